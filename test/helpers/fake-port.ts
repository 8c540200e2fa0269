/**
 * A generation port (src/api/generation.ts) without a model, for the callers' unit tests (fan-out,
 * admission): each generation streams one chunk (its stream's `x-pdserve-path`: `paths[seed]`,
 * default pd) and ends, or — for choice 1 when the body has `fail` — ends with an OpenAI error
 * event after it (what the router sends when decode dies mid-stream). With `keepAliveMs`, a
 * generation first waits `waitMs` writing a keep-alive comment every `keepAliveMs`, as the
 * router's SseKeepAlive does. `release()`: generations with `hold` wait until released. `slots`:
 * generations at once (the others wait for a free one, as on an engine with that many sequences).
 */
import type { GenerationPort, GenerationSink } from '../../src/api/generation.js';
import { ApiError } from '../../src/api/errors.js';
import { SSE_DONE } from '../../src/api/respond.js';
import type { ParsedRequest } from '../../src/api/parse.js';

export interface FakeBody {
  seed?: number;
  paths?: string[];
  fail?: boolean;
  /** Wait this long (ms) before the first chunk. */
  waitMs?: number;
  /** Wait for `release()` before the first chunk. */
  hold?: boolean;
  /** Chunks to stream (default 1) and the ms between them. */
  chunks?: number;
  intervalMs?: number;
  /** Refused by parse: a 400 naming `messages`. */
  invalid?: boolean;
}

export function fakePort(o: { keepAliveMs?: number; writeTimeoutMs?: number; slots?: number } = {}) {
  const held: (() => void)[] = [];
  // `slots`: generations at once, as an engine's sequences (a generation holds its slot until its stream ended)
  let free = o.slots ?? Infinity;
  const waiting: (() => void)[] = [];
  const state = { running: 0, ran: 0, aborted: 0 };
  const port: GenerationPort<never> = {
    parse(kind, body) {
      if ((body as FakeBody).invalid) throw new ApiError(400, 'invalid_request', "'messages' is required", 'invalid_request_error', 'messages');
      return { kind, stream: true, body } as unknown as ParsedRequest;
    },
    async generate(g, sink: GenerationSink) {
      const b = (g.parsed as unknown as { body: FakeBody }).body;
      while (free === 0) await new Promise<void>((r) => waiting.push(r));
      free--;
      state.running++;
      state.ran++;
      try {
        const seed = b.seed ?? 0;
        const headers = { 'x-request-id': g.rid, 'x-pdserve-path': b.paths?.[seed] ?? 'pd' };
        const until = Date.now() + (b.waitMs ?? 0);
        while (Date.now() < until && !sink.signal.aborted) {
          await new Promise((r) => setTimeout(r, Math.min(o.keepAliveMs ?? 10, until - Date.now())));
          if (o.keepAliveMs && Date.now() < until && !sink.signal.aborted) await sink.stream({ 'x-request-id': g.rid }).comment('keep-alive');
        }
        if (b.hold) await new Promise<void>((r) => held.push(r));
        if (sink.signal.aborted) {
          state.aborted++;
          return;
        }
        const w = sink.stream(headers);
        const chunk = (content: string, finish: string | null) => ({ id: g.rid, object: 'chat.completion.chunk', created: 1, model: 'm', choices: [{ index: 0, delta: { content }, finish_reason: finish }] });
        try {
          for (let i = 0; i < (b.chunks ?? 1); i++) {
            if (i > 0 && b.intervalMs) await new Promise((r) => setTimeout(r, b.intervalMs));
            await w.write(chunk('a', null));
          }
          if (seed === 1 && b.fail) {
            await w.write(ApiError.of('decode_failed', 'decode worker x failed: other side closed').toBody());
          } else {
            await w.write(chunk('', 'stop'));
            await w.write({ id: g.rid, object: 'chat.completion.chunk', created: 1, model: 'm', choices: [], usage: { prompt_tokens: 2, completion_tokens: b.chunks ?? 1, total_tokens: 2 + (b.chunks ?? 1) } });
            await w.write(SSE_DONE);
          }
        } catch {
          state.aborted++;
        } finally {
          w.end();
        }
      } finally {
        state.running--;
        free++;
        waiting.shift()?.();
      }
    },
    streams: { ...(o.keepAliveMs ? { keepAliveMs: o.keepAliveMs } : {}), ...(o.writeTimeoutMs ? { writeTimeoutMs: o.writeTimeoutMs } : {}) },
  };
  return { port, state, release: () => held.splice(0).forEach((r) => r()), held };
}
