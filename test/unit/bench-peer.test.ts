/**
 * The llama-server peer section's pure parts: the peer's command line, the agent prompt text
 * every system gets, the goals' verdicts, and the CPU profile's phase buckets (a builtin charged
 * to its caller, samples cut to a window). Running llama-server itself is the suite's job
 * (`npm run bench -- --sections 8`), never the unit suite's.
 */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { llamaServerArgs, llamaServerDir } from '../../src/bench/llama-server.js';
import { peerGoals, peerReport, renderAgentPrompt, type PeerAgentRun, type PeerResult, type UniformRun } from '../../src/bench/peer.js';
import { bucketProfile, phaseOfFrame, phaseReport, type CpuProfile } from '../../src/bench/profile.js';
import { summarize } from '../../src/observe/stats.js';

describe('llama-server peer', () => {
  it('runs with the same slots and threads as pdserve, the context split per slot', () => {
    const a = llamaServerArgs({ model: '/m.gguf', threads: 2, slots: 8, contextPerSlot: 4096, cacheRamMiB: 2048 }, 9000);
    const flag = (f: string) => a[a.indexOf(f) + 1];
    assert.equal(flag('-t'), '2');
    assert.equal(flag('-np'), '8');
    assert.equal(flag('-c'), String(8 * 4096));
    assert.equal(flag('--cache-ram'), '2048');
    assert.ok(a.includes('--no-kv-unified'));
    assert.match(llamaServerDir('v0.4.0', '/cache'), /^\/cache\/llama-server-v0\.4\.0$/);
  });

  it('renders one agent prompt text that grows by appending (the previous prompt is a prefix of the next)', () => {
    const m1 = [{ role: 'system' as const, content: 'You are agent 0.' }, { role: 'user' as const, content: 'Tool result 1:\nabc' }];
    const p1 = renderAgentPrompt(m1);
    const p2 = renderAgentPrompt([...m1, { role: 'assistant', content: 'next' }, { role: 'user', content: 'Tool result 2:\ndef' }]);
    assert.equal(p1, 'You are agent 0.\n\n### User\nTool result 1:\nabc\n\n### Assistant\n');
    assert.ok(p2.startsWith(p1), 'round 2 extends round 1 where the reply starts');
    assert.ok(p2.endsWith('### Assistant\n'));
  });

  const sum = (xs: number[]) => summarize(xs);
  const agent = (system: PeerAgentRun['system'], wallS: number, p90: number): PeerAgentRun => ({ system, rep: 0, sessions: 30, rounds: 2, wallS, sessionP50S: wallS, ttft: sum([p90]), ttftP90ByRound: [p90, p90], tpot: sum([10]), cachedShare: 0.7, failed: 0, reqPerS: 60 / wallS, cpuMsPerRequest: { x: 100 }, load: 3 });
  const uni = (system: UniformRun['system'], reqPerS: number, tpotP99: number): UniformRun => ({ system, streams: 8, promptTokens: 512, rep: 0, requests: 16, failed: 0, reqPerS, ttft: sum([100]), tpot: sum([tpotP99]), cpuMsPerRequest: { x: 50 }, load: 3 });
  const result = (agents: PeerAgentRun[], uniform: UniformRun[]): PeerResult => ({ llamaCppTag: 'v0', llamaServerArgs: [], config: { contextPerSlot: 4096, outputTokens: 64, agentSessions: 30, agentRounds: 2, reps: 1, streams: [8], promptTokens: [512] }, agents, uniform });

  it('judges the goals on the figures: PD ≤ 0.8× llama-server, colocated ≤ 1.0×, throughput ≥ 1.0×', () => {
    const g = peerGoals(result([agent('llama', 20, 500), agent('colo', 19, 400), agent('pd', 17, 600)], [uni('llama', 4, 40), uni('colo', 4.4, 40), uni('pd', 3, 5)]));
    const verdict = (re: RegExp) => g.find((x) => re.test(x.goal))?.met;
    assert.equal(verdict(/PD session completion/), false, '17 s > 0.8 × 20 s');
    assert.equal(verdict(/colocated session completion/), true);
    assert.equal(verdict(/PD 1\+2 TTFT p90/), false, '600 ms > 500 ms');
    assert.equal(verdict(/colocated TTFT p90/), true);
    assert.equal(verdict(/colocated requests\/s/), true);
    assert.equal(verdict(/PD 1\+2 requests\/s/), false);
    assert.equal(verdict(/TPOT p99 ≤ 0\.2/), true, '5 / 40 = 0.125');
  });

  it('a skipped peer says why instead of a table', () => {
    const r: PeerResult = { ...result([], []), skipped: 'llama-server peer skipped: cmake not found on PATH' };
    assert.deepEqual(peerGoals(r), []);
    assert.match(peerReport(r, '_prov_').join('\n'), /Not measured: llama-server peer skipped: cmake not found/);
  });
});

describe('CPU profile phases', () => {
  it('buckets frames by source file; builtins take their caller\'s phase', () => {
    assert.equal(phaseOfFrame('(idle)', ''), 'idle');
    assert.equal(phaseOfFrame('(garbage collector)', ''), 'gc');
    assert.equal(phaseOfFrame('stringify', ''), 'json');
    assert.equal(phaseOfFrame('x', 'file:///r/node_modules/fastify/lib/route.js'), 'http');
    assert.equal(phaseOfFrame('x', 'file:///r/dist/src/kv/channel.js'), 'transfer');
    assert.equal(phaseOfFrame('x', 'file:///r/dist/src/engine/prefix-cache.js'), 'save/load');
    assert.equal(phaseOfFrame('x', 'file:///r/dist/src/engine/llama.js'), 'engine');
    assert.equal(phaseOfFrame('x', 'file:///r/dist/src/engine/prompt.js'), 'render');
    assert.equal(phaseOfFrame('writev', ''), undefined);
    assert.equal(phaseOfFrame('emit', 'node:events'), undefined);
  });

  // root → engine fn → builtin (url '') ; root → idle ; root → http fn
  const prof: CpuProfile = {
    nodes: [
      { id: 1, callFrame: { functionName: '(root)', url: '' }, children: [2, 4, 5] },
      { id: 2, callFrame: { functionName: 'evaluate', url: 'file:///r/dist/src/engine/llama.js' }, children: [3] },
      { id: 3, callFrame: { functionName: 'memcpy', url: '' } },
      { id: 4, callFrame: { functionName: '(idle)', url: '' } },
      { id: 5, callFrame: { functionName: 'onRequest', url: 'file:///r/node_modules/fastify/lib/x.js' } },
    ],
    samples: [3, 3, 4, 5, 2],
    timeDeltas: [1000, 1000, 1000, 1000, 1000],
    startTime: 0,
    endTime: 5000,
  };

  it('sums self time per phase, ms, and the idle wall time', () => {
    const b = bucketProfile(prof);
    assert.equal(b.phases.engine, 3, 'two builtin samples under the engine + one of its own');
    assert.equal(b.phases.http, 1);
    assert.equal(b.idleMs, 1);
    assert.equal(b.wallMs, 5);
  });

  it('counts only the samples inside a window', () => {
    const b = bucketProfile(prof, { fromUs: 2500, toUs: 4500 });
    assert.equal(b.phases.engine, 0);
    assert.equal(b.phases.http, 1);
    assert.equal(b.idleMs, 1);
    assert.equal(b.wallMs, 2);
  });

  it('reports per process with the floor', () => {
    const zero = { http: 0, json: 0, tokenize: 0, render: 0, engine: 0, 'save/load': 0, transfer: 0, pdserve: 0, gc: 0, program: 0, other: 0 };
    const lines = phaseReport({ sessions: 30, rounds: 4, floorMs: 20, systems: [{ system: 'pdserve colocated', requests: 120, wallS: 30, processes: [{ name: 'colocated', cpuMs: 40, phases: { ...zero, http: 5 }, nativeMs: 30, waitingMs: 100, profiles: 2 }] }] }, '_p_').join('\n');
    assert.match(lines, /\| pdserve colocated \| \*\*40\*\* \(2\.0× floor\) \| colocated 40 \| 5\.0 \| 30 \|/);
    assert.doesNotMatch(lines, /\| tokenize \|/, 'a phase at 0 everywhere has no column');
    assert.match(lines, /0 everywhere: json, tokenize/);
  });
});
