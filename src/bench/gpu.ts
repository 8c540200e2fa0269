/**
 * The GPU part of BENCHMARKS.md (its prose and goal are the report template's, report.md): the
 * figures of `scripts/gpu-check.sh` (bench/results/gpu.json) when it has run — on CUDA or Vulkan,
 * or on lavapipe, whose figures are a functional check of the path and no performance claim.
 */
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { GPU_BACKENDS, parseDeviceList, type GpuBackend } from '../engine/gpu.js';

/** bench/results/gpu.json as scripts/gpu-check.sh writes it (ms). Fields after `kv` are absent from older runs. */
interface GpuCheckResult {
  date: string;
  backend: 'cuda' | 'vulkan' | 'lavapipe';
  gpus: number;
  rows: { promptTokens: number; colo: GpuRow; pd: GpuRow }[];
  /** §1's states, smallest first; the goal ratios when the run recorded them (TCP: KV / (save + raw + load); same host: (save + handoff) / (save + load)). */
  kv: { mib: number; kvMs?: number; rawMs?: number; tcpGoalRatio?: number; sameHostGoalRatio?: number }[] | null;
  /** `--smoke`: tiny model, two short prompts per length. */
  smoke?: boolean;
  /** The model file's name. */
  model?: string;
  /** What each engine got (colocated from /health, prefill and decode from the router's /workers); layers "offloaded/total". */
  engines?: { role: string; backend: string | null; devices: string[]; layers: string | null }[];
  /** The agents run (`pdserve bench-agents` on the GPU): per setup, TTFT of round 1 and of the last round (ms), cached share (0–1), goodput (rounds/s). */
  agents?: { setup: string; agents: number; ttftR1: number; ttftLast: number; rounds: number; cachedShare: number; goodput: number; failed: number }[] | null;
  /** What the run skipped and why. */
  notes?: string[];
}
interface GpuRow {
  ttftP50: number;
  itlP50: number;
  itlP99: number;
  e2eP50: number;
}

const f = (x: number | undefined, d = 1) => (typeof x === 'number' && Number.isFinite(x) ? x.toFixed(d) : '–');
const BACKEND_NAMES: Record<GpuCheckResult['backend'], string> = { cuda: 'CUDA', vulkan: 'Vulkan', lavapipe: 'lavapipe' };

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
  const devices = [...new Set((r.engines ?? []).flatMap((e) => e.devices))];
  const model = r.model ? `, model ${r.model}` : '';
  L.push(
    r.backend === 'lavapipe'
      ? `Last run (${r.date}): **lavapipe** (Mesa's CPU Vulkan)${model || ', tiny model'}, every layer offloaded: a functional check of the offload path, not a performance figure.`
      : `Last run (${r.date}): ${BACKEND_NAMES[r.backend] ?? r.backend}, ${r.gpus} GPU(s)${devices.length ? ` (${devices.join(', ')})` : ''}${model}, every layer offloaded.`,
  );
  if (r.smoke) L.push('', 'A `--smoke` run (tiny model, two short prompts per length): the path end to end, not a performance figure.');
  if (r.engines?.length) {
    L.push('', '| engine | backend | layers on the device |', '|---|---|---|');
    for (const e of r.engines) L.push(`| ${e.role} | ${e.backend ?? 'CPU'} | ${e.layers ?? '–'} |`);
  }
  L.push(
    '',
    '| prompt tokens | TTFT p50 colo / PD ms | PD / colo | ITL p50 colo / PD ms | ITL p99 colo / PD ms | E2E p50 colo / PD ms |',
    '|---|---|---|---|---|---|',
  );
  for (const x of r.rows) L.push(`| ${x.promptTokens} | ${f(x.colo.ttftP50)} / ${f(x.pd.ttftP50)} | ${f(x.pd.ttftP50 / x.colo.ttftP50, 2)} | ${f(x.colo.itlP50, 2)} / ${f(x.pd.itlP50, 2)} | ${f(x.colo.itlP99, 2)} / ${f(x.pd.itlP99, 2)} | ${f(x.colo.e2eP50, 0)} / ${f(x.pd.e2eP50, 0)} |`);
  if (r.kv?.length) {
    L.push('', '| state (MiB) | KV handoff (ms) | raw TCP (ms) | TCP: KV / (save + raw + load) | same host: (save + handoff) / (save + load) |', '|---|---|---|---|---|');
    for (const k of r.kv) L.push(`| ${f(k.mib, 0)} | ${f(k.kvMs)} | ${f(k.rawMs)} | ${f(k.tcpGoalRatio, 2)} | ${f(k.sameHostGoalRatio, 2)} |`);
  }
  if (r.agents?.length) {
    L.push('', '| agents run: setup | agents | TTFT round 1 (ms) | TTFT last round (ms) | cached (rounds 2+) | goodput (rounds/s) | failed |', '|---|---|---|---|---|---|---|');
    for (const a of r.agents) L.push(`| ${a.setup} | ${a.agents} | ${f(a.ttftR1, 0)} | ${f(a.ttftLast, 0)} | ${f(a.cachedShare * 100, 0)} % | ${f(a.goodput, 2)} | ${a.failed} |`);
  }
  if (r.notes?.length) L.push('', ...r.notes.map((n) => `- ${n}`));
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
