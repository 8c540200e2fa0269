/**
 * JSON-schema size bounds (api/json-schema.ts SchemaLimits): a `$defs` chain whose references
 * carry sibling keywords (expanded in place, doubling per level) and a 20,000-value enum are
 * refused as 400 `schema_too_complex` after bounded work — before any grammar is compiled —
 * through the request parsers (response_format, guided_json, tools, whose schemas share one
 * budget); the framework schemas (zod 3/4, the AI SDK, LangChain) stay well inside the bounds.
 * Run: node --import tsx --test test/unit/schema-bounds.test.ts
 */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { describe, it } from 'node:test';
import { DEFAULT_SCHEMA_LIMITS, normaliseJsonSchema, SchemaTooComplexError, type SchemaUsage } from '../../src/api/json-schema.js';
import { parseChatRequest, parseCompletionRequest } from '../../src/api/parse.js';
import { ApiError } from '../../src/base/errors.js';

const FIXTURES = JSON.parse(readFileSync(new URL('../fixtures/framework-schemas.json', import.meta.url), 'utf8')) as Record<string, Record<string, unknown>>;

/** `levels` definitions, each with `width` properties referring to the next with a sibling `type` (width^levels nodes when expanded); about 2 KB at 12 × 4. */
function hostileChain(levels: number, width = 4): Record<string, unknown> {
  const defs: Record<string, unknown> = {};
  const ref = (i: number) => ({ $ref: `#/$defs/d${i}`, type: 'object' });
  const props = (i: number) => Object.fromEntries(Array.from({ length: width }, (_, k) => [`p${k}`, ref(i)]));
  for (let i = 0; i < levels; i++) defs[`d${i}`] = i === levels - 1 ? { type: 'object', properties: { s: { type: 'string' } } } : { type: 'object', properties: props(i + 1) };
  return { $defs: defs, $ref: '#/$defs/d0' };
}
const bigEnum = (n: number) => ({ type: 'object', properties: { v: { enum: Array.from({ length: n }, (_, i) => `value-${i}`) } }, required: ['v'] });

/** Milliseconds `f` takes and what it threw. */
function timed(f: () => unknown): { ms: number; err: unknown } {
  const t = performance.now();
  try {
    f();
    return { ms: performance.now() - t, err: undefined };
  } catch (err) {
    return { ms: performance.now() - t, err };
  }
}

describe('schema bounds', () => {
  it('an exponential $defs chain (2 KB, 4^12 nodes expanded) is refused after bounded work, naming --schema-max-nodes', () => {
    const s = hostileChain(12);
    assert.ok(JSON.stringify(s).length < 3000, 'a small schema');
    const { ms, err } = timed(() => normaliseJsonSchema(s));
    assert.ok(err instanceof SchemaTooComplexError, `refused: ${String(err)}`);
    assert.equal(err.bound, 'schema-max-nodes');
    assert.match(err.message, /more than 5000 nodes/);
    assert.ok(ms < 2000, `refused in ${ms.toFixed(0)} ms`);
  });

  it('a 20,000-value enum is refused quickly, naming --schema-max-enum-values; the byte bound applies too', () => {
    const { ms, err } = timed(() => normaliseJsonSchema(bigEnum(20_000)));
    assert.ok(err instanceof SchemaTooComplexError, `refused: ${String(err)}`);
    assert.equal(err.bound, 'schema-max-enum-values');
    assert.ok(ms < 1000, `refused in ${ms.toFixed(0)} ms`);
    const long = { enum: Array.from({ length: 100 }, (_, i) => `${i}-${'x'.repeat(1000)}`) };
    assert.throws(() => normaliseJsonSchema(long), (e: unknown) => e instanceof SchemaTooComplexError && e.bound === 'schema-max-enum-bytes');
  });

  it('schemas within the bounds are accepted: every framework fixture, a chain of 10 levels, a 1,000-value enum', () => {
    for (const [name, s] of Object.entries(FIXTURES)) {
      const usage: SchemaUsage = { nodes: 0, enumValues: 0, enumBytes: 0 };
      normaliseJsonSchema(s, DEFAULT_SCHEMA_LIMITS, usage);
      assert.ok(usage.nodes < 100, `${name}: ${usage.nodes} nodes`);
    }
    normaliseJsonSchema(hostileChain(6, 2));
    normaliseJsonSchema(bigEnum(1000));
    // raised limits let the same schema through
    normaliseJsonSchema(bigEnum(2000), { ...DEFAULT_SCHEMA_LIMITS, maxEnumValues: 2000 });
  });

  it('the parsers answer 400 schema_too_complex naming the field; tools share one budget', () => {
    const code = (f: () => unknown): [string, string | undefined, number] => {
      try {
        f();
      } catch (e) {
        assert.ok(e instanceof ApiError, String(e));
        return [e.code, e.param ?? undefined, e.status];
      }
      return ['accepted', undefined, 200];
    };
    const messages = [{ role: 'user', content: 'hi' }];
    const [c, param, status] = code(() => parseChatRequest({ messages, response_format: { type: 'json_schema', json_schema: { name: 'x', schema: hostileChain(12) } } }));
    assert.deepEqual([c, status], ['schema_too_complex', 400]);
    assert.ok(param?.startsWith('response_format.json_schema.schema'), param);
    assert.deepEqual(code(() => parseCompletionRequest({ prompt: 'x', guided_json: bigEnum(20_000) })), ['schema_too_complex', 'guided_json.properties.v.enum', 400]);
    const tool = (name: string, n: number) => ({ type: 'function', function: { name, parameters: bigEnum(n) } });
    assert.deepEqual(code(() => parseChatRequest({ messages, tools: [tool('a', 600)] })), ['accepted', undefined, 200]);
    assert.deepEqual(code(() => parseChatRequest({ messages, tools: [tool('a', 600), tool('b', 600)] })), ['schema_too_complex', 'tools[1].function.parameters.properties.v.enum', 400]);
    assert.deepEqual(code(() => parseChatRequest({ messages, tools: [tool('a', 600), tool('b', 600)] }, { schemaLimits: { ...DEFAULT_SCHEMA_LIMITS, maxEnumValues: 1200 } })), ['accepted', undefined, 200]);
  });
});
