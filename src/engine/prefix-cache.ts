/**
 * Prefix cache policy of one engine context: which idle sequence a new prompt should reuse, how
 * many of its tokens may be kept, and which idle sequences to evict. Pure functions over token
 * arrays (no node-llama-cpp), so the policy is unit-tested without a model; `llama.ts` applies
 * the decisions to LlamaContextSequences.
 *
 * The scheme is llama.cpp server's `cache_prompt` with slot selection by longest common prefix
 * (`--slot-prompt-similarity`, LRU otherwise), plus vLLM's rule that the last prompt token is
 * always recomputed (a saved KV state holds no logits, and the first token must be sampled).
 *
 * Exactness. llama.cpp's CPU kernels sum a batch of rows in another order than a smaller batch,
 * so KV computed in a different chunking differs in the last bits from a cold run's (llama.cpp's
 * README says as much of its own prompt cache). In deterministic mode (`align` = the prompt
 * chunk size) reuse is therefore limited to whole chunks that were evaluated as full, aligned
 * chunks (`exactPrefix`): the suffix is then evaluated in exactly the chunks a cold run uses and
 * the output is bit-identical. Without deterministic mode the whole common prefix is reused
 * (greedy tokens usually, not always, match a cold run — as with llama.cpp's server).
 *
 * Retention (which cached state goes first, `evictionOrder`): a state another held state of the
 * same salt covers goes first (`superseded`: turn M makes turn M−1's copy unnecessary — the
 * a-posteriori rule of SGLang's agent-aware cache RFC); then states past their retention window
 * (`lru`, least recently used first); a state still inside its window (an agent's session
 * paused on a tool call: `retainUntil`, from the session TTL or the request's
 * `agent_hints.retention_seconds`) only when nothing else is left (`ttl_pressure`: lowest
 * `agent_hints.priority` first, then the most recently used — the session that just finished a
 * turn has just started its tool call, so its next turn is likely the farthest; the longest
 * paused is the likeliest to return next, and taking it first is LRU's failure on sessions that
 * take turns). The window is soft, as in
 * SGLang's `retention_seconds` and vLLM's session-hint RFC: it orders evictions and never fails
 * an allocation. A prefix held whole by one sequence and extended by two or more others that
 * diverge (a shared system prompt) is not superseded: it is the one copy a new session can
 * start from (a sequence is taken for a prompt only when it keeps ≥ MIN_KEEP_FRACTION of it).
 */

/** What the engine knows about one idle (free) sequence of its context. */
export interface CachedSequence {
  /** Sequence index in the context. */
  readonly index: number;
  /** Tokens whose KV the sequence holds (positions 0..n-1); empty = nothing cached. */
  readonly tokens: readonly number[];
  /** Leading tokens whose KV was computed in full chunks aligned to 0 (see the module doc). */
  readonly exactPrefix: number;
  /** Last time the sequence finished a request (any monotonic clock, ms). */
  readonly lastUsed: number;
  /** The cache salt of the request whose KV it holds (its tenant: vLLM's `cache_salt`); undefined = unsalted. */
  readonly salt?: string | undefined;
  /** End of its retention window (same clock as `lastUsed`); absent or ≤ now = none left (see the module doc). */
  readonly retainUntil?: number | undefined;
  /** Retention priority 0–99 (`agent_hints.priority`; higher = kept longer), inside its window only; absent = 0. */
  readonly priority?: number | undefined;
}

/** Why a cached state was evicted (the `cause` label of pdserve_cache_evictions_total). */
export type EvictionCause = 'superseded' | 'lru' | 'ttl_pressure';

/** One eviction decision: the state and why it goes. */
export interface Eviction<S extends CachedSequence> {
  seq: S;
  cause: EvictionCause;
}

/** Prefix-cache settings of an engine. */
export interface PrefixCacheSettings {
  /** Keep finished sequences' KV for reuse. */
  enabled: boolean;
  /** Chunk size reuse is aligned to (deterministic mode), or null for whole-prefix reuse. */
  align: number | null;
  /** Most tokens held by idle sequences together; beyond it states are evicted in `evictionOrder`. */
  maxTokens: number;
  /**
   * Retention window of a session's state after its request ends, ms (`--session-ttl-ms`): the
   * default for requests that name a session (prompt_cache_key, user, x-session-id) and give no
   * `agent_hints.retention_seconds`. Absent = 0.
   */
  sessionTtlMs?: number;
}

/** Length of the longest common prefix of two token arrays. */
export function commonPrefix(a: readonly number[], b: readonly number[]): number {
  const n = Math.min(a.length, b.length);
  let i = 0;
  while (i < n && a[i] === b[i]) i++;
  return i;
}

/**
 * Tokens of `prompt` whose KV may be taken from a sequence holding `cached`: the common prefix,
 * at most prompt.length − 1 (the last prompt token is always evaluated, so the first token can
 * be sampled), and with `align` rounded down to whole chunks and capped at `exactPrefix`.
 */
export function reusableTokens(cached: readonly number[], exactPrefix: number, prompt: readonly number[], align: number | null): number {
  let n = Math.min(commonPrefix(cached, prompt), prompt.length - 1);
  if (align !== null) n = Math.min(Math.floor(n / align) * align, exactPrefix);
  return Math.max(0, n);
}

/**
 * Tokens of a just-evaluated prompt of `promptLength` tokens that a later request can reuse
 * exactly: with `align`, the whole chunks (the last, partial chunk was evaluated in a smaller
 * batch than a longer cold prompt would use); without, all of them.
 */
export function exactPrefixAfterPrompt(promptLength: number, align: number | null): number {
  return align === null ? promptLength : Math.floor(promptLength / align) * align;
}

/** The sequence chosen for a prompt and how many of its cached tokens are kept. */
export interface SequenceChoice<S extends CachedSequence> {
  seq: S;
  /** Tokens reused (0 = the sequence is cleared). */
  reuse: number;
  /** Set when the sequence held a cache the choice drops (past `reuse`): why it was the one evicted. */
  evicts?: EvictionCause;
}

/**
 * A cached sequence is reused only when the reused prefix is at least this fraction of what it
 * holds: taking it erases the rest, and a short shared prefix (a common system-prompt opening)
 * must not destroy another conversation's long entry while an empty or stale sequence would do.
 * The same 0.5 as llama.cpp server's rule for keeping a slot's cache (f_keep).
 */
export const MIN_KEEP_FRACTION = 0.5;

/**
 * How many more runs of consecutive ids the busy sequences form once `index` joins them: +1 (a
 * new run), 0 (extends one), −1 (joins two).
 */
export function runDelta(busy: ReadonlySet<number>, index: number): number {
  return 1 - (busy.has(index - 1) ? 1 : 0) - (busy.has(index + 1) ? 1 : 0);
}

/**
 * Tokens of `s` a prompt must reuse for taking it to keep everything its session would resend:
 * its exact prefix (the prompt it was computed for; the reply's copy in the next round is text
 * tokenized again, see prefix-store.ts storeKeyTokens), all of it when unknown.
 */
function neededTokens(s: CachedSequence): number {
  return s.exactPrefix > 0 ? Math.min(s.exactPrefix, s.tokens.length) : s.tokens.length;
}

/** `a` holds everything of `b` a prompt could reuse from `b` (same salt; reuse rules of `reusableTokens`). */
function covers(a: CachedSequence, b: CachedSequence, align: number | null): boolean {
  if (a === b || a.salt !== b.salt || b.tokens.length === 0) return false;
  const need = neededTokens(b);
  // cheap rejections first: most states of other sessions differ at their end
  if (a.tokens.length < need || a.tokens[need - 1] !== b.tokens[need - 1] || commonPrefix(a.tokens, b.tokens) < need) return false;
  return align === null || a.exactPrefix >= need;
}

/** Order of two states that cover each other (duplicates): the longer, then more recent, then lower index is kept. */
function keptOver(a: CachedSequence, b: CachedSequence): boolean {
  return a.tokens.length !== b.tokens.length ? a.tokens.length > b.tokens.length : a.lastUsed !== b.lastUsed ? a.lastUsed > b.lastUsed : a.index < b.index;
}

/**
 * The states of `held` that another state of `held` supersedes: it covers them (same salt, every
 * reusable token) and, where both cover each other, is kept over them (`keptOver`) — except a
 * prefix covered by two or more states that do not cover one another (a prefix several
 * sessions share: the one copy a new session starts from).
 */
export function supersededStates<S extends CachedSequence>(held: readonly S[], align: number | null): Set<S> {
  const out = new Set<S>();
  const live = held.filter((s) => s.tokens.length > 0);
  for (const b of live) {
    const by = live.filter((a) => covers(a, b, align) && (!covers(b, a, align) || keptOver(a, b)));
    if (by.length === 0) continue;
    // a branch point: two covering states that diverge (neither covers the other)
    let branch = false;
    for (let i = 0; i < by.length && !branch; i++) for (let j = i + 1; j < by.length && !branch; j++) branch = !covers(by[i]!, by[j]!, align) && !covers(by[j]!, by[i]!, align);
    if (!branch) out.add(b);
  }
  return out;
}

/** Retention class of a cached state at `now`: 0 superseded, 1 past its window, 2 inside it. */
function retentionClass(s: CachedSequence, superseded: ReadonlySet<CachedSequence>, now: number): 0 | 1 | 2 {
  if (superseded.has(s)) return 0;
  return s.retainUntil !== undefined && s.retainUntil > now ? 2 : 1;
}

const CAUSES: readonly EvictionCause[] = ['superseded', 'lru', 'ttl_pressure'];

/** Within one class: LRU (classes 0, 1); lowest priority, then most recently used (class 2, see the module doc); then index. */
function withinClass(a: CachedSequence, b: CachedSequence, cls: 0 | 1 | 2): number {
  if (cls === 2) {
    const d = (a.priority ?? 0) - (b.priority ?? 0) || b.lastUsed - a.lastUsed;
    if (d !== 0) return d;
  }
  return a.lastUsed - b.lastUsed || a.index - b.index;
}

/**
 * Cached states of `idle` (empty ones left out) in the order they are evicted at `now` (any
 * monotonic ms, the clock of `lastUsed`), each with its cause: superseded, then past their
 * retention window (LRU), then inside it (lowest priority, then most recently used: see the module doc).
 */
export function evictionOrder<S extends CachedSequence>(idle: readonly S[], now: number, align: number | null): Eviction<S>[] {
  const sup = supersededStates(idle, align);
  const ranked = idle.filter((s) => s.tokens.length > 0).map((s) => ({ s, c: retentionClass(s, sup, now) }));
  ranked.sort((x, y) => x.c - y.c || withinClass(x.s, y.s, x.c));
  return ranked.map((r) => ({ seq: r.s, cause: CAUSES[r.c]! }));
}

/**
 * Pick the idle sequence for `prompt` (undefined = plain allocation, no reuse): the one with the
 * longest reusable prefix that keeps ≥ MIN_KEEP_FRACTION of its tokens (ties: the more recently
 * used, then lower index) — a state inside its retention window only when the prompt keeps all
 * of it that its own session would reuse (another session's prompt must not cut a paused one
 * short); else an empty sequence, else (all idle ones hold a cache) the first to evict
 * (`evictionOrder` class: superseded, past its window, inside it), whose cache is dropped except
 * the prefix the prompt shares with it (`evicts` = the cause). Among empty ones and within a
 * class, the one that keeps the busy sequences (`busy`: their indices) in the fewest runs of
 * consecutive ids (`runDelta`), then the lowest index (empty) or the class order (cached). Why:
 * llama.cpp splits a batch into ubatches of consecutive, increasing sequence ids (one KV stream
 * each; the engine sorts its queue by id), each a full pass over the weights, so 4 decoding
 * sequences 2, 5, 9, 13 cost 4 passes per step where 3–6 cost 1 — in a long-lived decode worker
 * every sequence holds a cache and plain LRU scatters new rooms over the context
 * (BENCHMARKS.md §4). Only sequences of the same `salt` (the request's tenant) are reused; any
 * may be evicted. `now`: the clock of `lastUsed` (absent = every window is over).
 * Never returns undefined when `free` is non-empty: eviction never fails an allocation.
 */
export function chooseSequence<S extends CachedSequence>(free: readonly S[], prompt: readonly number[] | undefined, settings: PrefixCacheSettings, busy?: ReadonlySet<number>, salt?: string, now = Infinity): SequenceChoice<S> | undefined {
  if (free.length === 0) return undefined;
  let best: SequenceChoice<S> | undefined;
  const reusable = (s: S): number => (settings.enabled && prompt && prompt.length > 0 && s.tokens.length > 0 && s.salt === salt ? reusableTokens(s.tokens, s.exactPrefix, prompt, settings.align) : 0);
  for (const s of free) {
    // another salt's KV is never reused (tenants do not share prefixes: vLLM's cache_salt)
    const reuse = reusable(s);
    if (reuse === 0 || reuse < MIN_KEEP_FRACTION * s.tokens.length) continue;
    if (s.retainUntil !== undefined && s.retainUntil > now && reuse < neededTokens(s)) continue;
    if (!best || reuse > best.reuse || (reuse === best.reuse && (s.lastUsed > best.seq.lastUsed || (s.lastUsed === best.seq.lastUsed && s.index < best.seq.index)))) best = { seq: s, reuse };
  }
  if (best) return best;
  const delta = (s: S): number => (busy && busy.size > 0 ? runDelta(busy, s.index) : 0);
  let pick: S | undefined;
  let pickDelta = 0;
  for (const s of free) {
    if (s.tokens.length !== 0) continue;
    const d = delta(s);
    if (!pick || d < pickDelta || (d === pickDelta && s.index < pick.index)) {
      pick = s;
      pickDelta = d;
    }
  }
  if (pick) return { seq: pick, reuse: 0 };
  const sup = supersededStates(free, settings.align);
  let cls: 0 | 1 | 2 = 2;
  for (const s of free) {
    const c = retentionClass(s, sup, now);
    const d = delta(s);
    if (!pick || c < cls || (c === cls && (d < pickDelta || (d === pickDelta && withinClass(s, pick, c) < 0)))) {
      pick = s;
      pickDelta = d;
      cls = c;
    }
  }
  return { seq: pick!, reuse: reusable(pick!), evicts: CAUSES[cls]! };
}

/**
 * Idle sequences to clear so that the cached tokens fit `maxTokens`, in `evictionOrder` at `now`
 * (absent = every window is over: superseded first, then least recently used), with their cause.
 * Sequences holding nothing are never returned.
 */
export function evictionsForBudget<S extends CachedSequence>(idle: readonly S[], maxTokens: number, now = Infinity, align: number | null = null): Eviction<S>[] {
  let total = 0;
  for (const s of idle) total += s.tokens.length;
  if (total <= maxTokens) return [];
  const out: Eviction<S>[] = [];
  for (const e of evictionOrder(idle, now, align)) {
    if (total <= maxTokens) break;
    out.push(e);
    total -= e.seq.tokens.length;
  }
  return out;
}
