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
import type { RoomId } from '../../src/common/room-id.js';
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
              state.delete(a.room); // the shell drops the blob on finish
            } else if (a.a === 'diag') {
              assert.notEqual(a.effect.t, 'illegal', `illegal transition: ${JSON.stringify(a.effect)}`);
            }
          }
        };
        for (const ev of evs) {
          if (ev.k === 'tick') {
            now += ev.dt;
            perform(d.tick(now));
            continue;
          }
          if (ev.k === 'lost') {
            perform(d.peerLost('D', 'gone', now));
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
                d.transferSent(room);
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
        for (const [room, st] of state) assert.ok(finished.has(room) || st === undefined, `state of ${room} still ${st}`);
      }),
      { numRuns: 400 },
    );
  });

  test('fault a at the driver: decode\'s KV_ACK crossing a router abort is late, not illegal', () => {
    const d = new PrefillDriver(cfg, 'p0p0p0p0');
    d.request(ROOMS[0]!, 'r', 0);
    d.message('D', E, { type: 'register', room: ROOMS[0]!, rid: 'r', epoch: E }, 1);
    d.computeDone(ROOMS[0]!, { ok: true, totalBytes: 10 }, 2);
    const abort = d.abort(undefined, ROOMS[0]!, 'router', 3);
    assert.deepEqual(abort.map((a) => a.a), ['send', 'finish']);
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

describe('decode reception rule (shared by the decode worker and the simulator)', () => {
  test('in order and inside the announced size; duplicated, reordered, overflowing chunks and an early KV_END fail the room', async () => {
    const { KvReception, checkAnnounced } = await import('../../src/decode/receive.js');
    assert.equal(checkAnnounced(10, 100), undefined);
    for (const bad of [0, -1, 101]) assert.equal(checkAnnounced(bad, 100)?.code, 'kv_transfer_failed');
    const r = new KvReception(10);
    assert.equal(r.accept(0, 4), undefined);
    assert.equal(r.end()?.code, 'kv_transfer_failed', 'kv_end before every byte');
    assert.match(r.accept(0, 4)!.detail, /offset 0 \(\+4\) does not follow 4 of 10/, 'a duplicated chunk');
    assert.ok(r.accept(8, 2), 'a reordered chunk');
    assert.ok(r.accept(4, 7), 'past the announced size');
    assert.equal(r.accept(4, 6), undefined);
    assert.equal(r.end(), undefined);
  });
});
