/**
 * Diagnosability on a real cluster (router + prefill + decode + colocated reference, tiny model):
 *  - request traces: the client's traceparent / x-request-id becomes the trace id, returned in
 *    `x-trace-id`, recorded by the router (/debug/traces) and by both workers (/debug/rooms);
 *    `pdserve doctor --request` prints the timeline across the three processes;
 *  - every /metrics passes `promtool check metrics` (where promtool is installed; said loudly where not);
 *  - `pdserve doctor` on a healthy cluster exits 0;
 *  - the incident: a room held in prefill's inflight phase (PDSERVE_TEST_HOLDS) is named by
 *    `pdserve doctor` with its state, phase, step and age, and the exit code is non-zero;
 *  - the /dashboard in headless Debian chromium shows live data (screenshot kept in test-artifacts/).
 */
import assert from 'node:assert/strict';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import type { Cluster } from '../../src/up/cluster.js';
import { getJson, startStack, waitFor } from '../helpers/stack.js';
import { cli } from '../helpers/cli.js';
import { assertTotalsAreCounters, checkMetrics, reportMissingPromtool } from '../helpers/promtool.js';

let c: Cluster;
/** --transfer-timeout-ms of the workers: the deadline of a room held mid-transfer, ms. */
const HELD_ROOM_DEADLINE_MS = 60_000;
/** How long a room is held in prefill inflight (released early by clearing the hold), ms. */
const HOLD_MS = 45_000;
const url = (role: 'prefill' | 'decode') => c.byRole(role)[0]!.url;

async function complete(headers: Record<string, string>, body: Record<string, unknown> = {}, signal?: AbortSignal): Promise<Response> {
  return fetch(`${c.router.url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...headers },
    body: JSON.stringify({ model: 'pdserve', prompt: 'the river ran', max_tokens: 6, temperature: 0, ...body }),
    signal: signal ?? AbortSignal.timeout(20_000),
  });
}

before(async () => {
  // A held room must stay live while the doctor (two CLI starts) and the page look at it, however
  // loaded the machine: its transfer deadline is 60 s here instead of 10 s; clearing the hold ends it.
  const slow = ['--transfer-timeout-ms', String(HELD_ROOM_DEADLINE_MS)];
  c = await startStack({ colocated: true, decodeSlots: 2, env: { PDSERVE_TEST_HOLDS: 'on' }, extraArgs: { prefill: slow, decode: slow } });
});
after(async () => {
  await c?.stop();
});

describe('request traces', () => {
  test('a request refused before dispatch: its trace finishes when the answer left, not at the later settle', async () => {
    const r = await fetch(`${c.router.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'no-such-model', prompt: 'x' }) });
    assert.equal(r.status, 404);
    await r.text();
    const rid = r.headers.get('x-request-id')!;
    let t: any;
    assert.ok(await waitFor(async () => (t = await getJson(`${c.router.url}/debug/traces/${rid}`)).outcome !== null, 5000), 'settled');
    const [received, finished] = [t.events[0], t.events.find((e: { what: string }) => e.what === 'finished')];
    assert.equal(finished.status, 404);
    assert.ok(finished.at - received.at < 500, `finished ${finished.at - received.at} ms after received (settle runs 1 s after the answer)`);
  });

  test('a traceparent trace id follows the request through router, prefill and decode', async () => {
    const traceId = '4bf92f3577b34da6a3ce929d0e0e4736';
    const r = await complete({ traceparent: `00-${traceId}-00f067aa0ba902b7-01` }, { stream: true });
    assert.equal(r.status, 200);
    assert.equal(r.headers.get('x-trace-id'), traceId);
    assert.match(await r.text(), /\[DONE\]/);
    // prefill answers the router on decode's kv_ack, which may trail the client's [DONE]: wait (5 s)
    // until the trace holds all five events, then check them
    let t: any;
    await waitFor(async () => (t = await getJson(`${c.router.url}/debug/traces/${traceId}`)).events.length >= 5, 5000);
    assert.equal(t.trace, traceId);
    const whats = t.events.map((e: { what: string }) => e.what);
    assert.deepEqual(whats.slice(0, 2), ['received', 'dispatched'], JSON.stringify(t));
    assert.deepEqual([...whats].sort(), ['dispatched', 'finished', 'first_token', 'prefill_done', 'received']);
    assert.equal(t.outcome, 'ok');
    const logFile = c.router.logFile!;
    const logged = await waitFor(async () => readFileSync(logFile, 'utf8').split('\n').some((l) => l.includes(`"trace":"${traceId}"`) && l.includes('request finished') && l.includes(`"room":"${t.room}"`)), 3000);
    assert.ok(logged, `the router's 'request finished' line carries the trace id and room (${logFile})`);
    for (const role of ['prefill', 'decode'] as const) {
      let row: { room: string; trace: string } | undefined;
      const ok = await waitFor(async () => {
        const d = await getJson(`${url(role)}/debug/rooms`);
        row = [...d.live, ...d.recent].find((x: { trace: string }) => x.trace === traceId);
        return row !== undefined;
      }, 3000);
      assert.ok(ok, `${role} /debug/rooms shows the trace id`);
      assert.equal(row!.room, t.room);
    }
  });

  test('x-request-id is the trace id when there is no traceparent; otherwise one is generated', async () => {
    const r1 = await complete({ 'x-request-id': 'client-req-42' });
    assert.equal(r1.status, 200);
    assert.equal(r1.headers.get('x-trace-id'), 'client-req-42');
    const body = (await r1.json()) as { id: string };
    assert.equal(r1.headers.get('x-request-id'), body.id, 'x-request-id still names the response id');
    const r2 = await complete({ traceparent: 'garbage' });
    assert.equal(r2.status, 200);
    assert.match(r2.headers.get('x-trace-id') ?? '', /^[0-9a-f]{32}$/);
    await r2.text();
  });

  test('pdserve doctor --request prints the timeline across processes with time per phase', async () => {
    const r = await complete({ 'x-request-id': 'timeline-probe' });
    assert.equal(r.status, 200);
    await r.text();
    const out = await cli(['doctor', '--url', c.router.url, '--request', 'timeline-probe'], 20_000, { PDSERVE_CLUSTER_SECRET: c.secret });
    assert.equal(out.code, 0, out.out + out.err);
    assert.match(out.out, /request timeline-probe/);
    for (const re of [/router\s+received/, /router\s+finished outcome=ok/, /prefill \S+\s+create → Bootstrapping\/bootstrap/, /decode \S+\s+create → Bootstrapping\/prealloc/, /kv_done → Success\/done/, /time per phase:/, /prefill \S+\s+bootstrap \d/, /decode \S+\s+prealloc \d/]) {
      assert.match(out.out, re);
    }
    const j = await cli(['doctor', '--url', c.router.url, '--request', 'timeline-probe', '--json'], 20_000, { PDSERVE_CLUSTER_SECRET: c.secret });
    const rep = JSON.parse(j.out) as { rows: { process: string }[]; phases: { process: string; phase: string; ms: number; ongoing: boolean }[] };
    assert.deepEqual(new Set(rep.rows.map((x) => x.process.split(' ')[0])), new Set(['router', 'prefill', 'decode']));
    // both workers' rooms gave their phases, each timed and over (the request has finished)
    const phaseOf = (role: string) => rep.phases.filter((p) => p.process.startsWith(`${role} `)).map((p) => p.phase);
    assert.ok(phaseOf('prefill').includes('bootstrap'), JSON.stringify(rep.phases));
    assert.ok(phaseOf('decode').includes('prealloc'), JSON.stringify(rep.phases));
    assert.ok(rep.phases.every((p) => Number.isFinite(p.ms) && p.ms >= 0 && !p.ongoing), JSON.stringify(rep.phases));
    const missing = await cli(['doctor', '--url', c.router.url, '--request', 'no-such-request'], 20_000, { PDSERVE_CLUSTER_SECRET: c.secret });
    assert.equal(missing.code, 1);
    assert.match(missing.out, /no process knows no-such-request/);
  });
});

test('every /metrics passes promtool check metrics', async (t) => {
  const targets = { router: c.router.url, prefill: url('prefill'), decode: url('decode'), colocated: c.colocated!.url };
  for (const [name, base] of Object.entries(targets)) {
    const text = await (await fetch(`${base}/metrics`)).text();
    assert.match(text, /^# TYPE pdserve_/m, `${name} serves pdserve metrics`);
    assertTotalsAreCounters(text);
    const res = checkMetrics(text);
    if (!res) return reportMissingPromtool(t);
    assert.ok(res.ok, `promtool rejects ${name} /metrics:\n${res.output}`);
  }
});

test('pdserve doctor on a healthy cluster exits 0 within 10 s', async (t) => {
  const out = await cli(['doctor', '--url', c.router.url, '--json'], 20_000, { PDSERVE_CLUSTER_SECRET: c.secret });
  t.diagnostic(`doctor (healthy cluster, process start included): ${out.ms} ms`);
  const j = JSON.parse(out.out) as { exit_code: number; findings: { severity: string; title: string }[] };
  assert.equal(out.code, 0, out.out);
  assert.ok(!j.findings.some((f) => f.severity !== 'info'), JSON.stringify(j.findings));
  assert.ok(out.ms < 10_000, `doctor took ${out.ms} ms`);
  const text = await cli(['doctor', '--url', c.router.url], 20_000, { PDSERVE_CLUSTER_SECRET: c.secret });
  assert.equal(text.code, 0);
  const watch = await cli(['doctor', '--url', c.router.url, '--json', '--watch', '0.2', '--count', '2'], 20_000, { PDSERVE_CLUSTER_SECRET: c.secret });
  assert.equal(watch.code, 0, watch.out + watch.err);
  assert.equal(watch.out.trim().split('\n').map((l) => JSON.parse(l).exit_code).join(), '0,0', 'two rounds');
  assert.match(text.out, /OK: nothing wrong found|\[INFO\]/);
});

test('the incident: a room held in prefill inflight is named by pdserve doctor, exit non-zero', async (t) => {
  const hold = (spec: string) => fetch(`${url('prefill')}/debug/test-holds`, { method: 'POST', headers: { 'content-type': 'text/plain' }, body: spec });
  assert.equal((await hold(`prefill.send=${HOLD_MS}`)).status, 200);
  const ac = new AbortController();
  const victim = complete({ 'x-request-id': 'held-victim' }, { stream: true }, ac.signal).then((r) => r.text()).catch(() => '');
  try {
    let room: { room: string; phase: string; step: string } | undefined;
    const found = await waitFor(async () => {
      const d = await getJson(`${url('prefill')}/debug/rooms`);
      room = d.live.find((r: { phase: string; step: string }) => r.phase === 'inflight' && r.step === 'sending');
      return room !== undefined;
    }, 10_000);
    assert.ok(found && room, 'the victim reached prefill inflight');
    await new Promise((r) => setTimeout(r, 1300));
    // JSON and text at once: both see the same held room (it lives until the hold is cleared)
    const [out, text] = await Promise.all([
      cli(['doctor', '--url', c.router.url, '--json', '--slow-ms', '1000'], 20_000, { PDSERVE_CLUSTER_SECRET: c.secret }),
      cli(['doctor', '--url', c.router.url, '--slow-ms', '1000'], 20_000, { PDSERVE_CLUSTER_SECRET: c.secret }),
    ]);
    t.diagnostic(`doctor (held room): ${out.ms} ms`);
    assert.equal(out.code, 2, out.out + out.err);
    assert.ok(out.ms < 10_000, `doctor took ${out.ms} ms`);
    const j = JSON.parse(out.out) as { findings: { kind: string; severity: string; title: string; data?: Record<string, unknown> }[] };
    const sig = j.findings.find((f) => f.kind === 'incident_signature');
    assert.ok(sig, `incident signature reported: ${JSON.stringify(j.findings)}`);
    assert.equal(sig.severity, 'critical');
    const rf = j.findings.find((f) => f.data?.room === room!.room && f.data?.role === 'prefill');
    assert.ok(rf, `a finding names room ${room.room}: ${JSON.stringify(j.findings)}`);
    assert.equal(rf.data!.state, 'Transferring');
    assert.equal(rf.data!.phase, 'inflight');
    assert.equal(rf.data!.step, 'sending');
    assert.equal(rf.data!.trace, 'held-victim');
    assert.ok(Number(rf.data!.in_phase_ms) >= 1000 && Number(rf.data!.age_ms) >= 1000, JSON.stringify(rf.data));
    assert.equal(j.findings[0]!.severity, 'critical', 'worst first');
    assert.equal(text.code, 2);
    assert.match(text.out, new RegExp(`room ${room.room} .*Transferring/inflight step sending`));
    assert.match(text.out, /requests are waiting while every engine is idle/);
    assert.match(text.out, /likely cause: .*\n\s+next: PDSERVE_CLUSTER_SECRET=<the cluster secret> (?:\S+=<[^>]*> )*pdserve doctor --url \S+ (?:.* )?--request held-victim/, 'the next command carries the secret this run read, by placeholder');
    assert.ok(!text.out.includes(c.secret), 'never the secret itself');
  } finally {
    await hold('');
    ac.abort();
    await victim;
  }
  assert.ok(await waitFor(async () => (await getJson(`${url('prefill')}/debug/rooms`)).live.length === 0, 5000), 'the held room ends once the client aborts');
});

describe('dashboard in headless chromium', () => {
  const CHROMIUM = '/usr/bin/chromium';
  test('shows workers, queues, rooms, charts and live updates', async (t) => {
    if (!existsSync(CHROMIUM)) {
      const msg = `chromium is NOT installed at ${CHROMIUM}: the dashboard browser test did NOT run (apt-get install chromium)`;
      process.stderr.write(`\n!!!!! ${msg} !!!!!\n\n`);
      t.diagnostic(msg);
      assert.ok(!process.env.CI, msg);
      return;
    }
    for (let i = 0; i < 3; i++) await (await complete({}, { max_tokens: 8 })).text();
    const { chromium } = await import('playwright-core');
    const profile = mkdtempSync(join(tmpdir(), 'pdserve-chromium-'));
    const ctx = await chromium.launchPersistentContext(profile, {
      executablePath: CHROMIUM,
      headless: true,
      viewport: { width: 1400, height: 1000 },
      // Secure test mode (docs/TESTING.md): the router's certificate is the run's throwaway CA's, its admin key the page's login.
      ...(c.kit ? { ignoreHTTPSErrors: true, httpCredentials: { username: 'admin', password: c.kit.adminKey, send: 'always' as const } } : {}),
      args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking', '--disable-component-update', '--disable-sync'],
    });
    try {
      const page = ctx.pages()[0] ?? (await ctx.newPage());
      const failed: string[] = [];
      page.on('requestfailed', (r) => failed.push(r.url()));
      page.on('pageerror', (e) => failed.push(`page error: ${e.message}`));
      await page.goto(`${c.router.url}/dashboard`, { timeout: 15_000 });
      await page.waitForFunction(() => Number(document.body.dataset.updates ?? 0) >= 1, null, { timeout: 15_000 });
      const rows = await page.locator('#workers tbody tr').allInnerTexts();
      assert.equal(rows.length, 2, rows.join('\n'));
      assert.ok(rows.some((r) => /prefill/.test(r) && /healthy/.test(r)) && rows.some((r) => /decode/.test(r) && /healthy/.test(r)), rows.join('\n'));
      assert.equal(await page.locator('.uplot canvas').count(), 3, 'three uPlot charts');
      const before = await page.locator('#requests').innerText();
      const okBefore = Number(before.split('/')[0]);
      assert.ok(okBefore >= 3, `requests ok shown: ${before}`);
      await (await complete({}, { max_tokens: 8 })).text();
      await page.waitForFunction((n) => Number(document.getElementById('requests')!.textContent!.split('/')[0]) > n, okBefore, { timeout: 10_000 });
      const tps = await page.evaluate(() => document.getElementById('tps')!.textContent);
      assert.match(tps ?? '', /^\d+\.\d$/);
      // the prefix-store card: the store's size and budget, lookups by tier (every prompt looked up), events
      const card = await page.locator('#prefixstore').innerText();
      assert.match(card, /store \d+\.\d \/ \d+\.\d MiB · \d+ files/, card);
      const seq = /sequence hits (\d+) \/ misses (\d+)/.exec(card);
      assert.ok(seq && Number(seq[1]) + Number(seq[2]) >= 4, card);
      assert.match(card, /store hits \d+ \/ misses \d+/, card);
      assert.match(card, /evictions \d+/, card);
      assert.match(card, /events published \d+ · consumed \d+ · gaps \d+/, card);
      assert.deepEqual(failed, [], 'every asset loads from the router (no CDN)');
      // A held room shows up live: rooms by phase, and the doctor's finding on the page.
      const holdSpec = (spec: string) => fetch(`${url('prefill')}/debug/test-holds`, { method: 'POST', headers: { 'content-type': 'text/plain' }, body: spec });
      await holdSpec(`prefill.send=${HOLD_MS}`);
      const ac = new AbortController();
      const victim = complete({ 'x-request-id': 'dashboard-held' }, { stream: true }, ac.signal).then((r) => r.text()).catch(() => '');
      try {
        await page.waitForFunction(() => /prefill inflight: 1/.test(document.getElementById('phases')!.textContent ?? ''), null, { timeout: 10_000 });
        await page.waitForFunction(() => document.getElementById('status')!.textContent === 'critical', null, { timeout: 10_000 });
        const findings = await page.locator('#findings li').allInnerTexts();
        assert.ok(findings.some((f) => /requests are waiting while every engine is idle/.test(f)), findings.join('\n'));
        mkdirSync('test-artifacts', { recursive: true });
        await page.screenshot({ path: join('test-artifacts', 'dashboard.png'), fullPage: true });
        t.diagnostic('screenshot: test-artifacts/dashboard.png');
      } finally {
        await holdSpec('');
        ac.abort();
        await victim;
      }
    } finally {
      await ctx.close();
      rmSync(profile, { recursive: true, force: true });
    }
  });
});

test('a hung worker (SIGSTOP) is named by pdserve doctor within 10 s', async (t) => {
  const decode = c.byRole('decode')[0]!;
  const pid = decode.child?.pid;
  assert.ok(pid, 'decode child pid');
  process.kill(pid, 'SIGSTOP');
  try {
    const out = await cli(['doctor', '--url', c.router.url, '--json'], 20_000, { PDSERVE_CLUSTER_SECRET: c.secret });
    t.diagnostic(`doctor (one worker hung): ${out.ms} ms`);
    assert.ok(out.ms < 10_000, `doctor took ${out.ms} ms`);
    assert.equal(out.code, 2, out.out + out.err);
    const j = JSON.parse(out.out) as { findings: { kind: string; title: string; data?: Record<string, unknown> }[] };
    const f = j.findings.find((x) => x.kind === 'worker_unreachable' && x.data?.url === decode.url);
    assert.ok(f, JSON.stringify(j.findings));
    assert.match(f.title, /timed out after 3000 ms/);
  } finally {
    process.kill(pid, 'SIGCONT');
  }
  assert.ok(await waitFor(async () => (await fetch(`${c.router.url}/health`)).status === 200, 10_000), 'the router sees decode again');
});
