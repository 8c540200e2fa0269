/**
 * The `pdserve` command line (commander). Each role runs on its own (`prefill`, `decode`,
 * `router`, `colocated`) so workers can live on other hosts; `up` starts a whole local cluster.
 */
import { DEFAULT_SEND_QUEUE_LIMITS, parseBufferedBytes } from '../runtime/send-queue.js';
import { testHooksFromEnv } from '../runtime/testhooks.js';
import { Command, InvalidArgumentError, Option } from 'commander';
import { randomBytes } from 'node:crypto';
import { readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { DEFAULT_KV_BLOCK_TOKENS, MAX_KV_BLOCK_TOKENS, MIN_KV_BLOCK_TOKENS } from '../protocol/token-blocks.js';
import { DEFAULT_ROUTER_MAX_BLOCKS } from '../protocol/kv-events.js';
import { DEFAULT_TOKENIZE_CACHE_BYTES } from '../engine/token-chunks.js';
import { DEFAULT_MAX_STATE_BYTES, parseStateBytes } from '../config/config.js';
import { createLogger } from '../base/log.js';
import { serveRole, startupProblem, type Served } from './serve.js';
import { upEngineArgs, type UpEngineFlags } from './up-args.js';
import { doctorLine, givenSecretFile, tryLines, writeSecretFile } from '../up/banner.js';
import { accessFlags, accessOf, clusterSecretOf, internalTlsFlags, internalTlsOf, listEnv, secretFlags } from './secrets.js';
import { POLICY_NAMES } from '../router/policy/index.js';
import { GPU_BACKENDS, KV_CACHE_TYPES, parseDeviceList, parseGpuLayers } from '../engine/gpu.js';
import { DEFAULT_MAX_TOOL_CALLS, DEFAULT_SCHEMA_MAX_ENUM_VALUES, DEFAULT_SCHEMA_MAX_NODES, DEFAULT_SESSION_TTL_MS, GRAMMAR_BUDGET_MS, MAX_TOOL_CALLS_LIMIT } from '../engine/types.js';
import { ConfigError } from '../base/errors.js';
import { GENERATE_DEFAULTS } from '../bench/agent-trace.js';

function int(v: string): number {
  const n = Number(v);
  if (!Number.isInteger(n)) throw new InvalidArgumentError(`not an integer: ${v}`);
  return n;
}

function port(v: string): number {
  const n = int(v);
  if (n < 0 || n > 65535) throw new InvalidArgumentError(`not a port (0-65535): ${v}`);
  return n;
}

const FIRST_TOKEN_AFTER_SAVE_HELP = "with the first token streamed from prefill: token 1 waits for the state save when the save is expected to take at most this percent of the prompt's evaluation (0: token 1 leaves before the save; 'always')";

function percentOrAlways(v: string): number | 'always' {
  if (v === 'always') return v;
  const n = Number(v);
  if (v.trim() === '' || !Number.isFinite(n) || n < 0 || n > 100) throw new InvalidArgumentError(`not a percentage (0-100) or 'always': ${v}`);
  return n;
}

function positive(v: string): number {
  const n = int(v);
  if (n < 1) throw new InvalidArgumentError(`must be at least 1: ${v}`);
  return n;
}

/** Resolve when host:port can be bound; reject with a clear message when it cannot. */
async function assertPortFree(host: string, p: number, flag = '--port'): Promise<void> {
  const { createServer } = await import('node:net');
  await new Promise<void>((resolve, reject) => {
    const s = createServer();
    s.once('error', (err: NodeJS.ErrnoException) => reject(new ConfigError(`cannot listen on ${host}:${p}: ${err.code === 'EADDRINUSE' ? `the port is in use (pick another with ${flag})` : err.message}`)));
    s.listen(p, host, () => s.close(() => resolve()));
  });
}

function collect(v: string, prev: string[] = []): string[] {
  return [...prev, v];
}

/** `500ms`, `20s`, `10m`, `1h`, or a bare number of seconds → ms. */
function parseDurationMs(v: string): number {
  const m = /^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$/.exec(v);
  if (!m) throw new ConfigError(`not a duration: ${v} (e.g. 500ms, 20s, 10m)`);
  const unit = m[2] ?? 's';
  return Math.round(Number(m[1]) * (unit === 'ms' ? 1 : unit === 's' ? 1000 : unit === 'm' ? 60_000 : 3_600_000));
}

const engineOptions = (c: Command) =>
  c
    .option('--model <file>', 'GGUF model file (default: the built-in tiny model, generated once into the cache)')
    .option('--threads <n>', 'llama.cpp threads of this process', int, 1)
    .option('--ctx-size <tokens>', 'context size per sequence, tokens', int, 2048)
    .option('--batch-size <tokens>', 'prompt evaluation chunk, tokens', int, 512)
    .option('--deterministic', 'batch-invariant inference: one sequence per llama.cpp decode call, so greedy output never depends on concurrent requests (slower; as SGLang --enable-deterministic-inference)', false)
    .option('--no-flash-attention', 'turn llama.cpp flash attention off (prefill and decode must agree)')
    .option('--prefix-cache-slots <n>', 'extra sequences that keep finished requests\' KV for prefix reuse (decode: for decode-local continuation)', int, 4)
    .option('--prefix-cache-tokens <tokens>', 'most tokens the prefix cache holds (LRU beyond)', int, 65536)
    .option('--session-ttl-ms <ms>', "retention window of a session's cached state after its turn ends (a request naming a session: prompt_cache_key, user or x-session-id; agent_hints.retention_seconds overrides it): inside it only superseded and out-of-window states are evicted before it; soft, never fails an allocation (0 = plain LRU)", int, DEFAULT_SESSION_TTL_MS)
    .option('--no-prefix-cache', 'never reuse a cached prefix (every prompt evaluated in full; decode: no decode-local continuation)')
    .option('--prefix-store-bytes <bytes>', "byte budget of the host-wide prefix store, shared by the host's workers (LRU beyond; 0 = off; default: 1/4 of the state directory's filesystem, at most 1/8 of RAM)", int)
    .option('--prefix-store-dir <dir>', "folder of the prefix store (default: the state directory; colocated: /dev/shm)")
    .option('--kv-block-tokens <tokens>', `tokens per block of the KV events this worker publishes (chained block hashes the router matches prompts against; ${MIN_KV_BLOCK_TOKENS}-${MAX_KV_BLOCK_TOKENS}; with --deterministic rounded up to whole --batch-size chunks)`, int, DEFAULT_KV_BLOCK_TOKENS)
    .option('--served-model-name <names...>', "model names the API answers to (as vLLM); a request naming another model gets 404 model_not_found; the first is the responses' model (default: the GGUF's file name without .gguf, and 'pdserve')")
    .addOption(new Option('--gpu <backend>', 'GPU backend (auto: CUDA, then Vulkan / Metal, else the CPU)').choices([...GPU_BACKENDS]).default('auto'))
    .option('--gpu-layers <n>', "layers offloaded to the GPU: auto (as many as fit), max, or a number (llama.cpp's -ngl)", cliParser(parseGpuLayers), 'auto')
    .option('--gpu-device <list>', 'GPU device indices this process may use, e.g. 0 or 0,1 (sets GGML_VK_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES; a software Vulkan device such as lavapipe is used only when named here)', cliParser(parseDeviceList))
    .addOption(new Option('--kv-cache-type <type>', 'K and V cache type (llama.cpp -ctk/-ctv; quantized needs flash attention and a head size that is a multiple of 32; prefill and decode must agree)').choices([...KV_CACHE_TYPES]).default('f16'))
    .option('--grammar-budget-ms <ms>', "longest generation of one JSON schema's grammar (response_format json_schema, strict tools), off the event loop; past it the request is a 400 schema_too_complex (50-600000)", int, GRAMMAR_BUDGET_MS);

/** A commander argument parser from one that throws RangeError. */
function cliParser<T>(parse: (v: string) => T): (v: string) => T {
  return (v) => {
    try {
      return parse(v);
    } catch (err) {
      throw new InvalidArgumentError((err as Error).message);
    }
  };
}

/** The GPU part of an engine config from the engine options (engine/gpu.ts). */
function gpuConfig(o: { gpu: string; gpuLayers: string | number; gpuDevice?: number[]; kvCacheType: string }) {
  return { gpu: o.gpu, gpuLayers: o.gpuLayers, kvCacheType: o.kvCacheType, ...(o.gpuDevice ? { gpuDevices: o.gpuDevice } : {}) };
}

/** The prefix-cache part of an engine config from the engine options. */
function prefixCacheConfig(o: { prefixCache?: boolean; prefixCacheSlots: number; prefixCacheTokens: number; sessionTtlMs: number; prefixStoreBytes?: number; prefixStoreDir?: string; kvBlockTokens?: number }) {
  return {
    ...(o.kvBlockTokens !== undefined ? { kvBlockTokens: o.kvBlockTokens } : {}),
    prefixCacheSlots: o.prefixCacheSlots,
    sessionTtlMs: o.sessionTtlMs,
    prefixCacheTokens: o.prefixCache === false ? 0 : o.prefixCacheTokens,
    ...(o.prefixStoreBytes !== undefined ? { prefixStoreBytes: o.prefixStoreBytes } : {}),
    ...(o.prefixStoreDir !== undefined ? { prefixStoreDir: o.prefixStoreDir } : {}),
  };
}

const kvOptions = (c: Command) =>
  internalTlsFlags(secretFlags(c))
    .option('--private-metrics', '/metrics needs a signed request too (default: open, for Prometheus)', false)
    .option('--heartbeat-ms <ms>', 'KV channel heartbeat interval; a peer is lost after 2 silent intervals', int, 1000)
    .option('--prealloc-timeout-ms <ms>', 'decode: max wait for a free sequence slot', int, 30_000)
    .option('--bootstrap-timeout-ms <ms>', 'max wait for the peer to register the room', int, 10_000)
    .option('--waiting-timeout-ms <ms>', 'prefill: max queue + prompt evaluation time; decode: max wait for the KV to start', int, 60_000)
    .option('--transfer-timeout-ms <ms>', 'max time without KV transfer progress', int, 10_000)
    .option('--state-dir <dir>', 'folder for sequence-state files (tmpfs)', '/dev/shm')
    .option('--max-state-bytes <size>', 'largest KV state accepted (bytes, or with K/M/G; 1M-16G): on decode, a prompt whose state is larger fails at once with 400 kv_state_too_large (never retried or migrated), on every handoff path; a 1 GiB state needs more than the default', cliParser(parseStateBytes), DEFAULT_MAX_STATE_BYTES)
    .option('--kv-streams <n>', 'sockets one KV connection stripes large states over (1-8; the pair uses the smaller of both sides)', int, 1)
    .option('--no-kv-same-host', 'never hand the saved state file over on one host (kv_file): every KV handoff goes over TCP')
    .option('--kv-same-host-verify', 'same-host handoff: also check the state\'s data bytes (CRC-32, one full read of the file on each side, on the critical path); by default size, envelope head and the ggsq structure are checked, not the data (no wire to damage it); either side turns it on for the pair', false);

/** The model file of `role` (default: the built-in tiny model); a path that is no GGUF file ends the process with one line. */
async function modelPath(model: string | undefined, role?: string): Promise<string> {
  if (model) {
    const { checkModelFile } = await import('../engine/model-file.js');
    try {
      checkModelFile(resolve(model));
    } catch (err) {
      console.error(`pdserve${role ? ` ${role}` : ''}: ${(err as Error).message}`);
      process.exit(2);
    }
    return resolve(model);
  }
  const { ensureModel } = await import('../engine/gguf-writer.js');
  return ensureModel('tiny', 1);
}

function secretOf(role: string, o: { clusterSecret?: string; clusterSecretFile?: string }): string {
  let s: string | undefined;
  try {
    s = clusterSecretOf(role, o);
  } catch (err) {
    console.error(`pdserve ${role}: ${(err as Error).message}`);
    process.exit(2);
  }
  if (!s) {
    console.error(`pdserve ${role}: a cluster secret is required: set PDSERVE_CLUSTER_SECRET or pass --cluster-secret-file (the same on the router and every prefill and decode worker)`);
    process.exit(2);
  }
  return s;
}

/** The HTTP server timeouts of every server role and of `up` (../runtime/http-timeouts.ts). */
const httpTimeoutOptions = (c: Command, what = '') =>
  c
    .option('--keep-alive-timeout-ms <ms>', `${what}how long an idle keep-alive connection stays open (sent as Keep-Alive: timeout=); behind a load balancer, set it above the balancer's idle timeout`, positive, 72_000)
    .option('--headers-timeout-ms <ms>', `${what}longest wait for one request's headers`, positive, 60_000)
    .option('--http-request-timeout-ms <ms>', `${what}longest wait to receive one whole request, headers and body (0 = none)`, int, 0);

/** `httpTimeouts` of a role's config from the flags of `httpTimeoutOptions`. */
function httpTimeoutsOf(o: { keepAliveTimeoutMs: number; headersTimeoutMs: number; httpRequestTimeoutMs: number }) {
  return { keepAliveMs: o.keepAliveTimeoutMs, headersMs: o.headersTimeoutMs, requestMs: o.httpRequestTimeoutMs };
}

/** The flags of `httpTimeoutOptions` again, for a child of `up`. */
function httpTimeoutArgs(o: { keepAliveTimeoutMs: number; headersTimeoutMs: number; httpRequestTimeoutMs: number }): string[] {
  return ['--keep-alive-timeout-ms', String(o.keepAliveTimeoutMs), '--headers-timeout-ms', String(o.headersTimeoutMs), '--http-request-timeout-ms', String(o.httpRequestTimeoutMs)];
}

/** Options every server role takes: graceful drain (see ./serve.ts), the HTTP server timeouts. */
const lifecycleOptions = (c: Command) =>
  httpTimeoutOptions(c)
    .option('--drain-timeout-ms <ms>', 'on SIGTERM: longest wait for requests in flight before failing them (a 2nd signal stops waiting)', int, 30_000)
    .option('--discovery <etcd://HOST:PORT>', 'membership on etcd: workers register under a lease, the router watches (default: static --prefill/--decode flags only)');

/** Worker flags of etcd membership (see ../membership/worker-hooks.ts). */
const memberOptions = (c: Command) =>
  c
    .option('--advertise-host <host>', 'with --discovery: the address the router and peers dial (default: --host)')
    .option('--discovery-ttl-s <s>', 'with --discovery: lease TTL, seconds (a dead worker disappears after it)', positive, 5);

/** Run a server role until a signal (graceful drain) or until the parent's IPC channel closes. */
async function serve(role: string, o: { drainTimeoutMs: number; host?: string; discovery?: string; advertiseHost?: string; discoveryTtlS?: number; [k: string]: unknown }, start: () => Promise<Served>): Promise<void> {
  let hooks;
  if (role !== 'router' && o.discovery) {
    const { membershipHooks } = await import('../membership/worker-hooks.js');
    try {
      hooks = membershipHooks(role as 'prefill' | 'decode' | 'colocated', { ...o, host: o.host ?? '127.0.0.1' }, { model_file: typeof o.model === 'string' ? o.model : null, ctx_size: o.ctxSize as number, batch_size: o.batchSize as number, deterministic: !!o.deterministic, threads: o.threads as number, slots: (o.slots as number | undefined) ?? null });
    } catch (err) {
      console.error(`pdserve ${role}: ${(err as Error).message}`);
      process.exit(2);
    }
  }
  try {
    // A busy port is named before the engine loads, with the message `up` gives.
    for (const [flag, p] of [['--port', o.port], ['--bootstrap-port', o.bootstrapPort]] as const) if (typeof p === 'number' && p > 0) await assertPortFree(o.host ?? '127.0.0.1', p, flag);
    await serveRole(role, start, { drainTimeoutMs: o.drainTimeoutMs, hooks });
  } catch (err) {
    const problem = startupProblem(err) ?? (/^cannot listen on /.test((err as Error)?.message ?? '') ? (err as Error).message : null);
    if (problem === null) throw err;
    console.error(`pdserve ${role}: ${problem}`);
    // A supervisor that picked the port (the test harness) may pick another and retry: told over
    // IPC, flushed before the exit.
    if (process.send && /the port is in use/.test(problem)) process.send({ type: 'start_failed', reason: 'port_in_use', message: problem }, () => process.exit(2));
    else process.exit(2);
  }
}

function timeoutsOf(o: Record<string, number>) {
  return { preallocMs: o.preallocTimeoutMs, bootstrapMs: o.bootstrapTimeoutMs, waitingMs: o.waitingTimeoutMs, transferIdleMs: o.transferTimeoutMs };
}

/** --cors-origin: repeatable, each value a comma-separated list of origins. */
function corsList(v: string, prev: string[] | undefined): string[] {
  return [...(prev ?? []), ...v.split(',').map((x) => x.trim()).filter((x) => x.length > 0)];
}

/**
 * Set the `--role` of switchable worker `p`'s arguments to the role the router at `router` has
 * it in (the planner may have flipped it since it started), so a restart keeps it. Best effort:
 * when the router cannot be read the arguments stay as they are.
 */
async function followRouterRole(router: string, p: { url: string; args: string[] }, adminKey: string | undefined): Promise<void> {
  try {
    const res = await fetch(`${router}/workers`, { headers: adminKey ? { authorization: `Bearer ${adminKey}` } : {}, signal: AbortSignal.timeout(2000) });
    const w = ((await res.json()) as { workers?: { url: string; role: string }[] }).workers?.find((x) => x.url === p.url);
    const i = p.args.indexOf('--role');
    if (w && i >= 0 && (w.role === 'prefill' || w.role === 'decode') && p.args[i + 1] !== w.role) {
      console.error(`pdserve: ${p.url} restarts as ${w.role} (the role the planner gave it)`);
      p.args[i + 1] = w.role;
    }
  } catch {
    // the router is down or slow: restart with the arguments it has
  }
}

/** `--no-kv-stream` (prefill and `up`): see ../config/config.ts `kvStream`. */
const NO_KV_STREAM_HELP = 'over TCP, send the state only once llama.cpp has saved it (default: a one-room state goes out while llama.cpp saves it, to a decode that takes that)';

/** `--max-tool-calls` (router and colocated): see ../api/tool-calls.ts ParsedTools.maxCalls. */
const MAX_TOOL_CALLS_HELP = `most tool calls in one turn with parallel_tool_calls (1..${MAX_TOOL_CALLS_LIMIT}): after the last one the grammar ends the turn (finish_reason "tool_calls")`;

/** `--schema-max-nodes`, `--schema-max-enum-values` (router, colocated, `up`): see ../api/json-schema.ts SchemaLimits. */
const SCHEMA_MAX_NODES_HELP = 'most JSON-schema nodes a request\'s response_format / guided_json / tool parameters may expand to after $ref expansion (all its schemas together); past it a 400 schema_too_complex before any grammar is compiled';
const SCHEMA_MAX_ENUM_HELP = 'most enum/const values in a request\'s JSON schemas (all together); past it a 400 schema_too_complex (each value is a grammar alternative checked on every sampled token)';

/** `--unavailable-wait-ms` (router and `up`): see ../router/attempts.ts `waitUntil`. */
const UNAVAILABLE_WAIT_HELP = 'a request finding every worker of a role draining (none can take it) waits at most this long for one, then gets 503 with retry-after';

/** `--sse-keepalive-ms` (router and `up`): see ../router/keepalive.ts. */
const SSE_KEEPALIVE_HELP = "a streamed request silent this long (waiting for a worker, its first token or the next) gets an SSE comment ': keep-alive', so an idle proxy in front does not cut it (0 = never)";
/** `--client-write-deadline-ms` and `--client-max-buffered-bytes` (router, colocated, and `up` for its router): ../runtime/send-queue.ts. */
const CLIENT_DEADLINE_HELP = 'every byte written to a client (a stream, or a non-streamed body of 64 KiB or more) must be delivered within this (ms) of its write, else the client is cut and its request aborted (a stalled or too slow reader)';
const CLIENT_BUFFER_HELP = 'most bytes queued for one client (bytes, or with K/M/G; 64K-1G; default 4M) before it is cut and its request aborted';

/** `--leg-silence-timeout-ms` (router and `up`): see ../router/dispatch.ts `watchSilence`. */
const LEG_SILENCE_HELP = "a decode worker whose stream goes silent this long mid-generation (no token: a stopped or frozen process) is marked frozen and the request migrates, as after a crash (0 = no bound)";

/** `--worker-wait-ms` (router and `up`): see ../router/attempts.ts `waitUntil`. */
const WORKER_WAIT_HELP = 'a request finding no healthy worker of a role waits for one: until its deadline when a worker of the role served before (restarting, draining), at most this long when none ever did (a misconfigured cluster); 0 = 503 at once';

/** Flags `up` forwards to its children: the HTTP server timeouts to every one, --cors-origin, --worker-wait-ms, --unavailable-wait-ms, --sse-keepalive-ms, --leg-silence-timeout-ms, --client-write-deadline-ms, --client-max-buffered-bytes, --max-tool-calls, --schema-max-nodes, --schema-max-enum-values to the router, --served-model-name, --kv-same-host-verify, --max-state-bytes, --kv-streams and the GPU flags to the workers, --first-token-after-save and --no-kv-stream to prefill. */
export function upExtraArgs(o: { corsOrigin?: string[]; servedModelName?: string[]; decodePolicy: string; localPrefillMaxTokens: number; kvSameHostVerify?: boolean; maxStateBytes?: number; kvStreams?: number; firstTokenAfterSave?: number | 'always'; kvStream?: boolean; workerWaitMs: number; unavailableWaitMs?: number; sseKeepaliveMs?: number; legSilenceTimeoutMs?: number; clientWriteDeadlineMs?: number; clientMaxBufferedBytes?: number; maxToolCalls?: number; schemaMaxNodes?: number; schemaMaxEnumValues?: number } & Partial<Parameters<typeof httpTimeoutArgs>[0]> & Parameters<typeof gpuArgs>[0] & UpEngineFlags): { router?: string[]; prefill?: string[]; decode?: string[] } {
  const names = [...(o.servedModelName?.length ? ['--served-model-name', ...o.servedModelName] : []), ...upEngineArgs(o)]; // + the engine flags Cluster does not carry
  const local = ['--local-prefill-max-tokens', String(o.localPrefillMaxTokens)];
  const verify = [...(o.kvSameHostVerify ? ['--kv-same-host-verify'] : []), ...(o.maxStateBytes !== undefined ? ['--max-state-bytes', String(o.maxStateBytes)] : []), ...(o.kvStreams !== undefined ? ['--kv-streams', String(o.kvStreams)] : [])];
  const http = o.keepAliveTimeoutMs !== undefined && o.headersTimeoutMs !== undefined && o.httpRequestTimeoutMs !== undefined ? httpTimeoutArgs({ keepAliveTimeoutMs: o.keepAliveTimeoutMs, headersTimeoutMs: o.headersTimeoutMs, httpRequestTimeoutMs: o.httpRequestTimeoutMs }) : [];
  const router = [...(o.corsOrigin ? ['--cors-origin', o.corsOrigin.join(',')] : []), '--decode-policy', o.decodePolicy, ...local, '--worker-wait-ms', String(o.workerWaitMs), ...(o.unavailableWaitMs !== undefined ? ['--unavailable-wait-ms', String(o.unavailableWaitMs)] : []), ...(o.sseKeepaliveMs !== undefined ? ['--sse-keepalive-ms', String(o.sseKeepaliveMs)] : []), ...(o.legSilenceTimeoutMs !== undefined ? ['--leg-silence-timeout-ms', String(o.legSilenceTimeoutMs)] : []), ...(o.clientWriteDeadlineMs !== undefined ? ['--client-write-deadline-ms', String(o.clientWriteDeadlineMs)] : []), ...(o.clientMaxBufferedBytes !== undefined ? ['--client-max-buffered-bytes', String(o.clientMaxBufferedBytes)] : []), ...(o.maxToolCalls !== undefined ? ['--max-tool-calls', String(o.maxToolCalls)] : []), ...(o.schemaMaxNodes !== undefined ? ['--schema-max-nodes', String(o.schemaMaxNodes)] : []), ...(o.schemaMaxEnumValues !== undefined ? ['--schema-max-enum-values', String(o.schemaMaxEnumValues)] : []), ...http];
  const firstToken = o.firstTokenAfterSave !== undefined ? ['--first-token-after-save', String(o.firstTokenAfterSave)] : [];
  const stream = o.kvStream === false ? ['--no-kv-stream'] : [];
  return { router, prefill: [...names, ...verify, ...firstToken, ...stream, ...gpuArgs(o, 'prefill'), ...http], decode: [...names, ...local, ...verify, ...gpuArgs(o, 'decode'), ...http] };
}

/** The GPU flags of one role's workers under `up` (per-role --prefill-gpu-device / --decode-gpu-device over --gpu-device). */
function gpuArgs(o: { gpu: string; gpuLayers: string | number; kvCacheType: string; gpuDevice?: number[]; prefillGpuDevice?: number[]; decodeGpuDevice?: number[] }, role: 'prefill' | 'decode'): string[] {
  const devices = (role === 'prefill' ? o.prefillGpuDevice : o.decodeGpuDevice) ?? o.gpuDevice;
  return ['--gpu', o.gpu, '--gpu-layers', String(o.gpuLayers), '--kv-cache-type', o.kvCacheType, ...(devices ? ['--gpu-device', devices.join(',')] : [])];
}

/** `up`'s cluster secret: given (file, env, flag) or a random one; its children get it by environment. A given one that breaks the workers' rule ends `up` with one line before any child starts. */
function upSecret(o: { clusterSecret?: string; clusterSecretFile?: string }): string {
  let s: string;
  try {
    s = clusterSecretOf('up', o) ?? randomBytes(24).toString('hex');
  } catch (err) {
    console.error(`pdserve up: ${(err as Error).message}`);
    process.exit(2);
  }
  return s;
}

/** `up`'s access flags, for the router: keys go to it by environment, the file and the metrics flag as flags (no secret in them). */
function upAccess(o: { apiKey?: string[]; apiKeyFile?: string; adminApiKey?: string[]; privateMetrics?: boolean; tlsCert?: string; tlsKey?: string }) {
  const a = accessOf('up', o);
  const tls = a.tls ? ['--tls-cert', resolve(a.tls.cert), '--tls-key', resolve(a.tls.key)] : [];
  const m = a.admission;
  const admission = ['--max-concurrent-requests', String(m.maxConcurrent), '--max-queued-requests', String(m.maxQueued), '--queue-timeout-ms', String(m.queueTimeoutMs), '--key-rps', String(m.keyRps), '--key-burst', String(m.keyBurst), '--key-max-concurrent', String(m.keyMaxConcurrent)];
  return { apiKeys: a.apiKeys, adminApiKeys: a.adminApiKeys, routerArgs: [...(a.apiKeyFile ? ['--api-key-file', resolve(a.apiKeyFile)] : []), ...(a.privateMetrics ? ['--private-metrics'] : []), ...tls, ...admission], tls: !!a.tls };
}

/** The version in the package.json next to src/ and dist/. */
function packageVersion(): string {
  return (JSON.parse(readFileSync(new URL('../../package.json', import.meta.url), 'utf8')) as { version: string }).version;
}

/**
 * The whole command tree, nothing run: `argv` is what the actions of `sim` and `bench-suite` read
 * their own flags from. `src/cli/cli-docs.ts` writes docs/CLI.md from it.
 */
export async function cliProgram(argv: string[] = process.argv): Promise<Command> {
  const program = new Command('pdserve').description('Prefill/decode-disaggregated LLM serving with a KV handoff that cannot wedge').showHelpAfterError();
  program.version(packageVersion(), '-V, --version', 'print the version');

  httpTimeoutOptions(internalTlsFlags(accessFlags(engineOptions(program.command('up').description('start a local cluster: router + N prefill + M decode workers on loopback')))), 'every process: ')
    .option('--prefill <n>', 'prefill workers', positive, 1)
    .option('--decode <n>', 'decode workers', positive, 1)
    .option('--port <port>', 'router port', port, 8000)
    .option('--routers <n>', 'routers in front of the same workers, on --port, --port+1, …; more than one shares load, admission and stored Responses through etcd (--discovery, else a local etcd is started: needs the etcd binary)', positive, 1)
    .option('--host <host>', 'bind address of every process', '127.0.0.1')
    .option('--decode-slots <n>', 'sequences per decode worker', positive, 8)
    .option('--cluster-secret-file <file>', 'file holding the cluster secret (default: PDSERVE_CLUSTER_SECRET, else a random one); children get it by environment')
    .option('--cluster-secret <secret>', 'the cluster secret on the command line (visible in ps: warns)')
    .option('--log-dir <dir>', 'one log file per process (default: a temp folder)')
    .addOption(new Option('--cors-origin <origin>', "allow browser calls from this origin (repeatable or comma-separated; '*' = any)").argParser(corsList))
    .option('--worker-port-base <port>', 'fixed worker ports from here: prefill i → HTTP base+2i, bootstrap base+2i+1; decode j → base+2·prefill+j (default: random free ports)', port)
    .option('--drain-timeout-ms <ms>', 'on SIGTERM/Ctrl-C: longest wait for requests in flight (router first, then workers); a 2nd signal stops waiting', int, 30_000)
    .option('--discovery <etcd://HOST:PORT>', 'every process uses etcd membership: workers register under a lease, the router watches')
    .addOption(new Option('--decode-policy <name>', "the router's load balancing of decode workers (cache_aware: a prefix tree per decode worker; enables decode-local continuation)").choices([...POLICY_NAMES]).default('least_load'))
    .option('--local-prefill-max-tokens <tokens>', 'decode-local continuation (with --decode-policy cache_aware): longest uncached prompt suffix a decode worker evaluates itself (router and decode; 0 = off)', int, 256)
    .option('--worker-wait-ms <ms>', `router: ${WORKER_WAIT_HELP}`, int, 20_000)
    .option('--max-tool-calls <n>', `router: ${MAX_TOOL_CALLS_HELP}`, int, DEFAULT_MAX_TOOL_CALLS)
    .option('--schema-max-nodes <n>', `router: ${SCHEMA_MAX_NODES_HELP}`, int, DEFAULT_SCHEMA_MAX_NODES)
    .option('--schema-max-enum-values <n>', `router: ${SCHEMA_MAX_ENUM_HELP}`, int, DEFAULT_SCHEMA_MAX_ENUM_VALUES)
    .option('--unavailable-wait-ms <ms>', `router: ${UNAVAILABLE_WAIT_HELP}`, int, 5000)
    .option('--sse-keepalive-ms <ms>', `router: ${SSE_KEEPALIVE_HELP}`, int, 15_000)
    .option('--leg-silence-timeout-ms <ms>', `router: ${LEG_SILENCE_HELP}`, int, 30_000)
    .option('--client-write-deadline-ms <ms>', `router: ${CLIENT_DEADLINE_HELP}`, int, DEFAULT_SEND_QUEUE_LIMITS.deadlineMs)
    .option('--client-max-buffered-bytes <size>', `router: ${CLIENT_BUFFER_HELP}`, cliParser(parseBufferedBytes), DEFAULT_SEND_QUEUE_LIMITS.maxBufferedBytes)
    .option('--kv-same-host-verify', 'every worker: the same-host KV handoff also checks the state\'s data bytes (CRC-32; one full read of the file on each side)', false)
    .option('--max-state-bytes <size>', 'every worker: largest KV state accepted (bytes, or with K/M/G; 1M-16G; default 512M); a larger state fails its request with 400 kv_state_too_large', cliParser(parseStateBytes))
    .option('--kv-streams <n>', 'every worker: sockets one KV connection stripes large states over (1-8; default 1)', int)
    .option('--first-token-after-save <pct>', `prefill workers: ${FIRST_TOKEN_AFTER_SAVE_HELP} (default 5)`, percentOrAlways)
    .option('--no-kv-stream', `prefill workers: ${NO_KV_STREAM_HELP}`)
    .option('--prefill-gpu-device <list>', 'GPU devices of the prefill workers (default: --gpu-device), e.g. 0 — with --decode-gpu-device 1, one box with two GPUs', cliParser(parseDeviceList))
    .option('--decode-gpu-device <list>', 'GPU devices of the decode workers (default: --gpu-device)', cliParser(parseDeviceList))
    .option('--autoscale', 'start the workers as `pdserve worker` (switchable in place) and run the planner: it flips roles on the workers\' load gauges (docs/OPERATIONS.md#planner)')
    .option('--planner-tick-ms <ms>', 'with --autoscale: the planner\'s tick', positive, 5000)
    .option('--planner-port <port>', 'with --autoscale: port of the planner\'s GET /metrics and /status (0 = any free port)', int, 0)
    .action(async (o) => {
      const { Cluster } = await import('../up/cluster.js');
      const { superviseAction, unexpectedExitLine } = await import('../up/supervise.js');
      try {
        for (let i = 0; i < o.routers; i++) await assertPortFree(o.host, o.port + i, i ? '--routers' : undefined);
        if (o.autoscale && o.discovery) throw new ConfigError('--autoscale with --discovery: switchable workers do not register in etcd; run `pdserve planner --router URL` against a router that lists them');
        const workerPorts = o.autoscale ? 2 * (o.prefill + o.decode) : 2 * o.prefill + o.decode;
        if (o.workerPortBase !== undefined) {
          const last = o.workerPortBase + workerPorts - 1;
          if (last > 65535) throw new ConfigError(`--worker-port-base ${o.workerPortBase} leaves no room for ${workerPorts} worker ports (last would be ${last})`);
          for (let p = o.workerPortBase; p <= last; p++) {
            if (p >= o.port && p < o.port + o.routers) throw new ConfigError(`--worker-port-base ${o.workerPortBase}: worker port ${p} is a router's port (--port, --routers)`);
            await assertPortFree(o.host, p, '--worker-port-base');
          }
        }
      } catch (err) {
        console.error(`pdserve: ${(err as Error).message}`);
        process.exit(2);
      }
      const model = await modelPath(o.model);
      const logDir = o.logDir ?? join(tmpdir(), `pdserve-${process.pid}`);
      const c = new Cluster({ model, prefill: o.prefill, decode: o.decode, port: o.port, host: o.host, threads: o.threads, ctxSize: o.ctxSize, batchSize: o.batchSize, deterministic: o.deterministic, decodeSlots: o.decodeSlots, secret: upSecret(o), logDir, workerPortBase: o.workerPortBase, drainTimeoutMs: o.drainTimeoutMs, discovery: o.discovery, routers: o.routers, prefixStoreDir: o.prefixStoreDir, extraArgs: upExtraArgs(o), access: upAccess(o), internalTls: internalTlsOf('up', o, true), switchable: o.autoscale === true });
      let stopping = false;
      let planner: { stop(): Promise<void> } | null = null;
      let madeSecretFile: string | null = null;
      const stop = async (code = 0) => {
        if (stopping) {
          console.log('\npdserve: second signal: the processes stop waiting for requests in flight');
          c.force();
          return;
        }
        stopping = true;
        await planner?.stop();
        console.log(`\npdserve: draining the cluster (router first; at most ${o.drainTimeoutMs} ms; Ctrl-C again to stop waiting)…`);
        await c.drain(o.drainTimeoutMs + 10_000);
        if (madeSecretFile) rmSync(madeSecretFile, { force: true }); // the secret of a cluster that is gone: no reason to keep it on disk
        console.log('pdserve: stopped (every process has exited)');
        process.exit(code);
      };
      process.on('SIGINT', () => void stop());
      process.on('SIGTERM', () => void stop());
      try {
        await c.start();
      } catch (err) {
        console.error(`pdserve: ${(err as Error).message}`);
        await stop(1);
        return;
      }
      const r = c.router.url;
      console.log(`pdserve is up (model ${model})`);
      for (const p of c.byRole('router')) console.log(`  ${p.name.padEnd(9)} ${p.url}   (OpenAI API: ${p.url}/v1)`);
      if (c.discovery && !o.discovery) console.log(`  etcd      ${c.discovery}   (started for the routers)`);
      for (const p of c.procs.filter((x) => x.role !== 'router')) console.log(`  ${p.name.padEnd(9)} ${p.url}${p.bootstrapPort ? `   bootstrap port ${p.bootstrapPort}` : ''}`);
      console.log(`  logs      ${logDir}`);
      if (o.autoscale) {
        const { Planner, servePlanner } = await import('../planner/planner.js');
        const p = new Planner({ router: r, ...(c.adminKey ? { adminKey: c.adminKey } : {}), tickMs: o.plannerTickMs, log: createLogger('planner') });
        const served = await servePlanner(p, '127.0.0.1', o.plannerPort);
        p.start();
        planner = { stop: async () => { await p.stop(); await served.close(); } };
        console.log(`  planner   ${served.url}/status   (tick ${o.plannerTickMs} ms; decisions in ${served.url}/metrics)`);
      }
      const secretGiven = !!(o.clusterSecret || o.clusterSecretFile || process.env.PDSERVE_CLUSTER_SECRET || process.env.PDSERVE_CLUSTER_SECRET_FILE);
      console.log(`  doctor    ${doctorLine(r, givenSecretFile(o) ?? (secretGiven ? null : (madeSecretFile = writeSecretFile(logDir, c.secret))), { https: r.startsWith('https:'), key: c.access.adminApiKeys.length > 0 ? 'ADMIN_KEY' : c.access.apiKeys.length > 0 || o.apiKeyFile ? 'KEY' : null, internalTls: c.opts.internalTls ?? {} })}`);
      console.log(`  access    ${c.access.apiKeys.length || o.apiKeyFile ? 'API key required (Authorization: Bearer KEY)' : 'OPEN: no API key, anyone who reaches the router can use it (--api-key-file or PDSERVE_API_KEY)'}`);
      console.log('\nTry:');
      for (const l of tryLines(r, { apiKey: c.access.apiKeys.length > 0 || !!o.apiKeyFile, https: r.startsWith('https:') })) console.log(`  ${l}`);
      console.log('\nCtrl-C drains and stops everything (a second Ctrl-C stops waiting).');
      // Supervise (up/supervise.ts): a worker that dies on its own is restarted on the same
      // ports (peers and the router find it again); one that drained on request (exit 0) stays
      // stopped; `up` itself keeps serving with the others meanwhile.
      const restarting = new Set<string>();
      setInterval(() => {
        for (const p of c.procs) {
          if (restarting.has(p.name)) continue;
          const action = superviseAction(p, stopping);
          if (action === 'stopped') {
            p.expectedDown = true;
            console.error(`pdserve: ${p.name} drained and stopped on request (exit 0); not restarting it`);
          }
          if (action !== 'restart') continue;
          restarting.add(p.name);
          console.error(unexpectedExitLine(p));
          // --autoscale: a worker the planner flipped comes back in the role the router has it in
          (o.autoscale ? followRouterRole(r, p, c.adminKey) : Promise.resolve()).then(() => c.spawn(p)).then(
            () => console.error(`pdserve: ${p.name} is back`),
            (err) => console.error(`pdserve: ${p.name} failed to restart: ${(err as Error).message}`),
          ).finally(() => restarting.delete(p.name));
        }
      }, 1000);
    });

  memberOptions(lifecycleOptions(kvOptions(engineOptions(program.command('prefill').description('run a prefill worker')))
    .option('--host <host>', 'HTTP bind address', '127.0.0.1')
    .option('--port <port>', 'HTTP port', int, 30000)
    .option('--bootstrap-port <port>', 'KV bootstrap/control listener port', int, 8998)
    .option('--bootstrap-host <host>', 'address decode workers use to reach the bootstrap listener', '127.0.0.1')
    .option('--slots <n>', 'sequences of the prefill context', int, 1)
    .option('--max-waiting <n>', 'bound on rooms queued for prompt evaluation', int, 256)
    .option('--first-token-after-save <pct>', FIRST_TOKEN_AFTER_SAVE_HELP, percentOrAlways, 5)
    .option('--no-kv-stream', NO_KV_STREAM_HELP)))
    .action(async (o) => {
      const { startPrefillWorker } = await import('../prefill/worker.js');
      const model = await modelPath(o.model, 'prefill');
      await serve('prefill', o, async () =>
        startPrefillWorker(
          { internalTls: internalTlsOf('prefill', o, true), host: o.host, port: o.port, bootstrapHost: o.bootstrapHost, bootstrapPort: o.bootstrapPort, secret: secretOf('prefill', o), privateMetrics: o.privateMetrics === true, slots: o.slots, maxWaiting: o.maxWaiting, heartbeatMs: o.heartbeatMs, stateDir: o.stateDir, maxStateBytes: o.maxStateBytes, kvSameHost: o.kvSameHost, kvSameHostVerify: o.kvSameHostVerify, kvStreams: o.kvStreams, kvStream: o.kvStream !== false, firstTokenAfterSave: o.firstTokenAfterSave, timeouts: timeoutsOf(o), httpTimeouts: httpTimeoutsOf(o), engine: { modelPath: model, threads: o.threads, contextSize: o.ctxSize, batchSize: o.batchSize, deterministic: o.deterministic, flashAttention: o.flashAttention, servedModelName: o.servedModelName ?? [], grammarBudgetMs: o.grammarBudgetMs, ...prefixCacheConfig(o), ...gpuConfig(o) } },
          createLogger('prefill'),
          testHooksFromEnv(),
        ),
      );
    });

  memberOptions(lifecycleOptions(kvOptions(engineOptions(program.command('decode').description('run a decode worker')))
    .option('--host <host>', 'HTTP bind address', '127.0.0.1')
    .option('--port <port>', 'HTTP port', int, 30001)
    .option('--slots <n>', 'sequences decoded as one batch', int, 8)
    .option('--max-prealloc <n>', 'bound on requests waiting for a slot', int, 256)
    .option('--local-prefill-max-tokens <tokens>', 'decode-local continuation: longest uncached prompt suffix decode evaluates itself for a request the router sends it alone (0 = off; needs the prefix cache)', int, 256)
    .addOption(new Option('--allow-prefill <host:port>', "a prefill bootstrap address decode may dial besides the router's pool (repeatable); any other is refused with 400").argParser(collect))))
    .action(async (o) => {
      const { startDecodeWorker } = await import('../decode/worker.js');
      const model = await modelPath(o.model, 'decode');
      await serve('decode', o, async () =>
        startDecodeWorker(
          { internalTls: internalTlsOf('decode', o, true), host: o.host, port: o.port, secret: secretOf('decode', o), privateMetrics: o.privateMetrics === true, allowPrefill: o.allowPrefill ?? [], slots: o.slots, maxPrealloc: o.maxPrealloc, localPrefillMaxTokens: o.localPrefillMaxTokens, heartbeatMs: o.heartbeatMs, stateDir: o.stateDir, maxStateBytes: o.maxStateBytes, kvSameHost: o.kvSameHost, kvSameHostVerify: o.kvSameHostVerify, kvStreams: o.kvStreams, timeouts: timeoutsOf(o), httpTimeouts: httpTimeoutsOf(o), engine: { modelPath: model, threads: o.threads, contextSize: o.ctxSize, batchSize: o.batchSize, deterministic: o.deterministic, flashAttention: o.flashAttention, servedModelName: o.servedModelName ?? [], grammarBudgetMs: o.grammarBudgetMs, ...prefixCacheConfig(o), ...gpuConfig(o) } },
          createLogger('decode'),
          testHooksFromEnv(),
        ),
      );
    });

  lifecycleOptions(kvOptions(engineOptions(program.command('worker').description('run a worker that serves either role over one loaded model and switches in place (POST /role, or the router\'s POST /workers/role)')))
    .addOption(new Option('--role <role>', 'the role it starts in').choices(['prefill', 'decode']).makeOptionMandatory())
    .option('--host <host>', 'HTTP bind address', '127.0.0.1')
    .option('--port <port>', 'HTTP port', int, 30000)
    .option('--bootstrap-port <port>', 'KV bootstrap/control listener port while it serves prefill', int, 8998)
    .option('--bootstrap-host <host>', 'address decode workers use to reach the bootstrap listener', '127.0.0.1')
    .option('--slots <n>', 'sequences of the context (both roles)', int, 4)
    .option('--max-waiting <n>', 'prefill: bound on rooms queued for prompt evaluation', int, 256)
    .option('--max-prealloc <n>', 'decode: bound on requests waiting for a slot', int, 256)
    .option('--local-prefill-max-tokens <tokens>', 'decode: decode-local continuation limit (0 = off)', int, 256)
    .option('--first-token-after-save <pct>', FIRST_TOKEN_AFTER_SAVE_HELP, percentOrAlways, 5)
    .option('--no-kv-stream', NO_KV_STREAM_HELP)
    .option('--switch-drain-timeout-ms <ms>', 'a role switch: longest wait for the drain (requests and rooms to terminal) before it gives up and serves the old role again', int, 30_000)
    .addOption(new Option('--allow-prefill <host:port>', "decode: a prefill bootstrap address it may dial besides the router's pool (repeatable)").argParser(collect)))
    .action(async (o) => {
      if (o.discovery) {
        console.error('pdserve worker: --discovery is not supported for a switchable worker (its etcd record is keyed by role); list it with the router\'s --prefill/--decode');
        process.exit(2);
      }
      const { startSwitchableWorker } = await import('../switch/host.js');
      const model = await modelPath(o.model, 'worker');
      await serve('worker', o, async () =>
        startSwitchableWorker(
          { internalTls: internalTlsOf('worker', o, true), host: o.host, port: o.port, bootstrapHost: o.bootstrapHost, bootstrapPort: o.bootstrapPort, secret: secretOf('worker', o), privateMetrics: o.privateMetrics === true, allowPrefill: o.allowPrefill ?? [], slots: o.slots, maxWaiting: o.maxWaiting, maxPrealloc: o.maxPrealloc, localPrefillMaxTokens: o.localPrefillMaxTokens, heartbeatMs: o.heartbeatMs, stateDir: o.stateDir, maxStateBytes: o.maxStateBytes, kvSameHost: o.kvSameHost, kvSameHostVerify: o.kvSameHostVerify, kvStreams: o.kvStreams, kvStream: o.kvStream !== false, firstTokenAfterSave: o.firstTokenAfterSave, timeouts: timeoutsOf(o), httpTimeouts: httpTimeoutsOf(o), engine: { modelPath: model, threads: o.threads, contextSize: o.ctxSize, batchSize: o.batchSize, deterministic: o.deterministic, flashAttention: o.flashAttention, servedModelName: o.servedModelName ?? [], grammarBudgetMs: o.grammarBudgetMs, ...prefixCacheConfig(o), ...gpuConfig(o) } },
          o.role,
          { drainTimeoutMs: o.switchDrainTimeoutMs, log: createLogger('worker') },
        ),
      );
    });

  program
    .command('planner')
    .description("flip switchable workers' roles on their load (Dynamo's easy-mode thresholds) through a router's POST /workers/role; the router's admin key from PDSERVE_ADMIN_API_KEY")
    .requiredOption('--router <url>', "the router's base URL")
    .option('--tick-ms <ms>', 'how often it observes and decides', positive, 5000)
    .option('--host <host>', 'bind address of its GET /metrics and /status', '127.0.0.1')
    .option('--port <port>', 'port of its GET /metrics and /status (0 = any free port)', int, 0)
    .action(async (o) => {
      const { Planner, servePlanner } = await import('../planner/planner.js');
      const key = (process.env.PDSERVE_ADMIN_API_KEY ?? '').split(',')[0]?.trim();
      const p = new Planner({ router: String(o.router).replace(/\/+$/, ''), ...(key ? { adminKey: key } : {}), tickMs: o.tickMs, log: createLogger('planner') });
      const served = await servePlanner(p, o.host, o.port);
      console.log(`pdserve planner: router ${o.router}, tick ${o.tickMs} ms; ${served.url}/status, ${served.url}/metrics`);
      p.start();
      const stop = () => void p.stop().then(() => served.close()).then(() => process.exit(0));
      process.on('SIGINT', stop);
      process.on('SIGTERM', stop);
    });

  accessFlags(memberOptions(lifecycleOptions(engineOptions(program.command('colocated').description('run a single-process server (no disaggregation): the baseline and correctness reference'))
    .option('--host <host>', 'HTTP bind address', '127.0.0.1')
    .option('--port <port>', 'HTTP port', int, 8000)
    .option('--slots <n>', 'sequences decoded as one batch', int, 8)
    .option('--max-tool-calls <n>', MAX_TOOL_CALLS_HELP, int, DEFAULT_MAX_TOOL_CALLS)
    .option('--schema-max-nodes <n>', SCHEMA_MAX_NODES_HELP, int, DEFAULT_SCHEMA_MAX_NODES)
    .option('--schema-max-enum-values <n>', SCHEMA_MAX_ENUM_HELP, int, DEFAULT_SCHEMA_MAX_ENUM_VALUES)
    .option('--client-write-deadline-ms <ms>', CLIENT_DEADLINE_HELP, int, DEFAULT_SEND_QUEUE_LIMITS.deadlineMs)
    .option('--client-max-buffered-bytes <size>', CLIENT_BUFFER_HELP, cliParser(parseBufferedBytes), DEFAULT_SEND_QUEUE_LIMITS.maxBufferedBytes)
    .addOption(new Option('--cors-origin <origin>', "allow browser calls from this origin (repeatable or comma-separated; '*' = any)").argParser(corsList)))))
    .action(async (o) => {
      const { startColocated } = await import('../colocated/server.js');
      const model = await modelPath(o.model, 'colocated');
      await serve('colocated', o, async () => startColocated({ host: o.host, port: o.port, slots: o.slots, clientWriteDeadlineMs: o.clientWriteDeadlineMs, clientMaxBufferedBytes: o.clientMaxBufferedBytes, maxToolCalls: o.maxToolCalls, schemaMaxNodes: o.schemaMaxNodes, schemaMaxEnumValues: o.schemaMaxEnumValues, corsOrigin: o.corsOrigin ?? [], httpTimeouts: httpTimeoutsOf(o), ...accessOf('colocated', o), engine: { modelPath: model, threads: o.threads, contextSize: o.ctxSize, batchSize: o.batchSize, deterministic: o.deterministic, flashAttention: o.flashAttention, servedModelName: o.servedModelName ?? [], grammarBudgetMs: o.grammarBudgetMs, ...prefixCacheConfig(o), ...gpuConfig(o) } }, createLogger('colocated'), testHooksFromEnv()));
    });

  internalTlsFlags(secretFlags(accessFlags(lifecycleOptions(program
    .command('router')))))
    .description('run the router (OpenAI API) in front of prefill and decode workers')
    .option('--host <host>', 'bind address', '127.0.0.1')
    .option('--port <port>', 'port', int, 8000)
    .addOption(new Option('--prefill <url[,bootstrap-port]>', 'a prefill worker (repeatable); bootstrap port defaults to 8998').argParser(collect))
    .addOption(new Option('--decode <url>', 'a decode worker (repeatable)').argParser(collect))
    .option('--request-timeout-ms <ms>', 'end-to-end deadline of one request', int, 300_000)
    .option('--health-interval-ms <ms>', 'worker health polling period', int, 1000)
    .option('--no-first-token-from-prefill', 'decode streams every token (the first token waits for the KV handoff)')
    .option('--max-tool-calls <n>', MAX_TOOL_CALLS_HELP, int, DEFAULT_MAX_TOOL_CALLS)
    .option('--schema-max-nodes <n>', SCHEMA_MAX_NODES_HELP, int, DEFAULT_SCHEMA_MAX_NODES)
    .option('--schema-max-enum-values <n>', SCHEMA_MAX_ENUM_HELP, int, DEFAULT_SCHEMA_MAX_ENUM_VALUES)
    .option('--migration-limit <n>', 'most re-dispatches of one request after a worker failure, before output (retry) or after (migration: prompt + tokens sent go to another pair); see docs/MIGRATION.md', int, 3)
    .option('--worker-wait-ms <ms>', WORKER_WAIT_HELP, int, 20_000)
    .option('--unavailable-wait-ms <ms>', UNAVAILABLE_WAIT_HELP, int, 5000)
    .option('--sse-keepalive-ms <ms>', SSE_KEEPALIVE_HELP, int, 15_000)
    .option('--leg-silence-timeout-ms <ms>', LEG_SILENCE_HELP, int, 30_000)
    .option('--client-write-deadline-ms <ms>', CLIENT_DEADLINE_HELP, int, DEFAULT_SEND_QUEUE_LIMITS.deadlineMs)
    .option('--client-max-buffered-bytes <size>', CLIENT_BUFFER_HELP, cliParser(parseBufferedBytes), DEFAULT_SEND_QUEUE_LIMITS.maxBufferedBytes)
    .addOption(new Option('--policy <name>', 'load balancing of prefill workers (cache_aware: SGLang\'s prefix-tree policy with a load-imbalance threshold)').choices([...POLICY_NAMES]).default('cache_aware'))
    .addOption(new Option('--decode-policy <name>', 'load balancing of decode workers (cache_aware: a prefix tree per decode worker; enables decode-local continuation)').choices([...POLICY_NAMES]).default('least_load'))
    .option('--local-prefill-max-tokens <tokens>', 'decode-local continuation (with --decode-policy cache_aware): a round whose prefix the chosen decode worker holds is sent to it alone when its uncached suffix is at most this many tokens (decode checks exactly; 0 = off)', int, 256)
    .option('--cache-threshold <fraction>', 'cache_aware: matched fraction of the prompt above which the worker holding the prefix is taken', Number, 0.3)
    .option('--model <file>', "the workers' GGUF: the router tokenizes prompts with its vocabulary (a vocabulary-only load on a thread) and routes on the token blocks the workers hold; without it: the approximate prefix tree and no decode-local ('up' passes its own)")
    .option('--kv-router-max-blocks <n>', 'block references of the workers\' KV events the router keeps per worker (an entry past the bound is not matched)', int, DEFAULT_ROUTER_MAX_BLOCKS)
    .option('--tokenize-cache-mib <n>', 'bound of the router tokenizer\'s chunk cache (long prompts tokenized by cached chunks, exactly; 0 = every prompt whole)', int, DEFAULT_TOKENIZE_CACHE_BYTES >> 20)
    .option('--balance-abs-threshold <n>', 'cache_aware: the load is imbalanced when max - min in-flight requests exceeds this…', int, 64)
    .option('--balance-rel-threshold <x>', '…and max exceeds min times this; then the least loaded worker is taken', Number, 1.5)
    .addOption(new Option('--cors-origin <origin>', "allow browser calls from this origin (repeatable or comma-separated; '*' = any)").argParser(corsList))
    .action(async (o) => {
      const { startRouter } = await import('../router/index.js');
      if (!o.discovery && (!o.prefill?.length || !o.decode?.length)) {
        console.error('pdserve router: at least one --prefill and one --decode are required (or --discovery etcd://HOST:PORT)');
        process.exit(2);
      }
      const prefill = ((o.prefill ?? []) as string[]).map((s) => {
        const [url, bp] = s.split(',');
        const u = new URL(url!);
        return { url: url!, bootstrapHost: u.hostname, bootstrapPort: bp ? int(bp) : 8998 };
      });
      const decode = ((o.decode ?? []) as string[]).map((url) => ({ url }));
      await serve('router', o, async () => {
        const r = await startRouter({ host: o.host, port: o.port, prefill, decode, discovery: o.discovery, requestTimeoutMs: o.requestTimeoutMs, httpTimeouts: httpTimeoutsOf(o), healthIntervalMs: o.healthIntervalMs, firstTokenFromPrefill: o.firstTokenFromPrefill, migrationLimit: o.migrationLimit, maxToolCalls: o.maxToolCalls, schemaMaxNodes: o.schemaMaxNodes, schemaMaxEnumValues: o.schemaMaxEnumValues, workerWaitMs: o.workerWaitMs, unavailableWaitMs: o.unavailableWaitMs, clientWriteDeadlineMs: o.clientWriteDeadlineMs, clientMaxBufferedBytes: o.clientMaxBufferedBytes, sseKeepAliveMs: o.sseKeepaliveMs, legSilenceMs: o.legSilenceTimeoutMs, policy: o.policy, decodePolicy: o.decodePolicy, localPrefillMaxTokens: o.localPrefillMaxTokens, ...(o.model ? { model: resolve(o.model as string) } : {}), kvRouterMaxBlocks: o.kvRouterMaxBlocks, tokenizeCacheBytes: o.tokenizeCacheMib * (1 << 20), cacheThreshold: o.cacheThreshold, balanceAbsThreshold: o.balanceAbsThreshold, balanceRelThreshold: o.balanceRelThreshold, corsOrigin: o.corsOrigin ?? [], ...accessOf('router', o), internalTls: internalTlsOf('router', o, false), clusterSecret: secretOf('router', o), log: createLogger('router') }, testHooksFromEnv());
        return r;
      });
    });

  program
    .command('make-model')
    .description('write a deterministic llama GGUF with random weights (no download needed)')
    .requiredOption('--out <file>', 'output path')
    .addOption(new Option('--preset <name>', 'model size').choices(['tiny', 'small']).default('tiny'))
    .option('--seed <n>', 'PRNG seed', int, 1)
    .option('--chat-template <file>', 'embed this Jinja chat template (tokenizer.chat_template); default: none (node-llama-cpp\'s generic chat wrapper)')
    .action(async (o) => {
      const { writeLlamaGguf } = await import('../engine/gguf-writer.js');
      const chatTemplate = o.chatTemplate ? readFileSync(resolve(o.chatTemplate), 'utf8') : undefined;
      await writeLlamaGguf(resolve(o.out), { preset: o.preset, seed: o.seed, ...(chatTemplate !== undefined ? { chatTemplate } : {}) });
      console.log(`wrote ${resolve(o.out)} (${o.preset}, seed ${o.seed}${chatTemplate !== undefined ? ', with a chat template' : ''})`);
    });

  program
    .command('bench-route-tokens')
    .description("the router's added latency for exact routing at a long prompt: tokenizing as the workers do plus block hashing and matching, p50/p99/max per request (one JSON line)")
    .option('--model <file>', "GGUF model, or 'tiny' / 'small' (generated)", 'tiny')
    .option('--prompt-tokens <n>', 'prompt size, tokens', int, 16_384)
    .option('--iterations <n>', 'requests measured, one after another', int, 300)
    .option('--kv-block-tokens <tokens>', 'block size hashed', int, DEFAULT_KV_BLOCK_TOKENS)
    .option('--tokenize-cache-mib <n>', 'bound of the router tokenizer\'s chunk cache (0 = every prompt whole)', int, DEFAULT_TOKENIZE_CACHE_BYTES >> 20)
    .option('--memory-sessions <n>', 'instead: the router\'s memory with this many sessions\' prompts tokenized and their blocks held (heap before/after beside the bounds)', int)
    .option('--session-tokens <n>', 'with --memory-sessions: tokens of each session\'s prompt', int, 8192)
    .option('--workers <n>', 'with --memory-sessions: workers the sessions\' blocks are spread over', int, 3)
    .option('--kv-router-max-blocks <n>', 'with --memory-sessions: block references kept per worker', int, DEFAULT_ROUTER_MAX_BLOCKS)
    .action(async (o) => {
      const { benchRouteTokens, benchRouteMemory } = await import('../bench/route-tokens.js');
      const { ensureModel } = await import('../engine/gguf-writer.js');
      const model = o.model === 'tiny' || o.model === 'small' ? await ensureModel(o.model, 1) : resolve(o.model);
      const cacheBytes = o.tokenizeCacheMib * (1 << 20);
      if (o.memorySessions !== undefined) console.log(JSON.stringify(await benchRouteMemory({ model, sessions: o.memorySessions, sessionTokens: o.sessionTokens, workers: o.workers, maxBlocks: o.kvRouterMaxBlocks, cacheBytes, blockTokens: o.kvBlockTokens })));
      else console.log(JSON.stringify(await benchRouteTokens({ model, promptTokens: o.promptTokens, iterations: o.iterations, blockTokens: o.kvBlockTokens, cacheBytes })));
    });

  // ---- bench (src/bench/index.ts) and the benchmark suite (src/bench/suite.ts) ----
  {
    const num = (v: string): number => {
      const n = Number(v);
      if (!Number.isFinite(n)) throw new InvalidArgumentError(`not a number: ${v}`);
      return n;
    };
    const reqRate = (v: string): number => {
      if (v === 'inf') return Infinity;
      const n = Number(v);
      if (!(n > 0)) throw new InvalidArgumentError(`not a positive rate or 'inf': ${v}`);
      return n;
    };
    const bench = program
      .command('bench')
      .description('serving benchmark of an OpenAI-compatible endpoint (TTFT, TPOT, ITL, E2E, throughput, goodput), like vLLM bench serve')
      .option('--url <url>', 'base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:8000')
      .addOption(new Option('--backend <name>', 'openai: /v1/completions or /v1/chat/completions; pd-direct: SGLang /generate to a prefill and a decode worker (no router)').choices(['openai', 'pd-direct']).default('openai'))
      .addOption(new Option('--endpoint <name>', 'OpenAI endpoint').choices(['completions', 'chat']).default('completions'))
      .option('--model <name>', 'model name sent in requests (default: the first of GET /v1/models)')
      .option('--prefill <url,bootstrap-port>', 'pd-direct: the prefill worker')
      .option('--decode <url>', 'pd-direct: the decode worker')
      .option('--num-prompts <n>', 'requests to send', int, 100)
      .addOption(new Option('--request-rate <r>', "Poisson arrival rate, req/s; 'inf' = all at once").argParser(reqRate).default(Infinity, 'inf'))
      .option('--max-concurrency <n>', 'cap on requests in flight', int)
      .addOption(new Option('--dataset <name>', 'random: words drawn at random; corpus: windows of a real text (bench/corpus/alice.txt)').choices(['random', 'corpus']).default('random'))
      .option('--input-len <tokens>', 'prompt length', int, 256)
      .option('--output-len <tokens>', 'max_tokens of each request', int, 128)
      .option('--random-range-ratio <r>', 'lengths uniform in [L(1-r), L(1+r)]', num, 0)
      .option('--corpus <file>', 'text file for --dataset corpus (and the random vocabulary)')
      .option('--tokenizer <gguf>', "the served model's GGUF: makes prompt lengths exact in its tokens (default: the target's /tokenize; estimated at 4 chars/token when it has none)")
      .option('--seed <n>', 'seed of prompts and arrival times', int, 0)
      .option('--slo-ttft-ms <ms>', 'goodput SLO on TTFT', num)
      .option('--slo-tpot-ms <ms>', 'goodput SLO on TPOT', num)
      .option('--slo-e2e-ms <ms>', 'goodput SLO on end-to-end latency', num)
      .option('--warmup <n>', 'unrecorded requests sent first', int, 1)
      .option('--no-ignore-eos', 'let EOS end generation (default: ignore_eos, so outputs have --output-len tokens)')
      .option('--timeout-ms <ms>', 'per-request deadline', int, 600_000)
      .option('--json <file>', 'write the result (config, metrics, per-request arrays) as JSON')
      .option('--no-progress', 'no progress bar on stderr')
      .option('--ca <file>', "PEM CA of an https:// --url (the router's API key: PDSERVE_API_KEY)");
    internalTlsFlags(bench)
      .action(async (o) => {
        const { benchCli } = await import('../bench/index.js');
        process.exitCode = await benchCli({ ...o, ...(o.ca ? { ca: resolve(o.ca) } : {}), internalTls: internalTlsOf('bench', o, false) });
      });
    const collect = (v: string, prev: string[]) => [...prev, v];
    program
      .command('bench-agents')
      .description('agent sessions: replay a seeded or recorded (Mooncake / AIPerf JSONL) trace on PD, colocated and PD without reuse, or on --target endpoints; job-level metrics and goals (--mode rounds: N agents × R rounds with and without the prefix store)')
      .addOption(new Option('--mode <name>', 'trace: session trace replay; rounds: agents at scale (N concurrent R-round conversations)').choices(['trace', 'rounds']).default('trace'))
      .option('--model <file>', "GGUF model, or 'tiny' / 'small' (generated); default tiny (trace), small (rounds)")
      .option('--trace <file>', 'trace: replay a recorded Mooncake / AIPerf mooncake_trace JSONL file (timestamp or delay, input_length, output_length, hash_ids, session_id) instead of generating one')
      .option('--block-size <tokens>', "trace: tokens per hash id of --trace (Mooncake's: 512)", int, 512)
      .option('--seed <n>', 'trace: seed of the generated sessions', int, GENERATE_DEFAULTS.seed)
      .option('--sessions <n>', 'trace: top-level sessions (sub-agents come on top)', int, GENERATE_DEFAULTS.sessions)
      .option('--turns <n>', 'trace: median turns per session', int, GENERATE_DEFAULTS.turns)
      .option('--turns-sigma <s>', 'trace: spread of the turn count (σ of its log; 0 = all equal)', num, GENERATE_DEFAULTS.turnsSigma)
      .option('--growth <tokens>', 'trace: median tokens a turn adds (tool result)', int, GENERATE_DEFAULTS.growth)
      .option('--system-tokens <tokens>', 'trace: shared system prompt', int, GENERATE_DEFAULTS.systemTokens)
      .option('--tool-tokens <tokens>', 'trace: shared tool definitions block', int, GENERATE_DEFAULTS.toolTokens)
      .option('--task-tokens <tokens>', 'trace: task text', int, GENERATE_DEFAULTS.taskTokens)
      .option('--tasks <n>', 'trace: distinct task texts the sessions open with (weights 1/rank)', int, GENERATE_DEFAULTS.tasks)
      .option('--io-ratio <r>', 'trace: total input : output tokens', num, GENERATE_DEFAULTS.ioRatio)
      .option('--think-ms <ms>', 'trace: median pause between turns (tool run, think time)', num, GENERATE_DEFAULTS.thinkMs)
      .option('--subagents <share>', 'trace: share of sessions that spawn sub-agents', num, GENERATE_DEFAULTS.subagentShare)
      .option('--ramp-ms <ms>', 'trace: sessions start uniformly over this window', num, GENERATE_DEFAULTS.rampMs)
      .option('--time-scale <x>', "trace: the trace's pauses and arrival times × this", num, 1)
      .option('--write-trace <file>', 'trace: also write the trace as mooncake_trace JSONL (hash ids per --block-size tokens)')
      .option('--setups <list>', 'trace: stacks to start and replay on, in order: pd, colo, pd_noreuse', 'pd,colo,pd_noreuse')
      .option('--repeats <n>', 'trace: replays per setup (the order rotates)', int, 1)
      .option('--target <url>', 'trace: replay on this OpenAI endpoint instead of starting stacks (NAME=URL; repeatable)', collect, [])
      .addOption(new Option('--endpoint <name>', 'trace: chat (messages by role) or completions (one prompt)').choices(['chat', 'completions']).default('chat'))
      .option('--tokenizer <gguf>', "trace with --target: the served model's GGUF, for exact block lengths (default: 4 characters a token)")
      .option('--no-session-key', 'trace: do not send the session id as prompt_cache_key')
      .option('--timeout-ms <ms>', 'trace: per-request deadline', int, 600_000)
      .option('--deadline-s <s>', 'trace: per-replay deadline (requests not sent by then fail)', int, 1800)
      .option('--save', "trace: write bench/results/s7-agent-trace.json and re-render BENCHMARKS.md from this checkout's results")
      .option('--agents <list>', 'rounds: comma-separated concurrencies', '8,30')
      .option('--rounds <n>', 'rounds: rounds per conversation', int, 8)
      .option('--decode <n>', 'decode workers', int, 2)
      .option('--decode-slots <n>', 'slots per decode worker', int, 10)
      .option('--ctx-size <tokens>', 'context size per sequence (default: rounds 2048; trace: the longest prompt and reply, rounded up)', int)
      .option('--batch-size <tokens>', 'prompt chunk', int, 512)
      .option('--json <file>', 'write the runs as JSON')
      .addOption(new Option('--gpu <backend>', 'engine processes on a GPU backend, every layer offloaded (default: CPU)').choices(['cuda', 'vulkan']))
      .option('--gpu-device <list>', 'with --gpu: the devices of every engine process, e.g. 0', cliParser(parseDeviceList))
      .action(async (o) => {
        const engineArgs = o.gpu ? ['--gpu', o.gpu, '--gpu-layers', 'max', ...(o.gpuDevice ? ['--gpu-device', (o.gpuDevice as number[]).join(',')] : [])] : [];
        if (o.mode === 'trace') {
          const { benchAgentsTraceCli } = await import('../bench/agents-cli.js');
          process.exitCode = await benchAgentsTraceCli({ ...o, model: o.model ?? 'tiny', subagentShare: o.subagents, targets: o.target, engineArgs, argv });
          return;
        }
        const { runAgentsScale, agentsScaleTable } = await import('../bench/agents.js');
        const { ensureModel } = await import('../engine/gguf-writer.js');
        const name = o.model ?? 'small';
        const model = name === 'tiny' || name === 'small' ? await ensureModel(name, 1) : resolve(name);
        const agents = String(o.agents).split(',').map((x: string) => int(x.trim()));
        const r = await runAgentsScale({ model, agents, rounds: o.rounds, decode: o.decode, decodeSlots: o.decodeSlots, contextSize: o.ctxSize ?? 2048, batchSize: o.batchSize, engineArgs });
        console.log(agentsScaleTable(r.runs, o.rounds).join('\n'));
        if (o.json) (await import('node:fs')).writeFileSync(o.json, JSON.stringify(r, null, 1) + '\n');
      });
    program
      .command('bench-routers')
      .description("scale-out: 1 prefill + 2 decode behind 2 routers and nginx; 2 routers × N streams (does a request wait for a slot while a decode has one free), then agent sessions through nginx with the openai SDK's retries while router A is SIGKILLed at the midpoint; goals met/missed (exit 1 when one is missed)")
      .option('--model <file>', "GGUF model, or 'tiny' / 'small' (generated)", 'tiny')
      .option('--sessions <n>', 'agent sessions', int, 30)
      .option('--turns <n>', 'turns per session (each resends the conversation plus a tool result)', int, 8)
      .option('--system-tokens <tokens>', "each session's system prompt", int, 120)
      .option('--tool-tokens <tokens>', "each turn's tool result", int, 40)
      .option('--output-tokens <tokens>', 'max_tokens of each turn (EOS ignored)', int, 12)
      .option('--think-ms <ms>', 'pause of a session between its turns', int, 50)
      .option('--decode-slots <n>', 'sequence slots per decode worker', int, 4)
      .option('--keep-slots <n>', "finished conversations each decode keeps (its --prefix-cache-slots; default: its share of the sessions + 2)", int)
      .option('--ctx-size <tokens>', 'context size per sequence', int, 1024)
      .option('--max-retries <n>', "the openai SDK's maxRetries", int, 3)
      .option('--timeout-ms <ms>', 'per-request deadline', int, 60_000)
      .option('--streams <n>', 'streams phase: streams per router', int, 4)
      .option('--stream-tokens <tokens>', 'streams phase: tokens each stream generates', int, 600)
      .option('--no-nginx', 'send the sessions to the routers directly even when nginx is installed')
      .option('--json <file>', 'write the result (per-turn records included) as JSON')
      .option('--save', "write bench/results/s9-routers.json (without the per-turn records) and re-render BENCHMARKS.md from this checkout's results")
      .action(async (o) => {
        const { runBenchRouters, routersReport } = await import('../bench/routers.js');
        const { ensureModel } = await import('../engine/gguf-writer.js');
        const model = o.model === 'tiny' || o.model === 'small' ? await ensureModel(o.model, 1) : resolve(o.model);
        const r = await runBenchRouters({ model, sessions: o.sessions, turns: o.turns, systemTokens: o.systemTokens, toolTokens: o.toolTokens, outputTokens: o.outputTokens, thinkMs: o.thinkMs, decodeSlots: o.decodeSlots, keepSlots: o.keepSlots ?? Math.ceil(o.sessions / 2) + 2, ctxSize: o.ctxSize, maxRetries: o.maxRetries, timeoutMs: o.timeoutMs, streams: o.streams, streamTokens: o.streamTokens, nginx: o.nginx !== false });
        console.log(routersReport(r).join('\n'));
        if (o.json) (await import('node:fs')).writeFileSync(o.json, JSON.stringify(r, (_k, v) => (typeof v === 'number' && !Number.isFinite(v) ? null : v), 1) + '\n');
        if (o.save) (await import('../bench/routers-save.js')).saveRoutersResult(r);
        process.exitCode = r.goals.every((g) => g.met) ? 0 : 1;
      });
    program
      .command('bench-suite')
      .description('the benchmark suite behind `npm run bench`: writes BENCHMARKS.md, bench/results/*.json, bench/plots/*.svg')
      .option('--sections <list>', 'comma-separated section numbers to run (1-8; 8 needs cmake and ninja to build llama-server once)', '1,2,3,4,5,6,7')
      .option('--quick', 'tiny repetitions and durations (a smoke run, numbers meaningless)')
      .option('--out <dir>', 'repository root to write into (default: this checkout)')
      .option('--no-pin', 'do not pin prefill/decode to separate cores with taskset')
      .option('--render-only', 'only re-render BENCHMARKS.md and the plots from bench/results')
      .action(async (o) => {
        const { benchSuiteCli } = await import('../bench/suite.js');
        process.exitCode = await benchSuiteCli({ sections: String(o.sections), quick: !!o.quick, out: o.out ? resolve(o.out) : undefined, pin: o.pin !== false, argv, renderOnly: !!o.renderOnly });
      });
  }

  program
    .command('sim')
    .description('run the deterministic room-lifecycle simulator over many seeds')
    .allowUnknownOption()
    .allowExcessArguments(true)
    .helpOption(false)
    .action(async () => {
      const { simMain } = await import('../sim/index.js');
      const i = argv.indexOf('sim');
      process.exitCode = await simMain(argv.slice(i + 1));
    });

  // ---- storm (src/storm/index.ts) ----
  {
    const dur = (v: string): number => {
      try {
        return parseDurationMs(v);
      } catch (err) {
        throw new InvalidArgumentError((err as Error).message);
      }
    };
    const rate = (v: string): number => {
      const n = Number(v);
      if (!(n >= 0 && n <= 1)) throw new InvalidArgumentError(`not a rate in [0, 1]: ${v}`);
      return n;
    };
    const storm = engineOptions(program.command('storm').description('many agents, client cancellations at every phase and worker faults; fails (exit 1) on any wedge, leak, hang, crash or wrong answer'))
      .option('--url <url>', 'drive this router instead of starting a cluster (client-side chaos only)')
      .addOption(new Option('--worker <url>', 'with --url: a worker to watch (/metrics, /health, /debug/rooms); repeatable').argParser(collect))
      .option('--reference <url>', 'with --url: a colocated server for the wrong-answer check')
      .option('--agents <n>', 'agents running conversations in parallel', int, 30)
      .option('--rounds <n>', 'rounds per conversation', int, 6)
      .addOption(new Option('--duration <time>', 'storm length (then drain, settle, verify)').argParser(dur).default(60_000, '1m'))
      .option('--seed <n>', 'seed of the chaos and prompt RNG', int, 1)
      .option('--prefill <n>', 'prefill workers (self-hosted)', int, 2)
      .option('--decode <n>', 'decode workers (self-hosted)', int, 2)
      .addOption(new Option('--preset <name>', 'built-in model when --model is not given').choices(['tiny', 'small']).default('tiny'))
      .option('--decode-slots <n>', 'sequences per decode worker', positive, 8)
      .addOption(new Option('--kv-same-host <mode>', 'same-host KV handoff (kv_file): on everywhere, off everywhere, or mixed (decode-1 runs --no-kv-same-host, so both paths carry rooms)').choices(['on', 'off', 'mixed']).default('mixed'))
      .option('--abort-rate <p>', 'share of requests the agent aborts (after sending, before the first token, mid-stream)', rate, 0.3)
      .option('--kill-rate <p>', 'share of requests whose agent is killed (TCP reset) and restarts its conversation', rate, 0.05)
      .option('--non-stream-rate <p>', 'share of requests sent without streaming', rate, 0.2)
      .addOption(new Option('--burst-every <time>', 'every agent cancels at once, this often (0 = never)').argParser(dur).default(15_000, '15s'))
      .addOption(new Option('--kill-decode-every <time>', 'SIGKILL + restart a decode worker, this often (0 = never)').argParser(dur).default(20_000, '20s'))
      .addOption(new Option('--kill-prefill-every <time>', 'SIGKILL + restart a prefill worker, this often (0 = never)').argParser(dur).default(30_000, '30s'))
      .addOption(new Option('--stop-prefill-every <time>', 'SIGSTOP a prefill worker, this often (0 = never)').argParser(dur).default(25_000, '25s'))
      .addOption(new Option('--stop-duration <time>', 'how long a SIGSTOP lasts before SIGCONT').argParser(dur).default(3000, '3s'))
      .addOption(new Option('--request-timeout <time>', 'deadline of every request (the hang check); the router gets 80 % of it').argParser(dur).default(60_000, '1m'))
      .addOption(new Option('--settle <time>', 'after the drain, max wait for every gauge to reach zero (the leak check); raised to the longest TTFT seen').argParser(dur).default(10_000, '10s'))
      .addOption(new Option('--warmup <time>', 'workers on a GPU: rounds of decode slots × decode requests before the clock starts, until one is all ok, at most this long (first-use pipeline compilation; 0 = none)').argParser(dur).default(600_000, '10m'))
      .option('--max-tokens <n>', 'max_tokens of a round is drawn from [n/4, n]', int, 48)
      .addOption(new Option('--think <time>', 'max think time between rounds').argParser(dur).default(200, '200ms'))
      .option('--verify <n>', 'completed rounds compared with the colocated reference (0 = skip)', int, 24)
      .option('--json <file>', 'write the full report as JSON')
      .option('--log-dir <dir>', 'one log file per process (default: a temp folder)')
      .option('--no-progress', 'no progress line')
      .option('--ca <file>', "PEM CA of an https:// router (the router's keys: PDSERVE_API_KEY, PDSERVE_ADMIN_API_KEY; self-hosted, the router is started with them)")
      .option('--tls-cert <file>', 'self-hosted: the router serves HTTPS with this PEM certificate (with --tls-key; give --ca)')
      .option('--tls-key <file>', 'self-hosted: the PEM key of --tls-cert');
    internalTlsFlags(storm)
      .action(async (o) => {
        const { runStorm } = await import('../storm/index.js');
        if (!o.tlsCert !== !o.tlsKey) {
          console.error('pdserve storm: --tls-cert and --tls-key go together');
          process.exit(2);
        }
        const apiKey = listEnv(process.env.PDSERVE_API_KEY)[0];
        const adminKey = listEnv(process.env.PDSERVE_ADMIN_API_KEY)[0];
        const access = { ...(apiKey ? { apiKey } : {}), ...(adminKey ? { adminKey } : {}), ...(o.ca ? { ca: resolve(o.ca) } : {}) };
        const internalTls = internalTlsOf('storm', o, !o.url);
        const ac = new AbortController();
        let interrupts = 0;
        process.on('SIGINT', () => {
          if (++interrupts === 1) {
            console.error('\npdserve storm: interrupted; draining and checking (Ctrl-C again to quit at once)');
            ac.abort();
          } else process.exit(130);
        });
        try {
          const report = await runStorm({
            url: o.url,
            workers: o.worker ?? [],
            reference: o.reference,
            agents: o.agents,
            rounds: o.rounds,
            durationMs: o.duration,
            seed: o.seed,
            prefill: o.prefill,
            decode: o.decode,
            model: o.model,
            preset: o.preset,
            threads: o.threads,
            workerArgs: gpuArgs(o, 'prefill'),
            ctxSize: o.ctxSize,
            batchSize: o.batchSize,
            // The wrong-answer check needs batch-invariant engines to compare exactly.
            deterministic: o.deterministic || o.verify > 0,
            decodeSlots: o.decodeSlots,
            kvSameHost: o.kvSameHost,
            abortRate: o.abortRate,
            killRate: o.killRate,
            nonStreamRate: o.nonStreamRate,
            burstEveryMs: o.burstEvery,
            killDecodeEveryMs: o.killDecodeEvery,
            killPrefillEveryMs: o.killPrefillEvery,
            stopPrefillEveryMs: o.stopPrefillEvery,
            stopDurationMs: o.stopDuration,
            requestTimeoutMs: o.requestTimeout,
            settleMs: o.settle,
            warmupMs: o.warmup,
            maxTokens: o.maxTokens,
            thinkMs: o.think,
            verify: o.verify,
            json: o.json ? resolve(o.json) : undefined,
            logDir: o.logDir ? resolve(o.logDir) : undefined,
            progress: o.progress === false ? 'off' : process.stderr.isTTY ? 'tty' : 'lines',
            signal: ac.signal,
            access,
            ...(o.tlsCert ? { routerTls: { cert: resolve(o.tlsCert), key: resolve(o.tlsKey) } } : {}),
            ...(internalTls ? { internalTls } : {}),
          });
          process.exit(report.ok ? 0 : 1);
        } catch (err) {
          console.error(`pdserve storm: ${(err as Error).message}`);
          process.exit(2);
        }
      });
  }

  // ---- doctor (src/doctor/) ----
  (await import('../doctor/cli.js')).addDoctorCommand(program);
  return program;
}

/** Parse argv and run. */
export async function runCli(argv: string[]): Promise<void> {
  await (await cliProgram(argv)).parseAsync(argv);
}
