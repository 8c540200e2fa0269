/**
 * llama.cpp's own `llama-server` as a benchmark peer: built from the llama.cpp source that
 * node-llama-cpp ships (`node_modules/node-llama-cpp/llama/gitRelease.bundle`, the very version
 * pdserve's engine runs), cached outside the repository, started and stopped like a pdserve
 * process.
 *
 * Cache layout (`<cache>` = the generated models' folder, ~/.cache/pdserve by default):
 *
 * | path | what |
 * |---|---|
 * | `<cache>/llama-server-<tag>/bin/llama-server` | the binary; its presence means "built" |
 * | `<cache>/llama-server-<tag>/src` | `git clone` of the bundle |
 * | `<cache>/llama-server-<tag>/build` | CMake + Ninja build folder (Release, CPU only, static) |
 *
 * `<tag>` is node-llama-cpp's llama.cpp release (llama/llama.cpp.info.json). A build that fails
 * leaves no binary, so the next call builds again; cmake, ninja or git missing skips with one line.
 */
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { createWriteStream, existsSync, mkdirSync, readFileSync, renameSync, rmSync, copyFileSync, chmodSync } from 'node:fs';
import { join } from 'node:path';
import { request } from 'undici';
import { PdError } from '../base/errors.js';
import { defaultCacheDir } from '../engine/gguf-writer.js';
import { freePort } from '../up/cluster.js';
import { REPO_ROOT } from './index.js';
import { sleep } from './util.js';

/** A built llama-server. */
export interface LlamaServerBinary {
  /** Absolute path of the executable. */
  binary: string;
  /** llama.cpp release tag it was built from. */
  tag: string;
}

/** node-llama-cpp's llama.cpp release tag and the bundle holding its source. */
export function llamaCppSource(root = REPO_ROOT): { tag: string; bundle: string } {
  const dir = join(root, 'node_modules', 'node-llama-cpp', 'llama');
  let tag = 'unknown';
  try {
    tag = (JSON.parse(readFileSync(join(dir, 'llama.cpp.info.json'), 'utf8')) as { tag?: string }).tag ?? 'unknown';
  } catch {
    /* no info file: 'unknown' */
  }
  return { tag, bundle: join(dir, 'gitRelease.bundle') };
}

/** The cache folder of the llama-server built from llama.cpp `tag`. */
export function llamaServerDir(tag: string, cacheDir = defaultCacheDir()): string {
  return join(cacheDir, `llama-server-${tag}`);
}

/** Why the peer cannot be built here (a tool or the bundle missing), or undefined when it can. */
export function llamaServerBuildBlocker(bundle: string): string | undefined {
  const missing = ['git', 'cmake', 'ninja'].filter((t) => spawnSync(t, ['--version'], { stdio: 'ignore' }).status !== 0);
  if (missing.length) return `${missing.join(', ')} not found on PATH`;
  if (!existsSync(bundle)) return `${bundle} is missing (node-llama-cpp without its llama.cpp source)`;
  return undefined;
}

/** CMake flags of the peer's build: Release, CPU only, no network features, static, the server alone. */
export const LLAMA_SERVER_CMAKE_FLAGS: readonly string[] = [
  '-G',
  'Ninja',
  '-DCMAKE_BUILD_TYPE=Release',
  '-DBUILD_SHARED_LIBS=OFF',
  '-DLLAMA_CURL=OFF',
  '-DLLAMA_OPENSSL=OFF',
  '-DLLAMA_BUILD_TESTS=OFF',
  '-DLLAMA_BUILD_EXAMPLES=OFF',
  '-DLLAMA_BUILD_SERVER=ON',
  '-DLLAMA_BUILD_UI=OFF',
  '-DLLAMA_USE_PREBUILT_UI=OFF',
];

function run(cmd: string, args: string[], o: { cwd?: string; log: string; timeoutMs: number }): Promise<void> {
  return new Promise((resolve, reject) => {
    const out = createWriteStream(o.log, { flags: 'a' });
    out.write(`$ ${cmd} ${args.join(' ')}\n`);
    // nice: the build shares the machine with whatever else runs (other benchmarks included)
    const child = spawn('nice', ['-n', '10', cmd, ...args], { cwd: o.cwd, stdio: ['ignore', 'pipe', 'pipe'] });
    child.stdout.pipe(out, { end: false });
    child.stderr.pipe(out, { end: false });
    const timer = setTimeout(() => child.kill('SIGKILL'), o.timeoutMs);
    child.on('error', (err) => {
      clearTimeout(timer);
      out.end();
      reject(err);
    });
    child.on('exit', (code, signal) => {
      clearTimeout(timer);
      out.end();
      if (code === 0) resolve();
      else reject(new Error(`${cmd} ${args.slice(0, 3).join(' ')} … exited ${code ?? signal}${signal === 'SIGKILL' ? ` (over its ${Math.round(o.timeoutMs / 1000)} s deadline)` : ''}; log: ${o.log}`));
    });
  });
}

/**
 * The llama-server binary, building it first when the cache has none (git clone of the bundle,
 * cmake, `ninja -j<jobs> llama-server`, each under `nice -n 10`; about 6 minutes on 2 idle cores).
 * @param o.log progress lines (one per step).
 * @param o.jobs build parallelism (default 2).
 * @param o.timeoutMs deadline of the whole build (default 45 minutes).
 * @returns the binary, or `{ skipped }` with one line saying why there is none (a tool or the
 *   bundle missing).
 * @throws Error when a build step fails (its log's path in the message).
 */
export async function ensureLlamaServer(o: { log: (line: string) => void; jobs?: number; timeoutMs?: number; cacheDir?: string }): Promise<LlamaServerBinary | { skipped: string }> {
  const { tag, bundle } = llamaCppSource();
  const dir = llamaServerDir(tag, o.cacheDir);
  const binary = join(dir, 'bin', 'llama-server');
  if (existsSync(binary)) return { binary, tag };
  const blocker = llamaServerBuildBlocker(bundle);
  if (blocker) return { skipped: `llama-server peer skipped: ${blocker}` };
  const deadline = Date.now() + (o.timeoutMs ?? 45 * 60_000);
  const left = () => Math.max(1000, deadline - Date.now());
  const src = join(dir, 'src');
  const build = join(dir, 'build');
  const log = join(dir, 'build.log');
  mkdirSync(dir, { recursive: true });
  o.log(`building llama-server ${tag} from ${bundle} in ${dir} (-j${o.jobs ?? 2}, log ${log})`);
  if (!existsSync(join(src, 'CMakeLists.txt'))) {
    rmSync(src, { recursive: true, force: true });
    await run('git', ['clone', '--quiet', bundle, src], { log, timeoutMs: left() });
  }
  await run('cmake', ['-S', src, '-B', build, ...LLAMA_SERVER_CMAKE_FLAGS], { log, timeoutMs: left() });
  await run('ninja', ['-C', build, `-j${o.jobs ?? 2}`, 'llama-server'], { log, timeoutMs: left() });
  const built = join(build, 'bin', 'llama-server');
  if (!existsSync(built)) throw new PdError('START_FAILED', `the build finished without ${built}; log: ${log}`);
  mkdirSync(join(dir, 'bin'), { recursive: true });
  const tmp = `${binary}.tmp-${process.pid}`;
  copyFileSync(built, tmp);
  chmodSync(tmp, 0o755);
  renameSync(tmp, binary);
  o.log(`built ${binary}`);
  return { binary, tag };
}

/** How the peer runs. */
export interface LlamaServerOptions {
  binary: string;
  model: string;
  /** llama.cpp threads (`-t`, also `-tb`). */
  threads: number;
  /** Parallel slots (`-np`). */
  slots: number;
  /** Context per slot, tokens (`-c` is slots × this: `--no-kv-unified` splits it). */
  contextPerSlot: number;
  /** Host prompt cache, MiB (`--cache-ram`). */
  cacheRamMiB: number;
  /** Extra flags, appended last. */
  extraArgs?: string[];
  /** Output of the server, appended. */
  logFile: string;
  startTimeoutMs?: number;
}

/** A running llama-server. */
export interface LlamaServerProc {
  url: string;
  child: ChildProcess;
  args: string[];
  /** SIGTERM, SIGKILL after 5 s; resolves once it exited. */
  stop(): Promise<void>;
}

/** The command line of the peer (without the binary). */
export function llamaServerArgs(o: Pick<LlamaServerOptions, 'model' | 'threads' | 'slots' | 'contextPerSlot' | 'cacheRamMiB' | 'extraArgs'>, port: number): string[] {
  return [
    '-m', o.model,
    '--host', '127.0.0.1',
    '--port', String(port),
    '-t', String(o.threads),
    '-tb', String(o.threads),
    '-np', String(o.slots),
    '-c', String(o.slots * o.contextPerSlot),
    '--no-kv-unified',
    '--cache-ram', String(o.cacheRamMiB),
    '--no-webui',
    ...(o.extraArgs ?? []),
  ]; // prettier-ignore
}

/**
 * Start llama-server and wait until GET /health answers 200.
 * @throws Error when it exits first or is not healthy within `startTimeoutMs` (default 120 s);
 *   the log's path is in the message.
 */
export async function startLlamaServer(o: LlamaServerOptions): Promise<LlamaServerProc> {
  const port = await freePort();
  const args = llamaServerArgs(o, port);
  const out = createWriteStream(o.logFile, { flags: 'a' });
  const child = spawn(o.binary, args, { stdio: ['ignore', 'pipe', 'pipe'] });
  child.stdout!.pipe(out);
  child.stderr!.pipe(out);
  const url = `http://127.0.0.1:${port}`;
  let exited: string | undefined;
  const gone = new Promise<void>((r) =>
    child.once('exit', (code, signal) => {
      exited = `exited ${code ?? signal}`;
      r();
    }),
  );
  const stop = async () => {
    if (exited === undefined) {
      child.kill('SIGTERM');
      const t = setTimeout(() => child.kill('SIGKILL'), 5000);
      await gone;
      clearTimeout(t);
    }
  };
  const deadline = Date.now() + (o.startTimeoutMs ?? 120_000);
  while (Date.now() < deadline) {
    if (exited !== undefined) throw new PdError('START_FAILED', `llama-server ${exited} while starting; log: ${o.logFile}`);
    try {
      const r = await request(`${url}/health`, { signal: AbortSignal.timeout(2000) });
      await r.body.dump();
      if (r.statusCode === 200) return { url, child, args, stop };
    } catch {
      /* not listening yet */
    }
    await sleep(200);
  }
  await stop();
  throw new PdError('START_FAILED', `llama-server not healthy within ${o.startTimeoutMs ?? 120_000} ms; log: ${o.logFile}`);
}
