/**
 * What several routers on one etcd share besides the worker records (./etcd.ts), each written
 * by the router it belongs to:
 *
 * | key | value | lifetime |
 * |---|---|---|
 * | `pdserve/v1/routers/<router id>` | presence: URL, process, when it last wrote, its view (workers, the age of its load readings) | a lease of PRESENCE_TTL_S: a hung or dead router stays listed that long, for doctor to name it |
 * | `pdserve/v1/admission/<key hash>/<router id>` | this router's shard of a per-key admission counter: requests in flight, the window id and the requests admitted in that window | the router's lease; deleted once idle |
 * | `pdserve/v1/responses/<response id>` | a stored Response (record of ../api/responses-store.ts) | a lease per minute of creation with TTL = the store's max age + 60 s: it outlives the router that stored it |
 *
 * Admission shards are summed, never merged with max(): a router's count only ever comes from
 * that router, and a shard of another window counts 0 in this one (the epoch per window of
 * SGLang's gateway mesh; a max() merge would resurrect counts a window reset). Every router
 * lists and watches the admission prefix, so the others' shards are known within one watch
 * delivery; two admissions closer than that may both pass (best effort within a window).
 * Stored Responses are read through: a router that misses an id fetches it from etcd once.
 * A Response larger than MAX_SHARED_RESPONSE_BYTES stays local to the router that stored it, and
 * each router deletes its oldest published Responses beyond the store's byte bound, so etcd holds
 * at most routers × that bound.
 */
import { createHash, randomBytes } from 'node:crypto';
import { hostname } from 'node:os';
import type { Etcd3, Lease, Watcher } from 'etcd3';
import type { Logger } from 'pino';
import { etcdClient } from './etcd.js';
import { PdError } from '../base/errors.js';
import { systemClock } from '../base/clock.js';
import type { AdmissionShard, SharedAdmission } from '../api/admission.js';
import type { SharedResponses, StoredResponse } from '../api/responses-store.js';

export const ROUTER_PREFIX = 'pdserve/v1/routers/';
export const ADMISSION_PREFIX = 'pdserve/v1/admission/';
export const RESPONSE_PREFIX = 'pdserve/v1/responses/';
/** Largest stored Response shared through etcd (its JSON), bytes; etcd refuses requests over 1.5 MiB by default. */
export const MAX_SHARED_RESPONSE_BYTES = 512 << 10;
/** How often a router rewrites its presence, ms. */
export const PRESENCE_EVERY_MS = 1000;
/** TTL of the presence lease, s: long enough that doctor still finds a router that stopped writing. */
export const PRESENCE_TTL_S = 30;

/** A router's presence record. Times are wall-clock ms. */
export interface RouterPresence {
  id: string;
  url: string;
  host: string;
  pid: number;
  started_at: number;
  /** When the router last wrote this record. */
  updated_at: number;
  /** Its view: workers in its pool, healthy ones, the age of its oldest load reading (ms; null: none yet or no workers). */
  view: { workers: number; healthy: number; load_age_ms: number | null };
}

/** Parse a presence record (null when it does not parse). */
export function parsePresence(v: string): RouterPresence | null {
  try {
    const j = JSON.parse(v) as RouterPresence;
    return typeof j.url === 'string' && typeof j.updated_at === 'number' && j.view && typeof j.view.workers === 'number' ? j : null;
  } catch {
    return null;
  }
}

/** Every router's presence record (for doctor). */
export async function listRouters(client: Etcd3): Promise<RouterPresence[]> {
  const all = await client.getAll().prefix(ROUTER_PREFIX).strings();
  return Object.values(all).map(parsePresence).filter((p): p is RouterPresence => p !== null);
}

const hashKey = (key: string): string => createHash('sha256').update('pdserve-admission\0').update(key).digest('hex').slice(0, 24);

/** A stored Response as JSON (its `items` Map as entries; `at` is not carried: the reader's clock starts it again). */
function encodeResponse(r: StoredResponse): string {
  return JSON.stringify({ id: r.id, response: r.response, history: r.history, items: [...r.items], input: r.input, bytes: r.bytes, owner: r.owner ?? null });
}

function decodeResponse(v: string, now: number): StoredResponse | undefined {
  try {
    const j = JSON.parse(v) as { id: string; response: Record<string, unknown>; history: StoredResponse['history']; items: [string, Record<string, unknown>][]; input: Record<string, unknown>[]; bytes: number; owner: string | null };
    if (typeof j.id !== 'string' || !Array.isArray(j.items) || !Array.isArray(j.history)) return undefined;
    return { id: j.id, response: j.response, history: j.history, items: new Map(j.items), input: j.input, bytes: j.bytes, at: now, ...(j.owner !== null ? { owner: j.owner } : {}) };
  } catch {
    return undefined;
  }
}

export interface RouterStateOptions {
  /** `etcd://HOST:PORT[,…]`. */
  discovery: string;
  /** The router's own URL (as clients and doctor reach it). */
  url: () => string;
  /** The router's view for its presence record. */
  view: () => RouterPresence['view'];
  log: Logger;
  /** Lease TTL of presence and admission shards, s (default 5). */
  ttlS?: number;
  /** The Response store's bounds: each router's published bytes and the records' age. */
  responses: { maxBytes: number; maxAgeMs: number };
}

/** One router's shared state on etcd (see the module doc). `start()` resolves once presence is written and the shards are listed. */
export class RouterState implements SharedAdmission, SharedResponses {
  readonly id = `${hostname()}-${process.pid}-${randomBytes(4).toString('hex')}`;
  private readonly client: Etcd3;
  private lease: Lease | null = null;
  private presenceLease: Lease | null = null;
  private watcher: Watcher | null = null;
  private responseWatcher: Watcher | null = null;
  private readonly deletedListeners: ((id: string) => void)[] = [];
  private timer: NodeJS.Timeout | null = null;
  private stopped = false;
  private readonly startedAt = Math.round(performance.timeOrigin);
  /** key hash → router id → shard (the other routers' only). */
  private readonly shards = new Map<string, Map<string, AdmissionShard>>();
  /** This router's shards (key hash → shard), to write again after a lost lease and to sweep when idle. */
  private readonly mine = new Map<string, AdmissionShard>();
  /** Shard writes: one in flight per key hash, the latest value wins. */
  private readonly writing = new Map<string, Promise<void>>();
  /** Responses this router published, oldest first: id → bytes. */
  private readonly published = new Map<string, number>();
  private publishedBytes = 0;
  /** Lease per minute of creation for Responses. */
  private readonly responseLeases = new Map<number, Promise<Lease>>();

  constructor(private readonly o: RouterStateOptions) {
    this.client = etcdClient(o.discovery);
  }

  /** @throws PdError ETCD_FAILED when etcd cannot be reached (the router refuses to start half-configured). */
  async start(): Promise<void> {
    try {
      // A router restarted on the same address replaces its predecessor's record at once.
      const all = await this.client.getAll().prefix(ROUTER_PREFIX).strings();
      for (const [k, v] of Object.entries(all)) if (parsePresence(v)?.url === this.o.url() && k !== this.presenceKey()) await this.client.delete().key(k);
      await this.grant();
      await this.relist();
      await this.watch();
    } catch (err) {
      this.client.close();
      throw new PdError('ETCD_FAILED', `cannot share router state on etcd at ${this.o.discovery}: ${(err as Error).message}`);
    }
    const tick = () => {
      this.timer = setTimeout(() => {
        void this.refresh().finally(() => !this.stopped && tick());
      }, PRESENCE_EVERY_MS);
      this.timer.unref();
    };
    tick();
  }

  private presenceKey(): string {
    return `${ROUTER_PREFIX}${this.id}`;
  }

  private presence(): RouterPresence {
    return { id: this.id, url: this.o.url(), host: hostname(), pid: process.pid, started_at: this.startedAt, updated_at: systemClock.wallMs(), view: this.o.view() };
  }

  /** A kept-alive lease of `ttlS`; `onLost` when etcd says it is gone. */
  private async newLease(ttlS: number, onLost: (l: Lease) => void): Promise<Lease> {
    const lease = this.client.lease(ttlS, { autoKeepAlive: true });
    lease.on('lost', (err) => {
      if (this.stopped) return;
      this.o.log.warn({ err: err?.message }, 'etcd: a router lease was lost; granting a new one');
      onLost(lease);
      lease.release();
    });
    await lease.grant();
    return lease;
  }

  /** Grant what is missing (presence lease, shard lease) and write presence and this router's shards under them. */
  private async grant(): Promise<void> {
    if (!this.presenceLease) {
      this.presenceLease = await this.newLease(PRESENCE_TTL_S, (l) => {
        if (l === this.presenceLease) this.presenceLease = null;
      });
    }
    await this.presenceLease.put(this.presenceKey()).value(JSON.stringify(this.presence()));
    if (!this.lease) {
      const lease = await this.newLease(this.o.ttlS ?? 5, (l) => {
        if (l === this.lease) this.lease = null;
      });
      this.lease = lease;
      for (const [k, s] of this.mine) await lease.put(`${ADMISSION_PREFIX}${k}/${this.id}`).value(JSON.stringify(s));
    }
  }

  /** Presence every PRESENCE_EVERY_MS; a lost lease granted again; idle shards deleted; the shards listed again (the watch's safety net). Never rejects. */
  private async refresh(): Promise<void> {
    try {
      await this.grant();
      const w = admissionWindow();
      for (const [k, s] of [...this.mine]) {
        if (s.inflight > 0 || s.window >= w) continue;
        this.mine.delete(k);
        await this.client.delete().key(`${ADMISSION_PREFIX}${k}/${this.id}`);
      }
      await this.relist();
    } catch (err) {
      this.o.log.warn({ err: (err as Error).message }, 'etcd: router state refresh failed; retrying');
    }
  }

  private apply(key: string, value: string | null): void {
    const rest = key.slice(ADMISSION_PREFIX.length);
    const i = rest.indexOf('/');
    if (i < 0) return;
    const [k, router] = [rest.slice(0, i), rest.slice(i + 1)];
    if (router === this.id) return;
    let m = this.shards.get(k);
    if (value === null) {
      m?.delete(router);
      if (m?.size === 0) this.shards.delete(k);
      return;
    }
    try {
      const s = JSON.parse(value) as AdmissionShard;
      if (typeof s.inflight !== 'number' || typeof s.window !== 'number' || typeof s.admitted !== 'number') return;
      if (!m) this.shards.set(k, (m = new Map()));
      m.set(router, s);
    } catch {
      // not a shard
    }
  }

  private async relist(): Promise<void> {
    const all = await this.client.getAll().prefix(ADMISSION_PREFIX).strings();
    this.shards.clear();
    for (const [k, v] of Object.entries(all)) this.apply(k, v);
  }

  private async watch(): Promise<void> {
    const w = await this.client.watch().prefix(ADMISSION_PREFIX).create();
    if (this.stopped) return void (await w.cancel().catch(() => {}));
    this.watcher = w;
    w.on('put', (kv) => this.apply(kv.key.toString(), kv.value.toString()));
    w.on('delete', (kv) => this.apply(kv.key.toString(), null));
    w.on('connected', () => void this.relist().catch(() => {}));
    w.on('error', (err) => this.o.log.warn({ err: err?.message }, 'etcd: admission watch error'));
    // Deletions of stored Responses (puts are delivered too and ignored: etcd3's ignore() swaps
    // its two filters, so none is asked): copies read through go too.
    const rw = await this.client.watch().prefix(RESPONSE_PREFIX).create();
    if (this.stopped) return void (await rw.cancel().catch(() => {}));
    this.responseWatcher = rw;
    rw.on('delete', (kv) => {
      const id = kv.key.toString().slice(RESPONSE_PREFIX.length);
      for (const fn of this.deletedListeners) fn(id);
    });
    rw.on('error', (err) => this.o.log.warn({ err: err?.message }, 'etcd: responses watch error'));
  }

  onResponseDeleted(fn: (id: string) => void): void {
    this.deletedListeners.push(fn);
  }

  // ---- SharedAdmission -------------------------------------------------------------------------

  others(key: string, window: number): { inflight: number; admitted: number } {
    let inflight = 0;
    let admitted = 0;
    for (const s of this.shards.get(hashKey(key))?.values() ?? []) {
      inflight += s.inflight;
      if (s.window === window) admitted += s.admitted;
    }
    return { inflight, admitted };
  }

  publish(key: string, shard: AdmissionShard): void {
    const k = hashKey(key);
    this.mine.set(k, { ...shard });
    if (this.writing.has(k)) return; // the write in flight is followed by the latest value
    const write = async (): Promise<void> => {
      for (let sent: string | undefined; ; ) {
        const s = this.mine.get(k);
        const v = s ? JSON.stringify(s) : undefined;
        if (v === undefined || v === sent || !this.lease || this.stopped) return;
        await this.lease.put(`${ADMISSION_PREFIX}${k}/${this.id}`).value(v);
        sent = v;
      }
    };
    this.writing.set(
      k,
      write()
        .catch((err: unknown) => this.o.log.warn({ err: (err as Error).message }, 'etcd: admission shard write failed'))
        .finally(() => this.writing.delete(k)),
    );
  }

  // ---- SharedResponses -------------------------------------------------------------------------

  private responseLease(now: number): Promise<Lease> {
    const minute = Math.floor(now / 60_000);
    let l = this.responseLeases.get(minute);
    if (!l) {
      const lease = this.client.lease(Math.ceil(this.o.responses.maxAgeMs / 1000) + 60, { autoKeepAlive: false });
      l = lease.grant().then(() => lease);
      l.catch(() => this.responseLeases.delete(minute));
      this.responseLeases.set(minute, l);
      for (const m of this.responseLeases.keys()) if (m < minute) this.responseLeases.delete(m); // their keys keep their own TTL
    }
    return l;
  }

  publishResponse(rec: StoredResponse): Promise<void> {
    const v = encodeResponse(rec);
    const bytes = Buffer.byteLength(v);
    if (bytes > MAX_SHARED_RESPONSE_BYTES || this.stopped) return Promise.resolve();
    return this.responseLease(systemClock.wallMs())
      .then((lease) => lease.put(`${RESPONSE_PREFIX}${rec.id}`).value(v))
      .then(() => {
        this.published.set(rec.id, bytes);
        this.publishedBytes += bytes;
        for (const [id, b] of this.published) {
          if (this.publishedBytes <= this.o.responses.maxBytes) break;
          this.published.delete(id);
          this.publishedBytes -= b;
          void this.client.delete().key(`${RESPONSE_PREFIX}${id}`).catch(() => {});
        }
      })
      .catch((err: unknown) => this.o.log.warn({ err: (err as Error).message, id: rec.id }, 'etcd: a stored Response could not be shared; it stays readable through this router only'));
  }

  unpublishResponse(id: string): void {
    const b = this.published.get(id);
    if (b !== undefined) {
      this.published.delete(id);
      this.publishedBytes -= b;
    }
    void this.client.delete().key(`${RESPONSE_PREFIX}${id}`).catch(() => {});
  }

  async fetchResponse(id: string): Promise<StoredResponse | undefined> {
    if (!/^[A-Za-z0-9_-]{1,128}$/.test(id) || this.stopped) return undefined;
    try {
      const v = await this.client.get(`${RESPONSE_PREFIX}${id}`).string();
      return v === null ? undefined : decodeResponse(v, systemClock.nowMs());
    } catch (err) {
      this.o.log.warn({ err: (err as Error).message, id }, 'etcd: a stored Response could not be read');
      return undefined;
    }
  }

  /** Revoke the lease (presence and shards go at once), stop watching, close the client. Idempotent. */
  async stop(): Promise<void> {
    if (this.stopped) return;
    this.stopped = true;
    if (this.timer) clearTimeout(this.timer);
    await this.watcher?.cancel().catch(() => {});
    await this.responseWatcher?.cancel().catch(() => {});
    await Promise.allSettled([...this.writing.values()]);
    await Promise.allSettled([this.lease?.revoke(), this.presenceLease?.revoke()]);
    this.client.close();
  }
}

/** The admission window of wall-clock time `wallMs` (ADMISSION_WINDOW_MS long; wall time: it crosses processes). */
export function admissionWindow(wallMs = systemClock.wallMs()): number {
  return Math.floor(wallMs / 1000);
}
