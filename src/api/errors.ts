/**
 * OpenAI error bodies: `ApiError` → `{error: {message, type, param, code}}` with the status of the
 * code table (../base/errors.ts), the JSON body parser and the fastify error handlers every HTTP
 * edge installs.
 */
import { ZodError, type ZodIssue } from 'zod';
import type { FastifyError, FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { ApiError, asErrorCode, toApiError as commonToApiError, type ApiErrorType, type CodeWithStatus, type ErrorCode } from '../base/errors.js';
import { RepeatLimiter } from '../base/log-limit.js';

export { ApiError };

export type { ApiErrorType };

/** OpenAI error body: `{error: {message, type, param, code}}`. */
export interface OpenAIErrorBody {
  error: { message: string; type: string; param: string | null; code: string | null };
}

/** Build an OpenAI error body. */
export function errorBody(message: string, type: ApiErrorType | string = 'invalid_request_error', param: string | null = null, code: string | null = null): OpenAIErrorBody {
  return { error: { message, type, param, code } };
}

/** 400 invalid_request_error with a stable `code` (one the table answers 400). */
export const badRequest = (message: string, param: string | null = null, code: CodeWithStatus<400> = 'invalid_value'): ApiError => ApiError.of(code, message, param);

/** Render a zod path as `messages[0].content`. */
function pathString(path: (string | number)[]): string {
  let s = '';
  for (const p of path) s += typeof p === 'number' ? `[${p}]` : s === '' ? p : `.${p}`;
  return s;
}

function issueMessage(issue: ZodIssue, param: string): string {
  if (param === '') {
    return issue.code === 'invalid_type' ? 'Invalid request body: expected a JSON object' : `Invalid request body: ${issue.message}`;
  }
  if (issue.code === 'invalid_type' && issue.received === 'undefined') return `Missing required parameter: '${param}'.`;
  if (issue.code === 'invalid_type') return `Invalid type for '${param}': expected ${issue.expected}, got ${issue.received}.`;
  return `Invalid value for '${param}': ${issue.message}`;
}

/** Convert a ZodError to a 400 ApiError naming the first offending field. */
export function zodToApiError(err: ZodError): ApiError {
  const issue = err.issues[0];
  if (!issue) return badRequest('Invalid request body');
  const param = pathString(issue.path);
  const code = issue.code === 'invalid_type' && issue.received === 'undefined' ? 'missing_required_parameter' : issue.code === 'invalid_type' ? 'invalid_type' : 'invalid_value';
  return ApiError.of(code, issueMessage(issue, param), param === '' ? null : param);
}

/**
 * Map anything thrown inside a request to an ApiError: ApiError as is, ZodError → 400, fastify
 * body errors → 400 (invalid / empty JSON, wrong content type, bad content-length) or 413
 * (bodyLimit: named when `bodyLimit`, bytes, is given), other errors with a 4xx `statusCode` keep
 * it, engine errors with a string `code` go through base/errors `toApiError`, anything else → 500
 * 'Internal server error'.
 */
export function apiErrorOf(err: unknown, bodyLimit?: number): ApiError {
  if (err instanceof ApiError) return err;
  if (err instanceof ZodError) return zodToApiError(err);
  const e = err as Partial<FastifyError> & { message?: string };
  switch (e?.code) {
    case 'FST_ERR_CTP_INVALID_JSON_BODY':
      return badRequest('We could not parse the JSON body of your request: body is not valid JSON.', null, 'invalid_json');
    case 'FST_ERR_CTP_EMPTY_JSON_BODY':
      return badRequest("Request body is empty but content-type is 'application/json'.", null, 'invalid_json');
    case 'FST_ERR_CTP_INVALID_MEDIA_TYPE':
      return badRequest("Unsupported Content-Type: send the body as JSON with 'Content-Type: application/json'.", null, 'unsupported_media_type');
    case 'FST_ERR_CTP_INVALID_CONTENT_LENGTH':
      return badRequest('Request body size did not match Content-Length.', null, 'invalid_content_length');
    case 'FST_ERR_CTP_BODY_TOO_LARGE':
      return ApiError.of('body_too_large', bodyLimit ? `Request body is too large: the limit is ${sizeText(bodyLimit)}.` : 'Request body is too large.');
  }
  if (err instanceof SyntaxError) return badRequest(`We could not parse the JSON body of your request: ${printable(err.message)}`, null, 'invalid_json');
  const status = typeof e?.statusCode === 'number' ? e.statusCode : 500;
  // a 4xx raised by fastify or a plugin: its own status is relayed, whatever its code maps to
  if (status >= 400 && status < 500) return new ApiError(status, asErrorCode(e?.code, 'invalid_request'), e?.message ?? 'Bad request', 'invalid_request_error');
  if (typeof e?.code === 'string' && !e.code.startsWith('FST_')) return commonToApiError(err);
  return ApiError.of('internal_error', 'Internal server error');
}

/** `bytes` for a person: "8 MiB (8388608 bytes)", "64 KiB (65536 bytes)", "1000 bytes". */
export function sizeText(bytes: number): string {
  const unit = bytes >= 1 << 20 ? ([1 << 20, 'MiB'] as const) : bytes >= 1024 ? ([1024, 'KiB'] as const) : null;
  if (!unit) return `${bytes} bytes`;
  const n = bytes / unit[0];
  return `${Number.isInteger(n) ? n : n.toFixed(1)} ${unit[1]} (${bytes} bytes)`;
}

/** Send an ApiError as an OpenAI error body through fastify. */
export function sendApiError(reply: FastifyReply, err: ApiError): FastifyReply {
  return reply.code(err.status).type('application/json; charset=utf-8').send(err.toBody());
}

/** One warn line per 503 refusal code per second in this process (see openAIErrorHandler). */
const refusalLog = new RepeatLimiter(1000);

/**
 * Fastify error handler producing OpenAI error bodies (see `apiErrorOf`); a 503 carries
 * `retry-after: 1` unless the route set its own. Logging follows the
 * error table (../base/errors.ts): a 503 refusal (no_healthy_decode, queue_full, draining, …)
 * is expected under load or restarts, so it is logged at warn without a stack, at most once per
 * code per second with `suppressed` = the refusals of that code not logged since the previous
 * line; other 5xx (faults) at error with the original error; 4xx at debug.
 */
export function openAIErrorHandler(error: unknown, request: FastifyRequest, reply: FastifyReply): void {
  const apiErr = apiErrorOf(error, request.routeOptions?.bodyLimit ?? request.server?.initialConfig.bodyLimit);
  if (apiErr.status === 503) {
    // a refusal that passes (no healthy worker, a full queue): the client may try again soon
    if (!reply.hasHeader('retry-after')) reply.header('retry-after', '1');
    const suppressed = refusalLog.hit(apiErr.code);
    if (suppressed !== null) request.log.warn({ status: apiErr.status, code: apiErr.code, message: apiErr.message, suppressed }, 'request refused');
  } else if (apiErr.status >= 500) request.log.error({ err: error }, 'request failed');
  else request.log.debug({ status: apiErr.status, message: apiErr.message }, 'request rejected');
  void sendApiError(reply, apiErr);
}

/** `text` with control characters and U+FFFD (undecodable bytes) written as \uXXXX: a parse error quoting a binary body echoes no raw bytes. */
function printable(text: string): string {
  return text.replace(/[\u0000-\u001f\u007f-\u009f\ufffd]/g, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`);
}

/**
 * Refuse a request body sent with a Content-Encoding other than identity (gzip, br, …) with 415
 * unsupported_content_encoding before it is read: bodies are parsed as sent, and OpenAI's clients
 * send them uncompressed (decompressing would also need a bound on the inflated size).
 */
function registerContentEncodingCheck(app: FastifyInstance): void {
  app.addHook('preParsing', async (request, _reply, payload) => {
    const enc = request.headers['content-encoding'];
    if (enc === undefined || enc.trim().toLowerCase() === 'identity' || enc.trim() === '') return payload;
    const named = /^[\w.,; -]{1,64}$/.test(enc) ? ` '${enc}'` : '';
    throw ApiError.of('unsupported_content_encoding', `Content-Encoding${named} is not supported: send the request body uncompressed (no Content-Encoding header, or identity).`);
  });
}

/** Keys refused in a JSON body (prototype poisoning, as fastify's secure-json-parse refuses them). */
const POISON_KEYS = /"(?:__proto__|constructor)"/;

/**
 * Parse a JSON request body, saying precisely what is wrong: JSON.parse's own syntax message
 * (e.g. "Unexpected end of JSON input"), an empty body, or a `__proto__` key / a
 * `constructor.prototype` object (refused like fastify's default parser does, but named).
 * @throws ApiError 400 invalid_json.
 */
export function parseJsonBody(text: string): unknown {
  if (text.trim() === '') throw badRequest("Request body is empty but content-type is 'application/json'.", null, 'invalid_json');
  try {
    if (!POISON_KEYS.test(text)) return JSON.parse(text);
    return JSON.parse(text, (key, value: unknown) => {
      if (key === '__proto__') throw badRequest("Invalid JSON body: the key '__proto__' is not allowed (prototype-poisoning protection).", null, 'invalid_json');
      if (key === 'constructor' && value !== null && typeof value === 'object' && Object.hasOwn(value, 'prototype')) {
        throw badRequest("Invalid JSON body: a 'constructor' object with a 'prototype' key is not allowed (prototype-poisoning protection).", null, 'invalid_json');
      }
      return value;
    });
  } catch (err) {
    if (err instanceof ApiError) throw err;
    throw badRequest(`We could not parse the JSON body of your request: ${printable((err as Error).message)}.`, null, 'invalid_json');
  }
}

/** Replace fastify's application/json parser with `parseJsonBody` (same body limit). */
function registerJsonBodyParser(app: FastifyInstance): void {
  app.removeContentTypeParser('application/json');
  app.addContentTypeParser('application/json', { parseAs: 'string' }, (_req, body, done) => {
    try {
      done(null, parseJsonBody(body as string));
    } catch (err) {
      done(err as Error, undefined);
    }
  });
}

/**
 * Answer errors node's HTTP parser raises before fastify sees a request (fastify's
 * `clientErrorHandler` option) with OpenAI error bodies: 431 request_header_fields_too_large,
 * 408 request_timeout, 400 bad_request. Same behaviour as fastify's default otherwise (nothing on
 * a reset or destroyed socket; the socket is closed after the answer).
 */
export function openAIClientErrorHandler(err: NodeJS.ErrnoException, socket: import('node:net').Socket): void {
  if (err.code === 'ECONNRESET' || socket.destroyed) return;
  const [status, reason, code, message] =
    err.code === 'HPE_HEADER_OVERFLOW'
      ? [431, 'Request Header Fields Too Large', 'request_header_fields_too_large', 'Request header fields are too large (the total size of the headers exceeds the server limit).']
      : err.code === 'ERR_HTTP_REQUEST_TIMEOUT'
        ? [408, 'Request Timeout', 'request_timeout', 'The request was not received in time.']
        : [400, 'Bad Request', 'bad_request', `Malformed HTTP request${err.code ? ` (${err.code})` : ''}.`];
  const body = JSON.stringify(errorBody(message, 'invalid_request_error', null, code));
  if (socket.writable) socket.write(`HTTP/1.1 ${status} ${reason}\r\nContent-Length: ${Buffer.byteLength(body)}\r\nContent-Type: application/json; charset=utf-8\r\nConnection: close\r\n\r\n${body}`);
  socket.destroy(err);
}

/**
 * Install the OpenAI error handler and a not-found handler with an OpenAI body on `app`: 405
 * with an `Allow` header when the path is a route for other methods, else 404. Call it before
 * adding routes (an onRoute hook records them; `:param` segments match any one segment).
 */
export function registerOpenAIErrorHandling(app: FastifyInstance): void {
  app.setErrorHandler(openAIErrorHandler);
  registerJsonBodyParser(app);
  registerContentEncodingCheck(app);
  const routes: { re: RegExp; methods: Set<string> }[] = [];
  app.addHook('onRoute', (r) => {
    if (r.url === '*' || r.url.includes('*')) return;
    const re = new RegExp(`^${r.url.split('/').map((seg) => (seg.startsWith(':') ? '[^/]+' : seg.replace(/[.*+?^${}()|[\]\\]/g, '\\$&'))).join('/')}$`);
    let entry = routes.find((x) => x.re.source === re.source);
    if (!entry) routes.push((entry = { re, methods: new Set() }));
    for (const m of Array.isArray(r.method) ? r.method : [r.method]) entry.methods.add(m);
  });
  app.setNotFoundHandler((request, reply) => {
    const path = request.url.split('?')[0] ?? '';
    const allowed = routes.filter((x) => x.re.test(path)).flatMap((x) => [...x.methods]);
    if (allowed.length > 0) {
      void sendApiError(reply.header('allow', [...new Set(allowed)].sort().join(', ')), ApiError.of('method_not_allowed', `Method ${request.method} is not allowed on ${path} (allowed: ${[...new Set(allowed)].sort().join(', ')})`));
      return;
    }
    // an unknown route is typed not_found_error (an unknown object id, the table's not_found, is OpenAI's invalid_request_error)
    void sendApiError(reply, new ApiError(404, 'not_found', `Route ${request.method} ${path} not found`, 'not_found_error'));
  });
}

/**
 * The served-model check of vLLM (--served-model-name) and OpenAI: a request naming a model the
 * server does not serve is a 404 `model_not_found` naming `model`. An absent `model` is accepted
 * (the server has one model). `served` empty = nothing known yet (no worker probed): no check.
 * @throws ApiError 404 model_not_found.
 */
export function checkModelName(model: string | undefined, served: readonly string[]): void {
  if (model === undefined || served.length === 0 || served.includes(model)) return;
  throw ApiError.of('model_not_found', `The model '${model}' does not exist (this server serves: ${served.map((m) => `'${m}'`).join(', ')})`, 'model');
}
