/**
 * Process logger: pino, JSON lines to stderr (or a file), level from PDSERVE_LOG_LEVEL (default
 * 'info'). Every worker log line carries `role`; request-scoped lines carry `rid` and `room`.
 */
import pino from 'pino';

export type Logger = pino.Logger;

/** Create the root logger of a process. `dest`: file path, or undefined for stderr. */
export function createLogger(name: string, opts: { level?: string; dest?: string } = {}): Logger {
  const level = opts.level ?? process.env.PDSERVE_LOG_LEVEL ?? 'info';
  const destination = opts.dest ? pino.destination({ dest: opts.dest, sync: false, mkdir: true }) : pino.destination(2);
  return pino({ name, level, base: { role: name, pid: process.pid } }, destination);
}

/** A logger that drops everything (tests, library defaults). */
export const silentLogger: Logger = pino({ level: 'silent' });
