/**
 * A full state directory (src/runtime/state-space.ts): when a failed write counts as "full",
 * how long the condition holds (until the free space covers what the write needed, or a write
 * succeeds), one failure counted once; and the router's answer when every live worker of a role
 * is degraded (src/router/attempts.ts `degradedError`): 507 `state_dir_full` at once.
 */
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { test } from 'node:test';
import client from 'prom-client';
import { nodeSpaceProbe, STATE_DIR_MARGIN_BYTES, StateSpace, type SpaceProbe } from '../../src/runtime/state-space.js';
import { degradedError } from '../../src/router/attempts.js';
import type { WorkerState } from '../../src/router/worker-state.js';

const MiB = 1 << 20;

function fake(free: number, files: Record<string, number> = {}): SpaceProbe & { free: number } {
  const p = {
    free,
    freeBytes: () => p.free,
    fileBytes: (f: string) => files[f] ?? 0,
  };
  return p;
}

test('ENOSPC is full whatever the free space; another error only when under the margin right after it', () => {
  const p = fake(100 * MiB);
  const s = new StateSpace('/x', p);
  assert.equal(s.judge(Object.assign(new Error('write'), { code: 'EIO' })), false, 'an error with room to spare is not a full directory');
  assert.equal(s.condition(), undefined);
  assert.equal(s.judge(Object.assign(new Error('no space left on device, write'), { code: 'ENOSPC' })), true);
  assert.equal(s.refused, 1);
  const q = fake(4096, { '/x/partial': 3 * MiB });
  const t = new StateSpace('/x', q);
  assert.equal(t.judge(new Error('Failed to save state to file'), '/x/partial'), true, "llama.cpp's save says nothing of why: the free space does");
  const c = t.condition();
  assert.equal(c?.reason, 'state_dir_full');
  assert.match(c!.detail, /state directory \/x is full: 4096 bytes free, a state needs about 4194304/);
  assert.match(t.message('prefill'), /^prefill state directory \/x is full.*--state-dir/);
  const d = new StateSpace('/x', fake(0));
  assert.equal(d.judge(new Error('bad state: checksum'), undefined, true), false, 'errnoOnly: only ENOSPC counts');
  assert.equal(d.judge(new Error('state file I/O failed: ENOSPC: no space left on device, write'), undefined, true), true, "the I/O thread's message carries the errno");
});

test('the condition holds until the free space covers the failed write plus the margin, or a write succeeds; one error counted once', () => {
  const p = fake(0, { '/x/f': 2 * MiB });
  const s = new StateSpace('/x', p);
  const err = new Error('Failed to save state to file');
  assert.equal(s.judge(err, '/x/f'), true);
  p.free = 2.5 * MiB; // the partial file went away
  assert.equal(s.judge(err, '/x/f'), true, 'the same error judged again (the streamed send saw it too): the same answer');
  assert.equal(s.refused, 1, 'and counted once');
  assert.ok(s.condition(), '2.5 MiB free < 2 MiB + margin');
  p.free = 2 * MiB + STATE_DIR_MARGIN_BYTES;
  assert.equal(s.condition(), undefined, 'space freed: over');
  assert.equal(s.judge(new Error('again'), '/x/f'), false, 'with room to spare a new error is not a full directory');
  p.free = 0;
  assert.equal(s.judge(new Error('again, full'), '/x/f'), true);
  s.ok(5 * MiB);
  assert.equal(s.condition(), undefined, 'a good write ends it');
  assert.equal(s.judge(new Error('after a 5 MiB state'), undefined), true);
  p.free = 5 * MiB;
  assert.ok(s.condition(), 'the last good state sets what a write needs: 5 MiB + margin');
});

test('metrics: pdserve_state_dir_full and pdserve_state_dir_full_total', async () => {
  const p = fake(0);
  const s = new StateSpace('/x', p);
  const r = new client.Registry();
  s.registerMetrics(r);
  s.judge(Object.assign(new Error('x'), { code: 'ENOSPC' }));
  const text = await r.metrics();
  assert.match(text, /^pdserve_state_dir_full 1$/m);
  assert.match(text, /^pdserve_state_dir_full_total 1$/m);
  p.free = 100 * MiB;
  assert.match(await r.metrics(), /^pdserve_state_dir_full 0$/m);
});

test('the real probe: statfs of a folder, the size of a file, 0 for a missing one', () => {
  const dir = mkdtempSync(path.join(os.tmpdir(), 'pdserve-space-'));
  try {
    writeFileSync(path.join(dir, 'f'), Buffer.alloc(1234));
    assert.equal(nodeSpaceProbe.fileBytes(path.join(dir, 'f')), 1234);
    assert.equal(nodeSpaceProbe.fileBytes(path.join(dir, 'missing')), 0);
    assert.ok((nodeSpaceProbe.freeBytes(dir) ?? -1) >= 0);
    assert.equal(nodeSpaceProbe.freeBytes(path.join(dir, 'missing')), undefined);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test('the router: every live worker of a role degraded by a full state directory → 507 state_dir_full at once; one fit or a down one → none', () => {
  const w = (role: 'prefill' | 'decode', o: Partial<WorkerState> = {}): WorkerState => ({ role, url: `http://${role}-${Math.random()}`, bootstrapHost: null, bootstrapPort: null, healthy: true, draining: false, model: null, load: 0, lastError: null, lastCheckAt: 0, consecutiveFailures: 0, settings: null, ...o });
  const full = 'state_dir_full: state directory /dev/shm is full';
  const e = degradedError({ workers: [w('prefill', { degraded: full }), w('decode')] });
  assert.equal(e?.code, 'state_dir_full');
  assert.equal(e?.status, 507);
  assert.match(e!.message, /no prefill worker can take the request: state_dir_full/);
  assert.equal(degradedError({ workers: [w('prefill', { degraded: full }), w('prefill'), w('decode')] }), undefined, 'another prefill is fit');
  assert.equal(degradedError({ workers: [w('prefill'), w('decode', { healthy: false })] }), undefined, 'a down decode: the request may wait for it');
  assert.equal(degradedError({ workers: [w('prefill'), w('decode', { degraded: 'other: x' })] })?.code, 'no_healthy_decode');
});
