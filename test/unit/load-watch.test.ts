/**
 * Shared load across routers: a worker's GET /load long poll (answers at once on a changed sig,
 * else when its count changes or the wait ends) and the router's LoadWatch over real HTTP
 * (other routers' load = the worker's rooms − this router's own count at the reading; a reading
 * that is too old counts as none), and the picker's decode packing with two routers' load.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import Fastify from 'fastify';
import { registerLoadRoute, loadSig, type WorkerLoad } from '../../src/worker/load-route.js';
import { LoadWatch, LOAD_STALE_MS } from '../../src/router/load-watch.js';
import { createPolicy } from '../../src/router/policy/index.js';

async function worker(l: WorkerLoad) {
  const app = Fastify();
  registerLoadRoute(app, () => l);
  const url = await app.listen({ host: '127.0.0.1', port: 0 });
  return { app, url, l };
}
const until = async (f: () => boolean, ms: number) => {
  const t0 = performance.now();
  while (!f() && performance.now() - t0 < ms) await new Promise((r) => setTimeout(r, 5));
  return f();
};

describe('GET /load', () => {
  test('answers at once without a matching sig; waits for a change, or the wait, with one', async () => {
    const w = await worker({ rooms: 1, slots: 4, slots_free: 3 });
    try {
      const now = await (await fetch(`${w.url}/load?after=x&wait_ms=5000`)).json();
      assert.deepEqual(now, { sig: loadSig(w.l), rooms: 1, slots: 4, slots_free: 3 });
      let t0 = performance.now();
      const waited = fetch(`${w.url}/load?after=${encodeURIComponent(now.sig)}&wait_ms=5000`).then((r) => r.json());
      setTimeout(() => (w.l.rooms = 2), 100);
      assert.equal((await waited).rooms, 2);
      const ms = performance.now() - t0;
      assert.ok(ms >= 90 && ms < 1000, `answered ${Math.round(ms)} ms after the poll (the change came at 100 ms)`);
      t0 = performance.now();
      const idle = await (await fetch(`${w.url}/load?after=${encodeURIComponent(loadSig(w.l))}&wait_ms=200`)).json();
      assert.equal(idle.rooms, 2);
      assert.ok(performance.now() - t0 >= 190, 'nothing changed: answered when the wait ended');
    } finally {
      await w.app.close();
    }
  });

  test('the app closes with a long poll pending', async () => {
    const w = await worker({ rooms: 0, slots: 1, slots_free: 1 });
    const p = fetch(`${w.url}/load?after=${encodeURIComponent(loadSig(w.l))}&wait_ms=10000`).then((r) => r.status).catch(() => 0);
    await new Promise((r) => setTimeout(r, 50));
    const t0 = performance.now();
    await w.app.close();
    await p;
    assert.ok(performance.now() - t0 < 2000, 'close did not wait for the long poll');
  });
});

describe('LoadWatch', () => {
  test("others' load = the worker's rooms − own at the reading, within a round trip of a change; 0 once stale", async () => {
    const w = await worker({ rooms: 0, slots: 4, slots_free: 4 });
    let own = 0;
    let clock = 0;
    const lw = new LoadWatch(() => own, undefined, undefined, 300, () => performance.now() + clock);
    try {
      lw.follow(w.url);
      assert.ok(await until(() => lw.oldestMs() < 1000, 2000), 'first reading');
      assert.equal(lw.others(w.url), 0);
      // another router sends 3 requests
      w.l.rooms = 3;
      const t0 = performance.now();
      assert.ok(await until(() => lw.others(w.url) === 3, 1000), `others = 3 (got ${lw.others(w.url)})`);
      assert.ok(performance.now() - t0 < 150, `seen ${Math.round(performance.now() - t0)} ms after the change`);
      // this router sends one (its own count rises first, then the worker's): still 3 others
      own = 1;
      w.l.rooms = 4;
      await new Promise((r) => setTimeout(r, 60));
      assert.equal(lw.others(w.url), 3);
      // the worker goes away: the reading ages out
      await w.app.close();
      clock = LOAD_STALE_MS + 1000;
      assert.equal(lw.others(w.url), 0, 'a stale reading counts as no other load');
    } finally {
      await lw.close();
      await w.app.close();
    }
  });

  test('decode packing with the other router\'s load: the full decode is skipped', () => {
    // two CPU decodes of 4 slots; this router has nothing in flight, the other router filled d0
    const gpu = { gpu: null };
    const p = createPolicy('cache_aware', { packBatches: true });
    const own = [
      { url: 'http://d0', load: 0, slots: 4, gpu },
      { url: 'http://d1', load: 0, slots: 4, gpu },
    ];
    const others: Record<string, number> = { 'http://d0': 4, 'http://d1': 0 };
    const views = own.map((w) => ({ ...w, load: w.load + others[w.url]! }));
    const first = p.pick(views, 'x', 0)!;
    assert.equal(first.worker.url, 'http://d1', 'the decode with free slots');
    assert.equal(first.reason, 'packed');
  });
});
