/**
 * Signed worker requests (src/security/request-auth.ts): a signature is good for one request, one
 * moment and one body; the replay cache is bounded and, once it forgot a nonce, refuses every
 * signature not newer than it. Decode's known prefills (src/decode/known-prefills.ts).
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import fc from 'fast-check';
import { bodyDigest, httpKeyOf, parseSignature, signRequest, SignatureVerifier, type Signature } from '../../src/security/request-auth.js';
import { KnownPrefills } from '../../src/decode/known-prefills.js';

const key = httpKeyOf('cluster-secret-1');
const now = 1_700_000_000_000;

function check(v: SignatureVerifier, header: string, method: string, path: string, body: string, at = now): string | null {
  const pre = v.precheck(header, at);
  if (typeof pre === 'string') return pre;
  return v.verify(pre, method, path, bodyDigest(body), at);
}

describe('SignatureVerifier', () => {
  test('accepts a fresh signature once; refuses a replay, an old one, another body, path, method or key', () => {
    const v = new SignatureVerifier(key, 30_000, 100);
    const h = signRequest(key, 'POST', '/generate', bodyDigest('{"a":1}'), now);
    assert.equal(check(v, h, 'POST', '/generate', '{"a":1}'), null);
    assert.equal(check(v, h, 'POST', '/generate', '{"a":1}'), 'replayed');
    assert.equal(check(v, signRequest(key, 'POST', '/generate', bodyDigest('{"a":1}'), now - 31_000), 'POST', '/generate', '{"a":1}'), 'expired');
    assert.equal(check(v, signRequest(key, 'POST', '/generate', bodyDigest('{"a":1}'), now + 31_000), 'POST', '/generate', '{"a":1}'), 'expired');
    assert.equal(check(v, signRequest(key, 'POST', '/generate', bodyDigest('{"a":1}'), now), 'POST', '/generate', '{"a":2}'), 'bad_signature');
    assert.equal(check(v, signRequest(key, 'POST', '/generate', bodyDigest(''), now), 'POST', '/abort_request', ''), 'bad_signature');
    assert.equal(check(v, signRequest(key, 'GET', '/debug/rooms', bodyDigest(''), now), 'POST', '/debug/rooms', ''), 'bad_signature');
    assert.equal(check(v, signRequest(httpKeyOf('other-secret'), 'GET', '/x', bodyDigest(''), now), 'GET', '/x', ''), 'bad_signature');
    assert.equal(check(v, 'v1 t=1 n=zz s=00', 'GET', '/x', ''), 'malformed');
    assert.equal(v.precheck(undefined, now), 'missing');
  });

  test('a bad signature does not burn the nonce of the real request', () => {
    const v = new SignatureVerifier(key);
    const h = signRequest(key, 'POST', '/generate', bodyDigest('real'), now);
    assert.equal(check(v, h, 'POST', '/generate', 'forged'), 'bad_signature');
    assert.equal(check(v, h, 'POST', '/generate', 'real'), null);
  });

  test('property: with a bounded cache, no signature is ever accepted twice, and the cache never exceeds its bound', () => {
    fc.assert(
      fc.property(fc.array(fc.tuple(fc.nat(40), fc.integer({ min: -20_000, max: 20_000 })), { minLength: 1, maxLength: 200 }), (plan) => {
        const v = new SignatureVerifier(key, 30_000, 8);
        const made: string[] = [];
        const accepted = new Set<string>();
        let t = now;
        for (const [pick, skew] of plan) {
          t += 100;
          // either a new signature (with clock skew) or a replay of an earlier one
          const h = pick < made.length ? made[pick]! : signRequest(key, 'GET', '/debug/rooms', bodyDigest(''), t + skew);
          if (pick >= made.length) made.push(h);
          if (check(v, h, 'GET', '/debug/rooms', '', t) === null) {
            assert.ok(!accepted.has(h), 'accepted twice');
            accepted.add(h);
          }
          assert.ok(v.size <= 8);
        }
      }),
    );
  });

  test('parseSignature never throws on junk', () => {
    fc.assert(fc.property(fc.anything(), (x) => void parseSignature(x)));
    const s = parseSignature(signRequest(key, 'GET', '/', bodyDigest(''), now)) as Signature;
    assert.equal(s.t, now);
  });
});

describe('KnownPrefills', () => {
  test('the static list, and addresses learned from probes until their TTL', () => {
    const k = new KnownPrefills(['10.0.0.2:8998', '[::1]:9000'], 1000, 2);
    assert.ok(k.allows('10.0.0.2', 8998, now));
    assert.ok(k.allows('::1', 9000, now));
    assert.ok(!k.allows('10.0.0.3', 8998, now));
    k.learn(['127.0.0.1:7000', 'junk', '127.0.0.1:0'], now);
    assert.ok(k.allows('127.0.0.1', 7000, now + 1000));
    assert.ok(!k.allows('127.0.0.1', 7000, now + 1001), 'expired');
    k.learn(['a:1', 'b:2', 'c:3'], now);
    assert.ok(!k.allows('a', 1, now), 'bounded: the oldest learned address is forgotten');
    assert.ok(k.allows('c', 3, now));
    assert.throws(() => new KnownPrefills(['nope']), /HOST:PORT/);
  });
});
