/**
 * The OpenAI-compatible surface: request schemas (zod), normalisation to the worker protocol,
 * OpenAI error bodies plus a fastify error handler, and response / stream-chunk builders.
 *
 * Nothing is accepted and ignored: every field pdserve knows is listed in ./fields.ts as honoured
 * or refused (docs/API.md's conformance table is generated from it); any other field is a 400
 * "Unrecognized request argument supplied" (as OpenAI). `null` means "not set" for every optional
 * field; wrong types and out-of-range values (vLLM's ranges) are 400s naming the field.
 */
import { z, ZodError, type ZodIssue } from 'zod';
import type { FastifyError, FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { checkRequestBounds, MAX_MESSAGES, MAX_TOKEN_LIST, type GenerateEvent, type GenerateRequest, type WireLogprob } from './worker-protocol.js';
import type { RoomId } from '../common/room-id.js';
import { normaliseJsonSchema, SchemaError } from './json-schema.js';
import { DEFAULT_COMPLETION_MAX_TOKENS, fieldsOf, LEGACY_FUNCTIONS_REFUSAL, MESSAGE_FIELDS, TOOLS_REFUSAL, type Endpoint, type FieldSpec } from './fields.js';
import { parseTools, toolGrammarOf, ToolCallParser, type ParsedTools, type ToolCall, type ToolCallDelta } from './tool-calls.js';
import type { ChatMessage, ToolCallSyntax } from '../engine/types.js';
import { ApiError, asErrorCode, toApiError as commonToApiError, type ApiErrorType, type ErrorCode } from '../common/errors.js';
import { RepeatLimiter } from '../common/log-limit.js';

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
export const badRequest = (message: string, param: string | null = null, code: ErrorCode = 'invalid_value'): ApiError =>
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
  if (status >= 400 && status < 500) return new ApiError(status, asErrorCode(e?.code, 'invalid_request'), e?.message ?? 'Bad request', 'invalid_request_error');
  if (typeof e?.code === 'string' && !e.code.startsWith('FST_')) return commonToApiError(err);
  return new ApiError(500, 'internal_error', 'Internal server error', 'server_error');
}

/** Send an ApiError as an OpenAI error body through fastify. */
export function sendApiError(reply: FastifyReply, err: ApiError): FastifyReply {
  return reply.code(err.status).type('application/json; charset=utf-8').send(err.toBody());
}

/** One warn line per 503 refusal code per second in this process (see openAIErrorHandler). */
const refusalLog = new RepeatLimiter(1000);

/**
 * Fastify error handler producing OpenAI error bodies (see `apiErrorOf`). Logging follows the
 * error table (../common/errors.ts): a 503 refusal (no_healthy_decode, queue_full, draining, …)
 * is expected under load or restarts, so it is logged at warn without a stack, at most once per
 * code per second with `suppressed` = the refusals of that code not logged since the previous
 * line; other 5xx (faults) at error with the original error; 4xx at debug.
 */
export function openAIErrorHandler(error: unknown, request: FastifyRequest, reply: FastifyReply): void {
  const apiErr = apiErrorOf(error);
  if (apiErr.status === 503) {
    const suppressed = refusalLog.hit(apiErr.code);
    if (suppressed !== null) request.log.warn({ status: apiErr.status, code: apiErr.code, message: apiErr.message, suppressed }, 'request refused');
  } else if (apiErr.status >= 500) request.log.error({ err: error }, 'request failed');
  else request.log.debug({ status: apiErr.status, message: apiErr.message }, 'request rejected');
  void sendApiError(reply, apiErr);
}

/** Keys refused in a JSON body (prototype poisoning, as fastify's secure-json-parse refuses them). */
const POISON_KEYS = /"(?:__proto__|constructor)"/;

/**
 * Parse a JSON request body, saying precisely what is wrong: JSON.parse's own syntax message
 * (e.g. "Unexpected end of JSON input"), an empty body, or a `__proto__` key / a
 * `constructor.prototype` object (refused like fastify's default parser does, but named).
 * @throws ApiError 400 invalid_json.
 */
export function parseJsonBody(text: string): unknown {
  if (text.trim() === '') throw badRequest("Request body is empty but content-type is 'application/json'.", null, 'invalid_json');
  try {
    if (!POISON_KEYS.test(text)) return JSON.parse(text);
    return JSON.parse(text, (key, value: unknown) => {
      if (key === '__proto__') throw badRequest("Invalid JSON body: the key '__proto__' is not allowed (prototype-poisoning protection).", null, 'invalid_json');
      if (key === 'constructor' && value !== null && typeof value === 'object' && Object.hasOwn(value, 'prototype')) {
        throw badRequest("Invalid JSON body: a 'constructor' object with a 'prototype' key is not allowed (prototype-poisoning protection).", null, 'invalid_json');
      }
      return value;
    });
  } catch (err) {
    if (err instanceof ApiError) throw err;
    throw badRequest(`We could not parse the JSON body of your request: ${(err as Error).message}.`, null, 'invalid_json');
  }
}

/** Replace fastify's application/json parser with `parseJsonBody` (same body limit). */
function registerJsonBodyParser(app: FastifyInstance): void {
  app.removeContentTypeParser('application/json');
  app.addContentTypeParser('application/json', { parseAs: 'string' }, (_req, body, done) => {
    try {
      done(null, parseJsonBody(body as string));
    } catch (err) {
      done(err as Error, undefined);
    }
  });
}

/**
 * Answer errors node's HTTP parser raises before fastify sees a request (fastify's
 * `clientErrorHandler` option) with OpenAI error bodies: 431 request_header_fields_too_large,
 * 408 request_timeout, 400 bad_request. Same behaviour as fastify's default otherwise (nothing on
 * a reset or destroyed socket; the socket is closed after the answer).
 */
export function openAIClientErrorHandler(err: NodeJS.ErrnoException, socket: import('node:net').Socket): void {
  if (err.code === 'ECONNRESET' || socket.destroyed) return;
  const [status, reason, code, message] =
    err.code === 'HPE_HEADER_OVERFLOW'
      ? [431, 'Request Header Fields Too Large', 'request_header_fields_too_large', 'Request header fields are too large (the total size of the headers exceeds the server limit).']
      : err.code === 'ERR_HTTP_REQUEST_TIMEOUT'
        ? [408, 'Request Timeout', 'request_timeout', 'The request was not received in time.']
        : [400, 'Bad Request', 'bad_request', `Malformed HTTP request${err.code ? ` (${err.code})` : ''}.`];
  const body = JSON.stringify(errorBody(message, 'invalid_request_error', null, code));
  if (socket.writable) socket.write(`HTTP/1.1 ${status} ${reason}\r\nContent-Length: ${Buffer.byteLength(body)}\r\nContent-Type: application/json; charset=utf-8\r\nConnection: close\r\n\r\n${body}`);
  socket.destroy(err);
}

/**
 * Install the OpenAI error handler and a not-found handler with an OpenAI body on `app`: 405
 * with an `Allow` header when the path is a route for other methods, else 404. Call it before
 * adding routes (an onRoute hook records them; `:param` segments match any one segment).
 */
export function registerOpenAIErrorHandling(app: FastifyInstance): void {
  app.setErrorHandler(openAIErrorHandler);
  registerJsonBodyParser(app);
  const routes: { re: RegExp; methods: Set<string> }[] = [];
  app.addHook('onRoute', (r) => {
    if (r.url === '*' || r.url.includes('*')) return;
    const re = new RegExp(`^${r.url.split('/').map((seg) => (seg.startsWith(':') ? '[^/]+' : seg.replace(/[.*+?^${}()|[\]\\]/g, '\\$&'))).join('/')}$`);
    let entry = routes.find((x) => x.re.source === re.source);
    if (!entry) routes.push((entry = { re, methods: new Set() }));
    for (const m of Array.isArray(r.method) ? r.method : [r.method]) entry.methods.add(m);
  });
  app.setNotFoundHandler((request, reply) => {
    const path = request.url.split('?')[0] ?? '';
    const allowed = routes.filter((x) => x.re.test(path)).flatMap((x) => [...x.methods]);
    if (allowed.length > 0) {
      void sendApiError(reply.header('allow', [...new Set(allowed)].sort().join(', ')), new ApiError(405, 'method_not_allowed', `Method ${request.method} is not allowed on ${path} (allowed: ${[...new Set(allowed)].sort().join(', ')})`, 'invalid_request_error'));
      return;
    }
    void sendApiError(reply, new ApiError(404, 'not_found', `Route ${request.method} ${path} not found`, 'not_found_error'));
  });
}

/**
 * The served-model check of vLLM (--served-model-name) and OpenAI: a request naming a model the
 * server does not serve is a 404 `model_not_found` naming `model`. An absent `model` is accepted
 * (the server has one model). `served` empty = nothing known yet (no worker probed): no check.
 * @throws ApiError 404 model_not_found.
 */
export function checkModelName(model: string | undefined, served: readonly string[]): void {
  if (model === undefined || served.length === 0 || served.includes(model)) return;
  throw new ApiError(404, 'model_not_found', `The model '${model}' does not exist (this server serves: ${served.map((m) => `'${m}'`).join(', ')})`, 'invalid_request_error', 'model');
}

// ---------------------------------------------------------------------------------------------
// Request schemas (built from the field table in ./fields.ts)
// ---------------------------------------------------------------------------------------------

export { DEFAULT_COMPLETION_MAX_TOKENS, MAX_STOP } from './fields.js';

/** 400 naming `param`, for a valid value pdserve does not support. */
const unsupported = (param: string, why: string): ApiError => new ApiError(400, 'unsupported_value', `Unsupported value for '${param}': ${why}`, 'invalid_request_error', param);

/** Re-root a zod error under `prefix` and convert it to a 400 naming the full path. */
function fieldError(prefix: (string | number)[], err: ZodError): ApiError {
  return zodToApiError(new ZodError(err.issues.map((i) => ({ ...i, path: [...prefix, ...i.path] }))));
}

/**
 * Validate the top-level fields of a request body against the field table: unknown names → 400
 * "Unrecognized request argument supplied" (as OpenAI), nulls dropped, each value checked
 * against its schema, refused values → 400 naming the field.
 */
function parseFields(endpoint: Endpoint, body: unknown): Record<string, unknown> {
  return parseFieldTable(fieldsOf(endpoint), body);
}

/**
 * `parseFields` over any field table (name → spec), e.g. /v1/responses' (./responses-fields.ts).
 * @throws ApiError 400 for a body that is not a JSON object, an unknown field, a bad or refused value.
 */
export function parseFieldTable(fields: ReadonlyMap<string, FieldSpec>, body: unknown): Record<string, unknown> {
  if (typeof body === 'string' || Buffer.isBuffer(body)) {
    throw new ApiError(400, 'unsupported_media_type', "The request body was not sent as JSON: send it with 'Content-Type: application/json' (a text/plain body is not parsed).", 'invalid_request_error');
  }
  if (body === null || typeof body !== 'object' || Array.isArray(body)) throw badRequest(`Invalid request body: expected a JSON object, got ${body === null ? 'null' : Array.isArray(body) ? 'an array' : typeof body}`, null, 'invalid_type');
  const out: Record<string, unknown> = {};
  for (const [k, v] of Object.entries(body as Record<string, unknown>)) {
    const f = fields.get(k);
    if (!f) throw new ApiError(400, 'unrecognized_argument', `Unrecognized request argument supplied: ${k}`, 'invalid_request_error', k);
    if (v === null || v === undefined) continue;
    const r = f.schema.safeParse(v);
    if (!r.success) throw fieldError([k], r.error);
    const why = f.refuse?.(r.data as never);
    if (why) throw unsupported(k, why);
    out[k] = r.data;
  }
  return out;
}

const PROMPT_MESSAGE = 'expected a string, an array of strings, a non-empty array of token ids, or an array of non-empty token-id arrays';
const isTokenId = (t: unknown): t is number => typeof t === 'number' && Number.isInteger(t) && t >= 0 && t <= 2 ** 31 - 1;

/** prompt: string | [string] | token ids | [token ids] → {text} | {input_ids}. */
function parsePrompt(p: unknown): { text: string } | { input_ids: number[] } {
  if (p === undefined) throw new ApiError(400, 'missing_required_parameter', "Missing required parameter: 'prompt'.", 'invalid_request_error', 'prompt');
  if (typeof p === 'string') return { text: p };
  if (Array.isArray(p)) {
    if (p.length === 1 && typeof p[0] === 'string') return { text: p[0] };
    // A batch is split into one request per prompt before this parser (api/fanout.ts planFanOut).
    if (p.length > 1 && (p.every((x) => typeof x === 'string') || p.every((x) => Array.isArray(x)))) throw badRequest("Invalid value for 'prompt': a batch of prompts must be split into one request per prompt (planFanOut) before this parser", 'prompt');
    if (p.length > 0 && p.every(isTokenId)) return { input_ids: p };
    if (p.length === 1 && Array.isArray(p[0]) && p[0].length > 0 && p[0].every(isTokenId)) return { input_ids: p[0] as number[] };
  }
  throw badRequest(`Invalid value for 'prompt': ${PROMPT_MESSAGE}`, 'prompt');
}

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

const MessageSchema = z
  .object({
    role: z.enum(['system', 'user', 'assistant', 'developer', 'tool', 'function']),
    content: z.union([z.string(), z.array(ContentPartSchema)]).nullish(),
    name: z.string().nullish(),
    tool_calls: z.array(z.unknown()).nullish(),
    tool_call_id: z.string().nullish(),
    function_call: z.unknown().nullish(),
    refusal: z.string().nullish(),
    audio: z.unknown().nullish(),
    annotations: z.array(z.unknown()).nullish(),
  })
  .passthrough();

/**
 * Validate chat messages (see MESSAGE_FIELDS) and flatten their content to text.
 * @throws ApiError 400 naming the offending message field.
 */
export function parseMessages(raw: unknown): ChatMessage[] {
  if (raw === undefined) throw new ApiError(400, 'missing_required_parameter', "Missing required parameter: 'messages'.", 'invalid_request_error', 'messages');
  const arr = z.array(z.unknown()).min(1).safeParse(raw);
  if (!arr.success) throw fieldError(['messages'], arr.error);
  const known = new Set(MESSAGE_FIELDS.map((f) => f.name));
  const messages = arr.data.map((m, i) => {
    const r = MessageSchema.safeParse(m);
    if (!r.success) throw fieldError(['messages', i], r.error);
    const msg = r.data;
    const at = (k: string) => `messages[${i}].${k}`;
    for (const k of Object.keys(msg)) if (!known.has(k)) throw new ApiError(400, 'unrecognized_argument', `Unrecognized request argument supplied: ${at(k)}`, 'invalid_request_error', at(k));
    if (msg.role === 'function') throw unsupported(at('role'), LEGACY_FUNCTIONS_REFUSAL);
    if (msg.function_call != null) throw unsupported(at('function_call'), LEGACY_FUNCTIONS_REFUSAL);
    if (msg.tool_calls && msg.tool_calls.length > 0 && msg.role !== 'assistant') throw unsupported(at('tool_calls'), 'only assistant messages carry tool_calls');
    if (msg.tool_call_id != null && msg.role !== 'tool') throw unsupported(at('tool_call_id'), 'only tool messages carry a tool_call_id');
    if (msg.role === 'tool' && msg.tool_call_id == null) throw new ApiError(400, 'missing_required_parameter', `Missing required parameter: '${at('tool_call_id')}'.`, 'invalid_request_error', at('tool_call_id'));
    if (msg.name != null) throw unsupported(at('name'), 'participant names are not supported (they would be dropped from the prompt)');
    if (msg.refusal) throw unsupported(at('refusal'), 'a non-empty refusal is not supported');
    if (msg.audio != null) throw unsupported(at('audio'), 'audio is not supported');
    if (msg.annotations && msg.annotations.length > 0) throw unsupported(at('annotations'), 'annotations are not supported');
    const c = msg.content;
    const content = c == null ? '' : typeof c === 'string' ? c : c.map((p) => p.text ?? '').join('\n');
    const out: ChatMessage = { role: msg.role as ChatMessage['role'], content };
    if (msg.tool_calls && msg.tool_calls.length > 0) {
      out.toolCalls = msg.tool_calls.map((tc, j) => {
        const r = ToolCallSchema.safeParse(tc);
        if (!r.success) throw fieldError(['messages', i, 'tool_calls', j], r.error);
        return { id: r.data.id, name: r.data.function.name, arguments: r.data.function.arguments };
      });
    }
    if (msg.tool_call_id != null) out.toolCallId = msg.tool_call_id;
    return out;
  });
  checkToolHistory(messages);
  return messages;
}

const ToolCallSchema = z
  .object({
    id: z.string().min(1).max(256),
    type: z.literal('function'),
    function: z.object({ name: z.string().regex(/^[a-zA-Z0-9_-]{1,64}$/, 'a function name is 1 to 64 of a-z, A-Z, 0-9, _ and -'), arguments: z.string().max(1 << 20) }).strict(),
  })
  .strict();

/**
 * Every tool message answers an earlier assistant tool call (by id, once), and every call is
 * answered (the chat wrapper renders each call with its result). @throws ApiError 400 naming the message field.
 */
function checkToolHistory(messages: ChatMessage[]): void {
  const open = new Map<string, string>();
  const answered = new Set<string>();
  messages.forEach((m, i) => {
    m.toolCalls?.forEach((c, j) => {
      if (open.has(c.id) || answered.has(c.id)) throw badRequest(`Invalid value for 'messages[${i}].tool_calls[${j}].id': the id '${c.id}' is used twice`, `messages[${i}].tool_calls[${j}].id`);
      open.set(c.id, `messages[${i}].tool_calls[${j}]`);
    });
    if (m.role === 'tool') {
      const id = m.toolCallId!;
      if (!open.has(id)) throw badRequest(`Invalid value for 'messages[${i}].tool_call_id': no earlier assistant tool call has the id '${id}'${answered.has(id) ? ' left unanswered (it was answered already)' : ''}`, `messages[${i}].tool_call_id`);
      open.delete(id);
      answered.add(id);
    }
  });
  for (const where of open.values()) throw badRequest(`Invalid value for '${where}': no tool message answers this call (add a message with role 'tool' and its tool_call_id)`, where);
}

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
  /** prompt_cache_key: the conversation key of session affinity (router/policy/affinity.ts). */
  promptCacheKey?: string;
  /** Set by the router: the conversation key it routes on, sent to the workers as `conversation_key`. */
  conversationKey?: string;
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
  /** tools / tool_choice, when the request has tools (see ./tool-calls.ts). */
  tools?: ParsedTools;
  /** The served model's call syntax, set by the server before the response is built (router: from prefill's /health). */
  toolSyntax?: ToolCallSyntax | null;
}

/**
 * The call syntax the response builder parses tool calls with: the model's, for a chat request
 * with tools and tool_choice other than "none"; else null (plain text).
 * @throws ApiError 400 naming `tools` when the request has tools and the model has no call syntax.
 */
export function responseToolSyntax(parsed: ParsedRequest): ToolCallSyntax | null {
  if (parsed.kind !== 'chat' || !parsed.tools) return null;
  if (!parsed.toolSyntax) throw unsupported('tools', TOOLS_REFUSAL);
  return parsed.tools.choice === 'none' ? null : parsed.toolSyntax;
}

export type ParsedRequest = ParsedCompletionRequest | ParsedChatRequest;

/** The grammar a request asks for (response_format json_object / json_schema, guided_json), if any. */
function grammarOf(b: Record<string, unknown>): WorkerSampling['grammar'] {
  const rf = b.response_format as { type: string; json_schema?: { schema?: Record<string, unknown> } } | undefined;
  const checked = (schema: unknown, param: string): Record<string, unknown> => {
    try {
      return normaliseJsonSchema(schema);
    } catch (err) {
      if (!(err instanceof SchemaError)) throw err;
      throw unsupported(`${param}${err.path}`, err.message);
    }
  };
  let g: WorkerSampling['grammar'];
  if (rf?.type === 'json_object') g = { type: 'json' };
  if (rf?.type === 'json_schema') g = rf.json_schema?.schema ? { type: 'json_schema', schema: checked(rf.json_schema.schema, 'response_format.json_schema.schema') } : { type: 'json' };
  if (b.guided_json !== undefined) {
    if (g) throw unsupported('guided_json', 'guided_json cannot be combined with a JSON response_format');
    let schema = b.guided_json;
    if (typeof schema === 'string') {
      try {
        schema = JSON.parse(schema);
      } catch {
        throw badRequest("Invalid value for 'guided_json': not a JSON schema (the string is not valid JSON)", 'guided_json');
      }
      if (schema === null || typeof schema !== 'object' || Array.isArray(schema)) throw badRequest("Invalid value for 'guided_json': expected a JSON schema object", 'guided_json');
    }
    g = { type: 'json_schema', schema: checked(schema, 'guided_json') };
  }
  return g;
}

/**
 * The logprobs a request asks for: completions `logprobs: N` (0..20), chat `logprobs: true` with
 * `top_logprobs: N` (default 0); undefined = none. The endpoint is told by `messages` presence.
 * @throws ApiError 400 for the other endpoint's type, or top_logprobs without logprobs (as OpenAI).
 */
function logprobsOf(b: Record<string, unknown>): number | undefined {
  const chat = 'messages' in b;
  const lp = b.logprobs;
  if (chat) {
    if (lp !== undefined && typeof lp !== 'boolean') throw new ApiError(400, 'invalid_type', "Invalid type for 'logprobs': expected boolean", 'invalid_request_error', 'logprobs');
    if (b.top_logprobs !== undefined && lp !== true) throw badRequest("Invalid value for 'top_logprobs': top_logprobs requires logprobs to be true", 'top_logprobs');
    return lp === true ? ((b.top_logprobs as number | undefined) ?? 0) : undefined;
  }
  if (lp !== undefined && typeof lp !== 'number') throw new ApiError(400, 'invalid_type', "Invalid type for 'logprobs': expected an integer in [0, 20]", 'invalid_request_error', 'logprobs');
  return lp as number | undefined;
}

/**
 * The parts shared by both endpoints. `maxTokens` undefined = the rest of the context (the
 * worker resolves it once it knows the prompt length).
 */
function commonOf(b: Record<string, unknown>, maxTokens: number | undefined): ParsedCommon {
  const stop = (b.stop === undefined ? [] : typeof b.stop === 'string' ? [b.stop] : (b.stop as string[])).filter((s) => s.length > 0);
  if (b.stream_options !== undefined && b.stream !== true) throw unsupported('stream_options', 'stream_options is only allowed when stream is true');
  const minTokens = (b.min_tokens as number | undefined) ?? 0;
  if (maxTokens !== undefined && minTokens > maxTokens) throw badRequest(`Invalid value for 'min_tokens': min_tokens (${minTokens}) must be <= max_tokens (${maxTokens})`, 'min_tokens');
  const topK = b.top_k as number | undefined;
  const sampling: WorkerSampling = {
    temperature: (b.temperature as number | undefined) ?? 1,
    top_p: (b.top_p as number | undefined) ?? 1,
    top_k: topK == null || topK < 0 ? 0 : topK,
    min_p: (b.min_p as number | undefined) ?? 0,
    repetition_penalty: (b.repetition_penalty as number | undefined) ?? 1,
    presence_penalty: (b.presence_penalty as number | undefined) ?? 0,
    frequency_penalty: (b.frequency_penalty as number | undefined) ?? 0,
    min_tokens: minTokens,
    stop,
    ignore_eos: (b.ignore_eos as boolean | undefined) ?? false,
  };
  if (maxTokens !== undefined) sampling.max_new_tokens = maxTokens;
  if (b.seed !== undefined) sampling.seed = b.seed as number;
  const bias = b.logit_bias as Record<string, number> | undefined;
  if (bias && Object.keys(bias).length > 0) {
    if (Object.keys(bias).length > MAX_TOKEN_LIST) throw badRequest(`Invalid value for 'logit_bias': at most ${MAX_TOKEN_LIST} entries`, 'logit_bias');
    sampling.logit_bias = bias;
  }
  const stopIds = b.stop_token_ids as number[] | undefined;
  if (stopIds && stopIds.length > 0) sampling.stop_token_ids = stopIds;
  const grammar = grammarOf(b);
  if (grammar) sampling.grammar = grammar;
  const lp = logprobsOf(b);
  if (lp !== undefined) sampling.logprobs = lp;
  if (b.echo === true) {
    if (lp !== undefined) throw unsupported('echo', 'echo together with logprobs is not supported (prompt logprobs are not computed)');
    sampling.echo = true;
  }
  const so = b.stream_options as { include_usage?: boolean | null } | undefined;
  const out: ParsedCommon = { sampling, stream: b.stream === true, includeUsage: b.stream === true && so?.include_usage === true };
  if (b.model !== undefined) out.model = b.model as string;
  if (b.user !== undefined) out.user = b.user as string;
  if (b.prompt_cache_key !== undefined) out.promptCacheKey = b.prompt_cache_key as string;
  return out;
}

/**
 * Validate and normalise a /v1/completions body (see ./fields.ts for every field).
 * @throws ApiError 400 naming the offending field.
 */
export function parseCompletionRequest(body: unknown): ParsedCompletionRequest {
  const b = parseFields('completions', body);
  const prompt = parsePrompt(b.prompt);
  return { kind: 'completion', prompt, ...commonOf(b, (b.max_tokens as number | undefined) ?? DEFAULT_COMPLETION_MAX_TOKENS) };
}

/**
 * Validate and normalise a /v1/chat/completions body (see ./fields.ts for every field).
 * `max_completion_tokens` wins over `max_tokens`; neither = the rest of the context.
 * @throws ApiError 400 naming the offending field.
 */
export function parseChatRequest(body: unknown): ParsedChatRequest {
  // Request-controlled counts first: an O(1) length check before any per-message work.
  const tooLarge = checkRequestBounds(body, { maxMessages: MAX_MESSAGES, maxPromptTokens: Infinity });
  if (tooLarge) throw tooLarge;
  const b = parseFields('chat', body);
  const messages = parseMessages(b.messages);
  const maxTokens = (b.max_completion_tokens as number | undefined) ?? (b.max_tokens as number | undefined);
  const out: ParsedChatRequest = { kind: 'chat', messages, ...commonOf(b, maxTokens) };
  const tools = parseTools(b);
  if (tools) {
    out.tools = tools;
    const g = toolGrammarOf(tools);
    if (g && out.sampling.grammar) throw unsupported('tool_choice', 'tools cannot be combined with response_format / guided_json (one grammar per request); send tool_choice "none" or drop the JSON format');
    if (g) out.sampling.grammar = g;
  }
  return out;
}

/** Routing facts the router adds to a request. */
export interface WorkerRouting {
  rid: string;
  bootstrapHost: string;
  bootstrapPort: number;
  /** Random 63-bit room id (common/room-id.ts newRoomId). */
  bootstrapRoom: RoomId;
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
    ...(parsed.conversationKey ? { conversation_key: parsed.conversationKey } : {}),
  };
  if (parsed.kind === 'chat') {
    const messages = parsed.messages.map((m) => {
      const w: NonNullable<GenerateRequest['messages']>[number] = { role: m.role, content: m.content };
      if (m.toolCalls) w.tool_calls = m.toolCalls;
      if (m.toolCallId !== undefined) w.tool_call_id = m.toolCallId;
      return w;
    });
    return parsed.tools ? { ...base, messages, tools: parsed.tools.functions } : { ...base, messages };
  }
  return 'text' in parsed.prompt ? { ...base, text: parsed.prompt.text } : { ...base, input_ids: parsed.prompt.input_ids };
}

// ---------------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------------

export type OpenAIFinishReason = 'stop' | 'length' | 'tool_calls';

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
  /** Always present: `cached_tokens` is the subset of prompt_tokens served from the prefix cache (0 when none). */
  prompt_tokens_details: { cached_tokens: number };
}

export const usageOf = (promptTokens: number, completionTokens: number, cachedTokens = 0): Usage => ({
  prompt_tokens: promptTokens,
  completion_tokens: completionTokens,
  total_tokens: promptTokens + completionTokens,
  prompt_tokens_details: { cached_tokens: cachedTokens },
});

/** Identity of one response: `id` is the rid, `created` unix seconds. */
export interface ResponseMeta {
  id: string;
  model: string;
  created: number;
}

/** Completions `logprobs` of one choice (OpenAI legacy shape; text_offset counts UTF-16 units of the token texts). */
export interface CompletionLogprobs {
  tokens: string[];
  token_logprobs: number[];
  top_logprobs: Record<string, number>[];
  text_offset: number[];
}

/** One token of a chat choice's `logprobs.content` (OpenAI shape; bytes = UTF-8 of the token text). */
export interface ChatTokenLogprob {
  token: string;
  logprob: number;
  bytes: number[];
  top_logprobs: { token: string; logprob: number; bytes: number[] }[];
}

/** Chat `logprobs` of one choice. */
export interface ChatLogprobs {
  content: ChatTokenLogprob[];
  refusal: null;
}

/** Completions logprobs of `lps`, the first token starting at text offset `offset0`. */
export function completionLogprobs(lps: readonly WireLogprob[], offset0 = 0): CompletionLogprobs {
  const out: CompletionLogprobs = { tokens: [], token_logprobs: [], top_logprobs: [], text_offset: [] };
  let off = offset0;
  for (const lp of lps) {
    out.tokens.push(lp.token);
    out.token_logprobs.push(lp.logprob);
    out.top_logprobs.push(Object.fromEntries(lp.top.map((t) => [t.token, t.logprob])));
    out.text_offset.push(off);
    off += lp.token.length;
  }
  return out;
}

/** Chat logprobs of `lps`. */
export function chatLogprobs(lps: readonly WireLogprob[]): ChatLogprobs {
  const bytes = (t: string) => [...Buffer.from(t, 'utf8')];
  return { content: lps.map((lp) => ({ token: lp.token, logprob: lp.logprob, bytes: bytes(lp.token), top_logprobs: lp.top.map((t) => ({ token: t.token, logprob: t.logprob, bytes: bytes(t.token) })) })), refusal: null };
}

export interface TextCompletion {
  id: string;
  object: 'text_completion';
  created: number;
  model: string;
  choices: { index: 0; text: string; logprobs: CompletionLogprobs | null; finish_reason: OpenAIFinishReason | null }[];
  usage?: Usage | null;
}

export interface ChatCompletion {
  id: string;
  object: 'chat.completion';
  created: number;
  model: string;
  choices: { index: 0; message: ChatMessageOut; logprobs: ChatLogprobs | null; finish_reason: OpenAIFinishReason }[];
  usage: Usage;
}

/** The assistant message of a chat response: `content` null when the model only called tools. */
export interface ChatMessageOut {
  role: 'assistant';
  content: string | null;
  tool_calls?: ToolCall[];
}

/** The delta of a chat stream chunk. */
export interface ChatDelta {
  role?: 'assistant';
  content?: string;
  tool_calls?: ToolCallDelta[];
}

export interface ChatCompletionChunk {
  id: string;
  object: 'chat.completion.chunk';
  created: number;
  model: string;
  choices: { index: 0; delta: ChatDelta; logprobs: ChatLogprobs | null; finish_reason: OpenAIFinishReason | null }[];
  usage?: Usage | null;
}

/** Non-stream /v1/completions response. */
export function completionResponse(m: ResponseMeta, text: string, finishReason: OpenAIFinishReason, usage: Usage, logprobs: CompletionLogprobs | null = null): TextCompletion {
  return { id: m.id, object: 'text_completion', created: m.created, model: m.model, choices: [{ index: 0, text, logprobs, finish_reason: finishReason }], usage };
}

/** Non-stream /v1/chat/completions response. */
export function chatCompletionResponse(m: ResponseMeta, content: string, finishReason: OpenAIFinishReason, usage: Usage, logprobs: ChatLogprobs | null = null, toolCalls: ToolCall[] = []): ChatCompletion {
  const message: ChatMessageOut = toolCalls.length > 0 ? { role: 'assistant', content: content === '' ? null : content, tool_calls: toolCalls } : { role: 'assistant', content };
  return {
    id: m.id,
    object: 'chat.completion',
    created: m.created,
    model: m.model,
    choices: [{ index: 0, message, logprobs, finish_reason: finishReason }],
    usage,
  };
}

/** One /v1/completions stream chunk. With `includeUsage`, carries `usage: null` (as OpenAI). */
export function completionChunk(m: ResponseMeta, text: string, finishReason: OpenAIFinishReason | null, includeUsage = false, logprobs: CompletionLogprobs | null = null): TextCompletion {
  const c: TextCompletion = { id: m.id, object: 'text_completion', created: m.created, model: m.model, choices: [{ index: 0, text, logprobs, finish_reason: finishReason }] };
  if (includeUsage) c.usage = null;
  return c;
}

/** One /v1/chat/completions stream chunk. With `includeUsage`, carries `usage: null` (as OpenAI). */
export function chatCompletionChunk(
  m: ResponseMeta,
  delta: ChatDelta,
  finishReason: OpenAIFinishReason | null,
  includeUsage = false,
  logprobs: ChatLogprobs | null = null,
): ChatCompletionChunk {
  const c: ChatCompletionChunk = { id: m.id, object: 'chat.completion.chunk', created: m.created, model: m.model, choices: [{ index: 0, delta, logprobs, finish_reason: finishReason }] };
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
 * Usage comes from the last event's meta_info (prompt_tokens, cached_tokens, completion_tokens).
 * Events carrying `logprobs` (the request asked for them) add them to their chunk — a chunk is
 * then sent even when the event's text is empty — and to the response, in OpenAI's completions
 * or chat shape.
 * finish_reason 'abort' is not a normal end: `push` throws ApiError 500 'generation_aborted'.
 */
export class OpenAIResponseBuilder {
  text = '';
  promptTokens = 0;
  /** Prompt tokens served from a prefix cache (meta_info.cached_tokens). */
  cachedTokens = 0;
  completionTokens = 0;
  finishReason: OpenAIFinishReason | null = null;
  /** Events seen so far. */
  events = 0;
  /** Logprobs of every token so far; null until an event carries some. */
  logprobs: WireLogprob[] | null = null;
  private lpOffset = 0;

  /** Parses tool calls out of the text (chat requests with tools and tool_choice other than "none"). */
  private readonly tools: ToolCallParser | null;

  /**
   * @param toolSyntax with it, the chat text is parsed for tool calls in this syntax (see
   *   ./tool-calls.ts): calls become `tool_calls` (deltas in streams), the text around them
   *   `content`, and a generation that made a call finishes with 'tool_calls'.
   */
  constructor(
    readonly kind: 'completion' | 'chat',
    readonly meta: ResponseMeta,
    readonly includeUsage = false,
    toolSyntax: ToolCallSyntax | null = null,
  ) {
    this.tools = kind === 'chat' && toolSyntax ? new ToolCallParser(toolSyntax) : null;
  }

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
    if (Number.isInteger(mi.cached_tokens)) this.cachedTokens = mi.cached_tokens!;
    const fr = mi.finish_reason;
    if (fr && fr.type === 'abort') {
      throw new ApiError(500, 'generation_aborted', `generation aborted by the worker${fr.message ? `: ${fr.message}` : ''}`, 'server_error');
    }
    if (fr && fr.type !== 'stop' && fr.type !== 'length') {
      throw new ApiError(502, 'bad_worker_event', `unknown finish_reason from the worker: ${String((fr as { type?: unknown }).type)}`, 'server_error');
    }
    let finish: OpenAIFinishReason | null = fr ? (fr.type as OpenAIFinishReason) : null;
    const out: (TextCompletion | ChatCompletionChunk)[] = [];
    if (this.kind === 'chat' && this.events === 0) out.push(chatCompletionChunk(this.meta, { role: 'assistant', content: '' }, null, this.includeUsage));
    this.events++;
    // With tools, the text is content only where it is not a tool call.
    let text = ev.text;
    let deltas: ToolCallDelta[] = [];
    if (this.tools) {
      const r = this.tools.feed(ev.text);
      if (finish) {
        const e = this.tools.end();
        r.content += e.content;
        r.deltas.push(...e.deltas);
        if (finish === 'stop' && this.tools.called) finish = 'tool_calls';
      }
      [text, deltas] = [r.content, r.deltas];
    }
    this.text += text;
    this.finishReason = finish;
    const lps = Array.isArray(ev.logprobs) && ev.logprobs.length > 0 ? ev.logprobs : null;
    if (lps) (this.logprobs ??= []).push(...lps);
    if (text !== '' || deltas.length > 0 || finish || lps) {
      if (this.kind === 'chat') {
        const delta: ChatDelta = {};
        if (text !== '') delta.content = text;
        if (deltas.length > 0) delta.tool_calls = deltas;
        out.push(chatCompletionChunk(this.meta, delta, finish, this.includeUsage, lps ? chatLogprobs(lps) : null));
      } else {
        out.push(completionChunk(this.meta, ev.text, finish, this.includeUsage, lps ? completionLogprobs(lps, this.lpOffset) : null));
      }
    }
    if (lps) for (const lp of lps) this.lpOffset += lp.token.length;
    return out;
  }

  get usage(): Usage {
    return usageOf(this.promptTokens, this.completionTokens, this.cachedTokens);
  }

  /** Chunks after the finish event (the usage chunk when requested). `[DONE]` is the caller's. */
  tail(): (TextCompletion | ChatCompletionChunk)[] {
    return this.includeUsage ? [usageChunk(this.kind, this.meta, this.usage)] : [];
  }

  /** The non-stream response. @throws Error when called before the finish event. */
  response(): TextCompletion | ChatCompletion {
    if (!this.finishReason) throw new Error('response() before the finish event');
    return this.kind === 'chat'
      ? chatCompletionResponse(this.meta, this.text, this.finishReason, this.usage, this.logprobs ? chatLogprobs(this.logprobs) : null, this.tools?.calls ?? [])
      : completionResponse(this.meta, this.text, this.finishReason, this.usage, this.logprobs ? completionLogprobs(this.logprobs) : null);
  }
}
