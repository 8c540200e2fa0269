/**
 * BENCHMARKS.md and the SVG plots of the suite, generated from the sections' JSON results. The
 * prose is the template beside this file (report.md); this module turns the results into
 * the tables, plots and one-sentence readings its placeholders take. Every sentence that judges
 * PD is derived from the numbers of the run it describes.
 */
import { handoffGoals, judged, KV_GOALS, largeStatesSection, targetMiBOf } from './report-kv.js';
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import type { KvSectionResult } from './kv.js';
import { agentGoals, agentsPlot, agentsReport, type AgentsResult } from './agents.js';
import { agentsScaleGoals, agentsScaleReport, type AgentsScaleResult } from './report-agents.js';
import { agentTraceGoals, agentTracePlot, agentTraceReport, type AgentTraceResult } from './report-agent-trace.js';
import { routersSection, routersSummaryRows, type RoutersResult } from './routers.js';
import { peerReport, type PeerResult } from './peer.js';
import { phaseReport, type PhaseProfileResult } from './profile.js';
import type { BatchingResult, BatchingRow, InterferenceResult, LowLoadRow, RouterOverheadResult, RouterOverheadRun, ScalingResult } from './sections.js';
import { barChart, lineChart } from './svg.js';
import { fmt, fmtRatio } from './util.js';
import { fillTemplate, readTemplate } from './template.js';
import type { SectionFile } from './util.js';
export type { SectionFile };

/** Suite-wide facts printed at the top of the report. */
export interface SuiteMeta {
  date: string;
  command: string;
  quick: boolean;
  commit: string;
  machine: { cpuModel: string; cores: number; memGiB: number; os: string; node: string; packages: Record<string, string>; loadavgStart: number[]; loadavgEnd: number[] };
  model: { name: string; path: string; params: number; nVocab: number; dims: { nEmbd: number; nLayer: number; nHead: number }; ggufBytes: number };
  config: { contextSize: number; batchSize: number; decodeSlots: number; threadsPerProcess: number; pinned: boolean; pinning: string };
  sectionSeconds: Record<number, number>;
  totalSeconds: number;
}

type Plots = Record<string, string>;

const MiB = 1024 * 1024;
/** a < b by more than 5 % and 0.02 (goodput, req/s). */
const clearlyBelow = (a: number | null, b: number | null) => (b ?? 0) - (a ?? 0) > Math.max(0.02, 0.05 * (b ?? 0));
const pct = (ratio: number) => (Number.isFinite(ratio) ? `${ratio >= 1 ? '+' : '−'}${Math.abs((ratio - 1) * 100).toFixed(0)} %` : 'n/a');

/** Write every plot whose section has results; returns name → path relative to the repo root. */
export function writePlots(files: Map<number, SectionFile>, dir: string): Plots {
  const out: Plots = {};
  const put = (name: string, svg: string) => {
    writeFileSync(join(dir, name), svg);
    out[name] = `bench/plots/${name}`;
  };
  const s1 = files.get(1)?.result as KvSectionResult | undefined;
  if (s1?.sizes?.length) {
    put(
      's1-kv-vs-raw.svg',
      barChart({
        title: 'KV handoff vs bare TCP socket (two processes)',
        yLabel: 'GB/s (state bytes / time)',
        categories: s1.sizes.map((s) => `${(s.blobBytes / MiB).toFixed(0)} MiB`),
        series: [
          { name: s1.sizes.some((s) => s.kvAckMs !== undefined) ? 'KV handoff (save start → loaded)' : 'KV handoff (saved → loaded)', values: s1.sizes.map((s) => s.kvGBps) },
          { name: 'KV wire phase only', values: s1.sizes.map((s) => s.wireGBps) },
          { name: 'raw TCP', values: s1.sizes.map((s) => s.rawGBps) },
        ],
      }),
    );
  }
  const s2 = files.get(2)?.result as LowLoadRow[] | undefined;
  if (s2?.length) {
    put(
      's2-low-load.svg',
      barChart({
        title: 'Low load, one request at a time: median TTFT and E2E',
        yLabel: 'ms',
        categories: s2.flatMap((r) => [`TTFT ${r.promptTokens} tok`, `E2E ${r.promptTokens} tok`]),
        series: [
          { name: 'PD (router)', values: s2.flatMap((r) => [r.pd.ttftMs.median, r.pd.e2eMs.median]) },
          { name: 'colocated', values: s2.flatMap((r) => [r.colo.ttftMs.median, r.colo.e2eMs.median]) },
        ],
        width: 720,
      }),
    );
  }
  const s3 = files.get(3)?.result as InterferenceResult | undefined;
  if (s3?.segments?.length) {
    const colo = s3.segments.find((s) => s.side === 'colo');
    const pd = s3.segments.find((s) => s.side === 'pd');
    put(
      's3-itl-over-time.svg',
      lineChart({
        title: `ITL of ${s3.streams} decoding streams while ${s3.longPrompt}-token prompts arrive`,
        xLabel: 'time in segment (s); one point per 100 ms: the largest gap ending in it',
        yLabel: 'ITL (ms, log)',
        logY: true,
        series: [
          { name: 'colocated', points: colo?.itlSeries ?? [], mode: 'points' },
          { name: 'PD', points: pd?.itlSeries ?? [], mode: 'points' },
        ],
        vlines: { x: colo?.longAt ?? pd?.longAt ?? [], label: 'long prompt sent' },
        width: 760,
      }),
    );
  }
  const s4r = files.get(4)?.result as BatchingResult | undefined;
  const s4 = s4r?.rows;
  if (s4?.length) {
    put(
      's4-batching.svg',
      lineChart({
        title: 'Decode batching: aggregate tokens/s with N concurrent streams',
        xLabel: 'concurrent streams',
        yLabel: 'tokens/s (all streams live)',
        series: [
          { name: 'pdserve (router → prefill → decode)', points: s4.map((r) => [r.streams, r.pdTokPerS]) },
          { name: 'node-llama-cpp directly', points: s4.map((r) => [r.streams, r.directTokPerS]) },
        ],
      }),
    );
  }
  const s5 = files.get(5)?.result as RouterOverheadResult | undefined;
  if (s5?.router) {
    put(
      's5-router-overhead.svg',
      barChart({
        title: 'Router overhead: same requests, with and without the router',
        yLabel: 'ms',
        categories: [...(s5.warm ? ['TTFT p50 (warm)', 'TTFT p99 (warm)'] : []), 'TTFT p50', 'TTFT p99', 'E2E p50', 'E2E p99'],
        series: [
          { name: 'through the router', values: [...(s5.warm ? [s5.warm.router.ttftMs.p50, s5.warm.router.ttftMs.p99] : []), s5.router.ttftMs.p50, s5.router.ttftMs.p99, s5.router.e2eMs.p50, s5.router.e2eMs.p99] },
          { name: 'workers directly', values: [...(s5.warm ? [s5.warm.direct.ttftMs.p50, s5.warm.direct.ttftMs.p99] : []), s5.direct.ttftMs.p50, s5.direct.ttftMs.p99, s5.direct.e2eMs.p50, s5.direct.e2eMs.p99] },
        ],
      }),
    );
  }
  const s6 = files.get(6)?.result as ScalingResult | undefined;
  if (s6?.rows?.length) {
    put(
      's6-goodput.svg',
      lineChart({
        title: `Goodput (TTFT ≤ ${s6.slo.ttftMs} ms, TPOT ≤ ${s6.slo.tpotMs} ms) vs request rate`,
        xLabel: 'request rate (req/s, Poisson)',
        yLabel: 'goodput (req/s)',
        series: [
          { name: 'PD', points: s6.rows.map((r) => [r.rate, r.pd.goodput ?? NaN]) },
          { name: 'colocated', points: s6.rows.map((r) => [r.rate, r.colo.goodput ?? NaN]) },
        ],
      }),
    );
    put(
      's6-latency.svg',
      lineChart({
        title: 'P99 TPOT vs request rate',
        xLabel: 'request rate (req/s, Poisson)',
        yLabel: 'P99 TPOT (ms, log)',
        logY: true,
        series: [
          { name: 'PD', points: s6.rows.map((r) => [r.rate, r.pd.tpotMs.p99]) },
          { name: 'colocated', points: s6.rows.map((r) => [r.rate, r.colo.tpotMs.p99]) },
        ],
        hline: s6.slo.tpotMs ? { y: s6.slo.tpotMs, label: `SLO ${s6.slo.tpotMs} ms` } : undefined,
      }),
    );
  }
  const s7 = files.get(7)?.result as AgentsResult | undefined;
  if (s7?.runs?.length) put('s7-agents-ttft.svg', agentsPlot(s7));
  const s7trace = files.get(72)?.result as AgentTraceResult | undefined;
  if (s7trace?.runs?.length) put('s7-agent-trace-ttft.svg', agentTracePlot(s7trace));
  return out;
}

function table(head: string[], rows: (string | number)[][]): string {
  return [`| ${head.join(' | ')} |`, `|${head.map((h, i) => (i === 0 ? '---' : '---:')).join('|')}|`, ...rows.map((r) => `| ${r.join(' | ')} |`)].join('\n');
}

/** A section's name in the report: its number, its sub-runs' numbers (11, 21, 71, 72, 81) named. */
function sectionName(n: number): string {
  return n === 21 ? '2 (unpinned)' : n === 11 ? '1 (large states)' : n === 71 ? '7 (agents at scale)' : n === 72 ? '7 (agent trace)' : n === 81 ? '8 (profile)' : String(n);
}

/** The line under a section's goals: when and at which commit its figures were measured, how long it ran, the load at its end. */
export function provenance(f: SectionFile | undefined, fresh: boolean): string {
  if (!f) return '';
  const q = f.meta.quick ? ' **Quick (smoke) run: numbers not meaningful.**' : '';
  return `_${fresh ? 'This run' : `Measured ${f.meta.date.slice(0, 16).replace('T', ' ')}Z at ${f.meta.commit}`}: ${f.meta.seconds} s, load ${f.meta.loadavg.join(' / ')} at the end._${q}`;
}

const img = (plots: Plots, name: string, alt: string) => (plots[name] ? `![${alt}](${plots[name]})` : '');
const NOT_RUN = '_Not run yet._';
const mib = (bytes: number, d = 0) => `${(bytes / MiB).toFixed(d)} MiB`;
const failures = (errs: readonly string[]) => (errs.length ? `Failed requests: ${errs.length} (${[...new Set(errs)].slice(0, 3).join('; ')}).` : '');
const blocks = (...xs: (string | undefined)[]) => xs.filter((x) => x).join('\n\n');

/** One benchmark's figures in the template: its tables and plot (`body`) and one sentence read from them. */
interface SectionText {
  body: string;
  reading: string;
}

/** The report template (src/bench/report.md): the prose a person edits. */
export const REPORT_TEMPLATE = 'report.md';

/**
 * The whole BENCHMARKS.md: the template filled with the tables and figures of `files`.
 * `fresh`: the sections measured in this run (the others come from earlier runs and say so);
 * `extra`: the GPU section's lines (bench-gpu.ts). `template` defaults to the shipped one.
 * @throws Error when the template and the values disagree (see `fillTemplate`).
 */
export function renderReport(meta: SuiteMeta, files: Map<number, SectionFile>, plots: Plots, fresh: number[], extra: readonly string[] = [], template = readTemplate(REPORT_TEMPLATE, import.meta.url)): string {
  const m = meta.machine;
  const s1 = files.get(1)?.result as KvSectionResult | undefined;
  const s2 = files.get(2)?.result as LowLoadRow[] | undefined;
  const s2u = files.get(21)?.result as LowLoadRow[] | undefined;
  const s3 = files.get(3)?.result as InterferenceResult | undefined;
  const s4r = files.get(4)?.result as BatchingResult | undefined;
  const s4: BatchingRow[] | undefined = s4r?.rows;
  const s5 = files.get(5)?.result as RouterOverheadResult | undefined;
  const s6 = files.get(6)?.result as ScalingResult | undefined;
  const s7 = files.get(7)?.result as AgentsResult | undefined;
  const prov = (n: number) => provenance(files.get(n), fresh.includes(n));
  const run = [
    `Last run: \`${meta.command}\` on ${meta.date.slice(0, 16).replace('T', ' ')}Z at ${meta.commit}, measuring §${fresh.length ? fresh.map(sectionName).join(', §') : ' none'} in ${meta.totalSeconds} s; other sections keep their earlier figures.`,
    meta.quick ? '> **This is a quick smoke run** (`--quick`): repetitions and durations are cut to the minimum; the numbers only show that every section works. Run `npm run bench` for real numbers.' : '',
  ];
  const s7scale = files.get(71)?.result as AgentsScaleResult | undefined;
  const s7trace = files.get(72)?.result as AgentTraceResult | undefined;
  const agentRows = [...(s7?.runs?.length ? agentGoals(s7) : []), ...(s7scale?.runs?.length ? agentsScaleGoals(s7scale) : []), ...(s7trace?.runs?.length ? agentTraceGoals(s7trace) : [])].map((g) => [`${g.goal} (§7)`, g.detail, g.met ? '**pass**' : '**miss**']);
  const s9 = files.get(9)?.result as RoutersResult | undefined;
  const routerRows = routersSummaryRows(s9).map((g) => [`${g.goal} (§9)`, g.figure, g.met ? '**pass**' : '**miss**']);
  const goals = table(['goal', 'measured', 'met?'], [...handoffGoals(files.get(1), files.get(11), s2), ...servingGoals(s2, s2u, s3, s4, s5, s6), ...agentRows, ...routerRows]);
  const machine = table(
    ['', ''],
    [
      ['CPU', `${m.cpuModel}, ${m.cores} cores`],
      ['memory', `${m.memGiB} GiB`],
      ['OS', m.os],
      ['Node', m.node],
      ['packages', Object.entries(m.packages).map(([k, v]) => `${k} ${v}`).join(', ')],
      ['model', `${meta.model.name}: ${(meta.model.params / 1e6).toFixed(1)} M parameters, f16, ${meta.model.dims.nLayer} layers, embd ${meta.model.dims.nEmbd}, vocab ${meta.model.nVocab}, GGUF ${(meta.model.ggufBytes / MiB).toFixed(1)} MiB`],
      ['engine', `node-llama-cpp (CPU), 1 llama.cpp thread per process, flash attention on, context ${meta.config.contextSize} tokens per sequence, batch ${meta.config.batchSize}`],
      ['cluster (§2–6)', `1 router, 1 prefill worker (1 slot), 1 decode worker (${meta.config.decodeSlots} slots), 1 colocated server (${meta.config.decodeSlots} slots), all on loopback`],
      ['CPU pinning', meta.config.pinning],
    ],
  );
  const sections: [number, SectionText][] = [
    [1, kvSection(s1, plots)],
    [2, lowLoadSection(s2, s2u, prov(21), plots)],
    [3, interferenceSection(s3, meta, plots)],
    [4, batchingSection(s4r, meta, plots)],
    [5, routerSection(s5, plots)],
    [6, scalingSection(s6, plots)],
  ];
  const values: Record<string, string> = { run: blocks(...run), goals, machine };
  for (const [n, s] of sections) {
    values[`s${n}_provenance`] = prov(n);
    values[`s${n}_body`] = s.body;
    values[`s${n}_reading`] = s.reading;
  }
  const large = largeStatesSection(files.get(11), prov(11));
  values.s1_large = large.length ? large.join('\n') : NOT_RUN;
  values.s7 = agentsReport(s7, prov(7), plots['s7-agents-ttft.svg']).join('\n');
  values.s7_scale = agentsScaleReport(s7scale, prov(71), m.cores).join('\n');
  values.s7_trace = agentTraceReport(s7trace, prov(72), plots['s7-agent-trace-ttft.svg']).join('\n');
  values.s8 = peerReport(files.get(8)?.result as PeerResult | undefined, prov(8)).join('\n');
  // the profile usually comes from §8's own run: its provenance line is said once
  values.s8_profile = phaseReport(files.get(81)?.result as PhaseProfileResult | undefined, prov(81) === prov(8) ? '_Same run._' : prov(81)).join('\n');
  values.s9 = routersSection(files.get(9)?.result as RoutersResult | undefined, prov(9)).join('\n');
  values.gpu = extra.join('\n');
  values.losses = losses(s1, s2, s3, s4, s5, s6, s7, s7scale, s7trace)
    .map((x) => `- ${x}`)
    .join('\n');
  return fillTemplate(template, values);
}

/** §1: the handoff's table and the same-host path's table (the per-phase medians and the building blocks' speeds stay in the JSON). */
function kvSection(s1: KvSectionResult | undefined, plots: Plots): SectionText {
  if (!s1?.sizes?.length) return { body: NOT_RUN, reading: '' };
  const size = (s: KvSectionResult['sizes'][number]) => mib(s.blobBytes, 1);
  const main = table(
    ['state', 'tokens', 'KV ms (p90)', 'raw TCP ms (p90)', 'save ms', 'KV / (save+raw+load), ≤ 1.3 from 16 MiB', 'trials'],
    s1.sizes.map((s) => [size(s), s.tokens, `${fmt(s.kvMs.median)} (${fmt(s.kvMs.p90)})`, `${fmt(s.rawMs.median)} (${fmt(s.rawMs.p90)})`, fmt(s.goalSaveMs ?? s.saveMs), s.goalRatio === undefined ? 'n/a' : `**${fmtRatio(s.goalRatio)}** ${!judged(KV_GOALS.tcp, targetMiBOf(s)) ? 'not judged' : s.goalRatio <= KV_GOALS.tcp.limit ? 'pass' : 'miss'}`, s.kvMs.n]),
  );
  const shs = s1.sizes.filter((s) => s.sameHostMs);
  const sameHost = shs.length
    ? table(
        ['state', 'same host ms (p90)', 'save ms', 'take ms', 'loadState ms', '(save+same host) / (save+load), ≤ 1.1 from 4 MiB'],
        shs.map((s) => {
          const p = s.sameHostPhasesMs!;
          return [size(s), `${fmt(s.sameHostMs!.median)} (${fmt(s.sameHostMs!.p90)})`, fmt(s.saveMs), fmt(p.take, 2), fmt(p.load), `**${fmtRatio(s.sameHostGoalRatio!)}** ${!judged(KV_GOALS.sameHost, targetMiBOf(s)) ? 'not judged' : s.sameHostGoalRatio! <= KV_GOALS.sameHost.limit ? 'pass' : 'miss'}`];
        }),
      )
    : '';
  const g1 = s1.sizes.filter((s) => s.goalRatio !== undefined);
  const gs = s1.sizes.filter((s) => s.sameHostGoalRatio !== undefined);
  const reading = g1.length ? `Over TCP the excess over the floor is the work a bare socket skips (file read, CRC-32, structure walk, file write)${gs.length ? '; on the same host, one loopback message and the header walk' : ''}.` : '';
  return {
    body: blocks(
      main,
      sameHost && 'Same host, same run (saved on prefill → loaded on decode; take: rename + header walk):',
      sameHost,
      img(plots, 's1-kv-vs-raw.svg', 'KV handoff vs raw TCP, GB/s'),
    ),
    reading,
  };
}

/** §2: the low-load table (pinned), PD's TTFT breakdown, the second-token gap and the unpinned table. */
function lowLoadSection(s2: LowLoadRow[] | undefined, s2u: LowLoadRow[] | undefined, provUnpinned: string, plots: Plots): SectionText {
  if (!s2?.length) return { body: NOT_RUN, reading: '' };
  const lowLoad = (rs: LowLoadRow[]) =>
    table(
      ['prompt tokens', 'TTFT PD / colo ms', 'TPOT PD / colo ms', 'E2E PD / colo ms', 'TTFT ratio', 'TPOT ratio', 'E2E ratio'],
      rs.map((r) => [r.promptTokens, `${fmt(r.pd.ttftMs.median)} / ${fmt(r.colo.ttftMs.median)}`, `${fmt(r.pd.tpotMs.median, 2)} / ${fmt(r.colo.tpotMs.median, 2)}`, `${fmt(r.pd.e2eMs.median)} / ${fmt(r.colo.e2eMs.median)}`, `**${fmtRatio(r.ratio.ttft)}**`, fmtRatio(r.ratio.tpot), fmtRatio(r.ratio.e2e)]),
    );
  const bd = s2.filter((r) => r.pdBreakdown);
  const st = s2.filter((r) => r.secondToken);
  const worst = s2.reduce((a, b) => (b.ratio.ttft > a.ratio.ttft ? b : a));
  const ref = s2u?.length ? s2u : s2;
  const refWorst = ref.reduce((a, b) => (b.ratio.ttft > a.ratio.ttft ? b : a));
  return {
    body: blocks(
      `Pinned (${s2[0]!.outputTokens} output tokens, ${s2.map((r) => r.reps).join(' / ')} repetitions; ratio > 1: PD slower):`,
      lowLoad(s2),
      bd.length ? `Workers called directly (${bd.map((r) => r.promptTokens).join(' / ')} tokens): \`prefill_ms\` (prompt, token 1, save) ${bd.map((r) => fmt(r.pdBreakdown.prefillMs, 0)).join(' / ')} ms; \`transfer_ms\` ${bd.map((r) => fmt(r.pdBreakdown.transferMs, 0)).join(' / ')} ms for ${bd.map((r) => fmt(r.pdBreakdown.kvBytes / MiB, 1)).join(' / ')} MiB.` : '',
      st.length ? `Token 1 → token 2 gap, PD against colocated ITL (${st.map((r) => r.promptTokens).join(' / ')} tokens): ${st.map((r) => `${fmt(r.secondToken!.pdGapMs)} vs ${fmt(r.secondToken!.coloItlMs, 2)} ms (**${fmtRatio(r.secondToken!.ratio)}**)`).join(', ')}; colocated's own gap ${st.map((r) => fmt(r.secondToken!.coloGapMs)).join(' / ')} ms.` : '',
      s2u?.length ? `Unpinned (\`--no-pin\`, ${s2u.map((r) => r.reps).join(' / ')} repetitions); ${provUnpinned.replace(/^_|\.?_$/g, '').replace(/^[TM]/, (c) => c.toLowerCase())}:` : '',
      s2u?.length ? lowLoad(s2u) : '',
      failures(s2.flatMap((r) => r.errors)),
      img(plots, 's2-low-load.svg', 'PD vs colocated at low load'),
    ),
    reading:
      refWorst.ratio.ttft > 1.1
        ? `PD's TTFT is ${pct(refWorst.ratio.ttft)} at ${refWorst.promptTokens} prompt tokens${s2u?.length ? ' unpinned' : ''} (${pct(worst.ratio.ttft)} at ${worst.promptTokens} pinned): token 1 streams from prefill before the transfer, so PD pays the router hop, decode's registration and the state save.`
        : `PD's TTFT is within 1.10 × colocated at every length${s2u?.length ? ' unpinned' : ''}${worst.ratio.ttft > 1.1 ? ` (pinned: ${pct(worst.ratio.ttft)} at ${worst.promptTokens} tokens)` : ''}: token 1 streams from prefill before the transfer, so only the state save is on it.`,
  };
}

/** §3: ITL and long-prompt TTFT, colocated and PD. */
function interferenceSection(s3: InterferenceResult | undefined, meta: SuiteMeta, plots: Plots): SectionText {
  if (!s3?.pd) return { body: NOT_RUN, reading: '' };
  const row = (name: string, x: InterferenceResult['pd']) => [name, fmt(x.itlMs.p50), fmt(x.itlMs.p99), fmt(x.itlMs.max, 0), x.stalls, fmt(x.longTtftMs.p50, 0), `${x.longUnfinished ?? 0} / ${x.longSent ?? '?'}`, fmt(x.streamTokPerS, 0)];
  return {
    body: blocks(
      `${s3.streams} streams (${s3.streamPrompt}-token prompts, ${s3.streamOutput} tokens out, back to back); from ${s3.settleMs / 1000} s a ${s3.longPrompt}-token prompt (${s3.longOutput} tokens out) every ${s3.periodMs / 1000} s; ${s3.segmentMs / 1000} s segments, ${(s3.drainMs ?? 0) / 1000} s drain; ${meta.config.pinned ? 'PD prefill pinned to CPU 0, decode to CPU 1' : 'unpinned'}.`,
      table(['', 'ITL p50 ms', 'ITL p99 ms', 'ITL max ms', 'gaps > 100 ms', 'long TTFT p50 ms', 'long without 1st token', 'stream tok/s'], [row('colocated', s3.colo), row('PD', s3.pd)]),
      `Colocated / PD: ITL p50 ${fmtRatio(s3.ratio.itlP50)}, ITL p99 **${fmtRatio(s3.ratio.itlP99)}**, long-prompt TTFT p50 ${fmtRatio(s3.ratio.longTtftP50)}.`,
      img(plots, 's3-itl-over-time.svg', 'ITL over time, colocated vs PD'),
    ),
    reading:
      s3.ratio.itlP99 > 1.5
        ? `A long prefill stalls every colocated decoder; PD's decoder runs in its own process${s3.ratio.longTtftP50 < 1 ? `, while the long prompts wait longer under PD (their state is saved, sent and loaded)` : ''}.`
        : `On this run PD did not clearly isolate the decoders (ITL p99 ${fmt(s3.pd.itlMs.p99)} ms PD against ${fmt(s3.colo.itlMs.p99)} ms colocated).`,
  };
}

/** §4: tokens/s with N streams, pdserve and direct, and the engine contention probe. */
function batchingSection(s4r: BatchingResult | undefined, meta: SuiteMeta, plots: Plots): SectionText {
  if (!s4r?.rows?.length) return { body: NOT_RUN, reading: '' };
  const s4 = s4r.rows;
  const ct = s4r.contention;
  const partial = s4.reduce((x, r) => x + (r.partialOverlapRuns ?? 0), 0);
  return {
    body: blocks(
      `${s4[0]!.outputTokens} output tokens per stream, ${s4[0]!.promptTokens ?? 32}-token prompts; direct: ${s4r.directSequences ?? meta.config.decodeSlots} sequences, context ${meta.config.contextSize}, 1 thread${meta.config.pinned ? ', pinned like the decode worker' : ''}; tokens/s while all streams are live.`,
      table(
        ['streams', 'reps', 'pdserve tok/s', 'direct tok/s', 'pdserve / direct'],
        s4.map((r) => [r.streams, r.reps, fmt(r.pdTokPerS, 0), fmt(r.directTokPerS, 0), `**${fmtRatio(r.ratio)}**`]),
      ),
      ct ? `Contention probe, idle → while ${ct.streams} sequences decode (${ct.finishedAtLoad + ct.finishedAtReuse === 0 ? 'none finished by then' : `${ct.finishedAtLoad} / ${ct.finishedAtReuse} finished by then`}): a ${ct.stateTokens}-token \`loadState\` ${fmt(ct.idleLoadMs)} → ${fmt(ct.busyLoadMs)} ms, a released slot's reuse ${fmt(ct.idleReuseMs)} → ${fmt(ct.busyReuseMs)} ms.` : '',
      ct && (ct.finishedAtLoad === ct.streams || ct.finishedAtReuse === ct.streams) ? '**The load or the reuse waited for every other sequence to finish**: the engine holds the context lock across consecutive batches.' : '',
      partial ? `In ${partial} run(s) the streams never all overlapped; their rate is over the whole span.` : '',
      failures(s4.flatMap((r) => r.errors)),
      img(plots, 's4-batching.svg', 'decode batching'),
    ),
    reading: s4.every((r) => r.ratio >= 0.9) ? 'The step barrier (`src/engine/step-barrier.ts`) keeps each decode step one batch over the live sequences, as the engine alone runs them.' : `pdserve falls below 0.9 × the engine driven directly at ${s4.filter((r) => r.ratio < 0.9).map((r) => r.streams).join(', ')} stream(s).`,
  };
}

/** §5: TTFT, ITL and E2E through the router and directly, warm and cold prompts. */
function routerSection(s5: RouterOverheadResult | undefined, plots: Plots): SectionText {
  if (!s5?.router) return { body: NOT_RUN, reading: '' };
  const rows5 = (x: RouterOverheadRun, kind: string) => [
    [`${kind}: via router`, fmt(x.router.ttftMs.p50), fmt(x.router.ttftMs.p99), fmt(x.router.e2eMs.p50), fmt(x.router.e2eMs.p99)],
    [`${kind}: direct`, fmt(x.direct.ttftMs.p50), fmt(x.direct.ttftMs.p99), fmt(x.direct.e2eMs.p50), fmt(x.direct.e2eMs.p99)],
    [`**${kind}: added**`, `**${fmt(x.addedMs.ttftP50)}**`, `**${fmt(x.addedMs.ttftP99)}**`, `**${fmt(x.addedMs.e2eP50)}**`, `**${fmt(x.addedMs.e2eP99)}**`],
  ];
  const head5 = ['ms', 'TTFT p50', 'TTFT p99', 'E2E p50', 'E2E p99'];
  const w = s5.warm;
  const allHits = w && w.cacheHits.router === w.reps && w.cacheHits.direct === w.reps;
  return {
    body: blocks(
      `${w ? `Warm (the verdict): ${w.reps} requests each way, prefix-cache hits ${w.cacheHits.router}/${w.reps} via the router, ${w.cacheHits.direct}/${w.reps} direct${allHits ? '' : ' — **not all hits: cold samples are mixed in**'}; cold: ` : ''}${s5.reps} requests each way, every prompt new to prefill; ${s5.promptTokens}-token prompts, ${s5.outputTokens} output tokens.`,
      table(head5, [...(w ? rows5(w, 'warm') : []), ...rows5(s5, 'cold')]),
      w ? failures(w.errors) : '',
      failures(s5.errors),
      img(plots, 's5-router-overhead.svg', 'router overhead'),
    ),
    reading: `The router adds ${fmt((w ?? s5).addedMs.ttftP50)} ms to TTFT p50 and ${fmt((w ?? s5).addedMs.ttftP99)} ms to p99${w ? '' : ' (cold prompts only)'}; p99 over this many samples is near the maximum, so it is noisy.`,
  };
}

/** §6: goodput, throughput and latency percentiles at each request rate. */
function scalingSection(s6: ScalingResult | undefined, plots: Plots): SectionText {
  if (!s6?.rows?.length) return { body: NOT_RUN, reading: '' };
  const lose = s6.rows.filter((r) => clearlyBelow(r.pd.goodput, r.colo.goodput));
  const win = s6.rows.filter((r) => clearlyBelow(r.colo.goodput, r.pd.goodput));
  return {
    body: blocks(
      `Prompts of ${s6.inputLen} ±${s6.rangeRatio * 100} % tokens, ${s6.outputLen} ±${s6.rangeRatio * 100} % output tokens, no concurrency cap; SLO **TTFT ≤ ${s6.slo.ttftMs} ms and TPOT ≤ ${s6.slo.tpotMs} ms**; drain ${(s6.drainMs ?? 0) / 1000} s.`,
      table(
        ['rate req/s', 'prompts', 'goodput PD', 'goodput colo', 'req/s PD / colo', 'TTFT p99 PD / colo ms', 'TPOT p99 PD / colo ms', 'failed'],
        s6.rows.map((r) => [r.rate, r.numPrompts, `**${fmt(r.pd.goodput, 2)}**`, `**${fmt(r.colo.goodput, 2)}**`, `${fmt(r.pd.requestThroughput, 2)} / ${fmt(r.colo.requestThroughput, 2)}`, `${fmt(r.pd.ttftMs.p99, 0)} / ${fmt(r.colo.ttftMs.p99, 0)}`, `${fmt(r.pd.tpotMs.p99, 1)} / ${fmt(r.colo.tpotMs.p99, 1)}`, r.pd.failed + r.colo.failed]),
      ),
      img(plots, 's6-goodput.svg', 'goodput vs request rate'),
      img(plots, 's6-latency.svg', 'P99 TPOT vs request rate'),
    ),
    reading: `PD's goodput is ${lose.length ? `below colocated's at ${lose.map((r) => r.rate).join(', ')} req/s` : "at least colocated's at every rate"} (±5 %): both saturate on prompt evaluation, but PD's decoding does not wait for it.`,
  };
}

/** "Where PD loses": every figure of the report where PD is behind. */
function losses(s1: KvSectionResult | undefined, s2: LowLoadRow[] | undefined, s3: InterferenceResult | undefined, s4: BatchingRow[] | undefined, s5: RouterOverheadResult | undefined, s6: ScalingResult | undefined, s7: AgentsResult | undefined, s7scale?: AgentsScaleResult, s7trace?: AgentTraceResult): string[] {
  const out: string[] = [];
  if (s2?.length) for (const r of s2) if (r.ratio.ttft > 1.05) out.push(`Unloaded TTFT at ${r.promptTokens} prompt tokens: ${pct(r.ratio.ttft)} (${fmt(r.pd.ttftMs.median, 0)} vs ${fmt(r.colo.ttftMs.median, 0)} ms).`);
  if (s2?.length) for (const r of s2) if (r.ratio.tpot > 1.05) out.push(`Unloaded TPOT at ${r.promptTokens} prompt tokens: ${pct(r.ratio.tpot)} (${fmt(r.pd.tpotMs.median, 2)} vs ${fmt(r.colo.tpotMs.median, 2)} ms).`);
  if (s1?.sizes?.length) out.push(`Moving the state: ${s1.sizes.map((s) => fmt(s.kvMs.median, 0)).join(' / ')} ms at ${s1.sizes.map((s) => (s.blobBytes / MiB).toFixed(0)).join(' / ')} MiB, ${fmtRatio(Math.min(...s1.sizes.map((s) => s.ratio)))}–${fmtRatio(Math.max(...s1.sizes.map((s) => s.ratio)))} a bare socket; colocated pays none.`);
  if (s3?.pd && s3.ratio.longTtftP50 < 1) out.push(`Long-prompt TTFT under interference: ${fmt(s3.pd.longTtftMs.p50, 0)} ms PD vs ${fmt(s3.colo.longTtftMs.p50, 0)} ms colocated (p50).`);
  if (s3?.pd && s3.ratio.itlP50 < 1) out.push(`Median ITL under interference: ${fmt(s3.pd.itlMs.p50)} ms PD vs ${fmt(s3.colo.itlMs.p50)} ms colocated.`);
  if (s4?.length) for (const r of s4) if (r.ratio < 0.95) out.push(`Decode throughput with ${r.streams} stream(s): pdserve reaches ${fmtRatio(r.ratio)} of node-llama-cpp driven directly.`);
  if (s5?.router && (s5.warm ? s5.warm.addedMs.ttftP50 > 0 : s5.addedMs.e2eP50 > 0)) out.push(`The router hop: ${s5.warm ? `+${fmt(s5.warm.addedMs.ttftP50)} ms TTFT p50 (warm), ` : ''}+${fmt(s5.addedMs.ttftP50)} ms TTFT and +${fmt(s5.addedMs.e2eP50)} ms E2E p50 (cold).`);
  if (s6?.rows?.length) for (const r of s6.rows) if (clearlyBelow(r.pd.goodput, r.colo.goodput)) out.push(`Goodput at ${r.rate} req/s: ${fmt(r.pd.goodput, 2)} vs ${fmt(r.colo.goodput, 2)} req/s.`);
  const missed = [...(s7?.runs?.length ? agentGoals(s7) : []), ...(s7scale?.runs?.length ? agentsScaleGoals(s7scale) : []), ...(s7trace?.runs?.length ? agentTraceGoals(s7trace) : [])].filter((g) => !g.met).length;
  if (missed) out.push(`Agents: ${missed} goal(s) of §7 missed (see the summary).`);
  out.push('Resources: PD loads the model twice (prefill and decode) and here used two cores where colocated used one.');
  return out;
}

/**
 * The serving goals as rows of [goal, measured, verdict] from this report's sections (each
 * measured side by side in one run; the handoff's goals are report-kv.ts `handoffGoals`). A goal
 * whose section has no figures says so instead of passing.
 */
function servingGoals(s2: LowLoadRow[] | undefined, s2u: LowLoadRow[] | undefined, s3: InterferenceResult | undefined, s4: BatchingRow[] | undefined, s5: RouterOverheadResult | undefined, s6?: ScalingResult): string[][] {
  const rows: string[][] = [];
  const verdict = (ok: boolean | undefined) => (ok === undefined ? 'not measured' : ok ? '**pass**' : '**miss**');
  // pinned and unpinned runs in one row per metric, each judged on its own
  const runs2: [string, LowLoadRow[]][] = [];
  if (s2?.length) runs2.push(['pinned', s2]);
  if (s2u?.length) runs2.push(['unpinned', s2u]);
  for (const [metric, limit, pick] of [['TTFT', 1.1, (r: LowLoadRow) => r.ratio.ttft], ['E2E', 1.15, (r: LowLoadRow) => r.ratio.e2e]] as const) {
    if (!runs2.length) continue;
    const ok = runs2.map(([name, rs]) => [name, rs.every((r) => pick(r) <= limit)] as const);
    rows.push([
      `PD ${metric} ≤ ${limit.toFixed(2)} × colocated at low load (§2)`,
      `${runs2.map(([name, rs]) => `${name} ${rs.map((r) => fmtRatio(pick(r))).join(' / ')}`).join('; ')} (${runs2[0]![1].map((r) => r.promptTokens).join(' / ')} tokens)`,
      ok.every(([, v]) => v) ? '**pass**' : ok.every(([, v]) => !v) ? '**miss**' : ok.map(([n, v]) => `${v ? '**pass**' : '**miss**'} ${n}`).join(', '),
    ]);
  }
  if (s5?.warm) {
    const w = s5.warm;
    const hits = w.cacheHits.router < w.reps || w.cacheHits.direct < w.reps ? ` (only ${w.cacheHits.router}/${w.reps} and ${w.cacheHits.direct}/${w.reps} cache hits: some samples cold)` : '';
    rows.push(['router adds ≤ 3 ms to TTFT p99 (§5, warm prompts)', `p99 ${fmt(w.addedMs.ttftP99)} ms${hits}; cold: ${fmt(s5.addedMs.ttftP99)} ms`, verdict(w.addedMs.ttftP99 <= 3)]);
  } else if (s5?.addedMs) rows.push(['router adds ≤ 3 ms to TTFT p99 (§5, cold prompts only)', `p99 ${fmt(s5.addedMs.ttftP99)} ms (p50 ${fmt(s5.addedMs.ttftP50)} ms)`, verdict(s5.addedMs.ttftP99 <= 3)]);
  else rows.push(['router adds ≤ 3 ms to TTFT p99 (§5)', 'n/a', 'not measured']);
  if (s4?.length) rows.push(['decode ≥ 0.9 × direct node-llama-cpp at 1, 4, 8 streams (§4)', s4.map((r) => `${r.streams}: ${fmtRatio(r.ratio)}`).join(', '), verdict(s4.every((r) => r.ratio >= 0.9))]);
  if (s3?.ratio) rows.push(['under prefill interference, PD ITL p99 ≤ 0.2 × colocated (§3)', `PD / colocated ${fmtRatio(1 / s3.ratio.itlP99)}`, verdict(1 / s3.ratio.itlP99 <= 0.2)]);
  if (s6?.rows?.length) rows.push(['PD goodput ≥ colocated at every request rate (§6)', `${s6.rows.map((r) => `${fmt(r.pd.goodput, 2)} vs ${fmt(r.colo.goodput, 2)}`).join(', ')} at ${s6.rows.map((r) => r.rate).join(' / ')} req/s`, verdict(s6.rows.every((r) => (r.pd.goodput ?? 0) >= (r.colo.goodput ?? 0)))]);
  return rows;
}
