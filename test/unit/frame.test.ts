import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import fc from 'fast-check';
import {
  checkHot,
  ControlMsgSchema,
  encodeChunk,
  encodeControl,
  FrameDecoder,
  isRoomId,
  MAX_REASON_CHARS,
  normalizeRoomId,
  parseControl,
  type Frame,
} from '../../src/kv/frame.js';
import { MAX_CHUNK_BYTES, MAX_CONTROL_BYTES, type ControlMsg } from '../../src/kv/messages.js';
import { KvError } from '../../src/kv/types.js';

const N = 'a'.repeat(32);
const E = '0123456789abcdef';
const MAC = 'f'.repeat(64);
const ALL: ControlMsg[] = [
  { type: 'hello', nonce: N, epoch: E, role: 'prefill', settings: { fingerprint: 'ab'.repeat(32), contextSize: 1024, batchSize: 128, flashAttention: true } },
  { type: 'auth', nonce: N, epoch: E, role: 'decode', mac: MAC, settings: { fingerprint: 'cd'.repeat(32), contextSize: 2048, batchSize: 512, flashAttention: false } },
  { type: 'auth_ok', mac: MAC },
  { type: 'auth_fail', reason: 'bad mac' },
  { type: 'auth_fail', reason: 'contextSize 1024 ≠ 2048', code: 'settings_mismatch' },
  { type: 'register', room: '18446744073709551615', rid: 'chatcmpl-1', epoch: E },
  { type: 'registered', room: '0' },
  { type: 'kv_begin', room: '42', totalBytes: 123456 },
  { type: 'kv_end', room: '42' },
  { type: 'kv_ack', room: '42', epoch: E },
  { type: 'fail', room: '42', code: 'request_aborted', detail: 'abort: client', epoch: E },
  { type: 'ping', seq: 0 },
  { type: 'pong', seq: Number.MAX_SAFE_INTEGER },
];

function frameBytes(parts: Buffer | Buffer[]): Buffer {
  return Array.isArray(parts) ? Buffer.concat(parts) : parts;
}

function decodeAll(chunks: Buffer[], streamChunks = false): Frame[] {
  const d = new FrameDecoder({ streamChunks });
  const out: Frame[] = [];
  for (const c of chunks) for (const f of d.feed(c)) out.push(f);
  assert.equal(d.bufferedBytes, 0);
  return out;
}

function rawFrame(type: number, body: Buffer, len = body.length + 1): Buffer {
  const h = Buffer.alloc(5);
  h.writeUInt32BE(len, 0);
  h[4] = type;
  return Buffer.concat([h, body]);
}

function expectBad(fn: () => unknown, re: RegExp): void {
  assert.throws(fn, (e: unknown) => {
    assert.ok(e instanceof KvError, `expected KvError, got ${String(e)}`);
    assert.equal(e.code, 'BAD_FRAME');
    assert.match(e.message, re);
    return true;
  });
}

function feedAll(d: FrameDecoder, b: Buffer): Frame[] {
  return [...d.feed(b)];
}

describe('frame: round trips', () => {
  it('every control message variant', () => {
    for (const m of ALL) {
      const [f] = decodeAll([encodeControl(m)]);
      assert.deepEqual(f, { kind: 'control', msg: m });
    }
  });

  it('chunk frame, without copying the data', () => {
    const data = Buffer.from('hello kv');
    const parts = encodeChunk('9223372036854775807', 1 << 40, data);
    assert.equal(parts.length, 2);
    assert.equal(parts[1], data, 'data buffer is passed through, not copied');
    const [f] = decodeAll([frameBytes(parts)]);
    assert.deepEqual(f, { kind: 'chunk', room: '9223372036854775807', offset: 1 << 40, data, final: true });
  });

  it('max-size control and chunk frames', () => {
    const big = { type: 'fail', room: '1', epoch: E, code: 'request_aborted', detail: 'x'.repeat(MAX_REASON_CHARS) } as const;
    assert.deepEqual(decodeAll([encodeControl(big)])[0], { kind: 'control', msg: big });
    const data = Buffer.alloc(MAX_CHUNK_BYTES, 7);
    const [f] = decodeAll([frameBytes(encodeChunk('5', 0, data))]);
    assert.ok(f.kind === 'chunk' && f.data.equals(data));
  });

  it('a stream split at every byte boundary, merged, and byte by byte', () => {
    const frames: Buffer[] = [];
    for (const m of ALL) frames.push(encodeControl(m));
    frames.push(frameBytes(encodeChunk('7', 0, Buffer.from([1, 2, 3]))));
    frames.push(frameBytes(encodeChunk('7', 3, Buffer.alloc(300, 9))));
    const stream = Buffer.concat(frames);
    const want = decodeAll([stream]);
    assert.equal(want.length, ALL.length + 2);
    for (let i = 0; i <= stream.length; i++) {
      assert.deepEqual(decodeAll([stream.subarray(0, i), stream.subarray(i)]), want, `split at ${i}`);
    }
    for (let i = 0; i < stream.length; i += 7) {
      for (const j of [i + 1, i + 5, i + 21, i + 200]) {
        if (j > stream.length) continue;
        assert.deepEqual(decodeAll([stream.subarray(0, i), stream.subarray(i, j), stream.subarray(j)]), want, `split at ${i},${j}`);
      }
    }
    assert.deepEqual(decodeAll([...stream].map((b) => Buffer.from([b]))), want);
  });
});

/** Merges streamed chunk pieces back into whole frames (checking order and contiguity). */
function mergePieces(frames: Frame[]): Frame[] {
  const out: Frame[] = [];
  let open: { room: string; offset: number; parts: Buffer[]; next: number } | undefined;
  for (const f of frames) {
    if (f.kind === 'control') {
      assert.equal(open, undefined, 'control frame inside a chunk frame');
      out.push(f);
      continue;
    }
    assert.ok(f.data.length > 0);
    if (!open) open = { room: f.room, offset: f.offset, parts: [], next: f.offset };
    assert.equal(f.room, open.room);
    assert.equal(f.offset, open.next, 'pieces are contiguous');
    open.parts.push(f.data);
    open.next += f.data.length;
    if (f.final) {
      out.push({ kind: 'chunk', room: open.room, offset: open.offset, data: Buffer.concat(open.parts), final: true });
      open = undefined;
    }
  }
  assert.equal(open, undefined);
  return out;
}

describe('frame: streamed chunks', () => {
  const stream = Buffer.concat([
    encodeControl({ type: 'kv_begin', room: '3', totalBytes: 1300 }),
    frameBytes(encodeChunk('3', 0, Buffer.alloc(1000, 1))),
    encodeControl({ type: 'ping', seq: 1 }),
    frameBytes(encodeChunk('3', 1000, Buffer.alloc(300, 2))),
    encodeControl({ type: 'kv_end', room: '3' }),
  ]);
  const want = decodeAll([stream]);

  it('pieces merge back to the same frames at every split point', () => {
    for (let i = 0; i <= stream.length; i++) {
      assert.deepEqual(mergePieces(decodeAll([stream.subarray(0, i), stream.subarray(i)], true)), want, `split at ${i}`);
    }
    assert.deepEqual(mergePieces(decodeAll([...stream].map((b) => Buffer.from([b])), true)), want);
  });

  it('data pieces are views of the fed buffers, never copies', () => {
    const parts = [stream.subarray(0, 100), Buffer.from(stream.subarray(100, 700)), Buffer.from(stream.subarray(700))];
    const d = new FrameDecoder({ streamChunks: true });
    for (const p of parts) {
      for (const f of d.feed(p)) if (f.kind === 'chunk') assert.equal(f.data.buffer, p.buffer);
    }
  });

  it('a fed buffer is not kept: one read buffer reused for every read gives the same frames', () => {
    for (const size of [1, 5, 21, 37, 200, stream.length]) {
      const rb = Buffer.alloc(size);
      const d = new FrameDecoder({ streamChunks: true });
      const got: Frame[] = [];
      for (let i = 0; i < stream.length; i += size) {
        const n = stream.copy(rb, 0, i, i + size);
        for (const f of d.feed(rb.subarray(0, n))) got.push(f.kind === 'chunk' ? { ...f, data: Buffer.from(f.data) } : f); // consumers copy chunk data out
        rb.fill(0xaa); // the next read overwrites it
      }
      assert.deepEqual(mergePieces(got), want, `reads of ${size} bytes`);
    }
  });

  it('a whole chunk inside one buffer comes out as one final piece', () => {
    const f = decodeAll([stream], true);
    assert.equal(f.length, want.length);
    assert.ok(f.every((x) => x.kind === 'control' || x.final));
  });

  it('caps are checked on the header, before any piece is emitted', () => {
    const h = Buffer.alloc(5);
    h.writeUInt32BE(MAX_CHUNK_BYTES + 18, 0);
    h[4] = 2;
    expectBad(() => [...new FrameDecoder({ streamChunks: true }).feed(h)], /exceeds cap/);
  });
});

describe('frame: caps and garbage', () => {
  it('zero length', () => expectBad(() => feedAll(new FrameDecoder(), Buffer.from([0, 0, 0, 0, 1])), /zero-length/));
  it('unknown type', () => expectBad(() => feedAll(new FrameDecoder(), rawFrame(3, Buffer.from('x'))), /unknown frame type 3/));
  it('empty control frame', () => expectBad(() => feedAll(new FrameDecoder(), rawFrame(1, Buffer.alloc(0))), /empty control/));

  it('oversized control frame is refused on its header, before the body arrives', () => {
    const h = Buffer.alloc(5);
    h.writeUInt32BE(MAX_CONTROL_BYTES + 2, 0);
    h[4] = 1;
    expectBad(() => feedAll(new FrameDecoder(), h), /control frame of 65537 bytes exceeds cap 65536/);
  });

  it('oversized chunk frame is refused on its header', () => {
    const h = Buffer.alloc(5);
    h.writeUInt32BE(MAX_CHUNK_BYTES + 18, 0);
    h[4] = 2;
    expectBad(() => feedAll(new FrameDecoder(), h), /chunk frame of \d+ bytes exceeds cap/);
    h.writeUInt32BE(0xffffffff, 0);
    expectBad(() => feedAll(new FrameDecoder(), h), /exceeds cap/);
  });

  it('chunk frame without data, and chunk frames while not accepted', () => {
    expectBad(() => feedAll(new FrameDecoder(), rawFrame(2, Buffer.alloc(16))), /carries no data/);
    const d = new FrameDecoder({ acceptChunks: false });
    expectBad(() => feedAll(d, frameBytes(encodeChunk('1', 0, Buffer.from('x')))), /not allowed/);
  });

  it('chunk offset beyond 2^53', () => {
    const body = Buffer.alloc(17);
    body.writeBigUInt64BE(1n, 0);
    body.writeBigUInt64BE(1n << 60n, 8);
    expectBad(() => feedAll(new FrameDecoder(), rawFrame(2, body)), /offset/);
  });

  it('bad JSON, bad UTF-8, unknown type, bad shapes', () => {
    const ctl = (s: string | Buffer) => rawFrame(1, Buffer.isBuffer(s) ? s : Buffer.from(s));
    expectBad(() => feedAll(new FrameDecoder(), ctl('{"type":')), /not valid JSON/);
    expectBad(() => feedAll(new FrameDecoder(), ctl(Buffer.from([0x7b, 0xff, 0x7d]))), /UTF-8/);
    expectBad(() => feedAll(new FrameDecoder(), ctl('[1,2]')), /not a JSON object/);
    expectBad(() => feedAll(new FrameDecoder(), ctl('null')), /not a JSON object/);
    expectBad(() => feedAll(new FrameDecoder(), ctl('{"type":"bogus"}')), /unknown control message type "bogus"/);
    expectBad(() => feedAll(new FrameDecoder(), ctl('{"seq":1}')), /unknown control message type/);
    expectBad(() => feedAll(new FrameDecoder(), ctl('{"type":"ping","seq":-1}')), /bad ping message: seq/);
    expectBad(() => feedAll(new FrameDecoder(), ctl('{"type":"ping","seq":1.5}')), /bad ping message: seq/);
    expectBad(() => feedAll(new FrameDecoder(), ctl('{"type":"kv_end","room":"007"}')), /bad kv_end message: room/);
    expectBad(() => feedAll(new FrameDecoder(), ctl('{"type":"kv_end","room":"18446744073709551616"}')), /room/);
    expectBad(() => feedAll(new FrameDecoder(), ctl('{"type":"register","room":"1","rid":"r"}')), /bad register message: epoch/);
    expectBad(() => feedAll(new FrameDecoder(), ctl('{"type":"hello","nonce":"ab","epoch":"0123456789abcdef","role":"prefill"}')), /nonce/);
    expectBad(() => feedAll(new FrameDecoder(), ctl(`{"type":"auth_ok","mac":"${'F'.repeat(64)}"}`)), /mac/);
  });

  it('unknown extra keys are stripped, not refused', () => {
    const [f] = feedAll(new FrameDecoder(), rawFrame(1, Buffer.from('{"type":"ping","seq":3,"extra":true}')));
    assert.deepEqual(f, { kind: 'control', msg: { type: 'ping', seq: 3 } });
  });

  it('frames before the bad one are delivered; the decoder stays poisoned', () => {
    const d = new FrameDecoder();
    const good = encodeControl({ type: 'ping', seq: 1 });
    const got: Frame[] = [];
    assert.throws(() => {
      for (const f of d.feed(Buffer.concat([good, good, Buffer.from([0, 0, 0, 0, 1])]))) got.push(f);
    }, KvError);
    assert.equal(got.length, 2);
    expectBad(() => feedAll(d, good), /zero-length/);
  });
});

describe('frame: encoding refuses invalid input', () => {
  it('control', () => {
    expectBad(() => encodeControl({ type: 'kv_end', room: '01' }), /room/);
    expectBad(() => encodeControl({ type: 'bogus' } as unknown as ControlMsg), /unknown control message type/);
    expectBad(() => encodeControl({ type: 'register', room: '1', rid: 'x'.repeat(129), epoch: E }), /rid/);
    const m = encodeControl({ type: 'fail', room: '1', epoch: E, code: 'request_aborted', detail: 'y'.repeat(100_000) });
    const [f] = decodeAll([m]);
    assert.ok(f.kind === 'control' && f.msg.type === 'fail' && f.msg.detail.length === MAX_REASON_CHARS);
  });

  it('chunk', () => {
    expectBad(() => encodeChunk('-1', 0, Buffer.from('x')), /room id/);
    expectBad(() => encodeChunk('1', -1, Buffer.from('x')), /offset/);
    expectBad(() => encodeChunk('1', 0.5, Buffer.from('x')), /offset/);
    expectBad(() => encodeChunk('1', 0, Buffer.alloc(0)), /empty chunk/);
    expectBad(() => encodeChunk('1', 0, Buffer.alloc(MAX_CHUNK_BYTES + 1)), /exceeds MAX_CHUNK_BYTES/);
  });

  it('room ids', () => {
    assert.equal(normalizeRoomId('007'), '7');
    assert.equal(normalizeRoomId(42), '42');
    assert.equal(normalizeRoomId('18446744073709551615'), '18446744073709551615');
    expectBad(() => normalizeRoomId('18446744073709551616'), /range/);
    expectBad(() => normalizeRoomId('1e3'), /decimal/);
    expectBad(() => normalizeRoomId(-1), /range/);
    expectBad(() => normalizeRoomId(''), /decimal/);
    assert.ok(isRoomId('0') && !isRoomId('00') && !isRoomId(7) && !isRoomId(' 7'));
    assert.throws(() => parseControl({ type: 'kv_end', room: 7 }), KvError);
  });
});

describe('frame: fuzz', () => {
  const onlyKvErrors = (chunks: Uint8Array[]): void => {
    for (const streamChunks of [false, true]) {
      const d = new FrameDecoder({ streamChunks });
      try {
        for (const c of chunks) for (const _ of d.feed(Buffer.from(c))) void _;
      } catch (e) {
        if (!(e instanceof KvError) || e.code !== 'BAD_FRAME') throw e;
      }
    }
  };

  it('random bytes never throw anything but KvError(BAD_FRAME)', () => {
    fc.assert(fc.property(fc.array(fc.uint8Array({ maxLength: 300 }), { maxLength: 8 }), onlyKvErrors), { numRuns: 3000 });
  });

  it('random bodies behind plausible headers never throw anything but KvError(BAD_FRAME)', () => {
    const arb = fc.tuple(fc.constantFrom(1, 2, 0, 255), fc.uint8Array({ maxLength: 200 }), fc.integer({ min: -3, max: 3 }));
    fc.assert(
      fc.property(fc.array(arb, { maxLength: 5 }), (frames) => {
        onlyKvErrors(frames.map(([t, body, delta]) => rawFrame(t, Buffer.from(body), Math.max(0, body.length + 1 + delta))));
      }),
      { numRuns: 3000 },
    );
  });

  it('mutated JSON of valid messages never throws anything but KvError(BAD_FRAME)', () => {
    fc.assert(
      fc.property(fc.constantFrom(...ALL), fc.nat(), fc.nat(255), (m, pos, byte) => {
        const f = encodeControl(m);
        const i = 5 + (pos % (f.length - 5));
        f[i] = byte;
        onlyKvErrors([f]);
      }),
      { numRuns: 3000 },
    );
  });

  it('random valid frame sequences round-trip under random splits', () => {
    const chunkArb = fc.record({
      room: fc.bigInt({ min: 0n, max: (1n << 64n) - 1n }).map(String),
      offset: fc.nat(),
      data: fc.uint8Array({ minLength: 1, maxLength: 100 }),
    });
    fc.assert(
      fc.property(fc.array(fc.oneof(fc.constantFrom(...ALL), chunkArb), { maxLength: 10 }), fc.array(fc.nat(), { maxLength: 6 }), (items, cuts) => {
        const bytes = Buffer.concat(
          items.map((it) => ('type' in it ? encodeControl(it) : frameBytes(encodeChunk(it.room, it.offset, Buffer.from(it.data))))),
        );
        const points = [...new Set(cuts.map((c) => c % (bytes.length + 1)))].sort((a, b) => a - b);
        const parts: Buffer[] = [];
        let prev = 0;
        for (const p of points) {
          parts.push(bytes.subarray(prev, p));
          prev = p;
        }
        parts.push(bytes.subarray(prev));
        const got = decodeAll(parts);
        assert.deepEqual(mergePieces(decodeAll(parts, true)), got);
        assert.deepEqual(
          got,
          items.map((it) => ('type' in it ? { kind: 'control', msg: it } : { kind: 'chunk', room: it.room, offset: it.offset, data: Buffer.from(it.data), final: true })),
        );
      }),
      { numRuns: 1000 },
    );
  });
});

describe('the hand check of kv_begin / kv_end / kv_file / kv_ack (before zod)', () => {
  // values around every rule of the two schemas: valid ones and each way to break them
  const anyVal = fc.oneof(
    fc.constantFrom('7', '0', '007', '18446744073709551615', '18446744073709551616', '-1', '1.5', '', 'x', 'a'.repeat(255), 'a'.repeat(256), '0123456789abcdef', '0123456', 'ABCDEF0123456789', 'f'.repeat(64), 'f'.repeat(65)),
    fc.constantFrom(0, -0, 1, -1, 1.5, 0xffffffff, 0x100000000, Number.MAX_SAFE_INTEGER, Number.MAX_SAFE_INTEGER + 1, NaN, Infinity, null, true, false),
    fc.string({ maxLength: 8 }),
    fc.integer(),
    fc.constant({}),
    fc.constant([]),
  );
  const msgArb = fc.record(
    {
      type: fc.constantFrom('kv_file', 'kv_ack', 'kv_begin', 'kv_end'),
      room: fc.oneof(fc.constantFrom('42', '18446744073709551615'), anyVal),
      file: fc.oneof(fc.constant('pdserve-prefill-1-42.ggsq'), anyVal),
      payloadBytes: fc.oneof(fc.constant(1050089), anyVal),
      totalBytes: fc.oneof(fc.constant(1050389), anyVal),
      streamed: fc.oneof(fc.constant(true), anyVal),
      crc: fc.oneof(fc.constant(123), anyVal),
      head: fc.oneof(fc.constant('UERLVg=='), fc.constant('a'.repeat(32 * 1024)), fc.constant('a'.repeat(32 * 1024 + 1)), anyVal),
      epoch: fc.oneof(fc.constant(E), anyVal),
      extra: anyVal,
    },
    { requiredKeys: ['type'] },
  );

  it('accepts exactly what the zod schema accepts, with the same result (unknown keys stripped)', () => {
    let fast = 0;
    fc.assert(
      fc.property(msgArb, (m) => {
        const z = ControlMsgSchema.safeParse(m);
        const h = checkHot(m as Record<string, unknown>);
        if (h) {
          fast++;
          assert.ok(z.success, `the hand check accepted what zod refuses: ${JSON.stringify(m)}`);
          assert.deepEqual(h, z.data);
        }
        // parseControl: the hand check, else zod (which words the refusal)
        if (z.success) assert.deepEqual(parseControl(m), z.data);
        else assert.throws(() => parseControl(m), (e: unknown) => e instanceof KvError && e.code === 'BAD_FRAME');
      }),
      { numRuns: 3000 },
    );
    assert.ok(fast > 100, `the hand check took only ${fast} of 3000 messages`);
  });

  it('takes every valid kv_begin, kv_end, kv_file and kv_ack (so zod is not on their path), and nothing else', () => {
    const hot = new Set(['kv_begin', 'kv_end', 'kv_file', 'kv_ack']);
    const msgs = [
      ...ALL,
      { type: 'kv_begin', room: '9', totalBytes: 5, streamed: true },
      { type: 'kv_end', room: '9', totalBytes: 7, crc: 0xffffffff },
    ] as ControlMsg[];
    for (const m of msgs.filter((x) => hot.has(x.type))) assert.deepStrictEqual(checkHot(JSON.parse(JSON.stringify(m))), ControlMsgSchema.parse(m));
    for (const m of ALL.filter((x) => !hot.has(x.type))) assert.equal(checkHot(JSON.parse(JSON.stringify(m))), undefined);
    assert.deepEqual(checkHot({ type: 'kv_file', room: '9', file: 'f', payloadBytes: 0, crc: 0xffffffff, head: 'h' }), { type: 'kv_file', room: '9', file: 'f', payloadBytes: 0, crc: 0xffffffff, head: 'h' });
    assert.deepStrictEqual(checkHot({ type: 'kv_begin', room: '9', totalBytes: 5, extra: 1 }), { type: 'kv_begin', room: '9', totalBytes: 5 });
    assert.equal(checkHot({ type: 'kv_begin', room: '9', totalBytes: 5, streamed: 1 }), undefined);
    assert.equal(checkHot({ type: 'kv_end', room: '9', crc: 0x100000000 }), undefined);
    assert.equal(checkHot({ type: 'kv_file', room: '09', file: 'f', payloadBytes: 0, head: 'h' }), undefined);
  });
});
