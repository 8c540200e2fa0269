/**
 * A worker that serves either role (prefill or decode) over ONE loaded model and switches between
 * them in place (`pdserve worker --role R`). The process keeps its engine (weights, KV memory and
 * its cached sequences), its HTTP edge and port for life; only the role's own parts change: the
 * room driver and effect executor, prefill's KV bootstrap listener and tokenizer thread, decode's
 * KV peer pool and receive files, and the role's metrics registry.
 *
 * POST /role {role, epoch} (a signed worker request, as every worker route) runs one switch:
 *
 * | step | what | on failure |
 * |---|---|---|
 * | 1 | refuse unless `epoch` is the current one and no switch runs | 409 `role_switch_refused`, nothing changed |
 * | 2 | drain: new work refused (503 `draining`, /health 503: the router takes it out of its pool) | |
 * | 3 | wait until no request is in flight and every room is terminal (prefill rooms whose KV a decode still reads included), at most `drainTimeoutMs` | reopen in the old role: 503 `role_switch_failed`, `safe_to_restore: true` |
 * | 4 | tear down the old role's parts (the engine stays) | |
 * | 5 | build and start the new role's parts under a new epoch | rebuild the old role (new epoch): `safe_to_restore: true`; if that fails too: state `failed`, /health 503, `safe_to_restore: false` |
 * | 6 | reopen: /health and GET /role name the new role and epoch | |
 *
 * A /generate leg carrying the router's role/epoch headers for another role or epoch is refused
 * with `stale_epoch` (../worker/shell.ts). The router verifies GET /role before it routes to the
 * worker in its new role (../router/role-switch.ts).
 *
 * Borrowed: SGLang's `--enable-pd-role-switch` / `POST /pd_role_switch` (drain, tear down the
 * role-specific parts keeping weights and KV memory, rebuild, `safe_to_restore` on failure) and
 * vLLM's role-switch RFC (an epoch per role incarnation; stale-epoch requests refused).
 */
import { readFileSync } from 'node:fs';
import { Counter, Gauge, Registry } from 'prom-client';
import { z } from 'zod';
import type { FastifyInstance } from 'fastify';
import { ApiError, PdError, toApiError } from '../base/errors.js';
import { systemClock } from '../base/clock.js';
import type { Logger } from '../base/log.js';
import type { DecodeConfig, PrefillConfig } from '../config/config.js';
import type { Engine } from '../engine/types.js';
import type { FilePrefixStore } from '../prefixes/prefix-store.js';
import { drainGateOf, sendError } from '../worker/http.js';
import { serveWorkerEdge, type RoleEdgeParts, type WorkerEdge, type WorkerIdentity } from '../worker/shell.js';
import { PrefillWorker } from '../prefill/worker.js';
import { drainedForSwitch } from './drain.js';
import { DecodeWorker } from '../decode/worker.js';

export type SwitchRole = 'prefill' | 'decode';

/** Body of POST /role. `epoch`: the epoch the caller saw (GET /role); another one is refused. */
export const RoleSwitchRequestSchema = z.object({ role: z.enum(['prefill', 'decode']), epoch: z.string().min(1).max(100).optional() }).strict();

/** A switch's outcome as POST /role answers it (`status`: HTTP status). */
export interface RoleSwitchAnswer {
  status: number;
  body: Record<string, unknown>;
}

/**
 * TEST-ONLY fault injection (never set it in production): read at each switch, `build` makes
 * building the new role fail (the worker goes back to its old role); `both` makes rebuilding the
 * old role fail too (the worker is left `failed`); null: no fault.
 */
export type SwitchFault = 'build' | 'both' | null;

/** The fault of `PDSERVE_FAULT_ROLE_SWITCH_FILE` (TEST-ONLY): the file's content, `build` or `both`, when it exists. */
export function switchFaultFromFile(path: string | undefined): () => SwitchFault {
  if (!path) return () => null;
  return () => {
    try {
      const v = readFileSync(path, 'utf8').trim();
      return v === 'build' || v === 'both' ? v : null;
    } catch {
      return null;
    }
  };
}

export interface RoleHostOptions {
  /** Prefill's configuration (the edge's shared fields — host, port, secret, … — are read from it). */
  prefill: PrefillConfig;
  decode: DecodeConfig;
  /** The one engine both roles use. */
  engine: Engine;
  /** The host prefix store, when one is open: its events and metrics follow the serving role. */
  store?: FilePrefixStore;
  /** Longest wait for the drain of a switch, ms. */
  drainTimeoutMs: number;
  log: Logger;
  /** TEST-ONLY: the fault to inject into the next switch (see `SwitchFault`). */
  fault?: () => SwitchFault;
}

type RoleWorker = PrefillWorker | DecodeWorker;

/** A worker process that hosts one role at a time over one engine (see the module doc). */
export class RoleHost {
  private worker!: RoleWorker;
  private parts!: RoleEdgeParts;
  private edge!: WorkerEdge;
  private state: WorkerIdentity['state'] = 'serving';
  /** The edge's own metrics (auth, GPU, switches); the serving role's registry is appended to /metrics. */
  readonly registry = new Registry();
  private readonly switches: Counter<'to' | 'outcome'>;
  /** Switches answered so far (tests). */
  switchesDone = 0;

  constructor(private readonly o: RoleHostOptions) {
    this.switches = new Counter({ name: 'pdserve_role_switches_total', help: 'Role switches by target role and outcome (ok; drain_timeout, build_failed: back in the old role; failed: left unhealthy; refused)', labelNames: ['to', 'outcome'], registers: [this.registry] });
    const host = this;
    new Gauge({ name: 'pdserve_role_switching', help: 'Whether a role switch is running (1) or not (0)', registers: [this.registry], collect() { this.set(host.state === 'switching' ? 1 : 0); } });
  }

  get app(): FastifyInstance {
    return this.edge.app;
  }

  get url(): string {
    return this.edge.url;
  }

  /** The KV bootstrap port: prefill's listener while it serves prefill, else the configured one it will listen on. */
  get bootstrapPort(): number {
    return this.worker instanceof PrefillWorker ? this.worker.bootstrapPort : this.o.prefill.bootstrapPort;
  }

  /** The role serving now. */
  get role(): SwitchRole {
    return this.worker instanceof PrefillWorker ? 'prefill' : 'decode';
  }

  get epoch(): string {
    return this.worker.epoch;
  }

  /** GET /role's answer. */
  identity(): WorkerIdentity {
    const w = this.worker;
    return { role: this.role, epoch: w.epoch, switchable: true, state: this.state, bootstrap_host: w instanceof PrefillWorker ? w.config.bootstrapHost : null, bootstrap_port: w instanceof PrefillWorker ? w.bootstrapPort : null };
  }

  /**
   * Build the first role, start its parts, then the HTTP edge over whichever role serves.
   * @throws the listen errors of the HTTP or bootstrap port
   */
  async start(role: SwitchRole): Promise<void> {
    const w = this.build(role);
    const internalTls = await w.startRole();
    this.install(w);
    const c = this.o.prefill;
    const live = () => this.parts;
    this.edge = await serveWorkerEdge({
      ...this.parts,
      engine: this.o.engine,
      tokenize: true,
      config: c,
      internalTls,
      log: this.o.log,
      registry: this.registry,
      space: undefined,
      spaceNow: () => this.worker.space,
      identity: () => this.identity(),
      switchRole: (body) => this.switchRole(body),
      metricsText: async () => `${await this.registry.metrics()}\n${await this.worker.metrics.registry.metrics()}`,
      kvEventsNow: () => this.worker.kvEvents,
      health: () => ({ ...(live().health?.() ?? {}), ...(this.state === 'failed' ? { role_switch_failed: true } : {}) }),
      liveRooms: () => live().liveRooms(),
      requests: () => { const p = live(); return p.requests?.() ?? p.liveRooms(); },
      queues: () => live().queues(),
      debugRooms: () => ({ role: this.role, state: this.state, ...(live().debugRooms() as object) }),
      onSignedProbe: (q) => live().onSignedProbe?.(q),
      generate: async (body, reply) => {
        if (this.state !== 'serving') return sendError(reply, ApiError.of('stale_epoch', `this worker is ${this.state === 'failed' ? 'broken by a failed role switch' : 'switching role'}: run the request elsewhere`));
        return live().generate(body, reply);
      },
      abort: (rid, room, cause) => live().abort(rid, room, cause),
      tick: () => live().tick(),
    });
    this.o.log.info({ url: this.url, role, epoch: this.epoch }, 'switchable worker ready');
  }

  /** Stop: fail what is left, close the edge, the role's parts and the engine. Idempotent. */
  async close(): Promise<void> {
    this.edge?.stop();
    this.worker?.effects.shutdown();
    await this.edge?.app.close().catch(() => {});
    await this.worker?.closeRole().catch(() => {});
    await this.o.engine.dispose();
  }

  /** POST /role: parse, refuse or run one switch (see the module doc); never throws. */
  async switchRole(raw: unknown): Promise<RoleSwitchAnswer> {
    const parsed = RoleSwitchRequestSchema.safeParse(raw);
    if (!parsed.success) return this.refuse(null, ApiError.of('invalid_request', `POST /role wants {role: 'prefill'|'decode', epoch?: string}: ${parsed.error.issues.map((i) => `${i.path.join('.')}: ${i.message}`).join('; ')}`));
    const { role, epoch } = parsed.data;
    if (this.state === 'switching') return this.refuse(role, ApiError.of('role_switch_refused', 'a role switch is already running on this worker'));
    if (this.state === 'failed') return this.refuse(role, ApiError.of('role_switch_refused', 'this worker was left broken by a failed role switch: restart it'));
    if (epoch !== undefined && epoch !== this.epoch) return this.refuse(role, ApiError.of('role_switch_refused', `stale epoch ${epoch}: this worker's epoch is ${this.epoch} (GET /role)`));
    if (role === this.role) return { status: 200, body: { ...this.identity(), switched: false } };
    return this.run(role);
  }

  private refuse(role: SwitchRole | null, err: ApiError): RoleSwitchAnswer {
    this.switches.inc({ to: role ?? 'unknown', outcome: 'refused' });
    return { status: err.status, body: err.toBody() as unknown as Record<string, unknown> };
  }

  private async run(role: SwitchRole): Promise<RoleSwitchAnswer> {
    const clock = systemClock;
    const t0 = clock.nowMs();
    const from = this.role;
    const previous = this.epoch;
    const gate = drainGateOf(this.edge.app);
    const log = this.o.log.child({ part: 'role-switch', from, to: role });
    this.state = 'switching';
    gate?.startDraining();
    log.info({ epoch: previous, inflight: gate?.inflight ?? 0, rooms: this.parts.liveRooms() }, 'role switch: draining');
    const drained = await this.drained(t0 + this.o.drainTimeoutMs);
    const drainMs = Math.round(clock.nowMs() - t0);
    if (!drained) {
      this.state = 'serving';
      gate?.reopen();
      this.switches.inc({ to: role, outcome: 'drain_timeout' });
      log.warn({ drain_ms: drainMs, inflight: gate?.inflight ?? 0, rooms: this.parts.liveRooms() }, 'role switch: the drain did not finish in time; serving the old role again');
      return this.failure(ApiError.of('role_switch_failed', `the drain did not finish within ${this.o.drainTimeoutMs} ms: still ${from}`), true, drainMs);
    }
    const old = this.worker;
    await old.closeRole().catch((err: unknown) => log.warn({ err: (err as Error)?.message }, 'role switch: closing the old role failed'));
    let next: RoleWorker | undefined;
    const fault = this.o.fault?.() ?? null;
    try {
      if (fault === 'build' || fault === 'both') throw new PdError('internal_error', 'injected fault (PDSERVE_FAULT_ROLE_SWITCH): building the new role fails');
      next = this.build(role);
      await next.startRole();
    } catch (err) {
      await next?.closeRole().catch(() => {});
      const why = toApiError(err).message;
      log.warn({ err: why }, 'role switch: building the new role failed; rebuilding the old one');
      let back: RoleWorker | undefined;
      try {
        if (fault === 'both') throw new PdError('internal_error', 'injected fault (PDSERVE_FAULT_ROLE_SWITCH): rebuilding the old role fails');
        back = this.build(from);
        await back.startRole();
      } catch (err2) {
        await back?.closeRole().catch(() => {});
        this.state = 'failed';
        this.switches.inc({ to: role, outcome: 'failed' });
        log.error({ err: toApiError(err2).message }, 'role switch: rebuilding the old role failed too; this worker takes no work until restarted');
        return this.failure(ApiError.of('role_switch_failed', `building ${role} failed (${why}) and rebuilding ${from} failed (${toApiError(err2).message}): restart this worker`), false, drainMs);
      }
      this.install(back);
      this.state = 'serving';
      gate?.reopen();
      this.switches.inc({ to: role, outcome: 'build_failed' });
      return this.failure(ApiError.of('role_switch_failed', `building ${role} failed (${why}): serving ${from} again under a new epoch`), true, drainMs);
    }
    this.install(next);
    this.state = 'serving';
    gate?.reopen();
    this.switches.inc({ to: role, outcome: 'ok' });
    this.switchesDone++;
    const switchMs = Math.round(clock.nowMs() - t0);
    log.info({ epoch: this.epoch, previous_epoch: previous, drain_ms: drainMs, switch_ms: switchMs }, 'role switch: done');
    return { status: 200, body: { ...this.identity(), switched: true, previous_role: from, previous_epoch: previous, drain_ms: drainMs, switch_ms: switchMs } };
  }

  /** 503 role_switch_failed with SGLang's `safe_to_restore` (true: serving again, in the old role) and where the worker stands. */
  private failure(err: ApiError, safeToRestore: boolean, drainMs: number): RoleSwitchAnswer {
    return { status: err.status, body: { ...(err.toBody() as unknown as Record<string, unknown>), safe_to_restore: safeToRestore, ...this.identity(), drain_ms: drainMs } };
  }

  /** Wait until no work request is in flight and no room is live, polling every 10 ms until `deadline` (monotonic ms). */
  private async drained(deadline: number): Promise<boolean> {
    const gate = drainGateOf(this.edge.app);
    for (;;) {
      if (drainedForSwitch({ inflight: gate?.inflight ?? 0, liveRooms: this.parts.liveRooms() })) return true;
      const left = deadline - systemClock.nowMs();
      if (left <= 0) return false;
      await new Promise((r) => setTimeout(r, Math.min(10, left)));
    }
  }

  private build(role: SwitchRole): RoleWorker {
    const log = this.o.log.child({ role });
    const w = role === 'prefill' ? new PrefillWorker(this.o.prefill, this.o.engine, log) : new DecodeWorker(this.o.decode, this.o.engine, log);
    return w;
  }

  /** Make `w` the serving role: its parts behind the edge, its space's metrics on its registry, the store's events into its log. */
  private install(w: RoleWorker): void {
    this.worker = w;
    this.parts = w.edgeParts();
    w.space.registerMetrics(w.metrics.registry);
    this.storeOff?.();
    const store = this.o.store;
    if (store) {
      this.storeOff = store.onEvent((e) => w.kvEvents.publish(e));
      store.registerMetrics(w.metrics.registry, (hit) => w.prefixMetrics.recordTier('store', hit));
    }
  }

  private storeOff: (() => void) | undefined;
}

/**
 * Parse `raw` as both roles' configuration (one object: the fields of either role), load the
 * engine once (`slots` sequences, the prefix cache and store when configured; the store writes
 * when decode-local continuation is on, as a decode worker's does), start role `role`.
 * @throws PdError('invalid_config') on a bad configuration; the engine's and the listen errors
 */
export async function startSwitchableWorker(raw: unknown, role: SwitchRole, o: { drainTimeoutMs: number; log: Logger }): Promise<RoleHost> {
  const { parseConfig, PrefillConfigSchema, DecodeConfigSchema, prefixCacheOf } = await import('../config/config.js');
  const { openPrefixStore } = await import('../prefixes/prefix-store.js');
  const { loadEngine } = await import('../engine/index.js');
  const prefill = parseConfig(PrefillConfigSchema, raw);
  const decode = parseConfig(DecodeConfigSchema, raw);
  const log = o.log;
  const store = openPrefixStore(decode.engine, decode.stateDir, { write: decode.localPrefillMaxTokens > 0, maxFileBytes: decode.maxStateBytes, log });
  const engine = await loadEngine({ ...decode.engine, sequences: decode.slots, prefixCache: prefixCacheOf(decode.engine), ...(store ? { prefixStore: store } : {}), log: (level: string, msg: string) => log.debug({ level }, msg) });
  const faultFile = process.env.PDSERVE_FAULT_ROLE_SWITCH_FILE;
  const fault = switchFaultFromFile(faultFile);
  if (faultFile) log.warn({ file: faultFile }, 'PDSERVE_FAULT_ROLE_SWITCH_FILE is set: role switches fail on purpose while it says so (test only)');
  const host = new RoleHost({ prefill, decode, engine, ...(store ? { store } : {}), drainTimeoutMs: o.drainTimeoutMs, log, fault });
  try {
    await host.start(role);
  } catch (err) {
    await engine.dispose().catch(() => {});
    throw err;
  }
  return host;
}
