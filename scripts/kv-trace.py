#!/usr/bin/env python3
"""Medians of the §1 KV trials' step stamps (PDSERVE_BENCH_KV_TRACE=<file> node bin/pdserve.js
bench-suite --sections 1; then: python3 scripts/kv-trace.py <file>). Bench-only; ms."""
import sys, statistics as S
ev = []
for line in open(sys.argv[1]).read().splitlines():
    t, role, what = line.split(' ', 2)
    ev.append((float(t), role, what))
ev.sort()
trials, cur = [], None
for e in ev:
    if e[2].startswith('save-start'):
        cur = [e]; trials.append(cur)
    elif cur is not None:
        cur.append(e)
by = {}
for t in trials:
    b = int(t[0][2].split('bytes=')[1])
    d = {}
    for x in t:
        k = x[2].split(' ')[0]
        if k == 'chunk':
            n = d.get('nchunks', 0)
            if n == 0: d['chunk-head'] = x[0]
            if n == 1: d['chunk-payload0'] = x[0]
            d['chunk-last'] = x[0]; d['nchunks'] = n + 1
        elif k == 'pushed':
            if d.get('npushed', 0) == 0: d['pushed-head'] = x[0]
            if d.get('npushed', 0) == 1: d['pushed-payload0'] = x[0]
            d['npushed'] = d.get('npushed', 0) + 1
            d['pushed-last'] = x[0]
        elif k == 'flushed':
            n = d.get('nflushed', 0)
            if n == 1: d['flushed-payload0'] = x[0]
            d['nflushed'] = n + 1
        else:
            d.setdefault(k, x[0])
    by.setdefault(b, []).append(d)
keys = [('save', 'save-start', 'save-resolved'), ('resolved->awaited', 'save-resolved', 'saved-awaited'),
        ('head prepared (during save)', 'save-start', 'head-prepared'), ('head encode', 'saved-awaited', 'head-encoded'), ('kv_begin encode+write', 'head-encoded', 'kv_begin-sent'),
        ('kv_begin sent->1st piece flushed', 'kv_begin-sent', 'flushed-payload0'),
        ('  kv_begin-sent->sendStateFile entered', 'kv_begin-sent', 'tx-enter'), ('  open', 'tx-enter', 'tx-opened'), ('  slots', 'tx-opened', 'tx-slots'),
        ('  1st read (incl. head write)', 'tx-slots', 'tx-read'), ('  1st crc', 'tx-read', 'tx-crc'), ('  all handed->resolved', 'tx-all-handed', 'send-resolved'),
        ('send (kv_begin->resolved)', 'kv_begin-sent', 'send-resolved'), ('kv_end send', 'send-resolved', 'kv_end-sent'),
        ('kv_begin lag', 'kv_begin-sent', 'kv_begin-recv'), ('rx made', 'kv_begin-recv', 'rx-made'),
        ('head chunk arrives (from kv_begin-recv)', 'kv_begin-recv', 'chunk-head'), ('head push (accept, open file)', 'chunk-head', 'pushed-head'),
        ('  head parse', 'rx-head-bytes', 'rx-head-parsed'), ('  file acquire', 'rx-head-parsed', 'rx-opened'), ('  walker', 'rx-opened', 'rx-walker'), ('  rest', 'rx-walker', 'pushed-head'),
        ('head pushed->1st payload chunk', 'pushed-head', 'chunk-payload0'), ('1st payload push', 'chunk-payload0', 'pushed-payload0'),
        ('kv_begin-recv->1st payload pushed', 'kv_begin-recv', 'pushed-payload0'), ('kv_begin-sent->1st payload pushed', 'kv_begin-sent', 'pushed-payload0'),
        ('save-start->1st payload on decode', 'save-start', 'chunk-payload0'),
        ('saved->1st payload on decode', 'save-resolved', 'chunk-payload0'),
        ('wire (kv_begin-recv->last chunk)', 'kv_begin-recv', 'chunk-last'), ('last chunk pushed', 'chunk-last', 'pushed-last'), ('last pushed->kv_end', 'pushed-last', 'kv_end-recv'),
        ('kv_end lag', 'kv_end-sent', 'kv_end-recv'), ('kv_end->finish', 'kv_end-recv', 'finish-start'),
        ('finish', 'finish-start', 'finished'), ('loadState', 'finished', 'loaded'), ('TOTAL', 'save-start', 'loaded')]
for b in sorted(by):
    ts = by[b]
    print(f'== {b} bytes, n={len(ts)}, chunks={S.median([t.get("nchunks", 0) for t in ts])}')
    for name, a, z in keys:
        v = [t[z] - t[a] for t in ts if a in t and z in t]
        if v: print(f'  {name:42s} med {S.median(v):8.3f}  min {min(v):8.3f}')
    # the handoff without llama.cpp: the clock minus the trial's own save and load
    v = [(t['loaded'] - t['save-start']) - (t['save-resolved'] - t['save-start']) - (t['loaded'] - t['finished']) for t in ts if all(k in t for k in ('loaded', 'save-start', 'save-resolved', 'finished'))]
    if v: print(f'  {"TOTAL - save - loadState":42s} med {S.median(v):8.3f}  min {min(v):8.3f}')
