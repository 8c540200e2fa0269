/**
 * Statistics of `pdserve bench` on hand-computed inputs: percentiles (linear interpolation),
 * summaries, TPOT, SLO checks, goodput, peak concurrency, the aggregate metrics, the steady-state
 * decode rate of section 4, section 5's prompt pairing, router − direct figures and cache-hit
 * count, and the seeded prompt generator.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { computeMetrics, goodput, meetsSlo, peakConcurrency, tpotMs, type RequestRecord } from '../../src/bench/metrics.js';
import { buildPrompts, exactText, Rng, type BenchTokenizer } from '../../src/bench/index.js';
import { DecodeConfigSchema, parseConfig, prefixCacheOf } from '../../src/config/config.js';
import { decodeContextSequences, ownPromptPair, promptCacheHits, routerOverhead, windowRate } from '../../src/bench/sections.js';
import { percentile, summarize } from '../../src/observe/stats.js';

const close = (a: number, b: number, eps = 1e-9) => assert.ok(Math.abs(a - b) <= eps, `${a} ≉ ${b}`);

function rec(over: Partial<RequestRecord>): RequestRecord {
  return { ok: true, promptTokens: 10, outputTokens: 5, usageReported: true, startMs: 0, ttftMs: 100, e2eMs: 500, itlMs: [], chunkAtMs: [], ...over };
}

describe('percentile', () => {
  const s = [10, 20, 30, 40, 50];
  test('interpolates linearly between closest ranks (rank = p/100 · (n − 1))', () => {
    assert.equal(percentile(s, 0), 10);
    assert.equal(percentile(s, 25), 20); // rank 1
    assert.equal(percentile(s, 50), 30); // rank 2
    close(percentile(s, 90), 46); // rank 3.6 → 40 + 0.6 · 10
    close(percentile(s, 99), 49.6); // rank 3.96 → 40 + 0.96 · 10
    assert.equal(percentile(s, 100), 50);
    close(percentile([1, 2, 3, 4], 50), 2.5);
    close(percentile([1, 2], 75), 1.75);
  });
  test('one value, no value', () => {
    assert.equal(percentile([7], 99), 7);
    assert.ok(Number.isNaN(percentile([], 50)));
  });
});

describe('summarize', () => {
  test('unsorted input, hand-computed fields', () => {
    const r = summarize([5, 1, 3]);
    assert.equal(r.n, 3);
    assert.equal(r.mean, 3);
    assert.equal(r.median, 3);
    assert.equal(r.p50, 3);
    close(r.p90, 4.6); // sorted [1,3,5], rank 1.8 → 3 + 0.8 · 2
    close(r.p99, 4.96); // rank 1.98
    assert.equal(r.min, 1);
    assert.equal(r.max, 5);
  });
  test('empty sample: NaN everywhere, n = 0', () => {
    const r = summarize([]);
    assert.equal(r.n, 0);
    for (const k of ['mean', 'median', 'p50', 'p90', 'p99', 'min', 'max'] as const) assert.ok(Number.isNaN(r[k]), k);
  });
});

describe('TPOT', () => {
  test('(E2E − TTFT) / (output tokens − 1)', () => {
    assert.equal(tpotMs(rec({ ttftMs: 100, e2eMs: 1000, outputTokens: 10 })), 100);
    assert.equal(tpotMs(rec({ ttftMs: 250, e2eMs: 400, outputTokens: 4 })), 50);
  });
  test('undefined for one output token and for failed requests', () => {
    assert.equal(tpotMs(rec({ outputTokens: 1 })), undefined);
    assert.equal(tpotMs(rec({ ok: false })), undefined);
  });
});

describe('SLO and goodput', () => {
  const rs = [
    rec({ ttftMs: 100, e2eMs: 500, outputTokens: 5 }), // TPOT 100 → fails TPOT ≤ 50
    rec({ ttftMs: 100, e2eMs: 300, outputTokens: 5 }), // TPOT 50 → good
    rec({ ttftMs: 300, e2eMs: 400, outputTokens: 5 }), // TTFT 300 → fails TTFT ≤ 200
    rec({ ttftMs: 150, e2eMs: 150, outputTokens: 1 }), // 1 token: TPOT counts as 0 → good
    rec({ ok: false, ttftMs: 10, e2eMs: 20 }), // failed → never good
  ];
  const slo = { ttftMs: 200, tpotMs: 50 };
  test('meetsSlo per request', () => {
    assert.deepEqual(
      rs.map((r) => meetsSlo(r, slo)),
      [false, true, false, true, false],
    );
    assert.equal(meetsSlo(rs[0]!, { e2eMs: 500 }), true);
    assert.equal(meetsSlo(rs[0]!, { e2eMs: 499 }), false);
  });
  test('goodput = good requests / duration; null without an SLO', () => {
    assert.deepEqual(goodput(rs, slo, 4), { good: 2, rps: 0.5 });
    assert.equal(goodput(rs, {}, 4), null);
    assert.equal(goodput(rs, undefined, 4), null);
  });
});

describe('peakConcurrency', () => {
  test('overlapping intervals; an end and a start at the same instant do not overlap', () => {
    assert.equal(peakConcurrency([{ startMs: 0, e2eMs: 10 }, { startMs: 5, e2eMs: 10 }, { startMs: 10, e2eMs: 10 }]), 2);
    assert.equal(peakConcurrency([{ startMs: 0, e2eMs: 100 }, { startMs: 1, e2eMs: 1 }, { startMs: 2, e2eMs: 1 }, { startMs: 2.5, e2eMs: 5 }]), 3);
    assert.equal(peakConcurrency([]), 0);
  });
});

describe('computeMetrics', () => {
  test('hand-computed run of two successes and one failure over 2 s', () => {
    const rs = [
      rec({ promptTokens: 10, outputTokens: 3, startMs: 0, ttftMs: 100, e2eMs: 300, itlMs: [100, 100] }), // TPOT 100
      rec({ promptTokens: 30, outputTokens: 5, startMs: 500, ttftMs: 200, e2eMs: 600, itlMs: [50, 150, 100, 100] }), // TPOT 100
      rec({ ok: false, promptTokens: 99, outputTokens: 0, startMs: 600, ttftMs: NaN, e2eMs: 50, error: 'x' }),
    ];
    const m = computeMetrics(rs, 2000, { ttftMs: 150 });
    assert.equal(m.completed, 2);
    assert.equal(m.failed, 1);
    assert.equal(m.durationS, 2);
    assert.equal(m.totalInputTokens, 40);
    assert.equal(m.totalOutputTokens, 8);
    assert.equal(m.requestThroughput, 1);
    assert.equal(m.inputThroughput, 20);
    assert.equal(m.outputThroughput, 4);
    assert.equal(m.totalTokenThroughput, 24);
    assert.equal(m.goodRequests, 1);
    assert.equal(m.goodput, 0.5);
    assert.equal(m.peakConcurrency, 2);
    assert.equal(m.ttftMs.mean, 150);
    assert.equal(m.ttftMs.n, 2);
    assert.equal(m.tpotMs.median, 100);
    assert.equal(m.itlMs.n, 6);
    close(m.itlMs.mean, 600 / 6);
    assert.equal(m.itlMs.max, 150);
    assert.equal(m.e2eMs.median, 450);
    assert.equal(computeMetrics(rs, 2000).goodput, null);
  });
});

describe('windowRate (section 4)', () => {
  test('tokens while all streams are live / window', () => {
    const r = windowRate([
      [0, 10, 20, 30],
      [5, 15, 25, 35],
    ]);
    // window (5, 30]: stream 0 → 10, 20, 30; stream 1 → 15, 25: 5 tokens in 25 ms
    assert.equal(r.allLive, true);
    assert.equal(r.tokens, 5);
    assert.equal(r.ms, 25);
    close(r.tokPerS, 200);
  });
  test('chunk → token scale, single stream = 1 / TPOT', () => {
    close(windowRate([[0, 10, 20]], [2]).tokPerS, 200);
    close(windowRate([[100, 105, 110, 115, 120]]).tokPerS, 200);
  });
  test('streams that never all overlap fall back to the whole span', () => {
    const r = windowRate([
      [0, 10],
      [20, 30],
    ]);
    assert.equal(r.allLive, false);
    assert.equal(r.tokens, 2);
    assert.equal(r.ms, 30);
  });
});

describe('prompts', () => {
  test('Rng is deterministic per seed and uniform ints stay in range', () => {
    const a = new Rng(7);
    const b = new Rng(7);
    const xs = Array.from({ length: 100 }, () => a.int(3, 9));
    assert.deepEqual(xs, Array.from({ length: 100 }, () => b.int(3, 9)));
    assert.ok(xs.every((x) => x >= 3 && x <= 9));
  });
  test('same options → same prompts; lengths follow the range ratio', () => {
    const o = { dataset: 'random' as const, numPrompts: 20, inputLen: 50, outputLen: 10, rangeRatio: 0.5, seed: 3 };
    const p1 = buildPrompts(o);
    assert.deepEqual(p1, buildPrompts(o));
    assert.ok(p1.every((p) => p.outputLen >= 5 && p.outputLen <= 15));
    assert.notDeepEqual(p1, buildPrompts({ ...o, seed: 4 }));
    const c = buildPrompts({ ...o, dataset: 'corpus', rangeRatio: 0 });
    assert.ok(c.every((p) => p.text.length >= 200 && p.outputLen === 10));
  });
  test('exactText reaches the target count (BOS included) with a character tokenizer', () => {
    const tok: BenchTokenizer = { encode: (t) => [...t].map((ch) => ch.codePointAt(0)!), decode: (ids) => String.fromCodePoint(...ids), bos: 1, dispose: async () => {} };
    const ids = tok.encode('hello world, this is a corpus');
    const e = exactText(tok, ids, 6, 10);
    assert.equal(e.tokens, 10);
    assert.equal(e.text, 'world, th');
  });
});

describe('section 4 baseline', () => {
  test('the direct engine has as many sequences (KV streams) as the decode worker creates with default flags', () => {
    const config = parseConfig(DecodeConfigSchema, { secret: 'bench-secret', slots: 10, engine: { modelPath: 'model.gguf' } });
    // startDecodeWorker's context: slots + the prefix cache's sequences when decode-local continuation is on
    const cache = config.localPrefillMaxTokens > 0 ? prefixCacheOf(config.engine) : undefined;
    assert.equal(decodeContextSequences(config.slots), config.slots + (cache?.cacheSequences ?? 0));
    assert.ok(decodeContextSequences(10) > 10, 'decode keeps a prefix cache by default, so the baseline has more sequences than slots');
  });
});

describe('section 5 prompts (ownPromptPair)', () => {
  test('every request of the section gets a prompt no other request had, and the sides swap every round', () => {
    const prompts = Array.from({ length: 8 }, (_, i) => `p${i}`);
    const pairs = [0, 1, 2, 3].map((r) => ownPromptPair(prompts, r));
    assert.deepEqual(pairs, [['p0', 'p1'], ['p3', 'p2'], ['p4', 'p5'], ['p7', 'p6']]);
    assert.equal(new Set(pairs.flat()).size, 8);
  });
  test('a list too short for the round is an error, not a reused prompt', () => {
    assert.throws(() => ownPromptPair(['a', 'b', 'c'], 1), RangeError);
  });
});

describe('section 5 figures (routerOverhead, promptCacheHits)', () => {
  test('router − direct of p50/p99 TTFT and E2E and p50 ITL; ratios of the p50s; failures listed, not measured', () => {
    // TTFT router 11..15 (p50 13, p99 14.96), direct 10..14 (p50 12, p99 13.96); E2E +5 each
    const router = [11, 12, 13, 14, 15].map((t) => rec({ ttftMs: t, e2eMs: t + 105, itlMs: [3, 3] }));
    const direct = [14, 10, 12, 13, 11].map((t) => rec({ ttftMs: t, e2eMs: t + 100, itlMs: [2, 2] }));
    direct.push(rec({ ok: false, error: 'boom', ttftMs: 9999, e2eMs: 9999 }));
    const o = routerOverhead(router, direct);
    assert.equal(o.reps, 6);
    close(o.addedMs.ttftP50, 1);
    close(o.addedMs.ttftP99, 1);
    close(o.addedMs.e2eP50, 6);
    close(o.addedMs.e2eP99, 6);
    close(o.addedMs.itlP50, 1);
    close(o.ratio.ttftP50, 13 / 12);
    close(o.ratio.e2eP50, 118 / 112);
    assert.deepEqual(o.errors, ['boom']);
  });
  test('a hit is a successful request with cached tokens ≥ 90 % of its prompt; no figure or a failure is a miss', () => {
    const rs = [
      rec({ promptTokens: 64, cachedTokens: 63 }), // full hit (last token evaluated again)
      rec({ promptTokens: 64, cachedTokens: 58 }), // 90.6 %
      rec({ promptTokens: 64, cachedTokens: 57 }), // 89 %
      rec({ promptTokens: 64, cachedTokens: 0 }),
      rec({ promptTokens: 64 }), // not reported
      rec({ ok: false, promptTokens: 64, cachedTokens: 63 }),
      rec({ promptTokens: 0, cachedTokens: 0 }),
    ];
    assert.equal(promptCacheHits(rs), 2);
    assert.equal(promptCacheHits(rs, 0.5), 3);
  });
});
