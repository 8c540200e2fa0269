/**
 * Entry of the tokenizer thread (see ./tokenizer-thread.ts): loads the model's vocabulary only
 * (`vocabOnly`: no weight tensors, no context) and turns prompts into tokens with the same
 * functions the engine uses (./prompt.ts), off the worker's event loop. Messages in:
 * `{id, kind: 'text', text, addSpecial}`, `{id, kind: 'chat', messages}` or `{id, kind: 'stats', gc}`;
 * out: `{cache}` (the chunk cache's state after its self-check) and `{ready: true}` once, then
 * `{id, tokens: Uint32Array}`, `{id, stats}` or `{id, error}` per request, in order. `{kind: 'stop'}`
 * is answered `{stopped: true}` when it is reached (the thread is idle then); while the shared
 * `stop` flag is up, queued prompts are skipped. With `cacheBytes` > 0 prompts go through the
 * chunk cache (./token-chunks.ts), which checks itself first and stays off on a mismatch.
 */
import { getHeapStatistics, setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import { parentPort, workerData } from 'node:worker_threads';
import { getLlama, LlamaLogLevel } from 'node-llama-cpp';
import { chatWrapperOf, renderChatTokens, tokenizeText } from './prompt.js';
import { ChunkedTokenizer, selfCheckSamples } from './token-chunks.js';
import type { TokenizeJob } from './tokenizer-thread.js';

const port = parentPort!;
const { modelPath, stop, cacheBytes } = workerData as { modelPath: string; stop: Int32Array; cacheBytes?: number };
const llama = await getLlama({ gpu: false, build: 'never', maxThreads: 0, logLevel: LlamaLogLevel.error });
const model = await llama.loadModel({ modelPath, vocabOnly: true, gpuLayers: 0 });
const wrapper = chatWrapperOf(model);
const chunked = new ChunkedTokenizer(model, { maxBytes: cacheBytes ?? 0 });
const samples = selfCheckSamples();
chunked.selfCheck(samples, [
  (t) => renderChatTokens(model, wrapper, [{ role: 'system', content: samples[0]! }, { role: 'user', content: samples[1]! }, { role: 'assistant', content: samples[2]! }, { role: 'user', content: samples[3]! }], undefined, t),
]);
const tokenizer = chunked.stats().on ? chunked.tokenizer : model.tokenizer;
port.postMessage({ cache: chunked.stats() });
port.on('message', (job: TokenizeJob) => {
  // Native resources are freed here, in JS, before the thread is terminated (a llama.cpp instance
  // torn down by thread termination can abort the process).
  if (job.kind === 'stop') return void model.dispose().then(() => llama.dispose()).finally(() => port.postMessage({ stopped: true }));
  // Closing: queued prompts are skipped (their callers were already answered).
  if (Atomics.load(stop, 0) === 1) return port.postMessage({ id: job.id, error: 'stopped' });
  if (job.kind === 'stats') {
    // benchmarks: what is live after a full collection (the GC exposed for this on demand)
    if (job.gc) {
      setFlagsFromString('--expose-gc');
      (runInNewContext('gc') as () => void)();
    }
    const h = getHeapStatistics();
    return port.postMessage({ id: job.id, stats: { ...chunked.stats(), heapUsed: h.used_heap_size + h.external_memory } });
  }
  try {
    const tokens = Uint32Array.from(job.kind === 'text' ? tokenizeText(model, job.text, job.addSpecial, tokenizer) : renderChatTokens(model, wrapper, job.messages, job.tools, tokenizer));
    port.postMessage({ id: job.id, tokens }, [tokens.buffer]);
  } catch (err) {
    port.postMessage({ id: job.id, error: (err as Error).message ?? String(err) });
  }
});
port.postMessage({ ready: true });
