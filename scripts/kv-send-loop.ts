/**
 * The sending side's event loop during one large TCP handoff, without llama.cpp. Bench-only.
 *
 *   SIZE_MIB=256 ROUNDS=3 [WINDOW=<sendWindowBytes>] node --import tsx scripts/kv-send-loop.ts
 *   TX_IO=0: the sender without the KV I/O thread (file read and CRC-32 inline); RX_IO=0 / 1: the
 *   receiver inline / through the thread (default: as decode picks it, kvIoForReceives)
 *   (add --cpu-prof --cpu-prof-dir=DIR before --import for a profile of both threads)
 *
 * Prefill's path (sendStateFile through the KV I/O thread: file read and CRC-32 on the thread,
 * the main thread hands slot views to the socket) into a child process that receives as decode
 * does (StateReceiver with its own KV I/O thread, a recycled file in /dev/shm). Per round, for
 * the send alone: its time, the main loop's delay (perf_hooks, 1 ms resolution: p99, max, mean),
 * the loop's active time (eventLoopUtilization) and the process's CPU time, and the I/O jobs.
 */
import { fork } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { monitorEventLoopDelay } from 'node:perf_hooks';
import { newEpoch } from '../src/kv/auth.js';
import { KvPeerPool, KvServer, type PeerConn } from '../src/kv/channel.js';
import { encodeEnvelopeHead } from '../src/kv/envelope.js';
import { KvIo, kvIoForReceives } from '../src/kv/transfer/io-thread.js';
import { BufferPool, FilePool } from '../src/kv/transfer/pool.js';
import { StateReceiver } from '../src/kv/transfer/receiver.js';
import { sendStateFile, wireBytes } from '../src/kv/transfer/sender.js';

const FP = 'f'.repeat(64);
const PAIR = { fingerprint: 'ab'.repeat(32), contextSize: 4352, batchSize: 512, flashAttention: true };
const secret = 'kv-send-loop-secret';
const head = (n: number) => encodeEnvelopeHead({ fingerprint: FP, contextSize: 4352, batchSize: 512, nTokens: 1, firstToken: 1, firstIsEog: false, payloadBytes: n });
const dir = '/dev/shm';
const prefix = 'pdserve-kv-send-loop';
if (process.argv[2] === 'recv') {
  const io = new KvIo();
  await io.start();
  const files = new FilePool({ dir, prefix: `${prefix}-${process.pid}`, maxFiles: 1, maxBytes: 2 ** 31 });
  let rx: StateReceiver<object> | undefined;
  let cpuAt: NodeJS.CpuUsage | undefined;
  let eluAt: ReturnType<typeof performance.eventLoopUtilization> | undefined;
  const epoch = newEpoch();
  const pool = new KvPeerPool({
    secret, settings: PAIR, epoch,
    onMessage: (c, m: any) => {
      if (m.type === 'kv_begin') {
        cpuAt = process.cpuUsage();
        eluAt = performance.eventLoopUtilization();
      }
      if (m.type === 'kv_begin') rx = new StateReceiver({ totalBytes: m.totalBytes, expect: { fingerprint: FP, contextSize: 4352, batchSize: 512, maxPayloadBytes: 2 ** 31 }, walker: () => ({ push() {}, end: () => ({}) }), files, pool: new BufferPool(1 << 20, 1), ...(process.env.RX_IO === '0' ? {} : process.env.RX_IO === '1' ? { io } : { io: kvIoForReceives(dir) }) });
      if (m.type === 'kv_end') void rx!.finish().then(async () => { await rx!.done(); const cpu = process.cpuUsage(cpuAt); process.send!({ done: true, cpuMs: (cpu.user + cpu.system) / 1000, activeMs: performance.eventLoopUtilization(eluAt).active }); }, (e) => process.send!({ error: String(e) }));
    },
    onChunk: (c, _r, _o, data) => rx!.push(data, c),
  });
  process.on('message', async (m: any) => {
    const d = await pool.get('127.0.0.1', m.port);
    d.sendControl({ type: 'register', room: '7', rid: 'r7', epoch });
  });
  process.on('SIGTERM', () => {
    files.close();
    process.exit(0);
  });
  process.send!({ up: true });
} else {
  const SIZE = Number(process.env.SIZE_MIB ?? 256) * 2 ** 20;
  const ROUNDS = Number(process.env.ROUNDS ?? 3);
  const tmp = mkdtempSync(path.join(dir, `${prefix}-`));
  const file = path.join(tmp, 's.bin');
  writeFileSync(file, Buffer.alloc(SIZE, 0x5a));
  const io = new KvIo();
  await io.start();
  let prefill: PeerConn | undefined;
  const server = new KvServer({ host: '127.0.0.1', port: 0, secret, settings: PAIR, epoch: newEpoch(), ...(process.env.WINDOW ? { sendWindowBytes: Number(process.env.WINDOW) } : {}), onMessage: (c) => void (prefill ??= c) });
  const port = await server.listen();
  const child = fork(process.argv[1]!, ['recv'], { execArgv: process.execArgv });
  await new Promise((r) => child.once('message', r));
  child.send({ port });
  while (!prefill) await new Promise((r) => setTimeout(r, 5));
  const eld = monitorEventLoopDelay({ resolution: 1 });
  const out: string[] = [];
  const cpuTx: number[] = [];
  const cpuRx: number[] = [];
  const med = (a: number[]): number => [...a].sort((x, y) => x - y)[Math.floor(a.length / 2)] ?? 0;
  for (let i = 0; i < ROUNDS; i++) {
    const h = head(SIZE);
    const done = new Promise<any>((r) => child.once('message', r));
    eld.reset(); eld.enable();
    const elu0 = performance.eventLoopUtilization(); const cpu0 = process.cpuUsage(); const j0 = io.jobs;
    const t0 = performance.now();
    prefill.sendControl({ type: 'kv_begin', room: '7', totalBytes: wireBytes(h, SIZE) });
    await sendStateFile(prefill, '7', file, h, SIZE, { pool: new BufferPool(1 << 20, 1), ...(process.env.TX_IO === '0' ? {} : { io }), stallMs: 60_000 });
    const t1 = performance.now();
    eld.disable();
    const elu = performance.eventLoopUtilization(elu0); const cpu = process.cpuUsage(cpu0);
    prefill.sendControl({ type: 'kv_end', room: '7' });
    const r = await done;
    const t2 = performance.now();
    if (r.error) throw new Error(r.error);
    cpuTx.push((cpu.user + cpu.system) / 1000);
    cpuRx.push(r.cpuMs);
    out.push(`send ${(t1 - t0).toFixed(0)} ms, received ${(t2 - t0).toFixed(0)} ms p99 ${(eld.percentile(99) / 1e6).toFixed(1)} max ${(eld.max / 1e6).toFixed(1)} mean ${(eld.mean / 1e6).toFixed(2)} loop-active ${elu.active.toFixed(0)} ms cpu(proc) ${((cpu.user + cpu.system) / 1000).toFixed(0)} ms jobs ${io.jobs - j0}; receiver cpu ${r.cpuMs.toFixed(0)} ms loop-active ${r.activeMs.toFixed(0)} ms`);
    await new Promise((r) => setTimeout(r, 200));
  }
  console.log(`tx-io ${process.env.TX_IO ?? 1} rx-io ${process.env.RX_IO ?? 'as decode'} window ${process.env.WINDOW ?? 'default'} ${SIZE / 2 ** 20} MiB load ${os.loadavg()[0].toFixed(1)}: median CPU ms per round sender ${med(cpuTx).toFixed(0)} receiver ${med(cpuRx).toFixed(0)}\n  ${out.join('\n  ')}`);
  child.kill();
  await server.close();
  await io.close();
  rmSync(tmp, { recursive: true, force: true });
}
