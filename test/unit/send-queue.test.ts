/**
 * Stalled and too-slow readers (src/runtime/send-queue.ts): the /proc/net/tcp parser, the rule
 * (drain within the deadline, at most the byte bound queued), the watch's sampling with a fake
 * kernel queue, and the size flag's parser.
 */
import assert from 'node:assert/strict';
import { EventEmitter } from 'node:events';
import type { Socket } from 'node:net';
import { test } from 'node:test';
import client from 'prom-client';
import { judgeQueue, parseBufferedBytes, parseTxQueues, SendQueueWatch } from '../../src/runtime/send-queue.js';

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

test('the rule: a queue that does not reach 0 within the deadline is stalled; over the bound at once; an emptied queue restarts the clock', () => {
  const limits = { deadlineMs: 1000, maxBufferedBytes: 1 << 20 };
  const st = { emptyAt: 0 };
  assert.equal(judgeQueue(st, 500, 900, limits), undefined);
  assert.equal(judgeQueue(st, 0, 950, limits), undefined, 'drained');
  assert.equal(judgeQueue(st, 10, 1900, limits), undefined, 'the deadline counts from the last empty queue');
  assert.equal(judgeQueue(st, 10, 1950, limits), 'stalled', 'a 1 byte/s reader never empties it');
  assert.equal(judgeQueue({ emptyAt: 0 }, (1 << 20) + 1, 10, limits), 'over_buffer');
});

test('the watch samples every watched socket (kernel + Node queue), cuts once, counts, and stops sampling when none is left', async () => {
  let now = 0;
  const kernel = new Map<string, number>();
  const registry = new client.Registry();
  const w = new SendQueueWatch({ deadlineMs: 1000, maxBufferedBytes: 1 << 20 }, { registry, now: () => now, readQueues: async () => kernel });
  const sock = (local: number, remote: number) => Object.assign(new EventEmitter(), { localPort: local, remotePort: remote, writableLength: 0, destroyed: false }) as unknown as Socket & { writableLength: number };
  const a = sock(8000, 1);
  const b = sock(8000, 2);
  const cut: string[] = [];
  w.watch(a, (r) => cut.push(`a:${r}`));
  const stopB = w.watch(b, (r) => cut.push(`b:${r}`));
  kernel.set('8000:1', 100);
  now = 500;
  await w.sample();
  assert.deepEqual(cut, []);
  now = 1000;
  await w.sample();
  assert.deepEqual(cut, ['a:stalled'], 'a never drained; b had nothing queued');
  now = 1100;
  b.writableLength = 2 << 20;
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
