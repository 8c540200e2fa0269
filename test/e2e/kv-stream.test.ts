/**
 * The streamed TCP handoff (prefill's default, `--no-kv-stream` turns it off: prefill sends the
 * state while llama.cpp saves it) on real processes, with prefill's default flags: a real prefill worker, a real decode worker and router, and a test decode made
 * of the real KV channel client (KvPeerPool) to see the wire itself.
 * - A decode whose `register` says `kvStream` gets the streamed sequence: kv_begin{streamed}, an
 *   envelope head with payloadBytes 0, the payload, kv_end{totalBytes, crc} — the bytes and the
 *   CRC-32 match, and the payload is the ggsq state of the prompt.
 * - A decode that does not say it (an older version) gets the old sequence: kv_begin with the
 *   exact size, head + payload + CRC trailer, a bare kv_end — although prefill streams by default.
 * - Through the router (the real decode says kvStream), greedy PD output equals colocated, and
 *   prefill's counters show each of those handoffs went over TCP, streamed.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { describe, test } from 'node:test';
import { newEpoch } from '../../src/kv/auth.js';
import { KvPeerPool } from '../../src/kv/channel.js';
import { kvTransportOf } from '../../src/kv/transport.js';
import { loadInternalTls } from '../../src/security/tls.js';
import { parseEnvelopeHead, ENVELOPE_TRAILER_BYTES } from '../../src/kv/envelope.js';
import type { ControlMsg } from '../../src/kv/messages.js';
import { crc32 } from '../../src/kv/transfer/checksum.js';
import { parseStateFile } from '../../src/engine/ggsq.js';
import { settingsFromHealth } from '../../src/router/pair-settings.js';
import { getJson, promptOf, useStack, waitFor } from '../helpers/stack.js';

// TCP only (same-host would hand the file over instead); prefill streams where it may by default.
const h = useStack({ extraArgs: { prefill: ['--no-kv-same-host'] } });

/** Act as a decode worker for one room on prefill's KV port: register (with or without kvStream), record the wire, ack. */
async function handoff(kvStream: boolean, prompt: string) {
  const p = h.c.byRole('prefill')[0]!;
  const health = await getJson<any>(`${p.url}/health`);
  const epoch = newEpoch();
  const msgs: ControlMsg[] = [];
  const chunks: Buffer[] = [];
  let next = 0;
  const pool = new KvPeerPool({
    // The cluster's KV transport (TLS in secure test mode, docs/TESTING.md).
    transport: kvTransportOf(loadInternalTls(h.c.opts.internalTls)),
    secret: h.c.secret,
    epoch,
    settings: settingsFromHealth(health.settings)!,
    onMessage: (_c, m) => void msgs.push(m),
    onChunk: (_c, _room, offset, data) => {
      assert.equal(offset, next, 'chunks in order');
      next += data.length;
      chunks.push(Buffer.from(data));
    },
  });
  const room = BigInt.asUintN(63, randomBytes(8).readBigUInt64BE()).toString();
  try {
    const conn = await pool.get('127.0.0.1', p.bootstrapPort!);
    const body = JSON.stringify({ rid: `kvs-${room}`, text: prompt, sampling_params: { temperature: 0, top_p: 1, top_k: 0, max_new_tokens: 4, stop: [], ignore_eos: true }, bootstrap_host: '127.0.0.1', bootstrap_port: p.bootstrapPort, bootstrap_room: room });
    const gen = fetch(`${p.url}/generate`, { method: 'POST', headers: { 'content-type': 'application/json' }, body, signal: AbortSignal.timeout(20_000) });
    conn.sendControl({ type: 'register', room, rid: `kvs-${room}`, epoch, ...(kvStream ? { kvStream: true } : {}) });
    assert.ok(await waitFor(async () => msgs.some((m) => m.type === 'kv_end'), 15_000, 5), 'kv_end within 15 s');
    conn.sendControl({ type: 'kv_ack', room, epoch });
    const res = await gen;
    assert.equal(res.status, 200, 'prefill answers once decode acked');
    await res.text();
    const begin = msgs.find((m) => m.type === 'kv_begin') as Extract<ControlMsg, { type: 'kv_begin' }>;
    const end = msgs.find((m) => m.type === 'kv_end') as Extract<ControlMsg, { type: 'kv_end' }>;
    assert.ok(begin, 'kv_begin came');
    return { begin, end, bytes: Buffer.concat(chunks), fingerprint: health.fingerprint as string, settings: health.settings };
  } finally {
    await pool.close();
  }
}

const expectOf = (w: { fingerprint: string; settings: any }) => ({ fingerprint: w.fingerprint, contextSize: w.settings.contextSize ?? w.settings.context_size, batchSize: w.settings.batchSize ?? w.settings.batch_size, maxPayloadBytes: 1 << 30 });

describe('streamed KV handoff over TCP (the default), real processes', () => {
  test('a decode that says kvStream gets the streamed sequence; one that does not gets the old one; both carry the same state', async () => {
    const prompt = promptOf(90, 3);
    const old = await handoff(false, prompt);
    assert.equal(old.begin.streamed, undefined, 'old decode: no streamed kv_begin');
    assert.equal(old.bytes.length, old.begin.totalBytes, 'old decode: kv_begin announced the exact size');
    assert.equal(old.end.totalBytes, undefined);
    assert.equal(old.end.crc, undefined);
    const oh = parseEnvelopeHead(old.bytes, expectOf(old))!;
    assert.equal(oh.header.payloadBytes, old.bytes.length - oh.headBytes - ENVELOPE_TRAILER_BYTES);
    const oldPayload = old.bytes.subarray(oh.headBytes, old.bytes.length - ENVELOPE_TRAILER_BYTES);
    assert.equal(crc32(oldPayload), old.bytes.readUInt32BE(old.bytes.length - ENVELOPE_TRAILER_BYTES), 'old decode: CRC trailer');

    const neu = await handoff(true, prompt + ' and more');
    assert.equal(neu.begin.streamed, true, 'kvStream decode: streamed kv_begin');
    const nh = parseEnvelopeHead(neu.bytes, expectOf(neu))!;
    assert.equal(nh.header.payloadBytes, 0, 'streamed head leaves the size to kv_end');
    assert.equal(neu.end.totalBytes, neu.bytes.length, 'kv_end carries the byte count');
    const payload = neu.bytes.subarray(nh.headBytes);
    assert.equal(neu.end.crc, crc32(payload), 'kv_end carries the CRC-32');
    const st = parseStateFile(payload, { contextSize: expectOf(neu).contextSize, nLayer: 2, maxBytes: payload.length });
    assert.equal(st.nTokens, nh.header.nTokens, 'the payload is the prompt\'s ggsq state');
    assert.ok(Math.abs(neu.begin.totalBytes - neu.bytes.length) < 4096 + neu.bytes.length / 10, `the size estimate (${neu.begin.totalBytes}) is near the real size (${neu.bytes.length})`);
  });

  test('through the router (its decode takes streamed states), greedy PD output equals colocated', async () => {
    const p = h.c.byRole('prefill')[0]!;
    const counters = async () => {
      const m = await (await fetch(`${p.url}/metrics`)).text();
      const num = (re: RegExp) => Number(re.exec(m)?.[1] ?? 0);
      return { tcp: num(/^pdserve_kv_handoffs_total\{path="tcp"\} (\d+)/m), streamed: num(/^pdserve_kv_streamed_handoffs_total (\d+)/m) };
    };
    const before = await counters();
    for (const [i, n] of [40, 200, 700].entries()) {
      const prompt = promptOf(n, 10 + i);
      const a = await h.pd.completions.create({ model: 'pdserve', prompt, max_tokens: 12, temperature: 0 });
      const b = await h.ref.completions.create({ model: 'pdserve', prompt, max_tokens: 12, temperature: 0 });
      assert.equal(a.choices[0]!.text, b.choices[0]!.text, `${n} tokens: PD == colocated`);
    }
    // prefill counts a handoff at decode's kv_ack, which may trail the response: wait (5 s) for the third
    let after = before;
    await waitFor(async () => { after = await counters(); return after.tcp - before.tcp >= 3 && after.streamed - before.streamed >= 3; }, 5000);
    assert.equal(after.tcp - before.tcp, 3, 'the three handoffs went over TCP');
    assert.equal(after.streamed - before.streamed, 3, 'and each was streamed while llama.cpp saved the state');
  });
});
