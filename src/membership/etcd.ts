/**
 * Membership on etcd: each worker registers itself under a lease; routers watch the prefix
 * (./watch.ts); workers' CLI glue is ./worker-hooks.ts, doctor's reader ./doctor-source.ts.
 *
 * Key:   `pdserve/v1/workers/<role>/<urlencoded worker URL>`
 * Value: a `MemberRecord` as JSON (below): role, URLs, bootstrap address, model fingerprint,
 *        engine settings, load and the draining flag.
 * Lease: one per worker process, TTL `ttlS` seconds (default 5; etcd's floor is about 2),
 *        kept alive by the etcd3 client every TTL/3. A worker that dies stops renewing and its key
 *        is deleted by etcd when the lease expires; the watch sees a DELETE. A worker that loses
 *        its lease while alive (etcd restarted, a partition longer than the TTL) grants a new one
 *        and writes its key again. Leaving (after a drain) revokes the lease: the key goes at once.
 * Load:  the record is re-read from the worker's own GET /health every `refreshMs` (default
 *        1000) and written only when it changed.
 *
 * The pattern (one primary lease per process, list-then-watch from the listed revision, resync
 * after a reconnect) follows NVIDIA Dynamo's etcd transport; see also etcd's own lease docs.
 * Client: the `etcd3` npm package (gRPC, pure JS).
 */
import { hostname } from 'node:os';
import { Etcd3, type Lease } from 'etcd3';
import { z } from 'zod';
import { systemClock, type Clock } from '../base/clock.js';
import { ConfigError, PdError } from '../base/errors.js';

/** Prefix of every worker key. */
export const MEMBER_PREFIX = 'pdserve/v1/workers/';

/** What a worker publishes about itself. Times in ms since the epoch. */
export const MemberRecordSchema = z
  .object({
    role: z.enum(['prefill', 'decode', 'colocated']),
    /** Base URL of the worker's HTTP API, as the router must dial it. */
    url: z.string().url(),
    bootstrap_host: z.string().nullable().default(null),
    bootstrap_port: z.number().int().nullable().default(null),
    model: z.string().nullable().default(null),
    /** sha256 of the GGUF (decode refuses a KV state from another fingerprint). */
    fingerprint: z.string().nullable().default(null),
    /** Engine settings that must agree between prefill and decode (ctx_size, batch_size, …). */
    engine: z.record(z.union([z.string(), z.number(), z.boolean(), z.null()])).default({}),
    /** Load as the worker sees it: slots, slots_free, rooms, queue lengths, inflight. */
    load: z.record(z.number()).default({}),
    draining: z.boolean().default(false),
    epoch: z.string().nullable().default(null),
    host: z.string().default(''),
    pid: z.number().int().default(0),
    started_at: z.number().default(0),
  })
  .passthrough();
export type MemberRecord = z.infer<typeof MemberRecordSchema>;

/** etcd key of a worker. */
export function memberKey(role: string, url: string): string {
  return `${MEMBER_PREFIX}${role}/${encodeURIComponent(url)}`;
}

/** Parse a record (null when the value is not a valid record). */
export function parseMemberRecord(value: string): MemberRecord | null {
  try {
    const r = MemberRecordSchema.safeParse(JSON.parse(value));
    return r.success ? r.data : null;
  } catch {
    return null;
  }
}

/**
 * `etcd://HOST:PORT[,HOST:PORT…]` → the etcd3 client's host list (`http://HOST:PORT`).
 * @throws Error naming the expected form on anything else.
 */
export function parseDiscoveryUrl(uri: string): string[] {
  const m = /^etcd:\/\/(.+)$/.exec(uri.trim());
  if (!m) throw new ConfigError(`--discovery: expected etcd://HOST:PORT[,HOST:PORT…], got ${JSON.stringify(uri)}`);
  const hosts = m[1]!.replace(/\/+$/, '').split(',').map((h) => h.trim());
  for (const h of hosts) if (!/^(\[[0-9a-fA-F:.]+\]|[^:/\s]+):\d{1,5}$/.test(h)) throw new ConfigError(`--discovery: not HOST:PORT: ${JSON.stringify(h)}`);
  return hosts.map((h) => `http://${h}`);
}

/** An etcd client with short deadlines (a dead etcd must not stall a worker or the router). */
export function etcdClient(uri: string): Etcd3 {
  // Deadlines on unary calls only: a deadline on the watch or keepalive stream would end it.
  // gRPC takes a deadline as a wall-clock date and turns it back into a timeout at once.
  return new Etcd3({ hosts: parseDiscoveryUrl(uri), dialTimeout: 2000, defaultCallOptions: (ctx) => (ctx.isStream ? {} : { deadline: systemClock.wallMs() + 3000 }) });
}

/**
 * Every valid record under the prefix, with the store revision they were read at. Read once,
 * without a pool: the router's watch (./watch.ts) and `pdserve doctor --discovery` both use it.
 * @throws whatever the etcd3 client rejects with (the caller wraps it in its own `ETCD_FAILED`).
 */
export async function listMembers(client: Etcd3): Promise<{ revision: string; members: Map<string, MemberRecord> }> {
  const res = await client.getAll().prefix(MEMBER_PREFIX).exec();
  const members = new Map<string, MemberRecord>();
  for (const kv of res.kvs) {
    const rec = parseMemberRecord(kv.value.toString());
    if (rec) members.set(kv.key.toString(), rec);
  }
  return { revision: String(res.header.revision), members };
}


interface Log {
  info(o: object, m: string): void;
  warn(o: object, m: string): void;
}

export interface JoinOptions {
  /** `etcd://HOST:PORT[,…]`. */
  discovery: string;
  /** The current record (read at join, on every refresh and when draining). */
  record: () => Promise<MemberRecord>;
  ttlS?: number;
  refreshMs?: number;
  log: Log;
  /** Monotonic time of the keepalive watchdog (default: the system clock). */
  clock?: Clock;
}

/**
 * A worker's registration. `join()` writes the key under a fresh lease and keeps it current;
 * `setDraining()` publishes `draining: true` at once; `leave()` revokes the lease (the key is
 * deleted) and closes the client. Errors after join are logged and retried, never thrown.
 */
export class Membership {
  private lease: Lease | null = null;
  private last = '';
  private timer: NodeJS.Timeout | null = null;
  private draining = false;
  private left = false;
  private writing: Promise<void> = Promise.resolve();
  private regrant: NodeJS.Timeout | null = null;
  /** When the lease was last confirmed alive (grant or keepalive answer), monotonic ms. */
  private aliveAt = 0;
  private readonly clock: Clock;

  private constructor(
    private client: Etcd3,
    private readonly o: JoinOptions,
    private key: string,
  ) {
    this.clock = o.clock ?? systemClock;
  }

  /**
   * Register (resolves once the key is written).
   * @throws Error when etcd cannot be reached within its deadlines.
   */
  static async join(o: JoinOptions): Promise<Membership> {
    const client = etcdClient(o.discovery);
    const rec = await o.record();
    const m = new Membership(client, o, memberKey(rec.role, rec.url));
    try {
      await m.grantAndWrite(rec);
    } catch (err) {
      client.close();
      throw new PdError('ETCD_FAILED', `cannot register in etcd at ${o.discovery}: ${(err as Error).message}`);
    }
    m.timer = setInterval(() => void m.refresh(), o.refreshMs ?? 1000);
    m.timer.unref();
    o.log.info({ key: m.key, ttl_s: o.ttlS ?? 5 }, 'registered in etcd');
    return m;
  }

  private async grantAndWrite(rec: MemberRecord): Promise<void> {
    const lease = this.client.lease(this.o.ttlS ?? 5, { autoKeepAlive: true });
    lease.on('lost', (err) => this.onLost(lease, err));
    lease.on('keepaliveSucceeded', () => {
      if (lease === this.lease) this.aliveAt = this.clock.nowMs();
    });
    await lease.grant();
    this.lease = lease;
    this.aliveAt = this.clock.nowMs();
    await this.write(rec, true);
  }

  private onLost(lease: Lease, err: Error): void {
    if (this.left || lease !== this.lease) return;
    this.o.log.warn({ key: this.key, err: err?.message }, 'etcd lease lost: registering again');
    this.lease = null;
    lease.release();
    const retry = async () => {
      this.regrant = null;
      if (this.left || this.lease) return;
      // A fresh client: the old channel may sit in gRPC's reconnect backoff after a partition.
      this.client.close();
      this.client = etcdClient(this.o.discovery);
      try {
        await this.grantAndWrite(await this.recordNow());
        this.o.log.info({ key: this.key }, 'registered in etcd again');
      } catch (e) {
        this.o.log.warn({ err: (e as Error).message }, 'etcd registration failed; retrying in 1 s');
        this.regrant = setTimeout(() => void retry(), 1000);
        this.regrant.unref();
      }
    };
    void retry();
  }

  private async recordNow(): Promise<MemberRecord> {
    const r = await this.o.record();
    return this.draining ? { ...r, draining: true } : r;
  }

  /** Write the record when it changed (or always with `force`); serialised. */
  private write(rec: MemberRecord, force = false): Promise<void> {
    const p = this.writing.then(async () => {
      const lease = this.lease;
      if (!lease || this.left) return;
      const json = JSON.stringify(rec);
      if (!force && json === this.last) return;
      await lease.put(this.key).value(json);
      this.last = json;
    });
    this.writing = p.catch(() => {});
    return p;
  }

  private async refresh(): Promise<void> {
    if (this.left || !this.lease) return;
    // No keepalive answer for 2 TTLs: the lease is gone server-side whatever the client thinks
    // (a keepalive stream can hang silently through a partition).
    const ttlMs = 1000 * (this.o.ttlS ?? 5);
    const silentMs = this.clock.nowMs() - this.aliveAt;
    if (silentMs > 2 * ttlMs) return this.onLost(this.lease, new PdError('ETCD_FAILED', `no keepalive answer for ${Math.round(silentMs)} ms`));
    try {
      await this.write(await this.recordNow());
    } catch (err) {
      this.o.log.warn({ err: (err as Error).message }, 'etcd record refresh failed');
    }
  }

  /** Publish `draining: true` now. Never rejects. */
  async setDraining(): Promise<void> {
    this.draining = true;
    await this.refresh();
  }

  /** Revoke the lease (the key is deleted at once) and close the client. Idempotent; never rejects. */
  async leave(): Promise<void> {
    if (this.left) return;
    this.left = true;
    if (this.timer) clearInterval(this.timer);
    if (this.regrant) clearTimeout(this.regrant);
    await this.writing;
    try {
      await this.lease?.revoke();
      this.o.log.info({ key: this.key }, 'left etcd (lease revoked)');
    } catch (err) {
      this.o.log.warn({ err: (err as Error).message }, 'etcd lease revoke failed; the key expires with its TTL');
    }
    this.client.close();
  }
}

/**
 * Fields every record carries about the process itself. `started_at` (wall ms) is the date the
 * process started, read once by the runtime: a wall-clock step does not change it, so the router
 * never takes the same process for a restarted one.
 */
export function processFields(): { host: string; pid: number; started_at: number } {
  return { host: hostname(), pid: process.pid, started_at: Math.round(performance.timeOrigin) };
}
