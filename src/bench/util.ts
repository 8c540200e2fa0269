/**
 * Helpers shared by the benchmark suite's sections: child processes with an IPC channel
 * (optionally pinned with taskset), interleaving, number formatting.
 */
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { existsSync } from 'node:fs';
import os from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { stopChild } from '../up/child.js';

const here = dirname(fileURLToPath(import.meta.url));
const ext = fileURLToPath(import.meta.url).endsWith('.ts') ? '.ts' : '.js';

/** Path of a sibling module of this file (`.ts` under tsx, `.js` from dist). */
export function siblingModule(name: string): string {
  return join(here, `${name}${ext}`);
}

/** The loader flags of this process (e.g. `--import tsx`) without test-runner flags. */
export function loaderExecArgv(): string[] {
  const out: string[] = [];
  const a = process.execArgv;
  for (let i = 0; i < a.length; i++) {
    const x = a[i]!;
    if ((x === '--import' || x === '--loader' || x === '--require' || x === '-r') && i + 1 < a.length) out.push(x, a[++i]!);
    else if (/^--(import|loader|require)=/.test(x)) out.push(x);
  }
  return out;
}

/** True when `taskset` exists and the machine has at least `cores` CPUs. */
export function canPin(cores = 2): boolean {
  if (os.cpus().length < cores) return false;
  if (process.platform !== 'linux') return false;
  return spawnSync('taskset', ['-V'], { stdio: 'ignore' }).status === 0 || existsSync('/usr/bin/taskset');
}

/** A child process running one of the bench modules, with a typed request/response IPC. */
export class BenchChild<Msg extends { type: string } = { type: string }> {
  readonly proc: ChildProcess;
  private readonly waiters: { pred: (m: Msg) => boolean; resolve: (m: Msg) => void; reject: (e: Error) => void }[] = [];
  private readonly listeners = new Set<(m: Msg) => void>();
  private exited: Error | undefined;

  /** Spawn `module` (a sibling module name) with `args`; `cpus` pins it with taskset -c. */
  constructor(module: string, args: string[] = [], cpus?: string) {
    const argv = [...loaderExecArgv(), siblingModule(module), ...args];
    const [cmd, full]: [string, string[]] = cpus ? ['taskset', ['-c', cpus, process.execPath, ...argv]] : [process.execPath, argv];
    this.proc = spawn(cmd, full, { stdio: ['ignore', 'inherit', 'inherit', 'ipc'], env: process.env });
    this.proc.on('message', (m) => this.onMessage(m as Msg));
    this.proc.on('exit', (code, sig) => {
      this.exited = new Error(`${module} exited (${code ?? sig})`);
      for (const w of this.waiters.splice(0)) w.reject(this.exited);
    });
  }

  private onMessage(m: Msg): void {
    for (const l of this.listeners) l(m);
    const i = this.waiters.findIndex((w) => w.pred(m));
    if (i >= 0) this.waiters.splice(i, 1)[0]!.resolve(m);
  }

  /** Call `fn` for every message. */
  on(fn: (m: Msg) => void): void {
    this.listeners.add(fn);
  }

  /** Send a message. */
  send(m: object): void {
    this.proc.send(m);
  }

  /** The next message matching `type` (and `pred`), or a rejection after `timeoutMs` or on exit. */
  wait<T extends Msg = Msg>(type: string, timeoutMs = 120_000, pred: (m: Msg) => boolean = () => true): Promise<T> {
    if (this.exited) return Promise.reject(this.exited);
    return new Promise<T>((resolve, reject) => {
      const w = {
        pred: (m: Msg) => m.type === type && pred(m),
        resolve: (m: Msg) => {
          clearTimeout(t);
          resolve(m as T);
        },
        reject: (e: Error) => {
          clearTimeout(t);
          reject(e);
        },
      };
      const t = setTimeout(() => {
        const i = this.waiters.indexOf(w);
        if (i >= 0) this.waiters.splice(i, 1);
        reject(new Error(`timed out after ${timeoutMs} ms waiting for '${type}'`));
      }, timeoutMs);
      this.waiters.push(w);
    });
  }

  /** Send and wait for the answer of `type`. */
  async call<T extends Msg = Msg>(m: object, type: string, timeoutMs?: number): Promise<T> {
    const p = this.wait<T>(type, timeoutMs);
    this.send(m);
    const r = await p;
    const err = (r as unknown as { error?: string }).error;
    if (err) throw new Error(err);
    return r;
  }

  /** Kill (SIGTERM, then SIGKILL after 2 s) and wait for the exit. */
  async stop(): Promise<void> {
    await stopChild(this.proc, 'SIGTERM', 2000);
  }
}

/** Run `a` then `b` on even rounds and `b` then `a` on odd ones (ABBA-style interleaving). */
export async function alternate<T>(round: number, a: () => Promise<T>, b: () => Promise<T>): Promise<[T, T]> {
  if (round % 2 === 0) {
    const x = await a();
    const y = await b();
    return [x, y];
  }
  const y = await b();
  const x = await a();
  return [x, y];
}

/** Median of a sample (NaN when empty). */
export function median(xs: readonly number[]): number {
  const s = xs.filter(Number.isFinite).sort((a, b) => a - b);
  if (s.length === 0) return NaN;
  const m = Math.floor(s.length / 2);
  return s.length % 2 ? s[m]! : (s[m - 1]! + s[m]!) / 2;
}

/** Fixed-point text, 'n/a' for non-finite numbers. */
export function fmt(x: number | null | undefined, digits = 1): string {
  return x == null || !Number.isFinite(x) ? 'n/a' : x.toFixed(digits);
}

/** A ratio as "1.23×". */
export function fmtRatio(x: number | null | undefined): string {
  return x == null || !Number.isFinite(x) ? 'n/a' : `${x.toFixed(2)}×`;
}

/** A line of progress on stderr, prefixed with the suite's elapsed time. */
export function say(msg: string): void {
  process.stderr.write(`[bench ${((performance.now() - SUITE_T0) / 1000).toFixed(0).padStart(4)} s] ${msg}\n`);
}
const SUITE_T0 = performance.now();

/** Promise-based sleep. */
export function sleep(ms: number): Promise<void> {
  return new Promise((r) => setTimeout(r, Math.max(0, ms)));
}

/** One section's JSON file. */
export interface SectionFile {
  section: number;
  meta: { date: string; quick: boolean; commit: string; seconds: number; loadavg: number[] };
  result: unknown;
}
