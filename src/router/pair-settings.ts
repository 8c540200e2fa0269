/**
 * Pair settings of the router's workers: read from /health, compared between a prefill and a
 * decode (../kv/handshake.ts `settingsMismatch`, the rule the KV handshake enforces).
 */
import { settingsMismatch } from '../kv/handshake.js';
import type { PairSettings } from '../kv/messages.js';
import type { WorkerState } from './worker-state.js';
import { BUILD, peerProtocol, protocolMismatch, protocolVersion } from '../base/version.js';

/** PairSettings from a /health body's `settings`, or null when absent or malformed. */
export function settingsFromHealth(v: unknown): PairSettings | null {
  const s = v as Partial<PairSettings> | null;
  if (!s || typeof s !== 'object') return null;
  if (typeof s.fingerprint !== 'string' || typeof s.contextSize !== 'number' || typeof s.batchSize !== 'number' || typeof s.flashAttention !== 'boolean') return null;
  return { fingerprint: s.fingerprint, contextSize: s.contextSize, batchSize: s.batchSize, flashAttention: s.flashAttention, ...(typeof s.kvCacheType === 'string' ? { kvCacheType: s.kvCacheType } : {}), ...(typeof s.protocol === 'string' ? { protocol: s.protocol.slice(0, 32) } : {}), ...(typeof s.build === 'string' ? { build: s.build.slice(0, 80) } : {}) };
}

/** Why `a` and `b` cannot pair ("contextSize 1024 ≠ 2048"), or undefined. Unknown settings pair (older workers). */
export function pairMismatch(a: WorkerState, b: WorkerState): string | undefined {
  if (!a.settings || !b.settings) return undefined;
  return settingsMismatch(a.settings, b.settings);
}

/**
 * Why the router cannot send work to `w` at all — its protocol has another major than the
 * router's (../base/version.ts) — or undefined. Unknown settings: protocol 1.0.
 */
export function routerMismatch(w: WorkerState): string | undefined {
  if (!w.settings) return undefined;
  const why = protocolMismatch(protocolVersion(), peerProtocol(w.settings.protocol));
  return why ? `${why}: the router runs ${BUILD.id}, the worker ${w.settings.build ?? 'an older build'}` : undefined;
}

/**
 * The `mismatch` reason of GET /workers for `w`: set when its protocol is incompatible with the
 * router's (`routerMismatch`: it is never picked), or when healthy workers of the other role
 * exist but none can pair with `w` (names the first one and what differs). null otherwise.
 */
export function mismatchOf(w: WorkerState, workers: readonly WorkerState[]): string | null {
  const own = routerMismatch(w);
  if (own) return `mismatch with the router: ${own}`;
  const others = workers.filter((o) => o.role !== w.role && o.healthy);
  if (!w.healthy || others.length === 0) return null;
  const reasons = others.map((o) => ({ o, why: pairMismatch(w, o) }));
  if (reasons.some((r) => r.why === undefined)) return null;
  const first = reasons[0]!;
  return `settings mismatch with ${first.o.role} ${first.o.url}: ${first.why}${others.length > 1 ? ` (and ${others.length - 1} more ${first.o.role} workers)` : ''}`;
}
