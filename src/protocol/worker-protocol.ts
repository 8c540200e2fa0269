/**
 * Router ↔ worker protocol: SGLang's native `POST /generate` with the bootstrap fields.
 * The router sends the same body to the chosen prefill and decode workers at once.
 *
 * Prefill answers (non-streaming) when its room is terminal: 200 {rid, meta_info} on Success,
 * an OpenAI error body with 4xx/5xx otherwise. With `first_token_from_prefill` it streams instead:
 * `data: GenerateEvent` (the first token, at once) … `data: {transfer: PrefillResponse}` or
 * `data: {error}`, then `data: [DONE]`; an error before the first token is a plain error body.
 * Decode answers with an SSE stream of `GenerateEvent`s, then `data: [DONE]`; an error before the
 * stream starts is a plain OpenAI error body with 4xx/5xx; after it starts, an `{error}` event.
 * `POST /abort_request {rid, bootstrap_room?, cause?}` cancels on either worker (idempotent, 200
 * even when unknown); `cause` {code, message} says why when the router knows (`abortCauseOf`).
 */
import { z } from 'zod';
import { ApiError, failure, isErrorCode, type RoomFailure } from '../base/errors.js';
import { parseRoomId, type RoomId } from '../base/room-id.js';
import { MAX_RETENTION_MS, MAX_TOOL_CALLS_LIMIT, type Retention } from '../engine/types.js';

/** Most tools (functions) one request may declare, and most calls one assistant message may carry. */
export const MAX_TOOLS = 128;

const ToolNameSchema = z.string().regex(/^[a-zA-Z0-9_-]{1,64}$/, 'a function name is 1 to 64 of a-z, A-Z, 0-9, _ and -');

export const ChatMessageSchema = z.object({
  role: z.enum(['system', 'user', 'assistant', 'developer', 'tool']),
  content: z.string(),
  /** Assistant: the calls it made (arguments = JSON text). */
  tool_calls: z.array(z.object({ id: z.string().max(256), name: ToolNameSchema, arguments: z.string() })).max(MAX_TOOLS).optional(),
  /** Tool: the call this message answers. */
  tool_call_id: z.string().max(256).optional(),
});

/** A function the model may call (rendered into the prompt by the chat wrapper). */
export const WorkerToolSchema = z.object({ name: ToolNameSchema, description: z.string().max(65_536).optional(), parameters: z.record(z.unknown()).optional() });

/** Most logit_bias entries and stop_token_ids accepted (OpenAI allows 300 logit_bias entries). */
export const MAX_TOKEN_LIST = 1024;

/** A grammar constraint: any JSON text, or JSON matching a schema (OpenAI response_format). */
export const WorkerGrammarSchema = z.union([
  z.object({ type: z.literal('json') }),
  z.object({ type: z.literal('json_schema'), schema: z.record(z.unknown()) }),
  /** One call of one of `functions` in the model's call syntax; lazy = only after the call prefix (tool_choice auto); reply = or else a JSON reply of that grammar (tool_choice auto with a JSON format). */
  z.object({ type: z.literal('tool_call'), functions: z.array(z.object({ name: ToolNameSchema, parameters: z.record(z.unknown()).optional() })).min(1).max(MAX_TOOLS), lazy: z.boolean(), parallel: z.boolean().optional(), maxCalls: z.number().int().min(1).max(MAX_TOOL_CALLS_LIMIT).optional(), reply: z.union([z.object({ type: z.literal('json') }), z.object({ type: z.literal('json_schema'), schema: z.record(z.unknown()) })]).optional() }),
]);

/**
 * sampling_params of /generate; names and defaults as SGLang's SamplingParams, except
 * `max_new_tokens`: absent = the rest of the context (vLLM's and OpenAI's chat default).
 * Ranges as vLLM's SamplingParams validation.
 */
export const WorkerSamplingSchema = z.object({
  temperature: z.number().min(0).max(2).default(1),
  top_p: z.number().gt(0).max(1).default(1),
  /** 0 or -1 = off (SGLang uses -1). */
  top_k: z.number().int().min(-1).default(0).transform((k) => Math.max(0, k)),
  min_p: z.number().min(0).max(1).default(0),
  repetition_penalty: z.number().gt(0).max(1e6).default(1),
  presence_penalty: z.number().min(-2).max(2).default(0),
  frequency_penalty: z.number().min(-2).max(2).default(0),
  /** Token id (decimal string) → value added to its logit, in [-100, 100]. */
  logit_bias: z.record(z.string().regex(/^\d{1,10}$/), z.number().min(-100).max(100)).refine((r) => Object.keys(r).length <= MAX_TOKEN_LIST, `at most ${MAX_TOKEN_LIST} entries`).optional(),
  stop_token_ids: z.array(z.number().int().min(0)).max(MAX_TOKEN_LIST).optional(),
  min_tokens: z.number().int().min(0).default(0),
  seed: z.number().int().optional(),
  max_new_tokens: z.number().int().min(1).optional(),
  stop: z.union([z.string(), z.array(z.string()).max(16)]).default([]).transform((s) => (typeof s === 'string' ? [s] : s)),
  ignore_eos: z.boolean().default(false),
  grammar: WorkerGrammarSchema.optional(),
  /** Report each token's logprob and this many top alternatives (0..20); absent = no logprobs. */
  logprobs: z.number().int().min(0).max(20).optional(),
  /** Prefix the first token's text with the prompt's text (OpenAI completions `echo`). */
  echo: z.boolean().optional(),
});

/**
 * Bounds on request-controlled counts, checked on the raw JSON BEFORE any per-item work (zod
 * parsing, chat templating, tokenizing): a 4 MB body of 250k empty messages must cost O(1), not
 * seconds of event loop (long enough for KV peers to declare this process lost).
 */
export const MAX_MESSAGES = 4096;

/**
 * O(1) pre-check of a raw request body's array lengths against `limits` (messages, input_ids —
 * input_ids longer than the context cannot fit anyway). Returns the 400 to answer, or undefined.
 * Runs before zod: zod walks every element.
 */
export function checkRequestBounds(raw: unknown, limits: { maxMessages: number; maxPromptTokens: number }): ApiError | undefined {
  if (!raw || typeof raw !== 'object') return undefined;
  const b = raw as { messages?: unknown; input_ids?: unknown };
  if (Array.isArray(b.messages) && b.messages.length > limits.maxMessages) {
    return ApiError.of('request_too_large', `messages has ${b.messages.length} entries; at most ${limits.maxMessages} are accepted`, 'messages');
  }
  if (Array.isArray(b.input_ids) && b.input_ids.length > limits.maxPromptTokens) {
    // named as the client's field: the router passes a worker's 4xx through to an OpenAI client, whose token ids were `prompt`
    return ApiError.of('context_length_exceeded', `the prompt (${b.input_ids.length} tokens) exceeds the context size (${limits.maxPromptTokens} tokens)`, 'prompt');
  }
  return undefined;
}

/** Most rooms one prefill request may feed (n > 1); the API's own limit on choices is lower. */
export const MAX_ROOMS_PER_REQUEST = 64;

/** A room id on the wire: decimal string or number (63-bit from the router; any u64 accepted), canonicalised by parseRoomId ("007" → "7"). */
const RoomIdSchema = z.union([z.string(), z.number()]).transform((v, ctx): RoomId => {
  const id = parseRoomId(v);
  if (id === undefined) {
    ctx.addIssue({ code: z.ZodIssueCode.custom, message: 'bootstrap_room must be a decimal u64 (string or safe integer)' });
    return z.NEVER;
  }
  return id;
});

/** Body of POST /generate (router → prefill and decode). Exactly one of text, input_ids, messages. */
export const GenerateRequestSchema = z
  .object({
    rid: z.string().min(1).max(128),
    /** The sender's protocol (`MAJOR.MINOR`, ../base/version.ts); absent = 1.0. A worker refuses another major (502 `protocol_mismatch`) before parsing the rest. */
    protocol: z.string().max(32).optional(),
    /** Trace id of the request (router: client's traceparent/x-request-id or generated); shown in logs and /debug/rooms. */
    trace_id: z.string().min(1).max(128).optional(),
    text: z.string().optional(),
    input_ids: z.array(z.number().int().min(0)).optional(),
    messages: z.array(ChatMessageSchema).max(MAX_MESSAGES).optional(),
    /** Functions documented in the chat prompt (OpenAI `tools`; chat only). */
    tools: z.array(WorkerToolSchema).max(MAX_TOOLS).optional(),
    sampling_params: WorkerSamplingSchema.default({}),
    stream: z.boolean().default(true),
    /**
     * First token before the KV handoff (pdserve's extension). On prefill: answer with an SSE
     * stream whose first event is the first token (a GenerateEvent) as soon as it is sampled and
     * whose last event is the transfer outcome (`PrefillStreamEnd` or an `{error}` event). On
     * decode: do not emit the first token (the router already has it from prefill); continue
     * from token 2 (a first token that ends generation gives only the finish event).
     */
    first_token_from_prefill: z.boolean().default(false),
    /**
     * Decode-local continuation (pdserve's extension; decode only): the router sent this request
     * to decode ALONE (prefill never sees it). Decode evaluates the prompt's uncached suffix
     * itself when it is at most `max_tokens` (and its own limit), reusing a sequence it kept
     * from an earlier round, and streams every token (first included); otherwise it answers at
     * once 409 `needs_prefill` without creating a room, and the router runs the PD path.
     * The bootstrap fields are those of the prefill the fallback would use; decode ignores them.
     */
    local_prefill: z.object({ max_tokens: z.number().int().min(1).max(1 << 20) }).strict().optional(),
    /** The router's conversation key (router/policy/affinity.ts): decode's KV events name kept sequences by it. */
    conversation_key: z.string().min(1).max(300).optional(),
    /**
     * The prefix cache's partition (vLLM's `cache_salt`; set by the router: the tenant of the
     * request's API key, or the client's own `cache_salt`, ../api/access.ts `cacheSaltOf`): KV
     * left by a request of another salt is never reused, in the sequences or the prefix store.
     */
    cache_salt: z.string().min(1).max(300).optional(),
    /**
     * Retention of the request's cached state after it ends (engine/prefix-cache.ts; set by the
     * router or colocated from `agent_hints` and the session key, ../api/parse.ts retentionOf):
     * `session` — the request names a session (its state gets the worker's --session-ttl-ms);
     * `ttl_ms` — its own retention window (agent_hints.retention_seconds); `priority` 0–99.
     */
    retention: z
      .object({
        session: z.boolean().optional(),
        ttl_ms: z.number().int().min(0).max(MAX_RETENTION_MS).optional(),
        priority: z.number().int().min(0).max(99).optional(),
      })
      .strict()
      .optional(),
    /**
     * Migration (pdserve's extension; prefill and decode): the tokens an earlier attempt of this
     * request generated and the client already has. Prefill (or decode itself, with
     * `local_prefill`) evaluates them after the prompt and samples the next token; both sides count them as generated in every sampler state
     * (penalties, grammar, min_tokens, max_new_tokens, stop strings) and in `completion_tokens`,
     * and `prompt_tokens` stays the prompt's; they are never streamed again.
     */
    resume_token_ids: z.array(z.number().int().min(0)).min(1).max(1 << 20).optional(),
    bootstrap_host: z.string().min(1).max(255),
    bootstrap_port: z.number().int().min(1).max(65535),
    /** Decimal string or number (63-bit from the router; any u64 accepted), canonicalised by parseRoomId ("007" → "7"). */
    bootstrap_room: RoomIdSchema,
    /**
     * n > 1 (pdserve's extension; prefill only): the rooms fed by this request's ONE prompt
     * computation, one per choice, the first equal to `bootstrap_room` (SGLang's single-room
     * field, kept). Room i samples its first token with seed + i. Needs
     * `first_token_from_prefill`; the answer is a multiplexed stream (prefill/computation.ts).
     */
    bootstrap_rooms: z.array(RoomIdSchema).min(2).max(MAX_ROOMS_PER_REQUEST).optional(),
  })
  .refine((b) => [b.text, b.input_ids, b.messages].filter((x) => x !== undefined).length === 1, {
    message: 'exactly one of text, input_ids, messages is required',
  })
  .refine((b) => b.bootstrap_rooms === undefined || (b.bootstrap_rooms[0] === b.bootstrap_room && new Set(b.bootstrap_rooms).size === b.bootstrap_rooms.length), {
    message: 'bootstrap_rooms must be distinct and start with bootstrap_room',
  })
  .refine((b) => b.resume_token_ids === undefined || b.bootstrap_rooms === undefined, {
    message: 'resume_token_ids is for a single-room request (not with bootstrap_rooms)',
  });
export type GenerateRequest = z.infer<typeof GenerateRequestSchema>;

/** The engine's Retention of a /generate body's `retention` (undefined when absent). */
export function retentionFromWire(r: GenerateRequest['retention']): Retention | undefined {
  if (!r) return undefined;
  const out: Retention = {};
  if (r.session) out.session = true;
  if (r.ttl_ms !== undefined) out.ttlMs = r.ttl_ms;
  if (r.priority !== undefined) out.priority = r.priority;
  return out;
}

/**
 * Logprob of one generated token and its top alternatives (natural log; token = its text in the
 * output; `bytes` only when they are not the UTF-8 of `token`: a part of a multi-byte character,
 * `token` then `bytes:\xNN…`).
 */
export interface WireLogprob {
  token: string;
  bytes?: number[];
  logprob: number;
  top: { token: string; bytes?: number[]; logprob: number }[];
}

/** The event of one generated token (`logprobs` when the token carries one). */
export function tokenEvent(out: { token: number; text: string; logprob?: WireLogprob }, meta: GenerateEvent['meta_info']): GenerateEvent {
  const ev: GenerateEvent = { text: out.text, token_ids: [out.token], meta_info: meta };
  if (out.logprob) ev.logprobs = [out.logprob];
  return ev;
}

/** One SSE event of decode's stream. */
export interface GenerateEvent {
  /** New text since the previous event. */
  text: string;
  token_ids: number[];
  /** Aligned with token_ids, when the request asked for logprobs. */
  logprobs?: WireLogprob[];
  meta_info: {
    id: string;
    prompt_tokens: number;
    /** Prompt tokens not evaluated again thanks to a prefix cache (OpenAI's usage.prompt_tokens_details.cached_tokens); absent = 0. */
    cached_tokens?: number;
    completion_tokens: number;
    /** Set on the last event. */
    finish_reason: null | { type: 'stop' | 'length' | 'abort'; message?: string };
  };
}

/** Longest `cause.message` of an /abort_request kept (longer ones are cut). */
export const MAX_ABORT_CAUSE_CHARS = 500;

/**
 * The `cause` of an /abort_request body as the room's failure: `{code, message}` with `code` a
 * row of ERROR_CODES and `message` a string (cut to MAX_ABORT_CAUSE_CHARS). Anything else
 * (absent, another shape, an unknown code) is undefined: the worker names the abort itself.
 */
export function abortCauseOf(raw: unknown): RoomFailure | undefined {
  if (!raw || typeof raw !== 'object') return undefined;
  const { code, message } = raw as { code?: unknown; message?: unknown };
  if (!isErrorCode(code) || typeof message !== 'string') return undefined;
  return failure(code, message.slice(0, MAX_ABORT_CAUSE_CHARS));
}

/** Error event inside an already started stream. */
export interface GenerateErrorEvent {
  error: { message: string; type: string; code: string };
}

/** Prefill's answer on success. */
export interface PrefillResponse {
  rid: string;
  meta_info: { prompt_tokens: number; cached_tokens: number; kv_bytes: number; prefill_ms: number; transfer_ms: number };
}

/** Last event of prefill's stream (`first_token_from_prefill`): the KV handoff succeeded. */
export interface PrefillStreamEnd {
  transfer: PrefillResponse;
}
