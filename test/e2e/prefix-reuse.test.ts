/**
 * Prefix reuse end to end (real processes, the real `openai` client, deterministic engines):
 * a multi-round agent conversation through PD (prefill's prefix cache) and the colocated server
 * (its own prefix cache) gives, round for round, the output of a colocated engine without any
 * cache; usage.prompt_tokens_details.cached_tokens reports the reuse; an aborted round leaves
 * nothing a later round could read; the metrics and /debug/rooms say what was reused. Retention:
 * an agent's session paused within its TTL keeps its cached state while one-off requests take
 * the sequences, and loses it past its window; `agent_hints.retention_seconds` gives a request a
 * window of its own; bad hints are a 400; evictions are counted by cause.
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import type OpenAI from 'openai';
import { chatRound as round, type Msg } from '../helpers/chat.js';
import { startColocated, type ColocatedServer } from '../../src/colocated/server.js';
import { createLogger } from '../../src/base/log.js';
import type { Cluster } from '../../src/up/cluster.js';
import { client, CTX, getJson, startStack, tinyModel } from '../helpers/stack.js';

const BATCH = 32;
let c: Cluster;
let nocache: ColocatedServer;
let retain: ColocatedServer;
let pd: OpenAI;
let colo: OpenAI;
let cold: OpenAI;


const metricValue = (text: string, name: string): number => {
  const m = new RegExp(`^${name}(?:\\{[^}]*\\})? (\\S+)$`, 'm').exec(text);
  return m ? Number(m[1]) : NaN;
};

/**
 * The retention server's session TTL: far longer than three 8-token requests take on a loaded
 * machine, so the within-TTL check always runs (and fails, naming the time, if they ever take it).
 */
const SESSION_TTL_MS = 60_000;
/** The short window (`agent_hints.retention_seconds`) the past-TTL check waits out. */
const SHORT_TTL_S = 1;

/** One greedy non-streamed chat call with extra body fields (prompt_cache_key, agent_hints): its text, prompt and cached tokens. */
async function callWith(api: OpenAI, messages: Msg[], extra: Record<string, unknown> = {}): Promise<{ text: string; prompt: number; cached: number }> {
  const r = await api.chat.completions.create({ model: 'pdserve', messages, max_tokens: 8, temperature: 0, ...extra } as OpenAI.Chat.Completions.ChatCompletionCreateParamsNonStreaming);
  return { text: r.choices[0]!.message.content ?? '', prompt: r.usage!.prompt_tokens, cached: r.usage!.prompt_tokens_details!.cached_tokens! };
}

describe('prefix reuse (PD and colocated vs no cache)', () => {
  before(async () => {
    c = await startStack({ batchSize: BATCH });
    nocache = await startColocated(
      { port: 0, slots: 2, engine: { modelPath: await tinyModel(), contextSize: CTX, batchSize: BATCH, deterministic: true, prefixCacheTokens: 0 } },
      createLogger('colocated-nocache', { level: 'silent' }),
    );
    // retention: 2 sequences (1 slot + 1 cache sequence), no host store (only the sequence tier
    // can serve a reuse), a short session TTL
    retain = await startColocated(
      { port: 0, slots: 1, engine: { modelPath: await tinyModel(), contextSize: CTX, batchSize: BATCH, deterministic: true, prefixCacheSlots: 1, prefixStoreBytes: 0, sessionTtlMs: SESSION_TTL_MS } },
      createLogger('colocated-retain', { level: 'silent' }),
    );
    pd = client(c.router.url);
    colo = client(c.colocated!.url);
    cold = client(nocache.url);
  });
  after(async () => {
    await c?.stop();
    await nocache?.close();
    await retain?.close();
  });

  test('a 6-round agent conversation: same output with and without reuse; cached tokens reported', async () => {
    const messages: Msg[] = [{ role: 'system', content: 'You are an agent. Call tools, read results, answer briefly.' }];
    let promptAll = 0;
    let cachedAll = 0;
    for (let r = 1; r <= 6; r++) {
      // each round adds a tool result as a user turn (the tiny model has no tool-call template)
      messages.push({ role: 'user', content: `tool result ${r}: ${'ok '.repeat(6 + r)}` });
      const stream = r % 2 === 0;
      const ref = await round(cold, messages, stream);
      const a = await round(pd, messages, stream);
      const b = await round(colo, messages, stream);
      assert.equal(a.text, ref.text, `round ${r}: PD with reuse differs from no-cache output`);
      assert.equal(b.text, ref.text, `round ${r}: colocated with reuse differs from no-cache output`);
      assert.equal(ref.cached, 0);
      assert.equal(a.prompt, ref.prompt);
      assert.equal(a.cached % BATCH, 0, 'deterministic reuse is whole prompt chunks');
      if (r > 1) {
        assert.ok(a.cached > 0, `round ${r}: PD reused nothing (${a.prompt} prompt tokens)`);
        assert.ok(b.cached > 0, `round ${r}: colocated reused nothing`);
        promptAll += a.prompt;
        cachedAll += a.cached;
      }
      messages.push({ role: 'assistant', content: ref.text });
    }
    assert.ok(cachedAll / promptAll > 0.5, `cached ${cachedAll} of ${promptAll} prompt tokens over rounds 2+`);

    const pm = await (await fetch(`${c.byRole('prefill')[0]!.url}/metrics`)).text();
    assert.ok(metricValue(pm, 'pdserve_prefix_cache_hit_tokens_total') >= cachedAll, 'hit tokens counted');
    assert.ok(metricValue(pm, 'pdserve_prefix_cache_query_tokens_total') >= promptAll, 'query tokens counted');
    assert.ok(metricValue(pm, 'pdserve_prefix_cache_tokens') > 0, 'idle sequences hold a prefix');
    const dm = await (await fetch(`${c.byRole('decode')[0]!.url}/metrics`)).text();
    assert.ok(metricValue(dm, 'pdserve_requests_by_path_total') >= 6, 'decode counts requests by path');
    assert.match(dm, /pdserve_requests_by_path_total\{path="pd"\}/);
    const cm = await (await fetch(`${c.colocated!.url}/metrics`)).text();
    assert.ok(metricValue(cm, 'pdserve_prefix_cache_hit_tokens_total') > 0);
  });

  test('a client abort mid-round leaves no entry a later round could read; the retried round matches', async () => {
    const messages: Msg[] = [{ role: 'system', content: 'Aborts must not poison the cache.' }, { role: 'user', content: 'start '.repeat(30) }];
    const ac = new AbortController();
    const s = await pd.chat.completions.create({ model: 'pdserve', messages, max_tokens: 200, temperature: 0, stream: true, stream_options: { include_usage: true } }, { signal: ac.signal });
    let seen = 0;
    let finish: string | null | undefined;
    try {
      for await (const ch of s) {
        finish = ch.choices[0]?.finish_reason ?? finish;
        if ((ch.choices[0]?.delta?.content ?? '') !== '' && ++seen === 2) ac.abort();
      }
    } catch (err) {
      assert.ok(ac.signal.aborted, `only our abort may end the stream early: ${String(err)}`);
    }
    assert.ok(ac.signal.aborted, `the round ended (${finish}) after ${seen} chunks before it could be aborted`);
    const ref = await round(cold, messages, false);
    const again = await round(pd, messages, false);
    assert.equal(again.text, ref.text);
    // the aborted generation lived on decode; prefill's finished prompt evaluation may be reused
    const dbg = await getJson<any>(`${c.byRole('prefill')[0]!.url}/debug/rooms`);
    assert.ok(Array.isArray(dbg.live));
  });

  test('/debug/rooms shows the serving path and cached tokens of live requests', async () => {
    const messages: Msg[] = [{ role: 'user', content: 'long answer please '.repeat(4) }];
    await round(colo, messages, false);
    const p = colo.chat.completions.create({ model: 'pdserve', messages, max_tokens: 300, temperature: 0 });
    let live: any[] = [];
    for (let i = 0; i < 200 && live.length === 0; i++) {
      live = (await getJson<any>(`${c.colocated!.url}/debug/rooms`)).live;
      if (live.length === 0) await new Promise((r) => setTimeout(r, 5));
    }
    await p;
    assert.ok(live.length > 0, 'a live request was seen');
    assert.equal(live[0].path, 'colocated');
    assert.equal(typeof live[0].cached_tokens, 'number');
  });

  test('retention: a session paused within its TTL keeps its state while one-off requests take the sequences; past it, LRU takes it', async () => {
    const api = client(retain.url);
    const agent: Msg[] = [{ role: 'system', content: 'You are a coding agent. Plan, call a tool, read its result, answer in one line. '.repeat(2) }, { role: 'user', content: 'task: fix the failing build step '.repeat(3) }];
    const oneOff = (i: number): Msg[] => [{ role: 'user', content: `${i} unrelated question number ${i}: ${'why '.repeat(20 + i)}` }];
    const evictions = async (cause: string): Promise<number> => {
      const m = new RegExp(`^pdserve_cache_evictions_total\\{tier="sequence",cause="${cause}"\\} (\\S+)$`, 'm').exec(await (await fetch(`${retain.url}/metrics`)).text());
      return m ? Number(m[1]) : 0;
    };
    const ref1 = await callWith(cold, agent);
    const t1 = await callWith(api, agent, { prompt_cache_key: 'agent-1' });
    assert.equal(t1.text, ref1.text);
    const t0 = Date.now();
    // the agent runs a tool; two one-off requests need both sequences meanwhile
    await callWith(api, oneOff(1));
    await callWith(api, oneOff(2));
    agent.push({ role: 'assistant', content: t1.text }, { role: 'user', content: 'tool result: exit 0, 12 tests passed' });
    const within = Date.now() - t0;
    // turn 2 reads turn 1's state (session TTL) and leaves its own with a short window for the past-TTL check
    const t2 = await callWith(api, agent, { prompt_cache_key: 'agent-1', agent_hints: { retention_seconds: SHORT_TTL_S } });
    const ref2 = await callWith(cold, agent);
    assert.equal(t2.text, ref2.text, 'reuse changed the output');
    assert.ok(within < SESSION_TTL_MS, `the one-off requests took ${within} ms, past the ${SESSION_TTL_MS} ms session TTL`);
    // plain LRU would have given the paused session's sequence to the second one-off request
    assert.ok(t2.cached >= BATCH, `turn 2 within the TTL (${within} ms) reused ${t2.cached} of ${t2.prompt} tokens`);
    assert.ok((await evictions('lru')) >= 1, 'the one-off state was evicted (lru)');

    // paused past its window: LRU takes it (turn 2's state is the oldest once two more requests came)
    await new Promise((r) => setTimeout(r, SHORT_TTL_S * 1000 + 200));
    await callWith(api, oneOff(3));
    await callWith(api, oneOff(4));
    agent.push({ role: 'assistant', content: t2.text }, { role: 'user', content: 'tool result: deployed' });
    const t3 = await callWith(api, agent, { prompt_cache_key: 'agent-1' });
    assert.equal(t3.text, (await callWith(cold, agent)).text);
    assert.equal(t3.cached, 0, 'past its window the paused session lost its state to LRU');

    // agent_hints.retention_seconds gives a request without a session key its own window
    const hinted: Msg[] = [{ role: 'user', content: 'hinted request: keep my state while my tool runs '.repeat(3) }];
    const h1 = await callWith(api, hinted, { agent_hints: { retention_seconds: 60, priority: 50 } });
    await callWith(api, oneOff(5));
    await callWith(api, oneOff(6));
    hinted.push({ role: 'assistant', content: h1.text }, { role: 'user', content: 'tool result: ok' });
    const h2 = await callWith(api, hinted);
    assert.ok(h2.cached >= BATCH, `the hinted request kept its state (${h2.cached} cached)`);
    assert.ok((await evictions('lru')) >= 2);
    assert.ok((await evictions('ttl_pressure')) >= 1, 'with both sequences inside their windows, the lower priority went (ttl_pressure)');

    // a bad hint is a 400 naming the field, through the real client
    await assert.rejects(callWith(api, hinted, { agent_hints: { retention_seconds: 7200 } }), (e: { status?: number; param?: string }) => e.status === 400 && e.param === 'agent_hints.retention_seconds');
  });
});
