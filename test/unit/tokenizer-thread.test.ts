/**
 * The tokenizer thread (src/engine/tokenizer-thread.ts): large prompts are
 * templated and tokenized off the event loop with the engine's own functions. Checked on the
 * real engine (tiny generated model): the thread's tokens equal the engine's for text and chat;
 * the event loop keeps running while a large chat renders there (and does not while the same
 * render runs on the loop, so the check can fail); the queue is bounded; a closed thread fails
 * its callers; `tokenizeRequestOffLoop` keeps tokenizeRequest's 400s and tokens.
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { OFF_LOOP_MESSAGES, tokenizeRequest, tokenizeRequestOffLoop } from '../../src/api/requests.js';
import { ensureModel } from '../../src/engine/gguf-writer.js';
import { loadEngine } from '../../src/engine/llama.js';
import { TokenizerThread } from '../../src/engine/tokenizer-thread.js';
import type { ChatMessage, Engine } from '../../src/engine/types.js';

let engine: Engine;
let thread: TokenizerThread;
const words = 'once upon a time there was a little fox who lived near the old mill and liked bread ';
const prose = (n: number): string => words.repeat(Math.ceil(n / words.length)).slice(0, n);
const chat = (n: number, bytes: number): ChatMessage[] =>
  Array.from({ length: n }, (_, i) => ({ role: i === 0 ? 'system' : i % 2 ? 'user' : 'assistant', content: `${i}: ${prose(bytes)}` }));

/** Timer ticks (1 ms interval) that fired while `work` ran. */
async function ticksDuring(work: () => unknown): Promise<number> {
  let ticks = 0;
  const iv = setInterval(() => ticks++, 1);
  await new Promise((r) => setTimeout(r, 5));
  ticks = 0;
  try {
    await work();
  } finally {
    clearInterval(iv);
  }
  return ticks;
}

before(async () => {
  engine = await loadEngine({ modelPath: await ensureModel('tiny', 1), sequences: 1, contextSize: 4096, batchSize: 64 });
  thread = new TokenizerThread(engine.info.modelPath);
  await thread.start();
});
after(async () => {
  await thread?.close();
  await engine?.dispose();
});

describe('tokenizer thread', () => {
  test('the same tokens as the engine, for text and chat', async () => {
    for (const text of ['', 'Once upon a time', prose(64 * 1024)]) assert.deepEqual(await thread.tokenize(text), engine.tokenize(text));
    assert.deepEqual(await thread.tokenize('abc', false), engine.tokenize('abc', false));
    for (const msgs of [chat(1, 10), chat(3, 100), chat(200, 300)]) assert.deepEqual(await thread.renderChat(msgs), engine.renderChat(msgs));
  });

  test('the event loop keeps running while a large chat renders on the thread (not while it renders on the loop)', async () => {
    const big = chat(2048, 64);
    const onLoop = await ticksDuring(() => engine.renderChat(big));
    const offLoop = await ticksDuring(() => thread.renderChat(big));
    assert.equal(onLoop, 0, 'rendering on the loop blocks every timer');
    assert.ok(offLoop >= 3, `timers fired while the thread rendered (${offLoop} ticks)`);
  });

  test('bounded queue; a closed thread fails its callers', async () => {
    const t = new TokenizerThread(engine.info.modelPath, { maxPending: 1 });
    await t.start();
    const first = t.renderChat(chat(500, 100));
    await assert.rejects(t.tokenize('x'), (e: { code?: string }) => e.code === 'QUEUE_FULL');
    await first;
    const held = assert.rejects(t.renderChat(chat(500, 100)), (e: { code?: string }) => e.code === 'engine_failed');
    await t.close();
    await held;
    await assert.rejects(t.tokenize('x'), (e: { code?: string }) => e.code === 'engine_failed');
    assert.equal(t.available, false, 'a closed thread is not available: callers tokenize on their loop');
    assert.deepEqual(await tokenizeRequestOffLoop(engine, t, { text: prose(8 * 1024) }), engine.tokenize(prose(8 * 1024)));
    // Starts are capped per process (each is a new llama.cpp instance).
    const once = new TokenizerThread(engine.info.modelPath, { maxStarts: 0 });
    assert.equal(once.available, false);
    await assert.rejects(once.start(), (e: { code?: string }) => e.code === 'engine_failed');
  });

  test('tokenizeRequestOffLoop: same tokens and the same 400s as tokenizeRequest', async () => {
    const bodies = [{ text: 'short prompt' }, { text: prose(20 * 1024) }, { messages: chat(OFF_LOOP_MESSAGES + 1, 20) }, { messages: chat(2, 20) }, { input_ids: [1, 2, 3] }];
    for (const b of bodies) assert.deepEqual(await tokenizeRequestOffLoop(engine, thread, b), tokenizeRequest(engine, b));
    const tooBig = { text: 'x'.repeat(engine.info.compat.contextSize * engine.info.maxTokenBytes + engine.info.maxTokenBytes) };
    await assert.rejects(tokenizeRequestOffLoop(engine, thread, tooBig), (e: { code?: string }) => e.code === 'context_length_exceeded');
    await assert.rejects(tokenizeRequestOffLoop(engine, thread, { messages: [] }), (e: { code?: string }) => e.code === 'invalid_request');
    await assert.rejects(tokenizeRequestOffLoop(engine, thread, { input_ids: [10 ** 9] }), (e: { code?: string }) => e.code === 'invalid_token');
  });
});
