/**
 * Worker registry: health polling, load accounting and pair selection.
 *
 * - Health: every `intervalMs` each worker's `GET /health` is polled with a `timeoutMs`
 *   deadline (one probe per worker in flight at most). Healthy = HTTP 200, JSON body with
 *   `status: 'ok'` and, when present, `role` equal to the configured role. `model` (string) is
 *   remembered for /v1/models. A worker is skipped after `unhealthyAfter` consecutive failed
 *   probes (timeouts, bad answers), or at once when the connection is refused (by a probe or
 *   while dispatching: `report`); the next successful probe restores it. A healthy
 *   worker that answered a generation request with 200 within the last `intervalMs`
 *   (`noteExchange`) skips its periodic probe — that answer says what the probe would — but at
 *   most MAX_SKIPPED_PROBES polls in a row, so its settings, slots and decode's prefill pool
 *   stay refreshed.
 * - Load: the router's own count of in-flight requests per worker. `acquire()` returns a
 *   `Lease` whose `release()` decrements exactly once (later calls are no-ops returning false).
 * - Draining: a worker whose /health says `status: 'draining'` (or that refused a request with
 *   the `draining` error, see ../runtime/drain.ts) is never picked again until it reports 'ok'.
 * - Membership: the pool starts from the configured workers; `upsert()` / `remove()` change it at
 *   run time (the etcd watcher in ./discovery/ calls them), and an upsert is probed at once.
 * - Selection: least-loaded healthy, non-draining worker of a role; ties broken round-robin.
 */
import { request, type Dispatcher } from 'undici';
import { systemClock } from '../base/clock.js';
import type { Logger } from 'pino';
import type { PairSettings } from '../kv/messages.js';
import type { RouterConfig } from './config.js';
import { mismatchOf, routerMismatch, settingsFromHealth } from './pair-settings.js';
import { gpuFromHealth, UNKNOWN_GPU } from '../engine/gpu.js';
import { toolSyntaxFromHealth } from '../api/tool-calls.js';
import type { WorkerRole, WorkerState } from './worker-state.js';
import { IMPLIED_PROTOCOL } from '../base/version.js';
export type { WorkerRole, WorkerState };

/** Most periodic probes in a row a worker skips for its recent successful exchanges (then one is sent anyway). */
export const MAX_SKIPPED_PROBES = 4;

/** JSON row of GET /workers. */
export interface WorkerSnapshot {
  role: WorkerRole;
  url: string;
  bootstrap_host: string | null;
  bootstrap_port: number | null;
  healthy: boolean;
  draining: boolean;
  /** Why the worker is alive but takes no new work (its /health `degraded`: `state_dir_full: …`), else null. */
  degraded: string | null;
  model: string | null;
  load: number;
  last_error: string | null;
  last_check_at: string | null;
  consecutive_failures: number;
  settings: PairSettings | null;
  /** The worker's build (`<version>+<commit>`, from its settings), null when not reported. */
  build: string | null;
  /** The worker's protocol (`MAJOR.MINOR`; 1.0 when its settings do not say), null before a probe. */
  protocol: string | null;
  /** Why the worker counts as frozen (a request's stream on it went silent: its requests migrated), until a probe finds it healthy; else null. */
  frozen: string | null;
  /** The worker's epoch (/health), null before a probe. */
  epoch: string | null;
  /** It can switch role in place (`pdserve worker`). */
  switchable: boolean;
  /** Why it is out of the pool for a role switch, else null. */
  switching: string | null;
  /** Why no healthy worker of the other role can pair with this one (settings differ), else null. */
  mismatch: string | null;
  /** GPU backend (null = CPU only or not reported), device names and offloaded layers ("3/3"). */
  gpu: string | null;
  gpu_devices: string[];
  gpu_layers: string | null;
}

/** A held unit of load on one worker. `release()` is idempotent; true only on the first call. */
/** What a request saw go wrong with a worker: the input of `WorkerRegistry.report` (`err`: what the transport threw; `why`: the silence seen). */
export type WorkerFailure = { kind: 'draining' } | { kind: 'unauthenticated' } | { kind: 'unreachable'; err: unknown } | { kind: 'connection_lost'; err: unknown } | { kind: 'frozen'; why: string };

export interface Lease {
  readonly worker: WorkerState;
  readonly released: boolean;
  release(): boolean;
}

export interface RegistryOptions {
  /** Dispatcher for /health probes (a small control-plane undici Agent). */
  dispatcher: Dispatcher;
  log: Logger;
  intervalMs: number;
  timeoutMs: number;
  /** Consecutive failed probes before a healthy worker is skipped (default 2). */
  unhealthyAfter?: number;
}

const MAX_HEALTH_BODY = 64 * 1024;

/** A worker to add to the pool (the discovery record's routing part). */
export interface WorkerSpec {
  role: WorkerRole;
  url: string;
  bootstrapHost?: string | null;
  bootstrapPort?: number | null;
}

export class WorkerRegistry {
  private pool: WorkerState[];
  /** Totals over the registry's life; acquired − released = Σ load. For tests and /workers. */
  acquiredTotal = 0;
  releasedTotal = 0;
  private readonly rr: Record<WorkerRole, number> = { prefill: 0, decode: 0 };
  private readonly probing = new Set<WorkerState>();
  /** Per worker probing now: settles when that probe has. */
  private readonly inflight = new Map<WorkerState, Promise<void>>();
  /** Probes asked for while one was in flight: run again when it settles (a restart must not wait a poll). */
  private readonly recheck = new Set<WorkerState>();
  private readonly warnedBootstrap = new Set<WorkerState>();
  /** Per worker: monotonic ms of its last successful exchange (noteExchange), periodic probes skipped in a row. */
  private readonly exchanged = new WeakMap<WorkerState, { at: number; skipped: number }>();
  /** Periodic probes skipped so far (tests, /debug). */
  skippedProbes = 0;
  private timer: NodeJS.Timeout | null = null;
  private stopped = false;
  /** Called when `upsert()` adds a worker that was not in the pool (membership: a join). */
  onAdded: ((w: WorkerState) => void) | null = null;
  /** Called when `remove()` drops a worker (e.g. to forget it in a routing policy's state). */
  onRemoved: ((w: WorkerState) => void) | null = null;
  /** Called when a probe finds a worker healthy that was not (e.g. to clear what its failures left). */
  onRecovered: ((w: WorkerState) => void) | null = null;
  private readonly probeAc = new AbortController();

  constructor(
    config: Pick<RouterConfig, 'prefill' | 'decode'>,
    private readonly opts: RegistryOptions,
  ) {
    const base = { healthy: false, draining: false, model: null, load: 0, lastError: 'not probed yet', lastCheckAt: 0, consecutiveFailures: 0, settings: null };
    this.pool = [
      ...config.prefill.map((p): WorkerState => ({ role: 'prefill', url: p.url, bootstrapHost: p.bootstrapHost, bootstrapPort: p.bootstrapPort, ...base })),
      ...config.decode.map((d): WorkerState => ({ role: 'decode', url: d.url, bootstrapHost: null, bootstrapPort: null, ...base })),
    ];
  }

  /** The pool now (a copy-on-write array: safe to iterate while workers come and go). */
  get workers(): readonly WorkerState[] {
    return this.pool;
  }

  /**
   * Add a worker, or update its bootstrap address if its URL is known, then probe it at once
   * (so a registered worker is routable within one probe round trip, not the next poll).
   * Returns the worker's state.
   */
  upsert(spec: WorkerSpec): WorkerState {
    let w = this.pool.find((x) => x.url === spec.url);
    if (w && w.role !== spec.role) {
      this.remove(spec.url, `re-registered as ${spec.role}`);
      w = undefined;
    }
    let newAddress = false;
    if (!w) {
      w = { role: spec.role, url: spec.url, bootstrapHost: spec.bootstrapHost ?? null, bootstrapPort: spec.bootstrapPort ?? null, healthy: false, draining: false, model: null, load: 0, lastError: 'not probed yet', lastCheckAt: 0, consecutiveFailures: 0, settings: null };
      this.pool = [...this.pool, w];
      this.opts.log.info({ worker: w.url, role: w.role }, 'worker joined');
      this.onAdded?.(w);
      newAddress = w.role === 'prefill';
    } else if (spec.bootstrapPort != null && (w.bootstrapPort !== spec.bootstrapPort || w.bootstrapHost !== (spec.bootstrapHost ?? null))) {
      (w as { bootstrapHost: string | null }).bootstrapHost = spec.bootstrapHost ?? null;
      (w as { bootstrapPort: number | null }).bootstrapPort = spec.bootstrapPort;
      newAddress = true;
    }
    // A new prefill address: the decodes' probes name it (the pool they may dial) before the
    // prefill's own probe makes it routable.
    const target = w;
    if (newAddress) void Promise.all(this.pool.filter((d) => d.role === 'decode').map((d) => this.check(d, true))).then(() => this.check(target, true));
    else void this.check(w, true);
    return w;
  }

  /**
   * Drop a worker from the pool (membership says it is gone). Requests in flight on it keep
   * their `WorkerState` and finish or fail on their own. False when the URL was not in the pool.
   */
  remove(url: string, reason: string): boolean {
    const w = this.pool.find((x) => x.url === url);
    if (!w) return false;
    this.pool = this.pool.filter((x) => x !== w);
    w.healthy = false;
    w.lastError = `removed: ${reason}`;
    this.opts.log.info({ worker: url, role: w.role, reason }, 'worker left');
    this.onRemoved?.(w);
    return true;
  }

  /** Mark `w` degraded with `reason` (or not: null): a degraded worker is never picked. */
  setDegraded(w: WorkerState, reason: string | null): void {
    if ((w.degraded ?? null) !== reason) {
      if (reason) this.opts.log.warn({ worker: w.url, role: w.role, reason }, 'worker degraded: no new requests go to it');
      else if (w.degraded) this.opts.log.info({ worker: w.url, role: w.role }, 'worker no longer degraded');
    }
    w.degraded = reason;
  }

  /** Take `w` out of the pool for a role switch (`why`), or put it back (null): draining while switching, whatever its probes say. */
  setSwitching(w: WorkerState, why: string | null): void {
    w.switching = why;
    this.setDraining(w, why !== null);
  }

  /** Mark `w` draining (or not): a draining worker is never picked. */
  setDraining(w: WorkerState, draining: boolean): void {
    if (w.draining !== draining) this.opts.log.info({ worker: w.url, role: w.role }, draining ? 'worker draining: no new requests go to it' : 'worker no longer draining');
    w.draining = draining;
  }

  /** Probe every worker once (awaited), then keep polling every intervalMs until `stop()`. */
  async start(): Promise<void> {
    await this.checkAll();
    this.schedule();
  }

  stop(): void {
    this.stopped = true;
    if (this.timer) clearTimeout(this.timer);
    this.timer = null;
    this.probeAc.abort();
  }

  private schedule(): void {
    if (this.stopped) return;
    this.timer = setTimeout(() => {
      void this.pollAll().finally(() => this.schedule());
    }, this.opts.intervalMs);
    this.timer.unref();
  }

  /**
   * The query of a decode worker's health probe: `?prefill_pool=host:port,…`, the bootstrap
   * addresses of every prefill in the pool (at most 256), which decode alone may dial
   * (src/decode/known-prefills.ts; the probe is signed, so the pool is the router's).
   */
  private poolQuery(): string {
    const addrs = this.workers.filter((x) => x.role === 'prefill' && x.bootstrapHost && x.bootstrapPort).slice(0, 256).map((x) => `${x.bootstrapHost!.includes(':') ? `[${x.bootstrapHost}]` : x.bootstrapHost}:${x.bootstrapPort}`);
    return addrs.length ? `?prefill_pool=${encodeURIComponent(addrs.join(','))}` : '';
  }

  /** Probe all workers concurrently; resolves when every probe settled. Never rejects. */
  async checkAll(): Promise<void> {
    await Promise.all(this.workers.map((w) => this.check(w)));
  }

  /**
   * `w` answered a request with 200 just now (dispatch: a /generate response's head): its next
   * periodic probe may be skipped (see Health in the module doc).
   */
  noteExchange(w: WorkerState): void {
    const e = this.exchanged.get(w);
    if (e) e.at = systemClock.nowMs();
    else this.exchanged.set(w, { at: systemClock.nowMs(), skipped: 0 });
  }

  /** The periodic poll: every worker, except a healthy one with a successful exchange within intervalMs (MAX_SKIPPED_PROBES in a row at most). */
  private pollAll(): Promise<void> {
    const now = systemClock.nowMs();
    return Promise.all(
      this.workers.map((w) => {
        const e = this.exchanged.get(w);
        if (e && w.healthy && !w.draining && now - e.at < this.opts.intervalMs && e.skipped < MAX_SKIPPED_PROBES) {
          e.skipped++;
          this.skippedProbes++;
          return undefined;
        }
        if (e) e.skipped = 0;
        return this.check(w);
      }),
    ).then(() => {});
  }

  /** Probe one worker. A probe already in flight is not doubled; with `again` one more runs when it settles. Never rejects. */
  async check(w: WorkerState, again = false): Promise<void> {
    if (this.stopped) return;
    if (this.probing.has(w)) {
      if (again) this.recheck.add(w);
      return;
    }
    this.probing.add(w);
    let settled!: () => void;
    this.inflight.set(w, new Promise<void>((r) => (settled = r)));
    try {
      const signal = AbortSignal.any([AbortSignal.timeout(this.opts.timeoutMs), this.probeAc.signal]);
      const res = await request(`${w.url}/health${w.role === 'decode' ? this.poolQuery() : ''}`, { method: 'GET', dispatcher: this.opts.dispatcher, signal, headersTimeout: this.opts.timeoutMs, bodyTimeout: this.opts.timeoutMs });
      const text = await readText(res.body, MAX_HEALTH_BODY);
      let j: Record<string, unknown> | null = null;
      try {
        j = JSON.parse(text) as Record<string, unknown>;
      } catch {
        // judged below
      }
      if (j?.status === 'draining' && (j.role === undefined || j.role === w.role)) {
        // Alive and finishing its work: not a failure, but no new requests.
        this.setDraining(w, true);
        w.lastCheckAt = systemClock.wallMs();
        return;
      }
      if (res.statusCode !== 200) return this.probeFailed(w, `GET /health: HTTP ${res.statusCode}`);
      if (j === null) return this.probeFailed(w, 'GET /health: body is not JSON');
      this.setDegraded(w, j.status === 'degraded' ? (Array.isArray(j.degraded) ? j.degraded.filter((x): x is string => typeof x === 'string').join('; ').slice(0, 500) : '') || 'degraded' : null);
      if (j?.status !== 'ok' && j?.status !== 'degraded') return this.probeFailed(w, `GET /health: status ${JSON.stringify(j?.status)}`);
      if (j.role !== undefined && j.role !== w.role) {
        // Another role (switched behind the router's back, or a misconfiguration): never routed as this one, from the first such answer.
        w.consecutiveFailures = Math.max(w.consecutiveFailures, (this.opts.unhealthyAfter ?? 2) - 1);
        return this.probeFailed(w, `GET /health: role is ${JSON.stringify(j.role)}, expected '${w.role}'`);
      }
      if (typeof j.epoch === 'string') w.epoch = j.epoch;
      w.switchable = j.role_switch === true;
      if (w.role === 'prefill' && typeof j.bootstrap_port === 'number' && j.bootstrap_port !== w.bootstrapPort && !this.warnedBootstrap.has(w)) {
        this.warnedBootstrap.add(w);
        this.opts.log.warn({ worker: w.url, configured: w.bootstrapPort, reported: j.bootstrap_port }, 'prefill reports a different bootstrap_port than configured; decode will dial the configured one');
      }
      w.settings = settingsFromHealth(j.settings) ?? w.settings;
      w.gpu = gpuFromHealth(j.gpu) ?? w.gpu;
      if (typeof j.slots === 'number' && Number.isSafeInteger(j.slots) && j.slots > 0) w.slots = j.slots;
      // a worker the router is switching stays out of the pool whatever its probe says (./role-switch.ts)
      this.setDraining(w, !!w.switching);
      if (w.role === 'prefill') w.toolSyntax = toolSyntaxFromHealth(j.tool_call_syntax);
      if (Array.isArray(j.served_model_names)) w.servedNames = j.served_model_names.filter((n: unknown): n is string => typeof n === 'string').slice(0, 16);
      this.setHealthy(w, typeof j.model === 'string' ? j.model : null);
    } catch (err) {
      if (this.stopped) return;
      if (isUnreachable(err)) this.report(w, { kind: 'unreachable', err });
      else this.probeFailed(w, `GET /health: ${describeError(err)}`);
    } finally {
      this.probing.delete(w);
      this.inflight.delete(w);
      settled();
      if (this.recheck.delete(w)) void this.check(w);
    }
  }

  /**
   * Probe `w` now and resolve once a probe that started after this call settled (one in flight
   * is waited out first): the router asks after a failure that names a condition of the worker
   * (`state_dir_full`) before it picks again. Never rejects.
   */
  async refresh(w: WorkerState): Promise<void> {
    for (let i = 0; i < 3 && this.inflight.has(w); i++) await this.inflight.get(w);
    await this.check(w);
  }

  /** Record a successful probe. */
  setHealthy(w: WorkerState, model: string | null): void {
    const recovered = !w.healthy;
    if (recovered) this.opts.log.info({ worker: w.url, role: w.role, model }, 'worker healthy');
    if (w.frozen) this.opts.log.info({ worker: w.url, role: w.role }, 'frozen worker answers again');
    w.frozen = null;
    w.healthy = true;
    w.servedOnce = true;
    w.model = model ?? w.model;
    w.lastError = null;
    w.lastCheckAt = systemClock.wallMs();
    w.consecutiveFailures = 0;
    if (recovered) this.onRecovered?.(w);
  }

  /** A failed probe: the worker is skipped once `unhealthyAfter` probes failed in a row. */
  probeFailed(w: WorkerState, reason: string): void {
    if (w.healthy && w.consecutiveFailures + 1 < (this.opts.unhealthyAfter ?? 2)) {
      w.consecutiveFailures++;
      w.lastError = reason;
      w.lastCheckAt = systemClock.wallMs();
      this.opts.log.debug({ worker: w.url, role: w.role, reason, failures: w.consecutiveFailures }, 'health probe failed');
      return;
    }
    this.setUnhealthy(w, reason);
  }

  /**
   * THE health write of a request's failure on `w` (the router's attempts report here, nothing
   * else writes worker health from a request): `draining` — out of new picks; `unauthenticated`
   * (refused the router's signed request), `unreachable` (connection refused, DNS, connect
   * timeout), `connection_lost` (closed or reset mid-request: it most likely died), `frozen` (its
   * stream went silent past the bound) — unhealthy until the next good probe.
   */
  report(w: WorkerState, failure: WorkerFailure): void {
    switch (failure.kind) {
      case 'draining':
        return this.setDraining(w, true);
      case 'unauthenticated':
        return this.setUnhealthy(w, "refused the router's signed request: another cluster secret?");
      case 'unreachable':
        return this.setUnhealthy(w, `unreachable: ${describeError(failure.err)}`);
      case 'connection_lost':
        return this.setUnhealthy(w, `connection lost mid-request: ${describeError(failure.err)}`);
      case 'frozen':
        w.frozen = failure.why;
        return this.setUnhealthy(w, `frozen: ${failure.why}`);
    }
  }

  /** Mark `w` unhealthy now. */
  setUnhealthy(w: WorkerState, reason: string): void {
    if (w.healthy || w.lastCheckAt === 0) this.opts.log.warn({ worker: w.url, role: w.role, reason }, 'worker unhealthy');
    w.healthy = false;
    w.lastError = reason;
    w.lastCheckAt = systemClock.wallMs();
    w.consecutiveFailures++;
  }

  /** Healthy, non-draining workers of `role`, in pool order (the candidates of a load-balancing policy). */
  candidates(role: WorkerRole): WorkerState[] {
    return this.workers.filter((w) => w.role === role && w.healthy && !w.draining && !w.degraded && routerMismatch(w) === undefined);
  }

  /** Least-loaded healthy, non-draining worker of `role` (ties round-robin), or null when there is none. */
  pick(role: WorkerRole): WorkerState | null {
    let min = Infinity;
    let tied: WorkerState[] = [];
    for (const w of this.workers) {
      if (w.role !== role || !w.healthy || w.draining || w.degraded || routerMismatch(w) !== undefined) continue;
      if (w.load < min) {
        min = w.load;
        tied = [w];
      } else if (w.load === min) {
        tied.push(w);
      }
    }
    if (tied.length === 0) return null;
    const w = tied[this.rr[role] % tied.length]!;
    this.rr[role] = (this.rr[role] + 1) % 1_000_000_007;
    return w;
  }

  /** Take one unit of load on `w`; the returned lease gives it back exactly once. */
  acquire(w: WorkerState): Lease {
    w.load++;
    this.acquiredTotal++;
    let released = false;
    const release = (): boolean => {
      if (released) return false;
      released = true;
      w.load--;
      this.releasedTotal++;
      if (w.load < 0) {
        // Unreachable by construction; kept loud in case a future change breaks the invariant.
        this.opts.log.error({ worker: w.url, load: w.load }, 'worker load went negative');
        w.load = 0;
      }
      return true;
    };
    return {
      worker: w,
      get released() {
        return released;
      },
      release,
    };
  }

  /** Distinct model names reported by workers (healthy ones first). */
  models(): string[] {
    const sorted = [...this.workers].sort((a, b) => Number(b.healthy) - Number(a.healthy));
    return [...new Set(sorted.flatMap((w) => w.servedNames ?? (w.model !== null ? [w.model] : [])))];
  }

  healthyCount(role: WorkerRole): number {
    return this.workers.filter((w) => w.role === role && w.healthy && !w.draining).length;
  }

  snapshot(): WorkerSnapshot[] {
    return this.workers.map((w) => ({
      role: w.role,
      url: w.url,
      bootstrap_host: w.bootstrapHost,
      bootstrap_port: w.bootstrapPort,
      healthy: w.healthy,
      draining: w.draining,
      degraded: w.degraded ?? null,
      model: w.model,
      load: w.load,
      last_error: w.lastError,
      last_check_at: w.lastCheckAt ? new Date(w.lastCheckAt).toISOString() : null,
      consecutive_failures: w.consecutiveFailures,
      frozen: w.frozen ?? null,
      epoch: w.epoch ?? null,
      switchable: w.switchable ?? false,
      switching: w.switching ?? null,
      settings: w.settings,
      build: w.settings?.build ?? null,
      protocol: w.settings ? (w.settings.protocol ?? IMPLIED_PROTOCOL) : null,
      mismatch: mismatchOf(w, this.workers),
      ...(w.gpu ?? UNKNOWN_GPU),
    }));
  }
}

/** Read at most `max` bytes of a body as UTF-8 (the rest is discarded). */
export async function readText(body: AsyncIterable<Uint8Array> & { destroy?(): unknown }, max: number): Promise<string> {
  const parts: Buffer[] = [];
  let n = 0;
  for await (const chunk of body) {
    if (n < max) {
      const c = Buffer.from(chunk.buffer, chunk.byteOffset, Math.min(chunk.length, max - n));
      parts.push(Buffer.from(c));
      n += c.length;
    }
  }
  return Buffer.concat(parts).toString('utf8');
}

/** Short description of a transport error (undici codes kept). */
export function describeError(err: unknown): string {
  const e = err as { code?: unknown; message?: unknown; name?: unknown; cause?: { code?: unknown; message?: unknown } };
  const code = typeof e?.code === 'string' ? e.code : typeof e?.cause?.code === 'string' ? e.cause.code : undefined;
  const msg = typeof e?.message === 'string' ? e.message : String(err);
  if (e?.name === 'TimeoutError') return 'timed out';
  return code && !msg.includes(code) ? `${code}: ${msg}` : msg;
}

const UNREACHABLE = new Set(['ECONNREFUSED', 'ENOTFOUND', 'EHOSTUNREACH', 'ENETUNREACH', 'EAI_AGAIN', 'UND_ERR_CONNECT_TIMEOUT']);

const CLOSED = new Set(['UND_ERR_SOCKET', 'ECONNRESET', 'EPIPE']);

/**
 * True when `err` means an open connection was closed or reset by the other side (undici's
 * `UND_ERR_SOCKET` "other side closed", ECONNRESET, EPIPE). Raised before the response headers,
 * the worker never answered the request.
 */
export function isConnectionClosed(err: unknown): boolean {
  return hasCode(err, CLOSED);
}

/** True when `err` means the worker could not be connected to at all. */
export function isUnreachable(err: unknown): boolean {
  return hasCode(err, UNREACHABLE);
}

function hasCode(err: unknown, codes: ReadonlySet<string>): boolean {
  const e = err as { code?: unknown; cause?: { code?: unknown } };
  return codes.has(String(e?.code)) || codes.has(String(e?.cause?.code));
}
