// tools/demo_gpu.h: the GPU part of `cpidx demo`: the plain GPU decode and the context-parallel
// step, on P real GPUs through NCCL (one host thread per GPU) or as P ranks simulated on one GPU,
// with CUDA-event stage times and the id checks (GPU plain vs CPU reference, CP vs GPU plain).
#pragma once

#include <cstdint>
#include <vector>

#include "cpidx/params.h"
#include "synthetic.h"

namespace cpidx::tools {

// CUDA devices visible to this build (0 in a CPU build or without a GPU).
int gpu_count();
// True when the build has the NCCL communicator (cpidx_comm_nccl).
bool built_with_nccl();

// Runs the step on the GPU and prints its report after the CPU one. `cpu_plain_ids` are the CPU
// reference ids [T][n][K]. `real_gpus`: the context-parallel step runs on GPUs 0..ranks-1
// through NCCL (the caller checked that they exist and that NCCL is built); otherwise the ranks
// are simulated on GPU 0. Returns kExitOk when every check passes, else kExitFailed.
int run_demo_gpu(const SyntheticStep& step, const Selection& sel, int ranks, bool real_gpus,
                 const std::vector<int32_t>& cpu_plain_ids);

}  // namespace cpidx::tools
