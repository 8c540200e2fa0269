/**
 * The HTTP server timeouts every role's server takes (router, prefill, decode, colocated):
 *
 * | field | Node's server setting | default | what it bounds |
 * |---|---|---|---|
 * | keepAliveMs | `keepAliveTimeout` | 72000 | how long an idle keep-alive connection stays open (the `Keep-Alive: timeout=` header says it, in seconds) |
 * | headersMs | `headersTimeout` | 60000 | time to receive one request's headers |
 * | requestMs | `requestTimeout` | 0 (none) | time to receive one whole request (headers and body) |
 *
 * Behind a load balancer or proxy that reuses connections, the server's keep-alive must exceed
 * the balancer's idle timeout: else the server may close a connection the balancer is just
 * sending a request on, and that request gets a reset (docs/OPERATIONS.md "Behind a load
 * balancer"). 72 s is fastify's default, above the common 60 s.
 */
import { z } from 'zod';

/** The timeouts as configs carry them, ms. */
export const HttpTimeoutsSchema = z
  .object({
    keepAliveMs: z.number().int().min(1).max(24 * 3_600_000).default(72_000),
    headersMs: z.number().int().min(1).max(24 * 3_600_000).default(60_000),
    requestMs: z.number().int().min(0).max(24 * 3_600_000).default(0),
  })
  .strict()
  .refine((t) => t.requestMs === 0 || t.headersMs <= t.requestMs, { message: 'the headers timeout cannot exceed the request timeout', path: ['headersMs'] })
  .default({});

export type HttpTimeouts = z.infer<typeof HttpTimeoutsSchema>;

/** The defaults (HttpTimeoutsSchema with nothing set). */
export const DEFAULT_HTTP_TIMEOUTS: Readonly<HttpTimeouts> = Object.freeze(HttpTimeoutsSchema.parse(undefined));

/** Fastify's server options for `t` (absent: the defaults). */
export function fastifyTimeoutOptions(t: Partial<HttpTimeouts> | undefined): { keepAliveTimeout: number; requestTimeout: number } {
  return { keepAliveTimeout: t?.keepAliveMs ?? DEFAULT_HTTP_TIMEOUTS.keepAliveMs, requestTimeout: t?.requestMs ?? DEFAULT_HTTP_TIMEOUTS.requestMs };
}

/**
 * Set `t` on a created Node server (fastify's `app.server`): the headers timeout fastify does not
 * take as an option, and the two it does (so a server made elsewhere gets them too).
 */
export function applyHttpTimeouts(server: { keepAliveTimeout: number; headersTimeout: number; requestTimeout: number }, t: Partial<HttpTimeouts> | undefined): void {
  const f = fastifyTimeoutOptions(t);
  server.keepAliveTimeout = f.keepAliveTimeout;
  server.requestTimeout = f.requestTimeout;
  server.headersTimeout = t?.headersMs ?? DEFAULT_HTTP_TIMEOUTS.headersMs;
}
