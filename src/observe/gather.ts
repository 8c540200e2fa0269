/**
 * Gathering a cluster's state for `pdserve doctor` and the router's /dashboard: the router's
 * GET /health, /workers, /metrics and /debug/traces, then every worker's GET /health, /metrics
 * and /debug/rooms, all at once, each with its own deadline (`timeoutMs`), so one hung worker
 * costs one deadline, not one per endpoint. A failed fetch is recorded (status, error), never
 * thrown: it is itself a finding ("worker unreachable").
 *
 * Where the worker list comes from is a `WorkerSource`: today the router's GET /workers
 * (`routerSource`); etcd membership (`--discovery`) plugs in as another source.
 */
import { request, type Dispatcher } from 'undici';
import { systemClock } from '../base/clock.js';
import type { RoomView } from '../protocol/debug-rooms.js';

/** A worker to probe; `router` is the router's own row for it (GET /workers), when known. */
export interface WorkerRef {
  role: 'prefill' | 'decode';
  url: string;
  router?: Record<string, unknown>;
}

/** The outcome of one GET. */
export interface Fetched<T> {
  ok: boolean;
  status: number | null;
  /** Time taken, ms. */
  ms: number;
  error: string | null;
  body: T | null;
}

/** One Prometheus sample. */
export interface Sample {
  name: string;
  labels: Record<string, string>;
  value: number;
}

/** A live or recent room as a worker's GET /debug/rooms shows it (fields used by the doctor). */
export interface RoomInfo extends RoomView {
  trace?: string | null;
  bytes: number;
  total_bytes: number | null;
  fail_reason: string | null;
}

/** Body of a worker's GET /debug/rooms (fields used by the doctor). */
export interface DebugRooms {
  role: string;
  /** The worker's clock when it answered, ms since epoch. */
  now: number;
  epoch?: string;
  queues?: Record<string, number>;
  pending_registrations?: number;
  live: RoomInfo[];
  recent: RoomInfo[];
  decoding?: { room: string; rid: string; age_ms: number; trace?: string | null }[];
}

export interface WorkerProbe {
  ref: WorkerRef;
  health: Fetched<Record<string, unknown>>;
  metrics: Fetched<Sample[]>;
  rooms: Fetched<DebugRooms>;
}

export interface RouterProbe {
  url: string;
  health: Fetched<Record<string, unknown>>;
  workers: Fetched<{ workers: Record<string, unknown>[] }>;
  metrics: Fetched<Sample[]>;
  traces: Fetched<{ traces: import('../protocol/trace.js').RequestTrace[] }>;
}

/** Everything gathered in one pass. */
/** A router as its shared-state record says (several routers on etcd: ../membership/router-state.ts). */
export interface RouterView {
  url: string;
  /** How long ago it last wrote its record, ms (it writes every second while alive). */
  ageMs: number;
  /** Workers in its pool, healthy ones, the age of its oldest load reading (ms; null: none). */
  view: { workers: number; healthy: number; load_age_ms: number | null };
}

export interface ClusterSnapshot {
  /** When gathering started, ms since epoch (this process's clock). */
  at: number;
  /** Several routers: each one's record (the source's `routers`); undefined when the source has none. */
  routers?: RouterView[];
  /** Workers the source lists (etcd's records), for comparing with each router's view. */
  listed?: number;
  /** How long gathering took, ms. */
  gatherMs: number;
  /** Where the worker list came from (e.g. 'router http://…'). */
  source: string;
  router: RouterProbe | null;
  workers: WorkerProbe[];
}

/** Where the worker list comes from. */
export interface WorkerSource {
  describe: string;
  /** The router to probe too, if the source has one. */
  routerUrl: string | null;
  /** Workers to probe; may throw when the source itself is unreachable (recorded, not thrown, by `gather`). */
  list(router: RouterProbe | null): Promise<WorkerRef[]>;
  /** The routers sharing this source (etcd), when it knows them; may throw (then left out). */
  routers?(): Promise<RouterView[]>;
}

/** Largest body read per endpoint, bytes. */
const MAX_BODY = 8 * 1024 * 1024;

/**
 * GET `url` through `dispatcher` (credentials: ../security/http-auth.ts; default: undici's global
 * one); `parse` turns the text into the body. Answers within `timeoutMs` whatever phase the
 * request is in: undici applies an abort only once the connection is up, so a TLS handshake with
 * a hung peer would otherwise wait for the dispatcher's connect timeout (10 s by default). Never
 * throws.
 */
export async function fetchText<T>(url: string, timeoutMs: number, parse: (text: string) => T, dispatcher?: Dispatcher): Promise<Fetched<T>> {
  const t0 = systemClock.nowMs();
  const ms = () => Math.round(systemClock.nowMs() - t0);
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<Fetched<T>>((resolve) => {
    timer = setTimeout(() => resolve({ ok: false, status: null, ms: ms(), error: `timed out after ${timeoutMs} ms`, body: null }), timeoutMs);
  });
  try {
    return await Promise.race([fetchOnce(url, timeoutMs, parse, ms, dispatcher), late]);
  } finally {
    clearTimeout(timer);
  }
}

async function fetchOnce<T>(url: string, timeoutMs: number, parse: (text: string) => T, ms: () => number, dispatcher?: Dispatcher): Promise<Fetched<T>> {
  try {
    const res = await request(url, { method: 'GET', signal: AbortSignal.timeout(timeoutMs), headersTimeout: timeoutMs, bodyTimeout: timeoutMs, ...(dispatcher ? { dispatcher } : {}) });
    let text = '';
    let n = 0;
    for await (const chunk of res.body) {
      n += chunk.length;
      if (n > MAX_BODY) {
        res.body.destroy();
        return { ok: false, status: res.statusCode, ms: ms(), error: `body larger than ${MAX_BODY} bytes`, body: null };
      }
      text += chunk.toString('utf8');
    }
    let body: T | null = null;
    try {
      body = parse(text);
    } catch (err) {
      return { ok: false, status: res.statusCode, ms: ms(), error: `unreadable body: ${(err as Error).message}`, body: null };
    }
    return { ok: res.statusCode >= 200 && res.statusCode < 300, status: res.statusCode, ms: ms(), error: res.statusCode >= 300 ? `HTTP ${res.statusCode}` : null, body };
  } catch (err) {
    const e = err as { name?: string; code?: string; cause?: { code?: string }; message?: string };
    const code = e.code ?? e.cause?.code;
    const why = e.name === 'TimeoutError' || code === 'UND_ERR_CONNECT_TIMEOUT' ? `timed out after ${timeoutMs} ms` : (code ?? e.message ?? String(err));
    return { ok: false, status: null, ms: ms(), error: String(why), body: null };
  }
}

/**
 * Parse the Prometheus text exposition format (version 0.0.4) into samples. Comment and blank
 * lines are skipped; label values are unescaped (\\, \", \n). Lines it cannot read are skipped.
 */
export function parsePrometheus(text: string): Sample[] {
  const out: Sample[] = [];
  const line = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
  const label = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
  for (const l of text.split('\n')) {
    if (l === '' || l.startsWith('#')) continue;
    const m = line.exec(l);
    if (!m) continue;
    const labels: Record<string, string> = {};
    if (m[2]) for (const x of m[2].matchAll(label)) labels[x[1]!] = x[2]!.replace(/\\(.)/g, (_, c: string) => (c === 'n' ? '\n' : c));
    const v = m[3] === '+Inf' ? Infinity : m[3] === '-Inf' ? -Infinity : Number(m[3]);
    out.push({ name: m[1]!, labels, value: v });
  }
  return out;
}

/** Sum of the samples named `name` whose labels include `where`. */
export function sumOf(samples: Sample[] | null | undefined, name: string, where: Record<string, string> = {}): number {
  let s = 0;
  for (const x of samples ?? []) if (x.name === name && Object.entries(where).every(([k, v]) => x.labels[k] === v)) s += x.value;
  return s;
}

const json = (t: string) => JSON.parse(t) as never;

/** Probe one worker's /health, /metrics and /debug/rooms concurrently. */
export async function probeWorker(ref: WorkerRef, timeoutMs: number, dispatcher?: Dispatcher): Promise<WorkerProbe> {
  const [health, metrics, rooms] = await Promise.all([
    fetchText<Record<string, unknown>>(`${ref.url}/health`, timeoutMs, json, dispatcher),
    fetchText(`${ref.url}/metrics`, timeoutMs, parsePrometheus, dispatcher),
    fetchText<DebugRooms>(`${ref.url}/debug/rooms`, timeoutMs, json, dispatcher),
  ]);
  return { ref, health, metrics, rooms };
}

/** Probe the router's /health, /workers, /metrics and /debug/traces concurrently. */
export async function probeRouter(url: string, timeoutMs: number, dispatcher?: Dispatcher): Promise<RouterProbe> {
  const [health, workers, metrics, traces] = await Promise.all([
    fetchText<Record<string, unknown>>(`${url}/health`, timeoutMs, json, dispatcher),
    fetchText<{ workers: Record<string, unknown>[] }>(`${url}/workers`, timeoutMs, json, dispatcher),
    fetchText(`${url}/metrics`, timeoutMs, parsePrometheus, dispatcher),
    fetchText<{ traces: import('../protocol/trace.js').RequestTrace[] }>(`${url}/debug/traces?active=1`, timeoutMs, json, dispatcher),
  ]);
  return { url, health, workers, metrics, traces };
}

/** The router's GET /workers as the worker list. */
export function routerSource(url: string): WorkerSource {
  const base = url.replace(/\/+$/, '');
  return {
    describe: `router ${base}`,
    routerUrl: base,
    async list(router) {
      const rows = router?.workers.body?.workers;
      if (!Array.isArray(rows)) return [];
      return rows
        .filter((w) => (w.role === 'prefill' || w.role === 'decode') && typeof w.url === 'string')
        .map((w) => ({ role: w.role as 'prefill' | 'decode', url: w.url as string, router: w }));
    },
  };
}

/** Gather a snapshot: the router (if the source has one), then every worker, each GET bounded by `timeoutMs`. */
export async function gather(source: WorkerSource, timeoutMs = 3000, dispatcher?: Dispatcher): Promise<ClusterSnapshot> {
  const at = systemClock.wallMs();
  const t0 = systemClock.nowMs();
  const router = source.routerUrl ? await probeRouter(source.routerUrl, timeoutMs, dispatcher) : null;
  const refs = await source.list(router);
  const workers = await Promise.all(refs.map((r) => probeWorker(r, timeoutMs, dispatcher)));
  const routers = source.routers ? await source.routers().catch(() => undefined) : undefined;
  return { at, gatherMs: Math.round(systemClock.nowMs() - t0), source: source.describe, router, workers, ...(routers ? { routers, listed: refs.length } : {}) };
}
