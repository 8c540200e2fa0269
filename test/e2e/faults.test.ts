/**
 * Peers that die, freeze and come back, and a KV port that receives garbage — on real processes.
 * - SIGKILL the prefill worker with transfers in flight: decode fails those requests at once,
 *   frees their slots, stays healthy; the restarted prefill serves again.
 * - SIGSTOP a prefill worker: decode's /health still answers within 1 s, requests through the
 *   other prefill worker succeed, and after SIGCONT service resumes.
 * - Restart a decode worker on the same port: service is back within 10 s, no manual steps.
 * - Unknown room, duplicate room, stale epoch, malformed, oversized and unauthenticated frames:
 *   refused and logged, the process lives, the next request is fine.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import { newEpoch } from '../../src/kv/auth.js';
import { KvPeerPool } from '../../src/kv/channel.js';
import { encodeControl } from '../../src/kv/frame.js';
import { kvTransportOf } from '../../src/kv/transport.js';
import { settingsFromHealth } from '../../src/router/pair-settings.js';
import { loadInternalTls } from '../../src/security/tls.js';
import type { Cluster, ClusterProc } from '../../src/up/cluster.js';
import { busy, getJson, promptOf, rawCompletion, startStack, waitFor } from '../helpers/stack.js';

const HB = 250;
let c: Cluster;

const completion = (prompt: string, maxTokens = 8, timeoutMs = 15_000) => rawCompletion(c.router.url, prompt, maxTokens, timeoutMs);
const ok = (r: { status: number; text: string }) => r.status === 200 && /\[DONE\]/.test(r.text) && !/"error"/.test(r.text);

const metric = async (p: ClusterProc, re: RegExp) => Number(re.exec(await (await fetch(`${p.url}/metrics`)).text())?.[1] ?? 0);
/** The pair settings a worker reports on /health (what the KV handshake compares). */
const pairOf = async (p: ClusterProc) => settingsFromHealth((await getJson<any>(`${p.url}/health`)).settings)!;
const healthyPrefills = async () => ((await getJson<any>(`${c.router.url}/workers`)).workers as any[]).filter((w) => w.role === 'prefill' && w.healthy).length;

before(async () => {
  c = await startStack({
    colocated: false,
    prefill: 2,
    extraArgs: { prefill: ['--heartbeat-ms', String(HB)], decode: ['--heartbeat-ms', String(HB)], router: ['--health-interval-ms', '200'] },
    env: { PDSERVE_TEST_HOLDS: 'prefill.send=400' },
  });
});
after(async () => {
  await c?.stop();
});

describe('peer faults on real processes', () => {
  test('SIGKILL prefill with transfers in flight: decode fails its rooms at once, frees slots, stays healthy; the router migrates the requests', async () => {
    const [p0] = c.byRole('prefill');
    const decode = c.byRole('decode')[0]!;
    const inflight = Array.from({ length: 6 }, (_, i) => completion(promptOf(40 + i, i), 16));
    // Wait until p0 holds at least one room mid-transfer (held before KV_END by the test hold).
    assert.ok(await waitFor(async () => (await getJson<any>(`${p0!.url}/debug/rooms`)).live.some((r: any) => r.phase === 'inflight'), 5000, 5));
    const killedAt = Date.now();
    await c.kill(p0!);
    const results = await Promise.all(inflight);
    // The requests on the killed prefill had token 1 (the transfer was held): their rooms failed
    // on decode at once and the router moved them, with that token, to the other prefill.
    assert.ok(results.every(ok), `every request is answered: ${results.filter((r) => !ok(r)).map((r) => r.text.slice(0, 200)).join(' | ')}`);
    assert.ok(Date.now() - killedAt < 8000, `answered within 8 s of the kill (${Date.now() - killedAt} ms)`);
    assert.ok((await metric(c.router, /^pdserve_router_migrations_total\{reason="[^"]+",outcome="ok"\} (\d+)/m)) >= 1, 'migrated');
    assert.ok(await waitFor(async () => (await busy(decode.url)) === 0, 1000), 'decode released every slot within 1 s');
    const h = await getJson<any>(`${decode.url}/health`);
    assert.equal(h.status, 'ok');
    assert.equal(h.slots_free, h.slots);
    await c.spawn(p0!);
    assert.ok(await waitFor(async () => (await healthyPrefills()) === 2, 10_000), 'router sees the restarted prefill');
    for (let i = 0; i < 6; i++) assert.ok(ok(await completion(promptOf(20, i))), 'requests succeed after the restart');
    assert.equal(decode.unexpectedExits.length, 0);
  });

  test('SIGSTOP one prefill: decode /health answers within 1 s, the other prefill serves, SIGCONT resumes', async () => {
    const [p0] = c.byRole('prefill');
    const decode = c.byRole('decode')[0]!;
    c.signal(p0!, 'SIGSTOP');
    try {
      const stuck = completion(promptOf(30, 7), 8, 20_000);
      for (let i = 0; i < 10; i++) {
        const t0 = Date.now();
        const h = await getJson<any>(`${decode.url}/health`, 1000);
        assert.equal(h.status, 'ok');
        assert.ok(Date.now() - t0 < 1000);
        await new Promise((r) => setTimeout(r, 100));
      }
      assert.ok(await waitFor(async () => (await healthyPrefills()) === 1, 5000), 'router skips the frozen prefill');
      const rs = await Promise.all(Array.from({ length: 6 }, (_, i) => completion(promptOf(25, i))));
      assert.ok(rs.every(ok), `requests via the other prefill succeed: ${rs.filter((r) => !ok(r)).map((r) => r.text).join(' | ')}`);
      const s = await stuck;
      // A request that went to the frozen prefill ends (error or success), never hangs.
      assert.ok(s.status !== 0 || !/TimeoutError/.test(s.text), `no hang: ${s.text}`);
    } finally {
      c.signal(p0!, 'SIGCONT');
    }
    assert.ok(await waitFor(async () => (await healthyPrefills()) === 2, 10_000), 'frozen prefill back after SIGCONT');
    assert.ok(await waitFor(async () => ok(await completion('resumed')), 10_000));
    for (let i = 0; i < 6; i++) assert.ok(ok(await completion(promptOf(15, i))));
    assert.equal(p0!.unexpectedExits.length, 0);
    assert.equal(decode.unexpectedExits.length, 0);
  });

  test('a decode worker restarted on the same port serves again within 10 s', async () => {
    const decode = c.byRole('decode')[0]!;
    await c.kill(decode);
    await c.spawn(decode); // resolves once the new process says it is ready (its model load is not the router's to count)
    const t0 = Date.now();
    assert.ok(await waitFor(async () => ok(await completion('back again', 4, 2000)), 10_000, 100), 'service back');
    assert.ok(Date.now() - t0 < 10_000, `back in ${Date.now() - t0} ms after the restarted decode was ready`);
  });
});

describe('protocol abuse on the KV port', () => {
  const bootstrap = () => c.byRole('prefill')[1]!;
  /** The cluster's KV transport: TLS with the run's client certificate in secure test mode (docs/TESTING.md), else TCP. */
  const transport = () => kvTransportOf(loadInternalTls(c.opts.internalTls));

  /** Open a raw connection to the bootstrap port over the cluster's KV transport, write `bytes` after the server's hello, and resolve when the server closes it. */
  function rawSession(bytes: Buffer): Promise<'closed'> {
    return new Promise((resolve, reject) => {
      const s = transport().dial({ host: '127.0.0.1', port: bootstrap().bootstrapPort! }).socket;
      const t = setTimeout(() => {
        s.destroy();
        reject(new Error('server did not close the connection within 3 s'));
      }, 3000);
      s.once('data', () => s.write(bytes));
      s.on('error', () => {});
      s.on('close', () => {
        clearTimeout(t);
        resolve('closed');
      });
    });
  }

  test('malformed, oversized and unauthenticated frames close that connection; the process lives', async () => {
    const before = await metric(bootstrap(), /pdserve_kv_channel_events_total\{event="auth_failures"\} (\d+)/);
    assert.equal(await rawSession(Buffer.from('GET / HTTP/1.1\r\n\r\n')), 'closed');
    const huge = Buffer.alloc(5);
    huge.writeUInt32BE(0x7fffffff, 0);
    huge[4] = 1;
    assert.equal(await rawSession(huge), 'closed');
    assert.equal(await rawSession(encodeControl({ type: 'register', room: '1', rid: 'x', epoch: 'deadbeefdeadbeef' })), 'closed');
    const wrongSecret = new KvPeerPool({ transport: transport(), secret: 'not-the-cluster-secret', epoch: newEpoch(), settings: await pairOf(bootstrap()) });
    await assert.rejects(wrongSecret.get('127.0.0.1', bootstrap().bootstrapPort!));
    await wrongSecret.close();
    const after = await metric(bootstrap(), /pdserve_kv_channel_events_total\{event="auth_failures"\} (\d+)/);
    assert.ok(after > before, 'auth failures counted');
    assert.ok(ok(await completion('still serving')));
  });

  test('unknown room, stale epoch and duplicate room are refused; the next request is fine', async () => {
    const p = bootstrap();
    const epoch = newEpoch();
    const pool = new KvPeerPool({ transport: transport(), secret: c.secret, epoch, settings: await pairOf(p) });
    try {
      const conn = await pool.get('127.0.0.1', p.bootstrapPort!);
      // Messages for rooms the prefill never saw: ignored (a FAIL leaves a tombstone), nothing breaks.
      assert.ok(conn.sendControl({ type: 'kv_ack', room: '12345', epoch }));
      assert.ok(conn.sendControl({ type: 'fail', room: '12346', code: 'request_aborted', detail: 'test', epoch }));
      const stale0 = await metric(p, /pdserve_kv_channel_events_total\{event="stale_epoch"\} (\d+)/);
      conn.sendControl({ type: 'register', room: '777', rid: 'stale', epoch: 'feedfacefeedface' });
      assert.ok(await waitFor(async () => (await metric(p, /pdserve_kv_channel_events_total\{event="stale_epoch"\} (\d+)/)) > stale0, 2000), 'stale epoch refused and counted');
    } finally {
      await pool.close();
    }
    const room = BigInt.asUintN(63, randomBytes(8).readBigUInt64BE()).toString();
    const body = JSON.stringify({ rid: `dup-${room}`, text: 'duplicate', sampling_params: { temperature: 0, top_p: 1, top_k: 0, max_new_tokens: 4, stop: [], ignore_eos: false }, bootstrap_host: '127.0.0.1', bootstrap_port: p.bootstrapPort, bootstrap_room: room });
    const first = fetch(`${p.url}/generate`, { method: 'POST', headers: { 'content-type': 'application/json' }, body, signal: AbortSignal.timeout(15_000) }).catch(() => undefined);
    assert.ok(await waitFor(async () => (await getJson<any>(`${p.url}/debug/rooms`)).live.some((r: any) => r.room === room), 2000));
    const second = await fetch(`${p.url}/generate`, { method: 'POST', headers: { 'content-type': 'application/json' }, body, signal: AbortSignal.timeout(5000) });
    assert.equal(second.status, 409);
    assert.match((await second.json()).error.message, /room/i);
    await fetch(`${p.url}/abort_request`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ rid: `dup-${room}`, bootstrap_room: room }) });
    const r1 = await first;
    assert.equal(r1?.status, 499);
    assert.ok(ok(await completion('fine after abuse')));
    for (const proc of c.procs) assert.equal(proc.unexpectedExits.length, 0, `${proc.name} alive`);
  });
});
