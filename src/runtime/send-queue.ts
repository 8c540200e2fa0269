/**
 * Stalled and too-slow readers of a stream. A client that stops reading does not make Node's
 * `write` fail: the kernel takes the bytes into the connection's send queue (its buffer grows to
 * megabytes while the peer's window is closed), so a response can "finish" into a queue nobody
 * reads, its room held all the while. This module watches each streaming client's queue — the
 * kernel's (Linux: `tx_queue` of /proc/net/tcp and tcp6, by port pair) plus Node's own buffer
 * (`writableLength`) — and cuts a client that breaks either rule:
 *
 * | rule | flag (router, colocated) | default | reason |
 * |---|---|---|---|
 * | every byte written to the client is delivered (acknowledged by its kernel) within the write deadline of its write | `--client-write-deadline-ms` | 30000 | `stalled` (a reader that stopped, or reads 1 byte/s) |
 * | at most this many bytes queued for one client | `--client-max-buffered-bytes` | 4M | `over_buffer` |
 *
 * Cutting = destroying the connection: the request's rooms are aborted as for a client that left,
 * and the cut is counted in `pdserve_client_cut_total{reason}`. Without /proc (not Linux) only
 * Node's buffer is seen: a reader stalled behind a full kernel queue is still caught by the
 * deadline once Node's buffer stops draining. A queue is sampled every `periodMs` (a quarter of
 * the deadline, 1 s at most) while any stream is watched, with one read of the two files.
 *
 * The deadline is judged per byte (delivered = written − queued), not on an empty queue: a healthy
 * reader across a WAN always has a round trip's worth of unacknowledged bytes queued while the
 * stream runs, so "the queue reaches 0" would cut it, while "what was written a deadline ago has
 * been delivered" holds for it and fails for a stopped or 1 byte/s reader.
 */
import { readFile } from 'node:fs/promises';
import type { Socket } from 'node:net';
import client from 'prom-client';
import { systemClock } from '../base/clock.js';

/** The limits of one server's streaming clients. */
export interface SendQueueLimits {
  /** What is queued for a client must reach 0 within this many ms. */
  deadlineMs: number;
  /** Most bytes queued for one client (kernel + Node). */
  maxBufferedBytes: number;
}

export const DEFAULT_SEND_QUEUE_LIMITS: SendQueueLimits = { deadlineMs: 30_000, maxBufferedBytes: 4 << 20 };

/**
 * `--client-max-buffered-bytes`'s value: bytes, or with a binary suffix (K, M, G), 64K to 1G.
 * @throws RangeError outside that or when it is not a size.
 */
export function parseBufferedBytes(v: string): number {
  const m = /^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*$/i.exec(v);
  if (!m) throw new RangeError(`not a byte size (e.g. 4M, 1048576): ${v}`);
  const n = Math.round(Number(m[1]) * { '': 1, k: 1024, m: 1024 ** 2, g: 1024 ** 3 }[m[2]!.toLowerCase() as '' | 'k' | 'm' | 'g']);
  if (n < 64 * 1024 || n > 1024 ** 3) throw new RangeError(`must be between 64K and 1G: ${v}`);
  return n;
}

/** Why a client was cut. */
export type CutReason = 'stalled' | 'over_buffer';

/**
 * `tx_queue` of every TCP socket in a /proc/net/tcp or tcp6 text, keyed `localPort:remotePort`
 * (decimal; the larger queue when two sockets share a port pair).
 */
export function parseTxQueues(text: string, into: Map<string, number> = new Map()): Map<string, number> {
  for (const line of text.split('\n')) {
    // "  1: 0100007F:9BB1 0100007F:96EA 01 00000000:00000000 …"
    const m = /^\s*\d+:\s+[0-9A-Fa-f]+:([0-9A-Fa-f]{4})\s+[0-9A-Fa-f]+:([0-9A-Fa-f]{4})\s+[0-9A-Fa-f]{2}\s+([0-9A-Fa-f]+):/.exec(line);
    if (!m) continue;
    const key = `${parseInt(m[1]!, 16)}:${parseInt(m[2]!, 16)}`;
    const q = parseInt(m[3]!, 16);
    if (q > (into.get(key) ?? -1)) into.set(key, q);
  }
  return into;
}

/**
 * One watched client: marks `{at, written}` (ms, bytes written so far) taken at samples while
 * bytes were still undelivered, oldest first; a mark goes once its bytes are delivered. At most
 * one mark per sample, and a mark older than the deadline cuts the client, so there are at most
 * deadline ÷ sample period + 1 marks.
 */
export interface QueueState {
  marks: { at: number; written: number }[];
}

/** A fresh QueueState. */
export function newQueueState(): QueueState {
  return { marks: [] };
}

/**
 * The verdict on a client to which `written` bytes were written in all, `queued` of them not yet
 * delivered, at `now` (ms); `st` updated. Cut when over the byte bound, or when bytes written at
 * least a deadline ago are still undelivered.
 */
export function judgeQueue(st: QueueState, written: number, queued: number, now: number, limits: SendQueueLimits): CutReason | undefined {
  if (queued > limits.maxBufferedBytes) return 'over_buffer';
  const delivered = written - Math.max(0, queued);
  while (st.marks.length > 0 && st.marks[0]!.written <= delivered) st.marks.shift();
  if (st.marks.length > 0 && now - st.marks[0]!.at >= limits.deadlineMs) return 'stalled';
  if (written > delivered && written > (st.marks.at(-1)?.written ?? -1)) st.marks.push({ at: now, written });
  return undefined;
}

interface Watched {
  socket: Socket;
  st: QueueState;
  cut(reason: CutReason, detail: string): void;
}

/** The send-queue watch of one server process (see the module doc). */
export class SendQueueWatch {
  private readonly watched = new Set<Watched>();
  private timer: NodeJS.Timeout | undefined;
  private readonly cuts: client.Counter<'reason'> | undefined;
  private procOk = true;

  constructor(
    readonly limits: SendQueueLimits,
    o: { registry?: client.Registry; now?: () => number; readQueues?: () => Promise<Map<string, number> | undefined> } = {},
  ) {
    this.now = o.now ?? (() => systemClock.nowMs());
    this.readQueues = o.readQueues ?? (() => this.readProcShared());
    this.cuts = o.registry ? new client.Counter({ name: 'pdserve_client_cut_total', help: 'Streaming clients cut for reading too slowly: stalled (their queue did not drain within --client-write-deadline-ms) or over_buffer (over --client-max-buffered-bytes queued)', labelNames: ['reason'], registers: [o.registry] }) : undefined;
    for (const r of ['stalled', 'over_buffer'] as const) this.cuts?.inc({ reason: r }, 0);
  }

  private readonly now: () => number;
  private readonly readQueues: () => Promise<Map<string, number> | undefined>;

  /** How often queues are sampled, ms. */
  get periodMs(): number {
    return Math.max(50, Math.min(1000, Math.floor(this.limits.deadlineMs / 4)));
  }

  /**
   * Watch `socket` (a streaming response's) until the returned function is called or the socket
   * closes; `cut` is called once when it breaks a rule (the caller destroys the connection).
   */
  watch(socket: Socket, cut: (reason: CutReason, detail: string) => void): () => void {
    const w: Watched = { socket, st: newQueueState(), cut };
    this.watched.add(w);
    const stop = () => {
      this.watched.delete(w);
      socket.off('close', stop);
      if (this.watched.size === 0 && this.timer) {
        clearTimeout(this.timer);
        this.timer = undefined;
      }
    };
    socket.once('close', stop);
    this.schedule();
    return stop;
  }

  /** Bytes queued for `socket` now (kernel + Node). Never rejects. */
  async queued(socket: Socket): Promise<number> {
    const kernel = await this.readQueues().catch(() => undefined);
    const k = kernel && socket.localPort !== undefined && socket.remotePort !== undefined ? (kernel.get(`${socket.localPort}:${socket.remotePort}`) ?? 0) : 0;
    return k + socket.writableLength;
  }

  /** Clients watched now (tests, /debug). */
  get size(): number {
    return this.watched.size;
  }

  private schedule(): void {
    if (this.timer || this.watched.size === 0) return;
    this.timer = setTimeout(() => {
      this.timer = undefined;
      void this.sample().finally(() => this.schedule());
    }, this.periodMs);
    this.timer.unref();
  }

  /** One sample of every watched client's queue. */
  async sample(): Promise<void> {
    const kernel = await this.readQueues().catch(() => undefined);
    const now = this.now();
    for (const w of [...this.watched]) {
      const s = w.socket;
      if (s.destroyed) continue;
      const k = kernel && s.localPort !== undefined && s.remotePort !== undefined ? (kernel.get(`${s.localPort}:${s.remotePort}`) ?? 0) : 0;
      const queued = k + s.writableLength;
      const reason = judgeQueue(w.st, s.bytesWritten, queued, now, this.limits);
      if (!reason) continue;
      this.watched.delete(w);
      this.cuts?.inc({ reason });
      const detail = reason === 'over_buffer' ? `${queued} bytes queued for the client, over --client-max-buffered-bytes ${this.limits.maxBufferedBytes}` : `bytes written to the client ${Math.round(now - (w.st.marks[0]?.at ?? now))} ms ago are still undelivered, ${queued} bytes queued (--client-write-deadline-ms ${this.limits.deadlineMs})`;
      w.cut(reason, detail);
    }
  }

  private shared: { at: number; p: Promise<Map<string, number> | undefined> } | undefined;

  /** readProc, one read shared by the callers of the same 50 ms (every stream's end asks). */
  private readProcShared(): Promise<Map<string, number> | undefined> {
    const now = this.now();
    if (!this.shared || now - this.shared.at > 50) this.shared = { at: now, p: this.readProc() };
    return this.shared.p;
  }

  /** tx_queue by port pair from /proc/net/tcp and tcp6, or undefined where there is no /proc. */
  private async readProc(): Promise<Map<string, number> | undefined> {
    if (!this.procOk) return undefined;
    const m = new Map<string, number>();
    let any = false;
    for (const f of ['/proc/net/tcp', '/proc/net/tcp6']) {
      try {
        parseTxQueues(await readFile(f, 'utf8'), m);
        any = true;
      } catch {
        /* absent (no IPv6, not Linux) */
      }
    }
    if (!any) this.procOk = false;
    return any ? m : undefined;
  }
}
