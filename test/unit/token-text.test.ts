/**
 * Logprob token texts: the pure rendering rules (token-text.ts), the OpenAI shapes built from them
 * (respond.ts: tokens, top_logprobs, text_offset, chat bytes) and the real engine (tiny generated
 * SentencePiece model): tokens rendered in context join to the text, a character split over byte
 * tokens renders as `bytes:\xNN` with its raw bytes, and PD renders as colocated.
 * Run: node --import tsx --test test/unit/token-text.test.ts
 */
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, test } from 'node:test';
import { chatLogprobs, completionLogprobs, OpenAIResponseBuilder, type ChatCompletion, type TextCompletion } from '../../src/api/respond.js';
import { ensureModel } from '../../src/engine/gguf-writer.js';
import { loadEngine } from '../../src/engine/llama.js';
import { bytesOf, escapeBytes, isUtf8, pieceBytes, renderToken } from '../../src/engine/token-text.js';
import type { Engine, SamplingParams, TokenLogprob } from '../../src/engine/types.js';
import type { GenerateEvent, WireLogprob } from '../../src/protocol/worker-protocol.js';

const utf8 = (s: string) => [...Buffer.from(s, 'utf8')];

describe('token rendering rules', () => {
  test('escapeBytes and isUtf8', () => {
    assert.equal(escapeBytes([0xe2, 0x80]), 'bytes:\\xe2\\x80');
    assert.equal(escapeBytes([0x0a]), 'bytes:\\x0a');
    assert.ok(isUtf8(utf8(' t’é')));
    assert.ok(isUtf8([0xef, 0xbb, 0xbf]), 'a BOM is text');
    assert.ok(!isUtf8([0xe2, 0x80]), 'an incomplete character');
    assert.ok(!isUtf8([0x99]), 'a lone continuation byte');
  });

  test('pieceBytes: SentencePiece byte tokens and spaces, GPT-2 byte-level pieces, unknown kinds', () => {
    assert.deepEqual(pieceBytes('<0xE2>', 'llama'), [0xe2]);
    assert.deepEqual(pieceBytes('\u2581the', 'llama'), utf8(' the'));
    assert.deepEqual(pieceBytes('Ġhello', 'gpt2'), utf8(' hello'));
    // 'âĢ' is how byte-level BPE writes the bytes E2 80 (the start of ’)
    assert.deepEqual(pieceBytes('âĢ', 'gpt2'), [0xe2, 0x80]);
    assert.deepEqual(pieceBytes('Ċ', 'gpt2'), [0x0a]);
    // the 256 byte characters are distinct and map back to every byte
    const all = new Set<number>();
    for (let b = 0; b < 512; b++) {
      const r = pieceBytes(String.fromCodePoint(b), 'gpt2');
      if (r) all.add(r[0]!);
    }
    assert.equal(all.size, 256);
    assert.equal(pieceBytes('漢', 'gpt2'), undefined, 'not of the byte alphabet');
    assert.equal(pieceBytes('x', 'bert'), undefined);
  });

  test('renderToken: a token that is not valid UTF-8 on its own is bytes:\\xNN with its raw bytes, any other its text in context', () => {
    assert.deepEqual(renderToken(utf8('t'), () => ' t'), { token: ' t' }, 'the text in context, not the piece');
    assert.deepEqual(renderToken([0xe2], () => '\ufffd'), { token: 'bytes:\\xe2', bytes: [0xe2] });
    assert.deepEqual(renderToken([0x80], () => ''), { token: 'bytes:\\x80', bytes: [0x80] }, 'a continuation byte reads as nothing in context');
    assert.deepEqual(renderToken([0x20, 0xe2, 0x80], () => ' \ufffd'), { token: 'bytes:\\x20\\xe2\\x80', bytes: [0x20, 0xe2, 0x80] });
    assert.deepEqual(renderToken(utf8('\ufffd'), () => '\ufffd'), { token: '\ufffd' }, 'a real U+FFFD piece is text');
    assert.deepEqual(renderToken(undefined, () => '\ufffd'), { token: '\ufffd' }, 'unknown tokenizer: the text as is');
    assert.deepEqual(bytesOf({ token: 'bytes:\\xe2', bytes: [0xe2] }), [0xe2]);
    assert.deepEqual(bytesOf({ token: ' é' }), utf8(' é'));
  });
});

describe('OpenAI logprobs shapes', () => {
  const lp = (token: string, bytes?: number[], top: WireLogprob['top'] = []): WireLogprob => ({ token, ...(bytes ? { bytes } : {}), logprob: -1, top });
  // " t" "’" (three byte tokens) "x": text " t’x"
  const lps = [lp(' t'), lp('bytes:\\xe2', [0xe2]), lp('bytes:\\x80', [0x80]), lp('bytes:\\x99', [0x99]), lp('x')];
  const texts = [' t', '', '', '’', 'x'];

  test('completions: text_offset is each token\'s start in the text (a split character at its first part)', () => {
    const c = completionLogprobs(lps);
    assert.deepEqual(c.tokens, lps.map((l) => l.token));
    assert.deepEqual(c.text_offset, [0, 2, 2, 2, 3]);
    const ascii = completionLogprobs([lp('F'), lp('!'), lp('f'), lp(' t'), lp('r'), lp('2')]);
    assert.equal(ascii.tokens.join(''), 'F!f tr2');
    assert.deepEqual(ascii.text_offset, [0, 1, 2, 3, 5, 6]);
    assert.deepEqual(completionLogprobs([lp('😀'), lp('a')]).text_offset, [0, 2], 'UTF-16 units');
  });

  test('completions top_logprobs: two alternatives with one text keep the likelier', () => {
    const c = completionLogprobs([{ token: 'a', logprob: -0.5, top: [{ token: 'a', logprob: -0.5 }, { token: 'b', logprob: -1 }, { token: 'a', logprob: -3 }] }]);
    assert.deepEqual(c.top_logprobs, [{ a: -0.5, b: -1 }]);
  });

  test('chat: bytes are the raw bytes and concatenate to the content', () => {
    const c = chatLogprobs([lp(' t', undefined, [{ token: 'bytes:\\xe2', bytes: [0xe2], logprob: -2 }]), ...lps.slice(1)]);
    assert.deepEqual(Buffer.from(c.content.flatMap((t) => t.bytes)).toString('utf8'), ' t’x');
    assert.deepEqual(c.content[0]!.top_logprobs, [{ token: 'bytes:\\xe2', logprob: -2, bytes: [0xe2] }]);
    assert.deepEqual(c.content[1]!.bytes, [0xe2]);
  });

  test('a stream\'s chunks carry the offsets of the whole text, equal to the non-stream response', () => {
    const meta = { id: 'r', model: 'm', created: 1 };
    const ev = (i: number): GenerateEvent => ({ text: texts[i]!, token_ids: [i], logprobs: [lps[i]!], meta_info: { id: 'r', prompt_tokens: 3, completion_tokens: i + 1, ...(i === lps.length - 1 ? { finish_reason: { type: 'length' } } : {}) } as GenerateEvent['meta_info'] });
    const b = new OpenAIResponseBuilder('completion', meta);
    const chunks = lps.flatMap((_, i) => b.push(ev(i))) as TextCompletion[];
    const streamed = chunks.flatMap((c) => c.choices[0]!.logprobs?.text_offset ?? []);
    const whole = (b.response() as TextCompletion).choices[0]!;
    assert.equal(whole.text, ' t’x');
    assert.deepEqual(streamed, [0, 2, 2, 2, 3]);
    assert.deepEqual(whole.logprobs!.text_offset, streamed);
    const chat = new OpenAIResponseBuilder('chat', meta);
    lps.forEach((_, i) => chat.push(ev(i)));
    const r = (chat.response() as ChatCompletion).choices[0]!;
    assert.equal(Buffer.from(r.logprobs!.content.flatMap((t) => t.bytes)).toString('utf8'), r.message.content);
  });
});

describe('the engine renders logprob tokens in context; PD equals colocated', () => {
  const dir = mkdtempSync(path.join(os.tmpdir(), 'pdserve-token-text-test-'));
  const never = new AbortController().signal;
  const base = (over: Partial<SamplingParams> = {}): SamplingParams => ({ temperature: 0, topP: 1, topK: 0, maxTokens: 16, stop: [], ignoreEos: true, logprobs: 5, ...over });
  let engine: Engine;

  before(async () => {
    engine = await loadEngine({ modelPath: await ensureModel('tiny', 1), sequences: 2, contextSize: 512, batchSize: 64, deterministic: true });
  });
  after(async () => {
    await engine?.dispose();
    rmSync(dir, { recursive: true, force: true });
  });

  /** Generation of `prompt` with logprobs: colocated (one slot) or PD (prefill on A, state into B, generate on B). */
  async function run(prompt: number[], sp: SamplingParams, pd: boolean): Promise<{ text: string; lps: TokenLogprob[] }> {
    const a = engine.tryAcquireSlot()!;
    const b = pd ? engine.tryAcquireSlot()! : a;
    const file = path.join(dir, `s-${Math.random().toString(36).slice(2)}.ggsq`);
    try {
      const r = await a.prefill(prompt, sp, never);
      if (pd) {
        await a.saveState(file);
        await b.loadState(file, prompt);
      }
      const out = { text: '', lps: [r.firstLogprob!] };
      const g = b.generate(r.firstToken, sp, never);
      for (let n = await g.next(); !n.done; n = await g.next()) {
        out.text += n.value.text;
        if (n.value.logprob) out.lps.push(n.value.logprob);
      }
      return out;
    } finally {
      a.release();
      if (pd) b.release();
      rmSync(file, { force: true });
    }
  }

  test('the tokens join to the text, leading spaces included; alternatives too are rendered in context', async () => {
    for (const text of ['Once upon a time', 'the river ran past old mills and', 'a']) {
      const prompt = engine.tokenize(text);
      const c = await run(prompt, base(), false);
      assert.equal(c.lps.length, 16);
      assert.equal(c.lps.map((l) => l.token).join(''), c.text, `tokens of ${JSON.stringify(text)}`);
      assert.ok(c.lps.every((l) => l.bytes === undefined && l.top.length === 5));
      // greedy: the sampled token is the likeliest alternative, rendered the same way
      for (const l of c.lps) assert.equal(l.top[0]!.token, l.token);
      assert.ok(c.lps.some((l) => l.token.startsWith(' ')), `some token of ${JSON.stringify(c.text)} starts a word`);
      assert.deepEqual(await run(prompt, base(), true), c, 'PD renders as colocated');
    }
  });

  test('a character only byte tokens can write: each part is bytes:\\xNN with its byte, the bytes make the text', async () => {
    // ’ (E2 80 99) and é (C3 A9) have no piece of their own in the tiny vocabulary
    const sp = base({ ignoreEos: false, maxTokens: 12, grammar: { type: 'json_schema', schema: { enum: ['’é'] } } });
    const prompt = engine.tokenize('say it:');
    const c = await run(prompt, sp, false);
    assert.match(c.text, /^"’é"\s*$/, 'the grammar allows trailing whitespace');
    const parts = c.lps.filter((l) => l.bytes);
    assert.deepEqual(parts.map((l) => l.token), ['bytes:\\xe2', 'bytes:\\x80', 'bytes:\\x99', 'bytes:\\xc3', 'bytes:\\xa9']);
    assert.equal(Buffer.from(c.lps.flatMap((l) => bytesOf(l))).toString('utf8'), c.text);
    assert.deepEqual(await run(prompt, sp, true), c, 'PD renders as colocated');
  });
});
