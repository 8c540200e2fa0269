/**
 * The prefix store's seam on the engine side: the second tier of the prefix cache, behind the
 * in-sequence cache (prefix-cache.ts). Finished sequences' states (prompt + reply) that the
 * first tier evicts are kept as files keyed by their token prefix; a prompt that starts with a stored prefix loads that state
 * into its sequence and evaluates only the rest. The engine only sees `PrefixStore`; the file
 * store that every worker process on a host shares is prefixes/prefix-store.ts.
 *
 * Keys: a hash chain over fixed-size token blocks, as vLLM's automatic prefix caching hashes
 * its KV blocks (hash(parent, block tokens, extras)); the chain starts from the store namespace
 * (model fingerprint, context settings, deterministic chunk size — vLLM's extra keys), so a
 * state is only ever found by an engine that could load it. A state of n tokens is stored under
 * the hash of its first K = ⌊usable / block⌋ × block tokens; a prompt looks up the hashes of its
 * own leading blocks, longest first, so a longer conversation finds its shorter ancestor.
 * llama.cpp state files hold a whole sequence: a state for tokens T serves any prompt whose
 * first K tokens are T's (load, erase past the reusable length, evaluate the rest).
 *
 * Exactness: `usable` is the state's whole length, or with deterministic mode only its exact
 * prefix (whole prompt chunks evaluated as full, aligned chunks: the chunk-alignment rule of
 * prefix-cache.ts), so a store hit gives bit-identical output there too.
 */
import { hash } from 'node:crypto';
import type { EngineInfo } from './types.js';

/**
 * Tokens per block of the key chain without deterministic mode (vLLM's default block size is 16;
 * coarser here: each key is one file probe). With it the block is the prompt chunk size.
 */
export const STORE_BLOCK_TOKENS = 64;

/** What decides whether a stored state can be loaded by an engine (the namespace of its keys). */
export interface StoreIdentity {
  /** sha256 of the GGUF (EngineInfo.fingerprint). */
  fingerprint: string;
  /** Context settings both sides of a handoff must agree on (EngineInfo.compat). */
  compat: EngineInfo['compat'];
  /** Vocabulary size (every token id of a state is checked against it). */
  nVocab: number;
  /** Sequences of the loading context (the n_stream its states must have). */
  nStream: number;
  /** Deterministic chunk size (reuse in whole aligned chunks only), or null. */
  align: number | null;
}

/** The namespace of an identity: hex sha256 of what must match for a state to be loadable. */
export function storeNamespace(id: Pick<StoreIdentity, 'fingerprint' | 'compat' | 'align'>): string {
  const compat = Object.fromEntries(Object.entries(id.compat).sort(([a], [b]) => (a < b ? -1 : 1)));
  return hash('sha256', JSON.stringify({ v: 1, fingerprint: id.fingerprint, compat, align: id.align }), 'hex');
}

/**
 * The namespace of one cache salt's entries (a tenant's, vLLM's `cache_salt`): the identity's
 * namespace itself when unsalted, else a hash of both — another salt's prompt never finds them.
 */
export function saltedNamespace(namespace: string, salt: string | undefined): string {
  return salt === undefined ? namespace : hash('sha256', `${namespace}/salt/${salt}`, 'hex');
}

/**
 * The key chain of `tokens`: element i is the key of the first (i + 1) × `blockTokens` tokens,
 * h_i = sha256(h_{i−1} ‖ block i as little-endian i32s) truncated to 16 bytes, h_{−1} =
 * sha256(namespace). Only whole blocks, at most `maxBlocks` of them.
 * @returns hex strings (32 chars), shortest prefix first.
 */
export function keyChain(namespace: string, tokens: readonly number[], maxBlocks: number, blockTokens = STORE_BLOCK_TOKENS): string[] {
  const n = Math.min(maxBlocks, Math.floor(tokens.length / blockTokens));
  const out: string[] = [];
  let prev = hash('sha256', `pdserve-prefix-store/${namespace}`, 'buffer').subarray(0, 16);
  const buf = Buffer.allocUnsafe(16 + blockTokens * 4);
  for (let b = 0; b < n; b++) {
    prev.copy(buf, 0);
    for (let i = 0; i < blockTokens; i++) buf.writeInt32LE(tokens[b * blockTokens + i]!, 16 + i * 4);
    prev = hash('sha256', buf, 'buffer').subarray(0, 16);
    out.push(prev.toString('hex'));
  }
  return out;
}

/**
 * Tokens a state of `nTokens` tokens is keyed by: whole blocks of its `exactPrefix` (the prompt
 * it was computed for; all of it when 0 and `align` is null). Not the reply: the next round
 * resends the prompt token for token, but its copy of the reply is text tokenized again, which
 * need not give the generated ids back — a key ending inside the reply would then never be
 * found, and the conversation's next round would fall back to an older entry. The entry still
 * serves the reply's tokens wherever they do match (reuse is the common prefix of the state).
 * 0 = too short to store.
 */
export function storeKeyTokens(nTokens: number, exactPrefix: number, align: number | null, blockTokens = STORE_BLOCK_TOKENS): number {
  const usable = align === null && exactPrefix <= 0 ? nTokens : Math.min(exactPrefix, nTokens);
  return Math.floor(usable / blockTokens) * blockTokens;
}

/**
 * The key an entry of `tokens` is found by, and the tokens it covers (storeKeyTokens), or
 * undefined when it is shorter than one block. Both tiers name their entries so (KV events).
 */
export function cacheKeyOf(namespace: string, tokens: readonly number[], exactPrefix: number, align: number | null, blockTokens: number): { key: string; tokens: number } | undefined {
  const keyTokens = storeKeyTokens(tokens.length, exactPrefix, align, blockTokens);
  if (keyTokens < blockTokens) return undefined;
  return { key: keyChain(namespace, tokens, keyTokens / blockTokens, blockTokens).at(-1)!, tokens: keyTokens };
}

/** A stored state found for a prompt, validated and ready for llama.cpp in a private file. */
export interface StoredPrefix {
  /** A file only this process reads: the state re-framed for the engine's n_stream. */
  readonly path: string;
  /** The tokens the state holds (the loaded sequence must hold exactly these). */
  readonly tokens: readonly number[];
  /** Prompt tokens it serves (reusableTokens rules: ≤ prompt − 1, aligned in deterministic mode). */
  readonly reuse: number;
  /** Leading tokens of the state a cold run computes identically (prefix-cache.ts). */
  readonly exactPrefix: number;
  /** Delete the private file. Never throws. */
  done(): Promise<void>;
}

/** A state being written to the store: llama.cpp saves into `path`, then `commit` publishes it. */
export interface StoreWrite {
  readonly path: string;
  /** Publish the saved file under its key (atomic rename). Never throws. */
  commit(): Promise<void>;
  /** The save failed: delete what was written. Never throws. */
  abort(): Promise<void>;
}

/** A stored or evicted entry of one tier, for KV events (the router routes on what is held). */
export interface KvCacheEvent {
  kind: 'stored' | 'evicted';
  tier: 'sequence' | 'store';
  /** Key of the entry (store: the file's chain key, hex). */
  key: string;
  /** Tokens the key covers. */
  tokens: number;
  /** Bytes the entry holds (store: file size; 0 when unknown). */
  bytes: number;
  /** `stored`: the chained hashes of the whole token blocks it holds, in order (../protocol/token-blocks.ts); absent: not named per block. */
  blocks?: number[];
  /** `stored` with blocks: tokens of the whole kept sequence (a prompt sharing less than half of it cannot take it: prefix-cache.ts MIN_KEEP_FRACTION). */
  seq_tokens?: number;
  /** `stored` with blocks: another session's prompt sharing half of it may take it (false: a paused session's state, kept for its own next round). */
  shared?: boolean;
}

/** The second tier as the engine uses it (prefixes/prefix-store.ts implements it over files). */
export interface PrefixStore {
  /** Called once by loadEngine with the loaded engine's identity; before it the store finds nothing. */
  bind(id: StoreIdentity): void;
  /**
   * The stored state serving most of `prompt`, if it serves more than `minReuse` tokens (what
   * the in-sequence tier already gives). Every candidate is validated before it is returned;
   * a bad one is refused and removed. Never throws.
   */
  take(prompt: readonly number[], minReuse: number, salt?: string): Promise<StoredPrefix | undefined>;
  /** Tokens of `prompt` a stored state would serve (a hint for decode-local planning; reads no state). Never throws. */
  reusable(prompt: readonly number[], salt?: string): Promise<number>;
  /**
   * Start storing a finished sequence holding `tokens` (`exactPrefix` as prefix-cache.ts):
   * undefined when it is not worth a file (too short, already stored, writes pending at the bound).
   * `salt` (in every method): the entries of one cache salt (a tenant) are keyed under their own
   * namespace (`saltedNamespace`): only a lookup with the same salt finds them. Never throws.
   */
  begin(tokens: readonly number[], exactPrefix: number, salt?: string): Promise<StoreWrite | undefined>;
  /** Entries this process evicted since it started, by cause (superseded by a newer state of the session, lru). */
  evictionStats?(): readonly { cause: 'superseded' | 'lru'; count: number }[];
  /** The engine is disposed: stop (the file store may remove its entries, see prefixes/prefix-store.ts). Idempotent; never rejects. */
  close?(): Promise<void>;
}
