/**
 * The Responses adapter without I/O: the request → chat mapping (instructions, stored history,
 * input items, tools, errors renamed to Responses fields), the field table (null = not set,
 * unknown names refused), the chat-chunk → event translator, and the stored responses' bounds.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { ApiError } from '../../src/api/errors.js';
import { RESPONSES_FIELDS } from '../../src/api/responses-fields.js';
import { parseResponsesRequest, ResponsesTranslator, storedRecordOf, type ResponseEcho } from '../../src/api/responses.js';
import { ResponseStore } from '../../src/api/responses-store.js';
import { pageInputItems } from '../../src/api/responses-items.js';

const store = () => new ResponseStore();
const err = (fn: () => unknown): ApiError => {
  try {
    fn();
  } catch (e) {
    assert.ok(e instanceof ApiError, String(e));
    return e;
  }
  assert.fail('no error');
};

/** A translator fed `chunks` (chat stream chunks), with every event it emitted. */
function translate(chunks: unknown[], echo?: Partial<ResponseEcho>) {
  const p = parseResponsesRequest({ input: 'hi', ...echo }, store());
  const t = new ResponsesTranslator('resp_1', 'm', 1, p.echo);
  const events = [...t.start()];
  for (const c of chunks) events.push(...t.chunk(c as never));
  events.push(...t.finish());
  return { t, events, types: events.map((e) => e.type), parsed: p };
}

describe('Responses request → chat request', () => {
  test('a string input with instructions: a system and a user message; settings mapped', () => {
    const p = parseResponsesRequest({ model: 'm', input: 'hello', instructions: 'be brief', max_output_tokens: 7, temperature: 0, text: { format: { type: 'json_object' } } }, store());
    assert.deepEqual(p.chat.messages, [{ role: 'system', content: 'be brief' }, { role: 'user', content: 'hello' }]);
    assert.equal(p.chat.max_completion_tokens, 7);
    assert.deepEqual(p.chat.response_format, { type: 'json_object' });
    assert.equal(p.chat.stream, true);
    assert.deepEqual(p.history, [{ role: 'user', content: 'hello' }], 'instructions are not history');
    assert.equal(p.store, true, 'store defaults to true');
  });

  test('cache_salt: passed to the chat request as chat takes it (same bounds), absent when not given', () => {
    const p = parseResponsesRequest({ input: 'hello', cache_salt: 'team-7' }, store());
    assert.equal(p.chat.cache_salt, 'team-7');
    assert.ok(!('cache_salt' in parseResponsesRequest({ input: 'hello' }, store()).chat));
    for (const bad of ['', 'x'.repeat(257), 7]) {
      const e = err(() => parseResponsesRequest({ input: 'hello', cache_salt: bad }, store()));
      assert.equal(e.status, 400, JSON.stringify(bad));
      assert.equal(e.param, 'cache_salt');
    }
  });

  test('items: text parts joined, developer as system, consecutive calls one assistant turn, outputs as tool messages', () => {
    const p = parseResponsesRequest(
      {
        input: [
          { role: 'developer', content: 'rules' },
          { type: 'message', role: 'user', content: [{ type: 'input_text', text: 'a' }, { type: 'input_text', text: 'b' }] },
          { type: 'function_call', call_id: 'c1', name: 'f', arguments: '{}' },
          { type: 'function_call', call_id: 'c2', name: 'g', arguments: '{"x":1}' },
          { type: 'function_call_output', call_id: 'c1', output: 'one' },
          { type: 'function_call_output', call_id: 'c2', output: [{ type: 'input_text', text: 'two' }] },
        ],
        tools: [{ type: 'function', name: 'f' }, { type: 'function', name: 'g', parameters: { type: 'object', properties: { x: { type: 'number' } } } }],
        tool_choice: { type: 'function', name: 'f' },
      },
      store(),
    );
    assert.deepEqual(p.chat.messages, [
      { role: 'system', content: 'rules' },
      { role: 'user', content: 'a\nb' },
      { role: 'assistant', content: null, tool_calls: [{ id: 'c1', type: 'function', function: { name: 'f', arguments: '{}' } }, { id: 'c2', type: 'function', function: { name: 'g', arguments: '{"x":1}' } }] },
      { role: 'tool', tool_call_id: 'c1', content: 'one' },
      { role: 'tool', tool_call_id: 'c2', content: 'two' },
    ]);
    assert.deepEqual(p.chat.tool_choice, { type: 'function', function: { name: 'f' } });
    assert.deepEqual((p.chat.tools as unknown[])[0], { type: 'function', function: { name: 'f' } });
  });

  test('previous_response_id: the stored history first, never changed in place; item_reference resolves stored items', () => {
    const s = store();
    const first = parseResponsesRequest({ input: 'q1' }, s);
    const t = new ResponsesTranslator('resp_a', 'm', 1, first.echo);
    t.start();
    t.chunk({ choices: [{ delta: { content: 'a1' } }] });
    t.chunk({ choices: [{ delta: { tool_calls: [{ index: 0, id: 'call_1', function: { name: 'f', arguments: '{}' } }] }, finish_reason: 'tool_calls' }] });
    t.finish();
    s.put(storedRecordOf(first, t.response(), t.output));
    const stored = structuredClone(s.get('resp_a')!.history);
    assert.deepEqual(stored, [{ role: 'user', content: 'q1' }, { role: 'assistant', content: 'a1', tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'f', arguments: '{}' } }] }]);
    const next = parseResponsesRequest({ previous_response_id: 'resp_a', instructions: 'sys', input: [{ type: 'function_call_output', call_id: 'call_1', output: 'r' }], tools: [{ type: 'function', name: 'f' }] }, s);
    assert.deepEqual(next.chat.messages, [{ role: 'system', content: 'sys' }, ...stored, { role: 'tool', tool_call_id: 'call_1', content: 'r' }]);
    // a function_call item right after the stored reply starts its own turn: the stored message is not changed
    parseResponsesRequest({ previous_response_id: 'resp_a', input: [{ type: 'function_call_output', call_id: 'call_1', output: 'r' }, { role: 'user', content: 'u' }, { type: 'function_call', call_id: 'c9', name: 'f', arguments: '{}' }, { type: 'function_call_output', call_id: 'c9', output: 'x' }], tools: [{ type: 'function', name: 'f' }] }, s);
    assert.deepEqual(s.get('resp_a')!.history, stored);
    const msgId = t.output[0]!.id;
    const ref = parseResponsesRequest({ input: [{ role: 'user', content: 'q1' }, { type: 'item_reference', id: msgId }, { role: 'user', content: 'q2' }] }, s);
    assert.deepEqual(ref.chat.messages, [{ role: 'user', content: 'q1' }, { role: 'assistant', content: 'a1' }, { role: 'user', content: 'q2' }]);
    assert.deepEqual(((e) => [e.status, e.code, e.param])(err(() => parseResponsesRequest({ previous_response_id: 'resp_x', input: 'q' }, s))), [400, 'previous_response_not_found', 'previous_response_id'], "OpenAI's answer to an unknown previous_response_id");
    assert.equal(err(() => parseResponsesRequest({ input: [{ type: 'item_reference', id: 'msg_x' }] }, s)).status, 404);
    assert.ok(s.delete('resp_a'));
    assert.equal(err(() => parseResponsesRequest({ input: [{ type: 'item_reference', id: msgId }] }, s)).status, 404, 'a deleted response takes its items');
  });

  test('input items: the chain of earlier inputs and outputs then this input, with stable ids; pages by limit / order / after', () => {
    const s = store();
    const first = parseResponsesRequest({ instructions: 'not an item', input: 'q1' }, s);
    const t = new ResponsesTranslator('resp_a', 'm', 1, first.echo);
    t.start();
    t.chunk({ choices: [{ delta: { content: 'a1' } }], usage: null });
    t.chunk({ choices: [{ delta: {}, finish_reason: 'stop' }] });
    t.finish();
    s.put(storedRecordOf(first, t.response(), t.output));
    const a = s.get('resp_a')!.input;
    assert.equal(a.length, 1);
    assert.deepEqual({ ...a[0], id: 'x' }, { id: 'x', type: 'message', role: 'user', status: 'completed', content: [{ type: 'input_text', text: 'q1' }] });
    const next = parseResponsesRequest({ previous_response_id: 'resp_a', tools: [{ type: 'function', name: 'f' }], input: [{ role: 'user', content: 'q2', id: 'msg_mine' }, { type: 'function_call', call_id: 'c1', name: 'f', arguments: '{}' }, { type: 'function_call_output', call_id: 'c1', output: 'r' }] }, s);
    assert.deepEqual(next.inputItems.map((i) => i.id).slice(0, 3), [a[0]!.id, t.output[0]!.id, 'msg_mine'], 'earlier items keep their ids');
    assert.deepEqual(next.inputItems.map((i) => i.type), ['message', 'message', 'message', 'function_call', 'function_call_output']);
    assert.match(String(next.inputItems[3]!.id), /^fc_/);
    assert.match(String(next.inputItems[4]!.id), /^fco_/);
    const items = next.inputItems;
    const desc = pageInputItems(items, { limit: '3' });
    assert.deepEqual([desc.data.map((i) => i.id), desc.first_id, desc.last_id, desc.has_more], [[items[4]!.id, items[3]!.id, items[2]!.id], items[4]!.id, items[2]!.id, true]);
    const rest = pageInputItems(items, { limit: '3', after: desc.last_id! });
    assert.deepEqual([rest.data.map((i) => i.id), rest.has_more], [[items[1]!.id, items[0]!.id], false]);
    assert.deepEqual(pageInputItems(items, { order: 'asc' }).data, items);
    assert.deepEqual(pageInputItems([], {}), { object: 'list', data: [], first_id: null, last_id: null, has_more: false });
    for (const q of [{ limit: '0' }, { limit: '101' }, { limit: 'x' }, { order: 'up' }, { after: 'msg_nope' }]) assert.equal(err(() => pageInputItems(items, q)).status, 400, JSON.stringify(q));
  });

  test("the chat parser's errors name the Responses field", () => {
    const e1 = err(() => parseResponsesRequest({ input: [{ role: 'user', content: 'x' }, { type: 'function_call', call_id: 'c', name: 'f', arguments: '{}' }], tools: [{ type: 'function', name: 'f' }] }, store()));
    assert.equal(e1.param, 'input[1]');
    const e2 = err(() => parseResponsesRequest({ input: 'x', tools: [{ type: 'function', name: 'f', parameters: { type: 'string' } }] }, store()));
    assert.match(String(e2.param), /^tools\[0\]\.parameters/);
    assert.equal(err(() => parseResponsesRequest({ input: 'x', max_output_tokens: 0 }, store())).param, 'max_output_tokens');
    assert.equal(err(() => parseResponsesRequest({ input: 'x', tools: [{ type: 'file_search' }] }, store())).param, 'tools[0].type');
    assert.equal(err(() => parseResponsesRequest({ input: [{ role: 'user', content: [{ type: 'input_file', file_id: 'f' }] }] }, store())).param, 'input[0].content[0].type');
    assert.equal(err(() => parseResponsesRequest({ input: [{ role: 'user', content: 'x', name: 'n' }] }, store())).param, 'input[0].name');
    assert.equal(err(() => parseResponsesRequest({ input: [] }, store())).param, 'input');
    assert.equal(err(() => parseResponsesRequest({}, store())).code, 'missing_required_parameter');
  });

  test('every field of the table: null means not set; any other name is refused', () => {
    for (const f of RESPONSES_FIELDS) {
      if (f.name === 'input') continue;
      assert.doesNotThrow(() => parseResponsesRequest({ input: 'x', [f.name]: null }, store()), f.name);
    }
    const e = err(() => parseResponsesRequest({ input: 'x', messages: [] }, store()));
    assert.deepEqual([e.param, e.code], ['messages', 'unrecognized_argument']);
  });
});

describe('chat chunks → Responses events', () => {
  test('text: created, in_progress, item and part added, deltas, the done events, completed with usage', () => {
    const { t, types, events } = translate([
      { choices: [{ delta: { role: 'assistant', content: '' } }] },
      { choices: [{ delta: { content: 'Hel' } }] },
      { choices: [{ delta: { content: 'lo' }, finish_reason: 'stop' }] },
      { choices: [], usage: { prompt_tokens: 5, completion_tokens: 2, prompt_tokens_details: { cached_tokens: 3 } } },
    ]);
    assert.deepEqual(types, [
      'response.created',
      'response.in_progress',
      'response.output_item.added',
      'response.content_part.added',
      'response.output_text.delta',
      'response.output_text.delta',
      'response.output_text.done',
      'response.content_part.done',
      'response.output_item.done',
      'response.completed',
    ]);
    assert.deepEqual(events.map((e) => e.sequence_number), events.map((_, i) => i));
    const r = t.response();
    assert.equal(r.status, 'completed');
    assert.deepEqual(r.usage, { input_tokens: 5, input_tokens_details: { cached_tokens: 3 }, output_tokens: 2, output_tokens_details: { reasoning_tokens: 0 }, total_tokens: 7 });
    assert.equal((r.output as { content: { text: string }[] }[])[0]!.content[0]!.text, 'Hello');
    assert.equal((events[2]!.item as { status: string }).status, 'in_progress');
  });

  test('text then two calls: one item each in order, arguments deltas, finish length → incomplete', () => {
    const { t, types } = translate([
      { choices: [{ delta: { content: 'x' } }] },
      { choices: [{ delta: { tool_calls: [{ index: 0, id: 'call_a', type: 'function', function: { name: 'f', arguments: '' } }] } }] },
      { choices: [{ delta: { tool_calls: [{ index: 0, function: { arguments: '{"a":' } }] } }] },
      { choices: [{ delta: { tool_calls: [{ index: 0, function: { arguments: '1}' } }, { index: 1, id: 'call_b', function: { name: 'g', arguments: '{}' } }] }, finish_reason: 'length' }] },
    ]);
    assert.deepEqual(types.slice(2), [
      'response.output_item.added',
      'response.content_part.added',
      'response.output_text.delta',
      'response.output_text.done',
      'response.content_part.done',
      'response.output_item.done',
      'response.output_item.added',
      'response.function_call_arguments.delta',
      'response.function_call_arguments.delta',
      'response.function_call_arguments.done',
      'response.output_item.done',
      'response.output_item.added',
      'response.function_call_arguments.delta',
      'response.function_call_arguments.done',
      'response.output_item.done',
      'response.incomplete',
    ]);
    const r = t.response();
    assert.deepEqual([r.status, r.incomplete_details], ['incomplete', { reason: 'max_output_tokens' }]);
    const out = r.output as { type: string; call_id?: string; arguments?: string; status: string }[];
    assert.deepEqual(out.map((o) => [o.type, o.call_id ?? null, o.arguments ?? null, o.status]), [
      ['message', null, null, 'completed'],
      ['function_call', 'call_a', '{"a":1}', 'completed'],
      ['function_call', 'call_b', '{}', 'incomplete'],
    ]);
  });

  test('a delta for a call never started is a bad event; fail() is response.failed with the error', () => {
    const p = parseResponsesRequest({ input: 'hi' }, store());
    const t = new ResponsesTranslator('resp_1', 'm', 1, p.echo);
    assert.throws(() => t.chunk({ choices: [{ delta: { tool_calls: [{ index: 3, function: { arguments: 'x' } }] } }] }), (e: ApiError) => e.code === 'bad_worker_event');
    const [ev] = t.fail('decode_failed', 'boom');
    assert.equal(ev!.type, 'response.failed');
    assert.deepEqual((ev!.response as { error: unknown }).error, { code: 'decode_failed', message: 'boom' });
  });
});

describe('stored responses: bounded by count, bytes and age', () => {
  const rec = (id: string, bytes = 10) => ({ id, response: { id }, history: [], items: new Map([[`msg_${id}`, { type: 'message' }]]), input: [], bytes });

  test('count and bytes: the oldest go first; a record over the byte budget alone is not stored', () => {
    const s = new ResponseStore({ maxCount: 2, maxBytes: 100, maxAgeMs: 1e9 });
    s.put(rec('a'));
    s.put(rec('b'));
    s.put(rec('c'));
    assert.deepEqual([s.get('a'), s.size, s.item('msg_a')], [undefined, 2, undefined]);
    s.put(rec('d', 91));
    assert.deepEqual([s.get('b'), s.get('c'), !!s.get('d'), s.bytes], [undefined, undefined, true, 91]);
    assert.equal(s.put(rec('e', 101)), false);
    assert.equal(s.evicted, 3);
  });

  test('age: a record older than maxAgeMs is gone (monotonic clock)', () => {
    let now = 0;
    const s = new ResponseStore({ maxCount: 10, maxBytes: 1000, maxAgeMs: 100 }, () => now);
    s.put(rec('a'));
    now = 50;
    s.put(rec('b'));
    now = 120;
    assert.deepEqual([s.get('a'), !!s.get('b'), s.size, s.bytes], [undefined, true, 1, 10]);
    now = 151;
    assert.equal(s.size, 0);
  });
});
