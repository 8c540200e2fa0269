/**
 * Decode's side of the pipelined KV handoff: validates the envelope and the ggsq structure while
 * the bytes stream in, computes the CRC-32 as they pass, and writes the payload into the
 * destination state file as it arrives — so when the last chunk lands the file is already on
 * disk and checked, and only llama.cpp's load remains. A head from another model, a ggsq field
 * that does not add up, or bytes beyond the announced size fail the room at that chunk, before
 * the rest is even sent. Payload bytes go to the file as they arrive (a socket read's worth
 * straight from the read buffer, small pieces gathered in a pooled buffer first) — into a
 * recycled destination file from a FilePool (pool.ts: a tmpfs file whose pages exist takes
 * writes ~3× faster than a new one), sized to the payload exactly, as llama.cpp's load wants.
 *
 * File calls are synchronous: the state directory is tmpfs (/dev/shm), where writing 1 MiB is a
 * memory copy well under a millisecond, while every asynchronous fs call is a round trip through
 * libuv's thread pool (a wake-up of a pool thread and of the event loop), on the handoff's
 * critical path. (A state directory on a real disk would block the event loop for its writes.)
 *
 * Byte stream (envelope.ts): head | payload | u32 BE CRC-32 trailer.
 */
import { closeSync, ftruncateSync, openSync, writeSync } from 'node:fs';
import { ENVELOPE_TRAILER_BYTES, parseEnvelopeHead, type EnvelopeExpect } from '../envelope.js';
import type { EnvelopeHeader } from '../messages.js';
import { KvError } from '../types.js';
import { Crc32 } from './checksum.js';
import { IO_SLOTS_PER_TRANSFER, type IoStream, type KvIo } from './io-thread.js';
import { unlinkInBackground, type BufferPool, type FilePool } from './pool.js';

/** An incremental parser of the payload's structure (see StateReceiverOptions.walker). */
export interface StructureWalker<S> {
  push(data: Buffer): void;
  end(): S;
}

/** Options of a StateReceiver. */
export interface StateReceiverOptions<S> {
  /**
   * Bytes kv_begin announced (head + payload + trailer); with `streamed`, the most bytes
   * accepted (the receiver's own limit: the real count comes with kv_end; more fail the receive
   * with KvError('STATE_TOO_LARGE'), and the structure walk is not bounded by it).
   */
  totalBytes: number;
  /**
   * A streamed kv_begin (the state sent while prefill still saves it): the head says
   * `payloadBytes: 0`, no trailer follows the payload, the ggsq structure's end is the payload's
   * end, and `finish` gets the byte count and the CRC-32 from kv_end. `hintBytes`: the sender's
   * estimate of head + payload, used only to pick and size the destination file.
   */
  streamed?: { hintBytes: number };
  /** What the envelope head must say (fingerprint, context settings, payload limit). */
  expect: EnvelopeExpect;
  /**
   * The incremental structure walk for a payload of `payloadBytes` (decode passes the ggsq one,
   * `GgsqStreamParser` in src/engine/ggsq.ts; kv does not import engine): `push` throws at the
   * first inconsistent byte, `end` returns the parsed state or throws when it is incomplete.
   */
  walker: (payloadBytes: number) => StructureWalker<S>;
  /** Where the payload is written (created; the receiver deletes it on `discard`), when `files` is not given. */
  path?: string;
  /**
   * Recycled destination files: the payload goes into one from here (its path is in the
   * ReceivedState), given back by `done`/`discard`.
   */
  files?: FilePool;
  /** Write buffers. */
  pool: BufferPool;
  /**
   * The KV I/O thread (io-thread.ts): the payload's CRC-32 and file writes happen there; the
   * main thread copies each piece into the transfer's reserved slots (and pauses the socket,
   * through the `flow` given to `push`, while they are all in the thread). Absent, or when the
   * thread is not available or the pool has no slot free: CRC-32 and writes inline.
   */
  io?: KvIo;
}

/** The socket a receiver's bytes come from, paused while the receiver's slots are all in the I/O thread (PeerConn). */
export interface ReadFlow {
  pauseReads(): void;
  resumeReads(): void;
}

/** Bytes received ahead of the I/O thread beyond the reserved slots before the room fails (the socket is paused long before). */
const MAX_OVERFLOW_BYTES = 4 * 1024 * 1024;
/**
 * Longest pause of the socket for one receive, ms: then the room fails (KvError('TIMEOUT')) and
 * the socket reads on — half the KV heartbeat's budget (2 × 1 s; a paused socket reads no
 * heartbeat), so a stuck or starved disk fails its room, never the connection and every room on it.
 */
export const PAUSE_LIMIT_MS = 1000;

/** One receive's share of the I/O thread: its slots, the one being filled, bytes waiting for a slot. */
interface Threaded {
  io: KvIo;
  stream: IoStream;
  slots: number[];
  free: number[];
  cur: { slot: number; used: number } | undefined;
  /** Payload offset of the next slot written. */
  filePos: number;
  /** Copies of bytes that found no free slot (in order, before any later byte). */
  overflow: Buffer[];
  overflowBytes: number;
  flow: ReadFlow | undefined;
  paused: boolean;
  /** Fails the receive when a pause lasts PAUSE_LIMIT_MS. */
  pauseTimer: NodeJS.Timeout | undefined;
  /** Called when nothing is left to write (no overflow, no job in the thread) or the stream failed. */
  drained: (() => void)[];
}

/** What kv_end says after a streamed kv_begin: bytes sent (head + payload) and the payload's CRC-32. */
export interface StreamEnd {
  totalBytes: number;
  crc: number;
}

/** What a completed receive yields: the envelope header and the walked ggsq structure. */
export interface ReceivedState<S> {
  header: EnvelopeHeader;
  state: S;
  /** The file holding exactly the payload. */
  path: string;
}

const bad = (reason: string): KvError => new KvError('BAD_ENVELOPE', reason);
/** A payload piece at least this large is written to the file without a copy, bytes. */
const DIRECT_WRITE_BYTES = 32 * 1024;
/** Gathered small pieces are written once this many bytes are buffered, bytes. */
const GATHER_FLUSH_BYTES = 256 * 1024;

/**
 * One room's incoming state. `push` the chunk data in order (synchronous; throws on the first
 * inconsistency), `finish` once kv_end arrives; then `done` once the caller no longer uses the
 * file `finish` returned (its load settled), or `discard` on any failure, at any time — also
 * while the caller may still be reading the file. After a throw the receiver refuses further
 * input. The file is given up exactly once: `done` gives it back to the file pool (or deletes
 * it); `discard` gives back a file nobody else has seen, and deletes one `finish` handed out
 * (a load may still be reading it: the unlinked inode lives until it closes; a recycled file
 * could be overwritten under it).
 */
export class StateReceiver<S> {
  /** Bytes pushed so far. */
  received = 0;
  private head: Buffer[] = [];
  private headLen = 0;
  private header: EnvelopeHeader | undefined;
  private headBytes = 0;
  private parser: StructureWalker<S> | undefined;
  private readonly crc = new Crc32();
  private trailer = Buffer.alloc(ENVELOPE_TRAILER_BYTES);
  private failed: Error | undefined;
  /** Opened once the head is accepted (a state refused at its head never creates a file). */
  private fd: number | undefined;
  /** The destination file, once opened. */
  private path: string | undefined;
  /** `finish` handed the file out. */
  private lent = false;
  private buf: Buffer | undefined;
  private bufUsed = 0;
  private discarded = false;
  /** Payload bytes accepted: the head's payloadBytes, or (streamed) the limit. */
  private payloadCap = 0;
  /** Size the destination file was given at open (streamed: cut or grown to the real size at finish). */
  private fileBytes = 0;
  /** Set when the I/O thread does the CRC-32 and the writes. */
  private t: Threaded | undefined;
  /** The first `flow` given to `push`. */
  private flow: ReadFlow | undefined;

  constructor(private readonly o: StateReceiverOptions<S>) {}

  /**
   * Consume the next piece of the room's byte stream.
   * `flow`: the socket the bytes come from, paused while this receive's I/O-thread slots are all
   * busy (with `io`; ignored otherwise).
   * @throws KvError('BAD_ENVELOPE' | 'BAD_STATE') at the first byte that proves the state bad
   *   (head fields, structure, more bytes than announced); KvError('STATE_TOO_LARGE') when a
   *   streamed state's bytes pass `totalBytes` (the limit); the I/O thread's failure
   *   (KvError('ABORTED') when it died, 'BAD_STATE' on a write error).
   */
  push(data: Buffer, flow?: ReadFlow): void {
    if (this.failed) throw this.failed;
    this.flow ??= flow;
    if (this.t) this.t.flow ??= flow;
    try {
      this.consume(data);
    } catch (e) {
      this.failed = e as Error;
      throw e;
    }
  }

  private consume(data: Buffer): void {
    if (this.received + data.length > this.o.totalBytes) {
      // streamed: `totalBytes` is the receiver's limit, not a size the sender announced
      if (this.o.streamed) throw new KvError('STATE_TOO_LARGE', `the state is over the limit of ${this.o.totalBytes} bytes: ${this.received + data.length} bytes arrived`);
      throw bad(`${this.received + data.length} bytes received, kv_begin announced ${this.o.totalBytes}`);
    }
    let d = data;
    if (!this.header) {
      this.head.push(d);
      this.headLen += d.length;
      this.received += d.length;
      const all = this.head.length === 1 ? this.head[0]! : Buffer.concat(this.head, this.headLen);
      const h = parseEnvelopeHead(all, this.o.expect);
      if (!h) {
        this.head = [Buffer.from(all)]; // a copy: `data` may be a reused socket read buffer
        return;
      }
      let payloadCap = h.header.payloadBytes;
      if (this.o.streamed) {
        if (h.header.payloadBytes !== 0) throw bad(`a streamed state's envelope head must say payloadBytes 0 (size at kv_end), it says ${h.header.payloadBytes}`);
        payloadCap = this.o.totalBytes - h.headBytes;
        if (payloadCap <= 0) throw bad(`envelope head of ${h.headBytes} bytes leaves no room under the limit of ${this.o.totalBytes}`);
      } else {
        const need = h.headBytes + h.header.payloadBytes + ENVELOPE_TRAILER_BYTES;
        if (need !== this.o.totalBytes) throw bad(`kv_begin announced ${this.o.totalBytes} bytes, the envelope needs ${need}`);
      }
      this.header = h.header;
      this.headBytes = h.headBytes;
      this.payloadCap = payloadCap;
      this.open(this.o.streamed ? Math.max(1, Math.min(payloadCap, this.o.streamed.hintBytes - h.headBytes)) : payloadCap);
      // Streamed, the real size is unknown until kv_end: the byte limit above is the only one (a
      // walk bounded by it would refuse a too-large state as a corrupt one at its first layer
      // header past the limit, before the bytes do); the walk still checks every field.
      this.parser = this.o.walker(this.o.streamed ? Number.MAX_SAFE_INTEGER : payloadCap);
      this.head = [];
      d = all.subarray(h.headBytes);
      this.received -= d.length; // counted again below
      if (d.length === 0) return;
    }
    const payloadEnd = this.headBytes + this.payloadCap;
    const inPayload = Math.max(0, Math.min(d.length, payloadEnd - this.received));
    if (inPayload > 0) {
      const p = d.subarray(0, inPayload);
      this.parser!.push(p);
      if (this.t) this.threadWrite(p, false);
      else {
        this.crc.update(p);
        this.write(p);
      }
      this.received += inPayload;
    }
    const rest = d.subarray(inPayload);
    if (rest.length > 0) {
      rest.copy(this.trailer, this.received - payloadEnd);
      this.received += rest.length;
    }
  }

  /** Open the destination: a recycled file of exactly `payloadBytes`, or a new file at `path`. */
  private open(payloadBytes: number): void {
    if (this.o.files) {
      const f = this.o.files.acquire(payloadBytes);
      this.fd = f.fd;
      this.path = f.path;
      this.fileBytes = payloadBytes;
      this.useThread(payloadBytes);
      return;
    }
    if (this.o.path === undefined) throw new KvError('BAD_STATE', 'StateReceiver: neither path nor files given');
    this.path = this.o.path;
    this.fd = openSync(this.o.path, 'w');
    ftruncateSync(this.fd, payloadBytes);
    this.fileBytes = payloadBytes;
    this.useThread(payloadBytes);
  }

  /** With `io`: reserve this receive's slots and a stream on the thread (none free, or no thread: inline). */
  private useThread(payloadBytes: number): void {
    const io = this.o.io;
    if (!io?.wants(payloadBytes)) return;
    const slots = io.reserve(IO_SLOTS_PER_TRANSFER);
    const stream = slots.length > 0 ? io.stream() : undefined;
    if (!stream) {
      io.unreserve(slots);
      return;
    }
    const t: Threaded = { io, stream, slots, free: [...slots], cur: undefined, filePos: 0, overflow: [], overflowBytes: 0, flow: this.flow, paused: false, pauseTimer: undefined, drained: [] };
    this.t = t;
    stream.onReply = (slot) => {
      t.free.push(slot);
      if (t.overflow.length > 0) {
        const waiting = t.overflow.splice(0);
        t.overflowBytes = 0;
        try {
          for (const b of waiting) this.threadWrite(b, true);
        } catch (e) {
          this.failed ??= e as Error;
        }
      }
      this.flowCheck();
      this.wakeDrained();
    };
    stream.onFail = (err) => {
      this.failed ??= err;
      this.flowCheck();
      this.wakeDrained();
    };
  }

  /**
   * A payload piece into the thread's slots, in order: copied into the slot being filled, which
   * goes to the thread (CRC-32, then the write at its file offset) once full; bytes that find no
   * free slot wait, copied (`owned`: `p` is such a copy already), and the socket is paused.
   */
  private threadWrite(p: Buffer, owned: boolean): void {
    const t = this.t!;
    const slotBytes = t.io.slotBytes;
    let i = 0;
    while (i < p.length) {
      if (t.overflow.length > 0 || (!t.cur && t.free.length === 0)) {
        const rest = p.subarray(i);
        if (t.overflowBytes + rest.length > MAX_OVERFLOW_BYTES) throw new KvError('BAD_STATE', `the KV I/O thread is ${t.overflowBytes + rest.length} bytes behind the socket`);
        t.overflow.push(owned ? rest : Buffer.from(rest));
        t.overflowBytes += rest.length;
        break;
      }
      t.cur ??= { slot: t.free.pop()!, used: 0 };
      const n = Math.min(slotBytes - t.cur.used, p.length - i);
      p.copy(t.io.mem, t.cur.slot * slotBytes + t.cur.used, i, i + n);
      t.cur.used += n;
      i += n;
      if (t.cur.used === slotBytes) this.submit();
    }
    this.flowCheck();
  }

  /** The slot being filled to the thread. @throws the stream's failure. */
  private submit(): void {
    const t = this.t!;
    const c = t.cur;
    if (!c) return;
    t.cur = undefined;
    t.stream.write(this.fd!, c.slot, c.used, t.filePos);
    t.filePos += c.used;
  }

  /** Pause the socket below two free slots' worth of room, resume from four (or once the receive failed or ended). */
  private flowCheck(): void {
    const t = this.t;
    if (!t?.flow) return;
    const room = t.free.length * t.io.slotBytes + (t.cur ? t.io.slotBytes - t.cur.used : 0) - t.overflowBytes;
    const over = this.failed !== undefined || this.discarded;
    // thresholds within the reservation (a short pool may have given this receive fewer than 4)
    const reserved = t.free.length + t.stream.pending + (t.cur ? 1 : 0);
    const low = Math.min(2, reserved) * t.io.slotBytes;
    const high = Math.min(4, reserved) * t.io.slotBytes;
    if (!t.paused && !over && room < low) {
      t.paused = true;
      t.flow.pauseReads();
      t.pauseTimer = setTimeout(() => {
        this.failed ??= new KvError('TIMEOUT', `the KV I/O thread kept up with the socket for none of ${PAUSE_LIMIT_MS} ms (${t.slots.length} slots reserved, ${t.stream.pending} writes in the thread, ${t.free.length} free, ${t.overflowBytes} bytes waiting): slow state directory or a starved thread`);
        this.flowCheck();
        this.wakeDrained();
      }, PAUSE_LIMIT_MS);
      t.pauseTimer.unref();
    } else if (t.paused && (over || room >= high)) {
      this.unpause();
    }
  }

  private unpause(): void {
    const t = this.t!;
    if (!t.paused) return;
    t.paused = false;
    clearTimeout(t.pauseTimer);
    t.pauseTimer = undefined;
    t.flow?.resumeReads();
  }

  private wakeDrained(): void {
    const t = this.t!;
    if (this.failed || (t.overflow.length === 0 && t.stream.pending === 0)) for (const fn of t.drained.splice(0)) fn();
  }

  /** Everything pushed is written by the thread (its CRC-32 final). @throws the stream's failure. */
  private async threadDrain(): Promise<void> {
    const t = this.t!;
    if (!this.failed) this.submit();
    while (!this.failed && (t.overflow.length > 0 || t.stream.pending > 0 || t.cur)) {
      await new Promise<void>((r) => t.drained.push(r));
      if (!this.failed) this.submit();
    }
    if (this.failed) throw this.failed;
  }

  /**
   * Payload bytes to the file as they come: a large piece (a socket read's worth) is written
   * straight from the read buffer, small ones are gathered in the pooled buffer first (flushed
   * at GATHER_FLUSH_BYTES), so the file is nearly complete when the last byte arrives.
   */
  private write(p: Buffer): void {
    if (this.bufUsed === 0 && p.length >= DIRECT_WRITE_BYTES) {
      let off = 0;
      while (off < p.length) off += writeSync(this.fd!, p, off, p.length - off);
      return;
    }
    let i = 0;
    while (i < p.length) {
      this.buf ??= this.o.pool.acquire();
      const n = Math.min(this.buf.length - this.bufUsed, p.length - i);
      p.copy(this.buf, this.bufUsed, i, i + n);
      this.bufUsed += n;
      i += n;
      if (this.bufUsed >= Math.min(this.buf.length, GATHER_FLUSH_BYTES)) this.flush();
    }
  }

  /** Write the buffered bytes to the file (the buffer stays for the next ones). */
  private flush(): void {
    let off = 0;
    while (off < this.bufUsed) off += writeSync(this.fd!, this.buf!, off, this.bufUsed - off);
    this.bufUsed = 0;
  }

  /**
   * kv_end arrived: check completeness, the structure's end and the CRC, wait for the file.
   * `end`: what a streamed kv_end says (required after a streamed kv_begin, ignored otherwise):
   * the bytes must be exactly `end.totalBytes`, the CRC-32 `end.crc`; the file is cut (or
   * grown) to the payload's real size and the returned header's payloadBytes is that size.
   * @throws KvError('BAD_ENVELOPE') on truncation or checksum mismatch, KvError('BAD_STATE') on
   *   an incomplete ggsq structure, fs errors from writing the file.
   */
  async finish(end?: StreamEnd): Promise<ReceivedState<S>> {
    if (this.failed) throw this.failed;
    try {
      let header = this.header;
      let crc: number;
      if (this.o.streamed) {
        if (!end) throw bad('streamed state: kv_end without its byte count and CRC-32');
        if (!header || this.received !== end.totalBytes) throw bad(`truncated: kv_end says ${end.totalBytes} bytes, ${this.received} received`);
        crc = end.crc;
      } else {
        if (!header || this.received !== this.o.totalBytes) throw bad(`truncated: kv_end after ${this.received} of ${this.o.totalBytes} bytes`);
        crc = this.trailer.readUInt32BE(0);
      }
      const state = this.parser!.end();
      if (this.t) {
        await this.threadDrain();
        // all written: the slots go back now (the load may take a while), the socket reads on
        const t = this.t;
        t.stream.end();
        t.io.unreserve(t.slots.splice(0));
        t.free.length = 0;
        this.unpause();
      }
      const got = this.t ? this.t.stream.crc : this.crc.value;
      if (got >>> 0 !== crc >>> 0) throw bad('payload checksum mismatch: state is corrupted');
      this.flush();
      if (this.o.streamed) {
        const payloadBytes = this.received - this.headBytes;
        if (payloadBytes !== this.fileBytes) ftruncateSync(this.fd!, payloadBytes);
        this.fileBytes = payloadBytes;
        header = { ...header, payloadBytes };
      }
      this.release();
      this.lent = true;
      return { header, state, path: this.path! };
    } catch (e) {
      this.failed = e as Error;
      throw e;
    }
  }

  /** Buffer back to the pool, file closed (idempotent). */
  private release(): void {
    if (this.buf) this.o.pool.release(this.buf);
    this.buf = undefined;
    if (this.fd !== undefined) closeSync(this.fd);
    this.fd = undefined;
  }

  /**
   * The caller is done with the file `finish` returned (its load settled, whatever the outcome):
   * the file goes back to the file pool (deleted when there is none, or it is full). Also fine
   * instead of `discard` when no one else can be reading the file. Idempotent, a no-op after
   * `discard`; never throws. A deletion runs in the background (unlinkInBackground): resolves
   * once it finished.
   */
  async done(): Promise<void> {
    return this.giveUp(false);
  }

  /**
   * Drop everything (any failure, at any time): buffer back to the pool, file closed; the file
   * is recycled if `finish` never handed it out, else deleted (in the background: resolves once
   * it is gone). Idempotent, a no-op after `done`; never throws.
   */
  async discard(): Promise<void> {
    this.failed ??= new KvError('ABORTED', 'receive discarded');
    return this.giveUp(this.lent);
  }

  private giveUp(remove: boolean): Promise<void> {
    if (this.discarded) return Promise.resolve();
    this.discarded = true;
    const t = this.t;
    if (t) {
      // nothing may write through the descriptor, or into the file once it is recycled, after
      // this: the file work waits until the thread holds no job of this receive
      this.flowCheck();
      t.overflow.length = 0;
      t.overflowBytes = 0;
      t.stream.end();
      return new Promise((resolve) =>
        t.stream.whenIdle(() => {
          t.io.unreserve(t.slots);
          this.giveUpNow(remove, resolve);
        }),
      );
    }
    return new Promise((resolve) => this.giveUpNow(remove, resolve));
  }

  /** Close the file, then recycle or delete it; `settled` once that is done (a deletion finished). */
  private giveUpNow(remove: boolean, settled: () => void): void {
    try {
      this.release();
    } catch {
      // closing a file we wrote cannot fail in a way that matters here
    }
    const path = this.path;
    if (path === undefined) return settled();
    if (!remove && this.o.files) {
      this.o.files.release(path);
      return settled();
    }
    // a large tmpfs file's pages are freed inside unlink(2): not on the event loop
    unlinkInBackground(path, () => settled());
  }
}
