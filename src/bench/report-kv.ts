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
 * The handoff-at-scale goals for the goals table: TCP ≤ 1.1× its floor at ≥ 256 MiB (≤ 1.3× from
 * 16 MiB), same-host ≤ 1.1×, event-loop p99 ≤ 20 ms at 1 GiB on both sides (§1's large-state
 * file), PD token-1 → token-2 gap ≤ 3 × colocated ITL at 1500 prompt tokens (§2). Rows of
 * [goal, measured, verdict]; none for what was not measured.
 */
export function handoffAtScaleGoals(f: SectionFile | undefined, s2: LowLoadRow[] | undefined): string[][] {
  const rows = largeStateGoals(f);
  const st = s2?.filter((r) => r.secondToken && r.promptTokens >= 1500) ?? [];
  if (st.length) rows.push(['PD token-1 → token-2 gap ≤ 3 × colocated ITL at 1500 prompt tokens (§2)', st.map((r) => `${r.promptTokens}: ${fmt(r.secondToken!.pdGapMs)} ms against ITL ${fmt(r.secondToken!.coloItlMs, 2)} ms, ${ratio(r.secondToken!.ratio)}`).join('; '), st.every((r) => r.secondToken!.ratio <= 3) ? '**pass**' : '**miss**']);
  return rows;
}

function largeStateGoals(f: SectionFile | undefined): string[][] {
  const r = f?.result as KvSectionResult | undefined;
  if (!r?.sizes?.length) return [];
  const rows: string[][] = [];
  const tcp = r.sizes.map((s) => `${size(s.blobBytes)} ${ratio(s.goalRatio)} (raw TCP ${fmt(s.rawGBps, 2)} GB/s, the channel's wire ${fmt(s.wireGBps, 2)} GB/s)`).join(', ');
  // a bare socket slower than the whole handoff is no floor: no verdict from it
  const floorOk = r.sizes.every((s) => s.rawMs.median < s.kvMs.median);
  rows.push(['KV handoff over TCP ≤ 1.1 × (save + raw TCP + load) at 256 MiB – 1 GiB (§1, large states)', tcp, !floorOk ? 'not measured: raw TCP slower than the handoff (no floor)' : r.sizes.every((s) => s.goalRatio <= 1.1) ? '**pass**' : r.sizes.every((s) => s.goalRatio <= 1.3) ? '**miss** (≤ 1.3 × met)' : '**miss**']);
  const sh = r.sizes.filter((s) => s.sameHostGoalRatio !== undefined);
  if (sh.length) rows.push(['same-host handoff ≤ 1.1 × (save + load) at 256 MiB – 1 GiB', sh.map((s) => `${size(s.blobBytes)} ${ratio(s.sameHostGoalRatio)}`).join(', '), sh.every((s) => s.sameHostGoalRatio! <= 1.1) ? '**pass**' : '**miss**']);
  const gib = r.sizes[r.sizes.length - 1]!;
  const d = gib.loopDelayMs?.kv;
  if (d) rows.push([`event-loop delay p99 ≤ 20 ms on both sides during a ${size(gib.blobBytes)} handoff`, `TCP: prefill ${fmt(d.senderP99)} ms, decode ${fmt(d.receiverP99)} ms${gib.loopDelayMs?.sameHost ? `; same host: prefill ${fmt(gib.loopDelayMs.sameHost.senderP99)} ms, decode ${fmt(gib.loopDelayMs.sameHost.receiverP99)} ms` : ''}`, d.senderP99 <= 20 && d.receiverP99 <= 20 && (!gib.loopDelayMs?.sameHost || (gib.loopDelayMs.sameHost.senderP99 <= 20 && gib.loopDelayMs.sameHost.receiverP99 <= 20)) ? '**pass**' : '**miss**']);
  return rows;
}

/** The tables of §1's "Large states" (the heading and prose are the report template's; empty when the run has not been made). */
export function largeStatesSection(f: SectionFile | undefined, provenance: string): string[] {
  const r = f?.result as KvSectionResult | undefined;
  if (!r?.sizes?.length) return [];
  const L: string[] = [provenance, '', `Context ${r.stateMaking.length ? Math.max(...r.stateMaking.map((s) => s.tokens)) + 256 : 'n/a'} tokens, 2 llama.cpp threads, decode side 1 sequence; each state is a real prompt evaluated once and saved by llama.cpp in every trial.`, ''];
  L.push(
    table(
      ['state', 'tokens', 'KV, workers\' path: median (p90) ms', 'KV, inline: median ms', 'raw TCP ms', 'save ms', 'loadState ms', 'goal: KV / (save + raw + load)', 'inline: same ratio', 'wire GB/s', 'raw GB/s', 'trials'],
      r.sizes.map((s) => [size(s.blobBytes), s.tokens, `${fmt(s.kvMs.median)} (${fmt(s.kvMs.p90)})`, fmt(s.inline?.kvMs.median), fmt(s.rawMs.median), fmt(s.goalSaveMs ?? s.saveMs), fmt(s.phasesMs.loadState), `**${ratio(s.goalRatio)}** ${s.rawMs.median >= s.kvMs.median ? '(no floor)' : s.goalRatio <= 1.1 ? 'pass' : s.goalRatio <= 1.3 ? '(≤ 1.3 only)' : 'miss'}`, ratio(s.inline?.goalRatio), fmt(s.wireGBps, 3), fmt(s.rawGBps, 3), s.kvMs.n]),
    ),
  );
  if (r.sizes.some((s) => s.rawMs.median >= s.kvMs.median))
    L.push('', `Raw TCP is slower than the whole handoff here (${r.sizes.map((s) => `${size(s.blobBytes)}: ${fmt(s.rawGBps, 2)} GB/s against the channel's wire ${fmt(s.wireGBps, 2)} GB/s`).join('; ')}): its receiver allocates a buffer per read where the channel reuses one, so that floor is no floor and its ratio no verdict; compare the workers' path with inline, same trials.`);
  L.push('', 'Phases of the workers\' path trials (medians, ms; as in the table above):', '');
  L.push(
    table(
      ['state', 'save', 'prefill send', 'kv_begin lag', 'decode wire', 'finish at kv_end', 'loadState', 'kv_ack lag'],
      r.sizes.map((s) => [size(s.blobBytes), fmt(s.phasesMs.save), fmt(s.phasesMs.send), fmt(s.phasesMs.beginLag, 2), fmt(s.phasesMs.wire), fmt(s.phasesMs.writeFile), fmt(s.phasesMs.loadState), fmt(s.phasesMs.ackLag, 2)]),
    ),
  );
  const sh = r.sizes.filter((s) => s.sameHostMs);
  if (sh.length) {
    L.push('', 'Same host (kv_file: rename + header walk, no byte read), same run:', '');
    L.push(
      table(
        ['state', 'same-host to decode-loaded, median (p90) ms', 'save ms', 'decode take ms', 'loadState ms', 'goal: (save + same-host) / (save + load), ≤ 1.1'],
        sh.map((s) => [size(s.blobBytes), `${fmt(s.sameHostMs!.median)} (${fmt(s.sameHostMs!.p90)})`, fmt(s.saveMs), fmt(s.sameHostPhasesMs?.take, 2), fmt(s.sameHostPhasesMs?.load), `**${ratio(s.sameHostGoalRatio)}** ${s.sameHostGoalRatio! <= 1.1 ? 'pass' : 'miss'}`]),
      ),
    );
  }
  const row = (s: KvSectionResult['sizes'][number], kind: string, d: LoopDelay | undefined): (string | number)[] | undefined => (d ? [size(s.blobBytes), kind, fmt(d.senderP99), fmt(d.senderMax), fmt(d.receiverP99), fmt(d.receiverMax)] : undefined);
  L.push(
    '',
    "The event loop's delay during the trials (1 ms resolution; prefill from the save's start to `kv_ack`, decode from `kv_begin` (TCP) or the load's start (same host) to the load's return; p99: median over trials of each trial's p99; max: the largest of any trial):",
    '',
  );
  L.push(
    table(
      ['state', 'handoff', 'prefill p99 ms', 'prefill max ms', 'decode p99 ms', 'decode max ms'],
      r.sizes.flatMap((s) => [row(s, 'TCP, workers\' path', s.loopDelayMs?.kv), row(s, 'TCP, inline', s.loopDelayMs?.kvInline), row(s, 'same host', s.loopDelayMs?.sameHost)].filter((x): x is (string | number)[] => x !== undefined)),
    ),
  );
  return L;
}
