/** One finding of the diagnosis (./diagnose.ts `diagnose`): what is wrong, why, what to run next. */

export type Severity = 'critical' | 'warning' | 'info';

export interface Finding {
  severity: Severity;
  /** Stable machine name: 'unreachable', 'incident_signature', 'stuck_room', … */
  kind: string;
  title: string;
  details: string[];
  cause: string;
  next: string[];
  /** For ordering within a severity (larger first), e.g. a room's ms in its phase. */
  weight: number;
  /** Structured data for --json (room ids, urls, …). */
  data?: Record<string, unknown>;
}
