#!/usr/bin/env bash
# scripts/test.sh: on a fresh Debian 12 machine, install what is missing, build the `ci` preset
# and run the whole C++ test suite with ctest (CPU, MPI at 2 and 4 ranks, and GPU tests, which
# skip themselves without a GPU); then fuzz the reference for 60 s (scripts/fuzz.sh) and run the
# CPU suite again under ASan + UBSan (asan preset); then pip-install the Python package (CPU-only
# wheel, in a venv under build-ci/; torch too with CPIDX_TEST_TORCH=1, as CI sets it) and run
# pyflakes (flake8 --select=F) over the Python sources, then pytest (GPU tests skip
# themselves, and torch tests without torch). Extra arguments go to both
# ctest runs. Stops at the first failing step; pytest's summary is the last line.
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "$0")/common.sh"
cpidx_prepare
cpidx_log "testing (ctest --preset ci -j$(nproc))"
ctest --preset ci -j"$(nproc)" "$@"
# Hardening: a short libFuzzer run of validation + reference (clang, installed when missing),
# then the CPU suite again under ASan + UBSan (the asan preset).
./scripts/fuzz.sh 60
cpidx_log "building the asan preset (CPU only, ASan + UBSan; log in build-asan/build.log)"
mkdir -p build-asan
if ! { cmake --preset asan && cmake --build --preset asan -j"$(nproc)"; } >build-asan/build.log 2>&1; then
  tail -n 40 build-asan/build.log
  cpidx_log "asan build failed (build-asan/build.log)"
  exit 1
fi
cpidx_log "testing under ASan + UBSan (ctest --preset asan -j$(nproc))"
ctest --preset asan -j"$(nproc)" "$@"
cpidx_install_python
# Names the Python tests cannot reach (the CUDA-only paths skip here) still fail: pyflakes' checks.
cpidx_log "pyflakes checks of python/ and examples/ (flake8 --select=F; log in build-ci/pip-flake8.log)"
build-ci/pyenv/bin/python -m pip install --disable-pip-version-check -q "flake8>=7,<8" \
  >build-ci/pip-flake8.log 2>&1 || { tail -n 20 build-ci/pip-flake8.log; exit 1; }
build-ci/pyenv/bin/python -m flake8 --select=F python examples
cpidx_log "testing the Python package (pytest python/tests)"
rc=0
build-ci/pyenv/bin/python -m pytest python/tests -q -p no:cacheprovider || rc=$?
if [ "$rc" -eq 5 ]; then
  cpidx_log "pytest collected no tests: treated as a failure"
  exit 1
fi
exit "$rc"
