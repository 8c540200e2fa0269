/**
 * The simulator's public shapes: a world's options, fault profiles and deadlines, and what a run
 * returns (statistics, violations, the trace).
 */
import type { RoomId, RoomTimeouts } from '../kv/types.js';
import type { Violation } from './checks.js';

export interface TraceEntry {
  /** Virtual ms. */
  at: number;
  who: 'R' | 'P' | 'D' | 'D2' | 'net' | 'sim';
  room?: RoomId;
  text: string;
}

export type FaultProfileName = 'calm' | 'mild' | 'harsh';

export interface FaultProfile {
  name: FaultProfileName;
  /** Probability a node→node frame is lost (the handshake's frames excepted: a TCP handshake retries until it works). */
  drop: number;
  /** Probability a frame is delivered twice. */
  dup: number;
  /** Extra random delay, ms (uniform 0..jitter). */
  jitterMs: number;
  /**
   * Probability a frame ignores the link's FIFO order (may overtake earlier frames). The real
   * channel is one TCP connection (FIFO); reordering models a broken/reconnected path and keeps
   * the drivers honest about out-of-order KV_BEGIN / chunks / KV_END.
   */
  reorder: number;
}

export const FAULT_PROFILES: Readonly<Record<FaultProfileName, FaultProfile>> = {
  calm: { name: 'calm', drop: 0, dup: 0, jitterMs: 2, reorder: 0 },
  mild: { name: 'mild', drop: 0.01, dup: 0.01, jitterMs: 10, reorder: 0.02 },
  harsh: { name: 'harsh', drop: 0.05, dup: 0.03, jitterMs: 30, reorder: 0.1 },
};

/** Deadlines used by the simulator (virtual ms), scaled down from the defaults. */
export const SIM_TIMEOUTS: Readonly<RoomTimeouts> = Object.freeze({ preallocMs: 400, bootstrapMs: 150, waitingMs: 600, transferIdleMs: 120 });

export interface SimOptions {
  seed: number;
  /** Requests in this world. Default 12. */
  rooms?: number;
  /** TEST-ONLY: both tables use `legacyMaxRule` (SGLang's max(old, new) status rule). */
  legacy?: boolean;
  /** Record the full event trace (slower; used to replay a failing seed). */
  trace?: boolean;
  /** Fault profile; default: drawn from the seed (30% calm, 50% mild, 20% harsh). */
  faults?: FaultProfileName;
  /** Decode slots; default drawn from the seed (2..4). */
  slots?: number;
  /** Both nodes on one host (the same-host handoff); default drawn from the seed (half the worlds). */
  sameHost?: boolean;
  /** Decode workers (1 or 2: requests paired with either, a migration goes to the other); default drawn from the seed (25 % two; legacy: 1). */
  decodes?: 1 | 2;
  /** Sockets per KV connection (`--kv-streams`: 2 stripes the chunks); default drawn from the seed (20 % two; legacy: 1). */
  kvStreams?: 1 | 2;
  timeouts?: Partial<RoomTimeouts>;
  /** The router's `--migration-limit` its attempt plan (../router/plan.ts) runs with; default the router's default. */
  migrationLimit?: number;
  /** Every request's deadline after its arrival, virtual ms; default drawn from the seed (30 % short: 200, else 10,000). */
  requestTimeoutMs?: number;
  /**
   * Role switches: one node per world (P or a decode) is asked to switch at a random time: the
   * router sends it nothing new, it drains (../switch/drain.ts), tears down its role's parts and
   * comes back under a new epoch (the simulated topology keeps its role); 30 % of switches fail
   * midway (down 100–300 ms before the rebuild). Default off.
   */
  switches?: boolean;
  /** TEST-ONLY planted bug: a switch tears down once no request is in flight, not waiting for live rooms. */
  plantSwitchBug?: boolean;
}

export interface SimStats {
  requests: number;
  success: number;
  failed: number;
  aborts: number;
  crashes: number;
  frames: number;
  dropped: number;
  duplicated: number;
  refusedStale: number;
  illegal: number;
  /** Benign races (`late` effects): forward events that reached an already Failed room. */
  late: number;
  expired: number;
  events: number;
  endAt: number;
  /** Requests sent on the decode-local path (decode alone, no prefill leg), and those that succeeded. */
  local: number;
  localSuccess: number;
  /** Rooms of choice groups (n > 1: one prefill computation for 2–3 rooms), and those that succeeded on decode. */
  grouped: number;
  groupedSuccess: number;
  /** States decode took over on the same host (kv_file), and kv_files it refused. */
  sameHost: number;
  fileRefused: number;
  /** Loaded state files decode still held at the room's first decode step and deleted there. */
  filesHeldToFirstStep: number;
  /** Requests migrated after their decode died mid-stream, and those whose migrated stream completed. */
  migrated: number;
  migratedSuccess: number;
  /** Migrations that went to the other decode worker (a world of two). */
  migratedAcross: number;
  /** Requests run again from the start after a worker died before the client had output, and those whose retry completed. */
  retried: number;
  retriedSuccess: number;
  /** 1 when the world has two decode workers. */
  twoDecodes: number;
  /** 1 when the world's KV connections are striped over two sockets; chunk frames sent on the second; chunks the reassembly held for earlier bytes; stripe sockets lost. */
  striped: number;
  stripeChunks: number;
  stripeHeld: number;
  stripeLost: number;
  /** Node freezes (the whole host paused: its loop and its network), and liveness checks that found their own node had stalled. */
  freezes: number;
  ownStalls: number;
  /** Role switches torn down and rebuilt; of them, switches that waited for live rooms with no request in flight (a prefill room whose KV a decode reads, a registration ahead of its request), switches asked while a decode-local request ran, switches that failed midway; switches whose drain ran out of time (the old role serves on). */
  switches: number;
  switchWaitedRooms: number;
  switchDuringLocal: number;
  switchFailed: number;
  switchTimeouts: number;
}

export interface SimResult {
  seed: number;
  ok: boolean;
  legacy: boolean;
  profile: FaultProfileName;
  /** The world's topology: decode workers and sockets per KV connection. */
  decodes: 1 | 2;
  kvStreams: 1 | 2;
  /** The `pdserve sim` flags that replay the options this run forced rather than drew from its seed. */
  forced: string[];
  violations: Violation[];
  stats: SimStats;
  /** Present when `trace: true`. */
  trace?: TraceEntry[];
  /** room id → '#n' */
  labels: Record<RoomId, string>;
}
