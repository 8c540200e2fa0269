/**
 * The planner loop: every `tickMs` it reads the pool from the router (GET /workers, admin key)
 * and each routable worker's gauges (GET /metrics), decides (./rules.ts), and carries a flip out
 * through the router (POST /workers/role: out of the pool, drain, rebuild, verify). One flip at a
 * time; ticks while one runs only observe. Every decision is logged (a hold repeating the tick
 * before's reason at debug level) and counted (pdserve_planner_decisions_total{action,reason});
 * `recent` keeps the last ones for GET /status.
 *
 * Runs inside `pdserve up --autoscale` or alone (`pdserve planner --router URL`, for a cluster
 * whose workers are `pdserve worker` processes).
 */
import { createServer, type Server } from 'node:http';
import { Counter, Gauge, Registry } from 'prom-client';
import { PdError } from '../base/errors.js';
import { systemClock } from '../base/clock.js';
import type { Logger } from '../base/log.js';
import { decide, DEFAULT_THRESHOLDS, type Decision, type Thresholds, type WorkerObservation } from './rules.js';

export interface PlannerOptions {
  /** The router's base URL. */
  router: string;
  /** Admin key of the router (Bearer), when it has one. */
  adminKey?: string;
  /** Tick, ms (Dynamo's default: 5 s). */
  tickMs: number;
  thresholds?: Thresholds;
  log: Logger;
  /** Deadline of one HTTP read (the pool, a worker's /metrics), ms. */
  readTimeoutMs?: number;
}

/** A decision with when it was taken and, for a flip, how it ended. */
export interface DecisionRecord extends Decision {
  at: string;
  tick: number;
  outcome?: 'ok' | 'failed';
  detail?: string;
}

const GAUGES = ['pdserve_prefill_queued_tokens', 'pdserve_engine_context_tokens', 'pdserve_decode_running_reqs', 'pdserve_decode_prealloc_queue_reqs', 'pdserve_engine_slots'] as const;

/** The sums of the named samples (every label set) in Prometheus text `text`. */
export function gaugesOf(text: string, names: readonly string[]): Map<string, number> {
  const want = new Set(names);
  const out = new Map<string, number>();
  for (const line of text.split('\n')) {
    if (line.length === 0 || line.startsWith('#')) continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)/.exec(line);
    if (!m || !want.has(m[1]!)) continue;
    const v = Number(m[3]);
    if (Number.isFinite(v)) out.set(m[1]!, (out.get(m[1]!) ?? 0) + v);
  }
  return out;
}

/** The planner (see the module doc). `start()` ticks until `stop()`; `tick()` runs one on its own (tests). */
export class Planner {
  readonly registry = new Registry();
  private readonly decisions: Counter<'action' | 'reason'>;
  private readonly flips: Counter<'to' | 'outcome'>;
  private timer: NodeJS.Timeout | null = null;
  private flip: Promise<void> | null = null;
  private ticks = 0;
  /** The last decisions, newest last (at most 100). */
  readonly recent: DecisionRecord[] = [];

  constructor(private readonly o: PlannerOptions) {
    this.decisions = new Counter({ name: 'pdserve_planner_decisions_total', help: 'Planner decisions by action (to_prefill, to_decode, hold) and reason', labelNames: ['action', 'reason'], registers: [this.registry] });
    this.flips = new Counter({ name: 'pdserve_planner_flips_total', help: 'Role flips the planner asked the router for, by target role and outcome (ok: verified in the new role; failed)', labelNames: ['to', 'outcome'], registers: [this.registry] });
    const self = this;
    new Gauge({ name: 'pdserve_planner_prefill_load', help: "Prefill load at the last tick: queued prompt tokens per context of the routable prefill workers (Dynamo's easy-mode signal)", registers: [this.registry], collect() { const d = self.recent.at(-1); if (d?.prefillLoad != null) this.set(d.prefillLoad); } });
    new Gauge({ name: 'pdserve_planner_decode_load', help: 'Decode load at the last tick: sequences generating plus requests waiting for a slot, per slot of the routable decode workers', registers: [this.registry], collect() { const d = self.recent.at(-1); if (d?.decodeLoad != null) this.set(d.decodeLoad); } });
  }

  /** Tick every `tickMs` until `stop()`. */
  start(): void {
    if (this.timer) return;
    const loop = () => {
      this.timer = setTimeout(() => void this.tick().finally(() => this.timer && loop()), this.o.tickMs);
    };
    this.timer = setTimeout(() => void this.tick().finally(loop), 0);
  }

  /** Stop ticking; resolves once a flip in flight has been answered (the router bounds it). */
  async stop(): Promise<void> {
    if (this.timer) clearTimeout(this.timer);
    this.timer = null;
    await this.flip;
  }

  /** Whether a flip is in flight. */
  get flipping(): boolean {
    return this.flip !== null;
  }

  /** One tick: observe, decide, log and count, start a flip when decided. Never throws. */
  async tick(): Promise<DecisionRecord> {
    const tick = ++this.ticks;
    let ws: WorkerObservation[] = [];
    let error: string | undefined;
    try {
      ws = await this.observe();
    } catch (err) {
      error = (err as Error)?.message ?? String(err);
    }
    const d = error ? { action: 'hold' as const, reason: 'no_data' as const, prefillLoad: null, decodeLoad: null, prefillWorkers: 0, decodeWorkers: 0 } : decide(ws, this.flip !== null, this.o.thresholds ?? DEFAULT_THRESHOLDS);
    const rec: DecisionRecord = { ...d, at: new Date(systemClock.wallMs()).toISOString(), tick, ...(error ? { detail: error } : {}) };
    this.decisions.inc({ action: d.action, reason: d.reason });
    this.recent.push(rec);
    if (this.recent.length > 100) this.recent.shift();
    const fields = { tick, action: d.action, reason: d.reason, worker: d.url ?? null, prefill_load: round(d.prefillLoad), decode_load: round(d.decodeLoad), prefill_workers: d.prefillWorkers, decode_workers: d.decodeWorkers, ...(error ? { err: error } : {}) };
    // a hold for the reason of the tick before is logged at debug (one info line per change, not one per tick); every decision is counted
    const prev = this.recent.at(-2);
    if (d.action === 'hold') (prev?.action === 'hold' && prev.reason === d.reason ? this.o.log.debug.bind(this.o.log) : this.o.log.info.bind(this.o.log))(fields, 'planner: hold');
    else {
      this.o.log.info(fields, `planner: flip ${d.url} ${d.action === 'to_prefill' ? 'decode → prefill' : 'prefill → decode'}`);
      const to = d.action === 'to_prefill' ? 'prefill' : 'decode';
      this.flip = this.switch(d.url!, to, rec).finally(() => {
        this.flip = null;
      });
    }
    return rec;
  }

  private async switch(url: string, role: 'prefill' | 'decode', rec: DecisionRecord): Promise<void> {
    try {
      const res = await fetch(`${this.o.router}/workers/role`, { method: 'POST', headers: this.headers({ 'content-type': 'application/json' }), body: JSON.stringify({ url, role }), signal: AbortSignal.timeout(150_000) });
      const body = (await res.json().catch(() => ({}))) as Record<string, unknown>;
      rec.outcome = res.status === 200 && body.verified === true ? 'ok' : 'failed';
      rec.detail = rec.outcome === 'ok' ? `verified ${role}, epoch ${String(body.epoch)}, ${String(body.ms)} ms` : `HTTP ${res.status}: ${String((body.error as { message?: unknown } | undefined)?.message ?? JSON.stringify(body)).slice(0, 300)}`;
    } catch (err) {
      rec.outcome = 'failed';
      rec.detail = (err as Error)?.message ?? String(err);
    }
    this.flips.inc({ to: role, outcome: rec.outcome });
    (rec.outcome === 'ok' ? this.o.log.info.bind(this.o.log) : this.o.log.warn.bind(this.o.log))({ worker: url, to: role, outcome: rec.outcome, detail: rec.detail }, 'planner: flip answered');
  }

  private headers(h: Record<string, string> = {}): Record<string, string> {
    return this.o.adminKey ? { ...h, authorization: `Bearer ${this.o.adminKey}` } : h;
  }

  /** The pool from the router and each worker's gauges (null gauges when its /metrics failed). */
  async observe(): Promise<WorkerObservation[]> {
    const timeout = this.o.readTimeoutMs ?? 2000;
    const res = await fetch(`${this.o.router}/workers`, { headers: this.headers(), signal: AbortSignal.timeout(timeout) });
    if (res.status !== 200) throw new PdError('bad_worker_answer', `GET ${this.o.router}/workers: HTTP ${res.status}`);
    const j = (await res.json()) as { workers?: { url: string; role: string; healthy: boolean; draining: boolean; switchable?: boolean; switching?: string | null }[] };
    const rows = (j.workers ?? []).filter((w) => w.role === 'prefill' || w.role === 'decode');
    return Promise.all(
      rows.map(async (w): Promise<WorkerObservation> => {
        let g = new Map<string, number>();
        try {
          const m = await fetch(`${w.url}/metrics`, { signal: AbortSignal.timeout(timeout) });
          if (m.status === 200) g = gaugesOf(await m.text(), GAUGES);
        } catch {
          // gauges unknown this tick
        }
        const v = (k: (typeof GAUGES)[number]) => g.get(k) ?? null;
        return { url: w.url, role: w.role as 'prefill' | 'decode', routable: w.healthy && !w.draining, switchable: w.switchable === true, switching: !!w.switching, queuedTokens: v('pdserve_prefill_queued_tokens'), contextTokens: v('pdserve_engine_context_tokens'), running: v('pdserve_decode_running_reqs'), preallocQueue: v('pdserve_decode_prealloc_queue_reqs'), slots: v('pdserve_engine_slots') };
      }),
    );
  }
}

function round(x: number | null): number | null {
  return x === null ? null : Math.round(x * 1000) / 1000;
}

/**
 * Serve the planner's GET /metrics (Prometheus text) and GET /status (the last decisions) on
 * host:port (0 = any free port). Returns the URL and a close function.
 */
export async function servePlanner(p: Planner, host: string, port: number): Promise<{ url: string; server: Server; close(): Promise<void> }> {
  const server = createServer((req, res) => {
    if (req.method === 'GET' && req.url === '/metrics') {
      void p.registry.metrics().then((t) => res.writeHead(200, { 'content-type': p.registry.contentType }).end(t));
      return;
    }
    if (req.method === 'GET' && req.url === '/status') {
      res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify({ flipping: p.flipping, decisions: p.recent.slice(-20) }));
      return;
    }
    res.writeHead(404, { 'content-type': 'application/json' }).end(JSON.stringify({ error: { message: 'GET /metrics or /status', type: 'invalid_request_error', param: null, code: 'not_found' } }));
  });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(port, host, () => resolve());
  });
  const a = server.address();
  const url = `http://${host}:${typeof a === 'object' && a ? a.port : port}`;
  return { url, server, close: () => new Promise<void>((r) => server.close(() => r())) };
}
