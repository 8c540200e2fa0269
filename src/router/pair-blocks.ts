/**
 * Pairs that cannot serve: a prefill–decode pair whose KV handshake failed (decode could not
 * open or authenticate the KV connection — a wrong cluster secret, an unreachable bootstrap port
 * — or the pair's settings differ) is taken out of the rotation at once, so the request is
 * retried on another pair and the next requests do not meet the same failure. The pair is tried
 * again after a backoff (1 s, doubling to 30 s while it keeps failing, as a circuit breaker's
 * half-open state: the next request given to it is the probe); an attempt it serves clears it.
 * A decode whose every pair is blocked (the wrong secret) has left the rotation.
 * Times are systemClock.nowMs() ms; at most MAX_PAIRS entries (the oldest dropped).
 */
import { systemClock } from '../base/clock.js';

/** Failure codes of a pair's KV handshake: the pair, not the request, is at fault. */
export const PAIR_FAILURE_CODES: ReadonlySet<string> = new Set(['peer_unreachable', 'settings_mismatch']);
const MIN_BACKOFF_MS = 1000;
const MAX_BACKOFF_MS = 30_000;
const MAX_PAIRS = 4096;

interface Block {
  prefill: string;
  decode: string;
  code: string;
  until: number;
  backoffMs: number;
}

/** The blocked pairs of one router, keyed by the two worker URLs. */
export class PairBlocks {
  private readonly m = new Map<string, Block>();

  constructor(private readonly now: () => number = () => systemClock.nowMs()) {}

  /** The pair (worker URLs) failed with `code`: block it for its next backoff. Returns that backoff (ms). */
  block(prefill: string, decode: string, code: string): number {
    const key = `${prefill} ${decode}`;
    const old = this.m.get(key);
    const backoffMs = old ? Math.min(MAX_BACKOFF_MS, old.backoffMs * 2) : MIN_BACKOFF_MS;
    this.m.delete(key);
    this.m.set(key, { prefill, decode, code, until: this.now() + backoffMs, backoffMs });
    while (this.m.size > MAX_PAIRS) this.m.delete(this.m.keys().next().value as string);
    return backoffMs;
  }

  /** The pair served an attempt: forget its failures. */
  ok(prefill: string, decode: string): void {
    if (this.m.size > 0) this.m.delete(`${prefill} ${decode}`);
  }

  /**
   * Worker `url` came back after being unhealthy (a restart): its pairs' blocks go — a killed
   * prefill fails its pairs' handshakes with peer_unreachable, which says nothing of the new process.
   */
  forget(url: string): void {
    for (const [k, b] of this.m) if (b.prefill === url || b.decode === url) this.m.delete(k);
  }

  /** May the pair be dispatched to now? (A block past its backoff lets one try through.) */
  usable(prefill: string, decode: string): boolean {
    if (this.m.size === 0) return true;
    const b = this.m.get(`${prefill} ${decode}`);
    return !b || this.now() >= b.until;
  }

  /** The blocks still in force, for GET /workers: {prefill, decode, code, retry_in_ms}. */
  snapshot(): { prefill: string; decode: string; code: string; retry_in_ms: number }[] {
    const now = this.now();
    return [...this.m.values()].filter((b) => b.until > now).map((b) => ({ prefill: b.prefill, decode: b.decode, code: b.code, retry_in_ms: Math.round(b.until - now) }));
  }
}
