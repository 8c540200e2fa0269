/**
 * `npm run bench` (`pdserve bench-suite`): the benchmark suite. Seven sections, each a
 * comparison whose two sides run in the same invocation, interleaved, so the ratio holds on a
 * noisy machine even when absolute times move:
 *
 *   1. KV handoff vs raw TCP (1/4/16/64 MiB real states, two processes)
 *   2. PD vs colocated at low load (prompts of 64/512/1500 tokens, one at a time)
 *   3. Interference: 8 decoding streams + long prompts every few seconds
 *   4. Decode batching: 1/4/8 streams through pdserve vs node-llama-cpp driven directly
 *   5. Router overhead: requests of one shape (each with a prompt of its own) through the router vs to the workers directly
 *   6. Scaling: Poisson rate sweep, goodput under an SLO
 *   7. Multi-round agents: prefix reuse (PD + cache vs colocated + cache vs PD without), own stacks
 *   8. Against llama-server: llama.cpp's own server beside colocated and PD (./peer.ts), and a
 *      per-phase CPU profile (PDSERVE_BENCH_PEER_PROFILE=1); a run of §8 alone keeps the stored
 *      run's header (suite.json) and re-renders
 *
 * Writes bench/results/sN-*.json, bench/plots/*.svg and BENCHMARKS.md (sections not run this time
 * are taken from their previous JSON, when present). Model: the generated `small` GGUF.
 */
import { execSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { ensureModel, describeModel } from '../engine/gguf-writer.js';
import { KV_CACHE_TYPES, type KvCacheType } from '../engine/gpu.js';
import { Cluster } from '../up/cluster.js';
import { benchAgent, discoverModel, loadTokenizer, REPO_ROOT, sendRequest, type BenchTarget } from './index.js';
import { runKvSection, type KvSectionResult } from './kv.js';
import { runBatching, runInterference, runLowLoad, runRouterOverhead, runScaling, type SectionCtx } from './sections.js';
import { renderReport, writePlots, type SectionFile, type SuiteMeta } from './report.js';
import { gpuReport } from './gpu.js';
import { canPin, say } from './util.js';
import { runAgentsScale, runAgentsSection } from './agents.js';
import { runPeerSection } from './peer.js';
import type { AgentsScaleResult } from './report-agents.js';

/** Options of `pdserve bench-suite`. */
export interface SuiteOptions {
  /** Comma-separated section numbers. */
  sections: string;
  quick: boolean;
  /** Repository root to write into (default: this checkout). */
  out?: string;
  /** Pin prefill and decode to separate cores (when the machine has ≥ 2 and taskset exists). */
  pin: boolean;
  argv: string[];
  /** Only re-render BENCHMARKS.md and the plots from bench/results (no measurement). */
  renderOnly?: boolean;
}

export const SECTION_FILES: Record<number, string> = {
  1: 's1-kv-handoff.json',
  2: 's2-low-load.json',
  3: 's3-interference.json',
  4: 's4-batching.json',
  5: 's5-router-overhead.json',
  6: 's6-scaling.json',
  7: 's7-agents.json',
  /** Section 2 run without CPU pinning (`--no-pin`), kept next to the pinned run (not a section of its own). */
  21: 's2-low-load-unpinned.json',
  /** Section 1's large states (PDSERVE_BENCH_KV_BIG), kept next to the default run. */
  11: 's1-kv-large.json',
  /** Section 7's agents at scale (PDSERVE_BENCH_AGENTS_SCALE), kept next to the default run. */
  71: 's7-agents-scale.json',
  /** Section 7's agent trace replay (`pdserve bench-agents --save`), kept next to the default run. */
  72: 's7-agent-trace.json',
  8: 's8-llama-server.json',
  /** Section 9, two routers (`pdserve bench-routers --save`). */
  9: 's9-routers.json',
  /** Section 8's per-phase profile (PDSERVE_BENCH_PEER_PROFILE=1). */
  81: 's8-profile.json',
};

const CTX = 2048;
const BATCH = 512;
const DECODE_SLOTS = 10;

function pkgVersion(name: string): string {
  try {
    return (JSON.parse(readFileSync(join(REPO_ROOT, 'node_modules', name, 'package.json'), 'utf8')) as { version: string }).version;
  } catch {
    return '?';
  }
}

/**
 * The commit the figures are measured on, named so that the name cannot go stale: HEAD's short hash
 * when HEAD is on `main` (main is never rewritten), else `<main's commit> + N branch commits` (a
 * branch's own hashes change when it is rebased onto main to land); either followed by
 * `+ uncommitted changes` when tracked files other than the report's own outputs (BENCHMARKS.md,
 * bench/) differ from HEAD — figures from code no commit holds must not name a commit alone.
 * `?` outside a git checkout.
 */
export function commitLabel(o: { head: string; base?: string; ahead: number; dirty: boolean }): string {
  const name = o.base === undefined || o.ahead === 0 ? o.head : `${o.base} + ${o.ahead} branch commit${o.ahead === 1 ? '' : 's'}`;
  return o.dirty ? `${name} + uncommitted changes` : name;
}

/** The commit label of this checkout (`commitLabel`), `?` outside git. */
export function gitCommit(): string {
  const git = (args: string) => execSync(`git ${args}`, { cwd: REPO_ROOT, stdio: ['ignore', 'pipe', 'ignore'] }).toString().trim();
  try {
    const head = git('rev-parse --short HEAD');
    const dirty = git("status --porcelain --untracked-files=no -- . ':(exclude)BENCHMARKS.md' ':(exclude)bench'") !== '';
    let base: string;
    try {
      base = git('merge-base HEAD main');
    } catch {
      return commitLabel({ head, ahead: 0, dirty }); // no local main (a bare clone of one branch): HEAD is the best name there is
    }
    const ahead = Number(git(`rev-list --count ${base}..HEAD`));
    return commitLabel({ head, base: git(`rev-parse --short ${base}`), ahead, dirty });
  } catch {
    return '?';
  }
}

function machine(): SuiteMeta['machine'] {
  const cpus = os.cpus();
  return {
    cpuModel: cpus[0]?.model ?? '?',
    cores: cpus.length,
    memGiB: Math.round((os.totalmem() / 2 ** 30) * 10) / 10,
    os: `${os.type()} ${os.release()} ${os.arch()}`,
    node: process.version,
    packages: Object.fromEntries(['node-llama-cpp', 'undici', 'fastify', 'zod', 'typescript'].map((p) => [p, pkgVersion(p)])),
    loadavgStart: os.loadavg().map((x) => Math.round(x * 100) / 100),
    loadavgEnd: [],
  };
}

/**
 * PDSERVE_BENCH_KV_REPS="30,30,8,6": §1 trials per size (1, 4, 16, 64 MiB) for an engineer's A/B
 * (bench-only). Unset or empty: undefined (the suite's default).
 * @throws Error unless it is exactly 4 comma-separated integers in 1..500.
 */
export function parseKvReps(v: string | undefined): number[] | undefined {
  if (v === undefined || v.trim() === '') return undefined;
  const reps = v.split(',').map((x) => Number(x.trim()));
  if (reps.length !== 4 || !reps.every((n) => Number.isSafeInteger(n) && n >= 1 && n <= 500)) {
    throw new Error(`PDSERVE_BENCH_KV_REPS=${JSON.stringify(v)}: give 4 trial counts (1, 4, 16, 64 MiB), each an integer in 1..500, e.g. "30,30,8,6"`);
  }
  return reps;
}

/**
 * PDSERVE_BENCH_AGENTS_SCALE_AGENTS: the agents-at-scale concurrencies, a comma list of integers
 * in 1..64 ("8" profiles one level); undefined when unset or blank.
 * @throws on anything else.
 */
export function parseAgents(v: string | undefined): number[] | undefined {
  if (v === undefined || v.trim() === '') return undefined;
  const agents = v.split(',').map((x) => Number(x.trim()));
  if (!agents.every((n) => Number.isSafeInteger(n) && n >= 1 && n <= 64)) throw new Error(`PDSERVE_BENCH_AGENTS_SCALE_AGENTS=${JSON.stringify(v)}: give concurrencies, integers in 1..64, e.g. "8,30"`);
  return agents;
}

/** Context of §1's large-state run: holds the 1 GiB state's 4096 tokens of the 'wide' model. */
const LARGE_CTX = 4352;

/**
 * PDSERVE_BENCH_KV_BIG_REPS="3,3": trials per large size (256 MiB, 1 GiB). Unset or empty: [3, 3].
 * @throws Error unless it is exactly 2 comma-separated integers in 1..50.
 */
export function parseKvBigReps(v: string | undefined): number[] {
  if (v === undefined || v.trim() === '') return [3, 3];
  const reps = v.split(',').map((x) => Number(x.trim()));
  if (reps.length !== 2 || !reps.every((n) => Number.isSafeInteger(n) && n >= 1 && n <= 50)) throw new Error(`PDSERVE_BENCH_KV_BIG_REPS=${JSON.stringify(v)}: give 2 trial counts (256 MiB, 1 GiB), each an integer in 1..50, e.g. "3,3"`);
  return reps;
}

/** Run the suite; returns the process exit code. */
export async function benchSuiteCli(o: SuiteOptions): Promise<number> {
  const t0 = performance.now();
  const root = o.out ?? REPO_ROOT;
  if (process.env.PDSERVE_BENCH_KV_BOUND && root === REPO_ROOT && !o.renderOnly) {
    // its §1 figures are not the handoff's: they must not land in the checkout's BENCHMARKS.md
    throw new Error(`PDSERVE_BENCH_KV_BOUND=${process.env.PDSERVE_BENCH_KV_BOUND} is a bound experiment, not the workers' path: run it with --out <scratch dir>`);
  }
  // PDSERVE_BENCH_KV_CACHE_TYPE=q8_0: §2–6's workers and colocated server run with --kv-cache-type
  // (an engineer's A/B; the checkout's figures are f16's, so it needs --out like the bound experiment)
  const kvCacheType = process.env.PDSERVE_BENCH_KV_CACHE_TYPE || undefined;
  if (kvCacheType !== undefined && !(KV_CACHE_TYPES as readonly string[]).includes(kvCacheType)) throw new Error(`PDSERVE_BENCH_KV_CACHE_TYPE must be one of ${KV_CACHE_TYPES.join(', ')}, not ${kvCacheType}`);
  if (kvCacheType !== undefined && root === REPO_ROOT && !o.renderOnly) throw new Error(`PDSERVE_BENCH_KV_CACHE_TYPE=${kvCacheType} is an A/B against the f16 figures: run it with --out <scratch dir>`);
  const kvReps = o.quick ? [2, 2, 1, 1] : parseKvReps(process.env.PDSERVE_BENCH_KV_REPS) ?? [12, 10, 8, 6];
  const resultsDir = join(root, 'bench', 'results');
  const plotsDir = join(root, 'bench', 'plots');
  mkdirSync(resultsDir, { recursive: true });
  mkdirSync(plotsDir, { recursive: true });
  if (o.renderOnly) return renderOnly(resultsDir, plotsDir, root);
  const want = new Set(
    o.sections
      .split(',')
      .map((s) => Number(s.trim()))
      .filter((n) => n >= 1 && n <= 8),
  );
  const modelPath = await ensureModel('small', 1);
  const desc = describeModel({ preset: 'small', seed: 1 });
  const pinned = o.pin && canPin(2);
  const meta: SuiteMeta = {
    date: new Date().toISOString(),
    command: process.env.npm_lifecycle_event === 'bench' ? `npm run bench${o.argv.slice(3).length ? ` -- ${o.argv.slice(3).join(' ')}` : ''}` : `pdserve ${o.argv.slice(2).join(' ')}`,
    quick: o.quick,
    commit: gitCommit(),
    machine: machine(),
    model: { name: 'small (generated, random weights)', path: modelPath, params: desc.nParams, nVocab: desc.nVocab, dims: { nEmbd: desc.dims.nEmbd, nLayer: desc.dims.nLayer, nHead: desc.dims.nHead }, ggufBytes: statSync(modelPath).size },
    config: { contextSize: CTX, batchSize: BATCH, decodeSlots: DECODE_SLOTS, threadsPerProcess: 1, pinned, pinning: pinned ? 'prefill → CPU 0, decode → CPU 1 (taskset); router, colocated and the bench client unpinned' : 'none' },
    sectionSeconds: {},
    totalSeconds: 0,
  };
  say(`pdserve bench suite: sections ${[...want].sort().join(',')}${o.quick ? ' (quick)' : ''}; model ${modelPath}; ${meta.machine.cores} cores, load ${meta.machine.loadavgStart.join(' ')}`);
  const fresh = new Map<number, SectionFile>();
  const save = (n: number, result: unknown, seconds: number) => {
    meta.sectionSeconds[n] = Math.round(seconds);
    const file: SectionFile = { section: n, meta: { date: new Date().toISOString(), quick: o.quick, commit: meta.commit, seconds: Math.round(seconds), loadavg: os.loadavg().map((x) => Math.round(x * 100) / 100) }, result };
    fresh.set(n, file);
    writeFileSync(join(resultsDir, SECTION_FILES[n]!), JSON.stringify(file, (_k, v: unknown) => (typeof v === 'number' && !Number.isFinite(v) ? null : v), 1) + '\n');
  };
  let failed = false;

  const big = process.env.PDSERVE_BENCH_KV_BIG ?? '';
  if (want.has(1) && (big === '1' || big === 'only')) {
    const ts = performance.now();
    const reps = parseKvBigReps(process.env.PDSERVE_BENCH_KV_BIG_REPS);
    say(`section 1, large states: 256 MiB and 1 GiB (the generated 'wide' model: 256 KiB of KV per token), ${reps.join('/')} trials${process.env.PDSERVE_BENCH_KV_STREAM === '0' ? ', each KV trial also with the data path inline' : ''}`);
    try {
      const r: KvSectionResult = await runKvSection({
        model: await ensureModel('wide', 1),
        sizesMiB: [256, 1024],
        reps,
        contextSize: LARGE_CTX,
        batchSize: BATCH,
        bytesPerToken: 262_161,
        receiverSequences: 1,
        // the inline trials differ from the workers' path only when it saves first (the streamed
        // send reads inline, and decode writes a tmpfs file inline either way)
        compareInline: process.env.PDSERVE_BENCH_KV_STREAM === '0',
        threads: 2,
        makeTimeoutMs: 1_800_000,
      });
      save(11, r, (performance.now() - ts) / 1000);
    } catch (err) {
      failed = true;
      say(`section 1 (large states) failed: ${(err as Error).stack ?? err}`);
    }
  }
  if (want.has(1) && big !== 'only') {
    const ts = performance.now();
    say('section 1: KV handoff vs raw TCP');
    try {
      const r: KvSectionResult = await runKvSection({
        model: modelPath,
        sizesMiB: [1, 4, 16, 64],
        reps: kvReps,
        contextSize: 4096,
        batchSize: BATCH,
        receiverSequences: DECODE_SLOTS,
      });
      save(1, r, (performance.now() - ts) / 1000);
    } catch (err) {
      failed = true;
      say(`section 1 failed: ${(err as Error).stack ?? err}`);
    }
  }

  const clusterSections = [2, 3, 4, 5, 6].filter((n) => want.has(n));
  if (clusterSections.length) {
    const logDir = mkdtempSync(join(os.tmpdir(), 'pdserve-bench-'));
    const cluster = new Cluster({
      model: modelPath,
      prefill: 1,
      decode: 1,
      colocated: true,
      threads: 1,
      ctxSize: CTX,
      batchSize: BATCH,
      decodeSlots: DECODE_SLOTS,
      prefillSlots: 1,
      logDir,
      startTimeoutMs: 120_000,
      cpuAffinity: pinned ? { prefill: '0', decode: '1' } : undefined,
      ...(kvCacheType ? { extraArgs: Object.fromEntries((['prefill', 'decode', 'colocated'] as const).map((r) => [r, ['--kv-cache-type', kvCacheType as KvCacheType]])) } : {}),
    });
    const dispatcher = benchAgent(64);
    const tokenizer = await loadTokenizer(modelPath);
    try {
      say(`starting the cluster (router, prefill, decode, colocated; logs in ${logDir})`);
      await cluster.start();
      const routerUrl = cluster.router.url;
      const coloUrl = cluster.colocated!.url;
      const prefill = cluster.byRole('prefill')[0]!;
      const decode = cluster.byRole('decode')[0]!;
      const served = await discoverModel(routerUrl, dispatcher);
      const pd: BenchTarget = { kind: 'openai', url: routerUrl, endpoint: 'completions', model: served };
      const colo: BenchTarget = { kind: 'openai', url: coloUrl, endpoint: 'completions', model: served };
      const direct: BenchTarget = { kind: 'pd-direct', prefillUrl: prefill.url, bootstrapHost: '127.0.0.1', bootstrapPort: prefill.bootstrapPort!, decodeUrl: decode.url };
      const ctx: SectionCtx = { pd, colo, direct, tokenizer, dispatcher, model: modelPath, contextSize: CTX, batchSize: BATCH, decodeSlots: DECODE_SLOTS, decodeCpus: pinned ? '1' : undefined, quick: o.quick, timeoutMs: 180_000 };
      // warm-up: every path once (first llama.cpp evaluation, connection pools, KV channel)
      const warm = { text: 'Alice was beginning to get very tired of sitting by her sister on the bank.', promptTokens: 20, outputLen: 8 };
      for (const t of [pd, colo, direct]) {
        const r = await sendRequest(t, warm, { t0: performance.now(), dispatcher, timeoutMs: 60_000 });
        if (!r.ok) throw new Error(`warm-up request failed (${t.kind === 'openai' ? t.url : 'pd-direct'}): ${r.error}`);
      }
      const sections: [number, string, () => Promise<unknown>][] = [
        [2, 'PD vs colocated at low load', () => runLowLoad(ctx)],
        [3, 'interference (8 streams + long prompts)', () => runInterference(ctx)],
        [4, 'decode batching: pdserve vs node-llama-cpp directly', () => runBatching(ctx)],
        [5, 'router overhead', () => runRouterOverhead(ctx)],
        [6, 'scaling: request-rate sweep, goodput', () => runScaling(ctx)],
      ];
      for (const [n, name, fn] of sections) {
        if (!want.has(n)) continue;
        const ts = performance.now();
        say(`section ${n}: ${name}`);
        try {
          // §2 keeps a pinned and an unpinned run side by side (the unpinned one under key 21)
          save(n === 2 && !pinned ? 21 : n, await fn(), (performance.now() - ts) / 1000);
        } catch (err) {
          failed = true;
          say(`section ${n} failed: ${(err as Error).stack ?? err}`);
        }
        for (const p of cluster.procs) if (p.unexpectedExits.length) say(`warning: ${p.name} exited unexpectedly (log: ${p.logFile})`);
      }
    } catch (err) {
      failed = true;
      say(`cluster sections failed: ${(err as Error).stack ?? err}`);
    } finally {
      await cluster.stop();
      await tokenizer.dispose().catch(() => {});
      await dispatcher.close().catch(() => {});
    }
  }

  // PDSERVE_BENCH_AGENTS_SCALE=1 (or =only: this run alone): §7's agents at scale, 8 and 30 agents
  // on the generated PDSERVE_BENCH_AGENTS_SCALE_MODEL (small, or tiny where small is too slow),
  // PDSERVE_BENCH_AGENTS_SCALE_ROUNDS rounds (default 8), PDSERVE_BENCH_AGENTS_SCALE_AGENTS levels
  // (comma list, default 8,30; quick 2,4).
  const scale = process.env.PDSERVE_BENCH_AGENTS_SCALE ?? '';
  if (want.has(7) && (scale === '1' || scale === 'only')) {
    const ts = performance.now();
    const name = process.env.PDSERVE_BENCH_AGENTS_SCALE_MODEL === 'tiny' ? 'tiny' : 'small';
    const rounds = Number(process.env.PDSERVE_BENCH_AGENTS_SCALE_ROUNDS ?? 8);
    if (!Number.isSafeInteger(rounds) || rounds < 2 || rounds > 32) throw new Error(`PDSERVE_BENCH_AGENTS_SCALE_ROUNDS=${process.env.PDSERVE_BENCH_AGENTS_SCALE_ROUNDS}: give an integer in 2..32`);
    const agents = parseAgents(process.env.PDSERVE_BENCH_AGENTS_SCALE_AGENTS) ?? (o.quick ? [2, 4] : [8, 30]);
    say(`section 7, agents at scale: ${agents.join(' and ')} agents × ${rounds} rounds, ${name} model, 1 prefill + 2 decode, with and without the prefix store, and colocated`);
    try {
      const r = await runAgentsScale({ model: await ensureModel(name, 1), agents, rounds, decode: 2, decodeSlots: DECODE_SLOTS, contextSize: CTX, batchSize: BATCH });
      const result: AgentsScaleResult = { model: name, rounds, decode: 2, ...r };
      save(71, result, (performance.now() - ts) / 1000);
    } catch (err) {
      failed = true;
      say(`section 7 (agents at scale) failed: ${(err as Error).stack ?? err}`);
    }
  }
  if (want.has(7) && scale !== 'only') {
    const ts = performance.now();
    say('section 7: multi-round agents (prefix reuse)');
    try {
      save(7, await runAgentsSection({ model: modelPath, quick: o.quick, contextSize: CTX, batchSize: BATCH, decodeSlots: DECODE_SLOTS }), (performance.now() - ts) / 1000);
    } catch (err) {
      failed = true;
      say(`section 7 failed: ${(err as Error).stack ?? err}`);
    }
  }

  if (want.has(8)) {
    const ts = performance.now();
    say('section 8: against llama-server');
    try {
      // PDSERVE_BENCH_PEER_MODEL=tiny: the overhead-bound model (its figures replace the small one's)
      const peerModel = process.env.PDSERVE_BENCH_PEER_MODEL === 'tiny' ? 'tiny' : 'small';
      const { profile, ...r } = await runPeerSection({ model: peerModel === 'tiny' ? await ensureModel('tiny', 1) : modelPath, modelName: peerModel, quick: o.quick, batchSize: BATCH });
      if (profile) save(81, profile, (performance.now() - ts) / 1000);
      save(8, r, (performance.now() - ts) / 1000);
    } catch (err) {
      failed = true;
      say(`section 8 failed: ${(err as Error).stack ?? err}`);
    }
  }

  meta.totalSeconds = Math.round((performance.now() - t0) / 1000);
  meta.machine.loadavgEnd = os.loadavg().map((x) => Math.round(x * 100) / 100);
  if (want.size === 1 && want.has(8) && existsSync(join(resultsDir, 'suite.json'))) {
    // §8 alone: the stored run's header and sections stay as measured, §8 comes from its new file
    say(`measured section 8 in ${meta.totalSeconds} s`);
    const code = renderOnly(resultsDir, plotsDir, root);
    return failed ? 1 : code;
  }
  writeFileSync(join(resultsDir, 'suite.json'), JSON.stringify({ meta, sectionsRun: [...fresh.keys()] }, null, 1) + '\n');
  render(resultsDir, plotsDir, root, meta, [...fresh.keys()], fresh);
  say(`wrote BENCHMARKS.md, ${resultsDir}, ${plotsDir} in ${meta.totalSeconds} s`);
  return failed ? 1 : 0;
}

function render(resultsDir: string, plotsDir: string, root: string, meta: SuiteMeta, sectionsRun: number[], fresh: Map<number, SectionFile>): void {
  writeFileSync(join(root, 'BENCHMARKS.md'), reportFromResults(resultsDir, plotsDir, meta, sectionsRun, fresh));
}

/**
 * BENCHMARKS.md's text from the sections' files: this run's (`fresh`), else the JSON stored in
 * `resultsDir` when present (a section without either is shown as not run). Writes the plots into
 * `plotsDir`. No measurement: this is what `--render-only` runs.
 */
export function reportFromResults(resultsDir: string, plotsDir: string, meta: SuiteMeta, sectionsRun: number[], fresh: Map<number, SectionFile> = new Map()): string {
  const files = new Map<number, SectionFile>();
  for (const n of Object.keys(SECTION_FILES).map(Number)) {
    const f = fresh.get(n);
    if (f) files.set(n, f);
    else if (existsSync(join(resultsDir, SECTION_FILES[n]!))) {
      try {
        files.set(n, JSON.parse(readFileSync(join(resultsDir, SECTION_FILES[n]!), 'utf8')) as SectionFile);
      } catch {
        /* unreadable: section shown as missing */
      }
    }
  }
  return renderReport(meta, files, writePlots(files, plotsDir), sectionsRun, gpuReport(resultsDir));
}

/** `--render-only`: BENCHMARKS.md and plots again from `root`'s bench/results (after a change to the report's wording, or a section saved alone); returns the exit code. */
export function renderOnly(resultsDir: string, plotsDir: string, root: string): number {
  const file = join(resultsDir, 'suite.json');
  if (!existsSync(file)) {
    console.error(`pdserve bench-suite: ${file} is missing; run the suite first`);
    return 1;
  }
  const { meta, sectionsRun } = JSON.parse(readFileSync(file, 'utf8')) as { meta: SuiteMeta; sectionsRun: number[] };
  render(resultsDir, plotsDir, root, meta, sectionsRun, new Map());
  say(`re-rendered BENCHMARKS.md and ${plotsDir} from ${resultsDir}`);
  return 0;
}
