/**
 * Where the CLI takes keys and secrets from: environment variables and files first, because a
 * process's command line is readable by every local user (`ps`); a flag still works and warns.
 *
 *   PDSERVE_API_KEY              API keys of the router / colocated (comma-separated)
 *   PDSERVE_ADMIN_API_KEY        admin keys (comma-separated)
 *   PDSERVE_CLUSTER_SECRET       the cluster secret (KV channel, worker request signatures)
 *   --cluster-secret-file FILE   the same from a file (its first line; PDSERVE_CLUSTER_SECRET_FILE)
 *
 * TLS files are paths, not secrets: they may go on a command line (`internalTlsArgs`).
 */
import { resolve } from 'node:path';
import type { Command } from 'commander';
import { loadInternalTls, type InternalTlsFiles } from '../security/tls.js';
import { checkClusterSecret, readClusterSecretFile } from '../security/cluster-secret.js';
import { ConfigError } from '../base/errors.js';

/** Split a comma-separated env value into its non-empty, trimmed entries. */
export function listEnv(v: string | undefined): string[] {
  return (v ?? '')
    .split(',')
    .map((x) => x.trim())
    .filter((x) => x.length > 0);
}

/** Flags of the client access of an OpenAI edge (src/api/access.ts). */
export const accessFlags = (c: Command) =>
  c
    .option('--api-key <keys...>', 'API key(s) clients send as Authorization: Bearer (better: PDSERVE_API_KEY, comma-separated, or --api-key-file: ps shows flags)')
    .option('--api-key-file <file>', 'API keys, one a line (# comments); re-read when the file changes: keys rotate without a restart')
    .option('--admin-api-key <keys...>', 'key(s) of /workers, /debug/*, /dashboard (better: PDSERVE_ADMIN_API_KEY)')
    .option('--private-metrics', '/metrics needs the admin key too (default: open, for scrapers)', false)
    .option('--tls-cert <file>', 'HTTPS for clients: PEM certificate (chain) file (with --tls-key)')
    .option('--tls-key <file>', 'HTTPS for clients: PEM private key file (with --tls-cert)')
    .option('--max-concurrent-requests <n>', 'admission: generation requests served at once (0 = no cap)', (v: string) => Number(v), 1024)
    .option('--max-queued-requests <n>', 'admission: requests waiting beyond the cap (then 429)', (v: string) => Number(v), 4096)
    .option('--queue-timeout-ms <ms>', 'admission: longest wait in the queue (then 429)', (v: string) => Number(v), 30_000)
    .option('--key-rps <r>', 'admission: requests per second per API key, a token bucket (0 = no limit)', (v: string) => Number(v), 0)
    .option('--key-burst <n>', 'admission: the bucket size of --key-rps (default: the rate)', (v: string) => Number(v), 0)
    .option('--key-max-concurrent <n>', 'admission: requests at once per API key (0 = no limit)', (v: string) => Number(v), 0);

/** Warn (stderr) that a secret came on the command line. */
export function warnArgv(role: string, flag: string, env: string): void {
  console.error(`pdserve ${role}: warning: ${flag} on the command line is visible to every local user (ps); use ${env} or a file instead`);
}

/** The access config of `accessFlags`' options and the environment (exits 2 on a lone --tls-cert / --tls-key). */
export function accessOf(role: string, o: { apiKey?: string[]; apiKeyFile?: string; adminApiKey?: string[]; privateMetrics?: boolean; tlsCert?: string; tlsKey?: string; maxConcurrentRequests?: number; maxQueuedRequests?: number; queueTimeoutMs?: number; keyRps?: number; keyBurst?: number; keyMaxConcurrent?: number }): { apiKeys: string[]; apiKeyFile?: string; adminApiKeys: string[]; privateMetrics: boolean; tls?: { cert: string; key: string }; admission: Record<string, number> } {
  if (!o.tlsCert !== !o.tlsKey) {
    console.error(`pdserve ${role}: --tls-cert and --tls-key go together`);
    process.exit(2);
  }
  if (o.apiKey?.length) warnArgv(role, '--api-key', 'PDSERVE_API_KEY or --api-key-file');
  if (o.adminApiKey?.length) warnArgv(role, '--admin-api-key', 'PDSERVE_ADMIN_API_KEY');
  return {
    apiKeys: [...(o.apiKey ?? []), ...listEnv(process.env.PDSERVE_API_KEY)],
    ...(o.apiKeyFile ? { apiKeyFile: o.apiKeyFile } : {}),
    adminApiKeys: [...(o.adminApiKey ?? []), ...listEnv(process.env.PDSERVE_ADMIN_API_KEY)],
    privateMetrics: o.privateMetrics === true,
    ...(o.tlsCert && o.tlsKey ? { tls: { cert: o.tlsCert, key: o.tlsKey } } : {}),
    admission: { maxConcurrent: o.maxConcurrentRequests ?? 1024, maxQueued: o.maxQueuedRequests ?? 4096, queueTimeoutMs: o.queueTimeoutMs ?? 30_000, keyRps: o.keyRps ?? 0, keyBurst: o.keyBurst ?? 0, keyMaxConcurrent: o.keyMaxConcurrent ?? 0 },
  };
}

/** Flags of the cluster secret (every role but colocated). */
export const secretFlags = (c: Command) =>
  c
    .option('--cluster-secret-file <file>', 'file holding the cluster secret (its first line; or PDSERVE_CLUSTER_SECRET_FILE, or PDSERVE_CLUSTER_SECRET)')
    .option('--cluster-secret <secret>', 'the cluster secret on the command line (visible in ps: warns; prefer PDSERVE_CLUSTER_SECRET or --cluster-secret-file)');

/**
 * The cluster secret: --cluster-secret-file, PDSERVE_CLUSTER_SECRET, PDSERVE_CLUSTER_SECRET_FILE,
 * then --cluster-secret (with a warning). Undefined when none is given.
 * @throws PdError('invalid_config') when a named file cannot be read or is empty, or the secret is
 *   shorter than ../security/cluster-secret.ts `CLUSTER_SECRET_MIN_CHARS` (one message for every role).
 */
export function clusterSecretOf(role: string, o: { clusterSecret?: string; clusterSecretFile?: string }): string | undefined {
  const file = o.clusterSecretFile ?? process.env.PDSERVE_CLUSTER_SECRET_FILE;
  if (o.clusterSecretFile || (!process.env.PDSERVE_CLUSTER_SECRET && file)) return readClusterSecretFile(file!);
  if (process.env.PDSERVE_CLUSTER_SECRET) return checkClusterSecret(process.env.PDSERVE_CLUSTER_SECRET);
  if (o.clusterSecret) {
    warnArgv(role, '--cluster-secret', 'PDSERVE_CLUSTER_SECRET or --cluster-secret-file');
    return checkClusterSecret(o.clusterSecret);
  }
  return undefined;
}

/** Flags of internal TLS (router ↔ workers HTTP, the KV channel): ../security/tls.ts `InternalTlsFiles`. */
export const internalTlsFlags = (c: Command) =>
  c
    .option('--internal-tls-cert <file>', 'internal TLS: this process\'s PEM certificate (its HTTPS / KV listener; the client certificate of its calls to other roles)')
    .option('--internal-tls-key <file>', 'internal TLS: the PEM private key of --internal-tls-cert')
    .option('--internal-tls-ca <file>', 'internal TLS: the PEM CA of the cluster\'s certificates: verifies the servers called; a server with it requires client certificates it signed (mutual TLS)');

/**
 * The internal TLS files of `internalTlsFlags`' options, as absolute paths, checked readable;
 * undefined when none is given. `server`: the role listens (prefill, decode, up), so it needs a
 * certificate and key. Exits 2 with one line on a lone cert or key, a missing server
 * certificate or an unreadable file.
 */
export function internalTlsOf(role: string, o: { internalTlsCert?: string; internalTlsKey?: string; internalTlsCa?: string }, server: boolean): InternalTlsFiles | undefined {
  const f: InternalTlsFiles = { ...(o.internalTlsCert ? { cert: resolve(o.internalTlsCert) } : {}), ...(o.internalTlsKey ? { key: resolve(o.internalTlsKey) } : {}), ...(o.internalTlsCa ? { ca: resolve(o.internalTlsCa) } : {}) };
  try {
    const t = loadInternalTls(f);
    if (!t) return undefined;
    if (server && !t.cert) throw new ConfigError('internal TLS on a listening role needs --internal-tls-cert and --internal-tls-key');
  } catch (err) {
    console.error(`pdserve ${role}: ${(err as Error).message}`);
    process.exit(2);
  }
  return f;
}
