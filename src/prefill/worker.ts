/**
 * Prefill worker: accepts SGLang-style `POST /generate` with bootstrap fields, waits for the
 * decode worker to register the room on the bootstrap listener (decode backpressure, as in
 * SGLang), evaluates the prompt, samples the first token, and streams the enveloped sequence
 * state to decode. The room's state lives only in the lifecycle core (`RoomTable`); this file
 * turns its effects into I/O.
 *
 * Queues (SGLang's names): bootstrap (rooms in phase 'bootstrap'), waiting (registered, queued for
 * or in prompt evaluation), inflight (state sent, waiting for decode's KV_ACK). Each entry leaves
 * on the single `terminal` effect of its room.
 */
import { readFile, rm } from 'node:fs/promises';
import { join } from 'node:path';
import type { FastifyInstance } from 'fastify';
import { zodToApiError } from '../api/openai.js';
import { checkRequestBounds, GenerateRequestSchema, MAX_MESSAGES, type GenerateEvent, type GenerateRequest, type PrefillResponse } from '../api/worker-protocol.js';
import { parseConfig, prefixCacheOf, PrefillConfigSchema, type PrefillConfig } from '../common/config.js';
import { PrefixCacheMetrics } from '../common/prefix-metrics.js';
import { ApiError, errorCodeOf, failure, toApiError, type RoomFailure } from '../common/errors.js';
import { pairSettingsOf } from '../common/pair.js';
import { parseRoomId } from '../common/room-id.js';
import { createWorkerApp, deferred, listenUrl, onClientGone, sendError, type Deferred } from '../api/worker-http.js';
import { createLogger, type Logger } from '../common/log.js';
import { sweepStaleStateFiles } from '../common/statefiles.js';
import { hold, holdsEnabled } from '../common/testhooks.js';
import { TraceTags } from '../common/trace-tags.js';
import { roomsByState, WorkerMetrics } from '../common/metrics.js';
import { loadEngine } from '../engine/index.js';
import type { Engine, SamplingParams, Slot } from '../engine/types.js';
import { newEpoch } from '../kv/auth.js';
import { KvServer, type PeerConn } from '../kv/channel.js';
import { encodeEnvelope } from '../kv/envelope.js';
import { RoomTable } from '../kv/lifecycle.js';
import { failureFromWire, type ControlMsg } from '../kv/messages.js';
import { KVPoll, type Effect, type RoomEvent, type RoomId } from '../kv/types.js';
import { checkSampling, fitSampling, samplingFromWire, tokenizeRequest } from '../api/requests.js';
import { answerWithFirstToken, firstTokenEvent } from './first-token.js';

interface Job {
  room: RoomId;
  rid: string;
  tokens: number[];
  sampling: SamplingParams;
  /** Fires when the room becomes terminal: stops prompt evaluation and the send. */
  ac: AbortController;
  conn?: PeerConn;
  /** The enveloped state while inflight (the KV buffer). Dropped on terminal. */
  blob?: Buffer;
  done: Deferred<PrefillResponse>;
  /** Set when the router asked for the first token before the handoff (`first_token_from_prefill`). */
  first?: Deferred<GenerateEvent>;
  /** What the worker is doing for the room right now (shown in /debug/rooms). */
  step: 'bootstrap' | 'queued' | 'computing' | 'sending' | 'awaiting_ack';
  t0: number;
  prefillMs: number;
  tKvBegin: number;
  /** Prompt tokens taken from the prefix cache (known once prompt evaluation finished). */
  cachedTokens: number;
}

interface PendingRegistration {
  conn: PeerConn;
  rid: string;
  at: number;
}

/** A running prefill worker. Create with `startPrefillWorker`. */
export class PrefillWorker {
  readonly rooms: RoomTable;
  readonly metrics: WorkerMetrics;
  readonly prefixMetrics: PrefixCacheMetrics;
  readonly epoch = newEpoch();
  /** Trace id per room, for /debug/rooms. */
  readonly traces = new TraceTags();
  private readonly jobs = new Map<RoomId, Job>();
  private readonly byRid = new Map<string, RoomId>();
  /** Rooms registered by decode before the router's request arrived here. Bounded, expires after bootstrapMs. */
  private readonly pendingRegs = new Map<RoomId, PendingRegistration>();
  /** FIFO of rooms waiting for a prefill slot. */
  private readonly waiting = new Set<RoomId>();
  private readonly conns = new Map<string, PeerConn>();
  private computing = 0;
  /**
   * TEST-ONLY fault injection, off unless PDSERVE_FAULT_LEAK_ROOM=1 (never set it in production).
   * The first room to get decode's kv_ack is leaked: the ack and every later event for that room
   * except `progress` are dropped, and each watchdog tick feeds it a zero-byte `progress` (a
   * zombie sender), so it stays Transferring in the inflight queue forever without passing its
   * deadline. It exists so the storm test can prove the storm's leak check fails and names the
   * room (test/e2e/storm.test.ts). A decode loss (failPeer) still fails the room.
   */
  private readonly faultLeak = process.env.PDSERVE_FAULT_LEAK_ROOM === '1' ? { room: undefined as RoomId | undefined } : undefined;
  private watchdog?: NodeJS.Timeout;
  app!: FastifyInstance;
  kv!: KvServer;
  url = '';
  bootstrapPort = 0;

  constructor(
    readonly config: PrefillConfig,
    readonly engine: Engine,
    readonly log: Logger,
  ) {
    // Prefill's bootstrap wait includes decode's wait for a free slot (prealloc), so its
    // deadline is the sum of both: a request queued at decode must not fail here first.
    this.rooms = new RoomTable('prefill', { ...config.timeouts, bootstrapMs: config.timeouts.preallocMs + config.timeouts.bootstrapMs });
    this.metrics = new WorkerMetrics('prefill', {
      queues: () => this.queueSizes(),
      roomsByState: () => roomsByState(this.rooms),
      channel: () => ({ ...(this.kv?.stats ?? {}) }),
    });
    this.prefixMetrics = new PrefixCacheMetrics(this.metrics.registry, () => this.engine.cachedStats());
  }

  /** Queue name → entries, derived from room phases (cannot drift). */
  queueSizes(): Record<string, number> {
    let bootstrap = 0;
    let inflight = 0;
    let waiting = 0;
    for (const r of this.rooms.rooms()) {
      if (r.phase === 'bootstrap') bootstrap++;
      else if (r.phase === 'waiting') waiting++;
      else if (r.phase === 'inflight') inflight++;
    }
    return { prefill_bootstrap_queue: bootstrap, prefill_waiting_queue: waiting, prefill_inflight_queue: inflight };
  }


  async start(): Promise<void> {
    const c = this.config;
    await sweepStaleStateFiles(c.stateDir, this.log);
    this.kv = new KvServer({
      host: c.host,
      port: c.bootstrapPort,
      secret: c.secret,
      epoch: this.epoch,
      settings: pairSettingsOf(this.engine.info),
      heartbeatMs: c.heartbeatMs,
      log: this.log.child({ part: 'kv' }),
      onMessage: (conn, msg) => this.onControl(conn, msg),
      onPeerLost: (conn, reason) => this.onPeerLost(conn, reason),
    });
    this.bootstrapPort = await this.kv.listen();
    this.app = createWorkerApp({
      engine: this.engine,
      log: this.log,
      registry: this.metrics.registry,
      modelName: this.engine.info.modelName,
      health: () => ({
        role: 'prefill',
        model: this.engine.info.modelName,
        fingerprint: this.engine.info.fingerprint,
        settings: pairSettingsOf(this.engine.info),
        bootstrap_host: c.bootstrapHost,
        bootstrap_port: this.bootstrapPort,
        epoch: this.epoch,
        slots: this.engine.info.sequences,
        slots_free: this.engine.slotsFree(),
        rooms: this.rooms.rooms().length,
        ...this.queueSizes(),
      }),
      debugRooms: () => {
        const snap = this.rooms.snapshot(Date.now());
        return this.traces.tag({ epoch: this.epoch, queues: this.queueSizes(), pending_registrations: this.pendingRegs.size, ...snap, live: snap.live.map((r) => ({ ...r, step: this.jobs.get(r.room)?.step ?? null, path: 'pd', cached_tokens: this.jobs.get(r.room)?.cachedTokens ?? 0 })) });
      },
    });
    this.app.post('/generate', (req, reply) => this.handleGenerate(req.body, reply));
    this.app.post('/abort_request', async (req) => {
      const b = (req.body ?? {}) as { rid?: unknown; bootstrap_room?: unknown };
      this.abort(typeof b.rid === 'string' ? b.rid : undefined, parseRoomId(b.bootstrap_room), 'router');
      return { ok: true };
    });
    this.url = await listenUrl(this.app, c.host, c.port);
    this.watchdog = setInterval(() => this.tick(), c.watchdogMs);
    this.watchdog.unref();
    this.log.info({ url: this.url, bootstrapPort: this.bootstrapPort, epoch: this.epoch }, 'prefill worker ready');
    if (holdsEnabled) this.log.warn({ holds: process.env.PDSERVE_TEST_HOLDS }, 'PDSERVE_TEST_HOLDS is set: test-only pauses are active');
  }

  /** Stop accepting, fail live rooms, close sockets, free the engine. Idempotent. */
  async close(): Promise<void> {
    if (this.watchdog) clearInterval(this.watchdog);
    this.watchdog = undefined;
    for (const r of this.rooms.rooms()) this.apply(r.id, { t: 'abort', from: 'local', failure: failure('shutting_down', 'prefill worker shutting down') });
    await this.app?.close().catch(() => {});
    await this.kv?.close();
    await this.engine.dispose();
  }

  // ---- lifecycle plumbing -------------------------------------------------------------------

  private apply(room: RoomId, ev: RoomEvent): void {
    if (this.faultLeak?.room === room && ev.t !== 'progress') return; // TEST-ONLY fault (faultLeak)
    this.run(this.rooms.apply(room, ev, Date.now()));
  }

  private tick(): void {
    const now = Date.now();
    for (const [room, p] of this.pendingRegs) {
      if (now - p.at > this.config.timeouts.bootstrapMs) {
        this.pendingRegs.delete(room);
        this.sendFail(p.conn, room, failure('registration_refused', `no request for this room reached prefill within ${this.config.timeouts.bootstrapMs} ms`));
        this.metrics.bootstrapFailed.inc({ reason: 'registration_refused' });
      }
    }
    const leaked = this.faultLeak?.room; // TEST-ONLY fault (faultLeak): the zombie sender
    if (leaked !== undefined && this.rooms.has(leaked)) this.apply(leaked, { t: 'progress', bytes: 0 });
    this.run(this.rooms.tick(now));
  }

  /** Perform the core's effects, in order. */
  private run(effects: Effect[]): void {
    for (const e of effects) {
      switch (e.t) {
        case 'notify_peer': {
          const conn = this.conns.get(e.peer);
          if (conn) this.sendFail(conn, e.room, e.failure);
          break;
        }
        case 'start_prefill': {
          const job = this.jobs.get(e.room);
          if (job) job.step = 'queued';
          this.waiting.add(e.room);
          this.pump();
          break;
        }
        case 'terminal':
          this.finish(e.room, e.state, e.failure);
          break;
        case 'illegal':
        case 'late':
        case 'expired':
          this.metrics.recordDiagnostic(e, this.log, this.traces.get(e.room));
          break;
        default:
          break;
      }
    }
  }

  /** The one release path of a room's resources (runs once: on the room's terminal effect). */
  private finish(room: RoomId, state: KVPoll, f: RoomFailure | undefined): void {
    const job = this.jobs.get(room);
    this.waiting.delete(room);
    if (!job) return;
    this.jobs.delete(room);
    if (this.byRid.get(job.rid) === room) this.byRid.delete(job.rid);
    job.ac.abort();
    job.blob = undefined;
    this.metrics.recordTerminal(state, f, job.conn !== undefined);
    if (state === KVPoll.Success) {
      this.metrics.kvSeconds.observe((Date.now() - job.tKvBegin) / 1000);
      job.done.resolve({
        rid: job.rid,
        meta_info: { prompt_tokens: job.tokens.length, cached_tokens: job.cachedTokens, kv_bytes: this.rooms.get(room)?.bytes ?? 0, prefill_ms: job.prefillMs, transfer_ms: Date.now() - job.tKvBegin },
      });
    } else {
      job.done.reject(ApiError.fromFailure(f ?? failure('internal_error', 'room failed')));
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
      tokens = tokenizeRequest(this.engine, body);
      sampling = fitSampling(this.engine, tokens.length, samplingFromWire(body.sampling_params));
      await checkSampling(this.engine, sampling);
    } catch (err) {
      return sendError(reply, toApiError(err));
    }
    if (this.rooms.has(body.bootstrap_room)) return sendError(reply, ApiError.of('duplicate_room', `room ${body.bootstrap_room} already exists`));
    // One live request per rid (as vLLM): a second one could never be aborted by rid.
    const other = this.byRid.get(body.rid);
    if (other !== undefined && this.jobs.has(other)) return sendError(reply, ApiError.of('duplicate_rid', `request id ${body.rid} is already running on this worker (room ${other})`, 'rid'));
    if (this.jobs.size >= this.config.maxRooms) return sendError(reply, new ApiError(503, 'queue_full', `prefill worker has ${this.jobs.size} live rooms (limit ${this.config.maxRooms})`, 'overloaded_error'));
    if (this.waiting.size >= this.config.maxWaiting) return sendError(reply, new ApiError(503, 'queue_full', `prefill waiting queue is full (${this.config.maxWaiting})`, 'overloaded_error'));
    const room = body.bootstrap_room;
    const job: Job = { room, rid: body.rid, tokens, sampling, ac: new AbortController(), done: deferred(), step: 'bootstrap', t0: Date.now(), prefillMs: 0, tKvBegin: 0, cachedTokens: 0, first: body.first_token_from_prefill ? deferred() : undefined };
    const trace = body.trace_id ?? body.rid;
    this.traces.set(room, trace);
    const log = this.log.child({ rid: body.rid, room, trace });
    let effects: Effect[];
    try {
      effects = this.rooms.create(room, body.rid, Date.now());
    } catch (err) {
      return sendError(reply, toApiError(err));
    }
    this.jobs.set(room, job);
    this.byRid.set(body.rid, room);
    log.debug({ tokens: tokens.length }, 'room created');
    this.run(effects);
    const pending = this.pendingRegs.get(room);
    if (pending) {
      this.pendingRegs.delete(room);
      this.register(pending.conn, room);
    }
    const off = onClientGone(reply, () => this.apply(room, { t: 'abort', from: 'router', failure: failure('request_aborted', 'the router closed the request') }));
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

  /** Abort by rid and/or room id; unknown ids leave a tombstone (when the room id is known). */
  abort(rid: string | undefined, room: RoomId | undefined, from: 'router' | 'local'): void {
    const id = room ?? (rid ? this.byRid.get(rid) : undefined);
    if (!id) return;
    if (this.rooms.has(id) || !this.rooms.get(id)) this.apply(id, { t: 'abort', from, failure: from === 'local' ? failure('shutting_down', 'aborted locally') : failure('request_aborted', `abort_request from the ${from}`) });
    this.pendingRegs.delete(id);
  }

  // ---- KV control channel ---------------------------------------------------------------------

  private onControl(conn: PeerConn, msg: ControlMsg): void {
    this.conns.set(conn.id, conn);
    switch (msg.type) {
      case 'register': {
        const live = this.jobs.has(msg.room);
        if (live) return this.register(conn, msg.room);
        const known = this.rooms.get(msg.room);
        if (known || this.rooms.isTombstoned(msg.room)) {
          this.sendFail(conn, msg.room, known?.failure ?? this.rooms.tombstone(msg.room)?.failure ?? failure('registration_refused', `room already ${known ? KVPoll[known.state] : 'failed'}`));
          return;
        }
        if (this.pendingRegs.size >= this.config.maxRooms) {
          this.sendFail(conn, msg.room, failure('registration_refused', `too many pending registrations (${this.config.maxRooms})`));
          return;
        }
        this.pendingRegs.set(msg.room, { conn, rid: msg.rid, at: Date.now() });
        return;
      }
      case 'kv_ack':
        if (this.faultLeak && this.faultLeak.room === undefined && this.rooms.has(msg.room)) {
          this.faultLeak.room = msg.room; // TEST-ONLY fault (faultLeak): drop the ack, leak the room
          this.log.warn({ room: msg.room }, 'FAULT INJECTION (PDSERVE_FAULT_LEAK_ROOM=1): leaking this room');
          return;
        }
        return this.apply(msg.room, { t: 'kv_done' });
      case 'fail':
        this.pendingRegs.delete(msg.room);
        return this.apply(msg.room, { t: 'abort', from: 'peer', failure: failureFromWire(msg, 'decode') });
      default:
        this.log.warn({ type: msg.type, peer: conn.id }, 'unexpected control message on prefill');
    }
  }

  private register(conn: PeerConn, room: RoomId): void {
    const job = this.jobs.get(room);
    if (!job) return;
    if (job.conn && job.conn !== conn) {
      this.sendFail(conn, room, failure('registration_refused', 'room already registered by another decode worker'));
      return;
    }
    job.conn = conn;
    const before = this.rooms.get(room)?.state;
    this.apply(room, { t: 'registered', peer: conn.id, peerEpoch: conn.peerEpoch });
    if (before === KVPoll.Bootstrapping && this.rooms.get(room)?.state === KVPoll.WaitingForInput) {
      conn.sendControl({ type: 'registered', room });
    }
  }

  private onPeerLost(conn: PeerConn, reason: string): void {
    this.conns.delete(conn.id);
    for (const [room, p] of this.pendingRegs) if (p.conn === conn) this.pendingRegs.delete(room);
    this.run(this.rooms.failPeer(conn.id, failure('peer_lost', reason), Date.now()));
  }

  /** Wire FAIL for a room: its RoomFailure, code and detail. */
  private sendFail(conn: PeerConn, room: RoomId, f: RoomFailure): void {
    conn.sendControl({ type: 'fail', room, code: f.code, detail: f.detail, epoch: this.epoch });
  }

  // ---- compute and send -----------------------------------------------------------------------

  /** Start prompt evaluation for waiting rooms while slots are free. */
  private pump(): void {
    while (this.waiting.size > 0) {
      const room = this.waiting.values().next().value as RoomId;
      // The prompt picks the idle sequence sharing its longest prefix (prefix cache).
      const slot = this.engine.tryAcquireSlot(this.jobs.get(room)?.tokens);
      if (!slot) return;
      this.waiting.delete(room);
      this.computing++;
      void this.compute(room, slot).finally(() => {
        this.computing--;
        this.pump();
      });
    }
  }

  private async compute(room: RoomId, slot: Slot): Promise<void> {
    const job = this.jobs.get(room);
    if (!job) {
      slot.release();
      return;
    }
    const path = join(this.config.stateDir, `pdserve-prefill-${process.pid}-${room}.ggsq`);
    let blob: Buffer;
    job.step = 'computing';
    try {
      await hold('prefill.compute', job.ac.signal);
      const t0 = Date.now();
      const r = await slot.prefill(job.tokens, job.sampling, job.ac.signal);
      job.cachedTokens = r.cachedTokens;
      this.prefixMetrics.recordLookup(r.promptTokens, r.cachedTokens);
      if (job.first) job.first.resolve(firstTokenEvent(job.rid, r.promptTokens, { ...(await slot.firstOutput(r.firstToken, job.sampling)), logprob: r.firstLogprob }, r.cachedTokens));
      await hold('prefill.save', job.ac.signal);
      if (job.ac.signal.aborted) return;
      await slot.saveState(path);
      const payload = await readFile(path);
      blob = encodeEnvelope(
        { fingerprint: this.engine.info.fingerprint, contextSize: this.engine.info.compat.contextSize, batchSize: this.engine.info.compat.batchSize, nTokens: r.promptTokens, firstToken: r.firstToken, cachedTokens: r.cachedTokens, firstIsEog: r.firstIsEog },
        payload,
      );
      job.prefillMs = Date.now() - t0;
    } catch (err) {
      const e = err as { code?: string; message?: string };
      if (e.code !== 'ABORTED') {
        const code = errorCodeOf(err);
        this.apply(room, { t: 'fail', failure: failure(code === 'internal_error' ? 'engine_failed' : code, `prefill: ${e.message ?? String(err)}`) });
      }
      return;
    } finally {
      slot.release();
      await rm(path, { force: true }).catch(() => {});
    }
    if (!this.jobs.has(room) || !job.conn) return;
    job.blob = blob;
    job.step = 'sending';
    job.tKvBegin = Date.now();
    this.apply(room, { t: 'kv_begin', totalBytes: blob.length });
    if (!this.jobs.has(room)) return;
    const conn = job.conn;
    if (!conn.sendControl({ type: 'kv_begin', room, totalBytes: blob.length })) {
      this.apply(room, { t: 'fail', failure: failure('kv_transfer_failed', 'connection to decode is gone') });
      return;
    }
    try {
      await conn.sendChunks(room, blob, {
        chunkBytes: this.config.chunkBytes,
        signal: job.ac.signal,
        stallMs: this.config.timeouts.transferIdleMs,
        onProgress: (bytes: number) => {
          this.metrics.kvBytes.inc(bytes);
          this.apply(room, { t: 'progress', bytes });
        },
      });
      job.blob = undefined;
      await hold('prefill.send', job.ac.signal);
      if (job.ac.signal.aborted) return;
      conn.sendControl({ type: 'kv_end', room });
      job.step = 'awaiting_ack';
    } catch (err) {
      if (!job.ac.signal.aborted) this.apply(room, { t: 'fail', failure: failure(errorCodeOf(err) === 'peer_lost' ? 'peer_lost' : 'kv_transfer_failed', (err as Error).message) });
    }
  }
}

/** Load the engine, start the worker. */
export async function startPrefillWorker(raw: unknown, log = createLogger('prefill')): Promise<PrefillWorker> {
  const config = parseConfig(PrefillConfigSchema, raw);
  const engine = await loadEngine({ ...config.engine, sequences: config.slots, prefixCache: prefixCacheOf(config.engine), log: (level: string, msg: string) => log.debug({ level }, msg) });
  const w = new PrefillWorker(config, engine, log);
  await w.start();
  return w;
}
