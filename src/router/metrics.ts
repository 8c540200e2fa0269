/**
 * Router metrics, in a prom-client Registry of its own (never the global one, so several
 * routers can live in one process, e.g. in tests).
 *
 * - pdserve_time_to_first_token_seconds: request received → first decode event (histogram).
 * - pdserve_inter_token_latency_seconds: gap between decode events, per token (histogram).
 * - pdserve_e2e_request_latency_seconds: request received → response finished, ok requests only.
 * - pdserve_router_requests_total{outcome}: finished generation requests by outcome
 *   (ok | client_abort | client_error | error | timeout): client_error is a request answered with
 *   a 4xx (a bad body, an unknown model, a prompt over the context), before or after dispatch;
 *   error is a failure of the system (5xx: no healthy worker, a worker failure).
 *   An n > 1 request or a prompt batch counts once per choice (api/fanout.ts: each choice is a
 *   generation of its own), the parent request is not counted.
 * - pdserve_router_requests_by_path_total{path}: ok requests (choices, as above) by serving path —
 *   pd (prefill + decode, KV handoff) or decode_local (decode alone continued a kept sequence) —
 *   and path="fallback": decode-local attempts decode answered `needs_prefill` (then served as pd).
 * - pdserve_router_retries_total{reason,outcome} / pdserve_router_migrations_total{reason,outcome}:
 *   attempts that failed and were dispatched again (./attempts.ts), before any output (retry) or
 *   after it (migration); reason = the failure's code, outcome = how the request then ended.
 * - pdserve_router_inflight_requests: generation requests being served right now.
 * - pdserve_router_worker_load{worker}: the router's in-flight count per worker URL.
 * Per-worker series exist only for the workers in the registry: a worker that leaves (etcd
 * membership, a removal) takes its series with it (`forgetWorker`), so no series stays frozen
 * at a departed worker's last value.
 */
import { Counter, Gauge, Histogram, Registry } from 'prom-client';
import type { WorkerRegistry } from './registry.js';

export type Outcome = 'ok' | 'client_abort' | 'client_error' | 'error' | 'timeout';
export const OUTCOMES: readonly Outcome[] = ['ok', 'client_abort', 'client_error', 'error', 'timeout'];

/**
 * The `outcome` label of a request that ended with `err`: `client_error` when it carries a 4xx
 * `status` (an ApiError), else `error` (the system's failure).
 */
export function errorOutcome(err: unknown): 'client_error' | 'error' {
  const status = (err as { status?: unknown } | null | undefined)?.status;
  return typeof status === 'number' && status >= 400 && status < 500 ? 'client_error' : 'error';
}

export class RouterMetrics {
  readonly registry = new Registry();
  readonly ttft: Histogram;
  readonly itl: Histogram;
  readonly e2e: Histogram;
  readonly requests: Counter<'outcome'>;
  readonly byPath: Counter<'path'>;
  readonly retries: Counter<'reason' | 'outcome'>;
  readonly migrations: Counter<'reason' | 'outcome'>;
  readonly inflight: Gauge;
  readonly workerLoad: Gauge<'worker'>;

  constructor(workers: WorkerRegistry) {
    const registers = [this.registry];
    this.ttft = new Histogram({
      name: 'pdserve_time_to_first_token_seconds',
      help: 'Time from request arrival at the router to the first generated token, seconds.',
      buckets: [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80, 160, 320],
      registers,
    });
    this.itl = new Histogram({
      name: 'pdserve_inter_token_latency_seconds',
      help: 'Time between consecutive generated tokens as seen by the router, seconds.',
      buckets: [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10],
      registers,
    });
    this.e2e = new Histogram({
      name: 'pdserve_e2e_request_latency_seconds',
      help: 'End-to-end latency of successful requests at the router, seconds.',
      buckets: [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600, 1200],
      registers,
    });
    this.requests = new Counter({ name: 'pdserve_router_requests_total', help: 'Finished generation requests by outcome, one per choice (each choice of an n > 1 request or of a prompt batch is a request of its own).', labelNames: ['outcome'], registers });
    for (const o of OUTCOMES) this.requests.labels(o).inc(0);
    this.byPath = new Counter({ name: 'pdserve_router_requests_by_path_total', help: 'Successful generations by serving path (pd, decode_local), one per choice (each choice of an n > 1 request or of a prompt batch is served, and counted, as a request of its own), and decode-local attempts that fell back to pd (fallback).', labelNames: ['path'], registers });
    for (const p of ['pd', 'decode_local', 'fallback']) this.byPath.labels(p).inc(0);
    this.retries = new Counter({ name: 'pdserve_router_retries_total', help: 'Attempts that failed before any output and were dispatched again, by the failure code and how the request then ended.', labelNames: ['reason', 'outcome'], registers });
    this.migrations = new Counter({ name: 'pdserve_router_migrations_total', help: 'Attempts that failed after the client had output and were migrated to another pair (prompt + tokens sent), by the failure code and how the request then ended.', labelNames: ['reason', 'outcome'], registers });
    this.inflight = new Gauge({ name: 'pdserve_router_inflight_requests', help: 'Generation requests in flight at the router.', registers });
    this.workerLoad = new Gauge({
      name: 'pdserve_router_worker_load',
      help: "The router's in-flight request count per worker.",
      labelNames: ['worker'],
      registers,
      collect() {
        // the pool now, nothing else: a series of a worker that left cannot come back
        this.reset();
        for (const w of workers.workers) this.labels(w.url).set(w.load);
      },
    });
  }

  /** Every gauge with a `worker` label (what `forgetWorker` clears). */
  get perWorker(): Gauge<'worker'>[] {
    return [this.workerLoad];
  }

  /** Remove every per-worker series of `url` (the worker left the registry). */
  forgetWorker(url: string): void {
    for (const g of this.perWorker) g.remove({ worker: url });
  }
}
