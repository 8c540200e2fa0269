/**
 * The HTTP edge both worker roles (prefill, decode) share, start to close: the app of
 * ./http.ts `createWorkerApp` (OpenAI error bodies, signed-request auth from the cluster
 * secret, GET /health, /metrics, /debug/rooms, the drain gate), the health fields every role
 * reports, the work routes POST /generate and POST /abort_request handed to the role, GET
 * /kv_events, the stale state-file sweeper, listening, and the watchdog that ticks the role's
 * driver (its deadlines). A role keeps only what is its own: the KV channel, the engine ports and
 * the handling of one /generate.
 */
import type { FastifyInstance, FastifyReply } from 'fastify';
import { servedModelNamesOf } from '../config/config.js';
import { ApiError, toApiError, type RoomFailure } from '../base/errors.js';
import { BUILD, peerProtocol, protocolMismatch, protocolVersion } from '../base/version.js';
import { abortCauseOf } from '../protocol/worker-protocol.js';
import type { KvEventLog } from '../protocol/kv-events.js';
import type { Logger } from '../base/log.js';
import { systemTimers, type Timers } from '../base/clock.js';
import { pairSettingsOf } from '../protocol/pair.js';
import { parseRoomId } from '../base/room-id.js';
import { startStateSweeper, sweepStaleStateFiles } from '../runtime/statefiles.js';
import type { StateSpace } from '../runtime/state-space.js';
import type { Engine } from '../engine/types.js';
import type { RoomId } from '../kv/types.js';
import { registerLoadRoute } from './load-route.js';
import { registerKvEventsRoute } from './kv-events-route.js';
import type { HttpTimeouts } from '../runtime/http-timeouts.js';
import { createWorkerApp, listenUrl, sendError, type WorkerAppOptions } from './http.js';

/** Role, identity and the work a worker role hands its edge. */
/** The worker config fields the edge reads (../config/config.ts, shared by both roles). */
export interface WorkerEdgeConfig {
  host: string;
  /** 0 = any free port. */
  port: number;
  /** Watchdog period, ms. */
  watchdogMs: number;
  /** State-file directory: stale files of dead processes are swept at start and every STATE_SWEEP_MS. */
  stateDir: string;
  /** The cluster secret (signed requests on every route but /health and open /metrics). */
  secret: string;
  privateMetrics: boolean;
  /** The HTTP server's timeouts (../runtime/http-timeouts.ts). */
  httpTimeouts?: Partial<HttpTimeouts>;
  /** Engine settings: `servedModelName` names the model in /health, /v1/models and responses. */
  engine: { servedModelName?: readonly string[] };
}

export interface WorkerEdgeOptions extends Omit<WorkerAppOptions, 'health' | 'engine' | 'offload' | 'modelNames' | 'clusterSecret' | 'privateMetrics' | 'degraded'> {
  role: 'prefill' | 'decode';
  config: WorkerEdgeConfig;
  /** The role's engine: identity fields of /health (fingerprint, pair settings, slots) and the GPU offload report. */
  engine: Engine;
  /** Serve POST /tokenize and /detokenize on `engine` too. */
  tokenize?: boolean;
  /** This process's epoch (/health `epoch`; a restarted worker has a new one). */
  epoch: string;
  /** The role's KV event log (GET /kv_events long polls). */
  kvEvents: KvEventLog;
  /** Live rooms (/health `rooms`). */
  liveRooms(): number;
  /** Requests held now in any step (GET /load `rooms`, the load routers share); default `liveRooms`. */
  requests?(): number;
  /** Queue name → entries (/health, flattened). */
  queues(): Record<string, number>;
  /** The state directory's full condition: /health `degraded` while it holds, its metrics on the role's registry. */
  space?: StateSpace;
  /** The role's own /health fields (added after the shared ones). */
  health?(): Record<string, unknown>;
  /** POST /generate: the role answers on `reply` (a stream or a JSON body). */
  generate(body: unknown, reply: FastifyReply): Promise<void>;
  /** POST /abort_request {rid?, bootstrap_room?, cause?}: the router gives up a request (unknown ids are fine); `cause` when it said why. */
  abort(rid: string | undefined, room: RoomId | undefined, cause?: RoomFailure): void;
  /** One watchdog tick (the driver's deadline checks). */
  tick(): void;
  /** The watchdog's timer (default: the process's). */
  timers?: Timers;
}

/** A listening worker edge. */
export interface WorkerEdge {
  app: FastifyInstance;
  /** scheme://host:port of the listening app (the real port). */
  url: string;
  /** Stop the watchdog and the sweeper (the role closes `app` when its driver has shut down). Idempotent. */
  stop(): void;
}

/**
 * Sweep stale state files, create the worker app, add the work routes, listen, start the
 * watchdog and the sweeper.
 * @throws the listen error (EADDRINUSE, EACCES); the sweeper is stopped first.
 */
export async function serveWorkerEdge(o: WorkerEdgeOptions): Promise<WorkerEdge> {
  const c = o.config;
  await sweepStaleStateFiles(c.stateDir, o.log);
  const stopSweep = startStateSweeper(c.stateDir, o.log);
  const e = o.engine;
  const modelNames = servedModelNamesOf(c.engine, e.info.modelName);
  o.space?.registerMetrics(o.registry);
  const app = createWorkerApp({
    ...o,
    degraded: () => {
      const full = o.space?.condition();
      return full ? [`${full.reason}: ${full.detail}`] : [];
    },
    modelNames,
    clusterSecret: c.secret,
    privateMetrics: c.privateMetrics,
    httpTimeouts: c.httpTimeouts,
    engine: o.tokenize ? e : undefined,
    offload: e,
    health: () => ({
      role: o.role,
      build: BUILD,
      protocol: protocolVersion(),
      model: modelNames[0],
      fingerprint: e.info.fingerprint,
      settings: pairSettingsOf(e.info),
      epoch: o.epoch,
      slots: e.info.sequences,
      slots_free: e.slotsFree(),
      rooms: o.liveRooms(),
      ...o.queues(),
      ...o.health?.(),
    }),
  });
  // A role's handler answers its own errors; anything it throws still leaves as an OpenAI error body.
  app.post('/generate', async (req, reply) => {
    // Another protocol major misreads this body or its answer: refused before anything runs.
    const theirs = peerProtocol((req.body as { protocol?: unknown } | null)?.protocol);
    const why = protocolMismatch(protocolVersion(), theirs);
    if (why) return sendError(reply, ApiError.of('protocol_mismatch', `${o.role} worker (${BUILD.id}) refuses a request of another protocol: ${why}`));
    try {
      await o.generate(req.body, reply);
    } catch (err) {
      o.log.error({ err: (err as Error).message }, `${o.role} /generate threw`);
      sendError(reply, toApiError(err));
    }
  });
  app.post('/abort_request', async (req) => {
    const b = (req.body ?? {}) as { rid?: unknown; bootstrap_room?: unknown; cause?: unknown };
    o.abort(typeof b.rid === 'string' ? b.rid : undefined, parseRoomId(b.bootstrap_room), abortCauseOf(b.cause));
    return { ok: true };
  });
  registerKvEventsRoute(app, o.kvEvents);
  registerLoadRoute(app, () => ({ rooms: o.requests?.() ?? o.liveRooms(), slots: e.info.sequences, slots_free: e.slotsFree() }));
  let url: string;
  try {
    url = await listenUrl(app, c.host, c.port);
  } catch (err) {
    stopSweep();
    await app.close().catch(() => {});
    throw err;
  }
  let stopWatchdog: (() => void) | undefined = (o.timers ?? systemTimers).every(c.watchdogMs, o.tick);
  if (o.testHooks?.enabled) o.log.warn({ holds: o.testHooks.spec }, 'PDSERVE_TEST_HOLDS is set: test-only pauses are active');
  return {
    app,
    url,
    stop() {
      if (!stopWatchdog) return;
      stopWatchdog();
      stopWatchdog = undefined;
      stopSweep();
    },
  };
}
