/**
 * Agent trace replay (`pdserve bench-agents`): the sessions of a trace (./agent-trace.ts) sent
 * to an OpenAI-compatible endpoint as the agents would send them — each session's turns one
 * after another, a turn after the previous one completed plus its pause, a sub-agent after its
 * parent's spawning turn, the parent's next turn after its sub-agents — and the job-level
 * metrics: session completion time, TTFT p50/p90 by turn position, cached share by turn
 * (usage.prompt_tokens_details.cached_tokens) beside the trace's own upper bound, the router's
 * needs_prefill bounces and the workers' evictions by cause (from /metrics, where served).
 *
 * The target is any OpenAI endpoint (`--target URL`: a pdserve router or colocated server,
 * llama.cpp's llama-server, vLLM); by default the command starts its own stacks and replays the
 * same trace on each, one after another in a rotating order (`runTraceSetups`).
 */
import { setMaxListeners } from 'node:events';
import { mkdtempSync } from 'node:fs';
import os from 'node:os';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { setTimeout as delay } from 'node:timers/promises';
import { request, type Dispatcher } from 'undici';
import { ConfigError } from '../base/errors.js';
import { summarize } from '../observe/stats.js';
import { Cluster } from '../up/cluster.js';
import { inputTokens, SeenBlocks, sessionsOf, type AgentTrace, type BlockText, type TraceRequest } from './agent-trace.js';
import { streamedRound } from './agents.js';
import { benchAgent, discoverModel } from './index.js';
import { fmt, say } from './util.js';

/** What the client saw for one request of the trace (times in ms; NaN / null when not measured). */
export interface ReplayRecord {
  session: string;
  parent?: string;
  turn: number;
  /** The last turn of its session. */
  last: boolean;
  ok: boolean;
  /** Never sent (an earlier turn of its session failed, or the run's deadline passed). */
  notRun?: boolean;
  error?: string;
  /** Sent at, ms since the run's start. */
  sentMs: number;
  ttftMs: number;
  e2eMs: number;
  promptTokens: number;
  /** usage.prompt_tokens_details.cached_tokens; null when the endpoint does not report it. */
  cachedTokens: number | null;
  outputTokens: number;
  /** The trace's prompt tokens and the leading ones an earlier completed request had (the upper bound). */
  input: number;
  seen: number;
  /** x-pdserve-path (pd | decode_local); '' when the endpoint sends none. */
  path: string;
}

/** Per turn position (top-level sessions): TTFT percentiles and cached share beside the bound. */
export interface TurnStat {
  turn: number;
  n: number;
  ttftP50: number;
  ttftP90: number;
  /** Σ cached / Σ prompt tokens of the turn's requests; null when not reported. */
  cached: number | null;
  /** Σ seen / Σ input of the trace's blocks. */
  bound: number;
}

/** One replay of a trace on one endpoint. */
export interface ReplayRun {
  setup: string;
  name: string;
  repeat: number;
  wallMs: number;
  /** 1-min load average when the run ended. */
  load: number;
  sessions: number;
  sessionsOk: number;
  requests: number;
  /** Requests that failed or were never sent. */
  failed: number;
  /** Top-level session completion (first send → last turn done, sub-agents included), ms. */
  completion: { p50: number; p90: number; mean: number };
  byTurn: TurnStat[];
  /** Each top-level session's last turn. */
  lastTurn: { n: number; ttftP50: number; ttftP90: number };
  /** Over every request of turn ≥ 2 (sub-agents included): cached share and the trace's bound. */
  cached2: number | null;
  bound2: number;
  /** decode-local attempts answered needs_prefill (router metric delta); null without the router's /metrics. */
  bounces: number | null;
  paths: { pd: number; decode_local: number };
  /** Evictions by cause over the run (workers' metric deltas); null when no worker serves an eviction metric. */
  evictions: Record<string, number> | null;
  /** Up to 5 distinct error texts. */
  errors: string[];
  records: ReplayRecord[];
}

/** Where a replay sends and what it scrapes. */
export interface ReplayTarget {
  setup: string;
  name: string;
  /** Base URL of the OpenAI endpoint. */
  url: string;
  /** /metrics of the router (needs_prefill) and of the workers (evictions); undefined: try `url`'s. */
  routerMetrics?: string;
  workerMetrics?: string[];
}

/** Options of one replay. */
export interface ReplayOptions {
  model: string;
  endpoint: 'chat' | 'completions';
  text: BlockText;
  /** Trace times (pauses, arrival offsets) × this. */
  timeScale: number;
  dispatcher: Dispatcher;
  /** Per request, ms. */
  timeoutMs: number;
  /** Whole run, ms: requests not sent by then count as failed. */
  deadlineMs: number;
  /** Send the session id as `prompt_cache_key`. */
  sessionKey: boolean;
  repeat?: number;
}

class Deferred<T> {
  resolve!: (v: T) => void;
  readonly promise = new Promise<T>((r) => (this.resolve = r));
}

/** One streamed request (`streamedRound`, with the run's signal); never rejects. E2E is the time to the failure on a failed one. */
async function send(url: string, r: TraceRequest, o: ReplayOptions, signal: AbortSignal): Promise<Omit<ReplayRecord, 'session' | 'parent' | 'turn' | 'last' | 'input' | 'seen' | 'sentMs'>> {
  const start = performance.now();
  const chat = o.endpoint === 'chat';
  const body: Record<string, unknown> = { model: o.model, max_tokens: r.outputTokens, temperature: 0, ignore_eos: true };
  if (chat) body.messages = o.text.messages(r.blocks);
  else body.prompt = o.text.prompt(r.blocks);
  if (o.sessionKey) body.prompt_cache_key = r.session;
  const s = await streamedRound(url, chat ? '/v1/chat/completions' : '/v1/completions', body, { dispatcher: o.dispatcher, timeoutMs: o.timeoutMs, tpotIfOne: NaN, signal });
  return {
    ok: s.ok,
    ...(s.error !== undefined ? { error: s.error } : {}),
    ttftMs: s.ttftMs,
    e2eMs: Number.isNaN(s.e2eMs) ? performance.now() - start : s.e2eMs,
    promptTokens: s.promptTokens,
    cachedTokens: s.cachedReported ? s.cachedTokens : null,
    outputTokens: s.outputTokens,
    path: s.path,
  };
}

async function metricsText(url: string | undefined, dispatcher: Dispatcher): Promise<string | undefined> {
  if (!url) return undefined;
  try {
    const res = await request(`${url}/metrics`, { dispatcher, signal: AbortSignal.timeout(10_000) });
    const t = await res.body.text();
    return res.statusCode === 200 ? t : undefined;
  } catch {
    return undefined;
  }
}

/**
 * Sum of a counter over the label sets of a Prometheus text that contain `labels` (all label
 * sets when empty; a counter without labels too); undefined when the text has no such counter.
 */
export function counterSum(text: string, name: string, labels = ''): number | undefined {
  let sum: number | undefined;
  for (const m of text.matchAll(new RegExp(`^${name}(?:\\{([^}]*)\\})? (\\S+)$`, 'gm'))) {
    if (labels && !(m[1] ?? '').includes(labels)) continue;
    sum = (sum ?? 0) + Number(m[2]);
  }
  return sum;
}

/**
 * Evictions by cause in a worker's /metrics: `pdserve_cache_evictions_total{tier,cause}` as
 * `tier cause` (e.g. `sequence superseded`), zero when the counter is declared without samples;
 * the host prefix store's own LRU counter (`pdserve_prefix_store_evictions_total`) as
 * `prefix_store` where no `tier="store"` sample counts it already; undefined when neither is served.
 */
export function evictionsOf(text: string): Record<string, number> | undefined {
  let out: Record<string, number> | undefined = /^# TYPE pdserve_cache_evictions_total /m.test(text) ? {} : undefined;
  let storeTier = false;
  for (const m of text.matchAll(/^pdserve_cache_evictions_total\{([^}]*)\} (\S+)$/gm)) {
    const cause = /cause="([^"]*)"/.exec(m[1]!)?.[1] ?? 'unknown';
    const tier = /tier="([^"]*)"/.exec(m[1]!)?.[1];
    if (tier === 'store') storeTier = true;
    const k = tier ? `${tier} ${cause}` : cause;
    out ??= {};
    out[k] = (out[k] ?? 0) + Number(m[2]);
  }
  const store = counterSum(text, 'pdserve_prefix_store_evictions_total');
  if (store !== undefined && !storeTier) {
    out ??= {};
    out.prefix_store = (out.prefix_store ?? 0) + store;
  }
  return out;
}

interface Counts {
  bounces?: number;
  evictions?: Record<string, number>;
}

async function counts(t: ReplayTarget, dispatcher: Dispatcher): Promise<Counts> {
  const routerText = await metricsText(t.routerMetrics ?? t.url, dispatcher);
  const out: Counts = {};
  if (routerText !== undefined) {
    const b = counterSum(routerText, 'pdserve_router_requests_by_path_total', 'path="fallback"');
    // a router serves the counter from its first fallback on: a pdserve router without it has had none
    if (b !== undefined || /^pdserve_router_/m.test(routerText)) out.bounces = b ?? 0;
  }
  for (const w of t.workerMetrics ?? [t.url]) {
    const text = await metricsText(w, dispatcher);
    const e = text !== undefined ? evictionsOf(text) : undefined;
    if (!e) continue;
    out.evictions ??= {};
    for (const [k, v] of Object.entries(e)) out.evictions[k] = (out.evictions[k] ?? 0) + v;
  }
  return out;
}

/** The job-level summary of a replay's records (pure; `recordsSummary` is what `replayTrace` returns around it). */
export function summarizeRecords(records: readonly ReplayRecord[]): Pick<ReplayRun, 'sessions' | 'sessionsOk' | 'requests' | 'failed' | 'completion' | 'byTurn' | 'lastTurn' | 'cached2' | 'bound2' | 'paths'> {
  const ok = records.filter((r) => r.ok);
  const top = new Map<string, ReplayRecord[]>();
  const bySession = new Map<string, ReplayRecord[]>();
  for (const r of records) {
    const root = r.parent ?? r.session;
    if (!top.has(root)) top.set(root, []);
    top.get(root)!.push(r);
    if (!bySession.has(r.session)) bySession.set(r.session, []);
    bySession.get(r.session)!.push(r);
  }
  const completion: number[] = [];
  let sessionsOk = 0;
  for (const rs of top.values()) {
    if (!rs.every((r) => r.ok)) continue;
    sessionsOk++;
    const first = Math.min(...rs.map((r) => r.sentMs));
    const end = Math.max(...rs.map((r) => r.sentMs + r.e2eMs));
    completion.push(end - first);
  }
  const cs = summarize(completion);
  const share = (rs: readonly ReplayRecord[]) => {
    const withUsage = rs.filter((r) => r.cachedTokens !== null);
    const prompt = withUsage.reduce((a, r) => a + r.promptTokens, 0);
    return withUsage.length === 0 || prompt === 0 ? null : withUsage.reduce((a, r) => a + r.cachedTokens!, 0) / prompt;
  };
  const bound = (rs: readonly ReplayRecord[]) => {
    const input = rs.reduce((a, r) => a + r.input, 0);
    return input > 0 ? rs.reduce((a, r) => a + r.seen, 0) / input : 0;
  };
  const topOk = ok.filter((r) => r.parent === undefined);
  const maxTurn = topOk.reduce((a, r) => Math.max(a, r.turn), 0);
  const byTurn: TurnStat[] = [];
  for (let t = 1; t <= maxTurn; t++) {
    const rs = topOk.filter((r) => r.turn === t);
    if (rs.length === 0) continue;
    const s = summarize(rs.map((r) => r.ttftMs));
    byTurn.push({ turn: t, n: rs.length, ttftP50: s.p50, ttftP90: s.p90, cached: share(rs), bound: bound(rs) });
  }
  const last = summarize(topOk.filter((r) => r.last).map((r) => r.ttftMs));
  const later = ok.filter((r) => r.turn >= 2);
  return {
    sessions: top.size,
    sessionsOk,
    requests: records.length,
    failed: records.length - ok.length,
    completion: { p50: cs.p50, p90: cs.p90, mean: cs.mean },
    byTurn,
    lastTurn: { n: last.n, ttftP50: last.p50, ttftP90: last.p90 },
    cached2: share(later),
    bound2: bound(later),
    paths: { pd: ok.filter((r) => r.path === 'pd').length, decode_local: ok.filter((r) => r.path === 'decode_local').length },
  };
}

/**
 * Replay `trace` on `target`: every session concurrently, each turn when its dependencies
 * allow (see the file's comment), every request streamed with `ignore_eos` and the trace's
 * output length. The upper bound of a request is taken at its send time over the requests
 * completed before it. Never rejects on a request's failure (recorded); the run stops sending
 * at `deadlineMs`.
 */
export async function replayTrace(trace: AgentTrace, target: ReplayTarget, o: ReplayOptions): Promise<ReplayRun> {
  const sessions = sessionsOf(trace);
  const key = (s: string, t: number) => `${s}#${t}`;
  const turnDone = new Map<string, Deferred<boolean>>();
  const sessionDone = new Map<string, Deferred<boolean>>();
  for (const [id, reqs] of sessions) {
    sessionDone.set(id, new Deferred());
    for (const r of reqs) turnDone.set(key(id, r.turn), new Deferred());
  }
  const seen = new SeenBlocks();
  const records: ReplayRecord[] = [];
  const before = await counts(target, o.dispatcher);
  const run = new AbortController();
  // every session waits on the run's signal at once (its pauses and its request): one listener each
  setMaxListeners(2 * sessions.size + 16, run.signal);
  const timer = setTimeout(() => run.abort(), o.deadlineMs);
  const t0 = performance.now();
  try {
    await Promise.all(
      [...sessions].map(async ([id, reqs]) => {
        let ok = true;
        let prevDone = performance.now();
        for (const [i, r] of reqs.entries()) {
          const base = { session: id, ...(r.parent !== undefined ? { parent: r.parent } : {}), turn: r.turn, last: i === reqs.length - 1, input: inputTokens(r) };
          if (ok && r.after) ok = (await turnDone.get(key(r.after.session, r.after.turn))?.promise) ?? true;
          if (ok && r.waitFor) for (const w of r.waitFor) await sessionDone.get(w)?.promise; // a failed sub-agent still returns to its parent
          if (ok) {
            const at = Math.max(prevDone + r.delayMs * o.timeScale, r.atMs !== undefined ? t0 + r.atMs * o.timeScale : 0);
            await delay(at - performance.now(), undefined, { signal: run.signal }).catch(() => {});
            if (run.signal.aborted) ok = false;
          }
          if (!ok) {
            records.push({ ...base, ok: false, notRun: true, sentMs: NaN, ttftMs: NaN, e2eMs: NaN, promptTokens: 0, cachedTokens: null, outputTokens: 0, seen: 0, path: '' });
            turnDone.get(key(id, r.turn))!.resolve(false);
            continue;
          }
          const sentMs = performance.now() - t0;
          const s = seen.seen(r.blocks);
          const res = await send(target.url, r, o, run.signal);
          records.push({ ...base, ...res, sentMs, seen: s });
          if (res.ok) seen.add(r.blocks);
          ok = res.ok;
          prevDone = performance.now();
          turnDone.get(key(id, r.turn))!.resolve(ok);
        }
        sessionDone.get(id)!.resolve(ok);
      }),
    );
  } finally {
    clearTimeout(timer);
  }
  const wallMs = performance.now() - t0;
  const after = await counts(target, o.dispatcher);
  let evictions: Record<string, number> | null = null;
  if (after.evictions) {
    evictions = {};
    for (const [k, v] of Object.entries(after.evictions)) evictions[k] = v - (before.evictions?.[k] ?? 0);
  }
  const errors = [...new Set(records.filter((r) => r.error).map((r) => r.error!))].slice(0, 5);
  return {
    setup: target.setup,
    name: target.name,
    repeat: o.repeat ?? 1,
    wallMs,
    load: Math.round(os.loadavg()[0]! * 100) / 100,
    ...summarizeRecords(records),
    bounces: after.bounces !== undefined ? after.bounces - (before.bounces ?? 0) : null,
    evictions,
    errors,
    records,
  };
}

// ----------------------------------------------------------------------------------- setups

/** The stacks `bench-agents` starts: PD with prefix reuse (cache_aware), the colocated server, PD with reuse off. */
export type TraceSetup = 'pd' | 'colo' | 'pd_noreuse';
export const TRACE_SETUPS: readonly TraceSetup[] = ['pd', 'colo', 'pd_noreuse'];
export const TRACE_SETUP_NAMES: Record<TraceSetup, string> = { pd: 'PD + prefix reuse', colo: 'colocated + prefix reuse', pd_noreuse: 'PD, prefix reuse off' };

/** Options of `runTraceSetups`. */
export interface TraceSetupsOptions {
  trace: AgentTrace;
  /** GGUF the stacks serve. */
  model: string;
  setups: readonly TraceSetup[];
  /** Replays of the trace per setup (the order of setups rotates each time). */
  repeats: number;
  decode: number;
  decodeSlots: number;
  ctxSize: number;
  batchSize: number;
  endpoint: 'chat' | 'completions';
  /** Block text for a salt (each run gets its own, so no run reuses another's cache). */
  textFor: (salt: number) => BlockText;
  timeScale: number;
  timeoutMs: number;
  deadlineMs: number;
  sessionKey: boolean;
  /** Engine flags of every prefill, decode and colocated process (e.g. a GPU backend). */
  engineArgs?: string[];
}

/**
 * Start the stacks of `setups` (PD 1 prefill + `decode` decode with `--decode-policy
 * cache_aware` and its colocated server in one cluster; PD with `--no-prefix-cache
 * --prefix-store-bytes 0` on every worker and decode-local off in another), replay the trace
 * on each, `repeats` times with the order rotating, stop them.
 * @throws ConfigError when a stack cannot start or a warm-up request fails.
 */
export async function runTraceSetups(o: TraceSetupsOptions): Promise<ReplayRun[]> {
  const common = { model: o.model, prefill: 1, decode: o.decode, threads: 1, ctxSize: o.ctxSize, batchSize: o.batchSize, decodeSlots: o.decodeSlots, prefillSlots: 1, startTimeoutMs: 120_000 };
  const eng = o.engineArgs ?? [];
  const off = ['--no-prefix-cache', '--prefix-store-bytes', '0'];
  const wantReuse = o.setups.includes('pd') || o.setups.includes('colo');
  const reuse = wantReuse
    ? new Cluster({ ...common, colocated: o.setups.includes('colo'), extraArgs: { router: ['--decode-policy', 'cache_aware'], prefill: eng, decode: eng, colocated: ['--slots', String(o.decodeSlots * o.decode), ...eng] }, logDir: mkdtempSync(join(os.tmpdir(), 'pdserve-bench-trace-')) })
    : undefined;
  const noreuse = o.setups.includes('pd_noreuse') ? new Cluster({ ...common, colocated: false, extraArgs: { router: ['--decode-policy', 'cache_aware', '--local-prefill-max-tokens', '0'], prefill: [...off, ...eng], decode: [...off, ...eng] }, logDir: mkdtempSync(join(os.tmpdir(), 'pdserve-bench-trace-nr-')) }) : undefined;
  const dispatcher = benchAgent(512);
  try {
    say(`bench-agents: starting the stacks (${o.setups.map((s) => TRACE_SETUP_NAMES[s]).join('; ')})`);
    await reuse?.start();
    await noreuse?.start();
    const workers = (c: Cluster) => c.procs.filter((p) => p.role === 'prefill' || p.role === 'decode').map((p) => p.url);
    const targets: Record<TraceSetup, ReplayTarget | undefined> = {
      pd: reuse ? { setup: 'pd', name: TRACE_SETUP_NAMES.pd, url: reuse.router.url, routerMetrics: reuse.router.url, workerMetrics: workers(reuse) } : undefined,
      colo: reuse?.colocated ? { setup: 'colo', name: TRACE_SETUP_NAMES.colo, url: reuse.colocated.url, workerMetrics: [reuse.colocated.url] } : undefined,
      pd_noreuse: noreuse ? { setup: 'pd_noreuse', name: TRACE_SETUP_NAMES.pd_noreuse, url: noreuse.router.url, routerMetrics: noreuse.router.url, workerMetrics: workers(noreuse) } : undefined,
    };
    const list = o.setups.map((s) => targets[s]!);
    return await replayOnTargets(o.trace, list, { ...o, dispatcher });
  } finally {
    await reuse?.stop();
    await noreuse?.stop();
    await dispatcher.close().catch(() => {});
  }
}

/**
 * Replay the trace on each target (a warm-up request first), `repeats` times, the order of
 * targets rotating per repeat; each run gets its own block-text salt.
 * @throws ConfigError when a warm-up request fails.
 */
export async function replayOnTargets(trace: AgentTrace, targets: readonly ReplayTarget[], o: Omit<TraceSetupsOptions, 'setups' | 'model' | 'decode' | 'decodeSlots' | 'ctxSize' | 'batchSize' | 'trace'> & { dispatcher: Dispatcher; servedModel?: string }): Promise<ReplayRun[]> {
  const runs: ReplayRun[] = [];
  const models = new Map<string, string>();
  for (const t of targets) {
    const model = o.servedModel ?? (await discoverModel(t.url, o.dispatcher));
    models.set(t.url, model);
    const warm = await send(t.url, { session: 'warm-up', turn: 1, delayMs: 0, outputTokens: 2, blocks: [{ id: 1e9, tokens: 8 }] }, { model, endpoint: o.endpoint, text: o.textFor(9999), timeScale: 1, dispatcher: o.dispatcher, timeoutMs: o.timeoutMs, deadlineMs: o.deadlineMs, sessionKey: false }, new AbortController().signal);
    if (!warm.ok) throw new ConfigError(`warm-up request to ${t.name} (${t.url}) failed: ${warm.error}`);
  }
  for (let rep = 0; rep < o.repeats; rep++) {
    for (let i = 0; i < targets.length; i++) {
      const t = targets[(i + rep) % targets.length]!;
      const salt = rep * 64 + targets.indexOf(t) + 1;
      const r = await replayTrace(trace, t, { model: models.get(t.url)!, endpoint: o.endpoint, text: o.textFor(salt), timeScale: o.timeScale, dispatcher: o.dispatcher, timeoutMs: o.timeoutMs, deadlineMs: o.deadlineMs, sessionKey: o.sessionKey, repeat: rep + 1 });
      say(
        `  ${t.name}${o.repeats > 1 ? ` (repeat ${rep + 1})` : ''}: ${r.sessionsOk}/${r.sessions} sessions, ${r.failed} of ${r.requests} requests failed; completion p50 ${fmt(r.completion.p50 / 1000, 2)} s; TTFT p90 turn 2 ${fmt(r.byTurn.find((x) => x.turn === 2)?.ttftP90, 0)} ms, last ${fmt(r.lastTurn.ttftP90, 0)} ms; cached 2+ ${r.cached2 === null ? 'n/a' : fmt(r.cached2 * 100, 0) + ' %'} (bound ${fmt(r.bound2 * 100, 0)} %); bounces ${r.bounces ?? 'n/a'}; load ${r.load}${r.errors.length ? `; errors: ${r.errors.join(' | ')}` : ''}`,
      );
      runs.push(r);
    }
  }
  return runs;
}
