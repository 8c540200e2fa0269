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
import { applyKvReply, KvEventConsumer, matchedBlocks, newClaims, PENDING_CLAIM_MS, type WorkerClaims } from '../../src/router/kv-events.js';
import { SequenceKvTracker } from '../../src/worker/kv-tracker.js';
import { blockHashes } from '../../src/protocol/token-blocks.js';

const ev = (kind: 'stored' | 'evicted', key: string, tier: 'sequence' | 'store' = 'store') => ({ kind, tier, key, tokens: 64, bytes: 100 });
const claims = (maxBlocks?: number): WorkerClaims => newClaims(maxBlocks);
const seq = (n: number, from = 0) => Array.from({ length: n }, (_, i) => from + i);

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
      // blocks: a prompt matches the longest run of its leading blocks the worker's entries name
      const prompt = seq(64);
      const h = blockHashes(prompt, 16);
      const now = 1_000_000;
      assert.equal(consumer.matchedTokens(url, () => h, now), 0);
      log.publish({ kind: 'stored', tier: 'sequence', key: 'b1', tokens: 32, bytes: 0, blocks: h.slice(0, 2) });
      await until(() => consumer.matchedTokens(url, () => h, now) === 32);
      // a round the router just finished there: its prompt blocks count until PENDING_CLAIM_MS pass
      consumer.expect(url, () => h, now);
      assert.equal(consumer.matchedTokens(url, () => h, now + 10), 64);
      assert.equal(consumer.matchedTokens(url, () => h, now + PENDING_CLAIM_MS), 32, 'a claim that never came is not assumed');
      log.publish({ kind: 'evicted', tier: 'sequence', key: 'b1', tokens: 32, bytes: 0 });
      await until(() => consumer.matchedTokens(url, () => h, now + PENDING_CLAIM_MS) === 0);
      assert.match(await reg.metrics(), /pdserve_router_kv_blocks 0/);
      // a worker that stops answering holds nothing
      await app.close();
      await until(() => consumer.held(url) === undefined);
    } finally {
      await consumer.close();
      await app.close();
    }
  });
});

describe('router: block claims', () => {
  test('entries share blocks by reference; an evicted entry leaves the blocks another still names; a gap, a restart, a resync', () => {
    const c = claims();
    const h = blockHashes(seq(80), 16); // 5 blocks
    applyKvReply(c, { epoch: 'e1', last: 0, events: [], snapshot: [], block_tokens: 16 });
    applyKvReply(c, { epoch: 'e1', last: 2, events: [
      { id: 1, kind: 'stored', tier: 'sequence', key: 'r1', tokens: 48, bytes: 0, blocks: h.slice(0, 3) },
      { id: 2, kind: 'stored', tier: 'store', key: 'r2', tokens: 80, bytes: 0, blocks: h },
    ] });
    assert.deepEqual([c.blockTokens, c.blocks.size, c.refs, matchedBlocks(c, h, 0)], [16, 5, 8, 5]);
    applyKvReply(c, { epoch: 'e1', last: 3, events: [{ id: 3, kind: 'evicted', tier: 'store', key: 'r2', tokens: 80, bytes: 0 }] });
    assert.deepEqual([c.blocks.size, matchedBlocks(c, h, 0)], [3, 3], 'r1 still names the first three');
    // a re-announced entry replaces its old blocks
    applyKvReply(c, { epoch: 'e1', last: 4, events: [{ id: 4, kind: 'stored', tier: 'sequence', key: 'r1', tokens: 16, bytes: 0, blocks: h.slice(0, 1) }] });
    assert.deepEqual([c.refs, matchedBlocks(c, h, 0)], [1, 1]);
    // a run stops at the first block not held, whatever comes after
    applyKvReply(c, { epoch: 'e1', last: 5, events: [{ id: 5, kind: 'stored', tier: 'sequence', key: 'x', tokens: 16, bytes: 0, blocks: [h[2]!] }] });
    assert.equal(matchedBlocks(c, h, 0), 1);
    // a gap drops every block; the snapshot rebuilds them
    assert.equal(applyKvReply(c, { epoch: 'e1', last: 9, events: [{ id: 9, kind: 'stored', tier: 'sequence', key: 'y', tokens: 16, bytes: 0, blocks: [h[1]!] }] }).outcome, 'gap');
    assert.deepEqual([c.blocks.size, c.refs, c.live], [0, 0, false]);
    applyKvReply(c, { epoch: 'e1', last: 9, events: [], snapshot: [{ tier: 'sequence', key: 'r1', tokens: 32, bytes: 0, blocks: h.slice(0, 2) }] });
    assert.deepEqual([matchedBlocks(c, h, 0), c.live], [2, true]);
    // a restarted worker: nothing of the old process counts, pending claims included
    c.pending.push({ at: 0, blocks: h });
    assert.equal(matchedBlocks(c, h, 1), 5);
    assert.equal(applyKvReply(c, { epoch: 'e2', last: 0, events: [], snapshot: [] }).outcome, 'restart');
    assert.deepEqual([c.blocks.size, matchedBlocks(c, h, 1)], [0, 0]);
  });

  test("a sequence serves another session's prompt only as the engine would give it: its whole run, or half of it when it is open to others", () => {
    const c = claims();
    const h = blockHashes(seq(160), 16); // 10 blocks
    const other = blockHashes([...seq(64), ...seq(96, 5000)], 16); // shares the first 4 blocks
    applyKvReply(c, { epoch: 'e', last: 1, events: [], snapshot: [{ tier: 'sequence', key: 'a', tokens: 160, bytes: 0, blocks: h, seq_tokens: 170, shared: false }], block_tokens: 16 });
    assert.equal(matchedBlocks(c, h, 0, undefined, 180), 10, 'its own continuation: the whole run, in a prompt holding the whole sequence');
    assert.equal(matchedBlocks(c, h, 0, undefined, 170), 0, 'another session\'s prompt of the same tokens: the engine keeps the paused state for its own');
    assert.equal(matchedBlocks(c, other, 0), 0, 'a paused session is not cut short for another prompt');
    applyKvReply(c, { epoch: 'e', last: 2, events: [{ id: 2, kind: 'stored', tier: 'sequence', key: 'a', tokens: 160, bytes: 0, blocks: h, seq_tokens: 170, shared: true }] });
    assert.equal(matchedBlocks(c, other, 0), 0, '4 blocks (64 tokens) keep less than half of 170');
    const half = blockHashes([...seq(96), ...seq(64, 5000)], 16);
    assert.equal(matchedBlocks(c, half, 0), 6, '96 tokens keep more than half');
    // a named session's pending round serves that session only
    c.pending.push({ at: 0, blocks: other, key: 'k:a' });
    assert.deepEqual([matchedBlocks(c, other, 1, 'k:a'), matchedBlocks(c, other, 1, 'k:b'), matchedBlocks(c, other, 1)], [other.length, 0, 0]);
  });

  test('the bound: block references past --kv-router-max-blocks are not kept (the entry is, without its blocks)', () => {
    const c = claims(4);
    const h = blockHashes(seq(96), 16);
    applyKvReply(c, { epoch: 'e', last: 2, events: [], snapshot: [
      { tier: 'sequence', key: 'a', tokens: 48, bytes: 0, blocks: h.slice(0, 3) },
      { tier: 'sequence', key: 'b', tokens: 96, bytes: 0, blocks: h },
    ] });
    assert.deepEqual([c.refs, c.refused, c.held.size, matchedBlocks(c, h, 0)], [3, 1, 2, 3]);
    assert.equal(c.held.get('sequence:b')!.blocks, undefined);
  });
});

/** An engine whose idle cache sequences are `idle` (mutated by the test): what SequenceKvTracker asks of it. */
function idleEngine(idle: number[][]) {
  return {
    reusableFor: (p: readonly number[]) => Math.max(0, ...idle.map((t) => { let i = 0; while (i < t.length && i < p.length - 1 && t[i] === p[i]) i++; return i; })),
    cachedStats: () => ({ sequences: idle.length, tokens: idle.reduce((n, t) => n + t.length, 0) }),
  };
}

describe('workers: per-block events from the engine itself', () => {
  test('a noted sequence is published with the blocks the engine would reuse, evicted when it no longer holds one', () => {
    const idle: number[][] = [];
    const engine = idleEngine(idle);
    const log = new KvEventLog({ blockTokens: 4 });
    const t = new SequenceKvTracker(engine as never, log, 4);
    try {
      const tokens = seq(13);
      assert.equal(t.noteFinished([1, 2, 3]), undefined, 'no whole block: nothing to name');
      const key = t.noteFinished(tokens)!;
      t.probe();
      assert.equal(log.last, 0, 'still busy: nothing held yet');
      idle.push(tokens);
      t.probe();
      const stored = log.read(log.epoch, 0).events;
      assert.deepEqual(stored.map((e) => [e.kind, e.tier, e.key, e.tokens]), [['stored', 'sequence', key, 12]]);
      assert.deepEqual(stored[0]!.blocks, blockHashes(tokens, 4), 'the hashes of the blocks held');
      assert.deepEqual([stored[0]!.seq_tokens, stored[0]!.shared], [13, true], 'the whole sequence, open to a prompt sharing half of it');
      assert.equal(log.read(log.epoch, 0).block_tokens, 4);
      t.probe();
      assert.equal(log.last, 1, 'no change, no event');
      idle.length = 0;
      idle.push(seq(9)); // the engine keeps only 8 tokens of it now: two blocks
      t.probe();
      assert.deepEqual(log.read(log.epoch, 1).events.map((e) => [e.kind, e.tokens, e.blocks?.length]), [['stored', 8, 2]]);
      idle.length = 0;
      idle.push([9, 9, 9]);
      t.probe();
      assert.deepEqual(log.read(log.epoch, 2).events.map((e) => [e.kind, e.key]), [['evicted', key]]);
      assert.deepEqual(t.held, []);
      // a salt roots the chain: another tenant's same tokens are other blocks
      assert.notEqual(t.noteFinished(tokens, 'tenant-b'), key);
    } finally {
      t.close();
    }
  });

  test('the next round supersedes the one it extends (evicted once the newer is published); the store tier serves what the sequences dropped', async () => {
    const idle: number[][] = [];
    let stored = 0;
    const engine = { ...idleEngine(idle), storedReusableFor: async () => stored };
    const log = new KvEventLog({ blockTokens: 4 });
    const t = new SequenceKvTracker(engine as never, log, 4);
    const kinds = (): string[] => log.read(log.epoch, 0).events.map((e) => `${e.kind}:${e.tier}:${e.tokens}`);
    try {
      const r1 = seq(9);
      t.noteFinished(r1);
      idle.push(r1);
      t.probe();
      assert.deepEqual(kinds(), ['stored:sequence:8']);
      const r2 = seq(17);
      t.noteFinished(r2);
      idle.length = 0;
      idle.push(r2);
      t.probe();
      assert.deepEqual(kinds(), ['stored:sequence:8', 'stored:sequence:16', 'evicted:sequence:8']);
      assert.equal(t.held.length, 1);
      // the sequences drop it; the host store holds it: announced again on the store tier
      idle.length = 0;
      stored = 16;
      t.probe();
      await new Promise((r) => setImmediate(r));
      t.probe();
      assert.deepEqual(kinds().slice(3), ['evicted:sequence:16', 'stored:store:16']);
    } finally {
      t.close();
    }
  });
});
