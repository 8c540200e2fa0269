/**
 * The engine's step barrier (src/engine/step-barrier.ts): every generating sequence in every
 * llama_decode, instead of node-llama-cpp starting the next step before the sequence sampled
 * last has queued its token. The barrier itself (one promise per event-loop turn), then the real
 * engine on the tiny model: N concurrent generations make one llama_decode per step (and more
 * without it). The barrier is keyed on the batch (the context's decodeBatch calls), not on time.
 * Run: node --import tsx --test test/unit/step-barrier.test.ts
 */
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { ensureModel } from '../../src/engine/gguf-writer.js';
import { loadEngine } from '../../src/engine/llama.js';
import { installBatchCounter, installStepBarrier, sortQueuedDecodes, StepBarrier } from '../../src/engine/step-barrier.js';
import type { Engine, SamplingParams } from '../../src/engine/types.js';

const turn = () => new Promise<void>((r) => setImmediate(r));

describe('StepBarrier', () => {
  it('gives every call of one batch the same promise, resolved at setImmediate; a new one for the next batch', async () => {
    const b = new StepBarrier();
    b.batchStarted();
    const p1 = b.wait()!;
    const p2 = b.wait()!;
    assert.equal(p1, p2);
    let resolved = false;
    void p1.then(() => (resolved = true));
    await Promise.resolve();
    await Promise.resolve();
    assert.equal(resolved, false, 'not before the check phase');
    await p1;
    assert.equal(b.wait(), p1, 'the rest of the batch right after it passes: same (resolved) promise');
    await turn();
    await turn();
    assert.equal(b.wait(), p1, 'still the same batch, however late its hook (an SWA checkpoint before it)');
    b.batchStarted();
    const p3 = b.wait()!;
    assert.notEqual(p3, p1);
    await p3;
    assert.deepEqual({ steps: b.steps, sequences: b.sequences, batches: b.batches }, { steps: 2, sequences: 5, batches: 2 });
  });

  it('counting mode never makes the caller wait', () => {
    const b = new StepBarrier(false);
    b.batchStarted();
    assert.equal(b.wait(), undefined);
    assert.equal(b.wait(), undefined);
    b.batchStarted();
    assert.equal(b.wait(), undefined);
    assert.deepEqual({ steps: b.steps, sequences: b.sequences }, { steps: 2, sequences: 3 });
  });

  it('a batch whose decode and sampling finish in the turn the last barrier passed still waits, and its queue is sorted (review F4)', async () => {
    let sorted = 0;
    const b = new StepBarrier(true, () => sorted++);
    // llama_decode and sampling that finish at once (a small model, few tokens): the next batch's
    // hooks come in the same event-loop turn as the previous batch's barrier passing
    const ctx = { _ctx: { decodeBatch: async (): Promise<void> => {} } };
    assert.equal(installBatchCounter({}, b), false);
    assert.equal(installBatchCounter({ _ctx: {} }, b), false);
    assert.equal(installBatchCounter(ctx, b), true);
    const seqs = [0, 1, 2].map(() => ({ _takeIntervalCheckpointIfNeededAfterBatch: (_len: number): Promise<void> | void => undefined }));
    for (const seq of seqs) assert.equal(installStepBarrier(seq, b), true);
    // node-llama-cpp 3.21.1's dispatcher loop: decode, sample, then await each sequence's hook in turn
    const waits: boolean[] = [];
    for (let step = 0; step < 5; step++) {
      await ctx._ctx.decodeBatch();
      for (const seq of seqs) {
        const r = seq._takeIntervalCheckpointIfNeededAfterBatch(step + 1);
        if (seq === seqs[0]) {
          let passed = false;
          if (r instanceof Promise) void r.then(() => (passed = true));
          await Promise.resolve();
          waits.push(r instanceof Promise && !passed);
        }
        if (r instanceof Promise) await r;
      }
    }
    assert.deepEqual(waits, [true, true, true, true, true], 'every batch waited for the check phase');
    assert.deepEqual({ steps: b.steps, sequences: b.sequences, sorted }, { steps: 5, sequences: 15, sorted: 5 });
  });

  it('wraps the per-sequence hook only where it is an own function, and keeps what it returned', async () => {
    const b = new StepBarrier();
    assert.equal(installStepBarrier({}, b), false);
    class Seq {
      _takeIntervalCheckpointIfNeededAfterBatch(this: void) {}
    }
    assert.equal(installStepBarrier(new Seq(), b), false, 'a prototype method is not the bound hook 3.21.1 has');
    let checkpointDone = false;
    const seq = { _takeIntervalCheckpointIfNeededAfterBatch: (len: number) => (len > 0 ? new Promise<void>((r) => setTimeout(() => ((checkpointDone = true), r()), 5)) : undefined) };
    assert.equal(installStepBarrier(seq, b), true);
    await seq._takeIntervalCheckpointIfNeededAfterBatch(0);
    await turn();
    await turn();
    await seq._takeIntervalCheckpointIfNeededAfterBatch(3);
    assert.equal(checkpointDone, true, 'the original hook is still awaited');
  });
});

describe('sortQueuedDecodes', () => {
  it('puts the pending decodes in sequence order, stably, in place; tolerates a missing queue', () => {
    const q = [5, 0, 2, 3, 6, 7, 1, 4, 2].map((sequenceId, i) => ({ sequenceId, i }));
    const ctx = { _queuedDecodes: q };
    assert.equal(sortQueuedDecodes(ctx), true);
    assert.equal(ctx._queuedDecodes, q, 'the same array (node-llama-cpp holds it)');
    assert.deepEqual(q.map((d) => d.sequenceId), [0, 1, 2, 2, 3, 4, 5, 6, 7]);
    assert.deepEqual(q.filter((d) => d.sequenceId === 2).map((d) => d.i), [2, 8], 'items of one sequence keep their order');
    assert.equal(sortQueuedDecodes({}), false);
    const odd = [{ sequenceId: 2 }, { other: 1 }, { sequenceId: 1 }];
    sortQueuedDecodes({ _queuedDecodes: odd });
    assert.deepEqual(odd, [{ sequenceId: 2 }, { other: 1 }, { sequenceId: 1 }], 'left alone when an item has no sequence id');
  });
});

describe('step barrier on the tiny model', () => {
  const dir = mkdtempSync(path.join(os.tmpdir(), 'pdserve-step-barrier-'));
  const sp: SamplingParams = { temperature: 0, topP: 1, topK: 0, maxTokens: 40, stop: [], ignoreEos: true };
  const never = new AbortController().signal;
  let modelPath: string;
  let engine: Engine;

  before(async () => {
    modelPath = await ensureModel('tiny', 1, path.join(dir, 'cache'));
    engine = await loadEngine({ modelPath, sequences: 6, contextSize: 256, batchSize: 64 });
  });
  after(async () => {
    await engine?.dispose();
    rmSync(dir, { recursive: true, force: true });
  });

  /** Prefill `n` slots one after another, then generate on all at once; the step counts of the generation. */
  async function concurrent(e: Engine, n: number, consumerHops: number) {
    const prompts = Array.from({ length: n }, (_, i) => e.tokenize(`stream ${i} says hello to the others`));
    const slots = prompts.map(() => e.tryAcquireSlot()!);
    try {
      const firsts: number[] = [];
      for (let i = 0; i < n; i++) firsts.push((await slots[i]!.prefill(prompts[i]!, sp, never)).firstToken);
      const before = e.stepStats()!;
      const runs = await Promise.all(
        slots.map(async (s, i) => {
          const g = s.generate(firsts[i]!, sp, never);
          const tokens: number[] = [];
          for (;;) {
            const r = await g.next();
            if (r.done) return tokens;
            tokens.push(r.value.token);
            // a consumer with work of its own between tokens (the decode worker's SSE write)
            for (let k = 0; k < consumerHops; k++) await Promise.resolve();
          }
        }),
      );
      // the hooks of the last batch after the first one run once its barrier passed
      await turn();
      await turn();
      const st = e.stepStats()!;
      return { runs, prompts, firsts, steps: st.steps - before.steps, sequences: st.sequences - before.sequences };
    } finally {
      for (const s of slots) s.release();
    }
  }

  it('4 concurrent generations share every llama_decode: one call per step', async () => {
    const n = 4;
    const r = await concurrent(engine, n, 20);
    // generate() evaluates the first token and every later one but the last: maxTokens - 1 steps
    const perSeq = sp.maxTokens - 1;
    assert.equal(r.sequences, n * perSeq, 'every evaluation of every sequence went through a hooked batch');
    assert.equal(r.steps, perSeq, `${r.steps} llama_decode calls for ${perSeq} steps of ${n} sequences (${(r.sequences / r.steps).toFixed(2)} sequences per call)`);
    for (const run of r.runs) assert.equal(run.length, sp.maxTokens);
  });

  it('without the barrier (stepBarrier: false, counting only) the same load takes more llama_decode calls', async () => {
    const counting = await loadEngine({ modelPath, sequences: 6, contextSize: 256, batchSize: 64, stepBarrier: false });
    try {
      const r = await concurrent(counting, 4, 20);
      assert.equal(r.sequences, 4 * (sp.maxTokens - 1));
      // the sequence sampled last misses the dispatcher's look at its queue (node-llama-cpp 3.21.1)
      assert.ok(r.steps > sp.maxTokens, `${r.steps} calls (${(r.sequences / r.steps).toFixed(2)} sequences per call)`);
    } finally {
      await counting.dispose();
    }
  });

  it('deterministic engines decode one sequence per call and count nothing', async () => {
    const det = await loadEngine({ modelPath, sequences: 2, contextSize: 256, batchSize: 64, deterministic: true });
    try {
      assert.equal(det.stepStats(), null);
    } finally {
      await det.dispose();
    }
  });
});
