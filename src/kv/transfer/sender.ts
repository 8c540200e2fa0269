/**
 * Prefill's side of the pipelined KV handoff: the saved state file goes into the socket in
 * pieces, never read whole. Envelope head first (decode validates it before any payload byte),
 * then the file, read in 256 KiB pieces into the slots of one pooled buffer — a piece is read
 * and CRC'd while earlier ones are on the wire, and written while it is still in the CPU cache —
 * then the 4-byte CRC trailer, all through one pull-based `PeerConn.sendFrom`. Disk read,
 * checksum and wire overlap; the bytes are touched once. (Chunked, overlapped sending is what
 * Mooncake's and NIXL's transfer engines do for KV blocks; here the unit is a file and a TCP
 * socket.)
 *
 * The file is read with synchronous calls: the state directory is tmpfs (/dev/shm), where a
 * piece read is a memory copy of microseconds, while each asynchronous fs call is a round trip
 * through libuv's thread pool (a wake-up of a pool thread and of the event loop), a fixed cost
 * that dominated small handoffs. The kernel sends earlier pieces while we read.
 */
import { closeSync, fstatSync, openSync, readSync } from 'node:fs';
import type { PeerConn, SendChunksOptions } from '../channel.js';
import { envelopeTrailer, ENVELOPE_TRAILER_BYTES } from '../envelope.js';
import { MAX_CHUNK_BYTES } from '../messages.js';
import { KvError, type RoomId } from '../types.js';
import { systemClock } from '../../base/clock.js';
import type { MonoClock } from '../heartbeat.js';
import { Crc32 } from './checksum.js';
import { IO_SLOTS_PER_TRANSFER, type KvIo } from './io-thread.js';
import type { BufferPool } from './pool.js';
import { PdError } from '../../base/errors.js';

/** Options of `sendStateFile`; signal, stallMs, onProgress as PeerConn.sendChunks; `chunkBytes` caps the piece size. */
export interface SendStateFileOptions extends Omit<SendChunksOptions, 'offset'> {
  /** Read buffers: one per transfer, cut into `pieceBytes` pieces, given back once no write uses it. */
  pool: BufferPool;
  /** Bytes per read piece and chunk frame (default SEND_PIECE_BYTES; at most chunkBytes and the pool's buffer size). */
  pieceBytes?: number;
  /**
   * The KV I/O thread (io-thread.ts): the file is read and CRC'd there, into its shared slots
   * (one slot = one piece: `pieceBytes` is then the slot size, at most chunkBytes); `pool` is
   * not used. Absent, or when the thread is not available or has no slot free: read inline.
   */
  io?: KvIo;
}

/**
 * Read piece and chunk frame size of `sendStateFile`, bytes. Small enough that the piece read
 * from the file is still in the core's L2 cache when the CRC and the socket's copy touch it (1 MiB
 * pieces read and CRC'd slower) and large enough that per-frame costs (a writev, a callback)
 * stay few: 256 frames per 64 MiB.
 */
export const SEND_PIECE_BYTES = 256 * 1024;

/**
 * One pooled buffer of a send, cut into `pieceBytes` slots (pieceBytes: opts.pieceBytes, else
 * SEND_PIECE_BYTES, at most chunkBytes, MAX_CHUNK_BYTES and the buffer's size). `take()` a free
 * slot (undefined: all in flight), `put(slot)` one back unused, `piece(slot, bytes)` when a read
 * piece goes to the socket, `flushed(piece)` when the socket is done with it (other buffers'
 * pieces — head, trailer — are ignored), `end()` once the send settled: the buffer goes back to
 * its pool exactly once, when the send has settled and no piece is in flight.
 */
class PieceSlots {
  readonly big: Buffer;
  readonly pieceBytes: number;
  private readonly free: number[] = [];
  private inFlight = 0;
  private over = false;
  private released = false;

  constructor(private readonly pool: BufferPool, opts: SendStateFileOptions) {
    this.big = pool.acquire();
    this.pieceBytes = Math.max(1, Math.min(opts.pieceBytes ?? SEND_PIECE_BYTES, opts.chunkBytes ?? MAX_CHUNK_BYTES, this.big.length, MAX_CHUNK_BYTES));
    for (let i = Math.floor(this.big.length / this.pieceBytes) - 1; i >= 0; i--) this.free.push(i);
  }

  take(): number | undefined {
    return this.free.pop();
  }

  put(slot: number): void {
    this.free.push(slot);
  }

  /** Reads up to `want` bytes of `fd` at `pos` into `slot` (readFull); the slot goes back if the read throws. */
  read(slot: number, fd: number, want: number, pos: number): number {
    try {
      return readFull(fd, this.big, slot * this.pieceBytes, want, pos);
    } catch (e) {
      this.put(slot);
      throw e;
    }
  }

  /** The first `bytes` of `slot`, now owned by the socket until `flushed`. */
  piece(slot: number, bytes: number): Buffer {
    this.inFlight++;
    const at = slot * this.pieceBytes;
    return this.big.subarray(at, at + bytes);
  }

  flushed(piece: Buffer): void {
    const big = this.big;
    if (piece.buffer !== big.buffer || piece.byteOffset < big.byteOffset || piece.byteOffset >= big.byteOffset + big.length) return;
    this.inFlight--;
    this.free.push((piece.byteOffset - big.byteOffset) / this.pieceBytes);
    this.giveBack();
  }

  /** The send settled: the buffer goes back now, or when the socket is done with the last piece in flight. */
  end(): void {
    this.over = true;
    this.giveBack();
  }

  private giveBack(): void {
    if (this.over && this.inFlight === 0 && !this.released) {
      this.released = true;
      this.pool.release(this.big);
    }
  }
}


/** Bytes on the wire for a payload of `payloadBytes` behind `head` (what kv_begin announces). */
export function wireBytes(head: Buffer, payloadBytes: number): number {
  return head.length + payloadBytes + ENVELOPE_TRAILER_BYTES;
}

/**
 * Stream `head`, the file at `path` (exactly `payloadBytes` bytes) and the CRC trailer as room
 * `room`'s chunk frames, offsets 0 .. wireBytes(head, payloadBytes), through one
 * `PeerConn.sendFrom`. The file is read piece by piece into one pooled buffer cut into
 * `pieceBytes` slots (a piece is read and CRC'd when the send window has room and a slot is
 * free; the most recently flushed slot is reused first, so it is still cached). Resolves once
 * everything is flushed to the kernel. The file is read only; the caller owns (and deletes) it.
 * @throws KvError as PeerConn.sendChunks ('PEER_LOST', 'ABORTED', 'TIMEOUT'); KvError('BAD_STATE')
 *   when the file's size is not `payloadBytes`; fs errors from reading it.
 */
export async function sendStateFile(conn: PeerConn, room: RoomId, path: string, head: Buffer, payloadBytes: number, opts: SendStateFileOptions): Promise<void> {
  if (opts.io?.wants(payloadBytes)) {
    const slots = opts.io.reserve(IO_SLOTS_PER_TRANSFER);
    if (slots.length > 0) return sendThroughThread(conn, room, path, head, payloadBytes, opts.io, slots, opts);
  }
  const fd = openSync(path, 'r');
  const slots = new PieceSlots(opts.pool, opts);
  const { pieceBytes } = slots;
  const crc = new Crc32();
  let pos = 0;
  let stage: 'head' | 'payload' | 'trailer' | 'end' = 'head';
  const source = {
    next: (): Buffer | null | undefined => {
      if (stage === 'head') {
        stage = payloadBytes > 0 ? 'payload' : 'trailer';
        if (head.length > 0) return head;
      }
      if (stage === 'payload') {
        const slot = slots.take();
        if (slot === undefined) return null;
        const want = Math.min(pieceBytes, payloadBytes - pos);
        const got = slots.read(slot, fd, want, pos);
        if (got !== want) {
          slots.put(slot);
          throw new KvError('BAD_STATE', `state file ${path} ended at byte ${pos + got}, expected ${payloadBytes}`);
        }
        const piece = slots.piece(slot, want);
        crc.update(piece);
        pos += want;
        if (pos === payloadBytes) stage = 'trailer';
        return piece;
      }
      if (stage === 'trailer') {
        const { size } = fstatSync(fd);
        if (size !== payloadBytes) throw new KvError('BAD_STATE', `state file ${path} is ${size} bytes, expected ${payloadBytes}`);
        stage = 'end';
        return envelopeTrailer(crc.value);
      }
      return undefined;
    },
    flushed: (piece: Buffer): void => slots.flushed(piece), // head and trailer are not the pool's
  };
  try {
    await conn.sendFrom(room, source, { signal: opts.signal, stallMs: opts.stallMs, onProgress: opts.onProgress, offset: 0 });
  } finally {
    slots.end();
    closeSync(fd);
  }
}

/**
 * sendStateFile with the file read and CRC'd on the KV I/O thread: up to `slots.length` pieces
 * are read ahead into the reserved slots while earlier ones are on the wire; answers arrive in
 * order and go to the socket as they come; a slot is read again once the socket flushed it. The
 * main thread only hands slot views to the socket. The descriptor is closed, and the slots go
 * back to the pool, once neither the thread nor the socket uses them — whatever happens.
 * @throws as sendStateFile; KvError('ABORTED') when the thread dies, KvError('BAD_STATE') on a
 *   read error there.
 */
async function sendThroughThread(conn: PeerConn, room: RoomId, path: string, head: Buffer, payloadBytes: number, io: KvIo, slots: number[], opts: SendStateFileOptions): Promise<void> {
  let fd: number;
  try {
    fd = openSync(path, 'r');
  } catch (e) {
    io.unreserve(slots);
    throw e;
  }
  const stream = io.stream();
  const pieceBytes = Math.max(1, Math.min(io.slotBytes, opts.chunkBytes ?? MAX_CHUNK_BYTES, MAX_CHUNK_BYTES));
  const free = [...slots];
  /** Pieces read, in file order, not yet handed to the socket. */
  const ready: Buffer[] = [];
  let issued = 0;
  let handed = 0;
  let inSocket = 0;
  let failed: Error | undefined;
  let resume: (() => void) | undefined;
  let stage: 'head' | 'payload' | 'trailer' | 'end' = 'head';
  let settled = false;
  /** Per slot in the thread: the piece's file offset and length. */
  const want = new Map<number, { pos: number; len: number }>();
  const pump = (): void => {
    if (!stream || failed || settled) return;
    while (issued < payloadBytes && free.length > 0) {
      const slot = free.pop()!;
      const len = Math.min(pieceBytes, payloadBytes - issued);
      want.set(slot, { pos: issued, len });
      stream.read(fd, slot, len, issued);
      issued += len;
    }
  };
  if (stream) {
    stream.onReply = (slot, got) => {
      const w = want.get(slot)!;
      if (got !== w.len) {
        free.push(slot);
        failed ??= new KvError('BAD_STATE', `state file ${path} ended at byte ${w.pos + got}, expected ${payloadBytes}`);
      } else ready.push(io.view(slot, got));
      resume?.();
    };
    stream.onFail = (err) => {
      failed ??= err;
      resume?.();
    };
  } else failed = new KvError('ABORTED', 'kv I/O thread unavailable');
  let done = false;
  const release = (): void => {
    // the socket and the thread are done with every slot: back to the pool, the descriptor closed
    if (done || inSocket > 0 || !settled) return;
    done = true;
    const finish = (): void => {
      closeSync(fd);
      // slots the thread still had are free now (answered or lost with it)
      io.unreserve(slots);
    };
    if (stream) {
      stream.end();
      stream.whenIdle(finish);
    } else finish();
  };
  const source = {
    attach: (r: () => void): void => {
      resume = r;
      pump();
    },
    next: (): Buffer | null | undefined => {
      if (failed) throw failed;
      if (stage === 'head') {
        stage = payloadBytes > 0 ? 'payload' : 'trailer';
        if (head.length > 0) return head;
      }
      if (stage === 'payload') {
        const piece = ready.shift();
        if (!piece) {
          pump();
          return null;
        }
        inSocket++;
        handed += piece.length;
        if (handed === payloadBytes) stage = 'trailer';
        return piece;
      }
      if (stage === 'trailer') {
        const { size } = fstatSync(fd);
        if (size !== payloadBytes) throw new KvError('BAD_STATE', `state file ${path} is ${size} bytes, expected ${payloadBytes}`);
        stage = 'end';
        return envelopeTrailer(stream!.crc);
      }
      return undefined;
    },
    flushed: (piece: Buffer): void => {
      const slot = io.slotOf(piece);
      if (slot < 0) return; // head and trailer are not the pool's
      inSocket--;
      if (settled) release();
      else {
        free.push(slot);
        pump();
      }
    },
  };
  try {
    await conn.sendFrom(room, source, { signal: opts.signal, stallMs: opts.stallMs, onProgress: opts.onProgress, offset: 0 });
  } finally {
    settled = true;
    resume = undefined;
    release();
  }
}

/** What `sendGrowingStateFile` adds to SendStateFileOptions: the save it streams behind. */
export interface GrowingStateFileOptions extends SendStateFileOptions {
  /**
   * Settles when llama.cpp's save of the file settles: its size in bytes, or the save's error
   * (then the send fails with KvError('BAD_STATE')).
   */
  saved: Promise<number>;
  /** Monotonic time source of the create and growth waits (default: the system clock). */
  clock?: MonoClock;
  /**
   * Longest time the file may stay without growing while the save runs, ms (default
   * GROW_STALL_MS): then the send fails with KvError('TIMEOUT') (a stuck save cannot be
   * cancelled; its room must not wait for it).
   */
  growStallMs?: number;
  /**
   * Longest wait for llama.cpp to create the file, ms (default `growStallMs`). The save may
   * first wait for the context's lock while another sequence evaluates (node-llama-cpp's batch
   * dispatcher holds it for a whole decode loop), which is queueing, not a stall: the caller
   * passes the room's waiting deadline here, and the growth clock starts only once the file
   * exists. Then KvError('TIMEOUT').
   */
  createWaitMs?: number;
  /**
   * Called once, when the file first exists, before any byte of the room is handed to the
   * socket: the streamed kv_begin goes out here, so decode's transfer-idle clock does not run
   * while the save waits for its lock. `false` (the control message could not be sent) fails
   * the send with KvError('PEER_LOST').
   */
  onFileStart?: () => boolean;
  /**
   * Wait before reading again when the bytes are not written yet, ms (default 1); doubled on
   * every read that finds nothing new, up to 16 ms, back to `pollMs` when the file grows (a save
   * waiting for its lock costs ~60 syscalls a second, not 1000).
   */
  pollMs?: number;
}

/** What a streamed send put on the wire: bytes (head + payload, no trailer), the payload's size and CRC-32 (for kv_end). */
export interface StreamedSend {
  totalBytes: number;
  payloadBytes: number;
  crc: number;
}

/**
 * Reads `want` bytes of `fd` at file offset `pos` into `buf` at `at`, looping over short reads
 * until `want` bytes or the end of the file: returns the count read (< want only at the end).
 * Throws what readSync throws.
 */
function readFull(fd: number, buf: Buffer, at: number, want: number, pos: number): number {
  let got = 0;
  while (got < want) {
    const n = readSync(fd, buf, at + got, want - got, pos + got);
    if (n === 0) break;
    got += n;
  }
  return got;
}

/** Default `growStallMs` of sendGrowingStateFile, ms. */
export const GROW_STALL_MS = 10_000;
/** A piece shorter than this is not sent while the save runs (wait for more), bytes. */
const GROW_MIN_PIECE_BYTES = 64 * 1024;

/**
 * Stream `head` and the state file at `path` WHILE llama.cpp is still saving it (the streamed
 * kv_begin; decode must have said `kvStream` in `register`): llama.cpp writes a sequence state
 * strictly front to back through stdio (`llama_state_seq_save_file` → `llama_io_write_file`:
 * fwrite only, no seek, no back-patching; checked in llama.cpp's src/llama-context.cpp), so every
 * byte below the file's current end is final. Pieces are read at the send position into one
 * pooled buffer as in `sendStateFile`; a short read while the save runs means "not written yet":
 * a piece of ≥ 64 KiB goes out as it is, less waits (`pollMs`, backing off) and reads again.
 * Nothing of the room is sent before llama.cpp has created the file: then `onFileStart` (the
 * caller's kv_begin), the head, the pieces. Once `saved`
 * resolves with the size, the rest is read and the send ends — no trailer: the caller sends the
 * returned byte count and CRC-32 in kv_end. The file must not exist before the save starts (a
 * stale file's bytes would be read as the new state); the caller deletes it. Resolves once
 * every piece is flushed to the kernel.
 * @throws KvError('BAD_STATE') when the save fails, or the file ends before the size the save
 *   reported or differs from it; KvError('TIMEOUT') when the file is not created within
 *   `createWaitMs` or stays without growing for `growStallMs` while the save runs;
 *   KvError('PEER_LOST') when `onFileStart` returns false; as sendStateFile otherwise
 *   ('PEER_LOST', 'ABORTED', …).
 *   The pooled buffer goes back once no write uses it, whatever happens.
 */
export async function sendGrowingStateFile(conn: PeerConn, room: RoomId, path: string, head: Buffer, opts: GrowingStateFileOptions): Promise<StreamedSend> {
  const slots = new PieceSlots(opts.pool, opts);
  const { pieceBytes } = slots;
  const minPiece = Math.min(pieceBytes, GROW_MIN_PIECE_BYTES);
  const growStallMs = opts.growStallMs ?? GROW_STALL_MS;
  const createWaitMs = opts.createWaitMs ?? growStallMs;
  const pollMs = opts.pollMs ?? 1;
  const clock = opts.clock ?? systemClock;
  const startedAt = clock.nowMs();
  let delayMs = pollMs;
  let fd: number | undefined;
  let savedBytes: number | undefined;
  let saveError: unknown;
  let resume: (() => void) | undefined;
  let timer: NodeJS.Timeout | undefined;
  let lastGrowth = clock.nowMs();
  /** The file's end as last seen (growth = this moving forward). */
  let seenEnd = 0;
  const wake = (): void => {
    if (timer) clearTimeout(timer);
    timer = undefined;
    resume?.();
  };
  opts.saved.then(
    (n) => {
      savedBytes = n;
      wake();
    },
    (e: unknown) => {
      saveError = e ?? new PdError('engine_failed', 'save failed');
      wake();
    },
  );
  /**
   * Nothing to read yet: read again after the current back-off delay, unless llama.cpp has not
   * created the file within createWaitMs, or the file has not grown for growStallMs.
   */
  const later = (): null => {
    if (fd === undefined) {
      if (clock.nowMs() - startedAt > createWaitMs) throw new KvError('TIMEOUT', `llama.cpp did not create state file ${path} within ${createWaitMs} ms`);
    } else if (clock.nowMs() - lastGrowth > growStallMs) {
      throw new KvError('TIMEOUT', `state file ${path} did not grow for ${growStallMs} ms while llama.cpp saved it (${pos} bytes)`);
    }
    timer ??= setTimeout(wake, delayMs);
    delayMs = Math.min(delayMs * 2, Math.max(pollMs, 16));
    return null;
  };
  const grew = (end: number): void => {
    seenEnd = end;
    lastGrowth = clock.nowMs();
    delayMs = pollMs;
  };
  const crc = new Crc32();
  let pos = 0;
  let headSent = false;
  let ended = false;
  const source = {
    attach: (r: () => void): void => {
      resume = r;
    },
    next: (): Buffer | null | undefined => {
      if (ended) return undefined;
      if (saveError !== undefined) throw new KvError('BAD_STATE', `saving the state failed: ${(saveError as Error).message ?? String(saveError)}`);
      const size = savedBytes;
      if (fd === undefined) {
        try {
          fd = openSync(path, 'r');
        } catch (e) {
          if ((e as NodeJS.ErrnoException).code !== 'ENOENT' || size !== undefined) throw e;
          return later(); // llama.cpp has not created it yet (its save may wait for the context's lock)
        }
        lastGrowth = clock.nowMs(); // the growth clock starts with the file
        delayMs = pollMs;
        if (opts.onFileStart && !opts.onFileStart()) throw new KvError('PEER_LOST', `room ${room}: the streamed kv_begin could not be sent (connection closing)`);
      }
      if (!headSent) {
        headSent = true;
        if (head.length > 0) return head;
      }
      if (size !== undefined && pos === size) {
        const st = fstatSync(fd).size;
        if (st !== size) throw new KvError('BAD_STATE', `state file ${path} is ${st} bytes, the save reported ${size}`);
        ended = true;
        return undefined;
      }
      const slot = slots.take();
      if (slot === undefined) return null; // resumed by a flush
      const want = size === undefined ? pieceBytes : Math.min(pieceBytes, size - pos);
      const got = slots.read(slot, fd, want, pos);
      if (got < want && (size !== undefined || got < minPiece)) {
        slots.put(slot);
        if (size !== undefined) throw new KvError('BAD_STATE', `state file ${path} ended at byte ${pos + got}, the save reported ${size}`);
        if (pos + got > seenEnd) grew(pos + got);
        return later(); // not written yet (or too little to be worth a frame)
      }
      const piece = slots.piece(slot, got);
      crc.update(piece);
      pos += got;
      if (pos > seenEnd) grew(pos);
      return piece;
    },
    flushed: (piece: Buffer): void => slots.flushed(piece), // the head is not the pool's
  };
  try {
    await conn.sendFrom(room, source, { signal: opts.signal, stallMs: opts.stallMs, onProgress: opts.onProgress, offset: 0 });
    return { totalBytes: head.length + pos, payloadBytes: pos, crc: crc.value >>> 0 };
  } finally {
    resume = undefined;
    if (timer) clearTimeout(timer);
    timer = undefined;
    slots.end();
    if (fd !== undefined) closeSync(fd);
  }
}
