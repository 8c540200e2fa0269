/**
 * Colocated generation: prompt evaluation and decoding in one process and one llama.cpp
 * context, no KV handoff. The baseline for benchmarks and the correctness reference for PD: it
 * runs exactly the engine calls PD runs (chunked prefill, first token sampled after the prompt,
 * then `generate` from that token) minus save/transfer/load.
 */
import { retentionFromWire, tokenEvent, type GenerateEvent, type GenerateRequest } from '../protocol/worker-protocol.js';
import { ApiError, PdError } from '../base/errors.js';
import { checkSampling, fitSampling, samplingFromWire, tokenizeRequest } from '../api/requests.js';
import type { Engine, Retention, Slot } from '../engine/types.js';
import type { PrefixCacheMetrics } from '../prefixes/prefix-metrics.js';
import { systemClock } from '../base/clock.js';
import type { SequenceKvTracker } from '../worker/kv-tracker.js';
import { noTestHooks, type TestHooks } from '../runtime/testhooks.js';

/** A request being served, as shown in /debug/rooms (colocated has no rooms: path 'colocated'). */
export interface ColocatedRunning {
  rid: string;
  prompt_tokens: number;
  /** Prompt tokens taken from the prefix cache (known once the prompt was evaluated). */
  cached_tokens: number;
  path: 'colocated';
  /** When it got its slot, monotonic ms (src/base/clock.ts); not shown. */
  t0: number;
}

export interface ColocatedLimits {
  /** Bound on requests waiting for a slot. */
  maxWaiting: number;
  /** Max wait for a slot, ms. */
  slotWaitMs: number;
}

/** Slot allocation with a bounded FIFO of waiters, each with a deadline. */
export class ColocatedBackend {
  private readonly waiters: { prompt: readonly number[]; salt: string | undefined; retention: Retention | undefined; resolve(s: Slot): void; reject(e: unknown): void }[] = [];
  running = 0;
  /** Requests holding a slot, by rid. */
  readonly live = new Map<string, ColocatedRunning>();

  constructor(
    readonly engine: Engine,
    readonly limits: ColocatedLimits,
    private readonly prefixMetrics?: PrefixCacheMetrics,
    /** The sequence tier of this server's KV events: a finished generation with a conversation key is noted (prompt + reply). */
    private readonly kvTracker?: SequenceKvTracker | null,
    /** Test-only hold points (`decode.step` before each token); production: `noTestHooks`. */
    private readonly testHooks: TestHooks = noTestHooks,
  ) {}

  get waiting(): number {
    return this.waiters.length;
  }

  private async acquire(signal: AbortSignal, prompt: readonly number[], salt: string | undefined, retention: Retention | undefined): Promise<Slot> {
    const s = this.engine.tryAcquireSlot(prompt, salt, retention);
    if (s) return s;
    if (this.waiters.length >= this.limits.maxWaiting) throw ApiError.of('queue_full', `colocated queue is full (${this.limits.maxWaiting})`);
    return new Promise<Slot>((resolve, reject) => {
      const w = {
        prompt,
        salt,
        retention,
        resolve: (slot: Slot) => {
          cleanup();
          resolve(slot);
        },
        reject: (e: unknown) => {
          cleanup();
          reject(e);
        },
      };
      const t = setTimeout(() => w.reject(ApiError.of('queue_timeout', `no free slot within ${this.limits.slotWaitMs} ms`)), this.limits.slotWaitMs);
      const onAbort = () => w.reject(new PdError('ABORTED', 'aborted while waiting for a slot'));
      signal.addEventListener('abort', onAbort, { once: true });
      const cleanup = () => {
        clearTimeout(t);
        signal.removeEventListener('abort', onAbort);
        const i = this.waiters.indexOf(w);
        if (i >= 0) this.waiters.splice(i, 1);
      };
      this.waiters.push(w);
    });
  }

  private release(slot: Slot): void {
    slot.release();
    const w = this.waiters[0];
    if (w) {
      const s = this.engine.tryAcquireSlot(w.prompt, w.salt, w.retention);
      if (s) w.resolve(s);
    }
  }

  /**
   * Generate for one request: yields GenerateEvents (one per token, then a final one with
   * finish_reason). @throws ApiError for bad prompts, full queues; Error code 'ABORTED' on signal.
   */
  async *generate(body: Pick<GenerateRequest, 'rid' | 'text' | 'input_ids' | 'messages' | 'sampling_params' | 'conversation_key' | 'cache_salt' | 'retention'>, signal: AbortSignal): AsyncGenerator<GenerateEvent> {
    const tokens = tokenizeRequest(this.engine, body);
    const sampling = fitSampling(this.engine, tokens.length, samplingFromWire(body.sampling_params));
    await checkSampling(this.engine, sampling);
    const slot = await this.acquire(signal, tokens, body.cache_salt, retentionFromWire(body.retention));
    this.running++;
    const entry: ColocatedRunning = { rid: body.rid, prompt_tokens: tokens.length, cached_tokens: 0, path: 'colocated', t0: systemClock.nowMs() };
    this.live.set(body.rid, entry);
    let gen: AsyncGenerator<unknown, unknown> | undefined;
    try {
      const first = await slot.prefill(tokens, sampling, signal);
      entry.cached_tokens = first.cachedTokens;
      this.prefixMetrics?.recordLookup(first.promptTokens, first.cachedTokens, first.cacheTier);
      this.prefixMetrics?.requestsByPath.inc({ path: 'colocated' });
      const meta = (n: number, finish: GenerateEvent['meta_info']['finish_reason']) => ({ id: body.rid, prompt_tokens: first.promptTokens, cached_tokens: first.cachedTokens, completion_tokens: n, finish_reason: finish });
      const g = slot.generate(first.firstToken, sampling, signal);
      gen = g;
      let n = 0;
      const track = this.kvTracker !== null && this.kvTracker !== undefined;
      const ids: number[] = [];
      for (;;) {
        if (this.testHooks.enabled) await this.testHooks.hold('decode.step', signal);
        const r = await g.next();
        if (r.done) {
          if (track && r.value !== 'abort') this.kvTracker!.noteFinished([...tokens, ...ids], body.cache_salt);
          yield { text: '', token_ids: [], meta_info: meta(n, { type: r.value }) };
          return;
        }
        if (track) ids.push(r.value.token);
        n++;
        // generate() knows no logprob for the first token: prefill sampled it
        yield tokenEvent(n === 1 && first.firstLogprob ? { ...r.value, logprob: first.firstLogprob } : r.value, meta(n, null));
      }
    } finally {
      await gen?.return(undefined).catch(() => {});
      this.running--;
      if (this.live.get(body.rid) === entry) this.live.delete(body.rid);
      this.release(slot);
    }
  }
}
