/**
 * CPU time of processes and of the whole machine, from Linux's /proc (bench only: where a
 * benchmark on a shared machine needs to say who had the cores).
 *   - `/proc/<pid>/stat` fields 14 and 15 (utime, stime) of every thread of the process, in clock
 *     ticks (USER_HZ, 100 on Linux);
 *   - `/proc/stat`'s first line: every state of every core; busy = all − idle − iowait.
 * Without /proc (another OS, a process gone) a figure is NaN, never a throw.
 */
import { readFileSync } from 'node:fs';

/** Linux's USER_HZ: /proc times are in 1/100 s on every architecture it exports them for. */
const TICKS_PER_S = 100;

/** CPU seconds `pid` has used so far (user + system), NaN when unknown. */
export function processCpuSeconds(pid: number | undefined): number {
  if (pid === undefined) return NaN;
  try {
    const s = readFileSync(`/proc/${pid}/stat`, 'utf8');
    // the command name (field 2) may hold spaces and parentheses: count fields after its last ')'
    const f = s.slice(s.lastIndexOf(')') + 2).split(' ');
    return (Number(f[11]) + Number(f[12])) / TICKS_PER_S;
  } catch {
    return NaN;
  }
}

/** Busy CPU seconds of the whole machine so far (all cores), NaN when unknown. */
export function machineBusySeconds(): number {
  try {
    const line = readFileSync('/proc/stat', 'utf8').split('\n', 1)[0]!;
    const v = line.trim().split(/\s+/).slice(1).map(Number);
    // user nice system idle iowait irq softirq steal (guest is counted in user already)
    const total = v.slice(0, 8).reduce((a, b) => a + b, 0);
    return (total - v[3]! - v[4]!) / TICKS_PER_S;
  } catch {
    return NaN;
  }
}
