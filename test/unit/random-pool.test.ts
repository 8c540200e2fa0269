/**
 * The router's pooled random ids (src/router/random-pool.ts): right length and alphabet, no value
 * handed out twice across pool refills, and the rid / room / trace id generators built on it.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { randomHex, randomU64 } from '../../src/router/random-pool.js';
import { newRid, randomRoom } from '../../src/router/dispatch.js';
import { newTraceId } from '../../src/router/trace.js';
import { parseRoomId } from '../../src/base/room-id.js';

describe('random pool', () => {
  test('randomHex(n) is 2n lowercase hex digits; 3000 ids (several 4 KiB refills) are all distinct', () => {
    const seen = new Set<string>();
    for (let i = 0; i < 3000; i++) {
      const n = [8, 12, 16][i % 3]!;
      const h = randomHex(n);
      assert.match(h, new RegExp(`^[0-9a-f]{${2 * n}}$`));
      seen.add(h);
    }
    assert.equal(seen.size, 3000);
  });

  test('randomHex refuses a size the pool cannot serve whole (0, over 256, fractions) instead of a short id; 256 works', () => {
    for (const n of [0, -1, 257, 5000, 1.5]) assert.throws(() => randomHex(n), RangeError, `n = ${n}`);
    assert.equal(randomHex(256).length, 512);
  });

  test('randomU64 spans 64 bits and repeats nothing over refills', () => {
    const seen = new Set<bigint>();
    let high = 0;
    for (let i = 0; i < 2000; i++) {
      const v = randomU64();
      assert.ok(v >= 0n && v < 2n ** 64n);
      if (v >= 2n ** 63n) high++;
      seen.add(v);
    }
    assert.equal(seen.size, 2000);
    assert.ok(high > 800 && high < 1200, `top bit set in ${high} of 2000`);
  });

  test('rid, bootstrap room and trace id keep their formats', () => {
    assert.match(newRid('completion'), /^cmpl-[0-9a-f]{24}$/);
    assert.match(newRid('chat'), /^chatcmpl-[0-9a-f]{24}$/);
    assert.match(newTraceId(), /^[0-9a-f]{32}$/);
    for (let i = 0; i < 200; i++) {
      const room = randomRoom();
      assert.equal(parseRoomId(room), room, `room ${room} is a valid 63-bit id`);
    }
  });
});
