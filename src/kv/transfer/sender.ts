/**
 * Prefill's side of the pipelined KV handoff: the saved state file goes into the socket in
 * pieces, never read whole. Envelope head first (decode validates it before any payload byte),
 * then the file, read into two pooled buffers in turn — the next piece is read while the previous
 * one is being written to the socket — with the CRC-32 updated as each piece passes, then the
 * 4-byte CRC trailer. Disk read, checksum and wire overlap; the bytes are touched once.
 * (Chunked, overlapped sending is what Mooncake's and NIXL's transfer engines do for KV blocks;
 * here the unit is a file and a TCP socket.)
 *
 * The file is read with synchronous calls: the state directory is tmpfs (/dev/shm), where a
 * 1 MiB read is a memory copy of well under a millisecond, while each asynchronous fs call is a
 * round trip through libuv's thread pool — measured on this 2-core machine under load at several
 * ms each, a fixed cost that dominated small handoffs. The socket write of one piece still
 * overlaps the read of the next (the kernel sends while we read).
 */
import { closeSync, fstatSync, openSync, readSync } from 'node:fs';
import type { PeerConn, SendChunksOptions } from '../channel.js';
import { envelopeTrailer, ENVELOPE_TRAILER_BYTES } from '../envelope.js';
import { KvError, type RoomId } from '../types.js';
import { Crc32 } from './checksum.js';
import type { BufferPool } from './pool.js';

/** Options of `sendStateFile`; chunkBytes, signal, stallMs, onProgress as PeerConn.sendChunks. */
export interface SendStateFileOptions extends Omit<SendChunksOptions, 'offset'> {
  /** Read buffers (two per transfer, given back at the end). Their size is the read piece size. */
  pool: BufferPool;
}

/** Bytes on the wire for a payload of `payloadBytes` behind `head` (what kv_begin announces). */
export function wireBytes(head: Buffer, payloadBytes: number): number {
  return head.length + payloadBytes + ENVELOPE_TRAILER_BYTES;
}

/**
 * Stream `head`, the file at `path` (exactly `payloadBytes` bytes) and the CRC trailer as room
 * `room`'s chunk frames, offsets 0 .. wireBytes(head, payloadBytes). Resolves once everything is
 * flushed to the kernel. The file is read only; the caller owns (and deletes) it.
 * @throws KvError as PeerConn.sendChunks ('PEER_LOST', 'ABORTED', 'TIMEOUT'); KvError('BAD_STATE')
 *   when the file's size is not `payloadBytes`; fs errors from reading it.
 */
export async function sendStateFile(conn: PeerConn, room: RoomId, path: string, head: Buffer, payloadBytes: number, opts: SendStateFileOptions): Promise<void> {
  const send = (data: Buffer, offset: number) => conn.sendChunks(room, data, { chunkBytes: opts.chunkBytes, signal: opts.signal, stallMs: opts.stallMs, onProgress: opts.onProgress, offset });
  await send(head, 0);
  const fd = openSync(path, 'r');
  const bufs = [opts.pool.acquire(), opts.pool.acquire()];
  try {
    const crc = new Crc32();
    const piece = bufs[0]!.length;
    const readAt = (i: number, pos: number): Buffer => {
      const want = Math.min(piece, payloadBytes - pos);
      let bytesRead = 0;
      while (bytesRead < want) {
        const n = readSync(fd, bufs[i]!, bytesRead, want - bytesRead, pos + bytesRead);
        if (n === 0) break;
        bytesRead += n;
      }
      if (bytesRead !== want) throw new KvError('BAD_STATE', `state file ${path} ended at byte ${pos + bytesRead}, expected ${payloadBytes}`);
      return bufs[i]!.subarray(0, want);
    };
    let pos = 0;
    let i = 0;
    let cur = payloadBytes > 0 ? readAt(0, 0) : undefined;
    while (cur) {
      crc.update(cur);
      const at = pos;
      pos += cur.length;
      // the kernel sends piece i while piece i^1 is read from the file
      const sent = send(cur, head.length + at);
      let next: Buffer | undefined;
      try {
        next = pos < payloadBytes ? readAt(i ^ 1, pos) : undefined;
      } catch (e) {
        await sent.catch(() => {});
        throw e;
      }
      await sent;
      cur = next;
      i ^= 1;
    }
    const { size } = fstatSync(fd);
    if (size !== payloadBytes) throw new KvError('BAD_STATE', `state file ${path} is ${size} bytes, expected ${payloadBytes}`);
    await send(envelopeTrailer(crc.value), head.length + payloadBytes);
  } finally {
    for (const b of bufs) opts.pool.release(b);
    closeSync(fd);
  }
}
