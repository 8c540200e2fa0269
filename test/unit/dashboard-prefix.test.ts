/**
 * The dashboard's prefix-store card from gathered worker metrics: a host's shared store counts
 * once however many of its workers report it, hosts add up, lookups / evictions / published
 * events sum over workers, unreachable workers count nothing, the router's figures pass through.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { parsePrometheus } from '../../src/observe/gather.js';
import { prefixStoreCard } from '../../src/router/dashboard-prefix.js';

const worker = (bytes: number, files: number, seq: [number, number], store: [number, number], evictions: number, published: number) =>
  parsePrometheus(
    [
      `pdserve_prefix_store_bytes ${bytes}`,
      `pdserve_prefix_store_files ${files}`,
      'pdserve_prefix_store_budget_bytes 1048576',
      `pdserve_prefix_cache_lookups_total{tier="sequence",result="hit"} ${seq[0]}`,
      `pdserve_prefix_cache_lookups_total{tier="sequence",result="miss"} ${seq[1]}`,
      `pdserve_prefix_cache_lookups_total{tier="store",result="hit"} ${store[0]}`,
      `pdserve_prefix_cache_lookups_total{tier="store",result="miss"} ${store[1]}`,
      `pdserve_prefix_store_evictions_total ${evictions}`,
      `pdserve_kv_events_published_total{tier="sequence",kind="stored"} ${published}`,
      `pdserve_kv_events_published_total{tier="store",kind="evicted"} 1`,
    ].join('\n'),
  );

test('one store per host, hosts add up; lookups, evictions and events sum; the router figures pass through', () => {
  const card = prefixStoreCard(
    [
      { url: 'http://10.0.0.1:8001', metrics: worker(1000, 2, [3, 1], [1, 2], 1, 4) },
      // the same host's store, seen by a second process after one more write
      { url: 'http://10.0.0.1:8002', metrics: worker(1500, 3, [0, 5], [2, 0], 2, 1) },
      { url: 'http://10.0.0.2:8001', metrics: worker(200, 1, [1, 1], [0, 1], 0, 0) },
      { url: 'http://10.0.0.3:8001', metrics: null },
    ],
    { consumed: 9, gaps: 1, held: 3 },
  );
  assert.deepEqual(card, {
    store: { bytes: 1700, files: 4, budget_bytes: 2 * 1048576, hosts: 2 },
    lookups: { sequence: { hit: 4, miss: 7 }, store: { hit: 3, miss: 3 } },
    evictions: 3,
    events: { published: 8, consumed: 9, gaps: 1, held: 3 },
  });
});

test('workers without a store (--prefix-store-bytes 0) report lookups only', () => {
  const card = prefixStoreCard([{ url: 'http://h:1', metrics: parsePrometheus('pdserve_prefix_cache_lookups_total{tier="sequence",result="miss"} 2') }], { consumed: 0, gaps: 0, held: 0 });
  assert.deepEqual(card.store, { bytes: 0, files: 0, budget_bytes: 0, hosts: 0 });
  assert.equal(card.lookups.sequence.miss, 2);
});
