/**
 * The storm's agents: each runs multi-round chat conversations through the router, appending
 * the previous answer and a new user turn every round (prompts grow as an agent's do, then
 * slide within the context budget), and misbehaves the way real clients do:
 *
 * - abort (rate `abortRate`): closes the connection right after sending, after a random delay
 *   (before or around the first token), or after k streamed chunks; then retries the round;
 * - kill (rate `killRate`): resets the connection at one of the same moments, as a dying process
 *   would, and restarts with a new conversation;
 * - bursts (`Agents.burst()`): every agent with a request in flight cancels it at once.
 *
 * Every request has a deadline; a request with neither answer nor error by then is `hung`.
 */
import http from 'node:http';
import { Prng } from '../base/prng.js';
import { ChatCall, clientAgent, type CallResult, type CancelKind, type ChatMessage } from './client.js';
import type { Corpus } from '../up/corpus.js';

/** How an agent meant to end a request (decided before sending). */
export type Plan = 'none' | `${CancelKind}:${'send' | 'delay' | 'tokens'}`;

/** One finished request as the storm records it. */
export interface RequestRecord {
  agent: number;
  conv: number;
  round: number;
  stream: boolean;
  plan: Plan;
  /** Cancelled by a burst (all agents at once). */
  burst: boolean;
  promptBytes: number;
  maxTokens: number;
  result: CallResult;
}

/** A completed round kept for the wrong-answer check. */
export interface SampledRound {
  agent: number;
  conv: number;
  round: number;
  messages: ChatMessage[];
  maxTokens: number;
  text: string;
  rid?: string;
  /** Prompt tokens the server took from a prefix cache for this round (undefined: not reported). */
  cachedTokens?: number;
  /** Serving path the router reported (x-pdserve-path: pd | decode_local), when it did. */
  path?: string;
  /** The router migrated the round mid-answer (its trace has an `attempt_failed` event with `next: 'migrate'`). */
  migrated?: boolean;
}

/** The wrong-answer check's reservoirs: one per serving path, migrated rounds apart from all. */
export interface SamplePools {
  migrated: SampledRound[];
  local: SampledRound[];
  cached: SampledRound[];
  plain: SampledRound[];
}

/**
 * The rounds the wrong-answer check compares (at most `k`): migrated rounds first, up to half of
 * `k` (a migrated answer is the one most likely to be wrong, and faults make few); of the rest,
 * up to a third from the decode-local rounds, up to half of what is left from the other rounds
 * answered with cached prefix tokens (the reuse paths must be checked even when they are rare),
 * the rest from the plain rounds. A pool with too few rounds leaves its share to the next.
 */
export function chooseSample(p: SamplePools, k: number): SampledRound[] {
  const others = p.local.length + p.cached.length + p.plain.length;
  const m = p.migrated.slice(0, Math.max(Math.ceil(k / 2), k - others));
  const r = k - m.length;
  const l = p.local.slice(0, Math.max(Math.ceil(r / 3), r - p.cached.length - p.plain.length));
  const c = p.cached.slice(0, Math.max(Math.ceil((r - l.length) / 2), r - l.length - p.plain.length));
  return [...m, ...l, ...c, ...p.plain.slice(0, r - l.length - c.length)];
}

export interface AgentsOptions {
  baseUrl: string;
  /** The router's API key (`Authorization: Bearer`), when it has keys. */
  apiKey?: string;
  /** PEM CA of an https:// router (default: the system store). */
  ca?: Buffer;
  agents: number;
  rounds: number;
  seed: number;
  corpus: Corpus;
  /** Tokens per sequence of the cluster (prompt + answer must fit). */
  ctxSize: number;
  maxTokens: number;
  abortRate: number;
  killRate: number;
  /** Share of requests sent without streaming. */
  nonStreamRate: number;
  requestTimeoutMs: number;
  /** Max think time between rounds, ms (uniform in [0, thinkMs]). */
  thinkMs: number;
  /** Rounds kept (reservoir sample) for the wrong-answer check. */
  sampleSize: number;
  /** Called for every finished request (the storm's accounting). */
  onRecord(rec: RequestRecord): void;
  /**
   * Whether the router migrated the completed round with response id `rid` (undefined: unknown);
   * asked once per completed round when set. Must settle within its own deadline.
   */
  migratedOf?(rid: string): Promise<boolean | undefined>;
  /** Called when a request hangs (for the rooms snapshot). */
  onHang?(rec: RequestRecord): void;
}

const SYSTEM_PROMPTS = [
  'You are a careful assistant. Answer briefly and stay on the passage the user quotes.',
  'You are a patient reading tutor. Explain each passage in plain words.',
  'You are an engineer reviewing documentation. Point out what each quoted part means.',
  'You are a storyteller. Continue each passage in the same voice.',
];
const ASKS = [
  'Summarize this passage in one sentence:',
  'Continue this text:',
  'What is the point of the following?',
  'Explain this part, please:',
  'Here is more of it. What changes?',
  'Read this and tell me what happens next:',
  'Rewrite this in simpler words:',
];

/** Per-message template overhead assumed by the context budget, bytes (≈ tokens). */
const TEMPLATE_BYTES_PER_MESSAGE = 40;
const TEMPLATE_BYTES_FIXED = 64;

interface AgentState {
  id: number;
  rng: Prng;
  conv: number;
  round: number;
  messages: ChatMessage[];
  call?: ChatCall;
  burst: boolean;
  failures: number;
}

/** Running estimate of a latency (EWMA), for choosing cancel moments that land in each phase. */
class Estimate {
  constructor(private v: number) {}
  add(x: number): void {
    this.v = 0.9 * this.v + 0.1 * x;
  }
  get value(): number {
    return this.v;
  }
}

/** A population of agents; `run()` resolves when every agent has stopped after `stop()`. */
export class Agents {
  /** The wrong-answer check's reservoirs (`chooseSample`) and how many rounds each has seen. */
  private readonly sampled: SamplePools = { migrated: [], local: [], cached: [], plain: [] };
  private readonly seen: Record<keyof SamplePools, number> = { migrated: 0, local: 0, cached: 0, plain: 0 };
  /** `migratedOf` look-ups not settled yet. */
  private readonly looking = new Set<Promise<void>>();
  private stopping = false;
  private wake = new Set<() => void>();
  private readonly agent: http.Agent;
  private readonly states: AgentState[] = [];
  private readonly sampleRng: Prng;
  private readonly ttft = new Estimate(100);
  private readonly e2e = new Estimate(400);
  /** Conversations started (first rounds), restarted after a kill, and finished (all rounds). */
  readonly conversations = { started: 0, restarted: 0, finished: 0 };

  constructor(private readonly o: AgentsOptions) {
    this.agent = clientAgent(o.baseUrl, { ...(o.ca ? { ca: o.ca } : {}) });
    this.sampleRng = new Prng(o.seed * 31 + 7);
    for (let i = 0; i < o.agents; i++) this.states.push({ id: i, rng: new Prng(o.seed * 7919 + i + 1), conv: 0, round: 0, messages: [], burst: false, failures: 0 });
  }

  /** Requests in flight now. */
  get inFlight(): number {
    return this.states.filter((s) => s.call && !s.call.isSettled).length;
  }

  /** Run every agent until `stop()`; each finishes its request in flight (bounded by its deadline). */
  async run(): Promise<void> {
    await Promise.all(this.states.map((s) => this.loop(s)));
    this.agent.destroy();
  }

  /** Stop starting requests; requests in flight run to their end. */
  stop(): void {
    this.stopping = true;
    for (const w of this.wake) w();
  }

  /** Every agent with a request in flight cancels it now. Returns how many were cancelled. */
  burst(): number {
    let n = 0;
    for (const s of this.states) {
      if (s.call && !s.call.isSettled) {
        s.burst = true;
        s.call.cancel('abort');
        n++;
      }
    }
    return n;
  }

  /** Cancel everything in flight (used only when the drain overruns). */
  cancelAll(): void {
    for (const s of this.states) s.call?.cancel('abort');
  }

  private sleep(ms: number): Promise<void> {
    if (this.stopping || ms <= 0) return Promise.resolve();
    return new Promise((resolve) => {
      const done = () => {
        clearTimeout(t);
        this.wake.delete(done);
        resolve();
      };
      const t = setTimeout(done, ms);
      this.wake.add(done);
    });
  }

  private newConversation(s: AgentState): void {
    s.conv++;
    s.round = 0;
    s.messages = [{ role: 'system', content: s.rng.pick(SYSTEM_PROMPTS) }];
    this.conversations.started++;
    this.addUserTurn(s);
  }

  private addUserTurn(s: AgentState): void {
    const max = Math.max(120, Math.min(600, Math.floor(this.o.ctxSize / 3)));
    const text = this.o.corpus.passage(s.rng, 60, max);
    s.messages.push({ role: 'user', content: `${s.rng.pick(ASKS)}\n\n${text}` });
  }

  /** Drop the oldest exchanges (keep the system prompt and the last user turn) to fit the context. */
  private fit(s: AgentState, maxTokens: number): number {
    const budget = this.o.ctxSize - maxTokens - TEMPLATE_BYTES_FIXED;
    const size = () => s.messages.reduce((a, m) => a + Buffer.byteLength(m.content) + TEMPLATE_BYTES_PER_MESSAGE, 0);
    while (size() > budget && s.messages.length > 2) s.messages.splice(1, Math.min(2, s.messages.length - 2));
    if (size() > budget) {
      const last = s.messages[s.messages.length - 1]!;
      const over = size() - budget;
      s.messages[s.messages.length - 1] = { ...last, content: last.content.slice(0, Math.max(1, last.content.length - over - 8)) };
    }
    return size();
  }

  private decide(s: AgentState, stream: boolean, maxTokens: number): { plan: Plan; delayMs?: number; afterChunks?: number } {
    const r = s.rng.float();
    const kind: CancelKind | null = r < this.o.abortRate ? 'abort' : r < this.o.abortRate + this.o.killRate ? 'kill' : null;
    if (!kind) return { plan: 'none' };
    const m = s.rng.int(0, 2);
    if (m === 0) return { plan: `${kind}:send` };
    if (m === 2 && stream && maxTokens > 1) return { plan: `${kind}:tokens`, afterChunks: s.rng.int(1, maxTokens - 1) };
    const scale = stream ? 2 * this.ttft.value : this.e2e.value;
    return { plan: `${kind}:delay`, delayMs: s.rng.float() * scale };
  }

  private async loop(s: AgentState): Promise<void> {
    // Stagger the start a little, as real agents do.
    await this.sleep(s.rng.float() * Math.min(1000, this.o.thinkMs * 2 + 50));
    this.newConversation(s);
    while (!this.stopping) {
      const maxTokens = s.rng.int(Math.max(1, Math.ceil(this.o.maxTokens / 4)), this.o.maxTokens);
      const promptBytes = this.fit(s, maxTokens);
      const stream = !s.rng.chance(this.o.nonStreamRate);
      const d = this.decide(s, stream, maxTokens);
      const kind = d.plan === 'none' ? null : (d.plan.split(':')[0] as CancelKind);
      const messages = s.messages.slice();
      s.burst = false;
      let timer: NodeJS.Timeout | undefined;
      const call = new ChatCall({
        baseUrl: this.o.baseUrl,
        agent: this.agent,
        ...(this.o.apiKey ? { apiKey: this.o.apiKey } : {}),
        messages,
        maxTokens,
        stream,
        deadlineMs: this.o.requestTimeoutMs,
        onSent: d.plan.endsWith(':send') ? () => setImmediate(() => call.cancel(kind!)) : undefined,
        onChunk: d.afterChunks !== undefined ? (n) => n >= d.afterChunks! && call.cancel(kind!) : undefined,
      });
      if (d.delayMs !== undefined) timer = setTimeout(() => call.cancel(kind!), d.delayMs);
      s.call = call;
      const res = await call.done;
      if (timer) clearTimeout(timer);
      s.call = undefined;
      const rec: RequestRecord = { agent: s.id, conv: s.conv, round: s.round, stream, plan: d.plan, burst: s.burst && res.outcome === 'aborted', promptBytes, maxTokens, result: res };
      this.o.onRecord(rec);
      switch (res.outcome) {
        case 'ok': {
          s.failures = 0;
          if (res.tFirst !== undefined && stream) this.ttft.add(res.tFirst - res.tStart);
          this.e2e.add(res.tEnd - res.tStart);
          this.keep(s, messages, maxTokens, res);
          s.round++;
          if (s.round >= this.o.rounds) {
            this.conversations.finished++;
            this.newConversation(s);
          } else {
            s.messages.push({ role: 'assistant', content: res.text });
            this.addUserTurn(s);
          }
          await this.sleep(s.rng.float() * this.o.thinkMs);
          break;
        }
        case 'aborted':
          await this.sleep(s.rng.float() * this.o.thinkMs);
          break;
        case 'killed':
          this.conversations.restarted++;
          await this.sleep(20 + s.rng.float() * 200);
          this.newConversation(s);
          break;
        case 'hung':
          this.o.onHang?.(rec);
          break;
        case 'failed':
          s.failures++;
          await this.sleep(Math.min(2000, 100 * 2 ** Math.min(4, s.failures - 1)) * (0.5 + s.rng.float()));
          break;
      }
    }
  }

  /** Completed rounds the router migrated mid-answer (as `migratedOf` said). */
  get migratedRounds(): number {
    return this.seen.migrated;
  }

  /** Completed rounds for the wrong-answer check (at most sampleSize, `chooseSample`), once every `migratedOf` look-up has settled. */
  async sample(): Promise<SampledRound[]> {
    await Promise.all([...this.looking]);
    return chooseSample(this.sampled, this.o.sampleSize);
  }

  /** Reservoir-sample a completed round for the wrong-answer check (each pool a uniform reservoir sample). */
  private keep(s: AgentState, messages: ChatMessage[], maxTokens: number, res: CallResult): void {
    const k = this.o.sampleSize;
    const item: SampledRound = { agent: s.id, conv: s.conv, round: s.round, messages, maxTokens, text: res.text, rid: res.rid, cachedTokens: res.cachedTokens, path: res.path };
    const put = (migrated: boolean) => {
      if (migrated) item.migrated = true;
      const kind: keyof SamplePools = migrated ? 'migrated' : res.path === 'decode_local' ? 'local' : (res.cachedTokens ?? 0) > 0 ? 'cached' : 'plain';
      const seen = ++this.seen[kind];
      if (k <= 0) return;
      const pool = this.sampled[kind];
      if (pool.length < k) pool.push(item);
      else {
        const j = Math.floor(this.sampleRng.float() * seen);
        if (j < k) pool[j] = item;
      }
    };
    if (!this.o.migratedOf || !res.rid) return put(false);
    const p: Promise<void> = this.o.migratedOf(res.rid).then(
      (m) => put(m === true),
      () => put(false),
    ).finally(() => this.looking.delete(p));
    this.looking.add(p);
  }
}
