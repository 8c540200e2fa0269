/**
 * The chunk cache's exactness (src/engine/token-chunks.ts): over many random chat prompts grown
 * turn by turn (an agent's next prompt extends the last), the cached path's tokens equal the
 * whole tokenization's, for the generated tiny GGUF (generic chat wrapper), the same with a Jinja
 * template (special tokens between messages, tools documented), and the trained stories260K with
 * and without that template; small chunks (many cuts) and a small byte bound (evictions) included.
 * The start-up self-check passes on these vocabularies and catches a deliberately inexact cut
 * rule; vocabularies the cut rule does not cover leave the cache off; the byte bound holds.
 */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { dirname, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { after, before, describe, test } from 'node:test';
import { getLlama, LlamaLogLevel, type Llama, type LlamaModel } from 'node-llama-cpp';
import { ensureModel } from '../../src/engine/gguf-writer.js';
import { chatWrapperOf, renderChatTokens, tokenizeText } from '../../src/engine/prompt.js';
import { ChunkedTokenizer, safeCutsOf, selfCheckSamples } from '../../src/engine/token-chunks.js';
import type { ChatMessage, ToolFunction } from '../../src/engine/types.js';
import { withChatTemplate } from '../helpers/gguf-template.js';
import { storiesModel } from '../helpers/stories.js';

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), '../..');
const TEMPLATE = readFileSync(resolve(ROOT, 'test/fixtures/tagged-tools.jinja'), 'utf8');


/** mulberry32: a small seeded PRNG, so a failure names its seed. */
function prng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) | 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const WORDS = ['the', 'agent', 'reads', 'file,', 'runs', 'tests.', 'Once', 'upon', 'a', 'time', 'Lily', 'saw', 'big', 'dog!', 'Ünïcödé', '日本語', '🙂', 'é', '"quoted"', '(a)', '{b: 1}', '[x]', '123', '4.5', '-', '—', ':', ';', '?', '...', '<s>', '</s>', '<unk>', '▁', 'x▁y', '### Human', '<tool_call>', '\\n', 'I', "don't", 'A.B', '#', '@', '=', '$', '%', '^', '&', '*', '~', '`', '|', '/'];
const SEPS = [' ', ' ', ' ', ' ', ' ', '', '  ', '   ', '\n', '\n\n', '\t', ' \n', ', '];

function text(r: () => number, words: number): string {
  let s = r() < 0.2 ? SEPS[Math.floor(r() * SEPS.length)]! : '';
  for (let i = 0; i < words; i++) s += WORDS[Math.floor(r() * WORDS.length)]! + SEPS[Math.floor(r() * SEPS.length)]!;
  return r() < 0.3 ? s.trimEnd() : s;
}

const TOOLS: ToolFunction[] = [{ name: 'get_weather', description: 'Weather of a city.', parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } }];

/** Conversations of `turns` turns: each turn's messages extend the last turn's (a shared system prompt in half of them). */
function conversations(seed: number, n: number, turns: number): { messages: ChatMessage[]; tools?: ToolFunction[] }[][] {
  const r = prng(seed);
  const shared = text(r, 300);
  const out: { messages: ChatMessage[]; tools?: ToolFunction[] }[][] = [];
  for (let c = 0; c < n; c++) {
    const messages: ChatMessage[] = [{ role: 'system', content: r() < 0.5 ? shared : text(r, 50 + Math.floor(r() * 400)) }];
    const tools = r() < 0.3 ? TOOLS : undefined;
    const conv: { messages: ChatMessage[]; tools?: ToolFunction[] }[] = [];
    for (let t = 0; t < turns; t++) {
      messages.push({ role: 'user', content: text(r, 1 + Math.floor(r() * 120)) });
      conv.push({ messages: [...messages], ...(tools ? { tools } : {}) });
      messages.push({ role: 'assistant', content: text(r, Math.floor(r() * 60)) });
    }
    out.push(conv);
  }
  return out;
}

let llama: Llama;
const models: { name: string; model: LlamaModel }[] = [];

before(async () => {
  llama = await getLlama({ gpu: false, build: 'never', maxThreads: 0, logLevel: LlamaLogLevel.error });
  const tiny = await ensureModel('tiny', 1);
  const paths: [string, string][] = [
    ['tiny', tiny],
    ['tiny + template', withChatTemplate(tiny, TEMPLATE)],
  ];
  const stories = storiesModel();
  if (stories) paths.push(['stories260K', stories], ['stories260K + template', withChatTemplate(stories, TEMPLATE)]);
  else {
    const why = `token-chunks.test.ts: stories260K cases SKIPPED: ../shared/models/stories260K.gguf is missing (looked from ${ROOT})`;
    console.error(`\n!!! ${why}\n`);
    if (process.env.CI === 'true') throw new Error(why);
  }
  for (const [name, modelPath] of paths) models.push({ name, model: await llama.loadModel({ modelPath, vocabOnly: true, gpuLayers: 0 }) });
});

after(async () => {
  for (const { model } of models) await model.dispose();
  await llama?.dispose();
});

describe('chunked tokenization equals whole tokenization', () => {
  const configs = [
    { chunkChars: 8, maxBytes: 1 << 20 },
    { chunkChars: 64, maxBytes: 4096 },
    { chunkChars: 400, maxBytes: 1 << 20 },
  ];
  test('random chats grown turn by turn, every model and chunk size', () => {
    let compared = 0;
    let hits = 0;
    for (const { name, model } of models) {
      const wrapper = chatWrapperOf(model);
      for (const [ci, cfg] of configs.entries()) {
        const ct = new ChunkedTokenizer(model, cfg);
        assert.equal(ct.stats().on, true, `${name}: ${ct.stats().why}`);
        const seed = 1000 + ci;
        for (const [k, conv] of conversations(seed, 12, 5).entries()) {
          for (const [t, turn] of conv.entries()) {
            const want = renderChatTokens(model, wrapper, turn.messages, turn.tools);
            const got = renderChatTokens(model, wrapper, turn.messages, turn.tools, ct.tokenizer);
            assert.deepEqual(got, want, `${name}, chunk ${cfg.chunkChars}, seed ${seed}, conversation ${k}, turn ${t}`);
            compared++;
          }
        }
        hits += ct.stats().hits;
        assert.ok(ct.stats().bytes <= cfg.maxBytes, `${name}: ${ct.stats().bytes} bytes held over the bound ${cfg.maxBytes}`);
      }
    }
    assert.ok(compared >= 2 * 3 * 12 * 5, `compared ${compared} prompts`);
    // the cache served chunks: the path under test is the cached one, not the whole fallback
    assert.ok(hits > 1000, `only ${hits} chunk hits`);
  });

  test('plain text (completions), with and without BOS, every model', () => {
    for (const { name, model } of models) {
      const ct = new ChunkedTokenizer(model, { chunkChars: 16 });
      const r = prng(7);
      for (let i = 0; i < 60; i++) {
        const s = text(r, 1 + Math.floor(r() * 400));
        for (const bos of [true, false]) assert.deepEqual(tokenizeText(model, s, bos, ct.tokenizer), tokenizeText(model, s, bos), `${name}, sample ${i}, bos ${bos}`);
      }
      assert.ok(ct.stats().hits + ct.stats().misses > 100, `${name}: chunks were not used`);
    }
  });
});

describe('self-check and the rules for when the cache is on', () => {
  test('passes on every model here', () => {
    for (const { name, model } of models) {
      const ct = new ChunkedTokenizer(model);
      const wrapper = chatWrapperOf(model);
      const s = selfCheckSamples();
      assert.equal(ct.selfCheck(s, [(t) => renderChatTokens(model, wrapper, [{ role: 'system', content: s[0]! }, { role: 'user', content: s[1]! }], undefined, t)]), undefined, name);
      assert.equal(ct.stats().on, true);
    }
  });

  test('an inexact cut rule (cut anywhere) is caught and turns the cache off', () => {
    const { model } = models[0]!;
    const ct = new ChunkedTokenizer(model, { unsafeCuts: true });
    const why = ct.selfCheck(selfCheckSamples());
    assert.match(why ?? '', /self-check/);
    assert.equal(ct.stats().on, false);
    // off: the same tokens as the model's own, computed whole
    const s = selfCheckSamples()[0]!.repeat(20);
    assert.deepEqual(ct.tokenizer(s, false), model.tokenizer(s, false));
    assert.equal(ct.stats().hits + ct.stats().misses, 0);
  });

  test('a cache of 0 bytes is off', () => {
    const ct = new ChunkedTokenizer(models[0]!.model, { maxBytes: 0 });
    assert.equal(ct.stats().on, false);
  });

  test('vocabularies outside the rule leave it off; a piece with "c▁" makes c unsafe', () => {
    const fake = (ggml: Record<string, unknown>) => ({ fileInfo: { metadata: { tokenizer: { ggml } } } }) as unknown as LlamaModel;
    assert.match(JSON.stringify(safeCutsOf(fake({ model: 'gpt2', tokens: ['a'], token_type: [1] }))), /not SentencePiece/);
    assert.match(JSON.stringify(safeCutsOf(fake({ model: 'llama', tokens: ['a', '<x>'], token_type: [1, 4] }))), /user-defined/);
    const cuts = safeCutsOf(fake({ model: 'llama', tokens: ['▁a', 'e▁x', 'q b'], token_type: [1, 1, 1] }));
    assert.ok('safeLeft' in cuts);
    assert.equal(cuts.safeLeft['e'.charCodeAt(0)], 0);
    assert.equal(cuts.safeLeft['q'.charCodeAt(0)], 0);
    assert.equal(cuts.safeLeft['a'.charCodeAt(0)], 1);
  });
});
