/**
 * Decode-local continuation end to end (real processes, the real `openai` client, deterministic
 * engines): the router (`--decode-policy cache_aware`) sends a conversation's later rounds to the
 * decode worker that kept the earlier one, alone; decode evaluates the short suffix itself. Round
 * for round the output equals a colocated server without any cache (and round 1, PD without
 * reuse: prefill runs `--no-prefix-cache`); cached_tokens are reported; a long suffix goes PD
 * from the start (the router counts what decode lacks in tokens); a client abort mid-round leaves nothing a later round could read; more
 * conversations than decode's spare sequences never fail a request; metrics and /debug/rooms
 * name the path.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import type OpenAI from 'openai';
import { chatRound as round, type Msg } from '../helpers/chat.js';
import { getJson, useStack } from '../helpers/stack.js';

const BATCH = 32;
// PD without reuse on prefill, a no-cache colocated reference; decode keeps 2 spare sequences.
const h = useStack({
  batchSize: BATCH,
  decodeSlots: 4,
  extraArgs: {
    router: ['--decode-policy', 'cache_aware', '--local-prefill-max-tokens', '128'],
    prefill: ['--no-prefix-cache'],
    decode: ['--prefix-cache-slots', '2'],
    colocated: ['--no-prefix-cache'],
  },
});


/** Sum of a counter over the label sets matching `labels` (e.g. 'path="decode_local"'). */
const metric = (text: string, name: string, labels = ''): number => {
  let sum = 0;
  for (const m of text.matchAll(new RegExp(`^${name}(?:\\{([^}]*)\\})? (\\S+)$`, 'gm'))) if (!labels || (m[1] ?? '').includes(labels)) sum += Number(m[2]);
  return sum;
};
const text = async (url: string) => (await fetch(url)).text();

describe('decode-local continuation (PD, decode alone for short suffixes) vs colocated without cache', () => {
  test('a 6-round conversation: rounds 2+ on decode alone, same output as colocated without cache; a long suffix falls back to PD', async () => {
    const decodeUrl = h.c.byRole('decode')[0]!.url;
    const before = { local: metric(await text(`${h.c.router.url}/metrics`), 'pdserve_router_requests_by_path_total', 'path="decode_local"') };
    const messages: Msg[] = [{ role: 'system', content: 'You are an agent. Call tools, read results, answer briefly.' }];
    let localRounds = 0;
    for (let r = 1; r <= 6; r++) {
      // round 5 adds a long tool result: over the 128-token local limit, which the router counts exactly
      messages.push({ role: 'user', content: r === 5 ? `tool result ${r}: ${'long output line '.repeat(20)}` : `tool result ${r}: ${'ok '.repeat(6 + r)}` });
      const stream = r % 2 === 0;
      const ref = await round(h.ref, messages, stream);
      const routerBefore = await text(`${h.c.router.url}/metrics`);
      // KV handoffs into decode, either path (TCP bytes or a same-host state file: kv/transfer/same-host.ts)
      const kvBefore = metric(await text(`${decodeUrl}/metrics`), 'pdserve_kv_handoffs_total');
      const a = await round(h.pd, messages, stream);
      const routerAfter = await text(`${h.c.router.url}/metrics`);
      const handoffs = metric(await text(`${decodeUrl}/metrics`), 'pdserve_kv_handoffs_total') - kvBefore;
      assert.equal(a.text, ref.text, `round ${r}: output differs from colocated without cache`);
      assert.equal(a.prompt, ref.prompt);
      const wasLocal = metric(routerAfter, 'pdserve_router_requests_by_path_total', 'path="decode_local"') - metric(routerBefore, 'pdserve_router_requests_by_path_total', 'path="decode_local"');
      const fellBack = metric(routerAfter, 'pdserve_router_requests_by_path_total', 'path="fallback"') - metric(routerBefore, 'pdserve_router_requests_by_path_total', 'path="fallback"');
      if (r === 1) {
        assert.equal(wasLocal, 0, 'round 1: nobody holds the conversation yet: PD');
        assert.equal(handoffs, 1, 'round 1: one KV handoff from prefill');
      }
      else if (r === 5) {
        assert.equal(wasLocal, 0, 'round 5: the long suffix is not evaluated on decode');
        assert.equal(fellBack, 0, 'round 5: the router knew decode lacked more than 128 tokens: PD at once, no needs_prefill');
      } else {
        assert.equal(wasLocal, 1, `round ${r}: served by decode alone`);
        assert.equal(handoffs, 0, `round ${r}: no KV handoff from prefill`);
        assert.ok(a.cached > 0 && a.cached % BATCH === 0, `round ${r}: cached ${a.cached} (whole chunks in deterministic mode)`);
        localRounds++;
      }
      messages.push({ role: 'assistant', content: ref.text });
    }
    assert.equal(localRounds, 4);
    const dm = await text(`${decodeUrl}/metrics`);
    assert.ok(metric(dm, 'pdserve_requests_by_path_total', 'path="decode_local"') >= 4);
    assert.ok(metric(dm, 'pdserve_prefix_cache_hit_tokens_total') > 0, 'decode counts the tokens it did not evaluate');
    assert.ok(metric(await text(`${h.c.router.url}/metrics`), 'pdserve_router_requests_by_path_total', 'path="decode_local"') - before.local >= 4);
    // decode-local rooms are rooms: in decode's table, with the local phase in their timeline, no prefill peer
    const dbg = await getJson<any>(`${decodeUrl}/debug/rooms`);
    const local = dbg.recent.filter((r: any) => r.timeline.some((e: any) => e.phase === 'local'));
    assert.ok(local.length >= 4, 'local rooms are in the room table');
    for (const r of local) {
      assert.equal(r.state, 'Success');
      assert.equal(r.peer, null);
      // after the request ended its row still says which path it took (and what it reused)
      assert.equal(r.path, 'decode_local');
      assert.equal(r.kv_path, null);
      // a local round continues the sequence decode kept: it reused whole chunks of it
      assert.ok(r.cached_tokens > 0 && r.cached_tokens % BATCH === 0, `local room ${r.room} shows the tokens it reused (${r.cached_tokens})`);
    }
    const pd = dbg.recent.filter((r: any) => r.state === 'Success' && r.peer !== null);
    assert.ok(pd.length >= 1 && pd.every((r: any) => r.path === 'pd' && (r.kv_path === 'same_host' || r.kv_path === 'tcp')), 'finished PD rooms keep path and kv_path');
    assert.equal(dbg.stats.illegal, 0);
  });

  test('a client abort mid-round on the local path leaves nothing a later round could read; the retried round matches', async () => {
    const messages: Msg[] = [{ role: 'system', content: 'Aborts must not poison the kept sequence.' }, { role: 'user', content: 'start '.repeat(12) }];
    const r1 = await round(h.pd, messages, false);
    assert.equal(r1.text, (await round(h.ref, messages, false)).text);
    messages.push({ role: 'assistant', content: r1.text }, { role: 'user', content: 'continue '.repeat(5) });
    const ac = new AbortController();
    const s = await h.pd.chat.completions.create({ model: 'pdserve', messages, max_tokens: 300, temperature: 0, stream: true }, { signal: ac.signal });
    let seen = 0;
    try {
      for await (const ch of s) if ((ch.choices[0]?.delta?.content ?? '') !== '' && ++seen === 2) ac.abort();
    } catch (err) {
      assert.ok(ac.signal.aborted, `only our abort may end the stream early: ${String(err)}`);
    }
    assert.ok(ac.signal.aborted, 'the round was aborted mid-stream');
    const ref = await round(h.ref, messages, false);
    const again = await round(h.pd, messages, false);
    assert.equal(again.text, ref.text, 'the retried round equals the reference');
    // the next round too (it may reuse what the retried round kept, never the aborted one)
    messages.push({ role: 'assistant', content: ref.text }, { role: 'user', content: 'and then?' });
    assert.equal((await round(h.pd, messages, true)).text, (await round(h.ref, messages, true)).text);
  });

  test('more conversations than decode keeps: eviction under pressure never fails a request', async () => {
    const convs: Msg[][] = [];
    for (let i = 0; i < 5; i++) convs.push([{ role: 'system', content: `Agent ${i} tracks ${'items '.repeat(i + 2)}` }]);
    for (let r = 1; r <= 3; r++) {
      const outs = await Promise.all(
        convs.map(async (m, i) => {
          m.push({ role: 'user', content: `round ${r} of agent ${i}: ${'data '.repeat(3 + i)}` });
          const [a, ref] = await Promise.all([round(h.pd, m, i % 2 === 0), round(h.ref, m, false)]);
          return { i, a, ref };
        }),
      );
      for (const o of outs) {
        assert.equal(o.a.text, o.ref.text, `round ${r} agent ${o.i}`);
        convs[o.i]!.push({ role: 'assistant', content: o.ref.text });
      }
    }
    const dbg = await getJson<any>(`${h.c.byRole('decode')[0]!.url}/debug/rooms`);
    assert.equal(dbg.stats.illegal, 0);
    assert.equal(dbg.counts.Failed, 0, 'no room failed');
  });
});
