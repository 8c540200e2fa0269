/**
 * First token before the KV handoff, on real processes: prefill streams token 1 to the router as
 * soon as it is sampled, the router writes it to the client at once, decode continues from
 * token 2. Proven by holding prefill before it saves the state (test-only hold): the client has
 * its first token while the state does not exist yet. Then the rest equals the colocated output
 * (no token repeated or lost), and a handoff that fails after token 1 reaches the client as an
 * SSE error event after that token, without [DONE].
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import type { Cluster } from '../../src/up/cluster.js';
import { busy, client, getJson, startStack, waitFor } from '../helpers/stack.js';

let c: Cluster;
const prefillUrl = () => c.byRole('prefill')[0]!.url;
const decodeUrl = () => c.byRole('decode')[0]!.url;

interface LiveRoom {
  room: string;
  rid: string;
  phase: string;
  step: string | null;
}

async function setHolds(spec: string): Promise<void> {
  for (const p of [...c.byRole('prefill'), ...c.byRole('decode')]) {
    const r = await fetch(`${p.url}/debug/test-holds`, { method: 'POST', headers: { 'content-type': 'text/plain' }, body: spec, signal: AbortSignal.timeout(2000) });
    assert.equal(r.status, 200);
  }
}

/** Stream a completion through the router with fetch; calls `onFirst` when the first data event with text arrives. */
async function streamRaw(body: Record<string, unknown>, onFirst: (text: string) => Promise<void>): Promise<{ status: number; events: string[] }> {
  const r = await fetch(`${c.router.url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model: 'pdserve', temperature: 0, stream: true, ...body }),
    signal: AbortSignal.timeout(20_000),
  });
  const events: string[] = [];
  const dec = new TextDecoder();
  let buf = '';
  let fired = false;
  for await (const chunk of r.body!) {
    buf += dec.decode(chunk, { stream: true });
    let i: number;
    while ((i = buf.indexOf('\n\n')) >= 0) {
      const ev = buf.slice(0, i).replace(/^data: /, '');
      buf = buf.slice(i + 2);
      events.push(ev);
      if (!fired && ev !== '[DONE]') {
        const j = JSON.parse(ev) as { choices?: { text?: string }[] };
        const text = j.choices?.[0]?.text ?? '';
        if (text !== '') {
          fired = true;
          await onFirst(text);
        }
      }
    }
  }
  return { status: r.status, events };
}

const prefillRooms = async () => (await getJson<{ live: LiveRoom[] }>(`${prefillUrl()}/debug/rooms`)).live;

before(async () => {
  // Token 1 before the save (--first-token-after-save 0); pd.test.ts runs it after the save.
  c = await startStack({ env: { PDSERVE_TEST_HOLDS: 'on' }, extraArgs: { prefill: ['--first-token-after-save', '0'] } });
});

after(async () => {
  await c?.stop();
});

describe('first token before the KV handoff', () => {
  const prompt = 'Once upon a time, the river';

  test('the client has token 1 while prefill has not even saved the state; the rest equals colocated', async () => {
    const ref = await client(c.colocated!.url).completions.create({ model: 'pdserve', prompt, max_tokens: 12, temperature: 0 });
    // Held far longer than token 1 can take to reach the client on a loaded machine; clearing the
    // hold once the room was seen releases it at once (src/runtime/testhooks.ts).
    await setHolds('prefill.save=30000');
    let seenWhileHeld: LiveRoom[] = [];
    const out = await streamRaw({ prompt, max_tokens: 12 }, async () => {
      seenWhileHeld = await prefillRooms();
      await setHolds('');
    });
    assert.equal(out.status, 200);
    assert.equal(seenWhileHeld.length, 1, 'the room is still live on prefill when the first token reaches the client');
    assert.equal(seenWhileHeld[0]!.step, 'computing', `prefill is held before saving the state (step ${seenWhileHeld[0]!.step})`);
    assert.equal(out.events.at(-1), '[DONE]');
    const text = out.events
      .filter((e) => e !== '[DONE]')
      .map((e) => (JSON.parse(e) as { choices: { text: string }[] }).choices[0]?.text ?? '')
      .join('');
    assert.equal(text, ref.choices[0]!.text, 'token 1 from prefill + tokens 2.. from decode = the colocated output');
  });

  test('non-streamed and chat requests still equal colocated (token 1 from prefill, the rest from decode)', async () => {
    await setHolds('');
    const pd = client(c.router.url);
    const ref = client(c.colocated!.url);
    for (const max of [1, 2, 9]) {
      const a = await pd.completions.create({ model: 'pdserve', prompt, max_tokens: max, temperature: 0 });
      const b = await ref.completions.create({ model: 'pdserve', prompt, max_tokens: max, temperature: 0 });
      assert.equal(a.choices[0]!.text, b.choices[0]!.text, `max_tokens ${max}`);
      assert.equal(a.usage?.completion_tokens, b.usage?.completion_tokens, `max_tokens ${max}: completion tokens`);
      assert.equal(a.choices[0]!.finish_reason, b.choices[0]!.finish_reason);
    }
    const messages = [{ role: 'user' as const, content: 'Tell me about the mills.' }];
    const s = await pd.chat.completions.create({ model: 'pdserve', messages, max_tokens: 10, temperature: 0, stream: true });
    let text = '';
    for await (const ch of s) text += ch.choices[0]?.delta.content ?? '';
    const r = await ref.chat.completions.create({ model: 'pdserve', messages, max_tokens: 10, temperature: 0 });
    assert.equal(text, r.choices[0]!.message.content);
  });

  test('a handoff that fails after token 1: the client gets an SSE error after its first token, no [DONE]', async () => {
    await setHolds('prefill.save=30000');
    const out = await streamRaw({ prompt, max_tokens: 12 }, async () => {
      // The handoff fails: decode's room for this request is aborted while prefill is held (until
      // the abort is answered, however long that takes), then prefill goes on to a dead room.
      const decodeRooms = (await getJson<{ live: LiveRoom[] }>(`${decodeUrl()}/debug/rooms`)).live;
      assert.equal(decodeRooms.length, 1);
      const r = await fetch(`${decodeUrl()}/abort_request`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ bootstrap_room: decodeRooms[0]!.room }) });
      assert.equal(r.status, 200);
      await setHolds('');
    });
    await setHolds('');
    assert.equal(out.status, 200, 'the stream had started');
    const first = JSON.parse(out.events[0]!) as { choices: { text: string }[] };
    assert.notEqual(first.choices[0]!.text, '', 'the first event carries token 1');
    const last = JSON.parse(out.events.at(-1)!) as { error?: { message: string } };
    assert.ok(last.error, `the last event is an error: ${out.events.at(-1)}`);
    assert.ok(!out.events.includes('[DONE]'));
    const idle = await waitFor(async () => (await busy(prefillUrl())) === 0 && (await busy(decodeUrl())) === 0, 5000);
    assert.ok(idle, 'both workers release everything');
    const next = await client(c.router.url).completions.create({ model: 'pdserve', prompt: 'and then', max_tokens: 4, temperature: 0 });
    assert.equal(next.choices[0]!.finish_reason !== null, true, 'the next request is served');
  });
});
