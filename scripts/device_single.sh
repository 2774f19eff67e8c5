#!/usr/bin/env bash
# scripts/device_single.sh: everything single-GPU in one device call: build, the GPU tests (decode
# and prefill), compute-sanitizer on the small cases, the prefill benchmark at the shape,
# and the Python suite on the GPU. Each stage is time-boxed; logs and JSON under $OUT.
set -uo pipefail
# Few files come back from the device machine: the stages write under a scratch folder, and
# one archive of it lands in $OUT.
FINAL=${OUT:-$PWD/device-out}
export OUT=/tmp/cpidx-device-out
rm -rf "$OUT"; mkdir -p "$OUT" "$FINAL"
trap 'tar czf "$FINAL/logs.tgz" -C "$OUT" .' EXIT
rc=0
timeout 330 scripts/device.sh tests || rc=1
echo "== compute-sanitizer"
timeout 150 scripts/gpu_sanitize.sh all >/dev/null 2>&1 || rc=1
cat "$OUT/sanitize_summary.txt" 2>/dev/null
grep -h "RACECHECK SUMMARY\|ERROR SUMMARY" "$OUT"/sanitize_*.log 2>/dev/null | sort | uniq -c
echo "== prefill bench"
timeout 100 ./build-device/cpidx bench --prefill ${PREFILL_FLAGS:-} --json "$OUT/prefill.json" 2>&1 | tee "$OUT/prefill.log" || rc=1
echo "== python"
timeout 200 scripts/device_python.sh || rc=1
exit $rc
