/**
 * When prefill's first token waits for the state save (`--first-token-after-save`): only when
 * the last save, scaled to this sequence's tokens, predicts a save within the given share of
 * this prompt's evaluation.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { firstTokenAfterSave } from '../../src/prefill/computation.js';

test('no save yet, or the policy off: token 1 leaves before the save', () => {
  assert.equal(firstTokenAfterSave(5, undefined, 1500, 2500), false);
  assert.equal(firstTokenAfterSave(0, { nTokens: 1500, ms: 12 }, 1500, 2500), false);
  assert.equal(firstTokenAfterSave(5, { nTokens: 0, ms: 12 }, 1500, 2500), false);
});

test('a save that is a small share of the evaluation is waited for; a large one is not', () => {
  // CPU: 12 ms to save 1500 tokens against 2.5 s of evaluation (0.5 %)
  assert.equal(firstTokenAfterSave(5, { nTokens: 1500, ms: 12 }, 1500, 2500), true);
  // a prefix-cache hit: 1500 tokens in the sequence, 40 ms of evaluation (30 %)
  assert.equal(firstTokenAfterSave(5, { nTokens: 1500, ms: 12 }, 1500, 40), false);
  // exactly at the share
  assert.equal(firstTokenAfterSave(10, { nTokens: 100, ms: 1 }, 100, 10), true);
  assert.equal(firstTokenAfterSave(10, { nTokens: 100, ms: 1 }, 100, 9.9), false);
});

test('the expectation scales with the sequence length', () => {
  const last = { nTokens: 100, ms: 2 };
  // 1000 tokens: expect 20 ms; 5 % of 500 ms = 25 ms → wait; of 300 ms = 15 ms → no
  assert.equal(firstTokenAfterSave(5, last, 1000, 500), true);
  assert.equal(firstTokenAfterSave(5, last, 1000, 300), false);
});

test("'always' waits even before any save", () => {
  assert.equal(firstTokenAfterSave('always', undefined, 10, 1), true);
});
