/**
 * Prefix cache: the pure policy (prefix-cache.ts) and the engine on the tiny model — reuse
 * gives the same greedy output as a cold run (deterministic mode, chunk-aligned reuse), across
 * a PD save/load too; an abort mid-prefill or mid-generation leaves no entry a later request
 * can read; eviction under pressure never fails an allocation.
 * Run: node --import tsx --test test/unit/prefix-cache.test.ts
 */
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { ensureModel } from '../../src/engine/gguf-writer.js';
import { loadEngine } from '../../src/engine/llama.js';
import { chooseSequence, commonPrefix, evictionOrder, evictionsForBudget, exactPrefixAfterPrompt, reusableTokens, runDelta, supersededStates, type CachedSequence } from '../../src/engine/prefix-cache.js';
import type { Engine, SamplingParams, Slot } from '../../src/engine/types.js';

const never = new AbortController().signal;
const greedy = (over: Partial<SamplingParams> = {}): SamplingParams => ({ temperature: 0, topP: 1, topK: 0, maxTokens: 12, stop: [], ignoreEos: true, ...over });
const seq = (index: number, tokens: number[], lastUsed: number, exactPrefix = tokens.length): CachedSequence => ({ index, tokens, exactPrefix, lastUsed });
const on = { enabled: true, align: null, maxTokens: 1000 };

describe('prefix cache policy', () => {
  it('common prefix and reusable tokens (last prompt token always evaluated; aligned to exact whole chunks)', () => {
    assert.equal(commonPrefix([1, 2, 3], [1, 2, 4]), 2);
    assert.equal(commonPrefix([], [1]), 0);
    assert.equal(reusableTokens([1, 2, 3, 4], 4, [1, 2, 3, 4], null), 3, 'full match keeps one token to evaluate');
    assert.equal(reusableTokens([1, 2, 3, 4, 5, 6, 7], 7, [1, 2, 3, 4, 5, 6, 9, 9], null), 6);
    assert.equal(reusableTokens([1, 2, 3, 4, 5, 6, 7], 4, [1, 2, 3, 4, 5, 6, 9, 9], 2), 4, 'capped at the exact prefix');
    assert.equal(reusableTokens([1, 2, 3, 4, 5, 6, 7], 6, [1, 2, 3, 4, 5, 9], 4), 4, 'rounded down to a chunk');
    assert.equal(reusableTokens([1, 2, 3], 3, [1, 2, 3, 4], 4), 0);
    assert.equal(reusableTokens([5], 1, [1], null), 0);
    assert.equal(exactPrefixAfterPrompt(37, 16), 32);
    assert.equal(exactPrefixAfterPrompt(32, 16), 32);
    assert.equal(exactPrefixAfterPrompt(37, null), 37);
  });

  it('chooses the longest reusable prefix, else an empty sequence, else the least recently used', () => {
    const free = [seq(0, [1, 2, 3, 4], 10), seq(1, [1, 2, 9], 20), seq(2, [], 0), seq(3, [7, 7], 5)];
    assert.deepEqual(pick(free, [1, 2, 3, 4, 5]), [0, 4]);
    assert.deepEqual(pick(free, [1, 2, 9, 9]), [1, 3]);
    assert.deepEqual(pick(free, [8, 8]), [2, 0], 'no match: the empty sequence');
    assert.deepEqual(pick(free, [1, 8, 8]), [2, 0], 'a short shared opening does not destroy a longer entry (1 of 4 tokens kept < 50 %)');
    assert.deepEqual(pick(free, [1, 2, 8, 8]), [1, 2], '2 of 3 kept: reused');
    assert.deepEqual(pick(free.filter((s) => s.index !== 2), [8, 8]), [3, 0], 'no empty one: LRU is evicted');
    assert.deepEqual(pick(free, undefined), [2, 0], 'no prompt (a state load): never a cached one while an empty one exists');
    assert.deepEqual(pick(free, [1, 2, 3, 4, 5], { ...on, enabled: false }), [2, 0], 'cache off: no reuse');
    assert.equal(chooseSequence([], [1], on), undefined);
    // ties: the more recently used wins
    assert.deepEqual(pick([seq(0, [1, 2, 3], 1), seq(1, [1, 2, 4], 2)], [1, 2, 5]), [1, 2]);
  });

  it('without a reusable prefix, keeps the busy sequences in as few runs of consecutive ids as it can (one ubatch per run)', () => {
    assert.equal(runDelta(new Set([2, 3]), 4), 0);
    assert.equal(runDelta(new Set([2, 4]), 3), -1);
    assert.equal(runDelta(new Set([2]), 7), 1);
    const busyPick = (free: CachedSequence[], busy: number[], prompt?: number[]) => chooseSequence(free, prompt, on, new Set(busy))!.seq.index;
    // a long-lived decode: every idle sequence holds a cache; LRU alone would take 9 (oldest)
    const allCached = [seq(0, [7], 50), seq(4, [7], 40), seq(9, [7], 10), seq(13, [7], 20)];
    assert.equal(busyPick(allCached, [1, 2, 3]), 4, 'next to the busy run 1–3, although 9 and 13 are older');
    assert.equal(busyPick(allCached, [1, 2, 3, 5]), 4, 'joining two runs beats extending one');
    assert.equal(busyPick(allCached, [6]), 9, 'no neighbour free: least recently used, as before');
    assert.equal(busyPick(allCached, []), 9, 'nothing busy: least recently used, as before');
    // empty sequences still come before cached ones; among them the neighbour of the busy run
    const mixed = [seq(0, [], 0), seq(5, [], 0), seq(3, [7], 10)];
    assert.equal(busyPick(mixed, [4]), 5, 'empty 5 next to busy 4, not the lowest empty index 0');
    assert.equal(busyPick(mixed, [8]), 0, 'no empty neighbour: lowest empty index');
    // a reusable prefix still wins over adjacency
    assert.equal(busyPick([seq(0, [1, 2, 3], 10), seq(4, [9], 5)], [3], [1, 2, 3, 4]), 0);
  });

  it('evicts beyond the token budget: superseded states first, then least recently used', () => {
    // 0 is a prefix of 1 (same salt): superseded, the first to go although 1 is older
    const idle = [seq(0, [1, 2, 3], 30), seq(1, [1, 2, 3, 4], 10), seq(2, [], 0), seq(3, [5, 6], 20)];
    const ev = (max: number, now?: number) => evictionsForBudget(idle, max, now).map((e) => `${e.seq.index}:${e.cause}`);
    assert.deepEqual(ev(9), []);
    assert.deepEqual(ev(8), ['0:superseded']);
    assert.deepEqual(ev(2), ['0:superseded', '1:lru']);
    assert.deepEqual(ev(0), ['0:superseded', '1:lru', '3:lru']);
  });
});

describe('retention rules', () => {
  const s = (index: number, tokens: number[], lastUsed: number, o: Partial<CachedSequence> = {}): CachedSequence => ({ index, tokens, exactPrefix: tokens.length, lastUsed, ...o });
  const order = (idle: CachedSequence[], now: number, align: number | null = null) => evictionOrder(idle, now, align).map((e) => `${e.seq.index}:${e.cause}`);

  it('supersede: turn M covers turn M-1 of the same salt (its prompt part; the reply is tokenized again next round)', () => {
    const turn1 = s(0, [1, 2, 3, 4, 50, 51], 10, { exactPrefix: 4 }); // prompt 1-4, reply 50 51
    const turn2 = s(1, [1, 2, 3, 4, 50, 52, 7, 8, 60], 20, { exactPrefix: 8 }); // the reply came back as 50 52
    assert.deepEqual([...supersededStates([turn1, turn2], null)].map((x) => x.index), [0], 'turn 1 superseded although its reply tail differs');
    assert.deepEqual([...supersededStates([turn1, { ...turn2, salt: 't:b' }], null)], [], "another salt's state supersedes nothing");
    assert.deepEqual([...supersededStates([turn1, s(1, [1, 2, 3, 9, 9, 9], 20)], null)], [], 'diverging inside the prompt: not covered');
    // deterministic: the newer state must hold the older's exact prefix exactly too
    assert.deepEqual([...supersededStates([s(0, [1, 2, 3, 4], 1, { exactPrefix: 4 }), s(1, [1, 2, 3, 4, 5, 6], 2, { exactPrefix: 2 })], 2)].map((x) => x.index), [1], 'the longer state whose exact part is shorter is the one covered');
    assert.deepEqual([...supersededStates([s(0, [1, 2, 3, 4], 1, { exactPrefix: 4 }), s(1, [1, 2, 3, 4, 5, 6], 2, { exactPrefix: 6 })], 2)].map((x) => x.index), [0]);
    // duplicates: exactly one of two identical states goes (the less recently used)
    assert.deepEqual([...supersededStates([s(0, [1, 2, 3], 5), s(1, [1, 2, 3], 9)], null)].map((x) => x.index), [0]);
    // superseded goes first even when the superseding state is older and LRU would pick another
    assert.deepEqual(order([s(5, [9, 9], 1), turn2, turn1], 0), ['0:superseded', '5:lru', '1:lru']);
  });

  it('a prefix shared by several diverging sessions is kept once (not superseded); a prefix of one line is', () => {
    const sys = s(0, [1, 2, 3, 4], 1);
    const a = s(1, [1, 2, 3, 4, 10, 11], 2);
    const b = s(2, [1, 2, 3, 4, 20, 21], 3);
    assert.deepEqual([...supersededStates([sys, a, b], null)], [], 'two sessions branch after it: the one copy new sessions start from');
    assert.deepEqual([...supersededStates([sys, a], null)].map((x) => x.index), [0], 'one session extends it: superseded');
    const a2 = s(3, [1, 2, 3, 4, 10, 11, 12], 4);
    assert.deepEqual([...supersededStates([sys, a, a2], null)].map((x) => x.index).sort(), [0, 1], 'a line, not a branch: both older states go first');
  });

  it('idle-session TTL: inside its window a state goes only after every other one; then the most recently used first (ttl_pressure)', () => {
    const paused = s(0, [1, 1], 10, { retainUntil: 10 + 1000 }); // an agent's session on a tool call
    const oneOff = s(1, [2, 2], 500); // a newer request without a session
    const other = s(2, [3, 3], 20, { retainUntil: 20 + 5000 });
    assert.deepEqual(order([paused, oneOff, other], 600), ['1:lru', '2:ttl_pressure', '0:ttl_pressure'], 'within TTL: the newer one-off goes first; under pressure the session that paused last (its next turn is the farthest), not the longest paused');
    assert.deepEqual(order([paused, oneOff, other], 2000), ['0:lru', '1:lru', '2:ttl_pressure'], 'past its TTL: plain LRU takes it');
    // priority (agent_hints.priority) inside the window: lower goes first, whatever the recency
    assert.deepEqual(order([s(0, [1], 2, { retainUntil: 100, priority: 50 }), s(1, [2], 1, { retainUntil: 900, priority: 10 })], 50), ['1:ttl_pressure', '0:ttl_pressure']);
    // the budget follows the same order
    assert.deepEqual(evictionsForBudget([paused, oneOff, other], 4, 600).map((e) => `${e.seq.index}:${e.cause}`), ['1:lru']);
  });

  it('allocation: an empty sequence, else superseded, else past its window, else inside it (ttl_pressure); a paused session is not cut short by another prompt', () => {
    const now = 600;
    const paused = s(0, [1, 2, 3, 4, 5, 6], 10, { retainUntil: 2000 });
    const oneOff = s(1, [7, 7], 500);
    const settings = { ...on, sessionTtlMs: 1000 };
    const c1 = chooseSequence([paused, oneOff], [8, 8, 8], settings, undefined, undefined, now)!;
    assert.deepEqual([c1.seq.index, c1.reuse, c1.evicts], [1, 0, 'lru'], 'the newer one-off state, not the older paused session');
    const c2 = chooseSequence([paused, oneOff], [8, 8, 8], settings, undefined, undefined, 3000)!;
    assert.deepEqual([c2.seq.index, c2.evicts], [0, 'lru'], 'past the TTL: LRU takes the session');
    // another session sharing 4 of its 6 tokens (≥ half): LRU would cut it to 4; inside its window it is not
    const c3 = chooseSequence([paused, oneOff], [1, 2, 3, 4, 9, 9], settings, undefined, undefined, now)!;
    assert.deepEqual([c3.seq.index, c3.evicts], [1, 'lru']);
    const c4 = chooseSequence([paused, oneOff], [1, 2, 3, 4, 9, 9], settings, undefined, undefined, 3000)!;
    assert.deepEqual([c4.seq.index, c4.reuse, c4.evicts], [0, 4, undefined], 'past its window: reused and cut, as before');
    // its own next turn still reuses it inside the window
    const c5 = chooseSequence([paused, oneOff], [1, 2, 3, 4, 5, 6, 9], settings, undefined, undefined, now)!;
    assert.deepEqual([c5.seq.index, c5.reuse], [0, 6]);
    // everything inside its window: the most recently used goes, keeping what the prompt shares with it
    const c6 = chooseSequence([paused, s(1, [1, 2, 9, 9, 9, 9], 500, { retainUntil: 1500 })], [1, 2, 3, 4, 9, 9], settings, undefined, undefined, now)!;
    assert.deepEqual([c6.seq.index, c6.reuse, c6.evicts], [1, 2, 'ttl_pressure']);
    // a superseded state goes before a past-window one
    const c7 = chooseSequence([oneOff, s(2, [1, 2, 3], 900), s(3, [1, 2, 3, 4], 50)], [8, 8], settings, undefined, undefined, now)!;
    assert.deepEqual([c7.seq.index, c7.evicts], [2, 'superseded']);
  });
});

function pick(free: CachedSequence[], prompt: number[] | undefined, settings = on): [number, number] {
  const c = chooseSequence(free, prompt, settings)!;
  return [c.seq.index, c.reuse];
}

describe('prefix cache on the tiny model', () => {
  const BATCH = 16;
  const dir = mkdtempSync(path.join(os.tmpdir(), 'pdserve-prefix-test-'));
  let cached: Engine; // deterministic, prefix cache on (1 slot + 1 cache sequence)
  let cold: Engine; // deterministic, no cache: the reference
  let loose: Engine; // prefix cache on, not deterministic: whole-prefix reuse
  let model: string;

  before(async () => {
    model = await ensureModel('tiny', 1, path.join(dir, 'cache'));
    const base = { modelPath: model, contextSize: 1024, batchSize: BATCH, deterministic: true };
    cached = await loadEngine({ ...base, sequences: 1, prefixCache: { cacheSequences: 1, maxTokens: 4096 } });
    cold = await loadEngine({ ...base, sequences: 1 });
    loose = await loadEngine({ ...base, deterministic: false, sequences: 1, prefixCache: { cacheSequences: 0, maxTokens: 4096 } });
  });
  after(async () => {
    await cached?.dispose();
    await cold?.dispose();
    await loose?.dispose();
    rmSync(dir, { recursive: true, force: true });
  });

  async function run(e: Engine, prompt: number[], sp = greedy(), signal = never): Promise<{ tokens: number[]; cached: number; slot: number }> {
    const s = e.tryAcquireSlot(prompt)!;
    try {
      const r = await s.prefill(prompt, sp, signal);
      const out = [r.firstToken];
      for await (const t of s.generate(r.firstToken, sp, signal)) if (out.length < sp.maxTokens) out.push(t.token);
      return { tokens: out.slice(0, sp.maxTokens), cached: r.cachedTokens, slot: s.index };
    } finally {
      s.release();
    }
  }

  it('multi-round conversation: output with reuse equals output without; reuse is whole chunks', async () => {
    const messages = [{ role: 'system' as const, content: 'You are a careful agent. Answer in short sentences about the state of the data.' }];
    let cachedTotal = 0;
    for (let round = 1; round <= 5; round++) {
      messages.push({ role: 'user', content: `Round ${round}: the tool returned ${'value '.repeat(round * 2)}done.` } as never);
      const prompt = cached.renderChat(messages);
      const a = await run(cached, prompt);
      const b = await run(cold, prompt);
      assert.deepEqual(a.tokens, b.tokens, `round ${round}: reuse changed the output`);
      assert.equal(b.cached, 0);
      assert.equal(a.cached % BATCH, 0, 'deterministic reuse is chunk-aligned');
      if (round > 1) assert.ok(a.cached > 0, `round ${round}: nothing reused`);
      cachedTotal += a.cached;
      messages.push({ role: 'assistant', content: cached.detokenize(a.tokens) } as never);
    }
    assert.ok(cachedTotal > 0);
    assert.ok(cached.cachedStats().tokens > 0);
  });

  it('non-deterministic mode reuses the whole common prefix (all but the last prompt token)', async () => {
    const p = loose.tokenize('the state stream of the model is data. '.repeat(6));
    const first = await run(loose, p);
    assert.equal(first.cached, 0);
    const again = await run(loose, p);
    assert.equal(again.cached, p.length - 1);
    assert.deepEqual(again.tokens, first.tokens);
    const longer = [...p, ...loose.tokenize(' and more')];
    const third = await run(loose, longer);
    assert.ok(third.cached >= p.length, `reused ${third.cached} of ${longer.length}`);
  });

  it('PD with reuse: a state saved after a cached prefill loads elsewhere and generates what a cold run does', async () => {
    const p1 = cached.tokenize('alpha beta gamma delta '.repeat(8));
    const p2 = [...p1, ...cached.tokenize(' epsilon zeta eta theta iota kappa')];
    await run(cached, p1);
    const s = cached.tryAcquireSlot(p2)!;
    const r = await s.prefill(p2, greedy(), never);
    assert.ok(r.cachedTokens > 0);
    const file = path.join(dir, 'reuse.ggsq');
    await s.saveState(file);
    s.release();
    const d = cold.tryAcquireSlot()!;
    await d.loadState(file, p2);
    const got = [r.firstToken];
    for await (const t of d.generate(r.firstToken, greedy(), never)) if (got.length < 12) got.push(t.token);
    d.release();
    const ref = await run(cold, p2);
    assert.deepEqual(got.slice(0, 12), ref.tokens);
  });

  it('an abort mid-prefill leaves no cache entry; a later round evaluates in full and matches the cold run', async () => {
    const e = await loadEngine({ modelPath: model, contextSize: 512, batchSize: BATCH, deterministic: true, sequences: 1, prefixCache: { cacheSequences: 0, maxTokens: 4096 } });
    try {
      const p = e.tokenize('one two three four five six seven eight nine ten '.repeat(8));
      assert.ok(p.length > BATCH * 6);
      const ac = new AbortController();
      const s = e.tryAcquireSlot(p)!;
      const pr = s.prefill(p, greedy(), ac.signal);
      setImmediate(() => ac.abort());
      await assert.rejects(pr, { code: 'ABORTED' });
      s.release();
      assert.deepEqual(e.cachedStats(), { sequences: 0, tokens: 0 }, 'the half-written sequence was dropped');
      const after1 = await run(e, p);
      assert.equal(after1.cached, 0);
      assert.deepEqual(after1.tokens, (await run(cold, p)).tokens);

      // an aborted generation does not leave an entry either
      const ac2 = new AbortController();
      const s2 = e.tryAcquireSlot(p)!;
      const r2 = await s2.prefill(p, greedy({ maxTokens: 100 }), never);
      assert.ok(r2.cachedTokens > 0, 'the completed round above was cached');
      let n = 0;
      for await (const _t of s2.generate(r2.firstToken, greedy({ maxTokens: 100 }), ac2.signal)) if (++n === 3) ac2.abort();
      s2.release();
      assert.equal(e.cachedStats().tokens, 0);
      assert.equal((await run(e, p)).cached, 0);
    } finally {
      await e.dispose();
    }
  });

  it('eviction under pressure never fails an allocation and keeps the token budget', async () => {
    const e = await loadEngine({ modelPath: model, contextSize: 256, batchSize: BATCH, sequences: 2, prefixCache: { cacheSequences: 2, maxTokens: 150 } });
    try {
      const runs: Promise<unknown>[] = [];
      for (let i = 0; i < 12; i++) {
        const p = e.tokenize(`request ${i} `.repeat(5 + (i % 7)));
        const go = async (): Promise<void> => {
          let s: Slot | null = null;
          while (!(s = e.tryAcquireSlot(p))) await new Promise((r) => setTimeout(r, 2));
          try {
            const r = await s.prefill(p, greedy({ maxTokens: 4 }), never);
            for await (const _t of s.generate(r.firstToken, greedy({ maxTokens: 4 }), never));
          } finally {
            s.release();
          }
        };
        runs.push(go());
      }
      await Promise.all(runs);
      assert.ok(e.cachedStats().tokens <= 150, `budget exceeded: ${e.cachedStats().tokens}`);
      assert.ok(e.cachedStats().sequences >= 1);
      assert.equal(e.slotsFree(), 2, 'two slots at most are busy; the cache sequences never count as free slots');
    } finally {
      await e.dispose();
    }
  });

  it('on the engine: a session state inside its window outlives a newer one-off; each slot records what it evicted and why; counted by cause', async () => {
    const e = await loadEngine({ modelPath: model, contextSize: 512, batchSize: BATCH, sequences: 1, prefixCache: { cacheSequences: 1, maxTokens: 4096, sessionTtlMs: 60_000 } });
    try {
      const go = async (prompt: number[], retention?: { session?: boolean; ttlMs?: number; priority?: number }) => {
        const s = e.tryAcquireSlot(prompt, undefined, retention)!;
        try {
          const r = await s.prefill(prompt, greedy({ maxTokens: 2 }), never);
          for await (const _t of s.generate(r.firstToken, greedy({ maxTokens: 2 }), never));
          return { cached: r.cachedTokens, slot: s };
        } finally {
          s.release();
        }
      };
      const session = e.tokenize('the agent reads the file and plans the change. '.repeat(4));
      await go(session, { session: true });
      await go(e.tokenize('one-off question number one about the weather. '.repeat(3)));
      const second = await go(e.tokenize('one-off question number two about rivers and mills. '.repeat(3)));
      assert.deepEqual(second.slot.evicted?.map((x) => [x.tier, x.cause]), [['sequence', 'lru']], 'the one-off state went, not the session');
      const back = await go([...session, ...e.tokenize(' the tool returned ok.', false)], { session: true });
      assert.ok(back.cached >= BATCH, `the session kept its state (${back.cached} cached)`);
      assert.deepEqual(e.evictionStats?.().filter((x) => x.tier === 'sequence').map((x) => [x.cause, x.count]), [['lru', 1]]);
    } finally {
      await e.dispose();
    }
  });

  it('on the engine: reusableFor counts what an evicted sequence shares; heldOnly counts only a state given as it is (a paused session is not open to another prompt)', async () => {
    const e = await loadEngine({ modelPath: model, contextSize: 512, batchSize: BATCH, sequences: 1, prefixCache: { cacheSequences: 1, maxTokens: 4096, sessionTtlMs: 60_000 } });
    try {
      const go = async (prompt: number[], retention?: { session?: boolean }) => {
        const s = e.tryAcquireSlot(prompt, undefined, retention)!;
        try {
          const r = await s.prefill(prompt, greedy({ maxTokens: 2 }), never);
          for await (const _t of s.generate(r.firstToken, greedy({ maxTokens: 2 }), never));
        } finally {
          s.release();
        }
      };
      const system = e.tokenize('You are a careful agent with tools. ');
      const session = [...system, ...e.tokenize('the agent reads the file and plans the change. '.repeat(4), false)];
      // both sequences hold a state: the paused session (inside its window) and a one-off sharing only the system prompt (under half of it)
      await go(session, { session: true });
      await go([...system, ...e.tokenize('one-off question about the weather and the mills by the river. '.repeat(3), false)]);
      const half = session.slice(0, Math.ceil(session.length / 2) + 1);
      assert.ok(e.reusableFor(half) >= system.length - 1, `taking the one-off's sequence would reuse the system prompt (${e.reusableFor(half)})`);
      assert.equal(e.reusableFor(half, undefined, true), 0, "the paused session's state is not given to another session's prompt");
      const next = [...session, ...e.tokenize(' the tool returned ok.', false)];
      assert.equal(e.reusableFor(next, undefined, true), e.reusableFor(next), "the session's own next turn gets its state as it is");
      assert.ok(e.reusableFor(next, undefined, true) >= session.length - 1);
    } finally {
      await e.dispose();
    }
  });
});
