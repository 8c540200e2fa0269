/**
 * The storm's warm-up: requests sent through the router before the storm's clock starts, when a
 * watched worker runs its model on a GPU backend.
 *
 * Why: llama.cpp's GPU backends build a compute pipeline the first time each kernel variant runs
 * (Vulkan: one matrix-vector variant per batch width 1–8, the matrix-matrix tiles, flash
 * attention), and a process pays that inside the request that first needs it. On a real GPU it
 * costs milliseconds; on lavapipe (Mesa's software Vulkan device, the stand-in GPU of CI) each
 * variant is compiled by LLVM: seconds, and minutes under load, with Mesa's shader disk cache
 * keeping it for later processes. Inside the storm's window that compilation shows up as
 * requests past their deadline and a prefill slot held past the settle by an evaluation still
 * running, not as what the storm checks. llama.cpp's own server warms up at start the same way
 * (`--warmup`, on by default).
 *
 * What: rounds of `decode slots × decodes` short prompts at once, `maxTokens` staggered so each decode's
 * batch narrows one sequence at a time from its full width to 1 (every batch width of the
 * generation step), each prompt also run through prefill, the KV handoff and its state load.
 */
import http from 'node:http';
import { ChatCall } from './client.js';

/** What the warm-up did: rounds sent, requests in the last round, answered ok in it, and how long it all took (ms). */
export interface WarmupResult {
  rounds: number;
  requests: number;
  ok: number;
  ms: number;
  /** The first error of a failed request in the last round (`outcome: code message`), if any. */
  error?: string;
}

/**
 * Send warm-up rounds through `baseUrl` (a router or a colocated server) until one round is
 * answered ok in full or `budgetMs` is spent: a round cut by the router's request deadline
 * while a pipeline compiles is sent again (the compilation goes on in the worker, and what it
 * built stays built).
 * @param o.requests concurrent requests per round (e.g. decode slots × decode workers).
 * @param o.width sequences per decode batch to narrow from (decode slots); request i gets
 *   `2 + (i % width)` tokens.
 * @param o.deadlineMs deadline of each request (ms).
 * @param o.budgetMs no round starts after this much time (ms).
 * Never throws: failures are reported (a storm still runs after a failed warm-up).
 */
export async function warmUp(baseUrl: string, o: { requests: number; width: number; deadlineMs: number; budgetMs: number }): Promise<WarmupResult> {
  const t0 = performance.now();
  const agent = new http.Agent({ keepAlive: true, maxSockets: Math.max(1, o.requests) });
  const res: WarmupResult = { rounds: 0, requests: o.requests, ok: 0, ms: 0 };
  try {
    while (res.rounds === 0 || (res.ok < o.requests && performance.now() - t0 < o.budgetMs)) {
      res.rounds++;
      const calls = Array.from({ length: o.requests }, (_, i) =>
        new ChatCall({
          baseUrl,
          agent,
          messages: [{ role: 'user', content: `Warm-up ${res.rounds}.${i}: tell me a short story about a lighthouse.` }],
          maxTokens: 2 + (i % Math.max(1, o.width)),
          stream: true,
          deadlineMs: o.deadlineMs,
        }).done,
      );
      const results = await Promise.all(calls);
      res.ok = results.filter((r) => r.outcome === 'ok').length;
      const bad = results.find((r) => r.outcome !== 'ok');
      if (bad) res.error = `${bad.outcome}: ${bad.code ?? ''} ${bad.message ?? ''}`.trim();
      else delete res.error;
    }
  } finally {
    agent.destroy();
  }
  res.ms = Math.round(performance.now() - t0);
  return res;
}
