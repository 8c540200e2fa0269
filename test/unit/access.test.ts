/**
 * Client access (src/api/access.ts): the access class of a path is decided by prefix (a route
 * added later under /v1/ is guarded without being listed), keys are matched in constant time
 * against digests, Bearer and Basic are read, refusals are OpenAI 401 bodies and are counted.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import Fastify from 'fastify';
import pino from 'pino';
import { Registry } from 'prom-client';
import { accessClassOf, KeyRing, parseKeyFile, presentedKey, registerAccess } from '../../src/api/access.js';
import { registerOpenAIErrorHandling } from '../../src/api/errors.js';

describe('access classes', () => {
  test('by prefix: /v1/* and unknown paths need an API key, control paths the admin key, /health is open', () => {
    assert.equal(accessClassOf('POST', '/v1/responses'), 'api');
    assert.equal(accessClassOf('GET', '/v1/models?x=1'), 'api');
    assert.equal(accessClassOf('POST', '/tokenize'), 'api');
    assert.equal(accessClassOf('GET', '/no/such/route'), 'api');
    assert.equal(accessClassOf('GET', '/health'), 'open');
    assert.equal(accessClassOf('GET', '/health/../workers'), 'api');
    assert.equal(accessClassOf('OPTIONS', '/v1/completions'), 'open');
    assert.equal(accessClassOf('GET', '/metrics'), 'metrics');
    for (const p of ['/workers', '/workers/probe', '/debug/traces/x', '/dashboard', '/dashboard/data']) assert.equal(accessClassOf('GET', p), 'admin', p);
    assert.equal(accessClassOf('GET', '/dashboardx'), 'api');
  });

  test('keys: Bearer and Basic are read, digests matched, ids are not the key', () => {
    assert.equal(presentedKey('Bearer abc'), 'abc');
    assert.equal(presentedKey('bearer   abc '), 'abc');
    assert.equal(presentedKey(`Basic ${Buffer.from('u:p:w').toString('base64')}`), 'p:w');
    assert.equal(presentedKey('Token abc'), null);
    assert.equal(presentedKey(undefined), null);
    const ring = new KeyRing(['k1', 'k2', '']);
    assert.equal(ring.size, 2);
    const id = ring.match('k2');
    assert.match(id ?? '', /^[0-9a-f]{8}$/);
    assert.equal(ring.match('k3'), null);
    assert.equal(ring.match(''), null);
    assert.deepEqual(parseKeyFile('# c\n a \n\nb\r\n'), ['a', 'b']);
  });
});

async function app(o: Parameters<typeof registerAccess>[1]) {
  const a = Fastify();
  registerOpenAIErrorHandling(a);
  const registry = new Registry();
  const access = registerAccess(a, o, registry, pino({ level: 'silent' }));
  a.get('/health', async () => ({ ok: true }));
  a.get('/metrics', async () => 'm');
  a.get('/workers', async () => ({ workers: [] }));
  a.post('/v1/responses', async () => ({ ok: true }));
  a.post('/abort_request', async () => ({ aborted: true }));
  await a.ready();
  return { a, access, registry };
}

describe('registerAccess', () => {
  test('no keys: everything is open and the banner says so', async () => {
    const { a, access } = await app({});
    assert.equal(access.apiOpen, true);
    assert.match(access.describe(), /OPEN/);
    assert.equal((await a.inject({ method: 'POST', url: '/v1/responses' })).statusCode, 200);
    assert.equal((await a.inject({ method: 'GET', url: '/workers' })).statusCode, 200);
    await a.close();
  });

  test('API key: 401 invalid_api_key without or with a wrong key, counted; admin paths need the admin key', async () => {
    const { a, access, registry } = await app({ apiKeys: ['sk-a'], adminKeys: ['sk-admin'], privateMetrics: true });
    assert.equal(access.apiOpen, false);
    const none = await a.inject({ method: 'POST', url: '/v1/responses' });
    assert.equal(none.statusCode, 401);
    assert.deepEqual(none.json().error.code, 'invalid_api_key');
    assert.equal(none.json().error.type, 'authentication_error');
    assert.match(String(none.headers['www-authenticate']), /^Bearer/);
    const wrong = await a.inject({ method: 'POST', url: '/v1/responses', headers: { authorization: 'Bearer sk-b' } });
    assert.equal(wrong.statusCode, 401);
    assert.ok(!wrong.body.includes('sk-b'));
    assert.equal((await a.inject({ method: 'POST', url: '/v1/responses', headers: { authorization: 'Bearer sk-a' } })).statusCode, 200);
    assert.equal((await a.inject({ method: 'GET', url: '/workers', headers: { authorization: 'Bearer sk-a' } })).statusCode, 401);
    assert.equal((await a.inject({ method: 'GET', url: '/workers', headers: { authorization: 'Bearer sk-admin' } })).statusCode, 200);
    assert.equal((await a.inject({ method: 'GET', url: '/metrics' })).statusCode, 401);
    assert.equal((await a.inject({ method: 'GET', url: '/health' })).statusCode, 200);
    const text = await registry.metrics();
    assert.match(text, /pdserve_auth_refused_total\{class="api"\} 2/);
    assert.match(text, /pdserve_auth_refused_total\{class="admin"\} 1/);
    await a.close();
  });

  test('API keys without an admin key: an API key opens the control paths (they are never left open), but not /debug/* nor /abort_request (other tenants\' traffic)', async () => {
    const { a } = await app({ apiKeys: ['sk-a'] });
    assert.equal((await a.inject({ method: 'GET', url: '/workers' })).statusCode, 401);
    assert.equal((await a.inject({ method: 'GET', url: '/workers', headers: { authorization: 'Bearer sk-a' } })).statusCode, 200);
    const traces = await a.inject({ method: 'GET', url: '/debug/traces', headers: { authorization: 'Bearer sk-a' } });
    assert.equal(traces.statusCode, 401);
    assert.match(traces.json().error.message, /need an admin API key, and none is configured/);
    for (const url of ['/abort_request', '/abort_request?x=1']) {
      const abort = await a.inject({ method: 'POST', url, headers: { authorization: 'Bearer sk-a' }, payload: { rid: 'chatcmpl-x' } });
      assert.equal(abort.statusCode, 401, url);
      assert.equal(abort.json().error.code, 'invalid_api_key');
      assert.match(abort.json().error.message, /abort_request .*needs an admin API key, and none is configured \(--admin-api-key or PDSERVE_ADMIN_API_KEY\)/);
    }
    assert.equal((await a.inject({ method: 'POST', url: '/abort_request', payload: { rid: 'chatcmpl-x' } })).statusCode, 401);
    assert.equal((await a.inject({ method: 'GET', url: '/metrics' })).statusCode, 200);
    await a.close();
  });

  test('/abort_request: the admin key when one is set (an API key is refused); open when no key is set', async () => {
    const locked = await app({ apiKeys: ['sk-a'], adminKeys: ['sk-admin'] });
    assert.equal((await locked.a.inject({ method: 'POST', url: '/abort_request', headers: { authorization: 'Bearer sk-a' }, payload: { rid: 'r' } })).statusCode, 401);
    assert.equal((await locked.a.inject({ method: 'POST', url: '/abort_request', headers: { authorization: 'Bearer sk-admin' }, payload: { rid: 'r' } })).statusCode, 200);
    await locked.a.close();
    const adminOnly = await app({ adminKeys: ['sk-admin'] });
    assert.equal((await adminOnly.a.inject({ method: 'POST', url: '/abort_request', payload: { rid: 'r' } })).statusCode, 401);
    assert.equal((await adminOnly.a.inject({ method: 'POST', url: '/abort_request', headers: { authorization: 'Bearer sk-admin' }, payload: { rid: 'r' } })).statusCode, 200);
    await adminOnly.a.close();
    const open = await app({});
    assert.equal((await open.a.inject({ method: 'POST', url: '/abort_request', payload: { rid: 'r' } })).statusCode, 200);
    await open.a.close();
  });

  test('an unreadable key file at start is an error', async () => {
    await assert.rejects(app({ apiKeyFile: '/nonexistent/keys' }), /cannot read the API key file/);
  });
});

describe('client-facing errors name the role, not the address', () => {
  test('URLs, IPv4/IPv6 literals and host:port are redacted; the rest of the message stays', async () => {
    const { redactAddresses, redactedForClient } = await import('../../src/base/redact.js');
    const { ApiError } = await import('../../src/base/errors.js');
    assert.equal(redactAddresses('decode worker http://10.0.0.3:30001 is unreachable: connect ECONNREFUSED 10.0.0.3:30001'), 'decode worker <address> is unreachable: connect ECONNREFUSED <address>');
    assert.equal(redactAddresses('cannot pair with prefill [fd00::2]:8998: timeout'), 'cannot pair with prefill <address>: timeout');
    assert.equal(redactAddresses('dial prefill-a.internal.example:8998 failed'), 'dial <address> failed');
    assert.equal(redactAddresses('prompt is 4096 tokens, the context is 2048'), 'prompt is 4096 tokens, the context is 2048');
    const e = new ApiError(502, 'peer_unreachable', 'cannot pair with prefill 127.0.0.1:8998', 'server_error');
    const r = redactedForClient(e);
    assert.equal(r.message, 'cannot pair with prefill <address>');
    assert.equal(r.code, 'peer_unreachable');
    assert.equal(r.status, 502);
    const clean = new ApiError(400, 'invalid_value', 'nothing to hide');
    assert.equal(redactedForClient(clean), clean);
  });
});
