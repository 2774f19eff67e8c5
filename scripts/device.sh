#!/usr/bin/env bash
# scripts/device.sh: one call on the GPU machine: build for sm_90a, run the GPU tests and the
# benchmark, write logs and JSON under $OUT. Usage: scripts/device.sh [tests|bench|all|build]
# [bench flags...]; `build` only builds (TARGETS="..." replaces cpidx_tool cpidx_gpu_tests).
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0
[ "$what" = build ] || nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
# Few files come back from the device machine: build logs stay in build-device/ (printed on
# failure); $OUT gets the test log and the bench JSON.
mkdir -p build-device
gtest_src=()
[ -d .deps/googletest ] && gtest_src=(-DCPIDX_GTEST_SOURCE_DIR="$PWD/.deps/googletest")
cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DCPIDX_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a "${gtest_src[@]}" >build-device/configure.log 2>&1 ||
  { tail -30 build-device/configure.log; exit 1; }
read -r -a targets <<<"${TARGETS:-cpidx_tool cpidx_gpu_tests}"
read -r -a extra <<<"${EXTRA_TARGETS:-}"
targets+=("${extra[@]}")
cmake --build build-device -j"$(nproc)" --target "${targets[@]}" >build-device/build.log 2>&1 ||
  { grep -E "error" -A3 build-device/build.log | head -60; exit 1; }
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  ./build-device/tests/cpidx_gpu_tests ${GTEST_FILTER:+"--gtest_filter=$GTEST_FILTER"} 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "^\[  (FAILED|PASSED|SKIPPED)|OK \]|Failure|Expected|Which is|error" | head -80
  rc=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  ./build-device/cpidx bench --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
fi
exit "$rc"
