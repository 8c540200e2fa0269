/**
 * Load-balancing policies of the router (`--policy`), one instance per worker role. Each picks
 * one worker among the healthy candidates for a request, given the request's routing text.
 *
 * - `round_robin`: in turn.
 * - `least_load`: fewest in-flight requests (the router's own count); ties in turn.
 * - `power_of_two`: two distinct random candidates, the less loaded (Mitzenmacher's "power of
 *   two choices"; SGLang's `power_of_two`).
 * - `cache_aware` (default): SGLang's cache-aware policy (sgl-router `policies/cache_aware.rs`).
 *   The system is imbalanced iff max load − min load > `balanceAbsThreshold` AND max load >
 *   min load × `balanceRelThreshold`; then the least-loaded worker is taken. Otherwise the worker
 *   whose recent requests share the longest prefix with this one (PrefixTree) is taken when the
 *   match covers more than `cacheThreshold` of the text; else the worker with the smallest tree
 *   (most spare cache). Either way the text is recorded for the chosen worker.
 *   Session affinity first (./affinity.ts): a request with a conversation key goes to the worker
 *   that served the key last when it is a candidate and not overloaded — its load exceeds the
 *   least loaded candidate's by more than `balanceAbsThreshold` AND is more than
 *   `balanceRelThreshold` times it (the imbalance rule, applied to that one worker).
 *   With `packBatches` (the router's decode policy), the "smallest tree" fallback gives way to
 *   batch packing on CPU hosts (./pack.ts): the most loaded worker with a free slot.
 */
import { PrefixTree } from './radix-tree.js';
import { SessionTable } from './affinity.js';
import { packedWorker } from './pack.js';

/** What a policy needs of a worker. */
export interface PolicyWorker {
  readonly url: string;
  /** In-flight requests. */
  readonly load: number;
}

export const POLICY_NAMES = ['cache_aware', 'least_load', 'round_robin', 'power_of_two'] as const;
export type PolicyName = (typeof POLICY_NAMES)[number];

/** Settings of the cache-aware policy (defaults: SGLang router's CLI defaults, tree bounded lower). */
export interface CacheAwareOptions {
  /** Matched fraction of the text above which the longest-match worker is taken (0..1). Default 0.3. */
  cacheThreshold: number;
  /** Absolute in-flight difference that may count as imbalance. Default 64. */
  balanceAbsThreshold: number;
  /** Relative factor max > min × this that may count as imbalance. Default 1.5. */
  balanceRelThreshold: number;
  /** Characters of routing text remembered per worker (LRU beyond). Default 4 Mi. */
  maxTreeChars: number;
  /** Conversation keys remembered (LRU beyond). Default 65 536. */
  maxSessions: number;
  /** Fill one worker's batch before the next on CPU hosts (./pack.ts) where no cache claim decides. Default false. */
  packBatches: boolean;
}

export const DEFAULT_CACHE_AWARE: CacheAwareOptions = { cacheThreshold: 0.3, balanceAbsThreshold: 64, balanceRelThreshold: 1.5, maxTreeChars: 4 << 20, maxSessions: 65_536, packBatches: false };

/** Why a policy chose its worker (for logs and metrics). */
export type PickReason = 'round_robin' | 'least_load' | 'power_of_two' | 'imbalanced' | 'cache_hit' | 'cache_miss' | 'affinity' | 'held' | 'packed';

export interface Pick<W extends PolicyWorker> {
  worker: W;
  reason: PickReason;
  /** cache_aware: characters of the text the chosen worker's tree matched. */
  matchedChars?: number;
}

/** A load-balancing policy for one role. */
export interface Policy {
  readonly name: PolicyName;
  /**
   * Choose among `candidates` (the healthy workers; may be empty → null). `now` in ms. `key`:
   * the request's conversation key (./affinity.ts), used by cache_aware; `holds(url)`: whether
   * that worker's KV events say it holds the key's conversation (undefined: no live events).
   */
  pick<W extends PolicyWorker>(candidates: readonly W[], text: string, now: number, key?: string, holds?: (url: string) => boolean | undefined): Pick<W> | null;
  /** Forget a worker (removed from the cluster). */
  forget?(url: string): void;
  /**
   * Remember that worker `url` now holds `text` as a prefix (cache_aware only): the router
   * records a finished conversation round (prompt + reply) for the decode worker that kept it.
   */
  record?(text: string, url: string, now: number): void;
}

class RoundRobin implements Policy {
  readonly name = 'round_robin';
  private next = 0;
  pick<W extends PolicyWorker>(c: readonly W[]): Pick<W> | null {
    if (c.length === 0) return null;
    const w = c[this.next % c.length]!;
    this.next = (this.next + 1) % 1_000_000_007;
    return { worker: w, reason: 'round_robin' };
  }
}

/** Least-loaded candidate, ties in turn (`rr` advances per call). */
function leastLoaded<W extends PolicyWorker>(c: readonly W[], rr: number): W {
  let min = Infinity;
  let tied: W[] = [];
  for (const w of c) {
    if (w.load < min) {
      min = w.load;
      tied = [w];
    } else if (w.load === min) tied.push(w);
  }
  return tied[rr % tied.length]!;
}

class LeastLoad implements Policy {
  readonly name = 'least_load';
  private rr = 0;
  pick<W extends PolicyWorker>(c: readonly W[]): Pick<W> | null {
    if (c.length === 0) return null;
    const w = leastLoaded(c, this.rr);
    this.rr = (this.rr + 1) % 1_000_000_007;
    return { worker: w, reason: 'least_load' };
  }
}

class PowerOfTwo implements Policy {
  readonly name = 'power_of_two';
  constructor(private readonly random: () => number) {}
  pick<W extends PolicyWorker>(c: readonly W[]): Pick<W> | null {
    if (c.length === 0) return null;
    if (c.length === 1) return { worker: c[0]!, reason: 'power_of_two' };
    const i = Math.floor(this.random() * c.length);
    let j = Math.floor(this.random() * (c.length - 1));
    if (j >= i) j++;
    const a = c[i]!;
    const b = c[j]!;
    return { worker: b.load < a.load ? b : a, reason: 'power_of_two' };
  }
}

class CacheAware implements Policy {
  readonly name = 'cache_aware';
  private readonly tree: PrefixTree;
  private readonly sessions: SessionTable;
  private rr = 0;
  constructor(private readonly o: CacheAwareOptions) {
    this.tree = new PrefixTree(o.maxTreeChars);
    this.sessions = new SessionTable(o.maxSessions);
  }

  /** The imbalance rule between two loads (SGLang's cache_aware): `hi` is overloaded against `lo`. */
  private overloaded(hi: number, lo: number): boolean {
    return hi - lo > this.o.balanceAbsThreshold && hi > lo * this.o.balanceRelThreshold;
  }

  pick<W extends PolicyWorker>(c: readonly W[], text: string, now: number, key?: string, holds?: (url: string) => boolean | undefined): Pick<W> | null {
    if (c.length === 0) return null;
    let min = Infinity;
    let max = -Infinity;
    for (const w of c) {
      min = Math.min(min, w.load);
      max = Math.max(max, w.load);
    }
    let pick: Pick<W>;
    const stickyUrl = key === undefined ? undefined : this.sessions.get(key);
    const sticky = stickyUrl === undefined ? undefined : c.find((w) => w.url === stickyUrl);
    // A worker whose events say it holds the conversation, least loaded first, unless overloaded.
    let holder: W | undefined;
    if (key !== undefined && holds) for (const w of c) if (holds(w.url) === true && !this.overloaded(w.load, min) && (!holder || w.load < holder.load)) holder = w;
    if (holder) {
      pick = { worker: holder, reason: 'held', matchedChars: this.tree.match(text).byTenant.get(holder.url) ?? 0 };
    } else if (sticky && !this.overloaded(sticky.load, min)) {
      pick = { worker: sticky, reason: 'affinity', matchedChars: this.tree.match(text).byTenant.get(sticky.url) ?? 0 };
    } else if (this.overloaded(max, min)) {
      pick = { worker: leastLoaded(c, this.rr++), reason: 'imbalanced' };
    } else {
      const m = this.tree.match(text);
      let best: W | undefined;
      let bestChars = 0;
      for (const w of c) {
        const n = m.byTenant.get(w.url) ?? 0;
        if (n > bestChars || (n === bestChars && best && n > 0 && w.load < best.load)) {
          best = w;
          bestChars = n;
        }
      }
      const packed = this.o.packBatches ? packedWorker(c, (load) => this.overloaded(load, min)) : undefined;
      if (best && text.length > 0 && bestChars / text.length > this.o.cacheThreshold) {
        pick = { worker: best, reason: 'cache_hit', matchedChars: bestChars };
      } else if (packed) {
        pick = { worker: packed, reason: 'packed', matchedChars: m.byTenant.get(packed.url) ?? 0 };
      } else {
        // Smallest tree = most room for new prefixes; ties: lower load, then in turn.
        let smallest = Infinity;
        let tied: W[] = [];
        for (const w of c) {
          const s = this.tree.tenantChars(w.url);
          if (s < smallest) {
            smallest = s;
            tied = [w];
          } else if (s === smallest) tied.push(w);
        }
        const w = leastLoaded(tied, this.rr++);
        pick = { worker: w, reason: 'cache_miss', matchedChars: m.byTenant.get(w.url) ?? 0 };
      }
    }
    this.rr %= 1_000_000_007;
    this.tree.insert(text, pick.worker.url, now);
    if (key !== undefined) this.sessions.set(key, pick.worker.url);
    return pick;
  }

  forget(url: string): void {
    this.tree.removeTenant(url);
    this.sessions.forget(url);
  }

  record(text: string, url: string, now: number): void {
    this.tree.insert(text, url, now);
  }
}

/** Create a policy by name. `random` (power_of_two) defaults to Math.random. */
export function createPolicy(name: PolicyName, cacheAware: Partial<CacheAwareOptions> = {}, random: () => number = Math.random): Policy {
  switch (name) {
    case 'round_robin':
      return new RoundRobin();
    case 'least_load':
      return new LeastLoad();
    case 'power_of_two':
      return new PowerOfTwo(random);
    case 'cache_aware':
      return new CacheAware({ ...DEFAULT_CACHE_AWARE, ...cacheAware });
  }
}

/**
 * Most characters per token assumed when the router guesses whether a decode-local suffix can
 * be short (a routing hint only: decode counts tokens exactly and answers `needs_prefill`).
 */
export const MAX_CHARS_PER_TOKEN = 8;

/**
 * Decode-local continuation at the router (Dynamo's conditional disaggregation; decode makes the
 * exact decision in tokens, ../../decode/local.ts): try the local path iff it is on
 * (`maxTokens` > 0), the decode policy is cache_aware and its pick was a tree hit or the
 * conversation's sticky worker (the worker served this conversation's earlier round and kept
 * it), and the unmatched part of the routing text could be at most `maxTokens` tokens. A pick
 * the worker's live KV events contradict (`held` false: it no longer holds the conversation)
 * never goes local: that claim is stale and would only come back `needs_prefill`; a 'held' pick
 * (the events say it does) goes local. The imbalance guard applies first: an imbalanced pick
 * is never a hit, so a hot conversation cannot pile onto one decode worker.
 * @returns the `local_prefill.max_tokens` to send, or undefined for the PD path.
 */
export function localPrefillFor(maxTokens: number, policy: PolicyName, pick: Pick<PolicyWorker> | null, textLength: number, held?: boolean): number | undefined {
  if (maxTokens <= 0 || policy !== 'cache_aware' || !pick || held === false) return undefined;
  if (pick.reason === 'held') return maxTokens;
  if (pick.reason !== 'cache_hit' && pick.reason !== 'affinity') return undefined;
  const unmatched = textLength - (pick.matchedChars ?? 0);
  return unmatched <= maxTokens * MAX_CHARS_PER_TOKEN ? maxTokens : undefined;
}

/**
 * Routing text of a conversation round once answered: the request's text followed by the reply,
 * as the next round will send it (chat: an assistant message; completion: the text continued).
 */
export function routingTextAfter(r: Parameters<typeof routingText>[0], reply: string): string {
  if (r.kind === 'chat') return routingText({ kind: 'chat', messages: [...r.messages, { role: 'assistant', content: reply }] });
  return routingText(r) + reply;
}

/**
 * Routing text of a request for the prefix tree: what the worker will render and tokenize, in
 * the same order (chat: role and content of each message; completion: the prompt text, or the
 * token ids as text). Two requests whose texts share a prefix share a tokenized prefix, roughly.
 */
export function routingText(r: { kind: 'chat'; messages: readonly { role: string; content: string }[] } | { kind: 'completion'; prompt: { text: string } | { input_ids: number[] } }): string {
  if (r.kind === 'chat') return r.messages.map((m) => `<|${m.role}|>${m.content}`).join('');
  return 'text' in r.prompt ? r.prompt.text : r.prompt.input_ids.join(',') + ',';
}
