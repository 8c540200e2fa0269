/**
 * A worker's per-block KV events: which token blocks (../protocol/token-blocks.ts, chained
 * hashes rooted at the cache salt) this process really keeps, in either tier. Decode and
 * colocated note every generation that ended normally with its tokens (prompt + reply); prefill
 * notes every computed prompt (its sequence keeps the prompt once released).
 *
 * The engine keeps such a sequence among its idle ones and evicts it later (LRU, budget, reuse by
 * another request) without telling anyone; so the tracker asks the engine itself how many leading
 * tokens of an entry it would reuse: `engine.reusableFor(tokens)` (the sequence tier) or, once
 * the sequences dropped it, `engine.storedReusableFor` (the host's prefix store, asked
 * asynchronously at most every STORE_RECHECK_MS: decode loads the state from there). An entry is
 * published `stored` with the hashes of the whole blocks of that reusable prefix, its tier the
 * one that serves it (`sequence` before `store`), and `evicted` when neither holds a block of it
 * any more; a changed block count or tier is announced again (evicted on the old tier first).
 *
 * | entry field | meaning |
 * |---|---|
 * | key | `b<hash of the entry's last whole block>`: one entry per distinct token run |
 * | blocks | chained hashes of the leading whole blocks held, in order |
 * | tokens | blocks × block size |
 * | seq_tokens | tokens of the whole kept sequence (prompt + reply) |
 * | shared | another session's prompt sharing half of it may take it (the engine's rule, asked of the engine with such a prompt); false: a paused session's state inside its retention window |
 *
 * A newer entry whose tokens extend an older one (the conversation's next round) supersedes it:
 * the older is dropped (`evicted`) once the newer is published, the newer names the same blocks.
 * Checked after every noted finish and whenever the engine's cached counts change (a 100 ms probe
 * of `cachedStats()`, O(entries × tokens)). Bounded: at most `maxEntries` tracked (the oldest
 * dropped with an `evicted` event beyond it); a noted entry the engine does not hold within
 * MAX_WAIT_PROBES probes (it kept nothing, or evicted it at once) is dropped silently.
 */
import type { Engine } from '../engine/types.js';
import type { KvEventLog } from '../protocol/kv-events.js';
import { blockHashes, DEFAULT_KV_BLOCK_TOKENS } from '../protocol/token-blocks.js';
import { MIN_KEEP_FRACTION } from '../engine/prefix-cache.js';
import { systemClock } from '../base/clock.js';

type Tier = 'sequence' | 'store';

interface Tracked {
  tokens: number[];
  /** Chained hashes of every whole block of `tokens`. */
  hashes: number[];
  /** The cache salt its sequence is kept under (the engine reuses it for that salt only). */
  salt: string | undefined;
  /** What the last `stored` event said (undefined: not published). */
  announced: { tier: Tier; blocks: number; shared: boolean } | undefined;
  /** Probes an entry not yet held has waited (its slot is released after the stream ends). */
  waited: number;
  /** Tokens the host's prefix store serves (last answer; undefined: not known yet). */
  stored: number | undefined;
  /** A store check is in flight; when the last one was asked (monotonic ms, systemClock). */
  checking: boolean;
  checkedAt: number;
  /** Keys of older entries this one extends: dropped once this one is published. */
  supersedes: string[];
}

/** Probes a noted entry may wait to become held before it is dropped (≈ 2 s). */
const MAX_WAIT_PROBES = 20;

/** Least time between two prefix-store checks of a held entry the sequences dropped, ms (each is a few access(2) calls). */
const STORE_RECHECK_MS = 1000;

/** How often the engine's cached counts are probed, ms. */
export const TRACK_PROBE_MS = 100;

/** Default most entries tracked per worker. */
export const DEFAULT_TRACKED_ENTRIES = 256;

/** See the module doc. Call `close()` to stop the probe. */
export class SequenceKvTracker {
  private readonly entries = new Map<string, Tracked>();
  private sig = '';
  private readonly timer: NodeJS.Timeout;

  /**
   * @param blockTokens tokens per block (`--kv-block-tokens`; the log's replies carry it).
   * @param maxEntries most entries tracked (the oldest evicted beyond).
   */
  constructor(
    private readonly engine: Pick<Engine, 'reusableFor' | 'cachedStats' | 'storedReusableFor'>,
    private readonly log: KvEventLog,
    readonly blockTokens = DEFAULT_KV_BLOCK_TOKENS,
    private readonly maxEntries = DEFAULT_TRACKED_ENTRIES,
  ) {
    this.timer = setInterval(() => this.probe(), TRACK_PROBE_MS);
    this.timer.unref();
  }

  /** Keys of the entries published held now (for tests and /debug). */
  get held(): string[] {
    return [...this.entries].filter(([, e]) => e.announced).map(([k]) => k);
  }

  /**
   * A sequence holding `tokens` (prompt first) was released to the engine's idle ones (a
   * generation ended normally, or prefill computed a prompt), under cache salt `salt`.
   * @returns the entry's key, or undefined when it holds no whole block.
   */
  noteFinished(tokens: number[], salt?: string): string | undefined {
    const hashes = blockHashes(tokens, this.blockTokens, salt);
    if (hashes.length === 0) return undefined;
    const key = `b${hashes[hashes.length - 1]}`;
    const old = this.entries.get(key);
    this.entries.delete(key);
    const supersedes: string[] = [];
    for (const [k, e] of this.entries) {
      const last = e.hashes.length - 1;
      if (e.hashes.length < hashes.length && hashes[last] === e.hashes[last]) supersedes.push(k);
    }
    this.entries.set(key, { tokens, hashes, salt, announced: old?.announced, waited: 0, stored: undefined, checking: false, checkedAt: 0, supersedes });
    while (this.entries.size > this.maxEntries) {
      const [k, e] = this.entries.entries().next().value as [string, Tracked];
      this.drop(k, e);
    }
    this.sig = ''; // check at the next probe (the slot is released after the stream ends)
    return key;
  }

  /** Re-check every entry against the engine when its cached counts changed. */
  probe(): void {
    const s = this.engine.cachedStats();
    const sig = `${s.sequences}/${s.tokens}`;
    let waiting = false;
    for (const e of this.entries.values()) if (!e.announced) waiting = true;
    if (sig === this.sig && !waiting) return;
    this.sig = sig;
    for (const [key, e] of [...this.entries]) {
      if (!this.entries.has(key)) continue; // superseded during this pass
      const inSequence = this.engine.reusableFor(e.tokens, e.salt);
      let reusable = inSequence;
      let tier: Tier = 'sequence';
      // a block the sequences dropped may still be served by the host's prefix store (asked
      // asynchronously; the answer counts from the next probe)
      if (inSequence < e.hashes.length * this.blockTokens && this.engine.storedReusableFor) {
        if (!e.checking && (e.stored === undefined || systemClock.nowMs() - e.checkedAt >= STORE_RECHECK_MS)) {
          e.checking = true;
          e.checkedAt = systemClock.nowMs();
          void this.engine.storedReusableFor(e.tokens, e.salt).then(
            (n) => {
              e.checking = false;
              e.stored = n;
              this.sig = '';
            },
            () => {
              e.checking = false;
              e.stored = 0;
              this.sig = '';
            },
          );
        }
        if (e.stored === undefined && inSequence < this.blockTokens) continue; // decided once the store answered
        if ((e.stored ?? 0) > inSequence) {
          reusable = e.stored!;
          tier = 'store';
        }
      }
      const blocks = Math.min(e.hashes.length, Math.floor(reusable / this.blockTokens));
      if (blocks > 0) {
        // would the engine give it to another session's prompt sharing just over half of it?
        // (prefix-cache.ts chooseSequence: MIN_KEEP_FRACTION, and a paused session's window) —
        // a held state only: what an evicted sequence happens to share is not this entry's
        const shared = tier === 'store' || this.engine.reusableFor(e.tokens.slice(0, Math.ceil(e.tokens.length * MIN_KEEP_FRACTION) + 1), e.salt, true) > 0;
        const a = e.announced;
        if (!a || a.tier !== tier || a.blocks !== blocks || a.shared !== shared) {
          if (a && a.tier !== tier) this.log.publish({ kind: 'evicted', tier: a.tier, key, tokens: a.blocks * this.blockTokens, bytes: 0 });
          this.log.publish({ kind: 'stored', tier, key, tokens: blocks * this.blockTokens, bytes: 0, blocks: e.hashes.slice(0, blocks), seq_tokens: tier === 'store' ? blocks * this.blockTokens : e.tokens.length, shared });
          e.announced = { tier, blocks, shared };
        }
        for (const k of e.supersedes) {
          const old = this.entries.get(k);
          if (old) this.drop(k, old);
        }
        e.supersedes = [];
        continue;
      }
      if (e.announced) this.drop(key, e);
      else if (++e.waited > MAX_WAIT_PROBES) this.entries.delete(key);
    }
  }

  close(): void {
    clearInterval(this.timer);
  }

  private drop(key: string, e: Tracked): void {
    this.entries.delete(key);
    if (e.announced) this.log.publish({ kind: 'evicted', tier: e.announced.tier, key, tokens: e.announced.blocks * this.blockTokens, bytes: 0 });
  }
}
