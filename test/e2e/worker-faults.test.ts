/**
 * Worker faults on real processes (one stack: router + 1 prefill + 2 decode, tiny model, one
 * slot per decode), each checked by its whole kind:
 *  - a second live request with the same rid is refused with 400 on prefill and on decode;
 *  - 250k empty chat messages are refused before any per-message work; a large accepted chat
 *    is tokenized off prefill's event loop (its tokenizer thread) and served;
 *  - a client error (prompt over the context) is not booked as a worker failure;
 *  - decode fails a room it never registered (prealloc deadline, prealloc queue full) and
 *    prefill hears within 1 s — decode opens the KV connection to tell it;
 *  - a decode with another context size is shown as `mismatch` on GET /workers, is never
 *    dispatched to, and a direct pairing is refused in the handshake with one log line per side;
 *  - a decode of another protocol major (PDSERVE_TEST_PROTOCOL_VERSION=2.0): its build and
 *    protocol on /health and /workers, `mismatch` with the router, never dispatched to, a request
 *    of protocol 1.x refused 502 `protocol_mismatch`, its KV handshake with prefill refused
 *    naming the protocols, doctor's `protocol_mismatch` finding.
 * The KV stand-in prefill used to hold decode's only slot is a real KvServer in this process.
 */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { after, before, describe, test } from 'node:test';
import { newRoomId } from '../../src/base/room-id.js';
import { PROTOCOL_VERSION } from '../../src/base/version.js';
import { freePort, type Cluster, type ClusterProc } from '../../src/up/cluster.js';
import { newEpoch } from '../../src/kv/auth.js';
import { KvServer } from '../../src/kv/channel.js';
import { kvTransportOf } from '../../src/kv/transport.js';
import { loadInternalTls } from '../../src/security/tls.js';
import { settingsFromHealth } from '../../src/router/pair-settings.js';
import { CTX, getJson, startStack, waitFor } from '../helpers/stack.js';
import { cli } from '../helpers/cli.js';

const PREALLOC_MS = 800;
let c: Cluster;
let stand: KvServer;
let standPort = 0;

const post = (url: string, body: unknown, timeoutMs = 15_000) =>
  fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body), signal: AbortSignal.timeout(timeoutMs) });
const gen = (rid: string, room: string, port: number, over: Record<string, unknown> = {}) => ({
  rid,
  text: 'Once upon a time',
  sampling_params: { temperature: 0, max_new_tokens: 4 },
  bootstrap_host: '127.0.0.1',
  bootstrap_port: port,
  bootstrap_room: room,
  ...over,
});
const metricSum = async (p: ClusterProc, name: string, labels = ''): Promise<number> => {
  const text = await (await fetch(`${p.url}/metrics`)).text();
  let n = 0;
  for (const line of text.split('\n')) if (line.startsWith(name) && line.includes(labels) && !line.startsWith('#')) n += Number(line.split(' ').at(-1));
  return n;
};
const prefill = () => c.byRole('prefill')[0]!;
const liveRooms = async (p: ClusterProc): Promise<{ room: string; phase: string }[]> => (await getJson<any>(`${p.url}/debug/rooms`)).live;

before(async () => {
  // The stand-in's port is fixed up front: decode dials only bootstrap addresses it knows.
  standPort = await freePort();
  c = await startStack({
    colocated: false,
    prefill: 1,
    decode: 2,
    decodeSlots: 1,
    extraArgs: { decode: ['--prealloc-timeout-ms', String(PREALLOC_MS), '--max-prealloc', '1', '--allow-prefill', `127.0.0.1:${standPort}`], router: ['--health-interval-ms', '200'] },
  });
  // A prefill stand-in that accepts decode's REGISTER and never answers: it holds a decode slot.
  const d0 = c.byRole('decode')[0]!;
  // The cluster's KV transport (TLS in secure test mode, docs/TESTING.md).
  stand = new KvServer({ transport: kvTransportOf(loadInternalTls(c.opts.internalTls)), host: '127.0.0.1', port: standPort, secret: c.secret, epoch: newEpoch(), settings: settingsFromHealth((await getJson<any>(`${d0.url}/health`)).settings)! });
  await stand.listen();
});
after(async () => {
  await stand?.close();
  await c?.stop();
});

describe('worker faults', () => {
  test('d: a duplicate live rid is refused with 400 duplicate_rid on prefill and on decode; the first still aborts by rid', async () => {
    const p = prefill();
    const d1 = c.byRole('decode')[1]!;
    for (const w of [p, d1]) {
      const port = w === p ? p.bootstrapPort! : standPort;
      const first = post(`${w.url}/generate`, gen('dup-rid', newRoomId(), port)).catch(() => undefined);
      assert.ok(await waitFor(async () => (await liveRooms(w)).length === 1, 3000), `${w.name} holds the first request`);
      const second = await post(`${w.url}/generate`, gen('dup-rid', newRoomId(), port));
      assert.equal(second.status, 400, w.name);
      const j = await second.json();
      assert.equal(j.error.code, 'duplicate_rid');
      assert.equal(j.error.param, 'rid');
      await post(`${w.url}/abort_request`, { rid: 'dup-rid' });
      const r1 = await first;
      assert.equal(r1?.status, 499, `${w.name}: abort by rid stopped the one running request`);
      assert.ok(await waitFor(async () => (await liveRooms(w)).length === 0, 2000));
    }
  });

  test('e: 250k empty chat messages are refused with 400 before any per-message work, on the router and on prefill', async () => {
    const messages = Array.from({ length: 250_000 }, () => ({ role: 'user', content: '' }));
    const atPrefill = await post(`${prefill().url}/generate`, gen('many-msgs', newRoomId(), prefill().bootstrapPort!, { text: undefined, messages }));
    assert.equal(atPrefill.status, 400);
    assert.equal((await atPrefill.json()).error.code, 'request_too_large');
    // The router's body limit is 4 MiB: 120k empty messages fit under it.
    const atRouter = await post(`${c.router.url}/v1/chat/completions`, { model: 'pdserve', messages: messages.slice(0, 120_000), max_tokens: 4 });
    assert.equal(atRouter.status, 400);
    assert.equal((await atRouter.json()).error.code, 'request_too_large');
    assert.equal((await getJson<any>(`${prefill().url}/health`)).status, 'ok');
    // An accepted chat of many messages is templated and tokenized on prefill's tokenizer thread
    // (off its event loop) and served like any other.
    const many = Array.from({ length: 40 }, (_, i) => ({ role: i % 2 ? 'assistant' : 'user', content: `turn ${i}` }));
    const ok = await post(`${c.router.url}/v1/chat/completions`, { model: 'pdserve', messages: many, max_tokens: 4, temperature: 0 });
    assert.equal(ok.status, 200, await ok.clone().text());
    const body = await ok.json();
    assert.ok(body.usage.prompt_tokens > 40, `prompt tokens ${body.usage.prompt_tokens}`);
    assert.equal(typeof body.choices[0].message.content, 'string');
  });

  test('b: a prompt over the context is a client error: 400, and no worker books a failure for it', async (t) => {
    const decodes = c.byRole('decode');
    const workers = [...decodes, prefill()];
    // System faults on every worker: the failure counters and rooms ended with cause "system".
    const sys = async () => {
      let n = 0;
      for (const w of workers) {
        n += (await metricSum(w, 'pdserve_bootstrap_failed_total')) + (await metricSum(w, 'pdserve_kv_transfer_failed_total'));
        n += await metricSum(w, 'pdserve_rooms_terminal_total', 'cause="system"');
      }
      return n;
    };
    const onDecode = async (labels = '') => {
      let n = 0;
      for (const d of decodes) n += await metricSum(d, 'pdserve_rooms_terminal_total', labels);
      return n;
    };
    const recentOnDecode = async (): Promise<{ room: string; fail_reason?: string | null }[]> => (await Promise.all(decodes.map(async (d) => (await getJson<any>(`${d.url}/debug/rooms`)).recent))).flat();
    const known = new Set((await recentOnDecode()).map((r) => r.room));
    const [sys0, ended0, client0] = [await sys(), await onDecode(), await onDecode('cause="client"')];
    const r = await post(`${c.router.url}/v1/completions`, { model: 'pdserve', prompt: 'Once upon a time', max_tokens: CTX + 10 });
    assert.equal(r.status, 400);
    assert.equal((await r.json()).error.code, 'context_length_exceeded');
    // Whether decode creates a room for it depends on timing and routing: the router cancels the
    // decode leg once prefill answers 400 (its /generate may be cancelled before it is sent, or
    // meet the abort's tombstone), and a decode-local attempt is refused by decode itself before
    // any room exists. If decode created a room, it ends and must be booked as client-caused.
    const saw = await waitFor(async () => (await onDecode()) > ended0, 1500);
    for (const d of decodes) assert.ok(await waitFor(async () => (await liveRooms(d)).length === 0, 2000), `${d.name} holds no room`);
    const [ended, client] = [(await onDecode()) - ended0, (await onDecode('cause="client"')) - client0];
    t.diagnostic(saw ? `decode ended ${ended} room(s) for it, ${client} client-caused` : 'decode created no room for it (leg cancelled before it arrived, or refused before a room)');
    assert.equal(client, ended, 'every decode room that ended for it was booked as client-caused');
    // and names why: the router told decode that prefill refused it (not a client's cancel)
    const fresh = (await recentOnDecode()).filter((r) => !known.has(r.room));
    for (const r of fresh) assert.match(r.fail_reason ?? '', /^prefill_refused: prefill refused the request: 400 context_length_exceeded/, `room ${r.room}`);
    if (fresh.length > 0) t.diagnostic(`decode's reason: ${fresh[0]!.fail_reason}`);
    assert.equal(await sys(), sys0, 'no system-fault counter moved on any worker');
  });

  test('c: decode tells prefill about rooms it never registered (prealloc deadline, prealloc queue full); prefill frees them within 1 s', async () => {
    const p = prefill();
    const d0 = c.byRole('decode')[0]!;
    // Hold d0's only slot: a room registered with the stand-in, which never answers.
    const holder = newRoomId();
    const held = post(`${d0.url}/generate`, gen('holder', holder, standPort)).catch(() => undefined);
    assert.ok(await waitFor(async () => (await liveRooms(d0)).some((r) => r.room === holder && r.phase === 'bootstrap'), 3000), 'slot held');
    try {
      // Prealloc deadline: prefill has the room, decode never gets a slot for it.
      const r2 = newRoomId();
      const t0 = Date.now();
      const atPrefill = post(`${p.url}/generate`, gen('c-deadline', r2, p.bootstrapPort!), 30_000);
      const atDecode = post(`${d0.url}/generate`, gen('c-deadline', r2, p.bootstrapPort!), 30_000);
      const [pr, dr] = await Promise.all([atPrefill, atDecode]);
      const ms = Date.now() - t0;
      assert.equal(dr.status, 504);
      assert.equal((await dr.json()).error.code, 'room_deadline_expired');
      assert.equal(pr.status, 504, 'prefill answers with decode\'s code');
      assert.equal((await pr.json()).error.code, 'room_deadline_expired');
      assert.ok(ms < PREALLOC_MS + 1000, `prefill freed the room ${ms} ms after the request (decode's prealloc deadline ${PREALLOC_MS} ms + at most 1 s)`);
      assert.equal((await liveRooms(p)).length, 0);

      // Prealloc queue full (max 1): the refused request's room is failed on prefill at once.
      const r3 = newRoomId();
      const queued = post(`${d0.url}/generate`, gen('c-queued', r3, p.bootstrapPort!)).catch(() => undefined);
      assert.ok(await waitFor(async () => (await liveRooms(d0)).some((r) => r.room === r3 && r.phase === 'prealloc'), 2000), 'one request waits for a slot');
      const r4 = newRoomId();
      const t1 = Date.now();
      const atPrefill4 = post(`${p.url}/generate`, gen('c-full', r4, p.bootstrapPort!), 30_000);
      assert.ok(await waitFor(async () => (await liveRooms(p)).some((r) => r.room === r4), 2000));
      const full = await post(`${d0.url}/generate`, gen('c-full', r4, p.bootstrapPort!));
      assert.equal(full.status, 503);
      assert.equal((await full.json()).error.code, 'queue_full');
      const pr4 = await atPrefill4;
      assert.equal((await pr4.json()).error.code, 'queue_full');
      assert.ok(Date.now() - t1 < 1000, `prefill freed the refused room within 1 s (${Date.now() - t1} ms)`);
      await post(`${d0.url}/abort_request`, { rid: 'c-queued', bootstrap_room: r3 });
      await queued;
    } finally {
      await post(`${d0.url}/abort_request`, { rid: 'holder', bootstrap_room: holder });
      await held;
    }
    assert.ok(await waitFor(async () => (await liveRooms(p)).length === 0 && (await liveRooms(d0)).length === 0, 2000));
  });

  test('f: a decode with another context size is shown as mismatch, never dispatched to, and refused in the handshake with one log line per side', async () => {
    const p = prefill();
    const d1 = c.byRole('decode')[1]!;
    await c.kill(d1);
    d1.args.push('--ctx-size', String(CTX / 2));
    await c.spawn(d1);
    const row = async () => ((await getJson<any>(`${c.router.url}/workers`)).workers as any[]).find((w) => w.url === d1.url);
    assert.ok(await waitFor(async () => (await row())?.healthy === true && /settings mismatch/.test((await row())?.mismatch ?? ''), 5000), 'GET /workers shows the mismatch');
    assert.match((await row()).mismatch, new RegExp(`contextSize ${CTX / 2} ≠ ${CTX}`));
    // Every request goes to the matching pair.
    const before = await metricSum(d1, 'pdserve_rooms_terminal_total');
    for (let i = 0; i < 6; i++) {
      const r = await post(`${c.router.url}/v1/completions`, { model: 'pdserve', prompt: `pair ${i}`, max_tokens: 4, temperature: 0 });
      assert.equal(r.status, 200, `request ${i}`);
    }
    assert.equal(await metricSum(d1, 'pdserve_rooms_terminal_total'), before, 'the mismatched decode got no room');
    // Paired directly, the handshake refuses: a clear code, one log line on each side.
    const room = newRoomId();
    const atPrefill = post(`${p.url}/generate`, gen('f-direct', room, p.bootstrapPort!)).catch(() => undefined);
    const dr = await post(`${d1.url}/generate`, gen('f-direct', room, p.bootstrapPort!));
    assert.equal(dr.status, 502);
    assert.equal((await dr.json()).error.code, 'settings_mismatch');
    // (The pair cannot talk over KV, so prefill's room ends by its deadline or, here, the router's abort.)
    await post(`${p.url}/abort_request`, { rid: 'f-direct', bootstrap_room: room });
    assert.equal((await atPrefill)?.status, 499);
    const lines = (proc: ClusterProc) => readFileSync(proc.logFile!, 'utf8').split('\n').filter((l) => l.includes('kv pair refused'));
    assert.ok(await waitFor(async () => lines(p).length === 1 && lines(d1).length === 1, 2000), `one line each: prefill ${lines(p).length}, decode ${lines(d1).length}`);
    assert.match(lines(p)[0]!, /contextSize/);
  });
  test('g: a decode of another protocol major: build and protocol on /health and /workers, mismatch, never dispatched to, refused on /generate and in the handshake, named by doctor', async () => {
    const p = prefill();
    const d1 = c.byRole('decode')[1]!;
    await c.kill(d1);
    const i = d1.args.lastIndexOf('--ctx-size');
    if (i >= 0 && d1.args[i + 1] === String(CTX / 2)) d1.args.splice(i, 2); // case f's: the settings of its pair again, only the protocol differs
    process.env.PDSERVE_TEST_PROTOCOL_VERSION = '2.0';
    try {
      await c.spawn(d1);
    } finally {
      delete process.env.PDSERVE_TEST_PROTOCOL_VERSION;
    }
    const h = await getJson<any>(`${d1.url}/health`);
    assert.equal(h.protocol, '2.0');
    assert.match(h.build.id, /^\d+\.\d+\.\d+\+\S+$/);
    const rh = await getJson<any>(`${c.router.url}/health`);
    assert.equal(rh.protocol, PROTOCOL_VERSION);
    assert.equal(rh.build.id, h.build.id, 'one checkout: one build');
    const row = async () => ((await getJson<any>(`${c.router.url}/workers`)).workers as any[]).find((w) => w.url === d1.url);
    assert.ok(await waitFor(async () => (await row())?.healthy === true && (await row())?.protocol === '2.0', 5000), 'GET /workers has the probe');
    const r1 = await row();
    assert.equal(r1.build, h.build.id);
    assert.match(r1.mismatch, /^mismatch with the router: protocol 1\.\d+ ≠ 2\.0 \(another major\)/);
    const d0row = ((await getJson<any>(`${c.router.url}/workers`)).workers as any[]).find((w) => w.url === c.byRole('decode')[0]!.url);
    assert.equal(d0row.protocol, PROTOCOL_VERSION);
    assert.equal(d0row.mismatch, null);
    const before = await metricSum(d1, 'pdserve_rooms_terminal_total');
    for (let k = 0; k < 4; k++) {
      const r = await post(`${c.router.url}/v1/completions`, { model: 'pdserve', prompt: `proto ${k}`, max_tokens: 4, temperature: 0 });
      assert.equal(r.status, 200, `request ${k}`);
    }
    assert.equal(await metricSum(d1, 'pdserve_rooms_terminal_total'), before, 'the other-protocol decode got no room');
    // A request of protocol 1.x (what this router sends; an older router sends none): refused before anything runs.
    for (const protocol of [PROTOCOL_VERSION, undefined]) {
      const r = await post(`${d1.url}/generate`, gen('g-old', newRoomId(), p.bootstrapPort!, protocol ? { protocol } : {}));
      assert.equal(r.status, 502);
      const e = (await r.json()).error;
      assert.equal(e.code, 'protocol_mismatch');
      assert.match(e.message, /refuses a request of another protocol: protocol 2\.0 ≠ 1\.\d+/);
    }
    // Its own protocol, paired with prefill directly: the KV handshake refuses, naming the protocols.
    const room = newRoomId();
    const atPrefill = post(`${p.url}/generate`, gen('g-direct', room, p.bootstrapPort!)).catch(() => undefined);
    const dr = await post(`${d1.url}/generate`, gen('g-direct', room, p.bootstrapPort!, { protocol: '2.0' }));
    assert.equal(dr.status, 502);
    const de = (await dr.json()).error;
    assert.equal(de.code, 'settings_mismatch');
    assert.match(de.message, /protocol 2\.0 ≠ 1\.\d+ \(another major\), builds \S+ and \S+$/);
    assert.doesNotMatch(de.message, /contextSize/, 'only the protocol differs');
    await post(`${p.url}/abort_request`, { rid: 'g-direct', bootstrap_room: room });
    await atPrefill;
    const doc = await cli(['doctor', '--url', c.router.url, '--json'], 20_000, { PDSERVE_CLUSTER_SECRET: c.secret });
    const found = (JSON.parse(doc.out) as { findings: { kind: string; title: string }[] }).findings.filter((f) => f.kind === 'protocol_mismatch');
    assert.ok(found.some((f) => f.title.includes(d1.url) && /protocol 2\.0 ≠ 1\.\d+/.test(f.title)), `doctor names the decode: ${doc.out.slice(0, 1500)}`);
  });
});
