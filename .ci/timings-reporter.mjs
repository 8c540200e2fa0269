/**
 * node:test reporter (`--test-reporter=./.ci/timings-reporter.mjs`): one line per test file with
 * its wall time and its top-level tests passed / failed, slowest first, then the total. `.ci/run`
 * writes it to `.ci/artifacts/test-timings.txt` (git-ignored) beside the usual report, so each CI run keeps the
 * per-file figures the time budget is checked against (docs/TESTING.md#budget).
 *
 * A file's time is the runner's own test for that file where it reports one (Node 20: the file's
 * process, start to exit); else the sum of its top-level tests' durations.
 */
import { relative } from 'node:path';

export default async function* timings(source) {
  /** file → { wall, sum, pass, fail } */
  const files = new Map();
  const of = (file) => {
    if (!files.has(file)) files.set(file, { wall: undefined, sum: 0, pass: 0, fail: 0 });
    return files.get(file);
  };
  for await (const e of source) {
    if (e.type !== 'test:pass' && e.type !== 'test:fail' && e.type !== 'test:complete') continue;
    const d = e.data;
    if (!d.file || d.nesting !== 0) continue;
    const f = of(d.file);
    const ms = d.details?.duration_ms ?? 0;
    if (d.name === d.file) {
      // the runner's test for the whole file; failed with no failed test in it: the file itself (a crash, a load error)
      f.wall = Math.max(f.wall ?? 0, ms);
      if (e.type === 'test:fail' && f.fail === 0) f.fail = 1;
      continue;
    }
    if (e.type === 'test:complete') continue; // counted by its test:pass / test:fail
    f.sum += ms;
    if (e.type === 'test:pass') f.pass++;
    else f.fail++;
  }
  const rows = [...files].map(([file, f]) => ({ file: relative(process.cwd(), file), s: (f.wall ?? f.sum) / 1000, pass: f.pass, fail: f.fail }));
  rows.sort((a, b) => b.s - a.s);
  const w = Math.max(4, ...rows.map((r) => r.file.length));
  yield `${'file'.padEnd(w)}  ${'seconds'.padStart(8)}  ${'passed'.padStart(6)}  ${'failed'.padStart(6)}\n`;
  for (const r of rows) yield `${r.file.padEnd(w)}  ${r.s.toFixed(1).padStart(8)}  ${String(r.pass).padStart(6)}  ${String(r.fail).padStart(6)}\n`;
  const total = rows.reduce((a, r) => a + r.s, 0);
  yield `${'total'.padEnd(w)}  ${total.toFixed(1).padStart(8)}  ${String(rows.reduce((a, r) => a + r.pass, 0)).padStart(6)}  ${String(rows.reduce((a, r) => a + r.fail, 0)).padStart(6)}\n`;
}
