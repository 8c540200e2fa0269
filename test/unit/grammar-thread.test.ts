/**
 * The grammar thread (engine/grammar-thread.ts): JSON-schema GBNF text generated in a worker
 * thread is the text the in-process path makes (node-llama-cpp's generator imported by path ===
 * `createGrammarForJsonSchema(x).grammar`, for the framework fixtures), the event loop keeps
 * ticking while a slow generation runs, and a generation past the time budget fails with
 * schema_too_complex, the thread being started again for the next schema.
 * Run: node --import tsx --test test/unit/grammar-thread.test.ts
 */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { pathToFileURL } from 'node:url';
import { monitorEventLoopDelay } from 'node:perf_hooks';
import { after, before, describe, it } from 'node:test';
import { getLlama, type Llama } from 'node-llama-cpp';
import { normaliseJsonSchema } from '../../src/api/json-schema.js';
import { PdError } from '../../src/base/errors.js';
import { jsonSchemaGbnf, type GbnfGenerator } from '../../src/engine/json-grammar.js';
import { BAD_GRAMMAR, gbnfGeneratorPath, GrammarThread } from '../../src/engine/grammar-thread.js';
import { GrammarCache } from '../../src/engine/sampling.js';

const FIXTURES = JSON.parse(readFileSync(new URL('../fixtures/framework-schemas.json', import.meta.url), 'utf8')) as Record<string, Record<string, unknown>>;
const SCHEMAS = Object.entries(FIXTURES).map(([name, s]) => [name, normaliseJsonSchema(s) as Record<string, unknown>] as const);

let llama: Llama;
const threads: GrammarThread[] = [];
const thread = (opts: ConstructorParameters<typeof GrammarThread>[0] = {}): GrammarThread => {
  const t = new GrammarThread(opts);
  threads.push(t);
  return t;
};

/** Count 10 ms interval ticks and the worst loop delay while `p` settles. */
async function loopWhile<T>(p: Promise<T>): Promise<{ ticks: number; maxDelayMs: number; ms: number; result: PromiseSettledResult<T> }> {
  const h = monitorEventLoopDelay({ resolution: 10 });
  h.enable();
  let ticks = 0;
  const iv = setInterval(() => ticks++, 10);
  const t0 = performance.now();
  const [result] = await Promise.allSettled([p]);
  const ms = performance.now() - t0;
  clearInterval(iv);
  h.disable();
  return { ticks, maxDelayMs: h.max / 1e6, ms, result: result! };
}

describe('grammar thread', () => {
  before(async () => {
    llama = await getLlama({ gpu: false, build: 'never' });
  });
  after(async () => {
    for (const t of threads) await t.close();
  });

  it("node-llama-cpp's generator, imported by path, makes createGrammarForJsonSchema's text", async () => {
    const { getGbnfGrammarForGbnfJsonSchema: generate } = (await import(pathToFileURL(gbnfGeneratorPath()).href)) as { getGbnfGrammarForGbnfJsonSchema: GbnfGenerator };
    assert.ok(SCHEMAS.length >= 3);
    for (const [name, s] of SCHEMAS) assert.equal(generate(s), (await llama.createGrammarForJsonSchema(s as never)).grammar, name);
  });

  it('the thread gives the in-process GBNF text for every fixture schema, and llama.cpp parses it', async () => {
    const t = thread();
    for (const [name, s] of SCHEMAS) {
      const text = await t.gbnf(s);
      assert.equal(text, await jsonSchemaGbnf(llama, s), name);
      assert.doesNotMatch(text, /\\n\\n\\n\\n/, `${name}: the trailer is cut`);
      await llama.createGrammar({ grammar: text });
    }
    assert.equal(t.starts, 1, 'one thread served them all');
  });

  it('the event loop keeps ticking while a slow generation runs in the thread', async () => {
    const t = thread({ spinMs: 600, budgetMs: 10_000 });
    await t.gbnf({ type: 'string' }); // started (the thread's start is not what is measured)
    const [name, s] = SCHEMAS[0]!;
    const { ticks, maxDelayMs, ms, result } = await loopWhile(t.gbnf(s));
    assert.equal(result.status, 'fulfilled', name);
    assert.equal((result as PromiseFulfilledResult<string>).value, await jsonSchemaGbnf(llama, s));
    assert.ok(ms >= 600, `took ${ms} ms (the spin is 600)`);
    // 600 ms at 10 ms: ~60 ticks on an idle loop; a blocked loop would give 0-1 (shared CPU: leeway)
    assert.ok(ticks >= 20, `${ticks} ticks in ${Math.round(ms)} ms`);
    // a blocked loop's worst delay is the whole generation; a shared CI core may pause the loop briefly
    assert.ok(maxDelayMs < ms * 0.75, `worst loop delay ${maxDelayMs} ms of ${Math.round(ms)}`);
  });

  it('past the time budget: schema_too_complex naming the budget, the loop responsive, a new thread for the next schema', async () => {
    const t = thread({ spinMs: 3_000, budgetMs: 400 });
    const { ticks, maxDelayMs, ms, result } = await loopWhile(t.gbnf(SCHEMAS[0]![1]));
    assert.equal(result.status, 'rejected');
    const err = (result as PromiseRejectedResult).reason as PdError;
    assert.ok(err instanceof PdError);
    assert.equal(err.code, 'schema_too_complex');
    assert.match(err.message, /400 ms time budget/);
    assert.ok(ms >= 400 && ms < 2_900, `failed after ${Math.round(ms)} ms, before the 3 s generation ended`);
    assert.ok(ticks >= 10, `${ticks} ticks in ${Math.round(ms)} ms`);
    assert.ok(maxDelayMs < ms * 0.75, `worst loop delay ${maxDelayMs} ms of ${Math.round(ms)}`);
    assert.equal(t.starts, 1);
    // the next schema gets a new thread (and its own budget)
    await assert.rejects(t.gbnf({ type: 'string' }), (e: PdError) => e.code === 'schema_too_complex');
    assert.equal(t.starts, 2);
  });

  it('a schema the generator refuses: PdError BAD_GRAMMAR from the thread, which GrammarCache names (a 400 at the API) and the thread lives on', async () => {
    const t = thread();
    const bad = { enum: [{ a: 1 }] }; // an object literal: node-llama-cpp's generator throws
    await assert.rejects(t.gbnf(bad), (e: unknown) => e instanceof PdError && e.code === BAD_GRAMMAR && /literal/.test(e.message));
    const cache = new GrammarCache(llama, null, t);
    await assert.rejects(cache.get({ type: 'json_schema', schema: bad }), (e: unknown) => e instanceof PdError && e.code === BAD_GRAMMAR && /^response_format: the JSON schema cannot be turned into a grammar: /.test(e.message));
    assert.ok(await cache.get({ type: 'json_schema', schema: { type: 'integer' } }), 'the next schema is served');
    assert.equal(t.starts, 1, 'a refused schema is no thread failure');
  });

  it("GrammarCache passes the budget's schema_too_complex through (not BAD_GRAMMAR) and does not cache it; closed, it refuses", async () => {
    const t = thread({ spinMs: 2_000, budgetMs: 200 });
    const cache = new GrammarCache(llama, null, t);
    const spec = { type: 'json_schema' as const, schema: SCHEMAS[0]![1] };
    await assert.rejects(cache.get(spec), (e: PdError) => e.code === 'schema_too_complex');
    await assert.rejects(cache.get(spec), (e: PdError) => e.code === 'schema_too_complex');
    assert.equal(t.starts, 2, 'tried again, not a cached failure');
    await cache.close();
    await assert.rejects(cache.get({ type: 'json_schema', schema: { type: 'integer' } }), (e: PdError) => e.code === 'engine_failed');
  });
});
