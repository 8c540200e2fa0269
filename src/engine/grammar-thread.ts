/**
 * JSON-schema grammar generation off the event loop, with a time budget. node-llama-cpp's
 * JSON-schema → GBNF generator is JavaScript (up to ~80 ms for a schema within the API's bounds,
 * seconds for a hostile one), so it runs in one worker thread (./grammar-worker.ts) together
 * with json-grammar.ts's patches; the caller gets the final GBNF text and builds the grammar
 * object on its own thread (llama.cpp's parse of the text is ~0.1 ms).
 *
 * The thread starts on the first schema, is unref'd (never holds the process open) and holds no
 * llama.cpp instance, so terminating it is safe. Schemas wait in a bounded queue (`maxPending`,
 * more → PdError QUEUE_FULL) and are sent one at a time; each gets `budgetMs` of the thread's
 * time, past which the thread is terminated (started again for the next schema) and the caller
 * gets PdError schema_too_complex (400) naming the budget. A thread that fails or exits fails the
 * schema it held with engine_failed and is started again for the next one.
 */
import { createRequire } from 'node:module';
import { dirname, join } from 'node:path';
import type { Worker } from 'node:worker_threads';
import { PdError } from '../base/errors.js';
import { startWorkerThread } from './worker-thread.js';
import { GRAMMAR_BUDGET_MS } from './types.js';

export { GRAMMAR_BUDGET_MS };

export interface GrammarThreadOptions {
  /** Longest generation of one schema's grammar, ms (queue wait and thread start not counted). Default GRAMMAR_BUDGET_MS. */
  budgetMs?: number;
  /** Most schemas queued or in work at once. Default 64. */
  maxPending?: number;
  /** Longest wait for the thread to start, ms. Default 30_000. */
  startTimeoutMs?: number;
  /** Tests only: each schema takes at least this long in the thread (a slow generation). */
  spinMs?: number;
}

/**
 * Path of node-llama-cpp's `getGbnfGrammarForGbnfJsonSchema` module (the package's `exports`
 * block has no deep entry, so it is found from the package's main file; pinned 3.21.1 layout).
 */
export function gbnfGeneratorPath(): string {
  const main = createRequire(import.meta.url).resolve('node-llama-cpp'); // <pkg>/dist/index.js
  return join(dirname(main), 'utils/gbnfJson/getGbnfGrammarForGbnfJsonSchema.js');
}

interface Job {
  id: number;
  schema: Record<string, unknown>;
  resolve: (gbnf: string) => void;
  reject: (err: Error) => void;
}

type Reply = { id: number; gbnf: string } | { id: number; error: string };

/** Code of a schema node-llama-cpp's generator refuses (GrammarCache makes it a 400 naming the field). */
export const BAD_GRAMMAR = 'BAD_GRAMMAR';

export class GrammarThread {
  private worker: Worker | undefined;
  private ready: Promise<void> | undefined;
  private readonly queue: Job[] = [];
  private current: (Job & { timer?: NodeJS.Timeout }) | undefined;
  private seq = 0;
  private closed = false;
  readonly budgetMs: number;
  private readonly maxPending: number;
  private readonly startTimeoutMs: number;
  private readonly spinMs: number;
  /** Threads started so far (restarts included). */
  starts = 0;

  constructor(opts: GrammarThreadOptions = {}) {
    this.budgetMs = opts.budgetMs ?? GRAMMAR_BUDGET_MS;
    this.maxPending = opts.maxPending ?? 64;
    this.startTimeoutMs = opts.startTimeoutMs ?? 30_000;
    this.spinMs = opts.spinMs ?? 0;
  }

  /**
   * GBNF text of a normalised JSON schema, as json-grammar.ts `jsonSchemaGbnf` makes it.
   * @throws PdError schema_too_complex past the budget, QUEUE_FULL, engine_failed (thread lost or
   * closed); PdError BAD_GRAMMAR with the generator's message when node-llama-cpp refuses the schema.
   */
  gbnf(schema: Record<string, unknown>): Promise<string> {
    if (this.closed) return Promise.reject(new PdError('engine_failed', 'grammar thread closed'));
    if (this.queue.length + (this.current ? 1 : 0) >= this.maxPending) return Promise.reject(new PdError('QUEUE_FULL', `grammar queue is full (${this.maxPending} schemas)`));
    return new Promise<string>((resolve, reject) => {
      this.queue.push({ id: ++this.seq, schema, resolve, reject });
      this.next();
    });
  }

  /** Terminate the thread; queued and running schemas fail with engine_failed. Idempotent. */
  async close(): Promise<void> {
    this.closed = true;
    const w = this.worker;
    this.lost(w, 'grammar thread closed');
    for (const j of this.queue.splice(0)) j.reject(new PdError('engine_failed', 'grammar thread closed'));
    if (w) await w.terminate().catch(() => 0);
  }

  /** Send the next queued schema when the thread is idle. */
  private next(): void {
    if (this.current || this.closed) return;
    const job = this.queue.shift();
    if (!job) return;
    this.current = job;
    this.start().then(
      () => {
        const w = this.worker;
        if (this.current !== job || !w) return;
        this.current.timer = setTimeout(() => {
          this.lost(w, null);
          void w.terminate().catch(() => 0);
          job.reject(new PdError('schema_too_complex', `the JSON schema's grammar took more than the ${this.budgetMs} ms time budget to generate`));
          this.next();
        }, this.budgetMs);
        this.current.timer.unref();
        w.postMessage({ id: job.id, schema: job.schema });
      },
      () => {}, // start failure: `lost` failed the job
    );
  }

  private start(): Promise<void> {
    if (this.ready) return this.ready;
    this.starts++;
    const { worker, ready } = startWorkerThread<Reply>({
      entry: 'grammar-worker',
      base: import.meta.url,
      label: 'grammar thread',
      workerData: { spinMs: this.spinMs },
      startTimeoutMs: this.startTimeoutMs,
      onMessage: (m, w) => {
        const job = this.current;
        if (!job || job.id !== m.id || this.worker !== w) return;
        clearTimeout(job.timer);
        this.current = undefined;
        if ('error' in m) job.reject(new PdError(BAD_GRAMMAR, m.error));
        else job.resolve(m.gbnf);
        this.next();
      },
      onGone: (w, why) => this.lost(w, why),
      onStartTimeout: (w, why) => {
        this.lost(w, why);
        void w.terminate().catch(() => 0);
      },
    });
    this.worker = worker;
    this.ready = ready;
    return ready;
  }

  /** Thread `w` is gone: the schema in work fails with `why` (null: already answered), the next starts a new thread. */
  private lost(w: Worker | undefined, why: string | null): void {
    if (!w || this.worker !== w) return;
    this.worker = undefined;
    this.ready = undefined;
    const job = this.current;
    this.current = undefined;
    if (job) {
      clearTimeout(job.timer);
      if (why !== null) job.reject(new PdError('engine_failed', why));
    }
    if (why !== null) this.next();
  }
}
