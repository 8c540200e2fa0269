/**
 * Prefill worker: the HTTP and process wiring around prefill's effect executor (effects.ts,
 * which holds the room handling over ports). It accepts SGLang-style `POST /generate` with
 * bootstrap fields, runs the KV bootstrap listener and gives the executor its real ports —
 * llama.cpp, the KV server's connections, the pooled state sender, node:fs, the process clock.
 */
import type { FastifyInstance } from 'fastify';
import { Gauge } from 'prom-client';
import { zodToApiError } from '../api/errors.js';
import { checkRequestBounds, GenerateRequestSchema, MAX_MESSAGES, retentionFromWire, type GenerateRequest } from '../protocol/worker-protocol.js';
import { kvEventBlockTokens, parseConfig, prefixCacheOf, PrefillConfigSchema, type PrefillConfig } from '../config/config.js';
import { PrefixCacheMetrics } from '../prefixes/prefix-metrics.js';
import { openPrefixStore } from '../prefixes/prefix-store.js';
import { nodeStateFiles } from '../runtime/statefiles.js';
import { StateSpace } from '../runtime/state-space.js';
import { KvEventLog } from '../protocol/kv-events.js';
import { serveWorkerEdge, type RoleEdgeParts, type WorkerEdge } from '../worker/shell.js';
import type { InternalTls } from '../security/tls.js';
import { workerKvChannel } from '../worker/kv-channel.js';
import { SequenceKvTracker } from '../worker/kv-tracker.js';
import { ApiError, toApiError } from '../base/errors.js';
import { onClientGone, sendError } from '../worker/http.js';
import { systemClock, systemTimers, type Clock } from '../base/clock.js';
import { createLogger, type Logger } from '../base/log.js';
import { TraceTags } from '../protocol/trace-tags.js';
import { roomsByState, WorkerMetrics } from '../runtime/metrics.js';
import { loadEngine } from '../engine/index.js';
import type { Engine, SamplingParams } from '../engine/types.js';
import { newEpoch } from '../kv/auth.js';
import { KvServer, type PeerConn } from '../kv/channel.js';
import { BufferPool, TRANSFER_BUFFER_BYTES, TRANSFER_POOL_BUFFERS } from '../kv/transfer/pool.js';
import { sendGrowingStateFile, sendStateFile } from '../kv/transfer/sender.js';
import { sharedKvIo } from '../kv/transfer/io-thread.js';
import { SameHostPrefill } from '../kv/transfer/same-host.js';
import type { RoomId } from '../kv/types.js';
import { checkSampling, fitSampling, samplingFromWire, tokenizeRequestOffLoop } from '../api/requests.js';
import { TokenizerThread } from '../engine/tokenizer-thread.js';
import { PrefillDriver } from './driver.js';
import { PrefillEffects } from './effects.js';
import { noTestHooks, type TestHooks } from '../runtime/testhooks.js';
import { answerWithFirstToken } from './first-token.js';
import { answerRooms, ComputationMetrics } from './computation.js';

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
  readonly computeMetrics: ComputationMetrics;
  /** The room handling (./effects.ts) over this worker's real ports. */
  readonly effects: PrefillEffects<PeerConn>;
  /** The shared HTTP edge (../worker/shell.ts): app, watchdog, sweeper. */
  private edge?: WorkerEdge;
  /** The same-host handoff (kv_file): probe answers and which decode connections may use it. */
  readonly sameHost: SameHostPrefill;
  /** Whether the state directory is too full for a state (../runtime/state-space.ts). */
  readonly space: StateSpace;
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
    /** Test-only hold points (../runtime/testhooks.ts); production: `noTestHooks`. */
    readonly testHooks: TestHooks = noTestHooks,
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
    this.prefixMetrics = new PrefixCacheMetrics(this.metrics.registry, () => this.engine.cachedStats(), () => this.engine.evictionStats?.() ?? []);
    this.kvEvents = new KvEventLog({ epoch: this.epoch, registry: this.metrics.registry, blockTokens: kvEventBlockTokens(config.engine) });
    this.kvTracker = engine.info.cacheSequences > 0 ? new SequenceKvTracker(engine, this.kvEvents, kvEventBlockTokens(config.engine)) : null;
    this.computeMetrics = new ComputationMetrics(this.metrics.registry);
    const queued = () => this.effects.queuedPromptTokens();
    new Gauge({ name: 'pdserve_prefill_queued_tokens', help: 'Prompt tokens of the requests not evaluated yet (queued for a compute slot or being evaluated): the planner\'s prefill load', registers: [this.metrics.registry], collect() { this.set(queued()); } });
    this.sameHost = new SameHostPrefill({ enabled: config.kvSameHost, verify: config.kvSameHostVerify, stateDir: config.stateDir });
    const pool = this.kvPool;
    const sameHost = this.sameHost;
    this.space = new StateSpace(config.stateDir);
    this.effects = new PrefillEffects<PeerConn>({
      testHooks,
      space: this.space,
      driver: this.driver,
      config,
      engine,
      clock,
      timers: systemTimers,
      pid: process.pid,
      files: nodeStateFiles,
      sender: {
        sendFile: (conn, room, path, head, payloadBytes, o) => sendStateFile(conn, room, path, head, payloadBytes, { ...o, pool, io: sharedKvIo() }),
        sendGrowing: (conn, room, path, head, o) => sendGrowingStateFile(conn, room, path, head, { ...o, clock, pool }),
      },
      sameHost: {
        onMessage: (id, msg) => sameHost.onMessage(id, msg),
        usable: (id) => sameHost.usable(id),
        forget: (id) => sameHost.forget(id),
        offer: (id, room, path, head, payloadBytes) => sameHost.offer(id, room, path, head, payloadBytes, pool),
      },
      metrics: this.metrics,
      computeMetrics: this.computeMetrics,
      prefixMetrics: this.prefixMetrics,
      kvTracker: this.kvTracker,
      traces: this.traces,
      log,
    });
  }

  /** The driver's room table (the lifecycle core). */
  get rooms() {
    return this.driver.rooms;
  }

  /** Queue name → entries, derived from room phases (cannot drift). */
  queueSizes(): Record<string, number> {
    return this.driver.queueSizes();
  }

  /** Start the worker: its role parts (`startRole`), then its own HTTP edge over them. */
  async start(): Promise<void> {
    const internalTls = await this.startRole();
    this.edge = await serveWorkerEdge({ ...this.edgeParts(), testHooks: this.testHooks, engine: this.engine, tokenize: true, config: this.config, internalTls, log: this.log });
    this.app = this.edge.app;
    this.url = this.edge.url;
    this.log.info({ url: this.url, bootstrapPort: this.bootstrapPort, epoch: this.epoch }, 'prefill worker ready');
  }

  /**
   * Start what is prefill's own: the tokenizer thread and the KV bootstrap listener. Returns the
   * internal TLS material the HTTP edge serves with.
   * @throws the listen error of the bootstrap port (EADDRINUSE, EACCES)
   */
  async startRole(): Promise<InternalTls | undefined> {
    const c = this.config;
    await this.tokenizer.start();
    const { internalTls, channel } = workerKvChannel(c, { engine: this.engine, epoch: this.epoch, clock: this.clock, log: this.log });
    this.kv = new KvServer({
      ...channel,
      host: c.host,
      port: c.bootstrapPort,
      onMessage: (conn, msg) => this.effects.onControl(conn, msg),
      onPeerLost: (conn, reason) => this.effects.peerLost(conn, reason),
    });
    this.bootstrapPort = await this.kv.listen();
    return internalTls;
  }

  /** What prefill hands an HTTP edge (../worker/shell.ts): its identity, metrics, rooms and work routes. */
  edgeParts(): RoleEdgeParts {
    const c = this.config;
    return {
      role: 'prefill',
      epoch: this.epoch,
      registry: this.metrics.registry,
      space: this.space,
      kvEvents: this.kvEvents,
      liveRooms: () => this.rooms.rooms().length,
      queues: () => this.queueSizes(),
      health: () => ({ bootstrap_host: c.bootstrapHost, bootstrap_port: this.bootstrapPort }),
      debugRooms: () => {
        const snap = this.rooms.snapshot(this.clock.nowMs(), this.clock.wallMs());
        return this.traces.tag({ epoch: this.epoch, queues: this.queueSizes(), pending_registrations: this.driver.pendingRegistrations, ...snap, live: snap.live.map((r) => ({ ...r, step: this.driver.step(r.room), path: 'pd', kv_path: this.effects.job(r.room)?.kvPath ?? null, cached_tokens: this.effects.job(r.room)?.comp.cachedTokens ?? 0, evicted: this.effects.job(r.room)?.comp.evicted ?? [], computation: this.driver.leadOf(r.room) ?? null })) });
      },
      generate: (body, reply) => this.handleGenerate(body, reply),
      abort: (rid, room) => this.abort(rid, room, 'router'),
      tick: () => this.effects.tick(),
    };
  }

  /** Stop accepting, fail live rooms, close sockets, free the engine. Idempotent. */
  async close(): Promise<void> {
    this.edge?.stop();
    this.kvTracker?.close();
    this.effects.shutdown();
    await this.app?.close().catch(() => {});
    await this.closeRole();
    await this.engine.dispose();
  }

  /**
   * Tear down what is prefill's own, keeping the engine (weights, KV memory) for the next role:
   * fail live rooms, stop the sequence tracker, close the bootstrap listener and the tokenizer
   * thread. Idempotent.
   */
  async closeRole(): Promise<void> {
    this.kvTracker?.close();
    this.effects.shutdown();
    await this.kv?.close();
    await this.tokenizer.close();
  }

  /** Abort by rid and/or room id; unknown ids leave a tombstone (when the room id is known). */
  abort(rid: string | undefined, room: RoomId | undefined, from: 'router' | 'local'): void {
    this.effects.abort(rid, room, from);
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
    if (rooms.length > 1 && !body.first_token_from_prefill) return sendError(reply, ApiError.of('invalid_request', 'bootstrap_rooms needs first_token_from_prefill (each room gets its own first token)', 'bootstrap_rooms'));
    const admitted = this.effects.admit({ rooms, rid: body.rid, tokens, sampling, first: body.first_token_from_prefill, trace: body.trace_id ?? body.rid, ...(body.conversation_key ? { conversationKey: body.conversation_key } : {}), ...(body.cache_salt !== undefined ? { salt: body.cache_salt } : {}), ...(body.retention ? { retention: retentionFromWire(body.retention)! } : {}) });
    if (admitted.refused) return sendError(reply, admitted.refused);
    const { jobs } = admitted;
    const off = onClientGone(reply, () => this.effects.abortRooms(rooms));
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
}

/** Load the engine, start the worker. `testHooks`: the test-only hold points (the CLI: `testHooksFromEnv()`). */
export async function startPrefillWorker(raw: unknown, log = createLogger('prefill'), testHooks: TestHooks = noTestHooks): Promise<PrefillWorker> {
  const config = parseConfig(PrefillConfigSchema, raw);
  // prefill only reads the store: decode's finished prompt + reply states supersede its prompt-only ones
  const store = openPrefixStore(config.engine, config.stateDir, { write: false, maxFileBytes: config.maxStateBytes, log });
  const engine = await loadEngine({ ...config.engine, sequences: config.slots, prefixCache: prefixCacheOf(config.engine), ...(store ? { prefixStore: store } : {}), log: (level: string, msg: string) => log.debug({ level }, msg) });
  const w = new PrefillWorker(config, engine, log, undefined, undefined, testHooks);
  store?.registerMetrics(w.metrics.registry, (hit) => w.prefixMetrics.recordTier('store', hit));
  store?.onEvent((e) => w.kvEvents.publish(e));
  await w.start();
  return w;
}
