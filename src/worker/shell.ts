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
import { Gauge } from 'prom-client';
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
  /** The role and epoch serving now (default: `role`, `epoch`, not switchable): a switchable worker's host (../switch/) changes them at run time. */
  identity?(): WorkerIdentity;
  /** POST /role {role, epoch}: switch this worker's role; absent: 409 role_switch_refused (a fixed-role worker). */
  switchRole?(body: unknown): Promise<{ status: number; body: Record<string, unknown> }>;
  /** The /metrics body (default: `registry`'s text). */
  metricsText?(): Promise<string>;
  /** The state directory's condition of the role serving now (default: `space`). */
  spaceNow?(): StateSpace | undefined;
  /** The KV event log serving now (default: `kvEvents`). */
  kvEventsNow?(): KvEventLog;
}

/** GET /role: which role a worker serves now, under which epoch, and whether it can switch. */
export interface WorkerIdentity {
  role: 'prefill' | 'decode';
  epoch: string;
  switchable: boolean;
  /** serving; switching (drained, out of the pool); failed (a switch broke it: unhealthy until restarted). */
  state: 'serving' | 'switching' | 'failed';
  /** Prefill: the KV bootstrap address decode dials; null on decode. */
  bootstrap_host: string | null;
  bootstrap_port: number | null;
}

/** Headers the router sets on a /generate leg: the role and epoch it picked the worker for (a switched worker refuses the rest with `stale_epoch`). */
export const ROLE_HEADER = 'x-pdserve-role';
export const EPOCH_HEADER = 'x-pdserve-epoch';

/**
 * Why a /generate leg may not run here: its role or epoch header names another role or another
 * epoch than `now` (the worker switched, or restarted, since the router picked it); null when it
 * may (headers absent: no expectation).
 */
export function staleLegOf(headers: Record<string, unknown>, now: Pick<WorkerIdentity, 'role' | 'epoch'>): ApiError | null {
  const role = headers[ROLE_HEADER];
  const epoch = headers[EPOCH_HEADER];
  if (typeof role === 'string' && role !== now.role) return ApiError.of('stale_epoch', `this worker serves ${now.role} now (epoch ${now.epoch}), not ${role}: the router's view is stale`);
  if (typeof epoch === 'string' && epoch !== now.epoch) return ApiError.of('stale_epoch', `this worker's epoch is ${now.epoch}, not ${epoch}: it switched role or restarted since the router picked it`);
  return null;
}

/** What a role (prefill, decode) hands an HTTP edge: its identity, metrics, rooms and work routes. */
export type RoleEdgeParts = Pick<WorkerEdgeOptions, 'role' | 'epoch' | 'registry' | 'space' | 'kvEvents' | 'liveRooms' | 'requests' | 'queues' | 'health' | 'debugRooms' | 'generate' | 'abort' | 'tick' | 'onSignedProbe'>;

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
  const identity = (): WorkerIdentity => o.identity?.() ?? { role: o.role, epoch: o.epoch, switchable: false, state: 'serving', bootstrap_host: null, bootstrap_port: null };
  const modelNames = servedModelNamesOf(c.engine, e.info.modelName);
  o.space?.registerMetrics(o.registry);
  new Gauge({ name: 'pdserve_engine_context_tokens', help: 'Context size of one sequence, tokens (the planner divides queued prefill tokens by it)', registers: [o.registry] }).set(e.info.compat.contextSize);
  new Gauge({ name: 'pdserve_engine_slots', help: 'Sequence slots of the engine (the planner divides slots in use by it)', registers: [o.registry] }).set(e.info.sequences);
  const app = createWorkerApp({
    ...o,
    degraded: () => {
      const full = (o.spaceNow?.() ?? o.space)?.condition();
      return full ? [`${full.reason}: ${full.detail}`] : [];
    },
    modelNames,
    clusterSecret: c.secret,
    privateMetrics: c.privateMetrics,
    httpTimeouts: c.httpTimeouts,
    engine: o.tokenize ? e : undefined,
    offload: e,
    ...(o.metricsText ? { metricsText: o.metricsText } : {}),
    health: () => ({
      role: identity().role,
      build: BUILD,
      protocol: protocolVersion(),
      model: modelNames[0],
      fingerprint: e.info.fingerprint,
      settings: pairSettingsOf(e.info),
      epoch: identity().epoch,
      role_switch: identity().switchable,
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
    const stale = staleLegOf(req.headers, identity());
    if (stale) return sendError(reply, stale);
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
  registerKvEventsRoute(app, o.kvEventsNow ?? o.kvEvents, o.testHooks);
  app.get('/role', async () => identity());
  app.post('/role', async (req, reply) => {
    if (!o.switchRole) return sendError(reply, ApiError.of('role_switch_refused', `this ${o.role} worker cannot switch role: start it with \`pdserve worker --role ${o.role}\``));
    const r = await o.switchRole(req.body);
    return reply.code(r.status).send(r.body);
  });
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
