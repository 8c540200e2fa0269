/**
 * Child process of bench section 1 (KV handoff vs raw TCP). Two roles, one process each:
 *
 *   sender   (prefill side): loads the model, makes real sequence states of the requested token
 *            counts (prompt evaluation + saveState to /dev/shm), listens with a KvServer and a
 *            bare TCP server. `kv` trial (the prefill worker's TCP path): the state is first
 *            loaded back into the sequence (off the clock); from the save's start — saveState
 *            into a fresh file (its envelope head prepared, all but the size, while llama.cpp
 *            saves), then the head's size filled in, kv_begin, sendStateFile (the file read in
 *            pooled pieces, CRC-32 as they pass, into the socket), kv_end; or, with
 *            `streamed` (the workers' default; off: --no-kv-stream), during the save: streamed kv_begin,
 *            sendGrowingStateFile (the growing file read behind llama.cpp's writes), kv_end with
 *            the byte count and CRC — until the receiver's kv_ack (the receiver stamps "loaded"
 *            itself: the goal's end). `raw` trial: write an 8-byte
 *            length and the same number of bytes on a bare socket until a 1-byte ack (the
 *            receiver stamps its last byte; it reads into one reused buffer of the KV channel's
 *            read size, as decode's KV connection does).
 *            `kvfile` trial (same host, transfer/same-host.ts): from "state saved" (a copy made
 *            before the clock starts), rename it to the room's name (the worker's one-room
 *            path), offer it (no read, no CRC-32 — the default, without
 *            --kv-same-host-verify), send kv_file — until the
 *            receiver's kv_ack; stamped with process.hrtime.bigint() (CLOCK_MONOTONIC, one
 *            clock for both processes), so the parent also ends the clock at the receiver's
 *            "state loaded" stamp. `floor` (same-host figures): the one-way lag of an 8-byte
 *            message on a bare loopback socket, each way, after an idle pause (the floor under
 *            kv_file's lag).
 *   receiver (decode side): loads the model, connects a KvPeerPool and a bare socket to the
 *            sender (running the same-host probe on the KV connection). kv_file: take the file
 *            over (rename), validate it (envelope head, size, ggsq header walk by pread — the
 *            KV data is not read), Slot.loadState, kv_ack, then delete it (off the clock). Chunks go into a StateReceiver (envelope head, ggsq walk, CRC, write into a
 *            recycled state file while streaming, as the decode worker); on kv_end: finish (tail of the writes, checks), Slot.loadState,
 *            then kv_ack; reports its own phase times and the loaded stamp to the parent. Raw: counts bytes, acks, reports its last byte's stamp.
 *
 * Cross-process stamps (`hr`) are process.hrtime.bigint() in ms: CLOCK_MONOTONIC, one clock for
 * every process of this host.
 *
 * These are the calls the prefill and decode workers make on their data path (without the room
 * state machine around them). Messages with the parent go over the IPC channel.
 */
import { benchGpuOptions } from './gpu.js';
import { pairSettingsOf } from '../protocol/pair.js';
import type { RoomId } from '../base/room-id.js';
import { normalizeRoomId } from '../kv/frame.js';
import { createHash, randomFillSync } from 'node:crypto';
import { copyFile, readFile, rm, writeFile } from 'node:fs/promises';
import net from 'node:net';
import { join } from 'node:path';
import { monitorEventLoopDelay, performance } from 'node:perf_hooks';
import { kvIoForReceives, sharedKvIo } from '../kv/transfer/io-thread.js';
import { loadEngine } from '../engine/llama.js';
import type { Engine } from '../engine/types.js';
import { KV_READ_BUFFER_BYTES, KvPeerPool, KvServer, type PeerConn } from '../kv/channel.js';
import { kvTransportOf } from '../kv/transport.js';
import { loadInternalTls, type InternalTlsFiles } from '../security/tls.js';
import type { ControlMsg } from '../kv/messages.js';
import { encodeEnvelopeHead, envelopeTrailer, prepareEnvelopeHead } from '../kv/envelope.js';
import { crc32 } from '../kv/transfer/checksum.js';
import { BufferPool, FilePool, RECV_SPARE_BYTES, RECV_SPARE_FILES, TRANSFER_BUFFER_BYTES, TRANSFER_POOL_BUFFERS } from '../kv/transfer/pool.js';
import { GgsqStreamParser, parseStateHeaders, type ParsedState, type PositionalSource } from '../engine/ggsq.js';
import { StateReceiver } from '../kv/transfer/receiver.js';
import { SEND_PIECE_BYTES, sendGrowingStateFile, sendStateFile, wireBytes } from '../kv/transfer/sender.js';
import { prefillStateName, SameHostDecode, SameHostPrefill } from '../kv/transfer/same-host.js';
import { appendFileSync, existsSync, ftruncateSync, openSync, readFileSync, renameSync, rmSync, writeFileSync } from 'node:fs';
import { loadCorpus } from './index.js';

interface Init {
  role: 'sender' | 'receiver';
  model: string;
  contextSize: number;
  batchSize: number;
  secret: string;
  epoch: string;
  stateDir: string;
  /** Sequences of this process's context (decode: the decode worker's slot count, so loads are re-framed as in the cluster). */
  sequences?: number;
  /** Sender: kv trials stream the state while it is saved (the prefill worker's default); else save, then send (--no-kv-stream). */
  streamed?: boolean;
  /** llama.cpp threads (default 1). */
  threads?: number;
  /** The KV channel over (mutual) TLS with these PEM files, as the workers' --internal-tls-*. */
  tls?: InternalTlsFiles;
}

const init = JSON.parse(process.argv[2] ?? '{}') as Init;
const send = (m: object): void => void process.send?.(m);
process.on('disconnect', () => process.exit(0));
/** Files to delete however this child ends (normal exit, or the parent's SIGTERM in BenchChild.stop). */
const exitCleanups: (() => void)[] = [];
const atExit = (fn: () => void): void => void exitCleanups.push(fn);
const runExitCleanups = (): void => {
  for (const fn of exitCleanups.splice(0)) {
    try {
      fn();
    } catch {
      // best effort: the state-file sweep removes what is left
    }
  }
};
process.on('exit', runExitCleanups);
process.on('SIGTERM', () => process.exit(0));
const now = () => performance.now();
/** CLOCK_MONOTONIC in ns as a decimal string (IPC is JSON: no bigint): comparable across processes of this machine. */
const mono = (): string => process.hrtime.bigint().toString();
/** Wall clock with sub-ms resolution, comparable across processes of this machine. */
const abs = () => performance.timeOrigin + performance.now();
/** CLOCK_MONOTONIC in ms (process.hrtime.bigint): the same clock in every process of this host. */
const hr = () => Number(process.hrtime.bigint()) / 1e6;
/**
 * Bench-only step stamps of KV trials (PDSERVE_BENCH_KV_TRACE=<file>): lines
 * "<CLOCK_MONOTONIC ms> <role> <step>" appended to the file once a trial is over (off the
 * clock); a push of a few µs per step on the clock. Unset: no stamps.
 */
const TRACE_FILE = process.env.PDSERVE_BENCH_KV_TRACE;
/**
 * Bench-only bound experiment (PDSERVE_BENCH_KV_BOUND; not the workers' path, not for the
 * report's figures): what a native addon could at best buy on the TCP handoff.
 *   mem     — prefill sends the state from memory with its CRC-32 computed in advance (read
 *             once when the state is made; each trial still saves it with llama.cpp, the clock
 *             is unchanged): the upper bound of sendfile(2) from the state file with the CRC
 *             from a mapping. The first trial per state checks that the trial's save wrote
 *             exactly these bytes.
 *   nowrite — decode validates (envelope head, ggsq walk, CRC-32) but writes nothing: its
 *             destination file is /dev/null and the load reads a file staged by the first
 *             (warm-up, unrecorded) trial of the same size, re-framed in place by its load
 *             (idempotent): the upper bound of reading the socket straight into a mapped
 *             destination file.
 *   both    — both.
 *   bare    — both, and decode does not even validate: the chunks are only counted (no head
 *             check, walk or CRC-32) and the staged file is loaded with the warm-up trial's
 *             walk — the channel alone (chunk frames from memory through PeerConn.sendFrom and
 *             decode's frame reader). NOT a legal handoff: it says what is left once no file
 *             is copied and nothing is checked.
 */
// (save-then-send trials only; the streamed ones ignore it)
/** PDSERVE_BENCH_KV_STREAMS=N: both ends stripe the KV connection over N sockets (the workers' `--kv-streams`; default 1). */
const KV_STREAMS = Number(process.env.PDSERVE_BENCH_KV_STREAMS ?? 1);
if (!Number.isSafeInteger(KV_STREAMS) || KV_STREAMS < 1 || KV_STREAMS > 8) throw new Error(`PDSERVE_BENCH_KV_STREAMS must be an integer in 1..8, not ${process.env.PDSERVE_BENCH_KV_STREAMS}`);
const BOUND = process.env.PDSERVE_BENCH_KV_BOUND ?? '';
if (BOUND !== '' && BOUND !== 'mem' && BOUND !== 'nowrite' && BOUND !== 'both' && BOUND !== 'bare') throw new Error(`PDSERVE_BENCH_KV_BOUND must be mem, nowrite, both or bare, not ${BOUND}`);
const BOUND_MEM = BOUND === 'mem' || BOUND === 'both' || BOUND === 'bare';
const BOUND_NOWRITE = BOUND === 'nowrite' || BOUND === 'both' || BOUND === 'bare';
const BOUND_BARE = BOUND === 'bare';
const traced: string[] = [];
const tr = TRACE_FILE ? (step: string): void => void traced.push(`${hr().toFixed(4)} ${init.role} ${step}`) : (): void => {};
const trFlush = (): void => {
  if (TRACE_FILE && traced.length > 0) appendFileSync(TRACE_FILE, traced.splice(0).join('\n') + '\n');
};
/**
 * Deadline of every wait inside one trial (an ack, kv_end after kv_begin, the receiver's
 * `settle`), ms: below the parent's 120 s per call, so a lost message comes back as this
 * child's error naming what it waited for, not as the parent's bare timeout.
 */
const TRIAL_WAIT_MS = 60_000;
/** `p`, or a rejection "<what>: nothing within <ms> ms" once `ms` pass first. */
function within<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: nothing within ${ms} ms`)), ms);
  });
  return Promise.race([p, late]).finally(() => clearTimeout(timer));
}

/**
 * The event loop's delay during a trial (perf_hooks histogram, 1 ms resolution): `start` at the
 * trial's first step, `stop` at its last → p99 and max in ms. The KV data path runs on the I/O
 * thread unless the parent's `io` command said 'inline' (the path before it, for comparison).
 */
const eld = monitorEventLoopDelay({ resolution: 1 });
const eldStart = (): void => {
  eld.disable();
  eld.reset();
  eld.enable();
};
const eldStop = (): { eldP99: number; eldMax: number } => {
  eld.disable();
  return eld.count > 0 ? { eldP99: eld.percentile(99) / 1e6, eldMax: eld.max / 1e6 } : { eldP99: 0, eldMax: 0 };
};
let ioMode: 'thread' | 'inline' = 'thread';
const kvIo = () => (ioMode === 'thread' ? sharedKvIo() : undefined);
/**
 * The receiver's thread as the decode worker picks it (kvIoForReceives: none on a tmpfs state
 * directory), or none with 'inline'; PDSERVE_BENCH_KV_RECV_THREAD=1: the thread whatever the
 * directory (to compare).
 */
const RECV_THREAD = process.env.PDSERVE_BENCH_KV_RECV_THREAD === '1';
const kvIoRecv = () => (ioMode !== 'thread' ? undefined : RECV_THREAD ? sharedKvIo() : kvIoForReceives(init.stateDir));

interface State {
  n: number;
  /** The prompt's tokens (to load the state back into the sequence before a kv trial). */
  tokens: number[];
  path: string;
  bytes: number;
  firstToken: number;
  firstIsEog: boolean;
  /** Median of 5 saves of this state (ms), each into a new file: the save that the handoff goal counts on both sides. */
  saveMs: number;
  /** PDSERVE_BENCH_KV_BOUND mem: the state's bytes and CRC-32; `checked` once a trial's save was compared with them. */
  mem?: { bytes: Buffer; crc: number; checked: boolean };
}

async function main(): Promise<void> {
  const engine = await loadEngine({ modelPath: init.model, threads: init.threads ?? 1, sequences: init.sequences ?? 1, contextSize: init.contextSize, batchSize: init.batchSize, ...benchGpuOptions() });
  if (init.role === 'sender') await sender(engine);
  else await receiver(engine);
}

async function sender(engine: Engine): Promise<void> {
  const states: State[] = [];
  const acks = new Map<string, () => void>();
  let conn: PeerConn | undefined;
  const sameHost = new SameHostPrefill({ enabled: true, stateDir: init.stateDir });
  const kv = new KvServer({
    onPeerLost: (_c, why) => send({ type: 'progress', msg: `sender: kv connection lost: ${why}` }),
    transport: kvTransportOf(loadInternalTls(init.tls)),
    host: '127.0.0.1',
    port: 0,
    secret: init.secret,
    epoch: init.epoch,
    settings: pairSettingsOf(engine.info),
    streams: KV_STREAMS,
    onConnect: (c) => void (conn = c),
    onMessage: (c, msg) => {
      if (msg.type === 'kv_ack') acks.get(msg.room)?.();
      else if (msg.type === 'kv_file_refused') send({ type: 'progress', msg: `kv_file refused: ${msg.reason}` });
      else if (msg.type === 'same_host_probe' || msg.type === 'same_host_ok') {
        const r = sameHost.onMessage(c.id, msg);
        if (r) c.sendControl(r);
      }
    },
  });
  const kvPort = await kv.listen();
  let rawSock: net.Socket | undefined;
  let rawAck: (() => void) | undefined;
  const raw = net.createServer({ noDelay: true }, (s) => {
    rawSock = s;
    s.on('data', () => rawAck?.());
  });
  await new Promise<void>((r) => raw.listen(0, '127.0.0.1', () => r()));
  const rawPort = (raw.address() as net.AddressInfo).port;
  let rawBuf = Buffer.alloc(0);
  // the floor under a message's lag: a bare loopback socket carrying 8 bytes each way (`floor`)
  let floorSock: net.Socket | undefined;
  let floorReply: ((b: Buffer, at: bigint) => void) | undefined;
  const floor = net.createServer({ noDelay: true }, (s) => {
    floorSock = s;
    // a 16-byte reply may arrive in pieces (TCP keeps no message boundaries): the last piece's arrival is the stamp
    let part: Buffer = Buffer.alloc(0);
    s.on('data', (b: Buffer) => {
      const at = process.hrtime.bigint();
      part = part.length > 0 ? Buffer.concat([part, b]) : b;
      if (part.length < 16) return;
      const whole = part;
      part = Buffer.alloc(0);
      floorReply?.(whole, at);
    });
  });
  await new Promise<void>((r) => floor.listen(0, '127.0.0.1', () => r()));
  const floorPort = (floor.address() as net.AddressInfo).port;
  const sendPool = new BufferPool(TRANSFER_BUFFER_BYTES, TRANSFER_POOL_BUFFERS);
  send({ type: 'ready', kvPort, rawPort, floorPort, fingerprint: engine.info.fingerprint });

  process.on('message', async (m: { cmd: string; tokens?: number[]; idx?: number; room?: string; bytes?: number; rounds?: number; gapMs?: number }) => {
    try {
      if (m.cmd === 'make') {
        const ids = engine.tokenize(loadCorpus());
        for (const n of m.tokens ?? []) {
          const toks: number[] = [];
          for (let i = 0; toks.length < n; i++) toks.push(ids[i % ids.length]!);
          const slot = engine.tryAcquireSlot();
          if (!slot) throw new Error('no free slot');
          const t0 = now();
          try {
            const sampling = { temperature: 0, topP: 1, topK: 0, maxTokens: 1, stop: [], ignoreEos: true };
            // PDSERVE_BENCH_KV_STATE_CACHE=<dir>: a state evaluated by an earlier run of this model and
            // prompt is loaded from there instead of evaluated again (the 1 GiB one takes minutes)
            const cacheDir = process.env.PDSERVE_BENCH_KV_STATE_CACHE;
            const cached = cacheDir ? join(cacheDir, `pdserve-bench-state-${engine.info.fingerprint.slice(0, 16)}-${n}`) : undefined;
            let r: { firstToken: number; firstIsEog: boolean };
            if (cached && existsSync(`${cached}.json`)) {
              r = JSON.parse(readFileSync(`${cached}.json`, 'utf8')) as typeof r;
              await slot.loadState(`${cached}.ggsq`, toks);
            } else {
              r = await slot.prefill(toks, sampling, new AbortController().signal);
              if (cached) {
                await slot.saveState(`${cached}.ggsq`);
                writeFileSync(`${cached}.json`, JSON.stringify({ firstToken: r.firstToken, firstIsEog: r.firstIsEog }));
              }
            }
            const path = join(init.stateDir, `pdserve-bench-kv-${process.pid}-${n}.ggsq`);
            const saves: number[] = [];
            let bytes = 0;
            for (let k = 0; k < 5; k++) {
              // into a file that does not exist, as in the KV trials and the workers (llama.cpp's
              // fopen("wb") of an existing file would first free its pages)
              rmSync(path, { force: true });
              const ts = now();
              bytes = await slot.saveState(path);
              saves.push(now() - ts);
            }
            const mem = BOUND_MEM ? readFileSync(path) : undefined;
            states.push({ n, tokens: toks, path, bytes, firstToken: r.firstToken, firstIsEog: r.firstIsEog, saveMs: saves.sort((a, b) => a - b)[2]!, ...(mem ? { mem: { bytes: mem, crc: crc32(mem), checked: false } } : {}) });
            atExit(() => rmSync(path, { force: true }));
          } finally {
            slot.release();
          }
          send({ type: 'progress', msg: `state of ${n} tokens made in ${((now() - t0) / 1000).toFixed(1)} s` });
        }
        const max = Math.max(...states.map((s) => s.bytes)) + 64 * 1024;
        rawBuf = Buffer.allocUnsafe(max);
        randomFillSync(rawBuf);
        send({ type: 'made', states: states.map((s) => ({ n: s.n, bytes: s.bytes, saveMs: s.saveMs })) });
      } else if (m.cmd === 'kv') {
        const st = states[m.idx!]!;
        const room = normalizeRoomId(m.room!);
        if (!conn?.alive) throw new Error('no kv connection');
        const c = conn;
        const acked = new Promise<void>((r) => acks.set(room, r));
        // off the clock: the sequence holds this state again, and the file the save writes does not exist
        const slot = engine.tryAcquireSlot();
        if (!slot) throw new Error('no free slot');
        const path = join(init.stateDir, `pdserve-bench-kvs-${process.pid}-${room}.ggsq`);
        try {
          await slot.loadState(st.path, st.tokens);
          rmSync(path, { force: true });
          eldStart();
          const t0 = now();
          const t0Hr = hr();
          tr(`save-start bytes=${st.bytes}`);
          const saving = slot.saveState(path);
          let tSaved = NaN;
          saving.then(() => {
            tSaved = now();
            tr('save-resolved');
          }, () => {});
          const info = engine.info;
          const headOf = (payloadBytes: number) => encodeEnvelopeHead({ fingerprint: info.fingerprint, contextSize: info.compat.contextSize, batchSize: info.compat.batchSize, nTokens: st.n, firstToken: st.firstToken, firstIsEog: st.firstIsEog, payloadBytes });
          let t2 = 0;
          let t2Abs = 0;
          let streamedBytes = 0;
          if (init.streamed) {
            const head = headOf(0);
            t2 = now();
            t2Abs = abs();
            // as the prefill worker: kv_begin (the size estimate from an earlier save of this many
            // tokens) once llama.cpp has created the file; a failed send leaves the receiver
            // without kv_end: it reports on its own deadline
            const begin = () => {
              tr('kv_begin-sent');
              return c.sendControl({ type: 'kv_begin', room, totalBytes: head.length + st.bytes, streamed: true });
            };
            let flushed = 0;
            const onProgress = TRACE_FILE ? (n: number) => tr(`flushed ${(flushed += n)}`) : undefined;
            let sent;
            try {
              sent = await sendGrowingStateFile(c, room, path, head, { saved: saving, pool: sendPool, chunkBytes: 1024 * 1024, growStallMs: TRIAL_WAIT_MS, onFileStart: begin, onProgress });
            } catch (e) {
              await saving.catch(() => {}); // llama.cpp may still be writing this sequence's file: release the slot after it
              throw e;
            }
            c.sendControl({ type: 'kv_end', room, totalBytes: sent.totalBytes, crc: sent.crc });
            streamedBytes = sent.totalBytes;
          } else {
            // as the prefill worker: the head, all but its size, while llama.cpp saves (one
            // event-loop turn lets the save start first)
            await new Promise<void>((resolve) => setImmediate(resolve));
            const makeHead = prepareEnvelopeHead({ fingerprint: info.fingerprint, contextSize: info.compat.contextSize, batchSize: info.compat.batchSize, nTokens: st.n, firstToken: st.firstToken, firstIsEog: st.firstIsEog });
            tr('head-prepared');
            const bytes = await saving;
            tr('saved-awaited');
            const head = makeHead(bytes);
            tr('head-encoded');
            t2 = now();
            t2Abs = abs();
            c.sendControl({ type: 'kv_begin', room, totalBytes: wireBytes(head, bytes) });
            tr('kv_begin-sent');
            let flushed = 0;
            const onProgress = TRACE_FILE ? (n: number) => tr(`flushed ${(flushed += n)}`) : undefined;
            if (st.mem) {
              if (bytes !== st.mem.bytes.length) throw new Error(`bound mem: the trial's save wrote ${bytes} bytes, the state in memory has ${st.mem.bytes.length}`);
              await sendFromMemory(c, room, head, st.mem.bytes, st.mem.crc, onProgress);
            } else await sendStateFile(c, room, path, head, bytes, { pool: sendPool, io: kvIo(), chunkBytes: 1024 * 1024, onProgress });
            tr('send-resolved');
            c.sendControl({ type: 'kv_end', room });
            tr('kv_end-sent');
          }
          const t3 = now();
          const saved = await saving;
          if (saved !== st.bytes) throw new Error(`the trial's save wrote ${saved} bytes, the state has ${st.bytes}`);
          try {
            await within(acked, TRIAL_WAIT_MS, `kv_ack of room ${room}`);
          } finally {
            acks.delete(room);
          }
          const t4 = now();
          const t4Abs = abs();
          const loop = eldStop();
          tr('ack-received');
          trFlush();
          if (st.mem && !st.mem.checked) {
            if (!readFileSync(path).equals(st.mem.bytes)) throw new Error('bound mem: the trial\'s save wrote other bytes than the state in memory');
            st.mem.checked = true;
          }
          send({ type: 'kvDone', room, blobBytes: wireBytes(headOf(st.bytes), st.bytes), streamedBytes, totalMs: t4 - t0, t0Hr, saveMs: tSaved - t0, readMs: 0, encodeMs: 0, sendMs: t3 - t2, t2Abs, t4Abs, io: ioMode, ...loop });
        } finally {
          acks.delete(room);
          slot.release();
          await rm(path, { force: true }); // off the event loop: unlinking 1 GiB of tmpfs takes ~0.2 s
        }
      } else if (m.cmd === 'kvfile') {
        const st = states[m.idx!]!;
        const room = normalizeRoomId(m.room!);
        if (!conn?.alive || !sameHost.usable(conn.id)) throw new Error('no same-host kv connection');
        const acked = new Promise<void>((r) => acks.set(room, r));
        const info = engine.info;
        const head = encodeEnvelopeHead({ fingerprint: info.fingerprint, contextSize: info.compat.contextSize, batchSize: info.compat.batchSize, nTokens: st.n, firstToken: st.firstToken, firstIsEog: st.firstIsEog, payloadBytes: st.bytes });
        // The saved state under the computation's name, as the prefill worker's save leaves it: a
        // copy made before the clock starts, standing for the save the goal counts apart. (Copied
        // off the event loop: a 1 GiB copy blocked heartbeats for > 2 s at load 15, and the
        // receiver dropped the connection.) On the clock, as the worker does for a one-room
        // request (prefill/effects.ts `transfer`): the rename to the room's name, the offer, kv_file.
        const saved = join(init.stateDir, `pdserve-bench-kv-${process.pid}-${room}-saved.ggsq`);
        const name = join(init.stateDir, prefillStateName(process.pid, room));
        await copyFile(st.path, saved);
        let [t1, t2, t4, crc, sentNs, ackNs] = [0, 0, 0, false, '', ''];
        let loop = { eldP99: NaN, eldMax: NaN };
        eldStart();
        const t0Ns = mono();
        const t0 = now();
        try {
          renameSync(saved, name);
          t1 = now();
          const msg = sameHost.offer(conn.id, room, name, head, st.bytes, sendPool);
          crc = msg.crc !== undefined;
          t2 = now();
          sentNs = mono();
          conn.sendControl(msg);
          await within(acked, TRIAL_WAIT_MS, `kv_ack of room ${room} (kv_file)`);
          t4 = now();
          ackNs = mono();
          loop = eldStop();
        } finally {
          acks.delete(room);
          await rm(name, { force: true }); // prefill's delete at finish: decode renamed it, so nothing is left (a failed trial's copy too)
          await rm(saved, { force: true }); // renamed on the clock: nothing left, unless the trial failed before
        }
        send({ type: 'kvFileDone', room, totalMs: t4 - t0, linkMs: t1 - t0, offerMs: t2 - t1, crc, t0Ns, sentNs, ackNs, ...loop });
      } else if (m.cmd === 'floor') {
        // one-way lags of an 8-byte message on a bare loopback socket, after `gapMs` idle (as before a kv_file)
        const s = floorSock;
        if (!s) throw new Error('no floor connection');
        const there: number[] = [];
        const back: number[] = [];
        for (let k = 0; k < (m.rounds ?? 20); k++) {
          await new Promise((r) => setTimeout(r, m.gapMs ?? 20));
          const got = new Promise<[Buffer, bigint]>((r) => (floorReply = (b, at) => r([b, at])));
          const out = Buffer.alloc(8);
          const t0 = process.hrtime.bigint();
          out.writeBigUInt64BE(t0);
          s.write(out);
          const [b, at] = await within(got, TRIAL_WAIT_MS, 'floor reply');
          if (b.length < 16) throw new Error(`floor reply of ${b.length} bytes`);
          there.push(Number(b.readBigUInt64BE(0) - t0) / 1e6);
          back.push(Number(at - b.readBigUInt64BE(8)) / 1e6);
        }
        floorReply = undefined;
        send({ type: 'floored', there, back });
      } else if (m.cmd === 'raw') {
        const n = m.bytes!;
        if (!rawSock) throw new Error('no raw connection');
        const acked = new Promise<void>((r) => (rawAck = r));
        const t0 = now();
        const t0Hr = hr();
        const head = Buffer.alloc(8);
        head.writeBigUInt64BE(BigInt(n));
        rawSock.write(head);
        rawSock.write(rawBuf.subarray(0, n));
        try {
          await within(acked, TRIAL_WAIT_MS, `raw ack of ${n} bytes`);
        } finally {
          rawAck = undefined;
        }
        const t1 = now();
        send({ type: 'rawDone', totalMs: t1 - t0, t0Hr });
      } else if (m.cmd === 'probe') {
        // What this machine allows for the handoff's building blocks, on `bytes` of data (median of 5).
        const n = m.bytes!;
        const src = Buffer.allocUnsafe(n);
        randomFillSync(src);
        const warm = Buffer.allocUnsafe(n);
        src.copy(warm);
        const path = join(init.stateDir, `pdserve-bench-probe-${process.pid}.bin`);
        const time = async (fn: () => unknown | Promise<unknown>) => {
          const xs: number[] = [];
          for (let i = 0; i < 5; i++) {
            const t = now();
            await fn();
            xs.push(now() - t);
          }
          return xs.sort((a, b) => a - b)[2]!;
        };
        const out = {
          bytes: n,
          sha256Ms: await time(() => createHash('sha256').update(src).digest()),
          copyWarmMs: await time(() => src.copy(warm)),
          copyFreshMs: await time(() => src.copy(Buffer.allocUnsafe(n))),
          writeFileMs: await time(() => writeFile(path, src)),
          readFileMs: await time(() => readFile(path)),
        };
        await rm(path, { force: true });
        send({ type: 'probed', ...out });
      } else if (m.cmd === 'io') {
        ioMode = (m as { mode?: string }).mode === 'inline' ? 'inline' : 'thread';
        send({ type: 'ioSet', mode: ioMode });
      } else if (m.cmd === 'cleanup') {
        await Promise.all(states.map((s) => rm(s.path, { force: true })));
        send({ type: 'cleaned' });
      }
    } catch (err) {
      send({ type: ({ make: 'made', kv: 'kvDone', kvfile: 'kvFileDone', floor: 'floored', raw: 'rawDone', probe: 'probed' } as Record<string, string>)[m.cmd] ?? 'cleaned', error: (err as Error).message });
    }
  });
}

/**
 * PDSERVE_BENCH_KV_BOUND mem: `head`, `payload` (already in memory) in SEND_PIECE_BYTES pieces
 * and the trailer carrying `crc`, as room `room`'s chunk frames — sendStateFile's bytes without
 * the file read and the CRC pass.
 */
function sendFromMemory(c: PeerConn, room: RoomId, head: Buffer, payload: Buffer, crc: number, onProgress?: (n: number) => void): Promise<void> {
  let pos = -1;
  let ended = false;
  return c.sendFrom(room, {
    next: () => {
      if (pos < 0) {
        pos = 0;
        return head;
      }
      if (pos < payload.length) {
        const n = Math.min(SEND_PIECE_BYTES, payload.length - pos);
        pos += n;
        return payload.subarray(pos - n, pos);
      }
      if (!ended) {
        ended = true;
        return envelopeTrailer(crc);
      }
      return undefined;
    },
  }, { offset: 0, onProgress });
}

async function receiver(engine: Engine): Promise<void> {
  const info = engine.info;
  const maxBytes = 2 * 1024 * 1024 * 1024; // above the 1 GiB state of the large-state run
  const kvPool = new BufferPool(TRANSFER_BUFFER_BYTES, TRANSFER_POOL_BUFFERS);
  // as the decode worker: received states go into recycled files (deleted when the process exits normally; the sweep otherwise)
  const recvFiles = new FilePool({ dir: init.stateDir, prefix: `pdserve-bench-kvrecv-${process.pid}`, maxFiles: RECV_SPARE_FILES, maxBytes: RECV_SPARE_BYTES, maxLargeBytes: maxBytes });
  atExit(() => recvFiles.close());
  // PDSERVE_BENCH_KV_BOUND nowrite: per payload size, the file the first trial wrote and loaded
  // (re-framed in place by that load; the next loads re-frame it again to the same bytes)
  const staged = new Map<number, string>();
  const staging = new Map<string, number>();
  const stagePool = {
    acquire(bytes: number) {
      const path = staged.get(bytes);
      if (path !== undefined) return { path, fd: openSync('/dev/null', 'w'), reused: true };
      const fresh = join(init.stateDir, `pdserve-bench-kvstage-${process.pid}-${bytes}.ggsq`);
      const fd = openSync(fresh, 'w+');
      ftruncateSync(fd, bytes);
      atExit(() => rmSync(fresh, { force: true }));
      staging.set(fresh, bytes);
      return { path: fresh, fd, reused: false };
    },
    release(path: string) {
      const bytes = staging.get(path);
      if (bytes === undefined) return;
      staging.delete(path);
      staged.set(bytes, path);
    },
  } as unknown as FilePool;
  type Recv = { room: RoomId; rx: StateReceiver<ParsedState>; tBegin: number; tLast: number; beginAbs: number; lastAbs: number; endAbs: number; end?: { totalBytes: number; crc: number }; error?: string; deadline?: NodeJS.Timeout; total: number; bare?: { path: string; state: ParsedState }; counted: number };
  /** PDSERVE_BENCH_KV_BOUND bare: per kv_begin size, the staged file and the warm-up trial's walk of it. */
  const bareOf = new Map<number, { path: string; state: ParsedState }>();
  let recv: Recv | undefined;
  /** A receive that ends without a load (failed, replaced, timed out): its file back to the pool (or deleted), its timer off. */
  const drop = (r: Recv): void => {
    clearTimeout(r.deadline);
    void r.rx.discard();
  };
  atExit(() => {
    if (recv) drop(recv); // discard's file work is synchronous: done before the exit
  });
  const sameHost = new SameHostDecode({ enabled: true, stateDir: init.stateDir });
  const expect = { fingerprint: info.fingerprint, contextSize: info.compat.contextSize, batchSize: info.compat.batchSize, maxPayloadBytes: maxBytes };
  const walker = (n: number) => new GgsqStreamParser({ contextSize: info.compat.contextSize, nLayer: info.compat.nLayer, maxBytes: n, nVocab: info.nVocab });
  const headers = (file: PositionalSource) => parseStateHeaders(file, { contextSize: info.compat.contextSize, nLayer: info.compat.nLayer, nVocab: info.nVocab, maxBytes });
  const pool = new KvPeerPool({
    onPeerLost: (_c, why) => send({ type: 'progress', msg: `receiver: kv connection lost: ${why}` }),
    transport: kvTransportOf(loadInternalTls(init.tls)),
    secret: init.secret,
    settings: pairSettingsOf(engine.info),
    epoch: init.epoch,
    streams: KV_STREAMS,
    onConnect: (c) => sameHost.probe(c),
    onMessage: (conn, msg) => {
      if (msg.type === 'same_host_reply') sameHost.onReply(conn, msg);
      else if (msg.type === 'kv_file') void loadFile(conn, msg, mono());
      else if (msg.type === 'kv_begin') {
        tr('kv_begin-recv');
        if (recv) {
          send({ type: 'kvRecv', room: recv.room, error: `kv_begin of room ${msg.room} before kv_end of room ${recv.room}` });
          drop(recv);
        }
        const streamed = msg.streamed === true;
        const rx = new StateReceiver({ totalBytes: streamed ? maxBytes : msg.totalBytes, ...(streamed ? { streamed: { hintBytes: msg.totalBytes } } : {}), expect: { fingerprint: info.fingerprint, contextSize: info.compat.contextSize, batchSize: info.compat.batchSize, maxPayloadBytes: maxBytes }, walker: (n: number) => new GgsqStreamParser({ contextSize: info.compat.contextSize, nLayer: info.compat.nLayer, maxBytes: n, nVocab: info.nVocab }), files: BOUND_NOWRITE ? stagePool : recvFiles, pool: kvPool, io: kvIoRecv() });
        eldStart();
        tr('rx-made');
        const bare = BOUND_BARE && !streamed ? bareOf.get(msg.totalBytes) : undefined;
        const r: Recv = { total: msg.totalBytes, counted: 0, ...(bare ? { bare } : {}), room: msg.room, rx, tBegin: now(), tLast: now(), beginAbs: abs(), lastAbs: abs(), endAbs: 0 };
        // the sender may fail after kv_begin (its state file gone or cut): no kv_end ever comes
        r.deadline = setTimeout(() => {
          if (recv !== r) return;
          recv = undefined;
          send({ type: 'kvRecv', room: r.room, error: `no kv_end within ${TRIAL_WAIT_MS} ms of kv_begin (${r.rx.received} bytes received)` });
          drop(r);
        }, TRIAL_WAIT_MS);
        recv = r;
      } else if (msg.type === 'kv_end') {
        tr('kv_end-recv');
        const r = recv;
        recv = undefined;
        if (r) {
          r.endAbs = abs();
          clearTimeout(r.deadline);
          if (msg.totalBytes !== undefined && msg.crc !== undefined) r.end = { totalBytes: msg.totalBytes, crc: msg.crc };
        }
        if (!r || r.room !== msg.room || r.error) {
          send({ type: 'kvRecv', room: msg.room, error: r?.error ?? 'kv_end without kv_begin' });
          if (r) drop(r);
          return;
        }
        void load(conn, r);
      }
    },
    onChunk: (_c, room, offset, data) => {
      const r = recv;
      if (!r || r.room !== room || r.error) return;
      try {
        if (r.bare) {
          if (offset !== r.counted) throw new Error(`chunk at ${offset}, expected ${r.counted}`);
          tr(`chunk ${offset} +${data.length}`);
          r.counted += data.length;
          tr('pushed');
          r.tLast = now();
          r.lastAbs = abs();
          return;
        }
        if (offset !== r.rx.received) throw new Error(`chunk at ${offset}, expected ${r.rx.received}`);
        tr(`chunk ${offset} +${data.length}`);
        r.rx.push(data, _c);
        tr('pushed');
      } catch (err) {
        r.error = (err as Error).message;
      }
      r.tLast = now();
      r.lastAbs = abs();
    },
  });
  const load = async (conn: PeerConn, r: Recv) => {
    const slot = engine.tryAcquireSlot();
    try {
      if (!slot) throw new Error('no free slot');
      const t0 = now();
      const loadAbs = abs();
      tr('finish-start');
      if (r.bare && r.counted !== r.total) throw new Error(`bound bare: ${r.counted} bytes came, kv_begin announced ${r.total}`);
      const { header, state, path } = r.bare ? { header: { nTokens: r.bare.state.nTokens }, state: r.bare.state, path: r.bare.path } : await r.rx.finish(r.end);
      if (BOUND_BARE && !r.bare) bareOf.set(r.total, { path, state });
      if (state.nTokens !== header.nTokens) throw new Error('token count mismatch');
      tr('finished');
      const t3 = now();
      await slot.loadState(path, state.tokens, state);
      const loadedHr = hr();
      const loop = eldStop();
      tr('loaded');
      const t4 = now();
      const ackAbs = abs();
      conn.sendControl({ type: 'kv_ack', room: r.room, epoch: init.epoch });
      trFlush();
      send({ type: 'kvRecv', room: r.room, wireMs: r.tLast - r.tBegin, decodeMs: 0, parseMs: 0, writeMs: t3 - t0, loadMs: t4 - t3, beginAbs: r.beginAbs, lastAbs: r.lastAbs, endAbs: r.endAbs, loadAbs, ackAbs, loadedHr, io: ioMode, ...loop });
    } catch (err) {
      send({ type: 'kvRecv', room: r.room, error: (err as Error).message });
    } finally {
      slot?.release();
      await track(r.rx.done()); // the load settled: the file goes back to the spares
    }
  };
  /** Work a trial leaves running after its report (the received file given back to the spares, or deleted past their bounds): `settle` waits for it. */
  const pending = new Set<Promise<unknown>>();
  const track = <T>(p: Promise<T>): Promise<T> => {
    pending.add(p);
    return p.finally(() => pending.delete(p));
  };
  /** Same host: the kv_file path of the decode worker (take over + validate, load, ack, then delete). */
  const loadFile = async (conn: PeerConn, msg: Extract<ControlMsg, { type: 'kv_file' }>, arriveNs: string) => {
    const slot = engine.tryAcquireSlot();
    let path: string | undefined;
    try {
      if (!slot) throw new Error('no free slot');
      const takeNs = mono();
      const t0 = now();
      const out = sameHost.take(msg, { expect, headers, walker, pool: kvPool });
      if ('refused' in out) throw new Error(`refused: ${out.refused}`);
      const { bytesRead: readBytes, reads } = out;
      path = out.taken.path;
      const t1 = now();
      const loading = slot.loadState(path, out.taken.state.tokens, out.taken.state);
      // the event-loop monitor from the load's start (its own start costs ~30 µs: off the clock,
      // while llama.cpp loads on its thread)
      setImmediate(eldStart);
      await loading;
      const t2 = now();
      const loadedNs = mono(); // the state is in the slot: the request could generate from here
      const loop = eldStop();
      // as the decode worker: kv_ack (loadDone) first, the file deleted after
      conn.sendControl({ type: 'kv_ack', room: msg.room, epoch: init.epoch });
      await rm(path, { force: true });
      const t3 = now();
      send({ type: 'kvFileRecv', room: msg.room, takeMs: t1 - t0, readBytes, reads, loadMs: t2 - t1, rmMs: t3 - t2, arriveNs, takeNs, loadedNs, ...loop });
    } catch (err) {
      if (path) await rm(path, { force: true });
      send({ type: 'kvFileRecv', room: msg.room, error: (err as Error).message });
    } finally {
      slot?.release();
    }
  };
  send({ type: 'ready', fingerprint: info.fingerprint });
  process.on('message', async (m: { cmd: string; kvPort?: number; rawPort?: number; floorPort?: number }) => {
    if (m.cmd === 'io') {
      ioMode = (m as { mode?: string }).mode === 'inline' ? 'inline' : 'thread';
      send({ type: 'ioSet', mode: ioMode });
      return;
    }
    if (m.cmd === 'settle') {
      try {
        await within(Promise.allSettled([...pending, recvFiles.settled()]), TRIAL_WAIT_MS, 'the previous trial\'s file work');
        send({ type: 'settled' });
      } catch (err) {
        send({ type: 'settled', error: (err as Error).message });
      }
      return;
    }
    if (m.cmd !== 'connect') return;
    try {
      const kvConn = await pool.get('127.0.0.1', m.kvPort!);
      const sameHostOk = await sameHost.ready(kvConn);
      // the raw floor reads as the KV channel does: into one reused buffer of the channel's read
      // size (net's `onread`), no allocation per read — a floor must not do more than the handoff
      let need = -1;
      let got = 0;
      const head = Buffer.alloc(8);
      let headGot = 0;
      let s!: net.Socket;
      const onRaw = (len: number, b: Buffer): boolean => {
        let off = 0;
        while (off < len) {
          if (need < 0) {
            const take = Math.min(8 - headGot, len - off);
            b.copy(head, headGot, off, off + take);
            headGot += take;
            off += take;
            if (headGot === 8) {
              need = Number(head.readBigUInt64BE(0));
              headGot = 0;
              got = 0;
            }
            continue;
          }
          const take = Math.min(need - got, len - off);
          got += take;
          off += take;
          if (got === need) {
            const lastHr = hr();
            need = -1;
            s.write(Buffer.from([1]));
            send({ type: 'rawRecv', bytes: got, lastHr });
          }
        }
        return true;
      };
      s = net.connect({ host: '127.0.0.1', port: m.rawPort!, noDelay: true, onread: { buffer: Buffer.allocUnsafeSlow(KV_READ_BUFFER_BYTES), callback: onRaw } });
      await new Promise<void>((res, rej) => {
        s.once('connect', () => res());
        s.once('error', rej);
      });
      if (m.floorPort) {
        // the floor socket (same-host figures): stamp each 8-byte message on arrival, answer at once
        const f = net.connect({ host: '127.0.0.1', port: m.floorPort, noDelay: true });
        await new Promise<void>((res, rej) => {
          f.once('connect', () => res());
          f.once('error', rej);
        });
        f.on('data', () => {
          const out = Buffer.alloc(16);
          out.writeBigUInt64BE(process.hrtime.bigint(), 0);
          out.writeBigUInt64BE(process.hrtime.bigint(), 8);
          f.write(out);
        });
      }
      send({ type: 'connected', sameHost: sameHostOk });
    } catch (err) {
      send({ type: 'connected', error: (err as Error).message });
    }
  });
}

main().catch((err) => {
  send({ type: 'ready', error: (err as Error).message });
  process.exit(1);
});
