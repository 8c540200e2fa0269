/**
 * Bench sections 2–6: comparisons run against one live cluster (router + prefill + decode +
 * colocated reference, all on the same machine). Each comparison runs both sides in the same
 * invocation, interleaved (A B, B A, …), and reports their ratio.
 */
import { performance } from 'node:perf_hooks';
import type { Dispatcher } from 'undici';
import { DecodeConfigSchema, EngineConfigSchema, prefixCacheOf } from '../config/config.js';
import { computeMetrics, type BenchMetrics, type RequestRecord, type Slo } from './metrics.js';
import { buildPrompts, runBench, sendRequest, type BenchTarget, type BenchTokenizer, type PromptSpec } from './index.js';
import { alternate, BenchChild, median, say, sleep } from './util.js';
import { summarize, type Summary } from '../observe/stats.js';

/** What every section needs. */
export interface SectionCtx {
  /** PD through the router (OpenAI API). */
  pd: BenchTarget;
  /** The colocated server (OpenAI API). */
  colo: BenchTarget;
  /** PD without the router (SGLang /generate to both workers). */
  direct: BenchTarget;
  tokenizer: BenchTokenizer;
  dispatcher: Dispatcher;
  model: string;
  contextSize: number;
  batchSize: number;
  decodeSlots: number;
  /** CPU list of the decode worker when pinned (section 4 pins the direct engine the same way). */
  decodeCpus?: string;
  quick: boolean;
  timeoutMs: number;
}

const send = (ctx: SectionCtx, t: BenchTarget, p: PromptSpec, t0 = performance.now(), signal?: AbortSignal) => sendRequest(t, p, { t0, dispatcher: ctx.dispatcher, timeoutMs: ctx.timeoutMs, signal });

function corpusPrompts(ctx: SectionCtx, n: number, inputLen: number, outputLen: number, seed: number): PromptSpec[] {
  return buildPrompts({ dataset: 'corpus', numPrompts: n, inputLen, outputLen, seed, tokenizer: ctx.tokenizer });
}

function failures(rs: RequestRecord[]): string[] {
  return rs.filter((r) => !r.ok).map((r) => r.error ?? 'failed');
}

// ------------------------------------------------------------------------------ section 2

/** Section 2, one prompt length. */
export interface LowLoadRow {
  promptTokens: number;
  outputTokens: number;
  reps: number;
  pd: BenchMetrics;
  colo: BenchMetrics;
  /** PD median / colocated median. */
  ratio: { ttft: number; tpot: number; e2e: number };
  /**
   * Where PD's TTFT goes (medians of a few extra requests sent to the workers directly):
   * prefill_ms (prompt evaluation + state save + read + envelope, as the prefill worker reports
   * it), transfer_ms (kv_begin → decode's kv_ack), state bytes, and those requests' TTFT.
   */
  pdBreakdown: { prefillMs: number; transferMs: number; kvBytes: number; directTtftMs: number; probes: number };
  /**
   * The gap between the first and the second token the client received, ms (medians over the
   * requests): with PD the first comes from prefill and the second from decode, so the gap holds
   * the KV handoff. Against colocated ITL (median of all its gaps); `ratio` = PD gap / that.
   */
  secondToken?: {
    pdGapMs: number;
    coloGapMs: number;
    coloItlMs: number;
    ratio: number;
    /** Request sent → token 2 at the client, ms (medians): what moving the save before token 1 (`--first-token-after-save`) cannot change. */
    pdAtMs?: number;
    coloAtMs?: number;
  };
  errors: string[];
}

/** Section 2: PD vs colocated, one request at a time, prompts of 64/512/1500 tokens. */
export async function runLowLoad(ctx: SectionCtx, lens = [64, 512, 1500], outputLen = 32): Promise<LowLoadRow[]> {
  const reps = ctx.quick ? [2, 2, 2] : [10, 8, 6];
  const rows: LowLoadRow[] = [];
  for (let li = 0; li < lens.length; li++) {
    const len = lens[li]!;
    const n = reps[li] ?? reps[reps.length - 1]!;
    const prompts = corpusPrompts(ctx, n, len, outputLen, 200 + len);
    const pd: RequestRecord[] = [];
    const colo: RequestRecord[] = [];
    for (let i = 0; i < n; i++) {
      const [a, b] = await alternate(i, () => send(ctx, ctx.pd, prompts[i]!), () => send(ctx, ctx.colo, prompts[i]!));
      pd.push(a);
      colo.push(b);
    }
    const mp = computeMetrics(pd, 1);
    const mc = computeMetrics(colo, 1);
    const probes: RequestRecord[] = [];
    for (let i = 0; i < (ctx.quick ? 1 : 3); i++) probes.push(await send(ctx, ctx.direct, prompts[i % prompts.length]!));
    const sv = (k: 'prefillMs' | 'transferMs' | 'kvBytes') => median(probes.map((r) => r.server?.[k] ?? NaN));
    rows.push({
      pdBreakdown: { prefillMs: sv('prefillMs'), transferMs: sv('transferMs'), kvBytes: sv('kvBytes'), directTtftMs: median(probes.filter((r) => r.ok).map((r) => r.ttftMs)), probes: probes.length },
      promptTokens: median(pd.map((r) => r.promptTokens)),
      outputTokens: outputLen,
      reps: n,
      pd: mp,
      colo: mc,
      ratio: { ttft: mp.ttftMs.median / mc.ttftMs.median, tpot: mp.tpotMs.median / mc.tpotMs.median, e2e: mp.e2eMs.median / mc.e2eMs.median },
      secondToken: (() => {
        const first = (rs: RequestRecord[]) => median(rs.filter((r) => r.ok && r.itlMs.length > 0).map((r) => r.itlMs[0]!));
        const second = (rs: RequestRecord[]) => median(rs.filter((r) => r.ok && r.itlMs.length > 0).map((r) => r.ttftMs + r.itlMs[0]!));
        const pdGapMs = first(pd);
        return { pdGapMs, coloGapMs: first(colo), coloItlMs: mc.itlMs.median, ratio: pdGapMs / mc.itlMs.median, pdAtMs: second(pd), coloAtMs: second(colo) };
      })(),
      errors: [...failures(pd), ...failures(colo), ...failures(probes)],
    });
    say(`  ${len} tokens: TTFT PD ${mp.ttftMs.median.toFixed(0)} ms vs colocated ${mc.ttftMs.median.toFixed(0)} ms; E2E ${mp.e2eMs.median.toFixed(0)} vs ${mc.e2eMs.median.toFixed(0)} ms`);
  }
  return rows;
}

// ------------------------------------------------------------------------------ section 3

/** One interference segment (one side, one run). */
export interface InterferenceSegment {
  side: 'pd' | 'colo';
  durationMs: number;
  streamRequests: number;
  longRequests: number;
  /** ITL of the decoding streams, chunks after the settle time. */
  itlMs: Summary;
  /** Gaps > 100 ms among those. */
  stalls: number;
  /** TPOT of the stream requests. */
  tpotMs: Summary;
  /** TTFT of the long prompts. */
  longTtftMs: Summary;
  /** Stream output tokens/s over the segment. */
  streamTokPerS: number;
  /** Max ITL per 100 ms bin: [t_s, ms]. */
  itlSeries: [number, number][];
  /** When long prompts were sent, s. */
  longAt: number[];
  /** Long prompts that got no first token before the segment's drain deadline (their TTFT is at least that). */
  longUnfinished: number;
  /** Requests cancelled at the drain deadline (streams and long prompts). */
  cancelled: number;
  errors: string[];
}

/** One side of section 3, pooled over its segments. */
export interface InterferenceSide {
  itlMs: Summary;
  tpotMs: Summary;
  longTtftMs: Summary;
  stalls: number;
  streamTokPerS: number;
  longSent: number;
  /** Long prompts without a first token before their segment's drain deadline (not in longTtftMs). */
  longUnfinished: number;
}

/** Section 3 result. */
export interface InterferenceResult {
  streams: number;
  streamPrompt: number;
  streamOutput: number;
  longPrompt: number;
  longOutput: number;
  periodMs: number;
  segmentMs: number;
  settleMs: number;
  drainMs: number;
  segments: InterferenceSegment[];
  pd: InterferenceSide;
  colo: InterferenceSide;
  /** colocated / PD: how many times worse colocated is. */
  ratio: { itlP50: number; itlP99: number; longTtftP50: number };
}

/** Section 3: 8 streams decoding while long prompts arrive every few seconds. */
export async function runInterference(ctx: SectionCtx): Promise<InterferenceResult> {
  const streams = 8;
  const streamPrompt = 32;
  const streamOutput = ctx.quick ? 48 : 192;
  const longPrompt = 1024;
  const longOutput = 8;
  const periodMs = ctx.quick ? 2500 : 4000;
  const segmentMs = ctx.quick ? 6000 : 20_000;
  const settleMs = 2000;
  /** After the segment, in-flight requests get this long to finish, then are cancelled (counted). */
  const drainMs = ctx.quick ? 5000 : 15_000;
  const rounds = ctx.quick ? 1 : 2;
  const sp = corpusPrompts(ctx, 64, streamPrompt, streamOutput, 301);
  const lp = corpusPrompts(ctx, 16, longPrompt, longOutput, 302);

  const segment = async (side: 'pd' | 'colo'): Promise<{ seg: InterferenceSegment; itl: number[]; tpot: number[]; longTtft: number[] }> => {
    const target = side === 'pd' ? ctx.pd : ctx.colo;
    const t0 = performance.now();
    const streamRecs: RequestRecord[] = [];
    const longRecs: RequestRecord[] = [];
    const longAt: number[] = [];
    let stop = false;
    let k = 0;
    const cancel = new AbortController();
    const loops = Array.from({ length: streams }, async () => {
      while (!stop) streamRecs.push(await send(ctx, target, sp[k++ % sp.length]!, t0, cancel.signal));
    });
    const longs: Promise<void>[] = [];
    for (let j = 0; settleMs + j * periodMs < segmentMs; j++) {
      await sleep(t0 + settleMs + j * periodMs - performance.now());
      longAt.push((performance.now() - t0) / 1000);
      longs.push(send(ctx, target, lp[j % lp.length]!, t0, cancel.signal).then((r) => void longRecs.push(r)));
    }
    await sleep(t0 + segmentMs - performance.now());
    stop = true;
    const all = Promise.all([...loops, ...longs]);
    await Promise.race([all, sleep(drainMs)]);
    cancel.abort(new Error('segment over'));
    await all;
    const cancelled = [...streamRecs, ...longRecs].filter((r) => !r.ok && r.error?.startsWith('cancelled')).length;
    // ITL samples: gaps whose end falls in [settle, segment end]
    const itl: number[] = [];
    const bins = new Map<number, number>();
    let tokens = 0;
    for (const r of streamRecs) {
      if (!r.ok) continue;
      for (let i = 0; i < r.chunkAtMs.length; i++) {
        const at = r.chunkAtMs[i]!;
        if (at < settleMs || at > segmentMs) continue;
        tokens++;
        if (i === 0) continue;
        const gap = at - r.chunkAtMs[i - 1]!;
        itl.push(gap);
        const b = Math.floor(at / 100);
        bins.set(b, Math.max(bins.get(b) ?? 0, gap));
      }
    }
    const okStreams = streamRecs.filter((r) => r.ok);
    const m = computeMetrics(okStreams, 1);
    const tpot = okStreams.map((r) => (r.outputTokens > 1 ? (r.e2eMs - r.ttftMs) / (r.outputTokens - 1) : NaN)).filter(Number.isFinite);
    const longTtft = longRecs.map((r) => r.ttftMs).filter(Number.isFinite);
    const seg: InterferenceSegment = {
      side,
      durationMs: segmentMs,
      streamRequests: streamRecs.length,
      longRequests: longRecs.length,
      itlMs: summarize(itl),
      stalls: itl.filter((g) => g > 100).length,
      tpotMs: m.tpotMs,
      longTtftMs: summarize(longTtft),
      streamTokPerS: tokens / ((segmentMs - settleMs) / 1000),
      itlSeries: [...bins.entries()].sort((a, b) => a[0] - b[0]).map(([b, v]) => [b / 10, Math.round(v * 10) / 10]),
      longAt,
      longUnfinished: longRecs.filter((r) => !Number.isFinite(r.ttftMs)).length,
      cancelled,
      errors: [...failures(streamRecs), ...failures(longRecs)].filter((e) => !e.startsWith('cancelled')),
    };
    say(`  ${side === 'pd' ? 'PD        ' : 'colocated '} ITL p50 ${seg.itlMs.p50.toFixed(1)} ms, p99 ${seg.itlMs.p99.toFixed(1)} ms, stalls>100ms ${seg.stalls}, long TTFT p50 ${seg.longTtftMs.p50.toFixed(0)} ms`);
    return { seg, itl, tpot, longTtft };
  };

  const segments: InterferenceSegment[] = [];
  const raw = new Map<InterferenceSegment, { itl: number[]; tpot: number[]; longTtft: number[] }>();
  for (let r = 0; r < rounds; r++) {
    // colo, pd, then pd, colo, ...
    for (const side of (r % 2 === 0 ? ['colo', 'pd'] : ['pd', 'colo']) as ('pd' | 'colo')[]) {
      const { seg, itl, tpot, longTtft } = await segment(side);
      segments.push(seg);
      raw.set(seg, { itl, tpot, longTtft });
    }
  }
  // pool the samples of both runs of a side (medians of per-run percentiles would hide tails)
  const pool = (side: 'pd' | 'colo') => {
    const segs = segments.filter((s) => s.side === side);
    const all = (k: 'itl' | 'tpot' | 'longTtft') => segs.flatMap((s) => raw.get(s)![k]);
    const itl = all('itl');
    return {
      itlMs: summarize(itl),
      tpotMs: summarize(all('tpot')),
      longTtftMs: summarize(all('longTtft')),
      stalls: itl.filter((g) => g > 100).length,
      streamTokPerS: median(segs.map((s) => s.streamTokPerS)),
      longSent: segs.reduce((a, s) => a + s.longAt.length, 0),
      longUnfinished: segs.reduce((a, s) => a + s.longUnfinished, 0),
    };
  };
  const pd = pool('pd');
  const colo = pool('colo');
  return {
    streams,
    streamPrompt,
    streamOutput,
    longPrompt,
    longOutput,
    periodMs,
    segmentMs,
    settleMs,
    drainMs,
    segments,
    pd,
    colo,
    ratio: { itlP50: colo.itlMs.p50 / pd.itlMs.p50, itlP99: colo.itlMs.p99 / pd.itlMs.p99, longTtftP50: colo.longTtftMs.p50 / pd.longTtftMs.p50 },
  };
}

// ------------------------------------------------------------------------------ section 4

/**
 * Steady-state aggregate decode rate of concurrent streams: tokens arriving while all streams
 * were producing (from the last stream's first token to the first stream's last token) divided
 * by that window. When the streams never all overlap, falls back to every token after each
 * stream's first over the whole span (`allLive` false). `scale[i]` converts stream i's chunks to
 * tokens (usage tokens / chunks). Times in ms; streams of < 2 arrivals make the result NaN.
 */
export function windowRate(streams: number[][], scale?: number[]): { tokens: number; ms: number; tokPerS: number; allLive: boolean } {
  if (streams.length === 0 || streams.some((s) => s.length < 2)) return { tokens: 0, ms: 0, tokPerS: NaN, allLive: false };
  const count = (from: number, to: number) => {
    let tokens = 0;
    streams.forEach((s, i) => {
      let c = 0;
      for (const t of s) if (t > from && t <= to) c++;
      tokens += c * (scale?.[i] ?? 1);
    });
    return tokens;
  };
  const start = Math.max(...streams.map((s) => s[0]!));
  const end = Math.min(...streams.map((s) => s[s.length - 1]!));
  if (end > start) {
    const tokens = count(start, end);
    return { tokens, ms: end - start, tokPerS: tokens / ((end - start) / 1000), allLive: true };
  }
  const first = Math.min(...streams.map((s) => s[0]!));
  const last = Math.max(...streams.map((s) => s[s.length - 1]!));
  let tokens = 0;
  streams.forEach((s, i) => (tokens += (s.length - 1) * (scale?.[i] ?? 1)));
  return { tokens, ms: last - first, tokPerS: last > first ? tokens / ((last - first) / 1000) : NaN, allLive: false };
}

/** Section 4, one concurrency level. */
export interface BatchingRow {
  streams: number;
  promptTokens: number;
  outputTokens: number;
  reps: number;
  /** Runs (either side) whose streams never all overlapped: their rate is over the whole span instead. */
  partialOverlapRuns: number;
  /** Steady-state aggregate tokens/s (all streams live), median over reps. */
  pdTokPerS: number;
  directTokPerS: number;
  /** Whole-run tokens/s (first request → last token), median over reps. */
  pdWallTokPerS: number;
  directWallTokPerS: number;
  /** pdserve / direct, steady state. */
  ratio: number;
  errors: string[];
}

/** Engine probe of section 4: state load and slot reuse with the context idle vs while N sequences decode. */
export interface EngineContention {
  streams: number;
  outputLen: number;
  stateTokens: number;
  idleLoadMs: number;
  idleReuseMs: number;
  busyLoadMs: number;
  finishedAtLoad: number;
  loadStreamsEndMs: number;
  busyReuseMs: number;
  finishedAtReuse: number;
  reuseStreamsEndMs: number;
}

/** Section 4 result. */
export interface BatchingResult {
  rows: BatchingRow[];
  /** Sequences (KV streams) of the direct engine's context: the decode worker's slots + its prefix-cache sequences. */
  directSequences?: number;
  contention?: EngineContention;
}

/**
 * Sequences of the bench cluster's decode context: `slots` plus the prefix-cache sequences the
 * decode worker adds with its default flags (decode-local continuation keeps finished sequences
 * there). Every sequence is one KV stream in llama.cpp, and each step of a 14-stream context
 * cost ≈ 4–6 % more than a 10-stream one in an interleaved A/B (BENCHMARKS.md §4), so section 4's
 * direct baseline is created with the same count.
 */
export function decodeContextSequences(slots: number): number {
  // as startDecodeWorker: the prefix cache is on when decode-local continuation is (default flags)
  const local = DecodeConfigSchema.shape.localPrefillMaxTokens.parse(undefined);
  const cache = local > 0 ? prefixCacheOf(EngineConfigSchema.parse({ modelPath: '-' })) : undefined;
  return slots + (cache?.cacheSequences ?? 0);
}

/** Section 4: decode batching through pdserve vs node-llama-cpp driven directly. */
export async function runBatching(ctx: SectionCtx, levels = [1, 4, 8]): Promise<BatchingResult> {
  const outputLen = ctx.quick ? 64 : 192;
  const promptLen = 16;
  const reps = ctx.quick ? 1 : 3;
  const sequences = decodeContextSequences(ctx.decodeSlots);
  const child = new BenchChild<{ type: string; error?: string }>(
    'engine-child',
    [JSON.stringify({ model: ctx.model, contextSize: ctx.contextSize, batchSize: ctx.batchSize, sequences, threads: 1 })],
    ctx.decodeCpus,
  );
  try {
    const ready = await child.wait('ready', 120_000);
    if (ready.error) throw new Error(`engine child: ${ready.error}`);
    const rows: BatchingRow[] = [];
    const acc = new Map<number, { pd: number[]; direct: number[]; pdWall: number[]; directWall: number[]; partial: number; errors: string[] }>();
    for (const n of levels) acc.set(n, { pd: [], direct: [], pdWall: [], directWall: [], partial: 0, errors: [] });
    for (let rep = 0; rep < reps; rep++) {
      for (const n of levels) {
        const prompts = corpusPrompts(ctx, n, promptLen, outputLen, 400 + rep * 16 + n);
        const a = acc.get(n)!;
        const viaPd = async () => {
          const t0 = performance.now();
          const recs = await Promise.all(prompts.map((p) => send(ctx, ctx.pd, p, t0)));
          const bad = failures(recs);
          a.errors.push(...bad);
          if (bad.length) return;
          const w = windowRate(
            recs.map((r) => r.chunkAtMs),
            recs.map((r) => (r.chunkAtMs.length ? r.outputTokens / r.chunkAtMs.length : 1)),
          );
          a.pd.push(w.tokPerS);
          if (!w.allLive) a.partial++;
          const last = Math.max(...recs.map((r) => r.startMs + r.e2eMs));
          a.pdWall.push(recs.reduce((x, r) => x + r.outputTokens, 0) / (last / 1000));
        };
        const viaDirect = async () => {
          const r = await child.call<{ type: string; streams?: number[][] }>({ cmd: 'run', prompts: prompts.map((p) => p.text), outputLen }, 'result', 300_000);
          const s = r.streams!;
          const w = windowRate(s);
          a.direct.push(w.tokPerS);
          if (!w.allLive) a.partial++;
          const last = Math.max(...s.map((x) => x[x.length - 1] ?? 0));
          a.directWall.push(s.reduce((x, y) => x + y.length, 0) / (last / 1000));
        };
        await alternate(rep + n, viaPd, viaDirect);
      }
    }
    for (const n of levels) {
      const a = acc.get(n)!;
      const pd = median(a.pd);
      const direct = median(a.direct);
      rows.push({ streams: n, promptTokens: promptLen, outputTokens: outputLen, reps, partialOverlapRuns: a.partial, pdTokPerS: pd, directTokPerS: direct, pdWallTokPerS: median(a.pdWall), directWallTokPerS: median(a.directWall), ratio: pd / direct, errors: a.errors });
      say(`  ${n} stream(s): pdserve ${pd.toFixed(0)} tok/s vs direct ${direct.toFixed(0)} tok/s`);
    }
    let contention: EngineContention | undefined;
    try {
      const probe = corpusPrompts(ctx, 8, promptLen, ctx.quick ? 48 : 96, 450);
      const r = await child.call<{ type: string } & EngineContention>({ cmd: 'starve', prompts: probe.map((p) => p.text), outputLen: ctx.quick ? 48 : 96, stateTokens: 1024 }, 'starved', 300_000);
      const { type: _t, ...rest } = r;
      void _t;
      contention = rest;
      say(`  engine: state load ${contention.idleLoadMs.toFixed(0)} ms idle vs ${contention.busyLoadMs.toFixed(0)} ms while ${contention.streams} sequences decode (${contention.finishedAtLoad}/${contention.streams} had finished)`);
    } catch (err) {
      say(`  engine contention probe failed: ${(err as Error).message}`);
    }
    return { rows, contention, directSequences: sequences };
  } finally {
    await child.stop();
  }
}

// ------------------------------------------------------------------------------ section 5

/** One §5 comparison: the same kind of request through the router and to the workers directly. */
export interface RouterOverheadRun {
  /** Requests each way. */
  reps: number;
  router: BenchMetrics;
  direct: BenchMetrics;
  /** router − direct, ms. */
  addedMs: { ttftP50: number; ttftP99: number; e2eP50: number; e2eP99: number; itlP50: number };
  /** router / direct. */
  ratio: { ttftP50: number; e2eP50: number };
  errors: string[];
}

/**
 * §5's warm-prompt comparison: every timed request's prompt was evaluated once just before by an
 * untimed priming request (sent directly to the workers, 1 output token), so the prefill worker
 * serves it from its prefix cache and TTFT is mostly path (≈ 13 ms instead of ≈ 120 ms cold).
 */
export interface RouterOverheadWarm extends RouterOverheadRun {
  /** Timed requests the prefix cache served (see `promptCacheHits`), each way. */
  cacheHits: { router: number; direct: number };
  /** Priming requests that failed (their timed request may then have run cold). */
  primeErrors: string[];
}

/**
 * Section 5 result. The top-level figures are the cold-prompt comparison (every prompt new to the
 * prefill worker; result files written before the warm variant have only these); `warm` is the
 * warm-prompt one, on which the goal's verdict rests.
 */
export interface RouterOverheadResult extends RouterOverheadRun {
  promptTokens: number;
  outputTokens: number;
  warm?: RouterOverheadWarm;
}

/**
 * Section 5's prompts of round `round` from a list of 2 × rounds: [through the router, direct].
 * Each request gets a prompt of its own, because both ways reach the same prefill worker, whose
 * prefix cache would give the second request of a pair sent with one prompt a hit (≈ 10 ms to the
 * first token instead of ≈ 120 ms): each side's samples were then half cold, half cached, and the
 * p50 of 40 fell between the two modes. The round's two prompts swap sides every round.
 * @throws RangeError when the list has no prompts for this round.
 */
export function ownPromptPair<T>(prompts: readonly T[], round: number): [T, T] {
  const a = prompts[2 * round];
  const b = prompts[2 * round + 1];
  if (a === undefined || b === undefined) throw new RangeError(`no prompts for round ${round} (${prompts.length} prompts)`);
  return round % 2 === 0 ? [a, b] : [b, a];
}

/**
 * Router − direct from the two sides' request records (pure): metrics of each (one request at a
 * time, so concurrency 1), differences of their p50/p99 TTFT and E2E and p50 ITL in ms, ratios
 * of the p50s, and the failed requests' errors. Failed requests do not enter the metrics.
 */
export function routerOverhead(viaRouter: readonly RequestRecord[], direct: readonly RequestRecord[]): RouterOverheadRun {
  const r = computeMetrics([...viaRouter], 1);
  const d = computeMetrics([...direct], 1);
  return {
    reps: Math.max(viaRouter.length, direct.length),
    router: r,
    direct: d,
    addedMs: { ttftP50: r.ttftMs.p50 - d.ttftMs.p50, ttftP99: r.ttftMs.p99 - d.ttftMs.p99, e2eP50: r.e2eMs.p50 - d.e2eMs.p50, e2eP99: r.e2eMs.p99 - d.e2eMs.p99, itlP50: r.itlMs.p50 - d.itlMs.p50 },
    ratio: { ttftP50: r.ttftMs.p50 / d.ttftMs.p50, e2eP50: r.e2eMs.p50 / d.e2eMs.p50 },
    errors: [...failures([...viaRouter]), ...failures([...direct])],
  };
}

/**
 * How many successful requests the server reports as served from its prefix cache: cached tokens
 * (usage / meta_info `cached_tokens`) at least `minShare` of the prompt (a full hit reuses all but
 * the last prompt token, which is evaluated again for the first token's logits). A request
 * without the figure counts as a miss.
 */
export function promptCacheHits(rs: readonly RequestRecord[], minShare = 0.9): number {
  return rs.filter((r) => r.ok && r.cachedTokens !== undefined && r.promptTokens > 0 && r.cachedTokens >= minShare * r.promptTokens).length;
}

/**
 * Section 5: streamed requests to the workers directly vs through the router, alternating.
 * Cold: a prompt of its own each, new to the prefill worker (see `ownPromptPair`); TTFT ≈ 120 ms
 * is mostly prompt evaluation, whose run-to-run spread hides a 1 ms difference. Warm: the same
 * with each prompt primed just before its timed request by an untimed direct request with 1
 * output token (same prefill worker, so its prefix cache turns the evaluation into one token),
 * and more requests: what remains of TTFT is the path, and the router's share of it shows.
 */
export async function runRouterOverhead(ctx: SectionCtx): Promise<RouterOverheadResult> {
  const reps = ctx.quick ? 4 : 40;
  const warmReps = ctx.quick ? 4 : 60;
  const promptLen = 64;
  const outputLen = 32;
  const prompts = corpusPrompts(ctx, 2 * reps, promptLen, outputLen, 500);
  const viaRouter: RequestRecord[] = [];
  const direct: RequestRecord[] = [];
  for (let i = 0; i < reps; i++) {
    const [pr, pd] = ownPromptPair(prompts, i);
    const [a, b] = await alternate(i, () => send(ctx, ctx.pd, pr), () => send(ctx, ctx.direct, pd));
    viaRouter.push(a);
    direct.push(b);
  }
  const cold = routerOverhead(viaRouter, direct);
  say(`  cold prompts: router adds ${cold.addedMs.ttftP50.toFixed(1)} ms TTFT p50 (p99 ${cold.addedMs.ttftP99.toFixed(1)} ms), ${cold.addedMs.e2eP50.toFixed(1)} ms E2E p50 (p99 ${cold.addedMs.e2eP99.toFixed(1)} ms)`);

  const warmPrompts = corpusPrompts(ctx, 2 * warmReps, promptLen, outputLen, 510);
  const primes: RequestRecord[] = [];
  const primed = async (t: BenchTarget, p: PromptSpec): Promise<RequestRecord> => {
    primes.push(await send(ctx, ctx.direct, { ...p, outputLen: 1 }));
    return send(ctx, t, p);
  };
  const wRouter: RequestRecord[] = [];
  const wDirect: RequestRecord[] = [];
  for (let i = 0; i < warmReps; i++) {
    const [pr, pd] = ownPromptPair(warmPrompts, i);
    const [a, b] = await alternate(i, () => primed(ctx.pd, pr), () => primed(ctx.direct, pd));
    wRouter.push(a);
    wDirect.push(b);
  }
  const warm: RouterOverheadWarm = { ...routerOverhead(wRouter, wDirect), cacheHits: { router: promptCacheHits(wRouter), direct: promptCacheHits(wDirect) }, primeErrors: failures(primes) };
  say(`  warm prompts: router adds ${warm.addedMs.ttftP50.toFixed(1)} ms TTFT p50 (p99 ${warm.addedMs.ttftP99.toFixed(1)} ms), ${warm.addedMs.e2eP50.toFixed(1)} ms E2E p50; TTFT p50 ${warm.router.ttftMs.p50.toFixed(1)} / ${warm.direct.ttftMs.p50.toFixed(1)} ms; cache hits ${warm.cacheHits.router}/${warmReps} router, ${warm.cacheHits.direct}/${warmReps} direct`);
  return { promptTokens: promptLen, outputTokens: outputLen, ...cold, warm };
}

// ------------------------------------------------------------------------------ section 6

/** Section 6, one request rate. */
export interface ScalingRow {
  rate: number;
  numPrompts: number;
  pd: BenchMetrics;
  colo: BenchMetrics;
  errors: string[];
}

/** Section 6 result. */
export interface ScalingResult {
  slo: Slo;
  inputLen: number;
  outputLen: number;
  rangeRatio: number;
  /** Requests still running this long after the last arrival were cancelled (counted as failed). */
  drainMs: number;
  rows: ScalingRow[];
}

/**
 * Section 6 cancels requests still running this long after the last arrival (counted as failed):
 * a request unfinished that long after being sent cannot meet the SLO (TTFT 2 s + 96 tokens × 50 ms
 * < 7 s), so goodput is unaffected, and an overloaded side cannot stretch the suite without bound.
 */
const DRAIN_MS = (ctx: SectionCtx) => (ctx.quick ? 5000 : 20_000);

/** Section 6: Poisson request-rate sweep; goodput under an SLO for PD vs colocated. */
export async function runScaling(ctx: SectionCtx, rates = [0.5, 1, 2, 4], slo: Slo = { ttftMs: 2000, tpotMs: 50 }): Promise<ScalingResult> {
  const inputLen = 512;
  const outputLen = 64;
  const rangeRatio = 0.5;
  const secondsPerRate = ctx.quick ? 3 : 16;
  const rows: ScalingRow[] = [];
  for (let i = 0; i < rates.length; i++) {
    const rate = rates[i]!;
    const numPrompts = Math.max(ctx.quick ? 2 : 6, Math.round(rate * secondsPerRate));
    const prompts = buildPrompts({ dataset: 'corpus', numPrompts, inputLen, outputLen, rangeRatio, seed: 600 + i, tokenizer: ctx.tokenizer });
    const run = (target: BenchTarget, label: string) =>
      runBench({ target, prompts, requestRate: rate, seed: 600 + i, slo, warmup: 0, timeoutMs: ctx.timeoutMs, progress: false, label, dispatcher: ctx.dispatcher, drainMs: DRAIN_MS(ctx) });
    const [pd, colo] = await alternate(i, () => run(ctx.pd, 'pd'), () => run(ctx.colo, 'colocated'));
    rows.push({ rate, numPrompts, pd: pd.metrics, colo: colo.metrics, errors: [...pd.requests.errors, ...colo.requests.errors].filter((e): e is string => !!e) });
    say(`  ${rate} req/s: goodput PD ${pd.metrics.goodput?.toFixed(2)} vs colocated ${colo.metrics.goodput?.toFixed(2)} req/s; TTFT p50 ${pd.metrics.ttftMs.p50.toFixed(0)} vs ${colo.metrics.ttftMs.p50.toFixed(0)} ms; TPOT p50 ${pd.metrics.tpotMs.p50.toFixed(1)} vs ${colo.metrics.tpotMs.p50.toFixed(1)} ms`);
  }
  return { slo, inputLen, outputLen, rangeRatio, drainMs: DRAIN_MS(ctx), rows };
}
