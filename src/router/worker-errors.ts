/**
 * THE mapping of a worker leg's failure to the client's error (one table for every way a leg
 * fails), so the attempt plan (./plan.ts) sees one shape whatever broke:
 *
 * | what failed | ApiError |
 * |---|---|
 * | an error answer (status + body, OpenAI shape or anything) | `workerError`: 4xx passed through untouched, 5xx prefixed with the role; a status outside 400–599 → 502; a worker refusing the router's signature → 502 `worker_unauthenticated` |
 * | an `{error}` event inside the worker's stream | `eventError`: the same, with the event's `status` when valid |
 * | an event that is not JSON, an SSE frame over the limit | 502 `bad_worker_event` |
 * | a stream that ended early | 502 `prefill_stream_truncated` / `decode_stream_truncated` (raised where it is seen) |
 * | the connection: refused, DNS, connect timeout | 502 `<role>_unreachable` (`unreachable`: the worker is marked so) |
 * | the connection: reset or closed by the worker | 502 `<role>_failed` (`closed`: the worker most likely died; out of the rotation until its next good probe) |
 * | the connection: anything else (a timeout) | 502 `<role>_failed` |
 * | the router's write to ITS client failed (`SSE_CLOSED`, `SSE_WRITE_TIMEOUT`, `SSE_SLOW_CLIENT`: cut for reading too slowly) | 499 `client_closed_request` (`clientGone`: not the worker's fault) |
 */
import { ApiError, asErrorCode, type ErrorCode } from '../base/errors.js';
import { SseError } from '../api/sse.js';
import { describeError, isConnectionClosed, isUnreachable } from './registry.js';

export type LegName = 'prefill' | 'decode';

/**
 * A worker's error answer: `status` and its body `text` (OpenAI shape or anything) → an ApiError
 * (4xx passed through untouched, 5xx prefixed with the worker's role; a status outside 400–599 →
 * 502; 401 `unauthenticated` → 502 `worker_unauthenticated`, the router's credential refused).
 */
export function workerError(role: LegName, status: number, text: string): ApiError {
  let message = text.trim().slice(0, 500) || `HTTP ${status}`;
  let code: ErrorCode = role === 'prefill' ? 'prefill_error' : 'decode_error';
  let type: string | undefined;
  let param: string | null = null;
  try {
    const j = JSON.parse(text) as { error?: { message?: unknown; code?: unknown; type?: unknown; param?: unknown } };
    if (j?.error && typeof j.error === 'object') {
      if (typeof j.error.message === 'string') message = j.error.message;
      code = asErrorCode(j.error.code, code);
      if (typeof j.error.type === 'string') type = j.error.type;
      if (typeof j.error.param === 'string') param = j.error.param;
    }
  } catch {
    // not JSON: keep the text
  }
  // The worker refused the router's own credential: a misconfigured worker, not the client's fault.
  if (status === 401 && code === 'unauthenticated') return ApiError.of('worker_unauthenticated', `${role} worker refused the router's signed request (does it run with another cluster secret?)`);
  const valid = status >= 400 && status <= 599;
  const out = valid ? status : 502;
  // 4xx: the client's fault (e.g. prompt too long): pass the message through untouched.
  // the worker's status and type are relayed as answered (the table decides only a missing type)
  if (out < 500) return new ApiError(out, code, message, (type ?? 'invalid_request_error') as ApiError['type'], param);
  return new ApiError(out, code, `${role} worker error: ${message}`, (type ?? 'server_error') as ApiError['type'], param);
}

/**
 * An `{error}` event inside a worker's stream (prefill: the handoff failed after token 1; decode:
 * generation failed) through `workerError`: its `status` when valid (prefill sends one), else
 * `fallbackStatus`.
 */
export function eventError(role: LegName, e: { message?: unknown; code?: unknown; type?: unknown; status?: unknown }, fallbackStatus: number): ApiError {
  const status = typeof e.status === 'number' && e.status >= 400 && e.status <= 599 ? e.status : fallbackStatus;
  return workerError(role, status, JSON.stringify({ error: { message: typeof e.message === 'string' ? e.message : `${role} failed`, code: e.code, type: e.type } }));
}

/** An event of a worker's stream that is not JSON: 502 `bad_worker_event`. */
export function badEvent(role: LegName): ApiError {
  return ApiError.of('bad_worker_event', `${role} worker sent an event that is not JSON`);
}

/** What a failure thrown while a leg ran means (see the module's table). */
export interface LegFailure {
  err: ApiError;
  /** The router's write to its own client failed: the request ends as the client's abort. */
  clientGone: boolean;
  /** A transport error (not an answer of the worker): ignored when the leg was aborted on purpose. */
  transport: boolean;
  /** The worker could not be connected to: mark it unreachable. */
  unreachable: boolean;
  /** The worker closed or reset the connection mid-request (it most likely died): out of the rotation until its next good probe. */
  closed: boolean;
}

/**
 * Map `thrown` — whatever a leg's request, stream read or client write threw — to its ApiError
 * (`role`'s worker at `url`; the address only in the message, which the router redacts for clients).
 */
export function legFailure(role: LegName, url: string, thrown: unknown): LegFailure {
  const of = (err: ApiError, o: Partial<Omit<LegFailure, 'err'>> = {}): LegFailure => ({ err, clientGone: false, transport: false, unreachable: false, closed: false, ...o });
  if (thrown instanceof SseError) {
    if (thrown.code === 'SSE_CLOSED' || thrown.code === 'SSE_WRITE_TIMEOUT' || thrown.code === 'SSE_SLOW_CLIENT') return of(ApiError.of('client_closed_request', `client stream failed: ${thrown.message}`), { clientGone: true });
    return of(ApiError.of('bad_worker_event', `${role} worker stream: ${thrown.message}`));
  }
  if (thrown instanceof ApiError) return of(thrown);
  if (isUnreachable(thrown)) return of(ApiError.of(`${role}_unreachable`, `${role} worker ${url} is unreachable: ${describeError(thrown)}`), { transport: true, unreachable: true });
  return of(ApiError.of(`${role}_failed`, `${role} worker ${url} failed: ${describeError(thrown)}`), { transport: true, closed: isConnectionClosed(thrown) });
}

/** The `cause` of an /abort_request (read by ../protocol/worker-protocol.ts `abortCauseOf`). */
export interface AbortCause {
  code: ErrorCode;
  message: string;
}

/** The cause an operator's abort (the router's POST /abort_request) gives every leg. */
export const OPERATOR_ABORT: AbortCause = { code: 'request_aborted', message: 'aborted by an operator (POST /abort_request on the router)' };

/**
 * Why the router aborts leg `leg` when the attempt ended because leg `failed.leg` failed with
 * `failed.err`: decode told that prefill refused the request (a 4xx: `prefill_refused`) or failed
 * it (`prefill_failed`), so its room does not read as a client's cancel; that prefill was
 * draining (`request_redispatched`: the request runs again elsewhere, nothing failed). Undefined
 * when there is nothing to tell (no leg failed, the leg itself failed, or decode's failure ends a
 * prefill leg).
 */
export function abortCause(leg: LegName, failed: { leg: LegName; err: ApiError } | null): AbortCause | undefined {
  if (!failed || failed.leg === leg || failed.leg !== 'prefill') return undefined;
  const { status, code, message } = failed.err;
  if (code === 'draining' || code === 'stale_epoch') return { code: 'request_redispatched', message: `prefill is ${code === 'draining' ? 'draining' : 'no longer the worker it was picked as'}: the request runs again on another pair (${message})` };
  const refused = status >= 400 && status < 500;
  return { code: refused ? 'prefill_refused' : 'prefill_failed', message: `prefill ${refused ? 'refused' : 'failed'} the request: ${status} ${code}: ${message}` };
}
