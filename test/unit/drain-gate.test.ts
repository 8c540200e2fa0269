/**
 * DrainGate on a real fastify app and real loopback sockets: once draining, responses say
 * `connection: close` (also a stream accepted before the drain whose headers leave after it,
 * written with `writeHead` + connectionHeader), and idle keep-alive sockets are closed when the
 * drain starts, so a client pool stops reusing sockets into a process about to close them.
 */
import assert from 'node:assert/strict';
import http from 'node:http';
import { after, test } from 'node:test';
import Fastify from 'fastify';
import { connectionHeader, DrainGate } from '../../src/runtime/drain.js';

const app = Fastify({ logger: false });
const gate = new DrainGate('worker');
gate.install(app);
let release: () => void = () => {};
const held = new Promise<void>((r) => (release = r));
app.get('/health', async () => ({ status: gate.draining ? 'draining' : 'ok' }));
app.post('/generate', async (_req, reply) => {
  await held;
  reply.hijack();
  reply.raw.writeHead(200, { 'content-type': 'text/event-stream', connection: connectionHeader(reply.raw) });
  reply.raw.end('data: [DONE]\n\n');
});
after(async () => {
  release();
  await app.close();
});

interface Answer {
  status: number;
  connection: string | undefined;
  socket: import('node:net').Socket;
}

function call(agent: http.Agent, port: number, method: string, path: string): Promise<Answer> {
  return new Promise((resolve, reject) => {
    const req = http.request({ host: '127.0.0.1', port, method, path, agent, headers: method === 'POST' ? { 'content-type': 'application/json' } : {} }, (res) => {
      res.resume();
      res.on('end', () => resolve({ status: res.statusCode!, connection: res.headers.connection, socket: req.socket! }));
    });
    req.on('error', reject);
    req.end(method === 'POST' ? '{}' : undefined);
  });
}

test('draining: connection close on every response, idle keep-alive sockets closed at the start', async () => {
  await app.listen({ host: '127.0.0.1', port: 0 });
  const port = (app.server.address() as import('node:net').AddressInfo).port;
  const idleAgent = new http.Agent({ keepAlive: true, maxSockets: 1 });
  const streamAgent = new http.Agent({ keepAlive: true, maxSockets: 1 });
  try {
    const before = await call(idleAgent, port, 'GET', '/health');
    assert.equal(before.connection, 'keep-alive');
    const idleClosed = new Promise<void>((r) => before.socket.once('close', () => r()));
    // A work request accepted before the drain; its headers leave after the drain started.
    const stream = call(streamAgent, port, 'POST', '/generate');
    const until = Date.now() + 2000;
    while (gate.inflight === 0 && Date.now() < until) await new Promise((r) => setTimeout(r, 5));
    assert.equal(gate.inflight, 1);
    gate.startDraining();
    await Promise.race([idleClosed, new Promise((_, rej) => setTimeout(() => rej(new Error('idle keep-alive socket not closed within 1 s')), 1000))]);
    release();
    const s = await stream;
    assert.equal(s.status, 200);
    assert.equal(s.connection, 'close', 'the stream accepted before the drain closes its connection');
    const refused = await call(idleAgent, port, 'POST', '/generate');
    assert.equal(refused.status, 503);
    assert.equal(refused.connection, 'close');
    const health = await call(idleAgent, port, 'GET', '/health');
    assert.equal(health.connection, 'close');
  } finally {
    idleAgent.destroy();
    streamAgent.destroy();
  }
});
