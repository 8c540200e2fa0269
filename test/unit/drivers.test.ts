/**
 * The shipped prefill driver (src/prefill/driver.ts) — the object the worker wraps and the
 * simulator runs — under every interleaving fast-check finds of: the request, decode's REGISTER
 * (before or after it), router aborts, the engine finishing (possibly after an abort), transfer
 * progress, decode's KV_ACK and FAIL, peer loss and the watchdog. Properties: one `finish` per
 * accepted request (decode behaving as the protocol says: it acks only a state it received); no `transfer` after `finish`; every computed state is transferred, discarded or released
 * by `finish`; the illegal-transition counter stays 0 (benign races are `late`); compute slots
 * never exceed the configured count. Plus the specific decisions the old copies drifted on, and
 * decode's KV reception rule (src/decode/receive.ts), which the worker and the simulator share.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import fc from 'fast-check';
import type { RoomId } from '../../src/base/room-id.js';
import { PrefillDriver, type PrefillAction } from '../../src/prefill/driver.js';
import { KVPoll, type RoomTimeouts } from '../../src/kv/types.js';

const T: RoomTimeouts = { preallocMs: 300, bootstrapMs: 100, waitingMs: 600, transferIdleMs: 50 };
const cfg = { timeouts: T, maxRooms: 4, maxWaiting: 4, slots: 1 };
const ROOMS = ['11', '12', '13'] as RoomId[];
const E = 'd0d0d0d0';

type Ev =
  | { k: 'request' | 'register' | 'abort' | 'computeDone' | 'progress' | 'sent' | 'ack' | 'fail'; room: number }
  | { k: 'tick'; dt: number }
  | { k: 'lost' };

const evArb: fc.Arbitrary<Ev> = fc.oneof(
  fc.record({ k: fc.constantFrom('request', 'register', 'abort', 'computeDone', 'progress', 'sent', 'ack', 'fail' as const), room: fc.integer({ min: 0, max: ROOMS.length - 1 }) }) as fc.Arbitrary<Ev>,
  fc.record({ k: fc.constant('tick' as const), dt: fc.integer({ min: 1, max: 400 }) }),
  fc.constant<Ev>({ k: 'lost' }),
);

/** The watchdog and peer-loss events of the property tests: the new clock, or undefined for any other event. */
function clockOrLoss(d: PrefillDriver, ev: { k: string; dt?: number }, now: number, perform: (acts: PrefillAction[]) => void, peer: string): number | undefined {
  if (ev.k === 'tick') {
    perform(d.tick(now + ev.dt!));
    return now + ev.dt!;
  }
  if (ev.k !== 'lost') return undefined;
  perform(d.peerLost(peer, 'gone', now));
  return now;
}

describe('prefill driver', () => {
  test('under any interleaving: one finish per room, no transfer after finish, states released, illegal stays 0', () => {
    fc.assert(
      fc.property(fc.array(evArb, { maxLength: 60 }), (evs) => {
        const d = new PrefillDriver(cfg, 'p0p0p0p0');
        let now = 0;
        const finished = new Map<RoomId, number>();
        const accepted = new Map<RoomId, number>();
        const computing = new Set<RoomId>();
        const state = new Map<RoomId, 'held' | 'sending'>();
        /** Rooms whose whole state was sent: a faithful decode acks only those (possibly after an abort). */
        const sent = new Set<RoomId>();
        const perform = (acts: PrefillAction[]): void => {
          for (const a of acts) {
            if (a.a === 'compute') {
              assert.ok(!computing.has(a.room), 'one compute per room at a time');
              computing.add(a.room);
              assert.ok(computing.size <= cfg.slots, 'compute slots bounded');
            } else if (a.a === 'transfer') {
              assert.ok(!finished.has(a.room), 'no transfer after finish');
              assert.equal(state.get(a.room), 'held');
              state.set(a.room, 'sending');
            } else if (a.a === 'discard') {
              state.delete(a.room);
            } else if (a.a === 'finish') {
              finished.set(a.room, (finished.get(a.room) ?? 0) + 1);
              assert.ok(finished.get(a.room)! <= (accepted.get(a.room) ?? 0), `room ${a.room}: more finishes than accepted requests`);
            } else if (a.a === 'diag') {
              assert.notEqual(a.effect.t, 'illegal', `illegal transition: ${JSON.stringify(a.effect)}`);
            }
          }
        };
        for (const ev of evs) {
          const t = clockOrLoss(d, ev, now, perform, 'D');
          if (t !== undefined) {
            now = t;
            continue;
          }
          const room = ROOMS[ev.room]!;
          switch (ev.k) {
            case 'request': {
              const r = d.request(room, `rid-${room}`, now);
              if (!r.refused) {
                accepted.set(room, (accepted.get(room) ?? 0) + 1);
                perform(r.actions);
              }
              break;
            }
            case 'register':
              perform(d.message('D', E, { type: 'register', room, rid: `rid-${room}`, epoch: E }, now));
              break;
            case 'abort':
              perform(d.abort(undefined, room, 'router', now));
              break;
            case 'computeDone':
              if (!computing.delete(room)) break; // only a compute that was started can finish
              state.set(room, 'held');
              perform(d.computeDone(room, { ok: true, totalBytes: 100 }, now));
              break;
            case 'progress':
              if (state.get(room) === 'sending') perform(d.progress(room, 10, now));
              break;
            case 'sent':
              if (state.get(room) === 'sending') {
                perform(d.transferSent(room));
                sent.add(room);
              }
              break;
            case 'ack':
              if (sent.has(room)) perform(d.message('D', E, { type: 'kv_ack', room, epoch: E }, now));
              break;
            case 'fail':
              perform(d.message('D', E, { type: 'fail', room, code: 'request_aborted', detail: 'client', epoch: E }, now));
              break;
          }
        }
        assert.equal(d.rooms.stats.illegal, 0);
        // Drain: every pending compute returns, the watchdog runs past every deadline; nothing stays.
        for (const room of [...computing]) {
          computing.delete(room);
          state.set(room, 'held');
          perform(d.computeDone(room, { ok: true, totalBytes: 100 }, now));
        }
        now += 10_000;
        perform(d.tick(now));
        perform(d.tick(now + 10_000));
        assert.equal(d.rooms.rooms().length, 0, 'no live room');
        assert.equal(d.live, 0, 'no job left');
        for (const [room, n] of accepted) assert.equal(finished.get(room) ?? 0, n, `room ${room}: one finish per accepted request`);
        assert.deepEqual([...state], [], 'every computed state released (discard is its one release path)');
      }),
      { numRuns: 400 },
    );
  });

  test('at the driver: decode\'s KV_ACK crossing a router abort is late, not illegal', () => {
    const d = new PrefillDriver(cfg, 'p0p0p0p0');
    d.request(ROOMS[0]!, 'r', 0);
    d.message('D', E, { type: 'register', room: ROOMS[0]!, rid: 'r', epoch: E }, 1);
    d.computeDone(ROOMS[0]!, { ok: true, totalBytes: 10 }, 2);
    const abort = d.abort(undefined, ROOMS[0]!, 'router', 3);
    assert.deepEqual(abort.map((a) => a.a), ['send', 'finish', 'discard']);
    const ack = d.message('D', E, { type: 'kv_ack', room: ROOMS[0]!, epoch: E }, 4);
    assert.deepEqual(ack.map((a) => (a.a === 'diag' ? a.effect.t : a.a)), ['late']);
    assert.equal(d.rooms.stats.illegal, 0);
  });

  test('the decisions the simulator\'s old copy drifted on: pending registrations bounded by maxRooms, REGISTERED once, FAIL for a failed room', () => {
    const d = new PrefillDriver({ ...cfg, maxRooms: 2 }, 'p0p0p0p0');
    for (const r of ['21', '22'] as RoomId[]) assert.deepEqual(d.message('D', E, { type: 'register', room: r, rid: r, epoch: E }, 0), []);
    const over = d.message('D', E, { type: 'register', room: '23' as RoomId, rid: '23', epoch: E }, 0);
    assert.equal(over.length, 1);
    assert.ok(over[0]!.a === 'send' && over[0]!.msg.type === 'fail' && over[0]!.msg.code === 'registration_refused');
    // The request consumes its early registration: REGISTERED is answered once, then compute starts.
    const r = d.request('21' as RoomId, 'r21', 1);
    assert.ok(!r.refused);
    assert.deepEqual(r.actions!.map((a) => (a.a === 'send' ? a.msg.type : a.a)), ['registered', 'compute']);
    assert.deepEqual(d.message('D', E, { type: 'register', room: '21' as RoomId, rid: 'r21', epoch: E }, 2), [], 'a duplicate REGISTER is not answered again');
    // A room that failed answers a late REGISTER with its own failure code.
    d.abort(undefined, '21' as RoomId, 'router', 3);
    const late = d.message('D', E, { type: 'register', room: '21' as RoomId, rid: 'r21', epoch: E }, 4);
    assert.ok(late[0]!.a === 'send' && late[0]!.msg.type === 'fail' && late[0]!.msg.code === 'request_aborted');
    // A compute that finishes after the abort: the state is discarded, nothing is sent.
    assert.deepEqual(d.computeDone('21' as RoomId, { ok: true, totalBytes: 10 }, 5).map((a) => (a.a === 'diag' ? a.effect.t : a.a)), ['late', 'discard']);
    // An unused pending registration expires with a FAIL after the bootstrap deadline.
    const exp = d.tick(1 + T.bootstrapMs + 1);
    assert.ok(exp.some((a) => a.a === 'send' && a.msg.type === 'fail' && a.msg.room === '22'));
    assert.equal(d.pendingRegistrations, 0);
  });

  test('a duplicate live rid is refused (400), a duplicate live room first (409)', () => {
    const d = new PrefillDriver(cfg, 'p0p0p0p0');
    assert.ok(!d.request(ROOMS[0]!, 'same', 0).refused);
    assert.equal(d.request(ROOMS[0]!, 'same', 0).refused?.code, 'duplicate_room');
    assert.equal(d.request(ROOMS[1]!, 'same', 0).refused?.code, 'duplicate_rid');
    assert.equal(d.rooms.get(ROOMS[0]!)?.state, KVPoll.Bootstrapping);
  });
});

/** Rooms of one multi-room computation (n = 3) and one single-room request, on two decode peers. */
const GROUPS: RoomId[][] = [['31', '32', '33'] as RoomId[], ['41'] as RoomId[]];
const ALL = GROUPS.flat();
type MEv =
  | { k: 'request' | 'computeDone'; g: number; ok: boolean }
  | { k: 'register' | 'abort' | 'progress' | 'sent' | 'ack' | 'fail'; room: number; peer: number }
  | { k: 'tick'; dt: number }
  | { k: 'lost'; peer: number };
const mevArb: fc.Arbitrary<MEv> = fc.oneof(
  { weight: 2, arbitrary: fc.record({ k: fc.constantFrom('request', 'computeDone' as const), g: fc.integer({ min: 0, max: GROUPS.length - 1 }), ok: fc.boolean() }) as fc.Arbitrary<MEv> },
  { weight: 6, arbitrary: fc.record({ k: fc.constantFrom('register', 'abort', 'progress', 'sent', 'ack', 'fail' as const), room: fc.integer({ min: 0, max: ALL.length - 1 }), peer: fc.integer({ min: 0, max: 1 }) }) as fc.Arbitrary<MEv> },
  { weight: 1, arbitrary: fc.record({ k: fc.constant('tick' as const), dt: fc.integer({ min: 1, max: 400 }) }) },
  { weight: 1, arbitrary: fc.record({ k: fc.constant('lost' as const), peer: fc.integer({ min: 0, max: 1 }) }) },
);

describe('prefill driver: one computation for several rooms (n > 1)', () => {
  test('under any interleaving: one compute per request, every room finishes once, the state file is released exactly once after its last room, no transfer without it', () => {
    fc.assert(
      fc.property(fc.array(mevArb, { maxLength: 80 }), (evs) => {
        const d = new PrefillDriver({ ...cfg, maxRooms: 8, slots: 1 }, 'p0p0p0p0');
        let now = 0;
        const leadOf = (room: RoomId): RoomId => GROUPS.find((g) => g.includes(room))![0]!;
        const requested = new Set<number>();
        const computes = new Map<RoomId, number>();
        const computing = new Set<RoomId>();
        const cancelled = new Set<RoomId>();
        /** The state file of a computation (by lead): present from computeDone(ok) to its discard. */
        const files = new Set<RoomId>();
        const finished = new Map<RoomId, number>();
        const transfers = new Map<RoomId, number>();
        const sending = new Set<RoomId>();
        const sentAll = new Set<RoomId>();
        const registeredSent = new Set<RoomId>();
        const perform = (acts: PrefillAction[]): void => {
          for (const a of acts) {
            switch (a.a) {
              case 'compute':
                computes.set(a.room, (computes.get(a.room) ?? 0) + 1);
                assert.equal(computes.get(a.room), 1, `computation ${a.room}: computed once`);
                computing.add(a.room);
                assert.ok(computing.size <= 1, 'compute slots bounded');
                break;
              case 'cancel':
                assert.ok(computing.has(a.room), 'cancel only a running compute');
                assert.ok(!cancelled.has(a.room), 'cancelled once');
                for (const r of GROUPS.find((g) => g[0] === a.room)!) assert.ok(finished.has(r), `cancel while room ${r} is live`);
                cancelled.add(a.room);
                break;
              case 'send':
                if (a.msg.type === 'registered') registeredSent.add(a.msg.room);
                break;
              case 'transfer':
                assert.ok(!finished.has(a.room), 'no transfer after finish');
                assert.ok(registeredSent.has(a.room), `transfer of ${a.room} before its REGISTERED`);
                assert.ok(files.has(leadOf(a.room)), `transfer of ${a.room} without its computation's state`);
                transfers.set(a.room, (transfers.get(a.room) ?? 0) + 1);
                assert.equal(transfers.get(a.room), 1, 'one transfer per room');
                sending.add(a.room);
                break;
              case 'discard': {
                assert.ok(files.delete(a.room), `discard of ${a.room}: no state held (double release)`);
                for (const r of GROUPS.find((g) => g[0] === a.room)!) assert.ok(finished.has(r) || sentAll.has(r) || !transfers.has(r) && d.rooms.get(r)?.state !== KVPoll.Bootstrapping, `state of ${a.room} released while room ${r} may still need it`);
                break;
              }
              case 'finish':
                finished.set(a.room, (finished.get(a.room) ?? 0) + 1);
                assert.equal(finished.get(a.room), 1, `room ${a.room}: one finish`);
                sending.delete(a.room);
                break;
              case 'diag':
                assert.notEqual(a.effect.t, 'illegal', `illegal transition: ${JSON.stringify(a.effect)}`);
                break;
            }
          }
        };
        const done = (lead: RoomId, ok: boolean): void => {
          computing.delete(lead);
          if (ok) files.add(lead);
          perform(d.computeDone(lead, ok ? { ok: true, totalBytes: 100 } : cancelled.has(lead) ? { ok: false, aborted: true } : { ok: false, failure: { code: 'engine_failed', detail: 'x' } }, now));
        };
        for (const ev of evs) {
          const t = clockOrLoss(d, ev, now, perform, ev.k === 'lost' ? `D${ev.peer}` : '');
          if (t !== undefined) {
            now = t;
            continue;
          }
          if (ev.k === 'request') {
            if (requested.has(ev.g)) continue;
            const r = d.request(GROUPS[ev.g]!, `rid-g${ev.g}`, now);
            assert.ok(!r.refused, r.refused?.message);
            requested.add(ev.g);
            perform(r.actions);
            continue;
          }
          if (ev.k === 'computeDone') {
            const lead = GROUPS[ev.g]![0]!;
            if (computing.has(lead)) done(lead, ev.ok);
            continue;
          }
          const room = ALL[ev.room]!;
          const E2 = `e${ev.peer}e${ev.peer}`;
          switch (ev.k) {
            case 'register':
              perform(d.message(`D${ev.peer}`, E2, { type: 'register', room, rid: 'x', epoch: E2 }, now));
              break;
            case 'abort':
              perform(d.abort(undefined, room, 'router', now));
              break;
            case 'progress':
              if (sending.has(room)) perform(d.progress(room, 10, now));
              break;
            case 'sent':
              if (sending.delete(room)) {
                sentAll.add(room);
                perform(d.transferSent(room));
              }
              break;
            case 'ack':
              if (sentAll.has(room)) perform(d.message(`D${ev.peer}`, E2, { type: 'kv_ack', room, epoch: E2 }, now));
              break;
            case 'fail':
              perform(d.message(`D${ev.peer}`, E2, { type: 'fail', room, code: 'request_aborted', detail: 'client', epoch: E2 }, now));
              break;
          }
        }
        assert.equal(d.rooms.stats.illegal, 0);
        // Drain: every compute (including ones the drain itself starts) returns.
        while (computing.size > 0) done(computing.values().next().value!, true);
        now += 10_000;
        perform(d.tick(now));
        perform(d.tick(now + 10_000));
        assert.equal(d.live, 0, 'no job left');
        assert.equal(d.computations, 0, 'no computation left');
        for (const g of requested) for (const r of GROUPS[g]!) assert.equal(finished.get(r), 1, `room ${r}: one finish`);
        assert.deepEqual([...files], [], 'every state file released');
      }),
      { numRuns: 600 },
    );
  });

  test('one compute, one state: each room transfers when registered (even after the compute), an aborted room does not hurt the others, the state goes after the last send', () => {
    const d = new PrefillDriver({ ...cfg, maxRooms: 8 }, 'p0p0p0p0');
    const [a, b, c] = ['51', '52', '53'] as RoomId[];
    const kinds = (acts: PrefillAction[]) => acts.map((x) => (x.a === 'send' ? x.msg.type : x.a === 'diag' ? x.effect.t : x.a));
    assert.deepEqual(kinds((d.request([a!, b!, c!], 'g', 0) as { actions: PrefillAction[] }).actions), []);
    assert.equal(d.request(['54' as RoomId], 'g', 0).refused?.code, 'duplicate_rid');
    assert.deepEqual(kinds(d.message('D0', E, { type: 'register', room: b!, rid: 'g', epoch: E }, 1)), ['registered', 'compute'], 'the first registration starts the one compute');
    assert.deepEqual(kinds(d.message('D1', E, { type: 'register', room: a!, rid: 'g', epoch: E }, 2)), ['registered'], 'no second compute');
    const cFin = d.abort(undefined, c!, 'router', 3);
    assert.deepEqual(kinds(cFin), ['finish'], 'room c fails alone (not registered: no peer to tell)');
    assert.equal((cFin[0] as Extract<PrefillAction, { a: 'finish' }>).bytes, 0, 'no state saved yet: 0 bytes');
    const cd = d.computeDone(a!, { ok: true, totalBytes: 100, roomBytes: new Map([[a!, 101], [b!, 102]]) }, 4);
    assert.deepEqual(cd.filter((x) => x.a === 'transfer').map((x) => (x as { room: RoomId }).room).sort(), [a, b]);
    assert.equal(d.rooms.get(a!)?.totalBytes, 101, 'each room its own wire size');
    assert.deepEqual(kinds(d.transferSent(a!)), [], 'b still needs the state');
    assert.deepEqual(kinds(d.abort(undefined, b!, 'router', 5)), ['fail', 'finish', 'discard'], 'the last reference goes: one discard');
    const acked = d.message('D1', E, { type: 'kv_ack', room: a!, epoch: E }, 6);
    assert.deepEqual(kinds(acked), ['finish']);
    assert.equal((acked[0] as Extract<PrefillAction, { a: 'finish' }>).bytes, 101, 'the finish carries the room\'s wire size (its kv_bytes)');
    assert.equal(d.rooms.get(a!)?.state, KVPoll.Success);
    assert.equal(d.computations, 0);
    assert.equal(d.live, 0);
  });

  test('a room registered after the compute gets the state at once; all rooms aborted mid-compute cancel it; abort by rid reaches every room', () => {
    const d = new PrefillDriver({ ...cfg, maxRooms: 8 }, 'p0p0p0p0');
    const [a, b] = ['61', '62'] as RoomId[];
    const kinds = (acts: PrefillAction[]) => acts.map((x) => (x.a === 'send' ? x.msg.type : x.a === 'diag' ? x.effect.t : x.a));
    d.request([a!, b!], 'g', 0);
    d.message('D0', E, { type: 'register', room: a!, rid: 'g', epoch: E }, 1);
    assert.deepEqual(kinds(d.computeDone(a!, { ok: true, totalBytes: 10 }, 2)), ['transfer']);
    assert.deepEqual(kinds(d.transferSent(a!)), [], 'b (not registered yet) holds the state');
    assert.deepEqual(kinds(d.message('D1', E, { type: 'register', room: b!, rid: 'g', epoch: E }, 3)), ['registered', 'transfer']);
    assert.deepEqual(kinds(d.transferSent(b!)), ['discard']);
    const e = new PrefillDriver({ ...cfg, maxRooms: 8 }, 'p0p0p0p0');
    e.request([a!, b!], 'h', 0);
    e.message('D0', E, { type: 'register', room: a!, rid: 'h', epoch: E }, 1);
    assert.deepEqual(kinds(e.abort(undefined, a!, 'router', 2)), ['fail', 'finish'], 'b still live: the compute goes on');
    assert.deepEqual(kinds(e.abort('h', undefined, 'router', 3)), ['finish', 'cancel']);
    assert.deepEqual(kinds(e.computeDone(a!, { ok: false, aborted: true }, 4)), []);
    assert.equal(e.computations, 0);
  });
});

describe('decode reception rule (shared by the decode worker and the simulator)', () => {
  test('in order and inside the announced size; duplicated, reordered, overflowing chunks and an early KV_END fail the room', async () => {
    const { KvReception, checkAnnounced } = await import('../../src/decode/receive.js');
    assert.equal(checkAnnounced(10, 100), undefined);
    assert.equal(checkAnnounced(100, 100), undefined, 'the limit itself is accepted');
    for (const bad of [0, -1]) assert.equal(checkAnnounced(bad, 100)?.code, 'kv_transfer_failed');
    const r = new KvReception(10);
    assert.equal(r.accept(0, 4), undefined);
    assert.equal(r.end()?.code, 'kv_transfer_failed', 'kv_end before every byte');
    assert.match(r.accept(0, 4)!.detail, /offset 0 \(\+4\) does not follow 4 of 10/, 'a duplicated chunk');
    assert.ok(r.accept(8, 2), 'a reordered chunk');
    assert.ok(r.accept(4, 7), 'past the announced size');
    assert.equal(r.accept(4, 6), undefined);
    assert.equal(r.end(), undefined);
  });

  test('a state over maxStateBytes is kv_state_too_large with the size, the limit and the flag: announced at once, streamed when the bytes in order pass the limit', async () => {
    const { KvReception, checkAnnounced, stateTooLarge } = await import('../../src/decode/receive.js');
    const M = 1024 * 1024;
    const announced = checkAnnounced(1058491, M)!;
    assert.equal(announced.code, 'kv_state_too_large');
    assert.match(announced.detail, /KV state of 1058491 bytes \(1\.01 MiB\) is over this decode worker's limit of 1048576 bytes \(1 MiB\) \(decode --max-state-bytes\)/);
    assert.match(announced.detail, /--max-state-bytes of at least 1058491/);
    assert.doesNotMatch(announced.detail, /outside|does not follow|past the limit/);
    // streamed (total = the limit, estimate = prefill's): the bytes up to the limit are fine
    const r = new KvReception(M, true, 1058491);
    assert.equal(r.accept(0, 786708), undefined);
    assert.equal(r.accept(786708, M - 786708), undefined, 'exactly the limit is accepted');
    const over = r.accept(M, 1)!;
    assert.equal(over.code, 'kv_state_too_large', 'the next byte in order is over the limit');
    assert.match(over.detail, /1048576 bytes arrived and more followed; it needs about 1058491 bytes \(1\.01 MiB\) \(prefill's estimate\)/);
    assert.match(over.detail, /--max-state-bytes/);
    // the tester's chunk: 786708 (+262123) past 1048576 → too large, not "does not follow"
    const t = new KvReception(M, true, 1058491);
    assert.equal(t.accept(0, 786708), undefined);
    assert.equal(t.accept(786708, 262123)?.code, 'kv_state_too_large');
    // an estimate under the limit (it may be a few hundred bytes low) is not quoted as the need
    assert.match(stateTooLarge(M, { over: true, estimate: M - 100 }).detail, /it needs more than 1048576 bytes/);
    // a chunk out of place stays a transfer fault, streamed or not; past an announced size too
    assert.equal(new KvReception(M, true).accept(5, 1)?.code, 'kv_transfer_failed');
    assert.equal(new KvReception(10).accept(0, 11)?.code, 'kv_transfer_failed');
  });
});
