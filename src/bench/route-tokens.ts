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
 * | tokenize_cache | the chunk cache after the run (../engine/token-chunks.ts): on, hits, misses, bytes |
 *
 * `benchRouteMemory` (`--memory-sessions N`): the router's memory with N sessions' prompts held —
 * each session's own prompt (about `sessionTokens` tokens of distinct text) tokenized through the
 * chunk cache, its blocks stored on one of `workers` workers' claims (round robin) as a KV event
 * would. Heap used (after a forced GC) before and after, beside the bounds that cap it:
 *
 * | field | meaning |
 * |---|---|
 * | kv_router_max_blocks | the per-worker bound (`--kv-router-max-blocks`) |
 * | block_refs | block references kept, per worker (each ≤ the bound) |
 * | entries_without_blocks | sessions whose blocks the bound refused (kept, not matched) |
 * | tokenize_cache_max_bytes / tokenize_cache_bytes | the chunk cache's bound (`--tokenize-cache-mib`) and what it holds |
 * | router_heap_mib | the router thread's V8 heap used: before, after, added |
 * | router_bytes_per_block_ref | heap added ÷ block references kept (the index's cost per block) |
 * | tokenizer_heap_mib | the tokenizer thread's V8 heap used plus its typed arrays (the chunk cache lives there), after a full GC: before, after, added |
 */
import { Registry } from 'prom-client';
import { RouterTokenizer } from '../router/tokens.js';
import { applyKvReply, matchedBlocks, newClaims } from '../router/kv-events.js';
import { blockHashes, DEFAULT_KV_BLOCK_TOKENS } from '../protocol/token-blocks.js';
import { parseChatRequest } from '../api/parse.js';
import { summarize } from '../observe/stats.js';
import { InternalError } from '../base/errors.js';
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import { DEFAULT_ROUTER_MAX_BLOCKS } from '../protocol/kv-events.js';
import { DEFAULT_TOKENIZE_CACHE_BYTES } from '../engine/token-chunks.js';

export interface RouteTokensOptions {
  model: string;
  /** Prompt size to reach, tokens (approximately: whole sentences are added until it is reached). */
  promptTokens: number;
  iterations: number;
  blockTokens?: number;
  /** Bound of the router tokenizer's chunk cache, bytes (default DEFAULT_TOKENIZE_CACHE_BYTES). */
  cacheBytes?: number;
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
  const tok = new RouterTokenizer(o.model, { registry: new Registry(), timeoutMs: 10_000, maxPending: 4, cacheBytes: o.cacheBytes ?? DEFAULT_TOKENIZE_CACHE_BYTES });
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
    const st = await tok.stats();
    return { model: o.model, block_tokens: b, iterations: o.iterations, prompt_tokens: promptTokens, matched_blocks: matched, tokenize_ms: f(tokenize), hash_match_ms: f(hash), total_ms: f(total), tokenize_cache: { on: st.on, why: st.why, hits: st.hits, misses: st.misses, whole: st.whole, bytes: st.bytes, max_bytes: st.maxBytes } };
  } finally {
    await tok.close();
  }
}

export interface RouteMemoryOptions {
  model: string;
  sessions: number;
  /** Tokens of each session's prompt (approximately). */
  sessionTokens: number;
  workers: number;
  /** Per-worker bound of block references (`--kv-router-max-blocks`). */
  maxBlocks?: number;
  /** Bound of the chunk cache, bytes (`--tokenize-cache-mib`). */
  cacheBytes?: number;
  blockTokens?: number;
}

/** V8 heap used after a full GC, bytes (the flag is set for this process when it was not). */
function heapAfterGc(): number {
  setFlagsFromString('--expose-gc');
  const gc = runInNewContext('gc') as () => void;
  gc();
  gc();
  return process.memoryUsage().heapUsed;
}

const mib = (n: number): number => +(n / (1 << 20)).toFixed(1);

/**
 * Run the memory measurement (see the module doc): `sessions` prompts of distinct text through
 * the router's tokenizer and onto `workers` workers' claims.
 * @returns the figures printed.
 */
export async function benchRouteMemory(o: RouteMemoryOptions): Promise<Record<string, unknown>> {
  const b = o.blockTokens ?? DEFAULT_KV_BLOCK_TOKENS;
  const maxBlocks = o.maxBlocks ?? DEFAULT_ROUTER_MAX_BLOCKS;
  const cacheBytes = o.cacheBytes ?? DEFAULT_TOKENIZE_CACHE_BYTES;
  const tok = new RouterTokenizer(o.model, { registry: new Registry(), timeoutMs: 30_000, maxPending: 4, cacheBytes });
  await tok.start();
  try {
    const claims = Array.from({ length: o.workers }, () => newClaims(maxBlocks));
    for (const c of claims) applyKvReply(c, { epoch: 'e', last: 0, events: [], snapshot: [], block_tokens: b });
    // distinct text per session: words drawn by a seeded LCG, so no two sessions share chunks
    const words = ['agent', 'file', 'test', 'build', 'error', 'module', 'router', 'worker', 'token', 'cache', 'block', 'prompt', 'session', 'reply', 'tool', 'call', 'result', 'exit', 'code', 'line', 'the', 'a', 'of', 'and', 'runs', 'reads', 'fails', 'passes'];
    let seed = 12345;
    const word = (): string => {
      seed = (Math.imul(seed, 1103515245) + 12345) >>> 0;
      return words[(seed >>> 16) % words.length]!;
    };
    let chars = Math.max(16, o.sessionTokens * 4);
    const sessionText = (i: number): string => {
      let t = `Session ${i}.`;
      while (t.length < chars) t += ' ' + word();
      return t;
    };
    const chatOf = (i: number) => parseChatRequest({ model: 'm', messages: [{ role: 'system', content: sessionText(i) }, { role: 'user', content: `turn ${i}` }] });
    // characters a token in this vocabulary: one sample session sets the text length
    const sample = (await tok.tokensOf(chatOf(-1)))?.length ?? 0;
    if (sample === 0) throw new InternalError('the tokenizer gave no tokens');
    chars = Math.max(16, Math.round((chars * o.sessionTokens) / sample));
    const thread0 = (await tok.stats(true)).heapUsed;
    const heap0 = heapAfterGc();
    let tokens = 0;
    const t0 = performance.now();
    for (let i = 0; i < o.sessions; i++) {
      const t = (await tok.tokensOf(chatOf(i))) ?? [];
      if (t.length === 0) throw new InternalError(`session ${i}: the tokenizer gave no tokens`);
      tokens += t.length;
      const c = claims[i % o.workers]!;
      const hashes = blockHashes(t, b);
      applyKvReply(c, { epoch: 'e', last: c.last + 1, events: [{ id: c.last + 1, kind: 'stored', tier: 'sequence', key: `s${i}`, tokens: hashes.length * b, bytes: 0, blocks: hashes, seq_tokens: t.length, shared: false }], block_tokens: b });
    }
    const seconds = (performance.now() - t0) / 1000;
    const heap1 = heapAfterGc();
    const st = await tok.stats(true);
    const refs = claims.reduce((n, c) => n + c.refs, 0);
    return {
      model: o.model,
      sessions: o.sessions,
      session_tokens: Math.round(tokens / Math.max(1, o.sessions)),
      workers: o.workers,
      block_tokens: b,
      kv_router_max_blocks: maxBlocks,
      block_refs: claims.map((c) => c.refs),
      distinct_blocks: claims.map((c) => c.blocks.size),
      entries_without_blocks: claims.reduce((n, c) => n + c.refused, 0),
      tokenize_cache_max_bytes: cacheBytes,
      tokenize_cache_bytes: st.bytes,
      tokenize_cache_entries: st.entries,
      tokenize_cache_on: st.on,
      router_heap_mib: { before: mib(heap0), after: mib(heap1), added: mib(heap1 - heap0) },
      router_bytes_per_block_ref: refs > 0 ? Math.round((heap1 - heap0) / refs) : null,
      tokenizer_heap_mib: { before: mib(thread0), after: mib(st.heapUsed), added: mib(st.heapUsed - thread0) },
      rss_mib: mib(process.memoryUsage().rss),
      seconds: +seconds.toFixed(1),
    };
  } finally {
    await tok.close();
  }
}
