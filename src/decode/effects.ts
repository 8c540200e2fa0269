/**
 * Decode's effect executor: everything the decode worker does for a room between its admission
 * and the start of its token stream, over ports — the engine's slots, the KV peer pool's
 * connections, the state receiver, the same-host handoff, the state files and the clock. It holds
 * the shell's per-request records, feeds every input to the sans-IO `DecodeDriver` (driver.ts)
 * and performs every `DecodeAction` it returns, in order. The worker (worker.ts) runs it over the
 * real ports (llama.cpp, TCP/TLS, node:fs, the process clock) and streams the tokens; the
 * simulator (src/sim) over fakes on virtual time — one copy of the room handling.
 *
 * Queues (SGLang's names): prealloc (waiting for a slot), transfer (slot held: registering,
 * waiting for or receiving KV, loading), running (generating). The engine slot is taken on the
 * driver's `assign_slot` and given back on its `release` — the one place, after any engine call
 * on it has settled.
 */
import { ApiError, errorCodeOf, failure, InternalError, PdError, toApiError, type RoomFailure } from '../base/errors.js';
import type { Clock } from '../base/clock.js';
import type { Logger } from '../base/log.js';
import type { TraceTags } from '../protocol/trace-tags.js';
import { deferred, type Deferred } from '../worker/http.js';
import type { TestHooks } from '../runtime/testhooks.js';
import type { WorkerMetrics } from '../runtime/metrics.js';
import type { PrefixCacheMetrics } from '../prefixes/prefix-metrics.js';
import type { StateFiles } from '../runtime/statefiles.js';
import type { StateSpacePort } from '../runtime/state-space.js';
import type { Engine, Retention, SamplingParams, Slot } from '../engine/types.js';
import type { ParsedState } from '../engine/ggsq.js';
import type { KvConn } from '../kv/channel.js';
import type { ReceivedState, StreamEnd } from '../kv/transfer/receiver.js';
import type { KvPath, TakeOutcome } from '../kv/transfer/same-host.js';
import type { ControlMsg, EnvelopeHeader } from '../kv/messages.js';
import { KVPoll, type RoomId } from '../kv/types.js';
import type { ConnId, DecodeAction, DecodeDriver, PrefillAddr } from './driver.js';
import { localPrefill, type DecodeStart, type LocalPlan } from './local.js';

/** One room's incoming state (real: ../kv/transfer/receiver.ts `StateReceiver`, validating as it writes). */
export interface StateIntake<C extends KvConn> {
  /** One chunk's data, in order. @throws on the first inconsistency (the room fails bad_state; KvError STATE_TOO_LARGE: kv_state_too_large). */
  push(data: Buffer, conn: C): void;
  /** kv_end arrived: the complete, checked state and its file. @throws KvError BAD_ENVELOPE / BAD_STATE. */
  finish(end?: StreamEnd): Promise<ReceivedState<ParsedState>>;
  /** The load settled: give the file up. */
  done(): Promise<void>;
  /** Drop everything (any failure, any time). Idempotent, a no-op after `done`. */
  discard(): Promise<void>;
}

/** The same-host handoff port (real: ../kv/transfer/same-host.ts `SameHostDecode`). */
export interface SameHostTake<C extends KvConn> {
  /** Settles once the connection's probe is answered (or timed out): true when kv_file may come on it. */
  ready(conn: C): Promise<boolean>;
  onReply(conn: C, msg: Extract<ControlMsg, { type: 'same_host_reply' }>): void;
  /** Take the handed file over (rename) and validate it; refused → the file stays prefill's. @throws on a bad file. */
  take(msg: Extract<ControlMsg, { type: 'kv_file' }>): TakeOutcome<ParsedState>;
}

/** Everything the executor runs over. */
export interface DecodeEffectsOptions<C extends KvConn> {
  driver: DecodeDriver;
  engine: Pick<Engine, 'tryAcquireSlot'>;
  /** The pooled connection to prefill host:port (opened if needed). @throws PdError SETTINGS_MISMATCH, or the connect error. */
  dial(host: string, port: number): Promise<C>;
  /** A receiver for `room`'s state of `totalBytes` (`hintBytes`: a streamed kv_begin's estimate). */
  receive(room: RoomId, totalBytes: number, hintBytes?: number): StateIntake<C>;
  sameHost: SameHostTake<C>;
  files: StateFiles;
  /** Judges a failed receive: ENOSPC fails the room `state_dir_full` (../runtime/state-space.ts); absent: never. */
  space?: StateSpacePort;
  clock: Clock;
  metrics: WorkerMetrics;
  prefixMetrics: PrefixCacheMetrics;
  traces: TraceTags;
  log: Logger;
  /** Test-only hold points (../runtime/testhooks.ts); production and the simulator: `noTestHooks`. */
  testHooks: TestHooks;
}

/** The request a decode worker admits (parsed; a local plan already accepted). */
export interface DecodeAsk {
  room: RoomId;
  rid: string;
  sampling: SamplingParams;
  /** The router has token 1 from prefill (`first_token_from_prefill`): stream from token 2. */
  skipFirst: boolean;
  /** Prefill's bootstrap address. */
  host: string;
  port: number;
  /** Decode-local continuation (./local.ts): the plan decode accepted; the room has no peer. */
  local?: LocalPlan;
  /** The router's conversation key (KV events name the kept sequence by it). */
  conversationKey?: string;
  /** The request's cache salt (its tenant): the kept sequence is reused for this salt only. */
  salt?: string;
  /** How long its kept sequence is retained (`retention` of /generate; engine/prefix-cache.ts). */
  retention?: Retention;
  /** Trace id (/debug/rooms). */
  trace: string;
}

/** The executor's record of one request: the ask, and what the driver does not need (I/O handles, timings). */
export interface DecodeJob<C extends KvConn = KvConn> extends Omit<DecodeAsk, 'trace'> {
  /** Fires when the room fails or the client goes: stops the register hold, the load hold, generation. */
  ac: AbortController;
  /** Why an /abort_request ended the job (set before `ac` aborts): an operator's or the router's reason, told to the router in the stream. */
  abortedBy?: RoomFailure;
  slot?: Slot;
  /** The incoming state: validated and written to its file as the chunks arrive. */
  recv?: StateIntake<C>;
  /** Resolves with the first token and prompt counts when generation may start (`generate`); rejects on `finish` Failed. */
  ready: Deferred<DecodeStart>;
  header?: EnvelopeHeader;
  /** Set when the KV is in the slot (PD: loaded from the envelope; local: evaluated here). */
  start?: DecodeStart;
  /** The prompt's token ids (PD: the loaded state's; local: the plan's), for the kept sequence's KV event. */
  promptIds?: readonly number[];
  /** When KV_BEGIN arrived (monotonic ms), for pdserve_kv_transfer_seconds. */
  tKvBegin?: number;
  /** How the state came: 'tcp' (recv_begin) or 'same_host' (take_file); shown in /debug/rooms, counted at Success. */
  kvPath?: KvPath;
  /**
   * The loaded state file's cleanup (unlink, or back to the receive pool), held from a successful
   * load until the room's first decode step (`stepped`) or the job's release, whichever comes
   * first; run once. Unlinking a state frees its tmpfs pages — 1-2 ms of kernel CPU for 23.5 MiB
   * that the first step, on a decode worker pinned to one core, would otherwise share its core with.
   */
  loadedFileCleanup?: () => Promise<void>;
  t0: number;
}

/** A room's path for /debug/rooms: served by decode alone, or prefill → KV handoff → decode. */
export const pathOf = (j: DecodeJob | undefined): 'decode_local' | 'pd' => (j?.local ? 'decode_local' : 'pd');
/** Prompt tokens a room did not evaluate: loaded from prefill's cache, or reused locally. */
export const cachedOf = (j: DecodeJob | undefined): number => j?.start?.cachedTokens ?? j?.local?.reusable ?? 0;

/** Decode's room handling over ports (see the module doc). Create one per worker process. */
export class DecodeEffects<C extends KvConn> {
  readonly driver: DecodeDriver;
  private readonly jobs = new Map<RoomId, DecodeJob<C>>();
  /** Live connections by the id the driver knows them by (one id per connection object). */
  private readonly conns = new Map<ConnId, C>();
  private readonly connIds = new WeakMap<C, ConnId>();
  private connSeq = 0;

  constructor(private readonly o: DecodeEffectsOptions<C>) {
    this.driver = o.driver;
  }

  private get now(): number {
    return this.o.clock.nowMs();
  }

  /** The room's record, if it is live here. */
  job(room: RoomId): DecodeJob<C> | undefined {
    return this.jobs.get(room);
  }

  /** Every live record. */
  allJobs(): IterableIterator<DecodeJob<C>> {
    return this.jobs.values();
  }

  /**
   * Admit a request: the driver's `request`, then its record and the driver's actions. Returns
   * the refusal (an ApiError to answer with; prefill was told), or the record whose `ready`
   * promise says when the stream may start.
   */
  admit(ask: DecodeAsk): { refused: ApiError } | { refused?: undefined; job: DecodeJob<C> } {
    const { room } = ask;
    const admitted = this.driver.request(room, ask.rid, `${ask.host}:${ask.port}`, this.now, { local: ask.local !== undefined });
    if (admitted.refused) {
      // Refusals before the room exists still reach prefill, or its room waits out a deadline: the driver's `send`.
      this.perform(admitted.actions);
      return { refused: admitted.refused };
    }
    const { trace: _trace, ...fields } = ask;
    const job: DecodeJob<C> = { ...fields, ac: new AbortController(), ready: deferred(), t0: this.now };
    this.jobs.set(room, job);
    this.o.traces.set(room, ask.trace);
    this.o.log.debug({ rid: ask.rid, room, trace: ask.trace }, 'room created');
    this.perform(admitted.actions);
    return { job };
  }

  /** Abort by room id and/or rid (router, client gone, local); also stops a generation in progress. `cause`: why, when the router said. */
  abort(rid: string | undefined, room: RoomId | undefined, from: 'router' | 'client' | 'local', cause?: RoomFailure): void {
    const id = room ?? (rid !== undefined ? this.driver.roomOfRid(rid) : undefined);
    this.perform(this.driver.abort(rid, room, from, this.now, cause));
    const job = id !== undefined ? this.jobs.get(id) : undefined;
    if (!job) return;
    if (from === 'router') job.abortedBy ??= cause ?? failure('request_aborted', 'aborted by POST /abort_request');
    job.ac.abort();
  }

  /** The room's stream is over (or never started): the driver releases its slot. */
  generationDone(room: RoomId): void {
    this.perform(this.driver.generationDone(room, this.now));
  }

  /**
   * The room's first decode step after its state load has run (the worker's second token): the
   * state file the load read is cleaned up now (`DecodeJob.loadedFileCleanup`). A no-op for a
   * room that holds none (decode-local, already cleaned, or gone).
   */
  stepped(room: RoomId): void {
    this.cleanLoadedFile(this.jobs.get(room));
  }

  /** Run the job's held state-file cleanup once; a failure is logged (the dead-pid sweep is the backstop). */
  private cleanLoadedFile(job: DecodeJob<C> | undefined): void {
    const clean = job?.loadedFileCleanup;
    if (!job || !clean) return;
    job.loadedFileCleanup = undefined;
    clean().catch((err: unknown) => this.o.log.warn({ room: job.room, err: String(err) }, 'could not clean up a loaded state file'));
  }

  /** One watchdog tick: the driver's deadline checks. */
  tick(): void {
    this.perform(this.driver.tick(this.now));
  }

  /** Fail every live room and stop what runs for them (the worker is closing). */
  shutdown(): void {
    this.perform(this.driver.shutdown(this.now));
    for (const j of this.jobs.values()) j.ac.abort();
  }

  /** The KV connection `conn` is gone: fail the rooms registered on it. false: it carried none (never used here). */
  peerLost(conn: C, reason: string): boolean {
    const id = this.connIds.get(conn);
    if (id === undefined) return false;
    this.conns.delete(id);
    this.perform(this.driver.peerLost(id, reason, this.now));
    return true;
  }

  /** A control message from prefill on `conn`. */
  onControl(conn: C, msg: ControlMsg): void {
    switch (msg.type) {
      case 'registered':
      case 'kv_begin':
      case 'kv_end':
      case 'kv_file':
      case 'fail':
        this.perform(this.driver.message(this.idOf(conn), conn.peerEpoch, msg, this.now));
        return;
      case 'same_host_reply':
        this.o.sameHost.onReply(conn, msg);
        return;
      default:
        this.o.log.warn({ type: msg.type, peer: conn.id }, 'unexpected control message on decode');
    }
  }

  /** A chunk of `room`'s state from prefill on `conn`. */
  onChunk(conn: C, room: RoomId, offset: number, data: Buffer): void {
    const { store, actions } = this.driver.chunk(this.idOf(conn), room, offset, data.length, this.now);
    if (store) {
      const recv = this.jobs.get(room)?.recv;
      try {
        if (!recv) throw new InternalError('no receiver for an accepted chunk');
        recv.push(data, conn);
        this.o.metrics.kvBytes.inc(data.length);
      } catch (err) {
        this.perform(actions);
        const full = this.o.space?.judge(err, undefined, true) === true;
        this.perform(this.driver.fail(room, full ? failure('state_dir_full', this.o.space!.message('decode')) : failure(intakeCode(err), (err as Error).message), this.now));
        return;
      }
    }
    this.perform(actions);
  }

  /** The id the driver knows `conn` by (a new id per connection object). */
  idOf(conn: C): ConnId {
    let id = this.connIds.get(conn);
    if (id === undefined) {
      id = `${conn.id}/${++this.connSeq}`;
      this.connIds.set(conn, id);
      this.conns.set(id, conn);
    }
    return id;
  }

  // ---- the driver's actions ------------------------------------------------------------------

  /** Perform the driver's actions, in order. */
  perform(actions: DecodeAction[]): void {
    for (const a of actions) {
      switch (a.a) {
        case 'assign_slot': {
          const job = this.jobs.get(a.room);
          // A local room's prompt picks the kept sequence holding its prefix.
          const slot = this.o.engine.tryAcquireSlot(job?.local?.tokens, job?.salt, job?.retention);
          if (job && slot) job.slot = slot;
          else {
            slot?.release();
            this.o.log.error({ room: a.room }, 'the engine had no free sequence for a slot the driver handed out');
            this.perform(this.driver.fail(a.room, failure('engine_failed', 'no free decode sequence'), this.now));
          }
          break;
        }
        case 'release': {
          const job = this.jobs.get(a.room);
          if (a.slot) job?.slot?.release();
          if (job) this.o.traces.note(a.room, { path: pathOf(job), kv_path: job.kvPath ?? null, cached_tokens: cachedOf(job), evicted: job.slot?.evicted ?? [] }); // kept for its `recent` row
          this.cleanLoadedFile(job);
          this.jobs.delete(a.room);
          break;
        }
        case 'dial':
          void this.dial(a.room, a.addr);
          break;
        case 'register':
          if (!this.conns.get(a.conn)?.sendControl(a.msg)) this.perform(this.driver.registerFailed(a.room, failure('peer_lost', 'connection closed before register'), this.now));
          break;
        case 'send':
          this.send(a);
          break;
        case 'recv_begin':
          this.recvBegin(a.room, a.totalBytes, a.hintBytes);
          break;
        case 'load':
          void this.load(a.room, a.end);
          break;
        case 'local_prefill':
          void this.runLocal(a.room);
          break;
        case 'take_file':
          void this.takeFile(a.room, a.msg);
          break;
        case 'generate': {
          const job = this.jobs.get(a.room);
          if (job?.start) job.ready.resolve(job.start);
          else this.perform(this.driver.generationDone(a.room, this.now));
          break;
        }
        case 'finish':
          this.finish(a);
          break;
        case 'diag':
          this.o.metrics.recordDiagnostic(a.effect, this.o.log, this.o.traces.get(a.effect.room));
          break;
        case 'stray':
          this.o.log.debug({ room: a.room, peer: a.conn, type: a.what }, 'message for a room not registered on this connection: ignored');
          break;
      }
    }
  }

  /** The one answer per room (the driver's `finish`): metrics, receive buffer, the request's promise. */
  private finish(a: Extract<DecodeAction, { a: 'finish' }>): void {
    const job = this.jobs.get(a.room);
    const m = this.o.metrics;
    m.recordTerminal(a.state, a.failure, a.registered);
    if (!job) return;
    if (job.recv && a.state !== KVPoll.Success) void job.recv.discard();
    if (a.state === KVPoll.Success) {
      if (job.tKvBegin) m.kvSeconds.observe((this.now - job.tKvBegin) / 1000);
      if (job.kvPath) m.kvHandoffs.inc({ path: job.kvPath }); // decode-local rooms had no handoff
      return; // the stream starts on `generate`
    }
    job.ac.abort();
    job.ready.reject(ApiError.fromFailure(a.failure ?? failure('internal_error', 'room failed')));
  }

  /** A control message to prefill: on its connection if alive, else (with `addr`) on a pooled one — opened if needed. */
  private send(a: Extract<DecodeAction, { a: 'send' }>): void {
    const conn = a.conn !== undefined ? this.conns.get(a.conn) : undefined;
    if (conn?.alive) {
      conn.sendControl(a.msg);
      return;
    }
    if (a.addr === undefined) return;
    const { host, port } = splitAddr(a.addr);
    this.o.dial(host, port).then(
      (c) => void c.sendControl(a.msg),
      (err: Error) => this.o.log.debug({ room: a.room, prefill: a.addr, err: err.message }, 'could not tell prefill about a failed room'),
    );
  }

  /** The driver's `dial`: open (or reuse) the pooled connection to the room's prefill; answer `dialed` / `registerFailed`. */
  private async dial(room: RoomId, addr: PrefillAddr): Promise<void> {
    const job = this.jobs.get(room);
    if (!job) return;
    await this.o.testHooks.hold('decode.register', job.ac.signal);
    let conn: C;
    try {
      conn = await this.o.dial(job.host, job.port);
    } catch (err) {
      const code = errorCodeOf(err) === 'settings_mismatch' ? 'settings_mismatch' : 'peer_unreachable';
      this.perform(this.driver.registerFailed(room, failure(code, `cannot pair with prefill ${addr}: ${(err as Error).message}`), this.now));
      return;
    }
    // A new connection's same-host probe settles first (bounded), so its first room can use it.
    await this.o.sameHost.ready(conn);
    this.perform(this.driver.dialed(room, this.idOf(conn), this.now));
  }

  /** The driver's `recv_begin`: a streamed receiver that validates and writes the state as it comes. */
  private recvBegin(room: RoomId, totalBytes: number, hintBytes?: number): void {
    const job = this.jobs.get(room);
    if (!job) return;
    job.recv = this.o.receive(room, totalBytes, hintBytes);
    job.kvPath = 'tcp';
    job.tKvBegin = this.now;
  }

  // ---- the engine port ------------------------------------------------------------------------

  /** The driver's `load`: finish the streamed receive (complete, checksum, structure end, file written), load it into the slot. */
  private async load(room: RoomId, end?: StreamEnd): Promise<void> {
    const job = this.jobs.get(room);
    const recv = job?.recv;
    if (!job || !recv) return this.perform(this.driver.loadFailed(room, failure('internal_error', 'load without a receiver'), this.now));
    // after the load settled nothing reads the file: it goes back to the spare files (a failure
    // meanwhile — finish Failed — discards it, deleting a file a running load may still read)
    await this.loadInto(job, () => recv.finish(end), () => recv.done());
  }

  /**
   * The driver's `take_file` (same host): take the handed file over and validate it (the
   * same-host port: size, envelope head, ggsq headers; the data bytes' CRC-32 too with
   * --kv-same-host-verify), then load it as a received one. Refused (still prefill's) →
   * `fileRefused` (prefill sends over TCP); a bad file → `loadFailed`.
   */
  private async takeFile(room: RoomId, msg: Extract<ControlMsg, { type: 'kv_file' }>): Promise<void> {
    const job = this.jobs.get(room);
    if (!job) return this.perform(this.driver.loadFailed(room, failure('internal_error', 'kv_file without a request'), this.now));
    job.kvPath = 'same_host';
    await this.o.testHooks.hold('decode.take', job.ac.signal);
    // The room over: the file stays prefill's (it deletes it, or the sweep once it is gone).
    const over = this.driver.proceed(room, 'take', this.now);
    if (over) return this.perform(over);
    let taken: ReceivedState<ParsedState>;
    try {
      const out = this.o.sameHost.take(msg);
      if ('refused' in out) {
        this.o.metrics.kvFileRefused.inc();
        this.o.log.warn({ room, reason: out.refused }, 'state file (kv_file) refused: asking prefill for TCP');
        return this.perform(this.driver.fileRefused(room, out.refused, this.now));
      }
      taken = out.taken;
    } catch (err) {
      return this.perform(this.driver.loadFailed(room, failure('bad_state', (err as Error).message), this.now));
    }
    job.tKvBegin = this.now;
    this.perform(this.driver.fileTaken(room, msg.payloadBytes, this.now));
    await this.loadInto(job, async () => taken, () => this.o.files.remove(taken.path));
  }

  /**
   * Load the validated state `get` yields into the slot; answer `loadDone` / `loadFailed`.
   * `cleanup` deletes its file whatever happened: at once when the load did not succeed, else
   * after the room's first decode step (`loadedFileCleanup`).
   */
  private async loadInto(job: DecodeJob<C>, get: () => Promise<ReceivedState<ParsedState>>, cleanup: () => Promise<void>): Promise<void> {
    const { room } = job;
    let held = false;
    try {
      await this.o.testHooks.hold('decode.load', job.ac.signal);
      const over = this.driver.proceed(room, 'load', this.now);
      if (over) return this.perform(over);
      const { header, state, path } = await get();
      if (state.nTokens !== header.nTokens) throw new PdError('BAD_STATE', `state holds ${state.nTokens} tokens, envelope says ${header.nTokens}`);
      const gone = this.driver.proceed(room, 'load', this.now);
      if (gone || !job.slot) return this.perform(gone ?? this.driver.loadFailed(room, failure('internal_error', 'no engine slot for the load'), this.now));
      // the walk above covered this file (ours): llama.cpp loads it as it is, re-framed in place
      await job.slot.loadState(path, state.tokens, state);
      job.promptIds = state.tokens;
      job.header = header;
      job.start = { promptTokens: header.nTokens, cachedTokens: header.cachedTokens ?? 0, firstToken: header.firstToken };
      // held before loadDone: a room that ended meanwhile is released inside it, and cleans up there
      job.loadedFileCleanup = cleanup;
      held = true;
      this.perform(this.driver.loadDone(room, this.now));
    } catch (err) {
      const e = err as { code?: string; message?: string };
      if (this.o.space?.judge(err, undefined, true)) return this.perform(this.driver.loadFailed(room, failure('state_dir_full', this.o.space.message('decode')), this.now));
      this.perform(this.driver.loadFailed(room, failure(e.code === 'BAD_ENVELOPE' || e.code === 'BAD_STATE' || e.code === 'STATE_TOO_LARGE' ? intakeCode(err) : 'engine_failed', e.message ?? String(err)), this.now));
    } finally {
      if (!held) await cleanup();
    }
  }

  /** The driver's `local_prefill`: evaluate the uncached suffix on the room's slot (./local.ts); answer `loadDone` / `loadFailed`. */
  private async runLocal(room: RoomId): Promise<void> {
    const job = this.jobs.get(room);
    if (!job?.local || !job.slot) return this.perform(this.driver.loadFailed(room, failure('internal_error', 'local prefill without a plan or slot'), this.now));
    try {
      await this.o.testHooks.hold('decode.local_prefill', job.ac.signal);
      const over = this.driver.proceed(room, 'local_prefill', this.now);
      if (over) return this.perform(over);
      const start = await localPrefill(job.slot, job.local, job.ac.signal);
      job.start = start;
      this.o.prefixMetrics.recordLookup(start.promptTokens, start.cachedTokens, start.cacheTier);
      this.perform(this.driver.loadDone(room, this.now));
    } catch (err) {
      const e = toApiError(err);
      this.perform(this.driver.loadFailed(room, failure(e.status < 500 ? (e.code as RoomFailure['code']) : 'engine_failed', e.message), this.now));
    }
  }
}

/** The room failure code of a receive that threw: a state over the limit, else a bad state. */
function intakeCode(err: unknown): 'kv_state_too_large' | 'bad_state' {
  return (err as { code?: unknown })?.code === 'STATE_TOO_LARGE' ? 'kv_state_too_large' : 'bad_state';
}

/** "host:port" (the host may be an IPv6 literal) → its parts. */
function splitAddr(addr: PrefillAddr): { host: string; port: number } {
  const i = addr.lastIndexOf(':');
  return { host: addr.slice(0, i), port: Number(addr.slice(i + 1)) };
}
