/**
 * Deterministic simulator of the KV room lifecycle (TigerBeetle VOPR style). Each seed builds a
 * `World` (router + prefill + decode, each node the shipped effect executor and driver over fake
 * ports) on virtual time with a seeded PRNG, runs it to completion and checks safety and
 * liveness (world.ts, ports.ts, checks.ts). A seed
 * replays exactly: `pdserve sim --from <seed> --seeds 1 --verbose` (add `--legacy` for the
 * legacy rule) prints the full interleaving.
 */
import { World } from './world.js';
import type { SimOptions, SimResult, TraceEntry } from './model.js';
import type { Violation, ViolationKind } from './checks.js';

export { World } from './world.js';
export { FAULT_PROFILES, SIM_TIMEOUTS } from './model.js';
export type { SimOptions, SimResult, SimStats, TraceEntry, FaultProfileName } from './model.js';
export type { Violation, ViolationKind, NodeName } from './checks.js';
export { Prng } from '../base/prng.js';

/** Run one seed. Pure function of `opts` (deterministic); async because the executors it runs are. */
export function runSim(opts: SimOptions): Promise<SimResult> {
  return new World(opts).run();
}

export interface RunSeedsOptions extends Omit<SimOptions, 'seed' | 'trace'> {
  /** Stop after this many failing seeds (default: never stop early). */
  maxFailures?: number;
  /** Stop at the first result for which this returns true. */
  until?: (r: SimResult) => boolean;
  /** Where failure reports go (default console.error); null: silent. */
  log?: ((line: string) => void) | null;
  /** Failing seeds replayed with a trace and printed in full (default 3). */
  printFailures?: number;
}

export interface RunSeedsResult {
  from: number;
  /** Seeds actually run. */
  ran: number;
  /** Failing results (violations), traces included for the first `printFailures`. */
  failures: SimResult[];
  /** The result `until` matched, replayed with its trace. */
  matched?: SimResult;
  violationsByKind: Partial<Record<ViolationKind, number>>;
  totals: { requests: number; success: number; failed: number; aborts: number; crashes: number; events: number; illegal: number; late: number; expired: number; local: number; localSuccess: number; grouped: number; groupedSuccess: number; sameHost: number; fileRefused: number; filesHeldToFirstStep: number; migrated: number; migratedSuccess: number; migratedAcross: number; retried: number; retriedSuccess: number; twoDecodes: number; striped: number; stripeChunks: number; stripeHeld: number; stripeLost: number; freezes: number; ownStalls: number; switches: number; switchWaitedRooms: number; switchDuringLocal: number; switchFailed: number; switchTimeouts: number };
  elapsedMs: number;
  seedsPerSec: number;
}

/** Run seeds `from .. from+count-1`. On a failure, replays the seed with tracing and prints it. */
export async function runSeeds(from: number, count: number, opts: RunSeedsOptions = {}): Promise<RunSeedsResult> {
  const log = opts.log === undefined ? (l: string) => console.error(l) : opts.log;
  const printFailures = opts.printFailures ?? 3;
  const t0 = performance.now();
  const failures: SimResult[] = [];
  const byKind: Partial<Record<ViolationKind, number>> = {};
  const totals = { requests: 0, success: 0, failed: 0, aborts: 0, crashes: 0, events: 0, illegal: 0, late: 0, expired: 0, local: 0, localSuccess: 0, grouped: 0, groupedSuccess: 0, sameHost: 0, fileRefused: 0, filesHeldToFirstStep: 0, migrated: 0, migratedSuccess: 0, migratedAcross: 0, retried: 0, retriedSuccess: 0, twoDecodes: 0, striped: 0, stripeChunks: 0, stripeHeld: 0, stripeLost: 0, freezes: 0, ownStalls: 0, switches: 0, switchWaitedRooms: 0, switchDuringLocal: 0, switchFailed: 0, switchTimeouts: 0 };
  let ran = 0;
  let matched: SimResult | undefined;
  const simOpts = (seed: number, trace: boolean): SimOptions => ({ seed, trace, rooms: opts.rooms, legacy: opts.legacy, faults: opts.faults, slots: opts.slots, sameHost: opts.sameHost, decodes: opts.decodes, kvStreams: opts.kvStreams, timeouts: opts.timeouts, migrationLimit: opts.migrationLimit, requestTimeoutMs: opts.requestTimeoutMs, switches: opts.switches, plantSwitchBug: opts.plantSwitchBug });
  for (let i = 0; i < count; i++) {
    const seed = from + i;
    const r = await runSim(simOpts(seed, false));
    ran++;
    for (const k of Object.keys(totals) as (keyof typeof totals)[]) totals[k] += r.stats[k];
    if (!r.ok) {
      for (const v of r.violations) byKind[v.kind] = (byKind[v.kind] ?? 0) + 1;
      let shown = r;
      if (failures.length < printFailures) {
        shown = await runSim(simOpts(seed, true)); // exact replay, now with the trace
        log?.(formatFailure(shown));
      }
      failures.push(shown);
    }
    if (opts.until?.(r)) {
      matched = await runSim(simOpts(seed, true));
      break;
    }
    if (opts.maxFailures !== undefined && failures.length >= opts.maxFailures) break;
  }
  const elapsedMs = performance.now() - t0;
  return { from, ran, failures, matched, violationsByKind: byKind, totals, elapsedMs, seedsPerSec: ran / (elapsedMs / 1000) };
}

/** The replay command for a seed. */
export function replayCommand(r: Pick<SimResult, 'seed' | 'legacy'> & Partial<Pick<SimResult, 'forced'>>, rooms?: number): string {
  return `pdserve sim --from ${r.seed} --seeds 1${r.legacy ? ' --legacy' : ''}${rooms ? ` --rooms ${rooms}` : ''}${(r.forced ?? []).map((f) => ` ${f}`).join('')} --verbose`;
}

/** The trace entries about one room, plus node-wide events (crashes, epochs, peer loss). */
export function interleaving(r: SimResult, room: string | undefined): TraceEntry[] {
  return (r.trace ?? []).filter((e) => e.room === room || (e.who === 'sim' && e.room === undefined));
}

export function formatTrace(entries: TraceEntry[], labels: Record<string, string> = {}): string {
  return entries.map((e) => `  t=${e.at.toFixed(1).padStart(7)}  ${e.who.padEnd(3)} ${e.room ? `${labels[e.room] ?? e.room} ` : ''}${e.text}`).join('\n');
}

export function formatViolation(v: Violation): string {
  return `${v.kind}${v.node ? ` on ${v.node}` : ''}${v.label ? ` ${v.label}` : ''}${v.room ? ` (room ${v.room})` : ''} at t=${v.at.toFixed(1)}: ${v.detail}`;
}

/** Seed, violations, replay command and the offending room's interleaving. */
export function formatFailure(r: SimResult, opts: { full?: boolean } = {}): string {
  const lines = [
    `SIM seed ${r.seed}${r.legacy ? ' (legacy max rule)' : ''} FAILED — ${r.violations.length} violation(s), faults=${r.profile}, decodes=${r.decodes}, kv-streams=${r.kvStreams}`,
    ...r.violations.slice(0, 8).map((v) => `  ${formatViolation(v)}`),
    ...(r.violations.length > 8 ? [`  ... ${r.violations.length - 8} more`] : []),
    `  replay: ${replayCommand(r)}`,
  ];
  const first = r.violations.find((v) => v.kind === 'wedge' && v.revived) ?? r.violations.find((v) => v.kind === 'wedge') ?? r.violations[0];
  if (r.trace) {
    const entries = opts.full ? r.trace : interleaving(r, first?.room);
    lines.push(opts.full ? '  full trace:' : `  interleaving of ${first?.label ?? '(world)'}${first?.node ? ` (offending node ${first.node})` : ''}:`);
    lines.push(formatTrace(entries, r.labels));
  }
  return lines.join('\n');
}

/** Find the first seed (from `from`, at most `max` seeds) whose run has a wedge; returns it traced. */
export function findFirstWedge(from: number, max: number, opts: Omit<RunSeedsOptions, 'until'> & { revivedOnly?: boolean } = {}): Promise<RunSeedsResult> {
  const pred = (v: Violation): boolean => v.kind === 'wedge' && (!opts.revivedOnly || v.revived === true);
  return runSeeds(from, max, { ...opts, log: opts.log ?? null, until: (r) => r.violations.some(pred) });
}

/**
 * CLI entry for `pdserve sim`. Flags: `--seeds N` (default 1000), `--from S` (default 1),
 * `--seed S` (= --from S --seeds 1 --verbose), `--rooms R` (requests per seed, default 12),
 * `--legacy` (test-only legacy max rule: expect wedges; stops at the first failing seed unless
 * `--all`), `--decodes 1|2` and `--kv-streams 1|2` (the topology, else drawn from each seed),
 * `--switches` (one role switch per world: drain, tear down, rebuild), `--verbose` (full trace of failing seeds, or of the single seed). Env
 * PDSERVE_SIM_SEEDS overrides the default seed count. Returns the exit code: 0 when no violation
 * was found, 1 otherwise (for `--legacy`, 1 means the bug was reproduced), 2 on bad flags.
 */
export async function simMain(argv: string[], out: (line: string) => void = (l) => console.log(l)): Promise<number> {
  if (argv.includes('--help') || argv.includes('-h')) {
    out('usage: pdserve sim [--seeds N] [--from S] [--seed S] [--rooms R] [--decodes 1|2] [--kv-streams 1|2] [--migration-limit N] [--request-timeout-ms MS] [--switches] [--legacy [--all]] [--verbose]');
    out('  runs the room lifecycle under a deterministic simulator (faulty network, crashes, aborts);');
    out('  exit 0 = no violation, 1 = violations (with --legacy: the wedge was reproduced), 2 = bad flags');
    return 0;
  }
  const known = new Set(['seeds', 'from', 'seed', 'rooms', 'decodes', 'kv-streams', 'migration-limit', 'request-timeout-ms', 'legacy', 'verbose', 'all', 'switches']);
  const args = new Map<string, string | true>();
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i]!;
    if (a.startsWith('--') && !known.has(a.slice(2).split('=', 1)[0]!)) {
      out(`pdserve sim: unknown flag ${a} (see pdserve sim --help)`);
      return 2;
    }
    if (!a.startsWith('--')) {
      out(`pdserve sim: unexpected argument ${a}`);
      return 2;
    }
    const [k, inline] = a.slice(2).split('=', 2) as [string, string | undefined];
    if (['legacy', 'verbose', 'all', 'switches'].includes(k)) args.set(k, true);
    else {
      const v = inline ?? argv[++i];
      if (v === undefined) {
        out(`pdserve sim: --${k} needs a value`);
        return 2;
      }
      args.set(k, v);
    }
  }
  const num = (k: string, d: number): number => {
    const v = args.get(k);
    if (v === undefined || v === true) return d;
    const n = Number(v);
    if (!Number.isInteger(n)) throw new Error(`--${k} must be an integer`);
    return n;
  };
  let from: number;
  let seeds: number;
  let rooms: number;
  const topo: Pick<SimOptions, 'decodes' | 'kvStreams' | 'migrationLimit' | 'requestTimeoutMs' | 'switches'> = {};
  try {
    for (const [k, f] of [['decodes', 'decodes'], ['kv-streams', 'kvStreams']] as const) {
      if (!args.has(k)) continue;
      const n = num(k, 1);
      if (n !== 1 && n !== 2) throw new Error(`--${k} must be 1 or 2`);
      topo[f] = n;
    }
    if (args.has('switches')) topo.switches = true;
    if (args.has('migration-limit')) topo.migrationLimit = Math.max(0, num('migration-limit', 0));
    if (args.has('request-timeout-ms')) topo.requestTimeoutMs = Math.max(1, num('request-timeout-ms', 1));
    const single = args.has('seed');
    from = single ? num('seed', 1) : num('from', 1);
    seeds = single ? 1 : num('seeds', Number(process.env.PDSERVE_SIM_SEEDS ?? 1000));
    rooms = num('rooms', 12);
  } catch (err) {
    out(`pdserve sim: ${(err as Error).message}`);
    return 2;
  }
  const legacy = args.has('legacy');
  const verbose = args.has('verbose') || (args.has('seed') && !args.has('from'));
  if (seeds === 1 && verbose) {
    const r = await runSim({ seed: from, rooms, legacy, trace: true, ...topo });
    out(r.ok ? `seed ${from}${legacy ? ' (legacy)' : ''}: ok (faults=${r.profile}, decodes=${r.decodes}, kv-streams=${r.kvStreams})` : formatFailure(r, { full: false }));
    out('full trace:');
    out(formatTrace(r.trace ?? [], r.labels));
    out(`stats: ${JSON.stringify(r.stats)}`);
    return r.ok ? 0 : 1;
  }
  const res = await runSeeds(from, seeds, {
    rooms,
    ...topo,
    legacy,
    maxFailures: legacy && !args.has('all') ? 1 : undefined,
    log: (l) => out(l),
    printFailures: verbose ? 10 : 3,
  });
  const kinds = Object.entries(res.violationsByKind).map(([k, n]) => `${k}=${n}`).join(' ');
  out(
    `${res.failures.length === 0 ? 'ok' : 'FAILED'}: ${res.ran} seeds from ${from} (${rooms} requests each${legacy ? ', legacy max rule' : ''}) in ${(res.elapsedMs / 1000).toFixed(1)} s = ${res.seedsPerSec.toFixed(0)} seeds/s; ` +
      `${res.totals.success} ok / ${res.totals.failed} failed requests, ${res.totals.aborts} aborts, ${res.totals.crashes} crashes, ${res.totals.late} late events (benign races), ${res.totals.illegal} refused writes (duplicated/reordered frames of the faulty network), ${res.totals.expired} deadlines` +
      (topo.switches ? `, ${res.totals.switches} role switches (${res.totals.switchWaitedRooms} waited for live rooms with no request in flight, ${res.totals.switchDuringLocal} asked during a decode-local request, ${res.totals.switchFailed} failed midway, ${res.totals.switchTimeouts} drain timeouts)` : '') +
      (res.failures.length ? `; ${res.failures.length} failing seed(s): ${res.failures.slice(0, 10).map((f) => f.seed).join(', ')}; violations: ${kinds}` : ''),
  );
  return res.failures.length === 0 ? 0 : 1;
}
