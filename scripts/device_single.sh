#!/usr/bin/env bash
# scripts/device_single.sh: everything single-GPU in one device call, most important first:
# build + the GPU tests (decode and prefill), the prefill benchmark, optional decode benchmarks
# (DECODE_BENCH="flags[;flags...]", one JSON per set, rewritten after every row so a set cut at
# its time limit keeps the rows it finished), optional Nsight Compute profiles
# (NCU_RUNS="kernel regex|bench flags[;...]", all into ncu.txt), the fused kernel's timeline
# (TRACE_FLAGS="bench flags": scripts/device_trace.sh), compute-sanitizer on the small cases,
# the Python suite on the GPU. Each stage is time-boxed; each writes one or two files straight
# into $OUT (few files come back from the device machine), so a call stopped at its limit still
# returns what finished.
# Knobs: GTEST_FILTER, TEST_TIMEOUT (s, default 330), SKIP_TESTS=1, PREFILL_FLAGS, DECODE_BENCH,
# NCU_RUNS, TRACE_FLAGS, SANITIZE_TOOLS (default all), SKIP_SANITIZE=1, SKIP_PYTHON=1,
# SKIP_PREFILL=1 (no prefill bench: a call of decode tests alone), SKIP_INSTALL_TEST=1,
# PYTHON_TIMEOUT (s, default 400: the pip install and the whole suite), PYTHON_TESTS (files of
# python/tests to run instead of all: scripts/device_python.sh).
set -uo pipefail
export OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
rc=0
# The build has its own time box: a cold build of every target took ~200 s of the tests' 330
# (v37), and the tests' box is theirs alone (TEST_TIMEOUT; the whole suite runs longer than one
# call holds, so split it by GTEST_FILTER over calls).
timeout 300 scripts/device.sh build || { echo "build failed or timed out"; exit 1; }
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-330}" scripts/device.sh tests || rc=1
fi
# (Not with TARGETS=...: cmake --install needs every installed library and the tool built.)
if [ "${SKIP_INSTALL_TEST:-0}" != 1 ] && [ -z "${TARGETS:-}" ]; then
  # The install and examples/cpp against it, now with a GPU: its Decoder step is compared with
  # the CPU reference (ctest InstallAndFindPackage; the tool and every library are built above).
  echo "== install + examples/cpp (${SECONDS}s)"
  CPIDX_EXPECT_GPU=1 timeout 120 ctest --test-dir build-device -R InstallAndFindPackage -V \
    >"$OUT/install_test.log" 2>&1 || rc=1
  grep -E "^[0-9]+: (head 0|gpu:)|tests passed|tests failed" "$OUT/install_test.log"
fi
if [ "${SKIP_PREFILL:-0}" != 1 ]; then
  echo "== prefill bench (${SECONDS}s)"
  read -r -a prefill_flags <<<"${PREFILL_FLAGS:-}"
  timeout 100 ./build-device/cpidx bench --prefill "${prefill_flags[@]}" --json "$OUT/prefill.json" || rc=1
fi
if [ -n "${DECODE_BENCH:-}" ]; then
  IFS=';' read -ra sets <<<"$DECODE_BENCH"
  for i in "${!sets[@]}"; do
    echo "== decode bench $i: ${sets[$i]} (${SECONDS}s)"
    name=decode.json; [ "$i" -gt 0 ] && name=decode$i.json
    # shellcheck disable=SC2086  # each set holds separate flags
    timeout 120 ./build-device/cpidx bench ${sets[$i]} --json "$OUT/$name" || rc=1
  done
fi
if [ -n "${NCU_RUNS:-}" ]; then
  IFS=';' read -ra runs <<<"$NCU_RUNS"
  for r in "${runs[@]}"; do
    echo "== ncu ${r} (${SECONDS}s)" | tee -a "$OUT/ncu.txt"
    # One launch of the kernel after the warm-up ones; clocks left as they are (METHOD.md).
    # shellcheck disable=SC2086
    timeout 150 ncu --clock-control none -k "regex:${r%%|*}" --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
      ./build-device/cpidx bench ${r#*|} >>"$OUT/ncu.txt" 2>&1 || rc=1
  done
fi
if [ -n "${TRACE_FLAGS:-}" ]; then
  echo "== trace: ${TRACE_FLAGS} (${SECONDS}s)"
  # shellcheck disable=SC2086
  timeout 200 scripts/device_trace.sh $TRACE_FLAGS || rc=1
fi
if [ "${SKIP_SANITIZE:-0}" != 1 ]; then
  echo "== compute-sanitizer (${SECONDS}s)"
  SAN_OUT=/tmp/cpidx-sanitize
  rm -rf "$SAN_OUT"  # a warm machine keeps the last call's logs
  OUT=$SAN_OUT timeout 150 scripts/gpu_sanitize.sh "${SANITIZE_TOOLS:-all}" >/dev/null 2>&1 || rc=1
  cp "$SAN_OUT/sanitize_summary.txt" "$OUT/" 2>/dev/null
  # The tools' logs name each hazard's two accesses: one file back for all of them.
  cat "$SAN_OUT"/sanitize_{memcheck,racecheck,synccheck}.log >"$OUT/sanitize.log" 2>/dev/null
  cat "$OUT/sanitize_summary.txt" 2>/dev/null
fi
if [ "${SKIP_PYTHON:-0}" != 1 ]; then
  echo "== python (${SECONDS}s)"
  # pip install ~60 s; the suite ~4 min since its torch.compile tests (inductor compiles)
  timeout "${PYTHON_TIMEOUT:-400}" scripts/device_python.sh || rc=1
fi
echo "== done (${SECONDS}s)"
exit $rc
