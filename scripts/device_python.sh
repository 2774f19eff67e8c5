#!/usr/bin/env bash
# scripts/device_python.sh: on the GPU machine, pip-install the package (CUDA build, offline: the
# image carries nanobind and scikit-build-core) into a scratch folder and run the whole pytest
# suite there, GPU tests included (with 2 GPUs its two-process test checks that "auto" picks the
# peer exchange). With 2+ GPUs also the torchrun example with --exchange peer and with
# --exchange nccl. Then test_numpy.py's tests of a CUDA build with no GPU visible
# (CUDA_VISIBLE_DEVICES empty). Three logs under $OUT.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
site=/tmp/cpidx_site
rm -rf "$site"  # pip --target keeps what a warm machine's last call installed there
CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90a" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  python3 -m pip install -q --no-build-isolation --no-deps --no-cache-dir --target "$site" . \
  >/tmp/cpidx_pip_install.log 2>&1 || { tail -40 /tmp/cpidx_pip_install.log; exit 1; }
# Run from outside the source tree so `import cpidx` is the installed package.
# PYTHON_TESTS: files under python/tests to run instead of all of them (test_gpu.py, say).
read -r -a tests <<<"${PYTHON_TESTS:-.}"
cd /tmp && PYTHONPATH="$site:$OLDPWD/python/tests" python3 -m pytest -q -p no:cacheprovider \
  -rs --durations=12 "${tests[@]/#/$OLDPWD/python/tests/}" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
rc=${PIPESTATUS[0]}
# The CUDA build with no GPU visible: the tests that need the peer communicator built and no
# GPU (CI builds without CUDA, so they run nowhere else). Their lines go to the same log.
CUDA_VISIBLE_DEVICES='' PYTHONPATH="$site:$OLDPWD/python/tests" python3 -m pytest -q \
  -p no:cacheprovider -rs "$OLDPWD/python/tests/test_numpy.py" -k "without_gpu" 2>&1 |
  tee -a "$OUT/pytest_gpu.log" | tail -3
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
cd "$OLDPWD" || exit 1
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "$ngpu" -ge 2 ]; then
  read -r -a example_args <<<"${EXAMPLE_ARGS:-}"
  for exchange in peer nccl; do
    echo "== torchrun --nproc_per_node=2 examples/indexer_layer.py --exchange $exchange"
    # --foreground: in a caller's timeout's process group, so the caller's time box reaches it.
    PYTHONPATH="$site" timeout --foreground 180 torchrun --nproc_per_node=2 \
      examples/indexer_layer.py --exchange "$exchange" "${example_args[@]}" 2>&1 |
      tee "$OUT/torchrun_$exchange.log" | tail -12
    rc2=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] && rc=$rc2
  done
fi
exit "$rc"
