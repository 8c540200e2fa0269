/**
 * The clock seam (src/base/clock.ts): the product reads time only through it, durations on the
 * monotonic clock and dates on the wall clock, and the views that show monotonic instants to
 * people (/debug/rooms timelines, the dashboard's time axis) turn them into dates at read time.
 */
import assert from 'node:assert/strict';
import { readdirSync, readFileSync, statSync } from 'node:fs';
import { dirname, join, relative, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { test } from 'node:test';
import { systemClock, wallOf, type Clock } from '../../src/base/clock.js';
import { RoomTable } from '../../src/kv/lifecycle.js';
import { DEFAULT_TIMEOUTS } from '../../src/kv/types.js';
import { DashboardSeries } from '../../src/router/dashboard-series.js';
import { Heartbeat } from '../../src/kv/heartbeat.js';

const SRC = resolve(dirname(fileURLToPath(import.meta.url)), '../../src');
const walk = (d: string): string[] => readdirSync(d).flatMap((n) => (statSync(join(d, n)).isDirectory() ? walk(join(d, n)) : n.endsWith('.ts') ? [join(d, n)] : []));

/** A clock whose wall time can be stepped apart from its monotonic time, as NTP or `date -s` does. */
function steppable(mono = 5_000, wall = 1_700_000_000_000): Clock & { advance(ms: number): void; step(ms: number): void } {
  return {
    nowMs: () => mono,
    wallMs: () => wall,
    advance(ms) {
      mono += ms;
      wall += ms;
    },
    step(ms) {
      wall += ms;
    },
  };
}

test('the product reads time only through src/base/clock.ts (the bench, storm and simulator tools aside)', () => {
  const reads = /\bDate\.now\(|\bperformance\.now\(|\bprocess\.hrtime\b|\bnew Date\(\)/;
  const found: string[] = [];
  for (const f of walk(SRC)) {
    const rel = relative(SRC, f);
    if (rel === 'base/clock.ts' || ['bench/', 'storm/', 'up/', 'sim/'].some((t) => rel.startsWith(t))) continue;
    readFileSync(f, 'utf8')
      .split('\n')
      .forEach((line, i) => {
        const code = line.trim();
        if (!code.startsWith('*') && !code.startsWith('//') && !code.startsWith('/*') && reads.test(code)) found.push(`${rel}:${i + 1}: ${code}`);
      });
  }
  assert.deepEqual(found, []);
});

test('systemClock: nowMs is monotonic and process-relative, wallMs is the epoch clock', () => {
  const a = systemClock.nowMs();
  const b = systemClock.nowMs();
  assert.ok(b >= a && a < process.uptime() * 1000 + 1000, 'nowMs counts from this process, not from 1970');
  assert.ok(Math.abs(systemClock.wallMs() - Date.now()) < 1000);
  const c = steppable(1000, 50_000);
  assert.equal(wallOf(c, 400), 49_400);
});

test('a wall-clock step moves neither room deadlines nor ages; /debug/rooms dates follow the wall clock', () => {
  const clock = steppable();
  const rooms = new RoomTable('prefill', DEFAULT_TIMEOUTS);
  rooms.create('1', 'r1', clock.nowMs(), 'peer');
  const created = clock.wallMs();
  clock.advance(2_000);
  clock.step(10 * 60_000);
  assert.deepEqual(rooms.tick(clock.nowMs()), [], 'no room expires on a forward step');
  let snap = rooms.snapshot(clock.nowMs(), clock.wallMs());
  assert.equal(snap.live[0]!.age_ms, 2_000);
  assert.equal(snap.live[0]!.deadline_ms, DEFAULT_TIMEOUTS.bootstrapMs - 2_000);
  assert.equal(snap.now, clock.wallMs(), 'now is a date');
  assert.equal(snap.live[0]!.timeline[0]!.at, created + 10 * 60_000, 'a timeline entry is shown on the current wall clock');
  clock.step(-20 * 60_000);
  snap = rooms.snapshot(clock.nowMs(), clock.wallMs());
  assert.equal(snap.live[0]!.age_ms, 2_000, 'no negative age on a backward step');
  assert.equal(snap.now - snap.live[0]!.timeline[0]!.at, 2_000);
  clock.advance(DEFAULT_TIMEOUTS.bootstrapMs);
  assert.equal(rooms.tick(clock.nowMs()).filter((e) => e.t === 'expired').length, 1, 'the deadline still holds on the monotonic clock');
});

test('the heartbeat does not lose a peer or report a stall when only the wall clock steps', () => {
  const clock = steppable();
  const hb = new Heartbeat(1000, 2, clock);
  clock.advance(hb.nextCheckInMs());
  clock.step(10 * 60_000);
  hb.received();
  assert.deepEqual(hb.check(), { k: 'ok' });
});

test('DashboardSeries: buckets on the monotonic clock, labels on the wall clock', () => {
  const s = new DashboardSeries(1000, 5);
  s.add({ outcome: 'ok', completion_tokens: 4 }, 10_000);
  s.add({ outcome: 'ok', completion_tokens: 6 }, 10_500);
  // the wall clock stepped back 10 minutes in between: same bucket, labels on the current wall clock
  const v = s.view(10_900, 1_700_000_000_900);
  assert.equal(v.tokens_per_s.at(-1), 10);
  assert.equal(v.t.at(-1), 1_700_000_000);
});
