/**
 * The router's per-request trace as it crosses HTTP (GET /debug/traces, GET /debug/traces/:id):
 * written by the router (../router/trace.ts `TraceStore`), read by the doctor and the dashboard.
 */

/** One event of a request at the router. `at`: wall-clock ms since the epoch, a date (never a duration). */
export interface TraceEvent {
  at: number;
  what: 'received' | 'dispatched' | 'prefill_done' | 'first_token' | 'attempt_failed' | 'operator_abort' | 'finished';
  [field: string]: unknown;
}

/** The router's record of one request (JSON of GET /debug/traces/:id). */
export interface RequestTrace {
  trace: string;
  rid: string;
  /** The room of the latest attempt. */
  room: string | null;
  /** Every attempt's room, in order (a retried or migrated request has several). */
  rooms: string[];
  /** The client's own id for the request (the body's `request_id`), when it sent one. */
  label: string | null;
  prefill: string | null;
  decode: string | null;
  events: TraceEvent[];
  /** Set by the 'finished' event. */
  outcome: string | null;
}
