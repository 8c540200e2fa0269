/**
 * One KV channel connection (either side): a TCP socket, the frame decoder (frame.ts), the
 * handshake (handshake.ts, sans-IO) and liveness (heartbeat.ts, injected clock) composed — the
 * way nats.js composes transport, parser and heartbeats. The server and the pool that own
 * connections are in channel.ts.
 *
 * Guarantees (see channel.ts for the whole list): nothing blocks the event loop; every wait has a
 * deadline; anything unexpected closes this one connection with a logged reason; onPeerLost fires
 * exactly once for every authenticated connection that ends.
 */
import type net from 'node:net';
import { encodeChunk, encodeControl, FrameDecoder, type Frame } from './frame.js';
import { Handshake } from './handshake.js';
import type { Clock } from '../base/clock.js';
import { Heartbeat } from './heartbeat.js';
import { MAX_CHUNK_BYTES, type ControlMsg, type PairSettings, type PeerMsg } from './messages.js';
import { KvError, type RoomId } from './types.js';
import { StripeReorder } from './stripes.js';

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

/** Callbacks of a KvServer / KvPeerPool. Exceptions thrown by them are logged and swallowed. */
export interface KvHandlers {
  /** A room message (register, registered, kv_begin, kv_end, kv_file, kv_ack, fail, …) with a valid epoch, or a same-host probe message. */
  onMessage?: (conn: PeerConn, msg: PeerMsg) => void;
  /**
   * KV data: `data` goes at byte `offset` of the blob of `room`. Data is delivered as it arrives,
   * without copies: a chunk frame may come out as several calls with contiguous offsets, each
   * with 1..MAX_CHUNK_BYTES bytes. `data` is a view into a socket read buffer that the next read
   * overwrites (decode reads into one reused buffer): copy it out before returning, do not keep
   * it. Without this handler a chunk frame is a protocol error that closes the connection.
   */
  onChunk?: (conn: PeerConn, room: RoomId, offset: number, data: Buffer) => void;
  /** An authenticated connection ended (peer lost, bad frame, queue overflow or local close). Once per connection. */
  onPeerLost?: (conn: PeerConn, reason: string) => void;
  /** A connection finished authentication. */
  onConnect?: (conn: PeerConn) => void;
}

/** Options of PeerConn.sendChunks. */
export interface SendChunksOptions {
  /** Data bytes per chunk frame, 1..MAX_CHUNK_BYTES (default MAX_CHUNK_BYTES). */
  chunkBytes?: number;
  /** Aborting rejects with KvError('ABORTED'). Chunks already queued are still delivered. */
  signal?: AbortSignal;
  /** Max time without progress (a chunk flushed to the kernel), ms (default 10000); then KvError('TIMEOUT'). */
  stallMs?: number;
  /** Called with the data bytes of each chunk once flushed to the kernel (a delta, not a total). */
  onProgress?: (bytes: number) => void;
  /** Offset of `blob`'s first byte in the room's byte stream (default 0): a transfer sent in pieces. */
  offset?: number;
}

/**
 * What `PeerConn.sendFrom` pulls pieces from. `next()`: a piece, `null` (none ready now),
 * `undefined` (the end). `flushed(piece)`: the socket is done with a piece. `attach(resume)`:
 * called once at the start by a source that can have nothing ready with nothing in flight (a
 * file still being written): it calls `resume()` when it may have bytes again, and bounds its
 * own waits (sendFrom's stall timer restarts on every resume). Without `attach`, `null` with
 * nothing in flight is an error.
 */
export interface ChunkSource {
  next(): Buffer | null | undefined;
  flushed?(piece: Buffer): void;
  attach?(resume: () => void): void;
}

/**
 * Bytes a transfer may hand the socket per turn of its connection's send rotation (its credit,
 * spent in whole pieces: it writes while credit is left), 2 × MAX_CHUNK_BYTES = 2 MiB. A
 * transfer that runs dry in its turn (all its pooled pieces in flight: the file sender has at
 * most 1 MiB out) keeps the credit it has left and is served first as soon as it has a piece
 * again, before the rotation goes on — deficit round robin (Shreedhar & Varghese, "Efficient
 * fair queuing using deficit round robin", SIGCOMM 1995), with the credit reset rather than
 * accumulated at each turn. So a state of up to about 2 MiB (envelope head, payload pieces,
 * trailer), once its turn comes, goes out without a whole rotation of other rooms' bytes between
 * its first and its last.
 */
export const SEND_QUANTUM_BYTES = 2 * MAX_CHUNK_BYTES;

/** One running sendFrom as its connection's send rotation sees it. */
interface Outgoing {
  /** False after its source returned null: skipped until a flush of its own or the source's resume. */
  ready: boolean;
  /** Bytes it may still write in its current turn (SEND_QUANTUM_BYTES when the turn starts; kept when it runs dry). */
  credit: number;
  /** Hands the socket the source's next piece: its bytes, or 0 (nothing ready, the end, or the transfer settled). */
  step(): number;
  /** The connection made progress: restart the stall timer. */
  alive(): void;
  /** The connection is gone: settle with PEER_LOST. */
  lost(): void;
}

/**
 * Bytes a connection reads from its socket per event-loop turn before it yields: then reads stop
 * until the turn's check phase (setImmediate) and go on in the next turn, after timers and other
 * sockets. libuv reads a readable socket up to 32 times per poll event (32 × the 256 KiB read
 * buffer = 8 MiB), each read handled on the spot (frame decode, CRC-32, ggsq walk, file write), so
 * a large state streaming in held decode's loop for 25–44 ms per poll event while a 1 GiB state
 * arrived (bench §1, event-loop delay p99 35–41 ms); 1 MiB (4 reads) bounds a turn to a few ms.
 * The sender is held back by TCP's window meanwhile; nothing is dropped.
 */
export const READ_TURN_BYTES = 1024 * 1024;

export const DEFAULT_HEARTBEAT_MS = 1000;
export { HEARTBEAT_MISS_BUDGET } from './heartbeat.js';

/** Fresh zeroed counters. */
export function newKvStats(): KvStats {
  return { framesIn: 0, framesOut: 0, bytesIn: 0, bytesOut: 0, authFailures: 0, badFrames: 0, staleEpoch: 0, peersLost: 0, settingsMismatch: 0, ownStalls: 0 };
}

export const noop = (): void => {};
export const NOOP_LOG: KvLog = { info: noop, warn: noop, error: noop, debug: noop };

/** @internal Validated options shared by every connection of one server/pool. */
export interface Settings {
  secret: string | Buffer;
  epoch: string;
  /** This process's pair settings, exchanged in the handshake. */
  pair: PairSettings;
  /** Monotonic time source of the heartbeat and the ping round trip. */
  clock: Clock;
  heartbeatMs: number;
  authTimeoutMs: number;
  maxQueuedBytes: number;
  sendWindowBytes: number;
  closeTimeoutMs: number;
  /** Sockets one connection may be striped over (`--kv-streams`; the pair agrees on the smaller). */
  streams: number;
  log: KvLog;
}

/** @internal What a PeerConn needs from its owner. */
export interface Owner {
  readonly s: Settings;
  readonly stats: KvStats;
  readonly handlers: KvHandlers;
  authenticated(conn: PeerConn): void;
  closed(conn: PeerConn): void;
}

export type ConnState = 'handshake' | 'open' | 'closing' | 'closed';
export type Side = 'prefill' | 'decode';

export const errText = (e: unknown): string => (e instanceof Error ? ((e as NodeJS.ErrnoException).code ?? e.message) : String(e));

/**
 * One authenticated channel connection, as seen from either side. Obtained from KvServer
 * (onConnect / handlers / get(id)) or KvPeerPool.get(); never constructed directly.
 */
/**
 * What a role's room handling needs of one KV connection: `PeerConn` here, a fake one in the
 * simulator (src/sim). `id`: stable for the connection; `alive`: authenticated and not closed;
 * `peerEpoch`: the peer's session epoch ('' before authentication); `sendControl`: false when
 * the message could not be queued (the connection is gone).
 */
export interface KvConn {
  readonly id: string;
  readonly alive: boolean;
  readonly peerEpoch: string;
  sendControl(msg: ControlMsg): boolean;
}

export class PeerConn implements KvConn {
  /** Peer's session epoch, bound at authentication ('' before). */
  peerEpoch = '';
  /** Round-trip time of the last answered ping, ms (undefined until one is answered). */
  rttMs: number | undefined;
  /** "host:port": the dialed address (decode side) or the peer's socket address (prefill side). */
  readonly address: string;
  /** Settles when the connection is fully closed (never rejects). */
  readonly closed: Promise<void>;
  /** @internal Resolves at authentication; rejects (KvError) if the handshake fails. */
  readonly ready: Promise<void>;

  private state: ConnState = 'handshake';
  private reason = '';
  private lost = false;
  private authed = false;
  private readonly decoder = new FrameDecoder({ acceptChunks: false, streamChunks: true });
  private readonly handshake: Handshake;
  private heartbeat: Heartbeat | undefined;
  /** Peer's pair settings, bound at authentication. */
  peerSettings: PairSettings | undefined;
  private pingSeq = 0;
  private pingSentAt = new Map<number, number>();
  private authTimer: NodeJS.Timeout | undefined;
  private pingTimer: NodeJS.Timeout | undefined;
  private liveTimer: NodeJS.Timeout | undefined;
  private closeTimer: NodeJS.Timeout | undefined;
  private readonly closeWaiters = new Set<(reason: string) => void>();
  /** Running sendFrom transfers in rotation order (see serveSends). */
  private readonly sending: Outgoing[] = [];
  /** Index in `sending` of the transfer whose turn it is, and the bytes it has written in this turn. */
  private sendCursor = 0;
  private turnOwner: Outgoing | undefined;
  /** Chunk bytes handed to the socket since the last per-turn yield, and whether one is scheduled. */
  private turnBytes = 0;
  private turnYield = false;
  private serving = false;
  private serveAgain = false;
  /** Outstanding pauseReads. */
  private readPauses = 0;
  /** Outstanding pauses of this socket (pauseReads, the reassembly's holds of a striped connection, the read turn's yield). */
  private socketPauses = 0;
  /** Bytes read in this event-loop turn (READ_TURN_BYTES), whether the turn's end is scheduled, whether reads yielded for it. */
  private turnRead = 0;
  private readTurnEnd = false;
  private readYielded = false;
  private resolveReady!: () => void;
  private rejectReady!: (e: KvError) => void;
  private resolveClosed!: () => void;
  private failure: KvError | undefined;
  /** Sockets the pair agreed to stripe this connection over (1 until authenticated, and for a stripe). */
  streams = 1;
  /** @internal Prefill side: the striped connection this one asked to join in its auth (stripes.ts). */
  stripeRequest: { of: string; index: number } | undefined;
  /** The other sockets of this striped connection (stripes.ts), in join order. */
  private readonly stripes: PeerConn[] = [];
  /** Set on a stripe: the connection it carries chunk frames for. */
  private primary: PeerConn | undefined;
  /** Decode side of a striped connection: reassembly of the chunks from every socket. */
  private reorder: StripeReorder | undefined;
  /** Chunk frames written so far: the next goes to socket rr mod (1 + stripes). */
  private rr = 0;
  private drainScheduled = false;
  /** Decode side: dialed as a stripe of another connection. */
  private readonly asStripe: boolean;

  /** @internal */
  constructor(
    private readonly socket: net.Socket,
    private readonly side: Side,
    private readonly owner: Owner,
    address: string,
    stripe?: { of: string; index: number },
  ) {
    this.address = address;
    this.asStripe = stripe !== undefined;
    this.ready = new Promise<void>((res, rej) => {
      this.resolveReady = res;
      this.rejectReady = rej;
    });
    this.ready.catch(noop);
    this.closed = new Promise<void>((res) => (this.resolveClosed = res));
    socket.setNoDelay(true);
    socket.on('data', (b: Buffer) => this.onData(b));
    socket.on('drain', () => {
      const p = this.primary ?? this;
      for (const o of p.sending) o.alive();
      p.serveSends();
    });
    socket.on('error', (e) => this.terminate(`socket error: ${errText(e)}`, { lost: true }));
    socket.on('end', () => this.terminate('connection closed by peer', { lost: true }));
    socket.on('close', () => this.terminate(this.state === 'closing' ? this.reason : 'connection closed', { lost: true }));
    this.authTimer = setTimeout(() => {
      this.owner.stats.authFailures++;
      this.refuse(`authentication timed out after ${this.owner.s.authTimeoutMs} ms`, 'TIMEOUT');
    }, owner.s.authTimeoutMs);
    this.authTimer.unref();
    this.handshake = new Handshake({ side, secret: owner.s.secret, epoch: owner.s.epoch, settings: owner.s.pair, streams: owner.s.streams, ...(stripe ? { stripe } : {}) });
    for (const m of this.handshake.start()) this.write(encodeControl(m));
  }

  /** "decode@<addr>:<port>#<epoch prefix>" on prefill, "prefill@<host>:<port>#<epoch prefix>" on decode. */
  get id(): string {
    return `${this.side === 'prefill' ? 'decode' : 'prefill'}@${this.address}#${this.peerEpoch.slice(0, 8) || '?'}`;
  }

  /** True while authenticated and not closing. */
  get alive(): boolean {
    return this.state === 'open';
  }

  /** @internal The key a stripe names to join this connection: its hello nonce. */
  get stripeKey(): string {
    return this.handshake.helloNonce;
  }

  /** The stripes that joined this connection (the sockets besides its own), in join order. */
  get stripeSockets(): readonly PeerConn[] {
    return this.stripes;
  }

  /** Sockets this connection's chunk frames go over now: 1 + the stripes that joined. */
  get sockets(): number {
    return 1 + this.stripes.length;
  }

  /**
   * @internal Adds `member` (authenticated, asked to join this connection) as one more socket
   * for chunk frames: the sender deals pieces over all sockets in rotation, the receiver
   * reassembles (stripes.ts). False (and `member` destroyed) when this connection is not open
   * or already has its agreed number of sockets. From then on either one's end ends both.
   */
  addStripe(member: PeerConn): boolean {
    if (this.state !== 'open' || this.primary || 1 + this.stripes.length >= this.streams || member.peerEpoch !== this.peerEpoch) {
      member.destroy('stripe refused: its connection is gone or complete');
      return false;
    }
    member.primary = this;
    this.stripes.push(member);
    if (this.readPauses > 0) member.pauseReads();
    this.owner.s.log.debug({ peer: this.id, sockets: this.sockets }, 'kv stripe joined');
    return true;
  }

  /**
   * Stop reading the socket until as many `resumeReads` (a receiver whose I/O-thread slots are all
   * busy: TCP's window then holds the sender back). Counted: reads go on once every pause is
   * resumed. Heartbeats are not read meanwhile, so a pause must be short: the receiver resumes as
   * soon as a slot is written, or fails its room first (receiver.ts PAUSE_LIMIT_MS).
   */
  pauseReads(): void {
    if (this.readPauses++ === 0) {
      this.pauseSocket();
      for (const m of this.stripes) m.pauseReads();
    }
  }

  /** The socket itself stops reading (counted: the receiver's pause and the reassembly's hold). */
  private pauseSocket(): void {
    if (this.socketPauses++ === 0) this.socket.pause();
  }

  private resumeSocket(): void {
    if (this.socketPauses === 0) return;
    if (--this.socketPauses === 0 && !this.socket.destroyed) this.socket.resume();
  }

  /** Socket `i` of this striped connection: 0 = this one, then the stripes in join order. */
  private socketAt(i: number): PeerConn | undefined {
    return i === 0 ? this : this.stripes[i - 1];
  }

  /** Undo one `pauseReads`. */
  resumeReads(): void {
    if (this.readPauses === 0) return;
    if (--this.readPauses === 0) {
      this.resumeSocket();
      for (const m of this.stripes) m.resumeReads();
      if (this.reorder && this.reorder.heldBytes > 0 && !this.drainScheduled) {
        // held stripe bytes go on after this turn (the receiver that resumed is still on the stack)
        this.drainScheduled = true;
        setImmediate(() => {
          this.drainScheduled = false;
          if (this.state === 'open') this.reorder?.drain();
        });
      }
    }
  }

  /** Bytes queued in user space, not yet handed to the kernel. */
  get queuedBytes(): number {
    return this.socket.writableLength;
  }

  /**
   * Sends one control message. Returns false (and sends nothing) if the connection is not open.
   * Throws KvError('BAD_FRAME') if `msg` is invalid (a bug at the caller).
   */
  sendControl(msg: ControlMsg): boolean {
    if (this.state !== 'open') return false;
    if (this.reorder && (msg.type === 'kv_ack' || msg.type === 'fail')) this.reorder.forget(msg.room);
    return this.write(encodeControl(msg));
  }

  /**
   * Streams `blob` as chunk frames of room `roomId` (canonical decimal u64), offsets 0..length.
   * Respects backpressure: writes while fewer than sendWindowBytes are queued, then waits for
   * the socket to flush; never blocks the event loop. `blob` is not copied and must not change
   * until the promise settles. Resolves once every chunk is flushed to the kernel. Rejects with
   * KvError('PEER_LOST') if the connection ends, 'ABORTED' if `signal` aborts, 'TIMEOUT' after
   * `stallMs` without progress, 'BAD_FRAME' for an invalid room id; RangeError for bad options.
   */
  sendChunks(roomId: RoomId, blob: Buffer, opts: SendChunksOptions = {}): Promise<void> {
    const chunkBytes = opts.chunkBytes ?? MAX_CHUNK_BYTES;
    if (!Number.isSafeInteger(chunkBytes) || chunkBytes < 1 || chunkBytes > MAX_CHUNK_BYTES) {
      return Promise.reject(new RangeError(`chunkBytes must be an integer in 1..${MAX_CHUNK_BYTES}, got ${chunkBytes}`));
    }
    let next = 0;
    return this.sendFrom(
      roomId,
      {
        next: () => {
          if (next >= blob.length) return undefined;
          const n = Math.min(chunkBytes, blob.length - next);
          next += n;
          return blob.subarray(next - n, next);
        },
      },
      opts,
    );
  }

  /**
   * Streams the pieces `source.next()` yields as chunk frames of room `roomId`, one frame per
   * piece, at contiguous offsets from `opts.offset` — the pull form of `sendChunks`, for a sender
   * that produces the bytes as they go (reads a file into a few reused buffers). `next()` is
   * called whenever the send window has room and returns a piece (1..MAX_CHUNK_BYTES bytes, not
   * copied: unchanged until `source.flushed(piece)`), `null` when it has none ready until one of
   * its pieces in flight is flushed, or `undefined` at the end; an exception from it rejects.
   * `flushed(piece)` is called once for every piece `next()` returned: for a piece written, when
   * the socket is done with it — also after the promise has settled (a failed or aborted
   * transfer's queued pieces), so a buffer goes back to its owner only when no I/O uses it; for
   * a piece never written (the socket already gone, or a piece the frame encoder refuses: empty
   * or over MAX_CHUNK_BYTES → 'BAD_FRAME'), at once, before the promise settles.
   * Transfers sharing the connection take turns (serveSends): each in turn writes up to
   * SEND_QUANTUM_BYTES (2 MiB) while the window has room, and one that ran dry in its turn is
   * served first with what it has left once it has a piece again, so a small room started behind
   * a long one waits for a turn, not for the long one's end. At most one send window is handed to the
   * socket per event-loop turn over all of them (the rest after setImmediate), so a peer that
   * reads as fast as we write cannot keep the loop in one send. The stall timer restarts on
   * every flushed piece of this room, on every flushed piece of another room while this one has
   * a piece ready (it is waiting for its turn), on 'drain', on each per-turn yield and on the
   * source's resume. Resolves once every piece is flushed to the kernel; rejects as `sendChunks`
   * ('PEER_LOST', 'ABORTED', 'TIMEOUT' after `stallMs` without progress, 'BAD_FRAME',
   * RangeError). (`chunkBytes` is not used: the source sizes its pieces.)
   */
  sendFrom(roomId: RoomId, source: ChunkSource, opts: SendChunksOptions = {}): Promise<void> {
    const stallMs = opts.stallMs ?? 10_000;
    if (!Number.isSafeInteger(stallMs) || stallMs < 1) return Promise.reject(new RangeError(`stallMs must be a positive integer, got ${stallMs}`));
    try {
      encodeChunk(roomId, 0, Buffer.alloc(1)); // validates the room id up front
    } catch (e) {
      return Promise.reject(e);
    }
    const signal = opts.signal;
    if (signal?.aborted) return Promise.reject(new KvError('ABORTED', `transfer of room ${roomId} aborted before start: ${reasonText(signal.reason)}`));
    if (this.state !== 'open') return Promise.reject(this.lostError(roomId));

    return new Promise<void>((resolve, reject) => {
      let offset = opts.offset ?? 0;
      let pending = 0;
      let flushed = 0;
      let ended = false;
      let done = false;
      const settle = (err?: Error): void => {
        if (done) return;
        done = true;
        clearTimeout(stall);
        this.dropSend(out);
        this.closeWaiters.delete(onClose);
        signal?.removeEventListener('abort', onAbort);
        if (err) reject(err);
        else resolve();
      };
      const onAbort = (): void => settle(new KvError('ABORTED', `transfer of room ${roomId} aborted: ${reasonText(signal?.reason)}`));
      const onClose = (): void => settle(this.lostError(roomId));
      const stall = setTimeout(() => settle(new KvError('TIMEOUT', `transfer of room ${roomId} stalled: no progress for ${stallMs} ms (${flushed} bytes flushed)`)), stallMs);
      stall.unref();
      const giveBack = (piece: Buffer): void => {
        if (!source.flushed) return;
        try {
          source.flushed(piece);
        } catch (e) {
          this.owner.s.log.error({ peer: this.id, room: roomId, err: errText(e) }, 'kv sendFrom flushed() threw');
        }
      };
      const written = (piece: Buffer) => (err?: Error | null): void => {
        pending--;
        giveBack(piece);
        if (!done) {
          if (err) settle(this.lostError(roomId, err));
          else {
            flushed += piece.length;
            stall.refresh();
            if (opts.onProgress) {
              try {
                opts.onProgress(piece.length);
              } catch (e) {
                this.owner.s.log.error({ peer: this.id, room: roomId, err: errText(e) }, 'kv sendChunks onProgress threw');
              }
            }
            if (ended && pending === 0) settle();
            else out.ready = true; // a piece back: the source may have one again
          }
        }
        if (!err) for (const o of this.sending) if (o.ready) o.alive(); // the connection moves: rooms waiting for their turn are not stalled
        this.serveSends(); // room in the window: a room with credit left first, then whoever's turn it is
      };
      const step = (): number => {
        if (done || ended) return 0;
        let piece: Buffer | null | undefined;
        out.ready = false; // before next(): a resume called from inside next() sets it again (no lost wake-up)
        try {
          piece = source.next();
        } catch (e) {
          settle(e as Error);
          return 0;
        }
        if (piece === undefined) {
          ended = true;
          this.dropSend(out); // nothing more to write; settles when the last piece is flushed
          if (pending === 0) settle();
          return 0;
        }
        if (piece === null) {
          // not ready until a flush of ours (or the source's resume, through attach)
          if (pending === 0 && !source.attach) settle(new KvError('BAD_STATE', `transfer of room ${roomId}: the source has nothing to send and nothing in flight`));
          return 0;
        }
        let frame: Buffer[];
        try {
          frame = encodeChunk(roomId, offset, piece);
        } catch (e) {
          giveBack(piece); // never handed to the socket: back to its owner now (a pooled buffer)
          settle(e as Error);
          return 0;
        }
        const to = this.sendTarget();
        if (to.socket.destroyed || !to.socket.writable) {
          giveBack(piece);
          settle(this.lostError(roomId));
          return 0;
        }
        out.ready = true;
        offset += piece.length;
        pending++; // from here the socket owns the piece until written() (called on destroy too)
        this.rr++;
        if (!to.write(frame, written(piece))) {
          settle(this.lostError(roomId));
          return 0;
        }
        return piece.length;
      };
      const out: Outgoing = {
        ready: true,
        credit: 0,
        step,
        alive: () => {
          if (!done) stall.refresh();
        },
        lost: onClose,
      };
      this.sending.push(out);
      this.closeWaiters.add(onClose);
      signal?.addEventListener('abort', onAbort, { once: true });
      source.attach?.(() => {
        if (done) return;
        stall.refresh();
        out.ready = true;
        this.serveSends();
      });
      this.serveSends();
    });
  }

  /**
   * Graceful close: stops sending and receiving, flushes queued bytes (up to closeTimeoutMs,
   * then destroys). Idempotent; onPeerLost fires with `reason` once closed.
   */
  close(reason = 'closed locally'): Promise<void> {
    this.terminate(reason, { lost: false, graceful: true });
    return this.closed;
  }

  /** Immediate close: drops queued bytes. Idempotent. */
  destroy(reason = 'destroyed locally'): void {
    this.terminate(reason, { lost: false });
  }

  // ---- internals ---------------------------------------------------------------------------

  private lostError(roomId: string, err?: Error): KvError {
    const why = this.reason || (err ? `write failed: ${errText(err)}` : 'not open');
    return new KvError('PEER_LOST', `connection ${this.id} is gone (${why}); transfer of room ${roomId} failed`);
  }

  /**
   * Fills the send window from the running transfers, in turns (deficit round robin, see
   * SEND_QUANTUM_BYTES): first any transfer that ran dry in its turn with credit left and has a
   * piece again, up to that credit; then the transfer whose turn it is writes pieces until it has
   * spent its credit (SEND_QUANTUM_BYTES a turn) or has nothing ready, then the next one in the
   * rotation. Called whenever the window may have room (a flush of any room's piece,
   * 'drain', a new transfer, a source's resume, the next event-loop turn), so a room that starts
   * behind a long transfer waits for one turn of each other room, not for their ends; a transfer
   * alone on the connection is served as fast as before. At most one send window is handed to
   * the socket per event-loop turn (the rest after setImmediate): when the peer reads as fast as
   * we write, the kernel takes every write at once, writableLength stays near 0 and nothing would
   * make this loop yield; write callbacks (progress, pooled buffers back), heartbeats and other
   * work run between.
   */
  private serveSends(): void {
    if (this.serving) {
      this.serveAgain = true; // re-entered (from a source or a settle): loop once more when back
      return;
    }
    this.serving = true;
    try {
      do {
        this.serveAgain = false;
        this.serveRound();
      } while (this.serveAgain);
    } finally {
      this.serving = false;
    }
  }

  private serveRound(): void {
    const list = this.sending;
    // 1. transfers that ran dry in their turn with credit left go first, up to that credit
    for (let i = 0; i < list.length; ) {
      if (!this.windowOpen()) return;
      const o = list[i];
      if (o.ready && o.credit > 0 && i !== this.sendCursor) {
        const n = o.step();
        if (list[i] !== o) continue; // it ended or settled: list[i] is the next one now
        if (n > 0) {
          o.credit -= n;
          this.turnBytes += n;
          continue;
        }
      }
      i++;
    }
    // 2. the rotation
    let idle = 0; // transfers in a row that had nothing to write
    while (list.length > 0) {
      if (!this.windowOpen()) return;
      if (this.sendCursor >= list.length) this.sendCursor = 0;
      const o = list[this.sendCursor];
      if (this.turnOwner !== o) {
        this.turnOwner = o; // its turn starts
        o.credit = SEND_QUANTUM_BYTES;
      }
      const n = o.ready ? o.step() : 0;
      if (list[this.sendCursor] !== o) {
        idle = 0; // it ended or settled (dropSend moved the cursor to the next one)
        continue;
      }
      if (n > 0) {
        idle = 0;
        this.turnBytes += n;
        o.credit -= n;
        if (o.credit > 0) continue;
        o.credit = 0;
      } else if (++idle >= list.length) return; // nobody has a piece ready
      this.sendCursor++; // the next one's turn (a dry one keeps its credit: step 1 serves it)
      this.turnOwner = undefined; // a new turn starts there, even when the rotation is back at the same transfer
    }
  }

  /**
   * Whether serveRound may hand the socket more: the connection is open (else every transfer is
   * settled as lost), the queue is under the send window (a flush or 'drain' serves again) and
   * this event-loop turn has not handed over a whole window yet (else the rest after setImmediate).
   */
  private windowOpen(): boolean {
    if (this.state !== 'open') {
      for (const o of [...this.sending]) o.lost();
      return false;
    }
    const window = this.owner.s.sendWindowBytes;
    // striped: strictly the next socket in the rotation (waiting for it keeps the skew between
    // the sockets, hence what the receiver holds out of order, bounded), each with its share of
    // the window, so a room that starts behind another waits for one window's bytes, as on one socket
    if (this.sendTarget().socket.writableLength >= Math.ceil(window / this.sockets)) return false;
    if (this.turnBytes >= window) {
      if (!this.turnYield) {
        this.turnYield = true;
        setImmediate(this.nextSendTurn);
      }
      return false;
    }
    return true;
  }

  private readonly nextSendTurn = (): void => {
    this.turnYield = false;
    this.turnBytes = 0;
    for (const o of this.sending) o.alive();
    this.serveSends();
  };

  /** The socket the next chunk frame goes to: this one, or a stripe, in rotation. */
  private sendTarget(): PeerConn {
    const n = this.stripes.length;
    if (n === 0) return this;
    const i = this.rr % (n + 1);
    return i === 0 ? this : this.stripes[i - 1]!;
  }

  /** A chunk from any socket of a striped connection (decode side), through the reassembly. */
  private stripedChunk(from: PeerConn, room: RoomId, offset: number, data: Buffer): void {
    if (!this.reorder) {
      this.owner.stats.badFrames++;
      this.refuse(`unexpected chunk frame (room ${room}) on a stripe of the ${this.side} side`);
      return;
    }
    this.reorder.chunk(room, offset, data, from === this ? 0 : this.stripes.indexOf(from) + 1);
  }

  /** Takes a transfer out of the rotation (ended or settled); the turn stays with the next one. */
  private dropSend(o: Outgoing): void {
    const i = this.sending.indexOf(o);
    if (i < 0) return;
    this.sending.splice(i, 1);
    if (i < this.sendCursor) this.sendCursor--;
    if (this.turnOwner === o) this.turnOwner = undefined;
  }

  /** Hands one frame to the socket; false if the socket is gone or the queue cap is exceeded. */
  private write(frame: Buffer | Buffer[], cb?: (err?: Error | null) => void): boolean {
    const s = this.socket;
    if (this.state === 'closing' || this.state === 'closed' || s.destroyed || !s.writable) return false;
    let len: number;
    if (Array.isArray(frame)) {
      s.cork();
      for (let i = 0; i < frame.length - 1; i++) s.write(frame[i]);
      s.write(frame[frame.length - 1], cb);
      s.uncork();
      len = frame.reduce((a, b) => a + b.length, 0);
    } else {
      s.write(frame, cb);
      len = frame.length;
    }
    this.owner.stats.framesOut++;
    this.owner.stats.bytesOut += len;
    if (s.writableLength > this.owner.s.maxQueuedBytes) {
      this.terminate(`send queue over cap: ${s.writableLength} bytes queued (max ${this.owner.s.maxQueuedBytes}); peer is not reading`, { lost: true });
      return false;
    }
    return true;
  }

  private get ending(): boolean {
    return this.state === 'closing' || this.state === 'closed';
  }

  /**
   * @internal Bytes read from the socket by its owner (a socket created with `onread`, whose
   * reads go into one reused buffer instead of 'data' events): consumed before returning.
   */
  received(buf: Buffer): void {
    this.onData(buf);
  }

  private onData(buf: Buffer): void {
    if (this.ending) return;
    this.heartbeat?.received();
    this.owner.stats.bytesIn += buf.length;
    this.countRead(buf.length);
    try {
      for (const f of this.decoder.feed(buf)) {
        if (f.kind === 'control' || f.final) this.owner.stats.framesIn++;
        this.onFrame(f);
        if (this.ending) return;
      }
    } catch (e) {
      if (e instanceof KvError && e.code === 'BAD_FRAME') {
        this.owner.stats.badFrames++;
        this.refuse(`bad frame: ${e.message}`, 'AUTH_FAILED');
      } else {
        this.owner.s.log.error({ peer: this.id, err: errText(e) }, 'kv channel internal error');
        this.terminate(`internal error: ${errText(e)}`, { lost: true });
      }
    }
  }

  /**
   * READ_TURN_BYTES: `n` more bytes read in this event-loop turn; past the budget the socket
   * stops reading until the turn's check phase, where the count restarts and reading resumes.
   */
  private countRead(n: number): void {
    this.turnRead += n;
    if (!this.readTurnEnd) {
      this.readTurnEnd = true;
      setImmediate(this.endReadTurn);
    }
    if (this.turnRead >= READ_TURN_BYTES && !this.readYielded) {
      this.readYielded = true;
      this.pauseSocket();
    }
  }

  private readonly endReadTurn = (): void => {
    this.readTurnEnd = false;
    this.turnRead = 0;
    if (this.readYielded) {
      this.readYielded = false;
      this.resumeSocket();
    }
  };

  private onFrame(f: Frame): void {
    if (this.state === 'handshake') {
      // The decoder refuses chunk frames until authenticated.
      if (f.kind === 'control') this.onHandshake(f.msg);
      return;
    }
    const h = this.owner.handlers;
    if (f.kind === 'chunk' && (this.primary || this.reorder)) {
      // a striped connection's chunk, from this socket or a stripe: reassembled in order
      (this.primary ?? this).stripedChunk(this, f.room, f.offset, f.data);
      return;
    }
    if (f.kind === 'chunk') {
      if (!h.onChunk) {
        this.owner.stats.badFrames++;
        this.refuse(`unexpected chunk frame (room ${f.room}) on the ${this.side} side`);
        return;
      }
      this.call('onChunk', () => h.onChunk?.(this, f.room, f.offset, f.data));
      return;
    }
    const msg = f.msg;
    switch (msg.type) {
      case 'ping':
        this.write(encodeControl({ type: 'pong', seq: msg.seq }));
        return;
      case 'pong': {
        const t = this.pingSentAt.get(msg.seq);
        if (t !== undefined) {
          this.rttMs = this.owner.s.clock.nowMs() - t;
          this.pingSentAt.delete(msg.seq);
        }
        return;
      }
      case 'hello':
      case 'auth':
      case 'auth_ok':
      case 'auth_fail':
        this.owner.stats.badFrames++;
        this.refuse(`handshake message '${msg.type}' after authentication`);
        return;
      default:
        if (this.primary) {
          this.owner.stats.badFrames++;
          this.refuse(`control message '${msg.type}' on a stripe (only chunk frames and heartbeats go there)`);
          return;
        }
        if ('epoch' in msg && msg.epoch !== this.peerEpoch) {
          this.owner.stats.staleEpoch++;
          this.owner.s.log.warn(
            { peer: this.id, type: msg.type, room: msg.room, epoch: msg.epoch, boundEpoch: this.peerEpoch },
            'kv message with a stale epoch refused',
          );
          return;
        }
        if (this.reorder && msg.type === 'kv_begin') {
          this.reorder.begin(msg.room, msg.totalBytes);
          this.call('onMessage', () => h.onMessage?.(this, msg));
          this.reorder.drain();
          return;
        }
        if (this.reorder && msg.type === 'kv_end' && !this.reorder.end(msg.room, msg, msg.totalBytes)) return; // held until its room's bytes are all in
        if (this.reorder && msg.type === 'fail') this.reorder.forget(msg.room);
        this.call('onMessage', () => h.onMessage?.(this, msg));
    }
  }

  private onHandshake(msg: ControlMsg): void {
    const step = this.handshake.onMessage(msg);
    if (step.k === 'continue') {
      for (const m of step.send) this.write(encodeControl(m));
      return;
    }
    if (step.k === 'refuse') {
      if (step.code === 'SETTINGS_MISMATCH') {
        this.owner.stats.settingsMismatch++;
        // The one log line of this refusal on this side (refuse() stays quiet for it).
        this.owner.s.log.error({ peer: this.address, reason: step.reason }, 'kv pair refused: prefill and decode settings differ; no request will be dispatched over this pair');
      } else {
        this.owner.stats.authFailures++;
      }
      this.refuse(step.reason, step.code, step.send);
      return;
    }
    for (const m of step.send) this.write(encodeControl(m));
    this.peerEpoch = step.peerEpoch;
    this.peerSettings = step.peerSettings;
    this.streams = step.streams;
    this.stripeRequest = step.stripe;
    if (this.side === 'decode' && this.streams > 1 && !this.asStripe) {
      this.reorder = new StripeReorder(
        {
          chunk: (room, offset, data) => this.call('onChunk', () => this.owner.handlers.onChunk?.(this, room, offset, data)),
          end: (_room, m) => this.call('onMessage', () => this.owner.handlers.onMessage?.(this, m as PeerMsg)),
          paused: () => this.readPauses > 0 || this.state !== 'open',
          holdSocket: (i) => this.socketAt(i)?.pauseSocket(),
          releaseSocket: (i) => this.socketAt(i)?.resumeSocket(),
        },
        this.owner.s.maxQueuedBytes,
      );
    }
    this.open();
  }

  private open(): void {
    clearTimeout(this.authTimer);
    this.authTimer = undefined;
    this.state = 'open';
    this.authed = true;
    this.decoder.acceptChunks = true;
    this.heartbeat = new Heartbeat(this.owner.s.heartbeatMs, undefined, this.owner.s.clock);
    const hb = this.owner.s.heartbeatMs;
    this.pingTimer = setInterval(() => this.ping(), hb);
    this.pingTimer.unref();
    this.armLiveness();
    this.owner.s.log.info({ peer: this.id }, 'kv peer authenticated');
    this.resolveReady();
    this.owner.authenticated(this);
  }

  private ping(): void {
    if (this.state !== 'open') return;
    const seq = this.pingSeq++;
    this.pingSentAt.set(seq, this.owner.s.clock.nowMs());
    if (this.pingSentAt.size > 16) this.pingSentAt.delete(this.pingSentAt.keys().next().value as number);
    this.write(encodeControl({ type: 'ping', seq }));
  }

  private armLiveness(): void {
    const hb = this.heartbeat!;
    this.liveTimer = setTimeout(() => {
      // Decide after the poll phase, so bytes that arrived while our loop was busy count first.
      setImmediate(() => {
        if (this.state !== 'open') return;
        const v = hb.check();
        if (v.k === 'lost') {
          this.terminate(v.reason, { lost: true });
          return;
        }
        if (v.k === 'stalled') {
          this.owner.stats.ownStalls++;
          this.owner.s.log.warn({ peer: this.id, lateMs: v.lateMs }, 'this process stalled: liveness check ran late, peer budget restarted (the peer is not blamed for our stall)');
        }
        this.armLiveness();
      });
    }, hb.nextCheckInMs());
    this.liveTimer.unref();
  }

  /** Closes for a protocol/auth reason: logs, tells the peer during the handshake (prefill side), destroys. */
  private refuse(reason: string, code: 'AUTH_FAILED' | 'SETTINGS_MISMATCH' | 'TIMEOUT' = 'AUTH_FAILED', send?: ControlMsg[]): void {
    if (this.state === 'closing' || this.state === 'closed') return;
    const wasHandshake = this.state === 'handshake';
    if (code !== 'SETTINGS_MISMATCH') this.owner.s.log.warn({ peer: this.id, reason }, 'closing kv connection');
    if (wasHandshake && this.side === 'prefill') {
      // Best effort, so decode can report a refused secret (or a settings mismatch) rather than a dead peer.
      for (const m of send ?? [{ type: 'auth_fail', reason, code: 'auth_failed' } as ControlMsg]) this.write(encodeControl(m));
      this.socket.end();
    }
    this.failure = wasHandshake ? new KvError(code, `${this.side === 'decode' ? `prefill ${this.address}` : 'peer'}: ${reason}`) : undefined;
    this.terminate(reason, { lost: true, graceful: wasHandshake && this.side === 'prefill' });
  }

  private terminate(reason: string, opts: { lost: boolean; graceful?: boolean }): void {
    if (this.state === 'closed') return;
    if (this.state === 'closing') {
      if (opts.graceful) return;
      this.finish();
      return;
    }
    this.reason = reason;
    this.lost = opts.lost;
    if (opts.graceful && !this.socket.destroyed) {
      this.state = 'closing';
      this.stopTimers();
      this.socket.end();
      this.closeTimer = setTimeout(() => this.finish(), this.owner.s.closeTimeoutMs);
      this.closeTimer.unref();
      for (const w of [...this.closeWaiters]) w(reason);
      return;
    }
    this.finish();
  }

  private finish(): void {
    if (this.state === 'closed') return;
    const wasOpen = this.authed;
    this.state = 'closed';
    this.stopTimers();
    clearTimeout(this.closeTimer);
    this.socket.destroy();
    // a striped connection is one connection: any socket's end ends all of them
    this.reorder?.clear();
    const reason0 = this.reason || 'connection closed';
    for (const m of this.stripes.splice(0)) m.destroy(`its striped connection ended: ${reason0}`);
    const p = this.primary;
    if (p) {
      const i = p.stripes.indexOf(this);
      if (i >= 0) p.stripes.splice(i, 1);
      p.terminate(`stripe ${this.address} lost: ${reason0}`, { lost: true });
    }
    const reason = this.reason || 'connection closed';
    this.rejectReady(this.failure ?? new KvError('PEER_LOST', `${this.side === 'decode' ? `prefill ${this.address}` : 'peer'}: ${reason}`));
    for (const w of [...this.closeWaiters]) w(reason);
    this.closeWaiters.clear();
    const isStripe = p !== undefined || this.asStripe || this.stripeRequest !== undefined;
    if (wasOpen && isStripe) this.owner.s.log.debug({ peer: this.id, reason }, 'kv stripe closed');
    else if (wasOpen) {
      if (this.lost) {
        this.owner.stats.peersLost++;
        this.owner.s.log.warn({ peer: this.id, reason }, 'kv peer lost');
      } else {
        this.owner.s.log.info({ peer: this.id, reason }, 'kv connection closed');
      }
      const h = this.owner.handlers;
      this.call('onPeerLost', () => h.onPeerLost?.(this, reason));
    }
    this.owner.closed(this);
    this.resolveClosed();
  }

  private stopTimers(): void {
    clearTimeout(this.authTimer);
    clearInterval(this.pingTimer);
    clearTimeout(this.liveTimer);
    this.authTimer = this.pingTimer = this.liveTimer = undefined;
  }

  private call(name: string, fn: () => void): void {
    try {
      fn();
    } catch (e) {
      this.owner.s.log.error({ peer: this.id, err: errText(e), stack: (e as Error)?.stack }, `kv ${name} handler threw`);
    }
  }
}

function reasonText(r: unknown): string {
  if (r instanceof Error) return r.message;
  return r === undefined ? 'aborted' : String(r);
}

