import { closeSync, ftruncateSync, openSync, rmSync, statSync } from 'node:fs';
import { join } from 'node:path';
/**
 * A bounded pool of equal-sized transfer buffers, reused across transfers. Fresh buffers cost
 * first-touch page faults (measured here at 1.3 GB/s against 15.8 GB/s into touched memory,
 * BENCHMARKS.md §1), so the handoff's read and write buffers are taken from here and given back.
 * The pool keeps at most `maxBuffers`; beyond that `acquire` hands out a transient buffer that
 * `release` simply drops, so a burst of transfers never waits on the pool and memory held
 * between bursts stays bounded (maxBuffers × bufferBytes).
 */
export class BufferPool {
  private readonly free: Buffer[] = [];
  /** Buffers handed out and not yet released. */
  inUse = 0;
  /** Buffers allocated over the pool's life (pooled and transient). */
  allocated = 0;
  /** Acquires served from a released buffer. */
  reused = 0;
  /** Buffers that exist now (handed out or kept). */
  private live = 0;

  /**
   * @param bufferBytes size of every buffer, bytes (≥ 1).
   * @param maxBuffers most buffers kept for reuse (≥ 0).
   * @throws RangeError on bad sizes.
   */
  constructor(
    readonly bufferBytes: number,
    readonly maxBuffers: number,
  ) {
    if (!Number.isSafeInteger(bufferBytes) || bufferBytes < 1) throw new RangeError(`bufferBytes must be a positive integer, got ${bufferBytes}`);
    if (!Number.isSafeInteger(maxBuffers) || maxBuffers < 0) throw new RangeError(`maxBuffers must be a non-negative integer, got ${maxBuffers}`);
  }

  /** A buffer of `bufferBytes` (contents undefined). Give it back with `release` once no I/O uses it. */
  acquire(): Buffer {
    this.inUse++;
    const b = this.free.pop();
    if (b) {
      this.reused++;
      return b;
    }
    this.allocated++;
    this.live++;
    return Buffer.allocUnsafeSlow(this.bufferBytes);
  }

  /** Like `acquire`, but undefined instead of a buffer beyond `maxBuffers` live ones (never allocates past the bound). */
  tryAcquire(): Buffer | undefined {
    if (this.free.length === 0 && this.live >= this.maxBuffers) return undefined;
    return this.acquire();
  }

  /** Return a buffer from `acquire` (kept when the pool has room, else dropped). */
  release(b: Buffer): void {
    this.inUse--;
    if (b.length === this.bufferBytes && this.free.length < this.maxBuffers) this.free.push(b);
    else this.live--;
  }
}

/** Size of one transfer buffer (read piece on prefill, file write on decode), bytes. */
export const TRANSFER_BUFFER_BYTES = 1 << 20;
/** Transfer buffers a worker keeps for reuse (2 per concurrent send; 1 per concurrent receive). */
export const TRANSFER_POOL_BUFFERS = 8;

/** One destination file handed out by a FilePool: its path and an fd open for writing. */
export interface PooledFile {
  path: string;
  /** Open read-write, positioned at 0, already truncated/extended to the asked size. */
  fd: number;
  /** True when the file was a recycled spare (its pages already allocated). */
  reused: boolean;
}

/** Options of a FilePool. */
export interface FilePoolOptions {
  /** Folder of the files (the state directory, tmpfs). */
  dir: string;
  /** File name prefix: `<prefix>-<n>.ggsq`; must make a name the state-file sweep knows (`pdserve-<kind>-<pid>`). */
  prefix: string;
  /** Most spare files kept (≥ 0). */
  maxFiles: number;
  /** Most bytes of spare files kept (their sizes summed, ≥ 0). */
  maxBytes: number;
}

/**
 * A bounded pool of recycled destination files for received states. Writing into a NEW tmpfs
 * file makes the kernel allocate and zero every page on first write (measured here: 1.9 GB/s
 * for 1 MiB writes into a new /dev/shm file against 6.6 GB/s into one whose pages exist), so
 * decode keeps a few spare state files after their load and overwrites them instead.
 *
 * Ownership: a spare belongs to the pool (deleted by `close` or when a release would exceed the
 * bounds); `acquire` hands one out (or creates one) and from then on its holder owns it until it
 * gives it back with `release` (kept as a spare, or deleted when over the bounds or closed) or
 * deletes it itself. The pool never touches a handed-out file, so a file has exactly one owner
 * at a time and is deleted exactly once. File calls are synchronous (tmpfs: memory operations).
 */
export class FilePool {
  private readonly spares: { path: string; bytes: number }[] = [];
  private spareBytes = 0;
  private seq = 0;
  private closed = false;
  /** Acquires served by a spare. */
  reused = 0;
  /** Files created. */
  created = 0;
  /** Files deleted by the pool (over the bounds, or at close). */
  deleted = 0;

  /** @throws RangeError on bad bounds. */
  constructor(private readonly o: FilePoolOptions) {
    if (!Number.isSafeInteger(o.maxFiles) || o.maxFiles < 0) throw new RangeError(`maxFiles must be a non-negative integer, got ${o.maxFiles}`);
    if (!Number.isSafeInteger(o.maxBytes) || o.maxBytes < 0) throw new RangeError(`maxBytes must be a non-negative integer, got ${o.maxBytes}`);
  }

  /** Spare files kept now, and their bytes. */
  get spare(): { files: number; bytes: number } {
    return { files: this.spares.length, bytes: this.spareBytes };
  }

  /**
   * A file of exactly `bytes` bytes (contents undefined) open read-write at position 0: a spare
   * of about that size (see `choose`) or a new one.
   * @throws fs errors (the file, if any was created, is deleted first).
   */
  acquire(bytes: number): PooledFile {
    const pick = this.closed ? -1 : this.choose(bytes);
    if (pick >= 0) {
      const [s] = this.spares.splice(pick, 1);
      this.spareBytes -= s!.bytes;
      let fd: number | undefined;
      try {
        fd = openSync(s!.path, 'r+');
        if (s!.bytes !== bytes) ftruncateSync(fd, bytes);
        this.reused++;
        return { path: s!.path, fd, reused: true };
      } catch {
        if (fd !== undefined) closeSync(fd);
        this.unlink(s!.path); // a spare we cannot reuse: gone, make a new one
      }
    }
    const path = join(this.o.dir, `${this.o.prefix}-${++this.seq}.ggsq`);
    const fd = openSync(path, 'w+');
    try {
      ftruncateSync(fd, bytes);
    } catch (e) {
      closeSync(fd);
      this.unlink(path);
      throw e;
    }
    this.created++;
    return { path, fd, reused: false };
  }

  /**
   * The spare to reuse for `bytes`, or -1 for a new file. Cutting a file frees its pages and
   * growing one allocates new ones, both costing about what writing them does, so: the smallest
   * spare that holds `bytes` if it is at most twice that; else the largest smaller one (grown);
   * else none (a much larger spare stays for a large state instead of being cut down).
   */
  private choose(bytes: number): number {
    let fit = -1;
    let under = -1;
    this.spares.forEach((s, i) => {
      if (s.bytes >= bytes) {
        if (fit < 0 || s.bytes < this.spares[fit]!.bytes) fit = i;
      } else if (under < 0 || s.bytes > this.spares[under]!.bytes) under = i;
    });
    if (fit >= 0 && this.spares[fit]!.bytes <= 2 * bytes) return fit;
    return under;
  }

  /**
   * Give back a file from `acquire` (closed by the caller, no I/O on it any more): kept as a
   * spare if the bounds allow, else deleted. After `close`, always deleted. Never throws.
   */
  release(path: string): void {
    let bytes = -1;
    try {
      bytes = statSync(path).size;
    } catch {
      return; // already gone
    }
    if (this.closed || this.spares.length + 1 > this.o.maxFiles || this.spareBytes + bytes > this.o.maxBytes) {
      this.unlink(path);
      return;
    }
    this.spares.push({ path, bytes });
    this.spareBytes += bytes;
  }

  /** Delete every spare; later releases delete their file. Idempotent; never throws. */
  close(): void {
    this.closed = true;
    for (const s of this.spares.splice(0)) this.unlink(s.path);
    this.spareBytes = 0;
  }

  private unlink(path: string): void {
    try {
      rmSync(path, { force: true });
      this.deleted++;
    } catch {
      // tmpfs unlink of our own file: nothing to do about a failure
    }
  }
}

/** Spare received-state files decode keeps (FilePool.maxFiles). */
export const RECV_SPARE_FILES = 4;
/** Most bytes of spare received-state files decode keeps (FilePool.maxBytes), 256 MiB. */
export const RECV_SPARE_BYTES = 256 * 1024 * 1024;
