/**
 * The stale state-file sweep (src/runtime/statefiles.ts) on real files and real processes: files
 * whose owner pid is dead go, files of a live owner and files that are not ours stay — including
 * the bench's names (kind with a dash) and same-host probe files.
 */
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, test } from 'node:test';
import { sweepStaleStateFiles } from '../../src/runtime/statefiles.js';

const dir = mkdtempSync(path.join(os.tmpdir(), 'pdserve-sweep-test-'));
after(() => rmSync(dir, { recursive: true, force: true }));

test('files of dead owners are swept (every kind of name we write); live owners\' and foreign files stay', async () => {
  const dead = spawnSync(process.execPath, ['-e', '0']).pid!; // exited and reaped
  const live = process.pid;
  const names = (pid: number) => [
    `pdserve-prefill-${pid}-123.ggsq`,
    `pdserve-prefill-${pid}-123-saved.ggsq`,
    `pdserve-decode-${pid}-456.ggsq`,
    `pdserve-restream-${pid}-0f0e.ggsq`,
    `pdserve-probe-${pid}-0123456789abcdef.nonce`,
    `pdserve-bench-kv-${pid}-64.ggsq`,
    `pdserve-bench-kvrecv-${pid}-1008.ggsq`,
    `pdserve-bench-probe-${pid}.bin`,
  ];
  for (const n of [...names(dead), ...names(live), 'other-123.ggsq', `pdserve-prefill-${dead}-1.txt`]) writeFileSync(path.join(dir, n), 'x');
  const removed = await sweepStaleStateFiles(dir);
  assert.equal(removed, names(dead).length);
  assert.deepEqual(readdirSync(dir).sort(), [...names(live), 'other-123.ggsq', `pdserve-prefill-${dead}-1.txt`].sort());
});
