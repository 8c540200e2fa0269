/**
 * The host-wide prefix store end to end (real processes, the real `openai` client, deterministic
 * engines, one store folder shared by prefill, decode and an in-process colocated server). Every
 * worker's in-sequence tier is made useless (`--prefix-cache-tokens 1`: a finished sequence is
 * evicted at once, after it was stored), so every reuse comes from the store. Round for round the
 * output equals a colocated server without any cache, on the decode-local path, on prefill (a
 * long suffix falls back to PD) and on colocated; cached_tokens report the store's hits; the
 * metrics count them and pass promtool.
 */
import assert from 'node:assert/strict';
import { mkdtempSync, readdirSync, rmSync, statSync, truncateSync } from 'node:fs';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import type OpenAI from 'openai';
import { startColocated, type ColocatedServer } from '../../src/colocated/server.js';
import { createLogger } from '../../src/base/log.js';
import { chatRound as round, type Msg } from '../helpers/chat.js';
import { checkMetrics } from '../helpers/promtool.js';
import { client, CTX, tinyModel, useStack } from '../helpers/stack.js';

const BATCH = 32;
const storeDir = mkdtempSync('/dev/shm/pdserve-e2e-store-');
const h = useStack({
  batchSize: BATCH,
  decodeSlots: 4,
  prefixStoreDir: storeDir,
  // Decode's in-sequence tier is off (below), so its events never claim a conversation: the
  // router sends round r + 1 to decode alone on the pending claim of round r, which lasts 3 s
  // (PENDING_CLAIM_MS, src/router/kv-events.ts). Here it outlasts the reference round and the
  // store's write on a loaded machine.
  env: { PDSERVE_TEST_PENDING_CLAIM_MS: '60000' },
  extraArgs: {
    router: ['--decode-policy', 'cache_aware', '--local-prefill-max-tokens', '128'],
    prefill: ['--prefix-cache-tokens', '1'],
    decode: ['--prefix-cache-slots', '1', '--prefix-cache-tokens', '1'],
    colocated: ['--no-prefix-cache'],
  },
});
let colo: ColocatedServer;
let coloApi: OpenAI;

before(async () => {
  colo = await startColocated(
    { port: 0, slots: 2, engine: { modelPath: await tinyModel(), contextSize: CTX, batchSize: BATCH, deterministic: true, prefixCacheSlots: 0, prefixCacheTokens: 1, prefixStoreDir: storeDir, prefixStoreBytes: 64 << 20 } },
    createLogger('colocated-store', { level: 'silent' }),
  );
  coloApi = client(colo.url);
});
after(async () => {
  await colo?.close();
  rmSync(storeDir, { recursive: true, force: true });
});

/** Sum of a counter over the label sets containing `labels`. */
const metric = (text: string, name: string, labels = ''): number => {
  let sum = 0;
  for (const m of text.matchAll(new RegExp(`^${name}(?:\\{([^}]*)\\})? (\\S+)$`, 'gm'))) if (!labels || (m[1] ?? '').includes(labels)) sum += Number(m[2]);
  return sum;
};
const text = async (url: string) => (await fetch(url)).text();
const storeHits = async (url: string) => metric(await text(`${url}/metrics`), 'pdserve_prefix_cache_lookups_total', 'tier="store",result="hit"');
/** Wait (deadline 5 s) until the store folder holds at least `n` entries: decode publishes after the stream ended. */
async function entries(n: number): Promise<number> {
  let have = 0;
  for (let i = 0; i < 250; i++) {
    have = readdirSync(storeDir).filter((f) => f.endsWith('.pdkv')).length;
    if (have >= n) break;
    await new Promise((r) => setTimeout(r, 20));
  }
  return have;
}

describe('prefix store shared by prefill, decode and colocated vs no cache', () => {
  const messages: Msg[] = [{ role: 'system', content: 'You are an agent. Call tools, read results, answer briefly and precisely.' }];

  test('decode-local: rounds 2+ load the stored previous round on decode; output equals no cache', async () => {
    const decode = h.c.byRole('decode')[0]!.url;
    for (let r = 1; r <= 4; r++) {
      messages.push({ role: 'user', content: `tool result ${r}: ${'ok '.repeat(8 + r)}` });
      const ref = await round(h.ref, messages, r % 2 === 0);
      const hitsBefore = await storeHits(decode);
      const a = await round(h.pd, messages, r % 2 === 0);
      assert.equal(a.text, ref.text, `round ${r}: output differs from no cache`);
      assert.equal(a.prompt, ref.prompt);
      if (r > 1) {
        assert.ok(a.cached > 0 && a.cached % BATCH === 0, `round ${r}: cached ${a.cached} of ${a.prompt} (whole chunks)`);
        assert.equal((await storeHits(decode)) - hitsBefore, 1, `round ${r}: decode loaded the stored round`);
      }
      messages.push({ role: 'assistant', content: ref.text });
      assert.ok((await entries(r)) >= r, `round ${r}: decode stored the finished round`);
    }
    const router = await text(`${h.c.router.url}/metrics`);
    assert.ok(metric(router, 'pdserve_router_requests_by_path_total', 'path="decode_local"') >= 3, 'rounds 2-4 on decode alone');
    assert.equal(metric(router, 'pdserve_router_requests_by_path_total', 'path="fallback"'), 0, 'no needs_prefill fallback');
  });

  test('prefill: a long suffix goes to PD, and prefill loads the stored conversation; output equals no cache', async () => {
    const prefill = h.c.byRole('prefill')[0]!.url;
    messages.push({ role: 'user', content: `tool result 5: ${'long output line '.repeat(20)}` });
    const ref = await round(h.ref, messages, false);
    const hitsBefore = await storeHits(prefill);
    const a = await round(h.pd, messages, true);
    assert.equal(a.text, ref.text);
    assert.ok(a.cached > 0 && a.cached % BATCH === 0, `cached ${a.cached} of ${a.prompt}`);
    assert.equal((await storeHits(prefill)) - hitsBefore, 1, 'prefill loaded the stored round');
    messages.push({ role: 'assistant', content: ref.text });
    await entries(5);
  });

  test('colocated: another process on the host continues the conversation from the store; and its own rounds', async () => {
    messages.push({ role: 'user', content: `tool result 6: ${'fine '.repeat(9)}` });
    const ref = await round(h.ref, messages, false);
    const a = await round(coloApi, messages, true);
    assert.equal(a.text, ref.text);
    assert.ok(a.cached > 0, 'the colocated server reused what decode stored');
    const own: Msg[] = [{ role: 'system', content: 'A colocated conversation of its own, several rounds long, to store.' }];
    for (let r = 1; r <= 3; r++) {
      own.push({ role: 'user', content: `step ${r}: ${'more data '.repeat(12)}` });
      const x = await round(h.ref, own, false);
      const y = await round(coloApi, own, r % 2 === 1);
      assert.equal(y.text, x.text, `own round ${r}`);
      if (r > 1) assert.ok(y.cached > 0 && y.cached % BATCH === 0, `own round ${r}: cached ${y.cached}`);
      own.push({ role: 'assistant', content: x.text });
      for (let i = 0; i < 100 && (await storeHits(colo.url)) < r - 1; i++) await new Promise((res) => setTimeout(res, 20));
    }
    const m = await text(`${colo.url}/metrics`);
    assert.ok(metric(m, 'pdserve_prefix_cache_lookups_total', 'tier="store",result="hit"') >= 3);
    assert.ok(metric(m, 'pdserve_prefix_store_files') >= 1);
    assert.ok(metric(m, 'pdserve_prefix_store_bytes') > 0);
  });

  test('worker /metrics with the store pass promtool', async () => {
    for (const url of [h.c.byRole('decode')[0]!.url, h.c.byRole('prefill')[0]!.url, colo.url]) {
      const t = await text(`${url}/metrics`);
      assert.match(t, /pdserve_prefix_store_budget_bytes \d+/);
      const res = checkMetrics(t);
      if (res) assert.ok(res.ok, `${url}: ${res.output}`);
    }
    const dm = await text(`${h.c.byRole('decode')[0]!.url}/metrics`);
    assert.ok(metric(dm, 'pdserve_prefix_store_writes_total') >= 4, 'decode stored its finished rounds');
    assert.equal(metric(dm, 'pdserve_prefix_store_refused_total'), 0);
  });

  test('torn store files under real workers: refused and removed, the round equals no cache, every process lives', async () => {
    const files = readdirSync(storeDir).filter((f) => f.endsWith('.pdkv'));
    assert.ok(files.length > 0);
    for (const f of files) truncateSync(join(storeDir, f), Math.floor(statSync(join(storeDir, f)).size / 2));
    const workers = [...h.c.byRole('decode'), ...h.c.byRole('prefill')].map((p) => p.url);
    const refused = async () => {
      let n = 0;
      for (const url of [...workers, colo.url]) n += metric(await text(`${url}/metrics`), 'pdserve_prefix_store_refused_total');
      return n;
    };
    const before = await refused();
    messages.push({ role: 'user', content: `tool result 7: ${'torn '.repeat(9)}` });
    const ref = await round(h.ref, messages, false);
    const a = await round(h.pd, messages, true);
    assert.equal(a.text, ref.text, 'served cold from torn entries, same output');
    assert.ok((await refused()) > before, 'a torn entry was refused');
    assert.ok(readdirSync(storeDir).filter((f) => files.includes(f)).length < files.length, 'and removed');
    for (const p of [...h.c.byRole('decode'), ...h.c.byRole('prefill')]) {
      assert.equal(p.child?.exitCode, null, `${p.name} lives`);
      assert.equal((await (await fetch(`${p.url}/health`)).json() as { status: string }).status, 'ok');
    }
  });
});
