/**
 * Shared vocabulary of the KV handoff: KVPoll states (SGLang's numbering), room records,
 * lifecycle events and effects. The lifecycle core (lifecycle.ts) is sans-IO: it maps
 * (rooms, event, now) → effects; workers and the simulator turn effects into I/O.
 */
import { PdError, type RoomFailure } from '../base/errors.js';
import type { RoomId } from '../base/room-id.js';

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

/** Bootstrap room id: the one branded type (a canonical decimal u64; see base/room-id.ts). */
export type { RoomId } from '../base/room-id.js';
export type { RoomFailure } from '../base/errors.js';

/**
 * Finer position of a room inside its KVPoll state; each phase has its own deadline.
 * prefill: bootstrap (Bootstrapping: waiting for decode's REGISTER) → waiting (WaitingForInput:
 *   queued for / running prompt evaluation) → inflight (Transferring: sending KV) → done.
 * decode: prealloc (Bootstrapping: waiting for a free sequence slot) → bootstrap (Bootstrapping:
 *   slot held, REGISTER sent, waiting for prefill's REGISTERED) → waiting (WaitingForInput:
 *   registered, waiting for KV_BEGIN) → transfer (Transferring: receiving, validating, loading) → done.
 * decode-local continuation (a room without a peer): prealloc → local (WaitingForInput: decode
 *   evaluates the uncached suffix itself on a kept sequence; deadline waitingMs) → done.
 */
export type Phase = 'prealloc' | 'bootstrap' | 'waiting' | 'inflight' | 'transfer' | 'local' | 'done';

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
  /** Why the room failed: stable code + detail (the first failure wins). */
  failure?: RoomFailure;
  timeline: TimelineEntry[];
}

/** Inputs to the lifecycle core. `now` is passed separately. */
export type RoomEvent =
  /** decode: a sequence slot is reserved for the room (prealloc → bootstrap). */
  | { t: 'slot_reserved' }
  /**
   * decode-local continuation: a sequence slot is reserved for a room created WITHOUT a peer
   * (the router sent the request to decode alone); decode evaluates the prompt's uncached suffix
   * itself (prealloc → WaitingForInput/local, effect `start_local_prefill`). Its `kv_done` (the
   * suffix evaluated, first token sampled) → Success. As Dynamo's conditional disaggregation.
   */
  | { t: 'local_prefill' }
  /** prefill: decode's REGISTER arrived; decode: prefill's REGISTERED arrived. → WaitingForInput. */
  | { t: 'registered'; peer?: string; peerEpoch?: string }
  /** prefill: prompt evaluated and state saved; decode: KV_BEGIN received. → Transferring. */
  | { t: 'kv_begin'; totalBytes: number }
  /** Bytes moved (chunk written to the socket / received). Restarts the transfer deadline. */
  | { t: 'progress'; bytes: number }
  /** prefill: decode's KV_ACK arrived; decode: state validated and loaded. → Success. */
  | { t: 'kv_done' }
  /**
   * Cancellation. `from`: who asked. 'peer' means the other worker told us (do not echo back);
   * its `failure` is the peer's own (a client abort on decode stays `request_aborted` on prefill).
   */
  | { t: 'abort'; from: 'router' | 'client' | 'peer' | 'local'; failure: RoomFailure }
  /** A local error (engine, validation, socket write). */
  | { t: 'fail'; failure: RoomFailure }
  /** The control connection to the room's peer is gone or silent. */
  | { t: 'peer_lost'; failure: RoomFailure };

/** Outputs of the lifecycle core; the driver performs them in order. */
export type Effect =
  /** Tell the peer this room is over (wire: FAIL). Never emitted for `abort` with from='peer'. */
  | { t: 'notify_peer'; room: RoomId; peer: string; failure: RoomFailure }
  /** decode: send REGISTER for this room (emitted on slot_reserved). */
  | { t: 'send_register'; room: RoomId; peer: string }
  /** decode: a local room holds its slot: evaluate the prompt's uncached suffix on it. */
  | { t: 'start_local_prefill'; room: RoomId }
  /** prefill: decode registered, enqueue prompt evaluation. */
  | { t: 'start_prefill'; room: RoomId }
  /** decode: tell prefill the state is loaded (wire: KV_ACK). */
  | { t: 'send_ack'; room: RoomId; peer: string }
  /**
   * The room reached Success or Failed. Emitted exactly once per room: release its resources now.
   * `failure` is set on Failed.
   */
  | { t: 'terminal'; room: RoomId; state: KVPoll.Success | KVPoll.Failed; failure?: RoomFailure }
  /**
   * A real protocol violation the transition function refused: an event out of order on a live
   * room, or a resource double-acquire on Success (pdserve_illegal_transitions_total; 0 in a
   * healthy cluster, so an alert on it is meaningful).
   */
  | { t: 'illegal'; room: RoomId; from: KVPoll; to: KVPoll; why: string }
  /**
   * A benign race: a forward event (a completion, an ack in flight) reached a room that had
   * already failed — e.g. decode's KV_ACK crossing a client abort. Refused like an illegal write
   * (the room stays Failed) but counted apart (pdserve_room_late_events_total{event}).
   */
  | { t: 'late'; room: RoomId; event: RoomEvent['t']; state: KVPoll }
  /** A deadline expired (counted as pdserve_room_deadline_expired_total{role,state}). */
  | { t: 'expired'; room: RoomId; state: KVPoll; phase: Phase; timeline: TimelineEntry[] };

/** The KV layer's errors (a PdError, see base/errors.ts): a stable code, mapped to HTTP there. */
export class KvError extends PdError {
  constructor(
    public override readonly code: 'DUPLICATE_ROOM' | 'ROOM_FAILED' | 'UNKNOWN_ROOM' | 'BAD_ENVELOPE' | 'BAD_STATE' | 'PEER_LOST' | 'AUTH_FAILED' | 'SETTINGS_MISMATCH' | 'BAD_FRAME' | 'TIMEOUT' | 'ABORTED' | 'STATE_TOO_LARGE',
    message: string,
  ) {
    super(code, message);
    this.name = 'KvError';
  }
}
