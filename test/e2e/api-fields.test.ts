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
import { busy, CTX, promptOf, useStack, waitFor } from '../helpers/stack.js';


type Body = Record<string, unknown>;

/** The file's stack: s.c (cluster), s.pd (router client), s.ref (colocated client); filled by a before hook. */
const ORIGIN = 'http://app.example';
// The colocated reference serves two names given with --served-model-name (PD: the defaults, file name + 'pdserve').
// Two prefills without a prefix cache, round-robin routing: n > 1 must still evaluate a prompt once
// (one prefill computation for n decode sequences), which only the choice groups can give.
const s = useStack({ prefill: 2, extraArgs: { router: ['--cors-origin', ORIGIN, '--policy', 'round_robin'], colocated: ['--cors-origin', ORIGIN, '--served-model-name', 'pdserve', 'alias-b'], prefill: ['--no-prefix-cache'] } });

/** Sum of a counter (all its series) over every prefill's /metrics. */
async function prefillCounter(name: string, labels = ''): Promise<number> {
  let sum = 0;
  for (const w of s.c.byRole('prefill')) {
    const text = await (await fetch(`${w.url}/metrics`, { signal: AbortSignal.timeout(5000) })).text();
    for (const line of text.split('\n')) {
      if (line.startsWith(`${name}{${labels}`) || (labels === '' && line.startsWith(`${name} `))) sum += Number(line.slice(line.lastIndexOf(' ') + 1));
    }
  }
  return sum;
}

/** Total of busy() over every worker of the PD stack. */
async function pdBusy(): Promise<number> {
  let n = 0;
  for (const w of [...s.c.byRole('prefill'), ...s.c.byRole('decode')]) n += await busy(w.url);
  return n;
}

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
    // the reply ends with the JSON: finish stop, nothing after it (PD, colocated, streamed and not: same() compares all four)
    for (const r of [j, js, g]) {
      assert.equal(r.finish, 'stop', r.text);
      assert.equal(r.text, r.text.trimEnd(), 'no trailing newlines');
      assert.ok(r.completionTokens < 300);
    }
  });

  test('zod idioms in a json_schema (.int(), .positive(), .email(), nullable, draft-07 definitions) are accepted; the reply satisfies the schema and ends with stop', async () => {
    // what zod 4's toJSONSchema / the AI SDK's zodSchema emit, plus a zod-to-json-schema reference
    const schema = {
      $schema: 'http://json-schema.org/draft-07/schema#',
      type: 'object',
      properties: {
        age: { type: 'integer', exclusiveMinimum: 0, maximum: 9007199254740991 },
        count: { type: 'integer', minimum: -9007199254740991, maximum: 9007199254740991, description: 'how many' },
        rating: { type: 'integer', minimum: 1, maximum: 5 },
        email: { type: 'string', format: 'email', pattern: "^(?!\\.)(?!.*\\.\\.)([A-Za-z0-9_'+\\-\\.]*)[A-Za-z0-9_+-]@([A-Za-z0-9][A-Za-z0-9\\-]*\\.)+[A-Za-z]{2,}$" },
        home: { $ref: '#/definitions/Place' },
        work: { anyOf: [{ $ref: '#/definitions/Place' }, { type: 'null' }] },
      },
      required: ['age', 'count', 'rating', 'email', 'home', 'work'],
      additionalProperties: false,
      definitions: { Place: { type: 'object', properties: { zip: { type: 'string', maxLength: 6 } }, required: ['zip'], additionalProperties: false } },
    };
    const r = await same('chat', { max_tokens: 400, response_format: { type: 'json_schema', json_schema: { name: 'person', strict: true, schema } } });
    assert.equal(r.finish, 'stop', r.text);
    const v = JSON.parse(r.text) as { age: number; count: number; rating: number; email: string; home: { zip: string }; work: { zip: string } | null };
    assert.ok(Number.isSafeInteger(v.age) && v.age > 0, `age ${v.age}`);
    assert.ok(Number.isSafeInteger(v.count));
    assert.ok(v.rating >= 1 && v.rating <= 5 && Number.isInteger(v.rating));
    assert.match(v.email, new RegExp(schema.properties.email.pattern));
    assert.equal(typeof v.home.zip, 'string');
    assert.ok(v.work === null || typeof v.work.zip === 'string');
    for (const k of ['age', 'count', 'rating']) assert.match(r.text, new RegExp(`"${k}":\\s*-?\\d+\\s*[,}]`), `${k} written as a JSON integer (no exponent)`);
  });

  test('a keyword checked after generation: an output that breaks it is a 422 output_schema_mismatch naming the path (PD and colocated)', async () => {
    // a pattern the random model cannot meet by chance; maxLength keeps the string short
    const schema = { type: 'object', properties: { s: { type: 'string', pattern: '^zz+q$', maxLength: 3 } }, required: ['s'] };
    for (const api of [s.ref, s.pd]) {
      await assert.rejects(
        api.chat.completions.create({ model: 'pdserve', temperature: 0, max_tokens: 60, messages: [{ role: 'user', content: 'x' }], response_format: { type: 'json_schema', json_schema: { name: 'p', schema } } }),
        (e: unknown) => e instanceof OpenAI.UnprocessableEntityError && e.code === 'output_schema_mismatch' && /\$\.s/.test(e.message),
      );
    }
  });

  test('a hostile schema (a 2 KB $defs chain expanding to 4^10 nodes, a 20,000-value enum, 1,000-value enums in two tools) is a fast 400 schema_too_complex while a concurrent stream goes on undisturbed', async () => {
    const defs: Record<string, unknown> = {};
    const props = (i: number) => Object.fromEntries([0, 1, 2, 3].map((k) => [`p${k}`, { $ref: `#/$defs/d${i}`, type: 'object' }]));
    for (let i = 0; i < 10; i++) defs[`d${i}`] = i === 9 ? { type: 'object', properties: { s: { type: 'string' } } } : { type: 'object', properties: props(i + 1) };
    const chain = { $defs: defs, $ref: '#/$defs/d0' };
    const bigEnum = (n: number) => ({ type: 'object', properties: { v: { enum: Array.from({ length: n }, (_, i) => `value-${i}`) } }, required: ['v'] });
    const tool = (name: string) => ({ type: 'function', function: { name, parameters: bigEnum(1000) } });
    const hostile: [string, Body, RegExp][] = [
      ['chat/completions', { messages: [{ role: 'user', content: 'x' }], response_format: { type: 'json_schema', json_schema: { name: 'h', schema: chain } } }, /more than 5000 nodes.*--schema-max-nodes/],
      ['completions', { prompt: 'x', guided_json: bigEnum(20_000) }, /more than 1000 enum\/const values.*--schema-max-enum-values/],
      ['chat/completions', { messages: [{ role: 'user', content: 'x' }], tools: [tool('a'), tool('b')] }, /more than 1000 enum/],
    ];
    for (const api of [s.pd, s.ref]) {
      // the side stream: fixed length, its inter-token gaps measured while the hostile requests come in
      const stream = await api.completions.create({ model: 'pdserve', prompt, max_tokens: 64, ignore_eos: true, temperature: 0, stream: true });
      const gaps: number[] = [];
      let tokens = 0;
      let finish: string | null = null;
      const side = (async () => {
        let last = performance.now();
        for await (const ch of stream) {
          const now = performance.now();
          if (ch.choices[0]?.text) (tokens++, gaps.push(now - last));
          finish = ch.choices[0]?.finish_reason ?? finish;
          last = now;
        }
      })();
      const url = api === s.pd ? s.c.router.url : s.c.colocated!.url;
      for (const [path, body, re] of hostile) {
        const t = performance.now();
        const r = await fetch(`${url}/v1/${path}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'pdserve', max_tokens: 8, ...body }), signal: AbortSignal.timeout(20_000) });
        const j = (await r.json()) as { error: { code: string; message: string; param: string | null } };
        const ms = performance.now() - t;
        assert.equal(r.status, 400, `${url} ${path}: ${JSON.stringify(j).slice(0, 300)}`);
        assert.equal(j.error.code, 'schema_too_complex');
        assert.match(j.error.message, re);
        assert.ok(ms < 3000, `${path} refused in ${ms.toFixed(0)} ms`);
      }
      await side;
      assert.equal(finish, 'length');
      assert.equal(tokens, 64, 'the side stream got every token');
      const worst = Math.max(...gaps.slice(1));
      assert.ok(worst < 3000, `side stream's longest inter-token gap ${worst.toFixed(0)} ms`);
    }
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

  test('logprob tokens are the text as written: leading spaces, joined tokens, text_offset, chat bytes (PD = colocated, stream and not)', async () => {
    type Cmpl = { tokens: string[]; token_logprobs: number[]; top_logprobs: Record<string, number>[]; text_offset: number[] };
    type Chat = { content: { token: string; logprob: number; bytes: number[]; top_logprobs: { token: string; logprob: number; bytes: number[] }[] }[] };
    // a SentencePiece word's first piece carries its space ("Once upon a time" → 'F!f tr2…': ' t' is one token)
    const c = await same('completion', { prompt: 'Once upon a time', max_tokens: 12, ignore_eos: true, logprobs: 3 });
    const lp = c.logprobs as Cmpl;
    assert.equal(lp.tokens.length, 12);
    assert.ok(lp.tokens.some((t) => t.startsWith(' ') && t.length > 1), `a token with its leading space in ${JSON.stringify(lp.tokens)}`);
    assert.equal(lp.tokens.join(''), c.text);
    assert.deepEqual(lp.text_offset, lp.tokens.map((_, i) => lp.tokens.slice(0, i).join('').length));
    // alternatives are rendered in the same context: greedy, the sampled token is the likeliest key
    lp.tokens.forEach((t, i) => assert.equal(lp.top_logprobs[i]![t], lp.token_logprobs[i], `token ${i} ${JSON.stringify(t)} among its alternatives`));
    // echo and logprobs together stay a clear 400 (no prompt logprobs), on both servers
    await refused('completions', { prompt: 'Once upon a time', max_tokens: 2, logprobs: 1, echo: true }, 'echo');

    const ch = await same('chat', { prompt: 'Once upon a time', max_tokens: 10, ignore_eos: true, logprobs: true, top_logprobs: 2 });
    const content = (ch.logprobs as Chat).content;
    assert.equal(content.length, 10);
    assert.equal(content.map((t) => t.token).join(''), ch.text);
    assert.equal(Buffer.from(content.flatMap((t) => t.bytes)).toString('utf8'), ch.text);
    for (const t of content) {
      assert.deepEqual(t.bytes, [...Buffer.from(t.token, 'utf8')]);
      assert.deepEqual(t.top_logprobs[0], { token: t.token, logprob: t.logprob, bytes: t.bytes });
    }

    // ’ (E2 80 99) and é (C3 A9) have no piece in the tiny vocabulary: byte tokens write them, one
    // part each — bytes:\xNN tokens whose raw bytes make the character, at the character's offset
    const parts = ['"', 'bytes:\\xe2', 'bytes:\\x80', 'bytes:\\x99', 'bytes:\\xc3', 'bytes:\\xa9', '"'];
    const g = await same('completion', { prompt: 'say it:', max_tokens: 7, logprobs: 1, guided_json: { enum: ['’é'] } });
    const glp = g.logprobs as Cmpl;
    assert.equal(g.text, '"’é"');
    assert.deepEqual(glp.tokens, parts);
    assert.deepEqual(glp.text_offset, [0, 1, 1, 1, 2, 2, 3]);
    const gc = await same('chat', { prompt: 'say it:', max_tokens: 7, logprobs: true, response_format: { type: 'json_schema', json_schema: { name: 'q', schema: { enum: ['’é'] } } } });
    const gcontent = (gc.logprobs as Chat).content;
    assert.equal(gc.text, '"’é"');
    assert.deepEqual(gcontent.map((t) => t.token), parts);
    assert.deepEqual(gcontent.map((t) => t.bytes), [[0x22], [0xe2], [0x80], [0x99], [0xc3], [0xa9], [0x22]]);
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

  test('refused fields name themselves (tools: see tools.test.ts)', async () => {
    await refused('completions', { prompt, min_p: 2 }, 'min_p');
    await refused('completions', { prompt, repetition_penalty: -3 }, 'repetition_penalty');
    await refused('completions', { prompt, logit_bias: { '999999': 1 } }, 'logit_bias', /outside the vocabulary/);
    await refused('completions', { prompt, stop_token_ids: [999999] }, 'stop_token_ids', /outside the vocabulary/);
    await refused('completions', { prompt, guided_regex: 'a+' }, 'guided_regex');
    await refused('completions', { prompt, bogus_field: 1 }, 'bogus_field', /Unrecognized request argument/);
    const messages = [{ role: 'user', content: 'hi' }];
    await refused('chat/completions', { messages, functions: [{ name: 'f', parameters: {} }] }, 'functions', /legacy/);
    await refused('chat/completions', { messages, tool_choice: 'required' }, 'tool_choice', /needs tools/);
    await refused('chat/completions', { messages: [...messages, { role: 'tool', content: '4', tool_call_id: 'c' }] }, 'messages[1].tool_call_id');
    await refused('chat/completions', { messages, response_format: { type: 'json_schema', json_schema: { name: 'r', schema: { type: 'string', not: { const: 'x' } } } } }, 'response_format.json_schema.schema.not', /keyword 'not'/);
    // the SDK surfaces the 400 as BadRequestError
    await assert.rejects(s.pd.completions.create({ model: 'pdserve', prompt, min_p: 2 } as never), (e: unknown) => e instanceof OpenAI.BadRequestError);
  });
});

/** Texts, finish reasons (by choice index) and usage of an n > 1 / batched request, stream or not. */
interface Multi {
  texts: string[];
  finishes: (string | null)[];
  usage: { prompt_tokens: number; completion_tokens: number } | null;
}

async function multi(api: OpenAI, kind: 'completion' | 'chat', body: Body, stream: boolean): Promise<Multi> {
  const req = { model: 'pdserve', ...body, ...(stream ? { stream: true, stream_options: { include_usage: true } } : {}) };
  const r = (kind === 'completion' ? await api.completions.create(req as never) : await api.chat.completions.create(req as never)) as unknown;
  const o: Multi = { texts: [], finishes: [], usage: null };
  if (!stream) {
    const c = r as { choices: { index: number; text?: string; message?: { content: string }; finish_reason: string }[]; usage: Multi['usage'] };
    c.choices.forEach((ch, k) => assert.equal(ch.index, k, 'choices in index order'));
    for (const ch of c.choices) [o.texts[ch.index], o.finishes[ch.index]] = [ch.text ?? ch.message?.content ?? '', ch.finish_reason];
    o.usage = { prompt_tokens: c.usage!.prompt_tokens, completion_tokens: c.usage!.completion_tokens };
    return o;
  }
  let usageChunks = 0;
  for await (const ch of r as AsyncIterable<AnyChunk & { choices: { index: number }[] }>) {
    for (const c of ch.choices) {
      o.texts[c.index] = (o.texts[c.index] ?? '') + (c.text ?? c.delta?.content ?? '');
      o.finishes[c.index] = c.finish_reason ?? o.finishes[c.index] ?? null;
    }
    if (ch.usage) {
      usageChunks++;
      o.usage = { prompt_tokens: ch.usage.prompt_tokens, completion_tokens: ch.usage.completion_tokens };
    }
  }
  assert.equal(usageChunks, 1, 'one usage chunk');
  return o;
}

/** One request's text (n = 1, one prompt), non-stream, colocated. */
async function single(kind: 'completion' | 'chat', body: Body): Promise<{ text: string; usage: OpenAI.CompletionUsage }> {
  if (kind === 'completion') {
    const c = await s.ref.completions.create({ model: 'pdserve', ...body } as never) as OpenAI.Completion;
    return { text: c.choices[0]!.text, usage: c.usage! };
  }
  const c = await s.ref.chat.completions.create({ model: 'pdserve', ...body } as never) as OpenAI.ChatCompletion;
  return { text: c.choices[0]!.message.content ?? '', usage: c.usage! };
}

/** `multi` on PD and colocated, stream and non-stream: all four equal; returns one. */
async function sameMulti(kind: 'completion' | 'chat', body: Body): Promise<Multi> {
  const want = await multi(s.ref, kind, body, false);
  for (const [api, stream, name] of [[s.ref, true, 'colocated stream'], [s.pd, false, 'PD'], [s.pd, true, 'PD stream']] as const) {
    assert.deepEqual(await multi(api, kind, body, stream), want, `${name} equals colocated for ${JSON.stringify(body).slice(0, 200)}`);
  }
  return want;
}

describe('n > 1 and prompt arrays (one sub-request per choice, merged; in PD one prefill computation per prompt)', () => {
  const p1 = promptOf(50, 3);
  const p2 = promptOf(70, 9);

  test('n=3 (completions and chat, greedy): three choices equal to a single request, usage summed, PD equals colocated', async () => {
    const one = await single('completion', { prompt: p1, max_tokens: 10, temperature: 0 });
    const r = await sameMulti('completion', { prompt: p1, max_tokens: 10, temperature: 0, n: 3 });
    assert.deepEqual(r.texts, [one.text, one.text, one.text]);
    assert.deepEqual(r.usage, { prompt_tokens: one.usage.prompt_tokens, completion_tokens: 3 * one.usage.completion_tokens });
    const messages = [{ role: 'user', content: p2 }];
    const chatOne = await single('chat', { messages, max_tokens: 8, temperature: 0 });
    const chat = await sameMulti('chat', { messages, max_tokens: 8, temperature: 0, n: 3 });
    assert.deepEqual(chat.texts, [chatOne.text, chatOne.text, chatOne.text]);
    assert.equal(chat.usage!.completion_tokens, 3 * chatOne.usage.completion_tokens);
  });

  test('seeded n=2 at temperature 1.2: choice i is the single request with seed + i', async () => {
    const messages = [{ role: 'user', content: p1 }];
    const base = { messages, max_tokens: 12, temperature: 1.2, seed: 11 };
    const r = await sameMulti('chat', { ...base, n: 2 });
    assert.deepEqual(r.texts, [(await single('chat', base)).text, (await single('chat', { ...base, seed: 12 })).text]);
  });

  test('prompt arrays (strings and token-id arrays) with n=2: index = prompt_index × n + i, each equal to its single request', async () => {
    const a = await single('completion', { prompt: p1, max_tokens: 6, temperature: 0 });
    const b = await single('completion', { prompt: p2, max_tokens: 6, temperature: 0 });
    const r = await sameMulti('completion', { prompt: [p1, p2], max_tokens: 6, temperature: 0, n: 2 });
    assert.deepEqual(r.texts, [a.text, a.text, b.text, b.text]);
    assert.deepEqual(r.usage, { prompt_tokens: a.usage.prompt_tokens + b.usage.prompt_tokens, completion_tokens: 2 * (a.usage.completion_tokens + b.usage.completion_tokens) });
    const ids = (await (await fetch(`${s.c.colocated!.url}/tokenize`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ prompt: p2 }) })).json()) as { tokens: number[] };
    const byIds = await sameMulti('completion', { prompt: [ids.tokens.slice(0, 20), ids.tokens], max_tokens: 6, temperature: 0 });
    assert.equal(byIds.texts[1], b.text);
    assert.equal(byIds.texts[0], (await single('completion', { prompt: ids.tokens.slice(0, 20), max_tokens: 6, temperature: 0 })).text);
  });

  test(`more than 16 choices is a 400 naming n / prompt; a failing choice fails the request`, async () => {
    await refused('completions', { prompt: p1, n: 17 }, 'n', /exceeds the limit/);
    await refused('completions', { prompt: Array(9).fill(p1), n: 2 }, 'n', /exceeds the limit/);
    await refused('completions', { prompt: [p1, 'x'.repeat(CTX * 8)], max_tokens: 4 }, 'prompt');
    await refused('chat/completions', { messages: [{ role: 'user', content: p1 }], n: 2, best_of: 2 }, 'best_of');
  });

  test('n=3 in PD is one prefill: the prompt evaluated and saved once for three rooms (no prefix cache, round-robin over two prefills); a batch: one computation per prompt', async () => {
    const prompt = promptOf(90, 21);
    const before = { comp: await prefillCounter('pdserve_prefill_computations_total'), tokens: await prefillCounter('pdserve_prefill_prompt_tokens_evaluated_total'), saved: await prefillCounter('pdserve_prefill_states_saved_total'), ok: await prefillCounter('pdserve_rooms_terminal_total', 'state="Success"') };
    const r = await s.pd.completions.create({ model: 'pdserve', prompt, max_tokens: 5, temperature: 0, n: 3 });
    assert.equal(r.choices.length, 3);
    const P = r.usage!.prompt_tokens;
    // Prefill's rooms reach Success on decode's kv_ack, which may trail the response a little.
    assert.ok(await waitFor(async () => (await prefillCounter('pdserve_rooms_terminal_total', 'state="Success"')) - before.ok === 3, 5000), 'three rooms handed off');
    assert.equal((await prefillCounter('pdserve_prefill_computations_total')) - before.comp, 1, 'one prompt computation');
    assert.equal((await prefillCounter('pdserve_prefill_states_saved_total')) - before.saved, 1, 'one state saved');
    assert.equal((await prefillCounter('pdserve_prefill_prompt_tokens_evaluated_total')) - before.tokens, P, 'the prompt tokens evaluated once');
    // Control: three single requests cost three computations (this stack has no prefix cache).
    for (let i = 0; i < 3; i++) await s.pd.completions.create({ model: 'pdserve', prompt, max_tokens: 5, temperature: 0 });
    assert.equal((await prefillCounter('pdserve_prefill_computations_total')) - before.comp, 4);
    // A batch of two prompts with n = 2: one computation per prompt, each feeding its two rooms.
    const batch = await s.pd.completions.create({ model: 'pdserve', prompt: [prompt, promptOf(60, 22)], max_tokens: 5, temperature: 0, n: 2 });
    assert.equal(batch.choices.length, 4);
    assert.equal((await prefillCounter('pdserve_prefill_computations_total')) - before.comp, 6);
    assert.equal((await prefillCounter('pdserve_prefill_states_saved_total')) - before.saved, 6);
  });

  test('aborting an n=3 stream frees every room on both workers', async () => {
    const ac = new AbortController();
    const stream = await s.pd.completions.create({ model: 'pdserve', prompt: p2, max_tokens: 900, ignore_eos: true, temperature: 0, n: 3, stream: true }, { signal: ac.signal });
    const decode = s.c.byRole('decode')[0]!.url;
    let chunks = 0;
    let busyAtAbort = 0;
    // The SDK ends the iteration (or throws APIUserAbortError, depending on timing) after abort().
    try {
      for await (const _ of stream) {
        if (++chunks === 6) {
          busyAtAbort = await busy(decode);
          ac.abort();
        }
      }
    } catch (err) {
      assert.ok(err instanceof OpenAI.APIUserAbortError, String(err));
    }
    assert.ok(chunks >= 6);
    assert.ok(busyAtAbort > 0, 'decode was generating the choices when the client aborted');
    const idle = await waitFor(async () => (await pdBusy()) === 0, 1500);
    assert.ok(idle, `workers idle after the abort: ${await pdBusy()}`);
  });

  test('the decode serving an n = 3 stream killed mid-way: every choice is migrated, the stream completes, every choice equal, every room freed', async () => {
    const stream = await s.pd.chat.completions.create({ model: 'pdserve', messages: [{ role: 'user', content: p1 }], max_tokens: 900, ignore_eos: true, temperature: 0, n: 3, stream: true } as never) as unknown as AsyncIterable<AnyChunk>;
    const decode = s.c.byRole('decode')[0]!.url;
    let chunks = 0;
    let killed = '';
    let killing: Promise<void> | null = null;
    const text = ['', '', ''];
    const finish: (string | null)[] = [null, null, null];
    for await (const chunk of stream) {
      for (const c of chunk.choices as (AnyChunk['choices'][number] & { index: number })[]) {
        text[c.index] += c.delta?.content ?? '';
        if (c.finish_reason) finish[c.index] = c.finish_reason;
      }
      if (++chunks === 6) {
        // The decode dies (SIGKILL) and is started again: the router migrates every choice.
        // (The first chunks may all come from prefill's first tokens: wait for decode to be generating.)
        await waitFor(async () => {
          const dbg = (await (await fetch(`${decode}/debug/rooms`)).json()) as { decoding: { room: string }[] };
          killed = dbg.decoding.at(-1)?.room ?? '';
          return killed !== '';
        }, 2000);
        const p = s.c.byRole('decode')[0]!;
        killing = (async () => {
          await s.c.kill(p);
          await s.c.spawn(p);
        })();
      }
    }
    await killing;
    assert.ok(killed, 'a choice was decoding');
    assert.deepEqual(finish, ['length', 'length', 'length'], 'every choice ran to its budget');
    assert.ok(text[0]!.length > 0);
    assert.deepEqual([text[1], text[2]], [text[0], text[0]], 'the migrated choices are equal (greedy): no token repeated or missing');
    const idle = await waitFor(async () => (await pdBusy()) === 0, 1500);
    assert.ok(idle, `every room released: ${await pdBusy()}`);
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

  test("served model names: 'pdserve' everywhere, --served-model-name aliases, another name is 404 model_not_found", async () => {
    for (const api of [s.pd, s.ref]) {
      const m = await api.models.retrieve('pdserve');
      assert.equal(m.id, 'pdserve');
      const bad = (e: unknown) => e instanceof OpenAI.NotFoundError && (e.error as { code?: string; param?: string }).code === 'model_not_found' && (e.error as { param?: string }).param === 'model';
      await assert.rejects(api.completions.create({ model: 'gpt-4o', prompt: 'hi', max_tokens: 2 }), bad);
      await assert.rejects(api.chat.completions.create({ model: 'gpt-4o', messages: [{ role: 'user', content: 'hi' }], max_tokens: 2, stream: true }), bad);
    }
    // PD: the GGUF's file name first (responses' model), then 'pdserve'
    const pdNames = (await s.pd.models.list()).data.map((m) => m.id);
    assert.equal(pdNames.length, 2);
    assert.equal(pdNames[1], 'pdserve');
    const r = await s.pd.completions.create({ model: pdNames[0]!, prompt: 'hi', max_tokens: 2 });
    assert.equal(r.model, pdNames[0]);
    // colocated with --served-model-name pdserve alias-b: exactly those, the first in responses
    assert.deepEqual((await s.ref.models.list()).data.map((m) => m.id), ['pdserve', 'alias-b']);
    const a = await s.ref.chat.completions.create({ model: 'alias-b', messages: [{ role: 'user', content: 'hi' }], max_tokens: 2 });
    assert.equal(a.model, 'pdserve');
    await assert.rejects(s.ref.completions.create({ model: pdNames[0]!, prompt: 'hi', max_tokens: 2 }), (e: unknown) => e instanceof OpenAI.NotFoundError);
  });

  test('precise 400s and OpenAI bodies for a __proto__ key, a text/plain body, broken JSON and oversized headers (431)', async () => {
    const raw = (url: string, body: string, headers: Record<string, string> = { 'content-type': 'application/json' }) =>
      fetch(`${url}/v1/completions`, { method: 'POST', headers, body, signal: AbortSignal.timeout(10_000) });
    for (const url of both()) {
      const cases: [Response, number, RegExp][] = [
        [await raw(url, '{"model":"pdserve","prompt":"hi","__proto__":{"x":1}}'), 400, /'__proto__' is not allowed/],
        [await raw(url, '{"model":"pdserve","prompt":"hi"}', { 'content-type': 'text/plain' }), 400, /not sent as JSON.*application\/json/],
        [await raw(url, '{"model":"pdserve","prompt":'), 400, /could not parse the JSON body.*Unexpected end of JSON input/],
        [await raw(url, '{"prompt":"hi"}', { 'content-type': 'application/json', 'x-filler': 'a'.repeat(20_000) }), 431, /header fields are too large/],
      ];
      for (const [r, status, re] of cases) {
        assert.equal(r.status, status);
        const e = ((await r.json()) as { error: { message: string; type: string } }).error;
        assert.match(e.message, re);
        assert.equal(e.type, 'invalid_request_error');
      }
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
