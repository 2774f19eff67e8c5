#!/usr/bin/env bash
# scripts/device_trace.sh [--build-only] [bench flags...]: on the GPU machine, build the tool
# with the fused kernel's timeline compiled in (-DCPIDX_TRACE, build-trace/; never a release
# build) and run `cpidx bench --trace` with the given flags; the per-shape timelines go to
# $OUT/trace.txt. --build-only: build, run nothing (scripts/device_ab.sh --trace builds two at
# once and runs them one after the other).
set -uo pipefail
build_only=0
[ "${1:-}" = --build-only ] && { build_only=1; shift; }
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT" build-trace
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0
gtest_src=()
[ -d .deps/googletest ] && gtest_src=(-DCPIDX_GTEST_SOURCE_DIR="$PWD/.deps/googletest")
cmake -S . -B build-trace -G Ninja -DCMAKE_BUILD_TYPE=Release -DCPIDX_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_CUDA_FLAGS=-DCPIDX_TRACE -DCMAKE_CXX_FLAGS=-DCPIDX_TRACE \
  "${gtest_src[@]}" >build-trace/configure.log 2>&1 || { tail -30 build-trace/configure.log; exit 1; }
cmake --build build-trace -j"$(nproc)" --target cpidx_tool >build-trace/build.log 2>&1 ||
  { grep -E "error" -A3 build-trace/build.log | head -40; exit 1; }
[ $build_only = 1 ] && exit 0
./build-trace/cpidx bench --trace "$@" >"$OUT/trace.txt" 2>&1
