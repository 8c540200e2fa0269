/**
 * Turning a worker `/generate` body into engine inputs. Shared by prefill, decode and colocated
 * so every role tokenizes and samples identically (PD output must equal colocated output).
 */
import type { GenerateRequest } from '../protocol/worker-protocol.js';
import type { ChatMessage, Engine, SamplingParams, ToolFunction } from '../engine/types.js';
import type { TokenizerThread } from '../engine/tokenizer-thread.js';
import { ApiError } from '../base/errors.js';
import { TOOLS_REFUSAL } from './fields.js';

/** One wire message → the engine's ChatMessage (what prefill, decode and the router's tokenizer render). */
export function chatMessageOf(m: NonNullable<GenerateRequest['messages']>[number]): ChatMessage {
  const out: ChatMessage = { role: m.role, content: m.content };
  if (m.tool_calls) out.toolCalls = m.tool_calls;
  if (m.tool_call_id !== undefined) out.toolCallId = m.tool_call_id;
  return out;
}

/**
 * Worker sampling_params → engine SamplingParams. An absent max_new_tokens becomes 0, which the
 * engine reads as "the rest of the context" (see `fitSampling`).
 */
export function samplingFromWire(s: GenerateRequest['sampling_params'], resumed?: readonly number[]): SamplingParams {
  const out: SamplingParams = {
    temperature: s.temperature,
    topP: s.top_p,
    topK: s.top_k,
    seed: s.seed,
    maxTokens: s.max_new_tokens ?? 0,
    stop: s.stop,
    ignoreEos: s.ignore_eos,
    minP: s.min_p,
    repetitionPenalty: s.repetition_penalty,
    presencePenalty: s.presence_penalty,
    frequencyPenalty: s.frequency_penalty,
    minTokens: s.min_tokens,
  };
  if (s.logit_bias) out.logitBias = Object.entries(s.logit_bias).map(([k, v]) => [Number(k), v]);
  if (s.stop_token_ids) out.stopTokenIds = s.stop_token_ids;
  if (s.grammar) out.grammar = s.grammar;
  if (s.logprobs !== undefined) out.logprobs = s.logprobs;
  if (s.echo) out.echo = true;
  if (resumed && resumed.length > 0) out.resumed = resumed;
  return out;
}

/**
 * Check that a prompt of `promptTokens` plus the requested output fits the context, and resolve
 * `maxTokens` 0 ("rest of the context") to contextSize - promptTokens. Mutates and returns
 * `sampling`. @throws ApiError 400 context_length_exceeded naming `prompt` or `max_tokens`;
 * 400 naming `min_tokens` when min_tokens exceeds the resolved max_tokens.
 */
export function fitSampling(engine: Engine, promptTokens: number, sampling: SamplingParams): SamplingParams {
  const ctx = engine.info.compat.contextSize;
  if (promptTokens >= ctx) {
    throw ApiError.of('context_length_exceeded', `the prompt (${promptTokens} tokens) leaves no room for output in the context (${ctx} tokens)`, 'prompt');
  }
  if (sampling.maxTokens === 0) sampling.maxTokens = ctx - promptTokens;
  if (promptTokens + sampling.maxTokens > ctx) {
    throw ApiError.of('context_length_exceeded', `prompt (${promptTokens} tokens) + max_tokens (${sampling.maxTokens}) exceeds the context size (${ctx} tokens)`, 'max_tokens');
  }
  if ((sampling.minTokens ?? 0) > sampling.maxTokens) {
    throw ApiError.of('invalid_value', `min_tokens (${sampling.minTokens}) exceeds max_tokens (${sampling.maxTokens})`, 'min_tokens');
  }
  return sampling;
}

/**
 * Check the token ids a request's sampling names (logit_bias keys, stop_token_ids) against the
 * vocabulary and compile its grammar (cached). @throws ApiError 400 naming the field.
 */
export async function checkSampling(engine: Engine, sampling: SamplingParams): Promise<void> {
  const n = engine.info.nVocab;
  const badBias = sampling.logitBias?.find(([t]) => t >= n);
  if (badBias) throw ApiError.of('invalid_value', `logit_bias names token ${badBias[0]}, outside the vocabulary (size ${n})`, 'logit_bias');
  const badStop = sampling.stopTokenIds?.find((t) => t >= n);
  if (badStop !== undefined) throw ApiError.of('invalid_value', `stop_token_ids names token ${badStop}, outside the vocabulary (size ${n})`, 'stop_token_ids');
  try {
    await engine.prepareSampling(sampling);
  } catch (err) {
    const e = err as { code?: string; message?: string };
    const param = sampling.grammar?.type === 'tool_call' ? 'tools' : 'response_format';
    if (e.code === 'BAD_GRAMMAR') throw ApiError.of('invalid_value', e.message ?? 'bad grammar', param);
    // the grammar thread's time budget (engine/grammar-thread.ts)
    if (e.code === 'schema_too_complex') throw ApiError.of('schema_too_complex', `The JSON schema at '${param}' is too complex: ${e.message ?? ''}`, param);
    throw err;
  }
}

type PromptBody = Pick<GenerateRequest, 'text' | 'input_ids' | 'messages' | 'tools'>;

/** What a request's prompt needs to become tokens (after the checks that need no tokenizing). */
type PromptWork = { kind: 'ids'; ids: number[] } | { kind: 'chat'; messages: ChatMessage[]; tools?: ToolFunction[] } | { kind: 'text'; text: string };

/** Prompt bytes (text or message contents) above which `tokenizeRequestOffLoop` uses the tokenizer thread. */
export const OFF_LOOP_PROMPT_BYTES = 4 * 1024;
/** Messages above which `tokenizeRequestOffLoop` uses the tokenizer thread (templating is per message). */
export const OFF_LOOP_MESSAGES = 32;

/**
 * The checks before tokenizing. @throws ApiError 400 when the prompt cannot fit (its bytes alone
 * prove more tokens than the context), is empty, names out-of-vocabulary ids, or asks for tools
 * the model's chat wrapper cannot express.
 */
function promptWork(engine: Engine, body: PromptBody): PromptWork & { bytes: number } {
  // A prompt that cannot fit is refused before tokenizing: tokenizing megabytes takes seconds
  // of event loop, long enough for the KV channel's peers to declare this process lost.
  const bytes = body.text !== undefined ? Buffer.byteLength(body.text) : (body.messages ?? []).reduce((n, m) => n + Buffer.byteLength(m.content), 0);
  const atLeast = Math.floor(bytes / engine.info.maxTokenBytes);
  if (atLeast > engine.info.compat.contextSize) {
    throw ApiError.of('context_length_exceeded', `the prompt (${bytes} bytes, at least ${atLeast} tokens) exceeds the context size (${engine.info.compat.contextSize} tokens)`, body.messages ? 'messages' : 'prompt');
  }
  if (body.input_ids) {
    const n = engine.info.nVocab;
    const bad = body.input_ids.find((t) => t >= n);
    if (bad !== undefined) throw ApiError.of('invalid_token', `token id ${bad} is outside the vocabulary (size ${n})`, 'prompt');
    return { kind: 'ids', ids: body.input_ids, bytes };
  }
  if (body.messages) {
    if (body.messages.length === 0) throw ApiError.of('invalid_request', 'messages must not be empty', 'messages');
    if (body.tools?.length && !engine.toolSyntax) throw ApiError.of('unsupported_value', `Unsupported value for 'tools': ${TOOLS_REFUSAL}`, 'tools');
    return { kind: 'chat', messages: body.messages.map(chatMessageOf), tools: body.tools, bytes };
  }
  return { kind: 'text', text: body.text ?? '', bytes };
}

function nonEmpty(tokens: number[]): number[] {
  if (tokens.length === 0) throw ApiError.of('empty_prompt', 'the prompt is empty (0 tokens)', 'prompt');
  return tokens;
}

/**
 * Prompt tokens of a request: input_ids as given, text tokenized, messages rendered with the
 * model's chat template (and tools) — on the event loop. @throws ApiError 400 for an empty prompt,
 * one that cannot fit, out-of-vocabulary ids, or tools the model cannot express.
 */
export function tokenizeRequest(engine: Engine, body: PromptBody): number[] {
  const w = promptWork(engine, body);
  return nonEmpty(w.kind === 'ids' ? w.ids : w.kind === 'chat' ? engine.renderChat(w.messages, w.tools) : engine.tokenize(w.text));
}

/**
 * As `tokenizeRequest`, but a large prompt (over OFF_LOOP_PROMPT_BYTES bytes or OFF_LOOP_MESSAGES
 * messages: up to ~0.5 s of templating and tokenizing with a real vocabulary) is rendered and
 * tokenized on the tokenizer thread, same functions and same tokens, so the event loop keeps
 * serving heartbeats and streams. Small prompts stay on the loop (a few ms at most), and so does
 * everything when the thread is not available (closed, or out of restarts).
 * @throws ApiError 400 as tokenizeRequest; PdError QUEUE_FULL / TIMEOUT / engine_failed from the thread.
 */
export async function tokenizeRequestOffLoop(engine: Engine, thread: TokenizerThread, body: PromptBody): Promise<number[]> {
  const w = promptWork(engine, body);
  if (w.kind === 'ids') return nonEmpty(w.ids);
  const large = w.bytes > OFF_LOOP_PROMPT_BYTES || (w.kind === 'chat' && w.messages.length > OFF_LOOP_MESSAGES);
  if (!large || !thread.available) return nonEmpty(w.kind === 'chat' ? engine.renderChat(w.messages, w.tools) : engine.tokenize(w.text));
  return nonEmpty(w.kind === 'chat' ? await thread.renderChat(w.messages, w.tools) : await thread.tokenize(w.text));
}
