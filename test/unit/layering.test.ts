/**
 * The layers of src/ (docs/ARCHITECTURE.md "Layers"): each top folder belongs to one layer, and a
 * file imports only its own folder or folders of lower layers. Every import form counts — static
 * `import`/`export … from`, `import type`, `import()` expressions and `import('…').T` type
 * queries — and no two files import each other, directly or round a loop.
 */
import assert from 'node:assert/strict';
import { readdirSync, readFileSync, statSync } from 'node:fs';
import { dirname, join, relative, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { describe, test } from 'node:test';

const SRC = resolve(dirname(fileURLToPath(import.meta.url)), '../../src');

/** Bottom to top. Folders of one layer never import each other. */
const LAYERS: readonly (readonly string[])[] = [
  ['base'], // errors, room ids, clock, log: imports nothing of src
  ['engine', 'kv'], // llama.cpp; the room lifecycle, KV channel and transfer
  ['protocol'], // what crosses HTTP between the roles and the tools
  ['security'], // signed worker calls, TLS, the cluster secret
  ['runtime'], // metrics, drain, send queues
  ['config', 'prefixes'], // the configuration schemas; the host prefix store
  ['api', 'observe'], // the OpenAI edge; gather + diagnose (doctor and dashboard)
  ['membership'], // etcd: worker records and leases, the router's watch (over a pool it is handed), doctor's reader
  ['worker'], // the HTTP edge both worker roles share
  ['router', 'prefill', 'decode', 'colocated'], // the roles
  ['switch', 'planner'], // a worker hosting either role (role switch); the planner that flips roles
  ['up'], // the local cluster, the tools' launcher
  ['bench', 'storm', 'doctor', 'sim'], // the tools
  ['cli'], // the `pdserve` command
];
const LAYER = new Map(LAYERS.flatMap((folders, i) => folders.map((f) => [f, i] as const)));

function files(dir: string): string[] {
  return readdirSync(dir).flatMap((n) => {
    const p = join(dir, n);
    return statSync(p).isDirectory() ? files(p) : p.endsWith('.ts') ? [p] : [];
  });
}
const SPEC = /(?:\bfrom\s+|\bimport\s*\(\s*|^\s*import\s+)['"](\.{1,2}\/[^'"]+)['"]/gm;
const GRAPH = new Map(
  files(SRC).map((p) => {
    const from = relative(SRC, p);
    const deps = [...readFileSync(p, 'utf8').matchAll(SPEC)].map((m) => relative(SRC, resolve(dirname(p), m[1]!)).replace(/\.js$/, '.ts'));
    return [from, [...new Set(deps)]] as const;
  }),
);
const top = (p: string) => (p.includes('/') ? p.split('/')[0]! : '.');

describe('layering', () => {
  test('every folder of src/ belongs to a layer', () => {
    assert.deepEqual([...new Set([...GRAPH.keys()].map(top))].filter((f) => !LAYER.has(f)), []);
  });

  test('a file imports only its own folder or lower layers (import() and import type included)', () => {
    const bad: string[] = [];
    for (const [from, deps] of GRAPH) {
      for (const to of deps) {
        if (to.startsWith('..')) bad.push(`${from} → ${to} (outside src)`);
        else if (top(from) !== top(to) && !(LAYER.get(top(to))! < LAYER.get(top(from))!)) bad.push(`${from} → ${to}`);
      }
    }
    assert.deepEqual(bad, []);
  });

  test('every import names a file that exists', () => {
    const missing = [...GRAPH].flatMap(([from, deps]) => deps.filter((d) => !GRAPH.has(d)).map((d) => `${from} → ${d}`));
    assert.deepEqual(missing, []);
  });

  test('no import cycles between files', () => {
    // Tarjan's strongly connected components over the file graph.
    const index = new Map<string, number>();
    const low = new Map<string, number>();
    const stack: string[] = [];
    const on = new Set<string>();
    const loops: string[][] = [];
    let n = 0;
    const visit = (v: string): void => {
      index.set(v, n);
      low.set(v, n++);
      stack.push(v);
      on.add(v);
      for (const w of GRAPH.get(v) ?? []) {
        if (!GRAPH.has(w)) continue;
        if (!index.has(w)) {
          visit(w);
          low.set(v, Math.min(low.get(v)!, low.get(w)!));
        } else if (on.has(w)) low.set(v, Math.min(low.get(v)!, index.get(w)!));
      }
      if (low.get(v) === index.get(v)) {
        const c: string[] = [];
        let w: string;
        do {
          w = stack.pop()!;
          on.delete(w);
          c.push(w);
        } while (w !== v);
        if (c.length > 1) loops.push(c.sort());
      }
    };
    for (const v of GRAPH.keys()) if (!index.has(v)) visit(v);
    assert.deepEqual(loops, []);
  });
});
