/**
 * GPU offload settings (src/engine/gpu.ts), their validation (config/config.ts), the pair rule
 * (a KV cache type is compared, the backend is not: kv/handshake.ts, router/pairing.ts) and the
 * engine on the real llama.cpp: CPU, lavapipe (a software Vulkan device, when installed) and
 * the KV cache type reaching llama.cpp (state sizes).
 * Run: node --import tsx --test test/unit/gpu.test.ts
 */
import assert from 'node:assert/strict';
import { existsSync, mkdirSync, mkdtempSync, rmSync, statSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { execFile } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { after, describe, test } from 'node:test';
import { applyDeviceEnv, checkDeviceMemory, describeGpu, deviceEnvOf, ggmlTypeName, gpuFromHealth, gpuHealthOf, parseDeviceList, parseGpuLayers, type GpuInfo } from '../../src/engine/gpu.js';
import { EngineConfigSchema, parseConfig, PrefillConfigSchema } from '../../src/config/config.js';
import { settingsMismatch } from '../../src/kv/handshake.js';
import { parseControl } from '../../src/kv/frame.js';
import { pairSettingsOf } from '../../src/protocol/pair.js';
import { settingsFromHealth } from '../../src/router/pair-settings.js';
import { ensureModel } from '../../src/engine/gguf-writer.js';
import { loadEngine } from '../../src/engine/llama.js';
import type { SamplingParams } from '../../src/engine/types.js';
import { cli } from '../helpers/cli.js';
import { benchGpuOptions, gpuReport } from '../../src/bench/gpu.js';
import { drain } from '../helpers/engine.js';

const dir = mkdtempSync(path.join(os.tmpdir(), 'pdserve-gpu-test-'));
after(() => rmSync(dir, { recursive: true, force: true }));
const run = promisify(execFile);
const CHILD = fileURLToPath(new URL('../fixtures/gpu-engine-child.ts', import.meta.url));
const LAVAPIPE = '/usr/share/vulkan/icd.d/lvp_icd.x86_64.json';
const never = new AbortController().signal;
const greedy: SamplingParams = { temperature: 0, topP: 1, topK: 0, maxTokens: 8, stop: [], ignoreEos: true };

describe('flags', () => {
  test('--gpu-layers: auto, max (all), a count; anything else is refused', () => {
    assert.equal(parseGpuLayers('auto'), 'auto');
    assert.equal(parseGpuLayers('MAX'), 'max');
    assert.equal(parseGpuLayers('all'), 'max');
    assert.equal(parseGpuLayers('0'), 0);
    assert.equal(parseGpuLayers('33'), 33);
    for (const bad of ['-1', '1.5', 'some', '']) assert.throws(() => parseGpuLayers(bad), RangeError, bad);
  });

  test('--gpu-device: distinct indices, comma-separated', () => {
    assert.deepEqual(parseDeviceList('0'), [0]);
    assert.deepEqual(parseDeviceList('1, 0'), [1, 0]);
    for (const bad of ['', 'a', '0,,1', '-1', '0,0']) assert.throws(() => parseDeviceList(bad), RangeError, bad);
  });

  test('the device list becomes the backend\'s variables; one list per process', () => {
    assert.deepEqual(deviceEnvOf('vulkan', [0, 1]), { GGML_VK_VISIBLE_DEVICES: '0,1' });
    assert.deepEqual(deviceEnvOf('cuda', [1]), { CUDA_VISIBLE_DEVICES: '1' });
    assert.deepEqual(deviceEnvOf('auto', [0]), { GGML_VK_VISIBLE_DEVICES: '0', CUDA_VISIBLE_DEVICES: '0' });
    assert.deepEqual(deviceEnvOf('off', [0]), {});
    const env: NodeJS.ProcessEnv = {};
    applyDeviceEnv('cuda', [1], env);
    assert.equal(env.CUDA_VISIBLE_DEVICES, '1');
    applyDeviceEnv('cuda', [1], env);
    applyDeviceEnv('off', undefined, env);
    assert.throws(() => applyDeviceEnv('cuda', [0], env), /already uses 1 devices/);
    assert.throws(() => applyDeviceEnv('auto', undefined, env), /already uses 1 devices/);
    const untouched: NodeJS.ProcessEnv = {};
    applyDeviceEnv('auto', undefined, untouched);
    assert.deepEqual(untouched, {}, 'no --gpu-device: the environment is left alone');
  });

  test('KV cache types are named as node-llama-cpp resolves them (GgmlType keys)', () => {
    assert.equal(ggmlTypeName('f16'), 'F16');
    assert.equal(ggmlTypeName('q8_0'), 'Q8_0');
    assert.equal(ggmlTypeName('q4_0'), 'Q4_0');
  });

  test('config: defaults auto / auto / f16; bad values and a quantized cache without flash attention are refused together', () => {
    const e = EngineConfigSchema.parse({ modelPath: 'm.gguf' });
    assert.deepEqual([e.gpu, e.gpuLayers, e.gpuDevices, e.kvCacheType], ['auto', 'auto', undefined, 'f16']);
    assert.equal(EngineConfigSchema.parse({ modelPath: 'm', gpuLayers: 'max', gpuDevices: [0, 1], kvCacheType: 'q8_0' }).gpuLayers, 'max');
    const raw = { secret: 'long enough secret', engine: { modelPath: 'm', gpu: 'opencl', gpuLayers: -1, gpuDevices: [0, 0] } };
    assert.throws(() => parseConfig(PrefillConfigSchema, raw), (err: Error) => /engine\.gpu:/.test(err.message) && /engine\.gpuLayers/.test(err.message) && /a device appears twice/.test(err.message));
    assert.throws(() => parseConfig(PrefillConfigSchema, { secret: 'long enough secret', engine: { modelPath: 'm', kvCacheType: 'q4_0', flashAttention: false } }), /needs flash attention/);
  });
});

describe('benchmarks', () => {
  test('BENCHMARKS.md GPU section: scripts/gpu-check.sh figures when present, lavapipe labelled a functional check (the goal is the template\'s: bench-report.test.ts)', () => {
    const results = path.join(dir, 'results');
    mkdirSync(results, { recursive: true });
    const none = gpuReport(results).join('\n');
    assert.match(none, /has not run yet/);
    const row = { ttftP50: 100, itlP50: 2, itlP99: 4, e2eP50: 140 };
    writeFileSync(path.join(results, 'gpu.json'), JSON.stringify({ date: 'd', backend: 'lavapipe', gpus: 1, rows: [{ promptTokens: 64, colo: row, pd: { ...row, ttftP50: 110 } }], kv: null }));
    const lv = gpuReport(results).join('\n');
    assert.match(lv, /functional check of the offload path.*not a performance figure/);
    assert.match(lv, /\| 64 \| 100\.0 \/ 110\.0 \| 1\.10 \|/);
    // a Vulkan run with what the engines got, the agents run and what was skipped
    const engines = [{ role: 'colocated', backend: 'vulkan', devices: ['NVIDIA H100 80GB HBM3'], layers: '9/9' }, { role: 'decode', backend: 'vulkan', devices: ['NVIDIA H100 80GB HBM3'], layers: '9/9' }];
    const agents = [{ setup: 'pd_store', agents: 8, ttftR1: 40, ttftLast: 30, rounds: 4, cachedShare: 0.8, goodput: 3.456, failed: 0 }];
    writeFileSync(path.join(results, 'gpu.json'), JSON.stringify({ date: 'd', backend: 'vulkan', gpus: 1, model: 'm.gguf', engines, rows: [{ promptTokens: 512, colo: row, pd: row }], kv: null, agents, notes: ['§1 skipped: --no-kv'] }));
    const vk = gpuReport(results).join('\n');
    assert.match(vk, /Vulkan, 1 GPU\(s\) \(NVIDIA H100 80GB HBM3\), model m\.gguf, every layer offloaded/);
    assert.match(vk, /\| decode \| vulkan \| 9\/9 \|/);
    assert.match(vk, /\| pd_store \| 8 \| 40 \| 30 \| 80 % \| 3\.46 \| 0 \|/);
    assert.match(vk, /- §1 skipped: --no-kv/);
    assert.doesNotMatch(vk, /not a performance figure/);
  });

  test('PDSERVE_BENCH_GPU puts the KV benchmark\'s engines on a device; absent = CPU; a bad value is refused', () => {
    assert.deepEqual(benchGpuOptions({}), {});
    assert.deepEqual(benchGpuOptions({ PDSERVE_BENCH_GPU: 'cuda', PDSERVE_BENCH_GPU_DEVICE: '1' }), { gpu: 'cuda', gpuLayers: 'max', gpuDevices: [1] });
    assert.throws(() => benchGpuOptions({ PDSERVE_BENCH_GPU: 'tpu' }), RangeError);
  });
});

describe('memory check', () => {
  const MiB = 1 << 20;
  const plan = { modelBytes: 400 * MiB, slotsContextBytes: 300 * MiB, perCacheSequenceBytes: 50 * MiB, slots: 8, cacheSequences: 4, freeBytes: 1000 * MiB, totalBytes: 1024 * MiB, contextSize: 2048 };
  test('everything fits: every prefix-cache sequence is kept', () => {
    assert.equal(checkDeviceMemory({ ...plan, freeBytes: 2000 * MiB }), 4);
  });
  test('the slots fit, not every cache sequence: as many as fit', () => {
    assert.equal(checkDeviceMemory(plan), 4);
    assert.equal(checkDeviceMemory({ ...plan, freeBytes: 820 * MiB }), 2);
    assert.equal(checkDeviceMemory({ ...plan, freeBytes: 700 * MiB }), 0);
  });
  test('the slots do not fit: one error naming the sizes and the flags', () => {
    assert.throws(
      () => checkDeviceMemory({ ...plan, freeBytes: 600 * MiB }),
      (err: Error & { code?: string }) =>
        err.code === 'GPU_MEMORY' && /model 400\.0 MiB \+ context 300\.0 MiB \(8 slots × 2048 tokens\) = 700\.0 MiB/.test(err.message) && /600\.0 MiB free of 1024\.0 MiB/.test(err.message) && /--gpu-layers/.test(err.message) && /--ctx-size/.test(err.message),
    );
  });
});

describe('pairs', () => {
  const base = { fingerprint: 'ab'.repeat(32), contextSize: 1024, batchSize: 128, flashAttention: true };
  test('a KV cache type mismatch is a settings mismatch; absent means f16', () => {
    assert.equal(settingsMismatch({ ...base, kvCacheType: 'q8_0' }, { ...base, kvCacheType: 'q8_0' }), undefined);
    assert.equal(settingsMismatch({ ...base, kvCacheType: 'f16' }, base), undefined);
    assert.equal(settingsMismatch({ ...base, kvCacheType: 'q8_0' }, { ...base, kvCacheType: 'f16' }), 'kvCacheType q8_0 ≠ f16');
    assert.equal(settingsMismatch(base, { ...base, kvCacheType: 'q4_0' }), 'kvCacheType f16 ≠ q4_0');
  });

  test('the KV cache type survives the wire (hello frame) and /health', () => {
    const hello = { type: 'hello' as const, nonce: 'a'.repeat(32), epoch: 'b'.repeat(16), role: 'prefill' as const, settings: { ...base, kvCacheType: 'q4_0' } };
    // parseControl is what the channel runs on every received control frame's JSON (zod strips unknown keys).
    const back = parseControl(JSON.parse(JSON.stringify(hello)));
    assert.equal((back as typeof hello).settings.kvCacheType, 'q4_0');
    assert.throws(() => parseControl({ ...hello, settings: { ...base, kvCacheType: 'Q8_0; drop' } }));
    assert.equal(settingsFromHealth({ ...base, kvCacheType: 'q8_0' })?.kvCacheType, 'q8_0');
    assert.equal(settingsFromHealth(base)?.kvCacheType, undefined);
  });

  test('backend and offloaded layers are not pair settings (a GPU prefill pairs with a CPU decode)', () => {
    const info = (gpu: GpuInfo) => ({ fingerprint: base.fingerprint, compat: { contextSize: 1024, batchSize: 128, nLayer: 2, flashAttention: true, kvCacheType: 'f16' as const }, gpu }) as never;
    const onGpu = pairSettingsOf(info({ requested: 'vulkan', backend: 'vulkan', devices: ['dev'], offloadedLayers: 3, totalLayers: 3, vramTotalBytes: 1 }));
    const onCpu = pairSettingsOf(info({ requested: 'off', backend: null, devices: [], offloadedLayers: 0, totalLayers: 3, vramTotalBytes: 0 }));
    assert.deepEqual(onGpu, onCpu);
    assert.equal(settingsMismatch(onGpu, onCpu), undefined);
  });

  test('/health gpu → the GET /workers fields; malformed → null', () => {
    const g: GpuInfo = { requested: 'auto', backend: 'vulkan', devices: ['llvmpipe'], offloadedLayers: 2, totalLayers: 3, vramTotalBytes: 1 };
    assert.deepEqual(gpuFromHealth(gpuHealthOf(g)), { gpu: 'vulkan', gpu_devices: ['llvmpipe'], gpu_layers: '2/3' });
    assert.deepEqual(gpuFromHealth(gpuHealthOf({ ...g, backend: 'vulkan', devices: [], offloadedLayers: 0 })), { gpu: null, gpu_devices: [], gpu_layers: '0/3' }, 'a backend without a device is CPU only');
    assert.equal(gpuFromHealth({ backend: 'cuda' }), null);
    assert.equal(gpuFromHealth(undefined), null);
    assert.match(describeGpu(g), /^vulkan \[llvmpipe\], 2\/3 layers offloaded/);
    assert.equal(describeGpu({ ...g, requested: 'off', backend: null, devices: [] }), 'CPU only (--gpu off)');
  });
});

describe('engine', () => {
  test('CPU (--gpu off): nothing offloaded, reported as CPU only; /health shape', async () => {
    const e = await loadEngine({ modelPath: await ensureModel('tiny', 1), sequences: 1, contextSize: 256, batchSize: 64, gpu: 'off' });
    try {
      assert.equal(e.info.gpu.backend, null);
      assert.equal(e.info.gpu.offloadedLayers, 0);
      assert.equal(e.info.gpu.totalLayers, 3, 'tiny: 2 blocks + the output layer');
      assert.deepEqual(await e.gpuMemory(), { totalBytes: 0, usedBytes: 0 });
      assert.equal(e.info.compat.kvCacheType, 'f16');
    } finally {
      await e.dispose();
    }
  });

  test('CLI: --gpu vulkan with no visible device exits with one clear error naming --gpu-device; a bad flag value is refused', { skip: process.env.GGML_VK_VISIBLE_DEVICES !== undefined && 'GGML_VK_VISIBLE_DEVICES is set' }, async () => {
    // A child process: this one's Vulkan backend is initialised below with a device list.
    const r = await cli(['colocated', '--gpu', 'vulkan', '--port', '0'], 60_000);
    assert.notEqual(r.code, 0);
    assert.match(r.out + r.err, /--gpu vulkan: the vulkan backend found no device.*--gpu-device 0/);
    const bad = await cli(['colocated', '--gpu-layers', 'lots']);
    assert.notEqual(bad.code, 0);
    assert.match(bad.err, /--gpu-layers.*not a layer count: lots/);
  });

  test('--kv-cache-type reaches llama.cpp: q8_0 / q4_0 states are ~0.53× / ~0.28× the f16 one and continue greedily', async () => {
    // The small model (head size 64): llama.cpp's q8_0 / q4_0 blocks of 32 do not divide the tiny model's 16.
    const modelPath = await ensureModel('small', 1);
    const sizes: Record<string, number> = {};
    for (const kvCacheType of ['f16', 'q8_0', 'q4_0'] as const) {
      const e = await loadEngine({ modelPath, sequences: 1, contextSize: 128, batchSize: 64, gpu: 'off', kvCacheType });
      try {
        assert.equal(e.info.compat.kvCacheType, kvCacheType);
        const s = e.tryAcquireSlot()!;
        const prompt = e.tokenize('Once upon a time there was a little model');
        await s.prefill(prompt, greedy, never);
        const file = path.join(dir, `${kvCacheType}.ggsq`);
        sizes[kvCacheType] = await s.saveState(file);
        assert.equal(statSync(file).size, sizes[kvCacheType]);
        s.release();
      } finally {
        await e.dispose();
      }
    }
    const q8 = sizes.q8_0! / sizes.f16!;
    const q4 = sizes.q4_0! / sizes.f16!;
    assert.ok(q8 > 0.5 && q8 < 0.56, `q8_0/f16 = ${q8.toFixed(3)} (${JSON.stringify(sizes)})`);
    assert.ok(q4 > 0.26 && q4 < 0.31, `q4_0/f16 = ${q4.toFixed(3)}`);
  });

  test('--kv-cache-type q8_0 on a model whose head size is not a multiple of 32: llama.cpp\'s reason in the error', async () => {
    await assert.rejects(loadEngine({ modelPath: await ensureModel('tiny', 1), sequences: 1, contextSize: 256, batchSize: 64, gpu: 'off', kvCacheType: 'q8_0' }), /does not divide n_embd_head_k/);
  });

  test('lavapipe (--gpu-device 0): every layer offloaded, cache sequences sized, a device-memory state walks as ggsq, --gpu-layers 0 equals the CPU build, a context too big refused by name', { skip: !existsSync(LAVAPIPE) && 'mesa-vulkan-drivers (lavapipe) is not installed' }, async (t) => {
    // 70+ tokens: two prompt chunks of 64, and batches big enough for llama.cpp's op offload.
    const text = 'Once upon a time there was a little model that lived in a software GPU and computed every layer of every token it was given, slowly but surely, until the end of the story.';
    const state = path.join(dir, 'vulkan.ggsq');
    const { stdout } = await run(process.execPath, ['--import', 'tsx', CHILD, text, state], { timeout: 180_000, env: { ...process.env, GGML_VK_VISIBLE_DEVICES: '' } });
    const o = JSON.parse(stdout.trim().split('\n').pop()!);
    assert.equal(o.env, '0', '--gpu-device 0 set GGML_VK_VISIBLE_DEVICES');
    assert.equal(o.gpu.backend, 'vulkan');
    assert.match(o.gpu.devices[0] ?? '', /llvmpipe/);
    assert.deepEqual([o.gpu.offloadedLayers, o.gpu.totalLayers], [3, 3]);
    assert.equal(o.cacheSequences, 2, 'the cache sequences fit the 2 GiB device');
    assert.ok(o.memory.totalBytes > 0);
    assert.ok(o.walkedTokens > 64, 'the state saved from device memory is a well-formed ggsq file');
    assert.equal(o.zeroGpu.offloadedLayers, 0);
    assert.match(o.tooBig, /not enough device memory: model .* \+ context .* \(64 slots × 1048576 tokens\).*--ctx-size/);
    assert.match(o.otherBackend, /one GPU backend per process/);
    // The CPU build here (this process runs --gpu off only).
    const e = await loadEngine({ modelPath: await ensureModel('tiny', 1), sequences: 1, contextSize: 256, batchSize: 64, gpu: 'off' });
    try {
      const s = e.tryAcquireSlot()!;
      const sp = { ...greedy, maxTokens: 16 };
      const r = await s.prefill(e.tokenize(text), sp, never);
      const cpu = (await drain(s, r.firstToken, sp)).tokens;
      s.release();
      assert.deepEqual(o.zeroLayers, cpu, '--gpu vulkan --gpu-layers 0 computes what the CPU build does');
      const same = cpu.findIndex((tok: number, i: number) => tok !== o.offloaded[i]);
      t.diagnostic(`every layer on lavapipe vs CPU: ${same === -1 ? 'all 16 greedy tokens equal' : `first difference at token ${same}`}`);
    } finally {
      await e.dispose();
    }
  });

});
