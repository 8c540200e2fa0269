/**
 * Text output of `pdserve storm`: the progress line and the final table (requests by outcome
 * and error code, latency percentiles, faults with their recovery times, the checks, and the
 * timelines of the offending rooms).
 */
import { formatTimeline, describeRoom } from './monitor.js';
import type { StormReport } from './types.js';
import { percentile, sortedNumbers } from '../observe/stats.js';

export interface ProgressInput {
  elapsedS: number;
  durationS: number;
  counts: Record<'ok' | 'aborted' | 'killed' | 'failed' | 'hung', number>;
  /** Recent TTFTs, ms (any order). */
  ttft: number[];
  /** Live rooms by state over all workers. */
  live: Record<string, number>;
  /** Kinds of the faults injected so far. */
  faults: string[];
  inFlight: number;
}

const ms = (x: number): string => (Number.isFinite(x) ? `${Math.round(x)}` : '-');
/** A duration with its unit: `812 ms`, `10.9 s`. */
const dur = (x: number | null): string => (x === null || !Number.isFinite(x) ? '-' : x >= 10_000 ? `${(x / 1000).toFixed(1)} s` : `${Math.round(x)} ms`);

/** The one-line progress: rounds done, outcomes, TTFT p50/p99, live rooms by state, faults. */
export function formatProgress(p: ProgressInput): string {
  const s = sortedNumbers(p.ttft);
  const c = p.counts;
  const live = ['Bootstrapping', 'WaitingForInput', 'Transferring'].map((k) => `${k.slice(0, 4)} ${p.live[k] ?? 0}`).join(' ');
  const f = { kill_decode: 0, kill_prefill: 0, stop_prefill: 0 } as Record<string, number>;
  for (const k of p.faults) f[k] = (f[k] ?? 0) + 1;
  const el = Math.min(p.elapsedS, p.durationS);
  return (
    `[${String(Math.round(el)).padStart(4)}s/${Math.round(p.durationS)}s${p.elapsedS > p.durationS + 0.5 ? ' drain' : ''}] ` +
    `rounds ${c.ok} | ok ${c.ok} aborted ${c.aborted} killed ${c.killed} failed ${c.failed}${c.hung ? ` HUNG ${c.hung}` : ''} | ` +
    `TTFT p50 ${ms(percentile(s, 50))} p99 ${ms(percentile(s, 99))} ms | in flight ${p.inFlight} | live rooms ${live} | ` +
    `faults kill-D ${f.kill_decode} kill-P ${f.kill_prefill} stop-P ${f.stop_prefill}`
  );
}

function table(rows: string[][], indent = '  '): string {
  const widths: number[] = [];
  for (const r of rows) r.forEach((c, i) => (widths[i] = Math.max(widths[i] ?? 0, c.length)));
  return rows.map((r) => indent + r.map((c, i) => (i === 0 ? c.padEnd(widths[i]!) : c.padStart(widths[i]!))).join('  ').trimEnd()).join('\n');
}

const pct = (x: number) => `${(100 * x).toFixed(1)} %`;
const kv = (o: Record<string, number>) =>
  Object.entries(o)
    .sort((a, b) => b[1] - a[1])
    .map(([k, v]) => `${k} ${v}`)
    .join(', ') || '-';

/** The final report as text: tables, checks, offending rooms, verdict. */
export function formatReport(r: StormReport): string {
  const q = r.requests;
  const c = r.config as Record<string, unknown>;
  const out: string[] = [];
  const target = r.mode === 'self-hosted' ? `self-hosted: ${c.prefill} prefill + ${c.decode} decode (${c.model ? 'model ' + String(c.model) : `${c.preset} model`})` : `router ${r.target}`;
  out.push('');
  out.push(`pdserve storm — ${target}, ${c.agents} agents × ${c.rounds} rounds, ${r.storm_s} s, seed ${c.seed}`);
  out.push('');
  out.push(
    table([
      ['requests', 'total', 'ok', 'aborted', 'killed', 'failed', 'hung'],
      ['', String(q.total), String(q.ok), String(q.aborted), String(q.killed), String(q.failed), String(q.hung)],
    ]),
  );
  out.push(`  abort share ${pct(q.abort_share)} (with kills ${pct(q.cancel_share)}); ${q.stream} streamed, ${q.non_stream} not; bursts ${r.bursts.count} (${r.bursts.cancelled} requests cancelled at once)`);
  out.push(`  aborted at: ${kv(q.aborted_at)}`);
  out.push(`  killed at:  ${kv(q.killed_at)}`);
  out.push(`  failed by code: ${kv(q.failed_by_code)}`);
  out.push(`  router dispatched again after a worker failure: retried ${kv(q.retried_by_code ?? {})}; migrated mid-answer ${kv(q.migrated_by_code ?? {})}`);
  if (r.warmup) out.push(`  warm-up before the clock (workers on a GPU): ${r.warmup.ok}/${r.warmup.requests} ok after ${r.warmup.rounds} round(s), ${(r.warmup.ms / 1000).toFixed(1)} s (not counted above)`);
  out.push(`  rounds completed ${r.rounds.completed} (migrated mid-answer ${r.rounds.migrated}: ${r.rounds.migrated_verified} checked against the reference, ${r.rounds.migrated_equal} equal); conversations started ${r.rounds.conversations_started}, finished ${r.rounds.conversations_finished}, restarted after a kill ${r.rounds.restarted_after_kill}; prompt bytes p50 ${ms(r.prompt_bytes.p50)} max ${ms(r.prompt_bytes.max)}`);
  out.push('');
  const L = r.latency_ms;
  const lrow = (name: string, s: StormReport['latency_ms']['ttft']) => [name, String(s.n), ms(s.p50), ms(s.p90), ms(s.p99), ms(s.max)];
  out.push(table([['latency (ms)', 'n', 'p50', 'p90', 'p99', 'max'], lrow('TTFT', L.ttft), lrow('ITL', L.itl), lrow('E2E (ok)', L.e2e)]));
  out.push('');
  if (r.faults.length) {
    const rows = [['fault', 'at', 'target', 'down', 'first ok', 'worker ok']];
    for (const f of r.faults) {
      rows.push([f.kind.replace('_', ' '), `${f.at_s.toFixed(1)} s`, f.target, dur(f.down_ms), f.first_ok_ms === null ? 'never' : dur(f.first_ok_ms), f.worker_ok_ms === null ? 'never' : dur(f.worker_ok_ms)]);
      if (f.error) rows.push(['', '', `error: ${f.error}`, '', '', '']);
    }
    out.push(table(rows));
    out.push('  (first ok: fault → first request sent after it that completed; worker ok: fault → the faulted worker\'s first successful room)');
    out.push('');
  } else if (r.mode === 'self-hosted') {
    out.push('  no worker faults injected');
    out.push('');
  }
  const hand = Object.entries(r.kv_handoffs ?? {});
  if (hand.length) {
    out.push(`KV handoffs by path (since each worker's last start${r.warmup ? ', warm-up included' : ''}): ${hand.map(([w, p]) => `${w} ${kv(p)}`).join('; ')}`);
    out.push('');
  }
  out.push('checks');
  for (const ch of r.checks) out.push(`  ${ch.name.padEnd(13)} ${ch.status.toUpperCase().padEnd(7)} ${ch.summary}`);
  const fails = r.checks.filter((x) => x.status === 'fail');
  for (const ch of fails) {
    out.push('');
    out.push(`${ch.name} — details:`);
    for (const d of ch.details.slice(0, 20)) out.push(`  ${typeof d === 'string' ? d : JSON.stringify(d).slice(0, 600)}`);
    if (ch.details.length > 20) out.push(`  … ${ch.details.length - 20} more (see --json)`);
  }
  if (r.offending_rooms.length) {
    out.push('');
    out.push('offending rooms:');
    const seen = new Set<string>();
    for (const o of r.offending_rooms) {
      const key = `${o.check}/${o.worker}/${o.room.room}`;
      if (seen.has(key)) continue;
      seen.add(key);
      if (seen.size > 20) break;
      out.push(`  [${o.check}] ${describeRoom(o.worker, o.room)}`);
      out.push(formatTimeline(o.room));
    }
  }
  out.push('');
  if (r.log_dir) out.push(`logs: ${r.log_dir}`);
  out.push(`RESULT: ${r.ok ? 'PASS' : 'FAIL'} (${fails.length ? `failed: ${fails.map((x) => x.name).join(', ')}` : 'all checks passed'}; ${r.wall_s.toFixed(0)} s wall)`);
  out.push('');
  return out.join('\n');
}
