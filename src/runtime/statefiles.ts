/**
 * Sequence-state files live in a tmpfs folder (/dev/shm) named `pdserve-<kind>-<pid>-<room>.ggsq`:
 * the pid is the file's owner (the one process that deletes it; a same-host handoff moves
 * ownership by renaming, see kv/transfer/same-host.ts). Same-host probe files are
 * `pdserve-probe-<pid>-<hex>.nonce`. Every path deletes its file in a `finally`, but a process
 * killed meanwhile cannot: workers remove the files of processes that no longer exist at start-up
 * and every `STATE_SWEEP_MS` (decode also when it loses a prefill connection), so /dev/shm cannot
 * fill up over restarts and a file handed over by a prefill that was then killed goes too.
 * (A dead owner's pid reused by a new process delays its sweep until that process is gone.)
 */
import { linkSync, readFileSync, renameSync, rmSync } from 'node:fs';
import { readdir, rm } from 'node:fs/promises';
import { join } from 'node:path';
import type { Logger } from '../base/log.js';

/** `pdserve-<kind>-<pid>[-<rest>].<ggsq|nonce|bin|pid>`; the kind may have dashes (the bench's `bench-kv`, `bench-probe`); `.pid`: a prefix store's user file (prefix-store.ts). */
const STATE_FILE = /^pdserve-[a-z]+(?:-[a-z]+)*-(\d+)(?:-[^/]*)?\.(?:ggsq|nonce|bin|pid)$/;

/**
 * The file-system operations a role's room handling performs on state files (a port: node:fs
 * here, a model of names in the simulator). Paths are absolute.
 */
export interface StateFiles {
  /** Delete `path` if it exists; never rejects. */
  remove(path: string): Promise<void>;
  /** Delete `path` now if it exists (synchronous); never throws. */
  removeNow(path: string): void;
  /** Rename `from` to `to` (same file system). @throws the rename error (ENOENT, EXDEV). */
  rename(from: string, to: string): void;
  /** Give the file `from` the additional name `to` (a hard link). @throws the link error (EEXIST, ENOENT). */
  link(from: string, to: string): void;
}

/** State files on the real file system. */
export const nodeStateFiles: StateFiles = {
  remove: (path) => rm(path, { force: true }).catch(() => {}),
  removeNow: (path) => {
    try {
      rmSync(path, { force: true });
    } catch {
      /* a file that cannot be deleted is the sweeper's */
    }
  },
  rename: (from, to) => renameSync(from, to),
  link: (from, to) => linkSync(from, to),
};

/** Period of the stale-file sweep of a running worker, ms. */
export const STATE_SWEEP_MS = 30_000;

/** The process exists and is not a zombie (a killed child its parent has not reaped yet is dead). Never throws. */
export function processAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'EPERM';
  }
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    return stat.slice(stat.lastIndexOf(')') + 2, stat.lastIndexOf(')') + 3) !== 'Z';
  } catch {
    return true; // no /proc: trust kill(0)
  }
}

/** Delete state files in `dir` left by dead processes. Returns how many were removed; never throws. */
export async function sweepStaleStateFiles(dir: string, log?: Logger): Promise<number> {
  let names: string[];
  try {
    names = await readdir(dir);
  } catch {
    return 0;
  }
  let removed = 0;
  for (const name of names) {
    const m = STATE_FILE.exec(name);
    if (!m || processAlive(Number(m[1]))) continue;
    await rm(join(dir, name), { force: true }).then(() => removed++, () => {});
  }
  if (removed > 0) log?.info({ dir, removed }, 'removed state files left by dead processes');
  return removed;
}

/**
 * Sweep `dir` every `everyMs` (default STATE_SWEEP_MS) until the returned function is
 * called. The timer does not keep the process alive. Never throws.
 */
export function startStateSweeper(dir: string, log?: Logger, everyMs = STATE_SWEEP_MS): () => void {
  const t = setInterval(() => void sweepStaleStateFiles(dir, log), everyMs);
  t.unref();
  return () => clearInterval(t);
}
