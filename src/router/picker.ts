/**
 * THE picker: which prefill and decode serve one attempt of a request, in one call. Its seam is
 * small on purpose — routing features (sessions and exact-prefix routing, several routers sharing
 * a pool) replace or wrap it without touching the attempts:
 *
 *   pick(facts: PickFacts) → { prefill, decode, localPrefill? } | { error, reason, waitable }
 *   learn(round: PickRound) — what became of a pick (the pair's KV handshake, the decode's new prefix:
 *   its prompt blocks count as held there until the worker's own event says so, ./kv-events.ts `expect`)
 *
 * | input (PickFacts) | meaning |
 * |---|---|
 * | `text` | the routing text (./policy/index.ts `routingText`): the prompt as the approximate tree sees it |
 * | `tokens` | the prompt's tokens as the workers tokenize it (./tokens.ts), or undefined (no router tokenizer) |
 * | `salt` | the request's cache salt: the root of its block hashes (../protocol/token-blocks.ts) |
 * | `resumed` | tokens the client already has (a migration's `resume_token_ids`): evaluated after the prompt, so lacked too |
 * | `key` | the explicit session key (./policy/affinity.ts), or undefined |
 * | `avoid` | workers of the request's failed attempts: skipped while other candidates exist |
 * | `prefill` | a fixed prefill (a choice group's, ./choices.ts): taken when it is a candidate |
 * | `local` | may the attempt go to decode alone (decode-local)? false for a choice of a group |
 *
 * Load as the policies see it is this router's own in-flight count plus the other routers' as the
 * workers report it (`othersLoad`, ./load-watch.ts).
 * A pair is chosen as ./pairing.ts `pickPair` does (prefill among those with a compatible decode,
 * then decode among that prefill's), through each role's policy (counted in
 * pdserve_router_policy_picks_total {role, policy, reason}) and the pair blocks of failed KV
 * handshakes (./pair-blocks.ts). Each policy gets the prompt's exact match per worker: its block
 * hashes (in each worker's block size, computed once per size) against the blocks that worker's KV
 * events name (./kv-events.ts). `localPrefill` (max uncached tokens decode evaluates) is set when
 * what the decode picked lacks of the prompt, in tokens, is within the limit (./policy/index.ts
 * `localPrefillFor`). An error names
 * what is missing (`no_healthy_prefill`, `no_healthy_decode`, `no_compatible_pair`), the client's
 * message (`reason`), and whether waiting may help (`waitable`: a role with no healthy worker, or
 * compatible pairs that are only blocked for a while; a settings mismatch is final).
 */
import { systemClock } from '../base/clock.js';
import type { Counter } from 'prom-client';
import { pickPair } from './pairing.js';
import { localPrefillFor, type ExactFacts, type Pick, type Policy } from './policy/index.js';
import { blockHashes } from '../protocol/token-blocks.js';
import type { PairBlocks } from './pair-blocks.js';
import type { WorkerRegistry, WorkerState } from './registry.js';
import type { KvEventConsumer } from './kv-events.js';

/** The request facts a pick needs (see the module doc's table). */
export interface PickFacts {
  text: string;
  tokens?: ArrayLike<number>;
  salt?: string;
  resumed?: number;
  key?: string;
  avoid?: ReadonlySet<WorkerState>;
  prefill?: WorkerState;
  local: boolean;
}

/** Why no pair was found. */
export type PickError = 'no_healthy_prefill' | 'no_healthy_decode' | 'no_compatible_pair';

/** A pick: a pair (decode-local: `localPrefill` max tokens), or why there is none. */
export type PickAnswer = { prefill: WorkerState; decode: WorkerState; localPrefill?: number } | { error: PickError; reason: string; waitable: boolean };

/** What became of one pick (its attempt's end), for the picker to learn from. */
export interface PickRound {
  prefill: WorkerState;
  decode: WorkerState;
  /** The attempt's outcome: ok, or the failure code that ended it. */
  ok: boolean;
  /** A failed KV handshake between the two (./pair-blocks.ts PAIR_FAILURE_CODES): the pair leaves the rotation; returns the block's ms. */
  pairFailed?: string;
  /** An ok round: the conversation as the decode now holds it (routing text after the reply). */
  heldText?: string;
  /** An ok round: its prompt's tokens (when the router tokenized it), cache salt and session key: held by the decode now. */
  tokens?: ArrayLike<number>;
  salt?: string;
  key?: string;
}

/** The picker's seam (the module doc). */
export interface PairPicker {
  pick(facts: PickFacts): PickAnswer;
  learn(round: PickRound): number | undefined;
}

/** What the router's picker is built from. */
export interface PickerDeps {
  registry: WorkerRegistry;
  policies: { prefill: Policy; decode: Policy };
  /** pdserve_router_policy_picks_total {role, policy, reason}. */
  picks: Counter<'role' | 'policy' | 'reason'>;
  /** The workers' KV events (./kv-events.ts): what each decode holds. */
  kv: KvEventConsumer;
  pairs: PairBlocks;
  /** `--local-prefill-max-tokens` (0: never decode-local). */
  localPrefillMaxTokens: number;
  /** Other routers' in-flight requests on a worker (./load-watch.ts `LoadWatch.others`); absent: this router's own count only. */
  othersLoad?: (url: string) => number;
}

/** The router's picker: policies + KV events + pair blocks over the registry (see the module doc). */
export class Picker implements PairPicker {
  constructor(private readonly d: PickerDeps) {}

  /** The prompt's block hashes per block size, computed on first use (one size in a uniform cluster). */
  private static hashes(tokens: ArrayLike<number>, salt: string | undefined): (blockTokens: number) => readonly number[] {
    const by = new Map<number, readonly number[]>();
    return (b) => {
      let h = by.get(b);
      if (!h) by.set(b, (h = blockHashes(tokens, b, salt)));
      return h;
    };
  }

  /** The exact facts of a prompt (undefined: no tokens). */
  exact(tokens: ArrayLike<number> | undefined, salt: string | undefined, now: number, key?: string): ExactFacts | undefined {
    if (!tokens) return undefined;
    const { kv } = this.d;
    const hashesFor = Picker.hashes(tokens, salt);
    return {
      promptTokens: tokens.length,
      matched: (url) => {
        kv.follow({ url });
        return kv.matchedTokens(url, hashesFor, now, tokens.length, key);
      },
    };
  }

  pick(f: PickFacts): PickAnswer {
    const { registry, policies, pairs } = this.d;
    const now = systemClock.nowMs();
    const exact = this.exact(f.tokens, f.salt, now, f.key);
    let decodePick: Pick<WorkerState> | null = null;
    const avoiding = (c: WorkerState[]): WorkerState[] => {
      const rest = f.avoid?.size ? c.filter((w) => !f.avoid!.has(w)) : c;
      return rest.length ? rest : c;
    };
    const others = this.d.othersLoad;
    const policy = (role: 'prefill' | 'decode') => (c: WorkerState[]): WorkerState | null => {
      const cand = avoiding(c);
      // Other routers' load on each worker (./load-watch.ts) counts as if it were this router's.
      const views = others ? cand.map((w) => ({ ref: w, url: w.url, load: w.load + others(w.url), slots: w.slots, gpu: w.gpu })) : null;
      const p = views ? policies[role].pick(views, f.text, now, f.key, exact) : policies[role].pick(cand, f.text, now, f.key, exact);
      const worker = p ? ('ref' in p.worker ? p.worker.ref : p.worker) : null;
      if (p) this.d.picks.inc({ role, policy: policies[role].name, reason: p.reason });
      if (role === 'decode') decodePick = p && worker ? { ...p, worker } : null;
      return worker;
    };
    const fixed = f.prefill;
    const pair = pickPair(registry, fixed ? (c) => (c.includes(fixed) ? fixed : null) : policy('prefill'), policy('decode'), (p, d) => pairs.usable(p.url, d.url));
    if ('error' in pair) {
      const reason = pair.error === 'no_compatible_pair' ? 'no healthy prefill–decode pair with matching settings (see GET /workers: mismatch)' : `no healthy ${pair.error.slice('no_healthy_'.length)} worker`;
      // A mismatch no pair can serve is final; blocked pairs only (a pair exists once the blocks are ignored) may come back.
      const waitable = pair.error !== 'no_compatible_pair' || !('error' in pickPair(registry, (c) => c[0] ?? null, (c) => c[0] ?? null, () => true));
      return { error: pair.error, reason, waitable };
    }
    const dp = decodePick as Pick<WorkerState> | null;
    // the policy's pick is the pair's decode unless the pair blocks replaced it: then it is not known to hold anything
    const dpFor = dp && dp.worker === pair.decode ? dp : null;
    const localPrefill = f.local ? localPrefillFor(this.d.localPrefillMaxTokens, policies.decode.name, dpFor, f.tokens?.length, f.resumed) : undefined;
    return localPrefill ? { ...pair, localPrefill } : pair;
  }

  learn(r: PickRound): number | undefined {
    const { pairs, policies, kv } = this.d;
    let blockedMs: number | undefined;
    if (r.pairFailed) blockedMs = pairs.block(r.prefill.url, r.decode.url, r.pairFailed);
    else if (r.ok) pairs.ok(r.prefill.url, r.decode.url);
    if (r.ok && r.heldText !== undefined) {
      // The decode worker now keeps this round (prompt + reply): the next round's prefix.
      policies.decode.record?.(r.heldText, r.decode.url, systemClock.nowMs());
      if (r.tokens) kv.expect(r.decode.url, Picker.hashes(r.tokens, r.salt), systemClock.nowMs(), r.key);
    }
    return blockedMs;
  }
}
