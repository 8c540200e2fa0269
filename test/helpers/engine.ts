/** Engine test helpers: drain a slot's generation into tokens, text, chunks and the finish reason. */
import type { FinishReason, SamplingParams, Slot } from '../../src/engine/types.js';

export interface Run {
  tokens: number[];
  text: string;
  chunks: string[];
  finish: FinishReason | 'abort';
}

/** Run `slot.generate(first, sp, signal)` to its end. */
export async function drain(slot: Slot, first: number, sp: SamplingParams, signal: AbortSignal = new AbortController().signal): Promise<Run> {
  const g = slot.generate(first, sp, signal);
  const run: Run = { tokens: [], text: '', chunks: [], finish: 'stop' };
  for (;;) {
    const n = await g.next();
    if (n.done) {
      run.finish = n.value;
      return run;
    }
    run.tokens.push(n.value.token);
    run.chunks.push(n.value.text);
    run.text += n.value.text;
  }
}
