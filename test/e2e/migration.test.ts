/**
 * Migration on real processes (2 prefill + 2 decode, --deterministic, the tiny model, the real
 * openai client): a worker SIGKILLed at a chosen point of a request costs the client nothing —
 * a retry before its first token, a migration (prompt + the tokens it has, to another pair) after
 * — and every greedy answer equals the colocated reference, token for token.
 *  - decode killed mid-stream, during the handoff (after token 1 from prefill), before token 1;
 *  - prefill killed before token 1 and after it (mid-transfer);
 *  - a JSON-schema chat request migrated mid-object: the same valid JSON;
 *  - n = 2 with a choice migrated.
 * The kill points are reached with test holds (src/common/testhooks.ts: `decode.step` slows
 * generation, `decode.load` / `prefill.compute` / `prefill.send` stop a room in its phase), not
 * with timing. Each killed worker is started again before the next test.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import type { ClusterProc } from '../../src/harness/cluster.js';
import { getJson, promptOf, useStack, waitFor } from '../helpers/stack.js';

const s = useStack({ prefill: 2, decode: 2, env: { PDSERVE_TEST_HOLDS: 'on' }, extraArgs: { router: ['--health-interval-ms', '200'] } });

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
    const ref = (await s.ref.chat.completions.create(body)).choices[0]!.message.content!;
    assert.doesNotThrow(() => JSON.parse(ref), ref);
    for (const d of s.c.byRole('decode')) await setHold(d, 'decode.step=25');
    const { data, response } = await s.pd.chat.completions.create({ ...body, stream: true }).withResponse();
    const rid = response.headers.get('x-request-id')!;
    let content = '';
    let chunks = 0;
    let killing: Promise<void> | null = null;
    for await (const c of data) {
      content += c.choices[0]?.delta?.content ?? '';
      if (++chunks === 4) killing = killAndRestart(procOf((await trace(rid)).decode));
    }
    await killing;
    await clearHolds();
    assert.equal(content, ref);
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
