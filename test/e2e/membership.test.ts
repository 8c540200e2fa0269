/**
 * Membership on etcd with real processes: a throwaway etcd on loopback, 1 prefill + 2 decode
 * workers registering under 2 s leases, and a router given NO worker flags (etcd is its only
 * source) whose health poll is slowed to 10 s, so everything asserted here comes from the watch
 * (a second router, `router-1`, watches the same etcd):
 * - the records carry role, URLs, bootstrap address, fingerprint, engine settings and load;
 * - two routers (Cluster `routers: 2`) × 4 streams on two 4-slot decodes: each router counts the
 *   other's streams (the workers' GET /load), so no request waits for a slot while the other
 *   decode has one free and both decodes serve;
 * - a Response stored through one router is read, continued (`previous_response_id`) and deleted
 *   through the other;
 * - router A SIGKILLed mid-run: every keyed next turn through B succeeds and goes to the decode
 *   holding its cache (≥ 95 % of the sessions a decode holds, by its KV events); A restarted is
 *   routable with the workers' load within 1 s of ready;
 * - doctor --discovery names a router that stopped (SIGSTOP) as stale;
 * - behind nginx (OPERATIONS.md's config) with router A SIGKILLed under load, the openai SDK's own
 *   retries carry A's cut requests to B: 0 failed (skipped loudly without nginx; fails under CI=true);
 * - a per-key limit of 2 in flight holds across the two routers (last: it restarts them);
 * - a SIGKILLed worker restarted on its port is routable within 1 s of being ready;
 * - a SIGKILLed worker leaves the pool when its lease expires;
 * - `pdserve doctor --discovery` reads the same workers from etcd (with and without the router);
 * - etcd wiped and down past the lease TTL: the pool keeps the workers that answer, then converges
 *   to exactly the live registered workers within one TTL of etcd's return (a worker killed
 *   meanwhile leaves it);
 * - SIGTERM under load: the record says draining at once, the router stops choosing the worker,
 *   no request fails, the key is deleted when the drain ends.
 * Without an `etcd` binary (Debian's etcd-server) the suite says so loudly and skips (fails
 * under CI=true, where .ci/install-tools installs it).
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { Etcd3 } from 'etcd3';
import type { Cluster, ClusterProc } from '../../src/up/cluster.js';
import { MEMBER_PREFIX, memberKey, parseMemberRecord } from '../../src/membership/etcd.js';
import { etcdBinary, startEtcd, type TestEtcd } from '../helpers/etcd.js';
import { getJson, promptOf, startStack, waitFor } from '../helpers/stack.js';
import { cli } from '../helpers/cli.js';
import OpenAI from 'openai';
import { nginxBinary, startNginx } from '../helpers/nginx.js';

const TTL_S = 2;
/** Sequence slots per decode worker. */
const SLOTS = 4;
const HOLDS = 'decode.load=200';
const missing = etcdBinary() === null;
if (missing) {
  if (process.env.CI === 'true') throw new Error('etcd is not installed but CI=true: .ci/install-tools should have installed etcd-server');
  console.error('\n*** SKIPPED: etcd is not installed here (apt-get install etcd-server; .ci/install-tools does it). Membership tests did NOT run. ***\n');
}

const noNginx = !missing && nginxBinary() === null;
if (noNginx) {
  if (process.env.CI === 'true') throw new Error('nginx is not installed but CI=true: .ci/install-tools should have installed nginx-light');
  console.error('\n*** SKIPPED: nginx is not installed here (apt-get install nginx-light; .ci/install-tools does it). The load-balancer test did NOT run. ***\n');
}

let etcd: TestEtcd;
let c: Cluster;
let kv: Etcd3;

async function completion(prompt: string, maxTokens = 8, base = c.router.url): Promise<{ status: number; text: string }> {
  try {
    const r = await fetch(`${base}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'pdserve', prompt, max_tokens: maxTokens, temperature: 0, stream: true }), signal: AbortSignal.timeout(20_000) });
    return { status: r.status, text: await r.text() };
  } catch (err) {
    return { status: 0, text: String(err) };
  }
}
const ok = (r: { status: number; text: string }) => r.status === 200 && /data: \[DONE\]/.test(r.text) && !/"error"/.test(r.text);
/** POST JSON to `url`: status and body (null when not JSON); never rejects. */
async function post(url: string, body: unknown, timeoutMs = 20_000): Promise<{ status: number; body: any }> {
  try {
    const r = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body), signal: AbortSignal.timeout(timeoutMs) });
    const text = await r.text();
    let j: any = null;
    try {
      j = JSON.parse(text);
    } catch {
      j = { text };
    }
    return { status: r.status, body: j };
  } catch (err) {
    return { status: 0, body: { error: String(err) } };
  }
}
/** One greedy chat round of session `user` through `base`. */
const chat = (base: string, user: string, messages: { role: string; content: string }[]) => post(`${base}/v1/chat/completions`, { model: 'pdserve', messages, max_tokens: 6, temperature: 0, user });
/** Decode picks of router `base` by reason. */
const picks = async (base: string, reason: string): Promise<number> => {
  const text = await (await fetch(`${base}/metrics`, { signal: AbortSignal.timeout(2000) })).text();
  return Number(new RegExp(`^pdserve_router_policy_picks_total\\{role="decode",policy="cache_aware",reason="${reason}"\\} (\\S+)$`, 'm').exec(text)?.[1] ?? 0);
};
const workers = async () => (await getJson<any>(`${c.router.url}/workers`)).workers as any[];
const routable = async (url: string) => (await workers()).some((w) => w.url === url && w.healthy && !w.draining);
const listed = async (url: string) => (await workers()).some((w) => w.url === url);
/** KV event streams the router opened on a worker for the first time (one per followed worker process it had no stream of). */
const firstStreams = async (): Promise<number> => {
  const text = await (await fetch(`${c.router.url}/metrics`, { signal: AbortSignal.timeout(2000) })).text();
  return Number(/^pdserve_router_kv_resyncs_total\{reason="first"\} (\S+)$/m.exec(text)?.[1] ?? 0);
};
const record = async (p: ClusterProc) => {
  const v = await kv.get(memberKey(p.role, p.url)).string();
  return v === null ? null : parseMemberRecord(v);
};

describe('membership on etcd', { skip: missing ? 'etcd is not installed (see the message above)' : false }, () => {
  before(async () => {
    etcd = await startEtcd();
    kv = new Etcd3({ hosts: etcd.clientUrl });
    c = await startStack({
      colocated: false,
      prefill: 1,
      decode: 2,
      decodeSlots: SLOTS,
      routers: 2,
      discovery: etcd.uri,
      staticWorkers: false,
      extraArgs: { prefill: ['--discovery-ttl-s', String(TTL_S)], decode: ['--discovery-ttl-s', String(TTL_S)], router: ['--health-interval-ms', '10000', '--decode-policy', 'cache_aware'] },
      env: { PDSERVE_TEST_HOLDS: HOLDS },
    });
  });
  after(async () => {
    await c?.stop();
    kv?.close();
    await etcd?.stop();
  });

  test('workers register full records; the router (no worker flags) serves through them', async () => {
    const p = c.byRole('prefill')[0]!;
    const rec = await record(p);
    assert.ok(rec, 'prefill record present');
    assert.equal(rec.role, 'prefill');
    assert.equal(rec.url, p.url);
    assert.equal(rec.bootstrap_port, p.bootstrapPort);
    assert.equal(rec.bootstrap_host, '127.0.0.1');
    assert.match(String(rec.fingerprint), /^[0-9a-f]{16,}$/);
    assert.equal(rec.engine.ctx_size, 1024);
    assert.equal(rec.draining, false);
    assert.equal(typeof rec.load.slots_free, 'number');
    const all = await kv.getAll().prefix(MEMBER_PREFIX).strings();
    const keys = Object.keys(all);
    assert.equal(keys.length, 3, `one key per worker: ${keys.join(', ')}`);
    for (const s of [c.secret, ...c.access.apiKeys, ...c.access.adminApiKeys]) assert.ok(!JSON.stringify(all).includes(s), 'no etcd record holds the cluster secret or a key');
    assert.ok(await waitFor(async () => (await workers()).filter((w) => w.healthy).length === 3, 5000), 'the router found all three');
    for (let i = 0; i < 4; i++) assert.ok(ok(await completion(promptOf(24, i))), 'requests succeed');
    // every worker that joined through etcd has its KV event stream followed from the join
    assert.ok(await waitFor(async () => (await firstStreams()) === 3, 5000), `KV event streams: ${await firstStreams()} of 3`);
  });

  test('two routers × 4 streams on two decodes: no request waits for a slot while a decode has one free', async (t) => {
    const routers = c.byRole('router');
    const decodes = c.byRole('decode');
    assert.equal(routers.length, 2);
    for (const r of routers) assert.ok(await waitFor(async () => ((await getJson<any>(`${r.url}/workers`)).workers as any[]).filter((w) => w.healthy).length === 3, 5000), `${r.name} found all three`);
    const holds = (spec: string) => Promise.all(decodes.map((d) => fetch(`${d.url}/debug/test-holds`, { method: 'POST', body: spec, signal: AbortSignal.timeout(2000) })));
    await holds(`${HOLDS},decode.step=150`); // each stream generates for about 2.5 s
    const samples: { rooms: number; slots: number }[][] = [];
    let sampling = true;
    const sampler = (async () => {
      while (sampling) {
        samples.push(await Promise.all(decodes.map(async (d) => getJson<{ rooms: number; slots: number }>(`${d.url}/load`))));
        await new Promise((r) => setTimeout(r, 15));
      }
    })();
    const results: Promise<{ status: number; text: string }>[] = [];
    const lags: number[] = [];
    // Decode load as router r sees it: its own in-flight requests plus the others' the workers report.
    const seen = async (r: ClusterProc) => ((await getJson<any>(`${r.url}/workers`)).workers as any[]).filter((w) => w.role === 'decode').reduce((n, w) => n + w.load + w.others_load, 0);
    try {
      // Through A, B, A, B, …, each sent once both routers see every earlier stream (a pick within
      // one round trip of another router's is the documented race, not this bar).
      for (let i = 0; i < 8; i++) {
        const t0 = Date.now();
        assert.ok(await waitFor(async () => (await seen(routers[0]!)) >= i && (await seen(routers[1]!)) >= i, 3000, 10), `both routers see the ${i} streams sent so far`);
        lags.push(Date.now() - t0);
        results.push(completion(promptOf(24, 300 + 11 * i), 16, routers[i % 2]!.url));
      }
    } finally {
      await Promise.allSettled(results);
      sampling = false;
      await sampler;
      await holds(HOLDS);
    }
    t.diagnostic(`ms until both routers saw the streams sent before: ${lags.join(', ')}`);
    assert.deepEqual((await Promise.all(results)).filter((r) => !ok(r)).map((r) => `${r.status} ${r.text.slice(0, 200)}`), [], 'every stream succeeds');
    const slots = samples[0]![0]!.slots;
    assert.equal(slots, SLOTS, 'each decode has SLOTS sequence slots');
    // a request waits for a slot on a decode (its rooms exceed its slots) while the other has a free one
    const waited = samples.filter((s) => s.some((x) => x.rooms > x.slots) && s.some((x) => x.rooms < x.slots));
    const most = decodes.map((_, i) => Math.max(...samples.map((s) => s[i]!.rooms)));
    t.diagnostic(`${samples.length} samples; most rooms per decode: ${most.join(', ')} (slots ${slots}); samples with a request waiting while a slot was free: ${waited.length}`);
    assert.deepEqual(waited, [], 'no request waited for a slot while the other decode had one free');
    assert.ok(most.every((n) => n > 0), `both decodes served (most rooms ${most.join(', ')})`);
  });

  test('a Response stored through one router is read, continued and deleted through the other', async () => {
    const [b, a] = c.byRole('router');
    const first = await post(`${a!.url}/v1/responses`, { model: 'pdserve', input: promptOf(20, 500), max_output_tokens: 6, temperature: 0 });
    assert.equal(first.status, 200, JSON.stringify(first.body));
    const id = first.body.id as string;
    const read = await getJson<any>(`${b!.url}/v1/responses/${id}`);
    assert.equal(read.id, id, 'read through the other router');
    assert.deepEqual(read.output, first.body.output, 'the same Response');
    const next = await post(`${b!.url}/v1/responses`, { model: 'pdserve', previous_response_id: id, input: 'and then', max_output_tokens: 6, temperature: 0 });
    assert.equal(next.status, 200, `previous_response_id through the other router: ${JSON.stringify(next.body)}`);
    assert.ok(next.body.usage.input_tokens > first.body.usage.input_tokens, 'the continuation carries the first exchange');
    assert.equal((await getJson<any>(`${a!.url}/v1/responses/${next.body.id}`)).id, next.body.id, 'and the continuation is read back through the first');
    const del = await fetch(`${a!.url}/v1/responses/${id}`, { method: 'DELETE', signal: AbortSignal.timeout(2000) });
    assert.equal(del.status, 200);
    assert.ok(await waitFor(async () => (await fetch(`${b!.url}/v1/responses/${id}`, { signal: AbortSignal.timeout(2000) })).status === 404, 2000), 'deleted through one router: gone through the other');
  });

  test('router A SIGKILLed mid-run: keyed next turns through B reach the worker holding their cache, none fails; A restarted is routable with the shared state within 1 s', async (t) => {
    const [b, a] = c.byRole('router');
    const decodes = c.byRole('decode');
    // 8 sessions: the two decodes keep up to 4 finished conversations each (--prefix-cache-slots);
    // prompts of several deterministic chunks, so that a kept sequence counts as held
    const N = 8;
    const sessions = Array.from({ length: N }, (_, i) => ({ user: `mk-${i}`, messages: [{ role: 'user', content: promptOf(400, 700 + 13 * i) }] as { role: string; content: string }[] }));
    // round 1 through A, four at a time
    for (let i = 0; i < N; i += 4) {
      const rs = await Promise.all(sessions.slice(i, i + 4).map((s) => chat(a!.url, s.user, s.messages)));
      rs.forEach((r, k) => {
        assert.equal(r.status, 200, JSON.stringify(r.body));
        sessions[i + k]!.messages.push({ role: 'assistant', content: r.body.choices[0].message.content }, { role: 'user', content: 'go on' });
      });
    }
    // mid-run: four next turns in flight through A when it is SIGKILLed (A's own clients see it fail)
    await Promise.all(decodes.map((d) => fetch(`${d.url}/debug/test-holds`, { method: 'POST', body: `${HOLDS},decode.step=100`, signal: AbortSignal.timeout(2000) })));
    const inflight = sessions.slice(0, 4).map((s) => chat(a!.url, s.user, s.messages));
    await new Promise((r) => setTimeout(r, 300));
    await c.kill(a!);
    await Promise.allSettled(inflight);
    await Promise.all(decodes.map((d) => fetch(`${d.url}/debug/test-holds`, { method: 'POST', body: HOLDS, signal: AbortSignal.timeout(2000) })));
    // sessions a decode holds now, by its own KV events
    const heldKeys = new Set<string>();
    for (const d of decodes) for (const e of ((await getJson<any>(`${d.url}/kv_events?after=-1`)).snapshot ?? []) as { tier: string; key: string }[]) if (e.tier === 'sequence') heldKeys.add(e.key);
    const held0 = await picks(b!.url, 'cache_hit');
    const rs = await Promise.all(sessions.map((s) => chat(b!.url, s.user, s.messages)));
    const held = (await picks(b!.url, 'cache_hit')) - held0;
    const failed = rs.filter((r) => r.status !== 200).map((r) => `${r.status} ${JSON.stringify(r.body).slice(0, 200)}`);
    t.diagnostic(`${N} next turns through B after A was killed: ${N - failed.length} ok, ${held} sent to the decode holding their cache, of ${heldKeys.size} sessions a decode held`);
    assert.deepEqual(failed, [], 'no next turn through B failed');
    assert.ok(heldKeys.size >= 3, `decodes held ${heldKeys.size} of ${N} sessions`);
    assert.ok(held >= Math.ceil(0.95 * heldKeys.size), `${held} of ${heldKeys.size} held sessions reached their worker (≥ 95 %)`);
    // A comes back: routable, with the workers' load and the other routers' shards, within 1 s of ready
    await c.spawn(a!);
    const t0 = Date.now();
    assert.ok(
      await waitFor(async () => {
        const ws = (await getJson<any>(`${a!.url}/workers`)).workers as any[];
        const me = Object.values(await kv.getAll().prefix('pdserve/v1/routers/').strings()).map((v) => JSON.parse(v)).find((p) => p.url === a!.url);
        return ws.filter((w) => w.healthy).length === 3 && me?.view.load_age_ms !== null && me?.view.load_age_ms !== undefined;
      }, 3000, 10),
      'restarted router routable with load readings',
    );
    const ms = Date.now() - t0;
    t.diagnostic(`restarted router A routable with shared state ${ms} ms after ready`);
    assert.ok(ms < 1000, `routable ${ms} ms after ready`);
    const heldA = await picks(a!.url, 'cache_hit');
    const again = await Promise.all(sessions.slice(4, 8).map((s) => chat(a!.url, s.user, s.messages)));
    assert.deepEqual(again.map((r) => r.status), [200, 200, 200, 200]);
    t.diagnostic(`then through A: ${(await picks(a!.url, 'cache_hit')) - heldA} of 4 next turns sent to a decode holding their cache`);
  });

  test('doctor --discovery names a router whose view is stale', async () => {
    const [, a] = c.byRole('router');
    c.signal(a!, 'SIGSTOP');
    try {
      await new Promise((r) => setTimeout(r, 3500));
      const d = await cli(['doctor', '--discovery', etcd.uri, '--json'], 20_000, { PDSERVE_CLUSTER_SECRET: c.secret });
      const j = JSON.parse(d.out) as { findings: { kind: string; title: string }[] };
      const stale = j.findings.filter((f) => f.kind === 'router_stale');
      assert.equal(stale.length, 1, JSON.stringify(j.findings));
      assert.ok(stale[0]!.title.includes(a!.url), `the stopped router is named: ${stale[0]!.title}`);
    } finally {
      c.signal(a!, 'SIGCONT');
    }
    assert.ok(await waitFor(async () => {
      const d = await cli(['doctor', '--discovery', etcd.uri, '--json'], 20_000, { PDSERVE_CLUSTER_SECRET: c.secret });
      return !(JSON.parse(d.out) as { findings: { kind: string }[] }).findings.some((f) => f.kind === 'router_stale');
    }, 8000, 200), 'fresh again once it runs');
  });

  test('behind nginx: router A SIGKILLed under load, the openai SDK\'s own retries carry its clients over, 0 failed', { skip: noNginx ? 'nginx is not installed (see the message above)' : false }, async (t) => {
    const [b, a] = c.byRole('router');
    const lb = await startNginx([b!.url, a!.url]);
    // answers of 5xx the SDK saw (and retried): A's requests in flight when it died come back 502 from nginx
    let retried = 0;
    const sdk = new OpenAI({
      baseURL: `${lb.url}/v1`,
      apiKey: 'none',
      maxRetries: 3,
      timeout: 20_000,
      fetch: async (url: any, init: any) => {
        const r = await fetch(url, init);
        if (r.status >= 500) retried++;
        return r;
      },
    });
    const decodes = c.byRole('decode');
    const holds = (spec: string) => Promise.all(decodes.map((d) => fetch(`${d.url}/debug/test-holds`, { method: 'POST', body: spec, signal: AbortSignal.timeout(2000) })));
    await holds(`${HOLDS},decode.step=100`); // each request takes about a second: some are in flight through A when it dies
    let running = true;
    const outcomes: string[] = [];
    try {
      const loops = Array.from({ length: 4 }, async (_, k) => {
        for (let i = 0; running; i++) {
          try {
            const r = await sdk.chat.completions.create({ model: 'pdserve', messages: [{ role: 'user', content: promptOf(40, 1000 + 31 * k + i) }], max_tokens: 6, temperature: 0, user: `lb-${k}` });
            outcomes.push(r.choices[0]?.message ? 'ok' : 'empty');
          } catch (err) {
            outcomes.push(`failed: ${(err as Error).message}`);
          }
        }
      });
      await new Promise((r) => setTimeout(r, 2500));
      const before = outcomes.length;
      await c.kill(a!);
      await new Promise((r) => setTimeout(r, 3000));
      running = false;
      await Promise.all(loops);
      const failed = outcomes.filter((o) => o !== 'ok');
      t.diagnostic(`${outcomes.length} requests through nginx (${before} before A was killed), ${retried} answers of 5xx retried by the SDK, ${failed.length} failed`);
      assert.ok(outcomes.length - before >= 4, `load went on after the kill (${outcomes.length - before})`);
      assert.ok(retried >= 1, 'requests in flight through A were cut by the kill and retried');
      assert.deepEqual(failed, [], 'no request failed: the SDK retried what A dropped, nginx sent it to B');
    } finally {
      running = false;
      await holds(HOLDS);
      await lb.stop();
      if (a!.child?.exitCode !== null || a!.child?.signalCode !== null) await c.spawn(a!);
    }
  });

  test('pdserve doctor --discovery reads the same workers from etcd and finds nothing wrong', async () => {
    const both = await cli(['doctor', '--discovery', etcd.uri, '--url', c.router.url, '--json'], 20_000, { PDSERVE_CLUSTER_SECRET: c.secret });
    const j = JSON.parse(both.out) as { exit_code: number; source: string; summary: string; findings: { kind: string; severity: string }[] };
    assert.equal(both.code, 0, both.out + both.err);
    assert.match(j.source, /^etcd etcd:\/\/.* \+ router http/);
    assert.match(j.summary, /1 prefill · 2 decode/);
    assert.ok(!j.findings.some((f) => f.kind === 'membership'), JSON.stringify(j.findings));
    const etcdOnly = await cli(['doctor', '--discovery', etcd.uri, '--json'], 20_000, { PDSERVE_CLUSTER_SECRET: c.secret });
    assert.equal(etcdOnly.code, 0, etcdOnly.out + etcdOnly.err);
    assert.match(JSON.parse(etcdOnly.out).summary, /no router · 1 prefill · 2 decode/);
  });

  test('a restarted worker is routable within 1 s of being ready (push, not the 10 s poll)', async (t) => {
    const d = c.byRole('decode')[0]!;
    await c.kill(d);
    await c.spawn(d); // resolves when the process says ready
    const t0 = Date.now();
    assert.ok(await waitFor(() => routable(d.url), 3000, 10), 'routable again');
    const ms = Date.now() - t0;
    t.diagnostic(`restarted decode routable ${ms} ms after ready`);
    assert.ok(ms < 1000, `routable ${ms} ms after ready`);
    assert.ok(ok(await completion(promptOf(30, 3))));
  });

  test('a killed worker leaves the pool when its lease expires', async (t) => {
    const d = c.byRole('decode')[1]!;
    await c.kill(d);
    const t0 = Date.now();
    assert.ok(await waitFor(async () => !(await listed(d.url)), TTL_S * 1000 + 4000, 50), 'removed from the router pool');
    const ms = Date.now() - t0;
    t.diagnostic(`killed decode removed ${ms} ms after the kill (TTL ${TTL_S} s)`);
    assert.ok(ms <= TTL_S * 1000 + 3000, `removed ${ms} ms after the kill (TTL ${TTL_S} s)`);
    assert.equal(await record(d), null, 'its key is gone');
    for (let i = 0; i < 3; i++) assert.ok(ok(await completion(promptOf(20, 10 + i))), 'the rest serves');
    const streams = await firstStreams();
    await c.spawn(d);
    assert.ok(await waitFor(() => routable(d.url), 1000, 10), 'back within 1 s of ready');
    // the leave dropped its stream; the join opens a new one
    assert.ok(await waitFor(async () => (await firstStreams()) === streams + 1, 5000), 'the rejoined worker is followed again');
  });

  test('etcd wiped and down past the lease TTL: the serving workers stay in the pool; after its return the pool is exactly the live registered workers within one TTL', async (t) => {
    const [p] = c.byRole('prefill');
    const [d0, d1] = c.byRole('decode');
    const urls = async () => (await workers()).map((w) => w.url).sort();
    assert.deepEqual(await urls(), [p!.url, d0!.url, d1!.url].sort());
    await etcd.stop(); // and its data: it comes back empty
    await c.kill(d1!); // dies while etcd is away: it must leave the pool once etcd answers again
    const outage = Date.now();
    while (Date.now() - outage < TTL_S * 1000 + 1500) {
      assert.ok((await urls()).includes(p!.url) && (await urls()).includes(d0!.url), 'the workers that answer stay in the pool while etcd is away');
      assert.ok(ok(await completion(promptOf(20, 40))), 'and serve');
      await new Promise((r) => setTimeout(r, 300));
    }
    etcd = await startEtcd({ ports: etcd.ports });
    const back = Date.now();
    const healed = await waitFor(async () => {
      const ws = await workers();
      return JSON.stringify(ws.map((w) => w.url).sort()) === JSON.stringify([p!.url, d0!.url].sort()) && ws.every((w) => w.healthy) && Object.keys(await kv.getAll().prefix(MEMBER_PREFIX).strings()).length === 2;
    }, TTL_S * 1000 + 4000, 50);
    const ms = Date.now() - back;
    t.diagnostic(`pool = the live registered workers ${ms} ms after etcd returned (TTL ${TTL_S} s)`);
    assert.ok(healed, `healed: ${JSON.stringify(await workers())}`);
    assert.ok(ms <= TTL_S * 1000 + 2000, `within one TTL (+ the 2 s re-list): ${ms} ms`);
    for (let i = 0; i < 3; i++) assert.ok(ok(await completion(promptOf(20, 50 + i))), 'requests succeed');
    await c.spawn(d1!);
    assert.ok(await waitFor(() => routable(d1!.url), 3000, 10), 'the restarted worker registers and is routable');
  });

  test('SIGTERM under load: draining is pushed at once, no request fails, the key is deleted', async (t) => {
    const d = c.byRole('decode')[0]!;
    let running = true;
    const results: { status: number; text: string }[] = [];
    const loops = Array.from({ length: 4 }, async (_, k) => {
      for (let i = 0; running; i++) results.push(await completion(promptOf(22, 100 * k + i)));
    });
    try {
      await new Promise((r) => setTimeout(r, 600));
      await fetch(`${d.url}/debug/test-holds`, { method: 'POST', body: 'decode.load=1500' });
      const exited = new Promise<number | null>((r) => d.child!.once('exit', (code) => r(code)));
      c.signal(d, 'SIGTERM');
      const t0 = Date.now();
      assert.ok(await waitFor(async () => (await record(d))?.draining === true || (await record(d)) === null, 2000, 10), 'the record says draining');
      assert.ok(await waitFor(async () => (await workers()).some((w) => w.url === d.url && w.draining) || !(await listed(d.url)), 1000, 10), 'the router stopped choosing it');
      t.diagnostic(`router knew of the drain ${Date.now() - t0} ms after SIGTERM`);
      assert.ok(Date.now() - t0 < 1000, `router knew within ${Date.now() - t0} ms (its poll is 10 s)`);
      assert.equal(await exited, 0);
      assert.equal(await record(d), null, 'key deleted after the drain');
      assert.ok(await waitFor(async () => !(await listed(d.url)), 1000, 10), 'and the worker left the pool');
      await new Promise((r) => setTimeout(r, 500));
    } finally {
      running = false;
      await Promise.all(loops);
    }
    t.diagnostic(`${results.length} requests under load during the drain, ${results.filter((r) => !ok(r)).length} failed`);
    assert.ok(results.length >= 8, `load ran (${results.length})`);
    assert.deepEqual(results.filter((r) => !ok(r)).map((r) => `${r.status} ${r.text.slice(0, 200)}`), [], 'no request failed');
  });
  test('a per-key limit of 2 in flight holds across the two routers', async (t) => {
    const routers = c.byRole('router');
    const [b, a] = routers;
    for (const r of routers) {
      await c.kill(r);
      r.args.push('--key-max-concurrent', '2');
      await c.spawn(r);
    }
    const d = c.byRole('decode').find((x) => x.child && x.child.exitCode === null)!;
    const shards = async () => Object.values(await kv.getAll().prefix('pdserve/v1/admission/').strings()).reduce((n, v) => n + (JSON.parse(v).inflight as number), 0);
    await fetch(`${d.url}/debug/test-holds`, { method: 'POST', body: `${HOLDS},decode.step=150`, signal: AbortSignal.timeout(2000) });
    try {
      // two in flight through A (the same client key: this process's address)
      const long = [0, 1].map((i) => completion(promptOf(20, 900 + i), 16, a!.url));
      assert.ok(await waitFor(async () => (await shards()) === 2, 5000, 10), 'A published its shard: 2 in flight');
      const more = await Promise.all([completion(promptOf(20, 910), 4, b!.url), completion(promptOf(20, 911), 4, b!.url), completion(promptOf(20, 912), 4, a!.url)]);
      t.diagnostic(`while 2 were in flight through A: ${more.map((r) => r.status).join(', ')} (B, B, A)`);
      assert.deepEqual(more.map((r) => r.status), [429, 429, 429], 'a third request of the key is refused through either router');
      assert.match(more[0]!.text, /across the routers/);
      assert.ok((await Promise.all(long)).every(ok), 'the two admitted ones finish');
      assert.ok(await waitFor(async () => (await shards()) === 0, 5000, 10), 'and their shard says 0');
      assert.ok(ok(await completion(promptOf(20, 913), 4, b!.url)), 'then the key is admitted through B again');
    } finally {
      await fetch(`${d.url}/debug/test-holds`, { method: 'POST', body: HOLDS, signal: AbortSignal.timeout(2000) });
    }
  });
});
