/** One worker as the router's registry holds it (./registry.ts), read by pairing and the policies. */
import type { WorkerGpu } from '../engine/gpu.js';
import type { ToolCallSyntax } from '../engine/types.js';
import type { PairSettings } from '../kv/messages.js';

export type WorkerRole = 'prefill' | 'decode';

/** One worker as the router sees it. Mutated only by the registry. */
export interface WorkerState {
  readonly role: WorkerRole;
  /** Origin, e.g. http://127.0.0.1:30000 — also the worker's id. */
  readonly url: string;
  /** Prefill only: the KV bootstrap address handed to decode. */
  readonly bootstrapHost: string | null;
  readonly bootstrapPort: number | null;
  healthy: boolean;
  /** A probe found it healthy at least once since it joined the pool: when unhealthy now, it is down or restarting, not misconfigured. */
  servedOnce?: boolean;
  /** Shutting down gracefully: finishes what it has, takes nothing new. */
  draining: boolean;
  /** Alive but unfit for new work (/health `status: 'degraded'`: e.g. `state_dir_full: …`): never picked; null or absent when fine. */
  degraded?: string | null;
  model: string | null;
  /** All names the worker serves (/health `served_model_names`; its `model` when absent). */
  servedNames?: string[];
  /** Prefill: the model's tool-call syntax (/health `tool_call_syntax`; null/absent = no tool calls). */
  toolSyntax?: ToolCallSyntax | null;
  /** In-flight requests routed to this worker by this router. */
  load: number;
  lastError: string | null;
  /** Wall-clock ms of the last completed probe, shown as a date (0 = never); never a duration. */
  lastCheckAt: number;
  consecutiveFailures: number;
  /** The settings the worker must share with its pair (from /health), null when not reported. */
  settings: PairSettings | null;
  /** GPU offload (from /health `gpu`; display, and decode batch packing on CPU hosts: policy/pack.ts). */
  gpu?: WorkerGpu;
  /** Why the worker counts as frozen (a request's stream went silent on it: ./dispatch.ts), until a probe finds it healthy; absent = not frozen. */
  frozen?: string | null;
  /** The worker's epoch (/health `epoch`): a new one after a restart or a role switch; null/absent before a probe. */
  epoch?: string | null;
  /** It can switch role in place (/health `role_switch`): the router sends it the epoch it picked it under (a switched worker refuses the leg with `stale_epoch`). */
  switchable?: boolean;
  /** Why it is out of the pool for a role switch the router runs (./role-switch.ts); null/absent when not switching. Kept draining while set. */
  switching?: string | null;
  /** Sequence slots (from /health `slots`; undefined when not reported). */
  slots?: number;
}
