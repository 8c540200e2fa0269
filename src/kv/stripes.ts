/**
 * Striping one KV connection over several sockets (`--kv-streams N`): the receiving side's
 * reassembly, sans-IO. The sender (PeerConn.sendFrom) deals a transfer's chunk frames round robin
 * over the group's sockets in the order it produces them and sends every control frame on the
 * group's first connection; the receiver's sockets are read in whatever order the kernel and libuv
 * deliver, so one room's bytes can arrive out of order across sockets, and its kv_begin / kv_end
 * (on the first connection) before or after pieces carried by the others. `StripeReorder` puts
 * them back: per room, bytes at the next expected offset go through at once, bytes ahead of it
 * wait (copied) until the gap fills, chunks that come before their room's kv_begin wait for it,
 * and kv_end waits until the room's last byte went through — so the handler sees exactly what one
 * socket would have given it.
 *
 * Bounds: the bytes held out of order, over all rooms, are capped (`maxHeldBytes`); over it
 * `chunk` throws and the caller closes the whole group, as it does for a lost member — every room
 * on it fails by the rules of one lost connection. The sender writes its sockets in strict
 * rotation (it waits for a full one rather than skip it), so the skew between sockets is one send
 * window plus the kernel's buffers of each. A room's state is dropped at its kv_end, at a `fail`
 * either way, at `kv_ack` and when `forget` is called; chunks of a room dropped in the last
 * RECENT_ROOMS go straight to the handler (which refuses them as it refuses a late chunk today).
 * Held bytes are handed on only while `paused()` is false (the receiver's I/O-thread slots have
 * room), so a drain never floods the receiver.
 *
 * Idea: Mooncake's transfer engine splits one transfer into slices over several connections and
 * NICs and completes it when every slice has landed; here the slices are the sender's pieces and
 * completion is the in-order offset reaching the end.
 */
import type { RoomId } from './types.js';
import { KvError } from './types.js';

/** Where reassembled bytes and held control messages go (the channel's handlers). */
export interface ReorderSink {
  /** In order, as one socket would have delivered them: `data` is a view valid only during the call. */
  chunk(room: RoomId, offset: number, data: Buffer): void;
  /** A kv_end held until its room's bytes were all handed to `chunk`. */
  end(room: RoomId, msg: unknown): void;
  /** True while the receiver cannot take more (its socket reads are paused): held bytes wait. */
  paused(): boolean;
  /** Stop reading socket `from`: it holds SOCKET_HOLD_HIGH bytes ahead of their rooms' gaps. */
  holdSocket(from: number): void;
  /** Read socket `from` again (undoes one holdSocket). */
  releaseSocket(from: number): void;
}

/**
 * Bytes one socket may have waiting out of order before its reads stop, and the level at which
 * they go on again. Only a socket whose own pieces wait is stopped: a piece waits for a gap
 * the sender wrote earlier, so the gap is not behind it on that socket, and the earliest piece
 * not yet read is always on a socket that reads (deadlock-free); without it a receiver slower
 * than the wire let one socket's held bytes grow to the cap.
 */
export const SOCKET_HOLD_HIGH = 4 * 1024 * 1024;
export const SOCKET_HOLD_LOW = 1024 * 1024;

/** How many ended rooms are remembered, so their late chunks are not held. */
export const RECENT_ROOMS = 1024;

interface RoomOrder {
  /** kv_begin seen: held chunks may go once it did. */
  begun: boolean;
  /** Bytes kv_begin announced (a streamed kv_end brings the real count). */
  total: number;
  /** Offset of the next byte to hand on. */
  next: number;
  /** Bytes that arrived ahead of `next`, by offset (copies), and the socket each came from. */
  held: Map<number, { b: Buffer; from: number }>;
  /** The kv_end waiting for the bytes before it, and the byte count it closes at. */
  end: { msg: unknown; at: number } | undefined;
}

/** One striped connection's reassembly (see the module comment). */
export class StripeReorder {
  /** Bytes held out of order now, over all rooms. */
  heldBytes = 0;
  private readonly rooms = new Map<RoomId, RoomOrder>();
  private readonly recent = new Set<RoomId>();
  /** Held bytes per socket, and the sockets whose reads this reassembly stopped. */
  private readonly bySocket = new Map<number, number>();
  private readonly stopped = new Set<number>();

  /**
   * `maxHeldBytes`: the cap on bytes held out of order (over it `chunk` throws); `hold`: a
   * socket's high and low marks (default SOCKET_HOLD_HIGH / SOCKET_HOLD_LOW).
   */
  constructor(
    private readonly sink: ReorderSink,
    private readonly maxHeldBytes: number,
    private readonly hold = { high: SOCKET_HOLD_HIGH, low: SOCKET_HOLD_LOW },
  ) {}

  /** Rooms with reassembly state now (for tests and leak checks). */
  get size(): number {
    return this.rooms.size;
  }

  /**
   * kv_begin of `room` (`totalBytes` as announced): its stream starts at offset 0. Call it, hand
   * the message to the handler, then call `drain` (chunks that came first go on after it).
   */
  begin(room: RoomId, totalBytes: number): void {
    this.recent.delete(room);
    const r = this.rooms.get(room);
    if (r && r.next === 0) {
      r.begun = true;
      r.total = totalBytes;
      return;
    }
    if (r) this.drop(room, r);
    this.rooms.set(room, { begun: true, total: totalBytes, next: 0, held: new Map(), end: undefined });
  }

  /**
   * A piece of `room`'s bytes at `offset`, from socket `from` of the group (`data` is copied if
   * it has to wait). @throws KvError('BAD_FRAME') for bytes already handed on (a duplicate or an
   * overlap) or when the held bytes would pass the cap.
   */
  chunk(room: RoomId, offset: number, data: Buffer, from = 0): void {
    let r = this.rooms.get(room);
    if (!r) {
      if (this.recent.has(room)) return this.sink.chunk(room, offset, data);
      r = { begun: false, total: 0, next: 0, held: new Map(), end: undefined };
      this.rooms.set(room, r);
    }
    if (r.begun && offset === r.next && r.held.size === 0) {
      r.next += data.length;
      this.sink.chunk(room, offset, data);
      this.maybeEnd(room);
      return;
    }
    if (offset < r.next || r.held.has(offset)) throw new KvError('BAD_FRAME', `striped chunk of room ${room} at offset ${offset} overlaps bytes already received (next ${r.next})`);
    if (this.heldBytes + data.length > this.maxHeldBytes) throw new KvError('BAD_FRAME', `striped connection holds ${this.heldBytes + data.length} bytes out of order (max ${this.maxHeldBytes})`);
    r.held.set(offset, { b: Buffer.from(data), from });
    this.heldBytes += data.length;
    const mine = (this.bySocket.get(from) ?? 0) + data.length;
    this.bySocket.set(from, mine);
    if (mine > this.hold.high && !this.stopped.has(from)) {
      this.stopped.add(from);
      this.sink.holdSocket(from);
    }
    if (r.begun && offset === r.next) this.drainRoom(room, r);
  }

  /**
   * kv_end of `room`: true when the handler may have it now (every byte before it went on, or
   * the room is unknown), false when it is held and `sink.end` gets it later. `totalBytes`: a
   * streamed kv_end's byte count (else the one kv_begin announced).
   */
  end(room: RoomId, msg: unknown, totalBytes?: number): boolean {
    const r = this.rooms.get(room);
    if (!r || !r.begun) return true;
    const at = totalBytes ?? r.total;
    if (r.next >= at && r.held.size === 0) {
      this.drop(room, r);
      return true;
    }
    r.end = { msg, at };
    return false;
  }

  /** The room ended (fail, kv_ack, a local failure): drop what is held for it. */
  forget(room: RoomId): void {
    const r = this.rooms.get(room);
    if (r) this.drop(room, r);
    else this.remember(room);
  }

  /** Hand on held bytes that are next in their room (after a resume of reads or a kv_begin). */
  drain(): void {
    for (const [room, r] of [...this.rooms]) {
      if (this.sink.paused()) return;
      if (r.begun) this.drainRoom(room, r);
    }
  }

  /** Everything dropped (the group closed). */
  clear(): void {
    for (const [room, r] of [...this.rooms]) this.drop(room, r);
  }

  /** A held piece leaves (handed on or dropped): its socket reads again once it holds little. */
  private unhold(h: { b: Buffer; from: number }): void {
    this.heldBytes -= h.b.length;
    const left = (this.bySocket.get(h.from) ?? 0) - h.b.length;
    this.bySocket.set(h.from, left);
    if (left <= this.hold.low && this.stopped.delete(h.from)) this.sink.releaseSocket(h.from);
  }

  private drainRoom(room: RoomId, r: RoomOrder): void {
    for (let h = r.held.get(r.next); h !== undefined && !this.sink.paused(); h = r.held.get(r.next)) {
      r.held.delete(r.next);
      const off = r.next;
      r.next += h.b.length;
      this.sink.chunk(room, off, h.b);
      this.unhold(h);
      if (this.rooms.get(room) !== r) return; // the handler ended the room
    }
    this.maybeEnd(room);
  }

  private maybeEnd(room: RoomId): void {
    const r = this.rooms.get(room);
    if (!r?.end || r.next < r.end.at) return;
    const { msg } = r.end;
    this.drop(room, r);
    this.sink.end(room, msg);
  }

  private drop(room: RoomId, r: RoomOrder): void {
    const held = [...r.held.values()];
    r.held.clear();
    for (const h of held) this.unhold(h);
    this.rooms.delete(room);
    this.remember(room);
  }

  private remember(room: RoomId): void {
    this.recent.add(room);
    if (this.recent.size > RECENT_ROOMS) this.recent.delete(this.recent.values().next().value as RoomId);
  }
}
