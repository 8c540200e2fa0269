/**
 * Binary envelope around a llama.cpp sequence state (the blob prefill sends to decode).
 *
 *   "PDKV" | u32 BE version | u32 BE header length H | header JSON (H bytes, UTF-8)
 *        | sha256(all preceding bytes) (32 raw bytes) | payload (header.payloadBytes bytes)
 *
 * The header is an EnvelopeHeader (messages.ts); `checksum` is the sha256 of the payload and the
 * 32-byte header digest covers magic, version, length and header JSON, so a flipped byte
 * anywhere (a digit of nTokens included) is detected. decodeEnvelope validates everything before
 * anything reaches llama.cpp. Pure functions; every problem is a KvError('BAD_ENVELOPE', reason).
 */
import { createHash } from 'node:crypto';
import { z } from 'zod';
import type { EnvelopeHeader } from './messages.js';
import { KvError } from './types.js';

export const ENVELOPE_MAGIC = Buffer.from('PDKV', 'ascii');
/** Current envelope format version (the u32 after the magic, and header.version). */
export const ENVELOPE_VERSION = 1;
/** Largest header JSON, bytes. */
export const MAX_ENVELOPE_HEADER_BYTES = 16 * 1024;
/** Bytes before the header JSON: magic + version + header length. */
export const ENVELOPE_PREFIX_BYTES = 12;
/** Bytes of the header digest that follows the header JSON. */
export const ENVELOPE_DIGEST_BYTES = 32;

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
const HeaderSchema = z
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
    checksum: z.string().regex(/^[0-9a-f]{64}$/, 'must be 64 lowercase hex chars'),
  })
  .strict();

type Same<A, B> = [A] extends [B] ? ([B] extends [A] ? true : false) : false;
const _headerSchemaMatches: Same<z.infer<typeof HeaderSchema>, EnvelopeHeader> = true;
void _headerSchemaMatches;

const bad = (reason: string): KvError => new KvError('BAD_ENVELOPE', reason);
const utf8 = new TextDecoder('utf-8', { fatal: true });
const sha256 = (...parts: Buffer[]): Buffer => {
  const h = createHash('sha256');
  for (const p of parts) h.update(p);
  return h.digest();
};

/**
 * Wraps `payload` (a llama.cpp sequence state, copied once) in an envelope. version, payloadBytes
 * and checksum are filled in. Throws KvError('BAD_ENVELOPE') if a header field is invalid.
 */
export function encodeEnvelope(header: Omit<EnvelopeHeader, 'payloadBytes' | 'checksum' | 'version'>, payload: Buffer): Buffer {
  const full: EnvelopeHeader = {
    version: ENVELOPE_VERSION,
    fingerprint: header.fingerprint,
    contextSize: header.contextSize,
    batchSize: header.batchSize,
    nTokens: header.nTokens,
    firstToken: header.firstToken,
    ...(header.cachedTokens !== undefined ? { cachedTokens: header.cachedTokens } : {}),
    firstIsEog: header.firstIsEog,
    payloadBytes: payload.length,
    checksum: sha256(payload).toString('hex'),
  };
  const r = HeaderSchema.safeParse(full);
  if (!r.success) throw bad(`cannot encode envelope: ${issue(r.error)}`);
  const json = Buffer.from(JSON.stringify(full), 'utf8');
  if (json.length > MAX_ENVELOPE_HEADER_BYTES) throw bad(`cannot encode envelope: header of ${json.length} bytes exceeds ${MAX_ENVELOPE_HEADER_BYTES}`);
  const headEnd = ENVELOPE_PREFIX_BYTES + json.length;
  const out = Buffer.allocUnsafe(headEnd + ENVELOPE_DIGEST_BYTES + payload.length);
  ENVELOPE_MAGIC.copy(out, 0);
  out.writeUInt32BE(ENVELOPE_VERSION, 4);
  out.writeUInt32BE(json.length, 8);
  json.copy(out, ENVELOPE_PREFIX_BYTES);
  sha256(out.subarray(0, headEnd)).copy(out, headEnd);
  payload.copy(out, headEnd + ENVELOPE_DIGEST_BYTES);
  return out;
}

/**
 * Validates an envelope and returns its header and payload (`payload` is a view into `buf`, not
 * a copy). Throws KvError('BAD_ENVELOPE', reason) on: truncation, bad magic, unsupported version,
 * bad header length, header digest mismatch, bad JSON or field types, payload over
 * maxPayloadBytes, trailing bytes, fingerprint mismatch ("state was produced by a different
 * model: …"), context setting mismatch, nTokens > contextSize, payload checksum mismatch.
 */
export function decodeEnvelope(buf: Buffer, expect: EnvelopeExpect): { header: EnvelopeHeader; payload: Buffer } {
  if (buf.length < ENVELOPE_PREFIX_BYTES) throw bad(`truncated envelope: ${buf.length} bytes, the prefix alone is ${ENVELOPE_PREFIX_BYTES}`);
  if (!buf.subarray(0, 4).equals(ENVELOPE_MAGIC)) throw bad(`bad magic ${JSON.stringify(buf.subarray(0, 4).toString('latin1'))}, expected "PDKV"`);
  const version = buf.readUInt32BE(4);
  if (version !== ENVELOPE_VERSION) throw bad(`unsupported envelope version ${version}, this build reads ${ENVELOPE_VERSION}`);
  const hlen = buf.readUInt32BE(8);
  if (hlen < 2 || hlen > MAX_ENVELOPE_HEADER_BYTES) throw bad(`bad header length ${hlen} (allowed 2..${MAX_ENVELOPE_HEADER_BYTES})`);
  const headEnd = ENVELOPE_PREFIX_BYTES + hlen;
  const payloadStart = headEnd + ENVELOPE_DIGEST_BYTES;
  if (buf.length < payloadStart) throw bad(`truncated envelope: ${buf.length} bytes, header and digest need ${payloadStart}`);
  if (!sha256(buf.subarray(0, headEnd)).equals(buf.subarray(headEnd, payloadStart))) throw bad('header digest mismatch: envelope header is corrupted');

  let raw: unknown;
  try {
    raw = JSON.parse(utf8.decode(buf.subarray(ENVELOPE_PREFIX_BYTES, headEnd)));
  } catch (e) {
    throw bad(`header is not valid UTF-8 JSON: ${(e as Error).message.slice(0, 100)}`);
  }
  const r = HeaderSchema.safeParse(raw);
  if (!r.success) throw bad(`bad header: ${issue(r.error)}`);
  const header: EnvelopeHeader = r.data;
  if (header.version !== version) throw bad(`header version ${header.version} differs from envelope version ${version}`);

  if (header.fingerprint !== expect.fingerprint) {
    throw bad(`state was produced by a different model: its fingerprint is ${header.fingerprint.slice(0, 16)}…, this model's is ${expect.fingerprint.slice(0, 16)}…`);
  }
  if (header.contextSize !== expect.contextSize) throw bad(`context setting mismatch: state has contextSize ${header.contextSize}, this context has ${expect.contextSize}`);
  if (header.batchSize !== expect.batchSize) throw bad(`context setting mismatch: state has batchSize ${header.batchSize}, this context has ${expect.batchSize}`);
  if (header.nTokens > header.contextSize) throw bad(`state holds ${header.nTokens} tokens, more than contextSize ${header.contextSize}`);

  if (header.payloadBytes > expect.maxPayloadBytes) throw bad(`payload of ${header.payloadBytes} bytes exceeds the limit of ${expect.maxPayloadBytes}`);
  const have = buf.length - payloadStart;
  if (have < header.payloadBytes) throw bad(`truncated payload: ${have} of ${header.payloadBytes} bytes`);
  if (have > header.payloadBytes) throw bad(`${have - header.payloadBytes} trailing bytes after the payload`);
  const payload = buf.subarray(payloadStart);
  if (sha256(payload).toString('hex') !== header.checksum) throw bad('payload checksum mismatch: state is corrupted');
  return { header, payload };
}

function issue(err: z.ZodError): string {
  const i = err.issues[0];
  return i ? `${i.path.join('.') || '(root)'}: ${i.message}` : 'invalid';
}
