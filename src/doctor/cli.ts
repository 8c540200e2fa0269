/**
 * `pdserve doctor`: one command that reads the whole cluster and says what is wrong.
 *
 *   pdserve doctor --url ROUTER            diagnosis, worst first; exit 0 ok, 1 warnings, 2 critical
 *   pdserve doctor --url ROUTER --json     the same as JSON ({exit_code, summary, findings, ...})
 *   pdserve doctor --url ROUTER --watch 2  repeat every 2 s, reporting counters that moved
 *   pdserve doctor --url ROUTER --request ID   one request's timeline across processes
 *
 * Every GET has a deadline (`--timeout`, default 3 s) and a whole round is bounded by 9 s, so an
 * answer comes within 10 s even when workers hang. `--discovery etcd://…` reads the worker list
 * from etcd membership instead of (or, with --url, besides) the router's GET /workers.
 * Credentials from the environment: PDSERVE_ADMIN_API_KEY (to the router only) and the cluster
 * secret the workers' requests are signed with (`--cluster-secret-file`, PDSERVE_CLUSTER_SECRET,
 * PDSERVE_CLUSTER_SECRET_FILE: the workers' order). TLS: `--ca` (the router's HTTPS CA) and
 * `--internal-tls-cert/-key/-ca` (https:// workers that ask for a client certificate). The
 * commands a finding suggests repeat these flags (paths) and name the keys by placeholder.
 */
import { Command, InvalidArgumentError } from 'commander';
import { diagnose, type Diagnosis } from '../observe/diagnose.js';
import { gather, routerSource, type ClusterSnapshot, type WorkerSource } from '../observe/gather.js';
import { renderRequestReport, requestReport } from './request.js';
import { readFileSync } from 'node:fs';
import { Agent, type Dispatcher } from 'undici';
import { withCredentials } from '../security/http-auth.js';
import { internalClientOptions, loadInternalTls, type InternalTlsFiles } from '../security/tls.js';
import { readClusterSecretFile } from '../security/cluster-secret.js';
import { ConfigError, PdError } from '../base/errors.js';

export interface DoctorOptions {
  url?: string;
  discovery?: string;
  json?: boolean;
  watch?: number;
  count?: number;
  request?: string;
  timeout: number;
  slowMs: number;
  windowMs: number;
  /** The router's admin key (--admin-api-key / PDSERVE_ADMIN_API_KEY), sent to the router only. */
  adminApiKey?: string;
  /** PEM file of the CA of the router's HTTPS certificate (default: the system store). */
  ca?: string;
  /** Internal TLS files: the CA of https:// workers and the client certificate they require. */
  internalTlsCert?: string;
  internalTlsKey?: string;
  internalTlsCa?: string;
  /** File holding the cluster secret (its first line); else PDSERVE_CLUSTER_SECRET, then PDSERVE_CLUSTER_SECRET_FILE. */
  clusterSecretFile?: string;
}

/**
 * What a command a finding suggests must carry to reach the same cluster as this run: the
 * admin key by placeholder (never its value), the cluster secret as this run read it (a file by
 * its path, `PDSERVE_CLUSTER_SECRET_FILE=/tmp/…/cluster-secret`; a secret from the environment
 * by placeholder), the TLS files as given (paths, not secrets). `env` is the process environment.
 */
export function doctorCredentials(o: Pick<DoctorOptions, 'adminApiKey' | 'ca' | 'internalTlsCert' | 'internalTlsKey' | 'internalTlsCa' | 'clusterSecretFile'>, env: NodeJS.ProcessEnv = process.env): { env: string[]; flags: string[] } {
  const key = o.adminApiKey ?? env.PDSERVE_ADMIN_API_KEY;
  const file = o.clusterSecretFile ?? (env.PDSERVE_CLUSTER_SECRET ? undefined : env.PDSERVE_CLUSTER_SECRET_FILE); // the order doctorSnapshot reads it in
  const secret = file ? [`PDSERVE_CLUSTER_SECRET_FILE=${file}`] : env.PDSERVE_CLUSTER_SECRET ? ['PDSERVE_CLUSTER_SECRET=<the cluster secret>'] : [];
  const flags = [o.ca ? `--ca ${o.ca}` : '', o.internalTlsCert ? `--internal-tls-cert ${o.internalTlsCert}` : '', o.internalTlsKey ? `--internal-tls-key ${o.internalTlsKey}` : '', o.internalTlsCa ? `--internal-tls-ca ${o.internalTlsCa}` : ''];
  return { env: [...secret, ...(key ? ['PDSERVE_ADMIN_API_KEY=<the admin key>'] : [])], flags: flags.filter(Boolean) };
}

/** Bound on one round (gather + diagnose), ms: the answer comes within 10 s. */
const ROUND_MS = 9000;

/** The worker source for the options, or an error message. */
export async function sourceOf(o: Pick<DoctorOptions, 'url' | 'discovery'>): Promise<WorkerSource | string> {
  if (o.url !== undefined && !/^https?:\/\//i.test(o.url)) return `--url ${o.url} has no scheme: give http://${o.url} (or https://)`;
  if (o.discovery) {
    const { parseDiscoveryUrl } = await import('../membership/etcd.js');
    try {
      parseDiscoveryUrl(o.discovery);
    } catch (err) {
      return (err as Error).message;
    }
    const { discoverySource } = await import('../membership/doctor-source.js');
    return discoverySource(o.discovery, o.url ?? null);
  }
  if (!o.url) return 'give --url ROUTER (e.g. --url http://127.0.0.1:8000) or --discovery etcd://HOST:PORT';
  return routerSource(o.url);
}

/** Render a diagnosis for a terminal. */
export function renderDiagnosis(d: Diagnosis, snap: ClusterSnapshot): string {
  const out = [`pdserve doctor · ${snap.source} · ${new Date(snap.at).toISOString()}`, `  ${d.summary}`, ''];
  if (d.findings.length === 0) out.push('OK: nothing wrong found.');
  for (const f of d.findings) {
    out.push(`[${f.severity.toUpperCase()}] ${f.title}`);
    for (const l of f.details) out.push(`    ${l}`);
    out.push(`    likely cause: ${f.cause}`);
    for (const n of f.next) out.push(`    next: ${n}`);
    out.push('');
  }
  return out.join('\n');
}

/**
 * The one dispatcher of all the doctor's GETs (../security/http-auth.ts): the admin key on the
 * router's requests, the workers' requests signed with the cluster secret
 * (`--cluster-secret-file`, PDSERVE_CLUSTER_SECRET, PDSERVE_CLUSTER_SECRET_FILE), the TLS options, and a connect timeout (TCP connect and TLS
 * handshake) of one GET's deadline, so a peer that accepts but never completes a handshake
 * holds neither a round nor the process's exit longer than `--timeout`.
 */
function doctorDispatcher(source: WorkerSource, o: DoctorOptions): Dispatcher {
  const key = o.adminApiKey ?? process.env.PDSERVE_ADMIN_API_KEY?.split(',')[0]?.trim();
  const file = o.clusterSecretFile ?? (process.env.PDSERVE_CLUSTER_SECRET ? undefined : process.env.PDSERVE_CLUSTER_SECRET_FILE);
  const secret = file ? readClusterSecretFile(file) : process.env.PDSERVE_CLUSTER_SECRET;
  const router = source.routerUrl ? [source.routerUrl] : [];
  const tls = doctorTls(o);
  return withCredentials({ ...(key && router.length ? { bearer: { key, origins: router } } : {}), ...(secret ? { sign: { secret, skipOrigins: router } } : {}) }, new Agent({ connect: { timeout: o.timeout, ...(tls ?? {}) } }));
}

/**
 * node:tls client options of the doctor's connections: the CAs of `--ca` and
 * `--internal-tls-ca` together (router and workers), the internal client certificate.
 * @throws Error naming a file that cannot be read.
 */
function doctorTls(o: DoctorOptions): { ca?: Buffer[]; cert?: Buffer; key?: Buffer } | undefined {
  const files: InternalTlsFiles = { ...(o.internalTlsCert ? { cert: o.internalTlsCert } : {}), ...(o.internalTlsKey ? { key: o.internalTlsKey } : {}), ...(o.internalTlsCa ? { ca: o.internalTlsCa } : {}) };
  const internal = loadInternalTls(files);
  let routerCa: Buffer | undefined;
  if (o.ca) {
    try {
      routerCa = readFileSync(o.ca);
    } catch (err) {
      throw new ConfigError(`cannot read the CA file ${o.ca}: ${(err as Error).message}`);
    }
  }
  if (!internal && !routerCa) return undefined;
  const { ca: internalCa, ...client } = internal ? internalClientOptions(internal) : {};
  const ca = [...(routerCa ? [routerCa] : []), ...(internalCa ? [internalCa] : [])];
  return { ...client, ...(ca.length ? { ca } : {}) };
}

async function round(source: WorkerSource, o: DoctorOptions, previous: ClusterSnapshot | null, dispatcher?: Dispatcher): Promise<{ snap: ClusterSnapshot; d: Diagnosis }> {
  let timer: NodeJS.Timeout | undefined;
  const limit = new Promise<never>((_, rej) => {
    timer = setTimeout(() => rej(new PdError('TIMEOUT', `gathering took longer than ${ROUND_MS} ms`)), ROUND_MS);
  });
  try {
    const snap = await Promise.race([gather(source, o.timeout, dispatcher), limit]);
    return { snap, d: diagnose(snap, { slowMs: o.slowMs, windowMs: o.windowMs, previous, routerUrl: source.routerUrl ?? undefined, doctor: doctorCredentials(o) }) };
  } finally {
    clearTimeout(timer);
  }
}

/** Run the doctor; resolves with the exit code (0 ok, 1 warnings, 2 critical, 3 usage/gather error). */
export async function runDoctor(o: DoctorOptions, write: (s: string) => void = (s) => process.stdout.write(s)): Promise<number> {
  const source = await sourceOf(o);
  if (typeof source === 'string') {
    process.stderr.write(`pdserve doctor: ${source}\n`);
    return 3;
  }
  let dispatcher: Dispatcher | undefined;
  try {
    dispatcher = doctorDispatcher(source, o);
  } catch (err) {
    process.stderr.write(`pdserve doctor: ${(err as Error).message}\n`);
    return 3;
  }
  try {
    return await doctorRounds(source, o, write, dispatcher);
  } finally {
    // destroy, not close: a GET past its deadline may still wait on a handshake; nothing is left to read
    await dispatcher?.destroy().catch(() => {});
  }
}

async function doctorRounds(source: WorkerSource, o: DoctorOptions, write: (s: string) => void, dispatcher: Dispatcher | undefined): Promise<number> {
  if (o.request) {
    if (!source.routerUrl) {
      process.stderr.write('pdserve doctor: --request needs --url ROUTER (the router keeps the request traces)\n');
      return 3;
    }
    const r = await requestReport(source.routerUrl!, o.request, o.timeout, dispatcher);
    write(o.json ? `${JSON.stringify(r, null, 2)}\n` : `${renderRequestReport(r)}\n`);
    return r.found ? 0 : 1;
  }
  let previous: ClusterSnapshot | null = null;
  let code = 0;
  const rounds = o.watch ? (o.count ?? Infinity) : 1;
  for (let i = 0; i < rounds; i++) {
    if (i > 0) await new Promise((r) => setTimeout(r, o.watch! * 1000));
    try {
      const { snap, d } = await round(source, o, previous, dispatcher);
      previous = snap;
      code = d.exitCode;
      if (o.json) write(`${JSON.stringify({ exit_code: d.exitCode, summary: d.summary, at: new Date(snap.at).toISOString(), source: snap.source, gather_ms: snap.gatherMs, findings: d.findings })}\n`);
      else write(`${o.watch && process.stdout.isTTY ? '\x1b[2J\x1b[H' : ''}${renderDiagnosis(d, snap)}\n`);
    } catch (err) {
      code = 3;
      write(o.json ? `${JSON.stringify({ exit_code: 3, error: (err as Error).message })}\n` : `pdserve doctor: ${(err as Error).message}\n`);
    }
  }
  return code;
}

function num(v: string): number {
  const n = Number(v);
  if (!Number.isFinite(n) || n <= 0) throw new InvalidArgumentError(`not a positive number: ${v}`);
  return n;
}

/** Add the `doctor` command to the CLI. */
export function addDoctorCommand(program: Command): void {
  program
    .command('doctor')
    .description('diagnose a running cluster: stuck or slow rooms, requests waiting while engines idle, lost or mismatched workers, recent failures; exit 0 ok, 1 warnings, 2 critical')
    .option('--url <router>', 'router URL (its GET /workers lists the workers)')
    .option('--discovery <etcd://HOST:PORT>', 'read the worker list from etcd membership (with --url too: compare it with the router\'s)')
    .option('--request <id>', "print one request's timeline across router, prefill and decode (trace id, rid or room id)")
    .option('--json', 'machine-readable output', false)
    .option('--watch [seconds]', 'repeat every N seconds (default 2) and report counters that moved', (v: string) => num(v))
    .option('--count <n>', 'with --watch: stop after N rounds', (v: string) => Math.floor(num(v)))
    .option('--timeout <ms>', 'deadline of each HTTP GET, ms', (v: string) => num(v), 3000)
    .option('--slow-ms <ms>', 'a room this long in one phase is slow', (v: string) => num(v), 2000)
    .option('--window <minutes>', 'report room failures of the last N minutes', (v: string) => num(v), 5)
    .option('--admin-api-key <key>', "the router's admin key, when it has one (better: PDSERVE_ADMIN_API_KEY, which ps does not show)")
    .option('--ca <file>', "PEM CA of the router's HTTPS certificate (default: the system store)")
    .option('--internal-tls-cert <file>', 'internal TLS: the client certificate (PEM) workers with --internal-tls-ca ask for')
    .option('--internal-tls-key <file>', 'internal TLS: the key of --internal-tls-cert')
    .option('--internal-tls-ca <file>', 'internal TLS: the PEM CA of the https:// workers')
    .option('--cluster-secret-file <file>', 'file holding the cluster secret, to read the workers\' rooms (its first line; or PDSERVE_CLUSTER_SECRET, or PDSERVE_CLUSTER_SECRET_FILE)')
    .action(async (opts: Omit<DoctorOptions, 'windowMs' | 'watch'> & { window: number; watch?: number | true }) => {
      const code = await runDoctor({ ...opts, watch: opts.watch === true ? 2 : opts.watch, windowMs: opts.window * 60_000 });
      process.exitCode = code;
    });
}
