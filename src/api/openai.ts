/**
 * The OpenAI-compatible surface: request schemas (zod), normalisation to the worker protocol,
 * OpenAI error bodies plus a fastify error handler, and response / stream-chunk builders.
 *
 * Leniency rules (as vLLM): unknown fields are accepted and ignored; `null` means "not set" for
 * every optional field; wrong types and out-of-range values are rejected with 400 and a message
 * naming the field. Features pdserve cannot honour (n > 1, logprobs, echo, best_of > 1, suffix,
 * non-zero penalties, logit_bias, tools, non-text content, JSON mode) are rejected with 400
 * rather than silently ignored.
 */
import { z, ZodError, type ZodIssue } from 'zod';
import type { FastifyError, FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import type { GenerateEvent, GenerateRequest } from './worker-protocol.js';
import type { ChatMessage } from '../engine/types.js';
import { ApiError, toApiError as commonToApiError, type ApiErrorType } from '../common/errors.js';

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

export { ApiError };
export type { ApiErrorType };

/** OpenAI error body: `{error: {message, type, param, code}}`. */
export interface OpenAIErrorBody {
  error: { message: string; type: string; param: string | null; code: string | null };
}

/** Build an OpenAI error body. */
export function errorBody(message: string, type: ApiErrorType | string = 'invalid_request_error', param: string | null = null, code: string | null = null): OpenAIErrorBody {
  return { error: { message, type, param, code } };
}

/** 400 invalid_request_error with a stable `code`. */
export const badRequest = (message: string, param: string | null = null, code = 'invalid_value'): ApiError =>
  new ApiError(400, code, message, 'invalid_request_error', param);

/** Render a zod path as `messages[0].content`. */
function pathString(path: (string | number)[]): string {
  let s = '';
  for (const p of path) s += typeof p === 'number' ? `[${p}]` : s === '' ? p : `.${p}`;
  return s;
}

function issueMessage(issue: ZodIssue, param: string): string {
  if (param === '') {
    return issue.code === 'invalid_type' ? 'Invalid request body: expected a JSON object' : `Invalid request body: ${issue.message}`;
  }
  if (issue.code === 'invalid_type' && issue.received === 'undefined') return `Missing required parameter: '${param}'.`;
  if (issue.code === 'invalid_type') return `Invalid type for '${param}': expected ${issue.expected}, got ${issue.received}.`;
  return `Invalid value for '${param}': ${issue.message}`;
}

/** Convert a ZodError to a 400 ApiError naming the first offending field. */
export function zodToApiError(err: ZodError): ApiError {
  const issue = err.issues[0];
  if (!issue) return badRequest('Invalid request body');
  const param = pathString(issue.path);
  const code = issue.code === 'invalid_type' && issue.received === 'undefined' ? 'missing_required_parameter' : issue.code === 'invalid_type' ? 'invalid_type' : 'invalid_value';
  return new ApiError(400, code, issueMessage(issue, param), 'invalid_request_error', param === '' ? null : param);
}

/**
 * Map anything thrown inside a request to an ApiError: ApiError as is, ZodError → 400, fastify
 * body errors → 400 (invalid / empty JSON, wrong content type, bad content-length) or 413
 * (bodyLimit), other errors with a 4xx `statusCode` keep it, engine errors with a string `code`
 * go through common/errors `toApiError`, anything else → 500 'Internal server error'.
 */
export function apiErrorOf(err: unknown): ApiError {
  if (err instanceof ApiError) return err;
  if (err instanceof ZodError) return zodToApiError(err);
  const e = err as Partial<FastifyError> & { message?: string };
  switch (e?.code) {
    case 'FST_ERR_CTP_INVALID_JSON_BODY':
      return badRequest('We could not parse the JSON body of your request: body is not valid JSON.', null, 'invalid_json');
    case 'FST_ERR_CTP_EMPTY_JSON_BODY':
      return badRequest("Request body is empty but content-type is 'application/json'.", null, 'invalid_json');
    case 'FST_ERR_CTP_INVALID_MEDIA_TYPE':
      return badRequest("Unsupported Content-Type: send the body as JSON with 'Content-Type: application/json'.", null, 'unsupported_media_type');
    case 'FST_ERR_CTP_INVALID_CONTENT_LENGTH':
      return badRequest('Request body size did not match Content-Length.', null, 'invalid_content_length');
    case 'FST_ERR_CTP_BODY_TOO_LARGE':
      return new ApiError(413, 'body_too_large', 'Request body is too large.', 'invalid_request_error');
  }
  if (err instanceof SyntaxError) return badRequest(`We could not parse the JSON body of your request: ${err.message}`, null, 'invalid_json');
  const status = typeof e?.statusCode === 'number' ? e.statusCode : 500;
  if (status >= 400 && status < 500) return new ApiError(status, typeof e?.code === 'string' ? e.code : 'invalid_request', e?.message ?? 'Bad request', 'invalid_request_error');
  if (typeof e?.code === 'string' && !e.code.startsWith('FST_')) return commonToApiError(err);
  return new ApiError(500, 'internal_error', 'Internal server error', 'server_error');
}

/** Send an ApiError as an OpenAI error body through fastify. */
export function sendApiError(reply: FastifyReply, err: ApiError): FastifyReply {
  return reply.code(err.status).type('application/json; charset=utf-8').send(err.toBody());
}

/**
 * Fastify error handler producing OpenAI error bodies (see `apiErrorOf`). 5xx are logged at
 * error level with the original error, 4xx at debug.
 */
export function openAIErrorHandler(error: unknown, request: FastifyRequest, reply: FastifyReply): void {
  const apiErr = apiErrorOf(error);
  if (apiErr.status >= 500) request.log.error({ err: error }, 'request failed');
  else request.log.debug({ status: apiErr.status, message: apiErr.message }, 'request rejected');
  void sendApiError(reply, apiErr);
}

/** Install the OpenAI error handler and a 404 handler with an OpenAI body on `app`. */
export function registerOpenAIErrorHandling(app: FastifyInstance): void {
  app.setErrorHandler(openAIErrorHandler);
  app.setNotFoundHandler((request, reply) => {
    void sendApiError(reply, new ApiError(404, 'not_found', `Route ${request.method} ${request.url.split('?')[0]} not found`, 'not_found_error'));
  });
}

// ---------------------------------------------------------------------------------------------
// Request schemas
// ---------------------------------------------------------------------------------------------

const MAX_INT32 = 2 ** 31 - 1;
/** Default `max_tokens` of /v1/completions (as OpenAI). */
export const DEFAULT_COMPLETION_MAX_TOKENS = 16;
/** Default `max_tokens` of /v1/chat/completions when neither max_tokens nor max_completion_tokens is set. */
export const DEFAULT_CHAT_MAX_TOKENS = 512;
/** Most stop strings accepted (OpenAI allows 4; pdserve is lenient). */
export const MAX_STOP = 16;

const StopSchema = z.unknown().transform((v, ctx): string[] | null => {
  if (v === null || v === undefined) return null;
  if (typeof v === 'string') return [v];
  if (Array.isArray(v) && v.length <= MAX_STOP && v.every((x) => typeof x === 'string')) return v as string[];
  ctx.addIssue({ code: z.ZodIssueCode.custom, message: `expected a string or an array of at most ${MAX_STOP} strings` });
  return z.NEVER;
});

/** Fields shared by both endpoints. All optional; `null` = unset. */
const commonFields = {
  model: z.string().max(512).nullish(),
  max_tokens: z.number().int().min(1).max(MAX_INT32).nullish(),
  temperature: z.number().min(0).max(2).nullish(),
  top_p: z.number().gt(0).max(1).nullish(),
  /** Extension (vLLM): -1 or 0 = off. */
  top_k: z.number().int().min(-1).max(MAX_INT32).nullish(),
  seed: z.number().int().min(Number.MIN_SAFE_INTEGER).max(Number.MAX_SAFE_INTEGER).nullish(),
  stop: StopSchema,
  stream: z.boolean().nullish(),
  stream_options: z.object({ include_usage: z.boolean().nullish() }).nullish(),
  n: z.number().int().nullish(),
  /** Extension (vLLM): keep generating past EOS. */
  ignore_eos: z.boolean().nullish(),
  user: z.string().nullish(),
  presence_penalty: z.number().min(-2).max(2).nullish(),
  frequency_penalty: z.number().min(-2).max(2).nullish(),
  logit_bias: z.record(z.number()).nullish(),
};

type CommonBody = z.output<z.ZodObject<typeof commonFields>>;

/** Cross-field checks and unsupported features shared by both endpoints. */
function refineCommon(b: CommonBody, ctx: z.RefinementCtx): void {
  const unsupported = (path: string, message: string) => ctx.addIssue({ code: z.ZodIssueCode.custom, path: [path], message });
  if (b.n != null && b.n !== 1) unsupported('n', 'only n=1 is supported');
  if (b.presence_penalty) unsupported('presence_penalty', 'presence_penalty is not supported (use 0 or omit it)');
  if (b.frequency_penalty) unsupported('frequency_penalty', 'frequency_penalty is not supported (use 0 or omit it)');
  if (b.logit_bias && Object.keys(b.logit_bias).length > 0) unsupported('logit_bias', 'logit_bias is not supported');
  if (b.stream_options != null && b.stream !== true) unsupported('stream_options', 'stream_options is only allowed when stream is true');
}

const PROMPT_MESSAGE = 'expected a string, an array with exactly one string, or a non-empty array of token ids (batched prompts are not supported)';
const isTokenId = (t: unknown): t is number => typeof t === 'number' && Number.isInteger(t) && t >= 0 && t <= MAX_INT32;

/** prompt: string | [string] | token ids | [token ids] → {text} | {input_ids}. */
const PromptSchema = z.unknown().transform((p, ctx): { text: string } | { input_ids: number[] } => {
  if (typeof p === 'string') return { text: p };
  if (Array.isArray(p)) {
    if (p.length === 1 && typeof p[0] === 'string') return { text: p[0] };
    if (p.length > 0 && p.every(isTokenId)) return { input_ids: p };
    if (p.length === 1 && Array.isArray(p[0]) && p[0].length > 0 && p[0].every(isTokenId)) return { input_ids: p[0] as number[] };
  }
  if (p === undefined) ctx.addIssue({ code: z.ZodIssueCode.invalid_type, expected: 'string', received: 'undefined' });
  else ctx.addIssue({ code: z.ZodIssueCode.custom, message: PROMPT_MESSAGE });
  return z.NEVER;
});

/** Raw body schema of POST /v1/completions (unknown keys stripped). */
export const CompletionBodySchema = z
  .object({
    ...commonFields,
    prompt: PromptSchema,
    logprobs: z.number().int().nullish(),
    echo: z.boolean().nullish(),
    best_of: z.number().int().nullish(),
    suffix: z.string().nullish(),
  })
  .superRefine((b, ctx) => {
    refineCommon(b, ctx);
    const unsupported = (path: string, message: string) => ctx.addIssue({ code: z.ZodIssueCode.custom, path: [path], message });
    if (b.logprobs != null) unsupported('logprobs', 'logprobs are not supported by pdserve');
    if (b.echo) unsupported('echo', 'echo is not supported');
    if (b.best_of != null && b.best_of !== 1) unsupported('best_of', 'only best_of=1 is supported');
    if (b.suffix) unsupported('suffix', 'suffix is not supported');
  });

const ContentPartSchema = z
  .object({ type: z.string(), text: z.string().optional() })
  .passthrough()
  .superRefine((p, ctx) => {
    if (p.type !== 'text') {
      ctx.addIssue({ code: z.ZodIssueCode.custom, path: ['type'], message: `unsupported content part type '${p.type}' (only 'text' is supported)` });
    } else if (typeof p.text !== 'string') {
      ctx.addIssue({ code: z.ZodIssueCode.invalid_type, path: ['text'], expected: 'string', received: 'undefined' });
    }
  });

const MessageSchema = z.object({
  role: z.enum(['system', 'user', 'assistant', 'developer', 'tool']),
  content: z.union([z.string(), z.array(ContentPartSchema)]).nullish(),
  name: z.string().nullish(),
});

/** Raw body schema of POST /v1/chat/completions (unknown keys stripped). */
export const ChatBodySchema = z
  .object({
    ...commonFields,
    messages: z.array(MessageSchema).min(1),
    max_completion_tokens: z.number().int().min(1).max(MAX_INT32).nullish(),
    logprobs: z.boolean().nullish(),
    top_logprobs: z.number().int().nullish(),
    tools: z.array(z.unknown()).nullish(),
    response_format: z.object({ type: z.string() }).passthrough().nullish(),
  })
  .superRefine((b, ctx) => {
    refineCommon(b, ctx);
    const unsupported = (path: string, message: string) => ctx.addIssue({ code: z.ZodIssueCode.custom, path: [path], message });
    if (b.logprobs) unsupported('logprobs', 'logprobs are not supported by pdserve');
    if (b.top_logprobs) unsupported('top_logprobs', 'logprobs are not supported by pdserve');
    if (b.tools && b.tools.length > 0) unsupported('tools', 'tool calling is not supported');
    if (b.response_format && b.response_format.type !== 'text') unsupported('response_format', `response_format '${b.response_format.type}' is not supported (only 'text')`);
  });

export type CompletionBody = z.output<typeof CompletionBodySchema>;
export type ChatBody = z.output<typeof ChatBodySchema>;

/** Sampling as sent to workers (`sampling_params` of /generate), defaults applied. */
export type WorkerSampling = GenerateRequest['sampling_params'];

interface ParsedCommon {
  /** Model named by the client, when given. */
  model?: string;
  sampling: WorkerSampling;
  stream: boolean;
  /** stream_options.include_usage: send a final usage chunk. */
  includeUsage: boolean;
  user?: string;
}

/** A validated, defaulted POST /v1/completions request. */
export interface ParsedCompletionRequest extends ParsedCommon {
  kind: 'completion';
  /** Exactly one of text / input_ids. */
  prompt: { text: string } | { input_ids: number[] };
}

/** A validated, defaulted POST /v1/chat/completions request (content flattened to text). */
export interface ParsedChatRequest extends ParsedCommon {
  kind: 'chat';
  messages: ChatMessage[];
}

export type ParsedRequest = ParsedCompletionRequest | ParsedChatRequest;

function commonOf(b: CommonBody, maxTokens: number): ParsedCommon {
  const stop = (b.stop ?? []).filter((s) => s.length > 0);
  const sampling: WorkerSampling = {
    temperature: b.temperature ?? 1,
    top_p: b.top_p ?? 1,
    top_k: b.top_k == null || b.top_k < 0 ? 0 : b.top_k,
    max_new_tokens: maxTokens,
    stop,
    ignore_eos: b.ignore_eos ?? false,
  };
  if (b.seed != null) sampling.seed = b.seed;
  const out: ParsedCommon = { sampling, stream: b.stream ?? false, includeUsage: b.stream === true && b.stream_options?.include_usage === true };
  if (b.model != null) out.model = b.model;
  if (b.user != null) out.user = b.user;
  return out;
}

/**
 * Validate and normalise a /v1/completions body.
 * @throws ApiError 400 naming the offending field.
 */
export function parseCompletionRequest(body: unknown): ParsedCompletionRequest {
  const r = CompletionBodySchema.safeParse(body);
  if (!r.success) throw zodToApiError(r.error);
  const b = r.data;
  return { kind: 'completion', prompt: b.prompt, ...commonOf(b, b.max_tokens ?? DEFAULT_COMPLETION_MAX_TOKENS) };
}

/** Flatten message content: a string as is, text parts joined with '\n' (as vLLM), null → ''. */
function flattenContent(c: ChatBody['messages'][number]['content']): string {
  if (c == null) return '';
  if (typeof c === 'string') return c;
  return c.map((p) => p.text ?? '').join('\n');
}

/**
 * Validate and normalise a /v1/chat/completions body. `max_completion_tokens` wins over
 * `max_tokens`; default DEFAULT_CHAT_MAX_TOKENS.
 * @throws ApiError 400 naming the offending field.
 */
export function parseChatRequest(body: unknown): ParsedChatRequest {
  const r = ChatBodySchema.safeParse(body);
  if (!r.success) throw zodToApiError(r.error);
  const b = r.data;
  const messages: ChatMessage[] = b.messages.map((m) => ({ role: m.role, content: flattenContent(m.content) }));
  const maxTokens = b.max_completion_tokens ?? b.max_tokens ?? DEFAULT_CHAT_MAX_TOKENS;
  return { kind: 'chat', messages, ...commonOf(b, maxTokens) };
}

/** Routing facts the router adds to a request. */
export interface WorkerRouting {
  rid: string;
  bootstrapHost: string;
  bootstrapPort: number;
  /** Random 63-bit room id, decimal string. */
  bootstrapRoom: string;
  /** Ask prefill to stream the first token before the KV handoff and decode to start at token 2. */
  firstTokenFromPrefill?: boolean;
}

/**
 * Build the /generate body sent to both prefill and decode (always `stream: true`; prefill
 * ignores it, decode streams SSE).
 */
export function toWorkerRequest(parsed: ParsedRequest, routing: WorkerRouting): GenerateRequest {
  const base = {
    rid: routing.rid,
    sampling_params: parsed.sampling,
    stream: true,
    first_token_from_prefill: routing.firstTokenFromPrefill ?? false,
    bootstrap_host: routing.bootstrapHost,
    bootstrap_port: routing.bootstrapPort,
    bootstrap_room: routing.bootstrapRoom,
  };
  if (parsed.kind === 'chat') return { ...base, messages: parsed.messages };
  return 'text' in parsed.prompt ? { ...base, text: parsed.prompt.text } : { ...base, input_ids: parsed.prompt.input_ids };
}

// ---------------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------------

export type OpenAIFinishReason = 'stop' | 'length';

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
}

export const usageOf = (promptTokens: number, completionTokens: number): Usage => ({
  prompt_tokens: promptTokens,
  completion_tokens: completionTokens,
  total_tokens: promptTokens + completionTokens,
});

/** Identity of one response: `id` is the rid, `created` unix seconds. */
export interface ResponseMeta {
  id: string;
  model: string;
  created: number;
}

export interface TextCompletion {
  id: string;
  object: 'text_completion';
  created: number;
  model: string;
  choices: { index: 0; text: string; logprobs: null; finish_reason: OpenAIFinishReason | null }[];
  usage?: Usage | null;
}

export interface ChatCompletion {
  id: string;
  object: 'chat.completion';
  created: number;
  model: string;
  choices: { index: 0; message: { role: 'assistant'; content: string }; logprobs: null; finish_reason: OpenAIFinishReason }[];
  usage: Usage;
}

export interface ChatCompletionChunk {
  id: string;
  object: 'chat.completion.chunk';
  created: number;
  model: string;
  choices: { index: 0; delta: { role?: 'assistant'; content?: string }; logprobs: null; finish_reason: OpenAIFinishReason | null }[];
  usage?: Usage | null;
}

/** Non-stream /v1/completions response. */
export function completionResponse(m: ResponseMeta, text: string, finishReason: OpenAIFinishReason, usage: Usage): TextCompletion {
  return { id: m.id, object: 'text_completion', created: m.created, model: m.model, choices: [{ index: 0, text, logprobs: null, finish_reason: finishReason }], usage };
}

/** Non-stream /v1/chat/completions response. */
export function chatCompletionResponse(m: ResponseMeta, content: string, finishReason: OpenAIFinishReason, usage: Usage): ChatCompletion {
  return {
    id: m.id,
    object: 'chat.completion',
    created: m.created,
    model: m.model,
    choices: [{ index: 0, message: { role: 'assistant', content }, logprobs: null, finish_reason: finishReason }],
    usage,
  };
}

/** One /v1/completions stream chunk. With `includeUsage`, carries `usage: null` (as OpenAI). */
export function completionChunk(m: ResponseMeta, text: string, finishReason: OpenAIFinishReason | null, includeUsage = false): TextCompletion {
  const c: TextCompletion = { id: m.id, object: 'text_completion', created: m.created, model: m.model, choices: [{ index: 0, text, logprobs: null, finish_reason: finishReason }] };
  if (includeUsage) c.usage = null;
  return c;
}

/** One /v1/chat/completions stream chunk. With `includeUsage`, carries `usage: null` (as OpenAI). */
export function chatCompletionChunk(
  m: ResponseMeta,
  delta: { role?: 'assistant'; content?: string },
  finishReason: OpenAIFinishReason | null,
  includeUsage = false,
): ChatCompletionChunk {
  const c: ChatCompletionChunk = { id: m.id, object: 'chat.completion.chunk', created: m.created, model: m.model, choices: [{ index: 0, delta, logprobs: null, finish_reason: finishReason }] };
  if (includeUsage) c.usage = null;
  return c;
}

/** The final usage-only chunk (`choices: []`) sent when stream_options.include_usage is true. */
export function usageChunk(kind: 'completion' | 'chat', m: ResponseMeta, usage: Usage): TextCompletion | ChatCompletionChunk {
  return kind === 'chat'
    ? { id: m.id, object: 'chat.completion.chunk', created: m.created, model: m.model, choices: [], usage }
    : { id: m.id, object: 'text_completion', created: m.created, model: m.model, choices: [], usage };
}

/** Payload of the SSE event that terminates an OpenAI stream. */
export const SSE_DONE = '[DONE]';

/**
 * Turns the worker's `GenerateEvent` stream (decode, or a colocated backend) into OpenAI
 * objects, for one request. Mapping:
 * - stream, chat: the first event yields a role chunk `delta: {role: 'assistant', content: ''}`;
 *   every event with non-empty `text` yields a chunk `delta: {content: text}`; the event with
 *   `meta_info.finish_reason` yields a chunk with `finish_reason` (carrying its text, if any,
 *   else `delta: {}`).
 * - stream, completion: the same without the role chunk (`choices[0].text`).
 * - `tail()`: the usage chunk (`choices: []`) when stream_options.include_usage was set.
 * - non-stream: `response()` assembles text, finish_reason and usage.
 * Usage comes from the last event's meta_info (prompt_tokens, completion_tokens).
 * finish_reason 'abort' is not a normal end: `push` throws ApiError 500 'generation_aborted'.
 */
export class OpenAIResponseBuilder {
  text = '';
  promptTokens = 0;
  completionTokens = 0;
  finishReason: OpenAIFinishReason | null = null;
  /** Events seen so far. */
  events = 0;

  constructor(
    readonly kind: 'completion' | 'chat',
    readonly meta: ResponseMeta,
    readonly includeUsage = false,
  ) {}

  get finished(): boolean {
    return this.finishReason !== null;
  }

  /**
   * Apply one event; returns the stream chunks it produces (possibly none).
   * @throws ApiError 502 'bad_worker_event' for a malformed event, 500 'generation_aborted' when
   *   the worker ended the generation with finish_reason 'abort', 502 'bad_worker_event' for an
   *   event after the finish.
   */
  push(ev: GenerateEvent): (TextCompletion | ChatCompletionChunk)[] {
    if (!ev || typeof ev !== 'object' || typeof ev.text !== 'string' || !ev.meta_info || typeof ev.meta_info !== 'object') {
      throw new ApiError(502, 'bad_worker_event', 'malformed generation event from the worker', 'server_error');
    }
    if (this.finished) throw new ApiError(502, 'bad_worker_event', 'generation event after the finish event', 'server_error');
    const mi = ev.meta_info;
    if (Number.isInteger(mi.prompt_tokens)) this.promptTokens = mi.prompt_tokens;
    if (Number.isInteger(mi.completion_tokens)) this.completionTokens = mi.completion_tokens;
    const fr = mi.finish_reason;
    if (fr && fr.type === 'abort') {
      throw new ApiError(500, 'generation_aborted', `generation aborted by the worker${fr.message ? `: ${fr.message}` : ''}`, 'server_error');
    }
    if (fr && fr.type !== 'stop' && fr.type !== 'length') {
      throw new ApiError(502, 'bad_worker_event', `unknown finish_reason from the worker: ${String((fr as { type?: unknown }).type)}`, 'server_error');
    }
    const finish: OpenAIFinishReason | null = fr ? (fr.type as OpenAIFinishReason) : null;
    const out: (TextCompletion | ChatCompletionChunk)[] = [];
    if (this.kind === 'chat' && this.events === 0) out.push(chatCompletionChunk(this.meta, { role: 'assistant', content: '' }, null, this.includeUsage));
    this.events++;
    this.text += ev.text;
    this.finishReason = finish;
    if (ev.text !== '' || finish) {
      if (this.kind === 'chat') out.push(chatCompletionChunk(this.meta, ev.text !== '' ? { content: ev.text } : {}, finish, this.includeUsage));
      else out.push(completionChunk(this.meta, ev.text, finish, this.includeUsage));
    }
    return out;
  }

  get usage(): Usage {
    return usageOf(this.promptTokens, this.completionTokens);
  }

  /** Chunks after the finish event (the usage chunk when requested). `[DONE]` is the caller's. */
  tail(): (TextCompletion | ChatCompletionChunk)[] {
    return this.includeUsage ? [usageChunk(this.kind, this.meta, this.usage)] : [];
  }

  /** The non-stream response. @throws Error when called before the finish event. */
  response(): TextCompletion | ChatCompletion {
    if (!this.finishReason) throw new Error('response() before the finish event');
    return this.kind === 'chat'
      ? chatCompletionResponse(this.meta, this.text, this.finishReason, this.usage)
      : completionResponse(this.meta, this.text, this.finishReason, this.usage);
  }
}
