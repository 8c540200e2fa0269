/**
 * `pdserve bench-routers --save`: a run kept as BENCHMARKS.md §9's figures. Its own module: the
 * report (./report.ts) renders §9 from ./routers.ts, and saving re-renders through ./suite.ts.
 */
import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { REPO_ROOT } from './index.js';
import type { RoutersResult } from './routers.js';
import { gitCommit, renderOnly, SECTION_FILES } from './suite.js';

/**
 * Save a run as BENCHMARKS.md §9's figures (bench/results/s9-routers.json; the per-turn records
 * stay in `--json`) and re-render BENCHMARKS.md from this checkout's results.
 */
export function saveRoutersResult(r: RoutersResult): void {
  const dir = join(REPO_ROOT, 'bench', 'results');
  mkdirSync(dir, { recursive: true });
  const file = { section: 9, meta: { date: new Date().toISOString(), quick: false, commit: gitCommit(), seconds: Math.round(r.wallS), loadavg: r.loadavg }, result: { ...r, sessions: { ...r.sessions, turns: [] } } };
  writeFileSync(join(dir, SECTION_FILES[9]!), JSON.stringify(file, (_k, v: unknown) => (typeof v === 'number' && !Number.isFinite(v) ? null : v), 1) + '\n');
  renderOnly(dir, join(REPO_ROOT, 'bench', 'plots'), REPO_ROOT);
}
