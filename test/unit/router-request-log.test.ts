/**
 * The router's per-request log lines (src/router/request-log.ts): a generation request gets no
 * info line before it is handled ('incoming request' at debug) and one info line after the
 * response that names it (rid, method, url, remote address, status); GETs get none; other POSTs
 * keep fastify's two lines.
 */
import assert from 'node:assert/strict';
import { Writable } from 'node:stream';
import { describe, test } from 'node:test';
import Fastify from 'fastify';
import pino from 'pino';
import { isGenerationRequest, RouterLogController } from '../../src/router/request-log.js';

type Line = { level: number; msg: string; rid?: string; req?: { method?: string; url?: string; remoteAddress?: string }; res?: { statusCode?: number }; responseTime?: number };

async function run(level: 'info' | 'debug', calls: { method: 'GET' | 'POST'; url: string; status?: number }[]): Promise<{ lines: Line[]; during: Line[][] }> {
  const lines: Line[] = [];
  const sink = new Writable({
    write(chunk: Buffer, _enc, cb) {
      for (const l of chunk.toString().split('\n')) if (l) lines.push(JSON.parse(l));
      cb();
    },
  });
  let n = 0;
  const app = Fastify({ loggerInstance: pino({ level }, sink), genReqId: () => `cmpl-${++n}`, logController: new RouterLogController({ requestIdLogLabel: 'rid' }) });
  // What was logged by the time the handler ran (before the response).
  const during: Line[][] = [];
  const handler = async (req: { url: string }, reply: { code(n: number): unknown }) => {
    await new Promise((r) => setImmediate(r));
    during.push(lines.slice());
    if (req.url.includes('fail')) reply.code(400);
    return { ok: true };
  };
  app.post('/v1/completions', handler);
  app.post('/v1/chat/completions', handler);
  app.post('/tokenize', handler);
  app.get('/health', handler);
  for (const c of calls) await app.inject({ method: c.method, url: c.url, payload: c.method === 'POST' ? {} : undefined });
  await app.close();
  await new Promise((r) => setImmediate(r));
  return { lines, during };
}

describe('router request log lines (RouterLogController)', () => {
  test('generation POST: no line before the handler at info; one info line after the response with the request and its status', async () => {
    const { lines, during } = await run('info', [
      { method: 'POST', url: '/v1/completions' },
      { method: 'POST', url: '/v1/chat/completions?fail=1' },
    ]);
    assert.deepEqual(during, [[], lines.slice(0, 1)], 'nothing is written before a generation request is handled');
    assert.equal(lines.length, 2);
    assert.deepEqual(
      lines.map((l) => [l.level, l.msg, l.rid, l.req?.method, l.req?.url, l.res?.statusCode, typeof l.responseTime, typeof l.req?.remoteAddress]),
      [
        [30, 'request completed', 'cmpl-1', 'POST', '/v1/completions', 200, 'number', 'string'],
        [30, 'request completed', 'cmpl-2', 'POST', '/v1/chat/completions?fail=1', 400, 'number', 'string'],
      ],
    );
  });

  test('at debug the incoming line is still written first; GETs log nothing; other POSTs keep fastify\'s two lines', async () => {
    const { lines } = await run('debug', [
      { method: 'POST', url: '/v1/completions' },
      { method: 'GET', url: '/health' },
      { method: 'POST', url: '/tokenize' },
    ]);
    assert.deepEqual(
      lines.map((l) => [l.level, l.msg, l.rid, l.req?.url ?? null]),
      [
        [20, 'incoming request', 'cmpl-1', '/v1/completions'],
        [30, 'request completed', 'cmpl-1', '/v1/completions'],
        [30, 'incoming request', 'cmpl-3', '/tokenize'],
        [30, 'request completed', 'cmpl-3', null],
      ],
    );
  });

  test('isGenerationRequest: POST to the two generation routes only', () => {
    assert.equal(isGenerationRequest({ method: 'POST', url: '/v1/completions' }), true);
    assert.equal(isGenerationRequest({ method: 'POST', url: '/v1/chat/completions?x=1' }), true);
    assert.equal(isGenerationRequest({ method: 'GET', url: '/v1/completions' }), false);
    assert.equal(isGenerationRequest({ method: 'POST', url: '/tokenize' }), false);
    assert.equal(isGenerationRequest({ method: 'POST' }), false);
  });
});
