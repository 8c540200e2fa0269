/**
 * Session affinity: a conversation's key, and the worker each key was last served by.
 *
 * Conversation key, first present of (SGLang's gateway routing keys and Dynamo's sticky sessions
 * do the same with one header):
 *   1. `prompt_cache_key` (OpenAI's own field for this),
 *   2. `user`,
 *   3. the `x-session-id` request header,
 *   4. chat only: a hash of the first message that is not a system message (the first user turn
 *      names a conversation; a system prompt shared by every agent would put them all on one key).
 * A completion without 1–3 has no key (no affinity; the policy alone decides).
 *
 * `SessionTable`: key → worker url, LRU-bounded. The cache-aware policy (./index.ts) takes the
 * key's worker when it is a candidate and the load guard does not call it overloaded, and
 * records its pick under the key either way.
 */
import { createHash } from 'node:crypto';

/** Most bytes of a first message hashed (a key, not a checksum: the start names the conversation). */
const HASHED_BYTES = 4096;

/** What the key is read from. */
export interface KeyedRequest {
  kind: 'chat' | 'completion';
  promptCacheKey?: string;
  user?: string;
  messages?: readonly { role: string; content: string }[];
}

/** The conversation key of a request (see the module doc), or undefined. Keys of the four sources never collide. */
export function conversationKey(r: KeyedRequest, sessionHeader: unknown): string | undefined {
  if (r.promptCacheKey) return `k:${r.promptCacheKey}`;
  if (r.user) return `u:${r.user}`;
  if (typeof sessionHeader === 'string' && sessionHeader !== '') return `s:${sessionHeader.slice(0, 256)}`;
  if (r.kind !== 'chat' || !r.messages) return undefined;
  const first = r.messages.find((m) => m.role !== 'system');
  if (!first) return undefined;
  const h = createHash('sha256').update(first.role).update('\0').update(first.content.slice(0, HASHED_BYTES)).digest('base64url');
  return `m:${h.slice(0, 22)}`;
}

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
