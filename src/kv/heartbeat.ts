/**
 * Peer liveness of one KV connection, as a small object that touches no socket and reads time
 * only through an injected clock (nats.js's `heartbeats.ts`: an interval and a miss budget). The
 * connection pings every `intervalMs`, calls `received()` on every byte in, and asks `check()`
 * when `nextCheckInMs()` says a check is due.
 *
 * A peer silent for `missBudget` intervals is lost — unless the silence is OUR stall: when the
 * check itself runs late by more than half an interval (and STALL_FLOOR_MS), this process's event loop was blocked
 * (a long synchronous task), so it neither read the peer's bytes nor sent its own pings. Blaming
 * the peer for that would fail every room on a healthy connection, so the budget restarts
 * instead (`{k:'stalled'}`); a really dead peer is still found one budget later.
 */
import { systemClock, type Clock } from '../base/clock.js';

/** Heartbeat intervals of silence after which a peer is lost. */
export const HEARTBEAT_MISS_BUDGET = 2;

/** The monotonic time source (ms): the system clock in the workers, virtual time in tests. */
export type MonoClock = Pick<Clock, 'nowMs'>;

/** A check late by less than this (ms) is ordinary timer jitter on a loaded machine, not a stall. */
export const STALL_FLOOR_MS = 250;


export type HeartbeatVerdict =
  /** The peer spoke recently enough; schedule the next check. */
  | { k: 'ok' }
  /** The peer has been silent for `silentMs` ≥ the budget: it is lost. */
  | { k: 'lost'; silentMs: number; reason: string }
  /** This process stalled for `lateMs` past the due check: the budget restarted, nobody is blamed. */
  | { k: 'stalled'; lateMs: number };

export class Heartbeat {
  private lastRx: number;
  private dueAt: number;

  /**
   * @param intervalMs ping interval, ms (≥ 1)
   * @param missBudget intervals of silence before the peer is lost (default 2)
   */
  constructor(
    readonly intervalMs: number,
    readonly missBudget: number = HEARTBEAT_MISS_BUDGET,
    private readonly clock: MonoClock = systemClock,
  ) {
    this.lastRx = clock.nowMs();
    this.dueAt = this.lastRx + this.budgetMs;
  }

  /** Silence allowed before the peer is lost, ms. */
  get budgetMs(): number {
    return this.missBudget * this.intervalMs;
  }

  /** Something (any byte) arrived from the peer. */
  received(): void {
    this.lastRx = this.clock.nowMs();
  }

  /** ms until the next check is due (≥ 1); remembers when, to detect our own stalls. */
  nextCheckInMs(): number {
    const now = this.clock.nowMs();
    const wait = Math.max(1, this.lastRx + this.budgetMs - now);
    this.dueAt = now + wait;
    return wait;
  }

  /** The liveness decision at a check (call it once the check's timer fired). */
  check(): HeartbeatVerdict {
    const now = this.clock.nowMs();
    const lateMs = now - this.dueAt;
    if (lateMs > Math.max(this.intervalMs / 2, STALL_FLOOR_MS)) {
      this.lastRx = now;
      return { k: 'stalled', lateMs: Math.round(lateMs) };
    }
    const silentMs = Math.round(now - this.lastRx);
    if (now - this.lastRx >= this.budgetMs) {
      return { k: 'lost', silentMs, reason: `peer silent for ${silentMs} ms (heartbeat ${this.intervalMs} ms, budget ${this.missBudget} intervals)` };
    }
    return { k: 'ok' };
  }
}
