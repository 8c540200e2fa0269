/**
 * pdserve's one error model, in the style of undici's `lib/core/errors.js`: every failure has a
 * stable string `code` that callers and tests switch on (never the message text), and ONE table
 * maps each code to its HTTP status, its OpenAI error `type` and whether the client or the
 * system caused it. This module is a leaf: it imports nothing from the project, so every layer
 * (engine, kv, api, the workers, the router) can use it without an upward import.
 *
 * Three shapes carry a code:
 *  - `PdError` — thrown inside a process (engine, KV channel, envelope, state parser, start-up
 *    checks); its code is a table code or an internal one of `INTERNAL_TO_API`, typed, so a code
 *    in neither fails the type check. Subclasses: `InternalError` (a broken invariant: a bug),
 *    `ConfigError` (a start-up configuration the user fixes), and each layer's own
 *    (`EngineError`, `KvError`, `SseError`, …);
 *  - `RoomFailure` — `{code, detail}`, why a KV room failed (the lifecycle core keeps the first
 *    one; it travels to the peer in the wire `fail` message);
 *  - `ApiError` — a PdError that crosses HTTP, rendered as an OpenAI error body; its `code` is
 *    typed `ErrorCode` (a code read from a peer's body goes through `asErrorCode`), and
 *    `ApiError.of(code, …)` takes its status and type from the table.
 */

export type ApiErrorType = 'invalid_request_error' | 'server_error' | 'timeout_error' | 'overloaded_error' | 'not_found_error' | 'authentication_error' | 'rate_limit_error';

/** Who caused a failure: the request/its client (4xx, a cancel) or the system (5xx, a fault). */
export type ErrorCause = 'client' | 'system';

/** One row of the code table. */
export interface CodeSpec {
  /** HTTP status the code is answered with. */
  status: number;
  type: ApiErrorType;
  cause: ErrorCause;
}

const c = <S extends number, T extends ApiErrorType>(status: S, type: T, cause: ErrorCause) => ({ status, type, cause });
const CLIENT_400 = c(400, 'invalid_request_error', 'client');
const BAD_GATEWAY = c(502, 'server_error', 'system');

/**
 * THE code → status table. Every code a pdserve process answers with over HTTP, or records as a
 * room failure, is here; `test/unit/errors.test.ts` checks that every `new ApiError(status,
 * 'code', …)` left in the sources agrees with it. Codes are never reused for another meaning.
 */
export const ERROR_CODES = {
  // -- client-caused: the request itself or its client --------------------------------------
  invalid_request: CLIENT_400,
  invalid_value: CLIENT_400,
  /** n × prompts over the router's fan-out bound. */
  too_many_choices: CLIENT_400,
  invalid_type: CLIENT_400,
  missing_required_parameter: CLIENT_400,
  invalid_json: CLIENT_400,
  unsupported_media_type: CLIENT_400,
  invalid_content_length: CLIENT_400,
  /** Plain HTTP sent to a TLS port (api/plain-http.ts): answered without reading the request. */
  plain_http_on_tls_port: CLIENT_400,
  context_length_exceeded: CLIENT_400,
  /** A request-controlled count (messages, input_ids) over its bound, refused before per-item work. */
  request_too_large: CLIENT_400,
  /** A JSON schema past a size bound (nodes after $ref expansion, enum values): refused before any grammar is compiled. */
  schema_too_complex: CLIENT_400,
  empty_prompt: CLIENT_400,
  invalid_token: CLIENT_400,
  /** A second live request with the same `rid` on one worker (vLLM answers 400 too). */
  duplicate_rid: CLIENT_400,
  /** A second live room with the same bootstrap_room on one worker. */
  duplicate_room: c(409, 'invalid_request_error', 'client'),
  body_too_large: c(413, 'invalid_request_error', 'client'),
  /** A request body sent compressed (Content-Encoding gzip, br, …): bodies are read as sent. */
  unsupported_content_encoding: c(415, 'invalid_request_error', 'client'),
  /** A request field pdserve does not know (refused by name, not ignored). */
  unrecognized_argument: CLIENT_400,
  /** A known field with a value pdserve does not support. */
  unsupported_value: CLIENT_400,
  /** An object id that names nothing (a stored response, an item, a dashboard asset): OpenAI's type for it is invalid_request_error. */
  not_found: c(404, 'invalid_request_error', 'client'),
  /** /v1/responses: previous_response_id names no stored response (OpenAI answers this code with a 400). */
  previous_response_not_found: CLIENT_400,
  /**
   * A finished JSON output (response_format json_schema, guided_json, tool-call arguments) breaks
   * a keyword of its schema that the grammar cannot enforce and that is checked after generation
   * (docs/API.md's keyword table); 4xx, so neither the router nor an SDK retries it.
   */
  output_schema_mismatch: c(422, 'invalid_request_error', 'client'),
  /** A model name this server does not serve (OpenAI answers it with type invalid_request_error). */
  model_not_found: c(404, 'invalid_request_error', 'client'),
  worker_not_found: c(404, 'not_found_error', 'client'),
  trace_not_found: c(404, 'invalid_request_error', 'client'),
  /** The router's POST /abort_request names no request in flight. */
  request_not_found: c(404, 'not_found_error', 'client'),
  /** A role switch asked of a worker that cannot make it now: a fixed-role worker, a stale epoch, a switch already running, the role it has, the last worker of a role. */
  role_switch_refused: c(409, 'invalid_request_error', 'client'),
  method_not_allowed: c(405, 'invalid_request_error', 'client'),
  /** No API key, or not one of the configured keys (OpenAI's code and type). */
  invalid_api_key: c(401, 'authentication_error', 'client'),
  /** A worker endpoint called without a valid, fresh, unused request signature (src/security/request-auth.ts). */
  unauthenticated: c(401, 'authentication_error', 'client'),
  /** A /generate naming a bootstrap address that is not one of the prefill workers decode knows. */
  unknown_bootstrap_address: CLIENT_400,
  /** The edge's admission refused the request (concurrency queue full or timed out, or the key's rate): retry after `retry-after`. */
  rate_limited: c(429, 'rate_limit_error', 'client'),
  /** The request was cancelled by its client, by the router on the client's behalf, or by an operator (POST /abort_request). */
  request_aborted: c(499, 'invalid_request_error', 'client'),
  /**
   * Router → a leg's worker only (the cause of an /abort_request): the other leg's worker was
   * draining and the request runs again on another pair; this leg's room is cancelled, not failed.
   */
  request_redispatched: c(499, 'invalid_request_error', 'client'),
  client_closed_request: c(499, 'invalid_request_error', 'client'),
  /**
   * Router ↔ decode only, never sent to a client: decode was asked for a decode-local
   * continuation but the prompt's uncached suffix is over its `local_prefill` limit; nothing was
   * created, and the router runs the request on the normal PD path.
   */
  needs_prefill: c(409, 'invalid_request_error', 'client'),
  /**
   * The prompt's KV state is over the decode worker's `--max-state-bytes`: the same prompt makes
   * the same state on every attempt, so it is answered at once, never retried or migrated (400
   * as `context_length_exceeded`: the prompt is too long for this deployment, not a fault).
   */
  kv_state_too_large: CLIENT_400,
  /**
   * Router → decode only (the cause of an /abort_request): prefill refused the request with a
   * 4xx (the request's own fault, e.g. context_length_exceeded), so decode's room ends with it.
   */
  prefill_refused: CLIENT_400,
  // -- system faults ---------------------------------------------------------------------------
  internal_error: c(500, 'server_error', 'system'),
  /** The engine (llama.cpp) failed evaluating, saving or loading a sequence. */
  engine_failed: c(500, 'server_error', 'system'),
  generation_aborted: c(500, 'server_error', 'system'),
  /**
   * The worker's state directory (--state-dir, /dev/shm) has no room for the request's KV state
   * (507 Insufficient Storage): the router does not send it to that worker again, the worker's
   * /health says `degraded` until space frees up (../runtime/state-space.ts).
   */
  state_dir_full: c(507, 'server_error', 'system'),
  /** The KV transfer broke: connection gone mid-send, chunk out of place, bad announced size. */
  kv_transfer_failed: BAD_GATEWAY,
  /** The received KV state failed validation (envelope, checksum, ggsq walk). */
  bad_state: BAD_GATEWAY,
  /** The KV connection to the room's peer closed or went silent. */
  peer_lost: BAD_GATEWAY,
  /** Decode could not open (or authenticate) a KV connection to the room's prefill. */
  peer_unreachable: BAD_GATEWAY,
  /** The peer refused the room's registration (unknown room, registered elsewhere, too many pending). */
  registration_refused: BAD_GATEWAY,
  /** Prefill and decode were started with different model or context settings: they never pair. */
  settings_mismatch: BAD_GATEWAY,
  /** A worker refused a request of another protocol major (../base/version.ts): a rolling upgrade's incompatible pair. */
  protocol_mismatch: BAD_GATEWAY,
  bad_worker_event: BAD_GATEWAY,
  bad_worker_answer: BAD_GATEWAY,
  prefill_stream_truncated: BAD_GATEWAY,
  decode_stream_truncated: BAD_GATEWAY,
  prefill_unreachable: BAD_GATEWAY,
  decode_unreachable: BAD_GATEWAY,
  /** A worker refused the router's signed request (it runs with another cluster secret): it leaves the rotation, the request is retried elsewhere. */
  worker_unauthenticated: BAD_GATEWAY,
  prefill_failed: BAD_GATEWAY,
  decode_failed: BAD_GATEWAY,
  /**
   * The decode worker's stream went silent mid-generation for longer than the router's
   * `--leg-silence-timeout-ms` (a stopped or frozen process): the worker is marked frozen and the
   * request migrates as after a crash.
   */
  decode_stalled: BAD_GATEWAY,
  /** A worker answered an error whose code is not in this table (a newer or foreign peer). */
  prefill_error: BAD_GATEWAY,
  decode_error: BAD_GATEWAY,
  /** n > 1: a choice of the group failed or never joined, so the group's one prefill request could not be sent. */
  choice_group_incomplete: c(503, 'server_error', 'system'),
  /** /v1/responses: the server's own chat path did not answer or broke its stream. */
  chat_path_failed: BAD_GATEWAY,
  queue_full: c(503, 'overloaded_error', 'system'),
  queue_timeout: c(503, 'overloaded_error', 'system'),
  shutting_down: c(503, 'server_error', 'system'),
  /** A process draining on SIGTERM refuses new work (../runtime/drain.ts); the router re-dispatches it. */
  draining: c(503, 'server_error', 'system'),
  /**
   * A /generate leg whose role or epoch header names another role or epoch than the worker's now
   * (it switched role or restarted since the router picked it): refused before anything runs; the
   * router re-dispatches the request and re-probes the worker.
   */
  stale_epoch: c(503, 'server_error', 'system'),
  /** A role switch (a worker's POST /role) broke midway: the worker is back in its old role (`safe_to_restore`) or marked failed. */
  role_switch_failed: c(503, 'server_error', 'system'),
  no_healthy_prefill: c(503, 'server_error', 'system'),
  no_healthy_decode: c(503, 'server_error', 'system'),
  /** Healthy prefill and decode workers exist, but no pair shares the same settings. */
  no_compatible_pair: c(503, 'server_error', 'system'),
  /** A room phase's deadline passed (watchdog). */
  room_deadline_expired: c(504, 'timeout_error', 'system'),
  timeout: c(504, 'timeout_error', 'system'),
} as const satisfies Record<string, CodeSpec>;

export type ErrorCode = keyof typeof ERROR_CODES;

/** The table codes answered with HTTP status `S` (e.g. `CodeWithStatus<400>` for a bad request). */
export type CodeWithStatus<S extends number> = { [K in ErrorCode]: (typeof ERROR_CODES)[K]['status'] extends S ? K : never }[ErrorCode];

/** True when `code` is in the table. */
export function isErrorCode(code: unknown): code is ErrorCode {
  return typeof code === 'string' && Object.prototype.hasOwnProperty.call(ERROR_CODES, code);
}

/** `code` when it is in the table, else `fallback`: for codes read from a peer's error body. */
export function asErrorCode(code: unknown, fallback: ErrorCode): ErrorCode {
  return isErrorCode(code) ? code : fallback;
}

/** The table row of `code`; unknown codes are system faults answered 500. */
export function codeSpec(code: string): CodeSpec {
  return isErrorCode(code) ? ERROR_CODES[code] : ERROR_CODES.internal_error;
}

/** Whether the client (4xx, cancel) or the system (5xx) caused a failure with this code. */
export function causeOf(code: string): ErrorCause {
  return codeSpec(code).cause;
}

/**
 * Why a KV room failed: a stable code and a human detail. The lifecycle core keeps the first one
 * (first failure wins); the wire `fail` message carries both to the peer.
 */
export interface RoomFailure {
  code: ErrorCode;
  detail: string;
}

/** Build a RoomFailure. */
export const failure = (code: ErrorCode, detail: string): RoomFailure => ({ code, detail });

/** "code: detail", for logs and timelines. */
export const failureText = (f: RoomFailure): string => `${f.code}: ${f.detail}`;

/**
 * THE internal → API table: every code thrown inside a process (PdError and its subclasses: the
 * engine's, the KV channel's, the state parser's, the SSE writer's, start-up checks) → the table
 * code it is answered with. `PdError`'s code is typed `ErrorCode | InternalCode`, so a code in
 * neither table fails the type check, and a new internal code cannot be added without its row.
 */
export const INTERNAL_TO_API = {
  // -- the engine (src/engine) -----------------------------------------------------------------
  PROMPT_TOO_LONG: 'context_length_exceeded',
  EMPTY_PROMPT: 'empty_prompt',
  INVALID_TOKEN: 'invalid_token',
  /** A JSON schema or grammar node-llama-cpp refuses: the request's fault. */
  BAD_GRAMMAR: 'invalid_value',
  /** A slot used after its release: a bug at the caller. */
  SLOT_RELEASED: 'internal_error',
  /** The engine was closed under a request: the process is shutting down. */
  ENGINE_DISPOSED: 'shutting_down',
  /** Model + slots over the free device memory (start-up). */
  GPU_MEMORY: 'engine_failed',
  QUEUE_FULL: 'queue_full',
  TIMEOUT: 'timeout',
  ABORTED: 'request_aborted',
  // -- the KV channel and the state it carries (src/kv, the prefix store) ----------------------
  DUPLICATE_ROOM: 'duplicate_room',
  /** A write to a room that already failed (its own failure is what is answered). */
  ROOM_FAILED: 'kv_transfer_failed',
  UNKNOWN_ROOM: 'registration_refused',
  /** A frame that does not decode (bad length, type, field): the transfer is broken. */
  BAD_FRAME: 'kv_transfer_failed',
  BAD_STATE: 'bad_state',
  BAD_ENVELOPE: 'bad_state',
  /** A stored prefix state whose tokens are not its key's. */
  KEY_MISMATCH: 'bad_state',
  STATE_TOO_LARGE: 'kv_state_too_large',
  PEER_LOST: 'peer_lost',
  AUTH_FAILED: 'peer_unreachable',
  SETTINGS_MISMATCH: 'settings_mismatch',
  STATE_DIR_FULL: 'state_dir_full',
  // -- the SSE writer and reader (src/api/sse.ts) ----------------------------------------------
  SSE_CLOSED: 'client_closed_request',
  SSE_WRITE_TIMEOUT: 'client_closed_request',
  SSE_SLOW_CLIENT: 'client_closed_request',
  SSE_EVENT_TOO_LARGE: 'bad_worker_event',
  /** A JSON schema outside the supported subset (the API names the keyword, 400). */
  UNSUPPORTED_SCHEMA: 'invalid_value',
  // -- start-up and operation: never answered over HTTP, printed or logged --------------------
  /** A configuration a user fixes from the message alone (flags, files, addresses). */
  invalid_config: 'internal_error',
  INVALID_ROUTER_CONFIG: 'internal_error',
  bad_model_file: 'internal_error',
  /** A child process could not listen on its port. */
  PORT_IN_USE: 'internal_error',
  /** etcd (membership) did not answer or refused. */
  ETCD_FAILED: 'internal_error',
  /** A child process did not become ready (pdserve up). */
  START_FAILED: 'internal_error',
  /** A broken invariant: a bug in pdserve, never the input's fault (`InternalError`). */
  INTERNAL: 'internal_error',
} as const satisfies Record<string, ErrorCode>;

/** A code thrown inside a process, mapped by INTERNAL_TO_API. */
export type InternalCode = keyof typeof INTERNAL_TO_API;

/** Every code a PdError may carry: a table code or an internal one. */
export type PdCode = ErrorCode | InternalCode;

/**
 * The one base class of pdserve's errors (undici's `UndiciError`): `code` is the stable
 * identity, `message` is for humans. Thrown inside processes with an internal code (the
 * engine's, the KV channel's, the state parser's: `errorCodeOf` maps them to the table); its
 * subclass `ApiError` carries a table code, checked by the type system.
 */
export class PdError extends Error {
  constructor(
    public readonly code: PdCode,
    message: string,
  ) {
    super(message);
    this.name = 'PdError';
  }
}

/**
 * A broken invariant — a bug in pdserve, never the input's fault (node:assert's role, with a
 * code): answered 500 `internal_error` if it reaches HTTP.
 */
export class InternalError extends PdError {
  constructor(message: string) {
    super('INTERNAL', message);
    this.name = 'InternalError';
  }
}

/**
 * A start-up configuration the user fixes from its message alone (a flag, a file, an address):
 * printed without a stack (src/cli/serve.ts `startupProblem`).
 */
export class ConfigError extends PdError {
  constructor(message: string) {
    super('invalid_config', message);
    this.name = 'ConfigError';
  }
}

/**
 * Errors that cross the HTTP boundary: a code from the table, its status and OpenAI `type`.
 * Build them with `ApiError.of(code, …)`: status and type come from the table. The constructor
 * takes them as given, for an answer relayed from a peer (a worker's status and type passed
 * through to the client) — the one case where the table does not decide.
 */
export class ApiError extends PdError {
  constructor(
    public readonly status: number,
    public override readonly code: ErrorCode,
    message: string,
    public readonly type: ApiErrorType = status < 500 ? 'invalid_request_error' : 'server_error',
    public readonly param: string | null = null,
  ) {
    super(code, message);
    this.name = 'ApiError';
  }

  /** An ApiError whose status and type come from the code table. */
  static of(code: ErrorCode, message: string, param: string | null = null): ApiError {
    const s = ERROR_CODES[code];
    return new ApiError(s.status, code, message, s.type, param);
  }

  /** This error with another message and/or param; its code, status and type kept. */
  with(changes: { message?: string; param?: string | null }): ApiError {
    return new ApiError(this.status, this.code, changes.message ?? this.message, this.type, changes.param === undefined ? this.param : changes.param);
  }

  /** The room failure as the HTTP error the worker answers with. */
  static fromFailure(f: RoomFailure): ApiError {
    return ApiError.of(f.code, f.detail);
  }

  /** OpenAI error body: {error: {message, type, param, code}}. */
  toBody(): { error: { message: string; type: string; param: string | null; code: string } } {
    return { error: { message: this.message, type: this.type, param: this.param, code: this.code } };
  }
}

/** True when `code` is an internal code (a row of INTERNAL_TO_API). */
export function isInternalCode(code: unknown): code is InternalCode {
  return typeof code === 'string' && Object.prototype.hasOwnProperty.call(INTERNAL_TO_API, code);
}

/** The table code of any thrown value (ApiError/PdError codes mapped; anything else internal_error). */
export function errorCodeOf(err: unknown): ErrorCode {
  const code = (err as { code?: unknown })?.code;
  if (typeof code !== 'string') return 'internal_error';
  if (isErrorCode(code)) return code;
  return isInternalCode(code) ? INTERNAL_TO_API[code] : 'internal_error';
}

/** Map any thrown value to an ApiError through the table (unknown errors become 500 internal_error). */
export function toApiError(err: unknown): ApiError {
  if (err instanceof ApiError) return err;
  const message = typeof (err as { message?: unknown })?.message === 'string' ? (err as Error).message : String(err);
  const param = (err as { code?: unknown })?.code === 'PROMPT_TOO_LONG' ? 'prompt' : null;
  return ApiError.of(errorCodeOf(err), message, param);
}
