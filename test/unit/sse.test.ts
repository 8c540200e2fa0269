import assert from 'node:assert/strict';
import { createServer, request as httpRequest, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { describe, test } from 'node:test';
import fc from 'fast-check';
import { formatSseEvent, readSse, SseError, SseParser, SseWriter } from '../../src/api/sse.js';

const enc = new TextEncoder();

async function* chunks(parts: (string | Uint8Array)[]): AsyncGenerator<Uint8Array> {
  for (const p of parts) yield typeof p === 'string' ? enc.encode(p) : p;
}

async function collect(parts: (string | Uint8Array)[], maxEventBytes?: number): Promise<string[]> {
  const out: string[] = [];
  for await (const d of readSse(chunks(parts), { maxEventBytes })) out.push(d);
  return out;
}

/** Split `bytes` at the given sorted cut positions. */
function splitAt(bytes: Uint8Array, cuts: number[]): Uint8Array[] {
  const out: Uint8Array[] = [];
  let prev = 0;
  for (const c of cuts) {
    out.push(bytes.slice(prev, c));
    prev = c;
  }
  out.push(bytes.slice(prev));
  return out;
}

describe('formatSseEvent', () => {
  test('single-line and multi-line data', () => {
    assert.equal(formatSseEvent('{"a":1}'), 'data: {"a":1}\n\n');
    assert.equal(formatSseEvent('a\nb\r\nc'), 'data: a\ndata: b\ndata: c\n\n');
  });
});

describe('readSse', () => {
  test('yields data payloads, ignores comments and other fields, joins multi-line data', async () => {
    const got = await collect([': keep-alive\n\nevent: x\nid: 7\ndata: {"a":1}\n\ndata: line1\ndata: line2\n\ndata:nospace\n\nretry: 5\ndata: [DONE]\n\n']);
    assert.deepEqual(got, ['{"a":1}', 'line1\nline2', 'nospace', '[DONE]']);
  });

  test('LF, CRLF and CR line endings, including CR at a chunk end and LF at the next start', async () => {
    assert.deepEqual(await collect(['data: a\r\n\r\ndata: b\r\rdata: c\n\n']), ['a', 'b', 'c']);
    assert.deepEqual(await collect(['data: a\r', '\n\r', '\ndata: b\r', '\r']), ['a', 'b']);
  });

  test('an event split at every byte position gives the same result', async () => {
    const text = 'data: {"text":"héllo ✓ 😀","n":1}\r\n\r\n: c\n\ndata: x\n\n';
    const bytes = enc.encode(text);
    const want = ['{"text":"héllo ✓ 😀","n":1}', 'x'];
    for (let i = 0; i <= bytes.length; i++) assert.deepEqual(await collect(splitAt(bytes, [i])), want, `cut at ${i}`);
    assert.deepEqual(await collect([...bytes].map((b) => new Uint8Array([b]))), want, 'one byte per chunk');
  });

  test('property: any chunking of a well-formed stream yields the same events', async () => {
    const eventArb = fc.array(fc.string({ unit: 'grapheme', maxLength: 20 }).filter((s) => !/[\r\n]/.test(s)), { minLength: 1, maxLength: 3 });
    await fc.assert(
      fc.asyncProperty(fc.array(eventArb, { minLength: 1, maxLength: 6 }), fc.constantFrom('\n', '\r\n', '\r'), fc.array(fc.nat(), { maxLength: 8 }), async (events, eol, rawCuts) => {
        const text = events.map((lines) => lines.map((l) => `data: ${l}${eol}`).join('') + eol).join('');
        const bytes = enc.encode(text);
        const cuts = [...new Set(rawCuts.map((c) => c % (bytes.length + 1)))].sort((a, b) => a - b);
        const got = await collect(splitAt(bytes, cuts));
        assert.deepEqual(got, events.map((lines) => lines.join('\n')));
      }),
      { numRuns: 300 },
    );
  });

  test('leading BOM is ignored', async () => {
    assert.deepEqual(await collect([new Uint8Array([0xef, 0xbb, 0xbf]), 'data: a\n\n']), ['a']);
  });

  test('an unterminated event at end of stream is discarded', async () => {
    assert.deepEqual(await collect(['data: a\n\ndata: b\n']), ['a']);
    assert.deepEqual(await collect(['data: a\n\ndata: b']), ['a']);
  });

  test('caps the size of one event, with or without newlines', async () => {
    await assert.rejects(collect(['data: ' + 'x'.repeat(2000) + '\n\n'], 1024), (e: unknown) => e instanceof SseError && e.code === 'SSE_EVENT_TOO_LARGE');
    await assert.rejects(collect(['data: ', 'x'.repeat(600), 'x'.repeat(600)], 1024), (e: unknown) => e instanceof SseError && e.code === 'SSE_EVENT_TOO_LARGE');
    const many = Array.from({ length: 50 }, () => 'data: ' + 'y'.repeat(30) + '\n').join('') + '\n';
    await assert.rejects(collect([many], 1024), (e: unknown) => e instanceof SseError && e.code === 'SSE_EVENT_TOO_LARGE');
    // Many small events in one chunk are fine: the cap is per event.
    const small = Array.from({ length: 200 }, (_, i) => `data: ${i}\n\n`).join('');
    assert.equal((await collect([small], 1024)).length, 200);
  });

  test('the events of a chunk before an oversized one are delivered first, then the error', async () => {
    const got: string[] = [];
    await assert.rejects(
      (async () => {
        for await (const d of readSse(chunks(['data: a\n\ndata: b\n\ndata: ' + 'x'.repeat(2000)]), { maxEventBytes: 1024 })) got.push(d);
      })(),
      (e: unknown) => e instanceof SseError && e.code === 'SSE_EVENT_TOO_LARGE',
    );
    assert.deepEqual(got, ['a', 'b']);
    const p = new SseParser({ maxEventBytes: 1024 });
    const out: string[] = [];
    assert.throws(() => p.push(enc.encode('data: c\n\ndata: ' + 'x'.repeat(2000)), out), (e: unknown) => e instanceof SseError && e.code === 'SSE_EVENT_TOO_LARGE');
    assert.deepEqual(out, ['c']);
  });

  test('property: SseParser.push over any chunking gives the events sent, each as soon as its chunk completes it', async () => {
    const eventArb = fc.array(fc.string({ unit: 'grapheme', maxLength: 20 }).filter((x) => !/[\r\n]/.test(x)), { minLength: 1, maxLength: 3 });
    await fc.assert(
      fc.asyncProperty(fc.array(eventArb, { minLength: 1, maxLength: 6 }), fc.constantFrom('\n', '\r\n', '\r'), fc.array(fc.nat(), { maxLength: 8 }), async (events, nl, rawCuts) => {
        const texts = events.map((lines) => lines.map((l) => `data: ${l}${nl}`).join('') + nl);
        const bytes = enc.encode(texts.join(''));
        // event k is complete once the first byte of its blank line's terminator has been pushed
        // (a CR dispatches at once; the LF of a CRLF only finishes the line)
        const completesAt: number[] = [];
        let end = 0;
        for (const t of texts) completesAt.push((end += enc.encode(t).length) - nl.length);
        const expected = events.map((lines) => lines.join('\n'));
        const cuts = [...new Set(rawCuts.map((c) => c % (bytes.length + 1)))].sort((a, b) => a - b);
        const parts = splitAt(bytes, cuts);
        const p = new SseParser();
        const sync: string[] = [];
        let pushed = 0;
        for (const part of parts) {
          p.push(part, sync);
          pushed += part.length;
          assert.equal(sync.length, completesAt.filter((at) => at < pushed).length, `events out after ${pushed} of ${bytes.length} bytes`);
        }
        assert.deepEqual(sync, expected);
        assert.deepEqual(await collect(parts), expected, 'readSse (the async form) gives the same');
      }),
      { numRuns: 200 },
    );
  });
});

async function withServer(handler: (req: IncomingMessage, res: ServerResponse) => void, fn: (port: number) => Promise<void>): Promise<void> {
  const server: Server = createServer(handler);
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  try {
    await fn((server.address() as AddressInfo).port);
  } finally {
    server.closeAllConnections();
    await new Promise<void>((r) => server.close(() => r()));
  }
}

describe('SseWriter', () => {
  test('headers, JSON and string events, end; round trip through readSse', async () => {
    await withServer(
      (_req, res) => {
        const w = new SseWriter(res, { headers: { 'x-request-id': 'cmpl-1' } });
        void (async () => {
          await w.write({ a: 1 });
          await w.comment('ping');
          await w.write('[DONE]');
          w.end();
          assert.equal(w.closed, true);
          await assert.rejects(w.write('late'), (e: unknown) => e instanceof SseError && e.code === 'SSE_CLOSED');
        })();
      },
      async (port) => {
        const r = await fetch(`http://127.0.0.1:${port}/`);
        assert.equal(r.status, 200);
        assert.match(r.headers.get('content-type') ?? '', /^text\/event-stream/);
        assert.equal(r.headers.get('cache-control'), 'no-cache, no-transform');
        assert.equal(r.headers.get('x-request-id'), 'cmpl-1');
        const got: string[] = [];
        for await (const d of readSse(r.body as unknown as AsyncIterable<Uint8Array>)) got.push(d);
        assert.deepEqual(got, ['{"a":1}', '[DONE]']);
      },
    );
  });

  test('write waits for drain and rejects SSE_WRITE_TIMEOUT when the client does not read', async () => {
    let result: Promise<unknown> = Promise.resolve();
    await withServer(
      (_req, res) => {
        const w = new SseWriter(res, { writeTimeoutMs: 200 });
        result = (async () => {
          const big = 'z'.repeat(256 * 1024);
          for (let i = 0; i < 400; i++) await w.write(big);
        })();
      },
      async (port) => {
        await new Promise<void>((resolve) => {
          const req = httpRequest({ port, host: '127.0.0.1', path: '/' }, (res) => {
            res.pause(); // never read
            resolve();
          });
          req.end();
        });
        await assert.rejects(result, (e: unknown) => e instanceof SseError && e.code === 'SSE_WRITE_TIMEOUT');
      },
    );
  });

  test('write rejects SSE_CLOSED when the client goes away while waiting for drain', async () => {
    let result: Promise<unknown> = Promise.resolve();
    await withServer(
      (_req, res) => {
        const w = new SseWriter(res, { writeTimeoutMs: 10_000 });
        result = (async () => {
          const big = 'z'.repeat(256 * 1024);
          for (let i = 0; i < 400; i++) await w.write(big);
        })();
      },
      async (port) => {
        await new Promise<void>((resolve) => {
          const req = httpRequest({ port, host: '127.0.0.1', path: '/' }, (res) => {
            res.pause();
            setTimeout(() => {
              req.destroy();
              resolve();
            }, 100);
          });
          req.end();
        });
        const t0 = Date.now();
        await assert.rejects(result, (e: unknown) => e instanceof SseError && e.code === 'SSE_CLOSED');
        assert.ok(Date.now() - t0 < 2000);
      },
    );
  });
});
