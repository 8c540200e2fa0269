/** The bench suite's engineer switches: PDSERVE_BENCH_KV_REPS is taken whole or refused, never shifted. */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { commitLabel, parseAgents, parseKvBigReps, parseKvReps } from '../../src/bench/suite.js';

describe('bench-suite: PDSERVE_BENCH_KV_REPS', () => {
  it('unset or empty: the suite default', () => {
    assert.equal(parseKvReps(undefined), undefined);
    assert.equal(parseKvReps(''), undefined);
    assert.equal(parseKvReps('  '), undefined);
  });
  it('four trial counts, one per size, in order', () => {
    assert.deepEqual(parseKvReps('30,30,8,6'), [30, 30, 8, 6]);
    assert.deepEqual(parseKvReps(' 1, 2 ,3,500'), [1, 2, 3, 500]);
  });
  it('anything else is refused instead of shifting the sizes', () => {
    // before: bad entries were dropped, so "30,0,8,6" ran 4 MiB 8 times and 64 MiB not at all
    for (const bad of ['30,0,8,6', '30,30,8', '30,30,8,6,6', '30,x,8,6', '1.5,2,3,4', '30,30,8,501', '-1,2,3,4', ',,,']) {
      assert.throws(() => parseKvReps(bad), /PDSERVE_BENCH_KV_REPS=.*give 4 trial counts/, bad);
    }
  });
});

describe('bench-suite: PDSERVE_BENCH_KV_BIG_REPS', () => {
  it('unset or empty: 3 trials per large size; two counts in order; anything else refused', () => {
    assert.deepEqual(parseKvBigReps(undefined), [3, 3]);
    assert.deepEqual(parseKvBigReps(' '), [3, 3]);
    assert.deepEqual(parseKvBigReps('5, 2'), [5, 2]);
    for (const bad of ['3', '3,3,3', '0,3', '3,51', 'x,3', '2.5,3']) assert.throws(() => parseKvBigReps(bad), /PDSERVE_BENCH_KV_BIG_REPS=.*give 2 trial counts/, bad);
  });
});

describe('bench-suite: PDSERVE_BENCH_AGENTS_SCALE_AGENTS', () => {
  it('unset or blank: the suite default; a comma list of concurrencies in order; anything else refused', () => {
    assert.equal(parseAgents(undefined), undefined);
    assert.equal(parseAgents(' '), undefined);
    assert.deepEqual(parseAgents('8'), [8]);
    assert.deepEqual(parseAgents(' 8, 30'), [8, 30]);
    for (const bad of ['0', '65', '8,x', '2.5', '8,,30', '-8']) assert.throws(() => parseAgents(bad), /PDSERVE_BENCH_AGENTS_SCALE_AGENTS=.*give concurrencies/, bad);
  });
});

describe('bench-suite: the commit a run names', () => {
  it("main's hash on main; main's hash + N branch commits on a branch; + uncommitted changes when the code differs from every commit", () => {
    assert.equal(commitLabel({ head: 'abc1234', base: 'abc1234', ahead: 0, dirty: false }), 'abc1234');
    assert.equal(commitLabel({ head: 'fff0000', base: 'abc1234', ahead: 1, dirty: false }), 'abc1234 + 1 branch commit');
    assert.equal(commitLabel({ head: 'fff0000', base: 'abc1234', ahead: 3, dirty: true }), 'abc1234 + 3 branch commits + uncommitted changes');
    assert.equal(commitLabel({ head: 'abc1234', base: 'abc1234', ahead: 0, dirty: true }), 'abc1234 + uncommitted changes');
    assert.equal(commitLabel({ head: 'abc1234', ahead: 0, dirty: false }), 'abc1234', 'no local main');
  });
});
