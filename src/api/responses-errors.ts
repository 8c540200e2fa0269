/**
 * The chat path's error answers, as a /v1/responses client reads them: ./responses-http.ts
 * serves a Responses request by a chat request to the same server, and passes the chat path's
 * 4xx/5xx through before the stream. Its status, code and message stay; its `param` names the
 * chat field (`messages[2].content`, `max_tokens`), which this client never sent, so it is
 * renamed to the Responses field the value came from (`input`, `max_output_tokens`).
 */

/** Chat field (a param's head) → the Responses field it was built from (./responses.ts). */
const RENAMES: ReadonlyArray<readonly [RegExp, string]> = [
  [/^(messages|prompt)(\[.*)?$/, 'input'], // the conversation (a worker names an over-long one `prompt`)
  [/^(max_tokens|max_completion_tokens)$/, 'max_output_tokens'],
  [/^response_format(\..*)?$/, 'text.format'],
  [/^tools\[(\d+)\]\.function(\..*)?$/, 'tools[$1]$2'], // chat nests a function tool's fields under `function`
];

/**
 * The Responses name of a chat error's `param`, e.g. `messages[1].content` → `input`,
 * `max_tokens` → `max_output_tokens`, `tools[0].function.parameters` → `tools[0].parameters`;
 * any other param (`model`, `temperature`, `tool_choice`, …: the same name in both APIs), and
 * null, unchanged.
 */
export function responsesParamOf(param: string | null): string | null {
  if (param === null) return null;
  for (const [re, to] of RENAMES) if (re.test(param)) return param.replace(re, to);
  return param;
}

/**
 * A chat error body (the JSON text of `{error: {message, type, param, code}}`) with its `param`
 * renamed by `responsesParamOf`. Text that is not such a body is returned as it is: it is still
 * what the chat path answered. Throws nothing.
 */
export function responsesErrorText(text: string): string {
  let body: unknown;
  try {
    body = JSON.parse(text);
  } catch {
    return text;
  }
  const err = (body as { error?: unknown } | null)?.error;
  if (!err || typeof err !== 'object' || typeof (err as { param?: unknown }).param !== 'string') return text;
  const e = err as { param: string };
  const param = responsesParamOf(e.param);
  return param === e.param ? text : JSON.stringify({ ...(body as object), error: { ...e, param } });
}
