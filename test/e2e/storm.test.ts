/**
 * `pdserve storm` end to end, through the real CLI (bin/pdserve.js → dist/):
 *  1. the CI storm: 40 s, self-hosted, tiny model, 30 agents, ≥ 30 % aborts, bursts, and at
 *     least one decode SIGKILL, one prefill SIGKILL and one prefill SIGSTOP/SIGCONT — it must
 *     pass every check (wedge, leak, hang, crash, wrong answer) with both KV handoff paths
 *     carrying rooms (decode-0 same host, decode-1 TCP), and no request may fail: the router
 *     retries or migrates what the faults break;
 *  2. the storm can fail: a prefill started with the test-only fault switch
 *     PDSERVE_FAULT_LEAK_ROOM=1 leaks one room; the storm must exit 1 and name that room.
 */
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { createServer, type Server } from 'node:http';
import { describe, test } from 'node:test';
import { BIN } from '../../src/up/cluster.js';
import { percentile, summarize } from '../../src/observe/stats.js';
import type { StormReport } from '../../src/storm/index.js';
import { collectLeaks, RoomMonitor } from '../../src/storm/monitor.js';

interface Run {
  code: number | null;
  stdout: string;
  stderr: string;
  report: StormReport;
  dir: string;
  ms: number;
}

/** Run `pdserve storm ARGS --json … --log-dir …` with a hard deadline. */
async function storm(args: string[], env: Record<string, string> = {}, deadlineMs = 240_000): Promise<Run> {
  const dir = mkdtempSync(join(tmpdir(), 'pdserve-storm-test-'));
  const json = join(dir, 'report.json');
  const t0 = Date.now();
  const child = spawn(process.execPath, [BIN, 'storm', ...args, '--json', json, '--log-dir', join(dir, 'logs')], { env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
  let stdout = '';
  let stderr = '';
  child.stdout.on('data', (d) => (stdout += d));
  child.stderr.on('data', (d) => (stderr += d));
  const code = await new Promise<number | null>((resolve) => {
    const t = setTimeout(() => child.kill('SIGKILL'), deadlineMs);
    child.on('exit', (c) => {
      clearTimeout(t);
      resolve(c);
    });
  });
  let report: StormReport;
  try {
    report = JSON.parse(readFileSync(json, 'utf8')) as StormReport;
  } catch (err) {
    throw new Error(`no JSON report (exit ${code}): ${(err as Error).message}\n--- stdout\n${stdout}\n--- stderr\n${stderr}`);
  }
  return { code, stdout, stderr, report, dir, ms: Date.now() - t0 };
}

/** A fake worker whose /debug/rooms, /metrics and /health bodies the test sets. */
async function fakeWorker(): Promise<{ url: string; server: Server; set(p: Partial<{ rooms: unknown; metrics: string; health: unknown }>): void }> {
  let state: { rooms: unknown; metrics: string; health: unknown } = { rooms: { epoch: 'e1', live: [], recent: [] }, metrics: '', health: { slots: 1, slots_free: 1 } };
  const server = createServer((req, res) => {
    const body = req.url === '/debug/rooms' ? JSON.stringify(state.rooms) : req.url === '/health' ? JSON.stringify(state.health) : state.metrics;
    res.writeHead(200, { 'content-type': req.url === '/metrics' ? 'text/plain' : 'application/json' }).end(body);
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  const a = server.address() as { port: number };
  return { url: `http://127.0.0.1:${a.port}`, server, set: (p) => (state = { ...state, ...p }) };
}

const room = (id: string, deadline: number | null, state = 'Transferring') => ({
  room: id,
  rid: `rid-${id}`,
  role: 'prefill',
  state,
  phase: 'inflight',
  age_ms: 20_000,
  deadline_ms: deadline,
  peer: 'decode@x',
  timeline: [
    { at: 1000, state: 'Bootstrapping', phase: 'bootstrap', why: 'create' },
    { at: 1010, state, phase: 'inflight', why: 'kv_begin' },
  ],
});

describe('storm helpers', () => {
  test('percentile interpolates linearly; summarize', () => {
    assert.equal(percentile([1, 2, 3, 4], 50), 2.5);
    assert.equal(percentile([1, 2, 3, 4], 0), 1);
    assert.equal(percentile([1, 2, 3, 4], 100), 4);
    assert.equal(percentile([10, 20], 90), 19);
    assert.ok(Number.isNaN(percentile([], 50)));
    const s = summarize([3, 1, 2, NaN]);
    assert.deepEqual([s.n, s.mean, s.median, s.p50, s.min, s.max], [3, 2, 2, 2, 1, 3]);
    assert.ok(Number.isNaN(summarize([]).p99));
  });

  test('wedge: a room past its deadline in two consecutive polls; paused workers and one-off sightings do not count', async () => {
    const w = await fakeWorker();
    try {
      const m = new RoomMonitor([{ name: 'prefill-0', url: w.url }], { pollMs: 1000, graceMs: 2000 });
      w.set({ rooms: { epoch: 'e1', live: [room('1', -5000), room('2', -100), room('3', 4000)], recent: [] } });
      await m.pollAll();
      assert.equal(m.wedges.size, 0, 'one sighting is not a wedge');
      w.set({ rooms: { epoch: 'e1', live: [room('1', -6000), room('2', -3000)], recent: [] } });
      await m.pollAll();
      assert.deepEqual([...m.wedges.values()].map((x) => [x.worker, x.room.room, x.overdueMs]), [['prefill-0', '1', 6000]]);
      assert.deepEqual(m.liveByState(), { Transferring: 2 });
      m.pause('prefill-0');
      w.set({ rooms: { epoch: 'e2', live: [room('2', -9000)], recent: [] } });
      await m.pollAll();
      await m.pollAll();
      assert.equal(m.wedges.size, 1, 'a paused (SIGSTOPped) worker is not polled');
      m.resume('prefill-0', 0);
      await m.pollAll();
      assert.equal(m.health()[0]!.unexpectedEpochChanges.length, 1, 'an epoch change nobody announced is a crash');
      m.expectRestart('prefill-0');
      w.set({ rooms: { epoch: 'e3', live: [], recent: [{ ...room('9', null, 'Success'), timeline: [{ at: Date.now() + 5, state: 'Success', phase: 'done', why: 'kv_done' }] }] } });
      const f = { worker: 'prefill-0', at: Date.now() };
      m.watchFault(f);
      await m.pollAll();
      assert.equal(m.health()[0]!.unexpectedEpochChanges.length, 1, 'an announced restart is not');
      assert.ok(f.workerOkAt !== undefined && f.workerOkAt >= f.at, 'worker recovery seen');
    } finally {
      w.server.close();
    }
  });

  test('leak: non-zero gauges, held slots and live rooms are reported by name', async () => {
    const w = await fakeWorker();
    try {
      w.set({ metrics: '# HELP x\npdserve_prefill_inflight_queue_reqs 1\npdserve_prefill_waiting_queue_reqs 0\npdserve_rooms{role="prefill",state="Transferring"} 1\npdserve_kv_transfer_bytes_total 99\n', health: { slots: 2, slots_free: 1 }, rooms: { epoch: 'e', live: [room('42', 3000)], recent: [] } });
      const rep = await collectLeaks([{ name: 'prefill-0', url: w.url }]);
      assert.deepEqual(rep.items.map((i) => [i.what, i.value]), [
        ['pdserve_prefill_inflight_queue_reqs', 1],
        ['pdserve_rooms{role="prefill",state="Transferring"}', 1],
        ['sequence slots held (slots 2, free 1)', 1],
      ]);
      assert.deepEqual(rep.rooms.map((r) => r.room.room), ['42']);
      w.set({ metrics: 'pdserve_prefill_inflight_queue_reqs 0\n', health: { slots: 2, slots_free: 2 }, rooms: { epoch: 'e', live: [], recent: [] } });
      const clean = await collectLeaks([{ name: 'prefill-0', url: w.url }]);
      assert.deepEqual([clean.items, clean.rooms, clean.unreachable], [[], [], []]);
    } finally {
      w.server.close();
    }
  });
});

describe('pdserve storm', () => {
  test('CI storm: 40 s, 30 agents, ≥ 30 % aborts, decode/prefill SIGKILL and prefill SIGSTOP — every check passes', async () => {
    const r = await storm([
      '--duration', '40s',
      '--agents', '30',
      '--prefill', '2',
      '--decode', '2',
      '--abort-rate', '0.4',
      '--kill-rate', '0.05',
      '--burst-every', '12s',
      '--kill-decode-every', '20s',
      '--kill-prefill-every', '25s',
      '--stop-prefill-every', '15s',
      '--stop-duration', '3s',
      '--request-timeout', '30s',
      '--settle', '10s',
      '--verify', '24',
      '--seed', '4',
    ]);
    const rep = r.report;
    const ctx = `\n--- stdout\n${r.stdout}\n--- stderr (tail)\n${r.stderr.slice(-3000)}`;
    console.log(r.stdout);
    assert.equal(r.code, 0, `storm exit code${ctx}`);
    assert.equal(rep.ok, true, `storm verdict${ctx}`);
    for (const c of rep.checks) assert.equal(c.status, 'pass', `check ${c.name}: ${c.summary}${ctx}`);
    assert.ok(rep.requests.total >= 200, `enough requests (${rep.requests.total})`);
    assert.ok(rep.requests.abort_share >= 0.3, `abort share ${rep.requests.abort_share} ≥ 30 %`);
    assert.ok(rep.bursts.count >= 3, 'bursts happened');
    for (const kind of ['kill_decode', 'kill_prefill', 'stop_prefill'] as const) {
      const fs = rep.faults.filter((f) => f.kind === kind);
      assert.ok(fs.length >= 1, `at least one ${kind}`);
      for (const f of fs) assert.equal(f.error, undefined, `${kind} on ${f.target} injected cleanly`);
    }
    assert.ok(rep.faults.some((f) => f.first_ok_ms !== null), 'service recovered after the faults');
    const wa = rep.checks.find((c) => c.name === 'wrong_answer')!;
    assert.match(wa.summary, /^(\d+) of \1 sampled rounds/, 'wrong-answer check compared every sampled round');
    assert.ok(Number(/^(\d+)/.exec(wa.summary)![1]) >= 20, 'at least 20 rounds compared');
    // Prefill runs with its prefix cache and the reference without: cached rounds were compared.
    const cachedRounds = Number(/(\d+) of the equal rounds were served with cached prefix tokens/.exec(wa.summary)?.[1] ?? 0);
    assert.ok(cachedRounds >= 1, `the wrong-answer check compared rounds served from the prefix cache: ${wa.summary}`);
    // Decode-local continuation is on: rounds decode served alone (no KV handoff) were compared.
    const localRounds = Number(/(\d+) on the decode-local path/.exec(wa.summary)?.[1] ?? 0);
    assert.ok(localRounds >= 1, `the wrong-answer check compared rounds served on the decode-local path: ${wa.summary}`);
    // Rounds the router migrated mid-answer come first in the sample (up to 12 of 24): each one was compared, and equal.
    if (rep.rounds.migrated > 0) {
      assert.ok(rep.rounds.migrated_verified >= Math.min(12, rep.rounds.migrated), `migrated rounds in the sample: ${JSON.stringify(rep.rounds)}`);
      assert.equal(rep.rounds.migrated_equal, rep.rounds.migrated_verified, wa.summary);
    }
    console.log(`migrated rounds: ${JSON.stringify(rep.rounds)}`);
    assert.equal(rep.requests.hung, 0);
    // The router retries and migrates what the faults break: no request exhausts its attempts.
    assert.equal(rep.requests.failed, 0, `failed by code: ${JSON.stringify(rep.requests.failed_by_code)}`);
    assert.ok(Object.keys(rep.requests.migrated_by_code).length + Object.keys(rep.requests.retried_by_code).length > 0, 'the faults made the router dispatch requests again');
    // --kv-same-host mixed (the default): decode-0 takes state files over on this host, decode-1
    // runs --no-kv-same-host; both paths carried rooms through the faults.
    const hand = rep.kv_handoffs;
    assert.ok((hand['decode-0']?.same_host ?? 0) >= 1 && (hand['decode-0']?.tcp ?? 0) === 0, `decode-0 used the same-host path: ${JSON.stringify(hand)}`);
    assert.ok((hand['decode-1']?.tcp ?? 0) >= 1 && (hand['decode-1']?.same_host ?? 0) === 0, `decode-1 used TCP: ${JSON.stringify(hand)}`);
    console.log(`storm test wall time ${(r.ms / 1000).toFixed(1)} s`);
  });

  test('the storm fails loudly: a leaked room (PDSERVE_FAULT_LEAK_ROOM=1) makes it exit 1 and name the room', async () => {
    const r = await storm(
      [
        // Long enough for the first acknowledged room (the one leaked) and some traffic after it;
        // the settle after it is waited out in full (the leaked room never ends).
        '--duration', '6s',
        '--agents', '8',
        '--prefill', '1',
        '--decode', '1',
        '--abort-rate', '0.2',
        '--kill-decode-every', '0',
        '--kill-prefill-every', '0',
        '--stop-prefill-every', '0',
        '--burst-every', '5s',
        '--request-timeout', '20s',
        '--settle', '4s',
        '--verify', '0',
      ],
      { PDSERVE_FAULT_LEAK_ROOM: '1' },
    );
    const ctx = `\n--- stdout\n${r.stdout}\n--- stderr (tail)\n${r.stderr.slice(-3000)}`;
    assert.equal(r.code, 1, `storm exit code${ctx}`);
    assert.equal(r.report.ok, false);
    const leak = r.report.checks.find((c) => c.name === 'leak')!;
    assert.equal(leak.status, 'fail', `leak check${ctx}`);
    // The room the prefill worker says it leaked…
    const log = readFileSync(join(r.dir, 'logs', 'prefill-0.log'), 'utf8');
    const line = log.split('\n').find((l) => l.includes('FAULT INJECTION'));
    assert.ok(line, 'the prefill worker leaked a room');
    const room = String(JSON.parse(line).room);
    // …is the room the storm names, with its timeline, and the only one.
    const named = r.report.offending_rooms.filter((o) => o.check === 'leak');
    assert.deepEqual(named.map((o) => o.room.room), [room], `leaked room named${ctx}`);
    assert.equal(named[0]!.worker, 'prefill-0');
    assert.equal(named[0]!.room.state, 'Transferring');
    assert.ok(r.stdout.includes(`room ${room}`), 'the room is printed');
    assert.match(r.stdout, /\(kv_begin\)/, 'with its timeline');
    assert.match(r.stdout, /RESULT: FAIL \(failed: leak/);
    // The other checks still pass: the fault leaks, it does not wedge or hang anything.
    for (const c of r.report.checks) if (c.name !== 'leak') assert.notEqual(c.status, 'fail', `${c.name}: ${c.summary}`);
  });
});
