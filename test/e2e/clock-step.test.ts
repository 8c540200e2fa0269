/**
 * Wall-clock steps under light load on real processes: the router, prefill and decode run under
 * Debian's libfaketime (LD_PRELOAD) with the offset read from a file at run time, and the test
 * steps their wall clock by +10 min, then back by −10 min, while requests cross each step.
 * DONT_FAKE_MONOTONIC=1 leaves CLOCK_MONOTONIC real, as an NTP step would. The test's own calls to
 * the workers are signed on the same stepped wall clock (a signature's window is wall time, shared
 * by design across processes). Pass: every request
 * succeeds, no room expires, no KV peer is lost, every worker stays healthy, every age and
 * deadline on /debug/rooms stays within its phase's bounds, and the only failed rooms are those of
 * attempts refused in the instant between two processes seeing the step (dispatched again, served).
 */
import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, readdirSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, test } from 'node:test';
import type { Cluster } from '../../src/up/cluster.js';
import { systemClock } from '../../src/base/clock.js';
import { busy, client, getJson, promptOf, startStack, waitFor } from '../helpers/stack.js';

/** libfaketime's multi-threaded build (Debian's `faketime` package), or null. */
function libfaketime(): string | null {
  const dirs = ['/usr/lib/faketime', ...(existsSync('/usr/lib') ? readdirSync('/usr/lib').map((d) => `/usr/lib/${d}/faketime`) : [])];
  return dirs.map((d) => join(d, 'libfaketimeMT.so.1')).find((p) => existsSync(p)) ?? null;
}

const LIB = libfaketime();
const STEP_MS = 10 * 60_000;
/** Held in decode before REGISTER, so rooms are live on both roles (Bootstrapping) when the clock steps. */
const HOLD_MS = 600;

interface Room {
  room: string;
  state: string;
  phase: string;
  age_ms: number;
  deadline_ms: number | null;
}
interface Rooms {
  now: number;
  live: Room[];
  recent: Room[];
}

let c: Cluster | undefined;
const offsetFile = join(mkdtempSync(join(tmpdir(), 'pdserve-faketime-')), 'offset');
const realWall = systemClock.wallMs;
/**
 * Set the faked processes' wall clock to the real one + `ms` (libfaketime's "+N" offset syntax,
 * seconds), and this process's request signatures with them.
 */
const setOffset = (ms: number) => {
  writeFileSync(offsetFile, `${ms >= 0 ? '+' : ''}${ms / 1000}\n`);
  systemClock.wallMs = () => realWall() + ms;
};

before(async () => {
  if (!LIB) return;
  setOffset(0);
  c = await startStack({
    colocated: false,
    decodeSlots: 4,
    env: { LD_PRELOAD: LIB, FAKETIME_TIMESTAMP_FILE: offsetFile, FAKETIME_NO_CACHE: '1', DONT_FAKE_MONOTONIC: '1', PDSERVE_TEST_HOLDS: `decode.register=${HOLD_MS}` },
  });
});
after(async () => {
  await c?.stop();
  systemClock.wallMs = realWall;
});

test('the wall clock steps +10 min and −10 min under load: no expired room, no lost peer, sane ages', async (t) => {
  if (!LIB) {
    const msg = 'libfaketime is NOT installed: the wall-clock step test did NOT run (apt-get install faketime)';
    process.stderr.write(`\n!!!!! ${msg} !!!!!\n\n`);
    t.diagnostic(msg);
    assert.ok(!process.env.CI, `${msg}; CI must have it (.ci/install-tools)`);
    return;
  }
  const cl = c!;
  const workers = [...cl.byRole('prefill'), ...cl.byRole('decode')];
  const pd = client(cl.router.url, 30_000);
  const failures: string[] = [];
  const bad: string[] = [];
  let ok = 0;
  let stop = false;
  const loop = async (k: number) => {
    for (let i = 0; !stop; i++) {
      try {
        const r = await pd.completions.create({ model: 'pdserve', prompt: promptOf(40, k * 1000 + i), max_tokens: 4, temperature: 0 });
        if (r.choices[0]?.finish_reason) ok++;
      } catch (err) {
        failures.push(`client ${k}: ${(err as Error).message}`);
      }
    }
  };
  /** Sample every worker's /debug/rooms: live ages and deadlines within the phase bounds. */
  const sample = async (label: string) => {
    for (const w of workers) {
      const d = await getJson<Rooms>(`${w.url}/debug/rooms`);
      for (const r of d.live) {
        if (!(r.age_ms >= 0 && r.age_ms < 30_000)) bad.push(`${label}: ${w.name} room ${r.room} ${r.state}/${r.phase} age_ms ${r.age_ms}`);
        if (r.deadline_ms !== null && !(r.deadline_ms > -2000 && r.deadline_ms <= 60_000)) bad.push(`${label}: ${w.name} room ${r.room} ${r.state}/${r.phase} deadline_ms ${r.deadline_ms}`);
      }
    }
  };
  /** Step every process to `offset` and wait until each one's wall clock shows it; then sample under load. */
  const stepTo = async (offset: number, label: string) => {
    setOffset(offset);
    const shows = async (): Promise<boolean> => {
      const nows = await Promise.all(workers.map(async (w) => (await getJson<Rooms>(`${w.url}/debug/rooms`)).now));
      const created = (await pd.completions.create({ model: 'pdserve', prompt: 'x', max_tokens: 1 })).created * 1000;
      return [...nows, created].every((n) => Math.abs(n - (Date.now() + offset)) < 5000);
    };
    const t0 = Date.now();
    assert.ok(await waitFor(shows, 10_000, 100), `${label}: every process's wall clock moved to real ${offset >= 0 ? '+' : ''}${offset / 60_000} min`);
    t.diagnostic(`${label}: every process showed the step after ${Date.now() - t0} ms`);
    const end = Date.now() + 4 * HOLD_MS + 1500;
    while (Date.now() < end) {
      await sample(label);
      await new Promise((r) => setTimeout(r, 150));
    }
  };

  const clients = [0, 1, 2].map(loop);
  await new Promise((r) => setTimeout(r, 2 * HOLD_MS));
  await sample('before the steps');
  await stepTo(STEP_MS, '+10 min');
  await stepTo(0, '−10 min');
  stop = true;
  await Promise.all(clients);

  t.diagnostic(`${ok} requests, ${failures.length} failed`);
  assert.deepEqual({ failures, bad }, { failures: [], bad: [] }, 'every request crossing a step succeeded; ages and deadlines on /debug/rooms stayed sane');
  assert.ok(ok >= 6, `requests ran under the steps (${ok})`);
  assert.ok(await waitFor(async () => (await Promise.all(workers.map((w) => busy(w.url)))).every((n) => n === 0), 10_000, 50), 'idle after the load');
  const sum = (text: string, re: RegExp) => [...text.matchAll(re)].reduce((s, m) => s + Number(m[1]), 0);
  const notOk: string[] = [];
  for (const w of workers) {
    const metrics = await (await fetch(`${w.url}/metrics`, { signal: AbortSignal.timeout(5000) })).text();
    assert.equal(sum(metrics, /^pdserve_room_deadline_expired_total\{[^}]*\} (\S+)$/gm), 0, `${w.name}: no room expired`);
    assert.equal(sum(metrics, /^pdserve_kv_channel_events_total\{[^}]*event="peers_lost"[^}]*\} (\S+)$/gm), 0, `${w.name}: no KV peer lost`);
    const d = await getJson<Rooms>(`${w.url}/debug/rooms`);
    notOk.push(...d.recent.filter((r) => r.state !== 'Success').map((r) => `${w.name}: ${r.room} ${r.state}`));
  }
  // In the instant one process shows the step and its peer does not yet, a signed request is 10 min
  // off the verifier's clock (the window is ±30 s of wall time, by design): it is refused as
  // worker_unauthenticated, the router dispatches it again, and that first attempt's room fails.
  // Any other failed room is a defect.
  const routerMetrics = await (await fetch(`${cl.router.url}/metrics`, { signal: AbortSignal.timeout(5000) })).text();
  const refused = sum(routerMetrics, /^pdserve_router_retries_total\{[^}]*reason="worker_unauthenticated"[^}]*\} (\S+)$/gm);
  const refusedOk = sum(routerMetrics, /^pdserve_router_retries_total\{(?=[^}]*reason="worker_unauthenticated")(?=[^}]*outcome="ok")[^}]*\} (\S+)$/gm);
  t.diagnostic(`${refused} attempts refused in a step's instant and dispatched again; failed rooms: ${JSON.stringify(notOk)}`);
  assert.equal(refusedOk, refused, 'every attempt refused in a step\'s instant was served on its next attempt');
  assert.ok(notOk.length <= refused, `every failed room is a refused attempt's (${refused}): ${JSON.stringify(notOk)}`);
  const reg = await getJson<{ workers: { url: string; healthy: boolean; consecutive_failures?: number }[] }>(`${cl.router.url}/workers`);
  assert.ok(reg.workers.length === 2 && reg.workers.every((w) => w.healthy), `every worker stayed healthy: ${JSON.stringify(reg.workers)}`);
});
