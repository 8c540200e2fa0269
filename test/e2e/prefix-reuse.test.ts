/**
 * Prefix reuse end to end (real processes, the real `openai` client, deterministic engines):
 * a multi-round agent conversation through PD (prefill's prefix cache) and the colocated server
 * (its own prefix cache) gives, round for round, the output of a colocated engine without any
 * cache; usage.prompt_tokens_details.cached_tokens reports the reuse; an aborted round leaves
 * nothing a later round could read; the metrics and /debug/rooms say what was reused.
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import type OpenAI from 'openai';
import { chatRound as round, type Msg } from '../helpers/chat.js';
import { startColocated, type ColocatedServer } from '../../src/colocated/server.js';
import { createLogger } from '../../src/base/log.js';
import type { Cluster } from '../../src/up/cluster.js';
import { client, CTX, getJson, startStack, tinyModel } from '../helpers/stack.js';

const BATCH = 32;
let c: Cluster;
let nocache: ColocatedServer;
let pd: OpenAI;
let colo: OpenAI;
let cold: OpenAI;


const metricValue = (text: string, name: string): number => {
  const m = new RegExp(`^${name}(?:\\{[^}]*\\})? (\\S+)$`, 'm').exec(text);
  return m ? Number(m[1]) : NaN;
};

describe('prefix reuse (PD and colocated vs no cache)', () => {
  before(async () => {
    c = await startStack({ batchSize: BATCH });
    nocache = await startColocated(
      { port: 0, slots: 2, engine: { modelPath: await tinyModel(), contextSize: CTX, batchSize: BATCH, deterministic: true, prefixCacheTokens: 0 } },
      createLogger('colocated-nocache', { level: 'silent' }),
    );
    pd = client(c.router.url);
    colo = client(c.colocated!.url);
    cold = client(nocache.url);
  });
  after(async () => {
    await c?.stop();
    await nocache?.close();
  });

  test('a 6-round agent conversation: same output with and without reuse; cached tokens reported', async () => {
    const messages: Msg[] = [{ role: 'system', content: 'You are an agent. Call tools, read results, answer briefly.' }];
    let promptAll = 0;
    let cachedAll = 0;
    for (let r = 1; r <= 6; r++) {
      // each round adds a tool result as a user turn (the tiny model has no tool-call template)
      messages.push({ role: 'user', content: `tool result ${r}: ${'ok '.repeat(6 + r)}` });
      const stream = r % 2 === 0;
      const ref = await round(cold, messages, stream);
      const a = await round(pd, messages, stream);
      const b = await round(colo, messages, stream);
      assert.equal(a.text, ref.text, `round ${r}: PD with reuse differs from no-cache output`);
      assert.equal(b.text, ref.text, `round ${r}: colocated with reuse differs from no-cache output`);
      assert.equal(ref.cached, 0);
      assert.equal(a.prompt, ref.prompt);
      assert.equal(a.cached % BATCH, 0, 'deterministic reuse is whole prompt chunks');
      if (r > 1) {
        assert.ok(a.cached > 0, `round ${r}: PD reused nothing (${a.prompt} prompt tokens)`);
        assert.ok(b.cached > 0, `round ${r}: colocated reused nothing`);
        promptAll += a.prompt;
        cachedAll += a.cached;
      }
      messages.push({ role: 'assistant', content: ref.text });
    }
    assert.ok(cachedAll / promptAll > 0.5, `cached ${cachedAll} of ${promptAll} prompt tokens over rounds 2+`);

    const pm = await (await fetch(`${c.byRole('prefill')[0]!.url}/metrics`)).text();
    assert.ok(metricValue(pm, 'pdserve_prefix_cache_hit_tokens_total') >= cachedAll, 'hit tokens counted');
    assert.ok(metricValue(pm, 'pdserve_prefix_cache_query_tokens_total') >= promptAll, 'query tokens counted');
    assert.ok(metricValue(pm, 'pdserve_prefix_cache_tokens') > 0, 'idle sequences hold a prefix');
    const dm = await (await fetch(`${c.byRole('decode')[0]!.url}/metrics`)).text();
    assert.ok(metricValue(dm, 'pdserve_requests_by_path_total') >= 6, 'decode counts requests by path');
    assert.match(dm, /pdserve_requests_by_path_total\{path="pd"\}/);
    const cm = await (await fetch(`${c.colocated!.url}/metrics`)).text();
    assert.ok(metricValue(cm, 'pdserve_prefix_cache_hit_tokens_total') > 0);
  });

  test('a client abort mid-round leaves no entry a later round could read; the retried round matches', async () => {
    const messages: Msg[] = [{ role: 'system', content: 'Aborts must not poison the cache.' }, { role: 'user', content: 'start '.repeat(30) }];
    const ac = new AbortController();
    const s = await pd.chat.completions.create({ model: 'pdserve', messages, max_tokens: 200, temperature: 0, stream: true, stream_options: { include_usage: true } }, { signal: ac.signal });
    let seen = 0;
    let finish: string | null | undefined;
    try {
      for await (const ch of s) {
        finish = ch.choices[0]?.finish_reason ?? finish;
        if ((ch.choices[0]?.delta?.content ?? '') !== '' && ++seen === 2) ac.abort();
      }
    } catch (err) {
      assert.ok(ac.signal.aborted, `only our abort may end the stream early: ${String(err)}`);
    }
    assert.ok(ac.signal.aborted, `the round ended (${finish}) after ${seen} chunks before it could be aborted`);
    const ref = await round(cold, messages, false);
    const again = await round(pd, messages, false);
    assert.equal(again.text, ref.text);
    // the aborted generation lived on decode; prefill's finished prompt evaluation may be reused
    const dbg = await getJson<any>(`${c.byRole('prefill')[0]!.url}/debug/rooms`);
    assert.ok(Array.isArray(dbg.live));
  });

  test('/debug/rooms shows the serving path and cached tokens of live requests', async () => {
    const messages: Msg[] = [{ role: 'user', content: 'long answer please '.repeat(4) }];
    await round(colo, messages, false);
    const p = colo.chat.completions.create({ model: 'pdserve', messages, max_tokens: 300, temperature: 0 });
    let live: any[] = [];
    for (let i = 0; i < 200 && live.length === 0; i++) {
      live = (await getJson<any>(`${c.colocated!.url}/debug/rooms`)).live;
      if (live.length === 0) await new Promise((r) => setTimeout(r, 5));
    }
    await p;
    assert.ok(live.length > 0, 'a live request was seen');
    assert.equal(live[0].path, 'colocated');
    assert.equal(typeof live[0].cached_tokens, 'number');
  });
});
