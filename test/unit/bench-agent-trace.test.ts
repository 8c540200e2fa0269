/**
 * Agent trace replay (src/bench/agent-trace.ts, agent-replay.ts, report-agent-trace.ts): the
 * seeded generator's determinism and shape, the Mooncake / AIPerf JSONL loader (a good file, a
 * bad line named), the trace's reuse upper bound, block text of exact token lengths with the
 * tiny model's vocabulary, the job-level summary and the goals.
 * Run: node --import tsx --test test/unit/bench-agent-trace.test.ts
 */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ConfigError } from '../../src/base/errors.js';
import { ensureModel } from '../../src/engine/gguf-writer.js';
import { counterSum, evictionsOf, summarizeRecords, type ReplayRecord, type ReplayRun } from '../../src/bench/agent-replay.js';
import { BlockText, generateSessions, inputTokens, parseTrace, sessionsOf, traceJsonl, upperBound } from '../../src/bench/agent-trace.js';
import { loadAgentCorpus } from '../../src/bench/agents.js';
import { loadTokenizer } from '../../src/bench/index.js';
import { agentTraceGoals, agentTraceReport, flagsJoined, type AgentTraceResult } from '../../src/bench/report-agent-trace.js';
import { median } from '../../src/bench/util.js';

describe('generated agent sessions', () => {
  it('are the same for the same seed and differ for another', () => {
    const a = generateSessions({ seed: 7, sessions: 12, turns: 10 });
    assert.deepEqual(generateSessions({ seed: 7, sessions: 12, turns: 10 }), a);
    assert.notDeepEqual(generateSessions({ seed: 8, sessions: 12, turns: 10 }).requests, a.requests);
  });

  it('have the shape asked for: median turns, shared prefix, growth past 8K, input:output ≈ 130:1, sub-agents in ~44 % of sessions', () => {
    const t = generateSessions({ seed: 3, sessions: 200, turns: 30 });
    const sessions = sessionsOf(t);
    const top = [...sessions.values()].filter((rs) => rs[0]!.parent === undefined);
    assert.equal(top.length, 200);
    const turns = median(top.map((rs) => rs.length));
    assert.ok(turns >= 27 && turns <= 33, `median turns ${turns}`);
    // every session opens with the shared system prompt and tool block; tasks are shared
    for (const rs of sessions.values()) assert.deepEqual(rs[0]!.blocks.slice(0, 2).map((b) => b.id), [0, 1]);
    const tasks = new Map<number, number>();
    for (const rs of top) tasks.set(rs[0]!.blocks[2]!.id, (tasks.get(rs[0]!.blocks[2]!.id) ?? 0) + 1);
    assert.equal(tasks.size, 4);
    assert.ok(Math.max(...tasks.values()) >= 60, 'the first task opens many sessions');
    // each turn's prompt extends the previous one (the conversation grows)
    for (const rs of sessions.values()) for (let i = 1; i < rs.length; i++) assert.deepEqual(rs[i]!.blocks.slice(0, rs[i - 1]!.blocks.length), rs[i - 1]!.blocks);
    const longest = top.filter((rs) => rs.length >= 30).map((rs) => inputTokens(rs[rs.length - 1]!));
    assert.ok(median(longest) > 8192, `30+-turn sessions end at ${median(longest)} tokens`);
    const inp = t.requests.reduce((a, r) => a + inputTokens(r), 0);
    const out = t.requests.reduce((a, r) => a + r.outputTokens, 0);
    assert.ok(Math.abs(inp / out - 130) < 13, `input:output ${inp / out}`);
    const spawning = top.filter((rs) => rs.some((r) => r.waitFor)).length;
    assert.ok(spawning >= 0.34 * 200 && spawning <= 0.54 * 200, `${spawning} of 200 spawn sub-agents`);
    // a sub-agent starts from its parent's prompt at the spawning turn (plus its reply) and the parent's next turn waits for it
    for (const rs of sessions.values()) {
      const first = rs[0]!;
      if (!first.parent) continue;
      const parent = sessions.get(first.parent)!;
      const at = parent[first.after!.turn - 1]!;
      assert.deepEqual(first.blocks.slice(0, at.blocks.length), at.blocks);
      assert.ok(parent[first.after!.turn]!.waitFor!.includes(first.session));
    }
    // pauses between turns, none before a first turn
    assert.ok(t.requests.filter((r) => r.turn > 1).every((r) => r.delayMs >= 0));
    assert.ok(median(t.requests.filter((r) => r.turn > 1).map((r) => r.delayMs)) > 100);
  });

  it('round-trip through the mooncake_trace JSONL form: the same sessions and lengths, the same sharing at block granularity', () => {
    const t = generateSessions({ seed: 5, sessions: 6, turns: 5 });
    const back = parseTrace(traceJsonl(t, 64), 64, 'x');
    assert.equal(back.requests.length, t.requests.length);
    assert.deepEqual(back.requests.map((r) => [r.session, r.turn, inputTokens(r), r.outputTokens]), t.requests.map((r) => [`t${r.session}`, r.turn, inputTokens(r), r.outputTokens]));
    const a = upperBound(t.requests);
    const b = upperBound(back.requests);
    // block granularity: at most one block less per request, never more
    for (let i = 0; i < a.length; i++) assert.ok(b[i]!.seen <= a[i]!.seen && b[i]!.seen > a[i]!.seen - 64, `request ${i}: ${b[i]!.seen} vs ${a[i]!.seen}`);
  });
});

describe('the trace loader (Mooncake / AIPerf JSONL)', () => {
  const good = [
    '{"timestamp": 0, "input_length": 1200, "output_length": 52, "hash_ids": [0, 1, 2]}',
    '',
    '{"session_id": "a", "timestamp": 10, "input_length": 600, "output_length": 8, "hash_ids": [0, 1]}',
    '{"session_id": "a", "delay": 2000, "input_length": 1100, "output_length": 8, "hash_ids": [0, 1, 3], "extra": {"x": 1}}',
    '{"timestamp": 30, "input_length": 100, "output_length": 4}',
  ].join('\n');

  it('reads blocks, sessions, pauses and arrival times', () => {
    const t = parseTrace(good, 512, 'good.jsonl');
    assert.equal(t.requests.length, 4);
    const [r0, a1, a2, r4] = t.requests;
    assert.deepEqual(r0!.blocks.map((b) => [b.id, b.tokens]), [[0, 512], [1, 512], [2, 176]]);
    assert.equal(r0!.session, 'row1');
    assert.deepEqual([a1!.session, a1!.turn, a1!.atMs, a2!.turn, a2!.delayMs, a2!.atMs], ['ta', 1, 10, 2, 2000, undefined]);
    assert.deepEqual(a2!.blocks.map((b) => b.tokens), [512, 512, 76]);
    // no hash_ids: blocks of its own, never equal to a trace's
    assert.equal(r4!.blocks.length, 1);
    assert.ok(r4!.blocks[0]!.id >= 2 ** 40);
    // the upper bound: line 3 shares blocks 0 and 1 with line 1; line 4 shares 0 and 1 (whole, as line 1 had them)
    assert.deepEqual(upperBound(t.requests), [
      { seen: 0, input: 1200 },
      { seen: 600, input: 600 },
      { seen: 1024, input: 1100 }, // block 1 was seen whole (512 tokens) on line 1
      { seen: 0, input: 100 },
    ]);
  });

  it('names the bad line and what is wrong with it', () => {
    const bad = (line: string, re: RegExp) =>
      assert.throws(
        () => parseTrace(`{"timestamp": 0, "input_length": 10, "output_length": 1}\n\n${line}\n`, 512, 'my.jsonl'),
        (e: unknown) => e instanceof ConfigError && re.test(e.message),
      );
    bad('{"timestamp": 0, "input_length": 10', /^my\.jsonl line 3: not JSON/);
    bad('{"timestamp": 0, "output_length": 1}', /^my\.jsonl line 3: input_length: Required/);
    bad('{"timestamp": 0, "input_length": -5, "output_length": 1}', /line 3: input_length: Number must be greater than 0/);
    bad('{"input_length": 5, "output_length": 1}', /line 3: needs a timestamp \(ms\) or a delay/);
    bad('{"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [1, 2]}', /line 3: 2 hash_ids at 512 tokens a block need input_length > 512, not 100/);
    assert.throws(() => parseTrace('\n\n', 512, 'empty.jsonl'), /no requests/);
  });
});

describe('the upper bound', () => {
  it('counts the leading blocks an earlier prompt had, a shorter block in part, and nothing past a new block', () => {
    const r = (blocks: [number, number][]) => ({ session: 's', turn: 1, delayMs: 0, outputTokens: 1, blocks: blocks.map(([id, tokens]) => ({ id, tokens })) });
    const ub = upperBound([r([[1, 10], [2, 5]]), r([[1, 10], [2, 8], [3, 4]]), r([[1, 10], [9, 3], [2, 8]]), r([[2, 8]])]);
    assert.deepEqual(ub, [
      { seen: 0, input: 15 },
      { seen: 15, input: 22 }, // block 2 was seen at 5 of its 8 tokens: the match ends there
      { seen: 10, input: 21 }, // block 9 is new: block 2 after it is another chain
      { seen: 0, input: 8 }, // block 2 at the start is another chain too
    ]);
  });
});

describe('block text', () => {
  it('has exactly the asked tokens with the tiny vocabulary, and blocks concatenate without changing counts', async () => {
    const tok = await loadTokenizer(await ensureModel('tiny', 1));
    try {
      const text = loadAgentCorpus();
      const bt = new BlockText({ text, ids: tok.encode(text) }, 1, tok);
      const blocks = [
        { id: 0, tokens: 300 },
        { id: 1, tokens: 41 },
        { id: 77, tokens: 7 },
        { id: 2 ** 41, tokens: 128 },
      ];
      for (const b of blocks) assert.equal(bt.count(bt.text(b.id, b.tokens)), b.tokens, `block ${b.id}`);
      assert.equal(bt.count(bt.prompt(blocks)), 300 + 41 + 7 + 128);
      // same ids → same text; another salt → other text of the same length
      assert.equal(new BlockText({ text, ids: tok.encode(text) }, 1, tok).text(77, 7), bt.text(77, 7));
      const other = new BlockText({ text, ids: tok.encode(text) }, 2, tok);
      assert.notEqual(other.text(0, 300), bt.text(0, 300));
      assert.equal(other.count(other.text(0, 300)), 300);
      // roles: consecutive blocks of one role form one message
      const m = bt.messages([{ id: 0, tokens: 5, role: 'system' }, { id: 1, tokens: 5, role: 'system' }, { id: 2, tokens: 5, role: 'user' }, { id: 3, tokens: 5 }]);
      assert.deepEqual(m.map((x) => x.role), ['system', 'user']);
      assert.equal(m[0]!.content, bt.text(0, 5) + bt.text(1, 5));
    } finally {
      await tok.dispose();
    }
  });

  it('without a tokenizer, estimates 4 characters a token', () => {
    const bt = new BlockText({ text: 'alpha beta gamma delta '.repeat(100) }, 1);
    const s = bt.text(3, 50);
    assert.ok(s.length <= 201 && s.length >= 190 && /^[A-Za-z0-9]/.test(s) && s.endsWith('\n'), JSON.stringify(s));
  });
});

const rec = (session: string, turn: number, o: Partial<ReplayRecord> = {}): ReplayRecord => ({ session, turn, last: false, ok: true, sentMs: turn * 1000, ttftMs: 10 * turn, e2eMs: 500, promptTokens: 100 * turn, cachedTokens: 80 * (turn - 1), outputTokens: 4, input: 100 * turn, seen: 90 * (turn - 1), path: 'pd', ...o });

describe('job-level metrics', () => {
  it('session completion (sub-agents included), TTFT and cached share by turn beside the bound, failures', () => {
    const records = [rec('a', 1), rec('a', 2), rec('a', 3, { last: true, path: 'decode_local' }), rec('a.0', 1, { parent: 'a', sentMs: 2500, e2eMs: 3000, last: true }), rec('b', 1), rec('b', 2, { ok: false, error: 'HTTP 500' }), rec('b', 3, { ok: false, notRun: true })];
    const s = summarizeRecords(records);
    assert.equal(s.sessions, 2);
    assert.equal(s.sessionsOk, 1);
    assert.equal(s.failed, 2);
    // a: sent at 1000, last done at max(3000+500, 2500+3000) = 5500
    assert.equal(s.completion.p50, 4500);
    assert.deepEqual(s.byTurn.map((t) => [t.turn, t.n]), [[1, 2], [2, 1], [3, 1]]);
    assert.equal(s.byTurn[1]!.cached, 80 / 200);
    assert.equal(s.byTurn[1]!.bound, 90 / 200);
    assert.equal(s.lastTurn.ttftP90, 30);
    // turns 2+: a's turns 2 and 3 (b's failed)
    assert.equal(s.cached2, (80 + 160) / (200 + 300));
    assert.equal(s.bound2, (90 + 180) / (200 + 300));
    assert.deepEqual(s.paths, { pd: 4, decode_local: 1 });
    // an endpoint that reports no cached_tokens: share null
    assert.equal(summarizeRecords([rec('x', 2, { cachedTokens: null })]).cached2, null);
  });

  it('reads the needs_prefill bounces and evictions by cause from /metrics', () => {
    const router = 'pdserve_router_requests_by_path_total{path="pd"} 9\npdserve_router_requests_by_path_total{path="fallback"} 2\n';
    assert.equal(counterSum(router, 'pdserve_router_requests_by_path_total', 'path="fallback"'), 2);
    assert.equal(counterSum(router, 'pdserve_nothing_total'), undefined);
    const worker = 'pdserve_cache_evictions_total{tier="sequence",cause="lru"} 3\npdserve_cache_evictions_total{tier="sequence",cause="superseded"} 4\npdserve_cache_evictions_total{cause="ttl_pressure"} 2\npdserve_prefix_store_evictions_total 1\n';
    assert.deepEqual(evictionsOf(worker), { 'sequence lru': 3, 'sequence superseded': 4, ttl_pressure: 2, prefix_store: 1 });
    // the store tier counted by the tiered counter: its own LRU counter is not added again
    assert.deepEqual(evictionsOf('pdserve_cache_evictions_total{tier="store",cause="lru"} 5\npdserve_prefix_store_evictions_total 5\n'), { 'store lru': 5 });
    // declared, nothing evicted yet: zero, not unknown
    assert.deepEqual(evictionsOf('# HELP pdserve_cache_evictions_total x\n# TYPE pdserve_cache_evictions_total counter\n'), {});
    assert.equal(evictionsOf('pdserve_other 1\n'), undefined);
  });
});

describe('agent trace goals and report', () => {
  const run = (setup: string, p50: number, cached2: number, t2: number, last: number, bounces: number): ReplayRun => ({
    setup,
    name: setup,
    repeat: 1,
    wallMs: 1000,
    load: 1,
    sessions: 2,
    sessionsOk: 2,
    requests: 400,
    failed: 0,
    completion: { p50, p90: p50, mean: p50 },
    byTurn: [
      { turn: 1, n: 2, ttftP50: 50, ttftP90: 60, cached: 0, bound: 0.5 },
      { turn: 2, n: 2, ttftP50: t2, ttftP90: t2, cached: cached2, bound: 0.95 },
    ],
    lastTurn: { n: 2, ttftP50: last, ttftP90: last },
    cached2,
    bound2: 0.95,
    bounces,
    paths: { pd: 3, decode_local: 1 },
    evictions: { lru: 2 },
    errors: [],
    records: [],
  });
  const result = (pd: ReplayRun): AgentTraceResult => ({ source: 'generated', model: 'tiny', decode: 2, command: 'pdserve bench-agents', scale: { sessions: 3, topSessions: 2, requests: 400, turnsMedian: 2, turnsMax: 2, promptMedian: 100, promptMax: 200, ioRatio: 130 }, load: { start: [1, 1, 1], end: [2, 2, 2], cores: 2 }, timeScale: 1, runs: [pd, run('colo', 900, 0.9, 100, 100, 0), run('pd_noreuse', 3000, 0, 300, 900, 0)] });

  it('are met or missed from the figures', () => {
    assert.deepEqual(agentTraceGoals(result(run('pd', 1000, 0.86, 100, 150, 2))).map((g) => g.met), [true, true, true, true]);
    const miss = agentTraceGoals(result(run('pd', 1001, 0.85, 100, 151, 3)));
    assert.deepEqual(miss.map((g) => g.met), [false, false, false, false]);
    assert.match(miss[0]!.detail, /1\.00 s vs 3\.00 s: 3\.00×/);
    assert.match(miss[3]!.detail, /3 of 400 \(0\.75 %\)/);
    assert.match(miss[1]!.detail, /^2×2 turns to 0\.2K tokens, tiny: /, 'the scale stands beside the figures');
  });

  it('render the runs, the load and the plot', () => {
    const md = agentTraceReport(result(run('pd', 1000, 0.86, 100, 150, 2)), '_prov_', 'bench/plots/x.svg').join('\n');
    assert.match(md, /^_prov_\n/);
    assert.match(md, /Measured under load [\d.]+ → [\d.]+ \(1 min, \d+ cores\)/);
    assert.match(md, /\| pd \| 2 \/ 2 \| 0 \/ 400 \| 1\.00 \/ 1\.00 \|.*\| 86\.0 % \| 0\.91 of 95\.0 % \| 2 \| 3 \/ 1 \| lru 2 \|/);
    assert.doesNotMatch(md, /^\| 2 \| /m, 'no per-turn table: the plot has every turn');
    assert.match(md, /!\[TTFT p90 by turn\]\(bench\/plots\/x\.svg\)/);
    assert.equal(flagsJoined('pdserve bench-agents --sessions 8 --save --turns 8 --target a=http://x --no-session-key'), 'pdserve bench-agents --sessions=8 --save --turns=8 --target=a=http://x --no-session-key');
  });
});
