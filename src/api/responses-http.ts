/**
 * The /v1/responses routes, on the router and on the colocated server alike:
 *
 *   POST   /v1/responses        create (stream or not), see ./responses.ts for the mapping
 *   GET    /v1/responses/{id}   a stored response, else 404
 *   DELETE /v1/responses/{id}   {id, object: 'response', deleted: true}, else 404
 *   GET    /v1/responses/{id}/input_items   its context as items, paged (./responses-items.ts)
 *
 * A Responses request is served by the server's own chat generation, run in process
 * (./generation.ts, as fan-out choices are): every property of the chat path — pair choice,
 * prefix-cache routing, decode-local continuation, redispatch on drain, deadlines, aborts, tool
 * calling, metrics, traces — holds for Responses without a second copy, in PD and colocated
 * mode; admission counts the Responses request once. The chat request always streams (with the
 * usage chunk); a non-stream Responses request is assembled from it. The chat path's errors
 * before the stream pass through (status and OpenAI body), their `param` renamed to the
 * Responses field (./responses-errors.ts); a chat error event after it is `response.failed`.
 * A streamed request is opened at once by the chat path's keep-alive comment while it waits,
 * and is written with the server's write deadline and send-queue watch (a reader too slow is
 * cut, its generation aborted). A client that goes away aborts the generation (its rooms).
 */
import { randomBytes } from 'node:crypto';
import { tenantOf } from './access.js';
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { systemClock } from '../base/clock.js';
import { ApiError, checkModelName } from './errors.js';
import { callerOf, generateInProcess, HttpSink, newResponseId, type ChunkStream, type GenerationPort } from './generation.js';
import type { ParsedRequest } from './parse.js';
import { newItemId, parseResponsesRequest, ResponsesTranslator, storedRecordOf, type ResponsesEvent } from './responses.js';
import { ResponseStore } from './responses-store.js';
import { pageInputItems, type InputItemsQuery } from './responses-items.js';
import { responsesParamOf } from './responses-errors.js';
import { Gauge, type Registry } from 'prom-client';

export interface ResponsesRouteOptions<M = unknown> {
  store: ResponseStore;
  /** Served model names (first = the responses' `model`, as on the chat path). */
  models(): readonly string[];
  /** Largest conversation (the chat body built from the input and the previous responses), bytes: the server's own body limit. */
  bodyLimit: number;
  /** The server's generation (./generation.ts): its chat path, its stream limits. */
  port: GenerationPort<M>;
  /** Registry for pdserve_responses_stored{unit} (the store's entries and bytes, and its evictions). */
  registry?: Registry;
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
export function registerResponsesRoutes<M>(app: FastifyInstance, o: ResponsesRouteOptions<M>): void {
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
  const notFound = (id: string) => ApiError.of('not_found', `Response with id '${id}' not found.`, 'id');
  // Each tenant (API key) sees its own stored responses only: another's id is unknown (404).
  app.get<{ Params: { id: string } }>('/v1/responses/:id', async (req) => {
    const mine = o.store.of(tenantOf(req));
    await mine.load(req.params.id);
    const r = mine.get(req.params.id);
    if (!r) throw notFound(req.params.id);
    return r.response;
  });
  app.get<{ Params: { id: string }; Querystring: InputItemsQuery }>('/v1/responses/:id/input_items', async (req) => {
    const mine = o.store.of(tenantOf(req));
    await mine.load(req.params.id);
    const r = mine.get(req.params.id);
    if (!r) throw notFound(req.params.id);
    return pageInputItems(r.input, req.query ?? {});
  });
  app.delete<{ Params: { id: string } }>('/v1/responses/:id', async (req) => {
    const mine = o.store.of(tenantOf(req));
    await mine.load(req.params.id);
    if (!mine.delete(req.params.id)) throw notFound(req.params.id);
    return { id: req.params.id, object: 'response', deleted: true };
  });

  app.post('/v1/responses', async (req: FastifyRequest, reply: FastifyReply) => {
    const mine = o.store.of(tenantOf(req));
    const prev = (req.body as { previous_response_id?: unknown } | null)?.previous_response_id;
    if (typeof prev === 'string') await mine.load(prev);
    const parsed = parseResponsesRequest(req.body, mine);
    checkModelName(parsed.chat.model as string | undefined, o.models());
    const size = Buffer.byteLength(JSON.stringify(parsed.chat));
    if (size > o.bodyLimit) {
      throw ApiError.of('context_length_exceeded', `the conversation (${size} bytes with the previous responses) exceeds the server's request size limit (${o.bodyLimit} bytes)`, parsed.echo.previous_response_id ? 'previous_response_id' : 'input');
    }
    const rid = newResponseId('chat', randomBytes(12).toString('hex'));
    const caller = callerOf(req);
    let chat: ParsedRequest;
    try {
      chat = o.port.parse('chat', parsed.chat, caller);
    } catch (err) {
      reply.header('x-request-id', rid);
      throw asResponsesError(err);
    }
    const model = o.models()[0] ?? (parsed.chat.model as string | undefined) ?? 'pdserve'; // the chat path's: the first served name, whichever served name was asked for
    const t = new ResponsesTranslator(responseIdOf(rid), model, Math.floor(systemClock.wallMs() / 1000), parsed.echo);
    const startEvents = t.start();
    const ac = new AbortController();
    const onClose = () => {
      if (!reply.raw.writableFinished) ac.abort();
    };
    reply.raw.once('close', onClose);
    const http = new HttpSink(reply, o.port.streams);
    let writer: ChunkStream | null = null;
    let started = false;
    let chain: Promise<void> = Promise.resolve();
    const send = (events: ResponsesEvent[]): Promise<void> => {
      const w = writer;
      if (!w) return chain;
      return (chain = chain.then(async () => {
        for (const e of events) await w.write(e, e.type);
      }));
    };
    /** The stream with its first events (response.created, response.in_progress). */
    const begin = (): void => {
      if (!parsed.stream) return;
      writer ??= http.stream({ 'x-request-id': rid });
      if (!started) {
        started = true;
        void send(startEvents).catch(() => {});
      }
    };
    try {
      const outcome = await generateInProcess(o.port, { parsed: chat, rid, caller, inProcess: true }, ac.signal, {
        open: () => begin(),
        async event(chunk) {
          begin();
          await send(t.chunk(chunk as Parameters<ResponsesTranslator['chunk']>[0]));
        },
        async comment(text) {
          // a waiting stream: the client's stream opens now, its first events follow with the chat's
          if (!parsed.stream || (http.answered && !writer)) return;
          writer ??= http.stream({ 'x-request-id': rid });
          const w = writer;
          await (chain = chain.then(() => w.comment(text)));
        },
      });
      await chain.catch(() => {});
      if (!outcome.ok) {
        if (outcome.gone || (reply.raw.destroyed && !writer)) return reply;
        if (writer) {
          if (!started) {
            started = true;
            void send(startEvents);
          }
          await send(t.fail(outcome.error.code, outcome.error.message)).catch(() => {});
          (writer as ChunkStream).end();
          return reply;
        }
        reply.header('x-request-id', rid);
        throw outcome.streamed ? outcome.error : asResponsesError(outcome.error);
      }
      const finalEvents = t.finish();
      const response = t.response();
      // Several routers: the record is in the shared store before the client hears of it (bounded wait).
      if (parsed.store && mine.put(storedRecordOf(parsed, response, t.output))) await mine.shared(response.id as string);
      if (writer) {
        await send(finalEvents).catch(() => {});
        (writer as ChunkStream).end();
        return reply;
      }
      return reply.header('x-request-id', rid).send(response);
    } finally {
      reply.raw.off('close', onClose);
      ac.abort();
    }
  });
}

/** A chat path's error before any output, as a Responses client reads it: its param renamed to the Responses field (./responses-errors.ts). */
function asResponsesError(err: unknown): unknown {
  if (!(err instanceof ApiError) || err.param === null) return err;
  const param = responsesParamOf(err.param);
  return param === err.param ? err : err.with({ param });
}
