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
  return [
    { goal: `agent trace: session completion with reuse ≥ ${TRACE_GOALS.completionSpeedup}× faster than with prefix reuse off (median)`, detail: pd.map((x, i) => `${fmt(x.completion.p50 / 1000, 2)} s vs ${fmt(offMedian / 1000, 2)} s: ${fmtRatio(speed[i])}`).join(', ') || 'no PD run', met: all(speed, (v) => v >= TRACE_GOALS.completionSpeedup) },
    { goal: `agent trace: cached share over turns 2+ ≥ ${TRACE_GOALS.cachedVsBound} of the trace's upper bound (PD)`, detail: pd.map((x, i) => `${x.cached2 === null ? 'n/a' : fmt(x.cached2 * 100, 1) + ' %'} of ${fmt(x.bound2 * 100, 1)} %: ${fmt(ratio[i], 2)}`).join(', ') || 'no PD run', met: all(ratio, (v) => v >= TRACE_GOALS.cachedVsBound) },
    { goal: `agent trace: TTFT p90 at the last turn ≤ ${TRACE_GOALS.lastVsTurn2}× turn 2 (PD)`, detail: pd.map((x, i) => `${fmt(x.lastTurn.ttftP90, 0)} vs ${fmt(t2(x), 0)} ms: ${fmtRatio(last[i])}`).join(', ') || 'no PD run', met: all(last, (v) => v <= TRACE_GOALS.lastVsTurn2) },
    { goal: `agent trace: needs_prefill bounces ≤ ${TRACE_GOALS.bounceShare * 100} % of requests (PD)`, detail: pd.map((x, i) => `${x.bounces ?? 'n/a'} of ${x.requests} (${fmt(bounce[i]! * 100, 2)} %)`).join(', ') || 'no PD run', met: all(bounce, (v) => v <= TRACE_GOALS.bounceShare) },
  ];
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

/** Past this many turn positions the by-turn table shows turns 1, 2, every BY_TURN_STEP-th and the last (the plot has them all). */
const BY_TURN_ALL = 12;
const BY_TURN_STEP = 5;

/** The turn positions the by-turn table shows, of the sorted positions `all`. */
export function byTurnRows(all: readonly number[]): number[] {
  if (all.length <= BY_TURN_ALL) return [...all];
  const last = all[all.length - 1];
  return all.filter((t) => t <= 2 || t % BY_TURN_STEP === 0 || t === last);
}

/** Markdown lines of the subsection's placeholder: provenance, scale, the runs, TTFT and cached share by turn, the plot. */
export function agentTraceReport(r: AgentTraceResult | undefined, prov: string, plot: string | undefined): string[] {
  if (!r?.runs?.length) return ['_Not run yet._'];
  const s = r.scale;
  const L = [
    prov,
    '',
    `Trace: ${r.source}. ${s.topSessions} sessions and ${s.sessions - s.topSessions} sub-agent sessions, ${s.requests} requests; turns per session median ${s.turnsMedian}, max ${s.turnsMax}; prompt tokens median ${s.promptMedian}, max ${s.promptMax}; input : output ${fmt(s.ioRatio, 0)} : 1; pauses × ${r.timeScale}. Model: the generated **${r.model}** model; PD is 1 prefill + ${r.decode} decode (\`--decode-policy cache_aware\`). Command: \`${flagsJoined(r.command)}\`.`,
    '',
    `Machine load (1/5/15-min) ${r.load.start.join(' / ')} at the start, ${r.load.end.join(' / ')} at the end, on ${r.load.cores} cores shared with other jobs: the figures are measured under that load.`,
    '',
  ];
  const head = ['setup', 'sessions ok', 'requests failed', 'session completion p50 / p90 s', 'TTFT p50 / p90 turn 2 ms', 'TTFT p50 / p90 last turn ms', 'cached (turns 2+)', 'upper bound', 'cached / bound', 'needs_prefill', 'pd / decode-local', 'evictions by cause'];
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
      pct(x.bound2),
      x.cached2 === null || x.bound2 === 0 ? 'n/a' : fmt(x.cached2 / x.bound2, 2),
      x.bounces === null ? '—' : String(x.bounces),
      x.paths.pd + x.paths.decode_local > 0 ? `${x.paths.pd} / ${x.paths.decode_local}` : '—',
      evictionText(x.evictions),
    ];
  };
  L.push(`| ${head.join(' | ')} |`, `|---|${head.slice(1).map(() => '---:').join('|')}|`, ...r.runs.map((x) => `| ${row(x).join(' | ')} |`), '');
  // by turn: TTFT p50/p90 of each run, cached share and bound of each run
  const all = [...new Set(r.runs.flatMap((x) => x.byTurn.map((t) => t.turn)))].sort((a, b) => a - b);
  const turns = byTurnRows(all);
  const first = r.runs.filter((x) => x.repeat === 1);
  const th = ['turn', 'sessions', ...first.map((x) => `${x.name}: TTFT p50 / p90 ms`), ...first.map((x) => `${x.name}: cached / bound`)];
  L.push(`By turn (top-level sessions; first replay of each setup${turns.length < all.length ? `; turns 1, 2, every ${BY_TURN_STEP}th and the last` : ''}):`, '', `| ${th.join(' | ')} |`, `|---:|${th.slice(1).map(() => '---:').join('|')}|`);
  for (const t of turns) {
    const cells = first.map((x) => x.byTurn.find((y) => y.turn === t));
    L.push(`| ${[t, cells.find((c) => c)?.n ?? 0, ...cells.map((c) => (c ? `${fmt(c.ttftP50, 0)} / ${fmt(c.ttftP90, 0)}` : '—')), ...cells.map((c) => (c ? `${pct(c.cached)} / ${pct(c.bound)}` : '—'))].join(' | ')} |`);
  }
  const errs = [...new Set(r.runs.flatMap((x) => x.errors))];
  if (errs.length) L.push('', `Errors seen: ${errs.slice(0, 5).map((e) => `\`${e.replace(/`/g, "'").slice(0, 160)}\``).join('; ')}.`);
  if (plot) L.push('', `![TTFT p90 by turn](${plot})`);
  L.push('');
  return L;
}
