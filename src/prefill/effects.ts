/**
 * Prefill's effect executor: everything the prefill worker does for a room between its admission
 * and its answer, over ports — the engine, the KV connections, the state sender, the same-host
 * handoff, the state files and the clock. It holds the shell's per-room and per-computation
 * records, feeds every input to the sans-IO `PrefillDriver` (driver.ts) and performs every
 * `PrefillAction` it returns, in order. The worker (worker.ts) runs it over the real ports
 * (llama.cpp, TCP/TLS, node:fs, the process clock); the simulator (src/sim) over fakes on virtual
 * time — one copy of the room handling, as TigerBeetle's simulator runs its real replica.
 *
 * Queues (SGLang's names): bootstrap (rooms in phase 'bootstrap'), waiting (registered, queued for
 * or in prompt evaluation), inflight (state sent, waiting for decode's KV_ACK). Each entry leaves
 * on the single `finish` action of its room.
 */
import { join } from 'node:path';
import { ApiError, errorCodeOf, failure } from '../base/errors.js';
import type { Clock, Timers } from '../base/clock.js';
import type { Logger } from '../base/log.js';
import type { GenerateEvent, PrefillResponse } from '../protocol/worker-protocol.js';
import type { TraceTags } from '../protocol/trace-tags.js';
import { deferred, type Deferred } from '../worker/http.js';
import type { SequenceKvTracker } from '../worker/kv-tracker.js';
import type { TestHooks } from '../runtime/testhooks.js';
import type { WorkerMetrics } from '../runtime/metrics.js';
import type { PrefixCacheMetrics } from '../prefixes/prefix-metrics.js';
import type { StateFiles } from '../runtime/statefiles.js';
import type { StateSpacePort } from '../runtime/state-space.js';
import type { PrefillConfig } from '../config/config.js';
import type { Engine, Retention, SamplingParams, Slot } from '../engine/types.js';
import type { KvConn } from '../kv/channel.js';
import { encodeEnvelopeHead, prepareEnvelopeHead } from '../kv/envelope.js';
import { wireBytes, type StreamedSend } from '../kv/transfer/sender.js';
import { prefillStateName, type KvPath } from '../kv/transfer/same-host.js';
import type { ControlMsg } from '../kv/messages.js';
import { KVPoll, type RoomId } from '../kv/types.js';
import type { ComputeOutcome, PrefillAction, PrefillDriver } from './driver.js';
import { firstTokenEvent } from './first-token.js';
import { firstTokenAfterSave } from './computation.js';
import type { Computation, ComputationMetrics } from './computation.js';

/** Options of one streamed send (the sender port adds its buffers and I/O thread). */
export interface SendOptions {
  chunkBytes: number;
  signal: AbortSignal;
  /** Longest wait for the socket to take more bytes, ms. */
  stallMs: number;
  /** Bytes handed to the socket since the last call. */
  onProgress(bytes: number): void;
}

/** Options of a send that starts while the state is still being saved (`--kv-stream`). */
export interface GrowingSendOptions extends SendOptions {
  /** Settles with the payload size when the save is over (rejects when it failed). */
  saved: Promise<number>;
  /** Longest wait for the growing file to grow, ms. */
  growStallMs: number;
  /** Longest wait for llama.cpp to create the file, ms. */
  createWaitMs: number;
  /** The file exists: send kv_begin now (false: the connection is gone). */
  onFileStart(): boolean;
}

/**
 * The state sender port (real: ../kv/transfer/sender.ts over pooled buffers and the KV I/O
 * thread): a saved file's head + payload as chunks of `room`, and the same for a file still
 * growing. Both reject on a socket failure (code PEER_LOST when the connection went) or a stall.
 */
export interface StateSender<C extends KvConn> {
  sendFile(conn: C, room: RoomId, path: string, head: Buffer, payloadBytes: number, o: SendOptions): Promise<void>;
  sendGrowing(conn: C, room: RoomId, path: string, head: Buffer, o: GrowingSendOptions): Promise<StreamedSend>;
}

/** The same-host handoff port (real: ../kv/transfer/same-host.ts `SameHostPrefill`). */
export interface SameHostOffer {
  /** A same_host_probe / same_host_ok from connection `connId`: the reply to send, if any. */
  onMessage(connId: string, msg: Extract<ControlMsg, { type: 'same_host_probe' | 'same_host_ok' }>): ControlMsg | undefined;
  /** Decode on `connId` proved it shares this host and state directory. */
  usable(connId: string): boolean;
  forget(connId: string): void;
  /** The kv_file naming `path` (the room's own link) for decode on `connId`. @throws when the file cannot be read (verify). */
  offer(connId: string, room: RoomId, path: string, head: Buffer, payloadBytes: number): Extract<ControlMsg, { type: 'kv_file' }>;
}

/** The engine port: slot leases and the identity fields an envelope head names. */
export type PrefillEngine = Pick<Engine, 'tryAcquireSlot'> & { readonly info: Pick<Engine['info'], 'fingerprint' | 'compat'> };

/** Everything the executor runs over. */
export interface PrefillEffectsOptions<C extends KvConn> {
  driver: PrefillDriver;
  config: Pick<PrefillConfig, 'stateDir' | 'kvStream' | 'firstTokenAfterSave' | 'chunkBytes' | 'timeouts'>;
  engine: PrefillEngine;
  sender: StateSender<C>;
  sameHost: SameHostOffer;
  files: StateFiles;
  /** Judges a failed save: a full state directory fails the room `state_dir_full` (../runtime/state-space.ts); absent: never. */
  space?: StateSpacePort;
  clock: Clock;
  /** One event-loop turn (`turn`) while llama.cpp starts a save. */
  timers: Pick<Timers, 'turn'>;
  /** Owner id in state-file names (`process.pid`; the simulator: the node's incarnation). */
  pid: number;
  metrics: WorkerMetrics;
  computeMetrics: ComputationMetrics;
  prefixMetrics: PrefixCacheMetrics;
  kvTracker: SequenceKvTracker | null;
  traces: TraceTags;
  log: Logger;
  /** Test-only hold points (../runtime/testhooks.ts); production and the simulator: `noTestHooks`. */
  testHooks: TestHooks;
}

/** The executor's record of one room: what the driver does not need (I/O handles, timings). */
export interface PrefillJob {
  rid: string;
  /** The computation this room takes its state from (shared by the rooms of one request). */
  comp: Computation;
  /** Fires when the room becomes terminal: stops its send. */
  ac: AbortController;
  /** Resolves at Success with the answer; rejects with an ApiError at Failed. */
  done: Deferred<PrefillResponse>;
  /** Set when the router asked for the first token before the handoff (`first_token_from_prefill`). */
  first?: Deferred<GenerateEvent>;
  t0: number;
  /** When the driver's `transfer` began (monotonic ms; 0 before): progress is reported from then. */
  tKvBegin: number;
  /** Streamed handoff (`--kv-stream`): when its kv_begin went out, during the save (monotonic ms). */
  tStreamStart?: number;
  /** How the state went to decode (set when the transfer starts). */
  kvPath?: KvPath;
  /**
   * Same host: this room's hard link to the computation's state file (`prefillStateName`), handed
   * over by kv_file. The room owns it until decode renames it; deleted (a no-op once taken) at the
   * room's finish.
   */
  handed?: { path: string; payloadBytes: number };
  /** TCP, streamed (`startStream`): settles with what kv_end must say, or undefined once the room was failed for it. */
  stream?: Promise<StreamedSend | undefined>;
  /** Bytes the streamed send flushed before the driver's `transfer` (reported to it then). */
  earlyBytes?: number;
}

/** One admitted prefill request: its rooms' records, lead first. */
export type PrefillAdmission = { refused: ApiError } | { refused?: undefined; jobs: PrefillJob[] };

/** The request a prefill worker admits (parsed, tokenized, sampling fitted). */
export interface PrefillAsk {
  /** Every room the request names; the first is the lead (= bootstrap_room). */
  rooms: RoomId[];
  rid: string;
  tokens: number[];
  sampling: SamplingParams;
  /** The router takes the first token from prefill (`first_token_from_prefill`). */
  first: boolean;
  trace: string;
  conversationKey?: string;
  /** The request's cache salt (its tenant): the prefix cache reuses only this salt's KV. */
  salt?: string;
  /** How long its kept sequence is retained (`retention` of /generate; engine/prefix-cache.ts). */
  retention?: Retention;
}

/** Prefill's room handling over ports (see the module doc). Create one per worker process. */
export class PrefillEffects<C extends KvConn> {
  readonly driver: PrefillDriver;
  private readonly jobs = new Map<RoomId, PrefillJob>();
  /** Computations by lead room, until the driver's `discard` (or a compute that ended without a state). */
  private readonly comps = new Map<RoomId, Computation>();
  private readonly conns = new Map<string, C>();
  /** Decode connections whose `register` said `kvStream` (they take a streamed kv_begin). */
  private readonly streamPeers = new Set<string>();
  /** The last saved state: prompt tokens, payload bytes (a streamed kv_begin's size estimate) and how long llama.cpp took, ms. */
  private lastSave: { nTokens: number; payloadBytes: number; ms: number } | undefined;

  constructor(private readonly o: PrefillEffectsOptions<C>) {
    this.driver = o.driver;
  }

  private get now(): number {
    return this.o.clock.nowMs();
  }

  /** Prompt tokens of the computations not evaluated yet (the planner's prefill load: Dynamo's queued prefill tokens). */
  queuedPromptTokens(): number {
    let n = 0;
    for (const lead of this.driver.pendingComputations()) n += this.comps.get(lead)?.tokens.length ?? 0;
    return n;
  }

  /** The room's record (for /debug/rooms), if it is live here. */
  job(room: RoomId): PrefillJob | undefined {
    return this.jobs.get(room);
  }

  /**
   * Admit a request: the driver's `request`, then one record per room and the driver's actions.
   * Returns the refusal (an ApiError to answer with), or the rooms' records (lead first) whose
   * `done` (and `first`) promises carry the answer.
   */
  admit(ask: PrefillAsk): PrefillAdmission {
    const { rooms } = ask;
    const admitted = this.driver.request(rooms, ask.rid, this.now);
    if (admitted.refused) return { refused: admitted.refused };
    const comp: Computation = { lead: rooms[0]!, rooms, tokens: ask.tokens, sampling: ask.sampling, ac: new AbortController(), heads: new Map(), prefillMs: 0, cachedTokens: 0, ...(ask.conversationKey ? { key: ask.conversationKey } : {}), ...(ask.salt !== undefined ? { salt: ask.salt } : {}), ...(ask.retention ? { retention: ask.retention } : {}) };
    this.comps.set(comp.lead, comp);
    const jobs = rooms.map((r) => {
      const job: PrefillJob = { rid: ask.rid, comp, ac: new AbortController(), done: deferred(), t0: this.now, tKvBegin: 0, first: ask.first ? deferred() : undefined };
      this.o.traces.set(r, ask.trace);
      this.jobs.set(r, job);
      return job;
    });
    this.o.log.debug({ rid: ask.rid, room: comp.lead, trace: ask.trace, tokens: ask.tokens.length, rooms: rooms.length }, 'room created');
    this.perform(admitted.actions);
    return { jobs };
  }

  /** Abort by rid and/or room id; unknown ids leave a tombstone (when the room id is known). */
  abort(rid: string | undefined, room: RoomId | undefined, from: 'router' | 'local'): void {
    this.perform(this.driver.abort(rid, room, from, this.now));
  }

  /** The router gave up every room of one request (its client went away). */
  abortRooms(rooms: readonly RoomId[]): void {
    this.perform(rooms.flatMap((r) => this.driver.abort(undefined, r, 'router', this.now)));
  }

  /** One watchdog tick: the driver's deadline checks. */
  tick(): void {
    this.perform(this.driver.tick(this.now));
  }

  /** Fail every live room (the worker is closing). */
  shutdown(): void {
    this.perform(this.driver.shutdown(this.now));
  }

  /** The KV connection `conn` is gone: fail the rooms bound to it. */
  peerLost(conn: C, reason: string): void {
    this.conns.delete(conn.id);
    this.streamPeers.delete(conn.id);
    this.o.sameHost.forget(conn.id);
    this.perform(this.driver.peerLost(conn.id, reason, this.now));
  }

  /** A control message from decode on `conn`. */
  onControl(conn: C, msg: ControlMsg): void {
    this.conns.set(conn.id, conn);
    if (msg.type === 'same_host_probe' || msg.type === 'same_host_ok') {
      const reply = this.o.sameHost.onMessage(conn.id, msg);
      if (reply) conn.sendControl(reply);
      if (this.o.sameHost.usable(conn.id)) this.driver.sameHostConfirmed(conn.id);
      return;
    }
    if (msg.type === 'kv_file_refused') {
      // decode could not take the handed file: the driver sends a live room again over TCP (from its link)
      const again = this.driver.fileRefused(conn.id, msg.room);
      if (again.length > 0) {
        this.o.metrics.kvFileRefused.inc();
        this.o.log.warn({ room: msg.room, reason: msg.reason }, 'decode refused the state file (kv_file): sending it over TCP');
      }
      this.perform(again);
      return;
    }
    if (msg.type === 'register' && msg.kvStream === true) this.streamPeers.add(conn.id);
    if (msg.type === 'register' || msg.type === 'kv_ack' || msg.type === 'fail') {
      this.perform(this.driver.message(conn.id, conn.peerEpoch, msg, this.now));
      return;
    }
    this.o.log.warn({ type: msg.type, peer: conn.id }, 'unexpected control message on prefill');
  }

  // ---- the driver's actions ----------------------------------------------------------------

  /** Perform the driver's actions, in order. */
  perform(actions: PrefillAction[]): void {
    for (const a of actions) {
      switch (a.a) {
        case 'send':
          this.conns.get(a.peer)?.sendControl(a.msg);
          break;
        case 'compute':
          void this.compute(a.room);
          break;
        case 'transfer':
          void this.transfer(a.room, a.peer, a.path);
          break;
        case 'discard': {
          const comp = this.comps.get(a.room);
          this.comps.delete(a.room);
          if (comp) this.dropState(comp);
          break;
        }
        case 'cancel':
          this.comps.get(a.room)?.ac.abort();
          break;
        case 'finish':
          this.finish(a);
          break;
        case 'diag':
          this.o.metrics.recordDiagnostic(a.effect, this.o.log, this.o.traces.get(a.effect.room));
          break;
        case 'registration_expired':
          this.o.metrics.bootstrapFailed.inc({ reason: 'registration_refused' });
          break;
        case 'fault_leak':
          this.o.log.warn({ room: a.room }, 'FAULT INJECTION (PDSERVE_FAULT_LEAK_ROOM=1): leaking this room');
          break;
      }
    }
  }

  /** The one release path of a room's resources (the driver's single `finish` per room). */
  private finish(a: Extract<PrefillAction, { a: 'finish' }>): void {
    const job = this.jobs.get(a.room);
    if (!job) return;
    this.jobs.delete(a.room);
    job.ac.abort(); // the state file is the computation's: released by the driver's `discard`
    // Same host: the room's own link, unless decode took it over (renamed it) already.
    if (job.handed) void this.o.files.remove(job.handed.path);
    const m = this.o.metrics;
    m.recordTerminal(a.state, a.failure, a.registered);
    if (a.state === KVPoll.Success) {
      m.kvSeconds.observe((this.now - (job.tStreamStart ?? job.tKvBegin)) / 1000);
      m.kvHandoffs.inc({ path: job.kvPath ?? 'tcp' });
      if (job.tStreamStart !== undefined && job.kvPath === 'tcp') m.kvStreamed?.inc();
      job.done.resolve({
        rid: job.rid,
        meta_info: { prompt_tokens: job.comp.tokens.length, cached_tokens: job.comp.cachedTokens, kv_bytes: a.bytes, prefill_ms: job.comp.prefillMs, transfer_ms: Math.round(this.now - (job.tStreamStart ?? job.tKvBegin)) },
      });
    } else {
      job.done.reject(ApiError.fromFailure(a.failure ?? failure('internal_error', 'room failed')));
    }
  }

  /** Delete the computation's state file once (it no longer names it afterwards). */
  private dropState(comp: Computation): void {
    const st = comp.state;
    comp.state = undefined;
    if (st) void this.o.files.remove(st.path);
  }

  // ---- the engine and sender ports ------------------------------------------------------------

  /** Prompt evaluation of a computation the driver started (`compute`, by its lead room); ends in `driver.computeDone`. */
  private async compute(lead: RoomId): Promise<void> {
    const comp = this.comps.get(lead);
    // The prompt picks the idle sequence sharing its longest prefix (prefix cache).
    const slot = comp && !comp.ac.signal.aborted ? this.o.engine.tryAcquireSlot(comp.tokens, comp.salt, comp.retention) : null;
    const done = (o: ComputeOutcome): void => {
      if (!o.ok) this.comps.delete(lead);
      this.perform(this.driver.computeDone(lead, o, this.now));
    };
    if (comp && slot?.evicted) comp.evicted = slot.evicted; // the same array: the release's evictions join it
    if (!comp || !slot) {
      slot?.release();
      return done(comp && !comp.ac.signal.aborted ? { ok: false, failure: failure('engine_failed', 'no free prefill sequence') } : { ok: false, aborted: true });
    }
    done(await this.evaluate(comp, slot));
  }

  /**
   * Evaluate the computation's prompt on `slot` ONCE, sample one first token per room (room i
   * with seed + i), save the state file once and make each room's envelope head. Never throws.
   */
  private async evaluate(comp: Computation, slot: Slot): Promise<ComputeOutcome> {
    const { config, files } = this.o;
    // Not a room's name (`prefillStateName`): on the same-host path each room gets its own link.
    const path = join(config.stateDir, `pdserve-prefill-${this.o.pid}-${comp.lead}-saved.ggsq`);
    const signal = comp.ac.signal;
    let saveFailed = false;
    try {
      await this.o.testHooks.hold('prefill.compute', signal);
      const t0 = this.now;
      this.o.computeMetrics.computations.inc();
      this.o.computeMetrics.roomsPerComputation.observe(comp.rooms.length);
      const r = await slot.prefill(comp.tokens, comp.sampling, signal, comp.rooms.length);
      comp.cachedTokens = r.cachedTokens;
      this.o.computeMetrics.evaluatedTokens.inc(r.promptTokens - r.cachedTokens);
      this.o.prefixMetrics.recordLookup(r.promptTokens, r.cachedTokens, r.cacheTier);
      const firsts: (() => void)[] = [];
      for (let i = 0; i < comp.rooms.length; i++) {
        const job = this.jobs.get(comp.rooms[i]!);
        const pick = r.choices[i]!;
        // A migrated request's state also holds its resumed tokens: they count as completion tokens.
        const resumed = comp.sampling.resumed?.length ?? 0;
        if (job?.first) {
          const ev = firstTokenEvent(job.rid, r.promptTokens - resumed, { ...(await slot.firstOutput(pick.firstToken, comp.sampling)), logprob: pick.firstLogprob }, r.cachedTokens, resumed);
          firsts.push(() => job.first!.resolve(ev));
        }
      }
      const holdFirst = firsts.length > 0 && firstTokenAfterSave(this.o.config.firstTokenAfterSave, this.lastSave, r.promptTokens, this.now - t0);
      if (!holdFirst) for (const send of firsts.splice(0)) send();
      await this.o.testHooks.hold('prefill.save', signal);
      if (signal.aborted) return { ok: false, aborted: true };
      files.removeNow(path); // a streamed send reads the file as it grows: no stale bytes
      const tSave = this.now;
      const saving = slot.saveState(path);
      saving.catch(() => {}); // awaited below; not unhandled while the heads are prepared
      const streamedBytes = this.startStream(comp, r.promptTokens, r.cachedTokens, r.choices[0]!, path, saving);
      // Each room's envelope head, all but the size, while llama.cpp saves (saveState first
      // reaches the native save through a few promise steps: one event-loop turn lets it start,
      // then this runs beside it instead of after it on the handoff's critical path).
      await this.o.timers.turn();
      const info = this.o.engine.info;
      let heads: ((payloadBytes: number) => Buffer)[] = [];
      let headError: unknown;
      try {
        heads = comp.rooms.map((_, i) => {
          const pick = r.choices[i]!;
          return prepareEnvelopeHead({ fingerprint: info.fingerprint, contextSize: info.compat.contextSize, batchSize: info.compat.batchSize, nTokens: r.promptTokens, firstToken: pick.firstToken, cachedTokens: r.cachedTokens, firstIsEog: pick.firstIsEog });
        });
      } catch (e) {
        headError = e; // thrown once the save is over (the slot is released after it)
      }
      const payloadBytes = await saving.catch((e: unknown) => {
        saveFailed = true;
        throw e;
      });
      this.o.space?.ok(payloadBytes);
      this.lastSave = { nTokens: r.promptTokens, payloadBytes, ms: this.now - tSave };
      if (headError !== undefined) throw headError;
      this.o.computeMetrics.statesSaved.inc();
      if (firsts.length > 0 && !signal.aborted) {
        this.o.computeMetrics.firstTokensAfterSave.inc(firsts.length);
        // The state is saved: token 1 leaves one event-loop turn later, once the driver's
        // `transfer` (after this returns) has begun the handoff — decode starts taking the state
        // while token 1 crosses the router, and the save is not in the gap to token 2.
        void this.o.timers.turn().then(() => {
          if (!signal.aborted) for (const send of firsts) send();
        });
      }
      const roomBytes = new Map<RoomId, number>();
      comp.rooms.forEach((room, i) => {
        const head = heads[i]!(payloadBytes);
        comp.heads.set(room, head);
        roomBytes.set(room, streamedBytes !== undefined && i === 0 ? streamedBytes + payloadBytes : wireBytes(head, payloadBytes));
      });
      comp.prefillMs = Math.round(this.now - t0);
      if (signal.aborted) return { ok: false, aborted: true };
      comp.state = { path, payloadBytes }; // the file is the computation's now: deleted by the driver's `discard`
      // the sequence keeps this prompt once released: the conversation's next round finds it here
      this.o.kvTracker?.noteFinished(comp.tokens, comp.salt);
      return { ok: true, totalBytes: roomBytes.get(comp.lead)!, roomBytes };
    } catch (err) {
      const e = err as { code?: string; message?: string };
      if (e.code === 'ABORTED' || signal.aborted) return { ok: false, aborted: true };
      // before the finally removes the partial file: it is part of the evidence
      if (saveFailed && this.o.space?.judge(err, path)) return { ok: false, failure: failure('state_dir_full', this.o.space.message('prefill')) };
      const code = errorCodeOf(err);
      return { ok: false, failure: failure(code === 'internal_error' ? 'engine_failed' : code, `prefill: ${e.message ?? String(err)}`) };
    } finally {
      slot.release();
      // the /debug/rooms rows of the rooms, after they end too: what this prompt reused and evicted
      for (const r of comp.rooms) this.o.traces.note(r, { cached_tokens: comp.cachedTokens, evicted: comp.evicted ?? [] });
      if (comp.state?.path !== path) await files.remove(path);
    }
  }

  /**
   * Start sending the state while llama.cpp saves it (the sender's `sendGrowing`), with
   * `--kv-stream` and when it fits: one room (n > 1 gives each room its own head: save, then
   * send), registered by a decode whose `register` said `kvStream`, on a TCP connection (same
   * host hands over the finished file instead). The streamed kv_begin (size: an estimate from the
   * last save) goes out once llama.cpp has created the file; records the send in the room's job;
   * the driver's `transfer` later finishes it with kv_end. A send that fails before the room is
   * done (the save failed or stopped growing, the socket) fails the room here; the room's end
   * (its `ac`) stops it. Returns the streamed envelope head's length (the room's wire bytes are
   * head + payload), or undefined when nothing was started.
   */
  private startStream(comp: Computation, nTokens: number, cachedTokens: number, pick: { firstToken: number; firstIsEog: boolean }, path: string, saved: Promise<number>): number | undefined {
    const { config } = this.o;
    if (!config.kvStream || comp.rooms.length !== 1) return undefined;
    const room = comp.lead;
    const job = this.jobs.get(room);
    const peer = this.driver.peerOf(room);
    if (!job || peer === undefined || job.ac.signal.aborted || !this.streamPeers.has(peer) || this.driver.pathFor(peer) === 'same_host') return undefined;
    const conn = this.conns.get(peer);
    if (!conn?.alive) return undefined;
    const info = this.o.engine.info;
    const head = encodeEnvelopeHead({ fingerprint: info.fingerprint, contextSize: info.compat.contextSize, batchSize: info.compat.batchSize, nTokens, firstToken: pick.firstToken, cachedTokens, firstIsEog: pick.firstIsEog, payloadBytes: 0 });
    // A state's size is affine in its token count with a small constant: the last save predicts it within a few hundred bytes.
    const last = this.lastSave;
    const estimate = last && last.nTokens > 0 ? Math.ceil((last.payloadBytes / last.nTokens) * Math.max(1, nTokens)) : 16 * 1024 * Math.max(1, nTokens);
    job.kvPath = 'tcp';
    job.earlyBytes = 0;
    job.stream = this.o.sender
      .sendGrowing(conn, room, path, head, {
        saved,
        chunkBytes: config.chunkBytes,
        signal: job.ac.signal,
        stallMs: config.timeouts.transferIdleMs,
        growStallMs: config.timeouts.transferIdleMs,
        // The save may first queue for the context's lock behind another sequence's evaluation:
        // that wait is bounded like any wait for input, and decode hears kv_begin only once
        // llama.cpp has created the file (its transfer-idle clock starts with the bytes).
        createWaitMs: config.timeouts.waitingMs,
        onFileStart: () => {
          job.tStreamStart = this.now;
          return conn.sendControl({ type: 'kv_begin', room, totalBytes: head.length + estimate, streamed: true });
        },
        onProgress: (bytes: number) => {
          this.o.metrics.kvBytes.inc(bytes);
          if (job.tKvBegin > 0) this.perform(this.driver.progress(room, bytes, this.now));
          else job.earlyBytes = (job.earlyBytes ?? 0) + bytes;
        },
      })
      .catch(async (err: unknown) => {
        if (job.ac.signal.aborted) return undefined;
        // the save itself failed (the send saw it first): a full state directory says so
        const saveErr: unknown = await saved.then(
          () => undefined,
          (e: unknown) => e ?? err,
        );
        if (saveErr !== undefined && this.o.space?.judge(saveErr, path)) this.perform(this.driver.transferFailed(room, failure('state_dir_full', this.o.space.message('prefill')), this.now));
        else this.perform(this.driver.transferFailed(room, failure(errorCodeOf(err) === 'peer_lost' ? 'peer_lost' : 'kv_transfer_failed', (err as Error).message), this.now));
        return undefined;
      });
    return head.length;
  }

  /**
   * Send the room's state to decode (`transfer`). On a same-host connection: the room's own hard
   * link to the state file (`prefillStateName`), named in one kv_file message (not read; CRC-32'd
   * only with --kv-same-host-verify on either side) (../kv/transfer/same-host.ts) — decode takes
   * it over by renaming it; the link is deleted at the room's finish if it is still ours. `path`
   * is the driver's choice (`PrefillDriver.pathFor`); 'tcp' (also a room whose file decode
   * refused, sent from its link): kv_begin, the file streamed in pooled pieces, kv_end.
   */
  private async transfer(room: RoomId, peer: string, path: KvPath): Promise<void> {
    const { config, files } = this.o;
    const job = this.jobs.get(room);
    const conn = this.conns.get(peer);
    const st = job?.handed ?? job?.comp.state;
    const head = job?.comp.heads.get(room);
    if (!job || !st || !head) return;
    job.tKvBegin = this.now;
    const failed = (detail: string, code: 'kv_transfer_failed' | 'peer_lost' = 'kv_transfer_failed'): void => this.perform(this.driver.transferFailed(room, failure(code, detail), this.now));
    // A state streamed while it was saved (startStream) already went over TCP.
    if (job.stream) {
      job.kvPath = 'tcp';
      // Streamed while the state was saved (startStream): report what went out meanwhile, wait
      // for the rest, then kv_end with the byte count and CRC-32. A failure was reported by it.
      if (job.earlyBytes) this.perform(this.driver.progress(room, job.earlyBytes, this.now));
      job.earlyBytes = 0;
      const sent = await job.stream;
      if (!sent || job.ac.signal.aborted) return;
      this.perform(this.driver.transferSent(room));
      await this.o.testHooks.hold('prefill.send', job.ac.signal);
      if (job.ac.signal.aborted) return;
      if (!conn || !conn.sendControl({ type: 'kv_end', room, totalBytes: sent.totalBytes, crc: sent.crc })) failed('connection to decode is gone');
      return;
    }
    job.kvPath = path;
    if (job.kvPath === 'same_host') {
      await this.o.testHooks.hold('prefill.send', job.ac.signal);
      if (job.ac.signal.aborted) return;
      try {
        const link = join(config.stateDir, prefillStateName(this.o.pid, room));
        if (job.comp.rooms.length === 1 && job.comp.state?.path === st.path) {
          // One room: the computation's file becomes the room's (one rename instead of link +
          // unlink, on the handoff's critical path): the data's only name, so decode may re-frame
          // it in place (it copies a file whose data another name shares). The driver's later
          // `discard` finds nothing.
          files.rename(st.path, link);
          job.comp.state = undefined;
        } else files.link(st.path, link);
        job.handed = { path: link, payloadBytes: st.payloadBytes };
        if (!conn || !conn.sendControl(this.o.sameHost.offer(peer, room, link, head, st.payloadBytes))) return failed('connection to decode is gone');
      } catch (err) {
        return failed((err as Error).message);
      }
      // The computation's file is no longer needed by this room (its link holds the data).
      this.perform(this.driver.transferSent(room));
      return;
    }
    if (!conn || !conn.sendControl({ type: 'kv_begin', room, totalBytes: wireBytes(head, st.payloadBytes) })) return failed('connection to decode is gone');
    try {
      await this.o.sender.sendFile(conn, room, st.path, head, st.payloadBytes, {
        chunkBytes: config.chunkBytes,
        signal: job.ac.signal,
        stallMs: config.timeouts.transferIdleMs,
        onProgress: (bytes: number) => {
          this.o.metrics.kvBytes.inc(bytes);
          this.perform(this.driver.progress(room, bytes, this.now));
        },
      });
      // The room no longer needs the state: the last room to get here releases it (`discard`).
      this.perform(this.driver.transferSent(room));
      await this.o.testHooks.hold('prefill.send', job.ac.signal);
      if (job.ac.signal.aborted) return;
      conn.sendControl({ type: 'kv_end', room });
    } catch (err) {
      if (!job.ac.signal.aborted) failed((err as Error).message, errorCodeOf(err) === 'peer_lost' ? 'peer_lost' : 'kv_transfer_failed');
    }
  }
}
