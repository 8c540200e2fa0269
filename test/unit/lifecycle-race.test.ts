/**
 * Races between the two SHIPPED drivers — `PrefillDriver` (src/prefill/driver.ts) and
 * `DecodeDriver` (src/decode/driver.ts), the objects the workers wrap — connected over a
 * simulated KV channel (one FIFO connection each way, as TCP; it can be lost and re-opened). The
 * test plays only their ports: the router (requests to both sides, aborts), the network, the
 * engines (prefill compute, decode load and generation, none cancellable) and the clock.
 * fast-check picks the interleaving: at each step, which of the enabled events runs next.
 *
 * Properties, under every interleaving: every live room is within its deadline after each
 * watchdog tick (so every room is terminal by its deadline); one `finish` per accepted request on
 * each side; decode's slot and request released exactly once (`release`), never while a load or
 * generation runs on it; no load or generation of a room decode already failed, no transfer after
 * prefill's finish; prefill told (a FAIL sent) of every failure decode decided itself; the
 * illegal-transition counter stays 0 on both sides (benign races are counted as `late`); queues
 * bounded. The same properties are shown to FAIL with the legacy max(old, new) status rule.
 * Decode-local continuation: fast-check may add a request sent to decode alone (`{local: true}`:
 * no prefill leg; its `local_prefill` evaluation is an uncancellable engine call like a load) —
 * the same properties hold, and nothing about it is ever sent to prefill.
 */
import { test, describe } from 'node:test';
import assert from 'node:assert/strict';
import fc from 'fast-check';
import type { RoomId } from '../../src/base/room-id.js';
import { DecodeDriver, type DecodeAction } from '../../src/decode/driver.js';
import { PrefillDriver, type PrefillAction } from '../../src/prefill/driver.js';
import { KVPoll, type RoomTimeouts } from '../../src/kv/types.js';
import type { ControlMsg } from '../../src/kv/messages.js';

const T: RoomTimeouts = { preallocMs: 500, bootstrapMs: 400, waitingMs: 600, transferIdleMs: 200 };
const ADDR = 'prefill:8998';
const CHUNKS = 2;
const CHUNK = 5;

type Frame = { msg: ControlMsg } | { chunk: { room: RoomId; offset: number; len: number } };

/** What a step does to the protocol: moves it on, brings requests, advances time, or interferes. */
type Kind = 'move' | 'request' | 'time' | 'interfere';

/** A step the world can take now. */
interface Step {
  name: string;
  kind: Kind;
  run: () => void;
}

/** Two drivers, their ports, and the checks. */
class World {
  readonly p: PrefillDriver;
  readonly d: DecodeDriver;
  now = 0;
  readonly log: string[] = [];
  /** Connection generation: ids on both sides change when it is lost and re-opened. */
  private gen = 1;
  private up = true;
  private toD: Frame[] = [];
  private toP: Frame[] = [];
  // prefill ports
  private readonly computing = new Set<RoomId>();
  private readonly sending = new Map<RoomId, { next: number }>();
  private readonly pFinished = new Map<RoomId, number>();
  private readonly pAccepted = new Map<RoomId, number>();
  // decode ports
  private readonly dialing = new Set<RoomId>();
  private readonly loading = new Set<RoomId>();
  private readonly generating = new Set<RoomId>();
  private readonly dFinished = new Map<RoomId, number>();
  private readonly dAccepted = new Map<RoomId, number>();
  private readonly dReleased = new Map<RoomId, number>();
  private readonly dFailed = new Set<RoomId>();
  private readonly toldPrefill = new Set<RoomId>();
  /** Rooms decode failed by its own decision (not told by prefill, not the connection): prefill must hear. */
  private readonly mustTell = new Set<RoomId>();
  private slotsHeld = 0;
  private readonly routerDone = new Set<string>();

  constructor(
    readonly rooms: RoomId[],
    readonly slots: number,
    legacy: boolean,
    /** Rooms the router sends to decode alone (decode-local continuation). */
    readonly localRooms: RoomId[] = [],
  ) {
    this.p = new PrefillDriver({ timeouts: T, maxRooms: 4, maxWaiting: 4, slots: 1, legacyMaxRule: legacy }, 'p0p0p0p0');
    this.d = new DecodeDriver({ timeouts: T, slots, maxPrealloc: 2, maxStateBytes: 1000, legacyMaxRule: legacy }, 'd0d0d0d0');
  }

  private get conn(): string {
    return `c${this.gen}`;
  }

  private get peer(): string {
    return `D#${this.gen}`;
  }

  private fail(why: string): never {
    assert.fail(`${why}\n${this.log.slice(-60).join('\n')}`);
  }

  // ---- performing the drivers' actions --------------------------------------------------------

  private performP(acts: PrefillAction[]): void {
    for (const a of acts) {
      this.log.push(`  P ${a.a}${'room' in a ? ` ${a.room}` : ''}${a.a === 'send' ? ` ${a.msg.type}` : ''}`);
      switch (a.a) {
        case 'send':
          if (a.peer === this.peer && this.up) this.toD.push({ msg: a.msg });
          break;
        case 'compute':
          if (this.computing.has(a.room)) this.fail(`second compute of ${a.room}`);
          this.computing.add(a.room);
          if (this.computing.size > 1) this.fail('compute slots exceeded');
          break;
        case 'transfer':
          if (this.pFinished.has(a.room) && this.pFinished.get(a.room)! >= (this.pAccepted.get(a.room) ?? 0)) this.fail(`transfer after finish of ${a.room}`);
          if (a.peer === this.peer && this.up) this.sending.set(a.room, { next: 0 });
          else this.performP(this.p.transferFailed(a.room, { code: 'peer_lost', detail: 'connection gone' }, this.now));
          break;
        case 'finish':
          this.sending.delete(a.room); // the worker's abort signal stops the send
          this.count(this.pFinished, a.room, this.pAccepted, 'prefill finish');
          break;
        default: // diag
          this.noIllegal(a);
      }
    }
    const q = this.p.queueSizes();
    if (q.prefill_waiting_queue! > 4 || this.p.pendingRegistrations > 4 || this.p.live > 4) this.fail(`prefill queues over their bounds ${JSON.stringify(q)}`);
  }

  private performD(acts: DecodeAction[]): void {
    for (const a of acts) {
      this.log.push(`  D ${a.a}${'room' in a ? ` ${a.room}` : ''}${a.a === 'send' ? ` ${a.msg.type}` : ''}`);
      switch (a.a) {
        case 'assign_slot':
          if (++this.slotsHeld > this.slots) this.fail('decode slots exceeded');
          break;
        case 'release':
          if (this.loading.has(a.room) || this.generating.has(a.room)) this.fail(`slot of ${a.room} released while the engine still uses it`);
          if (a.slot) this.slotsHeld--;
          this.count(this.dReleased, a.room, this.dAccepted, 'decode release');
          break;
        case 'dial':
          this.dialing.add(a.room);
          break;
        case 'register':
          if (a.conn === this.conn && this.up) this.toP.push({ msg: a.msg });
          else this.performD(this.d.registerFailed(a.room, { code: 'peer_lost', detail: 'connection closed before register' }, this.now));
          break;
        case 'send':
          if (this.localRooms.includes(a.room)) this.fail(`decode sent ${a.msg.type} to prefill for the decode-local room ${a.room}`);
          if (a.msg.type === 'fail') this.toldPrefill.add(a.room);
          if (a.conn === this.conn && this.up) this.toP.push({ msg: a.msg });
          else if (a.addr !== undefined) {
            this.reopen(); // the pool opens a connection to tell prefill
            this.toP.push({ msg: a.msg });
          }
          break;
        case 'load':
        case 'local_prefill':
          if (this.dFailed.has(a.room)) this.fail(`${a.a} of ${a.room} after decode failed it`);
          this.loading.add(a.room);
          break;
        case 'generate':
          if (this.dFailed.has(a.room)) this.fail(`generation of ${a.room} after decode failed it`);
          this.generating.add(a.room);
          break;
        case 'finish':
          this.count(this.dFinished, a.room, this.dAccepted, 'decode finish');
          if (a.state === KVPoll.Failed) {
            this.dFailed.add(a.room);
            const byPeer = a.failure?.code === 'peer_lost' || (a.failure?.detail ?? '').startsWith('prefill:');
            if (!byPeer && !this.localRooms.includes(a.room)) this.mustTell.add(a.room);
          }
          break;
        default: // diag
          this.noIllegal(a);
      }
    }
    if (this.d.preallocQueued > 2) this.fail('decode prealloc queue over its bound');
  }

  private noIllegal(a: PrefillAction | DecodeAction): void {
    if (a.a === 'diag' && a.effect.t === 'illegal') this.fail(`illegal transition ${JSON.stringify(a.effect)}`);
  }

  private count(m: Map<RoomId, number>, room: RoomId, accepted: Map<RoomId, number>, what: string): void {
    m.set(room, (m.get(room) ?? 0) + 1);
    if (m.get(room)! > (accepted.get(room) ?? 0)) this.fail(`${what} #${m.get(room)} of ${room} for ${accepted.get(room) ?? 0} accepted request(s)`);
  }

  /** A new connection (after a loss): new ids on both sides, empty pipes. */
  private reopen(): void {
    if (this.up) return;
    this.gen++;
    this.up = true;
    this.log.push(`connection ${this.conn} opened`);
  }

  private lose(): void {
    this.log.push(`connection ${this.conn} lost`);
    const conn = this.conn;
    const peer = this.peer;
    this.up = false;
    this.toD = [];
    this.toP = [];
    this.performP(this.p.peerLost(peer, 'connection lost', this.now));
    this.performD(this.d.peerLost(conn, 'connection lost', this.now));
  }

  private tick(dt: number): void {
    this.now += dt;
    this.log.push(`tick → ${this.now}`);
    this.performP(this.p.tick(this.now));
    this.performD(this.d.tick(this.now));
    for (const r of [...this.p.rooms.rooms(), ...this.d.rooms.rooms()]) {
      if (r.deadlineAt <= this.now) this.fail(`${r.role} room ${r.id} live (${KVPoll[r.state]}/${r.phase}) past its deadline ${r.deadlineAt} at ${this.now}`);
    }
  }

  // ---- the enabled steps ----------------------------------------------------------------------

  steps(withRouter: boolean): Step[] {
    const out: Step[] = [];
    const s = (name: string, run: () => void, kind: Kind = 'move'): void => void out.push({ name, kind, run });
    if (withRouter) {
      for (const room of this.rooms) {
        const once = (what: string, run: () => void): void => {
          if (!this.routerDone.has(`${what}${room}`)) s(`${what} ${room}`, () => (this.routerDone.add(`${what}${room}`), run()), what.endsWith('abort') ? 'interfere' : 'request');
        };
        once('router→P request', () => {
          const r = this.p.request(room, `rid-${room}`, this.now);
          if (!r.refused) {
            this.pAccepted.set(room, (this.pAccepted.get(room) ?? 0) + 1);
            this.performP(r.actions);
          }
        });
        once('router→D request', () => {
          const r = this.d.request(room, `rid-${room}`, ADDR, this.now);
          if (!r.refused) this.dAccepted.set(room, (this.dAccepted.get(room) ?? 0) + 1);
          this.performD(r.actions);
        });
        once('router→P abort', () => this.performP(this.p.abort(undefined, room, 'router', this.now)));
        once('router→D abort', () => this.performD(this.d.abort(undefined, room, 'router', this.now)));
      }
      for (const room of this.localRooms) {
        const once = (what: string, run: () => void): void => {
          if (!this.routerDone.has(`${what}${room}`)) s(`${what} ${room}`, () => (this.routerDone.add(`${what}${room}`), run()), what.endsWith('abort') ? 'interfere' : 'request');
        };
        once('router→D local request', () => {
          const r = this.d.request(room, `rid-${room}`, ADDR, this.now, { local: true });
          if (!r.refused) this.dAccepted.set(room, (this.dAccepted.get(room) ?? 0) + 1);
          this.performD(r.actions);
        });
        once('router→D local abort', () => this.performD(this.d.abort(undefined, room, 'router', this.now)));
      }
      if (!this.routerDone.has('lose') && this.up) s('connection lost', () => (this.routerDone.add('lose'), this.lose()), 'interfere');
    }
    const dHead = this.toD[0];
    if (dHead) {
      s('deliver →D', () => {
        this.toD.shift();
        if ('msg' in dHead) this.performD(this.d.message(this.conn, 'p0p0p0p0', dHead.msg, this.now));
        else this.performD(this.d.chunk(this.conn, dHead.chunk.room, dHead.chunk.offset, dHead.chunk.len, this.now).actions);
      });
    }
    const pHead = this.toP[0];
    if (pHead && 'msg' in pHead && 'room' in pHead.msg) {
      const msg = pHead.msg;
      s('deliver →P', () => {
        this.toP.shift();
        if (msg.type === 'register' || msg.type === 'kv_ack' || msg.type === 'fail') this.performP(this.p.message(this.peer, 'd0d0d0d0', msg, this.now));
      });
    }
    for (const room of this.computing) {
      s(`P compute done ${room}`, () => {
        this.computing.delete(room);
        this.performP(this.p.computeDone(room, { ok: true, totalBytes: CHUNKS * CHUNK }, this.now));
      });
    }
    for (const [room, t] of this.sending) {
      s(`P sends piece ${t.next} of ${room}`, () => {
        const i = t.next++;
        if (i === 0) this.toD.push({ msg: { type: 'kv_begin', room, totalBytes: CHUNKS * CHUNK } });
        else if (i <= CHUNKS) {
          this.toD.push({ chunk: { room, offset: (i - 1) * CHUNK, len: CHUNK } });
          this.performP(this.p.progress(room, CHUNK, this.now));
        } else {
          this.toD.push({ msg: { type: 'kv_end', room } });
          this.sending.delete(room);
          this.performP(this.p.transferSent(room));
        }
      });
    }
    for (const room of this.dialing) {
      s(`D dialed ${room}`, () => {
        this.dialing.delete(room);
        this.reopen();
        this.performD(this.d.dialed(room, this.conn, this.now));
      });
    }
    for (const room of this.loading) {
      s(`D load done ${room}`, () => (this.loading.delete(room), this.performD(this.d.loadDone(room, this.now))));
      s(`D load failed ${room}`, () => (this.loading.delete(room), this.performD(this.d.loadFailed(room, { code: 'bad_state', detail: 'checksum' }, this.now))), 'interfere');
    }
    for (const room of this.generating) s(`D generation done ${room}`, () => (this.generating.delete(room), this.performD(this.d.generationDone(room, this.now))));
    s('tick 20', () => this.tick(20), 'time');
    s('tick 150', () => this.tick(150), 'time');
    return out;
  }

  /** Run the interleaving fast-check chose, then let everything settle and check the end state. */
  play(choices: number[]): void {
    for (const c of choices) {
      // Most choices move the protocol on (a delivery, an engine or a sender step, in any order);
      // some bring requests, advance the clock or interfere (aborts, connection loss, a failed
      // load) — so the deep states (loading, generating) are reached and interfered with.
      const all = this.steps(true);
      const r = c % 16;
      const want: Kind = r < 10 ? 'move' : r < 13 ? 'request' : r < 15 ? 'time' : 'interfere';
      const pool = all.filter((x) => x.kind === want);
      const from = pool.length > 0 ? pool : all;
      const st = from[Math.floor(c / 16) % from.length]!;
      this.log.push(`> ${st.name}`);
      st.run();
    }
    // Settle: engines and pipes finish (the first enabled step, ticks last), the watchdog passes every deadline.
    for (let i = 0; i < 500; i++) {
      const st = this.steps(false).filter((x) => x.kind !== 'interfere')[0]!;
      this.log.push(`> ${st.name} (settle)`);
      st.run();
      if (st.name.startsWith('tick') && this.p.rooms.rooms().length + this.d.rooms.rooms().length + this.computing.size + this.loading.size + this.generating.size + this.dialing.size + this.toD.length + this.toP.length === 0) break;
    }
    this.tick(2000);
    this.tick(2000);
    for (const [side, drv] of [['prefill', this.p], ['decode', this.d]] as const) {
      if (drv.rooms.rooms().length) this.fail(`${side}: live rooms at the end`);
      if (drv.live) this.fail(`${side}: ${drv.live} request(s) still held`);
      if (drv.rooms.stats.illegal) this.fail(`${side}: illegal counter ${drv.rooms.stats.illegal}`);
    }
    if (this.slotsHeld !== 0 || this.d.freeSlots !== this.slots) this.fail(`decode slots not all back: ${this.slotsHeld} held`);
    for (const [room, n] of this.pAccepted) if ((this.pFinished.get(room) ?? 0) !== n) this.fail(`prefill ${room}: ${this.pFinished.get(room) ?? 0} finishes for ${n} accepted`);
    for (const [room, n] of this.dAccepted) {
      if ((this.dFinished.get(room) ?? 0) !== n) this.fail(`decode ${room}: ${this.dFinished.get(room) ?? 0} finishes for ${n} accepted`);
      if ((this.dReleased.get(room) ?? 0) !== n) this.fail(`decode ${room}: ${this.dReleased.get(room) ?? 0} releases for ${n} accepted`);
    }
    for (const room of this.mustTell) if (!this.toldPrefill.has(room)) this.fail(`decode failed ${room} itself and never told prefill`);
  }
}

const ROOMS = ['31', '32', '33'] as RoomId[];

function interleavings(legacy: boolean) {
  return fc.property(fc.array(fc.nat(), { minLength: 10, maxLength: 150, size: 'max' }), fc.integer({ min: 1, max: 3 }), fc.integer({ min: 1, max: 2 }), fc.boolean(), (choices, nRooms, slots, local) => {
    // The legacy rule's proof is about the PD handoff: no decode-local room there.
    new World(ROOMS.slice(0, nRooms), slots, legacy, local && !legacy ? (['39'] as RoomId[]) : []).play(choices);
  });
}

describe('the shipped prefill and decode drivers under every interleaving fast-check finds', () => {
  test('terminal by the deadline, one finish per request per side, slots released once, prefill told, illegal 0, queues bounded', () => {
    fc.assert(interleavings(false), { numRuns: 1500 });
  });

  test('a decode-local request alone succeeds, and sends nothing to prefill', () => {
    const w = new World([], 1, false, ['42' as RoomId]);
    w.play([0, 0]);
    assert.equal(w.d.rooms.get('42' as RoomId)?.state, KVPoll.Success);
    assert.equal(w.d.rooms.get('42' as RoomId)?.timeline.some((e) => e.phase === 'local'), true);
    assert.equal(w.p.rooms.get('42' as RoomId), undefined);
  });

  test('a full handoff succeeds on both sides when nothing interferes', () => {
    const w = new World(['41' as RoomId], 1, false);
    // Router requests, then always the first enabled non-router step.
    w.play([0, 0]);
    assert.equal(w.p.rooms.get('41' as RoomId)?.state, KVPoll.Success);
    assert.equal(w.d.rooms.get('41' as RoomId)?.state, KVPoll.Success);
    assert.ok(w.d.rooms.stats.success === 1 && w.p.rooms.stats.success === 1);
  });
});

describe('the same properties catch the legacy max rule', () => {
  test('with legacyMaxRule some interleaving breaks them (revival, wedge, double finish or leak)', () => {
    const out = fc.check(interleavings(true), { numRuns: 3000 });
    assert.equal(out.failed, true, 'the legacy rule should break the properties');
    const msg = String((out.errorInstance as Error | undefined)?.message ?? '');
    assert.match(msg, /past its deadline|finishes for|live rooms at the end|still held|releases for|after/);
  });
});
