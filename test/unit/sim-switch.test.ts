/**
 * Role switches in the simulator (src/sim/world.ts `requestSwitch`, the drain rule of
 * src/switch/drain.ts): one node per world is asked to switch at a random point — while a
 * prefill room's KV is still being read, while a decode-local request runs, with a rebuild that
 * fails midway — and no room wedges, nothing leaks, and no node is torn down with a request in
 * flight or a room live (`half_switched`). The planted bug (tear down once no request is in
 * flight, not waiting for the rooms) must be caught.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { runSeeds } from '../../src/sim/index.js';
import { drainedForSwitch } from '../../src/switch/drain.js';

const SEEDS = Number(process.env.PDSERVE_SIM_SWITCH_SEEDS ?? 300);

describe('simulator: role switches', () => {
  test('the drain rule: no request in flight and no live room', () => {
    assert.equal(drainedForSwitch({ inflight: 0, liveRooms: 0 }), true);
    assert.equal(drainedForSwitch({ inflight: 0, liveRooms: 1 }), false);
    assert.equal(drainedForSwitch({ inflight: 1, liveRooms: 0 }), false);
  });

  test(`${SEEDS} seeds with a switch each: no violation, and the interleavings that matter were reached`, async () => {
    const r = await runSeeds(1, SEEDS, { switches: true, log: null, printFailures: 1 });
    assert.deepEqual(r.failures.map((f) => [f.seed, f.violations.map((v) => `${v.kind}: ${v.detail}`).slice(0, 3)]), []);
    const t = r.totals;
    assert.ok(t.switches >= SEEDS / 3, `switches torn down and rebuilt: ${t.switches}`);
    assert.ok(t.switchWaitedRooms > 0, 'some switches waited for rooms with no request in flight (KV still read, a registration ahead of its request)');
    assert.ok(t.switchDuringLocal > 0, 'some switches were asked while a decode-local request ran');
    assert.ok(t.switchFailed > 0, 'some switches failed midway and rebuilt the old role');
    assert.ok(t.success > 0);
  });

  test('the planted bug (tear down once no request is in flight) is caught as half_switched', async () => {
    const r = await runSeeds(1, SEEDS, { switches: true, plantSwitchBug: true, log: null, printFailures: 0, maxFailures: 1 });
    assert.ok(r.failures.length > 0, 'a seed fails');
    assert.ok((r.violationsByKind.half_switched ?? 0) > 0, JSON.stringify(r.violationsByKind));
  });
});
