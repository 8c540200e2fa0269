/**
 * The handoff's data path off the event loop: one worker thread per process does the state
 * file's reads and CRC-32 on prefill and the CRC-32 and file writes on decode (./io-worker.ts;
 * decode's writes into a tmpfs state directory stay inline, see kvIoForReceives),
 * on a bounded pool of slots of one SharedArrayBuffer, so the main thread only hands slots to
 * the socket (prefill) or copies socket reads into them (decode) — a slow disk or a gigabyte
 * state never holds up heartbeats, HTTP or other rooms. (The same split as libuv's file I/O
 * thread pool, without its per-call round trip for each small file call: one message per
 * 256 KiB slot, the bytes never copied between threads.)
 *
 * Bounds: `slots` slots of `slotBytes` in all (default 64 × 256 KiB = 16 MiB), handed out in
 * fixed reservations per transfer (`reserve`: a transfer that gets none does its I/O inline, on
 * the event loop, as does one below `minBytes`, IO_THREAD_MIN_BYTES by default: `wants`). Failure: a thread that dies (an uncaught error, a crash) fails
 * every stream it held (`IoStream.failed`, the stream's `onFail` once) and is started again, at
 * most `maxStarts` times per process. Transfers use the thread only once it said it is ready
 * (`available`; a start takes tens of ms, longer from source under tsx): before that, after the
 * last start, or while a restart runs, they do their I/O inline. A job answered with an fs error
 * fails its stream only.
 *
 * Descriptors stay the main thread's: a stream never closes one, and its owner closes it only
 * once the stream is idle (`whenIdle`: no job of it left in the thread), so a descriptor number
 * is never reused under a job that still reads or writes through it.
 */
import { statfsSync } from 'node:fs';
import { Worker } from 'node:worker_threads';
import { KvError } from '../types.js';
import type { IoJob, IoReply } from './io-worker.js';

/** Bytes of one slot (a read piece on prefill, a write on decode). */
export const IO_SLOT_BYTES = 256 * 1024;
/** Slots of the process's pool (16 MiB with IO_SLOT_BYTES). */
export const IO_SLOTS = 64;
/** Slots one transfer reserves (2 MiB in flight between the thread and the socket). */
export const IO_SLOTS_PER_TRANSFER = 8;

/**
 * Smallest transfer (payload bytes) that goes through the thread (8 MiB); smaller ones do their
 * file I/O and CRC-32 inline, in the same 256 KiB pieces. Below it the thread's hand-offs (a
 * wake-up of the thread per piece and of the event loop per answer) cost more than the work they
 * move; larger states keep the thread because inline their reads and CRCs hold the event loop
 * for tens of ms (BENCHMARKS.md §1).
 */
export const IO_THREAD_MIN_BYTES = 8 * 1024 * 1024;

/** Options of a KvIo. */
export interface KvIoOptions {
  /** Smallest transfer, payload bytes, that `wants` the thread for (default IO_THREAD_MIN_BYTES). */
  minBytes?: number;
  /** Bytes of one slot (default IO_SLOT_BYTES). */
  slotBytes?: number;
  /** Slots in all (default IO_SLOTS). */
  slots?: number;
  /** Most thread starts in this process, restarts after a death included (default 3). */
  maxStarts?: number;
  /** Longest wait for a started thread to say it is ready, ms (default 10 000): then it is stopped and counts as a failed start. */
  startTimeoutMs?: number;
  /** TEST-ONLY: the next thread started dies (an uncaught throw) on its Nth job (default: env PDSERVE_TEST_KV_IO_CRASH_AFTER, else never); later starts live. */
  crashAfterJobs?: number;
  log?: { warn(o: object, m: string): void };
}

/**
 * One transfer's jobs on the thread: its running CRC-32 (as the thread reported it with the
 * last answer) and its failure. Answers arrive in the order the jobs were posted.
 */
export class IoStream {
  /** CRC-32 of every byte the thread read (with at least `min`) or wrote for this stream, in order (u32). */
  crc = 0;
  /** Jobs posted and not answered. */
  pending = 0;
  /** Set once: an fs error of a job, or the thread's death. */
  failed: Error | undefined;
  /** Called for each answered job: its slot and the bytes read / written. */
  onReply: (slot: number, got: number) => void = () => {};
  /** Called once, when the stream fails (`failed` is set). */
  onFail: (err: Error) => void = () => {};
  private idle: (() => void)[] = [];

  /** @internal */
  constructor(
    private readonly io: KvIo,
    readonly id: number,
  ) {}

  /** Read up to `len` bytes of `fd` at `pos` into `slot`; the CRC is extended if at least `min` (default `len`) came. */
  read(fd: number, slot: number, len: number, pos: number, min = len): void {
    this.post({ s: this.id, op: 'read', fd, slot, len, pos, min });
  }

  /** CRC-32 over the slot's first `len` bytes, then write them to `fd` at `pos`. */
  write(fd: number, slot: number, len: number, pos: number): void {
    this.post({ s: this.id, op: 'write', fd, slot, len, pos });
  }

  /** `fn` once no job of this stream is in the thread (at once when none is). */
  whenIdle(fn: () => void): void {
    if (this.pending === 0) fn();
    else this.idle.push(fn);
  }

  /** No more jobs: the thread forgets the stream's CRC (a no-op after a failure). Idempotent. */
  end(): void {
    this.io.endStream(this);
  }

  private post(j: IoJob): void {
    if (this.failed) throw this.failed;
    this.pending++;
    this.io.post(j);
  }

  /** @internal */
  answered(r: IoReply): void {
    this.pending--;
    if ('error' in r) this.fail(new KvError('BAD_STATE', `state file I/O failed: ${r.error}`));
    else {
      this.crc = r.crc;
      if (!this.failed) this.onReply(r.slot, r.got);
    }
    if (this.pending === 0) this.drained();
  }

  /** @internal The thread is gone: nothing of ours is left in it. */
  lost(err: Error): void {
    this.pending = 0;
    this.fail(err);
    this.drained();
  }

  private fail(err: Error): void {
    if (this.failed) return;
    this.failed = err;
    this.onFail(err);
  }

  private drained(): void {
    for (const fn of this.idle.splice(0)) fn();
  }
}

/**
 * The process's KV I/O thread and its slot pool. `reserve` slots, write into / read from them
 * through `view`, `stream()` for a transfer's jobs, `unreserve` the slots once nothing uses them.
 */
export class KvIo {
  readonly slotBytes: number;
  readonly slots: number;
  /** The shared memory, as a Buffer (slot i = bytes i·slotBytes ..). */
  readonly mem: Buffer;
  private readonly sab: SharedArrayBuffer;
  private readonly free: number[] = [];
  private worker: Worker | undefined;
  /** The running thread said it is ready. */
  private ready = false;
  private starting: Promise<boolean> | undefined;
  private starts = 0;
  private readonly maxStarts: number;
  /** TEST-ONLY: KvIoOptions.crashAfterJobs for the next thread start (consumed by it). */
  crashAfterJobs: number | undefined;
  private readonly streams = new Map<number, IoStream>();
  private seq = 0;
  private closed = false;
  /** Threads that died (counted; each failed the streams it held). */
  deaths = 0;
  /** Jobs handed to the thread over the pool's life. */
  jobs = 0;

  /** @throws RangeError on bad sizes. */
  constructor(private readonly o: KvIoOptions = {}) {
    this.slotBytes = o.slotBytes ?? IO_SLOT_BYTES;
    this.slots = o.slots ?? IO_SLOTS;
    if (!Number.isSafeInteger(this.slotBytes) || this.slotBytes < 1) throw new RangeError(`slotBytes must be a positive integer, got ${this.slotBytes}`);
    if (!Number.isSafeInteger(this.slots) || this.slots < 1) throw new RangeError(`slots must be a positive integer, got ${this.slots}`);
    this.maxStarts = o.maxStarts ?? 3;
    const env = Number(process.env.PDSERVE_TEST_KV_IO_CRASH_AFTER);
    this.crashAfterJobs = o.crashAfterJobs ?? (Number.isSafeInteger(env) && env > 0 ? env : undefined);
    this.sab = new SharedArrayBuffer(this.slotBytes * this.slots);
    this.mem = Buffer.from(this.sab);
    for (let i = this.slots - 1; i >= 0; i--) this.free.push(i);
  }

  /**
   * True while a thread is ready for streams. False before it is (the first call starts it),
   * while a restart runs, after the last start, once closed: do the I/O inline.
   */
  get available(): boolean {
    if (this.closed) return false;
    if (!this.ready) void this.start();
    return this.ready;
  }

  /**
   * Start the thread unless one runs or starts; resolves true once it is ready, false when it
   * could not start (closed, out of starts, it died or timed out before it was ready). Never rejects.
   */
  start(): Promise<boolean> {
    if (this.ready) return Promise.resolve(true);
    if (this.starting) return this.starting;
    if (this.closed || this.starts >= this.maxStarts) return Promise.resolve(false);
    const p = this.launch().finally(() => {
      if (this.starting === p) this.starting = undefined;
    });
    this.starting = p;
    return p;
  }

  /** Slots not reserved now. */
  get freeSlots(): number {
    return this.free.length;
  }

  /** Smallest payload (bytes) a transfer does through the thread (KvIoOptions.minBytes). */
  get minBytes(): number {
    return this.o.minBytes ?? IO_THREAD_MIN_BYTES;
  }

  /** Whether a transfer of `payloadBytes` should use the thread: it is `available` and the transfer is at least `minBytes`. */
  wants(payloadBytes: number): boolean {
    return this.available && payloadBytes >= this.minBytes;
  }

  /** Up to `n` slots for one transfer (fewer, or none, when the pool is short). Give them back with `unreserve`. */
  reserve(n: number): number[] {
    return this.free.splice(Math.max(0, this.free.length - n));
  }

  /** Slots back to the pool: neither the thread nor a socket may still use them. */
  unreserve(slots: readonly number[]): void {
    for (const s of slots) this.free.push(s);
  }

  /** Bytes 0..len of `slot` (a view of the shared memory). */
  view(slot: number, len: number): Buffer {
    const at = slot * this.slotBytes;
    return this.mem.subarray(at, at + len);
  }

  /** The slot a view from `view` lies in, or -1 when `b` is not in this pool's memory. */
  slotOf(b: Buffer): number {
    if (b.buffer !== this.mem.buffer) return -1;
    return Math.floor((b.byteOffset - this.mem.byteOffset) / this.slotBytes);
  }

  /** A new stream on the thread, or undefined when it is not available (see `available`). */
  stream(): IoStream | undefined {
    if (!this.available || !this.worker) return undefined;
    const s = new IoStream(this, ++this.seq);
    this.streams.set(s.id, s);
    return s;
  }

  /** @internal */
  post(j: IoJob): void {
    this.jobs++;
    this.worker!.postMessage(j);
  }

  /** @internal */
  endStream(s: IoStream): void {
    if (!this.streams.has(s.id)) return;
    s.whenIdle(() => {
      if (!this.streams.delete(s.id)) return;
      if (this.worker && !s.failed) this.worker.postMessage({ s: s.id, op: 'drop' } satisfies IoJob);
    });
  }

  /** Stop the thread: what it held fails. Idempotent. */
  async close(): Promise<void> {
    this.closed = true;
    const w = this.worker;
    this.lose(w, new KvError('ABORTED', 'kv I/O thread closed'));
    if (w) await w.terminate().catch(() => {});
  }

  private launch(): Promise<boolean> {
    this.starts++;
    // The entry next to this file; from source (tests under tsx) through tsx's loader, registered in the thread.
    const entry = new URL(`./io-worker${import.meta.url.endsWith('.ts') ? '.ts' : '.js'}`, import.meta.url);
    const workerData = { sab: this.sab, slotBytes: this.slotBytes, ...(this.crashAfterJobs ? { crashAfterJobs: this.crashAfterJobs } : {}) };
    this.crashAfterJobs = undefined;
    let w: Worker;
    try {
      w = entry.pathname.endsWith('.ts')
        ? new Worker(`import('tsx/esm/api').then((t) => { t.register(); return import(${JSON.stringify(entry.href)}); })`, { eval: true, workerData })
        : new Worker(entry, { workerData });
    } catch (e) {
      this.o.log?.warn({ err: (e as Error).message }, 'kv I/O thread did not start: file I/O stays on the event loop');
      return Promise.resolve(false);
    }
    w.unref();
    this.worker = w;
    return new Promise<boolean>((resolve) => {
      const timer = setTimeout(() => {
        this.o.log?.warn({ ms: this.o.startTimeoutMs ?? 10_000 }, 'kv I/O thread not ready in time: file I/O stays on the event loop');
        this.died(w, 'not ready in time');
        void w.terminate().catch(() => {});
      }, this.o.startTimeoutMs ?? 10_000);
      timer.unref();
      const settle = (ok: boolean): void => {
        clearTimeout(timer);
        resolve(ok);
      };
      w.on('message', (r: IoReply | { ready: true }) => {
        if ('ready' in r) {
          if (this.worker !== w || this.closed) return settle(false);
          this.ready = true;
          return settle(true);
        }
        this.streams.get(r.s)?.answered(r);
      });
      w.on('error', (e) => (this.died(w, e.message), settle(false)));
      w.on('exit', (code) => (this.died(w, `exited (${code})`), settle(false)));
    });
  }

  private died(w: Worker, why: string): void {
    if (this.worker !== w) return;
    this.ready = false;
    this.deaths++;
    this.o.log?.warn({ why, starts: this.starts }, 'kv I/O thread died: its transfers fail');
    this.lose(w, new KvError('ABORTED', `kv I/O thread died: ${why}`));
  }

  /** The thread `w` is gone or going: every stream fails, nothing of theirs is in a thread any more. */
  private lose(w: Worker | undefined, err: Error): void {
    if (w && this.worker === w) {
      this.worker = undefined;
      this.ready = false;
    }
    const all = [...this.streams.values()];
    this.streams.clear();
    for (const s of all) s.lost(err);
  }
}

let shared: KvIo | undefined;

/** The process's KvIo (created on first use; its thread starts then, transfers use it once it is ready). */
export function sharedKvIo(): KvIo {
  return (shared ??= new KvIo());
}

/** statfs(2) f_type of tmpfs (linux/magic.h TMPFS_MAGIC). */
const TMPFS_MAGIC = 0x01021994;
const onTmpfs = new Map<string, boolean>();

/**
 * The KV I/O thread for a TCP receive that writes its state file into `dir` (decode's state
 * directory): none when `dir` is on tmpfs, the shared one (sharedKvIo) otherwise. On tmpfs a
 * write is a memory copy, and the thread's hand-off costs more than the work it moves: the copy of
 * each socket read into a slot and two thread messages per 256 KiB slot more than doubled a
 * receiver's CPU time per state, on cores that also run the sender, so the bytes cross slower. On a disk a
 * write may block for milliseconds: there the thread keeps it off the event loop. The answer
 * per directory is computed once (statfs); a directory that cannot be checked gets the thread.
 */
export function kvIoForReceives(dir: string): KvIo | undefined {
  let tmpfs = onTmpfs.get(dir);
  if (tmpfs === undefined) {
    try {
      tmpfs = statfsSync(dir).type === TMPFS_MAGIC;
    } catch {
      tmpfs = false;
    }
    onTmpfs.set(dir, tmpfs);
  }
  return tmpfs ? undefined : sharedKvIo();
}
