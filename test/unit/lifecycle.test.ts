/**
 * Unit tests of the sans-IO room lifecycle core (src/kv/lifecycle.ts): the full transition table
 * per role, terminal stickiness, deadlines per phase, tombstones, duplicates, failPeer, history,
 * the legacy (buggy) rule, and a fast-check property over random event sequences.
 */
import { test, describe } from 'node:test';
import assert from 'node:assert/strict';
import fc from 'fast-check';
import { RoomTable, phaseTimeout, stateName } from '../../src/kv/lifecycle.js';
import { KVPoll, KvError, isTerminal, type Effect, type Phase, type Role, type Room, type RoomEvent, type RoomTimeouts, type RoomFailure } from '../../src/kv/types.js';

/** A RoomFailure with a neutral code: the core keeps whatever the driver gives it. */
const F = (detail: string): RoomFailure => ({ code: 'internal_error', detail });

const T: RoomTimeouts = { preallocMs: 400, bootstrapMs: 100, waitingMs: 600, transferIdleMs: 50 };

const EV: Record<string, RoomEvent> = {
  slot_reserved: { t: 'slot_reserved' },
  registered: { t: 'registered', peer: 'd1', peerEpoch: 'e1' },
  kv_begin: { t: 'kv_begin', totalBytes: 100 },
  progress: { t: 'progress', bytes: 10 },
  kv_done: { t: 'kv_done' },
  abort_router: { t: 'abort', from: 'router', failure: F('abort: router') },
  abort_peer: { t: 'abort', from: 'peer', failure: F('decode: abort') },
  fail: { t: 'fail', failure: F('engine: boom') },
  peer_lost: { t: 'peer_lost', failure: F('peer_lost: heartbeat') },
};

/** Events that bring a fresh room to a named position. */
const PATHS: Record<Role, Record<string, string[]>> = {
  prefill: {
    bootstrap: [],
    waiting: ['registered'],
    inflight: ['registered', 'kv_begin'],
    success: ['registered', 'kv_begin', 'kv_done'],
    failed: ['fail'],
  },
  decode: {
    prealloc: [],
    bootstrap: ['slot_reserved'],
    waiting: ['slot_reserved', 'registered'],
    transfer: ['slot_reserved', 'registered', 'kv_begin'],
    success: ['slot_reserved', 'registered', 'kv_begin', 'kv_done'],
    failed: ['fail'],
  },
};

/** Expected (state/phase after, effect kinds) per role/position/event. '=' means unchanged. */
type Exp = [after: string, effects: string];
const ILL: Exp = ['=', 'illegal'];
const NOOP: Exp = ['=', ''];
/** A forward event on a Failed room: a benign race, refused and counted as `late`, not `illegal`. */
const LATE: Exp = ['=', 'late'];
const CANCEL_NO_PEER: Record<string, Exp> = {
  abort_router: ['Failed/done', 'terminal'],
  abort_peer: ['Failed/done', 'terminal'],
  fail: ['Failed/done', 'terminal'],
  peer_lost: ['Failed/done', 'terminal'],
};
const CANCEL_PEER: Record<string, Exp> = {
  abort_router: ['Failed/done', 'notify_peer,terminal'],
  abort_peer: ['Failed/done', 'terminal'],
  fail: ['Failed/done', 'notify_peer,terminal'],
  peer_lost: ['Failed/done', 'terminal'],
};
const CANCEL_NOOP: Record<string, Exp> = { abort_router: NOOP, abort_peer: NOOP, fail: NOOP, peer_lost: NOOP };

const TABLE: Record<Role, Record<string, Record<string, Exp>>> = {
  prefill: {
    bootstrap: { slot_reserved: ILL, registered: ['WaitingForInput/waiting', 'start_prefill'], kv_begin: ILL, progress: ILL, kv_done: ILL, ...CANCEL_NO_PEER },
    waiting: { slot_reserved: ILL, registered: NOOP, kv_begin: ['Transferring/inflight', ''], progress: ILL, kv_done: ILL, ...CANCEL_PEER },
    inflight: { slot_reserved: ILL, registered: NOOP, kv_begin: ILL, progress: NOOP, kv_done: ['Success/done', 'terminal'], ...CANCEL_PEER },
    success: { slot_reserved: ILL, registered: NOOP, kv_begin: ILL, progress: NOOP, kv_done: NOOP, ...CANCEL_NOOP },
    failed: { slot_reserved: LATE, registered: ['=', 'notify_peer'], kv_begin: LATE, progress: NOOP, kv_done: LATE, ...CANCEL_NOOP },
  },
  decode: {
    prealloc: { slot_reserved: ['Bootstrapping/bootstrap', 'send_register'], registered: ILL, kv_begin: ILL, progress: ILL, kv_done: ILL, ...CANCEL_PEER },
    bootstrap: { slot_reserved: ILL, registered: ['WaitingForInput/waiting', ''], kv_begin: ILL, progress: ILL, kv_done: ILL, ...CANCEL_PEER },
    waiting: { slot_reserved: ILL, registered: NOOP, kv_begin: ['Transferring/transfer', ''], progress: ILL, kv_done: ILL, ...CANCEL_PEER },
    transfer: { slot_reserved: ILL, registered: NOOP, kv_begin: ILL, progress: NOOP, kv_done: ['Success/done', 'send_ack,terminal'], ...CANCEL_PEER },
    success: { slot_reserved: ILL, registered: NOOP, kv_begin: ILL, progress: NOOP, kv_done: NOOP, ...CANCEL_NOOP },
    failed: { slot_reserved: LATE, registered: ['=', 'notify_peer'], kv_begin: LATE, progress: NOOP, kv_done: LATE, ...CANCEL_NOOP },
  },
};

const pos = (r: Room): string => `${stateName(r.state)}/${r.phase}`;
const kinds = (eff: Effect[]): string => eff.map((e) => e.t).join(',');

/** The event named `name` as `role` sees it: decode's REGISTERED comes from its own peer (no peer field). */
const ev = (role: Role, name: string): RoomEvent => (role === 'decode' && name === 'registered' ? { t: 'registered', peerEpoch: 'P1' } : EV[name]!);

function at(role: Role, position: string, now = 0, opts: ConstructorParameters<typeof RoomTable>[2] = {}): RoomTable {
  const t = new RoomTable(role, T, opts);
  t.create('42', 'rid-42', now, role === 'decode' ? 'p1' : undefined);
  for (const e of PATHS[role][position]!) t.apply('42', ev(role, e), now);
  return t;
}

describe('transition table', () => {
  for (const role of ['prefill', 'decode'] as Role[]) {
    for (const [position, row] of Object.entries(TABLE[role])) {
      for (const [event, [after, effects]] of Object.entries(row)) {
        test(`${role} ${position} + ${event} → ${after === '=' ? 'unchanged' : after} [${effects}]`, () => {
          const t = at(role, position);
          const before = pos(t.get('42')!);
          const illegalBefore = t.stats.illegal;
          const eff = t.apply('42', ev(role, event), 1);
          assert.equal(kinds(eff), effects);
          assert.equal(pos(t.get('42')!), after === '=' ? before : after);
          assert.equal(t.stats.illegal - illegalBefore, effects === 'illegal' ? 1 : 0, 'illegal transitions are counted');
          for (const e of eff) assert.equal((e as { room: string }).room, '42');
          if (effects === 'illegal') {
            const ill = eff[0] as Extract<Effect, { t: 'illegal' }>;
            assert.equal(ill.from, t.get('42')!.state);
          }
        });
      }
    }
  }

  test('the table covers every event in every position', () => {
    for (const role of ['prefill', 'decode'] as Role[]) {
      for (const row of Object.values(TABLE[role])) assert.deepEqual(Object.keys(row).sort(), Object.keys(EV).sort());
    }
  });
});

describe('rules', () => {
  test('prefill path: effects, peer binding, bytes', () => {
    const t = new RoomTable('prefill', T);
    assert.deepEqual(t.create('7', 'r7', 0), []);
    const r = t.get('7')!;
    assert.equal(r.state, KVPoll.Bootstrapping);
    assert.equal(r.phase, 'bootstrap');
    assert.deepEqual(t.apply('7', { t: 'registered', peer: 'conn-1', peerEpoch: 'D1' }, 1), [{ t: 'start_prefill', room: '7' }]);
    assert.equal(r.peer, 'conn-1');
    assert.equal(r.peerEpoch, 'D1');
    t.apply('7', { t: 'kv_begin', totalBytes: 300 }, 2);
    assert.equal(r.totalBytes, 300);
    t.apply('7', { t: 'progress', bytes: 100 }, 3);
    t.apply('7', { t: 'progress', bytes: 200 }, 4);
    assert.equal(r.bytes, 300);
    assert.deepEqual(t.apply('7', { t: 'kv_done' }, 5), [{ t: 'terminal', room: '7', state: KVPoll.Success }]);
    assert.equal(t.has('7'), false);
    assert.equal(t.rooms().length, 0);
    assert.equal(t.recent()[0], r);
    assert.deepEqual(
      r.timeline.map((e) => e.why),
      ['create', 'registered', 'kv_begin', 'kv_done'],
    );
  });

  test('decode path: send_register to the peer, send_ack then terminal', () => {
    const t = new RoomTable('decode', T);
    t.create('8', 'r8', 0, 'prefill:8998');
    assert.deepEqual(t.apply('8', { t: 'slot_reserved' }, 1), [{ t: 'send_register', room: '8', peer: 'prefill:8998' }]);
    t.apply('8', { t: 'registered' }, 2);
    t.apply('8', { t: 'kv_begin', totalBytes: 5 }, 3);
    assert.deepEqual(t.apply('8', { t: 'kv_done' }, 4), [
      { t: 'send_ack', room: '8', peer: 'prefill:8998' },
      { t: 'terminal', room: '8', state: KVPoll.Success },
    ]);
  });

  test('decode room without a peer fails at slot_reserved instead of registering nowhere', () => {
    const t = new RoomTable('decode', T);
    t.create('9', 'r9', 0);
    const eff = t.apply('9', { t: 'slot_reserved' }, 1);
    assert.equal(kinds(eff), 'terminal');
    assert.equal(t.get('9')!.state, KVPoll.Failed);
  });

  test('failure reason: first reason wins, verbatim, and reaches notify_peer and terminal', () => {
    const t = at('decode', 'waiting');
    const eff = t.apply('42', { t: 'fail', failure: F('bad envelope: checksum') }, 5);
    assert.deepEqual(eff, [
      { t: 'notify_peer', room: '42', peer: 'p1', failure: F('bad envelope: checksum') },
      { t: 'terminal', room: '42', state: KVPoll.Failed, failure: F('bad envelope: checksum') },
    ]);
    t.apply('42', { t: 'abort', from: 'router', failure: F('abort: router') }, 6);
    assert.deepEqual(t.get('42')!.failure, F('bad envelope: checksum'));
  });

  test('registered by another peer after registration is refused', () => {
    const t = at('prefill', 'waiting');
    const eff = t.apply('42', { t: 'registered', peer: 'd2', peerEpoch: 'e9' }, 1);
    assert.equal(kinds(eff), 'illegal');
    assert.equal(t.get('42')!.peer, 'd1');
  });

  test('decode: REGISTERED naming another peer than the room was created with is refused', () => {
    const t = at('decode', 'bootstrap');
    assert.equal(kinds(t.apply('42', { t: 'registered', peer: 'other:1' }, 1)), 'illegal');
    assert.equal(t.get('42')!.peer, 'p1');
    assert.equal(kinds(t.apply('42', { t: 'registered', peer: 'p1', peerEpoch: 'P7' }, 2)), '');
    assert.equal(t.get('42')!.peerEpoch, 'P7');
    assert.equal(t.get('42')!.state, KVPoll.WaitingForInput);
  });

  test('registration of a failed prefill room answers FAIL to the registering peer, never revives', () => {
    const t = new RoomTable('prefill', T);
    t.create('5', 'r5', 0);
    t.apply('5', { t: 'abort', from: 'router', failure: F('abort: router') }, 1);
    const eff = t.apply('5', { t: 'registered', peer: 'conn-3', peerEpoch: 'D1' }, 2);
    assert.deepEqual(eff, [{ t: 'notify_peer', room: '5', peer: 'conn-3', failure: F('abort: router') }]);
    assert.equal(t.get('5')!.state, KVPoll.Failed);
    assert.equal(t.has('5'), false);
  });
});

describe('terminal stickiness', () => {
  for (const role of ['prefill', 'decode'] as Role[]) {
    for (const position of ['success', 'failed']) {
      test(`${role} ${position}: every event leaves the state, no second terminal`, () => {
        const t = at(role, position);
        const r = t.get('42')!;
        const state = r.state;
        for (const e of Object.values(EV)) {
          const eff = t.apply('42', e, 10);
          assert.equal(r.state, state);
          assert.equal(eff.filter((x) => x.t === 'terminal').length, 0);
        }
        assert.deepEqual(t.tick(1e9), []);
        assert.deepEqual(t.failPeer('p1', F('x'), 1e9), []);
        assert.deepEqual(t.failPeer('d1', F('x'), 1e9), []);
        assert.equal(r.state, state);
        assert.equal(r.deadlineAt, Infinity);
      });
    }
  }

  test('the incident ordering: abort, then the transfer continuation writes kv_begin → refused as a late event, not illegal', () => {
    const t = at('prefill', 'waiting');
    const abort = t.apply('42', EV.abort_router!, 10);
    assert.equal(kinds(abort), 'notify_peer,terminal');
    const late = t.apply('42', { t: 'kv_begin', totalBytes: 100 }, 11);
    assert.deepEqual(late, [{ t: 'late', room: '42', event: 'kv_begin', state: KVPoll.Failed }]);
    assert.equal(t.get('42')!.state, KVPoll.Failed);
    assert.equal(t.stats.illegal, 0);
    assert.equal(t.stats.late, 1);
  });

  test('a client abort crossing decode\'s KV_ACK is a benign race (late), never an illegal transition', () => {
    const t = at('prefill', 'inflight');
    assert.equal(kinds(t.apply('42', EV.abort_router!, 10)), 'notify_peer,terminal');
    assert.deepEqual(t.apply('42', EV.kv_done!, 11), [{ t: 'late', room: '42', event: 'kv_done', state: KVPoll.Failed }]);
    assert.deepEqual(t.apply('42', EV.kv_done!, 12), [{ t: 'late', room: '42', event: 'kv_done', state: KVPoll.Failed }], 'a duplicate ack is late too');
    assert.equal(t.stats.illegal, 0);
    assert.equal(t.stats.late, 2);
    // A real violation stays illegal: an ack for a room that never sent its state.
    const u = at('prefill', 'waiting');
    assert.equal(kinds(u.apply('42', EV.kv_done!, 1)), 'illegal');
    assert.equal(u.stats.illegal, 1);
  });
});

describe('deadlines', () => {
  const cases: [Role, string, Phase, number][] = [
    ['prefill', 'bootstrap', 'bootstrap', T.bootstrapMs],
    ['prefill', 'waiting', 'waiting', T.waitingMs],
    ['prefill', 'inflight', 'inflight', T.transferIdleMs],
    ['decode', 'prealloc', 'prealloc', T.preallocMs],
    ['decode', 'bootstrap', 'bootstrap', T.bootstrapMs],
    ['decode', 'waiting', 'waiting', T.waitingMs],
    ['decode', 'transfer', 'transfer', T.transferIdleMs],
  ];
  for (const [role, position, phase, ms] of cases) {
    test(`${role} ${phase}: deadline = entry + ${ms} ms; tick fails it with deadline:${phase}`, () => {
      const t = at(role, position, 1000);
      const r = t.get('42')!;
      const stateBefore = r.state;
      assert.equal(r.phase, phase);
      assert.equal(phaseTimeout(phase, T), ms);
      assert.equal(r.deadlineAt, 1000 + ms);
      assert.equal(t.nextDeadline(), 1000 + ms);
      assert.deepEqual(t.tick(1000 + ms - 1), []);
      const eff = t.tick(1000 + ms);
      const hasPeer = r.peer !== undefined;
      assert.equal(kinds(eff), hasPeer ? 'expired,notify_peer,terminal' : 'expired,terminal');
      const exp = eff[0] as Extract<Effect, { t: 'expired' }>;
      assert.equal(exp.phase, phase);
      assert.equal(exp.state, stateBefore, 'expired carries the state at expiry');
      assert.equal(r.state, KVPoll.Failed);
      assert.equal(exp.timeline.at(-1)!.why, `deadline:${phase}`);
      assert.deepEqual(r.failure, { code: 'room_deadline_expired', detail: `deadline:${phase}` });
      assert.equal((eff.at(-1) as Extract<Effect, { t: 'terminal' }>).failure?.detail, `deadline:${phase}`);
      assert.equal(t.stats.expired, 1);
      assert.deepEqual(t.tick(1e9), [], 'expired once');
      assert.equal(t.nextDeadline(), Infinity);
    });
  }

  test('each phase entry restarts the deadline', () => {
    const t = new RoomTable('decode', T);
    t.create('1', 'r', 0, 'p');
    t.apply('1', EV.slot_reserved!, 300);
    assert.equal(t.get('1')!.deadlineAt, 300 + T.bootstrapMs);
    t.apply('1', ev('decode', 'registered'), 350);
    assert.equal(t.get('1')!.deadlineAt, 350 + T.waitingMs);
  });

  test('progress restarts the transfer deadline and adds bytes; silence expires it', () => {
    const t = at('decode', 'transfer', 0);
    for (let now = 40; now <= 400; now += 40) {
      t.apply('42', { t: 'progress', bytes: 1 }, now);
      assert.deepEqual(t.tick(now + T.transferIdleMs - 1), []);
    }
    assert.equal(t.get('42')!.bytes, 10);
    assert.equal(kinds(t.tick(400 + T.transferIdleMs)), 'expired,notify_peer,terminal');
  });
});

describe('tombstones', () => {
  test('abort before the request: the late request is created Failed at once with the reason', () => {
    const t = new RoomTable('decode', T);
    assert.deepEqual(t.apply('77', { t: 'abort', from: 'router', failure: F('abort: router') }, 0), []);
    assert.equal(t.isTombstoned('77'), true);
    assert.equal(t.stats.tombstoned, 1);
    const eff = t.create('77', 'r77', 5, 'p1');
    assert.deepEqual(eff, [
      { t: 'notify_peer', room: '77', peer: 'p1', failure: F('abort: router') },
      { t: 'terminal', room: '77', state: KVPoll.Failed, failure: F('abort: router') },
    ]);
    assert.equal(t.get('77')!.state, KVPoll.Failed);
    assert.equal(t.has('77'), false);
    assert.deepEqual(t.apply('77', EV.slot_reserved!, 6).map((e) => e.t), ['late']);
  });

  test('a tombstone from the peer is not echoed back to it', () => {
    const t = new RoomTable('decode', T);
    t.apply('78', { t: 'abort', from: 'peer', failure: F('prefill: abort') }, 0);
    assert.equal(kinds(t.create('78', 'r', 1, 'p1')), 'terminal');
  });

  test('REGISTER for a tombstoned id answers FAIL; other unknown events return [] and are counted', () => {
    const t = new RoomTable('prefill', T);
    t.apply('79', EV.fail!, 0);
    assert.deepEqual(t.apply('79', { t: 'registered', peer: 'c1' }, 1), [{ t: 'notify_peer', room: '79', peer: 'c1', failure: F('engine: boom') }]);
    assert.deepEqual(t.apply('80', { t: 'registered', peer: 'c1' }, 1), []);
    assert.deepEqual(t.apply('80', EV.kv_done!, 1), []);
    assert.equal(t.stats.unknownEvents, 2);
    assert.equal(t.isTombstoned('80'), false);
  });

  test('TTL: tick drops old tombstones; the request then runs', () => {
    const t = new RoomTable('prefill', T, { tombstoneTtlMs: 1000 });
    t.apply('81', EV.abort_router!, 0);
    t.tick(999);
    assert.equal(t.isTombstoned('81'), true);
    t.tick(1000);
    assert.equal(t.isTombstoned('81'), false);
    assert.deepEqual(t.create('81', 'r', 1001), []);
    assert.equal(t.has('81'), true);
  });

  test('bounded: the oldest tombstone is evicted first; first reason wins', () => {
    const t = new RoomTable('prefill', T, { tombstoneMax: 3 });
    for (const id of ['1', '2', '3']) t.apply(id, EV.abort_router!, Number(id));
    t.apply('1', EV.fail!, 5);
    assert.deepEqual(t.tombstone('1')!.failure, F('abort: router'));
    t.apply('4', EV.abort_router!, 6);
    assert.equal(t.isTombstoned('1'), false);
    assert.deepEqual(['2', '3', '4'].map((id) => t.isTombstoned(id)), [true, true, true]);
    assert.equal(t.stats.tombstonesEvicted, 1);
  });

  test('a failed room leaves a tombstone: re-creating the id fails at once (no revival)', () => {
    const t = new RoomTable('prefill', T, { historyMax: 0 });
    t.create('90', 'r', 0);
    t.apply('90', EV.abort_router!, 1);
    assert.equal(t.get('90'), undefined, 'history disabled');
    assert.equal(kinds(t.create('90', 'r', 2)), 'terminal');
    assert.equal(t.get('90'), undefined);
  });
});

describe('duplicates, failPeer, history, snapshot', () => {
  test('a second live room with the same id throws KvError DUPLICATE_ROOM', () => {
    const t = new RoomTable('prefill', T);
    t.create('1', 'a', 0);
    assert.throws(() => t.create('1', 'b', 1), (e: unknown) => e instanceof KvError && e.code === 'DUPLICATE_ROOM');
    assert.equal(t.get('1')!.rid, 'a');
  });

  test('after Success the id may be reused (not live); after Failed it may not run', () => {
    const t = at('prefill', 'success');
    assert.deepEqual(t.create('42', 'again', 10), []);
    assert.equal(t.get('42')!.rid, 'again');
    assert.equal(t.has('42'), true);
    const f = at('prefill', 'failed');
    assert.equal(kinds(f.create('42', 'again', 10)), 'terminal');
  });

  test('failPeer fails exactly the live rooms of that peer, without echo', () => {
    const t = new RoomTable('prefill', T);
    t.create('1', 'a', 0);
    t.create('2', 'b', 0);
    t.create('3', 'c', 0);
    t.create('4', 'd', 0);
    t.apply('1', { t: 'registered', peer: 'A' }, 1);
    t.apply('2', { t: 'registered', peer: 'A' }, 1);
    t.apply('3', { t: 'registered', peer: 'B' }, 1);
    t.apply('2', EV.kv_begin!, 2);
    const eff = t.failPeer('A', F('peer_lost: closed'), 3);
    assert.deepEqual(eff, [
      { t: 'terminal', room: '1', state: KVPoll.Failed, failure: F('peer_lost: closed') },
      { t: 'terminal', room: '2', state: KVPoll.Failed, failure: F('peer_lost: closed') },
    ]);
    assert.deepEqual(t.rooms().map((r) => r.id), ['3', '4']);
    assert.deepEqual(t.failPeer('A', F('again'), 4), []);
  });

  test('history is bounded and newest first; counts include live and recent', () => {
    const t = new RoomTable('prefill', T, { historyMax: 3 });
    for (let i = 1; i <= 5; i++) {
      t.create(String(i), `r${i}`, i);
      t.apply(String(i), EV.abort_router!, i);
    }
    t.create('6', 'r6', 6);
    assert.deepEqual(t.recent().map((r) => r.id), ['5', '4', '3']);
    assert.deepEqual(t.countsByState(), { Failed: 3, Bootstrapping: 1, WaitingForInput: 0, Transferring: 0, Success: 0 });
  });

  test('timeline is capped, keeping the create entry', () => {
    const t = new RoomTable('prefill', T, { timelineMax: 4 });
    t.create('1', 'r', 0);
    t.apply('1', EV.registered!, 1);
    t.apply('1', EV.kv_begin!, 2);
    t.apply('1', EV.kv_done!, 3);
    t.create('2', 'r', 0);
    t.apply('2', EV.registered!, 1);
    t.apply('2', EV.kv_begin!, 2);
    t.apply('2', EV.fail!, 3);
    t.apply('2', EV.fail!, 4);
    const tl = t.get('2')!.timeline;
    assert.equal(tl.length, 4);
    assert.equal(tl[0]!.why, 'create');
    assert.equal(tl.at(-1)!.why, 'fail');
  });

  test('snapshot is JSON-able and carries the /debug/rooms fields', () => {
    const t = new RoomTable('decode', T);
    t.create('1', 'r1', 100, 'p1');
    t.apply('1', EV.slot_reserved!, 110);
    t.create('2', 'r2', 100, 'p1');
    t.apply('2', EV.abort_router!, 120);
    const snap = JSON.parse(JSON.stringify(t.snapshot(150)));
    assert.equal(snap.role, 'decode');
    assert.equal(snap.live.length, 1);
    assert.deepEqual(snap.live[0], {
      room: '1',
      rid: 'r1',
      role: 'decode',
      state: 'Bootstrapping',
      state_code: 1,
      phase: 'bootstrap',
      age_ms: 50,
      deadline_ms: 110 + T.bootstrapMs - 150,
      peer: 'p1',
      peer_epoch: null,
      bytes: 0,
      total_bytes: null,
      fail_reason: null,
      fail_code: null,
      timeline: [
        { at: 100, state: 'Bootstrapping', phase: 'prealloc', why: 'create' },
        { at: 110, state: 'Bootstrapping', phase: 'bootstrap', why: 'slot_reserved' },
      ],
    });
    assert.equal(snap.recent[0].state, 'Failed');
    assert.equal(snap.recent[0].deadline_ms, null);
    assert.equal(snap.recent[0].fail_reason, 'internal_error: abort: router');
    assert.equal(snap.recent[0].fail_code, 'internal_error');
    assert.equal(snap.tombstones, 1);
    assert.equal(snap.stats.created, 2);
  });
});

describe('legacyMaxRule (test-only reproduction of the bug)', () => {
  test('Failed is overwritten by a late Transferring, then the watchdog write is swallowed', () => {
    const t = new RoomTable('prefill', T, { legacyMaxRule: true });
    t.create('1', 'r', 0);
    t.apply('1', EV.registered!, 1);
    assert.equal(kinds(t.apply('1', EV.abort_router!, 2)), 'notify_peer,terminal');
    assert.deepEqual(t.apply('1', EV.kv_begin!, 3), [], 'no illegal effect in legacy mode');
    const r = t.get('1')!;
    assert.equal(r.state, KVPoll.Transferring, 'revived: max(Failed=0, Transferring=3) = 3');
    assert.equal(t.has('1'), true);
    assert.deepEqual(t.tick(1e6), [], 'watchdog Failed write swallowed: max(3, 0) = 3');
    assert.equal(r.state, KVPoll.Transferring);
    assert.ok(t.stats.swallowed >= 1);
    assert.equal(kinds(t.apply('1', EV.kv_done!, 1e6)), 'terminal', 'a second terminal for the same room');
  });

  test('the real rule refuses the same sequence', () => {
    const t = new RoomTable('prefill', T);
    t.create('1', 'r', 0);
    t.apply('1', EV.registered!, 1);
    t.apply('1', EV.abort_router!, 2);
    assert.equal(kinds(t.apply('1', EV.kv_begin!, 3)), 'late');
    assert.equal(t.get('1')!.state, KVPoll.Failed);
  });
});

describe('property: random event sequences', () => {
  const ids = ['1', '2', '3'];
  const eventArb: fc.Arbitrary<RoomEvent> = fc.oneof(
    fc.constant<RoomEvent>({ t: 'slot_reserved' }),
    fc.record({ t: fc.constant('registered' as const), peer: fc.constantFrom('A', 'B') }),
    fc.record({ t: fc.constant('kv_begin' as const), totalBytes: fc.nat(1000) }),
    fc.record({ t: fc.constant('progress' as const), bytes: fc.nat(100) }),
    fc.constant<RoomEvent>({ t: 'kv_done' }),
    fc.record({ t: fc.constant('abort' as const), from: fc.constantFrom('router', 'client', 'peer', 'local') as fc.Arbitrary<'router' | 'client' | 'peer' | 'local'>, failure: fc.constant(F('x')) }),
    fc.constant<RoomEvent>({ t: 'fail', failure: F('f') }),
    fc.constant<RoomEvent>({ t: 'peer_lost', failure: F('l') }),
  );
  type Cmd = { k: 'create'; id: string; peer: boolean } | { k: 'ev'; id: string; ev: RoomEvent } | { k: 'tick'; dt: number } | { k: 'failPeer'; peer: string };
  const cmdArb: fc.Arbitrary<Cmd> = fc.oneof(
    { weight: 2, arbitrary: fc.record({ k: fc.constant('create' as const), id: fc.constantFrom(...ids), peer: fc.boolean() }) },
    { weight: 8, arbitrary: fc.record({ k: fc.constant('ev' as const), id: fc.constantFrom(...ids), ev: eventArb }) },
    { weight: 2, arbitrary: fc.record({ k: fc.constant('tick' as const), dt: fc.integer({ min: 0, max: 700 }) }) },
    { weight: 1, arbitrary: fc.record({ k: fc.constant('failPeer' as const), peer: fc.constantFrom('A', 'B') }) },
  );

  for (const role of ['prefill', 'decode'] as Role[]) {
    test(`${role}: terminal is never left, exactly one terminal effect per terminal room, states only move forward`, () => {
      fc.assert(
        fc.property(fc.array(cmdArb, { maxLength: 60 }), (cmds) => {
          const t = new RoomTable(role, T, { tombstoneTtlMs: 500 });
          let now = 0;
          /** Every room object ever created, with its terminal effects. */
          const seen: { room: Room; terminals: Effect[]; last: KVPoll }[] = [];
          const byId = new Map<string, (typeof seen)[number]>();
          const account = (eff: Effect[]): void => {
            for (const e of eff) {
              if (e.t !== 'terminal') continue;
              const s = byId.get(e.room);
              assert.ok(s, 'terminal effect for a room that was never created');
              s.terminals.push(e);
              assert.equal(s.room.state, e.state, 'terminal effect state = room state');
            }
          };
          for (const c of cmds) {
            if (c.k === 'create') {
              const live = t.has(c.id);
              try {
                const peer = c.peer || role === 'decode' ? 'A' : undefined;
                const eff = t.create(c.id, 'r', now, peer);
                assert.ok(!live);
                const rec = { room: t.get(c.id)!, terminals: [] as Effect[], last: KVPoll.Bootstrapping };
                seen.push(rec);
                byId.set(c.id, rec);
                account(eff);
              } catch (e) {
                assert.ok(live && e instanceof KvError && e.code === 'DUPLICATE_ROOM');
              }
            } else if (c.k === 'ev') {
              account(t.apply(c.id, c.ev, now));
            } else if (c.k === 'tick') {
              now += c.dt;
              account(t.tick(now));
            } else {
              account(t.failPeer(c.peer, F('gone'), now));
            }
            for (const s of seen) {
              const st = s.room.state;
              if (s.terminals.length > 0) {
                assert.equal(st, (s.terminals[0] as Extract<Effect, { t: 'terminal' }>).state, 'terminal is sticky');
              } else {
                assert.ok(!isTerminal(st), 'terminal reached without a terminal effect');
                assert.ok(st >= s.last, `state went backwards ${s.last} → ${st}`);
                assert.ok(Number.isFinite(s.room.deadlineAt) && s.room.deadlineAt > now - 700 - 1, 'live room has a finite deadline');
              }
              assert.ok(s.terminals.length <= 1, 'at most one terminal effect per room');
              s.last = st;
            }
          }
          // Drain: every live room is failed by the watchdog in bounded time.
          now += 10_000;
          account(t.tick(now));
          assert.equal(t.rooms().length, 0);
          for (const s of seen) assert.equal(s.terminals.length, 1, 'exactly one terminal effect per room');
        }),
        { numRuns: 400 },
      );
    });
  }
});
