/**
 * The OpenAI surface end to end, one stack for the file. (1) Every honoured OpenAI / vLLM request field, driven through the real `openai` SDK against PD
 * (router → prefill → KV → decode) and the colocated reference on one stack: each field has its
 * effect and PD output equals colocated output (greedy or seeded, deterministic mode). Refused
 * fields get a 400 naming them from both servers. (2) The endpoints around generation on both
 * servers: GET /v1/models/{id} (the SDK's models.retrieve), /tokenize and /detokenize (vLLM's
 * shapes), CORS preflight with --cors-origin, 405 for a wrong method.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import OpenAI from 'openai';
import { CTX, promptOf, useStack } from '../helpers/stack.js';


type Body = Record<string, unknown>;

/** The file's stack: s.c (cluster), s.pd (router client), s.ref (colocated client); filled by a before hook. */
const ORIGIN = 'http://app.example';
const s = useStack({ extraArgs: { router: ['--cors-origin', ORIGIN], colocated: ['--cors-origin', ORIGIN] } });

interface Out {
  text: string;
  finish: string | null;
  completionTokens: number;
  promptTokens: number;
  /** choices[0].logprobs; for streams the chunks' logprobs concatenated into the same shape. */
  logprobs: Record<string, unknown[]> | null;
}

type AnyChunk = { choices: { text?: string; delta?: { content?: string | null }; finish_reason: string | null; logprobs?: Record<string, unknown> | null }[]; usage?: OpenAI.CompletionUsage | null };

/** Concatenate the array fields of a chunk's logprobs onto `acc` (refusal: null stays). */
function addLogprobs(acc: Record<string, unknown[]> | null, lp: Record<string, unknown> | null | undefined): Record<string, unknown[]> | null {
  if (!lp) return acc;
  const out = acc ?? {};
  for (const [k, v] of Object.entries(lp)) if (Array.isArray(v)) out[k] = [...(out[k] ?? []), ...v];
  return out;
}

/** Text, finish reason and usage of a completion or chat stream. */
async function collect(s: AsyncIterable<AnyChunk>): Promise<Out> {
  const o: Out = { text: '', finish: null, completionTokens: 0, promptTokens: 0, logprobs: null };
  for await (const ch of s) {
    const c = ch.choices[0];
    if (c) {
      o.text += c.text ?? c.delta?.content ?? '';
      o.finish = c.finish_reason ?? o.finish;
      o.logprobs = addLogprobs(o.logprobs, c.logprobs);
    }
    if (ch.usage) [o.completionTokens, o.promptTokens] = [ch.usage.completion_tokens, ch.usage.prompt_tokens];
  }
  return o;
}

/** Non-stream and stream completions/chat of `body` on both servers; asserts all four agree, returns the colocated result. */
async function same(kind: 'completion' | 'chat', body: Body): Promise<Out> {
  const one = async (api: OpenAI, stream: boolean): Promise<Out> => {
    const { prompt, ...rest } = body;
    const req = { model: 'pdserve', temperature: 0, ...(stream ? { stream: true, stream_options: { include_usage: true } } : { stream: false }) };
    if (kind === 'completion') {
      const r = (await api.completions.create({ ...req, prompt, ...rest } as never)) as unknown;
      if (stream) return collect(r as AsyncIterable<AnyChunk>);
      const c = r as OpenAI.Completion;
      return { text: c.choices[0]!.text, finish: c.choices[0]!.finish_reason, completionTokens: c.usage!.completion_tokens, promptTokens: c.usage!.prompt_tokens, logprobs: addLogprobs(null, c.choices[0]!.logprobs as never) };
    }
    const messages = [{ role: 'user', content: String(prompt ?? promptOf(60, 4)) }];
    const r = (await api.chat.completions.create({ ...req, messages, ...rest } as never)) as unknown;
    if (stream) return collect(r as AsyncIterable<AnyChunk>);
    const c = r as OpenAI.ChatCompletion;
    return { text: c.choices[0]!.message.content ?? '', finish: c.choices[0]!.finish_reason, completionTokens: c.usage!.completion_tokens, promptTokens: c.usage!.prompt_tokens, logprobs: addLogprobs(null, c.choices[0]!.logprobs as never) };
  };
  const want = await one(s.ref, false);
  for (const [api, stream, name] of [[s.ref, true, 'colocated stream'], [s.pd, false, 'PD'], [s.pd, true, 'PD stream']] as const) {
    assert.deepEqual(await one(api, stream), want, `${name} equals colocated for ${JSON.stringify(body).slice(0, 200)}`);
  }
  return want;
}

async function refused(path: string, body: Body, param: string, re?: RegExp): Promise<string> {
  let msg = '';
  for (const url of [s.c.router.url, s.c.colocated!.url]) {
    const r = await fetch(`${url}/v1/${path}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'pdserve', ...body }), signal: AbortSignal.timeout(10_000) });
    const j = (await r.json()) as { error: { message: string; param: string | null } };
    assert.equal(r.status, 400, `${url}: ${JSON.stringify(j)}`);
    assert.equal(j.error.param, param, j.error.message);
    if (re) assert.match(j.error.message, re);
    msg = j.error.message;
  }
  return msg;
}


describe('OpenAI fields end to end (PD = colocated)', () => {
  const prompt = promptOf(80, 2);

  test('penalties, min_p, seed, logit_bias change the output and PD equals colocated', async () => {
    const plain = await same('completion', { prompt, max_tokens: 24 });
    for (const extra of [{ repetition_penalty: 1.8 }, { presence_penalty: 2 }, { frequency_penalty: 2 }, { logit_bias: { [String(prompt.charCodeAt(0))]: -100 } }]) {
      const r = await same('completion', { prompt, max_tokens: 24, ...extra });
      if (!('logit_bias' in extra)) assert.notEqual(r.text, plain.text, `${JSON.stringify(extra)} has an effect`);
    }
    const seeded = await same('chat', { prompt, max_tokens: 16, temperature: 1.2, seed: 5, min_p: 0.05, top_k: 40 });
    assert.ok(seeded.completionTokens > 0);
  });

  test('stop_token_ids, min_tokens and ignore_eos', async () => {
    const r = await same('completion', { prompt, max_tokens: 12, min_tokens: 12, ignore_eos: true });
    assert.equal(r.completionTokens, 12);
    assert.equal(r.finish, 'length');
    // token 70 forced by logit_bias and also a stop token: generation stops on it at once…
    const force = { logit_bias: { '70': 100 }, stop_token_ids: [70], ignore_eos: true, max_tokens: 12 };
    const now = await same('completion', { prompt, ...force });
    assert.deepEqual([now.completionTokens, now.finish, now.text], [1, 'stop', '']);
    // …unless min_tokens holds stop tokens off: then it ends on the first one after min_tokens
    const later = await same('completion', { prompt, ...force, min_tokens: 3 });
    assert.deepEqual([later.completionTokens, later.finish], [4, 'stop']);
  });

  test('response_format json_object / json_schema and guided_json give valid JSON, same in PD', async () => {
    const j = await same('chat', { max_tokens: 300, response_format: { type: 'json_object' } });
    assert.equal(j.finish, 'stop', j.text);
    JSON.parse(j.text);
    const schema = { type: 'object', properties: { n: { type: 'integer' }, ok: { type: 'boolean' } }, required: ['n', 'ok'] };
    const js = await same('chat', { max_tokens: 300, response_format: { type: 'json_schema', json_schema: { name: 'r', schema } } });
    const v = JSON.parse(js.text) as { n: unknown; ok: unknown };
    assert.equal(typeof v.n, 'number');
    assert.equal(typeof v.ok, 'boolean');
    const g = await same('completion', { prompt, max_tokens: 300, guided_json: schema });
    assert.equal(typeof (JSON.parse(g.text) as { n: unknown }).n, 'number');
  });

  test('logprobs (completions: top N; chat: logprobs + top_logprobs): one per token, PD equals colocated', async () => {
    const c = await same('completion', { prompt, max_tokens: 10, ignore_eos: true, logprobs: 3 });
    const lp = c.logprobs as { tokens: string[]; token_logprobs: number[]; top_logprobs: Record<string, number>[]; text_offset: number[] };
    assert.equal(lp.tokens.length, 10);
    assert.equal(lp.tokens.join(''), c.text, 'token texts spell the text');
    assert.ok(lp.token_logprobs.every((x) => x <= 0));
    assert.ok(lp.top_logprobs.every((t) => Object.keys(t).length >= 1 && Object.keys(t).length <= 3));
    // greedy: the sampled token is the most likely one
    lp.top_logprobs.forEach((t, i) => assert.equal(Math.max(...Object.values(t)), lp.token_logprobs[i]));
    assert.equal(lp.text_offset[0], 0);
    const ch = await same('chat', { prompt, max_tokens: 8, ignore_eos: true, logprobs: true, top_logprobs: 2 });
    const content = (ch.logprobs as { content: { token: string; logprob: number; bytes: number[]; top_logprobs: unknown[] }[] }).content;
    assert.equal(content.length, 8);
    assert.ok(content.every((t) => t.top_logprobs.length === 2 && Buffer.from(t.bytes).toString('utf8') === t.token));
    const none = await same('chat', { prompt, max_tokens: 4 });
    assert.equal(none.logprobs, null, 'no logprobs unless asked');
  });

  test('echo puts the prompt text before the output (text and token-id prompts), PD equals colocated', async () => {
    const plain = await same('completion', { prompt, max_tokens: 6, ignore_eos: true });
    const e = await same('completion', { prompt, max_tokens: 6, ignore_eos: true, echo: true });
    assert.equal(e.text, prompt + plain.text);
    assert.equal(e.completionTokens, plain.completionTokens);
    const ids = (await (await fetch(`${s.c.colocated!.url}/tokenize`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ prompt }) })).json()) as { tokens: number[] };
    const byIds = await same('completion', { prompt: ids.tokens, max_tokens: 6, ignore_eos: true, echo: true });
    assert.equal(byIds.text, e.text);
  });

  test('chat without max_tokens gets the rest of the context (a prompt over 1536 tokens of 2048 used to fail)', async () => {
    const long = promptOf(CTX - 100, 1);
    const r = await same('chat', { prompt: long, ignore_eos: true });
    assert.equal(r.finish, 'length');
    assert.ok(r.completionTokens > 0, 'generated');
    assert.equal(r.completionTokens + r.promptTokens, CTX, 'prompt + output fill the context exactly');
  });

  test('refused fields name themselves; tools and functions get the same 400', async () => {
    await refused('completions', { prompt, min_p: 2 }, 'min_p');
    await refused('completions', { prompt, repetition_penalty: -3 }, 'repetition_penalty');
    await refused('completions', { prompt, logit_bias: { '999999': 1 } }, 'logit_bias', /outside the vocabulary/);
    await refused('completions', { prompt, stop_token_ids: [999999] }, 'stop_token_ids', /outside the vocabulary/);
    await refused('completions', { prompt, guided_regex: 'a+' }, 'guided_regex');
    await refused('completions', { prompt, bogus_field: 1 }, 'bogus_field', /Unrecognized request argument/);
    const messages = [{ role: 'user', content: 'hi' }];
    const tools = await refused('chat/completions', { messages, tools: [{ type: 'function', function: { name: 'f', parameters: {} } }] }, 'tools');
    const functions = await refused('chat/completions', { messages, functions: [{ name: 'f', parameters: {} }] }, 'functions');
    assert.equal(functions.replace("'functions'", "'tools'"), tools);
    await refused('chat/completions', { messages, tool_choice: 'required' }, 'tool_choice');
    await refused('chat/completions', { messages: [...messages, { role: 'tool', content: '4', tool_call_id: 'c' }] }, 'messages[1].role');
    await refused('chat/completions', { messages, response_format: { type: 'json_schema', json_schema: { name: 'r', schema: { type: 'string', pattern: 'x' } } } }, 'response_format.json_schema.schema.pattern');
    // the SDK surfaces the 400 as BadRequestError
    await assert.rejects(s.pd.completions.create({ model: 'pdserve', prompt, min_p: 2 } as never), (e: unknown) => e instanceof OpenAI.BadRequestError);
  });
});

describe('endpoints around generation (router and colocated)', () => {
  const both = () => [s.c.router.url, s.c.colocated!.url];
  const post = (url: string, body: unknown) => fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body), signal: AbortSignal.timeout(10_000) });

  test('models.retrieve() returns the served model; another id is 404 model_not_found', async () => {
    for (const api of [s.pd, s.ref]) {
      const list = await api.models.list();
      const id = list.data[0]!.id;
      const m = await api.models.retrieve(id);
      assert.deepEqual([m.id, m.object, m.owned_by], [id, 'model', 'pdserve']);
      await assert.rejects(api.models.retrieve('no-such-model'), (e: unknown) => e instanceof OpenAI.NotFoundError && (e.error as { code?: string }).code === 'model_not_found');
    }
  });

  test('/tokenize and /detokenize (vLLM shapes) agree with generation and with each other', async () => {
    const text = 'the river ran past old mills';
    const answers: unknown[] = [];
    for (const url of both()) {
      const t = (await (await post(`${url}/tokenize`, { prompt: text, return_token_strs: true })).json()) as { count: number; max_model_len: number; tokens: number[]; token_strs: string[] };
      assert.equal(t.count, t.tokens.length);
      assert.equal(t.max_model_len, CTX);
      assert.equal(t.token_strs.length, t.count);
      const noBos = (await (await post(`${url}/tokenize`, { prompt: text, add_special_tokens: false })).json()) as { tokens: number[]; token_strs: null };
      assert.equal(noBos.token_strs, null);
      assert.ok(noBos.tokens.length <= t.tokens.length);
      const d = (await (await post(`${url}/detokenize`, { tokens: t.tokens })).json()) as { prompt: string };
      assert.equal(d.prompt, text);
      // usage.prompt_tokens of a completion equals the tokenize count
      const r = await s.ref.completions.create({ model: 'pdserve', prompt: text, max_tokens: 1, temperature: 0 });
      assert.equal(r.usage!.prompt_tokens, t.count);
      const chat = (await (await post(`${url}/tokenize`, { messages: [{ role: 'user', content: text }] })).json()) as { count: number };
      const cr = await s.ref.chat.completions.create({ model: 'pdserve', messages: [{ role: 'user', content: text }], max_tokens: 1, temperature: 0 });
      assert.equal(cr.usage.prompt_tokens, chat.count);
      answers.push([t, d]);
      const bad = await post(`${url}/detokenize`, { tokens: [99999999] });
      assert.equal(bad.status, 400);
      const unk = await post(`${url}/tokenize`, { prompt: 'x', bogus: 1 });
      assert.equal(((await unk.json()) as { error: { param: string } }).error.param, 'bogus');
    }
    assert.deepEqual(answers[0], answers[1], 'router (via prefill) and colocated tokenize alike');
  });

  test('CORS preflight and headers for the configured origin only; 405 for a wrong method', async () => {
    for (const url of both()) {
      const pre = await fetch(`${url}/v1/chat/completions`, { method: 'OPTIONS', headers: { origin: ORIGIN, 'access-control-request-method': 'POST', 'access-control-request-headers': 'content-type,authorization' } });
      assert.equal(pre.status, 204);
      assert.equal(pre.headers.get('access-control-allow-origin'), ORIGIN);
      assert.match(pre.headers.get('access-control-allow-methods') ?? '', /POST/);
      assert.match(pre.headers.get('access-control-allow-headers') ?? '', /authorization/);
      const r = await fetch(`${url}/v1/models`, { headers: { origin: ORIGIN } });
      assert.equal(r.headers.get('access-control-allow-origin'), ORIGIN);
      const other = await fetch(`${url}/v1/models`, { headers: { origin: 'http://evil.example' } });
      assert.equal(other.headers.get('access-control-allow-origin'), null, 'another origin gets no CORS header');
      const wrong = await fetch(`${url}/v1/chat/completions`, { method: 'GET' });
      assert.equal(wrong.status, 405);
      assert.match(wrong.headers.get('allow') ?? '', /POST/);
      assert.equal(((await wrong.json()) as { error: { code: string } }).error.code, 'method_not_allowed');
      const nope = await fetch(`${url}/v1/nothing`);
      assert.equal(nope.status, 404);
    }
  });
});
