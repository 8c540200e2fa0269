/**
 * Agent session traces for `pdserve bench-agents`: the trace model (requests made of token
 * blocks with ids), a seeded generator of coding-agent sessions, a loader for recorded traces
 * in the Mooncake / AIPerf `mooncake_trace` JSONL form, the trace's own reuse upper bound, and
 * the text of a block.
 *
 * A request's prompt is a list of blocks `{id, tokens}`; two requests whose leading blocks have
 * the same ids have the same leading text (hence tokens), so what a prefix cache could reuse is
 * known from the trace alone. This is the Mooncake trace's `hash_ids` idea (Mooncake FAST'25
 * traces, AIPerf's `mooncake_trace` loader), with blocks of any length: the generator cuts
 * sessions at message boundaries, the loader cuts at the trace's block size.
 *
 * The generator's shape follows the published agent-traffic measurements the benchmark's goals
 * cite (median 43 turns per session, input:output ≈ 130:1, sub-agents in ~44 % of sessions,
 * long shared system prompts and tool blocks, many sessions opening with the same task), with
 * every size a flag so a tiny model can run it.
 */
import { readFileSync } from 'node:fs';
import { z } from 'zod';
import { ConfigError } from '../base/errors.js';
import { Prng } from '../base/prng.js';
import type { BenchTokenizer } from './index.js';

/** One block of a prompt: `tokens` tokens of the text of block `id`. */
export interface TraceBlock {
  id: number;
  tokens: number;
  /** Chat role of the message the block belongs to (consecutive blocks of one role form one message); a recorded trace has none (one user message). */
  role?: 'system' | 'user' | 'assistant';
}

/** One request of a trace. Times in ms of trace time (the replay scales them). */
export interface TraceRequest {
  session: string;
  /** The session that spawned this one (a sub-agent), if any. */
  parent?: string;
  /** 1-based position in its session. */
  turn: number;
  /** Not sent before this offset from the run's start (a recorded timestamp); undefined: no lower bound. */
  atMs?: number;
  /** Pause after the previous turn of the session completed (tool run, think time). */
  delayMs: number;
  /** A first turn only: sent after this turn of another session completed (a sub-agent after its parent's spawning turn). */
  after?: { session: string; turn: number };
  /** Sessions that must complete before this turn is sent (the parent joins its sub-agents). */
  waitFor?: string[];
  outputTokens: number;
  blocks: TraceBlock[];
}

/** A trace: requests grouped by session, each session's turns in order. */
export interface AgentTrace {
  /** Where it came from: `generated (seed N, …)` or the file. */
  source: string;
  requests: TraceRequest[];
}

/** Tokens of a request's prompt as the trace counts them (the sum of its blocks). */
export function inputTokens(r: Pick<TraceRequest, 'blocks'>): number {
  let n = 0;
  for (const b of r.blocks) n += b.tokens;
  return n;
}

/** The trace's sessions: id → its requests in turn order (sessions in first-appearance order). */
export function sessionsOf(trace: AgentTrace): Map<string, TraceRequest[]> {
  const m = new Map<string, TraceRequest[]>();
  for (const r of trace.requests) {
    let s = m.get(r.session);
    if (!s) m.set(r.session, (s = []));
    s.push(r);
  }
  for (const s of m.values()) s.sort((a, b) => a.turn - b.turn);
  return m;
}

// ------------------------------------------------------------------------------ the upper bound

interface TrieNode {
  /** Longest length of this node's block seen (a partial last block may be shorter). */
  tokens: number;
  next: Map<number, TrieNode>;
}

/**
 * What a prefix cache of unbounded size could have reused: a trie of the block-id chains seen
 * so far. `seen(blocks)` is the number of leading tokens of a prompt that an earlier prompt
 * (one `add`ed before) already had; a block seen shorter than now counts its seen part and
 * ends the match. The replay asks at send time and adds at completion (a cache holds what was
 * computed); `upperBound` does both in trace order.
 */
export class SeenBlocks {
  private readonly root: TrieNode = { tokens: 0, next: new Map() };

  /** Leading tokens of `blocks` an earlier prompt had. */
  seen(blocks: readonly TraceBlock[]): number {
    let node = this.root;
    let n = 0;
    for (const b of blocks) {
      const child = node.next.get(b.id);
      if (!child) break;
      n += Math.min(b.tokens, child.tokens);
      if (child.tokens < b.tokens) break;
      node = child;
    }
    return n;
  }

  /** Record a prompt as computed. */
  add(blocks: readonly TraceBlock[]): void {
    let node = this.root;
    for (const b of blocks) {
      let child = node.next.get(b.id);
      if (!child) node.next.set(b.id, (child = { tokens: 0, next: new Map() }));
      child.tokens = Math.max(child.tokens, b.tokens);
      node = child;
    }
  }
}

/**
 * The trace's reuse upper bound per request, in `order` (default: the trace's own order, each
 * request seen by the ones after it): `{seen, input}` tokens, `seen` being the leading tokens
 * of its prompt some earlier request's prompt had.
 */
export function upperBound(requests: readonly TraceRequest[]): { seen: number; input: number }[] {
  const s = new SeenBlocks();
  return requests.map((r) => {
    const out = { seen: s.seen(r.blocks), input: inputTokens(r) };
    s.add(r.blocks);
    return out;
  });
}

// ------------------------------------------------------------------------------- the generator

/** Options of `generateSessions` (tokens are the served model's; times in ms). */
export interface GenerateOptions {
  seed: number;
  /** Top-level sessions (sub-agents come on top). */
  sessions: number;
  /** Median turns per session (lognormal; 43 in the measured traffic). */
  turns: number;
  /** Spread of the turn count: σ of its log (0 = every session has `turns`). */
  turnsSigma: number;
  /** Median tokens a turn adds (the tool result; lognormal, σ 0.7). */
  growth: number;
  /** Shared system prompt, tokens. */
  systemTokens: number;
  /** Shared tool definitions block, tokens. */
  toolTokens: number;
  /** Task text, tokens. */
  taskTokens: number;
  /** Distinct task texts; sessions draw them with weights 1/rank (the first task opens most sessions). */
  tasks: number;
  /** Total input : total output tokens (output lengths are scaled to it; 130 in the measured traffic). */
  ioRatio: number;
  /** Median pause between turns (tool run + think time; lognormal, σ 0.8). */
  thinkMs: number;
  /** Share of sessions that spawn sub-agents (0.44 in the measured traffic). */
  subagentShare: number;
  /** Sessions start uniformly over this window. */
  rampMs: number;
}

/** Defaults sized for the generated tiny model: 30 sessions of ~30 turns growing past 8K tokens. */
export const GENERATE_DEFAULTS: GenerateOptions = { seed: 1, sessions: 30, turns: 30, turnsSigma: 0.3, growth: 240, systemTokens: 600, toolTokens: 400, taskTokens: 160, tasks: 4, ioRatio: 130, thinkMs: 200, subagentShare: 0.44, rampMs: 2000 };

/** Standard normal draw (Box–Muller). */
function normal(rng: Prng): number {
  const u = Math.max(rng.float(), 1e-12);
  return Math.sqrt(-2 * Math.log(u)) * Math.cos(2 * Math.PI * rng.float());
}

function lognormal(rng: Prng, median: number, sigma: number): number {
  return median * Math.exp(sigma * normal(rng));
}

const clamp = (x: number, lo: number, hi: number) => Math.min(hi, Math.max(lo, x));

/** A session's shape before output lengths are known: growth per turn, unit reply sizes, pauses. */
interface Shape {
  id: string;
  parent?: string;
  start: number;
  prefix: TraceBlock[];
  /** Per turn k (0-based): tokens the turn's new user message adds (turn 0: none beyond the prefix). */
  growth: number[];
  /** Per turn: the reply's size relative to the median reply. */
  reply: number[];
  pause: number[];
  /** Spawns at turn index `at` (0-based): sub-agent shapes. */
  spawn?: { at: number; subs: Shape[] };
  after?: { session: string; turn: number };
}

/**
 * Seeded agent sessions (same options → the same trace): every session opens with the shared
 * system prompt and tool block (blocks 0 and 1) and a task text drawn from `tasks` shared ones;
 * each turn adds the previous reply and a tool result; a sub-agent starts from its parent's
 * whole prompt at the spawning turn plus a sub-task of its own, and the parent's next turn waits
 * for its sub-agents. Output lengths are scaled so total input / total output ≈ `ioRatio`.
 */
export function generateSessions(options: Partial<GenerateOptions> = {}): AgentTrace {
  const o = { ...GENERATE_DEFAULTS, ...options };
  const rng = new Prng(o.seed);
  let nextId = 2 + o.tasks;
  const shared: TraceBlock[] = [
    { id: 0, tokens: o.systemTokens, role: 'system' },
    { id: 1, tokens: o.toolTokens, role: 'system' },
  ];
  const taskWeights = Array.from({ length: o.tasks }, (_, i) => 1 / (i + 1));
  const wsum = taskWeights.reduce((a, b) => a + b, 0);
  const pickTask = () => {
    let x = rng.float() * wsum;
    for (let i = 0; i < o.tasks; i++) if ((x -= taskWeights[i]!) < 0) return i;
    return o.tasks - 1;
  };
  const drawTurns = (median: number) => clamp(Math.round(o.turnsSigma > 0 ? lognormal(rng, median, o.turnsSigma) : median), 2, Math.max(2, 4 * median));
  const body = (id: string, turns: number, prefix: TraceBlock[], start: number, parent?: string): Shape => {
    const s: Shape = { id, parent, start, prefix, growth: [], reply: [], pause: [] };
    for (let k = 0; k < turns; k++) {
      s.growth.push(k === 0 ? 0 : Math.round(clamp(lognormal(rng, o.growth, 0.7), Math.min(8, o.growth), 10 * o.growth)));
      s.reply.push(clamp(lognormal(rng, 1, 0.4), 0.25, 4));
      s.pause.push(k === 0 ? 0 : Math.round(clamp(lognormal(rng, o.thinkMs, 0.8), 0, 20 * o.thinkMs)));
    }
    return s;
  };
  const shapes: Shape[] = [];
  for (let i = 0; i < o.sessions; i++) {
    const task = pickTask();
    const s = body(`s${i}`, drawTurns(o.turns), [...shared, { id: 2 + task, tokens: o.taskTokens, role: 'user' }], Math.round(rng.float() * o.rampMs));
    const turns = s.growth.length;
    if (turns >= 3 && rng.chance(o.subagentShare)) {
      const at = rng.int(0, turns - 2);
      const m = rng.float() < 0.5 ? 1 : rng.float() < 0.6 ? 2 : 3;
      const subs: Shape[] = [];
      for (let j = 0; j < m; j++) {
        const sub = body(`s${i}.${j}`, drawTurns(Math.max(2, Math.round(o.turns / 4))), [], 0, s.id);
        sub.after = { session: s.id, turn: at + 1 };
        subs.push(sub);
      }
      s.spawn = { at, subs };
    }
    shapes.push(s);
  }
  // block ids: assigned once per shape so every build (below) gives the same ids
  const ids = new Map<Shape, { growth: number[]; reply: number[]; subtask: number }>();
  const assign = (s: Shape) => {
    ids.set(s, { growth: s.growth.map(() => nextId++), reply: s.reply.map(() => nextId++), subtask: nextId++ });
    for (const sub of s.spawn?.subs ?? []) assign(sub);
  };
  for (const s of shapes) assign(s);

  const build = (replyMedian: number): TraceRequest[] => {
    const out: TraceRequest[] = [];
    const replyLen = (u: number) => Math.max(1, Math.round(u * replyMedian));
    const emit = (s: Shape, prefix: TraceBlock[]) => {
      const id = ids.get(s)!;
      const blocks = [...prefix];
      if (s.parent) blocks.push({ id: id.subtask, tokens: Math.max(8, Math.round(o.taskTokens / 2)), role: 'user' });
      for (let k = 0; k < s.growth.length; k++) {
        if (k > 0) {
          blocks.push({ id: id.reply[k - 1]!, tokens: replyLen(s.reply[k - 1]!), role: 'assistant' });
          blocks.push({ id: id.growth[k]!, tokens: s.growth[k]!, role: 'user' });
        }
        const r: TraceRequest = { session: s.id, turn: k + 1, delayMs: s.pause[k]!, outputTokens: replyLen(s.reply[k]!), blocks: [...blocks] };
        if (s.parent) r.parent = s.parent;
        if (k === 0 && !s.parent) r.atMs = s.start;
        if (k === 0 && s.after) r.after = s.after;
        if (s.spawn && k === s.spawn.at + 1) r.waitFor = s.spawn.subs.map((x) => x.id);
        out.push(r);
        if (s.spawn && k === s.spawn.at) for (const sub of s.spawn.subs) emit(sub, [...blocks, { id: id.reply[k]!, tokens: replyLen(s.reply[k]!), role: 'assistant' }]);
      }
    };
    for (const s of shapes) emit(s, s.prefix);
    return out;
  };
  // output lengths: the median reply m solves Σ input(m) / Σ output(m) = ioRatio (input grows with m: replies are resent)
  let m = 16;
  for (let i = 0; i < 6; i++) {
    const reqs = build(m);
    const inp = reqs.reduce((a, r) => a + inputTokens(r), 0);
    const outp = reqs.reduce((a, r) => a + r.outputTokens, 0);
    m = Math.max(1, (m * inp) / (o.ioRatio * outp));
  }
  const requests = build(m);
  return { source: `generated (seed ${o.seed}: ${o.sessions} sessions, median ${o.turns} turns, ${o.growth} tokens a turn, ${o.systemTokens}+${o.toolTokens} shared, ${o.tasks} tasks, sub-agents ${Math.round(o.subagentShare * 100)} %, pause ${o.thinkMs} ms)`, requests };
}

// ---------------------------------------------------------------------------------- the loader

/**
 * One line of a Mooncake / AIPerf `mooncake_trace` JSONL file. `timestamp`: arrival, ms from the
 * trace's start; `delay`: ms after the session's previous turn (AIPerf); `hash_ids`: one id per
 * `blockTokens` tokens of the prompt (the last block may be partial), equal ids = equal blocks.
 * Other fields (text_input, messages, extra, …) are accepted and ignored.
 */
const TraceLine = z
  .object({
    timestamp: z.number().nonnegative().optional(),
    delay: z.number().nonnegative().optional(),
    session_id: z.union([z.string().min(1).max(256), z.number().int()]).optional(),
    input_length: z.number().int().positive(),
    output_length: z.number().int().positive(),
    hash_ids: z.array(z.number().int().nonnegative()).max(1 << 20).optional(),
  })
  .passthrough();

/** Block ids the loader makes up for a prompt's tokens past its hash_ids start here (never equal to a trace's id). */
const FRESH_BASE = 2 ** 40;

/**
 * Parse a Mooncake / AIPerf JSONL trace. Lines with a `session_id` form sessions (file order is
 * turn order); a line without one is a session of its own. A turn's pause is its `delay`, else
 * 0 with its `timestamp` as the earliest send time. Blank lines are skipped.
 * @throws ConfigError naming the line (1-based) that is not JSON, misses a field, or whose
 *   hash_ids cannot cover its input_length at `blockTokens` tokens a block.
 */
export function parseTrace(text: string, blockTokens: number, source = 'trace'): AgentTrace {
  if (!(Number.isSafeInteger(blockTokens) && blockTokens > 0)) throw new ConfigError(`${source}: the block size must be a positive integer, not ${blockTokens}`);
  const requests: TraceRequest[] = [];
  const turns = new Map<string, number>();
  let fresh = FRESH_BASE;
  const lines = text.split('\n');
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i]!.trim();
    if (line === '') continue;
    const where = `${source} line ${i + 1}`;
    let json: unknown;
    try {
      json = JSON.parse(line);
    } catch (err) {
      throw new ConfigError(`${where}: not JSON (${(err as Error).message})`);
    }
    const p = TraceLine.safeParse(json);
    if (!p.success) throw new ConfigError(`${where}: ${p.error.issues.map((x) => `${x.path.join('.') || 'line'}: ${x.message}`).join('; ')}`);
    const l = p.data;
    if (l.timestamp === undefined && l.delay === undefined) throw new ConfigError(`${where}: needs a timestamp (ms) or a delay (ms)`);
    const hashes = l.hash_ids ?? [];
    if (hashes.length > 0 && (hashes.length - 1) * blockTokens >= l.input_length) {
      throw new ConfigError(`${where}: ${hashes.length} hash_ids at ${blockTokens} tokens a block need input_length > ${(hashes.length - 1) * blockTokens}, not ${l.input_length} (is the block size right? --block-size)`);
    }
    const blocks: TraceBlock[] = [];
    let left = l.input_length;
    for (const h of hashes) {
      blocks.push({ id: h, tokens: Math.min(blockTokens, left) });
      left -= Math.min(blockTokens, left);
    }
    for (; left > 0; left -= Math.min(blockTokens, left)) blocks.push({ id: fresh++, tokens: Math.min(blockTokens, left) });
    const session = l.session_id !== undefined ? `t${String(l.session_id)}` : `row${i + 1}`;
    const turn = (turns.get(session) ?? 0) + 1;
    turns.set(session, turn);
    const r: TraceRequest = { session, turn, delayMs: turn > 1 ? (l.delay ?? 0) : 0, outputTokens: l.output_length, blocks };
    if (l.timestamp !== undefined) r.atMs = l.timestamp;
    else if (turn === 1) r.atMs = l.delay ?? 0;
    requests.push(r);
  }
  if (requests.length === 0) throw new ConfigError(`${source}: no requests (an empty file?)`);
  return { source, requests };
}

/**
 * Load a JSONL trace file (see `parseTrace`).
 * @throws ConfigError when the file cannot be read or a line is bad.
 */
export function loadTrace(file: string, blockTokens: number): AgentTrace {
  let text: string;
  try {
    text = readFileSync(file, 'utf8');
  } catch (err) {
    throw new ConfigError(`cannot read the trace ${file}: ${(err as Error).message}`);
  }
  return parseTrace(text, blockTokens, file);
}

/**
 * A trace in the AIPerf `mooncake_trace` form, one line per request: each prompt cut into
 * `blockTokens`-token blocks, a block's hash id standing for its content and everything before it
 * (chained, as Mooncake's), so `parseTrace` at the same block size gives back the same sharing at
 * block granularity.
 */
export function traceJsonl(trace: AgentTrace, blockTokens: number): string {
  const ids = new Map<string, number>();
  const lines: string[] = [];
  for (const r of trace.requests) {
    const hashes: number[] = [];
    let prev = -1;
    let parts: string[] = [];
    let fill = 0;
    const close = () => {
      const key = `${prev}|${parts.join(',')}`;
      let h = ids.get(key);
      if (h === undefined) ids.set(key, (h = ids.size));
      hashes.push(h);
      prev = h;
      parts = [];
      fill = 0;
    };
    for (const b of r.blocks) {
      for (let at = 0; at < b.tokens; ) {
        const take = Math.min(b.tokens - at, blockTokens - fill);
        parts.push(`${b.id}:${at}+${take}`);
        at += take;
        fill += take;
        if (fill === blockTokens) close();
      }
    }
    if (fill > 0) close();
    lines.push(JSON.stringify({ session_id: r.session, ...(r.atMs !== undefined ? { timestamp: r.atMs } : {}), delay: r.delayMs, input_length: inputTokens(r), output_length: r.outputTokens, hash_ids: hashes }));
  }
  return lines.join('\n') + '\n';
}

// -------------------------------------------------------------------------------- block text

/** Context in which a block's tokens are counted: blocks follow a newline inside a prompt. */
const ANCHOR = 'Begin.\n';

/**
 * The text of block `id` at `tokens` tokens: a window of the corpus at an offset drawn from
 * (`id`, `salt`), starting with a letter and ending with a newline, so a prompt's blocks
 * tokenize one after another as they do alone (a newline merges with nothing in a byte-fallback
 * vocabulary). With the model's tokenizer the length is fitted exactly (counted after a newline,
 * as inside a prompt); without one it is `tokens × charsPerToken` characters. Another `salt`
 * gives other text for the same ids (a setup's run cannot hit an earlier run's cache).
 */
export class BlockText {
  private readonly cache = new Map<string, string>();
  private readonly anchor: number;

  constructor(
    private readonly corpus: { text: string; ids?: readonly number[] },
    private readonly salt: number,
    private readonly tok?: BenchTokenizer,
    private readonly charsPerToken = 4,
  ) {
    this.anchor = tok ? tok.encode(ANCHOR).length : 0;
  }

  private offset(id: number, span: number): number {
    let h = (Math.imul(id % 0x7fffffff, 0x9e3779b1) ^ Math.floor(id / 0x80000000) ^ Math.imul(this.salt + 1, 0x85ebca6b)) >>> 0;
    h = Math.imul(h ^ (h >>> 15), 0x2c1b3c6d) >>> 0;
    h = (h ^ (h >>> 12)) >>> 0;
    return h % Math.max(1, span);
  }

  private static clean(s: string): string {
    const t = s.replace(/^[^A-Za-z0-9]+/, '').replace(/\s+$/, '');
    return `${t || 'x'}\n`;
  }

  /** Tokens of `s` inside a prompt (after a newline). */
  count(s: string): number {
    return this.tok ? this.tok.encode(ANCHOR + s).length - this.anchor : Math.ceil(s.length / this.charsPerToken);
  }

  text(id: number, tokens: number): string {
    const key = `${id}:${tokens}`;
    const hit = this.cache.get(key);
    if (hit !== undefined) return hit;
    let out: string;
    if (this.tok && this.corpus.ids && this.corpus.ids.length > 0) {
      const ids = this.corpus.ids;
      const off = this.offset(id, ids.length);
      const window = (k: number) => {
        const w: number[] = [];
        for (let i = 0; i < k; i++) w.push(ids[(off + i) % ids.length]!);
        return w;
      };
      let k = tokens;
      out = BlockText.clean(this.tok.decode(window(k)));
      let best = { s: out, d: Math.abs(this.count(out) - tokens) };
      for (let round = 0; round < 8 && best.d > 0; round++) {
        const c = this.count(out);
        if (Math.abs(c - tokens) < best.d) best = { s: out, d: Math.abs(c - tokens) };
        if (c === tokens) break;
        k = Math.max(1, k + (tokens - c));
        out = BlockText.clean(this.tok.decode(window(k)));
      }
      if (Math.abs(this.count(out) - tokens) > best.d) out = best.s;
    } else {
      const t = this.corpus.text;
      const n = Math.max(1, tokens * this.charsPerToken);
      const off = this.offset(id, t.length);
      let s = t.slice(off, off + n + 16);
      while (s.length < n + 16) s += ` ${t.slice(0, n + 16 - s.length)}`;
      out = BlockText.clean(s.slice(0, n));
    }
    this.cache.set(key, out);
    return out;
  }

  /** Chat messages of a prompt: consecutive blocks of one role joined (blocks without a role: user). */
  messages(blocks: readonly TraceBlock[]): { role: 'system' | 'user' | 'assistant'; content: string }[] {
    const out: { role: 'system' | 'user' | 'assistant'; content: string }[] = [];
    for (const b of blocks) {
      const role = b.role ?? 'user';
      const t = this.text(b.id, b.tokens);
      const last = out[out.length - 1];
      if (last && last.role === role) last.content += t;
      else out.push({ role, content: t });
    }
    return out;
  }

  /** The prompt as one text (the completions endpoint). */
  prompt(blocks: readonly TraceBlock[]): string {
    return blocks.map((b) => this.text(b.id, b.tokens)).join('');
  }
}
