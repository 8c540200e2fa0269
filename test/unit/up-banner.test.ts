/** The request `pdserve up` prints under "Try:" (up/banner.ts): pasteable against the cluster as started. */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';
import { tryLines } from '../../src/up/banner.js';

const README = readFileSync(new URL('../../README.md', import.meta.url), 'utf8');

test('an open cluster: the curl line is the README quick start\'s, and nothing else', () => {
  const lines = tryLines('http://127.0.0.1:8000', { apiKey: false, https: false });
  const quick = /```sh\n(curl [\s\S]*?)```/.exec(README.slice(README.indexOf('## Quick start')))?.[1];
  assert.ok(quick, 'the README quick start has a curl line');
  assert.deepEqual(lines, [quick.replace(/\\\n\s*/g, '').trim()]);
});

test('API keys and HTTPS: the line sends the key and trusts a CA, and says what the placeholders are', () => {
  const [curl, note, ...rest] = tryLines('https://10.0.0.1:8443', { apiKey: true, https: true });
  assert.deepEqual(rest, []);
  assert.match(curl!, /^curl -s --cacert CA\.pem https:\/\/10\.0\.0\.1:8443\/v1\/completions -H 'authorization: Bearer KEY' -H 'content-type: application\/json' -d '\{.*\}'$/);
  assert.match(note!, /CA\.pem: the CA that signed --tls-cert; KEY: one of the API keys/);
  const [keyOnly, keyNote] = tryLines('http://h:1', { apiKey: true, https: false });
  assert.ok(!keyOnly!.includes('--cacert') && keyOnly!.includes('Bearer KEY'), keyOnly);
  assert.equal(keyNote, '(KEY: one of the API keys)');
});
