/**
 * Tool calls end to end through the real `openai` SDK, PD (router → prefill → KV → decode) and
 * the colocated reference on one stack (tiny generated model: no chat template, so
 * node-llama-cpp's generic wrapper and its `||call: name({...})` syntax). Random weights never
 * call a tool on their own, so "required" and a named tool_choice (the grammar forces one
 * well-formed call) carry the call tests; "auto" and "none" give text. Covers: non-stream and
 * stream (the SDK's stream accumulator), a follow-up round with the assistant tool_calls and the
 * tool result in the history, PD equal to colocated, and the 400s (bad schema, legacy functions,
 * unanswered calls, tool_choice without tools); tools with a JSON response_format (calls or a
 * JSON reply) on the tagged-template stack.
 * The context is 4096 tokens: the wrapper's function documentation alone is ≈ 1000 characters,
 * a token each on the tiny byte-level vocabulary.
 */
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import OpenAI from 'openai';
import { writeLlamaGguf } from '../../src/engine/gguf-writer.js';
import type { Cluster } from '../../src/up/cluster.js';
import { client, startStack, useStack } from '../helpers/stack.js';

const s = useStack({ ctxSize: 4096 });

const WEATHER: OpenAI.ChatCompletionTool = {
  type: 'function',
  function: { name: 'get_weather', description: 'Current weather of a city', parameters: { type: 'object', properties: { city: { type: 'string' }, unit: { type: 'string', enum: ['c', 'f'] } }, required: ['city', 'unit'] } },
};
const NOW: OpenAI.ChatCompletionTool = { type: 'function', function: { name: 'now', description: 'The current time' } };
const messages: OpenAI.ChatCompletionMessageParam[] = [{ role: 'user', content: 'What is the weather in Paris?' }];
const base = { model: 'pdserve', temperature: 0, max_tokens: 120, tools: [WEATHER, NOW] };

/** The call a response made, without its random id. */
interface Shape {
  content: string | null;
  finish: string | null;
  calls: { name: string; arguments: string }[];
}
const shapeOf = (r: OpenAI.ChatCompletion): Shape => ({
  content: r.choices[0]!.message.content,
  finish: r.choices[0]!.finish_reason,
  calls: (r.choices[0]!.message.tool_calls ?? []).map((c) => {
    assert.equal(c.type, 'function');
    assert.match(c.id, /^call_/);
    return { name: (c as OpenAI.ChatCompletionMessageFunctionToolCall).function.name, arguments: (c as OpenAI.ChatCompletionMessageFunctionToolCall).function.arguments };
  }),
});

/** Non-stream and stream (through the SDK's ChatCompletionStream accumulator) on PD and colocated: all four equal. */
async function same(body: Partial<OpenAI.ChatCompletionCreateParamsNonStreaming>): Promise<Shape> {
  const req = { ...base, messages, ...body } as OpenAI.ChatCompletionCreateParamsNonStreaming;
  const want = shapeOf(await s.ref.chat.completions.create(req));
  for (const [api, name] of [[s.ref, 'colocated'], [s.pd, 'PD']] as const) {
    if (api !== s.ref) assert.deepEqual(shapeOf(await api.chat.completions.create(req)), want, `${name} non-stream equals colocated`);
    const st = api.chat.completions.stream({ ...req, stream: true });
    const fin = await st.finalChatCompletion();
    const got = shapeOf(fin as OpenAI.ChatCompletion);
    // the accumulator turns an absent content into null; compare calls, finish and text
    assert.deepEqual({ ...got, content: got.content ?? null }, { ...want, content: want.content === '' ? null : want.content }, `${name} stream equals colocated`);
  }
  return want;
}

describe('tool calls through the chat wrapper (PD = colocated)', () => {
  test('tool_choice "required": one well-formed call whose arguments follow the schema, finish_reason tool_calls', async () => {
    const r = await same({ tool_choice: 'required' });
    assert.equal(r.finish, 'tool_calls');
    assert.equal(r.calls.length, 1);
    assert.ok(['get_weather', 'now'].includes(r.calls[0]!.name));
    const args = JSON.parse(r.calls[0]!.arguments) as { city?: unknown; unit?: unknown };
    if (r.calls[0]!.name === 'get_weather') {
      assert.equal(typeof args.city, 'string');
      assert.ok(args.unit === 'c' || args.unit === 'f', `enum honoured: ${r.calls[0]!.arguments}`);
    } else assert.deepEqual(args, {});
    assert.equal(r.content, null, 'only a call: content null');
  });

  test('a named tool_choice calls that function; seeded sampling too', async () => {
    const w = await same({ tool_choice: { type: 'function', function: { name: 'get_weather' } }, temperature: 0.8, seed: 3, max_tokens: 400 });
    assert.deepEqual([w.finish, w.calls.map((c) => c.name)], ['tool_calls', ['get_weather']]);
    assert.equal(typeof (JSON.parse(w.calls[0]!.arguments) as { city: unknown }).city, 'string');
    const n = await same({ tool_choice: { type: 'function', function: { name: 'now' } } });
    assert.deepEqual(n.calls, [{ name: 'now', arguments: '{}' }]);
  });

  test('"auto" and "none": the tools are in the prompt, the random model answers in text', async () => {
    const plain = await s.ref.chat.completions.create({ model: 'pdserve', messages, max_tokens: 1 });
    for (const tool_choice of ['auto', 'none'] as const) {
      const r = await same({ tool_choice, max_tokens: 24 });
      assert.equal(r.calls.length, 0);
      assert.ok(r.finish === 'stop' || r.finish === 'length');
      assert.equal(typeof r.content, 'string');
      const u = await s.pd.chat.completions.create({ ...base, messages, tool_choice, max_tokens: 1 });
      assert.ok(u.usage!.prompt_tokens > plain.usage!.prompt_tokens + 500, `functions documented in the prompt (${u.usage!.prompt_tokens} vs ${plain.usage!.prompt_tokens} tokens)`);
    }
  });

  test('a follow-up round with the assistant tool_calls and the tool result in the history', async () => {
    const first = await s.pd.chat.completions.create({ ...base, messages, tool_choice: { type: 'function', function: { name: 'get_weather' } } });
    const msg = first.choices[0]!.message;
    const call = msg.tool_calls![0]!;
    const history: OpenAI.ChatCompletionMessageParam[] = [...messages, msg as OpenAI.ChatCompletionAssistantMessageParam, { role: 'tool', tool_call_id: call.id, content: '{"temperature": 21, "sky": "clear"}' }];
    // LangChain's shape of the same history: name on the user, assistant ("model") and tool (the tool's name) messages — accepted, not rendered
    const named = [{ ...history[0]!, name: 'alice' }, { ...history[1]!, name: 'model' }, { ...history[2]!, name: 'get_weather' }] as OpenAI.ChatCompletionMessageParam[];
    const plainTurn = await same({ messages: history, tool_choice: 'auto', max_tokens: 8 } as never);
    assert.deepEqual(await same({ messages: named, tool_choice: 'auto', max_tokens: 8 } as never), plainTurn, 'names change nothing in the prompt');
    const r = await same({ messages: history, tool_choice: 'auto', max_tokens: 24 } as never);
    assert.equal(r.calls.length, 0);
    const u = await s.pd.chat.completions.create({ ...base, messages: history, max_tokens: 1 });
    assert.ok(u.usage!.prompt_tokens > first.usage!.prompt_tokens + 20, 'the call and its result are rendered into the prompt');
    // and a second forced call in the same turn
    const again = await same({ messages: history, tool_choice: 'required' } as never);
    assert.equal(again.finish, 'tool_calls');
  });

  test('/tokenize with tools counts the prompt as the generation request does; another model name is 404', async () => {
    const u = await s.ref.chat.completions.create({ ...base, messages, max_tokens: 1 });
    for (const url of [s.c.router.url, s.c.colocated!.url]) {
      const post = (body: unknown) => fetch(`${url}/tokenize`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body), signal: AbortSignal.timeout(10_000) });
      const t = (await (await post({ model: 'pdserve', messages, tools: base.tools })).json()) as { count: number };
      assert.equal(t.count, u.usage!.prompt_tokens);
      const other = await post({ model: 'gpt-4o', messages });
      assert.equal(other.status, 404);
      assert.equal(((await other.json()) as { error: { code: string } }).error.code, 'model_not_found');
    }
  });

  test('n = 2 with a forced call: each choice carries its call (stream and non-stream), seeded choices as single requests', async () => {
    const req = { ...base, messages, tool_choice: 'required' as const, temperature: 0.8, seed: 11, max_tokens: 400 };
    const single = (seed: number) => s.ref.chat.completions.create({ ...req, seed }).then(shapeOf);
    const want = [await single(11), await single(12)];
    for (const api of [s.pd, s.ref]) {
      const r = await api.chat.completions.create({ ...req, n: 2 });
      assert.deepEqual(r.choices.map((c) => shapeOf({ ...r, choices: [c] })), want, 'non-stream: choice i = the single request with seed + i');
      const fin = await api.chat.completions.stream({ ...req, n: 2, stream: true }).finalChatCompletion();
      assert.deepEqual(fin.choices.map((c) => shapeOf({ ...fin, choices: [c] } as OpenAI.ChatCompletion)), want, 'stream: the same calls');
    }
  });

  test('bad tools and tool histories are 400s naming the field, on both servers', async () => {
    for (const api of [s.pd, s.ref]) {
      const bad = async (body: Record<string, unknown>, param: string, re: RegExp) => {
        await assert.rejects(api.chat.completions.create({ model: 'pdserve', messages, ...body } as never), (e: unknown) => {
          assert.ok(e instanceof OpenAI.BadRequestError, String(e));
          assert.equal((e.error as { param?: string }).param, param);
          assert.match(e.message, re);
          return true;
        });
      };
      await bad({ tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'object', properties: { a: { type: 'object', propertyNames: { pattern: '^x' } } } } } }] }, 'tools[0].function.parameters.properties.a.propertyNames', /not supported/);
      await bad({ tools: [{ type: 'function', function: { name: 'f', parameters: 'nope' } }] }, 'tools[0].function.parameters', /object/i);
      await bad({ functions: [{ name: 'f', parameters: {} }] }, 'functions', /legacy.*tools/);
      await bad({ tool_choice: 'required' }, 'tool_choice', /needs tools/);
      await bad({ messages: [...messages, { role: 'tool', tool_call_id: 'nope', content: '1' }] }, 'messages[1].tool_call_id', /no earlier assistant tool call/);
      await bad({ messages: [...messages, { role: 'assistant', content: null, tool_calls: [{ id: 'c', type: 'function', function: { name: 'f', arguments: '{}' } }] }] }, 'messages[1].tool_calls[0]', /no tool message answers/);
    }
  });
});

/**
 * Parallel calls need a wrapper with a between-calls text: the tiny model with a template whose
 * calls are repeated <tool_call> blocks (test/fixtures/tagged-tools.jinja), on a second small
 * stack whose router and colocated server allow 2 calls per turn.
 */
describe('parallel tool calls (a template with repeated <tool_call> blocks, --max-tool-calls 2)', () => {
  const t = {} as { c: Cluster; pd: OpenAI; ref: OpenAI };
  before(async () => {
    const file = join(mkdtempSync(join(tmpdir(), 'pdserve-tagged-')), 'tagged.gguf');
    await writeLlamaGguf(file, { preset: 'tiny', seed: 1, chatTemplate: readFileSync(new URL('../fixtures/tagged-tools.jinja', import.meta.url), 'utf8') });
    t.c = await startStack({ model: file, ctxSize: 4096, extraArgs: { router: ['--max-tool-calls', '2'], colocated: ['--max-tool-calls', '2'] } });
    t.pd = client(t.c.router.url);
    t.ref = client(t.c.colocated!.url);
  });
  after(async () => {
    await t.c?.stop();
  });

  test('every turn ends by itself with finish_reason "tool_calls" and 1 or 2 well-formed calls (bounded whitespace between them); PD equals colocated, stream and not', async () => {
    const unit: OpenAI.ChatCompletionTool = { type: 'function', function: { name: 'forecast', parameters: { type: 'object', properties: { unit: { type: 'string', enum: ['c', 'f'] }, days: { type: 'integer', minimum: 1, maximum: 7 } }, required: ['unit', 'days'] } } };
    const counts: number[] = [];
    for (const seed of [1, 2, 3, 4]) {
      const req = { model: 'pdserve', messages, tools: [unit, NOW], tool_choice: 'required' as const, temperature: 1, seed, max_tokens: 600 };
      const want = shapeOf(await t.ref.chat.completions.create(req));
      assert.equal(want.finish, 'tool_calls', `seed ${seed}: ${JSON.stringify(want)}`);
      assert.ok(want.calls.length >= 1 && want.calls.length <= 2, `seed ${seed}: ${want.calls.length} calls`);
      for (const c of want.calls) {
        const args = JSON.parse(c.arguments) as { days?: number };
        if (c.name === 'forecast') assert.ok(Number.isInteger(args.days) && args.days! >= 1 && args.days! <= 7, c.arguments);
      }
      assert.deepEqual(shapeOf(await t.pd.chat.completions.create(req)), want, `seed ${seed}: PD equals colocated`);
      const fin = await t.pd.chat.completions.stream({ ...req, stream: true }).finalChatCompletion();
      assert.deepEqual(shapeOf(fin as OpenAI.ChatCompletion).calls, want.calls, `seed ${seed}: PD stream`);
      counts.push(want.calls.length);
    }
    assert.ok(counts.includes(2), `some turn makes 2 calls (the bound): ${counts}`);
  });

  test('tools with a json_schema response_format, tool_choice "auto": each reply is calls (finish tool_calls) or schema-valid JSON content (finish stop, nothing after it); PD equals colocated', async () => {
    const unit: OpenAI.ChatCompletionTool = { type: 'function', function: { name: 'forecast', parameters: { type: 'object', properties: { unit: { type: 'string', enum: ['c', 'f'] } }, required: ['unit'] } } };
    const schema = { type: 'object', properties: { city: { type: 'string', enum: ['Oslo', 'Rome'] }, warm: { type: 'boolean' } }, required: ['city', 'warm'], additionalProperties: false };
    // Random weights favour '{': half the runs push '<' (the call prefix's first character) up, so both forms are taken.
    const tok = (await (await fetch(`${t.c.colocated!.url}/tokenize`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'pdserve', prompt: '<', add_special_tokens: false }), signal: AbortSignal.timeout(10_000) })).json()) as { tokens: number[] };
    const lt = tok.tokens.at(-1)!;
    const seen = { calls: 0, json: 0 };
    for (const seed of [1, 2, 3, 4]) {
      const req = { model: 'pdserve', messages, tools: [unit], tool_choice: 'auto' as const, response_format: { type: 'json_schema' as const, json_schema: { name: 'report', schema } }, temperature: 1, seed, max_tokens: 300, ...(seed % 2 === 0 ? { logit_bias: { [lt]: 50 } } : {}) };
      const want = shapeOf(await t.ref.chat.completions.create(req));
      if (want.calls.length > 0) {
        seen.calls++;
        assert.equal(want.finish, 'tool_calls', `seed ${seed}: ${JSON.stringify(want)}`);
        assert.equal(want.content, null, `seed ${seed}: calls alone`);
        for (const c of want.calls) assert.ok(['c', 'f'].includes((JSON.parse(c.arguments) as { unit: string }).unit), c.arguments);
      } else {
        seen.json++;
        assert.equal(want.finish, 'stop', `seed ${seed}: ${JSON.stringify(want)}`);
        assert.doesNotMatch(want.content!, /\s$/, 'nothing after the JSON');
        const v = JSON.parse(want.content!) as { city: unknown; warm: unknown };
        assert.ok(['Oslo', 'Rome'].includes(v.city as string) && typeof v.warm === 'boolean' && Object.keys(v).length === 2, want.content!);
      }
      assert.deepEqual(shapeOf(await t.pd.chat.completions.create(req)), want, `seed ${seed}: PD equals colocated`);
      const fin = await t.pd.chat.completions.stream({ ...req, stream: true }).finalChatCompletion();
      const got = shapeOf(fin as OpenAI.ChatCompletion);
      assert.deepEqual({ ...got, content: got.content || null }, { ...want, content: want.content || null }, `seed ${seed}: PD stream`);
    }
    assert.ok(seen.calls > 0 && seen.json > 0, `both forms taken: ${JSON.stringify(seen)}`);
  });
});
