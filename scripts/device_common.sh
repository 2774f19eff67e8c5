# shellcheck shell=bash
# scripts/device_common.sh: sourced by the device scripts that log one timed call
# (device_ab.sh, device_configs.sh). `device_log_start NAME`: $OUT made (default ./device-out),
# CUDA on PATH and NVLink multicast off (NCCL_NVLS_ENABLE=0) exported, the clock of `elapsed`
# started, `log` set to $OUT/NAME, and the GPU's name and clocks written as its first lines
# (and printed).

device_log_start() {
  OUT=${OUT:-$PWD/device-out}
  mkdir -p "$OUT"
  export OUT PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0
  device_t0=$(date +%s)
  log=$OUT/$1
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$log"
}

elapsed() { echo $(( $(date +%s) - device_t0 )); }
