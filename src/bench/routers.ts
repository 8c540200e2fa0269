/**
 * `pdserve bench-routers`: the scale-out benchmark. Two routers in front of one cluster (1
 * prefill + 2 decode workers, etcd membership, `--decode-policy cache_aware`), nginx in front of
 * both (OPERATIONS.md's config; without nginx installed the sessions go to the routers directly,
 * and it says so), then two phases on the same cluster:
 *
 * | phase | what runs | what is measured |
 * |---|---|---|
 * | streams | `streams` long streams per router, sent to the routers in turn, each once both routers count the streams sent before it (GET /workers: own load + others'; deadline 3 s; a pick within one round trip of another router's is the documented race) | the decodes' GET /load, sampled every 15 ms: samples where a decode holds more requests than slots while the other has a slot free; how long each send waited for both routers to see the earlier streams |
 * | sessions | `sessions` agent conversations of `turns` turns each (a `prompt_cache_key` per session), through nginx with the openai SDK (its own `maxRetries`); router A is SIGKILLed once half the turns are done | per turn: the decode that served it (the router's GET /debug/traces/:id, the request's `x-request-id`), its path, `usage.prompt_tokens_details.cached_tokens`; router B's `pdserve_router_requests_total` by outcome; the 5xx answers and connection errors the SDK retried |
 *
 * "Reached the worker holding its cache": a session's first turn that completes after the kill
 * was served by the decode that served (and kept: decode `--prefix-cache-slots` covers its share
 * of the sessions) the session's previous turn. Goals:
 * ≥ 95 % of sessions; cached share of turns 2+ drops ≤ 5 points across the kill; 0 failed through
 * B; 0 failed at the client after the SDK's retries (behind nginx); no request waits for a slot
 * while a decode has one free.
 */
import { mkdtempSync } from 'node:fs';
import os from 'node:os';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import type OpenAI from 'openai';
import { ConfigError } from '../base/errors.js';
import { Cluster, type ClusterProc } from '../up/cluster.js';
import { nginxBinary, startNginx, type LocalNginx } from '../up/nginx.js';
import { conversations } from './agents.js';
import { loadTokenizer } from './index.js';
import { fmt, median, say, sleep } from './util.js';

/** Options of `pdserve bench-routers` (see the module doc). Times in ms. */
export interface RoutersOptions {
  /** GGUF path. */
  model: string;
  sessions: number;
  turns: number;
  /** Tokens of each session's system prompt, of each turn's tool result, and each reply (max_tokens, EOS ignored). */
  systemTokens: number;
  toolTokens: number;
  outputTokens: number;
  /** Pause of a session between its turns. */
  thinkMs: number;
  /** Sequence slots per decode worker; finished conversations each decode keeps (`--prefix-cache-slots`). */
  decodeSlots: number;
  keepSlots: number;
  ctxSize: number;
  /** The openai SDK's maxRetries, and its per-request timeout. */
  maxRetries: number;
  timeoutMs: number;
  /** Streams phase: streams per router, tokens each. */
  streams: number;
  streamTokens: number;
  /** Put nginx in front when it is installed (false: the sessions go to the routers directly). */
  nginx: boolean;
}

/** One turn as the client saw it. `at`: ms since the phase began. */
export interface TurnRecord {
  session: number;
  turn: number;
  /** Its `x-request-id` (the routers' trace id). */
  id: string;
  ok: boolean;
  error?: string;
  /** When the client sent it (the SDK's retries included) and when it completed or failed. */
  sentAt: number;
  doneAt: number;
  promptTokens: number;
  cachedTokens: number;
  /** Decode URL, path (pd | decode_local) and router (A | B) from the serving router's trace; null when none answered. */
  decode: string | null;
  path: string | null;
  router: 'A' | 'B' | null;
  /** When the serving router dispatched its last attempt (its trace's last `dispatched` event, on the `sentAt` clock); absent when unknown. */
  routedAt?: number;
}

/** What the sessions' turns say about the kill (see `sessionFigures`). */
export interface SessionFigures {
  /** Turns through A and B completed before the kill (from the traces). */
  beforeByRouter: { A: number; B: number };
  /** Sessions with a turn routed after the kill whose turn before it has a known decode. */
  nextTurns: number;
  /** Of those: served by the decode that served the turn before; served decode-local (on the kept sequence itself); in flight at the kill. */
  sameDecode: number;
  decodeLocal: number;
  inFlight: number;
  /** Sessions left out: a turn without a trace. */
  unknown: number;
  /** cached / prompt tokens of the turns 2+ completed before and after the kill (NaN: none). */
  cachedBefore: number;
  cachedAfter: number;
  /** Turns that failed at the client after the SDK's retries. */
  failedClient: number;
}

/**
 * The kill's figures from the client's turn records: per session, its first turn routed after
 * `killAt` (its last dispatch; the completion time where the trace has none) against the turn
 * before it (the decode that served, and kept, the conversation) — a turn routed before the
 * kill and finishing after it is not a decision made after the kill; the cached share of turns
 * 2+ completed on each side of the kill.
 */
export function sessionFigures(turns: readonly TurnRecord[], killAt: number, sessions: number): SessionFigures {
  const f: SessionFigures = { beforeByRouter: { A: 0, B: 0 }, nextTurns: 0, sameDecode: 0, decodeLocal: 0, inFlight: 0, unknown: 0, cachedBefore: NaN, cachedAfter: NaN, failedClient: turns.filter((t) => !t.ok).length };
  for (let s = 0; s < sessions; s++) {
    const own = turns.filter((t) => t.session === s && t.ok).sort((a, b) => a.doneAt - b.doneAt);
    const i = own.findIndex((t) => (t.routedAt ?? t.doneAt) > killAt);
    if (i <= 0) continue; // no turn after the kill, or none before it
    const prev = own[i - 1]!;
    const next = own[i]!;
    if (prev.decode === null || next.decode === null) {
      f.unknown++;
      continue;
    }
    f.nextTurns++;
    if (next.decode === prev.decode) f.sameDecode++;
    if (next.path === 'decode_local') f.decodeLocal++;
    if (next.sentAt < killAt) f.inFlight++;
  }
  for (const t of turns) if (t.ok && t.doneAt <= killAt && t.router) f.beforeByRouter[t.router]++;
  const share = (xs: TurnRecord[]) => {
    const p = xs.reduce((a, t) => a + t.promptTokens, 0);
    return p > 0 ? xs.reduce((a, t) => a + t.cachedTokens, 0) / p : NaN;
  };
  const later = turns.filter((t) => t.ok && t.turn >= 2);
  f.cachedBefore = share(later.filter((t) => t.doneAt <= killAt));
  f.cachedAfter = share(later.filter((t) => t.doneAt > killAt));
  return f;
}

/**
 * The goals, met or missed, with their figures. `throughB`: router B's finished requests by
 * outcome; `sdkRetried`: 5xx answers and connection errors the SDK saw; `lb`: what stood in
 * front of the routers (without nginx the load-balancer goal is not measured: missed).
 */
export function routersGoals(lb: 'nginx' | 'none', streams: RoutersResult['streams'], f: SessionFigures, turns: number, throughB: Record<string, number>, sdkRetried: number): RoutersGoal[] {
  const pct = (x: number) => `${fmt(x * 100, 1)} %`;
  const held = f.nextTurns > 0 ? f.sameDecode / f.nextTurns : NaN;
  const failedB = Object.entries(throughB).reduce((n, [k, v]) => n + (k === 'ok' ? 0 : v), 0);
  const dropped = f.cachedBefore - f.cachedAfter;
  return [
    { goal: "≥ 95 % of sessions' next turn after A's kill reaches the decode holding their cache", figure: `${f.sameDecode} of ${f.nextTurns} (${pct(held)}); ${f.decodeLocal} served decode-local on the kept sequence; ${f.inFlight} were in flight at the kill${f.unknown ? `; ${f.unknown} without a trace, left out` : ''}`, met: f.nextTurns > 0 && held >= 0.95 },
    { goal: 'cached share of turns 2+ drops ≤ 5 points across the kill', figure: `${pct(f.cachedBefore)} before, ${pct(f.cachedAfter)} after (${dropped > 0 ? `${fmt(dropped * 100, 1)} points drop` : 'no drop'})`, met: Number.isFinite(dropped) && dropped <= 0.05 },
    { goal: 'requests through B: 0 failed', figure: `${failedB} failed of ${Object.values(throughB).reduce((a, b) => a + b, 0)} (${Object.entries(throughB).map(([k, v]) => `${k} ${v}`).join(', ')})`, met: failedB === 0 && (throughB.ok ?? 0) > 0 },
    { goal: "behind nginx, the openai SDK's own retries carry A's clients over: 0 failed", figure: lb === 'nginx' ? `${f.failedClient} failed of ${turns} turns; ${sdkRetried} answers of 5xx / connection errors retried by the SDK` : `not measured: no nginx (${f.failedClient} failed at the client going direct)`, met: lb === 'nginx' && f.failedClient === 0 },
    { goal: '2 routers × 4 streams on 2 decodes: no request waits for a slot while a decode has one free', figure: `${streams.waited} of ${streams.samples} load samples (most waiting at once ${streams.mostWaiting}; most rooms per decode ${streams.mostRooms.join(' / ')} of ${streams.slots} slots; ${streams.failed} streams failed; each sent once both routers counted the earlier ones: ${fmt(streams.lagMs.median, 0)} ms median, ${fmt(streams.lagMs.max, 0)} ms max wait${streams.unseen ? `, ${streams.unseen} sent at the ${STREAM_SEEN_MS / 1000} s deadline` : ''})`, met: streams.waited === 0 && streams.failed === 0 && streams.samples > 0 },
  ];
}

/** One goal, met or missed, with its figure. */
export interface RoutersGoal {
  goal: string;
  figure: string;
  met: boolean;
}

/** What `runBenchRouters` measured. */
export interface RoutersResult {
  lb: 'nginx' | 'none';
  options: RoutersOptions;
  wallS: number;
  loadavg: number[];
  /** CPU cores of the machine that ran it. */
  cores?: number;
  streams: {
    samples: number;
    waited: number;
    mostWaiting: number;
    mostRooms: number[];
    slots: number;
    failed: number;
    /** ms each send waited until both routers counted the streams sent before it: median, max; sends that went at the deadline. */
    lagMs: { median: number; max: number };
    unseen: number;
  };
  sessions: SessionFigures & {
    killAt: number;
    turns: TurnRecord[];
    /** Router B's finished requests by outcome over the sessions phase. */
    throughB: Record<string, number>;
    /** 5xx answers and connection errors the SDK saw (and retried). */
    sdkRetried: number;
    /** Router B's decode picks by reason over the turns after the kill. */
    picksAfterB: Record<string, number>;
  };
  goals: RoutersGoal[];
}

/** Sum of a counter's series whose labels contain `match`, by the value of `label`. */
export function countersBy(text: string, name: string, label: string, match = ''): Record<string, number> {
  const out: Record<string, number> = {};
  const re = new RegExp(`^${name}\\{([^}]*)\\} (\\S+)$`, 'gm');
  for (const m of text.matchAll(re)) {
    if (!m[1]!.includes(match)) continue;
    const v = new RegExp(`${label}="([^"]*)"`).exec(m[1]!)?.[1];
    if (v !== undefined) out[v] = (out[v] ?? 0) + Number(m[2]);
  }
  return out;
}
const diff = (a: Record<string, number>, b: Record<string, number>): Record<string, number> => Object.fromEntries(Object.keys(a).map((k) => [k, a[k]! - (b[k] ?? 0)]).filter(([, v]) => v !== 0));

async function metricsOf(url: string): Promise<string> {
  try {
    return await (await fetch(`${url}/metrics`, { signal: AbortSignal.timeout(5000) })).text();
  } catch {
    return '';
  }
}

/** The streams phase (see the module doc). */
async function streamsPhase(routers: ClusterProc[], decodes: ClusterProc[], model: string, o: RoutersOptions): Promise<RoutersResult['streams']> {
  const samples: { rooms: number; slots: number }[][] = [];
  let sampling = true;
  const sampler = (async () => {
    while (sampling) {
      try {
        samples.push(await Promise.all(decodes.map(async (d) => (await (await fetch(`${d.url}/load`, { signal: AbortSignal.timeout(2000) })).json()) as { rooms: number; slots: number })));
      } catch {
        // a missed sample
      }
      await sleep(15);
    }
  })();
  const sends: Promise<boolean>[] = [];
  const lags: number[] = [];
  let unseen = 0;
  // decode requests router r counts: its own in flight plus the others' the workers report (-1: no answer)
  const seen = async (r: ClusterProc): Promise<number> => {
    try {
      const ws = ((await (await fetch(`${r.url}/workers`, { signal: AbortSignal.timeout(2000) })).json()) as { workers: { role: string; load: number; others_load?: number }[] }).workers;
      return ws.filter((w) => w.role === 'decode').reduce((n, w) => n + w.load + (w.others_load ?? 0), 0);
    } catch {
      return -1;
    }
  };
  try {
    for (let i = 0; i < o.streams * routers.length; i++) {
      const r = routers[i % routers.length]!;
      const t0 = performance.now();
      for (;;) {
        if ((await Promise.all(routers.map(seen))).every((n) => n >= i)) break;
        if (performance.now() - t0 > STREAM_SEEN_MS) {
          unseen++;
          break;
        }
        await sleep(10);
      }
      lags.push(performance.now() - t0);
      sends.push(
        (async () => {
          try {
            const res = await fetch(`${r.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model, prompt: `Stream ${i} of the two-router check. Once upon a time`, max_tokens: o.streamTokens, temperature: 0, ignore_eos: true, stream: true }), signal: AbortSignal.timeout(o.timeoutMs) });
            const text = await res.text();
            return res.status === 200 && text.includes('data: [DONE]') && !text.includes('"error"');
          } catch {
            return false;
          }
        })(),
      );
    }
  } finally {
    await Promise.allSettled(sends);
    sampling = false;
    await sampler;
  }
  const waited = samples.filter((s) => s.some((x) => x.rooms > x.slots) && s.some((x) => x.rooms < x.slots));
  return {
    samples: samples.length,
    waited: waited.length,
    mostWaiting: Math.max(0, ...waited.map((s) => s.reduce((n, x) => n + Math.max(0, x.rooms - x.slots), 0))),
    mostRooms: decodes.map((_, i) => Math.max(0, ...samples.map((s) => s[i]!.rooms))),
    slots: samples[0]?.[0]?.slots ?? NaN,
    failed: (await Promise.all(sends)).filter((ok) => !ok).length,
    lagMs: { median: median(lags), max: Math.max(0, ...lags) },
    unseen,
  };
}

/** How long a stream waits for both routers to count the streams sent before it, ms. */
const STREAM_SEEN_MS = 3000;

/** A router's recent traces (GET /debug/traces, at most 500) by trace id: decode and the path of the last dispatch; empty when it does not answer. */
async function recentTraces(url: string, wall0: number): Promise<Map<string, Served>> {
  const out = new Map<string, Served>();
  try {
    const j = (await (await fetch(`${url}/debug/traces?limit=500`, { signal: AbortSignal.timeout(5000) })).json()) as { traces: TraceJson[] };
    for (const t of j.traces) out.set(t.trace, servedBy(t, wall0));
  } catch {
    // none
  }
  return out;
}

/** A trace as GET /debug/traces gives it (the fields read here). */
interface TraceJson {
  trace: string;
  decode: string | null;
  events: { at: number; what: string; path?: string }[];
}

/** Where a trace says its request was served: decode, the path and time of its last dispatch. */
type Served = Pick<TurnRecord, 'decode' | 'path' | 'routedAt'>;

/** `Served` of trace `t`, its dispatch time on the phase clock that started at wall ms `wall0`. */
function servedBy(t: TraceJson, wall0: number): Served {
  const last = t.events.filter((e) => e.what === 'dispatched').at(-1);
  return { decode: t.decode, path: last?.path ?? null, ...(last ? { routedAt: last.at - wall0 } : {}) };
}

/** The serving router's trace of request `id`: decode, path and time of its last dispatch, which router. */
async function traceOf(id: string, routers: { name: 'A' | 'B'; url: string }[], wall0: number): Promise<Served & { router: 'A' | 'B' | null }> {
  for (const r of routers) {
    try {
      const res = await fetch(`${r.url}/debug/traces/${encodeURIComponent(id)}`, { signal: AbortSignal.timeout(2000) });
      if (res.status !== 200) continue;
      return { ...servedBy((await res.json()) as TraceJson, wall0), router: r.name };
    } catch {
      // dead or not this router's
    }
  }
  return { decode: null, path: null, router: null };
}

/**
 * Start the cluster (and nginx), run both phases, stop everything.
 * @returns the figures and the goals, met or missed.
 * @throws ConfigError without an etcd binary or when the openai package is missing; PdError START_FAILED when a process does not start.
 */
export async function runBenchRouters(o: RoutersOptions): Promise<RoutersResult> {
  let OpenAICtor: typeof OpenAI;
  try {
    OpenAICtor = (await import('openai')).default;
  } catch {
    throw new ConfigError('bench-routers drives the sessions with the openai SDK: npm install openai (a devDependency of pdserve)');
  }
  const t0 = performance.now();
  const useNginx = o.nginx && nginxBinary() !== null;
  if (o.nginx && !useNginx) say('bench-routers: nginx is NOT installed (apt-get install nginx-light): sessions go to the routers directly, a client of A fails over by itself; the load-balancer goal is not measured');
  const tok = await loadTokenizer(o.model);
  const convs = conversations(tok, o.sessions, o.turns, 'bench-routers', o.systemTokens, o.toolTokens);
  await tok.dispose().catch(() => {});
  const c = new Cluster({
    model: o.model,
    prefill: 1,
    decode: 2,
    routers: 2,
    threads: 1,
    ctxSize: o.ctxSize,
    decodeSlots: o.decodeSlots,
    prefillSlots: 1,
    startTimeoutMs: 120_000,
    logDir: mkdtempSync(join(os.tmpdir(), 'pdserve-bench-routers-')),
    extraArgs: { router: ['--decode-policy', 'cache_aware'], decode: ['--prefix-cache-slots', String(o.keepSlots)] },
  });
  let lb: LocalNginx | undefined;
  try {
    say(`bench-routers: starting 1 prefill + 2 decode (${o.decodeSlots} slots, ${o.keepSlots} kept conversations each), 2 routers, etcd${useNginx ? ', nginx' : ''}`);
    await c.start();
    const [ra, rb] = c.byRole('router') as [ClusterProc, ClusterProc];
    const decodes = c.byRole('decode');
    const named = [
      { name: 'B' as const, url: rb.url },
      { name: 'A' as const, url: ra.url },
    ];
    // both routers route with every worker's load before anything is measured
    const end = Date.now() + 20_000;
    for (const r of [ra, rb]) {
      while (((await (await fetch(`${r.url}/workers`, { signal: AbortSignal.timeout(2000) })).json()) as { workers: { healthy: boolean }[] }).workers.filter((w) => w.healthy).length < 3) {
        if (Date.now() > end) throw new ConfigError(`router ${r.name} did not see the 3 workers within 20 s`);
        await sleep(100);
      }
    }
    if (useNginx) lb = await startNginx([ra.url, rb.url]);
    const model = 'pdserve';
    for (const r of [ra, rb]) await fetch(`${r.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model, prompt: 'Warm up', max_tokens: 4 }), signal: AbortSignal.timeout(o.timeoutMs) });

    say(`bench-routers: streams phase: ${o.streams} streams × 2 routers on 2 decodes, ${o.streamTokens} tokens each, each sent once both routers count the earlier ones`);
    const streams = await streamsPhase([ra, rb], decodes, model, o);
    say(`  ${streams.samples} load samples, most rooms per decode ${streams.mostRooms.join(' / ')} (slots ${streams.slots}), samples with a request waiting while a slot was free: ${streams.waited}; both routers saw the earlier streams after ${fmt(streams.lagMs.median, 0)} ms median, ${fmt(streams.lagMs.max, 0)} ms max`);

    say(`bench-routers: sessions phase: ${o.sessions} sessions × ${o.turns} turns through ${useNginx ? `nginx (${lb!.url})` : 'the routers directly'}, openai SDK maxRetries ${o.maxRetries}; router A SIGKILLed at the midpoint`);
    let sdkRetried = 0;
    const counted: typeof fetch = async (url, init) => {
      try {
        const r = await fetch(url, init);
        if (r.status >= 500) sdkRetried++;
        return r;
      } catch (err) {
        sdkRetried++;
        throw err;
      }
    };
    const sdkOf = (baseURL: string) => new OpenAICtor({ baseURL: `${baseURL}/v1`, apiKey: 'none', maxRetries: o.maxRetries, timeout: o.timeoutMs, fetch: counted });
    const viaLb = lb ? sdkOf(lb.url) : undefined;
    const direct = { A: sdkOf(ra.url), B: sdkOf(rb.url) };
    const bBefore = await metricsOf(rb.url);
    const turns: TurnRecord[] = [];
    const phase0 = performance.now();
    const wall0 = Date.now(); // the routers' trace times are wall ms
    const half = Math.floor((o.sessions * o.turns) / 2);
    let done = 0;
    let killAt = NaN;
    let picksAtKill = '';
    let killing: Promise<void> | undefined;
    const lookups = new Set<Promise<unknown>>();
    let aTraces = new Map<string, Served>();
    const aDead = () => !Number.isNaN(killAt);
    await Promise.all(
      convs.map(async (conv, session) => {
        const messages: { role: 'system' | 'user' | 'assistant'; content: string }[] = [{ role: 'system', content: conv.system }];
        await sleep((session * 37) % 200); // sessions start spread out, as agents do
        for (let turn = 1; turn <= o.turns; turn++) {
          messages.push({ role: 'user', content: `Tool result ${turn}:\n${conv.tools[turn - 1]}` });
          const id = `bench-routers-${process.pid}-${session}-${turn}`;
          const body = { model, messages, max_tokens: o.outputTokens, temperature: 0, ignore_eos: true, prompt_cache_key: `bench-routers-${session}` } as OpenAI.ChatCompletionCreateParamsNonStreaming;
          let rec: TurnRecord;
          const sentAt = performance.now() - phase0;
          try {
            // without a load balancer the bench is the client that fails over: session i starts on router i mod 2
            const sdk = viaLb ?? (session % 2 === 0 && !aDead() ? direct.A : direct.B);
            const r = await sdk.chat.completions.create(body, { headers: { 'x-request-id': id } });
            const text = r.choices[0]?.message.content ?? '';
            messages.push({ role: 'assistant', content: text });
            const doneAt = performance.now() - phase0;
            const lookup = traceOf(id, named, wall0);
            lookups.add(lookup);
            const where = await lookup;
            lookups.delete(lookup);
            rec = { id, session, turn, ok: true, sentAt, doneAt, promptTokens: r.usage?.prompt_tokens ?? 0, cachedTokens: r.usage?.prompt_tokens_details?.cached_tokens ?? 0, ...where };
          } catch (err) {
            rec = { id, session, turn, ok: false, error: (err as Error).message.slice(0, 200), sentAt, doneAt: performance.now() - phase0, promptTokens: 0, cachedTokens: 0, decode: null, path: null, router: null };
            messages.pop();
          }
          turns.push(rec);
          if (!rec.ok) {
            // the session tries the same turn again (a failure is counted, not skipped over); three failures end it
            if (turns.filter((t) => t.session === session && !t.ok).length >= 3) return;
            turn--;
          }
          if (rec.ok && ++done === half) {
            killAt = performance.now() - phase0;
            // the turns A served read their traces from A before it goes (bounded: 2 s), and A's recent traces are kept for those whose lookup loses the race
            await Promise.race([Promise.allSettled([...lookups]), sleep(2000)]);
            picksAtKill = await metricsOf(rb.url);
            aTraces = await recentTraces(ra.url, wall0);
            say(`  ${done} turns done: SIGKILL router A`);
            killing = c.kill(ra);
          }
          await sleep(o.thinkMs);
        }
      }),
    );
    await killing;
    const bAfter = await metricsOf(rb.url);
    // turns whose own lookup found no trace: from B's recent traces, else A's taken before the kill
    const bTraces = await recentTraces(rb.url, wall0);
    for (const t of turns) {
      if (!t.ok || t.decode !== null) continue;
      const [router, found] = bTraces.has(t.id) ? (['B', bTraces.get(t.id)!] as const) : aTraces.has(t.id) ? (['A', aTraces.get(t.id)!] as const) : [null, undefined];
      if (found) Object.assign(t, found, { router });
    }
    const figures = sessionFigures(turns, killAt, o.sessions);
    const throughB = diff(countersBy(bAfter, 'pdserve_router_requests_total', 'outcome'), countersBy(bBefore, 'pdserve_router_requests_total', 'outcome'));
    const picksAfterB = diff(countersBy(bAfter, 'pdserve_router_policy_picks_total', 'reason', 'role="decode"'), countersBy(picksAtKill, 'pdserve_router_policy_picks_total', 'reason', 'role="decode"'));
    const sessions: RoutersResult['sessions'] = { ...figures, killAt, turns, throughB, sdkRetried, picksAfterB };
    const goals = routersGoals(useNginx ? 'nginx' : 'none', streams, figures, turns.length, throughB, sdkRetried);
    return { lb: useNginx ? 'nginx' : 'none', options: o, wallS: (performance.now() - t0) / 1000, loadavg: os.loadavg().map((x) => Math.round(x * 100) / 100), cores: os.cpus().length, streams, sessions, goals };
  } finally {
    await lb?.stop();
    await c.stop();
  }
}

/**
 * BENCHMARKS.md §9 from a saved run (bench/results/s9-routers.json): its provenance, the setup
 * and the kill's lines (the goals and their headline figures are the summary's rows,
 * `routersSummaryRows`; the whole figures stay in the file). Markdown lines; "not run yet"
 * without a run.
 */
export function routersSection(r: RoutersResult | undefined, prov: string): string[] {
  if (!r?.goals?.length) return ['_Not run yet._'];
  const [setup, kill] = routersReport(r, r.cores);
  return [prov, '', `${setup}.`, '', `${kill}.`];
}

/** The summary table's rows of a saved run: goal, the headline of its figure (up to its first " (" or ";"), met. */
export function routersSummaryRows(r: RoutersResult | undefined): { goal: string; figure: string; met: boolean }[] {
  return (r?.goals ?? []).map((g) => ({ goal: g.goal, figure: g.figure.split(/ \(|;/)[0]!, met: g.met }));
}

/** The report: setup line, per-phase figures, and the goals side by side with met/missed (markdown lines); `cores` of the machine that ran it (default: this one). */
export function routersReport(r: RoutersResult, cores = os.cpus().length): string[] {
  const s = r.sessions;
  const o = r.options;
  return [
    `bench-routers: 1 prefill + 2 decode, 2 routers (cache_aware), ${r.lb === 'nginx' ? 'nginx in front' : 'NO load balancer (nginx not installed)'}; ${o.sessions} sessions × ${o.turns} turns; ${fmt(r.wallS, 0)} s; load average ${r.loadavg.join(' ')} on ${cores} cores`,
    `sessions: router A SIGKILLed at ${fmt(s.killAt / 1000, 1)} s; turns before it through A ${s.beforeByRouter.A} / B ${s.beforeByRouter.B}; router B's decode picks after it: ${Object.entries(s.picksAfterB).map(([k, v]) => `${k} ${v}`).join(', ') || 'none'}`,
    '',
    '| goal | figure | |',
    '|---|---|---|',
    ...r.goals.map((g) => `| ${g.goal} | ${g.figure} | ${g.met ? 'met' : 'MISSED'} |`),
  ];
}
