#!/usr/bin/env bash
# scripts/test.sh: on a fresh Debian 12 machine, install what is missing, build the `ci` preset
# and run the whole test suite with ctest (CPU, MPI at 2 and 4 ranks, and GPU tests, which skip
# themselves without a GPU). Exits with ctest's status; extra arguments go to ctest.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cpidx_prepare
cpidx_log "testing (ctest --preset ci -j$(nproc))"
ctest --preset ci -j"$(nproc)" "$@"
