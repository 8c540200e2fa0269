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
 * through libuv's thread pool — measured on this 2-core machine under load at several ms each,
 * a fixed cost that dominated small handoffs. The kernel sends earlier pieces while we read.
 */
import { closeSync, fstatSync, openSync, readSync } from 'node:fs';
import type { PeerConn, SendChunksOptions } from '../channel.js';
import { envelopeTrailer, ENVELOPE_TRAILER_BYTES } from '../envelope.js';
import { MAX_CHUNK_BYTES } from '../messages.js';
import { KvError, type RoomId } from '../types.js';
import { Crc32 } from './checksum.js';
import type { BufferPool } from './pool.js';

/** Options of `sendStateFile`; signal, stallMs, onProgress as PeerConn.sendChunks; `chunkBytes` caps the piece size. */
export interface SendStateFileOptions extends Omit<SendChunksOptions, 'offset'> {
  /** Read buffers: one per transfer, cut into `pieceBytes` pieces, given back once no write uses it. */
  pool: BufferPool;
  /** Bytes per read piece and chunk frame (default SEND_PIECE_BYTES; at most chunkBytes and the pool's buffer size). */
  pieceBytes?: number;
}

/**
 * Read piece and chunk frame size of `sendStateFile`, bytes. Small enough that the piece read
 * from the file is still in the CPU cache (L2: 512 KiB per core here) when the CRC and the
 * socket's copy touch it — read + CRC-32 of a 64 MiB state from /dev/shm took 44-49 ms (best
 * of 7) in 64-256 KiB pieces against 59-63 ms in 1 MiB ones on this machine — and large
 * enough that per-frame costs (a writev, a callback) stay few: 256 frames per 64 MiB.
 */
export const SEND_PIECE_BYTES = 256 * 1024;

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
  const fd = openSync(path, 'r');
  const big = opts.pool.acquire();
  const pieceBytes = Math.max(1, Math.min(opts.pieceBytes ?? SEND_PIECE_BYTES, opts.chunkBytes ?? MAX_CHUNK_BYTES, big.length, MAX_CHUNK_BYTES));
  const slots = Math.floor(big.length / pieceBytes);
  const free: number[] = [];
  for (let i = slots - 1; i >= 0; i--) free.push(i);
  let inFlight = 0;
  let over = false;
  const giveBack = (): void => {
    if (over && inFlight === 0) opts.pool.release(big);
  };
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
        const slot = free.pop();
        if (slot === undefined) return null;
        const at = slot * pieceBytes;
        const want = Math.min(pieceBytes, payloadBytes - pos);
        let got = 0;
        try {
          while (got < want) {
            const n = readSync(fd, big, at + got, want - got, pos + got);
            if (n === 0) break;
            got += n;
          }
        } catch (e) {
          free.push(slot);
          throw e;
        }
        if (got !== want) {
          free.push(slot);
          throw new KvError('BAD_STATE', `state file ${path} ended at byte ${pos + got}, expected ${payloadBytes}`);
        }
        const piece = big.subarray(at, at + want);
        crc.update(piece);
        pos += want;
        if (pos === payloadBytes) stage = 'trailer';
        inFlight++;
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
    flushed: (piece: Buffer): void => {
      if (piece.buffer !== big.buffer || piece.byteOffset < big.byteOffset || piece.byteOffset >= big.byteOffset + big.length) return; // head or trailer
      inFlight--;
      free.push((piece.byteOffset - big.byteOffset) / pieceBytes);
      giveBack();
    },
  };
  try {
    await conn.sendFrom(room, source, { signal: opts.signal, stallMs: opts.stallMs, onProgress: opts.onProgress, offset: 0 });
  } finally {
    over = true;
    giveBack(); // else when the socket is done with the last piece in flight
    closeSync(fd);
  }
}
