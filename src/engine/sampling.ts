/**
 * Per-request sampler state on top of node-llama-cpp's sampler options: min-p, repetition /
 * presence / frequency penalties with their token history, logit bias, min_tokens (EOG and
 * stop-token bans), and grammars (JSON mode, JSON schema).
 *
 * PD exactness: a sampler is rebuilt for every engine call from (prompt, tokens generated so
 * far), never carried in memory. Prefill builds it from the prompt and samples the first token;
 * `generate` (colocated or on decode after the state load) builds it from the prompt plus the
 * first token — the penalty history gets the first token appended, a fresh grammar state is
 * advanced over it — so a PD run and a colocated run sample from identical sampler states.
 * (The same split as vLLM's disaggregated prefill, where decode re-derives its logits
 * processors' state from the prompt and the first token.)
 */
import { LlamaGrammarEvaluationState, TokenBias, type Llama, type LlamaGrammar, type LlamaModel, type SequenceEvaluateOptions, type Token } from 'node-llama-cpp';
import { randomInt } from 'node:crypto';
import { PdError } from '../base/errors.js';
import { DEFAULT_MAX_TOOL_CALLS, isLazyGrammar, type GrammarSpec, type SamplingParams, type TokenLogprob, type ToolCallSyntax } from './types.js';
import { JSON_OBJECT_GBNF } from './json-grammar.js';
import { BAD_GRAMMAR, GrammarThread } from './grammar-thread.js';
import { eitherGrammarText, toolCallGrammarText, triggerTexts } from './tools.js';
import type { TokenRenderer } from './token-text.js';

/** Error code thrown when a grammar cannot be built (bad JSON schema): the API maps it to 400. */
export { BAD_GRAMMAR };

/** Most distinct grammars kept compiled per engine (LRU). */
const GRAMMAR_CACHE = 32;

/**
 * Compiles and caches grammars of one llama instance: JSON schemas become GBNF text in the
 * grammar thread (./grammar-thread.ts, off the event loop, within its time budget), the text
 * becomes a grammar object here. `get` resolves to null when the spec is undefined.
 * @throws PdError BAD_GRAMMAR when node-llama-cpp rejects the schema; the grammar
 * thread's PdError as it is (schema_too_complex past the time budget, QUEUE_FULL, engine_failed).
 */
/** PdErrors of the grammar thread (time budget, queue, thread lost): `get` passes them on as they are. */
const threadErrors = new WeakSet<object>();

export class GrammarCache {
  private readonly cache = new Map<string, Promise<LlamaGrammar>>();
  /** @param toolSyntax the chat wrapper's call syntax (tool_call grammars need it; null = refused). */
  constructor(
    private readonly llama: Llama,
    private readonly toolSyntax: ToolCallSyntax | null = null,
    /** Where JSON schemas become GBNF text (closed by `close`). */
    readonly thread: GrammarThread = new GrammarThread(),
  ) {}

  /** Stop the grammar thread (the engine's dispose); later schemas fail with engine_failed. */
  close(): Promise<void> {
    return this.thread.close();
  }

  async get(spec: GrammarSpec | undefined): Promise<LlamaGrammar | null> {
    if (!spec) return null;
    const key = JSON.stringify(spec);
    let p = this.cache.get(key);
    if (p) {
      this.cache.delete(key);
      this.cache.set(key, p);
      return p;
    }
    p = this.compile(spec).catch((err: unknown) => {
      this.cache.delete(key);
      if (threadErrors.has(err as object)) throw err;
      const what = spec.type === 'tool_call' ? 'tools: a function\'s parameters schema' : 'response_format: the JSON schema';
      throw new PdError(BAD_GRAMMAR, `${what} cannot be turned into a grammar: ${(err as Error).message ?? String(err)}`);
    });
    this.cache.set(key, p);
    while (this.cache.size > GRAMMAR_CACHE) this.cache.delete(this.cache.keys().next().value as string);
    return p;
  }

  /** The grammar thread's GBNF text of a schema; its PdErrors are marked to pass `get` unwrapped. */
  private gbnf(schema: Record<string, unknown>): Promise<string> {
    return this.thread.gbnf(schema).catch((err: unknown) => {
      // the generator's refusal of the schema is the client's (get makes it BAD_GRAMMAR naming the field), the rest passes as it is
      if (err instanceof PdError && err.code !== BAD_GRAMMAR) threadErrors.add(err);
      throw err;
    });
  }

  private async compile(spec: GrammarSpec): Promise<LlamaGrammar> {
    // Both end where the JSON ends (json-grammar.ts): llama.cpp then allows only an end-of-generation token.
    if (spec.type === 'json') return this.llama.createGrammar({ grammar: JSON_OBJECT_GBNF });
    if (spec.type === 'json_schema') return this.llama.createGrammar({ grammar: await this.gbnf(spec.schema) });
    if (!this.toolSyntax) throw new PdError('engine_failed', "the model's chat wrapper has no function-call syntax");
    const calls = await toolCallGrammarText((schema) => this.gbnf(schema), this.toolSyntax, spec.functions, isLazyGrammar(spec), spec.parallel === true ? (spec.maxCalls ?? DEFAULT_MAX_TOOL_CALLS) : 1);
    if (!spec.reply) return this.llama.createGrammar({ grammar: calls });
    // The calls (from the call prefix on) or a JSON reply: whole-output, so both end where they end.
    const reply = spec.reply.type === 'json' ? JSON_OBJECT_GBNF : await this.gbnf(spec.reply.schema);
    return this.llama.createGrammar({ grammar: eitherGrammarText(calls, reply) });
  }
}

/** Advance a grammar state over a token sampled elsewhere (node-llama-cpp 3.21.1 binding; no public API). */
function acceptGrammarToken(llama: Llama, state: LlamaGrammarEvaluationState, token: number): void {
  const addon = (llama as unknown as { _bindings?: { AddonSampler?: { acceptGrammarEvaluationStateToken?: (s: unknown, t: number) => void } } })._bindings?.AddonSampler;
  const native = (state as unknown as { _state?: unknown })._state;
  if (!addon?.acceptGrammarEvaluationStateToken || native === undefined) throw new PdError('engine_failed', 'node-llama-cpp has no grammar accept binding (expected 3.21.1)');
  addon.acceptGrammarEvaluationStateToken(native, token);
}

/** Whether the grammar state allows `token` next (node-llama-cpp 3.21.1 binding; for an EOG token: whether the grammar may end here). */
function grammarAllows(llama: Llama, state: LlamaGrammarEvaluationState, token: number): boolean {
  const addon = (llama as unknown as { _bindings?: { AddonSampler?: { canBeNextTokenForGrammarEvaluationState?: (s: unknown, t: number) => boolean } } })._bindings?.AddonSampler;
  const native = (state as unknown as { _state?: unknown })._state;
  if (!addon?.canBeNextTokenForGrammarEvaluationState || native === undefined) throw new PdError('engine_failed', 'node-llama-cpp has no grammar check binding (expected 3.21.1)');
  return addon.canBeNextTokenForGrammarEvaluationState(native, token);
}

/**
 * A TokenBias holding exact logit offsets, EOG tokens included (TokenBias.set skips EOG tokens,
 * which min_tokens and logit_bias on EOS need): writes node-llama-cpp 3.21.1's `_biases` map.
 */
function biasOf(model: LlamaModel, entries: Iterable<[number, number]>): TokenBias {
  const b = new TokenBias(model.tokenizer);
  const map = (b as unknown as { _biases?: Map<number, number> })._biases;
  if (!(map instanceof Map)) throw new PdError('engine_failed', 'node-llama-cpp TokenBias has no _biases map (expected 3.21.1)');
  for (const [t, v] of entries) map.set(t, (map.get(t) ?? 0) + v);
  return b;
}

/**
 * The sampler of one engine call. `options` are passed to `LlamaContextSequence.evaluate`; its
 * functions read this object, so `accept(token)` after each sampled token keeps the penalty
 * history and the min_tokens count current.
 */
export class RequestSampler {
  /** Tokens generated so far (the first token included once accepted). */
  generated = 0;
  private readonly history: number[];
  private readonly penalizePrompt: boolean;
  private readonly bias: TokenBias | undefined;
  /** logit_bias plus -inf on EOG and stop_token_ids, while fewer than min_tokens were generated. */
  private readonly banBias: TokenBias | undefined;
  grammarState: LlamaGrammarEvaluationState | undefined;
  readonly options: SequenceEvaluateOptions;
  /** Lazy tool-call grammar: switched on when the generated text ends with one of `triggers`. */
  private readonly lazy: { grammar: LlamaGrammar; triggers: string[]; longest: number; tail: string } | undefined;

  /**
   * @param model the engine's model.
   * @param s the request's sampling settings.
   * @param prompt prompt tokens (the penalty window starts with them for repetition_penalty alone).
   * @param grammar compiled grammar of `s.grammar` (from GrammarCache), or null.
   * @param eogTokens every end-of-generation token id of the vocabulary.
   * @param toolSyntax the chat wrapper's call syntax (a lazy tool_call grammar's triggers).
   */
  constructor(
    private readonly model: LlamaModel,
    private readonly s: SamplingParams,
    prompt: readonly number[],
    grammar: LlamaGrammar | null,
    eogTokens: readonly number[],
    toolSyntax: ToolCallSyntax | null = null,
  ) {
    const rep = s.repetitionPenalty ?? 1;
    const pres = s.presencePenalty ?? 0;
    const freq = s.frequencyPenalty ?? 0;
    this.penalizePrompt = pres === 0 && freq === 0;
    this.history = this.penalizePrompt ? [...prompt] : [];
    const logit = s.logitBias ?? [];
    this.bias = logit.length > 0 ? biasOf(model, logit) : undefined;
    const minTokens = s.minTokens ?? 0;
    if (minTokens > 0) {
      const bans: [number, number][] = [...logit];
      if (!s.ignoreEos) for (const t of eogTokens) bans.push([t, -Infinity]);
      for (const t of s.stopTokenIds ?? []) bans.push([t, -Infinity]);
      this.banBias = biasOf(model, bans);
    }
    if (grammar && isLazyGrammar(s.grammar)) {
      if (!toolSyntax) throw new PdError('engine_failed', 'a lazy tool-call grammar needs the chat wrapper\'s call syntax');
      const triggers = triggerTexts(toolSyntax);
      this.lazy = { grammar, triggers, longest: Math.max(...triggers.map((t) => t.length)), tail: '' };
    } else {
      this.grammarState = grammar ? new LlamaGrammarEvaluationState({ model, grammar }) : undefined;
    }
    const opts: SequenceEvaluateOptions = {
      temperature: s.temperature,
      topK: s.topK,
      topP: s.topP,
      // node-llama-cpp would default to the current second: concurrent requests would share it.
      seed: s.seed !== undefined ? seedOf(s.seed) : randomInt(0, 0xffffffff),
      yieldEogToken: true,
    };
    if ((s.minP ?? 0) > 0) opts.minP = s.minP;
    if (rep !== 1 || pres !== 0 || freq !== 0) {
      opts.repeatPenalty = { punishTokens: () => this.history as Token[], penalty: rep, presencePenalty: pres, frequencyPenalty: freq };
    }
    if (this.bias || this.banBias) {
      const after = this.bias ?? biasOf(model, []);
      // A grammar that may end here (a complete JSON value or call) could be left with no token at
      // all with EOG banned, and llama.cpp would then fail the sequence: min_tokens yields to it.
      const grammarMayEnd = () => this.grammarState !== undefined && eogTokens.some((t) => grammarAllows(model.llama, this.grammarState!, t));
      opts.tokenBias = () => (this.banBias && this.generated < minTokens && !grammarMayEnd() ? this.banBias : after);
    }
    if (this.lazy) opts.grammarEvaluationState = () => this.grammarState;
    else if (this.grammarState) opts.grammarEvaluationState = this.grammarState;
    this.options = opts;
  }

  /**
   * Record a generated token. With `external` (a token this sampler did not sample itself, i.e.
   * the first token handed over by prefill) the grammar state is advanced too; tokens sampled
   * through `options` were already accepted by llama.cpp's sampler.
   */
  accept(token: number, external = false): void {
    this.generated++;
    this.history.push(token);
    if (this.lazy && !this.grammarState) {
      // Before the trigger the token was sampled freely; the grammar starts after the call prefix,
      // matched at a token boundary on the text so far (a pure function of the tokens: PD = colocated).
      const l = this.lazy;
      l.tail = (l.tail + this.model.detokenize([token as Token], true)).slice(-(l.longest + 1));
      if (l.triggers.some((t) => l.tail.endsWith(t))) this.grammarState = new LlamaGrammarEvaluationState({ model: this.model, grammar: l.grammar });
      return;
    }
    if (external && this.grammarState && !this.model.isEogToken(token as Token)) acceptGrammarToken(this.model.llama, this.grammarState, token);
  }
}

/**
 * The logprob of `token` and of the `top` most likely tokens of `probabilities` (node-llama-cpp's
 * sorted next-token distribution, as returned by evaluateWithMetadata({probabilities: true})),
 * every token rendered by `render` after `context` (the tokens before `token`, prompt included:
 * alternatives read as they would in its place). A probability of 0 gives -Infinity, sent as
 * -9999 (as vLLM clamps) to stay valid JSON.
 */
export function logprobOf(render: TokenRenderer, token: number, probabilities: Map<Token, number>, top: number, context: readonly number[]): TokenLogprob {
  const lp = (p: number | undefined) => (p && p > 0 ? Math.max(-9999, Math.log(p)) : -9999);
  const alts: TokenLogprob['top'] = [];
  for (const [t, p] of probabilities) {
    if (alts.length >= top) break;
    alts.push({ ...render.render(t, context), logprob: lp(p) });
  }
  return { ...render.render(token, context), logprob: lp(probabilities.get(token as Token)), top: alts };
}

/** llama.cpp's LLAMA_DEFAULT_SEED: a sampler given this u32 seed draws a random one instead. */
const LLAMA_RANDOM_SEED = 0xffffffff;

/**
 * The one seed rule of every path (prefill's first-token draw, llama.cpp's sampler on decode and
 * colocated): a request's integer `seed` (any safe integer) becomes its residue modulo
 * 2^32 − 1, in [0, 2^32 − 2] — a u32 (llama.cpp's seed type) that is never 4294967295
 * (LLAMA_DEFAULT_SEED, which llama.cpp reads as "pick a random seed"). So 4294967295 ≡ 0, and
 * consecutive seeds (n > 1: seed + i) stay distinct across the wrap.
 */
export function seedOf(seed: number): number {
  const m = LLAMA_RANDOM_SEED;
  return ((seed % m) + m) % m;
}

/**
 * Seed of choice `index` of a request with `seed` (n > 1: choice i uses seed + i, as a single
 * request with seed + i; OpenAI/vLLM give no rule, this one makes each choice reproducible on
 * its own). No seed → a random one per choice. Through `seedOf`, as every seed.
 */
export function choiceSeed(seed: number | undefined, index: number): number {
  return seed === undefined ? randomInt(0, 0xffffffff) : seedOf(seed + index);
}

/**
 * Draw one token from `probabilities` (node-llama-cpp's final next-token distribution, after
 * every sampler option) with a uniform number from `seed` (mulberry32, one step): the same seed
 * and distribution always give the same token. Used for the first token of every sampled
 * request, so that prefill can draw n first tokens from one prompt evaluation (vLLM's parallel
 * sampling also draws its n sequences' first tokens from one set of prompt logits).
 * @throws Error when the distribution is empty.
 */
export function drawToken(probabilities: Map<Token, number>, seed: number): number {
  let t = (seed + 0x6d2b79f5) >>> 0;
  t = Math.imul(t ^ (t >>> 15), t | 1);
  t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
  const u = ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  let total = 0;
  for (const p of probabilities.values()) total += p > 0 ? p : 0;
  if (!(total > 0)) throw new PdError('engine_failed', 'empty next-token distribution');
  let acc = 0;
  let last: number | undefined;
  for (const [tok, p] of probabilities) {
    if (!(p > 0)) continue;
    last = tok;
    acc += p;
    if (acc > u * total) return tok;
  }
  return last!;
}
