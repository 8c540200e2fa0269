/**
 * Every request field of POST /v1/responses (OpenAI's Responses API), honoured or refused, as
 * ./fields.ts does for completions and chat: the request parser of ./responses.ts is built from
 * this table (any other name is a 400 "Unrecognized request argument supplied") and the field
 * table of docs/RESPONSES.md is generated from it (`responsesConformanceMarkdown`, written by
 * `src/api/conformance.ts --write`; a unit test fails when the doc is stale).
 *
 * Field list: the openai SDK's `ResponseCreateParamsBase` (openai-node 6.x). Fields shared with
 * chat (sampling, user, service_tier) reuse chat's schemas, so their ranges are the same.
 */
import { z } from 'zod';
import { emptyOk, fieldsOf, notDefault, refusedAny, type FieldSpec, type FieldStatus } from './fields.js';
import { InternalError } from '../base/errors.js';

/** Most `metadata` keys, and their key / value lengths (OpenAI's limits). */
export const MAX_METADATA_KEYS = 16;
const MAX_INT32 = 2 ** 31 - 1;

const R = ['responses'] as const;
const chat = fieldsOf('chat');
/** Chat's schema of `name` (the same ranges on both endpoints). */
const chatSchema = (name: string): z.ZodTypeAny => {
  const f = chat.get(name);
  if (!f) throw new InternalError(`no chat field ${name}`);
  return f.schema;
};

const MetadataSchema = z
  .record(z.string().max(64), z.string().max(512))
  .refine((m) => Object.keys(m).length <= MAX_METADATA_KEYS, `at most ${MAX_METADATA_KEYS} keys`);

const TextFormatSchema = z.union([
  z.object({ type: z.literal('text') }).strict(),
  z.object({ type: z.literal('json_object') }).strict(),
  z.object({ type: z.literal('json_schema'), name: z.string().max(64), description: z.string().nullish(), schema: z.record(z.unknown()), strict: z.boolean().nullish() }).strict(),
]);

/** All fields of POST /v1/responses. Order = table order. */
export const RESPONSES_FIELDS: readonly FieldSpec[] = [
  { name: 'model', endpoints: R, status: 'honoured', notes: 'as chat: a served name, else 404 model_not_found; may be omitted', schema: chatSchema('model') },
  { name: 'input', endpoints: R, status: 'partial', notes: 'a string (one user message) or items: messages (roles user, assistant, system, developer; content a string or input_text / output_text parts), function_call, function_call_output, item_reference (an item of a stored response). Images, files, audio and reasoning items are a 400', schema: z.union([z.string(), z.array(z.unknown())]) },
  { name: 'instructions', endpoints: R, status: 'honoured', notes: 'a system message before the input; not carried over by previous_response_id (as OpenAI)', schema: z.string() },
  { name: 'previous_response_id', endpoints: R, status: 'honoured', notes: "continue a stored response: its input and output come before this input, exactly as they were (the workers' prefix caches hold that prefix); an unknown, expired or deleted id is a 400 previous_response_not_found (OpenAI's code)", schema: z.string().max(256) },
  { name: 'store', endpoints: R, status: 'honoured', notes: 'default true: the response is kept (bounded by count, bytes and age, see below) for GET, DELETE and previous_response_id', schema: z.boolean() },
  { name: 'stream', endpoints: R, status: 'honoured', notes: 'SSE with the Responses event types (response.created … response.completed)', schema: z.boolean() },
  { name: 'stream_options', endpoints: R, status: 'partial', notes: 'include_obfuscation false only (no padding field is sent)', schema: z.object({ include_obfuscation: z.boolean().nullish() }).strict(), refuse: (v: never) => ((v as { include_obfuscation?: boolean | null }).include_obfuscation ? 'include_obfuscation is not supported' : null) },
  { name: 'max_output_tokens', endpoints: R, status: 'honoured', notes: 'as chat max_completion_tokens (default: the rest of the context); a cut reply is status incomplete, reason max_output_tokens', schema: z.number().int().min(1).max(MAX_INT32) },
  { name: 'temperature', endpoints: R, status: 'honoured', notes: 'as chat', schema: chatSchema('temperature') },
  { name: 'top_p', endpoints: R, status: 'honoured', notes: 'as chat', schema: chatSchema('top_p') },
  { name: 'tools', endpoints: R, status: 'partial', notes: 'type function only ({type, name, description, parameters, strict}), through the chat path\'s tool calling; other tool types are a 400', schema: z.array(z.unknown()) },
  { name: 'tool_choice', endpoints: R, status: 'partial', notes: '"auto", "none", "required" or {type: "function", name}; other forms are a 400', schema: z.union([z.string(), z.record(z.unknown())]) },
  { name: 'parallel_tool_calls', endpoints: R, status: 'honoured', notes: 'as chat', schema: chatSchema('parallel_tool_calls') },
  { name: 'max_tool_calls', endpoints: R, status: 'refused', notes: 'not supported', schema: z.number().int(), refuse: refusedAny('max_tool_calls is not supported') },
  { name: 'text', endpoints: R, status: 'partial', notes: 'format text, json_object or json_schema (as chat response_format); verbosity refused', schema: z.object({ format: TextFormatSchema.nullish(), verbosity: z.string().nullish() }).strict(), refuse: (v: never) => ((v as { verbosity?: string | null }).verbosity ? 'text.verbosity is not supported' : null) },
  { name: 'metadata', endpoints: R, status: 'honoured', notes: `≤ ${MAX_METADATA_KEYS} string pairs (keys ≤ 64, values ≤ 512 characters), returned with the response`, schema: MetadataSchema },
  { name: 'user', endpoints: R, status: 'honoured', notes: 'as chat: no effect on generation', schema: chatSchema('user') },
  { name: 'safety_identifier', endpoints: R, status: 'honoured', notes: 'as chat: no effect on generation', schema: chatSchema('safety_identifier') },
  { name: 'prompt_cache_key', endpoints: R, status: 'honoured', notes: 'as chat: the conversation key of session affinity', schema: chatSchema('prompt_cache_key') },
  { name: 'cache_salt', endpoints: R, status: 'honoured', notes: "as chat (vLLM's field): the prefix cache's partition; with API keys each key has its own, and requests giving the same cache_salt share one whatever their key (docs/PREFIX-REUSE.md). Not echoed in the response", schema: chatSchema('cache_salt') },
  { name: 'agent_hints', endpoints: R, status: 'honoured', notes: 'as chat: priority and retention_seconds of the cached state (docs/PREFIX-REUSE.md)', schema: chatSchema('agent_hints') },
  { name: 'prompt_cache_retention', endpoints: R, status: 'partial', notes: '"in_memory" only', schema: z.string(), refuse: notDefault('in_memory', "only 'in_memory' prompt cache retention is supported") },
  { name: 'service_tier', endpoints: R, status: 'partial', notes: 'as chat: "auto" or "default" only', schema: chatSchema('service_tier'), refuse: chat.get('service_tier')!.refuse },
  { name: 'truncation', endpoints: R, status: 'partial', notes: '"disabled" only: an input that does not fit the context is a 400', schema: z.string(), refuse: notDefault('disabled', "only truncation 'disabled' is supported (an input that does not fit is a 400)") },
  { name: 'top_logprobs', endpoints: R, status: 'refused', notes: 'not supported on /v1/responses (chat has logprobs)', schema: z.number().int().min(0), refuse: notDefault(0, 'top_logprobs is not supported on /v1/responses (use /v1/chat/completions)') },
  { name: 'include', endpoints: R, status: 'refused', notes: 'an empty list only', schema: z.array(z.string()), refuse: emptyOk('include is not supported') },
  { name: 'reasoning', endpoints: R, status: 'refused', notes: 'not a reasoning model; {} accepted', schema: z.record(z.unknown()), refuse: (v: never) => (Object.values(v as Record<string, unknown>).every((x) => x == null) ? null : 'reasoning is not supported (not a reasoning model)') },
  { name: 'background', endpoints: R, status: 'partial', notes: 'false only', schema: z.boolean(), refuse: notDefault(false, 'background responses are not supported') },
  { name: 'conversation', endpoints: R, status: 'refused', notes: 'conversations are not supported; use previous_response_id', schema: z.union([z.string(), z.record(z.unknown())]), refuse: refusedAny('conversation is not supported (use previous_response_id)') },
  { name: 'prompt', endpoints: R, status: 'refused', notes: 'prompt templates are not supported', schema: z.record(z.unknown()), refuse: refusedAny('prompt templates are not supported') },
  { name: 'context_management', endpoints: R, status: 'refused', notes: 'not supported', schema: z.array(z.unknown()), refuse: emptyOk('context_management is not supported') },
  { name: 'moderation', endpoints: R, status: 'refused', notes: 'not supported', schema: z.record(z.unknown()), refuse: emptyOk('moderation is not supported') },
  { name: 'prompt_cache_options', endpoints: R, status: 'refused', notes: 'not supported', schema: z.record(z.unknown()), refuse: emptyOk('prompt_cache_options is not supported') },
];

/** The fields of /v1/responses by name. */
export const RESPONSES_FIELD_MAP: ReadonlyMap<string, FieldSpec> = new Map(RESPONSES_FIELDS.map((f) => [f.name, f]));

/** Fields of one `input` item, by item type. */
export const RESPONSES_ITEM_FIELDS: readonly { item: string; status: FieldStatus; notes: string }[] = [
  { item: 'message', status: 'partial', notes: 'role user / assistant / system / developer (as system); content a string or input_text / output_text parts (joined with newlines); id, status and phase accepted; image, file, audio and refusal parts are a 400' },
  { item: 'function_call', status: 'honoured', notes: 'an assistant tool call (call_id, name, arguments); consecutive calls are one assistant turn' },
  { item: 'function_call_output', status: 'honoured', notes: 'the result of a call (output a string or input_text parts); every call needs one, after it' },
  { item: 'item_reference', status: 'honoured', notes: "an item (message or function_call) of a stored response, by its id" },
  { item: 'other types', status: 'refused', notes: 'reasoning, built-in tool calls and their outputs: a 400 naming the item' },
];

const mark: Record<FieldStatus, string> = { honoured: 'honoured', partial: 'partly (rest: 400)', refused: 'refused (400)' };

/** docs/RESPONSES.md's field tables (markdown), generated from RESPONSES_FIELDS and RESPONSES_ITEM_FIELDS. */
export function responsesConformanceMarkdown(): string {
  const esc = (s: string) => s.replace(/\|/g, '\\|');
  return [
    '| field | status | notes |',
    '|---|---|---|',
    ...RESPONSES_FIELDS.map((f) => `| \`${f.name}\` | ${mark[f.status]} | ${esc(f.notes)} |`),
    '',
    '| `input[]` item | status | notes |',
    '|---|---|---|',
    ...RESPONSES_ITEM_FIELDS.map((f) => `| \`${f.item}\` | ${mark[f.status]} | ${esc(f.notes)} |`),
    '',
    'Any other field is refused with 400 "Unrecognized request argument supplied: <name>" (as OpenAI). `null` always means "not set".',
  ].join('\n');
}
