/**
 * OpenAI's Responses API as an adapter over the chat path: pure functions and a translator, no
 * I/O (the HTTP side is ./responses-http.ts).
 *
 *   parseResponsesRequest(body, store) → { chat: the /v1/chat/completions body, ... }
 *       Validates the body against ./responses-fields.ts, turns `instructions` + the stored
 *       conversation of `previous_response_id` + `input` items into chat messages, function
 *       tools into chat tools, `text.format` into `response_format`, and checks the result with
 *       the chat parser itself (its errors renamed to the Responses field that caused them).
 *   ResponsesTranslator
 *       Turns the chat path's stream chunks (`chat.completion.chunk`, then the usage chunk) into
 *       Responses stream events (response.created … response.completed, each with its
 *       sequence_number) and the final Response object; text becomes a `message` item with one
 *       `output_text` part, each tool call a `function_call` item (call_id = the chat call id).
 *   storedRecordOf(parsed, response) → the ResponseStore record continuing this conversation.
 *
 * Shapes follow the openai SDK's types (openai-node 6.x `Response`, `ResponseStreamEvent`,
 * `ResponseInputItem`); vLLM's /v1/responses maps Responses onto its chat machinery the same way.
 */
import { randomBytes } from 'node:crypto';
import { systemClock } from '../base/clock.js';
import { z, type ZodError } from 'zod';
import { ApiError } from '../base/errors.js';
import { parseChatRequest, parseFieldTable } from './parse.js';
import { RESPONSES_FIELD_MAP } from './responses-fields.js';
import type { ResponseStore, ResponseStoreView, StoredResponse, WireChatMessage } from './responses-store.js';

/** A fresh item or response id: `prefix` + 48 hex digits (OpenAI's ids are as long). */
export const newItemId = (prefix: string): string => `${prefix}_${randomBytes(24).toString('hex')}`;

/** A message input item as input_items lists it: its id (or a new one), text content as parts (input_text; assistant: output_text). */
function messageItem(id: string | undefined, role: string, content: string | unknown[]): Record<string, unknown> {
  const parts = typeof content === 'string' ? [role === 'assistant' ? { type: 'output_text', text: content, annotations: [] } : { type: 'input_text', text: content }] : content;
  return { id: id ?? newItemId('msg'), type: 'message', role, status: 'completed', content: parts };
}

/** A validated /v1/responses request, with the chat request it becomes. */
export interface ParsedResponsesRequest {
  /** The /v1/chat/completions body (always `stream: true` with usage: see ./responses-http.ts). */
  chat: Record<string, unknown>;
  stream: boolean;
  store: boolean;
  /** The conversation (without instructions) up to this input: stored history + new input. */
  history: WireChatMessage[];
  /** The context as Responses items, ids included (GET /v1/responses/{id}/input_items): the previous response's input items and output, then this input. */
  inputItems: Record<string, unknown>[];
  /** Echoed request settings of the Response object. */
  echo: ResponseEcho;
}

/** The request settings a Response object repeats. */
export interface ResponseEcho {
  instructions: string | null;
  previous_response_id: string | null;
  max_output_tokens: number | null;
  temperature: number;
  top_p: number;
  tools: Record<string, unknown>[];
  tool_choice: unknown;
  parallel_tool_calls: boolean;
  text: { format: Record<string, unknown> };
  metadata: Record<string, string>;
  store: boolean;
  user: string | null;
  safety_identifier: string | null;
  prompt_cache_key: string | null;
}

const bad = (param: string, message: string): ApiError => ApiError.of('invalid_value', `Invalid value for '${param}': ${message}`, param);
const unsupported = (param: string, why: string): ApiError => ApiError.of('unsupported_value', `Unsupported value for '${param}': ${why}`, param);

function zodError(prefix: string, err: ZodError): ApiError {
  const i = err.issues[0]!;
  const at = [prefix, ...i.path.map((p) => (typeof p === 'number' ? `[${p}]` : `.${p}`))].join('');
  if (i.code === 'unrecognized_keys') return ApiError.of('unrecognized_argument', `Unrecognized request argument supplied: ${at}.${i.keys[0]}`, `${at}.${i.keys[0]}`);
  if (i.code === 'invalid_type' && i.received === 'undefined') return ApiError.of('missing_required_parameter', `Missing required parameter: '${at}'.`, at);
  return bad(at, i.message);
}

const TextPart = z.object({ type: z.enum(['input_text', 'output_text']), text: z.string(), annotations: z.array(z.unknown()).max(0, 'annotations are not supported').nullish(), logprobs: z.array(z.unknown()).nullish() }).strict();
const MessageItem = z
  .object({
    type: z.literal('message').optional(),
    role: z.enum(['user', 'assistant', 'system', 'developer']),
    content: z.union([z.string(), z.array(z.unknown())]),
    id: z.string().max(256).nullish(),
    status: z.string().nullish(),
    phase: z.string().nullish(),
  })
  .strict();
const FunctionCallItem = z
  .object({
    type: z.literal('function_call'),
    call_id: z.string().min(1).max(256),
    name: z.string().regex(/^[a-zA-Z0-9_-]{1,64}$/, 'a function name is 1 to 64 of a-z, A-Z, 0-9, _ and -'),
    arguments: z.string().max(1 << 20),
    id: z.string().max(256).nullish(),
    status: z.string().nullish(),
  })
  .strict();
const FunctionCallOutputItem = z
  .object({ type: z.literal('function_call_output'), call_id: z.string().min(1).max(256), output: z.union([z.string(), z.array(z.unknown())]), id: z.string().max(256).nullish(), status: z.string().nullish() })
  .strict();
const ItemReference = z.object({ type: z.literal('item_reference'), id: z.string().max(256) }).strict();
const FunctionTool = z
  .object({ type: z.literal('function'), name: z.string(), description: z.string().nullish(), parameters: z.record(z.unknown()).nullish(), strict: z.boolean().nullish() })
  .strict();
const ToolChoice = z.union([z.enum(['none', 'auto', 'required']), z.object({ type: z.literal('function'), name: z.string() }).strict()]);

/** Text of a content list (input_text / output_text parts joined with newlines, as chat joins text parts). */
function partsText(parts: unknown[], at: string): string {
  return parts
    .map((p, j) => {
      const type = (p as { type?: unknown } | null)?.type;
      if (type !== 'input_text' && type !== 'output_text') throw unsupported(`${at}[${j}].type`, `content part type '${String(type)}' is not supported (only input_text and output_text: a text-only server)`);
      const r = TextPart.safeParse(p);
      if (!r.success) throw zodError(`${at}[${j}]`, r.error);
      return r.data.text;
    })
    .join('\n');
}

/**
 * Input items → chat messages appended to `out` (consecutive function_call items join one
 * assistant message; a message appended to is copied first, never changed in place: stored
 * histories share their objects). `sources[k]` names the input item that made out[k].
 */
function appendItems(items: unknown[], store: Pick<ResponseStoreView, 'item'>, out: WireChatMessage[], sources: string[], listed: Record<string, unknown>[]): void {
  const from = out.length;
  const add = (m: WireChatMessage, at: string) => {
    out.push(m);
    sources.push(at);
  };
  const item = (raw: unknown, at: string, viaReference = false): void => {
    const type = (raw as { type?: unknown } | null)?.type;
    if (raw === null || typeof raw !== 'object' || Array.isArray(raw)) throw bad(at, 'expected an input item (object)');
    if (type === undefined || type === 'message') {
      const r = MessageItem.safeParse(raw);
      if (!r.success) throw zodError(at, r.error);
      const content = typeof r.data.content === 'string' ? r.data.content : partsText(r.data.content, `${at}.content`);
      const role = r.data.role === 'developer' ? 'system' : r.data.role;
      add({ role, content }, at);
      if (!viaReference) listed.push(messageItem(r.data.id ?? undefined, r.data.role, r.data.content));
      return;
    }
    if (type === 'function_call') {
      const r = FunctionCallItem.safeParse(raw);
      if (!r.success) throw zodError(at, r.error);
      const call = { id: r.data.call_id, type: 'function' as const, function: { name: r.data.name, arguments: r.data.arguments } };
      const last = out[out.length - 1];
      if (last && out.length > from && last.role === 'assistant') {
        out[out.length - 1] = { ...last, tool_calls: [...(last.tool_calls ?? []), call] };
      } else add({ role: 'assistant', content: null, tool_calls: [call] }, at);
      if (!viaReference) listed.push({ id: r.data.id ?? newItemId('fc'), type: 'function_call', status: 'completed', call_id: r.data.call_id, name: r.data.name, arguments: r.data.arguments });
      return;
    }
    if (type === 'function_call_output') {
      const r = FunctionCallOutputItem.safeParse(raw);
      if (!r.success) throw zodError(at, r.error);
      const content = typeof r.data.output === 'string' ? r.data.output : partsText(r.data.output, `${at}.output`);
      add({ role: 'tool', tool_call_id: r.data.call_id, content }, at);
      if (!viaReference) listed.push({ id: r.data.id ?? newItemId('fco'), type: 'function_call_output', status: 'completed', call_id: r.data.call_id, output: r.data.output });
      return;
    }
    if (type === 'item_reference' && !viaReference) {
      const r = ItemReference.safeParse(raw);
      if (!r.success) throw zodError(at, r.error);
      const stored = store.item(r.data.id);
      if (!stored) throw ApiError.of('not_found', `Item with id '${r.data.id}' not found (items of stored responses only; it may have expired or been deleted).`, `${at}.id`);
      item(stored, at, true);
      listed.push(structuredClone(stored));
      return;
    }
    throw unsupported(`${at}.type`, `input item type '${String(type)}' is not supported (message, function_call, function_call_output and item_reference are)`);
  };
  items.forEach((raw, i) => item(raw, `input[${i}]`));
}

/** Rename a chat parser error's param to the Responses field (or input item) that caused it. */
function renamed(err: ApiError, sources: string[], hasInstructions: boolean): ApiError {
  const p = err.param;
  if (!p) return err;
  const map = (param: string): string => {
    const m = /^messages\[(\d+)\](.*)$/.exec(param);
    if (m) {
      const k = Number(m[1]) - (hasInstructions ? 1 : 0);
      return k < 0 ? 'instructions' : (sources[k] ?? 'input');
    }
    if (param.startsWith('max_completion_tokens')) return 'max_output_tokens';
    if (param.startsWith('response_format')) return `text.format${param.slice('response_format'.length).replace(/^\.json_schema/, '')}`;
    return param.replace(/^tools\[(\d+)\]\.function/, 'tools[$1]');
  };
  const to = map(p);
  if (to === p) return err;
  return err.with({ message: err.message.split(`'${p}'`).join(`'${to}'`), param: to });
}

/**
 * Validate a /v1/responses body and build its chat request (see the module doc).
 * @throws ApiError 400 naming the Responses field; 400 previous_response_not_found for an unknown previous_response_id (OpenAI's code), 404 for an unknown item_reference.
 */
export function parseResponsesRequest(body: unknown, store: Pick<ResponseStoreView, 'get' | 'item'>): ParsedResponsesRequest {
  const b = parseFieldTable(RESPONSES_FIELD_MAP, body);
  if (b.input === undefined) throw ApiError.of('missing_required_parameter', "Missing required parameter: 'input'.", 'input');
  const history: WireChatMessage[] = [];
  const sources: string[] = [];
  const inputItems: Record<string, unknown>[] = [];
  const prevId = b.previous_response_id as string | undefined;
  if (prevId !== undefined) {
    const prev = store.get(prevId);
    if (!prev) throw ApiError.of('previous_response_not_found', `Previous response with id '${prevId}' not found.`, 'previous_response_id');
    history.push(...prev.history);
    for (let i = 0; i < prev.history.length; i++) sources.push('previous_response_id');
    inputItems.push(...prev.input, ...((prev.response.output as Record<string, unknown>[] | undefined) ?? []));
  }
  if (typeof b.input === 'string') {
    history.push({ role: 'user', content: b.input });
    sources.push('input');
    inputItems.push(messageItem(undefined, 'user', b.input));
  } else appendItems(b.input as unknown[], store, history, sources, inputItems);
  if (history.length === 0) throw bad('input', 'the input is empty (and there is no previous response)');

  const instructions = (b.instructions as string | undefined) ?? null;
  const messages: WireChatMessage[] = instructions !== null ? [{ role: 'system', content: instructions }, ...history] : history;
  const chat: Record<string, unknown> = { messages, stream: true, stream_options: { include_usage: true } };
  for (const k of ['model', 'temperature', 'top_p', 'parallel_tool_calls', 'user', 'safety_identifier', 'service_tier', 'prompt_cache_key', 'cache_salt', 'agent_hints'] as const) if (b[k] !== undefined) chat[k] = b[k];
  if (b.max_output_tokens !== undefined) chat.max_completion_tokens = b.max_output_tokens;

  const tools = ((b.tools as unknown[] | undefined) ?? []).map((t, i) => {
    const type = (t as { type?: unknown } | null)?.type;
    if (type !== 'function') throw unsupported(`tools[${i}].type`, `tool type '${String(type)}' is not supported (only function tools)`);
    const r = FunctionTool.safeParse(t);
    if (!r.success) throw zodError(`tools[${i}]`, r.error);
    return r.data;
  });
  if (tools.length > 0) chat.tools = tools.map((t) => ({ type: 'function', function: { name: t.name, ...(t.description != null ? { description: t.description } : {}), ...(t.parameters != null ? { parameters: t.parameters } : {}), ...(t.strict != null ? { strict: t.strict } : {}) } }));
  let toolChoice: unknown = 'auto';
  if (b.tool_choice !== undefined) {
    const r = ToolChoice.safeParse(b.tool_choice);
    if (!r.success) throw unsupported('tool_choice', 'expected "none", "auto", "required" or {"type": "function", "name": ...}');
    toolChoice = r.data;
    chat.tool_choice = typeof r.data === 'string' ? r.data : { type: 'function', function: { name: r.data.name } };
  }
  const format = ((b.text as { format?: Record<string, unknown> | null } | undefined)?.format ?? { type: 'text' }) as Record<string, unknown>;
  if (format.type === 'json_object') chat.response_format = { type: 'json_object' };
  if (format.type === 'json_schema') chat.response_format = { type: 'json_schema', json_schema: { name: format.name, ...(format.description != null ? { description: format.description } : {}), schema: format.schema, ...(format.strict != null ? { strict: format.strict } : {}) } };

  // The chat parser checks what this one did not (tool schemas, tool-call history, ranges).
  try {
    parseChatRequest(chat);
  } catch (err) {
    throw err instanceof ApiError ? renamed(err, sources, instructions !== null) : err;
  }
  const storeIt = (b.store as boolean | undefined) ?? true;
  return {
    chat,
    stream: b.stream === true,
    store: storeIt,
    history,
    inputItems,
    echo: {
      instructions,
      previous_response_id: prevId ?? null,
      max_output_tokens: (b.max_output_tokens as number | undefined) ?? null,
      temperature: (b.temperature as number | undefined) ?? 1,
      top_p: (b.top_p as number | undefined) ?? 1,
      tools: tools.map((t) => ({ type: 'function', name: t.name, description: t.description ?? null, parameters: t.parameters ?? null, strict: t.strict ?? null })),
      tool_choice: toolChoice,
      parallel_tool_calls: (b.parallel_tool_calls as boolean | undefined) ?? true,
      text: { format },
      metadata: (b.metadata as Record<string, string> | undefined) ?? {},
      store: storeIt,
      user: (b.user as string | undefined) ?? null,
      safety_identifier: (b.safety_identifier as string | undefined) ?? null,
      prompt_cache_key: (b.prompt_cache_key as string | undefined) ?? null,
    },
  };
}

/** Responses usage. */
export interface ResponsesUsage {
  input_tokens: number;
  input_tokens_details: { cached_tokens: number };
  output_tokens: number;
  output_tokens_details: { reasoning_tokens: number };
  total_tokens: number;
}

/** An output item: a message with one output_text part, or a function call. */
export type OutputItem =
  | { type: 'message'; id: string; status: 'in_progress' | 'completed' | 'incomplete'; role: 'assistant'; content: { type: 'output_text'; text: string; annotations: []; logprobs: [] }[] }
  | { type: 'function_call'; id: string; status: 'in_progress' | 'completed' | 'incomplete'; call_id: string; name: string; arguments: string };

/** One Responses stream event (`type` and `sequence_number` plus the event's own fields). */
export type ResponsesEvent = { type: string; sequence_number: number } & Record<string, unknown>;

/** The chat stream chunk fields the translator reads. */
interface ChatChunk {
  choices?: { delta?: { content?: string; tool_calls?: { index: number; id?: string; function?: { name?: string; arguments?: string } }[] }; finish_reason?: string | null }[];
  usage?: { prompt_tokens?: number; completion_tokens?: number; prompt_tokens_details?: { cached_tokens?: number } } | null;
}

/**
 * Chat stream chunks → Responses events and the Response object, for one response (see the
 * module doc). Call `start()`, `chunk()` per chat chunk, then `finish()` after the chat
 * stream's [DONE], or `fail()` on an error. Each returns the events to send, in order.
 */
export class ResponsesTranslator {
  readonly output: OutputItem[] = [];
  status: 'in_progress' | 'completed' | 'incomplete' | 'failed' = 'in_progress';
  usage: ResponsesUsage | null = null;
  error: { code: string; message: string } | null = null;
  private seq = 0;
  private open: OutputItem | null = null;
  private readonly calls = new Map<number, Extract<OutputItem, { type: 'function_call' }>>();
  private finishReason: string | null = null;
  private completedAt: number | null = null;

  constructor(
    readonly id: string,
    readonly model: string,
    readonly createdAt: number,
    private readonly echo: ResponseEcho,
  ) {}

  private ev(type: string, fields: Record<string, unknown>): ResponsesEvent {
    return { type, sequence_number: this.seq++, ...fields };
  }

  /** The Response object as of now. */
  response(): Record<string, unknown> {
    const e = this.echo;
    return {
      id: this.id,
      object: 'response',
      created_at: this.createdAt,
      status: this.status,
      background: false,
      completed_at: this.completedAt,
      error: this.error,
      incomplete_details: this.status === 'incomplete' ? { reason: 'max_output_tokens' } : null,
      instructions: e.instructions,
      max_output_tokens: e.max_output_tokens,
      max_tool_calls: null,
      model: this.model,
      output: this.output.map((o) => structuredClone(o)),
      parallel_tool_calls: e.parallel_tool_calls,
      previous_response_id: e.previous_response_id,
      prompt_cache_key: e.prompt_cache_key,
      reasoning: { effort: null, summary: null },
      safety_identifier: e.safety_identifier,
      service_tier: 'default',
      store: e.store,
      temperature: e.temperature,
      text: e.text,
      tool_choice: e.tool_choice,
      tools: e.tools,
      top_logprobs: 0,
      top_p: e.top_p,
      truncation: 'disabled',
      usage: this.usage,
      user: e.user,
      metadata: e.metadata,
    };
  }

  /** response.created and response.in_progress. */
  start(): ResponsesEvent[] {
    const r = this.response();
    return [this.ev('response.created', { response: r }), this.ev('response.in_progress', { response: r })];
  }

  private index(item: OutputItem): number {
    return this.output.indexOf(item);
  }

  /** Close the open item (its done events). */
  private close(status: 'completed' | 'incomplete', out: ResponsesEvent[]): void {
    const item = this.open;
    if (!item) return;
    this.open = null;
    item.status = status;
    const output_index = this.index(item);
    if (item.type === 'message') {
      const part = item.content[0]!;
      out.push(this.ev('response.output_text.done', { item_id: item.id, output_index, content_index: 0, text: part.text, logprobs: [] }));
      out.push(this.ev('response.content_part.done', { item_id: item.id, output_index, content_index: 0, part: structuredClone(part) }));
    } else {
      out.push(this.ev('response.function_call_arguments.done', { item_id: item.id, output_index, name: item.name, arguments: item.arguments }));
    }
    out.push(this.ev('response.output_item.done', { output_index, item: structuredClone(item) }));
  }

  private openItem(item: OutputItem, out: ResponsesEvent[]): void {
    this.close('completed', out);
    this.output.push(item);
    this.open = item;
    const output_index = this.index(item);
    const added = item.type === 'message' ? { ...item, content: [] } : { ...item, arguments: '' };
    out.push(this.ev('response.output_item.added', { output_index, item: added }));
    if (item.type === 'message') out.push(this.ev('response.content_part.added', { item_id: item.id, output_index, content_index: 0, part: { type: 'output_text', text: '', annotations: [], logprobs: [] } }));
  }

  /**
   * One chat stream chunk. @throws ApiError 502 bad_worker_event for a tool-call delta that
   * names no call started before.
   */
  chunk(c: ChatChunk): ResponsesEvent[] {
    const out: ResponsesEvent[] = [];
    if (c.usage) {
      const input = c.usage.prompt_tokens ?? 0;
      const output = c.usage.completion_tokens ?? 0;
      this.usage = { input_tokens: input, input_tokens_details: { cached_tokens: c.usage.prompt_tokens_details?.cached_tokens ?? 0 }, output_tokens: output, output_tokens_details: { reasoning_tokens: 0 }, total_tokens: input + output };
    }
    const choice = c.choices?.[0];
    if (!choice) return out;
    const d = choice.delta ?? {};
    if (d.content) {
      if (this.open?.type !== 'message') this.openItem({ type: 'message', id: newItemId('msg'), status: 'in_progress', role: 'assistant', content: [{ type: 'output_text', text: '', annotations: [], logprobs: [] }] }, out);
      const item = this.open as Extract<OutputItem, { type: 'message' }>;
      item.content[0]!.text += d.content;
      out.push(this.ev('response.output_text.delta', { item_id: item.id, output_index: this.index(item), content_index: 0, delta: d.content, logprobs: [] }));
    }
    for (const tc of d.tool_calls ?? []) {
      let call = this.calls.get(tc.index);
      if (!call) {
        if (!tc.id || !tc.function?.name) throw ApiError.of('bad_worker_event', 'a tool-call delta names no call started before');
        call = { type: 'function_call', id: newItemId('fc'), status: 'in_progress', call_id: tc.id, name: tc.function.name, arguments: '' };
        this.calls.set(tc.index, call);
        this.openItem(call, out);
      }
      const piece = tc.function?.arguments ?? '';
      if (piece !== '') {
        call.arguments += piece;
        out.push(this.ev('response.function_call_arguments.delta', { item_id: call.id, output_index: this.index(call), delta: piece }));
      }
    }
    if (choice.finish_reason) this.finishReason = choice.finish_reason;
    return out;
  }

  /** The chat stream ended ([DONE]): close the open item, response.completed or response.incomplete. */
  finish(): ResponsesEvent[] {
    const out: ResponsesEvent[] = [];
    const cut = this.finishReason === 'length';
    this.close(cut ? 'incomplete' : 'completed', out);
    this.status = cut ? 'incomplete' : 'completed';
    this.completedAt = Math.floor(systemClock.wallMs() / 1000);
    out.push(this.ev(cut ? 'response.incomplete' : 'response.completed', { response: this.response() }));
    return out;
  }

  /** The generation failed: response.failed with the error. */
  fail(code: string, message: string): ResponsesEvent[] {
    this.status = 'failed';
    this.error = { code, message };
    this.open = null;
    return [this.ev('response.failed', { response: this.response() })];
  }

  /** True once the chat stream said how it finished (its finish_reason chunk arrived). */
  get finished(): boolean {
    return this.finishReason !== null;
  }
}

/**
 * The record that stores a finished response: its history is the request's conversation plus
 * one assistant message with the reply's text and calls (the chat shape the next round renders).
 */
export function storedRecordOf(parsed: ParsedResponsesRequest, response: Record<string, unknown>, output: readonly OutputItem[]): Omit<StoredResponse, 'at'> {
  const text = output.flatMap((o) => (o.type === 'message' ? [o.content[0]!.text] : [])).join('');
  const calls = output.flatMap((o) => (o.type === 'function_call' ? [{ id: o.call_id, type: 'function' as const, function: { name: o.name, arguments: o.arguments } }] : []));
  const reply: WireChatMessage = calls.length > 0 ? { role: 'assistant', content: text === '' ? null : text, tool_calls: calls } : { role: 'assistant', content: text };
  const history = [...parsed.history, reply];
  const items = new Map<string, Record<string, unknown>>(output.map((o) => [o.id, structuredClone(o) as Record<string, unknown>]));
  const bytes = Buffer.byteLength(JSON.stringify(response)) + Buffer.byteLength(JSON.stringify(history)) + Buffer.byteLength(JSON.stringify(parsed.inputItems));
  return { id: response.id as string, response, history, items, input: parsed.inputItems, bytes };
}
