/**
 * JSON schemas of `response_format`, `guided_json` and tool parameters, as zod 3/4, pydantic and
 * the agent frameworks write them, brought to the subset the grammar engine compiles
 * (node-llama-cpp 3.21.1's GbnfJsonSchema plus engine/json-grammar.ts's rules), and the check
 * of generated JSON against the keywords a grammar cannot enforce.
 *
 * - `normaliseJsonSchema(schema)`: annotations dropped; `anyOf` → `oneOf`; `allOf` merged;
 *   type lists and `nullable` → `oneOf` of single types; every local `$ref` (`#/$defs/…`,
 *   `#/definitions/…`, any other JSON pointer such as zod-to-json-schema's `#/properties/a`)
 *   becomes a `#/$defs/<name>` reference into the root's `$defs` (recursive schemas keep
 *   working); validation keywords are kept for the grammar and the check. Anything else is a
 *   SchemaError naming the keyword and why.
 * - `validateJson(schema, value)`: the first violation of a normalised schema, or null.
 *
 * Size bounds (`SchemaLimits`, flags `--schema-max-nodes`, `--schema-max-enum-values`): the
 * walk counts every schema node it produces (a `$ref` with sibling keywords is expanded in
 * place, so a chain of them doubles per level) and every enum/const value, and stops with a
 * SchemaTooComplexError as soon as a count passes its bound — an exponential `$defs` chain is
 * refused after O(bound) work instead of being expanded. The grammar compiler's time and the
 * grammar's cost per sampled token grow with both counts.
 *
 * The keyword table of docs/API.md is `SCHEMA_KEYWORDS`.
 */
import { ApiError, PdError } from '../base/errors.js';
import { DEFAULT_SCHEMA_MAX_ENUM_VALUES, DEFAULT_SCHEMA_MAX_NODES } from '../engine/types.js';

/** How the server treats a JSON-schema keyword (docs/API.md's table). */
export interface KeywordSpec {
  keyword: string;
  status: 'enforced' | 'checked after' | 'enforced, rest checked after' | 'annotation (ignored)' | 'refused';
  notes: string;
}

/** Every keyword the normaliser knows, with its treatment; a keyword not listed is refused. */
export const SCHEMA_KEYWORDS: readonly KeywordSpec[] = [
  { keyword: 'type', status: 'enforced', notes: 'string, number, integer, boolean, null, object, array; a list of types is a oneOf' },
  { keyword: 'enum, const', status: 'enforced', notes: 'string, number, boolean or null values (an object or array value is refused: the grammar engine matches literals); at most --schema-max-enum-values (1,000) values and 64 KiB of them in all of a request\'s schemas, past that a 400 schema_too_complex (each value is a grammar alternative checked on every sampled token)' },
  { keyword: 'anyOf, oneOf', status: 'enforced', notes: 'one alternative is generated (so oneOf\'s "exactly one" holds unless alternatives overlap)' },
  { keyword: 'allOf', status: 'enforced', notes: 'merged into one schema (properties and required joined); conflicting values are refused' },
  { keyword: 'nullable', status: 'enforced', notes: 'OpenAPI 3.0 form: the schema or null' },
  { keyword: '$ref, $defs, definitions', status: 'enforced', notes: 'local references only (#/$defs/…, #/definitions/…, any JSON pointer into the schema); recursion allowed; at most 256 definitions. A $ref with sibling keywords is expanded in place: all of a request\'s schemas together expand to at most --schema-max-nodes (5,000) nodes, past that a 400 schema_too_complex, refused before any grammar is compiled' },
  { keyword: 'properties, required', status: 'enforced', notes: 'every listed property is generated, in order (the grammar engine writes optional ones too, which satisfies required)' },
  { keyword: 'additionalProperties', status: 'enforced', notes: 'false or absent: none generated; true or a schema: extra properties allowed' },
  { keyword: 'minProperties, maxProperties', status: 'enforced', notes: 'with additionalProperties' },
  { keyword: 'items, prefixItems, minItems, maxItems', status: 'enforced', notes: 'an items array (draft 4 tuples) is prefixItems' },
  { keyword: 'uniqueItems', status: 'checked after', notes: '' },
  { keyword: 'minLength, maxLength', status: 'enforced, rest checked after', notes: 'in the grammar for a plain string; checked after with a format or pattern' },
  { keyword: 'pattern', status: 'checked after', notes: 'ECMAScript regular expression (as JSON Schema), at most 1,024 characters' },
  { keyword: 'format', status: 'enforced', notes: 'date-time, date, time (UTC, days 01-28), email, uuid, ipv4, uri/url by a grammar rule (a subset of each format that calendar-aware validators such as zod\'s ISO patterns accept too); other formats are annotations, as JSON Schema 2020-12 treats them by default' },
  { keyword: 'minimum, maximum, exclusiveMinimum, exclusiveMaximum', status: 'enforced, rest checked after', notes: 'integers: exactly the range in the grammar (default: the safe integers ±(2^53−1)); numbers: a lower bound ≥ 0 drops the sign in the grammar, the rest is checked after; draft 4 boolean exclusive forms accepted' },
  { keyword: 'multipleOf', status: 'enforced, rest checked after', notes: '1 (an integer) and 10^-k (k decimals at most) in the grammar; other values checked after' },
  { keyword: 'description', status: 'annotation (ignored)', notes: 'no effect on the grammar; kept, so the chat template documents a tool\'s parameters with it' },
  { keyword: 'title, default, examples, $schema, $id, $anchor, $comment, deprecated, readOnly, writeOnly, discriminator, contentEncoding, contentMediaType, strict', status: 'annotation (ignored)', notes: 'no effect on generation' },
  { keyword: 'not, if, then, else, patternProperties, propertyNames, dependentRequired, dependentSchemas, unevaluatedProperties, unevaluatedItems, contains, minContains, maxContains, $dynamicRef, remote $ref', status: 'refused', notes: 'a grammar cannot generate them and they are rare in framework schemas: a 400 naming the keyword' },
];

const TYPES = new Set(['string', 'number', 'integer', 'boolean', 'null', 'object', 'array']);
const ANNOTATIONS = new Set(['title', 'default', 'examples', '$schema', '$id', '$anchor', '$comment', 'deprecated', 'readOnly', 'writeOnly', 'discriminator', 'contentEncoding', 'contentMediaType', 'strict']);
const COUNTS = ['minProperties', 'maxProperties', 'minItems', 'maxItems', 'minLength', 'maxLength'];
const NUMERIC = ['minimum', 'maximum', 'exclusiveMinimum', 'exclusiveMaximum', 'multipleOf'];
const KEEP = new Set(['type', 'const', 'enum', 'required', 'uniqueItems', 'pattern', 'format', ...COUNTS, ...NUMERIC]);
/** Most definitions (including hoisted reference targets) in one schema. */
const MAX_DEFS = 256;
/** Deepest nesting of schemas accepted. */
const MAX_DEPTH = 32;
/** Longest `pattern` accepted (it is run on generated strings). */
const MAX_PATTERN = 1024;

/** Bounds on what one request's schemas may expand to (docs/API.md's keyword table). */
export interface SchemaLimits {
  /** Most schema nodes after `$ref` expansion, over all schemas of a request (`--schema-max-nodes`). */
  maxNodes: number;
  /** Most enum/const values, over all schemas of a request (`--schema-max-enum-values`). */
  maxEnumValues: number;
  /** Most bytes of enum/const values (as JSON), over all schemas of a request. */
  maxEnumBytes: number;
}

/** The default bounds (OpenAI's structured-output limits: 5,000 properties, 1,000 enum values). */
export const DEFAULT_SCHEMA_LIMITS: Readonly<SchemaLimits> = { maxNodes: DEFAULT_SCHEMA_MAX_NODES, maxEnumValues: DEFAULT_SCHEMA_MAX_ENUM_VALUES, maxEnumBytes: 65_536 };

/** What a request's schemas have used of their SchemaLimits (shared by its tools' schemas). */
export interface SchemaUsage {
  nodes: number;
  enumValues: number;
  enumBytes: number;
}

/** A schema outside the supported subset: `path` is a JSON pointer-ish path of the offending keyword. */
export class SchemaError extends PdError {
  constructor(
    readonly path: string,
    message: string,
  ) {
    super('UNSUPPORTED_SCHEMA', message);
    this.name = 'SchemaError';
  }
}

/** A schema past a SchemaLimits bound: `bound` names the flag; the API answers 400 `schema_too_complex`. */
export class SchemaTooComplexError extends SchemaError {
  constructor(
    path: string,
    message: string,
    readonly bound: string,
  ) {
    super(path, message);
    this.name = 'SchemaTooComplexError';
  }
}

/** The 400 `schema_too_complex` for a SchemaTooComplexError found at `param` (the schema's field path). */
export function schemaTooComplex(param: string, err: SchemaTooComplexError): ApiError {
  return ApiError.of('schema_too_complex', `The JSON schema at '${param}' is too complex: ${err.message}`, param);
}

/** Keywords that apply to one type (a type list is split into one schema per type). */
const BY_TYPE: Record<string, readonly string[]> = {
  string: ['minLength', 'maxLength', 'pattern', 'format'],
  number: NUMERIC,
  integer: NUMERIC,
  object: ['properties', 'required', 'additionalProperties', 'minProperties', 'maxProperties'],
  array: ['items', 'prefixItems', 'additionalItems', 'minItems', 'maxItems', 'uniqueItems'],
};
const TYPED = new Set(Object.values(BY_TYPE).flat());

/** `s` without the keywords of other types than `t`. */
function onlyFor(s: Record<string, unknown>, t: string): Record<string, unknown> {
  const mine = BY_TYPE[t] ?? [];
  return Object.fromEntries(Object.entries(s).filter(([k]) => !TYPED.has(k) || mine.includes(k)));
}

const isObj = (v: unknown): v is Record<string, unknown> => v !== null && typeof v === 'object' && !Array.isArray(v);

/** The value a JSON pointer (`#/a/b`, RFC 6901 escapes) names in `root`, or undefined. */
function resolvePointer(root: unknown, ref: string): unknown {
  if (ref === '#') return root;
  if (!ref.startsWith('#/')) return undefined;
  let cur: unknown = root;
  for (const raw of ref.slice(2).split('/')) {
    const key = decodeURIComponent(raw).replace(/~1/g, '/').replace(/~0/g, '~');
    if (Array.isArray(cur) && /^\d+$/.test(key)) cur = cur[Number(key)];
    else if (isObj(cur) && Object.hasOwn(cur, key)) cur = cur[key];
    else return undefined;
  }
  return cur;
}

/** Merge `b` into `a` (allOf): properties and required joined, equal values kept, others must not conflict. */
function mergeInto(a: Record<string, unknown>, b: Record<string, unknown>, at: string): void {
  for (const [k, v] of Object.entries(b)) {
    if (ANNOTATIONS.has(k) || (k === 'description' && k in a)) continue;
    if (!(k in a)) a[k] = v;
    else if (k === 'properties' && isObj(a[k]) && isObj(v)) {
      const p = { ...(a[k] as Record<string, unknown>) };
      for (const [name, s] of Object.entries(v)) {
        if (name in p && JSON.stringify(p[name]) !== JSON.stringify(s)) p[name] = { allOf: [p[name], s] };
        else p[name] = s;
      }
      a[k] = p;
    } else if (k === 'required' && Array.isArray(a[k]) && Array.isArray(v)) a[k] = [...new Set([...(a[k] as unknown[]), ...v])];
    else if (JSON.stringify(a[k]) !== JSON.stringify(v)) throw new SchemaError(`${at}.allOf`, `allOf parts disagree on '${k}' (only parts that can be merged into one schema are supported)`);
  }
}

/**
 * Bring `schema` to the supported subset (see the module doc). Returns a new schema; the input
 * is not changed. `usage` carries the counts across the schemas of one request (a fresh one per
 * call by default). @throws SchemaError naming the first unsupported keyword or value (depth ≤ 32,
 * ≤ 256 definitions); SchemaTooComplexError past a bound of `limits`, after O(bound) work.
 */
export function normaliseJsonSchema(schema: unknown, limits: Readonly<SchemaLimits> = DEFAULT_SCHEMA_LIMITS, usage: SchemaUsage = { nodes: 0, enumValues: 0, enumBytes: 0 }): Record<string, unknown> {
  if (!isObj(schema)) throw new SchemaError('', 'expected a schema object');
  const root = schema;
  const defs: Record<string, unknown> = {};
  /** Reference (JSON pointer) → its name in the output's $defs. */
  const names = new Map<string, string>();

  const refName = (ref: string, at: string): string => {
    const known = names.get(ref);
    if (known !== undefined) return known;
    const target = resolvePointer(root, ref);
    if (target === undefined || (typeof target !== 'boolean' && !isObj(target))) throw new SchemaError(at, `the reference ${JSON.stringify(ref)} names nothing in this schema (only local references are supported)`);
    if (names.size >= MAX_DEFS) throw new SchemaError(at, `more than ${MAX_DEFS} definitions`);
    const m = /^#\/(?:\$defs|definitions)\/([^/]+)$/.exec(ref);
    let name = (m ? decodeURIComponent(m[1]!).replace(/~1/g, '/').replace(/~0/g, '~') : `ref${names.size}`).replace(/[^A-Za-z0-9_-]/g, '_') || 'def';
    while (Object.hasOwn(defs, name)) name += '_';
    names.set(ref, name);
    defs[name] = {}; // placeholder while the target is walked (recursion refers to the name)
    defs[name] = walk(target === true ? {} : target, ref.replace(/^#/, ''), 0);
    return name;
  };

  const walk = (node: unknown, path: string, depth: number): Record<string, unknown> => {
    if (depth > MAX_DEPTH) throw new SchemaError(path, `the schema is nested too deeply (limit ${MAX_DEPTH})`);
    if (++usage.nodes > limits.maxNodes) throw new SchemaTooComplexError(path, `the schema expands to more than ${limits.maxNodes} nodes after $ref expansion (--schema-max-nodes)`, 'schema-max-nodes');
    if (node === true) return {};
    if (!isObj(node)) throw new SchemaError(path, 'expected a schema object');
    let s: Record<string, unknown> = node;
    const sub = (v: unknown, p: string) => walk(v, p, depth + 1);
    if (Array.isArray(s.allOf)) {
      if (s.allOf.length === 0) throw new SchemaError(`${path}.allOf`, 'expected a non-empty array of schemas');
      const merged: Record<string, unknown> = {};
      const { allOf, ...rest } = s;
      for (const [i, part] of [...(allOf as unknown[]), rest].entries()) {
        if (!isObj(part) && part !== true) throw new SchemaError(`${path}.allOf[${i}]`, 'expected a schema object');
        let p = part === true ? {} : part;
        if (typeof p.$ref === 'string') {
          const { $ref, ...others } = p;
          const target = resolvePointer(root, $ref as string);
          if (!isObj(target)) throw new SchemaError(`${path}.allOf[${i}].$ref`, `the reference ${JSON.stringify($ref)} names nothing in this schema`);
          p = { ...target, ...others };
        }
        mergeInto(merged, p, path);
      }
      s = merged;
    }
    if (s.$ref !== undefined) {
      if (typeof s.$ref !== 'string') throw new SchemaError(`${path}.$ref`, 'expected a string');
      const others = Object.keys(s).filter((k) => k !== '$ref' && k !== '$defs' && k !== 'definitions' && k !== 'description' && !ANNOTATIONS.has(k));
      if (others.length > 0) return sub({ allOf: [{ $ref: s.$ref }, Object.fromEntries(others.map((k) => [k, s[k]]))] }, path);
      return { $ref: `#/$defs/${refName(s.$ref, `${path}.$ref`)}` };
    }
    // type lists and OpenAPI nullable → oneOf of single types
    if (Array.isArray(s.type)) {
      const ts = s.type as unknown[];
      if (ts.length === 0) throw new SchemaError(`${path}.type`, 'expected a non-empty type list');
      for (const t of ts) if (typeof t !== 'string' || !TYPES.has(t)) throw new SchemaError(`${path}.type`, `unsupported type ${JSON.stringify(t)}`);
      if (ts.length === 1) return sub({ ...s, type: ts[0] }, path);
      return { oneOf: [...new Set(ts as string[])].map((t, i) => sub({ ...onlyFor(s, t), type: t }, `${path}.type[${i}]`)) };
    }
    if (s.nullable === true) {
      const { nullable: _n, ...rest } = s;
      return { oneOf: [sub(rest, path), { type: 'null' }] };
    }
    const out: Record<string, unknown> = {};
    for (const [k, v] of Object.entries(s)) {
      const at = `${path}.${k}`;
      if (ANNOTATIONS.has(k) || k === 'nullable' || k === '$defs' || k === 'definitions') continue;
      switch (k) {
        case 'description':
          // kept: the chat wrapper documents a tool's parameters with it; no effect on the grammar
          if (typeof v === 'string') out.description = v;
          break;
        case 'type':
          if (typeof v !== 'string' || !TYPES.has(v)) throw new SchemaError(at, `unsupported type ${JSON.stringify(v)}`);
          out.type = v;
          break;
        case 'oneOf':
        case 'anyOf': {
          if (!Array.isArray(v) || v.length === 0) throw new SchemaError(at, 'expected a non-empty array of schemas');
          const alts = v.map((x, i) => sub(x, `${at}[${i}]`));
          out.oneOf = out.oneOf ? [...(out.oneOf as unknown[]), ...alts] : alts;
          break;
        }
        case 'properties':
          if (!isObj(v)) throw new SchemaError(at, 'expected an object');
          out.properties = Object.fromEntries(Object.entries(v).map(([name, x]) => [name, sub(x, `${at}.${name}`)]));
          break;
        case 'additionalProperties':
          out.additionalProperties = typeof v === 'boolean' ? v : sub(v, at);
          break;
        case 'items':
          if (Array.isArray(v)) out.prefixItems = v.map((x, i) => sub(x, `${at}[${i}]`));
          else if (v === false) out.maxItems = Math.min(typeof out.maxItems === 'number' ? out.maxItems : Infinity, Array.isArray(s.prefixItems) ? s.prefixItems.length : 0);
          else out.items = sub(v, at);
          break;
        case 'additionalItems':
          if (v === false && Array.isArray(s.items)) out.maxItems = (s.items as unknown[]).length;
          else if (Array.isArray(s.items) && v !== true) out.items = sub(v, at);
          break;
        case 'prefixItems':
          if (!Array.isArray(v)) throw new SchemaError(at, 'expected an array of schemas');
          out.prefixItems = v.map((x, i) => sub(x, `${at}[${i}]`));
          break;
        case 'required':
          if (!Array.isArray(v) || !v.every((x) => typeof x === 'string')) throw new SchemaError(at, 'expected an array of property names');
          out.required = v;
          break;
        case 'const':
        case 'enum':
          if (k === 'enum' && (!Array.isArray(v) || v.length === 0)) throw new SchemaError(at, 'expected a non-empty array');
          for (const x of k === 'enum' ? (v as unknown[]) : [v]) {
            if (x !== null && typeof x === 'object') throw new SchemaError(at, 'only string, number, boolean or null values are supported (the grammar matches literals)');
            if (++usage.enumValues > limits.maxEnumValues) throw new SchemaTooComplexError(at, `more than ${limits.maxEnumValues} enum/const values (--schema-max-enum-values)`, 'schema-max-enum-values');
            usage.enumBytes += typeof x === 'string' ? Buffer.byteLength(x) + 2 : String(x).length;
            if (usage.enumBytes > limits.maxEnumBytes) throw new SchemaTooComplexError(at, `enum/const values longer than ${limits.maxEnumBytes} bytes (as JSON) in all`, 'schema-max-enum-bytes');
          }
          out[k] = v;
          break;
        case 'uniqueItems':
          if (typeof v !== 'boolean') throw new SchemaError(at, 'expected a boolean');
          if (v) out.uniqueItems = true;
          break;
        case 'pattern':
          if (typeof v !== 'string') throw new SchemaError(at, 'expected a string');
          if (v.length > MAX_PATTERN) throw new SchemaError(at, `a pattern is at most ${MAX_PATTERN} characters`);
          try {
            new RegExp(v, 'u');
          } catch (err) {
            throw new SchemaError(at, `not a valid regular expression: ${(err as Error).message}`);
          }
          out.pattern = v;
          break;
        case 'format':
          if (typeof v !== 'string') throw new SchemaError(at, 'expected a string');
          out.format = v;
          break;
        case 'minimum':
        case 'maximum':
        case 'multipleOf':
          if (typeof v !== 'number' || !Number.isFinite(v) || (k === 'multipleOf' && !(v > 0))) throw new SchemaError(at, k === 'multipleOf' ? 'expected a number > 0' : 'expected a number');
          out[k] = v;
          break;
        case 'exclusiveMinimum':
        case 'exclusiveMaximum':
          if (typeof v === 'boolean') {
            // draft 4: a flag on minimum / maximum
            const bound = s[k === 'exclusiveMinimum' ? 'minimum' : 'maximum'];
            if (v && typeof bound === 'number') out[k] = bound;
            break;
          }
          if (typeof v !== 'number' || !Number.isFinite(v)) throw new SchemaError(at, 'expected a number');
          out[k] = v;
          break;
        default:
          if (COUNTS.includes(k)) {
            if (typeof v !== 'number' || !Number.isInteger(v) || v < 0) throw new SchemaError(at, 'expected a non-negative integer');
            out[k] = v;
            break;
          }
          throw new SchemaError(at, `JSON schema keyword '${k}' is not supported (${KEEP.has(k) ? 'bad value' : 'see the keyword table in docs/API.md'})`);
      }
    }
    // draft 4 boolean exclusives replaced the plain bound
    if (s.exclusiveMinimum === true) delete out.minimum;
    if (s.exclusiveMaximum === true) delete out.maximum;
    if (out.type === 'integer' || (out.type === 'number' && out.multipleOf === 1)) {
      const lo = Math.max(typeof out.minimum === 'number' ? Math.ceil(out.minimum) : -Infinity, typeof out.exclusiveMinimum === 'number' ? Math.floor(out.exclusiveMinimum) + 1 : -Infinity);
      const hi = Math.min(typeof out.maximum === 'number' ? Math.floor(out.maximum) : Infinity, typeof out.exclusiveMaximum === 'number' ? Math.ceil(out.exclusiveMaximum) - 1 : Infinity);
      if (lo > hi) throw new SchemaError(path, `no integer lies between the bounds (${lo} > ${hi})`);
      if (lo > Number.MAX_SAFE_INTEGER || hi < -Number.MAX_SAFE_INTEGER) throw new SchemaError(path, 'the integer bounds lie outside the safe integers (±(2^53−1)), which JSON consumers cannot read exactly');
    }
    if (Array.isArray(out.oneOf) && Object.keys(out).length > 1) {
      // keywords beside anyOf/oneOf apply to every alternative
      const { oneOf, ...common } = out;
      return { oneOf: (oneOf as Record<string, unknown>[]).map((alt) => (alt.$ref !== undefined || alt.oneOf !== undefined ? alt : { ...common, ...alt })) };
    }
    return out;
  };

  const out = walk(root, '', 0);
  if (Object.keys(defs).length > 0) {
    if (out.$ref !== undefined) return { $ref: out.$ref, $defs: defs };
    out.$defs = defs;
  }
  return out;
}

/** A violation found by validateJson: where (a JSON path) and what. */
export interface JsonViolation {
  path: string;
  message: string;
}

/** Deep equality of JSON values. */
function jsonEqual(a: unknown, b: unknown): boolean {
  return JSON.stringify(a) === JSON.stringify(b);
}

/** Longest string a `pattern` is run on (the regular expression comes from the client). */
const MAX_PATTERN_SUBJECT = 16_384;

/**
 * The first place where `value` breaks the normalised `schema` (from normaliseJsonSchema), or
 * null when it satisfies it. Checks every kept keyword; `format` is left to the grammar.
 */
export function validateJson(schema: Record<string, unknown>, value: unknown): JsonViolation | null {
  const defs = (schema.$defs as Record<string, Record<string, unknown>> | undefined) ?? {};
  let budget = 100_000;
  const check = (s: Record<string, unknown>, v: unknown, at: string, depth: number): JsonViolation | null => {
    if (--budget < 0 || depth > 256) return { path: at, message: 'the value is too large or deep to check' };
    const fail = (message: string): JsonViolation => ({ path: at, message });
    if (typeof s.$ref === 'string') {
      const d = defs[s.$ref.replace('#/$defs/', '')];
      return d ? check(d, v, at, depth + 1) : null;
    }
    if (Array.isArray(s.oneOf)) {
      let first: JsonViolation | null = null;
      for (const alt of s.oneOf as Record<string, unknown>[]) {
        const r = check(alt, v, at, depth + 1);
        if (!r) return null;
        first ??= r;
      }
      return first;
    }
    if (s.const !== undefined && !jsonEqual(s.const, v)) return fail(`expected ${JSON.stringify(s.const)}`);
    if (Array.isArray(s.enum) && !s.enum.some((e) => jsonEqual(e, v))) return fail(`expected one of ${JSON.stringify(s.enum)}`);
    const t = s.type;
    const kind = v === null ? 'null' : Array.isArray(v) ? 'array' : typeof v === 'number' ? (Number.isInteger(v) ? 'integer' : 'number') : typeof v;
    if (typeof t === 'string' && !(t === kind || (t === 'number' && kind === 'integer'))) return fail(`expected ${t}, got ${kind}`);
    if (typeof v === 'number') {
      if (typeof s.minimum === 'number' && v < s.minimum) return fail(`${v} is less than the minimum ${s.minimum}`);
      if (typeof s.maximum === 'number' && v > s.maximum) return fail(`${v} is more than the maximum ${s.maximum}`);
      if (typeof s.exclusiveMinimum === 'number' && v <= s.exclusiveMinimum) return fail(`${v} is not more than the exclusive minimum ${s.exclusiveMinimum}`);
      if (typeof s.exclusiveMaximum === 'number' && v >= s.exclusiveMaximum) return fail(`${v} is not less than the exclusive maximum ${s.exclusiveMaximum}`);
      if (typeof s.multipleOf === 'number') {
        const q = v / s.multipleOf;
        if (Math.abs(q - Math.round(q)) > 1e-9 * Math.max(1, Math.abs(q))) return fail(`${v} is not a multiple of ${s.multipleOf}`);
      }
    }
    if (typeof v === 'string') {
      const len = [...v].length;
      if (typeof s.minLength === 'number' && len < s.minLength) return fail(`shorter than minLength ${s.minLength}`);
      if (typeof s.maxLength === 'number' && len > s.maxLength) return fail(`longer than maxLength ${s.maxLength}`);
      if (typeof s.pattern === 'string') {
        if (v.length > MAX_PATTERN_SUBJECT) return fail(`a string over ${MAX_PATTERN_SUBJECT} characters is not matched against a pattern`);
        if (!new RegExp(s.pattern, 'u').test(v)) return fail(`does not match the pattern ${JSON.stringify(s.pattern)}`);
      }
    }
    if (Array.isArray(v)) {
      if (typeof s.minItems === 'number' && v.length < s.minItems) return fail(`fewer than minItems ${s.minItems}`);
      if (typeof s.maxItems === 'number' && v.length > s.maxItems) return fail(`more than maxItems ${s.maxItems}`);
      if (s.uniqueItems === true && new Set(v.map((x) => JSON.stringify(x))).size !== v.length) return fail('items are not unique');
      const prefix = (s.prefixItems as Record<string, unknown>[] | undefined) ?? [];
      for (let i = 0; i < v.length; i++) {
        const is = i < prefix.length ? prefix[i] : (s.items as Record<string, unknown> | undefined);
        const r = is ? check(is, v[i], `${at}[${i}]`, depth + 1) : null;
        if (r) return r;
      }
    }
    if (isObj(v)) {
      const props = (s.properties as Record<string, Record<string, unknown>> | undefined) ?? {};
      const keys = Object.keys(v);
      if (typeof s.minProperties === 'number' && keys.length < s.minProperties) return fail(`fewer than minProperties ${s.minProperties}`);
      if (typeof s.maxProperties === 'number' && keys.length > s.maxProperties) return fail(`more than maxProperties ${s.maxProperties}`);
      for (const r of (s.required as string[] | undefined) ?? []) if (!Object.hasOwn(v, r) && Object.hasOwn(props, r)) return fail(`the required property '${r}' is missing`);
      for (const k of keys) {
        const ps = Object.hasOwn(props, k) ? props[k] : isObj(s.additionalProperties) ? s.additionalProperties : undefined;
        if (!ps) {
          if (s.additionalProperties === false) return fail(`the property '${k}' is not allowed`);
          continue;
        }
        const r = check(ps, v[k], `${at}.${k}`, depth + 1);
        if (r) return r;
      }
    }
    return null;
  };
  return check(schema, value, '$', 0);
}
