/**
 * Stalled and too-slow readers (src/runtime/send-queue.ts): the /proc/net/tcp parser, the rule
 * (every byte delivered within the deadline of its write, at most the byte bound queued), the watch's sampling with a fake
 * kernel queue, the size flag's parser, and the slicing of a large non-streamed body (src/api/body-watch.ts).
 */
import assert from 'node:assert/strict';
import { EventEmitter } from 'node:events';
import type { Socket } from 'node:net';
import { test } from 'node:test';
import client from 'prom-client';
import { judgeQueue, newQueueState, parseBufferedBytes, parseTxQueues, SendQueueWatch } from '../../src/runtime/send-queue.js';

test('tx_queue by port pair from /proc/net/tcp and tcp6 text', () => {
  const tcp = `  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0
   1: 0100007F:1F40 0100007F:C350 01 0013A000:00000000 01:00000014 00000000     0        0 2 1 0 20 4 30 10 -1
`;
  const tcp6 = `  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0000000000000000FFFF00000100007F:1F40 0000000000000000FFFF00000100007F:C351 01 00000010:00000000 00:00000000 00000000     0        0 3 1 0 20 4 30 10 -1
`;
  const m = parseTxQueues(tcp6, parseTxQueues(tcp));
  assert.equal(m.get('8000:50000'), 0x13a000);
  assert.equal(m.get('8000:50001'), 16);
  assert.equal(m.get('8000:0'), 0);
});

test('the rule: bytes still undelivered a deadline after their write are stalled; over the bound at once', () => {
  const limits = { deadlineMs: 1000, maxBufferedBytes: 1 << 20 };
  const st = newQueueState();
  assert.equal(judgeQueue(st, 500, 500, 0, limits), undefined, 'written at 0, not yet delivered');
  assert.equal(judgeQueue(st, 900, 500, 900, limits), undefined, '400 delivered, the first 500 not yet');
  assert.equal(judgeQueue(st, 900, 400, 950, limits), undefined, "the bytes written at 0 are delivered: that mark goes, 900's is 50 ms old");
  assert.equal(judgeQueue(st, 1000, 200, 1850, limits), undefined, '800 delivered');
  assert.equal(judgeQueue(st, 1000, 190, 1900, limits), 'stalled', 'bytes written at 900 still undelivered at 1900: a 1 byte/s reader');
  assert.equal(judgeQueue(newQueueState(), (1 << 20) + 1, (1 << 20) + 1, 10, limits), 'over_buffer');
});

test('the rule: a healthy reader across a WAN, whose queue never empties while the stream runs, is not cut', () => {
  const limits = { deadlineMs: 1000, maxBufferedBytes: 1 << 20 };
  const st = newQueueState();
  // 10 KB/s written, a round trip (100 ms = 1 KB) always in flight, for 10 deadlines.
  for (let t = 0; t <= 10_000; t += 250) {
    const written = t * 10 + 1000;
    assert.equal(judgeQueue(st, written, 1000, t, limits), undefined, `at ${t} ms`);
  }
  assert.ok(st.marks.length <= 2, `marks are bounded: ${st.marks.length}`);
  // The same stream's reader stops: what it had been sent is undelivered a deadline later.
  assert.equal(judgeQueue(st, 101_000, 1000 + 5000, 10_500, limits), undefined);
  assert.equal(judgeQueue(st, 101_000, 6000, 10_900, limits), undefined);
  assert.equal(judgeQueue(st, 101_000, 6000, 11_000, limits), 'stalled', 'what was written at 10 000 ms is undelivered at 11 000');
});

test('the watch samples every watched socket (kernel + Node queue), cuts once, counts, and stops sampling when none is left', async () => {
  let now = 0;
  const kernel = new Map<string, number>();
  const registry = new client.Registry();
  const w = new SendQueueWatch({ deadlineMs: 1000, maxBufferedBytes: 1 << 20 }, { registry, now: () => now, readQueues: async () => kernel });
  const sock = (local: number, remote: number) => Object.assign(new EventEmitter(), { localPort: local, remotePort: remote, writableLength: 0, bytesWritten: 0, destroyed: false }) as unknown as Socket & { writableLength: number; bytesWritten: number };
  const a = sock(8000, 1);
  const b = sock(8000, 2);
  const cut: string[] = [];
  w.watch(a, (r) => cut.push(`a:${r}`));
  const stopB = w.watch(b, (r) => cut.push(`b:${r}`));
  kernel.set('8000:1', 100);
  a.bytesWritten = 100;
  now = 0;
  await w.sample();
  now = 500;
  await w.sample();
  assert.deepEqual(cut, []);
  now = 1000;
  await w.sample();
  assert.deepEqual(cut, ['a:stalled'], 'a never drained; b had nothing queued');
  now = 1100;
  b.writableLength = 2 << 20;
  b.bytesWritten = 2 << 20;
  await w.sample();
  assert.deepEqual(cut, ['a:stalled', 'b:over_buffer'], "Node's own buffer counts");
  await w.sample();
  assert.equal(cut.length, 2, 'cut once');
  assert.match(await registry.metrics(), /pdserve_client_cut_total\{reason="stalled"\} 1\n.*\{reason="over_buffer"\} 1/s);
  stopB();
  assert.equal(w.size, 0);
  assert.equal(await w.queued(a), 100);
});

test('--client-max-buffered-bytes: sizes with K/M/G, 64K to 1G', () => {
  assert.equal(parseBufferedBytes('4M'), 4 << 20);
  assert.equal(parseBufferedBytes('65536'), 65536);
  assert.throws(() => parseBufferedBytes('1K'), RangeError);
  assert.throws(() => parseBufferedBytes('2G'), RangeError);
  assert.throws(() => parseBufferedBytes('lots'), RangeError);
});

test('a large non-streamed body (api/body-watch.ts): same bytes and content-length, sent in slices while watched, unwatched once delivered; a small one is left alone', async () => {
  const Fastify = (await import('fastify')).default;
  const pino = (await import('pino')).default;
  const { bodyPending, registerBodyWatch, WATCHED_BODY_BYTES } = await import('../../src/api/body-watch.js');
  const watch = new SendQueueWatch({ deadlineMs: 400, maxBufferedBytes: 1 << 20 });
  const app = Fastify();
  registerBodyWatch(app, watch, pino({ level: 'silent' }));
  const big = JSON.stringify({ text: 'x'.repeat(3 * WATCHED_BODY_BYTES + 123) });
  const pending: boolean[] = [];
  app.get('/big', async (_req, reply) => {
    void reply.send(big);
    pending.push(bodyPending(reply));
    return reply;
  });
  app.get('/small', async () => ({ ok: true }));
  await app.listen({ host: '127.0.0.1', port: 0 });
  try {
    const base = `http://127.0.0.1:${(app.server.address() as { port: number }).port}`;
    const r = await fetch(`${base}/big`);
    const text = await r.text();
    assert.equal(text, big, 'the same bytes');
    assert.equal(r.headers.get('content-length'), String(Buffer.byteLength(big)));
    assert.equal(r.headers.get('content-type'), 'text/plain; charset=utf-8', 'the headers fastify gave it');
    assert.deepEqual(pending, [true], 'the reply counts as sent while its slices go out');
    const t0 = Date.now();
    while (watch.size > 0 && Date.now() - t0 < 3000) await new Promise((res) => setTimeout(res, 20));
    assert.equal(watch.size, 0, 'unwatched once the client had it all');
    const small = await fetch(`${base}/small`);
    assert.deepEqual(await small.json(), { ok: true });
    assert.equal(watch.size, 0, 'a small body is not watched');
  } finally {
    await app.close();
  }
});
