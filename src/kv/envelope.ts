/**
 * Binary envelope around a llama.cpp sequence state (the bytes prefill streams to decode).
 *
 *   "PDKV" | u32 BE version | u32 BE header length H | header JSON (H bytes, UTF-8)
 *        | sha256(all preceding bytes) (32 raw bytes)            ← the "head", parsed first
 *        | payload (header.payloadBytes bytes, the ggsq file)
 *        | u32 BE CRC-32 of the payload                           ← trailer
 *
 * Version 2: the payload check is a CRC-32 trailer computed while the bytes stream (checksum.ts),
 * so the sender never reads the state twice and the head can go out before the payload is read;
 * the header's `checksum` names the algorithm ('crc32'). The 32-byte head digest covers magic,
 * version, length and header JSON, so a flipped byte anywhere in the head is detected before any
 * field is trusted. `parseEnvelopeHead` validates a head as soon as its bytes are in (decode
 * refuses a state from another model before its payload arrives); `decodeEnvelope` checks a whole
 * envelope. Pure functions; every problem is a KvError('BAD_ENVELOPE', reason).
 */
import { hash } from 'node:crypto';
import { z } from 'zod';
import type { EnvelopeHeader } from './messages.js';
import { CHECKSUM_ALGO, crc32 } from './transfer/checksum.js';
import { KvError } from './types.js';

export const ENVELOPE_MAGIC = Buffer.from('PDKV', 'ascii');
/** Current envelope format version (the u32 after the magic, and header.version). */
export const ENVELOPE_VERSION = 2;
/** Largest header JSON, bytes. */
export const MAX_ENVELOPE_HEADER_BYTES = 16 * 1024;
/** Bytes before the header JSON: magic + version + header length. */
export const ENVELOPE_PREFIX_BYTES = 12;
/** Bytes of the header digest that follows the header JSON. */
export const ENVELOPE_DIGEST_BYTES = 32;
/** Bytes of the payload checksum after the payload. */
export const ENVELOPE_TRAILER_BYTES = 4;

/** What the loading side requires of a state; all must match exactly (payload size: at most). */
export interface EnvelopeExpect {
  /** sha256 of the local GGUF, hex (EngineInfo.fingerprint). */
  fingerprint: string;
  contextSize: number;
  batchSize: number;
  /** Largest payload accepted, bytes. */
  maxPayloadBytes: number;
}

const int = z.number().int().min(0).max(Number.MAX_SAFE_INTEGER);
/** zod schema of the envelope header (strict). Exported for the fast check's test; parseEnvelopeHead is the API. @internal */
export const HeaderSchema = z
  .object({
    version: int,
    fingerprint: z.string().min(1).max(256),
    contextSize: int.min(1),
    batchSize: int.min(1),
    nTokens: int,
    firstToken: int,
    cachedTokens: int.optional(),
    firstIsEog: z.boolean(),
    payloadBytes: int,
    checksum: z.literal(CHECKSUM_ALGO),
  })
  .strict();

const HEADER_KEYS = new Set(Object.keys(HeaderSchema.shape));
const safeCount = (v: unknown, min = 0): v is number => Number.isSafeInteger(v) && (v as number) >= min;

/**
 * The envelope header checked by hand, by exactly HeaderSchema's rules (strict: no other key;
 * the result is a new object of its keys in schema order). Undefined when anything is off:
 * parseEnvelopeHead then runs HeaderSchema, which refuses it with its usual wording (nothing is
 * accepted here that zod would refuse; test/unit/envelope.test.ts compares both). Why: zod's
 * safeParse of this header took ~50–100 µs in a process that had been idle for a few ms (cold
 * caches; far less when hot) on the handoff's critical path (every TCP receive and every
 * same-host take); this check takes a few µs. Exported for that test only.
 * @internal
 */
export function checkHeader(v: unknown): EnvelopeHeader | undefined {
  if (typeof v !== 'object' || v === null || Array.isArray(v)) return undefined;
  const o = v as Record<string, unknown>;
  for (const k of Object.keys(o)) if (!HEADER_KEYS.has(k)) return undefined;
  const { version, fingerprint, contextSize, batchSize, nTokens, firstToken, cachedTokens, firstIsEog, payloadBytes, checksum } = o;
  if (!safeCount(version) || typeof fingerprint !== 'string' || fingerprint.length < 1 || fingerprint.length > 256) return undefined;
  if (!safeCount(contextSize, 1) || !safeCount(batchSize, 1) || !safeCount(nTokens) || !safeCount(firstToken)) return undefined;
  if (typeof firstIsEog !== 'boolean' || !safeCount(payloadBytes) || checksum !== CHECKSUM_ALGO) return undefined;
  if (cachedTokens === undefined) return { version, fingerprint, contextSize, batchSize, nTokens, firstToken, firstIsEog, payloadBytes, checksum };
  if (!safeCount(cachedTokens)) return undefined;
  return { version, fingerprint, contextSize, batchSize, nTokens, firstToken, cachedTokens, firstIsEog, payloadBytes, checksum };
}

type Same<A, B> = [A] extends [B] ? ([B] extends [A] ? true : false) : false;
const _headerSchemaMatches: Same<z.infer<typeof HeaderSchema>, EnvelopeHeader> = true;
void _headerSchemaMatches;

const bad = (reason: string): KvError => new KvError('BAD_ENVELOPE', reason);
const utf8 = new TextDecoder('utf-8', { fatal: true });
/** One-shot SHA-256 (crypto.hash, Node ≥ 20.12: no Hash object; 16 against 66 µs for a head in a process idle for a few ms). */
const sha256 = (data: Buffer): Buffer => hash('sha256', data, 'buffer');

/**
 * The envelope's head (prefix, header JSON, digest) for a payload of `header.payloadBytes`
 * bytes; version and checksum are filled in. Throws KvError('BAD_ENVELOPE') if a field is invalid.
 * Same bytes as `prepareEnvelopeHead(header)(header.payloadBytes)`.
 */
export function encodeEnvelopeHead(header: Omit<EnvelopeHeader, 'checksum' | 'version'>): Buffer {
  return prepareEnvelopeHead(header)(header.payloadBytes);
}

/**
 * Everything of an envelope head except the payload's size, done ahead: every field validated
 * (HeaderSchema's rules; checkHeader's hand check, zod only to word a refusal) and the header
 * JSON built around the size. The returned function makes the head for a payload of
 * `payloadBytes` bytes (a safe non-negative integer, else KvError('BAD_ENVELOPE')): the size
 * spliced into the JSON, the length checked, prefix and SHA-256 digest — a few µs. Prefill calls
 * this while llama.cpp saves the state (the size comes with the save), so the head's encode no
 * longer runs after the save on a CPU that sat idle through it (most of that cost was zod and cold
 * caches). `payloadBytes` in `header`, if any, is ignored.
 * @throws KvError('BAD_ENVELOPE') if a field is invalid (at once, not at the call).
 */
export function prepareEnvelopeHead(header: Omit<EnvelopeHeader, 'checksum' | 'version' | 'payloadBytes'> & { payloadBytes?: number }): (payloadBytes: number) => Buffer {
  const full: EnvelopeHeader = {
    version: ENVELOPE_VERSION,
    fingerprint: header.fingerprint,
    contextSize: header.contextSize,
    batchSize: header.batchSize,
    nTokens: header.nTokens,
    firstToken: header.firstToken,
    ...(header.cachedTokens !== undefined ? { cachedTokens: header.cachedTokens } : {}),
    firstIsEog: header.firstIsEog,
    payloadBytes: 0,
    checksum: CHECKSUM_ALGO,
  };
  if (!checkHeader(full)) {
    const r = HeaderSchema.safeParse(full);
    if (!r.success) throw bad(`cannot encode envelope: ${issue(r.error)}`);
  }
  // The size's place in the JSON: `"payloadBytes":0` cannot occur inside a string value (JSON
  // escapes the quotes there), so its one occurrence is the field itself.
  const json = JSON.stringify(full);
  const key = '"payloadBytes":0';
  const at = json.indexOf(key);
  if (at < 0) throw bad('cannot encode envelope: payloadBytes not found in the header JSON'); // unreachable
  const pre = json.slice(0, at + key.length - 1);
  const post = json.slice(at + key.length);
  return (payloadBytes: number): Buffer => {
    if (!safeCount(payloadBytes)) throw bad(`cannot encode envelope: payloadBytes: ${String(payloadBytes)} is not a safe non-negative integer`);
    const text = pre + String(payloadBytes) + post;
    const jsonLen = Buffer.byteLength(text, 'utf8');
    if (jsonLen > MAX_ENVELOPE_HEADER_BYTES) throw bad(`cannot encode envelope: header of ${jsonLen} bytes exceeds ${MAX_ENVELOPE_HEADER_BYTES}`);
    const headEnd = ENVELOPE_PREFIX_BYTES + jsonLen;
    const out = Buffer.allocUnsafe(headEnd + ENVELOPE_DIGEST_BYTES);
    ENVELOPE_MAGIC.copy(out, 0);
    out.writeUInt32BE(ENVELOPE_VERSION, 4);
    out.writeUInt32BE(jsonLen, 8);
    out.write(text, ENVELOPE_PREFIX_BYTES, jsonLen, 'utf8');
    sha256(out.subarray(0, headEnd)).copy(out, headEnd);
    return out;
  };
}

/** The 4-byte trailer carrying `crc` (u32). */
export function envelopeTrailer(crc: number): Buffer {
  const t = Buffer.allocUnsafe(ENVELOPE_TRAILER_BYTES);
  t.writeUInt32BE(crc >>> 0, 0);
  return t;
}

/**
 * Wraps `payload` (copied once) in a whole envelope: head, payload, CRC-32 trailer. Used by
 * tests and tools; the workers stream the same bytes (transfer/sender.ts).
 * Throws KvError('BAD_ENVELOPE') if a header field is invalid.
 */
export function encodeEnvelope(header: Omit<EnvelopeHeader, 'payloadBytes' | 'checksum' | 'version'>, payload: Buffer): Buffer {
  const head = encodeEnvelopeHead({ ...header, payloadBytes: payload.length });
  return Buffer.concat([head, payload, envelopeTrailer(crc32(payload))]);
}

/**
 * Validates the head at the start of `buf` as soon as it is complete: returns undefined while
 * more bytes are needed, else the header and the head's length (where the payload starts).
 * Throws KvError('BAD_ENVELOPE', reason) on: bad magic, unsupported version, bad header length,
 * header digest mismatch, bad JSON or field types, payload over maxPayloadBytes, fingerprint
 * mismatch ("state was produced by a different model: …"), context setting mismatch,
 * nTokens > contextSize.
 */
export function parseEnvelopeHead(buf: Buffer, expect: EnvelopeExpect): { header: EnvelopeHeader; headBytes: number } | undefined {
  if (buf.length >= 4 && !buf.subarray(0, 4).equals(ENVELOPE_MAGIC)) throw bad(`bad magic ${JSON.stringify(buf.subarray(0, 4).toString('latin1'))}, expected "PDKV"`);
  if (buf.length < ENVELOPE_PREFIX_BYTES) return undefined;
  const version = buf.readUInt32BE(4);
  if (version !== ENVELOPE_VERSION) throw bad(`unsupported envelope version ${version}, this build reads ${ENVELOPE_VERSION}`);
  const hlen = buf.readUInt32BE(8);
  if (hlen < 2 || hlen > MAX_ENVELOPE_HEADER_BYTES) throw bad(`bad header length ${hlen} (allowed 2..${MAX_ENVELOPE_HEADER_BYTES})`);
  const headEnd = ENVELOPE_PREFIX_BYTES + hlen;
  const payloadStart = headEnd + ENVELOPE_DIGEST_BYTES;
  if (buf.length < payloadStart) return undefined;
  if (!sha256(buf.subarray(0, headEnd)).equals(buf.subarray(headEnd, payloadStart))) throw bad('header digest mismatch: envelope header is corrupted');

  let raw: unknown;
  try {
    raw = JSON.parse(utf8.decode(buf.subarray(ENVELOPE_PREFIX_BYTES, headEnd)));
  } catch (e) {
    throw bad(`header is not valid UTF-8 JSON: ${(e as Error).message.slice(0, 100)}`);
  }
  let header = checkHeader(raw);
  if (!header) {
    const r = HeaderSchema.safeParse(raw);
    if (!r.success) throw bad(`bad header: ${issue(r.error)}`);
    header = r.data;
  }
  if (header.version !== version) throw bad(`header version ${header.version} differs from envelope version ${version}`);

  if (header.fingerprint !== expect.fingerprint) {
    throw bad(`state was produced by a different model: its fingerprint is ${header.fingerprint.slice(0, 16)}…, this model's is ${expect.fingerprint.slice(0, 16)}…`);
  }
  if (header.contextSize !== expect.contextSize) throw bad(`context setting mismatch: state has contextSize ${header.contextSize}, this context has ${expect.contextSize}`);
  if (header.batchSize !== expect.batchSize) throw bad(`context setting mismatch: state has batchSize ${header.batchSize}, this context has ${expect.batchSize}`);
  if (header.nTokens > header.contextSize) throw bad(`state holds ${header.nTokens} tokens, more than contextSize ${header.contextSize}`);
  if (header.payloadBytes > expect.maxPayloadBytes) throw bad(`payload of ${header.payloadBytes} bytes exceeds the limit of ${expect.maxPayloadBytes}`);
  return { header, headBytes: payloadStart };
}

/**
 * Validates a whole envelope and returns its header and payload (`payload` is a view into
 * `buf`, not a copy). Throws KvError('BAD_ENVELOPE', reason) on everything parseEnvelopeHead
 * refuses, and on truncation, trailing bytes, payload checksum mismatch.
 */
export function decodeEnvelope(buf: Buffer, expect: EnvelopeExpect): { header: EnvelopeHeader; payload: Buffer } {
  const head = parseEnvelopeHead(buf, expect);
  if (!head) throw bad(`truncated envelope: ${buf.length} bytes do not hold the whole head`);
  const { header, headBytes } = head;
  const have = buf.length - headBytes - ENVELOPE_TRAILER_BYTES;
  if (have < header.payloadBytes) throw bad(`truncated payload: ${Math.max(0, have)} of ${header.payloadBytes} bytes (+ ${ENVELOPE_TRAILER_BYTES}-byte checksum)`);
  if (have > header.payloadBytes) throw bad(`${have - header.payloadBytes} trailing bytes after the payload and checksum`);
  const payload = buf.subarray(headBytes, headBytes + header.payloadBytes);
  if (crc32(payload) !== buf.readUInt32BE(headBytes + header.payloadBytes)) throw bad('payload checksum mismatch: state is corrupted');
  return { header, payload };
}

function issue(err: z.ZodError): string {
  const i = err.issues[0];
  return i ? `${i.path.join('.') || '(root)'}: ${i.message}` : 'invalid';
}
