#!/usr/bin/env bash
# scripts/device_ncu.sh [--sections "S S ..."] -- BENCH_FLAGS [-- BENCH_FLAGS ...]: on the GPU
# machine, build the release tool (build-device/, as scripts/device.sh) and profile the scoring
# kernel of each bench run with Nsight Compute: one launch (after two warm ones) per run, the
# given sections with their details (default: where the issue slots go, the pipes' use, the
# warps' stalls and the instruction mix). Each run's report goes to $OUT/ncu_<N>.txt.
# --sass: also the SourceCounters section, and each SASS instruction's executions and stall
# samples as CSV ($OUT/ncu_<N>_sass.csv.gz, from `ncu --page source --print-source sass`).
# bench/ncu_sass.py reads that CSV: by opcode, by code region, shared-memory bank conflicts.
# Example (the consumers' own rate: pages from a 16 MiB pool, so from L2):
#   scripts/device_ncu.sh -- --modes plain4 --reqs 8 --contexts 1M --qlens 1 --dtype fp8 \
#     --pool-mb 16 -- --modes plain4 --reqs 8 --contexts 1M --qlens 4 --dtype fp8 --pool-mb 16
set -uo pipefail
sections="SpeedOfLight ComputeWorkloadAnalysis InstructionStats WarpStateStats SchedulerStats Occupancy"
sass=0
while [ "${1:-}" = --sections ] || [ "${1:-}" = --sass ]; do
  case "$1" in
    --sections) sections=$2; shift 2 ;;
    --sass) sass=1; shift ;;
  esac
done
[ $sass = 1 ] && sections="$sections SourceCounters"  # whatever the options' order
[ "${1:-}" = -- ] || { echo "device_ncu.sh: -- BENCH_FLAGS needed (see the header)" >&2; exit 2; }
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0
TARGETS=cpidx_tool OUT="$OUT" scripts/device.sh build || exit 1
ncu=$(command -v ncu)
for c in /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu; do
  [ -z "$ncu" ] && [ -x "$c" ] && ncu=$c
done
[ -n "$ncu" ] || { echo "device_ncu.sh: no ncu on this machine" >&2; exit 1; }
section_flags=()
for s in $sections; do section_flags+=(--section "$s"); done
runs=() cur=()
shift
for a in "$@"; do
  if [ "$a" = -- ]; then runs+=("${cur[*]}"); cur=(); else cur+=("$a"); fi
done
runs+=("${cur[*]}")
n=0
for flags in "${runs[@]}"; do
  n=$((n + 1))
  echo "== run $n: cpidx bench $flags" | tee "$OUT/ncu_$n.txt"
  # shellcheck disable=SC2086  # the flags are words
  {
    "$ncu" -k regex:score_topk --launch-skip 2 --launch-count 1 "${section_flags[@]}" \
      --print-details all -f -o "/tmp/ncu_$n" ./build-device/cpidx bench $flags --replays 1 2>&1
    echo "exit $?"
    "$ncu" -i "/tmp/ncu_$n.ncu-rep" --print-details all 2>&1
  } >>"$OUT/ncu_$n.txt"
  if [ $sass = 1 ]; then
    "$ncu" -i "/tmp/ncu_$n.ncu-rep" --page source --csv --print-source sass 2>&1 |
      gzip >"$OUT/ncu_${n}_sass.csv.gz"
  fi
  grep -E "Duration|Issue Slots Busy|Executed Ipc Active|No Eligible|Warp Cycles Per Issued" \
    "$OUT/ncu_$n.txt" | head -12
done
