/**
 * Pieces every worker's HTTP server shares: a fastify instance whose errors are OpenAI error
 * bodies, GET /health, GET /metrics and GET /debug/rooms, and a deferred helper.
 */
import Fastify, { type FastifyInstance, type FastifyReply } from 'fastify';
import type { Registry } from 'prom-client';
import { ApiError, toApiError } from './errors.js';
import type { Logger } from './log.js';

export interface WorkerAppOptions {
  log: Logger;
  registry: Registry;
  /** Body of GET /health (status 'ok' added). */
  health(): Record<string, unknown>;
  /** Body of GET /debug/rooms. */
  debugRooms(): unknown;
  /** Largest request body, bytes. */
  bodyLimit?: number;
}

/** Create a fastify app with the shared endpoints; the caller adds role routes, then listens. */
export function createWorkerApp(o: WorkerAppOptions): FastifyInstance {
  const app = Fastify({ loggerInstance: o.log, bodyLimit: o.bodyLimit ?? 8 * 1024 * 1024, disableRequestLogging: true });
  app.setErrorHandler((err, _req, reply) => {
    sendError(reply, httpError(err));
  });
  app.setNotFoundHandler((req, reply) => {
    sendError(reply, new ApiError(404, 'not_found', `no route ${req.method} ${req.url}`, 'not_found_error'));
  });
  app.get('/health', async () => ({ status: 'ok', ...o.health() }));
  app.get('/metrics', async (_req, reply) => {
    reply.header('content-type', o.registry.contentType);
    return o.registry.metrics();
  });
  app.get('/debug/rooms', async () => o.debugRooms());
  return app;
}

/** Fastify's own errors (bad JSON, body too large, wrong content type) → ApiError. */
export function httpError(err: unknown): ApiError {
  const e = err as { code?: string; statusCode?: number; message?: string };
  if (err instanceof ApiError) return err;
  if (typeof e?.statusCode === 'number' && e.statusCode >= 400 && e.statusCode < 500) {
    const code = e.statusCode === 413 ? 'request_too_large' : e.code === 'FST_ERR_CTP_INVALID_JSON_BODY' || e instanceof SyntaxError ? 'invalid_json' : 'invalid_request';
    return new ApiError(e.statusCode, code, e.message ?? 'bad request');
  }
  return toApiError(err);
}

/** Send an OpenAI error body unless the response has started. */
export function sendError(reply: FastifyReply, err: ApiError): void {
  if (reply.sent || reply.raw.headersSent) {
    if (!reply.raw.writableEnded) reply.raw.end();
    return;
  }
  void reply.code(err.status).type('application/json').send(err.toBody());
}

/** A promise with its resolve/reject exposed; settles once (later calls are ignored). */
export interface Deferred<T> {
  promise: Promise<T>;
  resolve(v: T): void;
  reject(e: unknown): void;
  settled: boolean;
}
export function deferred<T>(): Deferred<T> {
  let res!: (v: T) => void;
  let rej!: (e: unknown) => void;
  const d: Deferred<T> = {
    promise: new Promise<T>((a, b) => {
      res = a;
      rej = b;
    }),
    settled: false,
    resolve(v) {
      if (d.settled) return;
      d.settled = true;
      res(v);
    },
    reject(e) {
      if (d.settled) return;
      d.settled = true;
      rej(e);
    },
  };
  d.promise.catch(() => {});
  return d;
}

/** Calls `fn` once when the client goes away before the response finished. Returns a disposer. */
export function onClientGone(reply: FastifyReply, fn: () => void): () => void {
  const res = reply.raw;
  const h = () => {
    if (!res.writableFinished) fn();
  };
  res.once('close', h);
  return () => res.off('close', h);
}
