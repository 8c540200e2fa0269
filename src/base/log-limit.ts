import { systemClock } from './clock.js';

/**
 * Rate limit for repeated log lines: at most one line per key (e.g. an error code) per window,
 * with the count of the occurrences that were not logged. Used for expected refusals (a 503
 * `no_healthy_decode` while the only decode restarts) that would otherwise log thousands of
 * identical lines per second. The count of the last window is reported by the next line of the
 * same key (nothing is logged on a timer). Bounded: at most `maxKeys` keys (oldest dropped).
 */
export class RepeatLimiter {
  private readonly windows = new Map<string, { start: number; suppressed: number }>();

  /** @param windowMs length of one window in ms; @param maxKeys bound on remembered keys. */
  constructor(
    readonly windowMs = 1000,
    readonly maxKeys = 256,
  ) {}

  /**
   * One occurrence of `key` at `now` (monotonic ms). Returns null when it must not be logged (another line
   * of this key was logged less than windowMs ago), else the number of occurrences suppressed
   * since the previous logged line of this key (0 for the first).
   */
  hit(key: string, now = systemClock.nowMs()): number | null {
    const w = this.windows.get(key);
    if (w && now - w.start < this.windowMs) {
      w.suppressed++;
      return null;
    }
    if (!w && this.windows.size >= this.maxKeys) this.windows.delete(this.windows.keys().next().value as string);
    this.windows.set(key, { start: now, suppressed: 0 });
    return w?.suppressed ?? 0;
  }
}
