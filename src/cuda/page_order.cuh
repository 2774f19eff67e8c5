// src/cuda/page_order.cuh: the flattened page order of a decode step, shared by score_topk and
// select_topk so both kernels number the pages alike: request r's owned pages (its shard's blocks
// under the clamped length) are [prefix[r], prefix[r + 1]) of the step.
#pragma once

#include "kernels.h"

namespace cpidx {
namespace cuda {

__device__ __forceinline__ int64_t request_blocks(int32_t seq_len, int64_t max_blocks) {
  const int64_t b = cdiv(seq_len, kBlockSize);
  return b < max_blocks ? b : max_blocks;
}

__device__ __forceinline__ int64_t owned_pages(const ScoreTopkParams& p, int32_t seq_len,
                                               int32_t* err) {
  const int32_t len = clamp_seq_len(seq_len, p.max_seq_len, err);
  return owned_blocks(request_blocks(len, p.max_blocks), p.world, p.rank);
}

// The requests [*r0, *r1) this thread of a kThreads-thread CTA counts: contiguous chunks.
template <int kThreads>
__device__ __forceinline__ void thread_requests(int num_reqs, int* r0, int* r1) {
  const int per = (num_reqs + kThreads - 1) / kThreads;
  const int tid = threadIdx.x;
  *r0 = tid * per < num_reqs ? tid * per : num_reqs;
  *r1 = *r0 + per < num_reqs ? *r0 + per : num_reqs;
}

// prefix[0] = 0, prefix[r + 1] = owned pages of requests 0..r, from the lengths as read now
// (through L2: callers may run it before their PDL wait as a guess, and check it after); this
// thread counts requests [r0, r1) of thread_requests. Every thread of the CTA calls it, and
// every thread gets the most pages one request owns.
template <int kThreads>
__device__ int64_t pages_prefix(const ScoreTopkParams& p, int64_t* prefix, int r0, int r1) {
  __shared__ int64_t warp_tot[kThreads / 32], warp_max[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int32_t unused = 0;  // length errors are raised by score_topk from the lengths after its wait
  int64_t sum = 0, longest = 0;
  for (int r = r0; r < r1; ++r) {
    const int64_t own = owned_pages(p, __ldcg(p.seq_lens + r), &unused);
    prefix[r + 1] = own;
    sum += own;
    longest = own > longest ? own : longest;
  }
  int64_t incl = sum;
  for (int d = 1; d < 32; d *= 2) {
    const int64_t v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
    const int64_t m = __shfl_xor_sync(0xffffffffu, longest, d);
    longest = m > longest ? m : longest;
  }
  if (lane == 31) warp_tot[warp] = incl;
  if (lane == 0) warp_max[warp] = longest;
  __syncthreads();
  int64_t run = incl - sum;
  for (int w = 0; w < warp; ++w) run += warp_tot[w];
  for (int w = 0; w < kThreads / 32; ++w) longest = warp_max[w] > longest ? warp_max[w] : longest;
  if (threadIdx.x == 0) prefix[0] = 0;
  for (int r = r0; r < r1; ++r) {
    run += prefix[r + 1];
    prefix[r + 1] = run;
  }
  __syncthreads();
  return longest;
}

// Whether a step of `total` owned pages, the longest request owning `longest`, takes the split
// path (score_topk and select_topk decide alike from the same lengths).
__device__ __forceinline__ bool split_path(const ScoreTopkParams& p, int64_t total,
                                           int64_t longest) {
  return total <= p.split_max_pages &&
         (total <= p.split_any_pages || longest <= p.split_longest_pages);
}

}  // namespace cuda
}  // namespace cpidx
