/**
 * One prompt computation shared by the rooms of one prefill request (n > 1 in PD: one prefill,
 * n decode sequences from the same state; vLLM calls this parallel sampling, its n sequences
 * forking one prompt's KV blocks). The driver (driver.ts) decides when it runs, which room gets
 * the state and when the state file goes; this module holds what the I/O shell needs for it:
 * the shell's per-computation record, the counters that show a prompt was evaluated and saved
 * once, and the multiplexed SSE answer of a request with several rooms.
 *
 * Wire format of a multi-room answer (pdserve's own; the single-room answer is first-token.ts's):
 *
 *   data: {room, ...GenerateEvent}             room's first token + meta, once sampled
 *   data: {room, transfer: PrefillResponse}    room's KV handoff succeeded       (or)
 *   data: {room, error: {message,type,code,status}}  room failed (before or after its first token)
 *   data: [DONE]                               every room is terminal
 *
 * Each room has exactly one terminal event; a room may have no first-token event (it failed
 * first). The router (src/router/choices.ts) splits the stream back into one stream per room.
 */
import type { FastifyReply } from 'fastify';
import client from 'prom-client';
import type { GenerateEvent, PrefillResponse } from '../protocol/worker-protocol.js';
import { SseWriter } from '../api/sse.js';
import { toApiError } from '../base/errors.js';
import type { RoomId } from '../base/room-id.js';
import type { EvictionNote, Retention, SamplingParams } from '../engine/types.js';

/** The shell's record of one computation (by its lead room), from the request to its state's release. */
export interface Computation {
  lead: RoomId;
  rooms: RoomId[];
  tokens: number[];
  /** Sampling of room 0; room i samples its first token with seed + i (engine choices). */
  sampling: SamplingParams;
  /** Fires on the driver's `cancel`: stops prompt evaluation. */
  ac: AbortController;
  /** The saved state file, from compute until the driver's `discard` (deleted once). */
  state?: { path: string; payloadBytes: number };
  /** Envelope head of each room (its own first token). */
  heads: Map<RoomId, Buffer>;
  prefillMs: number;
  /** Prompt tokens taken from the prefix cache. */
  cachedTokens: number;
  /** The router's conversation key (`conversation_key`): what the sequence tier's KV events name. */
  key?: string;
  /** The request's cache salt (`cache_salt`, its tenant): only this salt's cached KV is reused. */
  salt?: string;
  /** How long the kept sequence is retained (`retention` of /generate). */
  retention?: Retention;
  /** Cached states the computation's slot evicted (engine Slot.evicted), for its trace rows. */
  evicted?: readonly EvictionNote[];
}

/** Counters that show how many prompt evaluations and state saves the rooms cost (n > 1: one each for n rooms). */
export class ComputationMetrics {
  readonly computations: client.Counter;
  readonly evaluatedTokens: client.Counter;
  readonly statesSaved: client.Counter;
  readonly roomsPerComputation: client.Histogram;
  readonly firstTokensAfterSave: client.Counter;

  constructor(registry: client.Registry) {
    const registers = [registry];
    this.computations = new client.Counter({ name: 'pdserve_prefill_computations_total', help: 'Prompt evaluations run by prefill (one per request, whatever its number of rooms)', registers });
    this.evaluatedTokens = new client.Counter({ name: 'pdserve_prefill_prompt_tokens_evaluated_total', help: 'Prompt tokens evaluated by prefill (prefix-cache hits excluded)', registers });
    this.statesSaved = new client.Counter({ name: 'pdserve_prefill_states_saved_total', help: 'Sequence states saved by prefill (one per computation, shared by its rooms)', registers });
    this.firstTokensAfterSave = new client.Counter({ name: 'pdserve_prefill_first_tokens_after_save_total', help: 'First tokens prefill sent once the state was saved (--first-token-after-save), not before the save', registers });
    this.roomsPerComputation = new client.Histogram({ name: 'pdserve_prefill_rooms_per_computation', help: 'Rooms (choices) fed by one prefill computation', buckets: [1, 2, 4, 8, 16], registers });
  }
}

/** A finished save: the sequence's tokens and how long llama.cpp took to save it, ms. */
export interface SaveTiming {
  nTokens: number;
  ms: number;
}

/**
 * Whether token 1 waits for the state save (`--first-token-after-save PCT`): yes when the save
 * of `nTokens` is expected to take at most PCT % of the `evalMs` the prompt's evaluation took.
 * Token 1 then leaves when the handoff can begin, so the client's gap between token 1 and token
 * 2 holds the transfer, the load and decode's first step, not llama.cpp's save too; the save
 * moves into TTFT, where it is a small share (CPU: ~0.5 % at 1500 tokens) and token 2 comes no
 * later. A save that would be a large share of TTFT (a GPU's fast prompt evaluation, a prefix
 * hit that evaluated a short suffix) is not waited for. The expectation scales the last save's
 * time by the token count (a state's size is affine in it); with no save yet, no wait.
 * @param pct the share, percent (0 = never wait; 'always': every first token waits).
 * @param last the worker's last save, if any.
 * @param nTokens tokens in the sequence to save (prompt, cached prefix included).
 * @param evalMs time from the computation's start to its first tokens, ms.
 */
export function firstTokenAfterSave(pct: number | 'always', last: SaveTiming | undefined, nTokens: number, evalMs: number): boolean {
  if (pct === 'always') return true;
  if (!(pct > 0) || !last || last.nTokens <= 0 || !(last.ms >= 0)) return false;
  const expectMs = last.ms * (Math.max(1, nTokens) / last.nTokens);
  return expectMs <= (pct / 100) * evalMs;
}

/** One room of a multi-room answer: its first-token event (never rejects) and its terminal outcome. */
export interface RoomAnswer {
  room: RoomId;
  first: Promise<GenerateEvent>;
  done: Promise<PrefillResponse>;
}

const NEVER = Symbol('no first token');

/**
 * Serve a multi-room prefill answer (see the module doc): always 200 + SSE, events in the order
 * they happen, [DONE] after every room's terminal event. Resolves when the response is over
 * (never rejects). A router that goes away is handled by the caller's onClientGone (it aborts
 * every room).
 * @param writeTimeoutMs longest wait for the router to drain one event (ms).
 */
export async function answerRooms(reply: FastifyReply, rooms: RoomAnswer[], writeTimeoutMs: number): Promise<void> {
  reply.hijack();
  const w = new SseWriter(reply.raw, { writeTimeoutMs });
  w.open(200, true); // the router waits for the head before it splits the stream
  let chain: Promise<void> = Promise.resolve();
  const emit = (ev: unknown): Promise<void> => (chain = chain.then(() => w.write(ev)));
  const one = async (r: RoomAnswer): Promise<void> => {
    const ended = r.done.then((): typeof NEVER => NEVER);
    ended.catch(() => {});
    let first: GenerateEvent | typeof NEVER = NEVER;
    try {
      first = await Promise.race([r.first, ended]);
    } catch {
      // failed before its first token: only the error event
    }
    if (first !== NEVER) await emit({ room: r.room, ...first });
    let end: unknown;
    try {
      end = { room: r.room, transfer: await r.done };
    } catch (err) {
      const e = toApiError(err);
      end = { room: r.room, error: { message: e.message, type: e.type, code: e.code, status: e.status } };
    }
    await emit(end);
  };
  try {
    await Promise.all(rooms.map(one));
    await emit('[DONE]');
  } catch {
    // the router went away or stopped reading: its close aborts the rooms (onClientGone)
  } finally {
    w.end();
  }
}
