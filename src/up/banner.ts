/**
 * The request `pdserve up` prints under "Try:": a `curl` line a user can paste against the
 * cluster as started, so it carries what that cluster asks of a client (an API key, a CA for
 * HTTPS) as placeholders, and says what each placeholder stands for.
 */

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
