/**
 * The router's side of KV events (../protocol/kv-events.ts): one long poll per worker,
 * `GET /kv_events?epoch=E&after=N&wait_ms=W`, over the worker HTTP channel the health probes use
 * (no new port, no broker; an answer comes as soon as the worker has an event, so a claim is at
 * most one round trip old). Chosen over piggy-backing on the health poll because that one runs
 * every 2 s: a stale claim would live that long.
 *
 * Per worker it keeps what the worker says it holds (`held`: key → tier, tokens, block hashes) and
 * the set of token blocks those entries name (`blocks`: hash → entries holding it, at most
 * `--kv-router-max-blocks` references; ../protocol/token-blocks.ts): a prompt's match on a worker
 * is the longest run of its leading blocks one kept sequence would serve by the engine's rules
 * (`matchedBlocks`).
 *   - events apply in id order; an id that is not last + 1 is a gap: the claims are dropped and
 *     the next poll asks for the snapshot (resync);
 *   - a reply with another epoch is a restarted process: every claim of the old one is dropped
 *     at once, then the snapshot of the new one applies;
 *   - a poll that fails (worker down, restarting, not answering) drops the claims too: only what
 *     a live process says is routed on. A worker without the endpoint (404) is asked again
 *     every NO_EVENTS_RETRY_MS; the approximate prefix tree stays the fallback for it.
 * Metrics: pdserve_router_kv_events_consumed_total{tier,kind}, pdserve_router_kv_event_gaps_total,
 * pdserve_router_kv_resyncs_total{reason}, pdserve_router_kv_held_entries{tier}, pdserve_router_kv_blocks.
 */
import { Counter, Gauge, type Registry } from 'prom-client';
import { request, type Dispatcher } from 'undici';
import { DEFAULT_ROUTER_MAX_BLOCKS, type KvEventsReply, type HeldEntry } from '../protocol/kv-events.js';
import type { WorkerState } from './registry.js';
import { PdError } from '../base/errors.js';
import { commonRun, leadingRun } from '../protocol/token-blocks.js';
import { pause, PollLoops } from './poll-loops.js';

/** Long-poll wait asked of a worker, ms. */
export const KV_WAIT_MS = 10_000;
/** Pause after a failed poll, ms. */
const RETRY_MS = 500;
/** Pause before asking a worker that has no /kv_events again, ms. */
const NO_EVENTS_RETRY_MS = 30_000;
/** Largest reply read, bytes. */
const MAX_REPLY_BYTES = 16 << 20;

/**
 * How long the prompt blocks of a round the router just finished on a worker count as held there
 * while the worker's events say nothing of them yet, ms: the tracker publishes within a probe or
 * two of the sequence's release (../worker/kv-tracker.ts), plus a poll round trip; a next round
 * arriving sooner would otherwise see the worker hold nothing. PDSERVE_TEST_PENDING_CLAIM_MS
 * (ms > 0) replaces it in tests whose next round may come later than that on a loaded machine.
 */
export const PENDING_CLAIM_MS = Number(process.env.PDSERVE_TEST_PENDING_CLAIM_MS) > 0 ? Number(process.env.PDSERVE_TEST_PENDING_CLAIM_MS) : 3000;
/** Most pending claims kept per worker (the oldest dropped beyond). */
const MAX_PENDING_CLAIMS = 64;

/** The key of an entry in `WorkerClaims.held`: `tier:key` (the tiers' keys are different spaces). */
export const heldKey = (tier: string, key: string): string => `${tier}:${key}`;

/** What one worker holds, as far as its events say. */
export interface WorkerClaims {
  epoch: string | null;
  /** Last event id applied; -1 = ask for the snapshot. */
  last: number;
  /** heldKey(tier, key) → entry (its `blocks` dropped when the bound refused them). */
  held: Map<string, HeldEntry>;
  /** The stream is up to date (its last poll succeeded). */
  live: boolean;
  /** Block hash → entries holding it (every tier). */
  blocks: Map<number, number>;
  /** Block references counted in `blocks` (sum over entries); bounded by `maxBlocks`. */
  refs: number;
  /** Most block references kept (`--kv-router-max-blocks`); an entry past it is kept without its blocks. */
  maxBlocks: number;
  /** Entries whose blocks the bound refused (since the last resync). */
  refused: number;
  /** The worker's block size (its replies' `block_tokens`); 0 before the first reply. */
  blockTokens: number;
  /** Prompt blocks of rounds the router finished here, the events silent on them so far: monotonic ms → hashes (`KvEventConsumer.expect`); an `evicted` entry that held a pending prompt's last block drops it. */
  pending: { at: number; blocks: readonly number[]; key?: string | undefined }[];
}

/** Fresh claims of a worker (`maxBlocks` block references at most). */
export function newClaims(maxBlocks = DEFAULT_ROUTER_MAX_BLOCKS): WorkerClaims {
  return { epoch: null, last: -1, held: new Map(), live: false, blocks: new Map(), refs: 0, maxBlocks, refused: 0, blockTokens: 0, pending: [] };
}

function clearClaims(c: WorkerClaims): void {
  c.held.clear();
  c.blocks.clear();
  c.refs = 0;
  c.refused = 0;
  c.pending = [];
}

function addEntry(c: WorkerClaims, e: HeldEntry): void {
  const k = heldKey(e.tier, e.key);
  removeEntry(c, k);
  let entry = e;
  if (e.blocks?.length) {
    if (c.refs + e.blocks.length > c.maxBlocks) {
      c.refused++;
      const { blocks: _dropped, ...rest } = e;
      entry = rest;
    } else {
      for (const h of e.blocks) c.blocks.set(h, (c.blocks.get(h) ?? 0) + 1);
      c.refs += e.blocks.length;
    }
  }
  c.held.set(k, entry);
}

function removeEntry(c: WorkerClaims, k: string): void {
  const old = c.held.get(k);
  if (!old) return;
  c.held.delete(k);
  if (!old.blocks) return;
  for (const h of old.blocks) {
    const n = (c.blocks.get(h) ?? 0) - 1;
    if (n > 0) c.blocks.set(h, n);
    else c.blocks.delete(h);
  }
  c.refs -= old.blocks.length;
}

/**
 * Apply one reply to `c`; returns what happened (for metrics). Pure (unit-tested).
 * 'restart' and 'gap' drop every claim; 'restart' then applies the new snapshot.
 */
export function applyKvReply(c: WorkerClaims, r: KvEventsReply): { outcome: 'ok' | 'resync' | 'restart' | 'gap'; applied: { tier: string; kind: string }[] } {
  const applied: { tier: string; kind: string }[] = [];
  let outcome: 'ok' | 'resync' | 'restart' | 'gap' = 'ok';
  if (c.epoch !== null && r.epoch !== c.epoch) {
    clearClaims(c);
    outcome = 'restart';
  }
  if (Number.isSafeInteger(r.block_tokens) && r.block_tokens! > 0) c.blockTokens = r.block_tokens!;
  if (r.snapshot) {
    const pending = c.pending;
    clearClaims(c);
    if (outcome !== 'restart') c.pending = pending;
    for (const e of r.snapshot) addEntry(c, e);
    c.epoch = r.epoch;
    c.last = r.last;
    c.live = true;
    return { outcome: outcome === 'restart' ? 'restart' : 'resync', applied };
  }
  const gap = () => {
    clearClaims(c);
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
    if (e.kind === 'stored') {
      const { id: _id, kind: _kind, ...entry } = e;
      addEntry(c, entry);
    }
    else {
      const gone = c.held.get(heldKey(e.tier, e.key))?.blocks;
      removeEntry(c, heldKey(e.tier, e.key));
      // a pending round whose whole prompt the dropped entry held went with it
      if (gone?.length && c.pending.length) {
        const had = new Set(gone);
        c.pending = c.pending.filter((p) => !had.has(p.blocks[p.blocks.length - 1]!));
      }
    }
    applied.push({ tier: e.tier, kind: e.kind });
  }
  c.live = true;
  return { outcome, applied };
}

/** A sequence shorter than this share of its tokens is not given to a prompt (the engine's MIN_KEEP_FRACTION). */
const KEEP_FRACTION = 0.5;

/**
 * Leading blocks of `hashes` (the worker's block size) that a kept sequence of claims `c` would
 * serve at `nowMs`, as the engine decides (../engine/prefix-cache.ts `chooseSequence`): per entry,
 * the run of leading blocks it shares with the prompt counts when it is the entry's whole run (the
 * session's own continuation) or, for an entry open to other sessions (`shared`), at least half of
 * the kept sequence (`seq_tokens`); a pending round counts only as a whole run. The longest such
 * run. The worker's block set bounds it first (`blocks`: nothing held, nothing to look at).
 */
export function matchedBlocks(c: WorkerClaims, hashes: readonly number[], nowMs: number, key?: string, promptTokens = Infinity): number {
  let n = 0;
  for (const p of c.pending) if (nowMs - p.at < PENDING_CLAIM_MS && (p.key === undefined || p.key === key) && commonRun(hashes, p.blocks) === p.blocks.length) n = Math.max(n, p.blocks.length);
  const bound = leadingRun(hashes, (h) => c.blocks.has(h));
  if (bound <= n) return n;
  for (const e of c.held.values()) {
    const b = e.blocks;
    if (!b || b.length <= n) continue;
    const run = commonRun(hashes, b);
    if (run <= n) continue;
    const seq = e.seq_tokens ?? b.length * c.blockTokens;
    // its whole run, in a prompt that holds the whole sequence: its session's next round (the
    // engine gives a paused session's state only to a prompt that reuses all of it)
    const continues = run === b.length && (e.shared !== false || promptTokens > seq);
    if (continues || (e.shared !== false && run * c.blockTokens >= KEEP_FRACTION * seq)) n = run;
    if (n >= bound) break;
  }
  return n;
}

/** One long-poll loop per worker (see the module doc). */
export class KvEventConsumer {
  private readonly claims = new Map<string, WorkerClaims>();
  private readonly polls: PollLoops;
  private readonly consumed: Counter<'tier' | 'kind'>;
  private readonly gaps: Counter;
  private readonly resyncs: Counter<'reason'>;

  /**
   * @param wrap composes the router's credentials onto the consumer's pool (worker requests are
   *   signed: ../security/http-auth.ts `withCredentials`).
   * @param tls node:tls client options of its connections (the CA and client certificate of https:// workers).
   * @param maxBlocks block references kept per worker (`--kv-router-max-blocks`).
   */
  constructor(registry: Registry, private readonly waitMs = KV_WAIT_MS, wrap: (base: Dispatcher) => Dispatcher = (b) => b, tls: object = {}, private readonly maxBlocks = DEFAULT_ROUTER_MAX_BLOCKS) {
    this.polls = new PollLoops(KV_WAIT_MS + 5_000, wrap, tls);
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
    new Gauge({
      name: 'pdserve_router_kv_blocks',
      help: 'Distinct token blocks the workers say they hold (live streams only, summed over workers); bounded per worker by --kv-router-max-blocks',
      registers: [registry],
      collect() {
        let n = 0;
        for (const c of claims.values()) if (c.live) n += c.blocks.size;
        this.set(n);
      },
    });
  }

  /** What worker `url` holds (live streams only; undefined: no live event stream, use the fallback). */
  held(url: string): ReadonlyMap<string, HeldEntry> | undefined {
    const c = this.claims.get(url);
    return c?.live ? c.held : undefined;
  }

  /** Claims of worker `url` while its stream is live (undefined: no live stream: nothing is known). */
  live(url: string): Readonly<WorkerClaims> | undefined {
    const c = this.claims.get(url);
    return c?.live && c.blockTokens > 0 ? c : undefined;
  }

  /**
   * Leading tokens of a prompt (of session `key`) worker `url` holds, from its block claims: matched blocks × its
   * block size (whole blocks before the prompt's last token: `promptTokens`); `hashesFor(blockTokens)`
   * gives the prompt's block hashes in the worker's size.
   * undefined: no live event stream (unknown, not "none").
   */
  matchedTokens(url: string, hashesFor: (blockTokens: number) => readonly number[], nowMs: number, promptTokens = Infinity, key?: string): number | undefined {
    const c = this.live(url);
    if (!c) return undefined;
    // a worker evaluates at least the prompt's last token: a whole held prompt serves one block less
    const most = Math.floor((promptTokens - 1) / c.blockTokens);
    return Math.min(matchedBlocks(c, hashesFor(c.blockTokens), nowMs, key, promptTokens), most) * c.blockTokens;
  }

  /**
   * The router just finished a round on worker `url` whose prompt has `hashesFor(size)` blocks
   * (of session `key`, if named): for PENDING_CLAIM_MS they count as held there for that session
   * (the worker's `stored` event is on its way).
   */
  expect(url: string, hashesFor: (blockTokens: number) => readonly number[], nowMs: number, key?: string): void {
    const c = this.claims.get(url);
    if (!c?.live || c.blockTokens <= 0) return;
    const blocks = hashesFor(c.blockTokens);
    if (blocks.length === 0) return;
    c.pending = c.pending.filter((p) => nowMs - p.at < PENDING_CLAIM_MS).slice(-(MAX_PENDING_CLAIMS - 1));
    c.pending.push({ at: nowMs, blocks, ...(key !== undefined ? { key } : {}) });
  }

  /** Follow `w` (idempotent). */
  follow(w: Pick<WorkerState, 'url'>): void {
    const c = newClaims(this.maxBlocks);
    if (this.polls.start(w.url, (signal) => this.loop(w.url, c, signal))) this.claims.set(w.url, c);
  }

  /** Stop following `url` and drop its claims. */
  forget(url: string): void {
    this.polls.stop(url);
    this.claims.delete(url);
  }

  /** Stop every loop. */
  async close(): Promise<void> {
    await this.polls.close();
  }

  private async loop(url: string, c: WorkerClaims, signal: AbortSignal): Promise<void> {
    let firstSnapshot = true;
    while (!signal.aborted) {
      const q = `epoch=${c.epoch ?? ''}&after=${c.last}&wait_ms=${c.last < 0 ? 0 : this.waitMs}`;
      let reply: KvEventsReply;
      try {
        const res = await request(`${url}/kv_events?${q}`, { dispatcher: this.polls.agent, signal: AbortSignal.any([signal, AbortSignal.timeout(this.waitMs + 5_000)]) });
        if (res.statusCode === 404) {
          await res.body.dump();
          c.live = false;
          clearClaims(c);
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
        clearClaims(c);
        c.last = -1;
        await pause(RETRY_MS);
        continue;
      }
      const r = applyKvReply(c, reply);
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
