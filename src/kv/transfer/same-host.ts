/**
 * The same-host KV handoff: when prefill and decode run on one host and share one state
 * directory, prefill hands decode the saved state file itself (a `kv_file` message naming it)
 * and no state byte crosses TCP. (The same idea as a shared-memory/local-file KV connector —
 * vLLM's and LMCache's local connectors, SGLang's same-node transfer through a shared tmpfs —
 * applied here to one llama.cpp state file.)
 *
 * Proof, once per connection, over the authenticated KV channel (messages.ts):
 *   decode → same_host_probe {boot, pidns, file}: decode's boot id
 *            (/proc/sys/kernel/random/boot_id), its pid namespace (/proc/self/ns/pid) and the
 *            name of a probe file it wrote into ITS state directory holding a random nonce;
 *   prefill → same_host_reply {ok, nonce}: prefill compares boot id and pid namespace with its
 *            own and reads the file of that name from ITS state directory, echoing its content;
 *   decode → same_host_ok {headerWalk: true}: the nonce matched — both sides see the same
 *            directory, on the same boot, with the same pids. Only then does prefill send this
 *            connection's rooms as kv_file. (`headerWalk`: this decode takes a kv_file without a
 *            CRC-32, see below; a decode of an earlier version does not say so and gets one.)
 *            Any doubt (path off on either side, another boot id or pid namespace, the file
 *            missing, another nonce, no answer within the probe deadline) leaves the connection
 *            on TCP. The probe file is deleted when the probe settles.
 *
 * Ownership of a handed file (deleted exactly once):
 *   - A state file's name records its owner: `pdserve-<kind>-<pid>-<room>.ggsq` (statefiles.ts).
 *     Prefill saves `pdserve-prefill-<prefill pid>-<room>.ggsq` and owns it.
 *   - Ownership moves when decode RENAMES it to `pdserve-decode-<decode pid>-<room>.ggsq`
 *     (`takeStateFile`). rename(2) in one directory is atomic: the inode has exactly one name at
 *     any moment, and that name's owner is the one that deletes it.
 *   - Prefill deletes its name when the room ends — at kv_ack, on failure, or when decode never
 *     answers and the room's transfer deadline fails it. If decode took the file first that
 *     delete finds nothing; if prefill's delete comes first, decode's rename finds nothing and
 *     decode refuses the handoff (kv_file_refused). Either way the inode is unlinked once.
 *   - Decode deletes its name after llama.cpp loaded it (or on any failure), as the TCP path.
 *   - A process killed while it owns a name leaves a file whose pid is dead: every worker
 *     sweeps such files at start-up and on a timer, and decode also right after losing a
 *     prefill connection (statefiles.ts). A killed prefill's file is swept once no live
 *     process has that pid.
 *   - n > 1 (one state → several decode rooms): one hard link per room, each named for its room;
 *     each link is owned, renamed and deleted by the rule above, so each is deleted once.
 *
 * Validation before llama.cpp — what protects the PROCESS (llama.cpp aborts it on a truncated
 * state and allocates without bound on a huge count, see engine/ggsq.ts), without reading the
 * payload: the envelope head (carried base64 in kv_file) goes through the same
 * `parseEnvelopeHead` as on TCP (model fingerprint, context settings, payload size); the taken
 * file's size must be the announced one (fstat after the rename: ours now); and its ggsq
 * STRUCTURE is walked with positional reads of the headers only (`parseStateHeaders` of
 * engine/ggsq.ts, injected by the caller: token ids,
 * cell metadata, per-layer type / row size), seeking over the KV data — every count and size
 * checked against the file's size, as the streamed walk does. A cut file, a damaged head or a
 * damaged structure header fails its room, never the process. Cost: 2 × n_layer preads (one
 * for everything before layer 0's K data: 16 bytes per token of ids and cell metadata; one per
 * other layer header) — none of the KV data — all synchronous (`take` says why, and what bounds
 * the time it blocks the event loop).
 *
 * What is NOT checked by default, and why: the KV data bytes (no CRC-32). No wire exists on this
 * path — the bytes decode loads are the very pages prefill's llama.cpp wrote into the shared
 * tmpfs — so a checksum would guard no transport; it would cost two full passes over the file on
 * the critical path (prefill's CRC before kv_file, decode's read), each about as long as
 * llama.cpp's load itself. Damaged data bytes (a bug or a third process writing into the state
 * directory) would load silently and give wrong tokens, as they would inside one process.
 * `--kv-same-host-verify` (on either side; decode asks for it in same_host_ok) restores the full
 * check: prefill computes the CRC-32 (one read) and names it in kv_file, decode reads the whole
 * file once through the streamed walk (`GgsqStreamParser`) and the CRC-32 and refuses a mismatch.
 * A decode of an earlier version required `crc` in kv_file (its parser closed the connection on a
 * kv_file without one): prefill leaves the CRC out only for a decode whose same_host_ok says
 * `headerWalk` (every decode since sends it), so a rolling upgrade (new prefill, old decode)
 * keeps working, at the old path's cost.
 * The TCP path always keeps its CRC-32 (transfer/sender.ts, receiver.ts).
 */
import { randomBytes } from 'node:crypto';
import { closeSync, fstatSync, lstatSync, openSync, readFileSync, readlinkSync, readSync, renameSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import type { PeerConn } from '../channel.js';
import { parseEnvelopeHead, type EnvelopeExpect } from '../envelope.js';
import type { ControlMsg, SameHostMsg } from '../messages.js';
import { KvError, type RoomId } from '../types.js';
import { Crc32 } from './checksum.js';
import type { BufferPool } from './pool.js';
import type { ReceivedState, StructureWalker } from './receiver.js';

/** How a room's state went from prefill to decode (shown in /debug/rooms and counted by path). */
export type KvPath = 'tcp' | 'same_host';

/** What proves two processes share a host: boot id and pid namespace. */
export interface HostIdentity {
  /** /proc/sys/kernel/random/boot_id. */
  boot: string;
  /** /proc/self/ns/pid link ("pid:[4026531836]"): state-file owners are pids, so both must see the same pids. */
  pidns: string;
}

/** Default deadline of one connection's probe, ms. */
export const SAME_HOST_PROBE_MS = 2000;
const PROBE_FILE = /^pdserve-probe-\d+-[0-9a-f]{16}\.nonce$/;
const NONCE = /^[0-9a-f]{32}$/;

/**
 * This process's host identity, or undefined where it cannot be read (not Linux): the path is
 * then off. TEST-ONLY: PDSERVE_TEST_BOOT_ID replaces the boot id (to prove a mismatch falls back).
 */
export function hostIdentity(): HostIdentity | undefined {
  try {
    const boot = process.env.PDSERVE_TEST_BOOT_ID || readFileSync('/proc/sys/kernel/random/boot_id', 'utf8').trim();
    return { boot, pidns: readlinkSync('/proc/self/ns/pid') };
  } catch {
    return undefined;
  }
}

/** The name prefill saves (and hands over) room `room`'s state under: owned by `pid`. */
export function prefillStateName(pid: number, room: RoomId): string {
  return `pdserve-prefill-${pid}-${room}.ggsq`;
}

/** The name decode takes room `room`'s handed file over to: owned by `pid`. */
export function decodeStateName(pid: number, room: RoomId): string {
  return `pdserve-decode-${pid}-${room}.ggsq`;
}

/** Options of both sides. */
export interface SameHostOptions {
  /** The path is on (false: `--no-kv-same-host`; the side then refuses/never probes). */
  enabled: boolean;
  /** This process's state directory. */
  stateDir: string;
  /** This host's identity (default hostIdentity()); undefined = path off. */
  identity?: HostIdentity | null;
  /** Probe deadline, ms (decode side; default SAME_HOST_PROBE_MS). */
  probeMs?: number;
  /**
   * `--kv-same-host-verify`: also check the KV data bytes (CRC-32) — prefill computes it for every
   * kv_file, decode asks for it in same_host_ok and reads the whole taken file to check it. Off
   * (default): no full read of the payload on the handoff's critical path (see the module doc).
   */
  verify?: boolean;
  log?: { info(o: object, m: string): void; warn(o: object, m: string): void };
}

function identityOf(o: SameHostOptions): HostIdentity | undefined {
  return o.identity === null ? undefined : (o.identity ?? hostIdentity());
}

// ---- prefill side ------------------------------------------------------------------------------

/**
 * Prefill's half: answers probes, remembers which connections decode confirmed, and turns a
 * saved state file into a kv_file message.
 */
export class SameHostPrefill {
  private readonly confirmed = new Set<string>();
  /**
   * Connections whose kv_file must carry the CRC-32: decode asked for the data check
   * (same_host_ok {verify}), or did not say it takes a kv_file without one (no `headerWalk`:
   * a decode of an earlier version, whose kv_file schema requires `crc`).
   */
  private readonly crcFor = new Set<string>();
  private readonly id: HostIdentity | undefined;

  constructor(private readonly o: SameHostOptions) {
    this.id = identityOf(o);
  }

  /** Whether the path is on here at all. */
  get enabled(): boolean {
    return this.o.enabled && this.id !== undefined;
  }

  /**
   * A same-host message from connection `connId`. Returns the answer to send (a probe's reply)
   * or undefined. Never throws.
   */
  onMessage(connId: string, msg: SameHostMsg): ControlMsg | undefined {
    if (msg.type === 'same_host_ok') {
      if (this.enabled) this.confirmed.add(connId);
      if (this.enabled && (msg.verify || !msg.headerWalk)) this.crcFor.add(connId);
      return undefined;
    }
    if (msg.type !== 'same_host_probe') return undefined;
    const no = (reason: string): ControlMsg => ({ type: 'same_host_reply', ok: false, reason });
    if (!this.o.enabled) return no('the same-host path is off on prefill (--no-kv-same-host)');
    if (!this.id) return no('prefill cannot read its boot id');
    if (msg.boot !== this.id.boot) return no('another boot id: not the same host');
    if (msg.pidns !== this.id.pidns) return no('another pid namespace');
    if (!PROBE_FILE.test(msg.file)) return no('bad probe file name');
    try {
      const p = join(this.o.stateDir, msg.file);
      const st = lstatSync(p);
      if (!st.isFile() || st.size > 64) return no('probe file is not a small regular file');
      return { type: 'same_host_reply', ok: true, nonce: readFileSync(p, 'utf8') };
    } catch (err) {
      return no(`probe file not found in prefill's state directory (${(err as NodeJS.ErrnoException).code ?? 'error'}): another directory`);
    }
  }

  /** True when rooms of connection `connId` may be handed over as kv_file. */
  usable(connId: string): boolean {
    return this.enabled && this.confirmed.has(connId);
  }

  /** The connection ended. */
  forget(connId: string): void {
    this.confirmed.delete(connId);
    this.crcFor.delete(connId);
  }

  /**
   * The kv_file message handing room `room`'s saved state at `path` (a file in the state
   * directory named `prefillStateName`) to decode over connection `connId`. By default no
   * system call is made: `payloadBytes` is the save's own count, the message carries no CRC-32
   * (the module doc says why), and decode checks the size of the file it took (fstat) — a
   * check here would only repeat it on the handoff's critical path. With `verify` on this side,
   * or asked for by that connection's decode, or when that decode's same_host_ok did not say
   * `headerWalk` (an earlier version, which requires `crc`), the file is read once to compute
   * its CRC-32, which the message then carries.
   * @throws KvError('BAD_STATE') (verify path only) when the file's size is not `payloadBytes`; fs errors.
   */
  offer(connId: string, room: RoomId, path: string, head: Buffer, payloadBytes: number, pool: BufferPool): Extract<ControlMsg, { type: 'kv_file' }> {
    const file = path.slice(path.lastIndexOf('/') + 1);
    if (this.o.verify || this.crcFor.has(connId)) {
      const crc = new Crc32();
      readPieces(path, payloadBytes, pool, (piece) => crc.update(piece));
      return { type: 'kv_file', room, file, payloadBytes, crc: crc.value >>> 0, head: head.toString('base64') };
    }
    return { type: 'kv_file', room, file, payloadBytes, head: head.toString('base64') };
  }
}

/** Read exactly `bytes` bytes of `path` in pooled pieces, in order. @throws KvError('BAD_STATE') on another size. */
function readPieces(path: string, bytes: number, pool: BufferPool, each: (piece: Buffer) => void): void {
  const fd = openSync(path, 'r');
  try {
    readPiecesOf(fd, bytes, pool, each);
  } finally {
    closeSync(fd);
  }
}

/** `readPieces` over an open file; returns the reads it made. */
function readPiecesOf(fd: number, bytes: number, pool: BufferPool, each: (piece: Buffer) => void): number {
  const buf = pool.acquire();
  try {
    const size = fstatSync(fd).size;
    if (size !== bytes) throw new KvError('BAD_STATE', `state file is ${size} bytes, expected ${bytes}`);
    let pos = 0;
    let reads = 0;
    while (pos < bytes) {
      const n = readSync(fd, buf, 0, Math.min(buf.length, bytes - pos), pos);
      reads++;
      if (n === 0) throw new KvError('BAD_STATE', `state file ended at byte ${pos}, expected ${bytes}`);
      each(buf.subarray(0, n));
      pos += n;
    }
    return reads;
  } finally {
    pool.release(buf);
  }
}

/** Bytes read past what the header walk asks for: the next small header fields often follow (fewer preads). */
const READ_AHEAD_BYTES = 512;

/**
 * The bytes of a one-stream ggsq state of `nTokens` tokens before its first layer's K data:
 * magic, version, n_tokens, the token ids (4 bytes each), n_stream, cell_count, the cell metadata
 * (12 bytes each), v_trans, n_layer and the first K header (12 bytes).
 */
const fixedRegionBytes = (nTokens: number): number => 16 * nTokens + 40;

/**
 * `PositionalSource` over an open file: each read that the current window does not hold is one
 * pread of the asked bytes plus READ_AHEAD_BYTES, into `scratch` when it fits. The first read
 * takes at least `firstBytes` (the region every walk reads front to back, sized from the
 * envelope's token count: one pread instead of three — a hint for the read's size only, the walk
 * checks every field it reads). Counts what it read. A returned buffer is valid until the next
 * `read` (the walk consumes each before asking again).
 */
class PreadSource {
  /** The last read's bytes: `win[0, winLen)` is the file at [winPos, winPos + winLen). */
  private win: Buffer;
  private winPos = 0;
  private winLen = 0;
  /** Bytes read from the file so far, and preads made. */
  bytesRead = 0;
  reads = 0;

  constructor(
    private readonly fd: number,
    readonly size: number,
    private readonly scratch: Buffer,
    private firstBytes = 0,
  ) {
    this.win = scratch;
  }

  read(pos: number, n: number): Buffer {
    const off = pos - this.winPos;
    if (off >= 0 && off + n <= this.winLen) return this.win.subarray(off, off + n);
    const len = Math.min(this.size - pos, Math.max(n + READ_AHEAD_BYTES, Math.min(this.firstBytes, this.scratch.length)));
    this.firstBytes = 0;
    const buf = len <= this.scratch.length ? this.scratch : Buffer.allocUnsafe(len);
    let got = 0;
    while (got < len) {
      const k = readSync(this.fd, buf, got, len - got, pos + got);
      this.reads++;
      if (k === 0) break;
      got += k;
    }
    this.bytesRead += got;
    this.win = buf;
    this.winPos = pos;
    this.winLen = got;
    return buf.subarray(0, Math.min(n, got));
  }
}

// ---- decode side -------------------------------------------------------------------------------

interface Probe {
  ready: Promise<boolean>;
}

/**
 * Outcome of `SameHostDecode.take`: taken (the file is decode's now; `verified` = its data bytes
 * were CRC-checked too, `bytesRead` = what validation read of the file, in `reads` preads) or
 * refused (still prefill's: use TCP).
 */
export type TakeOutcome<S> = { taken: ReceivedState<S>; verified: boolean; bytesRead: number; reads: number } | { refused: string };

/** A taken file as the header walk reads it (structurally `PositionalSource` of engine/ggsq.ts; kv does not import engine). */
export interface HeaderSource {
  readonly size: number;
  /** Exactly `n` bytes at `pos` (fewer only at the end of the file); valid until the next read. */
  read(pos: number, n: number): Buffer;
}

/** What `take` validates a taken file with (decode passes the ggsq walks of engine/ggsq.ts). */
export interface TakeOptions<S> {
  /** What the envelope head must say (fingerprint, context settings, payload limit). */
  expect: EnvelopeExpect;
  /** The structure walk over the file's headers only (default path): `parseStateHeaders`. */
  headers: (file: HeaderSource) => S;
  /** The streamed structure walk over every byte (verify path): `GgsqStreamParser`. */
  walker: (payloadBytes: number) => StructureWalker<S>;
  /** Read buffers. */
  pool: BufferPool;
}

/**
 * Decode's half: probes each new connection once, says whether a connection carries kv_file,
 * and takes a handed file over (`take`).
 */
export class SameHostDecode {
  private readonly probes = new WeakMap<PeerConn, Probe>();
  private readonly answers = new WeakMap<PeerConn, (msg: Extract<ControlMsg, { type: 'same_host_reply' }>) => void>();
  private readonly id: HostIdentity | undefined;
  /** The state directory with a trailing separator: + a checked one-component name = join(stateDir, name). */
  private readonly dirSlash: string;

  constructor(private readonly o: SameHostOptions) {
    this.id = identityOf(o);
    this.dirSlash = join(o.stateDir, '/');
  }

  /** Whether the path is on here at all. */
  get enabled(): boolean {
    return this.o.enabled && this.id !== undefined;
  }

  /**
   * Start the probe of a freshly authenticated connection (call from onConnect). Writes the probe
   * file, sends same_host_probe; settles on the reply, on the deadline or when the connection
   * closes, then deletes the file. Never throws.
   */
  probe(conn: PeerConn): void {
    if (!this.enabled || this.probes.has(conn)) return;
    const file = `pdserve-probe-${process.pid}-${randomBytes(8).toString('hex')}.nonce`;
    const path = join(this.o.stateDir, file);
    const nonce = randomBytes(16).toString('hex');
    let settle!: (ok: boolean, why: string) => void;
    const ready = new Promise<boolean>((resolve) => {
      let done = false;
      const timer = setTimeout(() => settle(false, `no answer within ${this.o.probeMs ?? SAME_HOST_PROBE_MS} ms`), this.o.probeMs ?? SAME_HOST_PROBE_MS);
      timer.unref();
      settle = (ok, why) => {
        if (done) return;
        done = true;
        clearTimeout(timer);
        this.answers.delete(conn);
        try {
          rmSync(path, { force: true });
        } catch {
          // the sweep removes it once this process is gone
        }
        this.o.log?.info({ peer: conn.id, sameHost: ok, why }, ok ? 'kv peer is on this host: state files are handed over (kv_file)' : 'kv peer stays on TCP');
        resolve(ok);
      };
    });
    this.probes.set(conn, { ready });
    try {
      writeFileSync(path, nonce, { flag: 'wx' });
    } catch (err) {
      settle(false, `cannot write the probe file: ${(err as Error).message}`);
      return;
    }
    this.answers.set(conn, (msg) => {
      if (!msg.ok) return settle(false, msg.reason ?? 'prefill refused');
      if (msg.nonce !== nonce || !NONCE.test(nonce)) return settle(false, 'prefill read another nonce: another state directory');
      // headerWalk: this decode takes a kv_file without a CRC-32 (prefill sends one to a decode that does not say so)
      if (!conn.sendControl(this.o.verify ? { type: 'same_host_ok', verify: true, headerWalk: true } : { type: 'same_host_ok', headerWalk: true })) return settle(false, 'connection closed');
      settle(true, 'boot id, pid namespace and state directory match');
    });
    void conn.closed.then(() => settle(false, 'connection closed'));
    if (!conn.sendControl({ type: 'same_host_probe', boot: this.id!.boot, pidns: this.id!.pidns, file })) settle(false, 'connection closed');
  }

  /** A same_host_reply arrived on `conn`. */
  onReply(conn: PeerConn, msg: Extract<ControlMsg, { type: 'same_host_reply' }>): void {
    this.answers.get(conn)?.(msg);
  }

  /**
   * True when `conn` carries kv_file: waits for its probe (at most the probe deadline). A
   * connection never probed (path off) resolves false at once.
   */
  ready(conn: PeerConn): Promise<boolean> {
    return this.probes.get(conn)?.ready ?? Promise.resolve(false);
  }

  /**
   * Take over the file a kv_file names, then validate it before llama.cpp sees it.
   * Refused (the file stays prefill's; send kv_file_refused, prefill sends over TCP): a name that
   * is not prefill's name for this room, the file missing or of another size, the rename failing,
   * or this side running `verify` while the kv_file carries no CRC-32.
   * Taken: the file now has decode's name (`decodeStateName`) — the caller deletes it after the
   * load, as a received one. Validation: the envelope head (`parseEnvelopeHead`, before taking);
   * the size again (fstat, ours now); then either the header walk (`o.headers`, positional
   * reads of the ggsq headers, seeking over the KV data — the default) or, with verify on here
   * or a CRC-32 in the message, one read of the whole file through `o.walker` and the CRC-32.
   *
   * Synchronous, on purpose: every fs call here is a synchronous syscall on the event loop, not
   * a round trip through libuv's thread pool (which costs a wake-up of a pool thread and one
   * of the loop per call — with ~20 calls that would be the take's whole cost, as sender.ts and
   * receiver.ts found for their reads and writes). What the loop is
   * blocked for is bounded by the state's shape, not its size: lstat, rename, open, fstat,
   * close, and the header walk's preads — one for everything before layer 0's K data (sized
   * from the envelope's token count: the fixed fields, 4 bytes a token of ids, 12 a cell of
   * metadata, the first K header), then one per other K and V header (12 bytes; each read takes
   * 512 bytes more, which holds the next header when a layer's data is small) — so 2 × n_layer
   * preads for a one-sequence state, reading ≤ 16 bytes a token + 0.5 KiB a read (bench §1: 16
   * preads of 12 KiB for a 4 MiB state of the 8-layer small model). Of the take's time in a
   * process just woken up (bench §1 "decode take"), about a third is the envelope head (base64,
   * SHA-256, JSON), a fifth the path syscalls, the rest the walk, its JS more than its preads. On the state directory's intended tmpfs (/dev/shm, the
   * default) each pread is a memory copy. On a disk-backed state directory the file was written
   * by prefill's saveState a moment before, so its pages are normally still in the page cache
   * and the reads stay memory copies; only pages evicted under memory pressure would make each
   * of those ~20 reads a disk read while the loop waits (the TCP path's receiver already writes
   * its files synchronously, so such a directory costs both paths alike; use tmpfs).
   * @throws KvError('BAD_ENVELOPE' | 'BAD_STATE') (or the walk's PdError('BAD_STATE')) when the
   *   head or the file is bad (the taken file is deleted before the throw).
   */
  take<S>(msg: Extract<ControlMsg, { type: 'kv_file' }>, o: TakeOptions<S>): TakeOutcome<S> {
    const head = Buffer.from(msg.head, 'base64');
    const h = parseEnvelopeHead(head, o.expect);
    if (!h || h.headBytes !== head.length) throw new KvError('BAD_ENVELOPE', 'kv_file: the envelope head is incomplete or has trailing bytes');
    if (h.header.payloadBytes !== msg.payloadBytes) throw new KvError('BAD_ENVELOPE', `kv_file names ${msg.payloadBytes} bytes, the envelope says ${h.header.payloadBytes}`);
    const m = /^pdserve-prefill-\d+-(\d+)\.ggsq$/.exec(msg.file);
    if (!m || m[1] !== msg.room) return { refused: `kv_file name ${JSON.stringify(msg.file.slice(0, 80))} is not a prefill state file of room ${msg.room}` };
    if (this.o.verify && msg.crc === undefined) return { refused: 'decode runs --kv-same-host-verify and the kv_file carries no CRC-32' };
    const src = this.dirSlash + msg.file; // one component (the pattern above)
    try {
      const st = lstatSync(src);
      if (!st.isFile()) return { refused: 'the named state file is not a regular file' };
      if (st.size !== msg.payloadBytes) return { refused: `the state file is ${st.size} bytes, kv_file says ${msg.payloadBytes}` };
    } catch (err) {
      return { refused: `the state file is not in decode's state directory (${(err as NodeJS.ErrnoException).code ?? 'error'})` };
    }
    const dst = this.dirSlash + decodeStateName(process.pid, msg.room);
    try {
      renameSync(src, dst); // ownership moves here, atomically
    } catch (err) {
      return { refused: `could not take the state file over (${(err as NodeJS.ErrnoException).code ?? 'error'}): prefill may have dropped it` };
    }
    try {
      const fd = openSync(dst, 'r');
      try {
        const size = fstatSync(fd).size;
        if (size !== msg.payloadBytes) throw new KvError('BAD_STATE', `the taken state file is ${size} bytes, kv_file says ${msg.payloadBytes}`);
        if (msg.crc !== undefined) {
          const walker = o.walker(msg.payloadBytes);
          const crc = new Crc32();
          const reads = readPiecesOf(fd, msg.payloadBytes, o.pool, (piece) => {
            crc.update(piece);
            walker.push(piece);
          });
          const state = walker.end();
          if (crc.value >>> 0 !== msg.crc) throw new KvError('BAD_ENVELOPE', 'payload checksum mismatch: the handed state file is corrupted');
          return { taken: { header: h.header, state, path: dst }, verified: true, bytesRead: size, reads };
        }
        const scratch = o.pool.acquire();
        try {
          const file = new PreadSource(fd, size, scratch, fixedRegionBytes(h.header.nTokens) + READ_AHEAD_BYTES);
          const state = o.headers(file);
          return { taken: { header: h.header, state, path: dst }, verified: false, bytesRead: file.bytesRead, reads: file.reads };
        } finally {
          o.pool.release(scratch);
        }
      } finally {
        closeSync(fd);
      }
    } catch (err) {
      rmSync(dst, { force: true });
      throw err;
    }
  }
}
