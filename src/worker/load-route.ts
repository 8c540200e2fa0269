/**
 * `GET /load?after=SIG&wait_ms=W` on a worker: its load as the worker counts it, across every
 * router that sends it work — the routers' shared view of load (../router/load-watch.ts).
 *
 * Answer: `{ sig, rooms, slots, slots_free }`: `rooms` the requests this worker holds in any step
 * (decode: waiting for a slot, receiving KV or generating; prefill: its live rooms),
 * `slots`/`slots_free` its engine's sequence slots; `sig` names those values. When `after` equals
 * the current `sig` and `wait_ms` > 0 (at most MAX_LOAD_WAIT_MS), the answer waits until the load
 * changes or `wait_ms` passes (a long poll: a router learns of another router's pick within one
 * round trip, and hears at least every `wait_ms` while nothing changes). The wait samples the
 * counters every LOAD_SAMPLE_MS (in process, no I/O). A client that goes away ends the wait, and
 * so does the app's close.
 */
import type { FastifyInstance } from 'fastify';
import { systemClock } from '../base/clock.js';

/** Longest wait a router may ask, ms. */
export const MAX_LOAD_WAIT_MS = 10_000;
/** How often a waiting answer samples the counters, ms. */
export const LOAD_SAMPLE_MS = 10;

/** The load a worker reports (rooms: live requests; slots: engine sequence slots). */
export interface WorkerLoad {
  rooms: number;
  slots: number;
  slots_free: number;
}

/** The answer of GET /load. */
export interface LoadReply extends WorkerLoad {
  sig: string;
}

/** The signature of a load (changes whenever one of its counts does). */
export const loadSig = (l: WorkerLoad): string => `${l.rooms}/${l.slots_free}/${l.slots}`;

/** Register the route on a worker app; `load()` reads the counters (cheap, synchronous). */
export function registerLoadRoute(app: FastifyInstance, load: () => WorkerLoad): void {
  const waits = new Set<AbortController>();
  app.addHook('preClose', async () => {
    for (const ac of waits) ac.abort();
  });
  app.get<{ Querystring: { after?: string; wait_ms?: string } }>('/load', async (req, reply) => {
    const waitMs = Math.max(0, Math.min(MAX_LOAD_WAIT_MS, Number(req.query.wait_ms ?? 0) || 0));
    let l = load();
    if (waitMs > 0 && req.query.after === loadSig(l)) {
      const ac = new AbortController();
      const gone = () => ac.abort();
      reply.raw.once('close', gone);
      waits.add(ac);
      let timer: NodeJS.Timeout | undefined;
      let wake = (): void => {};
      ac.signal.addEventListener('abort', () => (clearTimeout(timer), wake()), { once: true });
      try {
        const until = systemClock.nowMs() + waitMs;
        while (!ac.signal.aborted && systemClock.nowMs() < until && loadSig(l) === req.query.after) {
          await new Promise<void>((r) => {
            wake = r;
            timer = setTimeout(r, LOAD_SAMPLE_MS);
          });
          l = load();
        }
      } finally {
        waits.delete(ac);
        reply.raw.off('close', gone);
      }
    }
    return { sig: loadSig(l), ...l } satisfies LoadReply;
  });
}
