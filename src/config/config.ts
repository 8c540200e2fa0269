/**
 * Worker configuration, validated once with zod at start-up (all problems reported together)
 * and frozen, in the style of fastify's initial-config-validation.
 */
import { DEFAULT_KV_BLOCK_TOKENS, MAX_KV_BLOCK_TOKENS, MIN_KV_BLOCK_TOKENS } from '../protocol/token-blocks.js';
import { z } from 'zod';
import { PdError } from '../base/errors.js';
import { DEFAULT_TIMEOUTS } from '../kv/types.js';
import { DEFAULT_MAX_TOOL_CALLS, DEFAULT_SCHEMA_MAX_ENUM_VALUES, DEFAULT_SCHEMA_MAX_NODES, DEFAULT_SESSION_TTL_MS, GRAMMAR_BUDGET_MS, MAX_RETENTION_MS, MAX_TOOL_CALLS_LIMIT } from '../engine/types.js';
import { GPU_BACKENDS, KV_CACHE_TYPES } from '../engine/gpu.js';
import { CLUSTER_SECRET_MIN_CHARS, SHORT_SECRET_MESSAGE } from '../security/cluster-secret.js';
import { HttpTimeoutsSchema } from '../runtime/http-timeouts.js';
import { DEFAULT_SEND_QUEUE_LIMITS } from '../runtime/send-queue.js';

const port = z.number().int().min(0).max(65535);

/** `--internal-tls-cert/-key/-ca` file paths (tls.ts `InternalTlsFiles`). */
export const InternalTlsSchema = z.object({ cert: z.string().min(1).optional(), key: z.string().min(1).optional(), ca: z.string().min(1).optional() }).strict().optional();

export const EngineConfigSchema = z.object({
  /** Path of the GGUF model. */
  modelPath: z.string().min(1),
  /** llama.cpp threads for this process (1 per worker on a 2-core machine). */
  threads: z.number().int().min(1).max(256).default(1),
  /** Tokens per sequence. */
  contextSize: z.number().int().min(16).max(1 << 20).default(2048),
  /** Prompt chunk size in tokens; abort is checked between chunks. */
  batchSize: z.number().int().min(1).max(1 << 16).default(512),
  /** Batch-invariant inference: one sequence per llama.cpp decode call (see LoadEngineOptions.deterministic). */
  deterministic: z.boolean().default(false),
  /** llama.cpp flash attention; prefill and decode must agree (checked in the KV handshake). */
  flashAttention: z.boolean().default(true),
  /** Prefix cache: extra context sequences that only hold cached prefixes (prefill, colocated). */
  prefixCacheSlots: z.number().int().min(0).max(256).default(4),
  /** Prefix cache: most tokens idle sequences hold together (LRU beyond); 0 = the cache is off. */
  prefixCacheTokens: z.number().int().min(0).max(1 << 26).default(65536),
  /** `--session-ttl-ms`: retention window of a session's cached state, ms (engine/prefix-cache.ts); 0 = plain LRU. */
  sessionTtlMs: z.number().int().min(0).max(MAX_RETENTION_MS).default(DEFAULT_SESSION_TTL_MS),
  /**
   * Host-wide prefix store (prefixes/prefix-store.ts), the prefix cache's second tier: byte budget
   * of its files (LRU beyond); 0 = off; absent = defaultPrefixStoreBytes of its folder. Only
   * with the prefix cache on.
   */
  prefixStoreBytes: z.number().int().min(0).max(Number.MAX_SAFE_INTEGER).optional(),
  /** Folder of the prefix store (default: the worker's state directory; colocated: /dev/shm). */
  prefixStoreDir: z.string().min(1).optional(),
  /** Tokens per block of the KV events' chained block hashes (../protocol/token-blocks.ts). */
  kvBlockTokens: z.number().int().min(MIN_KV_BLOCK_TOKENS).max(MAX_KV_BLOCK_TOKENS).default(DEFAULT_KV_BLOCK_TOKENS),
  /**
   * Names the OpenAI API answers to (vLLM's --served-model-name): a request naming another model
   * is a 404 model_not_found. The first is the `model` of responses. Empty = the GGUF's file name
   * without `.gguf` and 'pdserve' (what the README's examples send).
   */
  servedModelName: z.array(z.string().min(1).max(512)).max(16).default([]),
  /** `--gpu`: GPU backend; 'auto' falls back to the CPU when no device is found (engine/gpu.ts). */
  gpu: z.enum(GPU_BACKENDS).default('auto'),
  /** `--gpu-layers`: layers offloaded when a device is found ('auto' = as many as fit, 'max' = all). */
  gpuLayers: z.union([z.enum(['auto', 'max']), z.number().int().min(0).max(1 << 16)]).default('auto'),
  /** `--gpu-device`: device indices this process may use (absent = what the environment allows). */
  gpuDevices: z
    .array(z.number().int().min(0).max(255))
    .min(1)
    .max(64)
    .refine((d) => new Set(d).size === d.length, 'a device appears twice')
    .optional(),
  /** `--kv-cache-type`: K and V cache type; prefill and decode must agree (checked in the KV handshake). */
  kvCacheType: z.enum(KV_CACHE_TYPES).default('f16'),
  /** `--grammar-budget-ms`: longest generation of one JSON schema's grammar, ms; past it a 400 schema_too_complex (engine/grammar-thread.ts). */
  grammarBudgetMs: z.number().int().min(50).max(600_000).default(GRAMMAR_BUDGET_MS),
}).refine((e) => e.kvCacheType === 'f16' || e.flashAttention, { message: 'a quantized --kv-cache-type needs flash attention (drop --no-flash-attention)', path: ['kvCacheType'] });

/** The name a request may use when --served-model-name is not given, besides the file name. */
export const DEFAULT_SERVED_NAME = 'pdserve';

/** Served model names (first = the responses' `model`): the configured ones, else [file name, 'pdserve']. */
export function servedModelNamesOf(e: { servedModelName?: readonly string[] }, modelName: string): string[] {
  return e.servedModelName && e.servedModelName.length > 0 ? [...new Set(e.servedModelName)] : [...new Set([modelName, DEFAULT_SERVED_NAME])];
}

/**
 * Tokens per block of the KV events a worker publishes: `kvBlockTokens`, rounded up to a multiple
 * of the batch in deterministic mode (the engine reuses whole batches only there: a block boundary
 * that is no batch boundary would claim tokens the engine cannot reuse).
 */
export function kvEventBlockTokens(e: Pick<z.infer<typeof EngineConfigSchema>, 'kvBlockTokens' | 'deterministic' | 'batchSize'>): number {
  if (!e.deterministic) return e.kvBlockTokens;
  return Math.ceil(e.kvBlockTokens / e.batchSize) * e.batchSize;
}

/** LoadEngineOptions.prefixCache for an engine config (undefined = off). */
export function prefixCacheOf(e: z.infer<typeof EngineConfigSchema>): { cacheSequences: number; maxTokens: number; sessionTtlMs: number } | undefined {
  return e.prefixCacheTokens > 0 ? { cacheSequences: e.prefixCacheSlots, maxTokens: e.prefixCacheTokens, sessionTtlMs: e.sessionTtlMs } : undefined;
}

/** Default `--max-state-bytes`: 512 MiB (a 4k-token state of an 8B GQA model in f16 fits; a 1 GiB one needs the flag). */
export const DEFAULT_MAX_STATE_BYTES = 512 * 1024 * 1024;
/** Smallest `--max-state-bytes`: 1 MiB (the tiny model's states are ~0.1-1 MiB). */
export const MIN_STATE_BYTES_LIMIT = 1024 * 1024;
/** Largest `--max-state-bytes`: 16 GiB (a state passes through tmpfs, twice on one host). */
export const MAX_STATE_BYTES_LIMIT = 16 * 1024 * 1024 * 1024;

/**
 * `--max-state-bytes`'s value: a byte count, or a number with a binary suffix (K, M, G: KiB,
 * MiB, GiB; case-insensitive, an optional trailing `iB`/`B`), e.g. `1536M`, `1G`, `1073741824`.
 * @throws RangeError when it is not such a size or lies outside
 *   [MIN_STATE_BYTES_LIMIT, MAX_STATE_BYTES_LIMIT].
 */
export function parseStateBytes(v: string): number {
  const m = /^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*$/i.exec(v);
  if (!m) throw new RangeError(`not a byte size (e.g. 1073741824, 1536M, 1G): ${v}`);
  const n = Math.round(Number(m[1]) * { '': 1, k: 1024, m: 1024 ** 2, g: 1024 ** 3 }[m[2]!.toLowerCase() as '' | 'k' | 'm' | 'g']);
  if (n < MIN_STATE_BYTES_LIMIT || n > MAX_STATE_BYTES_LIMIT) throw new RangeError(`must be between 1M and 16G: ${v}`);
  return n;
}

export const TimeoutsSchema = z.object({
  preallocMs: z.number().int().positive().default(DEFAULT_TIMEOUTS.preallocMs),
  bootstrapMs: z.number().int().positive().default(DEFAULT_TIMEOUTS.bootstrapMs),
  waitingMs: z.number().int().positive().default(DEFAULT_TIMEOUTS.waitingMs),
  transferIdleMs: z.number().int().positive().default(DEFAULT_TIMEOUTS.transferIdleMs),
});

/** The cluster secret's rule, one place for the workers' config and `up`'s own check. */
export const ClusterSecretSchema = z.string().min(CLUSTER_SECRET_MIN_CHARS, SHORT_SECRET_MESSAGE);

const common = {
  host: z.string().default('127.0.0.1'),
  port: port.default(0),
  /** Shared secret of the cluster: the KV channels' HMAC challenge and the HTTP request signatures (request-auth.ts). */
  secret: ClusterSecretSchema,
  /** /metrics needs a signed request too (default: open, for Prometheus). */
  privateMetrics: z.boolean().default(false),
  /**
   * Internal TLS (tls.ts `InternalTlsFiles`): the HTTP server and the KV channel over TLS with
   * this certificate and key; with `ca`, mutual (peers must present a certificate it signed).
   */
  internalTls: InternalTlsSchema,
  engine: EngineConfigSchema,
  timeouts: TimeoutsSchema.default({}),
  /** The HTTP server's keep-alive, headers and request timeouts (http-timeouts.ts). */
  httpTimeouts: HttpTimeoutsSchema,
  /** Heartbeat interval of the KV control channel, ms; a peer is lost after 2 silent intervals. */
  heartbeatMs: z.number().int().min(50).max(60_000).default(1000),
  /** Watchdog period (deadline checks), ms. */
  watchdogMs: z.number().int().min(5).max(10_000).default(100),
  /** Folder for sequence-state files (tmpfs). */
  stateDir: z.string().default('/dev/shm'),
  /**
   * `--max-state-bytes`: largest KV state accepted (decode: announced and received bytes, the
   * same-host file, the prefix store's entries; prefill: the prefix store's entries), bytes.
   * Bounded by MAX_STATE_BYTES_LIMIT (the state directory is tmpfs: RAM).
   */
  maxStateBytes: z.number().int().min(MIN_STATE_BYTES_LIMIT).max(MAX_STATE_BYTES_LIMIT).default(DEFAULT_MAX_STATE_BYTES),
  /**
   * Same-host handoff (kv/transfer/same-host.ts): when the peer proves it shares this host and
   * state directory, the saved state file is handed over instead of sent over TCP. False =
   * `--no-kv-same-host` (every handoff over TCP).
   */
  kvSameHost: z.boolean().default(true),
  /**
   * `--kv-same-host-verify`: the same-host handoff also checks the KV data bytes (CRC-32: one
   * full read of the file on each side, on the handoff's critical path). Off: size, envelope head
   * and the ggsq structure (headers only) are checked, the data bytes are not
   * (kv/transfer/same-host.ts says why). Either side turning it on turns it on for the pair.
   */
  kvSameHostVerify: z.boolean().default(false),
  /**
   * `--kv-streams`: sockets one KV connection's chunks are striped over (kv/stripes.ts); a pair
   * uses the smaller of both sides' values. 1 by default: both ends' sockets are served by one
   * event loop each, so more sockets add waits and out-of-order copies, not bandwidth
   * (BENCHMARKS.md §1).
   */
  kvStreams: z.number().int().min(1).max(8).default(1),
};

export const PrefillConfigSchema = z.object({
  ...common,
  /** Address decode workers use to reach the bootstrap listener. */
  bootstrapHost: z.string().default('127.0.0.1'),
  bootstrapPort: port.default(8998),
  /** Sequences of the prefill context (prompts evaluated at once). */
  slots: z.number().int().min(1).max(64).default(1),
  /** Bound on rooms waiting for prompt evaluation. */
  maxWaiting: z.number().int().min(1).default(256),
  /** Bound on live rooms (bootstrap + waiting + inflight). */
  maxRooms: z.number().int().min(1).default(1024),
  /** KV chunk size on the wire, bytes. */
  chunkBytes: z.number().int().min(1024).max(1024 * 1024).default(1024 * 1024),
  /**
   * Over TCP, send the state while llama.cpp is still saving it (one-room requests, to a decode
   * that said `kvStream`; transfer/sender.ts sendGrowingStateFile); `--no-kv-stream`: save, then
   * send. On by default: the send overlaps llama.cpp's save, which writes the state front to back
   * (BENCHMARKS.md §1); SGLang and vLLM overlap the transfer with the computation likewise.
   */
  kvStream: z.boolean().default(true),
  /**
   * `--first-token-after-save`: with the first token streamed from prefill, it waits for the
   * state save when the save is expected to take at most this share of the prompt's evaluation,
   * percent (prefill/computation.ts `firstTokenAfterSave`); 0 = token 1 leaves before the save,
   * 'always' = it always waits.
   */
  firstTokenAfterSave: z.union([z.number().min(0).max(100), z.literal('always')]).default(5),
});
export type PrefillConfig = Readonly<z.infer<typeof PrefillConfigSchema>>;

export const DecodeConfigSchema = z.object({
  ...common,
  /** Sequences of the decode context (requests decoded as one batch). */
  slots: z.number().int().min(1).max(256).default(8),
  /** Bound on the prealloc queue (requests waiting for a slot). */
  maxPrealloc: z.number().int().min(1).default(256),
  /** Connect timeout to a prefill bootstrap port, ms. */
  connectTimeoutMs: z.number().int().positive().default(2000),
  /**
   * Decode-local continuation (src/decode/local.ts): the longest uncached prompt suffix, tokens,
   * decode evaluates itself for a request the router marked `local_prefill`. > 0 also makes
   * decode keep finished sequences' KV in the engine's prefix cache (`prefixCacheSlots` spare
   * sequences, `prefixCacheTokens` budget, LRU). 0 = off: nothing kept, every local request
   * answered `needs_prefill`.
   */
  localPrefillMaxTokens: z.number().int().min(0).max(1 << 20).default(256),
  /** `--allow-prefill HOST:PORT`: bootstrap addresses decode may dial besides the router's pool (src/decode/known-prefills.ts). */
  allowPrefill: z.array(z.string().min(3).max(300)).max(1024).default([]),
});
export type DecodeConfig = Readonly<z.infer<typeof DecodeConfigSchema>>;

/** Admission at the edge (src/api/admission.ts): unset fields take its defaults. */
export const AdmissionSchema = z
  .object({ maxConcurrent: z.number().int().min(0).optional(), maxQueued: z.number().int().min(0).optional(), queueTimeoutMs: z.number().int().min(1).optional(), keyRps: z.number().min(0).optional(), keyBurst: z.number().min(0).optional(), keyMaxConcurrent: z.number().int().min(0).optional() })
  .strict()
  .default({});

export const ColocatedConfigSchema = z.object({
  host: z.string().default('127.0.0.1'),
  port: port.default(0),
  engine: EngineConfigSchema,
  slots: z.number().int().min(1).max(256).default(8),
  maxWaiting: z.number().int().min(1).default(256),
  requestTimeoutMs: z.number().int().positive().default(300_000),
  /** The HTTP server's keep-alive, headers and request timeouts (http-timeouts.ts). */
  httpTimeouts: HttpTimeoutsSchema,
  /** Most tool calls in one turn with parallel_tool_calls (`--max-tool-calls`). */
  maxToolCalls: z.number().int().min(1).max(MAX_TOOL_CALLS_LIMIT).default(DEFAULT_MAX_TOOL_CALLS),
  /** Most JSON-schema nodes after `$ref` expansion per request (`--schema-max-nodes`). */
  schemaMaxNodes: z.number().int().min(1).max(1_000_000).default(DEFAULT_SCHEMA_MAX_NODES),
  /** Most enum/const values in a request's JSON schemas (`--schema-max-enum-values`). */
  schemaMaxEnumValues: z.number().int().min(1).max(1_000_000).default(DEFAULT_SCHEMA_MAX_ENUM_VALUES),
  /** CORS origins ('*' = any); empty = no CORS. */
  corsOrigin: z.array(z.string().min(1)).max(64).default([]),
  /** Client access (src/api/access.ts): API keys, a key file re-read on change, admin keys, /metrics behind the admin rule. */
  apiKeys: z.array(z.string().min(1).max(4096)).max(1024).default([]),
  apiKeyFile: z.string().min(1).optional(),
  adminApiKeys: z.array(z.string().min(1).max(4096)).max(64).default([]),
  privateMetrics: z.boolean().default(false),
  /** HTTPS for clients: PEM certificate and key files (tls.ts). */
  tls: z.object({ cert: z.string().min(1), key: z.string().min(1) }).strict().optional(),
  /** Admission at the edge (src/api/admission.ts). */
  admission: AdmissionSchema,
  /** What was written to a client must be delivered within this, ms (`--client-write-deadline-ms`; ./send-queue.ts). */
  clientWriteDeadlineMs: z.number().int().min(100).default(DEFAULT_SEND_QUEUE_LIMITS.deadlineMs),
  /** Most bytes queued for one client (`--client-max-buffered-bytes`; ./send-queue.ts). */
  clientMaxBufferedBytes: z.number().int().min(64 * 1024).max(1024 ** 3).default(DEFAULT_SEND_QUEUE_LIMITS.maxBufferedBytes),
});
export type ColocatedConfig = Readonly<z.infer<typeof ColocatedConfigSchema>>;

/**
 * Parse and freeze.
 * @throws PdError('invalid_config') listing every problem, one line each (printed without a stack)
 */
export function parseConfig<S extends z.ZodTypeAny>(schema: S, raw: unknown): Readonly<z.infer<S>> {
  const r = schema.safeParse(raw);
  if (!r.success) {
    const lines = r.error.issues.map((i) => `  ${i.path.join('.') || '(root)'}: ${i.message}`);
    throw new PdError('invalid_config', `invalid configuration:\n${lines.join('\n')}`);
  }
  return deepFreeze(r.data);
}

function deepFreeze<T>(o: T): T {
  if (o && typeof o === 'object') {
    for (const v of Object.values(o)) deepFreeze(v);
    Object.freeze(o);
  }
  return o;
}
