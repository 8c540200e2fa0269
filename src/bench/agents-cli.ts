/**
 * `pdserve bench-agents` (trace mode): build or load the trace, replay it on the stacks this
 * command starts (PD, colocated, PD without reuse) or on `--target` endpoints, print the
 * job-level table and goals, optionally save it as BENCHMARKS.md §7's agent-trace subsection.
 */
import { mkdirSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import { join, resolve } from 'node:path';
import { ConfigError } from '../base/errors.js';
import { ensureModel } from '../engine/gguf-writer.js';
import { replayOnTargets, runTraceSetups, TRACE_SETUPS, type ReplayRun, type ReplayTarget, type TraceSetup } from './agent-replay.js';
import { BlockText, generateSessions, GENERATE_DEFAULTS, inputTokens, loadTrace, sessionsOf, traceJsonl, type AgentTrace, type GenerateOptions } from './agent-trace.js';
import { loadAgentCorpus } from './agents.js';
import { benchAgent, loadTokenizer, REPO_ROOT, type BenchTokenizer } from './index.js';
import { agentTraceGoals, agentTraceReport, type AgentTraceResult } from './report-agent-trace.js';
import { gitCommit, renderOnly, SECTION_FILES } from './suite.js';
import { median, say } from './util.js';

/** Options of the trace mode, as the CLI parses them. */
export interface TraceCliOptions extends Partial<GenerateOptions> {
  /** GGUF, or 'tiny' / 'small' (generated). */
  model: string;
  trace?: string;
  blockSize: number;
  targets: string[];
  setups: string;
  repeats: number;
  decode: number;
  decodeSlots: number;
  ctxSize?: number;
  batchSize: number;
  endpoint: 'chat' | 'completions';
  tokenizer?: string;
  sessionKey: boolean;
  timeScale: number;
  timeoutMs: number;
  deadlineS: number;
  writeTrace?: string;
  json?: string;
  save: boolean;
  engineArgs: string[];
  argv: string[];
}

/** The trace's scale, for the report. */
export function traceScale(trace: AgentTrace): AgentTraceResult['scale'] {
  const sessions = sessionsOf(trace);
  const top = [...sessions.values()].filter((rs) => rs[0]!.parent === undefined);
  const prompts = trace.requests.map(inputTokens);
  const out = trace.requests.reduce((a, r) => a + r.outputTokens, 0);
  return {
    sessions: sessions.size,
    topSessions: top.length,
    requests: trace.requests.length,
    turnsMedian: median(top.map((rs) => rs.length)),
    turnsMax: Math.max(...top.map((rs) => rs.length)),
    promptMedian: median(prompts),
    promptMax: Math.max(...prompts),
    ioRatio: out > 0 ? prompts.reduce((a, b) => a + b, 0) / out : NaN,
  };
}

const loads = () => os.loadavg().map((x) => Math.round(x * 100) / 100);

/**
 * Run the trace mode; returns the exit code (1 when a request failed).
 * @throws ConfigError on a bad trace, setup name or target.
 */
export async function benchAgentsTraceCli(o: TraceCliOptions): Promise<number> {
  const loadStart = loads();
  const gen: Partial<GenerateOptions> = {};
  for (const k of Object.keys(GENERATE_DEFAULTS) as (keyof GenerateOptions)[]) if (o[k] !== undefined) gen[k] = o[k] as never;
  const trace = o.trace ? loadTrace(resolve(o.trace), o.blockSize) : generateSessions(gen);
  const scale = traceScale(trace);
  say(`bench-agents: ${trace.source}: ${scale.topSessions} sessions and ${scale.sessions - scale.topSessions} sub-agent sessions, ${scale.requests} requests, turns median ${scale.turnsMedian} / max ${scale.turnsMax}, prompt tokens median ${scale.promptMedian} / max ${scale.promptMax}, input:output ${scale.ioRatio.toFixed(0)}:1`);
  if (o.writeTrace) writeFileSync(o.writeTrace, traceJsonl(trace, o.blockSize));
  const modelName = o.model;
  const gguf = o.targets.length ? (o.tokenizer ? resolve(o.tokenizer) : undefined) : modelName === 'tiny' || modelName === 'small' ? await ensureModel(modelName, 1) : resolve(modelName);
  let tok: BenchTokenizer | undefined;
  if (gguf) tok = await loadTokenizer(gguf);
  else say('bench-agents: no --tokenizer: block lengths are estimated at 4 characters a token');
  const corpusText = loadAgentCorpus();
  const corpus = { text: corpusText, ...(tok ? { ids: tok.encode(corpusText) } : {}) };
  const textFor = (salt: number) => new BlockText(corpus, salt, tok);
  const ctxSize = o.ctxSize ?? Math.ceil((scale.promptMax + Math.max(...trace.requests.map((r) => r.outputTokens)) + 512) / 1024) * 1024;
  const common = { repeats: o.repeats, endpoint: o.endpoint, textFor, timeScale: o.timeScale, timeoutMs: o.timeoutMs, deadlineMs: o.deadlineS * 1000, sessionKey: o.sessionKey };
  let runs: ReplayRun[];
  try {
    if (o.targets.length) {
      const targets: ReplayTarget[] = o.targets.map((t, i) => {
        const eq = t.indexOf('=');
        const [name, url] = eq > 0 && !t.slice(0, eq).includes('/') ? [t.slice(0, eq), t.slice(eq + 1)] : [`target ${i + 1}`, t];
        if (!/^https?:\/\//.test(url)) throw new ConfigError(`--target ${t}: give a base URL (http://HOST:PORT), optionally as NAME=URL`);
        return { setup: `target${i + 1}`, name, url: url.replace(/\/+$/, '').replace(/\/v1$/, '') };
      });
      const dispatcher = benchAgent(512);
      try {
        runs = await replayOnTargets(trace, targets, { ...common, dispatcher });
      } finally {
        await dispatcher.close().catch(() => {});
      }
    } else {
      const setups = o.setups.split(',').map((s) => s.trim()) as TraceSetup[];
      for (const s of setups) if (!TRACE_SETUPS.includes(s)) throw new ConfigError(`--setups: ${s} is not one of ${TRACE_SETUPS.join(', ')}`);
      runs = await runTraceSetups({ ...common, trace, model: gguf!, setups, decode: o.decode, decodeSlots: o.decodeSlots, ctxSize, batchSize: o.batchSize, engineArgs: o.engineArgs });
    }
  } finally {
    await tok?.dispose().catch(() => {});
  }
  const command = `pdserve ${o.argv.slice(2).join(' ')}`;
  const result: AgentTraceResult = { source: trace.source, model: o.targets.length ? 'target' : modelName, decode: o.decode, command, scale, load: { start: loadStart, end: loads(), cores: os.cpus().length }, timeScale: o.timeScale, runs };
  console.log(agentTraceReport(result, '', undefined).join('\n'));
  // the goals compare PD with and without reuse: judged only where a PD stack ran
  if (runs.some((r) => r.setup === 'pd')) for (const g of agentTraceGoals(result)) console.log(`${g.met ? 'met   ' : 'MISSED'} ${g.goal}: ${g.detail}`);
  const replacer = (_k: string, v: unknown) => (typeof v === 'number' && !Number.isFinite(v) ? null : v);
  if (o.json) writeFileSync(o.json, JSON.stringify(result, replacer, 1) + '\n');
  if (o.save) {
    const dir = join(REPO_ROOT, 'bench', 'results');
    mkdirSync(dir, { recursive: true });
    // the per-request records stay in --json: the checkout keeps the summaries
    const file = { section: 72, meta: { date: new Date().toISOString(), quick: false, commit: gitCommit(), seconds: Math.round(runs.reduce((a, r) => a + r.wallMs, 0) / 1000), loadavg: loads() }, result: { ...result, runs: runs.map((r) => ({ ...r, records: [] })) } };
    writeFileSync(join(dir, SECTION_FILES[72]!), JSON.stringify(file, replacer, 1) + '\n');
    renderOnly(dir, join(REPO_ROOT, 'bench', 'plots'), REPO_ROOT);
  }
  return runs.some((r) => r.failed > 0) ? 1 : 0;
}
