/**
 * The decode worker's SSE output for one request (`POST /generate`): the events of
 * `worker-protocol.ts` (`tokenEvent`, the finish event, `[DONE]`, an error event), byte for byte
 * what `data: ${JSON.stringify(event)}\n\n` gives, with two savings on the per-token path, which
 * shares its core with llama.cpp's compute thread (BENCHMARKS.md §4):
 *
 * - Token events are built from a per-request template (the id, prompt and cached token counts
 *   are encoded once); only the text (and a logprob, when asked for) goes through JSON.stringify.
 * - Frames queued in one event-loop turn leave in one `res.write`, at the end of the turn
 *   (`process.nextTick`, which runs once the promise continuations of the turn are done): the last
 *   token, the finish event and `[DONE]` are one chunk. A frame is never held past the turn it
 *   was queued in, so no token waits for a later decode step (node-llama-cpp starts the next
 *   llama_decode on `setImmediate` at the earliest, after the turn: src/engine/step-barrier.ts).
 *   Node's http layer already corks the socket for the rest of the turn on every write, so the
 *   syscalls were one per turn before; what the batching saves is the chunked-encoding framing
 *   and the write path per event.
 *
 * Backpressure: `writable()` is true at once unless the response still needs a 'drain' at the
 * moment it is called (`res.writableNeedDrain`: a write was refused and the socket has not
 * drained since), else it waits for 'drain' at most `drainTimeoutMs` (false: the client is gone
 * or stuck). The state is read at call time, not remembered from the write: the refused write is
 * the end-of-turn flush, and the worker asks only after its next token, a decode step later — a
 * 'drain' emitted in between must count (a flag set by the write and cleared only by a 'drain'
 * heard in `writable()` missed it and aborted a healthy stream). One writer per response; not
 * for other routes.
 */
import type { ServerResponse } from 'node:http';
import { tokenEvent, type GenerateEvent, type WireLogprob } from '../protocol/worker-protocol.js';

/** The request-constant parts of every token event. */
export interface TokenEventMeta {
  /** The request id (`meta_info.id`). */
  rid: string;
  promptTokens: number;
  cachedTokens: number;
}

/** A generated token as `tokenEvent` takes it. */
export interface TokenOut {
  token: number;
  text: string;
  logprob?: WireLogprob;
}

/** The finish event's reason (`meta_info.finish_reason`). */
export type FinishType = 'stop' | 'length' | 'abort';

const isCount = (x: number) => Number.isSafeInteger(x);

/** SSE writer of one decode stream; see the module comment. */
export class DecodeSseWriter {
  private queued = '';
  private flushScheduled = false;
  /** Frames written by `res.write` calls (one per turn with anything queued), for tests and stats. */
  writes = 0;
  /** `"text":` … `,"meta_info":{"id":…,"prompt_tokens":…,"cached_tokens":…,"completion_tokens":` — null when a field would not encode as a plain number. */
  private readonly metaHead: string | null;
  private readonly flushNow = () => {
    this.flushScheduled = false;
    this.flush();
  };

  constructor(
    private readonly res: ServerResponse,
    private readonly meta: TokenEventMeta,
    /** Longest wait for 'drain' in `writable()`, ms. */
    private readonly drainTimeoutMs: number,
  ) {
    this.metaHead = isCount(meta.promptTokens) && isCount(meta.cachedTokens) ? `,"meta_info":{"id":${JSON.stringify(meta.rid)},"prompt_tokens":${meta.promptTokens},"cached_tokens":${meta.cachedTokens},"completion_tokens":` : null;
  }

  /** True when the response ended or the connection is gone: nothing more is sent. */
  get closed(): boolean {
    return this.res.destroyed || this.res.writableEnded;
  }

  /** The `meta_info` of an event after `n` completion tokens. */
  metaInfo(n: number, finish: GenerateEvent['meta_info']['finish_reason']): GenerateEvent['meta_info'] {
    return { id: this.meta.rid, prompt_tokens: this.meta.promptTokens, cached_tokens: this.meta.cachedTokens, completion_tokens: n, finish_reason: finish };
  }

  /**
   * The frame of one token event, `n` completion tokens so far: exactly
   * `data: ${JSON.stringify(tokenEvent(out, metaInfo(n, null)))}\n\n`.
   */
  tokenFrame(out: TokenOut, n: number): string {
    if (this.metaHead === null || !isCount(out.token) || !isCount(n)) return `data: ${JSON.stringify(tokenEvent(out, this.metaInfo(n, null)))}\n\n`;
    const lp = out.logprob ? `,"logprobs":[${JSON.stringify(out.logprob)}]` : '';
    return `data: {"text":${JSON.stringify(out.text)},"token_ids":[${out.token}]${this.metaHead}${n},"finish_reason":null}${lp}}\n\n`;
  }

  /** Queue one token event (written at the end of this turn). */
  token(out: TokenOut, n: number): void {
    this.push(this.tokenFrame(out, n));
  }

  /** Queue the finish event (empty text, no tokens, `finish_reason: {type}`) and `[DONE]`. */
  finish(n: number, type: FinishType): void {
    const ev: GenerateEvent = { text: '', token_ids: [], meta_info: this.metaInfo(n, { type }) };
    this.push(`data: ${JSON.stringify(ev)}\n\ndata: [DONE]\n\n`);
  }

  /**
   * Queue an error event inside the started stream (`{error: {message, type, code}}`); with
   * `withStatus`, its `status` too (the router then reads a 4xx as the request's end, not as a
   * worker failure to migrate).
   */
  error(e: { message: string; type: string; code: string; status?: number }, withStatus = false): void {
    this.push(`data: ${JSON.stringify({ error: { message: e.message, type: e.type, code: e.code, ...(withStatus && e.status !== undefined ? { status: e.status } : {}) } })}\n\n`);
  }

  /** Queue a frame; the first of a turn schedules the flush at the end of the turn. Dropped when closed. */
  private push(frame: string): void {
    if (this.closed) return;
    this.queued += frame;
    if (!this.flushScheduled) {
      this.flushScheduled = true;
      process.nextTick(this.flushNow);
    }
  }

  /** Write what is queued now, in one `res.write`. False when the response is closed (the frames are dropped). */
  flush(): boolean {
    const data = this.queued;
    this.queued = '';
    if (this.closed) return false;
    if (data === '') return true;
    this.writes++;
    this.res.write(data); // a refusal shows as res.writableNeedDrain until the socket drains
    return true;
  }

  /**
   * True (synchronously) when more tokens may be produced: not closed and no 'drain' pending
   * (`res.writableNeedDrain` false now — also when the socket drained after a refused write and
   * before this call). Otherwise a promise: true on 'drain', false when the response closes or
   * errors, or after `drainTimeoutMs`.
   */
  writable(): boolean | Promise<boolean> {
    if (this.closed) return false;
    const res = this.res;
    if (!res.writableNeedDrain) return true;
    return new Promise<boolean>((resolve) => {
      const t = setTimeout(() => done(false), this.drainTimeoutMs);
      const done = (ok: boolean) => {
        clearTimeout(t);
        res.off('drain', onDrain);
        res.off('close', onFail);
        res.off('error', onFail);
        resolve(ok && !this.closed);
      };
      const onDrain = () => done(true);
      const onFail = () => done(false);
      res.on('drain', onDrain);
      res.on('close', onFail);
      res.on('error', onFail);
    });
  }

  /** Write what is queued and end the response (idempotent; nothing is sent once closed). */
  end(): void {
    this.flush();
    if (!this.res.writableEnded) this.res.end();
  }
}
