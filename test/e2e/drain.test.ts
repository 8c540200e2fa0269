/**
 * Graceful drain on real processes (router + 2 prefill + 2 decode, tiny model, loopback).
 * - SIGTERM a decode worker under steady load: /health says draining at once, its streams end
 *   with [DONE], the router sends it nothing new, it exits 0, and no request fails; restarted, it
 *   is routable again.
 * - The same for a prefill worker; decode counts no `prefill_failed` for a request prefill refused as it began to drain (it ran again elsewhere).
 * - A second SIGTERM stops waiting: the request left fails cleanly (an error, not a hang) and the
 *   process exits 0 at once.
 * - SIGTERM the router with streams in flight: they end with [DONE], new requests get 503
 *   `draining`, the router exits 0.
 * A test hold at decode.load (300 ms) keeps every request in flight long enough to be caught.
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import type { Cluster, ClusterProc } from '../../src/up/cluster.js';
import { getJson, promptOf, startStack, waitFor } from '../helpers/stack.js';

let c: Cluster;

interface Result {
  status: number;
  text: string;
}

async function completion(base: string, prompt: string, maxTokens = 8, timeoutMs = 20_000): Promise<Result> {
  try {
    const r = await fetch(`${base}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'pdserve', prompt, max_tokens: maxTokens, temperature: 0, stream: true }), signal: AbortSignal.timeout(timeoutMs) });
    return { status: r.status, text: await r.text() };
  } catch (err) {
    return { status: 0, text: String(err) };
  }
}
const ok = (r: Result) => r.status === 200 && /data: \[DONE\]/.test(r.text) && !/"error"/.test(r.text);

/** `n` clients sending requests back to back until `stop()`; every result is kept. */
function load(n: number) {
  let running = true;
  const results: Result[] = [];
  const loops = Array.from({ length: n }, async (_, k) => {
    for (let i = 0; running; i++) results.push(await completion(c.router.url, promptOf(24 + (i % 5), k * 100 + i)));
  });
  return {
    results,
    async stop() {
      running = false;
      await Promise.all(loops);
      return results;
    },
  };
}

function exitOf(p: ClusterProc): Promise<{ code: number | null; signal: string | null; at: number }> {
  const child = p.child!;
  return new Promise((r) => child.once('exit', (code, signal) => r({ code, signal, at: Date.now() })));
}

const workers = async () => (await getJson<any>(`${c.router.url}/workers`)).workers as any[];
const routable = async (url: string) => (await workers()).some((w) => w.url === url && w.healthy && !w.draining);

async function healthOf(url: string): Promise<{ status: number; body: any }> {
  const r = await fetch(`${url}/health`, { signal: AbortSignal.timeout(2000) });
  return { status: r.status, body: await r.json() };
}

/** The rooms live on a worker now (its /debug/rooms). */
const liveRooms = async (url: string) => (await getJson<{ live: { room: string }[] }>(`${url}/debug/rooms`)).live;

/** Requests served by `p` so far, from its own metrics (rooms that reached Success). */
async function served(p: ClusterProc): Promise<number> {
  const text = await (await fetch(`${p.url}/metrics`)).text();
  return Number(/pdserve_rooms_terminal_total\{[^}]*state="Success"[^}]*\} (\d+)/.exec(text)?.[1] ?? 0);
}

/** Decode rooms counted as failed because their prefill failed (pdserve_bootstrap_failed_total + kv_transfer_failed_total {reason="prefill_failed"}), over both decodes. */
async function prefillFailedOnDecode(): Promise<number> {
  let n = 0;
  for (const d of c.byRole('decode')) {
    const text = await (await fetch(`${d.url}/metrics`)).text();
    for (const m of text.matchAll(/^pdserve_(?:bootstrap|kv_transfer)_failed_total\{reason="prefill_failed"\} (\d+)/gm)) n += Number(m[1]);
  }
  return n;
}

before(async () => {
  c = await startStack({
    colocated: false,
    prefill: 2,
    decode: 2,
    decodeSlots: 4,
    // A slow poll: the router must learn of drains from refusals and of restarts from the
    // supervisor's push (POST /workers/probe), not from polling.
    extraArgs: { router: ['--health-interval-ms', '5000'] },
    env: { PDSERVE_TEST_HOLDS: 'decode.load=300' },
  });
});
after(async () => {
  await c?.stop();
});

describe('graceful drain on SIGTERM', () => {
  for (const role of ['decode', 'prefill'] as const) {
    test(`${role}: draining under load loses no request, streams end with [DONE], exit 0, restart is routable`, async (t) => {
      const p = c.byRole(role)[0]!;
      const failedBefore = role === 'prefill' ? await prefillFailedOnDecode() : 0;
      const l = load(4);
      try {
        assert.ok(await waitFor(async () => (await served(p)) > 0, 10_000), 'load is flowing through the worker');
        // Its requests from now on stay 1.5 s in flight, so the drain has something to wait for.
        await fetch(`${p.url}/debug/test-holds`, { method: 'POST', body: role === 'decode' ? 'decode.load=1500' : 'prefill.compute=1500' });
        // A room that appears after the change is held 1.5 s (one live before it may be at the
        // 300 ms hold, or past its hold point, and end before the signal is handled).
        const before = new Set((await liveRooms(p.url)).map((r) => r.room));
        assert.ok(await waitFor(async () => (await liveRooms(p.url)).some((r) => !before.has(r.room)), 5000, 5), `${role} has a room in flight held 1.5 s`);
        const exited = exitOf(p);
        const t0 = Date.now();
        c.signal(p, 'SIGTERM');
        // The signal is handled when the process gets to it (late on a loaded machine): wait for
        // the draining answer, while the 1.5 s hold keeps the process alive to give it.
        let h = { status: 0, body: {} as any };
        assert.ok(await waitFor(async () => (h = await healthOf(p.url)).status === 503, 5000, 10), `${role} answers draining after SIGTERM (last: ${h.status})`);
        assert.equal(h.body.status, 'draining');
        assert.ok(h.body.inflight > 0, 'requests in flight are being waited for');
        const ex = await exited;
        assert.equal(ex.code, 0, `${role} exits 0 after draining`);
        assert.ok(ex.at - t0 >= 500, `it waited for its requests (${ex.at - t0} ms)`);
        await new Promise((r) => setTimeout(r, 800)); // the load keeps running on the other worker
      } finally {
        await l.stop();
      }
      const failed = l.results.filter((r) => !ok(r));
      assert.ok(l.results.length >= 8, `load ran (${l.results.length} requests)`);
      assert.deepEqual(failed.map((r) => `${r.status} ${r.text.slice(0, 200)}`), [], 'no request failed');
      // a request prefill refused as it began to drain ran again elsewhere: decode's room of it was cancelled, not failed
      if (role === 'prefill') assert.equal(await prefillFailedOnDecode(), failedBefore, 'decode counted no prefill_failed for a drain-time retry');
      // Restart on the same ports: the supervisor's push makes it routable at once.
      const t1 = Date.now();
      await c.spawn(p); // resolves once the worker is ready and the router was asked to probe it
      assert.ok(await routable(p.url), 'routable the moment spawn() returned (the 5 s poll cannot have found it yet)');
      t.diagnostic(`restarted ${role} routable ${Date.now() - t1} ms after spawn began (process start-up included; health poll 5 s)`);
    });
  }

  test('a second SIGTERM stops waiting: the request left fails cleanly and the process exits 0 at once', async () => {
    const [d0, p] = c.byRole('decode');
    // One request on each decode (least-loaded picking), each held 4 s before its state loads.
    for (const d of [d0!, p!]) await fetch(`${d.url}/debug/test-holds`, { method: 'POST', body: 'decode.load=4000' });
    const reqs = [0, 1].map((i) => completion(c.router.url, promptOf(30, 9 + i), 8, 30_000));
    assert.ok(await waitFor(async () => (await healthOf(p!.url)).body.rooms > 0, 5000, 5), 'request in flight on decode');
    const exited = exitOf(p!);
    c.signal(p!, 'SIGTERM');
    // draining once the signal is handled (the held request keeps it there for 4 s)
    assert.ok(await waitFor(async () => (await healthOf(p!.url)).body.status === 'draining', 3000, 10), 'draining: the request is being waited for');
    const t0 = Date.now();
    c.signal(p!, 'SIGTERM');
    const ex = await exited;
    assert.equal(ex.code, 0);
    assert.ok(ex.at - t0 < 3000, `exited ${ex.at - t0} ms after the second signal`);
    // The request on the other decode goes on now (its hold only kept it in flight meanwhile).
    await fetch(`${d0!.url}/debug/test-holds`, { method: 'POST', body: '' });
    const results = await Promise.all(reqs);
    const failed = results.filter((r) => !ok(r));
    assert.equal(failed.length, 1, 'the request left on the drained decode failed, the other completed');
    assert.ok(failed[0]!.status >= 500 || /"error"/.test(failed[0]!.text), `a clean error, got ${failed[0]!.status} ${failed[0]!.text.slice(0, 200)}`);
    await c.spawn(p!);
    assert.ok(await waitFor(() => routable(p!.url), 5000, 20));
  });

  test('router: streams in flight end with [DONE], new requests get 503 draining, exit 0', async () => {
    for (const d of c.byRole('decode')) await fetch(`${d.url}/debug/test-holds`, { method: 'POST', body: 'decode.load=1500' });
    const inflight = Array.from({ length: 3 }, (_, i) => completion(c.router.url, promptOf(28, 50 + i)));
    assert.ok(await waitFor(async () => (await getJson<any>(`${c.router.url}/health`)).inflight >= 3, 5000, 5), 'requests in flight at the router');
    const exited = exitOf(c.router);
    c.signal(c.router, 'SIGTERM');
    // draining once the signal is handled (the streams held 1.5 s on decode keep it there)
    assert.ok(await waitFor(async () => (await fetch(`${c.router.url}/health`, { signal: AbortSignal.timeout(2000) })).status === 503, 5000, 10), 'the router answers draining after SIGTERM');
    const refused = await fetch(`${c.router.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'pdserve', prompt: 'hi', max_tokens: 2 }) });
    assert.equal(refused.status, 503);
    assert.equal(((await refused.json()) as any).error.code, 'draining');
    const h = await fetch(`${c.router.url}/health`);
    assert.equal(h.status, 503);
    assert.equal(((await h.json()) as any).status, 'draining');
    const results = await Promise.all(inflight);
    for (const r of results) assert.ok(ok(r), `in-flight stream completed: ${r.status} ${r.text.slice(-200)}`);
    assert.equal((await exited).code, 0);
  });
});
