/**
 * The trust model on a real cluster through the real CLI (SECURITY.md):
 *  - API keys on the router: the openai SDK with a wrong and with a missing key gets 401
 *    `invalid_api_key`; the right key (from the environment or from the key file, which is
 *    re-read when it changes) works, fanned-out n > 1 too; /health stays open;
 *  - the admin key guards /workers, /debug/*, /dashboard (Basic for a browser) and is what
 *    `pdserve doctor` sends (PDSERVE_ADMIN_API_KEY);
 *  - no key or secret in any log file or in `ps` output.
 */
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import OpenAI from 'openai';
import { Cluster } from '../../src/harness/cluster.js';
import { cli } from '../helpers/cli.js';
import { tinyModel, waitFor } from '../helpers/stack.js';

const API_KEY = 'sk-test-api-key-0123456789';
const ADMIN_KEY = 'sk-test-admin-key-9876543210';
const FILE_KEY_1 = 'sk-file-key-one-aaaaaaaa';
const FILE_KEY_2 = 'sk-file-key-two-bbbbbbbb';

let c: Cluster;
let logDir: string;
let keyFile: string;

const sdk = (apiKey: string, extra: Partial<ConstructorParameters<typeof OpenAI>[0]> = {}) => new OpenAI({ baseURL: `${c.router.url}/v1`, apiKey, timeout: 30_000, maxRetries: 0, ...extra });
const get = (path: string, headers: Record<string, string> = {}) => fetch(`${c.router.url}${path}`, { headers, signal: AbortSignal.timeout(5000) });
const bearer = (k: string) => ({ authorization: `Bearer ${k}` });

before(async () => {
  logDir = mkdtempSync(join(tmpdir(), 'pdserve-trust-'));
  keyFile = join(logDir, 'api-keys');
  writeFileSync(keyFile, `# rotated by the test\n${FILE_KEY_1}\n`);
  c = new Cluster({ model: await tinyModel(), prefill: 1, decode: 1, ctxSize: 512, batchSize: 128, decodeSlots: 4, logDir, access: { apiKeys: [API_KEY], adminApiKeys: [ADMIN_KEY], routerArgs: ['--api-key-file', keyFile] } });
  try {
    await c.start();
  } catch (err) {
    await c.stop();
    throw err;
  }
});
after(async () => {
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
    // n > 1 fans out over loopback: the sub-requests carry the client's key.
    const n2 = await sdk(API_KEY).completions.create({ model: 'pdserve', prompt: 'the river', max_tokens: 2, n: 2 });
    assert.equal(n2.choices.length, 2);
    assert.equal((await sdk(API_KEY).models.list()).data.length > 0, true);
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
    const withKey = await cli(['doctor', '--url', c.router.url, '--json'], 20_000, { PDSERVE_ADMIN_API_KEY: ADMIN_KEY });
    const d = JSON.parse(withKey.out) as { exit_code: number; findings: { title: string }[] };
    assert.ok(d.exit_code <= 1, withKey.out);
    assert.ok(!d.findings.some((f) => /401/.test(f.title)), withKey.out);
    const without = await cli(['doctor', '--url', c.router.url, '--json'], 20_000, { PDSERVE_ADMIN_API_KEY: '' });
    assert.match(without.out, /401/);
    assert.ok(!`${withKey.out}${withKey.err}`.includes(ADMIN_KEY), 'doctor output has no key');
  });
});

describe('secrets stay secret', () => {
  test('no key or cluster secret in the logs or in ps output', async () => {
    const ps = execFileSync('ps', ['-eo', 'args'], { encoding: 'utf8' });
    const logs = readdirSync(logDir).filter((f) => f.endsWith('.log')).map((f) => readFileSync(join(logDir, f), 'utf8')).join('\n');
    assert.ok(logs.includes('router listening'), 'the logs were read');
    for (const s of [API_KEY, ADMIN_KEY, FILE_KEY_1, FILE_KEY_2, c.secret]) {
      assert.ok(!ps.includes(s), 'ps shows no key or secret');
      assert.ok(!logs.includes(s), 'the logs hold no key or secret');
    }
  });
});
