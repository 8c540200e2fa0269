/**
 * Tool calls on the real engine (tiny generated model, node-llama-cpp's generic chat wrapper
 * `||call: name({...})`): the chat prompt renders the functions and past calls/results in the
 * wrapper's format; the tool-call grammar forces one well-formed call (arguments valid against
 * the schema) even from random weights; the lazy grammar ("auto") switches on after the call
 * prefix; PD (state saved, loaded into another slot, sampler rebuilt from prompt + first token)
 * equals colocated. Pure helpers (GBNF literal escaping, rule renaming) too.
 * Run: node --import tsx --test test/unit/tools-engine.test.ts
 */
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { GeneralChatWrapper } from 'node-llama-cpp';
import { readFileSync } from 'node:fs';
import { ensureModel, writeLlamaGguf } from '../../src/engine/gguf-writer.js';
import { ToolCallParser } from '../../src/api/tool-calls.js';
import { loadEngine } from '../../src/engine/llama.js';
import { gbnfLiteral, prefixGbnfRules, syntaxIsVisible, toolSyntaxOf } from '../../src/engine/tools.js';
import type { ChatMessage, Engine, SamplingParams, ToolFunction } from '../../src/engine/types.js';
import { drain, type Run } from '../helpers/engine.js';
import { RequestSampler } from '../../src/engine/sampling.js';

const dir = mkdtempSync(path.join(os.tmpdir(), 'pdserve-tools-test-'));
const never = new AbortController().signal;
const base = (over: Partial<SamplingParams> = {}): SamplingParams => ({ temperature: 0, topP: 1, topK: 0, maxTokens: 120, stop: [], ignoreEos: false, ...over });
const WEATHER: ToolFunction = { name: 'get_weather', description: 'Weather of a city', parameters: { type: 'object', properties: { city: { type: 'string' }, days: { type: 'integer' } }, required: ['city', 'days'] } };
const CLOCK: ToolFunction = { name: 'now', description: 'The time' };
/** Bounded arguments (an enum and an integer): a random model's free strings can run past max_tokens. */
const BOUNDED: ToolFunction = { name: 'get_weather', parameters: { type: 'object', properties: { unit: { type: 'string', enum: ['c', 'f'] }, days: { type: 'integer' } }, required: ['unit', 'days'] } };

let engine: Engine;

async function run(prompt: number[], sp: SamplingParams, mode: 'colocated' | 'pd', e: Engine): Promise<Run> {
  const a = e.tryAcquireSlot()!;
  const b = mode === 'pd' ? e.tryAcquireSlot()! : a;
  const file = path.join(dir, `s-${Math.random().toString(36).slice(2)}.ggsq`);
  try {
    await e.prepareSampling(sp);
    const r = await a.prefill(prompt, sp, never);
    if (mode === 'pd') {
      await a.saveState(file);
      await b.loadState(file, prompt);
    }
    return await drain(b, r.firstToken, sp);
  } finally {
    a.release();
    b.release();
    rmSync(file, { force: true });
  }
}

async function both(prompt: number[], sp: SamplingParams, e: Engine = engine): Promise<Run> {
  const c = await run(prompt, sp, 'colocated', e);
  const d = await run(prompt, sp, 'pd', e);
  assert.deepEqual(d.tokens, c.tokens, 'PD tokens equal colocated tokens');
  return c;
}

describe('tool calls on the engine', () => {
  before(async () => {
    engine = await loadEngine({ modelPath: await ensureModel('tiny', 1), sequences: 2, contextSize: 4096, batchSize: 256, deterministic: true });
  });
  after(async () => {
    await engine?.dispose();
  });

  it("the generic wrapper's syntax; functions and past calls/results rendered into the prompt", () => {
    assert.deepEqual(engine.toolSyntax, { prefix: '||call: ', prefixAlternates: ['||call:'], paramsPrefix: '(', suffix: ')', emptyParams: '', betweenCalls: null });
    const msgs: ChatMessage[] = [
      { role: 'user', content: 'Weather in Paris?' },
      { role: 'assistant', content: '', toolCalls: [{ id: 'c1', name: 'get_weather', arguments: '{"city":"Paris","days":1}' }] },
      { role: 'tool', content: '{"temp":21}', toolCallId: 'c1' },
    ];
    const text = engine.detokenize(engine.renderChat(msgs, [WEATHER, CLOCK]));
    assert.match(text, /\/\/ Weather of a city\nfunction get_weather\(params: \{city: string, days: /);
    assert.match(text, /function now\(\);/);
    // (the tiny vocabulary's detokenizer puts spaces around the separately tokenized '(' and ')')
    assert.ok(text.replace(/ /g, '').endsWith('###Assistant\n||call:get_weather({"city":"Paris","days":1})\n||result:{"temp":21}\n'), `the history ends inside the model turn, after the result: ${JSON.stringify(text.slice(-120))}`);
    const plain = engine.detokenize(engine.renderChat([{ role: 'user', content: 'hi' }]));
    assert.doesNotMatch(plain, /function|\|\|call/, 'no tools, no function documentation');
  });

  it('"required": the grammar forces one well-formed call whose arguments follow the schema; PD equals colocated', async () => {
    const prompt = engine.renderChat([{ role: 'user', content: 'Weather in Paris?' }], [WEATHER, CLOCK]);
    for (const sp of [base({ grammar: { type: 'tool_call', functions: [WEATHER, CLOCK], lazy: false } }), base({ temperature: 1, seed: 7, grammar: { type: 'tool_call', functions: [WEATHER], lazy: false } })]) {
      const r = await both(prompt, sp);
      assert.equal(r.finish, 'stop', `the call ends generation: ${JSON.stringify(r.text)}`);
      const m = /^\|\|call: (get_weather|now)\((.*)\)$/s.exec(r.text);
      assert.ok(m, `a call in the wrapper's syntax: ${JSON.stringify(r.text)}`);
      if (m[1] === 'get_weather') {
        const args = JSON.parse(m[2]!) as { city: unknown; days: unknown };
        assert.equal(typeof args.city, 'string');
        assert.ok(Number.isInteger(args.days));
      } else assert.ok(m[2] === '' || m[2] === '{}');
    }
  });

  it('"auto": free text (PD equals colocated); the lazy grammar switches on exactly when the text ends with the call prefix', async () => {
    const prompt = engine.renderChat([{ role: 'user', content: 'Weather in Paris?' }], [WEATHER]);
    const grammar = { type: 'tool_call' as const, functions: [WEATHER], lazy: true };
    const free = await both(prompt, base({ grammar, maxTokens: 40, ignoreEos: true }));
    assert.doesNotMatch(free.text, /\|\|call:/, 'random weights do not write the prefix: the output is free text');
    assert.equal(free.tokens.length, 40, 'not constrained: runs to max_tokens');
    // The trigger on the sampler itself (tokens handed over as prefill's first token would be).
    const e = engine as unknown as { model: never; grammars: { get(g: unknown): Promise<never> }; eogTokens: number[] };
    const bounded = { type: 'tool_call' as const, functions: [BOUNDED], lazy: true };
    const sp = base({ grammar: bounded });
    const sampler = new RequestSampler(e.model, sp, prompt, await e.grammars.get(bounded), e.eogTokens, engine.toolSyntax);
    const toks = engine.tokenize('Sure ||call:', false);
    toks.forEach((t, i) => {
      assert.equal(sampler.grammarState, undefined, `no grammar before the whole prefix (token ${i})`);
      sampler.accept(t, true);
    });
    assert.ok(sampler.grammarState, 'the grammar is on once the text ends with the prefix');
    // Sampling through node-llama-cpp with the switched-on state (the options' grammar is a
    // function read per token): the rest is a well-formed call, then the model can only stop.
    const ctx = await (e.model as unknown as { createContext(o: object): Promise<{ getSequence(): { evaluate(t: number[], o: object): AsyncGenerator<number> }; dispose(): Promise<void> }> }).createContext({ sequences: 1, contextSize: 2048, threads: 1 });
    try {
      const out: number[] = [];
      for await (const t of ctx.getSequence().evaluate([...prompt, ...toks], sampler.options)) {
        sampler.accept(t);
        if (e.eogTokens.includes(t) || out.length > 200) break;
        out.push(t);
      }
      const m = /^ ?get_weather\((.*)\)$/s.exec(engine.detokenize(out));
      assert.ok(m, `a call after the prefix: ${JSON.stringify(engine.detokenize(out))}`);
      const args = JSON.parse(m[1]!) as { unit: unknown; days: unknown };
      assert.ok((args.unit === 'c' || args.unit === 'f') && Number.isInteger(args.days), m[1]);
    } finally {
      await ctx.dispose();
    }
  });

  it('a call syntax made of control tokens (hidden from the output text) turns tool calls off', () => {
    const model = (engine as unknown as { model: never }).model;
    assert.equal(syntaxIsVisible(model, engine.toolSyntax!), true);
    assert.equal(syntaxIsVisible(model, { ...engine.toolSyntax!, prefix: '</s>' }), false, 'EOS text is a control token: not rendered');
  });

  it('GBNF helpers: literals escape quotes, backslashes and control characters; rule renaming skips literals and classes', () => {
    assert.equal(gbnfLiteral('a"b\\c\n\x01'), '"a\\"b\\\\c\\n\\x01"');
    assert.equal(prefixGbnfRules('root ::= "root" [a-z] rule0 # rule1\nrule0 ::= "x"', 'f0-'), 'f0-root ::= "root" [a-z] f0-rule0 # rule1\nf0-rule0 ::= "x"');
    assert.equal(toolSyntaxOf(Object.assign(new GeneralChatWrapper(), { settings: { ...new GeneralChatWrapper().settings, functions: undefined } }) as never), null, 'a wrapper without function settings: no tool calls');
  });
});

describe('tool calls with a chat template that defines the call syntax (tiny model + a Jinja template)', () => {
  let tmpl: Engine;
  before(async () => {
    const file = path.join(dir, 'tiny-tagged.gguf');
    await writeLlamaGguf(file, { preset: 'tiny', seed: 1, chatTemplate: readFileSync(new URL('../fixtures/tagged-tools.jinja', import.meta.url), 'utf8') });
    tmpl = await loadEngine({ modelPath: file, sequences: 2, contextSize: 2048, batchSize: 256, deterministic: true });
  });
  after(async () => {
    await tmpl?.dispose();
    rmSync(dir, { recursive: true, force: true });
  });

  it("node-llama-cpp reads the syntax from the template; history and the forced call use it; the parser reads the call back; PD equals colocated", async () => {
    assert.deepEqual(tmpl.toolSyntax, { prefix: '<tool_call>\n{"name": "', prefixAlternates: [], paramsPrefix: '", "arguments": ', suffix: '}\n</tool_call>', emptyParams: '{}', betweenCalls: '' });
    const history: ChatMessage[] = [
      { role: 'user', content: 'Weather in Paris?' },
      { role: 'assistant', content: '', toolCalls: [{ id: 'c1', name: 'get_weather', arguments: '{"city":"Paris","days":1}' }] },
      { role: 'tool', content: '{"temp":21}', toolCallId: 'c1' },
    ];
    const text = tmpl.detokenize(tmpl.renderChat(history, [WEATHER]));
    assert.ok(text.replace(/\s/g, '').includes('<tool_call>{"name":"get_weather","arguments":{"city":"Paris","days":1}}</tool_call>'), JSON.stringify(text));
    const prompt = tmpl.renderChat([{ role: 'user', content: 'Weather in Paris?' }], [BOUNDED]);
    const sp = base({ grammar: { type: 'tool_call', functions: [BOUNDED], lazy: false } });
    const c = await both(prompt, sp, tmpl);
    const p = new ToolCallParser(tmpl.toolSyntax!);
    const r = p.feed(c.text);
    p.end();
    assert.equal(r.content, '');
    assert.equal(p.calls.length, 1, JSON.stringify(c.text));
    assert.equal(p.calls[0]!.function.name, 'get_weather');
    const args = JSON.parse(p.calls[0]!.function.arguments) as { unit: unknown; days: unknown };
    assert.ok(args.unit === 'c' || args.unit === 'f');
    assert.ok(Number.isInteger(args.days));
    assert.equal(c.finish, 'stop', 'the complete call ends generation');
  });

  it('parallel calls: the grammar lets further calls follow (between-calls text + bounded whitespace + prefix), at most maxCalls, then the turn ends; each parsed back; PD equals colocated', async () => {
    const prompt = tmpl.renderChat([{ role: 'user', content: 'Weather in Paris and Rome?' }], [BOUNDED, CLOCK]);
    const counts: number[] = [];
    for (const seed of [1, 2, 3, 4, 5, 6]) {
      const sp = base({ temperature: 1, seed, maxTokens: 600, grammar: { type: 'tool_call', functions: [BOUNDED, CLOCK], lazy: false, parallel: true, maxCalls: 3 } });
      const c = await both(prompt, sp, tmpl);
      const p = new ToolCallParser(tmpl.toolSyntax!);
      const r = p.feed(c.text);
      const e = p.end();
      assert.equal(c.finish, 'stop', `seed ${seed}: the turn ends by itself: ${JSON.stringify(c.text)}`);
      assert.ok(p.calls.length >= 1 && p.calls.length <= 3, `seed ${seed}: 1 to maxCalls calls: ${p.calls.length}`);
      assert.ok(!/\s{24}/.test(c.text), 'whitespace between calls is bounded');
      assert.equal(r.content + e.content, '', `only calls: ${JSON.stringify(c.text)}`);
      for (const call of p.calls) {
        assert.ok(['get_weather', 'now'].includes(call.function.name));
        JSON.parse(call.function.arguments);
      }
      counts.push(p.calls.length);
    }
    assert.ok(counts.some((n) => n >= 2), `some run makes several calls: ${counts}`);
  });

  it('tools + a JSON schema ("auto"): the output is either calls or a JSON reply valid against the schema, ending "stop" with nothing after it; PD equals colocated', async () => {
    const prompt = tmpl.renderChat([{ role: 'user', content: 'Weather in Paris?' }], [BOUNDED]);
    const schema = { type: 'object', properties: { unit: { type: 'string', enum: ['c', 'f'] }, ok: { type: 'boolean' } }, required: ['unit', 'ok'], additionalProperties: false };
    const seen = { calls: 0, json: 0 };
    // Random weights favour '{': every other run pushes '<' (the call prefix's first character) up, so both forms are taken.
    const lt = tmpl.tokenize('<', false).at(-1)!;
    for (const seed of [1, 2, 3, 4, 5, 6, 7, 8]) {
      const sp = base({ temperature: 1, seed, maxTokens: 300, ...(seed % 2 === 0 ? { logitBias: [[lt, 50]] as [number, number][] } : {}), grammar: { type: 'tool_call', functions: [BOUNDED], lazy: false, parallel: true, maxCalls: 2, reply: { type: 'json_schema', schema } } });
      const c = await both(prompt, sp, tmpl);
      assert.equal(c.finish, 'stop', `seed ${seed}: ends by itself: ${JSON.stringify(c.text)}`);
      const p = new ToolCallParser(tmpl.toolSyntax!);
      const content = p.feed(c.text).content + p.end().content;
      if (p.calls.length > 0) {
        seen.calls++;
        assert.equal(content, '', `seed ${seed}: calls alone: ${JSON.stringify(c.text)}`);
        for (const call of p.calls) assert.ok(['c', 'f'].includes((JSON.parse(call.function.arguments) as { unit: string }).unit));
      } else {
        seen.json++;
        assert.equal(content, c.text);
        assert.doesNotMatch(c.text, /\s$/, `seed ${seed}: nothing after the JSON`);
        const v = JSON.parse(c.text) as { unit: unknown; ok: unknown };
        assert.deepEqual(Object.keys(v).sort(), ['ok', 'unit'], c.text);
        assert.ok((v.unit === 'c' || v.unit === 'f') && typeof v.ok === 'boolean', c.text);
      }
    }
    console.log(`tools + schema over 8 seeds: ${seen.calls} called, ${seen.json} replied JSON`);
    assert.ok(seen.calls > 0 && seen.json > 0, `both forms are open to the model: ${JSON.stringify(seen)}`);
  });
});
