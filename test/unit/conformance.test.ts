import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { describe, test } from 'node:test';
import { GENERATED, withConformanceTable } from '../../src/api/conformance.js';
import { conformanceMarkdown, fieldsOf, REQUEST_FIELDS } from '../../src/api/fields.js';
import { ApiError } from '../../src/api/errors.js';
import { parseChatRequest, parseCompletionRequest } from '../../src/api/parse.js';

describe('OpenAI conformance table', () => {
  test('docs/API.md holds the table generated from the schema (run: node --import tsx src/api/conformance.ts --write)', () => {
    const api = readFileSync(new URL('../../docs/API.md', import.meta.url), 'utf8');
    assert.equal(api, withConformanceTable(api), 'docs/API.md conformance table is stale');
    assert.ok(api.includes(conformanceMarkdown()));
    for (const g of GENERATED) {
      const text = readFileSync(new URL(`../../${g.path}`, import.meta.url), 'utf8');
      assert.equal(text, withConformanceTable(text, g.table()), `${g.path}: generated table is stale`);
    }
  });

  test('every listed field is parsed by its endpoints, every other name is refused', () => {
    const keys = REQUEST_FIELDS.flatMap((f) => f.endpoints.map((e) => `${e}:${f.name}`));
    assert.equal(new Set(keys).size, keys.length, 'a field is listed once per endpoint');
    for (const [endpoint, parse, base] of [
      ['completions', parseCompletionRequest, { prompt: 'x' }],
      ['chat', parseChatRequest, { messages: [{ role: 'user', content: 'x' }] }],
    ] as const) {
      const fields = fieldsOf(endpoint);
      for (const f of REQUEST_FIELDS) {
        if (f.name in base) continue; // the required prompt / messages
        // null = not set: accepted by the endpoints that know the field, refused by the others
        let err: unknown = null;
        try {
          (parse as (b: unknown) => unknown)({ ...base, [f.name]: null });
        } catch (e) {
          err = e;
        }
        if (fields.has(f.name)) assert.equal(err, null, `${endpoint}: ${f.name}: null must mean "not set"`);
        else assert.ok(err instanceof ApiError && err.param === f.name && /Unrecognized request argument/.test(err.message), `${endpoint}: ${f.name} must be unrecognized`);
      }
    }
  });
});
