/**
 * The sans-IO connection core (src/kv/conn-core.ts) with no socket and no timer: two cores
 * joined back to back in memory, time from a hand-moved clock. The handshake opens both ends,
 * room messages of the bound epoch pass and others are refused, pings are answered, a silent
 * peer is lost after the miss budget and a late check (this process's stall) is not blamed on
 * the peer; the send rotation (src/kv/send-rotation.ts) deals turns of its quantum.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { ConnCore, newKvStats, NOOP_LOG, type CoreEnd, type CoreSink } from '../../src/kv/conn-core.js';
import { SendRotation, type Outgoing } from '../../src/kv/send-rotation.js';
import { encodeControl } from '../../src/kv/frame.js';
import type { PeerMsg } from '../../src/kv/messages.js';
import type { RoomId } from '../../src/kv/types.js';

const PAIR = { fingerprint: 'ab'.repeat(32), contextSize: 1024, batchSize: 128, flashAttention: true };
const ROOM = '42' as RoomId;

/** Two cores whose writes are queued for the other end; `flush()` delivers them in order. */
function pair(o: { secret?: string } = {}) {
  const clock = { t: 0, nowMs() { return this.t; } };
  const wire: { to: 'p' | 'd'; bytes: Buffer }[] = [];
  const seen = { p: [] as PeerMsg[], d: [] as PeerMsg[] };
  const ended: Partial<Record<'p' | 'd', CoreEnd>> = {};
  const opened: ('p' | 'd')[] = [];
  const sink = (me: 'p' | 'd'): CoreSink => ({
    write: (f) => (wire.push({ to: me === 'p' ? 'd' : 'p', bytes: Array.isArray(f) ? Buffer.concat(f) : f }), true),
    opened: () => void opened.push(me),
    message: (m) => void seen[me].push(m),
    chunk: () => {},
    stalled: () => {},
    ended: (e) => void (ended[me] = e),
  });
  const stats = newKvStats();
  const common = { pair: PAIR, streams: 1, heartbeatMs: 100, clock, stats, log: NOOP_LOG, name: () => 'test' };
  const p = new ConnCore({ ...common, side: 'prefill', secret: 's3cret', epoch: 'aaaaaaaa', address: 'decode:1' }, sink('p'));
  const d = new ConnCore({ ...common, side: 'decode', secret: o.secret ?? 's3cret', epoch: 'dddddddd', address: 'prefill:1' }, sink('d'));
  const flush = (): void => {
    while (wire.length > 0) {
      const w = wire.shift()!;
      (w.to === 'p' ? p : d).receive(w.bytes);
    }
  };
  p.start();
  flush();
  return { p, d, clock, wire, seen, ended, opened, stats, flush };
}

test('the handshake opens both ends and binds each other’s epoch; a room message of another epoch is refused', () => {
  const { p, d, seen, opened, stats, flush } = pair();
  assert.deepEqual(opened.sort(), ['d', 'p']);
  assert.equal(p.peerEpoch, 'dddddddd');
  assert.equal(d.peerEpoch, 'aaaaaaaa');
  assert.equal(d.sendControl({ type: 'kv_ack', room: ROOM, epoch: 'dddddddd' }), true);
  assert.equal(d.sendControl({ type: 'kv_ack', room: ROOM, epoch: 'eeeeeeee' }), true);
  flush();
  assert.deepEqual(seen.p, [{ type: 'kv_ack', room: ROOM, epoch: 'dddddddd' }]);
  assert.equal(stats.staleEpoch, 1);
});

test('a wrong secret is refused in the handshake with AUTH_FAILED on both ends', () => {
  const { p, d, ended, opened } = pair({ secret: 'other' });
  assert.deepEqual(opened, []);
  assert.equal(p.state, 'ended');
  assert.equal(d.state, 'ended');
  assert.equal(ended.p?.failure?.code, 'AUTH_FAILED');
  assert.equal(ended.p?.graceful, true, 'prefill flushes its auth_fail before closing');
  assert.equal(ended.d?.failure?.code, 'AUTH_FAILED');
});

test('pings are answered and give the round trip; a silent peer is lost after the budget, a late check is our stall', () => {
  const { p, d, clock, wire, ended, stats, flush } = pair();
  p.ping();
  clock.t += 7;
  flush();
  assert.equal(p.rttMs, 7);
  // the pong was the peer's last byte: the check is due one budget after it
  assert.equal(p.nextCheckInMs(), 200);
  clock.t += 200;
  assert.equal(p.check()?.k, 'lost');
  assert.equal(ended.p?.silentMs, 200);
  // the other end: its check runs 400 ms late (our stall), the peer is not blamed
  const wait = d.nextCheckInMs()!;
  clock.t += wait + 400;
  assert.equal(d.check()?.k, 'stalled');
  assert.equal(stats.ownStalls, 1);
  assert.equal(d.state, 'open');
  wire.length = 0;
});

test('a bad frame ends the connection (BAD_FRAME counted); nothing is read after the end', () => {
  const { p, ended, stats } = pair();
  const bad = encodeControl({ type: 'ping', seq: 1 });
  bad[4] = 9; // unknown frame type
  p.receive(bad);
  assert.equal(p.state, 'ended');
  assert.equal(stats.badFrames, 1);
  assert.match(ended.p!.reason, /bad frame/);
  p.receive(encodeControl({ type: 'ping', seq: 2 }));
  assert.equal(stats.badFrames, 1);
});

test('the send rotation gives each transfer one quantum a turn, and a transfer alone all of it', () => {
  const log: string[] = [];
  const rot = new SendRotation(() => log.length < 12, 200);
  const transfer = (name: string, pieces: number): Outgoing => {
    let left = pieces;
    const o: Outgoing = {
      ready: true,
      credit: 0,
      step: () => {
        if (left === 0) {
          rot.drop(o);
          return 0;
        }
        left--;
        log.push(name);
        return 100;
      },
      alive: () => {},
      lost: () => {},
    };
    return o;
  };
  rot.add(transfer('a', 6));
  rot.add(transfer('b', 2));
  rot.add(transfer('c', 6));
  rot.serve();
  assert.deepEqual(log.join(''), 'aabbccaaccaa');
});
