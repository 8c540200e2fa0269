/**
 * The diagnosis of `pdserve doctor`: a pure function of a gathered `ClusterSnapshot` (and, in
 * --watch, the previous one) to findings, worst first, each with its likely cause and the next
 * command to run. No I/O here, so every rule is unit-tested on fabricated snapshots.
 *
 * Rules, in order of severity:
 *  - critical: router or worker unreachable; worker unhealthy at the router; the incident's
 *    signature (requests waiting while every engine is idle); a room past its deadline and still
 *    live (the watchdog is not failing it); a room stuck (≥ half its phase budget spent without
 *    moving on); an orphan room (live on one side, gone on its peer); settings that cannot work
 *    together (model fingerprints differ, bootstrap port differs from the router's, a
 *    `mismatch` reported by the router, a protocol major that differs from the router's or a
 *    peer's: `protocol_mismatch`).
 *  - warning: a slow room (≥ `slowMs` in one phase); a request in
 *    flight at the router for ≥ `slowMs` that no worker holds a room for; room failures other than
 *    client aborts in the last `windowMs`; illegal transitions; counters that moved since the
 *    previous round (--watch).
 *  - critical too: a worker whose state directory is full (`state_dir_full` in its /health
 *    `degraded` or the router's row); warning: another `degraded` condition.
 *  - info: model names differ, several builds (a rolling upgrade), draining workers, cumulative
 *    failure counters since start.
 *
 * "Every engine idle": every prefill has all slots free and every decode has no request
 * generating (`decode_running` 0). "Waiting": rooms live on a worker or requests in flight at the
 * router. The incident this project answers (SGLang's revived room) looked exactly like that: a
 * request waiting forever in prefill's inflight queue while both engines had nothing to do.
 */
import type { ClusterSnapshot, RoomInfo, WorkerProbe } from './gather.js';
import { sumOf } from './gather.js';
import { causeOf, isErrorCode } from '../base/errors.js';
import { peerProtocol, protocolMismatch } from '../base/version.js';
import { offloadFinding, offloadSummary } from './gpu.js';
import type { Severity, Finding } from './finding.js';
export type { Severity, Finding };

export interface Diagnosis {
  /** 0: nothing wrong; 1: warnings; 2: something critical (also the CLI's exit code). */
  exitCode: 0 | 1 | 2;
  findings: Finding[];
  /** One-line counts per role, e.g. 'router ok · 1 prefill · 1 decode · 2 live rooms'. */
  summary: string;
}

export interface DiagnoseOptions {
  /** A room this long in one phase is slow (warning), ms. Default 2000. */
  slowMs?: number;
  /** Window for "failures in the last minutes", ms. Default 300_000. */
  windowMs?: number;
  /** The previous round's snapshot (--watch): counters that moved since are reported. */
  previous?: ClusterSnapshot | null;
  /** Router URL to put into suggested commands. */
  routerUrl?: string;
  /** What a suggested `pdserve doctor` command carries to reach this cluster: environment assignments (keys by placeholder) and flags (TLS files). */
  doctor?: { env: string[]; flags: string[] };
}

const SEVERITY_RANK: Record<Severity, number> = { critical: 0, warning: 1, info: 2 };

/** ms → '1.2 s' / '850 ms' / '3m10s'. */
export function fmtMs(ms: number): string {
  const a = Math.abs(ms);
  const s = a < 1000 ? `${Math.round(a)} ms` : a < 60_000 ? `${(a / 1000).toFixed(1)} s` : `${Math.floor(a / 60_000)}m${Math.round((a % 60_000) / 1000)}s`;
  return ms < 0 ? `-${s}` : s;
}

/** A room of one worker, with derived times. */
interface RoomAt {
  w: WorkerProbe;
  r: RoomInfo;
  /** ms in the current phase (worker clock). */
  inPhase: number;
  /** ms the phase allows in total (inPhase + remaining); null when unknown. */
  budget: number | null;
}

function roomsOf(w: WorkerProbe): RoomAt[] {
  const d = w.rooms.body;
  if (!d || !Array.isArray(d.live)) return [];
  return d.live.map((r) => {
    const last = r.timeline?.[r.timeline.length - 1];
    const inPhase = last ? Math.max(0, d.now - last.at) : r.age_ms;
    const budget = r.deadline_ms === null ? null : inPhase + Math.max(0, r.deadline_ms);
    return { w, r, inPhase, budget };
  });
}

/**
 * The side of a room that has to act for it to move on (the other side waits for it): decode
 * while it waits for a slot or loads the state, or while prefill waits for its registration;
 * prefill otherwise (queued, evaluating, sending, awaiting the ack).
 */
function actorOf(sides: RoomAt[]): RoomAt {
  const p = sides.find((x) => x.w.ref.role === 'prefill');
  const d = sides.find((x) => x.w.ref.role === 'decode');
  if (!p || !d) return sides.reduce((a, b) => (b.inPhase > a.inPhase ? b : a));
  if (d.r.phase === 'prealloc' || d.r.step === 'loading' || p.r.phase === 'bootstrap') return d;
  return p;
}

/** Likely cause of a room not moving on, by role, phase and step. */
function roomCause(role: string, phase: string, step: string | null | undefined, r?: RoomInfo): string {
  if (role === 'prefill' && phase === 'inflight' && step === 'sending' && r && r.total_bytes !== null && r.bytes >= r.total_bytes) {
    return 'every KV byte was sent but KV_END was not: the sender is paused between the last chunk and KV_END (a test hold, or a stall in the send loop); decode waits for KV_END, both engines idle';
  }
  if (role === 'prefill') {
    if (phase === 'bootstrap') return 'decode has not registered the room: decode cannot reach the bootstrap port, or has no free slot (its prealloc queue)';
    if (phase === 'waiting') return step === 'computing' ? 'prompt evaluation is slow or hung in the engine' : 'queued for a prefill slot: every prefill slot is busy';
    if (phase === 'inflight') {
      if (step === 'sending') return 'the KV send is not progressing (socket backpressure, decode not reading) or is held; the room waits in the inflight queue';
      if (step === 'awaiting_ack') return "decode has not acknowledged the KV (KV_ACK): decode's load is slow, or decode lost the room without telling prefill";
      return 'the room is in the inflight queue and not progressing';
    }
  } else {
    if (phase === 'prealloc') return 'no free decode slot: every decode slot is busy (prealloc queue)';
    if (phase === 'bootstrap') return 'prefill has not confirmed the registration: prefill unreachable on its bootstrap port, or the router request never reached prefill';
    if (phase === 'waiting') return "prefill has not started sending the KV: the room is queued or evaluating on prefill (see prefill's room)";
    if (phase === 'transfer') return step === 'loading' ? 'loading the received state into the engine is slow' : 'KV bytes are not arriving: prefill stalled mid-send or the connection is wedged';
    if (phase === 'local') return 'decode-local continuation: decode is evaluating the uncached prompt suffix itself (no prefill involved); the engine is slow or busy';
  }
  return 'the room is not moving on';
}

function roomLine(x: RoomAt): string {
  const r = x.r;
  const dl = r.deadline_ms === null ? 'no deadline' : r.deadline_ms < 0 ? `deadline passed ${fmtMs(-r.deadline_ms)} ago` : `deadline in ${fmtMs(r.deadline_ms)}`;
  const bytes = r.total_bytes ? `, ${r.bytes}/${r.total_bytes} bytes` : '';
  return `${x.w.ref.role} ${x.w.ref.url}: ${r.state}/${r.phase}${r.step ? ` (step ${r.step})` : ''}, ${fmtMs(x.inPhase)} in phase, ${dl}, age ${fmtMs(r.age_ms)}, peer ${r.peer ?? 'none'}${bytes}`;
}

function timelineLine(x: RoomAt): string {
  const tl = x.r.timeline ?? [];
  const t0 = tl[0]?.at ?? 0;
  return `  ${x.w.ref.role} timeline: ${tl.slice(-5).map((e) => `+${e.at - t0}ms ${e.why}→${e.state}/${e.phase}`).join(', ')}`;
}

const idOf = (r: RoomInfo) => r.trace || r.rid;

/**
 * The "fail it now" command of a request: the router's POST /abort_request by the rid (an
 * attempt's worker rid works too), with the admin key. The request ends with 499
 * request_aborted on every leg and is never migrated (a worker's own /abort_request would read
 * to the router as that worker's failure).
 */
export function abortCmd(routerUrl: string, rid: string): string {
  return `curl -sS -X POST -H 'content-type: application/json' -H "authorization: Bearer $PDSERVE_ADMIN_API_KEY" -d '${JSON.stringify({ rid })}' ${routerUrl}/abort_request   # fail it now`;
}

/**
 * The likelier cause of a probe that failed in TLS, which "down" would misname: a certificate
 * doctor does not trust (`--ca` for the router's HTTPS, `--internal-tls-ca` for the workers'), or
 * a worker on mutual TLS that cut a doctor without a client certificate it accepts.
 * @param url the probed base URL; @param error the probe's error code or message (null: none).
 * @returns the cause, or undefined when the error is not a TLS one.
 */
export function tlsCause(url: string, error: string | null | undefined, who: 'router' | 'worker'): string | undefined {
  const e = error ?? '';
  const caFlag = who === 'router' ? '--ca FILE' : '--internal-tls-ca FILE';
  if (/ALTNAME|Hostname\/IP does not match/i.test(e)) return `the ${who}'s TLS certificate does not name ${hostOf(url)}, the host doctor dialed: reissue it with that name in its subjectAltName, or reach the ${who} by a name the certificate has`;
  if (/CERT_HAS_EXPIRED|CERT_NOT_YET_VALID/i.test(e)) return `the ${who}'s TLS certificate is expired or not yet valid: renew it (or check this host's clock)`;
  if (/CERT|SELF_SIGNED|UNABLE_TO_VERIFY|UNABLE_TO_GET_ISSUER|unable to verify/i.test(e)) return `doctor does not trust the ${who}'s TLS certificate: give the CA that signed it (${caFlag})`;
  if (who === 'worker' && url.startsWith('https:') && /UND_ERR_SOCKET|ECONNRESET|EPROTO|SSL|TLS|other side closed/i.test(e)) return 'the TLS handshake failed: a worker on mutual TLS refuses a client without a certificate its CA signed (--internal-tls-cert FILE --internal-tls-key FILE --internal-tls-ca FILE, the cluster\'s), or the worker process is gone';
  return undefined;
}

/** The host[:port] of a URL, as given (the URL itself when it does not parse). */
function hostOf(url: string): string {
  try {
    return new URL(url).host;
  } catch {
    return url;
  }
}

/** The diagnosis of one snapshot (see the module doc). */
/** A router's shared-state record or view older than this is stale, ms (it writes every second). */
export const STALE_ROUTER_MS = 3000;

export function diagnose(snap: ClusterSnapshot, o: DiagnoseOptions = {}): Diagnosis {
  const slowMs = o.slowMs ?? 2000;
  const windowMs = o.windowMs ?? 300_000;
  const routerUrl = o.routerUrl ?? snap.router?.url ?? 'ROUTER';
  const f: Finding[] = [];
  const add = (x: Omit<Finding, 'weight'> & { weight?: number }) => f.push({ weight: 0, ...x });
  // a suggested doctor command: this run's credentials (an assignment in `env` replaces this run's of the same variable; X and X_FILE are one)
  const doctorCmd = (env: string[], tail: string[]) => {
    const name = (e: string) => e.split('=')[0]!.replace(/_FILE$/, '');
    const named = new Set(env.map(name));
    return [...env, ...(o.doctor?.env ?? []).filter((e) => !named.has(name(e))), 'pdserve doctor --url', routerUrl, ...(o.doctor?.flags ?? []), ...tail].join(' ');
  };
  const doctorReq = (id: string) => doctorCmd([], ['--request', id]);

  // ---- reachability ---------------------------------------------------------------------------
  const router = snap.router;
  if (router && !router.workers.ok && router.workers.status === 401) {
    add({
      severity: 'critical',
      kind: 'router_refused_key',
      title: `router ${router.url} refuses doctor's GET /workers: its admin key is missing or wrong (HTTP 401)`,
      details: [`GET /health: ${router.health.ok ? 'ok' : router.health.error}`],
      cause: 'the router has admin keys (or API keys) and doctor sent none of them: PDSERVE_ADMIN_API_KEY (or --admin-api-key) is unset or holds another key',
      next: [doctorCmd(['PDSERVE_ADMIN_API_KEY=<one of the router\'s admin keys>'], [])],
      weight: 1e12,
    });
  } else if (router && !router.workers.ok) {
    add({
      severity: 'critical',
      kind: 'router_unreachable',
      title: `router ${router.url} does not answer GET /workers (${router.workers.error})`,
      details: [`GET /health: ${router.health.ok ? 'ok' : router.health.error}`],
      cause: tlsCause(router.url, router.workers.error, 'router') ?? 'the router process is down, not listening on that address, or its event loop is blocked',
      next: [`curl -sS -m 3 ${router.url}/health`, 'check the router process (ps, its log) and the address/port'],
      weight: 1e12,
    });
  }
  // Several routers: one whose shared-state record or view is old is stale (hung, starved, or cut off from etcd or the workers).
  for (const r of snap.routers ?? []) {
    const why = r.ageMs > STALE_ROUTER_MS ? `it last wrote its state ${Math.round(r.ageMs)} ms ago (every second while alive)` : r.view.load_age_ms !== null && r.view.load_age_ms > STALE_ROUTER_MS ? `its load readings of the workers are ${r.view.load_age_ms} ms old` : snap.listed !== undefined && r.view.workers < snap.listed ? `it knows ${r.view.workers} of the ${snap.listed} workers etcd lists` : null;
    if (!why) continue;
    add({ severity: 'warning', kind: 'router_stale', title: `router ${r.url} has a stale view: ${why}`, details: [`workers ${r.view.workers}, healthy ${r.view.healthy}, load readings ${r.view.load_age_ms ?? '—'} ms old`], cause: 'the router process is hung or starved, or cannot reach etcd or the workers: its routing decisions use old state', next: [`curl -sS -m 3 ${r.url}/health`, `curl -sS -m 3 ${r.url}/workers`, 'check its log; restart it (its clients retry through the other routers)'], weight: 1e10, data: { url: r.url } });
  }
  if (router?.health.body?.status === 'draining') {
    add({ severity: 'warning', kind: 'draining', title: `router ${router.url} is draining: it refuses new requests`, details: [], cause: 'a graceful shutdown (SIGTERM) is under way', next: [`curl -sS ${router.url}/health`] });
  } else if (router?.health.body && router.health.status === 503) {
    add({ severity: 'critical', kind: 'router_unavailable', title: `router ${router.url} answers 503: no healthy prefill or decode worker`, details: [`prefill ${JSON.stringify(router.health.body.prefill ?? null)}, decode ${JSON.stringify(router.health.body.decode ?? null)}`], cause: 'every worker of a role is down, unhealthy, draining or mismatched; the findings below name them', next: [`curl -sS ${router.url}/workers`], weight: 1e12 });
  }
  // A worker that answers /health but refuses /debug/rooms unsigned: doctor runs without the
  // cluster secret (`pdserve up` generates one), so every room finding below would be blind there.
  const unsigned = snap.workers.filter((w) => w.health.ok && w.rooms.status === 401);
  if (unsigned.length > 0) {
    add({
      severity: 'warning',
      kind: 'rooms_unreadable',
      title: `cannot read the rooms of ${unsigned.length} worker(s): their /debug/rooms takes only requests signed with the cluster secret`,
      details: unsigned.map((w) => `${w.ref.role} ${w.ref.url}`),
      cause: 'doctor runs without the cluster secret (PDSERVE_CLUSTER_SECRET) or with another one, so stuck and slow rooms on these workers cannot be seen',
      next: [doctorCmd(['PDSERVE_CLUSTER_SECRET_FILE=<file holding the cluster secret>'], [])],
      weight: 1e9,
    });
  }
  const drainingOf = (w: WorkerProbe) => w.ref.router?.draining === true || w.health.body?.status === 'draining' || w.health.body?.draining === true || w.health.body?.state === 'draining';
  for (const w of snap.workers) {
    const rr = w.ref.router ?? {};
    if (typeof rr.frozen === 'string' && rr.healthy !== true) {
      add({
        severity: 'critical',
        kind: 'worker_frozen',
        title: `${w.ref.role} ${w.ref.url} is frozen: ${rr.frozen}`,
        details: [`router's view: healthy=${String(rr.healthy)}, last_error=${String(rr.last_error ?? 'none')}`, `worker's own /health: ${w.health.ok ? `HTTP ${w.health.status}` : String(w.health.error)}`],
        cause: "the worker stopped answering in the middle of a request's stream: the process is stopped (SIGSTOP, a debugger), starved or swapped out, or its event loop is blocked; the router migrated its requests and sends it no new ones until a probe finds it healthy",
        next: [`ps -o pid,stat,wchan,cmd -p <the ${w.ref.role}'s pid>   # T = stopped (kill -CONT resumes it), D = waiting on I/O`, `curl -sS -m 3 ${w.ref.url}/health`, `check the ${w.ref.role} process and its log; restart it if it does not recover`],
        weight: 2e11,
        data: { url: w.ref.url, role: w.ref.role, frozen: rr.frozen },
      });
    } else if (!w.health.ok && !(w.health.status === 503 && w.health.body)) {
      add({
        severity: 'critical',
        kind: 'worker_unreachable',
        title: `${w.ref.role} ${w.ref.url} is unreachable (${w.health.error})`,
        details: [`router's view: healthy=${String(rr.healthy)}, last_error=${String(rr.last_error ?? 'none')}`],
        cause: tlsCause(w.ref.url, w.health.error, 'worker') ?? 'the worker process died, is not listening, or its event loop is blocked (a long synchronous call)',
        next: [`curl -sS -m 3 ${w.ref.url}/health`, `check the ${w.ref.role} process and its log`],
        weight: 1e11,
        data: { url: w.ref.url, role: w.ref.role },
      });
    } else if (rr.healthy === false && !drainingOf(w)) {
      add({
        severity: 'critical',
        kind: 'worker_unhealthy',
        title: `router skips ${w.ref.role} ${w.ref.url}: ${String(rr.last_error ?? rr.reason ?? 'unhealthy')}`,
        details: [`consecutive failed probes: ${String(rr.consecutive_failures ?? '?')}`, `worker's own /health: HTTP ${w.health.status}`],
        cause: 'the router cannot probe the worker (network path, timeouts) or the worker reports a problem (wrong role, settings mismatch, draining)',
        next: [`curl -sS ${routerUrl}/workers`, `curl -sS ${w.ref.url}/health`],
        weight: 1e10,
        data: { url: w.ref.url, role: w.ref.role },
      });
    }
  }

  // ---- rooms: overdue, stuck, slow, orphans ---------------------------------------------------
  const all = snap.workers.flatMap(roomsOf);
  const byRoom = new Map<string, RoomAt[]>();
  for (const x of all) byRoom.set(x.r.room, [...(byRoom.get(x.r.room) ?? []), x]);
  const recentById = new Map<string, { w: WorkerProbe; r: RoomInfo }>();
  for (const w of snap.workers) for (const r of w.rooms.body?.recent ?? []) recentById.set(`${w.ref.role}:${r.room}`, { w, r });
  for (const [room, sides] of byRoom) {
    const worst = actorOf(sides);
    const frac = worst.budget ? worst.inPhase / worst.budget : 0;
    const overdue = sides.find((x) => x.r.deadline_ms !== null && x.r.deadline_ms < -1000);
    const stuck = frac >= 0.5 && worst.inPhase >= slowMs;
    const slow = worst.inPhase >= slowMs;
    // Orphan: live on one role, terminal (or absent while the other role exists) on the other.
    const roles = new Set(sides.map((x) => x.w.ref.role));
    const otherRole = roles.has('prefill') ? 'decode' : 'prefill';
    const otherGone = roles.size === 1 && snap.workers.some((w) => w.ref.role === otherRole && w.rooms.ok);
    const otherTerminal = otherGone ? [...recentById.values()].find((v) => v.w.ref.role === otherRole && v.r.room === room) : undefined;
    // A decode-local room (decode alone, no prefill peer: phase local, or prealloc without a peer) has no other side.
    const localRoom = worst.r.role === 'decode' && (worst.r.phase === 'local' || worst.r.peer === null);
    const orphan = otherGone && worst.inPhase >= 1000 && !(worst.r.role === 'decode' && worst.r.phase === 'prealloc') && !localRoom;
    if (!overdue && !stuck && !slow && !orphan) continue;
    const severity: Severity = overdue || stuck || orphan ? 'critical' : 'warning';
    const kind = overdue ? 'overdue_room' : orphan ? 'orphan_room' : stuck ? 'stuck_room' : 'slow_room';
    const what = overdue ? 'past its deadline and still live' : orphan ? `live on ${worst.w.ref.role} but ${otherTerminal ? `${otherTerminal.r.state} on ${otherRole} (${otherTerminal.r.fail_reason ?? 'no reason'})` : `unknown to every ${otherRole}`}` : stuck ? 'stuck' : 'slow';
    const details = sides.map(roomLine);
    for (const x of sides) details.push(timelineLine(x));
    details.push(`rid ${worst.r.rid}${worst.r.trace ? `, trace ${worst.r.trace}` : ''}`);
    const cause = overdue
      ? "the watchdog is not failing the room: the worker's event loop is blocked or its watchdog stopped; this is the wedge the lifecycle core exists to prevent"
      : orphan
        ? `the ${otherRole} side ended the room and ${worst.w.ref.role} was not told (a lost fail message or a lost peer); the deadline will fail it in ${fmtMs(Math.max(0, worst.r.deadline_ms ?? 0))}`
        : roomCause(worst.r.role, worst.r.phase, worst.r.step, worst.r);
    add({
      severity,
      kind,
      title: `room ${room} ${what}: ${worst.r.state}/${worst.r.phase}${worst.r.step ? ` step ${worst.r.step}` : ''} on ${worst.w.ref.role} for ${fmtMs(worst.inPhase)}${worst.budget ? ` of its ${fmtMs(worst.budget)} budget` : ''}`,
      details,
      cause,
      next: [doctorReq(idOf(worst.r)), `curl -sS ${routerUrl}/debug/rooms   # every worker's rooms`, abortCmd(routerUrl, worst.r.rid)],
      weight: worst.inPhase,
      data: { room, rid: worst.r.rid, trace: worst.r.trace ?? null, state: worst.r.state, phase: worst.r.phase, step: worst.r.step ?? null, role: worst.w.ref.role, worker: worst.w.ref.url, in_phase_ms: worst.inPhase, age_ms: worst.r.age_ms, deadline_ms: worst.r.deadline_ms, peer: worst.r.peer },
    });
  }

  // ---- requests in flight at the router that no worker holds a room for ----------------------
  const liveIds = new Set(all.flatMap((x) => [x.r.rid, x.r.room]));
  for (const w of snap.workers) for (const d of w.rooms.body?.decoding ?? []) liveIds.add(d.rid);
  const activeTraces = (router?.traces.body?.traces ?? []).filter((t) => t.outcome === null);
  for (const t of activeTraces) {
    const age = snap.at - (t.events[0]?.at ?? snap.at);
    if (age < slowMs || liveIds.has(t.rid) || (t.room && liveIds.has(t.room))) continue;
    add({
      severity: 'warning',
      kind: 'lost_request',
      title: `request ${t.trace} (rid ${t.rid}) in flight at the router for ${fmtMs(age)} with no room on any worker`,
      details: [`last router event: ${t.events[t.events.length - 1]?.what ?? 'received'}`, `prefill ${t.prefill ?? '-'}, decode ${t.decode ?? '-'}, room ${t.room ?? '-'}`],
      cause: 'the router waits for a worker answer that will not come (a stream left open after its room ended), or the request is held before dispatch',
      next: [doctorReq(t.trace), `curl -sS ${routerUrl}/debug/traces/${t.trace}`],
      weight: age,
      data: { trace: t.trace, rid: t.rid, age_ms: age },
    });
  }

  // ---- the incident's signature -----------------------------------------------------------------
  const prefills = snap.workers.filter((w) => w.ref.role === 'prefill' && w.health.body);
  const decodes = snap.workers.filter((w) => w.ref.role === 'decode' && w.health.body);
  const num = (w: WorkerProbe, k: string) => Number(w.health.body?.[k] ?? NaN);
  const idle = prefills.length + decodes.length > 0 && prefills.every((w) => num(w, 'slots_free') === num(w, 'slots')) && decodes.every((w) => num(w, 'decode_running') === 0);
  const routerInflight = Number(router?.health.body?.inflight ?? 0);
  const oldest = all.reduce<RoomAt | null>((a, b) => (!a || b.inPhase > a.inPhase ? b : a), null);
  const oldestActive = activeTraces.reduce((m, t) => Math.max(m, snap.at - (t.events[0]?.at ?? snap.at)), 0);
  if (idle && (all.length > 0 || routerInflight > 0) && Math.max(oldest?.inPhase ?? 0, oldestActive) >= slowMs) {
    const queues: string[] = [];
    for (const w of [...prefills, ...decodes]) {
      const q = Object.entries(w.health.body ?? {}).filter(([k, v]) => /_queue$/.test(k) && Number(v) > 0);
      if (q.length) queues.push(`${w.ref.role} ${w.ref.url}: ${q.map(([k, v]) => `${k}=${v}`).join(' ')}`);
    }
    add({
      severity: 'critical',
      kind: 'incident_signature',
      title: `requests are waiting while every engine is idle: ${all.length} live room(s), ${routerInflight} request(s) in flight at the router, no prefill computing, no decode generating`,
      details: [...queues, oldest ? `longest wait: room ${oldest.r.room} ${oldest.r.state}/${oldest.r.phase}${oldest.r.step ? ` step ${oldest.r.step}` : ''} on ${oldest.w.ref.role} for ${fmtMs(oldest.inPhase)}` : `oldest request in flight: ${fmtMs(oldestActive)}`],
      cause: 'a room is waiting for an event that will not come (a lost KV_ACK/fail message, a stalled send, a held request): nothing is computing, so it is not load. The room findings name it',
      next: oldest ? [doctorReq(idOf(oldest.r)), `curl -sS ${routerUrl}/debug/rooms   # every worker's rooms`] : [`curl -sS ${routerUrl}/debug/traces?active=1`],
      weight: 1e9,
      data: oldest ? { room: oldest.r.room, rid: oldest.r.rid, trace: oldest.r.trace ?? null, state: oldest.r.state, phase: oldest.r.phase, step: oldest.r.step ?? null, role: oldest.w.ref.role, in_phase_ms: oldest.inPhase, age_ms: oldest.r.age_ms } : { router_inflight: routerInflight },
    });
  }

  // ---- settings ---------------------------------------------------------------------------------
  const fps = new Map<string, string[]>();
  const models = new Map<string, string[]>();
  for (const w of [...prefills, ...decodes]) {
    const fp = w.health.body?.fingerprint;
    if (typeof fp === 'string') fps.set(fp, [...(fps.get(fp) ?? []), `${w.ref.role} ${w.ref.url}`]);
    const m = w.health.body?.model;
    if (typeof m === 'string') models.set(m, [...(models.get(m) ?? []), `${w.ref.role} ${w.ref.url}`]);
    const rr = w.ref.router ?? {};
    if (w.ref.role === 'prefill' && typeof rr.bootstrap_port === 'number' && typeof w.health.body?.bootstrap_port === 'number' && rr.bootstrap_port !== w.health.body.bootstrap_port) {
      add({
        severity: 'critical',
        kind: 'mismatch',
        title: `prefill ${w.ref.url} listens for KV on port ${w.health.body.bootstrap_port} but the router sends decode to port ${rr.bootstrap_port}`,
        details: [],
        cause: "the router's --prefill URL,PORT does not match the prefill's --bootstrap-port: every room will fail in bootstrap",
        next: [`curl -sS ${w.ref.url}/health`, 'restart the router with --prefill URL,<the bootstrap_port above>'],
        weight: 1e8,
      });
    }
    // a protocol mismatch is versionFindings' (its own kind, cause and next steps)
    const why = [rr.mismatch, rr.reason, rr.state, rr.last_error].filter((x): x is string => typeof x === 'string' && /mismatch/i.test(x) && !/\bprotocol \S+ ≠/.test(x));
    if (why.length) {
      add({ severity: 'critical', kind: 'mismatch', title: `router reports a settings mismatch for ${w.ref.role} ${w.ref.url}: ${why[0]}`, details: [], cause: 'the worker runs with settings the rest of the cluster cannot work with (model, context size, secret)', next: [`curl -sS ${routerUrl}/workers`, `curl -sS ${w.ref.url}/health`], weight: 1e8 });
    }
    if (rr.membership === 'etcd_only' || rr.membership === 'router_only') {
      const etcdOnly = rr.membership === 'etcd_only';
      add({
        severity: 'warning',
        kind: 'membership',
        title: etcdOnly ? `${w.ref.role} ${w.ref.url} is registered in etcd but the router does not know it` : `the router routes to ${w.ref.role} ${w.ref.url}, which is not registered in etcd`,
        details: [],
        cause: etcdOnly ? "the router's etcd watch is behind or disconnected, or the router was started without --discovery" : 'the worker was given by a router flag, or its lease expired (the process hung or lost etcd) while the router still has it',
        next: [`curl -sS ${routerUrl}/workers`, `curl -sS ${w.ref.url}/health`],
        weight: 1e7,
      });
    }
    if (drainingOf(w)) {
      add({ severity: 'info', kind: 'draining', title: `${w.ref.role} ${w.ref.url} is draining`, details: [], cause: 'a graceful shutdown is under way: it takes no new requests', next: [`curl -sS ${w.ref.url}/health`] });
    }
    const degraded = [...(Array.isArray(w.health.body?.degraded) ? (w.health.body.degraded as unknown[]) : []), rr.degraded].filter((x): x is string => typeof x === 'string' && x.length > 0);
    const full = degraded.find((x) => x.startsWith('state_dir_full'));
    if (full) {
      add({
        severity: 'critical',
        kind: 'state_dir_full',
        title: `${w.ref.role} ${w.ref.url}: its state directory is full (${full.replace(/^state_dir_full: /, '')})`,
        details: [],
        cause: 'the tmpfs holding sequence states (--state-dir, /dev/shm by default) has no room for one: other files there, a tmpfs sized below the states, or --prefix-store-bytes sharing it; the worker takes no new requests until space frees up',
        next: [`curl -sS ${w.ref.url}/health`, 'df -h <its --state-dir>; du -sh <its --state-dir>/* | sort -h | tail', 'free space there or restart the worker with a larger --state-dir (mount -o remount,size=… for a tmpfs)'],
        weight: 1e9,
        data: { url: w.ref.url, role: w.ref.role },
      });
    } else if (degraded.length) {
      add({ severity: 'warning', kind: 'degraded', title: `${w.ref.role} ${w.ref.url} is degraded: ${degraded[0]}`, details: degraded.slice(1), cause: 'the worker is alive but reports a condition that keeps new requests away', next: [`curl -sS ${w.ref.url}/health`] });
    }
  }
  versionFindings(snap, routerUrl, add);
  if (fps.size > 1) {
    add({
      severity: 'critical',
      kind: 'mismatch',
      title: `workers run different model builds (${fps.size} engine fingerprints): decode will refuse prefill's KV state`,
      details: [...fps.entries()].map(([fp, ws]) => `${fp.slice(0, 16)}…: ${ws.join(', ')}`),
      cause: 'prefill and decode were started with different model files or engine settings (context size, batch size, --deterministic)',
      next: ['curl -sS WORKER/health | jq .fingerprint   # on each worker', 'restart the odd ones with the same --model and engine flags'],
      weight: 1e8,
    });
  } else if (models.size > 1) {
    add({ severity: 'info', kind: 'model_names', title: `workers report ${models.size} model names`, details: [...models.entries()].map(([m, ws]) => `${m}: ${ws.join(', ')}`), cause: 'same weights under different names, or a mixed deployment', next: [`curl -sS ${routerUrl}/v1/models`] });
  }

  // ---- failures in the last minutes and counters ---------------------------------------------
  const failures = new Map<string, { n: number; last: number; example: string }>();
  for (const w of snap.workers) {
    const d = w.rooms.body;
    if (!d) continue;
    for (const r of d.recent ?? []) {
      if (r.state !== 'Failed') continue;
      const end = r.timeline?.[r.timeline.length - 1]?.at ?? 0;
      if (d.now - end > windowMs) continue;
      const reason = failureLabel(w.ref.role, r.fail_reason);
      const key = `${w.ref.role}|${reason}`;
      const cur = failures.get(key) ?? { n: 0, last: 0, example: '' };
      cur.n++;
      if (end >= cur.last) {
        cur.last = end;
        cur.example = `room ${r.room} (rid ${r.rid}${r.trace ? `, trace ${r.trace}` : ''}): ${r.fail_reason}`;
      }
      failures.set(key, cur);
    }
  }
  for (const [key, v] of failures) {
    const [role, reason] = key.split('|') as [string, string];
    const inner = reason.split('→').pop()!;
    const benign = benignFailure(inner);
    add({
      severity: benign ? 'info' : 'warning',
      kind: 'recent_failures',
      title: `${v.n} ${role} room(s) failed with '${reason}' in the last ${fmtMs(windowMs)}`,
      details: [`latest: ${v.example}`],
      cause: reason.includes('→') ? `the ${reason.split('→')[0]} side ended the room and told this one: ${FAILURE_CAUSES[inner] ?? 'see the fail reason'}` : (FAILURE_CAUSES[reason] ?? 'see the fail reason'),
      next: [doctorReq(/trace ([^)\s,]+)/.exec(v.example)?.[1] ?? /rid ([^),]+)/.exec(v.example)?.[1] ?? 'ID')],
      weight: v.n,
    });
  }
  const counters: [string, string, Record<string, string>, Severity][] = [
    ['pdserve_illegal_transitions_total', 'illegal room transitions refused', {}, 'warning'],
    ['pdserve_room_deadline_expired_total', 'room deadlines expired', {}, 'info'],
    ['pdserve_kv_transfer_failed_total', 'KV transfers failed', {}, 'info'],
    ['pdserve_bootstrap_failed_total', 'bootstraps failed', {}, 'info'],
    ['pdserve_kv_channel_events_total', 'KV peers lost', { event: 'peers_lost' }, 'info'],
    ['pdserve_kv_channel_events_total', 'KV channel auth failures', { event: 'auth_failures' }, 'warning'],
    ['pdserve_kv_channel_events_total', 'bad KV frames', { event: 'bad_frames' }, 'warning'],
  ];
  const prevOf = (url: string) => o.previous?.workers.find((p) => p.ref.url === url);
  for (const [name, label, where, sev] of counters) {
    const moved: string[] = [];
    const total: string[] = [];
    for (const w of snap.workers) {
      const v = sumOf(w.metrics.body, name, where);
      if (v > 0) total.push(`${w.ref.role} ${w.ref.url}: ${v}`);
      const p = prevOf(w.ref.url);
      if (p?.metrics.body) {
        const d = v - sumOf(p.metrics.body, name, where);
        if (d > 0) moved.push(`${w.ref.role} ${w.ref.url}: +${d}`);
      }
    }
    if (moved.length) {
      add({ severity: 'warning', kind: 'counter_moved', title: `${label}: moved since the previous round (${fmtMs(snap.at - o.previous!.at)} ago)`, details: moved, cause: COUNTER_CAUSES[label] ?? 'see the worker log', next: [`curl -sS ${routerUrl}/debug/rooms   # every worker's recent rooms and their fail reasons`], weight: moved.length });
    } else if (total.length) {
      add({ severity: sev, kind: 'counter_total', title: `${label} since start: ${total.join('; ')}`, details: [], cause: COUNTER_CAUSES[label] ?? 'see the worker log', next: [`${doctorCmd([], ['--watch'])}   # shows when it moves`] });
    }
  }
  const prevRouter = o.previous?.router?.metrics.body;
  if (router?.metrics.body && prevRouter) {
    for (const outcome of ['error', 'timeout']) {
      const d = sumOf(router.metrics.body, 'pdserve_router_requests_total', { outcome }) - sumOf(prevRouter, 'pdserve_router_requests_total', { outcome });
      if (d > 0) add({ severity: 'warning', kind: 'counter_moved', title: `router: ${d} request(s) ended with outcome '${outcome}' since the previous round`, details: [], cause: outcome === 'timeout' ? 'requests hit the router deadline: a stuck room or an overloaded cluster' : 'worker errors or refused requests', next: [`curl -sS ${routerUrl}/debug/traces`], weight: d });
    }
  }

  // streaming clients the router cut for reading too slowly (../runtime/send-queue.ts)
  if (router?.metrics.body) {
    const by = (['stalled', 'over_buffer'] as const).map((reason) => ({ reason, n: sumOf(router.metrics.body, 'pdserve_client_cut_total', { reason }), d: prevRouter ? sumOf(router.metrics.body, 'pdserve_client_cut_total', { reason }) - sumOf(prevRouter, 'pdserve_client_cut_total', { reason }) : 0 }));
    const total = by.reduce((a, x) => a + x.n, 0);
    const moved = by.reduce((a, x) => a + Math.max(0, x.d), 0);
    if (total > 0) {
      add({
        severity: moved > 0 ? 'warning' : 'info',
        kind: 'slow_clients',
        title: moved > 0 ? `router: ${moved} client(s) cut for reading too slowly since the previous round` : `router: ${total} client(s) cut for reading too slowly since start`,
        details: by.filter((x) => x.n > 0).map((x) => `${x.reason}: ${x.n}`),
        cause: 'clients that stopped reading their stream or a large response (stalled: nothing drained within --client-write-deadline-ms) or let too much queue up (over_buffer: --client-max-buffered-bytes); their requests were aborted, their slots freed',
        next: [`curl -sS ${routerUrl}/metrics | grep pdserve_client_cut_total`, 'a proxy in front buffering, or clients on slow links: raise the router flags; else the clients are the problem'],
        weight: moved || total,
      });
    }
  }

  const offload = offloadFinding(snap.workers);
  if (offload) add(offload);

  f.sort((a, b) => SEVERITY_RANK[a.severity] - SEVERITY_RANK[b.severity] || b.weight - a.weight);
  const exitCode = f.some((x) => x.severity === 'critical') ? 2 : f.some((x) => x.severity === 'warning') ? 1 : 0;
  const summary = [
    router ? `router ${router.health.ok ? 'ok' : router.health.status === 503 ? 'unavailable' : 'unreachable'}` : 'no router',
    `${snap.workers.filter((w) => w.ref.role === 'prefill').length} prefill`,
    `${snap.workers.filter((w) => w.ref.role === 'decode').length} decode`,
    `${all.length} live room(s)`,
    `${routerInflight} in flight`,
    offloadSummary(snap.workers),
    `gathered in ${snap.gatherMs} ms`,
  ].filter((x) => x !== null).join(' · ');
  return { exitCode, findings: f, summary };
}

/**
 * Reason label of a failed room: the part before the first ':' ('deadline', 'transfer', …); a
 * failure the peer reported ('prefill: abort: router' on decode) is 'prefill→abort'.
 */
export function failureLabel(role: string, reason: string | null): string {
  const parts = (reason ?? 'unknown').split(':').map((x) => x.trim());
  const peer = role === 'decode' ? 'prefill' : 'decode';
  if (parts[0] === peer && parts.length > 1) return `${peer}→${parts[1]}`;
  return parts[0]!;
}

/**
 * A room failure that is no fault of the cluster, so an info finding (exit 0), not a warning:
 * one the error table (../base/errors.ts) says the client caused (request_aborted,
 * client_closed_request, a 4xx), or a shutdown; the legacy labels 'abort' / 'shutdown' too.
 */
export function benignFailure(reason: string): boolean {
  return reason === 'abort' || reason === 'shutdown' || reason === 'shutting_down' || (isErrorCode(reason) && causeOf(reason) === 'client');
}

const ABORT_CAUSE = 'the client or router cancelled the request (normal under client timeouts)';

const FAILURE_CAUSES: Record<string, string> = {
  deadline: 'a phase ran out of time: a stuck peer, an overloaded engine, or timeouts too short for the load',
  peer_lost: 'the KV channel to the peer dropped (peer process died or heartbeats were missed: a blocked event loop)',
  transfer: 'the KV send failed (connection lost, stall) or the received state was invalid',
  bootstrap: "the decode and prefill could not agree on the room (no request for it on prefill, a duplicate, a refused registration)",
  prefill: 'prompt evaluation failed in the engine',
  decode: 'the decode worker failed the room (invalid state, load failure) and told prefill',
  abort: ABORT_CAUSE,
  request_aborted: ABORT_CAUSE,
  client_closed_request: ABORT_CAUSE,
  prefill_refused: "prefill refused the request (a 4xx such as context_length_exceeded, the client's answer too): the router told decode to drop its room",
  prefill_failed: "prefill failed the request (see prefill's own failures): the router told decode to drop its room",
  shutdown: 'a worker was shutting down',
};

const COUNTER_CAUSES: Record<string, string> = {
  'illegal room transitions refused': 'a driver sent an event the room lifecycle refused: a race between an abort and a late transfer event (the kind of write that revived rooms in the incident); refused, so harmless, but worth a bug report with the worker log',
  'room deadlines expired': 'rooms failed by the watchdog: see recent failures for which phase',
  'KV transfers failed': 'rooms failed after registration: see recent failures for the reasons',
  'bootstraps failed': 'rooms failed before registration: decode could not register or no request reached prefill',
  'KV peers lost': 'a KV channel peer stopped answering heartbeats or closed the connection',
  'KV channel auth failures': 'a peer with the wrong --cluster-secret tried to connect',
  'bad KV frames': 'corrupt or oversized frames on the KV channel: a version mismatch or a non-pdserve client',
};

/** A process's build id and protocol from its /health body (`build.id`, `protocol`; 1.0 when it reports none: an older build). */
function versionOf(body: Record<string, unknown> | null | undefined): { build: string; protocol: string } | undefined {
  if (!body) return undefined;
  const b = body.build as { id?: unknown } | undefined;
  return { build: typeof b?.id === 'string' ? b.id : 'an older build (no build id)', protocol: peerProtocol(body.protocol) };
}

/**
 * Builds and protocols across the cluster (../base/version.ts): a worker whose protocol major
 * differs from the router's (without the router's /health: from a worker of the other role) is critical (`protocol_mismatch`:
 * the router never picks it, the KV handshake refuses the pair); several builds of one protocol
 * are info (`builds`: a rolling upgrade under way).
 */
function versionFindings(snap: ClusterSnapshot, routerUrl: string, add: (f: Omit<Finding, 'weight'> & { weight?: number }) => void): void {
  const router = versionOf(snap.router?.health.body as Record<string, unknown> | undefined);
  const workers = snap.workers.map((w) => ({ w, v: versionOf(w.health.body as Record<string, unknown> | undefined) })).filter((x): x is { w: WorkerProbe; v: { build: string; protocol: string } } => x.v !== undefined);
  for (const { w, v } of workers) {
    const against = router ? { who: `the router (${router.build})`, v: router } : undefined;
    const other = workers.find((o) => o.w.ref.role !== w.ref.role && protocolMismatch(v.protocol, o.v.protocol));
    // the router's protocol is the reference (it picks the workers); without it, the other role's
    const why = against ? (protocolMismatch(v.protocol, against.v.protocol) ? { who: against.who, text: protocolMismatch(v.protocol, against.v.protocol)! } : undefined) : other ? { who: `${other.w.ref.role} ${other.w.ref.url} (${other.v.build})`, text: protocolMismatch(v.protocol, other.v.protocol)! } : undefined;
    if (!why) continue;
    add({
      severity: 'critical',
      kind: 'protocol_mismatch',
      title: `${w.ref.role} ${w.ref.url} (${v.build}) cannot work with ${why.who}: ${why.text}`,
      details: [],
      cause: 'a rolling upgrade mixed builds of different protocol majors: the router never sends work to the worker and the KV handshake refuses the pair',
      next: [`curl -sS ${routerUrl}/workers   # build, protocol and mismatch of each worker`, `curl -sS ${w.ref.url}/health`, 'upgrade (or roll back) the odd workers so that every process speaks one protocol major'],
      weight: 1e8,
      data: { url: w.ref.url, role: w.ref.role, build: v.build, protocol: v.protocol },
    });
  }
  const builds = new Map<string, string[]>();
  if (router) builds.set(router.build, ['router']);
  for (const { w, v } of workers) builds.set(v.build, [...(builds.get(v.build) ?? []), `${w.ref.role} ${w.ref.url}`]);
  if (builds.size > 1) {
    add({ severity: 'info', kind: 'builds', title: `the cluster runs ${builds.size} builds`, details: [...builds.entries()].map(([b, ws]) => `${b}: ${ws.join(', ')}`), cause: 'a rolling upgrade under way, or a process left on an old build: fine while the protocol majors agree', next: [`curl -sS ${routerUrl}/workers`] });
  }
}
