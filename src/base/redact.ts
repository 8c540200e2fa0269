/**
 * Client-facing errors name the failed role, never its address: `redactAddresses` replaces
 * URLs, IPv4 and bracketed IPv6 literals (with their ports) and `name.domain:port` /
 * `localhost:port` with `<address>`. Logs keep the full text; only what an API client receives
 * is redacted. Pure.
 */
import { ApiError } from './errors.js';

const PATTERNS = [/\bhttps?:\/\/[^\s'"`,;)]+/gi, /\[[0-9a-f:.]+\](?::\d{1,5})?/gi, /\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b/g, /\b(?:localhost|[a-z0-9-]+(?:\.[a-z0-9-]+)+):\d{1,5}\b/gi];

/** `s` with every network address replaced by `<address>`. */
export function redactAddresses(s: string): string {
  let out = s;
  for (const re of PATTERNS) out = out.replace(re, '<address>');
  return out;
}

/** `err` with its message redacted (the same object when there was nothing to redact). */
export function redactedForClient(err: ApiError): ApiError {
  const m = redactAddresses(err.message);
  return m === err.message ? err : err.with({ message: m });
}
