/**
 * `--kv-streams N`: one KV connection's chunk frames striped over N sockets (src/kv/stripes.ts,
 * PeerConn's rotation). The reassembly alone on every interleaving of the sockets (fast-check),
 * then real loopback sockets: the handshake agrees on the smaller N, striped and unstriped
 * receivers get byte-identical files of a real llama.cpp state (inline and through the KV I/O
 * thread, whose pauses stop every socket), and a stripe lost mid-transfer fails its connection's
 * rooms on both sides within the liveness budget, with nothing left behind.
 */
import assert from 'node:assert/strict';
import { mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { createHash, randomBytes } from 'node:crypto';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import fc from 'fast-check';
import { GgsqStreamParser } from '../../src/engine/ggsq.js';
import { newEpoch } from '../../src/kv/auth.js';
import { KvPeerPool, KvServer, type PeerConn } from '../../src/kv/channel.js';
import { encodeEnvelopeHead, type EnvelopeExpect } from '../../src/kv/envelope.js';
import { StripeReorder } from '../../src/kv/stripes.js';
import type { RoomId } from '../../src/kv/types.js';
import { IO_SLOTS_PER_TRANSFER, KvIo } from '../../src/kv/transfer/io-thread.js';
import { BufferPool, FilePool } from '../../src/kv/transfer/pool.js';
import { StateReceiver } from '../../src/kv/transfer/receiver.js';
import { sendStateFile, wireBytes } from '../../src/kv/transfer/sender.js';
import { saveTinyState } from '../helpers/engine.js';

const CTX = 256;
const PAIR = { fingerprint: 'ab'.repeat(32), contextSize: CTX, batchSize: 64, flashAttention: true };
const FP = 'f'.repeat(64);
const EXPECT: EnvelopeExpect = { fingerprint: FP, contextSize: CTX, batchSize: 64, maxPayloadBytes: 1 << 24 };
const SECRET = 'stripes-test-secret';
const dir = mkdtempSync(path.join(os.tmpdir(), 'pdserve-stripes-test-'));
let state: Buffer;
let nTokens = 0;
let seq = 0;

before(async () => {
  ({ state, nTokens } = await saveTinyState(dir, CTX));
});
after(() => rmSync(dir, { recursive: true, force: true }));

const head = () => encodeEnvelopeHead({ fingerprint: FP, contextSize: CTX, batchSize: 64, nTokens, firstToken: 1, firstIsEog: false, payloadBytes: state.length });
const R = (n: number) => String(n) as RoomId;

describe('StripeReorder (the reassembly alone)', () => {
  it('any interleaving of the sockets gives each room its bytes in order, kv_end after its last byte, nothing held after; a socket stopped for what it holds never stops the transfer', () => {
    fc.assert(
      fc.property(fc.integer({ min: 1, max: 4 }), fc.integer({ min: 1, max: 3 }), fc.array(fc.nat(), { minLength: 64, maxLength: 64 }), (sockets, rooms, picks) => {
        // the sender: per room kv_begin on socket 0, pieces dealt round robin, kv_end on socket 0
        const queues: { kind: 'begin' | 'chunk' | 'end'; room: RoomId; off: number; data: Buffer }[][] = Array.from({ length: sockets }, () => []);
        const sent = new Map<RoomId, Buffer>();
        let rr = 0;
        for (let r = 1; r <= rooms; r++) {
          const blob = randomBytes(100 + r * 37);
          sent.set(R(r), blob);
          queues[0]!.push({ kind: 'begin', room: R(r), off: blob.length, data: Buffer.alloc(0) });
          for (let off = 0; off < blob.length; off += 23) queues[rr++ % sockets]!.push({ kind: 'chunk', room: R(r), off, data: blob.subarray(off, off + 23) });
          queues[0]!.push({ kind: 'end', room: R(r), off: 0, data: Buffer.alloc(0) });
        }
        const got = new Map<RoomId, Buffer[]>();
        const ended: RoomId[] = [];
        const stopped = new Set<number>();
        const sink = {
          chunk: (room: RoomId, offset: number, data: Buffer) => {
            const parts = got.get(room) ?? [];
            assert.equal(offset, parts.reduce((a, b) => a + b.length, 0), `room ${room}: in order`);
            assert.ok(!ended.includes(room), 'no byte after kv_end');
            parts.push(Buffer.from(data));
            got.set(room, parts);
          },
          end: (room: RoomId) => void ended.push(room),
          paused: () => false,
          holdSocket: (i: number) => {
            assert.ok(!stopped.has(i), 'held once');
            stopped.add(i);
          },
          releaseSocket: (i: number) => {
            assert.ok(stopped.delete(i), 'released once, after its hold');
          },
        };
        // tiny hold marks: sockets are stopped and released many times in a run
        const ro = new StripeReorder(sink, 1 << 20, { high: 46, low: 23 });
        // the receiver: reads the sockets that are not stopped in an arbitrary order, each in order
        let k = 0;
        while (queues.some((q) => q.length > 0)) {
          const live = queues.map((q, i) => ({ q, i })).filter(({ q, i }) => q.length > 0 && !stopped.has(i));
          assert.ok(live.length > 0, `deadlock: sockets ${[...stopped].join(', ')} stopped with bytes left (held ${ro.heldBytes})`);
          const { q, i } = live[picks[k++ % picks.length]! % live.length]!;
          const f = q.shift()!;
          if (f.kind === 'begin') {
            ro.begin(f.room, f.off);
            ro.drain();
          } else if (f.kind === 'chunk') ro.chunk(f.room, f.off, f.data, i);
          else if (ro.end(f.room, f)) sink.end(f.room);
        }
        for (const [room, blob] of sent) assert.ok(Buffer.concat(got.get(room) ?? []).equals(blob), `room ${room}: intact`);
        assert.deepEqual([...ended].sort(), [...sent.keys()].sort(), 'every kv_end delivered once');
        assert.equal(ro.heldBytes, 0);
        assert.equal(ro.size, 0, 'no room state left');
        assert.equal(stopped.size, 0, 'every stopped socket reads again');
      }),
      { numRuns: 300 },
    );
  });

  it('refuses an overlap and bytes over its cap; a forgotten room drops what it held and its late bytes pass through', () => {
    const passed: number[] = [];
    const ro = new StripeReorder({ chunk: (_r, off) => void passed.push(off), end: () => {}, paused: () => false, holdSocket: () => {}, releaseSocket: () => {} }, 100);
    ro.begin(R(1), 1000);
    ro.chunk(R(1), 0, Buffer.alloc(10));
    assert.throws(() => ro.chunk(R(1), 5, Buffer.alloc(10)), /overlaps/);
    ro.chunk(R(1), 50, Buffer.alloc(60));
    assert.throws(() => ro.chunk(R(1), 200, Buffer.alloc(41)), /out of order \(max 100\)/);
    assert.equal(ro.heldBytes, 60);
    ro.forget(R(1));
    assert.equal(ro.heldBytes, 0);
    assert.equal(ro.size, 0);
    ro.chunk(R(1), 500, Buffer.alloc(5)); // a late piece of an ended room: the handler refuses it, as without stripes
    assert.deepEqual(passed, [0, 500]);
    assert.equal(ro.size, 0);
  });

  it('held bytes wait while the receiver is paused and go on at drain', () => {
    let paused = false;
    const got: number[] = [];
    const ro = new StripeReorder({ chunk: (_r, off) => void got.push(off), end: () => {}, paused: () => paused, holdSocket: () => {}, releaseSocket: () => {} }, 1 << 20);
    ro.chunk(R(7), 10, Buffer.alloc(10)); // before its kv_begin: held
    ro.chunk(R(7), 0, Buffer.alloc(10));
    assert.deepEqual(got, []);
    ro.begin(R(7), 20);
    paused = true;
    ro.drain();
    assert.deepEqual(got, []);
    paused = false;
    ro.drain();
    assert.deepEqual(got, [0, 10]);
  });
});

describe('striped KV connections on real sockets', () => {
  /** A prefill server and a decode pool with `streams` each; decode's receivers push in order (asserted) and may use `io`. */
  const pair = async (prefillStreams: number, decodeStreams: number, io?: KvIo) => {
    let prefill: PeerConn | undefined;
    const lost: { side: string; reason: string; at: number }[] = [];
    const server = new KvServer({ host: '127.0.0.1', port: 0, secret: SECRET, settings: PAIR, epoch: newEpoch(), streams: prefillStreams, onMessage: (conn) => void (prefill ??= conn), onPeerLost: (_c, reason) => void lost.push({ side: 'prefill', reason, at: performance.now() }) });
    const port = await server.listen();
    const decodeEpoch = newEpoch();
    const receivers = new Map<string, StateReceiver<unknown>>();
    const ends = new Map<string, () => void>();
    const errors = new Map<string, Error>();
    const pool = new KvPeerPool({
      secret: SECRET,
      settings: PAIR,
      epoch: decodeEpoch,
      streams: decodeStreams,
      onPeerLost: (_c, reason) => void lost.push({ side: 'decode', reason, at: performance.now() }),
      onMessage: (_c, msg) => {
        if (msg.type === 'kv_end') ends.get(msg.room)?.();
      },
      onChunk: (c, room, offset, data) => {
        const r = receivers.get(room);
        if (!r || errors.has(room)) return;
        try {
          assert.equal(offset, r.received, 'chunks reach the handler in order');
          r.push(data, c);
        } catch (e) {
          errors.set(room, e as Error);
        }
      },
    });
    const d = await pool.get('127.0.0.1', port);
    d.sendControl({ type: 'register', room: '1', rid: 'r1', epoch: decodeEpoch });
    for (let i = 0; !prefill || prefill.sockets < Math.min(prefillStreams, decodeStreams); i++) {
      assert.ok(i < 400, `register and ${Math.min(prefillStreams, decodeStreams)} sockets within 2 s (have ${prefill?.sockets})`);
      await new Promise((r) => setTimeout(r, 5));
    }
    const files = new FilePool({ dir, prefix: `pdserve-kvrecv-stripes-${seq++}`, maxFiles: 2, maxBytes: 1 << 24 });
    const newReceiver = (room: string, h: Buffer) => {
      const r = new StateReceiver({ totalBytes: wireBytes(h, state.length), expect: EXPECT, walker: (n) => new GgsqStreamParser({ contextSize: CTX, nLayer: 2, maxBytes: n }), files, pool: new BufferPool(4096, 2), ...(io ? { io } : {}) });
      receivers.set(room, r);
      return r;
    };
    /** Sends the tiny state as `room` in `piece`-byte pieces; resolves with the received file's bytes. */
    const roundTrip = async (room: string, file: string, piece: number) => {
      const h = head();
      const rx = newReceiver(room, h);
      const ended = new Promise<void>((r) => ends.set(room, r));
      prefill!.sendControl({ type: 'kv_begin', room: room as RoomId, totalBytes: wireBytes(h, state.length) });
      await sendStateFile(prefill!, room as RoomId, file, h, state.length, { pool: new BufferPool(8 * piece, 4), pieceBytes: piece, ...(io ? { io } : {}) });
      prefill!.sendControl({ type: 'kv_end', room: room as RoomId });
      await ended;
      assert.equal(errors.get(room), undefined, `room ${room}: no receive error`);
      const got = await rx.finish();
      const bytes = readFileSync(got.path);
      await rx.done();
      return bytes;
    };
    return { prefill: prefill!, decode: d, server, pool, lost, files, errors, receivers, newReceiver, roundTrip, decodeEpoch, close: async () => (await pool.close(), await server.close(), files.close()) };
  };

  it('the pair agrees on the smaller count; striped (2, 4) and unstriped decode receive byte-identical files', async () => {
    const file = path.join(dir, 'stripe-send.ggsq');
    writeFileSync(file, state);
    const files: Buffer[] = [];
    for (const [p, d, want] of [[1, 1, 1], [4, 2, 2], [4, 4, 4], [2, 4, 2], [4, 1, 1]] as const) {
      const x = await pair(p, d);
      try {
        assert.equal(x.prefill.streams, want, `prefill ${p} / decode ${d}: ${want} agreed on prefill`);
        assert.equal(x.decode.streams, want, 'and on decode');
        assert.equal(x.prefill.sockets, want, 'every stripe joined');
        assert.equal(x.server.connections().length, 1, 'the stripes are not connections of their own');
        assert.equal(x.pool.connections().length, 1);
        for (const room of ['11', '12']) files.push(await x.roundTrip(room, file, 1024));
      } finally {
        await x.close();
      }
    }
    for (const b of files) assert.ok(b.equals(state), 'every received file equals the sent state, byte for byte');
  });

  it('through the KV I/O thread (its pauses stop every socket) the striped file is byte-identical; every slot goes back', async () => {
    const io = new KvIo({ slotBytes: 4096, slots: 16, minBytes: 0 });
    assert.ok(await io.start());
    const file = path.join(dir, 'stripe-io.ggsq');
    writeFileSync(file, state);
    const x = await pair(4, 4, io);
    try {
      for (const room of ['21', '22', '23']) assert.ok((await x.roundTrip(room, file, 4096)).equals(state), `room ${room}: intact`);
      assert.equal(io.freeSlots, 16, 'every reserved slot is back');
      assert.equal(io.deaths, 0);
    } finally {
      await x.close();
      await io.close();
    }
  });

  it('a 24 MiB blob over 4 sockets arrives in order and intact; the reassembly holds nothing afterwards', async () => {
    const x = await pair(4, 4);
    try {
      const blob = randomBytes(24 << 20);
      const want = createHash('sha256').update(blob).digest('hex');
      const h = createHash('sha256');
      let got = 0;
      const done = new Promise<void>((resolve) => {
        x.pool.onChunk = (_c, room, offset, data) => {
          assert.equal(offset, got, 'in order');
          h.update(data);
          got += data.length;
          if (got === blob.length) resolve();
        };
      });
      // kv_begin first so that the reassembly knows the room (as prefill's shell sends it)
      x.prefill.sendControl({ type: 'kv_begin', room: R(31), totalBytes: blob.length });
      await x.prefill.sendChunks(R(31), blob, { chunkBytes: 256 * 1024 });
      await done;
      assert.equal(h.digest('hex'), want);
      x.decode.sendControl({ type: 'kv_ack', room: R(31), epoch: x.decodeEpoch });
      const ro = (x.decode as unknown as { reorder: StripeReorder }).reorder;
      assert.equal(ro.heldBytes, 0);
      assert.equal(ro.size, 0);
    } finally {
      await x.close();
    }
  });

  it('rooms still take turns over stripes: a 1 MiB room started behind a 32 MiB one is reassembled and done first', async () => {
    const x = await pair(2, 2);
    try {
      const MiB = 1 << 20;
      let total = 0;
      const last = new Map<string, number>();
      const first = new Map<string, number>();
      const want = new Map<string, number>([['51', 32 * MiB], ['52', MiB]]);
      const got = new Map<string, number>();
      const done = new Promise<void>((resolve) => {
        x.pool.onChunk = (_c, room, offset, data) => {
          assert.equal(offset, got.get(room) ?? 0, `room ${room} in order`);
          got.set(room, offset + data.length);
          if (!first.has(room)) first.set(room, total);
          total += data.length;
          if (got.get(room) === want.get(room)) last.set(room, total);
          if (last.size === 2) resolve();
        };
      });
      for (const [room, n] of want) x.prefill.sendControl({ type: 'kv_begin', room: room as RoomId, totalBytes: n });
      const big = x.prefill.sendChunks(R(51), randomBytes(32 * MiB), { chunkBytes: 256 * 1024 });
      await new Promise((r) => setImmediate(r));
      const small = x.prefill.sendChunks(R(52), randomBytes(MiB), { chunkBytes: 256 * 1024 });
      await Promise.all([big, small, done]);
      const f = (n: number | undefined) => ((n ?? 0) / MiB).toFixed(1);
      const where = `room 52 at ${f(first.get('52'))}..${f(last.get('52'))} MiB, room 51 done at ${f(last.get('51'))} of 33 MiB received`;
      console.log(`# ${where}`);
      assert.ok(last.get('52')! < last.get('51')!, where);
      // between its first and last byte: its own MiB, a turn of the other room and what the two
      // sockets' kernel buffers held of it (on one socket the same test allows one turn, channel.test.ts)
      assert.ok(last.get('52')! - first.get('52')! - MiB <= 8 * MiB, `the small room's bytes spread over more than a few turns: ${where}`);
    } finally {
      await x.close();
    }
  });

  it('a stripe lost mid-transfer fails the room on both sides within the liveness budget; slots, buffers, files and sockets all come back; the next connection works', async () => {
    const io = new KvIo({ slotBytes: 4096, slots: 16, minBytes: 0 });
    assert.ok(await io.start());
    const file = path.join(dir, 'stripe-lost.ggsq');
    writeFileSync(file, state);
    const fdsBefore = readdirSync('/proc/self/fd').length;
    const x = await pair(4, 4, io);
    try {
      const h = head();
      const rx = x.newReceiver('41', h);
      const sendPool = new BufferPool(8 * 1024, 4);
      x.prefill.sendControl({ type: 'kv_begin', room: R(41), totalBytes: wireBytes(h, state.length) });
      // From the kill on, the I/O thread's answers wait until the send has settled: the rest of
      // the state (more than the thread reads ahead, asserted below) cannot reach the sockets
      // before the prefill side has seen the loss, however slow the machine.
      let holding = false;
      const held: (() => void)[] = [];
      const openStream = io.stream.bind(io);
      io.stream = () => {
        const st = openStream();
        if (st) {
          const answered = st.answered.bind(st);
          st.answered = (r) => void (holding ? held.push(() => answered(r)) : answered(r));
        }
        return st;
      };
      let killedAt = 0;
      let flushed = 0;
      let leftAtKill = 0;
      const total = wireBytes(h, state.length);
      const sent = sendStateFile(x.prefill, R(41), file, h, state.length, {
        pool: sendPool,
        pieceBytes: 1024,
        io,
        onProgress: (n) => {
          // a quarter of the bytes flushed: one of decode's stripe sockets dies (as a reset would).
          // Counted in bytes: the I/O thread's pieces are its slots (4 KiB), not pieceBytes.
          flushed += n;
          if (!killedAt && flushed >= total / 4) {
            killedAt = performance.now();
            leftAtKill = total - flushed;
            holding = true;
            x.decode.stripeSockets[1]!.destroy('test: stripe socket killed');
          }
        },
      });
      // (A send that flushed everything to the kernel before the loss resolves, as on one socket:
      // decode's kv_ack, never sent, decides the room. Hence the hold.)
      await assert.rejects(sent, /PEER_LOST|gone/);
      holding = false;
      for (const answer of held.splice(0)) answer();
      assert.ok(leftAtKill > IO_SLOTS_PER_TRANSFER * 4096 + 4, `killed mid-transfer: ${leftAtKill} of ${total} bytes left, more than the thread reads ahead`);
      for (let i = 0; x.lost.length < 2; i++) {
        assert.ok(i < 300, `both sides lost the connection (have ${JSON.stringify(x.lost)})`);
        await new Promise((r) => setTimeout(r, 10));
      }
      for (const l of x.lost) assert.ok(l.at - killedAt < 2000, `${l.side} failed it within 2 heartbeat intervals (${Math.round(l.at - killedAt)} ms): ${l.reason}`);
      assert.ok(x.lost.some((l) => l.side === 'decode' && /stripe/.test(l.reason)), 'decode names the lost stripe');
      await rx.discard();
      for (let i = 0; sendPool.inUse > 0 || io.freeSlots < 16; i++) {
        assert.ok(i < 200, `buffers (${sendPool.inUse} in use) and slots (${io.freeSlots} free) come back`);
        await new Promise((r) => setTimeout(r, 10));
      }
      assert.equal(x.server.connections().length, 0);
      assert.equal(x.pool.connections().length, 0);
      assert.equal(x.prefill.sockets, 1, 'no stripe left on the dead connection');
      // the receive's file went back to the file pool (a spare for the next receive), none other exists
      const onDisk = readdirSync(dir).filter((f) => f.startsWith('pdserve-kvrecv-stripes')).length;
      assert.equal(onDisk, x.files.spare.files, `every receive file on disk is a pool spare (${onDisk} on disk)`);
      const again = await x.pool.get('127.0.0.1', x.server.port!);
      assert.equal(again.streams, 4, 'the next get opens a new striped connection');
      for (let i = 0; again.sockets < 4; i++) {
        assert.ok(i < 200, 'its stripes join');
        await new Promise((r) => setTimeout(r, 10));
      }
    } finally {
      await x.close();
      await io.close();
    }
    await new Promise((r) => setTimeout(r, 50));
    assert.ok(readdirSync('/proc/self/fd').length <= fdsBefore + 2, 'no socket or file descriptor left behind');
  });
});
