#!/usr/bin/env bash
# scripts/device_configs.sh [options]: on the GPU machine, the working tree's `cpidx bench` under
# several configs (bench flags) in one call, alternated, and optionally the trace build under
# them: for a knob of the bench itself (a neighbour kernel before every call, --neighbour-us)
# rather than a patch of the library (scripts/device_ab.sh). Results under $OUT (default
# ./device-out):
#   configs.txt    every bench table, each under "== rep=N <config flags>", then the summary
#                  (bench/ab_summary.py --configs: each run's median and slowest replay, and one
#                  line per traced run), also printed
#   configs.json   the rows as JSON ({"runs": [{"build", "rep", "config", "results"}]})
#   trace.txt      every traced run (`cpidx bench --trace`), each under "== trace <config>"
# Options:
#   --config "FLAGS"   bench flags added to the shapes for one block (repeatable; default: one
#                      block with none)
#   --shapes "FLAGS"   the bench shapes (default: --modes plain4,cp2 --reqs 1,8
#                      --contexts 8192,262144 --qlens 1,4)
#   --reps N           alternations of the configs (default 2)
#   --trace "FLAGS"    the traced runs' shapes (each config's flags added); none: no trace build
#   --trace-reps N     traced runs per config (default 2): a trace is of one launch
# Example (a neighbour kernel holding 110 KiB a CTA before every call, against none):
#   scripts/device_configs.sh --shapes "--dtype fp8 --modes plain4 --reqs 64 --contexts 262144 \
#     --qlens 4 --replays 30" --config "" --config "--neighbour-us 20 --neighbour-smem-kb 110"
set -uo pipefail
# shellcheck source=scripts/device_common.sh
. "$(dirname "$0")/device_common.sh"
trace_reps=2
while [ $# -gt 0 ]; do
  bench_option "$@"
  [ "$taken" -gt 0 ] && { shift "$taken"; continue; }
  case "$1" in
    -h|--help) sed -n '2,/^set /{/^#/p}' "$0"; exit 0 ;;
    *) echo "device_configs.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ ${#configs[@]} -eq 0 ] && configs=("")
device_log_start configs.txt

# Both builds at once, and both done before the first bench (a compile beside it would take
# the host's cores from the graph launches it times).
(TARGETS=cpidx_tool OUT=$OUT scripts/device.sh build) & release_pid=$!
trace_built=0
if [ -n "$trace" ]; then
  (OUT=$OUT scripts/device_trace.sh --build-only) & trace_pid=$!
  wait $trace_pid && trace_built=1
fi
wait $release_pid || { echo "device_configs.sh: the release build failed" | tee -a "$log"; exit 1; }
echo "# built in $(elapsed) s" | tee -a "$log"

jsons=()
scratch=$(mktemp -d)
for ((rep = 1; rep <= reps; ++rep)); do
  for cfg in "${configs[@]}"; do
    json=$scratch/run_${#jsons[@]}.json
    echo "== rep=$rep $cfg (t=$(elapsed) s)" >>"$log"
    # shellcheck disable=SC2086  # shapes and cfg hold separate flags
    timeout 150 ./build-device/cpidx bench $shapes $cfg --json "$json" >>"$log" 2>&1
    jsons+=("base|$rep|$cfg|$json")
  done
done
echo "# benches done at $(elapsed) s" | tee -a "$log"
python3 bench/ab_summary.py --collect "$OUT/configs.json" "${jsons[@]}"

named=()
if [ -n "$trace" ]; then
  if [ $trace_built = 1 ]; then
    : >"$OUT/trace.txt"
    for i in "${!configs[@]}"; do : >"$scratch/trace_$i.txt"; done
    for ((rep = 1; rep <= trace_reps; ++rep)); do
      for i in "${!configs[@]}"; do
        echo "== trace rep=$rep ${configs[$i]}" >>"$OUT/trace.txt"
        # shellcheck disable=SC2086  # trace and the config hold separate flags
        timeout 120 ./build-trace/cpidx bench --trace $trace ${configs[$i]} 2>&1 |
          tee -a "$scratch/trace_$i.txt" >>"$OUT/trace.txt"
      done
    done
    for i in "${!configs[@]}"; do named+=("c$i=$scratch/trace_$i.txt"); done
  else
    echo "device_configs.sh: the trace build failed" | tee -a "$log"
  fi
  echo "# traces done at $(elapsed) s" | tee -a "$log"
fi
{
  for i in "${!configs[@]}"; do echo "# c$i: ${configs[$i]:-(none)}"; done
  python3 bench/ab_summary.py --configs "$OUT/configs.json" "${named[@]}"
} | tee -a "$log"
rm -rf "$scratch"
