/**
 * Test helpers: a real cluster (router + prefill + decode + colocated reference) on loopback,
 * built on the same Cluster class `pdserve up` uses, and small HTTP probes with deadlines.
 */
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import OpenAI from 'openai';
import { after, before } from 'node:test';
import { ensureModel } from '../../src/engine/gguf-writer.js';
import { Cluster, type ClusterOptions } from '../../src/up/cluster.js';
import { secureKit, secureTestMode } from './secure-mode.js';

export const CTX = 1024;

export async function tinyModel(): Promise<string> {
  return ensureModel('tiny', 1);
}

/** Start a cluster with the colocated reference; logs go to a temp folder (printed on failure). */
export async function startStack(over: Partial<ClusterOptions> = {}): Promise<Cluster> {
  const logDir = mkdtempSync(join(tmpdir(), 'pdserve-test-'));
  // Deterministic (batch-invariant) engines: greedy PD output must equal colocated output
  // token for token whatever else is running.
  const c = new Cluster({ model: await tinyModel(), prefill: 1, decode: 1, ctxSize: CTX, batchSize: 128, decodeSlots: 8, colocated: true, deterministic: true, logDir, ...secureLock(over), ...over });
  try {
    await c.start();
  } catch (err) {
    await c.stop();
    throw err;
  }
  return c;
}

/**
 * Secure test mode: the lock for a cluster started without access or TLS options of its own; its
 * certificate names every address the cluster binds (`host`, `placement`).
 */
export function secureLock(over: Partial<ClusterOptions>): Pick<ClusterOptions, 'lock'> {
  if (!secureTestMode() || over.access || over.internalTls) return {};
  return { lock: secureKit([...(over.host ? [over.host] : []), ...Object.values(over.placement ?? {}).map((p) => p.host)]) };
}

/**
 * One stack for the whole test file: started in a `before` hook, stopped in an `after` hook.
 * The returned holder is filled when `before` has run (c, the router client pd, the colocated client ref).
 */
export function useStack(over: Partial<ClusterOptions> = {}): { c: Cluster; pd: OpenAI; ref: OpenAI } {
  const h = {} as { c: Cluster; pd: OpenAI; ref: OpenAI };
  before(async () => {
    h.c = await startStack(over);
    h.pd = client(h.c.router.url);
    h.ref = client(h.c.colocated!.url);
  });
  after(async () => {
    await h.c?.stop();
  });
  return h;
}

/** The API key a test client sends: secure test mode's (./secure-mode.ts), else a placeholder the open cluster ignores. */
export function apiKey(): string {
  return secureTestMode() ? secureKit().apiKey : 'none';
}

/** The openai SDK on `baseUrl` (the router or colocated server); in secure test mode with its API key. */
export function client(baseUrl: string, timeoutMs = 30_000): OpenAI {
  return new OpenAI({ baseURL: `${baseUrl}/v1`, apiKey: apiKey(), timeout: timeoutMs, maxRetries: 0 });
}

/** GET JSON with a deadline. */
export async function getJson<T = any>(url: string, timeoutMs = 2000): Promise<T> {
  const r = await fetch(url, { signal: AbortSignal.timeout(timeoutMs) });
  if (!r.ok) throw new Error(`GET ${url}: ${r.status}`);
  return (await r.json()) as T;
}

/** Poll `fn` until it returns true or `timeoutMs` passes; returns the last value of `fn`. */
export async function waitFor(fn: () => Promise<boolean>, timeoutMs: number, stepMs = 25): Promise<boolean> {
  const end = Date.now() + timeoutMs;
  for (;;) {
    if (await fn().catch(() => false)) return true;
    if (Date.now() > end) return false;
    await new Promise((r) => setTimeout(r, stepMs));
  }
}

/** Sum of the queue and room gauges a worker reports on /health (0 when idle). */
export async function busy(workerUrl: string): Promise<number> {
  const h = await getJson<Record<string, unknown>>(`${workerUrl}/health`);
  let n = Number(h.rooms ?? 0);
  for (const [k, v] of Object.entries(h)) if (/_queue$|_running$|slots_used$/.test(k)) n += Number(v);
  return n;
}

/** Deterministic prompt text of about `n` characters (the tiny model's vocab is byte-level). */
export function promptOf(n: number, seed = 0): string {
  const words = ['the', 'river', 'ran', 'past', 'old', 'mills', 'and', 'quiet', 'farms', 'where', 'children', 'played', 'until', 'dusk', 'fell', 'over', 'hills'];
  let s = '';
  let i = seed;
  while (s.length < n) s += (s ? ' ' : '') + words[(i++ * 7 + seed) % words.length];
  return s.slice(0, Math.max(1, n));
}

/** Outcome of one raw streamed completion: HTTP status (0 = transport error), body text, duration. */
export interface RawResult {
  status: number;
  text: string;
  ms: number;
}

/** POST a streamed /v1/completions (greedy) with a deadline; never rejects. */
export async function rawCompletion(baseUrl: string, prompt: string, maxTokens = 8, timeoutMs = 15_000): Promise<RawResult> {
  const t0 = Date.now();
  try {
    const r = await fetch(`${baseUrl}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'pdserve', prompt, max_tokens: maxTokens, temperature: 0, stream: true }), signal: AbortSignal.timeout(timeoutMs) });
    return { status: r.status, text: await r.text(), ms: Date.now() - t0 };
  } catch (err) {
    return { status: 0, text: String(err), ms: Date.now() - t0 };
  }
}
