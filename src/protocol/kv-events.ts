/**
 * KV events of one worker process: what its cache tiers store and evict, for the routers
 * (vLLM / SGLang `BlockStored` / `BlockRemoved`, Dynamo's KV router events).
 *
 *   epoch   random per process: a restarted worker has a new one, so a router drops every claim
 *           of the old process at once (nothing the old process held survives it in memory).
 *   id      1, 2, 3, … per epoch, one per event: a router that sees a jump has missed events.
 *   held    what is held now, per (tier, key): the snapshot a router resyncs from.
 *   blocks  a `stored` event's chained token-block hashes (./token-blocks.ts), the block size in
 *           every reply (`block_tokens`): what a router matches a prompt against.
 *
 * `read(epoch, after)` answers a router: the events after `after` when it has all of them, or
 * the snapshot when it cannot continue (another epoch, an id it never issued, or events already
 * dropped from the ring). `wait` is the long poll. Served as `GET /kv_events` (../worker/http.ts).
 * Bounds: the ring keeps the last `maxEvents` events, a reply carries at most `maxBatch`, the
 * snapshot at most `maxHeld` entries (the oldest dropped beyond: `truncated` counts them).
 */
import { randomBytes } from 'node:crypto';
import { Counter, type Registry } from 'prom-client';
import type { KvCacheEvent } from '../engine/prefix-store.js';
import { DEFAULT_KV_BLOCK_TOKENS } from './token-blocks.js';

export type { KvCacheEvent };

/** One published event. */
export interface KvEvent extends KvCacheEvent {
  id: number;
}

/** An entry of the snapshot. */
export type HeldEntry = Omit<KvCacheEvent, 'kind'>;

/** The answer to a router. `snapshot` present = resync: it replaces everything the router held of this worker. */
export interface KvEventsReply {
  epoch: string;
  /** Id of the last event this reply accounts for (the router's next `after`). */
  last: number;
  events: KvEvent[];
  snapshot?: HeldEntry[];
  /** More events are waiting (the batch bound cut this reply). */
  more?: boolean;
  /** Tokens per block of the events' `blocks` (the worker's `--kv-block-tokens`). */
  block_tokens?: number;
}

export interface KvEventLogOptions {
  /** The process's epoch (default: 16 random hex digits). */
  epoch?: string;
  maxEvents?: number;
  maxBatch?: number;
  maxHeld?: number;
  /** Registry for pdserve_kv_events_published_total{tier,kind}. */
  registry?: Registry;
  /** Tokens per block of the published `blocks` (default DEFAULT_KV_BLOCK_TOKENS). */
  blockTokens?: number;
}

/** Default bound of the block references a router keeps per worker (`--kv-router-max-blocks`). */
export const DEFAULT_ROUTER_MAX_BLOCKS = 1 << 20;

/** Longest long poll a router may ask for, ms. */
export const MAX_KV_WAIT_MS = 30_000;

/** See the module doc. */
export class KvEventLog {
  readonly epoch: string;
  readonly blockTokens: number;
  private lastId = 0;
  private readonly ring: KvEvent[] = [];
  private readonly held = new Map<string, HeldEntry>();
  private readonly waiters = new Set<() => void>();
  private readonly maxEvents: number;
  private readonly maxBatch: number;
  private readonly maxHeld: number;
  private readonly published: Counter<'tier' | 'kind'> | null;
  /** Held entries dropped from the snapshot by its bound. */
  truncated = 0;

  constructor(o: KvEventLogOptions = {}) {
    this.epoch = o.epoch ?? randomBytes(8).toString('hex');
    this.published = o.registry ? new Counter({ name: 'pdserve_kv_events_published_total', help: 'KV events this worker published (what its cache tiers stored and evicted), by tier and kind', labelNames: ['tier', 'kind'], registers: [o.registry] }) : null;
    this.maxEvents = o.maxEvents ?? 4096;
    this.maxBatch = o.maxBatch ?? 1024;
    this.maxHeld = o.maxHeld ?? 65_536;
    this.blockTokens = o.blockTokens ?? DEFAULT_KV_BLOCK_TOKENS;
  }

  /** Id of the last event (0 before the first). */
  get last(): number {
    return this.lastId;
  }

  /** Entries held now. */
  get heldCount(): number {
    return this.held.size;
  }

  /** Publish one event (a stored entry already held, or an evicted one not held, still gets its event). */
  publish(e: KvCacheEvent): KvEvent {
    const extra = { ...(e.blocks ? { blocks: e.blocks } : {}), ...(e.seq_tokens !== undefined ? { seq_tokens: e.seq_tokens } : {}), ...(e.shared !== undefined ? { shared: e.shared } : {}) };
    const ev: KvEvent = { id: ++this.lastId, kind: e.kind, tier: e.tier, key: e.key, tokens: e.tokens, bytes: e.bytes, ...extra };
    this.ring.push(ev);
    if (this.ring.length > this.maxEvents) this.ring.splice(0, this.ring.length - this.maxEvents);
    const k = `${e.tier}:${e.key}`;
    this.held.delete(k);
    if (e.kind === 'stored') {
      this.held.set(k, { tier: e.tier, key: e.key, tokens: e.tokens, bytes: e.bytes, ...extra });
      if (this.held.size > this.maxHeld) {
        this.held.delete(this.held.keys().next().value as string);
        this.truncated++;
      }
    }
    this.published?.inc({ tier: e.tier, kind: e.kind });
    for (const w of [...this.waiters]) w();
    return ev;
  }

  /** The reply to a router that has seen events up to `after` of epoch `epoch` (see the module doc). */
  read(epoch: string | undefined, after: number): KvEventsReply {
    const oldest = this.ring[0]?.id ?? this.lastId + 1;
    if (epoch !== this.epoch || !Number.isSafeInteger(after) || after < 0 || after > this.lastId || after < oldest - 1) {
      return { epoch: this.epoch, last: this.lastId, events: [], snapshot: [...this.held.values()], block_tokens: this.blockTokens };
    }
    const from = after - oldest + 1;
    const events = this.ring.slice(from, from + this.maxBatch);
    const last = events.length > 0 ? events[events.length - 1]!.id : after;
    return last < this.lastId ? { epoch: this.epoch, last, events, more: true, block_tokens: this.blockTokens } : { epoch: this.epoch, last, events, block_tokens: this.blockTokens };
  }

  /** Resolves once an event after `after` exists, `ms` passed, or `signal` aborted (never rejects). */
  wait(after: number, ms: number, signal?: AbortSignal): Promise<void> {
    if (this.lastId > after || ms <= 0 || signal?.aborted) return Promise.resolve();
    return new Promise<void>((resolve) => {
      const done = () => {
        clearTimeout(timer);
        this.waiters.delete(done);
        signal?.removeEventListener('abort', done);
        resolve();
      };
      const timer = setTimeout(done, Math.min(ms, MAX_KV_WAIT_MS));
      this.waiters.add(done);
      signal?.addEventListener('abort', done, { once: true });
    });
  }
}
