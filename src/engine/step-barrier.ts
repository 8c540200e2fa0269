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
 * missed every step, and once llama.cpp's compute thread was running on the same core its
 * continuation finished 1–6 ms later and it joined the next step. Measured with 8 (4) streams on
 * one pinned core, steady state: 7 of 8 (3 of 4) sequences per llama_decode, in the decode worker
 * and in a bare engine loop alike; a llama_decode of 8 tokens costs about what one of 7 does
 * (BENCHMARKS.md §4).
 *
 * The dispatcher awaits, after sampling, the `afterBatchAction` each queued decode carries:
 * `LlamaContextSequence._takeIntervalCheckpointIfNeededAfterBatch`, an own, bound function of
 * every sequence (node-llama-cpp takes SWA checkpoints there; it returns undefined for models
 * without SWA). `installStepBarrier` wraps it: the first call of a batch (batches counted by
 * `installBatchCounter`) returns a promise resolved by `setImmediate`, so the dispatcher looks
 * at its queue only after every promise continuation of the current event-loop turn has run —
 * every sequence whose next token needs no I/O is queued by then. Cost: one event-loop turn per
 * llama_decode (microseconds). A sequence still late (its consumer waits for a socket to drain)
 * is not waited for: it joins the next step. If a later node-llama-cpp no longer has
 * the hook or the batch call, nothing is installed (`installStepBarrier` / `installBatchCounter`
 * return false) and batching works as it did without it.
 */

/** The per-sequence hook node-llama-cpp's dispatcher awaits after each batch (internal API of 3.21.1). */
const HOOK = '_takeIntervalCheckpointIfNeededAfterBatch';

type AfterBatch = (sequenceStateLength: number) => Promise<void> | void;

/**
 * The shared barrier of one context: `wait()` returns the same promise to every caller of one
 * batch, so one batch waits one `setImmediate`, not one per sequence. A batch is one
 * `batchStarted()` (the context's llama_decode call: `installBatchCounter`): the first hook call
 * after it makes a new promise, whatever the time — the hooks of the next batch can come within
 * the same event-loop turn as the last ones of this batch (a small model's llama_decode and
 * sampling finishing in one poll phase), and they must wait too. Counts the batches (`steps`)
 * and the queued decodes in them (`sequences`): `sequences / steps` is the mean number of
 * sequences per llama_decode while generating.
 */
export class StepBarrier {
  private pending: Promise<void> | null = null;
  /** The batch `pending` belongs to (a value of `batches`). */
  private pendingBatch = -1;
  /** llama_decode calls seen (`batchStarted`), with or without a hooked sequence. */
  batches = 0;
  /** Batches seen (llama_decode calls that carried a hooked sequence). */
  steps = 0;
  /** Hook calls: queued decodes (sequences) over all those batches. */
  sequences = 0;

  /**
   * @param waiting false: only count (the dispatcher does not wait; for comparisons).
   * @param beforeDispatch runs when the barrier passes, right before the dispatcher looks at its
   *   queue (the engine puts the queue in sequence order there: `sortQueuedDecodes`).
   */
  constructor(
    readonly waiting = true,
    private readonly beforeDispatch?: () => void,
  ) {}

  /** A new batch (llama_decode call) begins: the next `wait()` belongs to it. */
  batchStarted(): void {
    this.batches++;
  }

  /**
   * The current batch's promise, resolved on the `setImmediate` after its first hook call (the
   * check phase of that loop turn, after all pending promise continuations and I/O callbacks of
   * the poll phase). Later calls of the same batch get the same promise (already resolved once
   * the barrier passed): the dispatcher calls the hook once per sequence of a batch, one after
   * another. Undefined when not `waiting`.
   */
  wait(): Promise<void> | undefined {
    this.sequences++;
    if (this.pending && this.pendingBatch === this.batches) return this.waiting ? this.pending : undefined;
    this.steps++;
    this.pendingBatch = this.batches;
    const p = new Promise<void>((resolve) =>
      setImmediate(() => {
        this.beforeDispatch?.();
        resolve();
      }),
    );
    this.pending = p;
    return this.waiting ? p : undefined;
  }
}

/**
 * Make `barrier` count `context`'s batches: wraps the native context's `decodeBatch` (internal
 * API of 3.21.1: `LlamaContext._ctx.decodeBatch()`, called once per batch by the dispatcher,
 * before the batch's after-batch hooks) so that each call is `barrier.batchStarted()`; the
 * addon's method is shadowed by an own property of that one native object.
 * @returns false when `context` has no such call (another node-llama-cpp version) or it cannot
 *   be shadowed: nothing changed.
 */
export function installBatchCounter(context: object, barrier: StepBarrier): boolean {
  const ctx = (context as { _ctx?: unknown })._ctx;
  if (typeof ctx !== 'object' || ctx === null) return false;
  const c = ctx as Record<string, unknown>;
  const orig = c.decodeBatch;
  if (typeof orig !== 'function') return false;
  const counted = function (this: unknown, ...args: unknown[]): unknown {
    barrier.batchStarted();
    return (orig as (...a: unknown[]) => unknown).apply(this, args);
  };
  try {
    // an own property over the addon's read-only prototype method (assignment would throw)
    Object.defineProperty(c, 'decodeBatch', { value: counted, writable: true, configurable: true, enumerable: false });
  } catch {
    return false; // a non-extensible object
  }
  return c.decodeBatch === counted;
}

/**
 * Make node-llama-cpp's dispatcher wait for `barrier` after every batch that included `seq`
 * (see the module comment). Composes with what the hook did (an SWA checkpoint promise is
 * still awaited).
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

/**
 * Put node-llama-cpp's queue of pending decodes (`LlamaContext._queuedDecodes`, internal in
 * 3.21.1: objects with a numeric `sequenceId`) in sequence-id order, in place; stable, so one
 * sequence's items keep their order. Why: with one KV stream per sequence llama.cpp splits a
 * batch into ubatches of consecutive, increasing sequence ids in batch order
 * (`llama_batch_allocr::split_equal(…, sequential = true)` from `llama_kv_cache::init_batch`),
 * and node-llama-cpp builds the batch in queue order, which is the order the sequences' tokens
 * came back from sampling. 8 sequences 0–7 queued as 5,0,2,3,6,7,1,4 were three ubatches — three
 * passes over the weights — for one llama_decode; sorted, one. Sequences that are not consecutive
 * (0–2 and 9–13) still make one ubatch per run. Nothing happens when the queue is not there.
 * @returns whether the queue was found.
 */
export function sortQueuedDecodes(context: object): boolean {
  const q = (context as { _queuedDecodes?: unknown })._queuedDecodes;
  if (!Array.isArray(q)) return false;
  if (q.length > 1 && q.every((d) => typeof (d as { sequenceId?: unknown }).sequenceId === 'number')) q.sort((a: { sequenceId: number }, b: { sequenceId: number }) => a.sequenceId - b.sequenceId);
  return true;
}
