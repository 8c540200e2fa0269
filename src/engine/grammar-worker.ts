/**
 * Entry of the grammar thread (see ./grammar-thread.ts): turns JSON schemas into GBNF text with
 * node-llama-cpp's generator (pure JavaScript, no llama.cpp instance) and json-grammar.ts's
 * patches, off the worker's event loop. Messages in: `{id, schema}`; out: `{ready: true}` once,
 * then `{id, gbnf}` or `{id, error}` per schema, in order. `workerData.spinMs` (tests only) makes
 * each schema take at least that long, as a slow generation would.
 */
import { pathToFileURL } from 'node:url';
import { parentPort, workerData } from 'node:worker_threads';
import { jsonSchemaGbnfWith, type GbnfGenerator } from './json-grammar.js';
import { gbnfGeneratorPath } from './grammar-thread.js';

const port = parentPort!;
const spinMs = Number((workerData as { spinMs?: number } | null)?.spinMs ?? 0);
const mod = (await import(pathToFileURL(gbnfGeneratorPath()).href)) as { getGbnfGrammarForGbnfJsonSchema: GbnfGenerator };
const generate = mod.getGbnfGrammarForGbnfJsonSchema;
port.on('message', (job: { id: number; schema: Record<string, unknown> }) => {
  try {
    if (spinMs > 0) Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, spinMs); // the thread blocked, as in a slow generation
    port.postMessage({ id: job.id, gbnf: jsonSchemaGbnfWith((s) => generate(s), job.schema) });
  } catch (err) {
    port.postMessage({ id: job.id, error: (err as Error).message ?? String(err) });
  }
});
port.postMessage({ ready: true });
