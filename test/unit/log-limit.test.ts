/** Refusal logging: 503 refusals at warn without a stack, one line per code per second (base/log-limit.ts, api/errors.ts). */
import assert from 'node:assert/strict';
import { Writable } from 'node:stream';
import { describe, test } from 'node:test';
import Fastify from 'fastify';
import pino from 'pino';
import { ApiError, registerOpenAIErrorHandling } from '../../src/api/errors.js';
import { RepeatLimiter } from '../../src/base/log-limit.js';

describe('RepeatLimiter', () => {
  test('one hit per key per window; the next logged hit carries the suppressed count', () => {
    const l = new RepeatLimiter(1000);
    assert.equal(l.hit('a', 0), 0);
    assert.equal(l.hit('a', 10), null);
    assert.equal(l.hit('a', 999), null);
    assert.equal(l.hit('b', 500), 0, 'keys are independent');
    assert.equal(l.hit('a', 1000), 2);
    assert.equal(l.hit('a', 2500), 0);
  });

  test('at most maxKeys keys are remembered', () => {
    const l = new RepeatLimiter(1000, 2);
    l.hit('a', 0);
    l.hit('b', 0);
    l.hit('c', 0);
    assert.equal(l.hit('a', 1), 0, "'a' was dropped for 'c'");
  });
});

describe('openAIErrorHandler logging', () => {
  test('a burst of 503 no_healthy_decode: one warn line without a stack; a fault is still an error with its stack', async () => {
    const lines: { level: number; msg: string; err?: { stack?: string }; code?: string; suppressed?: number }[] = [];
    const sink = new Writable({
      write(chunk: Buffer, _enc, cb) {
        for (const l of chunk.toString().split('\n')) if (l) lines.push(JSON.parse(l));
        cb();
      },
    });
    const app = Fastify({ loggerInstance: pino({ level: 'debug' }, sink), disableRequestLogging: true });
    registerOpenAIErrorHandling(app);
    app.get('/refuse', async () => {
      throw ApiError.of('no_healthy_decode', 'no healthy decode worker');
    });
    app.get('/boom', async () => {
      throw new Error('a real fault');
    });
    try {
      for (let i = 0; i < 50; i++) {
        const r = await app.inject({ method: 'GET', url: '/refuse' });
        assert.equal(r.statusCode, 503);
        assert.equal(r.json().error.code, 'no_healthy_decode');
      }
      assert.equal((await app.inject({ method: 'GET', url: '/boom' })).statusCode, 500);
      const refused = lines.filter((l) => l.code === 'no_healthy_decode');
      assert.equal(refused.length, 1, 'one line for the burst (under one second)');
      assert.equal(refused[0]!.level, 40);
      assert.equal(refused[0]!.err, undefined, 'no error object, no stack');
      assert.ok(!lines.some((l) => l.level >= 50 && l.msg !== 'request failed'));
      const fault = lines.filter((l) => l.level === 50);
      assert.equal(fault.length, 1);
      assert.match(fault[0]!.err?.stack ?? '', /a real fault/);
    } finally {
      await app.close();
    }
  });
});
