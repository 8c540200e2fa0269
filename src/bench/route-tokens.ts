/**
 * `pdserve bench-route-tokens`: the router's added latency for exact routing at a long prompt —
 * tokenizing as the workers do (../router/tokens.ts: the vocabulary-only model on its thread,
 * the chat template rendered) plus hashing the token blocks and matching them against a worker's
 * block set (../router/kv-events.ts), per request, p50 / p99 / max over `iterations` requests run
 * one after another (a router's own cost, not a queue's). Prints one JSON line.
 *
 * | field | meaning |
 * |---|---|
 * | prompt_tokens | tokens of the prompt as the workers render it |
 * | tokenize_ms | the tokenizer thread's round trip (render + tokenize + transfer) |
 * | hash_match_ms | block hashes in the worker's size + the longest held run, on the event loop |
 * | total_ms | both: what the router adds before it picks |
 */
import { Registry } from 'prom-client';
import { RouterTokenizer } from '../router/tokens.js';
import { applyKvReply, matchedBlocks, newClaims } from '../router/kv-events.js';
import { blockHashes, DEFAULT_KV_BLOCK_TOKENS } from '../protocol/token-blocks.js';
import { parseChatRequest } from '../api/parse.js';
import { summarize } from '../observe/stats.js';
import { InternalError } from '../base/errors.js';

export interface RouteTokensOptions {
  model: string;
  /** Prompt size to reach, tokens (approximately: whole sentences are added until it is reached). */
  promptTokens: number;
  iterations: number;
  blockTokens?: number;
}

type Figures = { p50: number; p99: number; max: number };

/**
 * Run the measurement (see the module doc): an agent conversation of about `promptTokens` tokens
 * (a long system prompt, the task, then one turn that differs per request), its blocks matched
 * against a worker holding the previous request's.
 * @returns the figures printed.
 */
export async function benchRouteTokens(o: RouteTokensOptions): Promise<Record<string, unknown>> {
  const b = o.blockTokens ?? DEFAULT_KV_BLOCK_TOKENS;
  const tok = new RouterTokenizer(o.model, { registry: new Registry(), timeoutMs: 10_000, maxPending: 4 });
  await tok.start();
  try {
    const sentence = 'The agent reads the file, runs the tests, and reports what failed and why. ';
    const chat = (system: string, turn: number) =>
      parseChatRequest({ model: 'm', messages: [{ role: 'system', content: system }, { role: 'user', content: 'Task: fix the failing build.' }, { role: 'assistant', content: `Step ${turn}: running the tests again.` }, { role: 'user', content: `tool result ${turn}: exit code ${turn % 3}` }] });
    // grow the system prompt until the conversation has about the tokens asked for
    let system = sentence;
    let n = 0;
    for (;;) {
      n = (await tok.tokensOf(chat(system, 0)))?.length ?? 0;
      if (n === 0) throw new InternalError('the tokenizer gave no tokens');
      if (n >= o.promptTokens) break;
      system = sentence.repeat(Math.ceil((system.length / sentence.length) * Math.max(1.01, o.promptTokens / n)));
    }
    const claims = newClaims();
    const tokenize: number[] = [];
    const hash: number[] = [];
    const total: number[] = [];
    let matched = 0;
    let promptTokens = 0;
    for (let i = 0; i < o.iterations; i++) {
      const parsed = chat(system, i + 1);
      const t0 = performance.now();
      const t = (await tok.tokensOf(parsed)) ?? [];
      const t1 = performance.now();
      const hashes = blockHashes(t, b);
      matched = matchedBlocks(claims, hashes, 0);
      const t2 = performance.now();
      tokenize.push(t1 - t0);
      hash.push(t2 - t1);
      total.push(t2 - t0);
      promptTokens = t.length;
      applyKvReply(claims, { epoch: 'e', last: i, events: [], snapshot: [{ tier: 'sequence', key: 'b', tokens: hashes.length * b, bytes: 0, blocks: hashes }], block_tokens: b });
    }
    const f = (xs: number[]): Figures => {
      const st = summarize(xs);
      return { p50: +st.p50.toFixed(3), p99: +st.p99.toFixed(3), max: +st.max.toFixed(3) };
    };
    return { model: o.model, block_tokens: b, iterations: o.iterations, prompt_tokens: promptTokens, matched_blocks: matched, tokenize_ms: f(tokenize), hash_match_ms: f(hash), total_ms: f(total) };
  } finally {
    await tok.close();
  }
}
