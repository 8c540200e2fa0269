/**
 * A plain-HTTP request sent to a TLS port (`curl http://` to a server started with `--tls-cert`,
 * or to a worker on internal TLS) gets a plain-HTTP answer that says so, instead of the empty
 * reply of a failed TLS handshake ("curl: (52) Empty reply from server"). The server's first
 * look at a new connection is its first byte: a TLS ClientHello starts with 0x16 (a handshake
 * record), an HTTP/1.x request with its method's first letter. The same first-byte test as nginx's
 * "400 The plain HTTP request was sent to HTTPS port" and the `httpolyglot` package (one port,
 * both protocols), here only to answer the mistake: the request itself is never served.
 */
import type { Socket } from 'node:net';
import type { Server as TlsServer } from 'node:tls';
import { errorBody } from './errors.js';

/** How long a new connection may stay silent before its first byte, ms; then it is closed (TLS's own handshake timeout starts with that byte). */
export const FIRST_BYTE_MS = 10_000;
/** How long the answered connection is drained (its request read and dropped) before it is closed, ms: a close with unread bytes would be a reset that can cut the answer. */
const DRAIN_MS = 2000;

/** The answer: 400 with an OpenAI error body (code `plain_http_on_tls_port`). */
function answer(sock: Socket): void {
  const body = JSON.stringify(
    errorBody('This port speaks HTTPS (TLS), and the request came as plain HTTP: use an https:// URL (curl: https://…, with --cacert FILE when the server\'s certificate comes from a private CA).', 'invalid_request_error', null, 'plain_http_on_tls_port'),
  );
  sock.on('data', () => {}); // read and drop the request
  sock.end(`HTTP/1.1 400 Bad Request\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`);
  sock.setTimeout(DRAIN_MS, () => sock.destroy());
}

/**
 * Make `server` (an https / tls server, before it listens) answer plain HTTP/1.x on its port
 * (400, an OpenAI error body naming the mistake) and hand every other connection to TLS as
 * before, with the bytes already read. A connection silent for `firstByteMs` is closed; an error
 * before TLS has it is the end of that socket only. Borrowed idea: nginx (error 497 → 400) and
 * httpolyglot (the first byte decides).
 * @param firstByteMs default FIRST_BYTE_MS.
 */
export function answerPlainHttp(server: TlsServer, firstByteMs = FIRST_BYTE_MS): void {
  // tls.Server turns every accepted socket into a TLSSocket in its own 'connection' listener:
  // it runs only once the first byte is known to be TLS's
  const tls = server.listeners('connection') as ((s: Socket) => void)[];
  server.removeAllListeners('connection');
  server.on('connection', (sock: Socket) => {
    const fail = (): void => void sock.destroy();
    sock.on('error', fail);
    sock.setTimeout(firstByteMs, fail);
    const look = (): void => {
      const b = sock.read(1) as Buffer | null;
      if (b === null) return; // nothing yet (or the end: 'end' follows and the socket closes)
      sock.off('readable', look);
      sock.unshift(b);
      sock.setTimeout(0);
      // an HTTP/1.x method starts with an upper-case letter; anything else is TLS's to judge
      if (b[0]! >= 0x41 && b[0]! <= 0x5a) return answer(sock);
      sock.off('error', fail);
      for (const l of tls) l.call(server, sock);
    };
    sock.on('readable', look);
    sock.once('end', () => sock.destroy());
  });
}
