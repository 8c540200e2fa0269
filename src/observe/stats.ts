/**
 * Small statistics helpers shared by `pdserve storm` and `pdserve bench`: percentiles with
 * linear interpolation (numpy's default, "type 7") and a one-call summary of a sample.
 */

/** Summary of a sample. Every field is NaN (n = 0) for an empty sample. */
export interface Summary {
  n: number;
  mean: number;
  median: number;
  p50: number;
  p90: number;
  p99: number;
  min: number;
  max: number;
}

/**
 * The `p`-th percentile (0–100) of an ascending-sorted array, linearly interpolated between the
 * two closest ranks (rank = p/100 · (n − 1)). NaN for an empty array; `p` is clamped to [0, 100].
 * The array is not checked for order: sort it first (`sortedNumbers`).
 */
export function percentile(sorted: readonly number[], p: number): number {
  const n = sorted.length;
  if (n === 0) return NaN;
  if (n === 1) return sorted[0]!;
  const q = Math.min(100, Math.max(0, Number.isNaN(p) ? 0 : p)) / 100;
  const rank = q * (n - 1);
  const lo = Math.floor(rank);
  const hi = Math.min(n - 1, lo + 1);
  const w = rank - lo;
  return sorted[lo]! + (sorted[hi]! - sorted[lo]!) * w;
}

/** A sorted copy of the finite numbers of `values` (NaN and ±Infinity are dropped). */
export function sortedNumbers(values: Iterable<number>): number[] {
  const out: number[] = [];
  for (const v of values) if (Number.isFinite(v)) out.push(v);
  return out.sort((a, b) => a - b);
}

/** n, mean, median (= p50), p90, p99, min and max of the finite values of `values` (any order). */
export function summarize(values: Iterable<number>): Summary {
  const s = sortedNumbers(values);
  const n = s.length;
  if (n === 0) return { n: 0, mean: NaN, median: NaN, p50: NaN, p90: NaN, p99: NaN, min: NaN, max: NaN };
  let sum = 0;
  for (const v of s) sum += v;
  const p50 = percentile(s, 50);
  return { n, mean: sum / n, median: p50, p50, p90: percentile(s, 90), p99: percentile(s, 99), min: s[0]!, max: s[n - 1]! };
}
