#!/usr/bin/env bash
# scripts/fuzz.sh [SECONDS]: fuzz the host validation and the CPU reference with libFuzzer for
# SECONDS (default 60). Installs clang and its libFuzzer runtime when missing, builds the `fuzz`
# preset (clang, CPU only, ASan + UBSan) into build-fuzz/, starts from the seeds in fuzz/corpus/
# (read only; new inputs go to build-fuzz/corpus/). Exits non-zero on any crash, sanitizer report,
# hang (30 s per input) or broken invariant; the input is saved as build-fuzz/artifacts/crash-*,
# to replay: build-fuzz/fuzz/cpidx_fuzz_reference build-fuzz/artifacts/crash-...
set -euo pipefail
seconds=${1:-60}
# In CI the mutation sequence is fixed (seed 1) so a run can be reproduced; by hand it is random
# unless CPIDX_FUZZ_SEED is set (libFuzzer: 0 = random).
seed=${CPIDX_FUZZ_SEED:-$([ -n "${CI:-}" ] && echo 1 || echo 0)}
# shellcheck source=scripts/common.sh
source "$(dirname "$0")/common.sh"
cd "$(dirname "${BASH_SOURCE[0]}")/.."

clang_major() { clang++ --version 2>/dev/null | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -n1; }
# libclang_rt.fuzzer-x86_64.a (clang <= 15) or libclang_rt.fuzzer.a (per-target runtime dirs).
fuzzer_runtime_ok() {
  command -v clang++ >/dev/null 2>&1 &&
    compgen -G "$(clang++ -print-runtime-dir 2>/dev/null)/libclang_rt.fuzzer*.a" >/dev/null
}
if ! fuzzer_runtime_ok; then
  cpidx_ensure_packages  # cmake and friends, as for the main build
  command -v clang++ >/dev/null 2>&1 || cpidx_apt_install_missing clang
  # the libFuzzer runtime of that clang
  fuzzer_runtime_ok || cpidx_apt_install_missing "libclang-rt-$(clang_major)-dev"
fi

cpidx_log "building the fuzz preset (clang $(clang_major), ASan + UBSan; log in build-fuzz/build.log)"
mkdir -p build-fuzz
if ! { cmake --preset fuzz && cmake --build --preset fuzz -j"$(nproc)"; } >build-fuzz/build.log 2>&1; then
  tail -n 40 build-fuzz/build.log
  cpidx_log "fuzz build failed (build-fuzz/build.log)"
  exit 1
fi

mkdir -p build-fuzz/corpus build-fuzz/artifacts
cpidx_log "fuzzing for ${seconds} s (log in build-fuzz/fuzz.log)"
rc=0
build-fuzz/fuzz/cpidx_fuzz_reference -max_total_time="$seconds" -timeout=30 -seed="$seed" -print_final_stats=1 \
  -artifact_prefix=build-fuzz/artifacts/ build-fuzz/corpus fuzz/corpus >build-fuzz/fuzz.log 2>&1 || rc=$?
if [ "$rc" -ne 0 ]; then
  tail -n 60 build-fuzz/fuzz.log
  cpidx_log "fuzzing FAILED (exit $rc); inputs: $(find build-fuzz/artifacts -mindepth 1 -maxdepth 1 -printf '%f ')"
  exit "$rc"
fi
grep -E '^Done|stat::(number_of_executed_units|new_units_added)' build-fuzz/fuzz.log || true
cpidx_log "fuzzing passed: no crash, sanitizer report or broken invariant in ${seconds} s"
