// tools/bench_step.h: `cpidx bench --modes stepP`: the whole context-parallel step on P real GPUs
// (one host thread per GPU, or one process per GPU under mpirun; inside one CUDA graph per GPU,
// both exchanges included), and the exchange alone (two all-gathers of the step's payload
// sizes), timed across all the GPUs. The exchanges go through NCCL or the peer communicator
// (cpidx/comm_peer.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "cpidx/comm.h"

namespace cpidx::tools {

struct StepShape {
  int world = 2;  // P GPUs, 0..P-1
  int reqs = 1;
  int64_t context = 8192;
  int qlen = 1;
  std::string exchange = "nccl";  // "nccl", "peer" or "peer-gather" (no device channel)
  bool work_stealing = true;      // DecodeConfig::work_stealing
};

struct StepResult {
  double us = 0;           // the whole step: median replay / calls
  double exchange_us = 0;  // the two all-gathers alone: median replay / calls
  double floor_us = 0;     // shard cache bytes / 4.5 TB/s
  double cache_mb = 0;     // cache bytes of the whole batch (all ranks)
  double gbps = 0;         // shard cache bytes / us
  int sets = 0, calls = 0;
  int64_t q_bytes = 0, k_bytes = 0;  // per rank: queries [n, L, D] bf16, keys [T, n, K]
  std::string check;       // "ok", "FAIL(rows)" or the error
};

class StepBench {
 public:
  // `processes`: under mpirun, the host communicator of the processes (this process is one rank
  // on GPU rank % devices; not owned, must outlive the bench); nullptr: one thread per GPU.
  // Under MPI every process must call run() with the same shapes in the same order.
  StepBench(int64_t pool_mb, std::string dtype, bool pdl, Communicator* processes = nullptr);
  ~StepBench();
  StepBench(const StepBench&) = delete;
  StepBench& operator=(const StepBench&) = delete;

  // Empty when this build and machine can run a step of `world` GPUs; else why not.
  std::string unavailable(int world) const;
  // "NCCL 2.28.3 (library), ...; NCCL_GRAPH_MIXING_SUPPORT=unset; NCCL_NVLS_ENABLE=0"
  static std::string environment();

  StepResult run(const StepShape& shape, int replays);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cpidx::tools
