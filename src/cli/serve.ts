/**
 * How one server role runs as a process: start it, announce readiness to a parent (`pdserve
 * up`'s IPC channel), then on SIGTERM/SIGINT drain gracefully (../runtime/drain.ts):
 *   1st signal → refuse new work, wait for in-flight requests (at most `drainTimeoutMs`),
 *                deregister, close, exit 0;
 *   2nd signal (or the timeout) → stop waiting: close() fails what is left, exit 0;
 *   parent's IPC channel closed → the same as a 2nd signal (no orphan lingers for 30 s).
 */
import type { FastifyInstance } from 'fastify';
import { DrainGate, gracefulShutdown } from '../runtime/drain.js';
import { createLogger } from '../base/log.js';
import { PdError } from '../base/errors.js';

/** What a role's start function returns. */
export interface Served {
  close(): Promise<void>;
  url: string;
  bootstrapPort?: number;
  /** Workers: the app carrying the drain gate. */
  app?: FastifyInstance;
  /** The router: its own gate. */
  drain?: DrainGate;
}

/**
 * The message of a start-up failure a user fixes from its message alone — a busy port, an
 * invalid configuration, a bad model file — printed as is, without a stack; null for any other
 * error (a bug: its stack is wanted).
 */
export function startupProblem(err: unknown): string | null {
  const e = err as NodeJS.ErrnoException & { address?: string; port?: number };
  if (e?.code === 'EADDRINUSE') return `cannot listen on ${e.address ?? '?'}:${e.port ?? '?'}: the port is in use`;
  if (err instanceof PdError && (err.code === 'invalid_config' || err.code === 'INVALID_ROUTER_CONFIG' || err.code === 'bad_model_file')) return err.message;
  return null;
}

/** Hooks the membership layer plugs in (../discovery). */
export interface ServeHooks {
  /** After the role is ready; returns the deregistration and the "draining now" announcement. */
  register?(s: Served): Promise<{ setDraining(): Promise<void>; deregister(): Promise<void> }>;
}

export interface ServeOptions {
  /** Longest wait for in-flight requests on SIGTERM, ms. */
  drainTimeoutMs: number;
  hooks?: ServeHooks;
}

/**
 * Run a server role until a signal or until the parent's IPC channel closes (see the module
 * doc). Exits the process; never returns normally after a signal.
 */
export async function serveRole(role: string, start: () => Promise<Served>, o: ServeOptions): Promise<void> {
  const log = createLogger(`${role}-lifecycle`);
  const s = await start();
  // the worker edge (fastify) loads only for a serving role: the CLI's tools (doctor) start without it
  const gate = s.drain ?? (s.app ? (await import('../worker/http.js')).drainGateOf(s.app) : undefined) ?? new DrainGate(role);
  const membership = o.hooks?.register ? await o.hooks.register(s) : undefined;
  process.send?.({ type: 'ready', role, url: s.url, bootstrapPort: s.bootstrapPort });
  const force = new AbortController();
  let stopping = false;
  const stop = (why: string) => {
    if (stopping) {
      if (!force.signal.aborted) log.warn({ why }, 'second signal: failing the requests left');
      force.abort();
      return;
    }
    stopping = true;
    if (why === 'disconnect') force.abort();
    // Last resort: a close() that hangs must not keep the process alive.
    const hard = () => setTimeout(() => process.exit(0), 5000).unref();
    force.signal.addEventListener('abort', hard, { once: true });
    if (membership) void membership.setDraining().catch(() => {});
    void gracefulShutdown({
      gate,
      timeoutMs: o.drainTimeoutMs,
      force: force.signal,
      deregister: membership?.deregister,
      close: async () => {
        hard();
        await s.close();
      },
      log,
    }).then(() => process.exit(0));
  };
  // A terminal's Ctrl-C reaches the whole foreground process group. A process supervised over IPC
  // (`pdserve up`, the test clusters) leaves SIGINT to its supervisor, which drains the router first
  // and then the workers with SIGTERM; taking SIGINT here too would make the supervisor's SIGTERM
  // look like a second signal and cut in-flight streams. Run alone, SIGINT drains like SIGTERM.
  process.on('SIGINT', () => {
    if (process.connected) log.info('SIGINT ignored: the supervisor orders the drain');
    else stop('SIGINT');
  });
  process.on('SIGTERM', () => stop('SIGTERM'));
  process.on('disconnect', () => stop('disconnect'));
}
