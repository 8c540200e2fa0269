/**
 * A local pdserve cluster as child processes on loopback: N prefill + M decode workers and a
 * router, each a real `pdserve <role>` process. Used by `pdserve up`, `pdserve storm`, the bench
 * suite and the end-to-end tests. Ports are chosen up front so a killed worker restarts on the
 * same address (peers and the router find it again with no manual step).
 *
 * The cluster secret reaches the children by environment (never argv), and from `start()` on
 * this process's fetch() and undici calls sign their requests to the workers with it
 * (../security/http-auth.ts `signGlobally`), so tools and tests reach them as the router does.
 *
 * Children report readiness over an IPC channel ({type:'ready', url, bootstrapPort}) and exit
 * when that channel closes, so a dead parent leaves no orphans.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { closeSync, existsSync, mkdirSync, mkdtempSync, openSync, readdirSync, rmSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { PdError } from '../base/errors.js';
import { reachGlobally, signGlobally } from '../security/http-auth.js';
import { STORE_USER_FILE } from '../prefixes/prefix-store.js';
import { processAlive } from '../runtime/statefiles.js';
import { internalClientOptions, internalTlsArgs, loadInternalTls, type InternalTlsFiles } from '../security/tls.js';
import { startLocalEtcd, type LocalEtcd } from './etcd.js';

export type ProcRole = 'prefill' | 'decode' | 'router' | 'colocated';

/**
 * Keys and PEM files that lock a cluster started without access or TLS options of its own: an
 * API key and an admin key on the router and the colocated server, HTTPS on both with
 * `pki.cert`/`pki.key`, and internal mutual TLS between the roles under `pki.ca`. The test
 * harness's secure mode hands one in (test/helpers/secure-mode.ts); `pdserve up` never does
 * (it has its own --api-key and TLS flags).
 */
export interface ClusterLock {
  apiKey: string;
  adminKey: string;
  /** PEM paths (absolute), and the CA read, for this process's own calls. */
  pki: { ca: string; cert: string; key: string; pem: { ca: Buffer } };
  /** The key a request to `path` on the router or colocated server sends (the admin key on admin routes). */
  keyFor(path: string): string;
}

export interface ClusterOptions {
  model: string;
  prefill?: number;
  decode?: number;
  /** Router port (0 = any free port). */
  port?: number;
  /**
   * Fixed worker ports instead of random free ones: prefill i gets HTTP `base + 2i` and bootstrap
   * `base + 2i + 1`; decode j gets `base + 2·prefill + j`; the colocated server the next one.
   */
  workerPortBase?: number;
  /** `--drain-timeout-ms` of every process (their default: 30000). */
  drainTimeoutMs?: number;
  /** `--discovery etcd://HOST:PORT` of every process: workers register, the router watches. */
  discovery?: string;
  /**
   * Routers in front of the same workers (default 1): router 0 is named `router` and binds `port`,
   * router i `router-i` on `port + i` (free ports when `port` is 0 or unset). More than one needs
   * etcd: without `discovery` the cluster starts a local one (./etcd.ts).
   */
  routers?: number;
  /** With `discovery`: false = the router gets no --prefill/--decode flags (etcd is its only source). */
  staticWorkers?: boolean;
  /**
   * Per-process address and Linux network namespace, by process name (`prefill-0`, `decode-1`,
   * `colocated`, `router`): the process binds `host` and runs under `ip netns exec <netns>`
   * (the multi-host tests). Needs fixed ports (`workerPortBase`, `port`): free ports cannot be
   * probed from here in another namespace.
   */
  placement?: Record<string, { host: string; netns?: string }>;
  host?: string;
  threads?: number;
  ctxSize?: number;
  batchSize?: number;
  /** Batch-invariant inference in every engine (`--deterministic`). */
  deterministic?: boolean;
  decodeSlots?: number;
  prefillSlots?: number;
  secret?: string;
  /** Folder for one log file per process; undefined = logs discarded unless PDSERVE_LOG_LEVEL is set, then inherited. */
  logDir?: string;
  /** Extra flags per role, e.g. {decode: ['--heartbeat-ms', '200']}. */
  extraArgs?: Partial<Record<ProcRole, string[]>>;
  /** Extra flags of one process by name ('prefill-0', 'decode-1', …), after its role's. */
  extraArgsOf?: Record<string, string[]>;
  /** Extra environment for all children. */
  env?: Record<string, string>;
  /** Flags of every child's node before the entry script, e.g. `['--cpu-prof', '--cpu-prof-dir=…']` (flags NODE_OPTIONS refuses). */
  nodeArgs?: string[];
  /**
   * Client access of the router: keys go to it by environment
   * (PDSERVE_API_KEY, PDSERVE_ADMIN_API_KEY), never argv; `routerArgs` are extra router flags
   * (--api-key-file, --private-metrics). The harness's own admin calls use the admin key (else an API key).
   */
  access?: { apiKeys?: string[]; adminApiKeys?: string[]; routerArgs?: string[]; /** The router serves HTTPS (its url is https://). */ tls?: boolean };
  /**
   * Internal TLS of the prefill, decode and router processes (`--internal-tls-cert/-key/-ca`,
   * absolute paths): the workers serve HTTPS (their urls are https://) and a KV channel over
   * TLS, mutual with a CA. This process reaches the workers with the same CA and certificate.
   */
  internalTls?: InternalTlsFiles;
  /** Run locked with these keys and certificates (see `ClusterLock`); ignored when `access` or `internalTls` is given. */
  lock?: ClusterLock;
  /** Per-process start deadline, ms. */
  startTimeoutMs?: number;
  /** Also start a colocated reference server. */
  colocated?: boolean;
  /**
   * Pin a role's processes to CPUs by running them under `taskset -c <list>` (Linux; e.g.
   * {prefill: '0', decode: '1'}). Roles not listed run unpinned.
   */
  cpuAffinity?: Partial<Record<ProcRole, string>>;
  /**
   * `--prefix-store-dir` of every worker (the host-wide prefix store). Default: a fresh folder
   * under /dev/shm (`pdserve-cluster-store-<pid>-<random>`), removed by stop(), so two clusters
   * (tests, benchmark runs) never see each other's entries; start() first removes those of dead
   * clusters (`sweepDeadClusterStores`).
   */
  prefixStoreDir?: string;
  /**
   * Start the workers as `pdserve worker --role R` (one model, switchable in place: the router's
   * POST /workers/role, the planner); each gets a bootstrap port, decodes too (their prefill port
   * after a switch).
   */
  switchable?: boolean;
}

export interface ClusterProc {
  role: ProcRole;
  index: number;
  name: string;
  port: number;
  bootstrapPort?: number;
  url: string;
  args: string[];
  child?: ChildProcess;
  /** True while the harness expects the process to be dead (killed on purpose). */
  expectedDown: boolean;
  /** Exits nobody asked for: {code, signal, at}. */
  unexpectedExits: { code: number | null; signal: NodeJS.Signals | null; at: number }[];
  /** The latest exit of the process, asked for or not (undefined while it never exited). */
  lastExit?: { code: number | null; signal: NodeJS.Signals | null; at: number };
  logFile?: string;
}

const here = dirname(fileURLToPath(import.meta.url));
/** Path of bin/pdserve.js, from src/harness or dist/harness. */
export const BIN = join(here, '..', '..', 'bin', 'pdserve.js');

/** Ports freePort handed out lately (never handed out twice in a row; bounded). */
const handedOut = new Set<number>();
const HANDED_OUT_MAX = 4096;

/**
 * A port that was free a moment ago (listen on 0, close), never one this process handed out
 * lately. Another process may still take it before it is bound (the kernel hands the same range
 * to outgoing connections): `Cluster.start` re-picks on a child's `port_in_use`.
 */
export async function freePort(host = '127.0.0.1'): Promise<number> {
  for (;;) {
    const p = await new Promise<number>((resolve, reject) => {
      const s = createServer();
      s.once('error', reject);
      s.listen(0, host, () => {
        const a = s.address();
        const port = typeof a === 'object' && a ? a.port : 0;
        s.close(() => resolve(port));
      });
    });
    if (handedOut.has(p)) continue;
    if (handedOut.size >= HANDED_OUT_MAX) handedOut.delete(handedOut.values().next().value as number);
    handedOut.add(p);
    return p;
  }
}

/** A child that exited at start-up because its port was taken (it says so over IPC). */
class PortInUseError extends PdError {
  constructor(message: string) {
    super('PORT_IN_USE', message);
  }
}

/** A prefix store folder a cluster made: `pdserve-cluster-store-<owner pid>-<random>`. */
const CLUSTER_STORE = /^pdserve-cluster-store-(\d+)-[A-Za-z0-9]+$/;

/**
 * Remove the prefix store folders in `parent` made by clusters whose process is gone (a killed
 * `up` cannot remove its own) and used by no live process (no user file of a live pid inside).
 * Folders named without a pid are left alone.
 * @returns the folders removed. Never throws.
 */
export function sweepDeadClusterStores(parent: string): string[] {
  let names: string[];
  try {
    names = readdirSync(parent);
  } catch {
    return [];
  }
  const removed: string[] = [];
  for (const name of names) {
    const m = CLUSTER_STORE.exec(name);
    if (!m || processAlive(Number(m[1]))) continue;
    const dir = join(parent, name);
    try {
      if (readdirSync(dir).some((f) => { const u = STORE_USER_FILE.exec(f); return u !== null && processAlive(Number(u[1])); })) continue;
      rmSync(dir, { recursive: true, force: true });
      removed.push(dir);
    } catch {
      /* not a folder, or gone meanwhile */
    }
  }
  return removed;
}

/** Start and supervise a cluster. `start()` resolves when every process answered ready. */
export class Cluster {
  readonly procs: ClusterProc[] = [];
  readonly secret: string;
  readonly host: string;
  /** Client keys of the router (`ClusterOptions.access`). */
  readonly access: { apiKeys: string[]; adminApiKeys: string[] };
  private stopping = false;
  /** The workers' prefix store folder; `ownStoreDir`: made here, removed by stop(). */
  private storeDir: string | undefined;
  private ownStoreDir = false;
  private unsign?: () => void;
  private unreach?: () => void;
  private readonly unreachExtra: (() => void)[] = [];
  /** The lock's keys and CA (`ClusterOptions.lock`), when it applies to this cluster. */
  readonly kit: ClusterLock | undefined;
  readonly opts: ClusterOptions;
  /** `--discovery` of every process: the given one, or the local etcd's (`routers` > 1). */
  discovery: string | undefined;
  /** The etcd this cluster started (`routers` > 1 without `discovery`). */
  private etcd: LocalEtcd | undefined;

  /**
   * With `lock` and neither `access` nor `internalTls` given, the cluster runs locked: API and
   * admin keys, HTTPS on the router and the colocated server, internal mutual TLS.
   */
  constructor(opts: ClusterOptions) {
    this.kit = opts.lock && !opts.access && !opts.internalTls ? opts.lock : undefined;
    const k = this.kit;
    const tlsArgs = k ? ['--tls-cert', k.pki.cert, '--tls-key', k.pki.key] : [];
    this.opts = k
      ? { ...opts, access: { apiKeys: [k.apiKey], adminApiKeys: [k.adminKey], routerArgs: tlsArgs, tls: true }, internalTls: { cert: k.pki.cert, key: k.pki.key, ca: k.pki.ca }, extraArgs: { ...opts.extraArgs, colocated: [...tlsArgs, ...(opts.extraArgs?.colocated ?? [])] } }
      : opts;
    this.discovery = opts.discovery;
    this.secret = opts.secret ?? randomBytes(24).toString('hex');
    this.host = opts.host ?? '127.0.0.1';
    this.access = { apiKeys: [...(this.opts.access?.apiKeys ?? [])], adminApiKeys: [...(this.opts.access?.adminApiKeys ?? [])] };
  }

  /** The key the harness's own admin calls (/workers/probe) send: the admin key, else an API key, else none. */
  get adminKey(): string | undefined {
    return this.access.adminApiKeys[0] ?? this.access.apiKeys[0];
  }

  /**
   * Environment of one child: the cluster secret, and the client keys for the router (the keys
   * of this process's own environment reach no other child: a colocated reference stays open).
   */
  private envOf(role: ProcRole): Record<string, string> {
    const env: Record<string, string> = { PDSERVE_CLUSTER_SECRET: this.secret, PDSERVE_API_KEY: '', PDSERVE_ADMIN_API_KEY: '' };
    // Locked: the colocated reference is locked like the router.
    if (role === 'router' || (role === 'colocated' && this.kit)) {
      if (this.access.apiKeys.length) env.PDSERVE_API_KEY = this.access.apiKeys.join(',');
      if (this.access.adminApiKeys.length) env.PDSERVE_ADMIN_API_KEY = this.access.adminApiKeys.join(',');
    }
    return env;
  }

  /**
   * How a process of `role` started outside this cluster joins it (a second router over some of
   * its workers, a worker started by hand): `args` are the flags the cluster's own process of that
   * role gets for access and TLS (router: client TLS and internal TLS; workers: internal TLS;
   * colocated: client TLS when locked), `env` the cluster secret and, for a router, its
   * client keys (by environment, never argv; a router: the workers' model too, for exact routing), `scheme` the scheme of its url. Reach a router or
   * colocated server started so from this process with `reach(url)`.
   */
  joinerOf(role: ProcRole): { args: string[]; env: Record<string, string>; scheme: 'http' | 'https' } {
    const o = this.opts;
    const itls = role !== 'colocated' ? o.internalTls : undefined;
    const args = role === 'router' ? ['--model', o.model, ...(o.access?.routerArgs ?? []), ...internalTlsArgs(itls)] : role === 'colocated' ? (this.kit ? ['--tls-cert', this.kit.pki.cert, '--tls-key', this.kit.pki.key] : []) : internalTlsArgs(itls);
    return { args, env: this.envOf(role), scheme: this.schemeOf(role) };
  }

  /** The scheme of a `role` process's url: https with client TLS (router, colocated in secure mode) or internal TLS (workers). */
  private schemeOf(role: ProcRole): 'http' | 'https' {
    if (role === 'router') return this.opts.access?.tls ? 'https' : 'http';
    if (role === 'colocated') return this.kit ? 'https' : 'http';
    return this.opts.internalTls ? 'https' : 'http';
  }

  /**
   * From now on this process's fetch() and undici calls to `url` (a router or colocated server
   * started with `joinerOf`) send the keys and trust the CA as they do for the cluster's own
   * (when locked; a no-op otherwise). Undone by `stop()`, or earlier by the returned undo.
   */
  reach(url: string): () => void {
    const k = this.kit;
    if (!k) return () => {};
    const undo = reachGlobally([url], { bearer: k.keyFor, tls: { ca: k.pki.pem.ca } });
    this.unreachExtra.push(undo);
    return undo;
  }

  get router(): ClusterProc {
    return this.procs.find((p) => p.role === 'router')!;
  }
  get colocated(): ClusterProc | undefined {
    return this.procs.find((p) => p.role === 'colocated');
  }
  byRole(role: ProcRole): ClusterProc[] {
    return this.procs.filter((p) => p.role === role);
  }

  private engineArgs(): string[] {
    const o = this.opts;
    const a = ['--model', o.model, '--threads', String(o.threads ?? 1)];
    if (o.ctxSize) a.push('--ctx-size', String(o.ctxSize));
    if (o.batchSize) a.push('--batch-size', String(o.batchSize));
    if (o.deterministic) a.push('--deterministic');
    if (this.storeDir) a.push('--prefix-store-dir', this.storeDir);
    return a;
  }

  /** Ports of the workers in start order (see `workerPortBase`). */
  workerPorts(): number[] {
    const o = this.opts;
    const n = 2 * (o.prefill ?? 1) + (o.switchable ? 2 : 1) * (o.decode ?? 1) + (o.colocated ? 1 : 0);
    return o.workerPortBase === undefined ? [] : Array.from({ length: n }, (_, i) => o.workerPortBase! + i);
  }

  async start(): Promise<void> {
    const o = this.opts;
    if ((o.routers ?? 1) > 1 && !this.discovery) {
      this.etcd = await startLocalEtcd({ host: this.host, dir: o.logDir ?? mkdtempSync(join(tmpdir(), 'pdserve-up-')), ports: () => freePort(this.host) });
      this.discovery = this.etcd.uri;
    }
    if (!this.storeDir) {
      const parent = existsSync('/dev/shm') ? '/dev/shm' : tmpdir();
      // the folders of clusters killed before they could remove theirs (the pid in the name says whose)
      if (o.prefixStoreDir === undefined) sweepDeadClusterStores(parent);
      this.storeDir = o.prefixStoreDir ?? mkdtempSync(join(parent, `pdserve-cluster-store-${process.pid}-`));
      this.ownStoreDir = o.prefixStoreDir === undefined;
    }
    const fixed = this.workerPorts();
    const nextPort = async () => fixed.shift() ?? freePort(this.host);
    for (let i = 0; i < (o.prefill ?? 1); i++) {
      const h = this.hostOf(`prefill-${i}`);
      const port = await nextPort();
      const bootstrapPort = await nextPort();
      const args = [...(o.switchable ? ['worker', '--role', 'prefill'] : ['prefill']), ...this.engineArgs(), '--host', h, '--port', String(port), '--bootstrap-port', String(bootstrapPort), '--bootstrap-host', h];
      const slots = o.switchable ? (o.decodeSlots ?? o.prefillSlots) : o.prefillSlots;
      if (slots !== undefined) args.push('--slots', String(slots));
      this.procs.push(this.proc('prefill', i, port, [...args, ...(o.extraArgs?.prefill ?? [])], bootstrapPort));
    }
    for (let i = 0; i < (o.decode ?? 1); i++) {
      const port = await nextPort();
      const h = this.hostOf(`decode-${i}`);
      const bootstrapPort = o.switchable ? await nextPort() : undefined;
      const args = [...(o.switchable ? ['worker', '--role', 'decode', '--bootstrap-port', String(bootstrapPort), '--bootstrap-host', h] : ['decode']), ...this.engineArgs(), '--host', h, '--port', String(port)];
      if (o.decodeSlots !== undefined) args.push('--slots', String(o.decodeSlots));
      this.procs.push(this.proc('decode', i, port, [...args, ...(o.extraArgs?.decode ?? [])], bootstrapPort));
    }
    if (o.colocated) {
      const port = await nextPort();
      const args = ['colocated', ...this.engineArgs(), '--host', this.hostOf('colocated'), '--port', String(port)];
      if (o.decodeSlots !== undefined) args.push('--slots', String(o.decodeSlots));
      this.procs.push(this.proc('colocated', 0, port, [...args, ...(o.extraArgs?.colocated ?? [])]));
    }
    const workers = [...this.procs];
    await Promise.all(workers.map((p) => this.spawnFirst(p, this.workerPorts().length === 0)));
    // This process's fetch() and undici calls sign their requests to the workers (SECURITY.md);
    // after the start, which may have moved a worker to other ports.
    const itls = loadInternalTls(o.internalTls);
    this.unsign = signGlobally(workers.filter((p) => p.role === 'prefill' || p.role === 'decode').map((p) => p.url), this.secret, itls ? internalClientOptions(itls) : undefined);
    const statics = !this.discovery || o.staticWorkers !== false;
    const routers: ClusterProc[] = [];
    for (let i = 0; i < (o.routers ?? 1); i++) {
      const name = i === 0 ? 'router' : `router-${i}`;
      const rport = o.port === undefined || o.port === 0 ? await freePort(this.host) : o.port + i;
      // the router tokenizes with the workers' own GGUF (exact routing on the blocks they hold)
      const rargs = ['router', '--host', this.hostOf(name), '--port', String(rport), '--model', o.model];
      for (const p of statics ? this.byRole('prefill') : []) rargs.push('--prefill', `${p.url},${p.bootstrapPort}`);
      for (const p of statics ? this.byRole('decode') : []) rargs.push('--decode', p.url);
      const router = this.proc('router', i, rport, [...rargs, ...(o.access?.routerArgs ?? []), ...(o.extraArgs?.router ?? [])]);
      this.procs.push(router);
      routers.push(router);
    }
    await Promise.all(routers.map((r) => this.spawnFirst(r, o.port === undefined || o.port === 0)));
    // Locked: this process's calls to the client edges send the keys and trust the CA.
    const k = this.kit;
    if (k) this.unreach = reachGlobally([...routers.map((r) => r.url), ...(this.colocated ? [this.colocated.url] : [])], { bearer: k.keyFor, tls: { ca: k.pki.pem.ca } });
  }

  /**
   * First start of `p`: when its ports were picked here (`auto`) and another process took one
   * before the child bound it, pick new ones and start again (3 tries). Restarts (`spawn`) keep
   * their ports: the router knows them.
   */
  private async spawnFirst(p: ClusterProc, auto: boolean): Promise<void> {
    for (let attempt = 1; ; attempt++) {
      try {
        return await this.spawn(p);
      } catch (err) {
        if (!(err instanceof PortInUseError) || !auto || attempt >= 3) throw err;
        const swap = async (flag: string) => {
          const i = p.args.indexOf(flag);
          if (i < 0) return undefined;
          const port = await freePort(this.host);
          p.args[i + 1] = String(port);
          return port;
        };
        p.port = (await swap('--port')) ?? p.port;
        if (p.bootstrapPort !== undefined) {
          p.bootstrapPort = (await swap('--bootstrap-port')) ?? p.bootstrapPort;
        }
        p.url = p.url.replace(/:\d+$/, `:${p.port}`);
      }
    }
  }

  private proc(role: ProcRole, index: number, port: number, args: string[], bootstrapPort?: number): ClusterProc {
    if (this.opts.drainTimeoutMs !== undefined) args = [...args, '--drain-timeout-ms', String(this.opts.drainTimeoutMs)];
    if (this.discovery) args = [...args, '--discovery', this.discovery];
    const name = role === 'colocated' || (role === 'router' && index === 0) ? role : `${role}-${index}`;
    const itls = role !== 'colocated' ? this.opts.internalTls : undefined;
    args = [...args, ...internalTlsArgs(itls), ...(this.opts.extraArgsOf?.[name] ?? [])];
    return { role, index, name, port, bootstrapPort, url: `${this.schemeOf(role)}://${this.hostOf(name)}:${port}`, args, expectedDown: false, unexpectedExits: [] };
  }

  /** The address process `name` binds (its placement, else the cluster's host). */
  hostOf(name: string): string {
    return this.opts.placement?.[name]?.host ?? this.host;
  }

  /** Spawn (or respawn) one process and wait for its ready message. */
  async spawn(p: ClusterProc): Promise<void> {
    const o = this.opts;
    let out: number | 'ignore' | 'inherit' = process.env.PDSERVE_LOG_LEVEL ? 'inherit' : 'ignore';
    if (o.logDir) {
      mkdirSync(o.logDir, { recursive: true });
      p.logFile = join(o.logDir, `${p.name}.log`);
      out = openSync(p.logFile, 'a');
    }
    const cpus = o.cpuAffinity?.[p.role];
    const ns = o.placement?.[p.name]?.netns;
    const node = [process.execPath, ...(o.nodeArgs ?? []), BIN, ...p.args];
    const full = [...(ns ? ['ip', 'netns', 'exec', ns] : []), ...(cpus ? ['taskset', '-c', cpus] : []), ...node];
    const [cmd, argv]: [string, string[]] = [full[0]!, full.slice(1)];
    const child = spawn(cmd, argv, {
      stdio: ['ignore', out, out, 'ipc'],
      env: { ...process.env, ...this.envOf(p.role), ...(o.env ?? {}) },
    });
    if (typeof out === 'number') closeSync(out);
    p.child = child;
    p.expectedDown = false;
    child.on('exit', (code, signal) => {
      if (p.child === child) p.child = undefined;
      p.lastExit = { code, signal, at: Date.now() };
      if (!p.expectedDown && !this.stopping) p.unexpectedExits.push({ code, signal, at: Date.now() });
    });
    const deadline = o.startTimeoutMs ?? 60_000;
    await new Promise<void>((resolve, reject) => {
      const t = setTimeout(() => fail(new PdError('START_FAILED', `${p.name} did not become ready within ${deadline} ms${p.logFile ? ` (log: ${p.logFile})` : ''}`)), deadline);
      const onMsg = (m: unknown) => {
        const msg = m as { type?: string; reason?: string; message?: string };
        if (msg?.type === 'ready') done();
        if (msg?.type === 'start_failed' && msg.reason === 'port_in_use') fail(new PortInUseError(`${p.name}: ${msg.message ?? 'port in use'}`));
      };
      const onExit = (code: number | null, signal: string | null) => fail(new PdError('START_FAILED', `${p.name} exited (${code ?? signal}) before it was ready${p.logFile ? ` (log: ${p.logFile})` : ''}`));
      const done = () => {
        clearTimeout(t);
        child.off('message', onMsg);
        child.off('exit', onExit);
        resolve();
      };
      const fail = (e: Error) => {
        clearTimeout(t);
        child.off('message', onMsg);
        child.off('exit', onExit);
        child.kill('SIGKILL');
        reject(e);
      };
      child.on('message', onMsg);
      child.once('exit', onExit);
    });
    if (p.role === 'prefill' || p.role === 'decode') await this.nudgeRouter(p);
  }

  /**
   * A (re)started worker is ready: ask the router to probe it now (POST /workers/probe) instead of
   * at its next health poll, so it is routable within a probe round trip. No-op before the
   * router exists; failures are ignored (the poll still finds it).
   */
  private async nudgeRouter(p: ClusterProc): Promise<void> {
    const r = this.procs.find((x) => x.role === 'router');
    if (!r?.child) return;
    try {
      const key = this.adminKey;
      const res = await fetch(`${r.url}/workers/probe`, { method: 'POST', headers: { 'content-type': 'application/json', ...(key ? { authorization: `Bearer ${key}` } : {}) }, body: JSON.stringify({ url: p.url }), signal: AbortSignal.timeout(1000) });
      await res.body?.cancel();
    } catch {
      // the router is down or busy: its poll will find the worker
    }
  }

  /** Send a signal on purpose (the storm's faults). SIGKILL/SIGTERM mark the process as expected down. */
  signal(p: ClusterProc, sig: NodeJS.Signals): void {
    if (sig === 'SIGKILL' || sig === 'SIGTERM') p.expectedDown = true;
    p.child?.kill(sig);
  }

  /** Kill with SIGKILL and wait for the exit. */
  async kill(p: ClusterProc): Promise<void> {
    const c = p.child;
    if (!c) return;
    p.expectedDown = true;
    const exited = new Promise<void>((r) => c.once('exit', () => r()));
    c.kill('SIGKILL');
    await exited;
  }

  /** Kill (if alive) and start again on the same ports. */
  async restart(p: ClusterProc): Promise<void> {
    await this.kill(p);
    await this.spawn(p);
  }

  /**
   * Graceful stop: SIGTERM the router and wait for it to drain and exit, then the workers (which
   * by then have nothing in flight). A process still alive `graceMs` after its SIGTERM is killed.
   * `force()` (e.g. on a 2nd Ctrl-C) SIGTERMs every process again, which makes them stop waiting.
   * Then the prefix store folder it made goes, as in `stop()`.
   */
  async drain(graceMs: number): Promise<void> {
    this.stopping = true;
    await Promise.all(this.procs.filter((p) => p.role === 'router').map((p) => this.terminate(p, graceMs)));
    await Promise.all(this.procs.filter((p) => p.role !== 'router').map((p) => this.terminate(p, graceMs)));
    this.removeOwnStore();
    await this.etcd?.stop();
  }

  /** Remove the prefix store folder this cluster made (none given to it); a store it was given stays. */
  private removeOwnStore(): void {
    if (this.ownStoreDir && this.storeDir) rmSync(this.storeDir, { recursive: true, force: true });
  }

  /** During `drain()`: signal every live process again (they stop waiting and fail what is left). */
  force(): void {
    for (const p of this.procs) p.child?.kill('SIGTERM');
  }

  /** SIGTERM everything at once (processes drain what they have), SIGKILL after `graceMs`. Idempotent. */
  async stop(graceMs = 3000): Promise<void> {
    this.stopping = true;
    await Promise.all(this.procs.map((p) => this.terminate(p, graceMs)));
    this.removeOwnStore();
    await this.etcd?.stop();
    this.unsign?.();
    this.unreach?.();
    for (const undo of this.unreachExtra.splice(0)) undo();
  }

  /** SIGCONT + SIGTERM one process; SIGKILL if it is still alive after `graceMs`. Resolves on exit. */
  private async terminate(p: ClusterProc, graceMs: number): Promise<void> {
    const c = p.child;
    if (!c) return;
    p.expectedDown = true;
    const exited = new Promise<void>((r) => c.once('exit', () => r()));
    c.kill('SIGCONT');
    c.kill('SIGTERM');
    const t = setTimeout(() => c.kill('SIGKILL'), graceMs);
    await exited;
    clearTimeout(t);
  }
}
