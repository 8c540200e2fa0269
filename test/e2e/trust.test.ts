/**
 * The trust model on a real cluster through the real CLI (SECURITY.md):
 *  - API keys on the router: the openai SDK with a wrong and with a missing key gets 401
 *    `invalid_api_key`; the right key (from the environment or from the key file, which is
 *    re-read when it changes) works, fanned-out n > 1 too; /health stays open;
 *  - tenants (one per API key): another key's cached_tokens for the same prompt is 0 (the prefix
 *    cache is salted by the key), a shared `cache_salt` is the explicit opt-in to share; another
 *    key gets 404 for a stored Response (get, input_items, delete) and 400
 *    previous_response_not_found for its id, while its owner keeps it;
 *  - the admin key guards /workers, /debug/*, /dashboard (Basic for a browser) and is what
 *    `pdserve doctor` sends (PDSERVE_ADMIN_API_KEY);
 *  - every worker endpoint but /health and /metrics needs a request signed with the cluster
 *    secret: a direct call without one, a replayed one, an old one, one over another body or
 *    with another secret is a 401 `unauthenticated`, counted by reason;
 *  - decode dials only the prefills it knows: a signed /generate naming another bootstrap address
 *    is a 400 `unknown_bootstrap_address` and that address never sees a connection;
 *  - TLS for clients: a router started with --tls-cert/--tls-key (a throwaway CA made with
 *    openssl here) serves the openai SDK over HTTPS with that CA; a client without it is refused;
 *  - colocated takes the same API keys, admin key and HTTPS;
 *  - internal TLS: the whole stack runs with --internal-tls-cert/-key/-ca (mutual TLS on the
 *    workers' HTTP and on the KV channel, every handoff over the channel: --no-kv-same-host);
 *    a worker or bootstrap port reached without a client certificate the CA signed is refused
 *    in the TLS handshake; doctor and the dashboard reach the workers with the CA;
 *  - admission: past its key's token bucket, or past the server's cap with a full queue, a request
 *    is a 429 `rate_limited` with retry-after; `--private-metrics` puts /metrics behind the key;
 *  - `--cluster-secret` on a command line works and warns;
 *  - no key or secret in any log file or in `ps` output.
 */
import assert from 'node:assert/strict';
import { execFileSync, spawn } from 'node:child_process';
import { mkdtempSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { createConnection, createServer, type AddressInfo } from 'node:net';
import tls from 'node:tls';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import OpenAI from 'openai';
import { Agent, request } from 'undici';
import { BIN, Cluster, freePort } from '../../src/up/cluster.js';
import { bodyDigest, httpKeyOf, signRequest, SIGNATURE_HEADER } from '../../src/security/request-auth.js';
import { cli } from '../helpers/cli.js';
import { makeTestPki, type TestPki } from '../helpers/tls.js';
import { promptOf, tinyModel, waitFor } from '../helpers/stack.js';

const API_KEY = 'sk-test-api-key-0123456789';
/** A second tenant's key. */
const OTHER_KEY = 'sk-test-other-tenant-key-555';
const ADMIN_KEY = 'sk-test-admin-key-9876543210';
const FILE_KEY_1 = 'sk-file-key-one-aaaaaaaa';
const FILE_KEY_2 = 'sk-file-key-two-bbbbbbbb';

let c: Cluster;
let logDir: string;
let keyFile: string;
let pki: TestPki;
/** The doctor's flags of internal TLS (the workers ask for a client certificate). */
let doctorTls: string[];

/** A pool with the cluster's CA and client certificate (no signatures: requests to /health only here). */
let certified: Agent | undefined;
const plain2 = () => (certified ??= new Agent({ connect: { ca: pki.pem.ca, cert: pki.pem.cert, key: pki.pem.key } }));
const sdk = (apiKey: string, extra: Partial<ConstructorParameters<typeof OpenAI>[0]> = {}) => new OpenAI({ baseURL: `${c.router.url}/v1`, apiKey, timeout: 30_000, maxRetries: 0, ...extra });
const get = (path: string, headers: Record<string, string> = {}) => fetch(`${c.router.url}${path}`, { headers, signal: AbortSignal.timeout(5000) });
const bearer = (k: string) => ({ authorization: `Bearer ${k}` });

before(async () => {
  logDir = mkdtempSync(join(tmpdir(), 'pdserve-trust-'));
  keyFile = join(logDir, 'api-keys');
  writeFileSync(keyFile, `# rotated by the test\n${FILE_KEY_1}\n`);
  pki = makeTestPki();
  doctorTls = ['--internal-tls-ca', pki.ca, '--internal-tls-cert', pki.cert, '--internal-tls-key', pki.key];
  c = new Cluster({
    model: await tinyModel(),
    prefill: 1,
    decode: 1,
    ctxSize: 512,
    batchSize: 128,
    decodeSlots: 4,
    logDir,
    access: { apiKeys: [API_KEY, OTHER_KEY], adminApiKeys: [ADMIN_KEY], routerArgs: ['--api-key-file', keyFile] },
    internalTls: { cert: pki.cert, key: pki.key, ca: pki.ca },
    // Every KV handoff crosses the (TLS) channel: no same-host file handoff.
    extraArgs: { prefill: ['--no-kv-same-host'], decode: ['--no-kv-same-host'] },
  });
  try {
    await c.start();
  } catch (err) {
    await c.stop();
    throw err;
  }
});
after(async () => {
  await certified?.close();
  await c?.stop();
});

describe('API keys on the router', () => {
  test('the openai SDK with a wrong key and with no key gets 401 invalid_api_key; the right key works', async () => {
    const wrong = await sdk('sk-wrong').completions.create({ model: 'pdserve', prompt: 'hi', max_tokens: 2 }).then(
      () => null,
      (e: unknown) => e,
    );
    assert.ok(wrong instanceof OpenAI.AuthenticationError, `wrong key: ${String(wrong)}`);
    assert.equal(wrong.status, 401);
    assert.equal(wrong.code, 'invalid_api_key');
    assert.equal((wrong.error as { type?: string }).type, 'authentication_error');
    assert.ok(!JSON.stringify(wrong.error).includes('sk-wrong'), 'the key is not echoed');
    // No Authorization header at all (the SDK's null header removes it).
    const missing = await sdk('unused', { defaultHeaders: { Authorization: null } }).chat.completions.create({ model: 'pdserve', messages: [{ role: 'user', content: 'hi' }], max_tokens: 2 }).then(
      () => null,
      (e: unknown) => e,
    );
    assert.ok(missing instanceof OpenAI.AuthenticationError, `missing key: ${String(missing)}`);
    assert.equal(missing.code, 'invalid_api_key');
    assert.match(missing.message, /didn't provide an API key/);
    const okRes = await sdk(API_KEY).completions.create({ model: 'pdserve', prompt: 'the river', max_tokens: 3, temperature: 0 });
    assert.equal(okRes.choices.length, 1);
    // n > 1: the choices run in process, under the client's key (its tenant).
    const n2 = await sdk(API_KEY).completions.create({ model: 'pdserve', prompt: 'the river', max_tokens: 2, n: 2 });
    assert.equal(n2.choices.length, 2);
    assert.equal((await sdk(API_KEY).models.list()).data.length > 0, true);
    assert.doesNotMatch(readFileSync(join(logDir, 'router.log'), 'utf8'), /is OPEN/, 'a router with keys does not call itself open');
  });

  test('every /v1/* route (by prefix), /tokenize and /detokenize need the key; /health is open', async () => {
    for (const path of ['/v1/models', '/v1/responses', '/v1/anything/new', '/tokenize']) {
      const r = await get(path);
      assert.equal(r.status, 401, path);
      assert.equal(((await r.json()) as { error: { code: string } }).error.code, 'invalid_api_key');
    }
    const t = await fetch(`${c.router.url}/tokenize`, { method: 'POST', headers: { 'content-type': 'application/json', ...bearer(API_KEY) }, body: JSON.stringify({ prompt: 'hello' }), signal: AbortSignal.timeout(5000) });
    assert.equal(t.status, 200);
    assert.equal((await get('/health')).status, 200);
    assert.equal((await get('/metrics')).status, 200, '/metrics open by default');
  });

  test('the key file is re-read when it changes: a rotated-in key works, a rotated-out one is refused', async () => {
    assert.equal((await get('/v1/models', bearer(FILE_KEY_1))).status, 200);
    assert.equal((await get('/v1/models', bearer(FILE_KEY_2))).status, 401);
    writeFileSync(keyFile, `${FILE_KEY_2}\n`);
    assert.ok(await waitFor(async () => (await get('/v1/models', bearer(FILE_KEY_2))).status === 200, 5000, 100), 'the new key is accepted within seconds');
    assert.equal((await get('/v1/models', bearer(FILE_KEY_1))).status, 401);
    assert.equal((await get('/v1/models', bearer(API_KEY))).status, 200, 'keys from the environment stay');
  });
});

describe('tenants: one per API key', () => {
  /** prompt_tokens_details.cached_tokens of a greedy 2-token completion of `prompt` with `key` (and a cache_salt). */
  const cached = async (key: string, prompt: string, salt?: string): Promise<number> => {
    const r = await sdk(key).completions.create({ model: 'pdserve', prompt, max_tokens: 2, temperature: 0, ...(salt ? { cache_salt: salt } : {}) } as OpenAI.CompletionCreateParamsNonStreaming);
    return (r.usage as { prompt_tokens_details?: { cached_tokens?: number } }).prompt_tokens_details?.cached_tokens ?? -1;
  };

  test("another key's cached_tokens for the same prompt is 0 (the prefix cache is salted by the key); a shared cache_salt shares it", async () => {
    const p = promptOf(300, 41);
    assert.equal(await cached(API_KEY, p), 0, 'cold');
    const again = await cached(API_KEY, p);
    assert.ok(again > 200, `the same key reuses its prompt: ${again}`);
    assert.equal(await cached(OTHER_KEY, p), 0, "another key learns nothing of the first key's prompt");
    assert.ok((await cached(API_KEY, p)) > 200, 'the first key still reuses its own');
    const r = promptOf(300, 43);
    assert.equal(await cached(API_KEY, r), 0);
    assert.equal(await cached(OTHER_KEY, `${r.slice(0, 200)} something else`), 0, 'nor of a prefix of it');
    const q = promptOf(300, 42);
    assert.equal(await cached(API_KEY, q, 'team-7'), 0);
    const shared = await cached(OTHER_KEY, q, 'team-7');
    assert.ok(shared > 200, `the same cache_salt shares across keys: ${shared}`);
    // without the salt: the key's own partition, which holds none of q's state — only what any
    // prompt of this key would find there (the opening every prompt starts with: BOS and the first
    // piece, kept by the key's own earlier requests), measured on a prompt no key ever sent
    const fresh = await cached(OTHER_KEY, promptOf(300, 45));
    const own = await cached(OTHER_KEY, q);
    assert.ok(own <= fresh && fresh < 8, `without it the key's own partition: nothing of team-7's ${shared} tokens (${own}; a never-sent prompt: ${fresh})`);
  });

  test('/v1/responses takes cache_salt as chat does: salted by the key without it, shared across keys with the same one', async () => {
    const viaResponses = async (key: string, input: string, salt?: string): Promise<number> => {
      const r = await sdk(key).responses.create({ model: 'pdserve', input, max_output_tokens: 2, temperature: 0, store: false, ...(salt ? { cache_salt: salt } : {}) } as OpenAI.Responses.ResponseCreateParamsNonStreaming);
      return r.usage?.input_tokens_details.cached_tokens ?? -1;
    };
    const p = promptOf(300, 44);
    assert.equal(await viaResponses(API_KEY, p, 'team-9'), 0, 'cold');
    const shared = await viaResponses(OTHER_KEY, p, 'team-9');
    assert.ok(shared > 200, `the same cache_salt shares across keys on /v1/responses: ${shared}`);
    const fresh = await viaResponses(OTHER_KEY, promptOf(300, 46)); // what any prompt finds in the key's own partition (its opening)
    const alone = await viaResponses(OTHER_KEY, p);
    assert.ok(alone <= fresh && fresh < 8, `without it the key's own partition: nothing of team-9's ${shared} tokens (${alone}; a never-sent prompt: ${fresh})`);
    const own = await viaResponses(OTHER_KEY, p);
    assert.ok(own > 200, `the key reuses its own partition: ${own}`);
    const bad = await fetch(`${c.router.url}/v1/responses`, { method: 'POST', headers: { ...bearer(API_KEY), 'content-type': 'application/json' }, body: JSON.stringify({ model: 'pdserve', input: 'x', cache_salt: '' }), signal: AbortSignal.timeout(15_000) });
    assert.equal(bad.status, 400, 'an empty cache_salt is refused as on chat');
    assert.equal(((await bad.json()) as { error: { param: string } }).error.param, 'cache_salt');
  });

  test("another key gets 404 for a stored Response (get, input_items, delete) and 400 for its previous_response_id; the owner keeps it", async () => {
    const created = await sdk(API_KEY).responses.create({ model: 'pdserve', input: 'the river ran', max_output_tokens: 3, temperature: 0 });
    const id = created.id;
    const call = (key: string, method: string, path: string, body?: unknown) => fetch(`${c.router.url}${path}`, { method, headers: { ...bearer(key), ...(body ? { 'content-type': 'application/json' } : {}) }, ...(body ? { body: JSON.stringify(body) } : {}), signal: AbortSignal.timeout(15_000) });
    for (const [method, path] of [['GET', `/v1/responses/${id}`], ['GET', `/v1/responses/${id}/input_items`], ['DELETE', `/v1/responses/${id}`]] as const) {
      const r = await call(OTHER_KEY, method, path);
      assert.equal(r.status, 404, `${method} ${path} with another key`);
      assert.equal(((await r.json()) as { error: { code: string } }).error.code, 'not_found');
    }
    const cont = await call(OTHER_KEY, 'POST', '/v1/responses', { model: 'pdserve', input: 'and then', previous_response_id: id, max_output_tokens: 2 });
    assert.equal(cont.status, 400);
    assert.equal(((await cont.json()) as { error: { code: string } }).error.code, 'previous_response_not_found');
    const own = await call(API_KEY, 'GET', `/v1/responses/${id}`);
    assert.equal(own.status, 200, 'the owner still has it (the other key could not delete it)');
    assert.equal(((await own.json()) as { id: string }).id, id);
    const next = await sdk(API_KEY).responses.create({ model: 'pdserve', input: 'and then', previous_response_id: id, max_output_tokens: 2, temperature: 0 });
    assert.equal(next.previous_response_id, id, 'the owner continues it');
    assert.equal((await call(API_KEY, 'DELETE', `/v1/responses/${id}`)).status, 200);
  });
});

describe('the admin key', () => {
  test('guards /workers, /debug/*, /dashboard; an API key is not enough; a browser gets a Basic challenge', async () => {
    for (const path of ['/workers', '/debug/traces', '/dashboard', '/dashboard/data']) {
      assert.equal((await get(path)).status, 401, path);
      assert.equal((await get(path, bearer(API_KEY))).status, 401, `${path} with an API key`);
      assert.equal((await get(path, bearer(ADMIN_KEY))).status, 200, `${path} with the admin key`);
    }
    const probe = await fetch(`${c.router.url}/workers/probe`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ url: c.byRole('decode')[0]!.url }) });
    assert.equal(probe.status, 401);
    const page = await get('/dashboard');
    assert.match(page.headers.get('www-authenticate') ?? '', /^Basic /);
    const basic = `Basic ${Buffer.from(`admin:${ADMIN_KEY}`).toString('base64')}`;
    assert.equal((await get('/dashboard', { authorization: basic })).status, 200);
  });

  test('pdserve doctor sends the admin key from PDSERVE_ADMIN_API_KEY; without it the router refuses it', async () => {
    const withKey = await cli(['doctor', '--url', c.router.url, '--json', ...doctorTls], 20_000, { PDSERVE_ADMIN_API_KEY: ADMIN_KEY });
    const d = JSON.parse(withKey.out) as { exit_code: number; findings: { title: string }[] };
    assert.ok(d.exit_code <= 1, withKey.out);
    assert.ok(!d.findings.some((f) => /401/.test(f.title)), withKey.out);
    const without = await cli(['doctor', '--url', c.router.url, '--json', ...doctorTls], 20_000, { PDSERVE_ADMIN_API_KEY: '' });
    assert.match(without.out, /401/);
    assert.ok(!`${withKey.out}${withKey.err}`.includes(ADMIN_KEY), 'doctor output has no key');
  });
});

describe('signed worker requests', () => {
  /** A dispatcher that adds no signature (this process's global one signs requests to the cluster's workers), with the cluster's client certificate. */
  let plain: Agent;
  before(() => void (plain = new Agent({ connect: { ca: pki.pem.ca, cert: pki.pem.cert, key: pki.pem.key } })));
  after(() => plain.close());
  const call = async (url: string, method: 'GET' | 'POST', path: string, body?: string, signature?: string) => {
    const res = await request(`${url}${path}`, { method, dispatcher: plain, headers: { 'content-type': 'application/json', ...(signature ? { [SIGNATURE_HEADER]: signature } : {}) }, body, signal: AbortSignal.timeout(5000) });
    const text = await res.body.text();
    return { status: res.statusCode, text };
  };
  const refusals = async (url: string) => {
    const m = await call(url, 'GET', '/metrics');
    return Object.fromEntries([...m.text.matchAll(/^pdserve_http_auth_refused_total\{reason="(\w+)"\} (\d+)/gm)].map((x) => [x[1]!, Number(x[2])]));
  };

  test('a worker reached directly without a signature refuses everything but /health and /metrics, and counts it', async () => {
    for (const w of [c.byRole('prefill')[0]!, c.byRole('decode')[0]!]) {
      const gen = await call(w.url, 'POST', '/generate', JSON.stringify({ rid: 'x', text: 'hi', bootstrap_host: '127.0.0.1', bootstrap_port: 1, bootstrap_room: 1 }));
      assert.equal(gen.status, 401, `${w.name} /generate`);
      assert.equal(JSON.parse(gen.text).error.code, 'unauthenticated');
      assert.equal((await call(w.url, 'POST', '/abort_request', '{"rid":"x"}')).status, 401, `${w.name} /abort_request`);
      const rooms = await call(w.url, 'GET', '/debug/rooms');
      assert.equal(rooms.status, 401, `${w.name} /debug/rooms`);
      assert.match(JSON.parse(rooms.text).error.message, /GET <router>\/debug\/rooms.*pdserve doctor --url <router>/, 'the 401 names what works');
      assert.equal((await call(w.url, 'GET', '/v1/models')).status, 401, `${w.name} /v1/models`);
      assert.equal((await call(w.url, 'GET', '/health')).status, 200);
      assert.ok(((await refusals(w.url)).missing ?? 0) >= 4, `${w.name} counts the refusals`);
    }
  });

  test("the router's GET /debug/rooms (admin key) reads every worker's rooms, signed", async () => {
    const res = await get('/debug/rooms', bearer(ADMIN_KEY));
    assert.equal(res.status, 200);
    const { workers } = (await res.json()) as { workers: { role: string; url: string; error: string | null; rooms: { role: string; live: unknown[]; recent: unknown[] } | null }[] };
    assert.deepEqual(workers.map((w) => w.url).sort(), [...c.byRole('prefill'), ...c.byRole('decode')].map((p) => p.url).sort());
    for (const w of workers) {
      assert.equal(w.error, null, w.url);
      assert.equal(w.rooms?.role, w.role, w.url);
      assert.ok(Array.isArray(w.rooms?.recent), w.url);
    }
    assert.equal((await get('/debug/rooms')).status, 401, 'without the admin key');
  });

  test('a replayed, an old, a changed or a wrongly keyed signature is refused; a fresh one is accepted once', async () => {
    const w = c.byRole('decode')[0]!;
    const key = httpKeyOf(c.secret);
    const body = JSON.stringify({ rid: 'no-such-rid' });
    const sig = signRequest(key, 'POST', '/abort_request', bodyDigest(body));
    assert.equal((await call(w.url, 'POST', '/abort_request', body, sig)).status, 200, 'fresh');
    const replay = await call(w.url, 'POST', '/abort_request', body, sig);
    assert.equal(replay.status, 401, 'replayed');
    assert.match(JSON.parse(replay.text).error.message, /already used/);
    assert.equal((await call(w.url, 'POST', '/abort_request', body, signRequest(key, 'POST', '/abort_request', bodyDigest(body), Date.now() - 120_000))).status, 401, 'old');
    assert.equal((await call(w.url, 'POST', '/abort_request', '{"rid":"other"}', signRequest(key, 'POST', '/abort_request', bodyDigest(body)))).status, 401, 'another body');
    assert.equal((await call(w.url, 'GET', '/debug/rooms', undefined, signRequest(key, 'GET', '/debug/rooms?x=1', bodyDigest('')))).status, 401, 'another path');
    assert.equal((await call(w.url, 'POST', '/abort_request', body, signRequest(httpKeyOf('another-secret'), 'POST', '/abort_request', bodyDigest(body)))).status, 401, 'another secret');
    const r = await refusals(w.url);
    assert.equal(r.replayed, 1);
    assert.equal(r.expired, 1);
    assert.equal(r.bad_signature, 3);
    // The router's own calls (signed by its dispatcher) still go through.
    assert.equal((await sdk(API_KEY).completions.create({ model: 'pdserve', prompt: 'signed', max_tokens: 2 })).choices.length, 1);
  });
});

describe('decode dials only prefills it knows', () => {
  test('a /generate naming a forged bootstrap address is a 400 and the address is never dialed', async () => {
    const dialed: string[] = [];
    const trap = createServer((sock) => {
      dialed.push(String(sock.remoteAddress));
      sock.destroy();
    });
    await new Promise<void>((r) => trap.listen(0, '127.0.0.1', r));
    const port = (trap.address() as AddressInfo).port;
    try {
      const d = c.byRole('decode')[0]!;
      // Signed by this process's dispatcher (the harness's cluster): only the address is wrong.
      const res = await fetch(`${d.url}/generate`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ rid: 'forged-1', text: 'hi', sampling_params: { max_new_tokens: 2 }, bootstrap_host: '127.0.0.1', bootstrap_port: port, bootstrap_room: 12345 }), signal: AbortSignal.timeout(5000) });
      assert.equal(res.status, 400);
      const e = ((await res.json()) as { error: { code: string; param: string } }).error;
      assert.equal(e.code, 'unknown_bootstrap_address');
      assert.equal(e.param, 'bootstrap_host');
      await new Promise((r) => setTimeout(r, 300));
      assert.deepEqual(dialed, [], 'the forged address saw no connection');
      const m = await (await fetch(`${d.url}/metrics`, { signal: AbortSignal.timeout(5000) })).text();
      assert.match(m, /^pdserve_bootstrap_refused_total 1$/m);
      // The prefill the router's probes named is dialable: the PD path still works.
      assert.equal((await sdk(API_KEY).completions.create({ model: 'pdserve', prompt: 'known', max_tokens: 2 })).choices.length, 1);
    } finally {
      trap.close();
    }
  });
});

describe('internal TLS (mutual, HTTP and the KV channel)', () => {
  /** How a TLS connection to host:port with these client options ends: its first bytes, or the error that ended it. */
  const tlsProbe = (port: number, opts: tls.ConnectionOptions) =>
    new Promise<{ bytes: number; error?: string }>((resolve) => {
      let bytes = 0;
      const sock = tls.connect({ host: '127.0.0.1', port, ...opts });
      const end = (error?: string) => {
        clearTimeout(t);
        sock.destroy();
        resolve({ bytes, ...(error ? { error } : {}) });
      };
      const t = setTimeout(() => end(), 3000);
      sock.on('data', (b: Buffer) => {
        bytes += b.length;
        end();
      });
      sock.on('error', (e: Error) => end(e.message));
      sock.on('close', () => end('closed'));
    });

  test('a worker reached without a client certificate the CA signed is refused in the TLS handshake (HTTP and bootstrap port)', async () => {
    const stranger = new Agent({ connect: { ca: pki.pem.ca, cert: pki.pem.strangerCert, key: pki.pem.strangerKey } });
    const anonymous = new Agent({ connect: { ca: pki.pem.ca } });
    try {
      for (const w of [c.byRole('prefill')[0]!, c.byRole('decode')[0]!]) {
        assert.match(w.url, /^https:/);
        for (const [who, d] of [['no client certificate', anonymous], ["another CA's certificate", stranger]] as const) {
          await assert.rejects(request(`${w.url}/health`, { dispatcher: d, signal: AbortSignal.timeout(5000) }).then((r) => r.body.text()), `${w.name} /health with ${who}`);
        }
        // plain HTTP is not served: answered 400 plain_http_on_tls_port, before any TLS (no certificate asked)
        const plainW = await fetch(w.url.replace('https:', 'http:') + '/health', { signal: AbortSignal.timeout(3000) });
        assert.deepEqual([plainW.status, ((await plainW.json()) as { error: { code: string } }).error.code], [400, 'plain_http_on_tls_port'], `${w.name}: plain HTTP is not served`);
        // The cluster's certificate gets through TLS (and /health is open).
        assert.equal((await request(`${w.url}/health`, { dispatcher: plain2(), signal: AbortSignal.timeout(5000) })).statusCode, 200);
      }
      // The KV channel: prefill says hello at once to a peer with the cluster's certificate, nothing to one without.
      const bp = c.byRole('prefill')[0]!.bootstrapPort!;
      const ok = await tlsProbe(bp, { ca: pki.pem.ca, cert: pki.pem.cert, key: pki.pem.key });
      assert.ok(ok.bytes > 0, `a peer with the certificate gets the KV hello: ${JSON.stringify(ok)}`);
      for (const opts of [{ ca: pki.pem.ca }, { ca: pki.pem.ca, cert: pki.pem.strangerCert, key: pki.pem.strangerKey }]) {
        const refused = await tlsProbe(bp, opts);
        assert.equal(refused.bytes, 0, `no KV byte without the right certificate: ${JSON.stringify(refused)}`);
        assert.ok(refused.error, 'the connection is ended');
      }
      const raw = await new Promise<number>((resolve) => {
        let n = 0;
        const s = createConnection({ host: '127.0.0.1', port: bp }, () => s.write('{"type":"auth"}\n'));
        s.on('data', (b) => (n += b.length));
        s.on('error', () => {});
        s.on('close', () => resolve(n));
        setTimeout(() => s.destroy(), 3000);
      });
      // A TLS server answers bytes that are no TLS handshake with an alert at most (a few bytes), never a KV frame.
      assert.ok(raw < 64, `plain TCP to the bootstrap port gets no KV hello (${raw} bytes)`);
    } finally {
      await Promise.all([stranger.close(), anonymous.close()]);
    }
  });

  test('a request goes router → prefill → decode over mutual TLS, its KV through the TLS channel; doctor and the dashboard reach the workers', async () => {
    const d = c.byRole('decode')[0]!;
    const handoffs = async () => Number(/^pdserve_kv_handoffs_total\{path="tcp"\} (\d+)/m.exec(await (await fetch(`${d.url}/metrics`, { signal: AbortSignal.timeout(5000) })).text())?.[1] ?? 0);
    const before = await handoffs();
    const r = await sdk(API_KEY).chat.completions.create({ model: 'pdserve', messages: [{ role: 'user', content: 'over mutual tls' }], max_tokens: 4, temperature: 0 });
    assert.ok(r.choices[0]!.message.content !== null);
    assert.equal(await handoffs(), before + 1, 'one KV handoff over the channel (tcp path, TLS transport)');
    const dash = (await (await get('/dashboard/data', bearer(ADMIN_KEY))).json()) as { workers?: { url: string; reachable?: boolean; error?: string | null }[] };
    assert.ok(JSON.stringify(dash).includes(d.url), 'the dashboard lists the https:// worker');
    const doc = await cli(['doctor', '--url', c.router.url, '--json', ...doctorTls], 20_000, { PDSERVE_ADMIN_API_KEY: ADMIN_KEY, PDSERVE_CLUSTER_SECRET: c.secret });
    const findings = (JSON.parse(doc.out) as { findings: { title: string }[] }).findings.map((f) => f.title).join('\n');
    assert.doesNotMatch(findings, /unreachable|not answer|failed|certificate|ECONN/i, doc.out);
    // Without the internal TLS flags the doctor cannot reach the workers, and says so.
    const blind = await cli(['doctor', '--url', c.router.url, '--json'], 20_000, { PDSERVE_ADMIN_API_KEY: ADMIN_KEY, PDSERVE_CLUSTER_SECRET: c.secret });
    assert.match((JSON.parse(blind.out) as { findings: { title: string }[] }).findings.map((f) => f.title).join('\n'), /unreachable/, blind.out);
  });
});

describe('TLS for clients', () => {
  test('the openai SDK talks to a router over HTTPS with the test CA; without the CA the handshake fails', async (t) => {
    const dir = mkdtempSync(join(tmpdir(), 'pdserve-tls-'));
    const ssl = (...args: string[]) => execFileSync('openssl', args, { cwd: dir, stdio: 'pipe' });
    ssl('req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes', '-keyout', 'ca.key', '-out', 'ca.crt', '-days', '1', '-subj', '/CN=pdserve test CA');
    ssl('req', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes', '-keyout', 'srv.key', '-out', 'srv.csr', '-subj', '/CN=127.0.0.1');
    writeFileSync(join(dir, 'san.ext'), 'subjectAltName=IP:127.0.0.1,DNS:localhost\n');
    ssl('x509', '-req', '-in', 'srv.csr', '-CA', 'ca.crt', '-CAkey', 'ca.key', '-CAcreateserial', '-out', 'srv.crt', '-days', '1', '-extfile', 'san.ext');
    const port = await freePort();
    const p = c.byRole('prefill')[0]!;
    // This router takes the cluster secret on its command line (it must warn) and keeps /metrics behind its key.
    const args = [BIN, 'router', '--port', String(port), '--prefill', `${p.url},${p.bootstrapPort}`, '--decode', c.byRole('decode')[0]!.url, '--tls-cert', join(dir, 'srv.crt'), '--tls-key', join(dir, 'srv.key'), '--key-rps', '0.01', '--key-burst', '2', '--private-metrics', '--cluster-secret', c.secret, ...doctorTls];
    const child = spawn(process.execPath, args, { stdio: ['ignore', 'ignore', 'pipe'], env: { ...process.env, PDSERVE_CLUSTER_SECRET: '', PDSERVE_CLUSTER_SECRET_FILE: '', PDSERVE_API_KEY: API_KEY } });
    let stderr = '';
    child.stderr!.on('data', (d: Buffer) => (stderr += d.toString()));
    // gone before the ps scan of 'secrets stay secret'
    t.after(() => new Promise<void>((r) => (child.exitCode !== null || child.signalCode !== null ? r() : (child.once('exit', () => r()), child.kill('SIGKILL')))));
    const trusted = new Agent({ connect: { ca: readFileSync(join(dir, 'ca.crt')) } });
    t.after(() => trusted.close());
    const url = `https://127.0.0.1:${port}`;
    assert.ok(await waitFor(async () => (await request(`${url}/health`, { dispatcher: trusted })).statusCode === 200, 20_000, 100), 'the HTTPS router is up');
    // plain HTTP to the TLS port (curl http://…): an answer that names the mistake, not an empty reply
    const plain = await request(`http://127.0.0.1:${port}/health`);
    const plainBody = (await plain.body.json()) as { error: { code: string; message: string } };
    assert.equal(plain.statusCode, 400);
    assert.equal(plainBody.error.code, 'plain_http_on_tls_port');
    assert.match(plainBody.error.message, /https:\/\//);
    assert.match(stderr, /warning: --cluster-secret on the command line is visible to every local user \(ps\)/);
    assert.ok(!stderr.includes(c.secret), 'the warning does not repeat the secret');
    const metrics = (key?: string) => request(`${url}/metrics`, { dispatcher: trusted, headers: key ? bearer(key) : {} }).then(async (res) => (await res.body.text(), res.statusCode));
    assert.deepEqual([await metrics(), await metrics('sk-wrong'), await metrics(API_KEY)], [401, 401, 200], '--private-metrics: /metrics needs the key (the API key, with no admin key configured)');
    const secure = new OpenAI({ baseURL: `${url}/v1`, apiKey: API_KEY, maxRetries: 0, timeout: 30_000, fetchOptions: { dispatcher: trusted } as never });
    const r = await secure.completions.create({ model: 'pdserve', prompt: 'over tls', max_tokens: 3, temperature: 0 });
    assert.equal(r.choices.length, 1);
    const streamed = await secure.chat.completions.create({ model: 'pdserve', messages: [{ role: 'user', content: 'hi' }], max_tokens: 3, n: 2, stream: true });
    let chunks = 0;
    for await (const _ of streamed) chunks++;
    assert.ok(chunks > 0, 'a fanned-out stream over HTTPS (its choices in process, the request admitted once)');
    // Admission: the key's bucket (burst 2) is empty: the third generation request is a 429 with retry-after.
    const limited = await secure.completions.create({ model: 'pdserve', prompt: 'one more', max_tokens: 2 }).then(
      () => null,
      (e: unknown) => e,
    );
    assert.ok(limited instanceof OpenAI.RateLimitError, `rate limited: ${String(limited)}`);
    assert.equal(limited.code, 'rate_limited');
    assert.ok(Number(limited.headers?.get('retry-after')) >= 1);
    const untrusted = new OpenAI({ baseURL: `${url}/v1`, apiKey: API_KEY, maxRetries: 0, timeout: 10_000 });
    await assert.rejects(untrusted.models.list(), (e: unknown) => e instanceof OpenAI.APIConnectionError);
  });

  test('colocated takes the same keys and HTTPS: the openai SDK with a wrong or no key gets 401, the admin key guards /debug/*, /health is open, past its cap a request is a 429, no CA no handshake', async (t) => {
    const port = await freePort();
    // admission: one generation request at a time, none queued
    const args = [BIN, 'colocated', '--model', await tinyModel(), '--port', String(port), '--ctx-size', '512', '--threads', '1', '--slots', '1', '--tls-cert', pki.cert, '--tls-key', pki.key, '--max-concurrent-requests', '1', '--max-queued-requests', '0'];
    const child = spawn(process.execPath, args, { stdio: 'ignore', env: { ...process.env, PDSERVE_API_KEY: API_KEY, PDSERVE_ADMIN_API_KEY: ADMIN_KEY } });
    t.after(() => void child.kill('SIGKILL'));
    const trusted = new Agent({ connect: { ca: pki.pem.ca } });
    t.after(() => trusted.close());
    const url = `https://127.0.0.1:${port}`;
    assert.ok(await waitFor(async () => (await request(`${url}/health`, { dispatcher: trusted })).statusCode === 200, 30_000, 100), 'the HTTPS colocated server is up, /health without a key');
    const colo = (apiKey: string, extra: Partial<ConstructorParameters<typeof OpenAI>[0]> = {}) => new OpenAI({ baseURL: `${url}/v1`, apiKey, maxRetries: 0, timeout: 30_000, fetchOptions: { dispatcher: trusted } as never, ...extra });
    const refusal = (p: Promise<unknown>) => p.then(() => null, (e: unknown) => e);
    for (const [what, client] of [['wrong key', colo('sk-wrong')], ['admin key as an API key', colo(ADMIN_KEY)], ['no key', colo('unused', { defaultHeaders: { Authorization: null } })]] as const) {
      const e = await refusal(client.completions.create({ model: 'pdserve', prompt: 'hi', max_tokens: 2 }));
      assert.ok(e instanceof OpenAI.AuthenticationError, `${what}: ${String(e)}`);
      assert.equal(e.status, 401, what);
      assert.equal(e.code, 'invalid_api_key', what);
    }
    const r = await colo(API_KEY).completions.create({ model: 'pdserve', prompt: 'colocated', max_tokens: 2, temperature: 0 });
    assert.equal(r.choices.length, 1);
    const debug = (key?: string) => request(`${url}/debug/rooms`, { dispatcher: trusted, headers: key ? { authorization: `Bearer ${key}` } : {} }).then(async (res) => (await res.body.text(), res.statusCode));
    assert.deepEqual([await debug(), await debug(API_KEY), await debug(ADMIN_KEY)], [401, 401, 200], '/debug/rooms: the admin key only');
    // At its cap (1, no queue): while one stream runs, the next request is a 429 with retry-after; then it is served again.
    const running = await colo(API_KEY).completions.create({ model: 'pdserve', prompt: 'a long one', max_tokens: 24, temperature: 0, stream: true });
    const it = running[Symbol.asyncIterator]();
    assert.equal((await it.next()).done, false, 'the first request is streaming');
    const full = await refusal(colo(API_KEY).completions.create({ model: 'pdserve', prompt: 'one too many', max_tokens: 2 }));
    assert.ok(full instanceof OpenAI.RateLimitError, `at the cap: ${String(full)}`);
    assert.equal(full.code, 'rate_limited');
    assert.match(full.message, /at its limit of 1 requests with 0 waiting/);
    assert.ok(Number(full.headers?.get('retry-after')) >= 1, 'retry-after');
    while (!(await it.next()).done);
    assert.equal((await colo(API_KEY).completions.create({ model: 'pdserve', prompt: 'after', max_tokens: 2, temperature: 0 })).choices.length, 1, 'served again once the first ended');
    const refused = await (await request(`${url}/metrics`, { dispatcher: trusted })).body.text();
    assert.match(refused, /^pdserve_admission_refused_total\{reason="queue_full"\} 1$/m);
    const untrusted = new OpenAI({ baseURL: `${url}/v1`, apiKey: API_KEY, maxRetries: 0, timeout: 10_000 });
    await assert.rejects(untrusted.models.list(), (e: unknown) => e instanceof OpenAI.APIConnectionError);
  });
});

describe('secrets stay secret', () => {
  test('no key or cluster secret in the logs, /workers, /debug/traces, doctor output or ps output', async () => {
    const ps = execFileSync('ps', ['-eo', 'args'], { encoding: 'utf8' });
    const views = [await (await get('/workers', bearer(ADMIN_KEY))).text(), await (await get('/debug/traces', bearer(ADMIN_KEY))).text(), (await cli(['doctor', '--url', c.router.url, ...doctorTls], 20_000, { PDSERVE_ADMIN_API_KEY: ADMIN_KEY, PDSERVE_CLUSTER_SECRET: c.secret })).out].join('\n');
    assert.match(views, /prefill/);
    const logs = readdirSync(logDir).filter((f) => f.endsWith('.log')).map((f) => readFileSync(join(logDir, f), 'utf8')).join('\n');
    assert.ok(logs.includes('router listening'), 'the logs were read');
    // The internal TLS private key (its base64 body) stays in its file.
    const tlsKey = readFileSync(pki.key, 'utf8').split('\n').filter((l) => l && !l.startsWith('-----')).join('');
    for (const s of [API_KEY, ADMIN_KEY, FILE_KEY_1, FILE_KEY_2, c.secret, tlsKey.slice(0, 40)]) {
      assert.ok(!ps.includes(s), 'ps shows no key or secret');
      assert.ok(!logs.includes(s), 'the logs hold no key or secret');
      assert.ok(!views.includes(s), '/workers, traces and doctor show no key or secret');
    }
  });
});
