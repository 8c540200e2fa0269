/**
 * Prefix-cache and request-path metrics shared by the prefill, decode and colocated workers
 * (prom-client, registered on the worker's own registry).
 *
 * - `pdserve_prefix_cache_query_tokens_total`: prompt tokens looked up in the prefix cache
 *   (every evaluated prompt); `pdserve_prefix_cache_hit_tokens_total`: those served from it. The
 *   hit rate is hit / query, as SGLang's `cache_hit_rate` and vLLM's prefix-cache queries/hits.
 * - `pdserve_prefix_cache_tokens` / `_sequences`: what idle sequences hold right now.
 * - `pdserve_prefix_cache_lookups_total{tier,result}`: per tier (`sequence`: the engine's idle
 *   sequences; `store`: the host's prefix store, prefixes/prefix-store.ts), lookups whose reused
 *   KV that tier supplied (`hit`) or not (`miss`); the store counts only prompts it was asked for.
 * - `pdserve_cache_evictions_total{tier,cause}`: cached states evicted, by tier (`sequence`,
 *   `store`) and cause (`superseded`: a newer state of the same session covers it; `lru`: least
 *   recently used, past its retention window; `ttl_pressure`: inside its window, nothing else
 *   left — engine/prefix-cache.ts `evictionOrder`).
 * - `pdserve_requests_by_path_total{path}`: generations by serving path (`pd`: KV handed off by
 *   prefill; `decode_local`: continued on decode without a handoff; `colocated`).
 */
import client from 'prom-client';

/** Which path served a generation (see the module doc). */
export type ServePath = 'pd' | 'decode_local' | 'colocated';

export class PrefixCacheMetrics {
  readonly queryTokens: client.Counter;
  readonly hitTokens: client.Counter;
  readonly requestsByPath: client.Counter<'path'>;
  readonly lookups: client.Counter<'tier' | 'result'>;

  /**
   * @param cached reads the engine's idle cached sequences at scrape time (Engine.cachedStats).
   * @param evictions reads the evictions since start at scrape time, by tier and cause (Engine.evictionStats, the store's).
   */
  constructor(registry: client.Registry, cached?: () => { sequences: number; tokens: number }, evictions?: () => readonly { tier: string; cause: string; count: number }[]) {
    const registers = [registry];
    if (evictions) {
      const seen = new Map<string, number>();
      new client.Counter({
        name: 'pdserve_cache_evictions_total',
        help: 'Cached states evicted, by tier (sequence, store) and cause (superseded, lru, ttl_pressure)',
        labelNames: ['tier', 'cause'],
        registers,
        collect() {
          for (const e of evictions()) {
            const k = `${e.tier}/${e.cause}`;
            const d = e.count - (seen.get(k) ?? 0);
            if (d > 0) this.inc({ tier: e.tier, cause: e.cause }, d);
            seen.set(k, e.count);
          }
        },
      });
    }
    this.queryTokens = new client.Counter({ name: 'pdserve_prefix_cache_query_tokens_total', help: 'Prompt tokens looked up in the prefix cache', registers });
    this.hitTokens = new client.Counter({ name: 'pdserve_prefix_cache_hit_tokens_total', help: 'Prompt tokens served from the prefix cache (not evaluated again)', registers });
    this.lookups = new client.Counter({ name: 'pdserve_prefix_cache_lookups_total', help: 'Prefix-cache lookups by tier (sequence, store) and result (hit: that tier supplied the reused KV)', labelNames: ['tier', 'result'], registers });
    this.requestsByPath = new client.Counter({ name: 'pdserve_requests_by_path_total', help: 'Generations by serving path (pd, decode_local, colocated)', labelNames: ['path'], registers });
    if (cached) {
      new client.Gauge({
        name: 'pdserve_prefix_cache_tokens',
        help: 'Tokens held for reuse by idle sequences',
        registers,
        collect() {
          this.set(cached().tokens);
        },
      });
      new client.Gauge({
        name: 'pdserve_prefix_cache_sequences',
        help: 'Idle sequences holding a cached prefix',
        registers,
        collect() {
          this.set(cached().sequences);
        },
      });
    }
  }

  /** Count one evaluated prompt of `promptTokens` tokens of which `cachedTokens` came from the cache (`tier`: which tier supplied them). */
  recordLookup(promptTokens: number, cachedTokens: number, tier?: 'sequence' | 'store'): void {
    this.queryTokens.inc(promptTokens);
    if (cachedTokens > 0) this.hitTokens.inc(cachedTokens);
    this.recordTier('sequence', cachedTokens > 0 && tier === 'sequence');
  }

  /** Count one lookup of `tier`: hit or miss. */
  recordTier(tier: 'sequence' | 'store', hit: boolean): void {
    this.lookups.inc({ tier, result: hit ? 'hit' : 'miss' });
  }
}
