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

// The request offsets a kernel keeps in shared memory: prefix[k] = owned pages of requests
// [0, k << shift), k = 0 .. num_reqs >> shift. shift 0 keeps every request's offset; a larger
// one (a Decoder planned for many more requests than shared memory holds offsets for at two CTAs
// per SM) keeps every 2^shift-th, and the offsets between are summed again from the lengths
// (RequestOffsets). From the lengths as read now (through L2: callers may run it before their PDL
// wait as a guess, and check it after); this thread counts requests [r0, r1) of
// thread_requests. Every thread of the CTA calls it, and every thread gets the step's total pages
// and the most pages one request owns.
template <int kThreads>
__device__ int64_t pages_prefix(const ScoreTopkParams& p, int64_t* prefix, int shift, int r0,
                                int r1, int64_t* total) {
  __shared__ int64_t warp_tot[kThreads / 32], warp_max[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int mask = (1 << shift) - 1;
  int32_t unused = 0;  // length errors are raised by score_topk from the lengths after its wait
  int64_t sum = 0, longest = 0;
  for (int r = r0; r < r1; ++r) {  // kept offsets in (r0, r1]: sums from r0 (+ run below)
    const int64_t own = owned_pages(p, __ldcg(p.seq_lens + r), &unused);
    sum += own;
    longest = own > longest ? own : longest;
    if (((r + 1) & mask) == 0) prefix[(r + 1) >> shift] = sum;
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
  int64_t run = incl - sum, all = 0;
  for (int w = 0; w < kThreads / 32; ++w) {
    if (w < warp) run += warp_tot[w];
    all += warp_tot[w];
    longest = warp_max[w] > longest ? warp_max[w] : longest;
  }
  if (threadIdx.x == 0) prefix[0] = 0;
  for (int k = (r0 + 1 + mask) >> shift; r0 < r1 && k <= r1 >> shift; ++k) prefix[k] += run;
  __syncthreads();
  *total = all;
  return longest;
}

// Lookups in the offsets pages_prefix kept: a request's pages, start, and the request holding a
// page. Dense (every offset kept, shift 0): shared memory alone. Sparse (shift > 0): up to
// 2^shift - 1 lengths more (L2), so callers keep the request they are on in registers. The
// kernels are compiled for each, so the dense one carries none of the sparse one's code.
template <bool kSparse>
struct RequestOffsets {
  const int64_t* prefix;
  int shift;
  int num_reqs;
  // Owned pages of request r (0 <= r < num_reqs).
  __device__ __forceinline__ int64_t pages(const ScoreTopkParams& p, int r) const {
    if constexpr (!kSparse) return prefix[r + 1] - prefix[r];
    int32_t unused = 0;
    return owned_pages(p, __ldcg(p.seq_lens + r), &unused);
  }
  // Request r's first flattened page (0 <= r < num_reqs).
  __device__ __forceinline__ int64_t first(const ScoreTopkParams& p, int r) const {
    if constexpr (!kSparse) return prefix[r];
    int64_t at = prefix[r >> shift];
    for (int q = (r >> shift) << shift; q < r; ++q) at += pages(p, q);
    return at;
  }
  // The request holding flattened page x (the last r whose first page is <= x; num_reqs - 1 past
  // the end), and its first page in *start.
  __device__ __forceinline__ int find(const ScoreTopkParams& p, int64_t x, int64_t* start) const {
    int lo = 0, hi = (num_reqs - 1) >> shift;  // the last kept offset <= x
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (prefix[mid] <= x) lo = mid; else hi = mid - 1;
    }
    int r = lo << shift;
    int64_t at = prefix[lo];
    if constexpr (!kSparse) {
      *start = at;
      return r;
    }
    const int last = r + (1 << shift) - 1 < num_reqs - 1 ? r + (1 << shift) - 1 : num_reqs - 1;
    for (; r < last; ++r) {  // the requests after the kept offset
      const int64_t next = at + pages(p, r);
      if (next > x) break;
      at = next;
    }
    *start = at;
    return r;
  }
};

// Whether a step of `total` owned pages, the longest request owning `longest`, takes the split
// path (score_topk and select_topk decide alike from the same lengths).
__device__ __forceinline__ bool split_path(const ScoreTopkParams& p, int64_t total,
                                           int64_t longest) {
  return total <= p.split_max_pages &&
         (total <= p.split_any_pages || longest <= p.split_longest_pages);
}

}  // namespace cuda
}  // namespace cpidx
