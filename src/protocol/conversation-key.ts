/**
 * The explicit session key of a request: what session affinity routes on
 * (../router/policy/affinity.ts) and what a worker's logs name a request's session by. First
 * present of (SGLang's gateway routing keys and Dynamo's sticky sessions do the same with one
 * header): `prompt_cache_key` (OpenAI's own field), `user`, the `x-session-id` header. Nothing is
 * derived from the prompt: what a prompt shares with what a worker holds is matched on its token
 * blocks (../protocol/token-blocks.ts), not guessed from its first message.
 */

/** What the key is read from. */
export interface KeyedRequest {
  kind: 'chat' | 'completion';
  promptCacheKey?: string;
  user?: string;
}

/** The session key of a request (see the module doc), or undefined. Keys of the three sources never collide. */
export function conversationKey(r: KeyedRequest, sessionHeader: unknown): string | undefined {
  if (r.promptCacheKey) return `k:${r.promptCacheKey}`;
  if (r.user) return `u:${r.user}`;
  if (typeof sessionHeader === 'string' && sessionHeader !== '') return `s:${sessionHeader.slice(0, 256)}`;
  return undefined;
}

