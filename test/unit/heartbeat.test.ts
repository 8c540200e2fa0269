/**
 * Heartbeat liveness (src/kv/heartbeat.ts) on an injected clock: a silent peer is lost after the
 * miss budget; a check that runs late because THIS process's event loop stalled (e.g. a
 * 3–5 s synchronous task) restarts the budget instead of blaming the peer.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { Heartbeat, STALL_FLOOR_MS } from '../../src/kv/heartbeat.js';

function clock(t = 1000) {
  return { t, nowMs() { return this.t; } };
}

test('a peer silent for the whole budget is lost; any byte restarts the budget', () => {
  const c = clock();
  const hb = new Heartbeat(1000, 2, c);
  assert.equal(hb.nextCheckInMs(), 2000);
  c.t += 1500;
  hb.received();
  c.t += 500; // the check fires on time, the peer spoke 500 ms ago
  assert.deepEqual(hb.check(), { k: 'ok' });
  assert.equal(hb.nextCheckInMs(), 1500);
  c.t += 1500;
  const v = hb.check();
  assert.equal(v.k, 'lost');
  assert.match((v as { reason: string }).reason, /peer silent for 2000 ms \(heartbeat 1000 ms, budget 2 intervals\)/);
});

test('our own event-loop stall is not the peer\'s silence (budget restarts, peer lost only one budget later)', () => {
  const c = clock();
  const hb = new Heartbeat(1000, 2, c);
  c.t += hb.nextCheckInMs() + 4000; // the check was due in 2 s; our loop was blocked 4 s longer
  const v = hb.check();
  assert.deepEqual(v, { k: 'stalled', lateMs: 4000 });
  // The peer now has a fresh budget from the end of our stall…
  assert.equal(hb.nextCheckInMs(), 2000);
  c.t += 1999;
  // (not yet due; a check here would be early, which the connection never does)
  c.t += 1;
  // …and a peer that stays silent after it is still found.
  assert.equal(hb.check().k, 'lost');
});

test('ordinary timer jitter is not a stall', () => {
  const c = clock();
  const hb = new Heartbeat(100, 2, c);
  c.t += hb.nextCheckInMs() + STALL_FLOOR_MS - 1;
  assert.equal(hb.check().k, 'lost', 'a late-but-not-stalled check still finds a silent peer');
});
