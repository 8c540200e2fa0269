/**
 * The prefill↔decode KV channel: one persistent, mutually authenticated TCP (or TLS, see
 * transport.ts) connection per prefill–decode pair, opened by decode (KvPeerPool) to prefill's bootstrap port (KvServer),
 * reused across rooms, carrying control frames and KV chunk frames (wire format: messages.ts,
 * framing: frame.ts, handshake: handshake.ts + auth.ts, liveness: heartbeat.ts, one connection:
 * connection.ts; this file: the server and the pool that own connections).
 *
 * Guarantees:
 * - Nothing blocks the event loop: all writes are async. Chunk sends keep at most
 *   `sendWindowBytes` queued in user space and wait for the socket to flush; any connection whose
 *   queue exceeds `maxQueuedBytes` is destroyed as lost instead of buffering without bound.
 * - Every wait has a deadline: TCP connect and TLS handshake (connectTimeoutMs), handshake (authTimeoutMs),
 *   liveness (2 heartbeat intervals without a received byte), chunk-send stall (stallMs),
 *   graceful close (closeTimeoutMs, then destroy).
 * - Anything unexpected (malformed, oversized or unknown frame; a frame before authentication; a
 *   handshake frame after it) closes that one connection with a logged reason and a counter; the
 *   process and the other connections live on.
 * - The peer's session epoch is bound at authentication; register / kv_ack / fail carrying
 *   another epoch are refused (logged, counted in stats.staleEpoch), never delivered.
 * - The pair's settings (model, context size, batch size, flash attention) are compared in the
 *   handshake: a mismatched pair is refused with one log line on each side and stats
 *   .settingsMismatch; the pool then refuses that address for MISMATCH_RETRY_MS without dialing.
 * - Liveness never blames the peer for this process's own event-loop stall (heartbeat.ts).
 * - onPeerLost fires exactly once for every authenticated connection that ends, whatever the
 *   cause (including a local close); the owner should fail every room bound to it.
 */
import type net from 'node:net';
import { DEFAULT_HEARTBEAT_MS, errText, newKvStats, noop, NOOP_LOG, PeerConn, type KvHandlers, type KvLog, type KvStats, type Owner, type Settings } from './connection.js';
import { systemClock, systemTimers, type Clock, type Timers } from '../base/clock.js';
import { MAX_KV_STREAMS, type PairSettings } from './messages.js';
import { KvError } from './types.js';
import { tcpTransport, type KvTransport } from './transport.js';

export { DEFAULT_HEARTBEAT_MS, HEARTBEAT_MISS_BUDGET, newKvStats, PeerConn, type KvConn, type KvHandlers, type KvLog, type KvStats, type SendChunksOptions, type ChunkSource } from './connection.js';

/** Options shared by both ends. */
export interface KvChannelOptions extends KvHandlers {
  /** Shared secret of the deployment (non-empty). */
  secret: string | Buffer;
  /** This process's session epoch (hex, 8..64 chars; see newEpoch()). */
  epoch: string;
  /**
   * This process's pair settings (model fingerprint, context size, batch size, flash attention),
   * exchanged in the handshake: a pair whose settings differ is refused (code SETTINGS_MISMATCH).
   */
  settings: PairSettings;
  /** Time source of the heartbeat (default the system's monotonic clock). */
  clock?: Clock;
  /** Timers of each connection: handshake deadline, heartbeat, send stalls, per-turn yields, close (default node's, unref'd). */
  timers?: Timers;
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
  /** How sockets are made: plain TCP (default) or TLS (./transport.ts). */
  transport?: KvTransport;
  /**
   * Sockets one connection's KV chunks may be striped over (`--kv-streams`, 1..MAX_KV_STREAMS,
   * default 1): the pair uses the smaller of both sides' values; decode dials the extra sockets
   * after the first one authenticated (stripes.ts).
   */
  streams?: number;
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
  /** Connect deadline (TCP, and the TLS handshake with a TLS transport), ms (default 2000). */
  connectTimeoutMs?: number;
}

export const DEFAULT_BOOTSTRAP_PORT = 8998;
/**
 * Size of decode's one reused socket read buffer per KV connection, bytes. Each read is one
 * JS callback, frame decode, CRC-32 call, ggsq walk step and file write (writeSync) for the
 * receiver, so the read size sets how often those fixed costs are paid: while a state streams
 * in, the receiver is behind the sender and reads come back full. 256 KiB (the sender's piece
 * size, and small enough to stay in a core's L2 cache for the CRC and file write that follow the
 * read) makes the receiver handle less than half the pieces a 64 KiB buffer does for a 1-64 MiB
 * state, and so pays those fixed costs less often.
 * Memory: one buffer per decode→prefill connection.
 */
export const KV_READ_BUFFER_BYTES = 256 * 1024;
/** How long the pool refuses, without reconnecting, a prefill that refused its settings, ms. */
export const MISMATCH_RETRY_MS = 10_000;
const EPOCH_RE = /^[0-9a-f]{8,64}$/;

function settings(o: KvChannelOptions): Settings {
  if (o.secret === undefined || o.secret.length === 0) throw new TypeError('KV channel: secret must be a non-empty string or Buffer');
  if (!o.settings || typeof o.settings.fingerprint !== 'string') throw new TypeError('KV channel: settings (the pair settings exchanged in the handshake) are required');
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
    pair: o.settings,
    clock: o.clock ?? systemClock,
    timers: o.timers ?? systemTimers,
    heartbeatMs: posInt('heartbeatMs', o.heartbeatMs, DEFAULT_HEARTBEAT_MS, 10),
    authTimeoutMs: posInt('authTimeoutMs', o.authTimeoutMs, 2000),
    maxQueuedBytes,
    sendWindowBytes: Math.min(posInt('sendWindowBytes', o.sendWindowBytes, Math.min(4 * 1024 * 1024, Math.floor(maxQueuedBytes / 4))), maxQueuedBytes),
    closeTimeoutMs: posInt('closeTimeoutMs', o.closeTimeoutMs, 2000),
    streams: Math.min(posInt('streams', o.streams, 1), MAX_KV_STREAMS),
    log: o.log ?? NOOP_LOG,
  };
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
  /** Open connections striped over more than one socket, by their hello nonce (what a stripe names). */
  private readonly striped = new Map<string, PeerConn>();
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
    this.server = (opts.transport ?? tcpTransport).createServer(
      (sock) => this.accept(sock),
      (why, address, hangUp) => {
        this.stats.authFailures++;
        this.s.log[hangUp ? 'debug' : 'warn']({ address, err: why }, 'kv connection refused in the TLS handshake');
      },
    );
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
        if (c.stripeRequest) {
          // one more socket of a striped connection: joins it, is not a connection of its own
          const of = this.striped.get(c.stripeRequest.of);
          if (!of) c.destroy('stripe of an unknown connection');
          else of.addStripe(c);
          return;
        }
        if (c.streams > 1) this.striped.set(c.stripeKey, c);
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
        if (this.striped.get(c.stripeKey) === c) this.striped.delete(c.stripeKey);
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
  private readonly transport: KvTransport;
  private readonly live = new Map<string, PeerConn>();
  private readonly pending = new Map<string, Promise<PeerConn>>();
  private readonly all = new Set<PeerConn>();
  private readonly dialing = new Set<net.Socket>();
  /** Prefill addresses that refused this pool's settings, until when (ms), and why. */
  private readonly mismatched = new Map<string, { until: number; reason: string }>();
  private closing: Promise<void> | undefined;

  /** Throws TypeError on invalid options. */
  constructor(opts: KvPeerPoolOptions) {
    this.s = settings(opts);
    this.connectTimeoutMs = opts.connectTimeoutMs ?? 2000;
    this.transport = opts.transport ?? tcpTransport;
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
    const refused = this.mismatched.get(key);
    if (refused && this.s.clock.nowMs() < refused.until) return Promise.reject(new KvError('SETTINGS_MISMATCH', refused.reason));
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

  /** The owner of a connection of its own to `key`: it becomes the pool's live one at authentication. */
  private connOwner(key: string): Owner {
    return {
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
  }

  /** The owner of a stripe of `primary`: it joins at authentication (synchronously: chunks may follow auth_ok in the same read). */
  private stripeOwner(primary: PeerConn): Owner {
    return { s: this.s, stats: this.stats, handlers: {}, authenticated: (c) => void primary.addStripe(c), closed: (c) => void this.all.delete(c) };
  }

  /**
   * The other sockets of a striped connection (`primary` agreed on more than one): dialed now,
   * each joins `primary` at its authentication; one that fails leaves the connection with fewer
   * sockets (logged), never fails it.
   */
  private dialStripes(host: string, port: number, key: string, primary: PeerConn): void {
    for (let index = 1; index < primary.streams; index++) {
      this.connect(host, port, key, { primary, index }).catch((e: Error) => this.s.log.warn({ peer: key, index, err: e.message }, 'kv stripe not opened: fewer sockets for this connection'));
    }
  }

  private connect(host: string, port: number, key: string, join?: { primary: PeerConn; index: number }): Promise<PeerConn> {
    return new Promise<PeerConn>((resolve, reject) => {
      // Reads go into one reused buffer (no fresh allocation, hence no first-touch page faults, per
      // read; the chunk data lands in cache for the receiver's CRC, walk and file write);
      // PeerConn consumes each read before the next one (frame.ts copies partial frames).
      let conn: PeerConn | undefined;
      const early: Buffer[] = [];
      const { socket: sock, readyEvent } = this.transport.dial({
        host,
        port,
        onread: {
          buffer: Buffer.allocUnsafeSlow(KV_READ_BUFFER_BYTES),
          callback: (n: number, buf: Uint8Array): boolean => {
            const b = Buffer.from(buf.buffer, buf.byteOffset, n);
            if (conn) conn.received(b);
            else early.push(Buffer.from(b));
            return true;
          },
        },
      });
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
      const cancelTimer = this.s.timers.after(this.connectTimeoutMs, () => fail(new KvError('TIMEOUT', `connect to prefill ${key} timed out after ${this.connectTimeoutMs} ms`)));
      const cleanup = (): void => {
        cancelTimer();
        this.dialing.delete(sock);
        sock.off('error', onError);
        sock.off('close', onClose);
      };
      sock.once('error', onError);
      sock.once('close', onClose);
      sock.once(readyEvent, () => {
        if (done) return;
        done = true;
        cleanup();
        const owner: Owner = join ? this.stripeOwner(join.primary) : this.connOwner(key);
        const c = new PeerConn(sock, 'decode', owner, key, join ? { of: join.primary.stripeKey, index: join.index } : undefined);
        conn = c;
        this.all.add(c);
        if (this.closing) c.destroy('kv peer pool closing');
        for (const b of early.splice(0)) c.received(b);
        c.ready.then(
          () => {
            if (!join && c.streams > 1) this.dialStripes(host, port, key, c);
            resolve(c);
          },
          (e: KvError) => {
            // A mismatched pair stays refused for a while: no reconnect (and log line) per room.
            if (e.code === 'SETTINGS_MISMATCH') this.mismatched.set(key, { until: this.s.clock.nowMs() + MISMATCH_RETRY_MS, reason: e.message });
            else this.mismatched.delete(key);
            reject(e);
          },
        );
      });
    });
  }
}
