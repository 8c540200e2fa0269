/**
 * Exact prompt lengths with the target's own tokenizer, over HTTP: vLLM's `POST /tokenize`
 * (`{prompt, add_special_tokens}` → `{count, tokens}`) and `POST /detokenize` (`{tokens}` →
 * `{prompt}`), which the pdserve router, colocated server and prefill workers serve (vLLM and
 * SGLang serve the same shapes). `pdserve bench` uses it when no `--tokenizer <gguf>` is given,
 * so `--input-len 64` sends 64 prompt tokens whatever the model's characters per token (the
 * built-in tiny model's vocabulary is byte-level: ≈1.2 characters per token, not 4).
 */
import { request, type Dispatcher } from 'undici';

/** What is fitted: a prompt's text and its wanted length in tokens (bench.ts's PromptSpec). */
export interface Prompt {
  text: string;
  promptTokens: number;
}

/** Deadline of one /tokenize or /detokenize call, ms. */
const CALL_TIMEOUT_MS = 10_000;
/** Fitting rounds per prompt (each: one detokenize + one tokenize). */
const ROUNDS = 8;
/** Times a too-short draft is doubled before giving up on the exact length. */
const GROWTH = 4;

/** The target's tokenizer: the base URL that serves /tokenize and /detokenize. */
export class RemoteTokenizer {
  private bosCount: number | null = null;

  constructor(
    readonly baseUrl: string,
    private readonly dispatcher?: Dispatcher,
  ) {}

  private async post<T>(path: string, body: unknown): Promise<T> {
    const r = await request(`${this.baseUrl}${path}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body), dispatcher: this.dispatcher, signal: AbortSignal.timeout(CALL_TIMEOUT_MS) });
    const text = await r.body.text();
    if (r.statusCode !== 200) throw new Error(`${this.baseUrl}${path}: HTTP ${r.statusCode}: ${text.slice(0, 200)}`);
    return JSON.parse(text) as T;
  }

  /** Token ids of `text`; with `special`, as a completions prompt is counted (BOS included). */
  async encode(text: string, special: boolean): Promise<number[]> {
    return (await this.post<{ tokens: number[] }>('/tokenize', { prompt: text, add_special_tokens: special })).tokens;
  }

  async decode(ids: number[]): Promise<string> {
    return (await this.post<{ prompt: string }>('/detokenize', { tokens: ids })).prompt;
  }

  /** 1 when the model prepends BOS to a prompt (it counts in prompt_tokens), else 0. */
  async bos(): Promise<number> {
    this.bosCount ??= Math.max(0, (await this.encode('a', true)).length - (await this.encode('a', false)).length);
    return this.bosCount;
  }

  /**
   * `p` with its text cut to exactly `p.promptTokens` tokens (BOS included) as the target counts
   * a completions prompt: the draft is tokenized, a window of its first ids decoded and counted
   * again, the window moved by the difference, for at most 8 rounds; the closest text found is
   * returned with its true count. A draft too short for the target is doubled (≤ 4 times).
   * @throws Error when the target has no /tokenize (HTTP status and body in the message).
   */
  async fit<P extends Prompt>(p: P): Promise<P> {
    const target = p.promptTokens;
    const bos = await this.bos();
    let draft = p.text;
    let ids = await this.encode(draft, false);
    for (let g = 0; g < GROWTH && ids.length < target - bos; g++) ids = await this.encode((draft = `${draft} ${draft}`), false);
    let k = Math.min(ids.length, Math.max(1, target - bos));
    let best = { text: draft, tokens: ids.length + bos };
    for (let round = 0; round < ROUNDS; round++) {
      const text = (await this.decode(ids.slice(0, k))).replace(/^\s+/, '');
      const count = (await this.encode(text, true)).length;
      if (round === 0 || Math.abs(count - target) < Math.abs(best.tokens - target)) best = { text, tokens: count };
      if (count === target) break;
      const next = Math.min(ids.length, Math.max(1, k + (target - count)));
      if (next === k) break;
      k = next;
    }
    return { ...p, text: best.text, promptTokens: best.tokens };
  }
}

/** Every prompt fitted by `tok` (sequentially: a few round trips each, milliseconds on loopback). */
export async function fitPrompts<P extends Prompt>(tok: RemoteTokenizer, prompts: readonly P[]): Promise<P[]> {
  const out: P[] = [];
  for (const p of prompts) out.push(await tok.fit(p));
  return out;
}
