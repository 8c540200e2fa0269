#!/usr/bin/env node
/**
 * Whether striping one large transfer over N TCP connections can pay on this host: the bare
 * socket's ceiling for N = 1, 2, 4 … Bench-only; no pdserve code involved.
 *
 *   node scripts/kv-stripe-floor.mjs [MiB=256] [N list=1,2,4] [rounds=3]
 *
 * One process sends MiB over N loopback connections to a child process, 256 KiB pieces dealt
 * round robin (piece k on connection k mod N, each written with backpressure), the child reads
 * every connection into one reused 256 KiB buffer (net `onread`, as the KV channel reads) and
 * says when every byte arrived. Prints, per N, the median time and GB/s over the rounds and the
 * load average: if N > 1 is not faster than N = 1 for bare sockets, striping the KV channel
 * (whose sender and receiver are one event loop each, shared by every connection) cannot be.
 */
import { fork } from 'node:child_process';
import net from 'node:net';
import os from 'node:os';

const PIECE = 256 * 1024;

if (process.argv[2] === '--receiver') {
  const want = Number(process.argv[3]);
  let got = 0;
  process.on('message', (m) => {
    for (let i = 0; i < m.n; i++) {
      const s = net.connect({ host: '127.0.0.1', port: m.port, noDelay: true, onread: { buffer: Buffer.allocUnsafeSlow(PIECE), callback: (len) => {
        got += len;
        if (got >= want) {
          got -= want;
          process.send({ done: true });
        }
        return true;
      } } });
      s.on('error', () => {});
    }
  });
  process.send({ up: true });
} else {
  const total = Number(process.argv[2] ?? 256) * 2 ** 20;
  const ns = (process.argv[3] ?? '1,2,4').split(',').map(Number);
  const rounds = Number(process.argv[4] ?? 3);
  const data = Buffer.alloc(total, 0x5a);
  const once = (child) => new Promise((r) => child.once('message', r));
  for (const n of ns) {
    const child = fork(new URL(import.meta.url).pathname, ['--receiver', String(total)]);
    await once(child);
    const socks = [];
    const srv = net.createServer({ noDelay: true }, (s) => socks.push(s));
    await new Promise((r) => srv.listen(0, '127.0.0.1', r));
    child.send({ port: srv.address().port, n });
    for (let i = 0; socks.length < n; i++) {
      if (i > 1000) throw new Error('connections not up within 5 s');
      await new Promise((r) => setTimeout(r, 5));
    }
    const ms = [];
    for (let r = 0; r < rounds; r++) {
      const done = once(child);
      const t0 = performance.now();
      await Promise.all(socks.map((s, i) => new Promise((resolve) => {
        let k = i;
        const pump = () => {
          while (k * PIECE < total) {
            const piece = data.subarray(k * PIECE, Math.min(total, (k + 1) * PIECE));
            k += n;
            if (!s.write(piece)) return void s.once('drain', pump);
          }
          resolve();
        };
        pump();
      })));
      await done;
      ms.push(performance.now() - t0);
    }
    for (const s of socks) s.destroy();
    srv.close();
    child.kill();
    const med = [...ms].sort((a, b) => a - b)[Math.floor(ms.length / 2)];
    console.log(`N=${n}  ${total / 2 ** 20} MiB  median ${med.toFixed(0)} ms  ${(total / med / 1e6).toFixed(2)} GB/s  (rounds ${ms.map((x) => x.toFixed(0)).join(' ')}; load ${os.loadavg()[0].toFixed(1)})`);
  }
}
