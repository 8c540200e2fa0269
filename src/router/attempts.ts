/**
 * The attempts of one generation request: the one place that decides what a failure leads to.
 *
 *   serveAttempts(deps, caller, sink, parsed, member) — pick a pair → run the attempt (its two
 *   legs, ./dispatch.ts `PdRequest`) → done | retry | migrate, until the request is answered.
 *
 * An attempt whose leg fails ends without a word to the client when the attempt plan (./plan.ts
 * `AttemptPlan`, the rule the simulator runs too) says so, and the request runs again on another
 * pair (the failed attempt's workers are avoided while others are healthy):
 *  - **retry**: the client has nothing yet — the same request again;
 *  - **migrate**: the client already has output — prompt + the tokens it has (`resume_token_ids`)
 *    go to the new pair, whose prefill evaluates them after the prompt and samples the next token
 *    (or, when the decode picked holds the conversation's prefix, to that decode alone: decode-local),
 *    and whose decode rebuilds every sampler state (penalties, grammar, min_tokens, stop strings'
 *    text) from prompt + those tokens, so the same response continues: no token repeated or
 *    missing, usage counted once (the workers count the resumed tokens as completion tokens);
 *  - **fallback**: a decode-local attempt decode refused (`needs_prefill`): the PD path, same pair.
 * The plan's budget (`migrationLimit`, unreached workers apart) and the request's deadline bound
 * the re-dispatches; when it says fail the client gets the last cause's error.
 * A worker that cut its connection mid-request is out of the rotation until its next good probe
 * (./worker-errors.ts `closed`), so a migration does not land on a dying worker again.
 * When no worker of a role is healthy, a request waits for one (at most MAX_WAITING requests)
 * instead of failing at once: until its deadline when the role is only temporarily empty (its
 * workers served before and are down, restarting or draining now), at most `workerWaitMs` when
 * no worker of the role ever served (a misconfigured or still-forming cluster): `waitUntil`.
 * Each attempt sends the workers its own rid (`<rid>`, then `<rid>-a<n>`): a worker that still
 * holds an earlier attempt's room never answers `duplicate_rid`.
 * Counted in pdserve_router_retries_total / pdserve_router_migrations_total {reason, outcome}
 * (reason: the failure's code; outcome: how the request ended), and each failed attempt is an
 * `attempt_failed` event of the request's trace.
 */
import { systemClock } from '../base/clock.js';
import type { Logger } from 'pino';
import { setTimeout as sleep } from 'node:timers/promises';
import { ApiError } from '../api/errors.js';
import { type ParsedRequest } from '../api/parse.js';
import type { ChunkStream, GenerationSink } from '../api/generation.js';
import { isErrorCode, toApiError } from '../base/errors.js';
import type { ChoiceGroup } from './choices.js';
import { ClientReply, PdRequest, type Decide, type DispatchContext } from './dispatch.js';
import { AttemptPlan, type PlanState } from './plan.js';
import { errorOutcome, type Outcome } from './metrics.js';
import { routingText, routingTextAfter } from './policy/index.js';
import type { PairPicker, PickAnswer } from './picker.js';
import { conversationKey } from './policy/affinity.js';
import type { WorkerState } from './registry.js';
import { PAIR_FAILURE_CODES } from './pair-blocks.js';
import { SseKeepAlive } from './keepalive.js';

/** Most requests waiting for a healthy worker at once; beyond it a request gets the 503 at once. */
export const MAX_WAITING = 1024;
/** How often a waiting request looks for a healthy worker again (ms). */
const WAIT_POLL_MS = 50;

/** What `serveAttempts` needs from its router. */
export interface AttemptDeps {
  ctx: DispatchContext;
  /** Which pair serves an attempt (./picker.ts), and what became of it. */
  picker: PairPicker;
  /** The attempts running now (the router cancels them on close). */
  active: Set<PdRequest>;
  closing(): boolean;
  /** Requests waiting for a healthy worker now (bounded by MAX_WAITING). */
  waiting: { n: number };
  /** The prompt's tokens as the workers tokenize it (./tokens.ts); absent: no router tokenizer. */
  tokensOf?: (parsed: ParsedRequest) => Promise<ArrayLike<number> | undefined>;
}

/** Who a request is for: its response id, log, `x-session-id` and, for a fanned-out choice, the whole request's response id. */
export interface AttemptCaller {
  rid: string;
  log: Logger;
  sessionId: string | undefined;
  parentRid: string | undefined;
}

/**
 * Serve one generation request (validated: `parsed`) through as many attempts as it takes into
 * `sink` (an HTTP response or an in-process caller: ../api/generation.ts); see the module doc.
 * Resolves when the client was answered (or is gone).
 * @throws ApiError before any response was started (no healthy pair, shutting down): the caller
 *   answers it.
 */
export async function serveAttempts(d: AttemptDeps, caller: AttemptCaller, sink: GenerationSink, parsed: ParsedRequest, member: { group: ChoiceGroup; index: number } | undefined): Promise<void> {
  const { config, registry, metrics } = d.ctx;
  const log = caller.log;
  const rid = caller.rid;
  const text = routingText(parsed);
  const key = conversationKey(parsed, caller.sessionId);
  if (key !== undefined) parsed.conversationKey = key;
  // exact routing: the prompt's tokens, bounded and on a deadline (undefined: route without them)
  const tokens = d.tokensOf && !member ? await d.tokensOf(parsed) : undefined;
  /** The failed attempts' workers: the picker skips them while others are candidates. */
  const avoid = new Set<WorkerState>();
  const causes: { next: 'retry' | 'migrate'; code: string }[] = [];
  let client: ClientReply | null = null;
  const plan = new AttemptPlan({ migrationLimit: config.migrationLimit });
  /** The plan's state (./plan.ts), from the first attempt; `decided`: the state after the last failed attempt's decision. */
  let planned: PlanState | null = null;
  let decided: PlanState | null = null;
  let outcome: Outcome = 'error';
  // A streamed request silent for sseKeepAliveMs gets an SSE comment (./keepalive.ts): from now on,
  // while it waits for a pair, its first token or the next one.
  const ka = parsed.stream && config.sseKeepAliveMs > 0
    ? new SseKeepAlive(sink, config.sseKeepAliveMs, { 'x-request-id': rid, 'x-trace-id': d.ctx.observe?.traceOf(rid) ?? rid }, () => client?.lastTokenAt ?? 0, () => client?.writer ?? null, (w) => {
        if (client && !client.writer) client.writer = w;
      })
    : null;
  try {
    for (;;) {
      if (d.closing()) throw ApiError.of('shutting_down', 'router is shutting down');
      const first: boolean = client === null;
      // A choice group's prefill is picked once, by its first member; the others take it. A
      // choice runs again on its own (the group's prefill request is over).
      const m: { group: ChoiceGroup; index: number } | undefined = first ? member : undefined;
      const pick = (): PickAnswer => {
        const p = d.picker.pick({ text, ...(tokens ? { tokens } : {}), ...(parsed.salt !== undefined ? { salt: parsed.salt } : {}), resumed: client?.tokenIds.length ?? 0, key, avoid, prefill: m?.group.prefill ?? undefined, local: !m });
        // at once: the group's other members run in the same turn (in process) and must take this prefill
        if (m && !('error' in p)) m.group.prefill ??= p.prefill;
        return p;
      };
      const deadlineAt: number = client?.deadlineAt ?? systemClock.nowMs() + config.requestTimeoutMs;
      const waitStart = systemClock.nowMs();
      const until = (error: string): number => waitUntil(error, registry.workers, waitStart, deadlineAt, config.workerWaitMs, config.unavailableWaitMs);
      // A role whose live workers are all degraded (a full state directory) answers at once.
      const unfit = degradedError(registry);
      if (unfit) throw unfit;
      const pair = await pickOrWait(pick, until, d, () => sink.signal.aborted || d.closing());
      if ('error' in pair) throw ApiError.of(pair.error, pair.reason);
      // The client left while the request waited for a pair (or between attempts): no attempt for nobody.
      if (sink.signal.aborted) {
        outcome = 'client_abort';
        metrics.requests.labels('client_abort').inc();
        d.ctx.observe?.event(rid, 'finished', { outcome, status: 499, attempts: client?.attempt ?? 0 });
        break;
      }
      const { prefill, decode } = pair;
      if (parsed.kind === 'chat' && parsed.tools) parsed.toolSyntax = prefill.toolSyntax ?? null;
      if (m) m.group.prefill ??= prefill;
      client ??= new ClientReply(rid, parsed, decode.model ?? prefill.model ?? parsed.model ?? 'pdserve', config.requestTimeoutMs);
      const c = client;
      c.parentRid ??= caller.parentRid;
      c.writer ??= ka?.writer() ?? null; // a keep-alive comment opened the stream already
      planned ??= plan.start(c.deadlineAt);
      const state: PlanState = planned;
      decided = null;
      const decide: Decide = (err, ev) => {
        const d = plan.next(state, { code: err.code, status: err.status, now: systemClock.nowMs(), ...ev });
        decided = d.state;
        return d.next;
      };
      // Decode-local continuation first when the decode worker holds this conversation (the
      // picker's `localPrefill`; never for a choice of a group). A migration too: prompt + the
      // tokens the client has go to a decode that holds the prefix, which evaluates only what it
      // lacks (no prefill leg, no KV handoff). Its `needs_prefill` answer (before this attempt's
      // output) falls back to the PD path on the same pair.
      const localMax = pair.localPrefill;
      c.attempt++;
      let run = new PdRequest(d.ctx, c, parsed, sink, prefill, decode, log, decide, localMax ? { maxTokens: localMax } : undefined, m);
      d.active.add(run);
      try {
        await run.run();
        if (run.next === 'fallback' && !sink.signal.aborted && !d.closing()) {
          d.active.delete(run);
          c.attempt++;
          run = new PdRequest(d.ctx, c, parsed, sink, prefill, decode, log, decide);
          d.active.add(run);
          await run.run();
        }
      } finally {
        d.active.delete(run);
      }
      outcome = run.outcome ?? 'error';
      // A failed KV handshake takes the pair out of the rotation (./pair-blocks.ts); service clears it.
      // An ok round: the decode worker now keeps it (prompt + reply), the next round's prefix.
      const pairFailed = run.cause && PAIR_FAILURE_CODES.has(run.cause.code) ? run.cause.code : undefined;
      const ok = run.outcome === 'ok' && run.next === null;
      const blockedMs = d.picker.learn({ prefill, decode, ok: run.outcome === 'ok', pairFailed, ...(ok ? { heldText: routingTextAfter(parsed, run.generatedText), ...(tokens ? { tokens } : {}), ...(parsed.salt !== undefined ? { salt: parsed.salt } : {}), ...(key !== undefined ? { key } : {}) } : {}) });
      if (pairFailed) log.warn({ prefill: prefill.url, decode: decode.url, code: pairFailed, retry_in_ms: blockedMs }, 'KV handshake failed: the pair leaves the rotation');
      if (run.next !== 'retry' && run.next !== 'migrate') break;
      if (sink.signal.aborted) {
        // The attempt failed as its client left: the request ends as the client's abort.
        outcome = 'client_abort';
        metrics.requests.labels('client_abort').inc();
        d.ctx.observe?.event(rid, 'finished', { outcome, status: 499, attempts: c.attempt });
        break;
      }
      causes.push({ next: run.next, code: run.cause!.code });
      planned = decided ?? planned;
      avoid.add(prefill);
      avoid.add(decode);
      // The worker said its state directory is full: its /health says which one (degraded), and
      // a degraded worker is never picked, so the retry does not land on the same host.
      if (run.cause!.code === 'state_dir_full') await Promise.all([registry.refresh(prefill), registry.refresh(decode)]);
    }
  } catch (err) {
    metrics.requests.labels(errorOutcome(err)).inc();
    // The stream is open (output, or a keep-alive comment): the error can only go in it.
    const open = client?.writer ?? ka?.writer() ?? null;
    if (!(err instanceof ApiError) || (!open && (!client || client.builder.events === 0))) {
      if (client && err instanceof ApiError) d.ctx.observe?.event(rid, 'finished', { outcome: 'error', status: err.status, code: err.code, err: err.message, attempts: client.attempt });
      if (!open) throw err;
    }
    const e = toApiError(err);
    // The client has output or an open stream (a migration found no pair, no worker came): end its response with the error.
    failAfterOutput(open, client, sink, e, log);
    d.ctx.observe?.event(rid, 'finished', { outcome: 'error', status: e.status, code: e.code, err: e.message, attempts: client?.attempt ?? 0 });
  } finally {
    ka?.stop();
    for (const c of causes) (c.next === 'retry' ? metrics.retries : metrics.migrations).labels(isErrorCode(c.code) ? c.code : 'other', outcome).inc();
  }
}

/**
 * The error of a request that no worker of a role can take because every live one (healthy, not
 * draining) is degraded — `state_dir_full` when that is why — or undefined when each role has a
 * candidate or a worker that is down (which the request may wait for, see `waitUntil`).
 */
export function degradedError(registry: { readonly workers: readonly WorkerState[] }): ApiError | undefined {
  for (const role of ['prefill', 'decode'] as const) {
    const live = registry.workers.filter((w) => w.role === role && w.healthy && !w.draining);
    if (live.length === 0 || live.some((w) => !w.degraded)) continue;
    const reason = live[0]!.degraded!;
    return ApiError.of(reason.startsWith('state_dir_full') ? 'state_dir_full' : `no_healthy_${role}`, `no ${role} worker can take the request: ${reason}`);
  }
  return undefined;
}

/**
 * Until when (systemClock ms) a request that found no pair (`error`, a `pickPair` error code)
 * since `now` may wait for one:
 *  - `workerWaitMs` 0: not at all (`now`);
 *  - the role is temporarily empty — a worker of it (in `workers`) served before and is not
 *    draining (`servedOnce`: it is down or restarting now), or every compatible pair is blocked
 *    for a while (`no_compatible_pair`): until the request's deadline `deadlineAt`, since a
 *    restarted worker may take longer than any fixed wait to be ready (a tiny-model prefill needs
 *    10–17 s under load);
 *  - every worker of the role that served is draining (leaving: none of them can take the
 *    request): at most `unavailableWaitMs`, then 503 with `retry-after`, so a client (or the load
 *    balancer in front) tries again soon instead of waiting silently for the deadline;
 *  - no worker of the role ever served (none configured or registered, or none ever answered its
 *    probe: a wrong address, another cluster secret): at most `workerWaitMs`, so a misconfigured
 *    cluster answers 503 soon.
 * Never past `deadlineAt`.
 */
export function waitUntil(error: string, workers: readonly { role: WorkerState['role']; servedOnce?: boolean; draining?: boolean }[], now: number, deadlineAt: number, workerWaitMs: number, unavailableWaitMs = workerWaitMs): number {
  if (workerWaitMs <= 0) return now;
  const role = error === 'no_healthy_prefill' ? 'prefill' : error === 'no_healthy_decode' ? 'decode' : null;
  if (role === null) return deadlineAt;
  const served = workers.filter((w) => w.role === role && w.servedOnce === true);
  if (served.some((w) => !w.draining)) return deadlineAt;
  return Math.min(deadlineAt, now + (served.length > 0 ? unavailableWaitMs : workerWaitMs));
}

/**
 * The pair `pick` gives, or — when its answer may change by waiting (`waitable`: a role has no
 * healthy worker, or every compatible pair is blocked for a while) — the first one it gives before
 * `until(error)` (`waitUntil`, asked again after every look: the missing role can change; see
 * MAX_WAITING). A settings mismatch no pair can serve is answered at once.
 */
async function pickOrWait(pick: () => PickAnswer, until: (error: string) => number, d: AttemptDeps, gone: () => boolean): Promise<PickAnswer> {
  let pair = pick();
  if (!('error' in pair) || !pair.waitable || d.waiting.n >= MAX_WAITING) return pair;
  d.waiting.n++;
  try {
    while ('error' in pair && pair.waitable && systemClock.nowMs() + WAIT_POLL_MS <= until(pair.error) && !gone()) {
      await sleep(WAIT_POLL_MS);
      pair = pick();
    }
  } finally {
    d.waiting.n--;
  }
  return pair;
}

/** End a response that already has output (or an open stream `w`) with `err`: an SSE error event (no [DONE]) or, not streamed yet, the error body. */
function failAfterOutput(w: ChunkStream | null, client: ClientReply | null, sink: GenerationSink, err: ApiError, log: Logger): void {
  log.warn({ code: err.code, err: err.message, attempts: client?.attempt ?? 0, tokens: client?.tokenIds.length ?? 0 }, 'request failed');
  if (w) {
    if (!w.closed) {
      w.write({ error: err.toBody().error }).catch(() => {});
      w.end();
    }
    return;
  }
  sink.fail(err);
}
