import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import fc from 'fast-check';
import { blockHashes, blockRoot, commonRun, leadingRun } from '../../src/protocol/token-blocks.js';

const tokens = (n: number) => fc.array(fc.integer({ min: 0, max: 1 << 20 }), { minLength: n, maxLength: n + 200 });

describe('token blocks', () => {
  test('one hash per whole block, a partial last block names nothing', () => {
    assert.equal(blockHashes([1, 2, 3], 4).length, 0);
    assert.equal(blockHashes(Array.from({ length: 33 }, (_, i) => i), 16).length, 2);
    assert.equal(blockHashes(Array.from({ length: 64 }, (_, i) => i), 16, undefined, 3).length, 3);
    assert.throws(() => blockHashes([1], 0), /out of range/);
  });

  test('hashes are safe integers and deterministic', () => {
    fc.assert(fc.property(tokens(0), fc.integer({ min: 1, max: 64 }), (t, b) => {
      const a = blockHashes(t, b);
      assert.deepEqual(a, blockHashes(t, b));
      for (const h of a) assert.ok(Number.isSafeInteger(h) && h >= 0);
    }));
  });

  test('chained: two prompts share exactly the blocks of their common whole-block prefix', () => {
    fc.assert(fc.property(tokens(0), tokens(0), fc.integer({ min: 1, max: 32 }), (p, q, b) => {
      const shared = p.findIndex((t, i) => t !== q[i]);
      const common = shared < 0 ? Math.min(p.length, q.length) : Math.min(shared, q.length);
      const run = commonRun(blockHashes(p, b), blockHashes(q, b));
      assert.equal(run, Math.floor(common / b));
    }), { numRuns: 300 });
  });

  test('a block hash depends on every earlier block (same block after different prefixes differs)', () => {
    const blk = [7, 7, 7, 7];
    const a = blockHashes([1, 2, 3, 4, ...blk], 4);
    const b = blockHashes([1, 2, 3, 5, ...blk], 4);
    assert.notEqual(a[1], b[1]);
  });

  test('the salt roots the chain: tenants never match each other, no salt is its own tenant', () => {
    fc.assert(fc.property(tokens(16), fc.string(), fc.string(), (t, s1, s2) => {
      fc.pre(s1 !== s2);
      assert.notEqual(blockHashes(t, 16, s1)[0], blockHashes(t, 16, s2)[0]);
      assert.notEqual(blockHashes(t, 16, s1)[0], blockHashes(t, 16)[0]);
    }));
    assert.notEqual(blockRoot(''), blockRoot(undefined));
  });

  test('no collisions among 200k distinct one-block prompts', () => {
    const seen = new Set<number>();
    for (let i = 0; i < 200_000; i++) seen.add(blockHashes([i, i >> 3, 5, 9], 4)[0]!);
    assert.equal(seen.size, 200_000);
  });

  test('leadingRun stops at the first block not held', () => {
    const h = blockHashes(Array.from({ length: 64 }, (_, i) => i), 16);
    assert.equal(leadingRun(h, (x) => x !== h[2]), 2);
    assert.equal(leadingRun(h, () => true), 4);
    assert.equal(leadingRun(h, (x) => x !== h[0]), 0);
  });
});
