/** A chat error passed through /v1/responses names the Responses field (src/api/responses-errors.ts). */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { responsesErrorText, responsesParamOf } from '../../src/api/responses-errors.js';

test('chat params become the Responses fields they came from; shared names and null stay', () => {
  const cases: Array<[string | null, string | null]> = [
    ['messages', 'input'],
    ['messages[1].content', 'input'],
    ['prompt', 'input'],
    ['max_tokens', 'max_output_tokens'],
    ['max_completion_tokens', 'max_output_tokens'],
    ['response_format', 'text.format'],
    ['response_format.json_schema.schema', 'text.format'],
    ['tools[2].function.parameters', 'tools[2].parameters'],
    ['tools[0].function', 'tools[0]'],
    ['tools[0].type', 'tools[0].type'],
    ['model', 'model'],
    ['temperature', 'temperature'],
    ['messages_extra', 'messages_extra'],
    [null, null],
  ];
  for (const [chat, want] of cases) assert.equal(responsesParamOf(chat), want, String(chat));
});

test('an error body keeps status text, code and message; only param changes; other text is untouched', () => {
  const body = { error: { message: 'the prompt (25000 bytes, at least 4166 tokens) exceeds the context size (2048 tokens)', type: 'invalid_request_error', param: 'messages', code: 'context_length_exceeded' } };
  assert.deepEqual(JSON.parse(responsesErrorText(JSON.stringify(body))), { error: { ...body.error, param: 'input' } });
  const same = JSON.stringify({ error: { message: 'm', type: 'invalid_request_error', param: 'model', code: 'model_not_found' } });
  assert.equal(responsesErrorText(same), same);
  for (const t of ['not json', '{"error":null}', '{"error":{"param":null}}', '[]', 'null']) assert.equal(responsesErrorText(t), t);
});
