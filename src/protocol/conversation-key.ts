/**
 * The conversation key of a request: what session affinity routes on (../router/policy/affinity.ts)
 * and what the workers' sequence-tier KV events name a kept conversation by (../worker/kv-tracker.ts).
 * First present of (SGLang's gateway routing keys and Dynamo's sticky sessions do the same with
 * one header): `prompt_cache_key` (OpenAI's own field), `user`, the `x-session-id` header, and for
 * chat a hash of the first message that is not a system message.
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

