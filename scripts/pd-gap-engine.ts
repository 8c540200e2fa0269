/**
 * The engine's share of a PD request's token-1 → token-2 gap, without processes, sockets or
 * HTTP. Bench-only.
 *
 *   node --import tsx scripts/pd-gap-engine.ts [reps=4] [prompt words=580] [decode sequences=10] [kv cache type=f16]
 *
 * Two engines on the generated small GGUF, 1 thread each, in one process: a "prefill" one (1
 * sequence) and a "decode" one (`decode sequences`, as §2's decode worker). Per rep, a prompt of
 * about `prompt words` words (≈ 1500 tokens at 580; each rep its own, no prefix reused) is
 * evaluated on prefill; then, timed: the state save to /dev/shm (what prefill does after token 1),
 * the colocated continuation on the prefill sequence (its token 1 → 2 is one decode step), the
 * state load into a decode sequence (validated first, untimed, as decode's receiver does) and the
 * decode continuation, then a second generate() on the same decode sequence with no load before it
 * ("again": a new sampler and evaluation, the same context and shapes), and a third after the
 * same state was loaded into another decode sequence ("after a load into another sequence"). A line per rep: save,
 * load, and each continuation's step times (ms; the first entry is token 1, which needs no step).
 */
import { readFileSync, rmSync } from 'node:fs';
import { homedir } from 'node:os';
import { join } from 'node:path';
import { loadEngine, parseStateFile } from '../src/engine/index.js';
import type { SamplingParams } from '../src/engine/types.js';
import type { KvCacheType } from '../src/engine/gpu.js';

const reps = Number(process.argv[2] ?? 4);
const promptWords = Number(process.argv[3] ?? 580);
const decodeSequences = Number(process.argv[4] ?? 10);
const kvCacheType = (process.argv[5] ?? 'f16') as KvCacheType;
const modelPath = join(homedir(), '.cache/pdserve/pdserve-small-s1-g2.gguf');
const common = { modelPath, threads: 1, contextSize: 2048, batchSize: 512, kvCacheType };
const P = await loadEngine({ ...common, sequences: 1 });
const D = await loadEngine({ ...common, sequences: decodeSequences });
const sampling = { temperature: 0, maxTokens: 6, ignoreEos: true, stop: [] } as unknown as SamplingParams;
const words = 'the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly bears near old mills'.split(' ');

/** Step times (ms) of one generate() run: the first entry is token 1's, which needs no step. */
async function steps(gen: AsyncGenerator<unknown, unknown>): Promise<number[]> {
  const out: number[] = [];
  let t = performance.now();
  for await (const _ of gen) {
    const n = performance.now();
    out.push(Math.round(n - t));
    t = n;
  }
  return out;
}

try {
  for (let k = 0; k < reps; k++) {
    const text = `${Array.from({ length: promptWords }, (_, i) => words[(i * 7 + k * 3 + (i >> 5)) % words.length]).join(' ')} ${k}`;
    const toks = P.tokenize(text, true);
    const path = `/dev/shm/pdserve-gap-engine-${process.pid}-${k}.ggsq`;
    const ps = P.tryAcquireSlot()!;
    const ds = D.tryAcquireSlot()!;
    try {
      const r = await ps.prefill(toks, sampling, new AbortController().signal);
      let t = performance.now();
      const bytes = await ps.saveState(path);
      const saveMs = performance.now() - t;
      const colo = await steps(ps.generate(r.firstToken, sampling, new AbortController().signal));
      const buf = readFileSync(path);
      const parsed = parseStateFile(buf, { contextSize: D.info.compat.contextSize, nLayer: D.info.compat.nLayer, maxBytes: buf.length, nVocab: D.info.nVocab });
      t = performance.now();
      await ds.loadState(path, toks, parsed);
      const loadMs = performance.now() - t;
      const pd = await steps(ds.generate(r.firstToken, sampling, new AbortController().signal));
      const again = await steps(ds.generate(r.firstToken, sampling, new AbortController().signal));
      // The same state into another decode sequence, then a generate() on the first one again:
      // is a load's cost for the next step the loaded sequence's, or the whole context's?
      const ds2 = D.tryAcquireSlot()!;
      let cross: number[] = [];
      try {
        const buf2 = readFileSync(path);
        await ds2.loadState(path, toks, parseStateFile(buf2, { contextSize: D.info.compat.contextSize, nLayer: D.info.compat.nLayer, maxBytes: buf2.length, nVocab: D.info.nVocab }));
        cross = await steps(ds.generate(r.firstToken, sampling, new AbortController().signal));
      } finally {
        ds2.release();
      }
      console.log(`rep ${k}: ${toks.length} tokens, state ${(bytes / 2 ** 20).toFixed(1)} MiB (${kvCacheType}); save ${saveMs.toFixed(0)} ms; colocated steps ${colo.join(' ')}; load ${loadMs.toFixed(0)} ms; decode steps ${pd.join(' ')}; again ${again.join(' ')}; after a load into another sequence ${cross.join(' ')}`);
    } finally {
      ps.release();
      ds.release();
      rmSync(path, { force: true });
    }
  }
} finally {
  await P.dispose();
  await D.dispose();
}
