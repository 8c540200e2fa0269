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

/** A section's name in the report: its number, 71 and 72 (§7's agents at scale and agent trace results) named. */
function sectionName(n: number): string {
  return n === 71 ? '7 (agents at scale)' : n === 72 ? '7 (agent trace)' : n === 81 ? '8 (profile)' : String(n);
}

function provenance(f: SectionFile | undefined, fresh: boolean): string {
  if (!f) return '';
  const q = f.meta.quick ? ' **Quick (smoke) run: repetitions cut to the bone, numbers not meaningful.**' : '';
  return `_${fresh ? 'This run' : `From an earlier run (${f.meta.date}, commit ${f.meta.commit})`}: ${f.meta.seconds} s, load average ${f.meta.loadavg.join(' / ')} at its end._${q}`;
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
    `Generated by \`${meta.command}\` on ${meta.date}, commit ${meta.commit}. Sections measured in this run: ${fresh.length ? fresh.map(sectionName).join(', ') : 'none'}; wall time ${meta.totalSeconds} s (${Object.entries(meta.sectionSeconds).map(([k, v]) => `§${sectionName(Number(k))} ${v} s`).join(', ')}).`,
    meta.quick ? '> **This is a quick smoke run** (`--quick`): repetitions and durations are cut to the minimum; the numbers only show that every section works. Run `npm run bench` for real numbers.' : '',
  ];
  const s7scale = files.get(71)?.result as AgentsScaleResult | undefined;
  const s7trace = files.get(72)?.result as AgentTraceResult | undefined;
  const agentRows = [...(s7?.runs?.length ? agentGoals(s7) : []), ...(s7scale?.runs?.length ? agentsScaleGoals(s7scale) : []), ...(s7trace?.runs?.length ? agentTraceGoals(s7trace) : [])].map((g) => [`${g.goal} (§7)`, g.detail, g.met ? '**pass**' : '**miss**']);
  const goals = table(['goal', 'measured', 'met?'], [...handoffGoals(files.get(1), files.get(11), s2), ...servingGoals(s2, s2u, s3, s4, s5), ...agentRows]);
  const machine = table(
    ['', ''],
    [
      ['CPU', `${m.cpuModel}, ${m.cores} cores`],
      ['memory', `${m.memGiB} GiB`],
      ['OS', m.os],
      ['Node', m.node],
      ['packages', Object.entries(m.packages).map(([k, v]) => `${k} ${v}`).join(', ')],
      ['load average (1/5/15 min) at start → end', `${m.loadavgStart.join(' / ')} → ${m.loadavgEnd.join(' / ')}`],
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
  values.s8_profile = phaseReport(files.get(81)?.result as PhaseProfileResult | undefined, prov(81)).join('\n');
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
    ['state', 'tokens', 'bytes', 'KV: save start → loaded, median (p90) ms', 'raw: → last byte, median (p90) ms', 'KV GB/s', 'raw GB/s', "save ms (goal's floor)", 'goal: KV / (save+raw+load), ≤ 1.3 from 16 MiB', 'trials'],
    s1.sizes.map((s) => [size(s), s.tokens, s.blobBytes.toLocaleString('en-US'), `${fmt(s.kvMs.median)} (${fmt(s.kvMs.p90)})`, `${fmt(s.rawMs.median)} (${fmt(s.rawMs.p90)})`, fmt(s.kvGBps, 3), fmt(s.rawGBps, 3), fmt(s.goalSaveMs ?? s.saveMs), s.goalRatio === undefined ? 'n/a' : `**${fmtRatio(s.goalRatio)}** ${!judged(KV_GOALS.tcp, targetMiBOf(s)) ? 'not judged' : s.goalRatio <= KV_GOALS.tcp.limit ? 'pass' : 'miss'}`, s.kvMs.n]),
  );
  const shs = s1.sizes.filter((s) => s.sameHostMs);
  const sameHost = shs.length
    ? table(
        ['state', 'same-host to decode-loaded, median (p90) ms', 'save ms', 'decode take (rename + header walk)', 'preads (bytes) of the walk', 'loadState', 'goal: (save+same-host) / (save+load), ≤ 1.1 from 4 MiB', 'trials'],
        shs.map((s) => {
          const p = s.sameHostPhasesMs!;
          const bytes = s.sameHostReadBytes === undefined ? 'n/a' : Math.round(s.sameHostReadBytes).toLocaleString('en-US');
          return [size(s), `${fmt(s.sameHostMs!.median)} (${fmt(s.sameHostMs!.p90)})`, fmt(s.saveMs), fmt(p.take, 2), s.sameHostReads === undefined ? bytes : `${Math.round(s.sameHostReads)} (${bytes})`, fmt(p.load), `**${fmtRatio(s.sameHostGoalRatio!)}** ${!judged(KV_GOALS.sameHost, targetMiBOf(s)) ? 'not judged' : s.sameHostGoalRatio! <= KV_GOALS.sameHost.limit ? 'pass' : 'miss'}`, s.sameHostMs!.n];
        }),
      )
    : '';
  const g1 = s1.sizes.filter((s) => s.goalRatio !== undefined);
  const gs = s1.sizes.filter((s) => s.sameHostGoalRatio !== undefined);
  const reading = `Over TCP the handoff takes ${g1.map((s) => `${mib(s.blobBytes)} ${fmtRatio(s.goalRatio)}`).join(', ') || 'n/a'} its floor: above it is the work a bare socket does not do (prefill's file read and CRC-32, decode's CRC-32, structure walk and file write), so the bytes cross at the slower side's pace${gs.length ? `; on the same host the handoff is ${gs.map((s) => `${mib(s.blobBytes)} ${fmtRatio(s.sameHostGoalRatio)}`).join(', ')} of save + load, the rest one loopback message that wakes decode and the header walk` : ''}.`;
  return {
    body: blocks(
      main,
      sameHost && 'The same-host path in the same run (clock: saved on prefill → loaded on decode; `kv_ack` only releases prefill\'s file):',
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
      ['prompt tokens', 'reps', 'TTFT PD / colo (ms)', 'TPOT PD / colo (ms)', 'E2E PD / colo (ms)', 'TTFT ratio', 'TPOT ratio', 'E2E ratio'],
      rs.map((r) => [r.promptTokens, r.reps, `${fmt(r.pd.ttftMs.median)} / ${fmt(r.colo.ttftMs.median)}`, `${fmt(r.pd.tpotMs.median, 2)} / ${fmt(r.colo.tpotMs.median, 2)}`, `${fmt(r.pd.e2eMs.median)} / ${fmt(r.colo.e2eMs.median)}`, `**${fmtRatio(r.ratio.ttft)}**`, fmtRatio(r.ratio.tpot), fmtRatio(r.ratio.e2e)]),
    );
  const bd = s2.filter((r) => r.pdBreakdown);
  const st = s2.filter((r) => r.secondToken);
  const worst = s2.reduce((a, b) => (b.ratio.ttft > a.ratio.ttft ? b : a));
  const ref = s2u?.length ? s2u : s2;
  const refWorst = ref.reduce((a, b) => (b.ratio.ttft > a.ratio.ttft ? b : a));
  return {
    body: blocks(
      `Pinned (${s2[0]!.outputTokens} output tokens; ratios PD / colocated, > 1: PD slower):`,
      lowLoad(s2),
      bd.length ? "Where PD's TTFT goes (requests sent to the workers directly, after the interleaved ones): `prefill_ms` = prompt evaluation + first token + state save; `transfer_ms` = `kv_begin` → decode's `kv_ack`." : '',
      bd.length
        ? table(
            ['prompt tokens', 'colocated TTFT', 'PD prefill_ms', 'PD transfer_ms', 'state MiB', 'PD TTFT without router', 'PD TTFT via router'],
            bd.map((r) => [r.promptTokens, fmt(r.colo.ttftMs.median), fmt(r.pdBreakdown.prefillMs), fmt(r.pdBreakdown.transferMs), fmt(r.pdBreakdown.kvBytes / MiB, 1), fmt(r.pdBreakdown.directTtftMs), fmt(r.pd.ttftMs.median)]),
          )
        : '',
      st.length ? 'Token 1 → token 2 (medians over the same requests, ms; token 2 at: from the request):' : '',
      st.length
        ? table(
            ['prompt tokens', 'PD token 1 → 2', 'colocated token 1 → 2', 'colocated ITL', 'PD gap / colocated ITL', 'token 2 at, PD / colocated'],
            st.map((r) => [
              r.promptTokens,
              fmt(r.secondToken!.pdGapMs),
              fmt(r.secondToken!.coloGapMs),
              fmt(r.secondToken!.coloItlMs, 2),
              `**${fmtRatio(r.secondToken!.ratio)}** ${r.promptTokens >= 1500 ? (r.secondToken!.ratio <= 3 ? 'pass' : 'miss') : ''}`,
              r.secondToken!.pdAtMs !== undefined && r.secondToken!.coloAtMs !== undefined ? `${fmt(r.secondToken!.pdAtMs)} / ${fmt(r.secondToken!.coloAtMs)}` : '–',
            ]),
          )
        : '',
      s2u?.length ? `Unpinned (\`--no-pin\`); ${provUnpinned.replace(/^_|\.?_$/g, '').replace(/^[TF]/, (c) => c.toLowerCase())}:` : '',
      s2u?.length ? lowLoad(s2u) : '',
      failures(s2.flatMap((r) => r.errors)),
      img(plots, 's2-low-load.svg', 'PD vs colocated at low load'),
    ),
    reading:
      refWorst.ratio.ttft > 1.1
        ? `PD's TTFT is ${pct(refWorst.ratio.ttft)} at ${refWorst.promptTokens} prompt tokens${s2u?.length ? ' unpinned' : ''} (${pct(worst.ratio.ttft)} at ${worst.promptTokens} pinned): its first token streams from prefill before the transfer, so what it pays is the router hop, decode's registration before prefill evaluates, the state save when token 1 waits for it, and a process on another core.`
        : `PD's TTFT is within 1.10 × colocated at every length${s2u?.length ? ' unpinned' : ''}: its first token streams from prefill before the transfer, so the state's transfer and load are not on it (the save is, when token 1 waits for it: ≈ 0.5 % of TTFT)${worst.ratio.ttft > 1.1 ? ` (pinned: ${pct(worst.ratio.ttft)} at ${worst.promptTokens} tokens)` : ''}.`,
  };
}

/** §3: ITL and long-prompt TTFT, colocated and PD. */
function interferenceSection(s3: InterferenceResult | undefined, meta: SuiteMeta, plots: Plots): SectionText {
  if (!s3?.pd) return { body: NOT_RUN, reading: '' };
  const row = (name: string, x: InterferenceResult['pd']) => [name, fmt(x.itlMs.p50), fmt(x.itlMs.p90), fmt(x.itlMs.p99), fmt(x.itlMs.max, 0), x.stalls, fmt(x.tpotMs.p50), fmt(x.longTtftMs.p50, 0), fmt(x.longTtftMs.max, 0), `${x.longUnfinished ?? 0} / ${x.longSent ?? '?'}`, fmt(x.streamTokPerS, 0)];
  return {
    body: blocks(
      `${s3.streams} streams (${s3.streamPrompt}-token prompts, ${s3.streamOutput} output tokens, then the next request); after ${s3.settleMs / 1000} s a ${s3.longPrompt}-token prompt (${s3.longOutput} output tokens) every ${s3.periodMs / 1000} s; segments of ${s3.segmentMs / 1000} s, drain ${(s3.drainMs ?? 0) / 1000} s. PD: ${meta.config.pinned ? 'prefill pinned to CPU 0, decode to CPU 1' : 'not pinned'}; colocated: one process, unpinned.`,
      table(['', 'ITL p50 ms', 'ITL p90 ms', 'ITL p99 ms', 'ITL max ms', 'gaps > 100 ms', 'stream TPOT p50 ms', 'long TTFT p50 ms', 'long TTFT max ms', 'long without 1st token', 'stream tok/s'], [row('colocated', s3.colo), row('PD', s3.pd)]),
      `Colocated / PD: ITL p50 ${fmtRatio(s3.ratio.itlP50)}, ITL p99 **${fmtRatio(s3.ratio.itlP99)}**, long-prompt TTFT p50 ${fmtRatio(s3.ratio.longTtftP50)}.`,
      img(plots, 's3-itl-over-time.svg', 'ITL over time, colocated vs PD'),
    ),
    reading:
      s3.ratio.itlP99 > 1.5
        ? `Long prefills stall every colocated decoder (ITL p99 ${fmt(s3.colo.itlMs.p99)} ms) while PD's decoder keeps its pace (${fmt(s3.pd.itlMs.p99)} ms)${s3.ratio.longTtftP50 < 1 ? `; the long prompts themselves wait longer under PD (TTFT p50 ${fmt(s3.pd.longTtftMs.p50, 0)} against ${fmt(s3.colo.longTtftMs.p50, 0)} ms): their state is saved, sent and loaded` : ''}.`
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
      `${s4[0]!.outputTokens} output tokens per stream, ${s4[0]!.promptTokens ?? 32}-token prompts; direct: ${s4r.directSequences ?? meta.config.decodeSlots} sequences, context ${meta.config.contextSize}, 1 thread${meta.config.pinned ? ', pinned like the decode worker' : ''}; wall tokens/s = all output tokens / (first request → last token).`,
      table(
        ['streams', 'reps', 'pdserve tok/s', 'direct tok/s', 'pdserve / direct', 'pdserve wall tok/s', 'direct wall tok/s'],
        s4.map((r) => [r.streams, r.reps, fmt(r.pdTokPerS, 0), fmt(r.directTokPerS, 0), `**${fmtRatio(r.ratio)}**`, fmt(r.pdWallTokPerS, 0), fmt(r.directWallTokPerS, 0)]),
      ),
      ct ? `Engine contention probe: a ${ct.stateTokens}-token state load and the reuse of a just-released slot, idle and while ${ct.streams} other sequences generate ${ct.outputLen} tokens each:` : '',
      ct
        ? table(
            ['', 'idle (ms)', `while ${ct.streams} sequences decode (ms)`, 'streams finished by then', 'last stream ended (ms)'],
            [
              ['loadState', fmt(ct.idleLoadMs), fmt(ct.busyLoadMs), `${ct.finishedAtLoad} / ${ct.streams}`, fmt(ct.loadStreamsEndMs, 0)],
              ['reuse a released slot', fmt(ct.idleReuseMs), fmt(ct.busyReuseMs), `${ct.finishedAtReuse} / ${ct.streams}`, fmt(ct.reuseStreamsEndMs, 0)],
            ],
          )
        : '',
      ct && (ct.finishedAtLoad === ct.streams || ct.finishedAtReuse === ct.streams) ? '**The load or the reuse waited for every other sequence to finish**: the engine holds the context lock across consecutive batches.' : '',
      partial ? `In ${partial} run(s) the streams never all overlapped; their rate is over the whole span.` : '',
      failures(s4.flatMap((r) => r.errors)),
      img(plots, 's4-batching.svg', 'decode batching'),
    ),
    reading: `pdserve reaches ${s4.map((r) => `${fmtRatio(r.ratio)} at ${r.streams} stream${r.streams > 1 ? 's' : ''}`).join(', ')} of the engine driven directly.`,
  };
}

/** §5: TTFT, ITL and E2E through the router and directly, warm and cold prompts. */
function routerSection(s5: RouterOverheadResult | undefined, plots: Plots): SectionText {
  if (!s5?.router) return { body: NOT_RUN, reading: '' };
  const rows5 = (x: RouterOverheadRun) => [
    ['through router (ms)', fmt(x.router.ttftMs.p50), fmt(x.router.ttftMs.p99), fmt(x.router.itlMs.p50, 2), fmt(x.router.e2eMs.p50), fmt(x.router.e2eMs.p99)],
    ['workers directly (ms)', fmt(x.direct.ttftMs.p50), fmt(x.direct.ttftMs.p99), fmt(x.direct.itlMs.p50, 2), fmt(x.direct.e2eMs.p50), fmt(x.direct.e2eMs.p99)],
    ['**added by the router (ms)**', `**${fmt(x.addedMs.ttftP50)}**`, `**${fmt(x.addedMs.ttftP99)}**`, fmt(x.addedMs.itlP50, 2), `**${fmt(x.addedMs.e2eP50)}**`, `**${fmt(x.addedMs.e2eP99)}**`],
    ['router / direct', fmtRatio(x.ratio.ttftP50), '', '', fmtRatio(x.ratio.e2eP50), ''],
  ];
  const head5 = ['', 'TTFT p50', 'TTFT p99', 'ITL p50', 'E2E p50', 'E2E p99'];
  const w = s5.warm;
  const allHits = w && w.cacheHits.router === w.reps && w.cacheHits.direct === w.reps;
  return {
    body: blocks(
      w ? `**Warm prompts** (the verdict): ${w.reps} requests each way, ${s5.promptTokens}-token prompts, ${s5.outputTokens} output tokens; prefix-cache hits ${w.cacheHits.router}/${w.reps} through the router, ${w.cacheHits.direct}/${w.reps} directly${allHits ? '' : ' — **not all hits: cold samples are mixed in**'}.` : '',
      w ? table(head5, rows5(w)) : '',
      w ? failures(w.errors) : '',
      `**Cold prompts**: ${s5.reps} requests each way, every prompt new to prefill.`,
      table(head5, rows5(s5)),
      failures(s5.errors),
      img(plots, 's5-router-overhead.svg', 'router overhead'),
    ),
    reading: w ? `The router adds ${fmt(w.addedMs.ttftP50)} ms to TTFT p50 and ${fmt(w.addedMs.ttftP99)} ms to p99 with warm prompts (p99 over this many samples is near the maximum, so it is noisy).` : `The router adds ${fmt(s5.addedMs.ttftP50)} ms to TTFT p50 and ${fmt(s5.addedMs.ttftP99)} ms to p99 (cold prompts only).`,
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
        ['rate req/s', 'prompts', 'goodput PD', 'goodput colo', 'throughput PD / colo (req/s)', 'TTFT p50 PD / colo (ms)', 'TTFT p99 PD / colo (ms)', 'TPOT p50 PD / colo (ms)', 'TPOT p99 PD / colo (ms)', 'failed'],
        s6.rows.map((r) => [r.rate, r.numPrompts, `**${fmt(r.pd.goodput, 2)}**`, `**${fmt(r.colo.goodput, 2)}**`, `${fmt(r.pd.requestThroughput, 2)} / ${fmt(r.colo.requestThroughput, 2)}`, `${fmt(r.pd.ttftMs.p50, 0)} / ${fmt(r.colo.ttftMs.p50, 0)}`, `${fmt(r.pd.ttftMs.p99, 0)} / ${fmt(r.colo.ttftMs.p99, 0)}`, `${fmt(r.pd.tpotMs.p50, 1)} / ${fmt(r.colo.tpotMs.p50, 1)}`, `${fmt(r.pd.tpotMs.p99, 1)} / ${fmt(r.colo.tpotMs.p99, 1)}`, r.pd.failed + r.colo.failed]),
      ),
      img(plots, 's6-goodput.svg', 'goodput vs request rate'),
      img(plots, 's6-latency.svg', 'P99 TPOT vs request rate'),
    ),
    reading: `${lose.length ? `PD's goodput is below colocated's at ${lose.map((r) => `${r.rate} req/s`).join(', ')}` : "PD's goodput is not clearly below colocated's at any rate"}; ${win.length ? `above it at ${win.map((r) => `${r.rate} req/s`).join(', ')}` : 'not clearly above it at any rate'} (differences under 5 % or 0.02 req/s count as equal): with one prefill worker on one core both saturate on prompt evaluation, and PD's decoding does not wait for it.`,
  };
}

/** "Where PD loses": every figure of the report where PD is behind. */
function losses(s1: KvSectionResult | undefined, s2: LowLoadRow[] | undefined, s3: InterferenceResult | undefined, s4: BatchingRow[] | undefined, s5: RouterOverheadResult | undefined, s6: ScalingResult | undefined, s7: AgentsResult | undefined, s7scale?: AgentsScaleResult, s7trace?: AgentTraceResult): string[] {
  const out: string[] = [];
  if (s2?.length) for (const r of s2) if (r.ratio.ttft > 1.05) out.push(`Unloaded TTFT at ${r.promptTokens} prompt tokens: ${pct(r.ratio.ttft)} (${fmt(r.pd.ttftMs.median, 0)} vs ${fmt(r.colo.ttftMs.median, 0)} ms).`);
  if (s2?.length) for (const r of s2) if (r.ratio.tpot > 1.05) out.push(`Unloaded TPOT at ${r.promptTokens} prompt tokens: ${pct(r.ratio.tpot)} (${fmt(r.pd.tpotMs.median, 2)} vs ${fmt(r.colo.tpotMs.median, 2)} ms).`);
  if (s1?.sizes?.length) out.push(`Moving the state costs ${s1.sizes.map((s) => `${fmt(s.kvMs.median, 0)} ms at ${mib(s.blobBytes)}`).join(', ')}, ${fmtRatio(Math.min(...s1.sizes.map((s) => s.ratio)))}–${fmtRatio(Math.max(...s1.sizes.map((s) => s.ratio)))} a bare socket; a colocated server pays none of it.`);
  if (s3?.pd && s3.ratio.longTtftP50 < 1) out.push(`Long-prompt TTFT under interference: ${fmt(s3.pd.longTtftMs.p50, 0)} ms PD vs ${fmt(s3.colo.longTtftMs.p50, 0)} ms colocated (p50).`);
  if (s3?.pd && s3.ratio.itlP50 < 1) out.push(`Median ITL under interference: ${fmt(s3.pd.itlMs.p50)} ms PD vs ${fmt(s3.colo.itlMs.p50)} ms colocated.`);
  if (s4?.length) for (const r of s4) if (r.ratio < 0.95) out.push(`Decode throughput with ${r.streams} stream(s): pdserve reaches ${fmtRatio(r.ratio)} of node-llama-cpp driven directly.`);
  if (s5?.router && (s5.warm ? s5.warm.addedMs.ttftP50 > 0 : s5.addedMs.e2eP50 > 0)) out.push(`The router hop: ${s5.warm ? `+${fmt(s5.warm.addedMs.ttftP50)} ms TTFT at p50 with prefill-cached prompts; with cold prompts ` : ''}+${fmt(s5.addedMs.ttftP50)} ms TTFT, +${fmt(s5.addedMs.e2eP50)} ms E2E at p50.`);
  if (s6?.rows?.length) for (const r of s6.rows) if (clearlyBelow(r.pd.goodput, r.colo.goodput)) out.push(`Goodput at ${r.rate} req/s: ${fmt(r.pd.goodput, 2)} vs ${fmt(r.colo.goodput, 2)} req/s.`);
  if (s7?.runs?.length) for (const g of agentGoals(s7)) if (!g.met) out.push(`Multi-round agents: ${g.goal} missed (${g.detail}).`);
  if (s7scale?.runs?.length) for (const g of agentsScaleGoals(s7scale)) if (!g.met) out.push(`Agents at scale: ${g.goal} missed (${g.detail}).`);
  if (s7trace?.runs?.length) for (const g of agentTraceGoals(s7trace)) if (!g.met) out.push(`${g.goal[0]!.toUpperCase()}${g.goal.slice(1)} missed (${g.detail}).`);
  out.push('Resources: PD needs two model copies (prefill and decode each load the GGUF) and, here, two cores where the colocated server used one.');
  return out;
}

/**
 * The serving goals as rows of [goal, measured, verdict] from this report's sections (each
 * measured side by side in one run; the handoff's goals are report-kv.ts `handoffGoals`). A goal
 * whose section has no figures says so instead of passing.
 */
function servingGoals(s2: LowLoadRow[] | undefined, s2u: LowLoadRow[] | undefined, s3: InterferenceResult | undefined, s4: BatchingRow[] | undefined, s5: RouterOverheadResult | undefined): string[][] {
  const rows: string[][] = [];
  const verdict = (ok: boolean | undefined) => (ok === undefined ? 'not measured' : ok ? '**pass**' : '**miss**');
  for (const [name, rs] of [['pinned', s2], ['unpinned', s2u]] as const) {
    if (!rs?.length) continue;
    rows.push([`PD TTFT ≤ 1.10 × colocated at 64 / 512 / 1500 prompt tokens, low load (§2, ${name})`, rs.map((r) => `${r.promptTokens}: ${fmtRatio(r.ratio.ttft)}`).join(', '), verdict(rs.every((r) => r.ratio.ttft <= 1.1))]);
    rows.push([`PD E2E (32 output tokens) ≤ 1.15 × colocated (§2, ${name})`, rs.map((r) => `${r.promptTokens}: ${fmtRatio(r.ratio.e2e)}`).join(', '), verdict(rs.every((r) => r.ratio.e2e <= 1.15))]);
  }
  if (s5?.warm) {
    const w = s5.warm;
    const hits = w.cacheHits.router < w.reps || w.cacheHits.direct < w.reps ? ` (prefix-cache hits only ${w.cacheHits.router}/${w.reps} through the router, ${w.cacheHits.direct}/${w.reps} directly: some samples were cold)` : '';
    rows.push(['router adds ≤ 3 ms to TTFT p99 (§5; verdict from the warm-prompt run; its p50 is shown, not judged)', `warm prompts: p99 ${fmt(w.addedMs.ttftP99)} ms, p50 ${fmt(w.addedMs.ttftP50)} ms${hits}; cold prompts: p99 ${fmt(s5.addedMs.ttftP99)} ms, p50 ${fmt(s5.addedMs.ttftP50)} ms`, verdict(w.addedMs.ttftP99 <= 3)]);
  } else if (s5?.addedMs) rows.push(['router adds ≤ 3 ms to TTFT p99 (§5, cold prompts only; its p50 is shown, not judged)', `p99 ${fmt(s5.addedMs.ttftP99)} ms, p50 ${fmt(s5.addedMs.ttftP50)} ms`, verdict(s5.addedMs.ttftP99 <= 3)]);
  else rows.push(['router adds ≤ 3 ms to TTFT p99 (§5)', 'n/a', 'not measured']);
  if (s4?.length) rows.push(['decode ≥ 0.9 × direct node-llama-cpp at 1, 4, 8 streams (§4)', s4.map((r) => `${r.streams}: ${fmtRatio(r.ratio)}`).join(', '), verdict(s4.every((r) => r.ratio >= 0.9))]);
  if (s3?.ratio) rows.push(['under prefill interference, PD ITL p99 ≤ 0.2 × colocated (§3)', `PD / colocated ${fmtRatio(1 / s3.ratio.itlP99)}`, verdict(1 / s3.ratio.itlP99 <= 0.2)]);
  return rows;
}
