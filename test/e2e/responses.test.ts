/**
 * The Responses API end to end (one stack: router → prefill → KV → decode, and the colocated
 * reference; deterministic engines, tiny generated model), through the real `openai` SDK
 * (`client.responses.create`, `stream: true`, `previous_response_id`, function tools, retrieve,
 * delete) and the Vercel AI SDK's default OpenAI provider (`generateText({ model: openai(id) })`
 * calls /v1/responses). Greedy output through /v1/responses equals /v1/chat/completions for the
 * same conversation, on PD and colocated; a continuation by previous_response_id is the stored
 * conversation exactly (its output equals the chat path's for the explicit history, and the
 * prefix cache serves the earlier rounds: cached_tokens > 0). Session affinity: one
 * prompt_cache_key stays on one decode worker whatever its text. KV events and exact routing:
 * the workers publish the token blocks they keep, the router follows and matches prompts on them;
 * agents that share a long system prompt and the same task text (each its own prompt_cache_key,
 * or none) continue on decode alone without needs_prefill bounces; a restarted worker's claims
 * vanish, a lost event is a gap the snapshot repairs, a restarted router rebuilds its state from
 * the workers' snapshots.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import OpenAI from 'openai';
import { createOpenAI } from '@ai-sdk/openai';
import { generateText, jsonSchema, streamText, tool } from 'ai';
import { apiKey, getJson, useStack, waitFor } from '../helpers/stack.js';

// Two decode workers with the cache-aware decode policy: session affinity has a choice to make.
// PDSERVE_TEST_HOLDS=on: no holds, only the test routes (a lost KV event: worker/kv-events-route.ts).
const s = useStack({ ctxSize: 4096, decode: 2, env: { PDSERVE_TEST_HOLDS: 'on' }, extraArgs: { router: ['--decode-policy', 'cache_aware'] } });
const base = { model: 'pdserve', temperature: 0, max_output_tokens: 24 } as const;

/** The chat path's greedy reply for `messages` (the reference of every Responses result). */
async function chatText(api: OpenAI, messages: OpenAI.ChatCompletionMessageParam[], max = 24): Promise<string> {
  const r = await api.chat.completions.create({ model: 'pdserve', temperature: 0, max_completion_tokens: max, messages });
  return r.choices[0]!.message.content ?? '';
}

describe('/v1/responses through the openai SDK (PD and colocated)', () => {
  test('non-stream: a string input with instructions equals the chat path; usage and the Response shape', async () => {
    for (const [api, name] of [[s.pd, 'PD'], [s.ref, 'colocated']] as const) {
      const r = await api.responses.create({ ...base, instructions: 'Answer briefly.', input: 'Name a colour.' });
      assert.match(r.id, /^resp_[0-9a-f]+$/);
      assert.equal(r.object, 'response');
      assert.ok(r.status === 'completed' || r.status === 'incomplete', name);
      assert.equal(r.output.length, 1);
      const msg = r.output[0] as OpenAI.Responses.ResponseOutputMessage;
      assert.equal(msg.type, 'message');
      assert.equal(msg.role, 'assistant');
      assert.match(msg.id, /^msg_/);
      const want = await chatText(api, [{ role: 'system', content: 'Answer briefly.' }, { role: 'user', content: 'Name a colour.' }]);
      assert.equal(r.output_text, want, `${name}: Responses output equals chat output`);
      assert.ok(r.usage!.input_tokens > 0 && r.usage!.output_tokens > 0);
      assert.equal(r.usage!.total_tokens, r.usage!.input_tokens + r.usage!.output_tokens);
      assert.equal(r.instructions, 'Answer briefly.');
      assert.equal(r.max_output_tokens, 24);
      const chat = await api.chat.completions.create({ model: 'pdserve', max_completion_tokens: 1, messages: [{ role: 'user', content: 'x' }] });
      assert.equal(r.model, chat.model, `${name}: the Response's model is the chat path's (the first served name)`);
      if (r.usage!.output_tokens === 24) assert.deepEqual([r.status, r.incomplete_details], ['incomplete', { reason: 'max_output_tokens' }]);
    }
  });

  test('stream: the event sequence, deltas that add up to the non-stream text, then GET and DELETE', async () => {
    const input = [{ role: 'user' as const, content: [{ type: 'input_text' as const, text: 'Say something.' }] }];
    const plain = await s.pd.responses.create({ ...base, input });
    const stream = await s.pd.responses.create({ ...base, input, stream: true });
    const types: string[] = [];
    const seqs: number[] = [];
    let text = '';
    let done: OpenAI.Responses.Response | null = null;
    for await (const ev of stream) {
      types.push(ev.type);
      seqs.push(ev.sequence_number);
      if (ev.type === 'response.output_text.delta') text += ev.delta;
      if (ev.type === 'response.completed' || ev.type === 'response.incomplete') done = ev.response;
    }
    assert.deepEqual(seqs, seqs.map((_, i) => i), 'sequence numbers count from 0');
    const end = types.at(-1);
    assert.ok(end === 'response.completed' || end === 'response.incomplete');
    assert.deepEqual(types.slice(0, 4), ['response.created', 'response.in_progress', 'response.output_item.added', 'response.content_part.added']);
    assert.deepEqual(types.slice(-4), ['response.output_text.done', 'response.content_part.done', 'response.output_item.done', end]);
    assert.equal(text, plain.output_text, 'stream deltas = non-stream text');
    assert.ok(done);
    const got = await s.pd.responses.retrieve(done.id);
    assert.equal(got.id, done.id);
    assert.equal(got.output_text, text);
    // an item_reference input item is the stored item itself
    const msgId = (done.output[0] as OpenAI.Responses.ResponseOutputMessage).id;
    const ref = await s.pd.responses.create({ ...base, input: [...input, { type: 'item_reference', id: msgId }, { role: 'user', content: 'More.' }] });
    assert.equal(ref.output_text, await chatText(s.pd, [{ role: 'user', content: 'Say something.' }, { role: 'assistant', content: text }, { role: 'user', content: 'More.' }]));
    const del = (await s.pd.responses.delete(done.id)) as unknown;
    assert.deepEqual(del, { id: done.id, object: 'response', deleted: true });
    await assert.rejects(s.pd.responses.retrieve(done.id), (e: unknown) => e instanceof OpenAI.NotFoundError);
    await assert.rejects(s.pd.responses.delete(done.id), (e: unknown) => e instanceof OpenAI.NotFoundError);
    await assert.rejects(s.pd.responses.create({ ...base, input: [{ type: 'item_reference', id: msgId }] }), (e: unknown) => e instanceof OpenAI.NotFoundError, 'a deleted response takes its items with it');
  });

  test('previous_response_id continues the stored conversation exactly, and the prefix cache serves it', async () => {
    const history: OpenAI.ChatCompletionMessageParam[] = [{ role: 'system', content: 'You are terse.' }];
    let prev: string | undefined;
    let cached = 0;
    for (let round = 1; round <= 3; round++) {
      const user = `round ${round}: ${'tell me more '.repeat(3)}`;
      history.push({ role: 'user', content: user });
      const r = await s.pd.responses.create({ ...base, instructions: 'You are terse.', input: user, ...(prev ? { previous_response_id: prev } : {}) });
      assert.equal(r.previous_response_id, prev ?? null);
      const want = await chatText(s.ref, history);
      assert.equal(r.output_text, want, `round ${round}: equals the chat path on the explicit history`);
      history.push({ role: 'assistant', content: r.output_text });
      if (round > 1) cached += r.usage!.input_tokens_details.cached_tokens;
      prev = r.id;
    }
    assert.ok(cached > 0, 'rounds 2 and 3 reuse the stored prefix');
    // input_items: the 3 user inputs and the 2 earlier replies (instructions are no item), newest first, paged by the SDK's cursor
    const items: OpenAI.Responses.ResponseItem[] = [];
    for await (const it of s.pd.responses.inputItems.list(prev!, { limit: 2 })) items.push(it);
    const texts = items.map((it) => (it.type === 'message' ? `${it.role}: ${(it.content[0] as { text: string }).text}` : it.type));
    assert.deepEqual(texts, history.slice(1, -1).reverse().map((m) => `${m.role}: ${m.content as string}`));
    assert.equal(new Set(items.map((it) => it.id)).size, 5, 'every item has its own id');
    const asc = await s.pd.responses.inputItems.list(prev!, { order: 'asc', limit: 100 });
    assert.deepEqual(asc.data.map((it) => it.id), items.map((it) => it.id).reverse());
    await assert.rejects(s.pd.responses.inputItems.list('resp_unknown'), (e: unknown) => e instanceof OpenAI.NotFoundError);
    await assert.rejects(s.pd.responses.inputItems.list(prev!, { limit: 101 }), (e: unknown) => e instanceof OpenAI.BadRequestError && e.param === 'limit');
    await assert.rejects(s.pd.responses.create({ ...base, input: 'x', previous_response_id: 'resp_unknown' }), (e: unknown) => e instanceof OpenAI.BadRequestError && e.code === 'previous_response_not_found' && e.param === 'previous_response_id');
    // store: false keeps nothing to continue from
    const unstored = await s.pd.responses.create({ ...base, input: 'x', store: false });
    await assert.rejects(s.pd.responses.retrieve(unstored.id), (e: unknown) => e instanceof OpenAI.NotFoundError);
    const m = await (await fetch(`${s.c.router.url}/metrics`, { signal: AbortSignal.timeout(2000) })).text();
    assert.ok(Number(/^pdserve_responses_stored\{unit="responses"\} (\d+)$/m.exec(m)?.[1]) >= 3, 'the stored responses are on /metrics');
  });

  test('function tools: a forced call, its output sent back by previous_response_id, the same as chat tool calls', async () => {
    const tools: OpenAI.Responses.FunctionTool[] = [{ type: 'function', name: 'get_weather', description: 'Weather of a city', parameters: { type: 'object', properties: { city: { type: 'string', enum: ['oslo', 'paris'] } }, required: ['city'] }, strict: true }];
    const r = await s.pd.responses.create({ ...base, max_output_tokens: 300, input: 'Weather in Oslo?', tools, tool_choice: 'required' });
    const call = r.output.find((o) => o.type === 'function_call') as OpenAI.Responses.ResponseFunctionToolCall;
    assert.ok(call, `a function_call item: ${JSON.stringify(r.output)}`);
    assert.equal(call.name, 'get_weather');
    assert.equal(typeof (JSON.parse(call.arguments) as { city: unknown }).city, 'string');
    assert.match(call.call_id, /^call_/);
    // the chat path makes the same call for the same request
    const chatTools = [{ type: 'function' as const, function: { name: 'get_weather', description: 'Weather of a city', parameters: tools[0]!.parameters!, strict: true } }];
    const chat = await s.pd.chat.completions.create({ model: 'pdserve', temperature: 0, max_completion_tokens: 300, messages: [{ role: 'user', content: 'Weather in Oslo?' }], tools: chatTools, tool_choice: 'required' });
    const cc = chat.choices[0]!.message.tool_calls![0] as OpenAI.ChatCompletionMessageFunctionToolCall;
    assert.equal(call.arguments, cc.function.arguments);
    // the stream names the call's arguments piece by piece
    const stream = await s.pd.responses.create({ ...base, max_output_tokens: 300, input: 'Weather in Oslo?', tools, tool_choice: 'required', stream: true });
    let args = '';
    let doneArgs: string | null = null;
    for await (const ev of stream) {
      if (ev.type === 'response.function_call_arguments.delta') args += ev.delta;
      if (ev.type === 'response.function_call_arguments.done') doneArgs = ev.arguments;
    }
    assert.equal(args, call.arguments);
    assert.equal(doneArgs, call.arguments);
    // round two: the call's output, by previous_response_id
    const r2 = await s.pd.responses.create({ ...base, previous_response_id: r.id, input: [{ type: 'function_call_output', call_id: call.call_id, output: '{"temp": 3}' }], tools, tool_choice: 'none' });
    const c2 = await s.ref.chat.completions.create({
      model: 'pdserve',
      temperature: 0,
      max_completion_tokens: 24,
      tools: chatTools,
      tool_choice: 'none',
      messages: [
        { role: 'user', content: 'Weather in Oslo?' },
        { role: 'assistant', content: null, tool_calls: [{ id: call.call_id, type: 'function', function: { name: call.name, arguments: call.arguments } }] },
        { role: 'tool', tool_call_id: call.call_id, content: '{"temp": 3}' },
      ],
    });
    assert.equal(r2.output_text, c2.choices[0]!.message.content, 'round two equals the chat path on the explicit history');
    // an unanswered call is a 400 naming the input
    await assert.rejects(
      s.pd.responses.create({ ...base, input: [{ role: 'user', content: 'hi' }, { type: 'function_call', call_id: 'call_x', name: 'get_weather', arguments: '{}' }], tools }),
      (e: unknown) => e instanceof OpenAI.BadRequestError && /^input\[1\]/.test(String(e.param)),
    );
  });

  test('refusals: unknown fields, unsupported items and tools are 400s naming the field', async () => {
    const bad = async (body: Record<string, unknown>, param: string) =>
      assert.rejects(s.pd.responses.create({ model: 'pdserve', input: 'x', ...body } as never), (e: unknown) => e instanceof OpenAI.BadRequestError && e.param === param, param);
    await bad({ frobnicate: 1 }, 'frobnicate');
    await bad({ tools: [{ type: 'web_search' }] }, 'tools[0].type');
    await bad({ input: [{ role: 'user', content: [{ type: 'input_image', image_url: 'http://x' }] }] }, 'input[0].content[0].type');
    await bad({ input: [{ type: 'reasoning', summary: [] }] }, 'input[0].type');
    await bad({ truncation: 'auto' }, 'truncation');
    await bad({ max_output_tokens: 0 }, 'max_output_tokens');
    await bad({ background: true }, 'background');
    // refusals of the chat path name the Responses field the value came from
    await bad({ input: 'word '.repeat(5000) }, 'input');
    await bad({ max_output_tokens: 5000 }, 'max_output_tokens');
  });
});

describe('/v1/responses through the Vercel AI SDK default provider', () => {
  test('generateText and streamText with openai(model) call /v1/responses; a tool round trip with the SDK loop', async () => {
    const openai = createOpenAI({ baseURL: `${s.c.router.url}/v1`, apiKey: apiKey() });
    const messages = [{ role: 'user' as const, content: 'Name a colour.' }];
    const g = await generateText({ model: openai('pdserve'), messages, temperature: 0, maxOutputTokens: 24 });
    assert.equal(g.text, await chatText(s.pd, messages));
    assert.match(String(g.response.id), /^resp_/);
    const st = streamText({ model: openai('pdserve'), messages, temperature: 0, maxOutputTokens: 24 });
    assert.equal(await st.text, g.text);
    // a forced tool call, executed by the SDK, then its result sent back (store: true → item references)
    let called = 0;
    const t = await generateText({
      model: openai('pdserve'),
      messages: [{ role: 'user', content: 'Weather in Oslo?' }],
      temperature: 0,
      maxOutputTokens: 300,
      toolChoice: 'required',
      tools: {
        get_weather: tool({
          description: 'Weather of a city',
          inputSchema: jsonSchema<{ city: string }>({ type: 'object', properties: { city: { type: 'string', enum: ['oslo', 'paris'] } }, required: ['city'], additionalProperties: false }),
          execute: async ({ city }) => {
            called++;
            return { city, temp: 3 };
          },
        }),
      },
      prepareStep: ({ stepNumber }) => (stepNumber > 0 ? { toolChoice: 'none' } : {}),
      stopWhen: ({ steps }) => steps.length >= 2,
    });
    assert.equal(called, 1, JSON.stringify(t.steps.map((x) => x.content)));
    assert.equal(t.steps.length, 2);
    assert.equal(t.steps[0]!.toolCalls[0]!.toolName, 'get_weather');
    assert.equal(t.steps[1]!.finishReason === 'stop' || t.steps[1]!.finishReason === 'length', true);
  });
});

describe('session affinity', () => {
  test('one prompt_cache_key stays on one decode worker across unrelated prompts', async () => {
    const decodeOf = async (key: string, text: string): Promise<string> => {
      const { response } = await s.pd.chat.completions.create({ model: 'pdserve', temperature: 0, max_completion_tokens: 4, prompt_cache_key: key, messages: [{ role: 'user', content: text }] }).withResponse();
      const t = await getJson<{ decode: string | null }>(`${s.c.router.url}/debug/traces/${response.headers.get('x-request-id')}`);
      assert.ok(t.decode);
      return t.decode;
    };
    // without a key the second, unrelated prompt would go to the decode worker with the smaller tree (the other one)
    const first = await decodeOf('agent-a', 'first task: list three fruits');
    for (const text of ['unrelated: count to five', 'another topic entirely, the weather', 'zzz']) assert.equal(await decodeOf('agent-a', text), first, text);
  });
});

describe('KV events and exact routing', () => {
  const metric = async (name: string): Promise<number> => {
    const text = await (await fetch(`${s.c.router.url}/metrics`, { signal: AbortSignal.timeout(2000) })).text();
    const m = new RegExp(`^${name.replace(/[{}"]/g, (c) => `\\${c}`)} (\\S+)$`, 'm').exec(text);
    return m ? Number(m[1]) : 0;
  };
  type Entry = { tier: string; key: string; blocks?: number[] };
  const snapshot = async (url: string): Promise<Entry[]> => (await getJson<{ snapshot: Entry[] }>(`${url}/kv_events`)).snapshot ?? [];
  const sequences = async (url: string) => (await snapshot(url)).filter((e) => e.tier === 'sequence');
  const decodes = () => s.c.byRole('decode').map((p) => p.url);
  const followedUrls = () => [...s.c.byRole('prefill'), ...s.c.byRole('decode')].map((p) => p.url);
  /** Distinct blocks `urls` say they hold, summed over workers: the router's pdserve_router_kv_blocks once it has caught up. */
  const blocksOf = async (urls: string[]) => (await Promise.all(urls.map(async (u) => new Set((await snapshot(u)).flatMap((e) => e.blocks ?? [])).size))).reduce((a, b) => a + b, 0);
  const caughtUp = () => waitFor(async () => (await metric('pdserve_router_kv_blocks')) === (await blocksOf(followedUrls())), 5000);
  const FALLBACK = 'pdserve_router_requests_by_path_total{path="fallback"}';
  const LOCAL = 'pdserve_router_requests_by_path_total{path="decode_local"}';
  const SYSTEM = `You are a coding agent in a large repository. Read the task, call tools, read their results, and answer briefly. ${'Follow the style guide, keep changes small, and run the tests. '.repeat(8)}`;
  const TASK = `Task: the build is failing on the main branch after the last merge; find the cause and fix it. ${'Look at the logs first. '.repeat(4)}`;
  /** One agent round through the router: its text, usage and serving path. */
  const turn = async (messages: OpenAI.ChatCompletionMessageParam[], key: string | undefined) => {
    const { data, response } = await s.pd.chat.completions.create({ model: 'pdserve', temperature: 0, max_completion_tokens: 8, messages, ...(key ? { prompt_cache_key: key } : {}) }).withResponse();
    return { text: data.choices[0]!.message.content ?? '', prompt: data.usage!.prompt_tokens, cached: data.usage!.prompt_tokens_details?.cached_tokens ?? 0, path: response.headers.get('x-pdserve-path') };
  };
  const agents = new Map<string, OpenAI.ChatCompletionMessageParam[]>();

  for (const keyed of [true, false]) {
    test(`6 agents sharing a long system prompt and the same task text (${keyed ? 'each its own prompt_cache_key' : 'no session key'}): continuations on decode alone, no needs_prefill bounces, most of each prompt cached`, async () => {
      const AGENTS = 6;
      const ROUNDS = 4;
      const before = { fallback: await metric(FALLBACK), local: await metric(LOCAL) };
      const convs = Array.from({ length: AGENTS }, (_, i) => {
        const m: OpenAI.ChatCompletionMessageParam[] = [{ role: 'system', content: SYSTEM }, { role: 'user', content: TASK }];
        agents.set(`${keyed ? 'k' : 'n'}${i}`, m);
        return m;
      });
      let requests = 0;
      let localTurns = 0;
      let localAll = 0;
      let cached = 0;
      let prompt = 0;
      for (let r = 1; r <= ROUNDS; r++) {
        const out = await Promise.all(convs.map((m, i) => turn(m, keyed ? `agent-${i}` : undefined)));
        requests += out.length;
        out.forEach((o, i) => {
          if (o.path === 'decode_local') localAll++;
          if (r > 1) {
            cached += o.cached;
            prompt += o.prompt;
            if (o.path === 'decode_local') localTurns++;
          }
          // the agents diverge from round 2: each its own tool result
          convs[i]!.push({ role: 'assistant', content: o.text }, { role: 'user', content: `tool result ${r} for agent ${i}: exit code ${r + i}` });
        });
      }
      const bounces = (await metric(FALLBACK)) - before.fallback;
      const continuations = AGENTS * (ROUNDS - 1);
      // the figures, for the log of a run
      console.log(`exact routing, ${keyed ? 'keyed' : 'unkeyed'} agents: ${requests} requests, ${localTurns}/${continuations} continuations decode-local, ${bounces} needs_prefill bounces, cached share of rounds 2+ ${(cached / prompt).toFixed(3)}`);
      assert.ok(bounces <= 0.005 * requests, `needs_prefill bounces ${bounces} of ${requests} requests`);
      assert.ok(localTurns >= continuations / 2, `continuations decode-local: ${localTurns} of ${continuations}`);
      // round 1 too may go decode-local: the same opening as agents before (the keyed run's) is held
      assert.equal((await metric(LOCAL)) - before.local, localAll);
      assert.ok(cached / prompt >= 0.6, `cached share of rounds 2+: ${(cached / prompt).toFixed(3)}`);
    });
  }

  test('the workers publish token blocks, the router holds exactly their blocks; a restarted decode worker: its claims vanish, its agents go PD without a bounce', async () => {
    const keyed = [...agents].filter(([k]) => k.startsWith('k'));
    assert.ok(keyed.length > 0, 'the agents ran');
    for (const u of decodes()) for (const e of await sequences(u)) assert.ok(e.key.startsWith('b') && (e.blocks?.length ?? 0) > 0, 'an entry names its blocks');
    assert.ok(await caughtUp(), 'the router holds the workers\' blocks');
    const fallbacks = await metric(FALLBACK);
    let decode = decodes()[0]!;
    for (const u of decodes()) if ((await sequences(u)).length > 0) decode = u;
    const proc = s.c.byRole('decode').find((p) => p.url === decode)!;
    const restarts = await metric('pdserve_router_kv_resyncs_total{reason="restart"}');
    await s.c.restart(proc);
    assert.ok(await waitFor(async () => (await getJson<{ status: string }>(`${decode}/health`).catch(() => ({ status: 'down' }))).status === 'ok', 20_000));
    assert.ok(await waitFor(async () => (await metric('pdserve_router_kv_resyncs_total{reason="restart"}')) > restarts, 5000), 'the router follows the new process (new epoch)');
    assert.ok(await caughtUp(), "the old process's blocks are gone: the router holds what the live workers say");
    // every keyed agent's next round: none bounces on a stale claim
    await Promise.all(keyed.map(async ([k, m]) => {
      const o = await turn(m, `agent-${k.slice(1)}`);
      m.push({ role: 'assistant', content: o.text }, { role: 'user', content: 'tool result after the restart' });
    }));
    assert.equal(await metric(FALLBACK), fallbacks, 'no needs_prefill fallback');
  });

  test('a lost event: the router sees the gap, resyncs from the snapshot, and routes on the repaired state', async () => {
    const [k, m] = [...agents].find(([key]) => key.startsWith('n'))!;
    assert.ok(m);
    const gaps = await metric('pdserve_router_kv_event_gaps_total');
    for (const u of decodes()) await fetch(`${u}/debug/kv-events/drop`, { method: 'POST', signal: AbortSignal.timeout(2000) });
    // rounds make events; the first event each decode publishes next is lost on its way
    for (let r = 0; r < 2; r++) {
      const o = await turn(m, undefined);
      m.push({ role: 'assistant', content: o.text }, { role: 'user', content: `tool result ${r} of ${k} after a lost event` });
    }
    assert.ok(await waitFor(async () => (await metric('pdserve_router_kv_event_gaps_total')) > gaps, 5000), 'the gap is seen');
    assert.ok(await waitFor(async () => (await metric('pdserve_router_kv_resyncs_total{reason="resync"}')) >= 1, 5000), 'then the snapshot');
    assert.ok(await caughtUp(), 'the snapshot repaired the router\'s blocks');
    const fallbacks = await metric(FALLBACK);
    const o = await turn(m, undefined);
    assert.equal(o.path, 'decode_local', 'the next round goes to the decode that holds it, alone');
    assert.equal(await metric(FALLBACK), fallbacks);
  });

  test('prefill publishes the prompts it keeps, and the router picks prefill on their blocks', async () => {
    const prefill = s.c.byRole('prefill')[0]!.url;
    const hit = 'pdserve_router_policy_picks_total{role="prefill",policy="cache_aware",reason="cache_hit"}';
    const messages: OpenAI.ChatCompletionMessageParam[] = [{ role: 'user', content: `prefill events round 1: ${'other context '.repeat(30)}` }];
    const data = await s.pd.chat.completions.create({ model: 'pdserve', temperature: 0, max_completion_tokens: 1, messages });
    // prefill keeps the prompt: an entry of exactly its tokens
    const kept = async () => (await snapshot(prefill)).some((e) => (e as { seq_tokens?: number }).seq_tokens === data.usage!.prompt_tokens);
    assert.ok(await waitFor(kept, 5000), 'prefill publishes the kept prompt');
    assert.ok(await caughtUp(), 'the router holds prefill\'s blocks');
    const before = await metric(hit);
    messages.push({ role: 'assistant', content: data.choices[0]!.message.content ?? '' }, { role: 'user', content: 'round 2' });
    await s.pd.chat.completions.create({ model: 'pdserve', temperature: 0, max_completion_tokens: 1, messages });
    assert.equal(await metric(hit), before + 1, 'the prefill pick came from its blocks');
  });

  test('colocated publishes what it keeps: GET /kv_events and pdserve_kv_events_published_total', async () => {
    const colo = s.c.colocated!.url;
    await s.ref.chat.completions.create({ model: 'pdserve', temperature: 0, max_completion_tokens: 4, messages: [{ role: 'user', content: `colocated events: ${'more context '.repeat(30)}` }] });
    assert.ok(await waitFor(async () => (await sequences(colo)).some((e) => (e.blocks?.length ?? 0) > 0), 5000), 'colocated publishes the kept blocks');
    const text = await (await fetch(`${colo}/metrics`, { signal: AbortSignal.timeout(2000) })).text();
    assert.match(text, /^pdserve_kv_events_published_total\{tier="sequence",kind="stored"\} [1-9]/m);
  });

  test('a restarted router rebuilds its routing state from the workers\' snapshots: the next round goes decode-local at once', async () => {
    const [k, m] = [...agents].find(([key]) => key.startsWith('k'))!;
    const o1 = await turn(m, `agent-${k.slice(1)}`);
    m.push({ role: 'assistant', content: o1.text }, { role: 'user', content: 'tool result before the router restart' });
    assert.ok(await caughtUp());
    const held = await metric('pdserve_router_kv_blocks');
    assert.ok(held > 0);
    await s.c.restart(s.c.router);
    assert.ok(await waitFor(async () => (await metric('pdserve_router_kv_blocks')) === (await blocksOf(followedUrls())), 15_000), 'rebuilt from the snapshots');
    assert.ok(await metric('pdserve_router_kv_resyncs_total{reason="first"}') >= 3, 'one snapshot per worker');
    const o2 = await turn(m, `agent-${k.slice(1)}`);
    assert.equal(o2.path, 'decode_local');
    assert.equal(await metric(FALLBACK), 0, 'a fresh router: no bounce');
  });
});
