/**
 * The bootstrap room id (SGLang's `bootstrap_room`): ONE branded type, ONE generator, ONE
 * canonicaliser for the whole code base (router, workers, KV channel, simulator, bench).
 *
 * A room id is a u64 carried as its canonical decimal string (no sign, no leading zeros): JSON
 * numbers lose precision above 2^53, and KV chunk frames carry the room as a u64, so only the
 * canonical string survives every hop. The router draws 63-bit ids (SGLang's range); any u64 is
 * accepted. Leaf module: imports nothing from the project.
 */
import { randomBytes } from 'node:crypto';

declare const roomIdBrand: unique symbol;
/** A canonical decimal u64 room id. Obtain one only from `parseRoomId` or `newRoomId`. */
export type RoomId = string & { readonly [roomIdBrand]: true };

export const ROOM_ID_MAX = (1n << 64n) - 1n;
const CANONICAL_RE = /^(0|[1-9][0-9]{0,19})$/;
const DIGITS_RE = /^[0-9]{1,20}$/;

/** True when `s` is already a canonical room id string. */
export function isRoomId(s: unknown): s is RoomId {
  return typeof s === 'string' && CANONICAL_RE.test(s) && BigInt(s) <= ROOM_ID_MAX;
}

/**
 * THE canonicaliser: a decimal string ("007" → "7"), a non-negative safe integer or a bigint in
 * u64 range → its canonical RoomId; anything else → undefined (callers decide how to refuse).
 */
export function parseRoomId(v: unknown): RoomId | undefined {
  let n: bigint;
  if (typeof v === 'string') {
    if (!DIGITS_RE.test(v)) return undefined;
    n = BigInt(v);
  } else if (typeof v === 'number') {
    if (!Number.isSafeInteger(v) || v < 0) return undefined;
    n = BigInt(v);
  } else if (typeof v === 'bigint') {
    n = v;
  } else {
    return undefined;
  }
  return n >= 0n && n <= ROOM_ID_MAX ? (n.toString() as RoomId) : undefined;
}

/** 64 random bits from the OS CSPRNG. */
export function cryptoU64(): bigint {
  return randomBytes(8).readBigUInt64BE(0);
}

/**
 * THE generator: a fresh 63-bit room id from `u64` (default: the OS CSPRNG; the simulator passes
 * its seeded PRNG so a seed replays exactly).
 */
export function newRoomId(u64: () => bigint = cryptoU64): RoomId {
  return (u64() & 0x7fff_ffff_ffff_ffffn).toString() as RoomId;
}
