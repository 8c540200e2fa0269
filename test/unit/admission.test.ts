/**
 * Admission at the edge (src/api/admission.ts): the concurrency cap with its bounded queue and
 * queue timeout, per-key token buckets and concurrency, 429 + retry-after; a fanned-out request
 * admitted once, as one request (its choices run in process).
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import Fastify from 'fastify';
import { Registry } from 'prom-client';
import { registerAdmission, TokenBucket, type AdmissionOptions } from '../../src/api/admission.js';
import { registerOpenAIErrorHandling } from '../../src/api/errors.js';
import { planFanOut, serveFanOut } from '../../src/api/fanout.js';
import { fakePort } from '../helpers/fake-port.js';

async function server(o: AdmissionOptions) {
  const app = Fastify({ forceCloseConnections: true });
  registerOpenAIErrorHandling(app);
  const registry = new Registry();
  const adm = registerAdmission(app, o, registry);
  const gates: (() => void)[] = [];
  app.post('/v1/hold', () => new Promise((r) => gates.push(() => r({ ok: true }))));
  app.post('/v1/fast', async () => ({ ok: true }));
  // n > 1 over a generation port whose choices wait for `fake.release()` (test/helpers/fake-port.ts)
  const fake = fakePort();
  app.post('/v1/chat/completions', async (req, reply) => serveFanOut(req, reply, 'chat', planFanOut('chat', req.body)!, fake.port));
  app.get('/v1/models', async () => ({ data: [] }));
  await app.listen({ port: 0, host: '127.0.0.1' });
  const url = `http://127.0.0.1:${(app.server.address() as { port: number }).port}`;
  const post = (path: string, headers: Record<string, string> = {}) => fetch(`${url}${path}`, { method: 'POST', headers, signal: AbortSignal.timeout(5000) });
  return { app, adm, registry, gates, post, url, fake };
}

const until = async (f: () => boolean) => {
  for (let i = 0; i < 200 && !f(); i++) await new Promise((r) => setTimeout(r, 10));
  assert.ok(f());
};

describe('admission', () => {
  test('cap 1, queue 1: the second waits for the first, the third is a 429 queue_full with retry-after', async () => {
    const s = await server({ maxConcurrent: 1, maxQueued: 1, queueTimeoutMs: 5000 });
    const first = s.post('/v1/hold');
    await until(() => s.adm.active === 1);
    const second = s.post('/v1/hold');
    await until(() => s.adm.queued === 1);
    const third = await s.post('/v1/hold');
    assert.equal(third.status, 429);
    assert.equal(third.headers.get('retry-after'), '1');
    const body = (await third.json()) as { error: { code: string; type: string } };
    assert.equal(body.error.code, 'rate_limited');
    assert.equal(body.error.type, 'rate_limit_error');
    assert.equal((await fetch(`${s.url}/v1/models`)).status, 200, 'GETs are not admitted');
    s.gates.shift()!();
    assert.equal((await first).status, 200);
    await until(() => s.gates.length === 1);
    assert.equal(s.adm.queued, 0);
    s.gates.shift()!();
    assert.equal((await second).status, 200);
    await until(() => s.adm.active === 0);
    assert.match(await s.registry.metrics(), /pdserve_admission_refused_total\{reason="queue_full"\} 1/);
    await s.app.close();
  });

  test('the queue timeout is a 429 queue_timeout; a queued client that leaves frees its place', async () => {
    const s = await server({ maxConcurrent: 1, maxQueued: 4, queueTimeoutMs: 150 });
    const first = s.post('/v1/hold');
    await until(() => s.adm.active === 1);
    const late = await s.post('/v1/fast');
    assert.equal(late.status, 429);
    const ac = new AbortController();
    const leaving = fetch(`${s.url}/v1/fast`, { method: 'POST', signal: ac.signal }).catch(() => null);
    await until(() => s.adm.queued === 1);
    ac.abort();
    await leaving;
    await until(() => s.adm.queued === 0);
    s.gates.shift()!();
    await first;
    await until(() => s.adm.active === 0);
    assert.match(await s.registry.metrics(), /reason="queue_timeout"\} 1/);
    await s.app.close();
  });

  test('per key: a token bucket (rps, burst) and a concurrency limit', async () => {
    const s = await server({ keyRps: 1, keyBurst: 2, keyMaxConcurrent: 1 });
    assert.equal((await s.post('/v1/fast')).status, 200);
    assert.equal((await s.post('/v1/fast')).status, 200);
    const limited = await s.post('/v1/fast');
    assert.equal(limited.status, 429);
    assert.ok(Number(limited.headers.get('retry-after')) >= 1);
    await s.app.close();
    const c = await server({ keyMaxConcurrent: 1 });
    const held = c.post('/v1/hold');
    await until(() => c.adm.active === 1);
    assert.equal((await c.post('/v1/fast')).status, 429, 'the key has one in flight');
    // The header that let a server's own sub-requests skip admission is nothing now.
    assert.equal((await c.post('/v1/fast', { 'x-pdserve-loopback': 'x'.repeat(32) })).status, 429);
    c.gates.shift()!();
    await held;
    await c.app.close();
  });

  test('a fanned-out request (n = 4 > the cap of 1) is admitted once, as one request: it holds one slot, its choices run, and the next request waits for it', async () => {
    const s = await server({ maxConcurrent: 1, maxQueued: 1, queueTimeoutMs: 5000 });
    const chat = (body: object) => fetch(`${s.url}/v1/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body), signal: AbortSignal.timeout(5000) });
    const fanned = chat({ messages: [], n: 4, hold: true });
    await until(() => s.fake.held.length === 4);
    assert.deepEqual([s.adm.active, s.adm.queued], [1, 0], 'four choices running, one request admitted');
    const next = s.post('/v1/fast');
    await until(() => s.adm.queued === 1);
    assert.equal((await s.post('/v1/fast')).status, 429, 'the queue (1) is full: the fanned-out request counts as the one at the cap');
    s.fake.release();
    const res = await fanned;
    assert.equal(res.status, 200);
    assert.equal(((await res.json()) as { choices: unknown[] }).choices.length, 4);
    assert.equal((await next).status, 200);
    await until(() => s.adm.active === 0);
    await s.app.close();
  });

  test('TokenBucket refills at its rate up to its burst', () => {
    const b = new TokenBucket(2, 2, 0);
    assert.equal(b.take(0), 0);
    assert.equal(b.take(0), 0);
    assert.equal(b.take(0), 500);
    assert.equal(b.take(500), 0);
    assert.equal(b.take(10_000), 0);
    assert.equal(b.take(10_000), 0);
    assert.ok(b.take(10_000) > 0, 'burst caps the refill');
  });
});
