/**
 * Router unit tests against FAKE prefill/decode workers: real fastify servers on port 0 that
 * speak the worker protocol (POST /generate, POST /abort_request, GET /health) with canned
 * behaviour. The client is the real `openai` npm package pointed at the router.
 */
import assert from 'node:assert/strict';
import diagnostics from 'node:diagnostics_channel';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, afterEach, describe, test } from 'node:test';
import Fastify, { type FastifyInstance } from 'fastify';
import OpenAI from 'openai';
import type { GenerateEvent, GenerateRequest } from '../../src/protocol/worker-protocol.js';
import { createRouter, startRouter, WorkerRegistry, parseRouterConfig, RouterConfigError, type RunningRouter } from '../../src/router/index.js';
import pino from 'pino';
import { waitUntil } from '../../src/router/attempts.js';
import { KvEventLog } from '../../src/protocol/kv-events.js';
import { registerKvEventsRoute } from '../../src/worker/kv-events-route.js';
import { ensureModel } from '../../src/engine/gguf-writer.js';

// ------------------------------------------------------------------------------------------
// Fake workers
// ------------------------------------------------------------------------------------------

interface PrefillBehaviour {
  /** Answer after this many ms (abortable). */
  delayMs?: number;
  /** Non-200 answer with an OpenAI error body. */
  status?: number;
  message?: string;
  code?: string;
  /** With first_token_from_prefill: the first token's text (streamed at once). */
  first?: string;
  /** With first_token_from_prefill: wait this long after the first token, then end with an `{error}` event instead of `{transfer}`. */
  failAfterFirstMs?: number;
  /** With failAfterFirstMs: the `{error}` event's error (default 502 kv_transfer_failed). */
  failError?: { message: string; code: string; status: number; type: string };
  /** With first_token_from_prefill: the body of the 200 stream instead of the script above, in these pieces (5 ms apart), then the end. */
  rawPieces?: string[];
}

interface DecodeBehaviour {
  /** Error status before the stream starts (after startDelayMs). */
  status?: number;
  message?: string;
  /** The error's code (default decode_failed). */
  code?: string;
  /** Wait before the first event (the "KV transfer"), abortable. */
  startDelayMs?: number;
  tokens?: string[];
  intervalMs?: number;
  finish?: 'stop' | 'length' | 'abort';
  /** Send an `{error}` event after this many tokens. */
  errorAfter?: number;
  /** End the stream (no finish, no [DONE]) after this many tokens. */
  truncateAfter?: number;
  /** Stop sending after this many tokens but keep the stream open. */
  hangAfter?: number;
  promptTokens?: number;
  /** Destroy the connection without any response byte (a worker closing as it exits). */
  destroy?: boolean;
  /** Destroy the connection after this many tokens (50 ms after the headers and those tokens left). */
  destroyAfter?: number;
}

interface AbortRecord {
  rid: string;
  bootstrap_room?: string;
  cause?: { code: string; message: string };
  at: number;
}

class FakeWorker {
  readonly app: FastifyInstance;
  url = '';
  generates: GenerateRequest[] = [];
  aborts: AbortRecord[] = [];
  /** rid → time the worker saw its /generate connection close before it finished. */
  connectionClosed = new Map<string, number>();
  active = 0;
  /** How long /abort_request waits before it cancels (and answers). */
  abortDelayMs = 0;
  health: () => { code: number; body: unknown };
  /** GET /debug/rooms's answer (a real worker's needs the router's signature). */
  rooms: () => { code: number; body: unknown } = () => ({ code: 200, body: { role: this.role, now: Date.now(), live: [], recent: [] } });
  prefill: (b: GenerateRequest) => PrefillBehaviour = () => ({ delayMs: 5 });
  decode: (b: GenerateRequest) => DecodeBehaviour = () => ({ tokens: ['Hello', ',', ' world'], intervalMs: 2, finish: 'length' });
  private readonly cancels = new Map<string, AbortController>();
  /** GET /kv_events: what the test says this worker holds (nothing unless it publishes). */
  readonly kvEvents = new KvEventLog();

  constructor(
    readonly role: 'prefill' | 'decode',
    readonly model = 'fake-model',
  ) {
    this.health = () => ({ code: 200, body: { status: 'ok', role: this.role, model: this.model, slots_free: 4 } });
    this.app = Fastify({ logger: false });
    registerKvEventsRoute(this.app, this.kvEvents);
    this.app.get('/health', async (_req, reply) => {
      const h = this.health();
      return reply.code(h.code).send(h.body);
    });
    this.app.get('/debug/rooms', async (_req, reply) => {
      const r = this.rooms();
      return reply.code(r.code).send(r.body);
    });
    this.app.post('/abort_request', async (req) => {
      const b = req.body as { rid: string; bootstrap_room?: string };
      this.aborts.push({ ...b, at: Date.now() });
      if (this.abortDelayMs > 0) await sleep(this.abortDelayMs); // a worker busy for a while before it acts on the abort
      this.cancels.get(String(b.bootstrap_room ?? b.rid))?.abort(); // by room when given, as the real workers do
      return { ok: true };
    });
    this.app.post('/generate', async (req, reply) => {
      const body = req.body as GenerateRequest;
      this.generates.push(body);
      const ac = new AbortController();
      const key = String(body.bootstrap_room ?? body.rid);
      this.cancels.set(key, ac);
      let finished = false;
      reply.raw.on('close', () => {
        if (!finished) {
          this.connectionClosed.set(body.rid, Date.now());
          ac.abort();
        }
      });
      this.active++;
      try {
        if (this.role === 'prefill') return await this.runPrefill(body, reply, ac.signal);
        return await this.runDecode(body, reply, ac.signal);
      } finally {
        finished = true;
        this.active--;
        this.cancels.delete(key);
      }
    });
  }

  private async runPrefill(body: GenerateRequest, reply: import('fastify').FastifyReply, signal: AbortSignal) {
    const b = this.prefill(body);
    try {
      await sleep(b.delayMs ?? 0, undefined, { signal });
    } catch {
      return reply.code(500).send({ error: { message: 'aborted', type: 'server_error', param: null, code: 'aborted' } });
    }
    if (b.status && b.status !== 200) {
      return reply.code(b.status).send({ error: { message: b.message ?? 'prefill failed', type: b.status < 500 ? 'invalid_request_error' : 'server_error', param: null, code: b.code ?? 'prefill_failed' } });
    }
    if (body.first_token_from_prefill && b.rawPieces) {
      reply.hijack();
      const res = reply.raw;
      res.writeHead(200, { 'content-type': 'text/event-stream' });
      for (const piece of b.rawPieces) {
        if (res.destroyed) return;
        res.write(piece);
        await sleep(5);
      }
      return res.end();
    }
    if (body.first_token_from_prefill) {
      reply.hijack();
      const res = reply.raw;
      res.writeHead(200, { 'content-type': 'text/event-stream' });
      const ev: GenerateEvent = { text: b.first ?? 'Hello', token_ids: [99], meta_info: { id: body.rid, prompt_tokens: 3, completion_tokens: 1, finish_reason: null } };
      res.write(`data: ${JSON.stringify(ev)}\n\n`);
      try {
        await sleep(b.failAfterFirstMs ?? 1, undefined, { signal });
      } catch {
        return res.end();
      }
      const end = b.failAfterFirstMs !== undefined ? { error: b.failError ?? { message: 'KV transfer failed: peer lost', type: 'server_error', code: 'kv_transfer_failed', status: 502 } } : { transfer: { rid: body.rid, meta_info: { prompt_tokens: 3, kv_bytes: 1000, prefill_ms: 1, transfer_ms: 1 } } };
      res.write(`data: ${JSON.stringify(end)}\n\ndata: [DONE]\n\n`);
      return res.end();
    }
    return { rid: body.rid, meta_info: { prompt_tokens: 3, kv_bytes: 1000, prefill_ms: 1, transfer_ms: 1 } };
  }

  private async runDecode(body: GenerateRequest, reply: import('fastify').FastifyReply, signal: AbortSignal) {
    const b = this.decode(body);
    try {
      await sleep(b.startDelayMs ?? 0, undefined, { signal });
    } catch {
      return reply.code(500).send({ error: { message: 'aborted', type: 'server_error', param: null, code: 'aborted' } });
    }
    if (b.status) return reply.code(b.status).send({ error: { message: b.message ?? 'decode failed', type: b.status < 500 ? 'invalid_request_error' : 'server_error', param: null, code: b.code ?? 'decode_failed' } });
    reply.hijack();
    if (b.destroy) return void reply.raw.socket?.destroy();
    const res = reply.raw;
    res.writeHead(200, { 'content-type': 'text/event-stream' });
    const tokens = b.tokens ?? [];
    // first_token_from_prefill: the router has token 1 from prefill; the fake decode's script starts at token 2.
    // A migrated attempt (resume_token_ids): the client has the script's first k tokens already.
    const skip = (body.first_token_from_prefill ? 1 : 0) + (body.resume_token_ids?.length ?? 0);
    const meta = (n: number, finish: GenerateEvent['meta_info']['finish_reason']) => ({ id: body.rid, prompt_tokens: b.promptTokens ?? 3, completion_tokens: n, finish_reason: finish });
    try {
      for (let i = 0; i < tokens.length; i++) {
        if (b.errorAfter === i) {
          res.write(`data: ${JSON.stringify({ error: { message: 'slot exploded', type: 'server_error', code: 'engine_failed' } })}\n\n`);
          return res.end();
        }
        if (b.truncateAfter === i) return res.end();
        if (b.destroyAfter === i) {
          await sleep(50); // the headers and the tokens so far reach the router first
          return void res.socket?.destroy();
        }
        if (b.hangAfter === i) {
          await new Promise((r) => signal.addEventListener('abort', r, { once: true }));
          return res.end();
        }
        if (i > 0) await sleep(b.intervalMs ?? 0, undefined, { signal });
        const ev: GenerateEvent = { text: tokens[i]!, token_ids: [100 + i], meta_info: meta(i + 1, null) };
        if (i >= skip) res.write(`data: ${JSON.stringify(ev)}\n\n`);
      }
      res.write(`data: ${JSON.stringify({ text: '', token_ids: [], meta_info: meta(tokens.length, { type: b.finish ?? 'length' }) })}\n\n`);
      res.write('data: [DONE]\n\n');
      res.end();
    } catch {
      if (!res.destroyed) res.end();
    }
  }

  async start(): Promise<this> {
    await this.app.listen({ host: '127.0.0.1', port: 0 });
    const a = this.app.server.address();
    this.url = `http://127.0.0.1:${typeof a === 'object' && a ? a.port : 0}`;
    return this;
  }

  abortsFor(rid: string): AbortRecord[] {
    return this.aborts.filter((a) => a.rid === rid);
  }

  async close(): Promise<void> {
    for (const ac of this.cancels.values()) ac.abort();
    await this.app.close();
  }
}

// ------------------------------------------------------------------------------------------
// Harness
// ------------------------------------------------------------------------------------------

interface Stack {
  router: RunningRouter;
  prefill: FakeWorker[];
  decode: FakeWorker[];
  client: OpenAI;
}

const open: Stack[] = [];

/**
 * Fake workers and a real router. `firstTokenFromPrefill` defaults to false here (the tests of the
 * one-shot prefill answer); the streamed first token has its own tests below.
 */
async function stack(opts: { prefill?: number; decode?: number; requestTimeoutMs?: number; healthIntervalMs?: number; bodyLimit?: number; firstTokenFromPrefill?: boolean; policy?: 'cache_aware' | 'round_robin'; maxEventBytes?: number; workerWaitMs?: number; migrationLimit?: number; decodePolicy?: 'cache_aware'; unavailableWaitMs?: number; sseKeepAliveMs?: number; legSilenceMs?: number; model?: string } = {}): Promise<Stack> {
  const prefill = await Promise.all(Array.from({ length: opts.prefill ?? 1 }, () => new FakeWorker('prefill').start()));
  const decode = await Promise.all(Array.from({ length: opts.decode ?? 1 }, () => new FakeWorker('decode').start()));
  const router = await startRouter({
    host: '127.0.0.1',
    port: 0,
    prefill: prefill.map((p, i) => ({ url: p.url, bootstrapPort: 9000 + i })),
    decode: decode.map((d) => ({ url: d.url })),
    healthIntervalMs: opts.healthIntervalMs ?? 100,
    requestTimeoutMs: opts.requestTimeoutMs ?? 10_000,
    abortTimeoutMs: 500,
    firstTokenFromPrefill: opts.firstTokenFromPrefill ?? false,
    // 0: a request finding no healthy worker is answered 503 at once (the wait has its own test)
    workerWaitMs: opts.workerWaitMs ?? 0,
    ...(opts.migrationLimit !== undefined ? { migrationLimit: opts.migrationLimit } : {}),
    ...(opts.unavailableWaitMs !== undefined ? { unavailableWaitMs: opts.unavailableWaitMs } : {}),
    ...(opts.sseKeepAliveMs !== undefined ? { sseKeepAliveMs: opts.sseKeepAliveMs } : {}),
    ...(opts.legSilenceMs !== undefined ? { legSilenceMs: opts.legSilenceMs } : {}),
    ...(opts.bodyLimit ? { bodyLimit: opts.bodyLimit } : {}),
    ...(opts.policy ? { policy: opts.policy } : {}),
    ...(opts.decodePolicy ? { decodePolicy: opts.decodePolicy } : {}),
    ...(opts.maxEventBytes ? { maxEventBytes: opts.maxEventBytes } : {}),
    ...(opts.model ? { model: opts.model } : {}),
    log: { level: 'silent' },
  });
  const client = new OpenAI({ baseURL: `${router.url}/v1`, apiKey: 'none', maxRetries: 0, timeout: 10_000 });
  const s = { router, prefill, decode, client };
  open.push(s);
  return s;
}

async function waitFor(fn: () => boolean, timeoutMs: number, stepMs = 5): Promise<boolean> {
  const end = Date.now() + timeoutMs;
  for (;;) {
    if (fn()) return true;
    if (Date.now() > end) return false;
    await sleep(stepMs);
  }
}

/** Every lease released exactly once: acquired == released and each load 0, within `ms`. */
async function assertReleased(s: Stack, ms = 1000): Promise<void> {
  const r = s.router.registry;
  const ok = await waitFor(() => r.acquiredTotal === r.releasedTotal && r.workers.every((w) => w.load === 0), ms);
  assert.ok(ok, `loads released: acquired ${r.acquiredTotal}, released ${r.releasedTotal}, loads ${r.workers.map((w) => w.load).join(',')}`);
  assert.equal(r.acquiredTotal, r.releasedTotal);
  for (const w of r.workers) assert.equal(w.load, 0, `${w.role} ${w.url} load`);
  assert.equal(s.router.inflight, 0);
}

async function metric(s: Stack, name: string): Promise<string> {
  const text = await (await fetch(`${s.router.url}/metrics`)).text();
  return text
    .split('\n')
    .filter((l) => l.startsWith(name))
    .join('\n');
}

async function outcomeCount(s: Stack, outcome: string): Promise<number> {
  const line = (await metric(s, 'pdserve_router_requests_total')).split('\n').find((l) => l.includes(`outcome="${outcome}"`));
  return Number(line?.split(' ').pop() ?? NaN);
}

afterEach(async () => {
  while (open.length) {
    const s = open.pop()!;
    await s.router.close();
    await Promise.all([...s.prefill, ...s.decode].map((w) => w.close()));
  }
});

after(() => {
  // nothing global
});

function isApiError(status: number | undefined, re?: RegExp) {
  return (e: unknown) => {
    assert.ok(e instanceof OpenAI.APIError, `APIError, got ${String(e)}`);
    if (status !== undefined) assert.equal(e.status, status, e.message);
    if (re) assert.match(e.message, re);
    return true;
  };
}

// ------------------------------------------------------------------------------------------
// Tests
// ------------------------------------------------------------------------------------------

describe('router: happy paths through the openai client', () => {
  test('non-stream completion: text, usage, finish_reason, same body to both workers', async () => {
    const s = await stack();
    const r = await s.client.completions.create({ model: 'fake-model', prompt: 'Say hi', max_tokens: 3, temperature: 0 });
    assert.match(r.id, /^cmpl-[0-9a-f]{24}$/);
    assert.equal(r.object, 'text_completion');
    assert.equal(r.model, 'fake-model');
    assert.equal(r.choices[0]!.text, 'Hello, world');
    assert.equal(r.choices[0]!.finish_reason, 'length');
    assert.deepEqual(r.usage, { prompt_tokens: 3, completion_tokens: 3, total_tokens: 6, prompt_tokens_details: { cached_tokens: 0 } });

    const [pb] = s.prefill[0]!.generates;
    const [db] = s.decode[0]!.generates;
    assert.deepEqual(pb, db, 'the same /generate body goes to prefill and decode');
    assert.equal(pb!.rid, r.id);
    assert.equal(pb!.text, 'Say hi');
    assert.equal(pb!.bootstrap_host, '127.0.0.1');
    assert.equal(pb!.bootstrap_port, 9000);
    assert.match(String(pb!.bootstrap_room), /^\d{1,19}$/);
    assert.ok(BigInt(String(pb!.bootstrap_room)) < 2n ** 63n);
    assert.equal(pb!.sampling_params.max_new_tokens, 3);
    assert.equal(pb!.sampling_params.temperature, 0);
    assert.equal(s.prefill[0]!.aborts.length + s.decode[0]!.aborts.length, 0, 'no aborts on success');
    await assertReleased(s);
    assert.equal(await outcomeCount(s, 'ok'), 1);
  });

  test('stream completion with include_usage', async () => {
    const s = await stack();
    s.decode[0]!.decode = () => ({ tokens: ['a', 'b', 'c', 'd'], intervalMs: 1, finish: 'stop' });
    const stream = await s.client.completions.create({ model: 'fake-model', prompt: [1, 2, 3], max_tokens: 10, stream: true, stream_options: { include_usage: true } });
    let text = '';
    const finishes: (string | null)[] = [];
    let usage: OpenAI.CompletionUsage | undefined;
    const ids = new Set<string>();
    for await (const ch of stream) {
      ids.add(ch.id);
      if (ch.choices[0]) {
        text += ch.choices[0].text;
        finishes.push(ch.choices[0].finish_reason);
      }
      if (ch.usage) usage = ch.usage;
    }
    assert.equal(text, 'abcd');
    assert.equal(finishes.at(-1), 'stop');
    assert.ok(finishes.slice(0, -1).every((f) => f === null));
    assert.deepEqual(usage, { prompt_tokens: 3, completion_tokens: 4, total_tokens: 7, prompt_tokens_details: { cached_tokens: 0 } });
    assert.equal(ids.size, 1);
    assert.deepEqual(s.decode[0]!.generates[0]!.input_ids, [1, 2, 3]);
    await assertReleased(s);
  });

  test('chat non-stream and stream: role chunk first, finish chunk last, usage', async () => {
    const s = await stack();
    s.decode[0]!.decode = () => ({ tokens: ['I', ' am', ' fine'], intervalMs: 1, finish: 'stop' });
    const messages = [
      { role: 'system' as const, content: 'be brief' },
      { role: 'user' as const, content: [{ type: 'text' as const, text: 'how' }, { type: 'text' as const, text: 'are you' }] },
    ];
    const r = await s.client.chat.completions.create({ model: 'fake-model', messages, max_completion_tokens: 8 });
    assert.match(r.id, /^chatcmpl-/);
    assert.equal(r.object, 'chat.completion');
    assert.deepEqual(r.choices[0]!.message.role, 'assistant');
    assert.equal(r.choices[0]!.message.content, 'I am fine');
    assert.equal(r.choices[0]!.finish_reason, 'stop');
    assert.equal(r.usage?.completion_tokens, 3);
    assert.deepEqual(s.decode[0]!.generates[0]!.messages, [
      { role: 'system', content: 'be brief' },
      { role: 'user', content: 'how\nare you' },
    ]);
    assert.equal(s.decode[0]!.generates[0]!.sampling_params.max_new_tokens, 8);

    const stream = await s.client.chat.completions.create({ model: 'fake-model', messages, stream: true, stream_options: { include_usage: true } });
    const chunks: OpenAI.ChatCompletionChunk[] = [];
    for await (const ch of stream) chunks.push(ch);
    assert.equal(chunks[0]!.object, 'chat.completion.chunk');
    assert.equal(chunks[0]!.choices[0]!.delta.role, 'assistant');
    const withChoices = chunks.filter((c) => c.choices.length > 0);
    assert.equal(withChoices.at(-1)!.choices[0]!.finish_reason, 'stop');
    assert.equal(withChoices.map((c) => c.choices[0]!.delta.content ?? '').join(''), 'I am fine');
    const last = chunks.at(-1)!;
    assert.deepEqual(last.choices, []);
    assert.deepEqual(last.usage, { prompt_tokens: 3, completion_tokens: 3, total_tokens: 6, prompt_tokens_details: { cached_tokens: 0 } });
    await assertReleased(s);
  });

  test('raw SSE ends with data: [DONE]; x-request-id is the rid', async () => {
    const s = await stack();
    const r = await fetch(`${s.router.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ prompt: 'x', stream: true }) });
    assert.equal(r.status, 200);
    assert.match(r.headers.get('content-type') ?? '', /text\/event-stream/);
    const rid = r.headers.get('x-request-id');
    const text = await r.text();
    assert.ok(text.trimEnd().endsWith('data: [DONE]'), text);
    assert.ok(text.includes(`"id":"${rid}"`));
    await assertReleased(s);
  });

  test('concurrent requests never mix: each stream carries its own rid and text', async () => {
    const s = await stack();
    s.decode[0]!.decode = (b) => ({ tokens: [...String(b.text)].map((c) => c + '.'), intervalMs: 3, finish: 'stop' });
    const prompts = ['alpha', 'bravo', 'charlie', 'delta', 'echo', 'foxtrot', 'golf', 'hotel'];
    const results = await Promise.all(
      prompts.map(async (p) => {
        const st = await s.client.completions.create({ model: 'fake-model', prompt: p, stream: true, max_tokens: 50 });
        let text = '';
        const ids = new Set<string>();
        for await (const ch of st) {
          ids.add(ch.id);
          text += ch.choices[0]?.text ?? '';
        }
        return { text, ids };
      }),
    );
    for (const [i, p] of prompts.entries()) {
      assert.equal(results[i]!.text, [...p].map((c) => c + '.').join(''));
      assert.equal(results[i]!.ids.size, 1);
    }
    assert.equal(new Set(results.map((r) => [...r.ids][0])).size, prompts.length, 'distinct rids');
    const rooms = new Set(s.prefill[0]!.generates.map((g) => g.bootstrap_room));
    assert.equal(rooms.size, prompts.length, 'distinct bootstrap rooms');
    await assertReleased(s);
  });

  test('GET /v1/models, /health, /workers, /metrics', async () => {
    const s = await stack();
    const models = await s.client.models.list();
    assert.deepEqual(
      models.data.map((m) => [m.id, m.object, m.owned_by, typeof m.created]),
      [['fake-model', 'model', 'pdserve', 'number']],
    );
    const h = await (await fetch(`${s.router.url}/health`)).json();
    assert.equal(h.status, 'ok');
    assert.deepEqual(h.prefill, { healthy: 1, total: 1 });
    const w = await (await fetch(`${s.router.url}/workers`)).json();
    assert.equal(w.workers.length, 2);
    const p = w.workers.find((x: any) => x.role === 'prefill');
    assert.deepEqual(
      { url: p.url, bootstrap_host: p.bootstrap_host, bootstrap_port: p.bootstrap_port, healthy: p.healthy, model: p.model, load: p.load, last_error: p.last_error },
      { url: s.prefill[0]!.url, bootstrap_host: '127.0.0.1', bootstrap_port: 9000, healthy: true, model: 'fake-model', load: 0, last_error: null },
    );
    await s.client.completions.create({ model: 'fake-model', prompt: 'hi', stream: true }).then(async (st) => {
      for await (const _ of st);
    });
    const m = await (await fetch(`${s.router.url}/metrics`)).text();
    for (const name of [
      'pdserve_time_to_first_token_seconds_bucket',
      'pdserve_inter_token_latency_seconds_bucket',
      'pdserve_e2e_request_latency_seconds_bucket',
      'pdserve_router_requests_total{outcome="ok"} 1',
      'pdserve_router_requests_total{outcome="client_abort"} 0',
      'pdserve_router_inflight_requests 0',
      `pdserve_router_worker_load{worker="${s.decode[0]!.url}"} 0`,
    ]) {
      assert.ok(m.includes(name), name);
    }
    assert.match(m, /pdserve_time_to_first_token_seconds_count 1/);
    assert.match(m, /pdserve_inter_token_latency_seconds_count 2/);
  });
});

describe('router: failures', () => {
  test("GET /debug/rooms gathers every worker's rooms; a worker that refuses or is down has rooms null and its error", async () => {
    const s = await stack({ decode: 3 });
    const room = { room: '42', rid: 'r1', state: 'Transferring', phase: 'transfer', age_ms: 5, timeline: [] };
    s.prefill[0]!.rooms = () => ({ code: 200, body: { role: 'prefill', now: 1, live: [room], recent: [] } });
    s.decode[1]!.rooms = () => ({ code: 401, body: { error: { message: 'this worker endpoint takes only requests signed with the cluster secret', type: 'authentication_error', param: null, code: 'unauthenticated' } } });
    await s.decode[2]!.app.close(); // down
    const r = await fetch(`${s.router.url}/debug/rooms`);
    assert.equal(r.status, 200);
    const { workers } = (await r.json()) as { workers: { role: string; url: string; error: string | null; rooms: { live: unknown[] } | null }[] };
    const byUrl = new Map(workers.map((w) => [w.url, w]));
    assert.equal(workers.length, 4);
    assert.deepEqual(byUrl.get(s.prefill[0]!.url), { role: 'prefill', url: s.prefill[0]!.url, error: null, rooms: { role: 'prefill', now: 1, live: [room], recent: [] } });
    assert.equal(byUrl.get(s.decode[0]!.url)!.error, null);
    assert.deepEqual(byUrl.get(s.decode[0]!.url)!.rooms!.live, []);
    assert.equal(byUrl.get(s.decode[1]!.url)!.rooms, null);
    assert.match(byUrl.get(s.decode[1]!.url)!.error!, /^HTTP 401: this worker endpoint takes only requests signed/);
    assert.equal(byUrl.get(s.decode[2]!.url)!.rooms, null);
    assert.ok(byUrl.get(s.decode[2]!.url)!.error, 'the down worker has an error');
  });

  test('a request refused before dispatch (400, malformed JSON) does not stay in flight in /debug/traces', async () => {
    const s = await stack();
    const post = (body: string) => fetch(`${s.router.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body });
    assert.equal((await post(JSON.stringify({ model: 'fake-model', prompt: 'p', foo_bar: 1 }))).status, 400);
    assert.equal((await post('{"model":')).status, 400);
    const active = async () => ((await (await fetch(`${s.router.url}/debug/traces?active=1`)).json()) as { traces: unknown[] }).traces.length;
    const all = ((await (await fetch(`${s.router.url}/debug/traces`)).json()) as { traces: { outcome: string | null }[] }).traces;
    assert.equal(all.length, 2, 'both requests were traced');
    let n = -1;
    assert.ok(await (async () => { const end = Date.now() + 3000; while (Date.now() < end) { if ((n = await active()) === 0) return true; await sleep(100); } return false; })(), `traces still in flight: ${n}`);
  });

  test('client abort mid-stream → abort_request to BOTH workers within 1 s, loads back to 0', async () => {
    const s = await stack();
    s.decode[0]!.decode = () => ({ tokens: Array.from({ length: 2000 }, (_, i) => `t${i} `), intervalMs: 10 });
    const ac = new AbortController();
    const st = await s.client.completions.create({ model: 'fake-model', prompt: 'long', stream: true, max_tokens: 2000 }, { signal: ac.signal });
    let rid = '';
    let n = 0;
    // openai v6 ends the iteration quietly on abort (it swallows the AbortError).
    await (async () => {
      for await (const ch of st) {
        rid = ch.id;
        if (++n === 3) ac.abort();
      }
    })().catch(() => {});
    // Node 22+'s fetch may hand over a chunk already buffered when the abort fired.
    assert.ok(n >= 3 && n <= 5, `iteration stopped right after the abort (${n} chunks)`);
    const t0 = Date.now();
    assert.ok(await waitFor(() => s.prefill[0]!.abortsFor(rid).length === 1 && s.decode[0]!.abortsFor(rid).length === 1, 1000), 'both workers got abort_request');
    assert.ok(Date.now() - t0 < 1000);
    assert.equal(s.decode[0]!.aborts[0]!.bootstrap_room, s.decode[0]!.generates[0]!.bootstrap_room);
    await assertReleased(s);
    assert.ok(await waitFor(() => s.decode[0]!.active === 0, 1000), 'decode stopped streaming');
    assert.equal(await outcomeCount(s, 'client_abort'), 1);
    assert.equal(await outcomeCount(s, 'ok'), 0);
  });

  test('client abort while waiting for prefill (non-stream) → aborts to both, loads 0', async () => {
    const s = await stack();
    s.prefill[0]!.prefill = () => ({ delayMs: 5000 });
    s.decode[0]!.decode = () => ({ startDelayMs: 5000, tokens: ['x'] });
    const ac = new AbortController();
    const p = s.client.completions.create({ model: 'fake-model', prompt: 'slow', max_tokens: 5 }, { signal: ac.signal });
    assert.ok(await waitFor(() => s.decode[0]!.generates.length === 1 && s.prefill[0]!.generates.length === 1, 1000));
    ac.abort();
    await assert.rejects(p);
    const rid = s.decode[0]!.generates[0]!.rid;
    assert.ok(await waitFor(() => s.prefill[0]!.abortsFor(rid).length === 1 && s.decode[0]!.abortsFor(rid).length === 1, 1000));
    await assertReleased(s);
    assert.ok(await waitFor(() => s.prefill[0]!.active === 0 && s.decode[0]!.active === 0, 1000));
    assert.equal(await outcomeCount(s, 'client_abort'), 1);
  });

  for (const stream of [false, true]) {
    test(`prefill error 10 ms in (${stream ? 'stream' : 'non-stream'}) → client error within 1 s, decode gets abort_request`, async () => {
      const s = await stack();
      s.prefill[0]!.prefill = () => ({ delayMs: 10, status: 500, message: 'KV transfer failed: peer lost', code: 'kv_transfer_failed' });
      s.decode[0]!.decode = () => ({ startDelayMs: 30_000, tokens: ['never'] });
      const t0 = Date.now();
      await assert.rejects(async () => {
        const r = await s.client.completions.create({ model: 'fake-model', prompt: 'p', stream });
        if (stream) for await (const _ of r as AsyncIterable<unknown>);
      }, isApiError(500, /prefill worker error: KV transfer failed: peer lost/));
      assert.ok(Date.now() - t0 < 1000, `error after ${Date.now() - t0} ms`);
      const rid = s.decode[0]!.generates[0]!.rid;
      assert.ok(await waitFor(() => s.decode[0]!.abortsFor(rid).length === 1, 1000), 'decode got abort_request');
      assert.equal(s.prefill[0]!.abortsFor(rid).length, 0, 'prefill already terminal: no abort');
      await assertReleased(s);
      assert.ok(await waitFor(() => s.decode[0]!.active === 0, 1000), 'decode request cancelled');
      assert.equal(await outcomeCount(s, 'error'), 1);
    });
  }

  test('prefill 4xx passes through as 4xx with its message', async () => {
    const s = await stack();
    s.prefill[0]!.prefill = () => ({ delayMs: 1, status: 400, message: 'prompt (2000 tokens) + max_tokens (10) exceeds the context size (1024 tokens)', code: 'context_length_exceeded' });
    s.decode[0]!.decode = () => ({ startDelayMs: 30_000 });
    s.decode[0]!.abortDelayMs = 50;
    await assert.rejects(s.client.completions.create({ model: 'fake-model', prompt: 'p' }), (e: unknown) => {
      isApiError(400, /exceeds the context size/)(e);
      assert.equal((e as InstanceType<typeof OpenAI.APIError>).code, 'context_length_exceeded');
      return true;
    });
    // decode is told why (its room is no client's cancel), before its /generate connection closes
    const rid = s.decode[0]!.generates[0]!.rid;
    assert.ok(await waitFor(() => s.decode[0]!.abortsFor(rid).length === 1 && s.decode[0]!.active === 0, 3000), 'decode got abort_request and ended its request');
    const told = s.decode[0]!.abortsFor(rid)[0]!;
    assert.equal(told.cause?.code, 'prefill_refused');
    assert.match(told.cause?.message ?? '', /400 context_length_exceeded: prompt \(2000 tokens\)/);
    assert.ok(!s.decode[0]!.connectionClosed.has(rid), 'decode ended the request on the abort, not on a closed connection');
    await assertReleased(s);
    // a 4xx from a worker, and one the router gives before dispatch (an unknown field), are the client's errors, not failures
    await assert.rejects(s.client.completions.create({ model: 'fake-model', prompt: 'p', no_such_field: 1 } as never), isApiError(400, /Unrecognized request argument/));
    assert.equal(await outcomeCount(s, 'client_error'), 2);
    assert.equal(await outcomeCount(s, 'error'), 0);
  });

  test('decode error before the stream → client error, prefill gets abort_request', async () => {
    const s = await stack();
    s.prefill[0]!.prefill = () => ({ delayMs: 30_000 });
    s.decode[0]!.decode = () => ({ startDelayMs: 10, status: 503, message: 'decode prealloc queue is full' });
    const t0 = Date.now();
    await assert.rejects(s.client.completions.create({ model: 'fake-model', prompt: 'p', stream: true }), isApiError(503, /decode prealloc queue is full/));
    assert.ok(Date.now() - t0 < 1000);
    const rid = s.prefill[0]!.generates[0]!.rid;
    assert.ok(await waitFor(() => s.prefill[0]!.abortsFor(rid).length === 1, 1000));
    assert.equal(s.decode[0]!.abortsFor(rid).length, 0);
    await assertReleased(s);
    assert.ok(await waitFor(() => s.prefill[0]!.active === 0, 1000));
  });

  test('decode error event mid-stream → SSE error event (no [DONE]) for stream, 500 for non-stream', async () => {
    const s = await stack();
    s.decode[0]!.decode = () => ({ tokens: ['a', 'b', 'c', 'd'], intervalMs: 1, errorAfter: 2 });
    let got = '';
    await assert.rejects(async () => {
      const st = await s.client.completions.create({ model: 'fake-model', prompt: 'p', stream: true });
      for await (const ch of st) got += ch.choices[0]?.text ?? '';
    }, isApiError(undefined, /decode worker error: slot exploded/));
    assert.equal(got, 'ab');
    const raw = await (await fetch(`${s.router.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ prompt: 'x', stream: true }) })).text();
    assert.match(raw, /data: \{"error":\{"message":"decode worker error: slot exploded"/);
    assert.ok(!raw.includes('[DONE]'));
    await assert.rejects(s.client.completions.create({ model: 'fake-model', prompt: 'p' }), isApiError(500, /slot exploded/));
    await assertReleased(s);
    assert.equal(await outcomeCount(s, 'error'), 3);
  });

  test('decode stream that ends without a finish event → 502', async () => {
    const s = await stack();
    s.decode[0]!.decode = () => ({ tokens: ['a', 'b'], truncateAfter: 1 });
    await assert.rejects(s.client.completions.create({ model: 'fake-model', prompt: 'p' }), isApiError(502, /ended its stream before the finish event/));
    await assertReleased(s);
  });

  test('decode finish_reason abort → 500 error, not a normal end', async () => {
    const s = await stack();
    s.decode[0]!.decode = () => ({ tokens: ['a'], finish: 'abort' });
    await assert.rejects(s.client.completions.create({ model: 'fake-model', prompt: 'p' }), isApiError(500, /generation aborted/));
    await assertReleased(s);
  });

  test('prefill error after decode started generating is ignored (decode output stands)', async () => {
    const s = await stack();
    s.prefill[0]!.prefill = () => ({ delayMs: 40, status: 500, message: 'late ack timeout' });
    s.decode[0]!.decode = () => ({ tokens: ['a', 'b', 'c', 'd', 'e'], intervalMs: 20, finish: 'stop' });
    const r = await s.client.completions.create({ model: 'fake-model', prompt: 'p' });
    assert.equal(r.choices[0]!.text, 'abcde');
    await assertReleased(s);
  });

  test('prefill answering after decode finished: client served at once, no abort, lease released when prefill answers', async () => {
    const s = await stack();
    // prefill answers 1.5 s late: a response within 1.2 s did not wait for it (a margin a loaded machine needs)
    s.prefill[0]!.prefill = () => ({ delayMs: 1500 });
    const t0 = Date.now();
    const r = await s.client.completions.create({ model: 'fake-model', prompt: 'p' });
    assert.ok(Date.now() - t0 < 1200, `response does not wait for prefill (${Date.now() - t0} ms)`);
    assert.equal(r.choices[0]!.text, 'Hello, world');
    assert.equal(s.router.registry.workers[0]!.load, 1, 'prefill lease still held while its answer is pending');
    await assertReleased(s, 3000);
    assert.equal(s.prefill[0]!.aborts.length + s.decode[0]!.aborts.length, 0);
    assert.equal(s.prefill[0]!.connectionClosed.size, 0, 'prefill request not cut');
  });

  test('request deadline → 504 before streaming, SSE error after; aborts to both', async () => {
    const s = await stack({ requestTimeoutMs: 300 });
    s.prefill[0]!.prefill = () => ({ delayMs: 30_000 });
    s.decode[0]!.decode = () => ({ startDelayMs: 30_000 });
    const t0 = Date.now();
    await assert.rejects(s.client.completions.create({ model: 'fake-model', prompt: 'p' }), isApiError(504, /timed out after 300 ms/));
    assert.ok(Date.now() - t0 < 1000);
    const rid = s.decode[0]!.generates[0]!.rid;
    assert.ok(await waitFor(() => s.prefill[0]!.abortsFor(rid).length === 1 && s.decode[0]!.abortsFor(rid).length === 1, 1000));
    await assertReleased(s);

    s.prefill[0]!.prefill = () => ({ delayMs: 1 });
    s.decode[0]!.decode = () => ({ tokens: ['a', 'b', 'c'], hangAfter: 2 });
    let got = '';
    await assert.rejects(async () => {
      const st = await s.client.completions.create({ model: 'fake-model', prompt: 'p', stream: true });
      for await (const ch of st) got += ch.choices[0]?.text ?? '';
    }, isApiError(undefined, /timed out/));
    assert.equal(got, 'ab');
    const rid2 = s.decode[0]!.generates[1]!.rid;
    assert.ok(await waitFor(() => s.prefill[0]!.abortsFor(rid2).length === 1 && s.decode[0]!.abortsFor(rid2).length === 1, 1000));
    await assertReleased(s);
    assert.equal(await outcomeCount(s, 'timeout'), 2);
  });

  test('POST /workers/probe probes a worker now (a supervisor push after a restart); unknown url → 404', async () => {
    const s = await stack({ healthIntervalMs: 60_000 });
    s.decode[0]!.health = () => ({ code: 200, body: { status: 'loading', role: 'decode' } });
    await s.router.registry.checkAll();
    await s.router.registry.checkAll();
    assert.equal(s.router.registry.healthyCount('decode'), 0);
    s.decode[0]!.health = () => ({ code: 200, body: { status: 'ok', role: 'decode' } });
    const r = await fetch(`${s.router.url}/workers/probe`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ url: s.decode[0]!.url }) });
    assert.equal(r.status, 200);
    assert.equal(((await r.json()) as any).healthy, true, 'healthy right after the push, with a 60 s poll');
    assert.equal(s.router.registry.healthyCount('decode'), 1);
    const bad = await fetch(`${s.router.url}/workers/probe`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ url: 'http://127.0.0.1:1' }) });
    assert.equal(bad.status, 404);
    assert.equal(((await bad.json()) as any).error.code, 'worker_not_found');
  });

  test('no healthy worker → 503 (prefill down; decode reporting not ok)', async () => {
    const s = await stack();
    await s.prefill[0]!.close();
    await s.router.registry.checkAll();
    await assert.rejects(s.client.completions.create({ model: 'fake-model', prompt: 'p' }), isApiError(503, /no healthy prefill worker/));
    const h = await fetch(`${s.router.url}/health`);
    assert.equal(h.status, 503);
    const w = await (await fetch(`${s.router.url}/workers`)).json();
    const p = w.workers.find((x: any) => x.role === 'prefill');
    assert.equal(p.healthy, false);
    assert.match(p.last_error, /ECONNREFUSED|GET \/health/);
    assert.equal(s.decode[0]!.generates.length, 0, 'nothing dispatched');

    const s2 = await stack();
    s2.decode[0]!.health = () => ({ code: 200, body: { status: 'loading', role: 'decode' } });
    await s2.router.registry.checkAll();
    assert.equal(s2.router.registry.healthyCount('decode'), 1, 'one failed probe is not enough (no flapping)');
    await s2.router.registry.checkAll();
    assert.equal(s2.router.registry.healthyCount('decode'), 0, 'two in a row are');
    await assert.rejects(s2.client.chat.completions.create({ model: 'fake-model', messages: [{ role: 'user', content: 'hi' }] }), isApiError(503, /no healthy decode worker/));
    // Recovers on the next probe.
    s2.decode[0]!.health = () => ({ code: 200, body: { status: 'ok', role: 'decode', model: 'fake-model' } });
    assert.ok(await waitFor(() => s2.router.registry.healthyCount('decode') === 1, 1000));
    const ok = await s2.client.chat.completions.create({ model: 'fake-model', messages: [{ role: 'user', content: 'hi' }] });
    assert.equal(ok.choices[0]!.message.content, 'Hello, world');
    await assertReleased(s2);
  });

  test('a worker reporting the wrong role is unhealthy', async () => {
    const s = await stack();
    s.prefill[0]!.health = () => ({ code: 200, body: { status: 'ok', role: 'decode' } });
    await s.router.registry.checkAll();
    await s.router.registry.checkAll();
    assert.match(String(s.router.registry.workers[0]!.lastError), /role is "decode", expected 'prefill'/);
    await assert.rejects(s.client.completions.create({ model: 'fake-model', prompt: 'p' }), isApiError(503));
  });

  test('prefill unreachable at dispatch → marked unhealthy at once, decode aborted; no other prefill → 503', async () => {
    const s = await stack({ healthIntervalMs: 60_000 });
    s.decode[0]!.decode = () => ({ startDelayMs: 30_000 });
    await s.prefill[0]!.close();
    let rid = '';
    await assert.rejects(s.client.completions.create({ model: 'fake-model', prompt: 'p' }), (e: unknown) => {
      isApiError(503, /no healthy prefill/)(e);
      rid = String((e as InstanceType<typeof OpenAI.APIError>).requestID);
      return true;
    });
    assert.match(rid, /^cmpl-/);
    assert.equal(s.router.registry.workers[0]!.healthy, false);
    // decode may or may not have seen /generate before the cancel; it gets abort_request either way.
    assert.ok(await waitFor(() => s.decode[0]!.abortsFor(rid).length === 1, 1000));
    await assertReleased(s);
  });

  test('a worker that cannot be connected to never saw the request: it is dispatched again to another pair', async () => {
    const s = await stack({ prefill: 2, decode: 2, healthIntervalMs: 60_000, policy: 'round_robin' });
    await s.prefill[0]!.close();
    await s.decode[1]!.close();
    for (let i = 0; i < 4; i++) {
      const r = await s.client.completions.create({ model: 'fake-model', prompt: `p${i}` });
      assert.equal(r.choices.length, 1, 'served by the live pair');
    }
    assert.equal(s.router.registry.workers.filter((w) => w.healthy).length, 2, 'both dead workers marked unhealthy');
    assert.equal(await outcomeCount(s, 'error'), 0);
    await assertReleased(s);
  });

  test('a worker closing the connection before any response byte: dispatched again to another pair, the first prefill leg aborted; after the headers it is an error', async () => {
    const s = await stack({ decode: 2, healthIntervalMs: 60_000, policy: 'round_robin' });
    let first = true;
    for (const d of s.decode) d.decode = () => (first ? ((first = false), { startDelayMs: 20, destroy: true }) : { tokens: ['a', 'b'] });
    // The first attempt's prefill leg is still open when decode's connection closes.
    s.prefill[0]!.prefill = () => (s.prefill[0]!.generates.length === 1 ? { delayMs: 30_000 } : { delayMs: 5 });
    const r = await s.client.completions.create({ model: 'fake-model', prompt: 'p' });
    assert.equal(r.choices[0]!.text, 'ab', 'served by the second attempt');
    assert.equal(s.decode.reduce((n, d) => n + d.generates.length, 0), 2, 'two attempts reached decode');
    const gens = s.prefill[0]!.generates;
    assert.equal(gens.length, 2);
    assert.notEqual(gens[0]!.bootstrap_room, gens[1]!.bootstrap_room, 'the new attempt has a new room');
    assert.ok(await waitFor(() => s.prefill[0]!.aborts.some((a) => a.bootstrap_room === gens[0]!.bootstrap_room), 1000), "the first attempt's prefill leg got abort_request");
    assert.equal(await outcomeCount(s, 'error'), 0);
    assert.equal(s.router.registry.healthyCount('decode'), 1, 'the decode that cut its connection is out until its next good probe');
    await s.router.registry.checkAll();
    // A connection lost after decode's output, on every decode: each leaves the rotation, then no decode is left.
    s.decode[0]!.decode = s.decode[1]!.decode = () => ({ tokens: ['a', 'b'], destroyAfter: 1 });
    await assert.rejects(s.client.completions.create({ model: 'fake-model', prompt: 'q' }), isApiError(503, /no healthy decode/));
    assert.equal(s.prefill[0]!.generates.length, 2 + 2, 'one attempt per decode');
    await assertReleased(s);
  });

  test('bad HTTP input → 400/413 OpenAI bodies through the router, nothing dispatched', async () => {
    const s = await stack({ bodyLimit: 64 * 1024 });
    const post = (body: string, url = '/v1/completions') => fetch(`${s.router.url}${url}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body });
    for (const [body, status, re] of [
      ['{"model": "x", "prompt": ', 400, /JSON/],
      [JSON.stringify({ model: 'fake-model' }), 400, /prompt/],
      [JSON.stringify({ prompt: 'x', max_tokens: -1 }), 400, /max_tokens/],
      [JSON.stringify({ prompt: 'x', max_tokens: 0, echo: true }), 400, /'max_tokens': must be at least 1 .*prompt logprobs are not computed/],
      [JSON.stringify({ prompt: 'x', max_tokens: 'ten' }), 400, /max_tokens/],
      [JSON.stringify({ prompt: 'x', n: 17 }), 400, /exceeds the limit of 16/],
      [JSON.stringify({ prompt: 'x'.repeat(100 * 1024) }), 413, /too large/],
    ] as const) {
      const r = await post(body);
      assert.equal(r.status, status, body.slice(0, 50));
      const j = (await r.json()) as { error: { message: string; type: string } };
      assert.match(j.error.message, re);
      assert.equal(j.error.type, 'invalid_request_error');
    }
    const chat = await post(JSON.stringify({ model: 'fake-model' }), '/v1/chat/completions');
    assert.equal(chat.status, 400);
    assert.match(((await chat.json()) as any).error.message, /messages/);
    assert.equal(s.prefill[0]!.generates.length + s.decode[0]!.generates.length, 0);
    assert.equal(s.router.registry.acquiredTotal, 0);
  });
});

/** A raw streamed completion's SSE data payloads. */
async function rawStream(s: Stack): Promise<string[]> {
  const r = await fetch(`${s.router.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'fake-model', prompt: 'hi', stream: true }) });
  assert.equal(r.status, 200);
  return (await r.text()).split('\n\n').filter((e) => e.startsWith('data: ')).map((e) => e.slice(6));
}
const texts = (events: string[]) => events.filter((e) => e !== '[DONE]').map((e) => (JSON.parse(e) as { choices?: { text: string }[] }).choices?.[0]?.text ?? '');

describe('router: first token from prefill (before the KV handoff)', () => {

  test('token 1 comes from prefill, decode streams from token 2; decode events wait for prefill\'s first', async () => {
    const s = await stack({ firstTokenFromPrefill: true });
    s.prefill[0]!.prefill = () => ({ delayMs: 80, first: 'Hello' });
    s.decode[0]!.decode = () => ({ tokens: ['Hello', ',', ' world'], intervalMs: 1, finish: 'stop' });
    const events = await rawStream(s);
    assert.deepEqual(texts(events), ['Hello', ',', ' world', '']);
    assert.equal(events.at(-1), '[DONE]');
    assert.equal(s.prefill[0]!.generates[0]!.first_token_from_prefill, true);
    assert.equal(s.decode[0]!.generates[0]!.first_token_from_prefill, true);
    const r = await s.client.completions.create({ model: 'fake-model', prompt: 'hi' });
    assert.equal(r.choices[0]!.text, 'Hello, world');
    assert.equal(r.usage?.completion_tokens, 3);
    await assertReleased(s);
  });

  test("decode refuses (an error status) while prefill's token 1 is still coming: the client gets the error at once, not after the first token", async () => {
    const s = await stack({ firstTokenFromPrefill: true });
    s.prefill[0]!.prefill = () => ({ delayMs: 30_000 });
    s.decode[0]!.decode = () => ({ startDelayMs: 10, status: 503, message: 'decode prealloc queue is full' });
    const t0 = Date.now();
    await assert.rejects(s.client.completions.create({ model: 'fake-model', prompt: 'p', stream: true }), isApiError(503, /decode prealloc queue is full/));
    assert.ok(Date.now() - t0 < 1000, `answered after ${Date.now() - t0} ms`);
    await assertReleased(s);
  });

  test('handoff fails after token 1 with no migration left (migrationLimit 0): SSE error after the first token (no [DONE]); non-stream 502; decode aborted', async () => {
    const s = await stack({ firstTokenFromPrefill: true, migrationLimit: 0 });
    s.prefill[0]!.prefill = () => ({ delayMs: 1, first: 'Hello', failAfterFirstMs: 30 });
    s.decode[0]!.decode = () => ({ startDelayMs: 30_000, tokens: ['never'] });
    const events = await rawStream(s);
    assert.equal(texts(events)[0], 'Hello');
    const last = JSON.parse(events.at(-1)!) as { error?: { code: string } };
    assert.equal(last.error?.code, 'kv_transfer_failed');
    assert.ok(!events.includes('[DONE]'));
    await assert.rejects(s.client.completions.create({ model: 'fake-model', prompt: 'hi' }), isApiError(502, /KV transfer failed/));
    assert.ok(await waitFor(() => s.decode[0]!.aborts.length === 2, 1000), 'abort_request reached decode for both requests');
    await assertReleased(s);
  });

  test('decode\'s /generate is written before prefill\'s (prefill evaluates only once decode has registered)', async () => {
    const s = await stack({ firstTokenFromPrefill: true });
    const sent: string[] = [];
    const onSend = (m: unknown) => {
      const { request } = m as { request: { origin: string; path: string } };
      if (request.path === '/generate') sent.push(request.origin);
    };
    diagnostics.subscribe('undici:client:sendHeaders', onSend);
    try {
      for (let i = 0; i < 3; i++) await s.client.completions.create({ model: 'fake-model', prompt: `hi ${i}` });
    } finally {
      diagnostics.unsubscribe('undici:client:sendHeaders', onSend);
    }
    const p = new URL(s.prefill[0]!.url).origin;
    const d = new URL(s.decode[0]!.url).origin;
    assert.deepEqual(sent, [d, p, d, p, d, p]);
    await assertReleased(s);
  });

  test('prefill\'s stream read in pieces: an event split across writes, two events in one write', async () => {
    const s = await stack({ firstTokenFromPrefill: true });
    const ev = (rid: string) => JSON.stringify({ text: 'Hel', token_ids: [99], meta_info: { id: rid, prompt_tokens: 3, completion_tokens: 1, finish_reason: null } });
    s.prefill[0]!.prefill = (b) => {
      const first = `data: ${ev(b.rid)}\r\n\r\n`;
      return { rawPieces: [': comment\n', first.slice(0, 9), first.slice(9, 30), first.slice(30) + 'data: {"transfer":{"meta_info":{}}}\n\ndata: [DONE]\n\n'] };
    };
    s.decode[0]!.decode = () => ({ tokens: ['Hel', 'lo'], intervalMs: 1, finish: 'stop' });
    const r = await s.client.completions.create({ model: 'fake-model', prompt: 'hi' });
    assert.equal(r.choices[0]!.text, 'Hello');
    const stream = await s.client.completions.create({ model: 'fake-model', prompt: 'hi', stream: true });
    let text = '';
    for await (const c of stream) text += c.choices[0]?.text ?? '';
    assert.equal(text, 'Hello');
    await assertReleased(s);
  });

  test('prefill\'s stream: ended before the first token, an event that is not JSON, an event over maxEventBytes → 502 each; decode aborted', async () => {
    const s = await stack({ firstTokenFromPrefill: true, maxEventBytes: 1024 });
    s.decode[0]!.decode = () => ({ startDelayMs: 30_000, tokens: ['never'] });
    const cases: [string[], RegExp][] = [
      [[': nothing yet\n\n'], /ended its stream before the first token/],
      [['data: {not json\n\n'], /not JSON/],
      [[`data: "${'x'.repeat(2000)}"\n\n`], /SSE event larger than 1024 bytes/],
    ];
    for (const [pieces, re] of cases) {
      s.prefill[0]!.prefill = () => ({ rawPieces: pieces });
      await assert.rejects(s.client.completions.create({ model: 'fake-model', prompt: 'hi' }), isApiError(502, re));
    }
    // Each request's every attempt (a 502 is retried on the only pair, 1 + migrationLimit in all) ends with an abort_request to decode.
    assert.equal(s.prefill[0]!.generates.length, 3 * 4);
    assert.ok(await waitFor(() => s.decode[0]!.generates.every((g) => s.decode[0]!.aborts.some((a) => a.bootstrap_room === g.bootstrap_room && a.rid === g.rid)), 1000), "abort_request reached decode for each attempt's room");
    await assertReleased(s);
  });

  test('a prefill error after decode\'s first event is ignored (the handoff evidently succeeded)', async () => {
    const s = await stack({ firstTokenFromPrefill: true });
    s.prefill[0]!.prefill = () => ({ delayMs: 1, first: 'a', failAfterFirstMs: 150 });
    s.decode[0]!.decode = () => ({ tokens: ['a', 'b', 'c', 'd'], intervalMs: 60, finish: 'length' });
    const r = await s.client.completions.create({ model: 'fake-model', prompt: 'hi' });
    assert.equal(r.choices[0]!.text, 'abcd');
    await assertReleased(s, 2000);
  });
});

describe('router: scheduling and load accounting', () => {
  test('lease release is guarded: exactly once', () => {
    const reg = new WorkerRegistry(parseRouterConfig({ prefill: [{ url: 'http://127.0.0.1:1', bootstrapPort: 2 }], decode: [{ url: 'http://127.0.0.1:3' }], log: { level: 'silent' } }), {
      dispatcher: undefined as never,
      log: pino({ level: 'silent' }),
      intervalMs: 1000,
      timeoutMs: 100,
    });
    const w = reg.workers[0]!;
    const a = reg.acquire(w);
    const b = reg.acquire(w);
    assert.equal(w.load, 2);
    assert.equal(a.release(), true);
    assert.equal(a.release(), false);
    assert.equal(a.release(), false);
    assert.equal(w.load, 1);
    assert.equal(a.released, true);
    assert.equal(b.released, false);
    assert.equal(b.release(), true);
    assert.equal(w.load, 0);
    assert.equal(reg.acquiredTotal, 2);
    assert.equal(reg.releasedTotal, 2);
  });

  test("a worker that answered with 200 within the probe interval skips its periodic probe, at most MAX_SKIPPED_PROBES in a row; an idle one is probed every interval", async () => {
    const hits = { busy: 0, idle: 0 };
    const apps = await Promise.all((['busy', 'idle'] as const).map(async (name) => {
      const app = Fastify();
      app.get('/health', async () => {
        hits[name]++;
        return { status: 'ok', role: 'decode', model: 'm' };
      });
      await app.listen({ port: 0, host: '127.0.0.1' });
      return app;
    }));
    const urls = apps.map((a) => `http://127.0.0.1:${(a.server.address() as { port: number }).port}`);
    const reg = new WorkerRegistry({ prefill: [], decode: urls.map((url) => ({ url })) } as never, { dispatcher: undefined as never, log: pino({ level: 'silent' }), intervalMs: 40, timeoutMs: 1000 });
    try {
      await reg.start();
      const [busy, idle] = reg.workers;
      assert.ok(busy!.healthy && idle!.healthy);
      const start = { ...hits };
      const ticker = setInterval(() => reg.noteExchange(busy!), 5);
      await sleep(40 * 12);
      clearInterval(ticker);
      const busyProbes = hits.busy - start.busy;
      const idleProbes = hits.idle - start.idle;
      assert.ok(idleProbes >= 6, `the idle worker is probed every interval (${idleProbes})`);
      assert.ok(busyProbes >= 1, 'a busy worker is still probed once every MAX_SKIPPED_PROBES + 1 polls');
      assert.ok(busyProbes * 3 <= idleProbes, `the busy worker skipped most probes (${busyProbes} vs ${idleProbes})`);
      assert.ok(reg.skippedProbes > 0);
      // an unhealthy worker is probed whatever its last exchange
      reg.setUnhealthy(busy!, 'down');
      reg.noteExchange(busy!);
      const before = hits.busy;
      await sleep(40 * 3);
      assert.ok(hits.busy > before, 'probed while unhealthy');
      assert.ok(busy!.healthy, 'and restored by the probe');
    } finally {
      reg.stop();
      for (const app of apps) await app.close();
    }
  });

  test('pick: least loaded healthy worker, ties round-robin, unhealthy skipped', () => {
    const reg = new WorkerRegistry(
      parseRouterConfig({ prefill: [{ url: 'http://127.0.0.1:1', bootstrapPort: 2 }], decode: [{ url: 'http://127.0.0.1:3' }, { url: 'http://127.0.0.1:4' }, { url: 'http://127.0.0.1:5' }], log: { level: 'silent' } }),
      { dispatcher: undefined as never, log: pino({ level: 'silent' }), intervalMs: 1000, timeoutMs: 100 },
    );
    assert.equal(reg.pick('decode'), null, 'nothing healthy before probing');
    const [, d1, d2, d3] = reg.workers;
    for (const w of reg.workers) reg.setHealthy(w, 'm');
    const seq = Array.from({ length: 6 }, () => reg.pick('decode')!.url);
    assert.deepEqual(new Set(seq), new Set([d1!.url, d2!.url, d3!.url]), 'ties rotate over all');
    const l1 = reg.acquire(d1!);
    const l2 = reg.acquire(d2!);
    assert.equal(reg.pick('decode'), d3, 'least loaded');
    reg.setUnhealthy(d3!, 'down');
    const picks = new Set(Array.from({ length: 4 }, () => reg.pick('decode')!.url));
    assert.deepEqual(picks, new Set([d1!.url, d2!.url]));
    reg.acquire(d1!);
    assert.equal(reg.pick('decode'), d2);
    l1.release();
    l2.release();
  });

  test('concurrent requests spread over two decode workers; all released after', async () => {
    const s = await stack({ decode: 2 });
    for (const d of s.decode) d.decode = () => ({ tokens: ['a', 'b', 'c'], intervalMs: 100 });
    const runs = Array.from({ length: 4 }, () => s.client.completions.create({ model: 'fake-model', prompt: 'p' }));
    assert.ok(await waitFor(() => s.decode[0]!.generates.length + s.decode[1]!.generates.length === 4, 1000));
    assert.deepEqual(
      s.router.registry.workers.filter((w) => w.role === 'decode').map((w) => w.load),
      [2, 2],
    );
    assert.equal(s.router.registry.workers[0]!.load <= 4, true);
    await Promise.all(runs);
    assert.deepEqual(
      s.decode.map((d) => d.generates.length),
      [2, 2],
    );
    await assertReleased(s);
  });

  test('cache_aware (default) keeps each conversation on one prefill worker; round_robin does not', async () => {
    const conv = (who: string) => Array.from({ length: 4 }, (_, r) => `${who}: the shared system prompt and tools. ${Array.from({ length: r + 1 }, (_, k) => `round ${k} result`).join(' ')}`);
    for (const policy of [undefined, 'round_robin'] as const) {
      const s = await stack({ prefill: 2, ...(policy ? { policy } : {}) });
      for (const prompt of [...conv('agent A'), ...conv('agent B')]) await s.client.completions.create({ model: 'fake-model', prompt });
      const seen = s.prefill.map((p) => p.generates.map((g) => String(g.text).slice(0, 7)));
      if (policy === undefined) {
        assert.deepEqual(seen.map((x) => new Set(x).size), [1, 1], `one conversation per worker: ${JSON.stringify(seen)}`);
        assert.notEqual(seen[0]![0], seen[1]![0]);
        const m = await (await fetch(`${s.router.url}/metrics`)).text();
        assert.match(m, /pdserve_router_policy_picks_total\{role="prefill",policy="cache_aware",reason="cache_hit"\} 6/, 'rounds 2–4 of both conversations were cache hits');
        assert.match(m, /pdserve_router_policy_picks_total\{role="prefill",policy="cache_aware",reason="cache_miss"\} 2/);
      } else {
        assert.deepEqual(seen.map((x) => new Set(x).size), [2, 2], `round robin spreads each conversation: ${JSON.stringify(seen)}`);
      }
      await assertReleased(s);
    }
  });

  test('many mixed outcomes: acquired == released and loads 0', async () => {
    const s = await stack({ requestTimeoutMs: 400 });
    let i = 0;
    s.prefill[0]!.prefill = () => {
      const k = i++ % 4;
      return k === 1 ? { delayMs: 5, status: 500, message: 'boom' } : { delayMs: 2 };
    };
    s.decode[0]!.decode = (b) => {
      const k = Number(b.text) % 4;
      if (k === 2) return { startDelayMs: 10_000 }; // → timeout
      if (k === 3) return { tokens: ['x', 'y'], errorAfter: 1 };
      return { tokens: ['x', 'y', 'z'], intervalMs: 2 };
    };
    const outcomes = await Promise.allSettled(
      Array.from({ length: 24 }, async (_, n) => {
        const ac = new AbortController();
        // Abort once the router dispatched it (a request aborted before it is sent never reaches the router).
        if (n % 5 === 4) void waitFor(() => s.prefill[0]!.generates.some((g) => g.text === String(n)), 3000).then(() => setTimeout(() => ac.abort(), 5));
        const st = await s.client.completions.create({ model: 'fake-model', prompt: String(n), stream: n % 2 === 0 }, { signal: ac.signal });
        if (n % 2 === 0) for await (const _ of st as AsyncIterable<unknown>);
      }),
    );
    assert.ok(outcomes.some((o) => o.status === 'fulfilled'));
    assert.ok(outcomes.some((o) => o.status === 'rejected'));
    await assertReleased(s, 2000);
    const counts = await Promise.all(['ok', 'client_abort', 'error', 'timeout'].map((o) => outcomeCount(s, o)));
    assert.ok(counts.every((c) => c > 0), `every outcome occurred: ${counts}`);
    assert.equal(counts.reduce((a, b) => a + b, 0), 24, 'every request counted once');
  });
});

describe('router: config and lifecycle', () => {
  test('config is validated and frozen', () => {
    assert.throws(() => parseRouterConfig({ prefill: [], decode: [{ url: 'http://a:1' }] }), RouterConfigError);
    assert.throws(() => parseRouterConfig({ prefill: [{ url: 'ftp://a', bootstrapPort: 1 }], decode: [{ url: 'http://a:1' }] }), /http/);
    assert.throws(() => parseRouterConfig({ prefill: [{ url: 'http://a:1', bootstrapPort: 1 }], decode: [{ url: 'http://a:2' }], helthIntervalMs: 5 }), /Unrecognized key/);
    assert.throws(() => parseRouterConfig({ prefill: [{ url: 'http://a:1', bootstrapPort: 1 }], decode: [{ url: 'http://a:1/' }] }), /duplicate/);
    const c = parseRouterConfig({ prefill: [{ url: 'http://[::1]:30000/', bootstrapPort: 8998 }], decode: [{ url: 'http://localhost:30001' }] });
    assert.equal(c.prefill[0]!.url, 'http://[::1]:30000');
    assert.equal(c.prefill[0]!.bootstrapHost, '::1');
    assert.equal(c.requestTimeoutMs, 600_000);
    assert.ok(Object.isFrozen(c) && Object.isFrozen(c.prefill) && Object.isFrozen(c.prefill[0]));
    // A pino logger instance is accepted (the CLI passes one) and not frozen.
    const log = pino({ level: 'silent' });
    const c2 = parseRouterConfig({ prefill: [{ url: 'http://a:1', bootstrapPort: 1 }], decode: [{ url: 'http://a:2' }], log });
    assert.equal(c2.log, log);
    assert.ok(!Object.isFrozen(log));
  });

  test('a generation request\'s log lines carry its rid and trace id (the x-request-id and x-trace-id headers); other requests\' lines no trace', async () => {
    const prefill = await new FakeWorker('prefill').start();
    const decode = await new FakeWorker('decode').start();
    const lines: Record<string, unknown>[] = [];
    const log = pino({ level: 'info' }, { write: (s: string) => void lines.push(JSON.parse(s) as Record<string, unknown>) });
    const r = await startRouter({ host: '127.0.0.1', port: 0, prefill: [{ url: prefill.url, bootstrapPort: 9000 }], decode: [{ url: decode.url }], log, healthIntervalMs: 100, firstTokenFromPrefill: true });
    try {
      const post = (headers: Record<string, string>) => fetch(`${r.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json', ...headers }, body: JSON.stringify({ prompt: 'x', stream: true }) });
      const traceId = '4bf92f3577b34da6a3ce929d0e0e4736';
      const responses = [await post({}), await post({ traceparent: `00-${traceId}-00f067aa0ba902b7-01` })];
      for (const res of responses) await res.text();
      const probe = await fetch(`${r.url}/workers/probe`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ url: prefill.url }) });
      assert.equal(probe.status, 200);
      assert.equal(responses[1]!.headers.get('x-trace-id'), traceId);
      for (const res of responses) {
        const rid = res.headers.get('x-request-id')!;
        const trace = res.headers.get('x-trace-id')!;
        assert.match(rid, /^cmpl-/);
        assert.match(trace, /^[0-9a-f]{32}$|^[\w.:-]+$/);
        assert.ok(await waitFor(() => lines.some((l) => l.rid === rid && l.msg === 'request completed'), 1000), 'request completed line');
        const mine = lines.filter((l) => l.rid === rid);
        assert.ok(mine.some((l) => l.msg === 'request finished'), 'request finished line');
        for (const l of mine) assert.equal(l.trace, trace, `${String(l.msg)}: trace`);
      }
      const other = lines.filter((l) => (l.req as { url?: string } | undefined)?.url === '/workers/probe');
      assert.ok(other.length > 0, 'the probe request is logged');
      for (const l of other) assert.equal(l.trace, undefined);
    } finally {
      await r.close();
      await prefill.close();
      await decode.close();
    }
  });

  test('close() fails in-flight requests with 503 and aborts them on both workers', async (t) => {
    const prefill = await new FakeWorker('prefill').start();
    const decode = await new FakeWorker('decode').start();
    // both legs still running when close() comes (a prefill that already answered is not told to abort)
    prefill.prefill = () => ({ delayMs: 30_000 });
    decode.decode = () => ({ startDelayMs: 30_000 });
    const r = await createRouter({ port: 0, prefill: [{ url: prefill.url, bootstrapPort: 9000 }], decode: [{ url: decode.url }], log: { level: 'silent' }, healthIntervalMs: 100 });
    // a failed assertion must not leave servers open (the file would never end)
    t.after(async () => {
      await r.close();
      await prefill.close();
      await decode.close();
    });
    await r.app.listen({ host: '127.0.0.1', port: 0 });
    const port = (r.app.server.address() as { port: number }).port;
    const p = fetch(`http://127.0.0.1:${port}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ prompt: 'x' }) });
    assert.ok(await waitFor(() => decode.generates.length === 1 && prefill.generates.length === 1, 1000));
    const closing = r.close();
    const res = await p;
    assert.equal(res.status, 503);
    await closing;
    const rid = decode.generates[0]!.rid;
    // the aborts are requests on their way to the workers: they arrive, once each
    assert.ok(await waitFor(() => decode.abortsFor(rid).length >= 1 && prefill.abortsFor(rid).length >= 1, 2000), `both workers were told to abort: decode ${decode.abortsFor(rid).length}, prefill ${prefill.abortsFor(rid).length}, prefill saw ${JSON.stringify(prefill.generates.map((g) => g.rid))} rid ${rid}`);
    assert.equal(decode.abortsFor(rid).length, 1);
    assert.equal(prefill.abortsFor(rid).length, 1);
    assert.equal(r.registry.acquiredTotal, r.registry.releasedTotal);
  });
});

describe('router: attempts (retry before output, request ids)', () => {
  test('two concurrent requests with the same x-request-id and request_id both succeed; the workers see distinct rids; the trace is found by the label', async () => {
    const s = await stack();
    s.decode[0]!.decode = () => ({ tokens: ['a', 'b', 'c'], intervalMs: 20, finish: 'length' });
    const post = () =>
      fetch(`${s.router.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json', 'x-request-id': 'gateway-7' }, body: JSON.stringify({ model: 'fake-model', prompt: 'p', request_id: 'client-label-7' }) });
    const [a, b] = await Promise.all([post(), post()]);
    assert.equal(a.status, 200);
    assert.equal(b.status, 200);
    const ids = [((await a.json()) as any).id, ((await b.json()) as any).id];
    assert.notEqual(ids[0], ids[1]);
    const rids = s.decode[0]!.generates.map((g) => g.rid);
    assert.deepEqual(new Set(rids), new Set(ids), "each request's own rid reached the workers, never the client's id");
    const t = (await (await fetch(`${s.router.url}/debug/traces/client-label-7`)).json()) as any;
    assert.equal(t.label, 'client-label-7');
    assert.ok(ids.includes(t.rid));
    await assertReleased(s);
  });

  test('a 5xx before output is retried on the other pair with a new rid and room; a 4xx is not retried', async () => {
    const s = await stack({ prefill: 2, decode: 2, healthIntervalMs: 60_000, policy: 'round_robin' });
    s.decode[0]!.decode = () => ({ startDelayMs: 5, status: 503, message: 'decode prealloc queue is full' });
    s.decode[1]!.decode = () => ({ startDelayMs: 5, status: 503, message: 'decode prealloc queue is full' });
    let failed = false;
    for (const d of s.decode) {
      const fail = d.decode;
      d.decode = (b) => (failed ? { tokens: ['o', 'k'] } : ((failed = true), fail(b)));
    }
    const r = await s.client.completions.create({ model: 'fake-model', prompt: 'p' });
    assert.equal(r.choices[0]!.text, 'ok');
    const gens = [...s.decode[0]!.generates, ...s.decode[1]!.generates];
    assert.equal(gens.length, 2);
    assert.deepEqual(gens.map((g) => g.rid).sort(), [r.id, `${r.id}-a2`].sort(), 'attempt 2 has its own rid');
    assert.notEqual(gens[0]!.bootstrap_room, gens[1]!.bootstrap_room);
    assert.equal(s.decode[0]!.generates.length, 1, 'the second attempt avoided the failed decode');
    assert.match(await metric(s, 'pdserve_router_retries_total'), /reason="decode_failed",outcome="ok"} 1/);
    const t = (await (await fetch(`${s.router.url}/debug/traces/${r.id}`)).json()) as any;
    assert.deepEqual(t.events.filter((e: any) => e.what === 'attempt_failed').map((e: any) => [e.attempt, e.next, e.code]), [[1, 'retry', 'decode_failed']]);
    assert.equal(t.rooms.length, 2);
    // A client error is final.
    s.decode[0]!.decode = s.decode[1]!.decode = () => ({ status: 400, message: 'prompt too long' });
    const before = s.decode[0]!.generates.length + s.decode[1]!.generates.length;
    await assert.rejects(s.client.completions.create({ model: 'fake-model', prompt: 'q' }), isApiError(400, /prompt too long/));
    assert.equal(s.decode[0]!.generates.length + s.decode[1]!.generates.length, before + 1, 'not retried');
    await assertReleased(s);
  });

  test('a worker that refuses the connection costs no attempt of the budget (migrationLimit 0): it leaves the rotation and the request runs on the other pair', async () => {
    const s = await stack({ prefill: 2, decode: 2, healthIntervalMs: 60_000, policy: 'round_robin', migrationLimit: 0 });
    await s.prefill[0]!.close();
    await s.decode[1]!.close();
    for (let i = 0; i < 4; i++) {
      const r = await s.client.completions.create({ model: 'fake-model', prompt: `p${i}` });
      assert.equal(r.choices[0]!.text, 'Hello, world');
    }
    assert.match(await metric(s, 'pdserve_router_retries_total'), /reason="(prefill|decode)_unreachable",outcome="ok"}/);
    assert.equal(await outcomeCount(s, 'error'), 0);
    await assertReleased(s);
  });

  test('a decode that cuts its stream mid-answer leaves the rotation until its next good probe: the migration does not go back to it', async () => {
    const s = await stack({ decode: 2, healthIntervalMs: 60_000, policy: 'round_robin' });
    const script = ['The', ' quick', ' brown', ' fox'];
    for (const d of s.decode) d.decode = (b) => (b.resume_token_ids ? { tokens: script, finish: 'length' } : { tokens: script, intervalMs: 2, destroyAfter: 2 });
    const r = await s.client.completions.create({ model: 'fake-model', prompt: 'p' });
    assert.equal(r.choices[0]!.text, script.join(''));
    const cut = s.decode.find((d) => d.generates.length === 1 && !d.generates[0]!.resume_token_ids)!;
    const other = s.decode.find((d) => d !== cut)!;
    assert.ok(other.generates.some((g) => g.resume_token_ids), 'migrated to the other decode');
    const w = s.router.registry.workers.find((x) => x.url === cut.url)!;
    assert.equal(w.healthy, false);
    assert.match(String(w.lastError), /connection lost mid-request/);
    await s.router.registry.check(w, true);
    assert.equal(w.healthy, true, 'a good probe brings it back');
    await assertReleased(s);
  });

  test('retries run out: the client gets the last cause; every attempt released', async () => {
    const s = await stack({ migrationLimit: 2 });
    s.decode[0]!.decode = () => ({ status: 500, message: 'decode exploded' });
    await assert.rejects(s.client.completions.create({ model: 'fake-model', prompt: 'p' }), isApiError(500, /decode exploded/));
    assert.equal(s.decode[0]!.generates.length, 3, '1 + migrationLimit attempts');
    assert.match(await metric(s, 'pdserve_router_retries_total'), /outcome="error"} 2/);
    await assertReleased(s);
  });

  test('a failed KV handshake (decode cannot authenticate to prefill) takes the pair out of the rotation at once; the request is served by the other pair', async () => {
    const s = await stack({ decode: 2, healthIntervalMs: 60_000, policy: 'round_robin' });
    s.decode[0]!.decode = () => ({ status: 502, code: 'peer_unreachable', message: 'KV connection to prefill refused: authentication failed' });
    for (let i = 0; i < 4; i++) {
      const r = await s.client.completions.create({ model: 'fake-model', prompt: `p${i}` });
      assert.equal(r.choices[0]!.text, 'Hello, world');
    }
    assert.equal(s.decode[0]!.generates.length, 1, 'tried once, then out of the rotation');
    const w = (await (await fetch(`${s.router.url}/workers`)).json()) as any;
    assert.deepEqual(w.blocked_pairs.map((b: any) => [b.decode, b.code]), [[s.decode[0]!.url, 'peer_unreachable']]);
    assert.ok(w.blocked_pairs[0].retry_in_ms > 0 && w.blocked_pairs[0].retry_in_ms <= 1000);
    await assertReleased(s);
  });

  test('waitUntil: a temporarily empty role waits until the deadline; a role none of whose workers ever served waits at most workerWaitMs; 0 = no wait', () => {
    const served = [{ role: 'prefill' as const, servedOnce: true }, { role: 'decode' as const }];
    assert.equal(waitUntil('no_healthy_prefill', served, 1000, 61_000, 5000), 61_000, 'a prefill served before: until the deadline');
    assert.equal(waitUntil('no_healthy_decode', served, 1000, 61_000, 5000), 6000, 'no decode ever served: workerWaitMs');
    assert.equal(waitUntil('no_healthy_decode', [], 1000, 61_000, 5000), 6000, 'no decode in the pool at all: workerWaitMs');
    assert.equal(waitUntil('no_healthy_decode', [], 1000, 3000, 5000), 3000, 'never past the deadline');
    assert.equal(waitUntil('no_compatible_pair', served, 1000, 61_000, 5000), 61_000, 'blocked pairs only: until the deadline');
    assert.equal(waitUntil('no_healthy_prefill', served, 1000, 61_000, 0), 1000, 'workerWaitMs 0: 503 at once');
    const drained = [{ role: 'decode' as const, servedOnce: true, draining: true }, { role: 'decode' as const, servedOnce: true, draining: true }];
    assert.equal(waitUntil('no_healthy_decode', drained, 1000, 61_000, 5000, 300), 1300, 'every decode draining: unavailableWaitMs');
    assert.equal(waitUntil('no_healthy_decode', [...drained, { role: 'decode' as const, servedOnce: true }], 1000, 61_000, 5000, 300), 61_000, 'one decode restarting: until the deadline');
  });

  test('the only decode is draining: 503 no_healthy_decode with retry-after after unavailableWaitMs, not at the deadline', async () => {
    const s = await stack({ workerWaitMs: 5000, unavailableWaitMs: 300, requestTimeoutMs: 10_000, healthIntervalMs: 60_000 });
    const d = s.decode[0]!;
    d.health = () => ({ code: 503, body: { status: 'draining', role: 'decode' } });
    await s.router.registry.check(s.router.registry.workers.find((w) => w.role === 'decode')!, true);
    for (const stream of [false, true]) {
      const t0 = Date.now();
      const res = await fetch(`${s.router.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'fake-model', prompt: 'p', stream }) });
      const ms = Date.now() - t0;
      assert.equal(res.status, 503, await res.clone().text());
      assert.equal(((await res.json()) as any).error.code, 'no_healthy_decode');
      assert.ok(res.headers.get('retry-after'), 'retry-after is set');
      assert.ok(ms >= 250 && ms < 3000, `answered after the short wait, not the deadline (${ms} ms)`);
    }
    assert.equal(d.generates.length, 0);
  });

  test('a prefill that served and is down now: the request waits past workerWaitMs (inside its deadline) and is served when it is back', async () => {
    const s = await stack({ workerWaitMs: 200, healthIntervalMs: 60_000 });
    const w = s.router.registry.workers.find((x) => x.role === 'prefill')!;
    s.router.registry.setUnhealthy(w, 'test: restarting');
    const t0 = Date.now();
    const pending = s.client.completions.create({ model: 'fake-model', prompt: 'p' });
    await sleep(700);
    assert.equal(s.decode[0]!.generates.length, 0, 'nothing dispatched while no prefill is healthy');
    await s.router.registry.check(w, true);
    const r = await pending;
    assert.equal(r.choices[0]!.text, 'Hello, world');
    assert.ok(Date.now() - t0 >= 700, 'waited longer than workerWaitMs');
    await assertReleased(s);
  });

  test('a prefill that never answered its probe (wrong address): 503 no_healthy_prefill after about workerWaitMs, not the deadline', async () => {
    const dead = Fastify();
    await dead.listen({ host: '127.0.0.1', port: 0 });
    const a = dead.server.address();
    const deadUrl = `http://127.0.0.1:${typeof a === 'object' && a ? a.port : 0}`;
    await dead.close();
    const decode = await new FakeWorker('decode').start();
    const router = await startRouter({ host: '127.0.0.1', port: 0, prefill: [{ url: deadUrl, bootstrapPort: 9000 }], decode: [{ url: decode.url }], healthIntervalMs: 100, requestTimeoutMs: 10_000, workerWaitMs: 400, log: { level: 'silent' } });
    try {
      const client = new OpenAI({ baseURL: `${router.url}/v1`, apiKey: 'none', maxRetries: 0, timeout: 10_000 });
      const t0 = Date.now();
      await assert.rejects(client.completions.create({ model: 'fake-model', prompt: 'p' }), isApiError(503, /no healthy prefill worker/));
      const ms = Date.now() - t0;
      assert.ok(ms >= 350 && ms < 3000, `answered after ${ms} ms`);
      assert.equal(decode.generates.length, 0);
    } finally {
      await router.close();
      await decode.close();
    }
  });

  test('no healthy prefill: the request waits for one (workerWaitMs) instead of a 503', async () => {
    const s = await stack({ workerWaitMs: 5000, healthIntervalMs: 60_000 });
    const w = s.router.registry.workers.find((x) => x.role === 'prefill')!;
    s.router.registry.setUnhealthy(w, 'test: down');
    const pending = s.client.completions.create({ model: 'fake-model', prompt: 'p' });
    await sleep(300);
    assert.equal(s.decode[0]!.generates.length, 0, 'nothing dispatched while no prefill is healthy');
    await s.router.registry.check(w, true);
    const r = await pending;
    assert.equal(r.choices[0]!.text, 'Hello, world');
    await assertReleased(s);
  });
});

describe('router: migration (after output)', () => {
  const script = ['The', ' quick', ' brown', ' fox', ' jumps'];

  test('decode dies mid-stream: the stream continues on the other decode with prompt + the tokens sent; no token repeated or missing; usage once', async () => {
    const s = await stack({ decode: 2, healthIntervalMs: 60_000, policy: 'round_robin' });
    let first = true;
    for (const d of s.decode) d.decode = () => (first ? ((first = false), { tokens: script, intervalMs: 2, destroyAfter: 2 }) : { tokens: script, intervalMs: 2, finish: 'length' });
    const stream = await s.client.completions.create({ model: 'fake-model', prompt: 'p', stream: true, stream_options: { include_usage: true } });
    let text = '';
    let usage: any = null;
    const ids = new Set<string>();
    for await (const c of stream) {
      text += c.choices[0]?.text ?? '';
      ids.add(c.id);
      if (c.usage) usage = c.usage;
    }
    assert.equal(text, script.join(''), 'every token once, in order');
    assert.equal(ids.size, 1, 'one response id');
    assert.equal(usage.completion_tokens, script.length);
    assert.equal(usage.prompt_tokens, 3);
    const gens = [...s.decode[0]!.generates, ...s.decode[1]!.generates];
    const resumed = gens.find((g) => g.resume_token_ids)!;
    assert.deepEqual(resumed.resume_token_ids, [100, 101], 'the tokens the client had');
    assert.equal(s.prefill[0]!.generates.at(-1)!.resume_token_ids?.length, 2, 'prefill evaluates them too');
    assert.match(await metric(s, 'pdserve_router_migrations_total'), /reason="decode_failed",outcome="ok"} 1/);
    assert.equal(await outcomeCount(s, 'ok'), 1);
    assert.equal(await outcomeCount(s, 'error'), 0);
    await assertReleased(s);
  });

  test('non-stream: a decode error event after output is migrated; the response is whole', async () => {
    const s = await stack({ decode: 2, healthIntervalMs: 60_000, policy: 'round_robin' });
    s.decode[0]!.decode = s.decode[1]!.decode = (b) => (b.resume_token_ids ? { tokens: script, finish: 'stop' } : { tokens: script, errorAfter: 3 });
    const r = await s.client.completions.create({ model: 'fake-model', prompt: 'p' });
    assert.equal(r.choices[0]!.text, script.join(''));
    assert.equal(r.choices[0]!.finish_reason, 'stop');
    assert.equal(r.usage?.completion_tokens, script.length);
    await assertReleased(s);
  });

  test('handoff fails after token 1 (first token from prefill): migrated with that token; the client sees it once', async () => {
    const s = await stack({ firstTokenFromPrefill: true });
    s.prefill[0]!.prefill = (b) => (b.resume_token_ids ? { delayMs: 1, first: ' quick' } : { delayMs: 1, first: 'The', failAfterFirstMs: 20 });
    s.decode[0]!.decode = (b) => (b.resume_token_ids ? { tokens: script, finish: 'length' } : { startDelayMs: 30_000, tokens: ['never'] });
    const r = await s.client.completions.create({ model: 'fake-model', prompt: 'p' });
    assert.equal(r.choices[0]!.text, 'The quick brown fox jumps');
    assert.deepEqual(s.prefill[0]!.generates[1]!.resume_token_ids, [99]);
    const t = (await (await fetch(`${s.router.url}/debug/traces/${r.id}`)).json()) as any;
    assert.deepEqual(t.events.filter((e: any) => e.what === 'attempt_failed').map((e: any) => [e.next, e.code, e.tokens_sent]), [['migrate', 'kv_transfer_failed', 1]]);
    await assertReleased(s);
  });

  test('a state over decode\'s --max-state-bytes (kv_state_too_large, after token 1) is never migrated: stream → token 1 then the error event (no [DONE]); non-stream → 400; one attempt', async () => {
    const s = await stack({ decode: 2, firstTokenFromPrefill: true, healthIntervalMs: 60_000, policy: 'round_robin' });
    const msg = "the prompt's KV state of 1058491 bytes (1.01 MiB) is over this decode worker's limit of 1048576 bytes (1 MiB) (decode --max-state-bytes)";
    const tooLarge = { message: `decode: ${msg}`, code: 'kv_state_too_large', status: 400, type: 'invalid_request_error' };
    s.prefill[0]!.prefill = () => ({ delayMs: 1, first: 'The', failAfterFirstMs: 20, failError: tooLarge });
    // decode answers the same failure (its room failed); either leg may be heard first
    for (const d of s.decode) d.decode = () => ({ startDelayMs: 40, status: 400, code: 'kv_state_too_large', message: msg });
    const events = await rawStream(s);
    assert.equal(texts(events)[0], 'The', 'token 1 from prefill');
    const last = JSON.parse(events.at(-1)!) as { error?: { code: string; message: string } };
    assert.equal(last.error?.code, 'kv_state_too_large');
    assert.match(last.error!.message, /--max-state-bytes/);
    assert.ok(!events.includes('[DONE]'));
    await assert.rejects(s.client.completions.create({ model: 'fake-model', prompt: 'hi' }), (e: unknown) => e instanceof OpenAI.APIError && e.status === 400 && (e as { code?: unknown }).code === 'kv_state_too_large' && /--max-state-bytes/.test(e.message));
    assert.equal(s.prefill[0]!.generates.length, 2, 'one prefill attempt per request: nothing re-evaluated');
    assert.equal(s.decode[0]!.generates.length + s.decode[1]!.generates.length, 2, 'one decode attempt per request');
    assert.equal(await metric(s, 'pdserve_router_migrations_total{'), '', 'no migration');
    assert.equal(await metric(s, 'pdserve_router_retries_total{'), '', 'no retry');
    await assertReleased(s);
  });

  for (const local of ['served', 'needs_prefill'] as const) {
    test(`migration onto the decode that holds the prefix: prompt + the tokens sent go to it alone (decode-local)${local === 'needs_prefill' ? '; its needs_prefill falls back to PD on the same pair, with those tokens' : ''}`, async () => {
      // exact routing: the router tokenizes with the tiny model's vocabulary; round 1's prompt
      // blocks count as held by its decode (the fake workers publish nothing themselves)
      const s = await stack({ decode: 2, healthIntervalMs: 60_000, decodePolicy: 'cache_aware', model: await ensureModel('tiny', 1) });
      const round1 = 'The plan has these steps: first read the file, then count the lines, then report. '.repeat(4);
      const r1 = await s.client.completions.create({ model: 'fake-model', prompt: round1 });
      const holder = s.decode.find((d) => d.generates.length === 1)!;
      const other = s.decode.find((d) => d !== holder)!;
      const wHolder = s.router.registry.workers.find((w) => w.url === holder.url)!;
      // The first attempt of round 2 goes to the other decode (the holder is out for its pick), which dies after 2 tokens.
      s.router.registry.setUnhealthy(wHolder, 'test: out for one pick');
      other.decode = () => ({ tokens: script, intervalMs: 30, destroyAfter: 2 });
      holder.decode = (b) => (b.local_prefill && local === 'needs_prefill' ? { status: 409, code: 'needs_prefill', message: 'uncached suffix too long' } : { tokens: script, intervalMs: 2, finish: 'length' });
      const prefillsBefore = s.prefill[0]!.generates.length;
      const stream = await s.client.completions.create({ model: 'fake-model', prompt: `${round1}${r1.choices[0]!.text} Go on.`, stream: true, stream_options: { include_usage: true } });
      let text = '';
      let usage: any = null;
      let id = '';
      for await (const c of stream) {
        if (text === '') await s.router.registry.check(wHolder, true); // back before the migration
        id = c.id;
        text += c.choices[0]?.text ?? '';
        if (c.usage) usage = c.usage;
      }
      assert.equal(text, script.join(''), 'every token once, in order');
      assert.equal(usage.completion_tokens, script.length);
      const first = holder.generates[1]!;
      assert.ok(first.local_prefill, 'the migrated attempt went to the holder alone');
      assert.deepEqual(first.resume_token_ids, [100, 101], 'with the tokens the client had');
      if (local === 'served') {
        assert.equal(holder.generates.length, 2);
        assert.equal(s.prefill[0]!.generates.length, prefillsBefore + 1, 'no prefill leg for the migrated attempt');
      } else {
        assert.equal(holder.generates.length, 3);
        assert.equal(holder.generates[2]!.local_prefill, undefined, 'then PD on the same decode');
        assert.deepEqual(holder.generates[2]!.resume_token_ids, [100, 101]);
        assert.deepEqual(s.prefill[0]!.generates.at(-1)!.resume_token_ids, [100, 101], 'prefill evaluates them');
      }
      const t = (await (await fetch(`${s.router.url}/debug/traces/${id}`)).json()) as any;
      assert.deepEqual(t.events.filter((e: any) => e.what === 'dispatched').map((e: any) => [e.path, e.resumed_tokens]), [['pd', 0], ['decode_local', 2], ...(local === 'needs_prefill' ? [['pd', 2]] : [])]);
      assert.match(await metric(s, 'pdserve_router_migrations_total'), /reason="decode_failed",outcome="ok"} 1/);
      await assertReleased(s);
    });
  }

  test('migration limit reached: the stream ends with the last cause (no [DONE]); every attempt released', async () => {
    const s = await stack({ migrationLimit: 2 });
    s.decode[0]!.decode = (b) => ({ tokens: script, errorAfter: (b.resume_token_ids?.length ?? 0) + 1 });
    const events = await rawStream(s);
    assert.equal(texts(events).join(''), 'The quick brown', 'one more token per attempt, none repeated');
    const last = JSON.parse(events.at(-1)!) as { error?: { code: string; message: string } };
    assert.equal(last.error?.code, 'engine_failed');
    assert.ok(!events.includes('[DONE]'));
    assert.equal(s.decode[0]!.generates.length, 3);
    assert.match(await metric(s, 'pdserve_router_migrations_total'), /reason="engine_failed",outcome="error"} 2/);
    await assertReleased(s);
  });
});

describe('router: per-worker metric series', () => {
  test('a worker that leaves the registry takes its pdserve_router_worker_load series with it; one that joins gets one', async () => {
    const urls = ['http://127.0.0.1:9', 'http://127.0.0.1:10', 'http://127.0.0.1:11'];
    const r = await createRouter({ prefill: [{ url: 'http://127.0.0.1:8', bootstrapPort: 2 }], decode: urls.map((url) => ({ url })), healthIntervalMs: 60_000, healthTimeoutMs: 100, log: { level: 'silent' } });
    try {
      const series = async () => {
        const text = (await r.app.inject({ method: 'GET', url: '/metrics' })).body;
        return text.split('\n').filter((l) => l.startsWith('pdserve_router_worker_load{')).map((l) => /worker="([^"]+)"/.exec(l)![1]).sort();
      };
      assert.deepEqual(await series(), ['http://127.0.0.1:10', 'http://127.0.0.1:11', 'http://127.0.0.1:8', 'http://127.0.0.1:9']);
      // etcd churn: two decode workers leave, one new joins
      assert.ok(r.registry.remove('http://127.0.0.1:10', 'lease expired'));
      assert.ok(r.registry.remove('http://127.0.0.1:11', 'deregistered'));
      r.registry.upsert({ role: 'decode', url: 'http://127.0.0.1:12' });
      assert.deepEqual(await series(), ['http://127.0.0.1:12', 'http://127.0.0.1:8', 'http://127.0.0.1:9'], 'the departed workers have no series left');
    } finally {
      await r.close();
    }
  });
});

describe('router: what an aborted leg is told', () => {
  test("a prefill that was draining: decode's room ends as request_redispatched (a cancel), never as prefill_failed (a failure)", async () => {
    const { abortCause } = await import('../../src/router/worker-errors.js');
    const { ApiError: E, causeOf } = await import('../../src/base/errors.js');
    const drained = abortCause('decode', { leg: 'prefill', err: E.of('draining', 'prefill worker is draining') })!;
    assert.equal(drained.code, 'request_redispatched');
    assert.equal(causeOf(drained.code), 'client', 'counted in pdserve_rooms_cancelled_total, not pdserve_bootstrap_failed_total');
    assert.equal(abortCause('decode', { leg: 'prefill', err: E.of('prefill_failed', 'it died') })!.code, 'prefill_failed', 'a real failure stays one');
  });
});

describe('router: SSE keep-alive while a stream waits', () => {
  test("a stream waiting for its first token gets ': keep-alive' comments, then its tokens and [DONE]; the openai client reads it unchanged", async () => {
    const s = await stack({ sseKeepAliveMs: 100, healthIntervalMs: 60_000 });
    s.decode[0]!.decode = () => ({ startDelayMs: 450, tokens: ['Hello', ',', ' world'], intervalMs: 2, finish: 'length' });
    const res = await fetch(`${s.router.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'fake-model', prompt: 'p', stream: true }) });
    assert.equal(res.status, 200);
    assert.match(res.headers.get('content-type') ?? '', /text\/event-stream/);
    const text = await res.text();
    const firstData = text.indexOf('data:');
    const comments = text.slice(0, firstData).match(/^: keep-alive$/gm) ?? [];
    assert.ok(comments.length >= 2, `comments before the first token: ${JSON.stringify(text.slice(0, 200))}`);
    assert.match(text, /data: \[DONE\]\s*$/);
    const stream = await s.client.completions.create({ model: 'fake-model', prompt: 'p', stream: true });
    let got = '';
    for await (const c of stream) got += c.choices[0]?.text ?? '';
    assert.equal(got, 'Hello, world');
    await assertReleased(s);
  });

  test('a stream a comment opened, then no worker came before the deadline: the error is an SSE event in the open stream', async () => {
    const s = await stack({ sseKeepAliveMs: 100, workerWaitMs: 5000, requestTimeoutMs: 700, healthIntervalMs: 60_000 });
    s.router.registry.setUnhealthy(s.router.registry.workers.find((w) => w.role === 'prefill')!, 'test: restarting');
    const res = await fetch(`${s.router.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'fake-model', prompt: 'p', stream: true }) });
    assert.equal(res.status, 200, 'the stream was opened by a keep-alive comment');
    const text = await res.text();
    assert.match(text, /^: keep-alive$/m);
    assert.match(text, /data: \{"error":\{[^\n]*"code":"no_healthy_prefill"/, text);
    assert.doesNotMatch(text, /\[DONE\]/);
  });
});

describe('router: SSE keep-alive on n > 1 and Responses streams (their generations run in process)', () => {
  const post = (s: Stack, path: string, body: object) => fetch(`${s.router.url}${path}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });

  test("n = 2: while the choices wait for their first token the client gets ': keep-alive' comments (one per interval, not one per choice), then both choices and [DONE]", async () => {
    const s = await stack({ decode: 2, policy: 'round_robin', sseKeepAliveMs: 100, healthIntervalMs: 60_000 });
    for (const d of s.decode) d.decode = () => ({ startDelayMs: 550, tokens: ['Hello', ',', ' world'], intervalMs: 2, finish: 'length' });
    const t0 = Date.now();
    const res = await post(s, '/v1/completions', { model: 'fake-model', prompt: 'p', n: 2, stream: true });
    assert.equal(res.status, 200);
    assert.ok(Date.now() - t0 < 450, `the stream opened while the choices waited (${Date.now() - t0} ms)`);
    assert.equal(res.headers.get('x-pdserve-path'), null, 'opened by a comment: the path is not known yet');
    const text = await res.text();
    const comments = text.slice(0, text.indexOf('data:')).match(/^: keep-alive$/gm) ?? [];
    assert.ok(comments.length >= 2 && comments.length <= 6, `comments before the first token (2 choices × ~5 each, at most one per half interval passed on): ${JSON.stringify(text.slice(0, 300))}`);
    assert.match(text, /data: \[DONE\]\s*$/);
    const stream = await s.client.completions.create({ model: 'fake-model', prompt: 'p', n: 2, stream: true });
    const got = ['', ''];
    for await (const c of stream) for (const ch of c.choices) got[ch.index] += ch.text;
    assert.deepEqual(got, ['Hello, world', 'Hello, world'], 'the openai client reads the commented stream unchanged');
    await assertReleased(s, 3000);
  });

  test('n = 2: a stream a comment opened, then no worker came before the deadline: the error is an SSE event in the open stream, no [DONE]', async () => {
    const s = await stack({ sseKeepAliveMs: 100, workerWaitMs: 5000, requestTimeoutMs: 700, healthIntervalMs: 60_000 });
    s.router.registry.setUnhealthy(s.router.registry.workers.find((w) => w.role === 'prefill')!, 'test: restarting');
    const res = await post(s, '/v1/completions', { model: 'fake-model', prompt: 'p', n: 2, stream: true });
    assert.equal(res.status, 200, 'the stream was opened by a keep-alive comment');
    const text = await res.text();
    assert.match(text, /^: keep-alive$/m);
    assert.match(text, /data: \{"error":\{[^\n]*"code":"no_healthy_prefill"/, text);
    assert.doesNotMatch(text, /\[DONE\]/);
  });

  test("Responses: a streamed response waiting for its first token gets ': keep-alive' comments, then its events to response.completed; the openai client reads it", async () => {
    const s = await stack({ sseKeepAliveMs: 100, healthIntervalMs: 60_000 });
    s.decode[0]!.decode = () => ({ startDelayMs: 450, tokens: ['Hello', ',', ' world'], intervalMs: 2, finish: 'stop' });
    const t0 = Date.now();
    const res = await post(s, '/v1/responses', { model: 'fake-model', input: 'p', stream: true });
    assert.equal(res.status, 200);
    assert.ok(Date.now() - t0 < 400, `the stream opened while the response waited (${Date.now() - t0} ms)`);
    const text = await res.text();
    const comments = text.slice(0, text.indexOf('event:')).match(/^: keep-alive$/gm) ?? [];
    assert.ok(comments.length >= 2, `comments before the first event: ${JSON.stringify(text.slice(0, 300))}`);
    assert.match(text, /^event: response\.created$/m);
    assert.match(text, /^event: response\.completed$/m);
    const stream = await s.client.responses.create({ model: 'fake-model', input: 'p', stream: true });
    let got = '';
    let completed = false;
    for await (const e of stream) {
      if (e.type === 'response.output_text.delta') got += e.delta;
      if (e.type === 'response.completed') completed = true;
    }
    assert.deepEqual([got, completed], ['Hello, world', true]);
    await assertReleased(s);
  });

  test('Responses: a stream a comment opened, then no worker came: response.failed in the open stream', async () => {
    const s = await stack({ sseKeepAliveMs: 100, workerWaitMs: 5000, requestTimeoutMs: 700, healthIntervalMs: 60_000 });
    s.router.registry.setUnhealthy(s.router.registry.workers.find((w) => w.role === 'prefill')!, 'test: restarting');
    const res = await post(s, '/v1/responses', { model: 'fake-model', input: 'p', stream: true });
    assert.equal(res.status, 200, 'the stream was opened by a keep-alive comment');
    const text = await res.text();
    assert.match(text, /^: keep-alive$/m);
    assert.match(text, /^event: response\.created$/m);
    assert.match(text, /^event: response\.failed$/m);
    assert.match(text, /no_healthy_prefill/);
  });

  test('Responses and n = 2 without a stream: no comment, the plain answer (a waiting non-stream request is never opened)', async () => {
    const s = await stack({ sseKeepAliveMs: 100, healthIntervalMs: 60_000 });
    s.decode[0]!.decode = () => ({ startDelayMs: 350, tokens: ['Hi'], intervalMs: 2, finish: 'stop' });
    const r = await post(s, '/v1/responses', { model: 'fake-model', input: 'p' });
    assert.equal(r.status, 200);
    assert.match(r.headers.get('content-type') ?? '', /application\/json/);
    assert.equal(((await r.json()) as { status: string }).status, 'completed');
    const c = await post(s, '/v1/completions', { model: 'fake-model', prompt: 'p', n: 2 });
    assert.equal(c.status, 200);
    assert.equal(((await c.json()) as { choices: { text: string }[] }).choices.map((x) => x.text).join('|'), 'Hi|Hi');
  });
});

describe('router: a decode stream that goes silent', () => {
  test('decode stops sending mid-stream (connection open): after legSilenceMs it is marked frozen and the stream migrates to the other decode', async () => {
    const s = await stack({ decode: 2, healthIntervalMs: 60_000, policy: 'round_robin', legSilenceMs: 300 });
    const script = ['The', ' quick', ' brown', ' fox', ' jumps'];
    let first = true;
    for (const d of s.decode) d.decode = () => (first ? ((first = false), { tokens: script, intervalMs: 2, hangAfter: 2 }) : { tokens: script, intervalMs: 2, finish: 'length' });
    const t0 = Date.now();
    const stream = await s.client.completions.create({ model: 'fake-model', prompt: 'p', stream: true });
    let text = '';
    for await (const c of stream) text += c.choices[0]?.text ?? '';
    assert.equal(text, 'The quick brown fox jumps', 'no token repeated or missing');
    assert.ok(Date.now() - t0 < 5000, `migrated after the silence bound, not the deadline (${Date.now() - t0} ms)`);
    const frozen = s.router.registry.snapshot().filter((w) => w.frozen);
    assert.equal(frozen.length, 1, JSON.stringify(s.router.registry.snapshot()));
    assert.equal(frozen[0]!.healthy, false);
    assert.match(frozen[0]!.frozen!, /no event on a request's stream for \d+ ms/);
    assert.match(await metric(s, 'pdserve_router_migrations_total'), /reason="decode_stalled",outcome="ok"\} 1/);
    await assertReleased(s, 3000);
  });
});

describe("router: an operator's abort", () => {
  test('POST /abort_request by the id of an n = 2 request ends both choices with request_aborted; the workers are told, nothing migrates', async () => {
    const s = await stack({ decode: 2, healthIntervalMs: 60_000, policy: 'round_robin' });
    for (const d of s.decode) d.decode = () => ({ tokens: Array.from({ length: 200 }, (_, i) => ` t${i}`), intervalMs: 20, finish: 'length' });
    const res = await fetch(`${s.router.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'fake-model', prompt: 'p', n: 2, stream: true }) });
    assert.equal(res.status, 200);
    const rid = res.headers.get('x-request-id')!;
    const reader = res.body!.getReader();
    let text = new TextDecoder().decode((await reader.read()).value);
    const ab = await fetch(`${s.router.url}/abort_request`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ rid }) });
    assert.equal(ab.status, 200);
    assert.deepEqual(await ab.json(), { rid, aborted: 2 });
    for (;;) {
      const r = await reader.read();
      if (r.done) break;
      text += new TextDecoder().decode(r.value);
    }
    assert.match(text, /"code":"request_aborted"/);
    assert.doesNotMatch(text, /\[DONE\]/);
    for (const d of s.decode) assert.ok(await waitFor(() => d.aborts.some((a) => a.cause?.code === 'request_aborted'), 2000), 'each decode was told request_aborted');
    assert.doesNotMatch(await metric(s, 'pdserve_router_migrations_total'), /\} [1-9]/);
    await assertReleased(s, 3000);
  });
});
