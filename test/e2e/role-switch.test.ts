/**
 * Role switch in place and the planner, on real processes: router + 3 `pdserve worker` processes
 * (1 starting as prefill, 2 as decode; tiny model, loopback).
 * - A switch under streaming load (openai SDK): 0 failed requests; the router takes the worker
 *   out, the worker drains, rebuilds, the router verifies GET /role and routes to it in its new
 *   role; the last worker of a role is never switched (409).
 * - A worker switched behind the router's back: its legs are refused with `stale_epoch` and the
 *   router stops routing to it (role mismatch), 0 failed requests.
 * - A switch that fails midway (test-only fault file): back in its old role (`safe_to_restore`),
 *   or, when the rebuild fails too, unhealthy and never routed.
 * - The planner (500 ms tick): a prefill-heavy load flips a decode to prefill, a decode-heavy load
 *   flips a prefill to decode, each within two ticks of the load showing, 0 failed requests.
 * Test holds (prefill.compute, decode.step) make the phases last long enough to be seen.
 */
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import type OpenAI from 'openai';
import type { Cluster } from '../../src/up/cluster.js';
import { Planner, type DecisionRecord } from '../../src/planner/planner.js';
import { createLogger } from '../../src/base/log.js';
import { client, getJson, promptOf, startStack, waitFor } from '../helpers/stack.js';

const faultDir = mkdtempSync(join(tmpdir(), 'pdserve-role-fault-'));
const FAULT = join(faultDir, 'fault');
let c: Cluster;
let pd: OpenAI;

interface Row {
  url: string;
  role: string;
  healthy: boolean;
  draining: boolean;
  epoch: string | null;
  switching: string | null;
  last_error: string | null;
}
const workers = async () => (await getJson<{ workers: Row[] }>(`${c.router.url}/workers`)).workers;
const rowOf = async (url: string) => (await workers()).find((w) => w.url === url)!;
const switchVia = async (url: string, role: string) => {
  const r = await fetch(`${c.router.url}/workers/role`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ url, role }), signal: AbortSignal.timeout(60_000) });
  return { status: r.status, body: (await r.json()) as Record<string, any> };
};
const holds = (spec: string) => Promise.all(c.procs.filter((p) => p.role !== 'router').map((p) => fetch(`${p.url}/debug/test-holds`, { method: 'POST', headers: { 'content-type': 'text/plain' }, body: spec })));
const metric = async (url: string, name: string) => {
  const t = await (await fetch(`${url}/metrics`)).text();
  return t.split('\n').filter((l) => l.startsWith(name)).reduce((s, l) => s + Number(l.split(' ').pop()), 0);
};

/** `n` openai SDK clients streaming completions back to back until `stop()`; failures kept. */
function load(n: number, o: { promptChars: number; maxTokens: number }) {
  let running = true;
  let ok = 0;
  const failed: string[] = [];
  const loops = Array.from({ length: n }, async (_, k) => {
    for (let i = 0; running; i++) {
      try {
        const s = await pd.completions.create({ model: 'pdserve', prompt: promptOf(o.promptChars, k * 1000 + i), max_tokens: o.maxTokens, temperature: 0, stream: true });
        let finish: string | null = null;
        for await (const ch of s) finish = ch.choices[0]?.finish_reason ?? finish;
        if (finish) ok++;
        else failed.push('stream ended without a finish_reason');
      } catch (err) {
        failed.push((err as Error).message);
      }
    }
  });
  return {
    get ok() {
      return ok;
    },
    failed,
    async stop() {
      running = false;
      await Promise.all(loops);
    },
  };
}

describe('role switch and planner (3 switchable workers)', () => {
  before(async () => {
    c = await startStack({ prefill: 1, decode: 2, switchable: true, colocated: false, decodeSlots: 4, env: { PDSERVE_FAULT_ROLE_SWITCH_FILE: FAULT, PDSERVE_TEST_HOLDS: 'on' }, extraArgs: { router: ['--health-interval-ms', '300'] } });
    pd = client(c.router.url);
  });
  after(async () => {
    await c?.stop();
    rmSync(faultDir, { recursive: true, force: true });
  });

  test('a switch under load: 0 failed, verified, served in the new role; the last worker of a role is kept', async () => {
    const [p0] = c.byRole('prefill');
    const [, d1] = c.byRole('decode');
    // the only prefill: refused, nothing changed
    const floor = await switchVia(p0!.url, 'decode');
    assert.equal(floor.status, 409, JSON.stringify(floor.body));
    assert.equal(floor.body.error.code, 'role_switch_refused');
    assert.equal((await rowOf(p0!.url)).role, 'prefill');

    await holds('decode.step=15');
    const l = load(4, { promptChars: 60, maxTokens: 16 });
    try {
      await waitFor(async () => l.ok >= 4, 20_000);
      const epoch1 = (await getJson(`${d1!.url}/role`)).epoch;
      const a = await switchVia(d1!.url, 'prefill');
      assert.equal(a.status, 200, JSON.stringify(a.body));
      assert.equal(a.body.verified, true);
      assert.equal(a.body.role, 'prefill');
      assert.notEqual(a.body.epoch, epoch1, 'a new epoch');
      const role = await getJson(`${d1!.url}/role`);
      assert.deepEqual([role.role, role.state, role.epoch], ['prefill', 'serving', a.body.epoch]);
      assert.equal((await rowOf(d1!.url)).role, 'prefill');
      // now the old prefill may go: decode-1 is the only prefill left, every request's prefill runs on it
      const b = await switchVia(p0!.url, 'decode');
      assert.equal(b.status, 200, JSON.stringify(b.body));
      const before = l.ok;
      assert.ok(await waitFor(async () => l.ok >= before + 8, 20_000), 'requests keep completing after both switches');
    } finally {
      await l.stop();
      await holds('');
    }
    assert.deepEqual(l.failed, [], 'no request failed across two switches');
    assert.ok((await metric(d1!.url, 'pdserve_prefill_prompt_tokens_evaluated_total')) > 0, 'the switched worker evaluated prompts as prefill');
    const rows = await workers();
    assert.deepEqual(rows.map((w) => [w.role, w.healthy]).sort(), [['decode', true], ['decode', true], ['prefill', true]]);
  });

  test('a worker switched behind the router: its legs are refused (stale_epoch), the router stops routing to it, 0 failed', async () => {
    const [d0] = c.byRole('decode');
    const row = await rowOf(d0!.url);
    assert.equal(row.role, 'decode');
    const r = await fetch(`${d0!.url}/role`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ role: 'prefill', epoch: row.epoch }) });
    assert.equal(r.status, 200);
    // a leg the router picked it for as decode is refused before anything runs
    const stale = await fetch(`${d0!.url}/generate`, { method: 'POST', headers: { 'content-type': 'application/json', 'x-pdserve-role': 'decode' }, body: '{}' });
    assert.equal(stale.status, 503);
    assert.equal(((await stale.json()) as any).error.code, 'stale_epoch');
    const results = await Promise.all(Array.from({ length: 12 }, (_, i) => pd.completions.create({ model: 'pdserve', prompt: promptOf(40, i), max_tokens: 6, temperature: 0 }).then(() => 'ok', (e: Error) => e.message)));
    assert.deepEqual(results.filter((x) => x !== 'ok'), []);
    assert.ok(await waitFor(async () => !(await rowOf(d0!.url)).healthy, 3000), 'the router takes it out once a probe sees the other role');
    assert.match((await rowOf(d0!.url)).last_error ?? '', /role is "prefill"/);
    assert.equal(await metric(d0!.url, 'pdserve_prefill_prompt_tokens_evaluated_total'), 0, 'never routed as a prefill the router did not verify');
    // back as the router knows it: routable again after a probe
    const back = await fetch(`${d0!.url}/role`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ role: 'decode' }) });
    assert.equal(back.status, 200);
    assert.ok(await waitFor(async () => (await rowOf(d0!.url)).healthy, 5000));
  });

  test('a switch that fails midway goes back to its old role (safe_to_restore)', async () => {
    const [d0] = c.byRole('decode');
    const epoch = (await getJson(`${d0!.url}/role`)).epoch;
    writeFileSync(FAULT, 'build');
    try {
      const r = await switchVia(d0!.url, 'prefill');
      assert.equal(r.status, 503, JSON.stringify(r.body));
      assert.equal(r.body.error.code, 'role_switch_failed');
      assert.equal(r.body.safe_to_restore, true);
      assert.equal(r.body.role, 'decode');
    } finally {
      rmSync(FAULT, { force: true });
    }
    const role = await getJson(`${d0!.url}/role`);
    assert.deepEqual([role.role, role.state], ['decode', 'serving']);
    assert.notEqual(role.epoch, epoch, 'the rebuilt role has a new epoch');
    assert.ok(await waitFor(async () => { const w = await rowOf(d0!.url); return w.healthy && !w.draining && w.switching === null && w.role === 'decode'; }, 5000));
    const out = await pd.completions.create({ model: 'pdserve', prompt: 'Once upon a time', max_tokens: 4, temperature: 0 });
    assert.ok(out.choices[0]!.text.length > 0);
  });

  test('the planner flips a decode to prefill under a prefill-heavy load, and back under a decode-heavy one, within two ticks', async () => {
    const tickMs = 500;
    const planner = new Planner({ router: c.router.url, tickMs, log: createLogger('planner-test') });
    const roles = async () => (await workers()).filter((w) => w.healthy).map((w) => w.role).sort().join(',');
    assert.equal(await roles(), 'decode,decode,prefill');
    planner.start();
    const firstFlip = (recs: DecisionRecord[], action: string) => recs.findIndex((r) => r.action === action);
    try {
      // prefill-heavy: long prompts held in compute, 1 token each
      await holds('prefill.compute=600');
      let l = load(6, { promptChars: 600, maxTokens: 1 });
      try {
        assert.ok(await waitFor(async () => planner.recent.some((r) => r.action === 'to_prefill' && r.outcome === 'ok'), 15_000), `a verified flip to prefill: ${JSON.stringify(planner.recent.slice(-6))}`);
      } finally {
        await l.stop();
        await holds('');
      }
      const recs = [...planner.recent];
      const high = recs.findIndex((r) => (r.prefillLoad ?? 0) >= 1);
      assert.ok(high >= 0 && firstFlip(recs, 'to_prefill') - high <= 1, `flip within two ticks of the load: ${JSON.stringify(recs.map((r) => [r.action, r.reason, r.prefillLoad, r.decodeLoad]))}`);
      assert.deepEqual(l.failed, []);
      assert.equal(await roles(), 'decode,prefill,prefill');
      // decode-heavy: short prompts, long slow generations over the one decode's 4 slots
      const mark = planner.recent.length;
      await holds('decode.step=40');
      l = load(10, { promptChars: 20, maxTokens: 30 });
      try {
        assert.ok(await waitFor(async () => planner.recent.slice(mark).some((r) => r.action === 'to_decode' && r.outcome === 'ok'), 20_000), `a verified flip to decode: ${JSON.stringify(planner.recent.slice(-6))}`);
      } finally {
        await l.stop();
        await holds('');
      }
      const later = planner.recent.slice(mark);
      const busy = later.findIndex((r) => (r.decodeLoad ?? 0) > 1);
      assert.ok(busy >= 0 && firstFlip(later, 'to_decode') - busy <= 1, `flip within two ticks of the load: ${JSON.stringify(later.map((r) => [r.action, r.reason, r.prefillLoad, r.decodeLoad]))}`);
      assert.deepEqual(l.failed, []);
      assert.equal(await roles(), 'decode,decode,prefill');
      // every decision counted with its reason
      const text = await planner.registry.metrics();
      assert.match(text, /pdserve_planner_decisions_total\{action="to_prefill",reason="prefill_queue_high"\} 1/);
      assert.match(text, /pdserve_planner_decisions_total\{action="to_decode",reason="decode_kv_high"\} 1/);
      assert.match(text, /pdserve_planner_decisions_total\{action="hold",reason="change_in_flight"\}|pdserve_planner_decisions_total\{action="hold",reason="steady"\}/);
    } finally {
      await planner.stop();
    }
  });

  test('a switch whose rebuild fails too leaves the worker unhealthy, never routed; the others serve', async () => {
    // one of the two decodes (the other keeps serving)
    const target = (await workers()).find((w) => w.role === 'decode' && w.healthy)!;
    const from = target.role;
    writeFileSync(FAULT, 'both');
    try {
      const r = await switchVia(target.url, from === 'decode' ? 'prefill' : 'decode');
      assert.equal(r.status, 503, JSON.stringify(r.body));
      assert.equal(r.body.safe_to_restore, false);
    } finally {
      rmSync(FAULT, { force: true });
    }
    const row = await rowOf(target.url);
    assert.equal(row.healthy, false);
    assert.match(row.last_error ?? '', /role switch to .* failed/);
    assert.equal((await getJson(`${target.url}/role`)).state, 'failed');
    assert.equal((await fetch(`${target.url}/health`)).status, 503);
    const results = await Promise.all(Array.from({ length: 6 }, (_, i) => pd.completions.create({ model: 'pdserve', prompt: promptOf(30, i), max_tokens: 4, temperature: 0 }).then(() => 'ok', (e: Error) => e.message)));
    assert.deepEqual(results.filter((x) => x !== 'ok'), []);
  });
});
