/**
 * GPU offload gauges of a worker's engine (prom-client, on the worker's own registry), read at
 * scrape time: `pdserve_engine_offloaded_layers` / `pdserve_engine_layers` (node-llama-cpp's
 * layer count, the output layer included) and the backend's device memory,
 * `pdserve_engine_vram_total_bytes` / `pdserve_engine_vram_used_bytes` (0 on CPU). The backend
 * and device names are labels of `pdserve_engine_gpu_info` (value 1).
 */
import client from 'prom-client';
import type { Engine } from '../engine/types.js';

/** Register the gauges of `engine` on `registry`. */
export function registerGpuMetrics(registry: client.Registry, engine: Engine): void {
  const registers = [registry];
  const gpu = engine.info.gpu;
  new client.Gauge({ name: 'pdserve_engine_offloaded_layers', help: 'Model layers whose weights are on the GPU (0 = CPU only)', registers }).set(gpu.devices.length > 0 ? gpu.offloadedLayers : 0);
  new client.Gauge({ name: 'pdserve_engine_layers', help: 'Model layers (as counted for offload, output layer included)', registers }).set(gpu.totalLayers);
  new client.Gauge({ name: 'pdserve_engine_gpu_info', help: 'GPU backend and devices of the engine (value 1; backend "cpu" when nothing is offloaded)', labelNames: ['backend', 'devices'], registers }).set({ backend: gpu.devices.length > 0 && gpu.backend ? gpu.backend : 'cpu', devices: gpu.devices.join(', ') }, 1);
  let last: Promise<{ totalBytes: number; usedBytes: number }> | null = null;
  const memory = () => (last ??= engine.gpuMemory().finally(() => setImmediate(() => (last = null))));
  new client.Gauge({
    name: 'pdserve_engine_vram_total_bytes',
    help: 'Device memory of the GPU backend, bytes (0 on CPU)',
    registers,
    async collect() {
      this.set((await memory()).totalBytes);
    },
  });
  new client.Gauge({
    name: 'pdserve_engine_vram_used_bytes',
    help: 'Device memory in use, bytes (0 on CPU)',
    registers,
    async collect() {
      this.set((await memory()).usedBytes);
    },
  });
}
