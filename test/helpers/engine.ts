/** Engine test helpers: drain a slot's generation into tokens, text, chunks and the finish reason; save a real tiny state. */
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { ensureModel } from '../../src/engine/gguf-writer.js';
import { loadEngine } from '../../src/engine/llama.js';
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

/**
 * Save a real KV state with the real engine (tiny model, one sequence, greedy 4-token prefill of
 * a fixed ~40-token text) into `dir/state.ggsq` and return its bytes and prompt length (tokens).
 * Used by the KV handoff tests that need a genuine ggsq file. Throws what the engine throws.
 */
export async function saveTinyState(dir: string, contextSize: number): Promise<{ state: Buffer; nTokens: number }> {
  const engine = await loadEngine({ modelPath: await ensureModel('tiny', 1, dir), sequences: 1, contextSize, batchSize: 64 });
  try {
    const tokens = engine.tokenize('the river ran past old mills and quiet farms '.repeat(4));
    const slot = engine.tryAcquireSlot()!;
    await slot.prefill(tokens, { temperature: 0, topP: 1, topK: 0, maxTokens: 4, stop: [], ignoreEos: false }, new AbortController().signal);
    const file = path.join(dir, 'state.ggsq');
    await slot.saveState(file);
    slot.release();
    return { state: readFileSync(file), nTokens: tokens.length };
  } finally {
    await engine.dispose();
  }
}
