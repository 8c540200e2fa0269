/**
 * Request traces at the router: one trace id per request, carried to prefill and decode.
 *
 * - `traceIdOf(headers)`: the client's W3C `traceparent` trace-id (32 lowercase hex), else its
 *   `x-request-id` (1–128 of `[A-Za-z0-9._:/-]`), else a fresh 32-hex id (W3C format, so it can be
 *   passed on to a tracing system as is). The router sends it to the workers as the `trace_id`
 *   field of `/generate`; every log line of the request carries `trace`, the workers' GET
 *   /debug/rooms shows it per room, and the response header `x-trace-id` returns it.
 * - `TraceStore`: the router's side of each recent request (bounded ring, `max` entries): rid,
 *   trace, room, the two workers, and timestamped events (received, dispatched, prefill_done,
 *   first_token, finished). Read by GET /debug/traces/:id (id = trace id or rid) and by
 *   `pdserve doctor --request`, which joins it with the workers' room timelines. `onFinished`
 *   feeds the dashboard's time series.
 *
 * Ids follow the W3C Trace Context recommendation (traceparent = version-traceid-parentid-flags).
 */
import { systemClock } from '../base/clock.js';
import { randomHex } from './random-pool.js';
import type { TraceEvent, RequestTrace } from '../protocol/trace.js';
export type { TraceEvent, RequestTrace };

const TRACEPARENT = /^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$/;
const REQUEST_ID = /^[A-Za-z0-9._:/-]{1,128}$/;
/** Most events (and rooms) one trace keeps: a request with several attempts records a few per attempt. */
const MAX_EVENTS = 32;

/** A fresh W3C trace id: 32 lowercase hex digits, never all zero. */
export function newTraceId(): string {
  return randomHex(16);
}

/**
 * Trace id of a request from its headers (see the module doc). Invalid values are ignored, never
 * an error: a bad header must not fail the request.
 */
export function traceIdOf(headers: Record<string, string | string[] | undefined>): string {
  const one = (v: string | string[] | undefined) => (Array.isArray(v) ? v[0] : v)?.trim();
  const tp = one(headers.traceparent)?.toLowerCase();
  const m = tp ? TRACEPARENT.exec(tp) : null;
  if (m && !/^0+$/.test(m[1]!) && !tp!.startsWith('ff')) return m[1]!;
  const rid = one(headers['x-request-id']);
  if (rid && REQUEST_ID.test(rid)) return rid;
  return newTraceId();
}

/** What the dispatch code reports about a request (DispatchContext.observe). */
export interface RequestObserver {
  /** The trace id `begin` recorded for `rid` (sent to the workers), if any. */
  traceOf(rid: string): string | undefined;
  /** Record an event of `rid`; unknown rids are ignored. */
  event(rid: string, what: TraceEvent['what'], fields?: Record<string, unknown>): void;
}

/** Bounded store of recent request traces (oldest evicted first). */
export class TraceStore implements RequestObserver {
  private readonly byRid = new Map<string, RequestTrace>();
  private readonly byTrace = new Map<string, RequestTrace>();
  private readonly byLabel = new Map<string, RequestTrace>();
  /** Called with each request's trace when its 'finished' event is recorded. */
  onFinished: ((t: RequestTrace, fields: Record<string, unknown>) => void) | null = null;

  constructor(readonly max = 2000) {}

  /** Start the trace of request `rid` (received now). */
  begin(rid: string, trace: string, at = systemClock.wallMs()): RequestTrace {
    const t: RequestTrace = { trace, rid, room: null, rooms: [], label: null, prefill: null, decode: null, events: [{ at, what: 'received' }], outcome: null };
    this.byRid.set(rid, t);
    this.byTrace.set(trace, t);
    while (this.byRid.size > this.max) {
      const [oldRid, old] = this.byRid.entries().next().value as [string, RequestTrace];
      this.byRid.delete(oldRid);
      if (this.byTrace.get(old.trace) === old) this.byTrace.delete(old.trace);
      if (old.label !== null && this.byLabel.get(old.label) === old) this.byLabel.delete(old.label);
    }
    return t;
  }

  traceOf(rid: string): string | undefined {
    return this.byRid.get(rid)?.trace;
  }

  event(rid: string, what: TraceEvent['what'], fields: Record<string, unknown> = {}): void {
    const t = this.byRid.get(rid);
    if (!t) return;
    if (what === 'dispatched') {
      t.room = typeof fields.room === 'string' ? fields.room : t.room;
      if (typeof fields.room === 'string' && t.rooms.length < MAX_EVENTS) t.rooms.push(fields.room);
      t.prefill = typeof fields.prefill === 'string' ? fields.prefill : t.prefill;
      t.decode = typeof fields.decode === 'string' ? fields.decode : t.decode;
    }
    if (t.events.length < MAX_EVENTS) t.events.push({ at: systemClock.wallMs(), what, ...fields });
    if (what === 'finished') {
      t.outcome = typeof fields.outcome === 'string' ? fields.outcome : 'unknown';
      this.onFinished?.(t, fields);
    }
  }

  /**
   * Close the trace of `rid` if nothing recorded its end: a request refused before dispatch (bad
   * body, no healthy pair) or a fan-out parent, whose choices carry traces of their own. The
   * outcome comes from the HTTP status (`status` < 400 ok, < 500 rejected, else error). Not passed
   * to `onFinished`: the dashboard's series hold dispatched requests only. Idempotent. `at`: when
   * the response ended (wall ms; default now), so a settle run later still dates the finish right.
   */
  settle(rid: string, status: number, at: number = systemClock.wallMs()): void {
    const t = this.byRid.get(rid);
    if (!t || t.outcome !== null) return;
    t.outcome = status < 400 ? 'ok' : status < 500 ? 'rejected' : 'error';
    if (t.events.length < MAX_EVENTS) t.events.push({ at, what: 'finished', outcome: t.outcome, status });
  }

  /**
   * Record the client's own id of request `rid` (the body's `request_id`): a label, findable by
   * `get`, never a key the workers see. Unknown rids are ignored.
   */
  label(rid: string, label: string): void {
    const t = this.byRid.get(rid);
    if (!t) return;
    t.label = label;
    if (!this.byTrace.has(label)) this.byLabel.set(label, t);
  }

  /** A trace by trace id, rid or label (an id reused by several requests: the latest). */
  get(id: string): RequestTrace | undefined {
    return this.byTrace.get(id) ?? this.byRid.get(id) ?? this.byLabel.get(id);
  }

  /** The newest `n` traces, newest first. */
  recent(n = 50): RequestTrace[] {
    return [...this.byRid.values()].slice(-n).reverse();
  }
}
