/**
 * One long-poll loop per worker over one small connection pool: what the router's followers of
 * a worker endpoint share (LoadWatch: GET /load, KvEventConsumer: GET /kv_events). Each loop gets
 * an AbortSignal that `stop(url)` or `close()` aborts; what a loop asks and keeps is its owner's.
 */
import { Agent, type Dispatcher } from 'undici';

/** Sleep `ms` ms without holding the process open. */
export const pause = (ms: number): Promise<void> => new Promise<void>((r) => setTimeout(r, ms).unref());

/** The loops of one follower and the pool they send through. */
export class PollLoops {
  /** The pool the loops send through, with the router's credentials composed on. */
  readonly agent: Dispatcher;
  private readonly base: Agent;
  private readonly loops = new Map<string, AbortController>();
  private stopped = false;

  /**
   * @param replyMs longest wait for a reply's headers, and between its body's chunks, ms (the long-poll wait plus a margin).
   * @param wrap composes the router's credentials onto the pool (worker requests are signed: ../security/http-auth.ts `withCredentials`).
   * @param tls node:tls client options (the CA and client certificate of https:// workers).
   */
  constructor(replyMs: number, wrap: (base: Dispatcher) => Dispatcher = (b) => b, tls: object = {}) {
    this.base = new Agent({ connections: 2, pipelining: 1, keepAliveTimeout: 30_000, connect: { timeout: 2_000, ...tls }, headersTimeout: replyMs, bodyTimeout: replyMs });
    this.agent = wrap(this.base);
  }

  /** Run `loop(signal)` for `url` unless it has a loop already or the loops are closed; true when it started one. */
  start(url: string, loop: (signal: AbortSignal) => Promise<void>): boolean {
    if (this.stopped || this.loops.has(url)) return false;
    const ac = new AbortController();
    this.loops.set(url, ac);
    void loop(ac.signal);
    return true;
  }

  /** Abort `url`'s loop (no-op without one). */
  stop(url: string): void {
    this.loops.get(url)?.abort();
    this.loops.delete(url);
  }

  /** The URLs with a loop. */
  urls(): IterableIterator<string> {
    return this.loops.keys();
  }

  /** Abort every loop, refuse new ones, and close the pool. */
  async close(): Promise<void> {
    this.stopped = true;
    for (const ac of this.loops.values()) ac.abort();
    this.loops.clear();
    await this.base.destroy().catch(() => {});
  }
}
