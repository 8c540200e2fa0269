/**
 * Decode worker: accepts `POST /generate` with bootstrap fields, reserves a sequence slot
 * (prealloc queue), registers the room with the prefill worker over the KV channel, receives the
 * enveloped state (transfer queue), validates it completely (envelope + ggsq walk) before
 * llama.cpp sees a byte, loads it into the slot and streams tokens (running batch: all slots of
 * one llama.cpp context, batched by node-llama-cpp).
 *
 * Room state lives only in the lifecycle core (`RoomTable`). The slot is released in exactly one
 * place: the `finally` of the request handler, after any engine call on it has settled.
 */
import { join } from 'node:path';
import type { FastifyInstance, FastifyReply } from 'fastify';
import { zodToApiError } from '../api/openai.js';
import { GenerateRequestSchema, type GenerateEvent, type GenerateRequest, tokenEvent } from '../api/worker-protocol.js';
import { DecodeConfigSchema, parseConfig, servedModelNamesOf, type DecodeConfig } from '../common/config.js';
import { ApiError, errorCodeOf, failure, toApiError, type RoomFailure } from '../common/errors.js';
import { pairSettingsOf } from '../common/pair.js';
import { checkAnnounced, KvReception } from './receive.js';
import { parseRoomId } from '../common/room-id.js';
import { createWorkerApp, deferred, listenUrl, onClientGone, sendError, type Deferred } from '../api/worker-http.js';
import { createLogger, type Logger } from '../common/log.js';
import { sweepStaleStateFiles } from '../common/statefiles.js';
import { hold, holdsEnabled } from '../common/testhooks.js';
import { TraceTags } from '../common/trace-tags.js';
import { roomsByState, WorkerMetrics } from '../common/metrics.js';
import { PrefixCacheMetrics } from '../common/prefix-metrics.js';
import { samplingFromWire } from '../api/requests.js';
import { loadEngine } from '../engine/index.js';
import type { Engine, SamplingParams, Slot } from '../engine/types.js';
import { newEpoch } from '../kv/auth.js';
import { KvPeerPool, type PeerConn } from '../kv/channel.js';
import { BufferPool, TRANSFER_BUFFER_BYTES, TRANSFER_POOL_BUFFERS } from '../kv/transfer/pool.js';
import { GgsqStreamParser, type ParsedState } from '../engine/ggsq.js';
import { StateReceiver } from '../kv/transfer/receiver.js';
import { RoomTable } from '../kv/lifecycle.js';
import { failureFromWire, type ControlMsg, type EnvelopeHeader } from '../kv/messages.js';
import { KVPoll, type Effect, type RoomEvent, type RoomId } from '../kv/types.js';

interface Job {
  room: RoomId;
  rid: string;
  sampling: SamplingParams;
  /** The router has token 1 from prefill (`first_token_from_prefill`): stream from token 2. */
  skipFirst: boolean;
  /** "host:port" of the prefill bootstrap listener; also the room's peer key. */
  peerKey: string;
  host: string;
  port: number;
  ac: AbortController;
  slot?: Slot;
  conn?: PeerConn;
  /** The incoming state: validated and written to its file as the chunks arrive. */
  recv?: StateReceiver<ParsedState>;
  /** The shared reception rule (in order, inside the announced size), see decode/receive.ts. */
  rx?: KvReception;
  /** In-flight engine load, awaited before the slot is released. */
  loading?: Promise<void>;
  /** Resolves with the envelope header when the room reaches Success. */
  ready: Deferred<EnvelopeHeader>;
  header?: EnvelopeHeader;
  /** When KV_BEGIN arrived (ms), for pdserve_kv_transfer_seconds. */
  tKvBegin?: number;
  /** What the worker is doing for the request right now (shown in /debug/rooms). */
  step: 'prealloc' | 'registering' | 'waiting_kv' | 'receiving' | 'loading' | 'decoding';
  t0: number;
}

/** A running decode worker. Create with `startDecodeWorker`. */
export class DecodeWorker {
  readonly rooms: RoomTable;
  readonly metrics: WorkerMetrics;
  readonly prefixMetrics: PrefixCacheMetrics;
  readonly epoch = newEpoch();
  /** Trace id per room, for /debug/rooms. */
  readonly traces = new TraceTags();
  private readonly jobs = new Map<RoomId, Job>();
  private readonly byRid = new Map<string, RoomId>();
  /** FIFO of rooms waiting for a free slot. */
  private readonly prealloc = new Set<RoomId>();
  /** Requests generating tokens now. */
  private running = 0;
  /** Write buffers of the streaming receivers, reused across transfers. */
  private readonly kvPool = new BufferPool(TRANSFER_BUFFER_BYTES, TRANSFER_POOL_BUFFERS);
  private watchdog?: NodeJS.Timeout;
  app!: FastifyInstance;
  pool!: KvPeerPool;
  url = '';

  constructor(
    readonly config: DecodeConfig,
    readonly engine: Engine,
    readonly log: Logger,
  ) {
    this.rooms = new RoomTable('decode', config.timeouts);
    this.metrics = new WorkerMetrics('decode', { queues: () => this.queueSizes(), roomsByState: () => roomsByState(this.rooms), channel: () => ({ ...(this.pool?.stats ?? {}) }) });
    this.prefixMetrics = new PrefixCacheMetrics(this.metrics.registry);
  }

  /** Queue name → entries. prealloc and transfer derive from room phases; running is the batch. */
  queueSizes(): Record<string, number> {
    let prealloc = 0;
    let transfer = 0;
    for (const r of this.rooms.rooms()) {
      if (r.phase === 'prealloc') prealloc++;
      else transfer++;
    }
    return { decode_prealloc_queue: prealloc, decode_transfer_queue: transfer, decode_running: this.running, decode_slots_used: this.engine.info.sequences - this.engine.slotsFree() };
  }


  async start(): Promise<void> {
    const c = this.config;
    await sweepStaleStateFiles(c.stateDir, this.log);
    this.pool = new KvPeerPool({
      secret: c.secret,
      epoch: this.epoch,
      settings: pairSettingsOf(this.engine.info),
      heartbeatMs: c.heartbeatMs,
      connectTimeoutMs: c.connectTimeoutMs,
      log: this.log.child({ part: 'kv' }),
      onMessage: (conn, msg) => this.onControl(conn, msg),
      onChunk: (conn, room, offset, data) => this.onChunk(conn, room, offset, data),
      onPeerLost: (conn, reason) => this.onPeerLost(conn, reason),
    });
    this.app = createWorkerApp({
      log: this.log,
      registry: this.metrics.registry,
      modelNames: servedModelNamesOf(c.engine, this.engine.info.modelName),
      health: () => ({
        role: 'decode',
        model: servedModelNamesOf(c.engine, this.engine.info.modelName)[0],
        fingerprint: this.engine.info.fingerprint,
        settings: pairSettingsOf(this.engine.info),
        epoch: this.epoch,
        slots: this.engine.info.sequences,
        slots_free: this.engine.slotsFree(),
        rooms: this.rooms.rooms().length,
        ...this.queueSizes(),
      }),
      debugRooms: () => {
        const snap = this.rooms.snapshot(Date.now());
        const decoding = [...this.jobs.values()].filter((j) => j.step === 'decoding').map((j) => ({ room: j.room, rid: j.rid, age_ms: Date.now() - j.t0, path: 'pd', cached_tokens: j.header?.cachedTokens ?? 0 }));
        return this.traces.tag({ epoch: this.epoch, queues: this.queueSizes(), ...snap, live: snap.live.map((r) => ({ ...r, step: this.jobs.get(r.room)?.step ?? null, path: 'pd', cached_tokens: this.jobs.get(r.room)?.header?.cachedTokens ?? 0 })), decoding });
      },
    });
    this.app.post('/generate', (req, reply) => this.handleGenerate(req.body, reply));
    this.app.post('/abort_request', async (req) => {
      const b = (req.body ?? {}) as { rid?: unknown; bootstrap_room?: unknown };
      const id = parseRoomId(b.bootstrap_room) ?? (typeof b.rid === 'string' ? this.byRid.get(b.rid) : undefined);
      if (id) this.abort(id, 'router');
      return { ok: true };
    });
    this.url = await listenUrl(this.app, c.host, c.port);
    this.watchdog = setInterval(() => this.run(this.rooms.tick(Date.now())), c.watchdogMs);
    this.watchdog.unref();
    this.log.info({ url: this.url, epoch: this.epoch }, 'decode worker ready');
    if (holdsEnabled) this.log.warn({ holds: process.env.PDSERVE_TEST_HOLDS }, 'PDSERVE_TEST_HOLDS is set: test-only pauses are active');
  }

  async close(): Promise<void> {
    if (this.watchdog) clearInterval(this.watchdog);
    this.watchdog = undefined;
    for (const r of this.rooms.rooms()) this.apply(r.id, { t: 'abort', from: 'local', failure: failure('shutting_down', 'decode worker shutting down') });
    for (const j of this.jobs.values()) j.ac.abort();
    await this.app?.close().catch(() => {});
    await this.pool?.close();
    await this.engine.dispose();
  }

  // ---- lifecycle plumbing ---------------------------------------------------------------------

  private apply(room: RoomId, ev: RoomEvent): void {
    this.run(this.rooms.apply(room, ev, Date.now()));
  }

  private run(effects: Effect[]): void {
    for (const e of effects) {
      switch (e.t) {
        case 'send_register':
          void this.register(e.room);
          break;
        case 'send_ack': {
          const job = this.jobs.get(e.room);
          job?.conn?.sendControl({ type: 'kv_ack', room: e.room, epoch: this.epoch });
          break;
        }
        case 'notify_peer': {
          const job = this.jobs.get(e.room);
          if (job) this.tellPrefill(job, e.room, e.failure);
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

  /** Room terminal: drop its queue entry and receive buffer, wake the request handler. */
  private finish(room: RoomId, state: KVPoll, f: RoomFailure | undefined): void {
    this.prealloc.delete(room);
    const job = this.jobs.get(room);
    if (!job) return;
    if (job.recv && state !== KVPoll.Success) void job.recv.discard();
    this.metrics.recordTerminal(state, f, job.step !== 'prealloc' && job.step !== 'registering');
    if (state === KVPoll.Success && job.header) {
      job.step = 'decoding';
      if (job.tKvBegin) this.metrics.kvSeconds.observe((Date.now() - job.tKvBegin) / 1000);
      job.ready.resolve(job.header);
    } else {
      job.ac.abort();
      job.ready.reject(ApiError.fromFailure(f ?? failure('internal_error', 'room failed')));
    }
    this.admit();
  }

  abort(room: RoomId, from: 'router' | 'client' | 'local'): void {
    const job = this.jobs.get(room);
    if (this.rooms.has(room)) this.apply(room, { t: 'abort', from, failure: from === 'local' ? failure('shutting_down', 'aborted locally') : failure('request_aborted', from === 'router' ? 'abort_request from the router' : 'the client closed the request') });
    job?.ac.abort();
  }

  /** Hand free slots to the oldest prealloc rooms. */
  private admit(): void {
    while (this.prealloc.size > 0) {
      const room = this.prealloc.values().next().value as RoomId;
      const job = this.jobs.get(room);
      if (!job) {
        this.prealloc.delete(room);
        continue;
      }
      const slot = this.engine.tryAcquireSlot();
      if (!slot) return;
      this.prealloc.delete(room);
      job.slot = slot;
      job.step = 'registering';
      this.apply(room, { t: 'slot_reserved' });
    }
  }

  private async register(room: RoomId): Promise<void> {
    const job = this.jobs.get(room);
    if (!job) return;
    await hold('decode.register', job.ac.signal);
    if (!this.jobs.has(room) || job.ac.signal.aborted) return;
    let conn: PeerConn;
    try {
      conn = await this.pool.get(job.host, job.port);
    } catch (err) {
      const code = errorCodeOf(err) === 'settings_mismatch' ? 'settings_mismatch' : 'peer_unreachable';
      this.apply(room, { t: 'fail', failure: failure(code, `cannot pair with prefill ${job.peerKey}: ${(err as Error).message}`) });
      return;
    }
    if (!this.jobs.has(room) || job.ac.signal.aborted) return;
    job.conn = conn;
    if (!conn.sendControl({ type: 'register', room, rid: job.rid, epoch: this.epoch })) {
      this.apply(room, { t: 'peer_lost', failure: failure('peer_lost', 'connection closed before register') });
    }
  }

  /** Wire FAIL for `room` to its prefill, on the room's connection or a (new) pooled one. */
  private tellPrefill(job: Job, room: RoomId, f: RoomFailure): void {
    const msg = { type: 'fail', room, code: f.code, detail: f.detail, epoch: this.epoch } as const;
    if (job.conn?.alive) {
      job.conn.sendControl(msg);
      return;
    }
    this.tellPrefillAt(job.host, job.port, room, f);
  }

  /**
   * Wire FAIL for a room decode never registered (prealloc deadline, prealloc queue full,
   * refused request): opens the pooled connection to that prefill if needed (bounded by the
   * connect timeout), so prefill frees the room at once instead of at its bootstrap deadline.
   */
  private tellPrefillAt(host: string, port: number, room: RoomId, f: RoomFailure): void {
    this.pool.get(host, port).then(
      (conn) => void conn.sendControl({ type: 'fail', room, code: f.code, detail: f.detail, epoch: this.epoch }),
      (err: Error) => this.log.debug({ room, prefill: `${host}:${port}`, err: err.message }, 'could not tell prefill about a failed room'),
    );
  }

  // ---- KV channel -----------------------------------------------------------------------------

  /** The job for a room, only when `conn` is the connection that room registered on. */
  private jobOn(conn: PeerConn, room: RoomId): Job | undefined {
    const job = this.jobs.get(room);
    if (!job || job.conn !== conn) {
      this.log.debug({ room, peer: conn.id }, 'message for a room not registered on this connection: ignored');
      return undefined;
    }
    return job;
  }

  private onControl(conn: PeerConn, msg: ControlMsg): void {
    switch (msg.type) {
      case 'registered': {
        const job = this.jobOn(conn, msg.room);
        if (!job) return;
        job.step = 'waiting_kv';
        this.apply(msg.room, { t: 'registered' });
        return;
      }
      case 'kv_begin': {
        const job = this.jobOn(conn, msg.room);
        if (!job) return;
        const bad = checkAnnounced(msg.totalBytes, this.config.maxStateBytes);
        if (bad) {
          this.apply(msg.room, { t: 'fail', failure: bad });
          return;
        }
        const info = this.engine.info;
        job.recv = new StateReceiver({
          totalBytes: msg.totalBytes,
          expect: { fingerprint: info.fingerprint, contextSize: info.compat.contextSize, batchSize: info.compat.batchSize, maxPayloadBytes: this.config.maxStateBytes },
          walker: (n: number) => new GgsqStreamParser({ contextSize: info.compat.contextSize, nLayer: info.compat.nLayer, maxBytes: n }),
          path: join(this.config.stateDir, `pdserve-decode-${process.pid}-${msg.room}.ggsq`),
          pool: this.kvPool,
        });
        job.rx = new KvReception(msg.totalBytes);
        job.step = 'receiving';
        job.tKvBegin = Date.now();
        this.apply(msg.room, { t: 'kv_begin', totalBytes: msg.totalBytes });
        return;
      }
      case 'kv_end': {
        const job = this.jobOn(conn, msg.room);
        if (!job) return;
        const incomplete = job.recv && job.rx ? job.rx.end() : failure('kv_transfer_failed', 'kv_end before kv_begin');
        if (incomplete) {
          this.apply(msg.room, { t: 'fail', failure: incomplete });
          return;
        }
        job.step = 'loading';
        job.loading = this.load(job);
        return;
      }
      case 'fail':
        if (this.jobOn(conn, msg.room)) this.apply(msg.room, { t: 'abort', from: 'peer', failure: failureFromWire(msg, 'prefill') });
        return;
      default:
        this.log.warn({ type: msg.type, peer: conn.id }, 'unexpected control message on decode');
    }
  }

  private onChunk(conn: PeerConn, room: RoomId, offset: number, data: Buffer): void {
    const job = this.jobOn(conn, room);
    if (!job) return;
    const r = job.recv;
    if (!r) {
      this.apply(room, { t: 'fail', failure: failure('kv_transfer_failed', 'chunk before kv_begin') });
      return;
    }
    const out = job.rx!.accept(offset, data.length);
    if (out) {
      this.apply(room, { t: 'fail', failure: out });
      return;
    }
    try {
      r.push(data);
    } catch (err) {
      this.apply(room, { t: 'fail', failure: failure('bad_state', (err as Error).message) });
      return;
    }
    this.metrics.kvBytes.inc(data.length);
    this.apply(room, { t: 'progress', bytes: data.length });
  }

  private onPeerLost(conn: PeerConn, reason: string): void {
    const rooms = [...this.jobs.values()].filter((j) => j.conn === conn).map((j) => j.room);
    for (const room of rooms) this.apply(room, { t: 'peer_lost', failure: failure('peer_lost', reason) });
  }

  /** kv_end: finish the streamed receive (complete, checksum, structure end, file written), then load it into the room's slot. */
  private async load(job: Job): Promise<void> {
    const { room } = job;
    const recv = job.recv!;
    try {
      await hold('decode.load', job.ac.signal);
      if (!this.rooms.has(room)) return;
      const { header, state, path } = await recv.finish();
      if (state.nTokens !== header.nTokens) throw Object.assign(new Error(`state holds ${state.nTokens} tokens, envelope says ${header.nTokens}`), { code: 'BAD_STATE' });
      if (!this.jobs.has(room) || !job.slot) return;
      await job.slot.loadState(path, state.tokens);
      // The room may have failed while llama.cpp was loading (deadline, abort, peer lost): the
      // core would refuse kv_done anyway; not sending it keeps the illegal-transition counter
      // for real bugs.
      if (!this.rooms.has(room)) return;
      job.header = header;
      this.apply(room, { t: 'kv_done' });
    } catch (err) {
      const e = err as { code?: string; message?: string };
      this.apply(room, { t: 'fail', failure: failure(e.code === 'BAD_ENVELOPE' || e.code === 'BAD_STATE' ? 'bad_state' : 'engine_failed', e.message ?? String(err)) });
    } finally {
      await recv.discard();
    }
  }

  // ---- HTTP -----------------------------------------------------------------------------------

  private async handleGenerate(raw: unknown, reply: FastifyReply): Promise<void> {
    const parsed = GenerateRequestSchema.safeParse(raw);
    if (!parsed.success) return sendError(reply, zodToApiError(parsed.error));
    const body: GenerateRequest = parsed.data;
    const room = body.bootstrap_room;
    // Refusals before the room exists still reach prefill (it would otherwise hold the room in
    // its bootstrap queue until its deadline): opening the KV connection if needed.
    const refuse = (err: ApiError): void => {
      if (!this.rooms.has(room)) this.tellPrefillAt(body.bootstrap_host, body.bootstrap_port, room, failure(err.code as RoomFailure['code'], `decode refused the request: ${err.message}`));
      sendError(reply, err);
    };
    if (this.prealloc.size >= this.config.maxPrealloc) return refuse(ApiError.of('queue_full', `decode prealloc queue is full (${this.config.maxPrealloc})`));
    if (this.rooms.has(room)) return sendError(reply, ApiError.of('duplicate_room', `room ${room} already exists`));
    // One live request per rid (as vLLM): a second one could never be aborted by rid.
    const other = this.byRid.get(body.rid);
    if (other !== undefined && this.jobs.has(other)) return refuse(ApiError.of('duplicate_rid', `request id ${body.rid} is already running on this worker (room ${other})`, 'rid'));
    const job: Job = {
      room,
      rid: body.rid,
      sampling: samplingFromWire(body.sampling_params),
      skipFirst: body.first_token_from_prefill,
      peerKey: `${body.bootstrap_host}:${body.bootstrap_port}`,
      host: body.bootstrap_host,
      port: body.bootstrap_port,
      ac: new AbortController(),
      ready: deferred(),
      step: 'prealloc',
      t0: Date.now(),
    };
    let effects: Effect[];
    try {
      effects = this.rooms.create(room, body.rid, Date.now(), job.peerKey);
    } catch (err) {
      return sendError(reply, toApiError(err));
    }
    this.jobs.set(room, job);
    this.byRid.set(job.rid, room);
    this.traces.set(room, body.trace_id ?? body.rid);
    this.log.debug({ rid: body.rid, room, trace: body.trace_id ?? body.rid }, 'room created');
    this.prealloc.add(room);
    const off = onClientGone(reply, () => this.abort(room, 'client'));
    try {
      this.run(effects);
      this.admit();
      let header: EnvelopeHeader;
      try {
        header = await job.ready.promise;
      } catch (err) {
        return sendError(reply, toApiError(err));
      }
      await this.stream(job, header, reply);
    } finally {
      off();
      if (job.loading) await job.loading.catch(() => {});
      job.slot?.release();
      job.slot = undefined;
      this.jobs.delete(room);
      if (this.byRid.get(job.rid) === room) this.byRid.delete(job.rid);
      this.prealloc.delete(room);
      this.admit();
    }
  }

  /** Generate from the loaded slot and write SSE events until finish, abort or client loss. */
  private async stream(job: Job, header: EnvelopeHeader, reply: FastifyReply): Promise<void> {
    const res = reply.raw;
    reply.hijack();
    res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache', connection: 'keep-alive' });
    const meta = (n: number, finish: GenerateEvent['meta_info']['finish_reason']): GenerateEvent['meta_info'] => ({ id: job.rid, prompt_tokens: header.nTokens, cached_tokens: header.cachedTokens ?? 0, completion_tokens: n, finish_reason: finish });
    this.running++;
    this.prefixMetrics.requestsByPath.inc({ path: 'pd' });
    let n = 0;
    const gen = job.slot!.generate(header.firstToken, job.sampling, job.ac.signal);
    try {
      let finish: 'stop' | 'length' | 'abort' = 'abort';
      for (;;) {
        const r = await gen.next();
        if (r.done) {
          finish = r.value;
          break;
        }
        n++;
        if (n === 1 && job.skipFirst) continue; // the client has it from prefill; same text state here
        const ev: GenerateEvent = tokenEvent(r.value, meta(n, null));
        if (!(await writeEvent(res, ev, this.config.timeouts.transferIdleMs))) {
          job.ac.abort();
        }
      }
      if (!res.destroyed) {
        await writeEvent(res, { text: '', token_ids: [], meta_info: meta(n, { type: finish }) }, this.config.timeouts.transferIdleMs);
        res.write('data: [DONE]\n\n');
      }
    } catch (err) {
      const e = toApiError(err);
      if (!res.destroyed) res.write(`data: ${JSON.stringify({ error: { message: e.message, type: e.type, code: e.code } })}\n\n`);
    } finally {
      await gen.return('abort').catch(() => {});
      this.running--;
      if (!res.writableEnded) res.end();
    }
  }
}

/** Write one SSE event; waits for 'drain' at most `deadlineMs`. False when the client is gone or stuck. */
async function writeEvent(res: import('node:http').ServerResponse, ev: unknown, deadlineMs: number): Promise<boolean> {
  if (res.destroyed || res.writableEnded) return false;
  if (res.write(`data: ${JSON.stringify(ev)}\n\n`)) return true;
  return new Promise<boolean>((resolve) => {
    const t = setTimeout(() => done(false), deadlineMs);
    const done = (ok: boolean) => {
      clearTimeout(t);
      res.off('drain', onDrain);
      res.off('close', onClose);
      resolve(ok);
    };
    const onDrain = () => done(true);
    const onClose = () => done(false);
    res.once('drain', onDrain);
    res.once('close', onClose);
  });
}

/** Load the engine, start the worker. */
export async function startDecodeWorker(raw: unknown, log = createLogger('decode')): Promise<DecodeWorker> {
  const config = parseConfig(DecodeConfigSchema, raw);
  const engine = await loadEngine({ ...config.engine, sequences: config.slots, log: (level: string, msg: string) => log.debug({ level }, msg) });
  const w = new DecodeWorker(config, engine, log);
  await w.start();
  return w;
}
