/**
 * The prefill bootstrap addresses a decode worker may dial (llm-d fixed the same class of request
 * forgery with an allowlist from its pool, llm-d-router#242): decode never opens a connection to
 * an address a `/generate` body names unless it is one of
 *
 *   - `--allow-prefill HOST:PORT` (static, for deployments that pin their prefills), or
 *   - the router's pool: every signed health probe of a router carries its prefill workers'
 *     bootstrap addresses (`?prefill_pool=host:port,…`, covered by the signature); each address
 *     stays allowed for `ttlMs` after the last probe that named it, so several routers add up and
 *     a prefill dropped from every pool stops being dialable.
 *
 * A router marks a decode healthy only after a probe succeeded, so a decode always knows its
 * router's pool before the router sends it work. Bounded: at most `maxLearned` learned addresses.
 */
import { ConfigError } from '../base/errors.js';

/** Longest time an address stays allowed after the last probe that named it, ms. */
export const KNOWN_PREFILL_TTL_MS = 60_000;

/** Most addresses learned from probes (oldest forgotten first). */
export const MAX_LEARNED_PREFILLS = 1024;

/** `host:port` in one canonical form (lowercase host, IPv6 brackets stripped). */
export function bootstrapKey(host: string, port: number): string {
  const h = host.trim().toLowerCase();
  return `${h.startsWith('[') && h.endsWith(']') ? h.slice(1, -1) : h}:${port}`;
}

/** Parse `host:port` (IPv6 literals with or without brackets). Null when malformed. */
export function parseBootstrapAddr(s: string): { host: string; port: number } | null {
  const i = s.lastIndexOf(':');
  if (i <= 0) return null;
  const port = Number(s.slice(i + 1));
  if (!Number.isInteger(port) || port < 1 || port > 65535) return null;
  return { host: s.slice(0, i), port };
}

/** The set of allowed bootstrap addresses (see the module doc). */
export class KnownPrefills {
  private readonly fixed: Set<string>;
  /** key → expiry (ms), in insertion order. */
  private readonly learned = new Map<string, number>();

  constructor(
    allow: readonly string[] = [],
    private readonly ttlMs = KNOWN_PREFILL_TTL_MS,
    private readonly maxLearned = MAX_LEARNED_PREFILLS,
  ) {
    this.fixed = new Set(
      allow.map((a) => {
        const p = parseBootstrapAddr(a);
        if (!p) throw new ConfigError(`not a HOST:PORT bootstrap address: ${a}`);
        return bootstrapKey(p.host, p.port);
      }),
    );
  }

  /** A router's probe named these `host:port` addresses at `now` (malformed entries are skipped). */
  learn(addrs: readonly string[], now: number): void {
    for (const a of addrs) {
      const p = parseBootstrapAddr(a);
      if (!p) continue;
      const k = bootstrapKey(p.host, p.port);
      this.learned.delete(k);
      this.learned.set(k, now + this.ttlMs);
      if (this.learned.size > this.maxLearned) this.learned.delete(this.learned.keys().next().value as string);
    }
  }

  /** May decode dial host:port now? */
  allows(host: string, port: number, now: number): boolean {
    const k = bootstrapKey(host, port);
    if (this.fixed.has(k)) return true;
    const exp = this.learned.get(k);
    return exp !== undefined && exp >= now;
  }

  /** For /debug views: the allowed addresses now. */
  list(now: number): string[] {
    return [...this.fixed, ...[...this.learned].filter(([, e]) => e >= now).map(([k]) => k)];
  }
}
