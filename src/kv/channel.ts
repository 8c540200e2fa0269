/**
 * The prefill↔decode KV channel: one persistent, mutually authenticated TCP connection per
 * prefill–decode pair, opened by decode (KvPeerPool) to prefill's bootstrap port (KvServer),
 * reused across rooms, carrying control frames and KV chunk frames (wire format: messages.ts,
 * framing: frame.ts, handshake: auth.ts).
 *
 * Guarantees:
 * - Nothing blocks the event loop: all writes are async. Chunk sends keep at most
 *   `sendWindowBytes` queued in user space and wait for the socket to flush; any connection whose
 *   queue exceeds `maxQueuedBytes` is destroyed as lost instead of buffering without bound.
 * - Every wait has a deadline: TCP connect (connectTimeoutMs), handshake (authTimeoutMs),
 *   liveness (2 heartbeat intervals without a received byte), chunk-send stall (stallMs),
 *   graceful close (closeTimeoutMs, then destroy).
 * - Anything unexpected (malformed, oversized or unknown frame; a frame before authentication; a
 *   handshake frame after it) closes that one connection with a logged reason and a counter; the
 *   process and the other connections live on.
 * - The peer's session epoch is bound at authentication; register / kv_ack / fail carrying
 *   another epoch are refused (logged, counted in stats.staleEpoch), never delivered.
 * - onPeerLost fires exactly once for every authenticated connection that ends, whatever the
 *   cause (including a local close); the owner should fail every room bound to it.
 */
import net from 'node:net';
import { authMac, newNonce, verifyMac } from './auth.js';
import { encodeChunk, encodeControl, FrameDecoder, type Frame } from './frame.js';
import { MAX_CHUNK_BYTES, type ControlMsg, type RoomMsg } from './messages.js';
import { KvError } from './types.js';

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
}

/** Callbacks of a KvServer / KvPeerPool. Exceptions thrown by them are logged and swallowed. */
export interface KvHandlers {
  /** A room message (register, registered, kv_begin, kv_end, kv_ack, fail) with a valid epoch. */
  onMessage?: (conn: PeerConn, msg: RoomMsg) => void;
  /**
   * KV data: `data` goes at byte `offset` of the blob of `room`. Data is delivered as it arrives,
   * without copies: a chunk frame may come out as several calls with contiguous offsets, each
   * with 1..MAX_CHUNK_BYTES bytes. `data` is a view into a socket read buffer: copy it out, do
   * not keep it. Without this handler a chunk frame is a protocol error that closes the connection.
   */
  onChunk?: (conn: PeerConn, room: string, offset: number, data: Buffer) => void;
  /** An authenticated connection ended (peer lost, bad frame, queue overflow or local close). Once per connection. */
  onPeerLost?: (conn: PeerConn, reason: string) => void;
  /** A connection finished authentication. */
  onConnect?: (conn: PeerConn) => void;
}

/** Options shared by both ends. */
export interface KvChannelOptions extends KvHandlers {
  /** Shared secret of the deployment (non-empty). */
  secret: string | Buffer;
  /** This process's session epoch (hex, 8..64 chars; see newEpoch()). */
  epoch: string;
  /** Ping interval, ms (default 1000). A peer silent for 2 intervals is lost. */
  heartbeatMs?: number;
  /** Deadline of the whole handshake after TCP connect/accept, ms (default 2000). */
  authTimeoutMs?: number;
  /** Cap on bytes queued in user space per connection; over it the connection is destroyed as lost (default 64 MiB). */
  maxQueuedBytes?: number;
  /** sendChunks stops writing while this many bytes are queued (default min(4 MiB, maxQueuedBytes / 4)). */
  sendWindowBytes?: number;
  /** How long close() waits for queued bytes to flush before destroying, ms (default 2000). */
  closeTimeoutMs?: number;
  log?: KvLog;
}

export interface KvServerOptions extends KvChannelOptions {
  /** Listen address (default '0.0.0.0'). */
  host?: string;
  /** Listen port (default 8998; 0 = any free port). */
  port?: number;
  /** Connections accepted at once, authenticated or not (default 1024). */
  maxConnections?: number;
}

export interface KvPeerPoolOptions extends KvChannelOptions {
  /** TCP connect deadline, ms (default 2000). */
  connectTimeoutMs?: number;
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
}

export const DEFAULT_BOOTSTRAP_PORT = 8998;
export const DEFAULT_HEARTBEAT_MS = 1000;
/** Heartbeat intervals of silence after which a peer is lost. */
export const HEARTBEAT_MISS_BUDGET = 2;

/** Fresh zeroed counters. */
export function newKvStats(): KvStats {
  return { framesIn: 0, framesOut: 0, bytesIn: 0, bytesOut: 0, authFailures: 0, badFrames: 0, staleEpoch: 0, peersLost: 0 };
}

const noop = (): void => {};
const NOOP_LOG: KvLog = { info: noop, warn: noop, error: noop, debug: noop };
const EPOCH_RE = /^[0-9a-f]{8,64}$/;

interface Settings {
  secret: string | Buffer;
  epoch: string;
  heartbeatMs: number;
  authTimeoutMs: number;
  maxQueuedBytes: number;
  sendWindowBytes: number;
  closeTimeoutMs: number;
  log: KvLog;
}

function settings(o: KvChannelOptions): Settings {
  if (o.secret === undefined || o.secret.length === 0) throw new TypeError('KV channel: secret must be a non-empty string or Buffer');
  if (typeof o.epoch !== 'string' || !EPOCH_RE.test(o.epoch)) throw new TypeError(`KV channel: epoch must be 8..64 lowercase hex chars, got ${JSON.stringify(o.epoch)}`);
  const posInt = (name: string, v: number | undefined, def: number, min = 1): number => {
    const x = v ?? def;
    if (!Number.isSafeInteger(x) || x < min) throw new TypeError(`KV channel: ${name} must be an integer >= ${min}, got ${v}`);
    return x;
  };
  const maxQueuedBytes = posInt('maxQueuedBytes', o.maxQueuedBytes, 64 * 1024 * 1024, 64 * 1024);
  return {
    secret: o.secret,
    epoch: o.epoch,
    heartbeatMs: posInt('heartbeatMs', o.heartbeatMs, DEFAULT_HEARTBEAT_MS, 10),
    authTimeoutMs: posInt('authTimeoutMs', o.authTimeoutMs, 2000),
    maxQueuedBytes,
    sendWindowBytes: Math.min(posInt('sendWindowBytes', o.sendWindowBytes, Math.min(4 * 1024 * 1024, Math.floor(maxQueuedBytes / 4))), maxQueuedBytes),
    closeTimeoutMs: posInt('closeTimeoutMs', o.closeTimeoutMs, 2000),
    log: o.log ?? NOOP_LOG,
  };
}

/** What a PeerConn needs from its owner. */
interface Owner {
  readonly s: Settings;
  readonly stats: KvStats;
  readonly handlers: KvHandlers;
  authenticated(conn: PeerConn): void;
  closed(conn: PeerConn): void;
}

type ConnState = 'handshake' | 'open' | 'closing' | 'closed';
type Side = 'prefill' | 'decode';

const errText = (e: unknown): string => (e instanceof Error ? ((e as NodeJS.ErrnoException).code ?? e.message) : String(e));

/**
 * One authenticated channel connection, as seen from either side. Obtained from KvServer
 * (onConnect / handlers / get(id)) or KvPeerPool.get(); never constructed directly.
 */
export class PeerConn {
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
  private serverNonce = '';
  private clientNonce = '';
  private helloEpoch = '';
  private lastRx = Date.now();
  private pingSeq = 0;
  private pingSentAt = new Map<number, number>();
  private authTimer: NodeJS.Timeout | undefined;
  private pingTimer: NodeJS.Timeout | undefined;
  private liveTimer: NodeJS.Timeout | undefined;
  private closeTimer: NodeJS.Timeout | undefined;
  private readonly closeWaiters = new Set<(reason: string) => void>();
  private readonly drainWaiters = new Set<() => void>();
  private resolveReady!: () => void;
  private rejectReady!: (e: KvError) => void;
  private resolveClosed!: () => void;
  private failure: KvError | undefined;

  /** @internal */
  constructor(
    private readonly socket: net.Socket,
    private readonly side: Side,
    private readonly owner: Owner,
    address: string,
  ) {
    this.address = address;
    this.ready = new Promise<void>((res, rej) => {
      this.resolveReady = res;
      this.rejectReady = rej;
    });
    this.ready.catch(noop);
    this.closed = new Promise<void>((res) => (this.resolveClosed = res));
    socket.setNoDelay(true);
    socket.on('data', (b: Buffer) => this.onData(b));
    socket.on('drain', () => {
      for (const w of [...this.drainWaiters]) w();
    });
    socket.on('error', (e) => this.terminate(`socket error: ${errText(e)}`, { lost: true }));
    socket.on('end', () => this.terminate('connection closed by peer', { lost: true }));
    socket.on('close', () => this.terminate(this.state === 'closing' ? this.reason : 'connection closed', { lost: true }));
    this.authTimer = setTimeout(() => {
      this.owner.stats.authFailures++;
      this.refuse(`authentication timed out after ${this.owner.s.authTimeoutMs} ms`, 'TIMEOUT');
    }, owner.s.authTimeoutMs);
    this.authTimer.unref();
    if (side === 'prefill') {
      this.serverNonce = newNonce();
      this.write(encodeControl({ type: 'hello', nonce: this.serverNonce, epoch: owner.s.epoch, role: 'prefill' }));
    }
  }

  /** "decode@<addr>:<port>#<epoch prefix>" on prefill, "prefill@<host>:<port>#<epoch prefix>" on decode. */
  get id(): string {
    return `${this.side === 'prefill' ? 'decode' : 'prefill'}@${this.address}#${this.peerEpoch.slice(0, 8) || '?'}`;
  }

  /** True while authenticated and not closing. */
  get alive(): boolean {
    return this.state === 'open';
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
  sendChunks(roomId: string, blob: Buffer, opts: SendChunksOptions = {}): Promise<void> {
    const chunkBytes = opts.chunkBytes ?? MAX_CHUNK_BYTES;
    const stallMs = opts.stallMs ?? 10_000;
    if (!Number.isSafeInteger(chunkBytes) || chunkBytes < 1 || chunkBytes > MAX_CHUNK_BYTES) {
      return Promise.reject(new RangeError(`chunkBytes must be an integer in 1..${MAX_CHUNK_BYTES}, got ${chunkBytes}`));
    }
    if (!Number.isSafeInteger(stallMs) || stallMs < 1) return Promise.reject(new RangeError(`stallMs must be a positive integer, got ${stallMs}`));
    try {
      encodeChunk(roomId, 0, Buffer.alloc(1)); // validates the room id up front
    } catch (e) {
      return Promise.reject(e);
    }
    const signal = opts.signal;
    if (signal?.aborted) return Promise.reject(new KvError('ABORTED', `transfer of room ${roomId} aborted before start: ${reasonText(signal.reason)}`));
    if (this.state !== 'open') return Promise.reject(this.lostError(roomId));
    if (blob.length === 0) return Promise.resolve();

    return new Promise<void>((resolve, reject) => {
      const window = this.owner.s.sendWindowBytes;
      let next = 0;
      let pending = 0;
      let flushed = 0;
      let done = false;
      const settle = (err?: Error): void => {
        if (done) return;
        done = true;
        clearTimeout(stall);
        this.drainWaiters.delete(pump);
        this.closeWaiters.delete(onClose);
        signal?.removeEventListener('abort', onAbort);
        if (err) reject(err);
        else resolve();
      };
      const onAbort = (): void => settle(new KvError('ABORTED', `transfer of room ${roomId} aborted: ${reasonText(signal?.reason)}`));
      const onClose = (): void => settle(this.lostError(roomId));
      const stall = setTimeout(
        () => settle(new KvError('TIMEOUT', `transfer of room ${roomId} stalled: no progress for ${stallMs} ms (${flushed}/${blob.length} bytes flushed)`)),
        stallMs,
      );
      stall.unref();
      const written = (n: number) => (err?: Error | null): void => {
        pending--;
        if (done) return;
        if (err) return settle(this.lostError(roomId, err));
        flushed += n;
        stall.refresh();
        if (opts.onProgress) {
          try {
            opts.onProgress(n);
          } catch (e) {
            this.owner.s.log.error({ peer: this.id, room: roomId, err: errText(e) }, 'kv sendChunks onProgress threw');
          }
        }
        if (next >= blob.length && pending === 0) return settle();
        pump();
      };
      function pumpImpl(this: PeerConn): void {
        while (!done && next < blob.length) {
          if (this.state !== 'open') return settle(this.lostError(roomId));
          if (this.socket.writableLength >= window) return; // resumed by a flush of ours or by 'drain'
          const n = Math.min(chunkBytes, blob.length - next);
          const frame = encodeChunk(roomId, next, blob.subarray(next, next + n));
          next += n;
          pending++;
          if (!this.write(frame, written(n))) return settle(this.lostError(roomId));
        }
      }
      const pump = (): void => {
        if (!done) stall.refresh();
        pumpImpl.call(this);
      };
      this.drainWaiters.add(pump);
      this.closeWaiters.add(onClose);
      signal?.addEventListener('abort', onAbort, { once: true });
      pumpImpl.call(this);
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

  private onData(buf: Buffer): void {
    if (this.ending) return;
    this.lastRx = Date.now();
    this.owner.stats.bytesIn += buf.length;
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

  private onFrame(f: Frame): void {
    if (this.state === 'handshake') {
      // The decoder refuses chunk frames until authenticated.
      if (f.kind === 'control') this.onHandshake(f.msg);
      return;
    }
    const h = this.owner.handlers;
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
          this.rttMs = Date.now() - t;
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
        if ('epoch' in msg && msg.epoch !== this.peerEpoch) {
          this.owner.stats.staleEpoch++;
          this.owner.s.log.warn(
            { peer: this.id, type: msg.type, room: msg.room, epoch: msg.epoch, boundEpoch: this.peerEpoch },
            'kv message with a stale epoch refused',
          );
          return;
        }
        this.call('onMessage', () => h.onMessage?.(this, msg));
    }
  }

  private onHandshake(msg: ControlMsg): void {
    const s = this.owner.s;
    if (this.side === 'prefill') {
      if (msg.type !== 'auth') {
        this.owner.stats.authFailures++;
        this.refuse(`unauthenticated '${msg.type}' frame before auth`);
        return;
      }
      if (!verifyMac(s.secret, 'decode>prefill', this.serverNonce, msg.nonce, msg.epoch, msg.mac)) {
        this.owner.stats.authFailures++;
        this.refuse('authentication failed: bad mac (wrong secret?)');
        return;
      }
      this.clientNonce = msg.nonce;
      this.peerEpoch = msg.epoch;
      this.write(encodeControl({ type: 'auth_ok', mac: authMac(s.secret, 'prefill>decode', this.serverNonce, this.clientNonce, s.epoch) }));
      this.open();
      return;
    }
    // decode side: hello, then auth_ok
    if (!this.serverNonce) {
      if (msg.type !== 'hello') {
        this.owner.stats.authFailures++;
        this.refuse(`expected hello from prefill, got '${msg.type}'`);
        return;
      }
      this.serverNonce = msg.nonce;
      this.helloEpoch = msg.epoch;
      this.clientNonce = newNonce();
      this.write(
        encodeControl({
          type: 'auth',
          nonce: this.clientNonce,
          epoch: s.epoch,
          role: 'decode',
          mac: authMac(s.secret, 'decode>prefill', this.serverNonce, this.clientNonce, s.epoch),
        }),
      );
      return;
    }
    if (msg.type === 'auth_fail') {
      this.owner.stats.authFailures++;
      this.refuse(`prefill refused authentication: ${msg.reason}`);
      return;
    }
    if (msg.type !== 'auth_ok') {
      this.owner.stats.authFailures++;
      this.refuse(`expected auth_ok from prefill, got '${msg.type}'`);
      return;
    }
    if (!verifyMac(s.secret, 'prefill>decode', this.serverNonce, this.clientNonce, this.helloEpoch, msg.mac)) {
      this.owner.stats.authFailures++;
      this.refuse('prefill failed to authenticate: bad mac (wrong secret?)');
      return;
    }
    this.peerEpoch = this.helloEpoch;
    this.open();
  }

  private open(): void {
    clearTimeout(this.authTimer);
    this.authTimer = undefined;
    this.state = 'open';
    this.authed = true;
    this.decoder.acceptChunks = true;
    this.lastRx = Date.now();
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
    this.pingSentAt.set(seq, Date.now());
    if (this.pingSentAt.size > 16) this.pingSentAt.delete(this.pingSentAt.keys().next().value as number);
    this.write(encodeControl({ type: 'ping', seq }));
  }

  private armLiveness(): void {
    const budget = HEARTBEAT_MISS_BUDGET * this.owner.s.heartbeatMs;
    const due = Math.max(1, this.lastRx + budget - Date.now());
    this.liveTimer = setTimeout(() => {
      // Decide after the poll phase, so bytes that arrived while our loop was busy count first.
      setImmediate(() => {
        if (this.state !== 'open') return;
        const silent = Date.now() - this.lastRx;
        if (silent >= budget) {
          this.terminate(`peer silent for ${silent} ms (heartbeat ${this.owner.s.heartbeatMs} ms, budget ${HEARTBEAT_MISS_BUDGET} intervals)`, { lost: true });
        } else {
          this.armLiveness();
        }
      });
    }, due);
    this.liveTimer.unref();
  }

  /** Closes for a protocol/auth reason: logs, tells the peer during the handshake (prefill side), destroys. */
  private refuse(reason: string, code: 'AUTH_FAILED' | 'TIMEOUT' = 'AUTH_FAILED'): void {
    if (this.state === 'closing' || this.state === 'closed') return;
    const wasHandshake = this.state === 'handshake';
    this.owner.s.log.warn({ peer: this.id, reason }, 'closing kv connection');
    if (wasHandshake && this.side === 'prefill') {
      // Best effort, so decode can report a refused secret rather than a dead peer.
      this.write(encodeControl({ type: 'auth_fail', reason }));
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
    const reason = this.reason || 'connection closed';
    this.rejectReady(this.failure ?? new KvError('PEER_LOST', `${this.side === 'decode' ? `prefill ${this.address}` : 'peer'}: ${reason}`));
    for (const w of [...this.closeWaiters]) w(reason);
    this.closeWaiters.clear();
    this.drainWaiters.clear();
    if (wasOpen) {
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

// ---------------------------------------------------------------------------------------------

/**
 * Prefill side: accepts decode connections on the bootstrap port, authenticates them and
 * delivers their room messages. Handlers can be given as options or assigned later.
 */
export class KvServer implements KvHandlers {
  onMessage?: KvHandlers['onMessage'];
  onChunk?: KvHandlers['onChunk'];
  onPeerLost?: KvHandlers['onPeerLost'];
  onConnect?: KvHandlers['onConnect'];
  /** Counters (monotonic). */
  readonly stats: KvStats = newKvStats();

  private readonly s: Settings;
  private readonly host: string;
  private readonly wantPort: number;
  private readonly server: net.Server;
  private readonly conns = new Set<PeerConn>();
  private readonly byId = new Map<string, PeerConn>();
  private closing: Promise<void> | undefined;

  /** Throws TypeError on invalid options. */
  constructor(opts: KvServerOptions) {
    this.s = settings(opts);
    this.host = opts.host ?? '0.0.0.0';
    this.wantPort = opts.port ?? DEFAULT_BOOTSTRAP_PORT;
    this.onMessage = opts.onMessage;
    this.onChunk = opts.onChunk;
    this.onPeerLost = opts.onPeerLost;
    this.onConnect = opts.onConnect;
    this.server = net.createServer({ noDelay: true }, (sock) => this.accept(sock));
    this.server.maxConnections = opts.maxConnections ?? 1024;
    this.server.on('error', (e) => this.s.log.error({ err: errText(e) }, 'kv server error'));
  }

  /** Starts listening; resolves with the bound port. Rejects with the listen error (e.g. EADDRINUSE). */
  listen(): Promise<number> {
    if (this.closing) return Promise.reject(new KvError('PEER_LOST', 'kv server is closed'));
    return new Promise((resolve, reject) => {
      const onErr = (e: Error): void => reject(e);
      this.server.once('error', onErr);
      this.server.listen(this.wantPort, this.host, () => {
        this.server.off('error', onErr);
        const p = this.port as number;
        this.s.log.info({ host: this.host, port: p }, 'kv server listening');
        resolve(p);
      });
    });
  }

  /** Bound port, once listening. */
  get port(): number | undefined {
    const a = this.server.address();
    return a && typeof a === 'object' ? a.port : undefined;
  }

  /** The authenticated, open connection with this id, if any. */
  get(id: string): PeerConn | undefined {
    return this.byId.get(id);
  }

  /** All authenticated, open connections. */
  connections(): PeerConn[] {
    return [...this.byId.values()];
  }

  /** Stops accepting and closes every connection gracefully (each bounded by closeTimeoutMs). Idempotent. */
  close(): Promise<void> {
    if (!this.closing) {
      const listening = new Promise<void>((res) => (this.server.listening ? this.server.close(() => res()) : res()));
      const conns = [...this.conns].map((c) => c.close('kv server closing'));
      this.closing = Promise.all([listening, ...conns]).then(noop);
    }
    return this.closing;
  }

  /** Stops accepting and destroys every connection at once. Idempotent. */
  destroy(): void {
    if (!this.closing) this.closing = new Promise<void>((res) => (this.server.listening ? this.server.close(() => res()) : res()));
    for (const c of [...this.conns]) c.destroy('kv server destroyed');
  }

  private accept(sock: net.Socket): void {
    if (this.closing) {
      sock.destroy();
      return;
    }
    const address = `${sock.remoteAddress}:${sock.remotePort}`;
    const owner: Owner = {
      s: this.s,
      stats: this.stats,
      handlers: this,
      authenticated: (c) => {
        this.byId.set(c.id, c);
        if (this.onConnect) {
          try {
            this.onConnect(c);
          } catch (e) {
            this.s.log.error({ peer: c.id, err: errText(e) }, 'kv onConnect handler threw');
          }
        }
      },
      closed: (c) => {
        this.conns.delete(c);
        if (this.byId.get(c.id) === c) this.byId.delete(c.id);
      },
    };
    this.s.log.debug({ address }, 'kv connection accepted');
    this.conns.add(new PeerConn(sock, 'prefill', owner, address));
  }
}

/**
 * Decode side: one lazily created, authenticated connection per prefill "host:port", shared by
 * all rooms; a dead one is replaced on the next get(). Handlers can be given as options or
 * assigned later.
 */
export class KvPeerPool implements KvHandlers {
  onMessage?: KvHandlers['onMessage'];
  onChunk?: KvHandlers['onChunk'];
  onPeerLost?: KvHandlers['onPeerLost'];
  onConnect?: KvHandlers['onConnect'];
  /** Counters (monotonic). */
  readonly stats: KvStats = newKvStats();

  private readonly s: Settings;
  private readonly connectTimeoutMs: number;
  private readonly live = new Map<string, PeerConn>();
  private readonly pending = new Map<string, Promise<PeerConn>>();
  private readonly all = new Set<PeerConn>();
  private readonly dialing = new Set<net.Socket>();
  private closing: Promise<void> | undefined;

  /** Throws TypeError on invalid options. */
  constructor(opts: KvPeerPoolOptions) {
    this.s = settings(opts);
    this.connectTimeoutMs = opts.connectTimeoutMs ?? 2000;
    if (!Number.isSafeInteger(this.connectTimeoutMs) || this.connectTimeoutMs < 1) throw new TypeError('KV channel: connectTimeoutMs must be a positive integer');
    this.onMessage = opts.onMessage;
    this.onChunk = opts.onChunk;
    this.onPeerLost = opts.onPeerLost;
    this.onConnect = opts.onConnect;
  }

  /**
   * The live authenticated connection to prefill at host:port, connecting if needed; concurrent
   * callers share one attempt. Rejects with KvError: 'PEER_LOST' (refused/reset/closed, or the
   * pool is closed), 'AUTH_FAILED' (secret mismatch or protocol error in the handshake),
   * 'TIMEOUT' (connect or handshake deadline).
   */
  get(host: string, port: number): Promise<PeerConn> {
    if (this.closing) return Promise.reject(new KvError('PEER_LOST', 'kv peer pool is closed'));
    const key = `${host}:${port}`;
    const c = this.live.get(key);
    if (c?.alive) return Promise.resolve(c);
    if (c) this.live.delete(key);
    let p = this.pending.get(key);
    if (!p) {
      p = this.connect(host, port, key).finally(() => this.pending.delete(key));
      this.pending.set(key, p);
    }
    return p;
  }

  /** The live connection to host:port without connecting, if any. */
  peek(host: string, port: number): PeerConn | undefined {
    const c = this.live.get(`${host}:${port}`);
    return c?.alive ? c : undefined;
  }

  /** All authenticated, open connections. */
  connections(): PeerConn[] {
    return [...this.live.values()].filter((c) => c.alive);
  }

  /** Refuses new gets, aborts pending connects and closes every connection gracefully. Idempotent. */
  close(): Promise<void> {
    if (!this.closing) {
      for (const s of this.dialing) s.destroy();
      this.closing = Promise.all([...this.all].map((c) => c.close('kv peer pool closing'))).then(noop);
    }
    return this.closing;
  }

  /** Like close() but destroys every connection at once. Idempotent. */
  destroy(): void {
    if (!this.closing) this.closing = Promise.resolve();
    for (const s of this.dialing) s.destroy();
    for (const c of [...this.all]) c.destroy('kv peer pool destroyed');
  }

  private connect(host: string, port: number, key: string): Promise<PeerConn> {
    return new Promise<PeerConn>((resolve, reject) => {
      const sock = net.connect({ host, port, noDelay: true });
      this.dialing.add(sock);
      let done = false;
      const fail = (e: KvError): void => {
        if (done) return;
        done = true;
        cleanup();
        sock.destroy();
        this.s.log.warn({ peer: key, err: e.message }, 'kv connect failed');
        reject(e);
      };
      const onError = (e: Error): void => fail(new KvError('PEER_LOST', `connect to prefill ${key} failed: ${errText(e)}`));
      const onClose = (): void => fail(new KvError('PEER_LOST', `connect to prefill ${key} aborted`));
      const timer = setTimeout(() => fail(new KvError('TIMEOUT', `connect to prefill ${key} timed out after ${this.connectTimeoutMs} ms`)), this.connectTimeoutMs);
      timer.unref();
      const cleanup = (): void => {
        clearTimeout(timer);
        this.dialing.delete(sock);
        sock.off('error', onError);
        sock.off('close', onClose);
      };
      sock.once('error', onError);
      sock.once('close', onClose);
      sock.once('connect', () => {
        if (done) return;
        done = true;
        cleanup();
        const owner: Owner = {
          s: this.s,
          stats: this.stats,
          handlers: this,
          authenticated: (c) => {
            this.live.set(key, c);
            if (this.onConnect) {
              try {
                this.onConnect(c);
              } catch (e) {
                this.s.log.error({ peer: c.id, err: errText(e) }, 'kv onConnect handler threw');
              }
            }
          },
          closed: (c) => {
            this.all.delete(c);
            if (this.live.get(key) === c) this.live.delete(key);
          },
        };
        const conn = new PeerConn(sock, 'decode', owner, key);
        this.all.add(conn);
        conn.ready.then(() => resolve(conn), reject);
      });
    });
  }
}
