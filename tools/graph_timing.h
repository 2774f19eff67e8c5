// tools/graph_timing.h: how the benchmarks time a captured CUDA graph: `warmup` untimed
// launches, then `replays` launches each between two events on the stream; the median (and,
// if asked, the slowest and its index among the timed replays). `after_replay`, if given, is
// called on the host after each timed replay has finished, before the next is launched, with
// its index and time (ms): what the GPU left of that replay (a trace) can be read there; an
// error it returns ends the timing.
//
// Two clocks: the plain one (the peer's method, PEER_H200.md) starts when the GPU reaches the
// first event, so it also counts the host's cudaGraphLaunch latency before the graph's first
// node; `hold_stream` holds the stream behind a host function until the events and the graph
// are all queued, so the replay is timed on the GPU alone (what the same work costs as nodes of
// an engine's larger decode graph).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <vector>

namespace cpidx::tools {

namespace detail {
inline void CUDART_CB spin_until_released(void* flag) {
  auto* f = static_cast<std::atomic<int>*>(flag);
  while (f->load(std::memory_order_acquire) == 0) {
  }
}
}  // namespace detail

inline cudaError_t median_graph_ms(cudaGraphExec_t exec, cudaStream_t stream, int warmup,
                                   int replays, float* median_ms, bool hold_stream = false,
                                   float* max_ms = nullptr, int* max_at = nullptr,
                                   const std::function<cudaError_t(int, float)>& after_replay = {}) {
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  cudaError_t e = cudaEventCreate(&e0);
  if (e == cudaSuccess) e = cudaEventCreate(&e1);
  std::vector<float> times;
  std::atomic<int> release{0};
  for (int i = 0; e == cudaSuccess && i < warmup + replays; ++i) {
    release.store(0, std::memory_order_release);
    if (hold_stream) e = cudaLaunchHostFunc(stream, detail::spin_until_released, &release);
    if (e == cudaSuccess) e = cudaEventRecord(e0, stream);
    if (e == cudaSuccess) e = cudaGraphLaunch(exec, stream);
    if (e == cudaSuccess) e = cudaEventRecord(e1, stream);
    release.store(1, std::memory_order_release);  // always: a held stream must not stay held
    if (e == cudaSuccess) e = cudaEventSynchronize(e1);
    float ms = 0;
    if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, e0, e1);
    if (e == cudaSuccess && i >= warmup) {
      times.push_back(ms);
      if (after_replay) e = after_replay(i - warmup, ms);
    }
  }
  if (e != cudaSuccess) cudaStreamSynchronize(stream);  // the host function has returned
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  if (e != cudaSuccess) return e;
  const auto slowest = std::max_element(times.begin(), times.end());
  if (max_ms) *max_ms = times.empty() ? 0.f : *slowest;
  if (max_at) *max_at = static_cast<int>(slowest - times.begin());
  std::sort(times.begin(), times.end());
  *median_ms = times.empty() ? 0.f : times[times.size() / 2];
  return cudaSuccess;
}

}  // namespace cpidx::tools
