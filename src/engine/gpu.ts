/**
 * GPU offload settings of one engine process, as llama.cpp users know them: the backend
 * (`--gpu`), the layers offloaded (`--gpu-layers`, llama.cpp's -ngl), the devices this process
 * may use (`--gpu-device`) and the KV cache type (`--kv-cache-type`, llama.cpp's -ctk/-ctv).
 * Pure helpers (no node-llama-cpp call) except where named; llama.ts applies them.
 *
 * Device selection is by environment, read once when the backend initialises: Vulkan reads
 * GGML_VK_VISIBLE_DEVICES, CUDA reads CUDA_VISIBLE_DEVICES (indices in the driver's order).
 * llama.cpp's Vulkan backend skips CPU-type devices (Mesa's lavapipe) unless
 * GGML_VK_VISIBLE_DEVICES names them, so a software device is used only when asked for.
 */
import { ConfigError, PdError } from '../base/errors.js';

/** `--gpu`: 'auto' tries CUDA, then Vulkan (Metal on macOS), then falls back to the CPU. */
export const GPU_BACKENDS = ['auto', 'cuda', 'vulkan', 'metal', 'off'] as const;
export type GpuBackend = (typeof GPU_BACKENDS)[number];

/** `--gpu-layers`: 'auto' = as many as fit (node-llama-cpp's fit), 'max' = all, N = the first N. */
export type GpuLayers = 'auto' | 'max' | number;

/** `--kv-cache-type`: the K and V cache element type (quantized V needs flash attention). */
export const KV_CACHE_TYPES = ['f16', 'q8_0', 'q4_0'] as const;
export type KvCacheType = (typeof KV_CACHE_TYPES)[number];

/** What the engine asks for. */
export interface GpuOptions {
  backend: GpuBackend;
  layers: GpuLayers;
  /** Device indices this process may use; undefined = leave the environment as it is. */
  devices?: readonly number[];
}

/** What the engine got: shown in the start log, GET /health (`gpu`), GET /workers and /metrics. */
export interface GpuInfo {
  /** The `--gpu` value asked for. */
  requested: GpuBackend;
  /** The backend llama.cpp loaded; null = CPU only (no backend, or one that found no device). */
  backend: 'cuda' | 'vulkan' | 'metal' | null;
  /** Device names the backend sees (empty on CPU). */
  devices: string[];
  /** Layers whose weights live on the device (node-llama-cpp counts the output layer as one). */
  offloadedLayers: number;
  /** Layers of the model, same counting. */
  totalLayers: number;
  /** Device memory reported by the backend at load, bytes (0 on CPU). */
  vramTotalBytes: number;
}

/** The node-llama-cpp `getLlama({gpu})` value of a backend. */
export function llamaGpuOption(backend: GpuBackend): 'auto' | 'cuda' | 'vulkan' | 'metal' | false {
  return backend === 'off' ? false : backend;
}

/**
 * node-llama-cpp 3.21.1's name of a KV cache type: the `GgmlType` enum key ('Q8_0'). The
 * library resolves `experimentalKvCacheKeyType` by that key only; a lower-case 'q8_0' resolves
 * to nothing and silently leaves the cache at F16.
 */
export function ggmlTypeName(t: KvCacheType): 'F16' | 'Q8_0' | 'Q4_0' {
  return t.toUpperCase() as 'F16' | 'Q8_0' | 'Q4_0';
}

/**
 * Parse `--gpu-layers`: 'auto', 'max' (also 'all'), or a non-negative integer.
 * @throws RangeError on anything else.
 */
export function parseGpuLayers(v: string): GpuLayers {
  const s = v.trim().toLowerCase();
  if (s === 'auto' || s === 'max') return s;
  if (s === 'all') return 'max';
  if (/^\d+$/.test(s)) return Number(s);
  throw new RangeError(`not a layer count: ${v} (auto, max or a number)`);
}

/**
 * Parse `--gpu-device`: a comma-separated list of distinct device indices ("0", "0,1").
 * @throws RangeError on an empty list, a non-integer or a repeated index.
 */
export function parseDeviceList(v: string): number[] {
  const parts = v.split(',').map((x) => x.trim());
  if (parts.length === 0 || parts.some((p) => !/^\d+$/.test(p))) throw new RangeError(`not a device list: ${v} (e.g. 0 or 0,1)`);
  const list = parts.map(Number);
  if (new Set(list).size !== list.length) throw new RangeError(`a device appears twice: ${v}`);
  return list;
}

/** The environment variables that restrict a backend to `devices`. */
export function deviceEnvOf(backend: GpuBackend, devices: readonly number[]): Record<string, string> {
  const list = devices.join(',');
  if (backend === 'vulkan') return { GGML_VK_VISIBLE_DEVICES: list };
  if (backend === 'cuda') return { CUDA_VISIBLE_DEVICES: list };
  if (backend === 'auto') return { GGML_VK_VISIBLE_DEVICES: list, CUDA_VISIBLE_DEVICES: list };
  return {};
}

/** The device list applied to each environment object (the backend reads it once). */
const appliedDevices = new WeakMap<NodeJS.ProcessEnv, string>();

/**
 * Set the device variables in `env` (default: this process's) before the backend initialises.
 * A process has one device list (`undefined` = what the environment says): asking for another
 * after the first GPU engine is an error, because the backend read the variables once.
 * `--gpu off` uses no device and is not counted.
 * @throws Error when a different device list was applied before in this process.
 */
export function applyDeviceEnv(backend: GpuBackend, devices: readonly number[] | undefined, env: NodeJS.ProcessEnv = process.env): void {
  if (backend === 'off') return;
  const key = devices?.join(',') ?? 'the environment\'s';
  const before = appliedDevices.get(env);
  if (before !== undefined && before !== key) throw new ConfigError(`--gpu-device ${devices?.join(',') ?? '(none)'}: this process already uses ${before} devices (one device list per process)`);
  appliedDevices.set(env, key);
  if (devices) Object.assign(env, deviceEnvOf(backend, devices));
}

/** One human line: "vulkan [llvmpipe (…)], 3/3 layers offloaded, 2.0 GiB device memory" or "CPU only (…)". */
export function describeGpu(g: GpuInfo): string {
  if (g.backend === null || g.devices.length === 0) {
    const why = g.requested === 'off' ? '--gpu off' : g.backend ? `the ${g.backend} backend found no device` : 'no GPU backend could be loaded';
    return `CPU only (${why})`;
  }
  return `${g.backend} [${g.devices.join(', ')}], ${g.offloadedLayers}/${g.totalLayers} layers offloaded, ${mib(g.vramTotalBytes)} device memory${g.offloadedLayers === 0 ? ' (--gpu-layers 0: computing on the CPU)' : ''}`;
}

/** The `gpu` object of GET /health (snake_case, as the router's GET /workers shows it). */
export function gpuHealthOf(g: GpuInfo): { backend: string | null; devices: string[]; layers: number; total_layers: number } {
  return { backend: g.devices.length > 0 ? g.backend : null, devices: g.devices, layers: g.offloadedLayers, total_layers: g.totalLayers };
}

/**
 * A worker's GPU offload as the router's GET /workers and the doctor show it (`gpu`,
 * `gpu_devices`, `gpu_layers`), parsed back from the /health `gpu` object (`gpuHealthOf`).
 * Display only: pairing never looks at it (protocol/pair.ts).
 */
/** The GET /workers fields of one worker; nulls when the worker does not report them. */
export interface WorkerGpu {
  /** 'cuda' | 'vulkan' | 'metal', or null = CPU only. */
  gpu: string | null;
  gpu_devices: string[];
  /** Layers offloaded, e.g. "3/3"; null when unknown. */
  gpu_layers: string | null;
}

export const UNKNOWN_GPU: WorkerGpu = { gpu: null, gpu_devices: [], gpu_layers: null };

/** Parse the /health `gpu` object ({backend, devices, layers, total_layers}); null when absent or malformed. */
export function gpuFromHealth(v: unknown): WorkerGpu | null {
  const g = v as { backend?: unknown; devices?: unknown; layers?: unknown; total_layers?: unknown } | null;
  if (!g || typeof g !== 'object' || typeof g.layers !== 'number' || typeof g.total_layers !== 'number' || !Array.isArray(g.devices)) return null;
  return {
    gpu: typeof g.backend === 'string' ? g.backend.slice(0, 16) : null,
    gpu_devices: g.devices.filter((d): d is string => typeof d === 'string').slice(0, 16).map((d) => d.slice(0, 128)),
    gpu_layers: `${g.layers}/${g.total_layers}`,
  };
}

/** Bytes as "123.4 MiB". */
export function mib(bytes: number): string {
  return `${(bytes / 1048576).toFixed(1)} MiB`;
}

/** Inputs of `checkDeviceMemory` (bytes; sequences counted). */
export interface MemoryPlan {
  /** Device bytes the offloaded model weights take. */
  modelBytes: number;
  /** Device bytes of a context with `slots` sequences (KV + compute buffers). */
  slotsContextBytes: number;
  /** Extra device bytes per prefix-cache sequence. */
  perCacheSequenceBytes: number;
  slots: number;
  cacheSequences: number;
  /** Free device bytes before the model was loaded. */
  freeBytes: number;
  totalBytes: number;
  contextSize: number;
}

/**
 * Do the model and the contexts fit the device? Slots must fit: else an Error naming the sizes
 * and the flags to change. Prefix-cache sequences are optional: as many as fit are kept.
 * @returns the prefix-cache sequences that fit (≤ plan.cacheSequences).
 * @throws Error (code 'GPU_MEMORY') when model + slots exceed the free device memory.
 */
export function checkDeviceMemory(p: MemoryPlan): number {
  const need = p.modelBytes + p.slotsContextBytes;
  if (need > p.freeBytes) {
    throw new PdError(
      'GPU_MEMORY',
      `not enough device memory: model ${mib(p.modelBytes)} + context ${mib(p.slotsContextBytes)} (${p.slots} slots × ${p.contextSize} tokens) = ${mib(need)}, ` +
        `device has ${mib(p.freeBytes)} free of ${mib(p.totalBytes)}: lower --gpu-layers, --ctx-size or --slots (or --gpu off)`,
    );
  }
  if (p.cacheSequences === 0 || p.perCacheSequenceBytes <= 0) return p.cacheSequences;
  return Math.min(p.cacheSequences, Math.floor((p.freeBytes - need) / p.perCacheSequenceBytes));
}
