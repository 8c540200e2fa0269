/**
 * `pdserve doctor --request ID`: one request's whole timeline across processes.
 *
 * Joins the router's trace (GET /debug/traces/ID; ID = trace id or rid) with the room of the
 * same bootstrap_room on every worker (GET /debug/rooms: live and recent rooms with their
 * lifecycle timelines). Events are ordered by their wall-clock time (ms since epoch, each
 * process's own clock: exact on one host, off by the clock skew across hosts) and each phase's
 * duration is the time to the next event of the same process. A request with several attempts
 * (retried, migrated) lists every attempt's room in the header, and each `dispatched` /
 * `attempt_failed` row names its room, its pair and the failure's code and message.
 */
import type { Dispatcher } from 'undici';
import { fetchText, type DebugRooms, type RoomInfo } from '../observe/gather.js';
import { systemClock } from '../base/clock.js';
import { fmtMs } from '../observe/diagnose.js';
import type { RequestTrace } from '../protocol/trace.js';

export interface TimelineRow {
  at: number;
  process: string;
  event: string;
  state: string | null;
  phase: string | null;
}

export interface PhaseTime {
  process: string;
  phase: string;
  ms: number;
  /** Still in this phase when gathered. */
  ongoing: boolean;
}

export interface RequestReport {
  id: string;
  found: boolean;
  trace: RequestTrace | null;
  rooms: { role: string; url: string; room: RoomInfo; live: boolean }[];
  rows: TimelineRow[];
  phases: PhaseTime[];
  /** Problems met while gathering (unreachable worker, unknown id). */
  notes: string[];
}

/** Gather and join the timeline of request `id` (trace id, rid or room id). Never throws. */
export async function requestReport(routerUrl: string, id: string, timeoutMs = 3000, dispatcher?: Dispatcher): Promise<RequestReport> {
  const base = routerUrl.replace(/\/+$/, '');
  const notes: string[] = [];
  const [tr, workers] = await Promise.all([
    fetchText<RequestTrace>(`${base}/debug/traces/${encodeURIComponent(id)}`, timeoutMs, (t) => JSON.parse(t) as RequestTrace, dispatcher),
    fetchText<{ workers: { role: string; url: string }[] }>(`${base}/workers`, timeoutMs, (t) => JSON.parse(t) as never, dispatcher),
  ]);
  const trace = tr.ok ? tr.body : null;
  if (!trace) notes.push(tr.status === 404 ? `the router has no trace for ${id} (it keeps the most recent requests only); searching the workers' rooms` : `router: GET /debug/traces: ${tr.error}`);
  if (!workers.ok) notes.push(`router: GET /workers: ${workers.error}`);
  // Every attempt of the request: its rooms, and the workers' rids `<rid>` / `<rid>-a<n>`.
  const ofTrace = (r: RoomInfo) => trace !== null && (r.room === trace.room || (trace.rooms ?? []).includes(r.room) || r.rid === trace.rid || (typeof r.rid === 'string' && r.rid.startsWith(`${trace.rid}-a`)));
  const matches = (r: RoomInfo) => r.room === id || r.rid === id || r.trace === id || ofTrace(r);
  const rooms: RequestReport['rooms'] = [];
  let clock: number = systemClock.wallMs();
  await Promise.all(
    (workers.body?.workers ?? []).map(async (w) => {
      const d = await fetchText<DebugRooms>(`${w.url}/debug/rooms`, timeoutMs, (t) => JSON.parse(t) as DebugRooms, dispatcher);
      if (!d.ok || !d.body) {
        // a refusal's body parses too (an error object): without this its rooms just went missing
        const unsigned = d.status === 401 || d.status === 403 ? ': its rooms take only requests signed with the cluster secret (PDSERVE_CLUSTER_SECRET_FILE=<file holding the cluster secret>)' : '';
        notes.push(`${w.role} ${w.url}: GET /debug/rooms: ${d.error}${unsigned}`);
        return;
      }
      clock = d.body.now;
      for (const r of d.body.live ?? []) if (matches(r)) rooms.push({ role: w.role, url: w.url, room: r, live: true });
      for (const r of d.body.recent ?? []) if (matches(r)) rooms.push({ role: w.role, url: w.url, room: r, live: false });
    }),
  );
  const rows: TimelineRow[] = [];
  const phases: PhaseTime[] = [];
  // One attempt: its room and pair are the header's. Several (retried, migrated): each event names its own.
  const several = (trace?.rooms?.length ?? 0) > 1;
  for (const e of trace?.events ?? []) {
    const extra = Object.entries(e)
      .filter(([k]) => !['at', 'what', 'stream'].includes(k) && (several || (!['prefill', 'decode'].includes(k) && !(e.what === 'dispatched' && k === 'room'))))
      .map(([k, v]) => `${k}=${typeof v === 'object' ? JSON.stringify(v) : String(v)}`)
      .join(' ');
    rows.push({ at: e.at, process: 'router', event: extra ? `${e.what} ${extra}` : e.what, state: null, phase: null });
  }
  for (const x of rooms) {
    const proc = `${x.role} ${x.url.replace(/^https?:\/\//, '')}`;
    const tl = x.room.timeline ?? [];
    tl.forEach((e, i) => {
      rows.push({ at: e.at, process: proc, event: e.why, state: e.state, phase: e.phase });
      if (e.phase === 'done') return;
      const next = tl[i + 1];
      phases.push({ process: proc, phase: e.phase, ms: (next?.at ?? clock) - e.at, ongoing: !next && x.live });
    });
    if (x.room.fail_reason) rows.push({ at: tl[tl.length - 1]?.at ?? 0, process: proc, event: `fail_reason: ${x.room.fail_reason}`, state: null, phase: null });
  }
  rows.sort((a, b) => a.at - b.at);
  const found = trace !== null || rooms.length > 0;
  if (!found) notes.push(`no process knows ${id}: not a recent trace id, rid or room id`);
  return { id, found, trace, rooms, rows, phases, notes };
}

/** Human-readable rendering of a RequestReport. */
export function renderRequestReport(r: RequestReport): string {
  const out: string[] = [];
  const t = r.trace;
  out.push(t ? `request ${t.trace}  rid ${t.rid}  room ${t.room ?? '-'}  outcome ${t.outcome ?? 'in flight'}` : `request ${r.id}`);
  if (t) out.push(`  prefill ${t.prefill ?? '-'}  decode ${t.decode ?? '-'}`);
  if (t && (t.rooms?.length ?? 0) > 1) out.push(`  attempts ${t.rooms.length}: rooms ${t.rooms.join(' → ')}`);
  for (const n of r.notes) out.push(`  note: ${n}`);
  if (r.rows.length === 0) return out.join('\n');
  const t0 = r.rows[0]!.at;
  out.push('', '  time        process                     event');
  for (const row of r.rows) {
    const sp = row.state ? ` → ${row.state}/${row.phase}` : '';
    out.push(`  ${`+${fmtMs(row.at - t0)}`.padEnd(11)} ${row.process.padEnd(27)} ${row.event}${sp}`);
  }
  out.push('', '  time per phase:');
  const byProc = new Map<string, PhaseTime[]>();
  for (const p of r.phases) byProc.set(p.process, [...(byProc.get(p.process) ?? []), p]);
  for (const [proc, ps] of byProc) out.push(`    ${proc.padEnd(27)} ${ps.map((p) => `${p.phase} ${fmtMs(p.ms)}${p.ongoing ? ' (ongoing)' : ''}`).join(', ')}`);
  const fin = t?.events.find((e) => e.what === 'finished');
  if (fin) out.push(`    ${'router'.padEnd(27)} ttft ${fin.ttft_ms ?? '-'} ms, e2e ${fin.e2e_ms ?? '-'} ms, ${fin.completion_tokens ?? '?'} tokens`);
  return out.join('\n');
}
