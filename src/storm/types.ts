/** The storm's result as its report and `--json` file show it (./index.ts `runStorm` builds it, ./report.ts prints it). */
import type { RoomView } from '../protocol/debug-rooms.js';
import type { Summary } from '../observe/stats.js';
import type { WarmupResult } from './warmup.js';

export type FaultKind = 'kill_decode' | 'kill_prefill' | 'stop_prefill';

/** One injected worker fault and the recovery after it. */
export interface FaultRecord {
  kind: FaultKind;
  target: string;
  /** Seconds since the storm started. */
  at_s: number;
  /** SIGKILL → ready again (kills), or how long the process was stopped (SIGSTOP). */
  down_ms: number | null;
  /** Fault → the first request sent after it that completed ok (service recovery). */
  first_ok_ms: number | null;
  /** Fault → the first successful room on the faulted worker (worker recovery). */
  worker_ok_ms: number | null;
  error?: string;
}

export type CheckName = 'wedge' | 'leak' | 'hang' | 'crash' | 'wrong_answer' | 'illegal';

/** The verdict of one check; `details` names the offending rooms/requests/processes. */
export interface CheckResult {
  name: CheckName;
  status: 'pass' | 'fail' | 'skipped';
  summary: string;
  details: unknown[];
}

/** A room printed with a failed check. */
export interface OffendingRoom {
  check: CheckName;
  worker: string;
  room: RoomView;
}

/** The storm's result (also the `--json` file). */
export interface StormReport {
  ok: boolean;
  mode: 'self-hosted' | 'url';
  target: string;
  config: Record<string, unknown>;
  started_at: string;
  storm_s: number;
  wall_s: number;
  requests: {
    total: number;
    ok: number;
    aborted: number;
    killed: number;
    failed: number;
    hung: number;
    /** aborted / total. */
    abort_share: number;
    /** (aborted + killed) / total. */
    cancel_share: number;
    aborted_at: Record<string, number>;
    killed_at: Record<string, number>;
    /** Failed requests by error code. */
    failed_by_code: Record<string, number>;
    /** The first error message seen for each code. */
    failed_examples: Record<string, string>;
    /**
     * Attempts the router dispatched again after a worker failure (its
     * pdserve_router_retries_total / pdserve_router_migrations_total), by the failure's code:
     * before any output (retried) and after it (migrated). A request that did not exhaust its
     * attempts is not `failed`.
     */
    retried_by_code: Record<string, number>;
    migrated_by_code: Record<string, number>;
    stream: number;
    non_stream: number;
  };
  bursts: { count: number; cancelled: number };
  /**
   * `migrated`: completed rounds the router migrated mid-answer (their traces); of them,
   * `migrated_verified` were compared with the reference and `migrated_equal` were equal.
   */
  rounds: { completed: number; migrated: number; migrated_verified: number; migrated_equal: number; conversations_started: number; conversations_finished: number; restarted_after_kill: number };
  latency_ms: { ttft: Summary; itl: Summary; e2e: Summary };
  prompt_bytes: Summary;
  faults: FaultRecord[];
  checks: CheckResult[];
  /** Successful KV handoffs by worker and path ('tcp' | 'same_host'), since each worker's last start. */
  kv_handoffs: Record<string, Record<string, number>>;
  offending_rooms: OffendingRoom[];
  /** The warm-up before the storm's clock (self-hosted, workers on a GPU backend), if one ran. */
  warmup?: WarmupResult;
  log_dir?: string;
  model?: string;
}
