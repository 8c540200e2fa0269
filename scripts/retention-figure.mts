// Retention figure: cached share of agent turns 2+ on a colocated server (tiny model, 2 slots + 2
// cache sequences) whose agents take turns and pause on a tool call, while two one-off requests
// arrive in each pause; --session-ttl-ms 60000 against 0 (plain LRU).
// Run: node --import tsx scripts/retention-figure.mts   (env AGENTS=4 by default; STORE=1: host store on)
import { mkdtempSync, rmSync } from 'node:fs';
import { startColocated } from '../src/colocated/server.js';
import { createLogger } from '../src/base/log.js';
import { ensureModel } from '../src/engine/gguf-writer.js';

const model = await ensureModel('tiny', 1);
const AGENTS = Number(process.env.AGENTS ?? 4);

async function run(ttl: number): Promise<void> {
  const storeDir = process.env.STORE ? mkdtempSync('/dev/shm/pdserve-retention-figure-') : undefined;
  const srv = await startColocated(
    { port: 0, slots: 2, engine: { modelPath: model, contextSize: 2048, batchSize: 64, prefixCacheSlots: 2, ...(storeDir ? { prefixStoreBytes: 1 << 28, prefixStoreDir: storeDir } : { prefixStoreBytes: 0 }), sessionTtlMs: ttl } },
    createLogger('retention-figure', { level: 'silent' }),
  );
  const call = async (messages: { role: string; content: string }[], extra: Record<string, unknown> = {}) => {
    const r = await fetch(`${srv.url}/v1/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'pdserve', messages, max_tokens: 8, temperature: 0, ...extra }), signal: AbortSignal.timeout(60_000) });
    const j = (await r.json()) as { choices: { message: { content: string } }[]; usage: { prompt_tokens: number; prompt_tokens_details: { cached_tokens: number } } };
    return { text: j.choices[0]!.message.content, prompt: j.usage.prompt_tokens, cached: j.usage.prompt_tokens_details.cached_tokens };
  };
  const sys = { role: 'system', content: 'You are a coding agent with tools read, write, run. Be brief. '.repeat(3) };
  const agents = Array.from({ length: AGENTS }, (_, a) => [sys, { role: 'user', content: `agent ${a} task: ${'fix module '.repeat(5 + a)}` }]);
  let prompt = 0;
  let cached = 0;
  let oneOff = 0;
  for (let turn = 1; turn <= 6; turn++) {
    for (let a = 0; a < agents.length; a++) {
      const r = await call(agents[a]!, { prompt_cache_key: `agent-${a}` });
      if (turn > 1) {
        prompt += r.prompt;
        cached += r.cached;
      }
      agents[a]!.push({ role: 'assistant', content: r.text }, { role: 'user', content: `tool output ${turn}: ${'ok '.repeat(10)}` });
      for (let k = 0; k < 2; k++) await call([{ role: 'user', content: `one-off ${oneOff++}: ${'why '.repeat(30)}` }]);
    }
  }
  const evictions = (await (await fetch(`${srv.url}/metrics`)).text()).split('\n').filter((l) => l.startsWith('pdserve_cache_evictions_total{')).join(', ');
  console.log(`${AGENTS} agents, store ${storeDir ? 'on' : 'off'}, --session-ttl-ms ${ttl}: turns 2-6 cached ${cached} of ${prompt} prompt tokens (${(cached / prompt).toFixed(3)}); ${evictions}`);
  await srv.close();
  if (storeDir) rmSync(storeDir, { recursive: true, force: true });
}

await run(60_000);
await run(0);
