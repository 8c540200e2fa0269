/**
 * A decode worker must never hand a bad state to llama.cpp, and a bad state fails one request,
 * never the process. The test plays the prefill side itself with the real parts — the real KV
 * channel (KvServer), the real envelope, and a real state saved by the real engine — and then
 * damages what it sends: a truncated payload, a flipped byte, a state from another model — over TCP
 * and, on the same-host path, as a handed state file (kv_file) it damaged in the state directory:
 * cut, a damaged envelope head, a damaged ggsq structure header (caught by the header walk on
 * every decode), and a damaged data byte (caught only by decode-1, which runs
 * --kv-same-host-verify; decode-0 loads it: the documented trade of the default path).
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { readFile, rm, writeFile } from 'node:fs/promises';
import { BufferPool } from '../../src/kv/transfer/pool.js';
import { after, before, describe, test } from 'node:test';
import { ensureModel, loadEngine, parseStateFile, sha256File } from '../../src/engine/index.js';
import type { Engine } from '../../src/engine/types.js';
import { newEpoch } from '../../src/kv/auth.js';
import { KvServer, type PeerConn } from '../../src/kv/channel.js';
import { kvTransportOf } from '../../src/kv/transport.js';
import { loadInternalTls } from '../../src/security/tls.js';
import { encodeEnvelope, encodeEnvelopeHead } from '../../src/kv/envelope.js';
import { decodeStateName, prefillStateName, SameHostPrefill } from '../../src/kv/transfer/same-host.js';
import { settingsFromHealth } from '../../src/router/pair-settings.js';
import { freePort, type Cluster } from '../../src/up/cluster.js';
import { busy, client, CTX, getJson, startStack, waitFor } from '../helpers/stack.js';

const BATCH = 128;
let c: Cluster;
let kv: KvServer;
let kvPort: number;
/** What the fake prefill sends for the next registered room, and what it heard back. */
let nextBlob: Buffer | undefined;
/**
 * How the fake prefill sends it: kv_begin announces `announce` bytes (default the blob's), kv_end
 * follows unless `noEnd`; with `file`, the same-host path instead, as the real prefill does it:
 * `file.crcOf` (default the payload) is written to the shared state directory under prefill's
 * name and offered (`SameHostPrefill.offer`: a CRC-32 only when that decode asked for verify),
 * then overwritten with `file.payload` (the damage) and handed over (kv_file) with `file.head`.
 */
let nextSend: { announce?: number; noEnd?: boolean; file?: { payload: Buffer; head: Buffer; crcOf?: Buffer } } = {};
/** The fake prefill answers decode's same-host probe as a real one (the stack's state dir is /dev/shm). */
const sameHost = new SameHostPrefill({ enabled: true, stateDir: '/dev/shm' });
const pool = new BufferPool(1 << 16, 2);
const fails = new Map<string, string>();

async function stateOf(modelPath: string, prompt: string): Promise<{ payload: Buffer; fingerprint: string; nTokens: number; firstToken: number; firstIsEog: boolean }> {
  const engine: Engine = await loadEngine({ modelPath, sequences: 1, contextSize: CTX, batchSize: BATCH, threads: 1 });
  const path = `/dev/shm/pdserve-test-${process.pid}-${randomBytes(4).toString('hex')}.ggsq`;
  try {
    const slot = engine.tryAcquireSlot()!;
    const tokens = engine.tokenize(prompt);
    const r = await slot.prefill(tokens, { temperature: 0, topP: 1, topK: 0, maxTokens: 8, stop: [], ignoreEos: false }, new AbortController().signal);
    await slot.saveState(path);
    slot.release();
    return { payload: await readFile(path), fingerprint: await sha256File(modelPath), nTokens: r.promptTokens, firstToken: r.firstToken, firstIsEog: r.firstIsEog };
  } finally {
    await rm(path, { force: true });
    await engine.dispose();
  }
}

before(async () => {
  // decode-1 runs --kv-same-host-verify: it asks for (and checks) the handed file's CRC-32
  // The fake prefill's port is fixed up front: decode dials only bootstrap addresses it knows.
  const fakePort = await freePort();
  const allow = ['--allow-prefill', `127.0.0.1:${fakePort}`];
  c = await startStack({ colocated: false, decode: 2, extraArgs: { decode: allow }, extraArgsOf: { 'decode-1': ['--kv-same-host-verify'] } });
  kv = new KvServer({
    // The cluster's KV transport (TLS in secure test mode, docs/TESTING.md).
    transport: kvTransportOf(loadInternalTls(c.opts.internalTls)),
    host: '127.0.0.1',
    port: fakePort,
    secret: c.secret,
    epoch: newEpoch(),
    // The fake prefill claims the decode's own pair settings, so the handshake pairs them.
    settings: settingsFromHealth((await getJson<any>(`${c.byRole('decode')[0]!.url}/health`)).settings)!,
    onMessage: (conn: PeerConn, msg) => {
      if (msg.type === 'same_host_probe' || msg.type === 'same_host_ok') {
        const reply = sameHost.onMessage(conn.id, msg);
        if (reply) conn.sendControl(reply);
      } else if (msg.type === 'register') {
        const blob = nextBlob!;
        const how = nextSend;
        conn.sendControl({ type: 'registered', room: msg.room });
        if (how.file) {
          const f = how.file;
          assert.ok(sameHost.usable(conn.id), 'decode confirmed the same-host probe before registering');
          const name = prefillStateName(process.pid, msg.room);
          const seen = f.crcOf ?? f.payload;
          void (async () => {
            await writeFile(`/dev/shm/${name}`, seen);
            const offer = sameHost.offer(conn.id, msg.room, `/dev/shm/${name}`, f.head, seen.length, pool);
            if (f.crcOf) await writeFile(`/dev/shm/${name}`, f.payload);
            conn.sendControl({ ...offer, payloadBytes: f.payload.length });
          })();
          return;
        }
        conn.sendControl({ type: 'kv_begin', room: msg.room, totalBytes: how.announce ?? blob.length });
        void conn.sendChunks(msg.room, blob, { chunkBytes: 4096 }).then(() => how.noEnd || conn.sendControl({ type: 'kv_end', room: msg.room }), () => {});
      } else if (msg.type === 'fail') {
        fails.set(msg.room, `${msg.code}: ${msg.detail}`);
        // as the real prefill at the room's end: delete its name of a handed file (a no-op once taken)
        void rm(`/dev/shm/${prefillStateName(process.pid, msg.room)}`, { force: true });
      }
    },
  });
  kvPort = await kv.listen();
});

after(async () => {
  await kv?.close();
  await c?.stop();
});

/** Send one request straight to decode worker `d` (decode-1 runs --kv-same-host-verify), bootstrapping from the fake prefill. */
async function generate(d = 0): Promise<{ status: number; body: string; room: string }> {
  const room = BigInt.asUintN(63, randomBytes(8).readBigUInt64BE()).toString();
  const decode = c.byRole('decode')[d]!;
  const r = await fetch(`${decode.url}/generate`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ rid: `test-${room}`, text: 'Once upon a time', sampling_params: { temperature: 0, top_p: 1, top_k: 0, max_new_tokens: 8, stop: [], ignore_eos: false }, bootstrap_host: '127.0.0.1', bootstrap_port: kvPort, bootstrap_room: room }),
    signal: AbortSignal.timeout(10_000),
  });
  return { status: r.status, body: await r.text(), room };
}

describe('corrupt KV state reaching a real decode worker', () => {
  let good: Awaited<ReturnType<typeof stateOf>>;
  before(async () => {
    good = await stateOf(await ensureModel('tiny', 1), 'Once upon a time');
  });

  const envelope = (s: typeof good, payload = s.payload, fingerprint = s.fingerprint) =>
    encodeEnvelope({ fingerprint, contextSize: CTX, batchSize: BATCH, nTokens: s.nTokens, firstToken: s.firstToken, firstIsEog: s.firstIsEog }, payload);

  test('the untouched state is accepted (the fake prefill is faithful)', async () => {
    nextBlob = envelope(good);
    const r = await generate();
    assert.equal(r.status, 200, r.body);
    assert.match(r.body, /\[DONE\]/);
  });

  const bad: [string, () => Buffer, RegExp][] = [
    ['truncated payload inside the KV data (re-enveloped, so only the ggsq walk can catch it)', () => envelope(good, good.payload.subarray(0, good.payload.length - 100)), /bad_state/],
    ['truncated blob on the wire', () => envelope(good).subarray(0, envelope(good).length - 1000), /bad_state/],
    ['one flipped byte in the KV data', () => {
      const b = Buffer.from(envelope(good));
      b[b.length - 500] ^= 0x40;
      return b;
    }, /checksum|bad_state/],
    ['a flipped cell count in the ggsq header (re-enveloped)', () => {
      const p = Buffer.from(good.payload);
      const st = parseStateFile(p, { contextSize: CTX, maxBytes: 1 << 30 });
      p.writeUInt32LE(st.streams[0]!.cellCount + 7, st.streams[0]!.start);
      return envelope(good, p);
    }, /bad_state/],
  ];
  for (const [name, make, re] of bad) {
    test(`${name}: that request fails with a clear error, decode lives on`, async () => {
      nextSend = {};
      nextBlob = make();
      const r = await generate();
      assert.ok(r.status >= 400, `status ${r.status}`);
      const j = JSON.parse(r.body) as { error: { message: string; code: string } };
      assert.equal(j.error.code, 'bad_state', 'a stable code, not message text');
      assert.match(`${j.error.code}: ${j.error.message}`, re);
      assert.ok(await waitFor(async () => fails.has(r.room), 1000), 'prefill side told at once');
      assert.match(fails.get(r.room)!, /^bad_state: /, 'with the stable code');
    });
  }

  test('damage is detected while streaming: a bent ggsq header fails the room with no kv_end ever sent', async () => {
    const env = envelope(good);
    const st = parseStateFile(good.payload, { contextSize: CTX, maxBytes: 1 << 30 });
    const headLen = env.length - good.payload.length - 4;
    const b = Buffer.from(env);
    b.writeUInt32LE(999, headLen + st.nStreamOffset);
    nextSend = { noEnd: true };
    nextBlob = b;
    const r = await generate();
    assert.ok(r.status >= 400, `status ${r.status}`);
    const e = (JSON.parse(r.body) as { error: { message: string; code: string } }).error;
    assert.match(e.message, /n_stream 999/);
    assert.equal(e.code, 'bad_state');
    assert.ok(await waitFor(async () => fails.has(r.room), 1000), 'prefill side told at once');
  });

  test('a stream cut mid-way (kv_end after half the announced bytes) fails as truncated', async () => {
    const env = envelope(good);
    nextSend = { announce: env.length };
    nextBlob = env.subarray(0, env.length >> 1);
    const r = await generate();
    assert.ok(r.status >= 400, `status ${r.status}`);
    assert.match((JSON.parse(r.body) as { error: { message: string } }).error.message, /truncated/);
    nextSend = {};
  });

  const handed = (payload: Buffer, crcOf?: Buffer) => ({
    payload,
    crcOf,
    head: encodeEnvelopeHead({ fingerprint: good.fingerprint, contextSize: CTX, batchSize: BATCH, nTokens: good.nTokens, firstToken: good.firstToken, firstIsEog: good.firstIsEog, payloadBytes: payload.length }),
  });
  const gone = (room: string, d = 0) => !existsSync(`/dev/shm/${prefillStateName(process.pid, room as never)}`) && !existsSync(`/dev/shm/${decodeStateName(c.byRole('decode')[d]!.child!.pid!, room as never)}`);

  for (const d of [0, 1]) {
    test(`same host${d ? ' with --kv-same-host-verify' : ''}: the untouched handed file is taken over and served; no file stays behind`, async () => {
      nextSend = { file: handed(good.payload) };
      const r = await generate(d);
      assert.equal(r.status, 200, r.body);
      assert.match(r.body, /\[DONE\]/);
      assert.ok(await waitFor(async () => gone(r.room, d), 2000), 'the handed file was deleted once loaded');
    });
  }

  const structure = () => {
    const st = parseStateFile(good.payload, { contextSize: CTX, maxBytes: 1 << 30 });
    return { st, s0: st.streams.find((x) => x.cellCount > 0)! };
  };
  const badFiles: [string, () => ReturnType<typeof handed>, RegExp][] = [
    ['a handed file cut short (named at its cut size, so only the structure walk can catch it)', () => handed(good.payload.subarray(0, good.payload.length - 100)), /truncated|past the limit/],
    ['a damaged structure header: the last layer\'s V row size (reached by seeking over the data)', () => {
      const { s0 } = structure();
      const p = Buffer.from(good.payload);
      const lastV = s0.v![s0.v!.length - 1]!;
      p.writeBigUInt64LE(BigInt(lastV.bytesPerCell * 3), lastV.dataOffset - 8);
      return handed(p);
    }, /past the limit|truncated|trailing/],
    ['a damaged structure header: n_stream', () => {
      const p = Buffer.from(good.payload);
      p.writeUInt32LE(999, structure().st.nStreamOffset);
      return handed(p);
    }, /n_stream 999/],
    ['a damaged envelope head (one flipped byte)', () => {
      const h = handed(good.payload);
      h.head = Buffer.from(h.head);
      h.head[h.head.length - 5] ^= 0x08;
      return h;
    }, /digest|envelope/],
  ];
  for (const [name, make, re] of badFiles) {
    test(`same host: ${name}: that request fails with bad_state, decode lives, no file stays behind`, async () => {
      nextSend = { file: make() };
      const r = await generate();
      assert.ok(r.status >= 400, `status ${r.status}`);
      const e = (JSON.parse(r.body) as { error: { message: string; code: string } }).error;
      assert.equal(e.code, 'bad_state');
      assert.match(e.message, re);
      assert.ok(await waitFor(async () => fails.has(r.room), 1000), 'prefill side told at once');
      assert.ok(await waitFor(async () => gone(r.room), 2000), 'the handed file was deleted (by decode once taken, else by prefill at the fail)');
      nextSend = {};
    });
  }

  const flipped = () => {
    const p = Buffer.from(good.payload);
    p[p.length - 500] ^= 0x40;
    return handed(p, good.payload);
  };
  test('same host, --kv-same-host-verify (decode-1 asks for the CRC-32): one flipped data byte fails that request with bad_state', async () => {
    nextSend = { file: flipped() };
    const r = await generate(1);
    assert.ok(r.status >= 400, `status ${r.status}`);
    const e = (JSON.parse(r.body) as { error: { message: string; code: string } }).error;
    assert.equal(e.code, 'bad_state');
    assert.match(e.message, /checksum/);
    assert.ok(await waitFor(async () => gone(r.room, 1), 2000), 'the taken file was deleted by decode');
    nextSend = {};
  });

  test('same host, default: one flipped data byte is NOT read (no CRC-32 on this path): the request is served', async () => {
    nextSend = { file: flipped() };
    const r = await generate(0);
    assert.equal(r.status, 200, r.body);
    assert.ok(await waitFor(async () => gone(r.room), 2000));
    nextSend = {};
  });

  test('a state from another model (same shapes, other weights) is refused by fingerprint', async () => {
    const other = await ensureModel('tiny', 2);
    const s = await stateOf(other, 'Once upon a time');
    nextBlob = envelope(s);
    const r = await generate();
    assert.ok(r.status >= 400);
    assert.match(JSON.parse(r.body).error.message, /different model/);
  });

  test('after all that, decode is idle, alive, and serves a normal request through the router', async () => {
    for (const d of c.byRole('decode')) assert.ok(await waitFor(async () => (await busy(d.url)) === 0, 1000), JSON.stringify(await getJson(`${d.url}/health`)));
    const r = await client(c.router.url).completions.create({ model: 'pdserve', prompt: 'hello there', max_tokens: 8, temperature: 0 });
    assert.ok(r.usage!.completion_tokens >= 1);
    for (const p of c.procs) assert.equal(p.unexpectedExits.length, 0, `${p.name} did not crash`);
  });
});
