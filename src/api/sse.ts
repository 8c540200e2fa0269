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
import { connectionHeader } from '../common/drain.js';

export type SseErrorCode = 'SSE_CLOSED' | 'SSE_WRITE_TIMEOUT' | 'SSE_EVENT_TOO_LARGE';

/** Typed SSE error with a stable `code` (undici style). */
export class SseError extends Error {
  constructor(
    public readonly code: SseErrorCode,
    message: string,
  ) {
    super(message);
    this.name = 'SseError';
  }
}

/** Format one SSE event carrying `data` (newlines inside become several `data:` lines). */
export function formatSseEvent(data: string): string {
  if (!/[\r\n]/.test(data)) return `data: ${data}\n\n`;
  return data.split(/\r\n|\r|\n/).map((l) => `data: ${l}\n`).join('') + '\n';
}

export interface SseWriterOptions {
  /** Max time (ms) one `write` may wait for the socket to drain. Default 30 000. */
  writeTimeoutMs?: number;
  /** Extra response headers sent by `open()`. */
  headers?: Record<string, string>;
}

/**
 * SSE writer over a Node `ServerResponse`. Not safe to share between requests: one writer, one
 * response. `open()` is implicit on the first `write`.
 */
export class SseWriter {
  private readonly writeTimeoutMs: number;
  private readonly extraHeaders: Record<string, string>;

  constructor(
    private readonly res: ServerResponse,
    opts: SseWriterOptions = {},
  ) {
    this.writeTimeoutMs = opts.writeTimeoutMs ?? 30_000;
    this.extraHeaders = opts.headers ?? {};
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
   * else is JSON-encoded.
   * @throws SseError SSE_CLOSED when the response is closed (before or while waiting for drain);
   *   SSE_WRITE_TIMEOUT when the socket does not drain within `writeTimeoutMs`.
   */
  write(data: unknown): Promise<void> {
    return this.writeRaw(formatSseEvent(typeof data === 'string' ? data : JSON.stringify(data)));
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
  }

  private writeRaw(frame: string): Promise<void> {
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
        reject(new SseError('SSE_CLOSED', 'SSE response closed while waiting for drain'));
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
 * Yield the `data` payload of every complete event of an SSE byte stream.
 * An unterminated event at end of stream is discarded (as the WHATWG parser does).
 * Breaking out of the loop returns the underlying iterator (an undici body is destroyed).
 * @throws SseError SSE_EVENT_TOO_LARGE when one event exceeds `maxEventBytes`.
 */
export async function* readSse(
  body: AsyncIterable<Uint8Array>,
  opts: ReadSseOptions = {},
): AsyncGenerator<string, void, undefined> {
  const max = opts.maxEventBytes ?? 1024 * 1024;
  const decoder = new TextDecoder('utf-8');
  let partial: Uint8Array[] = [];
  let partialBytes = 0;
  let data: string[] | null = null;
  let eventBytes = 0;
  let skipLf = false;
  let firstLine = true;

  const tooLarge = () => new SseError('SSE_EVENT_TOO_LARGE', `SSE event larger than ${max} bytes`);

  /** Process one complete line; returns the payload when it dispatches an event. */
  const line = (bytes: Uint8Array): string | undefined => {
    if (firstLine) {
      firstLine = false;
      if (bytes.length >= 3 && bytes[0] === 0xef && bytes[1] === 0xbb && bytes[2] === 0xbf) bytes = bytes.subarray(3);
    }
    if (bytes.length === 0) {
      const out = data === null ? undefined : data.join('\n');
      data = null;
      eventBytes = 0;
      return out;
    }
    if (bytes[0] === 0x3a /* ':' comment */) return undefined;
    const text = decoder.decode(bytes);
    const colon = text.indexOf(':');
    const field = colon < 0 ? text : text.slice(0, colon);
    if (field !== 'data') return undefined;
    let value = colon < 0 ? '' : text.slice(colon + 1);
    if (value.startsWith(' ')) value = value.slice(1);
    eventBytes += bytes.length + 1;
    if (eventBytes > max) throw tooLarge();
    (data ??= []).push(value);
    return undefined;
  };

  const take = (chunk: Uint8Array, start: number, end: number): Uint8Array => {
    if (partial.length === 0) return chunk.subarray(start, end);
    partial.push(chunk.subarray(start, end));
    const out = new Uint8Array(partialBytes + end - start);
    let o = 0;
    for (const p of partial) {
      out.set(p, o);
      o += p.length;
    }
    partial = [];
    partialBytes = 0;
    return out;
  };

  for await (const chunk of body) {
    const n = chunk.length;
    let i = 0;
    if (skipLf && n > 0) {
      if (chunk[0] === LF) i = 1;
      skipLf = false;
    }
    let start = i;
    for (; i < n; i++) {
      const b = chunk[i];
      if (b !== LF && b !== CR) continue;
      const payload = line(take(chunk, start, i));
      if (b === CR) {
        if (i + 1 < n) {
          if (chunk[i + 1] === LF) i++;
        } else {
          skipLf = true;
        }
      }
      start = i + 1;
      if (payload !== undefined) yield payload;
    }
    if (start < n) {
      // Copy: the producer may reuse its buffer after we return control.
      partial.push(Uint8Array.prototype.slice.call(chunk, start));
      partialBytes += n - start;
      if (eventBytes + partialBytes > max) throw tooLarge();
    }
  }
}
