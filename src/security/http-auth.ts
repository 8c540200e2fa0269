/**
 * Client-side credentials of pdserve's own HTTP calls, as ONE undici dispatcher composition
 * (undici's interceptor API: `dispatcher.compose(...)`), so every call made through it carries
 * them and no call site adds a header by hand:
 *
 *   bearerFor(origins, key)  `Authorization: Bearer KEY` on requests to those origins only (the
 *                            doctor's admin key goes to the router, never to a worker)
 *   signWith(secret, skip)   `x-pdserve-signature` (./request-auth.ts) on every request, except
 *                            to the origins `skip` lists (the router itself)
 *
 * `withCredentials(c, base)` composes what `c` names onto `base`. A signed request's body must
 * be a string or bytes (what pdserve's own calls send) or an async iterable of bytes (what
 * fetch() hands a dispatcher), which is read into memory (at most 64 MiB) to be hashed.
 *
 * `signGlobally(origins, secret, tls?)`: fetch() and undici calls without a dispatcher of this
 * process sign their requests to these origins (the harness's clusters, the storm, bench's
 * pd-direct), and with `tls` reach them over connections with those node:tls client options
 * (the internal CA and client certificate of https:// workers).
 */
import { Agent, getGlobalDispatcher, setGlobalDispatcher, type Dispatcher } from 'undici';
import { bodyDigest, httpKeyOf, signRequest, SIGNATURE_HEADER } from './request-auth.js';
import { PdError } from '../base/errors.js';

/** What a client sends: an admin/API key for some origins; request signatures from the cluster secret. */
export interface ClientCredentials {
  /** Bearer key and the origins (scheme://host:port) it is sent to. */
  bearer?: { key: string; origins: readonly string[] };
  /** Sign every request with this cluster secret, except those to `skipOrigins`. */
  sign?: { secret: string; skipOrigins?: readonly string[] };
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

/** A bearer key, or the key for a request path (path with query, e.g. an API key for /v1/*, the admin key for /workers). */
export type BearerKey = string | ((path: string) => string);

/**
 * Interceptor: `Authorization: Bearer KEY` on requests to `origins` (exact scheme://host:port),
 * unless the request already has an Authorization header.
 */
export function bearerFor(origins: readonly string[], key: BearerKey): Dispatcher.DispatcherComposeInterceptor {
  const set = new Set(origins.map((o) => new URL(o).origin));
  return (dispatch) => (opts, handler) => {
    if (!set.has(originOf(opts.origin))) return dispatch(opts, handler);
    const headers = headersObject(opts.headers);
    if (headers.authorization === undefined) headers.authorization = `Bearer ${typeof key === 'string' ? key : key(opts.path)}`;
    return dispatch({ ...opts, headers }, handler);
  };
}

/** Largest body a signing interceptor reads into memory from an async iterable, bytes. */
const MAX_SIGNED_STREAM = 64 * 1024 * 1024;

type Body = Dispatcher.DispatchOptions['body'];

/** A body the signer can hash as it is. */
const isBytes = (b: Body): b is string | Uint8Array | null | undefined => b === null || b === undefined || typeof b === 'string' || b instanceof Uint8Array;

async function collect(body: AsyncIterable<unknown>): Promise<Buffer> {
  const parts: Buffer[] = [];
  let n = 0;
  for await (const c of body) {
    const b = typeof c === 'string' ? Buffer.from(c) : Buffer.from(c as Uint8Array);
    n += b.length;
    if (n > MAX_SIGNED_STREAM) throw new PdError('body_too_large', `signed request body larger than ${MAX_SIGNED_STREAM} bytes`);
    parts.push(b);
  }
  return Buffer.concat(parts);
}

/** Report an error to an undici handler of either API (undici 7's onResponseError, or the older onError). */
function fail(handler: Dispatcher.DispatchHandler, err: Error): void {
  const h = handler as { onResponseError?: (c: unknown, e: Error) => void; onError?: (e: Error) => void };
  if (h.onResponseError) h.onResponseError(null, err);
  else h.onError?.(err);
}

/**
 * Interceptor: sign every request (method, path with query, now, a fresh nonce, the body's
 * SHA-256) with the cluster secret's HTTP key, except to `skip` origins (a request to them passes
 * unchanged). An unsupported body (a stream that is not async-iterable) fails the request.
 */
export function signWith(secret: string, skip: () => ReadonlySet<string> = () => new Set()): Dispatcher.DispatcherComposeInterceptor {
  const key = httpKeyOf(secret);
  return (dispatch) => (opts, handler) => {
    if (skip().has(originOf(opts.origin))) return dispatch(opts, handler);
    const send = (body: string | Uint8Array | null | undefined): boolean => {
      const headers = headersObject(opts.headers);
      headers[SIGNATURE_HEADER] = signRequest(key, opts.method, opts.path, bodyDigest(body));
      return dispatch({ ...opts, headers, body: body ?? null }, handler);
    };
    if (isBytes(opts.body)) return send(opts.body);
    const it = opts.body as unknown as Partial<AsyncIterable<unknown>>;
    if (typeof it[Symbol.asyncIterator] !== 'function') {
      fail(handler, new TypeError('a signed request body must be a string, bytes or an async iterable'));
      return true;
    }
    collect(it as AsyncIterable<unknown>).then(send, (err: Error) => fail(handler, err));
    return true;
  };
}

/** `base` (default: a new Agent) with the interceptors `c` asks for; `base` itself when none. */
export function withCredentials(c: ClientCredentials, base: Dispatcher = new Agent()): Dispatcher {
  const ics: Dispatcher.DispatcherComposeInterceptor[] = [];
  if (c.bearer) ics.push(bearerFor(c.bearer.origins, c.bearer.key));
  if (c.sign) {
    const skip = new Set((c.sign.skipOrigins ?? []).map((o) => new URL(o).origin));
    ics.push(signWith(c.sign.secret, () => skip));
  }
  return ics.length ? base.compose(...ics) : base;
}

/** origin → its interceptors (signer, bearer key) and the pool to reach it through (TLS options), for the process-wide dispatcher (`reachGlobally`). */
interface GlobalRoute {
  wrap: Dispatcher.DispatcherComposeInterceptor[];
  via?: Dispatcher;
}
const globalSigners = new Map<string, GlobalRoute>();
let globalInstalled = false;

/**
 * Interceptor: requests to an origin registered with `signGlobally` are signed with its secret
 * (and sent through its TLS pool when it has one); others pass unchanged. The global dispatcher
 * has it; compose it onto a dispatcher of your own (bench's pool) to get the same.
 */
export function registeredSigners(): Dispatcher.DispatcherComposeInterceptor {
  return (dispatch) => {
    const bound = new Map<object, Dispatcher['dispatch']>();
    return (opts, handler) => {
      const s = globalSigners.get(originOf(opts.origin));
      if (!s) return dispatch(opts, handler);
      let d = bound.get(s);
      if (!d) {
        d = s.via ? s.via.dispatch.bind(s.via) : dispatch;
        for (const w of s.wrap) d = w(d);
        bound.set(s, d);
      }
      return d(opts, handler);
    };
  };
}

/**
 * Make this process's global undici dispatcher (fetch(), undici's request() without a
 * dispatcher) and every dispatcher composed with `registeredSigners()` sign requests to
 * `origins` with `secret`; other origins pass unchanged. `tls`: node:tls client options of the
 * connections to them (./tls.ts `internalClientOptions`), through a pool of their own.
 * Returns the undo (the origins forgotten, that pool closed). Several clusters with different
 * secrets may be registered.
 */
export function signGlobally(origins: readonly string[], secret: string, tls?: object): () => void {
  return reachGlobally(origins, { secret, ...(tls ? { tls } : {}) });
}

/**
 * `signGlobally` in general: requests of this process to `origins` are signed with `c.secret`,
 * carry `Authorization: Bearer c.bearer` (a router's API or admin key: the storm, bench) and go
 * over connections with the node:tls client options `c.tls` (a CA, a client certificate) —
 * whatever of the three is given. Returns the undo.
 */
export function reachGlobally(origins: readonly string[], c: { secret?: string; bearer?: BearerKey; tls?: object }): () => void {
  const list = origins.map((o) => new URL(o).origin);
  const wrap = [...(c.secret ? [signWith(c.secret)] : []), ...(c.bearer ? [bearerFor(list, c.bearer)] : [])];
  const signer: GlobalRoute = { wrap, ...(c.tls ? { via: new Agent({ connect: c.tls }) } : {}) };
  for (const o of list) globalSigners.set(o, signer);
  if (!globalInstalled) {
    globalInstalled = true;
    setGlobalDispatcher(getGlobalDispatcher().compose(registeredSigners()));
  }
  return () => {
    for (const o of list) if (globalSigners.get(o) === signer) globalSigners.delete(o);
    void signer.via?.close().catch(() => {});
  };
}
