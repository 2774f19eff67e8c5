// tools/graph_timing.h: how the benchmarks time a captured CUDA graph: `warmup` untimed
// launches, then `replays` launches each between two events on the stream; the median.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

namespace cpidx::tools {

inline cudaError_t median_graph_ms(cudaGraphExec_t exec, cudaStream_t stream, int warmup,
                                   int replays, float* median_ms) {
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  cudaError_t e = cudaEventCreate(&e0);
  if (e == cudaSuccess) e = cudaEventCreate(&e1);
  std::vector<float> times;
  for (int i = 0; e == cudaSuccess && i < warmup + replays; ++i) {
    e = cudaEventRecord(e0, stream);
    if (e == cudaSuccess) e = cudaGraphLaunch(exec, stream);
    if (e == cudaSuccess) e = cudaEventRecord(e1, stream);
    if (e == cudaSuccess) e = cudaEventSynchronize(e1);
    float ms = 0;
    if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, e0, e1);
    if (e == cudaSuccess && i >= warmup) times.push_back(ms);
  }
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  if (e != cudaSuccess) return e;
  std::sort(times.begin(), times.end());
  *median_ms = times.empty() ? 0.f : times[times.size() / 2];
  return cudaSuccess;
}

}  // namespace cpidx::tools
