/**
 * The HTTP server timeouts (src/runtime/http-timeouts.ts) are settable on every server: the
 * router and the worker app (prefill, decode and colocated share it) advertise the configured
 * keep-alive on a real connection (`Keep-Alive: timeout=N`), and `up` forwards the three flags
 * to every child, where the real commands parse them back to the same values. A load balancer
 * with a longer idle timeout than the server's keep-alive gets resets: the keep-alive must be
 * settable above it.
 */
import assert from 'node:assert/strict';
import { request as httpRequest, Agent } from 'node:http';
import { test } from 'node:test';
import pino from 'pino';
import { Registry } from 'prom-client';
import { startRouter } from '../../src/router/index.js';
import { createWorkerApp, listenUrl } from '../../src/worker/http.js';
import { upExtraArgs } from '../../src/cli/main.js';
import { parsedOptions } from '../helpers/cli-options.js';
import { DEFAULT_HTTP_TIMEOUTS, HttpTimeoutsSchema } from '../../src/runtime/http-timeouts.js';

/** GET `url` on a keep-alive connection: the response's status and `keep-alive` header. */
function keepAliveHeader(url: string): Promise<{ status: number; keepAlive: string | undefined }> {
  const agent = new Agent({ keepAlive: true });
  return new Promise((resolve, reject) => {
    const req = httpRequest(url, { agent, headers: { connection: 'keep-alive' } }, (res) => {
      res.resume();
      res.on('end', () => {
        agent.destroy();
        resolve({ status: res.statusCode ?? 0, keepAlive: res.headers['keep-alive'] as string | undefined });
      });
    });
    req.setTimeout(5000, () => req.destroy(new Error('no answer in 5 s')));
    req.on('error', reject);
    req.end();
  });
}

test('the router advertises and applies its configured keep-alive, headers and request timeouts', async () => {
  const r = await startRouter({ port: 0, prefill: [{ url: 'http://127.0.0.1:1', bootstrapPort: 2 }], decode: [{ url: 'http://127.0.0.1:3' }], healthIntervalMs: 60_000, healthTimeoutMs: 100, httpTimeouts: { keepAliveMs: 123_000, headersMs: 45_000, requestMs: 90_000 }, log: { level: 'silent' } });
  try {
    const { keepAlive } = await keepAliveHeader(`${r.url}/health`);
    assert.equal(keepAlive, 'timeout=123', 'the Keep-Alive header names the configured keep-alive, seconds');
    assert.equal(r.app.server.keepAliveTimeout, 123_000);
    assert.equal(r.app.server.headersTimeout, 45_000);
    assert.equal(r.app.server.requestTimeout, 90_000);
  } finally {
    await r.close();
  }
});

test("a worker's server (prefill, decode, colocated) advertises its configured keep-alive; the defaults stay fastify's 72 s", async () => {
  for (const [t, want] of [[{ keepAliveMs: 650_000 }, 'timeout=650'], [undefined, 'timeout=72']] as const) {
    const app = createWorkerApp({ log: pino({ level: 'silent' }), registry: new Registry(), health: () => ({ role: 'decode' }), debugRooms: () => ({}), modelNames: ['m'], httpTimeouts: t });
    try {
      const url = await listenUrl(app, '127.0.0.1', 0);
      const { status, keepAlive } = await keepAliveHeader(`${url}/health`);
      assert.equal(status, 200);
      assert.equal(keepAlive, want);
      assert.equal(app.server.headersTimeout, DEFAULT_HTTP_TIMEOUTS.headersMs);
    } finally {
      await app.close();
    }
  }
});

test('a headers timeout above the request timeout is refused', () => {
  assert.equal(HttpTimeoutsSchema.safeParse({ headersMs: 10_000, requestMs: 5_000 }).success, false);
  assert.equal(HttpTimeoutsSchema.safeParse({ headersMs: 10_000, requestMs: 0 }).success, true, '0 = no request timeout');
});

const parsed = parsedOptions;

test('every server command takes the timeout flags, and `up` forwards them to the router and every worker', async () => {
  const flags = ['--keep-alive-timeout-ms', '620000', '--headers-timeout-ms', '30000', '--http-request-timeout-ms', '120000'];
  const want = { keepAliveTimeoutMs: 620_000, headersTimeoutMs: 30_000, httpRequestTimeoutMs: 120_000 };
  const pick = (o: Record<string, unknown>) => ({ keepAliveTimeoutMs: o.keepAliveTimeoutMs, headersTimeoutMs: o.headersTimeoutMs, httpRequestTimeoutMs: o.httpRequestTimeoutMs });
  for (const role of ['router', 'prefill', 'decode', 'colocated']) assert.deepEqual(pick(await parsed(role, flags)), want, role);
  const up = await parsed('up', flags);
  const extra = upExtraArgs(up as unknown as Parameters<typeof upExtraArgs>[0]);
  for (const role of ['router', 'prefill', 'decode'] as const) assert.deepEqual(pick(await parsed(role, extra[role] ?? [])), want, `up forwards them to ${role}`);
});
