/**
 * The handoff's one integrity check: CRC-32 (IEEE, zlib's polynomial) computed while the bytes
 * pass, once per side. It replaces two SHA-256 passes over the whole state: the threat is
 * corruption and truncation on the way (the channel is authenticated, so forgery is not what the
 * checksum is for); the model fingerprint check stays in the envelope header. A CRC's guarantees
 * for this use: every burst error up to 32 bits and every odd number of flipped bits is detected;
 * random damage slips through with probability 2^-32.
 *
 * Implementation: `@node-rs/crc32` (napi-rs; the `crc32fast` crate, PCLMULQDQ folding) where its
 * prebuilt binary loads, about twice as fast as node:zlib's `crc32` on a large buffer. Both
 * compute the same CRC-32
 * (same polynomial, same init/xor-out, chainable through the running value), so peers using either
 * agree on the wire value and no capability is needed. Falls back to node:zlib's `crc32`
 * (Node ≥ 20.15) when the native module is absent (a platform without a prebuilt binary).
 */
import { createRequire } from 'node:module';
import zlib from 'node:zlib';
import { ConfigError } from '../../base/errors.js';

type Crc32Fn = (data: Uint8Array, value?: number) => number;

/** Which implementation `Crc32` uses: `'node-rs'` or `'zlib'` (for logs and the bench report). */
export let crc32Impl: 'node-rs' | 'zlib' = 'zlib';

function pick(): Crc32Fn | undefined {
  try {
    const mod = createRequire(import.meta.url)('@node-rs/crc32') as { crc32?: (d: Uint8Array, v?: number) => number };
    if (typeof mod.crc32 === 'function') {
      const f = mod.crc32;
      crc32Impl = 'node-rs';
      // napi-rs takes a Buffer or Uint8Array; the running value is a u32.
      return (data, value) => f(data, value ?? 0) >>> 0;
    }
  } catch {
    /* no prebuilt binary for this platform: zlib below */
  }
  const z = (zlib as unknown as { crc32?: Crc32Fn }).crc32;
  crc32Impl = 'zlib';
  return z;
}

const impl = pick();

function fn(): Crc32Fn {
  if (!impl) throw new ConfigError(`node:zlib has no crc32 in Node ${process.version} and @node-rs/crc32 did not load: pdserve needs Node >= 20.15`);
  return impl;
}

/** Name of the algorithm, as written in the envelope header's `checksum` field. */
export const CHECKSUM_ALGO = 'crc32' as const;

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
