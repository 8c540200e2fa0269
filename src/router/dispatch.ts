/**
 * Dual dispatch of one generation request (SGLang mini-LB style): the attempt's coordinator.
 *
 * The same `/generate` body (rid, bootstrap_host/port of the chosen prefill, a random 63-bit
 * bootstrap_room) is POSTed to the prefill and the decode worker at once. Prefill answers JSON
 * when its room is terminal; decode streams `GenerateEvent`s as SSE. The client gets decode's
 * stream converted to OpenAI chunks (stream) or the assembled response (non-stream).
 *
 * Each worker call is a leg (./leg.ts: the call, its one SSE loop, its abort, lease and
 * settling), heard as typed events; this class coordinates the two: the first-token gate, the
 * client's response, the deadline, aborts and the end.
 *
 * Lifecycle (`PdRequest`): waiting → streaming (stream mode, from decode's first event) →
 * finished. `finish(outcome)` runs once and:
 *  - sends the client an OpenAI error (status + body while waiting; an SSE `{error}` event and
 *    an end without `[DONE]` once streaming) unless the client is gone;
 *  - on client_abort / timeout: POSTs /abort_request {rid, bootstrap_room} to BOTH workers
 *    (fire-and-forget, short deadline, failures logged); on error: to every worker that has
 *    not itself reported a terminal answer; aborts the undici requests;
 *  - releases both load leases (each lease's release is guarded: exactly once per request);
 *  - on ok: a leg still open (prefill's answer not yet arrived, decode's body not yet ended)
 *    gets LINGER_MS to settle, then is aborted; its lease is released when it settles.
 * A prefill error after decode produced its first event is logged and ignored: the KV handoff
 * evidently succeeded and decode's output stands.
 *
 * First token before the handoff (`firstTokenFromPrefill`, default on): prefill's answer is an
 * SSE stream whose first event is token 1, written to the client at once (TTFT no longer waits
 * for the KV transfer and load); decode streams from token 2. Decode's events are held until
 * prefill's first event has been written, so the order is always right. If the handoff fails after
 * token 1, the client (already streaming) gets an SSE `{error}` event and no `[DONE]`.
 *
 * Decode-local continuation (`local`, ../decode/local.ts): the request goes to decode ALONE with
 * `local_prefill: {max_tokens}` (no prefill leg, no KV handoff; decode streams every token). If
 * decode answers 409 `needs_prefill` before this attempt sent anything to the client, the
 * attempt ends with `next = 'fallback'` (./plan.ts) instead of an error, and the caller runs a normal PD request
 * on the same pair. A migrated attempt may take this path too (`resume_token_ids` with
 * `local_prefill`). Everything else (deadline, aborts, leases, finish) is the same code. A
 * successful response names its path in the `x-pdserve-path` header (pd | decode_local).
 *
 * Attempts (./attempts.ts): this class is one attempt. A leg's failure is reported to the
 * registry (`report`: draining, unreachable, connection lost, frozen, unauthenticated) and put to
 * the attempt plan (./plan.ts, through `decide`): `retry` (no output yet) or `migrate` (the
 * client has output) end the attempt with `next` and `cause` set instead of an error — nothing is
 * sent to the client, the other leg is aborted (its room ends by /abort_request) and the caller
 * runs a new attempt on another pair, through the same `ClientReply` (response builder, SSE
 * stream, tokens sent, deadline). The workers' rid of attempt n > 1 is `<rid>-a<n>`; the
 * response id stays `<rid>`.
 */
import type { SendQueueWatch } from '../runtime/send-queue.js';
import { redactedForClient } from '../base/redact.js';
import { DRAINING_CODE } from '../runtime/drain.js';
import { systemClock } from '../base/clock.js';
import type { TestHooks } from '../runtime/testhooks.js';
import { newRoomId, type RoomId } from '../base/room-id.js';
import type { ChunkStream, GenerationSink } from '../api/generation.js';
import type { Logger } from 'pino';
import type { Dispatcher } from 'undici';
import { ApiError } from '../api/errors.js';
import { outputChecksOf, responseToolSyntax, toWorkerRequest, type ParsedRequest } from '../api/parse.js';
import { OpenAIResponseBuilder, SSE_DONE } from '../api/respond.js';
import type { GenerateEvent } from '../protocol/worker-protocol.js';
import type { RouterConfig } from './config.js';
import type { Next } from './plan.js';
import { errorOutcome, type Outcome, type RouterMetrics } from './metrics.js';
import type { RequestObserver } from './trace.js';
import type { ChoiceGroup } from './choices.js';
import { randomHex, randomU64 } from './random-pool.js';
import type { Lease, WorkerRegistry, WorkerState } from './registry.js';
import { Leg, type LegCall, type LegEvent } from './leg.js';
import { abortCause, legFailure, OPERATOR_ABORT, type LegName } from './worker-errors.js';

/** How long an already-answered request waits for a leg to settle on its own before aborting it. */
export const LINGER_MS = 2000;
/** Random 63-bit bootstrap room id (the one generator, base/room-id.ts; bytes from ./random-pool.ts). */
export const randomRoom = (): RoomId => newRoomId(randomU64);

/** Request id: `cmpl-<24 hex>` or `chatcmpl-<24 hex>`. */
export function newRid(kind: 'completion' | 'chat'): string {
  return `${kind === 'chat' ? 'chatcmpl' : 'cmpl'}-${randomHex(12)}`;
}

/** The attempt decision for a failed leg (./plan.ts `AttemptPlan.next` with the request's state): `err` and what the attempt knows. */
export type Decide = (err: ApiError, ev: { output: boolean; attemptOutput: boolean; local: boolean }) => Next;

/** Everything a request needs from its router. */
export interface DispatchContext {
  config: RouterConfig;
  registry: WorkerRegistry;
  metrics: RouterMetrics;
  /** Pool for /generate (long-lived streams). */
  dataAgent: Dispatcher;
  /** Pool for /abort_request (never queued behind streams). */
  controlAgent: Dispatcher;
  /** Register a fire-and-forget promise so `close()` can wait for it. */
  track(p: Promise<unknown>): void;
  /** Request traces (src/router/trace.ts): trace id per rid, and the request's events. */
  observe?: RequestObserver;
  /** Streaming clients' send queues (../runtime/send-queue.ts): one reading too slowly is cut. */
  sendWatch?: SendQueueWatch;
  /** Test-only hold points (`router.dispatch`); production: `noTestHooks`. */
  testHooks: TestHooks;
}

/**
 * What one client request keeps across its attempts (./attempts.ts): the response being built,
 * the client's SSE stream once open, the token ids the client has (or will get with the
 * response), the end-to-end deadline and the latency stamps. One per client request; each
 * `PdRequest` (one attempt) writes through it, so a retried or migrated attempt continues the
 * same response.
 */
export class ClientReply {
  readonly builder: OpenAIResponseBuilder;
  /** The client's SSE stream, once the first chunk was written (stream requests). */
  writer: ChunkStream | null = null;
  /** Token ids of every event applied to `builder`, in order: what a migrated attempt resumes after. */
  readonly tokenIds: number[] = [];
  readonly t0 = systemClock.nowMs();
  /** systemClock.nowMs() at which the request's deadline (requestTimeoutMs) expires. */
  readonly deadlineAt: number;
  firstTokenAt = 0;
  lastTokenAt = 0;
  /** Attempts started so far (1 for the first); attempt n > 1 sends the workers rid `<rid>-a<n>`. */
  attempt = 0;
  /** A choice of an n > 1 request or a prompt batch: the response id of the whole request (../api/fanout.ts). */
  parentRid: string | undefined;

  constructor(
    readonly rid: string,
    parsed: ParsedRequest,
    model: string,
    timeoutMs: number,
  ) {
    this.builder = new OpenAIResponseBuilder(parsed.kind, { id: rid, model, created: Math.floor(systemClock.wallMs() / 1000) }, parsed.includeUsage, responseToolSyntax(parsed), outputChecksOf(parsed));
    this.deadlineAt = this.t0 + timeoutMs;
  }

  /** The workers' rid of the current attempt: unique per attempt, so a worker still holding an earlier attempt's room never sees a duplicate. */
  get workerRid(): string {
    return this.attempt > 1 ? `${this.rid}-a${this.attempt}` : this.rid;
  }
}

/**
 * One attempt of a generation request, from dispatch to its last byte or its failure. Construct,
 * then `await run()`; `run()` never rejects. A failure that ./attempts.ts may retry or migrate
 * ends the attempt with `next` set and nothing sent to the client.
 */
export class PdRequest {
  readonly room = randomRoom();
  /** The response id (the client's rid, the same for every attempt). */
  readonly rid: string;
  outcome: Outcome | null = null;
  /** The attempt failed and runs again (./plan.ts): retry (no output yet), migrate (the client has output) or fallback (decode-local refused: the PD path on the same pair). */
  next: Exclude<Next, 'fail'> | null = null;
  /** The error the attempt failed with (why `next` is set, or what the client got). */
  cause: ApiError | null = null;
  /** The leg whose failure ended this attempt, and its error (the other leg's abort says so). */
  private failedLeg: { leg: LegName; err: ApiError } | null = null;
  /** The workers' rid of this attempt. */
  readonly workerRid: string;
  /** A choice of a fanned-out request: the whole request's response id (POST /abort_request finds the choices by it). */
  get parentRid(): string | undefined {
    return this.client.parentRid;
  }
  /** An operator aborted the request (`abortByOperator`): every leg is told so, nothing runs again. */
  private operatorAborted = false;
  /** Serving path, for metrics and logs. */
  readonly path: 'pd' | 'decode_local';
  private phase: 'waiting' | 'streaming' | 'finished' = 'waiting';
  private readonly parentLog: Logger;
  private roomLog: Logger | null = null;
  /** The prefill leg is absent on the decode-local path. */
  private readonly legs: { prefill?: Leg; decode: Leg };
  private readonly body: string;
  private deadline: NodeJS.Timeout | null = null;
  /** Events written from decode (a prefill error after one is ignored: the handoff succeeded). */
  private decodeEvents = 0;
  /** Opens once prefill's first-token event has been handled (or the request is over). */
  private firstGateOpen!: () => void;
  private readonly firstGate = new Promise<void>((r) => (this.firstGateOpen = r));
  private status = 200;
  private resolveDone!: () => void;
  private readonly done = new Promise<void>((r) => (this.resolveDone = r));
  private readonly onClientClose = () => {
    if (this.phase !== 'finished') this.finish('client_abort', ApiError.of('client_closed_request', 'client disconnected'));
  };

  constructor(
    private readonly ctx: DispatchContext,
    /** The request's state across attempts; its rid is the response id. */
    private readonly client: ClientReply,
    private readonly parsed: ParsedRequest,
    /** Where the answer goes (an HTTP response, or the in-process caller: ../api/generation.ts). */
    private readonly sink: GenerationSink,
    prefill: WorkerState,
    decode: WorkerState,
    log: Logger,
    /** What a failed leg leads to (./plan.ts with the request's state); null = always fail. */
    private readonly decide: Decide | null = null,
    /** Decode-local continuation: send to decode alone, decode evaluates ≤ maxTokens uncached tokens. */
    local?: { maxTokens: number },
    /** n > 1: this request is choice `index` of a group sharing one prefill computation (choices.ts). */
    private readonly member?: { group: ChoiceGroup; index: number },
  ) {
    // A group's prefill computation is one load on its worker: only its first choice holds the lease.
    const shared = (name: LegName) => name === 'prefill' && member !== undefined && member.index > 0;
    const leg = (name: LegName, worker: WorkerState): Leg => new Leg(name, worker, shared(name) ? noLease(worker) : ctx.registry.acquire(worker), ctx, () => this.log);
    this.path = local ? 'decode_local' : 'pd';
    this.legs = local ? { decode: leg('decode', decode) } : { prefill: leg('prefill', prefill), decode: leg('decode', decode) };
    this.parentLog = log;
    this.rid = client.rid;
    this.workerRid = client.workerRid;
    if (client.writer) this.phase = 'streaming';
    const firstTokenFromPrefill = !local && ctx.config.firstTokenFromPrefill;
    this.body = JSON.stringify({
      ...toWorkerRequest(parsed, { rid: this.workerRid, bootstrapHost: prefill.bootstrapHost!, bootstrapPort: prefill.bootstrapPort!, bootstrapRoom: this.room, firstTokenFromPrefill }),
      ...(local ? { local_prefill: { max_tokens: local.maxTokens } } : {}),
      // A migrated attempt: the tokens the client already has (./attempts.ts).
      ...(client.tokenIds.length > 0 ? { resume_token_ids: client.tokenIds } : {}),
      trace_id: ctx.observe?.traceOf(this.rid),
    });
    if (!firstTokenFromPrefill) this.firstGateOpen();
  }

  /**
   * The request's logger (its room bound), made on first use: a pino child costs a bindings
   * serialization, and at the default level the first line is 'request finished', after the response.
   */
  private get log(): Logger {
    return (this.roomLog ??= this.parentLog.child({ room: this.room }));
  }

  /** A debug line; below debug level not even the room-bound child logger is made. */
  private debug(fields: Record<string, unknown>, msg: string): void {
    if (this.parentLog.isLevelEnabled('debug')) this.log.debug(fields, msg);
  }

  /** Dispatch to both workers and serve the client; resolves when the request is finished. */
  async run(): Promise<void> {
    const { metrics, config } = this.ctx;
    metrics.inflight.inc();
    if (this.sink.signal.aborted) queueMicrotask(this.onClientClose);
    else this.sink.signal.addEventListener('abort', this.onClientClose);
    this.deadline = setTimeout(
      () => this.finish('timeout', ApiError.of('timeout', `request timed out after ${config.requestTimeoutMs} ms`)),
      Math.max(0, this.client.deadlineAt - systemClock.nowMs()),
    );
    if (this.ctx.testHooks.enabled) await this.ctx.testHooks.hold('router.dispatch');
    if (!this.over) {
      // Decode's request first: prefill waits for decode's `register` (which comes after decode has
      // read its request) before it evaluates, so decode's socket write is the one on the TTFT path.
      // (Not prefill first, as a direct client sends them: undici writes both in the same check
      // phase, after its idle-socket check; writing the first wakes its worker, which can preempt
      // the router before the second write.) What only records (the trace event, the debug line)
      // comes after both.
      void this.runDecode();
      if (this.legs.prefill) void this.runPrefill(this.legs.prefill);
    }
    this.ctx.observe?.event(this.rid, 'dispatched', { room: this.room, prefill: this.legs.prefill?.worker.url ?? null, decode: this.legs.decode.worker.url, path: this.path, attempt: this.client.attempt, worker_rid: this.workerRid, resumed_tokens: this.client.tokenIds.length });
    this.debug({ prefill: this.legs.prefill?.worker.url ?? null, decode: this.legs.decode.worker.url, path: this.path, stream: this.parsed.stream }, 'dispatching');
    await this.done;
  }

  /** Router shutdown: fail the request with 503 and abort both legs. */
  cancel(reason = 'router is shutting down'): void {
    this.finish('error', ApiError.of('shutting_down', reason));
  }

  /** The generated text so far (the whole reply once the request finished ok). */
  get generatedText(): string {
    return this.client.builder.text;
  }

  private get over(): boolean {
    return this.phase === 'finished';
  }

  /**
   * Prefill's leg (./leg.ts): its own stream, a choice group's share of one, or a JSON answer
   * (no streamed first token). Token 1 goes to the client at once and opens the first gate;
   * then the handoff outcome. A stream that ends before token 1 fails the leg.
   */
  private runPrefill(leg: Leg): Promise<void> {
    const sse = this.ctx.config.firstTokenFromPrefill;
    const m = this.member;
    const call: LegCall = m ? { via: 'group', sse, join: (signal) => m.group.join(m.index, this.room, this.body, signal) } : { via: 'generate', sse };
    let first = true;
    return leg.run(this.body, call, (e) => {
      switch (e.type) {
        case 'generate':
          if (!first || this.over) return;
          first = false;
          return this.onEvent(e.ev).finally(() => this.firstGateOpen());
        case 'transfer':
          this.debug({ prefill: e.info }, 'prefill answered: KV handoff done');
          this.ctx.observe?.event(this.rid, 'prefill_done', { meta_info: e.info });
          return;
        case 'answer':
          this.debug({ prefill: e.body }, 'prefill answered');
          this.ctx.observe?.event(this.rid, 'prefill_done', { meta_info: (e.body as { meta_info?: unknown })?.meta_info ?? null });
          return;
        case 'error':
          this.legFailed(leg, e.err);
          return 'stop';
        case 'end':
          if (first && !this.over) throw ApiError.of('prefill_stream_truncated', 'prefill worker ended its stream before the first token');
          return;
        case 'thrown':
          if (!this.over) this.legThrew(leg, e.thrown);
          return;
      }
    });
  }

  /**
   * Decode's leg (./leg.ts): every event after the first gate to the client, in order. After an
   * ok finish the rest of the body is drained; after any other finish the read stops. A stream
   * that ends before the finish event fails the leg; so does silence past `legSilenceMs` (the
   * worker is marked frozen, GET /workers and doctor name it, and the request migrates as after
   * a crash).
   */
  private runDecode(): Promise<void> {
    const leg = this.legs.decode;
    return leg.run(this.body, { via: 'generate', sse: true }, (e) => {
      switch (e.type) {
        case 'error':
          // an error status: no stream to keep in order
          if (e.via === 'status') return this.legFailed(leg, e.err);
        // falls through: an error event is ordered after prefill's token 1, as every event
        case 'generate':
          if (this.over) return this.outcome === 'ok' ? undefined : 'stop';
          return this.decodeEvent(leg, e);
        case 'end':
          if (!this.over) throw ApiError.of('decode_stream_truncated', 'decode worker ended its stream before the finish event');
          return;
        case 'thrown':
          if (!this.over) this.legThrew(leg, e.thrown);
          return;
        case 'silent':
          if (this.over) return;
          this.log.warn({ worker: leg.worker.url, why: e.why, events: this.decodeEvents }, 'decode stream went silent: the worker is frozen, migrating the request');
          this.ctx.registry.report(leg.worker, { kind: 'frozen', why: e.why });
          this.legFailed(leg, ApiError.of('decode_stalled', `decode worker ${leg.worker.url} stalled: ${e.why}`));
          return;
      }
    });
  }

  /** A decode event once prefill's token 1 was handled: an error fails the leg, anything else goes to the client. */
  private async decodeEvent(leg: Leg, e: Extract<LegEvent, { type: 'generate' | 'error' }>): Promise<void | 'stop'> {
    await this.firstGate;
    if (this.over) return;
    if (e.type === 'error') {
      this.legFailed(leg, e.err);
      return 'stop';
    }
    this.decodeEvents++;
    await this.onEvent(e.ev);
  }

  /** A decode event: metrics, translation, write to the client; completes on the finish event. */
  private async onEvent(ev: GenerateEvent): Promise<void> {
    const client = this.client;
    const chunks = client.builder.push(ev); // throws ApiError on malformed / aborted events
    const now = systemClock.nowMs();
    const n = Array.isArray(ev.token_ids) ? ev.token_ids.length : 0;
    if (n > 0) {
      for (const t of ev.token_ids) client.tokenIds.push(t);
      if (client.firstTokenAt === 0) {
        client.firstTokenAt = now;
        this.ctx.metrics.ttft.observe((now - client.t0) / 1000);
        this.ctx.observe?.event(this.rid, 'first_token');
      } else {
        const per = (now - client.lastTokenAt) / 1000 / n;
        for (let i = 0; i < n; i++) this.ctx.metrics.itl.observe(per);
      }
      client.lastTokenAt = now;
    }
    if (this.parsed.stream) {
      // a keep-alive comment (./keepalive.ts) may have opened the stream while this attempt waited
      if (this.phase === 'waiting') {
        if (client.writer) this.phase = 'streaming';
        else this.openStream();
      }
      for (const c of chunks) {
        await client.writer!.write(c);
        if (this.over) return;
      }
    }
    if (client.builder.finished) await this.complete();
  }

  private openStream(): void {
    this.client.writer = this.sink.stream({ 'x-request-id': this.rid, 'x-trace-id': this.ctx.observe?.traceOf(this.rid) ?? this.rid, 'x-pdserve-path': this.path });
    this.phase = 'streaming';
  }

  /** The finish event arrived: end the client response. */
  private async complete(): Promise<void> {
    const { builder, writer } = this.client;
    if (this.parsed.stream) {
      for (const c of builder.tail()) await writer!.write(c);
      await writer!.write(SSE_DONE);
      if (this.over) return;
      // still watched until the client read it all (a reader stalling now is cut and counted by the watch)
      writer!.end();
    } else {
      this.sink.json(builder.response(), { 'x-request-id': this.rid, 'x-pdserve-path': this.path });
    }
    this.finish('ok');
  }

  /**
   * An operator's abort (the router's POST /abort_request): the client gets 499 `request_aborted`
   * (an SSE error event once streaming), every leg's worker ends its room with the same code, and
   * the attempt is never retried or migrated. False when the request was already over.
   */
  abortByOperator(): boolean {
    if (this.over) return false;
    this.operatorAborted = true;
    this.ctx.observe?.event(this.rid, 'operator_abort', { attempt: this.client.attempt });
    this.finish('error', ApiError.of('request_aborted', OPERATOR_ABORT.message));
    return true;
  }

  /** A leg failed before the request finished (see the module doc for the prefill exception). */
  private legFailed(leg: Leg, err: ApiError): void {
    if ((err.code === DRAINING_CODE || err.code === 'stale_epoch') && !this.over) this.ctx.registry.report(leg.worker, { kind: 'draining' });
    // the worker switched role or restarted since it was picked: learn its role and epoch now
    if (err.code === 'stale_epoch') void this.ctx.registry.check(leg.worker, true);
    // Out of the rotation until a signed probe passes (its /health refuses a wrong signature too).
    if (err.code === 'worker_unauthenticated') this.ctx.registry.report(leg.worker, { kind: 'unauthenticated' });
    if (this.over) {
      this.log.warn({ leg: leg.name, worker: leg.worker.url, status: err.status, err: err.message }, 'worker error after the request finished');
      return;
    }
    if (leg.name === 'prefill' && this.decodeEvents > 0) {
      this.log.warn({ worker: leg.worker.url, status: err.status, err: err.message }, 'prefill reported an error after decode started generating; keeping decode output');
      return;
    }
    // Run again (./plan.ts decides): finish() aborts the other leg; nothing is sent.
    const next = this.decide ? this.decide(err, { output: this.client.builder.events > 0, attemptOutput: this.decodeEvents > 0, local: this.path === 'decode_local' }) : 'fail';
    if (next === 'fallback') {
      this.next = next;
      this.finish('error');
      return;
    }
    this.cause = err;
    this.failedLeg = { leg: leg.name, err };
    if (next !== 'fail') {
      this.next = next;
      this.finish('error');
      return;
    }
    this.finish('error', err);
  }

  /** Whatever a leg's request, stream read or client write threw, through the one mapping (./worker-errors.ts `legFailure`). */
  private legThrew(leg: Leg, thrown: unknown): void {
    const f = legFailure(leg.name, leg.worker.url, thrown);
    // Our write to the client failed: the client is gone or not reading.
    if (f.clientGone) return this.finish('client_abort', f.err);
    if (f.transport && leg.ac.signal.aborted) return;
    if (f.unreachable) this.ctx.registry.report(leg.worker, { kind: 'unreachable', err: thrown });
    // A worker that cut its connection mid-request most likely died: no further attempt picks it before a probe says it is back.
    else if (f.closed) this.ctx.registry.report(leg.worker, { kind: 'connection_lost', err: thrown });
    if (f.err.code === 'generation_aborted') leg.reported = true;
    this.legFailed(leg, f.err);
  }

  /** Send the client an error in the form its phase allows (naming the failed role, not its address). */
  private sendError(raw: ApiError, wasStreaming: boolean): void {
    const err = redactedForClient(raw);
    this.status = err.status;
    if (!wasStreaming) {
      this.sink.fail(err);
      return;
    }
    const w = this.client.writer;
    if (w && !w.closed) {
      w.write({ error: err.toBody().error }).catch(() => {});
      w.end();
    }
  }

  /** The single exit: see the module doc. Idempotent. */
  private finish(outcome: Outcome, err?: ApiError): void {
    if (this.phase === 'finished') return;
    const wasStreaming = this.phase === 'streaming' || (this.parsed.stream && this.client.writer !== null);
    this.phase = 'finished';
    this.outcome = outcome;
    this.firstGateOpen();
    if (this.deadline) clearTimeout(this.deadline);
    this.sink.signal.removeEventListener('abort', this.onClientClose);
    if (err && outcome !== 'client_abort') this.sendError(err, wasStreaming);
    else if (outcome === 'client_abort') this.status = 499;

    for (const leg of this.legs.prefill ? [this.legs.prefill, this.legs.decode] : [this.legs.decode]) {
      // ok: a leg still open gets LINGER_MS to settle on its own (an unsettled prefill is then told to abort)
      if (outcome === 'ok') leg.linger(LINGER_MS, () => leg.name === 'prefill' && void leg.sendAbort(this.workerRid, this.room));
      else {
        const tell = outcome === 'client_abort' || outcome === 'timeout' || !leg.reported;
        const cause = tell ? (this.operatorAborted ? OPERATOR_ABORT : abortCause(leg.name, this.failedLeg)) : undefined;
        leg.abort(tell ? { rid: this.workerRid, room: this.room, cause } : null);
      }
    }

    const { metrics } = this.ctx;
    const client = this.client;
    const e2eMs = systemClock.nowMs() - client.t0;
    metrics.inflight.dec();
    if (this.next === 'retry' || this.next === 'migrate') {
      const cause = this.cause!;
      this.ctx.observe?.event(this.rid, 'attempt_failed', { attempt: client.attempt, next: this.next, code: cause.code, err: cause.message, prefill: this.legs.prefill?.worker.url ?? null, decode: this.legs.decode.worker.url, tokens_sent: client.tokenIds.length });
      this.log.info({ prefill: this.legs.prefill?.worker.url ?? null, decode: this.legs.decode.worker.url, attempt: client.attempt, code: cause.code, err: cause.message, tokens: client.tokenIds.length }, this.next === 'retry' ? 'attempt failed before any output: dispatching the request again' : 'attempt failed after output: migrating the request');
      this.resolveDone();
      return;
    }
    if (this.next === 'fallback') {
      metrics.byPath.labels('fallback').inc();
      this.debug({ decode: this.legs.decode.worker.url }, 'decode-local attempt needs prefill: running the PD path');
      this.resolveDone();
      return;
    }
    metrics.requests.labels(outcome === 'error' ? errorOutcome(err) : outcome).inc();
    if (outcome === 'ok') {
      metrics.e2e.observe(e2eMs / 1000);
      metrics.byPath.labels(this.path).inc();
    }
    const line = {
      outcome,
      status: this.status,
      prefill: this.legs.prefill?.worker.url ?? null,
      decode: this.legs.decode.worker.url,
      path: this.path,
      stream: this.parsed.stream,
      prompt_tokens: client.builder.promptTokens,
      completion_tokens: client.builder.completionTokens,
      finish_reason: client.builder.finishReason,
      ttft_ms: client.firstTokenAt ? Math.round(client.firstTokenAt - client.t0) : null,
      itl_ms: client.builder.completionTokens > 1 ? Math.round(((client.lastTokenAt - client.firstTokenAt) / (client.builder.completionTokens - 1)) * 100) / 100 : null,
      e2e_ms: Math.round(e2eMs),
      attempts: client.attempt,
      ...(err && outcome !== 'ok' ? { err: err.message, code: err.code } : {}),
    };
    this.ctx.observe?.event(this.rid, 'finished', line);
    if (outcome === 'ok' || outcome === 'client_abort' || this.status < 500) this.log.info(line, 'request finished');
    else this.log.warn(line, 'request failed');
    this.resolveDone();
  }
}

/** The lease of a leg whose worker load is held by another request (a choice group's prefill). */
function noLease(worker: WorkerState): Lease {
  return { worker, released: false, release: () => false };
}
