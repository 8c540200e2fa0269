/**
 * Pieces every worker's HTTP server shares: a fastify instance whose errors are OpenAI error
 * bodies, signed-request checking from the cluster secret (./auth.ts), GET /health (503 `status: 'draining'` once draining), GET /metrics and GET
 * /debug/rooms, a drain gate on the work routes (`drainGateOf`, see ./drain.ts), and a deferred
 * helper.
 */
import Fastify, { LogController, type FastifyBaseLogger, type FastifyInstance, type FastifyReply } from 'fastify';
import { systemClock } from '../base/clock.js';
import type { Registry } from 'prom-client';
import { registerCors, registerModelRoute, registerTokenizeRoutes } from '../api/endpoints.js';
import { isSigned, registerWorkerAuth } from './auth.js';
import { internalServerOptions, tlsServerOptions, type InternalTls, type TlsFiles } from '../security/tls.js';
import { applyHttpTimeouts, fastifyTimeoutOptions, type HttpTimeouts } from '../runtime/http-timeouts.js';
import { openAIClientErrorHandler, registerOpenAIErrorHandling, sendApiError } from '../api/errors.js';
import { answerPlainHttp } from '../api/plain-http.js';
import type { Server as TlsServer } from 'node:tls';
import type { Engine } from '../engine/types.js';
import type { ApiError } from '../base/errors.js';
import { DrainGate } from '../runtime/drain.js';
import type { TestHooks } from '../runtime/testhooks.js';
import type { Logger } from '../base/log.js';
import { registerGpuMetrics } from '../runtime/gpu-metrics.js';
import { describeGpu, gpuHealthOf } from '../engine/gpu.js';

export interface WorkerAppOptions {
  log: Logger;
  registry: Registry;
  /** Body of GET /health (status 'ok' added). */
  health(): Record<string, unknown>;
  /** Conditions that make the worker unfit for new work while alive (`state_dir_full: …`): /health answers 200 `status: 'degraded'` with them as `degraded`. */
  degraded?(): string[];
  /** Body of GET /debug/rooms. */
  debugRooms(): unknown;
  /** Served model names (first = responses' `model`), listed by GET /v1/models and reported in /health as `served_model_names`. */
  modelNames: readonly string[];
  /** Largest request body, bytes. */
  bodyLimit?: number;
  /** When given: POST /tokenize and /detokenize on this engine (vLLM's shapes). */
  engine?: Engine;
  /** CORS origins ('*' = any); none = no CORS headers. */
  corsOrigins?: readonly string[];
  /** Installs the app's request guard (authentication hooks) before any other hook. */
  guard?: (app: FastifyInstance) => void;
  /** The cluster secret: every route but GET /health (and /metrics) needs a signed request (./auth.ts). */
  clusterSecret?: string;
  /** With `clusterSecret`: /metrics needs a signature too. */
  privateMetrics?: boolean;
  /** HTTPS: PEM certificate and key files (../security/tls.ts). */
  tls?: TlsFiles;
  /** HTTPS for the cluster's own calls (../security/tls.ts `internalServerOptions`: mutual when it has a CA); ignored with `tls`. */
  internalTls?: InternalTls;
  /** Called with the query of every GET /health that carried a valid signature (the router's probe). */
  onSignedProbe?: (query: Record<string, unknown>) => void;
  /** The server's keep-alive, headers and request timeouts (../runtime/http-timeouts.ts; absent: the defaults). */
  httpTimeouts?: Partial<HttpTimeouts>;
  /** The /metrics body (default: `registry`'s text): a switchable worker adds the serving role's registry. */
  metricsText?(): Promise<string>;
  /** The engine whose GPU offload is logged at start, reported in /health (`gpu`) and /metrics; default `engine`. */
  offload?: Engine;
  /** Test-only hold points: when on, POST /debug/test-holds is served (../runtime/testhooks.ts); default `noTestHooks`. */
  testHooks?: TestHooks;
}

const gates = new WeakMap<FastifyInstance, DrainGate>();

/** The drain gate `createWorkerApp` installed on `app` (see ../runtime/drain.ts). */
export function drainGateOf(app: FastifyInstance): DrainGate | undefined {
  return gates.get(app);
}

/** Create a fastify app with the shared endpoints; the caller adds role routes, then listens. */
export function createWorkerApp(o: WorkerAppOptions): FastifyInstance {
  // return503OnClosing false: the drain gate answers work reaching a closing app with `draining`.
  const https = o.tls ? tlsServerOptions(o.tls) : o.internalTls ? internalServerOptions(o.internalTls) : undefined;
  const app: FastifyInstance = Fastify({ ...(https ? { https } : {}), loggerInstance: o.log as FastifyBaseLogger, bodyLimit: o.bodyLimit ?? 8 * 1024 * 1024, ...fastifyTimeoutOptions(o.httpTimeouts), return503OnClosing: false, clientErrorHandler: openAIClientErrorHandler, logController: new LogController({ disableRequestLogging: true }) });
  applyHttpTimeouts(app.server, o.httpTimeouts);
  if (https) answerPlainHttp(app.server as unknown as TlsServer);
  registerOpenAIErrorHandling(app);
  if (o.clusterSecret !== undefined) registerWorkerAuth(app, { secret: o.clusterSecret, privateMetrics: o.privateMetrics }, o.registry);
  o.guard?.(app);
  const offload = o.offload ?? o.engine;
  if (offload) {
    const g = offload.info.gpu;
    o.log.info({ gpu: gpuHealthOf(g), kv_cache_type: offload.info.compat.kvCacheType }, `engine: ${describeGpu(g)}`);
    registerGpuMetrics(o.registry, offload);
  }
  const gate = new DrainGate('worker');
  gates.set(app, gate);
  gate.install(app, { closeIdle: false }); // see DrainGate.install: the router re-dispatches a draining 503
  app.get('/health', async (req, reply) => {
    if (o.onSignedProbe && isSigned(req)) o.onSignedProbe((req.query ?? {}) as Record<string, unknown>);
    // tool_call_syntax: the router parses tool calls in the model's syntax (null = no tool calls).
    const body = { ...o.health(), served_model_names: o.modelNames, ...(o.engine ? { tool_call_syntax: o.engine.toolSyntax } : {}), ...(offload ? { gpu: gpuHealthOf(offload.info.gpu) } : {}) };
    const degraded = gate.draining ? [] : (o.degraded?.() ?? []);
    if (degraded.length > 0) return { status: 'degraded', degraded, ...body };
    if (!gate.draining) return { status: 'ok', ...body };
    return reply.code(503).send({ status: 'draining', ...body, inflight: gate.inflight });
  });
  app.get('/metrics', async (_req, reply) => {
    reply.header('content-type', o.registry.contentType);
    return o.metricsText ? o.metricsText() : o.registry.metrics();
  });
  app.get('/debug/rooms', async () => o.debugRooms());
  const created = Math.floor(systemClock.wallMs() / 1000);
  app.get('/v1/models', async () => ({ object: 'list', data: o.modelNames.map((id) => ({ id, object: 'model', owned_by: 'pdserve', created })) }));
  registerModelRoute(app, () => [...o.modelNames], created);
  if (o.engine) registerTokenizeRoutes(app, o.engine, o.modelNames);
  registerCors(app, o.corsOrigins ?? []);
  o.testHooks?.registerRoute(app);
  return app;
}

/** Listen on host:port (0 = any free port); returns the base URL with the real port. */
export async function listenUrl(app: FastifyInstance, host: string, port: number): Promise<string> {
  await app.listen({ host, port });
  const addr = app.server.address();
  const scheme = (app.initialConfig as { https?: unknown }).https ? 'https' : 'http';
  return `${scheme}://${host}:${typeof addr === 'object' && addr ? addr.port : port}`;
}

/** Send an OpenAI error body; if the response has already started, just end it. */
export function sendError(reply: FastifyReply, err: ApiError): void {
  if (reply.sent || reply.raw.headersSent) {
    if (!reply.raw.writableEnded) reply.raw.end();
    return;
  }
  void sendApiError(reply, err);
}

/** A promise with its resolve/reject exposed; settles once (later calls are ignored). */
export interface Deferred<T> {
  promise: Promise<T>;
  resolve(v: T): void;
  reject(e: unknown): void;
  settled: boolean;
}
export function deferred<T>(): Deferred<T> {
  let res!: (v: T) => void;
  let rej!: (e: unknown) => void;
  const d: Deferred<T> = {
    promise: new Promise<T>((a, b) => {
      res = a;
      rej = b;
    }),
    settled: false,
    resolve(v) {
      if (d.settled) return;
      d.settled = true;
      res(v);
    },
    reject(e) {
      if (d.settled) return;
      d.settled = true;
      rej(e);
    },
  };
  d.promise.catch(() => {});
  return d;
}

/** Calls `fn` once when the client goes away before the response finished. Returns a disposer. */
export function onClientGone(reply: FastifyReply, fn: () => void): () => void {
  const res = reply.raw;
  const h = () => {
    if (!res.writableFinished) fn();
  };
  res.once('close', h);
  return () => res.off('close', h);
}
