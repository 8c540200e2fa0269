/**
 * BENCHMARKS.md §7's agent trace replay (bench/results/s7-agent-trace.json, written by
 * `pdserve bench-agents --save`): the trace's scale, one row per replay, TTFT and cached share
 * by turn, the goals met or missed, and the TTFT-by-turn plot.
 */
import type { ReplayRun } from './agent-replay.js';
import { lineChart } from './svg.js';
import { fmt, fmtRatio } from './util.js';

/** What `bench-agents --save` stores. */
export interface AgentTraceResult {
  /** The trace's description (generated with its options, or the file). */
  source: string;
  /** The served model (tiny / small / a file) and the stacks' shape. */
  model: string;
  decode: number;
  command: string;
  /** Trace scale: sessions (sub-agents included), requests, turns per top-level session (median, max), prompt tokens (median, max), Σ input / Σ output. */
  scale: { sessions: number; topSessions: number; requests: number; turnsMedian: number; turnsMax: number; promptMedian: number; promptMax: number; ioRatio: number };
  /** 1/5/15-min load averages at the start and at the end, and the machine's cores. */
  load: { start: number[]; end: number[]; cores: number };
  timeScale: number;
  runs: ReplayRun[];
}

/** Goal bounds. */
export const TRACE_GOALS = { completionSpeedup: 3, cachedVsBound: 0.9, lastVsTurn2: 1.5, bounceShare: 0.005 };

/** The agent-trace goals, one row each, judged on every PD run (reuse off: the completion baseline). */
export function agentTraceGoals(r: AgentTraceResult): { goal: string; detail: string; met: boolean }[] {
  const pd = r.runs.filter((x) => x.setup === 'pd');
  const off = r.runs.filter((x) => x.setup === 'pd_noreuse');
  const offMedian = off.length ? off.reduce((a, x) => a + x.completion.p50, 0) / off.length : NaN;
  const each = <T>(f: (x: ReplayRun) => T) => pd.map(f);
  const t2 = (x: ReplayRun) => x.byTurn.find((t) => t.turn === 2)?.ttftP90 ?? NaN;
  const speed = each((x) => offMedian / x.completion.p50);
  const ratio = each((x) => (x.cached2 === null || x.bound2 === 0 ? NaN : x.cached2 / x.bound2));
  const last = each((x) => x.lastTurn.ttftP90 / t2(x));
  const bounce = each((x) => (x.bounces === null ? NaN : x.bounces / Math.max(1, x.requests)));
  const all = (xs: number[], ok: (v: number) => boolean) => xs.length > 0 && xs.every((v) => Number.isFinite(v) && ok(v));
  // the scale the figures are from, beside them
  const at = `${r.scale.topSessions}×${r.scale.turnsMedian} turns to ${fmt(r.scale.promptMax / 1000, 1)}K tokens, ${r.model}: `;
  const rows = [
    { goal: `trace: median session completion ≥ ${TRACE_GOALS.completionSpeedup}× faster with reuse than without`, detail: pd.map((x, i) => `${fmt(x.completion.p50 / 1000, 2)} s vs ${fmt(offMedian / 1000, 2)} s: ${fmtRatio(speed[i])}`).join(', ') || 'no PD run', met: all(speed, (v) => v >= TRACE_GOALS.completionSpeedup) },
    { goal: `trace: PD cached share over turns 2+ ≥ ${TRACE_GOALS.cachedVsBound} × upper bound`, detail: pd.map((x, i) => `${x.cached2 === null ? 'n/a' : fmt(x.cached2 * 100, 1) + ' %'} of ${fmt(x.bound2 * 100, 1)} %: ${fmt(ratio[i], 2)}`).join(', ') || 'no PD run', met: all(ratio, (v) => v >= TRACE_GOALS.cachedVsBound) },
    { goal: `trace: PD TTFT p90 at the last turn ≤ ${TRACE_GOALS.lastVsTurn2}× turn 2`, detail: pd.map((x, i) => `${fmt(x.lastTurn.ttftP90, 0)} vs ${fmt(t2(x), 0)} ms: ${fmtRatio(last[i])}`).join(', ') || 'no PD run', met: all(last, (v) => v <= TRACE_GOALS.lastVsTurn2) },
    { goal: `trace: PD needs_prefill bounces ≤ ${TRACE_GOALS.bounceShare * 100} % of requests`, detail: pd.map((x, i) => `${x.bounces ?? 'n/a'} of ${x.requests} (${fmt(bounce[i]! * 100, 2)} %)`).join(', ') || 'no PD run', met: all(bounce, (v) => v <= TRACE_GOALS.bounceShare) },
  ];
  return rows.map((g) => ({ ...g, detail: at + g.detail }));
}

/** A command line with each `--flag value` written `--flag=value` (the same to the CLI; a count after a bare flag name reads as prose otherwise). */
export function flagsJoined(cmd: string): string {
  return cmd.replace(/(--[a-z][\w-]*) (?=[^-\s])/g, '$1=');
}

const pct = (x: number | null) => (x === null || !Number.isFinite(x) ? 'n/a' : `${fmt(x * 100, 1)} %`);

function evictionText(e: Record<string, number> | null): string {
  if (!e) return '—';
  const parts = Object.entries(e).filter(([, v]) => v !== 0);
  return parts.length ? parts.map(([k, v]) => `${k} ${v}`).join(', ') : '0';
}

/** The TTFT-by-turn plot: p90 per turn position, one line per replay. Returns the SVG text. */
export function agentTracePlot(r: AgentTraceResult): string {
  const many = r.runs.some((x) => x.repeat > 1);
  return lineChart({
    title: `Agent trace replay: TTFT p90 by turn (${r.scale.topSessions} sessions, ${r.model} model)`,
    xLabel: 'turn',
    yLabel: 'TTFT p90 ms (log)',
    logY: true,
    xMin: 1,
    series: r.runs.map((x) => ({ name: many ? `${x.name} #${x.repeat}` : x.name, points: x.byTurn.map((t) => [t.turn, t.ttftP90] as [number, number]) })),
  });
}

/** Markdown lines of the subsection's placeholder: provenance, the trace's scale, one row per replay, the TTFT-by-turn plot. */
export function agentTraceReport(r: AgentTraceResult | undefined, prov: string, plot: string | undefined): string[] {
  if (!r?.runs?.length) return ['_Not run yet._'];
  const s = r.scale;
  const L = [
    prov,
    '',
    `\`${flagsJoined(r.command)}\`, ${r.model} model, trace ${r.source}: ${s.topSessions} sessions + ${s.sessions - s.topSessions} sub-agents, ${s.requests} requests, turns median ${s.turnsMedian} (max ${s.turnsMax}), prompts median ${s.promptMedian} tokens (max ${s.promptMax}), input : output ${fmt(s.ioRatio, 0)} : 1${r.timeScale === 1 ? '' : `, pauses × ${r.timeScale}`}. Measured under load ${r.load.start[0]} → ${r.load.end[0]} (1 min, ${r.load.cores} cores).`,
    '',
  ];
  // evictions get a column only when some replay saw one
  const anyEvicted = r.runs.some((x) => Object.values(x.evictions ?? {}).some((v) => v !== 0));
  const head = ['setup', 'sessions ok', 'requests failed', 'session completion p50 / p90 s', 'TTFT p50 / p90 turn 2 ms', 'TTFT p50 / p90 last turn ms', 'cached (turns 2+)', 'cached / upper bound', 'needs_prefill', 'pd / decode-local', ...(anyEvicted ? ['evictions'] : [])];
  const row = (x: ReplayRun) => {
    const t2 = x.byTurn.find((t) => t.turn === 2);
    return [
      x.repeat > 1 || r.runs.some((y) => y.repeat > 1) ? `${x.name} #${x.repeat}` : x.name,
      `${x.sessionsOk} / ${x.sessions}`,
      `${x.failed} / ${x.requests}`,
      `${fmt(x.completion.p50 / 1000, 2)} / ${fmt(x.completion.p90 / 1000, 2)}`,
      `${fmt(t2?.ttftP50, 0)} / ${fmt(t2?.ttftP90, 0)}`,
      `${fmt(x.lastTurn.ttftP50, 0)} / ${fmt(x.lastTurn.ttftP90, 0)}`,
      pct(x.cached2),
      x.cached2 === null || x.bound2 === 0 ? 'n/a' : `${fmt(x.cached2 / x.bound2, 2)} of ${pct(x.bound2)}`,
      x.bounces === null ? '—' : String(x.bounces),
      x.paths.pd + x.paths.decode_local > 0 ? `${x.paths.pd} / ${x.paths.decode_local}` : '—',
      ...(anyEvicted ? [evictionText(x.evictions)] : []),
    ];
  };
  L.push(`| ${head.join(' | ')} |`, `|---|${head.slice(1).map(() => '---:').join('|')}|`, ...r.runs.map((x) => `| ${row(x).join(' | ')} |`), '');
  const errs = [...new Set(r.runs.flatMap((x) => x.errors))];
  if (errs.length) L.push('', `Errors seen: ${errs.slice(0, 5).map((e) => `\`${e.replace(/`/g, "'").slice(0, 160)}\``).join('; ')}.`);
  if (plot) L.push('', `![TTFT p90 by turn](${plot})`);
  L.push('');
  return L;
}
