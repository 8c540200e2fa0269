/**
 * Client-side credentials of pdserve's own HTTP calls, as ONE undici dispatcher composition
 * (undici's interceptor API: `dispatcher.compose(...)`), so every call made through it carries
 * them and no call site adds a header by hand:
 *
 *   bearerFor(origins, key)  `Authorization: Bearer KEY` on requests to those origins only (the
 *                            doctor's admin key goes to the router, never to a worker)
 *
 * `withCredentials(base, c)` composes what `c` names onto `base`.
 */
import { Agent, type Dispatcher } from 'undici';

/** What a client sends: an admin/API key for some origins. */
export interface ClientCredentials {
  /** Bearer key and the origins (scheme://host:port) it is sent to. */
  bearer?: { key: string; origins: readonly string[] };
}

type Headers = Record<string, string | string[] | undefined>;

/** The request's headers as a plain object (undici accepts an object, a flat array or null). */
export function headersObject(h: Dispatcher.DispatchOptions['headers']): Headers {
  if (!h) return {};
  if (Array.isArray(h)) {
    const o: Headers = {};
    for (let i = 0; i + 1 < h.length; i += 2) o[String(h[i]).toLowerCase()] = h[i + 1] as string;
    return o;
  }
  if (typeof (h as Partial<Iterable<unknown>>)[Symbol.iterator] === 'function') {
    const o: Headers = {};
    for (const [k, v] of h as Iterable<[string, string]>) o[k.toLowerCase()] = v;
    return o;
  }
  const o: Headers = {};
  for (const [k, v] of Object.entries(h as Record<string, string | string[] | undefined>)) o[k.toLowerCase()] = v;
  return o;
}

const originOf = (o: Dispatcher.DispatchOptions['origin']): string => (o === undefined ? '' : new URL(String(o)).origin);

/**
 * Interceptor: `Authorization: Bearer KEY` on requests to `origins` (exact scheme://host:port),
 * unless the request already has an Authorization header.
 */
export function bearerFor(origins: readonly string[], key: string): Dispatcher.DispatcherComposeInterceptor {
  const set = new Set(origins.map((o) => new URL(o).origin));
  return (dispatch) => (opts, handler) => {
    if (!set.has(originOf(opts.origin))) return dispatch(opts, handler);
    const headers = headersObject(opts.headers);
    if (headers.authorization === undefined) headers.authorization = `Bearer ${key}`;
    return dispatch({ ...opts, headers }, handler);
  };
}

/** `base` (default: a new Agent) with the interceptors `c` asks for; `base` itself when none. */
export function withCredentials(c: ClientCredentials, base: Dispatcher = new Agent()): Dispatcher {
  const ics: Dispatcher.DispatcherComposeInterceptor[] = [];
  if (c.bearer) ics.push(bearerFor(c.bearer.origins, c.bearer.key));
  return ics.length ? base.compose(...ics) : base;
}
