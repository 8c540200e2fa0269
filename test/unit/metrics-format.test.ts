/**
 * The metrics registries' text passes `promtool check metrics` (where promtool is installed; said
 * loudly where not) and names no gauge `*_total` (prom-client's default process gauges are renamed).
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { Registry } from 'prom-client';
import { WorkerMetrics } from '../../src/runtime/metrics.js';
import { registerGpuMetrics } from '../../src/runtime/gpu-metrics.js';
import { collectCleanDefaultMetrics } from '../../src/runtime/promclean.js';
import { KVPoll } from '../../src/kv/types.js';
import { RouterMetrics, WorkerRegistry } from '../../src/router/index.js';
import pino from 'pino';
import { assertTotalsAreCounters, checkMetrics, reportMissingPromtool } from '../helpers/promtool.js';

test('default process gauges named *_total are dropped or renamed', async () => {
  const reg = new Registry();
  const renamed = collectCleanDefaultMetrics(reg, 'x_');
  assert.ok(Object.keys(renamed).length >= 1, 'prom-client still exports *_total gauges (else this module is obsolete)');
  const text = await reg.metrics();
  assertTotalsAreCounters(text);
  for (const [old, clean] of Object.entries(renamed)) {
    assert.doesNotMatch(text, new RegExp(`^# TYPE ${old} `, 'm'));
    assert.match(text, new RegExp(`^# TYPE ${clean} gauge`, 'm'));
  }
});

test('worker and router /metrics text passes promtool check metrics', async (t) => {
  const w = new WorkerMetrics('decode', {
    queues: () => ({ decode_prealloc_queue: 1, decode_running: 2 }),
    roomsByState: () => new Map([[KVPoll.Transferring, 1]]),
    channel: () => ({ framesIn: 3, peersLost: 1 }),
  });
  w.kvTransferFailed.inc({ reason: 'deadline' });
  w.kvSeconds.observe(0.01);
  w.expired.inc({ role: 'decode', state: 'Transferring' });
  // The GPU gauges of an engine on a device (values as a Vulkan engine reports them).
  const gpu = { requested: 'vulkan', backend: 'vulkan', devices: ['llvmpipe (LLVM 15.0.6, 256 bits)', 'GPU "1"'], offloadedLayers: 3, totalLayers: 3, vramTotalBytes: 2 ** 31 };
  registerGpuMetrics(w.registry, { info: { gpu }, gpuMemory: async () => ({ totalBytes: 2 ** 31, usedBytes: 12345 }) } as never);
  const registry = new WorkerRegistry({ prefill: [], decode: [] }, { dispatcher: undefined as never, log: pino({ level: 'silent' }), intervalMs: 1000, timeoutMs: 1000 });
  const r = new RouterMetrics(registry);
  r.ttft.observe(0.1);
  const workerText = await w.registry.metrics();
  for (const line of ['pdserve_engine_offloaded_layers 3', 'pdserve_engine_vram_total_bytes 2147483648', 'pdserve_engine_vram_used_bytes 12345', 'pdserve_engine_gpu_info{backend="vulkan",devices="llvmpipe (LLVM 15.0.6, 256 bits), GPU \\"1\\""} 1']) assert.ok(workerText.includes(line), line);
  for (const [name, text] of [['worker', workerText], ['router', await r.registry.metrics()]] as const) {
    assertTotalsAreCounters(text);
    const res = checkMetrics(text);
    if (!res) return reportMissingPromtool(t);
    assert.ok(res.ok, `promtool rejects the ${name} metrics:\n${res.output}`);
  }
});

test('pdserve_kv_streamed_handoffs_total is on prefill only, the side that counts it', async () => {
  const sources = { queues: () => ({}), roomsByState: () => new Map<KVPoll, number>() };
  const text = async (role: 'prefill' | 'decode' | 'colocated') => new WorkerMetrics(role, sources).registry.metrics();
  assert.match(await text('prefill'), /^# TYPE pdserve_kv_streamed_handoffs_total counter$/m);
  for (const role of ['decode', 'colocated'] as const) assert.doesNotMatch(await text(role), /pdserve_kv_streamed_handoffs_total/, role);
  // the handoff count by path stays on both sides (each counts its own end of a handoff)
  assert.match(await text('decode'), /^# TYPE pdserve_kv_handoffs_total counter$/m);
});
