/**
 * Decode worker: the HTTP and process wiring around decode's effect executor (effects.ts, which
 * holds the room handling over ports). It accepts `POST /generate` with bootstrap fields, gives
 * the executor its real ports — llama.cpp's slots, the KV peer pool, the validating state
 * receiver, the same-host handoff, node:fs, the process clock — and streams the tokens once the
 * executor says the room's state is in its slot (running batch: all slots of one llama.cpp
 * context, batched by node-llama-cpp).
 */
import type { FastifyInstance, FastifyReply } from 'fastify';
import { zodToApiError } from '../api/errors.js';
import { GenerateRequestSchema, retentionFromWire, type GenerateRequest } from '../protocol/worker-protocol.js';
import { DecodeConfigSchema, kvEventBlockTokens, parseConfig, prefixCacheOf, type DecodeConfig } from '../config/config.js';
import { ApiError, toApiError, type RoomFailure } from '../base/errors.js';
import { connectionHeader } from '../runtime/drain.js';
import { onClientGone, sendError } from '../worker/http.js';
import { systemClock, systemTimers, type Clock, type Timers } from '../base/clock.js';
import { createLogger, type Logger } from '../base/log.js';
import { nodeStateFiles, sweepStaleStateFiles } from '../runtime/statefiles.js';
import { StateSpace } from '../runtime/state-space.js';
import { noTestHooks, type TestHooks } from '../runtime/testhooks.js';
import { TraceTags } from '../protocol/trace-tags.js';
import { roomsByState, WorkerMetrics } from '../runtime/metrics.js';
import { PrefixCacheMetrics } from '../prefixes/prefix-metrics.js';
import { openPrefixStore } from '../prefixes/prefix-store.js';
import { samplingFromWire } from '../api/requests.js';
import { loadEngine } from '../engine/index.js';
import type { Engine } from '../engine/types.js';
import { newEpoch } from '../kv/auth.js';
import { KvPeerPool, type PeerConn } from '../kv/channel.js';
import { BufferPool, FilePool, RECV_SPARE_BYTES, RECV_SPARE_FILES, TRANSFER_BUFFER_BYTES, TRANSFER_POOL_BUFFERS } from '../kv/transfer/pool.js';
import { GgsqStreamParser, parseStateHeaders } from '../engine/ggsq.js';
import { StateReceiver } from '../kv/transfer/receiver.js';
import { kvIoForReceives } from '../kv/transfer/io-thread.js';
import { SameHostDecode } from '../kv/transfer/same-host.js';
import type { RoomId } from '../kv/types.js';
import { DecodeDriver } from './driver.js';
import { cachedOf, DecodeEffects, pathOf, type DecodeJob } from './effects.js';
import { planLocal, type DecodeStart, type LocalPlan } from './local.js';
import { DecodeSseWriter } from './sse-out.js';
import { KnownPrefills } from './known-prefills.js';
import { Counter } from 'prom-client';
import { KvEventLog } from '../protocol/kv-events.js';
import { serveWorkerEdge, type RoleEdgeParts, type WorkerEdge } from '../worker/shell.js';
import type { InternalTls } from '../security/tls.js';
import { workerKvChannel } from '../worker/kv-channel.js';
import { SequenceKvTracker } from '../worker/kv-tracker.js';

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
  /** The room handling (./effects.ts) over this worker's real ports. */
  readonly effects: DecodeEffects<PeerConn>;
  /** Write buffers of the streaming receivers, reused across transfers. */
  private readonly kvPool = new BufferPool(TRANSFER_BUFFER_BYTES, TRANSFER_POOL_BUFFERS);
  /** Destination files of the streaming receivers, recycled after their load (tmpfs pages stay allocated). */
  private readonly recvFiles: FilePool;
  /** The shared HTTP edge (../worker/shell.ts): app, watchdog, sweeper. */
  private edge?: WorkerEdge;
  /** The same-host handoff (kv_file): per-connection probe, taking handed files over. */
  readonly sameHost: SameHostDecode;
  /** Whether the state directory is too full for a received state (../runtime/state-space.ts). */
  readonly space: StateSpace;
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
    /** The watchdog's and the state-file sweeps' timers. */
    readonly timers: Timers = systemTimers,
    /** Test-only hold points (../runtime/testhooks.ts); production: `noTestHooks`. */
    readonly testHooks: TestHooks = noTestHooks,
  ) {
    this.driver = new DecodeDriver({ timeouts: config.timeouts, slots: engine.info.sequences, maxPrealloc: config.maxPrealloc, maxStateBytes: config.maxStateBytes }, this.epoch);
    this.metrics = new WorkerMetrics('decode', { queues: () => this.queueSizes(), roomsByState: () => roomsByState(this.rooms), channel: () => ({ ...(this.pool?.stats ?? {}) }) });
    this.prefixMetrics = new PrefixCacheMetrics(this.metrics.registry, () => this.engine.cachedStats(), () => this.engine.evictionStats?.() ?? []);
    this.kvEvents = new KvEventLog({ epoch: this.epoch, registry: this.metrics.registry, blockTokens: kvEventBlockTokens(config.engine) });
    this.kvTracker = engine.info.cacheSequences > 0 ? new SequenceKvTracker(engine, this.kvEvents, kvEventBlockTokens(config.engine)) : null;
    // small spares within RECV_SPARE_BYTES, and large ones within --max-state-bytes while receives keep taking them
    this.recvFiles = new FilePool({ dir: config.stateDir, prefix: `pdserve-kvrecv-${process.pid}`, maxFiles: RECV_SPARE_FILES, maxBytes: RECV_SPARE_BYTES, maxLargeBytes: config.maxStateBytes });
    this.knownPrefills = new KnownPrefills(config.allowPrefill);
    this.bootstrapRefused = new Counter({ name: 'pdserve_bootstrap_refused_total', help: 'Requests refused because their bootstrap address is not a prefill this decode worker knows', registers: [this.metrics.registry] });
    this.sameHost = new SameHostDecode({ enabled: config.kvSameHost, verify: config.kvSameHostVerify, stateDir: config.stateDir, log: this.log.child({ part: 'kv' }) });
    const info = engine.info;
    const expect = { fingerprint: info.fingerprint, contextSize: info.compat.contextSize, batchSize: info.compat.batchSize, maxPayloadBytes: config.maxStateBytes };
    const walker = (n: number) => new GgsqStreamParser({ contextSize: info.compat.contextSize, nLayer: info.compat.nLayer, maxBytes: n, nVocab: info.nVocab });
    const sameHost = this.sameHost;
    this.space = new StateSpace(config.stateDir);
    this.effects = new DecodeEffects<PeerConn>({
      testHooks,
      space: this.space,
      driver: this.driver,
      engine,
      clock,
      files: nodeStateFiles,
      dial: (host, port) => this.pool.get(host, port),
      receive: (_room, totalBytes, hintBytes) =>
        new StateReceiver({ totalBytes, ...(hintBytes !== undefined ? { streamed: { hintBytes } } : {}), expect, walker, files: this.recvFiles, pool: this.kvPool, io: kvIoForReceives(config.stateDir) }),
      sameHost: {
        ready: (conn) => sameHost.ready(conn),
        onReply: (conn, msg) => sameHost.onReply(conn, msg),
        take: (msg) =>
          sameHost.take(msg, {
            expect,
            headers: (file) => parseStateHeaders(file, { contextSize: info.compat.contextSize, nLayer: info.compat.nLayer, nVocab: info.nVocab, maxBytes: config.maxStateBytes }),
            walker,
            pool: this.kvPool,
          }),
      },
      metrics: this.metrics,
      prefixMetrics: this.prefixMetrics,
      traces: this.traces,
      log,
    });
  }

  /** The driver's room table (the lifecycle core). */
  get rooms() {
    return this.driver.rooms;
  }

  /** Queue name → entries. prealloc and transfer derive from room phases; running is the batch. */
  queueSizes(): Record<string, number> {
    return this.driver.queueSizes();
  }

  /** Start the worker: its role parts (`startRole`), then its own HTTP edge over them. */
  async start(): Promise<void> {
    const internalTls = await this.startRole();
    this.edge = await serveWorkerEdge({ ...this.edgeParts(), testHooks: this.testHooks, engine: this.engine, config: this.config, internalTls, log: this.log, timers: this.timers });
    this.app = this.edge.app;
    this.url = this.edge.url;
    this.log.info({ url: this.url, epoch: this.epoch }, 'decode worker ready');
  }

  /** Start what is decode's own: the KV peer pool (receive side). Returns the internal TLS material the HTTP edge serves with. */
  async startRole(): Promise<InternalTls | undefined> {
    const c = this.config;
    const { internalTls, channel } = workerKvChannel(c, { engine: this.engine, epoch: this.epoch, clock: this.clock, log: this.log });
    this.pool = new KvPeerPool({
      ...channel,
      connectTimeoutMs: c.connectTimeoutMs,
      onMessage: (conn, msg) => this.effects.onControl(conn, msg),
      onChunk: (conn, room, offset, data) => this.effects.onChunk(conn, room, offset, data),
      onPeerLost: (conn, reason) => {
        if (!this.effects.peerLost(conn, reason)) return;
        // A prefill killed after handing a file over leaves it under its dead pid: sweep now and
        // once more shortly (its exit may not be complete yet).
        void sweepStaleStateFiles(c.stateDir, this.log);
        this.timers.after(1000, () => void sweepStaleStateFiles(c.stateDir, this.log));
      },
      onConnect: (conn) => this.sameHost.probe(conn),
    });
    return internalTls;
  }

  /** What decode hands an HTTP edge (../worker/shell.ts): its identity, metrics, rooms and work routes. */
  edgeParts(): RoleEdgeParts {
    return {
      role: 'decode',
      epoch: this.epoch,
      registry: this.metrics.registry,
      space: this.space,
      kvEvents: this.kvEvents,
      onSignedProbe: (q) => {
        if (typeof q.prefill_pool === 'string') this.knownPrefills.learn(q.prefill_pool.split(','), this.clock.nowMs());
      },
      liveRooms: () => this.rooms.rooms().length,
      requests: () => this.driver.requests,
      queues: () => this.queueSizes(),
      debugRooms: () => {
        const snap = this.rooms.snapshot(this.clock.nowMs(), this.clock.wallMs());
        const decoding = [...this.effects.allJobs()].filter((j) => this.driver.step(j.room) === 'decoding').map((j) => ({ room: j.room, rid: j.rid, age_ms: Math.round(this.clock.nowMs() - j.t0), path: pathOf(j), kv_path: j.kvPath ?? null, cached_tokens: cachedOf(j) }));
        return this.traces.tag({ epoch: this.epoch, queues: this.queueSizes(), ...snap, live: snap.live.map((r) => ({ ...r, step: this.driver.step(r.room), path: pathOf(this.effects.job(r.room)), kv_path: this.effects.job(r.room)?.kvPath ?? null, cached_tokens: cachedOf(this.effects.job(r.room)) })), decoding });
      },
      generate: (body, reply) => this.handleGenerate(body, reply),
      abort: (rid, room, cause) => this.abort(rid, room, 'router', cause),
      tick: () => this.effects.tick(),
    };
  }

  async close(): Promise<void> {
    this.edge?.stop();
    this.kvTracker?.close();
    this.recvFiles.close(); // spares deleted now (a hung close is cut short); a receiver still holding a file deletes it when it lets go
    this.effects.shutdown();
    await this.app?.close().catch(() => {});
    await this.closeRole();
    await this.engine.dispose();
  }

  /**
   * Tear down what is decode's own, keeping the engine (weights, KV memory) for the next role:
   * fail live rooms, stop the sequence tracker, drop the spare receive files, close the KV peer
   * pool. Idempotent.
   */
  async closeRole(): Promise<void> {
    this.kvTracker?.close();
    this.recvFiles.close();
    this.effects.shutdown();
    await this.pool?.close();
  }

  /** Abort by room id and/or rid (router, client gone, local); also stops a generation in progress. `cause`: why, when the router said. */
  abort(rid: string | undefined, room: RoomId | undefined, from: 'router' | 'client' | 'local', cause?: RoomFailure): void {
    this.effects.abort(rid, room, from, cause);
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
    // Never dial an address the router's pool (or --allow-prefill) does not name: a forged
    // bootstrap address is refused here, before any room or connection exists.
    if (!local && !this.knownPrefills.allows(body.bootstrap_host, body.bootstrap_port, this.clock.nowMs())) {
      this.bootstrapRefused.inc();
      return sendError(reply, ApiError.of('unknown_bootstrap_address', 'bootstrap_host:bootstrap_port is not a prefill worker this decode worker knows (the router\'s pool or --allow-prefill)', 'bootstrap_host'));
    }
    const admitted = this.effects.admit({
      room,
      rid: body.rid,
      sampling: local?.sampling ?? samplingFromWire(body.sampling_params, body.resume_token_ids),
      skipFirst: !local && body.first_token_from_prefill,
      host: body.bootstrap_host,
      port: body.bootstrap_port,
      trace: body.trace_id ?? body.rid,
      ...(local ? { local } : {}),
      ...(body.conversation_key !== undefined ? { conversationKey: body.conversation_key } : {}),
      ...(body.cache_salt !== undefined ? { salt: body.cache_salt } : {}),
      ...(body.retention ? { retention: retentionFromWire(body.retention)! } : {}),
    });
    if (admitted.refused) return sendError(reply, admitted.refused);
    const { job } = admitted;
    const off = onClientGone(reply, () => this.abort(undefined, room, 'client'));
    try {
      let start: DecodeStart;
      try {
        start = await job.ready.promise;
      } catch (err) {
        return sendError(reply, toApiError(err));
      }
      try {
        await this.stream(job, start, reply);
      } finally {
        this.effects.generationDone(room);
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
  private async stream(job: DecodeJob, start: DecodeStart, reply: FastifyReply): Promise<void> {
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
        if (this.testHooks.enabled) await this.testHooks.hold('decode.step', job.ac.signal);
        const r = await gen.next();
        if (r.done) {
          finish = r.value;
          break;
        }
        if (prompt && this.kvTracker) ids.push(r.value.token);
        n++;
        if (n === 1 && job.skipFirst) continue; // the client has it from prefill; same text state here
        // local path: decode sampled token 1 itself, with its logprob (generate() knows none for it)
        out.token(n === 1 && start.firstLogprob ? { ...r.value, logprob: start.firstLogprob } : r.value, resumed + n);
        // The first step ran: the loaded state's file may go, once this turn's flush has handed
        // token 2 to the socket (freeing its pages takes CPU that token 2 would wait for).
        if (n === 2) setImmediate(() => this.effects.stepped(job.room));
        const ok = out.writable();
        if (ok !== true && !(await ok)) job.ac.abort();
      }
      // An /abort_request (an operator's, or the router's own) ended it: say so with its code, so the
      // router does not take the end for a worker failure (and migrate the request).
      if (finish === 'abort' && job.abortedBy?.code === 'request_aborted') out.error(ApiError.fromFailure(job.abortedBy), true);
      else out.finish(resumed + n, finish);
      if (finish !== 'abort' && prompt) this.kvTracker?.noteFinished([...prompt, ...ids], job.salt);
    } catch (err) {
      out.error(toApiError(err));
    } finally {
      await gen.return('abort').catch(() => {});
      out.end();
    }
  }
}

/** Load the engine, start the worker. `testHooks`: the test-only hold points (the CLI: `testHooksFromEnv()`). */
export async function startDecodeWorker(raw: unknown, log = createLogger('decode'), testHooks: TestHooks = noTestHooks): Promise<DecodeWorker> {
  const config = parseConfig(DecodeConfigSchema, raw);
  // Decode keeps finished sequences (prompt + reply KV) for decode-local continuation when on.
  const prefixCache = config.localPrefillMaxTokens > 0 ? prefixCacheOf(config.engine) : undefined;
  const store = prefixCache ? openPrefixStore(config.engine, config.stateDir, { write: true, maxFileBytes: config.maxStateBytes, log }) : undefined;
  const engine = await loadEngine({ ...config.engine, sequences: config.slots, ...(prefixCache ? { prefixCache } : {}), ...(store ? { prefixStore: store } : {}), log: (level: string, msg: string) => log.debug({ level }, msg) });
  const w = new DecodeWorker(config, engine, log, undefined, undefined, testHooks);
  store?.registerMetrics(w.metrics.registry, (hit) => w.prefixMetrics.recordTier('store', hit));
  store?.onEvent((e) => w.kvEvents.publish(e));
  await w.start();
  return w;
}
