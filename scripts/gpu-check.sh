#!/usr/bin/env bash
# scripts/gpu-check.sh — the command to run the day a GPU machine is at hand: PD against
# colocated with every layer on the GPU (TTFT, ITL, E2E with `pdserve bench`, per prompt length),
# and the KV handoff benchmark (BENCHMARKS.md §1, with its 256 MiB and 1 GiB states) with states
# saved from and loaded into device memory; prints the tables and writes bench/results/gpu.json (rendered into BENCHMARKS.md by
# `node bin/pdserve.js bench-suite --render-only`).
#
#   scripts/gpu-check.sh --model ~/models/llama-3.1-8b-instruct-q4_k_m.gguf      # NVIDIA (CUDA)
#   scripts/gpu-check.sh --backend lavapipe                                        # software Vulkan, tiny model
#   scripts/gpu-check.sh --dry-run                                                 # print the plan only
#
# With two or more GPUs prefill runs on GPU 0 and decode on GPU 1 (one box, same-host handoff);
# with one both share GPU 0. `--backend lavapipe` is a functional check of the offload path on
# Mesa's CPU-backed Vulkan device: its figures are no performance claim.
# Options: --model FILE (default: the built-in small model; tiny for lavapipe), --lens "512 2048
# 8192", --prompts N (per length, default 16), --output-len N (default 128), --ctx-size N
# (default 16384), --threads N (default 2), --port-base P (default 18700), --no-kv (skip §1),
# --no-kv-big (§1 without the 256 MiB / 1 GiB states of the generated `wide` model),
# --concurrency N (requests in flight, default 4), --results DIR (default bench/results),
# --root DIR (the checkout; default: this script's).
# Exit: 0 done, 2 bad usage, 3 no NVIDIA GPU (nothing measured).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

backend=cuda model='' lens='512 2048 8192' prompts=16 outlen=128 ctx=16384 threads=2 base=18700 dry=0 kv=1 kvbig=1 results='' conc=4
while [ $# -gt 0 ]; do
  case "$1" in
    --root) root=$2; shift 2 ;;
    --results) results=$2; shift 2 ;;
    --backend) backend=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --lens) lens=$2; shift 2 ;;
    --prompts) prompts=$2; shift 2 ;;
    --output-len) outlen=$2; shift 2 ;;
    --ctx-size) ctx=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --port-base) base=$2; shift 2 ;;
    --no-kv) kv=0; shift ;;
    --no-kv-big) kvbig=0; shift ;;
    --concurrency) conc=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

pdserve() { node bin/pdserve.js "$@"; }
run() { if [ "$dry" = 1 ]; then echo "  would run: $*" >&2; else "$@"; fi; }

case "$backend" in
  cuda)
    ngpu=0
    if command -v nvidia-smi >/dev/null 2>&1; then ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true); fi
    if [ "$ngpu" -eq 0 ]; then
      echo "gpu-check: no NVIDIA GPU on this machine (nvidia-smi lists none): nothing measured."
      echo "gpu-check: --backend lavapipe runs the functional check on a software Vulkan device."
      [ "$dry" = 1 ] || exit 3
      ngpu=2
    fi
    gpu=(--gpu cuda --gpu-layers max)
    [ -n "$model" ] || model=small
    ;;
  lavapipe)
    ngpu=1
    gpu=(--gpu vulkan --gpu-layers max)
    [ -n "$model" ] || model=tiny
    [ "$lens" != '512 2048 8192' ] || lens='64 256'
    [ "$ctx" != 16384 ] || ctx=1024
    [ "$prompts" != 16 ] || prompts=4
    [ "$outlen" != 128 ] || outlen=16
    threads=1 conc=1   # lavapipe: one request at a time (a colocated server on it crashed at 4 in one run)
    ;;
  *) echo "gpu-check: --backend cuda|lavapipe" >&2; exit 2 ;;
esac
cd "$root"
results=${results:-bench/results}
if [ "$ngpu" -ge 2 ]; then pdev=0 ddev=1; else pdev=0 ddev=0; fi
case "$model" in
  tiny|small) file="$(node -e "import('./dist/engine/gguf-writer.js').then(async (m) => console.log(await m.ensureModel('$model', 1)))")" ;;
  *) file=$model ;;
esac

out=$(mktemp -d /tmp/pdserve-gpu-check-XXXX)
pids=()
cleanup() { for p in "${pids[@]:-}"; do [ -n "$p" ] && kill -TERM "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

serve() { # log file, pdserve arguments…: a server in the background (node itself, so signals reach it)
  local log=$1; shift
  if [ "$dry" = 1 ]; then echo "  would run: pdserve $* >$log &" >&2; return; fi
  node bin/pdserve.js "$@" >"$log" 2>&1 &
  pids+=($!)
}
# SIGTERM: a drain (an asynchronous command of a script ignores SIGINT)
stop_last() { [ "$dry" = 1 ] || { kill -TERM "${pids[-1]}" 2>/dev/null || true; wait "${pids[-1]}" || true; }; }

wait_up() { # url, deadline s
  local t=0
  until curl -sf "$1/health" >/dev/null 2>&1; do
    sleep 1; t=$((t + 1))
    if [ "$t" -ge "$2" ]; then echo "gpu-check: $1 did not come up in $2 s (logs: $out)" >&2; exit 1; fi
  done
}

bench() { # name url
  for len in $lens; do
    run pdserve bench --url "$2" --input-len "$len" --output-len "$outlen" --num-prompts "$prompts" --request-rate inf --max-concurrency "$conc" \
      --tokenizer "$file" --no-progress --json "$out/$1-$len.json" >"$out/$1-$len.txt"
  done
}

echo "gpu-check: backend $backend, $ngpu GPU(s) (prefill on $pdev, decode on $ddev), model $file, lengths $lens, results in $out"

# colocated on GPU 0
serve "$out/colocated.log" colocated --model "$file" --port "$base" --ctx-size "$ctx" --threads "$threads" "${gpu[@]}" --gpu-device 0
[ "$dry" = 1 ] || wait_up "http://127.0.0.1:$base" 600
bench colo "http://127.0.0.1:$base"
stop_last

# PD: prefill on GPU pdev, decode on GPU ddev (same-host handoff through /dev/shm)
serve "$out/up.log" up --model "$file" --port $((base + 1)) --worker-port-base $((base + 2)) --ctx-size "$ctx" --threads "$threads" "${gpu[@]}" \
  --prefill-gpu-device "$pdev" --decode-gpu-device "$ddev" --log-dir "$out/up"
[ "$dry" = 1 ] || wait_up "http://127.0.0.1:$((base + 1))" 600
bench pd "http://127.0.0.1:$((base + 1))"
stop_last

# §1: the KV handoff with states in device memory (the suite's section 1, engines on the GPU)
if [ "$kv" = 1 ]; then
  run env PDSERVE_BENCH_GPU="${gpu[1]}" PDSERVE_BENCH_GPU_DEVICE="$pdev" PDSERVE_BENCH_KV_BIG="$kvbig" node bin/pdserve.js bench-suite --sections 1 --out "$out/suite" >"$out/kv.txt" || echo "gpu-check: §1 failed (see $out/kv.txt)" >&2
fi
[ "$dry" = 1 ] && { echo "gpu-check: dry run done"; exit 0; }

node - "$out" "$backend" "$lens" "$ngpu" "$results" <<'EOF'
const fs = require('node:fs');
const [out, backend, lens, ngpu, results] = process.argv.slice(2);
const read = (f) => { try { return JSON.parse(fs.readFileSync(`${out}/${f}`, 'utf8')); } catch { return null; } };
const rows = [];
for (const len of lens.split(' ')) {
  const c = read(`colo-${len}.json`)?.metrics, p = read(`pd-${len}.json`)?.metrics;
  if (!c || !p) continue;
  rows.push({ promptTokens: Number(len), colo: { ttftP50: c.ttftMs.p50, itlP50: c.itlMs.p50, itlP99: c.itlMs.p99, e2eP50: c.e2eMs.p50 }, pd: { ttftP50: p.ttftMs.p50, itlP50: p.itlMs.p50, itlP99: p.itlMs.p99, e2eP50: p.e2eMs.p50 } });
}
// §1's states (s1-kv-handoff.json) and its large ones (s1-kv-large.json), smallest first; the
// goal ratios as BENCHMARKS.md §1 defines them (TCP: KV / (save + raw + load); same host:
// (save + same-host) / (save + load)).
let kv = [];
for (const f of ['s1-kv-handoff.json', 's1-kv-large.json']) {
  try {
    const s = JSON.parse(fs.readFileSync(`${out}/suite/bench/results/${f}`, 'utf8'));
    for (const x of s?.result?.sizes ?? []) kv.push({ mib: x.blobBytes / 1048576, kvMs: x.kvMs?.median, rawMs: x.rawMs?.median, tcpGoalRatio: x.goalRatio, sameHostGoalRatio: x.sameHostGoalRatio });
  } catch { /* §1 (or its large states) skipped or failed */ }
}
kv.sort((a, b) => a.mib - b.mib);
if (!kv.length) kv = null;
const f = (x, d = 1) => (typeof x === 'number' ? x.toFixed(d) : '–');
console.log(`\n| prompt tokens | TTFT p50 colo / PD ms | ratio | ITL p50 colo / PD ms | ITL p99 colo / PD ms | ratio | E2E p50 colo / PD ms |`);
console.log('|---|---|---|---|---|---|---|');
for (const r of rows) console.log(`| ${r.promptTokens} | ${f(r.colo.ttftP50)} / ${f(r.pd.ttftP50)} | ${f(r.pd.ttftP50 / r.colo.ttftP50, 2)} | ${f(r.colo.itlP50, 2)} / ${f(r.pd.itlP50, 2)} | ${f(r.colo.itlP99, 2)} / ${f(r.pd.itlP99, 2)} | ${f(r.pd.itlP99 / r.colo.itlP99, 2)} | ${f(r.colo.e2eP50, 0)} / ${f(r.pd.e2eP50, 0)} |`);
if (kv?.length) {
  console.log('\n| state MiB | KV handoff ms | raw TCP ms | TCP: KV / (save + raw + load) | same host: (save + handoff) / (save + load) |\n|---|---|---|---|---|');
  for (const k of kv) console.log(`| ${f(k.mib, 0)} | ${f(k.kvMs)} | ${f(k.rawMs)} | ${f(k.tcpGoalRatio, 2)} | ${f(k.sameHostGoalRatio, 2)} |`);
}
const result = { tool: 'scripts/gpu-check.sh', date: new Date().toISOString(), backend, gpus: Number(ngpu), rows, kv };
fs.mkdirSync(results, { recursive: true });
fs.writeFileSync(`${results}/gpu.json`, JSON.stringify(result, null, 2) + '\n');
console.log(`\nwritten: ${results}/gpu.json (node bin/pdserve.js bench-suite --render-only puts bench/results/gpu.json into BENCHMARKS.md)`);
EOF
