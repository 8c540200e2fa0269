/**
 * Router ↔ worker protocol: SGLang's native `POST /generate` with the bootstrap fields.
 * The router sends the same body to the chosen prefill and decode workers at once.
 *
 * Prefill answers (non-streaming) when its room is terminal: 200 {rid, meta_info} on Success,
 * an OpenAI error body with 4xx/5xx otherwise.
 * Decode answers with an SSE stream of `GenerateEvent`s, then `data: [DONE]`; an error before the
 * stream starts is a plain OpenAI error body with 4xx/5xx; after it starts, an `{error}` event.
 * `POST /abort_request {rid}` cancels on either worker (idempotent, 200 even when unknown).
 */
import { z } from 'zod';
import { ApiError } from '../common/errors.js';
import { parseRoomId, type RoomId } from '../common/room-id.js';

export const ChatMessageSchema = z.object({
  role: z.enum(['system', 'user', 'assistant', 'developer', 'tool']),
  content: z.string(),
});

/** sampling_params of /generate; defaults as SGLang's SamplingParams (max_new_tokens 128). */
export const WorkerSamplingSchema = z.object({
  temperature: z.number().min(0).max(2).default(1),
  top_p: z.number().gt(0).max(1).default(1),
  /** 0 or -1 = off (SGLang uses -1). */
  top_k: z.number().int().min(-1).default(0).transform((k) => Math.max(0, k)),
  seed: z.number().int().optional(),
  max_new_tokens: z.number().int().min(1).default(128),
  stop: z.union([z.string(), z.array(z.string()).max(16)]).default([]).transform((s) => (typeof s === 'string' ? [s] : s)),
  ignore_eos: z.boolean().default(false),
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
    return ApiError.of('context_length_exceeded', `input_ids has ${b.input_ids.length} tokens; the context holds ${limits.maxPromptTokens}`, 'input_ids');
  }
  return undefined;
}

/** Body of POST /generate (router → prefill and decode). Exactly one of text, input_ids, messages. */
export const GenerateRequestSchema = z
  .object({
    rid: z.string().min(1).max(128),
    text: z.string().optional(),
    input_ids: z.array(z.number().int().min(0)).optional(),
    messages: z.array(ChatMessageSchema).max(MAX_MESSAGES).optional(),
    sampling_params: WorkerSamplingSchema.default({}),
    stream: z.boolean().default(true),
    bootstrap_host: z.string().min(1).max(255),
    bootstrap_port: z.number().int().min(1).max(65535),
    /** Decimal string or number (63-bit from the router; any u64 accepted), canonicalised by parseRoomId ("007" → "7"). */
    bootstrap_room: z.union([z.string(), z.number()]).transform((v, ctx): RoomId => {
      const id = parseRoomId(v);
      if (id === undefined) {
        ctx.addIssue({ code: z.ZodIssueCode.custom, message: 'bootstrap_room must be a decimal u64 (string or safe integer)' });
        return z.NEVER;
      }
      return id;
    }),
  })
  .refine((b) => [b.text, b.input_ids, b.messages].filter((x) => x !== undefined).length === 1, {
    message: 'exactly one of text, input_ids, messages is required',
  });
export type GenerateRequest = z.infer<typeof GenerateRequestSchema>;

/** One SSE event of decode's stream. */
export interface GenerateEvent {
  /** New text since the previous event. */
  text: string;
  token_ids: number[];
  meta_info: {
    id: string;
    prompt_tokens: number;
    completion_tokens: number;
    /** Set on the last event. */
    finish_reason: null | { type: 'stop' | 'length' | 'abort'; message?: string };
  };
}

/** Error event inside an already started stream. */
export interface GenerateErrorEvent {
  error: { message: string; type: string; code: string };
}

/** Prefill's answer on success. */
export interface PrefillResponse {
  rid: string;
  meta_info: { prompt_tokens: number; kv_bytes: number; prefill_ms: number; transfer_ms: number };
}
