/**
 * What a new user meets first, through the real CLI: a model path that is missing, a directory
 * or not a GGUF file, a busy port, an invalid configuration and a doctor URL without a scheme
 * each end the command with one line on stderr (exit 2 or 3), no stack, before any engine loads;
 * `--version` prints the package's version; a busy port is also told to a supervisor over IPC.
 */
import assert from 'node:assert/strict';
import { fork } from 'node:child_process';
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { createServer, type Server } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, test } from 'node:test';
import { BIN, freePort } from '../../src/up/cluster.js';
import { cli } from '../helpers/cli.js';
import { tinyModel } from '../helpers/stack.js';

const dir = mkdtempSync(join(tmpdir(), 'pdserve-cli-'));
const notGguf = join(dir, 'notes.gguf');
writeFileSync(notGguf, 'these are notes, not weights\n');
const SECRET = { PDSERVE_CLUSTER_SECRET: 'a-secret-of-some-length' };
let busy: Server;
let busyPort = 0;
let model = '';

before(async () => {
  model = await tinyModel();
  busy = createServer();
  await new Promise<void>((r) => busy.listen(0, '127.0.0.1', () => r()));
  busyPort = (busy.address() as { port: number }).port;
});
after(() => busy?.close());

/** One line on stderr, no stack frame, the given exit code. */
function oneLine(r: { code: number | null; err: string }, code: number, re: RegExp): void {
  const lines = r.err.split('\n').filter((l) => l.trim() !== '');
  assert.equal(r.code, code, r.err);
  assert.ok(!/^\s+at /m.test(r.err), `no stack:\n${r.err}`);
  assert.equal(lines.length, 1, `one line:\n${r.err}`);
  assert.match(lines[0]!, re);
}

test('a model path that is missing, a directory or not GGUF: one line from every role and up', async () => {
  const cases: [string[], RegExp][] = [
    [['prefill', '--model', join(dir, 'missing.gguf')], /^pdserve prefill: model .*missing\.gguf: no such file$/],
    [['decode', '--model', dir], /^pdserve decode: model .*: is a directory, not a GGUF file$/],
    [['colocated', '--model', notGguf], /^pdserve colocated: model .*notes\.gguf: is not a GGUF file/],
    [['up', '--model', join(dir, 'missing.gguf'), '--port', '0'], /^pdserve: model .*missing\.gguf: no such file$/],
  ];
  // The commands are independent: run at once, each result checked on its own.
  const results = await Promise.all(cases.map(([args]) => cli(args, 20_000, SECRET)));
  cases.forEach(([, re], i) => oneLine(results[i]!, 2, re));
});

test('a role alone on a busy port: the one line `up` gives, before the engine loads', async () => {
  const want = new RegExp(`cannot listen on 127\\.0\\.0\\.1:${busyPort}: the port is in use \\(pick another with --(port|bootstrap-port)\\)$`);
  const cases: [string[], RegExp][] = [
    [['prefill', '--model', model, '--port', String(busyPort)], want],
    [['prefill', '--model', model, '--port', '0', '--bootstrap-port', String(busyPort)], /--bootstrap-port\)$/],
    [['decode', '--model', model, '--port', String(busyPort)], want],
    [['colocated', '--model', model, '--port', String(busyPort)], want],
    [['router', '--port', String(busyPort), '--prefill', 'http://127.0.0.1:1', '--decode', 'http://127.0.0.1:2'], want],
  ];
  // The commands are independent (the port stays busy throughout): run at once, each result checked on its own.
  const results = await Promise.all(cases.map(([args]) => cli(args, 20_000, SECRET)));
  cases.forEach(([, re], i) => oneLine(results[i]!, 2, re));
});

test('a supervisor that picked the port is told over IPC that it was taken (the harness then picks another)', async () => {
  const child = fork(BIN, ['router', '--port', String(busyPort), '--prefill', 'http://127.0.0.1:1', '--decode', 'http://127.0.0.1:2'], { stdio: ['ignore', 'ignore', 'ignore', 'ipc'], env: { ...process.env, ...SECRET } });
  const msgs: unknown[] = [];
  child.on('message', (m) => msgs.push(m));
  const code = await new Promise<number | null>((r) => child.once('exit', (c) => r(c)));
  assert.equal(code, 2);
  assert.deepEqual(msgs, [{ type: 'start_failed', reason: 'port_in_use', message: `cannot listen on 127.0.0.1:${busyPort}: the port is in use (pick another with --port)` }]);
});

test('an invalid configuration: its message, no stack', async () => {
  const r = await cli(['prefill', '--model', model, '--port', '0', '--bootstrap-port', '0', '--slots', '0'], 20_000, SECRET);
  assert.equal(r.code, 2, r.err);
  assert.ok(!/^\s+at /m.test(r.err), `no stack:\n${r.err}`);
  assert.match(r.err, /^pdserve prefill: invalid configuration:\n\s+slots: .*\n$/);
});

test('a cluster secret under 8 characters: the same one line, saying what to do, from every role and from up before any worker starts', async () => {
  const short = { PDSERVE_CLUSTER_SECRET: 'short' };
  const want = (role: string) => new RegExp(`^pdserve ${role}: the cluster secret is shorter than 8 characters: give the router and every worker the same longer one \\(e\\.g\\. openssl rand -hex 24 > FILE, then PDSERVE_CLUSTER_SECRET_FILE=FILE\\)$`);
  // from a file too, through the workers' own variable, and to doctor: the same words
  const file = join(dir, 'short-secret');
  writeFileSync(file, 'short\n');
  const upPort = String(await freePort());
  // The commands are independent: run at once, each result checked on its own.
  const [router, prefill, decode, up, decodeFromFile, d] = await Promise.all([
    cli(['router', '--port', '0', '--prefill', 'http://127.0.0.1:1', '--decode', 'http://127.0.0.1:2'], 20_000, short),
    cli(['prefill', '--model', model, '--port', '0', '--bootstrap-port', '0'], 20_000, short),
    cli(['decode', '--model', model, '--port', '0'], 20_000, short),
    cli(['up', '--model', model, '--port', upPort], 20_000, short),
    cli(['decode', '--model', model, '--port', '0'], 20_000, { PDSERVE_CLUSTER_SECRET: '', PDSERVE_CLUSTER_SECRET_FILE: file }),
    cli(['doctor', '--url', 'http://127.0.0.1:1', '--cluster-secret-file', file]),
  ]);
  oneLine(router, 2, want('router'));
  oneLine(prefill, 2, want('prefill'));
  oneLine(decode, 2, want('decode'));
  oneLine(up, 2, want('up'));
  oneLine(decodeFromFile, 2, want('decode'));
  assert.equal(d.code, 3, d.err);
  assert.match(d.err.trim(), want('doctor'));
});

test('--version prints the package version', async () => {
  const r = await cli(['--version']);
  assert.equal(r.code, 0, r.err);
  assert.equal(r.out.trim(), (JSON.parse(readFileSync('package.json', 'utf8')) as { version: string }).version);
});

test('doctor --url host:port without a scheme says so', async () => {
  const r = await cli(['doctor', '--url', '127.0.0.1:8000']);
  assert.notEqual(r.code, 0);
  assert.match(r.err + r.out, /--url 127\.0\.0\.1:8000 has no scheme: give http:\/\/127\.0\.0\.1:8000/);
});
