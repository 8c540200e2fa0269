/**
 * The deterministic simulator (src/sim) over many seeds: the real lifecycle rule must survive
 * every interleaving with no violation; the legacy max(old, new) rule must be caught wedging.
 *
 * The worlds run the shipped effect executors (src/prefill/effects.ts, src/decode/effects.ts) over
 * the simulator's fake ports, same-host handoffs and mid-stream migrations included; some worlds
 * have two decode workers (a migration goes to the other one) and KV connections striped over two
 * sockets (the shipped reassembly, src/kv/stripes.ts, on the decode end).
 *
 * PDSERVE_SIM_SEEDS=<n> runs more (or fewer) seeds for the real rule (default 1,000).
 * PDSERVE_SIM_FROM=<s> changes the first seed (default 1).
 */
import { newRoomId } from '../../src/base/room-id.js';
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { findFirstWedge, formatFailure, interleaving, runSeeds, runSim, simMain } from '../../src/sim/index.js';
import { Prng } from '../../src/base/prng.js';
import { DecodeEffects } from '../../src/decode/effects.js';
import { PrefillEffects } from '../../src/prefill/effects.js';
import { StripeReorder } from '../../src/kv/stripes.js';
import { AttemptPlan, type PlanState } from '../../src/router/plan.js';
import { DEFAULT_MIGRATION_LIMIT } from '../../src/router/config.js';
import { Heartbeat } from '../../src/kv/heartbeat.js';
import { SendRotation } from '../../src/kv/send-rotation.js';

const SEEDS = Number(process.env.PDSERVE_SIM_SEEDS ?? 1_000);
const FROM = Number(process.env.PDSERVE_SIM_FROM ?? 1);
/** Seeds within which the legacy rule must show the incident's wedge. */
const LEGACY_BOUND = 2_000;

test('PRNG is deterministic and roughly uniform', () => {
  const a = new Prng(7);
  const b = new Prng(7);
  const xs = Array.from({ length: 1000 }, () => a.u32());
  assert.deepEqual(xs, Array.from({ length: 1000 }, () => b.u32()));
  assert.notDeepEqual(xs.slice(0, 10), Array.from({ length: 10 }, () => new Prng(8).u32()));
  const r = new Prng(1);
  const buckets = [0, 0, 0, 0];
  for (let i = 0; i < 40_000; i++) buckets[r.int(0, 3)]!++;
  for (const c of buckets) assert.ok(c > 9_000 && c < 11_000, `bucket ${c}`);
  assert.match(newRoomId(() => new Prng(3).u64()), /^[1-9]\d{0,18}$/);
});

test('a seed replays exactly (same trace, same verdict, with or without tracing)', async () => {
  for (const seed of [1, 2, 3, 99, 12345]) {
    const a = await runSim({ seed, trace: true });
    const b = await runSim({ seed, trace: true });
    assert.deepEqual(a, b);
    assert.deepEqual((await runSim({ seed })).stats, a.stats);
  }
  const l1 = await runSim({ seed: 5, legacy: true, trace: true });
  assert.deepEqual(await runSim({ seed: 5, legacy: true, trace: true }), l1);
});

test(`real rule: ${SEEDS} seeds, no violation`, async () => {
  const res = await runSeeds(FROM, SEEDS, { rooms: 12, printFailures: 3 });
  const t = res.totals;
  console.log(
    `sim: ${res.ran} seeds in ${(res.elapsedMs / 1000).toFixed(1)} s (${res.seedsPerSec.toFixed(0)} seeds/s); ` +
      `${t.requests} requests: ${t.success} ok, ${t.failed} failed; ${t.aborts} aborts, ${t.crashes} crashes, ${t.expired} deadlines, ${t.late} late events, ${t.illegal} refused writes, ` +
      `${t.sameHost} same-host handoffs (${t.fileRefused} refused), ${t.migrated} migrations (${t.migratedSuccess} completed, ${t.migratedAcross} to the other decode), ` +
      `${t.twoDecodes} worlds of two decodes, ${t.striped} striped (${t.stripeChunks} chunks on stripe 2, ${t.stripeHeld} held out of order, ${t.stripeLost} stripes lost), ${t.events} events`,
  );
  // The worlds must actually exercise the hard paths, or "no violation" means nothing.
  assert.ok(t.success > t.requests * 0.3, 'enough requests complete');
  assert.ok(t.aborts > SEEDS, 'aborts happen');
  assert.ok(t.crashes > SEEDS / 20, 'crashes happen');
  assert.ok(t.late > 0, 'late writes are refused as benign races (the incident ordering occurs)');
  assert.ok(t.expired > 0, 'deadlines fire');
  // Decode-local rooms (decode alone, the core's local_prefill) run under the same faults.
  assert.ok(t.local > SEEDS && t.localSuccess > 0 && t.localSuccess < t.local, `decode-local requests exercised: ${t.localSuccess} of ${t.local} ok`);
  // Choice groups (n > 1: one prefill computation, 2–3 rooms) ran, and most of their rooms got the shared state.
  assert.ok(t.grouped > SEEDS && t.groupedSuccess > t.grouped / 3, `choice-group rooms exercised: ${t.groupedSuccess} of ${t.grouped} ok`);
  // The same-host path (kv_file, take_file) in half the worlds, and decodes killed mid-stream whose requests migrate.
  assert.ok(t.sameHost > SEEDS, `same-host handoffs exercised: ${t.sameHost}`);
  // A loaded state's file stays until the room's first decode step and goes there (its unlink is off the step's core time).
  assert.ok(t.filesHeldToFirstStep > SEEDS / 2, `state files held to the first decode step: ${t.filesHeldToFirstStep}`);
  assert.ok(t.migrated > SEEDS / 200 && t.migratedSuccess > 0, `migrations exercised: ${t.migratedSuccess} of ${t.migrated} completed`);
  // Worlds of two decodes (rooms of both on one prefill, migration to the other) and striped KV connections.
  assert.ok(t.twoDecodes > SEEDS / 6 && t.migratedAcross > 0, `two-decode worlds: ${t.twoDecodes}, migrations to the other decode: ${t.migratedAcross}`);
  assert.ok(t.striped > SEEDS / 8 && t.stripeChunks > SEEDS / 4 && t.stripeHeld > 0 && t.stripeLost > SEEDS / 12, `striped worlds: ${t.striped}, stripe-2 chunks ${t.stripeChunks}, held ${t.stripeHeld}, lost ${t.stripeLost}`);
  assert.deepEqual(
    res.failures.map((f) => f.seed),
    [],
    `failing seeds (replay with: pdserve sim --from <seed> --seeds 1 --verbose): ${JSON.stringify(res.violationsByKind)}`,
  );
});

test('real rule, larger worlds and harsh network: no violation', async () => {
  const big = await runSeeds(FROM + 1_000_000, 100, { rooms: 40, printFailures: 2 });
  const harsh = await runSeeds(FROM + 2_000_000, 300, { rooms: 12, faults: 'harsh', slots: 1, printFailures: 2 });
  assert.deepEqual([...big.failures, ...harsh.failures].map((f) => f.seed), []);
});

test('two decodes, striped KV connections over the network: no violation, out-of-order stripes reassembled, a lost stripe fails only its rooms', async () => {
  // Cross-host (chunks, not kv_file) so every transfer is striped; one calm set (stripes reorder only by their own sockets) and one harsh.
  const calm = await runSeeds(FROM + 3_000_000, 80, { rooms: 12, decodes: 2, kvStreams: 2, sameHost: false, faults: 'calm', printFailures: 2 });
  const harsh = await runSeeds(FROM + 4_000_000, 60, { rooms: 12, decodes: 2, kvStreams: 2, sameHost: false, faults: 'harsh', printFailures: 2 });
  assert.deepEqual([...calm.failures, ...harsh.failures].map((f) => f.seed), []);
  for (const t of [calm.totals, harsh.totals]) {
    assert.ok(t.stripeChunks > 0 && t.stripeHeld > 0 && t.stripeLost > 0, `stripes exercised: ${JSON.stringify(t)}`);
    assert.ok(t.success > t.requests * 0.3, `enough requests complete over striped connections: ${t.success} of ${t.requests}`);
  }
  // Calm worlds lose no frame: what fails there is aborts, crashes, engine failures, the lost stripe and deadlines, never the reassembly.
  assert.ok(calm.totals.success > calm.totals.requests * 0.6, `calm striped worlds: ${calm.totals.success} of ${calm.totals.requests} ok`);
});

test(`legacy max rule: the simulator finds the incident's wedge within ${LEGACY_BOUND} seeds`, async () => {
  // The incident: abort → Failed(0); the transfer continuation writes Transferring(3) and the max
  // rule revives the room; the abort dropped its transfer info so the worker skips it; the
  // watchdog's Failed write is swallowed (max(3, 0) = 3): non-terminal forever.
  const res = await findFirstWedge(1, LEGACY_BOUND, { legacy: true, rooms: 12, revivedOnly: true });
  assert.ok(res.matched, `no revived wedge in ${LEGACY_BOUND} legacy seeds`);
  const r = res.matched;
  const v = r.violations.find((x) => x.kind === 'wedge' && x.revived)!;
  console.log(`legacy: first revived wedge at seed ${r.seed} (after ${res.ran} seeds)\n${formatFailure(r)}`);
  const story = interleaving(r, v.room).filter((e) => e.who === v.node).map((e) => e.text);
  const iFail = story.findIndex((s) => s.includes('→ Failed/done'));
  const iRevive = story.findIndex((s) => s.includes('REVIVED'));
  // The watchdog's own Failed write swallowed (other writes — a peer's FAIL for the already Failed room — may be swallowed earlier).
  const iSwallow = story.findIndex((s) => s.startsWith('watchdog: Failed write') && s.includes('swallowed'));
  assert.ok(iFail >= 0 && iRevive > iFail && iSwallow > iRevive, `interleaving Failed → revived → swallowed:\n${story.join('\n')}`);
  // The same seed under the real rule is clean.
  assert.equal((await runSim({ seed: r.seed, rooms: 12 })).ok, true);
});

test('legacy max rule: the very first failing seed is a wedge too', async () => {
  const res = await findFirstWedge(1, LEGACY_BOUND, { legacy: true, rooms: 12 });
  assert.ok(res.matched);
  const v = res.matched.violations.find((x) => x.kind === 'wedge')!;
  console.log(`legacy: first wedge of any kind at seed ${res.matched.seed}: ${v.node} ${v.label} ${v.detail}`);
});

test('the worlds run the shipped executors: a release planted out of one is caught', async () => {
  // Decode's executor forgets a failed room's receive buffer; prefill's never deletes a computation's state file.
  const d = DecodeEffects.prototype as unknown as { finish(a: { room: string }): void };
  const p = PrefillEffects.prototype as unknown as { dropState(comp: unknown): void };
  const finish = d.finish;
  const dropState = p.dropState;
  d.finish = function (this: { job(room: string): { recv?: unknown } | undefined }, a) {
    const job = this.job(a.room);
    if (job) job.recv = undefined;
    return finish.call(this, a);
  };
  p.dropState = () => {};
  try {
    const res = await runSeeds(FROM, 40, { rooms: 12, log: null });
    const leaks = res.failures.flatMap((f) => f.violations).filter((v) => v.kind === 'leak');
    assert.ok(leaks.some((v) => v.node === 'D' && /recvbuf/.test(v.detail)), 'decode receive buffer leak found');
    assert.ok(leaks.some((v) => v.node === 'P' && /statefile/.test(v.detail)), 'prefill state file leak found');
  } finally {
    d.finish = finish;
    p.dropState = dropState;
  }
  assert.equal((await runSeeds(FROM, 40, { rooms: 12, log: null })).failures.length, 0);
});

test('the striped worlds run the shipped reassembly: a bypass planted in it is caught', async () => {
  // StripeReorder hands every chunk and kv_end on as it arrives, as if the sockets were one.
  const r = StripeReorder.prototype as unknown as { chunk(room: string, offset: number, data: Buffer): void; end(...a: unknown[]): boolean };
  const { chunk, end } = r;
  r.chunk = function (this: { sink: { chunk(room: string, offset: number, data: Buffer): void } }, room, offset, data) {
    this.sink.chunk(room, offset, data);
  };
  r.end = () => true;
  const opts = { rooms: 12, decodes: 2, kvStreams: 2, sameHost: false, faults: 'calm', log: null } as const;
  try {
    const res = await runSeeds(FROM + 3_000_000, 30, opts);
    assert.ok((res.violationsByKind.misordered ?? 0) > 0, `misordered hand-ons found: ${JSON.stringify(res.violationsByKind)}`);
  } finally {
    r.chunk = chunk;
    r.end = end;
  }
  assert.equal((await runSeeds(FROM + 3_000_000, 30, opts)).failures.length, 0);
});

/**
 * Plant a bug in one rule of the router's attempt plan (src/router/plan.ts, the object the worlds'
 * router asks) for the duration of `fn`.
 */
async function withPlanted<K extends 'budgetAllows' | 'inTime' | 'retry'>(rule: K, bug: AttemptPlan[K], fn: () => Promise<void>): Promise<void> {
  const proto = AttemptPlan.prototype as unknown as Record<K, AttemptPlan[K]>;
  const shipped = proto[rule];
  proto[rule] = bug;
  try {
    await fn();
  } finally {
    proto[rule] = shipped;
  }
}

test("the worlds' router runs the shipped attempt plan: an off-by-one in its migration budget is caught", async () => {
  // Limit 0: no request may migrate at all; the planted rule lets one more through than the budget.
  const opts = { rooms: 12, migrationLimit: 0, log: null } as const;
  await withPlanted('budgetAllows', function (this: AttemptPlan, s: PlanState) {
    return s.left >= 0;
  }, async () => {
    const res = await runSeeds(FROM, 300, opts);
    assert.ok((res.violationsByKind.over_budget ?? 0) > 0, `over-budget migrations found: ${JSON.stringify(res.violationsByKind)}`);
  });
  const clean = await runSeeds(FROM, 300, opts);
  assert.equal(clean.failures.length, 0);
  assert.equal(clean.totals.migrated, 0, 'limit 0: no migration');
});

test("the worlds' router runs the shipped attempt plan: a migration after the request's deadline is caught", async () => {
  // Short deadlines, so decodes die after them; the planted rule forgets the deadline.
  const opts = { rooms: 12, requestTimeoutMs: 150, log: null } as const;
  await withPlanted('inTime', () => true, async () => {
    const res = await runSeeds(FROM, 300, opts);
    assert.ok((res.violationsByKind.late_attempt ?? 0) > 0, `late migrations found: ${JSON.stringify(res.violationsByKind)}`);
  });
  assert.equal((await runSeeds(FROM, 300, opts)).failures.length, 0);
});

test("the worlds' router asks the shipped attempt plan on retries too: a retry that spends no budget, or is answered as a migration, is caught", async () => {
  // A worker dies under requests whose client has nothing yet: the router asks the plan, which
  // answers `retry` (run again from the start) while the budget lasts.
  const opts = { rooms: 12, migrationLimit: 1, log: null } as const;
  const clean = await runSeeds(FROM, 300, opts);
  assert.equal(clean.failures.length, 0, JSON.stringify(clean.failures.map((f) => f.violations[0])));
  assert.ok(clean.totals.retried > 0 && clean.totals.retriedSuccess > 0, `retries ran and completed: ${clean.totals.retried} / ${clean.totals.retriedSuccess}`);
  // The planted retry branch forgets to spend the budget: a request whose workers keep dying runs again past its limit.
  await withPlanted('retry', function (this: AttemptPlan, s: PlanState) {
    return { next: 'retry', state: s };
  }, async () => {
    const res = await runSeeds(FROM, 300, { ...opts, faults: 'harsh' });
    assert.ok((res.violationsByKind.over_budget ?? 0) > 0, `over-budget retries found: ${JSON.stringify(res.violationsByKind)}`);
  });
  // The planted retry branch answers `migrate`: a migration of a request whose client has nothing.
  await withPlanted('retry', function (this: AttemptPlan, s: PlanState, code: string) {
    return this.migrate(s, code);
  }, async () => {
    const res = await runSeeds(FROM, 300, opts);
    assert.ok((res.violationsByKind.wrong_redispatch ?? 0) > 0, `retries answered as migrations found: ${JSON.stringify(res.violationsByKind)}`);
  });
});

test("the worlds' router takes the router's migration limit (no limit of its own)", () => {
  assert.equal(new AttemptPlan().migrationLimit, DEFAULT_MIGRATION_LIMIT);
  // A request in state s fails once its counted budget is spent, migrates while it lasts.
  const plan = new AttemptPlan({ migrationLimit: 2 });
  let s = plan.start(1_000);
  const ev = { code: 'decode_failed', status: 502, output: true, attemptOutput: true, local: false, now: 0 };
  const seen: string[] = [];
  for (let i = 0; i < 3; i++) {
    const d = plan.next(s, ev);
    seen.push(d.next);
    s = d.state;
  }
  assert.deepEqual(seen, ['migrate', 'migrate', 'fail']);
  // Unreached workers use their own budget first; a 4xx, the router's own timeout and a late failure never run again.
  assert.equal(plan.next(plan.start(1_000), { ...ev, code: 'decode_unreachable' }).state.left, 2);
  assert.equal(plan.next(plan.start(1_000), { ...ev, status: 400, code: 'invalid_request' }).next, 'fail');
  assert.equal(plan.next(plan.start(1_000), { ...ev, status: 504, code: 'timeout' }).next, 'fail');
  assert.equal(plan.next(plan.start(1_000), { ...ev, now: 960 }).next, 'fail');
  assert.equal(plan.next(plan.start(1_000), { ...ev, output: false }).next, 'retry');
  assert.deepEqual(plan.next(plan.start(1_000), { ...ev, code: 'needs_prefill', status: 409, local: true, attemptOutput: false }), { next: 'fallback', state: plan.start(1_000) });
});

test('simMain: exit codes and output', async () => {
  const lines: string[] = [];
  assert.equal(await simMain(['--seeds', '20', '--from', '3'], (l) => lines.push(l)), 0);
  assert.match(lines.at(-1)!, /^ok: 20 seeds from 3 .* seeds\/s/);
  lines.length = 0;
  assert.equal(await simMain(['--seeds', '200', '--legacy'], (l) => lines.push(l)), 1);
  assert.match(lines.join('\n'), /SIM seed \d+ \(legacy max rule\) FAILED[\s\S]*replay: pdserve sim --from \d+ --seeds 1 --legacy --verbose/);
  lines.length = 0;
  assert.equal(await simMain(['--seed', '4'], (l) => lines.push(l)), 0);
  assert.match(lines.join('\n'), /full trace:/);
  assert.equal(await simMain(['--seeds'], () => {}), 2);
  assert.equal(await simMain(['--seeds', 'x'], () => {}), 2);
});

test("the worlds run the shipped connection core: a planted bug in the heartbeat's stall rule is caught", async () => {
  // The stall rule reads any lateness, even none, as this process's own stall: the peer's budget
  // restarts at every check, so a crashed peer is never found and its rooms are never failed.
  const hb = Heartbeat.prototype as unknown as { check(): unknown };
  const check = hb.check;
  hb.check = function (this: { clock: { nowMs(): number }; dueAt: number; lastRx: number }) {
    const now = this.clock.nowMs();
    this.lastRx = now;
    return { k: 'stalled', lateMs: Math.round(now - this.dueAt) };
  };
  try {
    const res = await runSeeds(FROM, 120, { rooms: 12, log: null });
    assert.ok((res.violationsByKind.peer_loss_late ?? 0) > 0, `a crashed peer's rooms outlive the heartbeat's bound: ${JSON.stringify(res.violationsByKind)}`);
  } finally {
    hb.check = check;
  }
  assert.equal((await runSeeds(FROM, 40, { rooms: 12, log: null })).failures.length, 0);
});

test("the worlds run the shipped connection core: the heartbeat without its stall rule blames the peer for the node's own freeze, and is caught", async () => {
  // The planted rule judges silence alone: a node whose host was paused wakes up, finds the
  // peer silent for the whole pause (its frames are still being retransmitted) and drops a
  // connection whose only fault was its own stall.
  const hb = Heartbeat.prototype as unknown as { check(): unknown };
  const check = hb.check;
  hb.check = function (this: { clock: { nowMs(): number }; lastRx: number; budgetMs: number; intervalMs: number; missBudget: number }) {
    const silentMs = Math.round(this.clock.nowMs() - this.lastRx);
    if (silentMs >= this.budgetMs) return { k: 'lost', silentMs, reason: `peer silent for ${silentMs} ms (heartbeat ${this.intervalMs} ms, budget ${this.missBudget} intervals)` };
    return { k: 'ok' };
  };
  try {
    const res = await runSeeds(FROM, 120, { rooms: 12, log: null });
    assert.ok(res.totals.freezes > 0, 'nodes freeze');
    assert.ok((res.violationsByKind.blamed_peer ?? 0) > 0, `the peer is blamed for the node's own freeze: ${JSON.stringify(res.violationsByKind)}`);
  } finally {
    hb.check = check;
  }
  const clean = await runSeeds(FROM, 120, { rooms: 12, log: null });
  assert.equal(clean.failures.length, 0);
  assert.ok(clean.totals.ownStalls > 0, `the shipped rule saw the freezes as its own stalls: ${clean.totals.ownStalls}`);
});

test('the worlds send through the shipped send rotation: a planted bug in the scheduler is caught', async () => {
  // The rotation serves the first transfer until it has nothing ready (first come, first served):
  // a room behind a long transfer waits for its end, not for one turn.
  const r = SendRotation.prototype as unknown as { round(): void };
  const round = r.round;
  r.round = function (this: { sending: { ready: boolean; step(): number }[]; gate(n: number): boolean; turnBytes: number }) {
    const list = this.sending;
    while (list.length > 0 && this.gate(this.turnBytes)) {
      const o = list[0]!;
      const n = o.ready ? o.step() : 0;
      if (list[0] !== o) continue;
      if (n === 0) return;
      this.turnBytes += n;
    }
  };
  try {
    const res = await runSeeds(FROM, 120, { rooms: 12, log: null });
    assert.ok((res.violationsByKind.unfair_send ?? 0) > 0, `a transfer waits past its turn: ${JSON.stringify(res.violationsByKind)}`);
  } finally {
    r.round = round;
  }
  assert.equal((await runSeeds(FROM, 40, { rooms: 12, log: null })).failures.length, 0);
});
