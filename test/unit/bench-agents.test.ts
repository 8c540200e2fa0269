/**
 * Bench §7 report logic (src/bench/agents.ts): goals met/missed from the figures, the
 * table and plot render. Pure functions on a hand-made result; the section itself needs a
 * cluster and runs in `pdserve bench-suite --sections 7`.
 * Run: node --import tsx --test test/unit/bench-agents.test.ts
 */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { agentGoals, agentsPlot, agentsReport, type AgentRun, type AgentsResult, type AgentSetup, type ScaleRun } from '../../src/bench/agents.js';
import { agentsScaleGoals, agentsScaleReport, type AgentsScaleResult } from '../../src/bench/report-agents.js';
import { machineBusySeconds, processCpuSeconds } from '../../src/bench/cpu.js';

const run = (setup: AgentSetup, concurrency: number, ttftByRound: number[], cachedShare: number, goodput: number): AgentRun => ({
  setup,
  concurrency,
  wallMs: 1000,
  rounds: [],
  ttftByRound,
  cachedShare,
  goodput,
  throughput: goodput + 0.1,
  failed: 0,
  load: 1,
  paths: { pd: setup === 'pd_local' ? 1 : 3, decode_local: setup === 'pd_local' ? 2 : 0 },
});

const result = (pdR8: number, share: number, pdGoodput: number): AgentsResult => ({
  rounds: 3,
  toolTokens: 150,
  outputTokens: 24,
  systemTokens: 120,
  concurrencies: [1],
  slo: { ttftMs: 1500, tpotMs: 100 },
  runs: [run('pd', 1, [100, 110, pdR8], share, pdGoodput), run('colo', 1, [90, 95, 100], 0.8, 1), run('pd_noreuse', 1, [100, 300, 600], 0, 0.2)],
});

describe('bench §7 goals', () => {
  it('are met or missed from the figures', () => {
    assert.deepEqual(agentGoals(result(150, 0.6, 1)).map((g) => g.met), [true, true, true]);
    assert.deepEqual(agentGoals(result(151, 0.59, 0.99)).map((g) => g.met), [false, false, false]);
    assert.match(agentGoals(result(151, 0.59, 0.99))[0]!.detail, /1 agent 1\.51×/);
  });

  it('with decode-local runs, the goals are judged on PD + decode-local and the rounds by path are shown', () => {
    const r = result(150, 0.6, 1);
    r.runs.push(run('pd_local', 1, [100, 110, 200], 0.9, 0.5));
    const g = agentGoals(r);
    assert.deepEqual(g.map((x) => x.met), [false, true, false]);
    assert.match(g[2]!.goal, /PD \+ decode-local/);
    assert.match(g[2]!.detail, /0\.50 vs 1\.00 rounds\/s \(PD \+ prefix cache alone: 1\.00\)/);
    const md = agentsReport(r, '_prov_', undefined).join('\n');
    assert.match(md, /^\| PD \+ decode-local \| 2\.00× \| 90 % \| 0\.50 \| 2 \|$/m, 'rounds on decode alone: 2 of 3');
    assert.match(md, /^\| PD \+ prefix cache \| 1\.50× \| 60 % \| 1\.00 \| 0 \|$/m);
  });

  it('render a table with every run, the reading and the plot (the goals are the summary\'s rows)', () => {
    const md = agentsReport(result(150, 0.6, 1), '_prov_', 'bench/plots/x.svg').join('\n');
    assert.match(md, /^_prov_\n/);
    assert.equal((md.match(/^\| (PD|colocated)/gm) ?? []).length, 3);
    assert.match(md, /^\| PD, no reuse \| 6\.00× \| 0 % \| 0\.20 \| 0 \|$/m);
    assert.match(md, /Each cell: 1 agent \(3 rounds\); no request failed\./);
    assert.match(md, /!\[TTFT per round\]\(bench\/plots\/x\.svg\)/);
    assert.match(agentsReport(undefined, '', undefined).join('\n'), /Not run yet/);
    const svg = agentsPlot(result(150, 0.6, 1));
    assert.match(svg, /^<svg/);
    assert.equal((svg.match(/<polyline/g) ?? []).length, 3);
  });
});

describe('bench §7 agents at scale', () => {
  const scaleRun = (scale: 'pd_store' | 'pd_nostore' | 'colo', concurrency: number, o: { cached: number; ratio: number; fallbacks: number; goodput: number }): ScaleRun => ({
    ...run(scale === 'colo' ? 'colo' : 'pd_local', concurrency, [1000, 1000 * o.ratio], o.cached, o.goodput),
    rounds: Array.from({ length: 100 }, (_, i) => ({ agent: i, round: 1, ok: true, ttftMs: 1, e2eMs: 2, tpotMs: 1, promptTokens: 10, cachedTokens: 5, outputTokens: 2, path: 'pd' })),
    scale,
    fallbacks: o.fallbacks,
    ttftRatio: o.ratio,
    store: { hits: 1, misses: 2, writes: 3, dropped: 0 },
  });
  const scaleResult = (pd: { cached: number; ratio: number; fallbacks: number; goodput: number }): AgentsScaleResult => ({
    model: 'tiny',
    rounds: 2,
    decode: 2,
    cfg: { systemTokens: 120, toolTokens: 150, outputTokens: 24 },
    slo: { ttftMs: 1500, tpotMs: 100 },
    runs: [8, 30].flatMap((c) => [scaleRun('pd_store', c, pd), scaleRun('pd_nostore', c, { ...pd, cached: 0 }), scaleRun('colo', c, { cached: 0.8, ratio: 1, fallbacks: 0, goodput: 1 })]),
  });
  it('meets each goal on its bound and misses it past the bound', () => {
    assert.deepEqual(agentsScaleGoals(scaleResult({ cached: 0.8, ratio: 1.5, fallbacks: 2, goodput: 1.5 })).map((g) => g.met), [true, true, true, true]);
    assert.deepEqual(agentsScaleGoals(scaleResult({ cached: 0.79, ratio: 1.51, fallbacks: 3, goodput: 1.49 })).map((g) => g.met), [false, false, false, false]);
    const missed = agentsScaleGoals(scaleResult({ cached: 0.81, ratio: 0.9, fallbacks: 3, goodput: 0.5 }));
    assert.deepEqual(missed.map((g) => g.met), [true, true, false, false]);
    assert.match(`${missed[2]!.goal}: ${missed[2]!.detail}`, /decode-local fallbacks ≤ 2 % of requests .*: 8 agents 3 of 100, 30 agents 3 of 100$/);
    assert.match(`${missed[3]!.goal}: ${missed[3]!.detail}`, /PD agent goodput ≥ 1\.5 × colocated .*0\.50 vs 1\.00 rounds\/s/);
    const lines = agentsScaleReport(scaleResult({ cached: 0.81, ratio: 0.9, fallbacks: 3, goodput: 0.5 }), 'prov', 2).join('\n');
    assert.equal((lines.match(/^\| /gm) ?? []).length, 1 + 6, 'the table: head and one row per run');
    assert.deepEqual(agentsScaleReport(undefined, 'prov', 2), ['_Not run yet._']);
  });
  it('the table\'s CPU columns: the setup\'s own CPU per completed round and the cores it used', () => {
    const r = scaleResult({ cached: 0.81, ratio: 0.9, fallbacks: 0, goodput: 2 });
    r.runs = r.runs.map((x) => ({ ...x, wallMs: 4000, cpu: x.scale === 'colo' ? { router: 0, prefill: 0, decode: 0, colocated: 3, bench: 0.5, machine: 8 } : { router: 1, prefill: 0.5, decode: 4.5, colocated: 0, bench: 0.5, machine: 7.9 } }));
    const lines = agentsScaleReport(r, 'prov', 2);
    // 100 completed rounds: PD + store 6.0 CPU s → 60 ms a round, 1.50 cores over 4 s; colocated 3.0 s → 30 ms, 0.75 cores
    assert.ok(lines.some((l) => l.startsWith('| PD + store | 8 |') && l.endsWith('| 60 | 1.50 |')), lines.join('\n'));
    assert.ok(lines.some((l) => l.startsWith('| colocated + store | 30 |') && l.endsWith('| 30 | 0.75 |')));
    assert.ok(lines.some((l) => l.includes('| CPU ms/round | cores used |')));
  });
  it('CPU seconds from /proc: this process counts up, an unknown one is NaN', () => {
    const before = processCpuSeconds(process.pid);
    const end = performance.now() + 60;
    let x = 0;
    while (performance.now() < end) x += Math.sqrt(x + 1);
    assert.ok(x > 0 && processCpuSeconds(process.pid) > before, 'busy 60 ms: more CPU seconds');
    assert.ok(Number.isNaN(processCpuSeconds(undefined)) && Number.isNaN(processCpuSeconds(2 ** 30)));
    assert.ok(machineBusySeconds() > 0);
  });
});
