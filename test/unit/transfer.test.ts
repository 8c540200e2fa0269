/**
 * The pipelined KV handoff's parts on real loopback sockets with a real state saved by the real
 * engine (tiny model): prefill's file sender (head, file in pooled pieces, CRC trailer) into
 * decode's streaming receiver (envelope head, ggsq walk and CRC while the bytes arrive, payload
 * written to its file as it comes). Damage is caught while streaming; cut streams at kv_end.
 */
import assert from 'node:assert/strict';
import { closeSync, existsSync, fstatSync, mkdtempSync, openSync, readdirSync, readFileSync, rmSync, statfsSync, statSync, truncateSync, writeFileSync, writeSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { GgsqStreamParser, parseStateFile } from '../../src/engine/ggsq.js';
import { newEpoch } from '../../src/kv/auth.js';
import { KvPeerPool, KvServer, type PeerConn } from '../../src/kv/channel.js';
import { encodeEnvelope, encodeEnvelopeHead, type EnvelopeExpect } from '../../src/kv/envelope.js';
import { Crc32, crc32, crc32Impl } from '../../src/kv/transfer/checksum.js';
import zlib from 'node:zlib';

const TMPFS_MAGIC = 0x01021994;
const statfsType = (dir: string): number => statfsSync(dir).type;
import { BufferPool, FilePool } from '../../src/kv/transfer/pool.js';
import { KvIo, kvIoForReceives, sharedKvIo } from '../../src/kv/transfer/io-thread.js';
import { StateReceiver } from '../../src/kv/transfer/receiver.js';
import { sendGrowingStateFile, sendStateFile, wireBytes } from '../../src/kv/transfer/sender.js';
import { PdError } from '../../src/base/errors.js';
import { saveTinyState } from '../helpers/engine.js';

const CTX = 256;
/** Pair settings both channel ends exchange in the handshake. */
const PAIR = { fingerprint: 'ab'.repeat(32), contextSize: CTX, batchSize: 64, flashAttention: true };
const FP = 'f'.repeat(64);
const EXPECT: EnvelopeExpect = { fingerprint: FP, contextSize: CTX, batchSize: 64, maxPayloadBytes: 1 << 24 };
const dir = mkdtempSync(path.join(os.tmpdir(), 'pdserve-transfer-test-'));
let state: Buffer;
let nTokens = 0;
let seq = 0;

before(async () => {
  ({ state, nTokens } = await saveTinyState(dir, CTX));
});
after(() => rmSync(dir, { recursive: true, force: true }));

const head = (payloadBytes = state.length, fingerprint = FP) => encodeEnvelopeHead({ fingerprint, contextSize: CTX, batchSize: 64, nTokens, firstToken: 1, firstIsEog: false, payloadBytes });
const receiver = (totalBytes: number, pool = new BufferPool(4096, 4)) =>
  new StateReceiver({ totalBytes, expect: EXPECT, walker: (n) => new GgsqStreamParser({ contextSize: CTX, nLayer: 2, maxBytes: n }), path: path.join(dir, `recv-${seq++}.ggsq`), pool });
const isBad = (re: RegExp) => (e: unknown) => {
  assert.ok(e instanceof PdError && (e.code === 'BAD_ENVELOPE' || e.code === 'BAD_STATE'), `BAD_ENVELOPE / BAD_STATE, got ${String(e)}`);
  assert.match((e as Error).message, re);
  return true;
};

describe('checksum and pool', () => {
  it('streaming CRC-32 over pieces equals the one-shot value', () => {
    const b = Buffer.from(Array.from({ length: 10_000 }, (_, i) => (i * 131) & 0xff));
    for (const cut of [1, 7, 4096, 9999]) assert.equal(new Crc32().update(b.subarray(0, cut)).update(b.subarray(cut)).value, crc32(b));
  });

  it('uses @node-rs/crc32 here, and its CRC-32 equals node:zlib\'s (so either side of a connection may use either)', () => {
    assert.equal(crc32Impl, 'node-rs', 'the native CRC-32 should load on linux-x64 (npm ci installs its prebuilt binary)');
    const zcrc = (zlib as unknown as { crc32: (d: Uint8Array, v?: number) => number }).crc32;
    const b = Buffer.from(Array.from({ length: 300_001 }, (_, i) => (i * 2654435761) >>> 24));
    assert.equal(crc32(b), zcrc(b));
    assert.equal(crc32(Buffer.alloc(0)), 0);
    // chained through the running value, pieces of odd sizes, in both directions
    let z = 0;
    const c = new Crc32();
    for (let o = 0; o < b.length; o += 65_537) {
      c.update(b.subarray(o, o + 65_537));
      z = zcrc(b.subarray(o, o + 65_537), z);
    }
    assert.equal(c.value, z);
    assert.equal(c.value, crc32(b));
  });

  it('the pool reuses released buffers and keeps at most maxBuffers', () => {
    const p = new BufferPool(1024, 2);
    const a = [p.acquire(), p.acquire(), p.acquire()];
    assert.equal(p.allocated, 3);
    for (const b of a) p.release(b);
    assert.equal(p.inUse, 0);
    const again = [p.acquire(), p.acquire()];
    assert.equal(p.reused, 2);
    assert.ok(again.every((b) => a.includes(b)));
    p.acquire();
    assert.equal(p.allocated, 4, 'the third buffer was not kept');
    const q = new BufferPool(16, 2);
    const [x, y] = [q.tryAcquire(), q.tryAcquire()];
    assert.ok(x && y);
    assert.equal(q.tryAcquire(), undefined, 'tryAcquire never allocates past the bound');
    q.release(x);
    assert.equal(q.tryAcquire(), x);
  });
});

describe('StateReceiver (in memory pieces)', () => {
  it('any split of the stream gives the same file, header and structure', async () => {
    const env = encodeEnvelope({ fingerprint: FP, contextSize: CTX, batchSize: 64, nTokens, firstToken: 1, firstIsEog: false }, state);
    for (const piece of [1, 13, 997, 65_536, env.length]) {
      const r = receiver(env.length);
      for (let i = 0; i < env.length; i += piece) r.push(env.subarray(i, i + piece));
      const got = await r.finish();
      assert.equal(got.header.nTokens, nTokens);
      assert.equal(got.state.nTokens, nTokens);
      assert.ok(readFileSync(got.path).equals(state), `piece ${piece}: the file holds exactly the payload`);
      await r.discard();
      assert.ok(!existsSync(got.path), 'discard deletes the file');
    }
  });

  it('damage is caught while streaming, at the chunk that carries it', async () => {
    const env = encodeEnvelope({ fingerprint: FP, contextSize: CTX, batchSize: 64, nTokens, firstToken: 1, firstIsEog: false }, state);
    const headLen = head().length;
    // another model: refused as soon as the head is in
    const other = encodeEnvelope({ fingerprint: 'e'.repeat(64), contextSize: CTX, batchSize: 64, nTokens, firstToken: 1, firstIsEog: false }, state);
    assert.throws(() => receiver(other.length).push(other.subarray(0, headLen)), isBad(/different model/));
    // a flipped n_stream in the ggsq header: refused with the first 4 KiB, long before the end
    const st = parseStateFile(state, { contextSize: CTX, maxBytes: state.length });
    const bent = Buffer.from(env);
    bent.writeUInt32LE(999, headLen + st.nStreamOffset);
    const r = receiver(bent.length);
    assert.throws(() => r.push(bent.subarray(0, headLen + 4096)), isBad(/n_stream 999/));
    assert.throws(() => r.push(bent.subarray(headLen + 4096)), isBad(/n_stream 999/), 'no input after an error');
    await r.discard();
    // more bytes than announced
    assert.throws(() => receiver(env.length - 1).push(env), isBad(/announced|needs/));
  });

  it('a flipped KV byte fails the CRC at kv_end; a cut stream fails as truncated', async () => {
    const env = encodeEnvelope({ fingerprint: FP, contextSize: CTX, batchSize: 64, nTokens, firstToken: 1, firstIsEog: false }, state);
    const flip = Buffer.from(env);
    flip[flip.length - 100] ^= 0x10;
    const a = receiver(flip.length);
    a.push(flip);
    await assert.rejects(a.finish(), isBad(/checksum mismatch/));
    await a.discard();
    const b = receiver(env.length);
    b.push(env.subarray(0, env.length - 1000));
    await assert.rejects(b.finish(), isBad(/truncated/));
    await b.discard();
  });
});

describe('FilePool (recycled destination files)', () => {
  const filesIn = (d: string) => readdirSync(d).filter((n) => n.endsWith('.ggsq')).sort();

  it('reuses a released file, sized exactly as asked; keeps at most maxFiles / maxBytes (deleting the rest in the background); close deletes the spares', async () => {
    const d = mkdtempSync(path.join(dir, 'fp-'));
    const fp = new FilePool({ dir: d, prefix: 'pdserve-kvrecv-1', maxFiles: 2, maxBytes: 10_000 });
    const a = fp.acquire(3000);
    assert.equal(a.reused, false);
    assert.equal(fstatSync(a.fd).size, 3000);
    writeSync(a.fd, Buffer.alloc(3000, 7));
    closeSync(a.fd);
    fp.release(a.path);
    assert.deepEqual(fp.spare, { files: 1, bytes: 3000 });
    const b = fp.acquire(2000); // the spare holds it and is at most twice the size: reused, cut to 2000
    assert.equal(b.path, a.path);
    assert.equal(b.reused, true);
    assert.equal(fstatSync(b.fd).size, 2000);
    assert.deepEqual(fp.spare, { files: 0, bytes: 0 }, 'a handed-out file is not a spare');
    const c = fp.acquire(5000); // nothing spare: a new file
    assert.notEqual(c.path, b.path);
    for (const f of [b, c]) closeSync(f.fd);
    const e = fp.acquire(6000);
    closeSync(e.fd);
    fp.release(b.path);
    fp.release(c.path);
    assert.deepEqual(fp.spare, { files: 2, bytes: 7000 });
    const deleted = fp.deleted;
    fp.release(e.path); // a third spare is over maxFiles (and maxBytes): deleted, in the background
    assert.equal(fp.deleted, deleted, 'the deletion is not done inside release (it runs off the event loop)');
    await fp.settled();
    assert.equal(fp.deleted, deleted + 1);
    assert.ok(!existsSync(e.path));
    assert.deepEqual(fp.spare, { files: 2, bytes: 7000 });
    // a much larger spare is not cut down for a small state: a new file instead
    const small = fp.acquire(100);
    assert.ok(small.path !== b.path && small.path !== c.path);
    closeSync(small.fd);
    rmSync(small.path);
    fp.close();
    assert.deepEqual(filesIn(d), [], 'close deleted every spare');
    const late = fp.acquire(10);
    closeSync(late.fd);
    fp.release(late.path);
    await fp.settled();
    assert.ok(!existsSync(late.path), 'after close a released file is deleted');
    assert.throws(() => new FilePool({ dir: d, prefix: 'x', maxFiles: -1, maxBytes: 0 }), RangeError);
    assert.throws(() => new FilePool({ dir: d, prefix: 'x', maxFiles: 1, maxBytes: 0, maxLargeBytes: -1 }), RangeError);
    assert.throws(() => new FilePool({ dir: d, prefix: 'x', maxFiles: 1, maxBytes: 0, largeIdleMs: 0 }), RangeError);
  });

  it('keeps large spares (over maxBytes) within maxLargeBytes: reused for a state of about their size, the oldest deleted to make room, deleted once idle or at close', async () => {
    const d = mkdtempSync(path.join(dir, 'fpl-'));
    const made = (fp: FilePool, n: number) => {
      const f = fp.acquire(n);
      closeSync(f.fd);
      return f.path;
    };
    const fp = new FilePool({ dir: d, prefix: 'pdserve-kvrecv-9', maxFiles: 4, maxBytes: 10_000, maxLargeBytes: 100_000, largeIdleMs: 60_000 });
    const small = made(fp, 4000);
    const big = made(fp, 64_000);
    const mid = made(fp, 30_000);
    const huge = made(fp, 200_000);
    fp.release(small);
    fp.release(big); // over maxBytes: a large spare
    assert.deepEqual(fp.spare, { files: 2, bytes: 68_000 });
    assert.deepEqual(fp.largeSpares, [64_000]);
    // a state of about its size takes it (cut by at most 1/16)
    const a = fp.acquire(62_000);
    assert.equal(a.path, big);
    assert.equal(fstatSync(a.fd).size, 62_000);
    closeSync(a.fd);
    assert.deepEqual(fp.largeSpares, [], 'a handed-out file is not a spare');
    fp.release(a.path);
    fp.release(mid); // both fit within maxLargeBytes
    assert.deepEqual(fp.largeSpares, [62_000, 30_000]);
    // one much larger than the state is not cut down to it (freeing its pages would block the loop)
    const b = fp.acquire(20_000);
    assert.ok(b.path !== big && b.path !== mid, 'neither large spare is cut to a third of its size');
    closeSync(b.fd);
    rmSync(b.path);
    // a newer one that does not fit with them makes room: the oldest goes, in the background
    const c = path.join(d, 'pdserve-kvrecv-9-c.ggsq'); // (made apart: acquire would grow a spare for it)
    writeFileSync(c, Buffer.alloc(50_000));
    fp.release(c);
    assert.deepEqual(fp.largeSpares, [30_000, 50_000]);
    await fp.settled();
    assert.ok(!existsSync(big), 'the oldest large spare is deleted');
    // over maxLargeBytes: deleted
    fp.release(huge);
    await fp.settled();
    assert.ok(!existsSync(huge));
    assert.deepEqual(fp.largeSpares, [30_000, 50_000]);
    // growing the largest smaller spare is fine (its pages are reused, the rest allocated by the writes)
    const g = fp.acquire(90_000);
    assert.equal(g.path, c);
    closeSync(g.fd);
    fp.release(g.path); // over maxLargeBytes with the 30 000-byte one: that one goes, in the background
    fp.close();
    await fp.settled(); // close deletes the spares at once; a deletion already under way finishes on its own
    assert.deepEqual(filesIn(d), [], 'close deleted the large spares too');
    assert.deepEqual(fp.spare, { files: 0, bytes: 0 });
    // idle: a large spare goes once no receive took it for largeIdleMs
    const fp2 = new FilePool({ dir: d, prefix: 'pdserve-kvrecv-10', maxFiles: 1, maxBytes: 1000, maxLargeBytes: 100_000, largeIdleMs: 1 });
    const idle = made(fp2, 50_000);
    fp2.release(idle);
    assert.deepEqual(fp2.largeSpares, [50_000]);
    const end = Date.now() + 5000;
    while (fp2.largeSpares.length > 0 && Date.now() < end) await new Promise((r) => setTimeout(r, 5));
    await fp2.settled();
    assert.deepEqual(fp2.largeSpares, [], 'dropped after its idle time');
    assert.ok(!existsSync(idle), 'and deleted');
    fp2.close();
  });

  it('a receiver takes its file from the pool; done recycles it, a failed transfer gives it back once, discard after finish deletes it', async () => {
    const d = mkdtempSync(path.join(dir, 'fpr-'));
    const fp = new FilePool({ dir: d, prefix: 'pdserve-kvrecv-1', maxFiles: 4, maxBytes: 1 << 24 });
    const env = encodeEnvelope({ fingerprint: FP, contextSize: CTX, batchSize: 64, nTokens, firstToken: 1, firstIsEog: false }, state);
    const rx = () => new StateReceiver({ totalBytes: env.length, expect: EXPECT, walker: (n) => new GgsqStreamParser({ contextSize: CTX, nLayer: 2, maxBytes: n }), files: fp, pool: new BufferPool(4096, 2) });
    // 1: received, loaded (done): back as a spare
    const r1 = rx();
    r1.push(env);
    const got1 = await r1.finish();
    assert.ok(readFileSync(got1.path).equals(state));
    await r1.done();
    await r1.done();
    await r1.discard(); // after done: nothing more
    assert.deepEqual(fp.spare, { files: 1, bytes: state.length });
    assert.ok(existsSync(got1.path));
    fp.close();
    assert.ok(!existsSync(got1.path), 'close deleted the spare');
    // 2: a spare overwritten; one that grew during its load is cut to the exact payload
    const fp2 = new FilePool({ dir: d, prefix: 'pdserve-kvrecv-2', maxFiles: 4, maxBytes: 1 << 24 });
    const rx2 = () => new StateReceiver({ totalBytes: env.length, expect: EXPECT, walker: (n) => new GgsqStreamParser({ contextSize: CTX, nLayer: 2, maxBytes: n }), files: fp2, pool: new BufferPool(4096, 2) });
    const a = rx2();
    a.push(env);
    const ga = await a.finish();
    writeFileSync(ga.path, Buffer.alloc(state.length + 100, 0xee)); // the load grew it (as an in-place re-frame does)
    await a.done();
    fp2.release(fp2.acquire(1).path); // (a tiny one: not chosen below)
    const b = rx2();
    b.push(env);
    const gb = await b.finish();
    assert.equal(gb.path, ga.path, 'the spare was reused');
    assert.equal(statSync(gb.path).size, state.length, 'exactly the payload');
    assert.ok(readFileSync(gb.path).equals(state), 'overwritten with the new payload');
    await b.done();
    const spares = fp2.spare.files;
    // 3: a corrupted transfer: its file goes back to the pool exactly once
    const flip = Buffer.from(env);
    flip[flip.length - 100] ^= 0x10;
    const c = rx2();
    c.push(flip);
    assert.equal(fp2.spare.files, spares - 1, 'the receiver holds a spare');
    await assert.rejects(c.finish(), isBad(/checksum mismatch/));
    await c.discard();
    await c.discard();
    await c.done();
    assert.equal(fp2.spare.files, spares, 'given back once');
    // 4: a failure while the finished file may still be read (a running load): deleted, not recycled
    const e = rx2();
    e.push(env);
    const ge = await e.finish();
    await e.discard();
    await e.done();
    assert.ok(!existsSync(ge.path), 'deleted: a load may hold it open');
    assert.equal(fp2.spare.files, spares - 1);
    fp2.close();
    assert.deepEqual(filesIn(d), [], 'nothing left behind');
  });
});

/**
 * The decode side of a real KV connection for these tests: a KvPeerPool that feeds each room's
 * chunks to `receivers.get(room)` (checking offsets) and resolves `ends.get(room)` at its kv_end.
 */
function decodeSide(secret: string) {
  const decodeEpoch = newEpoch();
  const receivers = new Map<string, StateReceiver>();
  const ends = new Map<string, () => void>();
  const pool = new KvPeerPool({
    secret,
    settings: PAIR,
    epoch: decodeEpoch,
    onMessage: (_c, msg) => {
      if (msg.type === 'kv_end') ends.get(msg.room)?.();
    },
    onChunk: (_c, room, offset, data) => {
      const r = receivers.get(room)!;
      assert.equal(offset, r.received);
      r.push(data);
    },
  });
  return { pool, decodeEpoch, receivers, ends };
}

describe('sendStateFile → StateReceiver over a real KV connection', () => {
  it('the file arrives intact through pooled pieces, in order; buffers are reused across transfers', async () => {
    const secret = 'transfer-test-secret';
    const file = path.join(dir, 'send.ggsq');
    writeFileSync(file, state);
    const recvPool = new BufferPool(4096, 4);
    const server = new KvServer({ host: '127.0.0.1', port: 0, secret, settings: PAIR, epoch: newEpoch(), onMessage: (conn, msg) => conns.push({ conn, msg }) });
    const conns: { conn: PeerConn; msg: unknown }[] = [];
    const port = await server.listen();
    const { pool, decodeEpoch, receivers, ends } = decodeSide(secret);
    try {
      const d = await pool.get('127.0.0.1', port);
      const sendPool = new BufferPool(8192, 4);
      for (const room of ['1', '2', '3']) {
        const h = head();
        receivers.set(room, receiver(wireBytes(h, state.length), recvPool));
        const ended = new Promise<void>((r) => ends.set(room, r));
        d.sendControl({ type: 'register', room, rid: `r${room}`, epoch: decodeEpoch });
        for (let i = 0; conns.length === 0; i++) {
          assert.ok(i < 400, 'register reached the server within 2 s');
          await new Promise((r) => setTimeout(r, 5));
        }
        const p = conns[0]!.conn;
        await sendStateFile(p, room, file, h, state.length, { pool: sendPool, pieceBytes: 3000 });
        p.sendControl({ type: 'kv_end', room });
        await ended;
        const got = await receivers.get(room)!.finish();
        assert.ok(readFileSync(got.path).equals(state), `room ${room}: intact`);
        await receivers.get(room)!.discard();
      }
      assert.equal(sendPool.allocated, 1, 'one read buffer (cut into pieces) for three transfers');
      assert.equal(sendPool.inUse, 0);
      assert.ok(recvPool.allocated <= 4, `receive buffers: never more than the pool's bound (allocated ${recvPool.allocated})`);
      assert.equal(recvPool.inUse, 0);
      await assert.rejects(sendStateFile(conns[0]!.conn, '9', file, head(state.length + 1), state.length + 1, { pool: sendPool, pieceBytes: 3000 }), isBad(/ended at byte/));
      await new Promise((r) => setTimeout(r, 50)); // pieces already queued are flushed first
      assert.equal(sendPool.inUse, 0, 'buffer back after a failed send, once the socket is done with its pieces');
    } finally {
      await pool.close();
      await server.close();
    }
  });

  it('a state file cut or deleted mid-send fails only that room: its buffer goes back, the connection carries the next room', async () => {
    const secret = 'transfer-test-secret';
    const piece = Math.floor(state.length / 8);
    assert.ok(piece >= 64, `the tiny state (${state.length} bytes) makes 8 pieces`);
    const server = new KvServer({ host: '127.0.0.1', port: 0, secret, settings: PAIR, epoch: newEpoch(), onMessage: (conn) => void (prefill ??= conn) });
    let prefill: PeerConn | undefined;
    const port = await server.listen();
    const recvPool = new BufferPool(4096, 4);
    const { pool, decodeEpoch, receivers, ends } = decodeSide(secret);
    // two slots of `piece` bytes: while one piece is on the wire the next is read
    const sendPool = new BufferPool(2 * piece, 2);
    const backWithin2s = async (what: string) => {
      for (let i = 0; sendPool.inUse > 0; i++) {
        assert.ok(i < 200, `${what}: the send's buffer is back once the socket is done with its pieces (inUse ${sendPool.inUse})`);
        await new Promise((r) => setTimeout(r, 10));
      }
    };
    /** Send `file` as `room`; `meddle` runs at the first flushed piece (the head), when pieces are already read. */
    const send = (room: string, file: string, meddle?: () => void) => {
      const h = head();
      receivers.set(room, receiver(wireBytes(h, state.length), recvPool));
      let first = true;
      return sendStateFile(prefill!, room, file, h, state.length, {
        pool: sendPool,
        pieceBytes: piece,
        onProgress: () => {
          if (first) meddle?.();
          first = false;
        },
      });
    };
    const sendWhole = async (room: string, file: string, meddle?: () => void) => {
      const ended = new Promise<void>((r) => ends.set(room, r));
      await send(room, file, meddle);
      prefill!.sendControl({ type: 'kv_end', room });
      await ended;
      const got = await receivers.get(room)!.finish();
      assert.ok(readFileSync(got.path).equals(state), `room ${room}: intact`);
      await receivers.get(room)!.discard();
    };
    try {
      const d = await pool.get('127.0.0.1', port);
      d.sendControl({ type: 'register', room: '20', rid: 'r20', epoch: decodeEpoch });
      for (let i = 0; !prefill; i++) {
        assert.ok(i < 400, 'register reached the server within 2 s');
        await new Promise((r) => setTimeout(r, 5));
      }
      // cut to one piece while the first pieces are in flight: the next read comes up short
      const cut = path.join(dir, 'cut.ggsq');
      writeFileSync(cut, state);
      await assert.rejects(send('20', cut, () => truncateSync(cut, piece)), isBad(/ended at byte/));
      await backWithin2s('cut');
      await receivers.get('20')!.discard();
      // deleted mid-send: the open descriptor still reads the whole inode, so the room completes intact
      const gone = path.join(dir, 'gone.ggsq');
      writeFileSync(gone, state);
      await sendWhole('21', gone, () => rmSync(gone));
      assert.ok(!existsSync(gone));
      await backWithin2s('deleted');
      // deleted before the send: that room fails with the fs error, nothing is held
      await assert.rejects(send('22', gone), (e: NodeJS.ErrnoException) => e.code === 'ENOENT');
      await receivers.get('22')!.discard();
      assert.equal(sendPool.inUse, 0, 'no buffer held by a send whose file was missing');
      // the same connection still carries the next room
      assert.ok(prefill!.alive, 'the connection outlives the failed rooms');
      const ok = path.join(dir, 'ok.ggsq');
      writeFileSync(ok, state);
      await sendWhole('23', ok);
      await backWithin2s('next room');
      assert.equal(recvPool.inUse, 0);
    } finally {
      await pool.close();
      await server.close();
    }
  });
});

describe('sendGrowingStateFile (streamed while the state is saved) → streamed StateReceiver', () => {
  /** A real KV connection, a decode side that records kv_end and feeds the room's receiver. */
  const link = async () => {
    const secret = 'transfer-test-secret';
    let prefill: PeerConn | undefined;
    const server = new KvServer({ host: '127.0.0.1', port: 0, secret, settings: PAIR, epoch: newEpoch(), onMessage: (conn) => void (prefill ??= conn) });
    const port = await server.listen();
    const receivers = new Map<string, StateReceiver>();
    const ends = new Map<string, (m: { totalBytes?: number; crc?: number }) => void>();
    const decodeEpoch = newEpoch();
    const pool = new KvPeerPool({
      secret,
      settings: PAIR,
      epoch: decodeEpoch,
      onMessage: (_c, msg) => {
        if (msg.type === 'kv_end') ends.get(msg.room)?.(msg);
      },
      onChunk: (_c, room, offset, data) => {
        const r = receivers.get(room)!;
        assert.equal(offset, r.received);
        r.push(data);
      },
    });
    const d = await pool.get('127.0.0.1', port);
    d.sendControl({ type: 'register', room: '40', rid: 'r40', epoch: decodeEpoch, kvStream: true });
    for (let i = 0; !prefill; i++) {
      assert.ok(i < 400, 'register reached the server within 2 s');
      await new Promise((r) => setTimeout(r, 5));
    }
    const close = async () => {
      await pool.close();
      await server.close();
    };
    return { prefill: prefill!, receivers, ends, close };
  };
  const streamedReceiver = (hintBytes: number, file: string, recvPool: BufferPool) =>
    new StateReceiver({ totalBytes: 1 << 24, streamed: { hintBytes }, expect: EXPECT, walker: (n) => new GgsqStreamParser({ contextSize: CTX, nLayer: 2, maxBytes: n }), path: file, pool: recvPool });
  /** Appends `data` to `file` in `pieces` writes, `gapMs` apart (as llama.cpp's fwrite does, front to back); resolves with the size. */
  const slowWriter = async (file: string, data: Buffer, pieces: number, gapMs: number, failAfter?: number): Promise<number> => {
    await new Promise((r) => setTimeout(r, gapMs)); // the file does not exist yet at first
    const fd = openSync(file, 'w');
    try {
      const step = Math.ceil(data.length / pieces);
      for (let i = 0, k = 0; i < data.length; i += step, k++) {
        if (failAfter !== undefined && k === failAfter) throw new Error('disk full (test)');
        writeSync(fd, data, i, Math.min(step, data.length - i), i);
        await new Promise((r) => setTimeout(r, gapMs));
      }
    } finally {
      closeSync(fd);
    }
    return data.length;
  };
  const sendBuffersBack = async (pool: BufferPool, what: string) => {
    for (let i = 0; pool.inUse > 0; i++) {
      assert.ok(i < 200, `${what}: the send's buffer is back (inUse ${pool.inUse})`);
      await new Promise((r) => setTimeout(r, 10));
    }
  };

  it('a file written in pieces with pauses arrives exactly, with the CRC-32 and size kv_end carries; estimates above and below the size both end in a file of the exact size', async () => {
    const l = await link();
    const recvPool = new BufferPool(4096, 4);
    const sendPool = new BufferPool(8192, 2);
    try {
      for (const [room, hint] of [['40', state.length - 999], ['41', state.length + 5000]] as const) {
        const file = path.join(dir, `grow-${room}.ggsq`);
        rmSync(file, { force: true });
        const h = head(0);
        const dest = path.join(dir, `grow-recv-${room}.ggsq`);
        l.receivers.set(room, streamedReceiver(h.length + hint, dest, recvPool));
        const ended = new Promise<{ totalBytes?: number; crc?: number }>((r) => l.ends.set(room, r));
        const saved = slowWriter(file, state, 9, 4);
        const sent = await sendGrowingStateFile(l.prefill, room, file, h, { saved, pool: sendPool, pieceBytes: 2048, growStallMs: 5000 });
        assert.equal(sent.payloadBytes, state.length);
        assert.equal(sent.totalBytes, h.length + state.length);
        assert.equal(sent.crc, crc32(state));
        l.prefill.sendControl({ type: 'kv_end', room, totalBytes: sent.totalBytes, crc: sent.crc });
        const end = await ended;
        const got = await l.receivers.get(room)!.finish({ totalBytes: end.totalBytes!, crc: end.crc! });
        assert.equal(got.header.payloadBytes, state.length, 'the header reports the real size');
        assert.equal(got.state.nTokens, nTokens);
        assert.ok(readFileSync(got.path).equals(state), `room ${room}: the received file is exactly the state`);
        await l.receivers.get(room)!.discard();
        assert.ok(!existsSync(dest), 'discard after finish deletes the file once');
        await sendBuffersBack(sendPool, `room ${room}`);
      }
      assert.equal(recvPool.inUse, 0);
    } finally {
      await l.close();
    }
  });

  it('a save that fails midway fails that send (buffer back once), the receiver fails at kv_end and its file goes once; the connection carries the next room', async () => {
    const l = await link();
    const recvPool = new BufferPool(4096, 4);
    const sendPool = new BufferPool(4096, 2);
    try {
      const file = path.join(dir, 'grow-fail.ggsq');
      rmSync(file, { force: true });
      const h = head(0);
      const dest = path.join(dir, 'grow-fail-recv.ggsq');
      const rx = streamedReceiver(h.length + state.length, dest, recvPool);
      l.receivers.set('42', rx);
      const saved = slowWriter(file, state, 8, 3, 4);
      saved.catch(() => {});
      await assert.rejects(sendGrowingStateFile(l.prefill, '42', file, h, { saved, pool: sendPool, pieceBytes: 1024 }), (e: unknown) => e instanceof PdError && e.code === 'BAD_STATE' && /saving the state failed: disk full/.test((e as Error).message));
      await sendBuffersBack(sendPool, 'failed save');
      // what decode sees: bytes stopped short; kv_end never comes (prefill fails the room), or a cut one is refused
      await assert.rejects(rx.finish({ totalBytes: h.length + state.length, crc: crc32(state) }), isBad(/truncated/));
      await rx.discard();
      await rx.discard();
      assert.ok(!existsSync(dest), 'the receiver\'s file is removed');
      assert.equal(recvPool.inUse, 0, 'the receiver\'s buffer back exactly once');
      assert.equal(sendPool.inUse, 0);
      // the next room on the same connection is intact
      const file2 = path.join(dir, 'grow-next.ggsq');
      rmSync(file2, { force: true });
      l.receivers.set('43', streamedReceiver(h.length + state.length, path.join(dir, 'grow-next-recv.ggsq'), recvPool));
      const ended = new Promise<{ totalBytes?: number; crc?: number }>((r) => l.ends.set('43', r));
      const sent = await sendGrowingStateFile(l.prefill, '43', file2, h, { saved: slowWriter(file2, state, 3, 2), pool: sendPool, pieceBytes: 1024 });
      l.prefill.sendControl({ type: 'kv_end', room: '43', totalBytes: sent.totalBytes, crc: sent.crc });
      const end = await ended;
      const got = await l.receivers.get('43')!.finish({ totalBytes: end.totalBytes!, crc: end.crc! });
      assert.ok(readFileSync(got.path).equals(state));
      await l.receivers.get('43')!.done();
    } finally {
      await l.close();
    }
  });

  it('a save queued behind the context lock (no file yet) waits up to createWaitMs, not growStallMs; kv_begin (onFileStart) goes out only once the file exists, before any byte; a refused kv_begin fails the send', async () => {
    const l = await link();
    const recvPool = new BufferPool(4096, 4);
    const sendPool = new BufferPool(8192, 2);
    try {
      const file = path.join(dir, 'grow-locked.ggsq');
      rmSync(file, { force: true });
      const h = head(0);
      l.receivers.set('46', streamedReceiver(h.length + state.length, path.join(dir, 'grow-locked-recv.ggsq'), recvPool));
      const ended = new Promise<{ totalBytes?: number; crc?: number }>((r) => l.ends.set('46', r));
      const t0 = Date.now();
      // llama.cpp's save waits 300 ms for the lock (file absent), then writes in pieces
      const saved = new Promise((r) => setTimeout(r, 300)).then(() => slowWriter(file, state, 4, 2));
      const starts: Array<{ at: number; received: number; exists: boolean }> = [];
      const onFileStart = () => {
        starts.push({ at: Date.now() - t0, received: l.receivers.get('46')!.received, exists: existsSync(file) });
        return true;
      };
      const sent = await sendGrowingStateFile(l.prefill, '46', file, h, { saved, pool: sendPool, pieceBytes: 2048, growStallMs: 150, createWaitMs: 5000, onFileStart });
      assert.equal(starts.length, 1, 'onFileStart once');
      assert.ok(starts[0]!.at >= 290, `kv_begin only after the save created the file (${starts[0]!.at} ms)`);
      assert.equal(starts[0]!.exists, true);
      assert.equal(starts[0]!.received, 0, 'no byte of the room before kv_begin');
      assert.equal(sent.crc, crc32(state));
      l.prefill.sendControl({ type: 'kv_end', room: '46', totalBytes: sent.totalBytes, crc: sent.crc });
      const end = await ended;
      const got = await l.receivers.get('46')!.finish({ totalBytes: end.totalBytes!, crc: end.crc! });
      assert.ok(readFileSync(got.path).equals(state));
      await l.receivers.get('46')!.discard();
      await sendBuffersBack(sendPool, 'locked save');

      // the connection cannot take kv_begin: the send fails at once with PEER_LOST, its buffer back, nothing sent
      const file2 = path.join(dir, 'grow-refused.ggsq');
      rmSync(file2, { force: true });
      writeFileSync(file2, state);
      l.receivers.set('47', streamedReceiver(h.length + state.length, path.join(dir, 'grow-refused-recv.ggsq'), recvPool));
      await assert.rejects(sendGrowingStateFile(l.prefill, '47', file2, h, { saved: Promise.resolve(state.length), pool: sendPool, pieceBytes: 2048, onFileStart: () => false }), (e: unknown) => e instanceof PdError && e.code === 'PEER_LOST');
      await sendBuffersBack(sendPool, 'refused kv_begin');
      assert.equal(l.receivers.get('47')!.received, 0, 'no byte of the refused room went out');
      await l.receivers.get('47')!.discard();
    } finally {
      await l.close();
    }
  });

  it('a save that stops writing fails the send at its deadline instead of waiting for it; a file that never appears too', async () => {
    const l = await link();
    const sendPool = new BufferPool(4096, 2);
    try {
      const file = path.join(dir, 'grow-stall.ggsq');
      writeFileSync(file, state.subarray(0, 100)); // the save wrote a little, then hangs
      const t0 = Date.now();
      const never = new Promise<number>(() => {});
      l.receivers.set('44', streamedReceiver(state.length, path.join(dir, 'grow-stall-recv.ggsq'), new BufferPool(4096, 2)));
      await assert.rejects(sendGrowingStateFile(l.prefill, '44', file, head(0), { saved: never, pool: sendPool, pieceBytes: 1024, growStallMs: 150 }), (e: unknown) => e instanceof PdError && e.code === 'TIMEOUT' && /did not grow for 150 ms/.test((e as Error).message));
      const took = Date.now() - t0;
      assert.ok(took >= 140 && took < 3000, `failed at the deadline (${took} ms)`);
      await sendBuffersBack(sendPool, 'stalled save');
      await l.receivers.get('44')!.discard();
      const missing = path.join(dir, 'grow-never.ggsq');
      rmSync(missing, { force: true });
      l.receivers.set('45', streamedReceiver(state.length, path.join(dir, 'grow-never-recv.ggsq'), new BufferPool(4096, 2)));
      await assert.rejects(sendGrowingStateFile(l.prefill, '45', missing, head(0), { saved: never, pool: sendPool, pieceBytes: 1024, growStallMs: 100 }), (e: unknown) => e instanceof PdError && e.code === 'TIMEOUT');
      await sendBuffersBack(sendPool, 'missing file');
      await l.receivers.get('45')!.discard();
      assert.ok(l.prefill.alive, 'the connection outlives the failed sends');
    } finally {
      await l.close();
    }
  });

  it('a streamed receiver refuses a head with a size, a kv_end with another count or CRC, and a kv_end without them', async () => {
    const pool = new BufferPool(4096, 4);
    const mk = () => streamedReceiver(state.length, path.join(dir, `sr-${seq++}.ggsq`), pool);
    const sized = mk();
    assert.throws(() => sized.push(head()), isBad(/payloadBytes 0/));
    await sized.discard();
    const h = head(0);
    const stream = Buffer.concat([h, state]);
    for (const [end, re] of [
      [{ totalBytes: stream.length + 1, crc: crc32(state) }, /truncated/],
      [{ totalBytes: stream.length, crc: (crc32(state) + 1) >>> 0 }, /checksum mismatch/],
      [undefined, /without its byte count/],
    ] as const) {
      const rx = mk();
      rx.push(stream);
      await assert.rejects(rx.finish(end), isBad(re));
      await rx.discard();
    }
    // bytes after the ggsq structure's end are refused as they arrive
    const rx = mk();
    assert.throws(() => rx.push(Buffer.concat([stream, Buffer.alloc(3)])), isBad(/trailing/));
    await rx.discard();
    assert.equal(pool.inUse, 0);
  });

  it('a streamed state over the receiver\'s limit fails STATE_TOO_LARGE once its bytes pass the limit, never as a bad structure first', async () => {
    const pool = new BufferPool(4096, 4);
    const h = head(0);
    const stream = Buffer.concat([h, state]);
    // The limit ends inside the last layer's data: its row header (before the limit) announces
    // data past it, which a walk bounded by the limit refuses as "goes past the limit".
    const limit = stream.length - 10;
    const rx = new StateReceiver({ totalBytes: limit, streamed: { hintBytes: stream.length }, expect: EXPECT, walker: (n) => new GgsqStreamParser({ contextSize: CTX, nLayer: 2, maxBytes: n }), path: path.join(dir, `sr-${seq++}.ggsq`), pool });
    for (let off = 0; off < limit; off += 1000) rx.push(stream.subarray(off, Math.min(limit, off + 1000)));
    assert.equal(rx.received, limit, 'every byte up to the limit is taken (the structure so far is sound)');
    const tooLarge = (e: unknown) => e instanceof PdError && e.code === 'STATE_TOO_LARGE' && new RegExp(`over the limit of ${limit} bytes`).test((e as Error).message);
    assert.throws(() => rx.push(stream.subarray(limit, limit + 1)), tooLarge);
    assert.throws(() => rx.push(Buffer.alloc(1)), tooLarge, 'the receive stays failed');
    await assert.rejects(rx.finish({ totalBytes: stream.length, crc: crc32(state) }), tooLarge);
    await rx.discard();
    assert.equal(pool.inUse, 0);
    // the announced (not streamed) receive keeps its own rule: bytes past the announce are a bad envelope
    const ann = receiver(stream.length - 1);
    assert.throws(() => ann.push(Buffer.concat([head(), state])), isBad(/kv_begin announced/));
    await ann.discard();
  });
});

describe('the data path on the KV I/O thread (io-thread.ts)', () => {
  const secret = 'transfer-test-secret';
  /** A KV pair whose decode receivers use `io` and pause the socket through the connection. */
  const pair = async (io: KvIo) => {
    let prefill: PeerConn | undefined;
    const server = new KvServer({ host: '127.0.0.1', port: 0, secret, settings: PAIR, epoch: newEpoch(), onMessage: (conn) => void (prefill ??= conn) });
    const port = await server.listen();
    const decodeEpoch = newEpoch();
    const receivers = new Map<string, StateReceiver>();
    const ends = new Map<string, () => void>();
    const errors = new Map<string, Error>();
    const lost: string[] = [];
    const pool = new KvPeerPool({
      secret,
      settings: PAIR,
      epoch: decodeEpoch,
      onPeerLost: (_c, reason) => void lost.push(reason),
      onMessage: (_c, msg) => {
        if (msg.type === 'kv_end') ends.get(msg.room)?.();
      },
      onChunk: (c, room, offset, data) => {
        const r = receivers.get(room)!;
        if (errors.has(room)) return;
        assert.equal(offset, r.received);
        try {
          r.push(data, c);
        } catch (e) {
          errors.set(room, e as Error);
        }
      },
    });
    const d = await pool.get('127.0.0.1', port);
    d.sendControl({ type: 'register', room: '1', rid: 'r1', epoch: decodeEpoch });
    for (let i = 0; !prefill; i++) {
      assert.ok(i < 400, 'register reached the server within 2 s');
      await new Promise((r) => setTimeout(r, 5));
    }
    const recvFiles = new FilePool({ dir, prefix: `pdserve-kvrecv-io-${seq++}`, maxFiles: 2, maxBytes: 1 << 24 });
    const newReceiver = (room: string, h: Buffer, viaThread = true) => {
      const r = new StateReceiver({ totalBytes: wireBytes(h, state.length), expect: EXPECT, walker: (n) => new GgsqStreamParser({ contextSize: CTX, nLayer: 2, maxBytes: n }), files: recvFiles, pool: new BufferPool(4096, 2), ...(viaThread ? { io } : {}) });
      receivers.set(room, r);
      return r;
    };
    return { prefill: prefill!, server, pool, receivers, ends, errors, lost, recvFiles, newReceiver, close: async () => (await pool.close(), await server.close(), recvFiles.close()) };
  };
  const openFds = () => readdirSync('/proc/self/fd').length;

  it('through the thread\'s slots, both ways, the file is byte-identical to the inline path\'s; every slot goes back', async () => {
    // slots far smaller than the state: many jobs, the reservation reused, the socket paused and resumed
    const io = new KvIo({ slotBytes: 4096, slots: 16, minBytes: 0 });
    assert.equal(io.available, false, 'not available before the thread is ready (transfers go inline meanwhile)');
    assert.ok(await io.start(), 'the thread starts');
    assert.ok(io.available);
    const p = await pair(io);
    const file = path.join(dir, 'io-send.ggsq');
    writeFileSync(file, state);
    try {
      const got: Buffer[] = [];
      for (const [room, viaThread] of [['31', true], ['32', false], ['33', true]] as const) {
        const h = head();
        const rx = p.newReceiver(room, h, viaThread);
        const ended = new Promise<void>((r) => p.ends.set(room, r));
        await sendStateFile(p.prefill, room, file, h, state.length, { pool: new BufferPool(8192, 2), chunkBytes: 4096, ...(viaThread ? { io } : {}) });
        p.prefill.sendControl({ type: 'kv_end', room });
        await ended;
        assert.equal(p.errors.get(room), undefined, `room ${room}: no receive error`);
        const r = await rx.finish();
        got.push(readFileSync(r.path));
        await rx.done();
      }
      for (const b of got) assert.ok(b.equals(state), 'each received file equals the sent state, byte for byte');
      assert.equal(io.freeSlots, 16, 'every reserved slot is back in the pool');
      assert.equal(io.deaths, 0);
      assert.ok(io.jobs >= 4 * Math.ceil(state.length / 4096), `both threaded rooms' reads and writes went through the thread (${io.jobs} jobs)`);
    } finally {
      await p.close();
      await io.close();
    }
  });

  it('a state smaller than the thread\'s minBytes goes inline on both sides (no job on the thread), byte-identical', async () => {
    const io = new KvIo({ slotBytes: 4096, slots: 16, minBytes: state.length + 1 });
    assert.ok(await io.start());
    assert.equal(io.wants(state.length), false);
    assert.equal(io.wants(state.length + 1), true);
    const p = await pair(io);
    const file = path.join(dir, 'io-small.ggsq');
    writeFileSync(file, state);
    try {
      const h = head();
      const rx = p.newReceiver('35', h, true);
      const ended = new Promise<void>((r) => p.ends.set('35', r));
      await sendStateFile(p.prefill, '35', file, h, state.length, { pool: new BufferPool(8192, 2), chunkBytes: 4096, io });
      p.prefill.sendControl({ type: 'kv_end', room: '35' });
      await ended;
      assert.equal(p.errors.get('35'), undefined, 'no receive error');
      const r = await rx.finish();
      assert.ok(readFileSync(r.path).equals(state), 'the received file equals the sent state');
      await rx.done();
      assert.equal(io.jobs, 0, 'neither side used the thread');
      assert.equal(io.freeSlots, 16, 'no slot reserved');
    } finally {
      await p.close();
      await io.close();
    }
  });

  it('a receive into a tmpfs directory writes inline (no thread); into another file system, through the shared thread', (t) => {
    const tmpfs = '/dev/shm';
    const disk = process.cwd(); // the checkout: not tmpfs on a developer's or CI machine
    if (!existsSync(tmpfs) || statfsType(tmpfs) !== TMPFS_MAGIC || statfsType(disk) === TMPFS_MAGIC) return t.skip('needs a tmpfs /dev/shm and a checkout on another file system');
    assert.equal(kvIoForReceives(tmpfs), undefined, 'tmpfs: inline');
    assert.equal(kvIoForReceives(disk), sharedKvIo(), 'a disk: the shared thread');
    assert.equal(kvIoForReceives(path.join(disk, 'no-such-dir-' + process.pid)), sharedKvIo(), 'a directory that cannot be checked: the thread');
  });

  it('a thread that dies mid-transfer fails that room on each side (slots and descriptors back once, the file given up once); the process and the connection live, and the next room goes through a restarted thread', async () => {
    const io = new KvIo({ slotBytes: 4096, slots: 16, minBytes: 0 });
    const p = await pair(io);
    const file = path.join(dir, 'io-crash.ggsq');
    writeFileSync(file, state);
    assert.ok(state.length > 8 * 4096, `the tiny state (${state.length} bytes) spans more than one reservation of slots`);
    try {
      const fds = openFds();
      // sending side: the reading thread dies at its 3rd read
      io.crashAfterJobs = 3;
      assert.ok(await io.start());
      const h = head();
      p.newReceiver('41', h, false);
      await assert.rejects(sendStateFile(p.prefill, '41', file, h, state.length, { pool: new BufferPool(8192, 2), chunkBytes: 4096, io }), (e: unknown) => e instanceof PdError && e.code === 'ABORTED' && /I\/O thread died/.test((e as Error).message));
      await p.receivers.get('41')!.discard();
      // receiving side: the writing thread dies at its 3rd write; the sender, inline, completes
      io.crashAfterJobs = 3;
      assert.equal(io.available, false, 'no thread right after the death (a restart is under way)');
      assert.ok(await io.start(), 'restarted');
      const rx = p.newReceiver('42', h);
      const ended = new Promise<void>((r) => p.ends.set('42', r));
      await sendStateFile(p.prefill, '42', file, h, state.length, { pool: new BufferPool(8192, 2), chunkBytes: 4096 });
      p.prefill.sendControl({ type: 'kv_end', room: '42' });
      await ended;
      const seen = p.errors.get('42') ?? (await rx.finish().then(() => undefined, (e: Error) => e));
      assert.ok(seen instanceof PdError && seen.code === 'ABORTED' && /I\/O thread died/.test(seen.message), `the receive failed with the thread's death, got ${String(seen)}`);
      await assert.rejects(rx.finish(), 'a failed receive stays failed');
      await rx.discard();
      await rx.discard();
      assert.equal(io.deaths, 2, 'both threads died');
      for (let i = 0; io.freeSlots < 16 || openFds() > fds; i++) {
        assert.ok(i < 200, `slots (${io.freeSlots} of 16 free) and descriptors (${openFds()} open, ${fds} before) back within 2 s`);
        await new Promise((r) => setTimeout(r, 10));
      }
      assert.equal(p.recvFiles.spare.files, 1, 'the failed receive\'s file went back to the file pool once');
      assert.ok(p.prefill.alive, `the connection outlives the failed rooms (lost: ${p.lost.join('; ') || 'none'})`);
      // a new thread for the next room, which arrives intact
      assert.ok(await io.start(), 'restarted again');
      const rx2 = p.newReceiver('43', h);
      const ended2 = new Promise<void>((r) => p.ends.set('43', r));
      await sendStateFile(p.prefill, '43', file, h, state.length, { pool: new BufferPool(8192, 2), chunkBytes: 4096, io });
      p.prefill.sendControl({ type: 'kv_end', room: '43' });
      await ended2;
      const r = await rx2.finish();
      assert.ok(readFileSync(r.path).equals(state), 'the next room is intact');
      await rx2.done();
      assert.equal(io.freeSlots, 16);
    } finally {
      await p.close();
      await io.close();
    }
  });
});
