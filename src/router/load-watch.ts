/**
 * Shared load across routers, read from the workers themselves (no router-to-router traffic).
 *
 * Each router counts its own in-flight requests per worker (`WorkerState.load`); several routers
 * in front of the same workers would each see only their own. So the router also follows every
 * worker's own count with one long poll per worker, `GET /load?after=SIG&wait_ms=W`
 * (../worker/load-route.ts): the worker answers as soon as its count of live requests changes,
 * or after W ms. At each answer the router notes the worker's count and its own count then; the
 * other routers' load is their difference, and the load a policy sees is
 *
 *   effective(w) = own(w) now + max(0, rooms(w) at the reading − own(w) at the reading)
 *
 * so the router's own picks since the reading count at once and the others' are at most one
 * round trip old (Dynamo's router replicas share active-request counts the same way, best effort,
 * as events with an expiry; here the worker is the one source of truth). A reading older than
 * LOAD_STALE_MS (the poll failed: worker down, restarting, too old to have /load) counts as no
 * other load — the router falls back to its own count, never to a frozen number.
 * Best effort: two picks by two routers within one round trip of each other can both see a slot
 * the other takes.
 */
import { request, type Dispatcher } from 'undici';
import type { LoadReply } from '../worker/load-route.js';
import { PdError } from '../base/errors.js';
import { systemClock } from '../base/clock.js';
import { pause, PollLoops } from './poll-loops.js';

/** Long-poll wait asked of a worker, ms (the reading is refreshed at least this often). */
export const LOAD_WAIT_MS = 1000;
/** A reading older than this no longer counts (its poll has failed for a while), ms. */
export const LOAD_STALE_MS = 3000;
/** Pause after a failed poll, ms. */
const RETRY_MS = 250;
/** Pause before asking a worker without /load again, ms. */
const NO_LOAD_RETRY_MS = 30_000;

/** One worker's last reading. */
interface Reading {
  sig: string;
  rooms: number;
  /** The router's own load on the worker when the reading came. */
  ownAt: number;
  /** Monotonic ms of the reading. */
  at: number;
}

/** The long polls of one router (see the module doc). */
export class LoadWatch {
  private readonly readings = new Map<string, Reading>();
  private readonly polls: PollLoops;

  /**
   * @param own the router's own in-flight count on a worker (by URL; 0 when unknown).
   * @param wrap composes the router's credentials onto the pool (worker requests are signed).
   * @param tls node:tls client options (internal TLS).
   * @param now monotonic ms.
   */
  constructor(
    private readonly own: (url: string) => number,
    wrap: (base: Dispatcher) => Dispatcher = (b) => b,
    tls: object = {},
    private readonly waitMs = LOAD_WAIT_MS,
    private readonly now: () => number = () => systemClock.nowMs(),
  ) {
    this.polls = new PollLoops(waitMs + 3_000, wrap, tls);
  }

  /** Other routers' in-flight requests on `url` as of the last fresh reading (0 without one). */
  others(url: string): number {
    const r = this.readings.get(url);
    if (!r || this.now() - r.at > LOAD_STALE_MS) return 0;
    return Math.max(0, r.rooms - r.ownAt);
  }

  /** Age of the oldest reading among the followed workers, ms (Infinity when one has none): the staleness of this router's view. */
  oldestMs(): number {
    let oldest = 0;
    for (const url of this.polls.urls()) {
      const r = this.readings.get(url);
      oldest = Math.max(oldest, r ? this.now() - r.at : Infinity);
    }
    return oldest;
  }

  /** Follow worker `url` (idempotent). */
  follow(url: string): void {
    this.polls.start(url, (signal) => this.loop(url, signal));
  }

  /** Stop following `url` and drop its reading. */
  forget(url: string): void {
    this.polls.stop(url);
    this.readings.delete(url);
  }

  /** Stop every loop. */
  async close(): Promise<void> {
    await this.polls.close();
  }

  private async loop(url: string, signal: AbortSignal): Promise<void> {
    while (!signal.aborted) {
      const last = this.readings.get(url);
      const q = last ? `after=${encodeURIComponent(last.sig)}&wait_ms=${this.waitMs}` : 'wait_ms=0';
      try {
        const res = await request(`${url}/load?${q}`, { dispatcher: this.polls.agent, signal: AbortSignal.any([signal, AbortSignal.timeout(this.waitMs + 3_000)]) });
        if (res.statusCode === 404) {
          await res.body.dump();
          this.readings.delete(url);
          await pause(NO_LOAD_RETRY_MS);
          continue;
        }
        if (res.statusCode !== 200) {
          await res.body.dump();
          throw new PdError('bad_worker_answer', `GET /load: HTTP ${res.statusCode}`);
        }
        const j = (await res.body.json()) as Partial<LoadReply>;
        if (typeof j.sig !== 'string' || typeof j.rooms !== 'number' || !Number.isFinite(j.rooms)) throw new PdError('bad_worker_answer', 'GET /load: malformed answer');
        if (signal.aborted) return;
        this.readings.set(url, { sig: j.sig, rooms: j.rooms, ownAt: this.own(url), at: this.now() });
      } catch {
        if (signal.aborted) return;
        this.readings.delete(url);
        await pause(RETRY_MS);
      }
    }
  }
}
