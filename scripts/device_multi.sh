#!/usr/bin/env bash
# scripts/device_multi.sh: one call on the 2-GPU machine: build, the multi-GPU tests (one process
# with a thread per GPU, then mpirun -np 2: NCCL and the peer communicator), the whole-step
# benchmark with both exchanges (threads, then one process per GPU under mpirun), the demo under
# mpirun, and the 2-GPU soak with each exchange (issue #7). Every stage is
# time-boxed against one deadline (DEADLINE seconds, default 500) so the call fits the device
# budget; at most 8 files land under $OUT (the bench and demo
# logs in step2.log; the soak prints its JSON into soak.log). The single-GPU suite's one test
# that needs two GPUs (GpuValidation.CallsWithAnotherDeviceCurrentAreRefused) runs first;
# WITH_SINGLE=1 runs the whole single-GPU suite instead. Last, with PYTHON=1 (the default) and
# at least 200 s before the deadline, scripts/device_python.sh on test_gpu.py: its 2-GPU tests
# and the torchrun example with each exchange (their logs in python.log). The single-GPU
# suite's log heads multigpu_tests.log: 8 files come back, the device tool's limit.
# Knobs: STEP_REQS, STEP_CTX (bench shapes), SOAK_STEPS (default 100000 per exchange), PYTHON.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
DEADLINE=${DEADLINE:-500}
# Seconds left for a stage: its own cap, or what remains before the deadline (at least 10).
box() { local left=$((DEADLINE - SECONDS)); [ "$left" -lt "$1" ] && echo $((left > 10 ? left : 10)) || echo "$1"; }

{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv; nvidia-smi topo -m; } \
  > "$OUT/build.log" 2>&1
gtest_src=()
[ -d .deps/googletest ] && gtest_src=(-DCPIDX_GTEST_SOURCE_DIR="$PWD/.deps/googletest")
targets=(cpidx_tool cpidx_multigpu_tests cpidx_multigpu_mpi_tests cpidx_gpu_tests)
echo "== build (${targets[*]})"
{ cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DCPIDX_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a "${gtest_src[@]}" &&
  timeout "$(box 300)" cmake --build build-device -j"$(nproc)" --target "${targets[@]}"; } \
  >> "$OUT/build.log" 2>&1 || { grep -E "error|Error" -A3 "$OUT/build.log" | head -60; exit 1; }
echo "build done at ${SECONDS}s"

rc=0
single_filter=GpuValidation.CallsWithAnotherDeviceCurrentAreRefused  # needs a second GPU
[ "${WITH_SINGLE:-0}" = 1 ] && single_filter='*'
echo "== single-GPU suite: $single_filter"
single_log=$(mktemp)
timeout "$(box 240)" build-device/tests/cpidx_gpu_tests --gtest_filter="$single_filter" \
  > "$single_log" 2>&1 || rc=1
grep -E "^\[  (FAILED|PASSED|SKIPPED)|Failure" "$single_log" | head -30

echo "== multi-GPU tests (one process, a thread per GPU; NCCL and peer)"
timeout "$(box 200)" build-device/tests/cpidx_multigpu_tests > "$OUT/multigpu_tests.log" 2>&1; m=$?
# The single-GPU suite's log goes first in the same file (the device tool returns 8 files).
{ echo "== cpidx_gpu_tests --gtest_filter=$single_filter"; cat "$single_log"
  echo "== cpidx_multigpu_tests"; cat "$OUT/multigpu_tests.log"; } > "$single_log.all"
mv "$single_log.all" "$OUT/multigpu_tests.log"; rm -f "$single_log"
grep -E "^\[  (FAILED|PASSED|SKIPPED)|OK \]|Failure" "$OUT/multigpu_tests.log" | head -60; echo "multigpu rc=$m (${SECONDS}s)"

echo "== multi-GPU tests under MPI (one process per GPU; NCCL and peer over CUDA IPC)"
timeout "$(box 150)" mpirun -np 2 --oversubscribe -x NCCL_NVLS_ENABLE=0 \
  build-device/tests/cpidx_multigpu_mpi_tests > "$OUT/multigpu_mpi.log" 2>&1; mm=$?
grep -E "^\[  (FAILED|PASSED)|OK \]|Failure|rank [0-9]\]" "$OUT/multigpu_mpi.log" | head -40
tail -2 "$OUT/multigpu_mpi.log"; echo "mpi rc=$mm (${SECONDS}s)"

echo "== whole step on 2 GPUs, NCCL and peer exchanges"
timeout "$(box 150)" build-device/cpidx bench --modes step2 --exchange both \
  --reqs "${STEP_REQS:-1,8,64}" --contexts "${STEP_CTX:-8K,128K}" --qlens 1 \
  --json "$OUT/step2.json" > "$OUT/step2.log" 2>&1; b=$?
cat "$OUT/step2.log"; echo "step2 rc=$b (${SECONDS}s)"

echo "== whole step and demo under mpirun (one process per GPU; peer and NCCL)"
timeout "$(box 120)" mpirun -np 2 --oversubscribe -x NCCL_NVLS_ENABLE=0 build-device/cpidx bench \
  --modes step2 --exchange both --reqs "${STEP_REQS:-1,8,64}" --contexts "${STEP_CTX:-8K,128K}" \
  --qlens 1 --json "$OUT/step2_mpi.json" > "$OUT/step2_mpi.log" 2>&1; bm=$?
grep -E "^step2|one process per GPU" "$OUT/step2_mpi.log"; echo "step2 mpi rc=$bm (${SECONDS}s)"
cat "$OUT/step2_mpi.log" >> "$OUT/step2.log"; rm -f "$OUT/step2_mpi.log"
dm=0
for ex in nccl peer; do
  timeout "$(box 60)" mpirun -np 2 --oversubscribe -x NCCL_NVLS_ENABLE=0 build-device/cpidx demo \
    --context 65536 --exchange $ex >> "$OUT/step2.log" 2>&1 || dm=1
done
grep -E "^gpu selection|one MPI process per GPU" "$OUT/step2.log"; echo "demo mpi rc=$dm (${SECONDS}s)"

echo "== soak: ${SOAK_STEPS:-100000} steps per exchange (T=4, Q 1..2, up to 8 x 16K)"
s=0
soak_json=$(mktemp)
for ex in peer nccl; do
  timeout "$(box 150)" build-device/cpidx soak --exchange $ex --steps "${SOAK_STEPS:-100000}" \
    --json "$soak_json" >> "$OUT/soak.log" 2>&1; r=$?
  [ $r -eq 124 ] && echo "soak $ex: killed by the time box (see soak.log)" >> "$OUT/soak.log"
  echo "soak $ex rc=$r (${SECONDS}s)"; [ $r -ne 0 ] && s=1
done
grep -E '"status"' "$OUT/soak.log" | cut -c1-400

py=0
if [ "${PYTHON:-1}" = 1 ] && [ $((DEADLINE - SECONDS)) -ge 200 ]; then
  echo "== Python suite on test_gpu.py (its 2-GPU tests) and the torchrun example (${SECONDS}s)"
  py_out=$(mktemp -d)  # its three logs become one, python.log (8 files come back)
  OUT=$py_out PYTHON_TESTS=test_gpu.py timeout "$(box 400)" scripts/device_python.sh || py=1
  shopt -s nullglob  # none when it ended early (the pip install's log says why)
  for f in "$py_out"/*.log /tmp/cpidx_pip_install.log; do echo "== $(basename "$f")"; cat "$f"
  done > "$OUT/python.log"
  shopt -u nullglob
  rm -rf "$py_out"
  echo "python rc=$py (${SECONDS}s)"
elif [ "${PYTHON:-1}" = 1 ]; then
  echo "== Python suite skipped: $((DEADLINE - SECONDS)) s left before the deadline"
fi

rm -f "$OUT"/*.tmp  # a bench killed while rewriting its JSON: the 8 files are all that come back
[ $rc -eq 0 ] && [ $m -eq 0 ] && [ $mm -eq 0 ] && [ $b -eq 0 ] && [ $bm -eq 0 ] && [ $dm -eq 0 ] &&
  [ $s -eq 0 ] && [ $py -eq 0 ]
