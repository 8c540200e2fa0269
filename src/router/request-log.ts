/**
 * The router's per-request log lines (fastify's `LogController`, which its docs say to extend to
 * change the built-in lines).
 *
 *  - GET requests (probes, dashboard): no per-request lines.
 *  - Generation requests (POST /v1/completions, /v1/chat/completions): fastify's
 *    'incoming request' line is written at debug, not info. At info it was serialized and written
 *    synchronously (pino.destination(2)) before the request was parsed and dispatched, i.e. on
 *    every request's TTFT path. The
 *    'request completed' line (info, written once the response is over) carries the request's
 *    fields instead (`req`: method, url, host, remote address and port), and the router's own
 *    'request finished' line (dispatch.ts) has its outcome and timings, so an info-level log
 *    still names every request with its rid.
 *  - Other POSTs (/tokenize, /workers/probe, …): fastify's lines, unchanged.
 */
import { LogController, type FastifyReply, type FastifyRequest } from 'fastify';

/** True for the two generation routes (their URL, query string allowed). */
export function isGenerationRequest(req: { method?: string; url?: string }): boolean {
  const url = req.url ?? '';
  return req.method === 'POST' && (url.startsWith('/v1/completions') || url.startsWith('/v1/chat/completions'));
}

/** See the module doc. Construct with `{ requestIdLogLabel }` like fastify's. */
export class RouterLogController extends LogController {
  constructor(opts: { requestIdLogLabel?: string } = {}) {
    super({ ...opts, disableRequestLogging: (req) => req.method === 'GET' });
  }

  override incomingRequest(request: FastifyRequest, reply: FastifyReply, metadata?: Record<string, unknown>): void {
    if (!isGenerationRequest(request)) return super.incomingRequest(request, reply, metadata);
    request.log.debug({ req: request }, 'incoming request'); // pino: a no-op function below debug
  }

  override requestCompleted(error: Error | null | undefined, request: FastifyRequest, reply: FastifyReply, metadata?: Record<string, unknown>): void {
    if (!isGenerationRequest(request)) return super.requestCompleted(error, request, reply, metadata);
    if (error) reply.log.error({ req: request, res: reply, err: error, responseTime: reply.elapsedTime }, 'request errored');
    else reply.log.info({ req: request, res: reply, responseTime: reply.elapsedTime }, 'request completed');
  }
}
