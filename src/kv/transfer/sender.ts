/**
 * Prefill's side of the pipelined KV handoff: the saved state file goes into the socket in
 * pieces, never read whole. Envelope head first (decode validates it before any payload byte),
 * then the file, read into two pooled buffers in turn — the next piece is read while the previous
 * one is being written to the socket — with the CRC-32 updated as each piece passes, then the
 * 4-byte CRC trailer. Disk read, checksum and wire overlap; the bytes are touched once.
 * (Chunked, overlapped sending is what Mooncake's and NIXL's transfer engines do for KV blocks;
 * here the unit is a file and a TCP socket.)
 */
import { open } from 'node:fs/promises';
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
  const fh = await open(path, 'r');
  const bufs = [opts.pool.acquire(), opts.pool.acquire()];
  try {
    const crc = new Crc32();
    const piece = bufs[0]!.length;
    const readAt = async (i: number, pos: number): Promise<Buffer> => {
      const want = Math.min(piece, payloadBytes - pos);
      const { bytesRead } = await fh.read(bufs[i]!, 0, want, pos);
      if (bytesRead !== want) throw new KvError('BAD_STATE', `state file ${path} ended at byte ${pos + bytesRead}, expected ${payloadBytes}`);
      return bufs[i]!.subarray(0, want);
    };
    let pos = 0;
    let i = 0;
    let cur = payloadBytes > 0 ? await readAt(0, 0) : undefined;
    while (cur) {
      crc.update(cur);
      const at = pos;
      pos += cur.length;
      // the socket takes piece i while piece i^1 is read from the file
      // (allSettled: a buffer goes back to the pool only when no read is still filling it)
      const [sent, read] = await Promise.allSettled([send(cur, head.length + at), pos < payloadBytes ? readAt(i ^ 1, pos) : Promise.resolve(undefined)]);
      if (sent.status === 'rejected') throw sent.reason;
      if (read.status === 'rejected') throw read.reason;
      cur = read.value;
      i ^= 1;
    }
    const { size } = await fh.stat();
    if (size !== payloadBytes) throw new KvError('BAD_STATE', `state file ${path} is ${size} bytes, expected ${payloadBytes}`);
    await send(envelopeTrailer(crc.value), head.length + payloadBytes);
  } finally {
    for (const b of bufs) opts.pool.release(b);
    await fh.close().catch(() => {});
  }
}
