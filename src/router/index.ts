/**
 * The pdserve router: the OpenAI-compatible front door of a PD deployment.
 *
 *   createRouter(config) → { app, close(), registry, metrics, config }  (not listening)
 *   startRouter(config)  → the same plus { url, port }                    (listening)
 *
 * Config: see `./config.ts` (validated with zod, frozen). Endpoints:
 *   POST /v1/completions, POST /v1/chat/completions — dual dispatch, see `./dispatch.ts`
 *   POST /v1/responses, GET|DELETE /v1/responses/{id} — the chat path in process, see ../api/responses-http.ts
 *   GET /v1/models  — {object:'list', data:[{id, object:'model', owned_by:'pdserve', created}]}
 *                      with the `model` names reported by the workers' /health
 *   GET /v1/models/{id} — one of them, or 404 model_not_found
 *   POST /tokenize, POST /detokenize — vLLM's shapes, forwarded to a healthy prefill worker
 * CORS for `config.corsOrigin`; a wrong method on a known path is a 405 with `Allow`.
 *   GET /health     — 200 {status:'ok', ...} when ≥ 1 healthy prefill and decode, else 503
 *                      ({status:'draining'} while draining: see ../runtime/drain.ts)
 *   POST /abort_request {rid} — an operator ends the request in flight with that id: 499
 *                      request_aborted on every leg, never migrated (admin access); 404
 *                      request_not_found when none
 *   GET /workers    — {workers: WorkerSnapshot[], acquired_total, released_total, blocked_pairs}
 *                      (blocked_pairs: pairs out of the rotation after a failed KV handshake, ./pair-blocks.ts)
 *   POST /workers/role {url, role} — switch a `pdserve worker` to the other role (admin access;
 *                      ./role-switch.ts): 200 verified, 409 role_switch_refused, 503 role_switch_failed
 *   GET /metrics    — Prometheus text of the router's own registry (see `./metrics.ts`)
 *   GET /dashboard, /dashboard/data, /debug/traces[/:id], /debug/rooms — see `./dashboard.ts`
 * Errors are OpenAI error bodies. Every log line of a request carries its `rid`
 * (`cmpl-…` / `chatcmpl-…`), which is also the response `id` and the workers' rid, and its
 * `trace` (see `./trace.ts`), returned in the `x-trace-id` header.
 */
import { switchWorkerRole } from './role-switch.js';
import { SendQueueWatch } from '../runtime/send-queue.js';
import { registerBodyWatch } from '../api/body-watch.js';
import { BUILD, protocolVersion } from '../base/version.js';
import { noTestHooks, type TestHooks } from '../runtime/testhooks.js';
import { systemClock } from '../base/clock.js';
import { DrainGate } from '../runtime/drain.js';
import { performance } from 'node:perf_hooks';
import Fastify, { type FastifyInstance, type FastifyReply, type FastifyRequest } from 'fastify';
import pino, { type Logger } from 'pino';
import { Agent } from 'undici';
import { cacheSaltOf, registerAccess, tenantOf, type Access } from '../api/access.js';
import { registerAdmission } from '../api/admission.js';
import { withCredentials } from '../security/http-auth.js';
import { internalClientOptions, loadInternalTls, tlsServerOptions } from '../security/tls.js';
import { applyHttpTimeouts, fastifyTimeoutOptions } from '../runtime/http-timeouts.js';
import { registerCors, registerModelRoute, registerTokenizeProxy } from '../api/endpoints.js';
import { ApiError, checkModelName, openAIClientErrorHandler, registerOpenAIErrorHandling } from '../api/errors.js';
import { answerPlainHttp } from '../api/plain-http.js';
import type { Server as TlsServer } from 'node:tls';
import { parseChatRequest, parseCompletionRequest } from '../api/parse.js';
import { DEFAULT_SCHEMA_LIMITS } from '../api/json-schema.js';
import { planFanOut, serveFanOut } from '../api/fanout.js';
import { callerOf, HttpSink, type GenerationPort } from '../api/generation.js';
import { registerResponsesRoutes } from '../api/responses-http.js';
import { ResponseStore } from '../api/responses-store.js';
import { ChoiceGroups, groupMembers, type ChoiceGroup } from './choices.js';
import { parseRouterConfig, type RouterConfig, type RouterConfigInput } from './config.js';
import { newRid, type DispatchContext, type PdRequest } from './dispatch.js';
import { serveAttempts, type AttemptDeps } from './attempts.js';
import { PairBlocks } from './pair-blocks.js';
import { errorOutcome, RouterMetrics } from './metrics.js';
import { WorkerRegistry, type WorkerState } from './registry.js';
import { Counter } from 'prom-client';
import { createPolicy } from './policy/index.js';
import { Picker } from './picker.js';
import { KvEventConsumer } from './kv-events.js';
import { LoadWatch } from './load-watch.js';
import { RouterTokenizer } from './tokens.js';
import { registerDiagnostics } from './dashboard.js';
import { DashboardSeries } from './dashboard-series.js';
import { TraceStore, traceIdOf } from './trace.js';
import { randomHex } from './random-pool.js';
import { isGenerationRequest, RouterLogController } from './request-log.js';

export { parseRouterConfig, RouterConfigError, RouterConfigSchema, type RouterConfig, type RouterConfigInput } from './config.js';
export { LINGER_MS, newRid, randomRoom } from './dispatch.js';
export { workerError } from './worker-errors.js';
export { OUTCOMES, RouterMetrics, type Outcome } from './metrics.js';
export { WorkerRegistry, type Lease, type WorkerRole, type WorkerSnapshot, type WorkerState } from './registry.js';

export interface Router {
  app: FastifyInstance;
  config: RouterConfig;
  registry: WorkerRegistry;
  metrics: RouterMetrics;
  /** Requests being served right now. */
  readonly inflight: number;
  /** Graceful drain: `drain.startDraining()` refuses new requests (503 `draining`), /health says draining. */
  drain: DrainGate;
  /**
   * Stop polling, fail in-flight requests with 503 (aborting them on the workers), wait briefly
   * for the abort_request calls, close the HTTP server and the connection pools. Idempotent.
   */
  close(): Promise<void>;
  /** Tell the router its own listening URL (used in the doctor's suggested commands). */
  setUrl(url: string): void;
  /** Client access (API and admin keys): `describe()` for the banner. */
  access: Access;
}

export interface RunningRouter extends Router {
  /** http://host:port of the listening router. */
  url: string;
  port: number;
}

/** The trace id of a generation request, kept on its raw request by the child logger factory. */
const TRACE = Symbol('pdserve.trace');

/** Longest wait for a worker's POST /role (its drain, bounded by its --switch-drain-timeout-ms, and its rebuild), ms. */
const ROLE_SWITCH_TIMEOUT_MS = 120_000;
type TracedRaw = { [TRACE]?: string };

/** Request id by route: generation routes get the OpenAI-style id that becomes the rid. */
function genReqId(req: { url?: string }): string {
  const url = req.url ?? '';
  if (url.startsWith('/v1/chat/completions')) return newRid('chat');
  if (url.startsWith('/v1/completions')) return newRid('completion');
  return `req-${randomHex(8)}`;
}

function makeLogger(config: RouterConfig): Logger {
  if ('child' in config.log) return config.log as Logger;
  return pino({ name: 'router', level: config.log.level, base: { role: 'router', pid: process.pid } }, pino.destination(2));
}

/**
 * Build the router (validates `raw` first), probe every worker once, start health polling.
 * `testHooks`: the test-only hold points (`router.dispatch`, POST /debug/test-holds); production:
 * `noTestHooks` (the CLI: `testHooksFromEnv()`).
 * @throws RouterConfigError on an invalid config.
 */
export async function createRouter(raw: RouterConfigInput | RouterConfig, testHooks: TestHooks = noTestHooks): Promise<Router> {
  const config = parseRouterConfig(raw);
  const schemaLimits = { ...DEFAULT_SCHEMA_LIMITS, maxNodes: config.schemaMaxNodes, maxEnumValues: config.schemaMaxEnumValues };
  const log = makeLogger(config);
  // Every router → worker request is signed with the cluster secret (../security/http-auth.ts).
  const credentials = config.clusterSecret ? { sign: { secret: config.clusterSecret } } : {};
  // --internal-tls-*: https:// workers are verified with the CA and shown the client certificate.
  const internalTls = loadInternalTls(config.internalTls);
  const workerTls = internalTls ? internalClientOptions(internalTls) : {};
  const dataAgent = withCredentials(credentials, new Agent({
    connections: 256,
    pipelining: 1,
    keepAliveTimeout: 30_000,
    connect: { timeout: 5_000, ...workerTls },
    // Safety nets only: the request deadline (requestTimeoutMs) fires first.
    headersTimeout: config.requestTimeoutMs + 5_000,
    bodyTimeout: config.requestTimeoutMs + 5_000,
  }));
  const controlAgent = withCredentials(credentials, new Agent({ connections: 32, pipelining: 1, keepAliveTimeout: 10_000, connect: { timeout: 2_000, ...workerTls }, headersTimeout: 10_000, bodyTimeout: 10_000 }));
  const registry = new WorkerRegistry(config, { dispatcher: controlAgent, log, intervalMs: config.healthIntervalMs, timeoutMs: config.healthTimeoutMs, unhealthyAfter: config.unhealthyAfter });
  const metrics = new RouterMetrics(registry);
  const policyOptions = { cacheThreshold: config.cacheThreshold, balanceAbsThreshold: config.balanceAbsThreshold, balanceRelThreshold: config.balanceRelThreshold, maxTreeChars: config.maxTreeChars };
  // One policy (and prefix tree) per role: prefill holds the prefix cache.
  const policies = { prefill: createPolicy(config.policy, policyOptions), decode: createPolicy(config.decodePolicy, { ...policyOptions, packBatches: true }) };
  // Why each worker was chosen (cache_aware: cache_hit / cache_miss / imbalanced): the router's view of prefix locality.
  const picks = new Counter({ name: 'pdserve_router_policy_picks_total', help: 'Workers chosen by the load-balancing policy, by role, policy and reason', labelNames: ['role', 'policy', 'reason'], registers: [metrics.registry] });
  // What the workers really hold, per token block, from their KV events (./kv-events.ts).
  const kv = new KvEventConsumer(metrics.registry, undefined, (base) => withCredentials(credentials, base), workerTls, config.kvRouterMaxBlocks);
  // Other routers' load, as each worker counts it (./load-watch.ts): one long poll per worker.
  const loads = new LoadWatch((url) => registry.workers.find((w) => w.url === url)?.load ?? 0, (base) => withCredentials(credentials, base), workerTls);
  // The prompt's tokens as the workers tokenize it (./tokens.ts): exact routing needs the model's vocabulary.
  const tokenizer = config.model ? new RouterTokenizer(config.model, { registry: metrics.registry, cacheBytes: config.tokenizeCacheBytes }) : null;
  // loaded before the router serves (bounded by the thread's start deadline): a request never waits for it
  if (tokenizer) {
    await tokenizer.start().catch((err: unknown) => log.warn({ err: (err as Error).message, model: config.model }, 'router tokenizer did not start: routing without exact token blocks'));
    const cache = tokenizer.cache;
    if (cache && !cache.on && config.tokenizeCacheBytes > 0) log.warn({ why: cache.why, model: config.model }, 'router tokenizer chunk cache is off: every prompt is tokenized whole');
  }
  else log.info('no --model: the router routes without exact token blocks (approximate prefix tree; no decode-local)');
  const traces = new TraceStore();
  const series = new DashboardSeries();
  traces.onFinished = (_t, fields) => series.add(fields);
  const pending = new Set<Promise<unknown>>();
  const active = new Set<PdRequest>();
  const sendWatch = new SendQueueWatch({ deadlineMs: config.clientWriteDeadlineMs, maxBufferedBytes: config.clientMaxBufferedBytes }, { registry: metrics.registry });
  const ctx: DispatchContext = {
    testHooks,
    sendWatch,
    config,
    registry,
    metrics,
    dataAgent,
    controlAgent,
    observe: traces,
    track(p) {
      pending.add(p);
      void p.finally(() => pending.delete(p));
    },
  };
  const pairs = new PairBlocks();
  const picker = new Picker({ registry, policies, picks, kv, pairs, localPrefillMaxTokens: config.localPrefillMaxTokens, othersLoad: (url) => loads.others(url) });
  const attemptDeps: AttemptDeps = { ctx, picker, active, closing: () => closing, waiting: { n: 0 }, ...(tokenizer ? { tokensOf: (p) => tokenizer.tokensOf(p) } : {}) };
  // n > 1: the choices of one prompt share one prefill computation (choices.ts).
  const choiceGroups = new ChoiceGroups({ dataAgent, joinTimeoutMs: Math.min(config.requestTimeoutMs, 30_000), maxEventBytes: config.maxEventBytes, log });
  const createdAt = Math.floor(systemClock.wallMs() / 1000);
  let selfUrl = `${config.tls ? 'https' : 'http'}://${config.host}:${config.port}`;
  // Several routers on one etcd share per-key admission, stored Responses and their presence (../membership/router-state.ts).
  const shared = config.discovery
    ? new (await import('../membership/router-state.js')).RouterState({
        discovery: config.discovery,
        url: () => selfUrl,
        view: () => {
          const age = loads.oldestMs();
          return { workers: registry.workers.length, healthy: registry.workers.filter((w) => w.healthy).length, load_age_ms: Number.isFinite(age) && registry.workers.length ? Math.round(age) : null };
        },
        log,
        responses: { maxBytes: config.responsesStore.maxBytes, maxAgeMs: config.responsesStore.maxAgeMs },
      })
    : null;
  let closing = false;

  const app = Fastify({
    // --tls-cert/--tls-key: HTTPS for clients (../security/tls.ts).
    ...(config.tls ? { https: tlsServerOptions(config.tls) } : {}),
    loggerInstance: log,
    bodyLimit: config.bodyLimit,
    ...fastifyTimeoutOptions(config.httpTimeouts),
    clientErrorHandler: openAIClientErrorHandler,
    genReqId,
    requestIdHeader: false,
    // Probes (GET) are not worth two log lines each; a generation request's 'incoming request'
    // line is at debug (its info line comes after the response: ./request-log.ts).
    logController: new RouterLogController({ requestIdLogLabel: 'rid' }),
    // A generation request's logger carries its trace id from the start: one pino child with
    // {rid, trace} instead of fastify's {rid} child and a {trace} child of it in the hook below.
    childLoggerFactory(logger, bindings, opts, raw) {
      if (!isGenerationRequest(raw)) return logger.child(bindings, opts);
      const trace = traceIdOf(raw.headers);
      (raw as TracedRaw)[TRACE] = trace;
      return logger.child({ ...bindings, trace }, opts);
    },
  }) as unknown as FastifyInstance;
  applyHttpTimeouts(app.server, config.httpTimeouts);
  if (config.tls) answerPlainHttp(app.server as unknown as TlsServer);
  registerOpenAIErrorHandling(app);
  // Keys first: an unauthenticated caller learns nothing, not even that the router drains.
  const access = registerAccess(app, { apiKeys: config.apiKeys, apiKeyFile: config.apiKeyFile, adminKeys: config.adminApiKeys, privateMetrics: config.privateMetrics }, metrics.registry, log);
  registerAdmission(app, config.admission, metrics.registry, shared ?? undefined);
  const drain = new DrainGate('router');
  drain.install(app);
  // a large non-streamed body under the same send-queue watch as the streams (../api/body-watch.ts)
  registerBodyWatch(app, sendWatch, log);
  // Every response names its rid (errors included); hijacked streams set it themselves.
  // Callback style (no promise per request); on every route, so it runs after the drain gate's.
  app.addHook('onRequest', (request, reply, done) => {
    reply.header('x-request-id', String(request.id));
    if (isGenerationRequest(request)) {
      // Set by childLoggerFactory, which bound it to request.log.
      const trace = (request.raw as TracedRaw)[TRACE] ?? traceIdOf(request.headers);
      const rid = String(request.id);
      traces.begin(rid, trace);
      // Whatever ends the response ends the trace: dispatch records its own 'finished' as the
      // response ends; a refusal before dispatch or a fan-out parent is settled from the status.
      reply.raw.once('close', () => {
        const at = systemClock.wallMs(); // the finish is now, not when the settle runs
        setTimeout(() => traces.settle(rid, reply.raw.statusCode, at), 1000).unref();
      });
      reply.header('x-trace-id', trace);
    }
    done();
  });

  // One generation, in process (../api/generation.ts): the HTTP handler, n > 1 fan-out and the
  // Responses API all run a request through `port`; admission saw only the client's request.
  type Member = { group: ChoiceGroup; index: number };
  const port: GenerationPort<Member> = {
    parse(kind, body, caller) {
      try {
        const parsed = kind === 'chat' ? parseChatRequest(body, { maxToolCalls: config.maxToolCalls, schemaLimits }) : parseCompletionRequest(body, { schemaLimits });
        parsed.salt = cacheSaltOf(caller.tenant, parsed.cacheSalt);
        checkModelName(parsed.model, registry.models());
        if (closing) throw ApiError.of('shutting_down', 'router is shutting down');
        // Token 1's logprob exists only where it was sampled: prefill's first-token event.
        if (parsed.sampling.logprobs !== undefined && !config.firstTokenFromPrefill) {
          throw ApiError.of('unsupported_value', "Unsupported value for 'logprobs': logprobs need the first token from prefill (this router runs with --no-first-token-from-prefill)", 'logprobs');
        }
        return parsed;
      } catch (err) {
        metrics.requests.labels(errorOutcome(err)).inc();
        throw err;
      }
    },
    async generate(g, sink) {
      const { caller, rid } = g;
      let log = caller.log as unknown as Logger;
      if (g.inProcess) {
        // A choice or a Responses request: its own trace entry (the client's trace context) and log fields, as a request of its own.
        const trace = traceIdOf(caller.headers);
        traces.begin(rid, trace);
        log = log.child({ rid, trace });
      }
      // The client's own id (vLLM's body field): a label of the trace, never the workers' rid.
      if (g.label !== undefined) traces.label(rid, g.label);
      let status = 200;
      try {
        await serveAttempts(attemptDeps, { rid, log, sessionId: caller.sessionId, parentRid: g.parentRid }, sink, g.parsed, g.member);
      } catch (err) {
        status = err instanceof ApiError ? err.status : 500;
        throw err;
      } finally {
        g.member?.group.leave(g.member.index);
        if (g.inProcess) traces.settle(rid, sink.signal.aborted ? 499 : status);
      }
    },
    // n > 1: the choices of one prompt share one prefill computation (choices.ts).
    members: (subs) => {
      const of = config.firstTokenFromPrefill ? groupMembers(choiceGroups, subs) : undefined;
      return (s) => of?.(s);
    },
    streams: { writeTimeoutMs: config.writeTimeoutMs, watch: sendWatch, keepAliveMs: config.sseKeepAliveMs },
  };

  const generation = (kind: 'completion' | 'chat') =>
    async function handler(request: FastifyRequest, reply: FastifyReply): Promise<FastifyReply> {
      // n > 1 / batched prompts: one generation (one PD room) per choice, merged (api/fanout.ts);
      // the n choices of one prompt share one prefill computation (choice groups, choices.ts).
      const subs = planFanOut(kind, request.body);
      if (subs) return serveFanOut(request, reply, kind, subs, port);
      const caller = callerOf(request);
      const parsed = port.parse(kind, request.body, caller);
      const label = (request.body as { request_id?: unknown }).request_id;
      const sink = new HttpSink(reply, port.streams);
      await port.generate({ parsed, rid: String(request.id), caller, inProcess: false, ...(typeof label === 'string' ? { label } : {}) }, sink);
      return sink.finish();
    };

  app.post('/v1/completions', generation('completion'));
  app.post('/v1/chat/completions', generation('chat'));
  registerResponsesRoutes(app, { store: new ResponseStore(config.responsesStore, undefined, shared ?? undefined), models: () => registry.models(), bodyLimit: config.bodyLimit, port, registry: metrics.registry });

  app.get('/v1/models', async () => ({
    object: 'list',
    data: registry.models().map((id) => ({ id, object: 'model', owned_by: 'pdserve', created: createdAt })),
  }));
  registerModelRoute(app, () => registry.models(), createdAt);
  registerTokenizeProxy(app, () => registry.pick('prefill')?.url ?? null, controlAgent, config.abortTimeoutMs * 5);
  registerCors(app, config.corsOrigin);

  app.get('/health', async (_req, reply) => {
    const role = (r: 'prefill' | 'decode') => ({ healthy: registry.healthyCount(r), total: registry.workers.filter((w) => w.role === r).length });
    const prefill = role('prefill');
    const decode = role('decode');
    const ok = prefill.healthy > 0 && decode.healthy > 0 && !closing && !drain.draining;
    return reply.code(ok ? 200 : 503).send({ status: ok ? 'ok' : drain.draining ? 'draining' : 'unavailable', role: 'router', build: BUILD, protocol: protocolVersion(), models: registry.models(), prefill, decode, inflight: active.size });
  });

  testHooks.registerRoute(app);
  registerDiagnostics(app, { registry, metrics, traces, series, inflight: () => active.size, selfUrl: () => selfUrl, dispatcher: controlAgent });

  // A supervisor that restarted a worker asks for an immediate probe (static membership's push;
  // etcd membership does the same on registration). Only configured or registered workers.
  app.post('/workers/probe', async (req) => {
    const url = (req.body as { url?: unknown } | null)?.url;
    const w = typeof url === 'string' ? registry.workers.find((x) => x.url === url.replace(/\/+$/, '')) : undefined;
    if (!w) throw new ApiError(404, 'worker_not_found', `no worker ${JSON.stringify(url)} in the pool`, 'not_found_error', 'url');
    await registry.check(w, true);
    return registry.snapshot().find((x) => x.url === w.url);
  });

  // An operator ends a request in flight (doctor's "fail it now"): by its id (the response id,
  // x-request-id; an attempt's worker rid `<rid>-a<n>` too; n > 1: every choice). Every leg ends with request_aborted;
  // never retried or migrated (./dispatch.ts `abortByOperator`). Admin access (../api/access.ts).
  app.post('/abort_request', async (req) => {
    const rid = (req.body as { rid?: unknown } | null)?.rid;
    if (typeof rid !== 'string' || rid.length === 0 || rid.length > 256) throw new ApiError(400, 'invalid_request', "'rid' must be the request's id (its response id, x-request-id)", 'invalid_request_error', 'rid');
    const runs = [...active].filter((r) => r.rid === rid || r.workerRid === rid || r.parentRid === rid);
    const aborted = runs.filter((r) => r.abortByOperator()).length;
    if (aborted === 0) throw ApiError.of('request_not_found', `no request ${JSON.stringify(rid)} is in flight at this router`, 'rid');
    log.warn({ rid, aborted }, 'request aborted by an operator (POST /abort_request)');
    return { rid, aborted };
  });

  // An operator or the planner flips a switchable worker's role (./role-switch.ts): out of the
  // pool, the worker's POST /role, GET /role verified, back in the pool in its new role.
  app.post('/workers/role', async (req, reply) => {
    const b = (req.body ?? {}) as { url?: unknown; role?: unknown };
    if (typeof b.url !== 'string' || (b.role !== 'prefill' && b.role !== 'decode')) throw ApiError.of('invalid_request', "POST /workers/role wants {url: a worker's URL, role: 'prefill' | 'decode'}", typeof b.url !== 'string' ? 'url' : 'role');
    const r = await switchWorkerRole({ registry, dispatcher: controlAgent, log, switchTimeoutMs: ROLE_SWITCH_TIMEOUT_MS }, b.url, b.role);
    return reply.code(r.status).send(r.body);
  });

    app.get('/workers', async () => ({ workers: registry.snapshot().map((w) => ({ ...w, others_load: loads.others(w.url) })), acquired_total: registry.acquiredTotal, released_total: registry.releasedTotal, blocked_pairs: pairs.snapshot() }));

  app.get('/metrics', async (_req, reply) => {
    const text = await metrics.registry.metrics();
    return reply.header('content-type', metrics.registry.contentType).send(text);
  });

  // A restarted worker's old handshake failures say nothing of the new process.
  registry.onRecovered = (w) => pairs.forget(w.url);
  // Workers that join later (etcd membership) are followed from their join; leaves are forgotten.
  registry.onAdded = (w) => {
    kv.follow(w);
    loads.follow(w.url);
  };
  registry.onRemoved = (w) => {
    metrics.forgetWorker(w.url);
    kv.forget(w.url);
    loads.forget(w.url);
    policies.prefill.forget?.(w.url);
    policies.decode.forget?.(w.url);
  };
  await registry.start();
  for (const w of registry.workers) {
    kv.follow(w);
    loads.follow(w.url);
  }
  // Membership on etcd (optional): the pool follows registrations, drains and lease expiries.
  let discovery: { stop(): Promise<void> } | null = null;
  if (config.discovery) {
    const { EtcdDiscovery } = await import('../membership/watch.js');
    const d = new EtcdDiscovery({ discovery: config.discovery, registry, log });
    try {
      await d.start();
      await shared?.start();
    } catch (err) {
      await d.stop();
      registry.stop();
      await kv.close();
      await loads.close();
      await tokenizer?.close();
      await Promise.allSettled([dataAgent.destroy(), controlAgent.destroy()]);
      throw err;
    }
    discovery = d;
  }
  await app.ready();

  let closed: Promise<void> | null = null;
  const close = (): Promise<void> =>
    (closed ??= (async () => {
      closing = true;
      await discovery?.stop();
      await shared?.stop();
      registry.stop();
      await kv.close();
      await loads.close();
      await tokenizer?.close();
      for (const r of [...active]) r.cancel();
      const settle = Promise.allSettled([...pending]);
      await Promise.race([settle, new Promise((r) => setTimeout(r, config.abortTimeoutMs + 100).unref())]);
      await app.close();
      await Promise.allSettled([dataAgent.destroy(), controlAgent.destroy()]);
    })());

  return {
    app,
    config,
    registry,
    metrics,
    get inflight() {
      return active.size;
    },
    drain,
    access,
    close,
    setUrl(url: string) {
      selfUrl = url;
    },
  };
}

/** createRouter + listen on config.host:config.port. */
export async function startRouter(raw: RouterConfigInput | RouterConfig, testHooks: TestHooks = noTestHooks): Promise<RunningRouter> {
  const r = await createRouter(raw, testHooks);
  try {
    await r.app.listen({ host: r.config.host, port: r.config.port });
  } catch (err) {
    await r.close();
    throw err;
  }
  const addr = r.app.server.address();
  const port = typeof addr === 'object' && addr ? addr.port : r.config.port;
  const h = r.config.host === '0.0.0.0' ? '127.0.0.1' : r.config.host === '::' ? '[::1]' : r.config.host.includes(':') ? `[${r.config.host}]` : r.config.host;
  const url = `${r.config.tls ? 'https' : 'http'}://${h}:${port}`;
  r.setUrl(url);
  r.app.log.info({ url, prefill: r.config.prefill.map((p) => p.url), decode: r.config.decode.map((d) => d.url), access: r.access.describe() }, 'router listening');
  if (r.access.apiOpen) r.app.log.warn('the router is OPEN: no API key is configured, anyone who reaches its port can use it (see SECURITY.md)');
  return Object.assign(r, { url, port });
}
