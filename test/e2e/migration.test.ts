/**
 * Migration on real processes (2 prefill + 2 decode, --deterministic, the tiny model, the real
 * openai client): a worker SIGKILLed at a chosen point of a request costs the client nothing —
 * a retry before its first token, a migration (prompt + the tokens it has, to another pair) after
 * — and every greedy answer equals the colocated reference, token for token.
 *  - decode killed mid-stream, during the handoff (after token 1 from prefill), before token 1;
 *    `pdserve doctor --request` on the migrated request shows both attempts;
 *  - prefill killed before token 1 and after it (mid-transfer);
 *  - a JSON-schema chat request migrated mid-object: the same valid JSON;
 *  - n = 2 with a choice migrated;
 *  - decode killed mid-stream while the other decode holds the conversation: migrated decode-local;
 *  - a decode with the wrong cluster secret never enters the rotation, no request lost;
 *  - a decode SIGSTOPped mid-stream: after the router's silence bound the stream migrates, the
 *    worker is marked frozen and doctor names it;
 *  - an operator's abort (the router's POST /abort_request, or a signed one straight to the decode)
 *    ends the request with request_aborted: never a migration;
 *  - the migration limit reached: a clear error naming the last cause, nothing left held.
 * The kill points are reached with test holds (src/runtime/testhooks.ts: `decode.step` slows
 * generation, `decode.load` / `prefill.compute` / `prefill.send` stop a room in its phase), not
 * with timing. Each killed worker is started again before the next test.
 */
import assert from 'node:assert/strict';
import { spawn, type ChildProcess } from 'node:child_process';
import { describe, test } from 'node:test';
import { BIN, freePort, type ClusterProc } from '../../src/up/cluster.js';
import { busy, client, CTX, getJson, promptOf, tinyModel, useStack, waitFor } from '../helpers/stack.js';
import { cli } from '../helpers/cli.js';

// --leg-silence-timeout-ms 3000: a frozen decode (SIGSTOP) is given up after 3 s of silence
const SILENCE_MS = 3000;
const s = useStack({ prefill: 2, decode: 2, env: { PDSERVE_TEST_HOLDS: 'on' }, extraArgs: { router: ['--health-interval-ms', '200', '--leg-silence-timeout-ms', String(SILENCE_MS)] } });

const setHold = (p: ClusterProc, spec: string) => fetch(`${p.url}/debug/test-holds`, { method: 'POST', headers: { 'content-type': 'text/plain' }, body: spec }).then((r) => r.body?.cancel());
const workers = () => s.c.procs.filter((p) => p.role === 'prefill' || p.role === 'decode');
const clearHolds = () => Promise.all(workers().filter((p) => p.child).map((p) => setHold(p, '')));
const trace = (id: string) => getJson<any>(`${s.c.router.url}/debug/traces/${encodeURIComponent(id)}`);
const procOf = (url: string) => s.c.procs.find((p) => p.url === url)!;
const migrations = async () => {
  const text = await (await fetch(`${s.c.router.url}/metrics`)).text();
  let n = 0;
  for (const m of text.matchAll(/^pdserve_router_(?:migrations|retries)_total\{reason="([^"]+)",outcome="([^"]+)"\} (\d+)/gm)) n += Number(m[3]);
  return n;
};

/** Kill `p`, clear the holds of the others (the next attempt runs unheld), start `p` again and wait until the router routes to it. */
async function killAndRestart(p: ClusterProc): Promise<void> {
  await s.c.kill(p);
  await clearHolds();
  await s.c.spawn(p);
  assert.ok(await waitFor(async () => ((await getJson<any>(`${s.c.router.url}/workers`)).workers as any[]).filter((w) => w.healthy).length === 4, 15_000), 'the restarted worker is routable');
}

/** A streamed greedy completion; `onChunk(i, rid)` runs after chunk i arrived (awaited). */
async function streamed(prompt: string, maxTokens: number, onChunk: (i: number, rid: string) => Promise<void>): Promise<{ text: string; usage: any; rid: string }> {
  const { data, response } = await s.pd.completions.create({ model: 'pdserve', prompt, max_tokens: maxTokens, temperature: 0, stream: true, stream_options: { include_usage: true } }).withResponse();
  const rid = response.headers.get('x-request-id')!;
  let text = '';
  let usage: any = null;
  let i = 0;
  for await (const c of data) {
    text += c.choices[0]?.text ?? '';
    if (c.usage) usage = c.usage;
    if (c.choices.length) await onChunk(i++, rid);
  }
  return { text, usage, rid };
}

async function reference(prompt: string, maxTokens: number) {
  const r = await s.ref.completions.create({ model: 'pdserve', prompt, max_tokens: maxTokens, temperature: 0 });
  return { text: r.choices[0]!.text, usage: r.usage! };
}

let migrated: { rid: string; trace: any } | undefined;

describe('a worker killed mid-request costs the client nothing', () => {
  test('decode SIGKILLed mid-stream: the stream continues on the other pair, equal to colocated, usage once', async () => {
    const prompt = promptOf(60, 1);
    const ref = await reference(prompt, 40);
    for (const d of s.c.byRole('decode')) await setHold(d, 'decode.step=25');
    const before = await migrations();
    let killing: Promise<void> | null = null;
    const got = await streamed(prompt, 40, async (i, rid) => {
      if (i !== 8) return;
      const t = await trace(rid);
      killing = killAndRestart(procOf(t.decode));
    });
    await killing;
    await clearHolds();
    assert.equal(got.text, ref.text);
    assert.equal(got.usage.completion_tokens, ref.usage.completion_tokens);
    assert.equal(got.usage.prompt_tokens, ref.usage.prompt_tokens);
    const t = await trace(got.rid);
    assert.equal(t.outcome, 'ok');
    const failed = t.events.filter((e: any) => e.what === 'attempt_failed');
    assert.equal(failed.length, 1, JSON.stringify(t.events));
    assert.equal(failed[0].next, 'migrate');
    assert.ok(failed[0].tokens_sent >= 9, `tokens the client had: ${failed[0].tokens_sent}`);
    assert.equal(t.rooms.length, 2);
    assert.equal((await migrations()) - before, 1);
    migrated = { rid: got.rid, trace: t };
  });

  test('pdserve doctor --request on the migrated request shows every attempt: both rooms, the failed attempt\'s cause, the migration', async () => {
    assert.ok(migrated, 'the mid-stream migration ran');
    const { rid, trace: t } = migrated;
    const r = await cli(['doctor', '--url', s.c.router.url, '--request', rid], 20_000, { PDSERVE_CLUSTER_SECRET: s.c.secret });
    assert.equal(r.code, 0, r.out + r.err);
    const failed = t.events.find((e: any) => e.what === 'attempt_failed');
    const [first, second] = t.rooms as string[];
    assert.match(r.out, new RegExp(`attempts 2: rooms ${first} → ${second}`), r.out);
    for (const room of [first, second]) assert.match(r.out, new RegExp(`dispatched room=${room} `), r.out);
    assert.match(r.out, new RegExp(`attempt_failed attempt=1 next=migrate code=${failed.code} err=.*decode=${failed.decode}`), r.out);
    // Each attempt's prefill room is found on its worker, with its timeline (the killed decode's rooms died with it).
    const prefills = (t.events as any[]).filter((e) => e.what === 'dispatched').map((e) => e.prefill.replace(/^https?:\/\//, ''));
    for (const p of prefills) assert.ok(r.out.includes(`prefill ${p}`), `${p} in ${r.out}`);
  });

  test('decode SIGKILLed during the handoff (the client has token 1 from prefill): migrated with that token', async () => {
    const prompt = promptOf(80, 2);
    const ref = await reference(prompt, 16);
    for (const d of s.c.byRole('decode')) await setHold(d, 'decode.load=4000');
    let killing: Promise<void> | null = null;
    const got = await streamed(prompt, 16, async (i, rid) => {
      if (i === 0) killing = killAndRestart(procOf((await trace(rid)).decode));
    });
    await killing;
    assert.equal(got.text, ref.text);
    assert.equal(got.usage.completion_tokens, ref.usage.completion_tokens);
    const failed = (await trace(got.rid)).events.filter((e: any) => e.what === 'attempt_failed');
    assert.deepEqual(failed.map((e: any) => [e.next, e.tokens_sent]), [['migrate', 1]]);
  });

  for (const role of ['decode', 'prefill'] as const) {
    test(`${role} SIGKILLed before the first token (prefill holds the registered room): retried on the other pair`, async () => {
      const prompt = promptOf(70, role === 'decode' ? 3 : 4);
      const ref = await reference(prompt, 12);
      for (const p of s.c.byRole('prefill')) await setHold(p, 'prefill.compute=4000');
      const pending = s.pd.completions.create({ model: 'pdserve', prompt, max_tokens: 12, temperature: 0 }).withResponse();
      let victim: ClusterProc | undefined;
      assert.ok(
        await waitFor(async () => {
          const t = ((await getJson<any>(`${s.c.router.url}/debug/traces?active=1`)).traces as any[]).find((x) => x.room && x.outcome === null);
          if (!t) return false;
          const p = procOf(t.prefill);
          if (!((await getJson<any>(`${p.url}/debug/rooms`)).live as any[]).some((r) => r.room === t.room && r.phase === 'waiting')) return false;
          victim = role === 'decode' ? procOf(t.decode) : p;
          return true;
        }, 5000),
        'a room waits for evaluation',
      );
      await s.c.kill(victim!);
      await clearHolds();
      const { data, response } = await pending;
      assert.equal(data.choices[0]!.text, ref.text);
      const failed = (await trace(response.headers.get('x-request-id')!)).events.filter((e: any) => e.what === 'attempt_failed');
      assert.deepEqual(failed.map((e: any) => e.next), ['retry']);
      await killAndRestart(victim!);
    });
  }

  test('prefill SIGKILLed after token 1 (mid-transfer): the stream is migrated with that token', async () => {
    const prompt = promptOf(90, 5);
    const ref = await reference(prompt, 16);
    for (const p of s.c.byRole('prefill')) await setHold(p, 'prefill.send=4000');
    let killing: Promise<void> | null = null;
    const got = await streamed(prompt, 16, async (i, rid) => {
      if (i === 0) killing = killAndRestart(procOf((await trace(rid)).prefill));
    });
    await killing;
    await clearHolds();
    assert.equal(got.text, ref.text);
    assert.equal(got.usage.completion_tokens, ref.usage.completion_tokens);
    const failed = (await trace(got.rid)).events.filter((e: any) => e.what === 'attempt_failed');
    assert.deepEqual(failed.map((e: any) => [e.next, e.tokens_sent]), [['migrate', 1]]);
  });

  test('a JSON-schema chat request migrated mid-object gives the same valid JSON as an uninterrupted run', async () => {
    const schema = { type: 'object', properties: { n: { type: 'integer' }, ok: { type: 'boolean' } }, required: ['n', 'ok'], additionalProperties: false };
    const body = { model: 'pdserve', messages: [{ role: 'user' as const, content: 'give me an object' }], temperature: 0, max_tokens: 120, response_format: { type: 'json_schema' as const, json_schema: { name: 'o', schema } } };
    const refChoice = (await s.ref.chat.completions.create(body)).choices[0]!;
    const ref = refChoice.message.content!;
    assert.doesNotThrow(() => JSON.parse(ref), ref);
    assert.equal(refChoice.finish_reason, 'stop', 'the grammar ends the reply with the JSON');
    for (const d of s.c.byRole('decode')) await setHold(d, 'decode.step=25');
    const { data, response } = await s.pd.chat.completions.create({ ...body, stream: true }).withResponse();
    const rid = response.headers.get('x-request-id')!;
    let content = '';
    let chunks = 0;
    let finish: string | null = null;
    let killing: Promise<void> | null = null;
    for await (const c of data) {
      content += c.choices[0]?.delta?.content ?? '';
      finish = c.choices[0]?.finish_reason ?? finish;
      if (++chunks === 4) killing = killAndRestart(procOf((await trace(rid)).decode));
    }
    await killing;
    await clearHolds();
    assert.equal(content, ref);
    assert.equal(finish, 'stop', 'the migrated attempt ends with the JSON too');
    assert.deepEqual(JSON.parse(content), JSON.parse(ref));
    const failed = (await trace(rid)).events.filter((e: any) => e.what === 'attempt_failed');
    assert.equal(failed.length, 1);
    assert.ok(failed[0].tokens_sent > 1 && content.length > 1, 'migrated mid-object');
  });

  test('n = 2: the choice whose decode is killed migrates; both choices equal colocated', async () => {
    const prompt = promptOf(50, 6);
    const body = { model: 'pdserve', prompt, max_tokens: 30, temperature: 0, n: 2 };
    const ref = await s.ref.completions.create(body);
    for (const d of s.c.byRole('decode')) await setHold(d, 'decode.step=25');
    const stream = await s.pd.completions.create({ ...body, stream: true });
    const text = ['', ''];
    let chunks = 0;
    let killing: Promise<void> | null = null;
    for await (const c of stream) {
      for (const ch of c.choices) text[ch.index] += ch.text;
      if (++chunks === 10) {
        const t = ((await getJson<any>(`${s.c.router.url}/debug/traces?active=1`)).traces as any[]).find((x) => x.decode && x.outcome === null);
        killing = killAndRestart(procOf(t.decode));
      }
    }
    await killing;
    await clearHolds();
    assert.deepEqual(text, [ref.choices[0]!.text, ref.choices[1]!.text]);
    assert.ok((await migrations()) >= 1);
  });
});

/** A child started outside the stack: resolves when it reports ready (rejects on exit or after 60 s). */
async function ready(child: ChildProcess, what: string): Promise<void> {
  await new Promise<void>((resolve, reject) => {
    const t = setTimeout(() => reject(new Error(`${what} not ready within 60 s`)), 60_000);
    child.on('message', (m: any) => m?.type === 'ready' && (clearTimeout(t), resolve()));
    child.once('exit', (code) => (clearTimeout(t), reject(new Error(`${what} exited (${code})`))));
  });
}

/**
 * A second router over some of the stack's workers, with its own flags, joined as the stack's own
 * router is (`Cluster.joinerOf`: the secret, and in secure test mode its keys, HTTPS and internal
 * TLS; `reach`: this process's calls to it send the keys and trust the CA); resolves when ready.
 */
async function extraRouter(prefills: ClusterProc[], decodes: string[], flags: string[]): Promise<{ url: string; child: ChildProcess; stop(): Promise<void> }> {
  const port = await freePort();
  const join = s.c.joinerOf('router');
  const args = [BIN, 'router', '--host', '127.0.0.1', '--port', String(port), '--health-interval-ms', '200', ...join.args, ...flags];
  for (const p of prefills) args.push('--prefill', `${p.url},${p.bootstrapPort}`);
  for (const d of decodes) args.push('--decode', d);
  const child = spawn(process.execPath, args, { stdio: ['ignore', 'ignore', 'ignore', 'ipc'], env: { ...process.env, ...join.env } });
  const url = `${join.scheme}://127.0.0.1:${port}`;
  const unreach = s.c.reach(url);
  const stop = async () => {
    unreach();
    if (child.exitCode !== null || child.signalCode !== null) return;
    const gone = new Promise((r) => child.once('exit', r));
    child.kill('SIGKILL');
    await gone;
  };
  try {
    await ready(child, 'router');
  } catch (err) {
    await stop();
    throw err;
  }
  return { url, child, stop };
}

/** Rooms and queue entries a worker reports on /health (0 when it holds nothing). */
const held = async (p: ClusterProc) => Number((await getJson<any>(`${p.url}/health`)).rooms ?? 0);

describe('migration onto a decode that holds the prefix', () => {
  test('decode killed mid-stream, the other decode holding the conversation: the migration goes to it alone (decode-local, prompt + the tokens sent), equal to colocated', async () => {
    const r = await extraRouter(s.c.byRole('prefill'), s.c.byRole('decode').map((d) => d.url), ['--decode-policy', 'cache_aware']);
    let stopped: ClusterProc | undefined;
    try {
      const api = client(r.url);
      const view = async () => ((await getJson<any>(`${r.url}/workers`)).workers as any[]);
      const healthy = async (url: string) => (await view()).find((w) => w.url === url)?.healthy === true;
      assert.ok(await waitFor(async () => (await view()).filter((w) => w.healthy).length === 4, 10_000), 'four workers seen');
      const tr = (rid: string) => getJson<any>(`${r.url}/debug/traces/${encodeURIComponent(rid)}`);
      // several whole blocks (128 tokens: a deterministic worker's batch) the holder claims exactly
      const p1 = promptOf(600, 60);
      const { data: r1, response: h1 } = await api.completions.create({ model: 'pdserve', prompt: p1, max_tokens: 8, temperature: 0 }).withResponse();
      const holder = procOf((await tr(h1.headers.get('x-request-id')!)).decode);
      const other = s.c.byRole('decode').find((d) => d !== holder)!;
      const p2 = `${p1}${r1.choices[0]!.text} And then`;
      const ref = await reference(p2, 24);
      // The holder is out of the rotation for round 2's first pick (stopped), back before the other decode dies.
      stopped = holder;
      process.kill(holder.child!.pid!, 'SIGSTOP');
      assert.ok(await waitFor(async () => !(await healthy(holder.url)), 10_000), 'the stopped holder left the rotation');
      await setHold(other, 'decode.step=60');
      let killing: Promise<void> | null = null;
      const { data, response } = await api.completions.create({ model: 'pdserve', prompt: p2, max_tokens: 24, temperature: 0, stream: true, stream_options: { include_usage: true } }).withResponse();
      const rid = response.headers.get('x-request-id')!;
      let text = '';
      let usage: any = null;
      let chunks = 0;
      for await (const c of data) {
        text += c.choices[0]?.text ?? '';
        if (c.usage) usage = c.usage;
        if (c.choices.length && ++chunks === 3) {
          process.kill(holder.child!.pid!, 'SIGCONT');
          stopped = undefined;
          assert.ok(await waitFor(() => healthy(holder.url), 10_000), 'the holder is back');
          killing = killAndRestart(other);
        }
      }
      await killing;
      assert.equal(text, ref.text);
      assert.equal(usage.completion_tokens, ref.usage.completion_tokens);
      assert.equal(usage.prompt_tokens, ref.usage.prompt_tokens);
      const t = await tr(rid);
      assert.equal(t.outcome, 'ok');
      assert.deepEqual((t.events as any[]).filter((e) => e.what === 'attempt_failed').map((e) => e.next), ['migrate']);
      const dispatched = (t.events as any[]).filter((e) => e.what === 'dispatched');
      assert.deepEqual(dispatched.map((e) => [e.path, e.decode === holder.url]), [['pd', false], ['decode_local', true]], JSON.stringify(dispatched));
      assert.ok(dispatched[1].resumed_tokens >= 3, `the tokens the client had: ${dispatched[1].resumed_tokens}`);
    } finally {
      if (stopped?.child?.pid) process.kill(stopped.child.pid, 'SIGCONT');
      await r.stop();
      await clearHolds();
    }
  });
});

describe('a frozen decode does not hang its streams', () => {
  test('decode SIGSTOPped mid-stream: after the silence bound the stream migrates, equal to colocated; the worker is marked frozen and doctor names it', async () => {
    const prompt = promptOf(60, 3);
    const ref = await reference(prompt, 40);
    for (const d of s.c.byRole('decode')) await setHold(d, 'decode.step=25');
    const before = await migrations();
    let stopped: ClusterProc | undefined;
    let safety: NodeJS.Timeout | undefined;
    let stoppedAt = 0;
    let resumedAt = 0;
    let doctor: { code: number | null; out: string } | undefined;
    try {
      const got = await streamed(prompt, 40, async (i, rid) => {
        if (i === 8) {
          stopped = procOf((await trace(rid)).decode);
          s.c.signal(stopped, 'SIGSTOP');
          stoppedAt = Date.now();
          // never hang the suite: SIGCONT after 20 s whatever happens (the stream must have moved on long before)
          safety = setTimeout(() => s.c.signal(stopped!, 'SIGCONT'), 20_000);
        } else if (stoppedAt && !resumedAt) {
          resumedAt = Date.now();
          // the frozen worker, still stopped, as doctor sees it
          doctor = await cli(['doctor', '--url', s.c.router.url], 20_000, { PDSERVE_CLUSTER_SECRET: s.c.secret });
        }
      });
      assert.equal(got.text, ref.text, 'the client got every token once');
      assert.ok(resumedAt - stoppedAt < 15_000, `the stream moved on after the silence bound, not at SIGCONT (${resumedAt - stoppedAt} ms)`);
      assert.ok(resumedAt - stoppedAt >= SILENCE_MS - 500, `not before the bound (${resumedAt - stoppedAt} ms)`);
      const t = await trace(got.rid);
      assert.equal(t.outcome, 'ok');
      assert.deepEqual((t.events as any[]).filter((e) => e.what === 'attempt_failed').map((e) => [e.next, e.code]), [['migrate', 'decode_stalled']]);
      assert.equal((await migrations()) - before, 1);
      assert.ok(doctor, 'doctor ran while the worker was stopped');
      assert.match(doctor.out, new RegExp(`decode ${stopped!.url.replace(/[.:/]/g, '\\$&')} is frozen: no event on a request's stream`), doctor.out);
    } finally {
      if (safety) clearTimeout(safety);
      if (stopped) s.c.signal(stopped, 'SIGCONT');
      await clearHolds();
    }
    // resumed, it answers its probe again: healthy, no longer frozen
    assert.ok(await waitFor(async () => ((await getJson<any>(`${s.c.router.url}/workers`)).workers as any[]).every((w) => w.healthy && w.frozen === null), 10_000), 'the resumed decode is back in the rotation');
  });
});

describe("an operator's abort is final: never a migration", () => {
  /** A streamed request that `abort(rid, decodeProc)` ends after chunk 5: the error it ended with, the chunks before it. */
  async function abortedStream(abort: (rid: string, decode: ClusterProc) => Promise<void>) {
    for (const d of s.c.byRole('decode')) await setHold(d, 'decode.step=25');
    const before = await migrations();
    let error: any = null;
    let rid = '';
    let chunks = 0;
    let decode: ClusterProc | undefined;
    try {
      await streamed(promptOf(40, 70), 60, async (i, id) => {
        rid = id;
        chunks = i + 1;
        if (i !== 5) return;
        decode = procOf((await trace(id)).decode);
        await abort(id, decode);
      });
    } catch (err) {
      error = err;
    } finally {
      await clearHolds();
    }
    return { error, rid, chunks, decode: decode!, migrated: (await migrations()) - before };
  }

  test('POST /abort_request on the router (admin) by rid: the stream ends with request_aborted, every leg ends its room, no migration', async () => {
    const r = await abortedStream(async (rid) => {
      const res = await fetch(`${s.c.router.url}/abort_request`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ rid }) });
      assert.equal(res.status, 200, await res.clone().text());
      assert.deepEqual(await res.json(), { rid, aborted: 1 });
    });
    assert.ok(r.error, `the stream ended with an error, not [DONE] (chunks: ${r.chunks})`);
    assert.equal(r.error.code, 'request_aborted', String(r.error.message));
    assert.ok(r.chunks < 30, `the client did not get the rest of the tokens (${r.chunks} chunks)`);
    assert.equal(r.migrated, 0, 'no retry or migration');
    const t = await trace(r.rid);
    assert.equal(t.outcome, 'error');
    assert.deepEqual((t.events as any[]).filter((e) => e.what === 'attempt_failed'), [], 'no failed attempt');
    assert.ok((t.events as any[]).some((e) => e.what === 'operator_abort'), JSON.stringify(t.events));
    assert.ok(await waitFor(async () => (await busy(r.decode.url)) === 0, 3000), 'decode stopped generating and freed its slot');
    const gone = await fetch(`${s.c.router.url}/abort_request`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ rid: r.rid }) });
    assert.equal(gone.status, 404);
    assert.equal(((await gone.json()) as any).error.code, 'request_not_found');
  });

  test("a signed /abort_request straight to the decode serving the stream is the request's end too, not a worker failure to migrate", async () => {
    const r = await abortedStream(async (rid, decode) => {
      const res = await fetch(`${decode.url}/abort_request`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ rid }) });
      assert.equal(res.status, 200, await res.clone().text());
    });
    assert.ok(r.error, `the stream ended with an error, not [DONE] (chunks: ${r.chunks})`);
    assert.equal(r.error.code, 'request_aborted', String(r.error.message));
    assert.equal(r.migrated, 0, 'no retry or migration');
    const t = await trace(r.rid);
    assert.equal(t.outcome, 'error');
    assert.equal(t.rooms.length, 1, 'one attempt');
  });
});

describe('when migration cannot save a request', () => {
  test('a decode with the wrong cluster secret never enters the rotation: its signed probe is refused, every request succeeds on the others', async () => {
    const port = await freePort();
    // the stack's internal TLS (secure test mode) but another secret: the handshake passes, the signature does not
    const join = s.c.joinerOf('decode');
    const bad = spawn(process.execPath, [BIN, 'decode', '--model', await tinyModel(), '--threads', '1', '--ctx-size', String(CTX), '--batch-size', '128', '--deterministic', '--host', '127.0.0.1', '--port', String(port), ...join.args], { stdio: ['ignore', 'ignore', 'ignore', 'ipc'], env: { ...process.env, ...join.env, PDSERVE_CLUSTER_SECRET: 'another-secret-entirely' } });
    let r: Awaited<ReturnType<typeof extraRouter>> | undefined;
    try {
      await ready(bad, 'decode');
      const badUrl = `${join.scheme}://127.0.0.1:${port}`;
      const router = (r = await extraRouter(s.c.byRole('prefill'), [...s.c.byRole('decode').map((d) => d.url), badUrl], []));
      const api = client(router.url);
      const view = async () => ((await getJson<any>(`${router.url}/workers`)).workers as any[]);
      assert.ok(await waitFor(async () => (await view()).filter((w) => w.healthy).length === 4, 10_000), 'the four right workers are healthy');
      const prompts = Array.from({ length: 8 }, (_, i) => promptOf(30, 40 + i));
      const refs = await Promise.all(prompts.map((p) => reference(p, 6)));
      const got = await Promise.all(prompts.map((prompt) => api.completions.create({ model: 'pdserve', prompt, max_tokens: 6, temperature: 0 })));
      assert.deepEqual(got.map((g) => g.choices[0]!.text), refs.map((x) => x.text), 'every request answered, equal to colocated');
      const w = (await view()).find((x) => x.url === badUrl);
      assert.equal(w.healthy, false, 'the wrong-secret decode is out of the rotation');
      assert.match(String(w.last_error), /401/, `its probe was refused: ${w.last_error}`);
    } finally {
      await r?.stop();
      bad.kill('SIGKILL');
    }
  });

  test('the migration limit reached: the stream ends with an error naming the last cause, and nothing is left held', async () => {
    const r = await extraRouter(s.c.byRole('prefill'), s.c.byRole('decode').map((d) => d.url), ['--migration-limit', '1']);
    try {
      const api = client(r.url);
      assert.ok(await waitFor(async () => ((await getJson<any>(`${r.url}/workers`)).workers as any[]).filter((w) => w.healthy).length === 4, 10_000), 'four workers seen');
      for (const d of s.c.byRole('decode')) await setHold(d, 'decode.step=40');
      const killed = new Set<string>();
      const tr = (rid: string) => getJson<any>(`${r.url}/debug/traces/${encodeURIComponent(rid)}`);
      const { data, response } = await api.completions.create({ model: 'pdserve', prompt: promptOf(60, 50), max_tokens: 80, temperature: 0, stream: true }).withResponse();
      const rid = response.headers.get('x-request-id')!;
      let chunks = 0;
      let migratedAt = -1;
      let error: any = null;
      try {
        for await (const c of data) {
          if (!c.choices.length) continue;
          chunks++;
          const t = await tr(rid);
          const failed = (t.events as any[]).filter((e) => e.what === 'attempt_failed').length;
          // the first decode at chunk 3; the one it migrated to two chunks after the migration shows
          // in the trace (its handoff done: a kill during the handoff may surface as prefill's cut
          // stream first, and this case is about the limit, not about which leg reports first)
          if (killed.size === 1 && failed === 1 && migratedAt < 0) migratedAt = chunks;
          if ((killed.size === 0 && chunks === 3) || (killed.size === 1 && migratedAt >= 0 && chunks >= migratedAt + 2)) {
            const victim = killed.size === 0 ? procOf(t.decode) : s.c.byRole('decode').find((d) => !killed.has(d.url))!;
            killed.add(victim.url);
            await s.c.kill(victim);
          }
        }
      } catch (err) {
        error = err;
      }
      assert.equal(killed.size, 2, 'both decodes were killed under the request');
      assert.ok(error, `the stream ended with an error (chunks: ${chunks})`);
      assert.match(String(error.message), /decode/, `the error names the last cause: ${error.message}`);
      assert.doesNotMatch(String(error.message), /127\.0\.0\.1|localhost|https?:\/\//, 'the client is told the role, never its address');
      const t = await tr(rid);
      assert.equal(t.outcome, 'error');
      // one migration (an attempt_failed event), then the second attempt's failure is the request's
      assert.deepEqual((t.events as any[]).filter((e) => e.what === 'attempt_failed').map((e) => e.next), ['migrate'], 'one migration, then the limit');
      assert.equal(t.rooms.length, 2, 'two attempts');
      assert.ok(await waitFor(async () => (await Promise.all(s.c.byRole('prefill').map(held))).every((n) => n === 0), 5000), 'prefill holds no room');
      assert.ok(await waitFor(async () => { const w = await getJson<any>(`${r.url}/workers`); return w.acquired_total > 0 && w.acquired_total === w.released_total; }, 5000), 'every router lease released');
    } finally {
      await r.stop();
      await clearHolds();
      for (const d of s.c.byRole('decode')) if (!d.child) await s.c.spawn(d);
    }
  });
});
