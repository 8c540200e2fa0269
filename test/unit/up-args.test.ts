/**
 * `pdserve up` forwards the engine flags it accepts to its workers: each flag given to `up`,
 * turned into worker arguments by `upEngineArgs`, parses under the real `prefill` and `decode`
 * commands to the same value (a flag `up` took but dropped left the workers on their defaults:
 * `up --no-prefix-cache` still reused prefixes).
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { upExtraArgs } from '../../src/cli/main.js';
import { parsedOptions } from '../helpers/cli-options.js';
import { upEngineArgs, type UpEngineFlags } from '../../src/cli/up-args.js';

const KEYS = ['flashAttention', 'prefixCache', 'prefixCacheSlots', 'prefixCacheTokens', 'prefixStoreBytes', 'grammarBudgetMs'] as const;

const parsed = parsedOptions;

const pick = (o: Record<string, unknown>) => Object.fromEntries(KEYS.map((k) => [k, o[k]]));

for (const given of [
  ['--no-flash-attention', '--no-prefix-cache', '--prefix-cache-slots', '2', '--prefix-cache-tokens', '1000', '--prefix-store-bytes', '0'],
  ['--prefix-cache-slots', '0', '--prefix-store-bytes', '1048576', '--grammar-budget-ms', '750'],
  [],
]) {
  test(`up ${given.join(' ') || '(defaults)'}: prefill and decode get the same engine flags`, async () => {
    const up = await parsed('up', given);
    const args = upEngineArgs(up as unknown as UpEngineFlags);
    for (const role of ['prefill', 'decode']) assert.deepEqual(pick(await parsed(role, args)), pick(up), role);
  });
}

test('prefill streams the state while llama.cpp saves it by default; `prefill --no-kv-stream` and `up --no-kv-stream` turn it off', async () => {
  assert.equal((await parsed('prefill', [])).kvStream, true, 'prefill: on by default');
  assert.equal((await parsed('prefill', ['--no-kv-stream'])).kvStream, false, 'prefill --no-kv-stream');
  for (const [given, want] of [[[], true], [['--no-kv-stream'], false]] as const) {
    const up = await parsed('up', [...given]);
    const forwarded = upExtraArgs(up as unknown as Parameters<typeof upExtraArgs>[0]).prefill ?? [];
    assert.equal(forwarded.includes('--no-kv-stream'), !want, `up ${given.join(' ')} forwards ${forwarded.join(' ')}`);
    assert.equal((await parsed('prefill', forwarded)).kvStream, want, `up ${given.join(' ') || '(defaults)'}: its prefill workers stream: ${want}`);
  }
});

test('`up --client-write-deadline-ms` and `--client-max-buffered-bytes` reach its router', async () => {
  const up = await parsed('up', ['--client-write-deadline-ms', '1234', '--client-max-buffered-bytes', '8M']);
  const forwarded = upExtraArgs(up as unknown as Parameters<typeof upExtraArgs>[0]).router ?? [];
  const router = await parsed('router', forwarded);
  assert.equal(router.clientWriteDeadlineMs, 1234, forwarded.join(' '));
  assert.equal(router.clientMaxBufferedBytes, 8 * 1024 * 1024, forwarded.join(' '));
  const defaults = await parsed('router', upExtraArgs((await parsed('up', [])) as unknown as Parameters<typeof upExtraArgs>[0]).router ?? []);
  const plain = await parsed('router', []);
  assert.deepEqual([defaults.clientWriteDeadlineMs, defaults.clientMaxBufferedBytes], [plain.clientWriteDeadlineMs, plain.clientMaxBufferedBytes], "up's defaults are the router's");
});

test('`up --max-tool-calls N` reaches its router', async () => {
  const up = await parsed('up', ['--max-tool-calls', '3']);
  const forwarded = upExtraArgs(up as unknown as Parameters<typeof upExtraArgs>[0]).router ?? [];
  assert.equal((await parsed('router', forwarded)).maxToolCalls, 3, forwarded.join(' '));
  assert.equal((await parsed('router', [])).maxToolCalls, 16, 'default');
});
