/**
 * Server-Sent Events, both directions, with no dependencies.
 *
 * - `SseWriter`: writes `data:` events to a Node `ServerResponse`, honouring backpressure: every
 *   `write` resolves once the bytes are accepted by the socket buffer (or after `drain`), and
 *   rejects with an `SseError` when the peer is gone (`SSE_CLOSED`) or does not drain within
 *   `writeTimeoutMs` (`SSE_WRITE_TIMEOUT`).
 * - `readSse`: parses an SSE byte stream (e.g. an undici response body) and yields each event's
 *   `data` payload (multi-line data joined with '\n'). Handles events split across chunks, LF /
 *   CRLF / CR line endings, comments, a leading BOM, and caps the size of one event
 *   (`SSE_EVENT_TOO_LARGE`). Fields other than `data` (`event`, `id`, `retry`) are ignored.
 */
import type { ServerResponse } from 'node:http';
import { connectionHeader } from '../runtime/drain.js';
import { PdError } from '../base/errors.js';
import type { SendQueueWatch } from '../runtime/send-queue.js';

export type SseErrorCode = 'SSE_CLOSED' | 'SSE_WRITE_TIMEOUT' | 'SSE_EVENT_TOO_LARGE' | 'SSE_SLOW_CLIENT';

/** Typed SSE error with a stable `code` (undici style). */
export class SseError extends PdError {
  constructor(
    public override readonly code: SseErrorCode,
    message: string,
  ) {
    super(code, message);
    this.name = 'SseError';
  }
}

/**
 * Format one SSE event carrying `data` (newlines inside become several `data:` lines), with an
 * `event:` line first when `event` is given (the Responses API names its events).
 */
export function formatSseEvent(data: string, event?: string): string {
  const head = event === undefined ? '' : `event: ${event.replace(/[\r\n]+/g, ' ')}\n`;
  if (!/[\r\n]/.test(data)) return `${head}data: ${data}\n\n`;
  return head + data.split(/\r\n|\r|\n/).map((l) => `data: ${l}\n`).join('') + '\n';
}

export interface SseWriterOptions {
  /** Max time (ms) one `write` may wait for the socket to drain. Default 30 000. */
  writeTimeoutMs?: number;
  /** Extra response headers sent by `open()`. */
  headers?: Record<string, string>;
  /**
   * The server's send-queue watch (../runtime/send-queue.ts): a client that does not drain what
   * is queued for it within the write deadline, or lets too much queue up, is cut — the
   * connection destroyed, every later `write` and `settled` rejecting SSE_SLOW_CLIENT.
   */
  watch?: SendQueueWatch;
}

/**
 * SSE writer over a Node `ServerResponse`. Not safe to share between requests: one writer, one
 * response. `open()` is implicit on the first `write`.
 */
export class SseWriter {
  private readonly writeTimeoutMs: number;
  private readonly extraHeaders: Record<string, string>;
  private readonly watch: SendQueueWatch | undefined;
  private unwatch: (() => void) | undefined;
  /** Why the watch cut the client (every later write rejects with it). */
  private cut: SseError | undefined;
  private onCut: ((e: SseError) => void)[] = [];

  constructor(
    private readonly res: ServerResponse,
    opts: SseWriterOptions = {},
  ) {
    this.writeTimeoutMs = opts.writeTimeoutMs ?? 30_000;
    this.extraHeaders = opts.headers ?? {};
    this.watch = opts.watch;
  }

  /** The client was cut for reading too slowly (`watch`), else undefined. */
  get cutError(): SseError | undefined {
    return this.cut;
  }

  private startWatch(): void {
    const sock = this.res.socket;
    if (!this.watch || this.unwatch || !sock) return;
    this.unwatch = this.watch.watch(sock, (_reason, detail) => {
      this.cut = new SseError('SSE_SLOW_CLIENT', `client cut: ${detail}`);
      for (const f of this.onCut.splice(0)) f(this.cut);
      this.res.destroy(this.cut);
      // after `end` the response is finished and its destroy leaves the (keep-alive) socket open
      sock.destroy();
    });
  }

  /**
   * After `end`: resolves once what was queued for the client drained (the watch saw nothing
   * queued), at once without a watch or when the client closed after the end. @throws SseError
   * SSE_SLOW_CLIENT when the watch cut the client first.
   */
  settled(): Promise<void> {
    if (this.cut) return Promise.reject(this.cut);
    const sock = this.res.socket;
    if (!this.watch || !this.unwatch || !sock || sock.destroyed) return Promise.resolve();
    const watch = this.watch;
    return new Promise<void>((resolve, reject) => {
      const done = () => {
        clearInterval(t);
        this.onCut = this.onCut.filter((f) => f !== fail);
        sock.off('close', closed);
      };
      const fail = (e: SseError) => {
        done();
        reject(e);
      };
      const closed = () => {
        done();
        if (this.cut) reject(this.cut);
        else resolve();
      };
      this.onCut.push(fail);
      sock.once('close', closed);
      const check = () =>
        void watch.queued(sock).then((n) => {
          if (n > 0 || this.cut || sock.destroyed) return;
          done();
          this.unwatch?.();
          resolve();
        });
      const t = setInterval(check, watch.periodMs);
      t.unref();
      check();
    });
  }

  /** True once the response ended or the connection is gone; further writes reject. */
  get closed(): boolean {
    return this.res.destroyed || this.res.writableEnded;
  }

  /**
   * Set the status line and SSE headers (idempotent). They leave with the first event, in the
   * same TCP segment (one write instead of two: a lone header segment followed by a small event
   * can leave the event waiting for the peer's delayed ACK); `flush` sends them at once instead.
   */
  open(status = 200, flush = false): void {
    if (this.res.headersSent || this.closed) return;
    this.startWatch();
    this.res.writeHead(status, {
      'content-type': 'text/event-stream; charset=utf-8',
      'cache-control': 'no-cache, no-transform',
      connection: connectionHeader(this.res),
      'x-accel-buffering': 'no',
      ...this.extraHeaders,
    });
    if (flush) this.res.flushHeaders();
  }

  /**
   * Write one event. Strings are sent verbatim as the data payload (e.g. `'[DONE]'`); anything
   * else is JSON-encoded. `event` names the event (an `event:` line).
   * @throws SseError SSE_CLOSED when the response is closed (before or while waiting for drain);
   *   SSE_WRITE_TIMEOUT when the socket does not drain within `writeTimeoutMs`.
   */
  write(data: unknown, event?: string): Promise<void> {
    return this.writeRaw(formatSseEvent(typeof data === 'string' ? data : JSON.stringify(data), event));
  }

  /** Write an SSE comment line (keep-alive); same errors as `write`. */
  comment(text: string): Promise<void> {
    return this.writeRaw(`: ${text.replace(/[\r\n]+/g, ' ')}\n\n`);
  }

  /** End the response (idempotent; no-op when the connection is gone). */
  end(): void {
    if (this.closed) return;
    this.open();
    this.res.end();
    // watched until what is queued drains (a reader that stalls at the end is cut all the same)
    if (this.unwatch) void this.settled().catch(() => {});
  }

  private writeRaw(frame: string): Promise<void> {
    if (this.cut) return Promise.reject(this.cut);
    if (this.closed) return Promise.reject(new SseError('SSE_CLOSED', 'SSE response is closed'));
    this.open();
    if (this.res.write(frame)) return Promise.resolve();
    return new Promise<void>((resolve, reject) => {
      const res = this.res;
      const cleanup = () => {
        clearTimeout(timer);
        res.off('drain', onDrain);
        res.off('close', onClose);
      };
      const onDrain = () => {
        cleanup();
        resolve();
      };
      const onClose = () => {
        cleanup();
        reject(this.cut ?? new SseError('SSE_CLOSED', 'SSE response closed while waiting for drain'));
      };
      const timer = setTimeout(() => {
        cleanup();
        reject(new SseError('SSE_WRITE_TIMEOUT', `SSE peer did not drain within ${this.writeTimeoutMs} ms`));
      }, this.writeTimeoutMs);
      res.on('drain', onDrain);
      res.on('close', onClose);
    });
  }
}

export interface ReadSseOptions {
  /** Max bytes of one event (its data lines plus a partial line), default 1 MiB. */
  maxEventBytes?: number;
}

const LF = 0x0a;
const CR = 0x0d;

/**
 * Synchronous SSE parser: `push(chunk)` returns the `data` payload of every event the chunk
 * completes (multi-line data joined with '\n'), in order. Same rules as `readSse` (which is this
 * parser behind an async iterator): events split across chunks, LF / CRLF / CR line endings,
 * comments, a leading BOM, fields other than `data` ignored, one event capped at `maxEventBytes`.
 * For callers that must act on an event inside the socket's read callback (the router's prefill
 * leg, src/router/dispatch.ts), without the async iterator's extra turns.
 * @throws SseError SSE_EVENT_TOO_LARGE (from `push`) when one event exceeds `maxEventBytes`.
 */
export class SseParser {
  private readonly max: number;
  private readonly decoder = new TextDecoder('utf-8');
  private partial: Uint8Array[] = [];
  private partialBytes = 0;
  private data: string[] | null = null;
  private eventBytes = 0;
  private skipLf = false;
  private firstLine = true;

  constructor(opts: ReadSseOptions = {}) {
    this.max = opts.maxEventBytes ?? 1024 * 1024;
  }

  /**
   * Feed one chunk; returns the payloads of the events it completed (often none or one), appended
   * to `out` as they are found (when `push` throws, `out` holds the events before the error).
   */
  push(chunk: Uint8Array, out: string[] = []): string[] {
    const n = chunk.length;
    let i = 0;
    if (this.skipLf && n > 0) {
      if (chunk[0] === LF) i = 1;
      this.skipLf = false;
    }
    let start = i;
    for (; i < n; i++) {
      const b = chunk[i];
      if (b !== LF && b !== CR) continue;
      const payload = this.line(this.take(chunk, start, i));
      if (b === CR) {
        if (i + 1 < n) {
          if (chunk[i + 1] === LF) i++;
        } else {
          this.skipLf = true;
        }
      }
      start = i + 1;
      if (payload !== undefined) out.push(payload);
    }
    if (start < n) {
      // Copy: the producer may reuse its buffer after we return control.
      this.partial.push(Uint8Array.prototype.slice.call(chunk, start));
      this.partialBytes += n - start;
      if (this.eventBytes + this.partialBytes > this.max) throw this.tooLarge();
    }
    return out;
  }

  private tooLarge(): SseError {
    return new SseError('SSE_EVENT_TOO_LARGE', `SSE event larger than ${this.max} bytes`);
  }

  /** Process one complete line; returns the payload when it dispatches an event. */
  private line(bytes: Uint8Array): string | undefined {
    if (this.firstLine) {
      this.firstLine = false;
      if (bytes.length >= 3 && bytes[0] === 0xef && bytes[1] === 0xbb && bytes[2] === 0xbf) bytes = bytes.subarray(3);
    }
    if (bytes.length === 0) {
      const out = this.data === null ? undefined : this.data.join('\n');
      this.data = null;
      this.eventBytes = 0;
      return out;
    }
    if (bytes[0] === 0x3a /* ':' comment */) return undefined;
    const text = this.decoder.decode(bytes);
    const colon = text.indexOf(':');
    const field = colon < 0 ? text : text.slice(0, colon);
    if (field !== 'data') return undefined;
    let value = colon < 0 ? '' : text.slice(colon + 1);
    if (value.startsWith(' ')) value = value.slice(1);
    this.eventBytes += bytes.length + 1;
    if (this.eventBytes > this.max) throw this.tooLarge();
    (this.data ??= []).push(value);
    return undefined;
  }

  private take(chunk: Uint8Array, start: number, end: number): Uint8Array {
    if (this.partial.length === 0) return chunk.subarray(start, end);
    this.partial.push(chunk.subarray(start, end));
    const out = new Uint8Array(this.partialBytes + end - start);
    let o = 0;
    for (const p of this.partial) {
      out.set(p, o);
      o += p.length;
    }
    this.partial = [];
    this.partialBytes = 0;
    return out;
  }
}

/**
 * Yield the `data` payload of every complete event of an SSE byte stream (`SseParser` over an
 * async iterable). An unterminated event at end of stream is discarded (as the WHATWG parser does).
 * Breaking out of the loop returns the underlying iterator (an undici body is destroyed).
 * @throws SseError SSE_EVENT_TOO_LARGE when one event exceeds `maxEventBytes`.
 */
export async function* readSse(
  body: AsyncIterable<Uint8Array>,
  opts: ReadSseOptions = {},
): AsyncGenerator<string, void, undefined> {
  const parser = new SseParser(opts);
  for await (const chunk of body) {
    const events: string[] = [];
    let failure: unknown = null;
    try {
      parser.push(chunk, events);
    } catch (err) {
      failure = err; // the chunk's events before the oversized one are still delivered first
    }
    for (const payload of events) yield payload;
    if (failure) throw failure;
  }
}
