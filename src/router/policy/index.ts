/**
 * Load-balancing policies of the router (`--policy`), one instance per worker role. Each picks
 * one worker among the healthy candidates for a request, given the request's routing text.
 *
 * - `round_robin`: in turn.
 * - `least_load`: fewest in-flight requests (the router's own count); ties in turn.
 * - `power_of_two`: two distinct random candidates, the less loaded (Mitzenmacher's "power of
 *   two choices"; SGLang's `power_of_two`).
 * - `cache_aware` (default): routes on what the workers hold.
 *   Exact first (`ExactFacts`: the router tokenized the prompt as the workers do and the workers'
 *   KV events name their token blocks, ../kv-events.ts): the candidate holding the longest run of
 *   the prompt's leading blocks, not overloaded, ties to the less loaded, is taken (`cache_hit`)
 *   when that run covers more than `cacheThreshold` of the prompt's tokens.
 *   Then session affinity (./affinity.ts): a request with an explicit session key goes to the
 *   worker that served the key last when it is a candidate and not overloaded — its load exceeds
 *   the least loaded candidate's by more than `balanceAbsThreshold` AND is more than
 *   `balanceRelThreshold` times it (SGLang's imbalance rule, applied to that one worker).
 *   Then SGLang's cache-aware rule (sgl-router `policies/cache_aware.rs`): imbalanced (the rule
 *   over all candidates) → the least loaded. Otherwise, only when some candidate has no exact
 *   facts (no live event stream, or no router tokenizer), the approximate prefix tree over the
 *   routing text (PrefixTree) decides as SGLang's does (longest match over `cacheThreshold`, else
 *   the smallest tree); with exact facts for every candidate the tree is not consulted and the
 *   least loaded is taken. The text is recorded in the tree for the chosen worker either way.
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
export type PickReason = 'round_robin' | 'least_load' | 'power_of_two' | 'imbalanced' | 'cache_hit' | 'cache_miss' | 'affinity' | 'packed';

export interface Pick<W extends PolicyWorker> {
  worker: W;
  reason: PickReason;
  /** cache_aware: characters of the text the chosen worker's tree matched. */
  matchedChars?: number;
  /** cache_aware with exact facts: leading prompt tokens the chosen worker holds (undefined: unknown). */
  matchedTokens?: number;
}

/** What the router knows exactly of a request's prompt against the workers (cache_aware). */
export interface ExactFacts {
  /** Prompt tokens, as the workers tokenize it. */
  promptTokens: number;
  /** Leading prompt tokens worker `url` holds (whole blocks its events name); undefined: unknown (no live events). */
  matched(url: string): number | undefined;
}

/** A load-balancing policy for one role. */
export interface Policy {
  readonly name: PolicyName;
  /**
   * Choose among `candidates` (the healthy workers; may be empty → null). `now` in ms. `key`:
   * the request's explicit session key (./affinity.ts), used by cache_aware; `exact`: the
   * prompt's exact match per worker (used by cache_aware; absent: the router has no tokens).
   */
  pick<W extends PolicyWorker>(candidates: readonly W[], text: string, now: number, key?: string, exact?: ExactFacts): Pick<W> | null;
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

  pick<W extends PolicyWorker>(c: readonly W[], text: string, now: number, key?: string, exact?: ExactFacts): Pick<W> | null {
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
    // Exact: the longest run of the prompt's leading blocks a worker holds, unless overloaded.
    const matched = new Map<string, number | undefined>();
    let allKnown = exact !== undefined;
    let holder: W | undefined;
    let held = 0;
    if (exact) {
      for (const w of c) {
        const n = exact.matched(w.url);
        matched.set(w.url, n);
        if (n === undefined) allKnown = false;
        else if (!this.overloaded(w.load, min) && (n > held || (n === held && holder && n > 0 && w.load < holder.load))) {
          holder = w;
          held = n;
        }
      }
    }
    const tokensOf = (w: W): { matchedTokens?: number } => (matched.get(w.url) === undefined ? {} : { matchedTokens: matched.get(w.url)! });
    if (holder && exact && held > 0 && held / exact.promptTokens > this.o.cacheThreshold) {
      pick = { worker: holder, reason: 'cache_hit', matchedTokens: held };
    } else if (sticky && !this.overloaded(sticky.load, min)) {
      pick = { worker: sticky, reason: 'affinity', ...tokensOf(sticky) };
    } else if (this.overloaded(max, min)) {
      const w = leastLoaded(c, this.rr++);
      pick = { worker: w, reason: 'imbalanced', ...tokensOf(w) };
    } else if (allKnown) {
      const packed = this.o.packBatches ? packedWorker(c, (load) => this.overloaded(load, min)) : undefined;
      const w = packed ?? leastLoaded(c, this.rr++);
      pick = { worker: w, reason: packed ? 'packed' : 'cache_miss', ...tokensOf(w) };
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
        pick = { worker: best, reason: 'cache_hit', matchedChars: bestChars, ...tokensOf(best) };
      } else if (packed) {
        pick = { worker: packed, reason: 'packed', matchedChars: m.byTenant.get(packed.url) ?? 0, ...tokensOf(packed) };
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
        pick = { worker: w, reason: 'cache_miss', matchedChars: m.byTenant.get(w.url) ?? 0, ...tokensOf(w) };
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
 * Decode-local continuation at the router (Dynamo's conditional disaggregation,
 * `disagg_router.rs`: prefill remotely iff prompt − prefix hit > max_local_prefill_length),
 * decided on exact numbers: the prompt's tokens as the workers tokenize them and the leading
 * tokens the chosen decode holds (whole blocks its KV events name). Local iff it is on
 * (`maxTokens` > 0), the decode policy is cache_aware, the pick was not an imbalance pick, the
 * decode holds at least one block of the prompt, and what it lacks — prompt − matched, at least
 * 1 (the engine always evaluates the last prompt token), plus `resumed` (a migration's tokens the
 * client has, evaluated after the prompt) — is at most `maxTokens`. Unknown numbers
 * (no router tokenizer, no live events) never go local. Decode checks again (../../decode/local.ts):
 * a `needs_prefill` is then a race (an eviction between the event and the request), counted.
 * @returns the `local_prefill.max_tokens` to send, or undefined for the PD path.
 */
export function localPrefillFor(maxTokens: number, policy: PolicyName, pick: Pick<PolicyWorker> | null, promptTokens: number | undefined, resumed = 0): number | undefined {
  if (maxTokens <= 0 || policy !== 'cache_aware' || !pick || pick.reason === 'imbalanced') return undefined;
  const matched = pick.matchedTokens;
  if (promptTokens === undefined || matched === undefined || matched <= 0) return undefined;
  return Math.max(1, promptTokens - matched) + resumed <= maxTokens ? maxTokens : undefined;
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
