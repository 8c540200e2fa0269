/**
 * The router's diagnostic endpoints:
 *
 *   GET /dashboard              live dashboard (assets/dashboard/index.html; charts by uPlot,
 *                               served from node_modules — no CDN)
 *   GET /dashboard/assets/:f    the page's script and styles (a fixed list)
 *   GET /dashboard/data         JSON the page polls every 2 s: workers and their state, queues,
 *                               rooms by phase, the time series (src/router/dashboard-series.ts),
 *                               the prefix-store card (src/router/dashboard-prefix.ts),
 *                               recent failures by reason, and the doctor's findings
 *   GET /debug/traces           recent request traces, newest first (?active=1: in flight only;
 *                               ?limit=N, default 50, at most 500)
 *   GET /debug/traces/:id       one trace by trace id or rid (404 when unknown)
 *   GET /debug/rooms            every worker's GET /debug/rooms, fetched now (signed with the
 *                               cluster secret, ROOMS_TIMEOUT_MS each, all at once):
 *                               {workers: [{role, url, error, rooms}]}, rooms = the worker's body
 *                               or null with the error (unreachable, refused, timed out)
 *
 * /dashboard/data gathers the workers' /health, /metrics and /debug/rooms with the doctor's code
 * (src/observe/gather.ts, 1.5 s deadline per GET) at most once a second, however many pages poll.
 */
import { readFile } from 'node:fs/promises';
import { kvEventSummary } from './kv-events.js';
import { prefixStoreCard } from './dashboard-prefix.js';
import { systemClock } from '../base/clock.js';
import { createRequire } from 'node:module';
import type { FastifyInstance } from 'fastify';
import type { Dispatcher } from 'undici';
import { ApiError } from '../api/errors.js';
import { diagnose, failureLabel } from '../observe/diagnose.js';
import { fetchText, probeWorker, type ClusterSnapshot, type DebugRooms, type Fetched, type RouterProbe, type WorkerProbe } from '../observe/gather.js';
import { gpuFromHealth } from '../engine/gpu.js';
import type { DashboardSeries } from './dashboard-series.js';
import type { RouterMetrics } from './metrics.js';
import type { WorkerRegistry } from './registry.js';
import type { TraceStore } from './trace.js';

export interface DiagnosticsDeps {
  registry: WorkerRegistry;
  metrics: RouterMetrics;
  traces: TraceStore;
  series: DashboardSeries;
  /** Requests being served now. */
  inflight(): number;
  /** This router's base URL as a client reaches it (for the doctor's suggested commands). */
  selfUrl(): string;
  /** Dispatcher of the workers' GETs (signed with the cluster secret). */
  dispatcher?: Dispatcher;
}

const ASSET_DIR = new URL('../../assets/dashboard/', import.meta.url);
const require = createRequire(import.meta.url);
const ASSETS: Record<string, { path: () => string | URL; type: string }> = {
  'app.js': { path: () => new URL('app.js', ASSET_DIR), type: 'text/javascript; charset=utf-8' },
  'app.css': { path: () => new URL('app.css', ASSET_DIR), type: 'text/css; charset=utf-8' },
  'uPlot.iife.min.js': { path: () => require.resolve('uplot/dist/uPlot.iife.min.js'), type: 'text/javascript; charset=utf-8' },
  'uPlot.min.css': { path: () => require.resolve('uplot/dist/uPlot.min.css'), type: 'text/css; charset=utf-8' },
};

const ok = <T>(body: T): Fetched<T> => ({ ok: true, status: 200, ms: 0, error: null, body });

/** Deadline of each worker's GET /debug/rooms behind the router's, ms. */
export const ROOMS_TIMEOUT_MS = 1500;

/** Register the dashboard and trace routes on the router's fastify app. */
export function registerDiagnostics(app: FastifyInstance, d: DiagnosticsDeps): void {
  const cache = new Map<string, Buffer>();
  const asset = async (name: string): Promise<Buffer> => {
    let b = cache.get(name);
    if (!b) {
      b = await readFile(ASSETS[name]!.path());
      cache.set(name, b);
    }
    return b;
  };

  app.get('/dashboard', async (_req, reply) => {
    const html = await readFile(new URL('index.html', ASSET_DIR));
    return reply.header('content-type', 'text/html; charset=utf-8').header('cache-control', 'no-store').send(html);
  });
  app.get<{ Params: { file: string } }>('/dashboard/assets/:file', async (req, reply) => {
    const a = ASSETS[req.params.file];
    if (!a) throw ApiError.of('not_found', `no dashboard asset ${req.params.file}`);
    return reply.header('content-type', a.type).header('cache-control', 'max-age=300').send(await asset(req.params.file));
  });

  app.get<{ Querystring: { active?: string; limit?: string } }>('/debug/traces', async (req) => {
    const limit = Math.min(500, Math.max(1, Number(req.query.limit ?? 50) || 50));
    const all = d.traces.recent(d.traces.max);
    const rows = req.query.active === '1' || req.query.active === 'true' ? all.filter((t) => t.outcome === null) : all;
    return { traces: rows.slice(0, limit) };
  });
  app.get<{ Params: { id: string } }>('/debug/traces/:id', async (req) => {
    const t = d.traces.get(req.params.id);
    if (!t) throw ApiError.of('trace_not_found', `no recent request with trace id or rid ${req.params.id}`);
    return t;
  });

  // Workers answer /debug/rooms to signed requests only: the router's dispatcher signs them.
  app.get('/debug/rooms', async () => {
    const rows = d.registry.snapshot() as unknown as { role: string; url: string }[];
    const workers = await Promise.all(
      rows.map(async (r) => {
        const f = await fetchText<DebugRooms>(`${r.url}/debug/rooms`, ROOMS_TIMEOUT_MS, (t) => JSON.parse(t) as DebugRooms, d.dispatcher);
        const said = (f.body as { error?: { message?: unknown } } | null)?.error?.message;
        return { role: r.role, url: r.url, error: f.ok ? null : `${f.error}${typeof said === 'string' ? `: ${said}` : ''}`, rooms: f.ok ? f.body : null };
      }),
    );
    return { workers };
  });

  let last: { at: number; body: unknown } | null = null;
  let running: Promise<unknown> | null = null;
  const build = async (): Promise<unknown> => {
    const at = systemClock.wallMs();
    const t0 = systemClock.nowMs();
    const rows = d.registry.snapshot() as unknown as Record<string, unknown>[];
    const workers: WorkerProbe[] = await Promise.all(rows.map((r) => probeWorker({ role: r.role as 'prefill' | 'decode', url: r.url as string, router: r }, 1500, d.dispatcher)));
    const router: RouterProbe = {
      url: d.selfUrl(),
      health: ok({ inflight: d.inflight() }),
      workers: ok({ workers: rows }),
      metrics: ok([]),
      traces: ok({ traces: d.traces.recent(200).filter((t) => t.outcome === null) }),
    };
    const snap: ClusterSnapshot = { at, gatherMs: Math.round(systemClock.nowMs() - t0), source: 'router', router, workers };
    const diag = diagnose(snap, { routerUrl: d.selfUrl() });
    const roomsByPhase: Record<string, number> = {};
    const roomFailures = new Map<string, number>();
    const view = workers.map((w) => {
      const h = w.health.body ?? {};
      const live = w.rooms.body?.live ?? [];
      const phases: Record<string, number> = {};
      for (const r of live) {
        phases[r.phase] = (phases[r.phase] ?? 0) + 1;
        roomsByPhase[`${w.ref.role} ${r.phase}`] = (roomsByPhase[`${w.ref.role} ${r.phase}`] ?? 0) + 1;
      }
      const now = w.rooms.body?.now ?? at;
      for (const r of w.rooms.body?.recent ?? []) {
        const end = r.timeline?.[r.timeline.length - 1]?.at ?? 0;
        if (r.state === 'Failed' && now - end <= 300_000) {
          const k = `${w.ref.role}: ${failureLabel(w.ref.role, r.fail_reason)}`;
          roomFailures.set(k, (roomFailures.get(k) ?? 0) + 1);
        }
      }
      return {
        role: w.ref.role,
        url: w.ref.url,
        healthy: w.ref.router?.healthy === true,
        reachable: w.health.body !== null,
        state: w.ref.router?.draining === true || h.status === 'draining' ? 'draining' : typeof w.ref.router?.mismatch === 'string' ? 'mismatch' : w.ref.router?.healthy === true ? 'healthy' : 'unhealthy',
        last_error: (w.ref.router?.last_error as string | null) ?? w.health.error,
        load: w.ref.router?.load ?? 0,
        slots: h.slots ?? null,
        slots_free: h.slots_free ?? null,
        gpu: gpuFromHealth(h.gpu),
        queues: Object.fromEntries(Object.entries(h).filter(([k]) => /_queue$|_running$/.test(k))),
        rooms_by_phase: phases,
        oldest_room_ms: live.reduce((m, r) => Math.max(m, r.age_ms), 0),
      };
    });
    const kvEvents = await kvEventSummary(d.metrics.registry);
    return {
      at,
      gather_ms: snap.gatherMs,
      router: { inflight: d.inflight(), requests: Object.fromEntries((await d.metrics.requests.get()).values.map((v) => [String(v.labels.outcome), v.value])), kv_events: kvEvents },
      prefix_store: prefixStoreCard(workers.map((w) => ({ url: w.ref.url, metrics: w.metrics.body })), kvEvents),
      workers: view,
      rooms_by_phase: roomsByPhase,
      series: d.series.view(),
      room_failures: [...roomFailures.entries()].map(([reason, count]) => ({ reason, count })).sort((a, b) => b.count - a.count),
      findings: diag.findings.slice(0, 8).map((f) => ({ severity: f.severity, title: f.title, cause: f.cause, next: f.next[0] ?? null })),
      status: diag.exitCode === 0 ? 'ok' : diag.exitCode === 1 ? 'warning' : 'critical',
    };
  };
  app.get('/dashboard/data', async (_req, reply) => {
    if (!last || systemClock.nowMs() - last.at >= 1000) {
      running ??= build().finally(() => (running = null));
      last = { at: systemClock.nowMs(), body: await running };
    }
    return reply.header('cache-control', 'no-store').send(last.body);
  });
}
