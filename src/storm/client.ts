/**
 * The storm's HTTP client: one OpenAI chat request over `node:http`, with the two ways a real
 * client goes away and a hard deadline.
 *
 * - `cancel('abort')`: the client closes its connection (what an SDK's AbortController does): FIN.
 * - `cancel('kill')`: the client process dies holding the socket: TCP RST, no FIN, no last bytes.
 * - deadline: if neither the answer nor an error arrived in time, the call ends as `hung` (the
 *   storm's hang check) and its connection is dropped.
 *
 * `node:http` rather than the `openai` package: the socket must be reachable (RST), and the CLI
 * must not depend on a dev dependency. The SSE stream is read with the project's own reader.
 * An https:// server is reached through `clientAgent`'s pool, whose TLS sockets keep their TCP
 * socket at hand (a TLSSocket cannot be reset itself: the kill resets the one below).
 */
import http from 'node:http';
import https from 'node:https';
import net, { type Socket } from 'node:net';
import tls from 'node:tls';
import { performance } from 'node:perf_hooks';
import { readSse } from '../api/sse.js';

export type CancelKind = 'abort' | 'kill';
export type CallOutcome = 'ok' | 'aborted' | 'killed' | 'failed' | 'hung';
/**
 * Where a call was when it ended: 'sending' (body not fully written), 'sent' (no response yet:
 * before the first token — the router answers a stream only at its first token), 'streaming'
 * (≥ 1 chunk received), 'done' (answer complete).
 */
export type CallPhase = 'sending' | 'sent' | 'streaming' | 'done';

/** The end of one call. Times are `performance.now()` ms. */
export interface CallResult {
  outcome: CallOutcome;
  phase: CallPhase;
  /** Error code (OpenAI body `error.code`, SSE error event code, or the socket error's code). */
  code?: string;
  status?: number;
  message?: string;
  /** The router's request id (x-request-id), when a response started. */
  rid?: string;
  text: string;
  /** Content chunks received (≈ tokens). */
  chunks: number;
  finishReason?: string;
  tStart: number;
  tFirst?: number;
  tEnd: number;
  /** Gaps between consecutive content chunks, ms. */
  itl: number[];
  /** usage.prompt_tokens_details.cached_tokens, when the server reported usage. */
  cachedTokens?: number;
  /** The router's serving path (x-pdserve-path: pd | decode_local), when it said. */
  path?: string;
}

export interface ChatMessage {
  role: 'system' | 'user' | 'assistant';
  content: string;
}

export interface CallOptions {
  /** Base URL of an OpenAI-compatible server (router or colocated), no trailing slash. */
  baseUrl: string;
  /** The pool (`clientAgent`: an https.Agent for an https:// server). */
  agent: http.Agent;
  /** Sent as `Authorization: Bearer KEY` (the router's API key). */
  apiKey?: string;
  messages: ChatMessage[];
  maxTokens: number;
  stream: boolean;
  /** The call's deadline, ms from now. */
  deadlineMs: number;
  /** Called once the request body is fully written. */
  onSent?: () => void;
  /** Called after each content chunk with the count so far. */
  onChunk?: (n: number) => void;
}

const MAX_BODY = 4 * 1024 * 1024;

/** The TCP socket under a TLS socket made by `clientAgent`'s pool. */
const RAW = Symbol('pdserve.storm.rawSocket');
type WithRaw = Socket & { [RAW]?: Socket; resetAndDestroy?: () => void };

/** https.Agent whose TLS sockets ride on a TCP socket of their own (kept under RAW). */
class ResettableTlsAgent extends https.Agent {
  override createConnection(o: tls.ConnectionOptions): Socket {
    const raw = net.connect({ host: o.host ?? 'localhost', port: Number(o.port) });
    const t = tls.connect({ ...o, socket: raw }) as WithRaw;
    t[RAW] = raw;
    return t;
  }
}

/**
 * The keep-alive pool of the storm's calls to `baseUrl`: node:http's, or for an https:// server
 * one with `ca` (PEM; default: the system store) whose sockets a kill can reset.
 */
export function clientAgent(baseUrl: string, o: { ca?: Buffer; maxSockets?: number } = {}): http.Agent {
  const base = { keepAlive: true, maxSockets: o.maxSockets ?? Infinity, keepAliveMsecs: 1000 };
  return new URL(baseUrl).protocol === 'https:' ? new ResettableTlsAgent({ ...base, ...(o.ca ? { ca: o.ca } : {}) }) : new http.Agent(base);
}

/** One chat completion request in flight. Construct it to send; await `done` (never rejects). */
export class ChatCall {
  readonly done: Promise<CallResult>;
  private phase: CallPhase = 'sending';
  private settled = false;
  private socket?: Socket;
  private readonly req: http.ClientRequest;
  private resolve!: (r: CallResult) => void;
  private readonly timer: NodeJS.Timeout;
  private readonly r: Omit<CallResult, 'outcome' | 'phase' | 'tEnd'> & { tEnd?: number };

  constructor(private readonly o: CallOptions) {
    this.done = new Promise((res) => (this.resolve = res));
    this.r = { text: '', chunks: 0, tStart: performance.now(), itl: [] };
    const body = JSON.stringify({
      model: 'pdserve',
      messages: o.messages,
      max_tokens: o.maxTokens,
      temperature: 0,
      stream: o.stream,
      ...(o.stream ? { stream_options: { include_usage: true } } : {}),
    });
    const u = new URL(`${o.baseUrl}/v1/chat/completions`);
    this.req = (u.protocol === 'https:' ? https : http).request({
      host: u.hostname,
      port: u.port,
      path: u.pathname,
      method: 'POST',
      agent: o.agent,
      headers: { 'content-type': 'application/json', 'content-length': Buffer.byteLength(body), accept: o.stream ? 'text/event-stream' : 'application/json', ...(o.apiKey ? { authorization: `Bearer ${o.apiKey}` } : {}) },
    });
    this.req.on('socket', (s) => (this.socket = s));
    this.req.on('finish', () => {
      if (this.phase === 'sending') this.phase = 'sent';
      if (!this.settled) o.onSent?.();
    });
    this.req.on('response', (res) => void this.onResponse(res));
    this.req.on('error', (err: NodeJS.ErrnoException) => this.fail(err.code ?? 'transport_error', err.message));
    this.timer = setTimeout(() => {
      this.end('hung', { code: 'client_deadline', message: `no answer and no error within ${o.deadlineMs} ms` });
      this.req.destroy();
    }, o.deadlineMs);
    this.req.end(body);
  }

  /** Where the call is now. */
  get where(): CallPhase {
    return this.phase;
  }

  get isSettled(): boolean {
    return this.settled;
  }

  /** Cancel the call the way a client does ('abort': close; 'kill': reset). No-op once settled. */
  cancel(kind: CancelKind): void {
    if (this.settled) return;
    this.end(kind === 'abort' ? 'aborted' : 'killed', {});
    if (kind === 'kill') {
      const s = ((this.socket as WithRaw | undefined)?.[RAW] ?? this.socket) as WithRaw | undefined;
      if (s && !s.destroyed && typeof s.resetAndDestroy === 'function' && s.readyState === 'open') s.resetAndDestroy();
    }
    this.req.destroy();
  }

  private fail(code: string, message: string, status?: number): void {
    this.end('failed', { code, message, status });
  }

  private end(outcome: CallOutcome, extra: Partial<CallResult>): void {
    if (this.settled) return;
    this.settled = true;
    clearTimeout(this.timer);
    this.resolve({ ...this.r, ...extra, outcome, phase: this.phase, tEnd: performance.now() });
  }

  private async onResponse(res: http.IncomingMessage): Promise<void> {
    const rid = res.headers['x-request-id'];
    if (typeof rid === 'string') this.r.rid = rid;
    const path = res.headers['x-pdserve-path'];
    if (typeof path === 'string') this.r.path = path;
    const status = res.statusCode ?? 0;
    try {
      if (status !== 200 || !this.o.stream) {
        const text = await readBody(res, MAX_BODY);
        if (this.settled) return;
        let j: { error?: { code?: unknown; message?: unknown }; choices?: { message?: { content?: unknown }; finish_reason?: unknown }[]; usage?: UsageBody } | undefined;
        try {
          j = JSON.parse(text);
        } catch {
          j = undefined;
        }
        if (status !== 200) {
          const code = typeof j?.error?.code === 'string' ? j.error.code : `http_${status}`;
          return this.fail(code, typeof j?.error?.message === 'string' ? j.error.message : text.slice(0, 300), status);
        }
        const c = j?.choices?.[0];
        if (!c || typeof c.message?.content !== 'string') return this.fail('bad_response', `unexpected body: ${text.slice(0, 200)}`, status);
        this.r.text = c.message.content;
        this.r.cachedTokens = cachedOf(j?.usage);
        this.r.tFirst = performance.now();
        this.r.finishReason = typeof c.finish_reason === 'string' ? c.finish_reason : undefined;
        this.phase = 'done';
        return this.end('ok', { status });
      }
      let last = 0;
      let finished = false;
      for await (const data of readSse(res, { maxEventBytes: 1024 * 1024 })) {
        if (this.settled) return;
        if (this.phase !== 'streaming') {
          this.phase = 'streaming';
          this.r.tFirst = performance.now();
        }
        if (data === '[DONE]') {
          if (!finished) return this.fail('done_without_finish', '[DONE] before a finish_reason', status);
          this.phase = 'done';
          return this.end('ok', { status });
        }
        let ev: { error?: { code?: unknown; message?: unknown }; choices?: { delta?: { content?: unknown }; finish_reason?: unknown }[]; usage?: UsageBody };
        try {
          ev = JSON.parse(data);
        } catch {
          return this.fail('bad_event', `event is not JSON: ${data.slice(0, 200)}`, status);
        }
        if (ev.error) {
          return this.fail(typeof ev.error.code === 'string' ? ev.error.code : 'stream_error', typeof ev.error.message === 'string' ? ev.error.message : 'error event', status);
        }
        const ch = ev.choices?.[0];
        if (!ch) {
          this.r.cachedTokens = cachedOf(ev.usage) ?? this.r.cachedTokens; // usage chunk
          continue;
        }
        const content = ch.delta?.content;
        if (typeof content === 'string' && content.length > 0) {
          const now = performance.now();
          if (this.r.chunks > 0) this.r.itl.push(now - last);
          last = now;
          this.r.chunks++;
          this.r.text += content;
          this.o.onChunk?.(this.r.chunks);
          if (this.settled) return;
        }
        if (typeof ch.finish_reason === 'string') {
          finished = true;
          this.r.finishReason = ch.finish_reason;
        }
      }
      if (!this.settled) this.fail('stream_truncated', 'the stream ended without [DONE]', status);
    } catch (err) {
      if (this.settled) return;
      const e = err as NodeJS.ErrnoException;
      this.fail(e.code ?? 'transport_error', e.message ?? String(err), status);
    }
  }
}

type UsageBody = { prompt_tokens_details?: { cached_tokens?: unknown } } | null;

/** usage.prompt_tokens_details.cached_tokens as a number, or undefined. */
function cachedOf(u: UsageBody | undefined): number | undefined {
  const c = u?.prompt_tokens_details?.cached_tokens;
  return typeof c === 'number' ? c : undefined;
}

/** Read a response body as text, at most `max` bytes (the rest is dropped). */
async function readBody(res: http.IncomingMessage, max: number): Promise<string> {
  const parts: Buffer[] = [];
  let n = 0;
  for await (const c of res as AsyncIterable<Buffer>) {
    if (n < max) parts.push(c.subarray(0, max - n));
    n += c.length;
  }
  return Buffer.concat(parts).toString('utf8');
}

/** GET JSON with a deadline; rejects on non-2xx. */
export async function getJson<T = unknown>(url: string, timeoutMs = 2000): Promise<T> {
  const r = await fetch(url, { signal: AbortSignal.timeout(timeoutMs) });
  if (!r.ok) throw new Error(`GET ${url}: HTTP ${r.status}`);
  return (await r.json()) as T;
}

/** GET text with a deadline; rejects on non-2xx. */
export async function getText(url: string, timeoutMs = 2000): Promise<string> {
  const r = await fetch(url, { signal: AbortSignal.timeout(timeoutMs) });
  if (!r.ok) throw new Error(`GET ${url}: HTTP ${r.status}`);
  return r.text();
}
