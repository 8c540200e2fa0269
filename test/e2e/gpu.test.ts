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
 *    (kv_file and TCP), with no transfer failure.
 * Skipped (loudly) where lavapipe is not installed (.ci/install-tools installs it).
 */
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import { describe, test } from 'node:test';
import { parsePrometheus, sumOf } from '../../src/doctor/gather.js';
import { getJson, useStack } from '../helpers/stack.js';

const LAVAPIPE = '/usr/share/vulkan/icd.d/lvp_icd.x86_64.json';
const VULKAN = ['--gpu', 'vulkan', '--gpu-device', '0', '--gpu-layers', 'max'];

async function metric(url: string, name: string, labels: Record<string, string> = {}): Promise<number> {
  const r = await fetch(`${url}/metrics`, { signal: AbortSignal.timeout(5000) });
  return sumOf(parsePrometheus(await r.text()), name, labels);
}

describe('GPU offload on lavapipe', { skip: !existsSync(LAVAPIPE) && 'mesa-vulkan-drivers (lavapipe) is not installed: run .ci/install-tools' }, () => {
  const s = useStack({
    prefill: 1,
    decode: 2,
    startTimeoutMs: 120_000,
    extraArgs: { prefill: VULKAN, colocated: VULKAN, router: ['--decode-policy', 'round_robin'] },
    extraArgsOf: { 'decode-0': VULKAN, 'decode-1': ['--gpu', 'off', '--no-kv-same-host'] },
  });

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
});
