/**
 * Exact tokenization of long prompts by cached chunks: an agent's next prompt repeats the last
 * one's text and many share a system prompt, so most of a 16K-token prompt was tokenized before.
 * `ChunkedTokenizer.tokenizer` is a drop-in for `model.tokenizer` (node-llama-cpp's `LlamaText`
 * calls it once per run of plain text between special tokens); a long plain run is cut into
 * chunks at safe cuts, each chunk's tokens come from a bounded LRU (exact text key) or llama.cpp.
 *
 * Why a cut is safe (llama.cpp's SentencePiece tokenizer, `tokenizer.ggml.model = llama`): it
 * escapes spaces to ▁, starts from single characters and merges adjacent symbols only into
 * vocabulary pieces. A cut before a space whose left character c is printable ASCII and such that
 * no piece contains "c▁" can never be crossed by a merge, so both sides are tokenized on their
 * own, in the same order. The right side is tokenized after an anchor (c itself, dropped after),
 * so it gets no leading-space prefix of its own.
 *
 * | rule | why |
 * |---|---|
 * | on only for a `llama` (SentencePiece) vocabulary without user-defined tokens | other tokenizers pre-split or match pieces across spaces; user-defined tokens split text even without special parsing |
 * | a start-up self-check (`selfCheck`) compares chunked with whole tokenization on sample texts; a mismatch turns it off | exactness is checked on this vocabulary, not assumed |
 * | cuts are chosen from the text's start (first safe cut ≥ `chunkChars` after the last) | a prompt that extends another gets the same chunks up to its new tail |
 * | two maps, first chunks and later chunks, keyed by the chunk's exact text | only the first chunk gets the leading-space prefix; an exact key cannot collide |
 * | bounded by `maxBytes` (2 bytes a character of key, 4 a token, 64 an entry), least recently used dropped | `--tokenize-cache-mib` |
 * | text shorter than 2 × `chunkChars`, or a chunk whose anchor does not tokenize as expected: tokenized whole | exact by delegation |
 */
import type { LlamaModel, Tokenizer } from 'node-llama-cpp';

/** Default bound of the chunk cache, bytes (`--tokenize-cache-mib`). */
export const DEFAULT_TOKENIZE_CACHE_BYTES = 64 << 20;
/** Default characters per chunk (a chunk ends at the first safe cut after this many). */
export const DEFAULT_CHUNK_CHARS = 1024;
/** Bytes counted per cache entry on top of its key and tokens. */
const ENTRY_OVERHEAD = 64;

export interface ChunkedTokenizerOptions {
  /** Most bytes the cache holds (0: no caching, every text tokenized whole). */
  maxBytes?: number;
  /** Characters per chunk before the next safe cut (tests use small ones to cut often). */
  chunkChars?: number;
  /** Tests of the self-check only: cut at any position and tokenize each chunk on its own, no anchor (inexact on purpose). */
  unsafeCuts?: boolean;
}

/** Cache figures: entries, bytes held, chunk hits and misses, texts tokenized whole. */
export interface ChunkCacheStats {
  on: boolean;
  why: string;
  entries: number;
  bytes: number;
  maxBytes: number;
  hits: number;
  misses: number;
  whole: number;
}

type TokenizerOption = 'trimLeadingSpace' | undefined;

/** Whether chunking is exact for this vocabulary by the module doc's rules: a reason when not, and which ASCII left characters make a safe cut. */
export function safeCutsOf(model: LlamaModel): { why: string } | { safeLeft: Uint8Array } {
  const g = (model.fileInfo.metadata as unknown as { tokenizer?: { ggml?: { model?: unknown; tokens?: unknown; token_type?: unknown } } }).tokenizer?.ggml;
  if (g?.model !== 'llama') return { why: `vocabulary type ${String(g?.model)} is not SentencePiece (llama)` };
  const pieces = g.tokens;
  const types = g.token_type;
  if (!Array.isArray(pieces) || !Array.isArray(types)) return { why: 'the GGUF has no token list' };
  // USER_DEFINED (4): llama.cpp splits text at these even without special parsing
  if (types.some((t) => t === 4)) return { why: 'the vocabulary has user-defined tokens' };
  const safeLeft = new Uint8Array(128);
  for (let c = 0x21; c < 0x7f; c++) safeLeft[c] = 1;
  for (const p of pieces) {
    if (typeof p !== 'string') return { why: 'a token piece is not a string' };
    const s = p.replaceAll(' ', '\u2581');
    for (let i = s.indexOf('\u2581', 1); i > 0; i = s.indexOf('\u2581', i + 1)) {
      const c = s.charCodeAt(i - 1);
      if (c < 128) safeLeft[c] = 0;
    }
  }
  return { safeLeft };
}

/** See the module doc. One per loaded model; not thread-safe (one thread uses it). */
export class ChunkedTokenizer {
  /** Drop-in for `model.tokenizer` (same results), for `LlamaText.tokenize` and plain text. */
  readonly tokenizer: Tokenizer;
  /** Chunks after a cut (text → tokens, least recently used first). */
  private readonly lru = new Map<string, Uint32Array>();
  /** First chunks of a text (they get the leading-space prefix): a space of their own. */
  private readonly first = new Map<string, Uint32Array>();
  private readonly anchors = new Map<number, number[]>();
  private readonly safeLeft: Uint8Array | undefined;
  private readonly nl: number[];
  private readonly maxBytes: number;
  private readonly chunkChars: number;
  private readonly unsafeCuts: boolean;
  private on: boolean;
  private why: string;
  private bytes = 0;
  private hits = 0;
  private misses = 0;
  private whole = 0;

  constructor(
    readonly model: LlamaModel,
    o: ChunkedTokenizerOptions = {},
  ) {
    this.maxBytes = o.maxBytes ?? DEFAULT_TOKENIZE_CACHE_BYTES;
    this.chunkChars = Math.max(1, o.chunkChars ?? DEFAULT_CHUNK_CHARS);
    this.unsafeCuts = o.unsafeCuts ?? false;
    const cuts = safeCutsOf(model);
    this.safeLeft = 'safeLeft' in cuts ? cuts.safeLeft : undefined;
    this.on = this.maxBytes > 0 && this.safeLeft !== undefined;
    this.why = this.maxBytes <= 0 ? 'cache size 0' : 'why' in cuts ? cuts.why : 'on';
    this.nl = model.tokenize('\n', false) as number[];
    const base = model.tokenizer;
    const tk = (text: string, special?: boolean | 'builtin', options?: TokenizerOption): number[] => {
      if (this.on && special !== true && special !== 'builtin' && text !== '') {
        if (options === undefined) return this.raw(text);
        // node-llama-cpp's own trimLeadingSpace rule for plain text (LlamaModel.tokenize): tokenize
        // "\n" + text and drop the newline's tokens; texts starting with a newline go its own way
        if (options === 'trimLeadingSpace' && !text.startsWith('\n') && this.nl.length > 0) {
          const t = this.raw('\n' + text);
          if (this.nl.every((x, i) => t[i] === x)) return t.slice(this.nl.length);
        }
      }
      return base(text, special as false, options) as number[];
    };
    this.tokenizer = Object.assign(tk, { detokenize: base.detokenize, isSpecialToken: base.isSpecialToken, isEogToken: base.isEogToken }) as unknown as Tokenizer;
  }

  /** Cache figures (see `ChunkCacheStats`). */
  stats(): ChunkCacheStats {
    return { on: this.on, why: this.why, entries: this.lru.size + this.first.size, bytes: this.bytes, maxBytes: this.maxBytes, hits: this.hits, misses: this.misses, whole: this.whole };
  }

  /**
   * Compare chunked with whole tokenization on `samples` (plain runs at the first position and
   * after a special token); on a mismatch the cache turns off for good and the reason is
   * returned (undefined: all equal). Uses a small chunk size so the samples are cut often.
   * `renders`: whole prompts (e.g. a chat rendered by the model's template) tokenized with the
   * tokenizer given, compared the same way.
   */
  selfCheck(samples: readonly string[], renders: readonly ((t: Tokenizer) => number[])[] = []): string | undefined {
    if (!this.on) return undefined;
    const probe = new ChunkedTokenizer(this.model, { maxBytes: 1 << 20, chunkChars: 24, unsafeCuts: this.unsafeCuts });
    for (const s of samples) {
      for (const opt of [undefined, 'trimLeadingSpace'] as const) {
        const want = this.model.tokenizer(s, false, opt) as number[];
        const got = probe.tokenizer(s, false, opt) as number[];
        // twice: the second comes from the cache
        const again = probe.tokenizer(s, false, opt) as number[];
        if (!sameTokens(want, got) || !sameTokens(want, again)) {
          this.on = false;
          this.why = `self-check: chunked tokens differ from whole tokens on a ${s.length}-character sample`;
          return this.why;
        }
      }
    }
    for (const render of renders) {
      if (!sameTokens(render(this.model.tokenizer), render(probe.tokenizer))) {
        this.on = false;
        this.why = 'self-check: a chat rendered by chunks differs from the whole rendering';
        return this.why;
      }
    }
    return undefined;
  }

  /** `model.tokenize(text, false)` by chunks (see the module doc). */
  private raw(text: string): number[] {
    const cuts = this.cutsOf(text);
    if (cuts.length === 0) {
      this.whole++;
      return this.model.tokenize(text, false) as number[];
    }
    const parts: Uint32Array[] = [];
    let n = 0;
    let a = 0;
    for (let k = 0; k <= cuts.length; k++) {
      const b = k < cuts.length ? cuts[k]! : text.length;
      const part = this.chunk(text, a, b);
      if (!part) {
        this.whole++;
        return this.model.tokenize(text, false) as number[];
      }
      parts.push(part);
      n += part.length;
      a = b;
    }
    const out = new Array<number>(n);
    let i = 0;
    for (const part of parts) for (let j = 0; j < part.length; j++) out[i++] = part[j]!;
    return out;
  }

  /** Safe cut positions of `text` (ascending), none when it is too short to be worth cutting. */
  private cutsOf(text: string): number[] {
    const cuts: number[] = [];
    const safe = this.safeLeft!;
    if (text.length < 2 * this.chunkChars) return cuts;
    let p = this.chunkChars;
    while (p < text.length) {
      if (this.unsafeCuts) {
        cuts.push(p);
        p += this.chunkChars;
        continue;
      }
      if (text.charCodeAt(p) === 32) {
        const c = text.charCodeAt(p - 1);
        if (c < 128 && safe[c] === 1) {
          cuts.push(p);
          p += this.chunkChars;
          continue;
        }
      }
      p++;
    }
    return cuts;
  }

  /** Tokens of `text[a, b)` in place (cached), or undefined when its anchor misbehaves. */
  private chunk(text: string, a: number, b: number): Uint32Array | undefined {
    const key = text.slice(a, b);
    const lru = a === 0 ? this.first : this.lru;
    const hit = lru.get(key);
    if (hit) {
      this.hits++;
      lru.delete(key);
      lru.set(key, hit);
      return hit;
    }
    this.misses++;
    let toks: number[];
    if (a === 0 || this.unsafeCuts) toks = this.model.tokenize(text.slice(a, b), false) as number[];
    else {
      const c = text.charCodeAt(a - 1);
      let anchor = this.anchors.get(c);
      if (!anchor) {
        anchor = this.model.tokenize(String.fromCharCode(c), false) as number[];
        this.anchors.set(c, anchor);
      }
      const t = this.model.tokenize(text.slice(a - 1, b), false) as number[];
      for (let i = 0; i < anchor.length; i++) if (t[i] !== anchor[i]) return undefined;
      toks = t.slice(anchor.length);
    }
    const v = Uint32Array.from(toks);
    const size = (b - a) * 2 + v.byteLength + ENTRY_OVERHEAD;
    if (size <= this.maxBytes) {
      // a flat copy: a slice may keep the whole prompt's string alive
      lru.set(Buffer.from(key, 'utf16le').toString('utf16le'), v);
      this.bytes += size;
      // least recently used first, from the map of later chunks, then from the first chunks'
      for (const m of [this.lru, this.first]) {
        for (const [k, old] of m) {
          if (this.bytes <= this.maxBytes) break;
          m.delete(k);
          this.bytes -= k.length * 2 + old.byteLength + ENTRY_OVERHEAD;
        }
      }
    }
    return v;
  }
}

function sameTokens(a: readonly number[], b: readonly number[]): boolean {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
  return true;
}

/**
 * Sample texts for `selfCheck`: prose, code, punctuation runs, several spaces, newlines, digits
 * and non-ASCII characters, each long enough to be cut many times at 24-character chunks.
 */
export function selfCheckSamples(): string[] {
  const prose = 'The agent reads the file, runs the tests, and reports what failed and why. Then it tries again; "quoted" words (and brackets) end here. ';
  const code = 'function add(a, b) {\n  return a + b; // sum\n}\nconst x = add(1, 2) * 3 - 4 / 5;\tif (x >= 0 && y !== null) { print(x); }\n';
  const mixed = 'Ünïcödé text — with dashes, émojis 🙂 and 日本語 words. Tabs\tand  double  spaces   and trailing   \n\n### Human\nTool result 17: exit code 2.\n';
  return [prose.repeat(6), code.repeat(6), mixed.repeat(6), (prose + code + mixed).repeat(3), ' leading space ' + prose.repeat(3)];
}
