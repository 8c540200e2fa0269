/**
 * Bench section 1: the KV handoff against a bare TCP socket, between two processes.
 *
 * KV (the prefill worker's TCP path): from the start of prefill's saveState to "state loaded on
 * decode" (decode's stamp when llama.cpp's load returned; CLOCK_MONOTONIC through
 * process.hrtime.bigint, one clock for both processes): the save, then the pipelined handoff
 * (transfer/: the file read in pooled pieces into framed chunks over the authenticated channel,
 * CRC-32 on both sides and envelope + ggsq validation and the file write on decode all while the
 * bytes stream) — or, with `kvStream` (the workers' default), the two overlapped (the growing file read
 * behind llama.cpp's writes) — then llama.cpp's state load. Raw: the same number of bytes written on a bare net.Socket and counted (not stored) by
 * the other process, until its last byte arrived (its stamp). Neither includes the return hop;
 * the ack-inclusive times (kv_ack / 1-byte ack received back) are kept as `kvAckMs` /
 * `rawAckMs`. Same host (when the two processes pass the same-host probe over their KV
 * connection, kv/transfer/same-host.ts): from the state saved under the computation's name,
 * renamed to prefill's name for the room (as the worker does for a one-room request), named in a
 * kv_file message (not read: no CRC-32 without --kv-same-host-verify); decode takes it over
 * (rename), validates it (envelope head,
 * size, ggsq header walk by pread — the KV data is not read), loads it, acks, then deletes it.
 * The same-host clock ends when decode's loadState returns ("prefill-saved → decode-loaded", the
 * handoff's definition: the request generates from there; kv_ack only lets prefill
 * release its file): both children stamp process.hrtime.bigint(), CLOCK_MONOTONIC, one clock for
 * every process of the machine. The figure up to prefill's receipt of kv_ack is kept beside it
 * (`sameHostAckMs`). Trials rotate KV/raw/same-host,
 * sizes interleaved. The handoff goals compare KV (which contains the save) with save + raw +
 * load (`goalRatio`, ≤ 1.3) and save + same-host with save + load (`sameHostGoalRatio`, ≤ 1.1; the load of the
 * same-host trials).
 */
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import { newEpoch } from '../kv/auth.js';
import { summarize, type Summary } from '../observe/stats.js';
import { BenchChild, median, say } from './util.js';

/** Options of section 1. */
export interface KvSectionOptions {
  model: string;
  /** Target state sizes, MiB. */
  sizesMiB: number[];
  /** Trials per size (each = one KV and one raw transfer). */
  reps: number[];
  /** Context of both processes (must hold the largest state). */
  contextSize: number;
  batchSize: number;
  /** Bytes of state per token of this model (to pick token counts); measured when absent. */
  bytesPerToken?: number;
  /** Sequences of the receiving context (the decode worker's slots; 1 on the sending side, as the prefill worker). */
  receiverSequences?: number;
  /**
   * KV trials stream the state while it is saved, as the prefill worker does by default
   * (default: true unless the environment says PDSERVE_BENCH_KV_STREAM=0: save, then send, as
   * `prefill --no-kv-stream`).
   */
  kvStream?: boolean;
  /**
   * Also run every KV trial with the data path inline on the event loop (file read, CRC-32 and
   * file write on the main thread, as without the KV I/O thread), interleaved with the others,
   * reported as `inline` and `loopDelayMs.kvInline`.
   */
  compareInline?: boolean;
  /** llama.cpp threads of both processes (default 1). */
  threads?: number;
  /** Longest wait for the states to be made (prompt evaluation), ms (default 600 000). */
  makeTimeoutMs?: number;
}

/** The event loop's delay on each side during one kind of trial, ms: median over trials of each trial's p99, and the largest max. */
export interface LoopDelay {
  senderP99: number;
  receiverP99: number;
  senderMax: number;
  receiverMax: number;
}

/** One size's results. Times in ms, rates in GB/s (10^9 bytes/s). */
export interface KvSizeResult {
  targetMiB: number;
  tokens: number;
  stateBytes: number;
  blobBytes: number;
  /** Save start on prefill → state loaded on decode (the save is inside: it overlaps the send). */
  kvMs: Summary;
  /** Save start → decode's kv_ack received on prefill (the return hop included). */
  kvAckMs?: Summary;
  /** First write → the receiver's last byte. */
  rawMs: Summary;
  /** First write → the receiver's 1-byte ack received back. */
  rawAckMs?: Summary;
  kvGBps: number;
  rawGBps: number;
  /** median KV time / median raw time. */
  ratio: number;
  /** Median of 5 saveState calls of this state, each into a new file (ms). */
  saveMs: number;
  /** KV / (save + raw + loadState): the handoff (save included) against its floor (goal ≤ 1.3). */
  goalRatio: number;
  /** The save in goalRatio's floor, ms: median of the KV trials' own saves (save, then send), or `saveMs` when they streamed. */
  goalSaveMs?: number;
  /** Medians of the phases (sender: save inside the trial, envelope, send; receiver: wire, validate, write, load). */
  phasesMs: {
    /** The trial's own save: its start → saveState resolved (overlaps send). */
    save?: number;
    read: number;
    envelope: number;
    send: number;
    wire: number;
    decodeEnvelope: number;
    parseState: number;
    writeFile: number;
    loadState: number;
    /** kv_begin sent (prefill) → received (decode). */
    beginLag: number;
    /** last chunk received → kv_end received (decode). */
    endLag: number;
    /** kv_end received → validation starts (decode). */
    loadLag: number;
    /** kv_ack sent (decode) → received (prefill). */
    ackLag: number;
  };
  /** Raw-socket GB/s vs the KV channel's wire phase alone. */
  wireGBps: number;
  /**
   * Same-host handoff (kv_file), state saved on prefill → state loaded on decode (loadState
   * returned; CLOCK_MONOTONIC stamps of both processes); absent when the probe failed.
   */
  sameHostMs?: Summary;
  /** The same trials up to prefill's receipt of kv_ack (one more loopback message). */
  sameHostAckMs?: Summary;
  /** (save + same-host) / (save + loadState): goal ≤ 1.1. */
  sameHostGoalRatio?: number;
  /**
   * Medians of the same-host phases: link (prefill renames the saved file to the room's name,
   * as the worker does for a one-room request), offer (prefill makes kv_file: no system call;
   * the CRC-32 read only with verify), take
   * (decode: rename + envelope head + ggsq header walk), load (llama.cpp), rm (decode's delete,
   * after the ack: off the clock), beginLag (kv_file sent → received: decode's KV message
   * handler; CLOCK_MONOTONIC), ackLag (decode's load done → kv_ack received: after the clock),
   * handle (decode: kv_file handler → take starts: the slot), over (per trial: the clock minus
   * that trial's own load, i.e. what the handoff adds to save + load; median over trials).
   */
  sameHostPhasesMs?: { link: number; offer: number; take: number; load: number; rm: number; beginLag: number; ackLag: number; handle?: number; over?: number };
  /** Bytes of the file decode's validation read (median; the header walk's preads). */
  sameHostReadBytes?: number;
  /** The preads that validation made (median). */
  sameHostReads?: number;
  /** The same-host trials carried a CRC-32 (verify on): false for the default path. */
  sameHostVerified?: boolean;
  /** Event-loop delay (perf_hooks.monitorEventLoopDelay, 1 ms resolution) during the KV, same-host and inline KV trials. */
  loopDelayMs?: { kv: LoopDelay; sameHost?: LoopDelay; kvInline?: LoopDelay };
  /** The KV trials with the data path inline on the event loop (compareInline): time and goal ratio, same floor. */
  inline?: { kvMs: Summary; goalRatio: number };
}

/** The machine's speed at the handoff's building blocks (one process, 16 MiB, GB/s). */
export interface MachineLimits {
  bytes: number;
  sha256GBps: number;
  /** memcpy into memory already touched. */
  copyWarmGBps: number;
  /** memcpy into a fresh allocation (page faults on first touch). */
  copyFreshGBps: number;
  /** writeFile / readFile on /dev/shm (tmpfs). */
  writeFileGBps: number;
  readFileGBps: number;
}

/** Result of section 1. */
export interface KvSectionResult {
  sizes: KvSizeResult[];
  stateMaking: { tokens: number; bytes: number }[];
  machine?: MachineLimits;
  /** Sequences of the receiving (decode-side) context. */
  receiverSequences?: number;
  /**
   * The floor under the same-host path's message lag on this machine, same run and processes:
   * one-way ms of an 8-byte message on a bare loopback socket (CLOCK_MONOTONIC stamps), each
   * after 20 ms idle (as a kv_file finds decode), prefill → decode (`there`) and back; medians
   * and p90 of `rounds`. Absent when the same-host probe failed.
   */
  sameHostFloorMs?: { there: number; thereP90: number; back: number; rounds: number };
  /** The KV trials streamed the state while it was saved (the workers' default); false: save, then send (--no-kv-stream). */
  streamed?: boolean;
  /** The KV channel ran over mutual TLS (PDSERVE_BENCH_KV_TLS_DIR); raw TCP stays plain. */
  tls?: boolean;
}

interface Msg {
  type: string;
  error?: string;
  [k: string]: unknown;
}

/** Run section 1. */
export async function runKvSection(o: KvSectionOptions): Promise<KvSectionResult> {
  const secret = randomBytes(16).toString('hex');
  const base = { model: o.model, contextSize: o.contextSize, batchSize: o.batchSize, secret, stateDir: '/dev/shm', threads: o.threads ?? 1 };
  const streamed = o.kvStream ?? process.env.PDSERVE_BENCH_KV_STREAM !== '0';
  // PDSERVE_BENCH_KV_TLS_DIR=<dir with ca.crt, node.crt, node.key>: the channel over mutual TLS (the workers' --internal-tls-*).
  const tlsDir = process.env.PDSERVE_BENCH_KV_TLS_DIR;
  if (tlsDir) (base as Record<string, unknown>).tls = { ca: join(tlsDir, 'ca.crt'), cert: join(tlsDir, 'node.crt'), key: join(tlsDir, 'node.key') };
  if (process.env.PDSERVE_BENCH_KV_BOUND) say(`  NOTE: PDSERVE_BENCH_KV_BOUND=${process.env.PDSERVE_BENCH_KV_BOUND}: a bound experiment (bench-kv-child.ts), not the workers' path — these §1 figures are not the handoff's`);
  const sender = new BenchChild<Msg>('kv-child', [JSON.stringify({ ...base, role: 'sender', epoch: newEpoch(), streamed })]);
  const receiver = new BenchChild<Msg>('kv-child', [JSON.stringify({ ...base, role: 'receiver', epoch: newEpoch(), sequences: o.receiverSequences ?? 1 })]);
  sender.on((m) => {
    if (m.type === 'progress') say(`  ${String(m.msg)}`);
  });
  receiver.on((m) => {
    if (m.type === 'progress') say(`  ${String(m.msg)}`);
  });
  try {
    const [sr, rr] = await Promise.all([sender.wait('ready', 120_000), receiver.wait('ready', 120_000)]);
    if (sr.error || rr.error) throw new Error(`kv child failed to start: ${sr.error ?? rr.error}`);
    // the states first, then the KV connection: a long evaluation starves the sender's event loop,
    // and an idle connection whose peer misses its heartbeats is closed
    const bpt = o.bytesPerToken ?? 16_401;
    const maxTok = o.contextSize - 2;
    const tokens = o.sizesMiB.map((mib) => Math.min(maxTok, Math.max(1, Math.round((mib * 1024 * 1024) / bpt))));
    say(`  making states of ${tokens.join(', ')} tokens (prompt evaluation; the largest takes a while)`);
    const made = await sender.call<Msg & { states: { n: number; bytes: number; saveMs: number }[] }>({ cmd: 'make', tokens }, 'made', o.makeTimeoutMs ?? 600_000);
    const conn = await receiver.call<Msg>({ cmd: 'connect', kvPort: sr.kvPort, rawPort: sr.rawPort, floorPort: sr.floorPort }, 'connected', 30_000);
    const sameHost = conn.sameHost === true;
    if (!sameHost) say('  NOTE: the same-host probe failed between the two processes: no same-host trials');
    const states = made.states;
    const kv: { total: number[]; blob: number; ph: Record<string, number[]> }[] = states.map(() => ({ total: [], blob: 0, ph: {} }));
    const kvIn: { total: number[]; ph: Record<string, number[]> }[] = states.map(() => ({ total: [], ph: {} }));
    const eldPush = (ph: Record<string, number[]>, d: Msg, rv: Msg) => {
      push(ph, 'eldSendP99', d.eldP99);
      push(ph, 'eldSendMax', d.eldMax);
      push(ph, 'eldRecvP99', rv.eldP99);
      push(ph, 'eldRecvMax', rv.eldMax);
    };
    const setIo = async (mode: 'thread' | 'inline') => {
      if (!o.compareInline) return;
      await Promise.all([sender.call<Msg>({ cmd: 'io', mode }, 'ioSet', 30_000), receiver.call<Msg>({ cmd: 'io', mode }, 'ioSet', 30_000)]);
    };
    const raw: number[][] = states.map(() => []);
    const rawAck: number[][] = states.map(() => []);
    const sh: { total: number[]; toAck: number[]; ph: Record<string, number[]>; verified?: boolean }[] = states.map(() => ({ total: [], toAck: [], ph: {} }));
    const push = (ph: Record<string, number[]>, k: string, v: unknown) => {
      if (typeof v === 'number') (ph[k] ??= []).push(v);
    };
    let room = 1000;
    /**
     * One trial's two reports: the sender's answer to `cmd` and the receiver's `recvType` for
     * room `r`, each within 120 s (the children bound their own waits at 60 s and answer with an
     * error). A failure of either side throws an error naming the trial and both sides' outcomes
     * (§1 fails; the suite goes on); the receiver's wait never stays unhandled (a rejection
     * nobody awaits would end the whole suite).
     */
    const trial = async (what: string, i: number, r: string, cmd: object, doneType: string, recvType: string): Promise<[Msg, Msg]> => {
      const recvP = receiver.wait<Msg>(recvType, 120_000, (m) => m.room === r);
      recvP.catch(() => {});
      const fail = (side: string, e: unknown) => new Error(`§1 ${what} trial (room ${r}, state ${states[i]!.bytes} bytes) failed on the ${side}: ${(e as Error).message ?? e}`);
      let d: Msg;
      try {
        d = await sender.call<Msg>(cmd, doneType, 120_000);
      } catch (e) {
        // the receiver reports on its own deadline; a few seconds for its side of the story
        const late = new Promise<Msg>((res) => setTimeout(() => res({ type: recvType, error: 'no report within 5 s' }), 5000).unref());
        const rv = await Promise.race([recvP.catch((x: Error) => ({ type: recvType, error: x.message }) as Msg), late]);
        throw fail(`sender (receiver: ${typeof rv.error === 'string' ? rv.error : 'ok'})`, e);
      }
      const rv = await recvP.catch((e: Error) => ({ type: recvType, error: e.message }) as Msg);
      if (rv.error) throw fail('receiver', new Error(String(rv.error)));
      return [d, rv];
    };
    const kvTrial = async (i: number, record: boolean, mode: 'thread' | 'inline' = 'thread') => {
      await setIo(mode);
      const r = String(room++);
      const [d, rv] = await trial(mode === 'inline' ? 'kv (inline)' : 'kv', i, r, { cmd: 'kv', idx: i, room: r }, 'kvDone', 'kvRecv');
      if (!record) return;
      if (mode === 'inline') {
        const k = kvIn[i]!;
        k.total.push((rv.loadedHr as number) - (d.t0Hr as number));
        eldPush(k.ph, d, rv);
        return;
      }
      const k = kv[i]!;
      eldPush(k.ph, d, rv);
      k.total.push((rv.loadedHr as number) - (d.t0Hr as number));
      push(k.ph, 'ack', d.totalMs);
      push(k.ph, 'save', d.saveMs);
      k.blob = d.blobBytes as number;
      push(k.ph, 'read', d.readMs);
      push(k.ph, 'envelope', d.encodeMs);
      push(k.ph, 'send', d.sendMs);
      push(k.ph, 'wire', rv.wireMs);
      push(k.ph, 'decodeEnvelope', rv.decodeMs);
      push(k.ph, 'parseState', rv.parseMs);
      push(k.ph, 'writeFile', rv.writeMs);
      push(k.ph, 'loadState', rv.loadMs);
      // cross-process gaps (wall clock of both processes): queueing and scheduling delays
      const n = (x: unknown) => (typeof x === 'number' ? x : NaN);
      push(k.ph, 'beginLag', n(rv.beginAbs) - n(d.t2Abs));
      push(k.ph, 'endLag', n(rv.endAbs) - n(rv.lastAbs));
      push(k.ph, 'loadLag', n(rv.loadAbs) - n(rv.endAbs));
      push(k.ph, 'ackLag', n(d.t4Abs) - n(rv.ackAbs));
    };
    const shTrial = async (i: number, record: boolean) => {
      if (!sameHost) return;
      // the receiver may still be giving the previous KV trial's received file back to its
      // FilePool (it reports before that; a release past the pool's bounds deletes the file):
      // let it finish, so this trial's clock measures only the handoff
      await receiver.call<Msg>({ cmd: 'settle' }, 'settled', 90_000);
      const r = String(room++);
      const [d, rv] = await trial('same-host', i, r, { cmd: 'kvfile', idx: i, room: r }, 'kvFileDone', 'kvFileRecv');
      if (!record) return;
      const k = sh[i]!;
      eldPush(k.ph, d, rv);
      // CLOCK_MONOTONIC ns (decimal strings) of both children → ms
      const ms = (a: unknown, b: unknown) => (typeof a === 'string' && typeof b === 'string' && a && b ? Number(BigInt(b) - BigInt(a)) / 1e6 : NaN);
      k.total.push(ms(d.t0Ns, rv.loadedNs));
      k.toAck.push(d.totalMs as number);
      push(k.ph, 'link', d.linkMs);
      push(k.ph, 'offer', d.offerMs);
      push(k.ph, 'take', rv.takeMs);
      push(k.ph, 'readBytes', rv.readBytes);
      push(k.ph, 'reads', rv.reads);
      if (d.crc === true) k.verified = true;
      push(k.ph, 'load', rv.loadMs);
      push(k.ph, 'rm', rv.rmMs);
      push(k.ph, 'beginLag', ms(d.sentNs, rv.arriveNs));
      push(k.ph, 'handle', ms(rv.arriveNs, rv.takeNs));
      // this trial's cost above its own load (the goal's budget is 10 % of save + load)
      if (typeof rv.loadMs === 'number') push(k.ph, 'over', ms(d.t0Ns, rv.loadedNs) - rv.loadMs);
      push(k.ph, 'ackLag', ms(rv.loadedNs, d.ackNs));
    };
    const rawTrial = async (i: number, record: boolean) => {
      const bytes = kv[i]!.blob || states[i]!.bytes;
      const recvP = receiver.wait<Msg>('rawRecv', 120_000, (m) => m.bytes === bytes);
      recvP.catch(() => {});
      const d = await sender.call<Msg>({ cmd: 'raw', bytes }, 'rawDone', 120_000);
      if (d.error) throw new Error(`§1 raw trial (${bytes} bytes) failed: ${d.error}`);
      const rv = await recvP;
      if (!record) return;
      raw[i]!.push((rv.lastHr as number) - (d.t0Hr as number));
      rawAck[i]!.push(d.totalMs as number);
    };
    // warm-up: one of each per size (page cache, socket buffers, llama.cpp first load)
    for (let i = 0; i < states.length; i++) {
      await kvTrial(i, false);
      if (o.compareInline) await kvTrial(i, false, 'inline');
      await rawTrial(i, false);
      await shTrial(i, false);
    }
    const rounds = Math.max(...o.reps);
    for (let round = 0; round < rounds; round++) {
      for (let i = 0; i < states.length; i++) {
        if (round >= (o.reps[i] ?? 0)) continue;
        // rotate the order of the three kinds, so none always runs first or after the same one
        const order = [kvTrial, rawTrial, shTrial, ...(o.compareInline ? [(j: number, rec: boolean) => kvTrial(j, rec, 'inline')] : [])];
        for (let k = 0; k < order.length; k++) await order[(round + i + k) % order.length]!(i, true);
      }
      say(`  round ${round + 1}/${rounds} done`);
    }
    // the floor under the same-host path's message lag (a bare loopback socket, same processes)
    const fl = sameHost
      ? await sender.call<Msg & { there: number[]; back: number[] }>({ cmd: 'floor', rounds: 20, gapMs: 20 }, 'floored', 60_000).catch((e: Error) => {
          say(`  NOTE: the loopback floor measurement failed (${e.message}): the report goes without it`);
          return undefined;
        })
      : undefined;
    const pr = await sender.call<Msg>({ cmd: 'probe', bytes: 16 * 1024 * 1024 }, 'probed', 120_000);
    const g = (ms: unknown) => (pr.bytes as number) / ((ms as number) / 1000) / 1e9;
    const machine: MachineLimits = { bytes: pr.bytes as number, sha256GBps: g(pr.sha256Ms), copyWarmGBps: g(pr.copyWarmMs), copyFreshGBps: g(pr.copyFreshMs), writeFileGBps: g(pr.writeFileMs), readFileGBps: g(pr.readFileMs) };
    await sender.call({ cmd: 'cleanup' }, 'cleaned', 30_000).catch(() => {});
    const sizes: KvSizeResult[] = states.map((s, i) => {
      const k = kv[i]!;
      const kvMs = summarize(k.total);
      const rawMs = summarize(raw[i]!);
      const gbps = (bytes: number, ms: number) => bytes / (ms / 1000) / 1e9;
      const ph = (name: string) => median(k.ph[name] ?? []);
      const delay = (p: Record<string, number[]>): LoopDelay => ({ senderP99: median(p.eldSendP99 ?? []), receiverP99: median(p.eldRecvP99 ?? []), senderMax: Math.max(...(p.eldSendMax ?? [NaN])), receiverMax: Math.max(...(p.eldRecvMax ?? [NaN])) });
      const floorMs = (streamed ? s.saveMs : ph('save')) + rawMs.median + ph('loadState');
      const inl = kvIn[i]!;
      return {
        loopDelayMs: { kv: delay(k.ph), ...(sh[i]!.total.length ? { sameHost: delay(sh[i]!.ph) } : {}), ...(inl.total.length ? { kvInline: delay(inl.ph) } : {}) },
        ...(inl.total.length ? { inline: { kvMs: summarize(inl.total), goalRatio: summarize(inl.total).median / floorMs } } : {}),
        targetMiB: o.sizesMiB[i]!,
        tokens: s.n,
        stateBytes: s.bytes,
        blobBytes: k.blob,
        kvMs,
        kvAckMs: summarize(k.ph.ack ?? []),
        rawMs,
        rawAckMs: summarize(rawAck[i]!),
        kvGBps: gbps(k.blob, kvMs.median),
        rawGBps: gbps(k.blob, rawMs.median),
        ratio: kvMs.median / rawMs.median,
        saveMs: s.saveMs,
        // the floor's save: the trials' own saves (many, interleaved) when they ran alone; while
        // streamed they overlap the send, so then the median of 5 saves made with the state
        goalSaveMs: streamed ? s.saveMs : ph('save'),
        goalRatio: kvMs.median / ((streamed ? s.saveMs : ph('save')) + rawMs.median + ph('loadState')),
        phasesMs: {
          save: ph('save'),
          read: ph('read'),
          envelope: ph('envelope'),
          send: ph('send'),
          wire: ph('wire'),
          decodeEnvelope: ph('decodeEnvelope'),
          parseState: ph('parseState'),
          writeFile: ph('writeFile'),
          loadState: ph('loadState'),
          beginLag: ph('beginLag'),
          endLag: ph('endLag'),
          loadLag: ph('loadLag'),
          ackLag: ph('ackLag'),
        },
        wireGBps: gbps(k.blob, ph('wire')),
        ...(sameHost && sh[i]!.total.length
          ? (() => {
              const q = sh[i]!;
              const sp = (name: string) => median(q.ph[name] ?? []);
              const shMs = summarize(q.total);
              return {
                sameHostMs: shMs,
                sameHostAckMs: summarize(q.toAck),
                sameHostGoalRatio: (s.saveMs + shMs.median) / (s.saveMs + sp('load')),
                sameHostPhasesMs: { link: sp('link'), offer: sp('offer'), take: sp('take'), load: sp('load'), rm: sp('rm'), beginLag: sp('beginLag'), ackLag: sp('ackLag'), ...(q.ph.over ? { handle: sp('handle'), over: sp('over') } : {}) },
                sameHostReadBytes: sp('readBytes'),
                ...(q.ph.reads ? { sameHostReads: sp('reads') } : {}),
                sameHostVerified: q.verified === true,
              };
            })()
          : {}),
      };
    });
    return {
      sizes,
      stateMaking: states.map((s) => ({ tokens: s.n, bytes: s.bytes })),
      machine,
      receiverSequences: o.receiverSequences ?? 1,
      streamed,
      ...(tlsDir ? { tls: true } : {}),
      ...(fl?.there?.length ? { sameHostFloorMs: { there: median(fl.there), thereP90: summarize(fl.there).p90, back: median(fl.back), rounds: fl.there.length } } : {}),
    };
  } finally {
    await Promise.all([sender.stop(), receiver.stop()]);
  }
}
