/**
 * The node-llama-cpp implementation of the engine seam (types.ts): one model, one context with
 * `sequences` sequences; a slot is one LlamaContextSequence.
 *
 * PD exactness: prefill evaluates the prompt in chunks of `batchSize` and samples the first
 * token from the last chunk without evaluating it; generate() emits that token, evaluates it and
 * samples on. A prefill → saveState → loadState (any process, any sequence count, any slot) →
 * generate run therefore does exactly what prefill → generate on one slot does.
 */
import { randomUUID } from 'node:crypto';
import { systemClock } from '../base/clock.js';
import { closeSync, existsSync, fstatSync, ftruncateSync, openSync, promises as fsp, writeSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import {
  getLlama,
  GgmlType,
  GgufInsights,
  LlamaLogLevel,
  readGgufFileInfo,
  type ChatWrapper,
  type Llama,
  type LlamaContext,
  type LlamaContextSequence,
  type LlamaModel,
  type Token,
  type CustomBatchingPrioritizationStrategy,
} from 'node-llama-cpp';
import { ConfigError, InternalError, PdError } from '../base/errors.js';
import { sha256File } from './gguf-writer.js';
import { inPlaceReframe, parseStateFile, rewriteNStream, type ParsedState } from './ggsq.js';
import { choiceSeed, drawToken, GrammarCache, logprobOf, RequestSampler } from './sampling.js';
import { GrammarThread } from './grammar-thread.js';
import { CONTEXT_TOKENS, TokenRenderer } from './token-text.js';
import { chatWrapperOf, renderChatTokens, tokenizeText } from './prompt.js';
import { installBatchCounter, installStepBarrier, sortQueuedDecodes, StepBarrier } from './step-barrier.js';
import { chooseSequence, evictionsForBudget, exactPrefixAfterPrompt, reusableTokens, type EvictionCause, type PrefixCacheSettings } from './prefix-cache.js';
import { cacheKeyOf, STORE_BLOCK_TOKENS, storeNamespace, type KvCacheEvent, type PrefixStore } from './prefix-store.js';
import type { ChatMessage, Engine, EngineInfo, EvictionNote, FinishReason, FirstToken, GeneratedToken, PrefillResult, Retention, SamplingParams, Slot, TokenLogprob, ToolCallSyntax, ToolFunction } from './types.js';
import { isLazyGrammar } from './types.js';
import { chatFunctionsOf, chatHistoryOf, syntaxIsVisible, toolSyntaxOf } from './tools.js';
import { applyDeviceEnv, checkDeviceMemory, ggmlTypeName, llamaGpuOption, type GpuBackend, type GpuInfo, type GpuLayers, type KvCacheType } from './gpu.js';

/** Options of `loadEngine`. Sizes in tokens. */
export interface LoadEngineOptions {
  modelPath: string;
  /** llama.cpp threads (default 1; the library default of 4 is ~20× slower on 2 cores). */
  threads?: number;
  /** Sequences (slots) of the context, ≥ 1. */
  sequences: number;
  /** Tokens per sequence. */
  contextSize: number;
  /** Prompt chunk size and llama.cpp batch size. */
  batchSize: number;
  /** sha256 of the GGUF (hex); computed at load when absent. */
  fingerprint?: string;
  /** Receives llama.cpp's log lines (level, message) — where the real failure reasons appear. */
  log?: (level: string, msg: string) => void;
  /** Flash attention (changes numerics and the V layout: both PD sides must agree). Default true. */
  flashAttention?: boolean;
  /**
   * Deterministic (batch-invariant) inference, as SGLang's --enable-deterministic-inference and
   * vLLM's batch-invariant mode: each llama.cpp decode call carries one sequence's tokens only,
   * so a sequence's numbers never depend on what else is running. llama.cpp's CPU matmul sums
   * in a different order for a batch of several rows than for one, which on a random-weight
   * model flips greedy choices now and then. Costs the batching speed-up. Default false.
   */
  deterministic?: boolean;
  /** Folder for temporary re-framed state files (default /dev/shm, else the OS temp dir). */
  tmpDir?: string;
  /**
   * Prefix cache (prefix-cache.ts): finished sequences keep their KV, and a prompt sharing a
   * prefix with one evaluates only the rest. `cacheSequences` extra sequences are added to the
   * context so that idle cached prefixes survive while all `sequences` slots are busy;
   * `maxTokens` bounds the tokens idle sequences hold together (eviction in prefix-cache.ts
   * `evictionOrder`); `sessionTtlMs` the retention window of a session's state (default 0).
   * Absent = off: every released slot is cleared.
   */
  prefixCache?: { cacheSequences: number; maxTokens: number; sessionTtlMs?: number };
  /**
   * Second prefix-cache tier (prefix-store.ts; with `prefixCache` only): finished sequences are
   * stored there, and a prompt it serves better than any idle sequence loads its state.
   */
  prefixStore?: PrefixStore;
  /**
   * KV events of the first tier: `stored` when a finished sequence is kept for reuse, `evicted`
   * when a kept one is cleared — keyed as the prefix store keys its entries (prefix-store.ts
   * cacheKeyOf), so one key names a prefix in both tiers. Called synchronously; must not throw.
   */
  onCacheEvent?: (e: KvCacheEvent) => void;
  /**
   * Wait for every generating sequence before each llama_decode (step-barrier.ts): default on
   * when batching (off in deterministic mode, which decodes one sequence per call). `false` only
   * counts the steps (`stepStats`), to compare.
   */
  stepBarrier?: boolean;
  /** GPU backend (gpu.ts): 'off' (default here; the CLI's default is 'auto') = CPU only. */
  gpu?: GpuBackend;
  /** Layers to offload when a device is found (default 'auto': as many as fit). */
  gpuLayers?: GpuLayers;
  /** Device indices this process may use (sets GGML_VK_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES first). */
  gpuDevices?: readonly number[];
  /** K and V cache type (default 'f16'); a quantized V cache needs flash attention. */
  kvCacheType?: KvCacheType;
  /** Time budget of one JSON schema's grammar generation, ms (grammar-thread.ts; default GRAMMAR_BUDGET_MS). */
  grammarBudgetMs?: number;
}

/** The engine's codes (rows of base/errors.ts INTERNAL_TO_API). */
export type EngineErrorCode = 'PROMPT_TOO_LONG' | 'EMPTY_PROMPT' | 'ABORTED' | 'INVALID_TOKEN' | 'SLOT_RELEASED' | 'ENGINE_DISPOSED' | 'GPU_MEMORY' | 'BAD_GRAMMAR';

/** The engine's errors: a stable `code` (EngineErrorCode), mapped to HTTP by base/errors.ts. */
export class EngineError extends PdError {
  constructor(
    public override readonly code: EngineErrorCode,
    message: string,
  ) {
    super(code, message);
    this.name = 'EngineError';
  }
}

// ------------------------------------------------------------------------------- llama singleton

type LogSink = (level: string, msg: string) => void;
const logSinks = new Set<LogSink>();
/** Recent llama.cpp warnings/errors, appended to load errors (the JS error text is generic). */
const recentProblems: Array<{ n: number; msg: string }> = [];
let problemCounter = 0;
/** One llama per backend asked for (a process normally asks for one). */
const llamaPromises = new Map<GpuBackend, Promise<Llama>>();

/**
 * The process's llama for `backend`. One backend per process: node-llama-cpp loads one native
 * binary per backend, and two of them in one process abort inside ggml (measured: a CPU engine,
 * then a Vulkan one — "pre-allocated tensor in a buffer (Vulkan0) that cannot run the operation").
 * @throws Error when another backend was loaded in this process before.
 */
function getSharedLlama(backend: GpuBackend): Promise<Llama> {
  const existing = llamaPromises.get(backend);
  if (existing) return existing;
  const other = [...llamaPromises.keys()][0];
  if (other !== undefined) return Promise.reject(new ConfigError(`--gpu ${backend}: this process already runs --gpu ${other} (one GPU backend per process)`));
  const p = getLlama({
    gpu: llamaGpuOption(backend),
    build: 'never',
    // 0 = no thread budget: each context's `threads` is used exactly.
    maxThreads: 0,
    logLevel: LlamaLogLevel.warn,
    logger: (level, message) => {
      const msg = message.trimEnd();
      if (level === LlamaLogLevel.error || level === LlamaLogLevel.warn || level === LlamaLogLevel.fatal) {
        recentProblems.push({ n: problemCounter++, msg });
        if (recentProblems.length > 20) recentProblems.shift();
      }
      for (const sink of logSinks) {
        try {
          sink(level, msg);
        } catch {
          /* a logger must not break llama.cpp callbacks */
        }
      }
    },
  }).catch((err: unknown) => {
    llamaPromises.delete(backend);
    const name = (err as Error)?.name;
    if (name === 'NoBinaryFoundError') throw new ConfigError(`--gpu ${backend}: node-llama-cpp has no ${backend} build that works on this machine (no driver or device?); use --gpu auto or --gpu off`);
    throw err;
  });
  llamaPromises.set(backend, p);
  return p;
}

/** Append the llama.cpp warnings/errors logged since `since` (a `markProblems()` value) to err. */
function withLlamaLog(err: unknown, since: number): Error {
  const lines = recentProblems.filter((p) => p.n >= since).map((p) => p.msg);
  const e = err instanceof Error ? err : new PdError('engine_failed', String(err));
  if (lines.length > 0) e.message += ` [llama.cpp: ${lines.join(' | ')}]`;
  return e;
}
function markProblems(): number {
  return problemCounter;
}

// ------------------------------------------------------------------------------- text streaming

/**
 * Incremental detokenizer + stop-string filter. Feed tokens one at a time; each call returns the
 * text that is now final. Multi-byte characters split across tokens are held until complete
 * (a trailing U+FFFD from an incomplete UTF-8 sequence is never emitted early); text that could
 * be the start of a stop string is held until disambiguated; the stop string itself and
 * everything after it are never returned.
 */
export class TextStream {
  private tail: number[];
  private pending: number[] = [];
  private pendingEmitted = 0;
  private held = '';
  private readonly stops: string[];
  /** Set once a stop string was found; further pushes return ''. */
  stopped = false;
  /** While false, stop strings are not looked for (min_tokens, as vLLM) and nothing is held. */
  stopsArmed = true;

  /**
   * @param detok detokenizer: (tokens, lastTokens) → text of `tokens` as it reads after `lastTokens`.
   * @param stop stop strings (empty strings are ignored).
   * @param context tokens preceding the generated ones (for SentencePiece leading-space rules).
   */
  constructor(
    private readonly detok: (tokens: number[], lastTokens: number[]) => string,
    stop: readonly string[],
    context: readonly number[] = [],
  ) {
    this.stops = stop.filter((s) => s.length > 0);
    this.tail = context.slice(-16);
  }

  /** Add one token; returns newly final text (possibly ''). */
  push(token: number): string {
    if (this.stopped) return '';
    this.pending.push(token);
    const s = this.detok(this.pending, this.tail);
    let stableEnd = s.length;
    while (stableEnd > 0 && s.charCodeAt(stableEnd - 1) === 0xfffd) stableEnd--;
    // Guard against unbounded re-decoding in long runs of invalid bytes.
    if (this.pending.length > 32) stableEnd = s.length;
    let fresh = '';
    if (stableEnd > this.pendingEmitted) {
      fresh = s.slice(this.pendingEmitted, stableEnd);
      this.pendingEmitted = stableEnd;
    }
    if (stableEnd === s.length) this.commitPending();
    return this.filter(fresh, false);
  }

  /** End of generation (length / EOS): everything still held is final. */
  flush(): string {
    if (this.stopped) return '';
    let rest = '';
    if (this.pending.length > 0) {
      rest = this.detok(this.pending, this.tail).slice(this.pendingEmitted);
      this.commitPending();
    }
    return this.filter(rest, true);
  }

  private commitPending(): void {
    this.tail = this.tail.concat(this.pending).slice(-16);
    this.pending = [];
    this.pendingEmitted = 0;
  }

  private filter(fresh: string, final: boolean): string {
    if (this.stops.length === 0 || (!this.stopsArmed && this.held === '')) return fresh;
    const text = this.held + fresh;
    let cut = -1;
    for (const st of this.stops) {
      const i = text.indexOf(st);
      if (i !== -1 && (cut === -1 || i < cut)) cut = i;
    }
    if (cut !== -1) {
      this.stopped = true;
      this.held = '';
      return text.slice(0, cut);
    }
    if (final) {
      this.held = '';
      return text;
    }
    // hold the longest suffix that is a proper prefix of some stop string
    let hold = 0;
    for (const st of this.stops) {
      for (let k = Math.min(st.length - 1, text.length); k > hold; k--) {
        if (text.endsWith(st.slice(0, k))) {
          hold = k;
          break;
        }
      }
    }
    this.held = text.slice(text.length - hold);
    return text.slice(0, text.length - hold);
  }
}

// ------------------------------------------------------------------------------- engine

function defaultTmpDir(): string {
  return existsSync('/dev/shm') ? '/dev/shm' : os.tmpdir();
}

function sameTokens(a: readonly number[], b: readonly number[]): boolean {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
  return true;
}

/** One sequence of the context; handed out as short-lived `Lease`s. */
class SeqHolder {
  /** Resolves when the previous owner's history is cleared. */
  pending: Promise<void> = Promise.resolve();
  lease: Lease | null = null;
  /** While idle: the tokens whose KV the sequence holds for reuse (empty = none). */
  tokens: readonly number[] = [];
  /** Leading tokens of the held KV that a cold run would compute identically (prefix-cache.ts). */
  exactPrefix = 0;
  lastUsed = 0;
  /** The cache salt of the request whose KV the sequence holds (set at acquisition; prefix-cache.ts). */
  salt: string | undefined = undefined;
  /** While idle: end of the held state's retention window (monotonic ms; prefix-cache.ts); undefined = none. */
  retainUntil: number | undefined = undefined;
  /** While idle: the held state's retention priority (agent_hints.priority). */
  priority: number | undefined = undefined;
  /** The leasing request's retention (set at acquisition, applied at release). */
  retention: Retention | undefined = undefined;
  /** The key of the entry a `stored` KV event announced for this sequence (prefix-store.ts), until its `evicted`. */
  eventKey: { key: string; tokens: number } | undefined;
  /**
   * The sequence's KV is complete for its tokens: set only when a prefill finished (and kept
   * through a generation that ended normally). An abort or error mid-way leaves it false, and
   * release() then clears the sequence, so no later request can reuse a half-written entry.
   */
  valid = false;
  constructor(
    readonly index: number,
    readonly seq: LlamaContextSequence,
  ) {}
}

class Lease implements Slot {
  released = false;
  readonly evicted: EvictionNote[] = [];
  constructor(
    private readonly engine: LlamaEngine,
    private readonly holder: SeqHolder,
  ) {}

  get index(): number {
    return this.holder.index;
  }

  private async ready(): Promise<LlamaContextSequence> {
    this.check();
    await this.holder.pending;
    this.check();
    return this.holder.seq;
  }

  private check(): void {
    if (this.released) throw new EngineError('SLOT_RELEASED', `slot ${this.index} was released`);
    if (this.engine.disposed) throw new EngineError('ENGINE_DISPOSED', 'the engine is disposed');
  }

  async prefill(tokens: number[], sampling: SamplingParams, signal: AbortSignal, choices = 1): Promise<PrefillResult> {
    const { contextSize, batchSize } = this.engine.info.compat;
    if (tokens.length < 1) throw new EngineError('EMPTY_PROMPT', 'the prompt has no tokens');
    const resumed = sampling.resumed ?? [];
    if (tokens.length >= contextSize || tokens.length + sampling.maxTokens > contextSize || resumed.length >= Math.max(1, sampling.maxTokens || contextSize - tokens.length)) {
      throw new EngineError('PROMPT_TOO_LONG', `prompt (${tokens.length} tokens) + max_tokens (${sampling.maxTokens}) exceeds the context size ${contextSize}`);
    }
    const nVocab = this.engine.info.nVocab;
    for (const t of resumed.length ? [...tokens, ...resumed] : tokens) {
      if (!Number.isInteger(t) || t < 0 || t >= nVocab) throw new EngineError('INVALID_TOKEN', `token ${t} is outside the vocabulary (${nVocab})`);
    }
    const grammar = await this.engine.grammars.get(sampling.grammar);
    const seq = await this.ready();
    const holder = this.holder;
    holder.valid = false;
    const cache = this.engine.cache;
    // Re-derived from the sequence itself under this lease: the choice made at acquisition is a hint.
    let reuse = cache.enabled && seq.nextTokenIndex > 0 ? reusableTokens(seq.contextTokens, holder.exactPrefix, tokens, cache.align) : 0;
    let tier: PrefillResult['cacheTier'] = reuse > 0 ? 'sequence' : undefined;
    const stored = await this.engine.loadStored(seq, holder, tokens, reuse);
    this.check();
    if (stored !== undefined) {
      reuse = stored;
      tier = stored > 0 ? 'store' : undefined;
    }
    if (reuse > 0 && seq.nextTokenIndex > reuse) {
      const end = seq.nextTokenIndex;
      await this.engine.exclusive(() => seq.eraseContextTokenRanges([{ start: reuse, end }]));
    }
    if (reuse > 0 && seq.nextTokenIndex !== reuse) reuse = 0; // the library re-evaluated or dropped the cache: start cold
    if (reuse === 0) tier = undefined;
    if (reuse === 0 && seq.nextTokenIndex > 0) await this.engine.exclusive(() => seq.clearHistory());
    const aborted = (): void => {
      if (signal.aborted) throw new EngineError('ABORTED', 'prefill aborted');
      this.check();
    };
    aborted();
    let i = reuse;
    for (; i + batchSize < tokens.length; i += batchSize) {
      await this.engine.gate();
      await seq.evaluateWithoutGeneratingNewTokens(tokens.slice(i, i + batchSize) as Token[]);
      aborted();
    }
    await this.engine.gate();
    let last = tokens.slice(i) as Token[];
    let first: number | undefined;
    let probabilities: Map<Token, number> | undefined;
    const sampler = new RequestSampler(this.engine.model, sampling, tokens, grammar, this.engine.eogTokens, this.engine.toolSyntax);
    if (resumed.length > 0) {
      // A migrated request: the prompt's last chunk, then the tokens generated before, one per
      // call as generation evaluated them (batch shapes change llama.cpp's sums); the sampler
      // accepts each as generated. The next token is sampled after the last of them.
      await seq.evaluateWithoutGeneratingNewTokens(last);
      aborted();
      for (const t of resumed.slice(0, -1)) {
        await this.engine.gate();
        await seq.evaluateWithoutGeneratingNewTokens([t as Token]);
        aborted();
        sampler.accept(t, true);
      }
      await this.engine.gate();
      last = [resumed[resumed.length - 1]! as Token];
      sampler.accept(last[0]!, true);
    }
    const wantLogprobs = sampling.logprobs !== undefined;
    // Sampled requests draw their first token(s) themselves from llama.cpp's final distribution
    // (drawToken): one evaluation then gives n first tokens (n > 1), each with its own seed.
    const draw = sampling.temperature > 0;
    for await (const out of seq.evaluateWithMetadata(last, { probabilities: wantLogprobs || draw }, sampler.options)) {
      first = out.token;
      probabilities = (out as unknown as { probabilities?: Map<Token, number> }).probabilities;
      break;
    }
    if (first === undefined) throw new PdError('engine_failed', 'llama.cpp sampled no token');
    holder.exactPrefix = exactPrefixAfterPrompt(tokens.length, cache.align);
    // The resumed tokens were evaluated one per call, not as a cold prompt's chunks: not a cache entry.
    holder.valid = resumed.length === 0;
    const picks: FirstToken[] = [];
    for (let c = 0; c < Math.max(1, choices); c++) {
      const tok = draw && probabilities ? drawToken(probabilities, choiceSeed(sampling.seed, c)) : first;
      const pick: FirstToken = { firstToken: tok, firstIsEog: this.engine.model.isEogToken(tok as Token) };
      // rendered after the prompt (and a migrated request's earlier tokens), as the text is
      if (wantLogprobs && probabilities) pick.firstLogprob = logprobOf(this.engine.renderer, tok, probabilities, sampling.logprobs!, resumed.length ? [...tokens, ...resumed] : tokens);
      picks.push(pick);
    }
    const res: PrefillResult = { promptTokens: tokens.length + resumed.length, cachedTokens: reuse, ...(tier ? { cacheTier: tier } : {}), ...picks[0]!, choices: picks };
    return res;
  }

  async saveState(filePath: string): Promise<number> {
    const seq = await this.ready();
    const { fileSize } = await seq.saveStateToFile(filePath);
    return fileSize;
  }

  async loadState(filePath: string, promptTokens: number[], parsed?: ParsedState): Promise<void> {
    const seq = await this.ready();
    this.holder.valid = false;
    const { contextSize, nLayer } = this.engine.info.compat;
    // Without the caller's walk, re-validated here: a malformed file can abort the process inside llama.cpp.
    let buf: Buffer | undefined;
    let st = parsed;
    if (!st) {
      buf = await fsp.readFile(filePath);
      st = parseStateFile(buf, { contextSize, nLayer, maxBytes: buf.length, nVocab: this.engine.info.nVocab });
    }
    if (!sameTokens(st.tokens, promptTokens)) throw new PdError('BAD_STATE', 'bad sequence state: the tokens in the state differ from the prompt');
    let loadPath = filePath;
    let tmp: string | null = null;
    const since = markProblems();
    try {
      const nStream = this.engine.info.sequences + this.engine.info.cacheSequences;
      const inPlace = parsed ? inPlaceReframe(st, nStream) : undefined;
      let reframed = false;
      if (inPlace) {
        // The caller's file, already walked: n_stream rewritten and empty streams added/cut where
        // they are — unless another name shares the inode (a hard link, e.g. one state handed to
        // several rooms), whose reader must see the bytes it validated: then copy.
        const fd = openSync(filePath, 'r+');
        try {
          if (fstatSync(fd).nlink === 1) {
            const b = Buffer.alloc(4);
            b.writeUInt32LE(inPlace.nStream, 0);
            writeSync(fd, b, 0, 4, inPlace.nStreamOffset);
            ftruncateSync(fd, inPlace.size);
            reframed = true;
          }
        } finally {
          closeSync(fd);
        }
      }
      if (!reframed && st.nStream !== nStream) {
        buf ??= await fsp.readFile(filePath);
        tmp = path.join(this.engine.tmpDir, `pdserve-restream-${process.pid}-${randomUUID()}.ggsq`);
        await fsp.writeFile(tmp, rewriteNStream(buf, nStream, { contextSize, nLayer, maxBytes: buf.length }));
        loadPath = tmp;
      }
      this.check();
      try {
        await this.engine.exclusive(() => seq.loadStateFromFile(loadPath, { acceptRisk: true }));
      } catch (err) {
        throw withLlamaLog(err, since);
      }
      if (!sameTokens(seq.contextTokens, promptTokens) || seq.nextTokenIndex !== promptTokens.length) {
        await this.engine.exclusive(() => seq.clearHistory());
        throw new PdError('BAD_STATE', 'bad sequence state: the loaded sequence does not hold the prompt');
      }
      // A complete, validated state: with the prefix cache on (decode keeping finished
      // sequences for decode-local continuation) it may be reused once the generation ends
      // normally. Prefill evaluated it in aligned chunks, as a cold run does.
      this.holder.exactPrefix = exactPrefixAfterPrompt(promptTokens.length, this.engine.cache.align);
      this.holder.valid = true;
    } finally {
      if (tmp) await fsp.rm(tmp, { force: true }).catch(() => {});
    }
  }

  /**
   * Turns sampled tokens into their client output, one call per token, with the sequence's
   * current tokens as detokenization context: text (stop strings held back and cut), and the
   * finish reason when generation ends on that token (EOG unless ignoreEos, a stop token id or
   * a stop string — both only after min_tokens — or maxTokens; maxTokens 0 = the rest of the
   * context). generate() and firstOutput() share it, so the first token's output is the same
   * whichever process computes it.
   */
  private stepper(seq: LlamaContextSequence, sampling: SamplingParams): (tok: number) => { out: GeneratedToken; end?: FinishReason } {
    const model = this.engine.model;
    // The sequence holds the prompt here, plus the resumed tokens of a migrated request.
    const resumed = sampling.resumed ?? [];
    const prompt = resumed.length ? seq.contextTokens.slice(0, seq.contextTokens.length - resumed.length) : seq.contextTokens;
    const text = new TextStream((toks, last) => model.detokenize(toks as Token[], false, last as Token[]), sampling.stop, prompt);
    // 0 = the rest of the context
    const maxTokens = Math.max(1, sampling.maxTokens || this.engine.info.compat.contextSize - prompt.length);
    const minTokens = sampling.minTokens ?? 0;
    const stopIds = new Set(sampling.stopTokenIds ?? []);
    // A grammar allows EOG only where its output is complete (json-grammar.ts), so ignore_eos does
    // not hold it open: it could only sample EOG up to max_tokens.
    const grammarEnds = sampling.grammar !== undefined && !isLazyGrammar(sampling.grammar);
    // echo: the prompt's text before token 1's text
    let echo = sampling.echo ? this.engine.detokenize(prompt) : '';
    let count = 0;
    const step = (tok: number): { out: GeneratedToken; end?: FinishReason } => {
      count++;
      const eog = model.isEogToken(tok as Token);
      if (eog && (!sampling.ignoreEos || grammarEnds)) return { out: { token: tok, text: text.flush() }, end: 'stop' };
      if (stopIds.has(tok) && count > minTokens) return { out: { token: tok, text: text.flush() }, end: 'stop' };
      text.stopsArmed = count > minTokens;
      let t = eog ? '' : text.push(tok);
      if (text.stopped) return { out: { token: tok, text: t }, end: 'stop' };
      if (count >= maxTokens) {
        t += text.flush();
        return { out: { token: tok, text: t }, end: text.stopped ? 'stop' : 'length' };
      }
      return { out: { token: tok, text: t } };
    };
    const emit = (tok: number) => {
      const r = step(tok);
      if (echo) {
        r.out.text = echo + r.out.text;
        echo = '';
      }
      return r;
    };
    // A migrated request's earlier tokens: the client has their text; replayed for the text state
    // (held-back stop-string prefixes, SentencePiece context), the count and echo, not emitted.
    for (const t of resumed) if (emit(t).end) throw new EngineError('INVALID_TOKEN', 'the resumed tokens already end the generation');
    return emit;
  }

  async firstOutput(firstToken: number, sampling: SamplingParams): Promise<GeneratedToken & { end?: FinishReason }> {
    const seq = await this.ready();
    const r = this.stepper(seq, sampling)(firstToken);
    return r.end ? { ...r.out, end: r.end } : r.out;
  }

  async *generate(firstToken: number, sampling: SamplingParams, signal: AbortSignal): AsyncGenerator<GeneratedToken, FinishReason | 'abort'> {
    const grammar = await this.engine.grammars.get(sampling.grammar);
    const seq = await this.ready();
    const step = this.stepper(seq, sampling);
    // Rebuilt from the prompt (the sequence holds exactly the prompt here, colocated or after
    // the state load; plus the resumed tokens of a migrated request, accepted as generated) plus
    // the first token: identical in PD and colocated runs.
    const resumed = sampling.resumed ?? [];
    const prompt = resumed.length ? seq.contextTokens.slice(0, seq.contextTokens.length - resumed.length) : seq.contextTokens;
    const sampler = new RequestSampler(this.engine.model, sampling, prompt, grammar, this.engine.eogTokens, this.engine.toolSyntax);
    for (const t of resumed) sampler.accept(t, true);
    if (signal.aborted) return 'abort';
    let r = step(firstToken);
    yield r.out;
    if (r.end) return r.end;
    sampler.accept(firstToken, true);
    const wantLogprobs = sampling.logprobs !== undefined;
    // The tokens before the next one (their last CONTEXT_TOKENS), to render logprob tokens in context.
    let context = wantLogprobs ? [...seq.contextTokens.slice(-CONTEXT_TOKENS), firstToken] : [];
    const it = seq.evaluateWithMetadata([firstToken as Token], { probabilities: wantLogprobs }, sampler.options);
    let ended = false;
    try {
      for (;;) {
        if (signal.aborted || this.released || this.engine.disposed) return 'abort';
        await this.engine.gate();
        if (signal.aborted || this.released || this.engine.disposed) return 'abort';
        const n = await it.next();
        if (signal.aborted || this.released || this.engine.disposed) return 'abort';
        // with yieldEogToken node-llama-cpp ends its generator only when sampling yields nothing
        if (n.done) throw new PdError('engine_failed', 'llama.cpp stopped sampling unexpectedly');
        const tok = n.value.token;
        sampler.accept(tok);
        r = step(tok);
        if (wantLogprobs) {
          r.out.logprob = logprobOf(this.engine.renderer, tok, (n.value as unknown as { probabilities: Map<Token, number> }).probabilities, sampling.logprobs!, context);
          context = [...context.slice(1 - CONTEXT_TOKENS), tok];
        }
        yield r.out;
        if (r.end) {
          ended = true;
          return r.end;
        }
      }
    } finally {
      // A generation cut short (abort, error, consumer gone) does not leave a cache entry, nor
      // does a resumed one (its earlier tokens were evaluated as a prompt's, by prefill).
      if (!ended || resumed.length > 0) this.holder.valid = false;
      await it.return();
    }
  }

  release(): void {
    if (this.released) return;
    this.released = true;
    this.engine.releaseHolder(this.holder, this);
  }
}

class LlamaEngine implements Engine {
  disposed = false;
  private readonly holders: SeqHolder[];
  private readonly free: SeqHolder[];
  private readonly chatWrapper: ChatWrapper;
  /** The chat wrapper's function-call syntax (null: no tool calls). */
  readonly toolSyntax: ToolCallSyntax | null;
  /** Compiled grammars (response_format), shared by all slots. */
  readonly grammars: GrammarCache;
  /** Every end-of-generation token id of the vocabulary (min_tokens bans them). */
  readonly eogTokens: number[];
  /** One llama_decode per step for all generating sequences (step-barrier.ts); null when not installed. */
  private readonly barrier: StepBarrier | null;
  /** Namespace of the KV events' keys (prefix-store.ts storeNamespace). */
  private readonly eventNamespace: string;
  /** Token texts in context, for logprobs. */
  readonly renderer: TokenRenderer;

  constructor(
    readonly info: EngineInfo,
    readonly model: LlamaModel,
    private readonly context: LlamaContext,
    readonly tmpDir: string,
    private readonly logSink: LogSink | null,
    readonly cache: PrefixCacheSettings,
    stepBarrier: 'wait' | 'count' | 'off',
    private readonly store: PrefixStore | null = null,
    private readonly onCacheEvent: ((e: KvCacheEvent) => void) | null = null,
    /** Time budget of one JSON schema's grammar, ms (undefined: GRAMMAR_BUDGET_MS). */
    grammarBudgetMs?: number,
  ) {
    this.eventNamespace = onCacheEvent ? storeNamespace({ fingerprint: info.fingerprint, compat: info.compat, align: cache.align }) : '';
    this.holders = [];
    for (let i = 0; i < info.sequences + info.cacheSequences; i++) this.holders.push(new SeqHolder(i, context.getSequence()));
    const barrier = stepBarrier === 'off' ? null : new StepBarrier(stepBarrier === 'wait', stepBarrier === 'wait' ? () => sortQueuedDecodes(context) : undefined);
    // the batch counter first: without it the barrier would never make a new promise (no step would wait)
    this.barrier = barrier && installBatchCounter(context, barrier) && this.holders.every((h) => installStepBarrier(h.seq, barrier)) ? barrier : null;
    if (barrier && !this.barrier) logSink?.('warn', 'node-llama-cpp has no after-batch hook or batch call: decode steps are not aligned (step-barrier.ts)');
    this.free = [...this.holders];
    this.eogTokens = [];
    for (let t = 0; t < info.nVocab; t++) if (model.isEogToken(t as Token)) this.eogTokens.push(t);
    this.chatWrapper = chatWrapperOf(model);
    const syntax = toolSyntaxOf(this.chatWrapper);
    this.toolSyntax = syntax && syntaxIsVisible(model, syntax) ? syntax : null;
    if (syntax && !this.toolSyntax) logSink?.('warn', `tool calls are off: the chat wrapper's call syntax ${JSON.stringify(syntax.prefix)} contains tokens that are not rendered as text`);
    this.grammars = new GrammarCache(model.llama, this.toolSyntax, new GrammarThread(grammarBudgetMs !== undefined ? { budgetMs: grammarBudgetMs } : {}));
    this.renderer = new TokenRenderer(model);
  }

  tokenize(text: string, addSpecial = true): number[] {
    return tokenizeText(this.model, text, addSpecial);
  }

  tokenPieces(tokens: number[]): string[] {
    const pieces = (this.model.fileInfo.metadata as unknown as { tokenizer?: { ggml?: { tokens?: unknown[] } } }).tokenizer?.ggml?.tokens ?? [];
    return tokens.map((t) => (typeof pieces[t] === 'string' ? (pieces[t] as string) : this.detokenize([t])));
  }

  renderChat(messages: ChatMessage[], tools?: readonly ToolFunction[]): number[] {
    return renderChatTokens(this.model, this.chatWrapper, messages, tools);
  }

  detokenize(tokens: number[]): string {
    // Like llama.cpp with remove_special: a leading BOS is dropped, so the SentencePiece space
    // prefix of the first word is removed and detokenize(tokenize(s)) === s for plain text.
    const bos = this.model.tokens.bos;
    const start = bos != null && tokens[0] === bos ? 1 : 0;
    return this.model.detokenize((start ? tokens.slice(start) : tokens) as Token[], false);
  }

  async prepareSampling(sampling: SamplingParams): Promise<void> {
    await this.grammars.get(sampling.grammar);
  }

  slotsFree(): number {
    if (this.disposed) return 0;
    const busy = this.holders.length - this.free.length;
    return Math.max(0, Math.min(this.free.length, this.info.sequences - busy));
  }

  tryAcquireSlot(prompt?: readonly number[], salt?: string, retention?: Retention): Slot | null {
    if (this.slotsFree() === 0) return null;
    // The idle sequence with the longest reusable prefix; else an empty one, else a cached one
    // (its cache is dropped) — next to the busy ones where possible (one ubatch per run of
    // consecutive sequence ids), then lowest index / least recently used.
    const busy = new Set<number>();
    for (const h of this.holders) if (h.lease) busy.add(h.index);
    const choice = chooseSequence(this.free, prompt, this.cache, busy, salt, systemClock.nowMs())!;
    const holder = choice.seq;
    this.free.splice(this.free.indexOf(holder), 1);
    const lease = new Lease(this, holder);
    if (choice.evicts && holder.tokens.length > 0) {
      // an eviction (counted with its cause): dropped whole, or cut back to what this prompt shares
      // with it (prefill erases the rest) — written back to the store first either way
      lease.evicted.push(this.noteEviction(choice.evicts, holder.tokens.length));
      if (choice.reuse === 0) this.clearHolder(holder, choice.evicts);
      else this.writeBack(holder, choice.evicts);
    } else if ((choice.reuse === 0 || holder.salt !== salt) && holder.tokens.length > 0) {
      // cleared (and written back under its own salt) before it takes this request's
      this.clearHolder(holder);
    }
    holder.salt = salt;
    holder.tokens = [];
    holder.retainUntil = undefined;
    holder.priority = undefined;
    holder.retention = retention;
    holder.lease = lease;
    return lease;
  }

  reusableFor(prompt: readonly number[], salt?: string, heldOnly = false): number {
    if (this.disposed || !this.cache.enabled || prompt.length === 0) return 0;
    const c = chooseSequence(this.free, prompt, this.cache, undefined, salt, systemClock.nowMs());
    return !c || (heldOnly && c.evicts) ? 0 : c.reuse;
  }

  async storedReusableFor(prompt: readonly number[], salt?: string): Promise<number> {
    if (this.disposed || !this.store || !this.cache.enabled || prompt.length === 0) return 0;
    return this.store.reusable(prompt, salt);
  }

  /**
   * The prefix store's turn (second tier) for a prompt the leased sequence serves `minReuse`
   * tokens of: when a stored state serves more, it is loaded into `seq` (which then holds it
   * whole; prefill erases past the reuse). @returns the reuse it gives, 0 when the load failed
   * (the sequence is cleared: start cold), undefined when the store had nothing better (the
   * sequence is untouched).
   */
  async loadStored(seq: LlamaContextSequence, holder: SeqHolder, prompt: readonly number[], minReuse: number): Promise<number | undefined> {
    if (!this.store || !this.cache.enabled || this.disposed) return undefined;
    const hit = await this.store.take(prompt, minReuse, holder.salt);
    if (!hit) return undefined;
    const since = markProblems();
    try {
      if (this.disposed || seq.disposed) return 0;
      await this.exclusive(() => seq.loadStateFromFile(hit.path, { acceptRisk: true }));
      if (!sameTokens(seq.contextTokens, hit.tokens)) throw new PdError('BAD_STATE', 'the loaded sequence does not hold the stored tokens');
      holder.exactPrefix = hit.exactPrefix;
      return hit.reuse;
    } catch (err) {
      this.logSink?.('warn', `prefix store: loading a validated entry failed, evaluating cold: ${withLlamaLog(err, since).message}`);
      if (!this.disposed && !seq.disposed) await this.exclusive(() => seq.clearHistory()).catch(() => {});
      return 0;
    } finally {
      await hit.done();
    }
  }

  /** The first tier's `stored` event for a kept sequence (and `evicted` for what it held before under another key). */
  private announceStored(holder: SeqHolder): void {
    if (!this.onCacheEvent) return;
    const named = cacheKeyOf(this.eventNamespace, holder.tokens, holder.exactPrefix, this.cache.align, this.cache.align ?? STORE_BLOCK_TOKENS);
    if (holder.eventKey && holder.eventKey.key !== named?.key) this.announceEvicted(holder);
    if (!named || holder.eventKey?.key === named.key) return;
    holder.eventKey = named;
    this.onCacheEvent({ kind: 'stored', tier: 'sequence', key: named.key, tokens: named.tokens, bytes: 0 });
  }

  private announceEvicted(holder: SeqHolder): void {
    const k = holder.eventKey;
    if (!k || !this.onCacheEvent) return;
    holder.eventKey = undefined;
    this.onCacheEvent({ kind: 'evicted', tier: 'sequence', key: k.key, tokens: k.tokens, bytes: 0 });
  }

  /**
   * Store a kept sequence's state as it is evicted (queued on the sequence before its clear: the
   * next user waits for the save, not for the file's publication). Write-back, as llama.cpp
   * server's `--cache-ram` saves a slot before overwriting it: a save pauses every stream of the
   * context (tens of MB for a long conversation on the small model), and while the sequence
   * tier holds a conversation its file would serve nobody.
   */
  private storeSave(holder: SeqHolder): void {
    const store = this.store;
    if (!store) return;
    const tokens = holder.tokens;
    // begun now, so that a lookup of this prefix (the conversation's next round) waits for it
    const started = store.begin(tokens, holder.exactPrefix, holder.salt);
    holder.pending = holder.pending
      .then(async () => {
        const w = await started;
        if (!w) return;
        try {
          if (this.disposed || holder.seq.disposed) throw new EngineError('ENGINE_DISPOSED', 'the engine is disposed');
          if (!sameTokens(holder.seq.contextTokens, tokens)) throw new InternalError('the sequence changed before its save');
          await this.exclusive(() => holder.seq.saveStateToFile(w.path));
        } catch (err) {
          await w.abort();
          this.logSink?.('warn', `prefix store: saving slot ${holder.index} failed: ${String(err)}`);
          return;
        }
        void w.commit();
      })
      .catch((err: unknown) => this.logSink?.('error', `prefix store: slot ${holder.index}: ${String(err)}`));
  }

  stepStats(): { steps: number; sequences: number } | null {
    return this.barrier ? { steps: this.barrier.steps, sequences: this.barrier.sequences } : null;
  }

  async gpuMemory(): Promise<{ totalBytes: number; usedBytes: number }> {
    if (this.info.gpu.devices.length === 0 || this.disposed) return { totalBytes: 0, usedBytes: 0 };
    const v = await this.model.llama.getVramState();
    return { totalBytes: v.total, usedBytes: v.used };
  }

  /** Tokens held by idle sequences for reuse, and how many sequences hold them. */
  cachedStats(): { sequences: number; tokens: number } {
    let sequences = 0;
    let tokens = 0;
    for (const h of this.free) {
      if (h.tokens.length === 0) continue;
      sequences++;
      tokens += h.tokens.length;
    }
    return { sequences, tokens };
  }

  /** Sequence-tier evictions since load, by cause. */
  private readonly evictions = new Map<EvictionCause, { count: number; tokens: number }>();

  /** Count one sequence-tier eviction; @returns its note for the request's trace. */
  private noteEviction(cause: EvictionCause, tokens: number): EvictionNote {
    const e = this.evictions.get(cause) ?? { count: 0, tokens: 0 };
    e.count++;
    e.tokens += tokens;
    this.evictions.set(cause, e);
    return { tier: 'sequence', cause, tokens };
  }

  evictionStats(): { tier: 'sequence' | 'store'; cause: EvictionCause; count: number; tokens: number }[] {
    const out: { tier: 'sequence' | 'store'; cause: EvictionCause; count: number; tokens: number }[] = [...this.evictions].map(([cause, e]) => ({ tier: 'sequence', cause, ...e }));
    for (const e of this.store?.evictionStats?.() ?? []) out.push({ tier: 'store', cause: e.cause, count: e.count, tokens: 0 });
    return out;
  }

  /**
   * The sequence tier lets a held state go: its `evicted` event, and the write-back to the
   * prefix store — except for a superseded state (another held state covers it: a file of it
   * would serve nobody).
   */
  private writeBack(holder: SeqHolder, cause?: EvictionCause): void {
    this.announceEvicted(holder);
    if (holder.valid && holder.tokens.length > 0 && cause !== 'superseded') this.storeSave(holder);
  }

  /** Drop a sequence's KV (queued behind its previous clear; ready() waits for it). `cause`: an eviction's (see writeBack). */
  private clearHolder(holder: SeqHolder, cause?: EvictionCause): void {
    this.writeBack(holder, cause);
    holder.tokens = [];
    holder.retainUntil = undefined;
    holder.priority = undefined;
    holder.exactPrefix = 0;
    holder.valid = false;
    holder.pending = holder.pending
      .then(() => (this.disposed || holder.seq.disposed ? undefined : this.exclusive(() => holder.seq.clearHistory())))
      .catch((err: unknown) => this.logSink?.('error', `clearHistory of slot ${holder.index} failed: ${String(err)}`));
  }

  /** Exclusive operations (state load, history clear) waiting for or holding the context lock. */
  private exclusivePending = 0;
  private gateWaiters: (() => void)[] = [];

  /**
   * Run `fn`, which needs node-llama-cpp's context lock (loadStateFromFile, clearHistory), while
   * token generation and prompt chunks pause at their next boundary. node-llama-cpp's batch
   * dispatcher keeps that lock for as long as any sequence has a decode queued, so without the
   * pause a state load on a busy decode worker waits until every running stream has finished.
   */
  async exclusive<T>(fn: () => Promise<T>): Promise<T> {
    this.exclusivePending++;
    try {
      return await fn();
    } finally {
      if (--this.exclusivePending === 0) {
        const waiters = this.gateWaiters;
        this.gateWaiters = [];
        for (const w of waiters) w();
      }
    }
  }

  /** Resolves at once, or when no exclusive operation is pending any more. */
  gate(): Promise<void> {
    if (this.exclusivePending === 0) return Promise.resolve();
    return new Promise((resolve) => this.gateWaiters.push(resolve));
  }

  /** @internal called by Lease.release(): clear the history, then the slot is free again. */
  releaseHolder(holder: SeqHolder, lease: Lease): void {
    if (holder.lease !== lease) return;
    holder.lease = null;
    const keep = this.cache.enabled && holder.valid && !this.disposed && !holder.seq.disposed && holder.seq.nextTokenIndex > 0;
    const now = systemClock.nowMs();
    if (keep) {
      holder.tokens = holder.seq.contextTokens;
      holder.exactPrefix = Math.min(holder.exactPrefix, holder.tokens.length);
      holder.lastUsed = now;
      const r = holder.retention;
      const ttl = r?.ttlMs ?? (r?.session || r?.priority !== undefined ? (this.cache.sessionTtlMs ?? 0) : 0);
      holder.retainUntil = ttl > 0 ? now + ttl : undefined;
      holder.priority = r?.priority;
      this.announceStored(holder);
    } else {
      this.clearHolder(holder);
    }
    holder.retention = undefined;
    this.free.push(holder);
    for (const e of evictionsForBudget(this.free, this.cache.maxTokens, now, this.cache.align)) {
      lease.evicted.push(this.noteEviction(e.cause, e.seq.tokens.length));
      this.clearHolder(e.seq, e.cause);
    }
  }

  async dispose(): Promise<void> {
    if (this.disposed) return;
    this.disposed = true;
    this.free.length = 0;
    if (this.logSink) logSinks.delete(this.logSink);
    await this.grammars.close();
    await this.context.dispose();
    await this.model.dispose();
    await this.store?.close?.(); // no write of this engine can start now
  }
}

/** Batch prioritization for deterministic mode: only the oldest queued item, up to the batch size. */
const oneSequencePerBatch: CustomBatchingPrioritizationStrategy = ({ items, size }) => {
  const first = items[0];
  return first ? [{ item: first, processAmount: Math.min(first.tokens.length, size) }] : [];
};

/** Longest vocabulary piece in UTF-8 bytes (byte tokens "<0xNN>" count 1); 64 when unknown. */
function maxPieceBytes(pieces: unknown[] | undefined): number {
  if (!pieces?.length) return 64;
  let max = 1;
  for (const p of pieces) {
    if (typeof p !== 'string' || /^<0x[0-9A-Fa-f]{2}>$/.test(p)) continue;
    const n = Buffer.byteLength(p, 'utf8');
    if (n > max) max = n;
  }
  return max;
}

/**
 * Load a GGUF and create one context with `sequences` sequences of `contextSize` tokens.
 * @returns the Engine; `info.fingerprint` is the GGUF's sha256 (computed unless given).
 * @throws Error when the model or context cannot be created (llama.cpp's log lines are appended).
 */
export async function loadEngine(opts: LoadEngineOptions): Promise<Engine> {
  const threads = opts.threads ?? 1;
  if (!Number.isInteger(threads) || threads < 1) throw new RangeError('threads must be a positive integer');
  if (!Number.isInteger(opts.sequences) || opts.sequences < 1) throw new RangeError('sequences must be a positive integer');
  if (!Number.isInteger(opts.contextSize) || opts.contextSize < 1) throw new RangeError('contextSize must be a positive integer');
  if (!Number.isInteger(opts.batchSize) || opts.batchSize < 1) throw new RangeError('batchSize must be a positive integer');
  const modelPath = path.resolve(opts.modelPath);
  const sink = opts.log ?? null;
  if (sink) logSinks.add(sink);
  const since = markProblems();
  let model: LlamaModel | null = null;
  try {
    const backend = opts.gpu ?? 'off';
    const flashAttention = opts.flashAttention ?? true;
    const kvCacheType = opts.kvCacheType ?? 'f16';
    // llama.cpp refuses a quantized V cache without flash attention (llama_init_from_model).
    if (kvCacheType !== 'f16' && !flashAttention) throw new RangeError(`--kv-cache-type ${kvCacheType} needs flash attention (drop --no-flash-attention)`);
    applyDeviceEnv(backend, opts.gpuDevices);
    const llama = await getSharedLlama(backend);
    const fingerprint = opts.fingerprint ?? (await sha256File(modelPath));
    const devices = llama.supportsGpuOffloading ? await llama.getGpuDeviceNames() : [];
    if (devices.length === 0 && backend !== 'auto' && backend !== 'off' && opts.gpuLayers !== 0) {
      const hint = backend === 'vulkan' ? ' (a CPU-type Vulkan device such as lavapipe is used only when named: --gpu-device 0)' : '';
      throw new ConfigError(`--gpu ${backend}: the ${llama.gpu || backend} backend found no device${hint}; use --gpu auto (CPU fallback) or --gpu off`);
    }
    const kvType = GgmlType[ggmlTypeName(kvCacheType)];
    const cacheSequences = devices.length > 0 ? await fitOnDevice(llama, modelPath, opts, kvType) : (opts.prefixCache?.cacheSequences ?? 0);
    if (cacheSequences < (opts.prefixCache?.cacheSequences ?? 0)) sink?.('warn', `prefix cache: ${cacheSequences} of ${opts.prefixCache!.cacheSequences} cache sequences fit the device memory`);
    try {
      model = await llama.loadModel({ modelPath, gpuLayers: devices.length > 0 ? (opts.gpuLayers ?? 'auto') : 0 });
    } catch (err) {
      throw withLlamaLog(err, since);
    }
    let context: LlamaContext;
    // node-llama-cpp's default dispatch schedule ("nextCycle": setImmediate), with the queue put in
    // sequence order first, so the first dispatch after an idle spell is sorted as well (the
    // dispatcher's own loop sorts at the step barrier: step-barrier.ts)
    const created: { context?: LlamaContext } = {};
    const sortedNextCycle = (dispatch: () => void): void => {
      setImmediate(() => {
        if (created.context) sortQueuedDecodes(created.context);
        dispatch();
      });
    };
    try {
      context = await model.createContext({
        sequences: opts.sequences + cacheSequences,
        contextSize: opts.contextSize,
        batchSize: opts.batchSize,
        threads,
        flashAttention,
        // 3.21.1 passes these to llama.cpp only as GgmlType values or enum keys ('Q8_0').
        experimentalKvCacheKeyType: kvType,
        experimentalKvCacheValueType: kvType,
        failedCreationRemedy: false,
        batching: opts.deterministic ? { itemPrioritizationStrategy: oneSequencePerBatch } : opts.stepBarrier === false ? {} : { dispatchSchedule: sortedNextCycle },
      });
    } catch (err) {
      throw withLlamaLog(err, since);
    }
    created.context = context;
    const meta = model.fileInfo.architectureMetadata as { block_count?: number };
    const tokensMeta = (model.fileInfo.metadata as unknown as { tokenizer?: { ggml?: { tokens?: unknown[] } } }).tokenizer?.ggml?.tokens;
    const vram = devices.length > 0 ? await llama.getVramState() : null;
    const gpu: GpuInfo = { requested: backend, backend: llama.gpu || null, devices, offloadedLayers: model.gpuLayers, totalLayers: model.fileInsights.totalLayers, vramTotalBytes: vram?.total ?? 0 };
    const info: EngineInfo = {
      modelPath,
      modelName: path.basename(modelPath).replace(/\.gguf$/i, ''),
      fingerprint,
      compat: { contextSize: context.contextSize, batchSize: context.batchSize, nLayer: Number(meta.block_count ?? 0), flashAttention, kvCacheType },
      sequences: opts.sequences,
      cacheSequences,
      nVocab: tokensMeta?.length ?? 0,
      maxTokenBytes: maxPieceBytes(tokensMeta),
      threads,
      gpu,
    };
    if (info.compat.contextSize !== opts.contextSize) {
      // llama.cpp may round the context size up; PD compat needs the real value, which info carries.
      sink?.('warn', `context size ${opts.contextSize} was rounded to ${info.compat.contextSize}`);
    }
    const cache: PrefixCacheSettings = {
      enabled: opts.prefixCache !== undefined,
      align: opts.deterministic ? context.batchSize : null,
      maxTokens: opts.prefixCache?.maxTokens ?? 0,
      sessionTtlMs: opts.prefixCache?.sessionTtlMs ?? 0,
    };
    const barrier = opts.deterministic ? 'off' : opts.stepBarrier === false ? 'count' : 'wait';
    const store = cache.enabled ? (opts.prefixStore ?? null) : null;
    store?.bind({ fingerprint, compat: info.compat, nVocab: info.nVocab, nStream: opts.sequences + cacheSequences, align: cache.align });
    return new LlamaEngine(info, model, context, opts.tmpDir ?? defaultTmpDir(), sink, cache, barrier, store, cache.enabled ? (opts.onCacheEvent ?? null) : null, opts.grammarBudgetMs);
  } catch (err) {
    if (sink) logSinks.delete(sink);
    await model?.dispose().catch(() => {});
    throw err;
  }
}

/**
 * Before loading on a device: resolve the layers to offload (node-llama-cpp's fit for 'auto'),
 * estimate the device bytes of the model and of the context (node-llama-cpp's estimators) and
 * check they fit the free device memory (gpu.ts checkDeviceMemory).
 * @returns the prefix-cache sequences that fit (≤ opts.prefixCache.cacheSequences).
 * @throws Error (code 'GPU_MEMORY') naming the sizes and the flags to change.
 */
async function fitOnDevice(llama: Llama, modelPath: string, opts: LoadEngineOptions, kvType: GgmlType): Promise<number> {
  const insights = await GgufInsights.from(await readGgufFileInfo(modelPath), llama);
  const flashAttention = opts.flashAttention ?? true;
  const asked = opts.gpuLayers ?? 'auto';
  // The formula estimators (not the *V2 ones): V2 simulates by creating the context on the
  // device, and llama.cpp aborted the process (GGML_ASSERT) for a context that did not fit.
  let layers: number;
  try {
    layers = await insights.configurationResolver.resolveModelGpuLayers(asked, { defaultContextFlashAttention: flashAttention, defaultContextKvCacheKeyType: kvType, defaultContextKvCacheValueType: kvType });
  } catch {
    // 'max' or N that node-llama-cpp finds too big: checkDeviceMemory below names the sizes.
    layers = typeof asked === 'number' ? Math.min(asked, insights.totalLayers) : insights.totalLayers;
  }
  const cache = opts.prefixCache?.cacheSequences ?? 0;
  const ctxBytes = (sequences: number): number =>
    insights.estimateContextResourceRequirements({ contextSize: opts.contextSize, modelGpuLayers: layers, batchSize: opts.batchSize, sequences, flashAttention, kvCacheKeyType: kvType, kvCacheValueType: kvType }).gpuVram;
  const slotsContextBytes = ctxBytes(opts.sequences);
  const vram = await llama.getVramState();
  return checkDeviceMemory({
    modelBytes: insights.estimateModelResourceRequirements({ gpuLayers: layers }).gpuVram,
    slotsContextBytes,
    perCacheSequenceBytes: cache > 0 ? (ctxBytes(opts.sequences + cache) - slotsContextBytes) / cache : 0,
    slots: opts.sequences,
    cacheSequences: cache,
    freeBytes: Math.max(0, vram.free - llama.vramPaddingSize),
    totalBytes: vram.total,
    contextSize: opts.contextSize,
  });
}
