/**
 * `pdserve colocated`: the OpenAI API served by one process that evaluates prompts and decodes
 * in one llama.cpp context — no disaggregation. Same request schemas, same response builders
 * and the same engine calls as PD, so greedy outputs can be compared token for token.
 */
import { BUILD, protocolVersion } from '../base/version.js';
import { newRoomId } from '../base/room-id.js';
import { randomBytes } from 'node:crypto';
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { ApiError, checkModelName, apiErrorOf } from '../api/errors.js';
import { callerOf, HttpSink, newResponseId, type GenerationPort } from '../api/generation.js';
import { outputChecksOf, responseToolSyntax, parseChatRequest, parseCompletionRequest, toWorkerRequest, type ParsedRequest } from '../api/parse.js';
import { OpenAIResponseBuilder, SSE_DONE } from '../api/respond.js';
import { DEFAULT_SCHEMA_LIMITS } from '../api/json-schema.js';
import { planFanOut, serveFanOut } from '../api/fanout.js';
import { registerResponsesRoutes } from '../api/responses-http.js';
import { ResponseStore } from '../api/responses-store.js';
import { ColocatedConfigSchema, kvEventBlockTokens, parseConfig, prefixCacheOf, servedModelNamesOf, type ColocatedConfig } from '../config/config.js';
import { PrefixCacheMetrics } from '../prefixes/prefix-metrics.js';
import { openPrefixStore } from '../prefixes/prefix-store.js';
import { createWorkerApp, listenUrl } from '../worker/http.js';
import { systemClock } from '../base/clock.js';
import { createLogger, type Logger } from '../base/log.js';
import { WorkerMetrics } from '../runtime/metrics.js';
import { loadEngine } from '../engine/index.js';
import type { Engine } from '../engine/types.js';
import { ColocatedBackend } from './backend.js';
import { cacheSaltOf, registerAccess, type Access } from '../api/access.js';
import { registerAdmission } from '../api/admission.js';
import { KvEventLog } from '../protocol/kv-events.js';
import { registerKvEventsRoute } from '../worker/kv-events-route.js';
import { SequenceKvTracker } from '../worker/kv-tracker.js';
import { conversationKey } from '../protocol/conversation-key.js';
import { SendQueueWatch } from '../runtime/send-queue.js';
import { registerBodyWatch } from '../api/body-watch.js';
import { noTestHooks, type TestHooks } from '../runtime/testhooks.js';
import { SseError } from '../api/sse.js';

/** A running colocated server. */
export interface ColocatedServer {
  url: string;
  /** The HTTP app (its drain gate: `drainGateOf(app)`). */
  app: FastifyInstance;
  backend: ColocatedBackend;
  close(): Promise<void>;
}

/** Load the engine and serve /v1/completions, /v1/chat/completions, /v1/responses(/{id}), /v1/models(/{id}), /tokenize, /detokenize, /health, /metrics (CORS for config.corsOrigin); `testHooks`: the test-only hold points (the CLI: `testHooksFromEnv()`). */
export async function startColocated(raw: unknown, log: Logger = createLogger('colocated'), testHooks: TestHooks = noTestHooks): Promise<ColocatedServer> {
  const config: ColocatedConfig = parseConfig(ColocatedConfigSchema, raw);
  const schemaLimits = { ...DEFAULT_SCHEMA_LIMITS, maxNodes: config.schemaMaxNodes, maxEnumValues: config.schemaMaxEnumValues };
  const store = openPrefixStore(config.engine, '/dev/shm', { write: true, log });
  const engine: Engine = await loadEngine({ ...config.engine, sequences: config.slots, prefixCache: prefixCacheOf(config.engine), ...(store ? { prefixStore: store } : {}), log: (level: string, msg: string) => log.debug({ level }, msg) });
  let backend: ColocatedBackend | undefined;
  const metrics = new WorkerMetrics('colocated', {
    queues: () => ({ colocated_waiting_queue: backend?.waiting ?? 0, colocated_running: backend?.running ?? 0 }),
    roomsByState: () => new Map(),
  });
  const prefixMetrics = new PrefixCacheMetrics(metrics.registry, () => engine.cachedStats(), () => engine.evictionStats?.() ?? []);
  store?.registerMetrics(metrics.registry, (hit) => prefixMetrics.recordTier('store', hit));
  // KV events as the workers publish them (GET /kv_events, pdserve_kv_events_published_total):
  // the store's files by chain key, kept token blocks per entry (../worker/kv-tracker.ts).
  const kvEvents = new KvEventLog({ registry: metrics.registry, blockTokens: kvEventBlockTokens(config.engine) });
  store?.onEvent((e) => kvEvents.publish(e));
  const kvTracker = engine.info.cacheSequences > 0 ? new SequenceKvTracker(engine, kvEvents, kvEventBlockTokens(config.engine)) : null;
  backend = new ColocatedBackend(engine, { maxWaiting: config.maxWaiting, slotWaitMs: config.requestTimeoutMs }, prefixMetrics, kvTracker, testHooks);
  const names = servedModelNamesOf(config.engine, engine.info.modelName);
  // stalled and too-slow readers (../runtime/send-queue.ts): streams, n > 1, Responses and large non-streamed bodies
  const sendWatch = new SendQueueWatch({ deadlineMs: config.clientWriteDeadlineMs, maxBufferedBytes: config.clientMaxBufferedBytes }, { registry: metrics.registry });
  let access: Access | undefined;
  const app = createWorkerApp({
    testHooks,
    log,
    registry: metrics.registry,
    modelNames: names,
    health: () => ({ role: 'colocated', build: BUILD, protocol: protocolVersion(), model: names[0], fingerprint: engine.info.fingerprint, slots: engine.info.sequences, slots_free: engine.slotsFree(), colocated_waiting_queue: backend.waiting, colocated_running: backend.running }),
    debugRooms: () => ({ role: 'colocated', live: [...backend.live.values()].map(({ t0, ...r }) => ({ ...r, age_ms: Math.round(systemClock.nowMs() - t0) })), recent: [] }),
    engine,
    corsOrigins: config.corsOrigin,
    httpTimeouts: config.httpTimeouts,
    ...(config.tls ? { tls: config.tls } : {}),
    guard: (a) => {
      access = registerAccess(a, { apiKeys: config.apiKeys, apiKeyFile: config.apiKeyFile, adminKeys: config.adminApiKeys, privateMetrics: config.privateMetrics }, metrics.registry, log);
      registerAdmission(a, config.admission, metrics.registry);
    },
  });
  registerBodyWatch(app, sendWatch, log);

  // One generation, in process (../api/generation.ts): the HTTP handler, n > 1 fan-out and the
  // Responses API all run a request through `port`; admission saw only the client's request.
  const port: GenerationPort<never> = {
    parse(kind, body, caller) {
      const parsed: ParsedRequest = kind === 'chat' ? parseChatRequest(body, { maxToolCalls: config.maxToolCalls, schemaLimits }) : parseCompletionRequest(body, { schemaLimits });
      parsed.salt = cacheSaltOf(caller.tenant, parsed.cacheSalt);
      checkModelName(parsed.model, names);
      if (parsed.kind === 'chat' && parsed.tools) parsed.toolSyntax = engine.toolSyntax;
      const key = conversationKey(parsed, caller.sessionId);
      if (key !== undefined) parsed.conversationKey = key;
      return parsed;
    },
    async generate({ parsed, rid }, sink) {
      const toolSyntax = responseToolSyntax(parsed);
      const body = toWorkerRequest(parsed, { rid, bootstrapHost: 'local', bootstrapPort: 1, bootstrapRoom: newRoomId(() => 0n) });
      const ac = new AbortController();
      const deadline = setTimeout(() => ac.abort(), config.requestTimeoutMs);
      const gone = () => ac.abort();
      if (sink.signal.aborted) ac.abort();
      else sink.signal.addEventListener('abort', gone, { once: true });
      const builder = new OpenAIResponseBuilder(parsed.kind, { id: rid, created: Math.floor(systemClock.wallMs() / 1000), model: names[0]! }, parsed.includeUsage, toolSyntax, outputChecksOf(parsed));
      const events = backend.generate(body, ac.signal);
      try {
        if (!parsed.stream) {
          for await (const ev of events) builder.push(ev);
          sink.json(builder.response(), {});
          return;
        }
        // First event before committing to a 200 stream, so early errors are plain HTTP errors.
        const first = await events.next();
        const sse = sink.stream({ 'x-request-id': rid });
        try {
          let r = first;
          while (!r.done) {
            for (const ch of builder.push(r.value)) await sse.write(ch);
            r = await events.next();
          }
          for (const ch of builder.tail()) await sse.write(ch);
          await sse.write(SSE_DONE);
        } catch (err) {
          // cut for reading too slowly: the connection is gone, the generation aborted with it
          if (err instanceof SseError && err.code === 'SSE_SLOW_CLIENT') log.warn({ rid, outcome: 'client_abort', err: err.message }, 'client cut: the stream was not read in time');
          const e = apiErrorOf(err);
          if (!sse.closed) await sse.write(e.toBody()).catch(() => {});
        } finally {
          sse.end();
        }
      } catch (err) {
        if (sink.answered) return;
        sink.fail(ac.signal.aborted ? ApiError.of('timeout', 'request deadline expired') : apiErrorOf(err));
      } finally {
        clearTimeout(deadline);
        sink.signal.removeEventListener('abort', gone);
        await events.return(undefined).catch(() => {});
      }
    },
    streams: { watch: sendWatch },
  };

  const handler = (kind: 'completion' | 'chat') => async (req: FastifyRequest, reply: FastifyReply) => {
    // n > 1 / batched prompts: one in-process generation per choice, merged (api/fanout.ts).
    const subs = planFanOut(kind, req.body);
    if (subs) return serveFanOut(req, reply, kind, subs, port);
    const caller = callerOf(req);
    const parsed = port.parse(kind, req.body, caller);
    const sink = new HttpSink(reply, port.streams);
    await port.generate({ parsed, rid: newResponseId(kind, randomBytes(12).toString('hex')), caller, inProcess: false }, sink);
    return sink.finish();
  };
  app.post('/v1/completions', handler('completion'));
  app.post('/v1/chat/completions', handler('chat'));
  registerKvEventsRoute(app, kvEvents, testHooks);
  registerResponsesRoutes(app, { store: new ResponseStore(), models: () => names, bodyLimit: app.initialConfig.bodyLimit ?? 8 << 20, port, registry: metrics.registry });
  const url = await listenUrl(app, config.host, config.port);
  log.info({ url, access: access?.describe() }, 'colocated server ready');
  if (access?.apiOpen) log.warn('the colocated server is OPEN: no API key is configured, anyone who reaches its port can use it (see SECURITY.md)');
  return {
    url,
    app,
    backend,
    async close() {
      kvTracker?.close();
      await app.close().catch(() => {});
      await store?.close();
      await engine.dispose();
    },
  };
}
