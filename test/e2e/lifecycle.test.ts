/**
 * The room lifecycle on real processes: a client abort in every phase of a request, a prefill
 * that fails early, and each scenario repeated (PDSERVE_LIFECYCLE_REPS; default 8, 50 with
 * PDSERVE_LONG_TESTS=1). Pass: no
 * crash; the victim's rooms terminal on both sides and everything released within 1 s; the next
 * request succeeds. The target phase of each scenario is made long enough to hit with a test-only
 * hold (PDSERVE_TEST_HOLDS, set at run time through POST /debug/test-holds).
 */
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import type { Cluster } from '../../src/up/cluster.js';
import { busy, getJson, promptOf, startStack, waitFor } from '../helpers/stack.js';

const REPS = Number(process.env.PDSERVE_LIFECYCLE_REPS ?? (process.env.PDSERVE_LONG_TESTS === '1' ? 50 : 8));
/** How long the target phase is held, ms: long enough to observe on a loaded 2-core machine. */
const HOLD = 150;

interface LiveRoom {
  room: string;
  rid: string;
  phase: string;
  step: string | null;
  state: string;
}
interface Debug {
  live: LiveRoom[];
  recent: { room: string; state: string; fail_reason: string | null }[];
  decoding?: { room: string }[];
}

let c: Cluster;
const url = (role: 'prefill' | 'decode') => c.byRole(role)[0]!.url;
const debug = (role: 'prefill' | 'decode') => getJson<Debug>(`${url(role)}/debug/rooms`);

/** POST a streamed completion and read it to the end; resolves with the HTTP status (0 when aborted). */
async function completion(body: Record<string, unknown>, signal?: AbortSignal): Promise<{ status: number; text: string }> {
  try {
    const r = await fetch(`${c.router.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'pdserve', temperature: 0, ...body }), signal: signal ?? AbortSignal.timeout(15_000) });
    return { status: r.status, text: await r.text() };
  } catch {
    return { status: 0, text: '' };
  }
}

async function nextRequestSucceeds(): Promise<void> {
  const r = await completion({ prompt: 'and then', max_tokens: 4, stream: true });
  assert.equal(r.status, 200, r.text);
  assert.match(r.text, /\[DONE\]/);
}

async function idleWithin(ms: number): Promise<void> {
  const ok = await waitFor(async () => (await busy(url('prefill'))) === 0 && (await busy(url('decode'))) === 0, ms, 10);
  if (!ok) assert.fail(`not idle within ${ms} ms: prefill ${JSON.stringify(await debug('prefill'))} decode ${JSON.stringify(await debug('decode'))}`);
}

/** Wait until `pick` finds the victim's room on `role` (polling /debug/rooms), at most 3 s. */
async function findRoom(role: 'prefill' | 'decode', pick: (d: Debug) => string | undefined): Promise<string> {
  let found: string | undefined;
  const ok = await waitFor(async () => (found = pick(await debug(role))) !== undefined, 3000, 3);
  assert.ok(ok && found, `victim reached the phase on ${role}`);
  return found;
}

interface Scenario {
  name: string;
  /** Holds for this scenario (PDSERVE_TEST_HOLDS syntax). */
  holds: string;
  /** Tokens the victim asks for (it is aborted long before). */
  maxTokens?: number;
  /** Start background work the victim must queue behind; returns its completion. */
  setup?: () => Promise<unknown>;
  /** Holds once the background work occupies what the victim must wait for. */
  ready?: () => Promise<boolean>;
  /** Where to wait before aborting; undefined = abort after a fixed delay. */
  find?: { role: 'prefill' | 'decode'; pick: (d: Debug) => string | undefined };
  delayMs?: number;
}

const liveIn = (phase: string, step?: string) => (d: Debug) => d.live.find((r) => r.phase === phase && (step === undefined || r.step === step))?.room;

const scenarios: Scenario[] = [
  { name: 'router before dispatch', holds: `router.dispatch=${HOLD}`, delayMs: HOLD / 3 },
  { name: 'prefill bootstrapping', holds: `decode.register=${HOLD}`, find: { role: 'prefill', pick: liveIn('bootstrap') } },
  {
    name: 'prefill waiting (queued behind another prompt)',
    // Longer: the victim must register while the first prompt still holds the only prefill slot.
    holds: `prefill.compute=${HOLD * 3}`,
    setup: () => completion({ prompt: promptOf(40, 1), max_tokens: 2, stream: true }),
    ready: async () => (await debug('prefill')).live.some((r) => r.step === 'computing'),
    find: { role: 'prefill', pick: liveIn('waiting', 'queued') },
  },
  { name: 'prefill computing', holds: `prefill.compute=${HOLD}`, find: { role: 'prefill', pick: liveIn('waiting', 'computing') } },
  { name: 'prefill inflight (transferring)', holds: `prefill.send=${HOLD}`, find: { role: 'prefill', pick: liveIn('inflight') } },
  {
    name: 'decode prealloc (all slots busy)',
    holds: `prefill.compute=${HOLD}`,
    setup: () => Promise.all([0, 1].map((i) => completion({ prompt: promptOf(10, i), max_tokens: 250, ignore_eos: true, stream: true }))),
    ready: async () => (await getJson<{ decode_slots_used: number }>(`${url('decode')}/health`)).decode_slots_used === 2,
    find: { role: 'decode', pick: liveIn('prealloc') },
  },
  { name: 'decode transfer queue', holds: `decode.load=${HOLD}`, find: { role: 'decode', pick: liveIn('transfer') } },
  { name: 'decoding', holds: '', maxTokens: 800, find: { role: 'decode', pick: (d) => d.decoding?.[0]?.room } },
];

/** Set the same holds on every process of the stack. */
async function setHolds(spec: string): Promise<void> {
  await Promise.all(
    c.procs.map(async (p) => {
      const r = await fetch(`${p.url}/debug/test-holds`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ spec }) });
      assert.equal(r.status, 200, `${p.name} accepts test holds`);
    }),
  );
}

before(async () => {
  c = await startStack({ colocated: false, decodeSlots: 2, env: { PDSERVE_TEST_HOLDS: 'on' } });
});
after(async () => {
  await c?.stop();
});

describe(`client abort in each phase, ${REPS}× each`, () => {
  for (const s of scenarios) {
    test(s.name, async () => {
      // From an idle stack: the victim of an earlier scenario that failed mid-rep (still decoding,
      // still holding a slot) must not be the room this scenario's `find` picks.
      await idleWithin(15_000);
      await setHolds(s.holds);
      for (let i = 0; i < REPS; i++) {
        const background = s.setup?.();
        if (s.ready) assert.ok(await waitFor(s.ready, 3000, 3), 'background work in place');
        const ac = new AbortController();
        const victim = completion({ prompt: promptOf(30 + (i % 7) * 10, i), max_tokens: s.maxTokens ?? 200, ignore_eos: true, stream: true }, ac.signal);
        let room: string | undefined;
        if (s.find) room = await findRoom(s.find.role, s.find.pick);
        else await new Promise((r) => setTimeout(r, s.delayMs));
        ac.abort();
        const t0 = Date.now();
        const v = await victim;
        assert.ok(!(v.status === 200 && /\[DONE\]/.test(v.text)), 'the aborted victim did not complete normally');
        if (room) {
          // Both sides' rooms terminal within 1 s (the side that never saw it has nothing live).
          const gone = await waitFor(async () => {
            const [p, d] = await Promise.all([debug('prefill'), debug('decode')]);
            return !p.live.some((r) => r.room === room) && !d.live.some((r) => r.room === room) && !(d.decoding ?? []).some((r) => r.room === room);
          }, 1000, 10);
          assert.ok(gone, `room ${room} terminal on both sides within 1 s (after ${Date.now() - t0} ms)`);
        }
        await background;
        await idleWithin(1000);
        // The next request runs unheld (the holds only place the victim), then they are set again.
        if (s.holds) await setHolds('');
        await nextRequestSucceeds();
        if (s.holds) await setHolds(s.holds);
      }
      for (const p of c.procs) assert.equal(p.unexpectedExits.length, 0, `${p.name} did not crash`);
    });
  }

  test('prefill answers an error at once: the client gets it within 1 s and the decode leg is cancelled', async () => {
    await idleWithin(15_000);
    await setHolds('');
    for (let i = 0; i < Math.min(REPS, 20); i++) {
      const t0 = Date.now();
      const r = await completion({ prompt: promptOf(3000, i), max_tokens: 16, stream: true });
      assert.ok(Date.now() - t0 < 1000, `error within 1 s (${Date.now() - t0} ms)`);
      assert.equal(r.status, 400, r.text);
      assert.match(r.text, /context/);
      await idleWithin(1000);
      const d = await debug('decode');
      assert.ok(d.recent.length > 0 && d.recent[0]!.state === 'Failed', 'decode room failed, not left waiting');
    }
    await nextRequestSucceeds();
  });
});
