/**
 * Serving-benchmark metrics, defined as in vLLM's `bench serve` and sglang's `bench_serving`:
 *
 * - TTFT: request sent → first chunk carrying non-empty text.
 * - ITL: every gap between consecutive non-empty chunks of one request (all requests pooled).
 * - TPOT: per request, (E2E − TTFT) / (output tokens − 1); only requests with > 1 output token
 *   enter the TPOT statistics (for the SLO check a 1-token request counts as TPOT 0).
 * - E2E: request sent → last byte of the stream.
 * - Goodput: requests per second that met every given SLO (TTFT, TPOT, E2E), over the run's
 *   duration; null when no SLO is given.
 * - Throughputs: tokens of successful requests / run duration (first send → last completion).
 */
import { summarize, type Summary } from '../observe/stats.js';

/** What the client observed for one request. Times in ms. */
export interface RequestRecord {
  ok: boolean;
  /** Error text of a failed request. */
  error?: string;
  /** Prompt tokens: the server's usage when reported, else the client's count/estimate. */
  promptTokens: number;
  /** Output tokens: the server's usage when reported, else the number of non-empty chunks. */
  outputTokens: number;
  /** True when the token counts came from the server (final usage chunk / meta_info). */
  usageReported: boolean;
  /** When the request was sent, ms since the run's start. */
  startMs: number;
  /** Sent → first non-empty chunk; NaN when none arrived. */
  ttftMs: number;
  /** Sent → end of the stream. */
  e2eMs: number;
  /** Gaps between consecutive non-empty chunks. */
  itlMs: number[];
  /** Arrival of each non-empty chunk, ms since the run's start (for time plots). */
  chunkAtMs: number[];
  /** Prompt tokens the server served from its prefix cache (usage.prompt_tokens_details.cached_tokens / meta_info.cached_tokens), when reported. */
  cachedTokens?: number;
  /** pd-direct only: what the prefill worker reported (meta_info) once its room succeeded. */
  server?: { prefillMs?: number; transferMs?: number; kvBytes?: number };
}

/** Service-level objectives for goodput; unset fields are not checked. */
export interface Slo {
  ttftMs?: number;
  tpotMs?: number;
  e2eMs?: number;
}

/** Aggregate metrics of one benchmark run. */
export interface BenchMetrics {
  completed: number;
  failed: number;
  /** First send → last completion, seconds. */
  durationS: number;
  totalInputTokens: number;
  totalOutputTokens: number;
  /** Successful requests / duration. */
  requestThroughput: number;
  inputThroughput: number;
  outputThroughput: number;
  totalTokenThroughput: number;
  /** Requests that met every SLO; null without SLOs. */
  goodRequests: number | null;
  /** goodRequests / duration, req/s; null without SLOs. */
  goodput: number | null;
  /** Highest number of requests in flight at once. */
  peakConcurrency: number;
  ttftMs: Summary;
  tpotMs: Summary;
  itlMs: Summary;
  e2eMs: Summary;
}

/** TPOT of one request, ms: (E2E − TTFT) / (outputTokens − 1); undefined for ≤ 1 output token or a failed request. */
export function tpotMs(r: Pick<RequestRecord, 'ok' | 'e2eMs' | 'ttftMs' | 'outputTokens'>): number | undefined {
  if (!r.ok || r.outputTokens <= 1 || !Number.isFinite(r.ttftMs)) return undefined;
  return (r.e2eMs - r.ttftMs) / (r.outputTokens - 1);
}

/** True when a successful request met every SLO that is set (a 1-token request has TPOT 0). */
export function meetsSlo(r: RequestRecord, slo: Slo): boolean {
  if (!r.ok) return false;
  if (slo.ttftMs !== undefined && !(r.ttftMs <= slo.ttftMs)) return false;
  if (slo.tpotMs !== undefined && !((tpotMs(r) ?? 0) <= slo.tpotMs)) return false;
  if (slo.e2eMs !== undefined && !(r.e2eMs <= slo.e2eMs)) return false;
  return true;
}

/** True when at least one SLO is set. */
export function hasSlo(slo: Slo | undefined): slo is Slo {
  return !!slo && (slo.ttftMs !== undefined || slo.tpotMs !== undefined || slo.e2eMs !== undefined);
}

/**
 * Goodput: {good, rps} = requests meeting every SLO and their rate over `durationS`;
 * null when no SLO is set. A zero duration gives rps 0.
 */
export function goodput(records: readonly RequestRecord[], slo: Slo | undefined, durationS: number): { good: number; rps: number } | null {
  if (!hasSlo(slo)) return null;
  const good = records.filter((r) => meetsSlo(r, slo)).length;
  return { good, rps: durationS > 0 ? good / durationS : 0 };
}

/** Highest number of overlapping [startMs, startMs + e2eMs] intervals. */
export function peakConcurrency(records: readonly Pick<RequestRecord, 'startMs' | 'e2eMs'>[]): number {
  const ev: [number, number][] = [];
  for (const r of records) {
    ev.push([r.startMs, 1]);
    ev.push([r.startMs + r.e2eMs, -1]);
  }
  // ends before starts at the same instant
  ev.sort((a, b) => a[0] - b[0] || a[1] - b[1]);
  let cur = 0;
  let peak = 0;
  for (const [, d] of ev) {
    cur += d;
    if (cur > peak) peak = cur;
  }
  return peak;
}

/** All metrics of a run from its request records and duration (ms). */
export function computeMetrics(records: readonly RequestRecord[], durationMs: number, slo?: Slo): BenchMetrics {
  const ok = records.filter((r) => r.ok);
  const durationS = durationMs / 1000;
  const per = (x: number) => (durationS > 0 ? x / durationS : 0);
  const totalInputTokens = ok.reduce((a, r) => a + r.promptTokens, 0);
  const totalOutputTokens = ok.reduce((a, r) => a + r.outputTokens, 0);
  const g = goodput(records, slo, durationS);
  const tpots: number[] = [];
  for (const r of ok) {
    const t = tpotMs(r);
    if (t !== undefined) tpots.push(t);
  }
  return {
    completed: ok.length,
    failed: records.length - ok.length,
    durationS,
    totalInputTokens,
    totalOutputTokens,
    requestThroughput: per(ok.length),
    inputThroughput: per(totalInputTokens),
    outputThroughput: per(totalOutputTokens),
    totalTokenThroughput: per(totalInputTokens + totalOutputTokens),
    goodRequests: g ? g.good : null,
    goodput: g ? g.rps : null,
    peakConcurrency: peakConcurrency(records),
    ttftMs: summarize(ok.map((r) => r.ttftMs)),
    tpotMs: summarize(tpots),
    itlMs: summarize(ok.flatMap((r) => r.itlMs)),
    e2eMs: summarize(ok.map((r) => r.e2eMs)),
  };
}
