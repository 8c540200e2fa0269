/**
 * BENCHMARKS.md §1's large states (bench/results/s1-kv-large.json, PDSERVE_BENCH_KV_BIG=1): the
 * TCP and same-host handoffs of 256 MiB and 1 GiB real states, their phases, and the event
 * loop's delay on both sides: the workers' path (prefill's reads on the KV I/O thread, decode's
 * tmpfs writes inline) and the data path inline on both sides (the same trials interleaved).
 */
import type { KvSectionResult, LoopDelay } from './kv.js';
import type { SectionFile } from './util.js';
import type { LowLoadRow } from './sections.js';

const MiB = 1024 * 1024;
const fmt = (x: number | undefined, d = 1): string => (x === undefined || x === null || !Number.isFinite(x) ? 'n/a' : x.toFixed(d));
const ratio = (x: number | undefined): string => (x === undefined || !Number.isFinite(x) ? 'n/a' : `${x.toFixed(2)}×`);
const size = (bytes: number): string => (bytes >= 1024 * MiB ? `${(bytes / (1024 * MiB)).toFixed(2)} GiB` : `${(bytes / MiB).toFixed(0)} MiB`);

function table(head: string[], rows: (string | number)[][]): string {
  return [`| ${head.join(' | ')} |`, `|${head.map((_h, i) => (i === 0 ? '---' : '---:')).join('|')}|`, ...rows.map((r) => `| ${r.join(' | ')} |`)].join('\n');
}

/**
 * The handoff goals' size ranges (MiB of the requested state, `targetMiB`): TCP ≤ 1.3 × its floor
 * from 16 MiB to 1 GiB and ≤ 1.1 × from 256 MiB; same host ≤ 1.1 × from 4 MiB. Below a range the
 * whole budget is a few loopback wake-ups on this machine: those sizes are shown, not judged.
 */
export const KV_GOALS = {
  tcp: { limit: 1.3, fromMiB: 16, toMiB: 1024 },
  tcpLarge: { limit: 1.1, fromMiB: 256, toMiB: Infinity },
  sameHost: { limit: 1.1, fromMiB: 4, toMiB: Infinity },
} as const;

/** A goal's size range. */
export type KvGoalRange = { limit: number; fromMiB: number; toMiB: number };

/** The requested size of a §1 state, MiB (older results without `targetMiB`: its bytes, rounded). */
export const targetMiBOf = (s: { targetMiB?: number; blobBytes: number }): number => s.targetMiB ?? Math.round(s.blobBytes / MiB);

/** Whether a state of `mib` MiB is inside goal `g`'s range. */
export const judged = (g: KvGoalRange, mib: number): boolean => mib >= g.fromMiB && mib <= g.toMiB;

/** One size's figure in a goal row: its label, its ratio, and whether it can be judged at all (`noFloor`: raw TCP slower than the handoff). */
export interface GoalFigure {
  targetMiB: number;
  label: string;
  ratio: number | undefined;
  noFloor?: boolean;
}

/** The figures of one run's table for a goal row (`figures` undefined: that table was not measured). */
export interface GoalPart {
  /** Where they come from ("§1", "§1 large states"). */
  what: string;
  /** The run's commit (named in the row when the parts come from different commits). */
  commit?: string;
  figures: GoalFigure[] | undefined;
}

/**
 * A goal over a size range as a summary row [goal, measured, verdict], from the figures of one
 * or more tables (each ratio is within one run). Sizes inside `g`'s range are judged against
 * `g.limit`; sizes outside it are left out of the row; a size without a floor (`noFloor`) is
 * shown and not judged. Verdict: **miss** when a judged size is above the limit; **pass** when
 * every judged size is within it and every part was measured; "pass so far (… not measured)"
 * when a part is missing; "not measured" when nothing in the range was.
 */
export function rangeGoal(goal: string, g: KvGoalRange, parts: GoalPart[]): string[] {
  const inRange: GoalFigure[] = [];
  const shown: string[] = [];
  const outside: string[] = [];
  const missing: string[] = [];
  const commits = new Set(parts.filter((p) => p.figures?.length && p.commit).map((p) => p.commit));
  for (const p of parts) {
    const figs = (p.figures ?? []).filter((f) => f.ratio !== undefined && Number.isFinite(f.ratio));
    if (!figs.length) {
      missing.push(p.what);
      continue;
    }
    const mine: string[] = [];
    for (const f of figs) {
      if (!judged(g, f.targetMiB)) outside.push(`${f.label} ${ratio(f.ratio)}`);
      else if (f.noFloor) mine.push(`${f.label} ${ratio(f.ratio)} (raw TCP slower than the handoff: no floor, not judged)`);
      else {
        inRange.push(f);
        mine.push(`${f.label} ${ratio(f.ratio)}`);
      }
    }
    if (mine.length) shown.push(commits.size > 1 ? `${mine.join(', ')} (${p.what}, ${p.commit})` : mine.join(', '));
  }
  // sizes outside the range are left out here (the section's tables mark them "not judged")
  const measured = shown.join('; ') || (outside.length ? 'none in range' : 'n/a');
  const verdict = inRange.some((f) => f.ratio! > g.limit) ? '**miss**' : !inRange.length ? 'not measured' : missing.length ? `pass so far (${missing.join(', ')} not measured)` : '**pass**';
  return [goal, measured, verdict];
}

const figuresOf = (r: KvSectionResult | undefined, pick: (s: KvSectionResult['sizes'][number]) => number | undefined, noFloor = false): GoalFigure[] | undefined =>
  r?.sizes?.length ? r.sizes.map((s) => ({ targetMiB: targetMiBOf(s), label: size(s.blobBytes), ratio: pick(s), ...(noFloor && s.rawMs.median >= s.kvMs.median ? { noFloor: true } : {}) })) : undefined;

/**
 * The handoff goals of the summary table, each judged on its own size range (KV_GOALS) over §1's
 * table (1–64 MiB, `s1`) and its large states (256 MiB, 1 GiB, `large`): TCP ≤ 1.3 × (save + raw
 * TCP + load) at 16 MiB – 1 GiB, ≤ 1.1 × at ≥ 256 MiB; same host ≤ 1.1 × (save + load) at ≥ 4 MiB;
 * the event loop's delay p99 ≤ 20 ms on both sides during the 1 GiB handoff; and §2's PD token-1
 * → token-2 gap ≤ 3 × colocated ITL at 1500 prompt tokens. Rows of [goal, measured, verdict];
 * a goal without figures says "not measured".
 */
export function handoffGoals(s1: SectionFile | undefined, large: SectionFile | undefined, s2: LowLoadRow[] | undefined): string[][] {
  const small = s1?.result as KvSectionResult | undefined;
  const big = large?.result as KvSectionResult | undefined;
  const parts = (pick: (s: KvSectionResult['sizes'][number]) => number | undefined, noFloor: boolean, withSmall = true): GoalPart[] => [
    ...(withSmall ? [{ what: '§1', commit: s1?.meta.commit, figures: figuresOf(small, pick) }] : []),
    { what: '§1 large states', commit: large?.meta.commit, figures: figuresOf(big, pick, noFloor) },
  ];
  const sameHostFigs = (r: KvSectionResult | undefined) => r?.sizes?.some((s) => s.sameHostGoalRatio !== undefined);
  const rows: string[][] = [
    rangeGoal('KV handoff over TCP ≤ 1.3 × floor at 16 MiB – 1 GiB (§1)', KV_GOALS.tcp, parts((s) => s.goalRatio, true)),
    rangeGoal('KV handoff over TCP ≤ 1.1 × floor at ≥ 256 MiB (§1)', KV_GOALS.tcpLarge, parts((s) => s.goalRatio, true, false)),
  ];
  const sh = rangeGoal('same-host handoff ≤ 1.1 × (save + load) at ≥ 4 MiB (§1)', KV_GOALS.sameHost, parts((s) => s.sameHostGoalRatio, false));
  if ((small || big) && !sameHostFigs(small) && !sameHostFigs(big)) sh[1] = 'n/a (the two processes failed the same-host probe)';
  rows.push(sh);
  const gib = big?.sizes?.length ? big.sizes[big.sizes.length - 1]! : undefined;
  const d = gib?.loopDelayMs?.kv;
  if (gib && d) {
    const shd = gib.loopDelayMs?.sameHost;
    const ok = d.senderP99 <= 20 && d.receiverP99 <= 20 && (!shd || (shd.senderP99 <= 20 && shd.receiverP99 <= 20));
    rows.push([`event-loop delay p99 ≤ 20 ms on both sides during a ${size(gib.blobBytes)} handoff (§1)`, `prefill / decode: TCP ${fmt(d.senderP99)} / ${fmt(d.receiverP99)} ms${shd ? `, same host ${fmt(shd.senderP99)} / ${fmt(shd.receiverP99)} ms` : ''}`, ok ? '**pass**' : '**miss**']);
  } else rows.push(['event-loop delay p99 ≤ 20 ms on both sides during a 1 GiB handoff (§1)', 'n/a', 'not measured']);
  const st = s2?.filter((r) => r.secondToken && r.promptTokens >= 1500) ?? [];
  rows.push(
    st.length
      ? ['PD token-1 → token-2 gap ≤ 3 × colocated ITL at 1500 prompt tokens (§2)', st.map((r) => `${fmt(r.secondToken!.pdGapMs)} vs ${fmt(r.secondToken!.coloItlMs, 2)} ms: ${ratio(r.secondToken!.ratio)}`).join('; '), st.every((r) => r.secondToken!.ratio <= 3) ? '**pass**' : '**miss**']
      : ['PD token-1 → token-2 gap ≤ 3 × colocated ITL at 1500 prompt tokens (§2)', 'n/a', 'not measured'],
  );
  return rows;
}

/** The tables of §1's "Large states" (the heading and prose are the report template's; empty when the run has not been made). */
export function largeStatesSection(f: SectionFile | undefined, provenance: string): string[] {
  const r = f?.result as KvSectionResult | undefined;
  if (!r?.sizes?.length) return [];
  const L: string[] = [provenance, '', `Context ${r.stateMaking.length ? Math.max(...r.stateMaking.map((s) => s.tokens)) + 256 : 'n/a'} tokens, 2 llama.cpp threads, 1 decode sequence.`, ''];
  // the inline columns only where the run made inline trials (save-then-send runs)
  const inline = r.sizes.some((s) => s.inline);
  const cols = (all: (string | number)[]) => (inline ? all : all.filter((_, i) => i !== 3 && i !== 8));
  L.push(
    table(
      cols(['state', 'tokens', 'KV ms (p90)', 'KV inline ms', 'raw TCP ms', 'save ms', 'loadState ms', 'KV / (save+raw+load)', 'inline: same ratio', 'trials']) as string[],
      r.sizes.map((s) => cols([size(s.blobBytes), s.tokens, `${fmt(s.kvMs.median)} (${fmt(s.kvMs.p90)})`, fmt(s.inline?.kvMs.median), fmt(s.rawMs.median), fmt(s.goalSaveMs ?? s.saveMs), fmt(s.phasesMs.loadState), `**${ratio(s.goalRatio)}** ${s.rawMs.median >= s.kvMs.median ? '(no floor)' : s.goalRatio <= 1.1 ? 'pass' : s.goalRatio <= 1.3 ? '(≤ 1.3 only)' : 'miss'}`, ratio(s.inline?.goalRatio), s.kvMs.n])),
    ),
  );
  if (r.sizes.some((s) => s.rawMs.median >= s.kvMs.median))
    L.push('', `Raw TCP is slower than the whole handoff here (${r.sizes.map((s) => `${size(s.blobBytes)}: ${fmt(s.rawGBps, 2)} GB/s against the channel's wire ${fmt(s.wireGBps, 2)} GB/s`).join('; ')}): its receiver allocates a buffer per read where the channel reuses one, so that floor is no floor and its ratio no verdict; compare the workers' path with inline, same trials.`);
  const sh = r.sizes.filter((s) => s.sameHostMs);
  if (sh.length) {
    L.push('', 'Same host, same run:', '');
    L.push(
      table(
        ['state', 'same host ms (p90)', 'save ms', 'take ms', 'loadState ms', '(save+same host) / (save+load), ≤ 1.1'],
        sh.map((s) => [size(s.blobBytes), `${fmt(s.sameHostMs!.median)} (${fmt(s.sameHostMs!.p90)})`, fmt(s.saveMs), fmt(s.sameHostPhasesMs?.take, 2), fmt(s.sameHostPhasesMs?.load), `**${ratio(s.sameHostGoalRatio)}** ${s.sameHostGoalRatio! <= 1.1 ? 'pass' : 'miss'}`]),
      ),
    );
  }
  const row = (s: KvSectionResult['sizes'][number], kind: string, d: LoopDelay | undefined): (string | number)[] | undefined => (d ? [size(s.blobBytes), kind, fmt(d.senderP99), fmt(d.senderMax), fmt(d.receiverP99), fmt(d.receiverMax)] : undefined);
  L.push(
    '',
    "Event-loop delay during the handoffs (p99: median of the trials' p99s; max: over all trials):",
    '',
  );
  L.push(
    table(
      ['state', 'handoff', 'prefill p99 ms', 'max', 'decode p99 ms', 'max'],
      r.sizes.flatMap((s) => [row(s, 'TCP', s.loopDelayMs?.kv), row(s, 'TCP, inline', s.loopDelayMs?.kvInline), row(s, 'same host', s.loopDelayMs?.sameHost)].filter((x): x is (string | number)[] => x !== undefined)),
    ),
  );
  return L;
}
