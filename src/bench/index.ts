/**
 * `pdserve bench`: a serving benchmark client for any OpenAI-compatible endpoint, in the manner
 * of vLLM's `bench serve` and sglang's `bench_serving`.
 *
 * Requests are streamed (`stream: true`, `stream_options.include_usage: true`) and sent on a
 * Poisson schedule (`--request-rate`, `inf` = all at once) under an optional concurrency cap.
 * Token counts come from the final usage chunk; without one, output tokens are counted as
 * non-empty chunks. Metric definitions: see bench-metrics.ts.
 *
 * Prompts come from a seeded generator: `random` (words drawn at random from the corpus
 * vocabulary) or `corpus` (contiguous windows of the shipped text, bench/corpus/alice.txt).
 * With `--tokenizer <gguf>` prompt lengths are exact in that model's tokens; without it they are
 * made exact with the target's own `/tokenize` and `/detokenize` (./tokenize.ts), and only
 * a target without them gets lengths estimated at 4 characters per token (the server's usage
 * then tells the real count).
 *
 * A second backend, `pd-direct`, drives a prefill and a decode worker with SGLang's
 * `/generate` protocol directly (what the router does), to measure the workers without it.
 */
import { newRoomId } from '../base/room-id.js';
import { readFileSync, writeFileSync, mkdirSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { performance } from 'node:perf_hooks';
import { fileURLToPath } from 'node:url';
import { randomBytes } from 'node:crypto';
import { Agent, request, type Dispatcher } from 'undici';
import { reachGlobally, registeredSigners, signGlobally } from '../security/http-auth.js';
import { internalClientOptions, loadInternalTls, type InternalTlsFiles } from '../security/tls.js';
import { readSse } from '../api/sse.js';
import { fitPrompts, RemoteTokenizer } from './tokenize.js';
import { computeMetrics, hasSlo, type BenchMetrics, type RequestRecord, type Slo } from './metrics.js';
import type { Summary } from '../observe/stats.js';

const here = dirname(fileURLToPath(import.meta.url));
/** The repository root (from src/harness or dist/harness). */
export const REPO_ROOT = resolve(here, '..', '..');
/** The corpus shipped with the project. */
export const DEFAULT_CORPUS = join(REPO_ROOT, 'bench', 'corpus', 'alice.txt');
/** Characters per token assumed when no tokenizer is given. */
export const CHARS_PER_TOKEN_ESTIMATE = 4;

// ---------------------------------------------------------------------------------- randomness

/** Seeded PRNG (mulberry32): deterministic prompts and arrival times for a given --seed. */
export class Rng {
  private s: number;
  constructor(seed: number) {
    this.s = seed >>> 0 || 0x9e3779b9;
  }
  /** Uniform in [0, 1). */
  next(): number {
    let t = (this.s = (this.s + 0x6d2b79f5) >>> 0);
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  }
  /** Uniform integer in [lo, hi]. */
  int(lo: number, hi: number): number {
    return lo + Math.floor(this.next() * (hi - lo + 1));
  }
  /** Exponential with the given rate (mean 1/rate). */
  exp(rate: number): number {
    return -Math.log(1 - this.next()) / rate;
  }
}

// ---------------------------------------------------------------------------------- tokenizer

/** Text ↔ token ids of one model, used only to make prompts of exact lengths. */
export interface BenchTokenizer {
  /** Token ids of `text`, without BOS. */
  encode(text: string): number[];
  decode(ids: number[]): string;
  /** 1 when the model prepends BOS to every prompt (it counts in prompt_tokens), else 0. */
  bos: number;
  dispose(): Promise<void>;
}

/** Load only the vocabulary of a GGUF with node-llama-cpp (no weights, no context). */
export async function loadTokenizer(ggufPath: string): Promise<BenchTokenizer> {
  const { getLlama, LlamaLogLevel } = await import('node-llama-cpp');
  const llama = await getLlama({ gpu: false, build: 'never', logLevel: LlamaLogLevel.error });
  const model = await llama.loadModel({ modelPath: resolve(ggufPath), vocabOnly: true });
  const bos = model.tokens.bos != null && model.tokens.shouldPrependBosToken ? 1 : 0;
  return {
    encode: (text) => model.tokenize(text, false) as number[],
    decode: (ids) => model.detokenize(ids as never, false),
    bos,
    dispose: () => model.dispose(),
  };
}

// ---------------------------------------------------------------------------------- prompts

/** One prompt to send. */
export interface PromptSpec {
  text: string;
  /** Prompt tokens (exact with a tokenizer, BOS included; else an estimate). */
  promptTokens: number;
  /** max_tokens of the request. */
  outputLen: number;
}

export type DatasetName = 'random' | 'corpus';

export interface PromptOptions {
  dataset: DatasetName;
  numPrompts: number;
  inputLen: number;
  outputLen: number;
  /** Lengths drawn uniformly from [L·(1−r), L·(1+r)] (0 = fixed). */
  rangeRatio?: number;
  seed: number;
  /** Corpus file (default: the shipped one). */
  corpusFile?: string;
  tokenizer?: BenchTokenizer;
}

/** The corpus text with typographic quotes and dashes folded to ASCII. */
export function loadCorpus(file = DEFAULT_CORPUS): string {
  return readFileSync(file, 'utf8')
    .replace(/[\u2018\u2019]/g, "'")
    .replace(/[\u201c\u201d]/g, '"')
    .replace(/\u2014/g, '--')
    .replace(/\r\n/g, '\n');
}

const tokenCache = new WeakMap<BenchTokenizer, Map<string, number[]>>();
function encodeCached(tok: BenchTokenizer, text: string): number[] {
  let m = tokenCache.get(tok);
  if (!m) tokenCache.set(tok, (m = new Map()));
  let ids = m.get(text);
  if (!ids) m.set(text, (ids = tok.encode(text)));
  return ids;
}

/**
 * Text of exactly `target` prompt tokens (BOS included) taken from `ids` at `offset` (wrapping
 * around), adjusting the window until re-tokenizing the decoded text gives the target count.
 * Returns the closest text found (and its count) after a few rounds.
 */
export function exactText(tok: BenchTokenizer, ids: readonly number[], offset: number, target: number): { text: string; tokens: number } {
  const want = Math.max(1, target - tok.bos);
  const slice = (k: number): number[] => {
    const out: number[] = [];
    for (let i = 0; i < k; i++) out.push(ids[(offset + i) % ids.length]!);
    return out;
  };
  let k = want;
  let best = { text: '', tokens: -1 };
  for (let round = 0; round < 8; round++) {
    const text = tok.decode(slice(k)).replace(/^\s+/, '');
    const count = tok.encode(text).length + tok.bos;
    if (best.tokens < 0 || Math.abs(count - target) < Math.abs(best.tokens - target)) best = { text, tokens: count };
    if (count === target) break;
    k = Math.max(1, k + (target - count));
  }
  return best;
}

function lengthsOf(rng: Rng, base: number, ratio: number): number {
  if (!ratio) return base;
  const lo = Math.max(1, Math.floor(base * (1 - ratio)));
  const hi = Math.max(lo, Math.ceil(base * (1 + ratio)));
  return rng.int(lo, hi);
}

/** Seeded prompts for a run (same options → same prompts). */
export function buildPrompts(o: PromptOptions): PromptSpec[] {
  const rng = new Rng(o.seed);
  const corpus = loadCorpus(o.corpusFile);
  const words = o.dataset === 'random' ? [...new Set(corpus.toLowerCase().match(/[a-z]+/g) ?? [])] : [];
  const tok = o.tokenizer;
  const corpusIds = tok && o.dataset === 'corpus' ? encodeCached(tok, corpus) : undefined;
  const out: PromptSpec[] = [];
  for (let i = 0; i < o.numPrompts; i++) {
    const inLen = lengthsOf(rng, o.inputLen, o.rangeRatio ?? 0);
    const outLen = lengthsOf(rng, o.outputLen, o.rangeRatio ?? 0);
    if (o.dataset === 'corpus') {
      if (tok && corpusIds) {
        const e = exactText(tok, corpusIds, rng.int(0, corpusIds.length - 1), inLen);
        out.push({ text: e.text, promptTokens: e.tokens, outputLen: outLen });
      } else {
        const chars = inLen * CHARS_PER_TOKEN_ESTIMATE;
        const ws = corpus.indexOf(' ', rng.int(0, Math.max(0, corpus.length - 1)));
        let pos = ws >= 0 ? ws + 1 : 0;
        let text = '';
        while (text.length < chars) {
          text += corpus.slice(pos, pos + chars - text.length);
          pos = 0;
          if (text.length < chars) text += '\n';
        }
        out.push({ text, promptTokens: inLen, outputLen: outLen });
      }
    } else {
      // random: words drawn uniformly from the corpus vocabulary
      const pick = (n: number) => Array.from({ length: n }, () => words[rng.int(0, words.length - 1)]).join(' ');
      if (tok) {
        const draft = pick(Math.ceil(inLen * 1.2) + 4);
        const e = exactText(tok, encodeCached(tok, draft), 0, inLen);
        out.push({ text: e.text, promptTokens: e.tokens, outputLen: outLen });
      } else {
        let text = '';
        while (text.length < inLen * CHARS_PER_TOKEN_ESTIMATE) text += (text ? ' ' : '') + pick(1);
        out.push({ text, promptTokens: inLen, outputLen: outLen });
      }
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------- targets

/** Where requests go. */
export type BenchTarget =
  | {
      kind: 'openai';
      /** Base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted). */
      url: string;
      endpoint: 'completions' | 'chat';
      model: string;
    }
  | {
      kind: 'pd-direct';
      /** Prefill worker HTTP URL. */
      prefillUrl: string;
      bootstrapHost: string;
      bootstrapPort: number;
      /** Decode worker HTTP URL. */
      decodeUrl: string;
    };

/** Options of one streamed request. */
export interface SendOptions {
  /** performance.now() of the run's start (record times are relative to it). */
  t0: number;
  ignoreEos?: boolean;
  timeoutMs?: number;
  dispatcher?: Dispatcher;
  /** Cancels the request (recorded as failed with the signal's reason). */
  signal?: AbortSignal;
}

function signalOf(o: SendOptions): AbortSignal {
  const t = AbortSignal.timeout(o.timeoutMs ?? 600_000);
  return o.signal ? AbortSignal.any([t, o.signal]) : t;
}

function transportError(err: unknown, o: SendOptions): string {
  if (o.signal?.aborted) return `cancelled: ${String(o.signal.reason instanceof Error ? o.signal.reason.message : (o.signal.reason ?? 'aborted'))}`;
  return `transport: ${(err as Error).message}`;
}

const JSON_HEADERS = { 'content-type': 'application/json' };

function baseUrl(u: string): string {
  return u.replace(/\/+$/, '').replace(/\/v1$/, '');
}

/** A keep-alive connection pool sized for `connections` parallel streams; requests to workers registered with `signGlobally` (a harness cluster, pd-direct) are signed. */
export function benchAgent(connections = 256): Dispatcher {
  return new Agent({ connections, pipelining: 1, keepAliveTimeout: 30_000, headersTimeout: 0, bodyTimeout: 0, connect: { timeout: 10_000 } }).compose(registeredSigners());
}

/** The model name an OpenAI endpoint serves (first of GET /v1/models), or 'default'. */
export async function discoverModel(url: string, dispatcher?: Dispatcher): Promise<string> {
  try {
    const r = await request(`${baseUrl(url)}/v1/models`, { dispatcher, signal: AbortSignal.timeout(5000) });
    const j = (await r.body.json()) as { data?: { id?: string }[] };
    return j.data?.[0]?.id ?? 'default';
  } catch {
    return 'default';
  }
}

class Collector {
  readonly rec: RequestRecord;
  private last = NaN;
  constructor(
    private readonly start: number,
    t0: number,
    prompt: PromptSpec,
  ) {
    this.rec = { ok: false, promptTokens: prompt.promptTokens, outputTokens: 0, usageReported: false, startMs: start - t0, ttftMs: NaN, e2eMs: NaN, itlMs: [], chunkAtMs: [] };
    this.t0 = t0;
  }
  private readonly t0: number;
  chunk(text: string): void {
    if (!text) return;
    const now = performance.now();
    if (Number.isNaN(this.last)) this.rec.ttftMs = now - this.start;
    else this.rec.itlMs.push(now - this.last);
    this.last = now;
    this.rec.chunkAtMs.push(now - this.t0);
  }
  finish(err?: string): RequestRecord {
    this.rec.e2eMs = performance.now() - this.start;
    if (!this.rec.usageReported) this.rec.outputTokens = this.rec.chunkAtMs.length;
    if (err) {
      this.rec.ok = false;
      this.rec.error = err;
    } else if (this.rec.chunkAtMs.length === 0 && this.rec.outputTokens === 0) {
      this.rec.ok = false;
      this.rec.error = 'no output';
    } else this.rec.ok = true;
    return this.rec;
  }
}

async function errorText(body: Dispatcher.ResponseData['body'], status: number): Promise<string> {
  const t = await body.text().catch(() => '');
  try {
    const j = JSON.parse(t) as { error?: { message?: string } };
    if (j.error?.message) return `HTTP ${status}: ${j.error.message}`;
  } catch {
    /* not JSON */
  }
  return `HTTP ${status}: ${t.slice(0, 200)}`;
}

/** Send one streamed request and record what the client saw. Never rejects. */
export async function sendRequest(target: BenchTarget, prompt: PromptSpec, o: SendOptions): Promise<RequestRecord> {
  return target.kind === 'openai' ? sendOpenAI(target, prompt, o) : sendPdDirect(target, prompt, o);
}

async function sendOpenAI(target: Extract<BenchTarget, { kind: 'openai' }>, prompt: PromptSpec, o: SendOptions): Promise<RequestRecord> {
  const chat = target.endpoint === 'chat';
  const body: Record<string, unknown> = {
    model: target.model,
    max_tokens: prompt.outputLen,
    temperature: 0,
    stream: true,
    stream_options: { include_usage: true },
    ignore_eos: o.ignoreEos ?? true,
  };
  if (chat) body.messages = [{ role: 'user', content: prompt.text }];
  else body.prompt = prompt.text;
  const url = `${baseUrl(target.url)}/v1/${chat ? 'chat/completions' : 'completions'}`;
  const start = performance.now();
  const c = new Collector(start, o.t0, prompt);
  try {
    const res = await request(url, { method: 'POST', headers: JSON_HEADERS, body: JSON.stringify(body), dispatcher: o.dispatcher, signal: signalOf(o) });
    if (res.statusCode !== 200) return c.finish(await errorText(res.body, res.statusCode));
    let done = false;
    for await (const data of readSse(res.body)) {
      if (data === '[DONE]') {
        done = true;
        continue;
      }
      let j: {
        choices?: { text?: string | null; delta?: { content?: string | null } }[];
        usage?: { prompt_tokens?: number; completion_tokens?: number; prompt_tokens_details?: { cached_tokens?: number } | null } | null;
        error?: { message?: string };
      };
      try {
        j = JSON.parse(data);
      } catch {
        continue;
      }
      if (j.error) return c.finish(`stream error: ${j.error.message ?? 'unknown'}`);
      const ch = j.choices?.[0];
      if (ch) c.chunk((chat ? ch.delta?.content : ch.text) ?? '');
      if (j.usage && Number.isInteger(j.usage.completion_tokens)) {
        c.rec.outputTokens = j.usage.completion_tokens!;
        if (Number.isInteger(j.usage.prompt_tokens)) c.rec.promptTokens = j.usage.prompt_tokens!;
        const cached = j.usage.prompt_tokens_details?.cached_tokens;
        if (Number.isInteger(cached)) c.rec.cachedTokens = cached;
        c.rec.usageReported = true;
      }
    }
    return c.finish(done ? undefined : 'stream ended without [DONE]');
  } catch (err) {
    return c.finish(transportError(err, o));
  }
}

async function sendPdDirect(target: Extract<BenchTarget, { kind: 'pd-direct' }>, prompt: PromptSpec, o: SendOptions): Promise<RequestRecord> {
  const rid = `bench-${randomBytes(8).toString('hex')}`;
  const body = JSON.stringify({
    rid,
    text: prompt.text,
    sampling_params: { temperature: 0, top_p: 1, top_k: 0, max_new_tokens: prompt.outputLen, stop: [], ignore_eos: o.ignoreEos ?? true },
    stream: true,
    // as the router does: prefill streams token 1 before the KV handoff, decode continues from token 2
    first_token_from_prefill: true,
    bootstrap_host: target.bootstrapHost,
    bootstrap_port: target.bootstrapPort,
    bootstrap_room: newRoomId(),
  });
  const signal = signalOf(o);
  const start = performance.now();
  const c = new Collector(start, o.t0, prompt);
  let firstSeen!: () => void;
  const first = new Promise<void>((r) => (firstSeen = r));
  const prefill = request(`${baseUrl(target.prefillUrl)}/generate`, { method: 'POST', headers: { ...JSON_HEADERS, accept: 'text/event-stream' }, body, dispatcher: o.dispatcher, signal })
    .then(async (r) => {
      if (r.statusCode !== 200) return errorText(r.body, r.statusCode);
      for await (const data of readSse(r.body)) {
        if (data === '[DONE]') continue;
        const j = JSON.parse(data) as { text?: string; error?: { message?: string }; transfer?: { meta_info?: { prefill_ms?: number; transfer_ms?: number; kv_bytes?: number } } };
        if (j.error) return `stream error: ${j.error.message ?? 'unknown'}`;
        const mi = j.transfer?.meta_info;
        if (mi) c.rec.server = { prefillMs: mi.prefill_ms, transferMs: mi.transfer_ms, kvBytes: mi.kv_bytes };
        else if (j.text !== undefined) {
          c.chunk(j.text); // token 1, before the handoff
          firstSeen();
        }
      }
      return undefined;
    })
    .catch((e: Error) => `prefill transport: ${e.message}`)
    .finally(() => firstSeen());
  try {
    const res = await request(`${baseUrl(target.decodeUrl)}/generate`, { method: 'POST', headers: JSON_HEADERS, body, dispatcher: o.dispatcher, signal });
    if (res.statusCode !== 200) {
      const e = await errorText(res.body, res.statusCode);
      const pe = await prefill;
      return c.finish(`decode ${e}${pe ? `; prefill ${pe}` : ''}`);
    }
    let done = false;
    for await (const data of readSse(res.body)) {
      if (data === '[DONE]') {
        done = true;
        continue;
      }
      let ev: { text?: string; error?: { message?: string }; meta_info?: { prompt_tokens?: number; cached_tokens?: number; completion_tokens?: number; finish_reason?: { type?: string; message?: string } | null } };
      try {
        ev = JSON.parse(data);
      } catch {
        continue;
      }
      if (ev.error) return c.finish(`decode stream error: ${ev.error.message ?? 'unknown'}`);
      await first; // token 1 (from prefill) is counted before decode's tokens
      c.chunk(ev.text ?? '');
      const mi = ev.meta_info;
      if (mi && Number.isInteger(mi.completion_tokens)) {
        c.rec.outputTokens = mi.completion_tokens!;
        if (Number.isInteger(mi.prompt_tokens)) c.rec.promptTokens = mi.prompt_tokens!;
        if (Number.isInteger(mi.cached_tokens)) c.rec.cachedTokens = mi.cached_tokens!;
        c.rec.usageReported = true;
      }
      if (mi?.finish_reason?.type === 'abort') return c.finish(`aborted: ${mi.finish_reason.message ?? ''}`);
    }
    const rec = c.finish(done ? undefined : 'decode stream ended without [DONE]');
    const pe = await prefill; // after finish(): E2E ends with decode's stream, as through the router
    if (pe && !rec.ok) rec.error = `${rec.error}; prefill ${pe}`;
    return rec;
  } catch (err) {
    return c.finish(transportError(err, o));
  }
}

// ---------------------------------------------------------------------------------- the run

/** Options of `runBench`. */
export interface BenchOptions {
  target: BenchTarget;
  prompts: PromptSpec[];
  /** Poisson arrival rate, req/s; Infinity = all at once. */
  requestRate: number;
  maxConcurrency?: number;
  seed: number;
  slo?: Slo;
  /** Un-recorded requests sent one by one before the run (default 1). */
  warmup?: number;
  ignoreEos?: boolean;
  timeoutMs?: number;
  /** Progress bar on stderr (default: true when stderr is a TTY). */
  progress?: boolean;
  /** Name shown on the progress line. */
  label?: string;
  dispatcher?: Dispatcher;
  /**
   * Cancel requests still running this long after the last one was sent (recorded as failed,
   * error 'cancelled: …'); default: wait for all.
   */
  drainMs?: number;
}

/** Result of `runBench`; `config` echoes the options that shaped the run. */
export interface BenchResult {
  tool: 'pdserve bench';
  date: string;
  config: {
    target: BenchTarget;
    numPrompts: number;
    requestRate: number | 'inf';
    maxConcurrency: number | null;
    seed: number;
    slo: Slo | null;
    warmup: number;
    ignoreEos: boolean;
    dataset?: string;
    inputLen?: number;
    outputLen?: number;
    rangeRatio?: number;
    tokenizer?: string | null;
  };
  metrics: BenchMetrics;
  /** Per request, in send order (vLLM's save-result fields). */
  requests: {
    inputLens: number[];
    outputLens: number[];
    ttftsMs: number[];
    e2elsMs: number[];
    itlsMs: number[][];
    startsMs: number[];
    errors: (string | null)[];
  };
  /** Raw records (not written to JSON by the CLI; used by the suite's plots). */
  records?: RequestRecord[];
}

/** A progress line on stderr: a bar on a TTY, a line per 10 % otherwise. */
export class Progress {
  private done = 0;
  private failed = 0;
  private lastDecile = -1;
  private readonly t0 = performance.now();
  private readonly tty: boolean;
  constructor(
    private readonly total: number,
    private readonly label = 'bench',
    private readonly enabled = true,
    private readonly out: NodeJS.WriteStream = process.stderr,
  ) {
    this.tty = !!out.isTTY;
  }
  /** Count one finished request. */
  tick(ok: boolean): void {
    this.done++;
    if (!ok) this.failed++;
    this.draw();
  }
  private draw(final = false): void {
    if (!this.enabled) return;
    const frac = this.total ? this.done / this.total : 1;
    const s = ((performance.now() - this.t0) / 1000).toFixed(1);
    const line = `${this.label} [${'#'.repeat(Math.round(frac * 30)).padEnd(30, '.')}] ${this.done}/${this.total}  ${s} s${this.failed ? `  ${this.failed} failed` : ''}`;
    if (this.tty) this.out.write(`\r${line}${final ? '\n' : ''}`);
    else {
      const d = Math.floor(frac * 10);
      if (d !== this.lastDecile || final) {
        this.lastDecile = d;
        if (!final || d !== 10) this.out.write(`${line}\n`);
      }
    }
  }
  /** Finish the line. */
  end(): void {
    if (this.enabled && this.tty) this.draw(true);
  }
}

function sleep(ms: number): Promise<void> {
  return new Promise((r) => setTimeout(r, Math.max(0, ms)));
}

/** Run a benchmark: warm up, send on the schedule, wait for all, compute metrics. */
export async function runBench(o: BenchOptions): Promise<BenchResult> {
  const dispatcher = o.dispatcher ?? benchAgent(Math.max(16, Math.min(1024, o.maxConcurrency ?? o.prompts.length)));
  const ownAgent = !o.dispatcher;
  const cancel = new AbortController();
  const send = (p: PromptSpec, t0: number) => sendRequest(o.target, p, { t0, ignoreEos: o.ignoreEos, timeoutMs: o.timeoutMs, dispatcher, signal: cancel.signal });
  try {
    const warm = o.warmup ?? 1;
    for (let i = 0; i < warm && o.prompts.length > 0; i++) {
      const r = await send(o.prompts[i % o.prompts.length]!, performance.now());
      if (!r.ok) throw new Error(`warm-up request failed: ${r.error}`);
    }
    const rng = new Rng(o.seed ^ 0x5eed);
    const at: number[] = [];
    let t = 0;
    for (let i = 0; i < o.prompts.length; i++) {
      at.push(t);
      if (Number.isFinite(o.requestRate) && o.requestRate > 0) t += rng.exp(o.requestRate) * 1000;
    }
    const progress = new Progress(o.prompts.length, o.label ?? 'bench', o.progress ?? !!process.stderr.isTTY);
    const limit = o.maxConcurrency && o.maxConcurrency > 0 ? o.maxConcurrency : Infinity;
    let inflight = 0;
    const waiters: (() => void)[] = [];
    const acquire = async () => {
      while (inflight >= limit) await new Promise<void>((r) => waiters.push(r));
      inflight++;
    };
    const release = () => {
      inflight--;
      waiters.shift()?.();
    };
    const t0 = performance.now();
    const records: RequestRecord[] = new Array(o.prompts.length);
    const tasks: Promise<void>[] = [];
    for (let i = 0; i < o.prompts.length; i++) {
      await sleep(t0 + at[i]! - performance.now());
      tasks.push(
        (async () => {
          await acquire();
          try {
            records[i] = await send(o.prompts[i]!, t0);
          } finally {
            release();
          }
          progress.tick(records[i]!.ok);
        })(),
      );
    }
    const all = Promise.all(tasks);
    if (o.drainMs !== undefined) {
      let timer: NodeJS.Timeout | undefined;
      const late = new Promise<void>((r) => (timer = setTimeout(r, o.drainMs)));
      await Promise.race([all, late]);
      clearTimeout(timer);
      cancel.abort(new Error(`still running ${o.drainMs} ms after the last request was sent`));
    }
    await all;
    const durationMs = performance.now() - t0;
    progress.end();
    const metrics = computeMetrics(records, durationMs, o.slo);
    return {
      tool: 'pdserve bench',
      date: new Date().toISOString(),
      config: {
        target: o.target,
        numPrompts: o.prompts.length,
        requestRate: Number.isFinite(o.requestRate) ? o.requestRate : 'inf',
        maxConcurrency: Number.isFinite(limit) ? limit : null,
        seed: o.seed,
        slo: hasSlo(o.slo) ? o.slo : null,
        warmup: warm,
        ignoreEos: o.ignoreEos ?? true,
      },
      metrics,
      requests: {
        inputLens: records.map((r) => r.promptTokens),
        outputLens: records.map((r) => r.outputTokens),
        ttftsMs: records.map((r) => r.ttftMs),
        e2elsMs: records.map((r) => r.e2eMs),
        itlsMs: records.map((r) => r.itlMs),
        startsMs: records.map((r) => r.startMs),
        errors: records.map((r) => (r.ok ? null : (r.error ?? 'failed'))),
      },
      records,
    };
  } finally {
    if (ownAgent) await (dispatcher as Agent).close().catch(() => {});
  }
}

// ---------------------------------------------------------------------------------- output

const f2 = (x: number | null | undefined) => (x == null || !Number.isFinite(x) ? 'n/a' : x.toFixed(2));

/** The result block, in the layout of vLLM's `bench serve`. */
export function formatResult(r: BenchResult): string {
  const m = r.metrics;
  const W = 50;
  const row = (k: string, v: string | number) => `${k.padEnd(40)}${String(v).padStart(10)}`;
  const head = (t: string) => {
    const pad = W - t.length - 2;
    return `${'-'.repeat(Math.floor(pad / 2))} ${t} ${'-'.repeat(Math.ceil(pad / 2))}`;
  };
  const block = (name: string, abbr: string, s: Summary) => [row(`Mean ${abbr} (ms):`, f2(s.mean)), row(`Median ${abbr} (ms):`, f2(s.median)), row(`P99 ${abbr} (ms):`, f2(s.p99))];
  const lines = [
    `${'='.repeat(12)} Serving Benchmark Result ${'='.repeat(12)}`,
    row('Successful requests:', m.completed),
    row('Failed requests:', m.failed),
    row('Maximum request concurrency:', r.config.maxConcurrency ?? 'none'),
    row('Request rate configured (req/s):', r.config.requestRate),
    row('Benchmark duration (s):', f2(m.durationS)),
    row('Total input tokens:', m.totalInputTokens),
    row('Total generated tokens:', m.totalOutputTokens),
    row('Request throughput (req/s):', f2(m.requestThroughput)),
    ...(m.goodput !== null ? [row('Request goodput (req/s):', f2(m.goodput))] : []),
    row('Input token throughput (tok/s):', f2(m.inputThroughput)),
    row('Output token throughput (tok/s):', f2(m.outputThroughput)),
    row('Total token throughput (tok/s):', f2(m.totalTokenThroughput)),
    head('Time to First Token'),
    ...block('TTFT', 'TTFT', m.ttftMs),
    head('Time per Output Token (excl. 1st token)'),
    ...block('TPOT', 'TPOT', m.tpotMs),
    head('Inter-token Latency'),
    ...block('ITL', 'ITL', m.itlMs),
    head('End-to-end Latency'),
    ...block('E2EL', 'E2EL', m.e2eMs),
    '='.repeat(W),
  ];
  const errs = r.requests.errors.filter((e): e is string => !!e);
  if (errs.length) {
    const counts = new Map<string, number>();
    for (const e of errs) counts.set(e.slice(0, 160), (counts.get(e.slice(0, 160)) ?? 0) + 1);
    lines.push('Errors:');
    for (const [e, n] of [...counts].sort((a, b) => b[1] - a[1]).slice(0, 5)) lines.push(`  ${n} × ${e}`);
  }
  return lines.join('\n');
}

/** JSON text of a result without the raw records (NaN → null). */
export function resultJson(r: BenchResult): string {
  const { records: _records, ...rest } = r;
  void _records;
  return JSON.stringify(rest, (_k, v: unknown) => (typeof v === 'number' && !Number.isFinite(v) ? null : v), 2);
}

// ---------------------------------------------------------------------------------- CLI

/** Parsed `pdserve bench` options (commander). */
export interface BenchCliOptions {
  url?: string;
  /** PEM CA of an https:// --url (default: the system store). The API key comes from PDSERVE_API_KEY. */
  ca?: string;
  /** pd-direct: internal TLS files (https:// workers asking for a client certificate). */
  internalTls?: InternalTlsFiles;
  backend: 'openai' | 'pd-direct';
  endpoint: 'completions' | 'chat';
  model?: string;
  prefill?: string;
  decode?: string;
  numPrompts: number;
  requestRate: number;
  maxConcurrency?: number;
  dataset: DatasetName;
  inputLen: number;
  outputLen: number;
  randomRangeRatio: number;
  corpus?: string;
  tokenizer?: string;
  seed: number;
  sloTtftMs?: number;
  sloTpotMs?: number;
  sloE2eMs?: number;
  warmup: number;
  ignoreEos: boolean;
  timeoutMs: number;
  json?: string;
  progress: boolean;
}

/** `pdserve bench`: build prompts, run, print the block, write --json. Returns the exit code. */
export async function benchCli(o: BenchCliOptions): Promise<number> {
  let target: BenchTarget;
  if (o.backend === 'pd-direct') {
    if (!o.prefill || !o.decode) {
      console.error('pdserve bench: --backend pd-direct needs --prefill <url,bootstrap-port> and --decode <url>');
      return 2;
    }
    const [pu, bp] = o.prefill.split(',');
    target = { kind: 'pd-direct', prefillUrl: pu!, bootstrapHost: new URL(pu!).hostname, bootstrapPort: Number(bp ?? 8998), decodeUrl: o.decode };
    // The workers take only signed requests: the cluster secret from the environment (SECURITY.md).
    const secret = process.env.PDSERVE_CLUSTER_SECRET;
    const itls = loadInternalTls(o.internalTls);
    if (secret) signGlobally([pu!, o.decode], secret, itls ? internalClientOptions(itls) : undefined);
  } else {
    if (!o.url) {
      console.error('pdserve bench: --url is required');
      return 2;
    }
    // A router with API keys (PDSERVE_API_KEY: the first key) and/or HTTPS (--ca): every request of this process to it carries them.
    const key = process.env.PDSERVE_API_KEY?.split(',')[0]?.trim();
    if (key || o.ca) reachGlobally([o.url], { ...(key ? { bearer: key } : {}), ...(o.ca ? { tls: { ca: readFileSync(o.ca) } } : {}) });
    target = { kind: 'openai', url: o.url, endpoint: o.endpoint, model: o.model ?? (await discoverModel(o.url)) };
  }
  const tokenizer = o.tokenizer ? await loadTokenizer(o.tokenizer) : undefined;
  let prompts: PromptSpec[];
  try {
    prompts = buildPrompts({ dataset: o.dataset, numPrompts: o.numPrompts, inputLen: o.inputLen, outputLen: o.outputLen, rangeRatio: o.randomRangeRatio, seed: o.seed, corpusFile: o.corpus, tokenizer });
  } finally {
    await tokenizer?.dispose();
  }
  // Without a GGUF: the target's own tokenizer makes the lengths exact (else they stay estimates).
  let lengthsBy: string | null = o.tokenizer ?? null;
  if (!tokenizer) {
    const tokenizeUrl = target.kind === 'openai' ? baseUrl(target.url) : target.prefillUrl;
    try {
      prompts = await fitPrompts(new RemoteTokenizer(tokenizeUrl), prompts);
      lengthsBy = `${tokenizeUrl}/tokenize`;
    } catch (err) {
      console.error(`pdserve bench: no exact prompt lengths (${(err as Error).message}): estimated at ${CHARS_PER_TOKEN_ESTIMATE} characters per token`);
    }
  }
  const slo: Slo = { ttftMs: o.sloTtftMs, tpotMs: o.sloTpotMs, e2eMs: o.sloE2eMs };
  const where = target.kind === 'openai' ? target.url : `${target.prefillUrl} + ${target.decodeUrl}`;
  console.error(`pdserve bench: ${o.numPrompts} prompts (${o.dataset}, input ${o.inputLen}, output ${o.outputLen}${lengthsBy ? '' : ', lengths estimated'}) → ${where} at ${Number.isFinite(o.requestRate) ? `${o.requestRate} req/s` : 'inf'}${o.maxConcurrency ? `, max concurrency ${o.maxConcurrency}` : ''}`);
  let r: BenchResult;
  try {
    r = await runBench({ target, prompts, requestRate: o.requestRate, maxConcurrency: o.maxConcurrency, seed: o.seed, slo, warmup: o.warmup, ignoreEos: o.ignoreEos, timeoutMs: o.timeoutMs, progress: o.progress });
  } catch (err) {
    console.error(`pdserve bench: ${(err as Error).message}`);
    return 1;
  }
  r.config.dataset = o.dataset;
  r.config.inputLen = o.inputLen;
  r.config.outputLen = o.outputLen;
  r.config.rangeRatio = o.randomRangeRatio;
  r.config.tokenizer = lengthsBy;
  console.log(formatResult(r));
  if (o.json) {
    mkdirSync(dirname(resolve(o.json)), { recursive: true });
    writeFileSync(o.json, resultJson(r) + '\n');
    console.error(`pdserve bench: wrote ${o.json}`);
  }
  return r.metrics.completed > 0 ? 0 : 1;
}
