#!/usr/bin/env bash
# scripts/device_ab.sh [options] PATCH [PATCH...]: on the GPU machine, one A/B of kernel patches
# in one call. Builds the working tree ("base", build-device/) and, side by side, a copy of it
# for each PATCH with that patch applied (build-ab/<patch name>/, its own build-device/); runs
# `cpidx bench` on every build, alternated (each rep starting one build later), for each
# --config; then, if asked, each patched build's GPU tests and (one PATCH) its sanitizers. A
# PATCH of the form A.patch+B.patch is one build with both applied, in that order (a patch
# prepared on top of another).
# With one PATCH its build is named "new"; with several, each by its patch name(s).
# Results under $OUT (default ./device-out), within the device tool's 8 files:
#   ab.txt      every bench table, each under "== <build> rep=N <config flags>", then the
#               side-by-side summaries (bench/ab_summary.py: one table a patched build against
#               base), also printed
#   ab.json     the same rows as JSON ({"runs": [{"build", "rep", "config", "results"}]})
#   tests.log   each patched build's GPU tests (--tests), each under "== <build>"
#   trace_base.txt, trace_new.txt   `cpidx bench --trace` of both trees (--trace; one PATCH)
#   sanitize_summary.txt, sanitize.log   compute-sanitizer on the new build (--sanitize; one
#               PATCH): the summary line per tool, and the tools' logs (each hazard's two accesses)
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
#   --tests FILTER     then run each patched build's cpidx_gpu_tests with this gtest filter
#   --sanitize TOOL    then scripts/gpu_sanitize.sh TOOL in the new tree (memcheck|racecheck|
#                      synccheck|all)
#   --check            only copy the tree and apply each PATCH (into a temporary folder), print
#                      the builds it would make and exit: 0 when every patch applies (no GPU,
#                      no build; run it here before spending device time)
#   --budget S         seconds the whole script may take (default 580, short of the device
#                      tool's 10-minute limit); the tests get what is left of it, so a small
#                      budget keeps a long filter from spending the session's device time
# The tests and the sanitizer run in what is left of the budget (the tests of several builds
# each a share of it).
# Examples (the v17e patch; then two patches and one stacked on the first, four builds):
#   scripts/device_ab.sh --config "" --config "--max-tokens 8192" \
#     --tests 'GpuDecode.*:GpuWorkStealing.*' docs/perf/raw/v17e_dense_offsets_when_the_batch_fits.patch
#   scripts/device_ab.sh docs/perf/raw/v52c_*.patch docs/perf/raw/v52m_*.patch \
#     docs/perf/raw/v52c_*.patch+docs/perf/raw/v52a_*.patch
set -uo pipefail
# shellcheck source=scripts/device_common.sh
. "$(dirname "$0")/device_common.sh"
tests="" sanitize="" patches=() budget=580 check=0
while [ $# -gt 0 ]; do
  bench_option "$@"
  [ "$taken" -gt 0 ] && { shift "$taken"; continue; }
  case "$1" in
    --tests) tests=$2; shift 2 ;;
    --sanitize) sanitize=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --check) check=1; shift ;;
    -h|--help) sed -n '2,/^set /{/^#/p}' "$0"; exit 0 ;;
    -*) echo "device_ab.sh: unknown option $1" >&2; exit 2 ;;
    *) patches+=("$1"); shift ;;
  esac
done
if [ ${#patches[@]} -eq 0 ]; then
  echo "device_ab.sh: PATCH file needed (see --help)" >&2
  exit 2
fi
for spec in "${patches[@]}"; do
  IFS=+ read -ra files <<<"$spec"
  for f in "${files[@]}"; do
    [ -f "$f" ] || { echo "device_ab.sh: no patch file $f (in $spec)" >&2; exit 2; }
  done
done
if [ ${#patches[@]} -gt 1 ] && { [ -n "$trace" ] || [ -n "$sanitize" ]; }; then
  echo "device_ab.sh: --trace and --sanitize take one PATCH" >&2
  exit 2
fi
[ ${#configs[@]} -eq 0 ] && configs=("")
ab_dir=build-ab
if [ $check -eq 1 ]; then
  ab_dir=$(mktemp -d) log=/dev/null
  trap 'rm -rf "$ab_dir"' EXIT
else
  device_log_start ab.txt
fi

# Each patched copy: the tree without build outputs, then its patches (git apply in a repository
# of its own: inside this one it would skip the paths outside the copy). A copy left by an
# earlier call on a warm machine is reused (its build too) only if neither the tree's files nor
# its patches changed since.
skip=('./build*' ./device-out ./.git)  # not the tree: build outputs, results, history
tar_skip=() find_skip=(-false)
for x in "${skip[@]}"; do tar_skip+=(--exclude="$x") find_skip+=(-o -path "$x"); done
tree_sum=$(find . \( "${find_skip[@]}" \) -prune -o -type f -print0 | sort -z | xargs -0 sha256sum |
  sha256sum | cut -c1-16)
names=() dirs=()
for spec in "${patches[@]}"; do
  IFS=+ read -ra files <<<"$spec"
  name="" sum=$tree_sum
  for f in "${files[@]}"; do
    name+=${name:++}$(basename "$f" .patch)
    sum+=$(sha256sum "$f" | cut -c1-16)
  done
  dir=$ab_dir/$name
  if [ "$(cat "$dir/.applied" 2>/dev/null)" != "$sum" ]; then  # new, or a patch changed
    rm -rf "$dir" && mkdir -p "$dir"
    tar "${tar_skip[@]}" -cf - . | tar -xf - -C "$dir"
    (cd "$dir" && git init -q .) || exit 1
    for f in "${files[@]}"; do
      abs=$(realpath "$f")
      (cd "$dir" && git apply "$abs") || {
        echo "device_ab.sh: $f does not apply to this tree (in $spec)" | tee -a "$log"
        exit 1
      }
    done
    echo "$sum" >"$dir/.applied"
  fi
  names+=("$name") dirs+=("$dir")
done
[ ${#patches[@]} -eq 1 ] && names=(new)
if [ $check -eq 1 ]; then
  for i in "${!names[@]}"; do echo "${names[$i]} = the tree + ${patches[$i]}: applies"; done
  exit 0
fi
build() {  # build SOURCE_DIR TARGET...: scripts/device.sh's build in SOURCE_DIR/build-device
  (cd "$1" && TARGETS="${*:2}" OUT="$OUT" scripts/device.sh build) ||
    { echo "device_ab.sh: build of $1 failed"; return 1; }
}
new_targets=(cpidx_tool)
[ -n "$tests" ] && new_targets+=(cpidx_gpu_tests)
build . cpidx_tool & pids=($!)
for dir in "${dirs[@]}"; do
  build "$dir" "${new_targets[@]}" & pids+=($!)
done
built=1
for pid in "${pids[@]}"; do wait "$pid" || built=0; done
[ $built -eq 1 ] || exit 1
echo "# built in $(elapsed) s; base = the working tree; $(for i in "${!names[@]}"; do
  printf '%s = + %s; ' "${names[$i]}" "${patches[$i]}"; done)" | tee -a "$log"
new=${dirs[0]}  # the one patched tree of --trace and --sanitize

jsons=()
# Each rep starts one build later (rep 1 with the base, rep 2 with the first patched build, ...),
# so that over a multiple of the builds' count of reps every build runs in every place: in
# d1207e (docs/perf/README.md) three builds that ran in one fixed order parted by ~1%, and
# their places could not be told from the builds.
nbuilds=$((${#names[@]} + 1))
for ((rep = 1; rep <= reps; ++rep)); do
  for cfg in "${configs[@]}"; do
    for ((i = 0; i < nbuilds; ++i)); do
      b=$(((i + rep - 1) % nbuilds))
      which=base bin=./build-device/cpidx
      if [ $b -gt 0 ]; then
        which=${names[$((b - 1))]} bin=${dirs[$((b - 1))]}/build-device/cpidx
      fi
      json=$new/ab_${b}_${rep}_${#jsons[@]}.json
      rm -f "$json"  # a reused copy's from an earlier call: a failed run must show as missing
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
  : >"$OUT/tests.log"
  for i in "${!names[@]}"; do
    left=$(( (budget - $(elapsed)) / (${#names[@]} - i) ))  # a share of what is left
    [ "$left" -gt 0 ] || left=1
    echo "== ${names[$i]}" >>"$OUT/tests.log"
    timeout "$left" "${dirs[$i]}/build-device/tests/cpidx_gpu_tests" --gtest_filter="$tests" \
      >"$OUT/tests_one.log" 2>&1
    one=$?
    [ $one -eq 0 ] || rc=$one
    cat "$OUT/tests_one.log" >>"$OUT/tests.log"
    echo "# tests (${names[$i]}) exit $one at $(elapsed) s ($left s allowed)" | tee -a "$log"
    grep -E "^\[  (PASSED|FAILED|SKIPPED) " "$OUT/tests_one.log" | tee -a "$log"
  done
  rm -f "$OUT/tests_one.log"
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
