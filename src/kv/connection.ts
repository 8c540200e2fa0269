/**
 * One KV channel connection (either side): the socket adapter around the sans-IO core
 * (conn-core.ts: frames, handshake, heartbeat) and the send rotation (send-rotation.ts), on
 * injected `Timers`. What is left here is the socket's: writes and their queue cap, read-turn
 * pacing, pausing reads, striping over several sockets (stripes.ts), closing. The server and the
 * pool that own connections are in channel.ts.
 *
 * Guarantees (see channel.ts for the whole list): nothing blocks the event loop; every wait has a
 * deadline; anything unexpected closes this one connection with a logged reason; onPeerLost fires
 * exactly once for every authenticated connection that ends.
 */
import type net from 'node:net';
import { ConnCore, CoreTimers, errText, noop, type CoreEnd, type CoreOpen, type KvConn, type KvLog, type KvStats, type Side } from './conn-core.js';
import type { Clock, Timers } from '../base/clock.js';
import { MAX_CHUNK_BYTES, type ControlMsg, type PairSettings, type PeerMsg } from './messages.js';
import { KvError, type RoomId } from './types.js';
import { StripeReorder } from './stripes.js';
import { sendFrom, SendRotation, type ChunkSource, type SendChunksOptions, type TransferHost } from './send-rotation.js';

export { errText, newKvStats, noop, NOOP_LOG, type KvConn, type KvLog, type KvStats, type Side } from './conn-core.js';
export { SEND_QUANTUM_BYTES, type ChunkSource, type SendChunksOptions } from './send-rotation.js';

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

/**
 * Bytes a connection reads from its socket per event-loop turn before it yields: then reads stop
 * until the turn's check phase (setImmediate) and go on in the next turn, after timers and other
 * sockets. libuv reads a readable socket up to 32 times per poll event (32 × the 256 KiB read
 * buffer = 8 MiB), each read handled on the spot (frame decode, CRC-32, ggsq walk, file write), so
 * a large state streaming in held decode's loop for tens of ms per poll event; 1 MiB (4 reads)
 * bounds a turn to a few ms. The sender is held back by TCP's window meanwhile; nothing is dropped.
 */
export const READ_TURN_BYTES = 1024 * 1024;

export const DEFAULT_HEARTBEAT_MS = 1000;
export { HEARTBEAT_MISS_BUDGET } from './heartbeat.js';

/** @internal Validated options shared by every connection of one server/pool. */
export interface Settings {
  secret: string | Buffer;
  epoch: string;
  /** This process's pair settings, exchanged in the handshake. */
  pair: PairSettings;
  /** Monotonic time source of the heartbeat and the ping round trip. */
  clock: Clock;
  /** Timers of the handshake deadline, heartbeat, send stalls, per-turn yields and close. */
  timers: Timers;
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

/**
 * One authenticated channel connection, as seen from either side. Obtained from KvServer
 * (onConnect / handlers / get(id)) or KvPeerPool.get(); never constructed directly.
 */
export class PeerConn implements KvConn {
  /** Sockets the pair agreed to stripe this connection over (1 until authenticated, and for a stripe). */
  streams = 1;
  /** @internal Prefill side: the striped connection this one asked to join in its auth (stripes.ts). */
  stripeRequest: { of: string; index: number } | undefined;
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
  private readonly core: ConnCore;
  private readonly ticks: CoreTimers;
  private cancelClose: (() => void) | undefined;
  private readonly closeWaiters = new Set<(reason: string) => void>();
  /** The running sendFrom transfers, taking turns (send-rotation.ts). */
  private readonly rotation: SendRotation;
  private turnYield = false;
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
  /** What sendFrom needs of this connection. */
  private readonly host: TransferHost;

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
    const s = owner.s;
    this.rotation = new SendRotation((turnBytes) => this.windowOpen(turnBytes));
    const self = this;
    this.host = {
      rotation: this.rotation,
      timers: s.timers,
      log: s.log,
      get name() {
        return self.id;
      },
      get open() {
        return self.state === 'open';
      },
      writeChunk: (frame, done) => {
        const to = this.sendTarget();
        if (to.socket.destroyed || !to.socket.writable) return 'gone';
        this.rr++;
        return to.write(frame, done);
      },
      lostError: (room, err) => this.lostError(room, err),
      onEnd: (fn) => {
        this.closeWaiters.add(fn);
        return () => this.closeWaiters.delete(fn);
      },
    };
    socket.setNoDelay(true);
    socket.on('data', (b: Buffer) => this.onData(b));
    socket.on('drain', () => {
      const p = this.primary ?? this;
      for (const o of p.rotation.sending) o.alive();
      p.rotation.serve();
    });
    socket.on('error', (e) => this.terminate(`socket error: ${errText(e)}`, { lost: true }));
    socket.on('end', () => this.terminate('connection closed by peer', { lost: true }));
    socket.on('close', () => this.terminate(this.state === 'closing' ? this.reason : 'connection closed', { lost: true }));
    this.core = new ConnCore(
      { side, secret: s.secret, epoch: s.epoch, pair: s.pair, streams: s.streams, ...(stripe ? { stripe } : {}), heartbeatMs: s.heartbeatMs, clock: s.clock, stats: owner.stats, log: s.log, address, name: () => this.id },
      {
        write: (frame) => this.write(frame),
        opened: (step) => this.opened(step),
        message: (msg) => this.onMessage(msg),
        chunk: (room, offset, data) => this.onChunk(room, offset, data),
        stalled: noop,
        ended: (e) => this.coreEnded(e),
      },
    );
    this.ticks = new CoreTimers(this.core, s.timers, s.heartbeatMs, s.authTimeoutMs);
    this.core.start();
  }

  /** Peer's session epoch, bound at authentication ('' before). */
  get peerEpoch(): string {
    return this.core.peerEpoch;
  }

  /** Peer's pair settings, bound at authentication. */
  get peerSettings(): PairSettings | undefined {
    return this.core.peerSettings;
  }

  /** Round-trip time of the last answered ping, ms (undefined until one is answered). */
  get rttMs(): number | undefined {
    return this.core.rttMs;
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
    return this.core.helloNonce;
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
        void this.owner.s.timers.turn().then(() => {
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
    return this.core.sendControl(msg);
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
    return sendFrom(this.host, roomId, source, opts);
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
   * The send rotation's gate: whether it may hand the socket more. The connection is open (else
   * every transfer is settled as lost), the queue is under the send window (a flush or 'drain'
   * serves again) and this event-loop turn has not handed over a whole window yet (else the rest
   * after the turn: when the peer reads as fast as we write, the kernel takes every write at
   * once, writableLength stays near 0 and nothing else would make the rotation yield).
   */
  private windowOpen(turnBytes: number): boolean {
    if (this.state !== 'open') {
      for (const o of [...this.rotation.sending]) o.lost();
      return false;
    }
    const window = this.owner.s.sendWindowBytes;
    // striped: strictly the next socket in the rotation (waiting for it keeps the skew between
    // the sockets, hence what the receiver holds out of order, bounded), each with its share of
    // the window, so a room that starts behind another waits for one window's bytes, as on one socket
    if (this.sendTarget().socket.writableLength >= Math.ceil(window / this.sockets)) return false;
    if (turnBytes >= window) {
      if (!this.turnYield) {
        this.turnYield = true;
        void this.owner.s.timers.turn().then(this.nextSendTurn);
      }
      return false;
    }
    return true;
  }

  private readonly nextSendTurn = (): void => {
    this.turnYield = false;
    this.rotation.newTurn();
    for (const o of this.rotation.sending) o.alive();
    this.rotation.serve();
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
      this.core.refuse(`unexpected chunk frame (room ${room}) on a stripe of the ${this.side} side`);
      return;
    }
    this.reorder.chunk(room, offset, data, from === this ? 0 : this.stripes.indexOf(from) + 1);
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
    this.countRead(buf.length);
    this.core.receive(buf);
  }

  /**
   * READ_TURN_BYTES: `n` more bytes read in this event-loop turn; past the budget the socket
   * stops reading until the turn's check phase, where the count restarts and reading resumes.
   */
  private countRead(n: number): void {
    this.turnRead += n;
    if (!this.readTurnEnd) {
      this.readTurnEnd = true;
      void this.owner.s.timers.turn().then(this.endReadTurn);
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

  /** A chunk the core decoded: through the reassembly of a striped connection, else to the handler. */
  private onChunk(room: RoomId, offset: number, data: Buffer): void {
    if (this.primary || this.reorder) {
      // a striped connection's chunk, from this socket or a stripe: reassembled in order
      (this.primary ?? this).stripedChunk(this, room, offset, data);
      return;
    }
    const h = this.owner.handlers;
    if (!h.onChunk) {
      this.owner.stats.badFrames++;
      this.core.refuse(`unexpected chunk frame (room ${room}) on the ${this.side} side`);
      return;
    }
    this.call('onChunk', () => h.onChunk?.(this, room, offset, data));
  }

  /** A room message the core accepted (its epoch is the connection's). */
  private onMessage(msg: PeerMsg): void {
    const h = this.owner.handlers;
    if (this.primary) {
      this.owner.stats.badFrames++;
      this.core.refuse(`control message '${msg.type}' on a stripe (only chunk frames and heartbeats go there)`);
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

  /** The handshake succeeded: bind what the pair agreed, start the heartbeat, tell the owner. */
  private opened(step: CoreOpen): void {
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
    this.state = 'open';
    this.authed = true;
    this.ticks.opened();
    this.owner.s.log.info({ peer: this.id }, 'kv peer authenticated');
    this.resolveReady();
    this.owner.authenticated(this);
  }

  /** The core gave up (refusal, bad frame, silent peer): close the socket accordingly. */
  private coreEnded(e: CoreEnd): void {
    if (this.ending) return;
    if (e.graceful) this.socket.end();
    this.failure = e.failure;
    this.terminate(e.reason, { lost: e.lost, graceful: e.graceful });
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
    this.core.end();
    if (opts.graceful && !this.socket.destroyed) {
      this.state = 'closing';
      this.ticks.stop();
      this.socket.end();
      this.cancelClose = this.owner.s.timers.after(this.owner.s.closeTimeoutMs, () => this.finish());
      for (const w of [...this.closeWaiters]) w(reason);
      return;
    }
    this.finish();
  }

  private finish(): void {
    if (this.state === 'closed') return;
    const wasOpen = this.authed;
    this.state = 'closed';
    this.core.end();
    this.ticks.stop();
    this.cancelClose?.();
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

  private call(name: string, fn: () => void): void {
    try {
      fn();
    } catch (e) {
      this.owner.s.log.error({ peer: this.id, err: errText(e), stack: (e as Error)?.stack }, `kv ${name} handler threw`);
    }
  }
}
