/**
 * Requests a server sends to itself over HTTP (fan-out sub-requests: ./fanout.ts; /v1/responses
 * over the chat path: ./responses-http.ts): the connection pool and the address to use, so each
 * such request is an ordinary request of that server (its dispatch, deadlines, aborts, metrics).
 */
import { Agent, type Dispatcher } from 'undici';
import type { FastifyRequest } from 'fastify';
import { ApiError } from './openai.js';

/**
 * Loopback connections (one per sub-request in flight); safety timeouts only, the callee's
 * deadline fires first. Over HTTPS the certificate is not checked: the connection goes to this
 * process's own listening address.
 */
export const loopback: Dispatcher = new Agent({ connections: 256, headersTimeout: 600_000, bodyTimeout: 600_000, connect: { rejectUnauthorized: false } });

/** Request headers a loopback request carries over: credentials and trace / session identity. */
export const FORWARDED_HEADERS = ['authorization', 'x-api-key', 'x-trace-id', 'x-session-id'] as const;

/** The FORWARDED_HEADERS `request` has, as a plain header object. */
export function forwardedHeaders(request: FastifyRequest): Record<string, string> {
  const out: Record<string, string> = {};
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
