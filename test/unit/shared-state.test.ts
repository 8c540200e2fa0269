/**
 * What several routers share (src/api/admission.ts `SharedAdmission`, src/api/responses-store.ts
 * `SharedResponses`), over an in-memory table standing for etcd: per-key limits count every
 * router's shard (summed; a shard of an older window counts 0, never a max() merge); a stored
 * Response is read through from another router's store, and a deletion reaches the copies.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import Fastify from 'fastify';
import { Registry } from 'prom-client';
import { registerAdmission, type AdmissionShard, type SharedAdmission } from '../../src/api/admission.js';
import { registerOpenAIErrorHandling } from '../../src/api/errors.js';
import { ResponseStore, type SharedResponses, type StoredResponse } from '../../src/api/responses-store.js';

/** The shards every router wrote: router → key → shard (what etcd holds under the admission prefix). */
class Shards {
  readonly table = new Map<string, Map<string, AdmissionShard>>();
  of(router: string): SharedAdmission {
    return {
      others: (key, window) => {
        let inflight = 0;
        let admitted = 0;
        for (const [r, m] of this.table) {
          const s = r === router ? undefined : m.get(key);
          if (!s) continue;
          inflight += s.inflight;
          if (s.window === window) admitted += s.admitted;
        }
        return { inflight, admitted };
      },
      publish: (key, shard) => {
        if (!this.table.has(router)) this.table.set(router, new Map());
        this.table.get(router)!.set(key, { ...shard });
      },
    };
  }
}

async function router(shared: SharedAdmission, o: Parameters<typeof registerAdmission>[1]) {
  const app = Fastify({ forceCloseConnections: true });
  registerOpenAIErrorHandling(app);
  registerAdmission(app, o, new Registry(), shared);
  const gates: (() => void)[] = [];
  app.post('/v1/hold', () => new Promise((r) => gates.push(() => r({ ok: true }))));
  app.post('/v1/fast', async () => ({ ok: true }));
  await app.listen({ port: 0, host: '127.0.0.1' });
  const url = `http://127.0.0.1:${(app.server.address() as { port: number }).port}`;
  return { app, gates, post: (p: string) => fetch(`${url}${p}`, { method: 'POST', signal: AbortSignal.timeout(5000) }) };
}
const until = async (f: () => boolean) => {
  for (let i = 0; i < 200 && !f(); i++) await new Promise((r) => setTimeout(r, 10));
  assert.ok(f());
};

describe('per-key admission across routers', () => {
  test('2 in flight per key: two held through A refuse a third through B; a release through A admits B again', async () => {
    const shards = new Shards();
    const a = await router(shards.of('a'), { keyMaxConcurrent: 2 });
    const b = await router(shards.of('b'), { keyMaxConcurrent: 2 });
    try {
      const held = [a.post('/v1/hold'), a.post('/v1/hold')];
      await until(() => a.gates.length === 2);
      const refused = await b.post('/v1/fast');
      assert.equal(refused.status, 429);
      assert.match(((await refused.json()) as { error: { message: string } }).error.message, /across the routers/);
      a.gates.shift()!();
      await held[0];
      await until(() => [...shards.table.get('a')!.values()][0]!.inflight === 1);
      assert.equal((await b.post('/v1/fast')).status, 200, 'one in flight through A: B admits');
      a.gates.shift()!();
      await held[1];
    } finally {
      await a.app.close();
      await b.app.close();
    }
  });

  test('requests per second: the shards of this window are summed, an older window counts 0 (no max() merge)', async () => {
    const shards = new Shards();
    const b = await router(shards.of('b'), { keyRps: 2, keyBurst: 2 });
    try {
      const now = Math.floor(Date.now() / 1000);
      // wait for a fresh second, so the window does not turn during the test
      await new Promise((r) => setTimeout(r, 1000 - (Date.now() % 1000) + 20));
      const w = Math.floor(Date.now() / 1000);
      // router A admitted 5 in an old window (a reset window: must not count) and 1 in this one
      shards.table.set('a', new Map([['ip:127.0.0.1', { inflight: 0, window: now - 5, admitted: 5 }]]));
      assert.equal((await b.post('/v1/fast')).status, 200, 'an old window adds nothing');
      shards.table.set('a', new Map([['ip:127.0.0.1', { inflight: 0, window: w, admitted: 1 }]]));
      const r = await b.post('/v1/fast');
      assert.equal(r.status, 429, '1 through B + 1 through A = the limit of 2 in this window');
      assert.ok(Number(r.headers.get('retry-after')) >= 1);
    } finally {
      await b.app.close();
    }
  });
});

describe('stored Responses across routers', () => {
  test('read through from another router, deletion reaches the copy, the answer waits for the share', async () => {
    const table = new Map<string, StoredResponse>();
    const listeners: ((id: string) => void)[] = [];
    let delay = 0;
    const shared = (): SharedResponses => ({
      publishResponse: async (r) => {
        await new Promise((res) => setTimeout(res, delay));
        table.set(r.id, r);
      },
      unpublishResponse: (id) => {
        table.delete(id);
        for (const f of listeners) f(id);
      },
      fetchResponse: async (id) => table.get(id),
      onResponseDeleted: (f) => void listeners.push(f),
    });
    const a = new ResponseStore(undefined, undefined, shared());
    const b = new ResponseStore(undefined, undefined, shared());
    const rec = { id: 'resp_1', response: { id: 'resp_1' }, history: [], items: new Map([['msg_1', { id: 'msg_1' }]]), input: [], bytes: 10 };
    delay = 50;
    const t0 = performance.now();
    assert.ok(a.of(undefined).put(rec));
    await a.of(undefined).shared('resp_1');
    assert.ok(performance.now() - t0 >= 45, 'shared() waited for the publication');
    assert.equal(b.of(undefined).get('resp_1'), undefined, 'not local to B');
    await b.of(undefined).load('resp_1');
    assert.equal(b.of(undefined).get('resp_1')?.id, 'resp_1', 'read through');
    assert.deepEqual(b.of(undefined).item('msg_1'), { id: 'msg_1' }, 'with its items');
    assert.equal(b.of('tenant-x').get('resp_1'), undefined, 'another tenant still does not see it');
    assert.ok(a.of(undefined).delete('resp_1'));
    assert.equal(b.of(undefined).get('resp_1'), undefined, 'the copy went with the deletion');
    await b.of(undefined).load('resp_1');
    assert.equal(b.of(undefined).get('resp_1'), undefined, 'and is not read through again');
  });
});
