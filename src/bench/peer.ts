/**
 * Bench section 8, "against llama-server": llama.cpp's own server (./llama-server.ts) beside
 * pdserve on the same generated model, the same llama.cpp threads and the same slots, in one
 * invocation, interleaved (the order rotates every point), through the same client:
 *
 * | system | processes | llama.cpp threads | slots |
 * |---|---|---|---|
 * | `llama` | llama-server `-t 2 -np 8 --no-kv-unified --cache-ram 2048` | 2 | 8 |
 * | `colo` | pdserve colocated `--threads 2 --slots 8` | 2 | 8 |
 * | `pd` | pdserve router (cache_aware) + 1 prefill + 2 decode (4 slots each) | 1 each | 8 |
 *
 * Two workloads: a uniform sweep (N streams of fixed-length random prompts, 64 tokens out) and
 * the agent workload (30 sessions × 6 rounds of ./agents.ts's conversations). Both go through
 * /v1/completions with one rendered prompt text, so every system evaluates the same tokens
 * (the generated model has no chat template, and the two servers' fallback chat formats
 * differ). CPU seconds per request are read from /proc per process (./cpu.ts).
 */
import { mkdirSync, mkdtempSync } from 'node:fs';
import os from 'node:os';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import type { Dispatcher } from 'undici';
import { ConfigError, PdError } from '../base/errors.js';
import { summarize, type Summary } from '../observe/stats.js';
import { Cluster } from '../up/cluster.js';
import { conversations, streamedRound, type Conversation, type StreamedRound } from './agents.js';
import { processCpuSeconds } from './cpu.js';
import { benchAgent, buildPrompts, discoverModel, loadTokenizer, runBench, type BenchTarget, type BenchTokenizer } from './index.js';
import { ensureLlamaServer, startLlamaServer, type LlamaServerProc } from './llama-server.js';
import { PHASES, processPhases, type PhaseProfileResult } from './profile.js';
import { fmt, fmtRatio, median, say } from './util.js';

export type PeerSystem = 'llama' | 'colo' | 'pd';
export const PEER_SYSTEMS: readonly PeerSystem[] = ['llama', 'colo', 'pd'];
export const PEER_NAMES: Record<PeerSystem, string> = { llama: 'llama-server', colo: 'pdserve colocated', pd: 'pdserve PD 1+2' };

/** A process of a system and its CPU share of a run. */
export type CpuPerRequest = Record<string, number>;

/** One uniform point of one system. Times in ms. */
export interface UniformRun {
  system: PeerSystem;
  streams: number;
  promptTokens: number;
  rep: number;
  requests: number;
  failed: number;
  reqPerS: number;
  ttft: Summary;
  tpot: Summary;
  /** CPU ms per completed request, per process (`llama-server`, `colocated`, `router`, `prefill-0`, `decode-0`, …). */
  cpuMsPerRequest: CpuPerRequest;
  /** 1-minute load average when the run ended. */
  load: number;
}

/** One agent-workload run of one system. Times in ms. */
export interface PeerAgentRun {
  system: PeerSystem;
  rep: number;
  sessions: number;
  rounds: number;
  /** First request → last session done, s. */
  wallS: number;
  /** Median session duration, s. */
  sessionP50S: number;
  ttft: Summary;
  /** TTFT p90 per round (index 0 = round 1). */
  ttftP90ByRound: number[];
  tpot: Summary;
  /** Cached / prompt tokens over rounds 2+. */
  cachedShare: number;
  failed: number;
  reqPerS: number;
  cpuMsPerRequest: CpuPerRequest;
  load: number;
}

export interface PeerResult {
  /** Set when the peer could not be built here: the section was not measured. */
  skipped?: string;
  llamaCppTag?: string;
  llamaServerArgs?: string[];
  /** The generated model's preset ('small', or 'tiny': overhead-bound). */
  modelName?: string;
  config: { contextPerSlot: number; outputTokens: number; agentSessions: number; agentRounds: number; reps: number; streams: number[]; promptTokens: number[] };
  uniform: UniformRun[];
  agents: PeerAgentRun[];
  /** The per-phase profile (PDSERVE_BENCH_PEER_PROFILE=1), saved as its own file. */
  profile?: PhaseProfileResult;
}

export interface PeerOptions {
  model: string;
  /** The generated model's preset, for the report. */
  modelName: string;
  quick: boolean;
  /** Prompt chunk of pdserve's processes (`--batch-size`). */
  batchSize: number;
  timeoutMs?: number;
}

/** A comma list of positive integers from the environment, or `dflt`. @throws on anything else. */
function envList(name: string, dflt: number[]): number[] {
  const v = process.env[name];
  if (v === undefined || v.trim() === '') return dflt;
  const xs = v.split(',').map((x) => Number(x.trim()));
  if (!xs.every((n) => Number.isSafeInteger(n) && n >= 1 && n <= 4096)) throw new ConfigError(`${name}=${JSON.stringify(v)}: give positive integers, e.g. "1,8"`);
  return xs;
}

/** The agent prompt text of `messages` (one format for every system; ends where the reply starts). */
export function renderAgentPrompt(messages: readonly { role: 'system' | 'user' | 'assistant'; content: string }[]): string {
  let s = '';
  for (const m of messages) s += m.role === 'system' ? `${m.content}\n\n` : `### ${m.role === 'user' ? 'User' : 'Assistant'}\n${m.content}\n\n`;
  return `${s}### Assistant\n`;
}

type RoundResult = StreamedRound;

/** One streamed /v1/completions round (TPOT NaN below 2 output tokens). Never rejects. */
function completionRound(url: string, model: string, prompt: string, maxTokens: number, dispatcher: Dispatcher, timeoutMs: number): Promise<RoundResult> {
  return streamedRound(url, '/v1/completions', { model, prompt, max_tokens: maxTokens, temperature: 0, ignore_eos: true }, { dispatcher, timeoutMs, tpotIfOne: NaN });
}

/**
 * The pdserve side of §8, as llama-server's threads and slots are matched: PD 1 prefill (1 slot)
 * + 2 decode (4 slots) at 1 llama.cpp thread each behind a `cache_aware` router, and a colocated
 * server at 2 threads and 8 slots; `ctxSize` tokens per slot, logs under `logDir`, `nodeArgs` for
 * every pdserve process (the profile's `--cpu-prof`).
 */
function peerCluster(o: PeerOptions, ctxSize: number, logDir: string, nodeArgs?: string[]): Cluster {
  return new Cluster({
    model: o.model,
    prefill: 1,
    decode: 2,
    colocated: true,
    threads: 1,
    ctxSize,
    batchSize: o.batchSize,
    decodeSlots: 4,
    prefillSlots: 1,
    logDir,
    startTimeoutMs: 120_000,
    ...(nodeArgs ? { nodeArgs } : {}),
    extraArgs: { router: ['--decode-policy', 'cache_aware'], colocated: ['--threads', '2', '--slots', '8'] },
  });
}

/** The processes of one system, by name, with their pids. */
type Procs = { name: string; pid: number | undefined }[];

function cpuOf(procs: Procs): Record<string, number> {
  return Object.fromEntries(procs.map((p) => [p.name, processCpuSeconds(p.pid)]));
}

function cpuPerRequest(before: Record<string, number>, after: Record<string, number>, done: number): CpuPerRequest {
  const out: CpuPerRequest = {};
  for (const k of Object.keys(after)) out[k] = done > 0 ? ((after[k]! - before[k]!) * 1000) / done : NaN;
  return out;
}

const load1 = () => Math.round(os.loadavg()[0]! * 100) / 100;

/**
 * Run `convs` at once against `url`, `rounds` rounds each, the prompt growing by the tool result
 * and the reply every round.
 */
export async function runAgentSessions(url: string, model: string, convs: readonly Conversation[], o: { rounds: number; outputTokens: number; dispatcher: Dispatcher; timeoutMs: number }): Promise<{ wallMs: number; sessionMs: number[]; rounds: (RoundResult & { round: number })[] }> {
  const t0 = performance.now();
  const all: (RoundResult & { round: number })[] = [];
  const sessionMs: number[] = [];
  await Promise.all(
    convs.map(async (c) => {
      const s0 = performance.now();
      const messages: { role: 'system' | 'user' | 'assistant'; content: string }[] = [{ role: 'system', content: c.system }];
      for (let round = 1; round <= o.rounds; round++) {
        messages.push({ role: 'user', content: `Tool result ${round}:\n${c.tools[round - 1]}` });
        const r = await completionRound(url, model, renderAgentPrompt(messages), o.outputTokens, o.dispatcher, o.timeoutMs);
        all.push({ ...r, round });
        if (!r.ok) return;
        messages.push({ role: 'assistant', content: r.text });
      }
      sessionMs.push(performance.now() - s0);
    }),
  );
  return { wallMs: performance.now() - t0, sessionMs, rounds: all };
}

/**
 * Section 8. Builds (or finds) llama-server, starts it and one pdserve cluster (PD + colocated),
 * runs the uniform sweep and the agent workload with the systems interleaved, stops them.
 * Environment (an engineer's narrower run): PDSERVE_BENCH_PEER_STREAMS, PDSERVE_BENCH_PEER_PROMPTS
 * (comma lists), PDSERVE_BENCH_PEER_REPS, PDSERVE_BENCH_PEER_AGENTS ("sessions,rounds",
 * "0" skips the agent workload).
 * @returns `{ skipped }` (and nothing measured) when llama-server cannot be built here.
 * @throws when a server cannot start or the build fails.
 */
export async function runPeerSection(o: PeerOptions): Promise<PeerResult> {
  const contextPerSlot = 4096; // a 2048-token prompt and its output fit one slot
  const outputTokens = 64;
  const streams = envList('PDSERVE_BENCH_PEER_STREAMS', o.quick ? [1, 8] : [1, 4, 8, 16]);
  const promptTokens = envList('PDSERVE_BENCH_PEER_PROMPTS', o.quick ? [128] : [128, 512, 2048]);
  const reps = envList('PDSERVE_BENCH_PEER_REPS', [o.quick ? 1 : 2])[0]!;
  const agentsEnv = process.env.PDSERVE_BENCH_PEER_AGENTS;
  const [agentSessions, agentRounds] = agentsEnv === '0' ? [0, 0] : agentsEnv ? envList('PDSERVE_BENCH_PEER_AGENTS', []) : o.quick ? [4, 2] : [30, 6];
  const config = { contextPerSlot, outputTokens, agentSessions: agentSessions ?? 0, agentRounds: agentRounds ?? 0, reps, streams, promptTokens };
  const bin = await ensureLlamaServer({ log: say, jobs: 2 });
  if ('skipped' in bin) {
    say(bin.skipped);
    return { skipped: bin.skipped, config, uniform: [], agents: [] };
  }
  const timeoutMs = o.timeoutMs ?? 600_000;
  const logDir = mkdtempSync(join(os.tmpdir(), 'pdserve-bench-peer-'));
  const cluster = peerCluster(o, contextPerSlot, logDir);
  const dispatcher = benchAgent(128);
  const tok: BenchTokenizer = await loadTokenizer(o.model);
  let peer: LlamaServerProc | undefined;
  try {
    say(`section 8: starting llama-server ${bin.tag} and pdserve (PD 1 prefill + 2 decode, colocated); logs in ${logDir}`);
    peer = await startLlamaServer({ binary: bin.binary, model: o.model, threads: 2, slots: 8, contextPerSlot, cacheRamMiB: 2048, logFile: join(logDir, 'llama-server.log') });
    await cluster.start();
    const urls: Record<PeerSystem, string> = { llama: peer.url, colo: cluster.colocated!.url, pd: cluster.router.url };
    const procs: Record<PeerSystem, Procs> = {
      llama: [{ name: 'llama-server', pid: peer.child.pid }],
      colo: [{ name: 'colocated', pid: cluster.colocated!.child?.pid }],
      pd: cluster.procs.filter((p) => p.role !== 'colocated').map((p) => ({ name: p.name, pid: p.child?.pid })),
    };
    const models: Record<PeerSystem, string> = { llama: await discoverModel(urls.llama, dispatcher), colo: await discoverModel(urls.colo, dispatcher), pd: await discoverModel(urls.pd, dispatcher) };
    for (const s of PEER_SYSTEMS) {
      const w = await completionRound(urls[s], models[s], 'Warm up: once upon a time', 8, dispatcher, 60_000);
      if (!w.ok) throw new PdError('START_FAILED', `warm-up request failed (${PEER_NAMES[s]}): ${w.error}`);
    }
    const uniform: UniformRun[] = [];
    const agents: PeerAgentRun[] = [];
    let turn = 0;
    const order = () => {
      const k = turn++;
      return PEER_SYSTEMS.map((_, i) => PEER_SYSTEMS[(i + k) % PEER_SYSTEMS.length]!);
    };
    for (let rep = 0; rep < reps; rep++) {
      for (const p of promptTokens) {
        for (const n of streams) {
          for (const s of order()) {
            const target: BenchTarget = { kind: 'openai', url: urls[s], endpoint: 'completions', model: models[s] };
            // fresh prompts per system and repetition: no run reuses another's prefix
            const prompts = buildPrompts({ dataset: 'random', numPrompts: Math.max(6, 2 * n), inputLen: p, outputLen: outputTokens, seed: 1000 * rep + 100 * PEER_SYSTEMS.indexOf(s) + n + p * 7, tokenizer: tok });
            const c0 = cpuOf(procs[s]);
            const r = await runBench({ target, prompts, requestRate: Infinity, maxConcurrency: n, seed: rep, warmup: 0, timeoutMs, progress: false, dispatcher, label: `${s} ${n}×${p}` });
            const c1 = cpuOf(procs[s]);
            const run: UniformRun = { system: s, streams: n, promptTokens: p, rep, requests: prompts.length, failed: r.metrics.failed, reqPerS: r.metrics.requestThroughput, ttft: r.metrics.ttftMs, tpot: r.metrics.tpotMs, cpuMsPerRequest: cpuPerRequest(c0, c1, r.metrics.completed), load: load1() };
            uniform.push(run);
            say(`  uniform ${p} tokens × ${n} streams, ${PEER_NAMES[s]}: ${fmt(run.reqPerS, 2)} req/s, TTFT p50 ${fmt(run.ttft.p50, 0)} ms, TPOT p50 ${fmt(run.tpot.p50, 1)} ms p99 ${fmt(run.tpot.p99, 1)} ms, failed ${run.failed}, CPU ms/req ${Object.entries(run.cpuMsPerRequest).map(([k, v]) => `${k} ${fmt(v, 0)}`).join(' / ')}, load ${run.load}`);
          }
        }
      }
      if (agentSessions && agentRounds) {
        for (const s of order()) {
          const convs = conversations(tok, agentSessions, agentRounds, `peer-${s}-r${rep}`, 120, 150);
          const c0 = cpuOf(procs[s]);
          const a = await runAgentSessions(urls[s], models[s], convs, { rounds: agentRounds, outputTokens: 24, dispatcher, timeoutMs });
          const c1 = cpuOf(procs[s]);
          const ok = a.rounds.filter((x) => x.ok);
          const later = ok.filter((x) => x.round >= 2);
          const prompt = later.reduce((acc, x) => acc + x.promptTokens, 0);
          const run: PeerAgentRun = {
            system: s,
            rep,
            sessions: agentSessions,
            rounds: agentRounds,
            wallS: a.wallMs / 1000,
            sessionP50S: median(a.sessionMs) / 1000,
            ttft: summarize(ok.map((x) => x.ttftMs)),
            ttftP90ByRound: Array.from({ length: agentRounds }, (_, i) => summarize(ok.filter((x) => x.round === i + 1).map((x) => x.ttftMs)).p90),
            tpot: summarize(ok.map((x) => x.tpotMs)),
            cachedShare: prompt > 0 ? later.reduce((acc, x) => acc + x.cachedTokens, 0) / prompt : 0,
            failed: agentSessions * agentRounds - ok.length,
            reqPerS: ok.length / (a.wallMs / 1000),
            cpuMsPerRequest: cpuPerRequest(c0, c1, ok.length),
            load: load1(),
          };
          agents.push(run);
          const firstErr = a.rounds.find((x) => !x.ok)?.error;
          say(`  agents ${agentSessions} × ${agentRounds}, ${PEER_NAMES[s]}: sessions done in ${fmt(run.wallS, 1)} s, TTFT p50 ${fmt(run.ttft.p50, 0)} p90 ${fmt(run.ttft.p90, 0)} ms, TPOT p50 ${fmt(run.tpot.p50, 1)} ms, cached ${fmt(run.cachedShare * 100, 0)} %, failed ${run.failed}${firstErr ? ` (${firstErr})` : ''}, CPU ms/req ${Object.entries(run.cpuMsPerRequest).map(([k, v]) => `${k} ${fmt(v, 0)}`).join(' / ')}, load ${run.load}`);
        }
      }
    }
    const profile = process.env.PDSERVE_BENCH_PEER_PROFILE === '1' ? await profileRun({ ...o, contextPerSlot, logDir, dispatcher, tok, llama: { url: urls.llama, model: models.llama, pid: peer.child.pid }, timeoutMs }) : undefined;
    return { llamaCppTag: bin.tag, modelName: o.modelName, llamaServerArgs: peer.args.map((a) => (a === o.model ? '<model>' : a)), config, uniform, agents, ...(profile ? { profile } : {}) };
  } finally {
    await peer?.stop();
    await cluster.stop();
    await tok.dispose().catch(() => {});
    await dispatcher.close().catch(() => {});
  }
}

const nowUs = () => Number(process.hrtime.bigint() / 1000n);

/**
 * The per-phase profile: a fresh pdserve cluster whose every process runs under `node --cpu-prof`,
 * 30 agent sessions (PDSERVE_BENCH_PEER_PROFILE_AGENTS="sessions,rounds", default 30,4) on the
 * colocated server, then on PD, then on llama-server (CPU only: the floor); the profiles are read
 * once the cluster stopped (node writes them at exit), their samples cut to each run's window.
 */
async function profileRun(o: PeerOptions & { contextPerSlot: number; logDir: string; dispatcher: Dispatcher; tok: BenchTokenizer; llama: { url: string; model: string; pid: number | undefined }; timeoutMs: number }): Promise<PhaseProfileResult> {
  const [sessions, rounds] = envList('PDSERVE_BENCH_PEER_PROFILE_AGENTS', [30, 4]) as [number, number];
  const profDir = join(o.logDir, 'cpuprof');
  mkdirSync(profDir, { recursive: true });
  const cluster = peerCluster(o, o.contextPerSlot, join(o.logDir, 'profiled'), ['--cpu-prof', `--cpu-prof-dir=${profDir}`]);
  say(`section 8, profile: ${sessions} sessions × ${rounds} rounds per system under node --cpu-prof (profiles in ${profDir})`);
  const windows: { system: string; procs: { name: string; pid: number; cpuS: number }[]; requests: number; wallS: number; fromUs: number; toUs: number }[] = [];
  let floorMs = NaN;
  try {
    await cluster.start();
    const sys: { system: string; url: string; procs: { name: string; pid: number | undefined }[] }[] = [
      { system: PEER_NAMES.colo, url: cluster.colocated!.url, procs: [{ name: 'colocated', pid: cluster.colocated!.child?.pid }] },
      { system: PEER_NAMES.pd, url: cluster.router.url, procs: cluster.procs.filter((p) => p.role !== 'colocated').map((p) => ({ name: p.name, pid: p.child?.pid })) },
    ];
    for (const s of sys) {
      const model = await discoverModel(s.url, o.dispatcher);
      const w = await completionRound(s.url, model, 'Warm up: once upon a time', 8, o.dispatcher, 60_000);
      if (!w.ok) throw new PdError('START_FAILED', `warm-up request failed (${s.system}, profiled): ${w.error}`);
      const c0 = cpuOf(s.procs);
      const fromUs = nowUs();
      const a = await runAgentSessions(s.url, model, conversations(o.tok, sessions, rounds, `profile-${s.system}`, 120, 150), { rounds, outputTokens: 24, dispatcher: o.dispatcher, timeoutMs: o.timeoutMs });
      const toUs = nowUs();
      const c1 = cpuOf(s.procs);
      const ok = a.rounds.filter((x) => x.ok).length;
      windows.push({ system: s.system, procs: s.procs.map((p) => ({ name: p.name, pid: p.pid ?? -1, cpuS: c1[p.name]! - c0[p.name]! })), requests: ok, wallS: a.wallMs / 1000, fromUs, toUs });
      say(`  profiled ${s.system}: ${ok} rounds in ${fmt(a.wallMs / 1000, 1)} s`);
    }
    const c0 = processCpuSeconds(o.llama.pid);
    const a = await runAgentSessions(o.llama.url, o.llama.model, conversations(o.tok, sessions, rounds, 'profile-llama', 120, 150), { rounds, outputTokens: 24, dispatcher: o.dispatcher, timeoutMs: o.timeoutMs });
    const ok = a.rounds.filter((x) => x.ok).length;
    floorMs = ok ? ((processCpuSeconds(o.llama.pid) - c0) * 1000) / ok : NaN;
  } finally {
    await cluster.stop(20_000); // a clean exit: node writes the profiles then
  }
  const systems = windows.map((w) => ({ system: w.system, requests: w.requests, wallS: w.wallS, processes: w.procs.map((p) => processPhases(p.name, profDir, p.pid, p.cpuS, w.requests, { fromUs: w.fromUs, toUs: w.toUs })) }));
  for (const s of systems) for (const p of s.processes) if (p.profiles === 0) say(`  warning: no CPU profile of ${s.system} / ${p.name} in ${profDir}`);
  say(`  profile: ${systems.map((s) => `${s.system} ${fmt(s.processes.reduce((acc, p) => acc + p.cpuMs, 0), 0)} ms/req (${PHASES.map((ph) => `${ph} ${fmt(s.processes.reduce((acc, p) => acc + p.phases[ph], 0), 1)}`).join(', ')}, native ${fmt(s.processes.reduce((acc, p) => acc + p.nativeMs, 0), 1)})`).join('; ')}; llama-server ${fmt(floorMs, 0)} ms/req`);
  return { sessions, rounds, systems, floorMs };
}

/** Mean of the finite values. */
function mean(xs: readonly number[]): number {
  const f = xs.filter(Number.isFinite);
  return f.length ? f.reduce((a, b) => a + b, 0) / f.length : NaN;
}

/** Sum of a run's per-process CPU ms per request. */
export function cpuTotal(c: CpuPerRequest): number {
  return Object.values(c).reduce((a, b) => a + b, 0);
}

function row(cells: (string | number)[]): string {
  return `| ${cells.join(' | ')} |`;
}

/** The goals of the section, each met/missed with its figures (medians over the repetitions). */
export function peerGoals(r: PeerResult): { goal: string; met: boolean; detail: string }[] {
  if (r.skipped || (!r.uniform.length && !r.agents.length)) return [];
  const out: { goal: string; met: boolean; detail: string }[] = [];
  const ag = (s: PeerSystem) => r.agents.filter((x) => x.system === s);
  if (r.agents.length) {
    const wall = (s: PeerSystem) => median(ag(s).map((x) => x.wallS));
    const l = wall('llama');
    out.push({ goal: `agents ${r.config.agentSessions} × ${r.config.agentRounds}: PD session completion ≤ 0.8× llama-server's`, met: wall('pd') <= 0.8 * l, detail: `${fmt(wall('pd'), 1)} s vs ${fmt(l, 1)} s (${fmtRatio(wall('pd') / l)})` });
    out.push({ goal: `agents ${r.config.agentSessions} × ${r.config.agentRounds}: colocated session completion ≤ 1.0× llama-server's`, met: wall('colo') <= l, detail: `${fmt(wall('colo'), 1)} s vs ${fmt(l, 1)} s (${fmtRatio(wall('colo') / l)})` });
    const byRound = (s: PeerSystem) => Array.from({ length: r.config.agentRounds }, (_, i) => median(ag(s).map((x) => x.ttftP90ByRound[i]!)));
    for (const s of ['pd', 'colo'] as const) {
      const mine = byRound(s);
      const theirs = byRound('llama');
      out.push({ goal: `agents: ${PEER_NAMES[s]} TTFT p90 ≤ llama-server's at every round`, met: mine.every((v, i) => v <= theirs[i]!), detail: mine.map((v, i) => `r${i + 1} ${fmt(v, 0)}/${fmt(theirs[i], 0)} ms`).join(', ') });
    }
    const failed = r.agents.filter((x) => x.system !== 'llama').reduce((a, x) => a + x.failed, 0);
    out.push({ goal: 'agents: 0 failed rounds (pdserve)', met: failed === 0, detail: `${failed} failed` });
  }
  if (r.uniform.length) {
    const pts = [...new Set(r.uniform.map((x) => `${x.promptTokens}×${x.streams}`))];
    const rps = (s: PeerSystem, k: string) => median(r.uniform.filter((x) => x.system === s && `${x.promptTokens}×${x.streams}` === k).map((x) => x.reqPerS));
    for (const s of ['colo', 'pd'] as const) {
      const ratios = pts.map((k) => ({ k, v: rps(s, k) / rps('llama', k) }));
      out.push({ goal: `uniform: ${PEER_NAMES[s]} requests/s ≥ 1.0× llama-server at every point`, met: ratios.every((x) => x.v >= 1), detail: `lowest ${fmtRatio(Math.min(...ratios.map((x) => x.v)))} (${ratios.reduce((a, b) => (b.v < a.v ? b : a)).k}), ${ratios.filter((x) => x.v >= 1).length} of ${ratios.length} points met` });
    }
    const mixed = pts.filter((k) => !k.endsWith('×1'));
    const tp = (s: PeerSystem, k: string) => median(r.uniform.filter((x) => x.system === s && `${x.promptTokens}×${x.streams}` === k).map((x) => x.tpot.p99));
    const tr = mixed.map((k) => tp('pd', k) / tp('llama', k));
    out.push({ goal: 'uniform, several streams: PD TPOT p99 ≤ 0.2× llama-server\'s', met: tr.length > 0 && tr.every((v) => v <= 0.2), detail: `highest ${fmtRatio(Math.max(...tr))}` });
  }
  const cpuReq = (s: PeerSystem) => mean(r.agents.filter((x) => x.system === s).map((x) => cpuTotal(x.cpuMsPerRequest)));
  if (r.agents.length) {
    for (const s of ['colo', 'pd'] as const) out.push({ goal: `agents: ${PEER_NAMES[s]} CPU per request ≤ 1.3× llama-server's (${r.modelName ?? 'small'} model; the goal is set on the overhead-bound tiny one)`, met: cpuReq(s) <= 1.3 * cpuReq('llama'), detail: `${fmt(cpuReq(s), 0)} vs ${fmt(cpuReq('llama'), 0)} ms (${fmtRatio(cpuReq(s) / cpuReq('llama'))})` });
  }
  return out;
}

/** Markdown lines of section 8 (tables; the prose around them is the report template's). */
export function peerReport(r: PeerResult | undefined, prov: string): string[] {
  const L = [prov, ''];
  if (!r) return [...L, '_Not run yet._'];
  if (r.skipped) return [...L, `_Not measured: ${r.skipped}._`];
  L.push(`Model: the generated ${r.modelName ?? 'small'} one; llama-server ${r.llamaCppTag}: \`llama-server ${(r.llamaServerArgs ?? []).join(' ').replace(/ --host \S+ --port \d+/, '')}\`. Medians of ${r.config.reps} repetition(s) per point, the systems' order rotating.`, '');
  if (r.agents.length) {
    L.push(`**Agent workload**: ${r.config.agentSessions} sessions × ${r.config.agentRounds} rounds at once (system prompt ~120 tokens, a 150-token tool result and 24 tokens out per round).`, '');
    L.push(row(['system', 'sessions done s', 'session p50 s', 'req/s', 'TTFT p50 ms', 'TTFT p90 ms', 'TPOT p50 ms', 'TPOT p99 ms', 'cached (r2+)', 'CPU ms/req by process', 'failed', 'load']), `|---|${Array(11).fill('---:').join('|')}|`);
    for (const s of PEER_SYSTEMS) {
      const xs = r.agents.filter((x) => x.system === s);
      if (!xs.length) continue;
      const m = (f: (x: PeerAgentRun) => number, d = 0) => fmt(median(xs.map(f)), d);
      const procs = Object.keys(xs[0]!.cpuMsPerRequest);
      const cpu = procs.map((k) => `${k} ${fmt(median(xs.map((x) => x.cpuMsPerRequest[k]!)), 0)}`).join(', ');
      const loads = xs.map((x) => x.load);
      L.push(row([PEER_NAMES[s], m((x) => x.wallS, 1), m((x) => x.sessionP50S, 1), m((x) => x.reqPerS, 2), m((x) => x.ttft.p50), m((x) => x.ttft.p90), m((x) => x.tpot.p50, 1), m((x) => x.tpot.p99, 1), `${m((x) => x.cachedShare * 100)} %`, cpu, xs.reduce((a, x) => a + x.failed, 0), `${Math.min(...loads)}–${Math.max(...loads)}`]));
    }
    L.push('');
  }
  if (r.uniform.length) {
    L.push(`**Uniform sweep**: random-word prompts of exact token counts, ${r.config.outputTokens} tokens out, N streams (2N requests, at least 6).`, '');
    L.push(row(['prompt tokens', 'streams', 'system', 'req/s', 'vs llama-server', 'TTFT p50 ms', 'TPOT p99 ms', 'CPU ms/req', 'failed', '1-min load']), `|---:|---:|---|${Array(7).fill('---:').join('|')}|`);
    for (const p of r.config.promptTokens) {
      for (const n of r.config.streams) {
        const llama = median(r.uniform.filter((x) => x.system === 'llama' && x.streams === n && x.promptTokens === p).map((x) => x.reqPerS));
        for (const s of PEER_SYSTEMS) {
          const xs = r.uniform.filter((x) => x.system === s && x.streams === n && x.promptTokens === p);
          if (!xs.length) continue;
          const m = (f: (x: UniformRun) => number, d = 0) => fmt(median(xs.map(f)), d);
          const loads = xs.map((x) => x.load);
          L.push(row([p, n, PEER_NAMES[s], m((x) => x.reqPerS, 2), s === 'llama' ? '—' : fmtRatio(median(xs.map((x) => x.reqPerS)) / llama), m((x) => x.ttft.p50), m((x) => x.tpot.p99, 1), m((x) => cpuTotal(x.cpuMsPerRequest)), xs.reduce((a, x) => a + x.failed, 0), `${Math.min(...loads)}–${Math.max(...loads)}`]));
        }
      }
    }
    L.push('');
  }
  const goals = peerGoals(r);
  if (goals.length) L.push(row(['goal', 'measured', 'met?']), '|---|---|---|', ...goals.map((g) => row([g.goal, g.detail, g.met ? '**met**' : '**missed**'])));
  return L;
}
