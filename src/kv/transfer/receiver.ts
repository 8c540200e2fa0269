/**
 * Decode's side of the pipelined KV handoff: validates the envelope and the ggsq structure while
 * the bytes stream in, computes the CRC-32 as they pass, and writes the payload into the
 * destination state file as it arrives — so when the last chunk lands the file is already on
 * disk and checked, and only llama.cpp's load remains. A head from another model, a ggsq field
 * that does not add up, or bytes beyond the announced size fail the room at that chunk, before
 * the rest is even sent. Payload bytes are gathered into pooled buffers (one file write per
 * buffer; at most the pool's bound, reused across transfers; past it pieces are written as they
 * came). `push` may keep a reference to its data until written: callers must not reuse it.
 *
 * Byte stream (envelope.ts): head | payload | u32 BE CRC-32 trailer.
 */
import { open, rm, type FileHandle } from 'node:fs/promises';
import { GgsqStreamParser, type ParsedState } from '../../engine/ggsq.js';
import { ENVELOPE_TRAILER_BYTES, parseEnvelopeHead, type EnvelopeExpect } from '../envelope.js';
import type { EnvelopeHeader } from '../messages.js';
import { KvError } from '../types.js';
import { Crc32 } from './checksum.js';
import type { BufferPool } from './pool.js';

/** Options of a StateReceiver. */
export interface StateReceiverOptions {
  /** Bytes kv_begin announced (head + payload + trailer). */
  totalBytes: number;
  /** What the envelope head must say (fingerprint, context settings, payload limit). */
  expect: EnvelopeExpect;
  /** KV layers of the local model (the ggsq walk checks it). */
  nLayer: number;
  /** Where the payload is written (created; the receiver deletes it on `discard`). */
  path: string;
  /** Write buffers. */
  pool: BufferPool;
}

/** What a completed receive yields: the envelope header and the walked ggsq structure. */
export interface ReceivedState {
  header: EnvelopeHeader;
  state: ParsedState;
  /** The file holding exactly the payload. */
  path: string;
}

const bad = (reason: string): KvError => new KvError('BAD_ENVELOPE', reason);

/**
 * One room's incoming state. `push` the chunk data in order (synchronous; throws on the first
 * inconsistency), `finish` once kv_end arrives, `discard` on any failure (idempotent). After a
 * throw the receiver refuses further input.
 */
export class StateReceiver {
  /** Bytes pushed so far. */
  received = 0;
  private head: Buffer[] = [];
  private headLen = 0;
  private header: EnvelopeHeader | undefined;
  private headBytes = 0;
  private parser: GgsqStreamParser | undefined;
  private readonly crc = new Crc32();
  private trailer = Buffer.alloc(ENVELOPE_TRAILER_BYTES);
  private failed: Error | undefined;
  /** Opened once the head is accepted (a state refused at its head never creates a file). */
  private file: Promise<FileHandle> | undefined;
  private writes: Promise<void> = Promise.resolve();
  private writeError: Error | undefined;
  private buf: Buffer | undefined;
  private bufUsed = 0;
  private discarded = false;

  constructor(private readonly o: StateReceiverOptions) {}

  /**
   * Consume the next piece of the room's byte stream.
   * @throws KvError('BAD_ENVELOPE' | 'BAD_STATE') at the first byte that proves the state bad
   *   (head fields, structure, more bytes than announced).
   */
  push(data: Buffer): void {
    if (this.failed) throw this.failed;
    try {
      this.consume(data);
    } catch (e) {
      this.failed = e as Error;
      throw e;
    }
  }

  private consume(data: Buffer): void {
    if (this.received + data.length > this.o.totalBytes) throw bad(`${this.received + data.length} bytes received, kv_begin announced ${this.o.totalBytes}`);
    let d = data;
    if (!this.header) {
      this.head.push(d);
      this.headLen += d.length;
      this.received += d.length;
      const all = this.head.length === 1 ? this.head[0]! : Buffer.concat(this.head, this.headLen);
      const h = parseEnvelopeHead(all, this.o.expect);
      if (!h) {
        this.head = [all];
        return;
      }
      const need = h.headBytes + h.header.payloadBytes + ENVELOPE_TRAILER_BYTES;
      if (need !== this.o.totalBytes) throw bad(`kv_begin announced ${this.o.totalBytes} bytes, the envelope needs ${need}`);
      this.header = h.header;
      this.headBytes = h.headBytes;
      this.file = open(this.o.path, 'w');
      this.file.catch((e: Error) => (this.writeError ??= e));
      this.parser = new GgsqStreamParser({ contextSize: this.o.expect.contextSize, nLayer: this.o.nLayer, maxBytes: h.header.payloadBytes });
      this.head = [];
      d = all.subarray(h.headBytes);
      this.received -= d.length; // counted again below
      if (d.length === 0) return;
    }
    const payloadEnd = this.headBytes + this.header.payloadBytes;
    const inPayload = Math.max(0, Math.min(d.length, payloadEnd - this.received));
    if (inPayload > 0) {
      const p = d.subarray(0, inPayload);
      this.crc.update(p);
      this.parser!.push(p);
      this.write(p);
      this.received += inPayload;
    }
    const rest = d.subarray(inPayload);
    if (rest.length > 0) {
      rest.copy(this.trailer, this.received - payloadEnd);
      this.received += rest.length;
    }
  }

  /**
   * Copy payload bytes into the current pooled buffer; a full buffer goes to the file. When the
   * pool has no buffer left (the disk is behind the wire), the piece is written as it is instead
   * (no copy, no allocation: it is the socket's own read buffer, which nobody reuses).
   */
  private write(p: Buffer): void {
    let i = 0;
    while (i < p.length) {
      if (!this.buf) {
        this.buf = this.o.pool.tryAcquire();
        if (!this.buf) return this.enqueue(p.subarray(i), p.length - i, false);
      }
      const n = Math.min(this.buf.length - this.bufUsed, p.length - i);
      p.copy(this.buf, this.bufUsed, i, i + n);
      this.bufUsed += n;
      i += n;
      if (this.bufUsed === this.buf.length) this.flush();
    }
  }

  private flush(): void {
    const b = this.buf;
    const n = this.bufUsed;
    this.buf = undefined;
    this.bufUsed = 0;
    if (b) this.enqueue(b, n, true);
  }

  /** Append `n` bytes of `b` to the file, in order; a pooled buffer goes back once written. */
  private enqueue(b: Buffer, n: number, pooled: boolean): void {
    this.writes = this.writes.then(async () => {
      try {
        if (!this.writeError && !this.discarded && n > 0) {
          const fh = await this.file!;
          let off = 0;
          while (off < n) off += (await fh.write(b, off, n - off)).bytesWritten;
        }
      } catch (e) {
        this.writeError ??= e as Error;
      } finally {
        if (pooled) this.o.pool.release(b);
      }
    });
  }

  /**
   * kv_end arrived: check completeness, the structure's end and the CRC, wait for the file.
   * @throws KvError('BAD_ENVELOPE') on truncation or checksum mismatch, KvError('BAD_STATE') on
   *   an incomplete ggsq structure, fs errors from writing the file.
   */
  async finish(): Promise<ReceivedState> {
    if (this.failed) throw this.failed;
    try {
      if (!this.header || this.received !== this.o.totalBytes) throw bad(`truncated: kv_end after ${this.received} of ${this.o.totalBytes} bytes`);
      const state = this.parser!.end();
      if (this.crc.value >>> 0 !== this.trailer.readUInt32BE(0)) throw bad('payload checksum mismatch: state is corrupted');
      this.flush();
      await this.writes;
      const fh = await this.file!;
      if (this.writeError) throw this.writeError;
      await fh.close();
      return { header: this.header, state, path: this.o.path };
    } catch (e) {
      this.failed = e as Error;
      throw e;
    }
  }

  /** Drop everything: buffers back to the pool, file closed and deleted. Idempotent; never throws. */
  async discard(): Promise<void> {
    if (this.discarded) return;
    this.discarded = true;
    this.failed ??= new KvError('ABORTED', 'receive discarded');
    if (this.buf) this.o.pool.release(this.buf);
    this.buf = undefined;
    await this.writes;
    if (!this.file) return;
    await this.file.then((fh) => fh.close()).catch(() => {});
    await rm(this.o.path, { force: true }).catch(() => {});
  }
}
