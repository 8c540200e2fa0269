/**
 * Where a PD request's token-1 → token-2 gap goes, phase by phase, for a few rooms. Bench-only.
 *
 *   node --import tsx scripts/pd-gap-trace.ts [requests=3] [prompt words=580] [model=the generated small GGUF]
 *
 * Starts a local PD stack (1 prefill, 1 decode, 1 thread each), sends streaming completions of
 * about `prompt words` words (each prompt its own, so no prefix is reused), stamps every text
 * event on arrival, then reads both workers' GET /debug/rooms and prints each room's timeline
 * (wall-clock ms, relative to token 1's arrival): prefill's kv_begin after its save, decode's
 * kv_done once the state is loaded, then token 2 after decode's first step and the router's relay.
 */
import { homedir } from 'node:os';
import { join } from 'node:path';
import { Cluster } from '../src/up/cluster.js';

const requests = Number(process.argv[2] ?? 3);
const promptWords = Number(process.argv[3] ?? 580);
const model = process.argv[4] ?? join(homedir(), '.cache/pdserve/pdserve-small-s1-g2.gguf');
const c = new Cluster({ model, prefill: 1, decode: 1, threads: 1, ctxSize: 2048 });
await c.start();
try {
  const words = 'the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly bears near old mills'.split(' ');
  for (let k = 0; k < requests; k++) {
    const prompt = `${Array.from({ length: promptWords }, (_, i) => words[(i * 7 + k * 3 + (i >> 5)) % words.length]).join(' ')} ${k}`;
    const t0 = Date.now();
    const res = await fetch(`${c.router.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'pdserve', prompt, max_tokens: 6, stream: true, temperature: 0, ignore_eos: true }), signal: AbortSignal.timeout(120_000) });
    if (!res.ok || !res.body) {
      console.log(`request ${k}: ${res.status} ${await res.text()}`);
      continue;
    }
    const stamps: number[] = [];
    const dec = new TextDecoder();
    let buf = '';
    for await (const ch of res.body as unknown as AsyncIterable<Uint8Array>) {
      buf += dec.decode(ch, { stream: true });
      for (let i = buf.indexOf('\n\n'); i >= 0; i = buf.indexOf('\n\n')) {
        const ev = buf.slice(0, i);
        buf = buf.slice(i + 2);
        if (ev.startsWith('data: {') && /"text":"[^"]/.test(ev)) stamps.push(Date.now());
      }
    }
    const t1 = stamps[0];
    if (t1 === undefined) {
      console.log(`request ${k}: no text`);
      continue;
    }
    console.log(`request ${k}: TTFT ${t1 - t0} ms; tokens at +${stamps.map((s) => s - t1).join(' +')} ms after token 1`);
    for (const p of [...c.byRole('prefill'), ...c.byRole('decode')]) {
      const d = (await (await fetch(`${p.url}/debug/rooms`, { signal: AbortSignal.timeout(5000) })).json()) as { recent: { room: string; timeline: { at: number; state: string; phase: string; why: string }[] }[] };
      const r = d.recent[0];
      const line = (r?.timeline ?? []).map((e) => `${e.at >= t1 ? '+' : ''}${e.at - t1} ${e.state}/${e.phase}(${e.why})`).join(', ');
      console.log(`  ${p.role} room ${r?.room}: ${line}`);
    }
  }
} finally {
  await c.stop();
}
