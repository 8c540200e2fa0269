/**
 * The doctor's pure parts on fabricated snapshots: diagnosis rules (stuck/slow/orphan/overdue
 * rooms, the incident's signature, lost and mismatched workers, recent failures, counters that
 * moved), trace id parsing, the trace store's bounds, the dashboard series, the Prometheus parser;
 * and one GET's deadline against a real socket that never finishes a TLS handshake.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { diagnose, tlsCause } from '../../src/observe/diagnose.js';
import { parsePrometheus, sumOf, type ClusterSnapshot, type Fetched, type RoomInfo, type WorkerProbe } from '../../src/observe/gather.js';
import { DashboardSeries, percentile } from '../../src/router/dashboard-series.js';
import { TraceStore, traceIdOf } from '../../src/router/trace.js';
import { doctorCredentials } from '../../src/doctor/cli.js';

const NOW = 1_800_000_000_000;
const ok = <T>(body: T): Fetched<T> => ({ ok: true, status: 200, ms: 1, error: null, body });
const down: Fetched<never> = { ok: false, status: null, ms: 3000, error: 'ECONNREFUSED', body: null };

function room(over: Partial<RoomInfo> & { inPhase: number; phase: string; state: string }): RoomInfo {
  const at = NOW - over.inPhase;
  return {
    room: '42',
    rid: 'cmpl-1',
    trace: 't-1',
    role: 'prefill',
    age_ms: over.inPhase + 5,
    deadline_ms: 10_000 - over.inPhase,
    peer: 'peer',
    bytes: 0,
    total_bytes: null,
    fail_reason: null,
    step: null,
    timeline: [{ at: at - 5, state: 'Bootstrapping', phase: 'bootstrap', why: 'create' }, { at, state: over.state, phase: over.phase, why: 'x' }],
    ...over,
  };
}

function worker(role: 'prefill' | 'decode', o: { live?: RoomInfo[]; recent?: RoomInfo[]; health?: Record<string, unknown>; metrics?: string; router?: Record<string, unknown>; reachable?: boolean } = {}): WorkerProbe {
  const url = `http://w-${role}:1`;
  const idle = role === 'prefill' ? { slots: 1, slots_free: 1, prefill_inflight_queue: 0 } : { slots: 2, slots_free: 2, decode_running: 0 };
  if (o.reachable === false) return { ref: { role, url, router: { healthy: false, last_error: 'unreachable' } }, health: down, metrics: down, rooms: down };
  return {
    ref: { role, url, router: { healthy: true, ...o.router } },
    health: ok({ status: 'ok', role, model: 'm', fingerprint: 'fp', ...idle, ...o.health }),
    metrics: ok(parsePrometheus(o.metrics ?? '')),
    rooms: ok({ role, now: NOW, live: o.live ?? [], recent: o.recent ?? [] }),
  };
}

function snap(workers: WorkerProbe[], inflight = 0): ClusterSnapshot {
  return {
    at: NOW,
    gatherMs: 5,
    source: 'router http://r',
    router: { url: 'http://r', health: ok({ status: 'ok', inflight }), workers: ok({ workers: [] }), metrics: ok([]), traces: ok({ traces: [] }) },
    workers,
  };
}

describe('diagnose', () => {
  test('clients the router cut (streams and large bodies) for reading too slowly: info since start, a warning when it moved', () => {
    const withCuts = (n: number) => {
      const s = snap([worker('prefill'), worker('decode')]);
      (s.router as any).metrics = ok(parsePrometheus(`pdserve_client_cut_total{reason="stalled"} ${n}\npdserve_client_cut_total{reason="over_buffer"} 0\n`));
      return s;
    };
    const once = diagnose(withCuts(2)).findings.find((x) => x.kind === 'slow_clients');
    assert.equal(once?.severity, 'info');
    assert.match(once!.title, /2 client\(s\) cut for reading too slowly since start/);
    assert.deepEqual(once!.details, ['stalled: 2']);
    const watch = diagnose(withCuts(5), { previous: withCuts(2) } as any).findings.find((x) => x.kind === 'slow_clients');
    assert.equal(watch?.severity, 'warning');
    assert.match(watch!.title, /3 client\(s\) cut/);
    assert.ok(!diagnose(withCuts(0)).findings.some((x) => x.kind === 'slow_clients'));
  });

  test('a worker whose state directory is full: a critical state_dir_full finding naming it and the folder; another degraded condition: a warning', () => {
    const reason = 'state_dir_full: state directory /dev/shm is full: 0 bytes free, a state needs about 1200000';
    const d = diagnose(snap([worker('prefill', { health: { status: 'degraded', degraded: [reason] }, router: { degraded: reason } }), worker('decode')]));
    const f = d.findings.find((x) => x.kind === 'state_dir_full');
    assert.ok(f, JSON.stringify(d.findings));
    assert.equal(f.severity, 'critical');
    assert.match(f.title, /^prefill http:\/\/w-prefill:1: its state directory is full \(state directory \/dev\/shm is full/);
    assert.ok(f.next.some((n) => n.includes('--state-dir')));
    assert.equal(d.findings.filter((x) => x.kind === 'state_dir_full').length, 1, 'one finding, whether /health or the router said it');
    const other = diagnose(snap([worker('prefill'), worker('decode', { health: { status: 'degraded', degraded: ['something_else: x'] } })]));
    assert.ok(other.findings.some((x) => x.kind === 'degraded' && x.severity === 'warning' && /something_else/.test(x.title)));
    assert.ok(!diagnose(snap([worker('prefill'), worker('decode')])).findings.some((x) => x.kind === 'state_dir_full' || x.kind === 'degraded'), 'healthy workers: no finding');
  });

  test('GPU offload: the summary counts engines per backend; an info finding names each worker\'s devices and layers, partial offload called out', () => {
    const vk = { backend: 'vulkan', devices: ['llvmpipe'], layers: 3, total_layers: 3 };
    const cpu = worker('decode', { health: { gpu: { backend: null, devices: [], layers: 0, total_layers: 3 } } });
    const d = diagnose(snap([worker('prefill', { health: { gpu: vk } }), cpu]));
    assert.equal(d.exitCode, 0, 'information, not a problem');
    assert.match(d.summary, /1 on GPU \(vulkan\), 1 on CPU/);
    const f = d.findings.find((x) => x.kind === 'gpu_offload')!;
    assert.equal(f.severity, 'info');
    assert.deepEqual(f.details, ['prefill http://w-prefill:1: vulkan [llvmpipe], 3/3 layers offloaded', 'decode http://w-decode:1: CPU only']);
    const partial = diagnose(snap([worker('prefill', { health: { gpu: { ...vk, layers: 2 } } }), cpu])).findings.find((x) => x.kind === 'gpu_offload')!;
    assert.match(partial.title, /1 worker\(s\) offload only part of the model/);
    assert.match(partial.next[0]!, /--gpu-layers/);
    const allCpu = diagnose(snap([worker('prefill', { health: { gpu: { backend: null, devices: [], layers: 0, total_layers: 3 } } }), cpu]));
    assert.equal(allCpu.findings.length, 0, 'CPU-only clusters: summary only');
    assert.match(allCpu.summary, /2 on CPU/);
  });

  test('a TLS failure is named as one, with the flag that fixes it, not as a dead process', () => {
    const untrusted: Fetched<never> = { ok: false, status: null, ms: 5, error: 'UNABLE_TO_VERIFY_LEAF_SIGNATURE', body: null };
    const s = snap([]);
    const d = diagnose({ ...s, router: { ...s.router!, url: 'https://r', health: untrusted, workers: untrusted } });
    const r = d.findings.find((f) => f.kind === 'router_unreachable')!;
    assert.match(r.cause, /does not trust the router's TLS certificate.*--ca FILE/);
    const cut: Fetched<never> = { ok: false, status: null, ms: 5, error: 'UND_ERR_SOCKET', body: null };
    const w = { ref: { role: 'decode' as const, url: 'https://w:1', router: { healthy: true } }, health: cut, metrics: cut, rooms: cut };
    assert.match(diagnose(snap([worker('prefill'), w])).findings.find((f) => f.kind === 'worker_unreachable')!.cause, /mutual TLS.*--internal-tls-cert/);
    assert.match(tlsCause('https://w:1', 'SELF_SIGNED_CERT_IN_CHAIN', 'worker')!, /--internal-tls-ca FILE/);
    // a certificate the CA signed for another name, or an expired one: giving the CA would not help
    assert.match(tlsCause('https://127.0.0.1:8444', 'ERR_TLS_CERT_ALTNAME_INVALID', 'router')!, /^the router's TLS certificate does not name 127\.0\.0\.1:8444, the host doctor dialed: reissue it .*subjectAltName/);
    assert.doesNotMatch(tlsCause('https://r', 'ERR_TLS_CERT_ALTNAME_INVALID', 'router')!, /--ca/);
    assert.match(tlsCause('https://w:1', 'CERT_HAS_EXPIRED', 'worker')!, /expired or not yet valid: renew it/);
    // not TLS: the usual causes stay
    assert.equal(tlsCause('http://w:1', 'UND_ERR_SOCKET', 'worker'), undefined, 'plain HTTP');
    assert.equal(tlsCause('https://r', 'ECONNREFUSED', 'router'), undefined);
    assert.match(diagnose(snap([worker('prefill'), worker('decode', { reachable: false })])).findings.find((f) => f.kind === 'worker_unreachable')!.cause, /worker process died/);
  });

  test('a router that refuses the admin key is named as such, not as a dead router, with the command that sends one', () => {
    const refused: Fetched<never> = { ok: false, status: 401, ms: 2, error: 'HTTP 401', body: null };
    const s = snap([]);
    const d = diagnose({ ...s, router: { ...s.router!, workers: refused } }, { routerUrl: 'https://r', doctor: { env: ['PDSERVE_ADMIN_API_KEY=<the admin key>'], flags: ['--ca /etc/pd/ca.pem'] } });
    assert.ok(!d.findings.some((f) => f.kind === 'router_unreachable'), JSON.stringify(d.findings));
    const f = d.findings.find((x) => x.kind === 'router_refused_key')!;
    assert.equal(f.severity, 'critical');
    assert.match(f.title, /admin key is missing or wrong/);
    assert.match(f.cause, /PDSERVE_ADMIN_API_KEY/);
    assert.deepEqual(f.next, ["PDSERVE_ADMIN_API_KEY=<one of the router's admin keys> pdserve doctor --url https://r --ca /etc/pd/ca.pem"]);
  });

  test('workers that refuse /debug/rooms unsigned (doctor without the cluster secret): one warning naming them, not silence', () => {
    const refused: Fetched<never> = { ok: false, status: 401, ms: 2, error: 'HTTP 401', body: null };
    const blind = (role: 'prefill' | 'decode') => ({ ...worker(role), rooms: refused });
    const d = diagnose(snap([blind('prefill'), blind('decode')]));
    const f = d.findings.find((x) => x.kind === 'rooms_unreadable')!;
    assert.ok(f, JSON.stringify(d.findings));
    assert.equal(f.severity, 'warning');
    assert.equal(d.exitCode, 1);
    assert.deepEqual(f.details, ['prefill http://w-prefill:1', 'decode http://w-decode:1']);
    assert.equal(f.next[0], 'PDSERVE_CLUSTER_SECRET_FILE=<file holding the cluster secret> pdserve doctor --url http://r');
    // a locked cluster: the suggested command carries what this run was given, keys by placeholder
    const locked = { env: ['PDSERVE_ADMIN_API_KEY=<the admin key>'], flags: ['--ca /etc/pd/ca.pem', '--internal-tls-cert /etc/pd/c.crt', '--internal-tls-key /etc/pd/c.key', '--internal-tls-ca /etc/pd/ica.pem'] };
    const lf = diagnose(snap([blind('prefill'), blind('decode')]), { routerUrl: 'https://r', doctor: locked }).findings.find((x) => x.kind === 'rooms_unreadable')!;
    assert.equal(lf.next[0], 'PDSERVE_CLUSTER_SECRET_FILE=<file holding the cluster secret> PDSERVE_ADMIN_API_KEY=<the admin key> pdserve doctor --url https://r --ca /etc/pd/ca.pem --internal-tls-cert /etc/pd/c.crt --internal-tls-key /etc/pd/c.key --internal-tls-ca /etc/pd/ica.pem');
    assert.deepEqual(doctorCredentials({ adminApiKey: 'k-123', ca: '/etc/pd/ca.pem', internalTlsCert: '/etc/pd/c.crt', internalTlsKey: '/etc/pd/c.key', internalTlsCa: '/etc/pd/ica.pem' }, {}), locked, 'the key by placeholder, never its value');
    // the cluster secret as this run read it: a file by its path (what `up` prints), a secret by placeholder
    assert.deepEqual(doctorCredentials({}, { PDSERVE_CLUSTER_SECRET_FILE: '/tmp/pdserve-1/cluster-secret' }).env, ['PDSERVE_CLUSTER_SECRET_FILE=/tmp/pdserve-1/cluster-secret']);
    assert.deepEqual(doctorCredentials({ clusterSecretFile: '/etc/pd/secret' }, { PDSERVE_CLUSTER_SECRET: 'abcdefgh12' }).env, ['PDSERVE_CLUSTER_SECRET_FILE=/etc/pd/secret']);
    const bySecret = doctorCredentials({}, { PDSERVE_CLUSTER_SECRET: 'abcdefgh12', PDSERVE_CLUSTER_SECRET_FILE: '/x' });
    assert.deepEqual(bySecret.env, ['PDSERVE_CLUSTER_SECRET=<the cluster secret>'], 'the secret by placeholder, never its value');
    // a finding's --request command carries this run's secret file, so pasting it reads the workers' rooms too
    const held = room({ role: 'prefill', state: 'Transferring', phase: 'inflight', step: 'sending', inPhase: 3000, bytes: 10, total_bytes: 10 });
    const withFile = diagnose(snap([worker('prefill', { live: [held] }), worker('decode')], 1), { routerUrl: 'http://r', doctor: doctorCredentials({}, { PDSERVE_CLUSTER_SECRET_FILE: '/tmp/pdserve-1/cluster-secret' }) });
    const reqNext = withFile.findings.flatMap((x) => x.next).filter((n) => n.includes('--request'));
    assert.ok(reqNext.length > 0, JSON.stringify(withFile.findings));
    for (const n of reqNext) assert.match(n, /^PDSERVE_CLUSTER_SECRET_FILE=\/tmp\/pdserve-1\/cluster-secret pdserve doctor --url http:\/\/r --request /);
    // the finding's own secret assignment replaces this run's, whichever of the two variables this run used
    const wrong = diagnose(snap([blind('prefill'), blind('decode')]), { routerUrl: 'http://r', doctor: bySecret }).findings.find((x) => x.kind === 'rooms_unreadable')!;
    assert.equal(wrong.next[0], 'PDSERVE_CLUSTER_SECRET_FILE=<file holding the cluster secret> pdserve doctor --url http://r');
    assert.doesNotMatch(f.title, /401/, 'the title names the cause, not the status');
    assert.ok(!diagnose(snap([worker('prefill'), worker('decode')])).findings.some((x) => x.kind === 'rooms_unreadable'), 'signed: no finding');
  });

  test('a healthy idle cluster: exit 0, no findings', () => {
    const d = diagnose(snap([worker('prefill'), worker('decode')]));
    assert.equal(d.exitCode, 0);
    assert.deepEqual(d.findings, []);
  });

  test('the incident: a room held in prefill inflight while engines idle is critical and named', () => {
    const p = room({ role: 'prefill', state: 'Transferring', phase: 'inflight', step: 'sending', inPhase: 3000, bytes: 10, total_bytes: 10 });
    const dr = room({ role: 'decode', state: 'Transferring', phase: 'transfer', step: 'receiving', inPhase: 3000 });
    const d = diagnose(snap([worker('prefill', { live: [p] }), worker('decode', { live: [dr] })], 1));
    assert.equal(d.exitCode, 2);
    assert.equal(d.findings[0]!.kind, 'incident_signature');
    const rf = d.findings.find((f) => f.kind === 'slow_room')!;
    assert.equal(rf.data!.role, 'prefill', 'the acting side (prefill) is named, not the waiting one');
    assert.equal(rf.data!.step, 'sending');
    assert.match(rf.cause, /KV_END/);
    assert.match(rf.next[0]!, /--request t-1/);
  });

  test('a busy cluster with young rooms is fine; the same rooms with an engine busy are no incident', () => {
    const young = room({ state: 'WaitingForInput', phase: 'waiting', inPhase: 100 });
    assert.equal(diagnose(snap([worker('prefill', { live: [young] }), worker('decode', { live: [{ ...young, role: 'decode' }] })], 1)).exitCode, 0);
    const old = room({ state: 'WaitingForInput', phase: 'waiting', step: 'computing', inPhase: 2500 });
    const d = diagnose(snap([worker('prefill', { live: [old], health: { slots_free: 0 } }), worker('decode', { live: [{ ...old, role: 'decode', step: 'waiting_kv' }] })], 1));
    assert.ok(!d.findings.some((f) => f.kind === 'incident_signature'));
    assert.equal(d.findings[0]!.kind, 'slow_room');
    assert.equal(d.exitCode, 1);
  });

  test('stuck (half the budget), overdue (past the deadline) and orphan rooms are critical', () => {
    const stuck = room({ state: 'WaitingForInput', phase: 'waiting', inPhase: 6000 });
    assert.ok(diagnose(snap([worker('prefill', { live: [stuck] }), worker('decode', { live: [{ ...stuck, role: 'decode' }] })])).findings.some((f) => f.kind === 'stuck_room' && f.severity === 'critical'));
    const overdue = room({ state: 'Transferring', phase: 'inflight', inPhase: 15_000, deadline_ms: -5000 });
    assert.ok(diagnose(snap([worker('prefill', { live: [overdue] }), worker('decode', { live: [{ ...overdue, role: 'decode' }] })])).findings.some((f) => f.kind === 'overdue_room'));
    const orphan = room({ state: 'Transferring', phase: 'inflight', step: 'awaiting_ack', inPhase: 1500 });
    const failed = { ...orphan, role: 'decode', state: 'Failed', phase: 'done', fail_reason: 'transfer: bad state' };
    const d = diagnose(snap([worker('prefill', { live: [orphan] }), worker('decode', { recent: [failed] })]));
    const f = d.findings.find((x) => x.kind === 'orphan_room')!;
    assert.ok(f, JSON.stringify(d.findings));
    assert.match(f.title, /Failed on decode \(transfer: bad state\)/);
  });

  test('a decode-local room (decode alone, no prefill peer) is never an orphan; a slow one names the local evaluation', () => {
    const local = room({ role: 'decode', state: 'WaitingForInput', phase: 'local', step: 'local_prefill', peer: null, inPhase: 1500 });
    const d = diagnose(snap([worker('prefill'), worker('decode', { live: [local] })], 1));
    assert.ok(!d.findings.some((f) => f.kind === 'orphan_room'), JSON.stringify(d.findings));
    const slow = diagnose(snap([worker('prefill'), worker('decode', { live: [{ ...local, ...room({ role: 'decode', state: 'WaitingForInput', phase: 'local', step: 'local_prefill', peer: null, inPhase: 6000 }) }] })], 1));
    const f = slow.findings.find((x) => x.kind === 'stuck_room')!;
    assert.ok(f, JSON.stringify(slow.findings));
    assert.match(f.cause, /decode-local continuation/);
    // "fail it now" goes through the router (never straight to a worker: the router would migrate it)
    const failNow = f.next.find((n) => n.includes('# fail it now'))!;
    assert.ok(failNow.includes(`-d '{"rid":"${local.rid}"}' http://r/abort_request`) && failNow.includes('$PDSERVE_ADMIN_API_KEY'), failNow);
  });

  test('a worker the router marked frozen is named as such, worst first', () => {
    const frozen = { ...worker('decode', { reachable: false }), ref: { role: 'decode' as const, url: 'http://d:2', router: { healthy: false, frozen: "no event on a request's stream for 3012 ms (bound 3000 ms), after 9 events", last_error: 'frozen: …' } } };
    const d = diagnose(snap([worker('prefill'), worker('decode'), frozen]));
    const f = d.findings[0]!;
    assert.equal(f.kind, 'worker_frozen', JSON.stringify(d.findings.map((x) => x.kind)));
    assert.equal(f.severity, 'critical');
    assert.match(f.title, /decode http:\/\/d:2 is frozen: no event/);
    assert.ok(!d.findings.some((x) => x.kind === 'worker_unreachable'), 'named once, as frozen');
  });

  test('lost and mismatched workers, recent failures, moved counters', () => {
    const d = diagnose(snap([worker('prefill', { health: { fingerprint: 'a', bootstrap_port: 9 }, router: { bootstrap_port: 8 } }), worker('decode', { health: { fingerprint: 'b' } }), { ...worker('decode', { reachable: false }), ref: { role: 'decode', url: 'http://gone:1', router: { healthy: false } } }]));
    const kinds = d.findings.map((f) => f.kind);
    assert.ok(kinds.includes('worker_unreachable') && kinds.filter((k) => k === 'mismatch').length === 2, kinds.join());
    assert.equal(d.exitCode, 2);
    const m = diagnose(snap([worker('prefill', { router: { mismatch: 'settings mismatch with decode http://d: context size 1024 vs 2048' } }), worker('decode', { health: { status: 'draining' }, router: { healthy: false, draining: true } })]));
    assert.ok(m.findings.some((f) => f.kind === 'mismatch' && /context size/.test(f.title)), JSON.stringify(m.findings));
    assert.ok(m.findings.some((f) => f.kind === 'draining' && f.severity === 'info'));
    assert.ok(!m.findings.some((f) => f.kind === 'worker_unhealthy'), 'a draining worker is not reported as unhealthy');
    const mem = diagnose(snap([worker('prefill', { router: { membership: 'etcd_only' } }), worker('decode', { router: { membership: 'router_only' } })]));
    assert.deepEqual(mem.findings.map((f) => f.kind), ['membership', 'membership']);
    assert.equal(mem.exitCode, 1);
    const unavailable = snap([worker('prefill')]);
    unavailable.router!.health = { ok: false, status: 503, ms: 1, error: 'HTTP 503', body: { status: 'unavailable', prefill: { healthy: 1, total: 1 }, decode: { healthy: 0, total: 0 } } };
    assert.equal(diagnose(unavailable).findings[0]!.kind, 'router_unavailable');
    const failedAt = NOW - 60_000;
    const recent = [{ ...room({ state: 'Failed', phase: 'done', inPhase: 0 }), fail_reason: 'deadline: inflight', timeline: [{ at: failedAt, state: 'Failed', phase: 'done', why: 'deadline' }] }];
    const old = { ...recent[0]!, room: '7', fail_reason: 'transfer: x', timeline: [{ at: NOW - 3_600_000, state: 'Failed', phase: 'done', why: 'x' }] };
    const prev = snap([worker('prefill', { metrics: 'pdserve_illegal_transitions_total{from="Failed",to="Transferring"} 1\n' }), worker('decode')]);
    const cur = snap([worker('prefill', { recent: [...recent, old], metrics: 'pdserve_illegal_transitions_total{from="Failed",to="Transferring"} 3\n' }), worker('decode')]);
    const d2 = diagnose(cur, { previous: { ...prev, at: NOW - 2000 } });
    assert.ok(d2.findings.some((f) => f.kind === 'recent_failures' && /'deadline'/.test(f.title) && f.severity === 'warning'));
    assert.ok(!d2.findings.some((f) => /'transfer'/.test(f.title)), 'failures older than the window are not reported');
    const peerAbort = [{ ...recent[0]!, role: 'decode', fail_reason: 'prefill: abort: router' }];
    const d3 = diagnose(snap([worker('prefill'), worker('decode', { recent: peerAbort })]));
    assert.equal(d3.exitCode, 0, 'an abort relayed by the peer is no warning');
    assert.match(d3.findings[0]!.title, /'prefill→abort'/);
    const clientAbort = [{ ...recent[0]!, fail_reason: 'request_aborted: client went away' }];
    const relayed = [{ ...recent[0]!, room: '8', role: 'decode', fail_reason: 'prefill: request_aborted: router' }];
    const d4 = diagnose(snap([worker('prefill', { recent: clientAbort }), worker('decode', { recent: relayed })]));
    assert.equal(d4.findings.length, 2);
    assert.equal(d4.exitCode, 0, 'client aborts (error table cause: client) are no warning');
    assert.ok(d4.findings.every((f) => f.severity === 'info'), JSON.stringify(d4.findings));
    assert.match(d4.findings[0]!.cause, /cancelled/);
    // a request prefill refused (its 400 went to the client): decode's room names it, and no one blames the client's cancel
    const refused = [{ ...recent[0]!, room: '9', role: 'decode', fail_reason: 'prefill_refused: prefill refused the request: 400 context_length_exceeded: too long' }];
    const d5 = diagnose(snap([worker('prefill'), worker('decode', { recent: refused })]));
    assert.equal(d5.exitCode, 0, 'a request refused by prefill is no cluster fault');
    assert.match(d5.findings[0]!.title, /decode room\(s\) failed with 'prefill_refused'/);
    assert.match(d5.findings[0]!.cause, /prefill refused the request/);
    assert.doesNotMatch(d5.findings[0]!.cause, /cancelled/);
    const fault = [{ ...recent[0]!, fail_reason: 'peer_lost: heartbeat' }];
    assert.equal(diagnose(snap([worker('prefill', { recent: fault }), worker('decode')])).exitCode, 1, 'a system fault stays a warning');
    const totals = diagnose(snap([worker('prefill', { metrics: 'pdserve_room_deadline_expired_total{role="prefill"} 2\n' }), worker('decode')]), { routerUrl: 'http://r:9' });
    assert.ok(totals.findings.some((f) => f.next.some((n) => n.startsWith('pdserve doctor --url http://r:9 --watch'))), JSON.stringify(totals.findings));
    const moved = d2.findings.find((f) => f.kind === 'counter_moved')!;
    assert.match(moved.details[0]!, /\+2/);
  });
});

test('traceIdOf: traceparent, then x-request-id, else a fresh W3C id', () => {
  assert.equal(traceIdOf({ traceparent: '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01' }), '4bf92f3577b34da6a3ce929d0e0e4736');
  assert.equal(traceIdOf({ traceparent: '00-00000000000000000000000000000000-00f067aa0ba902b7-01', 'x-request-id': 'abc' }), 'abc');
  assert.equal(traceIdOf({ 'x-request-id': 'has space' }).length, 32);
  assert.match(traceIdOf({}), /^[0-9a-f]{32}$/);
  assert.notEqual(traceIdOf({}), traceIdOf({}));
});

test('TraceStore: lookup by trace or rid, bounded, finished callback', () => {
  const s = new TraceStore(2);
  const done: string[] = [];
  s.onFinished = (t) => done.push(t.rid);
  s.begin('r1', 't1');
  s.event('r1', 'dispatched', { room: '9', prefill: 'p', decode: 'd' });
  s.event('r1', 'finished', { outcome: 'ok' });
  assert.equal(s.get('t1')!.room, '9');
  assert.equal(s.get('r1')!.outcome, 'ok');
  assert.deepEqual(done, ['r1']);
  s.begin('r2', 't2');
  s.begin('r3', 't3');
  assert.equal(s.get('t1'), undefined, 'oldest evicted');
  assert.deepEqual(s.recent().map((t) => t.rid), ['r3', 'r2']);
});

test('TraceStore.settle closes only a trace nothing finished, from the HTTP status, without onFinished', () => {
  const s = new TraceStore();
  const done: string[] = [];
  s.onFinished = (t) => done.push(t.rid);
  s.begin('bad', 't-bad');
  s.settle('bad', 400);
  assert.equal(s.get('bad')!.outcome, 'rejected');
  s.begin('fan', 't-fan');
  s.settle('fan', 200);
  assert.equal(s.get('fan')!.outcome, 'ok');
  s.begin('pd', 't-pd');
  s.event('pd', 'finished', { outcome: 'client_abort' });
  s.settle('pd', 200);
  assert.equal(s.get('pd')!.outcome, 'client_abort', 'a recorded finish wins');
  s.settle('unknown', 500);
  assert.deepEqual(done, ['pd'], 'settled traces are not fed to the dashboard series');
  s.begin('late', 't-late');
  s.settle('late', 404, 1234);
  assert.equal(s.get('late')!.events.at(-1)!.at, 1234, 'dated when the response ended, not when settled');
});

test('DashboardSeries: buckets, percentiles, failures by code', () => {
  const s = new DashboardSeries(1000, 5);
  const t = 1_000_000;
  s.add({ outcome: 'ok', ttft_ms: 10, itl_ms: 2, completion_tokens: 4 }, t);
  s.add({ outcome: 'ok', ttft_ms: 30, itl_ms: 4, completion_tokens: 6 }, t + 100);
  s.add({ outcome: 'error', code: 'kv_transfer_failed' }, t + 2000);
  s.add({ outcome: 'error', status: 400, code: 'context_length_exceeded' }, t + 2100);
  s.add({ outcome: 'client_abort', status: 499 }, t + 2200);
  const v = s.view(t + 2500);
  assert.equal(v.t.length, 5);
  assert.equal(v.tokens_per_s[2], 10);
  assert.equal(v.ttft_p50_ms[2], 10);
  assert.equal(v.ttft_p95_ms[2], 30);
  assert.deepEqual(v.failures, [{ code: 'kv_transfer_failed', count: 1 }], 'a 4xx is not a failure');
  assert.deepEqual([v.failed_per_s[4], v.rejected_per_s[4]], [1, 1]);
  assert.equal(percentile([], 0.5), null);
});

test('parsePrometheus reads labels, escapes and special values', () => {
  const x = parsePrometheus('# HELP a b\na_total{k="v\\"q",e="x"} 3\nb 1.5\nc +Inf\n');
  assert.deepEqual(x[0], { name: 'a_total', labels: { k: 'v"q', e: 'x' }, value: 3 });
  assert.equal(sumOf(x, 'b'), 1.5);
  assert.equal(x[2]!.value, Infinity);
});

test('DashboardSeries: a fresh series shows one minute, not the whole empty window', () => {
  const s = new DashboardSeries(5000, 60);
  const t = 1_000_000_000;
  s.add({ outcome: 'ok', completion_tokens: 5 }, t);
  assert.equal(s.view(t).t.length, 12);
  assert.equal(s.view(t + 120_000).t.length, 25);
  assert.equal(s.view(t + 3_600_000).t.length, 60);
});

test('fetchText answers within its deadline when the peer accepts TCP but never completes the TLS handshake', async () => {
  // A SIGSTOPped worker behind TLS: the kernel accepts, nothing answers; undici applies an abort
  // only once connected, so without fetchText's own deadline this waits for the connect timeout.
  const { createServer } = await import('node:net');
  const { Agent } = await import('undici');
  const { fetchText } = await import('../../src/observe/gather.js');
  const held: import('node:net').Socket[] = [];
  const srv = createServer((s) => held.push(s));
  await new Promise<void>((r) => srv.listen(0, '127.0.0.1', r));
  const port = (srv.address() as import('node:net').AddressInfo).port;
  const agent = new Agent({ connect: { timeout: 20_000 } });
  try {
    const t0 = performance.now();
    const f = await fetchText(`https://127.0.0.1:${port}/health`, 300, JSON.parse, agent);
    const ms = performance.now() - t0;
    assert.equal(f.ok, false);
    assert.equal(f.error, 'timed out after 300 ms');
    assert.ok(ms < 5000, `answered after ${Math.round(ms)} ms (the connect timeout is 20 s)`);
  } finally {
    await agent.destroy();
    for (const s of held) s.destroy();
    await new Promise((r) => srv.close(r));
  }
});
