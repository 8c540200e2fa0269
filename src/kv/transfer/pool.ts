import { closeSync, ftruncateSync, openSync, rmSync, statSync, unlink } from 'node:fs';
import { join } from 'node:path';
/**
 * A bounded pool of equal-sized transfer buffers, reused across transfers. Fresh buffers cost
 * first-touch page faults (a copy into fresh memory runs several times slower than into touched
 * memory), so the handoff's read and write buffers are taken from here and given back.
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
  /**
   * Large spares: a released file that does not fit under `maxFiles` / `maxBytes` is kept apart
   * for the next state of about its size while the large spares' bytes stay at most this many
   * (the oldest go first to make room; a file larger than this is deleted), default 0: none.
   */
  maxLargeBytes?: number;
  /** A large spare is deleted once it has not been taken for this long, ms (default LARGE_SPARE_IDLE_MS). */
  largeIdleMs?: number;
}

/**
 * Deletes `path` without blocking the event loop: unlink(2) of a large tmpfs file frees its pages
 * inside the call (a long stall for a large file), so it runs on libuv's thread pool. `done` is called
 * once it finished (`ok`: the file was deleted or was already gone). Never throws.
 */
export function unlinkInBackground(path: string, done?: (ok: boolean) => void): void {
  unlink(path, (err) => done?.(!err || err.code === 'ENOENT'));
}

/**
 * A bounded pool of recycled destination files for received states. Writing into a NEW tmpfs
 * file makes the kernel allocate and zero every page on first write (slower than overwriting a
 * file whose pages exist), so
 * decode keeps a few spare state files after their load and overwrites them instead: small ones
 * within `maxFiles` / `maxBytes`, and large ones within `maxLargeBytes`, each until it has been
 * idle for `largeIdleMs`.
 *
 * Ownership: a spare belongs to the pool (deleted by `close`, when a release would exceed the
 * bounds, or when a large spare has idled or made room for a newer one); `acquire` hands one out (or creates one) and from
 * then on its holder owns it until it gives it back with `release` (kept as a spare, or deleted)
 * or deletes it itself. The pool never touches a handed-out file, so a file has exactly one owner
 * at a time and is deleted exactly once. Deletions of spares and released files run in the
 * background (unlinkInBackground: freeing a large file's pages is not done on the event loop;
 * `settled()` resolves once they are done), except `close`'s, which are synchronous (the process
 * is stopping). The other file calls are synchronous (tmpfs: memory operations).
 */
export class FilePool {
  private readonly spares: { path: string; bytes: number }[] = [];
  private spareBytes = 0;
  /** The large spares (maxLargeBytes), oldest first, each with the timer that deletes it once idle. */
  private readonly large: { path: string; bytes: number; timer: NodeJS.Timeout }[] = [];
  private largeBytes = 0;
  private seq = 0;
  private closed = false;
  /** Background deletions not finished yet, and who waits for them. */
  private deleting = 0;
  private readonly onSettled: (() => void)[] = [];
  /** Acquires served by a spare. */
  reused = 0;
  /** Files created. */
  created = 0;
  /** Files deleted by the pool (over the bounds, idle, or at close; counted when the deletion finished). */
  deleted = 0;

  /** @throws RangeError on bad bounds. */
  constructor(private readonly o: FilePoolOptions) {
    if (!Number.isSafeInteger(o.maxFiles) || o.maxFiles < 0) throw new RangeError(`maxFiles must be a non-negative integer, got ${o.maxFiles}`);
    if (!Number.isSafeInteger(o.maxBytes) || o.maxBytes < 0) throw new RangeError(`maxBytes must be a non-negative integer, got ${o.maxBytes}`);
    if (o.maxLargeBytes !== undefined && (!Number.isSafeInteger(o.maxLargeBytes) || o.maxLargeBytes < 0)) throw new RangeError(`maxLargeBytes must be a non-negative integer, got ${o.maxLargeBytes}`);
    if (o.largeIdleMs !== undefined && (!Number.isSafeInteger(o.largeIdleMs) || o.largeIdleMs < 1)) throw new RangeError(`largeIdleMs must be a positive integer, got ${o.largeIdleMs}`);
  }

  /** Spare files kept now, and their bytes (the large spares included). */
  get spare(): { files: number; bytes: number } {
    return { files: this.spares.length + this.large.length, bytes: this.spareBytes + this.largeBytes };
  }

  /** The large spares kept now: their sizes, oldest first. */
  get largeSpares(): number[] {
    return this.large.map((l) => l.bytes);
  }

  /**
   * A file of exactly `bytes` bytes (contents undefined) open read-write at position 0: a spare
   * of about that size (see `choose`) or a new one.
   * @throws fs errors (the file, if any was created, is deleted first).
   */
  acquire(bytes: number): PooledFile {
    const s = this.closed ? undefined : this.take(bytes);
    if (s) {
      let fd: number | undefined;
      try {
        fd = openSync(s.path, 'r+');
        if (s.bytes !== bytes) ftruncateSync(fd, bytes);
        this.reused++;
        return { path: s.path, fd, reused: true };
      } catch {
        if (fd !== undefined) closeSync(fd);
        this.remove(s.path); // a spare we cannot reuse: gone, make a new one
      }
    }
    const path = join(this.o.dir, `${this.o.prefix}-${++this.seq}.ggsq`);
    const fd = openSync(path, 'w+');
    try {
      ftruncateSync(fd, bytes);
    } catch (e) {
      closeSync(fd);
      this.remove(path);
      throw e;
    }
    this.created++;
    return { path, fd, reused: false };
  }

  /** The spare `choose` picks for `bytes`, out of the pool (undefined: make a new file). */
  private take(bytes: number): { path: string; bytes: number } | undefined {
    const all: Spare[] = [...this.spares.map((s) => ({ bytes: s.bytes, cut: 2 })), ...this.large.map((l) => ({ bytes: l.bytes, cut: LARGE_SPARE_CUT }))];
    const pick = choose(all, bytes);
    if (pick < 0) return undefined;
    if (pick >= this.spares.length) {
      const [l] = this.large.splice(pick - this.spares.length, 1);
      clearTimeout(l!.timer);
      this.largeBytes -= l!.bytes;
      return { path: l!.path, bytes: l!.bytes };
    }
    const [s] = this.spares.splice(pick, 1);
    this.spareBytes -= s!.bytes;
    return s;
  }

  /**
   * Give back a file from `acquire` (closed by the caller, no I/O on it any more): kept as a
   * spare if the bounds allow (else as a large spare, if it has at most maxLargeBytes: the oldest
   * large spares are deleted to make room), else deleted in the background. After `close`, always deleted. Never throws.
   */
  release(path: string): void {
    let bytes = -1;
    try {
      bytes = statSync(path).size;
    } catch {
      return; // already gone
    }
    if (!this.closed && this.spares.length + 1 <= this.o.maxFiles && this.spareBytes + bytes <= this.o.maxBytes) {
      this.spares.push({ path, bytes });
      this.spareBytes += bytes;
      return;
    }
    const maxLarge = this.o.maxLargeBytes ?? 0;
    if (!this.closed && bytes > 0 && bytes <= maxLarge) {
      while (this.largeBytes + bytes > maxLarge) this.dropLarge(0);
      const entry = { path, bytes, timer: setTimeout(() => this.dropLarge(this.large.indexOf(entry)), this.o.largeIdleMs ?? LARGE_SPARE_IDLE_MS) };
      entry.timer.unref();
      this.large.push(entry);
      this.largeBytes += bytes;
      return;
    }
    this.remove(path);
  }

  /** Delete every spare now (synchronously); later releases delete their file. Idempotent; never throws. */
  close(): void {
    this.closed = true;
    const all: { path: string; bytes: number }[] = this.spares.splice(0);
    for (const l of this.large.splice(0)) {
      clearTimeout(l.timer);
      all.push(l);
    }
    this.largeBytes = 0;
    for (const s of all) {
      try {
        rmSync(s.path, { force: true });
        this.deleted++;
      } catch {
        // tmpfs unlink of our own file: nothing to do about a failure
      }
    }
    this.spareBytes = 0;
  }

  /** Resolves once every background deletion started so far has finished (never rejects). */
  settled(): Promise<void> {
    if (this.deleting === 0) return Promise.resolve();
    return new Promise((r) => this.onSettled.push(r));
  }

  /** Large spare `i` out of the pool, deleted in the background (a no-op for -1: already taken). */
  private dropLarge(i: number): void {
    if (i < 0) return;
    const [l] = this.large.splice(i, 1);
    clearTimeout(l!.timer);
    this.largeBytes -= l!.bytes;
    this.remove(l!.path);
  }

  /** Delete a file of the pool in the background (unlinkInBackground). */
  private remove(path: string): void {
    this.deleting++;
    unlinkInBackground(path, (ok) => {
      if (ok) this.deleted++;
      if (--this.deleting === 0) for (const r of this.onSettled.splice(0)) r();
    });
  }
}

/** A spare as `choose` sees it: its size, and how much larger than a state it may be and still be cut to it. */
interface Spare {
  bytes: number;
  /** Largest spare / state ratio for which the spare is cut down to the state. */
  cut: number;
}

/**
 * A large spare is cut down to a state only when it has at most 1/16 more bytes: cutting a
 * tmpfs file frees its pages inside ftruncate(2) on the event loop; a larger one is left for a
 * state of its size.
 */
const LARGE_SPARE_CUT = 17 / 16;

/**
 * The spare of `spares` to reuse for `bytes`, or -1 for a new file. Cutting a file frees its
 * pages and growing one allocates new ones, both costing about what writing them does, so: the
 * smallest spare that holds `bytes` if it is at most `cut` times that (2 for the small spares);
 * else the largest smaller one (grown); else none (a much larger spare stays for a large state
 * instead of being cut down).
 */
function choose(spares: readonly Spare[], bytes: number): number {
  let fit = -1;
  let under = -1;
  spares.forEach((s, i) => {
    if (s.bytes >= bytes) {
      if (s.bytes <= s.cut * bytes && (fit < 0 || s.bytes < spares[fit]!.bytes)) fit = i;
    } else if (under < 0 || s.bytes > spares[under]!.bytes) under = i;
  });
  return fit >= 0 ? fit : under;
}

/** Spare received-state files decode keeps (FilePool.maxFiles). */
export const RECV_SPARE_FILES = 4;
/** Most bytes of spare received-state files decode keeps (FilePool.maxBytes), 256 MiB. */
export const RECV_SPARE_BYTES = 256 * 1024 * 1024;
/**
 * How long decode keeps a large spare (a received state over RECV_SPARE_BYTES; all of them within
 * --max-state-bytes: FilePool.maxLargeBytes) without a receive taking it, ms: 60 s. A receive
 * into a new tmpfs file writes at a fraction of the speed of one that found a spare; the price
 * is that much tmpfs (RAM) held while idle.
 */
export const LARGE_SPARE_IDLE_MS = 60_000;
