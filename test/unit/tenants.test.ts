/**
 * Tenant isolation's sans-IO parts: the tenant of a key and the cache salt of a request
 * (src/api/access.ts), the prefix cache's choice under salts (src/engine/prefix-cache.ts), the
 * prefix store's salted key namespace (src/engine/prefix-store.ts), and the Responses store seen
 * by one tenant (src/api/responses-store.ts `of`).
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { cacheSaltOf, tenantOfKey } from '../../src/api/access.js';
import { chooseSequence, type CachedSequence } from '../../src/engine/prefix-cache.js';
import { keyChain, saltedNamespace } from '../../src/engine/prefix-store.js';
import { ResponseStore } from '../../src/api/responses-store.js';

test('a tenant per key (not the key, not reversible); a request salt: the client cache_salt wins, else the tenant, else none', () => {
  const a = tenantOfKey('sk-a');
  assert.match(a, /^[0-9a-f]{32}$/);
  assert.notEqual(a, tenantOfKey('sk-b'));
  assert.equal(a, tenantOfKey('sk-a'));
  assert.ok(!a.includes('sk-a'));
  assert.equal(cacheSaltOf(a, undefined), `t:${a}`);
  assert.equal(cacheSaltOf(undefined, undefined), undefined, 'an open server: one cache');
  const shared = cacheSaltOf(a, 'team');
  assert.match(shared!, /^s:[0-9a-f]{32}$/);
  assert.equal(cacheSaltOf(tenantOfKey('sk-b'), 'team'), shared, 'the same cache_salt shares across keys');
  assert.notEqual(cacheSaltOf(undefined, `${a}`), `t:${a}`, "a client cannot name another tenant's salt");
});

test('the prefix cache reuses only sequences of the same salt; another salt\'s sequence is evicted like an empty one would not be', () => {
  const settings = { enabled: true, align: null, maxTokens: 1e6 };
  const tokens = Array.from({ length: 100 }, (_, i) => i + 1);
  const seq = (index: number, salt: string | undefined, t: number[] = tokens): CachedSequence => ({ index, tokens: t, exactPrefix: t.length, lastUsed: index, salt });
  const free = [seq(0, 't:a'), seq(1, undefined, [])];
  assert.deepEqual(((c) => [c!.seq.index, c!.reuse])(chooseSequence(free, tokens, settings, undefined, 't:a')), [0, 99], 'its own salt: reused');
  assert.deepEqual(((c) => [c!.seq.index, c!.reuse])(chooseSequence(free, tokens, settings, undefined, 't:b')), [1, 0], 'another salt: an empty sequence, nothing reused');
  assert.deepEqual(((c) => [c!.seq.index, c!.reuse])(chooseSequence(free, tokens, settings, undefined, undefined)), [1, 0], 'unsalted: neither');
  assert.equal(chooseSequence([seq(0, 't:a')], tokens, settings, undefined, 't:b')!.reuse, 0, "the only idle one is another salt's: taken with nothing reused (cleared)");
});

test("the prefix store keys a salt's entries under their own namespace: another salt's chain never meets them", () => {
  const ns = 'f'.repeat(64);
  const tokens = Array.from({ length: 128 }, (_, i) => i);
  assert.equal(saltedNamespace(ns, undefined), ns);
  const a = keyChain(saltedNamespace(ns, 't:a'), tokens, 2);
  const b = keyChain(saltedNamespace(ns, 't:b'), tokens, 2);
  const none = keyChain(ns, tokens, 2);
  assert.equal(a.length, 2);
  for (const k of a) assert.ok(!b.includes(k) && !none.includes(k));
  assert.deepEqual(keyChain(saltedNamespace(ns, 't:a'), tokens, 2), a, 'stable');
});

test('stored Responses: a tenant sees, continues and deletes its own only; an open server (no tenant) neither sees a tenant\'s', () => {
  const s = new ResponseStore();
  const rec = (id: string) => ({ id, response: { id }, history: [], items: new Map([[`msg_${id}`, { id: `msg_${id}` }]]), input: [], bytes: 10 });
  assert.ok(s.of('A').put(rec('resp_1')));
  assert.equal(s.of('A').get('resp_1')?.id, 'resp_1');
  assert.equal(s.of('B').get('resp_1'), undefined);
  assert.equal(s.of(undefined).get('resp_1'), undefined);
  assert.equal(s.of('B').item('msg_resp_1'), undefined, "another tenant's item_reference is unknown");
  assert.ok(s.of('A').item('msg_resp_1'));
  assert.equal(s.of('B').delete('resp_1'), false);
  assert.equal(s.size, 1, 'still there');
  assert.equal(s.of('A').delete('resp_1'), true);
  assert.equal(s.size, 0);
});
