/**
 * Decode worker: the I/O shell around the sans-IO `DecodeDriver` (driver.ts). It accepts
 * `POST /generate` with bootstrap fields, dials prefill's bootstrap listener over the KV peer pool,
 * receives the enveloped state (validated completely — envelope + ggsq walk — before llama.cpp
 * sees a byte), loads it into a sequence slot and streams tokens (running batch: all slots of one
 * llama.cpp context, batched by node-llama-cpp). It makes no room decision itself: every input
 * goes to the driver, every `DecodeAction` it returns is performed here, in order. The simulator
 * runs the same driver over simulated I/O.
 *
 * Queues (SGLang's names): prealloc (waiting for a slot), transfer (slot held: registering,
 * waiting for or receiving KV, loading), running (generating). The engine slot is taken on the
 * driver's `assign_slot` and given back on its `release` — the one place, after any engine
 * call on it has settled.
 */
import type { FastifyInstance, FastifyReply } from 'fastify';
import { zodToApiError } from '../api/errors.js';
import { GenerateRequestSchema, type GenerateRequest } from '../protocol/worker-protocol.js';
import { DecodeConfigSchema, parseConfig, prefixCacheOf, type DecodeConfig } from '../runtime/config.js';
import { ApiError, errorCodeOf, failure, toApiError, type RoomFailure } from '../base/errors.js';
import { pairSettingsOf } from '../protocol/pair.js';
import { connectionHeader } from '../runtime/drain.js';
import { deferred, onClientGone, sendError, type Deferred } from '../worker/http.js';
import { systemClock, type Clock } from '../base/clock.js';
import { createLogger, type Logger } from '../base/log.js';
import { sweepStaleStateFiles } from '../runtime/statefiles.js';
import { hold, holdsEnabled } from '../runtime/testhooks.js';
import { TraceTags } from '../protocol/trace-tags.js';
import { roomsByState, WorkerMetrics } from '../runtime/metrics.js';
import { PrefixCacheMetrics } from '../runtime/prefix-metrics.js';
import { openPrefixStore } from '../runtime/prefix-store.js';
import { samplingFromWire } from '../api/requests.js';
import { loadEngine } from '../engine/index.js';
import type { Engine, SamplingParams, Slot } from '../engine/types.js';
import { newEpoch } from '../kv/auth.js';
import { KvPeerPool, type PeerConn } from '../kv/channel.js';
import { kvTransportOf } from '../kv/transport.js';
import { loadInternalTls } from '../runtime/tls.js';
import { BufferPool, FilePool, RECV_SPARE_BYTES, RECV_SPARE_FILES, TRANSFER_BUFFER_BYTES, TRANSFER_POOL_BUFFERS } from '../kv/transfer/pool.js';
import { GgsqStreamParser, parseStateHeaders, type ParsedState } from '../engine/ggsq.js';
import { StateReceiver, type ReceivedState, type StreamEnd } from '../kv/transfer/receiver.js';
import { sharedKvIo } from '../kv/transfer/io-thread.js';
import { SameHostDecode, type KvPath } from '../kv/transfer/same-host.js';
import { rm } from 'node:fs/promises';
import type { ControlMsg, EnvelopeHeader } from '../kv/messages.js';
import { KVPoll, type RoomId } from '../kv/types.js';
import { DecodeDriver, type ConnId, type DecodeAction, type PrefillAddr } from './driver.js';
import { localPrefill, planLocal, type DecodeStart, type LocalPlan } from './local.js';
import { DecodeSseWriter } from './sse-out.js';
import { KnownPrefills } from './known-prefills.js';
import { Counter } from 'prom-client';
import { KvEventLog } from '../protocol/kv-events.js';
import { serveWorkerEdge, type WorkerEdge } from '../worker/shell.js';
import { SequenceKvTracker } from '../worker/kv-tracker.js';

/** The shell's own per-request state: what the driver does not need (I/O handles, timings). */
interface Job {
  room: RoomId;
  rid: string;
  sampling: SamplingParams;
  /** The router has token 1 from prefill (`first_token_from_prefill`): stream from token 2. */
  skipFirst: boolean;
  host: string;
  port: number;
  /** Fires when the room fails or the client goes: stops the register hold, the load hold, generation. */
  ac: AbortController;
  slot?: Slot;
  /** The incoming state: validated and written to its file as the chunks arrive. */
  recv?: StateReceiver<ParsedState>;
  /** Decode-local continuation (./local.ts): the plan decode accepted; the room has no peer. */
  local?: LocalPlan;
  /** Resolves with the first token and prompt counts when generation may start (`generate`); rejects on `finish` Failed. */
  ready: Deferred<DecodeStart>;
  header?: EnvelopeHeader;
  /** Set when the KV is in the slot (PD: loaded from the envelope; local: evaluated here). */
  start?: DecodeStart;
  /** The router's conversation key (KV events name the kept sequence by it). */
  conversationKey?: string;
  /** The prompt's token ids (PD: the loaded state's; local: the plan's), for the kept sequence's KV event. */
  promptIds?: readonly number[];
  /** When KV_BEGIN arrived (ms), for pdserve_kv_transfer_seconds. */
  tKvBegin?: number;
  /** How the state came: 'tcp' (recv_begin) or 'same_host' (take_file); shown in /debug/rooms, counted at Success. */
  kvPath?: KvPath;
  t0: number;
}

/** A room's path for /debug/rooms: served by decode alone, or prefill → KV handoff → decode. */
const pathOf = (j: Job | undefined) => (j?.local ? 'decode_local' : 'pd');
/** Prompt tokens a room did not evaluate: loaded from prefill's cache, or reused locally. */
const cachedOf = (j: Job | undefined) => j?.start?.cachedTokens ?? j?.local?.reusable ?? 0;

/** A running decode worker. Create with `startDecodeWorker`. */
export class DecodeWorker {
  readonly driver: DecodeDriver;
  readonly metrics: WorkerMetrics;
  readonly prefixMetrics: PrefixCacheMetrics;
  readonly epoch = newEpoch();
  /** What this worker's cache tiers store and evict (GET /kv_events), same epoch as /health. */
  readonly kvEvents: KvEventLog;
  private readonly kvTracker: SequenceKvTracker | null;
  /** Trace id per room, for /debug/rooms. */
  readonly traces = new TraceTags();
  private readonly jobs = new Map<RoomId, Job>();
  /** Live connections by the id the driver knows them by (one id per connection object). */
  private readonly conns = new Map<ConnId, PeerConn>();
  private readonly connIds = new WeakMap<PeerConn, ConnId>();
  private connSeq = 0;
  /** Write buffers of the streaming receivers, reused across transfers. */
  private readonly kvPool = new BufferPool(TRANSFER_BUFFER_BYTES, TRANSFER_POOL_BUFFERS);
  /** Destination files of the streaming receivers, recycled after their load (tmpfs pages stay allocated). */
  private readonly recvFiles: FilePool;
  /** The shared HTTP edge (../worker/shell.ts): app, watchdog, sweeper. */
  private edge?: WorkerEdge;
  /** The same-host handoff (kv_file): per-connection probe, taking handed files over. */
  readonly sameHost: SameHostDecode;
  /** Prefill bootstrap addresses this worker may dial (--allow-prefill and the router's pool). */
  readonly knownPrefills: KnownPrefills;
  private readonly bootstrapRefused: Counter;
  app!: FastifyInstance;
  pool!: KvPeerPool;
  url = '';

  constructor(
    readonly config: DecodeConfig,
    readonly engine: Engine,
    readonly log: Logger,
    /** Monotonic time of every deadline, watchdog tick and elapsed figure; wall time for /debug/rooms dates. */
    readonly clock: Clock = systemClock,
  ) {
    this.driver = new DecodeDriver({ timeouts: config.timeouts, slots: engine.info.sequences, maxPrealloc: config.maxPrealloc, maxStateBytes: config.maxStateBytes }, this.epoch);
    this.metrics = new WorkerMetrics('decode', { queues: () => this.queueSizes(), roomsByState: () => roomsByState(this.rooms), channel: () => ({ ...(this.pool?.stats ?? {}) }) });
    this.prefixMetrics = new PrefixCacheMetrics(this.metrics.registry, () => this.engine.cachedStats());
    this.kvEvents = new KvEventLog({ epoch: this.epoch, registry: this.metrics.registry });
    this.kvTracker = engine.info.cacheSequences > 0 ? new SequenceKvTracker(engine, this.kvEvents) : null;
    this.recvFiles = new FilePool({ dir: config.stateDir, prefix: `pdserve-kvrecv-${process.pid}`, maxFiles: RECV_SPARE_FILES, maxBytes: RECV_SPARE_BYTES });
    this.knownPrefills = new KnownPrefills(config.allowPrefill);
    this.bootstrapRefused = new Counter({ name: 'pdserve_bootstrap_refused_total', help: 'Requests refused because their bootstrap address is not a prefill this decode worker knows', registers: [this.metrics.registry] });
    this.sameHost = new SameHostDecode({ enabled: config.kvSameHost, verify: config.kvSameHostVerify, stateDir: config.stateDir, log: this.log.child({ part: 'kv' }) });
  }

  /** The driver's room table (the lifecycle core). */
  get rooms() {
    return this.driver.rooms;
  }

  /** Queue name → entries. prealloc and transfer derive from room phases; running is the batch. */
  queueSizes(): Record<string, number> {
    return this.driver.queueSizes();
  }

  async start(): Promise<void> {
    const c = this.config;
    const internalTls = loadInternalTls(c.internalTls);
    this.pool = new KvPeerPool({
      transport: kvTransportOf(internalTls),
      clock: this.clock,
      secret: c.secret,
      epoch: this.epoch,
      settings: pairSettingsOf(this.engine.info),
      heartbeatMs: c.heartbeatMs,
      connectTimeoutMs: c.connectTimeoutMs,
      streams: c.kvStreams,
      log: this.log.child({ part: 'kv' }),
      onMessage: (conn, msg) => this.onControl(conn, msg),
      onChunk: (conn, room, offset, data) => this.onChunk(conn, room, offset, data),
      onPeerLost: (conn, reason) => {
        const id = this.connIds.get(conn);
        if (id === undefined) return;
        this.conns.delete(id);
        this.perform(this.driver.peerLost(id, reason, this.clock.nowMs()));
        // A prefill killed after handing a file over leaves it under its dead pid: sweep now and
        // once more shortly (its exit may not be complete yet).
        void sweepStaleStateFiles(c.stateDir, this.log);
        setTimeout(() => void sweepStaleStateFiles(c.stateDir, this.log), 1000).unref();
      },
      onConnect: (conn) => this.sameHost.probe(conn),
    });
    this.edge = await serveWorkerEdge({
      role: 'decode',
      engine: this.engine,
      epoch: this.epoch,
      config: c,
      internalTls,
      log: this.log,
      registry: this.metrics.registry,
      kvEvents: this.kvEvents,
      onSignedProbe: (q) => {
        if (typeof q.prefill_pool === 'string') this.knownPrefills.learn(q.prefill_pool.split(','), this.clock.nowMs());
      },
      liveRooms: () => this.rooms.rooms().length,
      queues: () => this.queueSizes(),
      debugRooms: () => {
        const snap = this.rooms.snapshot(this.clock.nowMs(), this.clock.wallMs());
        const decoding = [...this.jobs.values()].filter((j) => this.driver.step(j.room) === 'decoding').map((j) => ({ room: j.room, rid: j.rid, age_ms: Math.round(this.clock.nowMs() - j.t0), path: pathOf(j), kv_path: j.kvPath ?? null, cached_tokens: cachedOf(j) }));
        return this.traces.tag({ epoch: this.epoch, queues: this.queueSizes(), ...snap, live: snap.live.map((r) => ({ ...r, step: this.driver.step(r.room), path: pathOf(this.jobs.get(r.room)), kv_path: this.jobs.get(r.room)?.kvPath ?? null, cached_tokens: cachedOf(this.jobs.get(r.room)) })), decoding });
      },
      generate: (body, reply) => this.handleGenerate(body, reply),
      abort: (rid, room) => this.abort(rid, room, 'router'),
      tick: () => this.perform(this.driver.tick(this.clock.nowMs())),
    });
    this.app = this.edge.app;
    this.url = this.edge.url;
    this.log.info({ url: this.url, epoch: this.epoch }, 'decode worker ready');
  }

  async close(): Promise<void> {
    this.edge?.stop();
    this.kvTracker?.close();
    this.recvFiles.close(); // spares deleted now (a hung close is cut short); a receiver still holding a file deletes it when it lets go
    this.perform(this.driver.shutdown(this.clock.nowMs()));
    for (const j of this.jobs.values()) j.ac.abort();
    await this.app?.close().catch(() => {});
    await this.pool?.close();
    await this.engine.dispose();
  }

  /** Abort by room id and/or rid (router, client gone, local); also stops a generation in progress. */
  abort(rid: string | undefined, room: RoomId | undefined, from: 'router' | 'client' | 'local'): void {
    const id = room ?? (rid !== undefined ? this.driver.roomOfRid(rid) : undefined);
    this.perform(this.driver.abort(rid, room, from, this.clock.nowMs()));
    if (id !== undefined) this.jobs.get(id)?.ac.abort();
  }

  // ---- the driver's actions ------------------------------------------------------------------

  /** Perform the driver's actions, in order. */
  private perform(actions: DecodeAction[]): void {
    for (const a of actions) {
      switch (a.a) {
        case 'assign_slot': {
          const job = this.jobs.get(a.room);
          // A local room's prompt picks the kept sequence holding its prefix.
          const slot = this.engine.tryAcquireSlot(job?.local?.tokens);
          if (job && slot) job.slot = slot;
          else {
            slot?.release();
            this.log.error({ room: a.room }, 'the engine had no free sequence for a slot the driver handed out');
            this.perform(this.driver.fail(a.room, failure('engine_failed', 'no free decode sequence'), this.clock.nowMs()));
          }
          break;
        }
        case 'release': {
          const job = this.jobs.get(a.room);
          if (a.slot) job?.slot?.release();
          if (job) this.traces.note(a.room, { path: pathOf(job), kv_path: job.kvPath ?? null, cached_tokens: cachedOf(job) }); // kept for its `recent` row
          this.jobs.delete(a.room);
          break;
        }
        case 'dial':
          void this.dial(a.room, a.addr);
          break;
        case 'register':
          if (!this.conns.get(a.conn)?.sendControl(a.msg)) this.perform(this.driver.registerFailed(a.room, failure('peer_lost', 'connection closed before register'), this.clock.nowMs()));
          break;
        case 'send':
          this.send(a);
          break;
        case 'recv_begin':
          this.recvBegin(a.room, a.totalBytes, a.hintBytes);
          break;
        case 'load':
          void this.load(a.room, a.end);
          break;
        case 'local_prefill':
          void this.runLocal(a.room);
          break;
        case 'take_file':
          void this.takeFile(a.room, a.msg);
          break;
        case 'generate': {
          const job = this.jobs.get(a.room);
          if (job?.start) job.ready.resolve(job.start);
          else this.perform(this.driver.generationDone(a.room, this.clock.nowMs()));
          break;
        }
        case 'finish':
          this.finish(a);
          break;
        case 'diag':
          this.metrics.recordDiagnostic(a.effect, this.log, this.traces.get(a.effect.room));
          break;
        case 'stray':
          this.log.debug({ room: a.room, peer: a.conn, type: a.what }, 'message for a room not registered on this connection: ignored');
          break;
      }
    }
  }

  /** The one answer per room (the driver's `finish`): metrics, receive buffer, the request's promise. */
  private finish(a: Extract<DecodeAction, { a: 'finish' }>): void {
    const job = this.jobs.get(a.room);
    this.metrics.recordTerminal(a.state, a.failure, a.registered);
    if (!job) return;
    if (job.recv && a.state !== KVPoll.Success) void job.recv.discard();
    if (a.state === KVPoll.Success) {
      if (job.tKvBegin) this.metrics.kvSeconds.observe((this.clock.nowMs() - job.tKvBegin) / 1000);
      if (job.kvPath) this.metrics.kvHandoffs.inc({ path: job.kvPath }); // decode-local rooms had no handoff
      return; // the stream starts on `generate`
    }
    job.ac.abort();
    job.ready.reject(ApiError.fromFailure(a.failure ?? failure('internal_error', 'room failed')));
  }

  /** A control message to prefill: on its connection if alive, else (with `addr`) on a pooled one — opened if needed. */
  private send(a: Extract<DecodeAction, { a: 'send' }>): void {
    const conn = a.conn !== undefined ? this.conns.get(a.conn) : undefined;
    if (conn?.alive) {
      conn.sendControl(a.msg);
      return;
    }
    if (a.addr === undefined) return;
    const { host, port } = splitAddr(a.addr);
    this.pool.get(host, port).then(
      (c) => void c.sendControl(a.msg),
      (err: Error) => this.log.debug({ room: a.room, prefill: a.addr, err: err.message }, 'could not tell prefill about a failed room'),
    );
  }

  // ---- the channel port -----------------------------------------------------------------------

  /** The id the driver knows `conn` by (a new id per connection object). */
  private idOf(conn: PeerConn): ConnId {
    let id = this.connIds.get(conn);
    if (id === undefined) {
      id = `${conn.id}/${++this.connSeq}`;
      this.connIds.set(conn, id);
      this.conns.set(id, conn);
    }
    return id;
  }

  /** The driver's `dial`: open (or reuse) the pooled connection to the room's prefill; answer `dialed` / `registerFailed`. */
  private async dial(room: RoomId, addr: PrefillAddr): Promise<void> {
    const job = this.jobs.get(room);
    if (!job) return;
    await hold('decode.register', job.ac.signal);
    let conn: PeerConn;
    try {
      conn = await this.pool.get(job.host, job.port);
    } catch (err) {
      const code = errorCodeOf(err) === 'settings_mismatch' ? 'settings_mismatch' : 'peer_unreachable';
      this.perform(this.driver.registerFailed(room, failure(code, `cannot pair with prefill ${addr}: ${(err as Error).message}`), this.clock.nowMs()));
      return;
    }
    // A new connection's same-host probe settles first (bounded), so its first room can use it.
    await this.sameHost.ready(conn);
    this.perform(this.driver.dialed(room, this.idOf(conn), this.clock.nowMs()));
  }

  private onControl(conn: PeerConn, msg: ControlMsg): void {
    switch (msg.type) {
      case 'registered':
      case 'kv_begin':
      case 'kv_end':
      case 'kv_file':
      case 'fail':
        this.perform(this.driver.message(this.idOf(conn), conn.peerEpoch, msg, this.clock.nowMs()));
        return;
      case 'same_host_reply':
        this.sameHost.onReply(conn, msg);
        return;
      default:
        this.log.warn({ type: msg.type, peer: conn.id }, 'unexpected control message on decode');
    }
  }

  /** The driver's `recv_begin`: a streamed receiver that validates and writes the state as it comes. */
  private recvBegin(room: RoomId, totalBytes: number, hintBytes?: number): void {
    const job = this.jobs.get(room);
    if (!job) return;
    const info = this.engine.info;
    job.recv = new StateReceiver({
      totalBytes,
      ...(hintBytes !== undefined ? { streamed: { hintBytes } } : {}),
      expect: { fingerprint: info.fingerprint, contextSize: info.compat.contextSize, batchSize: info.compat.batchSize, maxPayloadBytes: this.config.maxStateBytes },
      walker: (n: number) => new GgsqStreamParser({ contextSize: info.compat.contextSize, nLayer: info.compat.nLayer, maxBytes: n, nVocab: info.nVocab }),
      files: this.recvFiles,
      pool: this.kvPool,
      io: sharedKvIo(),
    });
    job.kvPath = 'tcp';
    job.tKvBegin = this.clock.nowMs();
  }

  private onChunk(conn: PeerConn, room: RoomId, offset: number, data: Buffer): void {
    const { store, actions } = this.driver.chunk(this.idOf(conn), room, offset, data.length, this.clock.nowMs());
    if (store) {
      const recv = this.jobs.get(room)?.recv;
      try {
        if (!recv) throw new Error('no receiver for an accepted chunk');
        recv.push(data, conn);
        this.metrics.kvBytes.inc(data.length);
      } catch (err) {
        this.perform(actions);
        this.perform(this.driver.fail(room, failure('bad_state', (err as Error).message), this.clock.nowMs()));
        return;
      }
    }
    this.perform(actions);
  }

  // ---- the engine port ------------------------------------------------------------------------

  /** The driver's `load`: finish the streamed receive (complete, checksum, structure end, file written), load it into the slot. */
  private async load(room: RoomId, end?: StreamEnd): Promise<void> {
    const job = this.jobs.get(room);
    const recv = job?.recv;
    if (!job || !recv) return this.perform(this.driver.loadFailed(room, failure('internal_error', 'load without a receiver'), this.clock.nowMs()));
    // after the load settled nothing reads the file: it goes back to the spare files (a failure
    // meanwhile — finish Failed — discards it, deleting a file a running load may still read)
    await this.loadInto(job, () => recv.finish(end), () => recv.done());
  }

  /**
   * The driver's `take_file` (same host): take the handed file over and validate it
   * (transfer/same-host.ts: size, envelope head, ggsq headers; the data bytes' CRC-32 too with
   * --kv-same-host-verify), then load it as a received one. Refused (still prefill's) →
   * `fileRefused` (prefill sends over TCP); a bad file → `loadFailed`.
   */
  private async takeFile(room: RoomId, msg: Extract<ControlMsg, { type: 'kv_file' }>): Promise<void> {
    const job = this.jobs.get(room);
    if (!job) return this.perform(this.driver.loadFailed(room, failure('internal_error', 'kv_file without a request'), this.clock.nowMs()));
    job.kvPath = 'same_host';
    await hold('decode.take', job.ac.signal);
    // The room over: the file stays prefill's (it deletes it, or the sweep once it is gone).
    const over = this.driver.proceed(room, 'take', this.clock.nowMs());
    if (over) return this.perform(over);
    const info = this.engine.info;
    let taken: ReceivedState<ParsedState>;
    try {
      const out = this.sameHost.take(msg, {
        expect: { fingerprint: info.fingerprint, contextSize: info.compat.contextSize, batchSize: info.compat.batchSize, maxPayloadBytes: this.config.maxStateBytes },
        headers: (file) => parseStateHeaders(file, { contextSize: info.compat.contextSize, nLayer: info.compat.nLayer, nVocab: info.nVocab, maxBytes: this.config.maxStateBytes }),
        walker: (n: number) => new GgsqStreamParser({ contextSize: info.compat.contextSize, nLayer: info.compat.nLayer, maxBytes: n, nVocab: info.nVocab }),
        pool: this.kvPool,
      });
      if ('refused' in out) {
        this.metrics.kvFileRefused.inc();
        this.log.warn({ room, reason: out.refused }, 'state file (kv_file) refused: asking prefill for TCP');
        return this.perform(this.driver.fileRefused(room, out.refused, this.clock.nowMs()));
      }
      taken = out.taken;
    } catch (err) {
      return this.perform(this.driver.loadFailed(room, failure('bad_state', (err as Error).message), this.clock.nowMs()));
    }
    job.tKvBegin = this.clock.nowMs();
    this.perform(this.driver.fileTaken(room, msg.payloadBytes, this.clock.nowMs()));
    await this.loadInto(job, async () => taken, () => rm(taken.path, { force: true }).catch(() => {}));
  }

  /** Load the validated state `get` yields into the slot; answer `loadDone` / `loadFailed`; `cleanup` deletes its file, whatever happened. */
  private async loadInto(job: Job, get: () => Promise<ReceivedState<ParsedState>>, cleanup: () => Promise<void>): Promise<void> {
    const { room } = job;
    try {
      await hold('decode.load', job.ac.signal);
      const over = this.driver.proceed(room, 'load', this.clock.nowMs());
      if (over) return this.perform(over);
      const { header, state, path } = await get();
      if (state.nTokens !== header.nTokens) throw Object.assign(new Error(`state holds ${state.nTokens} tokens, envelope says ${header.nTokens}`), { code: 'BAD_STATE' });
      const gone = this.driver.proceed(room, 'load', this.clock.nowMs());
      if (gone || !job.slot) return this.perform(gone ?? this.driver.loadFailed(room, failure('internal_error', 'no engine slot for the load'), this.clock.nowMs()));
      // the walk above covered this file (ours): llama.cpp loads it as it is, re-framed in place
      await job.slot.loadState(path, state.tokens, state);
      job.promptIds = state.tokens;
      job.header = header;
      job.start = { promptTokens: header.nTokens, cachedTokens: header.cachedTokens ?? 0, firstToken: header.firstToken };
      this.perform(this.driver.loadDone(room, this.clock.nowMs()));
    } catch (err) {
      const e = err as { code?: string; message?: string };
      this.perform(this.driver.loadFailed(room, failure(e.code === 'BAD_ENVELOPE' || e.code === 'BAD_STATE' ? 'bad_state' : 'engine_failed', e.message ?? String(err)), this.clock.nowMs()));
    } finally {
      await cleanup();
    }
  }

  /** The driver's `local_prefill`: evaluate the uncached suffix on the room's slot (./local.ts); answer `loadDone` / `loadFailed`. */
  private async runLocal(room: RoomId): Promise<void> {
    const job = this.jobs.get(room);
    if (!job?.local || !job.slot) return this.perform(this.driver.loadFailed(room, failure('internal_error', 'local prefill without a plan or slot'), this.clock.nowMs()));
    try {
      await hold('decode.local_prefill', job.ac.signal);
      const over = this.driver.proceed(room, 'local_prefill', this.clock.nowMs());
      if (over) return this.perform(over);
      const start = await localPrefill(job.slot, job.local, job.ac.signal);
      job.start = start;
      this.prefixMetrics.recordLookup(start.promptTokens, start.cachedTokens, start.cacheTier);
      this.perform(this.driver.loadDone(room, this.clock.nowMs()));
    } catch (err) {
      const e = toApiError(err);
      this.perform(this.driver.loadFailed(room, failure(e.status < 500 ? (e.code as RoomFailure['code']) : 'engine_failed', e.message), this.clock.nowMs()));
    }
  }

  // ---- HTTP -----------------------------------------------------------------------------------

  private async handleGenerate(raw: unknown, reply: FastifyReply): Promise<void> {
    const parsed = GenerateRequestSchema.safeParse(raw);
    if (!parsed.success) return sendError(reply, zodToApiError(parsed.error));
    const body: GenerateRequest = parsed.data;
    const room = body.bootstrap_room;
    // Decode-local continuation: decided before any room exists (409 needs_prefill → the router
    // runs the PD path on the same pair; prefill never saw the request).
    let local: LocalPlan | undefined;
    if (body.local_prefill) {
      try {
        local = await planLocal(this.engine, body, this.config.localPrefillMaxTokens, this.engine.info.cacheSequences > 0);
      } catch (err) {
        const e = toApiError(err);
        // why a decode-local attempt goes back to PD (the router counts a fallback)
        if (e.code === 'needs_prefill') this.log.info({ rid: body.rid, conversation: body.conversation_key ?? null, reason: e.message }, 'decode-local refused: needs prefill');
        return sendError(reply, e);
      }
    }
    const job: Job = {
      room,
      rid: body.rid,
      sampling: local?.sampling ?? samplingFromWire(body.sampling_params, body.resume_token_ids),
      skipFirst: !local && body.first_token_from_prefill,
      host: body.bootstrap_host,
      port: body.bootstrap_port,
      ac: new AbortController(),
      ready: deferred(),
      t0: this.clock.nowMs(),
    };
    if (local) job.local = local;
    // Never dial an address the router's pool (or --allow-prefill) does not name: a forged
    // bootstrap address is refused here, before any room or connection exists.
    if (!local && !this.knownPrefills.allows(body.bootstrap_host, body.bootstrap_port, this.clock.nowMs())) {
      this.bootstrapRefused.inc();
      return sendError(reply, ApiError.of('unknown_bootstrap_address', 'bootstrap_host:bootstrap_port is not a prefill worker this decode worker knows (the router\'s pool or --allow-prefill)', 'bootstrap_host'));
    }
    if (body.conversation_key !== undefined) job.conversationKey = body.conversation_key;
    const admitted = this.driver.request(room, body.rid, `${body.bootstrap_host}:${body.bootstrap_port}`, this.clock.nowMs(), { local: local !== undefined });
    if (admitted.refused) {
      // Refusals before the room exists still reach prefill, or its room waits out a deadline: the driver's `send`.
      this.perform(admitted.actions);
      return sendError(reply, admitted.refused);
    }
    this.jobs.set(room, job);
    this.traces.set(room, body.trace_id ?? body.rid);
    this.log.debug({ rid: body.rid, room, trace: body.trace_id ?? body.rid }, 'room created');
    const off = onClientGone(reply, () => this.abort(undefined, room, 'client'));
    try {
      this.perform(admitted.actions);
      let start: DecodeStart;
      try {
        start = await job.ready.promise;
      } catch (err) {
        return sendError(reply, toApiError(err));
      }
      try {
        await this.stream(job, start, reply);
      } finally {
        this.perform(this.driver.generationDone(room, this.clock.nowMs()));
      }
    } finally {
      off();
    }
  }

  /**
   * Generate from the loaded slot and write SSE events until finish, abort or client loss. The
   * events of one event-loop turn leave in one write (./sse-out.ts); a token is never held past
   * the turn it was generated in.
   */
  private async stream(job: Job, start: DecodeStart, reply: FastifyReply): Promise<void> {
    const res = reply.raw;
    reply.hijack();
    res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache', connection: connectionHeader(res) });
    // A migrated request's loaded state also holds its resumed tokens: completion tokens, counted on.
    const resumed = job.sampling.resumed?.length ?? 0;
    const out = new DecodeSseWriter(res, { rid: job.rid, promptTokens: start.promptTokens - resumed, cachedTokens: start.cachedTokens }, this.config.timeouts.transferIdleMs);
    this.prefixMetrics.requestsByPath.inc({ path: job.local ? 'decode_local' : 'pd' });
    let n = 0;
    const gen = job.slot!.generate(start.firstToken, job.sampling, job.ac.signal);
    const prompt = job.local?.tokens ?? job.promptIds;
    const ids: number[] = [];
    try {
      let finish: 'stop' | 'length' | 'abort' = 'abort';
      for (;;) {
        if (holdsEnabled) await hold('decode.step', job.ac.signal);
        const r = await gen.next();
        if (r.done) {
          finish = r.value;
          break;
        }
        if (prompt && job.conversationKey) ids.push(r.value.token);
        n++;
        if (n === 1 && job.skipFirst) continue; // the client has it from prefill; same text state here
        // local path: decode sampled token 1 itself, with its logprob (generate() knows none for it)
        out.token(n === 1 && start.firstLogprob ? { ...r.value, logprob: start.firstLogprob } : r.value, resumed + n);
        const ok = out.writable();
        if (ok !== true && !(await ok)) job.ac.abort();
      }
      out.finish(resumed + n, finish);
      if (finish !== 'abort' && prompt && job.conversationKey) this.kvTracker?.noteFinished(job.conversationKey, [...prompt, ...ids], prompt.length);
    } catch (err) {
      out.error(toApiError(err));
    } finally {
      await gen.return('abort').catch(() => {});
      out.end();
    }
  }
}

/** "host:port" (the host may be an IPv6 literal) → its parts. */
function splitAddr(addr: PrefillAddr): { host: string; port: number } {
  const i = addr.lastIndexOf(':');
  return { host: addr.slice(0, i), port: Number(addr.slice(i + 1)) };
}

/** Load the engine, start the worker. */
export async function startDecodeWorker(raw: unknown, log = createLogger('decode')): Promise<DecodeWorker> {
  const config = parseConfig(DecodeConfigSchema, raw);
  // Decode keeps finished sequences (prompt + reply KV) for decode-local continuation when on.
  const prefixCache = config.localPrefillMaxTokens > 0 ? prefixCacheOf(config.engine) : undefined;
  const store = prefixCache ? openPrefixStore(config.engine, config.stateDir, { write: true, maxFileBytes: config.maxStateBytes, log }) : undefined;
  const engine = await loadEngine({ ...config.engine, sequences: config.slots, ...(prefixCache ? { prefixCache } : {}), ...(store ? { prefixStore: store } : {}), log: (level: string, msg: string) => log.debug({ level }, msg) });
  const w = new DecodeWorker(config, engine, log);
  store?.registerMetrics(w.metrics.registry, (hit) => w.prefixMetrics.recordTier('store', hit));
  store?.onEvent((e) => w.kvEvents.publish(e));
  await w.start();
  return w;
}
