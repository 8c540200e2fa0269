/**
 * Batch packing of decode workers on CPU hosts. On a CPU, one llama.cpp step of 8 sequences
 * costs much less than two steps of 4 on two workers (the weights are read once per step, and
 * the two workers' steps share the same cores); on a GPU spreading costs little. So a decode
 * pick that no cache claim decides fills one worker's batch before it starts the next:
 *
 *   When every candidate reports no GPU offload and its slot count, the request goes to the
 *   most loaded candidate with a free slot (load < slots) that the load guard does not call
 *   overloaded, ties in pool order; when none qualifies, the caller's own rule decides.
 *
 * Cache-aware choices (a worker whose KV events hold the conversation, the conversation's sticky
 * worker, a prefix-tree hit) come first in the policy (./index.ts); packing replaces only its
 * "most spare cache" fallback. The idea is vLLM/SGLang's batch-first scheduling within one
 * engine, applied across the engines of one host.
 */
/** What packing needs of a worker (a PolicyWorker of ./index.ts, which imports this module): load, slots and GPU offload from /health (undefined: not reported). */
export interface PackWorker {
  readonly url: string;
  /** In-flight requests. */
  readonly load: number;
  /** Sequence slots (/health `slots`). */
  readonly slots?: number | undefined;
  /** GPU offload from /health `gpu` (backend null or "0/N" layers: CPU only); undefined: not reported. */
  readonly gpu?: { readonly gpu: string | null; readonly gpu_layers?: string | null } | undefined;
}

/**
 * The candidate whose batch to fill (see the module doc), or undefined when packing does not
 * apply (a candidate with a GPU or with unreported slots/offload, none with a free slot that is
 * not `overloaded`, or fewer than two candidates).
 * @param overloaded the policy's load guard for one worker's load (SGLang's imbalance rule).
 */
export function packedWorker<W extends { readonly load: number }>(c: readonly W[], overloaded: (load: number) => boolean): W | undefined {
  if (c.length < 2) return undefined;
  let best: W | undefined;
  for (const w of c as readonly (W & PackWorker)[]) {
    if (w.gpu === undefined || w.slots === undefined || (w.gpu.gpu !== null && !w.gpu.gpu_layers?.startsWith('0/'))) return undefined;
    if (w.load >= w.slots || overloaded(w.load)) continue;
    if (!best || w.load > best.load) best = w;
  }
  return best;
}
