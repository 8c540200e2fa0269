/**
 * n > 1 and batched prompts (a /v1/completions `prompt` that is an array of strings or of
 * token-id arrays): the request is fanned out into n × prompts single-choice generations, each
 * run in process by the server's own generation path (./generation.ts), so each choice is an
 * ordinary generation with its own PD room (router) or its own sequence (colocated): dispatch,
 * load accounting, deadlines, aborts and error handling are the ones of a single request,
 * unchanged. The request is admitted once (./admission.ts sees the client's request only). The
 * results are merged into one OpenAI response or one SSE stream.
 *
 * Choice index = prompt_index × n + i (OpenAI's order). With `seed` set, choice i of a prompt
 * uses seed + i, so seeded choices differ at temperature > 0 and are reproducible. The prompt's
 * KV is not shared through one state fanned out to n decode sequences (vLLM's parallel
 * sampling); identical prompts are routed to the same prefill by the cache-aware policy and its
 * prefix cache evaluates the prompt once (each choice's usage then reports cached_tokens).
 *
 * Usage: prompt_tokens counts each prompt once (from its first choice), completion_tokens sums
 * every choice (as vLLM and OpenAI). Streams: every chunk carries its choice index; one usage
 * chunk at the end when stream_options.include_usage; one [DONE]. A failed choice fails the
 * whole request (its OpenAI error as the response, or as an error event in a started stream) and
 * the others are aborted through their sinks' signal, which each generation handles as a client
 * abort (rooms released).
 */
import { systemClock } from '../base/clock.js';
import type { FastifyReply, FastifyRequest } from 'fastify';
import { SseError } from './sse.js';
import { randomBytes } from 'node:crypto';
import { MAX_CHOICES } from './fields.js';
import { ApiError, badRequest, sendApiError } from './errors.js';
import { SSE_DONE, usageOf, type Usage } from './respond.js';
import { asErrorCode, codeSpec, type ApiErrorType } from '../base/errors.js';
import type { ToolCall, ToolCallDelta } from './tool-calls.js';
import { callerOf, generateInProcess, HttpSink, newResponseId, type ChunkStream, type GenerationOutcome, type GenerationPort } from './generation.js';

export { MAX_CHOICES };

/** One planned choice: its body (n = 1, one prompt) and its choice index. */
export interface SubRequest {
  index: number;
  promptIndex: number;
  body: Record<string, unknown>;
}

const isTokenArray = (p: unknown): boolean => Array.isArray(p) && p.length > 0 && p.every((t) => typeof t === 'number');

/**
 * The prompts of a completions `prompt` field when it is a batch (≥ 2 strings or ≥ 2 token-id
 * arrays), else null (a single prompt, or an invalid value left to the normal parser).
 */
export function batchedPrompts(prompt: unknown): unknown[] | null {
  if (!Array.isArray(prompt) || prompt.length < 2) return null;
  if (prompt.every((p) => typeof p === 'string') || prompt.every(isTokenArray)) return prompt;
  return null;
}

/**
 * Split a request body that asks for several choices into single-choice bodies, or
 * return null when it asks for one (n absent/1 and a single prompt). Sub-bodies always stream
 * with include_usage (the merge needs each choice's usage); `n`, the batch and `stream_options`
 * are replaced, every other field is passed as is (the choice's parse validates it).
 * @throws ApiError 400 naming `n` when n × prompts exceeds MAX_CHOICES.
 */
export function planFanOut(kind: 'completion' | 'chat', body: unknown): SubRequest[] | null {
  if (body === null || typeof body !== 'object' || Array.isArray(body)) return null;
  const b = body as Record<string, unknown>;
  const n = b.n;
  const prompts = kind === 'completion' ? batchedPrompts(b.prompt) : null;
  const nChoices = typeof n === 'number' && Number.isInteger(n) && n > 1 ? n : 1;
  if (nChoices === 1 && !prompts) return null;
  const total = nChoices * (prompts?.length ?? 1);
  if (total > MAX_CHOICES) {
    throw badRequest(`Invalid value for 'n': n (${nChoices}) × prompts (${prompts?.length ?? 1}) = ${total} choices exceeds the limit of ${MAX_CHOICES}`, prompts && nChoices === 1 ? 'prompt' : 'n', 'too_many_choices');
  }
  const out: SubRequest[] = [];
  const list = prompts ?? [b.prompt];
  for (let p = 0; p < list.length; p++) {
    for (let i = 0; i < nChoices; i++) {
      const sub: Record<string, unknown> = { ...b, n: 1, stream: true, stream_options: { include_usage: true } };
      if (kind === 'completion') sub.prompt = list[p];
      if (typeof b.seed === 'number') sub.seed = b.seed + i;
      out.push({ index: p * nChoices + i, promptIndex: p, body: sub });
    }
  }
  return out;
}

/** Most merged chunks waiting for the client's stream before a choice waits for it (a bound). */
const MAX_BACKLOG = 4096;

type Chunk = { id?: string; created?: number; model?: string; choices?: { index?: number }[]; usage?: Usage | null; error?: unknown };

/**
 * Merges the single-choice streams of a fanned-out request: chunk rewriting (index, id,
 * created, model, usage: null only when the client asked for usage), usage summing, and the
 * non-stream response (choices in index order). Pure; unit-tested.
 */
export class FanOutMerger {
  private readonly usages = new Map<number, Usage>();
  private readonly promptOf = new Map<number, number>();
  private readonly parts = new Map<number, { text: string; finish: string | null; logprobs: Record<string, unknown[]> | null; content: string; calls: ToolCall[] }>();
  model: string | null = null;

  constructor(
    readonly kind: 'completion' | 'chat',
    readonly id: string,
    readonly created: number,
    readonly includeUsage: boolean,
    subs: readonly SubRequest[],
  ) {
    for (const s of subs) {
      this.promptOf.set(s.index, s.promptIndex);
      this.parts.set(s.index, { text: '', finish: null, logprobs: null, content: '', calls: [] });
    }
  }

  /**
   * One chunk of choice `index`'s stream → the chunk to forward (null for its usage-only chunk,
   * which is kept for the final sum).
   * @throws ApiError 502 for a chunk that is not an OpenAI chunk.
   */
  push(index: number, raw: Chunk): Chunk | null {
    if (!raw || typeof raw !== 'object' || !Array.isArray(raw.choices)) throw ApiError.of('bad_worker_event', `malformed chunk in choice ${index}'s stream`);
    this.model ??= typeof raw.model === 'string' ? raw.model : null;
    if (raw.usage) this.usages.set(index, raw.usage);
    if (raw.choices.length === 0) return null;
    const part = this.parts.get(index)!;
    const choices = raw.choices.map((c) => {
      const x = c as { text?: string; delta?: { content?: string; tool_calls?: ToolCallDelta[] }; finish_reason?: string | null; logprobs?: Record<string, unknown> | null };
      part.text += x.text ?? '';
      part.content += x.delta?.content ?? '';
      for (const d of x.delta?.tool_calls ?? []) {
        if (d.id) part.calls[d.index] = { id: d.id, type: 'function', function: { name: d.function.name ?? '', arguments: '' } };
        const call = part.calls[d.index];
        if (call) call.function.arguments += d.function.arguments ?? '';
      }
      if (x.finish_reason) part.finish = x.finish_reason;
      if (x.logprobs) {
        part.logprobs ??= {};
        for (const [k, v] of Object.entries(x.logprobs)) if (Array.isArray(v)) part.logprobs[k] = [...(part.logprobs[k] ?? []), ...v];
      }
      return { ...c, index };
    });
    const out: Chunk = { ...raw, id: this.id, created: this.created, choices };
    if (this.includeUsage) out.usage = null;
    else delete out.usage;
    return out;
  }

  /** Summed usage: each prompt's prompt/cached tokens once (its lowest choice index), completion tokens of every choice. */
  usage(): Usage {
    let prompt = 0;
    let cached = 0;
    let completion = 0;
    const seen = new Set<number>();
    for (const [index, u] of [...this.usages].sort((a, b) => a[0] - b[0])) {
      completion += u.completion_tokens;
      const p = this.promptOf.get(index)!;
      if (seen.has(p)) continue;
      seen.add(p);
      prompt += u.prompt_tokens;
      cached += u.prompt_tokens_details?.cached_tokens ?? 0;
    }
    return usageOf(prompt, completion, cached);
  }

  /** The final usage-only chunk. */
  usageChunk(): Chunk {
    return { id: this.id, object: this.kind === 'chat' ? 'chat.completion.chunk' : 'text_completion', created: this.created, model: this.model ?? 'pdserve', choices: [], usage: this.usage() } as Chunk;
  }

  /** The non-stream response, choices in index order. Completion logprobs' text_offset restarts at 0 per choice (each choice is its own text). */
  response(): Record<string, unknown> {
    const choices = [...this.parts].sort((a, b) => a[0] - b[0]).map(([index, p]) =>
      this.kind === 'chat'
        ? { index, message: p.calls.length > 0 ? { role: 'assistant', content: p.content === '' ? null : p.content, tool_calls: p.calls } : { role: 'assistant', content: p.content }, logprobs: p.logprobs ? { ...p.logprobs, refusal: null } : null, finish_reason: p.finish }
        : { index, text: p.text, logprobs: p.logprobs, finish_reason: p.finish },
    );
    return { id: this.id, object: this.kind === 'chat' ? 'chat.completion' : 'text_completion', created: this.created, model: this.model ?? 'pdserve', choices, usage: this.usage() };
  }
}

/**
 * The error of choice `index` whose stream ended in an OpenAI error event: its own code, the
 * code's HTTP status and type from the error table (base/errors.ts; e.g. decode_failed → 502),
 * its param; the message names the choice. A body without a string code is an internal_error.
 */
export function choiceError(index: number, error: unknown): ApiError {
  const e = (error !== null && typeof error === 'object' ? error : {}) as { message?: unknown; code?: unknown; type?: unknown; param?: unknown };
  const code = asErrorCode(e.code, 'internal_error');
  const spec = codeSpec(code);
  const type = typeof e.type === 'string' ? (e.type as ApiErrorType) : spec.type;
  return new ApiError(spec.status, code, `choice ${index} failed: ${typeof e.message === 'string' ? e.message : 'error'}`, type, typeof e.param === 'string' ? e.param : null);
}

/**
 * The `x-pdserve-path` of a fanned-out response from its choices' headers (router: pd |
 * decode_local; each choice is its own request and may take its own path): the distinct values
 * in choice order, comma-separated (an HTTP list); null when no choice has one (colocated).
 */
export function mergedPath(values: readonly unknown[]): string | null {
  const distinct = [...new Set(values.filter((v): v is string => typeof v === 'string' && v !== ''))];
  return distinct.length > 0 ? distinct.join(', ') : null;
}

/**
 * Serve a fanned-out request (see the module doc): parse every choice (an invalid one is the
 * request's 400 before anything runs), run each as an in-process generation of `port`
 * (./generation.ts), wait for all their heads (so an early failure is one plain HTTP error), then
 * merge. A stream is opened at once by a choice's keep-alive comment while the choices wait (at
 * most one comment per half of `port.streams.keepAliveMs` is passed on), and is written with the
 * server's write deadline and send-queue watch: a client reading too slowly is cut and every
 * choice aborted. Resolves when the reply is sent or the client is gone; every choice is over by then.
 * @throws ApiError (before any answer) for an invalid choice body.
 */
export async function serveFanOut<M>(request: FastifyRequest, reply: FastifyReply, kind: 'completion' | 'chat', subs: SubRequest[], port: GenerationPort<M>): Promise<FastifyReply> {
  const body = request.body as Record<string, unknown>;
  const stream = body.stream === true;
  const so = body.stream_options as { include_usage?: boolean } | null | undefined;
  const caller = callerOf(request);
  const parsed = subs.map((s) => port.parse(kind, s.body, caller));
  const prefix = kind === 'chat' ? 'chatcmpl' : 'cmpl';
  const rid = String(request.id).startsWith(`${prefix}-`) ? String(request.id) : newResponseId(kind, randomBytes(12).toString('hex'));
  const merger = new FanOutMerger(kind, rid, Math.floor(systemClock.wallMs() / 1000), stream && so?.include_usage === true, subs);
  const ac = new AbortController();
  const onClose = () => {
    if (!reply.raw.writableFinished) ac.abort();
  };
  reply.raw.on('close', onClose);
  const http = new HttpSink(reply, port.streams);
  const gapMs = (port.streams.keepAliveMs ?? 0) / 2;
  let writer: ChunkStream | null = null;
  let lastWrite = systemClock.nowMs();
  let failure: { index: number; outcome: GenerationOutcome & { ok: false } } | null = null;
  // Chunks wait for the client's stream (opened once every choice has its first event, or by a
  // keep-alive comment) in one chain, in order; a choice blocks on its chunk only once the stream
  // is open or MAX_BACKLOG chunks wait, so a choice never holds its slot waiting for another's.
  let opened!: () => void;
  const writerOpen = new Promise<void>((r) => (opened = r));
  const open = (headers: Record<string, string>): void => {
    writer ??= http.stream(headers);
    opened();
  };
  let chain: Promise<void> = Promise.resolve();
  let backlog = 0;
  const emit = (c: unknown): Promise<void> => {
    backlog++;
    lastWrite = systemClock.nowMs();
    const p = (chain = chain.then(async () => {
      await writerOpen;
      if (failure || !writer) throw new SseError('SSE_CLOSED', 'the fanned-out request is over');
      await writer.write(c);
    }));
    void p.then(() => backlog--, () => backlog--);
    return p;
  };
  const paths: unknown[] = subs.map(() => undefined);
  const heads: Promise<void>[] = [];
  const headsDone: (() => void)[] = [];
  for (let i = 0; i < subs.length; i++) heads.push(new Promise<void>((r) => headsDone.push(r)));
  const allHeads = Promise.all(heads);
  const tagOf = port.members?.(subs);
  const runs = subs.map((s, i) => {
    const member = tagOf?.(s);
    return generateInProcess(port, { parsed: parsed[i]!, rid: newResponseId(kind, randomBytes(12).toString('hex')), caller, inProcess: true, parentRid: rid, ...(member !== undefined ? { member } : {}) }, ac.signal, {
      open(headers) {
        paths[i] = headers['x-pdserve-path'];
        headsDone[i]!();
      },
      async event(chunk) {
        if (failure || ac.signal.aborted) throw new SseError('SSE_CLOSED', 'the fanned-out request is over');
        const out = merger.push(s.index, chunk as Chunk);
        if (!out || !stream) return;
        const p = emit(out);
        if (writer || backlog > MAX_BACKLOG) await p;
        else p.catch(() => {});
      },
      async comment(text) {
        // a waiting stream: the client's stream opens now (no x-pdserve-path: not known yet)
        if (!stream || (http.answered && !writer)) return;
        if (systemClock.nowMs() - lastWrite < gapMs) return;
        open({ 'x-request-id': rid });
        lastWrite = systemClock.nowMs();
        await (chain = chain.then(() => writer!.comment(text)));
      },
    }).then((outcome) => {
      headsDone[i]!();
      if (!outcome.ok && !failure && !outcome.gone) {
        failure = { index: s.index, outcome };
        ac.abort();
        opened();
      }
      return outcome;
    });
  });
  try {
    await allHeads;
    if (!failure && !ac.signal.aborted && stream && !writer) {
      const servedBy = mergedPath(paths);
      open({ 'x-request-id': rid, ...(servedBy ? { 'x-pdserve-path': servedBy } : {}) });
    }
    opened(); // no stream to open (failed, gone, not streamed): chunks still waiting are dropped
    const outcomes = await Promise.all(runs);
    await chain.catch(() => {});
    const w = writer as ChunkStream | null;
    if (reply.raw.destroyed && !w) return reply;
    const f = failure as { index: number; outcome: GenerationOutcome & { ok: false } } | null;
    if (f || outcomes.some((o) => !o.ok)) {
      const o = f?.outcome ?? (outcomes.find((x) => !x.ok) as GenerationOutcome & { ok: false });
      const index = f?.index ?? outcomes.findIndex((x) => !x.ok);
      const e = o.streamed ? choiceError(index, o.error.toBody().error) : o.error;
      if (w) {
        if (!w.closed) await w.write(e.toBody()).catch(() => {});
        w.end();
        return reply;
      }
      if (o.gone || reply.raw.destroyed) return reply;
      return sendApiError(reply, e);
    }
    if (w) {
      try {
        if (merger.includeUsage) await emit(merger.usageChunk());
        await emit(SSE_DONE);
      } catch {
        // the client is gone or was cut: nothing more to send
      }
      w.end();
      return reply;
    }
    const servedBy = mergedPath(outcomes.map((o) => o.headers['x-pdserve-path']));
    if (servedBy) void reply.header('x-pdserve-path', servedBy);
    return reply.code(200).send(merger.response());
  } finally {
    reply.raw.off('close', onClose);
    ac.abort();
    await Promise.allSettled(runs);
  }
}
