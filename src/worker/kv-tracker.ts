/**
 * A worker's sequence-tier KV events: which conversations (by the conversation key,
 * `conversation_key` of /generate, ../protocol/conversation-key.ts) this process really keeps. Decode and
 * colocated note a generation that ended normally with its tokens (prompt + reply); prefill notes
 * a computed prompt (its sequence keeps the prompt once released).
 * The engine keeps
 * such a sequence among its idle ones, and evicts it later (LRU, budget, reuse by another
 * request) without telling anyone; so the tracker asks the engine itself: an entry is held while
 * `engine.reusableFor(tokens)` covers at least half its prompt (a next round would reuse that
 * much; in --deterministic mode reuse is cut to whole chunks, so not all of it) — or, once the
 * sequences dropped it, while the host's prefix store does (`engine.storedReusableFor`, asked
 * asynchronously at most every STORE_RECHECK_MS: decode loads the state from there).
 * It checks after every noted finish and whenever the engine's cached counts change (a 100 ms
 * probe of `cachedStats()`, O(idle sequences)), and publishes `stored` / `evicted` on every
 * change (tier 'sequence', key = the conversation key; a held key noted again for a later round
 * is announced again with its longer token count). While a request of the conversation runs
 * (`noteLeased` … `noteReleased`: its sequence is leased, so no longer among the idle ones) the
 * entry stays held unchecked: the conversation's next round is using it, and an evicted/stored
 * pair per round would be churn for every router. Bounded: at most `maxEntries` tracked
 * (the oldest dropped with an `evicted` event beyond it); a noted entry the engine does not hold
 * within MAX_WAIT_PROBES probes (it kept nothing, or evicted it at once) is dropped silently.
 */
import type { Engine } from '../engine/types.js';
import type { KvEventLog } from '../protocol/kv-events.js';
import { systemClock } from '../base/clock.js';

interface Tracked {
  tokens: number[];
  promptTokens: number;
  /** The cache salt its sequence is kept under (the engine reuses it for that salt only). */
  salt: string | undefined;
  held: boolean;
  /** Tokens of the last `stored` event published for the key (a later round re-announces its longer copy: routers compare copies by tokens). */
  announced: number;
  /** Probes an entry not yet held has waited (its slot is released after the stream ends). */
  waited: number;
  /** The host's prefix store serves at least half its prompt (last answer; undefined: not known yet). */
  stored: boolean | undefined;
  /** A store check is in flight; when the last one was asked (monotonic ms, systemClock). */
  checking: boolean;
  checkedAt: number;
  /** Requests of the conversation running now (noteLeased − noteReleased). */
  leased: number;
}

/** Probes a noted entry may wait to become held before it is dropped (≈ 2 s). */
const MAX_WAIT_PROBES = 20;

/** Least time between two prefix-store checks of a held entry the sequences dropped, ms (each is a few access(2) calls). */
const STORE_RECHECK_MS = 1000;

/** How often the engine's cached counts are probed, ms. */
export const TRACK_PROBE_MS = 100;

/** See the module doc. Call `close()` to stop the probe. */
export class SequenceKvTracker {
  private readonly entries = new Map<string, Tracked>();
  private sig = '';
  private readonly timer: NodeJS.Timeout;

  constructor(
    private readonly engine: Pick<Engine, 'reusableFor' | 'cachedStats' | 'storedReusableFor'>,
    private readonly log: KvEventLog,
    private readonly maxEntries = 256,
  ) {
    this.timer = setInterval(() => this.probe(), TRACK_PROBE_MS);
    this.timer.unref();
  }

  /** Conversations held now (for tests and /debug). */
  get held(): string[] {
    return [...this.entries].filter(([, e]) => e.held).map(([k]) => k);
  }

  /** A generation of conversation `key` ended normally; its sequence holds `tokens` (prompt first). */
  noteFinished(key: string, tokens: number[], promptTokens: number, salt?: string): void {
    const old = this.entries.get(key);
    this.entries.delete(key);
    this.entries.set(key, { tokens, promptTokens, salt, held: old?.held ?? false, announced: old?.announced ?? 0, waited: 0, stored: undefined, checking: false, checkedAt: 0, leased: old?.leased ?? 0 });
    while (this.entries.size > this.maxEntries) {
      const [k, e] = this.entries.entries().next().value as [string, Tracked];
      this.entries.delete(k);
      if (e.held) this.log.publish({ kind: 'evicted', tier: 'sequence', key: k, tokens: e.tokens.length, bytes: 0 });
    }
    this.sig = ''; // check at the next probe (the slot is released after the stream ends)
  }

  /**
   * A request of conversation `key` was admitted (its sequence is leased from now): the entry, if
   * any, counts as held and is not re-checked until the matching `noteReleased`.
   */
  noteLeased(key: string): void {
    const e = this.entries.get(key);
    if (e) e.leased++;
  }

  /** A request `noteLeased` announced ended (finished, failed or aborted, after any noteFinished): check the entry again. */
  noteReleased(key: string): void {
    const e = this.entries.get(key);
    if (e && e.leased > 0) e.leased--;
    this.sig = '';
  }

  /** Re-check every entry against the engine when its cached counts changed. */
  probe(): void {
    const s = this.engine.cachedStats();
    const sig = `${s.sequences}/${s.tokens}`;
    let waiting = false;
    for (const e of this.entries.values()) if (!e.held && e.leased === 0) waiting = true;
    if (sig === this.sig && !waiting) return;
    this.sig = sig;
    for (const [key, e] of this.entries) {
      if (e.leased > 0) continue; // in use by the conversation's next round: held as it was
      const half = Math.max(1, Math.ceil(e.promptTokens / 2));
      const inSequence = this.engine.reusableFor(e.tokens, e.salt) >= half;
      // dropped by the sequences: still served here if the host's prefix store holds it (asked
      // asynchronously; the answer counts from the next probe)
      if (!inSequence && this.engine.storedReusableFor) {
        // not held yet (its write-back may be on its way): every probe; held: every STORE_RECHECK_MS
        if (!e.checking && (!e.held || systemClock.nowMs() - e.checkedAt >= STORE_RECHECK_MS)) {
          e.checking = true;
          e.checkedAt = systemClock.nowMs();
          void this.engine.storedReusableFor(e.tokens, e.salt).then(
            (n) => {
              e.checking = false;
              e.stored = n >= half;
              this.sig = '';
            },
            () => {
              e.checking = false;
              e.stored = false;
              this.sig = '';
            },
          );
        }
        if (e.stored === undefined) continue; // decided once the store answered
      }
      const held = inSequence || e.stored === true;
      if (held && (!e.held || e.announced !== e.tokens.length)) {
        this.log.publish({ kind: 'stored', tier: 'sequence', key, tokens: e.tokens.length, bytes: 0 });
        e.announced = e.tokens.length;
      }
      if (held) {
        e.held = true;
        continue;
      }
      if (e.held) {
        this.log.publish({ kind: 'evicted', tier: 'sequence', key, tokens: e.tokens.length, bytes: 0 });
        this.entries.delete(key);
      } else if (++e.waited > MAX_WAIT_PROBES) this.entries.delete(key);
    }
  }

  close(): void {
    clearInterval(this.timer);
  }
}
