/**
 * Pairing: which prefill may be sent with which decode. A pair whose `PairSettings` differ (model
 * fingerprint, context size, batch size, flash attention, KV cache type — read from each worker's GET /health)
 * would fail every request after prefill did all the work, so the router never dispatches to it
 * and shows the reason on GET /workers (`mismatch`). The workers refuse such a pair in the KV
 * handshake as well (kv/handshake.ts); this is the router's half of the same rule.
 */
import { settingsMismatch } from '../kv/handshake.js';
import type { PairSettings } from '../kv/messages.js';
import type { WorkerRegistry, WorkerState } from './registry.js';

/** PairSettings from a /health body's `settings`, or null when absent or malformed. */
export function settingsFromHealth(v: unknown): PairSettings | null {
  const s = v as Partial<PairSettings> | null;
  if (!s || typeof s !== 'object') return null;
  if (typeof s.fingerprint !== 'string' || typeof s.contextSize !== 'number' || typeof s.batchSize !== 'number' || typeof s.flashAttention !== 'boolean') return null;
  return { fingerprint: s.fingerprint, contextSize: s.contextSize, batchSize: s.batchSize, flashAttention: s.flashAttention, ...(typeof s.kvCacheType === 'string' ? { kvCacheType: s.kvCacheType } : {}) };
}

/** Why `a` and `b` cannot pair ("contextSize 1024 ≠ 2048"), or undefined. Unknown settings pair (older workers). */
export function pairMismatch(a: WorkerState, b: WorkerState): string | undefined {
  if (!a.settings || !b.settings) return undefined;
  return settingsMismatch(a.settings, b.settings);
}

/**
 * The `mismatch` reason of GET /workers for `w`: set when healthy workers of the other role exist
 * but none can pair with `w`; names the first one and what differs. null otherwise.
 */
export function mismatchOf(w: WorkerState, workers: readonly WorkerState[]): string | null {
  const others = workers.filter((o) => o.role !== w.role && o.healthy);
  if (!w.healthy || others.length === 0) return null;
  const reasons = others.map((o) => ({ o, why: pairMismatch(w, o) }));
  if (reasons.some((r) => r.why === undefined)) return null;
  const first = reasons[0]!;
  return `settings mismatch with ${first.o.role} ${first.o.url}: ${first.why}${others.length > 1 ? ` (and ${others.length - 1} more ${first.o.role} workers)` : ''}`;
}

/**
 * A prefill and a decode that can pair: the prefill is chosen (by `pickPrefill`, the router's
 * load-balancing policy) among healthy prefills that have at least one healthy decode with the
 * same settings (and, with `usable`, a pair it allows: ./pair-blocks.ts), then the decode (by
 * `pickDecode`) among that prefill's compatible decodes.
 * `{error}` names what is missing: no healthy prefill / decode, or no pair with matching settings.
 */
export function pickPair(
  reg: WorkerRegistry,
  pickPrefill: (candidates: WorkerState[]) => WorkerState | null,
  pickDecode: (candidates: WorkerState[]) => WorkerState | null,
  usable?: (prefill: WorkerState, decode: WorkerState) => boolean,
): { prefill: WorkerState; decode: WorkerState } | { error: 'no_healthy_prefill' | 'no_healthy_decode' | 'no_compatible_pair' } {
  const prefills = reg.candidates('prefill');
  const decodes = reg.candidates('decode');
  if (prefills.length === 0) return { error: 'no_healthy_prefill' };
  if (decodes.length === 0) return { error: 'no_healthy_decode' };
  const pairs = (p: WorkerState, d: WorkerState) => pairMismatch(p, d) === undefined && (usable?.(p, d) ?? true);
  const pairable = prefills.filter((p) => decodes.some((d) => pairs(p, d)));
  const prefill = pairable.length ? pickPrefill(pairable) : null;
  if (!prefill) return { error: 'no_compatible_pair' };
  const decode = pickDecode(decodes.filter((d) => pairs(prefill, d)));
  if (!decode) return { error: 'no_compatible_pair' };
  return { prefill, decode };
}
