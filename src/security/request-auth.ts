/**
 * Signed requests to the workers' HTTP endpoints: a per-request HMAC-SHA256 over the method, the
 * path with its query, a timestamp, a nonce and the SHA-256 of the body, keyed by a key derived
 * from the cluster secret (domain-separated from the KV channel's challenge, ../kv/auth.ts).
 * The shape follows AWS SigV4 and HTTP Message Signatures (RFC 9421) in small:
 *
 *   x-pdserve-signature: v1 t=<unix ms> n=<32 hex nonce> s=<64 hex mac>
 *   mac = HMAC(K, "pdserve/v1|http|" METHOD "|" PATH "|" t "|" n "|" hex(SHA-256(body)))
 *   K   = HMAC(secret, "pdserve/v1|worker-http")
 *
 * Why not a bearer token derived from the secret: a token seen once (a log, a proxy, a core
 * dump of a client) is a credential forever; a signature is bound to one request and one moment.
 * The verifier refuses a signature older or newer than `windowMs` (clock skew included) and a
 * nonce it has seen; its replay cache is bounded: when full it forgets the oldest nonce and from
 * then on refuses every signature not newer than it (so a forgotten nonce can never be replayed).
 * Pure functions and one class over node:crypto; the HTTP glue is ./http-auth.ts (client) and
 * ../worker/auth.ts (server).
 */
import { createHash, createHmac, randomBytes, timingSafeEqual } from 'node:crypto';
import { systemClock } from '../base/clock.js';

/** The request header carrying the signature. */
export const SIGNATURE_HEADER = 'x-pdserve-signature';

/** Default validity window, ms either side of the verifier's clock. */
export const SIGNATURE_WINDOW_MS = 30_000;

/** Default bound on remembered nonces (≈ 100 B each). */
export const REPLAY_CACHE_ENTRIES = 100_000;

/** The HTTP signing key of a cluster secret (32 bytes). Throws TypeError on an empty secret. */
export function httpKeyOf(secret: string | Buffer): Buffer {
  if (secret.length === 0) throw new TypeError('cluster secret must not be empty');
  return createHmac('sha256', secret).update('pdserve/v1|worker-http', 'utf8').digest();
}

/** SHA-256 of a body (empty for none) as 64 hex chars. */
export function bodyDigest(body: string | Uint8Array | null | undefined): string {
  const h = createHash('sha256');
  if (body !== null && body !== undefined) h.update(body);
  return h.digest('hex');
}

/** The exact string that is MACed. */
export function signatureInput(method: string, path: string, t: number, nonce: string, digestHex: string): string {
  return `pdserve/v1|http|${method.toUpperCase()}|${path}|${t}|${nonce}|${digestHex}`;
}

/** HMAC-SHA256 of `signatureInput(...)` under `key`, 64 hex chars. */
export function signatureMac(key: Buffer, method: string, path: string, t: number, nonce: string, digestHex: string): string {
  return createHmac('sha256', key).update(signatureInput(method, path, t, nonce, digestHex), 'utf8').digest('hex');
}

/** The header value signing one request at time `now` (ms) with a fresh random nonce. */
export function signRequest(key: Buffer, method: string, path: string, digestHex: string, now = systemClock.wallMs(), nonce = randomBytes(16).toString('hex')): string {
  return `v1 t=${now} n=${nonce} s=${signatureMac(key, method, path, now, nonce, digestHex)}`;
}

/** A parsed signature header. */
export interface Signature {
  t: number;
  nonce: string;
  mac: string;
}

const HEADER_RE = /^v1 t=(\d{1,16}) n=([0-9a-f]{32}) s=([0-9a-f]{64})$/;

/** Parse a signature header; null when absent or malformed (never throws). */
export function parseSignature(v: unknown): Signature | null {
  if (typeof v !== 'string') return null;
  const m = HEADER_RE.exec(v);
  return m ? { t: Number(m[1]), nonce: m[2]!, mac: m[3]! } : null;
}

/** Why a signature was refused. */
export type RefusalReason = 'missing' | 'malformed' | 'expired' | 'replayed' | 'bad_signature';

/**
 * Checks signatures in two steps, so an unauthenticated body is never parsed: `precheck` (the
 * header, the window, the nonce unseen; on the head of the request) and `verify` (the mac over
 * the body's digest, then the nonce is remembered; atomic, so two copies of one request in flight
 * cannot both pass).
 */
export class SignatureVerifier {
  /** nonce → t, in insertion order (the oldest first). */
  private readonly seen = new Map<string, number>();
  /** Signatures with t ≤ floor are refused: their nonces may have been forgotten. */
  private floor = -Infinity;

  constructor(
    private readonly key: Buffer,
    private readonly windowMs = SIGNATURE_WINDOW_MS,
    private readonly maxEntries = REPLAY_CACHE_ENTRIES,
  ) {}

  /** Remembered nonces (≤ maxEntries). */
  get size(): number {
    return this.seen.size;
  }

  /** First step: the parsed signature, or why it is refused before the body is read. */
  precheck(header: unknown, now: number): Signature | RefusalReason {
    if (header === undefined) return 'missing';
    const sig = parseSignature(header);
    if (!sig) return 'malformed';
    if (Math.abs(now - sig.t) > this.windowMs || sig.t <= this.floor) return 'expired';
    if (this.seen.has(sig.nonce)) return 'replayed';
    return sig;
  }

  /** Second step: null when the mac is right and the nonce is new (then remembered), else why not. */
  verify(sig: Signature, method: string, path: string, digestHex: string, now: number): RefusalReason | null {
    const want = Buffer.from(signatureMac(this.key, method, path, sig.t, sig.nonce, digestHex), 'hex');
    if (!timingSafeEqual(want, Buffer.from(sig.mac, 'hex'))) return 'bad_signature';
    if (Math.abs(now - sig.t) > this.windowMs || sig.t <= this.floor) return 'expired';
    if (this.seen.has(sig.nonce)) return 'replayed';
    this.remember(sig, now);
    return null;
  }

  private remember(sig: Signature, now: number): void {
    // Nonces whose signatures are out of the window can go: those would be refused as expired.
    for (const [n, t] of this.seen) {
      if (t >= now - this.windowMs) break;
      this.seen.delete(n);
    }
    // Insertion order is arrival order, not t order: drop the oldest arrivals while full.
    while (this.seen.size >= this.maxEntries) {
      const [n, t] = this.seen.entries().next().value as [string, number];
      this.seen.delete(n);
      this.floor = Math.max(this.floor, t);
    }
    this.seen.set(sig.nonce, sig.t);
  }
}
