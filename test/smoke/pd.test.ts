/**
 * PD smoke test, run by `.ci/other-nodes` on Node 22 and 24 (the full suites run on Node 20):
 * a real router + prefill + decode + colocated reference on loopback, spawned with the Node
 * binary running this test; a streamed completion and a chat completion through the real
 * `openai` client, each equal token for token to the colocated server's answer.
 */
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import type { Cluster } from '../../src/up/cluster.js';
import { client, startStack } from '../helpers/stack.js';

let c: Cluster;
before(async () => {
  c = await startStack({ prefill: 1, decode: 1 });
});
after(async () => {
  await c?.stop();
});

test(`PD equals colocated on Node ${process.versions.node}`, async () => {
  const pd = client(c.router.url);
  const ref = client(c.colocated!.url);
  const prompt = 'the river ran past old mills and quiet farms';
  let streamed = '';
  for await (const ch of await pd.completions.create({ model: 'pdserve', prompt, max_tokens: 12, temperature: 0, stream: true })) streamed += ch.choices[0]?.text ?? '';
  const want = await ref.completions.create({ model: 'pdserve', prompt, max_tokens: 12, temperature: 0 });
  assert.ok(streamed.length > 0);
  assert.equal(streamed, want.choices[0]!.text);
  const messages = [{ role: 'user' as const, content: 'hello there' }];
  const a = await pd.chat.completions.create({ model: 'pdserve', messages, max_tokens: 10, temperature: 0 });
  const b = await ref.chat.completions.create({ model: 'pdserve', messages, max_tokens: 10, temperature: 0 });
  assert.equal(a.choices[0]!.message.content, b.choices[0]!.message.content);
  assert.equal(a.usage?.completion_tokens, b.usage?.completion_tokens);
});
