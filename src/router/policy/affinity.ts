/**
 * Session affinity: a conversation's key, and the worker each key was last served by.
 *
 * Session key (computed in ../../protocol/conversation-key.ts), first present of (SGLang's gateway
 * routing keys and Dynamo's sticky sessions do the same with one header):
 *   1. `prompt_cache_key` (OpenAI's own field for this),
 *   2. `user`,
 *   3. the `x-session-id` request header.
 * A request without one has no key (no affinity; what the workers hold decides).
 *
 * `SessionTable`: key → worker url, LRU-bounded. The cache-aware policy (./index.ts) takes the
 * key's worker when it is a candidate and the load guard does not call it overloaded, and
 * records its pick under the key either way.
 */
export { conversationKey, type KeyedRequest } from '../../protocol/conversation-key.js';

/** Default bound of a session table (keys). */
export const DEFAULT_MAX_SESSIONS = 65_536;

/** key → worker url, least recently used dropped beyond `max` keys. */
export class SessionTable {
  private readonly map = new Map<string, string>();
  constructor(readonly max: number = DEFAULT_MAX_SESSIONS) {}

  get size(): number {
    return this.map.size;
  }

  /** The worker of `key` (and mark the key used), or undefined. */
  get(key: string): string | undefined {
    const url = this.map.get(key);
    if (url === undefined) return undefined;
    this.map.delete(key);
    this.map.set(key, url);
    return url;
  }

  /** `key` is now served by `url`. */
  set(key: string, url: string): void {
    this.map.delete(key);
    this.map.set(key, url);
    if (this.map.size > this.max) this.map.delete(this.map.keys().next().value as string);
  }

  /** Drop every key of a removed worker. */
  forget(url: string): void {
    for (const [k, u] of this.map) if (u === url) this.map.delete(k);
  }
}
