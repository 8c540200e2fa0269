/**
 * The router's own tokenizer: a request's prompt as the workers will tokenize it, so the picker
 * matches real token blocks (../protocol/token-blocks.ts) against what each worker holds and
 * counts exactly what a decode lacks. The same functions as the workers (../engine/prompt.ts,
 * through ../engine/tokenizer-thread.ts: a vocabulary-only load of the same GGUF on a worker
 * thread, off the router's event loop), fed the same wire body (../api/parse.ts
 * `toWorkerRequest`, ../api/requests.ts `chatMessageOf`): same template, same BOS rule, same tokens.
 *
 * | setting | meaning |
 * |---|---|
 * | model | the GGUF path (`pdserve router --model`; `up` passes its own). None: no exact routing — the picker falls back to the approximate tree and never sends decode-local |
 * | bound | at most `maxPending` prompts queued (more: that request routes without tokens) |
 * | deadline | `timeoutMs` per prompt (over: that request routes without tokens) |
 * | chunk cache | `cacheBytes` (`--tokenize-cache-mib`): long prompts tokenized by cached chunks, exactly (../engine/token-chunks.ts: on after a self-check, else whole) |
 *
 * A prompt it cannot tokenize (queue full, deadline, thread gone, a template error) is routed
 * without tokens, never failed: the worker answers the client's error itself. Metrics:
 * pdserve_router_tokenize_seconds (the thread's round trip per request; the picker's block hashing
 * after it is O(tokens), `pdserve bench-route-tokens` measures both), and
 * pdserve_router_tokenize_total{outcome: ok | skipped | failed}.
 */
import { Counter, Histogram, type Registry } from 'prom-client';
import { TokenizerThread, type TokenizerThreadStats } from '../engine/tokenizer-thread.js';
import { DEFAULT_TOKENIZE_CACHE_BYTES, type ChunkCacheStats } from '../engine/token-chunks.js';
import { toWorkerRequest, type ParsedRequest } from '../api/parse.js';
import { chatMessageOf } from '../api/requests.js';
import { newRoomId } from '../base/room-id.js';
import { systemClock } from '../base/clock.js';

/** Default most prompts queued on the router's tokenizer thread. */
export const ROUTER_TOKENIZE_MAX_PENDING = 256;
/** Default deadline of one prompt's tokens, ms. */
export const ROUTER_TOKENIZE_TIMEOUT_MS = 500;

export interface RouterTokenizerOptions {
  maxPending?: number;
  timeoutMs?: number;
  /** Bound of the thread's chunk cache, bytes; default DEFAULT_TOKENIZE_CACHE_BYTES, 0 = off. */
  cacheBytes?: number;
  registry: Registry;
}

/** See the module doc. `close()` ends the thread. */
export class RouterTokenizer {
  private readonly thread: TokenizerThread;
  private readonly seconds: Histogram;
  private readonly outcomes: Counter<'outcome'>;
  private ready = false;

  constructor(readonly modelPath: string, o: RouterTokenizerOptions) {
    this.thread = new TokenizerThread(modelPath, { maxPending: o.maxPending ?? ROUTER_TOKENIZE_MAX_PENDING, timeoutMs: o.timeoutMs ?? ROUTER_TOKENIZE_TIMEOUT_MS, cacheBytes: o.cacheBytes ?? DEFAULT_TOKENIZE_CACHE_BYTES });
    this.seconds = new Histogram({ name: 'pdserve_router_tokenize_seconds', help: 'Time the router took to tokenize a prompt as the workers do (exact routing), per request', buckets: [0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5], registers: [o.registry] });
    this.outcomes = new Counter({ name: 'pdserve_router_tokenize_total', help: 'Prompts the router tokenized for exact routing, by outcome (ok; skipped: no tokenizer thread; failed: queue full, deadline, or an error — routed without tokens)', labelNames: ['outcome'], registers: [o.registry] });
    for (const outcome of ['ok', 'skipped', 'failed']) this.outcomes.labels(outcome).inc(0);
  }

  /** Load the vocabulary now (a failure is logged by the caller; later calls route without tokens). */
  async start(): Promise<void> {
    await this.thread.start();
    this.ready = true;
  }

  /**
   * The prompt tokens of `parsed` as a worker computes them (input ids as given; else the
   * thread's Uint32Array, not copied), or undefined when they cannot be had within the bound and
   * deadline (see the module doc). Never rejects.
   */
  async tokensOf(parsed: ParsedRequest): Promise<ArrayLike<number> | undefined> {
    // not loaded (yet, or ever): route without tokens rather than wait for the vocabulary
    if (!this.ready || !this.thread.available) {
      this.outcomes.labels('skipped').inc();
      return undefined;
    }
    const t0 = systemClock.nowMs();
    try {
      const body = toWorkerRequest(parsed, { rid: '', bootstrapHost: '', bootstrapPort: 0, bootstrapRoom: newRoomId() });
      const tokens = body.input_ids ? [...body.input_ids] : body.messages ? await this.thread.renderChatTyped(body.messages.map(chatMessageOf), body.tools) : await this.thread.tokenizeTyped(body.text ?? '');
      this.seconds.observe((systemClock.nowMs() - t0) / 1000);
      this.outcomes.labels('ok').inc();
      return tokens;
    } catch {
      this.outcomes.labels('failed').inc();
      return undefined;
    }
  }

  /** The chunk cache's state after the thread's self-check (undefined before it started). */
  get cache(): ChunkCacheStats | undefined {
    return this.thread.cache;
  }

  /** The chunk cache's figures now and the thread's heap (benchmarks; `gc`: after a full collection). @throws PdError as `TokenizerThread.stats`. */
  stats(gc = false): Promise<TokenizerThreadStats> {
    return this.thread.stats(gc);
  }

  /** End the thread (see `TokenizerThread.close`). */
  close(): Promise<void> {
    return this.thread.close();
  }
}
