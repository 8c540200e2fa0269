/**
 * Bench section 7, "multi-round agents": N agents hold R-round conversations whose context
 * grows every round (each round resends the whole conversation plus a ~150-token tool result
 * taken from the storm corpus, and the model's previous reply). Four setups, interleaved at
 * each concurrency (the order rotates per level):
 *
 *   - `pd_local`: PD with decode-local continuation (router `--decode-policy cache_aware`):
 *     rounds whose prefix the decode worker kept and whose new suffix is short run on decode
 *     alone (no prefill, no KV handoff); the rest as `pd`;
 *   - `pd`: router (cache_aware) → prefill with its prefix cache → decode;
 *   - `colo`: the colocated server with its prefix cache (the fair baseline, as llama.cpp's
 *     server with cache_prompt);
 *   - `pd_noreuse`: the same PD stack with `--no-prefix-cache` on prefill.
 *
 * Per round: TTFT (first content chunk at the client), E2E, prompt and cached tokens (from
 * usage.prompt_tokens_details.cached_tokens). Agent goodput = rounds per second meeting the SLO
 * (TTFT and TPOT). The agents goals are evaluated in the report: PD round-R TTFT ≤ 1.5 ×
 * round-1; cached ≥ 60 % of prompt tokens over rounds 2+; PD goodput ≥ colocated's at every
 * concurrency.
 */
import { mkdtempSync, readdirSync, readFileSync } from 'node:fs';
import os from 'node:os';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { request, type Dispatcher } from 'undici';
import { readSse } from '../api/sse.js';
import { foldAscii, ROOT } from '../up/corpus.js';
import { benchAgent, discoverModel, exactText, loadTokenizer, type BenchTokenizer } from './index.js';
import { lineChart } from './svg.js';
import { fmt, fmtRatio, median, say } from './util.js';
import { Cluster, type ClusterProc } from '../up/cluster.js';
import { machineBusySeconds, processCpuSeconds } from './cpu.js';

export type AgentSetup = 'pd_local' | 'pd' | 'colo' | 'pd_noreuse';
export const AGENT_SETUPS: readonly AgentSetup[] = ['pd_local', 'pd', 'colo', 'pd_noreuse'];
const SETUP_NAMES: Record<AgentSetup, string> = { pd_local: 'PD + decode-local', pd: 'PD + prefix cache', colo: 'colocated + prefix cache', pd_noreuse: 'PD, no reuse' };

/** What one streamed round measured, client side. Times in ms. */
export interface StreamedRound {
  ok: boolean;
  error?: string;
  ttftMs: number;
  e2eMs: number;
  /** (E2E − TTFT) / (output tokens − 1); `tpotIfOne` of `streamedRound` below 2 tokens. */
  tpotMs: number;
  promptTokens: number;
  cachedTokens: number;
  /** usage carried prompt_tokens_details.cached_tokens (when false, `cachedTokens` is 0 for want of a figure). */
  cachedReported: boolean;
  outputTokens: number;
  /** Serving path the router reported (x-pdserve-path: pd | decode_local); '' when absent. */
  path: string;
  text: string;
}

/** One agent's round as §7 keeps it (the reply's text goes back into the conversation, not into the results). */
export interface AgentRound extends Omit<StreamedRound, 'text' | 'cachedReported'> {
  agent: number;
  round: number;
}

/** One setup at one concurrency. */
export interface AgentRun {
  setup: AgentSetup;
  concurrency: number;
  wallMs: number;
  rounds: AgentRound[];
  /** Median TTFT per round (index 0 = round 1), ms. */
  ttftByRound: number[];
  /** Cached / prompt tokens over rounds 2+. */
  cachedShare: number;
  /** Rounds per second meeting the SLO; and all completed rounds per second. */
  goodput: number;
  throughput: number;
  failed: number;
  /** 1-min load average when the run ended. */
  load: number;
  /** Completed rounds by serving path (x-pdserve-path; colocated reports none). */
  paths: { pd: number; decode_local: number };
}

export interface AgentsResult {
  rounds: number;
  toolTokens: number;
  outputTokens: number;
  systemTokens: number;
  concurrencies: number[];
  slo: { ttftMs: number; tpotMs: number };
  runs: AgentRun[];
}

export interface AgentsOptions {
  model: string;
  quick: boolean;
  contextSize: number;
  batchSize: number;
  decodeSlots: number;
  timeoutMs?: number;
}

/** The agent corpus: corpus/*.txt (the storm's prose), folded to ASCII, in file-name order. */
export function loadAgentCorpus(): string {
  const dir = join(ROOT, 'corpus');
  return readdirSync(dir)
    .filter((f) => f.endsWith('.txt'))
    .sort()
    .map((f) => foldAscii(readFileSync(join(dir, f), 'utf8')))
    .join('\n\n');
}

/** One agent's conversation material: its system prompt and one tool result per round. */
export interface Conversation {
  system: string;
  tools: string[];
}

/** Agent conversations: a system prompt and one tool result per round, cut from the storm corpus at exact token counts (`tag` seeds the offsets: a new tag, new conversations). */
export function conversations(tok: BenchTokenizer, n: number, rounds: number, tag: string, systemTokens: number, toolTokens: number): Conversation[] {
  const ids = tok.encode(loadAgentCorpus());
  const out: Conversation[] = [];
  // the offset depends on the whole tag: two runs whose tags have the same length (c2 / c4) must
  // not share tool results, or the conversations share a key (its first user message) and a
  // later run routes on an earlier run's claims
  let seed = 0;
  for (const ch of tag) seed = (seed * 31 + ch.charCodeAt(0)) % 1_000_003;
  for (let a = 0; a < n; a++) {
    const base = (a * 7919 + seed * 104729) % ids.length;
    const system = `You are agent ${a} of run ${tag}. Read each tool result and decide the next step in one short sentence. Background: ${exactText(tok, ids, base, systemTokens).text}`;
    const tools: string[] = [];
    for (let r = 0; r < rounds; r++) tools.push(exactText(tok, ids, base + 997 * (r + 1), toolTokens).text);
    out.push({ system, tools });
  }
  return out;
}

/**
 * One streamed OpenAI round: POSTs `body` (`stream: true`, `stream_options.include_usage` set
 * here) to `url` + `endpoint` and reads the SSE stream. TTFT is taken at the first non-empty
 * piece (a completion's `text`, a chat chunk's `delta.content`), E2E at the stream's end (ms,
 * from the call); token counts are usage's. Shared by §7's chat rounds and §8's completion rounds.
 * Never rejects: a status other than 200, an error chunk, a stream without `[DONE]` or a transport
 * failure comes back `ok: false` with `error` saying which. `signal` (a run's deadline) aborts it as
 * the `timeoutMs` deadline does.
 */
export async function streamedRound(url: string, endpoint: '/v1/completions' | '/v1/chat/completions', body: Record<string, unknown>, o: { dispatcher: Dispatcher; timeoutMs: number; tpotIfOne: number; signal?: AbortSignal }): Promise<StreamedRound> {
  const start = performance.now();
  const r: StreamedRound = { ok: false, ttftMs: NaN, e2eMs: NaN, tpotMs: NaN, promptTokens: 0, cachedTokens: 0, cachedReported: false, outputTokens: 0, path: '', text: '' };
  try {
    const res = await request(`${url}${endpoint}`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
      dispatcher: o.dispatcher,
      signal: o.signal ? AbortSignal.any([o.signal, AbortSignal.timeout(o.timeoutMs)]) : AbortSignal.timeout(o.timeoutMs),
    });
    if (res.statusCode !== 200) {
      r.error = `HTTP ${res.statusCode}: ${(await res.body.text()).slice(0, 200)}`;
      return r;
    }
    const path = res.headers['x-pdserve-path'];
    if (typeof path === 'string') r.path = path;
    let done = false;
    for await (const data of readSse(res.body)) {
      if (data === '[DONE]') {
        done = true;
        continue;
      }
      const j = JSON.parse(data) as { choices?: { text?: string | null; delta?: { content?: string | null } }[]; usage?: { prompt_tokens: number; completion_tokens: number; prompt_tokens_details?: { cached_tokens?: number } | null } | null; error?: { message?: string } };
      if (j.error) {
        r.error = `stream error: ${j.error.message}`;
        return r;
      }
      const c = (endpoint === '/v1/completions' ? j.choices?.[0]?.text : j.choices?.[0]?.delta?.content) ?? '';
      if (c !== '' && Number.isNaN(r.ttftMs)) r.ttftMs = performance.now() - start;
      r.text += c;
      if (j.usage) {
        r.promptTokens = j.usage.prompt_tokens;
        r.outputTokens = j.usage.completion_tokens;
        const cached = j.usage.prompt_tokens_details?.cached_tokens;
        r.cachedReported = typeof cached === 'number';
        r.cachedTokens = typeof cached === 'number' ? cached : 0;
      }
    }
    r.e2eMs = performance.now() - start;
    if (Number.isNaN(r.ttftMs)) r.ttftMs = r.e2eMs;
    r.tpotMs = r.outputTokens > 1 ? (r.e2eMs - r.ttftMs) / (r.outputTokens - 1) : o.tpotIfOne;
    r.ok = done;
    if (!done) r.error = 'stream ended without [DONE]';
  } catch (err) {
    r.error = `transport: ${(err as Error).message}`;
  }
  return r;
}

/** One streamed chat round (TPOT 0 below 2 output tokens). Never rejects. */
function chatRound(url: string, model: string, messages: { role: string; content: string }[], maxTokens: number, dispatcher: Dispatcher, timeoutMs: number): Promise<StreamedRound> {
  return streamedRound(url, '/v1/chat/completions', { model, messages, max_tokens: maxTokens, temperature: 0, ignore_eos: true }, { dispatcher, timeoutMs, tpotIfOne: 0 });
}

/** Run `convs` concurrently against one endpoint, R rounds each; summarise. */
async function runSetup(setup: AgentSetup, url: string, model: string, convs: Conversation[], o: { rounds: number; outputTokens: number; slo: AgentsResult['slo']; dispatcher: Dispatcher; timeoutMs: number }): Promise<AgentRun> {
  const t0 = performance.now();
  const rounds: AgentRound[] = [];
  await Promise.all(
    convs.map(async (c, agent) => {
      const messages: { role: string; content: string }[] = [{ role: 'system', content: c.system }];
      for (let round = 1; round <= o.rounds; round++) {
        messages.push({ role: 'user', content: `Tool result ${round}:\n${c.tools[round - 1]}` });
        const r = await chatRound(url, model, messages, o.outputTokens, o.dispatcher, o.timeoutMs);
        rounds.push({ agent, round, ok: r.ok, error: r.error, ttftMs: r.ttftMs, e2eMs: r.e2eMs, tpotMs: r.tpotMs, promptTokens: r.promptTokens, cachedTokens: r.cachedTokens, outputTokens: r.outputTokens, path: r.path });
        if (!r.ok) return;
        messages.push({ role: 'assistant', content: r.text });
      }
    }),
  );
  const wallMs = performance.now() - t0;
  const ok = rounds.filter((r) => r.ok);
  const later = ok.filter((r) => r.round >= 2);
  const prompt = later.reduce((a, r) => a + r.promptTokens, 0);
  const good = ok.filter((r) => r.ttftMs <= o.slo.ttftMs && r.tpotMs <= o.slo.tpotMs).length;
  const ttftByRound: number[] = [];
  for (let k = 1; k <= o.rounds; k++) ttftByRound.push(median(ok.filter((r) => r.round === k).map((r) => r.ttftMs)));
  return {
    setup,
    concurrency: convs.length,
    wallMs,
    rounds,
    ttftByRound,
    cachedShare: prompt > 0 ? later.reduce((a, r) => a + r.cachedTokens, 0) / prompt : 0,
    goodput: good / (wallMs / 1000),
    throughput: ok.length / (wallMs / 1000),
    failed: convs.length * o.rounds - ok.length, // rounds after a failure never ran: they count too
    load: Math.round(os.loadavg()[0]! * 100) / 100,
    paths: { pd: ok.filter((r) => r.path === 'pd').length, decode_local: ok.filter((r) => r.path === 'decode_local').length },
  };
}

/**
 * Section 7. Starts its own three stacks (PD with reuse + the colocated server; PD with
 * decode-local continuation; PD without reuse), runs every concurrency level with the four
 * setups interleaved, stops them.
 * @throws when a stack cannot start.
 */
export async function runAgentsSection(o: AgentsOptions): Promise<AgentsResult> {
  const rounds = o.quick ? 3 : 8;
  const concurrencies = o.quick ? [1, 2] : [1, 2, 4];
  const cfg = { systemTokens: 120, toolTokens: 150, outputTokens: 24 };
  const slo = { ttftMs: 1500, tpotMs: 100 };
  const timeoutMs = o.timeoutMs ?? 180_000;
  const common = { model: o.model, prefill: 1, decode: 1, threads: 1, ctxSize: o.contextSize, batchSize: o.batchSize, decodeSlots: o.decodeSlots, prefillSlots: 1, startTimeoutMs: 120_000 };
  const reuse = new Cluster({ ...common, colocated: true, logDir: mkdtempSync(join(os.tmpdir(), 'pdserve-bench-agents-')) });
  const noreuse = new Cluster({ ...common, colocated: false, extraArgs: { prefill: ['--no-prefix-cache'] }, logDir: mkdtempSync(join(os.tmpdir(), 'pdserve-bench-agents-nr-')) });
  // The same PD stack with decode-local continuation on (decode keeps finished sequences by default).
  const local = new Cluster({ ...common, colocated: false, extraArgs: { router: ['--decode-policy', 'cache_aware'] }, logDir: mkdtempSync(join(os.tmpdir(), 'pdserve-bench-agents-local-')) });
  const dispatcher = benchAgent(64);
  const tok = await loadTokenizer(o.model);
  try {
    say('section 7: starting the stacks (PD + colocated with prefix cache; PD with decode-local; PD without reuse)');
    await reuse.start();
    await noreuse.start();
    await local.start();
    const urls: Record<AgentSetup, string> = { pd_local: local.router.url, pd: reuse.router.url, colo: reuse.colocated!.url, pd_noreuse: noreuse.router.url };
    const model = await discoverModel(urls.pd, dispatcher);
    // Warm-up: every path once (first llama.cpp evaluation, connection pools, KV channels).
    for (const s of AGENT_SETUPS) {
      const w = await chatRound(urls[s], model, [{ role: 'user', content: 'Warm up: say hello.' }], 4, dispatcher, timeoutMs);
      if (!w.ok) throw new Error(`warm-up request failed (${SETUP_NAMES[s]}): ${w.error}`);
    }
    const runs: AgentRun[] = [];
    for (const [li, c] of concurrencies.entries()) {
      const order = AGENT_SETUPS.map((_, i) => AGENT_SETUPS[(i + li) % AGENT_SETUPS.length]!);
      for (const setup of order) {
        // Fresh conversations per run: nothing cached by an earlier level can be reused.
        const convs = conversations(tok, c, rounds, `${setup}-c${c}`, cfg.systemTokens, cfg.toolTokens);
        const run = await runSetup(setup, urls[setup], model, convs, { rounds, outputTokens: cfg.outputTokens, slo, dispatcher, timeoutMs });
        say(`  ${SETUP_NAMES[setup]}, ${c} agent(s): TTFT round 1 ${fmt(run.ttftByRound[0], 0)} ms, round ${rounds} ${fmt(run.ttftByRound[rounds - 1], 0)} ms; cached ${fmt(run.cachedShare * 100, 0)} %; goodput ${fmt(run.goodput, 2)} rounds/s; paths pd ${run.paths.pd} / decode_local ${run.paths.decode_local}; load ${run.load}`);
        runs.push(run);
      }
    }
    return { rounds, ...cfg, concurrencies, slo, runs };
  } finally {
    await reuse.stop();
    await noreuse.stop();
    await local.stop();
    await tok.dispose().catch(() => {});
    await dispatcher.close().catch(() => {});
  }
}

/** The TTFT-per-round plot (one line per setup and concurrency). Returns the SVG text. */
export function agentsPlot(r: AgentsResult): string {
  return lineChart({
    title: `Multi-round agents: median TTFT per round (${r.toolTokens}-token tool result per round)`,
    xLabel: 'round',
    yLabel: 'TTFT ms (log)',
    logY: true,
    xMin: 1,
    series: r.runs.map((run) => ({ name: `${SETUP_NAMES[run.setup]}, ${run.concurrency} agent${run.concurrency > 1 ? 's' : ''}`, points: run.ttftByRound.map((v, i) => [i + 1, v] as [number, number]) })),
  });
}

/** The agents-at-scale goals, each met/missed with the figures behind it. */
const agentsN = (c: number) => `${c} agent${c === 1 ? '' : 's'}`;

export function agentGoals(r: AgentsResult): { goal: string; met: boolean; detail: string }[] {
  const of = (s: AgentSetup) => r.runs.filter((x) => x.setup === s);
  // PD as shipped with every part on (decode-local continuation); results from before it existed: PD + prefix cache.
  const full: AgentSetup = of('pd_local').length > 0 ? 'pd_local' : 'pd';
  const pd = of(full);
  const plain = of('pd');
  const colo = of('colo');
  const last = r.rounds - 1;
  const name = SETUP_NAMES[full];
  const ratio = pd.map((x) => ({ c: x.concurrency, v: x.ttftByRound[last]! / x.ttftByRound[0]! }));
  const share = pd.map((x) => ({ c: x.concurrency, v: x.cachedShare }));
  const at = (xs: AgentRun[], c: number) => xs.find((y) => y.concurrency === c)?.goodput ?? NaN;
  const gp = pd.map((x) => ({ c: x.concurrency, pd: x.goodput, colo: at(colo, x.concurrency), plain: at(plain, x.concurrency) }));
  const also = full === 'pd_local' ? ' (PD + prefix cache alone: ' : '';
  return [
    { goal: `round-${r.rounds} TTFT ≤ 1.5 × round 1 (${name})`, met: pd.length > 0 && ratio.every((x) => x.v <= 1.5), detail: ratio.map((x) => `${agentsN(x.c)} ${fmtRatio(x.v)}`).join(', ') },
    { goal: `cached share over rounds 2+ ≥ 60 % (${name})`, met: pd.length > 0 && share.every((x) => x.v >= 0.6), detail: share.map((x) => `${agentsN(x.c)} ${fmt(x.v * 100, 0)} %`).join(', ') },
    {
      goal: `PD agent goodput ≥ colocated at every concurrency (${name})`,
      met: pd.length > 0 && gp.every((x) => x.pd >= x.colo),
      detail: gp.map((x) => `${agentsN(x.c)} ${fmt(x.pd, 2)} vs ${fmt(x.colo, 2)}`).join(', ') + ' rounds/s' + (also ? `${also}${gp.map((x) => fmt(x.plain, 2)).join(' / ')})` : ''),
    },
  ];
}

/** Markdown lines of section 7 (the heading and the setups' description are the report template's; its goals are the summary's rows, `agentGoals`). `prov` is the provenance line; `plot` the SVG's path when written. */
export function agentsReport(r: AgentsResult | undefined, prov: string, plot: string | undefined): string[] {
  const L = [prov, ''];
  if (!r?.runs?.length) {
    L.push('_Not run yet._');
    return L;
  }
  // one row per setup, each cell its figures at every concurrency (the plot has the TTFT of every round)
  const setups = AGENT_SETUPS.filter((su) => r.runs.some((x) => x.setup === su));
  const anyFailed = r.runs.some((x) => x.failed > 0);
  const cell = (su: AgentSetup, f: (x: AgentRun) => string) => r.concurrencies.map((c) => r.runs.find((x) => x.setup === su && x.concurrency === c)).map((x) => (x ? f(x) : '—')).join(' / ');
  const rows = setups.map((su) => [
    SETUP_NAMES[su],
    cell(su, (x) => fmtRatio(x.ttftByRound[r.rounds - 1]! / x.ttftByRound[0]!)),
    cell(su, (x) => `${fmt(x.cachedShare * 100, 0)} %`),
    cell(su, (x) => fmt(x.goodput, 2)),
    su === 'colo' ? '—' : cell(su, (x) => (x.paths ? `${x.paths.decode_local}` : '—')),
    ...(anyFailed ? [cell(su, (x) => String(x.failed))] : []),
  ]);
  const head = ['setup', `TTFT r${r.rounds}/r1`, 'cached (r2+)', 'goodput rounds/s', 'rounds on decode alone', ...(anyFailed ? ['failed'] : [])];
  L.push(`${r.rounds} rounds (${r.toolTokens}-token tool result, ${r.outputTokens} tokens out; ~${r.systemTokens}-token system prompt); goodput: rounds/s within TTFT ≤ ${r.slo.ttftMs} ms, TPOT ≤ ${r.slo.tpotMs} ms. Each cell: ${r.concurrencies.join(' / ')} agent${r.concurrencies.length === 1 && r.concurrencies[0] === 1 ? '' : 's'} (${r.concurrencies.map((c) => c * r.rounds).join(' / ')} rounds)${anyFailed ? '' : '; no request failed'}.`, '');
  L.push(`| ${head.join(' | ')} |`, `|---|${head.slice(1).map(() => '---:').join('|')}|`, ...rows.map((x) => `| ${x.join(' | ')} |`));
  L.push('', "Without reuse every round evaluates the whole conversation again; with it only the new tool result, and a round on decode alone (decode-local) skips prefill and the KV transfer.");
  if (plot) L.push('', `![TTFT per round](${plot})`, '');
  return L;
}

/** A setup of the agents-at-scale run: PD + decode-local with the host's prefix store, without it, and the colocated server (with it). */
export type ScaleSetup = 'pd_store' | 'pd_nostore' | 'colo';
const SCALE_NAMES: Record<ScaleSetup, string> = { pd_store: 'PD + store', pd_nostore: 'PD, no store', colo: 'colocated + store' };

export interface ScaleOptions {
  model: string;
  contextSize: number;
  batchSize: number;
  /** Slots per decode worker. */
  decodeSlots: number;
  /** Decode workers of the PD stacks (one prefill). */
  decode: number;
  /** Concurrencies (agents at once). */
  agents: number[];
  rounds: number;
  timeoutMs?: number;
  /** Engine flags of every prefill, decode and colocated process, e.g. `['--gpu', 'vulkan', '--gpu-layers', 'max', '--gpu-device', '0']`. */
  engineArgs?: string[];
}

/** One setup at one concurrency, with the router's decode-local fallbacks. */
export interface ScaleRun extends AgentRun {
  scale: ScaleSetup;
  /** Requests the router sent down the decode-local path that came back needs_prefill (router metric delta). */
  fallbacks: number;
  /** Round-R / round-1 median TTFT. */
  ttftRatio: number;
  /** The setup's workers' prefix store counts over the run (metric deltas; zeros without a store). */
  store: StoreCounts;
  /** CPU seconds over the run (./cpu.ts; NaN without /proc): the setup's own processes by role, this bench process, the whole machine (all cores, every job on it). */
  cpu?: CpuSeconds;
}

/** CPU seconds of one run, see `ScaleRun.cpu`. */
export interface CpuSeconds {
  router: number;
  prefill: number;
  decode: number;
  colocated: number;
  bench: number;
  machine: number;
}

/** CPU seconds used so far by `procs` (summed per role), this process and the machine. */
function cpuNow(procs: readonly ClusterProc[]): CpuSeconds {
  const c: CpuSeconds = { router: 0, prefill: 0, decode: 0, colocated: 0, bench: 0, machine: machineBusySeconds() };
  for (const p of procs) c[p.role] += processCpuSeconds(p.child?.pid);
  const u = process.cpuUsage();
  c.bench = (u.user + u.system) / 1e6;
  return c;
}

interface StoreCounts {
  hits: number;
  misses: number;
  writes: number;
  dropped: number;
}

/** Sum of one counter of a /metrics text over label sets containing `labels`. */
function counterSum(text: string, name: string, labels: string): number {
  let sum = 0;
  for (const m of text.matchAll(new RegExp(`^${name}\\{([^}]*)\\} (\\S+)$`, 'gm'))) if (m[1]!.includes(labels)) sum += Number(m[2]);
  return sum;
}

async function metricsText(url: string, dispatcher: Dispatcher): Promise<string> {
  const res = await request(`${url}/metrics`, { dispatcher, signal: AbortSignal.timeout(10_000) });
  return res.body.text();
}

/** Fallbacks counted by the router and the store counts of `workers`, now. */
async function countsOf(router: string | undefined, workers: readonly string[], dispatcher: Dispatcher): Promise<{ fallbacks: number; store: StoreCounts }> {
  const fallbacks = router ? counterSum(await metricsText(router, dispatcher), 'pdserve_router_requests_by_path_total', 'path="fallback"') : 0;
  const store: StoreCounts = { hits: 0, misses: 0, writes: 0, dropped: 0 };
  for (const w of workers) {
    const t = await metricsText(w, dispatcher);
    const one = (name: string) => Number(new RegExp(`^${name} (\\S+)$`, 'm').exec(t)?.[1] ?? 0);
    store.hits += counterSum(t, 'pdserve_prefix_store_lookups_total', 'result="hit"');
    store.misses += counterSum(t, 'pdserve_prefix_store_lookups_total', 'result="miss"');
    store.writes += one('pdserve_prefix_store_writes_total');
    store.dropped += one('pdserve_prefix_store_dropped_total');
  }
  return { fallbacks, store };
}

/**
 * Agents at scale (the many-agents goal of the prefix store): N agents × R growing rounds at
 * once on 1 prefill + `decode` decode workers (router `--decode-policy cache_aware`), with the
 * host's prefix store and without it, and the colocated server; fresh conversations per run.
 * Per run: cached share of prompt tokens over rounds 2+, round-R / round-1 median TTFT,
 * decode-local fallbacks (needs_prefill) from the router's metrics, goodput.
 * @throws when a stack cannot start.
 */
export async function runAgentsScale(o: ScaleOptions): Promise<{ cfg: { systemTokens: number; toolTokens: number; outputTokens: number }; slo: AgentsResult['slo']; runs: ScaleRun[] }> {
  const cfg = { systemTokens: 120, toolTokens: 150, outputTokens: 24 };
  const slo = { ttftMs: 1500, tpotMs: 100 };
  const timeoutMs = o.timeoutMs ?? 300_000;
  const common = { model: o.model, prefill: 1, decode: o.decode, threads: 1, ctxSize: o.contextSize, batchSize: o.batchSize, decodeSlots: o.decodeSlots, prefillSlots: 1, startTimeoutMs: 120_000 };
  const router = ['--decode-policy', 'cache_aware'];
  const off = ['--prefix-store-bytes', '0'];
  // colocated gets as many slots as the decode workers together: the same concurrent sequences as PD
  const eng = o.engineArgs ?? [];
  const store = new Cluster({ ...common, colocated: true, extraArgs: { router, prefill: eng, decode: eng, colocated: ['--slots', String(o.decodeSlots * o.decode), ...eng] }, logDir: mkdtempSync(join(os.tmpdir(), 'pdserve-bench-scale-')) });
  const nostore = new Cluster({ ...common, colocated: false, extraArgs: { router, prefill: [...off, ...eng], decode: [...off, ...eng] }, logDir: mkdtempSync(join(os.tmpdir(), 'pdserve-bench-scale-ns-')) });
  const dispatcher = benchAgent(256);
  const tok = await loadTokenizer(o.model);
  const setups: ScaleSetup[] = ['pd_store', 'pd_nostore', 'colo'];
  try {
    await store.start();
    await nostore.start();
    const urls: Record<ScaleSetup, string> = { pd_store: store.router.url, pd_nostore: nostore.router.url, colo: store.colocated!.url };
    const model = await discoverModel(urls.pd_store, dispatcher);
    for (const s of setups) {
      const w = await chatRound(urls[s], model, [{ role: 'user', content: 'Warm up: say hello.' }], 4, dispatcher, timeoutMs);
      if (!w.ok) throw new Error(`warm-up request failed (${SCALE_NAMES[s]}): ${w.error}`);
    }
    const runs: ScaleRun[] = [];
    for (const [li, c] of o.agents.entries()) {
      for (const s of setups.map((_, i) => setups[(i + li) % setups.length]!)) {
        const convs = conversations(tok, c, o.rounds, `scale-${s}-c${c}`, cfg.systemTokens, cfg.toolTokens);
        const router = s === 'colo' ? undefined : urls[s];
        const workers = s === 'colo' ? [store.colocated!.url] : (s === 'pd_store' ? store : nostore).procs.filter((p) => p.role === 'prefill' || p.role === 'decode').map((p) => p.url);
        const own = s === 'colo' ? [store.colocated!] : (s === 'pd_store' ? store : nostore).procs.filter((p) => p.role !== 'colocated');
        const before = await countsOf(router, workers, dispatcher);
        const cpu0 = cpuNow(own);
        const run = await runSetup(s === 'colo' ? 'colo' : 'pd_local', urls[s], model, convs, { rounds: o.rounds, outputTokens: cfg.outputTokens, slo, dispatcher, timeoutMs });
        const cpu1 = cpuNow(own);
        const after = await countsOf(router, workers, dispatcher);
        const cpu = Object.fromEntries(Object.entries(cpu1).map(([k, v]) => [k, v - cpu0[k as keyof CpuSeconds]])) as unknown as CpuSeconds;
        const st: StoreCounts = { hits: after.store.hits - before.store.hits, misses: after.store.misses - before.store.misses, writes: after.store.writes - before.store.writes, dropped: after.store.dropped - before.store.dropped };
        const r: ScaleRun = { ...run, scale: s, fallbacks: after.fallbacks - before.fallbacks, ttftRatio: run.ttftByRound[o.rounds - 1]! / run.ttftByRound[0]!, store: st, cpu };
        say(`  ${SCALE_NAMES[s]}, ${c} agents: cached ${fmt(r.cachedShare * 100, 0)} %, TTFT r1 ${fmt(r.ttftByRound[0], 0)} ms r${o.rounds} ${fmt(r.ttftByRound[o.rounds - 1], 0)} ms (${fmtRatio(r.ttftRatio)}), fallbacks ${r.fallbacks} of ${r.rounds.length} requests, paths pd ${r.paths.pd} / local ${r.paths.decode_local}, store hits ${st.hits} / misses ${st.misses} / writes ${st.writes} / dropped ${st.dropped}, goodput ${fmt(r.goodput, 2)} rounds/s, failed ${r.failed}, load ${r.load}; CPU s router ${fmt(cpu.router, 1)} / prefill ${fmt(cpu.prefill, 1)} / decode ${fmt(cpu.decode, 1)} / colocated ${fmt(cpu.colocated, 1)}, machine ${fmt(cpu.machine / (run.wallMs / 1000), 2)} cores busy`);
        runs.push(r);
      }
    }
    return { cfg, slo, runs };
  } finally {
    await store.stop();
    await nostore.stop();
    await tok.dispose().catch(() => {});
    await dispatcher.close().catch(() => {});
  }
}

/**
 * The agents-at-scale table (markdown lines): one row per setup and concurrency; runs measured
 * with `cpu` add the CPU of the setup's own processes per completed round (ms) and the cores they
 * used on average over the run (CPU seconds / wall seconds).
 */
export function agentsScaleTable(runs: readonly ScaleRun[], rounds: number): string[] {
  const withCpu = runs.some((x) => x.cpu);
  const anyFailed = runs.some((x) => x.failed > 0);
  const head = ['setup', 'agents', 'cached (r2+)', `TTFT r${rounds} ms`, `r${rounds}/r1`, 'fallbacks / requests', 'rounds pd / decode-local', 'store hits / misses / writes', 'goodput rounds/s', ...(anyFailed ? ['failed'] : []), ...(withCpu ? ['CPU ms/round', 'cores used'] : [])];
  const cpuCells = (x: ScaleRun): string[] => {
    if (!withCpu) return [];
    if (!x.cpu) return ['n/a', 'n/a'];
    const own = x.cpu.router + x.cpu.prefill + x.cpu.decode + x.cpu.colocated;
    const done = x.rounds.filter((r) => r.ok).length;
    return [fmt(done ? (own * 1000) / done : NaN, 0), fmt(own / (x.wallMs / 1000), 2)];
  };
  const rows = runs.map((x) => [SCALE_NAMES[x.scale], x.concurrency, `${fmt(x.cachedShare * 100, 0)} %`, fmt(x.ttftByRound[rounds - 1], 0), fmtRatio(x.ttftRatio), x.scale === 'colo' ? '—' : `${x.fallbacks} / ${x.rounds.length}`, x.scale === 'colo' ? '—' : `${x.paths.pd} / ${x.paths.decode_local}`, `${x.store.hits} / ${x.store.misses} / ${x.store.writes}`, fmt(x.goodput, 2), ...(anyFailed ? [x.failed] : []), ...cpuCells(x)]);
  return [`| ${head.join(' | ')} |`, `|---|${head.slice(1).map(() => '---:').join('|')}|`, ...rows.map((r) => `| ${r.join(' | ')} |`)];
}
