#!/usr/bin/env bash
# scripts/sass.sh [--trace] [--no-spills] SOURCE [KERNEL_REGEX]: one CUDA source's device code
# for sm_90a, without a GPU. Compiles SOURCE (e.g. src/cuda/select_topk.cu) to a cubin with the
# release flags (--trace: -DCPIDX_TRACE, the timeline build) and prints ptxas' registers, stack and
# spills per kernel; then, where cuobjdump and nvdisasm are found, writes the SASS of the
# kernels whose mangled names match KERNEL_REGEX (default: all) to $OUT/<source>.sass (OUT
# defaults to ./sass-out) and prints how many instructions and shared-memory loads each has.
# The CUDA toolkit on the CI image has neither tool; they are looked for on PATH, in
# /usr/local/cuda/bin, and in $CPIDX_CUDA_TOOLS (a folder holding both). NVIDIA ships them as
# Python wheels (`pip download nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`, then unzip each
# and point CPIDX_CUDA_TOOLS at the nvidia/cu13/bin folder inside); nothing is downloaded here.
# Use: a kernel change's registers and spills against the tree's before any device run (the
# 64-register selection instances spill on small changes), and what ptxas made of a loop.
# --no-spills: exit 1 when a matching kernel spills (or none matches), before any SASS: the
# check ctest runs on the kernels whose registers the measurements say must hold (tests/).
# Example: scripts/sass.sh src/cuda/select_topk.cu 'select_topk_kernelILi256ELb0'
set -uo pipefail
defines=()
if [ "${1:-}" = "--trace" ]; then defines+=(-DCPIDX_TRACE); shift; fi
no_spills=0
if [ "${1:-}" = "--no-spills" ]; then no_spills=1; shift; fi
if [ $# -lt 1 ] || [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,/^set /{/^#/p}' "$0"
  [ $# -lt 1 ] && exit 2 || exit 0
fi
src=$1
regex=${2:-.}
root=$(cd "$(dirname "$0")/.." && pwd)
[ -f "$src" ] || { echo "sass.sh: no such source: $src" >&2; exit 2; }
nvcc=${NVCC:-/usr/local/cuda/bin/nvcc}
# The cpidx target's CUDA flags in CMakeLists.txt (and the trace check's), -lineinfo aside: keep
# them in step. scripts/ptx_diff.sh takes a build's own commands instead, where one exists.
out=${OUT:-$PWD/sass-out}
mkdir -p "$out"
name=$(basename "$src" .cu)
cubin="$out/$name.cubin"
"$nvcc" -DCPIDX_WITH_CUDA=1 "${defines[@]}" -I"$root/include" -I"$root/src" -O3 -DNDEBUG \
  -arch=sm_90a --expt-relaxed-constexpr -std=c++17 -Xptxas=-v -cubin -o "$cubin" "$src" \
  2>"$out/$name.ptxas" || { cat "$out/$name.ptxas" >&2; exit 1; }
# ptxas prints a kernel's name, then its stack and spills, then its registers.
usage=$(awk '
     /Compiling entry function/ { k = $0; sub(/.*function .?/, "", k); sub(/.? for .*/, "", k) }
     /bytes stack frame/ { match($0, /[0-9]+ bytes stack frame, [0-9]+ bytes spill stores, [0-9]+ bytes spill loads/); s = substr($0, RSTART, RLENGTH) }
     /Used [0-9]+ registers/ { match($0, /Used [0-9]+ registers/); printf "%-4s %s  %s\n", substr($0, RSTART + 5, RLENGTH - 15), s, k }' \
  "$out/$name.ptxas" | grep -E -- "$regex")
if [ -z "$usage" ]; then
  echo "sass.sh: no kernel matches $regex" >&2
  [ "$no_spills" = 1 ] && exit 1
else
  echo "$usage"
fi
if [ "$no_spills" = 1 ]; then
  spilled=$(echo "$usage" | grep -Ev ' 0 bytes spill stores, 0 bytes spill loads ' || true)
  if [ -n "$spilled" ]; then
    echo "sass.sh: these kernels spill (--no-spills):" >&2
    echo "$spilled" >&2
    exit 1
  fi
  echo "sass.sh: no spills in $(echo "$usage" | wc -l) kernel(s) matching $regex"
  exit 0
fi

tools=${CPIDX_CUDA_TOOLS:-}
cuobjdump=""
for dir in "$tools" /usr/local/cuda/bin; do
  if [ -n "$dir" ] && [ -x "$dir/cuobjdump" ] && [ -x "$dir/nvdisasm" ]; then
    cuobjdump=$dir/cuobjdump
    export PATH="$dir:$PATH"  # cuobjdump runs nvdisasm from PATH
    break
  fi
done
if [ -z "$cuobjdump" ] && command -v cuobjdump >/dev/null && command -v nvdisasm >/dev/null; then
  cuobjdump=$(command -v cuobjdump)
fi
if [ -z "$cuobjdump" ]; then
  echo "sass.sh: no cuobjdump + nvdisasm (PATH, /usr/local/cuda/bin, CPIDX_CUDA_TOOLS): registers only" >&2
  exit 0
fi
"$cuobjdump" -sass "$cubin" |
  awk -v re="$regex" '/Function :/ { keep = ($3 ~ re) } keep' >"$out/$name.sass" || exit 1
awk '/Function :/ { if (k != "") printf "%6d instructions %4d LDS  %s\n", n, l, k; k = $3; n = 0; l = 0 }
     /^ *\/\*[0-9a-f]+\*\/ / { n++; if ($0 ~ / LDS/) l++ }
     END { if (k != "") printf "%6d instructions %4d LDS  %s\n", n, l, k }' "$out/$name.sass"
echo "SASS: $out/$name.sass"
