/**
 * `GET /v1/responses/{id}/input_items`: the items a stored response was generated from (the
 * previous responses' input items and outputs, then its own input; `instructions` are not
 * items), as OpenAI lists them: `{object: 'list', data, first_id, last_id, has_more}`, a cursor
 * page of at most `limit` items (1–100, default 20) in `order` (`desc`, the default: newest first;
 * or `asc`) after the item `after`. `include` is accepted (nothing here has more to include).
 */
import { ApiError } from '../base/errors.js';

/** The query of the route (strings as fastify parses them). */
export interface InputItemsQuery {
  after?: unknown;
  limit?: unknown;
  order?: unknown;
  include?: unknown;
}

/** Most items per page (OpenAI's bound). */
export const MAX_INPUT_ITEMS_PAGE = 100;

const bad = (param: string, message: string): ApiError => ApiError.of('invalid_value', `Invalid value for '${param}': ${message}`, param);

/**
 * One page of `items` (in context order) for `q`.
 * @throws ApiError 400 for a limit out of 1–100, an order other than asc / desc, or an `after`
 *   that is not an item of this response.
 */
export function pageInputItems(items: readonly Record<string, unknown>[], q: InputItemsQuery): { object: 'list'; data: Record<string, unknown>[]; first_id: string | null; last_id: string | null; has_more: boolean } {
  const limit = q.limit === undefined ? 20 : Number(q.limit);
  if (!Number.isInteger(limit) || limit < 1 || limit > MAX_INPUT_ITEMS_PAGE) throw bad('limit', `expected an integer from 1 to ${MAX_INPUT_ITEMS_PAGE}`);
  const order = q.order ?? 'desc';
  if (order !== 'asc' && order !== 'desc') throw bad('order', "expected 'asc' or 'desc'");
  const ordered = order === 'asc' ? items : [...items].reverse();
  let from = 0;
  if (q.after !== undefined) {
    if (typeof q.after !== 'string') throw bad('after', 'expected an item id');
    const i = ordered.findIndex((x) => x.id === q.after);
    if (i < 0) throw bad('after', `no item '${q.after}' in this response's input items`);
    from = i + 1;
  }
  const data = ordered.slice(from, from + limit);
  return { object: 'list', data, first_id: (data[0]?.id as string | undefined) ?? null, last_id: (data[data.length - 1]?.id as string | undefined) ?? null, has_more: from + limit < ordered.length };
}
