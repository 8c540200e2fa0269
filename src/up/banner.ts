/**
 * The request `pdserve up` prints under "Try:": a `curl` line a user can paste against the
 * cluster as started, so it carries what that cluster asks of a client (an API key, a CA for
 * HTTPS) as placeholders, and says what each placeholder stands for; and the doctor command
 * that can read the cluster's rooms.
 */
import { rmSync, writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';

/** What the started router asks of a client. */
export interface TryAccess {
  /** Clients must send `Authorization: Bearer KEY` (API keys configured). */
  apiKey: boolean;
  /** The router serves HTTPS (`--tls-cert`): curl must trust the certificate's CA. */
  https: boolean;
}

/**
 * The lines of the banner's "Try:" block (without the heading).
 * @param routerUrl the router's base URL, e.g. `http://127.0.0.1:8000` (no trailing slash).
 * @returns the curl command (POST /v1/completions, a 16-token greedy completion), then one line
 *   naming the placeholders when it has any.
 */
export function tryLines(routerUrl: string, a: TryAccess): string[] {
  const ca = a.https ? ' --cacert CA.pem' : '';
  const key = a.apiKey ? " -H 'authorization: Bearer KEY'" : '';
  const curl = `curl -s${ca} ${routerUrl}/v1/completions${key} -H 'content-type: application/json' -d '{"model":"pdserve","prompt":"Once upon a time","max_tokens":16,"temperature":0}'`;
  const names = [a.https ? 'CA.pem: the CA that signed --tls-cert' : '', a.apiKey ? 'KEY: one of the API keys' : ''].filter(Boolean);
  return names.length ? [curl, `(${names.join('; ')})`] : [curl];
}

/**
 * Write the cluster secret `up` generated to `<dir>/cluster-secret` so that a user's `pdserve
 * doctor` can sign its worker requests (without it doctor sees no rooms). Mode 0600, created new
 * (`wx`, never written through a file or link already there; one left by an earlier run with the
 * same `--log-dir` is unlinked first).
 * @returns the file's path, or null when it cannot be written (the banner then prints no file).
 */
export function writeSecretFile(dir: string, secret: string): string | null {
  const path = join(dir, 'cluster-secret');
  try {
    rmSync(path, { force: true });
    writeFileSync(path, `${secret}\n`, { mode: 0o600, flag: 'wx' });
    return path;
  } catch {
    return null;
  }
}

/**
 * The file `up` read its cluster secret from, as an absolute path, for the doctor line: the
 * `--cluster-secret-file` flag, else PDSERVE_CLUSTER_SECRET_FILE unless PDSERVE_CLUSTER_SECRET is
 * set (../cli/secrets.ts `clusterSecretOf`'s order); null for a secret given by value or none.
 */
export function givenSecretFile(o: { clusterSecretFile?: string }, env: NodeJS.ProcessEnv = process.env): string | null {
  const f = o.clusterSecretFile ?? (env.PDSERVE_CLUSTER_SECRET ? undefined : env.PDSERVE_CLUSTER_SECRET_FILE);
  return f ? resolve(f) : null;
}

/** What the started cluster asks of `doctor`, for the banner's doctor line. */
export interface DoctorAccess {
  /** The router serves HTTPS (`--tls-cert`): doctor needs `--ca` for it. */
  https?: boolean;
  /** The router has admin keys (`ADMIN_KEY`) or only API keys (`KEY`: one opens the debug paths too); null: open. */
  key?: 'ADMIN_KEY' | 'KEY' | null;
  /** The internal TLS files `up` gave its children (absolute paths, not secrets): doctor presents the same. */
  internalTls?: { cert?: string; key?: string; ca?: string };
}

/**
 * The banner's doctor command: with the file of the secret (the one `up` was given, or the one it
 * wrote for a secret it generated), doctor reads the secret from there (PDSERVE_CLUSTER_SECRET_FILE: no shell substitution, the secret itself is never
 * printed); else it relies on the caller's own
 * PDSERVE_CLUSTER_SECRET, the secret `up` was given (or could not write). A keyed router adds
 * `PDSERVE_ADMIN_API_KEY=<placeholder>`, HTTPS adds `--ca CA.pem` (the placeholder `tryLines`
 * explains), internal TLS the `--internal-tls-*` files as given.
 */
export function doctorLine(routerUrl: string, secretFile: string | null, a: DoctorAccess = {}): string {
  const env = [secretFile ? `PDSERVE_CLUSTER_SECRET_FILE=${secretFile}` : 'PDSERVE_CLUSTER_SECRET=<the cluster secret>', a.key ? `PDSERVE_ADMIN_API_KEY=${a.key}` : ''];
  const t = a.internalTls ?? {};
  const flags = [a.https ? '--ca CA.pem' : '', t.cert ? `--internal-tls-cert ${t.cert}` : '', t.key ? `--internal-tls-key ${t.key}` : '', t.ca ? `--internal-tls-ca ${t.ca}` : ''];
  return [...env, 'node bin/pdserve.js doctor --url', routerUrl, ...flags].filter(Boolean).join(' ');
}
