/**
 * The decision of `pdserve up`'s supervisor (src/cli/main.ts) for one cluster process, each
 * second: a live process, one the cluster stopped on purpose, or any process while `up` drains
 * is left alone; a process that exited 0 had been asked to drain (a SIGTERM/SIGINT from outside
 * `up`: workers exit 0 only after a drain, ../cli/serve.ts) and stays stopped; any other exit
 * (a crash, a non-zero code, SIGKILL) is restarted on the same ports.
 */
import type { ClusterProc } from './cluster.js';

export type SuperviseAction = 'none' | 'stopped' | 'restart';

/** What to do with `p` now; `stopping`: `up` itself is draining. */
export function superviseAction(p: Pick<ClusterProc, 'child' | 'expectedDown' | 'lastExit'>, stopping: boolean): SuperviseAction {
  if (p.child || p.expectedDown || stopping) return 'none';
  return p.lastExit?.code === 0 ? 'stopped' : 'restart';
}

/**
 * `up`'s line for a process that died on its own: its name, how it ended (the signal's name when
 * one killed it — `SIGKILL`: the OOM killer or a `kill -9` — else its exit code) and its log.
 * e.g. `pdserve: decode-1 exited unexpectedly (SIGKILL; log: /tmp/pdserve-1/decode-1.log); restarting it`.
 */
export function unexpectedExitLine(p: Pick<ClusterProc, 'name' | 'lastExit' | 'logFile'>): string {
  const e = p.lastExit;
  const how = e?.signal ? e.signal : e?.code !== undefined && e.code !== null ? `exit code ${e.code}` : 'no exit status seen';
  return `pdserve: ${p.name} exited unexpectedly (${how}${p.logFile ? `; log: ${p.logFile}` : ''}); restarting it`;
}
