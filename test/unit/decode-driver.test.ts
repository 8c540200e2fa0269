/**
 * The shipped decode driver (src/decode/driver.ts) — the object the decode worker wraps and the
 * simulator runs — on its own decisions: the prealloc queue bound and who hears of a refusal,
 * slot hand-out in arrival order, registering once on one connection, messages counted only from
 * that connection, the reception rule (an out-of-order chunk fails the room and tells prefill),
 * the deferred slot release while llama.cpp is loading, deadlines, and prefill told of every
 * failure decode itself decides. Then fast-check over arbitrary input orders: one
 * finish and one release per accepted request, slots bounded, no load or generation after a
 * failure, illegal counter 0.
 */
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import fc from 'fast-check';
import type { RoomId } from '../../src/base/room-id.js';
import { DecodeDriver, type DecodeAction, type DecodeDriverConfig } from '../../src/decode/driver.js';
import { KVPoll, type RoomTimeouts } from '../../src/kv/types.js';

const T: RoomTimeouts = { preallocMs: 300, bootstrapMs: 100, waitingMs: 600, transferIdleMs: 50 };
const cfg: DecodeDriverConfig = { timeouts: T, slots: 1, maxPrealloc: 2, maxStateBytes: 1000 };
const P = '127.0.0.1:8998';
const C = 'conn-1';
const EP = 'p0p0p0p0';
const A = '101' as RoomId;
const B = '102' as RoomId;
const D3 = '103' as RoomId;
const D4 = '104' as RoomId;

/** Action kinds, with sends shown by their message type. */
const kinds = (acts: DecodeAction[]): string[] => acts.map((a) => (a.a === 'send' ? `send:${a.msg.type}` : a.a === 'diag' ? `diag:${a.effect.t}` : a.a));

/** Drive room `r` (holding the only slot) to the end of its KV reception on connection C. */
function toLoading(d: DecodeDriver, r: RoomId, now = 1): DecodeAction[] {
  const out: DecodeAction[] = [];
  out.push(...d.dialed(r, C, now));
  out.push(...d.message(C, EP, { type: 'registered', room: r }, now));
  out.push(...d.message(C, EP, { type: 'kv_begin', room: r, totalBytes: 10 }, now));
  out.push(...d.chunk(C, r, 0, 10, now).actions);
  out.push(...d.message(C, EP, { type: 'kv_end', room: r }, now));
  return out;
}

describe('decode driver: decisions', () => {
  test('admission: slot to the first, prealloc bounded; a refusal tells prefill except for a duplicate live room', () => {
    const d = new DecodeDriver(cfg, 'd0d0d0d0');
    const a = d.request(A, 'ra', P, 0);
    assert.ok(!a.refused);
    assert.deepEqual(kinds(a.actions), ['assign_slot', 'dial']);
    assert.deepEqual(kinds(d.request(B, 'rb', P, 0).actions), [], 'no free slot: B waits in prealloc');
    assert.deepEqual(kinds(d.request(D3, 'rc', P, 0).actions), []);
    assert.equal(d.preallocQueued, 2);
    const full = d.request(D4, 'rd', P, 0);
    assert.equal(full.refused?.code, 'queue_full');
    assert.deepEqual(kinds(full.actions), ['send:fail']);
    assert.ok(full.actions[0]!.a === 'send' && full.actions[0]!.addr === P && full.actions[0]!.conn === undefined, 'told on a (new) connection to the prefill address');
    assert.equal(d.rooms.has(D4), false, 'nothing created');
    const dupRoom = new DecodeDriver(cfg, 'd0d0d0d0');
    dupRoom.request(A, 'ra', P, 0);
    const r409 = dupRoom.request(A, 'other', P, 0);
    assert.equal(r409.refused?.code, 'duplicate_room');
    assert.deepEqual(r409.actions, [], 'the live room is not failed at prefill by a duplicate');
    const r400 = dupRoom.request(B, 'ra', P, 0);
    assert.equal(r400.refused?.code, 'duplicate_rid');
    assert.deepEqual(kinds(r400.actions), ['send:fail']);
  });

  test('registers once, on one connection; REGISTERED and later messages count only from that connection', () => {
    const d = new DecodeDriver(cfg, 'd0d0d0d0');
    d.request(A, 'ra', P, 0);
    assert.deepEqual(kinds(d.dialed(A, C, 1)), ['register']);
    assert.deepEqual(d.dialed(A, 'conn-2', 1), [], 'a second dial answer does not register again');
    assert.equal(d.step(A), 'registering');
    assert.deepEqual(kinds(d.message('conn-2', EP, { type: 'registered', room: A }, 2)), ['stray']);
    assert.deepEqual(d.message(C, EP, { type: 'registered', room: A }, 2), []);
    assert.equal(d.step(A), 'waiting_kv');
    assert.equal(d.rooms.get(A)?.state, KVPoll.WaitingForInput);
    assert.deepEqual(d.message(C, EP, { type: 'registered', room: A }, 3), [], 'a duplicate REGISTERED is a no-op');
    assert.deepEqual(kinds(d.chunk('conn-2', A, 0, 5, 3).actions), ['stray']);
    assert.equal(d.rooms.stats.illegal, 0);
  });

  test('an out-of-order chunk fails the room (shared reception rule) and prefill is told on the room\'s connection', () => {
    const d = new DecodeDriver(cfg, 'd0d0d0d0');
    d.request(A, 'ra', P, 0);
    d.dialed(A, C, 1);
    d.message(C, EP, { type: 'registered', room: A }, 1);
    assert.deepEqual(kinds(d.message(C, EP, { type: 'kv_begin', room: A, totalBytes: 10 }, 2)), ['recv_begin']);
    const first = d.chunk(C, A, 0, 4, 3);
    assert.equal(first.store, true);
    const bad = d.chunk(C, A, 8, 2, 4);
    assert.equal(bad.store, false);
    assert.deepEqual(kinds(bad.actions), ['send:fail', 'finish', 'release']);
    const f = bad.actions.find((a) => a.a === 'finish')!;
    assert.ok(f.a === 'finish' && f.state === KVPoll.Failed && f.failure?.code === 'kv_transfer_failed');
    const tell = bad.actions[0]!;
    assert.ok(tell.a === 'send' && tell.conn === C && tell.msg.type === 'fail' && tell.msg.code === 'kv_transfer_failed');
    assert.deepEqual(bad.actions[2], { a: 'release', room: A, slot: true });
  });

  test('an announced size over maxStateBytes, a KV_END before every byte: the room fails', () => {
    const d = new DecodeDriver({ ...cfg, slots: 2 }, 'd0d0d0d0');
    for (const r of [A, B]) {
      d.request(r, `r${r}`, P, 0);
      d.dialed(r, C, 0);
      d.message(C, EP, { type: 'registered', room: r }, 0);
    }
    const big = d.message(C, EP, { type: 'kv_begin', room: A, totalBytes: 1001 }, 1);
    assert.ok(big.some((a) => a.a === 'finish' && a.failure?.code === 'kv_state_too_large' && /1001 bytes is over .*limit of 1000 bytes .*--max-state-bytes/.test(a.failure.detail)));
    assert.ok(big.some((a) => a.a === 'send' && a.msg.type === 'fail' && a.msg.code === 'kv_state_too_large'), 'prefill is told, with the code');
    assert.ok(!big.some((a) => a.a === 'recv_begin'), 'nothing is received');
    d.message(C, EP, { type: 'kv_begin', room: B, totalBytes: 10 }, 1);
    d.chunk(C, B, 0, 5, 1);
    const early = d.message(C, EP, { type: 'kv_end', room: B }, 2);
    assert.ok(early.some((a) => a.a === 'finish' && /truncated/.test(a.failure?.detail ?? '')));
    assert.ok(!early.some((a) => a.a === 'load'));
  });

  test('streamed kv_begin (size at kv_end): the limit is decode\'s own; kv_end\'s count must match what came; register says kvStream', () => {
    const d = new DecodeDriver({ ...cfg, slots: 3 }, 'd0d0d0d0');
    const regs: DecodeAction[] = [];
    for (const r of [A, B, D3]) {
      d.request(r, `r${r}`, P, 0);
      regs.push(...d.dialed(r, C, 0));
      d.message(C, EP, { type: 'registered', room: r }, 0);
    }
    const registers = regs.flatMap((a) => (a.a === 'register' ? [a] : []));
    assert.equal(registers.length, 3, 'one register per room');
    assert.ok(registers.every((a) => a.msg.kvStream === true), 'every register offers the streamed handoff');
    // A: an estimate under the real size is fine; kv_end gives the count and CRC → load with them
    const begin = d.message(C, EP, { type: 'kv_begin', room: A, totalBytes: 8, streamed: true }, 1);
    const rb = begin.find((a) => a.a === 'recv_begin');
    assert.ok(rb && rb.a === 'recv_begin' && rb.totalBytes === cfg.maxStateBytes && rb.hintBytes === 8, 'the receiver is capped by maxStateBytes and sized from the hint');
    assert.deepEqual(d.chunk(C, A, 0, 12, 1).actions, []);
    const load = d.message(C, EP, { type: 'kv_end', room: A, totalBytes: 12, crc: 77 }, 2);
    assert.deepEqual(load, [{ a: 'load', room: A, end: { totalBytes: 12, crc: 77 } }]);
    // B: kv_end says more than came → truncated, no load
    d.message(C, EP, { type: 'kv_begin', room: B, totalBytes: 10, streamed: true }, 1);
    d.chunk(C, B, 0, 5, 1);
    const cut = d.message(C, EP, { type: 'kv_end', room: B, totalBytes: 10, crc: 1 }, 2);
    assert.ok(cut.some((a) => a.a === 'finish' && /truncated/.test(a.failure?.detail ?? '')) && !cut.some((a) => a.a === 'load'));
    // D3: bytes past decode's own limit fail at the chunk
    d.message(C, EP, { type: 'kv_begin', room: D3, totalBytes: 10, streamed: true }, 1);
    assert.deepEqual(d.chunk(C, D3, 0, cfg.maxStateBytes - 1, 1).actions, [], 'bytes up to the limit are taken');
    const over = d.chunk(C, D3, cfg.maxStateBytes - 1, 2, 1);
    assert.equal(over.store, false, 'the bytes past the limit are not stored');
    assert.ok(over.actions.some((a) => a.a === 'finish' && a.failure?.code === 'kv_state_too_large' && /over this decode worker's limit of 1000 bytes \(decode --max-state-bytes\)/.test(a.failure.detail)));
    assert.ok(over.actions.some((a) => a.a === 'send' && a.msg.type === 'fail' && a.msg.code === 'kv_state_too_large'), 'prefill is told, so it stops sending');
    const late = d.chunk(C, D3, cfg.maxStateBytes + 1, 10, 2);
    assert.ok(!late.store && late.actions.every((a) => a.a === 'stray'), 'later chunks of the failed room are dropped');
  });

  test('success: load, kv_ack on the room\'s connection, finish, generate; the slot goes back after generation, to the oldest waiter', () => {
    const d = new DecodeDriver(cfg, 'd0d0d0d0');
    d.request(A, 'ra', P, 0);
    d.request(B, 'rb', P, 0);
    assert.deepEqual(kinds(toLoading(d, A)), ['register', 'recv_begin', 'load']);
    assert.deepEqual(d.message(C, EP, { type: 'kv_end', room: A }, 1), [], 'a repeated KV_END does not load twice');
    const ok = d.loadDone(A, 2);
    assert.deepEqual(kinds(ok), ['send:kv_ack', 'finish', 'generate']);
    assert.ok(ok[0]!.a === 'send' && ok[0]!.conn === C);
    assert.equal(d.step(A), 'decoding');
    assert.equal(d.queueSizes().decode_running, 1);
    assert.deepEqual(d.abort(undefined, A, 'client', 3), [], 'an abort after Success changes nothing in the driver (the shell stops generation)');
    assert.deepEqual(kinds(d.generationDone(A, 4)), ['release', 'assign_slot', 'dial']);
    assert.ok(d.generationDone(A, 5).length === 0, 'generationDone once');
    assert.equal(d.step(B), 'registering');
  });

  test('same host: KV_FILE → take_file (slot kept); refused → KV_FILE_REFUSED and TCP still works; taken → kv_begin, load, kv_ack', () => {
    const kvFile = (r: RoomId) => ({ type: 'kv_file' as const, room: r, file: `pdserve-prefill-1-${r}.ggsq`, payloadBytes: 10, crc: 0, head: 'AA==' });
    const d = new DecodeDriver(cfg, 'd0d0d0d0');
    d.request(A, 'ra', P, 0);
    d.request(B, 'rb', P, 0);
    d.dialed(A, C, 1);
    d.message(C, EP, { type: 'registered', room: A }, 1);
    assert.deepEqual(kinds(d.message(C, EP, kvFile(A), 2)), ['take_file']);
    assert.equal(d.step(A), 'loading');
    const refused = d.fileRefused(A, 'file missing', 3);
    assert.deepEqual(kinds(refused), ['send:kv_file_refused']);
    assert.ok(refused[0]!.a === 'send' && refused[0]!.conn === C);
    assert.equal(d.step(A), 'waiting_kv', 'back to waiting: prefill sends the room over TCP');
    assert.deepEqual(kinds([...d.message(C, EP, { type: 'kv_begin', room: A, totalBytes: 10 }, 4), ...d.chunk(C, A, 0, 10, 4).actions, ...d.message(C, EP, { type: 'kv_end', room: A }, 4)]), ['recv_begin', 'load']);
    assert.deepEqual(kinds(d.loadDone(A, 5)), ['send:kv_ack', 'finish', 'generate']);
    d.generationDone(A, 6);
    // B got the slot: same host, taken this time
    d.dialed(B, C, 7);
    d.message(C, EP, { type: 'registered', room: B }, 7);
    assert.deepEqual(kinds(d.message(C, EP, kvFile(B), 8)), ['take_file']);
    assert.deepEqual(d.fileTaken(B, 10, 9), [], 'the take is the room\'s kv_begin (no action)');
    assert.equal(d.rooms.get(B)!.state, KVPoll.Transferring);
    assert.deepEqual(kinds(d.loadDone(B, 10)), ['send:kv_ack', 'finish', 'generate']);
    // a KV_FILE after the room is over is ignored
    assert.deepEqual(d.message(C, EP, kvFile(B), 11), [], 'a terminal room ignores a late KV_FILE');
  });

  test('same host: a KV_FILE over maxStateBytes fails the room kv_state_too_large (no take, no TCP fallback), prefill told', () => {
    const d = new DecodeDriver(cfg, 'd0d0d0d0');
    d.request(A, 'ra', P, 0);
    d.dialed(A, C, 1);
    d.message(C, EP, { type: 'registered', room: A }, 1);
    const out = d.message(C, EP, { type: 'kv_file', room: A, file: 'x', payloadBytes: cfg.maxStateBytes + 1, crc: 0, head: 'AA==' }, 2);
    assert.deepEqual(kinds(out), ['send:fail', 'finish', 'release'], 'not take_file, not kv_file_refused (TCP would fail the same)');
    const f = out.find((a) => a.a === 'finish')!;
    assert.ok(f.a === 'finish' && f.failure?.code === 'kv_state_too_large' && /KV state of 1001 bytes is over .*limit of 1000 bytes/.test(f.failure.detail));
    assert.equal(d.freeSlots, 1);
  });

  test('same host: a room that fails while its file is being taken keeps its slot until the take answers', () => {
    const d = new DecodeDriver(cfg, 'd0d0d0d0');
    d.request(A, 'ra', P, 0);
    d.dialed(A, C, 1);
    d.message(C, EP, { type: 'registered', room: A }, 1);
    d.message(C, EP, { type: 'kv_file', room: A, file: 'x', payloadBytes: 10, crc: 0, head: 'AA==' }, 2);
    assert.deepEqual(kinds(d.peerLost(C, 'gone', 3)), ['finish']);
    assert.equal(d.freeSlots, 0, 'slot kept while the shell may be renaming/validating');
    assert.deepEqual(kinds(d.fileRefused(A, 'room over', 4)), ['release']);
    assert.equal(d.freeSlots, 1);
  });

  test('deferred slot release: a room that fails while llama.cpp loads keeps its slot until the load returns', () => {
    const d = new DecodeDriver(cfg, 'd0d0d0d0');
    d.request(A, 'ra', P, 0);
    d.request(B, 'rb', P, 0);
    toLoading(d, A);
    const ab = d.abort(undefined, A, 'router', 2);
    assert.deepEqual(kinds(ab), ['send:fail', 'finish'], 'prefill told, request answered, the slot NOT released');
    assert.equal(d.freeSlots, 0);
    assert.equal(d.step(B), 'prealloc');
    assert.deepEqual(kinds(d.tick(2 + T.transferIdleMs + 1)), [], 'the watchdog does not release it either');
    const back = d.loadDone(A, 60);
    assert.deepEqual(kinds(back), ['release', 'assign_slot', 'dial'], 'no kv_ack, no generate: only the release, then B gets the slot');
    assert.equal(d.rooms.stats.illegal, 0);
    // The same with a failing load.
    const d2 = new DecodeDriver(cfg, 'd0d0d0d0');
    d2.request(A, 'ra', P, 0);
    toLoading(d2, A);
    const bad = d2.loadFailed(A, { code: 'bad_state', detail: 'x' }, 2);
    assert.deepEqual(kinds(bad), ['send:fail', 'finish', 'release']);
  });

  test("the router's abort cause is the room's failure, told to prefill too; a client's close stays request_aborted", () => {
    const finished = (out: ReturnType<DecodeDriver['abort']>) => out.find((a) => a.a === 'finish')?.failure;
    const told = (out: ReturnType<DecodeDriver['abort']>) => out.flatMap((a) => (a.a === 'send' && a.msg.type === 'fail' ? [a.msg.code] : []));
    const d = new DecodeDriver(cfg, 'd0d0d0d0');
    d.request(A, 'ra', P, 0);
    d.request(B, 'rb', P, 0);
    d.dialed(A, C, 0);
    const cause = { code: 'prefill_refused' as const, detail: 'prefill refused the request: 400 context_length_exceeded: too long' };
    const byRouter = d.abort(undefined, A, 'router', 1, cause);
    assert.deepEqual(finished(byRouter), cause);
    assert.deepEqual(told(byRouter), ['prefill_refused'], JSON.stringify(byRouter));
    assert.deepEqual(finished(d.abort(undefined, B, 'client', 1, cause)), { code: 'request_aborted', detail: 'the client closed the request' }, 'only the router says why');
  });

  test('deadlines: prealloc expiry tells prefill on a new connection; a silent prefill after REGISTER tells it on the room\'s', () => {
    const d = new DecodeDriver(cfg, 'd0d0d0d0');
    d.request(A, 'ra', P, 0);
    d.request(B, 'rb', P, 0);
    d.dialed(A, C, 0);
    const out = d.tick(T.preallocMs);
    const fails = out.filter((a) => a.a === 'send' && a.msg.type === 'fail');
    assert.equal(fails.length, 2, kinds(out).join(','));
    const toA = fails.find((a) => a.room === A)!;
    const toB = fails.find((a) => a.room === B)!;
    assert.ok(toA.a === 'send' && toA.conn === C && toA.msg.type === 'fail' && toA.msg.code === 'room_deadline_expired');
    assert.ok(toB.a === 'send' && toB.conn === undefined && toB.addr === P);
    assert.equal(d.live, 0);
    assert.equal(d.freeSlots, 1);
  });

  test('dial failure and peer loss fail the rooms on that connection only', () => {
    const d = new DecodeDriver({ ...cfg, slots: 2 }, 'd0d0d0d0');
    d.request(A, 'ra', P, 0);
    d.request(B, 'rb', P, 0);
    const nf = d.registerFailed(B, { code: 'peer_unreachable', detail: 'refused' }, 1);
    assert.ok(nf.some((a) => a.a === 'finish' && a.failure?.code === 'peer_unreachable'));
    assert.ok(nf.some((a) => a.a === 'send' && a.addr === P), 'prefill still told (it may be reachable later)');
    d.dialed(A, C, 1);
    assert.deepEqual(d.roomsOn(C), [A]);
    const lost = d.peerLost(C, 'heartbeat', 2);
    assert.deepEqual(kinds(lost), ['finish', 'release'], 'no FAIL to a peer that caused the failure');
    assert.deepEqual(d.peerLost('conn-9', 'x', 3), []);
  });

  test('an abort before the request leaves a tombstone: the request fails at once and prefill hears', () => {
    const d = new DecodeDriver(cfg, 'd0d0d0d0');
    assert.deepEqual(d.abort(undefined, A, 'router', 0), []);
    const r = d.request(A, 'ra', P, 1);
    assert.ok(!r.refused);
    assert.deepEqual(kinds(r.actions), ['send:fail', 'finish', 'release']);
    assert.equal(d.live, 0);
  });
});

type Ev =
  | { k: 'request' | 'dialed' | 'dialFail' | 'registered' | 'kvBegin' | 'chunk' | 'kvEnd' | 'loadDone' | 'loadFail' | 'genDone' | 'peerFail' | 'abort'; room: number }
  | { k: 'tick'; dt: number }
  | { k: 'lost' };

const ROOMS = ['11', '12', '13', '14'] as RoomId[];

const evArb: fc.Arbitrary<Ev> = fc.oneof(
  fc.record({ k: fc.constantFrom('request', 'dialed', 'dialFail', 'registered', 'kvBegin', 'chunk', 'kvEnd', 'loadDone', 'loadFail', 'genDone', 'peerFail', 'abort' as const), room: fc.integer({ min: 0, max: ROOMS.length - 1 }) }) as fc.Arbitrary<Ev>,
  fc.record({ k: fc.constant('tick' as const), dt: fc.integer({ min: 1, max: 400 }) }),
  fc.constant<Ev>({ k: 'lost' }),
);

describe('decode driver under any input order', () => {
  test('one finish and one release per accepted request, slots and prealloc bounded, no load/generate after a failure, illegal 0', () => {
    fc.assert(
      fc.property(fc.array(evArb, { maxLength: 80 }), fc.integer({ min: 1, max: 2 }), (evs, slots) => {
        const c = { ...cfg, slots };
        const d = new DecodeDriver(c, 'd0d0d0d0');
        let now = 0;
        let conn = 0;
        const accepted = new Map<RoomId, number>();
        const finished = new Map<RoomId, number>();
        const released = new Map<RoomId, number>();
        const failedAt = new Set<RoomId>();
        const loading = new Set<RoomId>();
        const generating = new Set<RoomId>();
        const dialing = new Set<RoomId>();
        let slotsHeld = 0;
        const perform = (acts: DecodeAction[]): void => {
          for (const a of acts) {
            switch (a.a) {
              case 'assign_slot':
                slotsHeld++;
                assert.ok(slotsHeld <= c.slots, 'slots bounded');
                break;
              case 'release':
                released.set(a.room, (released.get(a.room) ?? 0) + 1);
                assert.equal(released.get(a.room), accepted.get(a.room), `room ${a.room}: one release per accepted request`);
                assert.ok(!loading.has(a.room) && !generating.has(a.room), 'release only when nothing runs on the slot');
                if (a.slot) slotsHeld--;
                break;
              case 'dial':
                dialing.add(a.room);
                break;
              case 'load':
                assert.ok(!failedAt.has(a.room), 'no load after the room failed');
                loading.add(a.room);
                break;
              case 'generate':
                assert.ok(!failedAt.has(a.room), 'no generation of a failed room');
                generating.add(a.room);
                break;
              case 'finish':
                finished.set(a.room, (finished.get(a.room) ?? 0) + 1);
                assert.ok(finished.get(a.room)! <= (accepted.get(a.room) ?? 0), `room ${a.room}: more finishes than accepted requests`);
                if (a.state === KVPoll.Failed) failedAt.add(a.room);
                break;
              case 'diag':
                assert.notEqual(a.effect.t, 'illegal', `illegal transition: ${JSON.stringify(a.effect)}`);
                break;
            }
          }
          assert.ok(d.preallocQueued <= c.maxPrealloc, 'prealloc bounded');
        };
        const cid = (): string => `c${conn}`;
        for (const ev of evs) {
          if (ev.k === 'tick' || ev.k === 'lost') {
            now += ev.k === 'tick' ? ev.dt : 0;
            perform(ev.k === 'tick' ? d.tick(now) : d.peerLost(cid(), 'gone', now));
            if (ev.k === 'lost') conn++; // the next connection has a new id
            continue;
          }
          const room = ROOMS[ev.room]!;
          const st = d.rooms.get(room)?.state;
          switch (ev.k) {
            case 'request': {
              if (d.step(room) !== null) break; // the router sends one request per room at a time
              failedAt.delete(room);
              const r = d.request(room, `rid-${room}`, P, now);
              if (!r.refused) accepted.set(room, (accepted.get(room) ?? 0) + 1);
              perform(r.actions);
              break;
            }
            case 'dialed':
              if (dialing.delete(room)) perform(d.dialed(room, cid(), now));
              break;
            case 'dialFail':
              if (dialing.delete(room)) perform(d.registerFailed(room, { code: 'peer_unreachable', detail: 'x' }, now));
              break;
            // A faithful prefill: REGISTERED after REGISTER, KV_BEGIN/chunk/KV_END in order (FIFO).
            case 'registered':
              if (st === KVPoll.Bootstrapping && d.step(room) === 'registering' && d.roomsOn(cid()).includes(room)) perform(d.message(cid(), EP, { type: 'registered', room }, now));
              break;
            case 'kvBegin':
              if (st === KVPoll.WaitingForInput && d.roomsOn(cid()).includes(room)) perform(d.message(cid(), EP, { type: 'kv_begin', room, totalBytes: 10 }, now));
              break;
            case 'chunk':
              if (d.step(room) === 'receiving' && d.rooms.get(room)!.bytes < 10) perform(d.chunk(cid(), room, d.rooms.get(room)!.bytes, 5, now).actions);
              break;
            case 'kvEnd':
              if (d.step(room) === 'receiving' && d.rooms.get(room)!.bytes === 10) perform(d.message(cid(), EP, { type: 'kv_end', room }, now));
              break;
            case 'loadDone':
              if (loading.delete(room)) perform(d.loadDone(room, now));
              break;
            case 'loadFail':
              if (loading.delete(room)) perform(d.loadFailed(room, { code: 'engine_failed', detail: 'x' }, now));
              break;
            case 'genDone':
              if (generating.delete(room)) perform(d.generationDone(room, now));
              break;
            case 'peerFail':
              perform(d.message(cid(), EP, { type: 'fail', room, code: 'request_aborted', detail: 'x', epoch: EP }, now));
              break;
            case 'abort':
              perform(d.abort(undefined, room, 'router', now));
              break;
          }
        }
        // Drain: loads and generations return, dials fail, the watchdog runs past every deadline.
        for (const room of [...loading]) {
          loading.delete(room);
          perform(d.loadDone(room, now));
        }
        for (const room of [...generating]) {
          generating.delete(room);
          perform(d.generationDone(room, now));
        }
        for (const room of [...dialing]) perform(d.registerFailed(room, { code: 'peer_unreachable', detail: 'x' }, now));
        for (let i = 0; i < 4; i++) {
          now += 1000;
          perform(d.tick(now));
        }
        assert.equal(d.rooms.rooms().length, 0, 'no live room');
        assert.equal(d.live, 0, 'no request held');
        assert.equal(slotsHeld, 0, 'every slot back');
        assert.equal(d.freeSlots, c.slots);
        assert.equal(d.rooms.stats.illegal, 0);
        for (const [room, n] of accepted) {
          assert.equal(finished.get(room) ?? 0, n, `room ${room}: one finish per accepted request`);
          assert.equal(released.get(room) ?? 0, n, `room ${room}: one release per accepted request`);
        }
      }),
      { numRuns: 500 },
    );
  });
});
