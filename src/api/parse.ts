/**
 * OpenAI request parsing: request schemas (zod) built from the field table, and normalisation to
 * the worker protocol (`toWorkerRequest`).
 *
 * Nothing is accepted and ignored: every field pdserve knows is listed in ./fields.ts as honoured
 * or refused (docs/API.md's conformance table is generated from it); any other field is a 400
 * "Unrecognized request argument supplied" (as OpenAI). `null` means "not set" for every optional
 * field; wrong types and out-of-range values (vLLM's ranges) are 400s naming the field.
 */
import { protocolVersion } from '../base/version.js';
import { z, ZodError } from 'zod';
import { checkRequestBounds, MAX_MESSAGES, MAX_TOKEN_LIST, type GenerateRequest } from '../protocol/worker-protocol.js';
import type { RoomId } from '../base/room-id.js';
import { DEFAULT_SCHEMA_LIMITS, normaliseJsonSchema, SchemaError, schemaTooComplex, SchemaTooComplexError, type SchemaLimits } from './json-schema.js';
import { DEFAULT_COMPLETION_MAX_TOKENS, fieldsOf, LEGACY_FUNCTIONS_REFUSAL, MESSAGE_FIELDS, TOOLS_REFUSAL, type Endpoint, type FieldSpec } from './fields.js';
import { parseTools, toolGrammarOf, type ParsedTools } from './tool-calls.js';
import type { ChatMessage, JsonGrammarSpec, ToolCallSyntax } from '../engine/types.js';
import { ApiError } from '../base/errors.js';
import { badRequest, zodToApiError } from './errors.js';
import type { OutputChecks } from './respond.js';

export { DEFAULT_COMPLETION_MAX_TOKENS, MAX_STOP } from './fields.js';

/** 400 naming `param`, for a valid value pdserve does not support. */
const unsupported = (param: string, why: string): ApiError => ApiError.of('unsupported_value', `Unsupported value for '${param}': ${why}`, param);

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
    throw ApiError.of('unsupported_media_type', "The request body was not sent as JSON: send it with 'Content-Type: application/json' (a text/plain body is not parsed).");
  }
  if (body === null || typeof body !== 'object' || Array.isArray(body)) throw badRequest(`Invalid request body: expected a JSON object, got ${body === null ? 'null' : Array.isArray(body) ? 'an array' : typeof body}`, null, 'invalid_type');
  const out: Record<string, unknown> = {};
  for (const [k, v] of Object.entries(body as Record<string, unknown>)) {
    const f = fields.get(k);
    if (!f) throw ApiError.of('unrecognized_argument', `Unrecognized request argument supplied: ${k}`, k);
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
  if (p === undefined) throw ApiError.of('missing_required_parameter', "Missing required parameter: 'prompt'.", 'prompt');
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
    parsed: z.unknown(),
  })
  .passthrough();

/**
 * Validate chat messages (see MESSAGE_FIELDS) and flatten their content to text.
 * @throws ApiError 400 naming the offending message field.
 */
export function parseMessages(raw: unknown): ChatMessage[] {
  if (raw === undefined) throw ApiError.of('missing_required_parameter', "Missing required parameter: 'messages'.", 'messages');
  const arr = z.array(z.unknown()).min(1).safeParse(raw);
  if (!arr.success) throw fieldError(['messages'], arr.error);
  const known = new Set(MESSAGE_FIELDS.map((f) => f.name));
  const messages = arr.data.map((m, i) => {
    const r = MessageSchema.safeParse(m);
    if (!r.success) throw fieldError(['messages', i], r.error);
    const msg = r.data;
    const at = (k: string) => `messages[${i}].${k}`;
    for (const k of Object.keys(msg)) if (!known.has(k)) throw ApiError.of('unrecognized_argument', `Unrecognized request argument supplied: ${at(k)}`, at(k));
    if (msg.role === 'function') throw unsupported(at('role'), LEGACY_FUNCTIONS_REFUSAL);
    if (msg.function_call != null) throw unsupported(at('function_call'), LEGACY_FUNCTIONS_REFUSAL);
    if (msg.tool_calls && msg.tool_calls.length > 0 && msg.role !== 'assistant') throw unsupported(at('tool_calls'), 'only assistant messages carry tool_calls');
    if (msg.tool_call_id != null && msg.role !== 'tool') throw unsupported(at('tool_call_id'), 'only tool messages carry a tool_call_id');
    if (msg.role === 'tool' && msg.tool_call_id == null) throw ApiError.of('missing_required_parameter', `Missing required parameter: '${at('tool_call_id')}'.`, at('tool_call_id'));
    // A participant name is accepted and not rendered (see MESSAGE_FIELDS): frameworks send it on every role.
    if (msg.refusal) throw unsupported(at('refusal'), 'a non-empty refusal is not supported');
    if (msg.audio != null) throw unsupported(at('audio'), 'audio is not supported');
    if (msg.parsed != null && msg.role !== 'assistant') throw unsupported(at('parsed'), 'only an assistant message (an echoed reply) carries parsed');
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
    function: z.object({ name: z.string().regex(/^[a-zA-Z0-9_-]{1,64}$/, 'a function name is 1 to 64 of a-z, A-Z, 0-9, _ and -'), arguments: z.string().max(1 << 20), parsed_arguments: z.unknown() }).strict(),
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
  /** The client's `cache_salt` (vLLM). */
  cacheSalt?: string;
  /** `agent_hints` (validated): the retention hint sent to the workers as `retention`. */
  agentHints?: { priority?: number; retention_seconds?: number };
  /** Set by the edge: the salt the workers partition the prefix cache by (../api/access.ts `cacheSaltOf`), sent as `cache_salt`. */
  salt?: string;
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

/**
 * What the response builder checks a finished output against (respond.ts OutputChecks): the
 * json_schema grammar's schema (not with echo: the prompt's text comes first; with tools, the
 * content of a reply that made no call), and each tool's parameters schema.
 */
export function outputChecksOf(parsed: ParsedRequest): OutputChecks {
  const out: OutputChecks = {};
  const g = parsed.sampling.grammar;
  if (g?.type === 'json_schema' && !parsed.sampling.echo) out.output = g.schema;
  // tools + a JSON format (tool_choice auto): a reply without calls ends 'stop' and is checked as the JSON
  if (g?.type === 'tool_call' && g.reply?.type === 'json_schema') out.output = g.reply.schema;
  if ((parsed.sampling.stop?.length ?? 0) > 0 || (parsed.sampling.stop_token_ids?.length ?? 0) > 0) out.stopsMayCut = true;
  if (parsed.kind === 'chat' && parsed.tools) out.tools = new Map(parsed.tools.functions.flatMap((f) => (f.parameters ? [[f.name, f.parameters] as const] : [])));
  return out;
}

/** The grammar a request asks for (response_format json_object / json_schema, guided_json), if any. */
function grammarOf(b: Record<string, unknown>, limits: Readonly<SchemaLimits>): WorkerSampling['grammar'] {
  const rf = b.response_format as { type: string; json_schema?: { schema?: Record<string, unknown> } } | undefined;
  const checked = (schema: unknown, param: string): Record<string, unknown> => {
    try {
      return normaliseJsonSchema(schema, limits);
    } catch (err) {
      if (err instanceof SchemaTooComplexError) throw schemaTooComplex(`${param}${err.path}`, err);
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
    if (lp !== undefined && typeof lp !== 'boolean') throw ApiError.of('invalid_type', "Invalid type for 'logprobs': expected boolean", 'logprobs');
    if (b.top_logprobs !== undefined && lp !== true) throw badRequest("Invalid value for 'top_logprobs': top_logprobs requires logprobs to be true", 'top_logprobs');
    return lp === true ? ((b.top_logprobs as number | undefined) ?? 0) : undefined;
  }
  if (lp !== undefined && typeof lp !== 'number') throw ApiError.of('invalid_type', "Invalid type for 'logprobs': expected an integer in [0, 20]", 'logprobs');
  return lp as number | undefined;
}

/**
 * The parts shared by both endpoints. `maxTokens` undefined = the rest of the context (the
 * worker resolves it once it knows the prompt length).
 */
function commonOf(b: Record<string, unknown>, maxTokens: number | undefined, limits: Readonly<SchemaLimits>): ParsedCommon {
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
  const grammar = grammarOf(b, limits);
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
  if (b.cache_salt !== undefined) out.cacheSalt = b.cache_salt as string;
  const hints = b.agent_hints as { priority?: number; retention_seconds?: number } | undefined;
  if (hints && (hints.priority !== undefined || hints.retention_seconds !== undefined)) {
    out.agentHints = {};
    if (hints.priority !== undefined) out.agentHints.priority = hints.priority;
    if (hints.retention_seconds !== undefined) out.agentHints.retention_seconds = hints.retention_seconds;
  }
  return out;
}

/**
 * Validate and normalise a /v1/completions body (see ./fields.ts for every field).
 * @throws ApiError 400 naming the offending field.
 */
export function parseCompletionRequest(body: unknown, opts: CompletionParseOptions = {}): ParsedCompletionRequest {
  const b = parseFields('completions', body);
  const prompt = parsePrompt(b.prompt);
  return { kind: 'completion', prompt, ...commonOf(b, (b.max_tokens as number | undefined) ?? DEFAULT_COMPLETION_MAX_TOKENS, opts.schemaLimits ?? DEFAULT_SCHEMA_LIMITS) };
}

/** Server settings a completion request is parsed with. */
export interface CompletionParseOptions {
  /** Bounds on guided_json / response_format schemas (`--schema-max-nodes`, `--schema-max-enum-values`); past them a 400 schema_too_complex. */
  schemaLimits?: Readonly<SchemaLimits>;
}

/** Server settings a chat request is parsed with. */
export interface ChatParseOptions extends CompletionParseOptions {
  /** Most tool calls in one turn with parallel_tool_calls (`--max-tool-calls`; default DEFAULT_MAX_TOOL_CALLS). */
  maxToolCalls?: number;
}

/**
 * Validate and normalise a /v1/chat/completions body (see ./fields.ts for every field).
 * `max_completion_tokens` wins over `max_tokens`; neither = the rest of the context.
 * @throws ApiError 400 naming the offending field.
 */
export function parseChatRequest(body: unknown, opts: ChatParseOptions = {}): ParsedChatRequest {
  // Request-controlled counts first: an O(1) length check before any per-message work.
  const tooLarge = checkRequestBounds(body, { maxMessages: MAX_MESSAGES, maxPromptTokens: Infinity });
  if (tooLarge) throw tooLarge;
  const b = parseFields('chat', body);
  const messages = parseMessages(b.messages);
  const maxTokens = (b.max_completion_tokens as number | undefined) ?? (b.max_tokens as number | undefined);
  const limits = opts.schemaLimits ?? DEFAULT_SCHEMA_LIMITS;
  const out: ParsedChatRequest = { kind: 'chat', messages, ...commonOf(b, maxTokens, limits) };
  const tools = parseTools(b, opts.maxToolCalls, limits);
  if (tools) {
    out.tools = tools;
    // The grammar so far is the JSON format's (grammarOf); with tools it becomes the calls' (or either)
    const g = toolGrammarOf(tools, out.sampling.grammar as JsonGrammarSpec | undefined);
    if (g) out.sampling.grammar = g;
  }
  return out;
}

/**
 * The `retention` of a /generate body: the request's `agent_hints` (retention_seconds in ms) and
 * whether it names a session (prompt_cache_key, user or the x-session-id header: a conversation
 * key of those sources, `k:`, `u:`, `s:` in ../protocol/conversation-key.ts) — the workers then
 * give its state the session TTL. Empty when there is nothing to say.
 */
export function retentionOf(parsed: ParsedRequest): { retention?: NonNullable<GenerateRequest['retention']> } {
  const r: NonNullable<GenerateRequest['retention']> = {};
  if (parsed.conversationKey !== undefined && /^[kus]:/.test(parsed.conversationKey)) r.session = true;
  if (parsed.agentHints?.priority !== undefined) r.priority = parsed.agentHints.priority;
  if (parsed.agentHints?.retention_seconds !== undefined) r.ttl_ms = Math.round(parsed.agentHints.retention_seconds * 1000);
  return Object.keys(r).length > 0 ? { retention: r } : {};
}

/** Routing facts the router adds to a request. */
export interface WorkerRouting {
  rid: string;
  bootstrapHost: string;
  bootstrapPort: number;
  /** Random 63-bit room id (base/room-id.ts newRoomId). */
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
    protocol: protocolVersion(),
    sampling_params: parsed.sampling,
    stream: true,
    first_token_from_prefill: routing.firstTokenFromPrefill ?? false,
    bootstrap_host: routing.bootstrapHost,
    bootstrap_port: routing.bootstrapPort,
    bootstrap_room: routing.bootstrapRoom,
    ...(parsed.conversationKey ? { conversation_key: parsed.conversationKey } : {}),
    ...(parsed.salt !== undefined ? { cache_salt: parsed.salt } : {}),
    ...retentionOf(parsed),
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
