/**
 * The decode driver, sans-IO: every decision the decode worker makes about a room — admission
 * (prealloc queue bound, duplicate room / rid), slot hand-out to the oldest prealloc room, when
 * to register with prefill and on which connection, which control messages and chunks belong to
 * the room (the connection it registered on), the KV reception rule (src/decode/receive.ts), when
 * to load, when a slot is released (after generation; on failure at once, or — when llama.cpp is
 * still loading into it — deferred until the load returns, since the load cannot be cancelled),
 * and telling prefill about every failure (opening a connection if the room has none, so no
 * prefill room waits out its deadline for a decode that already gave up).
 * No sockets, no timers, no engine, no `Date.now()`: inputs are method calls with `now` (ms),
 * outputs are `DecodeAction`s the caller performs in order.
 *
 * Two callers run this same code, as TigerBeetle runs its real replica under its simulator: the
 * worker (`src/decode/worker.ts`, a thin shell over HTTP, the KV peer pool and llama.cpp) and the
 * deterministic simulator (`src/sim/`), over simulated network, engine and time. The prefill side
 * is `src/prefill/driver.ts`, with the same shape.
 *
 * Ports: the engine through `assign_slot` / `release` / `load` (answered by `loadDone` /
 * `loadFailed`) / `generate` (answered by `generationDone`); the channel through `dial`
 * (answered by `dialed` / `registerFailed`), `register`, `send`, `recv_begin` and the inputs
 * `message`, `chunk`, `peerLost`; the clock through the `now` argument. Prefill workers are
 * addressed by their bootstrap address "host:port" (`PrefillAddr`, the room's `peer` in the
 * table); connections are opaque ids chosen by the caller (`ConnId`), so a connection that was
 * lost and re-opened to the same prefill is a different id.
 *
 * Step of a request (shown in /debug/rooms): prealloc (waiting for a slot) → registering (slot
 * held, dialing / REGISTER sent) → waiting_kv (REGISTERED) → receiving (KV_BEGIN) → loading
 * (KV_END, llama.cpp loading the state) → decoding (Success: generating) → gone (slot released).
 *
 * Decode-local continuation (`request(…, {local: true})`, see ./local.ts): the router sent the
 * request to decode alone. Its room has no peer; once it holds a slot the core's `local_prefill`
 * event (→ WaitingForInput/local) yields the `local_prefill` action — evaluate the uncached
 * suffix on the slot, answered by `loadDone` / `loadFailed` exactly as a load is (the evaluation
 * cannot be cancelled either: a failed room keeps its slot until it returns) — and `kv_done`
 * makes the room Success and starts generation. Steps: prealloc → local_prefill → decoding →
 * gone. Nothing is ever sent to a prefill for it (refusals included: prefill never saw it).
 *
 * Same host (src/kv/transfer/same-host.ts): waiting_kv → loading on KV_FILE (`take_file`: the
 * shell takes the file over; `fileTaken` is the room's kv_begin) — or, when the shell refuses the
 * file (`fileRefused`), back to waiting_kv with KV_FILE_REFUSED sent, and prefill sends over TCP.
 */
import { ApiError, failure, type RoomFailure } from '../base/errors.js';
import type { RoomId } from '../base/room-id.js';
import { RoomTable } from '../kv/lifecycle.js';
import { failureFromWire, type ControlMsg } from '../kv/messages.js';
import { KVPoll, type Effect, type RoomEvent, type RoomTimeouts } from '../kv/types.js';
import { checkAnnounced, KvReception } from './receive.js';

/** A prefill worker's bootstrap address, "host:port" (the room's peer). */
export type PrefillAddr = string;
/** An opaque connection id, unique per connection (the caller's choice). */
export type ConnId = string;

/** What the decode worker is doing for a request (shown in /debug/rooms). */
export type DecodeStep = 'prealloc' | 'registering' | 'waiting_kv' | 'receiving' | 'loading' | 'local_prefill' | 'decoding';

export interface DecodeDriverConfig {
  timeouts: RoomTimeouts;
  /** Sequence slots of the engine (requests decoded at once). */
  slots: number;
  /** Bound on requests waiting for a slot (the prealloc queue). */
  maxPrealloc: number;
  /**
   * Largest state accepted, bytes (`--max-state-bytes`): announced at KV_BEGIN / KV_FILE, or
   * received in order on a streamed KV_BEGIN; above it the room fails `kv_state_too_large`.
   */
  maxStateBytes: number;
  /** TEST-ONLY: SGLang's max(old, new) status rule (simulator proof of the wedge). Never in a worker. */
  legacyMaxRule?: boolean;
}

/** Outputs, performed in order by the caller. */
export type DecodeAction =
  /** A sequence slot is the room's now: take one from the engine (the driver counts them). */
  | { a: 'assign_slot'; room: RoomId }
  /**
   * The request is over on this worker and nothing runs for it any more: give its slot back to
   * the engine when `slot` (once per `assign_slot`), forget it. Once per accepted request, after
   * its `finish`.
   */
  | { a: 'release'; room: RoomId; slot: boolean }
  /** Open (or reuse) the connection to prefill `addr` for `room`; answer `dialed` or `registerFailed`. */
  | { a: 'dial'; room: RoomId; addr: PrefillAddr }
  /** Write REGISTER on `conn`; a failed write is answered with `registerFailed`. */
  | { a: 'register'; room: RoomId; conn: ConnId; msg: Extract<ControlMsg, { type: 'register' }> }
  /**
   * Send a control message on `conn` if it is alive; when it is not (or absent) and `addr` is set,
   * on a (new) pooled connection to `addr` — so prefill hears of every failure.
   */
  | { a: 'send'; room: RoomId; conn?: ConnId; addr?: PrefillAddr; msg: ControlMsg }
  /** KV_BEGIN accepted: start receiving a state of `totalBytes` (the caller's buffer/validator). */
  | { a: 'recv_begin'; room: RoomId; totalBytes: number; hintBytes?: number }
  /**
   * Every byte is in and KV_END arrived: finish the receive and load it into the room's slot;
   * answer `loadDone` / `loadFailed`. `end`: a streamed kv_end's byte count and CRC-32.
   */
  | { a: 'load'; room: RoomId; end?: { totalBytes: number; crc: number } }
  /** Decode-local room holding its slot: evaluate the prompt's uncached suffix on it; answer `loadDone` / `loadFailed`. */
  | { a: 'local_prefill'; room: RoomId }
  /**
   * Same host: KV_FILE accepted (the slot is kept as for a load): take the named file over and
   * validate it; answer `fileRefused` (not taken: TCP instead), or `fileTaken` then load it and
   * answer `loadDone` / `loadFailed` (a bad file, or the room over meanwhile, is `loadFailed`).
   */
  | { a: 'take_file'; room: RoomId; msg: Extract<ControlMsg, { type: 'kv_file' }> }
  /** The state is loaded (room Success): generate tokens on the slot; answer `generationDone`. */
  | { a: 'generate'; room: RoomId }
  /**
   * The room is terminal: answer its request (Success: the stream starts with `generate`;
   * Failed: the error), drop its receive buffer, stop what runs for it. Once per room.
   * `registered`: the room got past registration (for the metrics' cause split).
   */
  | { a: 'finish'; room: RoomId; rid: string; state: KVPoll.Success | KVPoll.Failed; failure?: RoomFailure; registered: boolean }
  /** A diagnostic effect of the core (illegal, late, expired): count and log. */
  | { a: 'diag'; effect: Effect }
  /** A message or chunk for a room not registered on that connection was ignored (log at debug). */
  | { a: 'stray'; room: RoomId; conn: ConnId; what: string };

interface Job {
  rid: string;
  addr: PrefillAddr;
  /** Decode-local continuation: no prefill peer; decode evaluates the suffix itself. */
  local: boolean;
  step: DecodeStep;
  /** The connection the room registered on; control messages and chunks count only from it. */
  conn?: ConnId;
  /** Holds an engine slot (from assign_slot until release). */
  slot: boolean;
  /** llama.cpp is loading into the slot (cannot be cancelled: the slot waits for it). */
  loading: boolean;
  /** Generation runs on the slot. */
  generating: boolean;
  /** The room reached a terminal state (`finish` was emitted). */
  done: boolean;
  /** The reception rule for this room's state (from KV_BEGIN). */
  rx?: KvReception;
}

/** Answer to `request`: refused (nothing created; `actions` tell prefill) or accepted. */
export type DecodeAdmission = { refused: ApiError; actions: DecodeAction[] } | { refused?: undefined; actions: DecodeAction[] };

export class DecodeDriver {
  readonly rooms: RoomTable;
  private readonly jobs = new Map<RoomId, Job>();
  private readonly byRid = new Map<string, RoomId>();
  /** FIFO of rooms waiting for a free slot. Bounded by maxPrealloc. */
  private readonly prealloc = new Set<RoomId>();
  private slotsFree: number;

  constructor(
    readonly config: DecodeDriverConfig,
    /** This worker's epoch, stamped on every message it sends. */
    readonly epoch: string,
  ) {
    this.rooms = new RoomTable('decode', config.timeouts, { legacyMaxRule: config.legacyMaxRule });
    this.slotsFree = config.slots;
  }

  // ---- queries ---------------------------------------------------------------------------------

  /** Requests this worker holds now, in any step (waiting for a slot, receiving KV, generating): its load as GET /load reports it. */
  get requests(): number {
    return this.jobs.size;
  }

  /** Queue name → entries: prealloc and transfer from room phases, running = generating, slots used. */
  queueSizes(): Record<string, number> {
    let prealloc = 0;
    let transfer = 0;
    for (const r of this.rooms.rooms()) {
      if (r.phase === 'prealloc') prealloc++;
      else transfer++;
    }
    let running = 0;
    for (const j of this.jobs.values()) if (j.generating) running++;
    return { decode_prealloc_queue: prealloc, decode_transfer_queue: transfer, decode_running: running, decode_slots_used: this.config.slots - this.slotsFree };
  }

  /** The request's step, or null when the driver no longer holds it. */
  step(room: RoomId): DecodeStep | null {
    return this.jobs.get(room)?.step ?? null;
  }

  /** Requests the driver holds (live rooms, and terminal ones whose slot is not released yet). */
  get live(): number {
    return this.jobs.size;
  }

  /** Slots not handed out. */
  get freeSlots(): number {
    return this.slotsFree;
  }

  /** Entries of the prealloc queue. */
  get preallocQueued(): number {
    return this.prealloc.size;
  }

  /** The room id of a live request id. */
  roomOfRid(rid: string): RoomId | undefined {
    const id = this.byRid.get(rid);
    return id !== undefined && this.jobs.has(id) ? id : undefined;
  }

  /** Live rooms registered on `conn` (what `peerLost(conn)` fails). */
  roomsOn(conn: ConnId): RoomId[] {
    const out: RoomId[] = [];
    for (const [room, j] of this.jobs) if (j.conn === conn && this.rooms.has(room)) out.push(room);
    return out;
  }

  // ---- inputs ----------------------------------------------------------------------------------

  /**
   * A request (POST /generate) for `room` whose state comes from prefill `addr`. Refuses (503
   * queue_full when the prealloc queue is full, 409 duplicate_room, 400 duplicate_rid) without
   * creating anything — telling prefill, except for a duplicate live room (that room is running
   * here) — else creates the room (a tombstone fails it at once), queues it and hands out slots.
   */
  request(room: RoomId, rid: string, addr: PrefillAddr, now: number, opts: { local?: boolean } = {}): DecodeAdmission {
    const local = opts.local === true;
    const refuse = (err: ApiError, tell: boolean): DecodeAdmission => ({
      refused: err,
      // A decode-local request never reached a prefill: nobody to tell.
      actions: tell && !local ? [this.tell(room, undefined, addr, failure(err.code as RoomFailure['code'], `decode refused the request: ${err.message}`))] : [],
    });
    if (this.prealloc.size >= this.config.maxPrealloc) return refuse(ApiError.of('queue_full', `decode prealloc queue is full (${this.config.maxPrealloc})`), !this.rooms.has(room));
    if (this.rooms.has(room) || this.jobs.has(room)) return refuse(ApiError.of('duplicate_room', `room ${room} already exists`), false);
    // One live request per rid (as vLLM): a second one could never be aborted by rid.
    const other = this.roomOfRid(rid);
    if (other !== undefined) return refuse(ApiError.of('duplicate_rid', `request id ${rid} is already running on this worker (room ${other})`, 'rid'), true);
    // A local room has no peer: the core then allows only the local path for it.
    const effects = this.rooms.create(room, rid, now, local ? undefined : addr);
    this.jobs.set(room, { rid, addr, local, step: 'prealloc', slot: false, loading: false, generating: false, done: false });
    this.byRid.set(rid, room);
    this.prealloc.add(room);
    const out = this.run(effects, now);
    out.push(...this.admit(now));
    return { actions: out };
  }

  /**
   * Abort by room id (or, without one, by rid): router's /abort_request, the client gone, local
   * shutdown. An id not seen yet leaves a tombstone (the request, if it comes, fails at once).
   * A room already terminal is left as it is (a generation in progress is stopped by the caller).
   * `cause`: the router's reason (its /abort_request `cause`, e.g. prefill_refused), the room's
   * failure instead of request_aborted.
   */
  abort(rid: string | undefined, room: RoomId | undefined, from: 'router' | 'client' | 'local', now: number, cause?: RoomFailure): DecodeAction[] {
    const id = room ?? (rid !== undefined ? this.roomOfRid(rid) : undefined);
    if (id === undefined) return [];
    const f = from === 'local' ? failure('shutting_down', 'aborted locally') : from === 'router' && cause ? cause : failure('request_aborted', from === 'router' ? 'abort_request from the router' : 'the client closed the request');
    return this.apply(id, { t: 'abort', from, failure: f }, now);
  }

  /** The connection for `room`'s registration is open: write REGISTER on it (if the room still wants it). */
  dialed(room: RoomId, conn: ConnId, _now: number): DecodeAction[] {
    const job = this.jobs.get(room);
    if (!job || job.done || job.step !== 'registering' || job.conn !== undefined || !this.rooms.has(room)) return [];
    job.conn = conn;
    return [{ a: 'register', room, conn, msg: { type: 'register', room, rid: job.rid, epoch: this.epoch, kvStream: true } }];
  }

  /** The dial or the REGISTER write failed (`f`: peer_unreachable, settings_mismatch, peer_lost). */
  registerFailed(room: RoomId, f: RoomFailure, now: number): DecodeAction[] {
    if (!this.jobs.has(room)) return [];
    return this.apply(room, f.code === 'peer_lost' ? { t: 'peer_lost', failure: f } : { t: 'fail', failure: f }, now);
  }

  /**
   * A control message from prefill on `conn` (epoch already checked by the channel). Counted
   * only when `conn` is the connection the room registered on; else a `stray`.
   */
  message(conn: ConnId, peerEpoch: string | undefined, msg: ControlMsg, now: number): DecodeAction[] {
    if (!('room' in msg) || msg.type === 'register' || msg.type === 'kv_ack') return [];
    const job = this.jobOn(conn, msg.room);
    if (!job) return [{ a: 'stray', room: msg.room, conn, what: msg.type }];
    switch (msg.type) {
      case 'registered': {
        const out = this.apply(msg.room, { t: 'registered', peerEpoch: peerEpoch || undefined }, now);
        if (this.rooms.get(msg.room)?.state === KVPoll.WaitingForInput && job.step === 'registering') job.step = 'waiting_kv';
        return out;
      }
      case 'kv_begin': {
        // streamed: totalBytes is prefill's estimate; what is accepted is capped at maxStateBytes
        const streamed = msg.streamed === true;
        const limit = streamed ? this.config.maxStateBytes : msg.totalBytes;
        const bad = this.rooms.has(msg.room) ? checkAnnounced(streamed ? Math.min(msg.totalBytes, limit) : msg.totalBytes, this.config.maxStateBytes) : undefined;
        if (bad) return this.apply(msg.room, { t: 'fail', failure: bad }, now);
        const out = this.apply(msg.room, { t: 'kv_begin', totalBytes: msg.totalBytes }, now);
        if (!job.rx && this.rooms.get(msg.room)?.state === KVPoll.Transferring && this.rooms.has(msg.room)) {
          job.rx = new KvReception(limit, streamed, streamed ? msg.totalBytes : undefined);
          job.step = 'receiving';
          out.unshift({ a: 'recv_begin', room: msg.room, totalBytes: limit, ...(streamed ? { hintBytes: msg.totalBytes } : {}) });
        }
        return out;
      }
      case 'kv_file': {
        if (!this.rooms.has(msg.room)) return [];
        if (job.loading || job.rx || job.step !== 'waiting_kv') return this.apply(msg.room, { t: 'fail', failure: failure('kv_transfer_failed', `kv_file in step ${job.step}`) }, now);
        const bad = checkAnnounced(msg.payloadBytes, this.config.maxStateBytes);
        if (bad) return this.apply(msg.room, { t: 'fail', failure: bad }, now);
        if (!job.slot) return this.apply(msg.room, { t: 'fail', failure: failure('internal_error', 'kv_file for a room without a slot') }, now);
        job.step = 'loading';
        job.loading = true;
        return [{ a: 'take_file', room: msg.room, msg }];
      }
      case 'kv_end': {
        if (!this.rooms.has(msg.room)) return [];
        if (job.loading || job.step === 'loading') return []; // a repeated KV_END: the load already runs
        const incomplete = job.rx ? job.rx.end(msg.totalBytes) : failure('kv_transfer_failed', 'kv_end before kv_begin');
        if (incomplete) return this.apply(msg.room, { t: 'fail', failure: incomplete }, now);
        if (!job.slot) return this.apply(msg.room, { t: 'fail', failure: failure('internal_error', 'kv_end for a room without a slot') }, now);
        job.step = 'loading';
        job.loading = true;
        return [{ a: 'load', room: msg.room, ...(msg.totalBytes !== undefined && msg.crc !== undefined ? { end: { totalBytes: msg.totalBytes, crc: msg.crc } } : {}) }];
      }
      case 'fail':
        return this.apply(msg.room, { t: 'abort', from: 'peer', failure: failureFromWire(msg, 'prefill') }, now);
      default:
        return [];
    }
  }

  /**
   * A KV chunk of `len` bytes at `offset` for `room` on `conn`. `store`: the caller keeps the
   * bytes (validates them; a bad piece is reported with `fail`). Out of order, duplicated,
   * overflowing or before KV_BEGIN: the room fails (the shared reception rule).
   */
  chunk(conn: ConnId, room: RoomId, offset: number, len: number, now: number): { store: boolean; actions: DecodeAction[] } {
    const job = this.jobOn(conn, room);
    if (!job) return { store: false, actions: [{ a: 'stray', room, conn, what: 'chunk' }] };
    if (!this.rooms.has(room)) return { store: false, actions: [] }; // the room is over: bytes dropped
    if (!job.rx) return { store: false, actions: this.apply(room, { t: 'fail', failure: failure('kv_transfer_failed', 'chunk before kv_begin') }, now) };
    const out = job.rx.accept(offset, len);
    if (out) return { store: false, actions: this.apply(room, { t: 'fail', failure: out }, now) };
    return { store: true, actions: this.apply(room, { t: 'progress', bytes: len }, now) };
  }

  /**
   * Same host: the shell took the KV_FILE's file over (renamed, validated): the room's kv_begin.
   * The shell then loads it (`loadDone` / `loadFailed`).
   */
  fileTaken(room: RoomId, payloadBytes: number, now: number): DecodeAction[] {
    const job = this.jobs.get(room);
    if (!job || !job.loading || !this.rooms.has(room)) return [];
    return this.apply(room, { t: 'kv_begin', totalBytes: payloadBytes }, now);
  }

  /**
   * Same host: the shell could not take the KV_FILE's file over (missing, another size, …): the
   * file is still prefill's; KV_FILE_REFUSED asks prefill to send the room over TCP.
   */
  fileRefused(room: RoomId, reason: string, now: number): DecodeAction[] {
    const job = this.jobs.get(room);
    if (!job || !job.loading) return [];
    job.loading = false;
    const out: DecodeAction[] = [];
    if (this.rooms.has(room)) {
      job.step = 'waiting_kv';
      out.push({ a: 'send', room, conn: job.conn, msg: { type: 'kv_file_refused', room, reason, epoch: this.epoch } });
    }
    out.push(...this.settle(room, now));
    return out;
  }

  /** A local failure of the room (the caller's validation of stored bytes, a slot the engine refused). */
  fail(room: RoomId, f: RoomFailure, now: number): DecodeAction[] {
    return this.apply(room, { t: 'fail', failure: f }, now);
  }

  /**
   * The load finished (the state is in the slot). The room reaches Success (kv_ack to prefill,
   * `finish`, `generate`) if it is still live; if it failed meanwhile, the slot it kept for the
   * load is released now.
   */
  loadDone(room: RoomId, now: number): DecodeAction[] {
    const job = this.jobs.get(room);
    if (!job || !job.loading) return [];
    job.loading = false;
    const r = this.rooms.has(room) ? this.rooms.get(room)! : undefined;
    const out = r && (r.state === KVPoll.Transferring || r.phase === 'local') ? this.apply(room, { t: 'kv_done' }, now) : [];
    out.push(...this.settle(room, now));
    return out;
  }

  /**
   * Asked by the shell just before a step that writes into the room's slot — `take` (a handed
   * state file), `load`, `local_prefill` — after any wait: null = go on; otherwise the room ended
   * meanwhile (abort, deadline, peer lost) or holds no slot, the step must not run, and the
   * returned actions end its load (`loadFailed` request_aborted: the slot is released).
   */
  proceed(room: RoomId, step: 'take' | 'load' | 'local_prefill', now: number): DecodeAction[] | null {
    const job = this.jobs.get(room);
    if (job?.loading && job.slot && this.rooms.has(room)) return null;
    const what = step === 'take' ? 'the state file was taken' : step === 'load' ? 'the load' : 'the local prefill';
    return this.loadFailed(room, failure('request_aborted', `room over before ${what}`), now);
  }

  /** The load failed (bad state, engine error, aborted). The room fails; the slot is released. */
  loadFailed(room: RoomId, f: RoomFailure, now: number): DecodeAction[] {
    const job = this.jobs.get(room);
    if (!job || !job.loading) return [];
    job.loading = false;
    const out = this.apply(room, { t: 'fail', failure: f }, now);
    out.push(...this.settle(room, now));
    return out;
  }

  /** Generation ended (finished, aborted, client gone): the slot is released. */
  generationDone(room: RoomId, now: number): DecodeAction[] {
    const job = this.jobs.get(room);
    if (!job || !job.generating) return [];
    job.generating = false;
    return this.settle(room, now);
  }

  /** The connection `conn` to prefill ended: every live room registered on it fails. */
  peerLost(conn: ConnId, reason: string, now: number): DecodeAction[] {
    const out: DecodeAction[] = [];
    for (const room of this.roomsOn(conn)) out.push(...this.apply(room, { t: 'peer_lost', failure: failure('peer_lost', reason) }, now));
    return out;
  }

  /** The watchdog: room deadlines (prealloc, bootstrap, waiting, transfer idle). */
  tick(now: number): DecodeAction[] {
    return this.run(this.rooms.tick(now), now);
  }

  /** Fail every live room (shutdown). */
  shutdown(now: number): DecodeAction[] {
    const out: DecodeAction[] = [];
    for (const r of this.rooms.rooms()) out.push(...this.apply(r.id, { t: 'abort', from: 'local', failure: failure('shutting_down', 'decode worker shutting down') }, now));
    return out;
  }

  // ---- internals -------------------------------------------------------------------------------

  /** The job of `room` when `conn` is the connection it registered on. */
  private jobOn(conn: ConnId, room: RoomId): Job | undefined {
    const job = this.jobs.get(room);
    return job && job.conn === conn ? job : undefined;
  }

  /** Wire FAIL for `room` to its prefill: on its connection, else on a (new) one to `addr`. */
  private tell(room: RoomId, conn: ConnId | undefined, addr: PrefillAddr, f: RoomFailure): DecodeAction {
    return { a: 'send', room, conn, addr, msg: { type: 'fail', room, code: f.code, detail: f.detail, epoch: this.epoch } };
  }

  private apply(room: RoomId, ev: RoomEvent, now: number): DecodeAction[] {
    return this.run(this.rooms.apply(room, ev, now), now);
  }

  /** The core's effects → actions. */
  private run(effects: Effect[], now: number): DecodeAction[] {
    const out: DecodeAction[] = [];
    for (const e of effects) {
      switch (e.t) {
        case 'send_register': {
          const job = this.jobs.get(e.room);
          if (job) out.push({ a: 'dial', room: e.room, addr: job.addr });
          break;
        }
        case 'send_ack': {
          const job = this.jobs.get(e.room);
          if (job?.conn !== undefined) out.push({ a: 'send', room: e.room, conn: job.conn, msg: { type: 'kv_ack', room: e.room, epoch: this.epoch } });
          break;
        }
        case 'notify_peer': {
          const job = this.jobs.get(e.room);
          out.push(this.tell(e.room, job?.conn, job?.addr ?? e.peer, e.failure));
          break;
        }
        case 'start_local_prefill': {
          const job = this.jobs.get(e.room);
          if (job?.slot && !job.loading) {
            job.step = 'local_prefill';
            job.loading = true;
            out.push({ a: 'local_prefill', room: e.room });
          }
          break;
        }
        case 'terminal':
          out.push(...this.terminal(e.room, e.state, e.failure, now));
          break;
        default: // illegal, late, expired (start_prefill is prefill's)
          if (e.t !== 'start_prefill') out.push({ a: 'diag', effect: e });
      }
    }
    return out;
  }

  /** The room became terminal (once): answer the request; Success starts generation on the slot. */
  private terminal(room: RoomId, state: KVPoll.Success | KVPoll.Failed, f: RoomFailure | undefined, now: number): DecodeAction[] {
    this.prealloc.delete(room);
    const job = this.jobs.get(room);
    if (!job || job.done) return [];
    job.done = true;
    const registered = job.step !== 'prealloc' && job.step !== 'registering';
    const out: DecodeAction[] = [{ a: 'finish', room, rid: job.rid, state, failure: f, registered }];
    job.rx = undefined;
    if (state === KVPoll.Success && job.slot && !job.loading) {
      job.step = 'decoding';
      job.generating = true;
      out.push({ a: 'generate', room });
    }
    out.push(...this.settle(room, now));
    return out;
  }

  /**
   * The one place a slot is released and a job forgotten: once the room is terminal and nothing
   * runs on its slot (no load — llama.cpp cannot be cancelled, so a failed room keeps its slot
   * until the load returns — and no generation). Then free slots go to the prealloc queue.
   */
  private settle(room: RoomId, now: number): DecodeAction[] {
    const job = this.jobs.get(room);
    if (!job || !job.done || job.loading || job.generating) return [];
    const out: DecodeAction[] = [{ a: 'release', room, slot: job.slot }];
    if (job.slot) {
      job.slot = false;
      this.slotsFree++;
    }
    this.jobs.delete(room);
    if (this.byRid.get(job.rid) === room) this.byRid.delete(job.rid);
    out.push(...this.admit(now));
    return out;
  }

  /** Hand free slots to the oldest prealloc rooms (`assign_slot`, then the core's slot_reserved → `dial`). */
  private admit(now: number): DecodeAction[] {
    const out: DecodeAction[] = [];
    while (this.prealloc.size > 0 && this.slotsFree > 0) {
      const room = this.prealloc.values().next().value as RoomId;
      this.prealloc.delete(room);
      const job = this.jobs.get(room);
      if (!job || job.done || !this.rooms.has(room) || this.rooms.get(room)!.phase !== 'prealloc') continue;
      this.slotsFree--;
      job.slot = true;
      job.step = job.local ? 'local_prefill' : 'registering';
      out.push({ a: 'assign_slot', room });
      out.push(...this.apply(room, { t: job.local ? 'local_prefill' : 'slot_reserved' }, now));
      // A refused reservation (never on the real rule) must not keep the slot: the room fails.
      if (!job.done && this.rooms.get(room)?.phase === 'prealloc') out.push(...this.fail(room, failure('internal_error', 'slot reservation refused'), now));
    }
    return out;
  }
}
