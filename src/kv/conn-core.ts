/**
 * The sans-IO core of one KV channel connection (either side): the frame decoder (frame.ts), the
 * handshake (handshake.ts) and liveness (heartbeat.ts) composed, with no socket and no timer of
 * its own — bytes and ticks in, writes and events out (nats.js keeps parser, heartbeat and
 * transport apart the same way; its protocol handler composes them).
 *
 * In: `receive(bytes)` (in order), `ping()` (every heartbeat interval), `check()` (when
 * `nextCheckInMs()` says a liveness check is due), `authExpired()` (the handshake deadline),
 * `sendControl(msg)`, `refuse(reason)` and `end()` from the owner. Out, through a `CoreSink`:
 * `write(frame)` (the bytes to put on the wire, in order), `opened`, `message`, `chunk`,
 * `stalled` and `ended` (once). `PeerConn` (connection.ts) runs it over a socket and node's
 * timers; the simulator (../sim) runs it over its fake links and virtual timers.
 * `runTimers` is the one schedule of its ticks (ping interval, liveness check after the poll
 * phase, handshake deadline), shared by both.
 */
import { encodeControl, FrameDecoder, type Frame } from './frame.js';
import { Handshake, type HandshakeStep } from './handshake.js';
import type { Clock, Timers } from '../base/clock.js';
import { Heartbeat, type HeartbeatVerdict } from './heartbeat.js';
import type { ControlMsg, PairSettings, PeerMsg } from './messages.js';
import { KvError, type RoomId } from './types.js';

/** Pino-compatible logger subset. */
export interface KvLog {
  info(obj: object, msg?: string): void;
  warn(obj: object, msg?: string): void;
  error(obj: object, msg?: string): void;
  debug(obj: object, msg?: string): void;
}

/** Counters of one KvServer or KvPeerPool (monotonic; export as Prometheus counters). */
export interface KvStats {
  framesIn: number;
  framesOut: number;
  bytesIn: number;
  bytesOut: number;
  /** Handshakes refused: bad mac, auth_fail received, timeout, wrong or unauthenticated frame. */
  authFailures: number;
  /** Connections closed for a malformed, oversized, unknown or out-of-place frame. */
  badFrames: number;
  /** register / kv_ack / fail messages refused because their epoch is not the connection's. */
  staleEpoch: number;
  /** Authenticated connections lost for a cause other than a local close()/destroy(). */
  peersLost: number;
  /** Handshakes refused because the pair's settings (model, context, batch, flash attention) differ. */
  settingsMismatch: number;
  /** Liveness checks that found THIS process's event loop had stalled (the peer was not blamed). */
  ownStalls: number;
}

/** Fresh zeroed counters. */
export function newKvStats(): KvStats {
  return { framesIn: 0, framesOut: 0, bytesIn: 0, bytesOut: 0, authFailures: 0, badFrames: 0, staleEpoch: 0, peersLost: 0, settingsMismatch: 0, ownStalls: 0 };
}

export const noop = (): void => {};
export const NOOP_LOG: KvLog = { info: noop, warn: noop, error: noop, debug: noop };

/** An error's code (errno-style) or message, for logs and reasons. */
export const errText = (e: unknown): string => (e instanceof Error ? ((e as NodeJS.ErrnoException).code ?? e.message) : String(e));

export type Side = 'prefill' | 'decode';

/**
 * What a role's room handling needs of one KV connection: `PeerConn` in the workers, the
 * simulator's connection in src/sim. `id`: stable for the connection; `alive`: authenticated and
 * not closed; `peerEpoch`: the peer's session epoch ('' before authentication); `sendControl`:
 * false when the message could not be queued (the connection is gone).
 */
export interface KvConn {
  readonly id: string;
  readonly alive: boolean;
  readonly peerEpoch: string;
  sendControl(msg: ControlMsg): boolean;
}

/** What opened a connection: the handshake's 'open' step. */
export type CoreOpen = Extract<HandshakeStep, { k: 'open' }>;

/** Why a core ended and how its owner should close. */
export interface CoreEnd {
  reason: string;
  /** The peer (or the wire) ended it, not a local close: counted as a lost peer. */
  lost: boolean;
  /** Prefill's refusal in the handshake: flush the auth_fail just written, then close. */
  graceful: boolean;
  /** Set when the handshake failed: the error the connection's `ready` rejects with. */
  failure?: KvError;
  /** Set when the heartbeat found the peer silent: for how long, ms. */
  silentMs?: number;
}

/** Where a core's writes and events go (its owner: a socket adapter, or the simulator). */
export interface CoreSink {
  /** Bytes for the wire, in order. False when they could not be queued (the owner has ended the core meanwhile). */
  write(frame: Buffer | Buffer[]): boolean;
  /** Authenticated: the peer's epoch, settings and agreed stripe count are bound (`core.peerEpoch` …). Chunk frames may follow in the same `receive`. */
  opened(step: CoreOpen): void;
  /** A room or same-host message whose epoch (if it carries one) is the connection's. */
  message(msg: PeerMsg): void;
  /** Chunk data of `room` at `offset` (a view into the bytes received: copy before returning). */
  chunk(room: RoomId, offset: number, data: Buffer): void;
  /** A liveness check found this process's own loop stalled for `lateMs`: the peer's budget restarted. */
  stalled(lateMs: number): void;
  /** The core gave up on the connection (once): close the transport. */
  ended(end: CoreEnd): void;
}

/** Options of a ConnCore. */
export interface ConnCoreOptions {
  side: Side;
  secret: string | Buffer;
  /** This process's session epoch. */
  epoch: string;
  /** This process's pair settings, exchanged in the handshake. */
  pair: PairSettings;
  /** Sockets this side stripes a connection over (the pair agrees on the smaller). */
  streams: number;
  /** Decode side: this connection joins the striped connection whose hello nonce is `of`. */
  stripe?: { of: string; index: number };
  /** Ping interval, ms; a peer silent for HEARTBEAT_MISS_BUDGET intervals is lost. */
  heartbeatMs: number;
  /** Monotonic time of the heartbeat and the ping round trip. */
  clock: Pick<Clock, 'nowMs'>;
  stats: KvStats;
  log: KvLog;
  /** "host:port" of the peer (the refusal's error names it on the decode side). */
  address: string;
  /** The connection's name for log lines (it changes at authentication). */
  name(): string;
}

/** Refusal codes a connection can fail its handshake with. */
export type RefuseCode = 'AUTH_FAILED' | 'SETTINGS_MISMATCH' | 'TIMEOUT';

/** Pings whose send time is remembered for the round trip. */
const PINGS_REMEMBERED = 16;

/**
 * One connection's protocol state: 'handshake' → 'open' → 'ended' (or straight to 'ended').
 * Every method is synchronous and reads time only through the injected clock.
 */
export class ConnCore {
  /** Peer's session epoch, bound at authentication ('' before). */
  peerEpoch = '';
  /** Peer's pair settings, bound at authentication. */
  peerSettings: PairSettings | undefined;
  /** Round-trip time of the last answered ping, ms (undefined until one is answered). */
  rttMs: number | undefined;
  private st: 'handshake' | 'open' | 'ended' = 'handshake';
  private readonly decoder = new FrameDecoder({ acceptChunks: false, streamChunks: true });
  private readonly handshake: Handshake;
  private heartbeat: Heartbeat | undefined;
  private pingSeq = 0;
  private readonly pingSentAt = new Map<number, number>();

  constructor(
    private readonly o: ConnCoreOptions,
    private readonly sink: CoreSink,
  ) {
    this.handshake = new Handshake({ side: o.side, secret: o.secret, epoch: o.epoch, settings: o.pair, streams: o.streams, ...(o.stripe ? { stripe: o.stripe } : {}) });
  }

  /** 'handshake', 'open' or 'ended'. */
  get state(): 'handshake' | 'open' | 'ended' {
    return this.st;
  }

  private get ended(): boolean {
    return this.st === 'ended';
  }

  /** The prefill's hello nonce of this connection (what a stripe names to join it); '' before hello. */
  get helloNonce(): string {
    return this.handshake.helloNonce;
  }

  /** Writes what the handshake sends first (prefill: hello). Call once, when the transport is up. */
  start(): void {
    for (const m of this.handshake.start()) this.sink.write(encodeControl(m));
  }

  /**
   * Bytes from the peer, in order. Decodes every frame they complete and hands it on; a
   * malformed one refuses the connection (BAD_FRAME → 'AUTH_FAILED' during the handshake).
   * Nothing after `ended`.
   */
  receive(buf: Buffer): void {
    if (this.st === 'ended') return;
    this.heartbeat?.received();
    this.o.stats.bytesIn += buf.length;
    try {
      for (const f of this.decoder.feed(buf)) {
        if (f.kind === 'control' || f.final) this.o.stats.framesIn++;
        this.onFrame(f);
        if (this.ended) return;
      }
    } catch (e) {
      if (e instanceof KvError && e.code === 'BAD_FRAME') {
        this.o.stats.badFrames++;
        this.refuse(`bad frame: ${e.message}`, 'AUTH_FAILED');
      } else {
        this.o.log.error({ peer: this.o.name(), err: errText(e) }, 'kv channel internal error');
        this.finish({ reason: `internal error: ${errText(e)}`, lost: true, graceful: false });
      }
    }
  }

  /** Sends one control message; false (nothing sent) unless open. */
  sendControl(msg: ControlMsg): boolean {
    if (this.st !== 'open') return false;
    return this.sink.write(encodeControl(msg));
  }

  /** The heartbeat interval's tick: one ping (its send time kept for the round trip). */
  ping(): void {
    if (this.st !== 'open') return;
    const seq = this.pingSeq++;
    this.pingSentAt.set(seq, this.o.clock.nowMs());
    if (this.pingSentAt.size > PINGS_REMEMBERED) this.pingSentAt.delete(this.pingSentAt.keys().next().value as number);
    this.sink.write(encodeControl({ type: 'ping', seq }));
  }

  /** ms until the next liveness check is due (≥ 1); undefined unless open. */
  nextCheckInMs(): number | undefined {
    return this.st === 'open' ? this.heartbeat!.nextCheckInMs() : undefined;
  }

  /**
   * A due liveness check (run it after the bytes that arrived meanwhile were received): a
   * silent peer ends the connection as lost; this process's own stall is counted and reported
   * (`stalled`), the peer not blamed. Returns the verdict (undefined unless open).
   */
  check(): HeartbeatVerdict | undefined {
    if (this.st !== 'open') return undefined;
    const v = this.heartbeat!.check();
    if (v.k === 'lost') this.finish({ reason: v.reason, lost: true, graceful: false, silentMs: v.silentMs });
    else if (v.k === 'stalled') {
      this.o.stats.ownStalls++;
      this.o.log.warn({ peer: this.o.name(), lateMs: v.lateMs }, 'this process stalled: liveness check ran late, peer budget restarted (the peer is not blamed for our stall)');
      this.sink.stalled(v.lateMs);
    }
    return v;
  }

  /** The handshake deadline passed: refused with 'TIMEOUT' (no-op once open). */
  authExpired(ms: number): void {
    if (this.st !== 'handshake') return;
    this.o.stats.authFailures++;
    this.refuse(`authentication timed out after ${ms} ms`, 'TIMEOUT');
  }

  /**
   * Closes for a protocol/auth reason: logs, tells the peer during the handshake (prefill side:
   * auth_fail, or `send`), then `ended` (graceful on prefill's handshake refusal, so the
   * auth_fail flushes). No-op once ended.
   */
  refuse(reason: string, code: RefuseCode = 'AUTH_FAILED', send?: ControlMsg[]): void {
    if (this.st === 'ended') return;
    const wasHandshake = this.st === 'handshake';
    if (code !== 'SETTINGS_MISMATCH') this.o.log.warn({ peer: this.o.name(), reason }, 'closing kv connection');
    const tell = wasHandshake && this.o.side === 'prefill';
    // Best effort, so decode can report a refused secret (or a settings mismatch) rather than a dead peer.
    if (tell) for (const m of send ?? [{ type: 'auth_fail', reason, code: 'auth_failed' } as ControlMsg]) this.sink.write(encodeControl(m));
    const failure = wasHandshake ? new KvError(code, `${this.o.side === 'decode' ? `prefill ${this.o.address}` : 'peer'}: ${reason}`) : undefined;
    this.finish({ reason, lost: true, graceful: tell, ...(failure ? { failure } : {}) });
  }

  /** The owner ended the connection (a local close, the transport gone): no more reads, writes or events. */
  end(): void {
    this.st = 'ended';
  }

  private finish(e: CoreEnd): void {
    if (this.st === 'ended') return;
    this.st = 'ended';
    this.sink.ended(e);
  }

  private onFrame(f: Frame): void {
    if (this.st === 'handshake') {
      // The decoder refuses chunk frames until authenticated.
      if (f.kind === 'control') this.onHandshake(f.msg);
      return;
    }
    if (f.kind === 'chunk') {
      this.sink.chunk(f.room, f.offset, f.data);
      return;
    }
    const msg = f.msg;
    switch (msg.type) {
      case 'ping':
        this.sink.write(encodeControl({ type: 'pong', seq: msg.seq }));
        return;
      case 'pong': {
        const t = this.pingSentAt.get(msg.seq);
        if (t !== undefined) {
          this.rttMs = this.o.clock.nowMs() - t;
          this.pingSentAt.delete(msg.seq);
        }
        return;
      }
      case 'hello':
      case 'auth':
      case 'auth_ok':
      case 'auth_fail':
        this.o.stats.badFrames++;
        this.refuse(`handshake message '${msg.type}' after authentication`);
        return;
      default:
        if ('epoch' in msg && msg.epoch !== this.peerEpoch) {
          this.o.stats.staleEpoch++;
          this.o.log.warn({ peer: this.o.name(), type: msg.type, room: msg.room, epoch: msg.epoch, boundEpoch: this.peerEpoch }, 'kv message with a stale epoch refused');
          return;
        }
        this.sink.message(msg);
    }
  }

  private onHandshake(msg: ControlMsg): void {
    const step = this.handshake.onMessage(msg);
    if (step.k === 'continue') {
      for (const m of step.send) this.sink.write(encodeControl(m));
      return;
    }
    if (step.k === 'refuse') {
      if (step.code === 'SETTINGS_MISMATCH') {
        this.o.stats.settingsMismatch++;
        // The one log line of this refusal on this side (refuse() stays quiet for it).
        this.o.log.error({ peer: this.o.address, reason: step.reason }, 'kv pair refused: prefill and decode settings differ; no request will be dispatched over this pair');
      } else {
        this.o.stats.authFailures++;
      }
      this.refuse(step.reason, step.code, step.send);
      return;
    }
    for (const m of step.send) this.sink.write(encodeControl(m));
    this.peerEpoch = step.peerEpoch;
    this.peerSettings = step.peerSettings;
    this.st = 'open';
    this.decoder.acceptChunks = true;
    this.heartbeat = new Heartbeat(this.o.heartbeatMs, undefined, this.o.clock);
    this.sink.opened(step);
  }
}

/**
 * Runs a core's ticks on `timers`: the handshake deadline (`authTimeoutMs`) now; from
 * `opened()` on, a ping every heartbeat interval and each liveness check when due, decided one
 * event-loop turn later (`timers.turn()`: after the poll phase, so bytes that arrived while this
 * loop was busy count first). `stop()` cancels everything (idempotent).
 */
export class CoreTimers {
  private cancelAuth: (() => void) | undefined;
  private cancelPing: (() => void) | undefined;
  private cancelLive: (() => void) | undefined;
  private stopped = false;

  constructor(
    private readonly core: ConnCore,
    private readonly timers: Timers,
    private readonly heartbeatMs: number,
    authTimeoutMs: number,
  ) {
    this.cancelAuth = timers.after(authTimeoutMs, () => core.authExpired(authTimeoutMs));
  }

  /** The core opened: the handshake deadline is off, the heartbeat starts. */
  opened(): void {
    if (this.stopped) return;
    this.cancelAuth?.();
    this.cancelAuth = undefined;
    this.cancelPing = this.timers.every(this.heartbeatMs, () => this.core.ping());
    this.armLiveness();
  }

  /** Cancels every timer. */
  stop(): void {
    this.stopped = true;
    this.cancelAuth?.();
    this.cancelPing?.();
    this.cancelLive?.();
    this.cancelAuth = this.cancelPing = this.cancelLive = undefined;
  }

  private armLiveness(): void {
    const wait = this.core.nextCheckInMs();
    if (wait === undefined || this.stopped) return;
    this.cancelLive = this.timers.after(wait, () => {
      this.cancelLive = undefined;
      void this.timers.turn().then(() => {
        if (this.stopped || this.core.state !== 'open') return;
        this.core.check();
        this.armLiveness();
      });
    });
  }
}
