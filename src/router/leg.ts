/**
 * One leg of an attempt: one worker call (POST /generate to a prefill or decode worker), its
 * SSE loop, its abort, its load lease and its settling. The attempt (./dispatch.ts `PdRequest`)
 * runs one or two of them and hears each as typed events (`LegEvent`), never raw bytes.
 *
 * | worker answer | events out |
 * |---|---|
 * | 200 SSE: a generation event (token ids, text, finish) | `generate` (the leg counts them: `events`) |
 * | 200 SSE: prefill's handoff outcome `{transfer}` | `transfer` |
 * | 200 SSE: `[DONE]` | `done` |
 * | 200 SSE: an `{error}` event (prefill: 502 unless it names a status; decode: 500) | `error` via `event` (./worker-errors.ts `eventError`); the loop stops |
 * | 200 JSON (prefill without a streamed first token) | `answer` |
 * | an error status: its body (≤ MAX_ERROR_BODY bytes) | `error` via `status` (`workerError`) |
 * | the stream ended | `end` (the attempt says whether that was early) |
 * | anything thrown: transport, a non-JSON event, an SSE frame over the limit, the client's write | `thrown` (the attempt maps it with `legFailure`), unless the leg was aborted on purpose |
 * | no event for `legSilenceMs` (decode) | `silent` |
 *
 * THE SSE loop (`reader`, both roles) is a Writable fed the body's bytes by undici's `stream()`
 * API: events are parsed and handled inside undici's data callback, i.e. in the socket's read
 * callback, so a token reaches the client's socket in the turn its bytes arrived; the next chunk
 * waits for the handler's promise (the client write). A `request()` body read with `for await`
 * takes several more turns (the response promise, the Readable's buffering, the async iterators).
 * A choice group's share of one prefill stream (./choices.ts) goes through the same reader.
 *
 * The lease (one unit of the worker's load, ./registry.ts) is released exactly once: when the
 * HTTP exchange is over (`settle`), when the attempt ends with the leg still open (`abort`), or
 * when a leg left to finish on its own after an ok answer does not within `linger` ms.
 */
import type { Dispatcher } from 'undici';
import { request } from 'undici';
import { Writable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import type { Logger } from 'pino';
import { ApiError } from '../api/errors.js';
import { SseParser } from '../api/sse.js';
import { SSE_DONE } from '../api/respond.js';
import { systemClock } from '../base/clock.js';
import type { GenerateEvent } from '../protocol/worker-protocol.js';
import { describeError, readText, type Lease, type WorkerState } from './registry.js';
import { badEvent, eventError, workerError, type AbortCause, type LegName } from './worker-errors.js';

/** Largest worker error body read, bytes. */
export const MAX_ERROR_BODY = 64 * 1024;
const JSON_HEADERS = { 'content-type': 'application/json' } as const;
const SSE_HEADERS = { ...JSON_HEADERS, accept: 'text/event-stream' } as const;
/** Ends a stream the attempt said to stop reading (after an error event): not an error of its own. */
const STOP = ApiError.of('generation_aborted', 'stream stopped by its attempt');

/** What a leg tells its attempt (see the module doc's table). */
export type LegEvent =
  | { type: 'generate'; ev: GenerateEvent }
  | { type: 'transfer'; info: unknown }
  | { type: 'answer'; body: unknown }
  | { type: 'done' }
  | { type: 'error'; err: ApiError; via: 'status' | 'event' }
  | { type: 'end' }
  | { type: 'thrown'; thrown: unknown }
  | { type: 'silent'; why: string };

/**
 * The attempt's handler of a leg's events: 'stop' ends the read (the leg failed: read no
 * further); a promise holds the next event until it settles (a client write); it may throw
 * (reported back as `thrown`).
 */
export type LegHandler = (e: LegEvent) => 'stop' | Promise<void | 'stop'> | void;

/** What a leg needs of its router (./dispatch.ts `DispatchContext` has it). */
export interface LegContext {
  /** Pool for /generate (long-lived streams). */
  dataAgent: Dispatcher;
  /** Pool for /abort_request (never queued behind streams). */
  controlAgent: Dispatcher;
  /** Register a fire-and-forget promise so the router's close can wait for it. */
  track(p: Promise<unknown>): void;
  /** `maxEventBytes`: the largest SSE event; `abortTimeoutMs`: an /abort_request's deadline; `legSilenceMs`: decode's silence bound (0: none). */
  config: { readonly maxEventBytes: number; readonly abortTimeoutMs: number; readonly legSilenceMs: number };
  /** `noteExchange`: a worker answered 200 (its health is fresh). */
  registry: { noteExchange(w: WorkerState): void };
}

/** How a leg's call is made: its own /generate, or a choice group's share of one (./choices.ts `join`). */
export type LegCall = { via: 'generate'; sse: boolean } | { via: 'group'; sse: boolean; join: (signal: AbortSignal) => Promise<{ statusCode: number; body: AsyncIterable<Uint8Array> }> };

/** One worker call of an attempt (see the module doc). */
export class Leg {
  readonly ac = new AbortController();
  /** The worker gave a terminal answer (error status, error event, [DONE], its handoff outcome): no abort_request needed on error. */
  reported = false;
  /** The HTTP exchange is over. */
  settled = false;
  /** Generation events read. */
  events = 0;
  private abortSent = false;
  private lingerTimer: NodeJS.Timeout | null = null;

  constructor(
    readonly name: LegName,
    readonly worker: WorkerState,
    private readonly lease: Lease,
    private readonly ctx: LegContext,
    private readonly log: () => Logger,
  ) {}

  /** Make the call with `body` and read its answer into `on`; resolves when the exchange is over (never rejects; the lease is released then). */
  async run(body: string, call: LegCall, on: LegHandler): Promise<void> {
    const silence = this.name === 'decode' ? this.watchSilence(on) : null;
    try {
      if (call.via === 'generate' && call.sse) {
        await this.stream(body, on, silence);
      } else {
        const res = call.via === 'group' ? await call.join(this.ac.signal) : await request(`${this.worker.url}/generate`, { method: 'POST', headers: this.headers(JSON_HEADERS), body, signal: this.ac.signal, dispatcher: this.ctx.dataAgent });
        if (res.statusCode === 200 && call.sse) {
          await pipeline(res.body, this.reader(on, silence));
        } else {
          const text = await readText(res.body, MAX_ERROR_BODY);
          this.reported = true;
          on(res.statusCode === 200 ? { type: 'answer', body: safeJson(text) } : { type: 'error', err: workerError(this.name, res.statusCode, text), via: 'status' });
        }
      }
    } catch (err) {
      if (err !== STOP && !this.ac.signal.aborted) this.deliver(on, { type: 'thrown', thrown: err });
    } finally {
      silence?.stop();
      this.settle();
    }
  }

  /** `base` plus the role this leg picked the worker for and, for a worker that can switch role, the epoch it saw (a switched worker refuses the leg: `stale_epoch`). */
  private headers(base: Record<string, string>): Record<string, string> {
    const w = this.worker;
    return { ...base, 'x-pdserve-role': w.role, ...(w.switchable && w.epoch ? { 'x-pdserve-epoch': w.epoch } : {}) };
  }

  /** POST /generate through undici's `stream()`: a 200's body into `reader`, an error status's body (≤ MAX_ERROR_BODY) as an `error` event. */
  private stream(body: string, on: LegHandler, silence: Silence | null): Promise<void> {
    const url = new URL(`${this.worker.url}/generate`);
    let status = 0;
    let errorBody: TextSink | null = null;
    return new Promise<void>((resolve, reject) => {
      this.ctx.dataAgent.stream(
        { origin: url.origin, path: url.pathname + url.search, method: 'POST', headers: this.headers(SSE_HEADERS), body, signal: this.ac.signal },
        ({ statusCode }) => {
          status = statusCode;
          if (statusCode !== 200) return (errorBody = new TextSink(MAX_ERROR_BODY));
          this.ctx.registry.noteExchange(this.worker);
          silence?.waiting();
          return this.reader(on, silence);
        },
        (err) => {
          if (err) return reject(err);
          if (errorBody) {
            this.reported = true;
            on({ type: 'error', err: workerError(this.name, status, errorBody.text()), via: 'status' });
          }
          resolve();
        },
      );
    });
  }

  /**
   * THE SSE loop of both roles: a Writable parsing the body's events (SseParser) and handing each
   * to `on` as a typed event in the write callback; the next chunk waits for the handler's
   * promise. Fails with STOP when the handler says so, with an ApiError on a non-JSON event or the
   * SseError of an oversized one (after the chunk's earlier events, as readSse does).
   */
  private reader(on: LegHandler, silence: Silence | null): Writable {
    const parser = new SseParser({ maxEventBytes: this.ctx.config.maxEventBytes });
    return new Writable({
      write: (chunk: Buffer, _enc, cb) => {
        const events: string[] = [];
        let failure: unknown = null;
        try {
          parser.push(chunk, events);
        } catch (err) {
          failure = err;
        }
        const next = (i: number): void => {
          for (; i < events.length; i++) {
            silence?.heard();
            let r: ReturnType<LegHandler>;
            try {
              r = on(this.parse(events[i]!));
            } catch (err) {
              return cb(err as Error);
            }
            if (r === 'stop') return cb(STOP);
            if (r) {
              const at = i + 1;
              r.then(
                (v) => {
                  if (v === 'stop') return cb(STOP);
                  silence?.waiting();
                  next(at);
                },
                (err: Error) => cb(err),
              );
              return;
            }
            silence?.waiting();
          }
          cb(failure as Error | null);
        };
        next(0);
      },
      final: (cb) => {
        try {
          on({ type: 'end' });
        } catch (err) {
          return cb(err as Error);
        }
        cb(null);
      },
    });
  }

  /** One SSE event's data as a LegEvent. @throws ApiError 502 bad_worker_event when it is not JSON. */
  private parse(data: string): LegEvent {
    if (data === SSE_DONE) {
      this.reported = true;
      return { type: 'done' };
    }
    let ev: { error?: unknown; transfer?: unknown };
    try {
      ev = JSON.parse(data);
    } catch {
      throw badEvent(this.name);
    }
    if (ev?.error && typeof ev.error === 'object') {
      this.reported = true;
      return { type: 'error', err: eventError(this.name, ev.error as Record<string, unknown>, this.name === 'prefill' ? 502 : 500), via: 'event' };
    }
    if (this.name === 'prefill' && ev?.transfer !== undefined) {
      this.reported = true;
      return { type: 'transfer', info: ev.transfer };
    }
    this.events++;
    return { type: 'generate', ev: ev as unknown as GenerateEvent };
  }

  /** A failure to the attempt (its handler of one does not throw or wait). */
  private deliver(on: LegHandler, e: LegEvent): void {
    void on(e);
  }

  /**
   * The silence bound of decode's stream (`legSilenceMs`; null when 0): only the time the router
   * waits on the worker counts (`waiting()` after each event is handled, `heard()` when the next
   * arrives), not a slow client's write. Past the bound the leg reports `silent` once.
   */
  private watchSilence(on: LegHandler): Silence | null {
    const boundMs = this.ctx.config.legSilenceMs;
    if (boundMs <= 0) return null;
    let since = 0;
    const timer = setInterval(() => {
      if (since === 0 || this.settled) return;
      const silent = systemClock.nowMs() - since;
      if (silent < boundMs) return;
      clearInterval(timer);
      this.deliver(on, { type: 'silent', why: `no event on a request's stream for ${Math.round(silent)} ms (bound ${boundMs} ms), after ${this.events} events` });
    }, Math.max(10, Math.min(1000, Math.floor(boundMs / 4))));
    timer.unref();
    return {
      heard: () => (since = 0),
      waiting: () => (since = systemClock.nowMs()),
      stop: () => clearInterval(timer),
    };
  }

  /** The HTTP exchange is over: release the load (guarded) and stop the linger timer. */
  settle(): void {
    this.settled = true;
    if (this.lingerTimer) clearTimeout(this.lingerTimer);
    this.lingerTimer = null;
    this.lease.release();
  }

  /** Give an open leg `ms` to settle on its own after an ok answer, then `expire()` (abort it) and release its lease. */
  linger(ms: number, expire: () => void): void {
    if (this.settled) return;
    this.lingerTimer = setTimeout(() => {
      if (this.settled) return;
      this.log().warn({ leg: this.name, worker: this.worker.url }, 'leg did not settle after the response; aborting it');
      expire();
      this.ac.abort();
      this.lease.release();
    }, ms);
    this.lingerTimer.unref();
  }

  /** End the leg now: with `tell`, POST /abort_request (with `cause` when given) first — its connection closes once the worker has the cause. */
  abort(tell: { rid: string; room: string; cause?: AbortCause } | null): void {
    if (tell?.cause) void this.sendAbort(tell.rid, tell.room, tell.cause).then(() => this.ac.abort());
    else {
      if (tell) void this.sendAbort(tell.rid, tell.room);
      this.ac.abort();
    }
    this.lease.release();
  }

  /** POST /abort_request to the worker (once per leg); settles (never rejects) once answered or failed. */
  sendAbort(rid: string, room: string, cause?: AbortCause): Promise<void> {
    if (this.abortSent) return Promise.resolve();
    this.abortSent = true;
    const p = request(`${this.worker.url}/abort_request`, {
      method: 'POST',
      headers: JSON_HEADERS,
      body: JSON.stringify({ rid, bootstrap_room: room, ...(cause ? { cause } : {}) }),
      dispatcher: this.ctx.controlAgent,
      signal: AbortSignal.timeout(this.ctx.config.abortTimeoutMs),
    })
      .then(async (res) => {
        await res.body.dump();
        if (res.statusCode >= 300) this.log().warn({ worker: this.worker.url, status: res.statusCode }, 'abort_request refused');
      })
      .catch((err: unknown) => this.log().warn({ worker: this.worker.url, err: describeError(err) }, 'abort_request failed'));
    this.ctx.track(p);
    return p;
  }
}

interface Silence {
  heard(): void;
  waiting(): void;
  stop(): void;
}

/** A response body kept as text, at most `max` bytes (the rest is read and dropped, as `readText` does). */
class TextSink extends Writable {
  private readonly parts: Buffer[] = [];
  private n = 0;
  constructor(private readonly max: number) {
    super();
  }
  override _write(chunk: Buffer, _enc: BufferEncoding, cb: (err?: Error | null) => void): void {
    if (this.n < this.max) {
      const c = chunk.subarray(0, this.max - this.n);
      this.parts.push(Buffer.from(c));
      this.n += c.length;
    }
    cb();
  }
  text(): string {
    return Buffer.concat(this.parts).toString('utf8');
  }
}

function safeJson(text: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    return text.slice(0, 200);
  }
}
