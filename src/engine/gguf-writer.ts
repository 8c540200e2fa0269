/**
 * Deterministic writer of small llama-architecture GGUF v3 files with random weights.
 *
 * No model can be downloaded on the machines pdserve targets, so tests and benchmarks run on
 * models written here: same (preset, seed) → the same bytes, always (seeded PRNG, no
 * Math.random, no timestamps). The vocabulary is a byte-fallback SentencePiece ("llama") vocab:
 * <unk>, <s>, </s>, the 256 byte tokens <0x00>..<0xFF> and a few hundred / thousand normal
 * pieces (letters, English words and their prefixes) so common text tokenizes compactly.
 *
 * Format notes (see docs/ENGINE.md and /work/shared/notes/gguf-writing.md): dimensions are
 * written innermost first; every tensor offset and the header block are padded to
 * `general.alignment` (32).
 */
import { createHash } from 'node:crypto';
import { systemClock } from '../base/clock.js';
import { createReadStream, promises as fsp } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { ConfigError } from '../base/errors.js';

export type GgufPreset = 'tiny' | 'small' | 'wide';

/** Model shape. All sizes are element counts. */
export interface ModelDims {
  nEmbd: number;
  nLayer: number;
  nHead: number;
  nHeadKv: number;
  nFf: number;
  /** Value of llama.context_length (training context). */
  contextLength: number;
  /** Weight type of the 2-D matrices (norms are always f32). */
  weightType: 'f32' | 'f16';
  /** Approximate vocabulary size target; the real size is reported by `describeModel`. */
  vocabTarget: number;
}

export const PRESETS: Readonly<Record<GgufPreset, Readonly<ModelDims>>> = Object.freeze({
  tiny: Object.freeze({ nEmbd: 64, nLayer: 2, nHead: 4, nHeadKv: 4, nFf: 128, contextLength: 4096, weightType: 'f32', vocabTarget: 300 }),
  small: Object.freeze({ nEmbd: 512, nLayer: 8, nHead: 8, nHeadKv: 8, nFf: 1536, contextLength: 4096, weightType: 'f16', vocabTarget: 2000 }),
  /**
   * GPU-class KV at little compute (BENCHMARKS §1's large states): 128 layers × 512 KV dims × f16
   * K and V = 256 KiB of state per token (an 8B GQA model keeps 128 KiB, a 70B one 320 KiB), so
   * 1 GiB is a 4096-token prompt; a narrow feed-forward keeps the weights at ~150 M parameters.
   */
  wide: Object.freeze({ nEmbd: 512, nLayer: 128, nHead: 4, nHeadKv: 4, nFf: 64, contextLength: 8192, weightType: 'f16', vocabTarget: 300 }),
});

export interface WriteGgufOptions {
  preset: GgufPreset;
  /** PRNG seed (uint32); the same seed gives the same bytes. */
  seed: number;
  /** Override preset dimensions (tests use odd sizes to exercise alignment padding). */
  dims?: Partial<ModelDims>;
  /**
   * A Jinja chat template (`tokenizer.chat_template`); absent = none, so node-llama-cpp uses its
   * generic wrapper. A template that renders `tools` and `tool_calls` gives a model whose call
   * syntax node-llama-cpp reads from the template (tool-call tests).
   */
  chatTemplate?: string;
}

const GGUF_ALIGNMENT = 32;
// GGUF metadata value types
const T_UINT32 = 4;
const T_INT32 = 5;
const T_FLOAT32 = 6;
const T_BOOL = 7;
const T_STRING = 8;
const T_ARRAY = 9;
// ggml tensor types
const GGML_F32 = 0;
const GGML_F16 = 1;
// llama token types
const TOK_NORMAL = 1;
const TOK_UNKNOWN = 2;
const TOK_CONTROL = 3;
const TOK_BYTE = 6;

// ---------------------------------------------------------------- PRNG

/** xoshiro128** seeded through splitmix32: small, fast, fully deterministic. */
class Rng {
  private s = new Uint32Array(4);
  constructor(seed: number) {
    let x = seed >>> 0;
    for (let i = 0; i < 4; i++) {
      x = (x + 0x9e3779b9) >>> 0;
      let z = x;
      z = Math.imul(z ^ (z >>> 16), 0x85ebca6b) >>> 0;
      z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35) >>> 0;
      this.s[i] = (z ^ (z >>> 16)) >>> 0;
    }
    if ((this.s[0] | this.s[1] | this.s[2] | this.s[3]) === 0) this.s[0] = 1;
  }
  nextU32(): number {
    const s = this.s;
    const result = Math.imul(rotl(Math.imul(s[1], 5) >>> 0, 7), 9) >>> 0;
    const t = (s[1] << 9) >>> 0;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 11);
    return result;
  }
  /** Uniform in [0, 1). */
  next(): number {
    return this.nextU32() / 4294967296;
  }
}
function rotl(x: number, k: number): number {
  return ((x << k) | (x >>> (32 - k))) >>> 0;
}

// ---------------------------------------------------------------- f16

const f32Scratch = new Float32Array(1);
const u32Scratch = new Uint32Array(f32Scratch.buffer);

/**
 * IEEE-754 binary32 → binary16 bit pattern, round-to-nearest-even, with subnormals,
 * overflow to ±Inf and NaN preserved (quiet). Node 20 has no Float16Array.
 */
export function f32ToF16Bits(value: number): number {
  f32Scratch[0] = value;
  const x = u32Scratch[0];
  const sign = (x >>> 16) & 0x8000;
  const exp = (x >>> 23) & 0xff;
  let mant = x & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant !== 0 ? 0x200 : 0);
  const e = exp - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    mant |= 0x800000;
    const shift = 14 - e;
    let half = mant >>> shift;
    const rem = mant & ((1 << shift) - 1);
    const halfway = 1 << (shift - 1);
    if (rem > halfway || (rem === halfway && (half & 1) === 1)) half++;
    return sign | half;
  }
  let half = (e << 10) | (mant >>> 13);
  const rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem === 0x1000 && (half & 1) === 1)) half++;
  return sign | half;
}

/** binary16 bit pattern → number (for tests and sanity checks). */
export function f16BitsToF32(h: number): number {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >>> 10) & 0x1f;
  const mant = h & 0x3ff;
  if (exp === 0) return sign * mant * 2 ** -24;
  if (exp === 0x1f) return mant ? NaN : sign * Infinity;
  return sign * (1 + mant / 1024) * 2 ** (exp - 15);
}

// ---------------------------------------------------------------- vocab

/** Frequent English words; the small preset uses all, tiny uses none (letters + bigrams only). */
const WORDS = (
  'the of and to in a is that for it as was with be by on not he i this are or his from at which but have an they you were her ' +
  'she there been one all we their has would when if so no will more can out up who them some into its than other time these ' +
  'two may then do first any my now such like our over man me even most made after also did many before must through back years where ' +
  'much your way well down should because each just those people how too little state good very make world still own see men work long ' +
  'get here between both life being under never day same another know while last might us great old year off come since against go came ' +
  'right used take three states himself few house use during without again place around however home small found thought went say part once ' +
  'general high upon school every does got united left number course war until always away something fact though water less public put think ' +
  'almost hand enough far took head yet government system better set told nothing night end why called didn find going look asked later knew ' +
  'point next city business give group toward young days let room president side social given present several order national possible rather second face ' +
  'per among form important often things looked early white case john become large big need four within felt along children saw best church ' +
  'ever least power development light thing seemed family interest want members mind country area others done turned although open god service certain kind ' +
  'problem began different door thus help sense means whole matter perhaps itself york times law human line above name example action company hands ' +
  'local show whether five history gave today either act feet across taken past quite anything seen having death experience body word half really ' +
  'week field money words order question model token server request prefill decode cache state stream sequence data file text hello world'
).split(' ');

interface VocabEntry {
  piece: string;
  score: number;
  type: number;
}

function buildVocab(target: number): VocabEntry[] {
  const vocab: VocabEntry[] = [
    { piece: '<unk>', score: 0, type: TOK_UNKNOWN },
    { piece: '<s>', score: 0, type: TOK_CONTROL },
    { piece: '</s>', score: 0, type: TOK_CONTROL },
  ];
  for (let b = 0; b < 256; b++) {
    vocab.push({ piece: `<0x${b.toString(16).toUpperCase().padStart(2, '0')}>`, score: 0, type: TOK_BYTE });
  }
  const seen = new Set<string>();
  const normal: string[] = [];
  const add = (p: string): void => {
    if (!seen.has(p)) {
      seen.add(p);
      normal.push(p);
    }
  };
  // Single characters first: SentencePiece merges only pieces that exist in the vocabulary.
  add('\u2581');
  for (const c of 'etaoinshrdlcumwfgypbvkjxqz') add(c);
  const bigrams = ['\u2581t', 'th', 'he', 'in', 'er', 'an', 're', 'on', '\u2581a', 'en', 'at', 'ou', 'ed', 'nd', 'is', 'or', '\u2581s', '\u2581w', 'ing', '\u2581th', '\u2581the'];
  for (const b of bigrams) add(b);
  if (target > 400) {
    for (const c of 'ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?\'"-()[]{}/*+=<>_#@$%&') add(c);
    outer: for (let len = 2; ; len++) {
      let grew = false;
      for (const w of WORDS) {
        const full = '\u2581' + w;
        if (full.length < len) continue;
        grew = true;
        add(full.slice(0, len));
        if (w.length >= len) add(w.slice(0, len)); // word-internal pieces without the space marker
        if (3 + 256 + normal.length >= target) break outer;
      }
      if (!grew) break;
    }
  }
  const room = Math.max(0, target - 3 - 256);
  const chosen = target > 400 ? normal.slice(0, room) : normal;
  // Ensure every chosen multi-char piece is reachable by merging chosen prefixes + single chars.
  const chosenSet = new Set(chosen);
  const reachable = chosen.filter((p) => [...p].length === 1 || chosenSet.has(p.slice(0, -1)));
  reachable.forEach((piece, i) => {
    // Longer pieces get higher scores so merges prefer them (SentencePiece picks the best-scored pair).
    vocab.push({ piece, score: -1000 + [...piece].length * 10 - i * 1e-3, type: TOK_NORMAL });
  });
  return vocab;
}

// ---------------------------------------------------------------- binary builder

class ByteWriter {
  private chunks: Buffer[] = [];
  private cur = Buffer.alloc(1 << 16);
  private pos = 0;
  length = 0;
  private ensure(n: number): void {
    if (this.pos + n > this.cur.length) {
      this.chunks.push(this.cur.subarray(0, this.pos));
      this.cur = Buffer.alloc(Math.max(1 << 16, n));
      this.pos = 0;
    }
  }
  u8(v: number): void {
    this.ensure(1);
    this.cur.writeUInt8(v, this.pos);
    this.pos += 1;
    this.length += 1;
  }
  u32(v: number): void {
    this.ensure(4);
    this.cur.writeUInt32LE(v >>> 0, this.pos);
    this.pos += 4;
    this.length += 4;
  }
  i32(v: number): void {
    this.ensure(4);
    this.cur.writeInt32LE(v, this.pos);
    this.pos += 4;
    this.length += 4;
  }
  f32(v: number): void {
    this.ensure(4);
    this.cur.writeFloatLE(v, this.pos);
    this.pos += 4;
    this.length += 4;
  }
  u64(v: number | bigint): void {
    this.ensure(8);
    this.cur.writeBigUInt64LE(BigInt(v), this.pos);
    this.pos += 8;
    this.length += 8;
  }
  str(s: string): void {
    const b = Buffer.from(s, 'utf8');
    this.u64(b.length);
    this.raw(b);
  }
  raw(b: Buffer): void {
    this.ensure(b.length);
    b.copy(this.cur, this.pos);
    this.pos += b.length;
    this.length += b.length;
  }
  padTo(alignment: number): void {
    const pad = (alignment - (this.length % alignment)) % alignment;
    for (let i = 0; i < pad; i++) this.u8(0);
  }
  toBuffer(): Buffer {
    return Buffer.concat([...this.chunks, this.cur.subarray(0, this.pos)]);
  }
}

type KvValue =
  | { t: 'u32'; v: number }
  | { t: 'f32'; v: number }
  | { t: 'bool'; v: boolean }
  | { t: 'str'; v: string }
  | { t: 'arr_str'; v: string[] }
  | { t: 'arr_f32'; v: number[] }
  | { t: 'arr_i32'; v: number[] };

function writeKv(w: ByteWriter, key: string, val: KvValue): void {
  w.str(key);
  switch (val.t) {
    case 'u32': w.u32(T_UINT32); w.u32(val.v); break;
    case 'f32': w.u32(T_FLOAT32); w.f32(val.v); break;
    case 'bool': w.u32(T_BOOL); w.u8(val.v ? 1 : 0); break;
    case 'str': w.u32(T_STRING); w.str(val.v); break;
    case 'arr_str': w.u32(T_ARRAY); w.u32(T_STRING); w.u64(val.v.length); for (const s of val.v) w.str(s); break;
    case 'arr_f32': w.u32(T_ARRAY); w.u32(T_FLOAT32); w.u64(val.v.length); for (const x of val.v) w.f32(x); break;
    case 'arr_i32': w.u32(T_ARRAY); w.u32(T_INT32); w.u64(val.v.length); for (const x of val.v) w.i32(x); break;
  }
}

interface TensorSpec {
  name: string;
  /** ggml ne order: innermost (contiguous) dimension first. */
  ne: number[];
  type: number;
  /** 'norm' → values around 1.0; otherwise uniform with this std. */
  init: { kind: 'norm' } | { kind: 'rand'; std: number };
  /** Per-row (ne[1] index) multiplier; used to make <unk>/<s> never and </s> rarely the argmax. */
  rowScale?: ReadonlyMap<number, number>;
}

/** Row multipliers of the output projection (token id → scale); ids 3..258 are the byte tokens. */
function outputRowScale(): Map<number, number> {
  const m = new Map<number, number>([[0, 0.05], [1, 0.05], [2, 0.85]]);
  for (let b = 0; b < 256; b++) {
    const printable = (b >= 0x20 && b < 0x7f) || b === 0x0a;
    if (!printable) m.set(3 + b, 0.05);
  }
  return m;
}

function tensorBytes(t: TensorSpec): number {
  const n = t.ne.reduce((a, b) => a * b, 1);
  return n * (t.type === GGML_F16 ? 2 : 4);
}

function fillTensor(t: TensorSpec, rng: Rng): Buffer {
  const n = t.ne.reduce((a, b) => a * b, 1);
  const out = Buffer.alloc(tensorBytes(t));
  // uniform(-a, a) has std a/sqrt(3)
  const a = t.init.kind === 'norm' ? 0.1 * Math.sqrt(3) : t.init.std * Math.sqrt(3);
  const base = t.init.kind === 'norm' ? 1.0 : 0;
  const rowLen = t.ne[0];
  for (let i = 0; i < n; i++) {
    let v = base + (rng.next() * 2 - 1) * a;
    if (t.rowScale) v *= t.rowScale.get(Math.floor(i / rowLen)) ?? 1;
    if (t.type === GGML_F16) out.writeUInt16LE(f32ToF16Bits(v), i * 2);
    else out.writeFloatLE(v, i * 4);
  }
  return out;
}

/** Shape, vocabulary size and parameter count of what `writeLlamaGguf` would write. */
export function describeModel(opts: WriteGgufOptions): { dims: ModelDims; nVocab: number; nParams: number } {
  const dims = resolveDims(opts);
  const nVocab = buildVocab(dims.vocabTarget).length;
  const nParams = buildTensorSpecs(dims, nVocab).reduce((s, t) => s + t.ne.reduce((a, b) => a * b, 1), 0);
  return { dims, nVocab, nParams };
}

function resolveDims(opts: WriteGgufOptions): ModelDims {
  const base = PRESETS[opts.preset];
  if (!base) throw new ConfigError(`unknown preset ${String(opts.preset)}`);
  const d: ModelDims = { ...base, ...(opts.dims ?? {}) };
  for (const k of ['nEmbd', 'nLayer', 'nHead', 'nHeadKv', 'nFf', 'contextLength', 'vocabTarget'] as const) {
    if (!Number.isInteger(d[k]) || d[k] < 1) throw new ConfigError(`dims.${k} must be a positive integer`);
  }
  if (d.nEmbd % d.nHead !== 0) throw new ConfigError('nEmbd must be a multiple of nHead');
  if ((d.nEmbd / d.nHead) % 2 !== 0) throw new ConfigError('head dimension must be even (RoPE)');
  if (d.nHead % d.nHeadKv !== 0) throw new ConfigError('nHead must be a multiple of nHeadKv');
  return d;
}

function buildTensorSpecs(d: ModelDims, nVocab: number): TensorSpec[] {
  const wt = d.weightType === 'f16' ? GGML_F16 : GGML_F32;
  const headDim = d.nEmbd / d.nHead;
  const nEmbdKv = headDim * d.nHeadKv;
  const rand = (std: number) => ({ kind: 'rand' as const, std });
  const norm = { kind: 'norm' as const };
  const specs: TensorSpec[] = [
    { name: 'token_embd.weight', ne: [d.nEmbd, nVocab], type: wt, init: rand(0.2) },
  ];
  for (let l = 0; l < d.nLayer; l++) {
    const p = `blk.${l}.`;
    specs.push(
      { name: p + 'attn_norm.weight', ne: [d.nEmbd], type: GGML_F32, init: norm },
      { name: p + 'attn_q.weight', ne: [d.nEmbd, d.nEmbd], type: wt, init: rand(0.2) },
      { name: p + 'attn_k.weight', ne: [d.nEmbd, nEmbdKv], type: wt, init: rand(0.2) },
      { name: p + 'attn_v.weight', ne: [d.nEmbd, nEmbdKv], type: wt, init: rand(0.2) },
      { name: p + 'attn_output.weight', ne: [d.nEmbd, d.nEmbd], type: wt, init: rand(0.2) },
      { name: p + 'ffn_norm.weight', ne: [d.nEmbd], type: GGML_F32, init: norm },
      { name: p + 'ffn_gate.weight', ne: [d.nEmbd, d.nFf], type: wt, init: rand(0.2) },
      { name: p + 'ffn_up.weight', ne: [d.nEmbd, d.nFf], type: wt, init: rand(0.2) },
      { name: p + 'ffn_down.weight', ne: [d.nFf, d.nEmbd], type: wt, init: rand(0.2) },
    );
  }
  specs.push(
    { name: 'output_norm.weight', ne: [d.nEmbd], type: GGML_F32, init: norm },
    // <unk> and <s> are (almost) never predicted; </s> is predicted, but less often than the
    // average token, so greedy runs are long enough to be interesting yet end sometimes. Byte
    // tokens that are not printable ASCII (control bytes, 0x7F–0xFF: lone UTF-8 fragments) are
    // damped too, so the random model writes readable characters instead of U+FFFD.
    { name: 'output.weight', ne: [d.nEmbd, nVocab], type: wt, init: rand(0.5), rowScale: outputRowScale() },
  );
  return specs;
}

/** Build the GGUF file in memory. Same options → identical bytes. */
export function buildLlamaGguf(opts: WriteGgufOptions): Buffer {
  if (!Number.isInteger(opts.seed) || opts.seed < 0 || opts.seed > 0xffffffff) {
    throw new ConfigError('seed must be a uint32');
  }
  const d = resolveDims(opts);
  const vocab = buildVocab(d.vocabTarget);
  const specs = buildTensorSpecs(d, vocab.length);
  const headDim = d.nEmbd / d.nHead;

  const kvs: Array<[string, KvValue]> = [
    ['general.architecture', { t: 'str', v: 'llama' }],
    ['general.name', { t: 'str', v: `pdserve-${opts.preset}-s${opts.seed}` }],
    ['general.alignment', { t: 'u32', v: GGUF_ALIGNMENT }],
    ['general.file_type', { t: 'u32', v: d.weightType === 'f16' ? 1 : 0 }],
    ['llama.vocab_size', { t: 'u32', v: vocab.length }],
    ['llama.context_length', { t: 'u32', v: d.contextLength }],
    ['llama.embedding_length', { t: 'u32', v: d.nEmbd }],
    ['llama.block_count', { t: 'u32', v: d.nLayer }],
    ['llama.feed_forward_length', { t: 'u32', v: d.nFf }],
    ['llama.attention.head_count', { t: 'u32', v: d.nHead }],
    ['llama.attention.head_count_kv', { t: 'u32', v: d.nHeadKv }],
    ['llama.rope.dimension_count', { t: 'u32', v: headDim }],
    ['llama.rope.freq_base', { t: 'f32', v: 10000 }],
    ['llama.attention.layer_norm_rms_epsilon', { t: 'f32', v: 1e-5 }],
    ['tokenizer.ggml.model', { t: 'str', v: 'llama' }],
    ['tokenizer.ggml.tokens', { t: 'arr_str', v: vocab.map((e) => e.piece) }],
    ['tokenizer.ggml.scores', { t: 'arr_f32', v: vocab.map((e) => e.score) }],
    ['tokenizer.ggml.token_type', { t: 'arr_i32', v: vocab.map((e) => e.type) }],
    ['tokenizer.ggml.unknown_token_id', { t: 'u32', v: 0 }],
    ['tokenizer.ggml.bos_token_id', { t: 'u32', v: 1 }],
    ['tokenizer.ggml.eos_token_id', { t: 'u32', v: 2 }],
    ['tokenizer.ggml.add_bos_token', { t: 'bool', v: true }],
    ['tokenizer.ggml.add_eos_token', { t: 'bool', v: false }],
  ];
  if (opts.chatTemplate !== undefined) kvs.push(['tokenizer.chat_template', { t: 'str', v: opts.chatTemplate }]);

  const w = new ByteWriter();
  w.raw(Buffer.from('GGUF', 'latin1'));
  w.u32(3);
  w.u64(specs.length);
  w.u64(kvs.length);
  for (const [k, v] of kvs) writeKv(w, k, v);
  let offset = 0;
  for (const t of specs) {
    w.str(t.name);
    w.u32(t.ne.length);
    for (const n of t.ne) w.u64(n);
    w.u32(t.type);
    w.u64(offset);
    offset += tensorBytes(t);
    offset += (GGUF_ALIGNMENT - (offset % GGUF_ALIGNMENT)) % GGUF_ALIGNMENT;
  }
  w.padTo(GGUF_ALIGNMENT);
  const rng = new Rng(opts.seed);
  for (const t of specs) {
    w.raw(fillTensor(t, rng));
    w.padTo(GGUF_ALIGNMENT);
  }
  return w.toBuffer();
}

/**
 * Write a deterministic random-weight llama GGUF v3 to `filePath` (overwrites).
 * @returns bytes written.
 * @throws Error on bad options (unknown preset, odd head dimension, …) or I/O failure.
 */
export async function writeLlamaGguf(filePath: string, opts: WriteGgufOptions): Promise<number> {
  const buf = buildLlamaGguf(opts);
  await fsp.writeFile(filePath, buf);
  return buf.length;
}

/** Directory for generated models: $PDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve. */
export function defaultCacheDir(): string {
  if (process.env.PDSERVE_CACHE_DIR) return process.env.PDSERVE_CACHE_DIR;
  if (process.env.XDG_CACHE_HOME) return path.join(process.env.XDG_CACHE_HOME, 'pdserve');
  return path.join(os.homedir(), '.cache', 'pdserve');
}

/** Bumped whenever the bytes written for a (preset, seed) change. */
export const GENERATOR_VERSION = 2;

/**
 * Path of `pdserve-<preset>-s<seed>-g<GENERATOR_VERSION>.gguf` in the cache dir, writing it
 * first if missing (tmp file + rename, so concurrent callers never see a partial file).
 * @returns absolute path of the GGUF.
 */
export async function ensureModel(preset: GgufPreset, seed: number, cacheDir?: string): Promise<string> {
  const dir = path.resolve(cacheDir ?? defaultCacheDir());
  // The generator version is part of the name: a changed generator never reuses a stale cache.
  const file = path.join(dir, `pdserve-${preset}-s${seed}-g${GENERATOR_VERSION}.gguf`);
  try {
    await fsp.access(file);
    return file;
  } catch {
    /* write below */
  }
  await fsp.mkdir(dir, { recursive: true });
  const tmp = `${file}.tmp-${process.pid}-${Math.round(systemClock.wallMs())}`;
  try {
    await writeLlamaGguf(tmp, { preset, seed });
    await fsp.rename(tmp, file);
  } catch (err) {
    await fsp.rm(tmp, { force: true });
    throw err;
  }
  return file;
}

/** sha256 of a file's contents, lowercase hex (64 chars). Streams; works for large files. */
export function sha256File(filePath: string): Promise<string> {
  return new Promise((resolve, reject) => {
    const h = createHash('sha256');
    const s = createReadStream(filePath);
    s.on('error', reject);
    s.on('data', (c) => h.update(c));
    s.on('end', () => resolve(h.digest('hex')));
  });
}
