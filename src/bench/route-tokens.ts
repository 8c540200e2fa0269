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

export interface RouteTokensOptions {
  model: string;
  /** Prompt size to reach, tokens (approximately: whole sentences are added until it is reached). */
  promptTokens: number;
  iterations: number;
  blockTokens?: number;
}

/** Run the measurement (see the module doc). @returns the figures printed. */
export async function benchRouteTokens(o: RouteTokensOptions): Promise<Record<string, number | string>> {
  const tok = new RouterTokenizer(o.model, { registry: new Registry(), timeoutMs: 10_000, maxPending: 4 });
  await tok.start();
  try {
    const b = o.blockTokens ?? DEFAULT_KV_BLOCK_TOKENS;
    const sentence = 'The agent reads the file, runs the tests, and reports what failed and why. ';
    // grow the system prompt until the rendered prompt has the tokens asked for
    let system = sentence;
    let tokens: number[] = [];
    for (;;) {
      const parsed = parseChatRequest({ model: 'm', messages: [{ role: 'system', content: system }, { role: 'user', content: 'Fix the build.' }] });
      tokens = (await tok.tokensOf(parsed)) ?? [];
      if (tokens.length === 0) return { error: 'the tokenizer gave no tokens' };
      if (tokens.length >= o.promptTokens) break;
      system = system.repeat(Math.max(2, Math.ceil(o.promptTokens / tokens.length)));
      if (system.length > 64 << 20) return { error: 'the prompt cannot reach the size asked' };
    }
    // trim to about the size asked (whole sentences)
    while (system.length > sentence.length && tokens.length > o.promptTokens * 1.05) {
      system = system.slice(0, Math.floor(system.length * 0.97 / sentence.length) * sentence.length);
      tokens = (await tok.tokensOf(parseChatRequest({ model: 'm', messages: [{ role: 'system', content: system }, { role: 'user', content: 'Fix the build.' }] }))) ?? [];
    }
    // a worker holding all but the last blocks of the prompt (a continuation's case: the longest run to find)
    const claims = newClaims();
    const held = blockHashes(tokens, b);
    applyKvReply(claims, { epoch: 'e', last: 0, events: [], snapshot: [{ tier: 'sequence', key: 'b', tokens: held.length * b, bytes: 0, blocks: held.slice(0, -2) }], block_tokens: b });
    const parsed = parseChatRequest({ model: 'm', messages: [{ role: 'system', content: system }, { role: 'user', content: 'Fix the build.' }] });
    const tokenize: number[] = [];
    const hash: number[] = [];
    const total: number[] = [];
    let matched = 0;
    for (let i = 0; i < o.iterations; i++) {
      const t0 = performance.now();
      const t = await tok.tokensOf(parsed);
      const t1 = performance.now();
      matched = matchedBlocks(claims, blockHashes(t ?? [], b), 0);
      const t2 = performance.now();
      tokenize.push(t1 - t0);
      hash.push(t2 - t1);
      total.push(t2 - t0);
    }
    const f = (xs: number[]) => {
      const st = summarize(xs);
      return { p50: +st.p50.toFixed(3), p99: +st.p99.toFixed(3), max: +st.max.toFixed(3) };
    };
    const r = { model: o.model, prompt_tokens: tokens.length, block_tokens: b, matched_blocks: matched, iterations: o.iterations, tokenize_ms: f(tokenize), hash_match_ms: f(hash), total_ms: f(total) };
    return r as unknown as Record<string, number | string>;
  } finally {
    await tok.close();
  }
}
