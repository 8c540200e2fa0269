/**
 * The prefill driver, sans-IO: every decision the prefill worker makes about a room — admission,
 * pending registrations, when to answer REGISTERED or FAIL, the waiting queue and its compute
 * slots, what happens when a compute finishes after the room failed, the inflight queue — and
 * nothing else. No sockets, no timers, no engine, no `Date.now()`: inputs are method calls with
 * `now` (ms), outputs are `PrefillAction`s the caller performs in order.
 *
 * Two callers run this same code, as TigerBeetle runs its real replica under its simulator:
 * the worker (`src/prefill/worker.ts`, a thin shell over HTTP, the KV channel and llama.cpp) and
 * the deterministic simulator (`src/sim/`), over simulated network, engine and time.
 *
 * Ports: the engine is reached through `compute` actions answered by `computeDone`; the channel
 * through `send` / `transfer` actions answered by `progress`, `transferSent`, `transferFailed`;
 * the clock through the `now` argument. Peers are opaque ids (the worker: a connection id).
 *
 * Computations (n > 1: one prefill, n decode sequences from the same state): one request may
 * name several rooms (`request([r0, r1, …])`). Each room keeps its own lifecycle (registration,
 * deadlines, transfer, ack, abort) and its own `finish`; the prompt is computed ONCE for all of
 * them — when the first room is registered (decode backpressure: at least one decode holds a
 * slot) — and its one saved state is offered to each room as soon as that room is registered and
 * the state exists. The state is reference-counted: every live room holds a reference until its
 * send is over (`transferSent`) or it is terminal; `discard` is emitted exactly once, when the
 * last reference goes (or when the compute finishes with no reference left), and `cancel` stops a
 * running compute whose rooms are all terminal. A computation is named by its first room (the
 * lead). A request with one room is a computation of one room: the behaviour of a single request
 * is unchanged.
 */
import { ApiError, failure, type RoomFailure } from '../base/errors.js';
import type { RoomId } from '../base/room-id.js';
import { RoomTable } from '../kv/lifecycle.js';
import type { KvPath } from '../kv/transfer/same-host.js';
import { failureFromWire, type ControlMsg, type RoomMsg } from '../kv/messages.js';
import { KVPoll, type Effect, type RoomEvent, type RoomTimeouts } from '../kv/types.js';

/** An opaque peer (decode connection) id. */
export type PeerId = string;

/** What the prefill worker is doing for a room (shown in /debug/rooms). */
export type PrefillStep = 'bootstrap' | 'queued' | 'computing' | 'sending' | 'awaiting_ack';

export interface PrefillDriverConfig {
  /** Decode-side deadlines; prefill's bootstrap deadline is `preallocMs + bootstrapMs` (decode registers only once it holds a slot). */
  timeouts: RoomTimeouts;
  /** Bound on live rooms (and on pending registrations). */
  maxRooms: number;
  /** Bound on rooms waiting for a compute slot. */
  maxWaiting: number;
  /** Prompts evaluated at once (the engine's sequences). */
  slots: number;
  /** TEST-ONLY: SGLang's max(old, new) status rule (simulator proof of the wedge). */
  legacyMaxRule?: boolean;
  /**
   * TEST-ONLY fault injection (PDSERVE_FAULT_LEAK_ROOM=1): the first room to get decode's
   * kv_ack is leaked — that ack and every later event for it except `progress` are dropped, and
   * each tick feeds it a zero-byte `progress` (a zombie sender), so it stays in the inflight queue
   * without passing its deadline. Lets the storm test prove its leak check fails. Never in production.
   */
  faultLeakFirstAck?: boolean;
}

/** Outputs, performed in order by the caller. */
export type PrefillAction =
  /** Send a control message to a decode peer. */
  | { a: 'send'; peer: PeerId; msg: ControlMsg }
  /** Start prompt evaluation of the computation led by `room` (a compute slot is reserved for it); answer with `computeDone(room, …)`. */
  | { a: 'compute'; room: RoomId }
  /**
   * The room's state is ready and accepted (Transferring): hand it to `peer` by `path` —
   * `same_host` (a kv_file naming a link to the saved file: the peer proved it shares this host
   * and state directory, `sameHostConfirmed`) or `tcp` (kv_begin, the chunks, kv_end; also a
   * room whose kv_file decode refused, `fileRefused`).
   */
  | { a: 'transfer'; room: RoomId; peer: PeerId; path: KvPath }
  /** The computed state of the computation led by `room` is wanted by no room any more: drop it. Once per computed state. */
  | { a: 'discard'; room: RoomId }
  /** Every room of the computation led by `room` is terminal while its compute runs: stop it (it still answers `computeDone`). */
  | { a: 'cancel'; room: RoomId }
  /** The room is terminal: stop its compute/transfer, answer its request, release its resources. Once per room. */
  /** `bytes`: the room's transfer size in wire bytes (`roomWireBytes`), taken when it became terminal. */
  | { a: 'finish'; room: RoomId; rid: string; state: KVPoll.Success | KVPoll.Failed; failure?: RoomFailure; registered: boolean; bytes: number }
  /** A diagnostic effect of the core (illegal, late, expired): count and log. */
  | { a: 'diag'; effect: Effect }
  /** A pending registration expired without a request: count it. */
  | { a: 'registration_expired'; room: RoomId }
  /** TEST-ONLY fault injection happened (see faultLeakFirstAck). */
  | { a: 'fault_leak'; room: RoomId };

/**
 * Wire bytes of a room's transfer: the bytes that reached the socket (a streamed send's true size),
 * else the size announced at `kv_begin` (a same-host handoff moves none); 0 before any transfer.
 */
function roomWireBytes(room: { bytes: number; totalBytes?: number | null } | undefined): number {
  return room ? room.bytes || (room.totalBytes ?? 0) : 0;
}

interface Job {
  rid: string;
  peer?: PeerId;
  step: PrefillStep;
  /** How the state went to the peer (set by the room's `transfer`). */
  path?: KvPath;
  /** The computation's lead room. */
  comp: RoomId;
}

/** One prompt computation shared by the rooms of one request (see the module doc). */
interface Comp {
  lead: RoomId;
  rooms: RoomId[];
  rid: string;
  phase: 'idle' | 'queued' | 'computing' | 'ready';
  /** Rooms that still need the state: live and not done sending. */
  refs: Set<RoomId>;
  /** Rooms registered while the compute was queued or running: offered the state at computeDone. */
  offered: Set<RoomId>;
  /** Wire bytes of each room's transfer (its envelope head differs: its own first token). */
  bytes?: Map<RoomId, number>;
  cancelled: boolean;
}

/**
 * Outcome of a compute (prompt evaluated, state saved and enveloped), from the engine port.
 * `totalBytes`: wire bytes of each room's transfer; `roomBytes` overrides it per room (rooms of
 * one computation have their own envelope head).
 */
export type ComputeOutcome = { ok: true; totalBytes: number; roomBytes?: ReadonlyMap<RoomId, number> } | { ok: false; aborted: true } | { ok: false; aborted?: false; failure: RoomFailure };

export class PrefillDriver {
  readonly rooms: RoomTable;
  private readonly jobs = new Map<RoomId, Job>();
  /** rid → lead room of its computation. */
  private readonly byRid = new Map<string, RoomId>();
  /** Computations by lead room, from the request until their state is released. */
  private readonly comps = new Map<RoomId, Comp>();
  /** Rooms registered by decode before the request arrived here. Bounded (maxRooms), expire after the decode bootstrap deadline. */
  private readonly pendingRegs = new Map<RoomId, { peer: PeerId; peerEpoch: string; at: number }>();
  /** Decode peers confirmed on this host (`sameHostConfirmed`): their rooms get `transfer` path same_host. */
  private readonly sameHostPeers = new Set<PeerId>();
  /** FIFO of computations (lead rooms) waiting for a compute slot. */
  private readonly waiting = new Set<RoomId>();
  private computing = 0;
  private leaked: RoomId | undefined;
  private leakArmed: boolean;

  constructor(
    readonly config: PrefillDriverConfig,
    /** This worker's epoch, stamped on every `fail` it sends. */
    readonly epoch: string,
  ) {
    const t = config.timeouts;
    this.rooms = new RoomTable('prefill', { ...t, bootstrapMs: t.preallocMs + t.bootstrapMs }, { legacyMaxRule: config.legacyMaxRule });
    this.leakArmed = config.faultLeakFirstAck ?? false;
  }

  // ---- queries ---------------------------------------------------------------------------------

  /** Queue name → entries, derived from room phases (cannot drift). */
  queueSizes(): Record<string, number> {
    let bootstrap = 0;
    let inflight = 0;
    let waiting = 0;
    for (const r of this.rooms.rooms()) {
      if (r.phase === 'bootstrap') bootstrap++;
      else if (r.phase === 'waiting') waiting++;
      else if (r.phase === 'inflight') inflight++;
    }
    return { prefill_bootstrap_queue: bootstrap, prefill_waiting_queue: waiting, prefill_inflight_queue: inflight };
  }

  step(room: RoomId): PrefillStep | null {
    return this.jobs.get(room)?.step ?? null;
  }

  /** The decode connection that registered `room`, while the room is live (undefined before its `register`). */
  peerOf(room: RoomId): PeerId | undefined {
    return this.jobs.get(room)?.peer;
  }

  /** The lead room of `room`'s computation (itself for a single-room request), while the room is live. */
  leadOf(room: RoomId): RoomId | undefined {
    return this.jobs.get(room)?.comp;
  }

  /** Computations whose state is not released yet (for tests and /debug). */
  get computations(): number {
    return this.comps.size;
  }

  /** Lead rooms of the computations whose prompt is not evaluated yet (queued for a compute slot or computing). */
  pendingComputations(): RoomId[] {
    const out: RoomId[] = [];
    for (const c of this.comps.values()) if (c.phase === 'queued' || c.phase === 'computing' || c.phase === 'idle') out.push(c.lead);
    return out;
  }

  get pendingRegistrations(): number {
    return this.pendingRegs.size;
  }

  /** Live requests (rooms with a job). */
  get live(): number {
    return this.jobs.size;
  }

  // ---- inputs ----------------------------------------------------------------------------------

  /**
   * A request (POST /generate) for `room` — or for several rooms sharing one computation (n > 1;
   * the first is the lead) — already parsed and tokenized. Refuses (400 duplicate_rid, 409
   * duplicate_room, 503 queue_full) without creating anything, else creates the rooms and
   * consumes their early registrations.
   */
  request(room: RoomId | readonly RoomId[], rid: string, now: number): { refused: ApiError } | { refused?: undefined; actions: PrefillAction[] } {
    const rooms = typeof room === 'string' ? [room] : [...room];
    if (rooms.length === 0 || new Set(rooms).size !== rooms.length) return { refused: ApiError.of('invalid_request', 'bootstrap_rooms must name distinct rooms', 'bootstrap_rooms') };
    for (const r of rooms) if (this.rooms.has(r)) return { refused: ApiError.of('duplicate_room', `room ${r} already exists (rid ${this.rooms.get(r)!.rid})`) };
    const other = this.byRid.get(rid);
    if (other !== undefined && this.comps.get(other)?.rooms.some((r) => this.jobs.has(r))) return { refused: ApiError.of('duplicate_rid', `request id ${rid} is already running on this worker (room ${other})`, 'rid') };
    if (this.jobs.size + rooms.length > this.config.maxRooms) return { refused: ApiError.of('queue_full', `prefill worker has ${this.jobs.size} live rooms (limit ${this.config.maxRooms})`) };
    if (this.waiting.size >= this.config.maxWaiting) return { refused: ApiError.of('queue_full', `prefill waiting queue is full (${this.config.maxWaiting})`) };
    const lead = rooms[0]!;
    const comp: Comp = { lead, rooms, rid, phase: 'idle', refs: new Set(), offered: new Set(), cancelled: false };
    this.comps.set(lead, comp);
    this.byRid.set(rid, lead);
    const out: PrefillAction[] = [];
    for (const r of rooms) {
      const effects = this.rooms.create(r, rid, now);
      this.jobs.set(r, { rid, step: 'bootstrap', comp: lead });
      comp.refs.add(r);
      out.push(...this.run(effects, now));
    }
    for (const r of rooms) {
      const pending = this.pendingRegs.get(r);
      if (pending) {
        this.pendingRegs.delete(r);
        out.push(...this.register(pending.peer, pending.peerEpoch, r, now));
      }
    }
    return { actions: out };
  }

  /** Abort by room id and/or rid (router's /abort_request, client gone). Unknown ids leave a tombstone. */
  abort(rid: string | undefined, room: RoomId | undefined, from: 'router' | 'local', now: number): PrefillAction[] {
    const f = from === 'local' ? failure('shutting_down', 'aborted locally') : failure('request_aborted', `abort_request from the ${from}`);
    if (room === undefined && rid !== undefined) {
      // By rid alone: every room of its computation.
      const lead = this.byRid.get(rid);
      const rooms = lead !== undefined ? (this.comps.get(lead)?.rooms ?? [lead]) : [];
      return rooms.flatMap((r) => (this.rooms.has(r) ? this.apply(r, { t: 'abort', from, failure: f }, now) : []));
    }
    const id = room;
    if (id === undefined) return [];
    this.pendingRegs.delete(id);
    if (!this.rooms.has(id) && this.rooms.get(id)) return [];
    return this.apply(id, { t: 'abort', from, failure: f }, now);
  }

  /** A room message from decode `peer` (epoch already checked by the channel). */
  message(peer: PeerId, peerEpoch: string, msg: RoomMsg, now: number): PrefillAction[] {
    switch (msg.type) {
      case 'register': {
        if (this.jobs.has(msg.room)) return this.register(peer, peerEpoch, msg.room, now);
        const known = this.rooms.get(msg.room);
        if (known || this.rooms.isTombstoned(msg.room)) {
          const f = known?.failure ?? this.rooms.tombstone(msg.room)?.failure ?? failure('registration_refused', `room already ${known ? KVPoll[known.state] : 'failed'}`);
          return [this.fail(peer, msg.room, f)];
        }
        if (this.pendingRegs.size >= this.config.maxRooms) return [this.fail(peer, msg.room, failure('registration_refused', `too many pending registrations (${this.config.maxRooms})`))];
        this.pendingRegs.set(msg.room, { peer, peerEpoch, at: now });
        return [];
      }
      case 'kv_ack':
        if (this.leakArmed && this.rooms.has(msg.room)) {
          this.leakArmed = false;
          this.leaked = msg.room;
          return [{ a: 'fault_leak', room: msg.room }];
        }
        return this.apply(msg.room, { t: 'kv_done' }, now);
      case 'fail':
        this.pendingRegs.delete(msg.room);
        return this.apply(msg.room, { t: 'abort', from: 'peer', failure: failureFromWire(msg, 'decode') }, now);
      default:
        return [];
    }
  }

  /** Decode `peer` proved it shares this host and state directory (the same-host probe): its rooms' states go as files from now on. */
  sameHostConfirmed(peer: PeerId): void {
    this.sameHostPeers.add(peer);
  }

  /** How a room of `peer` gets its state: `same_host` once the peer was confirmed, else `tcp`. */
  pathFor(peer: PeerId): KvPath {
    return this.sameHostPeers.has(peer) ? 'same_host' : 'tcp';
  }

  /**
   * Decode `peer` could not take room `room`'s handed file (KV_FILE_REFUSED): a live room sent by
   * file goes again over TCP (`transfer` path tcp); anything else (another peer, a room over or
   * already sent by TCP) is ignored.
   */
  fileRefused(peer: PeerId, room: RoomId): PrefillAction[] {
    const job = this.jobs.get(room);
    if (!job || job.peer !== peer || job.path !== 'same_host' || (job.step !== 'sending' && job.step !== 'awaiting_ack') || this.rooms.get(room)?.state !== KVPoll.Transferring) return [];
    job.path = 'tcp';
    job.step = 'sending';
    return [{ a: 'transfer', room, peer, path: 'tcp' }];
  }

  /** The connection to decode `peer` ended: its pending registrations go, its rooms fail. */
  peerLost(peer: PeerId, reason: string, now: number): PrefillAction[] {
    this.sameHostPeers.delete(peer);
    for (const [room, p] of this.pendingRegs) if (p.peer === peer) this.pendingRegs.delete(room);
    return this.run(this.rooms.failPeer(peer, failure('peer_lost', reason), now), now);
  }

  /** The watchdog: pending registrations past the bootstrap deadline are refused; room deadlines. */
  tick(now: number): PrefillAction[] {
    const out: PrefillAction[] = [];
    for (const [room, p] of this.pendingRegs) {
      if (now - p.at > this.config.timeouts.bootstrapMs) {
        this.pendingRegs.delete(room);
        out.push(this.fail(p.peer, room, failure('registration_refused', `no request for this room reached prefill within ${this.config.timeouts.bootstrapMs} ms`)));
        out.push({ a: 'registration_expired', room });
      }
    }
    if (this.leaked !== undefined && this.rooms.has(this.leaked)) out.push(...this.apply(this.leaked, { t: 'progress', bytes: 0 }, now));
    out.push(...this.run(this.rooms.tick(now), now));
    return out;
  }

  /**
   * The engine finished the compute of the computation led by `lead`. The compute slot is free
   * again. On success the state is offered with `kv_begin` to every room that was registered
   * while it ran — written whatever happened to the room meanwhile, the table being the only
   * judge (a refused or late kv_begin → no transfer) — then `transfer` to each accepting room's
   * peer. Rooms not registered yet get the state when they register. `discard` when no room
   * needs the state; a failed compute fails every live room of the computation.
   */
  computeDone(lead: RoomId, outcome: ComputeOutcome, now: number): PrefillAction[] {
    this.computing--;
    const out: PrefillAction[] = [];
    const comp = this.comps.get(lead);
    if (!outcome.ok) {
      if (comp) {
        this.comps.delete(lead);
        if (!outcome.aborted) for (const r of comp.rooms) if (this.jobs.has(r)) out.push(...this.apply(r, { t: 'fail', failure: outcome.failure }, now));
      }
      out.push(...this.pump());
      return out;
    }
    if (!comp) {
      out.push({ a: 'discard', room: lead });
      out.push(...this.pump());
      return out;
    }
    comp.phase = 'ready';
    comp.bytes = new Map(comp.rooms.map((r) => [r, outcome.roomBytes?.get(r) ?? outcome.totalBytes]));
    const offered = [...comp.offered];
    comp.offered.clear();
    for (const r of offered) out.push(...this.offer(comp, r, now));
    // (Legacy rule only: a revived room whose job is gone has nobody to send it — the incident's wedge.)
    out.push(...this.release(comp));
    out.push(...this.pump());
    return out;
  }

  /** `bytes` of the room's state reached the socket. Restarts its transfer deadline. */
  progress(room: RoomId, bytes: number, now: number): PrefillAction[] {
    return this.apply(room, { t: 'progress', bytes }, now);
  }

  /**
   * Every chunk of the room's state was written (kv_end next): waiting for decode's kv_ack. The
   * room no longer needs the state: `discard` when it was the computation's last reference.
   */
  transferSent(room: RoomId): PrefillAction[] {
    const job = this.jobs.get(room);
    if (!job || !this.rooms.has(room)) return [];
    job.step = 'awaiting_ack';
    const comp = this.comps.get(job.comp);
    if (!comp) return [];
    comp.refs.delete(room);
    return this.release(comp);
  }

  /** The send failed (connection gone, stalled). */
  transferFailed(room: RoomId, f: RoomFailure, now: number): PrefillAction[] {
    return this.apply(room, { t: 'fail', failure: f }, now);
  }

  /** Fail every live room (shutdown). */
  shutdown(now: number): PrefillAction[] {
    const out: PrefillAction[] = [];
    for (const r of this.rooms.rooms()) out.push(...this.apply(r.id, { t: 'abort', from: 'local', failure: failure('shutting_down', 'prefill worker shutting down') }, now));
    return out;
  }

  // ---- internals -------------------------------------------------------------------------------

  private fail(peer: PeerId, room: RoomId, f: RoomFailure): PrefillAction {
    return { a: 'send', peer, msg: { type: 'fail', room, code: f.code, detail: f.detail, epoch: this.epoch } };
  }

  private apply(room: RoomId, ev: RoomEvent, now: number): PrefillAction[] {
    if (this.leaked === room && ev.t !== 'progress') return []; // TEST-ONLY fault (faultLeakFirstAck)
    return this.run(this.rooms.apply(room, ev, now), now);
  }

  /** Decode `peer` registered `room` (live job): bind, answer REGISTERED on the first one. */
  private register(peer: PeerId, peerEpoch: string, room: RoomId, now: number): PrefillAction[] {
    const job = this.jobs.get(room);
    if (!job) return [];
    if (job.peer !== undefined && job.peer !== peer) return [this.fail(peer, room, failure('registration_refused', 'room already registered by another decode worker'))];
    job.peer = peer;
    const before = this.rooms.get(room)?.state;
    const out = this.apply(room, { t: 'registered', peer, peerEpoch }, now);
    // WaitingForInput, or already Transferring when the computation's state was ready (n > 1).
    const after = this.rooms.get(room)?.state;
    if (before === KVPoll.Bootstrapping && (after === KVPoll.WaitingForInput || after === KVPoll.Transferring)) out.unshift({ a: 'send', peer, msg: { type: 'registered', room } });
    return out;
  }

  /** The core's effects → actions. */
  private run(effects: Effect[], _now: number): PrefillAction[] {
    const out: PrefillAction[] = [];
    for (const e of effects) {
      switch (e.t) {
        case 'notify_peer':
          out.push(this.fail(e.peer, e.room, e.failure));
          break;
        case 'start_prefill': {
          const job = this.jobs.get(e.room);
          const comp = job ? this.comps.get(job.comp) : undefined;
          if (!job || !comp) break;
          if (comp.phase === 'ready') {
            out.push(...this.offer(comp, e.room, _now));
            out.push(...this.release(comp));
            break;
          }
          job.step = comp.phase === 'computing' ? 'computing' : 'queued';
          comp.offered.add(e.room);
          if (comp.phase === 'idle') {
            comp.phase = 'queued';
            this.waiting.add(comp.lead);
            out.push(...this.pump());
          }
          break;
        }
        case 'terminal': {
          const job = this.jobs.get(e.room);
          if (!job) break;
          this.jobs.delete(e.room);
          const comp = this.comps.get(job.comp);
          if (this.byRid.get(job.rid) === job.comp && !(comp?.rooms.some((r) => this.jobs.has(r)) ?? false)) this.byRid.delete(job.rid);
          out.push({ a: 'finish', room: e.room, rid: job.rid, state: e.state, failure: e.failure, registered: job.peer !== undefined, bytes: roomWireBytes(this.rooms.get(e.room)) });
          if (comp) {
            comp.refs.delete(e.room);
            out.push(...this.release(comp));
          }
          break;
        }
        case 'illegal':
        case 'late':
        case 'expired':
          out.push({ a: 'diag', effect: e });
          break;
        default:
          break;
      }
    }
    return out;
  }

  /** Offer the computed state to registered room `room` with kv_begin; `transfer` when the table accepts it. */
  private offer(comp: Comp, room: RoomId, now: number): PrefillAction[] {
    const eff = this.apply(room, { t: 'kv_begin', totalBytes: comp.bytes?.get(room) ?? 0 }, now);
    const r = this.rooms.get(room);
    const job = this.jobs.get(room);
    const accepted = r !== undefined && r.state === KVPoll.Transferring && !eff.some((e) => e.a === 'diag' && (e.effect.t === 'illegal' || e.effect.t === 'late'));
    if (!accepted) comp.refs.delete(room);
    else if (job?.peer !== undefined) {
      job.step = 'sending';
      job.path = this.pathFor(job.peer);
      eff.push({ a: 'transfer', room, peer: job.peer, path: job.path });
    }
    return eff;
  }

  /**
   * The computation lost a reference: with none left, a computed state is discarded (once), a
   * queued compute leaves the queue, a running one is cancelled (its computeDone discards).
   */
  private release(comp: Comp): PrefillAction[] {
    if (comp.refs.size > 0 || this.comps.get(comp.lead) !== comp) return [];
    switch (comp.phase) {
      case 'ready':
        this.comps.delete(comp.lead);
        return [{ a: 'discard', room: comp.lead }];
      case 'computing':
        if (comp.cancelled) return [];
        comp.cancelled = true;
        return [{ a: 'cancel', room: comp.lead }];
      default:
        this.waiting.delete(comp.lead);
        this.comps.delete(comp.lead);
        return [];
    }
  }

  /** Start computes for waiting computations while compute slots are free. */
  private pump(): PrefillAction[] {
    const out: PrefillAction[] = [];
    while (this.waiting.size > 0 && this.computing < this.config.slots) {
      const lead = this.waiting.values().next().value as RoomId;
      this.waiting.delete(lead);
      const comp = this.comps.get(lead);
      if (!comp || comp.refs.size === 0) continue;
      comp.phase = 'computing';
      for (const r of comp.offered) {
        const job = this.jobs.get(r);
        if (job) job.step = 'computing';
      }
      this.computing++;
      out.push({ a: 'compute', room: lead });
    }
    return out;
  }
}
