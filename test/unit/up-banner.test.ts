/** What `pdserve up` prints for a user to paste (up/banner.ts): the "Try:" request and the doctor command, against the cluster as started. */
import assert from 'node:assert/strict';
import { lstatSync, mkdtempSync, readFileSync, rmSync, statSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { test } from 'node:test';
import { doctorLine, givenSecretFile, tryLines, writeSecretFile } from '../../src/up/banner.js';

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

test('the secret file: 0600, the secret alone, replaces a stale file, never writes through a link; the doctor line names the file, not the secret', () => {
  const dir = mkdtempSync(join(tmpdir(), 'pdserve-banner-'));
  try {
    const path = writeSecretFile(dir, 'generated-secret-1')!;
    assert.equal(path, join(dir, 'cluster-secret'));
    assert.equal(readFileSync(path, 'utf8'), 'generated-secret-1\n');
    assert.equal(statSync(path).mode & 0o777, 0o600);
    // a link left where the file goes (an earlier run's --log-dir, or planted): the link goes, its target is untouched
    const target = join(dir, 'elsewhere');
    writeFileSync(target, 'keep');
    rmSync(path);
    symlinkSync(target, path);
    assert.equal(writeSecretFile(dir, 'generated-secret-2'), path);
    assert.equal(readFileSync(target, 'utf8'), 'keep');
    assert.ok(!lstatSync(path).isSymbolicLink());
    assert.equal(readFileSync(path, 'utf8'), 'generated-secret-2\n');
    assert.equal(writeSecretFile(join(dir, 'no-such-dir'), 's'), null, 'unwritable: null, not a throw');
    const line = doctorLine('http://127.0.0.1:8000', path);
    assert.equal(line, `PDSERVE_CLUSTER_SECRET_FILE=${path} node bin/pdserve.js doctor --url http://127.0.0.1:8000`);
    assert.ok(!line.includes('generated-secret'));
    assert.match(doctorLine('http://h:1', null), /^PDSERVE_CLUSTER_SECRET=<the cluster secret> node bin\/pdserve\.js doctor --url http:\/\/h:1$/);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test('the doctor line of a locked cluster: the admin key (or an API key) by placeholder, --ca for HTTPS, the internal TLS files as given', () => {
  const tls = { cert: '/etc/pd/node.crt', key: '/etc/pd/node.key', ca: '/etc/pd/ca.crt' };
  const line = doctorLine('https://127.0.0.1:8443', '/tmp/l/cluster-secret', { https: true, key: 'ADMIN_KEY', internalTls: tls });
  assert.equal(line, 'PDSERVE_CLUSTER_SECRET_FILE=/tmp/l/cluster-secret PDSERVE_ADMIN_API_KEY=ADMIN_KEY node bin/pdserve.js doctor --url https://127.0.0.1:8443 --ca CA.pem --internal-tls-cert /etc/pd/node.crt --internal-tls-key /etc/pd/node.key --internal-tls-ca /etc/pd/ca.crt');
  assert.match(doctorLine('http://h:1', null, { key: 'KEY' }), /^PDSERVE_CLUSTER_SECRET=<the cluster secret> PDSERVE_ADMIN_API_KEY=KEY node bin\/pdserve\.js doctor --url http:\/\/h:1$/);
  assert.equal(doctorLine('http://h:1', null, { key: null, internalTls: {} }), doctorLine('http://h:1', null), 'an open cluster: nothing added');
});

test("a secret up was given in a file: the doctor line names that file (flag, else the workers' variable), not a placeholder", () => {
  assert.equal(givenSecretFile({ clusterSecretFile: '/etc/pd/secret' }, { PDSERVE_CLUSTER_SECRET: 'x'.repeat(16) }), '/etc/pd/secret', 'the flag wins');
  assert.equal(givenSecretFile({}, { PDSERVE_CLUSTER_SECRET_FILE: 'rel/secret' }), resolve('rel/secret'), 'absolute: doctor may run elsewhere');
  assert.equal(givenSecretFile({}, { PDSERVE_CLUSTER_SECRET: 'x'.repeat(16), PDSERVE_CLUSTER_SECRET_FILE: '/f' }), null, 'the value wins over the file, as for the workers');
  assert.equal(givenSecretFile({}, {}), null);
  assert.equal(doctorLine('https://r:1', givenSecretFile({}, { PDSERVE_CLUSTER_SECRET_FILE: '/etc/pd/secret' }), { key: 'ADMIN_KEY' }), 'PDSERVE_CLUSTER_SECRET_FILE=/etc/pd/secret PDSERVE_ADMIN_API_KEY=ADMIN_KEY node bin/pdserve.js doctor --url https://r:1');
});
