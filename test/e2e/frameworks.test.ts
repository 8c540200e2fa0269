/**
 * The agent frameworks' own high-level APIs against one `up` cluster (router → prefill → KV →
 * decode) and its colocated reference, each flow on both: the openai SDK (6, and 5 under the
 * `openai5` alias) `chat.completions.parse` and `runTools`; the Vercel AI SDK `generateObject`,
 * `streamObject` and `generateText` with a tool and `stopWhen` (chat and Responses providers);
 * LangChain `withStructuredOutput` (jsonSchema, functionCalling, jsonMode), a `bindTools` loop and
 * `createAgent`; the OpenAI Agents SDK (an agent with a tool and an `outputType`, Responses and
 * chat models); LlamaIndex `exec` with a tool and with a response format.
 *
 * Each asserts what a user of the framework expects: the parsed object validates against the
 * user's schema (zod `.int()`, `.positive()`, `.email()`, `.max()`; a draft-07 `#/definitions/`
 * schema), a structured reply ends on its own (finish_reason stop, not length), the tool's own
 * function ran with parsed arguments, and a final answer followed. The model is the trained
 * stories260K (real text) given test/fixtures/tagged-tools.jinja as its chat template, the
 * `<tool_call>` JSON syntax of Hermes/Qwen-style templates; JSON and tool calls are forced by the
 * grammar, so parsed objects and calls are real. It ends a story with BOS (id 1):
 * `stop_token_ids: [1]` goes in as an extra body field, and a final answer after a tool result
 * ends at its first sentence (`stop: ['.']`); the Responses API has neither: there the flows end
 * on JSON or a tool call. The model may call a tool several times in one turn (parallel calls
 * are on by default); a loop
 * ends deterministically: the first model call is forced to a tool (tool_choice), the next may
 * not call one (tool_choice none, or the framework's own reset), and every loop has a step bound.
 */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { dirname, resolve } from 'node:path';
import { describe, test } from 'node:test';
import { fileURLToPath } from 'node:url';
import OpenAI from 'openai';
import { zodFunction, zodResponseFormat } from 'openai/helpers/zod';
import OpenAI5 from 'openai5';
import { zodFunction as zodFunction5, zodResponseFormat as zodResponseFormat5 } from 'openai5/helpers/zod';
import { z } from 'zod';
import { createOpenAI } from '@ai-sdk/openai';
import { generateObject, generateText, jsonSchema, stepCountIs, streamObject, tool as aiTool } from 'ai';
import { ChatOpenAI } from '@langchain/openai';
import { AIMessage, HumanMessage, ToolMessage, type BaseMessage } from '@langchain/core/messages';
import { tool as lcTool } from '@langchain/core/tools';
import { createAgent, createMiddleware } from 'langchain';
import * as agents from 'pdserve-test-agents-sdk';
import { OpenAI as LlamaOpenAI } from '@llamaindex/openai';
import { tool as llamaTool } from '@llamaindex/core/tools';
import { withChatTemplate } from '../helpers/gguf-template.js';
import { apiKey, useStack } from '../helpers/stack.js';
import { storiesModel } from '../helpers/stories.js';

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), '../..');


const STORIES = storiesModel();
const MODEL = STORIES && withChatTemplate(STORIES, readFileSync(resolve(ROOT, 'test/fixtures/tagged-tools.jinja'), 'utf8'));
if (!MODEL) {
  const why = `frameworks.test.ts: SKIPPED: the trained model ../shared/models/stories260K.gguf is missing (looked from ${ROOT})`;
  console.error(`\n!!! ${why}\n`);
  if (process.env.CI === 'true') throw new Error(why);
}

/** BOS ends a story: the extra body field that ends a story with finish_reason stop. */
const STOP = { stop_token_ids: [1] };
/**
 * After a tool result the story model seldom reaches a BOS: a final answer ends at its first
 * sentence (a stop string, honoured by every framework). Only for text turns: a stop string
 * would cut JSON.
 */
const FINAL = { stop_token_ids: [1], stop: ['.'] };
/**
 * Enough for a turn of parallel calls to reach the server's bound (--max-tool-calls, 16): the
 * story model, asked for a call, writes call after call (about 80 tokens each) until it.
 */
const MAX = 2000;
const TIMEOUT = 60_000;

// The user's schema, with the zod refinements frameworks turn into JSON-schema keywords.
const Contact = z.object({
  name: z.string().max(16),
  age: z.number().int().positive(),
  email: z.string().email(),
  role: z.enum(['admin', 'user']),
});
type Contact = z.infer<typeof Contact>;
const ASK = 'Make up a contact card for Ann.';

/** A draft-07 schema with `#/definitions/` references, as zod-to-json-schema and hand-written schemas have. */
const TRIP_SCHEMA = {
  $schema: 'http://json-schema.org/draft-07/schema#',
  definitions: { city: { type: 'string', enum: ['oslo', 'paris', 'rome'] }, day: { type: 'integer', minimum: 1, maximum: 31 } },
  type: 'object',
  properties: { from: { $ref: '#/definitions/city' }, to: { $ref: '#/definitions/city' }, day: { $ref: '#/definitions/day' } },
  required: ['from', 'to', 'day'],
  additionalProperties: false,
} as const;
const Trip = z.object({ from: z.enum(['oslo', 'paris', 'rome']), to: z.enum(['oslo', 'paris', 'rome']), day: z.number().int().min(1).max(31) });

const CITIES = ['oslo', 'paris', 'rome'] as const;
const WEATHER_ASK = 'What is the weather in Oslo?';
/** The tool every loop offers: records each call's parsed arguments. */
function weatherLog(): { calls: { city: string }[]; run: (a: { city: string }) => string } {
  const calls: { city: string }[] = [];
  return { calls, run: (a) => (calls.push(a), JSON.stringify({ city: a.city, celsius: 3, sky: 'snow' })) };
}
function assertRan(calls: { city: string }[], what: string): void {
  assert.ok(calls.length >= 1, `${what}: the tool's function ran`);
  for (const c of calls) assert.ok((CITIES as readonly string[]).includes(c.city), `${what}: parsed arguments ${JSON.stringify(c)}`);
}
function assertAnswer(text: unknown, what: string): void {
  assert.equal(typeof text, 'string', `${what}: a final answer`);
  assert.ok((text as string).trim().length > 0, `${what}: a non-empty final answer`);
}

// 8192: a second turn carries 16 calls and their results (about 2300 tokens) and MAX more
const s = MODEL ? useStack({ model: MODEL, ctxSize: 8192 }) : null;
const SIDES = [
  ['PD', () => s!.c.router.url],
  ['colocated', () => s!.c.colocated!.url],
] as const;

/** One test per server side, skipped (loudly, above) without the model. */
function each(name: string, fn: (url: string, side: string) => Promise<void>): void {
  for (const [side, url] of SIDES) test(`${name} (${side})`, { skip: MODEL ? false : 'stories260K.gguf missing' }, () => fn(url(), side));
}

for (const [label, Client, respFormat, fnTool] of [
  ['openai 6', OpenAI, zodResponseFormat, zodFunction],
  ['openai 5', OpenAI5, zodResponseFormat5, zodFunction5],
] as const) {
  describe(`${label}`, () => {
    const client = (url: string) => new (Client as typeof OpenAI)({ baseURL: `${url}/v1`, apiKey: apiKey(), timeout: TIMEOUT, maxRetries: 0 });

    each('chat.completions.parse with a zod response_format: a parsed object, finish_reason stop', async (url) => {
      const r = await client(url).chat.completions.parse({ model: 'pdserve', temperature: 0, max_tokens: MAX, messages: [{ role: 'user', content: ASK }], response_format: (respFormat as typeof zodResponseFormat)(Contact, 'contact') });
      const c = r.choices[0]!;
      assert.equal(c.finish_reason, 'stop', `the JSON ends the reply: ${JSON.stringify(c.message.content)}`);
      assert.deepEqual(Contact.parse(c.message.parsed), c.message.parsed);
    });

    each('runTools: a forced zod tool runs with parsed arguments, then a final answer', async (url) => {
      const api = client(url);
      const w = weatherLog();
      const weather = (fnTool as typeof zodFunction)({ name: 'get_weather', description: 'Current weather of a city', parameters: z.object({ city: z.enum(CITIES) }), function: w.run });
      const finishes: (string | null)[] = [];
      // a named tool_choice: runTools calls that function once and returns
      const first = api.chat.completions.runTools({ model: 'pdserve', temperature: 0, max_tokens: MAX, messages: [{ role: 'user', content: WEATHER_ASK }], tools: [weather], tool_choice: { type: 'function', function: { name: 'get_weather' } } });
      first.on('chatCompletion', (cc) => finishes.push(cc.choices[0]!.finish_reason));
      await first.done();
      assertRan(w.calls, 'runTools');
      assert.equal(w.calls.length, 1, 'a named tool_choice is one call');
      assert.deepEqual(finishes, ['tool_calls'], 'the call ends the turn');
      assert.equal(JSON.parse((await first.finalFunctionToolCallResult())!).celsius, 3);
      // the same history, the model free not to call: the final answer
      const second = api.chat.completions.runTools({ model: 'pdserve', temperature: 0, max_tokens: MAX, messages: first.messages as OpenAI.ChatCompletionMessageParam[], tools: [weather], tool_choice: 'none', ...FINAL } as never, { maxChatCompletions: 2 });
      assertAnswer(await second.finalContent(), 'runTools');
      assert.equal(w.calls.length, 1);
    });
  });
}

describe('Vercel AI SDK', () => {
  const providers = (url: string) => {
    const p = createOpenAI({ baseURL: `${url}/v1`, apiKey: apiKey() });
    return [
      ['chat', p.chat('pdserve')],
      ['responses', p('pdserve')],
    ] as const;
  };

  each('generateObject with a zod schema and a draft-07 #/definitions/ schema (chat and Responses)', async (url) => {
    for (const [api, model] of providers(url)) {
      const r = await generateObject({ model, schema: Contact, prompt: ASK, temperature: 0, maxOutputTokens: MAX, maxRetries: 0 });
      assert.equal(r.finishReason, 'stop', `${api}: the object ends the reply`);
      assert.deepEqual(Contact.parse(r.object), r.object);
      const t = await generateObject({ model, schema: jsonSchema<z.infer<typeof Trip>>(TRIP_SCHEMA as never), prompt: 'Plan a trip.', temperature: 0, maxOutputTokens: MAX, maxRetries: 0 });
      assert.equal(t.finishReason, 'stop', `${api}: the object ends the reply`);
      assert.deepEqual(Trip.parse(t.object), t.object);
    }
  });

  each('streamObject: partial objects, then the whole object (chat and Responses)', async (url) => {
    for (const [api, model] of providers(url)) {
      const st = streamObject({ model, schema: Contact, prompt: ASK, temperature: 0, maxOutputTokens: MAX, maxRetries: 0 });
      let partials = 0;
      for await (const _ of st.partialObjectStream) partials++;
      const obj = await st.object;
      assert.ok(partials > 1, `${api}: streamed in parts`);
      assert.deepEqual(Contact.parse(obj), obj);
      assert.equal(await st.finishReason, 'stop', `${api}: the object ends the reply`);
    }
  });

  each('generateText with a tool and stopWhen: the tool runs, then a final answer (chat and Responses)', async (url) => {
    for (const [api, model] of providers(url)) {
      const w = weatherLog();
      // chat: the default parallel calls, and the answer ends at its first sentence; the Responses
      // API has no stop field, so its answer runs to max_output_tokens: one call keeps that short
      const chat = api === 'chat';
      const r = await generateText({
        model,
        prompt: WEATHER_ASK,
        temperature: 0,
        maxOutputTokens: chat ? MAX : 300,
        ...(chat ? { stopSequences: FINAL.stop } : { providerOptions: { openai: { parallelToolCalls: false } } }),
        maxRetries: 0,
        tools: { get_weather: aiTool({ description: 'Current weather of a city', inputSchema: z.object({ city: z.enum(CITIES) }), execute: async (a) => w.run(a) }) },
        prepareStep: ({ stepNumber }) => ({ toolChoice: stepNumber === 0 ? 'required' : 'none' }),
        stopWhen: stepCountIs(3),
      });
      assertRan(w.calls, `${api} generateText`);
      assert.equal(w.calls.length, r.steps[0]!.toolCalls.length, `${api}: each call ran once`);
      assert.equal(r.steps[0]!.finishReason, 'tool-calls', `${api}: the call ends the first step`);
      assert.equal(r.steps.length, 2, `${api}: a tool step, then the answer`);
      assertAnswer(r.text, `${api} generateText`);
    }
  });
});

describe('LangChain', () => {
  const chat = (url: string, extra: Record<string, unknown> = {}) => new ChatOpenAI({ model: 'pdserve', apiKey: apiKey(), configuration: { baseURL: `${url}/v1` }, temperature: 0, maxTokens: MAX, maxRetries: 0, timeout: TIMEOUT, modelKwargs: { ...STOP, ...extra } });

  each('withStructuredOutput, every method: a parsed object and a reply that ended', async (url) => {
    for (const method of ['jsonSchema', 'functionCalling'] as const) {
      const r = await chat(url).withStructuredOutput(Contact, { method, name: 'contact', includeRaw: true }).invoke(ASK);
      assert.deepEqual(Contact.parse(r.parsed), r.parsed, method);
      assert.equal((r.raw as AIMessage).response_metadata.finish_reason, method === 'jsonSchema' ? 'stop' : 'tool_calls', `${method}: the reply ended`);
    }
    // a draft-07 schema with #/definitions/ references
    const t = await chat(url).withStructuredOutput(TRIP_SCHEMA as never, { method: 'jsonSchema', name: 'trip', includeRaw: true }).invoke('Plan a trip.');
    assert.deepEqual(Trip.parse(t.parsed), t.parsed);
    // jsonMode (json_object): the keys are the prompt's job, and the story model writes one
    // key/value pair after another until max_tokens; so: a JSON object, whole when it ended
    const j = await chat(url).withStructuredOutput({ type: 'object', properties: {}, title: 'any' } as never, { method: 'jsonMode', includeRaw: true }).invoke(`${ASK} Reply in JSON.`);
    const raw = j.raw as AIMessage;
    assert.match(String(raw.content), /^\s*\{/, 'jsonMode: a JSON object');
    if (raw.response_metadata.finish_reason === 'stop') assert.ok(j.parsed !== null && typeof j.parsed === 'object' && !Array.isArray(j.parsed), JSON.stringify(j.parsed));
    else assert.equal(raw.response_metadata.finish_reason, 'length');
  });

  const weatherTool = (w: ReturnType<typeof weatherLog>) => lcTool(async (a: { city: (typeof CITIES)[number] }) => w.run(a), { name: 'get_weather', description: 'Current weather of a city', schema: z.object({ city: z.enum(CITIES) }) });

  each('a bindTools loop: the tool call, the ToolMessage back (named after its tool), a final answer', async (url) => {
    const w = weatherLog();
    const get = weatherTool(w);
    const messages: BaseMessage[] = [new HumanMessage(WEATHER_ASK)];
    const ai = await chat(url).bindTools([get], { tool_choice: 'required' }).invoke(messages);
    assert.equal(ai.response_metadata.finish_reason, 'tool_calls');
    assert.ok((ai.tool_calls?.length ?? 0) >= 1);
    messages.push(ai);
    for (const call of ai.tool_calls!) messages.push((await get.invoke(call)) as ToolMessage);
    assertRan(w.calls, 'bindTools');
    assert.ok(messages.at(-1) instanceof ToolMessage);
    assert.equal(w.calls.length, ai.tool_calls!.length);
    const final = await chat(url, { stop: FINAL.stop }).bindTools([get], { tool_choice: 'none' }).invoke(messages);
    assert.equal(final.tool_calls?.length ?? 0, 0);
    assertAnswer(final.content, 'bindTools');
  });

  each('createAgent: the agent calls the tool, then answers', async (url) => {
    const w = weatherLog();
    // the first model call must call a tool, the ones after a tool result may not: a loop that ends
    const forceFirst = createMiddleware({
      name: 'ForceFirstToolCall',
      wrapModelCall: (request, handler) => handler({ ...request, toolChoice: request.messages.some((m) => ToolMessage.isInstance(m)) ? 'none' : 'required' }),
    });
    const agent = createAgent({ model: chat(url, { stop: FINAL.stop }), tools: [weatherTool(w)], middleware: [forceFirst] });
    const out = await agent.invoke({ messages: [{ role: 'user', content: WEATHER_ASK }] }, { recursionLimit: 8 });
    assertRan(w.calls, 'createAgent');
    assert.equal(out.messages.filter((m) => ToolMessage.isInstance(m)).length, w.calls.length, 'one ToolMessage per call');
    const last = out.messages.at(-1)!;
    assert.ok(AIMessage.isInstance(last), last.constructor.name);
    assert.equal(last.tool_calls?.length ?? 0, 0);
    assertAnswer(last.content, 'createAgent');
  });
});

describe('OpenAI Agents SDK', () => {
  agents.setTracingDisabled(true);
  const client = (url: string) => new OpenAI({ baseURL: `${url}/v1`, apiKey: apiKey(), timeout: TIMEOUT, maxRetries: 0 });
  const MODELS = {
    responses: (url: string) => new agents.OpenAIResponsesModel(client(url) as never, 'pdserve'),
    chat: (url: string) => new agents.OpenAIChatCompletionsModel(client(url) as never, 'pdserve'),
  };
  // The SDK's strict schema keeps types and enums but drops zod checks (.int(), .positive(),
  // .email(), .max()): a schema of what it sends, so its own parse of the reply can succeed.
  const Card = agents.z.object({ name: agents.z.string(), age: agents.z.number(), role: agents.z.enum(['admin', 'user']), tags: agents.z.array(agents.z.enum(['friend', 'work'])) });
  const Report = agents.z.object({ city: agents.z.enum(CITIES), celsius: agents.z.number() });
  const weather = (w: ReturnType<typeof weatherLog>) => agents.tool({ name: 'get_weather', description: 'Current weather of a city', parameters: agents.z.object({ city: agents.z.enum(CITIES) }), execute: async (a) => w.run(a) });

  for (const api of ['responses', 'chat'] as const) {
    each(`${api} model: an agent with an outputType, finalOutput is the parsed object`, async (url) => {
      const agent = new agents.Agent({ name: 'carder', instructions: 'You write contact cards.', model: MODELS[api](url), outputType: Card, modelSettings: { temperature: 0, maxTokens: MAX } });
      const r = await agents.run(agent, ASK, { maxTurns: 2 });
      assert.deepEqual(Card.parse(r.finalOutput), r.finalOutput);
    });

    // The first turn sends the tool (toolChoice required) and the output format together: the
    // calls alone. The SDK then resets toolChoice to auto, where the model may call again or reply
    // in the format; stories260K at temperature 0 calls again, so the tool is off once it ran
    // (isEnabled) and the next turn is the format's reply.
    each(`${api} model: an agent with a tool and an outputType, the tool runs, finalOutput is the parsed object`, async (url) => {
      const w = weatherLog();
      const once = agents.tool({ name: 'get_weather', description: 'Current weather of a city', parameters: agents.z.object({ city: agents.z.enum(CITIES) }), execute: async (a) => w.run(a), isEnabled: () => w.calls.length === 0 });
      const agent = new agents.Agent({ name: 'reporter', instructions: 'Report the weather.', model: MODELS[api](url), tools: [once], outputType: Report, modelSettings: { temperature: 0, maxTokens: MAX, toolChoice: 'required' } });
      const r = await agents.run(agent, WEATHER_ASK, { maxTurns: 4 });
      assertRan(w.calls, 'agent');
      assert.deepEqual(Report.parse(r.finalOutput), r.finalOutput);
    });
  }

  // a text answer needs an ending: chat completions, where stop_token_ids goes in through providerData
  each('chat model: an agent with a tool, the tool runs, then a final answer', async (url) => {
    const w = weatherLog();
    const agent = new agents.Agent({ name: 'weather', instructions: 'Answer weather questions.', model: MODELS.chat(url), tools: [weather(w)], modelSettings: { temperature: 0, maxTokens: MAX, toolChoice: 'required', providerData: FINAL } });
    const r = await agents.run(agent, WEATHER_ASK, { maxTurns: 4 });
    assertRan(w.calls, 'agent');
    assertAnswer(r.finalOutput, 'agent');
  });
});

describe('LlamaIndex', () => {
  const llm = (url: string) => new LlamaOpenAI({ model: 'pdserve', apiKey: apiKey(), baseURL: `${url}/v1`, temperature: 0, maxTokens: MAX, maxRetries: 0, timeout: TIMEOUT, additionalChatOptions: STOP as never });

  each('exec with a tool: the call runs, then a final answer with the tool result in the history', async (url) => {
    const w = weatherLog();
    const get = llamaTool({ name: 'get_weather', description: 'Current weather of a city', parameters: z.object({ city: z.enum(CITIES) }), execute: (a: { city: string }) => w.run(a) });
    const m = llm(url);
    const messages = [{ role: 'user' as const, content: WEATHER_ASK }];
    const r = await m.exec({ messages, tools: [get], additionalChatOptions: { tool_choice: 'required' } as never });
    assertRan(w.calls, 'exec');
    assert.equal(r.toolCalls.length, w.calls.length);
    assert.equal(r.newMessages.length, 1 + w.calls.length, 'the assistant call and a tool result per call');
    const final = await m.chat({ messages: [...messages, ...r.newMessages], tools: [get], additionalChatOptions: { tool_choice: 'none', ...FINAL } as never });
    assertAnswer(final.message.content, 'LlamaIndex');
  });

  each('exec with a zod responseFormat: the parsed object', async (url) => {
    // one object: one call of the structured-output tool (exec parses every call it gets)
    const r = await llm(url).exec({ messages: [{ role: 'user', content: ASK }], responseFormat: Contact as never, additionalChatOptions: { tool_choice: 'required', parallel_tool_calls: false } as never });
    assert.ok(r.object, 'an object');
    assert.deepEqual(Contact.parse(r.object), r.object as Contact);
  });
});
