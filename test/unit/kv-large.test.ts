/**
 * A 1 GiB handoff on both paths (long test: PDSERVE_LONG_TESTS=1). The state is synthetic but
 * structurally complete (ggsq v3, 128 layers × 1 KiB rows × 4096 cells: the generated 'wide'
 * model's shape, 256 KiB per token): over TCP it goes through a real KV connection with the KV
 * I/O thread on both ends (file read + CRC-32 on one, CRC-32 + file write on the other, the
 * socket paused while the receiver's slots are busy) and arrives byte-identical; on the same-host
 * path the same state is handed over by name and validated from its headers. Nothing is left:
 * slots, descriptors, files. (BENCHMARKS §1's large-state run does the same with real states
 * and llama.cpp's save and load, timed.) The decode side's limit is the one a worker started
 * with `--max-state-bytes 1536M` has: the default (512 MiB) refuses a 1 GiB state.
 */
import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { DecodeConfigSchema, DEFAULT_MAX_STATE_BYTES, parseConfig, parseStateBytes, PrefillConfigSchema } from '../../src/config/config.js';
import { checkAnnounced } from '../../src/decode/receive.js';
import { GgsqStreamParser, parseStateHeaders } from '../../src/engine/ggsq.js';
import { newEpoch } from '../../src/kv/auth.js';
import { KvPeerPool, KvServer, type PeerConn } from '../../src/kv/channel.js';
import { encodeEnvelopeHead } from '../../src/kv/envelope.js';
import { normalizeRoomId } from '../../src/kv/frame.js';
import { crc32 } from '../../src/kv/transfer/checksum.js';
import { KvIo } from '../../src/kv/transfer/io-thread.js';
import { BufferPool, FilePool } from '../../src/kv/transfer/pool.js';
import { StateReceiver } from '../../src/kv/transfer/receiver.js';
import { prefillStateName, SameHostDecode, SameHostPrefill } from '../../src/kv/transfer/same-host.js';
import { sendStateFile, wireBytes } from '../../src/kv/transfer/sender.js';
import { synthState } from '../helpers/ggsq-synth.js';

const LONG = process.env.PDSERVE_LONG_TESTS === '1';
const CTX = 4352;
const N_LAYER = 128;
const TOKENS = 4096;
const FP = 'f'.repeat(64);
const PAIR = { fingerprint: 'ab'.repeat(32), contextSize: CTX, batchSize: 512, flashAttention: true };
const dir = mkdtempSync(path.join('/dev/shm', 'pdserve-kv-large-test-'));
after(() => rmSync(dir, { recursive: true, force: true }));

/** A decode worker's config as `pdserve decode --max-state-bytes <flag>` builds it (no flag: the default). */
const decodeConfig = (flag?: string) => parseConfig(DecodeConfigSchema, { secret: 'kv-large-test-secret', engine: { modelPath: 'm.gguf' }, ...(flag ? { maxStateBytes: parseStateBytes(flag) } : {}) });

describe('--max-state-bytes', () => {
  it('parses byte counts and binary suffixes, refuses the rest and anything outside 1M..16G', () => {
    assert.equal(parseStateBytes('1073741824'), 2 ** 30);
    assert.equal(parseStateBytes('1G'), 2 ** 30);
    assert.equal(parseStateBytes('1536M'), 1.5 * 2 ** 30);
    assert.equal(parseStateBytes('1.5GiB'), 1.5 * 2 ** 30);
    assert.equal(parseStateBytes('2048k'), 2 ** 21);
    for (const bad of ['', 'lots', '-1G', '1T', '1e9', '512K', '17G', '0']) assert.throws(() => parseStateBytes(bad), RangeError, bad);
  });

  it('the schema keeps the bound for configs not built from the flag, on both roles', () => {
    for (const schema of [DecodeConfigSchema, PrefillConfigSchema]) {
      assert.throws(() => parseConfig(schema, { secret: 'kv-large-test-secret', engine: { modelPath: 'm.gguf' }, maxStateBytes: 17 * 2 ** 30 }), /maxStateBytes/);
      assert.throws(() => parseConfig(schema, { secret: 'kv-large-test-secret', engine: { modelPath: 'm.gguf' }, maxStateBytes: 1000 }), /maxStateBytes/);
    }
  });

  it('a 1 GiB state is refused by default and accepted with --max-state-bytes 1536M (decode\'s announce rule)', () => {
    const gib = 2 ** 30 + 4096;
    assert.equal(decodeConfig().maxStateBytes, DEFAULT_MAX_STATE_BYTES);
    assert.equal(checkAnnounced(gib, decodeConfig().maxStateBytes)?.code, 'kv_state_too_large');
    assert.match(checkAnnounced(gib, decodeConfig().maxStateBytes)?.detail ?? '', /over this decode worker's limit of 536870912 bytes \(512 MiB\) \(decode --max-state-bytes\)/);
    assert.equal(checkAnnounced(gib, decodeConfig('1536M').maxStateBytes), undefined);
  });
});

describe('a 1 GiB handoff', { skip: !LONG && 'long test: set PDSERVE_LONG_TESTS=1' }, () => {
  const maxStateBytes = decodeConfig('1536M').maxStateBytes;
  const expect = { fingerprint: FP, contextSize: CTX, batchSize: 512, maxPayloadBytes: maxStateBytes };
  const walker = (n: number) => new GgsqStreamParser({ contextSize: CTX, nLayer: N_LAYER, maxBytes: n });
  let state: Buffer;
  let want = 0;
  before(() => {
    state = synthState(Array.from({ length: TOKENS }, (_, i) => (i * 7) % 250), { nLayer: N_LAYER, rowBytes: 1024, fill: 0x5a });
    // different KV bytes along the file (the structure's headers untouched), so a piece written
    // at the wrong offset cannot go unnoticed: 2 × N_LAYER rows of (12-byte header, 1 KiB × cells)
    const meta = 12 + 4 * TOKENS + 8 + 12 * TOKENS + 8;
    const rowSpan = 12 + 1024 * TOKENS;
    for (let r = 0; r < 2 * N_LAYER; r++) for (let k = 0; k < 1024 * TOKENS; k += 4093) state[meta + r * rowSpan + 12 + k] = (r + (k >>> 12)) & 0xff;
    want = crc32(state);
  });
  const head = (payloadBytes: number) => encodeEnvelopeHead({ fingerprint: FP, contextSize: CTX, batchSize: 512, nTokens: TOKENS, firstToken: 1, firstIsEog: false, payloadBytes });

  it('over TCP through the KV I/O thread: byte-identical, slots, descriptors and the file pool clean afterwards', async () => {
    assert.ok(state.length >= 2 ** 30, `the state is ${state.length} bytes`);
    assert.equal(checkAnnounced(wireBytes(head(state.length), state.length), maxStateBytes), undefined, 'decode accepts the announce');
    const file = path.join(dir, 'big.ggsq');
    writeFileSync(file, state);
    const io = new KvIo();
    assert.ok(await io.start());
    const secret = 'kv-large-test-secret';
    let prefill: PeerConn | undefined;
    const server = new KvServer({ host: '127.0.0.1', port: 0, secret, settings: PAIR, epoch: newEpoch(), onMessage: (c) => void (prefill ??= c) });
    const port = await server.listen();
    const files = new FilePool({ dir, prefix: 'pdserve-kvrecv-large', maxFiles: 1, maxBytes: 2 ** 31 });
    const h = head(state.length);
    const rx = new StateReceiver({ totalBytes: wireBytes(h, state.length), expect, walker, files, pool: new BufferPool(1 << 20, 1), io });
    let ended!: () => void;
    const end = new Promise<void>((r) => (ended = r));
    let pushError: Error | undefined;
    const decodeEpoch = newEpoch();
    const lost: string[] = [];
    const pool = new KvPeerPool({
      secret,
      settings: PAIR,
      epoch: decodeEpoch,
      onPeerLost: (_c, why) => void lost.push(why),
      onMessage: (_c, m) => m.type === 'kv_end' && ended(),
      onChunk: (c, _room, _offset, data) => {
        if (pushError) return;
        try {
          rx.push(data, c);
        } catch (e) {
          pushError = e as Error;
        }
      },
    });
    let fds = 0;
    try {
      const d = await pool.get('127.0.0.1', port);
      d.sendControl({ type: 'register', room: '7', rid: 'r7', epoch: decodeEpoch });
      for (let i = 0; !prefill; i++) {
        assert.ok(i < 400, 'register reached the server within 2 s');
        await new Promise((r) => setTimeout(r, 5));
      }
      fds = readdirSync('/proc/self/fd').length; // the connection's sockets included
      await sendStateFile(prefill, '7', file, h, state.length, { pool: new BufferPool(1 << 20, 1), io, stallMs: 60_000 });
      prefill.sendControl({ type: 'kv_end', room: '7' });
      await end;
      assert.equal(pushError, undefined, 'no receive error');
      const got = await rx.finish();
      assert.equal(got.state.nTokens, TOKENS);
      const bytes = readFileSync(got.path);
      assert.equal(bytes.length, state.length);
      assert.equal(crc32(bytes), want, 'the received file has the sent bytes');
      assert.ok(bytes.equals(state), 'byte for byte');
      await rx.done();
      assert.equal(io.freeSlots, io.slots, 'every slot back');
      assert.ok(io.jobs >= 2 * Math.ceil(state.length / io.slotBytes), `read and written on the thread (${io.jobs} jobs)`);
      assert.ok(readdirSync('/proc/self/fd').length <= fds, 'no descriptor left open');
      assert.deepEqual(lost, [], 'the connection lived through it (heartbeats answered while the socket was paused)');
    } finally {
      await pool.close();
      await server.close();
      files.close();
      await io.close();
      rmSync(file, { force: true });
    }
    assert.deepEqual(readdirSync(dir), [], 'no file left');
  });

  it('on the same host: handed over by name, validated from its headers, the data not read', () => {
    const id = { boot: 'b', pidns: 'p' };
    const pre = new SameHostPrefill({ enabled: true, stateDir: dir, identity: id });
    const dec = new SameHostDecode({ enabled: true, stateDir: dir, identity: id });
    const room = normalizeRoomId(8);
    const p = path.join(dir, prefillStateName(4242, room));
    writeFileSync(p, state);
    const msg = pre.offer('conn', room, p, head(state.length), state.length, new BufferPool(4096, 1));
    const out = dec.take(msg, { expect, headers: (f) => parseStateHeaders(f, { contextSize: CTX, nLayer: N_LAYER, maxBytes: maxStateBytes }), walker, pool: new BufferPool(4096, 1) });
    assert.ok('taken' in out, `taken (${'refused' in out ? out.refused : ''})`);
    assert.equal(out.taken.state.nTokens, TOKENS);
    assert.ok(out.bytesRead < 1 << 20, `read ${out.bytesRead} bytes of ${state.length}`);
    assert.equal(existsSync(p), false, "prefill's name is gone");
    assert.equal(crc32(readFileSync(out.taken.path)), want, 'the taken file is the handed state');
    rmSync(out.taken.path);
    assert.deepEqual(readdirSync(dir), []);
  });
});
