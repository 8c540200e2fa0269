/**
 * Smoke test of `pdserve bench` against a running tiny-model stack (router + prefill + decode +
 * colocated on loopback): the command completes and its JSON has every field, through the
 * router (OpenAI API) and with the pd-direct backend; prompt lengths are exact with a GGUF
 * tokenizer and with the target's /tokenize; both backends record the server's
 * prefix-cache hits (bench §5's warm prompts rely on it); `pdserve bench-agents --target` replays
 * a tiny generated agent trace through the router. No timing thresholds.
 */
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { runCli } from '../../src/cli/main.js';
import { sendRequest, type BenchTarget, type PromptSpec } from '../../src/bench/index.js';
import type { Cluster } from '../../src/up/cluster.js';
import { promptOf, startStack, tinyModel } from '../helpers/stack.js';

let c: Cluster;
const dir = mkdtempSync(join(tmpdir(), 'pdserve-bench-test-'));

before(async () => {
  c = await startStack({ colocated: false });
});
after(async () => {
  await c?.stop();
});

const SUMMARY = ['mean', 'median', 'p50', 'p90', 'p99', 'min', 'max', 'n'];
const METRICS = ['completed', 'failed', 'durationS', 'totalInputTokens', 'totalOutputTokens', 'requestThroughput', 'inputThroughput', 'outputThroughput', 'totalTokenThroughput', 'goodRequests', 'goodput', 'peakConcurrency', 'ttftMs', 'tpotMs', 'itlMs', 'e2eMs'];
const CONFIG = ['target', 'numPrompts', 'requestRate', 'maxConcurrency', 'seed', 'slo', 'warmup', 'ignoreEos', 'dataset', 'inputLen', 'outputLen', 'rangeRatio', 'tokenizer'];
const REQUESTS = ['inputLens', 'outputLens', 'ttftsMs', 'e2elsMs', 'itlsMs', 'startsMs', 'errors'];

async function bench(args: string[]): Promise<any> {
  const file = join(dir, `r-${Math.random().toString(36).slice(2)}.json`);
  const before = process.exitCode;
  await runCli(['node', 'pdserve', 'bench', ...args, '--json', file, '--no-progress']);
  const code = process.exitCode;
  process.exitCode = before;
  assert.equal(code, 0, 'pdserve bench exit code');
  return JSON.parse(readFileSync(file, 'utf8'));
}

function checkShape(j: any, n: number, outputLen: number): void {
  assert.equal(j.tool, 'pdserve bench');
  assert.ok(!Number.isNaN(Date.parse(j.date)));
  for (const k of CONFIG) assert.ok(k in j.config, `config.${k}`);
  for (const k of METRICS) assert.ok(k in j.metrics, `metrics.${k}`);
  for (const s of ['ttftMs', 'tpotMs', 'itlMs', 'e2eMs']) for (const k of SUMMARY) assert.equal(typeof j.metrics[s][k], 'number', `metrics.${s}.${k}`);
  for (const k of REQUESTS) {
    assert.ok(Array.isArray(j.requests[k]), `requests.${k}`);
    assert.equal(j.requests[k].length, n, `requests.${k} length`);
  }
  assert.equal(j.metrics.completed, n, `failures: ${JSON.stringify(j.requests.errors)}`);
  assert.equal(j.metrics.failed, 0);
  assert.deepEqual(j.requests.errors, Array(n).fill(null));
  // ignore_eos + usage: every request generated exactly --output-len tokens
  assert.deepEqual(j.requests.outputLens, Array(n).fill(outputLen));
  assert.equal(j.metrics.totalOutputTokens, n * outputLen);
  assert.ok(j.requests.inputLens.every((x: number) => x > 0));
  assert.ok(j.requests.ttftsMs.every((x: number) => x > 0));
  assert.ok(j.requests.itlsMs.every((x: number[]) => Array.isArray(x)));
  assert.equal(j.metrics.ttftMs.n, n);
  assert.equal(j.metrics.tpotMs.n, n);
  assert.ok(j.metrics.durationS > 0);
  assert.ok(j.metrics.outputThroughput > 0);
  assert.ok(j.metrics.peakConcurrency >= 1 && j.metrics.peakConcurrency <= n);
}

describe('pdserve bench', () => {
  test('through the router: corpus prompts of exact length, Poisson arrivals, SLO goodput', async () => {
    const model = await tinyModel();
    const j = await bench(['--url', c.router.url, '--num-prompts', '10', '--request-rate', '20', '--max-concurrency', '4', '--dataset', 'corpus', '--input-len', '40', '--output-len', '8', '--tokenizer', model, '--seed', '1', '--slo-ttft-ms', '60000', '--slo-tpot-ms', '60000']);
    checkShape(j, 10, 8);
    assert.equal(j.config.requestRate, 20);
    assert.equal(j.config.maxConcurrency, 4);
    assert.ok(j.metrics.peakConcurrency <= 4);
    assert.deepEqual(j.config.slo, { ttftMs: 60000, tpotMs: 60000 });
    assert.equal(j.metrics.goodRequests, 10);
    assert.equal(j.config.target.kind, 'openai');
    // with the tokenizer, prompt lengths are exact (the server's usage says so)
    assert.deepEqual(j.requests.inputLens, Array(10).fill(40));
  });

  test('pd-direct backend, all at once, random dataset, no SLO', async () => {
    const p = c.byRole('prefill')[0]!;
    const d = c.byRole('decode')[0]!;
    const j = await bench(['--backend', 'pd-direct', '--prefill', `${p.url},${p.bootstrapPort}`, '--decode', d.url, '--num-prompts', '6', '--request-rate', 'inf', '--input-len', '24', '--output-len', '6']);
    checkShape(j, 6, 6);
    assert.equal(j.config.requestRate, 'inf');
    assert.equal(j.config.slo, null);
    assert.equal(j.metrics.goodput, null);
    assert.equal(j.config.target.kind, 'pd-direct');
    // without --tokenizer the target's own /tokenize makes the lengths exact (the byte-level tiny
    // vocabulary has ≈1.2 characters per token: a 4-characters-per-token estimate sent ≈ 3.4× too many)
    assert.equal(j.config.tokenizer, `${p.url}/tokenize`);
    assert.deepEqual(j.requests.inputLens, Array(6).fill(24));
  });

  test('both backends record cached_tokens: a prompt sent again is served from the prefill worker\'s prefix cache', async () => {
    const p = c.byRole('prefill')[0]!;
    const d = c.byRole('decode')[0]!;
    const direct: BenchTarget = { kind: 'pd-direct', prefillUrl: p.url, bootstrapHost: '127.0.0.1', bootstrapPort: p.bootstrapPort!, decodeUrl: d.url };
    const router: BenchTarget = { kind: 'openai', url: c.router.url, endpoint: 'completions', model: 'pdserve' };
    // ≈ 300 tokens (byte-level vocab): the stack is deterministic, so reuse comes in whole 128-token chunks
    const prompt: PromptSpec = { text: promptOf(300, 11), promptTokens: 300, outputLen: 4 };
    const o = { t0: performance.now(), timeoutMs: 30_000 };
    const cold = await sendRequest(direct, { ...prompt, outputLen: 1 }, o);
    const viaDirect = await sendRequest(direct, prompt, o);
    const viaRouter = await sendRequest(router, prompt, o);
    for (const r of [cold, viaDirect, viaRouter]) assert.ok(r.ok, r.error);
    assert.equal(cold.cachedTokens, 0);
    for (const r of [viaDirect, viaRouter]) {
      assert.ok(r.cachedTokens! >= 128 && r.cachedTokens! < r.promptTokens, `cached ${r.cachedTokens} of ${r.promptTokens}`);
      assert.equal(r.outputTokens, 4);
    }
  });

  test('bench-agents --target: a tiny agent trace replayed through the router, every turn served, later turns cached', async () => {
    const model = await tinyModel();
    const file = join(dir, 'agents.json');
    const trace = join(dir, 'trace.jsonl');
    const before = process.exitCode;
    await runCli(['node', 'pdserve', 'bench-agents', '--target', `pd=${c.router.url}`, '--tokenizer', model, '--sessions', '2', '--turns', '3', '--turns-sigma', '0', '--subagents', '1', '--growth', '40', '--system-tokens', '100', '--tool-tokens', '50', '--task-tokens', '40', '--think-ms', '20', '--ramp-ms', '50', '--timeout-ms', '30000', '--deadline-s', '60', '--write-trace', trace, '--json', file]);
    const code = process.exitCode;
    process.exitCode = before;
    const j = JSON.parse(readFileSync(file, 'utf8'));
    assert.equal(j.runs.length, 1);
    const r = j.runs[0];
    assert.equal(code, 0, JSON.stringify(r.errors));
    assert.equal(r.name, 'pd');
    // every request of the written trace was sent and served with its output length
    const lines = readFileSync(trace, 'utf8').trim().split('\n').map((l) => JSON.parse(l));
    assert.equal(r.requests, lines.length);
    assert.equal(r.failed, 0);
    assert.equal(r.sessionsOk, 2);
    assert.ok(lines.some((l) => String(l.session_id).includes('.')), 'sub-agents ran');
    assert.deepEqual(r.records.map((x: any) => x.outputTokens).sort(), lines.map((l) => l.output_length).sort());
    // the conversation grows turn by turn, and the router reports what the prefill cache reused
    for (const x of r.records) if (x.turn > 1) assert.ok(x.promptTokens > r.records.find((y: any) => y.session === x.session && y.turn === x.turn - 1).promptTokens);
    assert.ok(r.cached2 > 0 && r.bound2 > 0.5, `cached ${r.cached2}, bound ${r.bound2}`);
    assert.equal(r.byTurn.length, 3);
    assert.equal(typeof r.bounces, 'number');
  });
});
