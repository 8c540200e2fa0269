/**
 * The tool-call parser (router and colocated side) and the response builder's tool_calls: text
 * in node-llama-cpp's call syntaxes split into content and OpenAI tool_call deltas whatever the
 * chunking, held-back text released when it is not a call, finish_reason 'tool_calls'.
 * Run: node --import tsx --test test/unit/tool-calls.test.ts
 */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ApiError } from '../../src/api/errors.js';
import { parseChatRequest, responseToolSyntax } from '../../src/api/parse.js';
import { OpenAIResponseBuilder, type ChatCompletion, type ChatCompletionChunk } from '../../src/api/respond.js';
import { ToolCallParser, toolSyntaxFromHealth, type ToolCallDelta } from '../../src/api/tool-calls.js';
import { normaliseJsonSchema } from '../../src/api/json-schema.js';
import type { GenerateEvent } from '../../src/protocol/worker-protocol.js';
import type { ToolCallSyntax } from '../../src/engine/types.js';

const GENERIC: ToolCallSyntax = { prefix: '||call: ', prefixAlternates: ['||call:'], paramsPrefix: '(', suffix: ')', emptyParams: '', betweenCalls: null };
const QWEN: ToolCallSyntax = { prefix: '<tool_call>\n{"name": "', prefixAlternates: [], paramsPrefix: '", "arguments": ', suffix: '}\n</tool_call>', emptyParams: '{}', betweenCalls: '\n' };

/** Parse `text` fed in pieces of `size` characters: content, and the calls assembled from the deltas. */
function parse(syntax: ToolCallSyntax, text: string, size: number): { content: string; calls: { id: string; name: string; args: string }[]; deltas: ToolCallDelta[] } {
  const p = new ToolCallParser(syntax);
  let content = '';
  const deltas: ToolCallDelta[] = [];
  for (let i = 0; i < text.length; i += size) {
    const r = p.feed(text.slice(i, i + size));
    content += r.content;
    deltas.push(...r.deltas);
  }
  const e = p.end();
  content += e.content;
  deltas.push(...e.deltas);
  const calls: { id: string; name: string; args: string }[] = [];
  for (const d of deltas) {
    if (d.id) calls[d.index] = { id: d.id, name: d.function.name!, args: '' };
    calls[d.index]!.args += d.function.arguments;
  }
  return { content, calls, deltas };
}

describe('ToolCallParser', () => {
  it('generic syntax: content before the call, name and JSON arguments, at any chunking', () => {
    const text = 'Let me check. ||call: get_weather({"city": "Paris (FR)", "q": "a)b\\"}"})';
    for (const size of [1, 2, 3, 7, 1000]) {
      const r = parse(GENERIC, text, size);
      assert.equal(r.content, 'Let me check. ', `size ${size}`);
      assert.equal(r.calls.length, 1);
      assert.equal(r.calls[0]!.name, 'get_weather');
      assert.deepEqual(JSON.parse(r.calls[0]!.args), { city: 'Paris (FR)', q: 'a)b"}' });
      assert.match(r.calls[0]!.id, /^call_[0-9a-f]{24}$/);
      assert.deepEqual(r.deltas[0], { index: 0, id: r.calls[0]!.id, type: 'function', function: { name: 'get_weather', arguments: '' } });
    }
  });

  it('a call without arguments, the alternate prefix, and two calls', () => {
    assert.deepEqual(parse(GENERIC, '||call: now()', 1).calls.map((c) => [c.name, c.args]), [['now', '{}']]);
    assert.deepEqual(parse(GENERIC, '||call:now({})', 2).calls.map((c) => [c.name, c.args]), [['now', '{}']]);
    const two = parse(GENERIC, '||call: a({"x":1})\n||call: b({"y":[2]})', 3);
    assert.deepEqual(two.calls.map((c) => [c.name, c.args]), [['a', '{"x":1}'], ['b', '{"y":[2]}']]);
    assert.equal(two.content, '', 'whitespace between and after calls is not content');
    assert.equal(parse(GENERIC, 'x ||call: a({})\n then text', 1).content, 'x \n then text', 'text after a call is content');
  });

  it('Qwen syntax (JSON around the call, suffix after the arguments)', () => {
    const r = parse(QWEN, 'ok<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>', 4);
    assert.equal(r.content, 'ok');
    assert.deepEqual(r.calls.map((c) => [c.name, c.args]), [['search', '{"q": "x"}']]);
  });

  it('text that only looks like the start of a call is released as content', () => {
    for (const text of ['a | b || c', 'ends with ||cal', 'x ||call: but never a paren' + ' y'.repeat(200)]) {
      const r = parse(GENERIC, text, 1);
      assert.equal(r.content, text);
      assert.equal(r.calls.length, 0);
    }
    const p = new ToolCallParser(GENERIC);
    assert.equal(p.feed('abc |').content, 'abc ', 'a possible prefix start is held back');
    assert.equal(p.feed('x').content, '|x', 'and released once it cannot be one');
  });

  it('a model without a call syntax: tools are one 400 naming tools and saying why; no tools or tool_choice none parse nothing', () => {
    const req = parseChatRequest({ messages: [{ role: 'user', content: 'x' }], tools: [{ type: 'function', function: { name: 'f' } }] });
    req.toolSyntax = null;
    assert.throws(() => responseToolSyntax(req), (e: unknown) => e instanceof ApiError && e.status === 400 && e.param === 'tools' && /chat wrapper \(node-llama-cpp\) has no function-call syntax/.test(e.message));
    req.toolSyntax = GENERIC;
    assert.deepEqual(responseToolSyntax(req), GENERIC);
    const none = parseChatRequest({ messages: [{ role: 'user', content: 'x' }], tools: [{ type: 'function', function: { name: 'f' } }], tool_choice: 'none' });
    none.toolSyntax = GENERIC;
    assert.equal(responseToolSyntax(none), null);
    assert.equal(responseToolSyntax(parseChatRequest({ messages: [{ role: 'user', content: 'x' }] })), null);
  });

  it('/health syntax: well-formed accepted, anything else null', () => {
    assert.deepEqual(toolSyntaxFromHealth(GENERIC), GENERIC);
    assert.equal(toolSyntaxFromHealth(null), null);
    assert.equal(toolSyntaxFromHealth({ prefix: '' }), null);
    const { betweenCalls: _, ...old } = GENERIC;
    assert.deepEqual(toolSyntaxFromHealth(old), GENERIC, 'betweenCalls absent = null (one call per turn)');
  });
});

describe('OpenAIResponseBuilder with tools', () => {
  const ev = (text: string, finish: 'stop' | 'length' | null = null): GenerateEvent => ({ text, token_ids: [1], meta_info: { id: 'r', prompt_tokens: 5, completion_tokens: 1, finish_reason: finish ? { type: finish } : null } });
  const meta = { id: 'chatcmpl-1', model: 'm', created: 1 };

  it('stream: role chunk, content, tool_call deltas, finish_reason tool_calls; non-stream: message.tool_calls and content null', () => {
    const b = new OpenAIResponseBuilder('chat', meta, false, GENERIC);
    const chunks = [ev('||call'), ev(': f({"a"'), ev(': 1})'), ev('', 'stop')].flatMap((e) => b.push(e)) as ChatCompletionChunk[];
    const deltas = chunks.map((c) => c.choices[0]!.delta);
    assert.deepEqual(deltas[0], { role: 'assistant', content: '' });
    assert.ok(deltas.every((d) => d.content === undefined || d.content === ''), 'no call text leaks into content');
    const calls = deltas.flatMap((d) => d.tool_calls ?? []);
    assert.equal(calls[0]!.function.name, 'f');
    assert.equal(calls.map((c) => c.function.arguments).join(''), '{"a": 1}');
    assert.equal(chunks.at(-1)!.choices[0]!.finish_reason, 'tool_calls');
    const r = b.response() as ChatCompletion;
    assert.equal(r.choices[0]!.finish_reason, 'tool_calls');
    assert.equal(r.choices[0]!.message.content, null);
    assert.deepEqual(r.choices[0]!.message.tool_calls, [{ id: calls[0]!.id, type: 'function', function: { name: 'f', arguments: '{"a": 1}' } }]);
  });

  it('plain text with tools stays content (finish stop); a call cut by max_tokens keeps finish length', () => {
    const b = new OpenAIResponseBuilder('chat', meta, false, GENERIC);
    for (const e of [ev('hello |'), ev('| there', 'stop')]) b.push(e);
    const r = b.response() as ChatCompletion;
    assert.deepEqual([r.choices[0]!.message, r.choices[0]!.finish_reason], [{ role: 'assistant', content: 'hello || there' }, 'stop']);
    const cut = new OpenAIResponseBuilder('chat', meta, false, GENERIC);
    for (const e of [ev('||call: f({"a": '), ev('1', 'length')]) cut.push(e);
    const c = cut.response() as ChatCompletion;
    assert.equal(c.choices[0]!.finish_reason, 'length');
    assert.equal(c.choices[0]!.message.tool_calls![0]!.function.arguments, '{"a": 1');
  });

  it('a call cut by max_tokens before its arguments: no raw call syntax in content, no call (stream and not)', () => {
    for (const pieces of [['||call: get_wea'], ['||cal'], ['Sure. ', '||call: f'], ['<tool_call>\n{"name": "get']]) {
      const syntax = pieces[0]!.startsWith('<') ? QWEN : GENERIC;
      const b = new OpenAIResponseBuilder('chat', meta, false, syntax);
      const chunks = pieces.map((t, i) => ev(t, i === pieces.length - 1 ? 'length' : null)).flatMap((e) => b.push(e)) as ChatCompletionChunk[];
      const streamed = chunks.map((c) => c.choices[0]!.delta.content ?? '').join('');
      const r = b.response() as ChatCompletion;
      const want = pieces[0] === 'Sure. ' ? 'Sure. ' : '';
      assert.equal(r.choices[0]!.message.content, want, JSON.stringify(pieces));
      assert.equal(streamed, want, JSON.stringify(pieces));
      assert.equal(r.choices[0]!.message.tool_calls, undefined);
      assert.equal(r.choices[0]!.finish_reason, 'length');
    }
    // the same text ending by itself (stop) was not a call: it is content (checked below)
    const b = new OpenAIResponseBuilder('chat', meta, false, GENERIC);
    b.push(ev('||cal', 'stop'));
    assert.equal((b.response() as ChatCompletion).choices[0]!.message.content, '||cal');
  });

  it('the check after generation: an output or call arguments breaking a keyword the grammar cannot enforce is a 422 at the finish', () => {
    const output = normaliseJsonSchema({ type: 'object', properties: { a: { type: 'integer', multipleOf: 3 }, s: { type: 'string', pattern: '^x' } } });
    const mismatch = (fn: () => unknown, re: RegExp) => assert.throws(fn, (e: unknown) => e instanceof ApiError && e.status === 422 && e.code === 'output_schema_mismatch' && re.test(e.message));
    const b = () => new OpenAIResponseBuilder('chat', meta, false, null, { output });
    mismatch(() => b().push(ev('{"a": 4, "s": "x"}', 'stop')), /at \$\.a: 4 is not a multiple of 3/);
    mismatch(() => b().push(ev('{"a": 3, "s": "y"}', 'stop')), /at \$\.s: does not match the pattern/);
    const ok = b();
    ok.push(ev('{"a": 6,'));
    ok.push(ev(' "s": "xy"}', 'stop'));
    assert.equal((ok.response() as ChatCompletion).choices[0]!.message.content, '{"a": 6, "s": "xy"}');
    b().push(ev('{"a": 4', 'length')); // cut by max_tokens: returned as it is, not checked
    mismatch(() => b().push(ev('{"a": 3', 'stop')), /not valid JSON/);
    const cut = new OpenAIResponseBuilder('chat', meta, false, null, { output, stopsMayCut: true });
    cut.push(ev('{"a": 3', 'stop')); // a stop string may have cut it: returned as it is
    assert.equal((cut.response() as ChatCompletion).choices[0]!.message.content, '{"a": 3');
    mismatch(() => new OpenAIResponseBuilder('chat', meta, false, null, { output, stopsMayCut: true }).push(ev('{"a": 4}', 'stop')), /multiple of 3/);
    const tools = new Map([['f', normaliseJsonSchema({ type: 'object', properties: { n: { type: 'number', maximum: 1 } } })]]);
    mismatch(() => new OpenAIResponseBuilder('chat', meta, false, GENERIC, { tools }).push(ev('||call: f({"n": 2})', 'stop')), /the call of 'f' breaks the schema at \$\.n/);
    const t = new OpenAIResponseBuilder('chat', meta, false, GENERIC, { tools });
    t.push(ev('||call: f({"n": 0.5})', 'stop'));
    assert.equal(t.finishReason, 'tool_calls');
  });
});
