/**
 * Prompt tokenization off the event loop, so a large prompt cannot stall heartbeats: rendering a chat template and
 * tokenizing are synchronous in node-llama-cpp, and an accepted prompt may be as large as
 * context × longest vocabulary piece bytes (about 1 MiB for an 8k context and a real vocabulary:
 * hundreds of ms of blocked loop). A worker thread holding the model's vocabulary only
 * (`vocabOnly`) does that work with the engine's own functions (./prompt.ts), so the tokens are
 * the same and the worker's loop keeps serving heartbeats and streams meanwhile.
 *
 * Bounded: at most `maxPending` prompts queued (more → PdError QUEUE_FULL, 503), each answered
 * within `timeoutMs` (else PdError TIMEOUT for that caller). A thread that dies fails what it held
 * (engine_failed) and is started again on the next call, at most `maxStarts` times per process
 * (each start is a new llama.cpp instance); after that `available` is false and callers tokenize
 * on their own loop. Closing never cuts the thread inside node-llama-cpp: `close` raises a shared
 * stop flag (queued prompts are skipped), the thread disposes its model and llama.cpp instance
 * and says so, and only then is it terminated — terminating threads whose instance was not
 * disposed aborted the process after 10–18 cycles ("terminate called after throwing an instance
 * of 'Napi::Error'", reproduced; 30 cycles clean with the dispose).
 */
import type { Worker } from 'node:worker_threads';
import { PdError } from '../base/errors.js';
import { startWorkerThread } from './worker-thread.js';
import type { ChatMessage, ToolFunction } from './types.js';
import type { ChunkCacheStats } from './token-chunks.js';

/** One request to the thread; `stop` asks it to answer `{stopped: true}` once idle. */
export type TokenizeJob = { id: number; kind: 'text'; text: string; addSpecial: boolean } | { id: number; kind: 'chat'; messages: ChatMessage[]; tools?: ToolFunction[] } | { id: number; kind: 'stats'; gc: boolean } | { id: number; kind: 'stop' };

/** The chunk cache's figures and the thread's V8 heap in use plus its external memory (typed arrays), bytes. */
export type TokenizerThreadStats = ChunkCacheStats & { heapUsed: number };

type Reply = { stopped: true } | { cache: ChunkCacheStats } | { id: number; tokens: Uint32Array } | { id: number; stats: TokenizerThreadStats } | { id: number; error: string };

export interface TokenizerThreadOptions {
  /** Most prompts queued or in work at once. Default 64. */
  maxPending?: number;
  /** Longest wait for one prompt's tokens, ms (queue included). Default 30_000. */
  timeoutMs?: number;
  /** Longest wait for the thread to load the vocabulary, ms. Default 60_000. */
  startTimeoutMs?: number;
  /** Most thread starts in this process (restarts after a thread died included). Default 3. */
  maxStarts?: number;
  /** Bound of the thread's chunk cache (./token-chunks.ts), bytes; 0 (default): prompts tokenized whole. */
  cacheBytes?: number;
}

interface Pending {
  resolve: (v: never) => void;
  /** Resolve with the thread's Uint32Array as it came (no copy into an array). */
  typed: boolean;
  reject: (err: Error) => void;
  timer: NodeJS.Timeout;
}

export class TokenizerThread {
  private worker: Worker | undefined;
  /** Shared with the thread: 1 = skip queued prompts (closing). */
  private stopFlag = new Int32Array(new SharedArrayBuffer(4));
  private onStopped: (() => void) | undefined;
  private ready: Promise<void> | undefined;
  private readonly pending = new Map<number, Pending>();
  private seq = 0;
  private closed = false;
  private readonly maxPending: number;
  private readonly timeoutMs: number;
  private readonly startTimeoutMs: number;
  private readonly maxStarts: number;
  private starts = 0;
  private readonly cacheBytes: number;
  /** The chunk cache's state as the thread reported it at its last start (after its self-check). */
  cache: ChunkCacheStats | undefined;

  constructor(
    /** The GGUF whose vocabulary is loaded (the engine's model file). */
    readonly modelPath: string,
    opts: TokenizerThreadOptions = {},
  ) {
    this.maxPending = opts.maxPending ?? 64;
    this.timeoutMs = opts.timeoutMs ?? 30_000;
    this.startTimeoutMs = opts.startTimeoutMs ?? 60_000;
    this.maxStarts = opts.maxStarts ?? 3;
    this.cacheBytes = opts.cacheBytes ?? 0;
  }

  /** False once closed or out of starts: tokenize on the caller's loop instead. */
  get available(): boolean {
    return !this.closed && (this.worker !== undefined || this.starts < this.maxStarts);
  }

  /** Start the thread and wait until its vocabulary is loaded. @throws Error when it cannot start. */
  start(): Promise<void> {
    if (this.closed) return Promise.reject(new PdError('engine_failed', 'tokenizer thread closed'));
    if (this.ready) return this.ready;
    if (this.starts >= this.maxStarts) return Promise.reject(new PdError('engine_failed', `tokenizer thread unavailable (started ${this.starts} times)`));
    this.starts++;
    const { worker, ready } = startWorkerThread<Reply>({
      entry: 'tokenizer-worker',
      base: import.meta.url,
      label: 'tokenizer thread',
      workerData: { modelPath: this.modelPath, stop: this.stopFlag, cacheBytes: this.cacheBytes },
      startTimeoutMs: this.startTimeoutMs,
      onMessage: (m) => {
        if ('stopped' in m) {
          this.onStopped?.();
          return;
        }
        if ('cache' in m) {
          this.cache = m.cache;
          return;
        }
        const p = this.pending.get(m.id);
        if (!p) return;
        this.pending.delete(m.id);
        clearTimeout(p.timer);
        if ('error' in m) p.reject(new PdError('engine_failed', `tokenizer: ${m.error}`));
        else if ('stats' in m) p.resolve(m.stats as never);
        else p.resolve((p.typed ? m.tokens : Array.from(m.tokens)) as never);
      },
      onGone: (w, why) => this.lost(w, why),
    });
    this.worker = worker;
    this.ready = ready;
    return ready;
  }

  /** Plain text → tokens, as `Engine.tokenize`. @throws PdError QUEUE_FULL, TIMEOUT, engine_failed. */
  tokenize(text: string, addSpecial = true): Promise<number[]> {
    return this.call({ id: 0, kind: 'text', text, addSpecial });
  }

  /** Messages (and tools) → tokens, as `Engine.renderChat`. @throws PdError QUEUE_FULL, TIMEOUT, engine_failed. */
  renderChat(messages: ChatMessage[], tools?: readonly ToolFunction[]): Promise<number[]> {
    return this.call({ id: 0, kind: 'chat', messages, ...(tools ? { tools: [...tools] } : {}) });
  }

  /** `tokenize`, the tokens as the thread's Uint32Array (no copy: for callers that only read them). */
  tokenizeTyped(text: string, addSpecial = true): Promise<Uint32Array> {
    return this.call({ id: 0, kind: 'text', text, addSpecial }, true);
  }

  /** `renderChat`, the tokens as the thread's Uint32Array (no copy: for callers that only read them). */
  renderChatTyped(messages: ChatMessage[], tools?: readonly ToolFunction[]): Promise<Uint32Array> {
    return this.call({ id: 0, kind: 'chat', messages, ...(tools ? { tools: [...tools] } : {}) }, true);
  }

  /** The chunk cache's figures and the thread's heap (`gc`: after a full collection there, for benchmarks). @throws PdError QUEUE_FULL, TIMEOUT, engine_failed. */
  stats(gc = false): Promise<TokenizerThreadStats> {
    return this.call({ id: 0, kind: 'stats', gc });
  }

  /**
   * Stop the thread; what it held fails at once. It is terminated once it is idle (queued prompts
   * skipped; at most `timeoutMs` for the one in work — after that it is left to the process
   * exit rather than terminated inside native code). Idempotent.
   */
  async close(): Promise<void> {
    this.closed = true;
    const w = this.worker;
    this.lost(w, 'tokenizer thread closed');
    if (!w) return;
    Atomics.store(this.stopFlag, 0, 1);
    const idle = new Promise<boolean>((resolve) => {
      const t = setTimeout(() => resolve(false), this.timeoutMs);
      t.unref();
      this.onStopped = () => {
        clearTimeout(t);
        resolve(true);
      };
      w.once('exit', () => resolve(false));
    });
    w.postMessage({ id: 0, kind: 'stop' } satisfies TokenizeJob);
    if (await idle) await w.terminate().catch(() => 0);
  }

  private async call<T = number[]>(job: TokenizeJob, typed = false): Promise<T> {
    if (this.pending.size >= this.maxPending) throw new PdError('QUEUE_FULL', `tokenizer queue is full (${this.maxPending} prompts)`);
    await this.start();
    const w = this.worker;
    if (!w) throw new PdError('engine_failed', 'tokenizer thread is gone');
    if (this.pending.size >= this.maxPending) throw new PdError('QUEUE_FULL', `tokenizer queue is full (${this.maxPending} prompts)`);
    const id = ++this.seq;
    return new Promise<T>((resolve, reject) => {
      const timer = setTimeout(() => {
        this.pending.delete(id);
        reject(new PdError('TIMEOUT', `tokenizing took more than ${this.timeoutMs} ms`));
      }, this.timeoutMs);
      timer.unref();
      this.pending.set(id, { resolve: resolve as (v: never) => void, reject, timer, typed });
      w.postMessage({ ...job, id });
    });
  }

  /** Thread `w` is gone: fail what it held; the next call starts a new one. */
  private lost(w: Worker | undefined, why: string): void {
    if (!w || this.worker !== w) return;
    this.worker = undefined;
    this.ready = undefined;
    for (const [id, p] of this.pending) {
      clearTimeout(p.timer);
      p.reject(new PdError('engine_failed', why));
      this.pending.delete(id);
    }
  }
}
