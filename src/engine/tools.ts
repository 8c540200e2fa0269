/**
 * Tool (function) calling through the model's chat wrapper, on node-llama-cpp 3.21.1's
 * sequence-level API (PD cannot use LlamaChat, which owns a whole chat session):
 *
 * - `toolSyntaxOf(wrapper)`: the function-call syntax of a chat wrapper
 *   (`ChatWrapper.settings.functions.call`: prefix, paramsPrefix, suffix — e.g. the generic
 *   wrapper's `||call: name({...})`, Qwen's `<tool_call>\n{"name": "…", "arguments": {…}}\n</tool_call>`)
 *   as plain text, or null when the wrapper has none.
 * - `chatHistoryOf(messages, functions)`: OpenAI-style messages (assistant `tool_calls`, `tool`
 *   results) as node-llama-cpp chat history items, so `wrapper.generateContextState` renders the
 *   functions' documentation and past calls/results in the model's own format (as LlamaChat does).
 * - `toolCallGrammar(...)`: a GBNF grammar for exactly one call of one of the given functions,
 *   whose arguments follow each function's JSON schema (node-llama-cpp's JSON-schema grammar,
 *   rules renamed per function). `lazy`: the grammar starts after the call prefix — the sampler
 *   switches it on once the generated text ends with the prefix (llama.cpp server's "lazy
 *   grammar" triggered by a tool-call start word), so free text stays free and a started call is
 *   well formed. Not lazy: the whole output is a call (tool_choice "required" or a named function).
 * A complete call ends the grammar, so llama.cpp only allows an end-of-generation token after it.
 */
import { LlamaText, type ChatHistoryItem, type ChatModelFunctions, type ChatModelResponse, type ChatWrapper, type LlamaModel } from 'node-llama-cpp';
import type { ChatMessage, ToolCallSyntax, ToolFunction } from './types.js';

/** Text of a LlamaText-ish value (string, LlamaText, special-token text) as the model would print it. */
function textOf(v: unknown): string {
  if (v == null) return '';
  if (typeof v === 'string') return v;
  return LlamaText(v as never).toString();
}

/** The wrapper's function-call syntax as text, or null when it has none (no call prefix or params prefix). */
export function toolSyntaxOf(wrapper: ChatWrapper): ToolCallSyntax | null {
  const call = (wrapper.settings as { functions?: { call?: Record<string, unknown> } }).functions?.call;
  if (!call) return null;
  const prefix = textOf(call.prefix);
  const paramsPrefix = textOf(call.paramsPrefix);
  const suffix = textOf(call.suffix);
  if (prefix === '' || paramsPrefix === '') return null;
  const alternates = Array.isArray(call.prefixAlternateMatches) ? (call.prefixAlternateMatches as unknown[]).map(textOf).filter((s) => s !== '') : [];
  const empty = call.emptyCallParamsPlaceholder;
  const parallel = (wrapper.settings as { functions?: { parallelism?: { call?: { betweenCalls?: unknown } } } }).functions?.parallelism?.call;
  return { prefix, prefixAlternates: alternates, paramsPrefix, suffix, emptyParams: empty === undefined || empty === '' ? '' : JSON.stringify(empty), betweenCalls: parallel ? textOf(parallel.betweenCalls) : null };
}

/**
 * Whether the syntax's texts survive tokenizing (special-token text parsed) and detokenizing
 * without special tokens, as generated text reaches the parser: a call prefix that is a control
 * token (e.g. a model whose template calls tools with a `<|python_tag|>`-like control token)
 * would vanish from the output, so its calls could not be parsed — such a model gets no tools.
 * Whitespace is ignored (SentencePiece detokenizers move leading spaces).
 */
export function syntaxIsVisible(model: LlamaModel, syntax: ToolCallSyntax): boolean {
  const norm = (x: string) => x.replace(/\s+/g, '');
  return [syntax.prefix, syntax.paramsPrefix, syntax.suffix.split('{{functionName}}').join('')].every((t) => {
    if (norm(t) === '') return true;
    const toks = model.tokenize(t, true);
    return norm(model.detokenize(toks, false)) === norm(t);
  });
}

/** The suffix of a call of `name` (`{{functionName}}` placeholders of Jinja-derived wrappers filled in). */
export function callSuffix(syntax: ToolCallSyntax, name: string): string {
  return syntax.suffix.split('{{functionName}}').join(name);
}

/** node-llama-cpp's `availableFunctions` for the documentation the wrapper puts in the system prompt. */
export function chatFunctionsOf(functions: readonly ToolFunction[]): ChatModelFunctions {
  const out: Record<string, { description?: string; params?: unknown }> = {};
  for (const f of functions) {
    const d: { description?: string; params?: unknown } = {};
    if (f.description) d.description = f.description;
    if (f.parameters && Object.keys(f.parameters).length > 0) d.params = f.parameters;
    out[f.name] = d;
  }
  return out as ChatModelFunctions;
}

/** A tool result or call arguments as a value: parsed when it is JSON, else the text itself. */
function jsonOrText(s: string): unknown {
  try {
    return JSON.parse(s);
  } catch {
    return s;
  }
}

/**
 * OpenAI-style messages → node-llama-cpp chat history, ending with the model turn to generate.
 * An assistant message's `toolCalls` become `functionCall` items whose `result` is the content
 * of the `tool` message answering the call id; an assistant message following those results
 * continues the same model turn (node-llama-cpp renders call, result, continuation as one
 * response). When the history ends with tool results, generation continues that model turn.
 * Callers validate ids beforehand (api/tool-calls.ts); an unanswered call gets an empty result.
 */
export function chatHistoryOf(messages: readonly ChatMessage[]): ChatHistoryItem[] {
  const results = new Map<string, string>();
  for (const m of messages) if (m.role === 'tool' && m.toolCallId !== undefined) results.set(m.toolCallId, m.content);
  const history: ChatHistoryItem[] = [];
  // The open model turn: set after an assistant message with tool calls, until a user/system message.
  let open: { type: 'model'; response: ChatModelResponse['response'] } | null = null;
  for (const m of messages) {
    if (m.role === 'tool') continue;
    if (m.role === 'assistant') {
      const response: ChatModelResponse['response'] = [];
      if (m.content !== '') response.push(m.content);
      for (const c of m.toolCalls ?? []) response.push({ type: 'functionCall', name: c.name, params: jsonOrText(c.arguments), result: jsonOrText(results.get(c.id) ?? '') });
      if (open) open.response.push(...response);
      else history.push((open = { type: 'model', response }));
      if (!(m.toolCalls && m.toolCalls.length > 0)) open = null;
      continue;
    }
    open = null;
    if (m.role === 'system' || m.role === 'developer') history.push({ type: 'system', text: m.content });
    else history.push({ type: 'user', text: m.content });
  }
  if (!open) history.push({ type: 'model', response: [] });
  return history;
}

// ---------------------------------------------------------------------------------------------
// Grammar
// ---------------------------------------------------------------------------------------------

/** A GBNF string literal of `s`. */
export function gbnfLiteral(s: string): string {
  let out = '"';
  for (const ch of s) {
    const c = ch.codePointAt(0)!;
    if (ch === '"' || ch === '\\') out += `\\${ch}`;
    else if (ch === '\n') out += '\\n';
    else if (ch === '\r') out += '\\r';
    else if (ch === '\t') out += '\\t';
    else if (c < 0x20 || c === 0x7f) out += `\\x${c.toString(16).padStart(2, '0')}`;
    else out += ch;
  }
  return `${out}"`;
}

/**
 * Rename every rule of a GBNF grammar `g` (definitions and references) to `prefix + name`;
 * string literals, character classes and comments are left alone.
 */
export function prefixGbnfRules(g: string, prefix: string): string {
  let out = '';
  let i = 0;
  while (i < g.length) {
    const ch = g[i]!;
    if (ch === '"' || ch === '[') {
      const close = ch === '"' ? '"' : ']';
      let j = i + 1;
      while (j < g.length && g[j] !== close) j += g[j] === '\\' ? 2 : 1;
      out += g.slice(i, j + 1);
      i = j + 1;
    } else if (ch === '#') {
      const j = g.indexOf('\n', i);
      const end = j < 0 ? g.length : j;
      out += g.slice(i, end);
      i = end;
    } else if (/[a-zA-Z_]/.test(ch)) {
      let j = i;
      while (j < g.length && /[a-zA-Z0-9_-]/.test(g[j]!)) j++;
      out += prefix + g.slice(i, j);
      i = j;
    } else {
      out += ch;
      i++;
    }
  }
  return out;
}

/**
 * The grammar of one call of any of `functions` in `syntax`. Arguments follow each function's
 * JSON schema (json-grammar.ts: ends where the JSON ends); a function without parameters takes `{}` (or the wrapper's empty placeholder).
 * `lazy`: starts after the call prefix (an optional space first, for prefixes matched without
 * their trailing space). `maxCalls` > 1: up to that many calls in the turn where the wrapper has
 * a between-calls text (ToolCallSyntax.betweenCalls), separated by that text and at most llama.cpp
 * server's whitespace (`| " " | "\n"{1,2} [ \t]{0,20}`); after the last one the grammar is
 * complete, so the turn ends. `schemaGbnf`: a parameters schema → its GBNF text (json-grammar.ts;
 * the engine's grammar thread). @throws what `schemaGbnf` throws for a bad schema.
 */
export async function toolCallGrammarText(schemaGbnf: (schema: Record<string, unknown>) => Promise<string>, syntax: ToolCallSyntax, functions: readonly { name: string; parameters?: Record<string, unknown> }[], lazy: boolean, maxCalls = 1): Promise<string> {
  const rules: string[] = [];
  const alts: string[] = [];
  for (let i = 0; i < functions.length; i++) {
    const f = functions[i]!;
    const p = `f${i}-`;
    let params: string;
    if (f.parameters && Object.keys(f.parameters).length > 0 && !(f.parameters.type === 'object' && f.parameters.properties && Object.keys(f.parameters.properties as object).length === 0)) {
      rules.push(prefixGbnfRules(await schemaGbnf(f.parameters), p).trim());
      params = `${p}root`;
    } else {
      params = syntax.emptyParams === '' ? '("{}" | "")' : `("{}" | ${gbnfLiteral(syntax.emptyParams)})`;
    }
    alts.push(`${gbnfLiteral(f.name)} ${gbnfLiteral(syntax.paramsPrefix)} ${params} ${callSuffix(syntax, f.name) === '' ? '' : gbnfLiteral(callSuffix(syntax, f.name))}`.trim());
  }
  const call = `call ::= ${alts.map((a) => `(${a})`).join(' | ')}`;
  // Several calls in one turn (parallel tool calls, when the wrapper has a between-calls text):
  // after a call either the end or the between text, bounded whitespace, the prefix, a call —
  // at most maxCalls in all, so neither whitespace nor calls can run a turn into max_tokens.
  const ws = '( " " | "\\n"{1,2} [ \\t]{0,20} )?';
  const more = maxCalls > 1 && syntax.betweenCalls !== null ? ` (${syntax.betweenCalls === '' ? '' : `${gbnfLiteral(syntax.betweenCalls)} `}${ws} ${gbnfLiteral(syntax.prefix)} call){0,${maxCalls - 1}}` : '';
  const root = lazy ? `root ::= " "? call${more}` : `root ::= ${gbnfLiteral(syntax.prefix)} call${more}`;
  return [root, call, ...rules].join('\n');
}

/**
 * A GBNF grammar whose output is one of `a` or `b` (two GBNF grammars with a `root` rule each):
 * `root ::= a-root | b-root`, every rule of `a` renamed `a-…`, of `b` `b-…` (prefixGbnfRules).
 * Used for tool calls or a JSON reply (tool_choice "auto" with a JSON response format).
 */
export function eitherGrammarText(a: string, b: string): string {
  return ['root ::= a-root | b-root', prefixGbnfRules(a, 'a-').trim(), prefixGbnfRules(b, 'b-').trim()].join('\n');
}

/**
 * The texts whose appearance at the end of the generated text starts a call (lazy grammar
 * trigger): the prefix, its alternates and the prefix without its trailing whitespace.
 */
export function triggerTexts(syntax: ToolCallSyntax): string[] {
  return [...new Set([syntax.prefix, syntax.prefix.trimEnd(), ...syntax.prefixAlternates].filter((s) => s !== ''))];
}
