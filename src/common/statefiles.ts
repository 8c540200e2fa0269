/**
 * Sequence-state files live in a tmpfs folder (/dev/shm) named `pdserve-<kind>-<pid>-<room>.ggsq`.
 * Every path deletes its file in a `finally`, but a process killed mid-load cannot: at start-up a
 * worker removes the files of processes that no longer exist, so /dev/shm cannot fill up over
 * restarts.
 */
import { readdir, rm } from 'node:fs/promises';
import { join } from 'node:path';
import type { Logger } from './log.js';

const STATE_FILE = /^pdserve-[a-z]+-(\d+)-[^/]*\.ggsq$/;

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'EPERM';
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
    if (!m || alive(Number(m[1]))) continue;
    await rm(join(dir, name), { force: true }).then(() => removed++, () => {});
  }
  if (removed > 0) log?.info({ dir, removed }, 'removed state files left by dead processes');
  return removed;
}
