/** Starting and ending a child server the launcher (or a test harness) spawned: readiness and stop. */
import type { ChildProcess } from 'node:child_process';

/**
 * Poll `probe` every `stepMs` ms until it says true (a throw counts as not yet). Resolves true
 * then, false as soon as `child` has exited or `timeoutMs` ms have passed without it. Never throws.
 */
export async function childReady(child: ChildProcess, probe: () => Promise<boolean>, timeoutMs: number, stepMs = 100): Promise<boolean> {
  const end = Date.now() + timeoutMs;
  for (;;) {
    try {
      if (await probe()) return true;
    } catch {
      // not up yet
    }
    if (child.exitCode !== null || Date.now() > end) return false;
    await new Promise((r) => setTimeout(r, stepMs));
  }
}

/**
 * Send `signal` to `child` unless it has exited already, SIGKILL it if it is still alive after
 * `graceMs` ms, and resolve once it has exited. Idempotent; never throws.
 */
export async function stopChild(child: ChildProcess, signal: NodeJS.Signals = 'SIGTERM', graceMs = 3000): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return;
  const exited = new Promise<void>((r) => child.once('exit', () => r()));
  child.kill(signal);
  const t = setTimeout(() => child.kill('SIGKILL'), graceMs);
  await exited;
  clearTimeout(t);
}
