/**
 * The same-host handoff's parts (src/kv/transfer/same-host.ts) on real loopback KV channels with
 * real files and a real state saved by the real engine (tiny model): the per-connection probe
 * (boot id, pid namespace, nonce file in the shared state directory) and every way it falls back
 * to TCP, and how it carries --kv-same-host-verify; taking a handed file over (rename =
 * ownership), refusing it while it is still prefill's, and validating it before anything could
 * load it — size, envelope head and ggsq structure (headers only) by default, the data's CRC-32
 * too with verify; a decode of the previous version (no `headerWalk` in same_host_ok) gets the
 * CRC-32 it requires.
 */
import assert from 'node:assert/strict';
import { existsSync, linkSync, lstatSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { PdError } from '../../src/base/errors.js';
import { normalizeRoomId } from '../../src/kv/frame.js';
import { GgsqStreamParser, parseStateFile, parseStateHeaders } from '../../src/engine/ggsq.js';
import { newEpoch } from '../../src/kv/auth.js';
import { KvPeerPool, KvServer, type PeerConn } from '../../src/kv/channel.js';
import { encodeEnvelopeHead, type EnvelopeExpect } from '../../src/kv/envelope.js';
import { BufferPool } from '../../src/kv/transfer/pool.js';
import { decodeStateName, hostIdentity, prefillStateName, SameHostDecode, SameHostPrefill, type HostIdentity } from '../../src/kv/transfer/same-host.js';
import { saveTinyState } from '../helpers/engine.js';

const CTX = 256;
const PAIR = { fingerprint: 'ab'.repeat(32), contextSize: CTX, batchSize: 64, flashAttention: true };
const FP = 'f'.repeat(64);
const EXPECT: EnvelopeExpect = { fingerprint: FP, contextSize: CTX, batchSize: 64, maxPayloadBytes: 1 << 24 };
const root = mkdtempSync(path.join(os.tmpdir(), 'pdserve-samehost-test-'));
const shared = path.join(root, 'shared');
const other = path.join(root, 'other');
let state: Buffer;
let nTokens = 0;
const ID = hostIdentity();

before(async () => {
  for (const d of [shared, other]) rmSync(d, { recursive: true, force: true });
  await import('node:fs/promises').then((f) => Promise.all([f.mkdir(shared), f.mkdir(other)]));
  ({ state, nTokens } = await saveTinyState(root, CTX));
});
after(() => rmSync(root, { recursive: true, force: true }));

/** A real channel pair whose two ends run the same-host probe with these options; resolves with decode's verdict. */
async function probePair(p: { enabled?: boolean; dir?: string; identity?: HostIdentity | null; verify?: boolean }, d: { enabled?: boolean; dir?: string; identity?: HostIdentity | null; verify?: boolean; legacy?: boolean }) {
  const secret = 'same-host-test-secret';
  const pre = new SameHostPrefill({ enabled: p.enabled ?? true, stateDir: p.dir ?? shared, identity: p.identity, verify: p.verify });
  const dec = new SameHostDecode({ enabled: d.enabled ?? true, stateDir: d.dir ?? shared, identity: d.identity, probeMs: 2000, verify: d.verify });
  let serverConn: PeerConn | undefined;
  const server = new KvServer({
    host: '127.0.0.1',
    port: 0,
    secret,
    epoch: newEpoch(),
    settings: PAIR,
    onConnect: (c) => void (serverConn = c),
    onMessage: (c, msg) => {
      if (msg.type === 'same_host_probe' || msg.type === 'same_host_ok') {
        const r = pre.onMessage(c.id, msg);
        if (r) c.sendControl(r);
      }
    },
  });
  const port = await server.listen();
  /** legacy: decode of the version before `headerWalk` — its same_host_ok says only {verify?}. */
  const legacy = (c: PeerConn) => {
    const send = c.sendControl.bind(c);
    c.sendControl = (m) => send(m.type === 'same_host_ok' ? { type: 'same_host_ok', ...(m.verify ? { verify: true } : {}) } : m);
  };
  const pool = new KvPeerPool({ secret, epoch: newEpoch(), settings: PAIR, onConnect: (c) => (d.legacy && legacy(c), dec.probe(c)), onMessage: (c, msg) => msg.type === 'same_host_reply' && dec.onReply(c, msg) });
  try {
    const conn = await pool.get('127.0.0.1', port);
    const ok = await dec.ready(conn);
    // prefill sees same_host_ok before anything decode sends later (one FIFO connection)
    await new Promise((r) => setTimeout(r, 50));
    // what prefill would send this connection: a kv_file with a CRC-32 only when verify is on for it
    let offersCrc: boolean | undefined;
    if (ok && serverConn) {
      const f = path.join(shared, prefillStateName(4242, normalizeRoomId(99)));
      writeFileSync(f, state);
      offersCrc = pre.offer(serverConn.id, normalizeRoomId(99), f, Buffer.from('head'), state.length, new BufferPool(4096, 1)).crc !== undefined;
      rmSync(f);
    }
    return { ok, prefillUsable: serverConn ? pre.usable(serverConn.id) : false, leftovers: readdirSync(d.dir ?? shared).filter((n) => n.endsWith('.nonce')), offersCrc };
  } finally {
    await pool.close();
    await server.close();
  }
}

describe('same-host probe (real channel, real files)', { skip: ID === undefined ? 'LOUD SKIP: this host has no /proc boot id — the same-host path is off here' : false }, () => {
  it('one host, one state directory: both sides agree on kv_file; the probe file is gone', async () => {
    const r = await probePair({}, {});
    assert.equal(r.ok, true);
    assert.equal(r.prefillUsable, true);
    assert.deepEqual(r.leftovers, []);
    assert.equal(r.offersCrc, false, 'by default kv_file carries no CRC-32 (prefill does not read the file)');
  });

  it('--kv-same-host-verify on decode (asked for in same_host_ok) or on prefill: kv_file carries the CRC-32', async () => {
    assert.equal((await probePair({}, { verify: true })).offersCrc, true);
    assert.equal((await probePair({ verify: true }, {})).offersCrc, true);
  });

  it('a decode of the previous version (same_host_ok without headerWalk; its kv_file schema requires crc): kv_file carries the CRC-32', async () => {
    const r = await probePair({}, { legacy: true });
    assert.deepEqual([r.ok, r.prefillUsable], [true, true], 'the path stays on for it');
    assert.equal(r.offersCrc, true);
    assert.equal((await probePair({}, { legacy: true, verify: true })).offersCrc, true);
  });

  it('another state directory: the nonce is not found, both stay on TCP', async () => {
    const r = await probePair({ dir: other }, {});
    assert.deepEqual([r.ok, r.prefillUsable, r.leftovers], [false, false, []]);
  });

  it('another boot id or another pid namespace: TCP', async () => {
    for (const identity of [{ ...ID!, boot: 'another-boot' }, { ...ID!, pidns: 'pid:[1]' }]) {
      const r = await probePair({ identity }, {});
      assert.deepEqual([r.ok, r.prefillUsable], [false, false]);
    }
  });

  it('the flag off on prefill, or on decode (no probe at all): TCP', async () => {
    assert.deepEqual(Object.values(await probePair({ enabled: false }, {})).slice(0, 2), [false, false]);
    assert.deepEqual(Object.values(await probePair({}, { enabled: false })).slice(0, 2), [false, false]);
  });
});

describe('taking a handed file over', () => {
  const pool = new BufferPool(4096, 4);
  const id = ID ?? { boot: 'b', pidns: 'p' };
  const pre = new SameHostPrefill({ enabled: true, stateDir: shared, identity: id });
  const preVerify = new SameHostPrefill({ enabled: true, stateDir: shared, identity: id, verify: true });
  const dec = new SameHostDecode({ enabled: true, stateDir: shared, identity: id });
  const decVerify = new SameHostDecode({ enabled: true, stateDir: shared, identity: id, verify: true });
  const opts = {
    expect: EXPECT,
    headers: (f: { size: number; read(pos: number, n: number): Buffer }) => parseStateHeaders(f, { contextSize: CTX, nLayer: 2 }),
    walker: (n: number) => new GgsqStreamParser({ contextSize: CTX, nLayer: 2, maxBytes: n }),
    pool,
  };
  let seq = 100;
  /**
   * Prefill's side: the (possibly damaged) payload saved under prefill's name, and its kv_file
   * (with a CRC-32 when `verify`; `crcOf`: the bytes prefill saw before the damage).
   */
  const handed = (payload: Buffer, o: { claim?: number; crcOf?: Buffer; verify?: boolean } = {}) => {
    const room = normalizeRoomId(seq++);
    const p = path.join(shared, prefillStateName(4242, room));
    writeFileSync(p, o.crcOf ?? payload);
    const head = encodeEnvelopeHead({ fingerprint: FP, contextSize: CTX, batchSize: 64, nTokens, firstToken: 1, firstIsEog: false, payloadBytes: o.claim ?? payload.length });
    const msg = (o.verify ? preVerify : pre).offer('conn', room, p, head, (o.crcOf ?? payload).length, pool);
    if (o.crcOf) writeFileSync(p, payload); // damaged after prefill offered it
    return { room, p, msg: { ...msg, payloadBytes: o.claim ?? payload.length } };
  };
  const isBad = (re: RegExp) => (e: unknown) => {
    assert.ok(e instanceof PdError && (e.code === 'BAD_ENVELOPE' || e.code === 'BAD_STATE'), `BAD_ENVELOPE / BAD_STATE, got ${String(e)}`);
    assert.match((e as Error).message, re);
    return true;
  };
  const decodeName = (room: string) => path.join(shared, decodeStateName(process.pid, room as never));
  const st0 = () => parseStateFile(state, { contextSize: CTX, nLayer: 2, maxBytes: state.length });

  it('a good file is renamed to decode (ownership) and validated from its headers only: the full parse\'s result, the data not read', () => {
    const { p, msg, room } = handed(state);
    assert.equal(msg.crc, undefined, 'prefill did not read the file');
    const out = dec.take(msg, opts);
    assert.ok('taken' in out);
    assert.equal(out.taken.state.nTokens, nTokens);
    assert.deepEqual(out.taken.state, st0());
    assert.equal(out.verified, false);
    assert.ok(out.bytesRead < state.length / 2, `read ${out.bytesRead} of ${state.length} bytes`);
    // one pread for everything before layer 0's K data (sized from the envelope's token count), then one per other K / V header
    assert.equal(out.reads, 2 * 2, `${nTokens} tokens, 2 layers: ${out.reads} preads`);
    assert.equal(out.taken.path, decodeName(room));
    assert.equal(existsSync(p), false, "prefill's name is gone: its delete at finish finds nothing");
    assert.deepEqual(readFileSync(out.taken.path), state);
    rmSync(out.taken.path);
  });

  it('a cut file that claims to be complete: the header walk refuses it before any load; the taken file is deleted', () => {
    for (const cut of [state.subarray(0, state.length - 100), state.subarray(0, state.length - 1), state.subarray(0, 200)]) {
      const { msg, room } = handed(cut);
      assert.throws(() => dec.take(msg, opts), isBad(/truncated|goes past the limit/), `cut to ${cut.length}`);
      assert.equal(existsSync(decodeName(room)), false);
    }
  });

  it('a damaged structure header (n_stream, cell_count, the LAST layer\'s V row size — reached only by seeking): BAD_STATE, the file deleted', () => {
    const st = st0();
    const s0 = st.streams.find((x) => x.cellCount > 0)!;
    const lastV = s0.v![s0.v!.length - 1]!;
    const cases: [string, (b: Buffer) => void, RegExp][] = [
      ['n_stream', (b) => b.writeUInt32LE(999, st.nStreamOffset), /n_stream 999/],
      ['cell_count', (b) => b.writeUInt32LE(s0.cellCount + 7, s0.start), /cell|past the limit|truncated/],
      ['last V row_size', (b) => b.writeBigUInt64LE(BigInt(lastV.bytesPerCell + 2), lastV.dataOffset - 8), /past the limit|truncated|trailing/],
      ['last V type', (b) => b.writeInt32LE(-3, lastV.dataOffset - 12), /V type -3/],
    ];
    for (const [name, f, re] of cases) {
      const b = Buffer.from(state);
      f(b);
      const { msg, room } = handed(b);
      assert.throws(() => dec.take(msg, opts), isBad(re), name);
      assert.equal(existsSync(decodeName(room)), false, name);
    }
  });

  it('a damaged envelope head (a flipped byte; another model): the room fails before taking, the file stays prefill\'s', () => {
    const a = handed(state);
    const head = Buffer.from(a.msg.head, 'base64');
    head[head.length - 3] ^= 0x10;
    assert.throws(() => dec.take({ ...a.msg, head: head.toString('base64') }, opts), isBad(/digest|envelope|incomplete/));
    assert.ok(existsSync(a.p));
    rmSync(a.p);
    const b = handed(state);
    const other = encodeEnvelopeHead({ fingerprint: 'e'.repeat(64), contextSize: CTX, batchSize: 64, nTokens, firstToken: 1, firstIsEog: false, payloadBytes: state.length });
    assert.throws(() => dec.take({ ...b.msg, head: other.toString('base64') }, opts), isBad(/different model/));
    assert.ok(existsSync(b.p), 'refused before taking: the file is still prefill\'s');
    rmSync(b.p);
  });

  it('a flipped data byte: loads by default (nothing reads the data: the documented trade); with verify the CRC-32 catches it', () => {
    const bad = Buffer.from(state);
    bad[bad.length - 10]! ^= 0xff;
    const a = handed(bad, { crcOf: state });
    const out = dec.take(a.msg, opts);
    assert.ok('taken' in out && out.verified === false, 'default: structure fine, data not checked');
    rmSync(out.taken.path);
    // verify on prefill (kv_file carries the CRC-32): decode checks it whatever its own flag
    const b = handed(bad, { crcOf: state, verify: true });
    assert.equal(typeof b.msg.crc, 'number');
    assert.throws(() => dec.take(b.msg, opts), isBad(/checksum mismatch/));
    assert.equal(existsSync(b.p), false);
    assert.equal(existsSync(decodeName(b.room)), false, 'the taken file is deleted');
    // verify on decode too: same
    const c = handed(bad, { crcOf: state, verify: true });
    assert.throws(() => decVerify.take(c.msg, opts), isBad(/checksum mismatch/));
    assert.equal(existsSync(decodeName(c.room)), false);
    // and an intact file passes the verified path, read whole
    const d = handed(state, { verify: true });
    const ok = decVerify.take(d.msg, opts);
    assert.ok('taken' in ok && ok.verified && ok.bytesRead === state.length);
    assert.deepEqual(ok.taken.state, st0());
    rmSync(ok.taken.path);
  });

  it('verify on decode but a kv_file without CRC-32: refused (still prefill\'s: it goes over TCP, which has one)', () => {
    const a = handed(state);
    const r = decVerify.take(a.msg, opts);
    assert.ok('refused' in r && /verify/.test(r.refused));
    assert.ok(existsSync(a.p));
    rmSync(a.p);
  });

  it('missing, another size, or another room name: refused (still prefill\'s, send over TCP)', () => {
    const a = handed(state);
    rmSync(a.p); // prefill dropped it (deadline) before decode took it
    const ra = dec.take(a.msg, opts);
    assert.ok('refused' in ra && /not in decode's state directory/.test(ra.refused));
    const b = handed(state);
    writeFileSync(b.p, state.subarray(0, 1000));
    const rb = dec.take({ ...b.msg }, opts);
    assert.ok('refused' in rb && /1000 bytes/.test(rb.refused));
    assert.ok(existsSync(b.p), 'a refused file stays with prefill');
    rmSync(b.p);
    const c = handed(state);
    const rc = dec.take({ ...c.msg, room: normalizeRoomId(7) }, opts);
    assert.ok('refused' in rc);
    rmSync(c.p);
  });

  it('prefill\'s offer touches no file (decode checks the size it took): a file of another size is refused by decode and stays prefill\'s; with verify the offer reads it and throws', () => {
    const room = normalizeRoomId(seq++);
    const p = path.join(shared, prefillStateName(4242, room));
    writeFileSync(p, state.subarray(0, 10));
    const head = encodeEnvelopeHead({ fingerprint: FP, contextSize: CTX, batchSize: 64, nTokens, firstToken: 1, firstIsEog: false, payloadBytes: state.length });
    const msg = pre.offer('conn', room, p, head, state.length, pool);
    assert.equal(msg.payloadBytes, state.length, "the save's own count");
    const r = dec.take(msg, opts);
    assert.ok('refused' in r && /10 bytes/.test(r.refused));
    assert.ok(existsSync(p), 'a refused file stays with prefill');
    assert.throws(() => preVerify.offer('conn', room, p, head, state.length, pool), isBad(/10 bytes/));
    rmSync(p);
  });

  it('a name prefill does not own (decode\'s own files, another directory, a symlink or a directory under prefill\'s name): refused, nothing renamed or deleted', () => {
    const { msg, p, room } = handed(state);
    // decode's own names, and names that leave the state directory
    const mine = path.join(shared, decodeStateName(process.pid, normalizeRoomId(5)));
    const recv = path.join(shared, `pdserve-kvrecv-${process.pid}-0.ggsq`);
    const outside = path.join(other, prefillStateName(4242, room));
    for (const f of [mine, recv, outside]) writeFileSync(f, state);
    for (const file of [path.basename(mine), path.basename(recv), `../other/${prefillStateName(4242, room)}`, `pdserve-prefill-4242-${room}.ggsq/`, `x/${path.basename(p)}`]) {
      const r = dec.take({ ...msg, file }, opts);
      assert.ok('refused' in r && /is not a prefill state file of room/.test(r.refused), file);
    }
    for (const f of [mine, recv, outside, p]) assert.deepEqual(readFileSync(f), state, `${f} untouched`);
    rmSync(p);
    // prefill's name for the room, but a symlink to a file prefill does not own (decode's): not a regular file
    symlinkSync(mine, p);
    const rs = dec.take(msg, opts);
    assert.ok('refused' in rs && /not a regular file/.test(rs.refused));
    assert.ok(lstatSync(p).isSymbolicLink() && existsSync(mine), 'neither the link nor its target was taken');
    rmSync(p);
    // a directory under prefill's name
    mkdirSync(p);
    const rd = dec.take(msg, opts);
    assert.ok('refused' in rd && /not a regular file/.test(rd.refused));
    rmSync(p, { recursive: true });
    for (const f of [mine, recv, outside]) rmSync(f);
    assert.equal(existsSync(decodeName(room)), false, 'nothing was taken for the room');
  });

  it('n > 1: one hard link per room, each taken and deleted once, the data shared', () => {
    const { p, msg } = handed(state);
    const room2 = normalizeRoomId(seq++);
    const p2 = path.join(shared, prefillStateName(4242, room2));
    linkSync(p, p2);
    const a = dec.take(msg, opts);
    const b = dec.take({ ...msg, room: room2, file: path.basename(p2) }, opts);
    assert.ok('taken' in a && 'taken' in b);
    rmSync(a.taken.path);
    assert.deepEqual(readFileSync(b.taken.path), state, 'deleting one link leaves the other room\'s file');
    rmSync(b.taken.path);
    assert.deepEqual(readdirSync(shared), []);
  });
});
