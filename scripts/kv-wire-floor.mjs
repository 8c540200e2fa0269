#!/usr/bin/env node
/**
 * What the TCP handoff's copies cost on bare loopback sockets, without the KV channel: a sender
 * (this process) and a receiver (a child) move MiB per round, timed from the first write to the
 * receiver's 1-byte ack. Bench-only; no pdserve code involved.
 *
 *   node scripts/kv-wire-floor.mjs [MiB=64] [rounds=5]
 *   COMBOS=one:count,mem:count,file:count,filecrc:count,filecrc:crc,filecrc:write (default: all)
 *   RING=<pieces> (default 4: the streamed sender's one 1 MiB pooled buffer of 256 KiB pieces)
 *
 * Sender (`tx`): `one` one write of the whole buffer (bench §1's raw floor); `mem` 256 KiB pieces
 * of a buffer in memory behind a 21-byte header each (a chunk frame's), with the channel's 4 MiB
 * send window; `file` the pieces read from a /dev/shm file into RING reused slots (a slot is
 * read again once its write is flushed); `filecrc` also a CRC-32 of each piece (@node-rs/crc32).
 * Receiver (`rx`, one reused 256 KiB read buffer as decode's KV connection): `count` counts;
 * `crc` also CRC-32; `write` also writes every read into a file whose pages exist (decode's
 * recycled state file). Combos run interleaved per round; prints the median ms of each.
 */
import { fork } from 'node:child_process';
import { ftruncateSync, openSync, readSync, rmSync, writeFileSync, writeSync } from 'node:fs';
import { createRequire } from 'node:module';
import net from 'node:net';
import os from 'node:os';
import { performance } from 'node:perf_hooks';

const { crc32 } = createRequire(import.meta.url)('@node-rs/crc32');
const PIECE = 256 * 1024;
const WINDOW = 4 * 1024 * 1024;
const MiB = Number(process.argv[2] ?? 64);
const BYTES = MiB * 1024 * 1024;
const ROUNDS = Number(process.argv[3] ?? 5);

if (process.argv[4] === 'child') {
  let rx = 'count';
  const dst = `/dev/shm/pdserve-wirefloor-${process.pid}.bin`;
  const fd = openSync(dst, 'w+');
  ftruncateSync(fd, BYTES);
  writeSync(fd, Buffer.alloc(BYTES, 1), 0, BYTES, 0); // pages exist, as in a recycled state file
  let got = 0;
  let crc = 0;
  process.on('message', (m) => {
    if (m.rx) {
      rx = m.rx;
      process.send({ ok: true });
      return;
    }
    const s = net.connect({
      host: '127.0.0.1',
      port: m.port,
      noDelay: true,
      onread: {
        buffer: Buffer.allocUnsafeSlow(PIECE),
        callback: (n, buf) => {
          const b = buf.subarray(0, n);
          if (rx !== 'count') crc = crc32(b, crc);
          if (rx === 'write') writeSync(fd, b, 0, n, got % BYTES);
          got += n;
          if (got >= BYTES) {
            got = 0;
            crc = 0;
            s.write(Buffer.from([1]));
          }
          return true;
        },
      },
    });
  });
  process.on('disconnect', () => {
    rmSync(dst, { force: true });
    process.exit(0);
  });
  process.send({ up: true });
} else {
  const RING = Number(process.env.RING ?? 4);
  const child = fork(new URL(import.meta.url).pathname, [String(MiB), String(ROUNDS), 'child']);
  await new Promise((r) => child.once('message', r));
  const srv = net.createServer({ noDelay: true });
  await new Promise((r) => srv.listen(0, '127.0.0.1', r));
  const conn = new Promise((r) => srv.once('connection', r));
  child.send({ port: srv.address().port });
  const s = await conn;
  let acked;
  s.on('data', () => acked?.());
  const src = `/dev/shm/pdserve-wirefloor-src-${process.pid}.bin`;
  const big = Buffer.alloc(BYTES, 0x5a);
  writeFileSync(src, big);
  const sfd = openSync(src, 'r');
  const ring = Buffer.allocUnsafeSlow(RING * PIECE);
  const hdr = Buffer.alloc(21);
  const run = (tx) =>
    new Promise((resolve) => {
      const t0 = performance.now();
      acked = () => resolve(performance.now() - t0);
      if (tx === 'one') {
        s.write(big);
        return;
      }
      let off = 0;
      const free = Array.from({ length: RING }, (_, i) => RING - 1 - i);
      const pump = () => {
        while (off < BYTES && s.writableLength < WINDOW) {
          if (tx === 'mem') {
            s.cork();
            s.write(hdr);
            s.write(big.subarray(off, off + PIECE));
            s.uncork();
            off += PIECE;
            continue;
          }
          if (free.length === 0) return;
          const slot = free.pop();
          const b = ring.subarray(slot * PIECE, (slot + 1) * PIECE);
          readSync(sfd, b, 0, PIECE, off);
          if (tx === 'filecrc') crc32(b);
          s.cork();
          s.write(hdr);
          s.write(b, () => {
            free.push(slot);
            setImmediate(pump);
          });
          s.uncork();
          off += PIECE;
        }
      };
      s.on('drain', pump);
      pump();
    });
  const setRx = (rx) =>
    new Promise((r) => {
      child.once('message', r);
      child.send({ rx });
    });
  const combos = (process.env.COMBOS ?? 'one:count,mem:count,file:count,filecrc:count,filecrc:crc,filecrc:write').split(',');
  const res = Object.fromEntries(combos.map((c) => [c, []]));
  for (let r = 0; r < ROUNDS; r++) {
    for (const c of combos) {
      const [tx, rx] = c.split(':');
      await setRx(rx);
      res[c].push(await run(tx));
      s.removeAllListeners('drain');
    }
  }
  const med = (a) => [...a].sort((x, y) => x - y)[Math.floor(a.length / 2)];
  console.log(`${MiB} MiB, ring ${RING}, ${ROUNDS} rounds, load ${os.loadavg()[0].toFixed(2)}: ${combos.map((c) => `${c} ${med(res[c]).toFixed(1)} ms`).join(' | ')}`);
  rmSync(src, { force: true });
  child.disconnect();
  process.exit(0);
}
