/**
 * Is the state directory full? A worker writes every sequence state into its state directory
 * (prefill: the saved state, decode: the received one; /dev/shm by default, a tmpfs of half the
 * RAM). When a write there fails for want of space the worker says so, instead of a generic
 * `engine_failed` that the router would retry on the same host:
 *
 * | where | what |
 * |---|---|
 * | the failed room | `state_dir_full` (507): the router does not send the request to this worker again |
 * | GET /health | `status: 'degraded'`, `degraded: ['state_dir_full: …']` (200): the router stops picking the worker; `pdserve doctor` names it |
 * | /metrics | `pdserve_state_dir_full` (0/1) and `pdserve_state_dir_full_total` (writes refused) |
 *
 * A write failed "for want of space" when its error is ENOSPC, or — llama.cpp's save reports
 * only "Failed to save state to file" — when the directory has less than STATE_DIR_MARGIN_BYTES
 * free right after the failure (the partial file still in place). The condition holds while the
 * directory has less free space than the failed write needed (the larger of the partial file
 * and the last good state, plus the margin), checked on each /health and cleared by the next
 * good write: once space frees up the worker serves again, nothing to restart.
 */
import { statSync, statfsSync } from 'node:fs';
import client from 'prom-client';
import { systemClock } from '../base/clock.js';

/** Free space under which a failed write counts as a full directory, and the slack a recovery needs on top of the failed size, bytes. */
export const STATE_DIR_MARGIN_BYTES = 1 << 20;

/** The file-system questions StateSpace asks (node:fs here; a fake in unit tests). */
export interface SpaceProbe {
  /** Bytes an unprivileged writer may still use in `dir`, or undefined when unknown. */
  freeBytes(dir: string): number | undefined;
  /** Size of the file at `path` in bytes, or 0 when it is not there. */
  fileBytes(path: string): number;
}

/** The real file system (statfs(2) and stat(2)); never throws. */
export const nodeSpaceProbe: SpaceProbe = {
  freeBytes(dir) {
    try {
      const s = statfsSync(dir);
      return s.bavail * s.bsize;
    } catch {
      return undefined;
    }
  },
  fileBytes(path) {
    try {
      return statSync(path).size;
    } catch {
      return 0;
    }
  },
};

/** What a role's room handling asks of StateSpace (a port: the simulator runs without one). */
export interface StateSpacePort {
  /** True when the write whose partial file is `path` failed for want of space (the condition is then set); `errnoOnly`: ENOSPC alone counts. */
  judge(err: unknown, path?: string, errnoOnly?: boolean): boolean;
  /** A state of `bytes` was written: the condition is over. */
  ok(bytes: number): void;
  /** The failure message of a room refused for want of space. */
  message(role: string): string;
}

/** The full-directory condition of one worker's state directory (see the module doc). */
export class StateSpace implements StateSpacePort {
  /** Bytes the last refused write needed (0: not full). */
  private need = 0;
  private since = 0;
  private lastGood = 0;
  private detail = '';
  /** Writes refused for want of space since start. */
  refused = 0;
  /** Errors judged already (one failed save reaches both the save's and the streamed send's handler): the same answer, counted once. */
  private readonly judged = new WeakMap<object, boolean>();

  constructor(
    readonly dir: string,
    private readonly probe: SpaceProbe = nodeSpaceProbe,
    private readonly now: () => number = () => systemClock.nowMs(),
  ) {}

  /**
   * Judge the failure `err` of a write into the directory, whose partial file is `path` (still
   * in place; undefined when there is none). True when the directory is full: the condition is
   * set and the caller fails the room with `state_dir_full`. `errnoOnly`: only an ENOSPC error
   * counts (a writer whose other errors mean something else, e.g. decode's bad state). The same
   * error object judged again gets the same answer and is counted once. Never throws.
   */
  judge(err: unknown, path?: string, errnoOnly = false): boolean {
    if (typeof err === 'object' && err !== null) {
      const known = this.judged.get(err);
      if (known !== undefined) return known;
      const full = this.judgeNew(err, path, errnoOnly);
      this.judged.set(err, full);
      return full;
    }
    return this.judgeNew(err, path, errnoOnly);
  }

  private judgeNew(err: unknown, path: string | undefined, errnoOnly: boolean): boolean {
    const enospc = hasCode(err, 'ENOSPC');
    if (errnoOnly && !enospc) return false;
    const free = this.probe.freeBytes(this.dir);
    if (!enospc && (free === undefined || free >= STATE_DIR_MARGIN_BYTES)) return false;
    const partial = path ? this.probe.fileBytes(path) : 0;
    this.need = Math.max(partial, this.lastGood) + STATE_DIR_MARGIN_BYTES;
    if (this.since === 0) this.since = this.now();
    this.detail = `state directory ${this.dir} is full: ${free ?? '?'} bytes free, a state needs about ${this.need}`;
    this.refused++;
    return true;
  }

  /** A write of `bytes` into the directory succeeded: the condition (if any) is over. */
  ok(bytes: number): void {
    this.lastGood = bytes;
    this.need = 0;
    this.since = 0;
  }

  /** The condition now (re-checked against the free space: freed space ends it), or undefined. */
  condition(): { reason: 'state_dir_full'; detail: string; since: number } | undefined {
    if (this.need === 0) return undefined;
    const free = this.probe.freeBytes(this.dir);
    if (free !== undefined && free >= this.need) {
      this.need = 0;
      this.since = 0;
      return undefined;
    }
    return { reason: 'state_dir_full', detail: this.detail, since: this.since };
  }

  /** The message a room refused for want of space fails with. */
  message(role: string): string {
    return `${role} ${this.detail} (free space there, or give the worker a larger --state-dir)`;
  }

  /** Register `pdserve_state_dir_full` and `pdserve_state_dir_full_total` on `registry`. */
  registerMetrics(registry: client.Registry): void {
    const self = this;
    new client.Gauge({
      name: 'pdserve_state_dir_full',
      help: 'Whether the state directory is too full for a sequence state (1) or not (0)',
      registers: [registry],
      collect() {
        this.set(self.condition() ? 1 : 0);
      },
    });
    new client.Counter({
      name: 'pdserve_state_dir_full_total',
      help: 'State writes that failed because the state directory was full',
      registers: [registry],
      collect() {
        this.reset();
        this.inc(self.refused);
      },
    });
  }
}

function hasCode(err: unknown, code: string): boolean {
  const e = err as { code?: unknown; cause?: { code?: unknown } } | undefined;
  return e?.code === code || e?.cause?.code === code || (typeof (err as Error)?.message === 'string' && (err as Error).message.includes(code));
}
