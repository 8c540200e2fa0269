/**
 * Router configuration: validated once with zod, defaults applied, then frozen.
 *
 * Shape (all times in ms, sizes in bytes):
 *   { host = '127.0.0.1', port = 8000 (0 = any free port),
 *     prefill: [{ url, bootstrapHost? (default: the url's hostname), bootstrapPort }] (≥ 1 unless discovery),
 *     decode: [{ url }] (≥ 1 unless discovery),
 *     discovery? = 'etcd://HOST:PORT[,…]' (workers also join and leave through etcd),
 *     healthIntervalMs = 2000, healthTimeoutMs = 1000 (probes never overlap),
 *     unhealthyAfter = 2 (consecutive failed probes before a worker is skipped; a refused
 *       connection counts at once),
 *     requestTimeoutMs = 600000 (end-to-end deadline of one request),
 *     abortTimeoutMs = 2000 (deadline of one POST /abort_request),
 *     writeTimeoutMs = 30000 (max wait for a slow client to drain one SSE write),
 *     httpTimeouts = { keepAliveMs = 72000, headersMs = 60000, requestMs = 0 } (the HTTP server's),
 *     bodyLimit = 4 MiB, maxEventBytes = 1 MiB (largest SSE event accepted from decode),
 *     firstTokenFromPrefill = true (prefill streams token 1 before the KV handoff; false: decode
 *       streams every token and prefill answers once with JSON),
 *     migrationLimit = 3 (re-dispatches of one request after retryable failures, before or
 *       after output: ./attempts.ts), workerWaitMs = 20000 (wait for a healthy worker of a role
 *       that has none, inside the deadline; 0 = 503 at once), unavailableWaitMs = 5000 (the wait
 *       when every worker of the role is draining), sseKeepAliveMs = 15000 (an SSE comment on a
 *       stream silent this long; 0 = none), legSilenceMs = 30000 (decode's stream silent this
 *       long mid-generation: the worker is frozen, the request migrates; 0 = no bound), maxToolCalls = 16 (tool calls
 *       per turn with parallel_tool_calls), schemaMaxNodes = 5000 and schemaMaxEnumValues =
 *       1000 (JSON-schema bounds, ../api/json-schema.ts SchemaLimits),
 *     policy (prefill) = 'cache_aware' | 'least_load' | 'round_robin' | 'power_of_two',
 *       decodePolicy = 'least_load' (same choices; cache_aware enables decode-local
 *       continuation up to localPrefillMaxTokens = 256 uncached tokens, 0 = off), with cache_aware's
 *       cacheThreshold = 0.3, balanceAbsThreshold = 64, balanceRelThreshold = 1.5,
 *       maxTreeChars = 4 Mi (SGLang router's defaults; see policy/index.ts),
 *     model? (the workers' GGUF: exact routing, ./tokens.ts), kvRouterMaxBlocks = 1 Mi (block
 *       references of the workers' KV events kept per worker, ./kv-events.ts), tokenizeCacheBytes =
 *       64 MiB (the router tokenizer's chunk cache, ../engine/token-chunks.ts; 0 = off),
 *     corsOrigin = [] (CORS origins; '*' = any; empty = no CORS headers),
 *     apiKeys = [], apiKeyFile?, adminApiKeys = [], privateMetrics = false (client access:
 *       ../api/access.ts), clusterSecret? (signs every request to a worker), tls? = { cert, key }
 *       (PEM files: HTTPS for clients), internalTls? = { cert?, key?, ca? } (PEM files: the CA
 *       that verifies https:// workers and the client certificate presented to them),
 *     responsesStore = { maxCount = 10000, maxBytes = 64 MiB, maxAgeMs = 1 h } (stored /v1/responses),
 *     log: a pino logger | { level } (default { level: 'info' }) }
 * Unknown keys are rejected (a typo in a config should not be silently ignored).
 */
import { DEFAULT_SEND_QUEUE_LIMITS } from '../runtime/send-queue.js';
import { z } from 'zod';
import { AdmissionSchema, type AdmissionOptions } from '../api/admission.js';
import { ClusterSecretSchema, InternalTlsSchema } from '../config/config.js';
import { HttpTimeoutsSchema, type HttpTimeouts } from '../runtime/http-timeouts.js';
import { PdError } from '../base/errors.js';
import type { Logger } from 'pino';
import { DEFAULT_CACHE_AWARE, POLICY_NAMES, type PolicyName } from './policy/index.js';
import { DEFAULT_ROUTER_MAX_BLOCKS } from '../protocol/kv-events.js';
import { DEFAULT_TOKENIZE_CACHE_BYTES } from '../engine/token-chunks.js';
import { DEFAULT_RESPONSE_STORE_LIMITS, type ResponseStoreLimits } from '../api/responses-store.js';
import { DEFAULT_MAX_TOOL_CALLS, DEFAULT_SCHEMA_MAX_ENUM_VALUES, DEFAULT_SCHEMA_MAX_NODES, MAX_TOOL_CALLS_LIMIT } from '../engine/types.js';

const LEVELS = ['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent'] as const;

/** http(s) URL without trailing slash, path or query. */
const WorkerUrl = z
  .string()
  .url()
  .refine((u) => /^https?:$/.test(new URL(u).protocol), { message: 'must be an http(s) URL' })
  .transform((u) => new URL(u).origin);

const PortSchema = z.number().int().min(1).max(65535);

const LoggerSchema = z.custom<Logger>(
  (v) => typeof v === 'object' && v !== null && ['info', 'warn', 'error', 'debug', 'child'].every((k) => typeof (v as Record<string, unknown>)[k] === 'function'),
  { message: 'expected a pino logger or { level }' },
);

/** Re-dispatches of one request after retryable failures (`--migration-limit`; ./plan.ts). */
export const DEFAULT_MIGRATION_LIMIT = 3;

export const RouterConfigSchema = z
  .object({
    host: z.string().min(1).default('127.0.0.1'),
    port: z.number().int().min(0).max(65535).default(8000),
    prefill: z
      .array(
        z
          .object({
            url: WorkerUrl,
            bootstrapHost: z.string().min(1).max(255).optional(),
            bootstrapPort: PortSchema,
          })
          .strict(),
      )
      .default([]),
    decode: z
      .array(z.object({ url: WorkerUrl }).strict())
      .default([]),
    /** `etcd://HOST:PORT[,…]`: workers also come from etcd membership (../membership/etcd.ts). */
    discovery: z.string().min(1).optional(),
    healthIntervalMs: z.number().int().min(20).default(2000),
    healthTimeoutMs: z.number().int().min(10).default(1000),
    unhealthyAfter: z.number().int().min(1).default(2),
    requestTimeoutMs: z.number().int().min(50).default(600_000),
    abortTimeoutMs: z.number().int().min(10).default(2000),
    writeTimeoutMs: z.number().int().min(10).default(30_000),
    /** What is queued for a streaming client must drain within this (ms), else it is cut (../runtime/send-queue.ts). */
    clientWriteDeadlineMs: z.number().int().min(100).default(DEFAULT_SEND_QUEUE_LIMITS.deadlineMs),
    /** Most bytes queued for one streaming client before it is cut. */
    clientMaxBufferedBytes: z.number().int().min(64 * 1024).default(DEFAULT_SEND_QUEUE_LIMITS.maxBufferedBytes),
    /** The HTTP server's keep-alive, headers and request timeouts (../runtime/http-timeouts.ts). */
    httpTimeouts: HttpTimeoutsSchema,
    bodyLimit: z.number().int().min(1024).default(4 * 1024 * 1024),
    maxEventBytes: z.number().int().min(1024).default(1024 * 1024),
    firstTokenFromPrefill: z.boolean().default(true),
    migrationLimit: z.number().int().min(0).max(16).default(DEFAULT_MIGRATION_LIMIT),
    maxToolCalls: z.number().int().min(1).max(MAX_TOOL_CALLS_LIMIT).default(DEFAULT_MAX_TOOL_CALLS),
    schemaMaxNodes: z.number().int().min(1).max(1_000_000).default(DEFAULT_SCHEMA_MAX_NODES),
    schemaMaxEnumValues: z.number().int().min(1).max(1_000_000).default(DEFAULT_SCHEMA_MAX_ENUM_VALUES),
    workerWaitMs: z.number().int().min(0).default(20_000),
    unavailableWaitMs: z.number().int().min(0).default(5000),
    sseKeepAliveMs: z.number().int().min(0).default(15_000),
    legSilenceMs: z.number().int().min(0).default(30_000),
    policy: z.enum(POLICY_NAMES).default('cache_aware'),
    decodePolicy: z.enum(POLICY_NAMES).default('least_load'),
    /**
     * Decode-local continuation (dispatch.ts, decode/local.ts): with decodePolicy cache_aware, a
     * request whose prefix the chosen decode worker holds (a tree hit) and whose unmatched text
     * is short is sent to that decode alone with `local_prefill: {max_tokens}`; decode checks in
     * tokens and answers `needs_prefill` when over, and the request then takes the PD path.
     * 0 = off.
     */
    localPrefillMaxTokens: z.number().int().min(0).max(1 << 20).default(256),
    cacheThreshold: z.number().min(0).max(1).default(DEFAULT_CACHE_AWARE.cacheThreshold),
    balanceAbsThreshold: z.number().int().min(0).default(DEFAULT_CACHE_AWARE.balanceAbsThreshold),
    balanceRelThreshold: z.number().min(1).default(DEFAULT_CACHE_AWARE.balanceRelThreshold),
    maxTreeChars: z.number().int().min(1).default(DEFAULT_CACHE_AWARE.maxTreeChars),
    /** The workers' GGUF: the router tokenizes prompts with its vocabulary (./tokens.ts) for exact routing. Absent: no exact routing. */
    model: z.string().min(1).optional(),
    /** Block references of the workers' KV events kept per worker (./kv-events.ts). */
    kvRouterMaxBlocks: z.number().int().min(1).max(1 << 26).default(DEFAULT_ROUTER_MAX_BLOCKS),
    tokenizeCacheBytes: z.number().int().min(0).max(2 ** 40).default(DEFAULT_TOKENIZE_CACHE_BYTES),
    /** CORS origins ('*' = any); empty = no CORS headers. */
    corsOrigin: z.array(z.string().min(1)).max(64).default([]),
    /** Client access (../api/access.ts): API keys, a key file re-read on change, admin keys, /metrics behind the admin rule. */
    apiKeys: z.array(z.string().min(1).max(4096)).max(1024).default([]),
    apiKeyFile: z.string().min(1).optional(),
    adminApiKeys: z.array(z.string().min(1).max(4096)).max(64).default([]),
    privateMetrics: z.boolean().default(false),
    responsesStore: z
      .object({ maxCount: z.number().int().min(0), maxBytes: z.number().int().min(0), maxAgeMs: z.number().int().min(0) })
      .strict()
      .default(DEFAULT_RESPONSE_STORE_LIMITS),
    /** The cluster secret: every request to a worker is signed with it (../security/request-auth.ts). Never logged. */
    clusterSecret: ClusterSecretSchema.optional(),
    /** HTTPS for clients: PEM certificate and key files (../security/tls.ts). */
    tls: z.object({ cert: z.string().min(1), key: z.string().min(1) }).strict().optional(),
    /** TLS to the workers (../security/tls.ts `InternalTlsFiles`): the CA of https:// workers, the client certificate they ask for. */
    internalTls: InternalTlsSchema,
    /** Admission at the edge (../api/admission.ts): concurrency cap, queue, per-key limits. */
    admission: AdmissionSchema,
    log: z.union([LoggerSchema, z.object({ level: z.enum(LEVELS).default('info') }).strict()]).default({ level: 'info' }),
  })
  .strict()
  .superRefine((c, ctx) => {
    if (!c.discovery) {
      if (c.prefill.length === 0) ctx.addIssue({ code: z.ZodIssueCode.custom, path: ['prefill'], message: 'at least one prefill worker is required (or discovery)' });
      if (c.decode.length === 0) ctx.addIssue({ code: z.ZodIssueCode.custom, path: ['decode'], message: 'at least one decode worker is required (or discovery)' });
    }
    const seen = new Set<string>();
    for (const [i, w] of [...c.prefill.map((w) => w.url), ...c.decode.map((w) => w.url)].entries()) {
      if (seen.has(w)) ctx.addIssue({ code: z.ZodIssueCode.custom, path: [i < c.prefill.length ? 'prefill' : 'decode'], message: `duplicate worker url ${w}` });
      seen.add(w);
    }
  });

export type RouterConfigInput = z.input<typeof RouterConfigSchema>;

export interface PrefillWorkerConfig {
  readonly url: string;
  readonly bootstrapHost: string;
  readonly bootstrapPort: number;
}

export interface RouterConfig {
  readonly host: string;
  readonly port: number;
  readonly prefill: readonly PrefillWorkerConfig[];
  readonly decode: readonly { readonly url: string }[];
  /** etcd membership source, when set. */
  readonly discovery?: string;
  readonly healthIntervalMs: number;
  readonly healthTimeoutMs: number;
  readonly unhealthyAfter: number;
  readonly requestTimeoutMs: number;
  readonly abortTimeoutMs: number;
  readonly writeTimeoutMs: number;
  /** What is queued for a streaming client must drain within this, ms (`--client-write-deadline-ms`). */
  readonly clientWriteDeadlineMs: number;
  /** Most bytes queued for one streaming client (`--client-max-buffered-bytes`). */
  readonly clientMaxBufferedBytes: number;
  /** The HTTP server's keep-alive, headers and request timeouts, ms (../runtime/http-timeouts.ts). */
  readonly httpTimeouts: Readonly<HttpTimeouts>;
  readonly bodyLimit: number;
  readonly maxEventBytes: number;
  /** Stream the first token from prefill before the KV handoff (default true). */
  readonly firstTokenFromPrefill: boolean;
  /** Most times one request is dispatched again after a retryable failure, before or after output (./attempts.ts). */
  readonly migrationLimit: number;
  /** Most tool calls in one turn with parallel_tool_calls (`--max-tool-calls`): the grammar ends the turn after the last. */
  readonly maxToolCalls: number;
  /** Most JSON-schema nodes after `$ref` expansion per request (`--schema-max-nodes`); past it a 400 schema_too_complex. */
  readonly schemaMaxNodes: number;
  /** Most enum/const values in a request's JSON schemas (`--schema-max-enum-values`); past it a 400 schema_too_complex. */
  readonly schemaMaxEnumValues: number;
  /** Longest wait (ms, inside the request's deadline) for a healthy worker of a role that has none; 0 = answer 503 at once. */
  readonly workerWaitMs: number;
  /** Longest wait (ms) for a worker of a role whose every worker is draining (./attempts.ts `waitUntil`), then 503 with retry-after. */
  readonly unavailableWaitMs: number;
  /** A streamed request silent this long (no token yet, or none since the last) gets an SSE comment `: keep-alive` (ms); 0 = never. */
  readonly sseKeepAliveMs: number;
  /** Longest silence of decode's stream once it streams (no event, ms) before the worker counts as frozen and the request migrates (./dispatch.ts); 0 = no bound. */
  readonly legSilenceMs: number;
  /** Load-balancing policy of prefill workers (policy/index.ts; they hold the prefix cache); cache_aware by default. */
  readonly policy: PolicyName;
  /**
   * Policy of decode workers; least_load by default (as SGLang's PD router, which has separate
   * prefill and decode policies). cache_aware keeps a prefix tree per decode worker (the
   * conversations whose KV it kept) and turns decode-local continuation on.
   */
  readonly decodePolicy: PolicyName;
  /** Decode-local continuation: longest uncached suffix (tokens) a decode worker is asked to evaluate itself; 0 = off. */
  readonly localPrefillMaxTokens: number;
  /** cache_aware: matched fraction above which the longest-match worker is taken. */
  readonly cacheThreshold: number;
  /** cache_aware: imbalance iff max−min load > this AND max > min × balanceRelThreshold. */
  readonly balanceAbsThreshold: number;
  readonly balanceRelThreshold: number;
  /** cache_aware: routing-text characters remembered per worker. */
  readonly maxTreeChars: number;
  /** The workers' GGUF (exact routing: the router tokenizes with its vocabulary); absent: none. */
  readonly model?: string;
  /** Block references of the workers' KV events kept per worker. */
  readonly kvRouterMaxBlocks: number;
  /** Bound of the router tokenizer's chunk cache, bytes (0: prompts tokenized whole). */
  readonly tokenizeCacheBytes: number;
  /** CORS origins ('*' = any); empty = no CORS headers. */
  readonly corsOrigin: readonly string[];
  /** Client access (../api/access.ts). Never logged. */
  readonly apiKeys: readonly string[];
  readonly apiKeyFile?: string;
  readonly adminApiKeys: readonly string[];
  readonly privateMetrics: boolean;
  /** Bounds of the stored /v1/responses (../api/responses-store.ts). */
  readonly responsesStore: Readonly<ResponseStoreLimits>;
  /** The cluster secret (worker request signatures); undefined = requests go unsigned. Never logged. */
  readonly clusterSecret?: string;
  /** HTTPS for clients: PEM certificate and key files. */
  readonly tls?: { readonly cert: string; readonly key: string };
  /** TLS to the workers: PEM files of the CA and of the client certificate and key. */
  readonly internalTls?: { readonly cert?: string; readonly key?: string; readonly ca?: string };
  /** Admission at the edge (../api/admission.ts). */
  readonly admission: Readonly<AdmissionOptions>;
  /** A ready logger, or the level of one the router creates. */
  readonly log: Logger | { readonly level: (typeof LEVELS)[number] };
}

/** Typed config error with a stable code. */
export class RouterConfigError extends PdError {
  constructor(message: string) {
    super('INVALID_ROUTER_CONFIG', message);
    this.name = 'RouterConfigError';
  }
}

/** Strip IPv6 brackets: URL.hostname of http://[::1]:80 is '[::1]'. */
const bareHost = (h: string) => (h.startsWith('[') && h.endsWith(']') ? h.slice(1, -1) : h);

/**
 * Validate, default and freeze a router config.
 * @throws RouterConfigError listing every problem as `path: message`.
 */
export function parseRouterConfig(raw: unknown): RouterConfig {
  const r = RouterConfigSchema.safeParse(raw);
  if (!r.success) {
    throw new RouterConfigError(`invalid router config: ${r.error.issues.map((i) => `${i.path.join('.') || '(root)'}: ${i.message}`).join('; ')}`);
  }
  const c = r.data;
  const cfg: RouterConfig = {
    ...c,
    prefill: Object.freeze(c.prefill.map((p) => Object.freeze({ url: p.url, bootstrapHost: p.bootstrapHost ?? bareHost(new URL(p.url).hostname), bootstrapPort: p.bootstrapPort }))),
    decode: Object.freeze(c.decode.map((d) => Object.freeze({ url: d.url }))),
    // A logger instance is not ours to freeze.
    log: 'child' in c.log ? c.log : Object.freeze({ ...c.log }),
  };
  return Object.freeze(cfg);
}
