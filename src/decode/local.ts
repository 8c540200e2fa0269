/**
 * Decode-local continuation: decode's decision whether to serve a request ALONE, and the
 * evaluation of the prompt's uncached suffix on a kept sequence. Conditional disaggregation as in
 * NVIDIA Dynamo (`lib/llm/src/disagg_router.rs`: prefill remotely iff prompt − prefix hit >
 * max_local_prefill_length): decode decides, in tokens, with its own kept KV.
 *
 * How a request gets here: the router's decode policy (cache_aware) found that this decode
 * worker served the conversation's previous round, and sent the request to decode alone with
 * `local_prefill: {max_tokens}`. Decode then:
 *  1. `planLocal`: tokenizes the prompt exactly as prefill would (api/requests.ts), checks the
 *     sampling, and asks the engine how many leading tokens a kept sequence holds
 *     (`Engine.reusableFor`). uncached = prompt − reusable; if uncached > min(router's limit,
 *     decode's `--local-prefill-max-tokens`) the answer is 409 `needs_prefill` at once — no room
 *     exists, nothing was streamed, and the router runs the normal PD path (a fallback the client
 *     never sees). An evicted prefix is therefore either evaluated whole locally (a short prompt)
 *     or sent back to PD (a long one).
 *  2. Otherwise the room is created WITHOUT a peer and, once it holds a slot (chosen by the
 *     prompt: the kept sequence), takes the lifecycle's `local_prefill` event
 *     (Bootstrapping/prealloc → WaitingForInput/local), whose `start_local_prefill` effect runs
 *     `localPrefill` below; its success is the room's `kv_done` (→ Success), and decode streams
 *     every token from the first. Deadlines, aborts and the single slot release are the room's,
 *     unchanged (see docs/LIFECYCLE.md).
 * A migrated request (`resume_token_ids`, ../router/attempts.ts) may come here too: the uncached
 * suffix then includes the resumed tokens, which `localPrefill` evaluates after the prompt.
 * The reuse counted at step 1 is a hint: a request that waited for a slot may find its prefix
 * evicted meanwhile; it is then evaluated locally in full (correct, slower), never failed.
 */
import { ApiError } from '../base/errors.js';
import { checkSampling, fitSampling, samplingFromWire, tokenizeRequest } from '../api/requests.js';
import type { GenerateRequest } from '../protocol/worker-protocol.js';
import type { Engine, SamplingParams, Slot, TokenLogprob } from '../engine/types.js';

/** Default `--local-prefill-max-tokens` (router and decode): the longest suffix decode evaluates itself. */
export const DEFAULT_LOCAL_PREFILL_MAX_TOKENS = 256;

/** What decode streams from: the first token and the prompt's counts (PD: from the envelope; local: from the local prefill). */
export interface DecodeStart {
  /** Prompt tokens (usage.prompt_tokens). */
  promptTokens: number;
  /** Leading prompt tokens not evaluated for this request (usage cached_tokens). */
  cachedTokens: number;
  /** Which prefix-cache tier served `cachedTokens` (absent: none). */
  cacheTier?: 'sequence' | 'store';
  /** First generated token. */
  firstToken: number;
  /** Its logprob (local path only: the PD path's first logprob travels from prefill to the router). */
  firstLogprob?: TokenLogprob;
}

/** A request decode accepted to serve locally. */
export interface LocalPlan {
  tokens: number[];
  sampling: SamplingParams;
  /** Tokens a kept sequence held for this prompt at planning time (a hint, see the module doc). */
  reusable: number;
}

/**
 * Decide whether decode serves `body` (which carries `local_prefill`) itself.
 * @param ownLimit decode's own `--local-prefill-max-tokens` (0 = decode-local off).
 * @param keeps whether this decode keeps finished sequences (its prefix cache is on).
 * @returns the plan; @throws ApiError 409 `needs_prefill` when the uncached suffix is over the
 *   limit (or decode-local is off here), and the usual 400s for a prompt or sampling that no
 *   path could serve (context_length_exceeded, invalid_token, …) — the same answers prefill gives.
 */
export async function planLocal(engine: Engine, body: GenerateRequest, ownLimit: number, keeps: boolean): Promise<LocalPlan> {
  const limit = Math.min(ownLimit, body.local_prefill?.max_tokens ?? 0);
  if (!keeps || limit <= 0) throw ApiError.of('needs_prefill', 'decode-local continuation is off on this decode worker');
  const tokens = tokenizeRequest(engine, body);
  // A migrated request (`resume_token_ids`): the tokens the client has are evaluated after the
  // prompt, one per call, and every sampler state counts them as generated (as prefill does).
  const sampling = fitSampling(engine, tokens.length, samplingFromWire(body.sampling_params, body.resume_token_ids));
  await checkSampling(engine, sampling);
  const resumed = body.resume_token_ids?.length ?? 0;
  let reusable = engine.reusableFor(tokens, body.cache_salt);
  // the host's prefix store (second tier) may hold it when no kept sequence does
  if (tokens.length + resumed - reusable > limit && engine.storedReusableFor) reusable = Math.max(reusable, await engine.storedReusableFor(tokens, body.cache_salt));
  const uncached = tokens.length + resumed - reusable;
  if (uncached > limit) throw ApiError.of('needs_prefill', `uncached suffix of ${uncached} tokens (prompt ${tokens.length}${resumed ? ` + ${resumed} resumed` : ''}, kept ${reusable}) exceeds the local prefill limit ${limit}`);
  return { tokens, sampling, reusable };
}

/**
 * Evaluate the plan's prompt on `slot` (only the part its kept sequence does not hold; the
 * engine re-derives the reuse under the lease) and sample the first token. Abortable between
 * chunks by `signal`. An abort or error leaves the sequence marked incomplete, so its release
 * clears it and no later round can reuse a half-written entry (engine/llama.ts `valid`).
 * @throws EngineError 'ABORTED' / 'SLOT_RELEASED' / 'PROMPT_TOO_LONG', llama.cpp errors.
 */
export async function localPrefill(slot: Slot, plan: LocalPlan, signal: AbortSignal): Promise<DecodeStart> {
  const r = await slot.prefill(plan.tokens, plan.sampling, signal);
  const start: DecodeStart = { promptTokens: r.promptTokens, cachedTokens: r.cachedTokens, firstToken: r.firstToken };
  if (r.firstLogprob) start.firstLogprob = r.firstLogprob;
  if (r.cacheTier) start.cacheTier = r.cacheTier;
  return start;
}
