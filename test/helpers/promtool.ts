/**
 * `promtool check metrics` (Debian's `prometheus` package) on a Prometheus text exposition.
 * Where promtool is not installed the check cannot run: `checkMetrics` returns null and the caller
 * says so loudly (`reportMissingPromtool`); under CI (CI=true, where .ci/run installs it) that is a
 * failure, not a pass.
 */
import { spawnSync } from 'node:child_process';
import assert from 'node:assert/strict';
import type { TestContext } from 'node:test';

let found: string | null | undefined;

/** Path of promtool, or null when it is not on PATH. */
export function promtoolPath(): string | null {
  if (found !== undefined) return found;
  const r = spawnSync('sh', ['-c', 'command -v promtool'], { encoding: 'utf8' });
  found = r.status === 0 && r.stdout.trim() ? r.stdout.trim() : null;
  return found;
}

/** Run `promtool check metrics` on `text`: {ok, output}; null when promtool is missing. */
export function checkMetrics(text: string): { ok: boolean; output: string } | null {
  const bin = promtoolPath();
  if (!bin) return null;
  const r = spawnSync(bin, ['check', 'metrics'], { input: text, encoding: 'utf8', timeout: 20_000 });
  return { ok: r.status === 0, output: `${r.stdout}${r.stderr}`.trim() };
}

/** Loud notice that promtool is missing; fails the test under CI, where it must be installed. */
export function reportMissingPromtool(t: TestContext): void {
  const msg = 'promtool is NOT installed: the Prometheus format check did NOT run (apt-get install prometheus)';
  process.stderr.write(`\n!!!!! ${msg} !!!!!\n\n`);
  t.diagnostic(msg);
  assert.ok(!process.env.CI, `${msg}; CI must have it (.ci/install-tools)`);
}

/** Our own minimal naming check, which runs everywhere: a `*_total` family must be a counter. */
export function assertTotalsAreCounters(text: string): void {
  for (const m of text.matchAll(/^# TYPE (\S+) (\S+)$/gm)) {
    if (m[1]!.endsWith('_total')) assert.equal(m[2], 'counter', `${m[1]} ends in _total but is a ${m[2]}`);
  }
}
