/**
 * The stored responses of /v1/responses (`store: true`, OpenAI's default): what GET / DELETE
 * /v1/responses/{id}, `previous_response_id` and `item_reference` input items read. In memory,
 * per server process, bounded three ways — entries, bytes, age — with the oldest dropped first
 * (insertion order = creation order, so the oldest is the first entry of the Map).
 *
 * A record keeps the conversation up to and including its own output as chat messages (the
 * wire shape the chat path takes), so a continuation is `instructions + history + new input`:
 * the prompt the previous response was generated from, followed by its reply, byte for byte.
 * The history and input-item arrays of a chain share their objects; `bytes` counts the whole history and input items
 * of each record (an upper bound of what it holds alive, so the byte bound always holds).
 */
import { systemClock } from '../base/clock.js';

/**
 * A store shared by several routers (etcd: ../membership/router-state.ts): every record stored
 * here is published, a deletion unpublished, and an id this store does not hold is fetched
 * (read-through) before it counts as unknown.
 */
export interface SharedResponses {
  /** Publish a stored record; settles once it is shared (or could not be: too large, the shared store unreachable). Never rejects. */
  publishResponse(rec: StoredResponse): Promise<void>;
  /** The record was deleted. */
  unpublishResponse(id: string): void;
  /** The record another router stored, or undefined (unknown, expired, or the shared store unreachable). Never rejects. */
  fetchResponse(id: string): Promise<StoredResponse | undefined>;
  /** Call `fn` with the id of every shared record deleted (through another router, or expired), so copies read through go too. */
  onResponseDeleted(fn: (id: string) => void): void;
}

/** A chat message as the chat path takes it (OpenAI wire shape). */
export interface WireChatMessage {
  role: 'system' | 'user' | 'assistant' | 'tool';
  content: string | null;
  tool_calls?: { id: string; type: 'function'; function: { name: string; arguments: string } }[];
  tool_call_id?: string;
}

/** One stored response. */
export interface StoredResponse {
  id: string;
  /** The public Response object (what GET returns). */
  response: Record<string, unknown>;
  /** The conversation without `instructions`: earlier history, this input, this output. */
  history: WireChatMessage[];
  /** Output items by id (for `item_reference`), with the chat message each one became. */
  items: Map<string, Record<string, unknown>>;
  /** The items of its context in order (GET /v1/responses/{id}/input_items; shared with the chain's later records). */
  input: Record<string, unknown>[];
  /** Bytes accounted to this record (JSON of response + history). */
  bytes: number;
  /** Monotonic ms when stored. */
  at: number;
  /** The tenant that created it (../api/access.ts `tenantOf`: its API key's); undefined on an open server. Another tenant never sees it. */
  owner?: string;
}

/** The store as one tenant sees it (`ResponseStore.of`): only its own records exist. */
export interface ResponseStoreView {
  /** Make `id` present when another router stored it (read-through; a no-op without a shared store). Never rejects. */
  load(id: string): Promise<void>;
  /** Settles once record `id` put here is shared with the other routers, or after SHARE_WAIT_MS (at once without a shared store). Never rejects. */
  shared(id: string): Promise<void>;
  get(id: string): StoredResponse | undefined;
  item(itemId: string): Record<string, unknown> | undefined;
  delete(id: string): boolean;
  put(rec: Omit<StoredResponse, 'at' | 'owner'>): boolean;
}

export interface ResponseStoreLimits {
  /** Most stored responses. */
  maxCount: number;
  /** Most bytes over all records (see the module doc). */
  maxBytes: number;
  /** A record older than this (ms) is gone. */
  maxAgeMs: number;
}

/** Longest a stored Response's answer waits for the record to be shared with the other routers, ms. */
export const SHARE_WAIT_MS = 1000;

/** Defaults: 10 000 responses, 64 MiB, 1 hour. */
export const DEFAULT_RESPONSE_STORE_LIMITS: ResponseStoreLimits = { maxCount: 10_000, maxBytes: 64 << 20, maxAgeMs: 3_600_000 };

/** Bounded store of responses (see the module doc). `now` is a monotonic ms clock. */
export class ResponseStore {
  private readonly records = new Map<string, StoredResponse>();
  /** item id → the response that holds it. */
  private readonly itemOwner = new Map<string, string>();
  private total = 0;
  /** Records dropped by a bound (count, bytes or age), for metrics. */
  evicted = 0;

  constructor(
    readonly limits: ResponseStoreLimits = DEFAULT_RESPONSE_STORE_LIMITS,
    private readonly now: () => number = () => systemClock.nowMs(),
    /** Several routers: the store they share (see `SharedResponses`). */
    private readonly shared?: SharedResponses,
  ) {
    shared?.onResponseDeleted((id) => this.delete(id));
  }

  /** Publications in flight: id → settles when shared. */
  private readonly sharing = new Map<string, Promise<void>>();

  /** See `ResponseStoreView.shared`. */
  async whenShared(id: string): Promise<void> {
    const p = this.sharing.get(id);
    if (!p) return;
    let timer: NodeJS.Timeout | undefined;
    await Promise.race([p, new Promise<void>((r) => (timer = setTimeout(r, SHARE_WAIT_MS)))]);
    clearTimeout(timer);
  }

  /** Read-through (see `SharedResponses`): fetch `id` into this store when it is not here. Never rejects. */
  async load(id: string): Promise<void> {
    if (!this.shared || this.records.has(id)) return;
    const r = await this.shared.fetchResponse(id);
    if (r && !this.records.has(id)) this.putLocal(r);
  }

  /** Stored responses now. */
  get size(): number {
    this.expire();
    return this.records.size;
  }

  /** Bytes accounted now. */
  get bytes(): number {
    this.expire();
    return this.total;
  }

  /**
   * Store a record (replacing one of the same id), then drop the oldest until every bound holds.
   * A record larger than `maxBytes` by itself is not stored. Returns whether it was stored.
   */
  put(rec: Omit<StoredResponse, 'at'>): boolean {
    const stored = this.putLocal(rec);
    const r = this.records.get(rec.id);
    if (stored && r && this.shared) {
      const p = this.shared.publishResponse(r).finally(() => {
        if (this.sharing.get(r.id) === p) this.sharing.delete(r.id);
      });
      this.sharing.set(r.id, p);
    }
    return stored;
  }

  private putLocal(rec: Omit<StoredResponse, 'at'>): boolean {
    this.delete(rec.id);
    if (rec.bytes > this.limits.maxBytes) return false;
    const r: StoredResponse = { ...rec, at: this.now() };
    this.records.set(r.id, r);
    for (const id of r.items.keys()) this.itemOwner.set(id, r.id);
    this.total += r.bytes;
    this.expire();
    while (this.records.size > this.limits.maxCount || this.total > this.limits.maxBytes) {
      const oldest = this.records.keys().next().value as string;
      this.delete(oldest);
      this.evicted++;
    }
    return this.records.has(r.id);
  }

  /** The record of `id` created by `owner` (undefined: an open server's), or undefined when unknown, another tenant's, deleted or expired. */
  get(id: string, owner?: string): StoredResponse | undefined {
    this.expire();
    const r = this.records.get(id);
    return r && r.owner === owner ? r : undefined;
  }

  /** The stored item `itemId` (an output item of a stored response of `owner`), or undefined. */
  item(itemId: string, owner?: string): Record<string, unknown> | undefined {
    const rid = this.itemOwner.get(itemId);
    return rid === undefined ? undefined : this.get(rid, owner)?.items.get(itemId);
  }

  /** The store as tenant `owner` sees it: its own records only (another tenant's id is unknown: 404). */
  of(owner: string | undefined): ResponseStoreView {
    return {
      get: (id) => this.get(id, owner),
      item: (id) => this.item(id, owner),
      load: (id) => this.load(id),
      shared: (id) => this.whenShared(id),
      delete: (id) => {
        if (!this.get(id, owner)) return false;
        this.delete(id);
        this.shared?.unpublishResponse(id);
        return true;
      },
      put: (rec) => this.put(owner === undefined ? rec : { ...rec, owner }),
    };
  }

  /** Remove `id` whoever owns it (a tenant deletes through `of`); returns whether it was there. */
  delete(id: string): boolean {
    const r = this.records.get(id);
    if (!r) return false;
    this.records.delete(id);
    for (const item of r.items.keys()) if (this.itemOwner.get(item) === id) this.itemOwner.delete(item);
    this.total -= r.bytes;
    return true;
  }

  /** Drop the records older than maxAgeMs (the oldest come first). */
  private expire(): void {
    const cutoff = this.now() - this.limits.maxAgeMs;
    for (const r of this.records.values()) {
      if (r.at > cutoff) break;
      this.delete(r.id);
      this.evicted++;
    }
  }
}
