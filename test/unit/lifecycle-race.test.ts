/**
 * Races between the async code paths of the workers, explored with fast-check's scheduler: every
 * `await` is a point where fast-check may run another task first. Small generic drivers mimic
 * the real ones (src/prefill/worker.ts, src/decode/worker.ts): a transfer continuation that awaits
 * then writes kv_begin/progress/kv_done, an abort applied concurrently, a registration racing the
 * request and an abort, a load racing the watchdog. Under all schedules: terminal is sticky, one
 * `terminal` per room, every resource released exactly once, nothing leaked, nothing run after
 * an abort. The same properties are shown to FAIL with `legacyMaxRule`.
 */
import { test, describe } from 'node:test';
import assert from 'node:assert/strict';
import fc from 'fast-check';
import { RoomTable } from '../../src/kv/lifecycle.js';
import { KVPoll, isTerminal, type Effect, type Role, type RoomEvent, type RoomTimeouts } from '../../src/kv/types.js';

const T: RoomTimeouts = { preallocMs: 1000, bootstrapMs: 1000, waitingMs: 1000, transferIdleMs: 1000 };
const ROOM = '4242';
const FAR = 1e9;

interface Handle {
  kind: string;
  released: number;
}

/** A room table plus the driver plumbing every worker has: effects → releases, with checks. */
class Harness {
  readonly table: RoomTable;
  now = 0;
  readonly log: string[] = [];
  private readonly handles: Handle[] = [];
  /** Resources owned by the room: released by the one terminal path. */
  readonly owned = new Set<Handle>();
  terminals = 0;
  terminalState: KVPoll | undefined;
  /** Set while an uncancellable operation (llama.cpp load) writes into an owned resource. */
  busy = false;
  deferred = false;
  onTerminal: (state: KVPoll) => void = () => {};

  constructor(role: Role, legacy: boolean) {
    this.table = new RoomTable(role, T, { legacyMaxRule: legacy });
  }

  acquire(kind: string): Handle {
    const h = { kind, released: 0 };
    this.handles.push(h);
    return h;
  }

  release(h: Handle, why: string): void {
    assert.ok(!(this.busy && h.kind === 'slot'), `slot released while a load still writes into it\n${this.log.join('\n')}`);
    h.released++;
    this.log.push(`release ${h.kind} (${why})`);
    assert.equal(h.released, 1, `${h.kind} released ${h.released} times\n${this.log.join('\n')}`);
  }

  releaseOwned(why: string): void {
    for (const h of this.owned) this.release(h, why);
    this.owned.clear();
  }

  run(eff: Effect[]): void {
    for (const e of eff) {
      if (e.t !== 'terminal') continue;
      this.terminals++;
      this.log.push(`terminal ${KVPoll[e.state]} (${e.failure ? `${e.failure.code}: ${e.failure.detail}` : 'kv_done'})`);
      assert.equal(this.terminals, 1, `second terminal effect\n${this.log.join('\n')}`);
      this.terminalState = e.state;
      this.onTerminal(e.state);
      if (this.busy) this.deferred = true;
      else this.releaseOwned('terminal');
    }
  }

  apply(ev: RoomEvent, label: string = ev.t): Effect[] {
    this.now++;
    const eff = this.table.apply(ROOM, ev, this.now);
    const r = this.table.get(ROOM);
    this.log.push(`${label} → ${r ? `${KVPoll[r.state]}/${r.phase}` : 'unknown'}${eff.length ? ` [${eff.map((e) => e.t).join(',')}]` : ''}`);
    this.run(eff);
    this.checkSticky();
    return eff;
  }

  tick(at: number): void {
    this.now = Math.max(this.now, at);
    const eff = this.table.tick(at);
    this.log.push(`tick@${at}${eff.length ? ` [${eff.map((e) => e.t).join(',')}]` : ''}`);
    this.run(eff);
    this.checkSticky();
  }

  checkSticky(): void {
    const r = this.table.get(ROOM);
    if (this.terminalState !== undefined && r) {
      assert.equal(r.state, this.terminalState, `terminal room moved to ${KVPoll[r.state]}\n${this.log.join('\n')}`);
    }
  }

  state(): KVPoll | undefined {
    return this.table.get(ROOM)?.state;
  }

  /** After everything settled: the watchdog ends any live room, then nothing may be left. */
  finish(): void {
    this.tick(FAR);
    const r = this.table.get(ROOM);
    if (r) assert.ok(isTerminal(r.state), `room still ${KVPoll[r.state]} after the watchdog\n${this.log.join('\n')}`);
    if (r) assert.equal(this.terminals, 1, `terminal effects: ${this.terminals}\n${this.log.join('\n')}`);
    for (const h of this.handles) assert.equal(h.released, 1, `${h.kind} released ${h.released} times (leak if 0)\n${this.log.join('\n')}`);
  }
}

const step = (s: fc.Scheduler, label: string): Promise<void> => s.schedule(Promise.resolve(), label).then(() => undefined);

/** Prefill: transfer continuation (compute → save → kv_begin → chunks → ack) vs an abort. */
function abortVsSend(legacy: boolean) {
  return fc.asyncProperty(fc.scheduler(), fc.integer({ min: 1, max: 3 }), fc.boolean(), async (s, chunks, alsoWatchdog) => {
    const h = new Harness('prefill', legacy);
    const transferInfo = new Set<string>();
    h.table.create(ROOM, 'rid', 0);
    h.apply({ t: 'registered', peer: 'decode-1', peerEpoch: 'D1' });
    transferInfo.add(ROOM);
    const queue = h.acquire('queue entry');
    h.owned.add(queue);

    const transfer = async (): Promise<void> => {
      await step(s, 'compute done');
      if (h.owned.delete(queue)) h.release(queue, 'dequeued');
      const file = h.acquire('state file');
      await step(s, 'transfer continuation');
      h.apply({ t: 'kv_begin', totalBytes: chunks * 10 }, 'continuation kv_begin');
      if (h.state() !== KVPoll.Transferring || h.terminals > 0) {
        h.release(file, 'kv_begin refused');
        return;
      }
      h.owned.add(file);
      if (!transferInfo.has(ROOM)) return; // the incident: the worker skips the room
      for (let i = 0; i < chunks; i++) {
        await step(s, `chunk ${i}`);
        if (h.state() !== KVPoll.Transferring) return;
        h.apply({ t: 'progress', bytes: 10 });
      }
      await step(s, 'kv_ack');
      h.apply({ t: 'kv_done' }, 'kv_ack');
    };
    const abort = async (): Promise<void> => {
      await step(s, 'client abort');
      transferInfo.delete(ROOM); // the incident's abort handler drops the transfer info first
      h.apply({ t: 'abort', from: 'router', failure: { code: 'request_aborted', detail: 'abort: router' } }, 'abort');
    };
    const watchdog = async (): Promise<void> => {
      await step(s, 'watchdog');
      h.tick(h.now + T.transferIdleMs);
    };
    const all = Promise.all([transfer(), abort(), ...(alsoWatchdog ? [watchdog()] : [])]);
    await s.waitIdle();
    await all;
    h.finish();
  });
}

/** Prefill: the router's request, decode's REGISTER and an abort, in any order. */
function abortVsRegistration(legacy: boolean) {
  return fc.asyncProperty(fc.scheduler(), async (s) => {
    const h = new Harness('prefill', legacy);
    let pendingReg: string | undefined;
    let order = 0;
    let abortedAt = -1;
    let computeStarted = -1;
    let queue: Handle | undefined;
    const answers: string[] = [];

    const register = (peer: string): void => {
      const before = h.state();
      const eff = h.apply({ t: 'registered', peer, peerEpoch: 'D1' }, 'REGISTER');
      for (const e of eff) {
        if (e.t === 'notify_peer') answers.push(`FAIL to ${e.peer}`);
        if (e.t === 'start_prefill') {
          queue = h.acquire('queue entry');
          h.owned.add(queue);
          void compute();
        }
      }
      if (before === KVPoll.Bootstrapping && h.state() === KVPoll.WaitingForInput) answers.push('REGISTERED');
    };
    const compute = async (): Promise<void> => {
      await step(s, 'engine picks the job');
      if (queue && h.owned.delete(queue)) h.release(queue, 'dequeued');
      if (h.state() !== KVPoll.WaitingForInput) return; // terminal: skipped
      computeStarted = ++order;
      h.log.push('compute runs');
    };

    const request = async (): Promise<void> => {
      await step(s, 'router request reaches prefill');
      h.now++;
      h.run(h.table.create(ROOM, 'rid', h.now));
      h.log.push(`create → ${KVPoll[h.state()!]}`);
      h.checkSticky();
      if (pendingReg && h.table.has(ROOM)) {
        const p = pendingReg;
        pendingReg = undefined;
        register(p);
      }
    };
    const registration = async (): Promise<void> => {
      await step(s, 'REGISTER reaches prefill');
      if (h.table.get(ROOM) || h.table.isTombstoned(ROOM)) register('decode-1');
      else pendingReg = 'decode-1';
    };
    const abort = async (): Promise<void> => {
      await step(s, 'router abort reaches prefill');
      pendingReg = undefined;
      abortedAt = ++order;
      h.apply({ t: 'abort', from: 'router', failure: { code: 'request_aborted', detail: 'abort: router' } }, 'abort');
    };
    const all = Promise.all([request(), registration(), abort()]);
    await s.waitIdle();
    await all;
    assert.ok(computeStarted < 0 || computeStarted < abortedAt, `compute ran after the abort\n${h.log.join('\n')}`);
    assert.ok(!answers.includes('REGISTERED') || answers.indexOf('REGISTERED') === answers.lastIndexOf('REGISTERED'));
    assert.equal(h.state(), KVPoll.Failed, `abort must win: ${h.log.join('\n')}`);
    h.finish();
  });
}

/** Decode: KV load (uncancellable) racing the watchdog and a peer FAIL; the slot is released once. */
function deadlineVsSuccess(legacy: boolean) {
  return fc.asyncProperty(fc.scheduler(), fc.boolean(), async (s, peerFail) => {
    const h = new Harness('decode', legacy);
    h.table.create(ROOM, 'rid', 0, 'prefill:8998');
    const slot = h.acquire('slot');
    h.owned.add(slot);
    h.apply({ t: 'slot_reserved' });
    h.apply({ t: 'registered' });
    h.apply({ t: 'kv_begin', totalBytes: 10 });
    h.apply({ t: 'progress', bytes: 10 });
    const recv = h.acquire('receive buffer');
    h.owned.add(recv);
    let generating = false;
    h.onTerminal = (state) => {
      if (state === KVPoll.Success) {
        h.owned.delete(slot); // the slot now belongs to generation
        generating = true;
        void (async () => {
          await step(s, 'generation ends');
          h.release(slot, 'generation done');
        })();
      }
    };

    const load = async (): Promise<void> => {
      await step(s, 'load starts');
      if (h.state() !== KVPoll.Transferring) return;
      h.busy = true;
      await step(s, 'load returns');
      h.busy = false;
      if (h.state() === KVPoll.Transferring && h.terminals === 0) {
        h.apply({ t: 'kv_done' }, 'loaded');
      } else if (h.deferred) {
        h.deferred = false;
        h.releaseOwned('load returned after the room failed');
      }
    };
    const watchdog = async (): Promise<void> => {
      await step(s, 'watchdog');
      h.tick(h.now + T.transferIdleMs);
    };
    const fail = async (): Promise<void> => {
      await step(s, 'prefill FAIL');
      h.apply({ t: 'abort', from: 'peer', failure: { code: 'room_deadline_expired', detail: 'prefill: deadline' } }, 'FAIL from prefill');
    };
    const all = Promise.all([load(), watchdog(), ...(peerFail ? [fail()] : [])]);
    await s.waitIdle();
    await all;
    assert.equal(h.busy, false);
    assert.ok(!generating || h.terminalState === KVPoll.Success);
    h.finish();
  });
}

describe('races under every schedule (real rule)', () => {
  test('abort vs transfer continuation: sticky, single release, no leak', async () => {
    await fc.assert(abortVsSend(false), { numRuns: 500 });
  });
  test('abort vs registration vs request: the abort wins, nothing runs after it', async () => {
    await fc.assert(abortVsRegistration(false), { numRuns: 500 });
  });
  test('deadline vs load/success: one terminal, the slot released exactly once', async () => {
    await fc.assert(deadlineVsSuccess(false), { numRuns: 500 });
  });
});

describe('the same properties catch the legacy max rule', () => {
  test('abort vs transfer continuation fails with legacyMaxRule (revival / leak)', async () => {
    const out = await fc.check(abortVsSend(true), { numRuns: 500 });
    assert.equal(out.failed, true, 'legacy rule should break the property');
    const msg = String((out.errorInstance as Error | undefined)?.message ?? '');
    assert.match(msg, /terminal room moved|second terminal|released 0 times|after the watchdog/);
  });
  test('abort vs registration fails with legacyMaxRule (a registration revives the aborted room)', async () => {
    const out = await fc.check(abortVsRegistration(true), { numRuns: 500 });
    assert.equal(out.failed, true);
  });
});
