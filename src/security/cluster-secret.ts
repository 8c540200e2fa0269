/**
 * The cluster secret's one rule and one message, for every role's configuration (router,
 * prefill, decode), `pdserve up` and `pdserve doctor`: a secret from a file is its first line,
 * trimmed; one shorter than `CLUSTER_SECRET_MIN_CHARS` is refused with `SHORT_SECRET_MESSAGE`,
 * which says what to do, whichever process reads it.
 */
import { readFileSync } from 'node:fs';
import { PdError } from '../base/errors.js';

/** The shortest cluster secret a process accepts, characters. */
export const CLUSTER_SECRET_MIN_CHARS = 8;

/** What every process says of a too-short cluster secret (the same on each, so one search finds the fix). */
export const SHORT_SECRET_MESSAGE = `the cluster secret is shorter than ${CLUSTER_SECRET_MIN_CHARS} characters: give the router and every worker the same longer one (e.g. openssl rand -hex 24 > FILE, then PDSERVE_CLUSTER_SECRET_FILE=FILE)`;

/**
 * The secret `s` when it is long enough.
 * @throws PdError('invalid_config', SHORT_SECRET_MESSAGE) when it is shorter than CLUSTER_SECRET_MIN_CHARS.
 */
export function checkClusterSecret(s: string): string {
  if (s.length < CLUSTER_SECRET_MIN_CHARS) throw new PdError('invalid_config', SHORT_SECRET_MESSAGE);
  return s;
}

/**
 * The cluster secret held in `file`: its first line, trimmed, checked by `checkClusterSecret`.
 * @throws PdError('invalid_config') naming the file when it cannot be read or is empty, or when the secret is too short.
 */
export function readClusterSecretFile(file: string): string {
  let s: string;
  try {
    s = (readFileSync(file, 'utf8').split(/\r?\n/)[0] ?? '').trim();
  } catch (err) {
    throw new PdError('invalid_config', `cannot read the cluster secret file ${file}: ${(err as Error).message}`);
  }
  if (!s) throw new PdError('invalid_config', `the cluster secret file ${file} is empty`);
  return checkClusterSecret(s);
}
