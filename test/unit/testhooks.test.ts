/**
 * The test-only holds (src/runtime/testhooks.ts) that real-process tests use to catch a request
 * in a phase: a hold waits its time; a new spec that leaves a point out releases the requests
 * waiting there at once, one that keeps it does not; an abort ends a wait. The port a process
 * starts with comes from PDSERVE_TEST_HOLDS; without it nothing waits and no route is served.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { noTestHooks, testHooksFromEnv, TestHolds } from '../../src/runtime/testhooks.js';

/** 'resolved' if `p` has resolved after `ms`, else 'pending'. */
async function settles(p: Promise<void>, ms: number): Promise<'resolved' | 'pending'> {
  let done = false;
  void p.then(() => (done = true));
  await new Promise((r) => setTimeout(r, ms));
  return done ? 'resolved' : 'pending';
}

test('a hold waits; clearing its point releases it at once, changing another point does not', async () => {
  const holds = testHooksFromEnv({ PDSERVE_TEST_HOLDS: 'on' });
  assert.ok(holds instanceof TestHolds && holds.enabled);
  const hold = holds.hold.bind(holds);
  const setHolds = holds.set.bind(holds);
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

test('the production port: unset or empty PDSERVE_TEST_HOLDS gives noTestHooks (nothing waits, no route)', async () => {
  assert.equal(testHooksFromEnv({}), noTestHooks);
  assert.equal(testHooksFromEnv({ PDSERVE_TEST_HOLDS: '' }), noTestHooks);
  assert.equal(noTestHooks.enabled, false);
  assert.equal(await settles(noTestHooks.hold('prefill.save'), 0), 'resolved');
  const routes: string[] = [];
  noTestHooks.registerRoute({ post: (path) => routes.push(path) });
  assert.deepEqual(routes, []);
  // the on port serves the route, and the route sets the holds and answers who waits where
  const on = new TestHolds('prefill.save=30000');
  const handlers = new Map<string, (req: { body: unknown }) => Promise<unknown>>();
  on.registerRoute({ post: (path, h) => handlers.set(path, h) });
  const held = on.hold('prefill.save');
  assert.deepEqual(await handlers.get('/debug/test-holds')!({ body: 'prefill.save=30000,decode.load=5' }), { holds: { 'prefill.save': 30000, 'decode.load': 5 }, waiting: { 'prefill.save': 1 } });
  assert.deepEqual(await handlers.get('/debug/test-holds')!({ body: '' }), { holds: {}, waiting: {} });
  assert.equal(await settles(held, 0), 'resolved');
});
