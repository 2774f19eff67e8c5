// tools/demo_gpu.h: the GPU part of `cpidx demo`: the plain GPU decode and the context-parallel
// step, on P real GPUs (one host thread per GPU through NCCL, or one MPI process per GPU through
// NCCL or the peer communicator) or as P ranks simulated on one GPU, with CUDA-event stage times
// and the id checks (GPU plain vs CPU reference, CP vs GPU plain).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cpidx/comm.h"
#include "cpidx/params.h"
#include "synthetic.h"

namespace cpidx::tools {

// True when the build has the CUDA kernels.
bool built_with_cuda();
// CUDA devices visible to this build (0 in a CPU build or without a GPU).
int gpu_count();
// True when the build has the NCCL communicator (cpidx_comm_nccl).
bool built_with_nccl();
// True when the build has the peer communicator (cpidx_comm_peer).
bool built_with_peer();

// Runs the step on the GPU and prints its report after the CPU one. `cpu_plain_ids` are the CPU
// reference ids [T][n][K]. `real_gpus`: the context-parallel step runs on GPUs 0..ranks-1
// through NCCL (the caller checked that they exist and that NCCL is built); otherwise the ranks
// are simulated on GPU 0. Returns kExitOk when every check passes, else kExitFailed.
int run_demo_gpu(const SyntheticStep& step, const Selection& sel, int ranks, bool real_gpus,
                 const std::vector<int32_t>& cpu_plain_ids);

// The same under MPI, one process per GPU: collective over `host` (every rank calls it, having
// checked together that the host has at least world_size GPUs). Each rank runs its share of the
// step on process_device(host) through `exchange` ("nccl" or "peer"); rank 0 also runs the plain
// GPU decode, gathers every rank's results over `host` and prints the report. `cpu_plain_ids`
// are only read on rank 0. Every rank returns rank 0's verdict (kExitOk or kExitFailed).
int run_demo_gpu_mpi(Communicator& host, const SyntheticStep& step, const Selection& sel,
                     const std::string& exchange, const std::vector<int32_t>& cpu_plain_ids);

}  // namespace cpidx::tools
