/**
 * The same-host KV handoff (kv_file) with real processes, the real engine (tiny model) and the
 * real openai client: one router, one prefill and two decode workers sharing a private state
 * directory; decode-0 takes state files over (same host), decode-1 runs --no-kv-same-host (TCP).
 *  - greedy PD output equals the colocated reference on both paths, and each path carried rooms
 *    (pdserve_kv_handoffs_total by path; the path of a live room in /debug/rooms);
 *  - prefill SIGKILLed right after handing a file over, before decode took it: the request fails,
 *    decode lives, the file is removed (swept: its owner is dead) and nothing stays behind;
 *  - prefill SIGKILLed after decode took the file over (ownership moved, the load held): decode
 *    fails the room cleanly and deletes its file; nothing stays behind; the next request works.
 *  - a prompt whose state is over the decodes' --max-state-bytes (1M; `'ab ' × 1000`, ~1.06 MB):
 *    streamed or not, n = 1 or 2, on both paths (TCP streamed while saved, TCP saved-then-sent
 *    for n = 2, same host), the client gets `kv_state_too_large` naming the flag at once — one
 *    attempt, no retry or migration — nothing stays behind, and the next request is served.
 *  - a client that stops reading a long stream (a raw socket, paused) — n = 1, n = 3 and
 *    /v1/responses, on the router and on colocated: cut within --client-write-deadline-ms once
 *    its queue stops draining, counted (pdserve_client_cut_total{reason="stalled"}), its rooms
 *    aborted and the slots freed long before the stream would have ended; a client that stops
 *    reading a large non-streamed body (~1 MB) is cut and counted the same way on both, while
 *    a reading client gets the whole body with its content-length;
 *  - the state directory full (its own 64 MiB tmpfs, root only, filled by a file): the client
 *    gets 507 `state_dir_full` at once, one save tried and never again on that host, prefill's
 *    /health `degraded`, the router's /workers row `degraded`, doctor's `state_dir_full` finding,
 *    the metrics; once the file goes, the router takes the worker back and requests are served;
 *    no process died and no state file stays behind.
 * Damaged or cut handed files: test/e2e/corrupt-state.test.ts; the probe's fallbacks (another
 * boot id, pid namespace or directory, the flag on either side): test/unit/same-host.test.ts.
 */
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readdirSync, rmSync, statfsSync, writeFileSync } from 'node:fs';
import { connect, type Socket } from 'node:net';
import { join } from 'node:path';
import { after, describe, test } from 'node:test';
import { busy, getJson, promptOf, useStack, waitFor } from '../helpers/stack.js';
import { cli } from '../helpers/cli.js';

const dir = mkdtempSync('/dev/shm/pdserve-samehost-e2e-');
/** The state directory's own tmpfs (root only), so the full-directory case can fill it without touching /dev/shm. */
const TMPFS_BYTES = 64 << 20;
let ownTmpfs: string | undefined;
try {
  if (process.getuid?.() === 0) {
    execFileSync('mount', ['-t', 'tmpfs', '-o', `size=${TMPFS_BYTES}`, 'tmpfs', dir]);
    ownTmpfs = dir;
  } else ownTmpfs = undefined;
} catch (err) {
  console.warn(`same-host.test.ts: cannot mount a tmpfs on ${dir} (${(err as Error).message}): the full state directory case is skipped`);
}
after(() => {
  if (ownTmpfs) execFileSync('umount', ['-l', ownTmpfs]);
  rmSync(dir, { recursive: true, force: true });
});

/** How long decode-0 holds a caught room (in take or load), ms: the test sees it and kills prefill meanwhile. */
const HOLD_MS = 3000;
/**
 * The router's deadline of one request, ms: twice a hold, so a held room's hold ends well before
 * the deadline (the request fails for its dead prefill, never for the hold); well below the client's 30 s.
 */
const REQUEST_DEADLINE_MS = 2 * HOLD_MS;
/** The router's --client-write-deadline-ms: a stalled reader is cut this long after its queue stopped draining. */
const CLIENT_DEADLINE_MS = 2500;
/** The router's deadline while the stalled-reader cases run, ms: past their 12 s generation. */
const STALL_REQUEST_DEADLINE_MS = 30_000;
/** Tokens a stalled reader's stream asks for: 4000 at 3 ms a token take at least 12 s (the context is 4096). */
const STALL_TOKENS = 4000;
/** A stalled reader is cut within this, ms: under the 12 s its generation takes at least, so the cut (not the end) frees the rooms. */
const STALL_CUT_WITHIN_MS = 11_500;
/** Both decodes' --max-state-bytes: the smallest accepted; the tiny model's state is ~530 B/token. */
const MAX_STATE = '1M';
/** A prompt of ~2000 tokens (a ~1.06 MB state: over MAX_STATE), as the context allows. */
const BIG_PROMPT = 'ab '.repeat(1000);
const h = useStack({
  decode: 2,
  ctxSize: 4096,
  env: { PDSERVE_TEST_HOLDS: 'on' },
  // A request whose only prefill was killed waits for one until its deadline (--worker-wait-ms):
  // 6 s here, not the default 300 s (cut short by the client's 30 s), so the kill cases end soon.
  extraArgs: { prefill: ['--state-dir', dir], decode: ['--state-dir', dir, '--max-state-bytes', MAX_STATE], router: ['--decode-policy', 'round_robin', '--request-timeout-ms', String(REQUEST_DEADLINE_MS), '--client-write-deadline-ms', String(CLIENT_DEADLINE_MS)], colocated: ['--client-write-deadline-ms', String(CLIENT_DEADLINE_MS)] },
  extraArgsOf: { 'decode-1': ['--no-kv-same-host'] },
});

const proc = (name: string) => h.c.procs.find((p) => p.name === name)!;
const setHolds = (name: string, spec: string) => fetch(`${proc(name).url}/debug/test-holds`, { method: 'POST', headers: { 'content-type': 'text/plain' }, body: spec });
/** State files of rooms (not decode's spare received-state files, `pdserve-kvrecv-*`, kept by a live decode for the next TCP handoff). */
const stateFiles = () => readdirSync(dir).filter((n) => (n.endsWith('.ggsq') || n.endsWith('.nonce')) && !n.startsWith('pdserve-kvrecv-'));

/** pdserve_client_cut_total{reason="stalled"} of the router or colocated server at `url`. */
const cuts = async (url: string) => Number(/^pdserve_client_cut_total\{reason="stalled"\} (\d+)/m.exec(await (await fetch(`${url}/metrics`)).text())?.[1] ?? NaN);

/** A raw HTTP/1.1 POST of `body` to `url` + `path` whose socket never reads (paused) until resumed; `received` counts the bytes read after, `closedAt` when it closed. */
function stalledReader(url: string, path: string, body: Record<string, unknown>): Socket & { closedAt: number; received: number } {
  const u = new URL(url);
  const json = JSON.stringify(body);
  const sock = Object.assign(connect(Number(u.port), u.hostname), { closedAt: 0, received: 0 });
  sock.pause(); // never read a byte: the kernel queues fill, then the server's
  sock.on('data', (b: Buffer) => (sock.received += b.length));
  sock.on('close', () => (sock.closedAt = Date.now()));
  sock.on('error', () => {});
  sock.write(`POST ${path} HTTP/1.1\r\nhost: ${u.host}\r\ncontent-type: application/json\r\ncontent-length: ${Buffer.byteLength(json)}\r\n\r\n${json}`);
  return sock;
}

/** Restart the router with another --request-timeout-ms; resolves once it serves a request. */
async function restartRouter(deadlineMs: number): Promise<void> {
  const r = h.c.router;
  const i = r.args.indexOf('--request-timeout-ms');
  assert.ok(i >= 0);
  if (r.args[i + 1] === String(deadlineMs)) return;
  await h.c.kill(r);
  r.args[i + 1] = String(deadlineMs);
  await h.c.spawn(r);
  const ok = await waitFor(async () => (await h.pd.completions.create({ model: 'pdserve', prompt: 'Once', max_tokens: 2, temperature: 0 }).then(() => true, () => false)), 15_000, 200);
  assert.ok(ok, `the router serves again (deadline ${deadlineMs} ms)`);
}

/** pdserve_kv_handoffs_total by path of one worker. */
async function handoffs(name: string): Promise<Record<string, number>> {
  const text = await (await fetch(`${proc(name).url}/metrics`)).text();
  const out: Record<string, number> = {};
  for (const m of text.matchAll(/^pdserve_kv_handoffs_total\{path="([a-z_]+)"\} (\d+)/gm)) out[m[1]!] = Number(m[2]);
  return out;
}

/**
 * Send a greedy streamed request through the router until one lands on decode-0 and is seen there
 * as a live same-host room in `step` (decode-0 holds it there); returns the room and the request.
 */
async function heldOnDecode0(step: string): Promise<{ room: string; done: Promise<unknown> }> {
  for (let attempt = 0; attempt < 4; attempt++) {
    const done = h.pd.completions.create({ model: 'pdserve', prompt: promptOf(120, 50 + attempt), max_tokens: 6, temperature: 0 }).then(
      (r) => ({ ok: true, r }),
      (err: unknown) => ({ ok: false, err }),
    );
    let room: string | undefined;
    await waitFor(async () => {
      const rooms = await getJson<{ live: { room: string; kv_path: string | null; step: string | null }[] }>(`${proc('decode-0').url}/debug/rooms`);
      room = rooms.live.find((r) => r.kv_path === 'same_host' && r.step === step)?.room;
      return room !== undefined;
    }, 6000);
    if (room) return { room, done };
    await done; // it went to decode-1 (TCP): try again
  }
  throw new Error(`no request was held on decode-0 in step ${step}`);
}

describe('same-host KV handoff (kv_file)', () => {
  test('PD == colocated on both paths (same host on decode-0, TCP on decode-1), and each path carried rooms', async () => {
    for (let i = 0; i < 6; i++) {
      const prompt = promptOf(60 + i * 40, i);
      const req = { model: 'pdserve', prompt, max_tokens: 9, temperature: 0 } as const;
      const [pd, ref] = await Promise.all([h.pd.completions.create(req), h.ref.completions.create(req)]);
      assert.equal(pd.choices[0]!.text, ref.choices[0]!.text, `request ${i}: PD text equals colocated`);
      const chat = { model: 'pdserve', messages: [{ role: 'user' as const, content: prompt }], max_tokens: 7, temperature: 0 };
      const [a, b] = await Promise.all([h.pd.chat.completions.create(chat), h.ref.chat.completions.create(chat)]);
      assert.equal(a.choices[0]!.message.content, b.choices[0]!.message.content, `chat ${i}: PD equals colocated`);
    }
    const d0 = await handoffs('decode-0');
    const d1 = await handoffs('decode-1');
    // Prefill counts a handoff when its room reaches Success, on decode's kv_ack, which may trail
    // the response the client already has: wait (5 s) for the twelfth, and never a thirteenth.
    let p0: Record<string, number> = {};
    await waitFor(async () => { p0 = await handoffs('prefill-0'); return (p0.same_host ?? 0) + (p0.tcp ?? 0) >= 12; }, 5000);
    assert.ok((d0.same_host ?? 0) >= 3 && (d0.tcp ?? 0) === 0, `decode-0 took every state over on the same host: ${JSON.stringify(d0)}`);
    assert.ok((d1.tcp ?? 0) >= 3 && (d1.same_host ?? 0) === 0, `decode-1 (--no-kv-same-host) received every state over TCP: ${JSON.stringify(d1)}`);
    assert.equal((p0.same_host ?? 0) + (p0.tcp ?? 0), 12, `prefill counted each handoff once by path: ${JSON.stringify(p0)}`);
    assert.ok(await waitFor(async () => stateFiles().length === 0, 3000), `no state file left behind: ${stateFiles().join(', ')}`);
  });

  test('a state over decode\'s --max-state-bytes: kv_state_too_large at once on every path (stream or not, n = 1 or 2), one attempt; nothing left; the next request is served', async () => {
    const tooLarge = async (name: string) => {
      const m = /^pdserve_rooms_cancelled_total\{code="kv_state_too_large"\} (\d+)/m.exec(await (await fetch(`${proc(name).url}/metrics`)).text());
      return Number(m?.[1] ?? 0);
    };
    const counts = async () => [await tooLarge('decode-0'), await tooLarge('decode-1')];
    const routerMetrics = async () => (await (await fetch(`${h.c.router.url}/metrics`)).text()).split('\n').filter((l) => /^pdserve_router_(migrations|retries)_total\{/.test(l)).sort().join('\n');
    const retriesBefore = await routerMetrics();
    /** The message a decode's path gives: streamed TCP learns the size as bytes come; an announced size (TCP n = 2, a handed file) is exact. */
    const streamedMsg = /over this decode worker's limit of 1048576 bytes \(1 MiB\) \(decode --max-state-bytes\): 1048576 bytes arrived and more followed; it needs about \d+ bytes/;
    const announcedMsg = /KV state of \d+ bytes \([\d.]+ MiB\) is over this decode worker's limit of 1048576 bytes \(1 MiB\) \(decode --max-state-bytes\): .*--max-state-bytes of at least \d+/;
    const seen = { streamed: 0, announced: 0, sameHost: 0 };
    for (const n of [1, 2]) {
      for (const stream of [false, true]) {
        // twice: round robin puts the two on different decodes (n = 2: each request's two choices)
        for (let rep = 0; rep < (n === 1 ? 2 : 1); rep++) {
          const before = await counts();
          const label = `n=${n} stream=${stream} #${rep}`;
          let err: any;
          let tokens = 0;
          try {
            if (stream) {
              const s = await h.pd.completions.create({ model: 'pdserve', prompt: BIG_PROMPT, max_tokens: 8, temperature: 0, n, stream: true });
              for await (const c of s) tokens += c.choices[0]?.text ? 1 : 0;
            } else await h.pd.completions.create({ model: 'pdserve', prompt: BIG_PROMPT, max_tokens: 8, temperature: 0, n });
          } catch (e) {
            err = e;
          }
          assert.ok(err, `${label}: the request failed`);
          assert.equal(err.code, 'kv_state_too_large', `${label}: ${err.message}`);
          assert.match(err.message, /--max-state-bytes/, label);
          assert.doesNotMatch(err.message, /does not follow|goes past the limit|outside \(0/, label);
          if (stream) assert.equal(err.status, undefined, `${label}: an SSE error event after token 1, not an HTTP error`);
          else assert.equal(err.status, 400, label);
          assert.ok(tokens <= n, `${label}: at most token 1 of each choice before the error (${tokens})`);
          // which decode(s) failed the room(s): prefill and decode may answer in either order, the count trails a little
          let after = before;
          await waitFor(async () => { after = await counts(); return after[0]! + after[1]! - before[0]! - before[1]! >= n; }, 3000);
          // at most one room per choice (an attempt run again would fail another room); n = 2: the
          // first choice to fail ends the request, the other's room may end as aborted before its state came
          const failed = after[0]! + after[1]! - before[0]! - before[1]!;
          assert.ok(failed >= 1 && failed <= n, `${label}: one attempt per choice, failed kv_state_too_large on a decode (${failed})`);
          const on = [0, 1].filter((d) => after[d]! > before[d]!);
          if (n === 1) {
            assert.equal(on.length, 1, label);
            // decode-0 takes files over (same host); decode-1 (--no-kv-same-host) gets a state streamed while it is saved
            assert.match(err.message, on[0] === 1 ? streamedMsg : announcedMsg, `${label} on decode-${on[0]}`);
            if (on[0] === 1) seen.streamed++;
            else seen.sameHost++;
          } else {
            assert.match(err.message, announcedMsg, `${label}: n = 2 is saved, then sent`);
            seen.announced++;
          }
        }
      }
    }
    assert.ok(seen.streamed >= 1 && seen.sameHost >= 1 && seen.announced >= 1, `every path was taken: ${JSON.stringify(seen)}`);
    assert.equal(await routerMetrics(), retriesBefore, 'no retry, no migration');
    for (const name of ['prefill-0', 'decode-0', 'decode-1']) assert.ok(await waitFor(async () => (await busy(proc(name).url)) === 0, 3000), `${name} idle: ${JSON.stringify(await getJson(`${proc(name).url}/health`))}`);
    assert.ok(await waitFor(async () => stateFiles().length === 0, 3000), `no state file left behind: ${stateFiles().join(', ')}`);
    const ok = await h.pd.completions.create({ model: 'pdserve', prompt: promptOf(200, 3), max_tokens: 4, temperature: 0 });
    assert.ok(ok.usage!.completion_tokens >= 1, 'the next request is served');
  });

  test('prefill killed right after handing a file over, before decode took it: the request fails, decode lives, the file is swept', async () => {
    await setHolds('decode-0', `decode.take=${HOLD_MS}`);
    try {
      const { room, done } = await heldOnDecode0('loading');
      const handed = stateFiles().filter((n) => n.startsWith('pdserve-prefill-') && n.endsWith(`-${room}.ggsq`));
      assert.equal(handed.length, 1, `the handed file is still prefill's: ${stateFiles().join(', ')}`);
      await h.c.kill(proc('prefill-0'));
      const t0 = Date.now();
      const r = (await done) as { ok: boolean; err?: { status?: number; message?: string } };
      assert.equal(r.ok, false, 'the request fails: its prefill died');
      // The router's error at its deadline (a status), not the client giving up (30 s, no status).
      assert.equal(typeof r.err?.status, 'number', `the router answered the failure: ${r.err?.message} after ${Date.now() - t0} ms`);
      assert.ok(await waitFor(async () => stateFiles().length === 0, 6000, 100), `the dead prefill's file was removed: ${stateFiles().join(', ')}`);
      assert.equal((await getJson(`${proc('decode-0').url}/health`)).role, 'decode', 'decode lives');
    } finally {
      await setHolds('decode-0', '');
      if (!proc('prefill-0').child || proc('prefill-0').child!.exitCode !== null) await h.c.spawn(proc('prefill-0'));
    }
  });

  test('prefill killed after decode took the file over: decode fails the room cleanly, deletes its file; the next request works', async () => {
    await setHolds('decode-0', `decode.load=${HOLD_MS}`);
    try {
      // the restarted prefill must be back in the router's pool
      assert.ok(await waitFor(async () => (await h.pd.completions.create({ model: 'pdserve', prompt: 'warm', max_tokens: 1, temperature: 0 }).then(() => true, () => false)), 15_000, 300), 'service back after the restart');
      const { room, done } = await heldOnDecode0('loading');
      const files = stateFiles();
      assert.deepEqual(files.filter((n) => n.endsWith(`-${room}.ggsq`)).map((n) => n.split('-')[1]), ['decode'], `ownership moved to decode (renamed): ${files.join(', ')}`);
      await h.c.kill(proc('prefill-0'));
      const r = (await done) as { ok: boolean; err?: { status?: number; message?: string } };
      if (!r.ok) assert.equal(typeof r.err?.status, 'number', `the router answered the failure: ${r.err?.message}`);
      assert.ok(await waitFor(async () => stateFiles().length === 0, 6000, 100), `decode deleted the file it owned: ${stateFiles().join(', ')}`);
    } finally {
      await setHolds('decode-0', '');
      if (!proc('prefill-0').child || proc('prefill-0').child!.exitCode !== null) await h.c.spawn(proc('prefill-0'));
    }
    const ok = await waitFor(async () => (await h.pd.completions.create({ model: 'pdserve', prompt: promptOf(80, 9), max_tokens: 4, temperature: 0 }).then(() => true, () => false)), 15_000, 300);
    assert.ok(ok, 'a request succeeds after the prefill restart');
  });
  test('a client that stops reading a long stream is cut within the write deadline, counted, its rooms aborted and the slots freed (router and colocated; n = 1, n = 3, Responses)', async () => {
    const servers = [
      { name: 'colocated', url: h.c.colocated!.url, slowed: ['colocated'], live: async () => (await getJson<{ live: unknown[] }>(`${h.c.colocated!.url}/debug/rooms`)).live.length },
      { name: 'router', url: h.c.router.url, slowed: ['decode-0', 'decode-1'], live: async () => (await Promise.all(['decode-0', 'decode-1'].map(async (n) => (await getJson<{ live: unknown[] }>(`${proc(n).url}/debug/rooms`)).live.length))).reduce((a, b) => a + b, 0) },
    ];
    for (const srv of servers) {
      // generation slowed to 3 ms a token: STALL_TOKENS take 12 s or more. The router runs with a
      // deadline past that for this case, so a cut that comes late on a loaded machine (the reader's
      // window fills more slowly as tokens come more slowly) is still a cut, never the deadline.
      if (srv.name === 'router') await restartRouter(STALL_REQUEST_DEADLINE_MS);
      for (const d of srv.slowed) await setHolds(d, 'decode.step=3');
      try {
        const cases: [string, string, Record<string, unknown>][] = [
          ['n = 1', '/v1/completions', { model: 'pdserve', prompt: 'Once upon a time', max_tokens: STALL_TOKENS, ignore_eos: true, temperature: 0, logprobs: 5, stream: true }],
          ['n = 3', '/v1/completions', { model: 'pdserve', prompt: 'Once upon a time', max_tokens: STALL_TOKENS, ignore_eos: true, temperature: 0, n: 3, logprobs: 5, stream: true }],
          ['Responses', '/v1/responses', { model: 'pdserve', input: 'Once upon a time', max_output_tokens: STALL_TOKENS, temperature: 0, stream: true }],
        ];
        for (const [label, path, body] of cases) {
          const before = await cuts(srv.url);
          const sock = stalledReader(srv.url, path, body);
          const t0 = Date.now();
          assert.ok(await waitFor(async () => (await cuts(srv.url)) === before + 1, STALL_CUT_WITHIN_MS, 50), `${srv.name} ${label}: the stalled reader was cut while its stream was generating (${await cuts(srv.url)} cuts)`);
          const ms = Date.now() - t0;
          assert.ok(await waitFor(async () => (await srv.live()) === 0, 1500, 50), `${srv.name} ${label}: its rooms were aborted, the slots are free`);
          sock.resume(); // read what was queued: the server's end of the connection is closed behind it
          assert.ok(await waitFor(async () => sock.closedAt > 0, 3000, 20), `${srv.name} ${label}: the server closed the connection`);
          assert.ok(ms >= CLIENT_DEADLINE_MS, `${srv.name} ${label}: not before the deadline (${ms} ms)`);
          console.log(`# ${srv.name} ${label}: cut after ${ms} ms`);
          sock.destroy();
        }
      } finally {
        for (const d of srv.slowed) await setHolds(d, '');
        if (srv.name === 'router') await restartRouter(REQUEST_DEADLINE_MS);
      }
      // a reader that reads is not cut: the next stream ends with [DONE]
      const s = await (srv.name === 'router' ? h.pd : h.ref).completions.create({ model: 'pdserve', prompt: 'Once upon a time', max_tokens: 200, ignore_eos: true, temperature: 0, logprobs: 5, stream: true } as never);
      let n = 0;
      for await (const _ of s as unknown as AsyncIterable<unknown>) n++;
      assert.ok(n >= 200, `${srv.name}: a reading client gets its whole stream (${n} chunks)`);
    }
  });

  test('a client that stops reading a large non-streamed response is cut within the write deadline and counted (router and colocated); a reading client gets the whole body', async () => {
    // chat with top-20 logprobs: ~1.2 KB a token, a body far over what a reader's kernel takes while it does not read (its receive buffer)
    const body = { model: 'pdserve', messages: [{ role: 'user', content: 'Once upon a time' }], max_tokens: 900, ignore_eos: true, temperature: 0, logprobs: true, top_logprobs: 20 };
    for (const srv of [{ name: 'colocated', url: h.c.colocated!.url }, { name: 'router', url: h.c.router.url }]) {
      const whole = await fetch(`${srv.url}/v1/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body), signal: AbortSignal.timeout(30_000) });
      assert.equal(whole.status, 200, `${srv.name}: ${whole.status}`);
      const text = await whole.text();
      const size = Buffer.byteLength(text);
      assert.equal(Number(whole.headers.get('content-length')), size, `${srv.name}: the content-length is the body's length`);
      assert.equal((JSON.parse(text) as { choices: { logprobs: { content: unknown[] } }[] }).choices[0]!.logprobs.content.length, 900, `${srv.name}: a reading client gets the whole body`);
      assert.ok(size > 768 << 10, `${srv.name}: the body (${size} bytes) is large enough to park in the queues`);
      const before = await cuts(srv.url);
      const sock = stalledReader(srv.url, '/v1/chat/completions', body);
      const t0 = Date.now();
      assert.ok(await waitFor(async () => (await cuts(srv.url)) === before + 1, 20_000, 50), `${srv.name}: the stalled reader of a ${size}-byte body was cut (${await cuts(srv.url)} cuts)`);
      const ms = Date.now() - t0;
      // what the server's kernel had queued still arrives (a close does not discard it), then the end
      sock.resume();
      assert.ok(await waitFor(async () => sock.closedAt > 0, 3000, 20), `${srv.name}: the server closed the connection`);
      assert.ok(ms >= CLIENT_DEADLINE_MS, `${srv.name}: not before the deadline (${ms} ms)`);
      console.log(`# ${srv.name} non-streamed ${size} bytes: cut after ${ms} ms, ${sock.received} bytes read`);
      sock.destroy();
    }
  });

  test('a full state directory: 507 state_dir_full at once, not retried on the host; /health degraded, /workers, doctor and metrics say so; served again once space frees up', async (t) => {
    if (!ownTmpfs) {
      const why = 'the full state directory case needs root to mount a small tmpfs';
      if (process.env.CI === 'true') assert.fail(why);
      console.warn(`SKIPPED: ${why}`);
      return t.skip(why);
    }
    const filler = join(dir, 'filler.bin');
    const metric = async (name: string, m: string) => Number(new RegExp(`^${m} (\\d+)`, 'm').exec(await (await fetch(`${proc(name).url}/metrics`)).text())?.[1] ?? NaN);
    // the restarted prefill must be back in the router's pool
    assert.ok(await waitFor(async () => (await h.pd.completions.create({ model: 'pdserve', prompt: 'warm', max_tokens: 1, temperature: 0 }).then(() => true, () => false)), 15_000, 300), 'service before the case');
    const pids = h.c.procs.map((p) => p.child?.pid);
    const s = statfsSync(dir);
    writeFileSync(filler, Buffer.alloc(Math.max(0, s.bavail * s.bsize - 32 * 1024)));
    try {
      const prompt = promptOf(300, 77); // a ~160 KB state: over the 32 KiB left
      const t0 = Date.now();
      const err: any = await h.pd.completions.create({ model: 'pdserve', prompt, max_tokens: 4, temperature: 0 }).then(() => null, (e: unknown) => e);
      const ms = Date.now() - t0;
      assert.ok(err, 'the request failed');
      assert.equal(err.status, 507, `${err.status} ${err.code}: ${err.message}`);
      assert.equal(err.code, 'state_dir_full');
      assert.match(err.message, /state directory .* is full/);
      assert.ok(ms < 3000, `answered at once, not retried until the deadline: ${ms} ms`);
      assert.equal(await metric('prefill-0', 'pdserve_state_dir_full_total'), 1, 'one save refused: the request was not sent to this prefill again');
      assert.equal(await metric('prefill-0', 'pdserve_state_dir_full'), 1);
      const health = await getJson(`${proc('prefill-0').url}/health`);
      assert.equal(health.status, 'degraded');
      assert.match(health.degraded[0], /^state_dir_full: state directory .* is full/);
      const row = (await getJson<{ workers: any[] }>(`${h.c.router.url}/workers`)).workers.find((w) => w.role === 'prefill');
      assert.match(String(row.degraded), /^state_dir_full/, `/workers: ${JSON.stringify(row)}`);
      // a second request does not reach the full prefill at all
      const again: any = await h.pd.completions.create({ model: 'pdserve', prompt, max_tokens: 4, temperature: 0 }).then(() => null, (e: unknown) => e);
      assert.equal(again?.code, 'state_dir_full', String(again?.message));
      assert.equal(await metric('prefill-0', 'pdserve_state_dir_full_total'), 1, 'the degraded prefill got no request');
      const doc = await cli(['doctor', '--url', h.c.router.url, '--json'], 20_000, { PDSERVE_CLUSTER_SECRET: h.c.secret });
      const kinds = (JSON.parse(doc.out) as { findings: { kind: string; title: string }[] }).findings;
      const f = kinds.find((x) => x.kind === 'state_dir_full');
      assert.ok(f, `doctor names the full state directory: ${doc.out.slice(0, 2000)}`);
      assert.match(f.title, /prefill .* state directory is full/);
    } finally {
      rmSync(filler, { force: true });
    }
    assert.ok(await waitFor(async () => !(await getJson<{ workers: any[] }>(`${h.c.router.url}/workers`)).workers.some((w) => w.degraded), 10_000, 100), 'the router takes the worker back once space frees up');
    const r = await h.pd.completions.create({ model: 'pdserve', prompt: promptOf(300, 78), max_tokens: 4, temperature: 0 });
    assert.equal(r.choices.length, 1, 'served again');
    assert.equal((await getJson(`${proc('prefill-0').url}/health`)).status, 'ok');
    assert.deepEqual(h.c.procs.map((p) => p.child?.pid), pids, 'no process died or restarted');
    assert.ok(await waitFor(async () => stateFiles().length === 0, 3000), `no state file left behind: ${stateFiles().join(', ')}`);
  });
});
