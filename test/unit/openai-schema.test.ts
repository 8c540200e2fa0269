import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import Fastify, { type FastifyInstance } from 'fastify';
import { gzipSync } from 'node:zlib';
import { GenerateRequestSchema, type GenerateEvent } from '../../src/protocol/worker-protocol.js';
import { ApiError, registerOpenAIErrorHandling, sizeText } from '../../src/api/errors.js';
import { outputChecksOf, parseChatRequest, parseCompletionRequest, toWorkerRequest } from '../../src/api/parse.js';
import { OpenAIResponseBuilder } from '../../src/api/respond.js';

const routing = { rid: 'cmpl-abc', bootstrapHost: '127.0.0.1', bootstrapPort: 8998, bootstrapRoom: '9223372036854775807' };

function rejects400(fn: () => unknown, param: string | null, re?: RegExp): ApiError {
  try {
    fn();
  } catch (e) {
    assert.ok(e instanceof ApiError, `ApiError, got ${String(e)}`);
    assert.equal(e.status, 400);
    assert.equal(e.type, 'invalid_request_error');
    assert.equal(e.param, param);
    if (re) assert.match(e.message, re);
    return e;
  }
  assert.fail('expected a 400');
}

describe('completion schema', () => {
  test('defaults', () => {
    const p = parseCompletionRequest({ model: 'm', prompt: 'hello' });
    assert.deepEqual(p.prompt, { text: 'hello' });
    assert.equal(p.stream, false);
    assert.equal(p.includeUsage, false);
    assert.deepEqual(p.sampling, { temperature: 1, top_p: 1, top_k: 0, min_p: 0, repetition_penalty: 1, presence_penalty: 0, frequency_penalty: 0, min_tokens: 0, max_new_tokens: 16, stop: [], ignore_eos: false });
  });

  test('prompt forms: string, [string], token ids, [[token ids]]', () => {
    assert.deepEqual(parseCompletionRequest({ prompt: ['hi'] }).prompt, { text: 'hi' });
    assert.deepEqual(parseCompletionRequest({ prompt: [1, 2, 3] }).prompt, { input_ids: [1, 2, 3] });
    assert.deepEqual(parseCompletionRequest({ prompt: [[4, 5]] }).prompt, { input_ids: [4, 5] });
    rejects400(() => parseCompletionRequest({ prompt: ['a', 'b'] }), 'prompt', /split into one request per prompt/);
    rejects400(() => parseCompletionRequest({ prompt: [] }), 'prompt');
    rejects400(() => parseCompletionRequest({ prompt: [1.5] }), 'prompt');
    rejects400(() => parseCompletionRequest({ prompt: 42 }), 'prompt');
    rejects400(() => parseCompletionRequest({ model: 'm' }), 'prompt', /Missing required parameter: 'prompt'/);
  });

  test('sampling fields, nulls; unknown fields are refused by name', () => {
    const p = parseCompletionRequest({
      prompt: 'x',
      max_tokens: 5,
      temperature: 0,
      top_p: 0.5,
      top_k: -1,
      seed: 42,
      stop: 'END',
      stream: true,
      stream_options: { include_usage: true },
      n: 1,
      ignore_eos: true,
      user: 'u',
      presence_penalty: 0.5,
      frequency_penalty: -0.5,
      repetition_penalty: 1.2,
      min_p: 0.1,
      min_tokens: 2,
      logit_bias: { '5': -100, '7': 2.5 },
      stop_token_ids: [3],
      logprobs: null,
    });
    assert.deepEqual(p.sampling, {
      temperature: 0,
      top_p: 0.5,
      top_k: 0,
      min_p: 0.1,
      repetition_penalty: 1.2,
      presence_penalty: 0.5,
      frequency_penalty: -0.5,
      min_tokens: 2,
      seed: 42,
      max_new_tokens: 5,
      stop: ['END'],
      ignore_eos: true,
      logit_bias: { '5': -100, '7': 2.5 },
      stop_token_ids: [3],
    });
    const unk = rejects400(() => parseCompletionRequest({ prompt: 'x', some_vllm_extension: { anything: true } }), 'some_vllm_extension', /Unrecognized request argument supplied: some_vllm_extension/);
    assert.equal(unk.code, 'unrecognized_argument');
    assert.equal(p.stream, true);
    assert.equal(p.includeUsage, true);
    const q = parseCompletionRequest({ prompt: 'x', max_tokens: null, temperature: null, stop: ['a', '', 'b'], top_k: 40 });
    assert.equal(q.sampling.max_new_tokens, 16);
    assert.equal(q.sampling.temperature, 1);
    assert.equal(q.sampling.top_k, 40);
    assert.deepEqual(q.sampling.stop, ['a', 'b'], 'empty stop strings dropped');
    assert.equal(parseCompletionRequest({ prompt: 'x', stop: Array(16).fill('s') }).sampling.stop.length, 16);
  });

  test('invalid values name the field', () => {
    // 0 (OpenAI's and vLLM's echo-only request, to score a prompt by its logprobs) says why it is refused
    for (const b of [{ max_tokens: 0 }, { max_tokens: 0, echo: true }]) rejects400(() => parseCompletionRequest({ prompt: 'x', ...b }), 'max_tokens', /Invalid value for 'max_tokens': must be at least 1 \(max_tokens 0, .*prompt logprobs are not computed\)/);
    rejects400(() => parseCompletionRequest({ prompt: 'x', max_tokens: -1 }), 'max_tokens', /Invalid value for 'max_tokens'/);
    rejects400(() => parseCompletionRequest({ prompt: 'x', max_tokens: 1.5 }), 'max_tokens');
    rejects400(() => parseCompletionRequest({ prompt: 'x', max_tokens: 'ten' }), 'max_tokens', /Invalid type for 'max_tokens': expected number, got string/);
    rejects400(() => parseCompletionRequest({ prompt: 'x', temperature: 2.5 }), 'temperature');
    rejects400(() => parseCompletionRequest({ prompt: 'x', temperature: -0.1 }), 'temperature');
    rejects400(() => parseCompletionRequest({ prompt: 'x', top_p: 0 }), 'top_p');
    rejects400(() => parseCompletionRequest({ prompt: 'x', top_k: -2 }), 'top_k');
    rejects400(() => parseCompletionRequest({ prompt: 'x', seed: 'a' }), 'seed');
    rejects400(() => parseCompletionRequest({ prompt: 'x', stream: 'yes' }), 'stream');
    rejects400(() => parseCompletionRequest({ prompt: 'x', stop: Array(17).fill('s') }), 'stop', /at most 16/);
    rejects400(() => parseCompletionRequest({ prompt: 'x', stop: [1] }), 'stop');
    rejects400(() => parseCompletionRequest({ prompt: 'x', ignore_eos: 1 }), 'ignore_eos');
    rejects400(() => parseCompletionRequest({ prompt: 'x', model: 5 }), 'model');
    rejects400(() => parseCompletionRequest(null), null, /expected a JSON object/);
    rejects400(() => parseCompletionRequest([1, 2]), null, /expected a JSON object/);
    rejects400(() => parseCompletionRequest('prompt'), null);
    // vLLM's ranges
    rejects400(() => parseCompletionRequest({ prompt: 'x', min_p: 2 }), 'min_p');
    rejects400(() => parseCompletionRequest({ prompt: 'x', min_p: -0.1 }), 'min_p');
    rejects400(() => parseCompletionRequest({ prompt: 'x', repetition_penalty: -3 }), 'repetition_penalty');
    rejects400(() => parseCompletionRequest({ prompt: 'x', repetition_penalty: 0 }), 'repetition_penalty');
    rejects400(() => parseCompletionRequest({ prompt: 'x', presence_penalty: 2.1 }), 'presence_penalty');
    rejects400(() => parseCompletionRequest({ prompt: 'x', frequency_penalty: -2.1 }), 'frequency_penalty');
    rejects400(() => parseCompletionRequest({ prompt: 'x', min_tokens: -1 }), 'min_tokens');
    rejects400(() => parseCompletionRequest({ prompt: 'x', max_tokens: 4, min_tokens: 5 }), 'min_tokens', /must be <= max_tokens/);
    rejects400(() => parseCompletionRequest({ prompt: 'x', stop_token_ids: [-1] }), 'stop_token_ids[0]');
    rejects400(() => parseCompletionRequest({ prompt: 'x', logit_bias: { '5': 101 } }), 'logit_bias.5');
    rejects400(() => parseCompletionRequest({ prompt: 'x', logit_bias: { abc: 1 } }), 'logit_bias.abc');
    rejects400(() => parseCompletionRequest({ prompt: 'x', n: 0 }), 'n');
  });

  test('unsupported features are 400 with a clear message', () => {
    rejects400(() => parseCompletionRequest({ prompt: 'x', n: 2 }), 'n', /planFanOut/);
    // logprobs: an integer for completions, a boolean (+ top_logprobs) for chat, as OpenAI
    assert.equal(parseCompletionRequest({ prompt: 'x', logprobs: 3 }).sampling.logprobs, 3);
    assert.equal(parseCompletionRequest({ prompt: 'x', logprobs: 0 }).sampling.logprobs, 0);
    rejects400(() => parseCompletionRequest({ prompt: 'x', logprobs: true }), 'logprobs');
    rejects400(() => parseCompletionRequest({ prompt: 'x', logprobs: 21 }), 'logprobs');
    const u = [{ role: 'user', content: 'x' }];
    assert.equal(parseChatRequest({ messages: u, logprobs: true, top_logprobs: 5 }).sampling.logprobs, 5);
    assert.equal(parseChatRequest({ messages: u, logprobs: true }).sampling.logprobs, 0);
    assert.equal(parseChatRequest({ messages: u, logprobs: false }).sampling.logprobs, undefined);
    rejects400(() => parseChatRequest({ messages: u, top_logprobs: 2 }), 'top_logprobs', /requires logprobs/);
    rejects400(() => parseChatRequest({ messages: u, logprobs: 2 }), 'logprobs');
    assert.equal(parseCompletionRequest({ prompt: 'x', echo: true }).sampling.echo, true);
    rejects400(() => parseCompletionRequest({ prompt: 'x', echo: true, logprobs: 1 }), 'echo', /prompt logprobs/);
    rejects400(() => parseChatRequest({ messages: [{ role: 'user', content: 'x' }], echo: true }), 'echo');
    rejects400(() => parseCompletionRequest({ prompt: 'x', best_of: 3 }), 'best_of');
    rejects400(() => parseCompletionRequest({ prompt: 'x', suffix: 'tail' }), 'suffix');
    rejects400(() => parseCompletionRequest({ prompt: 'x', guided_regex: 'a+' }), 'guided_regex');
    rejects400(() => parseCompletionRequest({ prompt: 'x', skip_special_tokens: false }), 'skip_special_tokens');
    rejects400(() => parseCompletionRequest({ prompt: 'x', include_stop_str_in_output: true }), 'include_stop_str_in_output');
    rejects400(() => parseCompletionRequest({ prompt: 'x', stream_options: { include_usage: true } }), 'stream_options', /only allowed when stream is true/);
    // Explicit "off" values are fine.
    parseCompletionRequest({ prompt: 'x', n: 1, echo: false, best_of: 1, suffix: '', logit_bias: {}, frequency_penalty: 0, skip_special_tokens: true });
  });

  test('toWorkerRequest produces a valid worker body', () => {
    const w = toWorkerRequest(parseCompletionRequest({ prompt: 'hello', max_tokens: 3, seed: 7 }), routing);
    assert.deepEqual(w, {
      rid: 'cmpl-abc',
      protocol: '1.2',
      text: 'hello',
      sampling_params: { temperature: 1, top_p: 1, top_k: 0, min_p: 0, repetition_penalty: 1, presence_penalty: 0, frequency_penalty: 0, min_tokens: 0, seed: 7, max_new_tokens: 3, stop: [], ignore_eos: false },
      stream: true,
      first_token_from_prefill: false,
      bootstrap_host: '127.0.0.1',
      bootstrap_port: 8998,
      bootstrap_room: '9223372036854775807',
    });
    assert.ok(GenerateRequestSchema.safeParse(w).success);
    assert.equal(toWorkerRequest(parseCompletionRequest({ prompt: 'hello' }), { ...routing, firstTokenFromPrefill: true }).first_token_from_prefill, true);
    const ids = toWorkerRequest(parseCompletionRequest({ prompt: [1, 2] }), routing);
    assert.deepEqual(ids.input_ids, [1, 2]);
    assert.equal(ids.text, undefined);
    assert.ok(GenerateRequestSchema.safeParse(ids).success);
  });
});

describe('chat schema', () => {
  test('messages: string and text parts flattened, null content; default max_tokens = rest of the context', () => {
    const p = parseChatRequest({
      model: 'm',
      messages: [
        { role: 'system', content: 'be brief' },
        { role: 'user', content: [{ type: 'text', text: 'hello' }, { type: 'text', text: 'world' }] },
        { role: 'assistant', content: null, refusal: null, annotations: [], tool_calls: [] },
        { role: 'assistant', content: '{"a":1}', parsed: { a: 1 } },
      ],
    });
    assert.deepEqual(p.messages, [
      { role: 'system', content: 'be brief' },
      { role: 'user', content: 'hello\nworld' },
      { role: 'assistant', content: '' },
      { role: 'assistant', content: '{"a":1}' },
    ]);
    rejects400(() => parseChatRequest({ messages: [{ role: 'user', content: 'x', parsed: { a: 1 } }] }), 'messages[0].parsed', /only an assistant message/);
    assert.equal(p.sampling.max_new_tokens, undefined, 'absent: the worker uses the rest of the context');
    const w = toWorkerRequest(p, { ...routing, rid: 'chatcmpl-x' });
    assert.ok(GenerateRequestSchema.safeParse(w).success);
    assert.deepEqual(w.messages, p.messages);
  });

  test("an echoed call's function.parsed_arguments is accepted and not rendered", () => {
    const p = parseChatRequest({
      messages: [
        { role: 'user', content: 'x' },
        { role: 'assistant', content: null, tool_calls: [{ id: 'c1', type: 'function', function: { name: 'f', arguments: '{"a":1}', parsed_arguments: { a: 1 } } }] },
        { role: 'tool', tool_call_id: 'c1', content: 'ok' },
      ],
    });
    assert.deepEqual(p.messages[1], { role: 'assistant', content: '', toolCalls: [{ id: 'c1', name: 'f', arguments: '{"a":1}' }] });
  });

  test('max_completion_tokens wins over max_tokens', () => {
    assert.equal(parseChatRequest({ messages: [{ role: 'user', content: 'x' }], max_tokens: 9 }).sampling.max_new_tokens, 9);
    assert.equal(parseChatRequest({ messages: [{ role: 'user', content: 'x' }], max_tokens: 9, max_completion_tokens: 4 }).sampling.max_new_tokens, 4);
    rejects400(() => parseChatRequest({ messages: [{ role: 'user', content: 'x' }], max_completion_tokens: 0 }), 'max_completion_tokens');
  });

  test('invalid messages', () => {
    rejects400(() => parseChatRequest({ model: 'm' }), 'messages', /Missing required parameter: 'messages'/);
    rejects400(() => parseChatRequest({ messages: [] }), 'messages');
    rejects400(() => parseChatRequest({ messages: 'hi' }), 'messages');
    rejects400(() => parseChatRequest({ messages: [{ role: 'wizard', content: 'x' }] }), 'messages[0].role');
    rejects400(() => parseChatRequest({ messages: [{ role: 'user', content: 5 }] }), 'messages[0].content');
    rejects400(
      () => parseChatRequest({ messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'x' } }] }] }),
      'messages[0].content[0].type',
      /unsupported content part type 'image_url'/,
    );
    rejects400(() => parseChatRequest({ messages: [{ role: 'user', content: [{ type: 'text' }] }] }), 'messages[0].content[0].text');
    rejects400(() => parseChatRequest({ messages: [{ role: 'user', content: 'x' }], n: 3 }), 'n');
    const u = [{ role: 'user', content: 'x' }];
    // tools: checked field by field; the legacy functions fields get one refusal asking for tools
    rejects400(() => parseChatRequest({ messages: u, tools: [{ type: 'function' }] }), 'tools[0].function', /Required/);
    rejects400(() => parseChatRequest({ messages: u, tools: [{ type: 'code_interpreter' }] }), 'tools[0].type');
    rejects400(() => parseChatRequest({ messages: u, tools: [{ type: 'function', function: { name: 'bad name' } }] }), 'tools[0].function.name');
    rejects400(() => parseChatRequest({ messages: u, tools: [{ type: 'function', function: { name: 'f' } }, { type: 'function', function: { name: 'f' } }] }), 'tools[1].function.name', /used twice/);
    rejects400(() => parseChatRequest({ messages: u, tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'object', properties: { a: { type: 'string', propertyNames: {} } } } } }] }), 'tools[0].function.parameters.properties.a.propertyNames', /not supported/);
    rejects400(() => parseChatRequest({ messages: u, tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'string' } } }] }), 'tools[0].function.parameters.type');
    const f = rejects400(() => parseChatRequest({ messages: u, functions: [{ name: 'f' }] }), 'functions', /legacy.*send 'tools'/);
    rejects400(() => parseChatRequest({ messages: u, function_call: 'auto' }), 'function_call', /legacy/);
    assert.ok(f.message.length > 0);
    rejects400(() => parseChatRequest({ messages: u, tool_choice: 'required' }), 'tool_choice', /needs tools/);
    rejects400(() => parseChatRequest({ messages: u, tool_choice: { type: 'function', function: { name: 'g' } }, tools: [{ type: 'function', function: { name: 'f' } }] }), 'tool_choice', /not one of the tools/);
    rejects400(() => parseChatRequest({ messages: u, tool_choice: 'sometimes', tools: [{ type: 'function', function: { name: 'f' } }] }), 'tool_choice');
    // tools + a JSON format: "auto" is the calls or a JSON reply (checked after as the format), "required" / named the calls alone, "none" the format alone
    const fn = [{ type: 'function', function: { name: 'f' } }];
    const schema = { type: 'object', properties: { a: { type: 'string', maxLength: 3 } }, required: ['a'], additionalProperties: false };
    const auto = parseChatRequest({ messages: u, tools: fn, response_format: { type: 'json_schema', json_schema: { name: 's', schema } } });
    assert.equal(auto.sampling.grammar?.type, 'tool_call');
    assert.ok(auto.sampling.grammar?.type === 'tool_call' && !auto.sampling.grammar.lazy && auto.sampling.grammar.reply?.type === 'json_schema', JSON.stringify(auto.sampling.grammar));
    assert.deepEqual(outputChecksOf(auto).output, (auto.sampling.grammar as { reply: { schema: unknown } }).reply.schema, 'a reply without calls is checked against the format');
    const obj = parseChatRequest({ messages: u, tools: fn, response_format: { type: 'json_object' } });
    assert.deepEqual(obj.sampling.grammar?.type === 'tool_call' && obj.sampling.grammar.reply, { type: 'json' });
    for (const tool_choice of ['required', { type: 'function', function: { name: 'f' } }]) {
      const g = parseChatRequest({ messages: u, tools: fn, tool_choice, response_format: { type: 'json_object' } }).sampling.grammar;
      assert.ok(g?.type === 'tool_call' && !g.lazy && g.reply === undefined, JSON.stringify(g));
    }
    assert.deepEqual(parseChatRequest({ messages: u, tools: fn, tool_choice: 'none', response_format: { type: 'json_object' } }).sampling.grammar, { type: 'json' });
    assert.ok(!('reply' in parseChatRequest({ messages: u, tools: fn }).sampling.grammar!), 'no format: the lazy call grammar alone');
    rejects400(() => parseChatRequest({ messages: [{ role: 'function', content: '4', name: 'f' }] }), 'messages[0].role', /legacy/);
    rejects400(() => parseChatRequest({ messages: [{ role: 'tool', content: '4' }] }), 'messages[0].tool_call_id');
    rejects400(() => parseChatRequest({ messages: [...u, { role: 'tool', content: '4', tool_call_id: 'c1' }] }), 'messages[1].tool_call_id', /no earlier assistant tool call/);
    const call = { id: 'c1', type: 'function', function: { name: 'f', arguments: '{}' } };
    rejects400(() => parseChatRequest({ messages: [...u, { role: 'assistant', content: null, tool_calls: [call] }] }), 'messages[1].tool_calls[0]', /no tool message answers/);
    rejects400(() => parseChatRequest({ messages: [...u, { role: 'assistant', content: null, tool_calls: [{ ...call, type: 'x' }] }] }), 'messages[1].tool_calls[0].type');
    rejects400(() => parseChatRequest({ messages: [...u, { role: 'user', content: 'x', tool_calls: [call] }] }), 'messages[1].tool_calls');
    // accepted: tools with every tool_choice, and a history with calls and their results
    const tools = [{ type: 'function', function: { name: 'get', description: 'd', parameters: { type: 'object', properties: { q: { type: 'string' } }, required: ['q'] }, strict: true } }, { type: 'function', function: { name: 'now' } }];
    const ok = parseChatRequest({ messages: [...u, { role: 'assistant', content: null, tool_calls: [call] }, { role: 'tool', content: '{"r":1}', tool_call_id: 'c1' }], tools, parallel_tool_calls: false });
    assert.deepEqual(ok.tools?.choice, 'auto');
    assert.deepEqual(ok.sampling.grammar, { type: 'tool_call', functions: [{ name: 'get', parameters: { type: 'object', properties: { q: { type: 'string' } }, required: ['q'] } }, { name: 'now' }], lazy: true });
    assert.deepEqual(ok.messages[1], { role: 'assistant', content: '', toolCalls: [{ id: 'c1', name: 'f', arguments: '{}' }] });
    assert.deepEqual(ok.messages[2], { role: 'tool', content: '{"r":1}', toolCallId: 'c1' });
    assert.equal(parseChatRequest({ messages: u, tools, tool_choice: 'none' }).sampling.grammar, undefined);
    assert.equal((parseChatRequest({ messages: u, tools, tool_choice: 'required' }).sampling.grammar as { parallel?: boolean }).parallel, true, 'parallel_tool_calls defaults to true');
    assert.deepEqual(parseChatRequest({ messages: u, tools, tool_choice: 'required' }).sampling.grammar?.type, 'tool_call');
    assert.deepEqual(parseChatRequest({ messages: u, tools, tool_choice: { type: 'function', function: { name: 'now' } } }).sampling.grammar, { type: 'tool_call', functions: [{ name: 'now' }], lazy: false });
    // name on any role (LangChain: the tool's name on tool messages, "model" on assistant messages): accepted, not rendered
    const named = parseChatRequest({ messages: [{ role: 'user', content: 'x', name: 'bob' }, { role: 'assistant', content: null, name: 'model', tool_calls: [{ id: 'c1', type: 'function', function: { name: 'f', arguments: '{}' } }] }, { role: 'tool', content: '1', tool_call_id: 'c1', name: 'f' }], tools });
    assert.deepEqual(named.messages, [{ role: 'user', content: 'x' }, { role: 'assistant', content: '', toolCalls: [{ id: 'c1', name: 'f', arguments: '{}' }] }, { role: 'tool', content: '1', toolCallId: 'c1' }]);
    rejects400(() => parseChatRequest({ messages: [{ role: 'user', content: 'x', name: 7 }] }), 'messages[0].name');
    rejects400(() => parseChatRequest({ messages: [{ role: 'user', content: 'x', extra: 1 }] }), 'messages[0].extra', /Unrecognized/);
    rejects400(() => parseChatRequest({ messages: u, response_format: { type: 'xml' } }), 'response_format');
    rejects400(() => parseChatRequest({ messages: u, response_format: { type: 'json_object' }, guided_json: {} }), 'guided_json');
    rejects400(() => parseChatRequest({ messages: u, guided_json: '{nope' }), 'guided_json');
    rejects400(() => parseChatRequest({ messages: u, store: true }), 'store');
    parseChatRequest({ messages: u, logprobs: false, tools: [], functions: [], response_format: { type: 'text' }, tool_choice: 'none', store: false, metadata: {}, n: 1 });
  });

  test('JSON mode, JSON schema and guided_json become a worker grammar', () => {
    const u = [{ role: 'user', content: 'x' }];
    assert.deepEqual(parseChatRequest({ messages: u, response_format: { type: 'json_object' } }).sampling.grammar, { type: 'json' });
    const schema = { type: 'object', properties: { a: { type: 'number' } } };
    assert.deepEqual(parseChatRequest({ messages: u, response_format: { type: 'json_schema', json_schema: { name: 's', schema } } }).sampling.grammar, { type: 'json_schema', schema });
    assert.deepEqual(parseCompletionRequest({ prompt: 'x', guided_json: JSON.stringify(schema) }).sampling.grammar, { type: 'json_schema', schema });
    assert.equal(parseChatRequest({ messages: u, response_format: { type: 'text' } }).sampling.grammar, undefined);
    // outside node-llama-cpp's exact subset: a 400 naming the keyword, not a silently looser grammar
    rejects400(() => parseChatRequest({ messages: u, response_format: { type: 'json_schema', json_schema: { name: 's', schema: { not: { type: 'string' } } } } }), 'response_format.json_schema.schema.not', /keyword 'not'/);
    // the zod idioms: .int() (safe-integer bounds), .positive(), .email() (format + pattern), draft-07 definitions
    const zod = { type: 'object', properties: { n: { type: 'integer', minimum: -9007199254740991, maximum: 9007199254740991 }, p: { type: 'number', exclusiveMinimum: 0 }, e: { type: 'string', format: 'email', pattern: '^\\S+@\\S+$' }, d: { $ref: '#/definitions/D' } }, definitions: { D: { type: 'boolean' } } };
    assert.deepEqual(parseChatRequest({ messages: u, response_format: { type: 'json_schema', json_schema: { name: 's', schema: zod } } }).sampling.grammar, { type: 'json_schema', schema: { type: 'object', properties: { ...zod.properties, d: { $ref: '#/$defs/D' } }, $defs: { D: { type: 'boolean' } } } });
    rejects400(() => parseCompletionRequest({ prompt: 'x', guided_json: { type: 'nonsense' } }), 'guided_json.type');
    rejects400(() => parseCompletionRequest({ prompt: 'x', guided_json: { $ref: '#/$defs/missing' } }), 'guided_json.$ref');
    assert.deepEqual(parseCompletionRequest({ prompt: 'x', guided_json: { anyOf: [{ type: 'null' }, { type: 'integer' }], title: 'T' } }).sampling.grammar, { type: 'json_schema', schema: { oneOf: [{ type: 'null' }, { type: 'integer' }] } });
  });
});

describe('OpenAIResponseBuilder', () => {
  const ev = (text: string, n: number, finish: GenerateEvent['meta_info']['finish_reason'] = null): GenerateEvent => ({
    text,
    token_ids: text ? [n] : [],
    meta_info: { id: 'r', prompt_tokens: 7, completion_tokens: n, finish_reason: finish },
  });
  const meta = { id: 'chatcmpl-1', model: 'm', created: 1 };

  test('chat stream: role chunk first, content chunks, finish chunk, usage chunk', () => {
    const b = new OpenAIResponseBuilder('chat', meta, true);
    const c1 = b.push(ev('Hel', 1));
    assert.equal(c1.length, 2);
    assert.deepEqual(c1[0]!.choices[0], { index: 0, delta: { role: 'assistant', content: '' }, logprobs: null, finish_reason: null });
    assert.deepEqual((c1[1] as any).choices[0].delta, { content: 'Hel' });
    assert.equal(c1[1]!.usage, null);
    assert.deepEqual(b.push(ev('', 1)), [], 'empty non-final event → no chunk');
    const last = b.push(ev('', 2, { type: 'length' }));
    assert.deepEqual(last.length, 1);
    assert.deepEqual((last[0] as any).choices[0], { index: 0, delta: {}, logprobs: null, finish_reason: 'length' });
    const tail = b.tail();
    assert.deepEqual(tail, [{ id: 'chatcmpl-1', object: 'chat.completion.chunk', created: 1, model: 'm', choices: [], usage: { prompt_tokens: 7, completion_tokens: 2, total_tokens: 9, prompt_tokens_details: { cached_tokens: 0 } } }]);
    assert.deepEqual(b.response(), {
      id: 'chatcmpl-1',
      object: 'chat.completion',
      created: 1,
      model: 'm',
      choices: [{ index: 0, message: { role: 'assistant', content: 'Hel' }, logprobs: null, finish_reason: 'length' }],
      usage: { prompt_tokens: 7, completion_tokens: 2, total_tokens: 9, prompt_tokens_details: { cached_tokens: 0 } },
    });
  });

  test('completion stream: text chunks, finish with text', () => {
    const b = new OpenAIResponseBuilder('completion', { ...meta, id: 'cmpl-1' });
    assert.deepEqual(b.push(ev('a', 1)).map((c) => (c as any).choices[0].text), ['a']);
    const fin = b.push(ev('b', 2, { type: 'stop' }));
    assert.deepEqual((fin[0] as any).choices[0], { index: 0, text: 'b', logprobs: null, finish_reason: 'stop' });
    assert.equal('usage' in fin[0]!, false);
    assert.deepEqual(b.tail(), []);
    const r = b.response();
    assert.equal(r.object, 'text_completion');
    assert.equal((r as any).choices[0].text, 'ab');
  });

  test('abort finish and malformed events are errors', () => {
    const b = new OpenAIResponseBuilder('completion', meta);
    assert.throws(() => b.push(ev('', 0, { type: 'abort', message: 'deadline' })), (e: unknown) => e instanceof ApiError && e.code === 'generation_aborted' && /deadline/.test(e.message));
    assert.throws(() => new OpenAIResponseBuilder('completion', meta).push({ nope: 1 } as any), (e: unknown) => e instanceof ApiError && e.status === 502);
    const done = new OpenAIResponseBuilder('completion', meta);
    done.push(ev('x', 1, { type: 'stop' }));
    assert.throws(() => done.push(ev('y', 2)), (e: unknown) => e instanceof ApiError && e.code === 'bad_worker_event');
  });
});

describe('HTTP errors through fastify', () => {
  let app: FastifyInstance;
  before(async () => {
    app = Fastify({ bodyLimit: 64 * 1024 });
    registerOpenAIErrorHandling(app);
    app.post('/v1/completions', async (req) => ({ ok: parseCompletionRequest(req.body).prompt }));
    app.post('/v1/chat/completions', async (req) => ({ ok: parseChatRequest(req.body).messages.length }));
    app.get('/boom', async () => {
      throw new Error('secret internals');
    });
    await app.ready();
  });
  after(() => app.close());

  const post = (url: string, payload: string, contentType = 'application/json') => app.inject({ method: 'POST', url, payload, headers: { 'content-type': contentType } });

  function assertOpenAIError(r: { statusCode: number; body: string }, status: number, re?: RegExp): { message: string; type: string; param: string | null; code: string | null } {
    assert.equal(r.statusCode, status, r.body);
    const j = JSON.parse(r.body) as { error: { message: string; type: string; param: string | null; code: string | null } };
    assert.deepEqual(Object.keys(j.error).sort(), ['code', 'message', 'param', 'type']);
    assert.equal(typeof j.error.message, 'string');
    if (re) assert.match(j.error.message, re);
    return j.error;
  }

  test('valid body passes', async () => {
    const r = await post('/v1/completions', JSON.stringify({ model: 'm', prompt: 'hi' }));
    assert.equal(r.statusCode, 200);
    assert.deepEqual(JSON.parse(r.body), { ok: { text: 'hi' } });
  });

  test('invalid JSON → 400 invalid_json', async () => {
    const e = assertOpenAIError(await post('/v1/completions', '{"model": "x", "prompt": '), 400, /could not parse the JSON body/);
    assert.equal(e.type, 'invalid_request_error');
    assert.equal(e.code, 'invalid_json');
  });

  test('empty JSON body → 400', async () => {
    assertOpenAIError(await post('/v1/completions', ''), 400);
  });

  test('wrong content type → 400', async () => {
    const e = assertOpenAIError(await post('/v1/completions', 'a=b', 'application/x-www-form-urlencoded'), 400, /Content-Type/);
    assert.equal(e.code, 'unsupported_media_type');
  });

  test('too-large body → 413 naming the limit', async () => {
    const e = assertOpenAIError(await post('/v1/completions', JSON.stringify({ prompt: 'x'.repeat(100 * 1024) })), 413, /the limit is 64 KiB \(65536 bytes\)/);
    assert.equal(e.code, 'body_too_large');
    assert.equal(sizeText(8 * 1024 * 1024), '8 MiB (8388608 bytes)');
    assert.equal(sizeText(1536 * 1024), '1.5 MiB (1572864 bytes)');
    assert.equal(sizeText(1000), '1000 bytes');
  });

  test('a compressed body → 415 unsupported_content_encoding, its bytes never echoed; binary JSON → 400 without raw bytes', async () => {
    const raw = gzipSync(JSON.stringify({ model: 'm', prompt: 'hi' }));
    const r = await app.inject({ method: 'POST', url: '/v1/completions', payload: raw, headers: { 'content-type': 'application/json', 'content-encoding': 'gzip' } });
    const e = assertOpenAIError(r, 415, /Content-Encoding 'gzip' is not supported/);
    assert.equal(e.code, 'unsupported_content_encoding');
    assert.equal(e.type, 'invalid_request_error');
    const plain = await app.inject({ method: 'POST', url: '/v1/completions', payload: JSON.stringify({ model: 'm', prompt: 'hi' }), headers: { 'content-type': 'application/json', 'content-encoding': 'identity' } });
    assert.equal(plain.statusCode, 200, 'identity is no encoding');
    // the same bytes without the header: a JSON syntax error whose message escapes what it quotes
    const b = await app.inject({ method: 'POST', url: '/v1/completions', payload: raw, headers: { 'content-type': 'application/json' } });
    const e2 = assertOpenAIError(b, 400, /could not parse the JSON body/);
    assert.equal(e2.code, 'invalid_json');
    assert.doesNotMatch(e2.message, /[\u0000-\u001f\u007f-\u009f\ufffd]/, `raw bytes echoed: ${JSON.stringify(e2.message)}`);
  });

  test('zod errors → 400 naming the field', async () => {
    const e1 = assertOpenAIError(await post('/v1/completions', JSON.stringify({ prompt: 'hi', max_tokens: -1 })), 400, /max_tokens/);
    assert.equal(e1.param, 'max_tokens');
    const e2 = assertOpenAIError(await post('/v1/completions', JSON.stringify({ prompt: 'hi', max_tokens: 'ten' })), 400, /max_tokens/);
    assert.equal(e2.code, 'invalid_type');
    const e3 = assertOpenAIError(await post('/v1/chat/completions', JSON.stringify({ model: 'x' })), 400, /messages/);
    assert.equal(e3.param, 'messages');
    assert.equal(e3.code, 'missing_required_parameter');
  });

  test('unknown route → 404 OpenAI body; internal error → 500 without internals', async () => {
    const e = assertOpenAIError(await app.inject({ method: 'GET', url: '/v2/nope' }), 404);
    assert.equal(e.type, 'not_found_error');
    const b = assertOpenAIError(await app.inject({ method: 'GET', url: '/boom' }), 500);
    assert.equal(b.message, 'Internal server error');
  });
});

describe('agent_hints (retention hint)', () => {
  const u = [{ role: 'user', content: 'hi' }];
  test('validated: priority an integer 0-99, retention_seconds 0-3600; other keys (Dynamo osl) ignored', () => {
    rejects400(() => parseChatRequest({ messages: u, agent_hints: { priority: 100 } }), 'agent_hints.priority', /99/);
    rejects400(() => parseChatRequest({ messages: u, agent_hints: { priority: 1.5 } }), 'agent_hints.priority');
    rejects400(() => parseChatRequest({ messages: u, agent_hints: { retention_seconds: -1 } }), 'agent_hints.retention_seconds');
    rejects400(() => parseChatRequest({ messages: u, agent_hints: { retention_seconds: 3601 } }), 'agent_hints.retention_seconds', /3600/);
    rejects400(() => parseCompletionRequest({ prompt: 'x', agent_hints: 'high' }), 'agent_hints');
    assert.deepEqual(parseChatRequest({ messages: u, agent_hints: { priority: 7, retention_seconds: 2.5, osl: 512 } }).agentHints, { priority: 7, retention_seconds: 2.5 });
    assert.equal(parseChatRequest({ messages: u, agent_hints: { osl: 512 } }).agentHints, undefined);
  });

  test('carried to the workers as retention (ttl in ms; session when the key is the client\'s own)', () => {
    const p = parseChatRequest({ messages: u, agent_hints: { priority: 7, retention_seconds: 2.5 } });
    let w = toWorkerRequest(p, routing);
    assert.deepEqual(w.retention, { priority: 7, ttl_ms: 2500 });
    assert.deepEqual(GenerateRequestSchema.parse(w).retention, { priority: 7, ttl_ms: 2500 }, 'the worker schema accepts it');
    w = toWorkerRequest({ ...parseChatRequest({ messages: u }), conversationKey: 'k:abc' }, routing);
    assert.deepEqual(w.retention, { session: true }, 'prompt_cache_key names a session');
    w = toWorkerRequest({ ...parseChatRequest({ messages: u }), conversationKey: 'm:first-message-hash' }, routing);
    assert.equal(w.retention, undefined, 'a key derived from the first message is no session');
    assert.throws(() => GenerateRequestSchema.parse({ ...w, retention: { ttl_ms: 3_600_001 } }), 'the worker bounds the window too');
  });
});
