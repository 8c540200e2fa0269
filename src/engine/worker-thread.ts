/**
 * Starting one of the engine's worker threads (./grammar-thread.ts, ./tokenizer-thread.ts): the
 * entry module next to the caller (`.ts` from source under tsx, whose loader the thread registers
 * first; `.js` when built), unref'd so it never holds the process open, and its start handshake:
 * the thread posts `{ready: true}` once it can take work. What happens to the work it held when it
 * fails, exits or does not start in time is the caller's (`onGone`, `onStartTimeout`).
 */
import { Worker } from 'node:worker_threads';
import { PdError } from '../base/errors.js';

export interface WorkerThreadStart<M> {
  /** Entry module's name without extension, next to `base` (e.g. 'grammar-worker'). */
  entry: string;
  /** `import.meta.url` of the caller: the entry is resolved next to it, with its extension. */
  base: string;
  /** The thread's name in messages, e.g. 'grammar thread'. */
  label: string;
  /** `workerData` of the thread. */
  workerData: unknown;
  /** Longest wait for `{ready: true}`, ms. */
  startTimeoutMs: number;
  /** Every message of the thread but `{ready: true}`. */
  onMessage(m: M, w: Worker): void;
  /** The thread failed or exited (once per event; `why` names it): the caller fails what it held. */
  onGone(w: Worker, why: string): void;
  /** The thread did not start in time (after `ready` rejected); default: nothing more. */
  onStartTimeout?(w: Worker, why: string): void;
}

/**
 * Start a worker thread (see the module doc). `ready` resolves on its `{ready: true}` and rejects
 * with PdError engine_failed when it fails, exits or does not start within `startTimeoutMs`
 * (`ready` is pre-caught: awaiting it is optional).
 */
export function startWorkerThread<M extends object>(o: WorkerThreadStart<M>): { worker: Worker; ready: Promise<void> } {
  const fromSource = o.base.endsWith('.ts');
  const entry = new URL(`./${o.entry}${fromSource ? '.ts' : '.js'}`, o.base);
  const w = fromSource
    ? new Worker(`import('tsx/esm/api').then((t) => { t.register(); return import(${JSON.stringify(entry.href)}); })`, { eval: true, workerData: o.workerData })
    : new Worker(entry, { workerData: o.workerData });
  w.unref();
  const ready = new Promise<void>((resolve, reject) => {
    const t = setTimeout(() => {
      const why = `${o.label} did not start within ${o.startTimeoutMs} ms`;
      reject(new PdError('engine_failed', why));
      o.onStartTimeout?.(w, why);
    }, o.startTimeoutMs);
    t.unref();
    w.on('message', (m: M | { ready: true }) => {
      if ('ready' in m) {
        clearTimeout(t);
        resolve();
        return;
      }
      o.onMessage(m, w);
    });
    const gone = (why: string): void => {
      clearTimeout(t);
      reject(new PdError('engine_failed', why));
      o.onGone(w, why);
    };
    w.on('error', (err) => gone(`${o.label} failed: ${err.message}`));
    w.on('exit', (code) => gone(`${o.label} exited (${code})`));
  });
  ready.catch(() => {});
  return { worker: w, ready };
}
