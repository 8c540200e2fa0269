/**
 * The GPU part of BENCHMARKS.md (its prose and goal are the report template's, report.md): the
 * figures of `scripts/gpu-check.sh` (bench/results/gpu.json) when it has run — on CUDA, or on
 * lavapipe, whose figures are a functional check of the path and no performance claim.
 */
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { GPU_BACKENDS, parseDeviceList, type GpuBackend } from '../engine/gpu.js';

/** bench/results/gpu.json as scripts/gpu-check.sh writes it (ms). */
interface GpuCheckResult {
  date: string;
  backend: 'cuda' | 'lavapipe';
  gpus: number;
  rows: { promptTokens: number; colo: GpuRow; pd: GpuRow }[];
  /** §1's states, smallest first; the goal ratios when the run recorded them (TCP: KV / (save + raw + load); same host: (save + handoff) / (save + load)). */
  kv: { mib: number; kvMs?: number; rawMs?: number; tcpGoalRatio?: number; sameHostGoalRatio?: number }[] | null;
}
interface GpuRow {
  ttftP50: number;
  itlP50: number;
  itlP99: number;
  e2eP50: number;
}

const f = (x: number | undefined, d = 1) => (typeof x === 'number' && Number.isFinite(x) ? x.toFixed(d) : '–');

/** The section's figures from `resultsDir`/gpu.json when present (the goal and the prose are the report template's). */
export function gpuReport(resultsDir: string): string[] {
  const L: string[] = [];
  const file = join(resultsDir, 'gpu.json');
  let r: GpuCheckResult | null = null;
  if (existsSync(file)) {
    try {
      r = JSON.parse(readFileSync(file, 'utf8')) as GpuCheckResult;
    } catch {
      r = null;
    }
  }
  if (!r?.rows?.length) {
    L.push('_`scripts/gpu-check.sh` has not run yet._');
    return L;
  }
  L.push(
    r.backend === 'lavapipe'
      ? `Last run (${r.date}): **lavapipe**, Mesa's CPU-backed Vulkan device, tiny model, every layer offloaded — a functional check of the offload path (PD served through device memory on both roles), not a performance figure.`
      : `Last run (${r.date}): CUDA, ${r.gpus} GPU(s), every layer offloaded.`,
    '',
    '| prompt tokens | TTFT p50 colocated / PD (ms) | PD / colocated | ITL p50 colocated / PD (ms) | ITL p99 colocated / PD (ms) | E2E p50 colocated / PD (ms) |',
    '|---|---|---|---|---|---|',
  );
  for (const x of r.rows) L.push(`| ${x.promptTokens} | ${f(x.colo.ttftP50)} / ${f(x.pd.ttftP50)} | ${f(x.pd.ttftP50 / x.colo.ttftP50, 2)} | ${f(x.colo.itlP50, 2)} / ${f(x.pd.itlP50, 2)} | ${f(x.colo.itlP99, 2)} / ${f(x.pd.itlP99, 2)} | ${f(x.colo.e2eP50, 0)} / ${f(x.pd.e2eP50, 0)} |`);
  if (r.kv?.length) {
    L.push('', '| state (MiB) | KV handoff (ms) | raw TCP (ms) | TCP: KV / (save + raw + load) | same host: (save + handoff) / (save + load) |', '|---|---|---|---|---|');
    for (const k of r.kv) L.push(`| ${f(k.mib, 0)} | ${f(k.kvMs)} | ${f(k.rawMs)} | ${f(k.tcpGoalRatio, 2)} | ${f(k.sameHostGoalRatio, 2)} |`);
  }
  return L;
}

/**
 * Engine options of the KV benchmark's children from the environment scripts/gpu-check.sh sets:
 * PDSERVE_BENCH_GPU (cuda | vulkan; absent = CPU, as the suite always runs) and
 * PDSERVE_BENCH_GPU_DEVICE (a device list). Every layer is offloaded.
 * @throws RangeError on a value that is not a backend or a device list.
 */
export function benchGpuOptions(env: NodeJS.ProcessEnv = process.env): { gpu?: GpuBackend; gpuLayers?: 'max'; gpuDevices?: number[] } {
  const gpu = env.PDSERVE_BENCH_GPU;
  if (!gpu) return {};
  if (!(GPU_BACKENDS as readonly string[]).includes(gpu)) throw new RangeError(`PDSERVE_BENCH_GPU=${gpu}: not one of ${GPU_BACKENDS.join(', ')}`);
  return { gpu: gpu as GpuBackend, gpuLayers: 'max', ...(env.PDSERVE_BENCH_GPU_DEVICE ? { gpuDevices: parseDeviceList(env.PDSERVE_BENCH_GPU_DEVICE) } : {}) };
}
