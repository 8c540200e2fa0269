/**
 * Decode-local continuation: the lifecycle's local path (src/kv/lifecycle.ts `local_prefill`),
 * decode's decision (src/decode/local.ts), the router's hint (policy `localPrefillFor`), and the
 * engine on the tiny model: a decode engine keeps a loaded + generated sequence, a later round
 * evaluates only its suffix there and generates exactly what a cold run does (deterministic
 * mode), an abort mid-suffix leaves nothing a later round could read, and more conversations
 * than spare sequences never fail a request.
 * Run: node --import tsx --test test/unit/decode-local.test.ts
 */
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { ensureModel } from '../../src/engine/gguf-writer.js';
import { loadEngine } from '../../src/engine/llama.js';
import type { ChatMessage, Engine, SamplingParams, Slot } from '../../src/engine/types.js';
import { RoomTable } from '../../src/kv/lifecycle.js';
import { KVPoll, type Effect, type RoomFailure, type RoomId } from '../../src/kv/types.js';
import { localPrefill, planLocal } from '../../src/decode/local.js';
import { DecodeDriver, type DecodeAction } from '../../src/decode/driver.js';
import { GenerateRequestSchema } from '../../src/protocol/worker-protocol.js';
import { localPrefillFor, routingText, routingTextAfter } from '../../src/router/policy/index.js';
import { RouterTokenizer } from '../../src/router/tokens.js';
import { parseChatRequest, parseCompletionRequest, toWorkerRequest } from '../../src/api/parse.js';
import { tokenizeRequest } from '../../src/api/requests.js';
import { newRoomId } from '../../src/base/room-id.js';
import { Registry } from 'prom-client';

const T = { preallocMs: 400, bootstrapMs: 100, waitingMs: 600, transferIdleMs: 50 };
const F: RoomFailure = { code: 'request_aborted', detail: 'client' };
const id = (n: number) => String(n) as RoomId;
const kinds = (e: Effect[]) => e.map((x) => x.t).join(',');

describe('lifecycle: the decode-local path', () => {
  it('prealloc → local_prefill → WaitingForInput/local [start_local_prefill] → kv_done → Success [terminal], no peer effects', () => {
    const t = new RoomTable('decode', T);
    assert.deepEqual(t.create(id(1), 'r1', 0), []);
    assert.equal(kinds(t.apply(id(1), { t: 'local_prefill' }, 1)), 'start_local_prefill');
    const r = t.get(id(1))!;
    assert.equal(r.state, KVPoll.WaitingForInput);
    assert.equal(r.phase, 'local');
    assert.equal(r.deadlineAt, 1 + T.waitingMs);
    assert.equal(kinds(t.apply(id(1), { t: 'kv_done' }, 2)), 'terminal', 'no send_ack: there is no prefill');
    assert.equal(t.get(id(1))!.state, KVPoll.Success);
    assert.equal(kinds(t.apply(id(1), { t: 'kv_done' }, 3)), '', 'duplicate kv_done on Success is a no-op');
    assert.equal(t.stats.illegal, 0);
  });

  it('PD events on a local room are refused (illegal) and change nothing; local_prefill needs a peerless decode prealloc room', () => {
    const t = new RoomTable('decode', T);
    t.create(id(1), 'r1', 0);
    t.apply(id(1), { t: 'local_prefill' }, 1);
    for (const ev of [{ t: 'registered', peer: 'p' }, { t: 'kv_begin', totalBytes: 9 }, { t: 'progress', bytes: 1 }, { t: 'slot_reserved' }, { t: 'local_prefill' }] as const) {
      assert.equal(kinds(t.apply(id(1), ev, 2)), 'illegal', ev.t);
      assert.equal(t.get(id(1))!.phase, 'local');
    }
    // a PD room (with a prefill peer) cannot take the local path
    t.create(id(2), 'r2', 0, 'prefill:8998');
    assert.equal(kinds(t.apply(id(2), { t: 'local_prefill' }, 1)), 'illegal');
    assert.equal(t.get(id(2))!.phase, 'prealloc');
    // nor a prefill room, nor a local room past prealloc
    const p = new RoomTable('prefill', T);
    p.create(id(3), 'r3', 0);
    assert.equal(kinds(p.apply(id(3), { t: 'local_prefill' }, 1)), 'illegal');
  });

  it('abort, deadline and a late local_prefill: terminal exactly once, no notify_peer, late counted apart', () => {
    const t = new RoomTable('decode', T);
    t.create(id(1), 'r1', 0);
    t.apply(id(1), { t: 'local_prefill' }, 1);
    assert.equal(kinds(t.apply(id(1), { t: 'abort', from: 'client', failure: F }, 2)), 'terminal');
    assert.equal(kinds(t.apply(id(1), { t: 'kv_done' }, 3)), 'late', 'a suffix finishing after the abort');
    assert.equal(kinds(t.apply(id(1), { t: 'abort', from: 'router', failure: F }, 4)), '');
    // an abort while waiting for a slot: the slot that frees later is refused as late
    t.create(id(2), 'r2', 0);
    t.apply(id(2), { t: 'abort', from: 'router', failure: F }, 1);
    assert.equal(kinds(t.apply(id(2), { t: 'local_prefill' }, 2)), 'late');
    // the watchdog fails a local room whose suffix evaluation overran waitingMs
    t.create(id(3), 'r3', 0);
    t.apply(id(3), { t: 'local_prefill' }, 10);
    assert.equal(kinds(t.tick(10 + T.waitingMs - 1)), '');
    assert.equal(kinds(t.tick(10 + T.waitingMs)), 'expired,terminal');
    assert.equal(t.get(id(3))!.failure?.code, 'room_deadline_expired');
    assert.equal(t.stats.illegal, 0);
    assert.equal(t.stats.late, 2);
  });
});

describe('router: when to try decode-local', () => {
  const w = { url: 'http://d1', load: 0 };
  it('only on exact numbers: what the chosen decode lacks of the prompt, in tokens, within the limit', () => {
    assert.equal(localPrefillFor(256, 'cache_aware', { worker: w, reason: 'cache_hit', matchedTokens: 896 }, 1000), 256, 'lacks 104 tokens');
    assert.equal(localPrefillFor(256, 'cache_aware', { worker: w, reason: 'cache_hit', matchedTokens: 744 }, 1000), 256, 'lacks exactly 256');
    assert.equal(localPrefillFor(256, 'cache_aware', { worker: w, reason: 'cache_hit', matchedTokens: 736 }, 1000), undefined, 'lacks 264: PD');
    assert.equal(localPrefillFor(256, 'cache_aware', { worker: w, reason: 'affinity', matchedTokens: 0 }, 100), undefined, 'holds nothing of it: PD even for a short prompt');
    assert.equal(localPrefillFor(256, 'cache_aware', { worker: w, reason: 'cache_hit', matchedChars: 999 }, 1000), undefined, 'no exact match (an approximate tree hit): PD');
    assert.equal(localPrefillFor(256, 'cache_aware', { worker: w, reason: 'cache_hit', matchedTokens: 900 }, undefined), undefined, 'no router tokens: PD');
    assert.equal(localPrefillFor(256, 'cache_aware', { worker: w, reason: 'imbalanced', matchedTokens: 999 }, 1000), undefined, 'the imbalance guard wins');
    assert.equal(localPrefillFor(256, 'least_load', { worker: w, reason: 'least_load', matchedTokens: 999 }, 1000), undefined);
    assert.equal(localPrefillFor(0, 'cache_aware', { worker: w, reason: 'cache_hit', matchedTokens: 999 }, 1000), undefined, '0 = off');
    assert.equal(localPrefillFor(1, 'cache_aware', { worker: w, reason: 'cache_hit', matchedTokens: 1000 }, 1000), 1, 'a whole match still lacks the last token');
  });
  it('a finished round is remembered as the next round will send it', () => {
    const msgs = [{ role: 'user', content: 'hi' }];
    const next = routingText({ kind: 'chat', messages: [...msgs, { role: 'assistant', content: 'hello' }, { role: 'user', content: 'more' }] });
    assert.ok(next.startsWith(routingTextAfter({ kind: 'chat', messages: msgs }, 'hello')));
    assert.equal(routingTextAfter({ kind: 'completion', prompt: { text: 'ab' } }, 'cd'), 'abcd');
  });
});

describe('decode-local on the tiny model', () => {
  const BATCH = 16;
  const never = new AbortController().signal;
  const greedy = (over: Partial<SamplingParams> = {}): SamplingParams => ({ temperature: 0, topP: 1, topK: 0, maxTokens: 10, stop: [], ignoreEos: true, ...over });
  const dir = mkdtempSync(path.join(os.tmpdir(), 'pdserve-decode-local-test-'));
  let prefill: Engine; // no cache: PD without reuse's prefill
  let decode: Engine; // keeps finished sequences: 2 slots + 2 spare
  let cold: Engine; // the reference (colocated, no cache)
  let model: string;

  before(async () => {
    model = await ensureModel('tiny', 1, path.join(dir, 'cache'));
    const base = { modelPath: model, contextSize: 1024, batchSize: BATCH, deterministic: true };
    prefill = await loadEngine({ ...base, sequences: 1 });
    decode = await loadEngine({ ...base, sequences: 2, prefixCache: { cacheSequences: 2, maxTokens: 4096 } });
    cold = await loadEngine({ ...base, sequences: 1 });
  });
  after(async () => {
    await prefill?.dispose();
    await decode?.dispose();
    await cold?.dispose();
    rmSync(dir, { recursive: true, force: true });
  });

  it('the router tokenizes a request exactly as the workers do (chat with tools history, completion text, input ids)', async () => {
    const tok = new RouterTokenizer(model, { registry: new Registry() });
    await tok.start();
    try {
      const routing = { rid: 'r', bootstrapHost: 'h', bootstrapPort: 1, bootstrapRoom: newRoomId() };
      const requests = [
        parseChatRequest({ model: 'm', messages: [{ role: 'system', content: 'You are an agent. '.repeat(20) }, { role: 'user', content: 'Fix the build.' }, { role: 'assistant', content: 'Reading the log.' }, { role: 'user', content: 'tool result: exit 2' }] }),
        parseCompletionRequest({ model: 'm', prompt: 'Once upon a time '.repeat(30) }),
        parseCompletionRequest({ model: 'm', prompt: [1, 5, 9, 12] }),
      ];
      for (const parsed of requests) {
        const expected = tokenizeRequest(prefill, toWorkerRequest(parsed, routing));
        assert.deepEqual(Array.from((await tok.tokensOf(parsed)) ?? []), expected);
      }
    } finally {
      await tok.close();
    }
  });

  async function gen(s: Slot, first: number, sp: SamplingParams, signal = never): Promise<number[]> {
    const out: number[] = [];
    for await (const t of s.generate(first, sp, signal)) out.push(t.token);
    return out;
  }
  /** PD without reuse: prefill evaluates, saves; decode loads and generates (and keeps the sequence). */
  async function pd(prompt: number[], n: number): Promise<number[]> {
    const s = prefill.tryAcquireSlot()!;
    const r = await s.prefill(prompt, greedy(), never);
    const file = path.join(dir, `pd-${n}.ggsq`);
    await s.saveState(file);
    s.release();
    const d = decode.tryAcquireSlot()!;
    try {
      await d.loadState(file, prompt);
      return await gen(d, r.firstToken, greedy());
    } finally {
      d.release();
    }
  }
  /** The decode-local path: plan (as decode/worker.ts does), acquire by prompt, evaluate the suffix, generate. */
  async function local(messages: ChatMessage[], limit = 512, signal = never): Promise<{ tokens: number[]; cached: number }> {
    const body = GenerateRequestSchema.parse({ rid: 'r', messages, sampling_params: { temperature: 0, max_new_tokens: 10, ignore_eos: true }, bootstrap_host: 'h', bootstrap_port: 1, bootstrap_room: 1, local_prefill: { max_tokens: limit } });
    const plan = await planLocal(decode, body, limit, true);
    const d = decode.tryAcquireSlot(plan.tokens)!;
    try {
      const st = await localPrefill(d, plan, signal);
      return { tokens: await gen(d, st.firstToken, plan.sampling, signal), cached: st.cachedTokens };
    } finally {
      d.release();
    }
  }
  async function ref(prompt: number[]): Promise<number[]> {
    const s = cold.tryAcquireSlot()!;
    try {
      const r = await s.prefill(prompt, greedy(), never);
      return await gen(s, r.firstToken, greedy());
    } finally {
      s.release();
    }
  }

  it('rounds 2+ evaluated on decode from its kept sequence equal the cold run and PD without reuse, round for round', async () => {
    const messages: ChatMessage[] = [{ role: 'system', content: 'You are a careful agent. Answer in short sentences about the state of the data.' }];
    let localRounds = 0;
    for (let round = 1; round <= 5; round++) {
      messages.push({ role: 'user', content: `Round ${round}: the tool returned ${'value '.repeat(round * 3)}done.` });
      const prompt = decode.renderChat(messages);
      const want = await ref(prompt);
      let got: number[];
      if (round === 1) {
        got = await pd(prompt, round);
        assert.ok(decode.cachedStats().tokens >= prompt.length, 'decode kept the loaded + generated sequence');
      } else {
        assert.ok(decode.reusableFor(prompt) > 0, `round ${round}: decode holds the conversation's prefix`);
        const r = await local(messages);
        assert.ok(r.cached > 0 && r.cached % BATCH === 0, `round ${round}: cached ${r.cached} (chunk-aligned in deterministic mode)`);
        got = r.tokens;
        localRounds++;
        // and the same round through PD without reuse
        assert.deepEqual(await pd(prompt, round), want, `round ${round}: PD without reuse`);
      }
      assert.deepEqual(got, want, `round ${round}: decode-local changed the output`);
      messages.push({ role: 'assistant', content: decode.detokenize(got) });
    }
    assert.equal(localRounds, 4);
  });

  it('a migrated round (resume_token_ids) on the decode that keeps the conversation: evaluated from its kept sequence, the rest equals the uninterrupted run; the resumed tokens count against the limit', async () => {
    const messages: ChatMessage[] = [{ role: 'user', content: 'Migration check: list the steps of the plan, one by one.' }];
    const p1 = decode.renderChat(messages);
    const r1 = await pd(p1, 200);
    messages.push({ role: 'assistant', content: decode.detokenize(r1) }, { role: 'user', content: 'And the next steps?' });
    const p2 = decode.renderChat(messages);
    const want = await ref(p2);
    const resumed = want.slice(0, 4);
    const body = GenerateRequestSchema.parse({ rid: 'r', messages, sampling_params: { temperature: 0, max_new_tokens: 10, ignore_eos: true }, bootstrap_host: 'h', bootstrap_port: 1, bootstrap_room: 1, local_prefill: { max_tokens: 4096 }, resume_token_ids: resumed });
    const uncached = p2.length - decode.reusableFor(p2);
    assert.ok(uncached > 0 && decode.reusableFor(p2) > 0, 'decode holds the conversation prefix');
    await assert.rejects(planLocal(decode, body, uncached + resumed.length - 1, true), { code: 'needs_prefill' }, 'the resumed tokens are part of the suffix decode evaluates');
    const plan = await planLocal(decode, body, uncached + resumed.length, true);
    assert.deepEqual(plan.sampling.resumed, resumed);
    const d = decode.tryAcquireSlot(plan.tokens)!;
    try {
      const st = await localPrefill(d, plan, never);
      assert.ok(st.cachedTokens > 0, 'the kept sequence served the prefix');
      assert.equal(st.promptTokens, p2.length + resumed.length);
      assert.deepEqual(await gen(d, st.firstToken, plan.sampling), want.slice(resumed.length), 'no token repeated or missing, none changed');
    } finally {
      d.release();
    }
  });

  it('decode answers needs_prefill when the uncached suffix is over the limit (or decode-local is off)', async () => {
    const messages: ChatMessage[] = [{ role: 'user', content: 'an unrelated conversation about '.repeat(20) }];
    const body = GenerateRequestSchema.parse({ rid: 'r', messages, bootstrap_host: 'h', bootstrap_port: 1, bootstrap_room: 1, local_prefill: { max_tokens: 8 } });
    await assert.rejects(planLocal(decode, body, 256, true), { code: 'needs_prefill' });
    await assert.rejects(planLocal(decode, { ...body, local_prefill: { max_tokens: 4096 } }, 256, false), { code: 'needs_prefill' });
    await assert.rejects(planLocal(decode, { ...body, local_prefill: { max_tokens: 4096 } }, 0, true), { code: 'needs_prefill' });
    const ok = await planLocal(decode, { ...body, local_prefill: { max_tokens: 4096 } }, 4096, true);
    assert.equal(ok.tokens.length, decode.renderChat(messages).length, 'a short-enough prompt is evaluated whole locally even with nothing kept');
  });

  it('an abort mid-suffix leaves no kept sequence a later round could read; the next round is evaluated cold and equal', async () => {
    const messages: ChatMessage[] = [{ role: 'user', content: 'one two three four five six seven eight nine ten '.repeat(6) }];
    const p1 = decode.renderChat(messages);
    const r1 = await pd(p1, 100);
    messages.push({ role: 'assistant', content: decode.detokenize(r1) }, { role: 'user', content: 'eleven twelve thirteen fourteen fifteen sixteen '.repeat(8) });
    const p2 = decode.renderChat(messages);
    assert.ok(p2.length - decode.reusableFor(p2) > BATCH * 3, 'a suffix of several chunks');
    const ac = new AbortController();
    const run = local(messages, 4096, ac.signal);
    setImmediate(() => ac.abort());
    await assert.rejects(run, { code: 'ABORTED' });
    assert.equal(decode.reusableFor(p2), 0, 'the half-written sequence was cleared, not kept');
    const again = await local(messages, 4096);
    assert.equal(again.cached, 0);
    assert.deepEqual(again.tokens, await ref(p2));
    // an aborted generation does not keep its sequence either
    messages.push({ role: 'assistant', content: decode.detokenize(again.tokens) }, { role: 'user', content: 'ok' });
    const ac2 = new AbortController();
    const p3 = decode.renderChat(messages);
    assert.ok(decode.reusableFor(p3) > 0);
    const body = GenerateRequestSchema.parse({ rid: 'r', messages, sampling_params: { temperature: 0, max_new_tokens: 50, ignore_eos: true }, bootstrap_host: 'h', bootstrap_port: 1, bootstrap_room: 1, local_prefill: { max_tokens: 4096 } });
    const plan = await planLocal(decode, body, 4096, true);
    const d = decode.tryAcquireSlot(plan.tokens)!;
    const st = await localPrefill(d, plan, never);
    let n = 0;
    for await (const _t of d.generate(st.firstToken, plan.sampling, ac2.signal)) if (++n === 3) ac2.abort();
    d.release();
    assert.equal(decode.reusableFor(p3), 0);
  });

  it('more conversations than spare sequences: eviction never fails a request, and every round equals the cold run', async () => {
    const convs: ChatMessage[][] = [];
    for (let c = 0; c < 5; c++) convs.push([{ role: 'system', content: `Agent ${c} keeps a log of ${'entries '.repeat(c + 2)}` }]);
    let localHits = 0;
    let evictedServed = 0;
    let served = 0;
    for (let round = 1; round <= 3; round++) {
      // all conversations of the round at once (2 slots, 2 spare sequences, 5 conversations)
      const outs = await Promise.all(
        convs.map(async (m, c) => {
          m.push({ role: 'user', content: `round ${round} of agent ${c}: ${'data '.repeat(3 + c)}` });
          const prompt = decode.renderChat(m);
          const body = GenerateRequestSchema.parse({ rid: `r${c}`, messages: m, sampling_params: { temperature: 0, max_new_tokens: 10, ignore_eos: true }, bootstrap_host: 'h', bootstrap_port: 1, bootstrap_room: 1, local_prefill: { max_tokens: 4096 } });
          const plan = await planLocal(decode, body, 4096, true);
          let s: Slot | null = null;
          while (!(s = decode.tryAcquireSlot(plan.tokens))) await new Promise((r) => setTimeout(r, 2));
          try {
            const st = await localPrefill(s, plan, never);
            if (st.cachedTokens > 0) localHits++;
            // planned with a kept prefix that another request evicted while this one waited: served whole, locally
            else if (plan.reusable > 0) evictedServed++;
            served++;
            return { c, prompt, tokens: await gen(s, st.firstToken, plan.sampling) };
          } finally {
            s.release();
          }
        }),
      );
      for (const o of outs) {
        assert.deepEqual(o.tokens, await ref(o.prompt), `round ${round} agent ${o.c}`);
        convs[o.c]!.push({ role: 'assistant', content: decode.detokenize(o.tokens) });
      }
      const st = decode.cachedStats();
      assert.ok(st.sequences <= 2 + 2 && st.tokens <= 4096);
    }
    assert.equal(served, 15);
    // A cyclic access pattern over more conversations than sequences is LRU's worst case: most
    // plans find their prefix evicted by the time they hold a slot. They are still served.
    assert.ok(evictedServed > 0, `no request exercised the evicted-while-waiting path (hits ${localHits})`);
  });
});

describe('decode driver: the decode-local path (src/decode/driver.ts)', () => {
  const cfg = { timeouts: T, slots: 1, maxPrealloc: 1, maxStateBytes: 1000 };
  const P = '127.0.0.1:8998';
  const acts = (a: DecodeAction[]) => a.map((x) => (x.a === 'send' ? `send:${x.msg.type}` : x.a === 'finish' ? `finish:${KVPoll[x.state]}` : x.a === 'diag' ? `diag:${x.effect.t}` : x.a));

  it('slot → local_prefill → loadDone → Success, generation, one release; nothing ever goes to a prefill', () => {
    const d = new DecodeDriver(cfg, 'd0');
    const a = d.request(id(1), 'r1', P, 0, { local: true });
    assert.deepEqual(acts(a.actions), ['assign_slot', 'local_prefill']);
    assert.equal(d.step(id(1)), 'local_prefill');
    assert.equal(d.rooms.get(id(1))!.peer, undefined);
    assert.deepEqual(acts(d.loadDone(id(1), 5)), ['finish:Success', 'generate']);
    assert.deepEqual(acts(d.generationDone(id(1), 9)), ['release']);
    assert.equal(d.freeSlots, 1);
  });

  it('an abort while the suffix is evaluated: Failed at once, the slot kept until the evaluation returns, released once', () => {
    const d = new DecodeDriver(cfg, 'd0');
    d.request(id(1), 'r1', P, 0, { local: true });
    const b = d.request(id(2), 'r2', P, 0, { local: true });
    assert.deepEqual(acts(b.actions), [], 'waits for the only slot');
    assert.deepEqual(acts(d.abort(undefined, id(1), 'client', 1)), ['finish:Failed'], 'no FAIL to any prefill: the room has no peer');
    assert.equal(d.freeSlots, 0, 'llama.cpp still evaluates into the slot');
    assert.deepEqual(acts(d.loadDone(id(1), 2)), ['release', 'assign_slot', 'local_prefill'], 'released when it returns; the next local room gets the slot');
    assert.deepEqual(acts(d.loadFailed(id(2), { code: 'engine_failed', detail: 'x' }, 3)), ['finish:Failed', 'release']);
    const full = d.request(id(3), 'r3', P, 3, { local: true });
    assert.deepEqual(acts(full.actions), ['assign_slot', 'local_prefill']);
    const refused = d.request(id(4), 'r4', P, 3, { local: true });
    assert.deepEqual(acts(refused.actions), []);
    const q = d.request(id(5), 'r5', P, 3, { local: true });
    assert.equal(q.refused?.code, 'queue_full');
    assert.deepEqual(q.actions, [], 'a refused local request is not reported to a prefill that never saw it');
    assert.equal(d.rooms.stats.illegal, 0);
  });

  it('the watchdog fails a local evaluation that overran waitingMs; the slot waits for the evaluation', () => {
    const d = new DecodeDriver(cfg, 'd0');
    d.request(id(1), 'r1', P, 0, { local: true });
    assert.deepEqual(acts(d.tick(T.waitingMs)), ['diag:expired', 'finish:Failed']);
    assert.deepEqual(acts(d.loadDone(id(1), T.waitingMs + 1)), ['release']);
  });
});
