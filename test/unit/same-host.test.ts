/**
 * The same-host handoff's parts (src/kv/transfer/same-host.ts) on real loopback KV channels with
 * real files and a real state saved by the real engine (tiny model): the per-connection probe
 * (boot id, pid namespace, nonce file in the shared state directory) and every way it falls back
 * to TCP; taking a handed file over (rename = ownership), refusing it while it is still
 * prefill's, and validating it before anything could load it.
 */
import assert from 'node:assert/strict';
import { existsSync, linkSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { PdError } from '../../src/common/errors.js';
import { normalizeRoomId } from '../../src/kv/frame.js';
import { GgsqStreamParser } from '../../src/engine/ggsq.js';
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
async function probePair(p: { enabled?: boolean; dir?: string; identity?: HostIdentity | null }, d: { enabled?: boolean; dir?: string; identity?: HostIdentity | null }) {
  const secret = 'same-host-test-secret';
  const pre = new SameHostPrefill({ enabled: p.enabled ?? true, stateDir: p.dir ?? shared, identity: p.identity });
  const dec = new SameHostDecode({ enabled: d.enabled ?? true, stateDir: d.dir ?? shared, identity: d.identity, probeMs: 2000 });
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
  const pool = new KvPeerPool({ secret, epoch: newEpoch(), settings: PAIR, onConnect: (c) => dec.probe(c), onMessage: (c, msg) => msg.type === 'same_host_reply' && dec.onReply(c, msg) });
  try {
    const conn = await pool.get('127.0.0.1', port);
    const ok = await dec.ready(conn);
    // prefill sees same_host_ok before anything decode sends later (one FIFO connection)
    await new Promise((r) => setTimeout(r, 50));
    return { ok, prefillUsable: serverConn ? pre.usable(serverConn.id) : false, leftovers: readdirSync(d.dir ?? shared).filter((n) => n.endsWith('.nonce')) };
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
  const pre = new SameHostPrefill({ enabled: true, stateDir: shared, identity: ID ?? { boot: 'b', pidns: 'p' } });
  const dec = new SameHostDecode({ enabled: true, stateDir: shared, identity: ID ?? { boot: 'b', pidns: 'p' } });
  const walker = (n: number) => new GgsqStreamParser({ contextSize: CTX, nLayer: 2, maxBytes: n });
  let seq = 100;
  /** Prefill's side: the (possibly damaged) payload saved under prefill's name, and its kv_file. */
  const handed = (payload: Buffer, o: { claim?: number; crcOf?: Buffer } = {}) => {
    const room = normalizeRoomId(seq++);
    const p = path.join(shared, prefillStateName(4242, room));
    writeFileSync(p, o.crcOf ?? payload);
    const head = encodeEnvelopeHead({ fingerprint: FP, contextSize: CTX, batchSize: 64, nTokens, firstToken: 1, firstIsEog: false, payloadBytes: o.claim ?? payload.length });
    const msg = pre.offer(room, p, head, (o.crcOf ?? payload).length, pool);
    if (o.crcOf) writeFileSync(p, payload); // damaged after prefill computed the CRC
    return { room, p, msg: { ...msg, payloadBytes: o.claim ?? payload.length } };
  };
  const isBad = (re: RegExp) => (e: unknown) => {
    assert.ok(e instanceof PdError && (e.code === 'BAD_ENVELOPE' || e.code === 'BAD_STATE'), `BAD_ENVELOPE / BAD_STATE, got ${String(e)}`);
    assert.match((e as Error).message, re);
    return true;
  };

  it('a good file is renamed to decode (ownership), validated, and parses to the prompt', () => {
    const { p, msg, room } = handed(state);
    const out = dec.take(msg, { expect: EXPECT, walker, pool });
    assert.ok('taken' in out);
    assert.equal(out.taken.state.nTokens, nTokens);
    assert.equal(out.taken.path, path.join(shared, decodeStateName(process.pid, room)));
    assert.equal(existsSync(p), false, "prefill's name is gone: its delete at finish finds nothing");
    assert.deepEqual(readFileSync(out.taken.path), state);
    rmSync(out.taken.path);
  });

  it('a flipped byte: checksum mismatch, the taken file is deleted', () => {
    const bad = Buffer.from(state);
    bad[bad.length - 10]! ^= 0xff;
    const { p, msg, room } = handed(bad, { crcOf: state });
    assert.throws(() => dec.take(msg, { expect: EXPECT, walker, pool }), isBad(/checksum mismatch/));
    assert.equal(existsSync(p), false);
    assert.equal(existsSync(path.join(shared, decodeStateName(process.pid, room))), false);
  });

  it('a cut file that claims to be complete: the structure walk refuses it before any load', () => {
    const cut = state.subarray(0, state.length - 100);
    const { msg, room } = handed(cut);
    assert.throws(() => dec.take(msg, { expect: EXPECT, walker, pool }), isBad(/truncated|goes past the limit/));
    assert.equal(existsSync(path.join(shared, decodeStateName(process.pid, room))), false);
  });

  it('missing, another size, or another room name: refused (still prefill\'s, send over TCP)', () => {
    const a = handed(state);
    rmSync(a.p); // prefill dropped it (deadline) before decode took it
    const ra = dec.take(a.msg, { expect: EXPECT, walker, pool });
    assert.ok('refused' in ra && /not in decode's state directory/.test(ra.refused));
    const b = handed(state);
    writeFileSync(b.p, state.subarray(0, 1000));
    const rb = dec.take({ ...b.msg }, { expect: EXPECT, walker, pool });
    assert.ok('refused' in rb && /1000 bytes/.test(rb.refused));
    assert.ok(existsSync(b.p), 'a refused file stays with prefill');
    rmSync(b.p);
    const c = handed(state);
    const rc = dec.take({ ...c.msg, room: normalizeRoomId(7) }, { expect: EXPECT, walker, pool });
    assert.ok('refused' in rc);
    rmSync(c.p);
  });

  it('a head from another model fails the room (as on TCP)', () => {
    const { p, msg } = handed(state);
    const head = encodeEnvelopeHead({ fingerprint: 'e'.repeat(64), contextSize: CTX, batchSize: 64, nTokens, firstToken: 1, firstIsEog: false, payloadBytes: state.length });
    assert.throws(() => dec.take({ ...msg, head: head.toString('base64') }, { expect: EXPECT, walker, pool }), isBad(/different model/));
    assert.ok(existsSync(p), 'refused before taking: the file is still prefill\'s');
    rmSync(p);
  });

  it('n > 1: one hard link per room, each taken and deleted once, the data shared', () => {
    const { p, msg } = handed(state);
    const room2 = normalizeRoomId(seq++);
    const p2 = path.join(shared, prefillStateName(4242, room2));
    linkSync(p, p2);
    const a = dec.take(msg, { expect: EXPECT, walker, pool });
    const b = dec.take({ ...msg, room: room2, file: path.basename(p2) }, { expect: EXPECT, walker, pool });
    assert.ok('taken' in a && 'taken' in b);
    rmSync(a.taken.path);
    assert.deepEqual(readFileSync(b.taken.path), state, 'deleting one link leaves the other room\'s file');
    rmSync(b.taken.path);
    assert.deepEqual(readdirSync(shared), []);
  });
});
