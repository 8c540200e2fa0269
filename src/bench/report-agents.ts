/**
 * BENCHMARKS.md §7's agents at scale (bench/results/s7-agents-scale.json,
 * `PDSERVE_BENCH_AGENTS_SCALE=1 npm run bench -- --sections 7`): N agents × R growing rounds at
 * once on 1 prefill + 2 decode workers with the host prefix store, without it, and colocated
 * (`runAgentsScale` in ./agents.ts), and the many-agents goals read from it.
 */
import { agentsScaleTable, type ScaleRun } from './agents.js';
import { fmt, fmtRatio } from './util.js';

/** What the suite saves for the scale run. */
export interface AgentsScaleResult {
  /** The generated model's name (tiny / small) or a file. */
  model: string;
  rounds: number;
  decode: number;
  cfg: { systemTokens: number; toolTokens: number; outputTokens: number };
  slo: { ttftMs: number; tpotMs: number };
  runs: ScaleRun[];
}

/** Goal bounds (the numbers). */
export const SCALE_GOALS = { cachedShare: 0.8, ttftRatio: 1.5, fallbackShare: 0.02, goodputVsColo: 1.5 };

/** The many-agents goals, one row each, from the PD + store setup (goodput against colocated at each concurrency). */
export function agentsScaleGoals(r: AgentsScaleResult): { goal: string; detail: string; met: boolean }[] {
  const levels = [...new Set(r.runs.map((x) => x.concurrency))].sort((a, b) => a - b);
  const at = (s: ScaleRun['scale'], c: number) => r.runs.find((x) => x.scale === s && x.concurrency === c);
  const pd = levels.map((c) => ({ c, run: at('pd_store', c), colo: at('colo', c) })).filter((x) => x.run);
  const each = (f: (x: (typeof pd)[number]) => string) => pd.map((x) => `${x.c} agents ${f(x)}`).join(', ');
  const share = (x: ScaleRun) => (x.rounds.length ? x.fallbacks / x.rounds.length : 0);
  const tag = `at scale, PD + store`;
  return [
    { goal: `cached share over rounds 2+ ≥ ${SCALE_GOALS.cachedShare * 100} % (${tag})`, detail: each((x) => `${fmt(x.run!.cachedShare * 100, 0)} %`), met: pd.length > 0 && pd.every((x) => x.run!.cachedShare >= SCALE_GOALS.cachedShare) },
    { goal: `round-${r.rounds} / round-1 TTFT ≤ ${SCALE_GOALS.ttftRatio} (${tag})`, detail: each((x) => fmtRatio(x.run!.ttftRatio)), met: pd.length > 0 && pd.every((x) => x.run!.ttftRatio <= SCALE_GOALS.ttftRatio) },
    { goal: `decode-local fallbacks ≤ ${SCALE_GOALS.fallbackShare * 100} % of requests (${tag})`, detail: each((x) => `${x.run!.fallbacks} of ${x.run!.rounds.length}`), met: pd.length > 0 && pd.every((x) => share(x.run!) <= SCALE_GOALS.fallbackShare) },
    { goal: `PD agent goodput ≥ ${SCALE_GOALS.goodputVsColo} × colocated (${tag})`, detail: each((x) => `${fmt(x.run!.goodput, 2)} vs ${fmt(x.colo?.goodput, 2)}`) + ' rounds/s', met: pd.length > 0 && pd.every((x) => x.colo !== undefined && x.run!.goodput >= SCALE_GOALS.goodputVsColo * x.colo.goodput) },
  ];
}

/** The subsection's placeholder `{{s7_scale}}`: provenance and the tables (the goals are the summary's rows, `agentsScaleGoals`; the prose is in report.md); `cores`: the measuring machine's. */
export function agentsScaleReport(r: AgentsScaleResult | undefined, prov: string, cores: number): string[] {
  if (!r?.runs?.length) return ['_Not run yet._'];
  const dropped = r.runs.reduce((a, x) => a + x.store.dropped, 0);
  const failed = r.runs.reduce((a, x) => a + x.failed, 0);
  return [prov, '', `Model: **${r.model}**; ${r.rounds} rounds; 1 prefill (1 slot) + ${r.decode} decode workers; store writes dropped: ${dropped}${failed ? '' : '; no request failed'}; cores used: the setup's CPU seconds over wall seconds (of ${cores}).`, '', ...agentsScaleTable(r.runs, r.rounds), ''];
}
