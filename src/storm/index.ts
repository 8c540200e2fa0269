/**
 * `pdserve storm`: the production incident as a command. Many agents run multi-round chat
 * conversations in parallel while clients cancel at every phase of a request and workers are
 * killed, restarted and frozen; then the storm checks that nothing wedged, leaked, hung, crashed
 * or answered wrongly, and exits 1 (printing the offending rooms' timelines) if anything did.
 *
 * Two modes:
 *  - self-hosted (default): starts its own cluster (router + N prefill + M decode, plus a
 *    colocated reference) with `Cluster`, so it can inject worker faults on a schedule:
 *    SIGKILL + restart of a decode or prefill worker, SIGSTOP/SIGCONT of a prefill worker;
 *  - `url`: drives an existing router (client-side chaos only) and watches the workers given.
 *
 * Phases: start → storm (duration) → drain (requests in flight finish; each has a deadline) →
 * settle (wait for every gauge to reach zero, bounded) → verify (sampled rounds against the
 * colocated reference, temperature 0) → stop → report.
 *
 * Checks: wedge (a live room past its deadline, from /debug/rooms), leak (a queue/room gauge, a
 * slot or a router lease not back to zero after the settle period), hang (a request with
 * neither answer nor error within its deadline), crash (a worker that died without being killed
 * by the storm), wrong answer (a completed round whose text differs from the reference's),
 * illegal (pdserve_illegal_transitions_total not 0 on a worker: a real protocol violation).
 */
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import http from 'node:http';
import { performance } from 'node:perf_hooks';
import { Cluster, type ClusterProc } from '../up/cluster.js';
import { reachGlobally, signGlobally } from '../security/http-auth.js';
import { internalClientOptions, loadInternalTls, type InternalTlsFiles } from '../security/tls.js';
import { Agents, type RequestRecord, type SampledRound } from './agents.js';
import { ChatCall, getJson } from './client.js';
import { loadCorpus } from '../up/corpus.js';
import { collectLeaks, RoomMonitor, type LeakReport, type RoomView, type WatchedFault, type WatchedWorker } from './monitor.js';
import { formatProgress, formatReport } from './report.js';
import { warmUp, type WarmupResult } from './warmup.js';
import { summarize, type Summary } from '../observe/stats.js';
import type { RequestTrace } from '../protocol/trace.js';
import type { FaultKind, FaultRecord, CheckName, CheckResult, OffendingRoom, StormReport } from './types.js';
export type { FaultKind, FaultRecord, CheckName, CheckResult, OffendingRoom, StormReport };

/** Everything `runStorm` needs. Durations in ms; rates in [0, 1]; 0 disables a schedule. */
export interface StormOptions {
  /** Drive this router instead of starting a cluster (no worker faults). */
  url?: string;
  /** Workers to watch in `url` mode (their /metrics, /health and /debug/rooms). */
  workers?: string[];
  /** A colocated server for the wrong-answer check in `url` mode. */
  reference?: string;
  agents: number;
  rounds: number;
  durationMs: number;
  seed: number;
  prefill: number;
  decode: number;
  /** GGUF path; default: the built-in model of `preset`. */
  model?: string;
  preset: 'tiny' | 'small';
  threads: number;
  /** Extra engine flags of every worker and of the colocated reference (the GPU flags: `--gpu vulkan --gpu-device 0`). */
  workerArgs?: string[];
  ctxSize: number;
  batchSize: number;
  /**
   * Self-hosted: batch-invariant engines (`--deterministic`), so the wrong-answer check compares
   * exactly; without it llama.cpp's batched float sums can flip a greedy token now and then.
   */
  deterministic: boolean;
  decodeSlots: number;
  /**
   * Self-hosted: the same-host KV handoff (kv_file) on every worker ('on'), off everywhere
   * ('off', `--no-kv-same-host`), or 'mixed': decode-1 runs with it off, so one storm carries
   * rooms on both paths (the report lists handoffs by worker and path).
   */
  kvSameHost: 'on' | 'off' | 'mixed';
  abortRate: number;
  killRate: number;
  nonStreamRate: number;
  burstEveryMs: number;
  killDecodeEveryMs: number;
  killPrefillEveryMs: number;
  stopPrefillEveryMs: number;
  stopDurationMs: number;
  requestTimeoutMs: number;
  /**
   * After the drain, the longest wait for every gauge to reach zero (the leak check); raised to
   * the longest TTFT the storm saw (to `requestTimeoutMs` when it saw none), at most
   * `requestTimeoutMs`: a prompt evaluation that started before the drain runs to its end before
   * it frees its slot (llama.cpp cannot stop a running evaluation), which on a slow device takes
   * longer than the default.
   */
  settleMs: number;
  /**
   * Self-hosted: when a worker runs on a GPU backend, warm the engines up before the storm's
   * clock starts (storm-warmup.ts: first-use pipeline compilation), for at most this long (ms;
   * 0 = no warm-up).
   */
  warmupMs: number;
  maxTokens: number;
  thinkMs: number;
  /** Completed rounds checked against the reference (0 = skip the check). */
  verify: number;
  /** /debug/rooms polling period. */
  pollMs: number;
  /** A live room must be this far past its deadline to count as wedged. */
  wedgeGraceMs: number;
  json?: string;
  logDir?: string;
  /** Extra environment for the cluster's processes. */
  env?: Record<string, string>;
  /**
   * The router's client credentials (self-hosted: the router is started with them; env
   * PDSERVE_API_KEY / PDSERVE_ADMIN_API_KEY in the CLI): `apiKey` on every generation request,
   * `adminKey` (else `apiKey`) on /workers and /metrics; `ca`: PEM file of an https:// router's CA.
   */
  access?: { apiKey?: string; adminKey?: string; ca?: string };
  /** Self-hosted: the router serves HTTPS with these PEM files (`--tls-cert`, `--tls-key`). */
  routerTls?: { cert: string; key: string };
  /** Internal TLS files (`--internal-tls-*`): self-hosted, every process; url mode, to reach the watched https:// workers. */
  internalTls?: InternalTlsFiles;
  /** Progress output: a line refreshed in place ('tty'), a line every 10 s ('lines'), or none. */
  progress: 'tty' | 'lines' | 'off';
  /** Ends the storm early (drain, checks and report still run). */
  signal?: AbortSignal;
  /** Where progress and the report go (default: stderr / stdout). */
  write?: { progress(s: string): void; out(s: string): void };
}

/** Defaults of every option (the CLI's defaults). */
export const STORM_DEFAULTS: StormOptions = {
  agents: 30,
  rounds: 6,
  durationMs: 60_000,
  seed: 1,
  prefill: 2,
  decode: 2,
  preset: 'tiny',
  threads: 1,
  ctxSize: 2048,
  batchSize: 512,
  deterministic: true,
  decodeSlots: 8,
  kvSameHost: 'mixed',
  abortRate: 0.3,
  killRate: 0.05,
  nonStreamRate: 0.2,
  burstEveryMs: 15_000,
  killDecodeEveryMs: 20_000,
  killPrefillEveryMs: 30_000,
  stopPrefillEveryMs: 25_000,
  stopDurationMs: 3000,
  requestTimeoutMs: 60_000,
  settleMs: 10_000,
  warmupMs: 600_000,
  maxTokens: 48,
  thinkMs: 200,
  verify: 24,
  pollMs: 1000,
  wedgeGraceMs: 2000,
  progress: 'lines',
};

interface HangNote {
  agent: number;
  conv: number;
  round: number;
  phase: string;
  rid?: string;
  stream: boolean;
  rooms: { worker: string; room: RoomView }[];
}

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

/** This process's fetch() calls to the router (/health, /metrics, /workers) carry its admin (else API) key and trust its CA. */
function reachRouter(routerUrl: string, a: StormOptions['access']): void {
  const bearer = a?.adminKey ?? a?.apiKey;
  if (bearer || a?.ca) reachGlobally([routerUrl], { ...(bearer ? { bearer } : {}), ...(a?.ca ? { tls: { ca: readFileSync(a.ca) } } : {}) });
}

/** Run a storm; never throws for check failures (see `report.ok`), throws on setup errors. */
export async function runStorm(opts: Partial<StormOptions>): Promise<StormReport> {
  const o: StormOptions = { ...STORM_DEFAULTS, ...opts };
  const write = o.write ?? { progress: (s: string) => process.stderr.write(s), out: (s: string) => process.stdout.write(s) };
  const wall0 = Date.now();
  const corpus = loadCorpus();
  const selfHosted = !o.url;
  let cluster: Cluster | undefined;
  let routerUrl: string;
  let referenceUrl: string | undefined = o.reference;
  let watched: WatchedWorker[];
  let logDir: string | undefined;
  let model: string | undefined;

  if (selfHosted) {
    model = o.model ? resolve(o.model) : await (await import('../engine/gguf-writer.js')).ensureModel(o.preset, 1);
    logDir = o.logDir ?? mkdtempSync(join(tmpdir(), 'pdserve-storm-'));
    const routerTimeout = Math.max(1000, Math.round(o.requestTimeoutMs * 0.8));
    cluster = new Cluster({
      model,
      prefill: o.prefill,
      decode: o.decode,
      threads: o.threads,
      ctxSize: o.ctxSize,
      batchSize: o.batchSize,
      deterministic: o.deterministic,
      decodeSlots: o.decodeSlots,
      logDir,
      colocated: o.verify > 0,
      env: o.env,
      // The reference evaluates every prompt in full: the check compares reuse against no reuse.
      // Prefill keeps more cached prefixes than by default (tiny model: ≈1 MB a sequence), so
      // the storm's many concurrent conversations get cache hits to check. Decode-local
      // continuation is on (decode policy cache_aware; decode keeps 8 finished sequences), so
      // rounds also run on decode alone, under the same faults.
      extraArgs: { router: ['--request-timeout-ms', String(routerTimeout), '--decode-policy', 'cache_aware'], prefill: ['--prefix-cache-slots', '16', ...(o.kvSameHost === 'off' ? ['--no-kv-same-host'] : []), ...(o.workerArgs ?? [])], decode: ['--prefix-cache-slots', '8', ...(o.kvSameHost === 'off' ? ['--no-kv-same-host'] : []), ...(o.workerArgs ?? [])], colocated: ['--no-prefix-cache', ...(o.workerArgs ?? [])] },
      extraArgsOf: o.kvSameHost === 'mixed' ? { 'decode-1': ['--no-kv-same-host'] } : {},
      access: { apiKeys: o.access?.apiKey ? [o.access.apiKey] : [], adminApiKeys: o.access?.adminKey ? [o.access.adminKey] : [], routerArgs: o.routerTls ? ['--tls-cert', o.routerTls.cert, '--tls-key', o.routerTls.key] : [], tls: !!o.routerTls },
      ...(o.internalTls ? { internalTls: o.internalTls } : {}),
    });
    write.progress(`pdserve storm: starting ${o.prefill} prefill + ${o.decode} decode + router${o.verify > 0 ? ' + colocated reference' : ''} (logs: ${logDir})\n`);
    try {
      await cluster.start();
    } catch (err) {
      await cluster.stop();
      throw err;
    }
    routerUrl = cluster.router.url;
    referenceUrl = cluster.colocated?.url;
    reachRouter(routerUrl, o.access);
    watched = cluster.procs.filter((p) => p.role === 'prefill' || p.role === 'decode').map((p) => ({ name: p.name, url: p.url }));
  } else {
    routerUrl = o.url!.replace(/\/+$/, '').replace(/\/v1$/, '');
    watched = (o.workers ?? []).map((u, i) => ({ name: `worker-${i}(${new URL(u).host})`, url: u.replace(/\/+$/, '') }));
    // Watched workers answer signed requests only: the cluster secret from the environment.
    const itls = loadInternalTls(o.internalTls);
    if (process.env.PDSERVE_CLUSTER_SECRET && watched.length) signGlobally(watched.map((w) => w.url), process.env.PDSERVE_CLUSTER_SECRET, itls ? internalClientOptions(itls) : undefined);
    reachRouter(routerUrl, o.access);
    await getJson(`${routerUrl}/health`, 5000).catch((err) => {
      throw new Error(`router ${routerUrl} does not answer /health: ${(err as Error).message}`);
    });
    // Name url-mode workers by their role.
    await Promise.all(
      watched.map(async (w) => {
        const h = await getJson<{ role?: string }>(`${w.url}/health`, 3000).catch(() => ({}) as { role?: string });
        if (h.role) w.name = `${h.role}(${new URL(w.url).host})`;
      }),
    );
  }

  let warmup: WarmupResult | undefined;
  if (selfHosted && o.warmupMs > 0 && (await onGpu(watched))) {
    write.progress(`pdserve storm: warming up the engines on the GPU (rounds of ${o.decode * o.decodeSlots} requests, at most ${Math.round(o.warmupMs / 1000)} s)\n`);
    warmup = await warmUp(routerUrl, { requests: o.decode * o.decodeSlots, width: o.decodeSlots, deadlineMs: o.requestTimeoutMs, budgetMs: o.warmupMs });
    write.progress(`pdserve storm: warm-up ${warmup.ok}/${warmup.requests} ok after ${warmup.rounds} round(s), ${(warmup.ms / 1000).toFixed(1)} s${warmup.error ? ` (last error: ${warmup.error})` : ''}\n`);
  }

  const records: RequestRecord[] = [];
  const ttfts: number[] = [];
  const itls: number[] = [];
  const e2es: number[] = [];
  const recentTtft: number[] = [];
  const hangNotes: Promise<HangNote>[] = [];
  const faults: (FaultRecord & { t: number; watch?: WatchedFault })[] = [];
  const counts = { ok: 0, aborted: 0, killed: 0, failed: 0, hung: 0 };
  const bursts = { count: 0, cancelled: 0 };
  const monitor = new RoomMonitor(watched, { pollMs: o.pollMs, graceMs: o.wedgeGraceMs });

  const snapshotRooms = async (rid: string | undefined, minAgeMs: number): Promise<{ worker: string; room: RoomView }[]> => {
    const out: { worker: string; room: RoomView }[] = [];
    await Promise.all(
      watched.map(async (w) => {
        const d = await getJson<{ live?: RoomView[]; recent?: RoomView[] }>(`${w.url}/debug/rooms`, 3000).catch(() => undefined);
        if (!d) return;
        for (const r of d.live ?? []) if ((rid && r.rid === rid) || (!rid && r.age_ms >= minAgeMs)) out.push({ worker: w.name, room: r });
        if (rid) for (const r of d.recent ?? []) if (r.rid === rid) out.push({ worker: w.name, room: r });
      }),
    );
    return out;
  };

  const agents = new Agents({
    baseUrl: routerUrl,
    ...(o.access?.apiKey ? { apiKey: o.access.apiKey } : {}),
    ...(o.access?.ca ? { ca: readFileSync(o.access.ca) } : {}),
    agents: o.agents,
    rounds: o.rounds,
    seed: o.seed,
    corpus,
    ctxSize: o.ctxSize,
    maxTokens: o.maxTokens,
    abortRate: o.abortRate,
    killRate: o.killRate,
    nonStreamRate: o.nonStreamRate,
    requestTimeoutMs: o.requestTimeoutMs,
    thinkMs: o.thinkMs,
    sampleSize: o.verify,
    migratedOf: (rid) => migratedOf(routerUrl, rid),
    onRecord(rec) {
      records.push(rec);
      const r = rec.result;
      counts[r.outcome]++;
      if (r.outcome === 'ok') {
        e2es.push(r.tEnd - r.tStart);
        if (rec.stream && r.tFirst !== undefined) {
          ttfts.push(r.tFirst - r.tStart);
          recentTtft.push(r.tFirst - r.tStart);
          if (recentTtft.length > 2000) recentTtft.splice(0, recentTtft.length - 2000);
        }
        for (const g of r.itl) itls.push(g);
      }
    },
    onHang(rec) {
      const r = rec.result;
      hangNotes.push(
        snapshotRooms(r.rid, o.requestTimeoutMs - 2000).then((rooms) => ({ agent: rec.agent, conv: rec.conv, round: rec.round, phase: r.phase, rid: r.rid, stream: rec.stream, rooms })),
      );
    },
  });

  // ---- schedules ------------------------------------------------------------------------------
  const t0 = performance.now();
  const timers: NodeJS.Timeout[] = [];
  const pendingFaults = new Set<Promise<void>>();
  const busy = new Set<ClusterProc>();
  const rr: Record<FaultKind, number> = { kill_decode: 0, kill_prefill: 0, stop_prefill: 0 };
  const tail = Math.min(10_000, o.durationMs / 6);
  /** Call `fn` every `everyMs` while the storm runs; worker faults stop `tail` ms before its end so their recovery can be seen. */
  const schedule = (everyMs: number, fn: () => void, tailMs = tail) => {
    if (!(everyMs > 0)) return;
    for (let t = everyMs; t <= o.durationMs - tailMs; t += everyMs) timers.push(setTimeout(fn, t));
  };

  const inject = async (kind: FaultKind): Promise<void> => {
    if (!cluster) return;
    const role = kind === 'kill_decode' ? 'decode' : 'prefill';
    const pool = cluster.byRole(role);
    let p: ClusterProc | undefined;
    for (let i = 0; i < pool.length; i++) {
      const c = pool[(rr[kind] + i) % pool.length]!;
      if (!busy.has(c) && c.child) {
        p = c;
        rr[kind] = (rr[kind] + i + 1) % pool.length;
        break;
      }
    }
    if (!p) return;
    busy.add(p);
    const f: FaultRecord & { t: number; watch?: WatchedFault } = { kind, target: p.name, at_s: (performance.now() - t0) / 1000, down_ms: null, first_ok_ms: null, worker_ok_ms: null, t: performance.now() };
    f.watch = { worker: p.name, at: Date.now() };
    monitor.watchFault(f.watch);
    faults.push(f);
    try {
      if (kind === 'stop_prefill') {
        monitor.pause(p.name);
        const child = p.child!;
        child.kill('SIGSTOP');
        await sleep(o.stopDurationMs);
        child.kill('SIGCONT');
        monitor.resume(p.name);
        f.down_ms = o.stopDurationMs;
      } else {
        const k0 = performance.now();
        monitor.expectRestart(p.name);
        await cluster.kill(p);
        await cluster.spawn(p);
        f.down_ms = Math.round(performance.now() - k0);
      }
    } catch (err) {
      f.error = (err as Error).message;
    } finally {
      busy.delete(p);
    }
  };
  const fault = (kind: FaultKind) => () => {
    const pr = inject(kind);
    pendingFaults.add(pr);
    void pr.finally(() => pendingFaults.delete(pr));
  };
  if (selfHosted) {
    schedule(o.killDecodeEveryMs, fault('kill_decode'));
    schedule(o.killPrefillEveryMs, fault('kill_prefill'));
    schedule(o.stopPrefillEveryMs, fault('stop_prefill'));
  }
  schedule(
    o.burstEveryMs,
    () => {
      bursts.count++;
      bursts.cancelled += agents.burst();
    },
    1,
  );

  // ---- progress -------------------------------------------------------------------------------
  const progressLine = (): string =>
    formatProgress({
      elapsedS: (performance.now() - t0) / 1000,
      durationS: o.durationMs / 1000,
      counts,
      ttft: recentTtft,
      live: monitor.liveByState(),
      faults: faults.map((f) => f.kind),
      inFlight: agents.inFlight,
    });
  let lastLine = 0;
  const progress = setInterval(
    () => {
      if (o.progress === 'tty') write.progress(`\r${progressLine()}\x1b[K`);
      else if (o.progress === 'lines' && performance.now() - lastLine >= 9_500) {
        lastLine = performance.now();
        write.progress(`${progressLine()}\n`);
      }
    },
    o.progress === 'tty' ? 1000 : 500,
  );

  // ---- run ------------------------------------------------------------------------------------
  let report: StormReport | undefined;
  try {
    monitor.start();
    const running = agents.run();
    await new Promise<void>((res) => {
      const t = setTimeout(res, o.durationMs);
      o.signal?.addEventListener('abort', () => {
        clearTimeout(t);
        res();
      });
    });
    const stormS = (performance.now() - t0) / 1000;
    for (const t of timers) clearTimeout(t);
    agents.stop();
    // Drain: every request has its own deadline; this bound is a safety net.
    const drained = await Promise.race([running.then(() => true), sleep(o.requestTimeoutMs + 5000).then(() => false)]);
    if (!drained) {
      agents.cancelAll();
      await running;
    }
    await Promise.all([...pendingFaults]);
    clearInterval(progress);
    if (o.progress === 'tty') write.progress(`\r${progressLine()}\x1b[K\n`);
    else if (o.progress === 'lines') write.progress(`${progressLine()}\n`);

    // Settle: wait (bounded) for every gauge to come back to zero; at least the longest TTFT seen,
    // the time one prompt evaluation took, or the request deadline when no first token came at
    // all (see StormOptions.settleMs).
    const settleLimitMs = Math.max(o.settleMs, Math.min(o.requestTimeoutMs, ttfts.length ? ttfts.reduce((a, t) => Math.max(a, t), 0) : o.requestTimeoutMs));
    const settle0 = performance.now();
    let leaks: LeakReport = await collectLeaks(watched, routerUrl);
    while ((leaks.items.length > 0 || leaks.rooms.length > 0 || leaks.unreachable.length > 0) && performance.now() - settle0 < settleLimitMs) {
      await sleep(250);
      leaks = await collectLeaks(watched, routerUrl);
    }
    const settledMs = performance.now() - settle0;
    await monitor.pollAll();
    monitor.stop();

    // Verify: sampled rounds against the colocated reference, one at a time.
    const verification = await verify(await agents.sample(), referenceUrl, o.requestTimeoutMs);
    const hangs = await Promise.all(hangNotes);
    const redispatched = await routerRedispatches(routerUrl);

    // Crashes.
    const crashes: { process: string; detail: string }[] = [];
    if (cluster) {
      for (const p of cluster.procs) for (const e of p.unexpectedExits) crashes.push({ process: p.name, detail: `exited (code ${e.code}, signal ${e.signal}) at +${((e.at - wall0) / 1000).toFixed(1)} s without being killed by the storm${p.logFile ? ` (log: ${p.logFile})` : ''}` });
    }
    for (const h of monitor.health()) for (const e of h.unexpectedEpochChanges) crashes.push({ process: h.name, detail: `restarted (epoch ${e.from} → ${e.to}) without the storm restarting it` });
    if (!cluster) for (const u of leaks.unreachable) crashes.push({ process: u.where, detail: `unreachable after the storm: ${u.error}` });

    report = buildReport({
      o,
      selfHosted,
      routerUrl,
      model,
      logDir,
      wall0,
      stormS,
      records,
      counts,
      bursts,
      conversations: agents.conversations,
      ttfts,
      itls,
      e2es,
      faults,
      wedges: [...monitor.wedges.values()],
      leaks,
      settledMs,
      settleLimitMs,
      warmup,
      hangs,
      crashes,
      verification,
      watchedCount: watched.length,
      redispatched,
      migratedRounds: agents.migratedRounds,
    });
  } finally {
    clearInterval(progress);
    for (const t of timers) clearTimeout(t);
    monitor.stop();
    agents.stop();
    await cluster?.stop();
  }
  report.wall_s = (Date.now() - wall0) / 1000;
  if (o.json) writeFileSync(o.json, `${JSON.stringify(report, null, 2)}\n`);
  write.out(formatReport(report));
  return report;
}

/** True when a watched worker's /health says it offloads layers to a GPU (`gpu.layers > 0`). */
async function onGpu(watched: WatchedWorker[]): Promise<boolean> {
  const layers = await Promise.all(watched.map((w) => getJson<{ gpu?: { layers?: number } }>(`${w.url}/health`, 3000).then((h) => h.gpu?.layers ?? 0, () => 0)));
  return layers.some((n) => n > 0);
}

interface Verification {
  reference?: string;
  sampled: number;
  equal: number;
  /** Checked rounds that were served with cached prefix tokens (the prefix cache's path). */
  cached: number;
  /** Checked rounds the router served on the decode-local path (decode alone, no KV handoff). */
  local: number;
  /** Sampled rounds the router migrated mid-answer, and how many of them equal the reference. */
  migrated: number;
  migratedEqual: number;
  mismatches: { agent: number; conv: number; round: number; rid?: string; messages: number; prompt_bytes: number; cached_tokens?: number; path?: string; migrated?: boolean; got: string; want: string }[];
  errors: { agent: number; round: number; error: string }[];
}

/**
 * Send each sampled round to the reference (temperature 0, one at a time) and compare texts.
 * Bounded: each call has `timeoutMs`, the whole pass `max(60 s, 2 × timeoutMs)`; rounds left
 * when the budget runs out are reported as not checked.
 */
async function verify(sample: SampledRound[], reference: string | undefined, timeoutMs: number): Promise<Verification> {
  const v: Verification = { reference, sampled: sample.length, equal: 0, cached: 0, local: 0, migrated: sample.filter((s) => s.migrated).length, migratedEqual: 0, mismatches: [], errors: [] };
  if (!reference || sample.length === 0) return v;
  const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
  const end = performance.now() + Math.max(60_000, 2 * timeoutMs);
  try {
    for (const s of sample) {
      const left = end - performance.now();
      if (left < 1000) {
        v.errors.push({ agent: s.agent, round: s.round, error: 'not checked: the verification time budget ran out' });
        continue;
      }
      const r = await new ChatCall({ baseUrl: reference, agent, messages: s.messages, maxTokens: s.maxTokens, stream: false, deadlineMs: Math.min(timeoutMs, left) }).done;
      if (r.outcome !== 'ok') {
        v.errors.push({ agent: s.agent, round: s.round, error: `${r.outcome}: ${r.code ?? ''} ${r.message ?? ''}`.trim() });
      } else if (r.text === s.text) {
        v.equal++;
        if ((s.cachedTokens ?? 0) > 0) v.cached++;
        if (s.path === 'decode_local') v.local++;
        if (s.migrated) v.migratedEqual++;
      } else {
        v.mismatches.push({ agent: s.agent, conv: s.conv, round: s.round, rid: s.rid, messages: s.messages.length, prompt_bytes: s.messages.reduce((a, m) => a + Buffer.byteLength(m.content), 0), cached_tokens: s.cachedTokens, path: s.path, ...(s.migrated ? { migrated: true } : {}), got: s.text, want: r.text });
      }
    }
  } finally {
    agent.destroy();
  }
  return v;
}

interface BuildInput {
  o: StormOptions;
  selfHosted: boolean;
  routerUrl: string;
  model?: string;
  logDir?: string;
  wall0: number;
  stormS: number;
  records: RequestRecord[];
  counts: Record<'ok' | 'aborted' | 'killed' | 'failed' | 'hung', number>;
  bursts: { count: number; cancelled: number };
  conversations: { started: number; restarted: number; finished: number };
  ttfts: number[];
  itls: number[];
  e2es: number[];
  faults: (FaultRecord & { t: number; watch?: WatchedFault })[];
  wedges: { worker: string; room: RoomView; overdueMs: number; sightings: number }[];
  leaks: LeakReport;
  settledMs: number;
  settleLimitMs: number;
  warmup?: WarmupResult;
  hangs: HangNote[];
  crashes: { process: string; detail: string }[];
  verification: Verification;
  watchedCount: number;
  redispatched: { retried: Record<string, number>; migrated: Record<string, number> };
  /** Completed rounds the router migrated mid-answer (their traces). */
  migratedRounds: number;
}

/**
 * Whether the router migrated request `rid` mid-answer: its trace (GET /debug/traces/:rid) has an
 * `attempt_failed` event with `next: 'migrate'`. Undefined when the trace is unreadable (3 s).
 */
async function migratedOf(routerUrl: string, rid: string): Promise<boolean | undefined> {
  try {
    const t = await getJson<RequestTrace>(`${routerUrl}/debug/traces/${encodeURIComponent(rid)}`, 3000);
    return t.events.some((e) => e.what === 'attempt_failed' && e.next === 'migrate');
  } catch {
    return undefined;
  }
}

/**
 * The router's re-dispatched attempts by failure code, summed over outcomes (its /metrics:
 * pdserve_router_retries_total, pdserve_router_migrations_total); empty when unreadable.
 */
async function routerRedispatches(routerUrl: string): Promise<{ retried: Record<string, number>; migrated: Record<string, number> }> {
  const out = { retried: {} as Record<string, number>, migrated: {} as Record<string, number> };
  try {
    const res = await fetch(`${routerUrl}/metrics`, { signal: AbortSignal.timeout(5000) });
    for (const m of (await res.text()).matchAll(/^pdserve_router_(retries|migrations)_total\{reason="([^"]*)",outcome="[^"]*"\} (\d+)/gm)) {
      const into = m[1] === 'retries' ? out.retried : out.migrated;
      if (Number(m[3]) > 0) into[m[2]!] = (into[m[2]!] ?? 0) + Number(m[3]);
    }
  } catch {
    // the router is gone: nothing to report
  }
  return out;
}

function buildReport(b: BuildInput): StormReport {
  const { o, records, counts } = b;
  const total = records.length;
  const abortedAt: Record<string, number> = {};
  const killedAt: Record<string, number> = {};
  const failedBy: Record<string, number> = {};
  const failedExamples: Record<string, string> = {};
  let stream = 0;
  for (const r of records) {
    if (r.stream) stream++;
    const res = r.result;
    const at = r.plan.endsWith(':send') ? 'right_after_send' : res.phase === 'sending' ? 'while_sending' : res.phase === 'sent' ? 'before_first_token' : 'mid_stream';
    if (res.outcome === 'aborted') abortedAt[at] = (abortedAt[at] ?? 0) + 1;
    if (res.outcome === 'killed') killedAt[at] = (killedAt[at] ?? 0) + 1;
    if (res.outcome === 'failed') {
      const code = res.code ?? 'unknown';
      failedBy[code] = (failedBy[code] ?? 0) + 1;
      failedExamples[code] ??= (res.message ?? '').slice(0, 300);
    }
  }
  const oks = records.filter((r) => r.result.outcome === 'ok').sort((a, b2) => a.result.tStart - b2.result.tStart);
  const faults: FaultRecord[] = b.faults.map((f) => {
    let firstOk = Infinity;
    for (const r of oks) if (r.result.tStart >= f.t && r.result.tEnd - f.t < firstOk) firstOk = r.result.tEnd - f.t;
    const { t: _t, watch, ...rest } = f;
    void _t;
    return {
      ...rest,
      at_s: Math.round(f.at_s * 10) / 10,
      first_ok_ms: Number.isFinite(firstOk) ? Math.round(firstOk) : null,
      worker_ok_ms: watch?.workerOkAt !== undefined ? Math.max(0, watch.workerOkAt - watch.at) : null,
    };
  });

  const offending: OffendingRoom[] = [];
  const checks: CheckResult[] = [];
  const noWorkers = b.watchedCount === 0;

  // wedge
  for (const w of b.wedges) offending.push({ check: 'wedge', worker: w.worker, room: w.room });
  checks.push(
    noWorkers
      ? { name: 'wedge', status: 'skipped', summary: 'no worker to watch (pass --worker URL)', details: [] }
      : {
          name: 'wedge',
          status: b.wedges.length ? 'fail' : 'pass',
          summary: b.wedges.length ? `${b.wedges.length} room(s) live past their deadline (> ${o.wedgeGraceMs} ms, seen in 2 polls)` : `no live room past its deadline (polled every ${o.pollMs} ms)`,
          details: b.wedges.map((w) => ({ worker: w.worker, room: w.room.room, rid: w.room.rid, state: w.room.state, phase: w.room.phase, overdue_ms: w.overdueMs })),
        },
  );

  // leak
  const L = b.leaks;
  for (const r of L.rooms) offending.push({ check: 'leak', worker: r.worker, room: r.room });
  const leakFail = L.items.length > 0 || L.rooms.length > 0 || L.unreachable.length > 0;
  checks.push(
    noWorkers
      ? { name: 'leak', status: 'skipped', summary: 'no worker to watch (pass --worker URL)', details: [] }
      : {
          name: 'leak',
          status: leakFail ? 'fail' : 'pass',
          summary: leakFail
            ? `after a ${(b.settleLimitMs / 1000).toFixed(0)} s settle${b.settleLimitMs > o.settleMs ? (b.ttfts.length ? ' (the longest TTFT seen)' : ' (no first token seen: the request timeout)') : ''}: ${L.items.length} gauge(s) not zero, ${L.rooms.length} live room(s)${L.unreachable.length ? `, ${L.unreachable.length} process(es) unreachable` : ''}`
            : `every queue/room gauge, slot and router lease back to 0 (${(b.settledMs / 1000).toFixed(1)} s after the drain)`,
          details: [...L.items, ...L.rooms.map((r) => ({ where: r.worker, room: r.room.room, rid: r.room.rid, state: r.room.state, phase: r.room.phase, step: r.room.step ?? null })), ...L.unreachable],
        },
  );

  // illegal: refused room writes that are real protocol violations (benign races are not counted here)
  checks.push(
    noWorkers
      ? { name: 'illegal', status: 'skipped', summary: 'no worker to watch (pass --worker URL)', details: [] }
      : {
          name: 'illegal',
          status: L.illegal.length ? 'fail' : 'pass',
          summary: L.illegal.length
            ? `${L.illegal.reduce((n, i) => n + i.value, 0)} illegal room transition(s) (pdserve_illegal_transitions_total)`
            : 'pdserve_illegal_transitions_total is 0 on every worker (benign races are counted as late events)',
          details: L.illegal,
        },
  );

  // hang
  for (const h of b.hangs) for (const r of h.rooms) offending.push({ check: 'hang', worker: r.worker, room: r.room });
  checks.push({
    name: 'hang',
    status: counts.hung ? 'fail' : 'pass',
    summary: counts.hung ? `${counts.hung} request(s) got neither an answer nor an error within ${o.requestTimeoutMs / 1000} s` : `every request got its answer or an error within ${o.requestTimeoutMs / 1000} s`,
    details: b.hangs.map((h) => ({ agent: h.agent, conv: h.conv, round: h.round, phase: h.phase, rid: h.rid ?? null, stream: h.stream, rooms: h.rooms.map((r) => `${r.worker}/${r.room.room}`) })),
  });

  // crash
  checks.push({
    name: 'crash',
    status: b.crashes.length ? 'fail' : 'pass',
    summary: b.crashes.length ? `${b.crashes.length} unexpected exit(s)/restart(s)` : b.selfHosted ? 'no process died without being killed by the storm' : 'no watched worker restarted or vanished',
    details: b.crashes,
  });

  // wrong answer
  const v = b.verification;
  const checked = v.equal + v.mismatches.length;
  checks.push(
    !v.reference || o.verify <= 0
      ? { name: 'wrong_answer', status: 'skipped', summary: o.verify <= 0 ? 'disabled (--verify 0)' : 'no reference (pass --reference URL of a colocated server)', details: [] }
      : checked === 0
        ? { name: 'wrong_answer', status: v.errors.length ? 'fail' : 'skipped', summary: v.errors.length ? `the reference failed all ${v.errors.length} sampled rounds` : 'no completed round to check', details: v.errors }
        : {
            name: 'wrong_answer',
            status: v.mismatches.length ? 'fail' : 'pass',
            summary: `${v.equal} of ${checked} sampled rounds equal the colocated reference (no prefix cache; ${v.cached} of the equal rounds were served with cached prefix tokens, ${v.local} on the decode-local path; ${v.migratedEqual} of ${v.migrated} migrated rounds checked equal, of ${b.migratedRounds} completed rounds the router migrated)${v.mismatches.length ? `, ${v.mismatches.length} differ` : ''}${v.errors.length ? ` (${v.errors.length} not checked: reference error)` : ''}${checked < Math.min(20, o.verify) ? ` (only ${checked} rounds completed)` : ''}`,
            details: [...v.mismatches, ...v.errors],
          },
  );

  const r1 = (x: number) => Math.round(x * 10) / 10;
  const sum = (xs: number[]): Summary => {
    const s = summarize(xs);
    return { n: s.n, mean: r1(s.mean), median: r1(s.median), p50: r1(s.p50), p90: r1(s.p90), p99: r1(s.p99), min: r1(s.min), max: r1(s.max) };
  };
  const { write: _w, signal: _s, env: _e, ...config } = o;
  void _w;
  void _s;
  void _e;
  return {
    ok: checks.every((c) => c.status !== 'fail'),
    mode: b.selfHosted ? 'self-hosted' : 'url',
    target: b.routerUrl,
    config: config as unknown as Record<string, unknown>,
    started_at: new Date(b.wall0).toISOString(),
    storm_s: r1(b.stormS),
    wall_s: 0,
    requests: {
      total,
      ...counts,
      abort_share: total ? counts.aborted / total : 0,
      cancel_share: total ? (counts.aborted + counts.killed) / total : 0,
      aborted_at: abortedAt,
      killed_at: killedAt,
      failed_by_code: failedBy,
      failed_examples: failedExamples,
      retried_by_code: b.redispatched.retried,
      migrated_by_code: b.redispatched.migrated,
      stream,
      non_stream: total - stream,
    },
    bursts: b.bursts,
    rounds: { completed: counts.ok, migrated: b.migratedRounds, migrated_verified: v.migrated, migrated_equal: v.migratedEqual, conversations_started: b.conversations.started, conversations_finished: b.conversations.finished, restarted_after_kill: b.conversations.restarted },
    latency_ms: { ttft: sum(b.ttfts), itl: sum(b.itls), e2e: sum(b.e2es) },
    prompt_bytes: sum(records.map((r) => r.promptBytes)),
    faults,
    checks,
    kv_handoffs: b.leaks.handoffs,
    offending_rooms: offending,
    ...(b.warmup ? { warmup: b.warmup } : {}),
    log_dir: b.logDir,
    model: b.model,
  };
}
