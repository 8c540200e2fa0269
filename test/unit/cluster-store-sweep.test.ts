/**
 * `up` makes its prefix store folder as `pdserve-cluster-store-<pid>-<random>` and, before it
 * makes one, removes those of clusters whose process is gone (a SIGKILLed `up` cannot remove its
 * own) unless a live process still uses them.
 */
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { test } from 'node:test';
import { sweepDeadClusterStores } from '../../src/up/cluster.js';

test("the folders of dead clusters go; a live cluster's, one a live process uses, and one named without a pid stay", (t) => {
  const parent = mkdtempSync(path.join(os.tmpdir(), 'pdserve-sweep-test-'));
  t.after(() => rmSync(parent, { recursive: true, force: true }));
  const dead = spawnSync(process.execPath, ['-e', '0']).pid!;
  const mk = (name: string, files: string[] = []) => {
    mkdirSync(path.join(parent, name));
    for (const f of files) writeFileSync(path.join(parent, name, f), 'x');
  };
  mk(`pdserve-cluster-store-${dead}-Ab12Cd`); // empty, as a killed `up` leaves it once its workers cleared their entries
  mk(`pdserve-cluster-store-${dead}-Ef34Gh`, [`pdserve-store-${'ab'.repeat(16)}.pdkv`, `pdserve-storeuser-${dead}-0011.pid`]);
  mk(`pdserve-cluster-store-${dead}-Ij56Kl`, [`pdserve-storeuser-${process.pid}-0022.pid`]); // a worker still running
  mk(`pdserve-cluster-store-${process.pid}-Mn78Op`); // a live cluster
  mk('pdserve-cluster-store-Qr90St'); // no pid in the name
  writeFileSync(path.join(parent, `pdserve-cluster-store-${dead}-file`), 'x'); // not a folder
  const removed = sweepDeadClusterStores(parent).map((d) => path.basename(d)).sort();
  assert.deepEqual(removed, [`pdserve-cluster-store-${dead}-Ab12Cd`, `pdserve-cluster-store-${dead}-Ef34Gh`]);
  assert.deepEqual(readdirSync(parent).sort(), [`pdserve-cluster-store-${dead}-Ij56Kl`, `pdserve-cluster-store-${dead}-file`, `pdserve-cluster-store-${process.pid}-Mn78Op`, 'pdserve-cluster-store-Qr90St'].sort());
  assert.deepEqual(sweepDeadClusterStores(path.join(parent, 'missing')), [], 'a parent that cannot be listed: nothing');
});
