/**
 * Test-only pauses at named points of a request's path, so real-process tests can catch a
 * request in a chosen phase (e.g. abort while prefill is transferring). Off unless the
 * environment variable PDSERVE_TEST_HOLDS is set, e.g. `prefill.compute=50,decode.load=50`
 * (ms per point) or `on` (none yet). When set, every process also serves
 * `POST /debug/test-holds` (body: the same spec as text) to change them at run time.
 * Never set it in production: it only adds latency.
 */
export type HoldPoint =
  /** router: after validation, before dispatching to the workers. */
  | 'router.dispatch'
  /** decode: slot reserved, before sending REGISTER. */
  | 'decode.register'
  /** decode: all KV bytes received, before validation and load. */
  | 'decode.load'
  /** decode and colocated: before each generated token is sampled (a slow generation, to catch a stream mid-way). */
  | 'decode.step'
  /** decode: decode-local room holds its slot, before the suffix is evaluated. */
  | 'decode.local_prefill'
  /** decode: a same-host kv_file arrived, before decode takes the file over (renames it). */
  | 'decode.take'
  /** prefill: registered, before prompt evaluation starts. */
  | 'prefill.compute'
  /** prefill: prompt evaluated, before the state is saved. */
  | 'prefill.save'
  /** prefill: chunks sent, before KV_END (same host: before KV_FILE is sent). */
  | 'prefill.send';

function parseHolds(spec: string | undefined): Map<string, number> {
  const m = new Map<string, number>();
  for (const part of (spec ?? '').split(',')) {
    const [k, v] = part.split('=');
    const ms = Number(v);
    if (k && Number.isFinite(ms) && ms > 0) m.set(k.trim(), Math.min(ms, 60_000));
  }
  return m;
}

let holds = parseHolds(process.env.PDSERVE_TEST_HOLDS);
/** Requests waiting at a point now, so that a new spec without that point releases them. */
const waiting = new Set<{ point: HoldPoint; release(): void }>();

/** True when PDSERVE_TEST_HOLDS is set (logged at start-up; enables POST /debug/test-holds). */
export const holdsEnabled = (process.env.PDSERVE_TEST_HOLDS ?? '') !== '';

/**
 * Replace every hold with `spec` ("point=ms,…"; '' clears). Requests waiting at a point the new
 * spec leaves out go on at once (a test releases what it caught as soon as it has looked);
 * those at a point it keeps wait out their own time. Ignored unless holdsEnabled.
 */
export function setHolds(spec: string): void {
  if (!holdsEnabled) return;
  holds = parseHolds(spec);
  for (const w of [...waiting]) if (!holds.has(w.point)) w.release();
}

/** Requests waiting now, by hold point (a test polls this to know its request reached a point). */
function waitingAt(): Record<string, number> {
  const out: Record<string, number> = {};
  for (const w of waiting) out[w.point] = (out[w.point] ?? 0) + 1;
  return out;
}

/** Register POST /debug/test-holds on a fastify app when holds are enabled; it answers the holds now set and the requests `waiting` at each point. */
export function registerHoldRoute(app: { post(path: string, handler: (req: { body: unknown }) => Promise<unknown>): unknown }): void {
  if (!holdsEnabled) return;
  app.post('/debug/test-holds', async (req) => {
    setHolds(typeof req.body === 'string' ? req.body : String((req.body as { spec?: unknown } | null)?.spec ?? ''));
    return { holds: Object.fromEntries(holds), waiting: waitingAt() };
  });
}

/**
 * Wait the configured ms at `point` (resolves early when `signal` aborts, or when `setHolds`
 * leaves the point out); no-op when unset.
 */
export function hold(point: HoldPoint, signal?: AbortSignal): Promise<void> {
  const ms = holds.get(point);
  if (!ms || signal?.aborted) return Promise.resolve();
  return new Promise((resolve) => {
    const t = setTimeout(done, ms);
    const entry = { point, release: done };
    waiting.add(entry);
    function done() {
      clearTimeout(t);
      waiting.delete(entry);
      signal?.removeEventListener('abort', done);
      resolve();
    }
    signal?.addEventListener('abort', done, { once: true });
  });
}
