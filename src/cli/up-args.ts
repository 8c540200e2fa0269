/**
 * The engine flags of `pdserve up` that its prefill and decode children must receive as flags.
 * `up` takes every engine option the workers take (`engineOptions` in ./main.ts); the model,
 * threads, context and batch size and `--deterministic` travel as `ClusterOptions`, the GPU flags
 * and served names through `upExtraArgs`, `--prefix-store-dir` as `ClusterOptions.prefixStoreDir`;
 * these are the rest, so that no flag `up` accepts is silently dropped.
 */

/** The parsed engine options `upEngineArgs` forwards (commander's camel-case names). */
export interface UpEngineFlags {
  /** false with `--no-flash-attention`. */
  flashAttention?: boolean;
  /** false with `--no-prefix-cache`. */
  prefixCache?: boolean;
  /** `--prefix-cache-slots`: extra sequences. */
  prefixCacheSlots: number;
  /** `--prefix-cache-tokens`: tokens. */
  prefixCacheTokens: number;
  /** `--session-ttl-ms`: ms; undefined = the workers' default. */
  sessionTtlMs?: number;
  /** `--prefix-store-bytes`: bytes (0 = off); undefined = the workers' default. */
  prefixStoreBytes?: number;
  /** `--grammar-budget-ms`: ms; undefined = the workers' default. */
  grammarBudgetMs?: number;
  /** `--kv-block-tokens`: tokens per KV-event block; undefined = the workers' default. */
  kvBlockTokens?: number;
}

/**
 * The worker command-line arguments for `o` (the same for prefill and decode), e.g.
 * `['--no-flash-attention', '--prefix-cache-slots', '4', '--prefix-cache-tokens', '65536']`.
 * Throws nothing: `o` was validated by commander's parsers.
 */
export function upEngineArgs(o: UpEngineFlags): string[] {
  return [
    ...(o.flashAttention === false ? ['--no-flash-attention'] : []),
    ...(o.prefixCache === false ? ['--no-prefix-cache'] : []),
    '--prefix-cache-slots',
    String(o.prefixCacheSlots),
    '--prefix-cache-tokens',
    String(o.prefixCacheTokens),
    ...(o.sessionTtlMs !== undefined ? ['--session-ttl-ms', String(o.sessionTtlMs)] : []),
    ...(o.prefixStoreBytes !== undefined ? ['--prefix-store-bytes', String(o.prefixStoreBytes)] : []),
    ...(o.grammarBudgetMs !== undefined ? ['--grammar-budget-ms', String(o.grammarBudgetMs)] : []),
    ...(o.kvBlockTokens !== undefined ? ['--kv-block-tokens', String(o.kvBlockTokens)] : []),
  ];
}
