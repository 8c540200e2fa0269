/**
 * The storm's client and the process-wide credentials of the tools against an HTTPS router with
 * API keys (a throwaway CA from test/helpers/tls.ts): ChatCall sends the key and trusts the CA;
 * its kill resets the TCP connection under TLS (the server sees ECONNRESET, not a clean end);
 * reachGlobally gives fetch() the key and the CA for its origins only; the wrong-answer
 * check's sample takes migrated rounds first (chooseSample).
 */
import assert from 'node:assert/strict';
import { once } from 'node:events';
import https from 'node:https';
import type { AddressInfo } from 'node:net';
import { after, before, describe, it } from 'node:test';
import { reachGlobally } from '../../src/security/http-auth.js';
import { ChatCall, clientAgent } from '../../src/storm/client.js';
import { chooseSample, type SampledRound, type SamplePools } from '../../src/storm/agents.js';
import { makeTestPki, type TestPki } from '../helpers/tls.js';

let pki: TestPki;
let server: https.Server;
let url: string;
const seen: { auth?: string; path?: string }[] = [];
const resets: string[] = [];

before(async () => {
  pki = makeTestPki();
  server = https.createServer({ cert: pki.pem.cert, key: pki.pem.key }, (req, res) => {
    seen.push({ auth: req.headers.authorization, path: req.url });
    req.socket.on('error', (e: NodeJS.ErrnoException) => resets.push(String(e.code)));
    if (req.url === '/health') return void res.end('{"status":"ok"}');
    req.resume();
    req.on('end', () => {
      if (req.headers.accept === 'text/event-stream') {
        res.writeHead(200, { 'content-type': 'text/event-stream' });
        // One chunk, then silence: the client kills the call mid-stream.
        res.write(`data: ${JSON.stringify({ choices: [{ index: 0, delta: { content: 'a' } }] })}\n\n`);
        return;
      }
      res.writeHead(200, { 'content-type': 'application/json' });
      res.end(JSON.stringify({ choices: [{ index: 0, message: { role: 'assistant', content: 'hello' }, finish_reason: 'stop' }], usage: { prompt_tokens: 1, completion_tokens: 1 } }));
    });
  });
  server.listen(0, '127.0.0.1');
  await once(server, 'listening');
  url = `https://127.0.0.1:${(server.address() as AddressInfo).port}`;
});
after(() => {
  server.closeAllConnections();
  server.close();
});

describe('storm client over HTTPS with an API key', () => {
  it('sends the key, trusts the CA, and gets the answer; without the CA the call fails', async () => {
    const agent = clientAgent(url, { ca: pki.pem.ca });
    const r = await new ChatCall({ baseUrl: url, agent, apiKey: 'sk-storm', messages: [{ role: 'user', content: 'hi' }], maxTokens: 2, stream: false, deadlineMs: 5000 }).done;
    agent.destroy();
    assert.equal(r.outcome, 'ok', JSON.stringify(r));
    assert.equal(r.text, 'hello');
    assert.equal(seen.at(-1)?.auth, 'Bearer sk-storm');
    const blind = clientAgent(url);
    const f = await new ChatCall({ baseUrl: url, agent: blind, messages: [{ role: 'user', content: 'hi' }], maxTokens: 2, stream: false, deadlineMs: 5000 }).done;
    blind.destroy();
    assert.equal(f.outcome, 'failed');
    assert.match(String(f.code), /CERT|SELF_SIGNED|UNABLE/);
  });

  it("a kill resets the TCP connection under TLS (the server's socket errors with ECONNRESET)", async () => {
    const agent = clientAgent(url, { ca: pki.pem.ca });
    let call: ChatCall | undefined;
    call = new ChatCall({ baseUrl: url, agent, apiKey: 'sk-storm', messages: [{ role: 'user', content: 'hi' }], maxTokens: 8, stream: true, deadlineMs: 5000, onChunk: () => call?.cancel('kill') });
    const r = await call.done;
    assert.equal(r.outcome, 'killed');
    const t0 = Date.now();
    while (!resets.includes('ECONNRESET') && Date.now() - t0 < 3000) await new Promise((res) => setTimeout(res, 20));
    agent.destroy();
    assert.ok(resets.includes('ECONNRESET'), `server saw ${JSON.stringify(resets)}`);
  });
});

describe('reachGlobally', () => {
  it("gives fetch() the bearer key and the CA for its origins only", async () => {
    const undo = reachGlobally([url], { bearer: 'sk-admin', tls: { ca: pki.pem.ca } });
    try {
      const res = await fetch(`${url}/health`, { signal: AbortSignal.timeout(5000) });
      assert.equal(res.status, 200);
      assert.equal(seen.at(-1)?.auth, 'Bearer sk-admin');
    } finally {
      undo();
    }
    await assert.rejects(fetch(`${url}/health`, { signal: AbortSignal.timeout(5000) }), 'forgotten: the CA is not trusted any more');
  });
});

describe('the wrong-answer sample (chooseSample)', () => {
  const rounds = (tag: string, n: number): SampledRound[] => Array.from({ length: n }, (_, i) => ({ agent: 0, conv: 0, round: i, messages: [], maxTokens: 1, text: `${tag}${i}` }));
  const pools = (m: number, l: number, c: number, p: number): SamplePools => ({ migrated: rounds('m', m), local: rounds('l', l), cached: rounds('c', c), plain: rounds('p', p) });
  const kinds = (s: SampledRound[]) => s.map((r) => r.text[0]).join('');

  it('takes the migrated rounds first, up to half of the sample, then a share of each path', () => {
    // 3 migrated of 24: all of them, then 7 local (a third of 21), 7 cached, 7 plain.
    assert.equal(kinds(chooseSample(pools(3, 24, 24, 24), 24)), `${'m'.repeat(3)}${'l'.repeat(7)}${'c'.repeat(7)}${'p'.repeat(7)}`);
    // Many migrated rounds: half of the sample; the other paths keep their shares.
    assert.equal(kinds(chooseSample(pools(24, 24, 24, 24), 24)), `${'m'.repeat(12)}${'l'.repeat(4)}${'c'.repeat(4)}${'p'.repeat(4)}`);
    // Other pools short: migrated rounds fill what they leave.
    assert.equal(kinds(chooseSample(pools(24, 0, 2, 3), 24)), `${'m'.repeat(19)}ccppp`);
    // No migrated round: the paths' rule alone (a third local, half the rest cached).
    assert.equal(kinds(chooseSample(pools(0, 24, 24, 24), 24)), `${'l'.repeat(8)}${'c'.repeat(8)}${'p'.repeat(8)}`);
    assert.equal(chooseSample(pools(5, 5, 5, 5), 0).length, 0);
  });
});
