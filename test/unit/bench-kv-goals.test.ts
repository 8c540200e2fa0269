/**
 * The handoff goals of BENCHMARKS.md's summary (src/bench/report-kv.ts): each judged on its own
 * size range over §1's table and its large states — TCP ≤ 1.3 × at 16 MiB – 1 GiB, ≤ 1.1 × at
 * ≥ 256 MiB, same host ≤ 1.1 × at ≥ 4 MiB — with the sizes outside a range not judged (left out of the summary row),
 * a missing table named, and a size without a floor never judged.
 */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import type { KvSectionResult } from '../../src/bench/kv.js';
import { handoffGoals, KV_GOALS, rangeGoal } from '../../src/bench/report-kv.js';
import type { SectionFile } from '../../src/bench/util.js';

const MiB = 1024 * 1024;
type Size = KvSectionResult['sizes'][number];
/** A §1 size with the given goal ratios (TCP `tcp`, same host `sh`); `noFloor`: raw TCP slower than the handoff. */
const sz = (mib: number, tcp: number, sh?: number, noFloor = false): Size =>
  ({
    targetMiB: mib,
    blobBytes: mib * MiB + 1234,
    goalRatio: tcp,
    kvMs: { median: 100 },
    rawMs: { median: noFloor ? 200 : 50 },
    ...(sh === undefined ? {} : { sameHostGoalRatio: sh }),
    loopDelayMs: { kv: { senderP99: 10, receiverP99: 6, senderMax: 40, receiverMax: 30 }, sameHost: { senderP99: 2, receiverP99: 1.5, senderMax: 3, receiverMax: 2 } },
  }) as unknown as Size;
const file = (section: number, commit: string, sizes: Size[]): SectionFile => ({ section, meta: { date: '2026-12-07T00:00:00Z', quick: false, commit, seconds: 10, loadavg: [1, 1, 1] }, result: { sizes } });
const row = (rows: string[][], start: string) => {
  const r = rows.find((x) => x[0]!.startsWith(start));
  assert.ok(r, `a row "${start}…" in ${JSON.stringify(rows.map((x) => x[0]))}`);
  return r;
};

describe('handoff goals: each judged on its own size range', () => {
  const s1 = file(1, 'abc1234', [sz(1, 3.4, 1.41), sz(4, 1.62, 1.09), sz(16, 1.25, 1.05), sz(64, 1.2, 1.02)]);
  const large = file(11, 'abc1234', [sz(256, 1.08, 1.03), sz(1024, 1.09, 1.01)]);

  it('TCP ≤ 1.3 × at 16 MiB – 1 GiB: 1 and 4 MiB far above the limit are not judged (left out of the row); §1 and the large states together pass', () => {
    const [, measured, verdict] = row(handoffGoals(s1, large, undefined), 'KV handoff over TCP ≤ 1.3');
    assert.equal(verdict, '**pass**');
    assert.match(measured!, /^16 MiB 1\.25×, 64 MiB 1\.20×; 256 MiB 1\.08×, 1\.00 GiB 1\.09×$/);
  });

  it('a judged size above its limit misses, whichever table it is in', () => {
    const bigMiss = file(11, 'abc1234', [sz(256, 1.35, 1.03), sz(1024, 1.09, 1.01)]);
    assert.equal(row(handoffGoals(s1, bigMiss, undefined), 'KV handoff over TCP ≤ 1.3')[2], '**miss**');
    const smallMiss = file(1, 'abc1234', [sz(1, 1, 1), sz(4, 1, 1.2), sz(16, 1.31, 1), sz(64, 1, 1)]);
    assert.equal(row(handoffGoals(smallMiss, large, undefined), 'KV handoff over TCP ≤ 1.3')[2], '**miss**');
    assert.equal(row(handoffGoals(smallMiss, large, undefined), 'same-host handoff')[2], '**miss**', '4 MiB is inside the same-host range');
  });

  it('TCP ≤ 1.1 × at ≥ 256 MiB judges the large states alone (§1 at 1.25× does not count)', () => {
    const r = row(handoffGoals(s1, large, undefined), 'KV handoff over TCP ≤ 1.1');
    assert.deepEqual(r.slice(1), ['256 MiB 1.08×, 1.00 GiB 1.09×', '**pass**']);
    const one = file(11, 'abc1234', [sz(256, 1.12), sz(1024, 1.05)]);
    assert.equal(row(handoffGoals(s1, one, undefined), 'KV handoff over TCP ≤ 1.1')[2], '**miss**');
  });

  it('same host ≤ 1.1 × at ≥ 4 MiB: 1 MiB at 1.41× is not judged; the large states count', () => {
    const [, measured, verdict] = row(handoffGoals(s1, large, undefined), 'same-host handoff');
    assert.equal(verdict, '**pass**');
    assert.match(measured!, /^4 MiB 1\.09×, 16 MiB 1\.05×, 64 MiB 1\.02×; 256 MiB 1\.03×, 1\.00 GiB 1\.01×$/);
    const bad = file(11, 'abc1234', [sz(256, 1, 1.2), sz(1024, 1, 1.01)]);
    assert.equal(row(handoffGoals(s1, bad, undefined), 'same-host handoff')[2], '**miss**');
  });

  it('without the large states: a pass is only "so far" and names what is missing; the ≥ 256 MiB goal is not measured', () => {
    const rows = handoffGoals(s1, undefined, undefined);
    assert.equal(row(rows, 'KV handoff over TCP ≤ 1.3')[2], 'pass so far (§1 large states not measured)');
    assert.equal(row(rows, 'same-host handoff')[2], 'pass so far (§1 large states not measured)');
    assert.deepEqual(row(rows, 'KV handoff over TCP ≤ 1.1').slice(1), ['n/a', 'not measured']);
    assert.deepEqual(row(rows, 'event-loop delay').slice(1), ['n/a', 'not measured']);
  });

  it('nothing measured: every handoff goal is stated as not measured', () => {
    const rows = handoffGoals(undefined, undefined, undefined);
    assert.equal(rows.length, 5);
    for (const r of rows) assert.equal(r[2], 'not measured', r[0]);
  });

  it('a size whose raw TCP was slower than the handoff is shown without a verdict (no floor)', () => {
    const noFloor = file(11, 'abc1234', [sz(256, 1.5, 1.03, true), sz(1024, 1.09, 1.01)]);
    const [, measured, verdict] = row(handoffGoals(s1, noFloor, undefined), 'KV handoff over TCP ≤ 1.3');
    assert.equal(verdict, '**pass**');
    assert.match(measured!, /256 MiB 1\.50× \(raw TCP slower than the handoff: no floor, not judged\)/);
  });

  it('tables from runs on different commits are named with their commits', () => {
    const other = file(11, 'def5678', large.result ? (large.result as KvSectionResult).sizes : []);
    const measured = row(handoffGoals(s1, other, undefined), 'KV handoff over TCP ≤ 1.3')[1]!;
    assert.match(measured, /64 MiB 1\.20× \(§1, abc1234\); 256 MiB 1\.08×, 1\.00 GiB 1\.09× \(§1 large states, def5678\)/);
  });

  it('the same-host row says so when the probe failed (no same-host figures at all)', () => {
    const tcpOnly = file(1, 'abc1234', [sz(4, 1.5), sz(16, 1.2)]);
    assert.match(row(handoffGoals(tcpOnly, undefined, undefined), 'same-host handoff')[1]!, /failed the same-host probe/);
  });

  it('rangeGoal: the range bounds are inclusive; outside both ends is not judged (left out of the row)', () => {
    const g = { limit: 1.1, fromMiB: 4, toMiB: 64 };
    const r = rangeGoal('g', g, [{ what: 't', figures: [{ targetMiB: 1, label: '1', ratio: 9 }, { targetMiB: 4, label: '4', ratio: 1.1 }, { targetMiB: 64, label: '64', ratio: 1.1 }, { targetMiB: 256, label: '256', ratio: 9 }] }]);
    assert.deepEqual(r, ['g', '4 1.10×, 64 1.10×', '**pass**']);
    assert.equal(KV_GOALS.tcp.fromMiB, 16);
    assert.equal(KV_GOALS.sameHost.fromMiB, 4);
  });
});
