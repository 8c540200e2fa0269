/**
 * OpenAI tool calling on top of the model's chat wrapper (engine/tools.ts renders the functions
 * and past calls; a grammar forces or completes the call):
 *
 * - `parseTools(body)`: `tools` (type "function", name, description, parameters = a JSON schema
 *   in the subset the grammar engine supports, checked by ./json-schema.ts), `tool_choice`
 *   ("none" | "auto" | "required" | {type: "function", function: {name}}), `parallel_tool_calls`.
 *   Every problem is a 400 naming the field.
 * - `toolGrammarOf(tools, format)`: the worker grammar — none for "none", a lazy call grammar for "auto"
 *   (on after the call prefix), a whole-output call grammar for "required" / a named function;
 *   with a JSON format, "auto" is a whole-output grammar of the calls or a JSON reply.
 * - `ToolCallParser`: the router's (and colocated's) incremental parser of the generated text in
 *   the wrapper's call syntax (`prefix name paramsPrefix {json} suffix`), producing OpenAI
 *   content and `tool_calls` deltas (index, id, type, function name, then argument pieces) as the
 *   openai SDK's stream accumulator expects. Text that might be the start of a call is held back
 *   until it is known not to be one. It runs where the whole text passes — the router, after
 *   prefill's first token and decode's stream — so PD output equals colocated output.
 * vLLM does the same split (tool parser on the API server, guided decoding for "required" and
 * named tool_choice); llama.cpp's server uses lazy grammars triggered by the call start.
 */
import { randomBytes } from 'node:crypto';
import { z } from 'zod';
import { ApiError } from '../base/errors.js';
import { DEFAULT_MAX_TOOL_CALLS, type GrammarSpec, type JsonGrammarSpec, type ToolCallSyntax, type ToolFunction } from '../engine/types.js';
import { DEFAULT_SCHEMA_LIMITS, normaliseJsonSchema, SchemaError, schemaTooComplex, SchemaTooComplexError, type SchemaLimits, type SchemaUsage } from './json-schema.js';
import { MAX_TOOLS } from '../protocol/worker-protocol.js';

/** tool_choice after parsing: a named function is `{name}`. */
export type ToolChoice = 'none' | 'auto' | 'required' | { name: string };

/** The tools of a chat request. */
export interface ParsedTools {
  functions: ToolFunction[];
  choice: ToolChoice;
  /** parallel_tool_calls (default true): several calls in one turn when the wrapper has a syntax for it. */
  parallel: boolean;
  /** With `parallel`: most calls in one turn (the server's --max-tool-calls); the grammar ends the turn after the last. */
  maxCalls: number;
}

const NAME = /^[a-zA-Z0-9_-]{1,64}$/;

const ToolSchema = z
  .object({
    type: z.literal('function'),
    function: z
      .object({
        name: z.string().regex(NAME, 'a function name is 1 to 64 of a-z, A-Z, 0-9, _ and -'),
        description: z.string().max(65_536).nullish(),
        parameters: z.record(z.unknown()).nullish(),
        strict: z.boolean().nullish(),
      })
      .strict(),
  })
  .strict();

const ToolChoiceSchema = z.union([
  z.enum(['none', 'auto', 'required']),
  z.object({ type: z.literal('function'), function: z.object({ name: z.string() }).strict() }).strict(),
]);

const bad = (param: string, message: string) => ApiError.of('invalid_value', `Invalid value for '${param}': ${message}`, param);

/**
 * `tools`, `tool_choice`, `parallel_tool_calls` of a chat body (already type-checked as arrays /
 * values by the field table). Returns undefined when the request has no tools and no tool_choice
 * other than "none"/"auto". `maxCalls`: the server's bound on calls per turn; `limits`: the bounds
 * all parameter schemas together stay within. @throws ApiError 400 naming the field
 * (`schema_too_complex` past `limits`).
 */
export function parseTools(b: Record<string, unknown>, maxCalls = DEFAULT_MAX_TOOL_CALLS, limits: Readonly<SchemaLimits> = DEFAULT_SCHEMA_LIMITS): ParsedTools | undefined {
  const usage: SchemaUsage = { nodes: 0, enumValues: 0, enumBytes: 0 };
  const raw = (b.tools as unknown[] | undefined) ?? [];
  if (raw.length > MAX_TOOLS) throw bad('tools', `at most ${MAX_TOOLS} tools`);
  const functions: ToolFunction[] = [];
  const seen = new Set<string>();
  raw.forEach((t, i) => {
    const r = ToolSchema.safeParse(t);
    if (!r.success) {
      const issue = r.error.issues[0]!;
      const at = ['tools', i, ...issue.path].map((p, k) => (typeof p === 'number' ? `[${p}]` : k === 0 ? p : `.${p}`)).join('');
      throw bad(at, issue.code === 'unrecognized_keys' ? `unrecognized key(s) ${issue.keys.join(', ')}` : issue.message);
    }
    const f = r.data.function;
    if (seen.has(f.name)) throw bad(`tools[${i}].function.name`, `the function name '${f.name}' is used twice`);
    seen.add(f.name);
    const fn: ToolFunction = { name: f.name };
    if (f.description) fn.description = f.description;
    if (f.parameters && Object.keys(f.parameters).length > 0) {
      try {
        fn.parameters = normaliseJsonSchema(f.parameters, limits, usage);
      } catch (err) {
        if (err instanceof SchemaTooComplexError) throw schemaTooComplex(`tools[${i}].function.parameters${err.path}`, err);
        if (err instanceof SchemaError) throw bad(`tools[${i}].function.parameters${err.path}`, err.message);
        throw err;
      }
      if (fn.parameters.type !== undefined && fn.parameters.type !== 'object') throw bad(`tools[${i}].function.parameters.type`, "the parameters of a function must be an object schema (type 'object')");
    }
    functions.push(fn);
  });
  let choice: ToolChoice = functions.length > 0 ? 'auto' : 'none';
  if (b.tool_choice !== undefined) {
    const r = ToolChoiceSchema.safeParse(b.tool_choice);
    if (!r.success) throw bad('tool_choice', `expected "none", "auto", "required" or {"type": "function", "function": {"name": ...}}`);
    choice = typeof r.data === 'string' ? r.data : { name: r.data.function.name };
  }
  if (functions.length === 0) {
    if (choice === 'none' || choice === 'auto') return undefined;
    throw bad('tool_choice', `${typeof choice === 'string' ? `"${choice}"` : `the function '${choice.name}'`} needs tools (none were given)`);
  }
  if (typeof choice === 'object' && !seen.has(choice.name)) throw bad('tool_choice', `the function '${choice.name}' is not one of the tools (${[...seen].join(', ')})`);
  return { functions, choice, parallel: b.parallel_tool_calls !== false, maxCalls };
}

const SyntaxSchema = z.object({ prefix: z.string().min(1).max(256), prefixAlternates: z.array(z.string().max(256)).max(8), paramsPrefix: z.string().min(1).max(256), suffix: z.string().max(256), emptyParams: z.string().max(256), betweenCalls: z.string().max(256).nullable().default(null) });

/** A worker's /health `tool_call_syntax`, or null when absent or malformed. */
export function toolSyntaxFromHealth(v: unknown): ToolCallSyntax | null {
  const r = SyntaxSchema.safeParse(v);
  return r.success ? r.data : null;
}

/**
 * The worker grammar for `tools` (see the module doc), or `format` (the request's JSON format
 * grammar, if any) for tool_choice "none". With a JSON format, tool_choice "auto" is the calls
 * or a JSON reply of that format (OpenAI accepts both together: the model calls tools or answers
 * in the format), "required" / a named function the calls alone (the format applies to a later
 * turn's reply).
 */
export function toolGrammarOf(tools: ParsedTools, format?: JsonGrammarSpec): GrammarSpec | undefined {
  if (tools.choice === 'none') return format;
  const named = typeof tools.choice === 'object';
  const pick = named ? tools.functions.filter((f) => f.name === (tools.choice as { name: string }).name) : tools.functions;
  const reply = tools.choice === 'auto' ? format : undefined;
  const g: GrammarSpec = { type: 'tool_call', functions: pick.map((f) => (f.parameters ? { name: f.name, parameters: f.parameters } : { name: f.name })), lazy: tools.choice === 'auto' && !reply, ...(reply ? { reply } : {}) };
  // A named tool_choice is one call of that function (OpenAI); otherwise parallel_tool_calls decides.
  return tools.parallel && !named ? { ...g, parallel: true, maxCalls: tools.maxCalls } : g;
}

// ---------------------------------------------------------------------------------------------
// Parsing the generated text
// ---------------------------------------------------------------------------------------------

/** One OpenAI stream delta of a tool call (the first carries id, type and name). */
export interface ToolCallDelta {
  index: number;
  id?: string;
  type?: 'function';
  function: { name?: string; arguments: string };
}

/** A complete tool call of a non-stream response. */
export interface ToolCall {
  id: string;
  type: 'function';
  function: { name: string; arguments: string };
}

/** Longest name accepted between the call prefix and the params prefix before giving up. */
const MAX_NAME = 256;

/**
 * Incremental parser of generated text in a wrapper's call syntax. `feed(text)` returns the
 * content to emit now and the tool-call deltas; `end(cut)` flushes at the end of generation (held
 * text becomes content; unfinished arguments stay as streamed, a partial `tool_calls` entry). A
 * generation cut by max_tokens (`cut`) inside a call's prefix or name returns no call and none
 * of that template text as content (API.md: a cut call comes back as far as it got, never as raw
 * call syntax); a generation that ended there by itself was not a call, and its text is content.
 */
export class ToolCallParser {
  readonly calls: ToolCall[] = [];
  private state: 'text' | 'name' | 'args' | 'suffix' = 'text';
  private buf = '';
  /** Raw text of the call being parsed (given back as content when it turns out not to be one). */
  private raw = '';
  private readonly triggers: string[];
  // JSON scanner state of the arguments
  private depth = 0;
  private inString = false;
  private escaped = false;
  private started = false;

  constructor(private readonly syntax: ToolCallSyntax) {
    // Longest first: the full prefix wins over its alternates at the same position.
    this.triggers = [...new Set([syntax.prefix, ...syntax.prefixAlternates])].filter((t) => t !== '').sort((a, b) => b.length - a.length);
  }

  /** Whether a call was completed (finish_reason becomes "tool_calls"). */
  get called(): boolean {
    return this.calls.length > 0 && this.state !== 'args';
  }

  feed(text: string): { content: string; deltas: ToolCallDelta[] } {
    this.buf += text;
    const out = { content: '', deltas: [] as ToolCallDelta[] };
    for (let progress = true; progress; ) progress = this.step(out);
    return out;
  }

  end(cut = false): { content: string; deltas: ToolCallDelta[] } {
    const out = { content: '', deltas: [] as ToolCallDelta[] };
    if (this.state === 'text') {
      const text = cut ? this.buf.slice(0, this.buf.length - this.heldBack()) : this.buf;
      out.content = this.calls.length > 0 && text.trim() === '' ? '' : text;
    } else if (this.state === 'name' && !cut) out.content = this.raw + this.buf;
    this.buf = '';
    return out;
  }

  /** One transition; false when more text is needed. */
  private step(out: { content: string; deltas: ToolCallDelta[] }): boolean {
    const s = this.syntax;
    switch (this.state) {
      case 'text': {
        let at = -1;
        let trig = '';
        for (const t of this.triggers) {
          const i = this.buf.indexOf(t);
          if (i >= 0 && (at < 0 || i < at)) [at, trig] = [i, t];
        }
        if (at < 0) {
          const hold = this.heldBack();
          // Whitespace after a call is held (between-calls text, or trailing): never content on its own.
          if (this.calls.length > 0 && this.buf.slice(0, this.buf.length - hold).trim() === '') return false;
          out.content += this.buf.slice(0, this.buf.length - hold);
          this.buf = this.buf.slice(this.buf.length - hold);
          return false;
        }
        const before = this.buf.slice(0, at);
        if (!(this.calls.length > 0 && before.trim() === '')) out.content += before;
        this.raw = trig;
        this.buf = this.buf.slice(at + trig.length);
        this.state = 'name';
        return true;
      }
      case 'name': {
        const i = this.buf.indexOf(s.paramsPrefix);
        if (i < 0) {
          if (this.buf.length > MAX_NAME) {
            // not a call after all
            out.content += this.raw;
            this.state = 'text';
            return true;
          }
          return false;
        }
        const name = this.buf.slice(0, i).trim();
        const id = `call_${randomBytes(12).toString('hex')}`;
        this.calls.push({ id, type: 'function', function: { name, arguments: '' } });
        out.deltas.push({ index: this.calls.length - 1, id, type: 'function', function: { name, arguments: '' } });
        this.buf = this.buf.slice(i + s.paramsPrefix.length);
        this.state = 'args';
        [this.depth, this.inString, this.escaped, this.started] = [0, false, false, false];
        return true;
      }
      case 'args': {
        const call = this.calls[this.calls.length - 1]!;
        const suffix = callSuffixOf(s, call.function.name);
        if (!this.started) {
          const lead = this.buf.length - this.buf.trimStart().length;
          const rest = this.buf.slice(lead);
          if (rest === '') return false;
          if (rest[0] !== '{' && rest[0] !== '[') {
            // No JSON arguments (a call without parameters, e.g. `now()`): up to the suffix.
            if (suffix !== '' && rest.length < suffix.length && suffix.startsWith(rest)) return false;
            this.addArgs(out, call, '{}');
            this.buf = rest;
            this.state = 'suffix';
            return true;
          }
          this.buf = rest;
          this.started = true;
        }
        let end = -1;
        for (let i = 0; i < this.buf.length && end < 0; i++) {
          const ch = this.buf[i]!;
          if (this.inString) {
            if (this.escaped) this.escaped = false;
            else if (ch === '\\') this.escaped = true;
            else if (ch === '"') this.inString = false;
          } else if (ch === '"') this.inString = true;
          else if (ch === '{' || ch === '[') this.depth++;
          else if (ch === '}' || ch === ']') {
            if (--this.depth === 0) end = i + 1;
          }
        }
        const piece = end < 0 ? this.buf : this.buf.slice(0, end);
        if (piece !== '') this.addArgs(out, call, piece);
        this.buf = end < 0 ? '' : this.buf.slice(end);
        if (end < 0) return false;
        this.state = 'suffix';
        return true;
      }
      case 'suffix': {
        const call = this.calls[this.calls.length - 1]!;
        const suffix = callSuffixOf(s, call.function.name);
        const rest = this.buf.trimStart();
        if (suffix.trim() === '') {
          this.state = 'text';
          return true;
        }
        if (rest.length < suffix.trimStart().length && suffix.trimStart().startsWith(rest)) return false;
        this.buf = rest.startsWith(suffix.trimStart()) ? rest.slice(suffix.trimStart().length) : rest;
        this.state = 'text';
        return true;
      }
    }
  }

  private addArgs(out: { deltas: ToolCallDelta[] }, call: ToolCall, piece: string): void {
    call.function.arguments += piece;
    out.deltas.push({ index: this.calls.length - 1, function: { arguments: piece } });
  }

  /** Length of the longest end of `buf` that is a proper beginning of a trigger (it may become one). */
  private heldBack(): number {
    let best = 0;
    for (const t of this.triggers) {
      for (let k = Math.min(t.length - 1, this.buf.length); k > best; k--) {
        if (this.buf.endsWith(t.slice(0, k))) {
          best = k;
          break;
        }
      }
    }
    return best;
  }
}

/** The suffix of a call of `name` (`{{functionName}}` filled in). */
function callSuffixOf(s: ToolCallSyntax, name: string): string {
  return s.suffix.split('{{functionName}}').join(name);
}
