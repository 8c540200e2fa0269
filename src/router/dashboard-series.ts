/**
 * The dashboard's time series: finished requests at the router, in fixed buckets
 * (`bucketMs`, default 5 s) over a sliding window (`buckets`, default 60 = the last 5 minutes).
 * Per bucket: requests by outcome (client errors, 4xx, apart from failures), completion tokens (throughput), TTFT and mean-ITL samples
 * (bounded per bucket) for p50/p95, and failures by code. Memory is bounded: at most
 * `buckets × maxSamples` numbers. Buckets follow the monotonic clock, so a wall-clock step
 * neither empties the window nor piles requests into one bucket; only the labels are wall time.
 */
import { systemClock } from '../base/clock.js';

interface Bucket {
  /** Bucket start, monotonic ms (src/base/clock.ts). */
  t: number;
  ok: number;
  /** Answered with a client error (HTTP 4xx): counted apart from failures. */
  rejected: number;
  failed: number;
  tokens: number;
  ttft: number[];
  itl: number[];
  failures: Map<string, number>;
}

/** JSON of the series for the dashboard (arrays aligned on `t`, seconds since epoch). */
export interface SeriesView {
  bucket_s: number;
  t: number[];
  ttft_p50_ms: (number | null)[];
  ttft_p95_ms: (number | null)[];
  itl_p50_ms: (number | null)[];
  itl_p95_ms: (number | null)[];
  tokens_per_s: number[];
  requests_per_s: number[];
  failed_per_s: number[];
  /** Requests answered with a client error (HTTP 4xx), per second. */
  rejected_per_s: number[];
  /** Failures by code over the whole window, most frequent first. */
  failures: { code: string; count: number }[];
}

/** Nearest-rank percentile of `xs` (q in [0, 1]); null when empty. */
export function percentile(xs: number[], q: number): number | null {
  if (xs.length === 0) return null;
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.max(0, Math.ceil(q * s.length) - 1))]!;
}

export class DashboardSeries {
  private readonly ring: Bucket[] = [];

  constructor(
    readonly bucketMs = 5000,
    readonly buckets = 60,
    readonly maxSamples = 512,
  ) {}

  private bucket(now: number): Bucket {
    now = Math.floor(now);
    const t = now - (now % this.bucketMs);
    let b = this.ring[this.ring.length - 1];
    if (!b || b.t !== t) {
      b = { t, ok: 0, rejected: 0, failed: 0, tokens: 0, ttft: [], itl: [], failures: new Map() };
      this.ring.push(b);
      while (this.ring.length > this.buckets) this.ring.shift();
    }
    return b;
  }

  /**
   * Record one finished request (the dispatch 'finished' fields: outcome, code, ttft_ms, itl_ms,
   * completion_tokens, status). Client aborts count neither as ok nor as failed; a request
   * answered with a 4xx status counts as rejected, not failed.
   */
  add(f: Record<string, unknown>, now = systemClock.nowMs()): void {
    const b = this.bucket(now);
    const n = (v: unknown) => (typeof v === 'number' && Number.isFinite(v) ? v : null);
    if (f.outcome === 'ok') b.ok++;
    else if (f.outcome !== 'client_abort' && typeof f.status === 'number' && f.status >= 400 && f.status < 500) b.rejected++;
    else if (f.outcome !== 'client_abort') {
      b.failed++;
      const code = typeof f.code === 'string' ? f.code : String(f.outcome ?? 'error');
      b.failures.set(code, (b.failures.get(code) ?? 0) + 1);
    }
    b.tokens += n(f.completion_tokens) ?? 0;
    const ttft = n(f.ttft_ms);
    const itl = n(f.itl_ms);
    if (ttft !== null && b.ttft.length < this.maxSamples) b.ttft.push(ttft);
    if (itl !== null && b.itl.length < this.maxSamples) b.itl.push(itl);
  }

  /**
   * The window as aligned arrays, one entry per bucket (empty buckets included), oldest first; it
   * starts at the oldest bucket with data, showing at least one minute. `now` is on the clock of
   * `add` (default: the monotonic clock); `wallNow` is the wall-clock date of `now`, for the `t`
   * labels (default: the wall clock when `now` is defaulted, else `now`).
   */
  view(now?: number, wallNow?: number): SeriesView {
    if (now === undefined) {
      now = systemClock.nowMs();
      wallNow ??= systemClock.wallMs();
    }
    const toWall = (wallNow ?? now) - now;
    now = Math.floor(now);
    const last = now - (now % this.bucketMs);
    // From the oldest bucket with data (a fresh router shows its first minutes, not 5 empty
    // ones), but at least one minute and at most the whole window.
    const oldest = this.ring[0]?.t ?? last;
    const first = Math.max(last - (this.buckets - 1) * this.bucketMs, Math.min(oldest, last - Math.max(0, Math.ceil(60_000 / this.bucketMs) - 1) * this.bucketMs));
    const byT = new Map(this.ring.map((b) => [b.t, b]));
    const v: SeriesView = { bucket_s: this.bucketMs / 1000, t: [], ttft_p50_ms: [], ttft_p95_ms: [], itl_p50_ms: [], itl_p95_ms: [], tokens_per_s: [], requests_per_s: [], failed_per_s: [], rejected_per_s: [], failures: [] };
    const failures = new Map<string, number>();
    const sec = this.bucketMs / 1000;
    for (let t = first; t <= last; t += this.bucketMs) {
      const b = byT.get(t);
      v.t.push(Math.round(t + toWall) / 1000);
      v.ttft_p50_ms.push(b ? percentile(b.ttft, 0.5) : null);
      v.ttft_p95_ms.push(b ? percentile(b.ttft, 0.95) : null);
      v.itl_p50_ms.push(b ? percentile(b.itl, 0.5) : null);
      v.itl_p95_ms.push(b ? percentile(b.itl, 0.95) : null);
      v.tokens_per_s.push(b ? b.tokens / sec : 0);
      v.requests_per_s.push(b ? b.ok / sec : 0);
      v.failed_per_s.push(b ? b.failed / sec : 0);
      v.rejected_per_s.push(b ? b.rejected / sec : 0);
      for (const [k, c] of b?.failures ?? []) failures.set(k, (failures.get(k) ?? 0) + c);
    }
    v.failures = [...failures.entries()].map(([code, count]) => ({ code, count })).sort((a, b) => b.count - a.count);
    return v;
  }
}
