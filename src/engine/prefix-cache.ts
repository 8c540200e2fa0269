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
}

/** Prefix-cache settings of an engine. */
export interface PrefixCacheSettings {
  /** Keep finished sequences' KV for reuse. */
  enabled: boolean;
  /** Chunk size reuse is aligned to (deterministic mode), or null for whole-prefix reuse. */
  align: number | null;
  /** Most tokens held by idle sequences together; the least recently used are evicted beyond it. */
  maxTokens: number;
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
 * Pick the idle sequence for `prompt` (undefined = plain allocation, no reuse): the one with the
 * longest reusable prefix that keeps ≥ MIN_KEEP_FRACTION of its tokens (ties: the more recently
 * used, then lower index); else an empty sequence, else (all idle ones hold a cache) any idle one,
 * whose cache is dropped. Among those, the one that keeps the busy sequences (`busy`: their
 * indices) in the fewest runs of consecutive ids (`runDelta`), then the lowest index (empty) or
 * the least recently used (cached). Why: llama.cpp splits a batch into ubatches of consecutive,
 * increasing sequence ids (one KV stream each; the engine sorts its queue by id), each a full
 * pass over the weights, so 4 decoding sequences 2, 5, 9, 13 cost 4 passes per step where 3–6
 * cost 1 — in a long-lived decode worker every sequence holds a cache and plain LRU scatters new
 * rooms over the context (BENCHMARKS.md §4). Without `busy`: lowest index / LRU. Only
 * sequences of the same `salt` (the request's tenant) are reused; any may be evicted.
 * Never returns undefined when `free` is non-empty: eviction never fails an allocation.
 */
export function chooseSequence<S extends CachedSequence>(free: readonly S[], prompt: readonly number[] | undefined, settings: PrefixCacheSettings, busy?: ReadonlySet<number>, salt?: string): SequenceChoice<S> | undefined {
  if (free.length === 0) return undefined;
  let best: SequenceChoice<S> | undefined;
  if (settings.enabled && prompt && prompt.length > 0) {
    for (const s of free) {
      // another salt's KV is never reused (tenants do not share prefixes: vLLM's cache_salt)
      if (s.tokens.length === 0 || s.salt !== salt) continue;
      const reuse = reusableTokens(s.tokens, s.exactPrefix, prompt, settings.align);
      if (reuse === 0 || reuse < MIN_KEEP_FRACTION * s.tokens.length) continue;
      if (!best || reuse > best.reuse || (reuse === best.reuse && (s.lastUsed > best.seq.lastUsed || (s.lastUsed === best.seq.lastUsed && s.index < best.seq.index)))) best = { seq: s, reuse };
    }
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
  if (!pick) {
    for (const s of free) {
      const d = delta(s);
      if (!pick || d < pickDelta || (d === pickDelta && (s.lastUsed < pick.lastUsed || (s.lastUsed === pick.lastUsed && s.index < pick.index)))) {
        pick = s;
        pickDelta = d;
      }
    }
  }
  return { seq: pick!, reuse: 0 };
}

/**
 * Idle sequences to clear so that the cached tokens fit `maxTokens`, least recently used first.
 * Sequences holding nothing are never returned.
 */
export function evictionsForBudget<S extends CachedSequence>(idle: readonly S[], maxTokens: number): S[] {
  let total = 0;
  for (const s of idle) total += s.tokens.length;
  if (total <= maxTokens) return [];
  const order = idle.filter((s) => s.tokens.length > 0).sort((a, b) => a.lastUsed - b.lastUsed || a.index - b.index);
  const out: S[] = [];
  for (const s of order) {
    if (total <= maxTokens) break;
    out.push(s);
    total -= s.tokens.length;
  }
  return out;
}
