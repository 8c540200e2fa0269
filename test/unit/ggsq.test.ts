/**
 * ggsq parser and n_stream rewriting against state files written by the real llama.cpp
 * (node-llama-cpp 3.21.1) for a generated tiny model, in both V layouts.
 * Run: node --import tsx --test test/unit/ggsq.test.ts
 */
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { ensureModel } from '../../src/engine/gguf-writer.js';
import { GgsqStreamParser, kvBytesPerCell, parseStateFile, parseStateHeaders, rewriteNStream, truncatedStateParts, type PositionalSource, type StateExpect } from '../../src/engine/ggsq.js';
import { loadEngine } from '../../src/engine/llama.js';
import type { Engine, SamplingParams } from '../../src/engine/types.js';
import { PdError } from '../../src/base/errors.js';
import { synthState } from '../helpers/ggsq-synth.js';

const CTX = 256;
const expect: StateExpect = { contextSize: CTX, nLayer: 2, maxBytes: 1 << 24 };
const greedy: SamplingParams = { temperature: 0, topP: 1, topK: 0, maxTokens: 8, stop: [], ignoreEos: true };

const dir = mkdtempSync(path.join(os.tmpdir(), 'pdserve-ggsq-test-'));
/** Files written by llama.cpp: transposed V (no flash attention) from slot 1 of 2; plain V (flash attention) from slot 0 of 1. */
let trans: Buffer; // 5 tokens, n_stream 2, data in stream 1
let plain: Buffer; // 5 tokens, n_stream 1
let transLong: Buffer; // 40 tokens
let prompt5: number[];
let prompt40: number[];

function isBadState(err: unknown): boolean {
  return err instanceof PdError && err.code === 'BAD_STATE';
}

async function saveFrom(engine: Engine, prompt: number[], holdFirst: boolean, file: string): Promise<Buffer> {
  const hold = holdFirst ? engine.tryAcquireSlot() : null;
  const slot = engine.tryAcquireSlot()!;
  await slot.prefill(prompt, greedy, new AbortController().signal);
  await slot.saveState(file);
  slot.release();
  hold?.release();
  return readFileSync(file);
}

before(async () => {
  const modelPath = await ensureModel('tiny', 1, dir);
  const a = await loadEngine({ modelPath, sequences: 2, contextSize: CTX, batchSize: 64, flashAttention: false });
  const b = await loadEngine({ modelPath, sequences: 1, contextSize: CTX, batchSize: 64, flashAttention: true });
  try {
    prompt5 = a.tokenize('Hi there').slice(0, 5);
    prompt40 = a.tokenize('the model of the state stream '.repeat(10)).slice(0, 40);
    assert.equal(prompt5.length, 5);
    trans = await saveFrom(a, prompt5, true, path.join(dir, 'trans.ggsq'));
    transLong = await saveFrom(a, prompt40, false, path.join(dir, 'trans40.ggsq'));
    plain = await saveFrom(b, prompt5, false, path.join(dir, 'plain.ggsq'));
  } finally {
    await a.dispose();
    await b.dispose();
  }
});
after(() => rmSync(dir, { recursive: true, force: true }));

describe('parseStateFile on real llama.cpp files', () => {
  it('reads a transposed-V state saved from slot 1 of a 2-sequence context', () => {
    const st = parseStateFile(trans, expect);
    assert.equal(st.version, 3);
    assert.deepEqual(st.tokens, prompt5);
    assert.equal(st.nStream, 2);
    assert.deepEqual(st.streams.map((s) => s.cellCount), [0, 5]);
    const s = st.streams[1];
    assert.equal(s.vTrans, true);
    assert.equal(s.nLayer, 2);
    assert.deepEqual([...s.positions].sort((x, y) => x - y), [0, 1, 2, 3, 4]);
    // f16 K and V, n_embd_kv = 64 → 128 bytes per cell per layer
    assert.deepEqual(s.k!.map((l) => [l.type, l.bytesPerCell]), [[1, 128], [1, 128]]);
    assert.deepEqual(s.v!.map((l) => [l.type, l.elSize, l.nEmbd]), [[1, 2, 64], [1, 2, 64]]);
    assert.equal(kvBytesPerCell(s), 512);
    // exact size: header 12 + tokens 4n + n_stream 4 + 2 cell counts + 12/cell meta + v_trans/n_layer 8
    //   + K (4 + 8 + 128n) × 2 + V (4 + 4 + 4 + 128n) × 2
    const n = 5;
    assert.equal(trans.length, 12 + 4 * n + 4 + 8 + 12 * n + 8 + 2 * (12 + 128 * n) + 2 * (12 + 128 * n));
    assert.equal(st.end, trans.length);
  });

  it('reads a plain-V state (flash attention) from a 1-sequence context', () => {
    const st = parseStateFile(plain, expect);
    assert.equal(st.nStream, 1);
    assert.equal(st.streams[0].vTrans, false);
    assert.deepEqual(st.streams[0].v!.map((l) => [l.type, l.bytesPerCell]), [[1, 128], [1, 128]]);
    assert.equal(plain.length, 12 + 4 * 5 + 4 + 4 + 12 * 5 + 8 + 4 * (12 + 128 * 5));
  });

  it('reads a 40-token state; ~528 bytes per token', () => {
    const st = parseStateFile(transLong, expect);
    assert.equal(st.nTokens, 40);
    assert.equal(st.streams[0].cellCount, 40);
    assert.ok(Math.abs(transLong.length / 40 - 528) < 5);
  });
});

describe('parseStateFile rejects damaged files', () => {
  it('rejects every truncation (each header field, inside K data, inside V data)', () => {
    for (const buf of [trans, plain]) {
      for (let len = 0; len < buf.length; len++) {
        assert.throws(() => parseStateFile(buf.subarray(0, len), expect), isBadState, `truncated to ${len} of ${buf.length}`);
      }
    }
  });

  it('rejects trailing bytes (llama.cpp would ignore them; the handoff payload must be exact)', () => {
    assert.throws(() => parseStateFile(Buffer.concat([trans, Buffer.from([0])]), expect), /trailing/);
    assert.throws(() => parseStateFile(Buffer.concat([plain, Buffer.alloc(4096)]), expect), /trailing/);
  });

  const cellCountOff = (buf: Buffer) => parseStateFile(buf, expect).streams.find((s) => s.cellCount > 0)!.start;
  const mutate = (buf: Buffer, f: (b: Buffer) => void): Buffer => {
    const b = Buffer.from(buf);
    f(b);
    return b;
  };

  it('rejects a huge or oversized cell_count before allocating', () => {
    const off = cellCountOff(trans);
    for (const v of [0xffffffff, 0x7fffffff, CTX + 1, 6, 4]) {
      assert.throws(() => parseStateFile(mutate(trans, (b) => b.writeUInt32LE(v, off)), expect), isBadState, `cell_count ${v}`);
    }
  });

  it('rejects a wrong n_layer (expected, and in the file)', () => {
    assert.throws(() => parseStateFile(trans, { ...expect, nLayer: 3 }), /n_layer 2, this model has 3/);
    const off = cellCountOff(plain) + 4 + 12 * 5 + 4;
    for (const v of [0, 1, 3, 0xffffffff]) {
      assert.throws(() => parseStateFile(mutate(plain, (b) => b.writeUInt32LE(v, off)), expect), isBadState, `n_layer ${v}`);
    }
    // and without an expected n_layer the inconsistent sizes still fail
    assert.throws(() => parseStateFile(mutate(plain, (b) => b.writeUInt32LE(3, off)), { ...expect, nLayer: undefined }), isBadState);
  });

  it('rejects absurd row sizes without overflow (u64 max, 2^40, off by one)', () => {
    const kRowOff = cellCountOff(plain) + 4 + 12 * 5 + 8 + 4;
    for (const v of [0xffffffffffffffffn, 1n << 40n, 1n << 32n, (1n << 24n) + 1n, 1n << 24n, 129n, 0n]) {
      assert.throws(() => parseStateFile(mutate(plain, (b) => b.writeBigUInt64LE(v, kRowOff)), expect), isBadState, `row ${v}`);
    }
    // the error names the u64 exactly (the walk reads it as two u32 halves)
    assert.throws(() => parseStateFile(mutate(plain, (b) => b.writeBigUInt64LE(0xffffffffffffffffn, kRowOff)), expect), /K row_size 18446744073709551615 of layer 0 out of range/);
    assert.throws(() => parseStateFile(mutate(plain, (b) => b.writeBigUInt64LE((1n << 32n) + 8n, kRowOff)), expect), /K row_size 4294967304 of layer 0 out of range/);
    // a row within the limit whose data runs past the file: the exact byte count in the error
    assert.throws(() => parseStateFile(mutate(plain, (b) => b.writeBigUInt64LE(1n << 24n, kRowOff)), expect), new RegExp(`K data \\(layer 0\\) of ${5 * 2 ** 24} bytes at byte \\d+ goes past the limit`));
  });

  it("refuses a byte limit that is not a safe integer (the walk's sizes are exact below 2^53)", () => {
    for (const maxBytes of [Infinity, 2 ** 53, -1, 1.5]) {
      assert.throws(() => new GgsqStreamParser({ contextSize: CTX, maxBytes }), /is not a byte count/, String(maxBytes));
    }
  });

  it('rejects bad magic, version, n_tokens, n_stream, n_seq_id, positions, v_trans, types, size limit', () => {
    const cases: Array<[string, (b: Buffer) => void]> = [
      ['magic', (b) => b.writeUInt32LE(0x46554747, 0)],
      ['version', (b) => b.writeUInt32LE(2, 4)],
      ['n_tokens huge', (b) => b.writeUInt32LE(0xffffffff, 8)],
      ['n_tokens > ctx', (b) => b.writeUInt32LE(CTX + 1, 8)],
      ['n_tokens < cells', (b) => b.writeUInt32LE(4, 8)],
      ['negative token', (b) => b.writeInt32LE(-1, 12)],
      ['n_stream 0', (b) => b.writeUInt32LE(0, 12 + 20)],
      ['n_stream 1000', (b) => b.writeUInt32LE(1000, 12 + 20)],
      ['n_stream 3', (b) => b.writeUInt32LE(3, 12 + 20)],
      ['pos dup', (b) => b.writeInt32LE(0, cellCountOff(trans) + 4 + 12)],
      ['pos negative', (b) => b.writeInt32LE(-1, cellCountOff(trans) + 4)],
      ['pos ≥ n_tokens', (b) => b.writeInt32LE(5, cellCountOff(trans) + 4)],
      ['n_seq_id 2', (b) => b.writeUInt32LE(2, cellCountOff(trans) + 8)],
      ['n_seq_id 0', (b) => b.writeUInt32LE(0, cellCountOff(trans) + 8)],
      ['seq_id', (b) => b.writeInt32LE(-5, cellCountOff(trans) + 12)],
      ['v_trans 2', (b) => b.writeUInt32LE(2, cellCountOff(trans) + 4 + 60)],
      ['v_trans flipped', (b) => b.writeUInt32LE(0, cellCountOff(trans) + 4 + 60)],
      ['K type', (b) => b.writeInt32LE(-1, cellCountOff(trans) + 4 + 60 + 8)],
    ];
    for (const [name, f] of cases) assert.throws(() => parseStateFile(mutate(trans, f), expect), isBadState, name);
    assert.throws(() => parseStateFile(trans, { ...expect, maxBytes: trans.length - 1 }), /exceeds the limit/);
    assert.throws(() => parseStateFile(trans, { ...expect, nVocab: Math.min(...prompt5) }), /outside the vocabulary/);
  });

  it('never throws anything but BAD_STATE on random corruption of the metadata', () => {
    let x = 12345;
    const rnd = () => ((x = (Math.imul(x, 1103515245) + 12345) >>> 0) / 2 ** 32);
    const metaEnd = cellCountOff(trans) + 4 + 60 + 8 + 12; // through the first K header
    let accepted = 0;
    for (let i = 0; i < 3000; i++) {
      const b = Buffer.from(trans);
      const flips = 1 + Math.floor(rnd() * 3);
      for (let j = 0; j < flips; j++) b[Math.floor(rnd() * metaEnd)] ^= 1 << Math.floor(rnd() * 8);
      try {
        parseStateFile(b, expect);
        accepted++; // e.g. a flipped token id or seq_id: structurally fine
      } catch (err) {
        assert.ok(isBadState(err), String(err));
      }
    }
    assert.ok(accepted < 3000);
  });
});

describe('parseStateHeaders: the structure walk without reading the KV data (same-host path)', () => {
  /** A PositionalSource over `buf` that records every byte it hands out. */
  const source = (buf: Buffer) => {
    const seen = new Uint8Array(buf.length);
    let bytes = 0;
    const src: PositionalSource = {
      size: buf.length,
      read(pos, n) {
        assert.ok(pos >= 0 && pos + n <= buf.length, `read ${n} at ${pos} stays inside the ${buf.length}-byte file`);
        seen.fill(1, pos, pos + n);
        bytes += n;
        return buf.subarray(pos, pos + n);
      },
    };
    return { src, seen, bytes: () => bytes };
  };
  /** Both walks on `b`: the same state, or both BAD_STATE. */
  const agree = (b: Buffer, what: string) => {
    let full: unknown;
    let head: unknown;
    try {
      full = parseStateFile(b, expect);
    } catch (err) {
      assert.ok(isBadState(err), `${what}: ${String(err)}`);
      full = 'bad';
    }
    try {
      head = parseStateHeaders(source(b).src, expect);
    } catch (err) {
      assert.ok(isBadState(err), `${what}: ${String(err)}`);
      head = 'bad';
    }
    assert.deepEqual(head, full, what);
    return full !== 'bad';
  };

  it('gives the full parse\'s result on real files, reading only the headers', () => {
    for (const buf of [trans, plain, transLong]) {
      const s = source(buf);
      assert.deepEqual(parseStateHeaders(s.src, expect), parseStateFile(buf, expect));
      const st = parseStateFile(buf, expect);
      // nothing inside any layer's K or V data was read
      for (const stream of st.streams) {
        for (const sec of [...(stream.k ?? []), ...(stream.v ?? [])]) {
          const end = sec.dataOffset + sec.bytesPerCell * stream.cellCount;
          assert.equal(s.seen.subarray(sec.dataOffset, end).indexOf(1), -1, `data at ${sec.dataOffset}..${end} not read`);
        }
      }
      assert.ok(s.bytes() < buf.length / 4, `read ${s.bytes()} of ${buf.length} bytes`);
    }
  });

  it('the same result and the same rejections from a buffer that is not 4-byte aligned (the readInt32LE path)', () => {
    const unaligned = (b: Buffer) => {
      const u = Buffer.alloc(b.length + 1).subarray(1);
      b.copy(u);
      assert.equal(u.byteOffset % 4, 1);
      return u;
    };
    for (const buf of [trans, plain, transLong]) assert.deepEqual(parseStateFile(unaligned(buf), expect), parseStateFile(buf, expect));
    const off = parseStateFile(trans, expect).streams.find((x) => x.cellCount > 0)!.start;
    for (const [f, re] of [
      [(b: Buffer) => b.writeInt32LE(0, off + 4 + 12), /repeats pos 0/],
      [(b: Buffer) => b.writeUInt32LE(2, off + 8), /n_seq_id 2/],
      [(b: Buffer) => b.writeInt32LE(-5, off + 12), /seq_id -5/],
      [(b: Buffer) => b.writeInt32LE(-1, 12), /negative id -1/],
    ] as [(b: Buffer) => void, RegExp][]) {
      const b = Buffer.from(trans);
      f(b);
      assert.throws(() => parseStateFile(b, expect), re);
      assert.throws(() => parseStateFile(unaligned(b), expect), re);
    }
  });

  it('rejects every truncation, and trailing bytes, as the full parse does', () => {
    for (const buf of [trans, plain]) {
      for (let len = 0; len < buf.length; len++) {
        assert.throws(() => parseStateHeaders(source(buf.subarray(0, len)).src, expect), isBadState, `truncated to ${len} of ${buf.length}`);
      }
    }
    assert.throws(() => parseStateHeaders(source(Buffer.concat([trans, Buffer.from([0])])).src, expect), /trailing/);
    assert.throws(() => parseStateHeaders(source(plain).src, { ...expect, maxBytes: plain.length - 1 }), /exceeds the limit/);
  });

  it('agrees with the full parse on every damaged header byte (3 ways each), and a damaged data byte passes both', () => {
    for (const buf of [trans, plain]) {
      const { src, seen } = source(buf);
      parseStateHeaders(src, expect);
      let headerBytes = 0;
      let rejected = 0;
      for (let i = 0; i < buf.length; i++) {
        if (!seen[i]) continue;
        headerBytes++;
        for (const f of [(v: number) => v ^ 0xff, (v: number) => v ^ 0x01, () => 0x7f]) {
          const b = Buffer.from(buf);
          b[i] = f(b[i]!);
          if (b[i] === buf[i]) continue;
          if (!agree(b, `byte ${i}`)) rejected++;
        }
      }
      assert.ok(headerBytes > 50 && rejected > headerBytes, `${rejected} rejections over ${headerBytes} header bytes`);
      const st = parseStateFile(buf, expect);
      const data = st.streams.find((x) => x.cellCount > 0)!.k![1]!.dataOffset + 3;
      assert.equal(seen[data], 0);
      const b = Buffer.from(buf);
      b[data] ^= 0xff;
      assert.ok(agree(b, 'data byte'), 'a data byte is not structure: neither walk sees it (the CRC does, --kv-same-host-verify)');
    }
  });
});

describe('rewriteNStream', () => {
  it('adds and drops empty streams, keeping the KV bytes', () => {
    for (const target of [1, 2, 3, 8, 256]) {
      const out = rewriteNStream(trans, target);
      const st = parseStateFile(out, expect);
      assert.equal(st.nStream, target);
      assert.deepEqual(st.tokens, prompt5);
      assert.deepEqual(st.streams.map((s) => s.cellCount).filter((c) => c > 0), [5]);
      const src = parseStateFile(trans, expect).streams[1];
      const dst = st.streams.find((s) => s.cellCount > 0)!;
      assert.ok(trans.subarray(src.start, src.end).equals(out.subarray(dst.start, dst.end)));
      assert.equal(out.length, trans.length + 4 * (target - 2));
    }
    assert.equal(rewriteNStream(trans, 2), trans);
  });

  it('validates its input and target', () => {
    assert.throws(() => rewriteNStream(trans.subarray(0, trans.length - 1), 1), isBadState);
    assert.throws(() => rewriteNStream(trans, 0), RangeError);
    assert.throws(() => rewriteNStream(trans, 257), RangeError);
  });
});

describe('truncatedStateParts: the first tokens of a state as a state of their own', () => {
  /** A one-sequence state whose every K/V byte names its cell's position (cells in `order`), transposed V when `vTrans`. */
  const cellState = (tokens: number[], order: number[], vTrans: boolean): Buffer =>
    synthState(tokens, { nStream: 2, seq: 1, rowBytes: 4, positions: order, ...(vTrans ? { vTrans: { elBytes: 2, rows: 3 } } : {}), data: (part, l, p, j) => (part === 'k' ? p + 10 * l : 100 + p + 10 * l + 50 * j) });
  const expect = { contextSize: 64, maxBytes: 1 << 20 };

  for (const vTrans of [false, true]) {
    it(`keeps tokens and cells of positions < keep, data byte for byte (v_trans ${vTrans}, cells out of order)`, () => {
      const tokens = [5, 6, 7, 8, 9, 10];
      const order = [0, 1, 4, 2, 5, 3]; // a sequence that was erased and refilled
      const buf = cellState(tokens, order, vTrans);
      const st = parseStateFile(buf, expect);
      const cut = Buffer.concat(truncatedStateParts(buf, st, 4));
      const ct = parseStateFile(cut, expect);
      assert.deepEqual(ct.tokens, [5, 6, 7, 8]);
      assert.equal(ct.nStream, 2);
      const s = ct.streams[1]!;
      assert.deepEqual(s.positions, [0, 1, 2, 3], 'the kept cells in their file order');
      for (let l = 0; l < 2; l++) {
        for (let i = 0; i < 4; i++) assert.equal(cut[s.k![l]!.dataOffset + i * 4], s.positions[i]! + 10 * l, `K layer ${l} cell ${i}`);
        const v = s.v![l]!;
        if (!vTrans) for (let i = 0; i < 4; i++) assert.equal(cut[v.dataOffset + i * 4], 100 + s.positions[i]! + 10 * l);
        else for (let j = 0; j < 3; j++) for (let i = 0; i < 4; i++) assert.equal(cut[v.dataOffset + (j * 4 + i) * 2], 100 + s.positions[i]! + 10 * l + 50 * j, `V layer ${l} row ${j} cell ${i}`);
      }
      assert.equal(Buffer.concat(truncatedStateParts(buf, st, 6)).equals(buf), true, 'keeping all is the same file');
    });
  }

  it('refuses what cannot be cut', () => {
    const buf = cellState([1, 2, 3], [0, 1, 2], false);
    const st = parseStateFile(buf, expect);
    assert.throws(() => truncatedStateParts(buf, st, 0), PdError);
    assert.throws(() => truncatedStateParts(buf, st, 4), PdError);
  });
});
