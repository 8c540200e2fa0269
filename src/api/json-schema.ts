/**
 * The JSON-schema subset node-llama-cpp 3.21.1 turns into a grammar exactly (its GbnfJsonSchema
 * type). node-llama-cpp itself is lenient — an unknown `type` becomes `null`, an unknown keyword
 * such as `pattern` is dropped, a dangling `$ref` becomes "any" — so a schema is checked here
 * first and anything outside the subset is a 400 naming the keyword, instead of output that
 * silently ignores part of the schema.
 */
import { PdError } from '../base/errors.js';

const TYPES = new Set(['string', 'number', 'integer', 'boolean', 'null', 'object', 'array']);
/** Keywords without effect on generation (annotations). */
const ANNOTATIONS = new Set(['description', 'title', '$schema', '$id', '$comment', 'examples', 'default']);
const KEYWORDS = new Set(['type', 'const', 'enum', 'oneOf', 'anyOf', 'properties', 'required', 'additionalProperties', 'minProperties', 'maxProperties', 'items', 'prefixItems', 'minItems', 'maxItems', 'minLength', 'maxLength', 'format', '$defs', '$ref']);
const FORMATS = new Set(['date-time', 'time', 'date']);

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

/**
 * Check `schema` against the supported subset and return a copy with `anyOf` rewritten to
 * `oneOf` (for generation both are the same alternation; node-llama-cpp knows only `oneOf`).
 * @throws SchemaError naming the first unsupported keyword or value. Depth is limited to 32.
 */
export function normaliseJsonSchema(schema: unknown, path = '', defs?: Record<string, unknown>, depth = 0): Record<string, unknown> {
  if (depth > 32) throw new SchemaError(path, 'the schema is nested too deeply (limit 32)');
  if (schema === null || typeof schema !== 'object' || Array.isArray(schema)) throw new SchemaError(path, 'expected a schema object');
  const s = schema as Record<string, unknown>;
  const localDefs = (s.$defs as Record<string, unknown> | undefined) ?? defs;
  const out: Record<string, unknown> = {};
  const sub = (v: unknown, p: string) => normaliseJsonSchema(v, p, localDefs, depth + 1);
  for (const [k, v] of Object.entries(s)) {
    const at = `${path}.${k}`;
    if (ANNOTATIONS.has(k)) continue;
    if (!KEYWORDS.has(k)) throw new SchemaError(at, `JSON schema keyword '${k}' is not supported by the grammar engine`);
    switch (k) {
      case 'type': {
        const ts = Array.isArray(v) ? v : [v];
        for (const t of ts) if (typeof t !== 'string' || !TYPES.has(t)) throw new SchemaError(at, `unsupported type ${JSON.stringify(t)}`);
        if (Array.isArray(v) && v.some((t) => t === 'object' || t === 'array')) throw new SchemaError(at, 'a type list may only hold string, number, integer, boolean, null');
        out[k] = v;
        break;
      }
      case 'oneOf':
      case 'anyOf':
        if (!Array.isArray(v) || v.length === 0) throw new SchemaError(at, 'expected a non-empty array of schemas');
        out.oneOf = v.map((x, i) => sub(x, `${at}[${i}]`));
        break;
      case 'properties':
        if (v === null || typeof v !== 'object' || Array.isArray(v)) throw new SchemaError(at, 'expected an object');
        out[k] = Object.fromEntries(Object.entries(v).map(([name, x]) => [name, sub(x, `${at}.${name}`)]));
        break;
      case 'additionalProperties':
        out[k] = typeof v === 'boolean' ? v : sub(v, at);
        break;
      case 'items':
        out[k] = sub(v, at);
        break;
      case 'prefixItems':
        if (!Array.isArray(v)) throw new SchemaError(at, 'expected an array of schemas');
        out[k] = v.map((x, i) => sub(x, `${at}[${i}]`));
        break;
      case '$defs':
        if (v === null || typeof v !== 'object' || Array.isArray(v)) throw new SchemaError(at, 'expected an object');
        out[k] = Object.fromEntries(Object.entries(v).map(([name, x]) => [name, sub(x, `${at}.${name}`)]));
        break;
      case '$ref': {
        const m = typeof v === 'string' ? /^#\/\$defs\/(.+)$/.exec(v) : null;
        if (!m || !localDefs || !(m[1]! in localDefs)) throw new SchemaError(at, `only references to an existing '#/$defs/<name>' are supported (got ${JSON.stringify(v)})`);
        out[k] = v;
        break;
      }
      case 'format':
        if (typeof v !== 'string' || !FORMATS.has(v)) throw new SchemaError(at, `string format ${JSON.stringify(v)} is not supported (date-time, time, date)`);
        out[k] = v;
        break;
      case 'required':
        if (!Array.isArray(v) || !v.every((x) => typeof x === 'string')) throw new SchemaError(at, 'expected an array of property names');
        out[k] = v;
        break;
      case 'const':
      case 'enum':
        if (k === 'enum' && (!Array.isArray(v) || v.length === 0)) throw new SchemaError(at, 'expected a non-empty array');
        for (const x of k === 'enum' ? (v as unknown[]) : [v]) if (x !== null && typeof x === 'object') throw new SchemaError(at, 'only string, number, boolean or null values are supported');
        out[k] = v;
        break;
      default:
        if (typeof v !== 'number' || !Number.isInteger(v) || v < 0) throw new SchemaError(at, 'expected a non-negative integer');
        out[k] = v;
    }
  }
  return out;
}
