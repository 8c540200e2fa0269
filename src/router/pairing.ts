/**
 * Pairing: which prefill may be sent with which decode. A pair whose `PairSettings` differ (model
 * fingerprint, context size, batch size, flash attention, KV cache type — read from each worker's GET /health)
 * would fail every request after prefill did all the work, so the router never dispatches to it
 * and shows the reason on GET /workers (`mismatch`). The workers refuse such a pair in the KV
 * handshake as well (kv/handshake.ts); this is the router's half of the same rule.
 */
import type { WorkerRegistry } from './registry.js';
import type { WorkerState } from './worker-state.js';
import { pairMismatch } from './pair-settings.js';

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
