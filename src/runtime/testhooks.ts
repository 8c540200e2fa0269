/**
 * Test-only pauses at named points of a request's path, so real-process tests can catch a
 * request in a chosen phase (e.g. abort while prefill is transferring). One port, `TestHooks`,
 * is handed to every role and executor that has a hold point; production gets `noTestHooks`
 * (nothing waits, no route). The CLI builds the port with `testHooksFromEnv()`: holds are on
 * only when the environment variable PDSERVE_TEST_HOLDS is set, e.g.
 * `prefill.compute=50,decode.load=50` (ms per point) or `on` (none yet); such a process also
 * serves `POST /debug/test-holds` (body: the same spec as text) to change them at run time.
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

/** The hooks port: where a request may be held, and the route that changes the holds. */
export interface TestHooks {
  /** True when holds are on (logged at start-up; POST /debug/test-holds is served). */
  readonly enabled: boolean;
  /** The spec the port started with ('' when off), for the start-up log. */
  readonly spec: string;
  /**
   * Wait the configured ms at `point` (resolves early when `signal` aborts, or when a new spec
   * leaves the point out); resolves at once when the point has no hold.
   */
  hold(point: HoldPoint, signal?: AbortSignal): Promise<void>;
  /** Register POST /debug/test-holds on a fastify app (nothing when off). */
  registerRoute(app: { post(path: string, handler: (req: { body: unknown }) => Promise<unknown>): unknown }): void;
}

const resolved = Promise.resolve();

/** The production port: no hold point waits, no route is served. */
export const noTestHooks: TestHooks = Object.freeze({
  enabled: false,
  spec: '',
  hold: () => resolved,
  registerRoute: () => {},
});

function parseHolds(spec: string | undefined): Map<string, number> {
  const m = new Map<string, number>();
  for (const part of (spec ?? '').split(',')) {
    const [k, v] = part.split('=');
    const ms = Number(v);
    if (k && Number.isFinite(ms) && ms > 0) m.set(k.trim(), Math.min(ms, 60_000));
  }
  return m;
}

/** Holds on: each point waits the ms its spec gives it (at most 60 s), changeable at run time. */
export class TestHolds implements TestHooks {
  readonly enabled = true;
  private holds: Map<string, number>;
  /** Requests waiting at a point now, so that a new spec without that point releases them. */
  private readonly waiting = new Set<{ point: HoldPoint; release(): void }>();

  /** @param spec "point=ms,…" ('on' or '': on, no point held yet). */
  constructor(readonly spec: string) {
    this.holds = parseHolds(spec);
  }

  /**
   * Replace every hold with `spec` ("point=ms,…"; '' clears). Requests waiting at a point the new
   * spec leaves out go on at once (a test releases what it caught as soon as it has looked);
   * those at a point it keeps wait out their own time.
   */
  set(spec: string): void {
    this.holds = parseHolds(spec);
    for (const w of [...this.waiting]) if (!this.holds.has(w.point)) w.release();
  }

  /** Requests waiting now, by hold point (a test polls this to know its request reached a point). */
  waitingAt(): Record<string, number> {
    const out: Record<string, number> = {};
    for (const w of this.waiting) out[w.point] = (out[w.point] ?? 0) + 1;
    return out;
  }

  /** POST /debug/test-holds: sets the holds and answers the holds now set and the requests `waiting` at each point. */
  registerRoute(app: { post(path: string, handler: (req: { body: unknown }) => Promise<unknown>): unknown }): void {
    app.post('/debug/test-holds', async (req) => {
      this.set(typeof req.body === 'string' ? req.body : String((req.body as { spec?: unknown } | null)?.spec ?? ''));
      return { holds: Object.fromEntries(this.holds), waiting: this.waitingAt() };
    });
  }

  hold(point: HoldPoint, signal?: AbortSignal): Promise<void> {
    const ms = this.holds.get(point);
    if (!ms || signal?.aborted) return resolved;
    return new Promise((resolve) => {
      const t = setTimeout(done, ms);
      const entry = { point, release: done };
      const waiting = this.waiting;
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
}

/** The port a process starts with: `TestHolds` when PDSERVE_TEST_HOLDS is set and not empty, else `noTestHooks`. */
export function testHooksFromEnv(env: NodeJS.ProcessEnv = process.env): TestHooks {
  const spec = env.PDSERVE_TEST_HOLDS ?? '';
  return spec !== '' ? new TestHolds(spec) : noTestHooks;
}
