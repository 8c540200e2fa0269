/**
 * Chained hashes of fixed-size token blocks: the names the workers' KV events give what they
 * hold and the router matches a prompt against (Dynamo's KV router and llm-d's precise prefix
 * scorer name blocks the same way: block i's hash covers block i's tokens AND block i − 1's hash,
 * so equal hashes at position i mean equal prompts up to the end of block i).
 *
 * | term | meaning |
 * |---|---|
 * | block size | tokens per block (`--kv-block-tokens`, a worker flag; its events carry it) |
 * | root | the chain's seed: the cache salt (tenant), so two tenants' blocks never match |
 * | hash | a 53-bit integer (two 32-bit murmur3 lanes, one cut to 21 bits): a safe JS number, a cheap Set key |
 *
 * Only whole blocks are hashed: a prompt's last partial block names nothing. A collision (two
 * different prefixes with one hash, about 1 in 2^53 per pair) costs a routing choice, never a
 * wrong answer: the worker matches tokens exactly before it reuses anything.
 */
import { InternalError } from '../base/errors.js';

/** Default tokens per block (`--kv-block-tokens`). */
export const DEFAULT_KV_BLOCK_TOKENS = 16;
/** Bounds of the block size. */
export const MIN_KV_BLOCK_TOKENS = 1;
export const MAX_KV_BLOCK_TOKENS = 4096;
/** Largest block hashed (a deterministic worker's blocks are whole batches: up to the batch bound). */
const MAX_HASHED_BLOCK_TOKENS = 1 << 16;

const C1 = 0xcc9e2d51;
const C2 = 0x1b873593;
const HI_MASK = 0x1fffff; // 21 bits: hi × 2^32 + lo stays a safe integer
const TWO32 = 0x1_0000_0000;

/** murmur3's per-word step. */
function mix(h: number, k: number): number {
  k = Math.imul(k, C1);
  k = (k << 15) | (k >>> 17);
  k = Math.imul(k, C2);
  h ^= k;
  h = (h << 13) | (h >>> 19);
  return (Math.imul(h, 5) + 0xe6546b64) | 0;
}

/** murmur3's finalizer (unsigned result). */
function fmix(h: number): number {
  h ^= h >>> 16;
  h = Math.imul(h, 0x85ebca6b);
  h ^= h >>> 13;
  h = Math.imul(h, 0xc2b2ae35);
  h ^= h >>> 16;
  return h >>> 0;
}

/** Hash of `parent` (a chain value) and `words[from, to)`. */
function chain(parent: number, words: ArrayLike<number>, from: number, to: number): number {
  const pLo = parent % TWO32 | 0;
  const pHi = Math.floor(parent / TWO32) | 0;
  let a = mix(pLo, pHi ^ 0x5bd1e995);
  let b = mix(pHi ^ 0x9e3779b9, pLo);
  for (let i = from; i < to; i++) {
    const t = words[i]! | 0;
    a = mix(a, t);
    b = mix(b, t ^ 0x27d4eb2f);
  }
  const n = to - from;
  return (fmix(b ^ n) & HI_MASK) * TWO32 + fmix(a ^ n);
}

/**
 * The chain's root for a cache salt (undefined: no salt). Different salts give different roots,
 * and "no salt" is its own root, so no tenant's blocks ever equal another's.
 */
export function blockRoot(salt?: string): number {
  if (salt === undefined) return chain(0x51_7e57, [0x6e6f6e65], 0, 1);
  const units = new Array<number>(salt.length + 1);
  units[0] = 0x73616c74;
  for (let i = 0; i < salt.length; i++) units[i + 1] = salt.charCodeAt(i);
  return chain(0x51_7e57, units, 0, units.length);
}

/**
 * Chained hashes of the whole `blockTokens`-token blocks of `tokens` (at most `maxBlocks`),
 * rooted at `blockRoot(salt)`: element i names tokens [0, (i + 1) × blockTokens).
 * O(tokens). @throws InternalError for a block size outside [MIN_KV_BLOCK_TOKENS, 65 536]
 * (a programming error: the flag is validated where it is read).
 */
export function blockHashes(tokens: ArrayLike<number>, blockTokens: number, salt?: string, maxBlocks = Infinity): number[] {
  if (!Number.isInteger(blockTokens) || blockTokens < MIN_KV_BLOCK_TOKENS || blockTokens > MAX_HASHED_BLOCK_TOKENS) throw new InternalError(`block size ${blockTokens} out of range`);
  const n = Math.min(Math.floor(tokens.length / blockTokens), maxBlocks);
  const out = new Array<number>(n);
  let h = blockRoot(salt);
  for (let i = 0; i < n; i++) {
    h = chain(h, tokens, i * blockTokens, (i + 1) * blockTokens);
    out[i] = h;
  }
  return out;
}

/** Leading blocks of `hashes` that `has` says are held: the longest run from block 0 (stops at the first miss). */
export function leadingRun(hashes: readonly number[], has: (h: number) => boolean): number {
  let i = 0;
  while (i < hashes.length && has(hashes[i]!)) i++;
  return i;
}

/** Leading elements `a` and `b` share. */
export function commonRun(a: readonly number[], b: readonly number[]): number {
  const n = Math.min(a.length, b.length);
  let i = 0;
  while (i < n && a[i] === b[i]) i++;
  return i;
}
