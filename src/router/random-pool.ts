/**
 * Random ids for the router's hot path from a pooled buffer of OS CSPRNG bytes.
 *
 * Every generation request needs three: its rid (12 bytes), its trace id (16 bytes, unless the
 * client sent one) and its bootstrap room (8 bytes). `crypto.randomBytes` per id is one
 * getrandom(2) call and one Buffer each; here one `randomFillSync` refills POOL_BYTES (4 KiB)
 * and ids are sliced from it, so a request costs a syscall once every ≈ 100 requests. The bytes
 * are the same CSPRNG output, each handed out once. Idea from the `uuid` package's rng pool
 * (rnds8Pool) and Node's own randomUUID entropy cache.
 */
import { randomFillSync } from 'node:crypto';

/** Bytes fetched from the OS per refill. */
const POOL_BYTES = 4096;
const pool = Buffer.allocUnsafe(POOL_BYTES);
let offset = POOL_BYTES;

function take(n: number): number {
  if (!Number.isInteger(n) || n < 1 || n > 256) throw new RangeError(`random-pool: 1..256 bytes at a time, asked for ${n}`);
  if (offset + n > POOL_BYTES) {
    randomFillSync(pool);
    offset = 0;
  }
  const at = offset;
  offset += n;
  return at;
}

/**
 * `n` random bytes as 2n lowercase hex characters.
 * @param n 1 … 256 bytes
 * @throws RangeError for any other n (a longer id would come back short)
 */
export function randomHex(n: number): string {
  const at = take(n);
  return pool.toString('hex', at, at + n);
}

/** 64 random bits (the `u64` source of base/room-id.ts newRoomId). */
export function randomU64(): bigint {
  return pool.readBigUInt64BE(take(8));
}
