/**
 * The /v1/responses routes, on the router and on the colocated server alike:
 *
 *   POST   /v1/responses        create (stream or not), see ./responses.ts for the mapping
 *   GET    /v1/responses/{id}   a stored response, else 404
 *   DELETE /v1/responses/{id}   {id, object: 'response', deleted: true}, else 404
 *   GET    /v1/responses/{id}/input_items   its context as items, paged (./responses-items.ts)
 *
 * A Responses request is served by the server's own /v1/chat/completions, called over HTTP on
 * its listening address (./loopback.ts, as fan-out sub-requests are): every property of the chat
 * path — pair choice, prefix-cache routing, decode-local continuation, redispatch on drain,
 * deadlines, aborts, tool calling, metrics, traces — holds for Responses without a second copy,
 * in PD and colocated mode. The cost is one loopback HTTP exchange per request (a local socket
 * and one more SSE parse per event). The chat request always streams (with the usage chunk); a non-stream Responses
 * request is assembled from it. The chat path's error answers (status and OpenAI body) pass
 * through before the stream, their `param` renamed to the Responses field (./responses-errors.ts);
 * a chat error event after it is `response.failed`.
 * A client that goes away aborts the chat request, which aborts the room on the workers.
 */
import type { SendQueueWatch } from '../runtime/send-queue.js';
import { tenantOf } from './access.js';
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { systemClock } from '../base/clock.js';
import { request, type Dispatcher } from 'undici';
import { ApiError, checkModelName } from './errors.js';
import { SSE_DONE } from './respond.js';
import { asErrorCode, codeSpec } from '../base/errors.js';
import { forwardedHeaders, loopback, selfUrl } from './loopback.js';
import { readSse, SseError, SseWriter } from './sse.js';
import { newItemId, parseResponsesRequest, ResponsesTranslator, storedRecordOf, type ResponsesEvent } from './responses.js';
import { ResponseStore } from './responses-store.js';
import { pageInputItems, type InputItemsQuery } from './responses-items.js';
import { responsesErrorText } from './responses-errors.js';
import { Gauge, type Registry } from 'prom-client';

export interface ResponsesRouteOptions {
  store: ResponseStore;
  /** Served model names (first = the responses' `model`, as on the chat path). */
  models(): readonly string[];
  /** Largest chat body sent (the server's own body limit), bytes. */
  bodyLimit: number;
  /** Safety deadline of the loopback request, ms (the chat path's own deadline fires first). */
  requestTimeoutMs: number;
  /** Max wait for the client to drain one event, ms. */
  writeTimeoutMs?: number;
  /** The server's send-queue watch: a stream whose client reads too slowly is cut (../runtime/send-queue.ts). */
  watch?: SendQueueWatch;
  /** Largest chat event read, bytes. */
  maxEventBytes?: number;
  /** Registry for pdserve_responses_stored{unit} (the store's entries and bytes, and its evictions). */
  registry?: Registry;
}

/** Largest chat error body passed through, bytes. */
const MAX_ERROR_BODY = 64 * 1024;

async function readBounded(body: AsyncIterable<Uint8Array>, max: number): Promise<string> {
  const parts: Buffer[] = [];
  let n = 0;
  for await (const c of body) {
    if (n >= max) continue;
    const b = Buffer.from(c).subarray(0, max - n);
    parts.push(b);
    n += b.length;
  }
  return Buffer.concat(parts).toString('utf8');
}

/** The Responses id of a chat rid (`chatcmpl-<hex>` → `resp_<hex>`): one id in both logs. */
function responseIdOf(rid: string | undefined): string {
  const m = rid ? /^chatcmpl-([0-9a-f]{8,64})$/.exec(rid) : null;
  return m ? `resp_${m[1]}` : newItemId('resp');
}


/**
 * Register the routes on `app` (before it is ready). Errors are OpenAI error bodies (400 naming
 * the Responses field, 404 for an unknown id).
 */
export function registerResponsesRoutes(app: FastifyInstance, o: ResponsesRouteOptions): void {
  if (o.registry) {
    const store = o.store;
    new Gauge({
      name: 'pdserve_responses_stored',
      help: 'Stored /v1/responses now (unit=responses), their bytes (unit=bytes), and the responses dropped by a bound since start (unit=evicted)',
      labelNames: ['unit'],
      registers: [o.registry],
      collect() {
        this.set({ unit: 'responses' }, store.size);
        this.set({ unit: 'bytes' }, store.bytes);
        this.set({ unit: 'evicted' }, store.evicted);
      },
    });
  }
  const notFound = (id: string) => new ApiError(404, 'not_found', `Response with id '${id}' not found.`, 'invalid_request_error', 'id');
  // Each tenant (API key) sees its own stored responses only: another's id is unknown (404).
  app.get<{ Params: { id: string } }>('/v1/responses/:id', async (req) => {
    const r = o.store.of(tenantOf(req)).get(req.params.id);
    if (!r) throw notFound(req.params.id);
    return r.response;
  });
  app.get<{ Params: { id: string }; Querystring: InputItemsQuery }>('/v1/responses/:id/input_items', async (req) => {
    const r = o.store.of(tenantOf(req)).get(req.params.id);
    if (!r) throw notFound(req.params.id);
    return pageInputItems(r.input, req.query ?? {});
  });
  app.delete<{ Params: { id: string } }>('/v1/responses/:id', async (req) => {
    if (!o.store.of(tenantOf(req)).delete(req.params.id)) throw notFound(req.params.id);
    return { id: req.params.id, object: 'response', deleted: true };
  });

  app.post('/v1/responses', async (req: FastifyRequest, reply: FastifyReply) => {
    const mine = o.store.of(tenantOf(req));
    const parsed = parseResponsesRequest(req.body, mine);
    checkModelName(parsed.chat.model as string | undefined, o.models());
    const body = JSON.stringify(parsed.chat);
    if (Buffer.byteLength(body) > o.bodyLimit) {
      throw new ApiError(400, 'context_length_exceeded', `the conversation (${Buffer.byteLength(body)} bytes with the previous responses) exceeds the server's request size limit (${o.bodyLimit} bytes)`, 'invalid_request_error', parsed.echo.previous_response_id ? 'previous_response_id' : 'input');
    }
    const headers: Record<string, string> = { 'content-type': 'application/json', accept: 'text/event-stream', ...forwardedHeaders(req) };
    const ac = new AbortController();
    const deadline = setTimeout(() => ac.abort(new ApiError(504, 'timeout', `request timed out after ${o.requestTimeoutMs} ms`, 'timeout_error')), o.requestTimeoutMs + 1_000);
    const onClose = () => {
      if (!reply.raw.writableFinished) ac.abort();
    };
    reply.raw.once('close', onClose);
    try {
      let res: Dispatcher.ResponseData;
      try {
        res = await request(`${selfUrl(req)}/v1/chat/completions`, { method: 'POST', headers, body, signal: ac.signal, dispatcher: loopback });
      } catch (err) {
        if (ac.signal.aborted && ac.signal.reason instanceof ApiError) throw ac.signal.reason;
        throw new ApiError(502, 'chat_path_failed', `the chat path did not answer: ${(err as Error).message}`, 'server_error');
      }
      const rid = typeof res.headers['x-request-id'] === 'string' ? res.headers['x-request-id'] : undefined;
      if (res.statusCode !== 200) {
        const text = await readBounded(res.body, MAX_ERROR_BODY);
        const retryAfter = res.headers['retry-after'];
        if (typeof retryAfter === 'string') reply.header('retry-after', retryAfter);
        if (rid) reply.header('x-request-id', rid);
        return reply.code(res.statusCode).type('application/json; charset=utf-8').send(responsesErrorText(text));
      }
      const model = o.models()[0] ?? (parsed.chat.model as string | undefined) ?? 'pdserve'; // the chat path's: the first served name, whichever served name was asked for
      const t = new ResponsesTranslator(responseIdOf(rid), model, Math.floor(systemClock.wallMs() / 1000), parsed.echo);
      let writer: SseWriter | null = null;
      const send = async (events: ResponsesEvent[]) => {
        if (!writer) return;
        for (const e of events) await writer.write(e, e.type);
      };
      if (parsed.stream) {
        reply.hijack();
        writer = new SseWriter(reply.raw, { writeTimeoutMs: o.writeTimeoutMs, headers: { 'x-request-id': rid ?? t.id }, ...(o.watch ? { watch: o.watch } : {}) });
        reply.raw.socket?.setNoDelay(true);
      }
      let failure: { status: number; code: string; message: string; type: string } | null = null;
      let done = false;
      try {
        await send(t.start());
        for await (const data of readSse(res.body, { maxEventBytes: o.maxEventBytes })) {
          if (data === SSE_DONE) {
            done = true;
            break;
          }
          const c = JSON.parse(data) as { error?: { message?: unknown; code?: unknown; type?: unknown } };
          if (c.error && typeof c.error === 'object') {
            const e = c.error;
            const code = typeof e.code === 'string' ? e.code : 'internal_error';
            failure = { status: codeSpec(code).status, code, message: typeof e.message === 'string' ? e.message : 'generation failed', type: typeof e.type === 'string' ? e.type : 'server_error' };
            break;
          }
          await send(t.chunk(c as Parameters<ResponsesTranslator['chunk']>[0]));
        }
        if (!done && !failure) failure = { status: 502, code: 'chat_path_failed', message: 'the chat stream ended before its end', type: 'server_error' };
      } catch (err) {
        if (err instanceof SseError && (err.code === 'SSE_CLOSED' || err.code === 'SSE_WRITE_TIMEOUT' || err.code === 'SSE_SLOW_CLIENT')) {
          ac.abort();
          return reply;
        }
        if (reply.raw.destroyed) return reply;
        const e = err instanceof ApiError ? err : new ApiError(502, 'chat_path_failed', `the chat stream failed: ${(err as Error).message}`, 'server_error');
        failure = { status: e.status, code: e.code, message: e.message, type: e.type };
      }
      if (failure) {
        res.body.destroy();
        if (writer) {
          await send(t.fail(failure.code, failure.message)).catch(() => {});
          writer.end();
          return reply;
        }
        throw new ApiError(failure.status, asErrorCode(failure.code, 'chat_path_failed'), failure.message, failure.type as ApiError['type']);
      }
      const finalEvents = t.finish();
      const response = t.response();
      if (parsed.store) mine.put(storedRecordOf(parsed, response, t.output));
      if (writer) {
        await send(finalEvents).catch(() => {});
        writer.end();
        return reply;
      }
      return reply.header('x-request-id', rid ?? t.id).send(response);
    } finally {
      clearTimeout(deadline);
      reply.raw.off('close', onClose);
    }
  });
}
