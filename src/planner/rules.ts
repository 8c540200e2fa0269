/**
 * The planner's decision, sans IO: from one observation of the pool (each worker's role and the
 * gauges it exports) to one action — flip a worker's role, or hold — with its reason.
 *
 * Loads (Dynamo Planner's easy-mode signals, computed over the healthy workers of a role):
 *
 * | role | load | up when | down when |
 * |---|---|---|---|
 * | prefill | Σ `pdserve_prefill_queued_tokens` ÷ (Σ `pdserve_engine_context_tokens`) | ≥ 1.0 | < 0.1 |
 * | decode | Σ (`pdserve_decode_running_reqs` + `pdserve_decode_prealloc_queue_reqs`) ÷ Σ `pdserve_engine_slots` | > 1.0 | < 0.6 |
 *
 * Decode counts the sequences generating and the requests waiting for a slot, not the slots
 * reserved for a KV transfer still on its way: those wait for prefill, and counting them would
 * read a prefill-bound load as decode load.
 *
 * The pool's size is fixed (workers change role, none start or stop), so "up" for one role is a
 * flip from the other, allowed only when the donor role is at or below its down threshold and
 * still below its up threshold after losing the worker (hysteresis: the gap between the two
 * thresholds, and the projected load, keep a flip from undoing itself on the next tick). One
 * change at a time: while a flip is in flight (the router's POST /workers/role, or a worker out
 * of the pool switching) the planner only observes. A floor of one routable worker per role.
 *
 * Borrowed: NVIDIA Dynamo's Planner (its SLA-less "easy mode" thresholds, a 5 s tick, one
 * scaling change at a time, observe-only while a change is in flight).
 */

export type PlannerRole = 'prefill' | 'decode';

/** One worker as the planner sees it at a tick. Gauges are null when its /metrics could not be read. */
export interface WorkerObservation {
  url: string;
  role: PlannerRole;
  /** Healthy and not draining in the router's pool. */
  routable: boolean;
  switchable: boolean;
  /** Out of the pool for a role switch (router). */
  switching: boolean;
  /** Prefill: prompt tokens not evaluated yet. */
  queuedTokens: number | null;
  /** Tokens of one sequence's context. */
  contextTokens: number | null;
  /** Decode: sequences generating and requests waiting for a slot. */
  running: number | null;
  preallocQueue: number | null;
  slots: number | null;
}

export interface Thresholds {
  prefillUp: number;
  prefillDown: number;
  decodeUp: number;
  decodeDown: number;
}

/** Dynamo's easy-mode thresholds. */
export const DEFAULT_THRESHOLDS: Thresholds = { prefillUp: 1.0, prefillDown: 0.1, decodeUp: 1.0, decodeDown: 0.6 };

/** Why the planner did what it did (the `reason` label of pdserve_planner_decisions_total). */
export type DecisionReason =
  | 'prefill_queue_high'
  | 'decode_kv_high'
  | 'steady'
  | 'both_high'
  | 'floor'
  | 'donor_busy'
  | 'no_switchable'
  | 'change_in_flight'
  | 'no_data';

export interface Decision {
  action: 'to_prefill' | 'to_decode' | 'hold';
  reason: DecisionReason;
  /** The worker to flip (flips only). */
  url?: string;
  prefillLoad: number | null;
  decodeLoad: number | null;
  prefillWorkers: number;
  decodeWorkers: number;
}

/** Prefill's load: queued prompt tokens per context of the routable prefill workers; null when none reported. */
export function prefillLoadOf(ws: readonly WorkerObservation[]): number | null {
  let q = 0;
  let ctx = 0;
  for (const w of ws) {
    if (w.role !== 'prefill' || !w.routable || w.queuedTokens === null || !w.contextTokens) continue;
    q += w.queuedTokens;
    ctx += w.contextTokens;
  }
  return ctx > 0 ? q / ctx : null;
}

/** Decode's load: sequences generating plus requests waiting for a slot, per slot of the routable decode workers; null when none reported. */
export function decodeLoadOf(ws: readonly WorkerObservation[], without?: string): number | null {
  let used = 0;
  let slots = 0;
  for (const w of ws) {
    if (w.role !== 'decode' || !w.routable || w.url === without || w.running === null || !w.slots) continue;
    used += w.running + (w.preallocQueue ?? 0);
    slots += w.slots;
  }
  return slots > 0 ? used / slots : null;
}

/** Prefill's load without worker `without` (its queue moves to the others). */
function prefillLoadWithout(ws: readonly WorkerObservation[], without: string): number | null {
  let q = 0;
  let ctx = 0;
  for (const w of ws) {
    if (w.role !== 'prefill' || !w.routable || w.queuedTokens === null || !w.contextTokens) continue;
    q += w.queuedTokens;
    if (w.url !== without) ctx += w.contextTokens;
  }
  return ctx > 0 ? q / ctx : null;
}

/**
 * One tick's decision (see the module doc). `inFlight`: a flip is running (the planner's own, or
 * a worker out of the pool switching). Pure: the same observation gives the same decision.
 */
export function decide(ws: readonly WorkerObservation[], inFlight: boolean, t: Thresholds = DEFAULT_THRESHOLDS): Decision {
  const prefill = ws.filter((w) => w.role === 'prefill' && w.routable);
  const decode = ws.filter((w) => w.role === 'decode' && w.routable);
  const pl = prefillLoadOf(ws);
  const dl = decodeLoadOf(ws);
  const base = { prefillLoad: pl, decodeLoad: dl, prefillWorkers: prefill.length, decodeWorkers: decode.length };
  const hold = (reason: DecisionReason): Decision => ({ action: 'hold', reason, ...base });
  if (inFlight || ws.some((w) => w.switching)) return hold('change_in_flight');
  if (pl === null || dl === null) return hold('no_data');
  const prefillUp = pl >= t.prefillUp;
  const decodeUp = dl > t.decodeUp;
  if (prefillUp && decodeUp) return hold('both_high');
  if (prefillUp) {
    const donors = decode.filter((w) => w.switchable);
    if (decode.length <= 1) return hold('floor');
    if (donors.length === 0) return hold('no_switchable');
    if (dl >= t.decodeDown) return hold('donor_busy');
    // the least busy decode goes; decode must stay under its up threshold without it
    const pick = [...donors].sort((a, b) => (a.running ?? 0) + (a.preallocQueue ?? 0) - ((b.running ?? 0) + (b.preallocQueue ?? 0)) || a.url.localeCompare(b.url))[0]!;
    const after = decodeLoadOf(ws, pick.url);
    if (after === null || after > t.decodeUp) return hold('donor_busy');
    return { action: 'to_prefill', reason: 'prefill_queue_high', url: pick.url, ...base };
  }
  if (decodeUp) {
    const donors = prefill.filter((w) => w.switchable);
    if (prefill.length <= 1) return hold('floor');
    if (donors.length === 0) return hold('no_switchable');
    if (pl >= t.prefillDown) return hold('donor_busy');
    const pick = [...donors].sort((a, b) => (a.queuedTokens ?? 0) - (b.queuedTokens ?? 0) || a.url.localeCompare(b.url))[0]!;
    const after = prefillLoadWithout(ws, pick.url);
    if (after === null || after >= t.prefillUp) return hold('donor_busy');
    return { action: 'to_decode', reason: 'decode_kv_high', url: pick.url, ...base };
  }
  return hold('steady');
}
