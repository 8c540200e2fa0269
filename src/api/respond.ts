/**
 * OpenAI response and stream-chunk builders: completions, chat completions, usage, logprobs, and
 * `OpenAIResponseBuilder`, which turns worker events into the client's body or SSE chunks.
 */
import type { GenerateEvent, WireLogprob } from '../protocol/worker-protocol.js';
import { ToolCallParser, type ToolCall, type ToolCallDelta } from './tool-calls.js';
import type { ToolCallSyntax } from '../engine/types.js';
import { bytesOf } from '../engine/token-text.js';
import { ApiError, InternalError } from '../base/errors.js';
import { validateJson } from './json-schema.js';

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

/**
 * What a finished generation is checked against (api/json-schema.ts validateJson): the keywords
 * a grammar cannot enforce (docs/API.md's keyword table, "checked after").
 */
export interface OutputChecks {
  /** response_format json_schema / guided_json: the normalised schema of the whole output. */
  output?: Record<string, unknown>;
  /** Tool calls: each function's normalised parameters schema, by name. */
  tools?: ReadonlyMap<string, Record<string, unknown>>;
  /**
   * The request has stop strings or stop_token_ids: a finish 'stop' may be one of them cutting
   * the JSON, so text that is not JSON is returned as it is (as max_tokens' cut); JSON that
   * parses is still checked.
   */
  stopsMayCut?: boolean;
}

/** The 422 of a finished output that breaks its schema where only the check after generation could see it (`cutOk`: text that is not JSON is no error). */
function schemaMismatch(what: string, text: string, checks: Record<string, unknown>, cutOk = false): ApiError | null {
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch {
    return cutOk ? null : ApiError.of('output_schema_mismatch', `${what} is not valid JSON although its grammar was complete`);
  }
  const v = validateJson(checks, value);
  return v ? ApiError.of('output_schema_mismatch', `${what} breaks the schema at ${v.path}: ${v.message} (a keyword the grammar cannot enforce, checked after generation: see docs/API.md, JSON schemas)`) : null;
}

/** Identity of one response: `id` is the rid, `created` unix seconds. */
export interface ResponseMeta {
  id: string;
  model: string;
  created: number;
}

/**
 * Completions `logprobs` of one choice (OpenAI legacy shape). `tokens` and the keys of
 * `top_logprobs` are token texts as they read in the text (see engine/token-text.ts), so
 * `tokens.join('')` is the text unless a stop string cut it or a token is part of a multi-byte
 * character (`bytes:\xNN…`); `text_offset[i]` is where token i starts in the text, in UTF-16 units.
 */
export interface CompletionLogprobs {
  tokens: string[];
  token_logprobs: number[];
  top_logprobs: Record<string, number>[];
  text_offset: number[];
}

/** One token of a chat choice's `logprobs.content` (OpenAI shape; bytes = the token's UTF-8 bytes, partial for a part of a multi-byte character). */
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

/**
 * Text offsets of consecutive tokens of one text: `next(bytes)` returns where the token with these
 * UTF-8 bytes starts (UTF-16 units) and moves past it. A character split over tokens starts where
 * its first part's token does; the bytes are decoded as a stream, as the text is.
 */
export class TextOffsets {
  private readonly decoder = new TextDecoder('utf-8', { ignoreBOM: true });
  private at: number;

  /** @param start offset of the first token (UTF-16 units of text before it). */
  constructor(start = 0) {
    this.at = start;
  }

  next(bytes: readonly number[]): number {
    const off = this.at;
    this.at += this.decoder.decode(Uint8Array.from(bytes), { stream: true }).length;
    return off;
  }
}

/**
 * Completions logprobs of `lps`, offsets from `offsets` (shared by a stream's chunks). An
 * alternative whose text another, likelier one has too keeps the likelier logprob (the
 * alternatives come most likely first).
 */
export function completionLogprobs(lps: readonly WireLogprob[], offsets = new TextOffsets()): CompletionLogprobs {
  const out: CompletionLogprobs = { tokens: [], token_logprobs: [], top_logprobs: [], text_offset: [] };
  for (const lp of lps) {
    out.tokens.push(lp.token);
    out.token_logprobs.push(lp.logprob);
    const top: Record<string, number> = {};
    for (const t of lp.top) if (!Object.hasOwn(top, t.token)) top[t.token] = t.logprob;
    out.top_logprobs.push(top);
    out.text_offset.push(offsets.next(bytesOf(lp)));
  }
  return out;
}

/** Chat logprobs of `lps`. */
export function chatLogprobs(lps: readonly WireLogprob[]): ChatLogprobs {
  return { content: lps.map((lp) => ({ token: lp.token, logprob: lp.logprob, bytes: bytesOf(lp), top_logprobs: lp.top.map((t) => ({ token: t.token, logprob: t.logprob, bytes: bytesOf(t) })) })), refusal: null };
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
 * With `checks`, an output that ends by itself (finish_reason stop / tool_calls) is validated
 * against its schema: a violation throws ApiError 422 'output_schema_mismatch' at the finish
 * event (non-stream: the response is that error; stream: the SSE error event ends the stream).
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
  /** Text offsets of the streamed chunks' tokens. */
  private readonly offsets = new TextOffsets();

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
    private readonly checks: OutputChecks = {},
  ) {
    this.tools = kind === 'chat' && toolSyntax ? new ToolCallParser(toolSyntax) : null;
  }

  /** @throws ApiError 422 'output_schema_mismatch' (see the class doc). */
  private check(full: string, finish: OpenAIFinishReason): void {
    if (finish === 'stop' && this.checks.output) {
      const e = schemaMismatch('the output', full, this.checks.output, this.checks.stopsMayCut === true);
      if (e) throw e;
    }
    if (finish === 'tool_calls' && this.checks.tools && this.tools) {
      for (const c of this.tools.calls) {
        const schema = this.checks.tools.get(c.function.name);
        const e = schema ? schemaMismatch(`the arguments of the call of '${c.function.name}'`, c.function.arguments, schema) : null;
        if (e) throw e;
      }
    }
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
      throw ApiError.of('bad_worker_event', 'malformed generation event from the worker');
    }
    if (this.finished) throw ApiError.of('bad_worker_event', 'generation event after the finish event');
    const mi = ev.meta_info;
    if (Number.isInteger(mi.prompt_tokens)) this.promptTokens = mi.prompt_tokens;
    if (Number.isInteger(mi.completion_tokens)) this.completionTokens = mi.completion_tokens;
    if (Number.isInteger(mi.cached_tokens)) this.cachedTokens = mi.cached_tokens!;
    const fr = mi.finish_reason;
    if (fr && fr.type === 'abort') {
      throw ApiError.of('generation_aborted', `generation aborted by the worker${fr.message ? `: ${fr.message}` : ''}`);
    }
    if (fr && fr.type !== 'stop' && fr.type !== 'length') {
      throw ApiError.of('bad_worker_event', `unknown finish_reason from the worker: ${String((fr as { type?: unknown }).type)}`);
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
        const e = this.tools.end(finish === 'length');
        r.content += e.content;
        r.deltas.push(...e.deltas);
        if (finish === 'stop' && this.tools.called) finish = 'tool_calls';
      }
      [text, deltas] = [r.content, r.deltas];
    }
    if (finish) this.check(this.text + text, finish);
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
        out.push(completionChunk(this.meta, ev.text, finish, this.includeUsage, lps ? completionLogprobs(lps, this.offsets) : null));
      }
    }
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
    if (!this.finishReason) throw new InternalError('response() before the finish event');
    return this.kind === 'chat'
      ? chatCompletionResponse(this.meta, this.text, this.finishReason, this.usage, this.logprobs ? chatLogprobs(this.logprobs) : null, this.tools?.calls ?? [])
      : completionResponse(this.meta, this.text, this.finishReason, this.usage, this.logprobs ? completionLogprobs(this.logprobs) : null);
  }
}
