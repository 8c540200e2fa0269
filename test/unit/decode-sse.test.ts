/**
 * The decode worker's SSE writer (src/decode/sse-out.ts): frames byte-identical to
 * `data: ${JSON.stringify(event)}\n\n`; the frames of one event-loop turn in one write, in order,
 * written before the turn's setImmediate (where node-llama-cpp starts the next decode step);
 * frames of later turns not held back; backpressure (a drain that came before `writable()` was
 * asked counts) and closing.
 * Run: node --import tsx --test test/unit/decode-sse.test.ts
 */
import assert from 'node:assert/strict';
import { EventEmitter, once } from 'node:events';
import { createServer, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { describe, test } from 'node:test';
import fc from 'fast-check';
import { request } from 'undici';
import { readSse } from '../../src/api/sse.js';
import { tokenEvent, type GenerateEvent } from '../../src/protocol/worker-protocol.js';
import { DecodeSseWriter, type TokenEventMeta, type TokenOut } from '../../src/decode/sse-out.js';

/**
 * A ServerResponse stand-in that records writes; `accept` decides what write() returns. As Node's
 * http: a refused write sets `writableNeedDrain` until the socket drains (`drain()`).
 */
class FakeRes extends EventEmitter {
  writes: string[] = [];
  destroyed = false;
  writableEnded = false;
  writableNeedDrain = false;
  accept = true;
  write(data: string): boolean {
    if (this.writableEnded) throw new Error('write after end');
    this.writes.push(data);
    if (!this.accept) this.writableNeedDrain = true;
    return this.accept;
  }
  end(): void {
    this.writableEnded = true;
  }
  /** The socket drained: 'drain' is emitted once, as Node does after a refused write. */
  drain(): void {
    this.accept = true;
    if (!this.writableNeedDrain) return;
    this.writableNeedDrain = false;
    this.emit('drain');
  }
}

const meta: TokenEventMeta = { rid: 'req-1', promptTokens: 16, cachedTokens: 0 };
const writer = (res: FakeRes, drainMs = 1000) => new DecodeSseWriter(res as unknown as ServerResponse, meta, drainMs);
const reference = (out: TokenOut, m: TokenEventMeta, n: number) =>
  `data: ${JSON.stringify(tokenEvent(out, { id: m.rid, prompt_tokens: m.promptTokens, cached_tokens: m.cachedTokens, completion_tokens: n, finish_reason: null }))}\n\n`;
const turn = () => new Promise<void>((r) => setImmediate(r));

describe('DecodeSseWriter frames', () => {
  test('a token frame is byte for byte data: JSON.stringify(tokenEvent(...))', () => {
    const lp = fc.record({ token: fc.string(), logprob: fc.double({ noNaN: true, noDefaultInfinity: true }), top: fc.array(fc.record({ token: fc.string(), logprob: fc.double({ noNaN: true, noDefaultInfinity: true }) }), { maxLength: 3 }) });
    fc.assert(
      fc.property(
        fc.record({ rid: fc.string({ unit: 'binary' }), promptTokens: fc.nat(), cachedTokens: fc.nat() }),
        fc.record({ token: fc.nat(), text: fc.string({ unit: 'binary' }), logprob: fc.option(lp, { nil: undefined }) }, { requiredKeys: ['token', 'text'] }),
        fc.nat(),
        (m, out, n) => {
          const w = new DecodeSseWriter(new FakeRes() as unknown as ServerResponse, m, 1000);
          assert.equal(w.tokenFrame(out, n), reference(out, m, n));
        },
      ),
      { numRuns: 500 },
    );
  });

  test('numbers a template cannot carry fall back to JSON.stringify', () => {
    const odd: TokenEventMeta = { rid: 'x', promptTokens: 1.5, cachedTokens: NaN };
    const w = new DecodeSseWriter(new FakeRes() as unknown as ServerResponse, odd, 1000);
    assert.equal(w.tokenFrame({ token: 3, text: 'a' }, 1), reference({ token: 3, text: 'a' }, odd, 1));
    const ok = writer(new FakeRes());
    assert.equal(ok.tokenFrame({ token: -0.5, text: 'b' }, 2), reference({ token: -0.5, text: 'b' }, meta, 2));
  });
});

describe('DecodeSseWriter batching', () => {
  test('frames queued in one turn leave in one write, in order, before the turn\'s setImmediate', async () => {
    const res = new FakeRes();
    const w = writer(res);
    let writesAtImmediate = -1;
    setImmediate(() => (writesAtImmediate = res.writes.length));
    const outs: TokenOut[] = [{ token: 1, text: 'a' }, { token: 2, text: 'b"c' }, { token: 3, text: '\n' }];
    // queued from different promise continuations of the same turn, as the decode loop does
    for (let i = 0; i < outs.length; i++) {
      w.token(outs[i]!, i + 1);
      await Promise.resolve();
      await Promise.resolve();
    }
    assert.equal(res.writes.length, 0, 'nothing written while the turn is still running');
    await turn();
    assert.equal(writesAtImmediate, 1, 'flushed before the next setImmediate (the next decode step)');
    assert.deepEqual(res.writes, [outs.map((o, i) => reference(o, meta, i + 1)).join('')]);
    assert.equal(w.writes, 1);
  });

  test('a frame is not held past its turn: tokens of two turns are two writes', async () => {
    const res = new FakeRes();
    const w = writer(res);
    w.token({ token: 1, text: 'x' }, 1);
    await turn();
    assert.equal(res.writes.length, 1);
    w.token({ token: 2, text: 'y' }, 2);
    await turn();
    assert.deepEqual(res.writes, [reference({ token: 1, text: 'x' }, meta, 1), reference({ token: 2, text: 'y' }, meta, 2)]);
  });

  test('the last token, the finish event and [DONE] are one write; end() flushes first and nothing follows', async () => {
    const res = new FakeRes();
    const w = writer(res);
    w.token({ token: 7, text: 'end' }, 5);
    w.finish(5, 'length');
    w.end();
    const fin: GenerateEvent = { text: '', token_ids: [], meta_info: { id: 'req-1', prompt_tokens: 16, cached_tokens: 0, completion_tokens: 5, finish_reason: { type: 'length' } } };
    assert.deepEqual(res.writes, [reference({ token: 7, text: 'end' }, meta, 5) + `data: ${JSON.stringify(fin)}\n\ndata: [DONE]\n\n`]);
    assert.equal(res.writableEnded, true);
    w.token({ token: 8, text: 'late' }, 6);
    w.end();
    await turn();
    assert.equal(res.writes.length, 1, 'nothing after end');
  });

  test('an error event follows the tokens of its turn', async () => {
    const res = new FakeRes();
    const w = writer(res);
    w.token({ token: 1, text: 'a' }, 1);
    w.error({ message: 'boom', type: 'server_error', code: 'engine_failed' });
    await turn();
    assert.deepEqual(res.writes, [reference({ token: 1, text: 'a' }, meta, 1) + 'data: {"error":{"message":"boom","type":"server_error","code":"engine_failed"}}\n\n']);
  });
});

describe('DecodeSseWriter backpressure and closing', () => {
  test('writable() is true at once until a write is refused, then waits for drain', async () => {
    const res = new FakeRes();
    const w = writer(res);
    assert.equal(w.writable(), true);
    res.accept = false;
    w.token({ token: 1, text: 'a' }, 1);
    await turn();
    const p = w.writable();
    assert.ok(p instanceof Promise);
    let settled = false;
    void p.then(() => (settled = true));
    await turn();
    assert.equal(settled, false, 'still waiting for drain');
    res.drain();
    assert.equal(await p, true);
    assert.equal(w.writable(), true);
  });

  test('a drain between the refused write and writable() counts: true at once, no wait for another drain', async () => {
    // the worker asks writable() only after its next token, one decode step after the flush:
    // the socket may have drained (and emitted its one 'drain') in between
    const res = new FakeRes();
    const w = writer(res, 1000);
    res.accept = false;
    w.token({ token: 1, text: 'a' }, 1);
    await turn(); // the end-of-turn flush: refused
    assert.equal(res.writableNeedDrain, true);
    res.drain();
    await turn(); // the decode step
    assert.equal(w.writable(), true);
  });

  test('a stuck peer: false after the drain deadline; a closed one: false at once', async () => {
    const res = new FakeRes();
    const w = writer(res, 30);
    res.accept = false;
    w.token({ token: 1, text: 'a' }, 1);
    await turn();
    assert.equal(await w.writable(), false);
    const res2 = new FakeRes();
    const w2 = writer(res2);
    res2.accept = false;
    w2.token({ token: 1, text: 'a' }, 1);
    await turn();
    const p = w2.writable();
    res2.destroyed = true;
    res2.emit('close');
    assert.equal(await p, false);
    assert.equal(w2.writable(), false);
    w2.token({ token: 2, text: 'b' }, 2);
    await turn();
    assert.equal(res2.writes.length, 1, 'frames for a closed response are dropped');
    const res3 = new FakeRes();
    const w3 = writer(res3);
    res3.accept = false;
    w3.token({ token: 1, text: 'a' }, 1);
    await turn();
    const q = w3.writable();
    res3.emit('error', new Error('socket hang up'));
    assert.equal(await q, false, 'an error while waiting for drain: false');
    assert.equal(res3.listenerCount('drain') + res3.listenerCount('close') + res3.listenerCount('error'), 0, 'no listener left behind');
  });

  test('over a real socket: the socket drains a decode step before writable() is asked — true at once', async () => {
    // the reviewer's case (review F1): a 4 MiB token overfills the socket buffer, the client reads
    // it all, and only then (a decode step later) does the worker ask whether it may go on
    const big = 'x'.repeat(4 * 1024 * 1024);
    let refused: boolean | undefined;
    let verdict: boolean | Promise<boolean> | undefined;
    let serverError: unknown;
    const server = createServer(async (_req, res) => {
      try {
        res.writeHead(200, { 'content-type': 'text/event-stream' });
        const w = new DecodeSseWriter(res, meta, 1000);
        w.token({ token: 1, text: big }, 1);
        w.flush(); // what the end-of-turn flush does
        refused = res.writableNeedDrain;
        if (refused) await once(res, 'drain', { signal: AbortSignal.timeout(5000) });
        await turn(); // the decode step before the worker asks
        verdict = w.writable();
        w.finish(1, 'stop');
        w.end();
      } catch (e) {
        serverError = e;
        res.destroy();
      }
    });
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
    try {
      const { port } = server.address() as AddressInfo;
      const { body } = await request(`http://127.0.0.1:${port}/`);
      const text = await body.text(); // (readSse caps an event at 1 MiB; this one is 4 MiB)
      assert.equal(serverError, undefined);
      assert.equal(refused, true, 'the 4 MiB write was refused by the socket buffer (else this test shows nothing)');
      assert.equal(verdict, true, 'writable() after the drain: true at once (not a wait for a drain that already happened)');
      const events = text.split('\n\n').filter((e) => e !== '');
      assert.equal(events.length, 3);
      assert.equal((JSON.parse(events[0]!.slice('data: '.length)) as GenerateEvent).text.length, big.length);
      assert.equal(events[2], 'data: [DONE]');
    } finally {
      await new Promise<void>((r) => server.close(() => r()));
    }
  });

  test('over a real socket: the client reads every event, in order', async () => {
    const outs: TokenOut[] = Array.from({ length: 50 }, (_, i) => ({ token: i, text: `t${i} é "q"\n` }));
    const server = createServer(async (_req, res) => {
      res.writeHead(200, { 'content-type': 'text/event-stream' });
      const w = new DecodeSseWriter(res, meta, 1000);
      for (let i = 0; i < outs.length; i++) {
        w.token(outs[i]!, i + 1);
        if (i % 3 === 2) await turn(); // some turns carry several tokens, some one
        const ok = w.writable();
        if (ok !== true) await ok;
      }
      w.finish(outs.length, 'stop');
      w.end();
    });
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
    try {
      const { port } = server.address() as AddressInfo;
      const { body } = await request(`http://127.0.0.1:${port}/`);
      const got: string[] = [];
      for await (const d of readSse(body)) got.push(d);
      assert.equal(got.length, outs.length + 2);
      assert.equal(got.at(-1), '[DONE]');
      got.slice(0, outs.length).forEach((d, i) => assert.deepEqual(JSON.parse(d), tokenEvent(outs[i]!, { id: 'req-1', prompt_tokens: 16, cached_tokens: 0, completion_tokens: i + 1, finish_reason: null })));
      assert.equal((JSON.parse(got[outs.length]!) as GenerateEvent).meta_info.finish_reason?.type, 'stop');
    } finally {
      await new Promise<void>((r) => server.close(() => r()));
    }
  });
});
