/**
 * JSON schemas as the frameworks write them (test/fixtures/framework-schemas.json: openai's
 * zodResponseFormat on zod 3 and 4, zod 4's toJSONSchema, the AI SDK's zodSchema, LangChain's
 * toJsonSchema — captured from those packages) through the normaliser (api/json-schema.ts) and
 * the grammar builder (engine/json-grammar.ts) on real llama.cpp grammars: each compiles, its
 * grammar accepts a valid value and refuses what breaks a bound it enforces, the grammar ends
 * at the JSON's end (no trailing newlines), integer ranges are exact, and validateJson finds
 * what the grammar leaves to the check after generation.
 * Run: node --import tsx --test test/unit/json-schema.test.ts
 */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { before, describe, it } from 'node:test';
import { getLlama, type Llama } from 'node-llama-cpp';
import { normaliseJsonSchema, SchemaError, validateJson } from '../../src/api/json-schema.js';
import { integerRangeGbnf, JSON_OBJECT_GBNF, jsonSchemaGbnf } from '../../src/engine/json-grammar.js';

const FIXTURES = JSON.parse(readFileSync(new URL('../fixtures/framework-schemas.json', import.meta.url), 'utf8')) as Record<string, Record<string, unknown>>;
/** A value every fixture schema accepts. */
const GOOD = { name: 'x', age: 3, score: 0.5, email: 'a.b@c.io', tags: ['t'], home: { street: 's', zip: 'z' }, work: null, kind: 'a', note: 'n' };

let llama: Llama;

/** Whether the grammar of `schema` (normalised) accepts exactly `text`. */
async function accepts(schema: unknown, text: string): Promise<boolean> {
  const g = await llama.createGrammar({ grammar: await jsonSchemaGbnf(llama, normaliseJsonSchema(schema)) });
  return (g as unknown as { _testText(t: string): boolean })._testText(text);
}

const refused = (schema: unknown, path: string, re: RegExp) =>
  assert.throws(
    () => normaliseJsonSchema(schema),
    (e: unknown) => e instanceof SchemaError && e.path === path && re.test(e.message),
  );

describe('JSON schemas of the frameworks', () => {
  before(async () => {
    llama = await getLlama({ gpu: false, logLevel: 'error' as never });
  });

  it('every framework schema compiles; its grammar takes a valid value and ends at the JSON (no trailing newline)', async () => {
    assert.ok(Object.keys(FIXTURES).length >= 6);
    for (const [name, schema] of Object.entries(FIXTURES)) {
      const n = normaliseJsonSchema(schema);
      assert.equal(validateJson(n, GOOD), null, name);
      assert.ok(await accepts(schema, JSON.stringify(GOOD)), `${name}: grammar accepts the valid value`);
      assert.ok(!(await accepts(schema, `${JSON.stringify(GOOD)}\n`)), `${name}: nothing after the JSON`);
      // .int().positive(): exclusiveMinimum 0 in the grammar
      assert.ok(!(await accepts(schema, JSON.stringify({ ...GOOD, age: 0 }))), `${name}: age 0 refused by the grammar`);
      assert.ok(!(await accepts(schema, JSON.stringify({ ...GOOD, email: 'nope' }))), `${name}: not an email`);
      // score ≤ 1 is checked after generation
      assert.deepEqual(validateJson(n, { ...GOOD, score: 2 }), { path: '$.score', message: '2 is more than the maximum 1' }, name);
      assert.equal(validateJson(n, { ...GOOD, extra: 1 })?.message, "the property 'extra' is not allowed", name);
    }
  });

  it('LangChain / zod-to-json-schema references (#/properties/…, #/definitions/…) become $defs references', () => {
    const lc = normaliseJsonSchema(FIXTURES.lc_v3);
    assert.deepEqual((lc.properties as Record<string, unknown>).work, { oneOf: [{ $ref: '#/$defs/ref0' }, { type: 'null' }] });
    assert.deepEqual(Object.keys(lc.$defs as object), ['ref0']);
    const oa = normaliseJsonSchema(FIXTURES.openai_v3);
    assert.ok(Object.keys(oa.$defs as object).includes('person_properties_home'));
    assert.equal(JSON.stringify(oa).includes('definitions'), false);
  });

  it('recursive schemas through $defs / definitions / a root reference', async () => {
    const tree = { $ref: '#/definitions/Node', definitions: { Node: { type: 'object', properties: { v: { type: 'integer' }, kids: { type: 'array', items: { $ref: '#/definitions/Node' }, maxItems: 2 } }, required: ['v', 'kids'] } } };
    assert.ok(await accepts(tree, '{"v": 1, "kids": [{"v": 2, "kids": []}]}'));
    assert.equal(validateJson(normaliseJsonSchema(tree), { v: 1, kids: [{ v: 'x', kids: [] }] })?.path, '$.kids[0].v');
    const self = { type: 'object', properties: { next: { anyOf: [{ $ref: '#' }, { type: 'null' }] } } };
    assert.ok(await accepts(self, '{"next": {"next": null}}'));
  });

  it('integers: no exponent, safe range by default, exact ranges, exclusive and draft-4 bounds', async () => {
    const int = (extra: Record<string, unknown> = {}) => ({ type: 'integer', ...extra });
    assert.ok(await accepts(int(), '9007199254740991'));
    assert.ok(!(await accepts(int(), '9007199254740992')), 'past the safe integers');
    assert.ok(!(await accepts(int(), '1e21')), 'no exponent');
    assert.ok(!(await accepts(int(), '-0')));
    for (const [lo, hi] of [[1, 5], [-15, 123], [17, 1234], [0, 0], [-300, -7], [95, 105]] as const) {
      const s = int({ minimum: lo, maximum: hi });
      const g = await llama.createGrammar({ grammar: await jsonSchemaGbnf(llama, normaliseJsonSchema(s)) });
      const ok = (n: number) => (g as unknown as { _testText(t: string): boolean })._testText(String(n));
      for (let n = lo - 30; n <= hi + 30; n++) assert.equal(ok(n), n >= lo && n <= hi, `${n} in ${lo}..${hi}`);
    }
    assert.ok(await accepts(int({ exclusiveMinimum: 0 }), '1'));
    assert.ok(!(await accepts(int({ exclusiveMinimum: 0 }), '0')));
    assert.ok(!(await accepts(int({ minimum: 0, exclusiveMinimum: true }), '0')), 'draft 4 boolean exclusiveMinimum');
    assert.ok(!(await accepts(int({ maximum: 10, exclusiveMaximum: true }), '10')));
    assert.match(integerRangeGbnf(1n, 5n), /\[1-5\]/);
    refused(int({ minimum: 5, maximum: 4 }), '', /no integer lies between/);
  });

  it('numbers: no exponent; a lower bound ≥ 0 drops the sign; multipleOf 0.01 allows two decimals, others are checked after', async () => {
    assert.ok(await accepts({ type: 'number' }, '-1.5'));
    assert.ok(!(await accepts({ type: 'number' }, '1e5')));
    assert.ok(!(await accepts({ type: 'number', minimum: 0 }, '-1')));
    assert.ok(await accepts({ type: 'number', multipleOf: 0.01 }, '3.14'));
    assert.ok(!(await accepts({ type: 'number', multipleOf: 0.01 }, '3.141')));
    assert.ok(!(await accepts({ type: 'number', multipleOf: 1 }, '3.5')));
    const n = normaliseJsonSchema({ type: 'number', multipleOf: 3, maximum: 10 });
    assert.equal(validateJson(n, 9), null);
    assert.match(validateJson(n, 7)!.message, /not a multiple of 3/);
    assert.match(validateJson(n, 12)!.message, /more than the maximum/);
  });

  it('strings: formats by grammar, pattern and lengths with a format checked after', async () => {
    assert.ok(await accepts({ type: 'string', format: 'uuid' }, '"123e4567-e89b-12d3-a456-426614174000"'));
    assert.ok(!(await accepts({ type: 'string', format: 'uuid' }, '"x"')));
    assert.ok(await accepts({ type: 'string', format: 'ipv4' }, '"10.0.255.1"'));
    assert.ok(!(await accepts({ type: 'string', format: 'ipv4' }, '"10.0.256.1"')));
    assert.ok(await accepts({ type: 'string', format: 'date' }, '"2024-02-28"'));
    assert.ok(await accepts({ type: 'string', format: 'hostname' }, '"anything"'), 'an unknown format is an annotation');
    // zod 4's ISO formats (format + a calendar-aware pattern): what the grammar allows, the pattern accepts
    const iso = {
      date: '^(?:(?:\\d\\d[2468][048]|\\d\\d[13579][26]|\\d\\d0[48]|[02468][048]00|[13579][26]00)-02-29|\\d{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\\d|30)|(?:02)-(?:0[1-9]|1\\d|2[0-8])))$',
      time: '^(?:[01]\\d|2[0-3]):[0-5]\\d(?::[0-5]\\d(?:\\.\\d+)?)?$',
    };
    assert.ok(await accepts({ type: 'string', format: 'date', pattern: iso.date }, '"2023-02-28"'));
    assert.ok(!(await accepts({ type: 'string', format: 'date', pattern: iso.date }, '"2023-02-29"')), 'days past 28 are left out');
    assert.ok(await accepts({ type: 'string', format: 'time', pattern: iso.time }, '"23:59:59.123"'));
    assert.ok(!(await accepts({ type: 'string', format: 'time', pattern: iso.time }, '"23:59:59Z"')), 'zod time: no offset');
    assert.ok(await accepts({ type: 'string', format: 'time' }, '"23:59:59Z"'), 'JSON Schema time: with its offset');
    assert.ok(await accepts({ type: 'string', format: 'date-time' }, '"1999-12-28T00:00:00.000Z"'));
    assert.match('1999-12-28', new RegExp(iso.date));
    assert.match('23:59:59.123', new RegExp(iso.time));
    const p = normaliseJsonSchema({ type: 'string', pattern: '^[a-z]+$', maxLength: 3 });
    assert.equal(validateJson(p, 'abc'), null);
    assert.match(validateJson(p, 'aB')!.message, /does not match the pattern/);
    assert.match(validateJson(p, 'abcd')!.message, /longer than maxLength 3/);
    refused({ type: 'string', pattern: '(' }, '.pattern', /not a valid regular expression/);
  });

  it('nullable unions, type lists, allOf, annotations', () => {
    assert.deepEqual(normaliseJsonSchema({ type: ['string', 'null'], maxLength: 4, title: 'T', default: 'x' }), { oneOf: [{ type: 'string', maxLength: 4 }, { type: 'null' }] });
    // description is kept for the prompt (the chat wrapper documents tool parameters with it)
    assert.deepEqual(normaliseJsonSchema({ type: 'object', properties: { city: { type: 'string', description: 'a city', examples: ['Paris'] } } }), { type: 'object', properties: { city: { type: 'string', description: 'a city' } } });
    assert.deepEqual(normaliseJsonSchema({ type: 'integer', nullable: true, minimum: 1 }), { oneOf: [{ type: 'integer', minimum: 1 }, { type: 'null' }] });
    assert.deepEqual(normaliseJsonSchema({ allOf: [{ type: 'object', properties: { a: { type: 'string' } }, required: ['a'] }, { properties: { b: { type: 'boolean' } }, required: ['b'] }] }), {
      type: 'object',
      properties: { a: { type: 'string' }, b: { type: 'boolean' } },
      required: ['a', 'b'],
    });
    assert.deepEqual(normaliseJsonSchema({ type: 'object', properties: { a: { $ref: '#/$defs/A', description: 'd' } }, $defs: { A: { const: 1 } } }), { type: 'object', properties: { a: { $ref: '#/$defs/A' } }, $defs: { A: { const: 1 } } });
  });

  it('refused keywords name themselves and why', () => {
    refused({ not: { type: 'string' } }, '.not', /keyword 'not' is not supported/);
    refused({ type: 'object', patternProperties: { '^a': {} } }, '.patternProperties', /not supported/);
    refused({ $ref: 'https://example.com/s.json' }, '.$ref', /names nothing in this schema/);
    refused({ enum: [{ a: 1 }] }, '.enum', /the grammar matches literals/);
    refused({ allOf: [{ type: 'string' }, { type: 'integer' }] }, '.allOf', /disagree on 'type'/);
  });

  it('json_object: the grammar ends at the object', async () => {
    const g = (await llama.createGrammar({ grammar: JSON_OBJECT_GBNF })) as unknown as { _testText(t: string): boolean };
    assert.ok(g._testText('{"a": [1, {"b": null}]}'));
    assert.ok(!g._testText('{"a": 1} '));
    assert.ok(!g._testText('{"a": 1}\n'));
  });
});
