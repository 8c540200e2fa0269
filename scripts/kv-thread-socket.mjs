#!/usr/bin/env node
/**
 * Whether a data socket owned by a worker thread pays for a large TCP handoff: the bulk bytes'
 * whole path (file read + CRC-32 + socket write on the sender, socket read + CRC-32 + file write
 * on the receiver) on the event loop against the same path in a worker thread that owns its own
 * socket (the main thread only waits for its answer). Bench-only; no pdserve code involved.
 *
 *   node scripts/kv-thread-socket.mjs [MiB=256] [rounds=3]
 *
 * A state file of MiB in /dev/shm is sent to a child process in 256 KiB pieces with
 * backpressure and written there into a recycled /dev/shm file; both sides CRC every byte
 * (node:zlib crc32). Modes, interleaved per round: `main` (both sides on their event loop) and
 * `thread` (both sides in a worker thread with its own socket). Prints per mode the median time,
 * GB/s, and the sending main thread's event-loop delay p99 and active share (eventLoopUtilization)
 * with the load average.
 */
import { fork } from 'node:child_process';
import { closeSync, ftruncateSync, openSync, readSync, rmSync, writeFileSync, writeSync } from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import { monitorEventLoopDelay, performance } from 'node:perf_hooks';
import { Worker, isMainThread, parentPort, workerData } from 'node:worker_threads';
import zlib from 'node:zlib';

const PIECE = 256 * 1024;
const WINDOW = 4 * 1024 * 1024;

/** Sends `file` (`bytes`) to host:port: read, CRC, write with backpressure; resolves with the CRC. */
function sendFile(file, bytes, port) {
  return new Promise((resolve, reject) => {
    const fd = openSync(file, 'r');
    const s = net.connect({ host: '127.0.0.1', port, noDelay: true });
    let off = 0;
    let crc = 0;
    const pump = () => {
      while (off < bytes && s.writableLength < WINDOW) {
        const b = Buffer.allocUnsafe(Math.min(PIECE, bytes - off));
        const n = readSync(fd, b, 0, b.length, off);
        crc = zlib.crc32(b.subarray(0, n), crc);
        off += n;
        s.write(b.subarray(0, n));
      }
      if (off >= bytes) {
        closeSync(fd);
        s.end(() => resolve(crc));
      }
    };
    s.on('drain', pump);
    s.on('error', reject);
    s.on('connect', pump);
  });
}

/** Accepts one connection on a listening server and writes what arrives into `file`, CRC'd; resolves at its end. */
function receiveInto(server, file, bytes) {
  return new Promise((resolve) => {
    server.once('connection', (sock) => {
      const fd = openSync(file, 'r+');
      let pos = 0;
      let crc = 0;
      sock.on('data', (b) => {
        crc = zlib.crc32(b, crc);
        let o = 0;
        while (o < b.length) o += writeSync(fd, b, o, b.length - o, pos + o);
        pos += b.length;
      });
      sock.on('end', () => {
        closeSync(fd);
        resolve({ crc, pos });
      });
    });
  });
}

if (!isMainThread) {
  const w = workerData;
  if (w.role === 'send') parentPort.postMessage({ crc: await sendFile(w.file, w.bytes, w.port) });
  else {
    const server = net.createServer();
    await new Promise((r) => server.listen(0, '127.0.0.1', r));
    parentPort.postMessage({ port: server.address().port });
    parentPort.postMessage(await receiveInto(server, w.file, w.bytes));
    server.close();
  }
} else if (process.argv[2] === '--receiver') {
  // child: per round, receive in `mode` into a recycled file; answers {port} then {done}
  const file = `/dev/shm/pdserve-kv-thread-socket-recv-${process.pid}`;
  process.on('message', async (m) => {
    if (m.quit) {
      rmSync(file, { force: true });
      process.exit(0);
    }
    const fd = openSync(file, 'a');
    ftruncateSync(fd, m.bytes);
    closeSync(fd);
    if (m.mode === 'thread') {
      const w = new Worker(new URL(import.meta.url), { workerData: { role: 'recv', file, bytes: m.bytes } });
      w.once('message', (a) => {
        process.send({ port: a.port });
        w.once('message', (r) => {
          process.send({ done: true, ...r });
          void w.terminate();
        });
      });
    } else {
      const server = net.createServer();
      await new Promise((r) => server.listen(0, '127.0.0.1', r));
      process.send({ port: server.address().port });
      const r = await receiveInto(server, file, m.bytes);
      server.close();
      process.send({ done: true, ...r });
    }
  });
} else {
  const mib = Number(process.argv[2] ?? 256);
  const rounds = Number(process.argv[3] ?? 3);
  const bytes = mib * 1024 * 1024;
  const file = `/dev/shm/pdserve-kv-thread-socket-send-${process.pid}`;
  writeFileSync(file, Buffer.alloc(bytes, 7));
  const child = fork(new URL(import.meta.url), ['--receiver']);
  const ask = (m) =>
    new Promise((resolve) => {
      child.send(m);
      child.once('message', resolve);
    });
  const results = { main: [], thread: [] };
  for (let r = 0; r < rounds; r++) {
    for (const mode of r % 2 === 0 ? ['main', 'thread'] : ['thread', 'main']) {
      const { port } = await ask({ bytes, mode });
      const done = new Promise((resolve) => child.once('message', resolve));
      const eld = monitorEventLoopDelay({ resolution: 1 });
      eld.enable();
      const elu0 = performance.eventLoopUtilization();
      const t0 = performance.now();
      let crc;
      if (mode === 'thread') {
        const w = new Worker(new URL(import.meta.url), { workerData: { role: 'send', file, bytes, port } });
        crc = (await new Promise((resolve) => w.once('message', resolve))).crc;
        void w.terminate();
      } else crc = await sendFile(file, bytes, port);
      const got = await done;
      const ms = performance.now() - t0;
      const elu = performance.eventLoopUtilization(elu0);
      eld.disable();
      if (got.crc !== crc || got.pos !== bytes) throw new Error(`round ${r} ${mode}: received ${got.pos} bytes, CRC ${got.crc} ≠ ${crc}`);
      results[mode].push({ ms, p99: eld.percentile(99) / 1e6, active: elu.utilization });
    }
  }
  child.send({ quit: true });
  rmSync(file, { force: true });
  const med = (a) => [...a].sort((x, y) => x - y)[Math.floor((a.length - 1) / 2)];
  for (const mode of ['main', 'thread']) {
    const ms = med(results[mode].map((x) => x.ms));
    console.log(`${mode.padEnd(6)} ${mib} MiB: median ${ms.toFixed(1)} ms, ${(bytes / ms / 1e6).toFixed(2)} GB/s; sender loop delay p99 ${med(results[mode].map((x) => x.p99)).toFixed(1)} ms, active ${(100 * med(results[mode].map((x) => x.active))).toFixed(0)} % (rounds ${results[mode].map((x) => x.ms.toFixed(0)).join(', ')} ms)`);
  }
  console.log(`load average ${os.loadavg().map((x) => x.toFixed(2)).join(' / ')}`);
}
