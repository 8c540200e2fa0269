/**
 * Child process of bench section 4: node-llama-cpp driven directly through src/engine (no HTTP,
 * no PD), with the decode worker's context settings. `run`: N prompts are evaluated at once
 * (one slot each), then all N sequences generate concurrently (node-llama-cpp batches them into
 * one llama_decode per step, as the decode worker does); the arrival time of every token is
 * reported, relative to the run's start.
 */
import { performance } from 'node:perf_hooks';
import { loadEngine } from '../engine/llama.js';

interface Init {
  model: string;
  contextSize: number;
  batchSize: number;
  sequences: number;
  threads: number;
}

const init = JSON.parse(process.argv[2] ?? '{}') as Init;
const send = (m: object): void => void process.send?.(m);
process.on('disconnect', () => process.exit(0));

async function main(): Promise<void> {
  const engine = await loadEngine({ modelPath: init.model, threads: init.threads, sequences: init.sequences, contextSize: init.contextSize, batchSize: init.batchSize });
  send({ type: 'ready' });
  process.on('message', async (m: { cmd: string; prompts: string[]; outputLen: number }) => {
    if (m.cmd !== 'run') return;
    try {
      const sampling = { temperature: 0, topP: 1, topK: 0, maxTokens: m.outputLen, stop: [], ignoreEos: true };
      const t0 = performance.now();
      const slots = m.prompts.map(() => {
        const s = engine.tryAcquireSlot();
        if (!s) throw new Error('not enough slots');
        return s;
      });
      try {
        const streams = await Promise.all(
          m.prompts.map(async (p, i) => {
            const slot = slots[i]!;
            const ac = new AbortController();
            const r = await slot.prefill(engine.tokenize(p), sampling, ac.signal);
            const at: number[] = [];
            for await (const _t of slot.generate(r.firstToken, sampling, ac.signal)) at.push(performance.now() - t0);
            return at;
          }),
        );
        send({ type: 'result', streams });
      } finally {
        for (const s of slots) s.release();
      }
    } catch (err) {
      send({ type: 'result', error: (err as Error).message });
    }
  });
}

main().catch((err) => {
  send({ type: 'ready', error: (err as Error).message });
  process.exit(1);
});
