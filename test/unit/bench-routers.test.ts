/**
 * bench-routers' figures from the client's turn records and the routers' metrics (the run
 * itself starts a cluster: `pdserve bench-routers`): the next turn after the kill judged
 * against the decode of the turn before it, turns in flight at the kill, the cached share on
 * each side, and each goal missed when its figure says so (a router B that served nothing, no
 * load balancer, a request waiting for a slot).
 */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { countersBy, routersGoals, routersSection, routersSummaryRows, sessionFigures, type RoutersResult, type TurnRecord } from '../../src/bench/routers.js';

const D0 = 'http://127.0.0.1:1';
const D1 = 'http://127.0.0.1:2';
/** A completed turn. */
const t = (session: number, turn: number, sentAt: number, doneAt: number, decode: string | null, path = 'decode_local', cached = 80, router: 'A' | 'B' = 'A'): TurnRecord => ({ id: `${session}-${turn}`, session, turn, ok: true, sentAt, doneAt, promptTokens: 100, cachedTokens: cached, decode, path, router });
const streams = { samples: 50, waited: 0, mostWaiting: 0, mostRooms: [4, 4], slots: 4, failed: 0, lagMs: { median: 20, max: 60 }, unseen: 0 };

describe('bench-routers figures', () => {
  it('next turn after the kill: same decode, decode-local, in flight at the kill; a turn without a trace is left out', () => {
    const kill = 1000;
    const turns = [
      // session 0: stays on D0, decode-local
      t(0, 1, 0, 400, D0, 'pd', 0),
      t(0, 2, 500, 900, D0),
      t(0, 3, 1050, 1200, D0, 'decode_local', 90, 'B'),
      // session 1: in flight at the kill, retried onto the other decode through PD
      t(1, 1, 0, 300, D1, 'pd', 0, 'B'),
      t(1, 2, 900, 1500, D0, 'pd', 10, 'B'),
      // session 2: its turn before the kill has no trace
      t(2, 1, 0, 800, null),
      t(2, 2, 1100, 1300, D1, 'decode_local', 90, 'B'),
      // session 3: nothing after the kill
      t(3, 1, 0, 500, D1),
      { id: '3-2', session: 3, turn: 2, ok: false, error: 'x', sentAt: 600, doneAt: 1400, promptTokens: 0, cachedTokens: 0, decode: null, path: null, router: null },
    ];
    const f = sessionFigures(turns, kill, 4);
    assert.deepEqual({ next: f.nextTurns, same: f.sameDecode, local: f.decodeLocal, inFlight: f.inFlight, unknown: f.unknown, failed: f.failedClient }, { next: 2, same: 1, local: 1, inFlight: 1, unknown: 1, failed: 1 });
    assert.deepEqual(f.beforeByRouter, { A: 4, B: 1 });
    assert.equal(f.cachedBefore, 80 / 100, 'turn 2 of session 0');
    assert.equal(f.cachedAfter, (90 + 10 + 90) / 300);
    const goals = routersGoals('nginx', streams, f, turns.length, { ok: 12 }, 3);
    assert.deepEqual(
      goals.map((g) => g.met),
      [false, false, true, false, true],
      goals.map((g) => `${g.goal}: ${g.figure}`).join('\n'),
    );
    assert.match(goals[0]!.figure, /^1 of 2 \(50\.0 %\); 1 served decode-local on the kept sequence; 1 were in flight at the kill; 1 without a trace, left out$/);
    assert.match(goals[1]!.figure, /80\.0 % before, 63\.3 % after \(16\.7 points drop\)/);
  });

  it('the next turn is the first routed after the kill: a turn routed before it and finishing after is the one before', () => {
    const kill = 1000;
    const turns = [
      t(0, 1, 0, 400, D0, 'pd', 0),
      // routed to D1 by B before the kill, done after it: no decision of the kill's aftermath
      { ...t(0, 2, 800, 1100, D1, 'pd', 10, 'B'), routedAt: 820 },
      // routed after the kill: judged against turn 2's decode
      { ...t(0, 3, 1200, 1400, D1, 'decode_local', 90, 'B'), routedAt: 1210 },
      // in flight at the kill, retried through B after it: the retry's dispatch counts
      t(1, 1, 0, 300, D0, 'pd', 0),
      { ...t(1, 2, 900, 1500, D0, 'decode_local', 90, 'B'), routedAt: 1050 },
    ];
    const f = sessionFigures(turns, kill, 2);
    assert.deepEqual({ next: f.nextTurns, same: f.sameDecode, inFlight: f.inFlight }, { next: 2, same: 2, inFlight: 1 });
    // by completion alone session 0's turn 2 would have been the next turn, on another decode
    const byDone = sessionFigures(turns.map(({ routedAt: _, ...r }) => r), kill, 2);
    assert.deepEqual({ next: byDone.nextTurns, same: byDone.sameDecode }, { next: 2, same: 1 });
  });

  it("BENCHMARKS §9: the summary shows each figure's headline, the section the whole figure; no run: not run yet", () => {
    const turns = [t(0, 1, 0, 100, D0, 'pd', 0), t(0, 2, 200, 300, D0), t(0, 3, 400, 600, D1, 'pd', 10, 'B')];
    const f = sessionFigures(turns, 350, 1);
    const goals = routersGoals('nginx', streams, f, 3, { ok: 5 }, 2);
    const r = { lb: 'nginx', options: { sessions: 1, turns: 3 }, wallS: 20, loadavg: [1, 2, 3], cores: 2, streams, sessions: { ...f, killAt: 350, turns, throughB: { ok: 5 }, sdkRetried: 2, picksAfterB: { cache_hit: 1 } }, goals } as unknown as RoutersResult;
    const rows = routersSummaryRows(r);
    assert.deepEqual(rows.map((x) => x.figure), ['0 of 1', '80.0 % before, 10.0 % after', '0 failed of 5', '0 failed of 3 turns', '0 of 50 load samples']);
    assert.deepEqual(rows.map((x) => x.met), goals.map((g) => g.met));
    const text = routersSection(r, '_prov_').join('\n');
    assert.match(text, /^_prov_\n/);
    assert.match(text, /on 2 cores/);
    assert.match(text, /router A SIGKILLed at 0\.3 s/);
    assert.deepEqual(routersSection(undefined, '_prov_'), ['_Not run yet._']);
  });

  it('every goal met; and each missed by its own figure', () => {
    const turns = [t(0, 1, 0, 100, D0, 'pd', 0), t(0, 2, 200, 300, D0), t(0, 3, 400, 600, D0, 'decode_local', 90, 'B')];
    const f = sessionFigures(turns, 350, 1);
    assert.deepEqual(
      routersGoals('nginx', streams, f, 3, { ok: 5 }, 2).map((g) => g.met),
      [true, true, true, true, true],
    );
    const missed = (g: ReturnType<typeof routersGoals>) => g.filter((x) => !x.met).map((x) => x.goal.slice(0, 20));
    assert.deepEqual(missed(routersGoals('none', streams, f, 3, { ok: 5 }, 2)), ["behind nginx, the op"], 'no load balancer: not measured, so not met');
    assert.deepEqual(missed(routersGoals('nginx', streams, f, 3, { ok: 5, error: 1 }, 2)), ['requests through B: '], 'a failure through B');
    assert.deepEqual(missed(routersGoals('nginx', streams, f, 3, {}, 2)), ['requests through B: '], 'B served nothing: not a pass');
    assert.deepEqual(missed(routersGoals('nginx', { ...streams, waited: 2, mostWaiting: 1 }, f, 3, { ok: 5 }, 2)), ['2 routers × 4 stream'], 'a request waited while a slot was free');
    assert.deepEqual(missed(routersGoals('nginx', { ...streams, samples: 0 }, f, 3, { ok: 5 }, 2)), ['2 routers × 4 stream'], 'no load samples: not a pass');
  });

  it('counters by label from a /metrics text', () => {
    const text = [
      '# HELP pdserve_router_requests_total x',
      'pdserve_router_requests_total{outcome="ok"} 7',
      'pdserve_router_requests_total{outcome="error"} 2',
      'pdserve_router_policy_picks_total{role="decode",policy="cache_aware",reason="cache_hit"} 5',
      'pdserve_router_policy_picks_total{role="prefill",policy="cache_aware",reason="cache_hit"} 9',
      'pdserve_router_policy_picks_total{role="decode",policy="cache_aware",reason="affinity"} 1',
    ].join('\n');
    assert.deepEqual(countersBy(text, 'pdserve_router_requests_total', 'outcome'), { ok: 7, error: 2 });
    assert.deepEqual(countersBy(text, 'pdserve_router_policy_picks_total', 'reason', 'role="decode"'), { cache_hit: 5, affinity: 1 });
  });
});
