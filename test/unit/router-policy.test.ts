/**
 * Router load-balancing policies (src/router/policy): the approximate prefix tree and the four
 * policies, on plain worker objects (no sockets: this is pure selection logic).
 * Run: node --import tsx --test test/unit/router-policy.test.ts
 */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import fc from 'fast-check';
import { createPolicy, localPrefillFor, routingText, type PolicyWorker } from '../../src/router/policy/index.js';
import { conversationKey, SessionTable } from '../../src/router/policy/affinity.js';
import { ownedSlice, PrefixTree } from '../../src/router/policy/radix-tree.js';
import v8 from 'node:v8';
import vm from 'node:vm';

const workers = (...loads: number[]): PolicyWorker[] => loads.map((load, i) => ({ url: `http://w${i}`, load }));

describe('prefix tree', () => {
  it('matches the longest prefix per tenant and splits edges', () => {
    const t = new PrefixTree(1000);
    t.insert('hello world', 'a', 1);
    t.insert('hello there', 'b', 2);
    t.insert('help', 'a', 3);
    const m = t.match('hello world again');
    assert.equal(m.matchedChars, 11);
    assert.equal(m.byTenant.get('a'), 11);
    assert.equal(m.byTenant.get('b'), 6, 'b shares "hello "');
    assert.equal(t.match('xyz').matchedChars, 0);
    assert.equal(t.match('hel').byTenant.get('b'), 3);
    assert.equal(t.tenantChars('a'), 'hello world'.length + 1, 'a holds "hel" + "lo world"/"lo " split + "p"');
    assert.equal(t.tenantChars('b'), 'hello there'.length);
  });

  it('evicts a tenant\'s least recently used leaves down to its bound, leaving other tenants intact', () => {
    const t = new PrefixTree(1_000_000);
    t.insert('aaaa1111', 'x', 1);
    t.insert('aaaa2222', 'x', 2);
    t.insert('bbbb3333', 'x', 3);
    t.insert('aaaa1111', 'y', 4);
    t.evict('x', 16);
    assert.equal(t.match('aaaa1111').byTenant.get('x'), 4, 'the oldest leaf "1111" went first');
    assert.equal(t.match('aaaa2222').byTenant.get('x'), 8);
    assert.equal(t.match('aaaa1111').byTenant.get('y'), 8, 'y keeps its path');
    assert.equal(t.tenantChars('x'), 16);
    t.removeTenant('x');
    assert.equal(t.tenantChars('x'), 0);
    assert.equal(t.match('bbbb3333').matchedChars, 0, 'nodes nobody holds are gone');
    assert.equal(t.match('aaaa1111').byTenant.get('y'), 8);
  });

  it('keeps each tenant within ~its bound on insert, and sizes stay exact (property)', () => {
    fc.assert(
      fc.property(fc.array(fc.tuple(fc.string({ unit: fc.constantFrom('a', 'b', 'c'), maxLength: 12 }), fc.constantFrom('p', 'q')), { maxLength: 60 }), (ops) => {
        const t = new PrefixTree(20);
        ops.forEach(([s, who], i) => t.insert(s, who, i));
        for (const who of ['p', 'q']) assert.ok(t.tenantChars(who) <= 22 + 12, `${who}: ${t.tenantChars(who)}`);
        // every inserted text of the last op is fully matched for its tenant
        const last = ops[ops.length - 1];
        if (last) assert.equal(t.match(last[0]).byTenant.get(last[1]) ?? 0, last[0].length);
      }),
    );
  });
});

describe('prefix tree memory', () => {
  it('follows the characters it holds, not the prompts routed: 20 000 prompts sharing a 1.6 KB prefix', () => {
    v8.setFlagsFromString('--expose-gc');
    const gc = vm.runInNewContext('gc') as () => void;
    const shared = 'You are a helpful agent. '.repeat(64);
    gc();
    const before = process.memoryUsage().heapUsed;
    const t = new PrefixTree(4 << 20);
    for (let i = 0; i < 20_000; i++) t.insert(`${shared}task ${i}: ${'step '.repeat(18)}${i}`, `http://w${i % 2}`, i);
    gc();
    const grown = process.memoryUsage().heapUsed - before;
    const chars = t.tenantChars('http://w0') + t.tenantChars('http://w1');
    // ≈ 2 M characters and 20 k nodes: 13 MB measured; edges that were views of their prompts kept 46 MB
    assert.ok(chars < 2.1e6, `${chars} characters`);
    assert.ok(grown < 24e6, `the tree grew the heap by ${(grown / 1e6).toFixed(1)} MB for ${chars} characters`);
    assert.equal(t.match(`${shared}task 7: `).matchedChars, shared.length + 8);
  });

  it('ownedSlice is slice', () => {
    fc.assert(fc.property(fc.string({ unit: 'binary' }), fc.nat(), fc.nat(), (s, a, b) => ownedSlice(s, a % (s.length + 1), b % (s.length + 1)) === s.slice(a % (s.length + 1), b % (s.length + 1))));
    assert.equal(ownedSlice('\ud800'.repeat(20), 3), '\ud800'.repeat(17), 'lone surrogates survive');
  });
});

describe('policies', () => {
  it('round_robin takes turns; least_load takes the least loaded (ties in turn)', () => {
    const rr = createPolicy('round_robin');
    const w = workers(5, 0, 9);
    assert.deepEqual([0, 1, 2, 3].map(() => rr.pick(w, 'x', 0)!.worker.url), ['http://w0', 'http://w1', 'http://w2', 'http://w0']);
    const ll = createPolicy('least_load');
    assert.equal(ll.pick(w, 'x', 0)!.worker.url, 'http://w1');
    const tie = workers(1, 1);
    assert.deepEqual([ll.pick(tie, '', 0)!.worker.url, ll.pick(tie, '', 0)!.worker.url].sort(), ['http://w0', 'http://w1']);
    assert.equal(rr.pick([], 'x', 0), null);
    assert.equal(ll.pick([], 'x', 0), null);
  });

  it('power_of_two takes the less loaded of two distinct random workers', () => {
    const seq = [0.0, 0.99, 0.5, 0.0];
    let i = 0;
    const p = createPolicy('power_of_two', {}, () => seq[i++ % seq.length]!);
    const w = workers(3, 7, 1);
    // draws 0.0 → w0 and 0.99 → w2 (of the other two): w2 has the lower load
    assert.equal(p.pick(w, '', 0)!.worker.url, 'http://w2');
    // draws 0.5 → w1 and 0.0 → w0: w0 (3) beats w1 (7)
    assert.equal(p.pick(w, '', 0)!.worker.url, 'http://w0');
    for (let k = 0; k < 50; k++) assert.notEqual(createPolicy('power_of_two').pick(w, '', 0)!.worker.url, 'http://w1', 'the most loaded of three can never win two-choice');
  });

  it('cache_aware routes a conversation\'s rounds to the worker holding its prefix', () => {
    const p = createPolicy('cache_aware', { cacheThreshold: 0.3 });
    const w = workers(0, 0, 0);
    const a1 = 'agent A: system prompt, tools, round 1';
    const b1 = 'agent B: a different system prompt, round 1';
    const wa = p.pick(w, a1, 1)!;
    assert.equal(wa.reason, 'cache_miss');
    const wb = p.pick(w, b1, 2)!;
    assert.notEqual(wb.worker.url, wa.worker.url, 'a miss goes to the worker with the smallest tree');
    for (let r = 2; r <= 6; r++) {
      const ra = p.pick(w, `${a1} … round ${r}`, 2 + r)!;
      assert.equal(ra.worker.url, wa.worker.url, `A round ${r}`);
      assert.equal(ra.reason, 'cache_hit');
      assert.equal(p.pick(w, `${b1} … round ${r}`, 3 + r)!.worker.url, wb.worker.url, `B round ${r}`);
    }
  });

  it('cache_aware falls back to the least loaded worker when the load is imbalanced (both thresholds)', () => {
    const p = createPolicy('cache_aware', { balanceAbsThreshold: 4, balanceRelThreshold: 1.5 });
    const text = 'hot prefix shared by everyone';
    const w0 = { url: 'http://w0', load: 0 };
    const w1 = { url: 'http://w1', load: 0 };
    assert.equal(p.pick([w0, w1], text, 1)!.worker, w0);
    // hot prefix piles on w0 until max − min > 4 and max > 1.5 × min
    w0.load = 4;
    assert.equal(p.pick([w0, w1], text, 2)!.reason, 'cache_hit', 'diff 4 is not > 4');
    w0.load = 5;
    const r = p.pick([w0, w1], text, 3)!;
    assert.equal(r.reason, 'imbalanced');
    assert.equal(r.worker, w1);
    // abs exceeded but not rel: 20 vs 14 (20 < 21)
    w0.load = 20;
    w1.load = 14;
    assert.equal(p.pick([w0, w1], text, 4)!.reason, 'cache_hit');
  });

  it('cache_aware below the threshold goes to the smallest tree; routing text follows the message order', () => {
    const p = createPolicy('cache_aware', { cacheThreshold: 0.9 });
    const w = workers(0, 0);
    const first = p.pick(w, 'abcdefghij', 1)!.worker.url;
    const r = p.pick(w, 'abcdeXXXXX', 2)!;
    assert.equal(r.reason, 'cache_miss');
    assert.notEqual(r.worker.url, first);
    assert.equal(routingText({ kind: 'chat', messages: [{ role: 'system', content: 's' }, { role: 'user', content: 'u' }] }), '<|system|>s<|user|>u');
    assert.equal(routingText({ kind: 'completion', prompt: { input_ids: [1, 2] } }), '1,2,');
    assert.equal(routingText({ kind: 'completion', prompt: { text: 'hi' } }), 'hi');
  });
});

describe('session affinity', () => {
  it('the session key: prompt_cache_key, then user, then x-session-id; nothing derived from the prompt', () => {
    assert.equal(conversationKey({ kind: 'chat', promptCacheKey: 'k', user: 'u' }, 's'), 'k:k');
    assert.equal(conversationKey({ kind: 'chat', user: 'u' }, 's'), 'u:u');
    assert.equal(conversationKey({ kind: 'chat' }, 's'), 's:s');
    assert.equal(conversationKey({ kind: 'chat' }, undefined), undefined, 'agents that open alike are not one session');
    assert.equal(conversationKey({ kind: 'completion' }, undefined), undefined);
    assert.equal(conversationKey({ kind: 'chat' }, ''), undefined);
  });

  it('cache_aware keeps a key on its worker whatever the text, until the load guard says it is overloaded', () => {
    const p = createPolicy('cache_aware', { balanceAbsThreshold: 4, balanceRelThreshold: 1.5 });
    const w = workers(0, 0, 0);
    const first = p.pick(w, 'conversation A round 1', 0, 'k:a')!;
    // unrelated texts (no tree match) under the same key: the same worker, reason affinity
    for (let i = 0; i < 5; i++) {
      const again = p.pick(w, `something else entirely ${i} ${'x'.repeat(i * 7)}`, i + 1, 'k:a')!;
      assert.deepEqual([again.worker.url, again.reason], [first.worker.url, 'affinity']);
    }
    // without the key the smallest-tree rule sends the text elsewhere
    assert.notEqual(p.pick(w, 'another conversation', 9)!.worker.url, first.worker.url);
    // the key's worker 5 ahead of the least loaded (> 4 and > 1.5×): moved to the least loaded, and the key follows
    const i = w.findIndex((x) => x.url === first.worker.url);
    const loaded = w.map((x, j) => ({ ...x, load: j === i ? 6 : 1 }));
    const moved = p.pick(loaded, 'conversation A round 2', 10, 'k:a')!;
    assert.equal(moved.reason, 'imbalanced');
    assert.notEqual(moved.worker.url, first.worker.url);
    assert.equal(p.pick(w, 'conversation A round 3', 11, 'k:a')!.worker.url, moved.worker.url, 'the key now lives on its new worker');
    // a busy but not overloaded worker keeps the key (6 vs 3: > 1.5× but not > 4 ahead)
    const busy = w.map((x) => ({ ...x, load: x.url === moved.worker.url ? 6 : 3 }));
    assert.equal(p.pick(busy, 'round 4', 12, 'k:a')!.reason, 'affinity');
    // a removed worker's keys are forgotten; a key whose worker is not a candidate is picked afresh
    p.forget!(moved.worker.url);
    assert.notEqual(p.pick(w, 'round 5', 13, 'k:a')!.reason, 'affinity');
    const others = w.filter((x) => x.url !== first.worker.url);
    p.pick(w.filter((x) => x.url === first.worker.url), 'pin', 14, 'k:b');
    assert.notEqual(p.pick(others, 'pin', 15, 'k:b')!.reason, 'affinity');
  });

  it('decode batch packing on CPU hosts: the most loaded worker with a free slot; a held or sticky conversation still wins; GPUs and unknown hosts spread', () => {
    const cpu = { gpu: null, gpu_devices: [], gpu_layers: '0/3' };
    const pool = (loads: number[], slots = 4, gpu: object | undefined = cpu) => loads.map((load, i) => ({ url: `http://w${i}`, load, slots, gpu }));
    const p = createPolicy('cache_aware', { packBatches: true, balanceAbsThreshold: 64 });
    // eight new conversations at once, each pick's load counted before the next: 4 fill w0, then w1
    const loads = [0, 0];
    const got: string[] = [];
    for (let i = 0; i < 8; i++) {
      const pick = p.pick(pool(loads), String.fromCharCode(65 + i).repeat(20), i, `k:${i}`)!;
      assert.equal(pick.reason, 'packed');
      got.push(pick.worker.url);
      loads[Number(pick.worker.url.slice(-1))]!++;
    }
    assert.deepEqual(got, [...Array(4).fill('http://w0'), ...Array(4).fill('http://w1')]);
    // the busier worker first while it has a free slot, whichever it is in pool order
    assert.equal(p.pick(pool([1, 3]), 'new a', 10, 'k:new-a')!.worker.url, 'http://w1');
    // every slot in use: the usual smallest-tree rule
    assert.notEqual(p.pick(pool([4, 4]), 'new b', 11, 'k:new-b')!.reason, 'packed');
    // the cache-aware choices come first: a conversation stays on the worker that served it
    assert.deepEqual(((x) => [x.worker.url, x.reason])(p.pick(pool([1, 3]), 'any text', 12, 'k:0')!), ['http://w0', 'affinity']);
    const exact = { promptTokens: 100, matched: (url: string) => (url === 'http://w0' ? 96 : 0) };
    assert.deepEqual(((x) => [x.worker.url, x.reason])(p.pick(pool([0, 3]), 'other text', 13, 'k:held', exact)!), ['http://w0', 'cache_hit']);
    // the load guard: a worker it calls overloaded is not filled further
    const guarded = createPolicy('cache_aware', { packBatches: true, balanceAbsThreshold: 2, balanceRelThreshold: 1.5 });
    assert.equal(guarded.pick(pool([0, 3], 8), 'guarded', 0, 'k:g')!.worker.url, 'http://w0', 'w1 (3 vs 0) is overloaded');
    // a GPU worker, or one that reports no slots or no offload, is not packed
    const gpu = { gpu: 'cuda', gpu_devices: ['A100'], gpu_layers: '33/33' };
    for (const c of [pool([0, 1], 4, gpu), pool([0, 1]).map(({ gpu: _g, ...w }) => w), pool([0, 1]).map(({ slots: _s, ...w }) => w)]) {
      assert.notEqual(createPolicy('cache_aware', { packBatches: true }).pick(c, 'spread', 0, 'k:s')!.reason, 'packed');
    }
    // off by default (the prefill policy): spread as before
    assert.notEqual(createPolicy('cache_aware').pick(pool([0, 1]), 'spread', 0, 'k:s')!.reason, 'packed');
  });

  it('an affinity pick goes decode-local only on the exact numbers of what its worker holds', () => {
    const p = createPolicy('cache_aware');
    const w = workers(0, 0);
    const first = p.pick(w, 'abc', 0, 'k:x')!.worker.url;
    const holds = { promptTokens: 300, matched: (url: string) => (url === first ? 64 : 0) };
    const pick = p.pick(w, 'zzz unrelated', 1, 'k:x', holds)!;
    assert.deepEqual([pick.worker.url, pick.reason, pick.matchedTokens], [first, 'affinity', 64]);
    assert.equal(localPrefillFor(256, 'cache_aware', pick, 300), 256, 'lacks 236 tokens');
    assert.equal(localPrefillFor(256, 'cache_aware', p.pick(w, 'zzz unrelated', 2, 'k:x')!, 300), undefined, 'no exact facts: PD');
  });

  it('the session table is LRU-bounded', () => {
    const t = new SessionTable(2);
    t.set('a', 'w1');
    t.set('b', 'w2');
    t.get('a');
    t.set('c', 'w3');
    assert.deepEqual([t.get('a'), t.get('b'), t.get('c'), t.size], ['w1', undefined, 'w3', 2]);
  });
});

describe('routing on KV events', () => {
  it('the worker holding the longest run of the prompt\'s blocks wins; an overloaded one is passed over; no tree once every worker is known', () => {
    const p = createPolicy('cache_aware', { balanceAbsThreshold: 2 });
    const w = workers(0, 0);
    const [a, b] = [w[0]!.url, w[1]!.url];
    // the tree says a (a round recorded there), the events say b holds 90 % of the prompt
    p.record!('shared system prompt and task', a, 0);
    const facts = { promptTokens: 1000, matched: (url: string) => (url === b ? 900 : 16) };
    const hit = p.pick(w, 'shared system prompt and task', 1, undefined, facts)!;
    assert.deepEqual([hit.worker.url, hit.reason, hit.matchedTokens], [b, 'cache_hit', 900]);
    assert.equal(localPrefillFor(256, 'cache_aware', hit, 1000), 256);
    // below the threshold of the prompt: no cache hit, and with every worker known the tree is not asked
    const low = p.pick(w, 'shared system prompt and task', 2, undefined, { promptTokens: 1000, matched: () => 16 })!;
    assert.equal(low.reason, 'cache_miss');
    assert.equal(localPrefillFor(256, 'cache_aware', low, 1000), undefined, 'lacks 984 tokens');
    // an overloaded holder is not taken
    const loaded = w.map((x) => ({ ...x, load: x.url === b ? 100 : 0 }));
    assert.notEqual(p.pick(loaded, 'x', 3, undefined, facts)!.worker.url, b);
    // a worker without live events (undefined): the tree is the fallback
    const partial = p.pick(w, 'shared system prompt and task', 4, undefined, { promptTokens: 1000, matched: (url: string) => (url === b ? 0 : undefined) })!;
    assert.deepEqual([partial.worker.url, partial.reason], [a, 'cache_hit'], 'the tree decides for the unknown worker');
    assert.equal(localPrefillFor(256, 'cache_aware', partial, 1000), undefined, 'no exact number for it: PD');
  });
});
