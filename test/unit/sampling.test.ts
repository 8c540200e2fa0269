/**
 * Sampler options on the real engine (tiny generated model): each option has an effect, and a
 * PD run (prefill on one slot, state saved, loaded into another slot, generate there — the
 * sampler rebuilt from prompt + first token) equals the colocated run (prefill + generate on one
 * slot) token for token, for every option, greedy and seeded.
 * Run: node --import tsx --test test/unit/sampling.test.ts
 */
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { ensureModel } from '../../src/engine/gguf-writer.js';
import { loadEngine } from '../../src/engine/llama.js';
import { choiceSeed, seedOf, type GrammarCache } from '../../src/engine/sampling.js';
import type { Engine, SamplingParams } from '../../src/engine/types.js';
import { drain, type Run } from '../helpers/engine.js';

const dir = mkdtempSync(path.join(os.tmpdir(), 'pdserve-sampling-test-'));
const never = new AbortController().signal;
const base = (over: Partial<SamplingParams> = {}): SamplingParams => ({ temperature: 0, topP: 1, topK: 0, maxTokens: 24, stop: [], ignoreEos: true, ...over });

let engine: Engine;
let prompt: number[];

async function colocated(sp: SamplingParams, p = prompt): Promise<Run> {
  const s = engine.tryAcquireSlot()!;
  try {
    const r = await s.prefill(p, sp, never);
    return await drain(s, r.firstToken, sp);
  } finally {
    s.release();
  }
}

/** Prefill on slot A, save; load into slot B (A still held, so B is another sequence); generate on B. */
async function pd(sp: SamplingParams, p = prompt): Promise<Run> {
  const a = engine.tryAcquireSlot()!;
  const b = engine.tryAcquireSlot()!;
  const file = path.join(dir, `s-${Math.random().toString(36).slice(2)}.ggsq`);
  try {
    const r = await a.prefill(p, sp, never);
    await a.saveState(file);
    await b.loadState(file, p);
    return await drain(b, r.firstToken, sp);
  } finally {
    a.release();
    b.release();
    rmSync(file, { force: true });
  }
}

async function both(sp: SamplingParams, p = prompt): Promise<Run> {
  const c = await colocated(sp, p);
  const d = await pd(sp, p);
  assert.deepEqual(d.tokens, c.tokens, 'PD tokens equal colocated tokens');
  assert.equal(d.text, c.text);
  assert.equal(d.finish, c.finish);
  return c;
}

describe('sampling options, PD equals colocated', () => {
  before(async () => {
    engine = await loadEngine({ modelPath: await ensureModel('tiny', 1), sequences: 2, contextSize: 512, batchSize: 64, deterministic: true, grammarBudgetMs: 1500 });
    prompt = engine.tokenize('the river ran past old mills and the river ran past old mills and');
  });
  after(async () => {
    await engine?.dispose();
    rmSync(dir, { recursive: true, force: true });
  });

  it('repetition, presence and frequency penalties change greedy output and survive the handoff', async () => {
    const plain = await both(base());
    const rep = await both(base({ repetitionPenalty: 1.8 }));
    const pres = await both(base({ presencePenalty: 2 }));
    const freq = await both(base({ frequencyPenalty: 2 }));
    assert.notDeepEqual(rep.tokens, plain.tokens, 'repetition_penalty has an effect');
    assert.notDeepEqual(pres.tokens, plain.tokens, 'presence_penalty has an effect');
    assert.notDeepEqual(freq.tokens, plain.tokens, 'frequency_penalty has an effect');
    // penalising what was generated makes the output more varied
    assert.ok(new Set(pres.tokens).size > new Set(plain.tokens).size, `presence_penalty: ${pres.tokens} vs ${plain.tokens}`);
  });

  it('logit_bias bans and forces tokens', async () => {
    const plain = await both(base());
    const banned = plain.tokens[0]!;
    const r = await both(base({ logitBias: [[banned, -100]] }));
    assert.ok(!r.tokens.includes(banned), 'a -100 bias bans the token');
    const forced = await both(base({ logitBias: [[banned === 70 ? 71 : 70, 100]] }));
    assert.ok(forced.tokens.every((t) => t === (banned === 70 ? 71 : 70)), 'a +100 bias forces the token');
  });

  it('stop_token_ids end generation; min_tokens holds them (and EOS) off', async () => {
    const plain = await both(base());
    const stopTok = plain.tokens[3]!;
    const firstAt = plain.tokens.indexOf(stopTok);
    const r = await both(base({ stopTokenIds: [stopTok] }));
    assert.equal(r.finish, 'stop');
    assert.deepEqual(r.tokens, plain.tokens.slice(0, firstAt + 1), 'ends on the first stop token (counted, its text not returned)');
    const m = await both(base({ stopTokenIds: [stopTok], minTokens: firstAt + 2, maxTokens: firstAt + 2 }));
    assert.ok(!m.tokens.slice(0, firstAt + 2).includes(stopTok), 'the stop token is banned before min_tokens');
    assert.equal(m.tokens.length, firstAt + 2);
    // EOS: with ignoreEos false and min_tokens, no EOG before min_tokens
    const eosFree = await both(base({ ignoreEos: false, minTokens: 20, maxTokens: 20, logitBias: [...engineEog().map((t): [number, number] => [t, 30])] }));
    assert.equal(eosFree.tokens.length, 20, 'EOG strongly favoured yet held off by min_tokens');
    const eosNow = await both(base({ ignoreEos: false, maxTokens: 20, logitBias: [...engineEog().map((t): [number, number] => [t, 30])] }));
    assert.ok(eosNow.tokens.length < 20 && eosNow.finish === 'stop', 'without min_tokens the favoured EOG ends generation');
  });

  it('min_p and seeded sampling: same seed same output across the handoff; min_p 1 is greedy', async () => {
    const seeded = await both(base({ temperature: 1.5, seed: 7 }));
    const again = await both(base({ temperature: 1.5, seed: 7 }));
    assert.deepEqual(again.tokens, seeded.tokens);
    const other = await both(base({ temperature: 1.5, seed: 8 }));
    assert.notDeepEqual(other.tokens, seeded.tokens, 'another seed, another sample');
    const greedy = await both(base());
    const minp1 = await both(base({ temperature: 1.5, seed: 7, minP: 1 }));
    assert.deepEqual(minp1.tokens, greedy.tokens, 'min_p 1 keeps only the most likely token');
  });

  it('JSON grammar and JSON schema grammar: valid JSON out of a random model, same in PD', async () => {
    assert.equal((engine as unknown as { grammars: GrammarCache }).grammars.thread.budgetMs, 1500, 'the engine\'s grammar thread has the budget it was loaded with (--grammar-budget-ms)');
    const json = await both(base({ ignoreEos: false, maxTokens: 200, grammar: { type: 'json' } }));
    assert.equal(json.finish, 'stop', json.text);
    assert.doesNotThrow(() => JSON.parse(json.text), json.text);
    const schema = { type: 'object', properties: { n: { type: 'integer' }, ok: { type: 'boolean' } }, required: ['n', 'ok'] };
    const js = await both(base({ ignoreEos: false, maxTokens: 200, grammar: { type: 'json_schema', schema } }));
    const v = JSON.parse(js.text) as { n: unknown; ok: unknown };
    assert.equal(typeof v.n, 'number');
    assert.equal(typeof v.ok, 'boolean');
    // the grammar ends where the JSON ends: EOG right after it, no trigger newlines, finish stop
    for (const [name, r] of [['json', json], ['json schema', js]] as const) {
      assert.equal(r.finish, 'stop', `${name}: ${JSON.stringify(r.text)}`);
      assert.equal(r.text, r.text.trimEnd(), `${name}: no trailing whitespace`);
      assert.ok(r.text.endsWith('}'), name);
      assert.ok(r.tokens.length < 200, name);
    }
    assert.ok(Number.isInteger(v.n) && !/\d[eE]/.test(js.text), 'an integer is written without exponent');
    // ignore_eos and min_tokens past the JSON's end do not hold a complete grammar open
    // (min_tokens banning EOG would leave llama.cpp no token at all: the sequence would fail)
    for (const over of [{ ignoreEos: true }, { minTokens: 150 }, { temperature: 1, seed: 11, minTokens: 150 }]) {
      const r = await both(base({ ignoreEos: false, maxTokens: 200, grammar: { type: 'json_schema', schema }, ...over }));
      assert.equal(r.finish, 'stop', JSON.stringify(over));
      assert.doesNotThrow(() => JSON.parse(r.text), r.text);
      assert.equal(r.text, r.text.trimEnd());
    }
  });

  it('a migrated request (prompt + k tokens the client has) continues exactly: penalties, logit bias, min_tokens, stop strings, grammars, max_tokens 0', async () => {
    const schema = { type: 'object', properties: { n: { type: 'integer' }, ok: { type: 'boolean' } }, required: ['n', 'ok'] };
    const plain = await colocated(base());
    const cases: [string, SamplingParams][] = [
      ['greedy', base()],
      ['repetition', base({ repetitionPenalty: 1.8 })],
      ['presence+frequency', base({ presencePenalty: 1.5, frequencyPenalty: 1 })],
      ['logit_bias + min_tokens + stop token', base({ ignoreEos: false, logitBias: [[plain.tokens[2]!, -100]], minTokens: 8, stopTokenIds: [plain.tokens[4]!] })],
      // a stop string whose first characters the earlier attempt's text already held back
      ['stop string', base({ stop: [plain.text.slice(plain.chunks.slice(0, 6).join('').length - 1, plain.chunks.slice(0, 8).join('').length)] })],
      ['json schema', base({ ignoreEos: false, maxTokens: 200, grammar: { type: 'json_schema', schema } })],
      ['rest of the context', base({ maxTokens: 0 })],
    ];
    for (const [name, sp] of cases) {
      const ref = await colocated(sp.maxTokens === 0 ? { ...sp, maxTokens: 512 - prompt.length } : sp);
      for (const k of [1, 5]) {
        assert.ok(ref.tokens.length > k, `${name}: the uninterrupted run is longer than ${k} tokens`);
        const resumed = ref.tokens.slice(0, k);
        const msp = { ...sp, resumed };
        const a = engine.tryAcquireSlot()!;
        const b = engine.tryAcquireSlot()!;
        const file = path.join(dir, `m-${k}.ggsq`);
        try {
          const r = await a.prefill(prompt, msp, never);
          assert.equal(r.promptTokens, prompt.length + k, `${name} k=${k}: the state holds prompt + resumed`);
          assert.equal(r.firstToken, ref.tokens[k], `${name} k=${k}: prefill samples token k+1`);
          assert.equal((await a.firstOutput(r.firstToken, msp)).text, ref.chunks[k], `${name} k=${k}: its text as the uninterrupted run emitted it`);
          await a.saveState(file);
          await b.loadState(file, [...prompt, ...resumed]);
          const got = await drain(b, r.firstToken, msp);
          assert.deepEqual([...resumed, ...got.tokens], ref.tokens, `${name} k=${k}: tokens`);
          assert.equal(ref.chunks.slice(0, k).join('') + got.text, ref.text, `${name} k=${k}: text`);
          assert.equal(got.finish, ref.finish, `${name} k=${k}: finish`);
        } finally {
          a.release();
          b.release();
          rmSync(file, { force: true });
        }
      }
      if (name === 'json schema') assert.doesNotThrow(() => JSON.parse(ref.text), ref.text);
    }
  });

  it('a migrated request with a seed (temperature > 0): the resumed tokens stand, the rest is a full-length sample, the same for the same migration point', async () => {
    const sp = base({ temperature: 1.2, seed: 1234 });
    const ref = await colocated(sp);
    const k = 4;
    const msp = { ...sp, resumed: ref.tokens.slice(0, k) };
    const once = () => colocated(msp);
    const a = await once();
    const b = await once();
    assert.deepEqual(a.tokens, b.tokens, 'reproducible for the same migration point');
    assert.equal(a.tokens.length, ref.tokens.length - k, 'max_tokens counts the resumed tokens');
    assert.equal(a.finish, ref.finish);
  });

  it("one seed rule: 4294967295 (llama.cpp's random-seed value) is a seed like any other, ≡ 0; PD equals colocated; consecutive seeds stay distinct across the wrap", async () => {
    assert.deepEqual([4294967294, 4294967295, 4294967296, -1, 0].map(seedOf), [4294967294, 0, 1, 4294967294, 0]);
    assert.deepEqual([0, 1, 2].map((i) => choiceSeed(4294967294, i)), [4294967294, 0, 1], 'n: 3 with seed 4294967294: three distinct seeds, none the random value');
    const sp = base({ temperature: 1.5, seed: 4294967295 });
    const a = await both(sp);
    const b = await both(sp);
    assert.deepEqual(b.tokens, a.tokens, 'reproducible (llama.cpp did not pick a random seed)');
    assert.deepEqual((await both(base({ temperature: 1.5, seed: 0 }))).tokens, a.tokens, 'the same residue, the same sample');
  });

  it('maxTokens 0 = the rest of the context', async () => {
    const long = engine.tokenize('x'.repeat(10)).concat(Array(490).fill(prompt[1]));
    const r = await colocated(base({ maxTokens: 0 }), long);
    assert.equal(r.tokens.length, 512 - long.length);
    assert.equal(r.finish, 'length');
  });
});

function engineEog(): number[] {
  return (engine as unknown as { eogTokens: number[] }).eogTokens;
}
