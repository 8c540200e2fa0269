/**
 * Plain HTTP sent to a TLS port (src/api/plain-http.ts) on a real fastify HTTPS server with
 * throwaway certificates: a plain request is answered 400 with an OpenAI error body that names
 * the mistake (curl's "Empty reply from server" before), HTTPS on the same port is served as
 * before, a connection that never speaks is closed at the first-byte deadline, and bytes that are
 * neither HTTP nor TLS fail the TLS handshake as before.
 */
import assert from 'node:assert/strict';
import net from 'node:net';
import { after, before, test } from 'node:test';
import type { Server as TlsServer } from 'node:tls';
import Fastify, { type FastifyInstance } from 'fastify';
import { Agent, request } from 'undici';
import { answerPlainHttp } from '../../src/api/plain-http.js';
import { makeTestPki, type TestPki } from '../helpers/tls.js';

let pki: TestPki;
let app: FastifyInstance;
let port = 0;

before(async () => {
  pki = makeTestPki();
  app = Fastify({ https: { cert: pki.pem.cert, key: pki.pem.key } });
  answerPlainHttp(app.server as unknown as TlsServer, 300);
  app.get('/health', async () => ({ ok: true }));
  await app.listen({ port: 0, host: '127.0.0.1' });
  port = (app.server.address() as net.AddressInfo).port;
});
after(() => app.close());

/** Send `bytes` on a fresh TCP connection; resolves with everything the server sent until it closed (or `ms` passed). */
function raw(bytes: string | Buffer | null, ms = 5000): Promise<{ text: string; closed: boolean; afterMs: number }> {
  return new Promise((resolve) => {
    const t0 = performance.now();
    const s = net.connect({ port, host: '127.0.0.1' });
    let text = '';
    const timer = setTimeout(() => (s.destroy(), resolve({ text, closed: false, afterMs: performance.now() - t0 })), ms);
    s.on('data', (d) => (text += d.toString('latin1')));
    s.on('error', () => {});
    s.on('close', () => (clearTimeout(timer), resolve({ text, closed: true, afterMs: performance.now() - t0 })));
    if (bytes !== null) s.write(bytes);
  });
}

test('a plain HTTP request on the TLS port: 400 with an OpenAI error body saying to use https://', async () => {
  const r = await raw('GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n');
  assert.ok(r.closed, 'the server closes the connection after its answer');
  assert.match(r.text, /^HTTP\/1\.1 400 Bad Request\r\n/);
  const body = JSON.parse(r.text.slice(r.text.indexOf('\r\n\r\n') + 4)) as { error: { code: string; message: string; type: string } };
  assert.equal(body.error.code, 'plain_http_on_tls_port');
  assert.equal(body.error.type, 'invalid_request_error');
  assert.match(body.error.message, /https:\/\//);
  // a POST with a body the server never reads: the answer still arrives whole (no reset)
  const big = await raw(`POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 200000\r\n\r\n${'x'.repeat(200_000)}`);
  assert.match(big.text, /plain_http_on_tls_port/);
});

test('HTTPS on the same port is served as before (undici with the test CA), several requests on one connection', async () => {
  const agent = new Agent({ connect: { ca: pki.pem.ca } });
  try {
    for (let i = 0; i < 3; i++) {
      const res = await request(`https://127.0.0.1:${port}/health`, { dispatcher: agent });
      assert.equal(res.statusCode, 200);
      assert.deepEqual(await res.body.json(), { ok: true });
    }
  } finally {
    await agent.close();
  }
});

test('a connection that sends nothing is closed at the first-byte deadline; bytes that are neither HTTP nor TLS fail the handshake (closed, no answer)', async () => {
  const silent = await raw(null, 5000);
  assert.ok(silent.closed, 'closed by the server');
  assert.ok(silent.afterMs >= 250 && silent.afterMs < 4000, `closed after ${silent.afterMs} ms (deadline 300 ms)`);
  const junk = await raw(Buffer.from([0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08]));
  assert.ok(junk.closed);
  assert.equal(junk.text, '', 'no HTTP answer to bytes that are not HTTP');
});
