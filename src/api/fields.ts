/**
 * Every request field pdserve knows, per endpoint: its zod schema, whether it is honoured or
 * refused, and a note. The request schemas of ./parse.ts are BUILT from this table (a field
 * missing here is an unrecognised argument and gets a 400), and the conformance table of docs/API.md
 * is GENERATED from it (`conformanceMarkdown`, written by `src/api/conformance.ts --write`;
 * a unit test fails when docs/API.md is stale). So nothing can be accepted and ignored without
 * the table saying so.
 *
 * Field lists: OpenAI's completions and chat-completions request schemas plus the common vLLM and
 * SGLang extensions (vLLM's protocol.py CompletionRequest / ChatCompletionRequest). Ranges follow
 * vLLM's SamplingParams validation (presence/frequency in [-2, 2], repetition_penalty > 0,
 * min_p in [0, 1], top_p in (0, 1], temperature in [0, 2], top_k -1/0 = off, min_tokens <=
 * max_tokens, logprobs <= 20).
 */
import { z } from 'zod';
import { MAX_TOKEN_LIST, WorkerGrammarSchema } from '../protocol/worker-protocol.js';
import { MAX_RETENTION_MS } from '../engine/types.js';

/**
 * `agent_hints`: the retention fields the agent-serving proposals name (Dynamo's
 * `nvext.agent_hints.priority`, SGLang's `priority` 0–99 with `retention_seconds`). Unknown keys
 * are dropped (a client written for Dynamo also sends `osl`, `latency_sensitivity`).
 */
export const AgentHintsSchema = z.object({
  priority: z.number().int().min(0).max(99).optional(),
  retention_seconds: z.number().min(0).max(MAX_RETENTION_MS / 1000).optional(),
});
import { SCHEMA_KEYWORDS } from './json-schema.js';

/** 'responses' fields live in ./responses-fields.ts (their own table, docs/RESPONSES.md). */
export type Endpoint = 'completions' | 'chat' | 'responses';
/** honoured: used as specified; partial: some values honoured, the others refused with a 400 naming the field; refused: any non-default value is a 400. */
export type FieldStatus = 'honoured' | 'partial' | 'refused';

export interface FieldSpec {
  name: string;
  endpoints: readonly Endpoint[];
  status: FieldStatus;
  /** One line for the docs/API.md table. */
  notes: string;
  /** Schema of a non-null value (null always means "not set"). */
  schema: z.ZodTypeAny;
  /**
   * For partial/refused fields: returns why the (non-null, valid) value is refused, or null when
   * it is the default / an honoured value.
   */
  refuse?: (value: never) => string | null;
}

const MAX_INT32 = 2 ** 31 - 1;
/** Most stop strings accepted (OpenAI allows 4; pdserve is lenient). */
export const MAX_STOP = 16;
/** Largest logprobs / top_logprobs (vLLM's default max_logprobs and OpenAI's top_logprobs bound). */
export const MAX_LOGPROBS = 20;
/** Default `max_tokens` of /v1/completions (OpenAI and vLLM). */
export const DEFAULT_COMPLETION_MAX_TOKENS = 16;
/** Most choices one request may ask for (n × number of prompts); see api/fanout.ts. */
export const MAX_CHOICES = 16;

/**
 * Why `max_tokens: 0` is refused. OpenAI's legacy completions (and vLLM) take 0 with `echo` to
 * return the prompt alone, used with `logprobs` to score it; pdserve computes no prompt logprobs
 * (echo with logprobs is refused), so an echo-only answer would serve no purpose.
 */
const MAX_TOKENS_ZERO_NOTE = '0 (with echo: the prompt alone, to score it by its logprobs in OpenAI and vLLM) is a 400, as prompt logprobs are not computed';
const MAX_TOKENS_ZERO = 'must be at least 1 (max_tokens 0, which OpenAI and vLLM take with echo to score a prompt by its logprobs, is not supported: prompt logprobs are not computed)';

const BOTH: readonly Endpoint[] = ['completions', 'chat'];
const CMPL: readonly Endpoint[] = ['completions'];
const CHAT: readonly Endpoint[] = ['chat'];

export const TOOLS_REFUSAL =
  "tool calling is not supported by the served model: its chat wrapper (node-llama-cpp) has no function-call syntax, so calls could neither be prompted nor parsed (send the request without tools and functions)";
/** The legacy `functions` / `function_call` fields (and role "function" messages). */
export const LEGACY_FUNCTIONS_REFUSAL = "the legacy 'functions' / 'function_call' fields are not supported: send 'tools' / 'tool_choice' (and role 'tool' messages) instead";

const StopSchema = z.union([z.string(), z.array(z.string()).max(MAX_STOP, `expected at most ${MAX_STOP} stop strings`)]);
const tokenIdKey = z.string().regex(/^\d{1,10}$/, 'logit_bias keys must be token ids');

/** Refuse any value but `dflt`. */
export const notDefault = (dflt: unknown, why: string) => (v: never) => ((v as unknown) === dflt ? null : why);
/** Refuse every non-null value. */
export const refusedAny = (why: string) => () => why;
/** Refuse every value but an empty one ('', false, [], {}). */
export const emptyOk = (why: string) => (v: never) => {
  const x = v as unknown;
  if (x === '' || x === false || (Array.isArray(x) && x.length === 0) || (typeof x === 'object' && x !== null && !Array.isArray(x) && Object.keys(x).length === 0)) return null;
  return why;
};

/** All known request fields. Order = the table's order. */
export const REQUEST_FIELDS: readonly FieldSpec[] = [
  // ---- prompt
  { name: 'prompt', endpoints: CMPL, status: 'partial', notes: `string, [string], token ids, or [token ids]; a batch (several strings or token-id arrays) gives one choice per prompt and n, index = prompt_index × n + i; n × prompts ≤ ${MAX_CHOICES}. In PD each choice is its own room (see n)`, schema: z.unknown() },
  { name: 'messages', endpoints: CHAT, status: 'partial', notes: 'rendered with the model\'s chat template; see the message table below', schema: z.unknown() },
  { name: 'model', endpoints: BOTH, status: 'honoured', notes: "one of the served names (--served-model-name, as vLLM; default: the GGUF's file name without .gguf and 'pdserve'), else 404 model_not_found; may be omitted. Responses carry the first served name", schema: z.string().max(512) },
  // ---- length and stopping
  { name: 'max_tokens', endpoints: BOTH, status: 'honoured', notes: `default ${DEFAULT_COMPLETION_MAX_TOKENS} for completions, the rest of the context for chat (as vLLM); at least 1: ${MAX_TOKENS_ZERO_NOTE}`, schema: z.number().int().min(1, MAX_TOKENS_ZERO).max(MAX_INT32) },
  { name: 'max_completion_tokens', endpoints: CHAT, status: 'honoured', notes: 'wins over max_tokens; at least 1', schema: z.number().int().min(1, MAX_TOKENS_ZERO).max(MAX_INT32) },
  { name: 'min_tokens', endpoints: BOTH, status: 'honoured', notes: 'vLLM: EOS, stop_token_ids and stop strings are not honoured before it; <= max_tokens', schema: z.number().int().min(0).max(MAX_INT32) },
  { name: 'stop', endpoints: BOTH, status: 'honoured', notes: `string or up to ${MAX_STOP} strings; the stop string is not returned`, schema: StopSchema },
  { name: 'stop_token_ids', endpoints: BOTH, status: 'honoured', notes: 'vLLM: these token ids end generation like EOS (their text is not returned)', schema: z.array(z.number().int().min(0).max(MAX_INT32)).max(MAX_TOKEN_LIST) },
  { name: 'ignore_eos', endpoints: BOTH, status: 'honoured', notes: 'vLLM: keep generating past EOS', schema: z.boolean() },
  { name: 'include_stop_str_in_output', endpoints: BOTH, status: 'refused', notes: 'vLLM; only false', schema: z.boolean(), refuse: notDefault(false, 'include_stop_str_in_output=true is not supported') },
  // ---- sampling
  { name: 'temperature', endpoints: BOTH, status: 'honoured', notes: '[0, 2]; 0 = greedy', schema: z.number().min(0).max(2) },
  { name: 'top_p', endpoints: BOTH, status: 'honoured', notes: '(0, 1]', schema: z.number().gt(0).max(1) },
  { name: 'top_k', endpoints: BOTH, status: 'honoured', notes: 'vLLM/SGLang: -1 or 0 = off', schema: z.number().int().min(-1).max(MAX_INT32) },
  { name: 'min_p', endpoints: BOTH, status: 'honoured', notes: 'vLLM: [0, 1]; 0 = off', schema: z.number().min(0).max(1) },
  { name: 'seed', endpoints: BOTH, status: 'honoured', notes: 'same seed, same settings, same output (in --deterministic mode also under load); any safe integer, reduced modulo 2^32 − 1 on every path, so 4294967295 (llama.cpp\'s "random seed" value) ≡ 0. A request migrated after a worker failure (docs/MIGRATION.md) at temperature > 0 restarts its random stream at the migration point', schema: z.number().int().min(Number.MIN_SAFE_INTEGER).max(Number.MAX_SAFE_INTEGER) },
  { name: 'presence_penalty', endpoints: BOTH, status: 'honoured', notes: '[-2, 2], over the generated tokens', schema: z.number().min(-2).max(2) },
  { name: 'frequency_penalty', endpoints: BOTH, status: 'honoured', notes: '[-2, 2], over the generated tokens', schema: z.number().min(-2).max(2) },
  {
    name: 'repetition_penalty',
    endpoints: BOTH,
    status: 'honoured',
    notes: 'vLLM: > 0, 1 = off; over prompt + generated tokens, or generated only when combined with presence/frequency_penalty (llama.cpp has one penalty window)',
    schema: z.number().gt(0).max(1e6),
  },
  { name: 'logit_bias', endpoints: BOTH, status: 'honoured', notes: 'token id → [-100, 100] added to the logit; ids outside the vocabulary are a 400', schema: z.record(tokenIdKey, z.number().min(-100).max(100)) },
  { name: 'allowed_token_ids', endpoints: BOTH, status: 'refused', notes: 'vLLM; not supported', schema: z.array(z.number().int()), refuse: emptyOk('allowed_token_ids is not supported') },
  { name: 'bad_words', endpoints: BOTH, status: 'refused', notes: 'vLLM; not supported', schema: z.array(z.string()), refuse: emptyOk('bad_words is not supported') },
  { name: 'n', endpoints: BOTH, status: 'honoured', notes: `n × prompts ≤ ${MAX_CHOICES}; with seed, choice i uses seed + i. In PD one prefill computation per prompt feeds n decode sequences: the prompt is evaluated and its state saved once, each choice is its own room (own decode pick and handoff of that one state) and samples its own first token from the same distribution (router choice groups; with --no-first-token-from-prefill each choice is a separate request). One failed choice fails the whole request (an error, or an error event in a started stream) and aborts the others. usage: prompt_tokens and prompt_tokens_details.cached_tokens count each prompt once, as its first choice's evaluation of it (the cache hits of the other choices' re-use of the same prompt are not added: cached_tokens stays a part of prompt_tokens); completion_tokens is the sum over all choices`, schema: z.number().int().min(1).max(MAX_CHOICES), refuse: notDefault(1, 'n > 1 is served by splitting the request into choices (planFanOut) before this parser') },
  { name: 'best_of', endpoints: CMPL, status: 'partial', notes: 'only 1', schema: z.number().int().min(1).max(128), refuse: notDefault(1, 'only best_of=1 is supported') },
  { name: 'use_beam_search', endpoints: BOTH, status: 'refused', notes: 'vLLM; only false', schema: z.boolean(), refuse: notDefault(false, 'beam search is not supported') },
  { name: 'length_penalty', endpoints: BOTH, status: 'refused', notes: 'vLLM beam search; only 1', schema: z.number(), refuse: notDefault(1, 'length_penalty (beam search) is not supported') },
  // ---- structured output
  {
    name: 'response_format',
    endpoints: BOTH,
    status: 'honoured',
    notes: 'text; json_object (any JSON object); json_schema (see JSON schemas: the keyword table below; the reply ends with the JSON, finish_reason stop). Output cut by max_tokens is returned as is, not well-formed JSON, with finish_reason length (as OpenAI)',
    schema: z.union([
      z.object({ type: z.literal('text') }).strict(),
      z.object({ type: z.literal('json_object') }).strict(),
      z.object({ type: z.literal('json_schema'), json_schema: z.object({ name: z.string().max(64), description: z.string().optional(), schema: z.record(z.unknown()).optional(), strict: z.boolean().nullish() }).strict() }).strict(),
    ]),
  },
  { name: 'guided_json', endpoints: BOTH, status: 'honoured', notes: 'vLLM: a JSON schema (object or JSON string), same grammar as response_format json_schema', schema: z.union([z.record(z.unknown()), z.string()]) },
  { name: 'guided_regex', endpoints: BOTH, status: 'refused', notes: 'vLLM; regex grammars are not supported', schema: z.string(), refuse: refusedAny('guided_regex is not supported') },
  { name: 'guided_choice', endpoints: BOTH, status: 'refused', notes: 'vLLM; not supported', schema: z.array(z.string()), refuse: refusedAny('guided_choice is not supported') },
  { name: 'guided_grammar', endpoints: BOTH, status: 'refused', notes: 'vLLM; not supported', schema: z.string(), refuse: refusedAny('guided_grammar is not supported') },
  { name: 'guided_decoding_backend', endpoints: BOTH, status: 'refused', notes: 'vLLM; the grammar backend is llama.cpp', schema: z.string(), refuse: refusedAny('guided_decoding_backend is not supported (the grammar backend is llama.cpp)') },
  { name: 'guided_whitespace_pattern', endpoints: BOTH, status: 'refused', notes: 'vLLM; not supported', schema: z.string(), refuse: refusedAny('guided_whitespace_pattern is not supported') },
  { name: 'structured_outputs', endpoints: BOTH, status: 'refused', notes: 'vLLM; use response_format or guided_json', schema: z.record(z.unknown()), refuse: refusedAny('structured_outputs is not supported (use response_format or guided_json)') },
  // ---- output shape
  { name: 'stream', endpoints: BOTH, status: 'honoured', notes: 'SSE chunks, then data: [DONE]', schema: z.boolean() },
  {
    name: 'stream_options',
    endpoints: BOTH,
    status: 'partial',
    notes: 'include_usage honoured (final usage chunk); continuous_usage_stats refused; only with stream=true',
    schema: z.object({ include_usage: z.boolean().nullish(), continuous_usage_stats: z.boolean().nullish() }).strict(),
    refuse: (v: never) => ((v as { continuous_usage_stats?: boolean | null }).continuous_usage_stats ? 'continuous_usage_stats is not supported' : null),
  },
  {
    name: 'logprobs',
    endpoints: BOTH,
    status: 'honoured',
    notes: `completions: integer 0..${MAX_LOGPROBS} (top alternatives per token); chat: boolean. Logprobs of the distribution each token was sampled from (after penalties, bias, grammar, temperature, top-k/p, min-p); PD: token 1's come from prefill (needs the router's default first-token-from-prefill). Tokens are rendered as they read in the text (see Logprobs above)`,
    schema: z.union([z.boolean(), z.number().int().min(0).max(MAX_LOGPROBS)]),
  },
  { name: 'top_logprobs', endpoints: CHAT, status: 'honoured', notes: `0..${MAX_LOGPROBS}, requires logprobs: true`, schema: z.number().int().min(0).max(MAX_LOGPROBS) },
  { name: 'prompt_logprobs', endpoints: BOTH, status: 'refused', notes: 'vLLM; not supported', schema: z.number().int().min(0), refuse: refusedAny('prompt_logprobs are not supported') },
  { name: 'echo', endpoints: CMPL, status: 'partial', notes: 'the prompt text before the output (token-id prompts: their detokenized text); not with logprobs (no prompt logprobs)', schema: z.boolean() },
  { name: 'echo', endpoints: CHAT, status: 'refused', notes: 'vLLM chat echo; only false', schema: z.boolean(), refuse: notDefault(false, 'echo is not supported on chat completions') },
  { name: 'suffix', endpoints: CMPL, status: 'refused', notes: 'insertion is not supported', schema: z.string(), refuse: emptyOk('suffix is not supported') },
  { name: 'skip_special_tokens', endpoints: BOTH, status: 'partial', notes: 'vLLM; true (the default) only: special tokens are never rendered', schema: z.boolean(), refuse: notDefault(true, 'skip_special_tokens=false is not supported') },
  { name: 'spaces_between_special_tokens', endpoints: BOTH, status: 'partial', notes: 'vLLM; true only (no special tokens are rendered)', schema: z.boolean(), refuse: notDefault(true, 'spaces_between_special_tokens=false is not supported') },
  { name: 'return_tokens_as_token_ids', endpoints: BOTH, status: 'refused', notes: 'vLLM; only false', schema: z.boolean(), refuse: notDefault(false, 'return_tokens_as_token_ids is not supported') },
  // ---- prompt handling
  { name: 'add_special_tokens', endpoints: BOTH, status: 'refused', notes: 'vLLM; BOS follows the model (completions) / the chat template (chat)', schema: z.boolean(), refuse: refusedAny('add_special_tokens is not supported (BOS follows the model and its chat template)') },
  { name: 'truncate_prompt_tokens', endpoints: BOTH, status: 'refused', notes: 'vLLM; a prompt that does not fit is a 400', schema: z.number().int(), refuse: refusedAny('truncate_prompt_tokens is not supported') },
  { name: 'add_generation_prompt', endpoints: CHAT, status: 'partial', notes: 'vLLM; true only', schema: z.boolean(), refuse: notDefault(true, 'add_generation_prompt=false is not supported') },
  { name: 'continue_final_message', endpoints: CHAT, status: 'refused', notes: 'vLLM; only false', schema: z.boolean(), refuse: notDefault(false, 'continue_final_message is not supported') },
  { name: 'chat_template', endpoints: CHAT, status: 'refused', notes: "vLLM; the model's own template is used", schema: z.string(), refuse: refusedAny("chat_template is not supported (the model's own template is used)") },
  { name: 'chat_template_kwargs', endpoints: CHAT, status: 'refused', notes: 'vLLM; not supported', schema: z.record(z.unknown()), refuse: emptyOk('chat_template_kwargs is not supported') },
  { name: 'documents', endpoints: CHAT, status: 'refused', notes: 'vLLM RAG documents; not supported', schema: z.array(z.unknown()), refuse: emptyOk('documents are not supported') },
  { name: 'mm_processor_kwargs', endpoints: CHAT, status: 'refused', notes: 'vLLM; text-only server', schema: z.record(z.unknown()), refuse: emptyOk('mm_processor_kwargs is not supported (text-only server)') },
  // ---- tools (through the model's chat wrapper: src/api/tool-calls.ts, src/engine/tools.ts)
  { name: 'tools', endpoints: CHAT, status: 'honoured', notes: `type "function" only, ≤ 128; parameters: a JSON schema (the keyword table below; a refused keyword is a 400 naming it). Rendered into the prompt and parsed from the output in the chat wrapper's own call syntax (node-llama-cpp's: the generic wrapper's \`||call: name({...})\` for a GGUF without a template); a model whose wrapper has no call syntax gets a 400`, schema: z.array(z.unknown()) },
  { name: 'tool_choice', endpoints: CHAT, status: 'honoured', notes: '"auto" (default with tools): free text, a grammar completes a call once the model starts one; "required" / a named function: the grammar forces one call; "none": tools shown, no call parsed. "required" / a name without tools is a 400', schema: z.union([z.string(), z.record(z.unknown())]) },
  { name: 'parallel_tool_calls', endpoints: CHAT, status: 'honoured', notes: "true (default): up to --max-tool-calls calls in one turn where the chat wrapper has a between-calls syntax (node-llama-cpp's parallelism settings, e.g. templates with repeated <tool_call> blocks), whitespace between them bounded; the generic wrapper has none, so one call ends its turn. false: one call. A named tool_choice is one call", schema: z.boolean() },
  { name: 'functions', endpoints: CHAT, status: 'refused', notes: `legacy (deprecated) form of tools: a 400 asking for tools`, schema: z.array(z.unknown()), refuse: emptyOk(LEGACY_FUNCTIONS_REFUSAL) },
  { name: 'function_call', endpoints: CHAT, status: 'refused', notes: 'legacy tool_choice: a 400 asking for tool_choice ("none" accepted)', schema: z.union([z.string(), z.record(z.unknown())]), refuse: notDefault('none', LEGACY_FUNCTIONS_REFUSAL) },
  // ---- OpenAI platform features
  { name: 'user', endpoints: BOTH, status: 'honoured', notes: 'an end-user id: it has no effect on generation (as in OpenAI and vLLM)', schema: z.string().max(256) },
  { name: 'safety_identifier', endpoints: BOTH, status: 'honoured', notes: 'like user: no effect on generation', schema: z.string().max(256) },
  { name: 'cache_salt', endpoints: BOTH, status: 'honoured', notes: "vLLM: the prefix cache's partition. With API keys each key has its own (a key's cached_tokens reveal nothing of another key's prompts); requests giving the same cache_salt share one whatever their key: the explicit opt-in to share (docs/PREFIX-REUSE.md)", schema: z.string().min(1).max(256) },
  { name: 'prompt_cache_key', endpoints: BOTH, status: 'honoured', notes: 'the conversation key of session affinity (then user, the x-session-id header, the first non-system message): the router keeps a key on the worker that served it unless that worker is overloaded (docs/PREFIX-REUSE.md)', schema: z.string().min(1).max(1024) },
  { name: 'agent_hints', endpoints: BOTH, status: 'honoured', notes: "retention hint of this request's cached state (Dynamo's `agent_hints`, SGLang's soft retention): `priority` integer 0–99 (higher = kept longer inside its window; default 0) and `retention_seconds` 0–3600 (its retention window after the request ends; default --session-ttl-ms when the request names a session: prompt_cache_key, user, x-session-id; 0 = none). Soft: orders evictions, never fails a request. Other keys (Dynamo's osl, latency_sensitivity, …) are accepted and ignored (docs/PREFIX-REUSE.md)", schema: AgentHintsSchema },
  { name: 'service_tier', endpoints: BOTH, status: 'partial', notes: '"auto" or "default" only', schema: z.string(), refuse: (v: never) => ((v as string) === 'auto' || (v as string) === 'default' ? null : `service_tier '${v as string}' is not supported (only 'auto' or 'default')`) },
  { name: 'store', endpoints: CHAT, status: 'refused', notes: 'nothing is stored; only false', schema: z.boolean(), refuse: notDefault(false, 'store=true is not supported: pdserve stores nothing') },
  { name: 'metadata', endpoints: CHAT, status: 'refused', notes: 'only with store; an empty object is accepted', schema: z.record(z.string()), refuse: emptyOk('metadata is not supported: pdserve stores nothing') },
  { name: 'reasoning_effort', endpoints: CHAT, status: 'refused', notes: 'not a reasoning model', schema: z.string(), refuse: refusedAny('reasoning_effort is not supported') },
  { name: 'verbosity', endpoints: CHAT, status: 'refused', notes: 'not supported', schema: z.string(), refuse: refusedAny('verbosity is not supported') },
  { name: 'modalities', endpoints: CHAT, status: 'partial', notes: '["text"] only', schema: z.array(z.string()), refuse: (v: never) => ((v as string[]).every((m) => m === 'text') ? null : 'only the text modality is supported') },
  { name: 'audio', endpoints: CHAT, status: 'refused', notes: 'text-only server', schema: z.record(z.unknown()), refuse: refusedAny('audio output is not supported') },
  { name: 'prediction', endpoints: CHAT, status: 'refused', notes: 'predicted outputs are not supported', schema: z.record(z.unknown()), refuse: refusedAny('prediction is not supported') },
  { name: 'web_search_options', endpoints: CHAT, status: 'refused', notes: 'not supported', schema: z.record(z.unknown()), refuse: refusedAny('web_search_options is not supported') },
  { name: 'priority', endpoints: BOTH, status: 'partial', notes: 'vLLM; 0 only (FIFO scheduling)', schema: z.number().int(), refuse: notDefault(0, 'priority scheduling is not supported (only 0)') },
  { name: 'request_id', endpoints: BOTH, status: 'honoured', notes: "vLLM; the client's label for the request (≤ 128 characters): kept in its router trace (`GET /debug/traces/<id>`, `doctor --request`); the response id and the workers' rids stay pdserve's own, so reused ids never collide", schema: z.string().max(128) },
  { name: 'logits_processors', endpoints: BOTH, status: 'refused', notes: 'vLLM; not supported', schema: z.array(z.unknown()), refuse: emptyOk('logits_processors are not supported') },
  { name: 'vllm_xargs', endpoints: BOTH, status: 'refused', notes: 'vLLM; not supported', schema: z.record(z.unknown()), refuse: emptyOk('vllm_xargs is not supported') },
  { name: 'kv_transfer_params', endpoints: BOTH, status: 'refused', notes: 'vLLM; the router owns the KV handoff', schema: z.record(z.unknown()), refuse: refusedAny('kv_transfer_params is not supported: the router owns the KV handoff') },
];

/** Fields of one chat message (`messages[]`), documented the same way. */
export const MESSAGE_FIELDS: readonly { name: string; status: FieldStatus; notes: string }[] = [
  { name: 'role', status: 'partial', notes: 'system, developer (as system), user, assistant, tool; function (legacy) is refused' },
  { name: 'content', status: 'partial', notes: 'string, null, or text parts (joined with newlines); image/audio/file parts are refused' },
  { name: 'name', status: 'honoured', notes: 'any role (LangChain names tool messages after their tool and assistant messages "model"): accepted and not rendered, since node-llama-cpp\'s chat history has no participant name; vLLM passes it to the template, whose common forms ignore it' },
  { name: 'tool_calls', status: 'honoured', notes: 'assistant: rendered as calls in the wrapper\'s syntax, each with the result of the tool message answering its id (every call needs one)' },
  { name: 'tool_call_id', status: 'honoured', notes: 'tool: the id of an earlier assistant tool call (else 400)' },
  { name: 'function_call', status: 'refused', notes: 'legacy; use tool_calls' },
  { name: 'refusal', status: 'partial', notes: 'null or "" only (an echoed assistant message)' },
  { name: 'audio', status: 'refused', notes: 'null only' },
  { name: 'annotations', status: 'partial', notes: 'null or [] only (an echoed assistant message)' },
  { name: 'parsed', status: 'partial', notes: 'assistant only: accepted and not rendered, as a call\'s `function.parsed_arguments` (the openai SDK\'s parse helpers and runTools echo the parsed JSON beside the text that carries it)' },
];

/** The fields of one endpoint, by name. */
export function fieldsOf(endpoint: Endpoint): Map<string, FieldSpec> {
  return new Map(REQUEST_FIELDS.filter((f) => f.endpoints.includes(endpoint)).map((f) => [f.name, f]));
}

const mark: Record<FieldStatus, string> = { honoured: 'honoured', partial: 'partly (rest: 400)', refused: 'refused (400)' };

/** docs/API.md's conformance section (markdown), generated from REQUEST_FIELDS and MESSAGE_FIELDS. */
export function conformanceMarkdown(): string {
  const cell = (f: FieldSpec, e: Endpoint) => (f.endpoints.includes(e) ? mark[f.status] : '—');
  const esc = (s: string) => s.replace(/\|/g, '\\|');
  const lines = [
    '| field | /v1/completions | /v1/chat/completions | notes |',
    '|---|---|---|---|',
    ...REQUEST_FIELDS.map((f) => `| \`${f.name}\` | ${cell(f, 'completions')} | ${cell(f, 'chat')} | ${esc(f.notes)} |`),
    '',
    '| `messages[]` field | status | notes |',
    '|---|---|---|',
    ...MESSAGE_FIELDS.map((f) => `| \`${f.name}\` | ${mark[f.status]} | ${esc(f.notes)} |`),
    '',
    'Any other field is refused with 400 "Unrecognized request argument supplied: <name>" (as OpenAI). `null` always means "not set".',
    '',
    '| JSON-schema keyword | treatment | notes |',
    '|---|---|---|',
    ...SCHEMA_KEYWORDS.map((k) => `| ${k.keyword.split(', ').map((w) => `\`${w}\``).join(', ')} | ${k.status} | ${esc(k.notes)} |`),
    '',
    'A keyword not in this table is refused (400), the message naming it.',
  ];
  return lines.join('\n');
}

/** Re-exported for the schema builder. */
export { WorkerGrammarSchema };
