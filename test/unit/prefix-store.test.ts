/**
 * The host-wide prefix store (src/prefixes/prefix-store.ts, keys in src/engine/prefix-store.ts) on
 * real files, with synthetic but complete ggsq states: the key chain finds a shorter ancestor;
 * entries are validated as handed-over states (torn, corrupt, foreign entries refused, removed,
 * counted — never thrown); the byte budget holds with LRU over 30 growing conversations; two
 * real processes storing the same prefix at once leave one complete entry and no temp file;
 * a dead writer's temp files are swept; the store's metrics pass promtool. On the tiny model:
 * an engine whose prompt the store serves (the state another engine with another sequence count
 * stored) generates exactly what an engine without any cache does (deterministic mode).
 */
import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import { mkdtempSync, promises as fsp, readdirSync, readFileSync, rmSync, statSync, truncateSync, utimesSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, describe, test } from 'node:test';
import { Registry } from 'prom-client';
import { FilePrefixStore, INDEX_FRESH_MS } from '../../src/prefixes/prefix-store.js';
import { parseStateFile } from '../../src/engine/ggsq.js';
import { ensureModel } from '../../src/engine/gguf-writer.js';
import { loadEngine } from '../../src/engine/llama.js';
import type { ChatMessage, Engine, SamplingParams } from '../../src/engine/types.js';
import { keyChain, storeKeyTokens, storeNamespace, type KvCacheEvent, type StoreIdentity } from '../../src/engine/prefix-store.js';
import { synthState } from '../helpers/ggsq-synth.js';
import { assertTotalsAreCounters, checkMetrics, reportMissingPromtool } from '../helpers/promtool.js';

const root = mkdtempSync(path.join(existsShm() ? '/dev/shm' : os.tmpdir(), 'pdserve-store-test-'));
after(() => rmSync(root, { recursive: true, force: true }));
let dirs = 0;
const freshDir = (): string => mkdtempSync(path.join(root, `d${dirs++}-`));

function existsShm(): boolean {
  try {
    return statSync('/dev/shm').isDirectory();
  } catch {
    return false;
  }
}

const ID: StoreIdentity = { fingerprint: 'ab'.repeat(32), compat: { contextSize: 1024, batchSize: 32, nLayer: 2, flashAttention: true }, nVocab: 300, nStream: 3, align: null };
const toks = (n: number, seed = 1): number[] => Array.from({ length: n }, (_, i) => (i * 7 + seed * 13) % 300);

/** A store of 16 MiB in 64-token blocks in a fresh folder, bound to `id`, with the events it emits. */
function boundStore(id: StoreIdentity = ID): { dir: string; store: FilePrefixStore; events: KvCacheEvent[] } {
  const dir = freshDir();
  const store = new FilePrefixStore({ dir, maxBytes: 1 << 24, blockTokens: 64 });
  const events: KvCacheEvent[] = [];
  store.onEvent((e) => events.push(e));
  store.bind(id);
  return { dir, store, events };
}

/** Store `tokens` (a synthetic state in a 2-sequence context) the way the engine does: begin, "save", commit. */
async function put(store: FilePrefixStore, tokens: number[], exactPrefix = tokens.length): Promise<boolean> {
  const w = await store.begin(tokens, exactPrefix);
  if (!w) return false;
  writeFileSync(w.path, synthState(tokens, { nStream: 2, seq: 1 }));
  await w.commit();
  return true;
}

const entries = (dir: string): string[] => readdirSync(dir).filter((n) => n.endsWith('.pdkv'));
/** Wait until a store's index lists a file written from outside it (as by another process). */
const listed = (): Promise<void> => new Promise((r) => setTimeout(r, INDEX_FRESH_MS + 10));

describe('key chain', () => {
  test('a prefix has the leading keys of every longer token list; a change in block i changes keys i..', () => {
    const ns = storeNamespace(ID);
    const a = keyChain(ns, toks(300), 100, 64);
    assert.equal(a.length, 4, 'whole blocks only');
    assert.deepEqual(keyChain(ns, toks(130), 100, 64), a.slice(0, 2));
    const b = toks(300);
    b[150] = (b[150]! + 1) % 300;
    const kb = keyChain(ns, b, 100, 64);
    assert.deepEqual(kb.slice(0, 2), a.slice(0, 2));
    assert.notEqual(kb[2], a[2]);
    assert.notEqual(kb[3], a[3]);
    assert.equal(keyChain(ns, toks(300), 2, 64).length, 2, 'maxBlocks bounds the chain');
  });

  test('the namespace separates models and settings (fingerprint, context, deterministic chunk)', () => {
    const k = (id: StoreIdentity) => keyChain(storeNamespace(id), toks(64), 1, 64)[0];
    const base = k(ID);
    assert.notEqual(k({ ...ID, fingerprint: 'cd'.repeat(32) }), base);
    assert.notEqual(k({ ...ID, compat: { ...ID.compat, batchSize: 64 } }), base);
    assert.notEqual(k({ ...ID, compat: { ...ID.compat, flashAttention: false } }), base);
    assert.notEqual(k({ ...ID, align: 32 }), base);
    assert.equal(k({ ...ID, nStream: 9 }), base, 'the loader re-frames: any sequence count shares entries');
  });

  test('key length: whole blocks of the usable prefix (deterministic: the exact prefix only)', () => {
    assert.equal(storeKeyTokens(200, 0, null, 64), 192);
    assert.equal(storeKeyTokens(200, 128, 32, 64), 128);
    assert.equal(storeKeyTokens(200, 96, 32, 64), 64);
    assert.equal(storeKeyTokens(63, 63, null, 64), 0);
    assert.equal(storeKeyTokens(644, 620, null, 64), 576, 'prompt 620 + reply 24: keyed inside the prompt, never inside the reply');
  });
});

describe('FilePrefixStore', () => {
  test('a stored conversation serves a longer prompt (its ancestor), re-framed for the loader; nothing for another prompt', async () => {
    const { dir, store, events } = boundStore();
    const conv = toks(200);
    assert.ok(await put(store, conv));
    assert.equal(entries(dir).length, 1);
    assert.deepEqual(events, [{ kind: 'stored', tier: 'store', key: keyChain(storeNamespace(ID), conv, 3, 64)[2], tokens: 192, bytes: statSync(path.join(dir, entries(dir)[0]!)).size }]);
    assert.equal(await put(store, conv), false, 'the same prefix is stored once');

    const next = [...conv, ...toks(90, 5)];
    assert.equal(await store.reusable(next), 200, "the entry's length (its head), not only its key");
    const hit = await store.take(next, 0);
    assert.ok(hit, 'the longer prompt finds its ancestor');
    assert.equal(hit.reuse, 200, 'the whole stored sequence is reused (common prefix, < prompt length)');
    assert.deepEqual([...hit.tokens], conv);
    const st = parseStateFile(readFileSync(hit.path), { contextSize: 1024, maxBytes: 1 << 24 });
    assert.equal(st.nStream, ID.nStream, 'the load copy has the loading context n_stream');
    assert.deepEqual(st.tokens, conv);
    await hit.done();
    assert.deepEqual(readdirSync(dir).filter((n) => !/\.(pdkv|pid)$/.test(n)), [], 'no temp or load file left');

    assert.equal(await store.take(next, 200), undefined, 'nothing better than what the first tier gives');
    assert.equal(await store.take(toks(300, 9), 0), undefined, 'another conversation misses');
    const shortCut = [...conv.slice(0, 100), 1, 2, 3];
    assert.equal(await store.take(shortCut, 0), undefined, 'an entry is found by its whole key only: a prompt that leaves it after 100 tokens does not');
    assert.equal(store.stats.hits, 1);
    assert.equal(store.stats.misses, 3);
    store.close();
  });

  test('the next round finds a conversation whose reply comes back tokenized differently (the key ends inside the prompt)', async () => {
    const store = new FilePrefixStore({ dir: freshDir(), maxBytes: 1 << 24, blockTokens: 64 });
    store.bind(ID);
    const prompt = toks(180);
    const reply = toks(24, 3);
    // decode's kept sequence: prompt + the generated ids, exact prefix = the prompt
    assert.ok(await put(store, [...prompt, ...reply], prompt.length));
    // the next round resends the reply as text: its first ids differ from the generated ones
    const next = [...prompt, (reply[0]! + 1) % 300, ...reply.slice(1), ...toks(80, 9)];
    const hit = await store.take(next, 0);
    assert.ok(hit, 'found although the stored tokens and the prompt part at token 180, inside the last whole block of the state (192)');
    assert.equal(hit.reuse, 180, 'the common prefix: the whole prompt, no reply token');
    await hit.done();
    store.close();
  });

  test("a lookup of a key this process is still writing waits for the write (the next round arriving while the last one is stored)", async () => {
    const store = new FilePrefixStore({ dir: freshDir(), maxBytes: 1 << 24, blockTokens: 64 });
    store.bind(ID);
    const conv = toks(200);
    const w = (await store.begin(conv, conv.length))!;
    const early = store.take([...conv, 1, 2], 0);
    const hint = store.reusable([...conv, 1, 2]);
    await new Promise((r) => setTimeout(r, 50));
    writeFileSync(w.path, synthState(conv, { nStream: 2, seq: 1 }));
    await w.commit();
    const hit = await early;
    assert.equal(hit?.reuse, 200, 'the lookup saw the entry written meanwhile');
    assert.equal(await hint, 200);
    await hit?.done();
    // an abandoned write releases its waiters too
    const other = toks(200, 7);
    const w2 = (await store.begin(other, other.length))!;
    const waiting = store.take([...other, 1], 0);
    await w2.abort();
    assert.equal(await waiting, undefined);
    store.close();
  });

  test("the index: a miss costs no file system call; another process's entry is found; an entry removed behind it is a miss, never a throw", async () => {
    const dir = freshDir();
    const a = new FilePrefixStore({ dir, maxBytes: 1 << 24, blockTokens: 64 });
    const b = new FilePrefixStore({ dir, maxBytes: 1 << 24, blockTokens: 64 });
    a.bind(ID);
    b.bind(ID);
    const conv = toks(200);
    const next = [...conv, 1, 2];
    assert.equal(await b.take(next, 0), undefined, 'nothing stored yet: a miss (and a listing)');
    // once listed, misses touch no file: count the store's fs.promises calls over 20 of them
    const counted = ['readdir', 'access', 'open', 'stat'] as const;
    const saved = counted.map((k) => fsp[k]);
    let calls = 0;
    for (const k of counted) (fsp as unknown as Record<string, (...a: unknown[]) => unknown>)[k] = (...args: unknown[]) => (calls++, (saved[counted.indexOf(k)] as (...a: unknown[]) => unknown)(...args));
    try {
      for (let i = 0; i < 20; i++) {
        assert.equal(await b.take([...toks(300, 20 + i), 1], 0), undefined);
        assert.equal(await b.reusable([...toks(300, 40 + i), 1]), 0);
      }
    } finally {
      counted.forEach((k, i) => ((fsp as unknown as Record<string, unknown>)[k] = saved[i]));
    }
    assert.equal(calls, 0, 'no readdir, access, open or stat for a miss');
    assert.ok(await put(a, conv));
    assert.equal(a.indexed, 1, "the writer's index has its own entry at once");
    await listed();
    assert.equal(await b.reusable(next), 200, "the other store lists the writer's entry once its listing is old");
    const hit = await b.take(next, 0);
    assert.equal(hit?.reuse, 200);
    await hit?.done();
    // removed from outside while both indexes still list it: the file check on the hit path misses
    rmSync(path.join(dir, entries(dir)[0]!));
    assert.equal(await a.reusable(next), 0, 'reusable checks the file the index names');
    assert.equal(a.indexed, 0, 'and forgets it');
    assert.equal(await b.take(next, 0), undefined, 'take opens the file the index names: gone, a miss');
    assert.equal(b.indexed, 0);
    assert.equal(b.stats.misses, 22);
    a.close();
    b.close();
  });

  test('deterministic mode: keyed and reused by the exact prefix only', async () => {
    const { dir, store } = boundStore({ ...ID, align: 32 });
    const conv = toks(200);
    assert.ok(await put(store, conv, 160));
    const hit = await store.take([...conv, 5, 6, 7], 0);
    assert.ok(hit);
    assert.equal(hit.reuse, 128, 'the key covers 128 exact tokens (2 blocks); whole chunks only');
    assert.equal(hit.exactPrefix, 128);
    await hit.done();
    store.close();
  });

  test('torn, corrupt and foreign entries are refused, removed and counted; the lookup goes on to a shorter key', async () => {
    const dir = freshDir();
    const reg = new Registry();
    const store = new FilePrefixStore({ dir, maxBytes: 1 << 24, blockTokens: 64, registry: reg });
    store.bind(ID);
    const long = toks(260);
    const short = long.slice(0, 140);
    assert.ok(await put(store, short));
    const shortEntry = entries(dir)[0]!;
    const prompt = [...long, 9];
    const longEntry = () => entries(dir).find((n) => n !== shortEntry)!;
    const damage: [string, (p: string) => void, keyof FilePrefixStore['stats']['refused']][] = [
      ['truncated inside the KV data', (p) => truncateSync(p, statSync(p).size - 100), 'bad_envelope'],
      ['a flipped payload byte', (p) => {
        const b = readFileSync(p);
        b[b.length - 200] ^= 0x40;
        writeFileSync(p, b);
      }, 'bad_envelope'],
      ['empty', (p) => writeFileSync(p, ''), 'bad_envelope'],
    ];
    for (const [what, f, reason] of damage) {
      assert.ok(await put(store, long), what);
      f(path.join(dir, longEntry()));
      const before = store.stats.refused[reason];
      const hit = await store.take(prompt, 0);
      assert.equal(store.stats.refused[reason], before + 1, `${what}: refused as ${reason}`);
      assert.deepEqual(entries(dir), [shortEntry], `${what}: the bad entry is removed, the good one stays`);
      assert.ok(hit, `${what}: the shorter ancestor serves instead`);
      assert.equal(hit.reuse, 140);
      await hit.done();
    }
    // another model's entry under this model's name (a wrong fingerprint): refused before any state byte is used
    const other = new FilePrefixStore({ dir: freshDir(), maxBytes: 1 << 24, blockTokens: 64 });
    other.bind({ ...ID, fingerprint: 'ee'.repeat(32) });
    assert.ok(await put(other, long));
    const otherDir = path.dirname(other.entryPath('x'));
    const name = keyChain(storeNamespace(ID), long, 4, 64)[3]!;
    writeFileSync(store.entryPath(name), readFileSync(path.join(otherDir, entries(otherDir)[0]!)));
    await listed();
    const refusedBefore = store.stats.refused.bad_envelope;
    const hit = await store.take(prompt, 0);
    assert.equal(store.stats.refused.bad_envelope, refusedBefore + 1, 'fingerprint mismatch refused');
    assert.equal(hit?.reuse, 140);
    await hit?.done();
    // a valid entry of other tokens under this prompt's name (a collision or a misnamed file)
    assert.ok(await put(store, toks(260, 4)));
    const misnamed = entries(dir).find((n) => n !== shortEntry)!;
    writeFileSync(store.entryPath(name), readFileSync(path.join(dir, misnamed)));
    rmSync(path.join(dir, misnamed));
    await listed();
    const h2 = await store.take(prompt, 0);
    assert.equal(store.stats.refused.key_mismatch, 1);
    assert.equal(h2?.reuse, 140);
    await h2?.done();
    const text = await reg.metrics();
    assert.match(text, /pdserve_prefix_store_refused_total\{reason="bad_envelope"\} 4/);
    assert.match(text, /pdserve_prefix_store_refused_total\{reason="key_mismatch"\} 1/);
    store.close();
    other.close();
  });

  test('the byte budget holds over 30 eight-round conversations; superseded rounds and the least recently used go first, a hit keeps an entry', async () => {
    const dir = freshDir();
    const one = synthState(toks(64), { nStream: 2, seq: 1 }).length;
    const budget = 40 * (one + 4 * 64 * 2 * 2 * 8); // room for a few dozen mid-sized entries
    const store = new FilePrefixStore({ dir, maxBytes: budget, blockTokens: 64 });
    const evicted: KvCacheEvent[] = [];
    store.onEvent((e) => e.kind === 'evicted' && evicted.push(e));
    store.bind(ID);
    const convs = Array.from({ length: 30 }, (_, c) => toks(70, c + 1));
    let t = 1_000_000;
    // an entry no later one extends (a superseded one is first to go, whatever its hits before)
    assert.ok(await put(store, toks(140, 99)));
    const kept = path.join(dir, entries(dir)[0]!);
    for (let round = 1; round <= 8; round++) {
      for (let c = 0; c < 30; c++) {
        convs[c] = [...convs[c]!, ...toks(40, c * 8 + round)];
        assert.ok(await put(store, convs[c]!));
        // fix the write order in mtime (one second apart), whatever the clock's resolution
        const newest = entries(dir).map((n) => path.join(dir, n)).sort((a, b) => statSync(b).mtimeMs - statSync(a).mtimeMs || 0)[0]!;
        utimesSync(newest, t, t++);
        utimesSync(kept, t, t++); // hit again and again
        await store.scheduleScan();
        const bytes = entries(dir).reduce((a, n) => a + statSync(path.join(dir, n)).size, 0);
        assert.ok(bytes <= budget, `round ${round} conversation ${c}: ${bytes} bytes over the budget ${budget}`);
        assert.equal(store.stats.bytes, bytes);
      }
    }
    assert.ok(evicted.length > 100, `LRU evicted ${evicted.length} entries`);
    assert.ok(entries(dir).includes(path.basename(kept)), 'the entry hit all along survives');
    assert.ok(store.stats.superseded > 60, `each round's entry superseded its conversation's last (${store.stats.superseded} of ${store.stats.evictions} evictions)`);
    const last = await store.take([...convs[29]!, 1], 0);
    assert.ok(last, 'the newest round of the last conversation is held');
    assert.equal(last.reuse, convs[29]!.length);
    await last.done();
    assert.equal(await store.take([...toks(70, 2), ...toks(40, 9), 7], 0), undefined, 'an old round-1 entry was evicted');
    store.close();
  });

  test('two processes storing the same prefix at once, with evictions and a reader: never a torn entry, no temp files left', async () => {
    const dir = freshDir();
    const script = `
      import { writeFileSync, rmSync } from 'node:fs';
      import { FilePrefixStore } from ${JSON.stringify(path.resolve('src/prefixes/prefix-store.ts'))};
      import { synthState } from ${JSON.stringify(path.resolve('test/helpers/ggsq-synth.ts'))};
      const [dir, id] = [process.argv[1], JSON.parse(process.argv[2])];
      const tokens = Array.from({ length: 300 }, (_, i) => (i * 7 + 13) % 300);
      const store = new FilePrefixStore({ dir, maxBytes: 1 << 26, blockTokens: 64 });
      store.bind(id);
      let writes = 0;
      for (let i = 0; i < 150; i++) {
        const w = await store.begin(tokens, tokens.length);
        if (w) { writeFileSync(w.path, synthState(tokens, { nStream: 2, seq: 1, rowBytes: 256, fill: 0x11 })); await w.commit(); writes++; }
        if (i % 3 === 0) rmSync(store.entryPath(process.argv[3]), { force: true });
      }
      store.close();
      console.log(JSON.stringify({ writes, dropped: store.stats.dropped }));
    `;
    const key = keyChain(storeNamespace(ID), toks(300), 4, 64)[3]!;
    const run = () =>
      new Promise<{ writes: number; dropped: number }>((resolve, reject) => {
        const p = spawn(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', script, dir, JSON.stringify(ID), key], { stdio: ['ignore', 'pipe', 'inherit'] });
        let out = '';
        p.stdout.on('data', (d) => (out += d));
        const t = setTimeout(() => p.kill('SIGKILL'), 60_000);
        p.on('exit', (code) => {
          clearTimeout(t);
          code === 0 ? resolve(JSON.parse(out)) : reject(new Error(`writer exited ${code}`));
        });
      });
    const reader = new FilePrefixStore({ dir, maxBytes: 1 << 26, blockTokens: 64 });
    reader.bind(ID);
    const both = Promise.all([run(), run()]);
    let done = false;
    void both.finally(() => (done = true));
    let hits = 0;
    while (!done) {
      const h = await reader.take([...toks(300), 1], 0);
      if (h) {
        hits++;
        assert.equal(h.reuse, 300);
        await h.done();
      }
      // a miss does no I/O (the index answers): let the writers' exit events in
      await new Promise((r) => setImmediate(r));
    }
    const [a, b] = await both;
    assert.ok(a.writes + b.writes >= 50, `the writers stored ${a.writes} + ${b.writes} times`);
    assert.deepEqual(reader.stats.refused, { bad_envelope: 0, bad_state: 0, key_mismatch: 0, too_large: 0 }, 'no torn or mixed entry was ever read');
    assert.deepEqual(readdirSync(dir).filter((n) => !/\.(pdkv|pid)$/.test(n)), [], 'no temp files left');
    // the race was exercised: the reader took whole entries while the writers stored and removed them
    assert.ok(hits > 0, 'the reader never hit an entry while the writers ran');
    assert.equal(reader.stats.hits, hits);
    // leave one entry and check it whole
    if (entries(dir).length > 0) {
      await listed(); // the writers' last entry may be newer than the reader's index
      const h = await reader.take([...toks(300), 1], 0);
      assert.ok(h);
      await h.done();
    }
    reader.close();
  });

  test('entries outlive a store closed while another uses the folder, not the last one; a store bound where no live process uses the folder removes what killed ones left', async () => {
    const dir = freshDir();
    const users = () => readdirSync(dir).filter((n) => n.endsWith('.pid'));
    const claimed = (s: FilePrefixStore) => (s as unknown as { claimed: Promise<void> }).claimed;
    const a = new FilePrefixStore({ dir, maxBytes: 1 << 24, blockTokens: 64 });
    const b = new FilePrefixStore({ dir, maxBytes: 1 << 24, blockTokens: 64 });
    a.bind(ID);
    b.bind(ID);
    await Promise.all([claimed(a), claimed(b)]);
    assert.equal(users().length, 2, 'one user file per bound store');
    assert.ok(await put(a, toks(200)));
    assert.ok(await put(b, toks(200, 4)));
    assert.equal(entries(dir).length, 2);
    await a.close();
    assert.equal(entries(dir).length, 2, 'b still uses the folder: the entries stay');
    assert.equal(users().length, 1);
    await b.close();
    assert.deepEqual(readdirSync(dir), [], 'the last one to stop removed every entry and its user file');
    await b.close(); // idempotent

    // killed processes: their entries and user file, no live user → the next store removes them
    const dead = spawnSync(process.execPath, ['-e', '0']).pid!;
    const left = `pdserve-store-${'ab'.repeat(16)}.pdkv`;
    writeFileSync(path.join(dir, left), 'x'.repeat(100));
    writeFileSync(path.join(dir, `pdserve-storeuser-${dead}-00112233.pid`), `${dead}\n`);
    const c = new FilePrefixStore({ dir, maxBytes: 1 << 24, blockTokens: 64 });
    c.bind(ID);
    await claimed(c);
    assert.deepEqual(entries(dir), [], 'the entries killed processes left are removed');
    await new Promise((r) => setTimeout(r, 100)); // the dead-pid sweep follows the claim
    assert.equal(users().length, 1, "the dead user's file is swept; the new store's stays");
    await c.close();

    // another live process uses the folder (a user file of a live pid): neither bind nor close removes entries
    writeFileSync(path.join(dir, left), 'x'.repeat(100));
    writeFileSync(path.join(dir, `pdserve-storeuser-${process.pid}-ffeeddcc.pid`), `${process.pid}\n`);
    const d = new FilePrefixStore({ dir, maxBytes: 1 << 24, blockTokens: 64 });
    d.bind(ID);
    await claimed(d);
    await d.close();
    assert.deepEqual(entries(dir), [left], 'a live user keeps the entries');
  });

  test("a dead writer's temp files are swept when a store binds; a live one's stay", async () => {
    const dir = freshDir();
    const dead = spawnSync(process.execPath, ['-e', '0']).pid!;
    const names = [`pdserve-storetmp-${dead}-0011223344556677.ggsq`, `pdserve-storetmp-${dead}-0011223344556677-env.ggsq`, `pdserve-storeload-${dead}-8899aabbccddeeff.ggsq`];
    const live = `pdserve-storetmp-${process.pid}-0011223344556677.ggsq`;
    for (const n of [...names, live]) writeFileSync(path.join(dir, n), 'x');
    const store = new FilePrefixStore({ dir, maxBytes: 1 << 20 });
    store.bind(ID);
    await store.scheduleScan();
    const left = () => readdirSync(dir).filter((n) => !n.endsWith('.pid')); // but the store's own user file
    for (let i = 0; i < 50 && left().length > 1; i++) await new Promise((r) => setTimeout(r, 10));
    assert.deepEqual(left(), [live]);
    await store.close();
  });

  test('store metrics pass promtool', async (t) => {
    const reg = new Registry();
    const store = new FilePrefixStore({ dir: freshDir(), maxBytes: 1 << 20, registry: reg, blockTokens: 64 });
    store.bind(ID);
    await put(store, toks(100));
    await store.take([...toks(100), 1], 0);
    await store.take(toks(100, 3), 0);
    await store.scheduleScan();
    const text = await reg.metrics();
    assert.match(text, /pdserve_prefix_store_files 1/);
    assert.match(text, /pdserve_prefix_store_lookups_total\{result="hit"\} 1/);
    assert.match(text, /pdserve_prefix_store_lookups_total\{result="miss"\} 1/);
    assertTotalsAreCounters(text);
    const res = checkMetrics(text);
    store.close();
    if (!res) return reportMissingPromtool(t);
    assert.ok(res.ok, res.output);
  });
});

describe('session rules in the store', () => {
  const setBudget = (s: FilePrefixStore, bytes: number): void => {
    (s as unknown as { o: { maxBytes: number } }).o.maxBytes = bytes;
  };
  const dirBytes = (dir: string): number => entries(dir).reduce((a, n) => a + statSync(path.join(dir, n)).size, 0);

  test("supersede: a session's older entry on a newer entry's chain goes first under the budget, before an older entry of another session", async () => {
    const { dir, store } = boundStore();
    const a1 = toks(140, 1);
    const b1 = toks(140, 2);
    assert.ok(await put(store, a1));
    assert.ok(await put(store, b1));
    const bFile = entries(dir).find((n) => n.includes(keyChain(storeNamespace(ID), b1, 2, 64)[1]!))!;
    utimesSync(path.join(dir, bFile), 1000, 1000); // session b's entry is by far the least recently used
    const a2 = [...a1, ...toks(100, 3)];
    assert.ok(await put(store, a2));
    assert.equal(entries(dir).length, 3);
    setBudget(store, dirBytes(dir) - 1); // one entry must go
    await store.scheduleScan();
    const left = entries(dir);
    assert.equal(left.length, 2);
    assert.ok(left.includes(bFile), "the other session's older entry stays");
    assert.ok(!left.some((n) => n.includes(keyChain(storeNamespace(ID), a1, 2, 64)[1]!)), "turn 1's entry went: turn 2's covers it");
    const next = await store.take([...a2, 9, 9], 0);
    assert.ok(next && next.reuse === a2.length, "the session's next turn is served by turn 2's entry");
    await next.done();
    assert.deepEqual(store.evictionStats(), [{ cause: 'lru', count: 0 }, { cause: 'superseded', count: 1 }]);
    store.close();
  });

  test('a superseded entry hit since it was marked is no longer first to go', async () => {
    const { dir, store } = boundStore();
    const a1 = toks(140, 1);
    assert.ok(await put(store, a1));
    assert.ok(await put(store, toks(140, 2)));
    const a2 = [...a1, ...toks(100, 3)];
    assert.ok(await put(store, a2));
    const aFile = entries(dir).find((n) => n.includes(keyChain(storeNamespace(ID), a1, 2, 64)[1]!))!;
    await store.scheduleScan(); // the write's own scan: one that listed the files before the hit below would act on the old mtime
    utimesSync(path.join(dir, aFile), 4e9, 4e9); // a hit (a sub-agent forked from turn 1): the newest entry now
    setBudget(store, dirBytes(dir) - 1);
    await store.scheduleScan();
    assert.ok(entries(dir).includes(aFile));
    assert.deepEqual(store.evictionStats(), [{ cause: 'lru', count: 1 }, { cause: 'superseded', count: 0 }]);
    store.close();
  });

  test('a prefix two sessions share is written once as an entry of its own (cut from the newer state) and serves a third session', async () => {
    const { dir, store, events } = boundStore();
    const system = toks(150, 7); // 2 whole blocks shared
    assert.ok(await put(store, [...system, ...toks(90, 1)]));
    assert.equal(store.stats.sharedWrites, 0, 'one session: nothing shared yet');
    assert.ok(await put(store, [...system, ...toks(90, 2)]));
    assert.equal(store.stats.sharedWrites, 1);
    const sharedKey = keyChain(storeNamespace(ID), system, 2, 64)[1]!;
    assert.ok(events.some((e) => e.kind === 'stored' && e.key === sharedKey && e.tokens === 128), JSON.stringify(events));
    assert.ok(await put(store, [...system, ...toks(90, 3)]));
    assert.equal(store.stats.sharedWrites, 1, 'kept once: a third session does not write it again');
    const third = [...system, ...toks(50, 4)];
    const hit = await store.take(third, 0);
    assert.ok(hit, "a new session sharing only the prefix finds it (no session's own entry is on its chain)");
    assert.equal(hit.tokens.length, 128);
    assert.equal(hit.reuse, 128);
    await hit.done();
    // the shared entry is never superseded by a session extending it
    assert.ok(await put(store, [...system, ...toks(90, 1), ...toks(80, 5)]));
    setBudget(store, dirBytes(dir) - 1);
    await store.scheduleScan();
    assert.ok(entries(dir).some((n) => n.includes(sharedKey)), 'the shared prefix survives');
    store.close();
  });
});

describe('the store between two engines on the tiny model', () => {
  const BATCH = 16;
  const greedy: SamplingParams = { temperature: 0, topP: 1, topK: 0, maxTokens: 12, stop: [], ignoreEos: true };
  const never = new AbortController().signal;
  let writer: Engine; // 1 slot + 1 cache sequence holding 1 token at most: every finished round is evicted at once, so stored
  let reader: Engine; // 2 slots, no useful in-sequence cache (its budget is 1 token): only the store serves it
  let cold: Engine; // no cache at all: the reference
  let ws: FilePrefixStore;
  let rs: FilePrefixStore;

  async function run(e: Engine, prompt: number[]): Promise<{ tokens: number[]; cached: number; tier?: string }> {
    const slot = e.tryAcquireSlot(prompt)!;
    try {
      const r = await slot.prefill(prompt, greedy, never);
      const out = [r.firstToken];
      for await (const t of slot.generate(r.firstToken, greedy, never)) if (out.length < greedy.maxTokens) out.push(t.token);
      return { tokens: out, cached: r.cachedTokens, ...(r.cacheTier ? { tier: r.cacheTier } : {}) };
    } finally {
      slot.release();
    }
  }

  after(async () => {
    await writer?.dispose();
    await reader?.dispose();
    await cold?.dispose();
    ws?.close();
    rs?.close();
  });

  test('deterministic: every round the store serves gives the no-cache output; cached tokens are whole chunks', async () => {
    const model = await ensureModel('tiny', 1);
    const dir = freshDir();
    ws = new FilePrefixStore({ dir, maxBytes: 1 << 26 });
    rs = new FilePrefixStore({ dir, maxBytes: 1 << 26, write: false });
    const base = { modelPath: model, contextSize: 1024, batchSize: BATCH, deterministic: true };
    writer = await loadEngine({ ...base, sequences: 1, prefixCache: { cacheSequences: 1, maxTokens: 1 }, prefixStore: ws });
    reader = await loadEngine({ ...base, sequences: 2, prefixCache: { cacheSequences: 0, maxTokens: 1 }, prefixStore: rs });
    cold = await loadEngine({ ...base, sequences: 1 });
    const messages: ChatMessage[] = [{ role: 'system', content: 'You are a careful agent. Answer in short sentences about the state of the data and the tools.' }];
    let served = 0;
    for (let round = 1; round <= 5; round++) {
      messages.push({ role: 'user', content: `Round ${round}: the tool returned ${'value '.repeat(10 + round * 4)}done.` });
      const prompt = cold.renderChat(messages);
      const ref = await run(cold, prompt);
      const got = await run(reader, prompt);
      assert.deepEqual(got.tokens, ref.tokens, `round ${round}: a store hit changed the output`);
      assert.equal(got.cached % BATCH, 0, 'whole chunks only');
      if (got.tier === 'store') served++;
      if (round > 1) assert.equal(got.tier, 'store', `round ${round}: the store did not serve (cached ${got.cached} of ${prompt.length})`);
      const w = await run(writer, prompt);
      assert.deepEqual(w.tokens, ref.tokens);
      const writes = ws.stats.writes;
      for (let i = 0; i < 200 && ws.stats.writes === writes; i++) await new Promise((r) => setTimeout(r, 10));
      assert.equal(ws.stats.writes, writes + 1, `round ${round}: the writer stored the finished round`);
      messages.push({ role: 'assistant', content: cold.detokenize(ref.tokens) });
    }
    assert.equal(served, 4);
    assert.equal(rs.stats.hits, 4);
    assert.deepEqual(readdirSync(dir).filter((n) => !/\.(pdkv|pid)$/.test(n)), [], 'no temp or load file left');
  });

  test('KV events and write-back: a kept sequence is announced; evicted, it is stored under the same key', async () => {
    const model = await ensureModel('tiny', 1);
    const dir = freshDir();
    const events: KvCacheEvent[] = [];
    const st = new FilePrefixStore({ dir, maxBytes: 1 << 26 });
    st.onEvent((e) => events.push(e));
    const e = await loadEngine({ modelPath: model, contextSize: 1024, batchSize: BATCH, deterministic: true, sequences: 1, prefixCache: { cacheSequences: 0, maxTokens: 4096 }, prefixStore: st, onCacheEvent: (x) => events.push(x) });
    try {
      const a = e.tokenize('the first conversation talks about rivers and mills. '.repeat(4));
      await run(e, a);
      const seqStored = events.find((x) => x.tier === 'sequence' && x.kind === 'stored');
      assert.ok(seqStored, JSON.stringify(events));
      assert.equal(seqStored.tokens % BATCH, 0);
      await new Promise((r) => setTimeout(r, 100));
      assert.equal(st.stats.writes, 0, 'nothing is written while the sequence tier holds it');
      await run(e, e.tokenize('an unrelated prompt that shares nothing with the other one at all. '.repeat(3)));
      assert.ok(events.some((x) => x.tier === 'sequence' && x.kind === 'evicted' && x.key === seqStored.key), 'the cleared sequence evicted its key');
      for (let i = 0; i < 200 && !events.some((x) => x.tier === 'store'); i++) await new Promise((r) => setTimeout(r, 10));
      const storeStored = events.find((x) => x.tier === 'store' && x.kind === 'stored');
      assert.ok(storeStored, 'the evicted sequence was written back');
      assert.equal(storeStored.key, seqStored.key, 'one key names the prefix in both tiers');
      assert.equal(storeStored.tokens, seqStored.tokens);
      const hit = await st.take([...a, 5, 6], 0);
      assert.ok(hit && hit.reuse >= seqStored.tokens, 'the written-back state serves the conversation');
      await hit.done();
    } finally {
      await e.dispose();
      st.close();
    }
  });

  test('deterministic: a system prompt two sessions share is stored once, cut from a saved state, and a third session loaded from it gives the no-cache output', async () => {
    const model = await ensureModel('tiny', 1);
    const dir = freshDir();
    const wst = new FilePrefixStore({ dir, maxBytes: 1 << 26 });
    const rst = new FilePrefixStore({ dir, maxBytes: 1 << 26, write: false });
    const base = { modelPath: model, contextSize: 1024, batchSize: BATCH, deterministic: true };
    // every finished round is evicted from the writer's sequences at once (a 1-token budget), so written back
    const w = await loadEngine({ ...base, sequences: 1, prefixCache: { cacheSequences: 1, maxTokens: 1 }, prefixStore: wst });
    const r = await loadEngine({ ...base, sequences: 1, prefixCache: { cacheSequences: 0, maxTokens: 1 }, prefixStore: rst });
    const c0 = cold ?? (await loadEngine({ ...base, sequences: 1 }));
    try {
      const system: ChatMessage = { role: 'system', content: 'You are one of many agents. Tools: read(path), write(path, text), run(cmd). Answer briefly. '.repeat(2) };
      const session = (task: string): number[] => c0.renderChat([system, { role: 'user', content: task }]);
      for (const [i, task] of ['task one: fix the mills', 'task two: count the rivers'].entries()) {
        const writes = wst.stats.writes;
        await run(w, session(task));
        for (let k = 0; k < 300 && wst.stats.writes < writes + 1 + i; k++) await new Promise((res) => setTimeout(res, 10));
      }
      assert.equal(wst.stats.sharedWrites, 1, `the shared system prompt was stored once (${wst.stats.writes} writes)`);
      const third = session('task three: list the tools you have');
      const ref = await run(c0, third);
      const got = await run(r, third);
      assert.equal(got.tier, 'store', `the third session was served by the shared entry (cached ${got.cached})`);
      assert.ok(got.cached >= BATCH && got.cached % BATCH === 0);
      assert.deepEqual(got.tokens, ref.tokens, 'a state cut from another session gives the no-cache output');
    } finally {
      await w.dispose();
      await r.dispose();
      if (c0 !== cold) await c0.dispose();
      wst.close();
      rst.close();
    }
  });
});
