#!/usr/bin/env bash
# scripts/device_ab.sh [options] PATCH: on the GPU machine, one A/B of a kernel patch in one call.
# Builds the working tree ("base", build-device/) and a copy with PATCH applied ("new",
# build-ab/<patch name>/, its own build-device/), side by side; runs `cpidx bench` on both,
# alternated, for each --config; then, if asked, the new build's GPU tests and sanitizers.
# Results under $OUT (default ./device-out), within the device tool's 8 files:
#   ab.txt      every bench table, each under "== base|new rep=N <config flags>", then the
#               side-by-side summaries (bench/ab_summary.py), also printed
#   ab.json     the same rows as JSON ({"runs": [{"build", "rep", "config", "results"}]})
#   tests.log   the new build's GPU tests (--tests)
#   trace_base.txt, trace_new.txt   `cpidx bench --trace` of both trees (--trace)
#   sanitize_summary.txt, sanitize.log   compute-sanitizer on the new build (--sanitize): the
#               summary line per tool, and the tools' logs (each hazard's two accesses)
# Options:
#   --config "FLAGS"   bench flags added to the shapes for one block (repeatable; default: one
#                      block with none)
#   --shapes "FLAGS"   the bench shapes (default: --modes plain4,cp2 --reqs 1,8
#                      --contexts 8192,262144 --qlens 1,4)
#   --reps N           alternations per config (default 2)
#   --trace "FLAGS"    then build both trees with the timeline (scripts/device_trace.sh, at
#                      once) and run `cpidx bench --trace FLAGS` on each, one after the other
#   --trace-reps N     that many traced runs a build, alternated (default 1): a run traces its
#                      last call and its slowest replay's last call (two rows of the trace
#                      summary), so an event in a few replays only (a CTA placed late, v41-slow)
#                      shows in the second row; several runs catch rarer ones
#   --tests FILTER     then run the new build's cpidx_gpu_tests with this gtest filter
#   --sanitize TOOL    then scripts/gpu_sanitize.sh TOOL in the new tree (memcheck|racecheck|
#                      synccheck|all)
#   --budget S         seconds the whole script may take (default 580, short of the device
#                      tool's 10-minute limit); the tests get what is left of it, so a small
#                      budget keeps a long filter from spending the session's device time
# The tests and the sanitizer run in what is left of the budget.
# Example (the v17e patch):
#   scripts/device_ab.sh --config "" --config "--max-tokens 8192" \
#     --tests 'GpuDecode.*:GpuWorkStealing.*' docs/perf/raw/v17e_dense_offsets_when_the_batch_fits.patch
set -uo pipefail
# shellcheck source=scripts/device_common.sh
. "$(dirname "$0")/device_common.sh"
tests="" sanitize="" patch="" budget=580
while [ $# -gt 0 ]; do
  bench_option "$@"
  [ "$taken" -gt 0 ] && { shift "$taken"; continue; }
  case "$1" in
    --tests) tests=$2; shift 2 ;;
    --sanitize) sanitize=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set /{/^#/p}' "$0"; exit 0 ;;
    -*) echo "device_ab.sh: unknown option $1" >&2; exit 2 ;;
    *) [ -z "$patch" ] || { echo "device_ab.sh: one PATCH only" >&2; exit 2; }; patch=$1; shift ;;
  esac
done
if [ -z "$patch" ] || [ ! -f "$patch" ]; then
  echo "device_ab.sh: PATCH file needed (see --help)" >&2
  exit 2
fi
patch_file=$(realpath "$patch")
[ ${#configs[@]} -eq 0 ] && configs=("")
device_log_start ab.txt

# The patched copy: the tree without build outputs, then the patch (git apply in a repository of
# its own: inside this one it would skip the paths outside the copy).
name=$(basename "$patch" .patch)
new=build-ab/$name
sum=$(sha256sum "$patch_file" | cut -c1-16)
if [ "$(cat "$new/.applied" 2>/dev/null)" != "$sum" ]; then  # new, or the patch changed
  rm -rf "$new" && mkdir -p "$new"
  tar --exclude='./build*' --exclude=./device-out --exclude=./.git -cf - . | tar -xf - -C "$new"
  (cd "$new" && git init -q . && git apply "$patch_file") ||
    { echo "device_ab.sh: $patch does not apply to this tree" | tee -a "$log"; exit 1; }
  echo "$sum" >"$new/.applied"
fi
build() {  # build SOURCE_DIR TARGET...: scripts/device.sh's build in SOURCE_DIR/build-device
  (cd "$1" && TARGETS="${*:2}" OUT="$OUT" scripts/device.sh build) ||
    { echo "device_ab.sh: build of $1 failed"; return 1; }
}
new_targets=(cpidx_tool)
[ -n "$tests" ] && new_targets+=(cpidx_gpu_tests)
build . cpidx_tool & base_pid=$!
build "$new" "${new_targets[@]}" & new_pid=$!
wait $base_pid; base_rc=$?
wait $new_pid; new_rc=$?
[ $base_rc -eq 0 ] && [ $new_rc -eq 0 ] || exit 1
echo "# built in $(elapsed) s; base = the working tree, new = + $patch" | tee -a "$log"

jsons=()
for ((rep = 1; rep <= reps; ++rep)); do
  for cfg in "${configs[@]}"; do
    for which in base new; do
      bin=./build-device/cpidx
      [ $which = new ] && bin=$new/build-device/cpidx
      json=$new/ab_${which}_${rep}_${#jsons[@]}.json
      echo "== $which rep=$rep $cfg (t=$(elapsed) s)" >>"$log"
      # shellcheck disable=SC2086  # shapes and cfg hold separate flags
      timeout 150 "$bin" bench $shapes $cfg --json "$json" 2>&1 | grep -v '^#' >>"$log"
      jsons+=("$which|$rep|$cfg|$json")
    done
  done
done
echo "# benches done at $(elapsed) s" | tee -a "$log"
python3 bench/ab_summary.py --collect "$OUT/ab.json" "${jsons[@]}"
python3 bench/ab_summary.py "$OUT/ab.json" | tee -a "$log"

if [ -n "$trace" ]; then
  (OUT=$OUT scripts/device_trace.sh --build-only) & tb_pid=$!
  (cd "$new" && OUT=$OUT scripts/device_trace.sh --build-only) & tn_pid=$!
  wait $tb_pid; tb_rc=$?
  wait $tn_pid; tn_rc=$?
  if [ $tb_rc -eq 0 ] && [ $tn_rc -eq 0 ]; then
    : >"$OUT/trace_base.txt"
    : >"$OUT/trace_new.txt"
    for ((rep = 1; rep <= trace_reps; ++rep)); do
      # shellcheck disable=SC2086  # trace holds separate flags
      timeout 120 ./build-trace/cpidx bench --trace $trace >>"$OUT/trace_base.txt" 2>&1
      # shellcheck disable=SC2086
      timeout 120 "$new/build-trace/cpidx" bench --trace $trace >>"$OUT/trace_new.txt" 2>&1
    done
    python3 bench/ab_summary.py --trace "$OUT/trace_base.txt" "$OUT/trace_new.txt" | tee -a "$log"
  else
    echo "device_ab.sh: a trace build failed" | tee -a "$log"
  fi
  echo "# traces done at $(elapsed) s" | tee -a "$log"
fi

rc=0
if [ -n "$tests" ]; then
  left=$(( budget - $(elapsed) ))
  [ "$left" -gt 0 ] || left=1
  timeout "$left" "$new/build-device/tests/cpidx_gpu_tests" --gtest_filter="$tests" \
    >"$OUT/tests.log" 2>&1
  rc=$?
  echo "# tests (new) exit $rc at $(elapsed) s ($left s allowed)" | tee -a "$log"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) " "$OUT/tests.log" | tee -a "$log"
fi
if [ -n "$sanitize" ] && [ $(( budget - 20 - $(elapsed) )) -gt 60 ]; then
  if ! (cd "$new" && OUT=$OUT/san scripts/gpu_sanitize.sh "$sanitize" >/dev/null 2>&1); then
    rc=1
  fi
  cp "$OUT/san/sanitize_summary.txt" "$OUT/sanitize_summary.txt" 2>/dev/null
  # The tool's own log names each hazard's two accesses: keep it (one file a tool, 'all' too).
  cat "$OUT"/san/sanitize_{memcheck,racecheck,synccheck}.log >"$OUT/sanitize.log" 2>/dev/null
  rm -rf "$OUT/san"
  [ -f "$OUT/sanitize_summary.txt" ] && tee -a "$log" <"$OUT/sanitize_summary.txt"
fi
echo "# done at $(elapsed) s" | tee -a "$log"
exit $rc
