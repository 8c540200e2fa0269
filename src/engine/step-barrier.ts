/**
 * One decode step for every generating sequence: keeps node-llama-cpp's batch dispatcher from
 * starting the next llama_decode before the sequences whose tokens it just sampled have queued
 * their next one.
 *
 * How node-llama-cpp 3.21.1 batches (`LlamaContext.dispatchPendingBatch`): while it holds the
 * context lock it loops — decode what is queued, sample each sequence's next token (one native
 * async call per sequence), wait for every sample, then look at its queue again and decode what
 * is there. A sequence queues its next token only at the end of the JavaScript continuation of
 * the previous one: node-llama-cpp's own generator, the engine's `generate()`, the consumer (the
 * decode worker's SSE write) and back — some 20–30 promise hops, against about 5 in the
 * dispatcher between the last sample and its look at the queue. So the sequence sampled last
 * missed almost every step, and once llama.cpp's compute thread was running on the same core its
 * continuation finished 1–6 ms later and it waited for the next step. Measured with 8 streams on
 * one pinned core: 6.2 tokens per llama_decode behind the decode worker's HTTP streams, 7.5 in a
 * bare engine loop (issue #9, BENCHMARKS.md §4).
 *
 * The dispatcher awaits, after sampling, the `afterBatchAction` each queued decode carries:
 * `LlamaContextSequence._takeIntervalCheckpointIfNeededAfterBatch`, an own, bound function of
 * every sequence (node-llama-cpp takes SWA checkpoints there; it returns undefined for models
 * without SWA). `installStepBarrier` wraps it: the first call after a batch returns a promise
 * resolved by `setImmediate`, so the dispatcher looks at its queue only after every promise
 * continuation of the current event-loop turn has run — every sequence whose next token needs
 * no I/O is queued by then. Cost: one event-loop turn per llama_decode (microseconds). A
 * sequence still late (its consumer waits for a socket to drain) is not waited for: it joins the
 * next step, as before. If a later node-llama-cpp no longer has the hook, nothing is installed
 * (`installStepBarrier` returns false) and batching works as it did without it.
 */

/** The per-sequence hook node-llama-cpp's dispatcher awaits after each batch (internal API of 3.21.1). */
const HOOK = '_takeIntervalCheckpointIfNeededAfterBatch';

type AfterBatch = (sequenceStateLength: number) => Promise<void> | void;

/**
 * The shared barrier of one context: `wait()` returns the same promise to every caller until the
 * event loop has moved on, so one batch waits one `setImmediate`, not one per sequence. Counts
 * the batches (`steps`) and the queued decodes in them (`sequences`): `sequences / steps` is the
 * mean number of sequences per llama_decode while generating.
 */
export class StepBarrier {
  private pending: Promise<void> | null = null;
  /** Batches seen (llama_decode calls that carried a hooked sequence). */
  steps = 0;
  /** Hook calls: queued decodes (sequences) over all those batches. */
  sequences = 0;

  /** @param waiting false: only count (the dispatcher does not wait; for comparisons). */
  constructor(readonly waiting = true) {}

  /**
   * A promise resolved on the next `setImmediate` (the check phase of this loop turn, after all
   * pending promise continuations and I/O callbacks of the poll phase). Calls until the turn after
   * that get the same promise (already resolved once the barrier passed): the dispatcher calls the
   * hook once per sequence of a batch, one after another. Undefined when not `waiting`.
   */
  wait(): Promise<void> | undefined {
    this.sequences++;
    if (this.pending) return this.waiting ? this.pending : undefined;
    this.steps++;
    const p = new Promise<void>((resolve) =>
      setImmediate(() => {
        resolve();
        // Forget it in the next turn's check phase: the rest of this batch's hooks run in the
        // promise continuations right after `resolve`, the next batch's only after a llama_decode
        // and a round of sampling (native async calls, so at least one poll phase later).
        setImmediate(() => {
          if (this.pending === p) this.pending = null;
        });
      }),
    );
    this.pending = p;
    return this.waiting ? p : undefined;
  }
}

/**
 * Make node-llama-cpp's dispatcher wait for `barrier` after every batch that included `seq`
 * (see the module comment). Composes with what the hook did (an SWA checkpoint promise is
 * awaited as before).
 * @returns false when `seq` has no such hook (another node-llama-cpp version): nothing changed.
 */
export function installStepBarrier(seq: object, barrier: StepBarrier): boolean {
  const s = seq as Record<string, unknown>;
  const orig = s[HOOK];
  if (typeof orig !== 'function' || !Object.prototype.hasOwnProperty.call(s, HOOK)) return false;
  const inner = orig as AfterBatch;
  const wrapped: AfterBatch = (len) => {
    const r = inner(len);
    const b = barrier.wait();
    if (!b) return r;
    return r instanceof Promise ? Promise.all([r, b]).then(() => undefined) : b;
  };
  s[HOOK] = wrapped;
  return true;
}
