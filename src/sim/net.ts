/**
 * The simulated KV channel: every connection between a decode node and prefill is a pair of the
 * SHIPPED connection cores (../kv/conn-core.ts: frames, handshake, the `Heartbeat`, pings) joined
 * by fake sockets, and every state goes out through the shipped send rotation and `sendFrom`
 * (../kv/send-rotation.ts) — as TigerBeetle runs its real replica under its simulator. The
 * simulator keeps no liveness, epoch or hello rule of its own: a crashed node goes silent and its
 * peer's heartbeat finds it; a restarted node is reached over a new connection with a new
 * handshake that binds its new epoch; frames of another epoch are refused by the core.
 *
 * A fake socket carries whole frames (the encoded bytes) with a random delay; once both ends are
 * authenticated the network may drop, duplicate or reorder a frame (the handshake's frames are
 * spared, as a TCP handshake retries until it works). A socket's end that closes tells the other
 * end one network delay later (FIN); a crashed node's sockets say nothing. Chunk frames leave a
 * socket at SIM_SOCKET_BYTES_PER_MS (the send window's flushes); a striped connection
 * (`--kv-streams 2`) is two sockets, the second joined by the shipped stripe handshake, decode
 * reassembling both through the shipped `StripeReorder` (../kv/stripes.ts).
 *
 * The fairness check of the send rotation lives here too: while a transfer waits with a piece
 * ready, the other transfers on its connection may write at most one turn each.
 */
import type { Clock, Timers } from '../base/clock.js';
import type { Prng } from '../base/prng.js';
import { ConnCore, CoreTimers, NOOP_LOG, type CoreEnd, type CoreOpen, type KvConn, type KvStats, type Side } from '../kv/conn-core.js';
import { sendFrom, SendRotation, type ChunkSource, type Outgoing, type SendChunksOptions, type TransferHost } from '../kv/send-rotation.js';
import { StripeReorder } from '../kv/stripes.js';
import { FRAME_CHUNK, type ControlMsg, type PairSettings, type PeerMsg } from '../kv/messages.js';
import { FRAME_HEADER_BYTES } from '../kv/frame.js';
import { KvError, type RoomId } from '../kv/types.js';
import { StreamOrder, type Checks, type NodeName } from './checks.js';
import type { FaultProfile, SimStats, TraceEntry } from './model.js';

/** Heartbeat interval of the simulated connections, virtual ms (a peer silent for 2 is lost). */
export const SIM_HEARTBEAT_MS = 40;
/** Credit per turn of the simulated send rotations (two pieces: a state of up to 2 KiB takes several turns). */
export const SIM_SEND_QUANTUM_BYTES = 512;
/** Piece size of the simulated state sender (`sendFrom`'s pieces). */
export const SIM_PIECE_BYTES = 256;
/** Bytes a simulated connection queues before its transfers wait for flushes (and per turn). */
export const SIM_SEND_WINDOW_BYTES = 1024;
/** How fast a simulated socket flushes chunk bytes, bytes per virtual ms. */
export const SIM_SOCKET_BYTES_PER_MS = 512;
/** Handshake deadline of the simulated connections, virtual ms. */
export const SIM_AUTH_TIMEOUT_MS = 200;
const SECRET = 'pdserve-sim-secret';
const PAIR: PairSettings = { fingerprint: '51a5', contextSize: 4096, batchSize: 512, flashAttention: false };

/** A node incarnation as the network sees it (the world's node: its executor's entry points). */
export interface NetNode {
  readonly name: NodeName;
  readonly role: 'prefill' | 'decode';
  /** This incarnation's session epoch (hex). */
  readonly epoch: string;
  readonly inc: number;
  readonly up: boolean;
  /** Virtual timers of this incarnation (dead with it). */
  readonly timers: Timers;
  message(conn: SimConn, msg: PeerMsg): void;
  chunk(conn: SimConn, room: RoomId, offset: number, data: Buffer): void;
  peerLost(conn: SimConn, reason: string): void;
  /** A connection authenticated (decode: probe for the same host). */
  connected(conn: SimConn): void;
}

/** What the network needs of its world. */
export interface NetWorld {
  readonly rng: Prng;
  readonly profile: FaultProfile;
  readonly stats: SimStats;
  readonly checks: Checks;
  readonly clock: Clock;
  /** The run records its trace (fault notes cost a frame parse). */
  readonly tracing: boolean;
  /** Sockets per connection (1 or 2). */
  readonly streams: number;
  /** Latest time the heartbeat timers run (the world's end). */
  readonly endAt: number;
  now(): number;
  /** Run `fn` at virtual time `t` (marks the world dirty). */
  at(t: number, fn: () => void): void;
  /** Run `fn` on node `name` at `t`, held while the node is frozen (`wire`: a frame, retransmitted after the freeze). */
  atNode(name: NodeName, t: number, fn: () => void, wire: boolean): void;
  /** When node `name`'s last freeze ended (undefined: never frozen). */
  thawedAt(name: NodeName): number | undefined;
  node(name: NodeName): NetNode;
  tr(who: TraceEntry['who'], room: RoomId | undefined, text: string): void;
}

/** One side's end of one fake socket, running the shipped core. */
class End {
  readonly core: ConnCore;
  readonly ticks: CoreTimers;
  /** The connection this socket belongs to on this side (set when the core opens). */
  conn: SimConn | undefined;
  other!: End;
  closed = false;
  /** Delivery time of the last FIFO frame from this end (the socket's tail). */
  private tail = 0;
  /** Chunk bytes written and not flushed yet, and when the last of them flushes. */
  queued = 0;
  private flushAt = 0;

  constructor(
    readonly net: SimNet,
    readonly node: NetNode,
    readonly side: Side,
    readonly peer: NodeName,
    readonly index: number,
    stripe: { of: string; index: number } | undefined,
    private readonly onOpen: (e: End, step: CoreOpen) => void,
  ) {
    const w = net.w;
    this.core = new ConnCore(
      { side, secret: SECRET, epoch: node.epoch, pair: PAIR, streams: w.streams, ...(stripe ? { stripe } : {}), heartbeatMs: SIM_HEARTBEAT_MS, clock: w.clock, stats: net.kvStats, log: NOOP_LOG, address: peer, name: () => `${node.name}>${peer}` },
      {
        write: (frame) => this.write(Array.isArray(frame) ? Buffer.concat(frame) : frame),
        opened: (step) => {
          this.ticks.opened();
          this.onOpen(this, step);
        },
        message: (msg) => this.conn?.message(this, msg),
        chunk: (room, offset, data) => this.conn?.chunk(this, room, offset, data),
        stalled: (lateMs) => w.tr('sim', undefined, `${node.name}: own stall of ${lateMs} ms seen by its heartbeat (${peer} not blamed)`),
        ended: (e) => this.ended(e),
      },
    );
    this.ticks = new CoreTimers(this.core, net.heartbeatTimers(node), SIM_HEARTBEAT_MS, SIM_AUTH_TIMEOUT_MS);
  }

  /** The node incarnation this end belongs to is still the live one. */
  get live(): boolean {
    return this.node.up && this.net.w.node(this.node.name).inc === this.node.inc;
  }

  /** Frame bytes onto the socket toward the other end. */
  write(bytes: Buffer): boolean {
    if (this.closed || !this.live) return false;
    const w = this.net.w;
    const p = w.profile;
    w.stats.frames++;
    // The handshake's frames are spared the faults (a TCP handshake retries until it works).
    const faulty = this.core.state === 'open';
    if (faulty && w.rng.chance(p.drop)) {
      w.stats.dropped++;
      this.note(bytes, 'DROPPED');
      return true;
    }
    const copies = faulty && w.rng.chance(p.dup) ? 2 : 1;
    if (copies === 2) w.stats.duplicated++;
    for (let i = 0; i < copies; i++) {
      let t = w.now() + 0.5 + w.rng.float() * p.jitterMs;
      if (!faulty || !w.rng.chance(p.reorder)) {
        t = Math.max(t, this.tail);
        this.tail = t;
      } else this.note(bytes, 'may overtake earlier frames');
      const to = this.other;
      w.atNode(to.node.name, t, () => {
        if (!to.closed && to.live) to.core.receive(bytes);
      }, true);
    }
    return true;
  }

  /** A chunk frame: written now, flushed (its `done`) when the socket has sent the bytes before it. */
  writeChunk(frame: Buffer[], done: (err?: Error | null) => void): boolean | 'gone' {
    if (this.closed || !this.live) return 'gone';
    const bytes = Buffer.concat(frame);
    const w = this.net.w;
    this.queued += bytes.length;
    this.flushAt = Math.max(w.now(), this.flushAt) + bytes.length / SIM_SOCKET_BYTES_PER_MS;
    const inc = this.node.inc;
    w.atNode(this.node.name, this.flushAt, () => {
      if (this.node.inc !== inc || !this.live) return; // memory gone with the process
      this.queued -= bytes.length;
      done(this.closed ? new KvError('PEER_LOST', 'socket closed') : null);
    }, false);
    return this.write(bytes);
  }

  /** The core gave up (silent peer, refusal, bad frame): this socket closes. */
  private ended(e: CoreEnd): void {
    const w = this.net.w;
    w.tr('sim', undefined, `${this.node.name}: connection to ${this.peer} ended: ${e.reason}`);
    // Liveness never blames the peer for this node's own stall: a check that ran as its freeze ended is one.
    if (e.silentMs !== undefined && w.thawedAt(this.node.name) === w.now()) {
      w.checks.violate({ kind: 'blamed_peer', node: this.node.name, detail: `${this.node.name} declared ${this.peer} lost (${e.reason}) in the liveness check that ran late as its own freeze ended` });
    }
    this.close(e.reason, true);
  }

  /** Closes this end (and its connection on this side); `fin`: the other end learns it one network delay later. */
  close(reason: string, fin: boolean): void {
    if (this.closed) return;
    this.closed = true;
    this.core.end();
    this.ticks.stop();
    if (this.live) this.conn?.end(reason);
    this.net.endClosed(this, reason);
    if (fin) {
      const w = this.net.w;
      const to = this.other;
      w.atNode(to.node.name, w.now() + 0.5 + w.rng.float() * w.profile.jitterMs, () => {
        if (to.live) to.close('connection closed by peer', false);
      }, true);
    }
  }

  /** Traces a fault on a frame of a room (traced runs only): its type and room, read back from the bytes. */
  private note(bytes: Buffer, what: string): void {
    const w = this.net.w;
    if (!w.tracing) return;
    if (bytes[4] === FRAME_CHUNK) {
      w.tr('net', bytes.readBigUInt64BE(5).toString() as RoomId, `${this.node.name}→${this.peer} chunk ${what}`);
      return;
    }
    const msg = JSON.parse(bytes.subarray(FRAME_HEADER_BYTES).toString('utf8')) as { type: string; room?: RoomId };
    if (msg.room) w.tr('net', msg.room, `${this.node.name}→${this.peer} ${msg.type} ${what}`);
  }
}

/**
 * One authenticated connection as one side sees it (what the executors hold): its sockets (the
 * first carries the control frames), and on prefill the send rotation of its transfers.
 */
export class SimConn implements KvConn {
  readonly ends: End[];
  private over = false;
  /** Decode end of a striped connection: the shipped reassembly, and the check of what it hands on. */
  private readonly reorder: StripeReorder | undefined;
  private readonly order: StreamOrder | undefined;
  /** Prefill: the running transfers' rotation, what it asks of this connection, and the fairness check. */
  private readonly rotation: SendRotation;
  private readonly host: TransferHost;
  private rr = 0;
  private turnYield = false;
  /** Transfers in the rotation: chunk bytes others wrote since it last wrote, and the most transfers there were meanwhile. */
  private readonly waiting = new Map<RoomId, { out: Outgoing; bytes: number; most: number }>();

  constructor(
    private readonly net: SimNet,
    readonly id: string,
    primary: End,
  ) {
    this.ends = [primary];
    const node = primary.node;
    const w = net.w;
    if (node.role === 'decode' && w.streams > 1) {
      const order = (this.order = new StreamOrder(w.checks, node.name));
      this.reorder = new StripeReorder(
        {
          chunk: (room, offset, data) => {
            order.chunk(room, offset, data.length);
            node.chunk(this, room, offset, data);
          },
          end: (room, msg) => {
            order.end(room, (msg as { totalBytes?: number }).totalBytes);
            node.message(this, msg as PeerMsg);
          },
          paused: () => false,
          // a sim socket has no reads to stop, and its states stay below the per-socket hold mark: never called
          holdSocket: () => {},
          releaseSocket: () => {},
        },
        1 << 20,
      );
    }
    this.rotation = new SendRotation((turnBytes) => this.windowOpen(turnBytes), SIM_SEND_QUANTUM_BYTES);
    const self = this;
    this.host = {
      rotation: this.rotation,
      timers: node.timers,
      log: NOOP_LOG,
      name: id,
      get open() {
        return self.alive;
      },
      writeChunk: (frame, done) => this.writeChunk(frame, done),
      lostError: (room) => new KvError('PEER_LOST', `connection ${id} is gone; transfer of room ${room} failed`),
      onEnd: (fn) => {
        this.onEnd.add(fn);
        return () => this.onEnd.delete(fn);
      },
    };
  }

  private readonly onEnd = new Set<() => void>();

  get alive(): boolean {
    return !this.over && this.ends[0]!.live;
  }

  get peerEpoch(): string {
    return this.ends[0]!.core.peerEpoch;
  }

  sendControl(msg: ControlMsg): boolean {
    if (!this.alive) return false;
    if (this.reorder && (msg.type === 'kv_ack' || msg.type === 'fail')) {
      this.reorder.forget(msg.room); // as PeerConn.sendControl
      this.order?.forget(msg.room);
    }
    return this.ends[0]!.core.sendControl(msg);
  }

  /** The shipped `sendFrom` over this connection's sockets and rotation. */
  sendFrom(room: RoomId, source: ChunkSource, opts: SendChunksOptions): Promise<void> {
    const before = this.rotation.sending.length;
    const p = sendFrom(this.host, room, source, opts);
    const out = this.rotation.sending.length > before ? this.rotation.sending.at(-1) : undefined;
    if (out) this.waiting.set(room, { out, bytes: 0, most: this.rotation.sending.length });
    return p;
  }

  /**
   * A chunk frame to the next socket (round robin over a striped connection's), the fairness
   * check on the way: between two pieces of a transfer in the rotation, each other transfer
   * writes at most one turn — its credit, spent in whole pieces, so up to one piece over.
   */
  private writeChunk(frame: Buffer[], done: (err?: Error | null) => void): boolean | 'gone' {
    const to = this.ends[this.rr % this.ends.length]!;
    const room = frame[0]!.readBigUInt64BE(5).toString() as RoomId;
    const bytes = frame[1]!.length;
    const n = this.rotation.sending.length;
    for (const [r, wt] of this.waiting) {
      if (!this.rotation.sending.includes(wt.out)) {
        this.waiting.delete(r); // it wrote its last piece, or settled
        continue;
      }
      if (r === room) {
        wt.bytes = 0;
        wt.most = n;
        continue;
      }
      wt.bytes += bytes;
      wt.most = Math.max(wt.most, n);
      const bound = (wt.most - 1) * (SIM_SEND_QUANTUM_BYTES + SIM_PIECE_BYTES - 1);
      if (wt.bytes > bound) {
        this.net.w.checks.violate({ kind: 'unfair_send', node: this.ends[0]!.node.name, room: r, detail: `the send rotation let other rooms write ${wt.bytes} bytes while room ${r} waited in it (bound ${bound} with ${wt.most} transfers)` });
        this.waiting.delete(r); // once per transfer
      }
    }
    const w = to.writeChunk(frame, done);
    if (w !== 'gone') {
      this.rr++;
      if (to.index > 0) this.net.w.stats.stripeChunks++;
    }
    return w;
  }

  private windowOpen(turnBytes: number): boolean {
    if (!this.alive) {
      for (const o of [...this.rotation.sending]) o.lost();
      return false;
    }
    const window = SIM_SEND_WINDOW_BYTES;
    // a full socket: its next flush serves again (PeerConn's 'drain')
    if (this.ends[this.rr % this.ends.length]!.queued >= Math.ceil(window / this.ends.length)) return false;
    if (turnBytes >= window) {
      if (!this.turnYield) {
        this.turnYield = true;
        void this.ends[0]!.node.timers.turn().then(() => {
          this.turnYield = false;
          this.rotation.newTurn();
          for (const o of this.rotation.sending) o.alive();
          this.rotation.serve();
        });
      }
      return false;
    }
    return true;
  }

  /** A stripe socket joins (its handshake named this connection). */
  join(e: End): void {
    e.conn = this;
    this.ends.push(e);
  }

  /** A message from the core of socket `from` (accepted: its epoch is the connection's). */
  message(from: End, msg: PeerMsg): void {
    if (from !== this.ends[0]) {
      from.core.refuse(`control message '${msg.type}' on a stripe`);
      return;
    }
    const node = from.node;
    const r = this.reorder;
    if (r && this.order) {
      try {
        if (msg.type === 'kv_begin') {
          r.begin(msg.room, msg.totalBytes);
          this.order.begin(msg.room, msg.totalBytes);
          node.message(this, msg);
          r.drain();
          return;
        }
        if (msg.type === 'kv_end' && !r.end(msg.room, msg, msg.totalBytes)) {
          this.net.w.tr(node.name, msg.room, 'kv_end held until its bytes are in');
          return;
        }
        if (msg.type === 'kv_end') this.order.end(msg.room, msg.totalBytes);
        if (msg.type === 'fail') {
          r.forget(msg.room);
          this.order.forget(msg.room);
        }
      } catch (err) {
        this.refused(from, 'room' in msg ? msg.room : undefined, err);
        return;
      }
    }
    node.message(this, msg);
  }

  /** Chunk data from the core of socket `from`: through the reassembly of a striped connection. */
  chunk(from: End, room: RoomId, offset: number, data: Buffer): void {
    const node = this.ends[0]!.node;
    if (!this.reorder) {
      node.chunk(this, room, offset, data);
      return;
    }
    try {
      const held = this.reorder.heldBytes;
      this.reorder.chunk(room, offset, data, from.index);
      if (this.reorder.heldBytes > held) {
        this.net.w.stats.stripeHeld++;
        this.net.w.tr(node.name, room, `striped chunk at ${offset} held for the bytes before it`);
      }
    } catch (err) {
      this.refused(from, room, err);
    }
  }

  /** The reassembly refused a frame (an overlap, the held-bytes cap): the whole striped connection closes. */
  private refused(from: End, room: RoomId | undefined, err: unknown): void {
    this.net.w.tr('sim', room, `${from.node.name}: striped connection refused a frame (${(err as Error).message}): closing it`);
    from.core.refuse(`striped connection closed: ${(err as Error).message}`);
  }

  /** This side of the connection is over (any of its sockets closed): the others close, rooms bound to it fail. */
  end(reason: string): void {
    if (this.over) return;
    this.over = true;
    this.reorder?.clear();
    for (const e of this.ends) e.close(reason, true);
    for (const fn of [...this.onEnd]) fn();
    this.onEnd.clear();
    const node = this.ends[0]!.node;
    if (node.up && this.ends[0]!.live) node.peerLost(this, reason);
  }
}


/** The simulated KV network of one world: dials, sockets, and the shipped cores at both ends. */
export class SimNet {
  /** The channel counters of every core in the world (stale epochs refused, own stalls …). */
  readonly kvStats: KvStats = { framesIn: 0, framesOut: 0, bytesIn: 0, bytesOut: 0, authFailures: 0, badFrames: 0, staleEpoch: 0, peersLost: 0, settingsMismatch: 0, ownStalls: 0 };
  /** Open connections by node, then peer (the side's view). */
  private readonly conns = new Map<NodeName, Map<NodeName, SimConn>>();
  /** Prefill's primary ends by hello nonce (what a stripe names to join). */
  private readonly primaries = new Map<string, End>();
  private readonly dials = new Map<NodeName, Promise<SimConn>>();
  private seq = 0;

  constructor(readonly w: NetWorld) {}

  /** Node `n`'s live connection to `peer`, if any. */
  conn(n: NodeName, peer: NodeName): SimConn | undefined {
    const c = this.conns.get(n)?.get(peer);
    return c?.alive ? c : undefined;
  }

  /** A node (re)started: it holds no connection (its old ones died with its memory, silently). */
  nodeUp(n: NodeName): void {
    this.conns.delete(n);
    this.dials.delete(n);
  }

  /**
   * Decode `d` asks for its connection to prefill, as the pool's `get`: the live one, or a new
   * one (concurrent asks share it) once its handshake is through. Rejects with KvError
   * PEER_LOST (prefill down: refused at once; the handshake's connection closed) or TIMEOUT.
   */
  dial(d: NetNode): Promise<SimConn> {
    const live = this.conn(d.name, 'P');
    if (live) return Promise.resolve(live);
    let p = this.dials.get(d.name);
    if (!p) {
      p = this.connect(d).finally(() => {
        if (this.dials.get(d.name) === p) this.dials.delete(d.name);
      });
      this.dials.set(d.name, p);
    }
    return p;
  }

  private connect(d: NetNode): Promise<SimConn> {
    const w = this.w;
    return new Promise<SimConn>((resolve, reject) => {
      const pn = w.node('P');
      const delay = 0.5 + w.rng.float() * w.profile.jitterMs;
      if (!pn.up) {
        d.timers.after(delay, () => reject(new KvError('PEER_LOST', 'connect to prefill P failed: ECONNREFUSED')));
        return;
      }
      const pair = this.socket(pn, d, 0, undefined, (e) => {
        if (!e.conn) reject(new KvError('PEER_LOST', 'connect to prefill P: the connection closed in the handshake'));
      });
      pair.dEnd.onOpened = (c) => {
        resolve(c);
        if (w.streams > 1) this.stripe(pn, d, c, pair.pEnd.core.helloNonce);
      };
    });
  }

  /** Decode `d` dials the second socket of connection `c` (its stripe): it joins at its authentication. */
  private stripe(pn: NetNode, d: NetNode, c: SimConn, of: string): void {
    const w = this.w;
    w.at(w.now() + 0.5, () => {
      if (!c.alive || !pn.up || !d.up) return;
      this.socket(pn, d, 1, { of, index: 1 }, () => {});
    });
  }

  /** A new fake socket between prefill `pn` and decode `d`, both cores started. */
  private socket(pn: NetNode, d: NetNode, index: number, stripe: { of: string; index: number } | undefined, closedEarly: (e: End) => void): { pEnd: End & { onOpened?: (c: SimConn) => void }; dEnd: End & { onOpened?: (c: SimConn) => void } } {
    const opened = (e: End & { onOpened?: (c: SimConn) => void }, step: CoreOpen): void => {
      const peer = e.peer;
      if (step.stripe || (e.side === 'decode' && index > 0)) {
        // one more socket of a striped connection: joins it (prefill: the one its hello nonce names)
        const primary = e.side === 'prefill' ? this.primaries.get(step.stripe!.of) : this.conns.get(e.node.name)?.get(peer)?.ends[0];
        if (!primary?.conn?.alive || primary.conn.ends.length >= this.w.streams) {
          e.close('stripe refused: its connection is gone or complete', true);
          return;
        }
        primary.conn.join(e);
        return;
      }
      const c = new SimConn(this, `${e.node.name}>${peer}#${++this.seq}@${step.peerEpoch.slice(-4)}`, e);
      e.conn = c;
      if (e.side === 'prefill' && step.streams > 1) this.primaries.set(e.core.helloNonce, e);
      let m = this.conns.get(e.node.name);
      if (!m) this.conns.set(e.node.name, (m = new Map()));
      m.set(peer, c);
      this.w.tr('sim', undefined, `${e.node.name}: connection ${c.id} to ${peer} authenticated (peer epoch ${step.peerEpoch})`);
      e.onOpened?.(c);
      e.node.connected(c);
    };
    const pEnd = new End(this, pn, 'prefill', d.name, index, undefined, opened);
    const dEnd = new End(this, d, 'decode', 'P', index, stripe, opened);
    pEnd.other = dEnd;
    dEnd.other = pEnd;
    this.closedEarly.set(dEnd, closedEarly);
    pEnd.core.start();
    return { pEnd, dEnd };
  }

  private readonly closedEarly = new Map<End, (e: End) => void>();

  /** Bookkeeping when an end closes. */
  endClosed(e: End, _reason: string): void {
    this.closedEarly.get(e)?.(e);
    this.closedEarly.delete(e);
    if (e.side === 'prefill' && this.primaries.get(e.core.helloNonce) === e) this.primaries.delete(e.core.helloNonce);
    const m = this.conns.get(e.node.name);
    if (e.conn && m?.get(e.peer) === e.conn && e.conn.ends[0] === e) m.delete(e.peer);
  }

  /** One stripe socket of decode `d`'s connection dies: as PeerConn.terminate, the whole striped connection ends on both sides. */
  loseStripe(d: NodeName): boolean {
    const c = this.conn(d, 'P');
    const s = c?.ends[1];
    if (!c || !s) return false;
    s.close('stripe lost: its striped connection ended', false);
    s.other.close('stripe lost: its striped connection ended', false);
    return true;
  }

  /** Virtual timers for a node's heartbeat: like its own, but nothing past the world's end (pings would run forever). */
  heartbeatTimers(n: NetNode): Timers {
    const t = n.timers;
    const w = this.w;
    return {
      after: (ms, fn) => (w.now() + ms > w.endAt ? () => {} : t.after(ms, fn)),
      every: (ms, fn) => {
        let cancel = (): void => {};
        let live = true;
        const loop = (): void => {
          if (!live || w.now() + ms > w.endAt) return;
          cancel = t.after(ms, () => {
            fn();
            loop();
          });
        };
        loop();
        return () => {
          live = false;
          cancel();
        };
      },
      turn: () => t.turn(),
    };
  }
}
