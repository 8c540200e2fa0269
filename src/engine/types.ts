/**
 * The engine seam: the only interfaces the rest of pdserve uses to reach llama.cpp.
 * Implementations live in this folder (node-llama-cpp) and nowhere else touches the library.
 *
 * Units: token ids are llama.cpp vocabulary ids (int32); sizes in bytes; times in ms.
 */
import type { ParsedState } from './ggsq.js';
import type { GpuInfo, KvCacheType } from './gpu.js';

/** Sampling settings of one request, already validated and defaulted by the API layer. */
export interface SamplingParams {
  /** 0 = greedy. */
  temperature: number;
  /** Nucleus sampling mass in (0, 1]; 1 = off. */
  topP: number;
  /** 0 = off. */
  topK: number;
  /** RNG seed for non-greedy sampling; undefined = random. */
  seed?: number;
  /** Upper bound on generated tokens, including the first one (>= 1; 0 = the rest of the context). */
  maxTokens: number;
  /** Stop strings: generation ends before the first occurrence; the stop text is not returned. */
  stop: string[];
  /** When true, EOS tokens do not end generation. */
  ignoreEos: boolean;
  /** Min-p sampling threshold in [0, 1]; 0 = off (llama.cpp min_p sampler). */
  minP?: number;
  /**
   * Repetition penalty (> 0, 1 = off; as vLLM/HF: positive logits divided, negative multiplied).
   * Its token window is the prompt plus the generated tokens when used alone, and the generated
   * tokens only when combined with presence/frequency penalties (llama.cpp has one window).
   */
  repetitionPenalty?: number;
  /** OpenAI presence penalty in [-2, 2] over the generated tokens; 0 = off. */
  presencePenalty?: number;
  /** OpenAI frequency penalty in [-2, 2] over the generated tokens; 0 = off. */
  frequencyPenalty?: number;
  /** Logit bias: [token id, value added to the logit]; -100 bans a token in practice. */
  logitBias?: [number, number][];
  /** Token ids that end generation like EOS (the stop token's text is not returned). */
  stopTokenIds?: number[];
  /** EOS, stop_token_ids and stop strings are not honoured before this many tokens (vLLM). */
  minTokens?: number;
  /** Top alternatives reported per token (0..20) with its logprob; undefined = no logprobs. */
  logprobs?: number;
  /** Prefix the first token's text with the prompt's text (completions `echo`). */
  echo?: boolean;
  /**
   * A GBNF grammar (JSON mode / JSON schema) constraining the output; both PD sides build the
   * same grammar from it, decode advances it over the first token received from prefill.
   */
  grammar?: GrammarSpec;
  /**
   * Tokens this request already generated in an earlier attempt whose client has them (the
   * router migrated it after a worker failed). `prefill` evaluates them after the prompt, one per
   * llama.cpp call as generation did, and samples the next token; every sampler state counts
   * them as generated (penalties, grammar, min_tokens, maxTokens, stop strings' text, echo), so
   * the continuation is the one an uninterrupted run gives. Never emitted again. The sequence
   * then holds prompt + these tokens.
   */
  resumed?: readonly number[];
}

/**
 * A grammar request: JSON text of any shape, JSON matching a JSON schema, or one tool call of
 * one of `functions` in the model's call syntax (`lazy`: only once the text ends with the call
 * prefix — tool_choice "auto"; else the whole output is the call — "required" / a named function).
 * A tool_call grammar's `reply` (tool_choice "auto" with a JSON response format): the output is
 * either the calls or a JSON reply of that format, never free text; `lazy` is then false.
 */
export type GrammarSpec =
  | { type: 'json' }
  | { type: 'json_schema'; schema: Record<string, unknown> }
  | { type: 'tool_call'; functions: { name: string; parameters?: Record<string, unknown> }[]; lazy: boolean; parallel?: boolean; maxCalls?: number; reply?: JsonGrammarSpec };

/** The JSON grammars (response_format json_object / json_schema, guided_json). */
export type JsonGrammarSpec = { type: 'json' } | { type: 'json_schema'; schema: Record<string, unknown> };

/** Whether a grammar starts only after the call prefix (a lazy tool_call grammar without a JSON reply). */
export function isLazyGrammar(g: GrammarSpec | undefined): boolean {
  return g?.type === 'tool_call' && g.lazy && g.reply === undefined;
}

/**
 * Default `--session-ttl-ms`: 60 s. An agent's tool call (a test run, a build, a fetch) mostly
 * returns within seconds to tens of seconds; a session quiet for longer than a minute gives way
 * to active ones (the window is soft: it orders evictions, never fails an allocation).
 */
export const DEFAULT_SESSION_TTL_MS = 60_000;

/** Longest retention window a request may ask (`agent_hints.retention_seconds`) or `--session-ttl-ms` may set: 1 h. */
export const MAX_RETENTION_MS = 3_600_000;

/** Longest generation of one JSON schema's grammar, ms, by default (`--grammar-budget-ms`; ./grammar-thread.ts): a hostile 2 KB `$defs` chain takes seconds, real schemas under 100 ms. */
export const GRAMMAR_BUDGET_MS = 2000;

/** Most JSON-schema nodes after `$ref` expansion in one request, by default (`--schema-max-nodes`; OpenAI's structured outputs allow 5,000 properties). */
export const DEFAULT_SCHEMA_MAX_NODES = 5000;
/** Most enum/const values in one request's JSON schemas, by default (`--schema-max-enum-values`; OpenAI's bound). */
export const DEFAULT_SCHEMA_MAX_ENUM_VALUES = 1000;
/** Most tool calls in one turn when a parallel tool_call grammar names no `maxCalls` (the router's and colocated's `--max-tool-calls` default). */
export const DEFAULT_MAX_TOOL_CALLS = 16;
/** Highest `--max-tool-calls`. */
export const MAX_TOOL_CALLS_LIMIT = 128;

/** A function the model may call (OpenAI `tools[].function`; parameters = a JSON schema). */
export interface ToolFunction {
  name: string;
  description?: string;
  parameters?: Record<string, unknown>;
}

/** One call in an assistant message of the history (`arguments`: JSON text). */
export interface ToolCallRecord {
  id: string;
  name: string;
  arguments: string;
}

/**
 * A chat wrapper's function-call syntax as text: a call is `prefix name paramsPrefix <JSON
 * arguments> suffix` (`{{functionName}}` in suffix = the name). `emptyParams`: the JSON text a
 * call without arguments uses ('' = nothing). From node-llama-cpp's ChatWrapper.settings.functions.
 */
export interface ToolCallSyntax {
  prefix: string;
  prefixAlternates: string[];
  paramsPrefix: string;
  suffix: string;
  emptyParams: string;
  /** Text between two calls of one turn (node-llama-cpp's `parallelism.call.betweenCalls`); null = one call per turn. */
  betweenCalls: string | null;
}

/**
 * One chat message as accepted by the OpenAI API (content already flattened to text).
 * Assistant messages may carry the calls they made; `tool` messages answer one call by id.
 */
export interface ChatMessage {
  role: 'system' | 'user' | 'assistant' | 'developer' | 'tool';
  content: string;
  toolCalls?: ToolCallRecord[];
  toolCallId?: string;
}

/** Static facts about the loaded model and context; both PD sides must agree on `compat`. */
export interface EngineInfo {
  /** Absolute path of the GGUF file. */
  modelPath: string;
  /** Name shown in /v1/models (file name without extension). */
  modelName: string;
  /** sha256 of the GGUF file, lowercase hex (64 chars). */
  fingerprint: string;
  /** Context settings that must match between the saving and the loading side. */
  compat: {
    /** Tokens per sequence. */
    contextSize: number;
    /** Prompt-evaluation chunk size in tokens (also llama.cpp batchSize). */
    batchSize: number;
    /** Number of KV layers and the per-token state size, for sanity checks. */
    nLayer: number;
    /** llama.cpp flash attention (changes the V-cache layout of a saved state). */
    flashAttention: boolean;
    /** K and V cache element type (a saved state holds the cache in this type). */
    kvCacheType: KvCacheType;
  };
  /** Number of slots: sequences of this engine's context that may be busy at once. */
  sequences: number;
  /**
   * Extra sequences of the context that only hold cached prefixes while idle (prefix cache; 0 =
   * off). The context has `sequences + cacheSequences` sequences (the n_stream of its states).
   */
  cacheSequences: number;
  /** Vocabulary size. */
  nVocab: number;
  /**
   * Longest vocabulary piece in UTF-8 bytes (an over-estimate is safe): a text of B bytes has at
   * least floor(B / maxTokenBytes) tokens, which lets a worker refuse a prompt that cannot fit
   * the context without tokenizing it (tokenizing megabytes blocks the event loop).
   */
  maxTokenBytes: number;
  /** Threads used by llama.cpp. */
  threads: number;
  /** Backend, devices and offloaded layers (gpu.ts); not part of `compat`: a state does not depend on them. */
  gpu: GpuInfo;
}

/** Outcome of a prefill: the first token and the saved sequence state. */
export interface PrefillResult {
  /** Number of prompt tokens evaluated (also the n_tokens of the saved state). */
  promptTokens: number;
  /** Leading prompt tokens whose KV came from the prefix cache and were not evaluated again. */
  cachedTokens: number;
  /** Which prefix-cache tier they came from: an idle sequence, or the host's prefix store (absent: none). */
  cacheTier?: 'sequence' | 'store';
  /** First generated token (sampled after the last prompt chunk). */
  firstToken: number;
  /** True when the first token is an end-of-generation token (EOS/EOT). */
  firstIsEog: boolean;
  /** The first token's logprob, when the request asked for logprobs. */
  firstLogprob?: TokenLogprob;
  /**
   * One first token per choice when `prefill` was asked for several (`choices` > 1): choice i
   * drawn from the same final distribution with seed + i. `choices[0]` equals the fields above.
   */
  choices: FirstToken[];
}

/** A first token sampled by prefill for one choice. */
export interface FirstToken {
  firstToken: number;
  firstIsEog: boolean;
  firstLogprob?: TokenLogprob;
}

/**
 * Log-probability of one sampled token and of the `SamplingParams.logprobs` most likely
 * alternatives, from the distribution it was sampled from (after penalties, bias, grammar,
 * temperature, top-k/top-p/min-p; natural log). `token` strings are each token's text after the
 * tokens before it (alternatives: in the sampled token's place), see ./token-text.ts: `bytes`
 * only for a token that is part of a multi-byte character (`token` is then `bytes:\xNN…`).
 */
export interface TokenLogprob {
  token: string;
  bytes?: number[];
  logprob: number;
  top: { token: string; bytes?: number[]; logprob: number }[];
}

/** One generated token as streamed to a client. */
export interface GeneratedToken {
  token: number;
  /** Text newly decodable at this step (may be '' while a multi-byte char is incomplete, or while held back as a possible stop-string prefix). */
  text: string;
  /** Present when the request asked for logprobs (never for the first token of `generate`: see PrefillResult.firstLogprob). */
  logprob?: TokenLogprob;
}

/** Why generation ended. `stop`: EOS or a stop string; `length`: maxTokens reached. */
export type FinishReason = 'stop' | 'length';

/**
 * A reserved sequence of a multi-sequence llama.cpp context ("slot", as in llama.cpp server).
 * Exactly one owner; `release()` is idempotent and must be called on every path.
 */
export interface Slot {
  readonly index: number;
  /**
   * Cached states this slot's acquisition and release evicted from the sequence tier (filled by
   * `tryAcquireSlot` and `release`; the request's trace shows them). Absent on engines without a
   * prefix cache.
   */
  readonly evicted?: readonly EvictionNote[];
  /**
   * Evaluate `tokens` in chunks of `compat.batchSize`, checking `signal` between chunks, then
   * sample the first token with `sampling`. The sampled token is NOT evaluated (the state holds
   * the prompt only), exactly as the decode side expects. With `choices` > 1 (n > 1 in PD: one
   * prefill for n decode sequences), `choices` first tokens are sampled from the one final
   * distribution, choice i with seed `sampling.seed + i` (random each when no seed), so choice i
   * equals a single request with seed + i. Greedy (temperature 0): every choice is the argmax;
   * otherwise each first token is drawn by pdserve (`drawToken`, sampling.ts) from llama.cpp's
   * final distribution, for every request, so n = 1 and n > 1 draw alike.
   * @throws AbortError-like Error with code 'ABORTED' when the signal fires between chunks.
   * @throws Error with code 'PROMPT_TOO_LONG' when tokens.length + maxTokens > contextSize,
   *   'EMPTY_PROMPT' for no tokens, 'INVALID_TOKEN' for an id outside the vocabulary.
   */
  prefill(tokens: number[], sampling: SamplingParams, signal: AbortSignal, choices?: number): Promise<PrefillResult>;
  /** Save this sequence's state (llama.cpp "ggsq" file) to `path`; returns its size in bytes. */
  saveState(path: string): Promise<number>;
  /**
   * Load a state previously validated with `parseStateFile` (ggsq.ts) into this sequence.
   * Without `parsed`, the file is read and parsed again here before llama.cpp sees it (a bad file
   * can abort the process inside llama.cpp), and a state saved from a context with another
   * sequence count is re-framed (n_stream rewritten) through a temporary file. With `parsed` —
   * the caller's full walk of exactly this file (`GgsqStreamParser` with this engine's
   * contextSize, nLayer and nVocab), and the file is the caller's to modify — the file is not read
   * again and is re-framed in place (`inPlaceReframe`: a 4-byte write and a size change), falling
   * back to the temporary file when that is impossible or another name (a hard link) shares the
   * file's data.
   * @throws PdError('BAD_STATE') when the file is malformed or its tokens differ from `promptTokens`.
   */
  loadState(path: string, promptTokens: number[], parsed?: ParsedState): Promise<void>;
  /**
   * Continue generation from `firstToken` (emitted first, then evaluated, then more sampled),
   * honouring maxTokens, stop strings and EOS. Ends on `signal` or `release()` (finish reason
   * 'abort'). An EOS/EOT token that ends generation is yielded with text '' (plus any text that
   * was held back), so token counts include it; its own text is never emitted.
   */
  generate(firstToken: number, sampling: SamplingParams, signal: AbortSignal): AsyncGenerator<GeneratedToken, FinishReason | 'abort'>;
  /**
   * The output `generate(firstToken, sampling, …)` yields first, computed without evaluating
   * anything (no llama.cpp call, the sequence is unchanged): token, text, and `end` when
   * generation ends on that token. Prefill uses it to stream the first token before the KV
   * handoff; decode then runs `generate` as usual and drops its first output (same text state).
   * @throws EngineError 'SLOT_RELEASED' / 'ENGINE_DISPOSED'.
   */
  firstOutput(firstToken: number, sampling: SamplingParams): Promise<GeneratedToken & { end?: FinishReason }>;
  /** Clear the sequence and return it to the pool. Idempotent. */
  release(): void;
}

/** One eviction of a cached state: the tier, why (prefix-cache.ts EvictionCause) and the tokens it held. */
export interface EvictionNote {
  tier: 'sequence' | 'store';
  cause: 'superseded' | 'lru' | 'ttl_pressure';
  tokens: number;
}

/**
 * How long and how firmly a request's state is kept after it ends (prefix-cache.ts retention):
 * `ttlMs` its retention window (from `agent_hints.retention_seconds`), else the session TTL when
 * `session` (the request names a session) or a `priority` is given, else none; `priority` 0–99
 * (`agent_hints.priority`, higher = kept longer inside the window).
 */
export interface Retention {
  session?: boolean;
  ttlMs?: number;
  priority?: number;
}

/** A loaded model with one multi-sequence context. */
export interface Engine {
  readonly info: EngineInfo;
  /** Tokenize plain text (special-token text is not parsed); prepends BOS when the model asks for it and `addSpecial` (default true). */
  tokenize(text: string, addSpecial?: boolean): number[];
  /** The vocabulary's raw piece of each token (as vLLM's token_strs: '<s>', byte tokens '<0x0A>'). */
  tokenPieces(tokens: number[]): string[];
  /** Render messages with the model's chat template (generic one when the GGUF has none), add the assistant prefix, tokenize. */
  renderChat(messages: ChatMessage[], tools?: readonly ToolFunction[]): number[];
  /** The chat wrapper's function-call syntax; null = tools cannot be honoured with this model. */
  readonly toolSyntax: ToolCallSyntax | null;
  detokenize(tokens: number[]): string;
  /**
   * Prepare what `sampling` needs before a slot is taken (compiles and caches its grammar).
   * @throws PdError 'BAD_GRAMMAR' when the JSON schema cannot be turned into a grammar.
   */
  prepareSampling(sampling: SamplingParams): Promise<void>;
  /** Free slots right now. */
  slotsFree(): number;
  /**
   * Reserve a free slot, or null when all are taken. With the prefix cache on and `prompt` given,
   * the idle sequence sharing the longest reusable prefix with it is chosen (its `prefill` then
   * evaluates only the rest); a cached sequence is evicted rather than ever returning null while
   * a slot is free. `salt` (here and below): the request's cache salt (its tenant, vLLM's
   * `cache_salt`): only KV left by requests of the same salt is reused, in the sequences and in
   * the prefix store; the slot's KV is then kept under that salt. `retention`: how long its KV
   * is kept once the slot is released (absent: no retention window, plain LRU).
   */
  tryAcquireSlot(prompt?: readonly number[], salt?: string, retention?: Retention): Slot | null;
  /**
   * Tokens of `prompt` the slot `tryAcquireSlot(prompt)` would reuse right now (0 with the prefix
   * cache off). A hint: another acquisition may evict that sequence before this one takes it;
   * `Slot.prefill` re-derives the reuse under its lease. Decode uses it to decide whether a
   * request's uncached suffix is short enough to evaluate locally (decode-local continuation).
   * That count includes what a sequence taken by eviction happens to share with the prompt;
   * `heldOnly` counts only an idle state the engine would give the prompt as it is (0 when the
   * acquisition would have to evict): whether a kept state is open to the prompt.
   */
  reusableFor(prompt: readonly number[], salt?: string, heldOnly?: boolean): number;
  /**
   * Tokens of `prompt` the prefix store (second tier) would serve (0 without one): a hint from
   * the store's file names and one entry's head; `Slot.prefill` loads and validates the state.
   */
  storedReusableFor?(prompt: readonly number[], salt?: string): Promise<number>;
  /** Idle sequences holding cached prefixes and their tokens in total (prefix cache). */
  cachedStats(): { sequences: number; tokens: number };
  /** Evictions since load by tier (sequence; store: this process's) and cause, with the tokens they held (0 where unknown). */
  evictionStats?(): readonly { tier: EvictionNote['tier']; cause: EvictionNote['cause']; count: number; tokens: number }[];
  /**
   * Decode steps of the context (batches node-llama-cpp sent to llama_decode with a generating or
   * prefilling sequence in them) and the sequences in them, since load; null when not counted
   * (deterministic mode, or a node-llama-cpp without the hook: src/engine/step-barrier.ts).
   */
  stepStats(): { steps: number; sequences: number } | null;
  /** The GPU backend's device memory now, bytes (zeros on CPU). */
  gpuMemory(): Promise<{ totalBytes: number; usedBytes: number }>;
  dispose(): Promise<void>;
}
