/**
 * GPU offload end to end on lavapipe (Mesa's software Vulkan device, named by `--gpu-device 0`,
 * every layer offloaded, tiny model, 1 thread): one stack of a Vulkan prefill, a Vulkan decode
 * (decode-0, same-host handoff), a CPU decode (decode-1, `--gpu off`, handoff over TCP) and a
 * Vulkan colocated reference; the router alternates the decodes (round_robin).
 *  - GET /workers and /metrics show backend, devices and offloaded layers per worker;
 *  - Vulkan PD (both roles offloaded) equals the Vulkan colocated server token for token;
 *  - Vulkan prefill → CPU decode is a legal pair: it serves, and its first token equals the
 *    Vulkan colocated server's (the rest may differ: the backends differ in the last bits);
 *  - the states saved from device memory pass decode's envelope and ggsq checks on both paths
 *    (kv_file and TCP), with no transfer failure;
 *  - a KV cache type mismatch (the CPU decode restarted with `--kv-cache-type q8_0`) is refused
 *    like the other pair mismatches: `mismatch` on GET /workers, no room dispatched to it, and a
 *    direct pairing refused in the KV handshake (settings_mismatch, one log line per side).
 * The model is the tiny one with head size 32 (2 heads of 32, not 4 of 16): llama.cpp quantizes
 * the KV cache in blocks of 32 values per head.
 * Skipped (loudly) where lavapipe is not installed (.ci/install-tools installs it).
 */
import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { newRoomId } from '../../src/base/room-id.js';
import { parsePrometheus, sumOf } from '../../src/observe/gather.js';
import { writeLlamaGguf } from '../../src/engine/gguf-writer.js';
import type { ClusterOptions, ClusterProc } from '../../src/up/cluster.js';
import { getJson, useStack, waitFor } from '../helpers/stack.js';

const LAVAPIPE = '/usr/share/vulkan/icd.d/lvp_icd.x86_64.json';
const VULKAN = ['--gpu', 'vulkan', '--gpu-device', '0', '--gpu-layers', 'max'];

async function metric(url: string, name: string, labels: Record<string, string> = {}): Promise<number> {
  const r = await fetch(`${url}/metrics`, { signal: AbortSignal.timeout(5000) });
  return sumOf(parsePrometheus(await r.text()), name, labels);
}

const post = (url: string, body: unknown) => fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body), signal: AbortSignal.timeout(15_000) });

describe('GPU offload on lavapipe', { skip: !existsSync(LAVAPIPE) && 'mesa-vulkan-drivers (lavapipe) is not installed: run .ci/install-tools' }, () => {
  const dir = mkdtempSync(join(tmpdir(), 'pdserve-gpu-model-'));
  const over: Partial<ClusterOptions> = {
    prefill: 1,
    decode: 2,
    startTimeoutMs: 120_000,
    extraArgs: { prefill: VULKAN, colocated: VULKAN, router: ['--decode-policy', 'round_robin'] },
    extraArgsOf: { 'decode-0': VULKAN, 'decode-1': ['--gpu', 'off', '--no-kv-same-host'] },
  };
  before(async () => {
    over.model = join(dir, 'tiny-head32.gguf');
    await writeLlamaGguf(over.model, { preset: 'tiny', seed: 1, dims: { nHead: 2, nHeadKv: 2 } });
  });
  const s = useStack(over);
  after(() => rmSync(dir, { recursive: true, force: true }));

  test('GET /workers, /health and /metrics show backend, devices and offloaded layers', async () => {
    const { workers } = await getJson<{ workers: any[] }>(`${s.c.router.url}/workers`, 5000);
    const byUrl = new Map(workers.map((w) => [w.url, w]));
    const [p, d0, d1] = [s.c.byRole('prefill')[0]!, s.c.byRole('decode')[0]!, s.c.byRole('decode')[1]!];
    for (const w of [p, d0]) {
      const row = byUrl.get(w.url);
      assert.equal(row.gpu, 'vulkan', w.name);
      assert.match(row.gpu_devices[0], /llvmpipe/);
      assert.equal(row.gpu_layers, '3/3');
      assert.equal(row.mismatch, null, 'a Vulkan prefill pairs with a CPU decode');
      assert.equal(await metric(w.url, 'pdserve_engine_offloaded_layers'), 3);
      assert.ok((await metric(w.url, 'pdserve_engine_vram_total_bytes')) > 0);
    }
    assert.deepEqual([byUrl.get(d1.url).gpu, byUrl.get(d1.url).gpu_devices, byUrl.get(d1.url).gpu_layers], [null, [], '0/3']);
    assert.equal(await metric(d1.url, 'pdserve_engine_offloaded_layers'), 0);
    assert.equal((await getJson<any>(`${s.c.colocated!.url}/health`)).gpu.backend, 'vulkan');
  });

  test('Vulkan PD equals Vulkan colocated; Vulkan prefill → CPU decode serves with the same first token; both handoffs pass the checks', async () => {
    const [d0, d1] = s.c.byRole('decode');
    const served = { vulkan: 0, cpu: 0 };
    const prompts = ['Once upon a time', 'The little model said', 'In a land far away there', 'A story about GPUs and'];
    for (const prompt of prompts) {
      const ask = { model: 'pdserve', prompt, max_tokens: 12, temperature: 0, logprobs: 0 };
      const before = [await metric(d0!.url, 'pdserve_kv_handoffs_total'), await metric(d1!.url, 'pdserve_kv_handoffs_total')];
      const pd = await s.pd.completions.create(ask);
      const ref = await s.ref.completions.create(ask);
      const after = [await metric(d0!.url, 'pdserve_kv_handoffs_total'), await metric(d1!.url, 'pdserve_kv_handoffs_total')];
      const onGpu = after[0]! > before[0]!;
      assert.notEqual(onGpu, after[1]! > before[1]!, 'exactly one decode took the room');
      const [a, b] = [pd.choices[0]!, ref.choices[0]!];
      assert.equal(a.finish_reason, 'length');
      assert.equal(a.logprobs!.tokens![0], b.logprobs!.tokens![0], `first token of ${JSON.stringify(prompt)}`);
      if (onGpu) {
        served.vulkan++;
        assert.equal(a.text, b.text, `Vulkan PD = Vulkan colocated for ${JSON.stringify(prompt)}`);
      } else served.cpu++;
    }
    assert.ok(served.vulkan >= 1 && served.cpu >= 1, `both decodes served (${JSON.stringify(served)})`);
    assert.ok((await metric(d0!.url, 'pdserve_kv_handoffs_total', { path: 'same_host' })) >= 1, 'decode-0 took the state file (kv_file: size, envelope head, ggsq headers)');
    assert.ok((await metric(d1!.url, 'pdserve_kv_handoffs_total', { path: 'tcp' })) >= 1, 'decode-1 took the state over TCP (envelope, CRC-32, ggsq walk)');
    for (const d of [d0!, d1!]) assert.equal(await metric(d.url, 'pdserve_kv_transfer_failed_total'), 0, d.name);
  });

  test('a KV cache type mismatch (q8_0 decode, f16 prefill) is shown as mismatch, never dispatched to, and refused in the handshake', async () => {
    const p = s.c.byRole('prefill')[0]!;
    const d1 = s.c.byRole('decode')[1]!;
    await s.c.kill(d1);
    d1.args.push('--kv-cache-type', 'q8_0');
    await s.c.spawn(d1);
    assert.equal((await getJson<any>(`${d1.url}/health`)).settings.kvCacheType, 'q8_0', 'the decode runs a q8_0 KV cache');
    const row = async () => ((await getJson<any>(`${s.c.router.url}/workers`)).workers as any[]).find((w) => w.url === d1.url);
    assert.ok(await waitFor(async () => (await row())?.healthy === true && /settings mismatch/.test((await row())?.mismatch ?? ''), 5000), 'GET /workers shows the mismatch');
    assert.match((await row()).mismatch, /kvCacheType q8_0 ≠ f16/);
    const before = await metric(d1.url, 'pdserve_rooms_terminal_total');
    // Prompts of more than 8 tokens (22), as in the test above: an 8-token prompt made the Vulkan
    // prefill build other pipelines first (llama.cpp's matrix-vector kernels), 20-40 s on lavapipe
    // with a cold Mesa shader cache, past the client's 30 s at load 4.
    for (let i = 0; i < 2; i++) {
      const r = await s.pd.completions.create({ model: 'pdserve', prompt: `pair ${i}: once upon a time`, max_tokens: 2, temperature: 0 });
      assert.equal(r.choices[0]!.finish_reason, 'length', `request ${i} served by the matching pair`);
    }
    assert.equal(await metric(d1.url, 'pdserve_rooms_terminal_total'), before, 'the mismatched decode got no room');
    // Paired directly, the KV handshake refuses: a clear code, one log line on each side.
    const room = newRoomId();
    const gen = { rid: 'kv-type-direct', text: 'Once upon a time', sampling_params: { temperature: 0, max_new_tokens: 2 }, bootstrap_host: '127.0.0.1', bootstrap_port: p.bootstrapPort, bootstrap_room: room };
    const atPrefill = post(`${p.url}/generate`, gen).catch(() => undefined);
    const dr = await post(`${d1.url}/generate`, gen);
    assert.equal(dr.status, 502);
    assert.equal((await dr.json()).error.code, 'settings_mismatch');
    await post(`${p.url}/abort_request`, { rid: 'kv-type-direct', bootstrap_room: room });
    assert.equal((await atPrefill)?.status, 499);
    const refused = (proc: ClusterProc) => readFileSync(proc.logFile!, 'utf8').split('\n').filter((l) => l.includes('kv pair refused'));
    assert.ok(await waitFor(async () => refused(p).length === 1 && refused(d1).length >= 1, 2000), `one line each: prefill ${refused(p).length}, decode ${refused(d1).length}`);
    assert.match(refused(p)[0]!, /kvCacheType/);
  });
});
