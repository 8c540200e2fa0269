/**
 * Engine tests on a generated tiny model: GGUF determinism, PD exactness (prefill + save →
 * load in another engine / process with another sequence count and slot → generate equals
 * colocated prefill + generate), concurrency, stop strings, maxTokens, EOS, abort, state
 * validation before loading.
 * Run: node --import tsx --test test/unit/engine.test.ts
 */
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { createHash } from 'node:crypto';
import { copyFileSync, mkdtempSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { after, before, describe, it } from 'node:test';
import { promisify } from 'node:util';
import { buildLlamaGguf, describeModel, ensureModel, f16BitsToF32, f32ToF16Bits, sha256File, writeLlamaGguf } from '../../src/engine/gguf-writer.js';
import { inPlaceReframe, parseStateFile } from '../../src/engine/ggsq.js';
import { loadEngine, TextStream } from '../../src/engine/llama.js';
import type { Engine, FinishReason, SamplingParams, Slot } from '../../src/engine/types.js';
import { drain, type Run } from '../helpers/engine.js';
import { PdError } from '../../src/base/errors.js';

const CTX = 512;
const BATCH = 64;
const dir = mkdtempSync(path.join(os.tmpdir(), 'pdserve-engine-test-'));
const never = new AbortController().signal;
const greedy = (over: Partial<SamplingParams> = {}): SamplingParams => ({ temperature: 0, topP: 1, topK: 0, maxTokens: 24, stop: [], ignoreEos: true, ...over });

/** Colocated path: prefill then generate on one slot, no save/load. */
async function colocated(e: Engine, prompt: number[], sp: SamplingParams): Promise<Run & { first: number }> {
  const s = e.tryAcquireSlot()!;
  try {
    const r = await s.prefill(prompt, sp, never);
    return { ...(await drain(s, r.firstToken, sp)), first: r.firstToken };
  } finally {
    s.release();
  }
}
// ------------------------------------------------------------------------------- GGUF writer

describe('gguf writer', () => {
  it('is byte-for-byte deterministic per seed', () => {
    const a = buildLlamaGguf({ preset: 'tiny', seed: 7 });
    const b = buildLlamaGguf({ preset: 'tiny', seed: 7 });
    const c = buildLlamaGguf({ preset: 'tiny', seed: 8 });
    assert.ok(a.equals(b));
    assert.ok(!a.equals(c));
    assert.equal(a.length, c.length);
    assert.equal(a.subarray(0, 4).toString('latin1'), 'GGUF');
    assert.equal(a.readUInt32LE(4), 3);
    const d = describeModel({ preset: 'tiny', seed: 7 });
    assert.ok(d.nVocab >= 290 && d.nVocab <= 320, `vocab ${d.nVocab}`);
    const s = describeModel({ preset: 'small', seed: 7 });
    assert.ok(s.nParams > 25e6 && s.nParams < 30e6, `small params ${s.nParams}`);
  });

  it('converts f32 to f16 with round-to-nearest-even, subnormals and overflow', () => {
    const cases: Array<[number, number]> = [
      [0, 0], [-0, 0x8000], [1, 0x3c00], [-2, 0xc000], [0.1, 0x2e66], [65504, 0x7bff], [65520, 0x7c00],
      [2 ** -24, 0x0001], [2 ** -25, 0x0000], [3 * 2 ** -25, 0x0002], [2 ** -14, 0x0400], [Infinity, 0x7c00],
      [1 + 2 ** -11, 0x3c00], [1 + 3 * 2 ** -11, 0x3c02],
    ];
    for (const [v, bits] of cases) assert.equal(f32ToF16Bits(v), bits, `f16(${v})`);
    assert.ok(Number.isNaN(f16BitsToF32(f32ToF16Bits(NaN))));
    for (let i = 0; i < 1000; i++) {
      const v = (i - 500) / 37.3;
      assert.ok(Math.abs(f16BitsToF32(f32ToF16Bits(v)) - v) <= Math.abs(v) * 2 ** -11 + 1e-7);
    }
  });

  it('pads offsets for odd tensor sizes: a model with odd dims loads and generates', async () => {
    const file = path.join(dir, 'odd.gguf');
    // n_embd 24 → 96-byte norm tensors (not a multiple of 32); ff 70; f16 matrices
    await writeLlamaGguf(file, { preset: 'tiny', seed: 3, dims: { nEmbd: 24, nHead: 2, nHeadKv: 2, nFf: 70, weightType: 'f16' } });
    assert.throws(() => buildLlamaGguf({ preset: 'tiny', seed: 3, dims: { nEmbd: 18, nHead: 2 } }), /even/);
    const e = await loadEngine({ modelPath: file, sequences: 1, contextSize: 64, batchSize: 16 });
    try {
      const r = await colocated(e, e.tokenize('odd dims'), greedy({ maxTokens: 5 }));
      assert.equal(r.tokens.length, 5);
    } finally {
      await e.dispose();
    }
  });

  it('ensureModel writes once into the cache dir; sha256File matches', async () => {
    const cache = path.join(dir, 'cache');
    const p = await ensureModel('tiny', 11, cache);
    assert.equal(p, path.join(cache, 'pdserve-tiny-s11-g2.gguf'));
    const m1 = statSync(p).mtimeMs;
    assert.equal(await ensureModel('tiny', 11, cache), p);
    assert.equal(statSync(p).mtimeMs, m1);
    assert.equal(await sha256File(p), createHash('sha256').update(buildLlamaGguf({ preset: 'tiny', seed: 11 })).digest('hex'));
  });
});

// ------------------------------------------------------------------------------- text stream

describe('TextStream (byte-level fake detokenizer)', () => {
  const detok = (toks: number[], last: number[]) => {
    const all = Buffer.from([...last, ...toks]).toString('utf8');
    const prev = Buffer.from(last).toString('utf8');
    return all.startsWith(prev) ? all.slice(prev.length) : Buffer.from(toks).toString('utf8');
  };
  const feed = (bytes: number[], stop: string[]) => {
    const ts = new TextStream(detok, stop);
    const out: string[] = [];
    for (const b of bytes) {
      out.push(ts.push(b));
      if (ts.stopped) break;
    }
    if (!ts.stopped) out[out.length - 1] += ts.flush();
    return { out, text: out.join(''), stopped: ts.stopped };
  };
  const bytes = (s: string) => [...Buffer.from(s, 'utf8')];

  it('holds split multi-byte characters until complete', () => {
    const r = feed(bytes('a€b😀'), []);
    assert.equal(r.text, 'a€b😀');
    assert.deepEqual(r.out, ['a', '', '', '€', 'b', '', '', '', '😀']);
  });
  it('cuts at a stop string spanning tokens and never emits it', () => {
    const r = feed(bytes('hello END world'), ['END']);
    assert.equal(r.text, 'hello ');
    assert.ok(r.stopped);
    assert.ok(r.out.every((c) => !c.includes('E')));
  });
  it('releases a held stop-string prefix that did not complete', () => {
    const r = feed(bytes('xENx'), ['END']);
    assert.equal(r.text, 'xENx');
    assert.deepEqual(r.out, ['x', '', '', 'ENx']);
    assert.equal(feed(bytes('abEN'), ['END']).text, 'abEN'); // flushed at the end
  });
  it('finds the earliest of several stops, incl. multi-byte ones and one at the start', () => {
    assert.equal(feed(bytes('ab€cd'), ['cd', '€']).text, 'ab');
    assert.equal(feed(bytes('STOPx'), ['STOP']).text, '');
    assert.equal(feed(bytes('aaab'), ['aab']).text, 'a');
  });
  it('emits invalid bytes as U+FFFD once they cannot complete', () => {
    assert.equal(feed([0x61, 0xe2, 0x62], []).text, 'a\ufffdb');
    assert.equal(feed([0x61, 0xe2], []).text, 'a\ufffd');
  });
});

// ------------------------------------------------------------------------------- real engine

describe('engine on the tiny model', () => {
  let modelPath: string;
  let A: Engine; // "prefill" engine: 2 sequences
  let B: Engine; // "decode" engine: 3 sequences
  let C: Engine; // 1 sequence
  let prompts: Record<string, number[]>;

  before(async () => {
    modelPath = await ensureModel('tiny', 1, path.join(dir, 'cache'));
    A = await loadEngine({ modelPath, sequences: 2, contextSize: CTX, batchSize: BATCH });
    B = await loadEngine({ modelPath, sequences: 3, contextSize: CTX, batchSize: BATCH });
    C = await loadEngine({ modelPath, sequences: 1, contextSize: CTX, batchSize: BATCH });
    const long = A.tokenize('the state stream of the model is data. '.repeat(40)).slice(0, CTX - 24);
    assert.equal(long.length, CTX - 24);
    prompts = { one: [1], short: A.tokenize('Hello world'), chat: A.renderChat([{ role: 'user', content: 'hi' }]), long };
  });
  after(async () => {
    await A?.dispose();
    await B?.dispose();
    await C?.dispose();
  });

  it('reports info; fingerprint is the GGUF sha256', async () => {
    assert.equal(A.info.fingerprint, await sha256File(modelPath));
    assert.deepEqual(A.info.compat, { contextSize: CTX, batchSize: BATCH, nLayer: 2, flashAttention: true, kvCacheType: 'f16' });
    assert.equal(A.info.sequences, 2);
    assert.equal(A.info.threads, 1);
    assert.equal(A.info.nVocab, describeModel({ preset: 'tiny', seed: 1 }).nVocab);
    assert.equal(A.info.modelName, 'pdserve-tiny-s1-g2');
    assert.equal(A.detokenize(A.tokenize('hello there')), 'hello there');
  });

  it('hands out slots until exhausted; release is idempotent and frees the slot', async () => {
    assert.equal(A.slotsFree(), 2);
    const s0 = A.tryAcquireSlot()!;
    const s1 = A.tryAcquireSlot()!;
    assert.deepEqual([s0.index, s1.index], [0, 1]);
    assert.equal(A.tryAcquireSlot(), null);
    s1.release();
    s1.release();
    assert.equal(A.slotsFree(), 1);
    await assert.rejects(s1.prefill([1], greedy(), never), { code: 'SLOT_RELEASED' });
    s0.release();
    assert.equal(A.slotsFree(), 2);
  });

  it('PD equals colocated: save in A, load into B (3 seqs, slot 2) and C (1 seq), with concurrent generation', async () => {
    for (const [name, prompt] of Object.entries(prompts)) {
      const sp = greedy({ maxTokens: 24 });
      const ref = await colocated(A, prompt, sp);
      assert.equal(ref.tokens.length, 24, name);

      // background generation on A while prefilling (the prompt chunks share batches with it)
      const bgA = A.tryAcquireSlot()!;
      const rBg = await bgA.prefill(A.tokenize('background'), greedy({ maxTokens: 400 }), never);
      const bgRun = drain(bgA, rBg.firstToken, greedy({ maxTokens: 400 }));
      const p = A.tryAcquireSlot()!;
      assert.equal(p.index, 1);
      const r = await p.prefill(prompt, sp, never);
      const file = path.join(dir, `pd-${name}.ggsq`);
      const size = await p.saveState(file);
      p.release();
      assert.equal(r.firstToken, ref.first, name);
      assert.equal(r.promptTokens, prompt.length);
      const st = parseStateFile(readFileSync(file), { contextSize: CTX, nLayer: 2, maxBytes: 1 << 24 });
      assert.equal(st.nStream, 2);
      assert.equal(size, statSync(file).size);

      // decode in B, slot 2, while slot 0 generates
      const bgB = B.tryAcquireSlot()!;
      const rB = await bgB.prefill(B.tokenize('other request'), greedy({ maxTokens: 400 }), never);
      const bgRunB = drain(bgB, rB.firstToken, greedy({ maxTokens: 400 }));
      const blocker = B.tryAcquireSlot()!;
      const d = B.tryAcquireSlot()!;
      assert.equal(d.index, 2);
      await d.loadState(file, prompt);
      const got = await drain(d, r.firstToken, sp);
      d.release();
      blocker.release();
      assert.deepEqual(got.tokens, ref.tokens, `${name}: B differs`);
      assert.equal(got.text, ref.text);
      assert.equal(got.finish, ref.finish);

      // and into a 1-sequence context (streams dropped)
      const c = C.tryAcquireSlot()!;
      await c.loadState(file, prompt);
      const gotC = await drain(c, r.firstToken, sp);
      c.release();
      assert.deepEqual(gotC.tokens, ref.tokens, `${name}: C differs`);

      // in place, as decode loads a file it received and walked: into B the file grows by one
      // empty stream (4 bytes, n_stream patched), no copy; into C only a copy works (the
      // non-empty stream is not first)
      const own = path.join(dir, `pd-${name}-own.ggsq`);
      copyFileSync(file, own);
      const walked = parseStateFile(readFileSync(own), { contextSize: CTX, nLayer: 2, maxBytes: 1 << 24, nVocab: B.info.nVocab });
      assert.deepEqual(inPlaceReframe(walked, 3), { nStreamOffset: walked.nStreamOffset, nStream: 3, size: size + 4 });
      assert.equal(inPlaceReframe(walked, 1), undefined);
      const e = B.tryAcquireSlot()!;
      await e.loadState(own, prompt, walked);
      const gotE = await drain(e, r.firstToken, sp);
      e.release();
      assert.deepEqual(gotE.tokens, ref.tokens, `${name}: B (in place) differs`);
      assert.equal(statSync(own).size, size + 4, 'the file was re-framed in place');
      assert.equal(parseStateFile(readFileSync(own), { contextSize: CTX, maxBytes: 1 << 24 }).nStream, 3);

      await bgRun;
      await bgRunB;
      bgA.release();
      bgB.release();
    }
  });

  it('PD equals colocated across processes', async () => {
    const prompt = prompts.short;
    const sp = greedy({ maxTokens: 20 });
    const ref = await colocated(A, prompt, sp);
    const s = A.tryAcquireSlot()!;
    const r = await s.prefill(prompt, sp, never);
    const file = path.join(dir, 'xproc.ggsq');
    await s.saveState(file);
    s.release();
    const engineUrl = pathToFileURL(path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../../src/engine/llama.ts')).href;
    const code = `
      const { loadEngine } = await import(${JSON.stringify(engineUrl)});
      const e = await loadEngine({ modelPath: ${JSON.stringify(modelPath)}, sequences: 4, contextSize: ${CTX}, batchSize: ${BATCH} });
      const held = [e.tryAcquireSlot(), e.tryAcquireSlot(), e.tryAcquireSlot()];
      const d = e.tryAcquireSlot();
      await d.loadState(${JSON.stringify(file)}, ${JSON.stringify(prompt)});
      const out = [];
      for await (const t of d.generate(${r.firstToken}, ${JSON.stringify(sp)}, new AbortController().signal)) out.push(t.token);
      console.log(JSON.stringify({ index: d.index, out }));
      await e.dispose();`;
    // a script file, not `-e`: node-llama-cpp forks a binding test process that inherits execArgv
    const script = path.join(dir, 'child.mts');
    writeFileSync(script, code);
    const { stdout } = await promisify(execFile)(process.execPath, ['--import', 'tsx', script], { cwd: process.cwd(), timeout: 30_000 });
    const res = JSON.parse(stdout.trim().split('\n').pop()!) as { index: number; out: number[] };
    assert.equal(res.index, 3);
    assert.deepEqual(res.out, ref.tokens);
  });

  it('seeded sampling (temperature 0.8, topP 0.9, topK 40) is reproducible and PD equals colocated', async () => {
    const sp: SamplingParams = { temperature: 0.8, topP: 0.9, topK: 40, seed: 42, maxTokens: 30, stop: [], ignoreEos: true };
    const ref = await colocated(A, prompts.short, sp);
    assert.deepEqual((await colocated(A, prompts.short, sp)).tokens, ref.tokens);
    assert.notDeepEqual((await colocated(A, prompts.short, { ...sp, seed: 43 })).tokens, ref.tokens);
    const p = A.tryAcquireSlot()!;
    const r = await p.prefill(prompts.short, sp, never);
    const file = path.join(dir, 'seeded.ggsq');
    await p.saveState(file);
    p.release();
    const d = B.tryAcquireSlot()!;
    await d.loadState(file, prompts.short);
    const got = await drain(d, r.firstToken, sp);
    d.release();
    assert.deepEqual(got.tokens, ref.tokens);
  });

  it('maxTokens counts the first token; text equals the detokenized tokens', async () => {
    const one = await colocated(A, prompts.short, greedy({ maxTokens: 1 }));
    assert.equal(one.tokens.length, 1);
    assert.equal(one.finish, 'length');
    const r = await colocated(A, prompts.short, greedy({ maxTokens: 60 }));
    assert.equal(r.tokens.length, 60);
    assert.equal(r.finish, 'length');
    const ctxTail = prompts.short;
    const expected = A.detokenize([...ctxTail, ...r.tokens]).slice(A.detokenize(ctxTail).length);
    assert.equal(r.text, expected);
  });

  it('stop strings end generation before the stop text, even across tokens', async () => {
    const sp = greedy({ maxTokens: 120 });
    const base = await colocated(A, prompts.chat, sp);
    // pick a plain-ASCII substring of the output, from its first occurrence
    let stop = '';
    for (let i = 4; i + 3 <= base.text.length && !stop; i++) {
      const cand = base.text.slice(i, i + 3);
      if (/^[a-z ]{3}$/.test(cand) && cand.trim() === cand) stop = cand;
    }
    assert.ok(stop, `no ASCII run in ${JSON.stringify(base.text)}`);
    const cut = base.text.indexOf(stop);
    const r = await colocated(A, prompts.chat, { ...sp, stop: ['\u0000never', stop] });
    assert.equal(r.finish, 'stop');
    assert.equal(r.text, base.text.slice(0, cut));
    assert.ok(r.tokens.length < base.tokens.length);
    assert.deepEqual(r.tokens, base.tokens.slice(0, r.tokens.length));
  });

  it('EOS ends generation (not emitted as text) unless ignoreEos', async () => {
    const eos = 2;
    let found: { prompt: number[]; idx: number } | null = null;
    for (const w of ['abc def ghi', 'q', 'what is the time', 'state stream', 'In the beginning', 'x', 'zz', 'hello']) {
      const prompt = A.tokenize(w);
      const r = await colocated(A, prompt, greedy({ maxTokens: 300 }));
      const idx = r.tokens.indexOf(eos);
      if (idx >= 0) {
        found = { prompt, idx };
        break;
      }
    }
    assert.ok(found, 'no greedy run reached </s>');
    const stopRun = await colocated(A, found.prompt, greedy({ maxTokens: 300, ignoreEos: false }));
    assert.equal(stopRun.finish, 'stop');
    assert.equal(stopRun.tokens.length, found.idx + 1);
    assert.equal(stopRun.tokens.at(-1), eos);
    assert.ok(!stopRun.text.includes('</s>'));
    const goOn = await colocated(A, found.prompt, greedy({ maxTokens: found.idx + 5, ignoreEos: true }));
    assert.equal(goOn.finish, 'length');
    assert.equal(goOn.tokens.length, found.idx + 5);
  });

  it('prefill rejects prompts that do not fit and empty ones', async () => {
    const s = A.tryAcquireSlot()!;
    try {
      await assert.rejects(s.prefill(new Array(CTX - 9).fill(5), greedy({ maxTokens: 10 }), never), { code: 'PROMPT_TOO_LONG' });
      await assert.rejects(s.prefill([], greedy(), never), { code: 'EMPTY_PROMPT' });
      await assert.rejects(s.prefill([1, 99999], greedy(), never), { code: 'INVALID_TOKEN' });
      const ok = await s.prefill(new Array(CTX - 10).fill(5), greedy({ maxTokens: 10 }), never);
      assert.equal(ok.promptTokens, CTX - 10);
    } finally {
      s.release();
    }
  });

  it('abort is honoured between prefill chunks and during generation; the slot stays usable', async () => {
    const ref = await colocated(A, prompts.long, greedy({ maxTokens: 8 }));
    const s = A.tryAcquireSlot()!;
    const ac = new AbortController();
    const p = s.prefill(prompts.long, greedy({ maxTokens: 8 }), ac.signal);
    setImmediate(() => ac.abort());
    await assert.rejects(p, { code: 'ABORTED' });
    // deterministic: a signal that turns aborted on its 3rd read = after the 2nd of 8 chunks
    let reads = 0;
    const counting = { get aborted() { return ++reads >= 3; } } as AbortSignal;
    await assert.rejects(s.prefill(prompts.long, greedy({ maxTokens: 8 }), counting), { code: 'ABORTED' });
    assert.equal(reads, 3);
    const pre = new AbortController();
    pre.abort();
    await assert.rejects(s.prefill(prompts.short, greedy(), pre.signal), { code: 'ABORTED' });
    // the same slot, reused: clean state, same result
    const r = await s.prefill(prompts.long, greedy({ maxTokens: 8 }), never);
    assert.deepEqual((await drain(s, r.firstToken, greedy({ maxTokens: 8 }))).tokens, ref.tokens);
    s.release();
    // abort during generation
    const s2 = A.tryAcquireSlot()!;
    const r2 = await s2.prefill(prompts.short, greedy({ maxTokens: 200 }), never);
    const gen = new AbortController();
    const g = s2.generate(r2.firstToken, greedy({ maxTokens: 200 }), gen.signal);
    let n = 0;
    let res: IteratorResult<unknown, FinishReason | 'abort'>;
    for (;;) {
      res = await g.next();
      if (res.done) break;
      if (++n === 5) gen.abort();
    }
    assert.equal(res.value, 'abort');
    assert.equal(n, 5);
    s2.release();
    // release during generation ends the generator; the next owner gets a clean sequence
    const s3 = A.tryAcquireSlot()!;
    const r3 = await s3.prefill(prompts.short, greedy({ maxTokens: 200 }), never);
    const g3 = s3.generate(r3.firstToken, greedy({ maxTokens: 200 }), never);
    await g3.next();
    await g3.next();
    s3.release();
    assert.deepEqual(await g3.next(), { done: true, value: 'abort' });
    const again = await colocated(A, prompts.long, greedy({ maxTokens: 8 }));
    assert.deepEqual(again.tokens, ref.tokens);
  });

  it('a state rejected by the parser never reaches llama.cpp (the process survives)', async () => {
    const s = A.tryAcquireSlot()!;
    const r = await s.prefill(prompts.short, greedy(), never);
    const file = path.join(dir, 'good.ggsq');
    await s.saveState(file);
    s.release();
    const good = readFileSync(file);
    const st = parseStateFile(good, { contextSize: CTX, nLayer: 2, maxBytes: 1 << 24 });
    const kData = st.streams.find((x) => x.cellCount > 0)!.k![1].dataOffset + 7;
    const d = B.tryAcquireSlot()!;
    try {
      // truncated inside the K data: llama.cpp itself would abort the process (GGML_ASSERT)
      for (const [bad, why] of [
        [good.subarray(0, kData), 'truncated in K'],
        [good.subarray(0, good.length - 1), 'truncated in V'],
        [Buffer.concat([good, Buffer.alloc(3)]), 'trailing'],
      ] as const) {
        const f = path.join(dir, 'bad.ggsq');
        writeFileSync(f, bad);
        await assert.rejects(d.loadState(f, prompts.short), (e: unknown) => e instanceof PdError && e.code === 'BAD_STATE', why);
      }
      // tokens in the file must be the prompt the caller expects
      await assert.rejects(d.loadState(file, [1, 2, 3]), /differ from the prompt/);
      // and the slot still works
      await d.loadState(file, prompts.short);
      const got = await drain(d, r.firstToken, greedy());
      assert.deepEqual(got.tokens, (await colocated(A, prompts.short, greedy())).tokens);
    } finally {
      d.release();
    }
  });
});

after(() => rmSync(dir, { recursive: true, force: true }));
