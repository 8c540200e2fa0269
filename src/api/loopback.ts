/**
 * Requests a server sends to itself over HTTP (fan-out sub-requests: ./fanout.ts; /v1/responses
 * over the chat path: ./responses-http.ts): the connection pool and the address to use, so each
 * such request is an ordinary request of that server (its dispatch, deadlines, aborts, metrics).
 */
import { randomBytes, timingSafeEqual } from 'node:crypto';
import { Agent, type Dispatcher } from 'undici';
import type { FastifyRequest } from 'fastify';
import { ApiError } from './errors.js';

/**
 * Loopback connections (one per sub-request in flight); safety timeouts only, the callee's
 * deadline fires first. Over HTTPS the certificate is not checked: the connection goes to this
 * process's own listening address.
 */
export const loopback: Dispatcher = new Agent({ connections: 256, headersTimeout: 600_000, bodyTimeout: 600_000, connect: { rejectUnauthorized: false } });

/** Request headers a loopback request carries over: credentials and trace / session identity. */
export const FORWARDED_HEADERS = ['authorization', 'x-api-key', 'x-trace-id', 'x-session-id'] as const;

/** Marks a request this process sent itself (a random token of this process; never forwarded from a client). */
const LOOPBACK_HEADER = 'x-pdserve-loopback';
const LOOPBACK_TOKEN = randomBytes(16).toString('hex');

/** The response id of the request a fan-out sub-request belongs to (the router's POST /abort_request finds its choices by it). */
export const PARENT_RID_HEADER = 'x-pdserve-parent-rid';

/** The parent's response id of one of this process's own fan-out sub-requests; undefined for any other request (a client cannot set it). */
export function parentRidOf(request: { headers: Record<string, unknown> }): string | undefined {
  const v = request.headers[PARENT_RID_HEADER];
  return typeof v === 'string' && isLoopback(request) ? v : undefined;
}

/** True when `request` is one of this process's own loopback sub-requests (./admission.ts does not admit it twice). */
export function isLoopback(request: { headers: Record<string, unknown> }): boolean {
  const v = request.headers[LOOPBACK_HEADER];
  return typeof v === 'string' && v.length === LOOPBACK_TOKEN.length && timingSafeEqual(Buffer.from(v), Buffer.from(LOOPBACK_TOKEN));
}

/** The FORWARDED_HEADERS `request` has, as a plain header object, plus this process's loopback mark. */
export function forwardedHeaders(request: FastifyRequest): Record<string, string> {
  const out: Record<string, string> = { [LOOPBACK_HEADER]: LOOPBACK_TOKEN };
  for (const h of FORWARDED_HEADERS) if (typeof request.headers[h] === 'string') out[h] = request.headers[h] as string;
  return out;
}

/**
 * http(s)://host:port this fastify server can reach itself at (wildcard addresses → loopback).
 * @throws ApiError 500 when the server is not listening.
 */
export function selfUrl(request: FastifyRequest): string {
  const a = request.server.server.address();
  if (!a || typeof a === 'string') throw new ApiError(500, 'internal_error', 'server address unknown', 'server_error');
  const host = a.address === '0.0.0.0' ? '127.0.0.1' : a.address === '::' ? '::1' : a.address;
  return `${request.protocol}://${host.includes(':') ? `[${host}]` : host}:${a.port}`;
}
