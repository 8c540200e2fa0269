/**
 * JSON grammars that end where the JSON ends, in GBNF text for llama.cpp.
 *
 * node-llama-cpp's JSON-schema grammar ends in `"\n\n\n\n" [\n]*` and expects its caller to stop
 * on that trigger and trim (LlamaCompletion does); pdserve samples on the sequence level, so the
 * trailer is cut here instead: once the JSON is complete the grammar is complete, llama.cpp then
 * allows only an end-of-generation token, and the reply ends with `finish_reason: "stop"` and
 * no trailing whitespace — the same grammar state in prefill, decode and a migrated request,
 * since it is rebuilt from the tokens (as llama.cpp's server, whose schema grammars end at the
 * value). What node-llama-cpp's generator cannot express is added as GBNF rules of our own:
 *
 * | schema | grammar |
 * |---|---|
 * | `integer` | an integer without exponent in the safe range (±2^53−1) |
 * | `integer` + `minimum` / `maximum` / exclusive forms | exactly the integers of the range (digit-range rules, llama.cpp's idea) |
 * | `number` | no exponent; `minimum` ≥ 0 / `exclusiveMinimum` ≥ 0: no sign; `multipleOf` 1 / 10^-k: an integer / k decimals at most |
 * | `string` + `format` email, uuid, ipv4, uri/url, date, date-time, time | a rule per format (a subset of what the format allows that calendar-aware validators accept too) |
 *
 * Bounds the grammar cannot express (non-integer ranges, other `multipleOf`, `pattern`) are
 * checked after generation by the API layer (api/json-schema.ts `validateJson`).
 */
import type { Llama } from 'node-llama-cpp';

/** llama.cpp's grammars/json.gbnf with the whitespace after the root object cut (any JSON object, ending at its `}`). */
export const JSON_OBJECT_GBNF = String.raw`root   ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}"
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ws
ws ::= | " " | "\n" [ \t]{0,20}`;

const MAX_SAFE = BigInt(Number.MAX_SAFE_INTEGER);
/** Marker const strings standing for a rule of our own until the grammar text is generated. */
const MARK = 'pdserve-rule-';

/** Number of decimal digits of a non-negative bigint. */
const digits = (n: bigint): number => n.toString().length;

/** GBNF for the same-length digit strings from `x` to `y` (x ≤ y, equal length). */
function sameLength(x: string, y: string): string {
  if (x === y) return `"${x}"`;
  if (x.length === 1) return `[${x}-${y}]`;
  if (x[0] === y[0]) return `"${x[0]}" (${sameLength(x.slice(1), y.slice(1))})`;
  const rest = x.length - 1;
  const parts: string[] = [];
  let start = Number(x[0]);
  let end = Number(y[0]);
  if (!/^0*$/.test(x.slice(1))) {
    parts.push(`"${x[0]}" (${sameLength(x.slice(1), '9'.repeat(rest))})`);
    start++;
  }
  let tail: string | null = null;
  if (!/^9*$/.test(y.slice(1))) {
    tail = `"${y[0]}" (${sameLength('0'.repeat(rest), y.slice(1))})`;
    end--;
  }
  if (start <= end) parts.push(`${start === end ? `"${start}"` : `[${start}-${end}]`} [0-9]{${rest}}`);
  if (tail) parts.push(tail);
  return parts.join(' | ');
}

/** GBNF for the non-negative integers from `a` to `b` (a ≤ b), without leading zeros. */
function unsignedRange(a: bigint, b: bigint): string {
  const alts: string[] = [];
  for (let len = digits(a); len <= digits(b); len++) {
    const lo = a > (len === 1 ? 0n : 10n ** BigInt(len - 1)) ? a : len === 1 ? 0n : 10n ** BigInt(len - 1);
    const hi = b < 10n ** BigInt(len) - 1n ? b : 10n ** BigInt(len) - 1n;
    if (lo <= hi) alts.push(`(${sameLength(lo.toString(), hi.toString())})`);
  }
  return alts.join(' | ');
}

/**
 * GBNF for exactly the integers from `lo` to `hi` as JSON writes them (no exponent, no leading
 * zero, no "-0"). The digit-range construction is the one of llama.cpp's json-schema-to-grammar
 * (`_build_min_max_int`). @throws RangeError when lo > hi.
 */
export function integerRangeGbnf(lo: bigint, hi: bigint): string {
  if (lo > hi) throw new RangeError(`empty integer range ${lo}..${hi}`);
  if (lo >= 0n) return `(${unsignedRange(lo, hi)})`;
  if (hi < 0n) return `("-" (${unsignedRange(-hi, -lo)}))`;
  return `("-" (${unsignedRange(1n, -lo)}) | ${unsignedRange(0n, hi)})`;
}

/** The integer bounds of a schema (minimum / maximum / exclusive forms; draft-04 boolean exclusives too), safe range by default. */
export function integerBounds(s: Record<string, unknown>): [bigint, bigint] {
  let lo = -MAX_SAFE;
  let hi = MAX_SAFE;
  const num = (v: unknown): number | undefined => (typeof v === 'number' && Number.isFinite(v) ? v : undefined);
  const min = num(s.minimum);
  const max = num(s.maximum);
  const xmin = num(s.exclusiveMinimum) ?? (s.exclusiveMinimum === true ? min : undefined);
  const xmax = num(s.exclusiveMaximum) ?? (s.exclusiveMaximum === true ? max : undefined);
  const clamp = (v: number): bigint => (v > Number.MAX_SAFE_INTEGER ? MAX_SAFE + 1n : v < -Number.MAX_SAFE_INTEGER ? -MAX_SAFE - 1n : BigInt(v));
  if (min !== undefined && s.exclusiveMinimum !== true) lo = maxOf(lo, clamp(Math.ceil(min)));
  if (xmin !== undefined) lo = maxOf(lo, clamp(Math.floor(xmin) + 1));
  if (max !== undefined && s.exclusiveMaximum !== true) hi = minOf(hi, clamp(Math.floor(max)));
  if (xmax !== undefined) hi = minOf(hi, clamp(Math.ceil(xmax) - 1));
  return [lo, hi];
}
const maxOf = (a: bigint, b: bigint): bigint => (a > b ? a : b);
const minOf = (a: bigint, b: bigint): bigint => (a < b ? a : b);

const INT_DIGITS = '("0" | [1-9] [0-9]{0,15})';
/** A JSON number without exponent (node-llama-cpp's digit limits). */
const NUMBER = `"-"? ${INT_DIGITS} ("." [0-9]{1,16})?`;

/** Rules for string formats (each a subset of the format, so a consumer's check passes). */
const octet = integerRangeGbnf(0n, 255n);
const FORMATS: Record<string, string> = {
  email: '[A-Za-z0-9_+-]{1,32} ("." [A-Za-z0-9_+-]{1,32}){0,3} "@" ([A-Za-z0-9] [A-Za-z0-9-]{0,30} "."){1,4} [A-Za-z]{2,10}',
  uuid: '[0-9a-f]{8} "-" [0-9a-f]{4} "-" [1-8] [0-9a-f]{3} "-" [89ab] [0-9a-f]{3} "-" [0-9a-f]{12}',
  ipv4: `${octet} "." ${octet} "." ${octet} "." ${octet}`,
  uri: '("https" | "http") "://" [a-z0-9] [a-z0-9-]{0,30} ("." [a-z0-9] [a-z0-9-]{0,30}){0,4} ("/" [A-Za-z0-9._~-]{1,32}){0,6}',
};
FORMATS.url = FORMATS.uri!;
// Dates: days 01-28 are valid in every month, so a validator that knows the calendar (zod's
// ISO patterns) accepts every one; times in UTC ("Z").
const DATE = '[0-9]{4} "-" ("0" [1-9] | "1" [012]) "-" ("0" [1-9] | "1" [0-9] | "2" [0-8])';
const TIME = '([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ("." [0-9]{3})?';
FORMATS.date = DATE;
FORMATS['date-time'] = `${DATE} "T" ${TIME} "Z"`;
FORMATS.time = `${TIME} "Z"`;
/** `time` beside a `pattern` (zod's ISO time pattern refuses an offset): no "Z". */
const TIME_NO_OFFSET = TIME;

/** String formats with a grammar rule of ours; any other format is an annotation. */
export const GRAMMAR_FORMATS = new Set(Object.keys(FORMATS));

/**
 * The schema with every sub-schema that needs a rule of ours replaced by a marker `const`
 * (pushed to `rules`, in order). Walks what api/json-schema.ts's normaliser leaves: type,
 * properties, additionalProperties, items, prefixItems, oneOf, $defs.
 */
function lower(schema: unknown, rules: string[]): unknown {
  if (schema === null || typeof schema !== 'object' || Array.isArray(schema)) return schema;
  const s = schema as Record<string, unknown>;
  const mark = (rule: string) => ({ const: `${MARK}${rules.push(rule) - 1}` });
  if (s.const === undefined && s.enum === undefined) {
    if (s.type === 'integer') {
      const [lo, hi] = integerBounds(s);
      return mark(integerRangeGbnf(lo, hi));
    }
    if (s.type === 'number') {
      const m = typeof s.multipleOf === 'number' ? s.multipleOf : undefined;
      const nonNegative = (typeof s.minimum === 'number' && s.minimum >= 0) || (typeof s.exclusiveMinimum === 'number' && s.exclusiveMinimum >= 0);
      let rule = NUMBER;
      if (m === 1) {
        const [lo, hi] = integerBounds(s);
        return mark(integerRangeGbnf(lo, hi));
      }
      const k = m !== undefined ? Math.round(-Math.log10(m)) : -1;
      if (m !== undefined && k >= 1 && k <= 16 && Math.abs(m - 10 ** -k) < 1e-12) rule = `"-"? ${INT_DIGITS} ("." [0-9]{1,${k}})?`;
      if (nonNegative) rule = rule.replace(/^"-"\? /, '');
      return mark(rule);
    }
    if (s.type === 'string' && typeof s.format === 'string' && FORMATS[s.format]) {
      const rule = s.format === 'time' && typeof s.pattern === 'string' ? TIME_NO_OFFSET : FORMATS[s.format];
      return mark(`"\\"" ${rule} "\\""`);
    }
  }
  const out: Record<string, unknown> = { ...s };
  // a format without a rule (ours or node-llama-cpp's) is an annotation
  if (typeof s.format === 'string' && !GRAMMAR_FORMATS.has(s.format)) delete out.format;
  const map = (o: unknown) => (o && typeof o === 'object' && !Array.isArray(o) ? Object.fromEntries(Object.entries(o).map(([k, v]) => [k, lower(v, rules)])) : o);
  if (s.properties) out.properties = map(s.properties);
  if (s.$defs) out.$defs = map(s.$defs);
  if (s.additionalProperties && typeof s.additionalProperties === 'object') out.additionalProperties = lower(s.additionalProperties, rules);
  if (s.items) out.items = lower(s.items, rules);
  if (Array.isArray(s.prefixItems)) out.prefixItems = s.prefixItems.map((x) => lower(x, rules));
  if (Array.isArray(s.oneOf)) out.oneOf = s.oneOf.map((x) => lower(x, rules));
  return out;
}

/** node-llama-cpp's JSON-schema → GBNF generator (`getGbnfGrammarForGbnfJsonSchema`, or `createGrammarForJsonSchema(x).grammar`). */
export type GbnfGenerator = (lowered: Record<string, unknown>) => string;

/**
 * GBNF text of a JSON schema (in api/json-schema.ts's normalised subset) whose root rule ends
 * where the JSON value ends (see the module doc), with node-llama-cpp's generator `generate`
 * doing the part it can express. Synchronous and pure apart from `generate`: both the grammar
 * thread (./grammar-thread.ts) and `jsonSchemaGbnf` call it. @throws what `generate` throws.
 */
export function jsonSchemaGbnfWith(generate: GbnfGenerator, schema: Record<string, unknown>): string {
  const rules: string[] = [];
  const lowered = lower(schema, rules) as Record<string, unknown>;
  let g = generate(lowered);
  g = g.replace(/[ \t]*"\\n\\n\\n\\n"[ \t]*\[\\n\]\*[ \t]*$/m, '');
  // "any JSON" parts (additionalProperties: true, a schema without type) use node-llama-cpp's number rules
  g = g.replace(/^integer-number-rule ::= .*$/m, `integer-number-rule ::= ${integerRangeGbnf(-MAX_SAFE, MAX_SAFE)}`);
  g = g.replace(/^fractional-number-rule ::= .*$/m, `fractional-number-rule ::= ${NUMBER}`);
  g = g.replace(new RegExp(`"\\\\"${MARK}(\\d+)\\\\""`, 'g'), (_m, i: string) => `(${rules[Number(i)]!})`);
  return g;
}

/**
 * `jsonSchemaGbnfWith` on this thread, with `llama.createGrammarForJsonSchema(x).grammar` as the
 * generator (up to ~80 ms of blocked loop for a bounded schema: the engine uses the grammar
 * thread instead; this is the reference the thread is tested against).
 * @throws what llama.createGrammarForJsonSchema throws for a schema it cannot compile.
 */
export async function jsonSchemaGbnf(llama: Llama, schema: Record<string, unknown>): Promise<string> {
  // lowering is deterministic: the text generated here is the one jsonSchemaGbnfWith's own lowering expects
  const grammar = (await llama.createGrammarForJsonSchema(lower(schema, []) as never)).grammar;
  return jsonSchemaGbnfWith(() => grammar, schema);
}
