/**
 * A worker's signed-request hooks (src/worker/auth.ts) on a bare fastify app: an unsigned request
 * is a 401 whose message names what works instead (the router's routes, `pdserve doctor` with the
 * cluster secret), a signed one passes, /health stays open.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import Fastify from 'fastify';
import { Registry } from 'prom-client';
import { registerWorkerAuth } from '../../src/worker/auth.js';
import { bodyDigest, httpKeyOf, signRequest, SIGNATURE_HEADER } from '../../src/security/request-auth.js';

const SECRET = 'worker-auth-test-secret';

test('an unsigned request is a 401 naming what works: the router\'s /debug/rooms or doctor for /debug/*, the router for the rest', async () => {
  const app = Fastify({ logger: false });
  registerWorkerAuth(app, { secret: SECRET }, new Registry());
  app.get('/health', async () => ({ status: 'ok' }));
  app.get('/debug/rooms', async () => ({ live: [], recent: [] }));
  app.post('/generate', async () => ({ ok: true }));
  await app.ready();
  try {
    assert.equal((await app.inject({ method: 'GET', url: '/health' })).statusCode, 200);
    const rooms = await app.inject({ method: 'GET', url: '/debug/rooms?x=1' });
    assert.equal(rooms.statusCode, 401);
    const e = rooms.json().error as { code: string; message: string };
    assert.equal(e.code, 'unauthenticated');
    assert.match(e.message, /GET <router>\/debug\/rooms/);
    assert.match(e.message, /pdserve doctor --url <router>` with PDSERVE_CLUSTER_SECRET or --cluster-secret-file/);
    const gen = await app.inject({ method: 'POST', url: '/generate', payload: { rid: 'x' } });
    assert.equal(gen.statusCode, 401);
    assert.match(gen.json().error.message, /send requests to the router \(\/v1\/\.\.\.\)/);
    assert.doesNotMatch(gen.json().error.message, /debug\/rooms/);
    // signed with the cluster secret: served
    const signed = await app.inject({ method: 'GET', url: '/debug/rooms', headers: { [SIGNATURE_HEADER]: signRequest(httpKeyOf(SECRET), 'GET', '/debug/rooms', bodyDigest('')) } });
    assert.equal(signed.statusCode, 200);
    assert.deepEqual(signed.json(), { live: [], recent: [] });
  } finally {
    await app.close();
  }
});
