/**
 * The workers' side of signed requests (../security/request-auth.ts), as three fastify hooks
 * installed first on a worker's app (./http.ts `createWorkerApp`):
 *
 *   onRequest      the header, the window, the nonce unseen — refused before the body is read
 *   preParsing     the body's SHA-256, computed as fastify reads it
 *   preValidation  the mac over method, path, time, nonce and body digest; the nonce remembered
 *
 * Open: GET /health (supervisors, the router's probe before it knows anything) and, unless
 * `privateMetrics`, GET /metrics (Prometheus); a signature there is not required, but one that is
 * sent is checked and a wrong one refused — so a router's signed health probe fails on a worker
 * with another cluster secret, which then never enters its rotation (`isSigned`: decode trusts
 * the prefill pool in a signed probe's query only). Everything else — /generate, /abort_request,
 * /debug/*, /v1/models, /tokenize, 404s — needs a signature. A refusal is a 401 `unauthenticated`
 * OpenAI error body, counted in `pdserve_http_auth_refused_total{reason}`; its log line (debug)
 * names the reason, never the header.
 */
import { createHash, type Hash } from 'node:crypto';
import { systemClock } from '../base/clock.js';
import { Transform } from 'node:stream';
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { Counter, type Registry } from 'prom-client';
import { ApiError } from '../base/errors.js';
import { httpKeyOf, SIGNATURE_HEADER, SignatureVerifier, type RefusalReason, type Signature } from '../security/request-auth.js';
import { sendApiError } from '../api/errors.js';

export interface WorkerAuthOptions {
  /** The cluster secret. */
  secret: string;
  /** /metrics needs a signature too (default: open). */
  privateMetrics?: boolean;
  /** Validity window, ms (default SIGNATURE_WINDOW_MS). */
  windowMs?: number;
  /** Replay cache bound (default REPLAY_CACHE_ENTRIES). */
  maxNonces?: number;
}

const SIG = Symbol('pdserve.signature');
const DIGEST = Symbol('pdserve.bodyDigest');
const VERIFIED = Symbol('pdserve.signatureVerified');
type Signed = { [SIG]?: Signature; [DIGEST]?: Hash; [VERIFIED]?: boolean };

/** True when `request` carried a valid signature (on an open path too: the router's health probe). */
export function isSigned(request: FastifyRequest): boolean {
  return (request as unknown as Signed)[VERIFIED] === true;
}

const EMPTY_DIGEST = createHash('sha256').digest('hex');

/**
 * The 401 of an unsigned request says what works instead: the router's own routes (its
 * GET /debug/rooms gathers every worker's rooms, signed) or `pdserve doctor` with the secret.
 */
function missingMessage(path: string): string {
  const head = `this worker endpoint takes only requests signed with the cluster secret (${SIGNATURE_HEADER})`;
  if (path.startsWith('/debug/')) return `${head}: read every worker's rooms through the router (GET <router>/debug/rooms, with the admin key if it has one), or run \`pdserve doctor --url <router>\` with PDSERVE_CLUSTER_SECRET or --cluster-secret-file; see SECURITY.md`;
  return `${head}: send requests to the router (/v1/...), or sign them with the cluster secret as the router and \`pdserve doctor\` do; see SECURITY.md`;
}

const MESSAGES: Record<Exclude<RefusalReason, 'missing'>, string> = {
  malformed: `malformed ${SIGNATURE_HEADER} header`,
  expired: 'request signature outside its validity window (check the clocks) or too old',
  replayed: 'request signature already used (a replayed request)',
  bad_signature: 'request signature does not match (wrong cluster secret, or the request was changed)',
};

/** True for the paths a worker answers without a signature. */
function isOpen(method: string, url: string, privateMetrics: boolean): boolean {
  if (method !== 'GET' && method !== 'HEAD') return false;
  const q = url.indexOf('?');
  const path = q < 0 ? url : url.slice(0, q);
  return path === '/health' || (!privateMetrics && path === '/metrics');
}

/**
 * Install signed-request checking on a worker app (before any other hook).
 * @returns the verifier (its `size`: remembered nonces).
 */
export function registerWorkerAuth(app: FastifyInstance, o: WorkerAuthOptions, registry: Registry): SignatureVerifier {
  const verifier = new SignatureVerifier(httpKeyOf(o.secret), o.windowMs, o.maxNonces);
  const refused = new Counter({ name: 'pdserve_http_auth_refused_total', help: 'Worker HTTP requests refused for a missing, malformed, expired, replayed or wrong signature', labelNames: ['reason'], registers: [registry] });
  const deny = (request: FastifyRequest, reply: FastifyReply, reason: RefusalReason): FastifyReply => {
    refused.inc({ reason });
    request.log.debug({ reason, method: request.method, path: request.url.split('?')[0] }, 'unauthenticated worker request refused');
    const message = reason === 'missing' ? missingMessage(request.url.split('?')[0]!) : MESSAGES[reason];
    return sendApiError(reply, ApiError.of('unauthenticated', message));
  };
  app.addHook('onRequest', (request, reply, done) => {
    const open = isOpen(request.method, request.url, o.privateMetrics === true);
    // An open path is answered unsigned; a signature sent on it (the router's probe) must be right.
    if (open && request.headers[SIGNATURE_HEADER] === undefined) return done();
    const sig = verifier.precheck(request.headers[SIGNATURE_HEADER], systemClock.wallMs());
    if (typeof sig === 'string') return void deny(request, reply, sig);
    (request as unknown as Signed)[SIG] = sig;
    done();
  });
  app.addHook('preParsing', (request, _reply, payload, done) => {
    if (!(request as unknown as Signed)[SIG]) return done(null, payload);
    const hash = createHash('sha256');
    (request as unknown as Signed)[DIGEST] = hash;
    let n = 0;
    const t = new Transform({
      transform(chunk: Buffer, _enc, cb) {
        hash.update(chunk);
        n += chunk.length;
        (t as unknown as { receivedEncodedLength: number }).receivedEncodedLength = n;
        cb(null, chunk);
      },
    });
    payload.on('error', (err) => t.destroy(err));
    done(null, payload.pipe(t));
  });
  app.addHook('preValidation', (request, reply, done) => {
    const s = request as unknown as Signed;
    const sig = s[SIG];
    if (!sig) return done();
    const digest = s[DIGEST] ? s[DIGEST].digest('hex') : EMPTY_DIGEST;
    const why = verifier.verify(sig, request.method, request.url, digest, systemClock.wallMs());
    if (why) return void deny(request, reply, why);
    s[VERIFIED] = true;
    done();
  });
  return verifier;
}
