/**
 * Prefill's streamed answer to `/generate` with `first_token_from_prefill` (first token before
 * the KV handoff). The first token is sampled by prefill, so the client can see it before the
 * sequence state has moved: TTFT no longer depends on the state's size or the transfer. The idea
 * is the one behind vLLM's and SGLang's disaggregated prefill returning the first token from the
 * prefill instance; the wire format here is pdserve's own (see worker-protocol.ts):
 *
 *   data: GenerateEvent                 the first token + meta, as soon as it is sampled
 *   data: {transfer: PrefillResponse}   the KV handoff succeeded      (or)
 *   data: {error: {message,type,code,status}}  the KV handoff failed (the client already has token 1)
 *   data: [DONE]
 *
 * A room that fails before its first token is answered with a plain OpenAI error body and its
 * HTTP status, exactly as without the flag.
 */
import type { FastifyReply } from 'fastify';
import { tokenEvent, type GenerateEvent, type PrefillResponse, type PrefillStreamEnd } from '../protocol/worker-protocol.js';
import { SseWriter } from '../api/sse.js';
import { InternalError, toApiError } from '../base/errors.js';
import { sendError } from '../worker/http.js';
import type { GeneratedToken, FinishReason } from '../engine/types.js';

const NO_FIRST = Symbol('no first token');

/**
 * The first-token event prefill streams: token 1's output exactly as decode would have emitted it
 * (token `resumed` + 1 of a migrated request, whose `resumed` earlier tokens the client has).
 */
export function firstTokenEvent(rid: string, promptTokens: number, out: GeneratedToken & { end?: FinishReason }, cachedTokens = 0, resumed = 0): GenerateEvent {
  return tokenEvent(out, { id: rid, prompt_tokens: promptTokens, cached_tokens: cachedTokens, completion_tokens: resumed + 1, finish_reason: out.end ? { type: out.end } : null });
}

/**
 * Serve one streamed prefill answer. `first` resolves with the first-token event (never
 * rejects); `done` resolves when the room reaches Success and rejects with an ApiError-like error
 * when it fails. Resolves when the response is over (never rejects). A client that goes away is
 * handled by the caller's onClientGone (it aborts the room).
 * @param writeTimeoutMs longest wait for the router to drain one event (ms).
 */
export async function answerWithFirstToken(reply: FastifyReply, first: Promise<GenerateEvent>, done: Promise<PrefillResponse>, writeTimeoutMs: number): Promise<void> {
  const finished = done.then((): typeof NO_FIRST => NO_FIRST);
  finished.catch(() => {});
  let ev: GenerateEvent | typeof NO_FIRST;
  try {
    ev = await Promise.race([first, finished]);
  } catch (err) {
    sendError(reply, toApiError(err));
    return;
  }
  if (ev === NO_FIRST) {
    sendError(reply, toApiError(new InternalError('prefill finished the room without a first token')));
    return;
  }
  reply.hijack();
  const w = new SseWriter(reply.raw, { writeTimeoutMs });
  try {
    await w.write(ev);
    let end: PrefillStreamEnd | { error: { message: string; type: string; code: string; status: number } };
    try {
      end = { transfer: await done };
    } catch (err) {
      const e = toApiError(err);
      end = { error: { message: e.message, type: e.type, code: e.code, status: e.status } };
    }
    await w.write(end);
    await w.write('[DONE]');
  } catch {
    // the router went away or stopped reading: its close aborts the room (onClientGone)
  } finally {
    w.end();
  }
}
