/**
 * Graceful drain, shared by every role (router, prefill, decode, colocated).
 *
 * A `DrainGate` sits in front of a fastify app's work routes (POST /generate,
 * /v1/completions, /v1/chat/completions). While serving it counts the requests in flight (one
 * per HTTP request, released when its response closes — streams included). Once draining:
 *  - new work is refused with 503 `{error: {code: 'draining'}}` and `retry-after: 1`; the router
 *    treats that answer as "pick another worker" and re-dispatches the request (it never reaches
 *    the client), and marks the worker draining at once;
 *  - GET /health answers 503 `{status: 'draining', ...}` so pollers and load balancers stop at once;
 *  - everything else (/abort_request, /metrics, the KV channel) keeps working, so the requests in
 *    flight can finish;
 *  - every response from then on says `connection: close` (also the streams of requests accepted
 *    before the drain whose headers had not left yet), and idle keep-alive sockets are closed when
 *    the drain starts: a client pool stops reusing sockets into a process that will close them
 *    (a request written into a socket the server closes at exit dies with "other side closed").
 *
 * `gracefulShutdown` is the sequence a process runs on SIGTERM: drain → wait until idle (at most
 * `timeoutMs`, or until a second signal) → deregister → close (which fails whatever is left
 * with the role's usual shutdown errors) → exit code 0.
 *
 * Borrowed idea: Kubernetes' preStop / terminationGracePeriod contract and SGLang's and vLLM's
 * "stop accepting, finish running requests" shutdown; the 503-then-retry-elsewhere rule is the
 * usual load-balancer drain (Envoy's drain_listeners).
 */
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import type { ServerResponse } from 'node:http';
import { systemClock } from '../base/clock.js';

/** Routes that carry work (only these are counted and refused while draining). */
export const WORK_ROUTES: ReadonlySet<string> = new Set(['/generate', '/v1/completions', '/v1/chat/completions']);

/** Error code of the 503 a draining process answers new work with. */
export const DRAINING_CODE = 'draining';

/** Body of that 503 (OpenAI error shape). */
export function drainingBody(role: string): { error: { message: string; type: string; param: null; code: string } } {
  return { error: { message: `${role} is draining (shutting down gracefully); retry on another instance`, type: 'server_error', param: null, code: DRAINING_CODE } };
}

/**
 * The `connection` header value for code that writes its own headers with `writeHead` (whose
 * headers override those set before): `close` once a draining `DrainGate` set it on `res`, else
 * `keep-alive`.
 */
export function connectionHeader(res: ServerResponse): string {
  return res.getHeader('connection') === 'close' ? 'close' : 'keep-alive';
}

/** In-flight counter + draining flag of one process. */
export class DrainGate {
  private _draining = false;
  private _inflight = 0;
  private readonly idleWaiters = new Set<() => void>();
  private readonly listeners = new Set<(draining: boolean) => void>();

  constructor(readonly role: string) {}

  get draining(): boolean {
    return this._draining;
  }

  /** Work requests whose response has not closed yet. */
  get inflight(): number {
    return this._inflight;
  }

  /** Count one unit of work; the returned function releases it (idempotent). */
  enter(): () => void {
    this._inflight++;
    let done = false;
    return () => {
      if (done) return;
      done = true;
      this._inflight--;
      if (this._inflight === 0) for (const w of [...this.idleWaiters]) w();
    };
  }

  /** Refuse new work from now on. Idempotent; listeners (e.g. membership) hear it once. */
  startDraining(): void {
    if (this._draining) return;
    this._draining = true;
    for (const l of this.listeners) l(true);
  }

  /**
   * Take work again after a drain that did not end the process (a worker's role switch: drained,
   * rebuilt, serving again). Listeners hear `false`. Idempotent.
   */
  reopen(): void {
    if (!this._draining) return;
    this._draining = false;
    for (const l of this.listeners) l(false);
  }

  /** Called when draining starts (`true`) and when a drained gate reopens (`false`). Returns a disposer. */
  onDraining(fn: (draining: boolean) => void): () => void {
    this.listeners.add(fn);
    return () => this.listeners.delete(fn);
  }

  /**
   * Resolve true when no work is in flight, false when `timeoutMs` passed or `signal` fired first.
   */
  waitIdle(timeoutMs: number, signal?: AbortSignal): Promise<boolean> {
    if (this._inflight === 0) return Promise.resolve(true);
    return new Promise<boolean>((resolve) => {
      const done = (ok: boolean) => {
        clearTimeout(t);
        this.idleWaiters.delete(onIdle);
        signal?.removeEventListener('abort', onAbort);
        resolve(ok);
      };
      const onIdle = () => done(true);
      const onAbort = () => done(false);
      const t = setTimeout(() => done(false), timeoutMs);
      this.idleWaiters.add(onIdle);
      if (signal?.aborted) return done(false);
      signal?.addEventListener('abort', onAbort, { once: true });
    });
  }

  /**
   * Install on a fastify app (before it listens): counts work routes and refuses them while
   * draining or closing (create the app with `return503OnClosing: false` so requests reaching a
   * closing app get here). The hook runs before body parsing, so a refused request costs nothing.
   * `closeIdle` (default true): close idle keep-alive sockets when the drain starts, so clients
   * reconnect elsewhere at once. Workers pass false: their one client is the router, and a request
   * already on its way over an idle socket would be reset (ECONNRESET, read as a failed worker)
   * where the drain's `draining` 503 with `connection: close` re-dispatches it with nothing failed.
   */
  install(app: FastifyInstance, opts: { closeIdle?: boolean } = {}): void {
    const closeIdle = opts.closeIdle ?? true;
    // Work responses whose headers have not left yet: told `connection: close` when the drain starts.
    const open = new Set<ServerResponse>();
    // Closing (app.close(): after the drain, or without one): work is refused the same way. With
    // fastify's `return503OnClosing: false` a request arriving on a still-open socket then gets
    // this `draining` 503 (the router re-dispatches it) instead of fastify's bare 503.
    let closing = false;
    app.addHook('preClose', async () => {
      closing = true;
    });
    this.onDraining((draining) => {
      if (!draining) return;
      for (const res of open) if (!res.headersSent) res.setHeader('connection', 'close');
      if (closeIdle) app.server.closeIdleConnections?.();
    });
    app.addHook('onRequest', async (req: FastifyRequest, reply: FastifyReply) => {
      const refusing = this._draining || closing;
      if (refusing) reply.raw.setHeader('connection', 'close');
      if (req.method !== 'POST' || !WORK_ROUTES.has(req.routeOptions.url ?? '')) {
        // Other routes of a closing app: fastify's own answer (its return503OnClosing).
        if (closing) return reply.code(503).send({ error: 'Service Unavailable', message: 'Service Unavailable', statusCode: 503 });
        return;
      }
      if (refusing) {
        return reply.code(503).header('retry-after', '1').type('application/json; charset=utf-8').send(drainingBody(this.role));
      }
      const release = this.enter();
      const res = reply.raw;
      open.add(res);
      res.once('close', () => {
        open.delete(res);
        release();
      });
    });
  }
}

export interface ShutdownOptions {
  gate: DrainGate;
  /** Longest wait for in-flight work, ms. */
  timeoutMs: number;
  /** Fires on a second signal: stop waiting, fail the rest now. */
  force: AbortSignal;
  /** Remove this process from membership (etcd lease revoke); failures are logged, not thrown. */
  deregister?: () => Promise<void>;
  /** Fail what is left and release everything (the role's close()). */
  close: () => Promise<void>;
  log: { info(o: object, m: string): void; warn(o: object, m: string): void };
}

/**
 * Drain, wait, deregister, close. Resolves with `drained` = every request finished on its own.
 * Never rejects.
 */
export async function gracefulShutdown(o: ShutdownOptions): Promise<{ drained: boolean; left: number; ms: number }> {
  const t0 = systemClock.nowMs();
  o.gate.startDraining();
  o.log.info({ inflight: o.gate.inflight, timeout_ms: o.timeoutMs }, 'draining: new work is refused, waiting for requests in flight');
  const drained = await o.gate.waitIdle(o.timeoutMs, o.force);
  const left = o.gate.inflight;
  if (drained) o.log.info({ ms: Math.round(systemClock.nowMs() - t0) }, 'drained: no request in flight');
  else o.log.warn({ left, reason: o.force.aborted ? 'second signal' : 'drain timeout' }, 'drain cut short: failing the requests left');
  if (o.deregister) await o.deregister().catch((err: unknown) => o.log.warn({ err: (err as Error)?.message ?? String(err) }, 'deregistration failed'));
  await o.close().catch((err: unknown) => o.log.warn({ err: (err as Error)?.message ?? String(err) }, 'close failed'));
  return { drained, left, ms: Math.round(systemClock.nowMs() - t0) };
}
