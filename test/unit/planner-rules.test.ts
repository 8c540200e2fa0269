/**
 * The planner's rules (src/planner/rules.ts): Dynamo's easy-mode thresholds, hysteresis through
 * the donor's projected load, one change at a time, a floor of one worker per role.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { decide, decodeLoadOf, prefillLoadOf, type WorkerObservation } from '../../src/planner/rules.js';
import { gaugesOf } from '../../src/planner/planner.js';

const P = (url: string, queued: number, o: Partial<WorkerObservation> = {}): WorkerObservation => ({ url, role: 'prefill', routable: true, switchable: true, switching: false, queuedTokens: queued, contextTokens: 1000, running: null, preallocQueue: null, slots: 8, ...o });
const D = (url: string, used: number, queue = 0, o: Partial<WorkerObservation> = {}): WorkerObservation => ({ url, role: 'decode', routable: true, switchable: true, switching: false, queuedTokens: null, contextTokens: 1000, running: used, preallocQueue: queue, slots: 8, ...o });

describe('planner rules', () => {
  test('loads: queued tokens per context; slots used + waiting per slot', () => {
    assert.equal(prefillLoadOf([P('a', 1500), P('b', 500)]), 1);
    assert.equal(decodeLoadOf([D('c', 8, 4), D('d', 0)]), 12 / 16);
    assert.equal(prefillLoadOf([P('a', 1500, { routable: false })]), null);
  });

  test('prefill queue ≥ 1 context with idle decodes: the least busy decode flips to prefill', () => {
    const d = decide([P('a', 1200), D('c', 2), D('d', 1)], false);
    assert.equal(d.action, 'to_prefill');
    assert.equal(d.reason, 'prefill_queue_high');
    assert.equal(d.url, 'd');
  });

  test('decode over its slots with an idle prefill pool: a prefill flips to decode', () => {
    const d = decide([P('a', 0), P('b', 50), D('c', 8, 3)], false);
    assert.equal(d.action, 'to_decode');
    assert.equal(d.reason, 'decode_kv_high');
    assert.equal(d.url, 'a');
  });

  test('just under the up thresholds (0.99 prefill, exactly 1.0 decode): hold steady', () => {
    assert.equal(decide([P('a', 990), D('c', 1), D('d', 1)], false).reason, 'steady');
    assert.equal(decide([P('a', 0), P('b', 0), D('c', 8, 0)], false).reason, 'steady');
  });

  test('hysteresis: a donor at or above its down threshold, or one that would go over its up threshold, gives nothing', () => {
    // decode at 0.6 (≥ down 0.6): busy
    assert.equal(decide([P('a', 2000), D('c', 5), D('d', 5, 0, { slots: 8 })], false).reason, 'donor_busy');
    // prefill at 0.1 of its contexts: busy
    assert.equal(decide([P('a', 100), P('b', 100), D('c', 8, 4)], false).reason, 'donor_busy');
    // decode at 0.5: the least busy decode goes, the other takes the rest within its slots (5/10)
    assert.equal(decide([P('a', 2000), D('c', 4, 0), D('d', 4, 1, { slots: 10 })], false).action, 'to_prefill');
  });

  test('a floor of one worker per role; both high holds; non-switchable workers are never picked', () => {
    assert.equal(decide([P('a', 5000), D('c', 0)], false).reason, 'floor');
    assert.equal(decide([P('a', 0), D('c', 8, 8)], false).reason, 'floor');
    assert.equal(decide([P('a', 5000), D('c', 8, 8), D('d', 8, 8)], false).reason, 'both_high');
    assert.equal(decide([P('a', 5000), D('c', 0, 0, { switchable: false }), D('d', 0, 0, { switchable: false })], false).reason, 'no_switchable');
  });

  test('observe only while a change is in flight (the planner\'s own, or a worker switching)', () => {
    assert.equal(decide([P('a', 5000), D('c', 0), D('d', 0)], true).reason, 'change_in_flight');
    assert.equal(decide([P('a', 5000), D('c', 0), D('d', 0, 0, { switching: true, routable: false })], false).reason, 'change_in_flight');
  });

  test('no gauges: no_data, never a flip', () => {
    assert.equal(decide([P('a', 5000, { queuedTokens: null }), D('c', 0), D('d', 0)], false).reason, 'no_data');
  });

  test('gaugesOf sums a metric over its label sets and skips comments', () => {
    const g = gaugesOf('# HELP x y\n# TYPE x gauge\npdserve_engine_slots 8\npdserve_decode_running_reqs{a="1"} 2\npdserve_decode_running_reqs{a="2"} 3\nother 1\n', ['pdserve_engine_slots', 'pdserve_decode_running_reqs']);
    assert.deepEqual([...g], [['pdserve_engine_slots', 8], ['pdserve_decode_running_reqs', 5]]);
  });
});
