/**
 * End to end through real processes on loopback: router → prefill → KV over TCP → decode,
 * on the generated tiny GGUF, with the real `openai` client. The colocated server is the
 * reference: greedy PD output must be identical to it.
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import type OpenAI from 'openai';
import type { Cluster } from '../../src/up/cluster.js';
import { busy, client, CTX, getJson, promptOf, startStack, waitFor } from '../helpers/stack.js';

let c: Cluster;
let pd: OpenAI;
let ref: OpenAI;

interface Case {
  name: string;
  kind: 'completion' | 'chat';
  stream: boolean;
  prompt: string | number[];
  maxTokens: number;
  stop?: string[];
}

interface Outcome {
  text: string;
  completionTokens: number | undefined;
  promptTokens: number | undefined;
  finish: string | null | undefined;
}

async function run(api: OpenAI, k: Case, signal?: AbortSignal): Promise<Outcome> {
  const common = { model: 'pdserve', max_tokens: k.maxTokens, temperature: 0, stop: k.stop } as const;
  if (k.kind === 'completion') {
    if (k.stream) {
      const s = await api.completions.create({ ...common, prompt: k.prompt, stream: true, stream_options: { include_usage: true } }, { signal });
      let text = '';
      let finish: string | null | undefined;
      let usage: OpenAI.CompletionUsage | undefined;
      for await (const ch of s) {
        if (ch.choices[0]) {
          text += ch.choices[0].text;
          finish = ch.choices[0].finish_reason ?? finish;
        }
        if (ch.usage) usage = ch.usage;
      }
      return { text, completionTokens: usage?.completion_tokens, promptTokens: usage?.prompt_tokens, finish };
    }
    const r = await api.completions.create({ ...common, prompt: k.prompt }, { signal });
    return { text: r.choices[0]!.text, completionTokens: r.usage?.completion_tokens, promptTokens: r.usage?.prompt_tokens, finish: r.choices[0]!.finish_reason };
  }
  const messages = [
    { role: 'system' as const, content: 'You are a terse assistant.' },
    { role: 'user' as const, content: String(k.prompt) },
  ];
  if (k.stream) {
    const s = await api.chat.completions.create({ ...common, messages, stream: true, stream_options: { include_usage: true } }, { signal });
    let text = '';
    let finish: string | null | undefined;
    let usage: OpenAI.CompletionUsage | undefined;
    for await (const ch of s) {
      if (ch.choices[0]) {
        text += ch.choices[0].delta.content ?? '';
        finish = ch.choices[0].finish_reason ?? finish;
      }
      if (ch.usage) usage = ch.usage;
    }
    return { text, completionTokens: usage?.completion_tokens, promptTokens: usage?.prompt_tokens, finish };
  }
  const r = await api.chat.completions.create({ ...common, messages }, { signal });
  return { text: r.choices[0]!.message.content ?? '', completionTokens: r.usage?.completion_tokens, promptTokens: r.usage?.prompt_tokens, finish: r.choices[0]!.finish_reason };
}

function cases(): Case[] {
  const out: Case[] = [];
  const lens = [1, 3, 12, 40, 90, 180, 300, 450, 640, 800, CTX - 24 - 40];
  let i = 0;
  for (const n of lens) {
    for (const kind of ['completion', 'chat'] as const) {
      const stream = i % 2 === 0;
      const maxTokens = n > 700 ? 16 : 24;
      const chatOverhead = kind === 'chat' ? 80 : 0;
      const len = Math.max(1, Math.min(n, CTX - maxTokens - chatOverhead - 8));
      out.push({ name: `${kind} ${stream ? 'stream' : 'non-stream'} ~${len} chars`, kind, stream, prompt: promptOf(len, i), maxTokens });
      i++;
    }
  }
  out.push({ name: 'completion from exactly one token id', kind: 'completion', stream: true, prompt: [72], maxTokens: 20 });
  out.push({ name: 'completion with a stop string', kind: 'completion', stream: false, prompt: promptOf(50, 3), maxTokens: 40, stop: ['e'] });
  out.push({ name: 'max_tokens 1', kind: 'completion', stream: true, prompt: promptOf(30, 5), maxTokens: 1 });
  return out;
}

before(async () => {
  // Every first token here waits for the state save (prefill's --first-token-after-save always);
  // first-token.test.ts runs the other order.
  c = await startStack({ env: { PDSERVE_TEST_HOLDS: 'on' }, extraArgs: { prefill: ['--first-token-after-save', 'always'] } });
  pd = client(c.router.url);
  ref = client(c.colocated!.url);
});

after(async () => {
  await c?.stop();
});

describe('PD end to end', () => {
  test('greedy PD output equals colocated for prompts from 1 token to near the context length', async () => {
    const all = cases();
    assert.ok(all.length >= 20);
    for (const k of all) {
      const want = await run(ref, k);
      const got = await run(pd, k);
      assert.ok(want.completionTokens !== undefined && want.completionTokens >= 1, `${k.name}: reference produced tokens`);
      assert.deepEqual(got, want, k.name);
      if (k.maxTokens === 1) assert.equal(got.completionTokens, 1);
      if (k.stop) assert.ok(!got.text.includes('e'), 'stop string not in text');
    }
  });

  test('8 concurrent streams each match their colocated output', async () => {
    const ks: Case[] = Array.from({ length: 8 }, (_, i) => ({ name: `concurrent ${i}`, kind: i % 2 ? 'chat' : 'completion', stream: true, prompt: promptOf(20 + i * 37, 100 + i), maxTokens: 32 }));
    // The reference runs one at a time; the stack runs with --deterministic (one sequence per
    // llama.cpp decode call), without which batched float sums can flip a greedy token.
    const want: Outcome[] = [];
    for (const k of ks) want.push(await run(ref, k));
    const got = await Promise.all(ks.map((k) => run(pd, k)));
    for (let i = 0; i < ks.length; i++) assert.deepEqual(got[i], want[i], ks[i]!.name);
  });

  test('client abort mid-stream releases everything on both workers within 1 s', async () => {
    const aborts = async () => {
      const m = await (await fetch(`${c.router.url}/metrics`)).text();
      return Number(/pdserve_router_requests_total\{outcome="client_abort"\} (\d+)/.exec(m)?.[1] ?? 0);
    };
    const before = await aborts();
    const ac = new AbortController();
    const s = await pd.completions.create({ model: 'pdserve', prompt: promptOf(200, 9), max_tokens: 700, temperature: 0, stream: true }, { signal: ac.signal });
    let chunks = 0;
    let finished = false;
    try {
      for await (const ch of s) {
        if (ch.choices[0]?.finish_reason) finished = true;
        if (++chunks === 3) ac.abort();
      }
    } catch {
      // the client sees its own abort
    }
    assert.ok(chunks >= 3 && !finished, `aborted mid-stream after ${chunks} chunks`);
    // only this case aborts in this file, so the router's counter moves by this abort alone; it is
    // counted when the router notices the closed socket (late on a loaded machine)
    assert.ok(await waitFor(async () => (await aborts()) === before + 1, 5000), 'router counted the client abort');
    const workers = c.procs.filter((p) => p.role === 'prefill' || p.role === 'decode');
    const idle = await waitFor(async () => (await Promise.all(workers.map((w) => busy(w.url)))).every((n) => n === 0), 1000);
    assert.ok(idle, `workers idle within 1 s: ${JSON.stringify(await Promise.all(workers.map((w) => getJson(`${w.url}/health`))))}`);
    const next = await run(pd, { name: 'after abort', kind: 'completion', stream: false, prompt: 'hello', maxTokens: 8 });
    assert.ok(next.completionTokens! >= 1);
  });

  test('bad HTTP input gets a 400 OpenAI error body and the stack keeps serving', async () => {
    const url = `${c.router.url}/v1/completions`;
    const bodies: [string, string][] = [
      ['invalid JSON', '{"model": "x", "prompt": '],
      ['missing prompt', JSON.stringify({ model: 'pdserve' })],
      ['wrong type', JSON.stringify({ model: 'pdserve', prompt: 'hi', max_tokens: 'ten' })],
      ['negative max_tokens', JSON.stringify({ model: 'pdserve', prompt: 'hi', max_tokens: -1 })],
      ['temperature out of range', JSON.stringify({ model: 'pdserve', prompt: 'hi', temperature: 9 })],
    ];
    for (const [name, body] of bodies) {
      const r = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body, signal: AbortSignal.timeout(5000) });
      assert.equal(r.status, 400, name);
      const j = (await r.json()) as { error?: { message?: string; type?: string } };
      assert.equal(typeof j.error?.message, 'string', name);
      assert.equal(j.error?.type, 'invalid_request_error', name);
    }
    const chat = await fetch(`${c.router.url}/v1/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'pdserve' }), signal: AbortSignal.timeout(5000) });
    assert.equal(chat.status, 400);
    const tooLong = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'pdserve', prompt: promptOf(CTX * 2), max_tokens: 10 }), signal: AbortSignal.timeout(5000) });
    assert.equal(tooLong.status, 400, 'prompt longer than the context');
    const ok = await run(pd, { name: 'after bad input', kind: 'chat', stream: true, prompt: 'still there?', maxTokens: 8 });
    assert.ok(ok.completionTokens! >= 1);
    for (const p of c.procs) assert.equal(p.unexpectedExits.length, 0, `${p.name} did not crash`);
  });

  test('--first-token-after-save: no token reaches the client while prefill saves the state; then the stream equals colocated', async () => {
    const prefill = c.byRole('prefill')[0]!;
    const holds = async (spec: string): Promise<{ waiting: Record<string, number> }> => {
      const r = await fetch(`${prefill.url}/debug/test-holds`, { method: 'POST', headers: { 'content-type': 'text/plain' }, body: spec, signal: AbortSignal.timeout(2000) });
      assert.equal(r.status, 200);
      return (await r.json()) as { waiting: Record<string, number> };
    };
    const counted = async (): Promise<number> => Number(/^pdserve_prefill_first_tokens_after_save_total (\d+)/m.exec(await (await fetch(`${prefill.url}/metrics`)).text())?.[1] ?? 'NaN');
    const k: Case = { name: 'held save', kind: 'completion', stream: true, prompt: promptOf(60, 7), maxTokens: 8 };
    const want = await run(ref, k);
    const before = await counted();
    await holds('prefill.save=30000');
    let events = 0;
    const got = (async () => {
      const s = await pd.completions.create({ model: 'pdserve', prompt: k.prompt, max_tokens: k.maxTokens, temperature: 0, stream: true });
      let text = '';
      for await (const ch of s) {
        events++;
        text += ch.choices[0]?.text ?? '';
      }
      return text;
    })();
    try {
      assert.ok(await waitFor(async () => ((await holds('prefill.save=30000')).waiting['prefill.save'] ?? 0) >= 1, 10_000), 'prefill reached the save');
      await new Promise((r) => setTimeout(r, 300));
      assert.equal(events, 0, 'the client has nothing while the state is not saved');
    } finally {
      await holds('');
    }
    assert.equal(await got, want.text);
    assert.equal(await counted(), before + 1, 'one first token sent after its save');
  });

  test('/v1/models, /workers, /metrics and /debug/rooms answer', async () => {
    const models = await pd.models.list();
    assert.ok(models.data.length >= 1);
    const workers = await getJson<any>(`${c.router.url}/workers`);
    assert.ok(JSON.stringify(workers).includes('prefill'));
    const metrics = await (await fetch(`${c.byRole('decode')[0]!.url}/metrics`)).text();
    for (const m of ['pdserve_decode_prealloc_queue_reqs', 'pdserve_decode_transfer_queue_reqs', 'pdserve_decode_running_reqs', 'pdserve_kv_transfer_bytes_total']) assert.ok(metrics.includes(m), m);
    const pm = await (await fetch(`${c.byRole('prefill')[0]!.url}/metrics`)).text();
    for (const m of ['pdserve_prefill_inflight_queue_reqs', 'pdserve_kv_transfer_failed_total', 'pdserve_bootstrap_failed_total']) assert.ok(pm.includes(m), m);
    const rm = await (await fetch(`${c.router.url}/metrics`)).text();
    for (const m of ['pdserve_time_to_first_token_seconds', 'pdserve_inter_token_latency_seconds', 'pdserve_e2e_request_latency_seconds']) assert.ok(rm.includes(m), m);
    const dbg = await getJson<any>(`${c.byRole('decode')[0]!.url}/debug/rooms`);
    assert.ok(Array.isArray(dbg.recent) && dbg.recent.length > 0, 'recent terminal rooms listed');
  });
});
