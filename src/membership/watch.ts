/**
 * The router's side of etcd membership (see ./etcd.ts for the records).
 *
 * List-then-watch: a prefix GET gives every record and the store revision; a prefix watch from
 * revision + 1 then streams each PUT (a worker joined, changed load, or started draining) and
 * DELETE (it left, or its lease expired). Every change is applied to the `WorkerRegistry` at
 * once: a new or re-registered worker is probed immediately (so it is routable within one probe
 * round trip of registering), a draining one is never picked again, a deleted one leaves the pool.
 * After the watch reconnects (etcd restarted, network cut), or as soon as a periodic list succeeds
 * while the watch is still down (etcd3 retries a lost watch on a backoff that grows to seconds
 * over an outage, and a delete must not wait for it), the prefix is listed again, diffed
 * with what the router knows (Dynamo's resync), and the watch is made again from the new
 * revision (an etcd restarted empty counts revisions from 1 again: a watch resumed at the old
 * revision would miss every re-registration). The prefix is also listed every `resyncMs`, so
 * the pool converges to the registered workers within one lease TTL whatever the watch missed.
 * Healing, not trusting: a worker etcd no longer lists (a DELETE, or missing from a list) is
 * probed first and stays in the pool while it answers healthy and not draining — etcd restarted,
 * wiped or stalled past the lease TTL must not empty the pool of workers that are serving; it is
 * removed once the probe fails or says draining (a drained worker's revoke, a dead worker's
 * lease expiry). While etcd cannot be read the pool is left as it is. Workers given by flags
 * are never removed by etcd.
 *
 * The pool is whatever the router hands in as a `MemberPool` (its `WorkerRegistry`): membership
 * does not import the router. Other consumers (`pdserve doctor --discovery`, a dashboard) read the
 * same records with `listMembers()` in ./etcd.ts, without a pool.
 */
import type { Etcd3, Watcher } from 'etcd3';
import type { Logger } from 'pino';
import { etcdClient, listMembers, MEMBER_PREFIX, parseMemberRecord, type MemberRecord } from './etcd.js';
import { PdError } from '../base/errors.js';

/** Deadline for etcd to confirm a new watch (ms); past it the watch counts as down and the next tick tries again. */
const WATCH_CREATE_MS = 5000;

/** What the watch reads of one pooled worker. */
export interface PooledWorker {
  readonly url: string;
  readonly healthy: boolean;
  readonly draining: boolean;
  readonly bootstrapPort: number | null;
}

/**
 * The worker pool the watch keeps in step with etcd (the router's `WorkerRegistry` is one).
 * `upsert` adds or refreshes a worker and probes it when new; `check(w, true)` probes it now;
 * `remove` takes it out of the pool, `reason` for the log.
 */
export interface MemberPool<W extends PooledWorker = PooledWorker> {
  readonly workers: readonly W[];
  upsert(spec: { role: 'prefill' | 'decode'; url: string; bootstrapHost: string | null; bootstrapPort: number | null }): W;
  setDraining(w: W, draining: boolean): void;
  check(w: W, again: boolean): Promise<void>;
  remove(url: string, reason: string): unknown;
}

export interface EtcdDiscoveryOptions<W extends PooledWorker = PooledWorker> {
  /** `etcd://HOST:PORT[,…]`. */
  discovery: string;
  registry: MemberPool<W>;
  log: Logger;
  /** Period of the safety-net re-list (ms); default 2000 (etcd's shortest lease TTL is about 2 s). */
  resyncMs?: number;
}

/** Keeps a WorkerRegistry in step with the etcd records. `start()` resolves after the first list. */
export class EtcdDiscovery<W extends PooledWorker = PooledWorker> {
  private readonly client: Etcd3;
  private watcher: Watcher | null = null;
  /** key → URL and process signature of workers this source added (only these are removed on DELETE). */
  private readonly known = new Map<string, { url: string; sig: string }>();
  private readonly staticUrls: Set<string>;
  private stopped = false;
  private timer: NodeJS.Timeout | null = null;
  /** Keys being verified after etcd stopped listing them (a probe in flight). */
  private readonly verifying = new Set<string>();
  /** Keys of workers kept although etcd does not list them (they answer healthy). */
  private readonly unlisted = new Set<string>();
  /** The last list failed (logged once per outage). */
  private etcdDown = false;
  /** The current watch lost its stream and has not delivered `connected` since. */
  private watchDown = false;
  /** A re-watch in flight (list, then watch from its revision): one at a time. */
  private rewatching: Promise<void> | null = null;

  constructor(private readonly o: EtcdDiscoveryOptions<W>) {
    this.client = etcdClient(o.discovery);
    this.staticUrls = new Set(o.registry.workers.map((w) => w.url));
  }

  /**
   * List, apply, then watch from the listed revision.
   * @throws Error when etcd cannot be reached (the router refuses to start half-configured).
   */
  async start(): Promise<void> {
    let revision: string;
    try {
      revision = await this.resync();
    } catch (err) {
      this.client.close();
      throw new PdError('ETCD_FAILED', `cannot read worker membership from etcd at ${this.o.discovery}: ${(err as Error).message}`);
    }
    try {
      await this.watchFrom(revision);
    } catch (err) {
      this.client.close();
      throw new PdError('ETCD_FAILED', `cannot watch worker membership on etcd at ${this.o.discovery}: ${(err as Error).message}`);
    }
    const every = this.o.resyncMs ?? 2000;
    const tick = () => {
      this.timer = setTimeout(() => {
        void this.resync()
          .then((rev) => {
            if (this.etcdDown) this.o.log.info('etcd answers again: membership re-listed');
            this.etcdDown = false;
            // etcd answers but the watch is still down (etcd3 retries it on a growing backoff):
            // watch again now, so deletes are pushed again within a tick of etcd's return.
            if (this.watchDown) this.rewatch('etcd answers a list but the watch is down', rev);
          })
          .catch((err: unknown) => {
            if (!this.etcdDown) this.o.log.warn({ err: (err as Error).message }, 'etcd cannot be read: keeping the pool as it is');
            this.etcdDown = true;
          })
          .finally(() => !this.stopped && tick());
      }, every);
      this.timer.unref();
    };
    tick();
  }

  /** (Re)make the prefix watch from `revision` + 1. */
  private async watchFrom(revision: string): Promise<void> {
    const old = this.watcher;
    this.watcher = null;
    await old?.cancel().catch(() => {});
    if (this.stopped) return;
    const creating = this.client.watch().prefix(MEMBER_PREFIX).startRevision(String(BigInt(revision) + 1n)).create();
    let timer: NodeJS.Timeout | undefined;
    const w = await Promise.race([
      creating,
      new Promise<never>((_, reject) => {
        timer = setTimeout(() => {
          void creating.then((late) => late.cancel()).catch(() => {}); // connects after the deadline: not ours any more
          reject(new PdError('ETCD_FAILED', `the watch was not created within ${WATCH_CREATE_MS} ms`));
        }, WATCH_CREATE_MS);
      }),
    ]).finally(() => clearTimeout(timer));
    if (this.stopped) {
      await w.cancel().catch(() => {});
      return;
    }
    this.watcher = w;
    this.watchDown = false;
    let disconnected = false;
    w.on('put', (kv) => this.onPut(kv.key.toString(), kv.value.toString()));
    w.on('delete', (kv) => this.onDelete(kv.key.toString(), 'deregistered or lease expired'));
    w.on('disconnected', (err) => {
      if (this.watcher !== w) return;
      if (!disconnected) this.o.log.warn({ err: err?.message }, 'etcd watch disconnected; reconnecting');
      disconnected = true;
      this.watchDown = true;
    });
    w.on('connected', () => {
      if (!disconnected || this.stopped || this.watcher !== w) return;
      disconnected = false;
      this.rewatch('etcd watch reconnected');
    });
    w.on('error', (err) => this.o.log.warn({ err: err?.message }, 'etcd watch error'));
  }

  /**
   * List again (unless `revision` is the revision of a list just applied) and watch from the
   * listed revision: what the lost watch missed is in the list, nothing after it is missed.
   * At most one runs at a time; a failure leaves `watchDown` set for the next tick.
   */
  private rewatch(reason: string, revision?: string): void {
    if (this.rewatching || this.stopped) return;
    this.o.log.info({ reason }, 'etcd: listing members again and watching from the new revision');
    this.rewatching = (revision !== undefined ? Promise.resolve(revision) : this.resync())
      .then((rev) => this.watchFrom(rev))
      .catch((err: unknown) => {
        this.watchDown = true;
        this.o.log.warn({ err: (err as Error).message }, 'etcd re-watch failed; the next tick tries again');
      })
      .finally(() => {
        this.rewatching = null;
      });
  }

  /** List the prefix and make the registry match it (see the module doc). Returns the revision. */
  private async resync(): Promise<string> {
    const { revision, members } = await listMembers(this.client);
    if (this.stopped) return revision;
    for (const [key, rec] of members) this.apply(key, rec);
    for (const key of [...this.known.keys()]) if (!members.has(key)) this.onDelete(key, 'missing from the list');
    return revision;
  }

  private onPut(key: string, value: string): void {
    const rec = parseMemberRecord(value);
    if (!rec) {
      this.o.log.warn({ key }, 'etcd: ignoring a worker record that does not parse');
      return;
    }
    this.apply(key, rec);
  }

  private apply(key: string, rec: MemberRecord): void {
    if (this.stopped || (rec.role !== 'prefill' && rec.role !== 'decode')) return;
    const url = new URL(rec.url).origin;
    const sig = `${rec.host}/${rec.pid}/${rec.started_at}/${rec.epoch ?? ''}`;
    const prev = this.known.get(key);
    const existing = this.o.registry.workers.find((x) => x.url === url);
    // Probe (inside upsert) when the worker is new to the pool, is another process than before
    // (a restart on the same URL), or stopped draining; load refreshes need no probe.
    if (!existing || prev?.sig !== sig || (existing.draining && !rec.draining) || (rec.role === 'prefill' && existing.bootstrapPort !== rec.bootstrap_port)) {
      const w = this.o.registry.upsert({ role: rec.role, url, bootstrapHost: rec.bootstrap_host ?? new URL(url).hostname, bootstrapPort: rec.bootstrap_port });
      if (rec.draining) this.o.registry.setDraining(w, true);
    } else if (rec.draining) {
      this.o.registry.setDraining(existing, true);
    }
    this.known.set(key, { url, sig });
    if (this.unlisted.delete(key)) this.o.log.info({ worker: url }, 'etcd lists the worker again');
  }

  /** etcd no longer lists `key`: probe its worker and remove it unless it answers healthy and not draining. */
  private onDelete(key: string, reason: string): void {
    const known = this.known.get(key);
    if (!known || this.verifying.has(key)) return;
    if (this.staticUrls.has(known.url)) {
      this.known.delete(key);
      return;
    }
    const w = this.o.registry.workers.find((x) => x.url === known.url);
    if (!w) {
      this.known.delete(key);
      return;
    }
    this.verifying.add(key);
    void this.o.registry
      .check(w, true)
      .catch(() => {})
      .then(() => {
        this.verifying.delete(key);
        if (this.stopped || this.known.get(key) !== known) return; // re-registered meanwhile
        if (w.healthy && !w.draining) {
          if (!this.unlisted.has(key)) this.o.log.warn({ worker: known.url, reason }, 'etcd no longer lists the worker, but it answers healthy: kept until it stops answering');
          this.unlisted.add(key);
          return;
        }
        this.known.delete(key);
        this.unlisted.delete(key);
        this.o.registry.remove(known.url, `etcd: ${reason}`);
      });
  }

  /** Stop watching and close the client. Idempotent. */
  async stop(): Promise<void> {
    if (this.stopped) return;
    this.stopped = true;
    if (this.timer) clearTimeout(this.timer);
    await this.watcher?.cancel().catch(() => {});
    this.client.close();
  }
}
