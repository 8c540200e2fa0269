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
