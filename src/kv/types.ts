/**
 * Shared vocabulary of the KV handoff: KVPoll states (SGLang's numbering), room records,
 * lifecycle events and effects. The lifecycle core (lifecycle.ts) is sans-IO: it maps
 * (rooms, event, now) → effects; workers and the simulator turn effects into I/O.
 */

/** Room status, numbered as SGLang's `KVPoll`. Failed and Success are terminal. */
export enum KVPoll {
  Failed = 0,
  Bootstrapping = 1,
  WaitingForInput = 2,
  Transferring = 3,
  Success = 4,
}

export const isTerminal = (s: KVPoll): boolean => s === KVPoll.Failed || s === KVPoll.Success;

export type Role = 'prefill' | 'decode';

/** Bootstrap room id: a random 63-bit integer, carried as a decimal string (JSON-safe). */
export type RoomId = string;

/**
 * Finer position of a room inside its KVPoll state; each phase has its own deadline.
 * prefill: bootstrap (Bootstrapping: waiting for decode's REGISTER) → waiting (WaitingForInput:
 *   queued for / running prompt evaluation) → inflight (Transferring: sending KV) → done.
 * decode: prealloc (Bootstrapping: waiting for a free sequence slot) → bootstrap (Bootstrapping:
 *   slot held, REGISTER sent, waiting for prefill's REGISTERED) → waiting (WaitingForInput:
 *   registered, waiting for KV_BEGIN) → transfer (Transferring: receiving, validating, loading) → done.
 */
export type Phase = 'prealloc' | 'bootstrap' | 'waiting' | 'inflight' | 'transfer' | 'done';

/** Deadlines per phase, in ms. Transfer deadlines restart on every progress event. */
export interface RoomTimeouts {
  /** decode: max wait for a free sequence slot. */
  preallocMs: number;
  /** both: max wait for the peer's registration / registration ack. */
  bootstrapMs: number;
  /** prefill: max queue + prompt evaluation time; decode: max wait for KV_BEGIN after registering. */
  waitingMs: number;
  /** both: max time without transfer progress (chunk sent/received, load finished, ack). */
  transferIdleMs: number;
}

export const DEFAULT_TIMEOUTS: Readonly<RoomTimeouts> = Object.freeze({
  preallocMs: 30_000,
  bootstrapMs: 10_000,
  waitingMs: 60_000,
  transferIdleMs: 10_000,
});

export interface TimelineEntry {
  /** ms since epoch (or virtual ms in the simulator). */
  at: number;
  state: KVPoll;
  phase: Phase;
  /** Event that caused the entry, e.g. 'create', 'registered', 'abort:router', 'deadline:bootstrap'. */
  why: string;
}

/** One room as held by one worker. Mutated only by lifecycle.ts. */
export interface Room {
  id: RoomId;
  /** Request id (OpenAI-style id given by the router). */
  rid: string;
  role: Role;
  state: KVPoll;
  phase: Phase;
  createdAt: number;
  /** Absolute deadline (ms) of the current phase; Infinity once terminal. */
  deadlineAt: number;
  /** Peer address "host:port" (prefill's bootstrap address as seen by decode, or decode's connection id as seen by prefill). */
  peer?: string;
  /** Peer's session epoch, bound at registration. */
  peerEpoch?: string;
  /** KV bytes sent (prefill) or received (decode). */
  bytes: number;
  /** Total KV bytes announced in KV_BEGIN, when known. */
  totalBytes?: number;
  /** Why the room failed (first reason wins). */
  failReason?: string;
  timeline: TimelineEntry[];
}

/** Inputs to the lifecycle core. `now` is passed separately. */
export type RoomEvent =
  /** decode: a sequence slot is reserved for the room (prealloc → bootstrap). */
  | { t: 'slot_reserved' }
  /** prefill: decode's REGISTER arrived; decode: prefill's REGISTERED arrived. → WaitingForInput. */
  | { t: 'registered'; peer?: string; peerEpoch?: string }
  /** prefill: prompt evaluated and state saved; decode: KV_BEGIN received. → Transferring. */
  | { t: 'kv_begin'; totalBytes: number }
  /** Bytes moved (chunk written to the socket / received). Restarts the transfer deadline. */
  | { t: 'progress'; bytes: number }
  /** prefill: decode's KV_ACK arrived; decode: state validated and loaded. → Success. */
  | { t: 'kv_done' }
  /** Cancellation. `from`: who asked. 'peer' means the other worker told us (do not echo back). */
  | { t: 'abort'; from: 'router' | 'client' | 'peer' | 'local'; reason: string }
  /** A local error (engine, validation, socket write). */
  | { t: 'fail'; reason: string }
  /** The control connection to the room's peer is gone or silent. */
  | { t: 'peer_lost'; reason: string };

/** Outputs of the lifecycle core; the driver performs them in order. */
export type Effect =
  /** Tell the peer this room is over (wire: FAIL). Never emitted for `abort` with from='peer'. */
  | { t: 'notify_peer'; room: RoomId; peer: string; reason: string }
  /** decode: send REGISTER for this room (emitted on slot_reserved). */
  | { t: 'send_register'; room: RoomId; peer: string }
  /** prefill: decode registered, enqueue prompt evaluation. */
  | { t: 'start_prefill'; room: RoomId }
  /** decode: tell prefill the state is loaded (wire: KV_ACK). */
  | { t: 'send_ack'; room: RoomId; peer: string }
  /** The room reached Success or Failed. Emitted exactly once per room: release its resources now. */
  | { t: 'terminal'; room: RoomId; state: KVPoll.Success | KVPoll.Failed; reason: string }
  /** A write the transition function refused (counted as pdserve_illegal_transitions_total). */
  | { t: 'illegal'; room: RoomId; from: KVPoll; to: KVPoll; why: string }
  /** A deadline expired (counted as pdserve_room_deadline_expired_total{role,state}). */
  | { t: 'expired'; room: RoomId; state: KVPoll; phase: Phase; timeline: TimelineEntry[] };

/** Typed error with a stable string code, in the style of undici's errors. */
export class KvError extends Error {
  constructor(
    public readonly code: 'DUPLICATE_ROOM' | 'ROOM_FAILED' | 'UNKNOWN_ROOM' | 'BAD_ENVELOPE' | 'BAD_STATE' | 'PEER_LOST' | 'AUTH_FAILED' | 'BAD_FRAME' | 'TIMEOUT' | 'ABORTED',
    message: string,
  ) {
    super(message);
    this.name = 'KvError';
  }
}
