#!/usr/bin/env bash
# scripts/demo.sh: on a fresh Debian 12 machine, install what is missing, build the `ci` preset
# and run `cpidx demo` (extra arguments go to the demo, e.g. ./scripts/demo.sh --query-len=4).
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "$0")/common.sh"
cpidx_prepare
cpidx_log "running build-ci/cpidx demo $*"
./build-ci/cpidx demo "$@"
