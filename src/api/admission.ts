/**
 * Admission at the OpenAI edge (router, colocated), as SGLang's gateway does it: a cap on the
 * generation requests served at once, with a bounded FIFO queue and a queue timeout, and per-key
 * limits (requests per second as a token bucket, requests at once). A refusal is a 429
 * `rate_limited` OpenAI error body with `retry-after` (seconds), counted in
 * `pdserve_admission_refused_total{reason}`; `pdserve_admission_queued` is the queue's length.
 *
 * Only POSTs under /v1/ are admitted (generation; /v1/models and the control paths are not).
 * A fanned-out request (n > 1, a prompt batch) or a /v1/responses request is admitted once, as
 * one request: its choices and its chat generation run in process (./generation.ts) and never
 * pass this hook (so n > cap cannot wait on itself).
 * Defaults never refuse a single user's normal traffic: 1024 at once, 4096 queued for 30 s, no
 * per-key limit.
 *
 * Several routers (`shared`): the per-key limits count every router's requests. Each router
 * publishes its own shard of a key — requests in flight, and requests admitted in the current
 * one-second window with that window's id — and checks the sum of its own and the others' shards
 * (shards of another window count 0; no max() merge). The global cap and queue stay per router.
 * Best effort: two admissions closer than one shard delivery (an etcd watch event) may both pass.
 */
import type { FastifyInstance, FastifyRequest } from 'fastify';
import { systemClock } from '../base/clock.js';
import { Counter, Gauge, type Registry } from 'prom-client';
import { ApiError } from '../base/errors.js';
import { keyIdOf } from './access.js';
import { sendApiError } from './errors.js';

/** One router's part of a per-key counter (see the module doc). */
export interface AdmissionShard {
  /** Requests of the key in flight through this router. */
  inflight: number;
  /** The window (wall-clock second, `Math.floor(ms / 1000)`) `admitted` counts in. */
  window: number;
  /** Requests of the key this router admitted in `window`. */
  admitted: number;
}

/** Per-key admission across routers: the other routers' shards, and publishing this router's. */
export interface SharedAdmission {
  /** Σ over the other routers' shards of `key`: in flight, and admitted in `window` (a shard of another window adds 0). */
  others(key: string, window: number): { inflight: number; admitted: number };
  /** This router's shard of `key` is now `shard` (written asynchronously; the latest wins). */
  publish(key: string, shard: AdmissionShard): void;
}

export interface AdmissionOptions {
  /** Generation requests served at once (0 = no cap). */
  maxConcurrent?: number;
  /** Requests waiting for a turn beyond the cap (0 = refuse at once when full). */
  maxQueued?: number;
  /** Longest wait in the queue, ms. */
  queueTimeoutMs?: number;
  /** Per API key (or per client when no keys): requests per second (0 = no limit), with `keyBurst` tokens of burst. */
  keyRps?: number;
  keyBurst?: number;
  /** Per API key: requests at once (0 = no limit). */
  keyMaxConcurrent?: number;
}

export { AdmissionSchema } from '../config/config.js';

export const ADMISSION_DEFAULTS = { maxConcurrent: 1024, maxQueued: 4096, queueTimeoutMs: 30_000, keyRps: 0, keyBurst: 0, keyMaxConcurrent: 0 } as const;

/** Most distinct keys tracked (the least recently seen are forgotten: a bound). */
const MAX_KEYS = 10_000;

/** A token bucket (`rate` tokens/s, at most `burst`), in ms. */
export class TokenBucket {
  private tokens: number;
  private at: number;
  constructor(
    private readonly rate: number,
    private readonly burst: number,
    now: number,
  ) {
    this.tokens = burst;
    this.at = now;
  }
  /** Take one token: 0 when taken, else the ms until one is there. */
  take(now: number): number {
    this.tokens = Math.min(this.burst, this.tokens + ((now - this.at) / 1000) * this.rate);
    this.at = now;
    if (this.tokens >= 1) {
      this.tokens -= 1;
      return 0;
    }
    return Math.ceil(((1 - this.tokens) / this.rate) * 1000);
  }
}

interface KeyState {
  bucket?: TokenBucket;
  inflight: number;
  /** With `shared`: the window this router's admissions count in, and how many. */
  window: number;
  admitted: number;
}

/**
 * Install admission on `app` (after the access hook, which sets the key id).
 * @returns the live counts, for tests and /health views.
 */
export function registerAdmission(app: FastifyInstance, raw: AdmissionOptions, registry: Registry, shared?: SharedAdmission): { readonly active: number; readonly queued: number } {
  const o = { ...ADMISSION_DEFAULTS, ...Object.fromEntries(Object.entries(raw).filter(([, v]) => v !== undefined)) } as Required<AdmissionOptions>;
  const refused = new Counter({ name: 'pdserve_admission_refused_total', help: 'Generation requests refused at the edge with 429: queue_full, queue_timeout, key_rate, key_concurrency', labelNames: ['reason'], registers: [registry] });
  const waiting: { grant(): void }[] = [];
  new Gauge({ name: 'pdserve_admission_queued', help: 'Generation requests waiting for a turn at the edge', registers: [registry], collect() { this.set(waiting.length); } });
  const keys = new Map<string, KeyState>();
  let active = 0;

  const keyOf = (request: FastifyRequest): string => keyIdOf(request) ?? `ip:${request.ip}`;
  const stateOf = (k: string): KeyState => {
    let s = keys.get(k);
    if (s) {
      keys.delete(k);
      keys.set(k, s);
      return s;
    }
    s = { inflight: 0, window: 0, admitted: 0, ...(o.keyRps > 0 ? { bucket: new TokenBucket(o.keyRps, Math.max(1, o.keyBurst || Math.ceil(o.keyRps)), systemClock.nowMs()) } : {}) };
    keys.set(k, s);
    for (const [old, st] of keys) {
      if (keys.size <= MAX_KEYS) break;
      if (st.inflight === 0) keys.delete(old);
    }
    return s;
  };
  const refuse = (reason: string, retryMs: number, message: string): ApiError => {
    refused.inc({ reason });
    return Object.assign(ApiError.of('rate_limited', message), { retryAfterS: Math.max(1, Math.ceil(retryMs / 1000)) });
  };
  const release = (): void => {
    const next = waiting.shift();
    if (next) next.grant();
    else active--;
  };

  const perKey = shared && (o.keyMaxConcurrent > 0 || o.keyRps > 0) ? shared : undefined;
  /** Publish key `k`'s shard (several routers). */
  const publish = (k: string, ks: KeyState): void => perKey?.publish(k, { inflight: ks.inflight, window: ks.window, admitted: ks.admitted });
  app.addHook('onRequest', (request, reply, done) => {
    if (request.method !== 'POST' || !request.url.startsWith('/v1/')) return done();
    const k = keyOf(request);
    const ks = stateOf(k);
    const fail = (e: ApiError & { retryAfterS?: number }): void => void sendApiError(reply.header('retry-after', String(e.retryAfterS ?? 1)), e);
    const wallMs = systemClock.wallMs();
    const window = Math.floor(wallMs / 1000);
    if (ks.window !== window) {
      ks.window = window;
      ks.admitted = 0;
    }
    const others = perKey?.others(k, window) ?? { inflight: 0, admitted: 0 };
    if (o.keyMaxConcurrent > 0 && ks.inflight + others.inflight >= o.keyMaxConcurrent) return fail(refuse('key_concurrency', 1000, `Too many requests in flight for this API key (limit ${o.keyMaxConcurrent}${perKey ? ' across the routers' : ''})`));
    if (perKey && o.keyRps > 0 && ks.admitted + others.admitted >= Math.max(o.keyRps, o.keyBurst)) return fail(refuse('key_rate', 1000 - (wallMs % 1000), `Rate limit reached for this API key (${o.keyRps} requests per second across the routers)`));
    const wait = ks.bucket?.take(systemClock.nowMs()) ?? 0;
    if (wait > 0) return fail(refuse('key_rate', wait, `Rate limit reached for this API key (${o.keyRps} requests per second)`));
    ks.inflight++;
    ks.admitted++;
    publish(k, ks);
    let released = false;
    const admitted = (): void => {
      reply.raw.once('close', () => {
        if (released) return;
        released = true;
        ks.inflight--;
        publish(k, ks);
        release();
      });
      done();
    };
    if (o.maxConcurrent === 0 || active < o.maxConcurrent) {
      active++;
      return admitted();
    }
    if (waiting.length >= o.maxQueued) {
      ks.inflight--;
      publish(k, ks);
      return fail(refuse('queue_full', 1000, `The server is at its limit of ${o.maxConcurrent} requests with ${o.maxQueued} waiting; retry later`));
    }
    // Queued: a turn (a finished request hands its slot over), the timeout, or the client gone.
    const entry = {
      grant: () => {
        clearTimeout(timer);
        reply.raw.off('close', gone);
        admitted();
      },
    };
    const leave = (): void => {
      const i = waiting.indexOf(entry);
      if (i >= 0) waiting.splice(i, 1);
      clearTimeout(timer);
      reply.raw.off('close', gone);
      ks.inflight--;
      publish(k, ks);
    };
    const timer = setTimeout(() => {
      leave();
      fail(refuse('queue_timeout', 1000, `The request waited ${o.queueTimeoutMs} ms for a turn (limit ${o.maxConcurrent} at once); retry later`));
    }, o.queueTimeoutMs);
    // The response is not started while queued: its close means the client went away.
    const gone = (): void => leave();
    reply.raw.once('close', gone);
    waiting.push(entry);
  });

  return {
    get active() {
      return active;
    },
    get queued() {
      return waiting.length;
    },
  };
}
