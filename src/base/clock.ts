/**
 * The product's one time source, injected where time is read (the workers, the router, the KV
 * channel; the simulator passes virtual time straight to the sans-IO cores instead).
 *
 * Two clocks, never mixed:
 * - `nowMs()` is monotonic (CLOCK_MONOTONIC through `performance.now()`, ms since this process
 *   started): every deadline, timeout, age, heartbeat, watchdog, lease and elapsed time. An NTP
 *   step or an operator's `date -s` does not move it, so a step cannot expire a room or lose a peer.
 * - `wallMs()` is the wall clock (ms since the Unix epoch, `Date.now()`): timestamps shown to
 *   people or required by a protocol (log lines, OpenAI `created`, trace and timeline dates).
 *   Nothing subtracts from it to get a deadline or an age.
 *
 * Monotonic instants mean nothing outside their process: a deadline never crosses a process
 * boundary as an instant (send a duration), and one shown to a person goes through `wallOf`.
 * This module imports nothing (a leaf of the layering test).
 */

/** A time source: monotonic ms for durations, wall ms for dates. */
export interface Clock {
  /** Monotonic ms from an arbitrary per-process origin (fractional); only differences mean anything. */
  nowMs(): number;
  /** Wall-clock ms since 1970-01-01T00:00:00Z; for display and protocol fields only. */
  wallMs(): number;
}

/** The process's real clocks. */
export const systemClock: Clock = {
  nowMs: () => performance.now(),
  wallMs: () => Date.now(),
};

/**
 * The wall-clock date (ms since the epoch) of monotonic instant `t` of `clock`, as the wall clock
 * reads now: for showing a monotonic instant to a person. Two instants converted in one call
 * keep their monotonic difference exactly.
 */
export function wallOf(clock: Clock, t: number): number {
  return Math.round(clock.wallMs() - (clock.nowMs() - t));
}

/** Timers (a port: node's timers here, virtual ones in a simulator). Both return a cancel function; neither keeps the process alive. */
export interface Timers {
  /** Call `fn` every `ms` until cancelled. */
  every(ms: number, fn: () => void): () => void;
  /** Call `fn` once after `ms` unless cancelled first. */
  after(ms: number, fn: () => void): () => void;
  /** Settles after the current event-loop turn (what is queued now runs first). */
  turn(): Promise<void>;
}

/** The process's real timers (unref'd). */
export const systemTimers: Timers = {
  every(ms, fn) {
    const t = setInterval(fn, ms);
    t.unref();
    return () => clearInterval(t);
  },
  after(ms, fn) {
    const t = setTimeout(fn, ms);
    t.unref();
    return () => clearTimeout(t);
  },
  turn: () => new Promise<void>((resolve) => setImmediate(resolve)),
};
