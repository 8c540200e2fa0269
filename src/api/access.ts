/**
 * Client access to the OpenAI edge (router, colocated): API keys and the admin key, checked in
 * ONE fastify onRequest hook by path prefix, so a route added later under /v1/ is covered
 * without being listed. vLLM's `--api-key` and SGLang's `--admin-api-key` are the models; unlike
 * vLLM, the control and debug routes are never left open once a key is configured.
 *
 *   class     paths                                                     needs
 *   open      GET /health, OPTIONS (CORS preflight)                     nothing
 *   metrics   /metrics                                                  nothing, or (privateMetrics) admin
 *   admin     /workers*, /dashboard*                                    an admin key (none configured: an API key)
 *             /debug/*, /abort_request                                  an admin key (none configured while API keys are: refused;
 *                                                                       traces and rooms name other tenants' requests and responses,
 *                                                                       and an abort ends any tenant's request by its id)
 *   api       everything else (/v1/*, /tokenize, /detokenize, 404s)      an API key
 *
 * No key of a class configured = that class is open (as before keys existed). A key is sent as
 * `Authorization: Bearer KEY` (the OpenAI SDKs) or HTTP Basic with the key as password (a
 * browser on /dashboard: the 401 asks for it). Keys are kept as SHA-256 digests and compared in
 * constant time against every configured digest; a key is never logged. A key file (one key a
 * line, `#` comments) is polled once a second and re-read when it changes: keys rotate without a
 * restart; an unreadable file keeps the last keys read.
 */
import { createHash, timingSafeEqual } from 'node:crypto';
import { readFileSync, statSync } from 'node:fs';
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { Counter, type Registry } from 'prom-client';
import { ApiError, ConfigError } from '../base/errors.js';
import type { Logger } from '../base/log.js';
import { sendApiError } from './errors.js';

/** Access configuration of one OpenAI edge. */
export interface AccessOptions {
  /** API keys given directly (flag or PDSERVE_API_KEY). */
  apiKeys?: readonly string[];
  /** File of API keys, one a line, re-read when it changes. */
  apiKeyFile?: string;
  /** Admin keys (--admin-api-key / PDSERVE_ADMIN_API_KEY). */
  adminKeys?: readonly string[];
  /** /metrics needs the admin rule too (default: open, for scrapers). */
  privateMetrics?: boolean;
}

export type AccessClass = 'open' | 'metrics' | 'admin' | 'api';

/** The access class of a request (method, path without query), by prefix. */
export function accessClassOf(method: string, url: string): AccessClass {
  const q = url.indexOf('?');
  const path = q < 0 ? url : url.slice(0, q);
  if (method === 'OPTIONS') return 'open';
  if (path === '/health') return 'open';
  if (path === '/metrics') return 'metrics';
  if (path === '/workers' || path.startsWith('/workers/') || path.startsWith('/debug/') || path === '/dashboard' || path.startsWith('/dashboard/') || path === '/abort_request') return 'admin';
  return 'api';
}

const digest = (k: string): Buffer => createHash('sha256').update(k, 'utf8').digest();

/** Parse a key file's text: one key a line, blank lines and `#` comments skipped. */
export function parseKeyFile(text: string): string[] {
  return text
    .split(/\r?\n/)
    .map((l) => l.trim())
    .filter((l) => l.length > 0 && !l.startsWith('#'));
}

/**
 * A set of keys held as SHA-256 digests. `match(key)` compares the key's digest with every
 * digest (no early exit, `timingSafeEqual` on equal-length buffers) and returns the matching
 * key's id (the first 8 hex digits of its digest: safe to log, stable across rotations) or null.
 */
export class KeyRing {
  private digests: Buffer[] = [];
  constructor(keys: readonly string[] = []) {
    this.set(keys);
  }
  /** Replace the keys (empty strings are ignored). */
  set(keys: readonly string[]): void {
    this.digests = [...new Set(keys.filter((k) => k.length > 0))].map(digest);
  }
  get size(): number {
    return this.digests.length;
  }
  match(key: string | null): string | null {
    if (key === null || key.length === 0 || key.length > 4096) return null;
    const d = digest(key);
    let hit: Buffer | null = null;
    for (const x of this.digests) if (timingSafeEqual(x, d)) hit = x;
    return hit ? hit.subarray(0, 4).toString('hex') : null;
  }
}

/** The key of an `Authorization` header: `Bearer KEY`, or the password of `Basic base64(user:KEY)`. Null when absent or malformed. */
export function presentedKey(header: unknown): string | null {
  if (typeof header !== 'string') return null;
  const m = /^\s*(bearer|basic)\s+(\S+)\s*$/i.exec(header);
  if (!m) return null;
  if (m[1]!.toLowerCase() === 'bearer') return m[2]!;
  const plain = Buffer.from(m[2]!, 'base64').toString('utf8');
  const i = plain.indexOf(':');
  return i < 0 ? null : plain.slice(i + 1);
}

/** The key id an authenticated request was let in with (undefined: the class is open). */
export const KEY_ID = Symbol('pdserve.keyId');
/** The tenant of a request let in with an API key (`tenantOf`). */
export const TENANT = Symbol('pdserve.tenant');
type Keyed = { [KEY_ID]?: string; [TENANT]?: string };

/**
 * The tenant of an API key: hex of SHA-256 over a domain label and the key (128 bits). It
 * partitions what one key's requests leave behind — stored responses, the prefix cache and the
 * host store (as the cache salt) — so another key can neither read them nor learn of them.
 * Derived from the key itself, so rotating a key to a new one starts a new tenant.
 */
export function tenantOfKey(key: string): string {
  return createHash('sha256').update('pdserve-tenant\0', 'utf8').update(key, 'utf8').digest('hex').slice(0, 32);
}

/**
 * The cache salt of a request (sent to the workers as `cache_salt`): the client's own
 * `cache_salt` (hashed: `s:<hex>`) when it gave one — every request giving the same one shares
 * the prefix cache, whatever its key: the explicit opt-in to share — else its tenant's
 * (`t:<tenant>`), else none (an open server: one tenant, one cache).
 */
export function cacheSaltOf(tenant: string | undefined, clientSalt: string | undefined): string | undefined {
  if (clientSalt !== undefined) return `s:${createHash('sha256').update('pdserve-cache-salt\0', 'utf8').update(clientSalt, 'utf8').digest('hex').slice(0, 32)}`;
  return tenant === undefined ? undefined : `t:${tenant}`;
}

/** The tenant `request` came in as: its API key's (`tenantOfKey`), undefined when the API is open (one tenant: everyone). */
export function tenantOf(request: FastifyRequest): string | undefined {
  return (request as unknown as Keyed)[TENANT];
}

/** The id of the API key `request` came in with, when it needed one (for per-key limits). */
export function keyIdOf(request: FastifyRequest): string | undefined {
  return (request as unknown as Keyed)[KEY_ID];
}

export interface Access {
  /** True when the API (/v1/*, /tokenize, /detokenize) needs no key: the banner says the server is open. */
  readonly apiOpen: boolean;
  /** One sentence for the start banner: which classes are open. */
  describe(): string;
  /** Stop watching the key file. */
  close(): void;
}

/**
 * Install the access hook on `app` (call before any other onRequest hook, e.g. the drain
 * gate's, so an unauthenticated caller learns nothing). Refusals are 401 `invalid_api_key`
 * OpenAI error bodies with `WWW-Authenticate` (Basic on /dashboard, so a browser asks) and
 * counted in `pdserve_auth_refused_total{class}` on `registry`.
 * @throws Error when `apiKeyFile` cannot be read at start.
 */
export function registerAccess(app: FastifyInstance, o: AccessOptions, registry: Registry, log: Logger): Access {
  const api = new KeyRing(o.apiKeys ?? []);
  const fileKeys = new KeyRing();
  const admin = new KeyRing(o.adminKeys ?? []);
  let fileStamp = '';
  const load = (first: boolean): void => {
    if (!o.apiKeyFile) return;
    try {
      const st = statSync(o.apiKeyFile);
      const stamp = `${st.mtimeMs}:${st.size}:${st.ino}`;
      if (stamp === fileStamp) return;
      const keys = parseKeyFile(readFileSync(o.apiKeyFile, 'utf8'));
      fileKeys.set(keys);
      fileStamp = stamp;
      if (!first) log.info({ file: o.apiKeyFile, keys: fileKeys.size }, 'API key file re-read');
    } catch (err) {
      if (first) throw new ConfigError(`cannot read the API key file ${o.apiKeyFile}: ${(err as Error).message}`);
      log.warn({ file: o.apiKeyFile, err: (err as Error).message }, 'API key file unreadable: keeping the keys read before');
    }
  };
  load(true);
  const poll = o.apiKeyFile ? setInterval(() => load(false), 1000) : undefined;
  poll?.unref();
  const apiGuarded = () => api.size > 0 || o.apiKeyFile !== undefined;
  const adminRing = (): KeyRing[] | null => (admin.size > 0 ? [admin] : apiGuarded() ? [api, fileKeys] : null);
  const refused = new Counter({ name: 'pdserve_auth_refused_total', help: 'Requests refused for a missing or wrong API or admin key, by access class', labelNames: ['class'], registers: [registry] });

  const rings = (cls: AccessClass): KeyRing[] | null => {
    if (cls === 'open') return null;
    if (cls === 'api') return apiGuarded() ? [api, fileKeys] : null;
    if (cls === 'metrics' && !o.privateMetrics) return null;
    return adminRing();
  };
  const deny = (request: FastifyRequest, reply: FastifyReply, cls: AccessClass, missing: boolean, adminOnly?: 'debug' | 'abort'): void => {
    refused.inc({ class: cls });
    if (adminOnly) {
      const what = adminOnly === 'debug' ? 'The /debug/* routes show every client\'s requests: they need' : 'POST /abort_request ends any client\'s request: it needs';
      void sendApiError(reply, ApiError.of('invalid_api_key', `${what} an admin API key, and none is configured (--admin-api-key or PDSERVE_ADMIN_API_KEY).`));
      return;
    }
    const what = cls === 'api' ? 'API key' : 'admin API key';
    const path = request.url.split('?')[0] ?? '';
    reply.header('www-authenticate', path === '/dashboard' || path.startsWith('/dashboard/') ? 'Basic realm="pdserve admin", charset="UTF-8"' : 'Bearer realm="pdserve"');
    // OpenAI's wording; the key itself is never echoed.
    const msg = missing ? `You didn't provide an ${what}. Send it as 'Authorization: Bearer KEY'.` : `Incorrect ${what} provided.`;
    void sendApiError(reply, ApiError.of('invalid_api_key', msg));
  };

  app.addHook('onRequest', (request, reply, done) => {
    const cls = accessClassOf(request.method, request.url);
    const need = rings(cls);
    if (!need) return done();
    // tenants must not see nor end each other's traffic: with API keys on, /debug/* and /abort_request are the admin key's alone
    if (cls === 'admin' && admin.size === 0) {
      const path = request.url.split('?')[0] ?? '';
      if (path.startsWith('/debug/')) return deny(request, reply, cls, false, 'debug');
      if (path === '/abort_request') return deny(request, reply, cls, false, 'abort');
    }
    const key = presentedKey(request.headers.authorization);
    let id: string | null = null;
    for (const r of need) id ??= r.match(key);
    if (id === null) return deny(request, reply, cls, key === null);
    (request as unknown as Keyed)[KEY_ID] = id;
    if (cls === 'api') (request as unknown as Keyed)[TENANT] = tenantOfKey(key!);
    done();
  });
  app.addHook('onClose', (_i, done) => {
    if (poll) clearInterval(poll);
    done();
  });

  return {
    get apiOpen() {
      return !apiGuarded();
    },
    describe() {
      const apiPart = apiGuarded() ? `API key required on /v1/*, /tokenize, /detokenize (${api.size} key(s)${o.apiKeyFile ? ` + key file ${o.apiKeyFile}` : ''})` : 'OPEN: no API key (anyone who reaches this port can use the API; set --api-key-file or PDSERVE_API_KEY)';
      const adminPart = admin.size > 0 ? 'admin key required on /workers, /debug/*, /dashboard, /abort_request' : apiGuarded() ? 'an API key also opens /workers and /dashboard, /debug/* and /abort_request are closed (no admin key)' : '/workers, /debug/*, /dashboard, /abort_request open';
      return `${apiPart}; ${adminPart}; /metrics ${o.privateMetrics ? 'behind the admin rule' : 'open'}; /health open`;
    },
    close() {
      if (poll) clearInterval(poll);
    },
  };
}
