/**
 * The host-wide prefix store: the states of finished sequences that the engines' first tier
 * evicts (engine/llama.ts: write-back), as files in the state directory, shared
 * by every worker process on the host (prefill, decode, colocated) with no channel between them
 * — the directory is the truth (each process keeps an index of it: Index below). The engine's second prefix-cache tier (engine/prefix-store.ts
 * has the keys and the engine's seam). The idea is llama.cpp server's `--cache-ram` (finished
 * prompts kept in host RAM and swapped into a slot) and SGLang HiCache's host tier, over files,
 * because node-llama-cpp moves sequence state through files only.
 *
 * Files (names in `dir`):
 *   pdserve-store-<key>.pdkv              an entry: `key` = the chain key of its first K tokens
 *   pdserve-storetmp-<pid>-<hex>[-env].ggsq  a write in progress (owner pid in the name)
 *   pdserve-storeload-<pid>-<hex>.ggsq    a validated copy re-framed for one engine, being loaded
 *   pdserve-storeuser-<pid>-<hex>.pid     a store bound by a running process (one per store)
 * An entry is a KV envelope (kv/envelope.ts: head with the model fingerprint and context
 * settings, payload = the ggsq state, CRC-32 trailer) — the bytes a TCP handoff carries.
 *
 * Safety:
 *   - Atomic publication: llama.cpp saves into a temp file, the envelope is written to another
 *     temp file, which is renamed onto the entry's name (rename(2) in one directory is atomic).
 *     No reader ever sees a partial entry; two processes storing the same prefix at once each
 *     rename a complete file and the last one wins.
 *   - Validated before llama.cpp reads a byte, exactly as a handed-over state: the envelope
 *     (head digest, fingerprint, contextSize, batchSize, size bound, CRC-32 of the payload) and
 *     the whole ggsq structure walk (engine/ggsq.ts), n_tokens equal in both, the file's first K
 *     tokens equal to the prompt's (a hash collision or a misnamed file is refused). A file that
 *     fails is refused, removed, counted, and the lookup goes on to a shorter key. Only a private
 *     copy (the validated bytes, re-framed to the engine's n_stream) is handed to llama.cpp, so
 *     an entry replaced or evicted meanwhile cannot change what is loaded.
 *   - Crashes: temp and load files carry the writer's pid; files of dead pids are swept (at
 *     bind and every STATE_SWEEP_MS: statefiles.ts, also run by prefill and decode).
 *   - Never blocks the event loop: fs.promises only; the synchronous work per lookup is one
 *     CRC-32 and a header walk.
 *
 * Index: each process keeps the entry names it knows in memory, so a miss costs no system call.
 * It is filled by each directory listing (the budget scan), by this process's own writes,
 * evictions and refusals, and by the directory's change notifications (fs.watch, inotify on
 * Linux) for other processes' writes; where the folder cannot be watched, a lookup that finds
 * the listing older than INDEX_FRESH_MS lists it again first (one readdir(2)). The index is a
 * hint: a hit still opens the file (`take`) or checks it is there (`reusable`), a name it lists
 * that is gone is dropped then, and every rule above applies to what is opened.
 *
 * Lifetime: entries outlive a process but not the last one using the folder. Each bound store
 * keeps a user file; `close()` (engine dispose, on every clean stop) removes it and, when no user
 * file of a live pid is left, every entry. A store bound where no live process uses the folder
 * removes the entries it finds (their processes were killed). Between the two, at most the budget.
 *
 * Budget and LRU: every process keeps the directory's entries within `maxBytes` (its own
 * `--prefix-store-bytes`; with several values on a host the smallest wins in effect): after
 * each write and every SCAN_MS it lists the entries, and removes superseded entries first, then
 * the least recently used (mtime: set at write and on every hit) until the total fits.
 * Evictions by two processes at once may remove a little more than needed, never an entry in use
 * (loads read a private copy).
 *
 * Sessions (engine/prefix-cache.ts retention): each process remembers the key chains of the
 * entries it wrote (`lines`, bounded). An entry on the chain of a newer one is superseded (turn
 * M's entry covers turn M−1's key) — the first to go under the budget, as long as its mtime
 * shows no hit since — unless a known line branches off there. Where two known lines diverge,
 * the prefix they share (whole blocks: a system prompt, tool definitions) is written once as an
 * entry of its own, cut from the newer state (ggsq.ts truncatedStateParts), so that a new
 * session sharing only that prefix finds it: without it, a lookup probes the prompt's own key
 * chain and meets no session's longer entry.
 */
import { randomBytes } from 'node:crypto';
import { systemClock } from '../base/clock.js';
import { promises as fsp, statfsSync, watch, type FSWatcher } from 'node:fs';
import os from 'node:os';
import { join } from 'node:path';
import client from 'prom-client';
import { parseStateFile, reframedParts, truncatedStateParts } from '../engine/ggsq.js';
import { reusableTokens } from '../engine/prefix-cache.js';
import { cacheKeyOf, keyChain, saltedNamespace, STORE_BLOCK_TOKENS, storeNamespace, type KvCacheEvent, type PrefixStore, type StoredPrefix, type StoreIdentity, type StoreWrite } from '../engine/prefix-store.js';
import { decodeEnvelope, encodeEnvelopeHead, ENVELOPE_DIGEST_BYTES, ENVELOPE_PREFIX_BYTES, envelopeTrailer, MAX_ENVELOPE_HEADER_BYTES, parseEnvelopeHead } from '../kv/envelope.js';
import { crc32 } from '../kv/transfer/checksum.js';
import type { Logger } from '../base/log.js';
import { processAlive, STATE_SWEEP_MS, sweepStaleStateFiles } from '../runtime/statefiles.js';
import { PdError } from '../base/errors.js';

/** An entry's file name. */
const ENTRY = /^pdserve-store-([0-9a-f]{32})\.pdkv$/;
/** A running process's mark that it uses the folder (one per bound store; a dead pid's is swept by statefiles.ts); group 1: its pid. */
export const STORE_USER_FILE = /^pdserve-storeuser-(\d+)-[0-9a-f]+\.pid$/;
/** Period of the budget scan (also refreshes the bytes/files gauges), ms. */
export const SCAN_MS = 5000;
/**
 * Most store writes in flight per process (begun, saving or publishing); a finished sequence
 * beyond it is not stored (a cache may drop). Agents finish rounds in bursts (30 agents on two
 * decode workers: a dozen evictions at once per worker), so the bound is well above that.
 */
export const MAX_PENDING_WRITES = 32;
/** Most publications (a state read into memory, enveloped, written) at once per process: bounds the memory they hold. */
export const MAX_PUBLISHING = 2;
/** Key chains of this process's entries remembered for the session rules (oldest forgotten first). */
export const MAX_LINES = 4096;
/** Without change notifications: the oldest directory listing a lookup trusts, ms (an older one is refreshed by one readdir(2), shared by lookups meanwhile). */
export const INDEX_FRESH_MS = 200;
/** Longest a lookup waits for this process's own write of a candidate key, ms. */
export const PENDING_WAIT_MS = 2000;

/**
 * Default `--prefix-store-bytes`: ¼ of the state directory's filesystem, at most ⅛ of RAM. On
 * tmpfs (/dev/shm, 50 % of RAM by default) the files are RAM: ¼ leaves the rest of the tmpfs to
 * in-flight handoffs, and ⅛ of RAM bounds it on a disk or a larger tmpfs (24 GiB host → 3 GiB).
 * @returns bytes (0 when the directory cannot be read: the store is then off).
 */
export function defaultPrefixStoreBytes(dir: string): number {
  const ram = Math.floor(os.totalmem() / 8);
  try {
    const s = statfsSync(dir);
    return Math.min(Math.floor((s.blocks * s.bsize) / 4), ram);
  } catch {
    return 0;
  }
}

/**
 * `size` bytes of an open file into one new buffer, in as few reads as the kernel allows (one on
 * tmpfs): FileHandle#readFile reads 512 KiB per libuv round trip, each a wake-up of a pool
 * thread and of the event loop.
 * @throws Error when the file ends before `size` bytes.
 */
async function readWhole(fh: fsp.FileHandle, size: number): Promise<Buffer> {
  const buf = Buffer.allocUnsafe(size);
  let off = 0;
  while (off < size) {
    const { bytesRead } = await fh.read(buf, off, size - off, off);
    if (bytesRead === 0) throw new PdError('BAD_STATE', `file ended at byte ${off} of ${size}`);
    off += bytesRead;
  }
  return buf;
}

/** Why a stored file was refused (the `reason` label). */
export type RefusedReason = 'bad_envelope' | 'bad_state' | 'key_mismatch' | 'too_large';

export interface FilePrefixStoreOptions {
  /** The state directory (shared by the host's workers). */
  dir: string;
  /** Byte budget of all entries in `dir` (LRU beyond); > 0. */
  maxBytes: number;
  /** Store finished sequences (false: this process only reads; prefill, whose prompt-only states decode's prompt + reply states supersede). */
  write?: boolean;
  /** Largest entry read or written, bytes (the worker's maxStateBytes). Default maxBytes. */
  maxFileBytes?: number;
  /**
   * Tokens per key block. Default: the deterministic chunk size when the engine has one (reuse is
   * in whole chunks there, so a key then ends exactly where the reusable prefix does), else
   * STORE_BLOCK_TOKENS.
   */
  blockTokens?: number;
  /** Registry for the store's metrics (pdserve_prefix_store_*). */
  registry?: client.Registry;
  /** Called once per lookup that probed the store: hit or miss (PrefixCacheMetrics.recordTier). */
  onLookup?: ((hit: boolean) => void) | undefined;
  log?: Logger;
  /** Scan period, ms (default SCAN_MS). */
  scanMs?: number;
}

/** Counts of one store (what its metrics show). */
export interface PrefixStoreStats {
  /** Entries and their bytes in the directory at the last scan (every process's). */
  files: number;
  bytes: number;
  hits: number;
  misses: number;
  hitTokens: number;
  writes: number;
  /** Finished sequences not stored because MAX_PENDING_WRITES were in flight, or a write failed. */
  dropped: number;
  evictions: number;
  /** Of `evictions`, the superseded entries. */
  superseded: number;
  /** Shared-prefix entries written (a prefix two known lines share). */
  sharedWrites: number;
  refused: Record<RefusedReason, number>;
}

/** The prefix store over files (see the module doc). Create one per worker; loadEngine binds it. */
export class FilePrefixStore implements PrefixStore {
  /** Tokens per key block (set by bind unless given). */
  blockTokens: number;
  readonly stats: PrefixStoreStats = { files: 0, bytes: 0, hits: 0, misses: 0, hitTokens: 0, writes: 0, dropped: 0, evictions: 0, superseded: 0, sharedWrites: 0, refused: { bad_envelope: 0, bad_state: 0, key_mismatch: 0, too_large: 0 } };
  private id: StoreIdentity | undefined;
  private ns = '';
  private pendingWrites = 0;
  /** Publications running, and those waiting for a turn (MAX_PUBLISHING). */
  private publishing = 0;
  private readonly publishQueue: (() => void)[] = [];
  /** Keys being written by this process → settles when the write is published or given up. */
  private readonly writing = new Map<string, Promise<void>>();
  private scanning: Promise<void> | null = null;
  /** Entry keys in the directory as this process knows them (see Index in the module doc). */
  private readonly index = new Set<string>();
  /** When the index was last listed from the directory (monotonic ms; -Infinity: never). */
  private indexAt = -Infinity;
  private listing: Promise<void> | null = null;
  /** Keys added by this process's publications and by change notifications → when (monotonic ms): one added while a listing ran is kept by it. */
  private readonly ownWrites = new Map<string, number>();
  /** The directory's change notifications (null: none; lookups then list the folder when the index is old). */
  private watcher: FSWatcher | null = null;
  private rescan = false;
  private timer: NodeJS.Timeout | null = null;
  private lastSweep = 0;
  private readonly listeners = new Set<(e: KvCacheEvent) => void>();
  /** Key chains of the entries this process wrote (the session rules, see the module doc); insertion order = age. */
  private readonly lines = new Map<string, readonly string[]>();
  /** Entries marked superseded, with their mtime then (a later hit clears the mark in effect). */
  private readonly supersededAt = new Map<string, number>();
  /** Keys of prefixes two known lines share: never marked superseded. */
  private readonly shared = new Set<string>();
  private closed = false;
  /** This store's user file (null before bind, or when it could not be written). */
  private userFile: string | null = null;
  /** The claim of the folder made at bind (user file written, entries of killed processes removed). */
  private claimed: Promise<void> = Promise.resolve();
  private closing: Promise<void> | null = null;
  private readonly counters: { lookups?: client.Counter<'result'>; refused?: client.Counter<'reason'>; evictions?: client.Counter; writes?: client.Counter; hitTokens?: client.Counter; dropped?: client.Counter } = {};

  constructor(private readonly o: FilePrefixStoreOptions) {
    if (!Number.isSafeInteger(o.maxBytes) || o.maxBytes <= 0) throw new RangeError('maxBytes must be a positive integer');
    this.blockTokens = o.blockTokens ?? STORE_BLOCK_TOKENS;
    if (!Number.isSafeInteger(this.blockTokens) || this.blockTokens < 1) throw new RangeError('blockTokens must be a positive integer');
    if (o.registry) this.registerMetrics(o.registry, o.onLookup);
  }

  /** Entries' budget, bytes. */
  get maxBytes(): number {
    return this.o.maxBytes;
  }

  bind(id: StoreIdentity): void {
    this.id = id;
    this.ns = storeNamespace(id);
    if (this.o.blockTokens === undefined) this.blockTokens = id.align ?? STORE_BLOCK_TOKENS;
    this.lastSweep = systemClock.nowMs();
    this.watchDir();
    this.claimed = this.claim().then(() => {
      void sweepStaleStateFiles(this.o.dir, this.o.log);
      if (!this.closed) void this.scheduleScan();
    });
    this.timer = setInterval(() => this.tick(), this.o.scanMs ?? SCAN_MS);
    this.timer.unref();
  }

  /**
   * Stop the scan timer and the change notifications, wait for this process's writes in flight
   * (PENDING_WAIT_MS at most), remove this store's user file and, when no live process uses the
   * folder any more, every entry (module doc, Lifetime). Idempotent; never rejects.
   */
  close(): Promise<void> {
    if (this.closing) return this.closing;
    this.closed = true;
    if (this.timer) clearInterval(this.timer);
    this.timer = null;
    this.watcher?.close();
    this.watcher = null;
    this.closing = (async () => {
      await this.claimed;
      const writes = [...this.writing.values()];
      if (writes.length > 0) {
        let t: NodeJS.Timeout | undefined;
        await Promise.race([Promise.all(writes), new Promise<void>((r) => (t = setTimeout(r, PENDING_WAIT_MS)))]);
        clearTimeout(t);
      }
      if (!this.userFile) return;
      // own file first: of two users stopping at once, the one listing last sees neither and clears
      await fsp.rm(this.userFile, { force: true }).catch(() => {});
      this.userFile = null;
      if ((await this.liveUsers()) === 0) {
        const removed = await this.removeEntries();
        if (removed > 0) this.o.log?.info({ dir: this.o.dir, removed }, 'prefix store: the last process using the folder removed its entries');
      }
    })().catch((err) => this.o.log?.warn({ err: String(err) }, 'prefix store: close failed'));
    return this.closing;
  }

  /** Write this store's user file; where no other live process uses the folder, remove the entries killed processes left. Never throws. */
  private async claim(): Promise<void> {
    const path = join(this.o.dir, `pdserve-storeuser-${process.pid}-${randomBytes(8).toString('hex')}.pid`);
    try {
      await fsp.writeFile(path, `${process.pid}\n`, { flag: 'wx' });
    } catch (err) {
      this.o.log?.warn({ path, err: String(err) }, 'prefix store: cannot mark the folder as used (its entries are not removed at stop)');
      return;
    }
    this.userFile = path;
    if ((await this.liveUsers()) === 0) {
      const removed = await this.removeEntries();
      if (removed > 0) this.o.log?.info({ dir: this.o.dir, removed }, 'prefix store: removed entries no running process uses (their processes were killed)');
    }
  }

  /** User files of live processes in the folder other than this store's (Infinity when it cannot be listed: assume users). */
  private async liveUsers(): Promise<number> {
    let names: string[];
    try {
      names = await fsp.readdir(this.o.dir);
    } catch {
      return Infinity;
    }
    let n = 0;
    for (const name of names) {
      const m = STORE_USER_FILE.exec(name);
      if (m && join(this.o.dir, name) !== this.userFile && processAlive(Number(m[1]))) n++;
    }
    return n;
  }

  /** Remove every entry of the folder; returns how many. Never throws. */
  private async removeEntries(): Promise<number> {
    let names: string[];
    try {
      names = await fsp.readdir(this.o.dir);
    } catch {
      return 0;
    }
    let removed = 0;
    for (const name of names) {
      const m = ENTRY.exec(name);
      if (!m) continue;
      await fsp.rm(join(this.o.dir, name), { force: true }).then(() => removed++, () => {});
      this.index.delete(m[1]!);
      this.ownWrites.delete(m[1]!);
    }
    this.stats.bytes = 0;
    this.stats.files = 0;
    return removed;
  }

  /**
   * Watch the directory: an entry name renamed in or out is added to the index (a name that is
   * gone is dropped at its next lookup or listing). Without notifications (fs.watch throws or
   * fails later) lookups list the folder when the index is older than INDEX_FRESH_MS.
   */
  private watchDir(): void {
    try {
      const w = watch(this.o.dir, { persistent: false }, (_event, name) => {
        const m = typeof name === 'string' ? ENTRY.exec(name) : null;
        if (m) {
          this.index.add(m[1]!);
          this.ownWrites.set(m[1]!, systemClock.nowMs());
        } else if (name == null) this.indexAt = -Infinity; // the kernel dropped names: list again
      });
      w.on('error', () => {
        w.close();
        if (this.watcher === w) this.watcher = null;
        this.indexAt = -Infinity;
      });
      this.watcher = w;
    } catch {
      this.watcher = null;
    }
  }

  /** Subscribe to stored / evicted events of this process's store operations; returns the unsubscribe function. */
  onEvent(fn: (e: KvCacheEvent) => void): () => void {
    this.listeners.add(fn);
    return () => this.listeners.delete(fn);
  }

  /** Path of the entry with chain key `key`. */
  entryPath(key: string): string {
    return join(this.o.dir, `pdserve-store-${key}.pdkv`);
  }

  private tmpPath(kind: 'storetmp' | 'storeload'): string {
    return join(this.o.dir, `pdserve-${kind}-${process.pid}-${randomBytes(8).toString('hex')}.ggsq`);
  }

  private emit(e: KvCacheEvent): void {
    for (const fn of this.listeners) {
      try {
        fn(e);
      } catch (err) {
        this.o.log?.warn({ err: String(err) }, 'prefix store event listener threw');
      }
    }
  }

  /** The chain keys a prompt may be served from (longest first) with their token counts. */
  private candidates(prompt: readonly number[], minReuse: number, salt: string | undefined): { key: string; tokens: number }[] {
    const id = this.id!;
    const B = this.blockTokens;
    const maxBlocks = Math.floor(Math.min(prompt.length - 1, id.compat.contextSize) / B);
    if (maxBlocks * B <= minReuse) return [];
    const chain = keyChain(saltedNamespace(this.ns, salt), prompt, maxBlocks, B);
    const out: { key: string; tokens: number }[] = [];
    for (let m = chain.length; m >= 1 && m * B > minReuse; m--) out.push({ key: chain[m - 1]!, tokens: m * B });
    return out;
  }

  /**
   * The candidates whose entry the index lists, longest first — after this process's own writes
   * of any of them settled (PENDING_WAIT_MS at most) and with a listing no older than
   * INDEX_FRESH_MS — or undefined when there were no candidates at all (no lookup to count).
   */
  private async present(cands: { key: string; tokens: number }[]): Promise<{ key: string; tokens: number }[] | undefined> {
    if (cands.length === 0) return undefined;
    const waits = cands.map((c) => this.writing.get(c.key)).filter((p) => p !== undefined);
    if (waits.length > 0) {
      let t: NodeJS.Timeout | undefined;
      await Promise.race([Promise.all(waits), new Promise<void>((r) => (t = setTimeout(r, PENDING_WAIT_MS)))]);
      clearTimeout(t);
    }
    // notifications keep the index current once one listing filled it; without them it ages
    if (this.indexAt === -Infinity || (!this.watcher && systemClock.nowMs() - this.indexAt >= INDEX_FRESH_MS)) await this.listIndex();
    return cands.filter((c) => this.index.has(c.key));
  }

  /** Refill the index from one readdir(2) of the directory (one at a time; callers meanwhile share it). Never throws. */
  private listIndex(): Promise<void> {
    this.listing ??= (async () => {
      const at = systemClock.nowMs();
      try {
        this.setIndex(await fsp.readdir(this.o.dir), at);
      } catch {
        /* unreadable directory: keep what is known; take() checks every file it opens */
      }
    })().finally(() => {
      this.listing = null;
    });
    return this.listing;
  }

  /** The index := the entries among `names` (a listing begun at monotonic `at` ms). */
  private setIndex(names: readonly string[], at: number): void {
    this.index.clear();
    for (const name of names) {
      const m = ENTRY.exec(name);
      if (m) this.index.add(m[1]!);
    }
    for (const [key, t] of this.ownWrites) {
      if (t >= at) this.index.add(key);
      else this.ownWrites.delete(key);
    }
    this.indexAt = at;
  }

  /** Number of entries the index lists now (tests, /debug). */
  get indexed(): number {
    return this.index.size;
  }

  async reusable(prompt: readonly number[], salt?: string): Promise<number> {
    const id = this.id;
    if (!id || this.closed) return 0;
    const cands = (await this.present(this.candidates(prompt, 0, salt))) ?? [];
    // the index is a hint: the chosen entry's file must be there (one access(2) on a hit)
    let c: { key: string; tokens: number } | undefined;
    for (const x of cands) {
      if (await fsp.access(this.entryPath(x.key)).then(() => true, () => false)) {
        c = x;
        break;
      }
      this.index.delete(x.key);
    }
    if (!c) return 0;
    // deterministic: the key ends at the exact prefix (whole chunks, when they are the blocks);
    // else the entry's length from its head: the prompt usually continues the whole stored sequence
    if (id.align !== null) return Math.floor(c.tokens / id.align) * id.align;
    const held = await this.entryTokens(this.entryPath(c.key));
    return Math.max(c.tokens, Math.min(held ?? 0, prompt.length - 1));
  }

  async take(prompt: readonly number[], minReuse: number, salt?: string): Promise<StoredPrefix | undefined> {
    const id = this.id;
    if (!id || this.closed) return undefined;
    const cands = await this.present(this.candidates(prompt, minReuse, salt));
    if (cands === undefined) return undefined;
    for (const c of cands) {
      const path = this.entryPath(c.key);
      let buf: Buffer;
      let ino = 0;
      try {
        const fh = await fsp.open(path, 'r');
        try {
          const st = await fh.stat();
          ino = st.ino;
          if (st.size > (this.o.maxFileBytes ?? this.o.maxBytes)) {
            await this.refuse(path, c, ino, 'too_large', `${st.size} bytes`);
            continue;
          }
          buf = await readWhole(fh, st.size);
        } finally {
          await fh.close();
        }
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code === 'ENOENT') this.index.delete(c.key);
        else this.o.log?.warn({ path, err: String(err) }, 'prefix store: entry unreadable');
        continue;
      }
      let parsed: { payload: Buffer; st: ReturnType<typeof parseStateFile> };
      try {
        parsed = this.validate(buf, prompt, c.tokens);
      } catch (err) {
        const e = err as { code?: string; message?: string };
        const reason: RefusedReason = e.code === 'BAD_ENVELOPE' ? 'bad_envelope' : e.code === 'KEY_MISMATCH' ? 'key_mismatch' : 'bad_state';
        await this.refuse(path, c, ino, reason, e.message ?? String(err));
        continue;
      }
      const { payload, st } = parsed;
      const exactPrefix = id.align === null ? st.nTokens : c.tokens;
      const reuse = reusableTokens(st.tokens, exactPrefix, prompt, id.align);
      if (reuse <= minReuse) break; // a shorter key serves no more
      const loadPath = this.tmpPath('storeload');
      try {
        const fh = await fsp.open(loadPath, 'wx');
        try {
          await fh.writev(reframedParts(payload, st, id.nStream));
        } finally {
          await fh.close();
        }
      } catch (err) {
        await fsp.rm(loadPath, { force: true }).catch(() => {});
        this.o.log?.warn({ err: String(err) }, 'prefix store: cannot write the load copy');
        break;
      }
      const now = new Date(systemClock.wallMs()); // a file's mtime is a wall-clock date
      void fsp.utimes(path, now, now).catch(() => {}); // LRU: a hit is a use
      this.stats.hits++;
      this.stats.hitTokens += reuse;
      this.counters.lookups?.inc({ result: 'hit' });
      this.counters.hitTokens?.inc(reuse);
      this.o.onLookup?.(true);
      return { path: loadPath, tokens: st.tokens, reuse, exactPrefix, done: () => fsp.rm(loadPath, { force: true }).catch(() => {}) };
    }
    this.stats.misses++;
    this.counters.lookups?.inc({ result: 'miss' });
    this.o.onLookup?.(false);
    return undefined;
  }

  /** Envelope + ggsq walk + key check of an entry's bytes. @throws coded errors (BAD_ENVELOPE, BAD_STATE, KEY_MISMATCH). */
  private validate(buf: Buffer, prompt: readonly number[], keyTokens: number): { payload: Buffer; st: ReturnType<typeof parseStateFile> } {
    const id = this.id!;
    const { contextSize, batchSize, nLayer } = id.compat;
    const { header, payload } = decodeEnvelope(buf, { fingerprint: id.fingerprint, contextSize, batchSize, maxPayloadBytes: this.o.maxFileBytes ?? this.o.maxBytes });
    const st = parseStateFile(payload, { contextSize, nLayer, nVocab: id.nVocab, maxBytes: payload.length });
    if (st.nTokens !== header.nTokens) throw new PdError('BAD_STATE', `state holds ${st.nTokens} tokens, envelope says ${header.nTokens}`);
    if (st.nTokens < keyTokens) throw new PdError('KEY_MISMATCH', `state holds ${st.nTokens} tokens, its key covers ${keyTokens}`);
    for (let i = 0; i < keyTokens; i++) if (st.tokens[i] !== prompt[i]) throw new PdError('KEY_MISMATCH', `token ${i} differs from the key's`);
    return { payload, st };
  }

  /** Remove a refused entry (unless another file was renamed onto its name meanwhile) and count it. */
  private async refuse(path: string, c: { key: string; tokens: number }, ino: number, reason: RefusedReason, detail: string): Promise<void> {
    this.stats.refused[reason]++;
    this.counters.refused?.inc({ reason });
    this.o.log?.warn({ path, reason, detail }, 'prefix store: entry refused and removed');
    this.index.delete(c.key);
    this.ownWrites.delete(c.key);
    try {
      if ((await fsp.stat(path)).ino !== ino) return;
      await fsp.rm(path, { force: true });
      this.emit({ kind: 'evicted', tier: 'store', key: c.key, tokens: c.tokens, bytes: 0 });
    } catch {
      /* gone already */
    }
  }

  async begin(tokens: readonly number[], exactPrefix: number, salt?: string): Promise<StoreWrite | undefined> {
    const id = this.id;
    if (!id || this.closed || this.o.write === false) return undefined;
    // The same key (whole blocks) may be reached again by a longer state of the same
    // conversation: that one replaces the entry (its reply serves the next round).
    const named = cacheKeyOf(saltedNamespace(this.ns, salt), tokens, exactPrefix, id.align, this.blockTokens);
    if (!named) return undefined;
    if (this.pendingWrites >= MAX_PENDING_WRITES) {
      this.drop();
      return undefined;
    }
    const { key, tokens: keyTokens } = named;
    const chain = keyChain(saltedNamespace(this.ns, salt), tokens, keyTokens / this.blockTokens, this.blockTokens);
    const final = this.entryPath(key);
    this.pendingWrites++;
    // Registered before the first await: a lookup of this key in this process waits for it
    // (the next round of a conversation often arrives while its previous round is being stored).
    let settled = false;
    let wake!: () => void;
    const written = new Promise<void>((r) => (wake = r));
    this.writing.set(key, written);
    const settle = (): void => {
      if (!settled) {
        this.pendingWrites--;
        if (this.writing.get(key) === written) this.writing.delete(key);
        wake();
      }
      settled = true;
    };
    const held = await this.entryTokens(final);
    if (held !== undefined && held >= tokens.length) {
      settle();
      return undefined; // stored already (by this or another process), as long or longer
    }
    const raw = this.tmpPath('storetmp');
    return {
      path: raw,
      commit: () => this.publishInTurn(raw, final, chain, keyTokens, tokens.length).finally(settle),
      abort: async () => {
        settle();
        this.drop();
        await fsp.rm(raw, { force: true }).catch(() => {});
      },
    };
  }

  /** Tokens of the entry at `path` from its envelope head (one small read), or undefined (none, unreadable, not ours). */
  private async entryTokens(path: string): Promise<number | undefined> {
    const id = this.id!;
    let fh: fsp.FileHandle | undefined;
    try {
      fh = await fsp.open(path, 'r');
      const buf = Buffer.alloc(ENVELOPE_PREFIX_BYTES + MAX_ENVELOPE_HEADER_BYTES + ENVELOPE_DIGEST_BYTES);
      const { bytesRead } = await fh.read(buf, 0, buf.length, 0);
      const head = parseEnvelopeHead(buf.subarray(0, bytesRead), { fingerprint: id.fingerprint, contextSize: id.compat.contextSize, batchSize: id.compat.batchSize, maxPayloadBytes: this.o.maxFileBytes ?? this.o.maxBytes });
      return head?.header.nTokens;
    } catch {
      return undefined;
    } finally {
      await fh?.close().catch(() => {});
    }
  }

  private drop(): void {
    this.stats.dropped++;
    this.counters.dropped?.inc();
  }

  /** `publish` in turn: at most MAX_PUBLISHING at once. Never throws. */
  private async publishInTurn(raw: string, final: string, chain: readonly string[], keyTokens: number, nTokens: number): Promise<void> {
    // a waiter inherits the turn of the publication that wakes it
    if (this.publishing >= MAX_PUBLISHING) await new Promise<void>((r) => this.publishQueue.push(r));
    else this.publishing++;
    try {
      await this.publish(raw, final, chain, keyTokens, nTokens);
    } finally {
      const next = this.publishQueue.shift();
      if (next) next();
      else this.publishing--;
    }
  }

  /** Wrap the saved state in an envelope and rename it onto its name; then the session rules. Never throws. */
  private async publish(raw: string, final: string, chain: readonly string[], keyTokens: number, nTokens: number): Promise<void> {
    const id = this.id!;
    const key = chain.at(-1)!;
    const env = raw.replace(/\.ggsq$/, '-env.ggsq');
    try {
      const rf = await fsp.open(raw, 'r');
      let payload: Buffer;
      try {
        payload = await readWhole(rf, (await rf.stat()).size);
      } finally {
        await rf.close();
      }
      await fsp.rm(raw, { force: true });
      // our own bytes too: a state this engine could not load is never published
      const st = parseStateFile(payload, { contextSize: id.compat.contextSize, nLayer: id.compat.nLayer, nVocab: id.nVocab, maxBytes: payload.length });
      if (st.nTokens !== nTokens) throw new PdError('BAD_STATE', `saved state holds ${st.nTokens} tokens, the sequence ${nTokens}`);
      const head = encodeEnvelopeHead({ fingerprint: id.fingerprint, contextSize: id.compat.contextSize, batchSize: id.compat.batchSize, nTokens, firstToken: 0, firstIsEog: false, payloadBytes: payload.length });
      const bytes = head.length + payload.length + 4;
      if (bytes > Math.min(this.o.maxBytes, this.o.maxFileBytes ?? this.o.maxBytes)) {
        this.drop();
        return;
      }
      const fh = await fsp.open(env, 'wx');
      try {
        await fh.writev([head, payload, envelopeTrailer(crc32(payload))]);
      } finally {
        await fh.close();
      }
      await fsp.rename(env, final);
      this.index.add(key);
      this.ownWrites.set(key, systemClock.nowMs());
      this.stats.writes++;
      this.counters.writes?.inc();
      this.emit({ kind: 'stored', tier: 'store', key, tokens: keyTokens, bytes });
      await this.sessionRules(chain, payload, st);
      this.scheduleScan();
    } catch (err) {
      this.drop();
      this.o.log?.warn({ err: String(err) }, 'prefix store: write failed');
    } finally {
      await fsp.rm(raw, { force: true }).catch(() => {});
      await fsp.rm(env, { force: true }).catch(() => {});
    }
  }

  /**
   * After `chain`'s entry was published (its saved `payload`, parsed as `st`): mark the entries on
   * its chain superseded unless a known line branches off there, and write the prefix it shares
   * with the known line it diverges from deepest as an entry of its own (see the module doc).
   * Never throws.
   */
  private async sessionRules(chain: readonly string[], payload: Buffer, st: ReturnType<typeof parseStateFile>): Promise<void> {
    const key = chain.at(-1)!;
    let deepest = 0;
    for (const [k, other] of this.lines) {
      if (k === key) continue;
      const l = commonKeys(other, chain);
      if (l < chain.length && l < other.length && l > deepest) deepest = l;
    }
    this.lines.delete(key);
    this.lines.set(key, chain);
    if (this.lines.size > MAX_LINES) this.lines.delete(this.lines.keys().next().value as string);
    for (let i = 0; i < chain.length - 1; i++) {
      const a = chain[i]!;
      if (this.shared.has(a) || !this.index.has(a)) continue;
      let branch = false;
      for (const other of this.lines.values()) if (other.length > i + 1 && other[i] === a && other[i + 1] !== chain[i + 1]) branch = true;
      if (branch) continue;
      try {
        this.supersededAt.set(a, (await fsp.stat(this.entryPath(a))).mtimeMs);
        this.lines.delete(a); // its keys are on this chain
      } catch {
        /* gone meanwhile */
      }
    }
    if (this.supersededAt.size > MAX_LINES) this.supersededAt.delete(this.supersededAt.keys().next().value as string);
    if (deepest < 1) return;
    const sharedKey = chain[deepest - 1]!;
    this.shared.add(sharedKey);
    this.supersededAt.delete(sharedKey);
    if (this.shared.size > MAX_LINES) this.shared.delete(this.shared.values().next().value as string);
    if (this.index.has(sharedKey)) return;
    await this.writeShared(sharedKey, deepest * this.blockTokens, payload, st);
  }

  /** Publish the first `keep` tokens of a saved state as the entry `key` (a shared prefix). Never throws. */
  private async writeShared(key: string, keep: number, payload: Buffer, st: ReturnType<typeof parseStateFile>): Promise<void> {
    const id = this.id!;
    const env = this.tmpPath('storetmp').replace(/\.ggsq$/, '-env.ggsq');
    try {
      const cut = Buffer.concat(truncatedStateParts(payload, st, keep));
      const head = encodeEnvelopeHead({ fingerprint: id.fingerprint, contextSize: id.compat.contextSize, batchSize: id.compat.batchSize, nTokens: keep, firstToken: 0, firstIsEog: false, payloadBytes: cut.length });
      const bytes = head.length + cut.length + 4;
      if (bytes > Math.min(this.o.maxBytes, this.o.maxFileBytes ?? this.o.maxBytes)) return;
      const fh = await fsp.open(env, 'wx');
      try {
        await fh.writev([head, cut, envelopeTrailer(crc32(cut))]);
      } finally {
        await fh.close();
      }
      await fsp.rename(env, this.entryPath(key));
      this.index.add(key);
      this.ownWrites.set(key, systemClock.nowMs());
      this.stats.sharedWrites++;
      this.stats.writes++;
      this.counters.writes?.inc();
      this.emit({ kind: 'stored', tier: 'store', key, tokens: keep, bytes });
    } catch (err) {
      this.o.log?.warn({ err: String(err) }, 'prefix store: shared-prefix write failed');
    } finally {
      await fsp.rm(env, { force: true }).catch(() => {});
    }
  }

  /** Entries this process evicted, by cause. */
  evictionStats(): { cause: 'superseded' | 'lru'; count: number }[] {
    return [
      { cause: 'lru', count: this.stats.evictions - this.stats.superseded },
      { cause: 'superseded', count: this.stats.superseded },
    ];
  }

  private tick(): void {
    if (systemClock.nowMs() - this.lastSweep >= STATE_SWEEP_MS) {
      this.lastSweep = systemClock.nowMs();
      void sweepStaleStateFiles(this.o.dir, this.o.log);
    }
    this.scheduleScan();
  }

  /** Run a budget scan now, or once more after the running one. */
  scheduleScan(): Promise<void> {
    if (this.scanning) {
      this.rescan = true;
      return this.scanning;
    }
    this.scanning = (async () => {
      do {
        this.rescan = false;
        await this.scan();
      } while (this.rescan && !this.closed);
    })().finally(() => {
      this.scanning = null;
    });
    return this.scanning;
  }

  /** List the entries, evict the least recently used beyond the budget, refresh the gauges. Never throws. */
  private async scan(): Promise<void> {
    let names: string[];
    const at = systemClock.nowMs();
    try {
      names = await fsp.readdir(this.o.dir);
    } catch {
      return;
    }
    this.setIndex(names, at);
    const entries: { name: string; key: string; size: number; mtimeMs: number; superseded: boolean }[] = [];
    for (const name of names) {
      const m = ENTRY.exec(name);
      if (!m) continue;
      try {
        const st = await fsp.stat(join(this.o.dir, name));
        entries.push({ name, key: m[1]!, size: st.size, mtimeMs: st.mtimeMs, superseded: this.supersededAt.get(m[1]!) === st.mtimeMs });
      } catch {
        /* evicted meanwhile */
      }
    }
    let total = entries.reduce((a, e) => a + e.size, 0);
    let files = entries.length;
    if (total > this.o.maxBytes) {
      // superseded first (unless hit since they were marked), then least recently used
      entries.sort((a, b) => Number(b.superseded) - Number(a.superseded) || a.mtimeMs - b.mtimeMs || (a.name < b.name ? -1 : 1));
      for (const e of entries) {
        if (total <= this.o.maxBytes) break;
        try {
          await fsp.rm(join(this.o.dir, e.name));
          this.index.delete(e.key);
          this.ownWrites.delete(e.key);
          this.stats.evictions++;
          if (e.superseded) this.stats.superseded++;
          this.supersededAt.delete(e.key);
          this.lines.delete(e.key);
          this.counters.evictions?.inc();
          this.emit({ kind: 'evicted', tier: 'store', key: e.key, tokens: 0, bytes: e.size });
        } catch {
          /* another process evicted it */
        }
        total -= e.size;
        files--;
      }
    }
    this.stats.bytes = total;
    this.stats.files = files;
  }

  /**
   * Register the store's metrics (pdserve_prefix_store_*) on `registry` and report each lookup
   * to `onLookup` (hit or miss). Once per store.
   */
  registerMetrics(registry: client.Registry, onLookup?: (hit: boolean) => void): void {
    if (onLookup) this.o.onLookup = onLookup;
    const registers = [registry];
    const stats = this.stats;
    const budget = (): number => this.o.maxBytes;
    new client.Gauge({ name: 'pdserve_prefix_store_bytes', help: "Bytes of the host's prefix store entries (state directory, last scan)", registers, collect() { this.set(stats.bytes); } });
    new client.Gauge({ name: 'pdserve_prefix_store_files', help: "Entries of the host's prefix store (last scan)", registers, collect() { this.set(stats.files); } });
    new client.Gauge({ name: 'pdserve_prefix_store_budget_bytes', help: 'Byte budget this process keeps the prefix store within (--prefix-store-bytes)', registers, collect() { this.set(budget()); } });
    this.counters.lookups = new client.Counter({ name: 'pdserve_prefix_store_lookups_total', help: 'Prompts looked up in the prefix store, by result (hit, miss)', labelNames: ['result'], registers });
    this.counters.hitTokens = new client.Counter({ name: 'pdserve_prefix_store_hit_tokens_total', help: 'Prompt tokens served from the prefix store (not evaluated again)', registers });
    this.counters.writes = new client.Counter({ name: 'pdserve_prefix_store_writes_total', help: 'Finished sequences stored in the prefix store', registers });
    this.counters.dropped = new client.Counter({ name: 'pdserve_prefix_store_dropped_total', help: 'Finished sequences not stored (writes in flight at the bound, or a write failed)', registers });
    this.counters.evictions = new client.Counter({ name: 'pdserve_prefix_store_evictions_total', help: 'Prefix store entries this process evicted over the budget (superseded first, then LRU; by cause: pdserve_cache_evictions_total)', registers });
    this.counters.refused = new client.Counter({ name: 'pdserve_prefix_store_refused_total', help: 'Prefix store entries refused and removed, by reason', labelNames: ['reason'], registers });
  }
}

/**
 * The store a worker's config asks for, or undefined (prefix cache off, `prefixStoreBytes` 0,
 * or a folder whose size cannot be read with no budget given).
 * @param engine the worker's engine config; `stateDir` its state directory (the default folder).
 */
export function openPrefixStore(engine: { prefixCacheTokens: number; prefixStoreBytes?: number | undefined; prefixStoreDir?: string | undefined }, stateDir: string, o: { write: boolean; maxFileBytes?: number; log?: Logger }): FilePrefixStore | undefined {
  if (engine.prefixCacheTokens <= 0) return undefined;
  const dir = engine.prefixStoreDir ?? stateDir;
  const maxBytes = engine.prefixStoreBytes ?? defaultPrefixStoreBytes(dir);
  if (maxBytes <= 0) return undefined;
  return new FilePrefixStore({ dir, maxBytes, write: o.write, ...(o.maxFileBytes !== undefined ? { maxFileBytes: o.maxFileBytes } : {}), ...(o.log ? { log: o.log } : {}) });
}

/** Leading keys two chains share (chained hashes: equal at i means equal before). */
function commonKeys(a: readonly string[], b: readonly string[]): number {
  const n = Math.min(a.length, b.length);
  let i = 0;
  while (i < n && a[i] === b[i]) i++;
  return i;
}
