/**
 * Entry of the KV I/O thread (see ./io-thread.ts): the file reads, file writes and CRC-32 of the
 * handoff's data path, off the worker's event loop. The thread shares one SharedArrayBuffer of
 * `slots × slotBytes` with the main thread and works on file descriptors the main thread opened
 * (descriptors belong to the process). Jobs come in order and are answered in order:
 *   {s, op: 'read', fd, slot, len, pos, min}: read up to `len` bytes at file offset `pos` into
 *     the slot (looping over short reads); if at least `min` bytes came, they extend stream `s`'s
 *     running CRC-32 → {s, slot, got, crc}.
 *   {s, op: 'write', fd, slot, len, pos}: extend stream `s`'s CRC-32 with the slot's first `len`
 *     bytes, write them at file offset `pos` → {s, slot, got: len, crc}.
 *   {s, op: 'drop'}: forget stream `s` (no answer).
 * Once it listens, the thread says {ready: true}.
 * An fs error answers {s, slot, error, code}. TEST-ONLY: `crashAfterJobs` (> 0) makes the thread
 * throw on that job, uncaught, so the thread dies as a crashing one would.
 */
import { readSync, writeSync } from 'node:fs';
import { parentPort, workerData } from 'node:worker_threads';
import { Crc32 } from './checksum.js';
import { InternalError } from '../../base/errors.js';

/** A job of the I/O thread (see the module doc). */
export type IoJob = { s: number; op: 'read'; fd: number; slot: number; len: number; pos: number; min: number } | { s: number; op: 'write'; fd: number; slot: number; len: number; pos: number } | { s: number; op: 'drop' };
/** The thread's answer to a read or write job. */
export type IoReply = { s: number; slot: number; got: number; crc: number } | { s: number; slot: number; error: string; code?: string };

const port = parentPort;
if (port) {
  const { sab, slotBytes, crashAfterJobs } = workerData as { sab: SharedArrayBuffer; slotBytes: number; crashAfterJobs?: number };
  const mem = Buffer.from(sab);
  const crcs = new Map<number, Crc32>();
  let jobs = 0;
  port.on('message', (j: IoJob) => {
    if (crashAfterJobs && ++jobs >= crashAfterJobs) throw new InternalError(`kv I/O thread: test crash at job ${jobs}`);
    if (j.op === 'drop') return void crcs.delete(j.s);
    const at = j.slot * slotBytes;
    try {
      let crc = crcs.get(j.s);
      if (!crc) crcs.set(j.s, (crc = new Crc32()));
      if (j.op === 'read') {
        let got = 0;
        while (got < j.len) {
          const n = readSync(j.fd, mem, at + got, j.len - got, j.pos + got);
          if (n === 0) break;
          got += n;
        }
        if (got >= j.min) crc.update(mem.subarray(at, at + got));
        port.postMessage({ s: j.s, slot: j.slot, got, crc: crc.value >>> 0 } satisfies IoReply);
      } else {
        const piece = mem.subarray(at, at + j.len);
        crc.update(piece);
        let off = 0;
        while (off < j.len) off += writeSync(j.fd, piece, off, j.len - off, j.pos + off);
        port.postMessage({ s: j.s, slot: j.slot, got: j.len, crc: crc.value >>> 0 } satisfies IoReply);
      }
    } catch (e) {
      port.postMessage({ s: j.s, slot: j.slot, error: (e as Error).message ?? String(e), code: (e as NodeJS.ErrnoException).code } satisfies IoReply);
    }
  });
  port.postMessage({ ready: true });
}
