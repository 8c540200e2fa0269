/**
 * One generation, in process: the seam between a server's way of generating (the router's
 * attempts, the colocated engine) and whoever asks for it — the HTTP chat/completions handler,
 * n > 1 fan-out (./fanout.ts) and the Responses API (./responses-http.ts).
 *
 *   port.parse(kind, body, caller)  → ParsedRequest (400 ApiError for a bad body)
 *   port.generate(request, sink)    → resolves when the generation is over (never rejects once
 *                                      the sink has output; before that an ApiError may be thrown)
 *
 * A generation writes its client through a `GenerationSink`: an OpenAI SSE stream (opened once,
 * by the first token or a keep-alive comment), a whole JSON answer, or an error before either.
 * `HttpSink` is an HTTP response; `InProcessSink` hands the same calls to the in-process caller
 * and records the outcome, so a fanned-out choice or a Responses request runs the server's own
 * generation path — pair choice, deadlines, retries and migrations, aborts, metrics, traces —
 * with no HTTP request to itself. Admission sees the client's HTTP request only: a fanned-out or
 * Responses request is admitted once, as one request.
 */
import type { FastifyBaseLogger, FastifyReply, FastifyRequest } from 'fastify';
import { ApiError, asErrorCode, codeSpec, type ApiErrorType } from '../base/errors.js';
import type { SendQueueWatch } from '../runtime/send-queue.js';
import { tenantOf } from './access.js';
import { sendApiError } from './errors.js';
import type { ParsedRequest } from './parse.js';
import { SSE_DONE } from './respond.js';
import { SseError, SseWriter } from './sse.js';
import { bodyPending } from './body-watch.js';

/** The client stream of a generation: SSE events and comments out (`SseWriter` is one). */
export interface ChunkStream {
  /** One event: an object (JSON), or a string sent verbatim (`[DONE]`); resolves once accepted (backpressure). @throws SseError when the client is gone or too slow. */
  write(data: unknown, event?: string): Promise<void>;
  /** An SSE comment (keep-alive). Same errors as `write`. */
  comment(text: string): Promise<void>;
  /** End the stream (idempotent). */
  end(): void;
  /** True once ended or the client is gone. */
  readonly closed: boolean;
}

/** Where one generation's answer goes (see the module doc). */
export interface GenerationSink {
  /** Aborted when the client is gone (its connection closed; the in-process caller gave up). */
  readonly signal: AbortSignal;
  /** Open the stream (status 200, these response headers) on the first call; later calls return the same stream. */
  stream(headers: Record<string, string>): ChunkStream;
  /** The stream, once open. */
  readonly opened: ChunkStream | null;
  /** True once an answer started (a stream, a JSON body or an error) or the client is gone. */
  readonly answered: boolean;
  /** The whole answer at once: status 200, `body` as JSON, with `headers`. No-op once answered. */
  json(body: unknown, headers: Record<string, string>): void;
  /** An error answer before any stream (its status and OpenAI body). No-op once answered. */
  fail(err: ApiError): void;
}

/** Who asks for a generation: what a server needs of the client's HTTP request. */
export interface Caller {
  /** The client's tenant (its API key's, ./access.ts), undefined when the API is open. */
  tenant: string | undefined;
  /** `x-session-id`: the conversation's affinity key. */
  sessionId: string | undefined;
  /** The client request's headers (a server reads its trace context from them: `traceparent`). */
  headers: Record<string, string | string[] | undefined>;
  log: FastifyBaseLogger;
}

/** The caller of an HTTP request. */
export function callerOf(request: FastifyRequest): Caller {
  const h = (k: string) => (typeof request.headers[k] === 'string' ? (request.headers[k] as string) : undefined);
  return { tenant: tenantOf(request), sessionId: h('x-session-id'), headers: request.headers, log: request.log };
}

/** A choice of a fanned-out request (./fanout.ts `SubRequest`): its index and its prompt's. */
export interface ChoiceSpec {
  index: number;
  promptIndex: number;
}

/** One generation to run. `M`: the server's own tag of a fanned-out choice (the router's choice group member). */
export interface GenerationRequest<M = unknown> {
  parsed: ParsedRequest;
  /** The response id (`chatcmpl-…` / `cmpl-…`). */
  rid: string;
  caller: Caller;
  /** In process (a choice, a Responses request): the server starts the request's trace and log of its own; false for the HTTP handler's request. */
  inProcess: boolean;
  /** A choice of a fanned-out request: the whole request's response id (an operator's abort by it ends every choice). */
  parentRid?: string;
  /** The client's own `request_id` (a trace label). */
  label?: string;
  member?: M;
}

/** What a server offers its callers (see the module doc). */
export interface GenerationPort<M = unknown> {
  /** Validate a single-choice body. @throws ApiError 400 (a bad body), 404 (an unknown model), 503 (shutting down). */
  parse(kind: 'completion' | 'chat', body: unknown, caller: Caller): ParsedRequest;
  /** Run one generation into `sink`; resolves when it is over. @throws ApiError before the sink has output (no healthy worker, …). */
  generate(request: GenerationRequest<M>, sink: GenerationSink): Promise<void>;
  /** The tags of a fan-out's choices (the router: one choice group per prompt with n > 1); called once per fanned-out request, before any choice runs. */
  members?<S extends ChoiceSpec>(subs: readonly S[]): (s: S) => M | undefined;
  /** How the server writes streams to its clients (a fanned-out or Responses stream is written by the caller). */
  streams: StreamLimits;
}

/** A server's limits on the streams it writes. */
export interface StreamLimits {
  /** Max wait for the client to drain one write, ms. */
  writeTimeoutMs?: number;
  /** The server's send-queue watch: a stalled or too-slow reader is cut (../runtime/send-queue.ts). */
  watch?: SendQueueWatch;
  /** The keep-alive interval of a waiting stream, ms (0/absent: none): a caller merging several generations forwards at most one comment per half of it. */
  keepAliveMs?: number;
}

/** A new response id: `cmpl-<24 hex>` or `chatcmpl-<24 hex>`. */
export function newResponseId(kind: 'completion' | 'chat', hex: string): string {
  return `${kind === 'chat' ? 'chatcmpl' : 'cmpl'}-${hex}`;
}

/** A sink over an HTTP response (the stream is an `SseWriter` with the server's limits). */
export class HttpSink implements GenerationSink {
  private readonly ac = new AbortController();
  private writer: SseWriter | null = null;

  constructor(
    private readonly reply: FastifyReply,
    private readonly limits: StreamLimits = {},
  ) {
    const raw = reply.raw;
    const onClose = () => {
      if (!raw.writableFinished) this.ac.abort();
    };
    if (raw.destroyed) this.ac.abort();
    else raw.once('close', onClose);
  }

  get signal(): AbortSignal {
    return this.ac.signal;
  }

  get opened(): ChunkStream | null {
    return this.writer;
  }

  get answered(): boolean {
    const { reply } = this;
    return this.writer !== null || reply.sent || reply.raw.headersSent || reply.raw.destroyed;
  }

  stream(headers: Record<string, string>): ChunkStream {
    if (this.writer) return this.writer;
    this.reply.hijack();
    this.writer = new SseWriter(this.reply.raw, { ...(this.limits.writeTimeoutMs !== undefined ? { writeTimeoutMs: this.limits.writeTimeoutMs } : {}), headers, ...(this.limits.watch ? { watch: this.limits.watch } : {}) });
    this.reply.raw.socket?.setNoDelay(true); // each token leaves at once (no Nagle wait for an ACK)
    this.writer.open(200);
    return this.writer;
  }

  json(body: unknown, headers: Record<string, string>): void {
    if (this.answered) return;
    void this.reply.code(200).headers(headers).send(body);
  }

  fail(err: ApiError): void {
    if (this.answered) return;
    void sendApiError(this.reply, err);
  }

  /**
   * The handler's last word after `generate`: when nothing was sent (no response, no body still
   * going out in slices: ./body-watch.ts), the client went before any response — the connection
   * is destroyed, nothing is written. Returns the reply for fastify.
   */
  finish(): FastifyReply {
    const { reply } = this;
    if (!reply.sent && !bodyPending(reply)) {
      reply.hijack();
      if (!reply.raw.destroyed) reply.raw.destroy();
    }
    return reply;
  }
}

/** How an in-process generation ended. */
export type GenerationOutcome =
  | { ok: true; headers: Record<string, string>; body?: unknown }
  | { ok: false; error: ApiError; headers: Record<string, string>; streamed: boolean; gone: boolean };

/** What the in-process caller does with a generation's output. */
export interface SinkHandlers {
  /** The stream's first event is here (its response headers): called once, before that event (a keep-alive comment before it opens nothing). */
  open?(headers: Record<string, string>): void;
  /** One event of the stream (an OpenAI chunk object; the `{error}` and `[DONE]` ends are kept by the sink, not passed). Its promise is the backpressure; a rejection fails the generation as its client's. */
  event(data: Record<string, unknown>): Promise<void>;
  /** A keep-alive comment. */
  comment?(text: string): Promise<void>;
}

/**
 * A sink whose client is the in-process caller: the stream's events go to `handlers`, its end
 * (`[DONE]`, an `{error}` event, a JSON answer, an error answer, the caller's abort) becomes
 * `outcome()`. `head` resolves when the answer started (the stream's first event, or an answer
 * without a stream).
 */
export class InProcessSink implements GenerationSink {
  private out: ChunkStream | null = null;
  private headers: Record<string, string> = {};
  private result: GenerationOutcome | null = null;
  /** The stream's first event came (the caller has output). */
  private begun = false;
  private headDone!: () => void;
  /** Resolves once the stream's first event came or the generation answered without a stream. */
  readonly head = new Promise<void>((r) => (this.headDone = r));

  constructor(
    readonly signal: AbortSignal,
    private readonly handlers: SinkHandlers,
  ) {}

  get opened(): ChunkStream | null {
    return this.out;
  }

  get answered(): boolean {
    return this.out !== null || this.result !== null || this.signal.aborted;
  }

  stream(headers: Record<string, string>): ChunkStream {
    if (this.out) return this.out;
    this.headers = headers;
    let ended = false;
    /** The head: the stream's first event (a keep-alive comment alone opens nothing for the caller). */
    const begin = () => {
      if (this.begun) return;
      this.begun = true;
      this.handlers.open?.(this.headers);
      this.headDone();
    };
    const gone = () => ApiError.of('client_closed_request', 'the in-process caller is gone');
    const self = this;
    const stopped = (err: unknown) => (err instanceof SseError ? err : new SseError('SSE_CLOSED', `the in-process caller stopped: ${(err as Error)?.message ?? String(err)}`));
    this.out = {
      get closed() {
        return ended || self.signal.aborted;
      },
      write: async (data: unknown) => {
        if (ended || this.signal.aborted) throw closedError();
        begin();
        if (data === SSE_DONE) {
          this.result ??= { ok: true, headers: this.headers };
          return;
        }
        const d = data as Record<string, unknown>;
        if (d && typeof d === 'object' && d.error && typeof d.error === 'object') {
          this.result ??= { ok: false, error: errorOfBody(d.error), headers: this.headers, streamed: true, gone: false };
          return;
        }
        try {
          await this.handlers.event(d);
        } catch (err) {
          // the caller's own client is gone or too slow (its SseError), or the caller failed: this generation's client is gone
          throw stopped(err);
        }
      },
      comment: async (text: string) => {
        if (ended || this.signal.aborted) throw closedError();
        try {
          await this.handlers.comment?.(text);
        } catch (err) {
          throw stopped(err);
        }
      },
      end: () => {
        if (ended) return;
        ended = true;
        this.result ??= this.signal.aborted ? { ok: false, error: gone(), headers: this.headers, streamed: this.begun, gone: true } : { ok: false, error: ApiError.of('internal_error', 'the stream ended without [DONE]'), headers: this.headers, streamed: this.begun, gone: false };
      },
    };
    return this.out;
  }

  json(body: unknown, headers: Record<string, string>): void {
    if (this.answered) return;
    this.result = { ok: true, headers, body };
    this.headDone();
  }

  fail(err: ApiError): void {
    if (this.answered) return;
    this.result = { ok: false, error: err, headers: {}, streamed: false, gone: false };
    this.headDone();
  }

  /** How it ended: call after `generate` resolved (or threw: `thrown`). */
  outcome(thrown?: unknown): GenerationOutcome {
    this.headDone();
    if (this.result) return this.result;
    if (thrown !== undefined) return { ok: false, error: thrown instanceof ApiError ? thrown : ApiError.of('internal_error', `generation failed: ${(thrown as Error)?.message ?? String(thrown)}`), headers: this.headers, streamed: this.begun, gone: false };
    return { ok: false, error: ApiError.of('client_closed_request', 'the in-process caller is gone'), headers: this.headers, streamed: this.begun, gone: true };
  }
}

/** The error an HTTP client's closed stream gives (SseError SSE_CLOSED), so a generation handles both clients alike. */
function closedError(): SseError {
  return new SseError('SSE_CLOSED', 'the in-process caller is gone');
}

/**
 * An OpenAI error event's body as an ApiError: its code (unknown or missing: internal_error),
 * the code's status from the error table (../base/errors.ts), its type and param.
 */
export function errorOfBody(error: unknown): ApiError {
  const e = (error !== null && typeof error === 'object' ? error : {}) as { message?: unknown; code?: unknown; type?: unknown; param?: unknown };
  const code = asErrorCode(e.code, 'internal_error');
  const spec = codeSpec(code);
  return new ApiError(spec.status, code, typeof e.message === 'string' ? e.message : 'generation failed', typeof e.type === 'string' ? (e.type as ApiErrorType) : spec.type, typeof e.param === 'string' ? e.param : null);
}

/**
 * Run one generation in process: parse nothing (the request is parsed), call `port.generate`
 * with an `InProcessSink` over `signal` and `handlers`, and return how it ended. Never rejects.
 */
export async function generateInProcess<M>(port: GenerationPort<M>, request: GenerationRequest<M>, signal: AbortSignal, handlers: SinkHandlers): Promise<GenerationOutcome> {
  const sink = new InProcessSink(signal, handlers);
  try {
    await port.generate(request, sink);
    return sink.outcome();
  } catch (err) {
    return sink.outcome(err);
  }
}
