/**
 * Errors that cross the HTTP boundary: each has a stable `code` (matched by callers and tests),
 * the HTTP status it maps to, and an OpenAI error `type`.
 */
export type ApiErrorType = 'invalid_request_error' | 'server_error' | 'timeout_error' | 'overloaded_error' | 'not_found_error';

export class ApiError extends Error {
  constructor(
    public readonly status: number,
    public readonly code: string,
    message: string,
    public readonly type: ApiErrorType = status < 500 ? 'invalid_request_error' : 'server_error',
    public readonly param: string | null = null,
  ) {
    super(message);
    this.name = 'ApiError';
  }

  /** OpenAI error body: {error: {message, type, param, code}}. */
  toBody(): { error: { message: string; type: string; param: string | null; code: string } } {
    return { error: { message: this.message, type: this.type, param: this.param, code: this.code } };
  }
}

/** Map any thrown value to an ApiError (unknown errors become 500 internal_error). */
export function toApiError(err: unknown): ApiError {
  if (err instanceof ApiError) return err;
  const e = err as { code?: unknown; message?: unknown };
  const code = typeof e?.code === 'string' ? e.code : 'internal_error';
  const message = typeof e?.message === 'string' ? e.message : String(err);
  switch (code) {
    case 'PROMPT_TOO_LONG':
      return new ApiError(400, 'context_length_exceeded', message, 'invalid_request_error', 'prompt');
    case 'DUPLICATE_ROOM':
      return new ApiError(409, 'duplicate_room', message);
    case 'ABORTED':
      return new ApiError(499, 'request_aborted', message, 'invalid_request_error');
    case 'TIMEOUT':
      return new ApiError(504, 'timeout', message, 'timeout_error');
    case 'QUEUE_FULL':
      return new ApiError(503, 'queue_full', message, 'overloaded_error');
    default:
      return new ApiError(500, code.toLowerCase(), message, 'server_error');
  }
}
