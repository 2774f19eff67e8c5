#!/usr/bin/env bash
# scripts/device_grid.sh: on the GPU machine, the decode grid of TARGETS.md (modes plain1,
# plain4, cp2, cp4; 1, 8 and 64 requests; contexts 8K, 64K, 256K and 1M; Q = 1 and 4: 96 rows a
# dtype) in three `cpidx bench` calls a dtype, one after another (--reqs 1; --reqs 8,64 at 8K
# and 64K; --reqs 8,64 at 256K and 1M), their rows merged into $OUT/grid_<dtype>_r1.json, the
# tables into grid_<dtype>_r1.txt. With R2=1 (the default) the 32 rows of 8 and 64 requests at
# 256K and 1M run again after every dtype's run 1 (grid_<dtype>_2m_up_r2.json): the B*L >= 2M
# rows but 64 x 64K from a second call. grid_vs_peer_r1.md: bench/compare_peer.py on run 1.
# A bench call that fails or is cut at its time box keeps the rows it wrote (the tool rewrites
# its JSON after every row): the table file and the JSON's note say which call, and the exit
# status is 1.
# Knobs: DTYPES (default "bf16 fp8"), R2 (0 or 1), CPIDX_TOOL (a built tool; default: build
# build-device/cpidx with scripts/device.sh), NOTE (the merged JSON's note).
set -uo pipefail
# shellcheck source=scripts/device_common.sh
. "$(dirname "$0")/device_common.sh"
device_log_start gpu.txt  # $OUT, CUDA on PATH, NVLS off, the GPU's name and clocks
tool=${CPIDX_TOOL:-}
if [ -z "$tool" ]; then
  TARGETS=cpidx_tool timeout 300 scripts/device.sh build || { echo "build failed"; exit 1; }
  tool=./build-device/cpidx
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
rm -f "$OUT/grid_vs_peer_r1.md"  # a reused $OUT: never a previous run's table
rc=0

# run NAME DTYPE FLAGS... : one bench call per FLAGS (bench flags), rows merged into $OUT/NAME.json
run() {
  local name=$1 dt=$2; shift 2
  local parts=() i=0 flags status failed=""
  : >"$OUT/$name.txt"
  rm -f "$OUT/$name.json"  # never a previous run's rows under this run's name
  for flags in "$@"; do
    echo "== $name: --dtype $dt $flags (${SECONDS}s)" | tee -a "$OUT/$name.txt"
    # shellcheck disable=SC2086  # flags holds separate flags
    timeout 200 "$tool" bench --dtype "$dt" $flags --json "$scratch/$name.$i.json" \
      >>"$OUT/$name.txt" 2>&1
    status=$?
    if [ $status -ne 0 ]; then
      echo "== exit $status (124: cut at the time box): the rows above are all it wrote" |
        tee -a "$OUT/$name.txt"
      failed+=" [call $((i + 1)) exited $status]"
      rc=1
    fi
    parts+=("$scratch/$name.$i.json")
    i=$((i + 1))
  done
  python3 - "$OUT/$name.json" "${NOTE:-device_grid.sh} ($name): $(IFS=';'; echo "$*")$failed" \
    "${parts[@]}" <<'EOF'
import json, os, sys
out, note, parts = sys.argv[1], sys.argv[2], [p for p in sys.argv[3:] if os.path.exists(p)]
if not parts:
    sys.exit(f"{out}: no bench call wrote its JSON")
merged = None
for p in parts:
    try:
        d = json.load(open(p))
    except ValueError as e:  # a safeguard: the tool writes a .tmp and renames it
        note += f" [{os.path.basename(p)} unreadable: {e}]"
        continue
    if merged is None:
        merged = d
        continue
    merged["results"] += d["results"]
    merged["step_results"] = merged.get("step_results", []) + d.get("step_results", [])
if merged is None:
    sys.exit(f"{out}: no bench call left a readable JSON")
merged["note"] = note
json.dump(merged, open(out, "w"), indent=1)
print(f"{out}: {len(merged['results'])} rows, checks:",
      sorted({r['check'] for r in merged['results']}))
EOF
}

# Every dtype's run 1 before any run 2: a call cut at its limit keeps whole grids.
for dt in ${DTYPES:-bf16 fp8}; do
  run "grid_${dt}_r1" "$dt" "--reqs 1" "--reqs 8,64 --contexts 8K,64K" \
    "--reqs 8,64 --contexts 256K,1M" || rc=1
done
for dt in ${DTYPES:-bf16 fp8}; do
  [ "${R2:-1}" = 1 ] || break
  run "grid_${dt}_2m_up_r2" "$dt" "--reqs 8,64 --contexts 256K,1M" || rc=1
done
# The targets' tables (against the peer's H200 figures, and fp8 against bf16), run 1's rows.
r1=()
for dt in ${DTYPES:-bf16 fp8}; do
  [ -s "$OUT/grid_${dt}_r1.json" ] && r1+=("$OUT/grid_${dt}_r1.json")
done
if [ ${#r1[@]} -gt 0 ]; then
  python3 bench/compare_peer.py "${r1[@]}" >"$OUT/grid_vs_peer_r1.md" || rc=1
fi
echo "== done (${SECONDS}s)"
exit $rc
