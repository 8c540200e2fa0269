/**
 * What each worker's engine runs on, from the `gpu` object of its GET /health
 * (engine/gpu.ts gpuHealthOf): a term of the doctor's summary line, and an info finding naming
 * backend, devices and offloaded layers per worker when any worker is on a GPU.
 */
import { gpuFromHealth } from '../engine/gpu.js';
import type { Finding } from './finding.js';
import type { WorkerProbe } from './gather.js';

/** One worker's engine as a short label: 'vulkan 3/3 layers', 'cpu', or null when not reported. */
function labelOf(w: WorkerProbe): string | null {
  const g = gpuFromHealth(w.health.body?.gpu);
  if (!g) return null;
  return g.gpu ? `${g.gpu} ${g.gpu_layers} layers` : 'cpu';
}

/** The summary term, e.g. '1 on GPU (vulkan), 1 on CPU'; null when no worker reports it. */
export function offloadSummary(workers: readonly WorkerProbe[]): string | null {
  const labels = workers.map(labelOf).filter((l): l is string => l !== null);
  if (labels.length === 0) return null;
  const gpus = labels.filter((l) => l !== 'cpu');
  const backends = [...new Set(gpus.map((l) => l.split(' ')[0]))];
  return [gpus.length ? `${gpus.length} on GPU (${backends.join(', ')})` : '', labels.length - gpus.length ? `${labels.length - gpus.length} on CPU` : ''].filter(Boolean).join(', ');
}

/** An info finding listing every worker's offload, when at least one is on a GPU; else null. */
export function offloadFinding(workers: readonly WorkerProbe[]): Omit<Finding, 'weight'> | null {
  const rows = workers.map((w) => ({ w, g: gpuFromHealth(w.health.body?.gpu) })).filter((r) => r.g !== null);
  if (!rows.some((r) => r.g!.gpu !== null)) return null;
  const partial = rows.filter((r) => r.g!.gpu !== null && r.g!.gpu_layers !== null && !/^(\d+)\/\1$/.test(r.g!.gpu_layers));
  return {
    severity: 'info',
    kind: 'gpu_offload',
    title: `GPU offload: ${offloadSummary(workers)}${partial.length ? `; ${partial.length} worker(s) offload only part of the model` : ''}`,
    details: rows.map(({ w, g }) => `${w.ref.role} ${w.ref.url}: ${g!.gpu ? `${g!.gpu} [${g!.gpu_devices.join(', ')}], ${g!.gpu_layers} layers offloaded` : 'CPU only'}`),
    cause: 'what each engine runs on (GET /health gpu); a GPU prefill with a CPU decode is a legal pair, layers left on the CPU are slower',
    next: partial.length ? ['raise --gpu-layers, or free device memory (lower --ctx-size / --slots)'] : [`curl -sS ${rows[0]!.w.ref.url}/health`],
    data: { workers: rows.map(({ w, g }) => ({ role: w.ref.role, url: w.ref.url, ...g })) },
  };
}
