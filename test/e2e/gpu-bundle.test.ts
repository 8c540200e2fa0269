/**
 * The GPU bundle end to end (scripts/gpu-bundle.sh, docs/GPU.md): the bundle is built (once per
 * content: cached under .cache/gpu-bundle/, keyed by dist/, the two scripts and the lockfile),
 * checked against its 60 MiB limit, unpacked into an empty folder and run there as on a lent GPU
 * machine: `./run --backend lavapipe --smoke` with a PATH that holds no Node and no node_modules
 * beside it, the bundle's own Vulkan loader forced (PDSERVE_BUNDLE_LIBS=all) over the host's
 * lavapipe driver. Asserted: gpu.json exists with finite TTFT and ITL figures of PD and colocated,
 * every engine (colocated, prefill, decode) reported its layers offloaded to the Vulkan device,
 * the Node that ran was the bundle's, and BENCHMARKS' renderer takes the file.
 * Skipped loudly where lavapipe, zstd or dpkg-deb is missing (.ci/install-tools installs them);
 * under CI=true that is a failure.
 */
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, realpathSync, rmSync, statSync, symlinkSync } from 'node:fs';
import net from 'node:net';
import { tmpdir } from 'node:os';
import { dirname, join, relative } from 'node:path';
import { after, test } from 'node:test';
import { fileURLToPath } from 'node:url';
import { gpuReport } from '../../src/bench/gpu.js';

const ROOT = join(dirname(fileURLToPath(import.meta.url)), '..', '..');
const LAVAPIPE = '/usr/share/vulkan/icd.d/lvp_icd.x86_64.json';
const MAX_BYTES = 60 * 1024 * 1024;

const has = (cmd: string) => spawnSync('sh', ['-c', `command -v ${cmd}`]).status === 0;
const missing = [
  process.platform === 'linux' && process.arch === 'x64' ? null : `Linux x86-64 (this is ${process.platform}-${process.arch})`,
  existsSync(LAVAPIPE) ? null : 'lavapipe (mesa-vulkan-drivers)',
  has('zstd') ? null : 'zstd',
  has('dpkg-deb') ? null : 'dpkg-deb',
].filter((x): x is string => x !== null);

/** sha256 over the files that make the bundle: dist/ (resolved), the scripts, the lockfile. */
function contentKey(): string {
  const h = createHash('sha256');
  const walk = (dir: string) => {
    for (const e of readdirSync(dir, { withFileTypes: true }).sort((a, b) => (a.name < b.name ? -1 : 1))) {
      const p = join(dir, e.name);
      if (e.isDirectory()) walk(p);
      else if (e.isFile()) h.update(`${relative(ROOT, p)}\0`).update(readFileSync(p));
    }
  };
  walk(realpathSync(join(ROOT, 'dist')));
  for (const f of ['scripts/gpu-bundle.sh', 'scripts/gpu-check.sh', 'package-lock.json', 'bin/pdserve.js']) h.update(`${f}\0`).update(readFileSync(join(ROOT, f)));
  return h.digest('hex').slice(0, 16);
}

/** A base port with base..base+4 free on loopback (colocated, router, prefill HTTP + bootstrap, decode). */
async function freeBase(): Promise<number> {
  const free = (port: number) => new Promise<boolean>((resolve) => {
    const s = net.createServer().once('error', () => resolve(false)).listen(port, '127.0.0.1', () => s.close(() => resolve(true)));
  });
  for (let i = 0; i < 50; i++) {
    const base = 20000 + Math.floor(Math.random() * 20000);
    let ok = true;
    for (let p = base; p < base + 5 && ok; p++) ok = await free(p);
    if (ok) return base;
  }
  throw new Error('no 5 free consecutive loopback ports found in 50 tries');
}

/** A folder of links to every program on the usual system PATH except Node and its tools. */
function pathWithoutNode(dir: string): string {
  mkdirSync(dir);
  const skip = new Set(['node', 'nodejs', 'npm', 'npx', 'corepack']);
  for (const d of ['/usr/local/sbin', '/usr/local/bin', '/usr/sbin', '/usr/bin', '/sbin', '/bin']) {
    if (!existsSync(d)) continue;
    for (const name of readdirSync(d)) {
      if (skip.has(name) || existsSync(join(dir, name))) continue;
      symlinkSync(join(d, name), join(dir, name));
    }
  }
  return dir;
}

if (missing.length && !process.env.CI) process.stderr.write(`\n!!!!! SKIPPED: the GPU bundle test needs ${missing.join(', ')} (run .ci/install-tools) !!!!!\n\n`);

const work = mkdtempSync(join(tmpdir(), 'pdserve-gpu-bundle-'));
after(() => rmSync(work, { recursive: true, force: true }));

test('the GPU bundle, unpacked into an empty folder, runs the check on lavapipe with its own Node', { skip: missing.length > 0 && !process.env.CI && `needs ${missing.join(', ')}: run .ci/install-tools` }, async (t) => {
  if (missing.length) {
    process.stderr.write(`\n!!!!! the GPU bundle test needs ${missing.join(', ')} !!!!!\n\n`);
    assert.fail(`the GPU bundle test needs ${missing.join(', ')}; CI must have them (.ci/install-tools)`);
  }
  // build once per content
  const cacheDir = join(ROOT, '.cache', 'gpu-bundle');
  mkdirSync(cacheDir, { recursive: true });
  const bundle = join(cacheDir, `pdserve-gpu-${contentKey()}.tar.zst`);
  if (!existsSync(bundle)) {
    for (const old of readdirSync(cacheDir).filter((f) => /^pdserve-gpu-.*\.tar\.zst$/.test(f))) rmSync(join(cacheDir, old), { force: true });
    const b = spawnSync('bash', [join(ROOT, 'scripts', 'gpu-bundle.sh'), '--out', bundle], { cwd: ROOT, encoding: 'utf8', timeout: 300_000 });
    assert.equal(b.status, 0, `gpu-bundle.sh failed:\n${b.stdout}\n${b.stderr}`);
    t.diagnostic(b.stdout.trim());
  }
  const size = statSync(bundle).size;
  assert.ok(size <= MAX_BYTES, `the bundle is ${size} bytes, over 60 MiB`);
  t.diagnostic(`bundle ${bundle}: ${(size / 1048576).toFixed(1)} MiB`);

  // unpack into an empty folder outside the checkout
  const dir = join(work, 'b');
  mkdirSync(dir);
  const x = spawnSync('tar', ['-C', dir, '--zstd', '-xf', bundle], { encoding: 'utf8', timeout: 120_000 });
  assert.equal(x.status, 0, `unpacking failed: ${x.stderr}`);
  assert.ok(existsSync(join(dir, 'run')) && existsSync(join(dir, 'node', 'bin', 'node')), 'run and node/bin/node at the top');
  assert.ok(!existsSync(join(work, 'node_modules')) && !existsSync(join(dir, 'node_modules')), 'no node_modules beside the bundle');

  // a PATH without Node: only the bundle's can run
  const bin = pathWithoutNode(join(work, 'path'));
  assert.notEqual(spawnSync('sh', ['-c', 'command -v node'], { env: { PATH: bin } }).status, 0, 'no node on the test PATH');
  const tmp = join(work, 'tmp'); // the check's logs and raw results: removed with the rest
  mkdirSync(tmp);
  const env: NodeJS.ProcessEnv = { PATH: bin, HOME: process.env.HOME, TMPDIR: tmp, PDSERVE_BUNDLE_LIBS: 'all' };
  for (const k of Object.keys(env)) if (env[k] === undefined) delete env[k];
  const base = await freeBase();
  const r = spawnSync(join(dir, 'run'), ['--backend', 'lavapipe', '--smoke', '--port-base', String(base)], { cwd: work, env, encoding: 'utf8', timeout: 300_000 });
  for (const l of r.stdout.split('\n')) if (l.startsWith('run:') || l.startsWith('|')) t.diagnostic(l);
  assert.equal(r.status, 0, `./run failed (${r.status}, ${r.signal}):\n${r.stdout}\n${r.stderr}`);
  assert.match(r.stdout, /^run: node .*\/node\/bin\/node \(v20\.[^)]*\); bundle libraries used: .*libvulkan\.so\.1/m);

  const res = JSON.parse(readFileSync(join(dir, 'results', 'gpu.json'), 'utf8'));
  assert.equal(res.backend, 'lavapipe');
  assert.equal(res.smoke, true);
  assert.ok(res.node.execPath.startsWith(realpathSync(dir) + '/') || res.node.execPath.startsWith(dir + '/'), `the check ran on the bundle's Node (${res.node.execPath})`);
  assert.match(res.node.version, /^v20\./);
  assert.ok(res.rows.length >= 1, 'figures for at least one prompt length');
  for (const row of res.rows) {
    for (const side of ['colo', 'pd'] as const) {
      for (const k of ['ttftP50', 'itlP50', 'itlP99', 'e2eP50']) {
        const v = row[side][k];
        assert.ok(typeof v === 'number' && Number.isFinite(v) && v > 0, `${side} ${k} at ${row.promptTokens} tokens: ${v}`);
      }
    }
  }
  const roles = res.engines.map((e: any) => e.role).sort();
  assert.deepEqual(roles, ['colocated', 'decode', 'prefill']);
  for (const e of res.engines) {
    assert.equal(e.backend, 'vulkan', `${e.role} on the Vulkan backend`);
    assert.match(e.devices.join(','), /llvmpipe/, `${e.role} on lavapipe`);
    const m = /^(\d+)\/(\d+)$/.exec(e.layers ?? '');
    assert.ok(m && Number(m[1]) > 0 && m[1] === m[2], `${e.role}: every layer offloaded (${e.layers})`);
  }
  assert.ok(res.notes.some((n: string) => /§1 skipped/.test(n)), 'the smoke run says it skipped §1');
  // BENCHMARKS' GPU section takes the file
  const md = gpuReport(join(dir, 'results')).join('\n');
  assert.match(md, /\*\*lavapipe\*\*/);
  assert.match(md, /\| prefill \| vulkan \| 3\/3 \|/);
});
