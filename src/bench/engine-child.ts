/**
 * Child process of bench section 4: node-llama-cpp driven directly through src/engine (no HTTP,
 * no PD), with the decode worker's context settings (its sequence count includes the decode
 * worker's prefix-cache sequences: see `decodeContextSequences`). `run`: N prompts are evaluated at once
 * (one slot each), then all N sequences generate concurrently (node-llama-cpp batches them into
 * one llama_decode per step, as the decode worker does); the arrival time of every token is
 * reported, relative to the run's start.
 */
import { rm } from 'node:fs/promises';
import { performance } from 'node:perf_hooks';
import { loadEngine } from '../engine/llama.js';
import type { Engine } from '../engine/types.js';

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
  process.on('message', async (m: { cmd: string; prompts: string[]; outputLen: number; stateTokens?: number }) => {
    if (m.cmd === 'starve') {
      try {
        send({ type: 'starved', ...(await starveProbe(engine, m.prompts, m.outputLen, m.stateTokens ?? 1024)) });
      } catch (err) {
        send({ type: 'starved', error: (err as Error).message });
      }
      return;
    }
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

/**
 * How long a state load and a slot reuse take with the context idle, and while `prompts.length`
 * other sequences are generating `outputLen` tokens: each busy measurement also reports how many
 * of those streams had finished by the time it completed (all of them = it waited for the batch
 * to drain).
 */
async function starveProbe(engine: Engine, prompts: string[], outputLen: number, stateTokens: number) {
  const sampling = { temperature: 0, topP: 1, topK: 0, maxTokens: outputLen, stop: [], ignoreEos: true };
  const one = { ...sampling, maxTokens: 1 };
  const sig = () => new AbortController().signal;
  const corpus = engine.tokenize(prompts.join(' ').repeat(Math.ceil(stateTokens / 10) + 1)).slice(0, stateTokens);
  const path = `/dev/shm/pdserve-bench-starve-${process.pid}.ggsq`;
  const a = engine.tryAcquireSlot()!;
  await a.prefill(corpus, one, sig());
  await a.saveState(path);
  a.release();
  const short = corpus.slice(0, 64);
  const loadMs = async () => {
    const s = engine.tryAcquireSlot()!;
    const t = performance.now();
    await s.loadState(path, corpus);
    const d = performance.now() - t;
    s.release();
    return d;
  };
  const reuseMs = async () => {
    // the slot released last is the lowest free index: reacquire it while its clearHistory is pending
    const s = engine.tryAcquireSlot()!;
    await s.prefill(short, one, sig());
    s.release();
    const r = engine.tryAcquireSlot()!;
    const t = performance.now();
    await r.prefill(short, one, sig());
    const d = performance.now() - t;
    r.release();
    return d;
  };
  const idleLoadMs = (await loadMs(), await loadMs());
  const idleReuseMs = (await reuseMs(), await reuseMs());
  // Busy: `prompts.length` streams generate; 500 ms in, measure once (a fresh batch per measurement).
  const busy = async (measure: () => Promise<number>) => {
    let finished = 0;
    const t0 = performance.now();
    const streams = prompts.map(async (p) => {
      const s = engine.tryAcquireSlot()!;
      const r = await s.prefill(engine.tokenize(p), sampling, sig());
      for await (const _t of s.generate(r.firstToken, sampling, sig()));
      s.release();
      finished++;
      return performance.now() - t0;
    });
    await new Promise((r) => setTimeout(r, 500));
    const ms = await measure();
    const finishedBefore = finished;
    const ends = await Promise.all(streams);
    return { ms, finishedBefore, streamsEndMs: Math.max(...ends) - 500 };
  };
  const load = await busy(loadMs);
  const reuse = await busy(reuseMs);
  await rm(path, { force: true });
  return {
    streams: prompts.length,
    outputLen,
    stateTokens,
    idleLoadMs,
    idleReuseMs,
    busyLoadMs: load.ms,
    /** Streams that had finished when the busy load completed (all = it waited for the batch to drain). */
    finishedAtLoad: load.finishedBefore,
    /** When the last stream ended, ms after the busy measurement started. */
    loadStreamsEndMs: load.streamsEndMs,
    busyReuseMs: reuse.ms,
    finishedAtReuse: reuse.finishedBefore,
    reuseStreamsEndMs: reuse.streamsEndMs,
  };
}

main().catch((err) => {
  send({ type: 'ready', error: (err as Error).message });
  process.exit(1);
});
