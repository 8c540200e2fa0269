/**
 * The engine's share of a PD request's token-1 → token-2 gap, without processes, sockets or
 * HTTP. Bench-only.
 *
 *   node --import tsx scripts/pd-gap-engine.ts [reps=4] [prompt words=580] [decode sequences=10] [kv cache type=f16] [validate=headers|buffer]
 *
 * Two engines on the generated small GGUF, 1 thread each, in one process: a "prefill" one (1
 * sequence) and a "decode" one (`decode sequences`, as §2's decode worker). Both run one short
 * generation first, untimed: a context's first llama_decode does one-off work (≈ 30 ms of CPU
 * on the small model) that no later request pays. Per rep, a prompt of about `prompt words`
 * words (≈ 1500 tokens at 580; each rep its own, no prefix reused) is evaluated on prefill; then,
 * timed: the state save to /dev/shm (what prefill does after token 1), the colocated
 * continuation on the prefill sequence (its token 1 → 2 is one decode step), the state load into
 * a decode sequence and the decode continuation, a second generate() on the same decode sequence
 * with no load before it ("again"), and a third after the same state was loaded into another
 * decode sequence ("after a load into another sequence").
 *
 * Before each load the file is validated untimed, as decode does: `headers` (default) walks its
 * structure with positional reads of the headers only (the same-host receiver's
 * `parseStateHeaders`); `buffer` reads the whole state into a JavaScript Buffer and parses it:
 * those tens of MiB of external memory start a V8 garbage collection whose helper threads then
 * take the core from the next decode steps.
 *
 * Every timed phase is reported as wall ms and, on Linux, as the on-CPU ms of the thread that
 * did the work and how long that thread waited for a core (/proc/self/task/<tid>/schedstat),
 * plus the CPU ms of every other thread of the process (V8's main and helper threads: JS and
 * garbage collection). On-CPU time does not depend on what else runs on the machine; the wait
 * does. A line per rep (steps: the first entry is token 1, which needs no step), then medians.
 */
import { closeSync, fstatSync, openSync, readdirSync, readFileSync, readSync, rmSync } from 'node:fs';
import { homedir } from 'node:os';
import { join } from 'node:path';
import { loadEngine, parseStateFile, parseStateHeaders, type ParsedState } from '../src/engine/index.js';
import type { Engine, SamplingParams } from '../src/engine/types.js';
import type { KvCacheType } from '../src/engine/gpu.js';

const reps = Number(process.argv[2] ?? 4);
const promptWords = Number(process.argv[3] ?? 580);
const decodeSequences = Number(process.argv[4] ?? 10);
const kvCacheType = (process.argv[5] ?? 'f16') as KvCacheType;
const validate = process.argv[6] ?? 'headers';
if (validate !== 'headers' && validate !== 'buffer') throw new Error(`validate must be headers or buffer, not ${validate}`);
const modelPath = join(homedir(), '.cache/pdserve/pdserve-small-s1-g2.gguf');
const common = { modelPath, threads: 1, contextSize: 2048, batchSize: 512, kvCacheType };
const P = await loadEngine({ ...common, sequences: 1 });
const D = await loadEngine({ ...common, sequences: decodeSequences });
const sampling = { temperature: 0, maxTokens: 6, ignoreEos: true, stop: [] } as unknown as SamplingParams;
const words = 'the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly bears near old mills'.split(' ');

// ------------------------------------------------------------------ per-thread CPU (Linux)

type Sched = Map<string, [cpuNs: number, waitNs: number]>;
const hasSched = (() => {
  try {
    readFileSync('/proc/self/schedstat', 'utf8');
    return true;
  } catch {
    return false;
  }
})();
function sched(): Sched {
  const m: Sched = new Map();
  if (!hasSched) return m;
  for (const t of readdirSync('/proc/self/task')) {
    try {
      const [a, b] = readFileSync(`/proc/self/task/${t}/schedstat`, 'utf8').split(' ');
      m.set(t, [Number(a), Number(b)]);
    } catch {
      /* the thread ended */
    }
  }
  return m;
}
/** One timed phase: wall ms; the busiest thread's on-CPU and run-queue wait ms; all other threads' CPU ms. */
interface Phase {
  wall: number;
  cpu: number;
  wait: number;
  others: number;
}
function phase(t0: number, s0: Sched): Phase {
  const wall = performance.now() - t0;
  const s1 = sched();
  let best: [number, number] = [0, 0];
  let total = 0;
  for (const [t, [c, w]] of s1) {
    const [c0, w0] = s0.get(t) ?? [0, 0];
    const dc = (c - c0) / 1e6;
    total += dc;
    if (dc > best[0]) best = [dc, (w - w0) / 1e6];
  }
  return { wall, cpu: best[0], wait: best[1], others: total - best[0] };
}
async function timed<T>(fn: () => Promise<T>): Promise<[T, Phase]> {
  const s0 = sched();
  const t0 = performance.now();
  const r = await fn();
  return [r, phase(t0, s0)];
}
/** Per step of one generate() run (the first entry is token 1's, which needs no step). */
async function steps(gen: AsyncGenerator<unknown, unknown>): Promise<Phase[]> {
  const out: Phase[] = [];
  let s0 = sched();
  let t0 = performance.now();
  for await (const _ of gen) {
    out.push(phase(t0, s0));
    s0 = sched();
    t0 = performance.now();
  }
  return out;
}

function fmt(p: Phase): string {
  return hasSched ? `${p.wall.toFixed(0)} (cpu ${p.cpu.toFixed(1)}, wait ${p.wait.toFixed(0)}, others ${p.others.toFixed(0)})` : p.wall.toFixed(0);
}
function fmtSteps(ps: Phase[]): string {
  return ps.map((p) => (hasSched ? `${p.wall.toFixed(0)}/${p.cpu.toFixed(1)}` : p.wall.toFixed(0))).join(' ');
}

// ------------------------------------------------------------------ validation before a load

function validated(path: string, engine: Engine): ParsedState {
  const expect = { contextSize: engine.info.compat.contextSize, nLayer: engine.info.compat.nLayer, nVocab: engine.info.nVocab };
  if (validate === 'buffer') {
    const buf = readFileSync(path);
    return parseStateFile(buf, { ...expect, maxBytes: buf.length });
  }
  const fd = openSync(path, 'r');
  try {
    const size = fstatSync(fd).size;
    return parseStateHeaders({ size, read: (pos, n) => {
      const b = Buffer.allocUnsafe(n);
      return b.subarray(0, readSync(fd, b, 0, n, pos));
    } }, expect);
  } finally {
    closeSync(fd);
  }
}

const rows: Record<'save' | 'load' | 'colocated' | 'decode' | 'again' | 'cross' | 'steady', Phase[]> = { save: [], load: [], colocated: [], decode: [], again: [], cross: [], steady: [] };
try {
  // warm-up: each context's first llama_decode, untimed
  for (const E of [P, D]) {
    const s = E.tryAcquireSlot()!;
    try {
      const r = await s.prefill(E.tokenize('warm up the context', true), sampling, new AbortController().signal);
      for await (const _ of s.generate(r.firstToken, { ...sampling, maxTokens: 3 }, new AbortController().signal));
    } finally {
      s.release();
    }
  }
  for (let k = 0; k < reps; k++) {
    const text = `${Array.from({ length: promptWords }, (_, i) => words[(i * 7 + k * 3 + (i >> 5)) % words.length]).join(' ')} ${k}`;
    const toks = P.tokenize(text, true);
    const path = `/dev/shm/pdserve-gap-engine-${process.pid}-${k}.ggsq`;
    const ps = P.tryAcquireSlot()!;
    const ds = D.tryAcquireSlot()!;
    try {
      const r = await ps.prefill(toks, sampling, new AbortController().signal);
      const [bytes, save] = await timed(() => ps.saveState(path));
      const colo = await steps(ps.generate(r.firstToken, sampling, new AbortController().signal));
      const parsed = validated(path, D);
      const [, load] = await timed(() => ds.loadState(path, toks, parsed));
      const pd = await steps(ds.generate(r.firstToken, sampling, new AbortController().signal));
      const again = await steps(ds.generate(r.firstToken, sampling, new AbortController().signal));
      // The same state into another decode sequence, then a generate() on the first one again:
      // is a load's cost for the next step the loaded sequence's, or the whole context's?
      const ds2 = D.tryAcquireSlot()!;
      let cross: Phase[] = [];
      try {
        await ds2.loadState(path, toks, validated(path, D));
        cross = await steps(ds.generate(r.firstToken, sampling, new AbortController().signal));
      } finally {
        ds2.release();
      }
      rows.save.push(save);
      rows.load.push(load);
      for (const [key, run] of [['colocated', colo], ['decode', pd], ['again', again], ['cross', cross]] as const) {
        if (run[1]) rows[key].push(run[1]);
        rows.steady.push(...run.slice(2));
      }
      console.log(
        `rep ${k}: ${toks.length} tokens, state ${(bytes / 2 ** 20).toFixed(1)} MiB (${kvCacheType}); save ${fmt(save)}; load ${fmt(load)}; ` +
          `steps wall/cpu ms: colocated ${fmtSteps(colo)}; decode ${fmtSteps(pd)}; again ${fmtSteps(again)}; after a load into another sequence ${fmtSteps(cross)}`,
      );
    } finally {
      ps.release();
      ds.release();
      rmSync(path, { force: true });
    }
  }
  const med = (xs: number[]): number => {
    const s = [...xs].sort((a, b) => a - b);
    return s.length ? (s.length % 2 ? s[(s.length - 1) / 2]! : (s[s.length / 2 - 1]! + s[s.length / 2]!) / 2) : NaN;
  };
  console.log(`\nmedians over ${reps} reps (validate: ${validate}), ms: wall | on-CPU of the working thread | its wait for a core | other threads' CPU`);
  const names: Record<keyof typeof rows, string> = {
    save: 'state save',
    load: 'state load',
    colocated: 'first step, colocated (after the prompt)',
    decode: 'first step on the sequence just loaded',
    again: 'first step of a generate() again, no load',
    cross: 'first step after a load into another sequence',
    steady: 'every later step',
  };
  for (const key of Object.keys(rows) as (keyof typeof rows)[]) {
    const ps = rows[key];
    console.log(`  ${names[key].padEnd(48)} n=${String(ps.length).padStart(3)}  ${med(ps.map((p) => p.wall)).toFixed(1).padStart(6)} | ${med(ps.map((p) => p.cpu)).toFixed(1).padStart(6)} | ${med(ps.map((p) => p.wait)).toFixed(1).padStart(6)} | ${med(ps.map((p) => p.others)).toFixed(1).padStart(6)}`);
  }
  if (hasSched) {
    const floor = med(rows.save.map((p) => p.cpu)) + med(rows.load.map((p) => p.cpu)) + med(rows.decode.map((p) => p.cpu));
    const itl = med(rows.steady.map((p) => p.cpu));
    console.log(`  save + load + first step, on-CPU: ${floor.toFixed(1)} ms = ${(floor / itl).toFixed(2)} × a steady step's ${itl.toFixed(1)} ms`);
  }
} finally {
  await P.dispose();
  await D.dispose();
}
