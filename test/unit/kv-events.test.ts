/**
 * KV events: the worker's log (epoch, ids, ring, snapshot, long poll), the router's reply
 * application (gaps, restarts, resyncs) and the consumer over real HTTP (a worker app on a
 * socket that restarts with a new epoch: its claims vanish at once).
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import Fastify from 'fastify';
import { Registry } from 'prom-client';
import { KvEventLog } from '../../src/protocol/kv-events.js';
import { registerKvEventsRoute } from '../../src/worker/kv-events-route.js';
import { applyKvReply, KvEventConsumer, PENDING_CLAIM_MS, type WorkerClaims } from '../../src/router/kv-events.js';
import { SequenceKvTracker } from '../../src/worker/kv-tracker.js';

const ev = (kind: 'stored' | 'evicted', key: string, tier: 'sequence' | 'store' = 'store') => ({ kind, tier, key, tokens: 64, bytes: 100 });
const claims = (): WorkerClaims => ({ epoch: null, last: -1, held: new Map(), live: false, pending: new Map() });

describe('worker KV event log', () => {
  test('ids count from 1; events after an id; the snapshot for another epoch, an unknown id or dropped events', () => {
    const log = new KvEventLog({ maxEvents: 3 });
    log.publish(ev('stored', 'a'));
    log.publish(ev('stored', 'b'));
    log.publish(ev('evicted', 'a'));
    assert.deepEqual(log.read(log.epoch, 1).events.map((e) => [e.id, e.kind, e.key]), [[2, 'stored', 'b'], [3, 'evicted', 'a']]);
    assert.equal(log.read(log.epoch, 3).events.length, 0);
    assert.deepEqual(log.read('other', 1).snapshot?.map((e) => e.key), ['b']);
    assert.ok(log.read(log.epoch, 9).snapshot, 'an id never issued');
    log.publish(ev('stored', 'c'));
    log.publish(ev('stored', 'd'));
    assert.ok(log.read(log.epoch, 1).snapshot, 'event 2 left the ring: resync');
    assert.deepEqual(log.read(log.epoch, 2).events.map((e) => e.id), [3, 4, 5]);
    assert.notEqual(new KvEventLog().epoch, log.epoch);
  });

  test('batches are bounded; the long poll ends on an event, its deadline or an abort', async () => {
    const log = new KvEventLog({ maxBatch: 2 });
    for (const k of ['a', 'b', 'c']) log.publish(ev('stored', k));
    const r = log.read(log.epoch, 0);
    assert.deepEqual([r.events.length, r.last, r.more], [2, 2, true]);
    const t0 = performance.now();
    const w = log.wait(3, 5000);
    setTimeout(() => log.publish(ev('stored', 'd')), 20);
    await w;
    assert.ok(performance.now() - t0 < 2000);
    await log.wait(4, 30);
    const ac = new AbortController();
    const p = log.wait(4, 5000, ac.signal);
    ac.abort();
    await p;
  });
});

describe('router: applying KV event replies', () => {
  test('snapshot, events in order, a gap drops the claims and asks for the snapshot, a new epoch drops everything', () => {
    const c = claims();
    assert.equal(applyKvReply(c, { epoch: 'e1', last: 2, events: [], snapshot: [{ tier: 'store', key: 'a', tokens: 1, bytes: 0 }] }).outcome, 'resync');
    assert.deepEqual([c.live, [...c.held.keys()], c.last], [true, ['store:a'], 2]);
    const ok = applyKvReply(c, { epoch: 'e1', last: 4, events: [{ id: 3, ...ev('stored', 'b') }, { id: 4, ...ev('evicted', 'a') }] });
    assert.deepEqual([ok.outcome, ok.applied.length, [...c.held.keys()]], ['ok', 2, ['store:b']]);
    assert.equal(applyKvReply(c, { epoch: 'e1', last: 6, events: [{ id: 6, ...ev('stored', 'c') }] }).outcome, 'gap');
    assert.deepEqual([c.live, c.held.size, c.last], [false, 0, -1]);
    applyKvReply(c, { epoch: 'e1', last: 6, events: [], snapshot: [{ tier: 'store', key: 'c', tokens: 1, bytes: 0 }] });
    assert.equal(applyKvReply(c, { epoch: 'e2', last: 1, events: [], snapshot: [{ tier: 'sequence', key: 'z', tokens: 1, bytes: 0 }] }).outcome, 'restart');
    assert.deepEqual([...c.held.keys()], ['sequence:z'], 'the old process held nothing any more');
  });
});

describe('router: following a worker over HTTP', () => {
  test('claims follow the events within one round trip; a restarted worker (new epoch) replaces them at once', async () => {
    const reg = new Registry();
    const consumer = new KvEventConsumer(reg, 300);
    let log = new KvEventLog();
    const app = Fastify();
    registerKvEventsRoute(app, { get epoch() { return log.epoch; }, read: (e: string | undefined, a: number) => log.read(e, a), wait: (a: number, ms: number, s?: AbortSignal) => log.wait(a, ms, s) } as unknown as KvEventLog);
    await app.listen({ host: '127.0.0.1', port: 0 });
    const url = `http://127.0.0.1:${(app.server.address() as { port: number }).port}`;
    const until = async (ok: () => boolean) => {
      const end = Date.now() + 3000;
      while (!ok()) {
        if (Date.now() > end) assert.fail('deadline');
        await new Promise((r) => setTimeout(r, 10));
      }
    };
    try {
      log.publish(ev('stored', 'a'));
      consumer.follow({ url });
      await until(() => consumer.held(url)?.has('store:a') === true);
      log.publish(ev('stored', 'b', 'sequence'));
      log.publish(ev('evicted', 'a'));
      await until(() => consumer.held(url)?.has('sequence:b') === true && !consumer.held(url)!.has('store:a'));
      // the process restarts: a new epoch with nothing of the old one
      log = new KvEventLog();
      log.publish(ev('stored', 'n'));
      await until(() => consumer.held(url)?.has('store:n') === true);
      assert.deepEqual([...consumer.held(url)!.keys()], ['store:n']);
      const text = await reg.metrics();
      assert.match(text, /pdserve_router_kv_resyncs_total\{reason="restart"\} 1/);
      assert.match(text, /pdserve_router_kv_events_consumed_total\{tier="sequence",kind="stored"\} 1/);
      // a round the router just finished there: unknown (not "not held") until the worker's
      // events speak of it, or PENDING_CLAIM_MS pass
      const now = 1_000_000;
      assert.equal(consumer.holds(url, 'k', now), false);
      consumer.expect(url, 'k', now);
      assert.equal(consumer.holds(url, 'k', now + 10), undefined);
      assert.equal(consumer.holds(url, 'k', now + PENDING_CLAIM_MS), false, 'a claim that never came is not assumed');
      consumer.expect(url, 'k', now);
      log.publish(ev('stored', 'k', 'sequence'));
      await until(() => consumer.holds(url, 'k', now) === true);
      log.publish(ev('evicted', 'k', 'sequence'));
      await until(() => consumer.holds(url, 'k', now) === false);
      // a worker that stops answering holds nothing
      await app.close();
      await until(() => consumer.held(url) === undefined);
    } finally {
      await consumer.close();
      await app.close();
    }
  });
});

describe('router: the freshest copy of a conversation', () => {
  test('an older round on one worker says false when another holds a later one, or the router just finished a round there', async () => {
    const consumer = new KvEventConsumer(new Registry(), 300);
    const logs = [new KvEventLog(), new KvEventLog()];
    const apps = logs.map((log) => {
      const app = Fastify();
      registerKvEventsRoute(app, log);
      return app;
    });
    const urls: string[] = [];
    for (const app of apps) {
      await app.listen({ host: '127.0.0.1', port: 0 });
      urls.push(`http://127.0.0.1:${(app.server.address() as { port: number }).port}`);
    }
    const until = async (ok: () => boolean) => {
      const end = Date.now() + 3000;
      while (!ok()) {
        if (Date.now() > end) assert.fail('deadline');
        await new Promise((r) => setTimeout(r, 10));
      }
    };
    const copy = (tokens: number) => ({ kind: 'stored' as const, tier: 'sequence' as const, key: 'k', tokens, bytes: 0 });
    const now = 5_000_000;
    const among = () => [...consumer.holdsAmong(urls, 'k', now).values()];
    try {
      for (const u of urls) consumer.follow({ url: u });
      logs[0]!.publish(copy(431)); // round r − 2 on worker 0
      logs[1]!.publish(copy(620)); // round r − 1 on worker 1
      await until(() => consumer.holds(urls[0]!, 'k', now) === true && consumer.holds(urls[1]!, 'k', now) === true);
      assert.deepEqual(among(), [false, true], 'the later round wins');
      logs[0]!.publish(copy(830)); // round r re-announced on worker 0
      await until(() => consumer.held(urls[0]!)?.get('sequence:k')?.tokens === 830);
      assert.deepEqual(among(), [true, false]);
      // the router finished round r + 1 on worker 1; its event is not here yet: worker 1 is the freshest
      consumer.expect(urls[1]!, 'k', now);
      assert.deepEqual(among(), [false, true]);
      assert.deepEqual([...consumer.holdsAmong(urls, 'k', now + PENDING_CLAIM_MS).values()], [true, false], 'a pending claim that never came does not count');
      assert.deepEqual([...consumer.holdsAmong(urls, 'other', now).values()], [false, false]);
    } finally {
      await consumer.close();
      for (const app of apps) await app.close();
    }
  });
});

/** An engine whose idle cache sequences are `idle` (mutated by the test): what SequenceKvTracker asks of it. */
function idleEngine(idle: number[][]) {
  return {
    reusableFor: (p: readonly number[]) => Math.max(0, ...idle.map((t) => { let i = 0; while (i < t.length && i < p.length - 1 && t[i] === p[i]) i++; return i; })),
    cachedStats: () => ({ sequences: idle.length, tokens: idle.reduce((n, t) => n + t.length, 0) }),
  };
}

describe('decode: the sequence tier, from the engine itself', () => {
  test('a noted conversation is published once the engine holds it, evicted when it no longer does', () => {
    const idle: number[][] = [];
    const engine = idleEngine(idle);
    const log = new KvEventLog();
    const t = new SequenceKvTracker(engine as never, log);
    try {
      t.noteFinished('k:a', [1, 2, 3, 4, 5, 6], 4);
      t.probe();
      assert.equal(log.last, 0, 'still busy: nothing held yet');
      idle.push([1, 2, 3, 4, 5]);
      t.probe();
      assert.deepEqual(log.read(log.epoch, 0).events.map((e) => [e.kind, e.tier, e.key]), [['stored', 'sequence', 'k:a']]);
      t.probe();
      assert.equal(log.last, 1, 'no change, no event');
      idle.length = 0;
      idle.push([9, 9, 9]);
      t.probe();
      assert.deepEqual(log.read(log.epoch, 1).events.map((e) => [e.kind, e.key]), [['evicted', 'k:a']]);
      assert.deepEqual(t.held, []);
    } finally {
      t.close();
    }
  });
  test("a conversation whose next round leased its sequence stays held, with no evicted/stored pair; released and gone, it is evicted", () => {
    const idle: number[][] = [];
    const engine = idleEngine(idle);
    const log = new KvEventLog();
    const t = new SequenceKvTracker(engine as never, log);
    const kinds = (): string[] => log.read(log.epoch, 0).events.map((e) => `${e.kind}:${e.tokens}`);
    try {
      t.noteFinished('k:a', [1, 2, 3, 4, 5, 6], 4);
      idle.push([1, 2, 3, 4, 5, 6]);
      t.probe();
      assert.deepEqual(kinds(), ['stored:6']);
      // round 2: its request leases the sequence (no longer idle) and ends normally
      t.noteLeased('k:a');
      idle.length = 0;
      t.probe();
      assert.deepEqual(t.held, ['k:a'], 'leased to the next round: still held');
      t.noteFinished('k:a', [1, 2, 3, 4, 5, 6, 7, 8, 9], 7);
      t.noteReleased('k:a');
      idle.push([1, 2, 3, 4, 5, 6, 7, 8, 9]);
      t.probe();
      assert.deepEqual(kinds(), ['stored:6', 'stored:9'], 'the longer copy announced, no evicted between');
      // round 3 aborted: released without a finish, and the engine dropped the sequence
      t.noteLeased('k:a');
      idle.length = 0;
      t.probe();
      assert.equal(log.last, 2);
      t.noteReleased('k:a');
      t.probe();
      assert.deepEqual(kinds(), ['stored:6', 'stored:9', 'evicted:9']);
      assert.deepEqual(t.held, []);
      t.noteLeased('k:unknown'); // not tracked: nothing to keep
      t.noteReleased('k:unknown');
      t.probe();
      assert.equal(log.last, 3);
    } finally {
      t.close();
    }
  });
});
