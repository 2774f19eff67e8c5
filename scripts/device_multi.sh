#!/usr/bin/env bash
# scripts/device_multi.sh: one call on the 2-GPU machine: build, single-GPU tests, multi-GPU tests
# (threads and MPI), the whole-step benchmark on both GPUs and a single-GPU bench subset.
# Logs and JSON under $OUT. Each stage is time-boxed so the call fits the device budget.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
EXTRA_TARGETS="cpidx_multigpu_tests cpidx_multigpu_mpi_tests" timeout 300 scripts/device.sh tests
rc=$?
echo "== multi-GPU tests (one process, a thread per GPU)"
timeout 240 build-device/tests/cpidx_multigpu_tests --gtest_output=json:"$OUT/multigpu_tests.json" \
  > "$OUT/multigpu_tests.log" 2>&1; m=$?
grep -E "^\[  (FAILED|PASSED|SKIPPED)|OK \]|Failure" "$OUT/multigpu_tests.log" | head -40; echo "multigpu rc=$m"
echo "== multi-GPU tests under MPI"
timeout 120 mpirun -np 2 --oversubscribe -x NCCL_NVLS_ENABLE=0 build-device/tests/cpidx_multigpu_mpi_tests \
  > "$OUT/multigpu_mpi.log" 2>&1; mm=$?
tail -5 "$OUT/multigpu_mpi.log"; echo "mpi rc=$mm"
echo "== whole step on 2 GPUs"
timeout 150 build-device/cpidx bench --modes step2 --reqs ${STEP_REQS:-1,8,64} --contexts ${STEP_CTX:-8K,1M} \
  --qlens 1 --json "$OUT/step2.json" 2>&1 | tee "$OUT/step2.log"
echo "== single-GPU subset"
timeout 120 build-device/cpidx bench --modes plain4,plain1,cp4 --reqs 1,8 --contexts 8K,64K,256K,1M \
  --qlens 1,4 --pool-mb 2048 --json "$OUT/bench_subset.json" 2>&1 | tee "$OUT/bench_subset.log"
[ $rc -eq 0 ] && [ $m -eq 0 ] && [ $mm -eq 0 ]
