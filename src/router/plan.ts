/**
 * THE attempt plan of one generation request: what a failed attempt leads to. Pure — a state and
 * an event in, a decision and the next state out; no clock, no I/O — so the router (./attempts.ts)
 * and the simulator (../sim/world.ts) run the same rule, and a bug planted in it fails the
 * simulator's test.
 *
 * | event | decision |
 * |---|---|
 * | decode-local attempt answered `needs_prefill` before it wrote anything | `fallback`: the PD path on the same pair, no budget spent |
 * | not retryable (a 4xx; the router's own `timeout`, `shutting_down`, client gone) | `fail` |
 * | less than `minAttemptMs` left before the request's deadline | `fail` |
 * | budget spent (`migrationLimit` counted re-dispatches, `maxUnreached` uncounted ones) | `fail` |
 * | retryable, the client has nothing yet | `retry` |
 * | retryable, the client has output | `migrate` (prompt + the tokens it has go to the new pair) |
 *
 * A re-dispatch after a worker that could not be reached at all (UNREACHED_CODES: nothing ran on
 * it, and it leaves the rotation at once) is not counted against `migrationLimit` (Dynamo's
 * `--migration-limit`); at most `maxUnreached` of those per request.
 */
import { DEFAULT_MIGRATION_LIMIT } from './config.js';

/** Failures of a worker that could not be reached at all: their re-dispatch is not counted against `migrationLimit`. */
export const UNREACHED_CODES: ReadonlySet<string> = new Set(['prefill_unreachable', 'decode_unreachable', 'peer_unreachable']);
/** Most re-dispatches after an unreached worker per request, besides `migrationLimit`. */
export const MAX_UNREACHED = 8;
/** A failure with less time than this left before the deadline is not retried (ms). */
export const MIN_ATTEMPT_MS = 50;
/** Codes never retried although 5xx: the router's own deadline and shutdown, the client gone. */
const NEVER: ReadonlySet<string> = new Set(['timeout', 'shutting_down', 'client_closed_request']);

/** The plan's limits (the router's config; the simulator's options). */
export interface PlanLimits {
  /** Counted re-dispatches per request (`--migration-limit`). */
  migrationLimit: number;
  /** Uncounted re-dispatches after an unreached worker. Default MAX_UNREACHED. */
  maxUnreached?: number;
  /** Least time left before the deadline for another attempt, ms. Default MIN_ATTEMPT_MS. */
  minAttemptMs?: number;
}

/** Where one request stands (immutable: `next` returns a new one). */
export interface PlanState {
  /** Counted re-dispatches left. */
  readonly left: number;
  /** Uncounted (unreached) re-dispatches used. */
  readonly unreached: number;
  /** The request's deadline, on the caller's clock (ms). */
  readonly deadlineAt: number;
}

/** A failed attempt, as the plan sees it. */
export interface PlanEvent {
  /** The failure's error code and HTTP status (./worker-errors.ts). */
  code: string;
  status: number;
  /** The client already has output (events applied to its response). */
  output: boolean;
  /** The failed attempt wrote output itself (a decode-local attempt that did may not fall back). */
  attemptOutput: boolean;
  /** The attempt was decode-local (decode alone, no prefill leg). */
  local: boolean;
  /** The time of the failure, on the state's clock (ms). */
  now: number;
}

export type Next = 'retry' | 'migrate' | 'fallback' | 'fail';

/** The plan's answer: what to do, and the state after it (budget spent for retry / migrate). */
export interface Decision {
  next: Next;
  state: PlanState;
}

/**
 * The plan (see the module doc). Its rules are methods so a test can plant a bug in one
 * (test/unit/sim.test.ts replaces `budgetAllows`, `inTime` or `retry` on the prototype); every method is
 * pure.
 */
export class AttemptPlan {
  readonly migrationLimit: number;
  readonly maxUnreached: number;
  readonly minAttemptMs: number;

  constructor(limits: PlanLimits = { migrationLimit: DEFAULT_MIGRATION_LIMIT }) {
    this.migrationLimit = limits.migrationLimit;
    this.maxUnreached = limits.maxUnreached ?? MAX_UNREACHED;
    this.minAttemptMs = limits.minAttemptMs ?? MIN_ATTEMPT_MS;
  }

  /** The state of a request with deadline `deadlineAt` (ms, the caller's clock) and a full budget. */
  start(deadlineAt: number): PlanState {
    return { left: this.migrationLimit, unreached: 0, deadlineAt };
  }

  /** May a failure with `code` / `status` run again elsewhere? Any 5xx but the router's own; never a 4xx. */
  retryable(code: string, status: number): boolean {
    return status >= 500 && !NEVER.has(code);
  }

  /** Is there time for another attempt at `now`? */
  inTime(s: PlanState, now: number): boolean {
    return s.deadlineAt - now >= this.minAttemptMs;
  }

  /** Does the budget allow one more re-dispatch after a failure with `code`? */
  budgetAllows(s: PlanState, code: string): boolean {
    return s.left > 0 || (UNREACHED_CODES.has(code) && s.unreached < this.maxUnreached);
  }

  /** The state after one re-dispatch for a failure with `code` (an unreached one uses the uncounted budget first). */
  spend(s: PlanState, code: string): PlanState {
    return UNREACHED_CODES.has(code) && s.unreached < this.maxUnreached ? { ...s, unreached: s.unreached + 1 } : { ...s, left: s.left - 1 };
  }

  /** Run the request again from the start (the client has nothing yet): one re-dispatch spent. */
  retry(s: PlanState, code: string): Decision {
    return { next: 'retry', state: this.spend(s, code) };
  }

  /** Move the request with the output the client has to a new pair: one re-dispatch spent. */
  migrate(s: PlanState, code: string): Decision {
    return { next: 'migrate', state: this.spend(s, code) };
  }

  /** The decision for a failed attempt `ev` of a request in state `s`. */
  next(s: PlanState, ev: PlanEvent): Decision {
    if (ev.code === 'needs_prefill' && ev.local && !ev.attemptOutput) return { next: 'fallback', state: s };
    if (!this.retryable(ev.code, ev.status) || !this.inTime(s, ev.now) || !this.budgetAllows(s, ev.code)) return { next: 'fail', state: s };
    return ev.output ? this.migrate(s, ev.code) : this.retry(s, ev.code);
  }
}
