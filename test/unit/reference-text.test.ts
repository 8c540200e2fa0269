/**
 * Source comments and docs are reference text: they name what the code does and why, not which
 * issue, session or fault letter of the project's history produced it (a newcomer cannot look
 * those up; history belongs in commit messages). This scans src/, docs/ and the top-level docs
 * for such labels.
 */
import assert from 'node:assert/strict';
import { readdirSync, readFileSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

const ROOT = fileURLToPath(new URL('../../', import.meta.url));
const LABELS: readonly RegExp[] = [/\bissue #\d+/i, /\bsessions? \d+(?:[–-]\d+)?\b/i, /\bsession-\d/i, /\bfaults? [a-f](?:[–-][a-f])?\b(?![-\w])/i];

function files(dir: string): string[] {
  return readdirSync(dir).flatMap((f) => {
    const p = join(dir, f);
    return statSync(p).isDirectory() ? files(p) : /\.(ts|js|mjs|md|html)$/.test(f) ? [p] : [];
  });
}

test('no development-history labels (issue #N, session N, fault a–f) in src, docs, README, BENCHMARKS, SECURITY', () => {
  const found: string[] = [];
  for (const f of [...files(join(ROOT, 'src')), ...files(join(ROOT, 'docs')), ...['README.md', 'BENCHMARKS.md', 'SECURITY.md'].map((x) => join(ROOT, x))]) {
    readFileSync(f, 'utf8')
      .split('\n')
      .forEach((line, i) => {
        for (const re of LABELS) if (re.test(line)) found.push(`${f.slice(ROOT.length)}:${i + 1}: ${line.trim().slice(0, 120)}`);
      });
  }
  assert.deepEqual(found, []);
});

test('the label patterns match what they are for', () => {
  for (const s of ['see issue #9', 'measured in session 6', 'sessions 5–6', 'session-5 notes', 'fault e', '(fault c)', 'faults b–f']) assert.ok(LABELS.some((re) => re.test(s)), s);
  for (const s of ['the session epoch', 'session affinity', 'a system fault answered 500', 'faultLeakFirstAck', 'x-session-id']) assert.ok(!LABELS.some((re) => re.test(s)), s);
});
