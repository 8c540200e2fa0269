/**
 * The router's side of KV events (../protocol/kv-events.ts): one long poll per worker,
 * `GET /kv_events?epoch=E&after=N&wait_ms=W`, over the worker HTTP channel the health probes use
 * (no new port, no broker; an answer comes as soon as the worker has an event, so a claim is at
 * most one round trip old). Chosen over piggy-backing on the health poll because that one runs
 * every 2 s: a stale claim would live that long.
 *
 * Per worker it keeps what the worker says it holds (`held`: key → tier, tokens):
 *   - events apply in id order; an id that is not last + 1 is a gap: the claims are dropped and
 *     the next poll asks for the snapshot (resync);
 *   - a reply with another epoch is a restarted process: every claim of the old one is dropped
 *     at once, then the snapshot of the new one applies;
 *   - a poll that fails (worker down, restarting, not answering) drops the claims too: only what
 *     a live process says is routed on. A worker without the endpoint (404) is asked again
 *     every NO_EVENTS_RETRY_MS; the approximate prefix tree stays the fallback for it.
 * Metrics: pdserve_router_kv_events_consumed_total{tier,kind}, pdserve_router_kv_event_gaps_total,
 * pdserve_router_kv_resyncs_total{reason}, pdserve_router_kv_held_entries{tier}.
 */
import { Counter, Gauge, type Registry } from 'prom-client';
import { Agent, request, type Dispatcher } from 'undici';
import type { KvEventsReply, HeldEntry } from '../protocol/kv-events.js';
import type { WorkerState } from './registry.js';
import { PdError } from '../base/errors.js';

/** Long-poll wait asked of a worker, ms. */
export const KV_WAIT_MS = 10_000;
/** Pause after a failed poll, ms. */
const RETRY_MS = 500;
/** Pause before asking a worker that has no /kv_events again, ms. */
const NO_EVENTS_RETRY_MS = 30_000;
/** Largest reply read, bytes. */
const MAX_REPLY_BYTES = 16 << 20;

/**
 * How long a conversation the router just finished on a worker counts as "not known yet" rather
 * than "not held" while the worker's events say nothing of it, ms: decode's tracker decides
 * within its 2 s wait for a released sequence (../worker/kv-tracker.ts), plus a poll round trip.
 * PDSERVE_TEST_PENDING_CLAIM_MS (ms > 0) replaces it in tests whose next round may come later
 * than that on a loaded machine.
 */
export const PENDING_CLAIM_MS = Number(process.env.PDSERVE_TEST_PENDING_CLAIM_MS) > 0 ? Number(process.env.PDSERVE_TEST_PENDING_CLAIM_MS) : 3000;
/** Most pending claims kept per worker (the oldest dropped beyond). */
const MAX_PENDING_CLAIMS = 4096;

/** The key of an entry in `WorkerClaims.held`: `tier:key` (the tiers' keys are different spaces). */
export const heldKey = (tier: string, key: string): string => `${tier}:${key}`;

/** What one worker holds, as far as its events say. */
export interface WorkerClaims {
  epoch: string | null;
  /** Last event id applied; -1 = ask for the snapshot. */
  last: number;
  /** heldKey(tier, key) → entry. */
  held: Map<string, HeldEntry>;
  /** The stream is up to date (its last poll succeeded). */
  live: boolean;
  /** Sequence-tier keys the router finished a round of here, the events silent on them since: key → monotonic ms (`KvEventConsumer.expect`). */
  pending: Map<string, number>;
}

/**
 * Apply one reply to `c`; returns what happened (for metrics). Pure (unit-tested).
 * 'restart' and 'gap' drop every claim; 'restart' then applies the new snapshot.
 */
export function applyKvReply(c: WorkerClaims, r: KvEventsReply): { outcome: 'ok' | 'resync' | 'restart' | 'gap'; applied: { tier: string; kind: string }[] } {
  const applied: { tier: string; kind: string }[] = [];
  let outcome: 'ok' | 'resync' | 'restart' | 'gap' = 'ok';
  if (c.epoch !== null && r.epoch !== c.epoch) {
    c.held.clear();
    outcome = 'restart';
  }
  if (r.snapshot) {
    c.held.clear();
    for (const e of r.snapshot) c.held.set(heldKey(e.tier, e.key), e);
    c.epoch = r.epoch;
    c.last = r.last;
    c.live = true;
    return { outcome: outcome === 'restart' ? 'restart' : 'resync', applied };
  }
  const gap = () => {
    c.held.clear();
    c.epoch = r.epoch;
    c.last = -1;
    c.live = false;
    return { outcome: 'gap' as const, applied };
  };
  // events for an epoch this router has no base for, or not following its last id
  if (outcome === 'restart' || c.last < 0) return gap();
  for (const e of r.events) {
    if (e.id !== c.last + 1) return gap();
    c.last = e.id;
    if (e.kind === 'stored') c.held.set(heldKey(e.tier, e.key), { tier: e.tier, key: e.key, tokens: e.tokens, bytes: e.bytes });
    else c.held.delete(heldKey(e.tier, e.key));
    applied.push({ tier: e.tier, kind: e.kind });
  }
  c.live = true;
  return { outcome, applied };
}

/** One long-poll loop per worker (see the module doc). */
export class KvEventConsumer {
  private readonly claims = new Map<string, WorkerClaims>();
  private readonly loops = new Map<string, AbortController>();
  private readonly base: Agent;
  private readonly agent: Dispatcher;
  private readonly consumed: Counter<'tier' | 'kind'>;
  private readonly gaps: Counter;
  private readonly resyncs: Counter<'reason'>;
  private stopped = false;

  /**
   * @param wrap composes the router's credentials onto the consumer's pool (worker requests are
   *   signed: ../security/http-auth.ts `withCredentials`).
   * @param tls node:tls client options of its connections (the CA and client certificate of https:// workers).
   */
  constructor(registry: Registry, private readonly waitMs = KV_WAIT_MS, wrap: (base: Dispatcher) => Dispatcher = (b) => b, tls: object = {}) {
    this.base = new Agent({ connections: 2, pipelining: 1, keepAliveTimeout: 30_000, connect: { timeout: 2_000, ...tls }, headersTimeout: KV_WAIT_MS + 5_000, bodyTimeout: KV_WAIT_MS + 5_000 });
    this.agent = wrap(this.base);
    this.consumed = new Counter({ name: 'pdserve_router_kv_events_consumed_total', help: 'KV events applied from the workers, by tier and kind', labelNames: ['tier', 'kind'], registers: [registry] });
    this.gaps = new Counter({ name: 'pdserve_router_kv_event_gaps_total', help: 'KV event streams found with a missing event id (claims dropped, then resynced)', registers: [registry] });
    this.resyncs = new Counter({ name: 'pdserve_router_kv_resyncs_total', help: 'Snapshots applied, by reason (first: a new stream; restart: a new worker epoch; resync: after a gap or a lost stream)', labelNames: ['reason'], registers: [registry] });
    const claims = this.claims;
    new Gauge({
      name: 'pdserve_router_kv_held_entries',
      help: 'Cache entries the workers say they hold (live streams only), by tier',
      labelNames: ['tier'],
      registers: [registry],
      collect() {
        const n = new Map<string, number>([['sequence', 0], ['store', 0]]);
        for (const c of claims.values()) if (c.live) for (const e of c.held.values()) n.set(e.tier, (n.get(e.tier) ?? 0) + 1);
        for (const [tier, v] of n) this.set({ tier }, v);
      },
    });
  }

  /** What worker `url` holds (live streams only; undefined: no live event stream, use the fallback). */
  held(url: string): ReadonlyMap<string, HeldEntry> | undefined {
    const c = this.claims.get(url);
    return c?.live ? c.held : undefined;
  }

  /**
   * The router just finished a round of conversation `key` (a sequence-tier key) on worker
   * `url` at `nowMs` (monotonic): until the worker's events say something of `key`, or
   * PENDING_CLAIM_MS pass, `holds` answers "unknown" instead of "not held" — the worker's
   * `stored` event is on its way, and the conversation's next round may arrive before it.
   */
  expect(url: string, key: string, nowMs: number): void {
    const c = this.claims.get(url);
    if (!c) return;
    c.pending.delete(key);
    c.pending.set(key, nowMs);
    for (const [k, at] of c.pending) {
      if (c.pending.size <= MAX_PENDING_CLAIMS && nowMs - at < PENDING_CLAIM_MS) break;
      c.pending.delete(k);
    }
  }

  /**
   * Does worker `url` hold conversation `key` in its sequence tier? true / false from its events;
   * undefined when unknown: no live event stream (use the fallback), or a round of `key` the
   * router finished there is newer than anything the events said of it (see `expect`).
   */
  holds(url: string, key: string, nowMs: number): boolean | undefined {
    const c = this.claims.get(url);
    if (!c?.live) return undefined;
    if (c.held.has(heldKey('sequence', key))) return true;
    const at = c.pending.get(key);
    if (at !== undefined && nowMs - at < PENDING_CLAIM_MS) return undefined;
    return false;
  }

  /**
   * `holds` for each of `urls` (workers of one role), answering for the conversation's latest
   * round: a worker whose copy is older than another's says false. The router just finished a
   * round of `key` on one of them (`expect`, within PENDING_CLAIM_MS): that one is the freshest
   * and every other copy is older; otherwise the copies the events carry compare by tokens (an
   * entry holds prompt + reply of the round it was noted for: a later round holds more), ties
   * all true. Without this, a worker keeping round r − 2 of a conversation whose round r − 1 ran
   * elsewhere claims it as fully as the one that ran it, and a decode-local attempt there comes
   * back `needs_prefill` (two rounds of suffix).
   */
  holdsAmong(urls: readonly string[], key: string, nowMs: number): Map<string, boolean | undefined> {
    const out = new Map<string, boolean | undefined>();
    let pendingAt: string | undefined;
    let most = 0;
    for (const url of urls) {
      out.set(url, this.holds(url, key, nowMs));
      const c = this.claims.get(url);
      const at = c?.live ? c.pending.get(key) : undefined;
      if (at !== undefined && nowMs - at < PENDING_CLAIM_MS) pendingAt = url;
      if (out.get(url) === true) most = Math.max(most, c!.held.get(heldKey('sequence', key))?.tokens ?? 0);
    }
    for (const url of urls) {
      if (out.get(url) !== true) continue;
      const older = pendingAt !== undefined ? url !== pendingAt : (this.claims.get(url)!.held.get(heldKey('sequence', key))?.tokens ?? 0) < most;
      if (older) out.set(url, false);
    }
    return out;
  }

  /** Follow `w` (idempotent). */
  follow(w: Pick<WorkerState, 'url'>): void {
    if (this.stopped || this.loops.has(w.url)) return;
    const ac = new AbortController();
    this.loops.set(w.url, ac);
    const c: WorkerClaims = { epoch: null, last: -1, held: new Map(), live: false, pending: new Map() };
    this.claims.set(w.url, c);
    void this.loop(w.url, c, ac.signal);
  }

  /** Stop following `url` and drop its claims. */
  forget(url: string): void {
    this.loops.get(url)?.abort();
    this.loops.delete(url);
    this.claims.delete(url);
  }

  /** Stop every loop. */
  async close(): Promise<void> {
    this.stopped = true;
    for (const ac of this.loops.values()) ac.abort();
    this.loops.clear();
    await this.base.destroy().catch(() => {});
  }

  private async loop(url: string, c: WorkerClaims, signal: AbortSignal): Promise<void> {
    const pause = (ms: number) => new Promise<void>((r) => setTimeout(r, ms).unref());
    let firstSnapshot = true;
    while (!signal.aborted) {
      const q = `epoch=${c.epoch ?? ''}&after=${c.last}&wait_ms=${c.last < 0 ? 0 : this.waitMs}`;
      let reply: KvEventsReply;
      try {
        const res = await request(`${url}/kv_events?${q}`, { dispatcher: this.agent, signal: AbortSignal.any([signal, AbortSignal.timeout(this.waitMs + 5_000)]) });
        if (res.statusCode === 404) {
          await res.body.dump();
          c.live = false;
          c.held.clear();
          c.last = -1;
          await pause(NO_EVENTS_RETRY_MS);
          continue;
        }
        if (res.statusCode !== 200) throw new PdError('bad_worker_answer', `HTTP ${res.statusCode}`);
        const len = Number(res.headers['content-length'] ?? 0);
        if (len > MAX_REPLY_BYTES) throw new PdError('bad_worker_answer', 'reply too large');
        reply = (await res.body.json()) as KvEventsReply;
        if (!reply || typeof reply.epoch !== 'string' || !Array.isArray(reply.events) || !Number.isSafeInteger(reply.last)) throw new PdError('bad_worker_answer', 'malformed reply');
      } catch {
        if (signal.aborted) return;
        // a worker that does not answer holds nothing as far as routing goes; resync when it answers
        c.live = false;
        c.held.clear();
        c.last = -1;
        await pause(RETRY_MS);
        continue;
      }
      const r = applyKvReply(c, reply);
      // the worker spoke of these conversations (or restarted): their claims are its word now
      if (r.outcome === 'restart') c.pending.clear();
      for (const e of reply.events) if (e.tier === 'sequence') c.pending.delete(e.key);
      for (const a of r.applied) this.consumed.inc(a);
      if (r.outcome === 'gap') this.gaps.inc();
      if (r.outcome === 'restart' || r.outcome === 'resync') this.resyncs.inc({ reason: r.outcome === 'restart' ? 'restart' : firstSnapshot ? 'first' : 'resync' });
      if (reply.snapshot) firstSnapshot = false;
    }
  }
}

/** The KV-event figures of the dashboard, read from the router's registry: consumed and gaps (totals), held entries (now). */
export async function kvEventSummary(registry: Registry): Promise<{ consumed: number; gaps: number; held: number }> {
  const sum = async (name: string) => ((await registry.getSingleMetric(name)?.get())?.values ?? []).reduce((n, v) => n + v.value, 0);
  return { consumed: await sum('pdserve_router_kv_events_consumed_total'), gaps: await sum('pdserve_router_kv_event_gaps_total'), held: await sum('pdserve_router_kv_held_entries') };
}
