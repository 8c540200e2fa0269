/**
 * Where a request's CPU time goes, per pdserve process and phase: V8 CPU profiles
 * (`node --cpu-prof`, one `.cpuprofile` per JS thread, written when the process exits) bucketed
 * by the source file of each sample's function, plus the threads V8 does not see (llama.cpp's
 * compute, libuv, GC helpers) from /proc/<pid>/task/<tid>/stat.
 *
 * | phase | what falls into it |
 * |---|---|
 * | http | node's http/net/streams, fastify, undici, SSE framing (src/api/sse.ts) |
 * | json | JSON.parse / JSON.stringify, zod, request field parsing (src/api/parse, fields, requests) |
 * | tokenize | the tokenizer thread and node-llama-cpp's tokenizer |
 * | render | chat rendering (src/engine/prompt.ts, tools.ts; node-llama-cpp chat wrappers, LlamaText) |
 * | engine | node-llama-cpp's evaluation and src/engine's driving code (JS side), sampling |
 * | save/load | sequence state save/restore: src/engine/prefix-*, src/prefixes/ |
 * | transfer | the KV channel and transfer (src/kv/) |
 * | pdserve | the roles' own logic (router, workers, decode/prefill drivers, admission) |
 * | gc | V8's garbage collector on the JS thread |
 * | program | V8's `(program)`: native work on the JS thread outside any JS frame |
 * | other | what matches nothing above (module loading included) |
 * | native threads | CPU of every thread but the JS threads: llama.cpp's compute (the engine proper) |
 * | waiting | JS thread idle (wall time, not CPU) |
 *
 * A function with no file of its own (a builtin such as `writev`, or node's internals other than
 * http/net/streams) takes its caller's phase, so a builtin is charged to the phase that called it.
 */
import { readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';

export const PHASES = ['http', 'json', 'tokenize', 'render', 'engine', 'save/load', 'transfer', 'pdserve', 'gc', 'program', 'other'] as const;
export type Phase = (typeof PHASES)[number];

interface CpuProfileNode {
  id: number;
  callFrame: { functionName: string; url: string };
  children?: number[];
}
/** The JSON of a `.cpuprofile` file (the fields used here). */
export interface CpuProfile {
  nodes: CpuProfileNode[];
  samples: number[];
  timeDeltas: number[];
  startTime: number;
  endTime: number;
}

const RULES: [RegExp, Phase][] = [
  [/\/src\/engine\/(tokenizer-|token-text)|node-llama-cpp\/dist\/evaluator\/LlamaModel\/.*[Tt]okeni|node-llama-cpp\/dist\/utils\/(tokenize|StopGenerationDetector)/, 'tokenize'],
  [/\/src\/engine\/(prompt|tools)\.|node-llama-cpp\/dist\/(chatWrappers|utils\/LlamaText|evaluator\/LlamaChat)/, 'render'],
  [/\/src\/(engine\/prefix-|prefixes\/)/, 'save/load'],
  [/\/src\/kv\//, 'transfer'],
  [/node-llama-cpp\/|\/src\/engine\//, 'engine'],
  [/\/src\/api\/(sse|plain-http|body-watch)\.|node:_http|node:http|node:net|node:internal\/(streams|stream_base|http|net|dns)|node:stream|\/(fastify|find-my-way|light-my-request|avvio|undici|@fastify)\//, 'http'],
  [/\/(zod|fast-json-stringify|secure-json-parse|ajv|fast-uri)\/|\/src\/api\/(parse|fields|requests|json-schema|responses-fields)\./, 'json'],
  [/\/src\/(api|router|worker|decode|prefill|colocated|runtime|protocol|security|membership|base|config|observe)\/|\/(pino|prom-client|sonic-boom|thread-stream)\//, 'pdserve'],
];

/** The phase of one profile frame; undefined = no file of its own (takes its caller's phase). */
export function phaseOfFrame(functionName: string, url: string): Phase | 'idle' | undefined {
  if (functionName === '(idle)') return 'idle';
  if (functionName === '(garbage collector)') return 'gc';
  if (functionName === '(program)') return 'program';
  if (functionName === '(root)') return 'other';
  if (url === '' && /^(parse|stringify)$/.test(functionName)) return 'json';
  for (const [re, ph] of RULES) if (re.test(url)) return ph;
  if (url === '' || url.startsWith('node:')) return undefined;
  return 'other';
}

/**
 * Self time of one profile by phase, ms (a builtin charged to its caller's phase) and the JS
 * thread's idle time; only samples inside `window` (µs on the profile's clock, CLOCK_MONOTONIC
 * like `process.hrtime`) when given.
 */
export function bucketProfile(p: CpuProfile, window?: { fromUs: number; toUs: number }): { phases: Record<Phase, number>; idleMs: number; wallMs: number } {
  const byId = new Map(p.nodes.map((n) => [n.id, n]));
  const phaseOf = new Map<number, Phase | 'idle'>();
  const root = p.nodes[0];
  // walk from the root, each node inheriting its caller's phase when it has none of its own
  const stack: [number, Phase | 'idle'][] = root ? [[root.id, 'other']] : [];
  while (stack.length) {
    const [id, inherited] = stack.pop()!;
    const n = byId.get(id);
    if (!n) continue;
    const ph = phaseOfFrame(n.callFrame.functionName, n.callFrame.url) ?? inherited;
    phaseOf.set(id, ph);
    for (const c of n.children ?? []) stack.push([c, ph === 'idle' ? 'other' : ph]);
  }
  const phases = Object.fromEntries(PHASES.map((x) => [x, 0])) as Record<Phase, number>;
  let idle = 0;
  let at = p.startTime;
  for (let i = 0; i < p.samples.length; i++) {
    at += p.timeDeltas[i] ?? 0;
    if (window && (at < window.fromUs || at > window.toUs)) continue;
    const dt = (p.timeDeltas[i] ?? 0) / 1000;
    const ph = phaseOf.get(p.samples[i]!) ?? 'other';
    if (ph === 'idle') idle += dt;
    else phases[ph] += dt;
  }
  const from = window ? Math.max(window.fromUs, p.startTime) : p.startTime;
  const to = window ? Math.min(window.toUs, p.endTime) : p.endTime;
  return { phases, idleMs: idle, wallMs: Math.max(0, to - from) / 1000 };
}

/** CPU seconds of each thread of `pid` now (tid → s), from /proc; empty when unknown. */
export function threadCpuSeconds(pid: number | undefined): Map<number, number> {
  const out = new Map<number, number>();
  if (pid === undefined) return out;
  try {
    for (const t of readdirSync(`/proc/${pid}/task`)) {
      try {
        const s = readFileSync(`/proc/${pid}/task/${t}/stat`, 'utf8');
        const f = s.slice(s.lastIndexOf(')') + 2).split(' ');
        out.set(Number(t), (Number(f[11]) + Number(f[12])) / 100);
      } catch {
        /* thread gone */
      }
    }
  } catch {
    /* process gone or no /proc */
  }
  return out;
}

/** One process's profile, per request. */
export interface ProcessPhases {
  name: string;
  /** CPU ms per request from /proc over the run (all threads). */
  cpuMs: number;
  /** JS threads' self time per request by phase, ms. */
  phases: Record<Phase, number>;
  /** CPU ms per request of the threads V8 does not profile (total − JS threads' non-idle samples). */
  nativeMs: number;
  /** JS threads' idle (waiting) wall ms per request. */
  waitingMs: number;
  /** `.cpuprofile` files read (one per JS thread). */
  profiles: number;
}

/** Section 8's profile: per system, its processes' phases per request, and llama-server's CPU per request (the floor). */
export interface PhaseProfileResult {
  sessions: number;
  rounds: number;
  systems: { system: string; requests: number; wallS: number; processes: ProcessPhases[] }[];
  /** llama-server's CPU ms per request on the same workload: the engine's own cost, the floor. */
  floorMs: number;
}

/**
 * Phases per request of one process from the `.cpuprofile` files of `pid` in `dir` (node names
 * them `CPU.<date>.<time>.<pid>.<tid>.<seq>.cpuprofile`), samples inside `window` only, given its
 * CPU seconds over the same window.
 */
export function processPhases(name: string, dir: string, pid: number, cpuS: number, requests: number, window?: { fromUs: number; toUs: number }): ProcessPhases {
  const files = readdirSync(dir).filter((f) => f.endsWith('.cpuprofile') && f.split('.')[3] === String(pid));
  const phases = Object.fromEntries(PHASES.map((x) => [x, 0])) as Record<Phase, number>;
  let idle = 0;
  for (const f of files) {
    const b = bucketProfile(JSON.parse(readFileSync(join(dir, f), 'utf8')) as CpuProfile, window);
    for (const ph of PHASES) phases[ph] += b.phases[ph];
    idle += b.idleMs;
  }
  const js = PHASES.reduce((a, ph) => a + phases[ph], 0);
  const per = (x: number) => (requests > 0 ? x / requests : NaN);
  return { name, cpuMs: per(cpuS * 1000), phases: Object.fromEntries(PHASES.map((ph) => [ph, per(phases[ph])])) as Record<Phase, number>, nativeMs: per(Math.max(0, cpuS * 1000 - js)), waitingMs: per(idle), profiles: files.length };
}

const f0 = (x: number) => (Number.isFinite(x) ? x.toFixed(x < 10 ? 1 : 0) : 'n/a');

/**
 * Markdown lines of the profile table (`prov` the provenance line): one row per system with its
 * CPU ms per request against the floor (llama-server's on the same workload), each process's
 * share, and the whole system's JS phases and native-thread time; a phase no process spent 0.1 ms
 * per request on gets no column (its name is listed instead).
 */
export function phaseReport(r: PhaseProfileResult | undefined, prov: string): string[] {
  const L = [prov, ''];
  if (!r?.systems?.length) return [...L, '_Not run yet._'];
  const shown = PHASES.filter((ph) => r.systems.some((s) => s.processes.some((p) => f0(p.phases[ph]) !== '0.0')));
  const none = PHASES.filter((ph) => !shown.includes(ph));
  L.push(`${r.sessions} agent sessions × ${r.rounds} rounds per system; CPU ms per request: JS phases by \`--cpu-prof\` self time; native threads: /proc CPU minus JS samples (llama.cpp, libuv, GC helpers)${none.length ? `; 0 everywhere: ${none.join(', ')}` : ''}. Floor: llama-server's CPU per request, **${f0(r.floorMs)} ms**.`, '');
  const head = ['system', 'CPU ms/req', 'by process', ...shown, 'native threads'];
  L.push(`| ${head.join(' | ')} |`, `|---|${head.slice(1).map((h) => (h === 'by process' ? '---' : '---:')).join('|')}|`);
  for (const s of r.systems) {
    const sum = (f: (p: ProcessPhases) => number) => s.processes.reduce((a, p) => a + f(p), 0);
    const total = sum((p) => p.cpuMs);
    L.push(`| ${s.system} | **${f0(total)}** (${f0(total / r.floorMs)}× floor) | ${s.processes.map((p) => `${p.name} ${f0(p.cpuMs)}`).join(', ')} | ${shown.map((ph) => f0(sum((p) => p.phases[ph]))).join(' | ')} | ${f0(sum((p) => p.nativeMs))} |`);
  }
  return L;
}
