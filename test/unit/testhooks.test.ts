/**
 * The test-only holds (src/runtime/testhooks.ts) that real-process tests use to catch a request
 * in a phase: a hold waits its time; a new spec that leaves a point out releases the requests
 * waiting there at once, one that keeps it does not; an abort ends a wait.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';

// Holds are read from the environment when the module loads: enable them first.
process.env.PDSERVE_TEST_HOLDS = 'on';
const { hold, holdsEnabled, setHolds } = await import('../../src/runtime/testhooks.js');

/** 'resolved' if `p` has resolved after `ms`, else 'pending'. */
async function settles(p: Promise<void>, ms: number): Promise<'resolved' | 'pending'> {
  let done = false;
  void p.then(() => (done = true));
  await new Promise((r) => setTimeout(r, ms));
  return done ? 'resolved' : 'pending';
}

test('a hold waits; clearing its point releases it at once, changing another point does not', async () => {
  assert.equal(holdsEnabled, true);
  setHolds('prefill.save=30000,decode.load=30000');
  const save = hold('prefill.save');
  const load = hold('decode.load');
  assert.equal(await settles(save, 50), 'pending', 'held');
  setHolds('decode.load=30000');
  assert.equal(await settles(save, 50), 'resolved', 'a spec without prefill.save releases it');
  assert.equal(await settles(load, 50), 'pending', 'decode.load is kept: it waits on');
  setHolds('decode.load=10');
  assert.equal(await settles(load, 50), 'pending', 'a new time for a kept point does not shorten a wait under way');
  const ac = new AbortController();
  const aborted = hold('decode.load', ac.signal);
  ac.abort();
  assert.equal(await settles(aborted, 50), 'resolved', 'an abort ends the wait');
  setHolds('');
  assert.equal(await settles(load, 50), 'resolved', "'' clears every point");
  assert.equal(await settles(hold('prefill.save'), 0), 'resolved', 'no hold: no wait');
});
