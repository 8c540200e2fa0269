/**
 * The room lifecycle core: a sans-IO state machine for the KV rooms of ONE worker role.
 *
 * `(rooms, event, now) → effects`. No timers, no sockets, no `Date.now()`: time is passed in
 * (ms; monotonic in the workers (src/base/clock.ts), virtual in the simulator), and every side effect is returned as
 * an `Effect` for the driver to perform in order. The workers (src/prefill, src/decode) and the
 * deterministic simulator (src/sim) drive this same code.
 *
 * States are SGLang's `KVPoll` (Failed=0, Bootstrapping=1, WaitingForInput=2, Transferring=3,
 * Success=4). The incident this core exists to prevent: SGLang's `update_status` took
 * `max(old, new)`, so a transfer worker's late `Transferring` (3) overwrote an abort's `Failed`
 * (0); the abort had already dropped the room's transfer info, the worker skipped the room, and the
 * prefill inflight queue had no timeout: the request hung forever with every engine idle.
 *
 * Rules enforced here (see docs/LIFECYCLE.md):
 *  1. One transition function (`RoomTable.transition`); every state write goes through it.
 *  2. Terminal (Success, Failed) is sticky. Non-terminal states only move forward, one step at a
 *     time along the role's path; any non-terminal state may fail. Refused writes change nothing
 *     and emit `{t:'illegal'}`.
 *  3. Every phase has a deadline (`deadlineAt = now + timeout(phase)`); `tick(now)` fails every
 *     live room at or past it. Transfer deadlines restart on `progress`.
 *  4. `terminal` is emitted exactly once per room, when it becomes terminal: the one moment a
 *     driver releases the room's resources.
 *  5. Failures reach the peer (`notify_peer`) unless the peer caused them.
 *  6. Cancellations for rooms not seen yet leave a tombstone, so a late request fails at once.
 *
 * Idempotent inputs (return `[]`, no `illegal`): a cancellation (abort/fail/peer_lost) of a room
 * that is already terminal (the first outcome wins — a late client abort after Success is normal);
 * `progress` for a terminal room (bytes of a finished room are dropped; not a state write); a
 * duplicate `registered` from the same peer once the room is past bootstrap; a duplicate `kv_done`
 * on Success. `registered` on a Failed room answers with `notify_peer` (the registration is told
 * the room failed; it is never revived). Duplicates that would double-acquire a resource
 * (`slot_reserved`, `kv_begin`) are refused with `illegal`, so the driver releases the extra one.
 *
 * Benign races vs violations: a forward event (`slot_reserved`, `kv_begin`, `kv_done`) reaching a
 * room that already FAILED lost a race with that failure — decode's KV_ACK crossing a client
 * abort, a compute finishing after an abort. It is refused (the room stays Failed) and reported
 * as `{t:'late'}`, counted apart. `illegal` is kept for real protocol violations (an event out of
 * order on a live room, a double-acquire on Success), so an alert on it fires only on bugs.
 */
import { failure, failureText, type RoomFailure } from '../base/errors.js';
import {
  KVPoll,
  KvError,
  isTerminal,
  type Effect,
  type Phase,
  type Role,
  type Room,
  type RoomEvent,
  type RoomId,
  type RoomTimeouts,
  type TimelineEntry,
} from './types.js';

/** Name of a KVPoll value ('Failed', 'Bootstrapping', ...). */
export type StateName = 'Failed' | 'Bootstrapping' | 'WaitingForInput' | 'Transferring' | 'Success';

export const stateName = (s: KVPoll): StateName => KVPoll[s] as StateName;

/** Deadline length (ms) of a phase; `Infinity` for 'done'. */
export function phaseTimeout(phase: Phase, t: RoomTimeouts): number {
  switch (phase) {
    case 'prealloc':
      return t.preallocMs;
    case 'bootstrap':
      return t.bootstrapMs;
    case 'waiting':
    case 'local':
      return t.waitingMs;
    case 'inflight':
    case 'transfer':
      return t.transferIdleMs;
    case 'done':
      return Infinity;
  }
}

export interface RoomTableOptions {
  /**
   * TEST-ONLY. Reproduces SGLang's buggy status rule, for the simulator's proof that it wedges.
   * Forward writes become `max(old, new)` with no terminal stickiness and no source checks, so a
   * late `Transferring` (3) overwrites `Failed` (0) — the revival. Explicit failures (abort, fail,
   * peer_lost, a tombstone) still land on a non-terminal room, as in SGLang (`update_status`
   * lets Failed through; the abort handler pops the room and re-inserts Failed). The watchdog's
   * `deadline` write goes through max like any other write and is swallowed by every live room
   * (max(3, 0) = 3): the incident's inflight queue had no working timeout. No `illegal` effects
   * are emitted in this mode (the legacy code had none). Never enable it in a worker.
   */
  legacyMaxRule?: boolean;
  /** How long a tombstone lives, ms. Default 60_000. */
  tombstoneTtlMs?: number;
  /** Most tombstones kept; the oldest is evicted first. Default 10_000. */
  tombstoneMax?: number;
  /** Most recent terminal rooms kept for /debug/rooms. Default 200. */
  historyMax?: number;
  /** Most timeline entries per room (the first, 'create', is always kept). Default 32. */
  timelineMax?: number;
}

/** A cancellation that arrived for a room before (or after) its record. */
export interface Tombstone {
  /** The failure a late room gets. */
  failure: RoomFailure;
  /** When it was written (ms). Expires at `at + tombstoneTtlMs`. */
  at: number;
  /** The cancellation came from the peer itself (abort from 'peer', peer_lost): do not echo it back. */
  fromPeer: boolean;
}

/** Cumulative counters (monotonic over the table's life). */
export interface RoomTableStats {
  created: number;
  success: number;
  failed: number;
  /** Refused writes that are real protocol violations (`illegal` effects). */
  illegal: number;
  /** Forward events that reached an already Failed room: benign races (`late` effects). */
  late: number;
  /** Rooms failed by their deadline (`expired` effects). */
  expired: number;
  /** Tombstones written for rooms not seen yet. */
  tombstoned: number;
  /** Tombstones evicted because `tombstoneMax` was reached. */
  tombstonesEvicted: number;
  /** Non-cancel events for rooms this table does not know (returned []). */
  unknownEvents: number;
  /** Legacy mode only: writes swallowed by max(old, new). */
  swallowed: number;
}

/** One room as shown by GET /debug/rooms. */
export interface RoomView {
  room: RoomId;
  rid: string;
  role: Role;
  state: StateName;
  state_code: KVPoll;
  phase: Phase;
  age_ms: number;
  /** Remaining ms until the phase deadline (negative: overdue); null when terminal. */
  deadline_ms: number | null;
  peer: string | null;
  peer_epoch: string | null;
  bytes: number;
  total_bytes: number | null;
  /** "code: detail" of the room's failure. */
  fail_reason: string | null;
  /** Stable error code of the room's failure (base/errors.ts). */
  fail_code: string | null;
  timeline: { at: number; state: StateName; phase: Phase; why: string }[];
}

/** JSON-able body of GET /debug/rooms. */
export interface RoomsSnapshot {
  role: Role;
  now: number;
  legacy_max_rule: boolean;
  counts: Record<StateName, number>;
  tombstones: number;
  stats: RoomTableStats;
  /** Live (non-terminal) rooms, oldest first. */
  live: RoomView[];
  /** Recent terminal rooms, newest first. */
  recent: RoomView[];
}

/** Internal causes: the public events plus the watchdog and a tombstone replayed at create. */
type Cause = RoomEvent | { t: 'deadline' } | { t: 'tombstone'; failure: RoomFailure; fromPeer: boolean };

type Plan =
  /** Nothing to do, nothing to report. */
  | { k: 'noop'; swallowed?: boolean }
  /** Refused write: a real protocol violation. */
  | { k: 'refuse'; to: KVPoll; why: string }
  /** Refused write: a forward event that lost a benign race with the room's failure. */
  | { k: 'late' }
  /** Transfer progress: add bytes, restart the transfer deadline. */
  | { k: 'progress'; bytes: number }
  /** Reply without writing (registration of a failed room). */
  | { k: 'answer'; effects: Effect[] }
  /** The one kind of state write. */
  | { k: 'write'; to: KVPoll; phase: Phase; why: string; failure?: RoomFailure; fromPeer?: boolean };

const FAILURE_CAUSES = new Set(['abort', 'fail', 'peer_lost', 'deadline', 'tombstone']);

/**
 * The failure a cause leaves in `room.failure` (and in `terminal`/`notify_peer`): the event's own
 * `{code, detail}`, verbatim; `room_deadline_expired` with detail `deadline:<phase>` for the
 * watchdog. Codes come from the one table in base/errors.ts; nobody parses the detail.
 */
function failureOf(c: Cause, phase: Phase): RoomFailure {
  switch (c.t) {
    case 'abort':
    case 'fail':
    case 'peer_lost':
    case 'tombstone':
      return c.failure;
    case 'deadline':
      return failure('room_deadline_expired', `deadline:${phase}`);
    default:
      return failure('internal_error', c.t);
  }
}

/** Short label of a cause for timelines ('abort:router', 'deadline:waiting', ...). */
function why(c: Cause, phase: Phase): string {
  switch (c.t) {
    case 'abort':
      return `abort:${c.from}`;
    case 'deadline':
      return `deadline:${phase}`;
    case 'tombstone':
      return 'tombstone';
    default:
      return c.t;
  }
}

const fromPeer = (c: Cause): boolean =>
  (c.t === 'abort' && c.from === 'peer') || c.t === 'peer_lost' || (c.t === 'tombstone' && c.fromPeer);

/**
 * The rooms of one worker role. Not thread-safe by design: JS is single-threaded, and each call
 * is atomic with respect to the others — the races this guards against are between *awaits* in
 * the drivers, which all funnel through `apply`.
 */
export class RoomTable {
  readonly role: Role;
  readonly legacyMaxRule: boolean;
  private readonly timeouts: RoomTimeouts;
  private readonly tombstoneTtlMs: number;
  private readonly tombstoneMax: number;
  private readonly historyMax: number;
  private readonly timelineMax: number;
  /** Non-terminal rooms (insertion order = creation order). */
  private readonly live = new Map<RoomId, Room>();
  /** Recent terminal rooms (insertion order = terminal order), bounded by historyMax. */
  private readonly history = new Map<RoomId, Room>();
  /** Insertion order = age order (entries are never refreshed: first reason wins). */
  private readonly tombstones = new Map<RoomId, Tombstone>();
  private readonly counters: RoomTableStats = {
    created: 0,
    success: 0,
    failed: 0,
    illegal: 0,
    late: 0,
    expired: 0,
    tombstoned: 0,
    tombstonesEvicted: 0,
    unknownEvents: 0,
    swallowed: 0,
  };

  constructor(role: Role, timeouts: RoomTimeouts, opts: RoomTableOptions = {}) {
    this.role = role;
    this.timeouts = { ...timeouts };
    this.legacyMaxRule = opts.legacyMaxRule ?? false;
    this.tombstoneTtlMs = opts.tombstoneTtlMs ?? 60_000;
    this.tombstoneMax = Math.max(1, opts.tombstoneMax ?? 10_000);
    this.historyMax = Math.max(0, opts.historyMax ?? 200);
    this.timelineMax = Math.max(2, opts.timelineMax ?? 32);
  }

  // ---- inputs ---------------------------------------------------------------------------------

  /**
   * Register a new room. prefill: Bootstrapping/'bootstrap' (waiting for decode's REGISTER);
   * decode: Bootstrapping/'prealloc' (waiting for a slot). `peer` is decode's view of prefill's
   * bootstrap address (prefill learns its peer at `registered`).
   *
   * If a cancellation already arrived for this id (tombstone) or a room with this id already
   * failed, the room is created and failed at once: the effects are `[notify_peer?, terminal]`.
   * @throws KvError('DUPLICATE_ROOM') when a live room with this id exists.
   */
  create(id: RoomId, rid: string, now: number, peer?: string): Effect[] {
    if (this.live.has(id)) throw new KvError('DUPLICATE_ROOM', `room ${id} already exists (rid ${this.live.get(id)!.rid})`);
    const phase: Phase = this.role === 'prefill' ? 'bootstrap' : 'prealloc';
    const room: Room = {
      id,
      rid,
      role: this.role,
      state: KVPoll.Bootstrapping,
      phase,
      createdAt: now,
      deadlineAt: now + phaseTimeout(phase, this.timeouts),
      peer,
      bytes: 0,
      timeline: [{ at: now, state: KVPoll.Bootstrapping, phase, why: 'create' }],
    };
    this.counters.created++;
    this.live.set(id, room);
    const prior = this.priorFailure(id);
    if (prior) return this.transition(room, { t: 'tombstone', failure: prior.failure, fromPeer: prior.fromPeer }, now);
    return [];
  }

  /**
   * Feed one event for room `id`. Returns the effects to perform, in order.
   *
   * Unknown ids: abort/fail/peer_lost leave a tombstone and return []; `registered` for a
   * tombstoned id answers `notify_peer` (to `event.peer`) with the tombstone's reason; any other
   * event returns [] and counts `stats.unknownEvents` — the driver decides (prefill buffers a
   * REGISTER that beat the router's request; check `get(id)` / `isTombstoned(id)` first).
   */
  apply(id: RoomId, event: RoomEvent, now: number): Effect[] {
    const room = this.live.get(id) ?? this.history.get(id);
    if (room) return this.transition(room, event, now);
    if (event.t === 'abort' || event.t === 'fail' || event.t === 'peer_lost') {
      if (!this.tombstones.has(id)) {
        this.counters.tombstoned++;
        this.addTombstone(id, failureOf(event, 'done'), fromPeer(event), now);
      }
      return [];
    }
    const ts = this.tombstones.get(id);
    if (event.t === 'registered' && ts) {
      return event.peer ? [{ t: 'notify_peer', room: id, peer: event.peer, failure: ts.failure }] : [];
    }
    this.counters.unknownEvents++;
    return [];
  }

  /**
   * The watchdog: fail every live room whose phase deadline is at or before `now`, with reason
   * `room_deadline_expired` (`deadline:<phase>`); effects per room `expired` (state/phase at expiry, timeline) then
   * `notify_peer` (when it has a peer) then `terminal`. Also drops expired tombstones.
   * Call it periodically (the workers: every watchdog interval; the simulator: every tick).
   */
  tick(now: number): Effect[] {
    const out: Effect[] = [];
    for (const room of this.live.values()) {
      if (now >= room.deadlineAt) out.push(...this.transition(room, { t: 'deadline' }, now));
    }
    for (const [id, ts] of this.tombstones) {
      if (ts.at + this.tombstoneTtlMs > now) break;
      this.tombstones.delete(id);
    }
    return out;
  }

  /** `peer_lost` for every live room bound to `peer` (connection closed or silent). */
  failPeer(peer: string, f: RoomFailure, now: number): Effect[] {
    const out: Effect[] = [];
    for (const room of [...this.live.values()]) {
      if (room.peer === peer) out.push(...this.transition(room, { t: 'peer_lost', failure: f }, now));
    }
    return out;
  }

  // ---- queries --------------------------------------------------------------------------------

  /** Live (non-terminal) rooms, oldest first. The objects are the table's own: do not mutate. */
  rooms(): Room[] {
    return [...this.live.values()];
  }

  /** Recent terminal rooms, newest first (at most historyMax). */
  recent(): Room[] {
    return [...this.history.values()].reverse();
  }

  /** A live room, else a recent terminal one. */
  get(id: RoomId): Room | undefined {
    return this.live.get(id) ?? this.history.get(id);
  }

  /** Whether a live (non-terminal) room with this id exists. */
  has(id: RoomId): boolean {
    return this.live.has(id);
  }

  /** Whether a cancellation for this id is remembered (room failed, or abort before create). */
  isTombstoned(id: RoomId): boolean {
    return this.tombstones.has(id);
  }

  tombstone(id: RoomId): Tombstone | undefined {
    const t = this.tombstones.get(id);
    return t ? { ...t } : undefined;
  }

  /** Earliest deadline among live rooms (ms), Infinity when none: lets a driver sleep until then. */
  nextDeadline(): number {
    let min = Infinity;
    for (const r of this.live.values()) if (r.deadlineAt < min) min = r.deadlineAt;
    return min;
  }

  /** Rooms per state: live rooms plus the recent terminal ones still in history. */
  countsByState(): Record<StateName, number> {
    const c: Record<StateName, number> = { Failed: 0, Bootstrapping: 0, WaitingForInput: 0, Transferring: 0, Success: 0 };
    for (const r of this.live.values()) c[stateName(r.state)]++;
    for (const r of this.history.values()) c[stateName(r.state)]++;
    return c;
  }

  get stats(): Readonly<RoomTableStats> {
    return { ...this.counters };
  }

  /**
   * JSON-able state for GET /debug/rooms at instant `now` (the table's clock). Ages and
   * `deadline_ms` are differences on that clock; `wallNow`, the wall-clock date of `now` (ms since
   * the epoch), turns `now` and every timeline `at` into dates for people and for joining the
   * timelines of several processes (default: `now` itself, for a table already on wall time).
   */
  snapshot(now: number, wallNow: number = now): RoomsSnapshot {
    const toWall = (t: number): number => Math.round(t - now + wallNow);
    return {
      role: this.role,
      now: toWall(now),
      legacy_max_rule: this.legacyMaxRule,
      counts: this.countsByState(),
      tombstones: this.tombstones.size,
      stats: this.stats,
      live: this.rooms().map((r) => view(r, now, toWall)),
      recent: this.recent().map((r) => view(r, now, toWall)),
    };
  }

  // ---- the transition function ------------------------------------------------------------------

  /**
   * THE transition function: decides (`plan`) and writes (`commit`). Every state change of every
   * room — create's tombstone replay, apply, tick's deadlines, failPeer — goes through here.
   */
  private transition(room: Room, cause: Cause, now: number): Effect[] {
    const plan = this.legacyMaxRule ? this.planLegacy(room, cause) : this.plan(room, cause);
    switch (plan.k) {
      case 'noop':
        if (plan.swallowed) this.counters.swallowed++;
        return [];
      case 'answer':
        return plan.effects;
      case 'refuse':
        this.counters.illegal++;
        return [{ t: 'illegal', room: room.id, from: room.state, to: plan.to, why: plan.why }];
      case 'late':
        this.counters.late++;
        return [{ t: 'late', room: room.id, event: cause.t as RoomEvent['t'], state: room.state }];
      case 'progress':
        room.bytes += plan.bytes;
        room.deadlineAt = now + phaseTimeout(room.phase, this.timeouts);
        return [];
      case 'write':
        return this.commit(room, plan, cause, now);
    }
  }

  /** The real rule. Pure: reads the room, returns what to do. */
  private plan(room: Room, c: Cause): Plan {
    const s = room.state;
    const terminal = isTerminal(s);
    if (FAILURE_CAUSES.has(c.t)) {
      if (terminal) return { k: 'noop' };
      return { k: 'write', to: KVPoll.Failed, phase: 'done', why: why(c, room.phase), failure: failureOf(c, room.phase), fromPeer: fromPeer(c) };
    }
    // A forward event on a Failed room lost a race with the failure (an ack or a completion in
    // flight when the abort landed): refused, but benign — counted as `late`, not `illegal`.
    // (`registered` is answered below; `progress` is a no-op.)
    if (s === KVPoll.Failed && (c.t === 'slot_reserved' || c.t === 'local_prefill' || c.t === 'kv_begin' || c.t === 'kv_done')) return { k: 'late' };
    // A decode-local room (no peer) never registers and never receives KV: only its own
    // `kv_done` (suffix evaluated) moves it on; anything of the PD path is refused.
    if (room.phase === 'local' && c.t !== 'kv_done') return { k: 'refuse', to: s, why: `${c.t} refused on a decode-local room` };
    const refuse = (to: KVPoll): Plan => ({ k: 'refuse', to, why: `${c.t} refused in ${stateName(s)}/${room.phase}` });
    switch (c.t) {
      case 'slot_reserved':
        if (this.role !== 'decode') return { k: 'refuse', to: KVPoll.Bootstrapping, why: 'slot_reserved on a prefill room' };
        if (s === KVPoll.Bootstrapping && room.phase === 'prealloc') {
          if (!room.peer) return { k: 'write', to: KVPoll.Failed, phase: 'done', why: 'no_peer', failure: failure('peer_unreachable', 'decode room has no peer to register with') };
          return { k: 'write', to: KVPoll.Bootstrapping, phase: 'bootstrap', why: 'slot_reserved' };
        }
        return refuse(KVPoll.Bootstrapping);
      case 'local_prefill':
        if (this.role !== 'decode') return { k: 'refuse', to: KVPoll.WaitingForInput, why: 'local_prefill on a prefill room' };
        if (room.peer) return { k: 'refuse', to: KVPoll.WaitingForInput, why: 'local_prefill on a room with a prefill peer' };
        if (s === KVPoll.Bootstrapping && room.phase === 'prealloc') return { k: 'write', to: KVPoll.WaitingForInput, phase: 'local', why: 'local_prefill' };
        return refuse(KVPoll.WaitingForInput);
      case 'registered': {
        if (s === KVPoll.Failed) {
          const peer = c.peer ?? room.peer;
          return { k: 'answer', effects: peer ? [{ t: 'notify_peer', room: room.id, peer, failure: room.failure ?? failure('internal_error', 'failed') }] : [] };
        }
        if (s === KVPoll.Success) return { k: 'noop' };
        if (s === KVPoll.Bootstrapping && room.phase !== 'bootstrap') return refuse(KVPoll.WaitingForInput); // decode prealloc: no slot, never registered
        if ((c.peer !== undefined && room.peer !== undefined && c.peer !== room.peer) || (c.peerEpoch !== undefined && room.peerEpoch !== undefined && c.peerEpoch !== room.peerEpoch)) {
          return { k: 'refuse', to: KVPoll.WaitingForInput, why: `registered by another peer (${c.peer ?? '?'}/${c.peerEpoch ?? '?'}) than ${room.peer}/${room.peerEpoch ?? '?'}` };
        }
        if (s === KVPoll.Bootstrapping) return { k: 'write', to: KVPoll.WaitingForInput, phase: 'waiting', why: 'registered' };
        return { k: 'noop' }; // duplicate registration from the same peer
      }
      case 'kv_begin':
        if (s === KVPoll.WaitingForInput) return { k: 'write', to: KVPoll.Transferring, phase: this.role === 'prefill' ? 'inflight' : 'transfer', why: 'kv_begin' };
        return refuse(KVPoll.Transferring);
      case 'progress':
        if (terminal) return { k: 'noop' };
        if (s === KVPoll.Transferring) return { k: 'progress', bytes: c.bytes };
        return refuse(KVPoll.Transferring);
      case 'kv_done':
        if (s === KVPoll.Success) return { k: 'noop' };
        if (s === KVPoll.Transferring) return { k: 'write', to: KVPoll.Success, phase: 'done', why: 'kv_done' };
        if (s === KVPoll.WaitingForInput && room.phase === 'local') return { k: 'write', to: KVPoll.Success, phase: 'done', why: 'kv_done (local)' };
        return refuse(KVPoll.Success);
      default:
        return refuse(s);
    }
  }

  /**
   * TEST-ONLY legacy rule (SGLang's old `update_status`): forward writes new = max(old, target),
   * no terminal stickiness, no source checks; explicit failures land on a non-terminal room;
   * the watchdog's Failed write goes through max and is swallowed.
   */
  private planLegacy(room: Room, c: Cause): Plan {
    const s = room.state;
    if (c.t === 'progress') return s === KVPoll.Transferring ? { k: 'progress', bytes: c.bytes } : { k: 'noop' };
    if (FAILURE_CAUSES.has(c.t)) {
      const lands = c.t !== 'deadline' && !isTerminal(s);
      if (!lands) return { k: 'noop', swallowed: c.t === 'deadline' && s !== KVPoll.Failed };
      return { k: 'write', to: KVPoll.Failed, phase: 'done', why: why(c, room.phase), failure: failureOf(c, room.phase), fromPeer: fromPeer(c) };
    }
    let target: { to: KVPoll; phase: Phase };
    switch (c.t) {
      case 'slot_reserved':
        target = { to: KVPoll.Bootstrapping, phase: 'bootstrap' };
        break;
      case 'local_prefill':
        target = { to: KVPoll.WaitingForInput, phase: 'local' };
        break;
      case 'registered':
        target = { to: KVPoll.WaitingForInput, phase: 'waiting' };
        break;
      case 'kv_begin':
        target = { to: KVPoll.Transferring, phase: this.role === 'prefill' ? 'inflight' : 'transfer' };
        break;
      case 'kv_done':
        target = { to: KVPoll.Success, phase: 'done' };
        break;
      default:
        return { k: 'noop' };
    }
    const to = Math.max(s, target.to) as KVPoll;
    if (to === s && !(c.t === 'slot_reserved' && room.phase === 'prealloc')) return { k: 'noop', swallowed: true };
    return { k: 'write', to, phase: to === target.to ? target.phase : room.phase, why: `${c.t}${isTerminal(s) ? ' (legacy max rule: overwrote a terminal state)' : ''}` };
  }

  /** The single writer of `room.state`/`room.phase`/`room.deadlineAt`. */
  private commit(room: Room, p: Extract<Plan, { k: 'write' }>, cause: Cause, now: number): Effect[] {
    const from = room.state;
    const fromPhase = room.phase;
    const wasTerminal = isTerminal(from);
    if (cause.t === 'registered') {
      // Bind, never rebind: a decode room keeps the prefill address it was created with.
      if (cause.peer !== undefined && room.peer === undefined) room.peer = cause.peer;
      if (cause.peerEpoch !== undefined && room.peerEpoch === undefined) room.peerEpoch = cause.peerEpoch;
    }
    if (cause.t === 'kv_begin') room.totalBytes = cause.totalBytes;
    room.state = p.to;
    room.phase = p.phase;
    room.deadlineAt = now + phaseTimeout(p.phase, this.timeouts);
    if (p.to === KVPoll.Failed && room.failure === undefined) room.failure = p.failure;
    this.pushTimeline(room, { at: now, state: p.to, phase: p.phase, why: p.why });

    const out: Effect[] = [];
    if (cause.t === 'deadline') {
      this.counters.expired++;
      out.push({ t: 'expired', room: room.id, state: from, phase: fromPhase, timeline: room.timeline.map((e) => ({ ...e })) });
    }
    if (p.to === KVPoll.Failed) {
      if (room.peer && !p.fromPeer) out.push({ t: 'notify_peer', room: room.id, peer: room.peer, failure: room.failure ?? failure('internal_error', p.why) });
    } else if (p.to === KVPoll.Bootstrapping && p.phase === 'bootstrap') {
      out.push({ t: 'send_register', room: room.id, peer: room.peer ?? '' });
    } else if (p.to === KVPoll.WaitingForInput && this.role === 'prefill') {
      out.push({ t: 'start_prefill', room: room.id });
    } else if (p.to === KVPoll.WaitingForInput && p.phase === 'local') {
      out.push({ t: 'start_local_prefill', room: room.id });
    } else if (p.to === KVPoll.Success && this.role === 'decode' && room.peer) {
      out.push({ t: 'send_ack', room: room.id, peer: room.peer });
    }

    const nowTerminal = isTerminal(p.to);
    if (nowTerminal && (!wasTerminal || from !== p.to)) {
      if (p.to === KVPoll.Success) this.counters.success++;
      else this.counters.failed++;
      out.push(
        p.to === KVPoll.Success
          ? { t: 'terminal', room: room.id, state: KVPoll.Success }
          : { t: 'terminal', room: room.id, state: KVPoll.Failed, failure: room.failure ?? failure('internal_error', p.why) },
      );
    }
    if (nowTerminal && this.live.get(room.id) === room) {
      this.live.delete(room.id);
      this.history.delete(room.id);
      this.history.set(room.id, room);
      while (this.history.size > this.historyMax) this.history.delete(this.history.keys().next().value as RoomId);
      if (p.to === KVPoll.Failed && !this.tombstones.has(room.id)) this.addTombstone(room.id, room.failure ?? failure('internal_error', p.why), !!p.fromPeer, now);
    } else if (!nowTerminal && this.history.get(room.id) === room) {
      // Only reachable with legacyMaxRule: the revival the real rule forbids.
      this.history.delete(room.id);
      this.live.set(room.id, room);
    }
    return out;
  }

  // ---- helpers ----------------------------------------------------------------------------------

  /** A reason this id must not run: a tombstone, or a Failed record in history. */
  private priorFailure(id: RoomId): Tombstone | undefined {
    const ts = this.tombstones.get(id);
    if (ts) return ts;
    const old = this.history.get(id);
    if (old && old.state === KVPoll.Failed) return { failure: old.failure ?? failure('internal_error', 'failed'), at: old.createdAt, fromPeer: false };
    return undefined;
  }

  private addTombstone(id: RoomId, f: RoomFailure, fromPeerFlag: boolean, now: number): void {
    while (this.tombstones.size >= this.tombstoneMax) {
      this.tombstones.delete(this.tombstones.keys().next().value as RoomId);
      this.counters.tombstonesEvicted++;
    }
    this.tombstones.set(id, { failure: f, at: now, fromPeer: fromPeerFlag });
  }

  private pushTimeline(room: Room, e: TimelineEntry): void {
    room.timeline.push(e);
    if (room.timeline.length > this.timelineMax) room.timeline.splice(1, room.timeline.length - this.timelineMax);
  }
}

function view(r: Room, now: number, toWall: (t: number) => number): RoomView {
  return {
    room: r.id,
    rid: r.rid,
    role: r.role,
    state: stateName(r.state),
    state_code: r.state,
    phase: r.phase,
    age_ms: Math.round(now - r.createdAt),
    deadline_ms: Number.isFinite(r.deadlineAt) ? Math.round(r.deadlineAt - now) : null,
    peer: r.peer ?? null,
    peer_epoch: r.peerEpoch ?? null,
    bytes: r.bytes,
    total_bytes: r.totalBytes ?? null,
    fail_reason: r.failure ? failureText(r.failure) : null,
    fail_code: r.failure?.code ?? null,
    timeline: r.timeline.map((e) => ({ at: toWall(e.at), state: stateName(e.state), phase: e.phase, why: e.why })),
  };
}
