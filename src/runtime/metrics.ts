/**
 * Prometheus metrics of a worker (prom-client, one registry per process — never the global one).
 * Queue and room gauges are read from the live data structures at scrape time (collect), so
 * they cannot drift from the truth: a gauge is never incremented on one path and forgotten on another.
 */
import client from 'prom-client';
import type { RoomTable } from '../kv/lifecycle.js';
import { causeOf, type RoomFailure } from '../base/errors.js';
import { KVPoll, type Effect, type Role } from '../kv/types.js';
import type { Logger } from '../base/log.js';
import { collectCleanDefaultMetrics } from './promclean.js';

export interface WorkerMetricSources {
  /** Queue name (e.g. 'prefill_inflight_queue') → entries now. */
  queues(): Record<string, number>;
  /** KVPoll → live rooms now. */
  roomsByState(): Map<KVPoll, number>;
  /** Monotonic counters of the KV channel (KvServer / KvPeerPool `stats`), when the role has one. */
  channel?(): Record<string, number>;
}

/** Metric handles shared by prefill and decode workers. */
export class WorkerMetrics {
  readonly registry = new client.Registry();
  readonly kvTransferFailed: client.Counter<'reason'>;
  readonly bootstrapFailed: client.Counter<'reason'>;
  readonly kvBytes: client.Counter;
  readonly kvSeconds: client.Histogram;
  /** Rooms whose KV handoff succeeded, by path ('tcp' | 'same_host', kv/transfer/same-host.ts). */
  readonly kvHandoffs: client.Counter<'path'>;
  /** Prefill only (null on decode and colocated, where it is not registered): successful TCP handoffs whose state went out while llama.cpp was still saving it (`--kv-stream`). */
  readonly kvStreamed: client.Counter | null;
  /** Same-host handoffs decode refused (the room went over TCP instead). */
  readonly kvFileRefused: client.Counter;
  readonly illegal: client.Counter<'from' | 'to'>;
  readonly late: client.Counter<'event' | 'state'>;
  readonly roomsCancelled: client.Counter<'code'>;
  readonly expired: client.Counter<'role' | 'state'>;
  readonly roomsTerminal: client.Counter<'state' | 'cause'>;

  constructor(readonly role: Role | 'colocated', sources: WorkerMetricSources) {
    const registers = [this.registry];
    collectCleanDefaultMetrics(this.registry);
    const queueNames = Object.keys(sources.queues());
    for (const q of queueNames) {
      new client.Gauge({
        name: `pdserve_${q}_reqs`,
        help: `Requests in the ${q.replace(/_/g, ' ')}`,
        registers,
        collect() {
          this.set(sources.queues()[q] ?? 0);
        },
      });
    }
    new client.Gauge({
      name: 'pdserve_rooms',
      help: 'Live rooms by role and KVPoll state',
      labelNames: ['role', 'state'],
      registers,
      collect() {
        const m = sources.roomsByState();
        for (const s of [KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring]) {
          this.set({ role, state: KVPoll[s] }, m.get(s) ?? 0);
        }
      },
    });
    this.kvTransferFailed = new client.Counter({ name: 'pdserve_kv_transfer_failed_total', help: 'Rooms that failed after registration by a system fault, by error code (client cancels are in pdserve_rooms_cancelled_total)', labelNames: ['reason'], registers });
    this.bootstrapFailed = new client.Counter({ name: 'pdserve_bootstrap_failed_total', help: 'Rooms that failed before registration completed by a system fault, by error code (client cancels are in pdserve_rooms_cancelled_total)', labelNames: ['reason'], registers });
    this.roomsCancelled = new client.Counter({ name: 'pdserve_rooms_cancelled_total', help: 'Rooms failed by their client (abort, bad request such as a prompt over the context): not a worker fault, by error code', labelNames: ['code'], registers });
    this.kvBytes = new client.Counter({ name: 'pdserve_kv_transfer_bytes_total', help: 'KV state bytes sent (prefill) or received (decode)', registers });
    this.kvSeconds = new client.Histogram({ name: 'pdserve_kv_transfer_seconds', help: 'Time from kv_begin to the room reaching Success', buckets: [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10], registers });
    this.kvHandoffs = new client.Counter({ name: 'pdserve_kv_handoffs_total', help: 'Rooms whose KV handoff succeeded, by path: tcp (streamed over the KV channel) or same_host (the state file handed over, kv_file)', labelNames: ['path'], registers });
    this.kvStreamed = role !== 'prefill' ? null : new client.Counter({ name: 'pdserve_kv_streamed_handoffs_total', help: 'Prefill: successful TCP handoffs sent while llama.cpp was still saving the state (--kv-stream; also counted in pdserve_kv_handoffs_total{path="tcp"})', registers });
    this.kvFileRefused = new client.Counter({ name: 'pdserve_kv_file_refused_total', help: 'Same-host handoffs (kv_file) refused by decode (file missing, other size, …): the room went over TCP instead', registers });
    this.illegal = new client.Counter({ name: 'pdserve_illegal_transitions_total', help: 'Room state writes refused as protocol violations (0 in a healthy cluster)', labelNames: ['from', 'to'], registers });
    this.late = new client.Counter({ name: 'pdserve_room_late_events_total', help: 'Benign races: events (an ack, a completion) that reached a room already Failed, refused without harm', labelNames: ['event', 'state'], registers });
    this.expired = new client.Counter({ name: 'pdserve_room_deadline_expired_total', help: 'Rooms failed by the watchdog', labelNames: ['role', 'state'], registers });
    this.roomsTerminal = new client.Counter({ name: 'pdserve_rooms_terminal_total', help: 'Rooms that reached a terminal state, by state and cause (none | client | system)', labelNames: ['state', 'cause'], registers });
    if (sources.channel) {
      const read = sources.channel;
      // Monotonic counters kept by the KV channel, mirrored at scrape time.
      new client.Counter({
        name: 'pdserve_kv_channel_events_total',
        help: 'KV channel counters since start: frames and bytes in/out, auth failures, bad frames, stale-epoch messages, peers lost',
        labelNames: ['event'],
        registers,
        collect() {
          this.reset();
          for (const [k, v] of Object.entries(read())) this.inc({ event: k.replace(/[A-Z]/g, (m) => `_${m.toLowerCase()}`) }, v);
        },
      });
    }
  }

  /**
   * Count a room's terminal outcome once: pdserve_rooms_terminal_total{state,cause}; a client-caused
   * failure in pdserve_rooms_cancelled_total{code}; a system fault in kv_transfer_failed (after
   * registration) or bootstrap_failed (before), labelled by its error code.
   */
  recordTerminal(state: KVPoll, f: RoomFailure | undefined, registered: boolean): void {
    const cause = f ? causeOf(f.code) : 'none';
    this.roomsTerminal.inc({ state: KVPoll[state], cause });
    if (!f) return;
    if (cause === 'client') this.roomsCancelled.inc({ code: f.code });
    else (registered ? this.kvTransferFailed : this.bootstrapFailed).inc({ reason: f.code });
  }

  /**
   * Count and log the core's diagnostic effects (`illegal`, `late`, `expired`); other effects are ignored.
   * `trace`: the room's trace id (TraceTags), put on the log line when known.
   */
  recordDiagnostic(e: Effect, log: Logger, trace?: string | null): void {
    if (trace && (e.t === 'illegal' || e.t === 'expired')) log = log.child({ trace });
    if (e.t === 'late') {
      this.late.inc({ event: e.event, state: KVPoll[e.state] });
      log.debug({ room: e.room, event: e.event, state: KVPoll[e.state] }, 'late event on a failed room (benign race) refused');
    } else if (e.t === 'illegal') {
      this.illegal.inc({ from: KVPoll[e.from], to: KVPoll[e.to] });
      log.warn({ room: e.room, from: KVPoll[e.from], to: KVPoll[e.to], why: e.why }, 'illegal room transition refused');
    } else if (e.t === 'expired') {
      this.expired.inc({ role: this.role, state: KVPoll[e.state] });
      log.warn({ room: e.room, state: KVPoll[e.state], phase: e.phase, timeline: e.timeline }, 'room deadline expired');
    }
  }
}

/** Live rooms of `table` per KVPoll state. */
export function roomsByState(table: RoomTable): Map<KVPoll, number> {
  const m = new Map<KVPoll, number>();
  for (const r of table.rooms()) m.set(r.state, (m.get(r.state) ?? 0) + 1);
  return m;
}
