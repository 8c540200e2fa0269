/**
 * Prefill worker: the I/O shell around the sans-IO `PrefillDriver` (driver.ts). It accepts
 * SGLang-style `POST /generate` with bootstrap fields, runs the KV bootstrap listener, evaluates
 * prompts on llama.cpp and streams the enveloped sequence state to decode — and makes no room
 * decision itself: every input goes to the driver, every `PrefillAction` it returns is performed
 * here, in order. The simulator runs the same driver over simulated I/O.
 *
 * Queues (SGLang's names): bootstrap (rooms in phase 'bootstrap'), waiting (registered, queued for
 * or in prompt evaluation), inflight (state sent, waiting for decode's KV_ACK). Each entry leaves
 * on the single `finish` action of its room.
 */
import { linkSync, renameSync, rmSync } from 'node:fs';
import { rm } from 'node:fs/promises';
import { join } from 'node:path';
import type { FastifyInstance } from 'fastify';
import { zodToApiError } from '../api/errors.js';
import { checkRequestBounds, GenerateRequestSchema, MAX_MESSAGES, type GenerateEvent, type GenerateRequest, type PrefillResponse } from '../protocol/worker-protocol.js';
import { parseConfig, prefixCacheOf, PrefillConfigSchema, type PrefillConfig } from '../runtime/config.js';
import { PrefixCacheMetrics } from '../runtime/prefix-metrics.js';
import { openPrefixStore } from '../runtime/prefix-store.js';
import { KvEventLog } from '../protocol/kv-events.js';
import { serveWorkerEdge, type WorkerEdge } from '../worker/shell.js';
import { SequenceKvTracker } from '../worker/kv-tracker.js';
import { ApiError, errorCodeOf, failure, toApiError } from '../base/errors.js';
import { pairSettingsOf } from '../protocol/pair.js';
import { deferred, onClientGone, sendError, type Deferred } from '../worker/http.js';
import { systemClock, type Clock } from '../base/clock.js';
import { createLogger, type Logger } from '../base/log.js';
import { hold } from '../runtime/testhooks.js';
import { TraceTags } from '../protocol/trace-tags.js';
import { roomsByState, WorkerMetrics } from '../runtime/metrics.js';
import { loadEngine } from '../engine/index.js';
import type { Engine, SamplingParams, Slot } from '../engine/types.js';
import { newEpoch } from '../kv/auth.js';
import { KvServer, type PeerConn } from '../kv/channel.js';
import { kvTransportOf } from '../kv/transport.js';
import { loadInternalTls } from '../runtime/tls.js';
import { encodeEnvelopeHead, prepareEnvelopeHead } from '../kv/envelope.js';
import { BufferPool, TRANSFER_BUFFER_BYTES, TRANSFER_POOL_BUFFERS } from '../kv/transfer/pool.js';
import { sendGrowingStateFile, sendStateFile, wireBytes, type StreamedSend } from '../kv/transfer/sender.js';
import { sharedKvIo } from '../kv/transfer/io-thread.js';
import { prefillStateName, SameHostPrefill, type KvPath } from '../kv/transfer/same-host.js';
import type { ControlMsg } from '../kv/messages.js';
import { KVPoll, type RoomId } from '../kv/types.js';
import { checkSampling, fitSampling, samplingFromWire, tokenizeRequestOffLoop } from '../api/requests.js';
import { TokenizerThread } from '../engine/tokenizer-thread.js';
import { PrefillDriver, type ComputeOutcome, type PrefillAction } from './driver.js';
import { answerWithFirstToken, firstTokenEvent } from './first-token.js';
import { answerRooms, ComputationMetrics, type Computation } from './computation.js';

/** The shell's own per-room state: what the driver does not need (I/O handles, timings). */
interface Job {
  rid: string;
  /** The computation this room takes its state from (shared by the rooms of one request). */
  comp: Computation;
  /** Fires when the room becomes terminal: stops its send. */
  ac: AbortController;
  done: Deferred<PrefillResponse>;
  /** Set when the router asked for the first token before the handoff (`first_token_from_prefill`). */
  first?: Deferred<GenerateEvent>;
  t0: number;
  /** When the driver's `transfer` began (ms epoch; 0 before): progress is reported from then. */
  tKvBegin: number;
  /** Streamed handoff (`--kv-stream`): when its kv_begin went out, during the save (ms epoch); the transfer's metrics count from here. */
  tStreamStart?: number;
  /** How the state went to decode (set when the transfer starts). */
  kvPath?: KvPath;
  /**
   * Same host: this room's hard link to the computation's state file (`prefillStateName`), handed
   * over by kv_file. The room owns it until decode renames it; deleted (a no-op once taken) at the
   * room's finish.
   */
  handed?: { path: string; payloadBytes: number };
  /**
   * TCP, streamed (`startStream`): the send that began while llama.cpp was still saving the
   * state; settles with what kv_end must say, or undefined once the room was failed for it.
   * `transfer` waits for it instead of reading the saved file again.
   */
  stream?: Promise<StreamedSend | undefined>;
  /** Bytes the streamed send flushed before the driver's `transfer` (reported to it then). */
  earlyBytes?: number;
}

/** A running prefill worker. Create with `startPrefillWorker`. */
export class PrefillWorker {
  readonly driver: PrefillDriver;
  /** Read buffers of the streaming sends, reused across transfers. */
  private readonly kvPool = new BufferPool(TRANSFER_BUFFER_BYTES, TRANSFER_POOL_BUFFERS);
  readonly metrics: WorkerMetrics;
  readonly prefixMetrics: PrefixCacheMetrics;
  readonly epoch = newEpoch();
  /** What this worker's cache tiers store and evict (GET /kv_events): the host store's events, same epoch as /health. */
  readonly kvEvents: KvEventLog;
  /** Which conversations (router conversation keys) this worker's sequences keep: the sequence tier of its events. */
  private readonly kvTracker: SequenceKvTracker | null;
  /** Trace id per room, for /debug/rooms. */
  readonly traces = new TraceTags();
  private readonly jobs = new Map<RoomId, Job>();
  /** Computations by lead room, until the driver's `discard` (or a compute that ended without a state). */
  private readonly comps = new Map<RoomId, Computation>();
  readonly computeMetrics: ComputationMetrics;
  private readonly conns = new Map<string, PeerConn>();
  /** Decode connections whose `register` said `kvStream` (they take a streamed kv_begin). */
  private readonly streamPeers = new Set<string>();
  /** The last saved state: prompt tokens and payload bytes (a streamed kv_begin's size estimate). */
  private lastSave: { nTokens: number; payloadBytes: number } | undefined;
  /** The shared HTTP edge (../worker/shell.ts): app, watchdog, sweeper. */
  private edge?: WorkerEdge;
  /** The same-host handoff (kv_file): probe answers and which decode connections may use it. */
  readonly sameHost: SameHostPrefill;
  app!: FastifyInstance;
  kv!: KvServer;
  url = '';
  bootstrapPort = 0;

  constructor(
    readonly config: PrefillConfig,
    readonly engine: Engine,
    readonly log: Logger,
    /** Large prompts are templated and tokenized here, off the event loop (heartbeats and streams keep flowing). */
    readonly tokenizer: TokenizerThread = new TokenizerThread(engine.info.modelPath),
    /** Monotonic time of every deadline, watchdog tick and elapsed figure; wall time for /debug/rooms dates. */
    readonly clock: Clock = systemClock,
  ) {
    this.driver = new PrefillDriver(
      {
        timeouts: config.timeouts,
        maxRooms: config.maxRooms,
        maxWaiting: config.maxWaiting,
        slots: engine.info.sequences,
        // TEST-ONLY fault injection (never set it in production), see PrefillDriverConfig.
        faultLeakFirstAck: process.env.PDSERVE_FAULT_LEAK_ROOM === '1',
      },
      this.epoch,
    );
    this.metrics = new WorkerMetrics('prefill', {
      queues: () => this.driver.queueSizes(),
      roomsByState: () => roomsByState(this.rooms),
      channel: () => ({ ...(this.kv?.stats ?? {}) }),
    });
    this.prefixMetrics = new PrefixCacheMetrics(this.metrics.registry, () => this.engine.cachedStats());
    this.kvEvents = new KvEventLog({ epoch: this.epoch, registry: this.metrics.registry });
    this.kvTracker = engine.info.cacheSequences > 0 ? new SequenceKvTracker(engine, this.kvEvents) : null;
    this.computeMetrics = new ComputationMetrics(this.metrics.registry);
    this.sameHost = new SameHostPrefill({ enabled: config.kvSameHost, verify: config.kvSameHostVerify, stateDir: config.stateDir });
  }

  /** The driver's room table (the lifecycle core). */
  get rooms() {
    return this.driver.rooms;
  }

  /** Queue name → entries, derived from room phases (cannot drift). */
  queueSizes(): Record<string, number> {
    return this.driver.queueSizes();
  }

  async start(): Promise<void> {
    const c = this.config;
    await this.tokenizer.start();
    const internalTls = loadInternalTls(c.internalTls);
    this.kv = new KvServer({
      transport: kvTransportOf(internalTls),
      clock: this.clock,
      host: c.host,
      port: c.bootstrapPort,
      secret: c.secret,
      epoch: this.epoch,
      settings: pairSettingsOf(this.engine.info),
      heartbeatMs: c.heartbeatMs,
      streams: c.kvStreams,
      log: this.log.child({ part: 'kv' }),
      onMessage: (conn, msg) => this.onControl(conn, msg),
      onPeerLost: (conn, reason) => {
        this.conns.delete(conn.id);
        this.streamPeers.delete(conn.id);
        this.sameHost.forget(conn.id);
        this.perform(this.driver.peerLost(conn.id, reason, this.clock.nowMs()));
      },
    });
    this.bootstrapPort = await this.kv.listen();
    this.edge = await serveWorkerEdge({
      role: 'prefill',
      engine: this.engine,
      tokenize: true,
      epoch: this.epoch,
      config: c,
      internalTls,
      log: this.log,
      registry: this.metrics.registry,
      kvEvents: this.kvEvents,
      liveRooms: () => this.rooms.rooms().length,
      queues: () => this.queueSizes(),
      health: () => ({ bootstrap_host: c.bootstrapHost, bootstrap_port: this.bootstrapPort }),
      debugRooms: () => {
        const snap = this.rooms.snapshot(this.clock.nowMs(), this.clock.wallMs());
        return this.traces.tag({ epoch: this.epoch, queues: this.queueSizes(), pending_registrations: this.driver.pendingRegistrations, ...snap, live: snap.live.map((r) => ({ ...r, step: this.driver.step(r.room), path: 'pd', kv_path: this.jobs.get(r.room)?.kvPath ?? null, cached_tokens: this.jobs.get(r.room)?.comp.cachedTokens ?? 0, computation: this.driver.leadOf(r.room) ?? null })) });
      },
      generate: (body, reply) => this.handleGenerate(body, reply),
      abort: (rid, room) => this.abort(rid, room, 'router'),
      tick: () => this.perform(this.driver.tick(this.clock.nowMs())),
    });
    this.app = this.edge.app;
    this.url = this.edge.url;
    this.log.info({ url: this.url, bootstrapPort: this.bootstrapPort, epoch: this.epoch }, 'prefill worker ready');
  }

  /** Stop accepting, fail live rooms, close sockets, free the engine. Idempotent. */
  async close(): Promise<void> {
    this.edge?.stop();
    this.kvTracker?.close();
    this.perform(this.driver.shutdown(this.clock.nowMs()));
    await this.app?.close().catch(() => {});
    await this.kv?.close();
    await this.tokenizer.close();
    await this.engine.dispose();
  }

  /** Abort by rid and/or room id; unknown ids leave a tombstone (when the room id is known). */
  abort(rid: string | undefined, room: RoomId | undefined, from: 'router' | 'local'): void {
    this.perform(this.driver.abort(rid, room, from, this.clock.nowMs()));
  }

  // ---- the driver's actions ----------------------------------------------------------------

  /** Perform the driver's actions, in order. */
  private perform(actions: PrefillAction[]): void {
    for (const a of actions) {
      switch (a.a) {
        case 'send':
          this.conns.get(a.peer)?.sendControl(a.msg);
          break;
        case 'compute':
          void this.compute(a.room);
          break;
        case 'transfer':
          void this.transfer(a.room, a.peer, a.path);
          break;
        case 'discard': {
          const comp = this.comps.get(a.room);
          this.comps.delete(a.room);
          if (comp) dropState(comp);
          break;
        }
        case 'cancel':
          this.comps.get(a.room)?.ac.abort();
          break;
        case 'finish':
          this.finish(a);
          break;
        case 'diag':
          this.metrics.recordDiagnostic(a.effect, this.log, this.traces.get(a.effect.room));
          break;
        case 'registration_expired':
          this.metrics.bootstrapFailed.inc({ reason: 'registration_refused' });
          break;
        case 'fault_leak':
          this.log.warn({ room: a.room }, 'FAULT INJECTION (PDSERVE_FAULT_LEAK_ROOM=1): leaking this room');
          break;
      }
    }
  }

  /** The one release path of a room's resources (the driver's single `finish` per room). */
  private finish(a: Extract<PrefillAction, { a: 'finish' }>): void {
    const job = this.jobs.get(a.room);
    if (!job) return;
    this.jobs.delete(a.room);
    job.ac.abort(); // the state file is the computation's: released by the driver's `discard`
    // Same host: the room's own link, unless decode took it over (renamed it) already.
    if (job.handed) void rm(job.handed.path, { force: true }).catch(() => {});
    this.metrics.recordTerminal(a.state, a.failure, a.registered);
    if (a.state === KVPoll.Success) {
      this.metrics.kvSeconds.observe((this.clock.nowMs() - (job.tStreamStart ?? job.tKvBegin)) / 1000);
      this.metrics.kvHandoffs.inc({ path: job.kvPath ?? 'tcp' });
      if (job.tStreamStart !== undefined && job.kvPath === 'tcp') this.metrics.kvStreamed.inc();
      job.done.resolve({
        rid: job.rid,
        meta_info: { prompt_tokens: job.comp.tokens.length, cached_tokens: job.comp.cachedTokens, kv_bytes: this.rooms.get(a.room)?.bytes ?? 0, prefill_ms: job.comp.prefillMs, transfer_ms: Math.round(this.clock.nowMs() - (job.tStreamStart ?? job.tKvBegin)) },
      });
    } else {
      job.done.reject(ApiError.fromFailure(a.failure ?? failure('internal_error', 'room failed')));
    }
  }

  // ---- HTTP -----------------------------------------------------------------------------------

  private async handleGenerate(raw: unknown, reply: import('fastify').FastifyReply): Promise<void> {
    // Request-controlled counts are bounded before any per-item work (zod, templating): each
    // message costs at least one token, so more messages than the context cannot fit.
    const ctxTokens = this.engine.info.compat.contextSize;
    const tooLarge = checkRequestBounds(raw, { maxMessages: Math.min(MAX_MESSAGES, ctxTokens), maxPromptTokens: ctxTokens });
    if (tooLarge) return sendError(reply, tooLarge);
    const parsed = GenerateRequestSchema.safeParse(raw);
    if (!parsed.success) return sendError(reply, zodToApiError(parsed.error));
    const body: GenerateRequest = parsed.data;
    let tokens: number[];
    let sampling: SamplingParams;
    try {
      tokens = await tokenizeRequestOffLoop(this.engine, this.tokenizer, body);
      sampling = fitSampling(this.engine, tokens.length, samplingFromWire(body.sampling_params, body.resume_token_ids));
      await checkSampling(this.engine, sampling);
    } catch (err) {
      return sendError(reply, toApiError(err));
    }
    // n > 1: one computation for every room named (the first is the lead, = bootstrap_room).
    const rooms = body.bootstrap_rooms ?? [body.bootstrap_room];
    const room = rooms[0]!;
    if (rooms.length > 1 && !body.first_token_from_prefill) return sendError(reply, ApiError.of('invalid_request', 'bootstrap_rooms needs first_token_from_prefill (each room gets its own first token)', 'bootstrap_rooms'));
    const admitted = this.driver.request(rooms, body.rid, this.clock.nowMs());
    if (admitted.refused) return sendError(reply, admitted.refused);
    const comp: Computation = { lead: room, rooms, tokens, sampling, ac: new AbortController(), heads: new Map(), prefillMs: 0, cachedTokens: 0, ...(body.conversation_key ? { key: body.conversation_key } : {}) };
    this.comps.set(room, comp);
    const trace = body.trace_id ?? body.rid;
    const jobs = rooms.map((r) => {
      const job: Job = { rid: body.rid, comp, ac: new AbortController(), done: deferred(), t0: this.clock.nowMs(), tKvBegin: 0, first: body.first_token_from_prefill ? deferred() : undefined };
      this.traces.set(r, trace);
      this.jobs.set(r, job);
      return job;
    });
    this.log.child({ rid: body.rid, room, trace }).debug({ tokens: tokens.length, rooms: rooms.length }, 'room created');
    this.perform(admitted.actions);
    const off = onClientGone(reply, () => this.perform(rooms.flatMap((r) => this.driver.abort(undefined, r, 'router', this.clock.nowMs()))));
    if (rooms.length > 1) {
      await answerRooms(reply, rooms.map((r, i) => ({ room: r, first: jobs[i]!.first!.promise, done: jobs[i]!.done.promise })), this.config.timeouts.transferIdleMs);
      off();
      return;
    }
    const job = jobs[0]!;
    if (job.first) {
      await answerWithFirstToken(reply, job.first.promise, job.done.promise, this.config.timeouts.transferIdleMs);
      off();
      return;
    }
    try {
      const res = await job.done.promise;
      off();
      void reply.send(res);
    } catch (err) {
      off();
      sendError(reply, toApiError(err));
    }
  }

  // ---- KV control channel ---------------------------------------------------------------------

  private onControl(conn: PeerConn, msg: ControlMsg): void {
    this.conns.set(conn.id, conn);
    if (msg.type === 'same_host_probe' || msg.type === 'same_host_ok') {
      const reply = this.sameHost.onMessage(conn.id, msg);
      if (reply) conn.sendControl(reply);
      if (this.sameHost.usable(conn.id)) this.driver.sameHostConfirmed(conn.id);
      return;
    }
    if (msg.type === 'kv_file_refused') {
      // decode could not take the handed file: the driver sends a live room again over TCP (from its link)
      const again = this.driver.fileRefused(conn.id, msg.room);
      if (again.length > 0) {
        this.metrics.kvFileRefused.inc();
        this.log.warn({ room: msg.room, reason: msg.reason }, 'decode refused the state file (kv_file): sending it over TCP');
      }
      this.perform(again);
      return;
    }
    if (msg.type === 'register' && msg.kvStream === true) this.streamPeers.add(conn.id);
    if (msg.type === 'register' || msg.type === 'kv_ack' || msg.type === 'fail') {
      this.perform(this.driver.message(conn.id, conn.peerEpoch, msg, this.clock.nowMs()));
      return;
    }
    this.log.warn({ type: msg.type, peer: conn.id }, 'unexpected control message on prefill');
  }

  // ---- the engine and channel ports -----------------------------------------------------------

  /** Prompt evaluation of a computation the driver started (`compute`, by its lead room); ends in `driver.computeDone`. */
  private async compute(lead: RoomId): Promise<void> {
    const comp = this.comps.get(lead);
    // The prompt picks the idle sequence sharing its longest prefix (prefix cache).
    const slot = comp && !comp.ac.signal.aborted ? this.engine.tryAcquireSlot(comp.tokens) : null;
    const done = (o: ComputeOutcome): void => {
      if (!o.ok) this.comps.delete(lead);
      this.perform(this.driver.computeDone(lead, o, this.clock.nowMs()));
    };
    if (!comp || !slot) {
      slot?.release();
      return done(comp && !comp.ac.signal.aborted ? { ok: false, failure: failure('engine_failed', 'no free prefill sequence') } : { ok: false, aborted: true });
    }
    done(await this.evaluate(comp, slot));
  }

  /**
   * Evaluate the computation's prompt on `slot` ONCE, sample one first token per room (room i
   * with seed + i), save the state file once and make each room's envelope head. Never throws.
   */
  private async evaluate(comp: Computation, slot: Slot): Promise<ComputeOutcome> {
    // Not a room's name (`prefillStateName`): on the same-host path each room gets its own link.
    const path = join(this.config.stateDir, `pdserve-prefill-${process.pid}-${comp.lead}-saved.ggsq`);
    const signal = comp.ac.signal;
    try {
      await hold('prefill.compute', signal);
      const t0 = this.clock.nowMs();
      this.computeMetrics.computations.inc();
      this.computeMetrics.roomsPerComputation.observe(comp.rooms.length);
      const r = await slot.prefill(comp.tokens, comp.sampling, signal, comp.rooms.length);
      comp.cachedTokens = r.cachedTokens;
      this.computeMetrics.evaluatedTokens.inc(r.promptTokens - r.cachedTokens);
      this.prefixMetrics.recordLookup(r.promptTokens, r.cachedTokens, r.cacheTier);
      for (let i = 0; i < comp.rooms.length; i++) {
        const job = this.jobs.get(comp.rooms[i]!);
        const pick = r.choices[i]!;
        // A migrated request's state also holds its resumed tokens: they count as completion tokens.
        const resumed = comp.sampling.resumed?.length ?? 0;
        if (job?.first) job.first.resolve(firstTokenEvent(job.rid, r.promptTokens - resumed, { ...(await slot.firstOutput(pick.firstToken, comp.sampling)), logprob: pick.firstLogprob }, r.cachedTokens, resumed));
      }
      await hold('prefill.save', signal);
      if (signal.aborted) return { ok: false, aborted: true };
      rmSync(path, { force: true }); // a streamed send reads the file as it grows: no stale bytes
      const saving = slot.saveState(path);
      saving.catch(() => {}); // awaited below; not unhandled while the heads are prepared
      const streamedBytes = this.startStream(comp, r.promptTokens, r.cachedTokens, r.choices[0]!, path, saving);
      // Each room's envelope head, all but the size, while llama.cpp saves (saveState first
      // reaches the native save through a few promise steps: one event-loop turn lets it start,
      // then this runs beside it instead of after it on the handoff's critical path).
      await new Promise<void>((resolve) => setImmediate(resolve));
      const info = this.engine.info;
      let heads: ((payloadBytes: number) => Buffer)[] = [];
      let headError: unknown;
      try {
        heads = comp.rooms.map((_, i) => {
          const pick = r.choices[i]!;
          return prepareEnvelopeHead({ fingerprint: info.fingerprint, contextSize: info.compat.contextSize, batchSize: info.compat.batchSize, nTokens: r.promptTokens, firstToken: pick.firstToken, cachedTokens: r.cachedTokens, firstIsEog: pick.firstIsEog });
        });
      } catch (e) {
        headError = e; // thrown once the save is over (the slot is released after it)
      }
      const payloadBytes = await saving;
      if (headError !== undefined) throw headError;
      this.computeMetrics.statesSaved.inc();
      this.lastSave = { nTokens: r.promptTokens, payloadBytes };
      const roomBytes = new Map<RoomId, number>();
      comp.rooms.forEach((room, i) => {
        const head = heads[i]!(payloadBytes);
        comp.heads.set(room, head);
        roomBytes.set(room, streamedBytes !== undefined && i === 0 ? streamedBytes + payloadBytes : wireBytes(head, payloadBytes));
      });
      comp.prefillMs = Math.round(this.clock.nowMs() - t0);
      if (signal.aborted) return { ok: false, aborted: true };
      comp.state = { path, payloadBytes }; // the file is the computation's now: deleted by the driver's `discard`
      // the sequence keeps this prompt once released: the conversation's next round finds it here
      if (comp.key) this.kvTracker?.noteFinished(comp.key, comp.tokens, comp.tokens.length);
      return { ok: true, totalBytes: roomBytes.get(comp.lead)!, roomBytes };
    } catch (err) {
      const e = err as { code?: string; message?: string };
      if (e.code === 'ABORTED' || signal.aborted) return { ok: false, aborted: true };
      const code = errorCodeOf(err);
      return { ok: false, failure: failure(code === 'internal_error' ? 'engine_failed' : code, `prefill: ${e.message ?? String(err)}`) };
    } finally {
      slot.release();
      if (comp.state?.path !== path) await rm(path, { force: true }).catch(() => {});
    }
  }

  /**
   * Start sending the state while llama.cpp saves it (transfer/sender.ts `sendGrowingStateFile`),
   * with `--kv-stream` and when it fits: one room (n > 1 gives each room its own head: save, then send), registered by
   * a decode whose `register` said `kvStream`, on a TCP connection (same host hands over the
   * finished file instead). The streamed kv_begin (size: an estimate from the last save) goes
   * out once llama.cpp has created the file; records the send in the room's job; the driver's `transfer` later finishes it with kv_end.
   * A send that fails before the room is done (the save failed or stopped growing, the socket)
   * fails the room here; the room's end (its `ac`) stops it. Returns the streamed envelope head's
   * length (the room's wire bytes are head + payload), or undefined when nothing was started.
   */
  private startStream(comp: Computation, nTokens: number, cachedTokens: number, pick: { firstToken: number; firstIsEog: boolean }, path: string, saved: Promise<number>): number | undefined {
    if (!this.config.kvStream || comp.rooms.length !== 1) return undefined;
    const room = comp.lead;
    const job = this.jobs.get(room);
    const peer = this.driver.peerOf(room);
    if (!job || peer === undefined || job.ac.signal.aborted || !this.streamPeers.has(peer) || this.driver.pathFor(peer) === 'same_host') return undefined;
    const conn = this.conns.get(peer);
    if (!conn?.alive) return undefined;
    const info = this.engine.info;
    const head = encodeEnvelopeHead({ fingerprint: info.fingerprint, contextSize: info.compat.contextSize, batchSize: info.compat.batchSize, nTokens, firstToken: pick.firstToken, cachedTokens, firstIsEog: pick.firstIsEog, payloadBytes: 0 });
    // A state's size is affine in its token count with a small constant: the last save predicts it within a few hundred bytes.
    const last = this.lastSave;
    const estimate = last && last.nTokens > 0 ? Math.ceil((last.payloadBytes / last.nTokens) * Math.max(1, nTokens)) : 16 * 1024 * Math.max(1, nTokens);
    job.kvPath = 'tcp';
    job.earlyBytes = 0;
    job.stream = sendGrowingStateFile(conn, room, path, head, {
      clock: this.clock,
      saved,
      pool: this.kvPool,
      chunkBytes: this.config.chunkBytes,
      signal: job.ac.signal,
      stallMs: this.config.timeouts.transferIdleMs,
      growStallMs: this.config.timeouts.transferIdleMs,
      // The save may first queue for the context's lock behind another sequence's evaluation:
      // that wait is bounded like any wait for input, and decode hears kv_begin only once
      // llama.cpp has created the file (its transfer-idle clock starts with the bytes).
      createWaitMs: this.config.timeouts.waitingMs,
      onFileStart: () => {
        job.tStreamStart = this.clock.nowMs();
        return conn.sendControl({ type: 'kv_begin', room, totalBytes: head.length + estimate, streamed: true });
      },
      onProgress: (bytes: number) => {
        this.metrics.kvBytes.inc(bytes);
        if (job.tKvBegin > 0) this.perform(this.driver.progress(room, bytes, this.clock.nowMs()));
        else job.earlyBytes = (job.earlyBytes ?? 0) + bytes;
      },
    }).catch((err: unknown) => {
      if (!job.ac.signal.aborted) this.perform(this.driver.transferFailed(room, failure(errorCodeOf(err) === 'peer_lost' ? 'peer_lost' : 'kv_transfer_failed', (err as Error).message), this.clock.nowMs()));
      return undefined;
    });
    return head.length;
  }

  /**
   * Send the room's state to decode (`transfer`). On a same-host connection: the room's own hard
   * link to the state file (`prefillStateName`), named in one kv_file message (not read; CRC-32'd
   * only with --kv-same-host-verify on either side)
   * (transfer/same-host.ts) — decode takes it over by renaming it; the link is deleted at the
   * room's finish if it is still ours. `path` is the driver's choice (`PrefillDriver.pathFor`);
   * 'tcp' (also a room whose file decode refused, sent from its link): kv_begin, the file
   * streamed in pooled pieces (transfer/sender.ts), kv_end.
   */
  private async transfer(room: RoomId, peer: string, path: KvPath): Promise<void> {
    const job = this.jobs.get(room);
    const conn = this.conns.get(peer);
    const st = job?.handed ?? job?.comp.state;
    const head = job?.comp.heads.get(room);
    if (!job || !st || !head) return;
    job.tKvBegin = this.clock.nowMs();
    const failed = (detail: string, code: 'kv_transfer_failed' | 'peer_lost' = 'kv_transfer_failed'): void => this.perform(this.driver.transferFailed(room, failure(code, detail), this.clock.nowMs()));
    // A state streamed while it was saved (startStream) already went over TCP.
    if (job.stream) {
      job.kvPath = 'tcp';
      // Streamed while the state was saved (startStream): report what went out meanwhile, wait
      // for the rest, then kv_end with the byte count and CRC-32. A failure was reported by it.
      if (job.earlyBytes) this.perform(this.driver.progress(room, job.earlyBytes, this.clock.nowMs()));
      job.earlyBytes = 0;
      const sent = await job.stream;
      if (!sent || job.ac.signal.aborted) return;
      this.perform(this.driver.transferSent(room));
      await hold('prefill.send', job.ac.signal);
      if (job.ac.signal.aborted) return;
      if (!conn || !conn.sendControl({ type: 'kv_end', room, totalBytes: sent.totalBytes, crc: sent.crc })) failed('connection to decode is gone');
      return;
    }
    job.kvPath = path;
    if (job.kvPath === 'same_host') {
      await hold('prefill.send', job.ac.signal);
      if (job.ac.signal.aborted) return;
      try {
        const link = join(this.config.stateDir, prefillStateName(process.pid, room));
        if (job.comp.rooms.length === 1 && job.comp.state?.path === st.path) {
          // One room: the computation's file becomes the room's (one rename instead of link +
          // unlink, on the handoff's critical path): the data's only name, so decode may re-frame
          // it in place (it copies a file whose data another name shares). The driver's later
          // `discard` finds nothing.
          renameSync(st.path, link);
          job.comp.state = undefined;
        } else linkSync(st.path, link);
        job.handed = { path: link, payloadBytes: st.payloadBytes };
        if (!conn || !conn.sendControl(this.sameHost.offer(peer, room, link, head, st.payloadBytes, this.kvPool))) return failed('connection to decode is gone');
      } catch (err) {
        return failed((err as Error).message);
      }
      // The computation's file is no longer needed by this room (its link holds the data).
      this.perform(this.driver.transferSent(room));
      return;
    }
    if (!conn || !conn.sendControl({ type: 'kv_begin', room, totalBytes: wireBytes(head, st.payloadBytes) })) return failed('connection to decode is gone');
    try {
      await sendStateFile(conn, room, st.path, head, st.payloadBytes, {
        pool: this.kvPool,
        io: sharedKvIo(),
        chunkBytes: this.config.chunkBytes,
        signal: job.ac.signal,
        stallMs: this.config.timeouts.transferIdleMs,
        onProgress: (bytes: number) => {
          this.metrics.kvBytes.inc(bytes);
          this.perform(this.driver.progress(room, bytes, this.clock.nowMs()));
        },
      });
      // The room no longer needs the state: the last room to get here releases it (`discard`).
      this.perform(this.driver.transferSent(room));
      await hold('prefill.send', job.ac.signal);
      if (job.ac.signal.aborted) return;
      conn.sendControl({ type: 'kv_end', room });
    } catch (err) {
      if (!job.ac.signal.aborted) failed((err as Error).message, errorCodeOf(err) === 'peer_lost' ? 'peer_lost' : 'kv_transfer_failed');
    }
  }
}

/** Delete the computation's state file once (it no longer names it afterwards). */
function dropState(comp: Computation): void {
  const st = comp.state;
  comp.state = undefined;
  if (st) void rm(st.path, { force: true }).catch(() => {});
}

/** Load the engine, start the worker. */
export async function startPrefillWorker(raw: unknown, log = createLogger('prefill')): Promise<PrefillWorker> {
  const config = parseConfig(PrefillConfigSchema, raw);
  // prefill only reads the store: decode's finished prompt + reply states supersede its prompt-only ones
  const store = openPrefixStore(config.engine, config.stateDir, { write: false, maxFileBytes: config.maxStateBytes, log });
  const engine = await loadEngine({ ...config.engine, sequences: config.slots, prefixCache: prefixCacheOf(config.engine), ...(store ? { prefixStore: store } : {}), log: (level: string, msg: string) => log.debug({ level }, msg) });
  const w = new PrefillWorker(config, engine, log);
  store?.registerMetrics(w.metrics.registry, (hit) => w.prefixMetrics.recordTier('store', hit));
  store?.onEvent((e) => w.kvEvents.publish(e));
  await w.start();
  return w;
}
