# shellcheck shell=bash
# scripts/device_common.sh: sourced by the device scripts that log one timed call
# (device_ab.sh, device_configs.sh, device_grid.sh). `device_log_start NAME`: $OUT made (default
# ./device-out), CUDA on PATH and NVLink multicast off (NCCL_NVLS_ENABLE=0) exported, the clock
# of `elapsed` started, `log` set to $OUT/NAME, and the GPU's name and clocks written as its
# first lines (and printed). `bench_option ARGS...`: the bench options device_ab.sh and
# device_configs.sh take (see below).

device_log_start() {
  OUT=${OUT:-$PWD/device-out}
  mkdir -p "$OUT"
  export OUT PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0
  device_t0=$(date +%s)
  log=$OUT/$1
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$log"
}

elapsed() { echo $(( $(date +%s) - device_t0 )); }

# The bench options device_ab.sh and device_configs.sh share, with their defaults:
#   --config "FLAGS" (repeatable: configs), --shapes "FLAGS", --reps N, --trace "FLAGS",
#   --trace-reps N.
# `bench_option "$@"` takes one of them from the front of the arguments into its variable and
# sets `taken` to the words it used: 0 when the first argument is not one of them (the caller
# parses it), 2 otherwise. Every option of those scripts but --help takes a value, so one given
# last without it is an error here (exit 2), whoever parses it.
# shellcheck disable=SC2034  # set here, read by the sourcing script
configs=() shapes="--modes plain4,cp2 --reqs 1,8 --contexts 8192,262144 --qlens 1,4" reps=2
trace="" trace_reps=1
# shellcheck disable=SC2034  # the variables it sets are the sourcing script's
bench_option() {
  taken=0
  case "$1" in -h|--help|[!-]*) return 0 ;; esac  # --help, or an operand (the PATCH)
  if [ $# -lt 2 ]; then
    echo "$(basename "$0"): $1 needs a value (or is no option: see --help)" >&2
    exit 2
  fi
  taken=2
  case "$1" in
    --config) configs+=("$2") ;;
    --shapes) shapes=$2 ;;
    --reps) reps=$2 ;;
    --trace) trace=$2 ;;
    --trace-reps) trace_reps=$2 ;;
    *) taken=0 ;;
  esac
}
