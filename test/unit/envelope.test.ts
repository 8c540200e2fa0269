import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { describe, it } from 'node:test';
import fc from 'fast-check';
import {
  checkHeader,
  decodeEnvelope,
  encodeEnvelope,
  ENVELOPE_DIGEST_BYTES,
  ENVELOPE_PREFIX_BYTES,
  ENVELOPE_VERSION,
  envelopeTrailer,
  HeaderSchema,
  parseEnvelopeHead,
  prepareEnvelopeHead,
  encodeEnvelopeHead,
  type EnvelopeExpect,
} from '../../src/kv/envelope.js';
import { crc32 } from '../../src/kv/transfer/checksum.js';
import { KvError } from '../../src/kv/types.js';

const FP = createHash('sha256').update('model-a').digest('hex');
const FP_B = createHash('sha256').update('model-b').digest('hex');
const HDR = { fingerprint: FP, contextSize: 4096, batchSize: 512, nTokens: 37, firstToken: 1234, firstIsEog: false };
const EXPECT: EnvelopeExpect = { fingerprint: FP, contextSize: 4096, batchSize: 512, maxPayloadBytes: 1 << 20 };
const PAYLOAD = Buffer.from(Array.from({ length: 1000 }, (_, i) => (i * 31) & 0xff));

function bad(fn: () => unknown, re: RegExp): void {
  assert.throws(fn, (e: unknown) => {
    assert.ok(e instanceof KvError, `expected KvError, got ${String(e)}`);
    assert.equal(e.code, 'BAD_ENVELOPE');
    assert.match(e.message, re);
    return true;
  });
}

/** An envelope head as the format defines it, built independently of the code under test: prefix, header JSON, sha256 of both. */
function formatHead(json: Buffer, version = ENVELOPE_VERSION): Buffer {
  const pre = Buffer.alloc(ENVELOPE_PREFIX_BYTES);
  pre.write('PDKV', 0, 'ascii');
  pre.writeUInt32BE(version, 4);
  pre.writeUInt32BE(json.length, 8);
  const body = Buffer.concat([pre, json]);
  return Buffer.concat([body, createHash('sha256').update(body).digest()]);
}

/** Builds an envelope with an arbitrary header JSON, a valid header digest and a valid payload CRC trailer. */
function forge(header: unknown, payload: Buffer, version = ENVELOPE_VERSION): Buffer {
  return Buffer.concat([formatHead(Buffer.from(JSON.stringify(header)), version), payload, envelopeTrailer(crc32(payload))]);
}

function headerOf(env: Buffer): Record<string, unknown> {
  const n = env.readUInt32BE(8);
  return JSON.parse(env.subarray(12, 12 + n).toString());
}

describe('envelope', () => {
  it('round trip: header fields filled in, payload is a view', () => {
    const env = encodeEnvelope(HDR, PAYLOAD);
    assert.equal(env.subarray(0, 4).toString(), 'PDKV');
    const { header, payload } = decodeEnvelope(env, EXPECT);
    assert.deepEqual(header, {
      version: ENVELOPE_VERSION,
      ...HDR,
      payloadBytes: PAYLOAD.length,
      checksum: 'crc32',
    });
    assert.ok(payload.equals(PAYLOAD));
    assert.equal(payload.buffer, env.buffer, 'payload shares memory with the envelope');
  });

  it('empty payload round-trips', () => {
    const { payload } = decodeEnvelope(encodeEnvelope({ ...HDR, nTokens: 0 }, Buffer.alloc(0)), EXPECT);
    assert.equal(payload.length, 0);
  });

  it('every truncation is refused', () => {
    const env = encodeEnvelope(HDR, PAYLOAD);
    for (let n = 0; n < env.length; n++) bad(() => decodeEnvelope(env.subarray(0, n), EXPECT), /truncated/);
  });

  it('trailing bytes are refused', () => {
    const env = encodeEnvelope(HDR, PAYLOAD);
    bad(() => decodeEnvelope(Buffer.concat([env, Buffer.from([0])]), EXPECT), /1 trailing bytes/);
  });

  it('a flipped byte anywhere is refused', () => {
    const env = encodeEnvelope(HDR, PAYLOAD);
    for (let i = 0; i < env.length; i++) {
      for (const mask of [0x01, 0x80]) {
        const c = Buffer.from(env);
        c[i] ^= mask;
        assert.throws(() => decodeEnvelope(c, EXPECT), (e: unknown) => e instanceof KvError && e.code === 'BAD_ENVELOPE', `byte ${i} ^ ${mask}`);
      }
    }
  });

  it('random corruption never throws anything but BAD_ENVELOPE', () => {
    const env = encodeEnvelope(HDR, PAYLOAD.subarray(0, 64));
    fc.assert(
      // distinct positions: two flips of one byte by the same mask would cancel out and leave the
      // envelope intact (fast-check found [[111589494,7],[1460364526,7]])
      fc.property(fc.uniqueArray(fc.tuple(fc.nat({ max: env.length - 1 }), fc.integer({ min: 1, max: 255 })), { minLength: 1, maxLength: 4, selector: (f) => f[0] }), fc.nat(), (flips, cut) => {
        const c = Buffer.from(env);
        for (const [p, x] of flips) c[p] ^= x;
        for (const b of [c, c.subarray(0, cut % (c.length + 1))]) {
          assert.throws(() => decodeEnvelope(b, EXPECT), (e: unknown) => e instanceof KvError && e.code === 'BAD_ENVELOPE');
        }
      }),
      { numRuns: 2000 },
    );
    fc.assert(
      fc.property(fc.uint8Array({ maxLength: 400 }), (bytes) => {
        const b = Buffer.from(bytes);
        if (b.length >= 4) b.write('PDKV', 0, 'ascii');
        if (b.length >= 8) b.writeUInt32BE(1, 4);
        assert.throws(() => decodeEnvelope(b, EXPECT), (e: unknown) => e instanceof KvError && e.code === 'BAD_ENVELOPE');
      }),
      { numRuns: 2000 },
    );
  });

  it('precise reasons for prefix problems', () => {
    const env = encodeEnvelope(HDR, PAYLOAD);
    const m = Buffer.from(env);
    m.write('GGUF', 0, 'ascii');
    bad(() => decodeEnvelope(m, EXPECT), /bad magic "GGUF"/);
    bad(() => decodeEnvelope(forge(headerOf(env), PAYLOAD, 1), EXPECT), /unsupported envelope version 1/);
    const l = Buffer.from(env);
    l.writeUInt32BE(0xffffffff, 8);
    bad(() => decodeEnvelope(l, EXPECT), /bad header length 4294967295/);
    l.writeUInt32BE(1, 8);
    bad(() => decodeEnvelope(l, EXPECT), /bad header length 1/);
    const d = Buffer.from(env);
    d[20] ^= 1;
    bad(() => decodeEnvelope(d, EXPECT), /header digest mismatch/);
    const p = Buffer.from(env);
    p[p.length - 1] ^= 1;
    bad(() => decodeEnvelope(p, EXPECT), /payload checksum mismatch/);
  });

  it('header JSON and field types are validated', () => {
    const good = headerOf(encodeEnvelope(HDR, PAYLOAD));
    const json = Buffer.from('{not json');
    const pre = Buffer.alloc(12);
    pre.write('PDKV');
    pre.writeUInt32BE(ENVELOPE_VERSION, 4);
    pre.writeUInt32BE(json.length, 8);
    const head = Buffer.concat([pre, json]);
    bad(() => decodeEnvelope(Buffer.concat([head, createHash('sha256').update(head).digest()]), EXPECT), /not valid UTF-8 JSON/);
    bad(() => decodeEnvelope(forge([1, 2], PAYLOAD), EXPECT), /bad header/);
    bad(() => decodeEnvelope(forge({ ...good, nTokens: '37' }, PAYLOAD), EXPECT), /bad header: nTokens/);
    bad(() => decodeEnvelope(forge({ ...good, nTokens: -1 }, PAYLOAD), EXPECT), /bad header: nTokens/);
    bad(() => decodeEnvelope(forge({ ...good, firstIsEog: 1 }, PAYLOAD), EXPECT), /bad header: firstIsEog/);
    bad(() => decodeEnvelope(forge({ ...good, checksum: 'abc' }, PAYLOAD), EXPECT), /bad header: checksum/);
    bad(() => decodeEnvelope(forge({ ...good, extra: 1 }, PAYLOAD), EXPECT), /bad header/);
    const { payloadBytes: _omit, ...noBytes } = good;
    bad(() => decodeEnvelope(forge(noBytes, PAYLOAD), EXPECT), /bad header: payloadBytes/);
    bad(() => decodeEnvelope(forge({ ...good, version: 3 }, PAYLOAD), EXPECT), /header version 3 differs/);
    bad(() => decodeEnvelope(forge({ ...good, payloadBytes: PAYLOAD.length + 1 }, PAYLOAD), EXPECT), /truncated payload: 1000 of 1001/);
    bad(() => decodeEnvelope(forge({ ...good, payloadBytes: PAYLOAD.length - 1 }, PAYLOAD), EXPECT), /1 trailing bytes/);
  });

  it('a state from another model is refused with a clear message', () => {
    const env = encodeEnvelope({ ...HDR, fingerprint: FP_B }, PAYLOAD);
    bad(() => decodeEnvelope(env, EXPECT), new RegExp(`state was produced by a different model: .*${FP_B.slice(0, 16)}.*${FP.slice(0, 16)}`));
  });

  it('context setting mismatches are refused', () => {
    bad(() => decodeEnvelope(encodeEnvelope({ ...HDR, contextSize: 2048 }, PAYLOAD), EXPECT), /context setting mismatch: state has contextSize 2048, this context has 4096/);
    bad(() => decodeEnvelope(encodeEnvelope({ ...HDR, batchSize: 256 }, PAYLOAD), EXPECT), /context setting mismatch: state has batchSize 256/);
    bad(() => decodeEnvelope(encodeEnvelope({ ...HDR, nTokens: 5000 }, PAYLOAD), EXPECT), /5000 tokens, more than contextSize 4096/);
  });

  it('payload over the limit is refused before hashing', () => {
    bad(() => decodeEnvelope(encodeEnvelope(HDR, PAYLOAD), { ...EXPECT, maxPayloadBytes: 999 }), /payload of 1000 bytes exceeds the limit of 999/);
  });

  it('encode refuses invalid header fields', () => {
    bad(() => encodeEnvelope({ ...HDR, nTokens: 1.5 }, PAYLOAD), /cannot encode envelope: nTokens/);
    bad(() => encodeEnvelope({ ...HDR, fingerprint: '' }, PAYLOAD), /cannot encode envelope: fingerprint/);
  });

  it('layout: prefix, header, digest, payload, CRC-32 trailer (zlib polynomial: crc32("123456789") = 0xcbf43926)', () => {
    const env = encodeEnvelope(HDR, PAYLOAD);
    const n = env.readUInt32BE(8);
    assert.equal(env.readUInt32BE(4), ENVELOPE_VERSION);
    assert.equal(env.length, ENVELOPE_PREFIX_BYTES + n + ENVELOPE_DIGEST_BYTES + PAYLOAD.length + 4);
    assert.ok(env.subarray(env.length - 4 - PAYLOAD.length, env.length - 4).equals(PAYLOAD));
    assert.equal(env.readUInt32BE(env.length - 4), crc32(PAYLOAD));
    assert.equal(crc32(Buffer.from('123456789')), 0xcbf43926);
  });
});

describe('prepareEnvelopeHead (the head made before the payload size is known)', () => {
  /** The head as the format defines it, built independently: prefix, JSON.stringify of the full header, sha256. */
  const reference = (h: Record<string, unknown>, payloadBytes: number): Buffer => {
    const { cachedTokens, ...rest } = h;
    const full = { version: ENVELOPE_VERSION, fingerprint: rest.fingerprint, contextSize: rest.contextSize, batchSize: rest.batchSize, nTokens: rest.nTokens, firstToken: rest.firstToken, ...(cachedTokens !== undefined ? { cachedTokens } : {}), firstIsEog: rest.firstIsEog, payloadBytes, checksum: 'crc32' };
    return formatHead(Buffer.from(JSON.stringify(full)));
  };

  it('gives the bytes of the format for any size, and parses back (with and without cachedTokens, odd fingerprints)', () => {
    const heads = [HDR, { ...HDR, cachedTokens: 12 }, { ...HDR, fingerprint: 'x","payloadBytes":0,"y' }, { ...HDR, fingerprint: 'ü"payloadBytes":0' }];
    for (const h of heads) {
      const make = prepareEnvelopeHead(h);
      for (const n of [0, 1, 9, 10, 1050089, 67109020, Number.MAX_SAFE_INTEGER]) {
        const head = make(n);
        assert.deepEqual(head, reference(h, n), `${JSON.stringify(h)} ${n}`);
        assert.deepEqual(head, encodeEnvelopeHead({ ...h, payloadBytes: n }));
        const parsed = parseEnvelopeHead(head, { ...EXPECT, fingerprint: h.fingerprint, maxPayloadBytes: Number.MAX_SAFE_INTEGER });
        assert.equal(parsed?.headBytes, head.length);
        assert.equal(parsed?.header.payloadBytes, n);
        assert.equal(parsed?.header.cachedTokens, (h as { cachedTokens?: number }).cachedTokens);
      }
    }
  });

  it('refuses invalid fields when prepared, an invalid size when called', () => {
    bad(() => prepareEnvelopeHead({ ...HDR, nTokens: -1 }), /cannot encode envelope: nTokens/);
    bad(() => prepareEnvelopeHead({ ...HDR, fingerprint: '' }), /cannot encode envelope: fingerprint/);
    const make = prepareEnvelopeHead(HDR);
    for (const n of [-1, 1.5, NaN, Number.MAX_SAFE_INTEGER + 1]) bad(() => make(n), /cannot encode envelope: payloadBytes/);
    bad(() => encodeEnvelopeHead({ ...HDR, payloadBytes: -3 }), /cannot encode envelope: payloadBytes/);
  });
});

describe('the hand check of the envelope header (before zod)', () => {
  const anyVal = fc.oneof(
    fc.constantFrom(0, -0, 1, -1, 1.5, 2, Number.MAX_SAFE_INTEGER, Number.MAX_SAFE_INTEGER + 1, NaN, Infinity, null, true, false, '', 'crc32', 'CRC32', 'a'.repeat(256), 'a'.repeat(257), '12'),
    fc.string({ maxLength: 6 }),
    fc.integer(),
    fc.constant({}),
    fc.constant([]),
  );
  const ok = { version: ENVELOPE_VERSION, fingerprint: FP, contextSize: 4096, batchSize: 512, nTokens: 37, firstToken: 1234, cachedTokens: 16, firstIsEog: false, payloadBytes: 1000, checksum: 'crc32' };
  const field = <K extends keyof typeof ok>(k: K) => fc.oneof({ weight: 3, arbitrary: fc.constant(ok[k]) }, { weight: 1, arbitrary: anyVal });
  const hdrArb = (requiredKeys: (keyof typeof ok | 'extra')[]) => fc.record(
    {
      version: field('version'),
      fingerprint: field('fingerprint'),
      contextSize: field('contextSize'),
      batchSize: field('batchSize'),
      nTokens: field('nTokens'),
      firstToken: field('firstToken'),
      cachedTokens: field('cachedTokens'),
      firstIsEog: field('firstIsEog'),
      payloadBytes: field('payloadBytes'),
      checksum: field('checksum'),
      extra: anyVal,
    },
    { requiredKeys },
  );
  // the valid header with ONE key changed, deleted or added (every rule is met alone), or any mix
  const oneOff = fc.tuple(fc.constantFrom(...Object.keys(ok), 'extra', '__proto__'), anyVal, fc.boolean()).map(([k, v, del]) => {
    const h: Record<string, unknown> = { ...ok };
    if (del) delete h[k];
    else Object.defineProperty(h, k, { value: v, enumerable: true, writable: true, configurable: true });
    return h;
  });

  it('accepts exactly what the strict zod schema accepts, with the same result', () => {
    let fast = 0;
    fc.assert(
      fc.property(fc.oneof({ weight: 4, arbitrary: oneOff }, { weight: 1, arbitrary: hdrArb([]) }, { weight: 1, arbitrary: anyVal }), (h) => {
        const z = HeaderSchema.safeParse(h);
        const c = checkHeader(h);
        if (c) fast++;
        assert.equal(c !== undefined, z.success, `hand check ${c ? 'accepts' : 'refuses'}, zod ${z.success ? 'accepts' : 'refuses'}: ${JSON.stringify(h)}`);
        if (c) assert.deepEqual(c, z.data);
      }),
      { numRuns: 3000 },
    );
    assert.ok(fast > 20, `only ${fast} of 3000 headers were valid`);
  });

  it('a refused header still gets zod\'s wording from parseEnvelopeHead', () => {
    const json = Buffer.from(JSON.stringify({ ...ok, nTokens: -1 }));
    const pre = Buffer.alloc(ENVELOPE_PREFIX_BYTES);
    Buffer.from('PDKV').copy(pre, 0);
    pre.writeUInt32BE(ENVELOPE_VERSION, 4);
    pre.writeUInt32BE(json.length, 8);
    const body = Buffer.concat([pre, json]);
    const head = Buffer.concat([body, createHash('sha256').update(body).digest()]);
    assert.throws(() => parseEnvelopeHead(head, EXPECT), (e: unknown) => e instanceof KvError && e.code === 'BAD_ENVELOPE' && /bad header: nTokens/.test(e.message));
  });
});
