#!/usr/bin/env bash
# scripts/device_single.sh: everything single-GPU in one device call, most important first:
# build + the GPU tests (decode and prefill), the prefill benchmark, an optional decode
# benchmark (DECODE_BENCH="flags"), compute-sanitizer on the small cases, the Python suite on the
# GPU. Each stage is time-boxed; each writes one or two files straight into $OUT (few files come
# back from the device machine), so a call stopped at its limit still returns what finished.
# Knobs: GTEST_FILTER, PREFILL_FLAGS, DECODE_BENCH, SANITIZE_TOOLS (default all), SKIP_SANITIZE=1,
# SKIP_PYTHON=1.
set -uo pipefail
export OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
rc=0
timeout 330 scripts/device.sh tests || rc=1
echo "== prefill bench (${SECONDS}s)"
timeout 100 ./build-device/cpidx bench --prefill ${PREFILL_FLAGS:-} --json "$OUT/prefill.json" || rc=1
if [ -n "${DECODE_BENCH:-}" ]; then
  echo "== decode bench (${SECONDS}s)"
  # shellcheck disable=SC2086  # DECODE_BENCH holds separate flags
  timeout 120 ./build-device/cpidx bench $DECODE_BENCH --json "$OUT/decode.json" || rc=1
fi
if [ "${SKIP_SANITIZE:-0}" != 1 ]; then
  echo "== compute-sanitizer (${SECONDS}s)"
  SAN_OUT=/tmp/cpidx-sanitize
  OUT=$SAN_OUT timeout 150 scripts/gpu_sanitize.sh ${SANITIZE_TOOLS:-all} >/dev/null 2>&1 || rc=1
  cp "$SAN_OUT/sanitize_summary.txt" "$OUT/" 2>/dev/null
  cat "$OUT/sanitize_summary.txt" 2>/dev/null
fi
if [ "${SKIP_PYTHON:-0}" != 1 ]; then
  echo "== python (${SECONDS}s)"
  timeout 200 scripts/device_python.sh || rc=1
fi
echo "== done (${SECONDS}s)"
exit $rc
