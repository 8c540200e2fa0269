/** PairBlocks (src/router/pair-blocks.ts): a failed pair is out of the rotation for a backoff that doubles to 30 s; service clears it. */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { PairBlocks } from '../../src/router/pair-blocks.js';

test('a blocked pair is unusable for 1 s, doubling per failure to 30 s; other pairs are untouched; ok() clears it', () => {
  let now = 0;
  const b = new PairBlocks(() => now);
  assert.ok(b.usable('p', 'd'));
  assert.equal(b.block('p', 'd', 'peer_unreachable'), 1000);
  assert.equal(b.usable('p', 'd'), false);
  assert.ok(b.usable('p', 'd2'), 'another pair of the same prefill');
  now = 1000;
  assert.ok(b.usable('p', 'd'), 'the backoff over, one try goes through');
  const backoffs = [2, 3, 4, 5, 6, 7].map(() => b.block('p', 'd', 'peer_unreachable'));
  assert.deepEqual(backoffs, [2000, 4000, 8000, 16_000, 30_000, 30_000]);
  assert.deepEqual(b.snapshot(), [{ prefill: 'p', decode: 'd', code: 'peer_unreachable', retry_in_ms: 30_000 }]);
  b.ok('p', 'd');
  assert.ok(b.usable('p', 'd'));
  assert.equal(b.block('p', 'd', 'settings_mismatch'), 1000, 'after a success the backoff starts again');
});

test('forget(url): a worker back after a restart loses the blocks of its pairs, and only those', () => {
  let now = 0;
  const b = new PairBlocks(() => now);
  b.block('p1', 'd1', 'peer_unreachable');
  b.block('p1', 'd2', 'peer_unreachable');
  b.block('p2', 'd1', 'settings_mismatch');
  b.forget('p1');
  assert.ok(b.usable('p1', 'd1') && b.usable('p1', 'd2'));
  assert.equal(b.usable('p2', 'd1'), false, "another prefill's block stays");
  b.forget('d1');
  assert.ok(b.usable('p2', 'd1'));
  assert.deepEqual(b.snapshot(), []);
});
