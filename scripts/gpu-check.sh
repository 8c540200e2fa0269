#!/usr/bin/env bash
# scripts/gpu-check.sh — the command to run the day a GPU machine is at hand: PD against
# colocated with every layer on the GPU (TTFT, ITL p50/p99 with requests in flight, so prompt
# evaluations interfere with decoding on the colocated server, E2E with `pdserve bench`, per prompt
# length), the KV handoff benchmark (BENCHMARKS.md §1, with its 256 MiB and 1 GiB states) with
# states saved from and loaded into device memory, and the agents run (`pdserve bench-agents`) on
# the GPU; prints the tables and writes bench/results/gpu.json (rendered into BENCHMARKS.md by
# `node bin/pdserve.js bench-suite --render-only`). Sized for ≤ 8 min on one H100.
#
#   scripts/gpu-check.sh                                  # NVIDIA through CUDA (the node-llama-cpp CUDA build)
#   scripts/gpu-check.sh --backend vulkan                 # any GPU through Vulkan (the bundle's way: scripts/gpu-bundle.sh)
#   scripts/gpu-check.sh --backend lavapipe --smoke       # software Vulkan, tiny model, a minute or two
#   scripts/gpu-check.sh --dry-run                        # print the plan only
#
# With two or more GPUs prefill runs on GPU 0 and decode on GPU 1 (one box, same-host handoff);
# with one both share GPU 0. `--backend lavapipe` is a functional check of the offload path on
# Mesa's CPU-backed Vulkan device: its figures are no performance claim.
# Options: --model FILE (default: the generated small model; tiny for lavapipe), --lens "512 2048
# 8192", --prompts N (per length, default 16), --output-len N (default 128), --ctx-size N
# (default 16384), --threads N (default 2), --port-base P (default 18700), --no-kv (skip §1),
# --no-kv-big (§1 without the 256 MiB / 1 GiB states of the generated `wide` model),
# --concurrency N (requests in flight, default 4), --agents N (agents of the agents run, default
# 8; 0 skips it), --smoke (tiny model, 2 prompts of 32 and 96 tokens, 8 output tokens, no §1, no
# agents run: the end-to-end path in a minute), --results DIR (default bench/results), --logs FILE
# (a .tar.gz of the servers' logs and the raw results), --root DIR (the checkout; default: this
# script's).
# Exit: 0 done, 1 a step failed, 2 bad usage, 3 no GPU of the backend (nothing measured).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

backend=cuda model='' lens='' prompts='' outlen='' ctx='' threads=2 base=18700 dry=0 kv=1 kvbig=1 results='' conc=4 agents=8 smoke=0 logs=''
while [ $# -gt 0 ]; do
  case "$1" in
    --root) root=$2; shift 2 ;;
    --results) results=$2; shift 2 ;;
    --logs) logs=$2; shift 2 ;;
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
    --agents) agents=$2; shift 2 ;;
    --smoke) smoke=1; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

exec 3>&2   # the plan of a dry run goes to the original stderr, past a step's redirections
run() { if [ "$dry" = 1 ]; then echo "  would run: $*" >&3; else "$@"; fi; }
cd "$root"
command -v node >/dev/null 2>&1 || { echo "gpu-check: node is not on PATH" >&2; exit 1; }

# Vulkan devices llama.cpp uses by default (it skips CPU-type ones such as lavapipe): one
# "vk-device: NAME" line each, then node-llama-cpp's own lines when it found none
vulkan_devices() {
  node --input-type=module -e "
    const { getLlama, LlamaLogLevel } = await import('node-llama-cpp');
    try {
      const l = await getLlama({ gpu: 'vulkan', build: 'never', logLevel: LlamaLogLevel.error });
      for (const d of await l.getGpuDeviceNames()) console.log('vk-device: ' + d);
    } catch (e) { console.log('the Vulkan backend did not start: ' + (e?.message ?? e)); }
  " 2>&1 || true
}

notes=()   # lines for the JSON: what was skipped and why
if [ "$smoke" = 1 ]; then
  [ -n "$model" ] || model=tiny
  [ -n "$lens" ] || lens='32 96'
  [ -n "$ctx" ] || ctx=512
  [ -n "$prompts" ] || prompts=2
  [ -n "$outlen" ] || outlen=8
  conc=1
  [ "$kv" = 0 ] || { kv=0; notes+=("§1 skipped: --smoke"); }
  [ "$agents" = 0 ] || { agents=0; notes+=("agents run skipped: --smoke"); }
fi
case "$backend" in
  cuda)
    ngpu=0
    if command -v nvidia-smi >/dev/null 2>&1; then ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true); fi
    if [ "$ngpu" -eq 0 ]; then
      echo "gpu-check: no NVIDIA GPU on this machine (nvidia-smi lists none): nothing measured."
      echo "gpu-check: --backend vulkan runs on any GPU with a Vulkan driver; --backend lavapipe on a software Vulkan device."
      [ "$dry" = 1 ] || exit 3
      ngpu=2
    fi
    gpu=(--gpu cuda --gpu-layers max) bench_gpu=cuda
    ;;
  vulkan)
    ngpu=0
    if [ "$dry" = 1 ]; then ngpu=1; else
      devs=$(vulkan_devices)
      ngpu=$(grep -c '^vk-device: ' <<<"$devs" || true)
      echo "gpu-check: Vulkan devices: $(sed -n 's/^vk-device: //p' <<<"$devs" | paste -sd ';')"
    fi
    if [ "$ngpu" -eq 0 ]; then
      grep -v -e '^vk-device: ' -e '^ *at ' <<<"$devs" | tail -3 | sed 's/^/gpu-check: /' 
      echo "gpu-check: no Vulkan GPU on this machine (llama.cpp's Vulkan backend lists none; a software device does not count): nothing measured."
      echo "gpu-check: check the driver's manifest (VK_DRIVER_FILES, /usr/share/vulkan/icd.d) and that libvulkan.so.1 loads; --backend lavapipe runs on Mesa's software device."
      exit 3
    fi
    gpu=(--gpu vulkan --gpu-layers max) bench_gpu=vulkan
    ;;
  lavapipe)
    ngpu=1
    gpu=(--gpu vulkan --gpu-layers max) bench_gpu=vulkan
    [ -n "$model" ] || model=tiny
    [ -n "$lens" ] || lens='64 256'
    [ -n "$ctx" ] || ctx=1024
    [ -n "$prompts" ] || prompts=4
    [ -n "$outlen" ] || outlen=16
    threads=1 conc=1   # lavapipe: one request at a time (a colocated server on it crashed at 4 in one run)
    [ "$agents" = 0 ] || { agents=0; notes+=("agents run skipped: too slow on lavapipe"); }
    ;;
  *) echo "gpu-check: --backend cuda|vulkan|lavapipe" >&2; exit 2 ;;
esac
[ -n "$model" ] || model=small
[ -n "$lens" ] || lens='512 2048 8192'
[ -n "$ctx" ] || ctx=16384
[ -n "$prompts" ] || prompts=16
[ -n "$outlen" ] || outlen=128
[ "$kv" = 1 ] || [ "$smoke" = 1 ] || notes+=("§1 skipped: --no-kv")
[ "$agents" != 0 ] || [ "$smoke" = 1 ] || [ "$backend" = lavapipe ] || notes+=("agents run skipped: --agents 0")
notes+=("trace replay: none in pdserve; the agents run stands in")

results=${results:-bench/results}
if [ "$ngpu" -ge 2 ]; then pdev=0 ddev=1; else pdev=0 ddev=0; fi
case "$model" in
  tiny|small) file="$(node -e "import('./dist/engine/gguf-writer.js').then(async (m) => console.log(await m.ensureModel('$model', 1)))")" ;;
  *) file=$model ;;
esac

out=$(mktemp -d "${TMPDIR:-/tmp}/pdserve-gpu-check-XXXX")
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

get() { # url file: the JSON body of a GET (node's fetch: the machine may lack curl)
  node -e "fetch(process.argv[1], { signal: AbortSignal.timeout(5000) }).then(async (r) => { if (!r.ok) process.exit(1); require('fs').writeFileSync(process.argv[2], await r.text()); }, () => process.exit(1))" "$1" "$2"
}
wait_up() { # url, deadline s, log
  local t=0
  until get "$1/health" /dev/null 2>/dev/null; do
    sleep 1; t=$((t + 1))
    if ! kill -0 "${pids[-1]}" 2>/dev/null; then echo "gpu-check: the server for $1 exited; its log ($3):" >&2; tail -20 "$3" >&2; exit 1; fi
    if [ "$t" -ge "$2" ]; then echo "gpu-check: $1 did not come up in $2 s (logs: $out)" >&2; exit 1; fi
  done
}

bench() { # name url
  for len in $lens; do
    run node bin/pdserve.js bench --url "$2" --input-len "$len" --output-len "$outlen" --num-prompts "$prompts" --request-rate inf --max-concurrency "$conc" \
      --tokenizer "$file" --no-progress --json "$out/$1-$len.json" >"$out/$1-$len.txt"
  done
}

echo "gpu-check: backend $backend, $ngpu GPU(s) (prefill on $pdev, decode on $ddev), model $file, lengths $lens, $prompts prompts of each, results in $out"

# colocated on GPU 0
serve "$out/colocated.log" colocated --model "$file" --port "$base" --ctx-size "$ctx" --threads "$threads" "${gpu[@]}" --gpu-device 0
[ "$dry" = 1 ] || wait_up "http://127.0.0.1:$base" 600 "$out/colocated.log"
bench colo "http://127.0.0.1:$base"
[ "$dry" = 1 ] || get "http://127.0.0.1:$base/health" "$out/colo-health.json" || echo "gpu-check: GET /health of the colocated server failed" >&2
stop_last

# PD: prefill on GPU pdev, decode on GPU ddev (same-host handoff through /dev/shm)
serve "$out/up.log" up --model "$file" --port $((base + 1)) --worker-port-base $((base + 2)) --ctx-size "$ctx" --threads "$threads" "${gpu[@]}" \
  --prefill-gpu-device "$pdev" --decode-gpu-device "$ddev" --log-dir "$out/up"
[ "$dry" = 1 ] || wait_up "http://127.0.0.1:$((base + 1))" 600 "$out/up.log"
bench pd "http://127.0.0.1:$((base + 1))"
[ "$dry" = 1 ] || get "http://127.0.0.1:$((base + 1))/workers" "$out/pd-workers.json" || echo "gpu-check: GET /workers of the router failed" >&2
stop_last

# §1: the KV handoff with states in device memory (the suite's section 1, engines on the GPU)
if [ "$kv" = 1 ]; then
  run env PDSERVE_BENCH_GPU="$bench_gpu" PDSERVE_BENCH_GPU_DEVICE="$pdev" PDSERVE_BENCH_KV_BIG="$kvbig" node bin/pdserve.js bench-suite --sections 1 --out "$out/suite" >"$out/kv.txt" 2>&1 || echo "gpu-check: §1 failed (see $out/kv.txt)" >&2
fi
# The agents run: one prefill, one decode (decode-local continuation, prefix store on and off)
# and colocated, every engine on GPU pdev
if [ "$agents" != 0 ]; then
  run node bin/pdserve.js bench-agents --mode rounds --model "$file" --agents "$agents" --rounds 4 --decode 1 --gpu "$bench_gpu" --gpu-device "$pdev" --json "$out/agents.json" >"$out/agents.txt" 2>&1 || echo "gpu-check: the agents run failed (see $out/agents.txt)" >&2
fi
[ "$dry" = 1 ] && { rm -rf "$out"; echo "gpu-check: dry run done"; exit 0; }

node - "$out" "$backend" "$lens" "$ngpu" "$results" "$smoke" "$file" "$(printf '%s\n' "${notes[@]}")" <<'EOF'
const fs = require('node:fs');
const path = require('node:path');
const [out, backend, lens, ngpu, results, smoke, model, notes] = process.argv.slice(2);
const read = (f) => { try { return JSON.parse(fs.readFileSync(`${out}/${f}`, 'utf8')); } catch { return null; } };
const rows = [];
for (const len of lens.split(' ')) {
  const c = read(`colo-${len}.json`)?.metrics, p = read(`pd-${len}.json`)?.metrics;
  if (!c || !p) continue;
  rows.push({ promptTokens: Number(len), colo: { ttftP50: c.ttftMs.p50, itlP50: c.itlMs.p50, itlP99: c.itlMs.p99, e2eP50: c.e2eMs.p50 }, pd: { ttftP50: p.ttftMs.p50, itlP50: p.itlMs.p50, itlP99: p.itlMs.p99, e2eP50: p.e2eMs.p50 } });
}
// What each engine got: the colocated server's /health, the PD workers' rows of GET /workers
const layersOf = (g) => (g && g.total_layers ? `${g.layers}/${g.total_layers}` : null);
const colo = read('colo-health.json')?.gpu;
const engines = [];
if (colo) engines.push({ role: 'colocated', backend: colo.backend ?? null, devices: colo.devices ?? [], layers: layersOf(colo) });
for (const w of read('pd-workers.json')?.workers ?? []) if (w.role === 'prefill' || w.role === 'decode') engines.push({ role: w.role, backend: w.gpu, devices: w.gpu_devices, layers: w.gpu_layers });
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
// The agents run: per setup, TTFT of round 1 and the last round, cached share, goodput
const ag = read('agents.json');
const agents = ag?.runs?.length ? ag.runs.map((r) => ({ setup: r.scale, agents: r.concurrency, ttftR1: r.ttftByRound[0], ttftLast: r.ttftByRound[r.ttftByRound.length - 1], rounds: r.ttftByRound.length, cachedShare: r.cachedShare, goodput: r.goodput, failed: r.failed })) : null;
const f = (x, d = 1) => (typeof x === 'number' ? x.toFixed(d) : '–');
console.log('\n| engine | backend | devices | layers |\n|---|---|---|---|');
for (const e of engines) console.log(`| ${e.role} | ${e.backend ?? 'CPU'} | ${e.devices.join(', ')} | ${e.layers ?? '–'} |`);
console.log(`\n| prompt tokens | TTFT p50 colo / PD ms | ratio | ITL p50 colo / PD ms | ITL p99 colo / PD ms | ratio | E2E p50 colo / PD ms |`);
console.log('|---|---|---|---|---|---|---|');
for (const r of rows) console.log(`| ${r.promptTokens} | ${f(r.colo.ttftP50)} / ${f(r.pd.ttftP50)} | ${f(r.pd.ttftP50 / r.colo.ttftP50, 2)} | ${f(r.colo.itlP50, 2)} / ${f(r.pd.itlP50, 2)} | ${f(r.colo.itlP99, 2)} / ${f(r.pd.itlP99, 2)} | ${f(r.pd.itlP99 / r.colo.itlP99, 2)} | ${f(r.colo.e2eP50, 0)} / ${f(r.pd.e2eP50, 0)} |`);
if (kv?.length) {
  console.log('\n| state MiB | KV handoff ms | raw TCP ms | TCP: KV / (save + raw + load) | same host: (save + handoff) / (save + load) |\n|---|---|---|---|---|');
  for (const k of kv) console.log(`| ${f(k.mib, 0)} | ${f(k.kvMs)} | ${f(k.rawMs)} | ${f(k.tcpGoalRatio, 2)} | ${f(k.sameHostGoalRatio, 2)} |`);
}
if (agents) {
  console.log('\n| agents setup | agents | TTFT round 1 ms | TTFT last round ms | cached | goodput rounds/s | failed |\n|---|---|---|---|---|---|---|');
  for (const a of agents) console.log(`| ${a.setup} | ${a.agents} | ${f(a.ttftR1, 0)} | ${f(a.ttftLast, 0)} | ${f(a.cachedShare * 100, 0)} % | ${f(a.goodput, 2)} | ${a.failed} |`);
}
const skipped = notes.split('\n').filter(Boolean);
for (const n of skipped) console.log(`gpu-check: ${n}`);
const result = {
  tool: 'scripts/gpu-check.sh', date: new Date().toISOString(), backend, gpus: Number(ngpu), smoke: smoke === '1', model: path.basename(model),
  node: { version: process.version, execPath: process.execPath }, engines, rows, kv, agents, notes: skipped,
};
fs.mkdirSync(results, { recursive: true });
fs.writeFileSync(`${results}/gpu.json`, JSON.stringify(result, null, 2) + '\n');
console.log(`\nwritten: ${results}/gpu.json (node bin/pdserve.js bench-suite --render-only puts bench/results/gpu.json into BENCHMARKS.md)`);
if (!rows.length) { console.error('gpu-check: no length has figures from both PD and colocated'); process.exit(1); }
EOF
if [ -n "$logs" ]; then
  mkdir -p "$(dirname "$logs")"
  (cd "$out" && find . -type f \( -name '*.log' -o -name '*.txt' -o -name '*.json' \) -size -20M -print0 | tar -czf "$logs" --null -T -) && echo "logs: $logs"
fi
