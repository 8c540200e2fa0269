/**
 * Non-streamed response bodies under the send-queue watch (../runtime/send-queue.ts), on the
 * router and the colocated server. A body that does not fit the kernel's send queue parks in
 * Node's buffer when its reader stalls: the response never finishes, so neither the keep-alive
 * timeout nor anything else frees the connection. A body of `WATCHED_BODY_BYTES` or more is
 * therefore sent in slices with backpressure (the same bytes and `content-length`; a slice is
 * written once the one before it left Node's buffer), so the deadline rule applies to each slice
 * as it is written, as for a stream, and the bound on buffered bytes is never reached by a
 * healthy reader of a large body; the socket is watched until what was queued for the client
 * was delivered. A reader that breaks a rule is cut: the connection destroyed, counted in
 * `pdserve_client_cut_total{reason}` like a streaming one. The request was complete when its
 * body was sent, so nothing is left to abort and its outcome stays booked.
 *
 * Smaller bodies are not watched: the kernel takes them whole, and the keep-alive timeout closes
 * the idle connection of a reader that never reads them. Streams (hijacked replies) do not pass
 * here: their SseWriter is watched.
 */
import { Readable } from 'node:stream';
import type { ServerResponse } from 'node:http';
import type { FastifyInstance, FastifyReply } from 'fastify';
import type { Logger } from '../base/log.js';
import type { SendQueueWatch } from '../runtime/send-queue.js';

/** Smallest body watched, bytes (smaller ones fit a kernel send queue at once). */
export const WATCHED_BODY_BYTES = 64 * 1024;
/** Bytes of one slice of a watched body. */
const SLICE_BYTES = 16 * 1024;

/** Responses whose body this hook is sending in slices (see `bodyPending`). */
const sliced = new WeakSet<ServerResponse>();

/**
 * True when `reply`'s body is being sent in slices by this module: the reply is sent although
 * fastify's `reply.sent` is false until the last slice was handed to the socket.
 */
export function bodyPending(reply: FastifyReply): boolean {
  return sliced.has(reply.raw);
}

/**
 * Install the onSend hook that watches large non-streamed bodies on `app` (see the module doc).
 * `log` gets one warn line per cut (request id, reason, detail).
 */
export function registerBodyWatch(app: FastifyInstance, watch: SendQueueWatch, log: Logger): void {
  app.addHook('onSend', async (request, reply, payload) => {
    if (typeof payload !== 'string' && !Buffer.isBuffer(payload)) return payload;
    const bytes = typeof payload === 'string' ? Buffer.byteLength(payload) : payload.length;
    const res = reply.raw;
    const sock = res.socket;
    if (bytes < WATCHED_BODY_BYTES || !sock || sock.destroyed || request.method === 'HEAD') return payload;
    const body = typeof payload === 'string' ? Buffer.from(payload) : payload;
    sliced.add(res);
    const unwatch = watch.watch(sock, (reason, detail) => {
      clearInterval(poll);
      log.warn({ rid: String(request.id), reason, detail, bytes }, 'client cut: a non-streamed response was not read in time');
      res.destroy();
      sock.destroy();
    });
    // after the last slice: unwatched once the client has everything (or the socket closed)
    const poll: NodeJS.Timeout = setInterval(() => {
      if (!res.writableFinished) return;
      void watch.queued(sock).then((n) => {
        if (n > 0) return;
        clearInterval(poll);
        unwatch();
      });
    }, watch.periodMs);
    poll.unref();
    sock.once('close', () => clearInterval(poll));
    reply.header('content-length', String(bytes));
    return Readable.from(slices(body), { objectMode: false });
  });
}

function* slices(body: Buffer): Generator<Buffer> {
  for (let i = 0; i < body.length; i += SLICE_BYTES) yield body.subarray(i, i + SLICE_BYTES);
}
