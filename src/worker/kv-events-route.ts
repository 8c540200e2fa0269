/**
 * `GET /kv_events?epoch=E&after=N&wait_ms=W` on a worker: its KV events for the routers
 * (../protocol/kv-events.ts). With the worker's current epoch and an `after` it has issued, the
 * answer waits up to `wait_ms` (≤ 30 s) for an event after N, then carries the events after N;
 * otherwise (no epoch, another epoch, an id it cannot continue from) it is the snapshot at once.
 * A client that goes away ends the wait, and so does the app's close (a pending long poll would
 * otherwise hold `app.close()` — and a worker's shutdown — for up to `wait_ms`).
 * Tests (`testHooks` enabled: PDSERVE_TEST_HOLDS set, ../runtime/testhooks.ts): `POST /debug/kv-events/drop` loses the
 * next event this worker publishes, as a lost message would: every answer leaves it out, so the
 * router sees the id jump (a gap) at the event after it and resyncs from the snapshot.
 */
import type { FastifyInstance } from 'fastify';
import { MAX_KV_WAIT_MS, type KvEventLog } from '../protocol/kv-events.js';
import type { TestHooks } from '../runtime/testhooks.js';

/** Register the route on a worker app. `source`: the log, or the log serving now (a switchable worker's role has its own, with its epoch); `testHooks` enabled: the lost-event hook too. */
export function registerKvEventsRoute(app: FastifyInstance, source: KvEventLog | (() => KvEventLog), testHooks?: Pick<TestHooks, 'enabled'>): void {
  const current = (): KvEventLog => (typeof source === 'function' ? source() : source);
  const waits = new Set<AbortController>();
  app.addHook('preClose', async () => {
    for (const ac of waits) ac.abort();
  });
  app.get<{ Querystring: { epoch?: string; after?: string; wait_ms?: string } }>('/kv_events', async (req, reply) => {
    const log = current();
    const after = Number(req.query.after ?? -1);
    const waitMs = Math.max(0, Math.min(MAX_KV_WAIT_MS, Number(req.query.wait_ms ?? 0) || 0));
    if (req.query.epoch === log.epoch && Number.isSafeInteger(after) && after >= 0 && waitMs > 0) {
      const ac = new AbortController();
      const gone = () => ac.abort();
      reply.raw.once('close', gone);
      waits.add(ac);
      try {
        await log.wait(after, waitMs, ac.signal);
      } finally {
        waits.delete(ac);
        reply.raw.off('close', gone);
      }
    }
    const r = log.read(req.query.epoch, after);
    if (lost === undefined || r.snapshot || !r.events.some((e) => e.id === lost)) return r;
    // the lost event never reaches a router: the ones after it come without it (a gap); when it
    // was all there was, the answer waits for the next one instead (no busy poll meanwhile)
    const events = r.events.filter((e) => e.id !== lost);
    if (events.length > 0 || waitMs === 0) return { ...r, events };
    await log.wait(lost, waitMs, AbortSignal.timeout(waitMs));
    const next = log.read(req.query.epoch, after);
    return next.snapshot ? next : { ...next, events: next.events.filter((e) => e.id !== lost) };
  });
  /** Test hook: the id of the event every answer leaves out. */
  let lost: number | undefined;
  if (testHooks?.enabled) {
    app.post('/debug/kv-events/drop', async () => {
      lost = current().last + 1;
      return { lost };
    });
  }
}
