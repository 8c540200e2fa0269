/**
 * The dashboard's prefix-store card: what the cache tiers of the whole cluster hold and do, from
 * the workers' /metrics (as the dashboard gathers them, ../observe/gather.ts) and the router's
 * KV-event figures (./kv-events.ts `kvEventSummary`).
 *
 *   store       bytes, files and budget of the host prefix store. Every worker process on a host
 *               reports the same shared store, so per host (the workers' URL hostname) the
 *               largest report counts once; hosts add up.
 *   lookups     prefix-cache lookups by tier (sequence, store) and result (hit, miss), summed.
 *   evictions   prefix-store entries the workers evicted (LRU, over the budget), summed.
 *   events      KV events the workers published (summed) and the router consumed, its gaps,
 *               and the entries it holds now.
 */
import type { Sample } from '../observe/gather.js';

/** One worker's metrics as gathered (null: not reachable). */
export interface WorkerMetricsView {
  url: string;
  metrics: readonly Sample[] | null;
}

/** The card's figures (`/dashboard/data` → `prefix_store`). */
export interface PrefixStoreCard {
  store: { bytes: number; files: number; budget_bytes: number; hosts: number };
  lookups: Record<'sequence' | 'store', { hit: number; miss: number }>;
  evictions: number;
  events: { published: number; consumed: number; gaps: number; held: number };
}

const sum = (m: readonly Sample[], name: string, labels: Record<string, string> = {}): number =>
  m.reduce((n, s) => (s.name === name && Object.entries(labels).every(([k, v]) => s.labels[k] === v) ? n + s.value : n), 0);

const hostOf = (url: string): string => {
  try {
    return new URL(url).hostname;
  } catch {
    return url;
  }
};

/** Build the card from the gathered worker metrics and the router's KV-event summary. Pure; never throws. */
export function prefixStoreCard(workers: readonly WorkerMetricsView[], router: { consumed: number; gaps: number; held: number }): PrefixStoreCard {
  const hosts = new Map<string, { bytes: number; files: number; budget: number }>();
  const lookups: PrefixStoreCard['lookups'] = { sequence: { hit: 0, miss: 0 }, store: { hit: 0, miss: 0 } };
  let evictions = 0;
  let published = 0;
  for (const w of workers) {
    const m = w.metrics;
    if (!m) continue;
    if (m.some((s) => s.name === 'pdserve_prefix_store_bytes')) {
      const h = hosts.get(hostOf(w.url)) ?? { bytes: 0, files: 0, budget: 0 };
      h.bytes = Math.max(h.bytes, sum(m, 'pdserve_prefix_store_bytes'));
      h.files = Math.max(h.files, sum(m, 'pdserve_prefix_store_files'));
      h.budget = Math.max(h.budget, sum(m, 'pdserve_prefix_store_budget_bytes'));
      hosts.set(hostOf(w.url), h);
    }
    for (const tier of ['sequence', 'store'] as const) for (const result of ['hit', 'miss'] as const) lookups[tier][result] += sum(m, 'pdserve_prefix_cache_lookups_total', { tier, result });
    evictions += sum(m, 'pdserve_prefix_store_evictions_total');
    published += sum(m, 'pdserve_kv_events_published_total');
  }
  const store = { bytes: 0, files: 0, budget_bytes: 0, hosts: hosts.size };
  for (const h of hosts.values()) {
    store.bytes += h.bytes;
    store.files += h.files;
    store.budget_bytes += h.budget;
  }
  return { store, lookups, evictions, events: { published, consumed: router.consumed, gaps: router.gaps, held: router.held } };
}
