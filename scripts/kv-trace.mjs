#!/usr/bin/env node
/**
 * Medians of the §1 KV trials' step stamps. Bench-only; every figure in ms.
 *
 *   PDSERVE_BENCH_KV_TRACE=/tmp/kv.trace node bin/pdserve.js bench-suite --sections 1
 *   node scripts/kv-trace.mjs /tmp/kv.trace
 *
 * Input: lines "<CLOCK_MONOTONIC ms> <role> <step> [k=v …]" written by src/bench/kv-child.ts
 * (both processes append to one file). A trial starts at a `save-start` step (which carries
 * `bytes=<state size>`) and runs to the next one; per state size, prints the median and minimum of
 * each step-to-step span over the trials that have both stamps (only steps bench-kv-child.ts records).
 */
import { readFileSync } from 'node:fs';

const file = process.argv[2];
if (!file) {
  console.error('usage: node scripts/kv-trace.mjs <trace file>');
  process.exit(2);
}

const events = readFileSync(file, 'utf8')
  .split('\n')
  .filter((l) => l.trim() !== '')
  .map((line) => {
    const [t, role, ...rest] = line.split(' ');
    return { t: Number(t), role, what: rest.join(' ') };
  })
  .sort((a, b) => a.t - b.t);

/** Events grouped into trials, each starting at its save-start. */
const trials = [];
let cur;
for (const e of events) {
  if (e.what.startsWith('save-start')) {
    cur = [e];
    trials.push(cur);
  } else if (cur) cur.push(e);
}

/** Steps stamped once per piece (chunk frames received, pieces pushed into the receiver, pieces flushed on prefill). */
const REPEATED = new Set(['chunk', 'pushed', 'flushed']);

/** state bytes → per-trial maps of step name → first stamp (chunk/pushed/flushed: head, first payload, last). */
const bySize = new Map();
for (const trial of trials) {
  const bytes = Number(trial[0].what.split('bytes=')[1]);
  const d = {};
  for (const x of trial) {
    const k = x.what.split(' ')[0];
    if (REPEATED.has(k)) {
      // one stamp per piece: keep the first (the envelope head's), the second (the first payload piece's) and the last
      const n = (d[`n${k}`] ?? 0) + 1;
      d[`n${k}`] = n;
      if (n === 1) d[`${k}-head`] = x.t;
      if (n === 2) d[`${k}-payload0`] = x.t;
      d[`${k}-last`] = x.t;
    } else if (!(k in d)) d[k] = x.t;
  }
  if (!bySize.has(bytes)) bySize.set(bytes, []);
  bySize.get(bytes).push(d);
}

const SPANS = [
  ['save', 'save-start', 'save-resolved'],
  ['resolved->awaited', 'save-resolved', 'saved-awaited'],
  ['head prepared (during save)', 'save-start', 'head-prepared'],
  ['head encode', 'saved-awaited', 'head-encoded'],
  ['kv_begin encode+write', 'head-encoded', 'kv_begin-sent'],
  ['kv_begin sent->1st piece flushed', 'kv_begin-sent', 'flushed-payload0'],
  ['send (kv_begin->resolved)', 'kv_begin-sent', 'send-resolved'],
  ['kv_end send', 'send-resolved', 'kv_end-sent'],
  ['kv_begin lag', 'kv_begin-sent', 'kv_begin-recv'],
  ['rx made', 'kv_begin-recv', 'rx-made'],
  ['head chunk arrives (from kv_begin-recv)', 'kv_begin-recv', 'chunk-head'],
  ['head push (accept, open file)', 'chunk-head', 'pushed-head'],
  ['head pushed->1st payload chunk', 'pushed-head', 'chunk-payload0'],
  ['1st payload push', 'chunk-payload0', 'pushed-payload0'],
  ['kv_begin-recv->1st payload pushed', 'kv_begin-recv', 'pushed-payload0'],
  ['kv_begin-sent->1st payload pushed', 'kv_begin-sent', 'pushed-payload0'],
  ['save-start->1st payload on decode', 'save-start', 'chunk-payload0'],
  ['saved->1st payload on decode', 'save-resolved', 'chunk-payload0'],
  ['wire (kv_begin-recv->last chunk)', 'kv_begin-recv', 'chunk-last'],
  ['last chunk pushed', 'chunk-last', 'pushed-last'],
  ['last pushed->kv_end', 'pushed-last', 'kv_end-recv'],
  ['kv_end lag', 'kv_end-sent', 'kv_end-recv'],
  ['kv_end->finish', 'kv_end-recv', 'finish-start'],
  ['finish', 'finish-start', 'finished'],
  ['loadState', 'finished', 'loaded'],
  ['TOTAL', 'save-start', 'loaded'],
];

/** Median as Python's statistics.median: the mean of the two middle values for an even count. */
function median(v) {
  const s = [...v].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}
const f3 = (x) => x.toFixed(3).padStart(8);
const line = (name, v) => console.log(`  ${name.padEnd(42)} med ${f3(median(v))}  min ${f3(Math.min(...v))}`);

for (const bytes of [...bySize.keys()].sort((a, b) => a - b)) {
  const ts = bySize.get(bytes);
  console.log(`== ${bytes} bytes, n=${ts.length}, chunks=${median(ts.map((t) => t.nchunk ?? 0))}`);
  for (const [name, a, z] of SPANS) {
    const v = ts.filter((t) => a in t && z in t).map((t) => t[z] - t[a]);
    if (v.length) line(name, v);
  }
  // the handoff without llama.cpp: the clock minus the trial's own save and load
  const need = ['loaded', 'save-start', 'save-resolved', 'finished'];
  const v = ts.filter((t) => need.every((k) => k in t)).map((t) => t.loaded - t['save-start'] - (t['save-resolved'] - t['save-start']) - (t.loaded - t.finished));
  if (v.length) line('TOTAL - save - loadState', v);
}
