/**
 * The handoff's one integrity check: CRC-32 (IEEE, zlib's polynomial) computed while the bytes
 * pass, once per side, with node:zlib's `crc32` (Node ≥ 20.15; zlib's braided implementation runs
 * at several GB/s, far above this machine's wire). It replaces two SHA-256 passes over the whole
 * state: the threat is corruption and truncation on the way (the channel is authenticated, so
 * forgery is not what the checksum is for); the model fingerprint check stays in the envelope
 * header. A CRC's guarantees for this use: every burst error up to 32 bits and every odd number
 * of flipped bits is detected; random damage slips through with probability 2^-32.
 */
import zlib from 'node:zlib';

type Crc32Fn = (data: Uint8Array | string, value?: number) => number;
const zcrc32 = (zlib as unknown as { crc32?: Crc32Fn }).crc32;

/** Name of the algorithm, as written in the envelope header's `checksum` field. */
export const CHECKSUM_ALGO = 'crc32' as const;

function fn(): Crc32Fn {
  if (!zcrc32) throw new Error(`node:zlib has no crc32 in Node ${process.version}: pdserve needs Node >= 20.15`);
  return zcrc32;
}

/** Streaming CRC-32: `update` each piece in order, read `value` (u32) at the end. */
export class Crc32 {
  /** The CRC-32 of everything passed to `update` so far (u32). */
  value = 0;

  update(data: Uint8Array): this {
    if (data.length > 0) this.value = fn()(data, this.value);
    return this;
  }
}

/** CRC-32 of one buffer (u32). */
export function crc32(data: Uint8Array): number {
  return new Crc32().update(data).value;
}
