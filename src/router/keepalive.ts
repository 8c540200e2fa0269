/**
 * SSE keep-alive of one streamed request: while the client waits — for a pair, for its first
 * token (a prefill queue, busy decode slots) or between tokens — and nothing was written to it
 * for `intervalMs`, an SSE comment `: keep-alive` is written (opening the stream, status 200,
 * when it is not open yet), so an idle-timeout proxy in front does not cut a request that is
 * only waiting. SSE clients ignore comment lines (the WHATWG event-stream rules), as the OpenAI
 * SDKs do. Once the stream is open an error can only reach the client as an SSE `{error}`
 * event: the request's code (./dispatch.ts, ./attempts.ts) reads `writer()` to know. The stream is
 * the request's sink's (../api/generation.ts): an HTTP response, or a fan-out's or a Responses
 * request's in-process sink, which passes the comment on to its own client.
 */
import { systemClock } from '../base/clock.js';
import type { ChunkStream, GenerationSink } from '../api/generation.js';

/** The comment's text. */
export const KEEP_ALIVE_COMMENT = 'keep-alive';

export class SseKeepAlive {
  private timer: NodeJS.Timeout | null = null;
  private lastCommentAt: number;
  private early: ChunkStream | null = null;
  /** Comments written so far (tests, logs). */
  comments = 0;

  /**
   * Start the timer. `lastWrite()`: systemClock ms of the last chunk the request wrote to its
   * client (0 = none yet); `current()`: the stream the request opened itself, if any;
   * `headers`: the response headers a stream opened here carries.
   */
  constructor(
    private readonly sink: GenerationSink,
    private readonly intervalMs: number,
    private readonly headers: Record<string, string>,
    private readonly lastWrite: () => number,
    private readonly current: () => ChunkStream | null,
    /** Called with the stream a comment opened (the request adopts it). */
    private readonly onOpen: (w: ChunkStream) => void = () => {},
  ) {
    this.lastCommentAt = systemClock.nowMs();
    this.schedule(intervalMs);
  }

  /** The client's stream: the request's own, or the one a comment opened (null: not open). */
  writer(): ChunkStream | null {
    return this.current() ?? this.early;
  }

  /** Stop the timer (the request is over). Idempotent. */
  stop(): void {
    if (this.timer) clearTimeout(this.timer);
    this.timer = null;
  }

  private schedule(ms: number): void {
    this.timer = setTimeout(() => this.tick(), Math.max(1, ms));
    this.timer.unref();
  }

  private tick(): void {
    this.timer = null;
    const now = systemClock.nowMs();
    const silent = now - Math.max(this.lastCommentAt, this.lastWrite());
    if (silent + 1 < this.intervalMs) return this.schedule(this.intervalMs - silent);
    let w = this.writer();
    if (!w) {
      if (this.sink.answered) return; // answered (or gone) another way
      w = this.early = this.sink.stream(this.headers);
      this.onOpen(w);
    }
    if (w.closed) return;
    this.lastCommentAt = now;
    this.comments++;
    w.comment(KEEP_ALIVE_COMMENT).catch(() => {}); // a gone client is seen by the request itself
    this.schedule(this.intervalMs);
  }
}
