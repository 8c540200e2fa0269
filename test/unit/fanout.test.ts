/** n > 1 and batched prompts: the split into single-choice generations, run in process, and the merge of their streams (api/fanout.ts). */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import Fastify from 'fastify';
import { choiceError, FanOutMerger, MAX_CHOICES, mergedPath, planFanOut, serveFanOut } from '../../src/api/fanout.js';
import { ApiError, registerOpenAIErrorHandling } from '../../src/api/errors.js';
import { SSE_DONE } from '../../src/api/respond.js';
import { fakePort } from '../helpers/fake-port.js';

const usage = (p: number, c: number, cached = 0) => ({ prompt_tokens: p, completion_tokens: c, total_tokens: p + c, prompt_tokens_details: { cached_tokens: cached } });

describe('planFanOut', () => {
  test('a single choice is not split', () => {
    assert.equal(planFanOut('completion', { prompt: 'x' }), null);
    assert.equal(planFanOut('completion', { prompt: ['x'], n: 1 }), null);
    assert.equal(planFanOut('completion', { prompt: [[1, 2]] }), null);
    assert.equal(planFanOut('chat', { messages: [], n: null }), null);
    assert.equal(planFanOut('completion', { prompt: ['a', 1] }), null, 'an invalid batch is left to the parser');
  });

  test('n × prompts sub-requests, index = prompt_index × n + i, seed + i, always streamed with usage', () => {
    const subs = planFanOut('completion', { prompt: ['a', 'b'], n: 2, seed: 7, stream: false, max_tokens: 3 })!;
    assert.deepEqual(subs.map((s) => [s.index, s.promptIndex, s.body.prompt, s.body.seed, s.body.n]), [
      [0, 0, 'a', 7, 1],
      [1, 0, 'a', 8, 1],
      [2, 1, 'b', 7, 1],
      [3, 1, 'b', 8, 1],
    ]);
    for (const s of subs) assert.deepEqual([s.body.stream, s.body.stream_options, s.body.max_tokens], [true, { include_usage: true }, 3]);
    const ids = planFanOut('completion', { prompt: [[1, 2], [3]] })!;
    assert.deepEqual(ids.map((s) => s.body.prompt), [[1, 2], [3]]);
    const chat = planFanOut('chat', { messages: [{ role: 'user', content: 'q' }], n: 3 })!;
    assert.equal(chat.length, 3);
    assert.ok(chat.every((s) => s.body.seed === undefined && !('prompt' in s.body)));
  });

  test(`more than ${MAX_CHOICES} choices is a 400`, () => {
    assert.throws(() => planFanOut('chat', { messages: [], n: MAX_CHOICES + 1 }), (e: ApiError) => e.status === 400 && e.param === 'n');
    assert.throws(() => planFanOut('completion', { prompt: Array(MAX_CHOICES + 1).fill('p') }), (e: ApiError) => e.status === 400 && e.param === 'prompt');
    assert.equal(planFanOut('completion', { prompt: Array(MAX_CHOICES / 2).fill('p'), n: 2 })!.length, MAX_CHOICES);
  });
});

describe('FanOutMerger', () => {
  test('stream chunks get their choice index and the parent id; usage summed once per prompt', () => {
    const subs = planFanOut('completion', { prompt: ['a', 'b'], n: 2 })!;
    const m = new FanOutMerger('completion', 'cmpl-P', 5, true, subs);
    const ch = (text: string, finish: string | null = null) => ({ id: 'cmpl-sub', object: 'text_completion', created: 1, model: 'm', choices: [{ index: 0, text, logprobs: null, finish_reason: finish }], usage: null });
    const c = m.push(3, ch('x'))!;
    assert.deepEqual([c.id, c.created, c.choices![0]!.index, c.usage], ['cmpl-P', 5, 3, null]);
    m.push(3, ch('y', 'length'));
    m.push(0, ch('z', 'stop'));
    m.push(1, ch('', 'stop'));
    m.push(2, ch('w', 'length'));
    assert.equal(m.push(0, { choices: [], usage: usage(4, 1) }), null, 'usage-only chunks are held back');
    m.push(1, { choices: [], usage: usage(4, 0, 3) });
    m.push(2, { choices: [], usage: usage(6, 1) });
    m.push(3, { choices: [], usage: usage(6, 2, 5) });
    assert.deepEqual(m.usage(), usage(10, 4, 0));
    const u = m.usageChunk() as { choices: unknown[]; usage: unknown; id: string };
    assert.deepEqual([u.id, u.choices, u.usage], ['cmpl-P', [], usage(10, 4)]);
    const r = m.response() as { choices: { index: number; text: string; finish_reason: string }[]; usage: unknown };
    assert.deepEqual(r.choices.map((x) => [x.index, x.text, x.finish_reason]), [
      [0, 'z', 'stop'],
      [1, '', 'stop'],
      [2, 'w', 'length'],
      [3, 'xy', 'length'],
    ]);
  });

  test('chat: content and logprobs assembled per choice; no usage field when the client did not ask', () => {
    const subs = planFanOut('chat', { messages: [], n: 2 })!;
    const m = new FanOutMerger('chat', 'chatcmpl-P', 5, false, subs);
    const ch = (delta: object, finish: string | null = null, lp: object | null = null) => ({ id: 's', object: 'chat.completion.chunk', created: 1, model: 'm', choices: [{ index: 0, delta, logprobs: lp, finish_reason: finish }], usage: null });
    const first = m.push(1, ch({ role: 'assistant', content: '' }))!;
    assert.ok(!('usage' in first));
    m.push(1, ch({ content: 'hi' }, null, { content: [{ token: 'hi', logprob: -1 }], refusal: null }));
    m.push(1, ch({}, 'stop'));
    m.push(0, ch({ content: 'yo' }, 'length'));
    const r = m.response() as { object: string; choices: { index: number; message: { content: string }; logprobs: unknown; finish_reason: string }[] };
    assert.equal(r.object, 'chat.completion');
    assert.deepEqual(r.choices.map((x) => [x.index, x.message.content, x.finish_reason]), [
      [0, 'yo', 'length'],
      [1, 'hi', 'stop'],
    ]);
    assert.deepEqual(r.choices[1]!.logprobs, { content: [{ token: 'hi', logprob: -1 }], refusal: null });
    assert.equal(r.choices[0]!.logprobs, null);
  });

  test('a malformed chunk is a 502', () => {
    const m = new FanOutMerger('chat', 'c', 1, false, planFanOut('chat', { messages: [], n: 2 })!);
    assert.throws(() => m.push(0, { nope: 1 } as never), (e: ApiError) => e.status === 502);
  });
});

/**
 * serveFanOut on a real Fastify server (real HTTP to the client) over a fake generation port
 * (test/helpers/fake-port.ts): its choices run in process, no request goes back to the server.
 */
describe('serveFanOut over a generation port', () => {
  const start = async (o: Parameters<typeof fakePort>[0] = {}) => {
    const fake = fakePort(o);
    const app = Fastify({ logger: false, forceCloseConnections: true });
    registerOpenAIErrorHandling(app);
    let posted = 0;
    app.post('/v1/chat/completions', async (req, reply) => {
      posted++;
      const subs = planFanOut('chat', req.body);
      assert.ok(subs, 'the tests send n > 1');
      return serveFanOut(req, reply, 'chat', subs, fake.port);
    });
    await app.listen({ port: 0, host: '127.0.0.1' });
    const a = app.server.address() as { port: number };
    return { app, fake, posted: () => posted, url: `http://127.0.0.1:${a.port}/v1/chat/completions` };
  };

  test('non-stream: the choice\'s status and code (decode_failed 502), the message names the choice; one HTTP request, every choice in process', async () => {
    const { app, url, fake, posted } = await start();
    try {
      const res = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ messages: [], n: 2, seed: 0, fail: true }) });
      const body = (await res.json()) as { error: { code: string; type: string; message: string } };
      assert.equal(res.status, 502);
      assert.equal(body.error.code, 'decode_failed');
      assert.equal(body.error.type, 'server_error');
      assert.match(body.error.message, /^choice 1 failed: decode worker x failed/);
      assert.equal(posted(), 1, 'the server saw the client\'s request only');
      assert.equal(fake.state.ran, 2);
    } finally {
      await app.close();
    }
  });

  test('an invalid choice body is the request\'s 400 before any choice runs', async () => {
    const { app, url, fake } = await start();
    try {
      const res = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ messages: [], n: 3, invalid: true }) });
      assert.equal(res.status, 400);
      assert.equal(((await res.json()) as { error: { param: string } }).error.param, 'messages');
      assert.equal(fake.state.ran, 0);
    } finally {
      await app.close();
    }
  });

  test('stream: the error event carries the choice\'s code', async () => {
    const { app, url } = await start();
    try {
      const res = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ messages: [], n: 2, seed: 0, stream: true, fail: true }) });
      assert.equal(res.status, 200);
      const events = (await res.text()).split('\n').filter((l) => l.startsWith('data: ')).map((l) => l.slice(6));
      assert.ok(!events.includes(SSE_DONE), 'no [DONE] after a failed choice');
      const err = JSON.parse(events.at(-1)!) as { error: { code: string; message: string } };
      assert.equal(err.error.code, 'decode_failed');
      assert.match(err.error.message, /^choice 1 failed/);
    } finally {
      await app.close();
    }
  });

  test('x-pdserve-path: the choices\' path, stream and non-stream; distinct paths listed in choice order', async () => {
    const { app, url } = await start();
    try {
      const post = (body: object) => fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ messages: [], seed: 0, ...body }) });
      const plain = await post({ n: 3 });
      assert.equal(plain.status, 200);
      assert.equal(plain.headers.get('x-pdserve-path'), 'pd');
      assert.equal(((await plain.json()) as { choices: unknown[] }).choices.length, 3);
      const streamed = await post({ n: 2, stream: true, paths: ['decode_local', 'decode_local'] });
      assert.equal(streamed.headers.get('x-pdserve-path'), 'decode_local');
      assert.ok((await streamed.text()).includes('[DONE]'));
      const mixed = await post({ n: 3, paths: ['pd', 'decode_local', 'pd'] });
      assert.equal(mixed.headers.get('x-pdserve-path'), 'pd, decode_local');
      await mixed.text();
      assert.equal(mergedPath([undefined, undefined]), null);
    } finally {
      await app.close();
    }
  });

  test('keep-alive: while the choices wait, their comments reach the client (at most one per half interval), then the merged tokens and [DONE]', async () => {
    const { app, url } = await start({ keepAliveMs: 100 });
    try {
      const t0 = Date.now();
      const res = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ messages: [], n: 3, stream: true, waitMs: 550 }) });
      assert.equal(res.status, 200);
      assert.ok(Date.now() - t0 < 450, `the stream opened while the choices waited (${Date.now() - t0} ms)`);
      const text = await res.text();
      const comments = text.slice(0, text.indexOf('data:')).match(/^: keep-alive$/gm) ?? [];
      assert.ok(comments.length >= 2 && comments.length <= 6, `${comments.length} comments (3 choices × ~5 each, deduplicated): ${JSON.stringify(text.slice(0, 300))}`);
      const data = text.split('\n').filter((l) => l.startsWith('data: ')).map((l) => l.slice(6));
      assert.equal(data.at(-1), SSE_DONE);
      const indexes = new Set(data.slice(0, -1).map((d) => (JSON.parse(d) as { choices: { index: number }[] }).choices[0]?.index));
      assert.deepEqual([...indexes].sort(), [0, 1, 2]);
    } finally {
      await app.close();
    }
  });

  test('stream: a choice that streams before the others started does not wait for them (one slot for three choices: no deadlock)', async () => {
    const { app, url, fake } = await start({ slots: 1 });
    try {
      const res = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ messages: [], n: 3, stream: true, chunks: 20 }), signal: AbortSignal.timeout(5000) });
      assert.equal(res.status, 200);
      const data = (await res.text()).split('\n').filter((l) => l.startsWith('data: ')).map((l) => l.slice(6));
      assert.equal(data.at(-1), SSE_DONE);
      assert.equal(fake.state.ran, 3);
      const per = [0, 0, 0];
      for (const d of data.slice(0, -1)) for (const c of (JSON.parse(d) as { choices: { index: number; delta: { content?: string } }[] }).choices) if (c.delta.content) per[c.index]!++;
      assert.deepEqual(per, [20, 20, 20], 'every chunk of every choice, in order per choice');
    } finally {
      await app.close();
    }
  });

  test('a client gone mid-stream aborts every choice', async () => {
    const { app, url, fake } = await start();
    try {
      const ac = new AbortController();
      const res = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ messages: [], n: 2, stream: true, chunks: 1000, intervalMs: 5 }), signal: ac.signal });
      const reader = res.body!.getReader();
      await reader.read();
      ac.abort();
      const t0 = Date.now();
      while (fake.state.running > 0 && Date.now() - t0 < 3000) await new Promise((r) => setTimeout(r, 10));
      assert.equal(fake.state.running, 0, 'both choices ended');
      assert.equal(fake.state.aborted, 2, 'both choices saw their client gone');
    } finally {
      await app.close();
    }
  });

  test('choiceError: unknown or missing codes are internal_error 500, table codes keep their status', () => {
    assert.deepEqual([choiceError(2, { message: 'm', code: 'queue_full' }).status, choiceError(2, { code: 'queue_full' }).code], [503, 'queue_full']);
    const e = choiceError(0, 'garbage');
    assert.deepEqual([e.status, e.code, e.message], [500, 'internal_error', 'choice 0 failed: error']);
  });
});
