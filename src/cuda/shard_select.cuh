// src/cuda/shard_select.cuh: the selection side of the fused decode kernel, run by its consumer
// warps: per-column candidate buffers compacted to their top K by rank counting, and the output
// writers. A request split across CTAs leaves one ordered list per CTA in `partial`, merged by
// select_topk (select_topk.cu).
#pragma once

#include "device_utils.cuh"
#include "kernels.h"
#include "sparse_table.cuh"

namespace cpidx {
namespace cuda {

constexpr int kConsumerWarps = 4;                 // 4 warps x 32 tokens = one 128-token page
constexpr int kConsumerThreads = kConsumerWarps * 32;
constexpr int kThreads = kConsumerThreads + 32;   // + one producer warp

__host__ __device__ inline int cand_capacity(int topk) { return topk * 2 > 32 ? topk * 2 : 32; }

// Named barrier over the consumer warps only (the producer warp runs its own loop).
__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumerThreads) : "memory");
}

struct Smem {
  uint8_t* pages;     // [stages][page bytes]
  __nv_bfloat16* q;   // [ncols][kQStride] (fp8 pages: fp16, scaled per column)
  float* qinv;        // fp8 pages only, [2][ncols]: what scales a column's dots back; then staged
  float* red;         // [2][kConsumerWarps][ncols] ([2][2][...]: fp8 pages at 16 columns)
  Key* cbuf;          // [ncols][cap]: candidates, then the ordered top K
  Key* tmp;           // [ncols][K]
  int* cnt;           // [ncols]
  Key* tau;           // [ncols]: admission threshold (the current K-th key)
  int64_t* prefix;    // [num_reqs + 1]: flattened page offset of each request
  uint64_t* full;     // [stages]
  uint64_t* empty;    // [stages]
  int64_t* stage_x;   // [stages]: the flattened page in each stage; -1: no more pages
  int* misc;          // [0] compact flag
};

// Reduces every column's candidate buffer to its top K (ordered), resets the thresholds.
__device__ inline void compact_all(const Smem& s, int ncols, int K) {
  const int cap = cand_capacity(K);
  for (int idx = threadIdx.x; idx < ncols * cap; idx += kConsumerThreads) {
    const int col = idx / cap, i = idx % cap;
    const int count = s.cnt[col];
    if (i < K && i >= count) s.tmp[col * K + i] = kPadKey;
    if (i < count) {
      const Key* c = s.cbuf + col * cap;
      const Key mine = c[i];
      int rank = 0;
      for (int j = 0; j < count; ++j) rank += c[j] > mine;
      if (rank < K) s.tmp[col * K + rank] = mine;
    }
  }
  consumer_sync();
  for (int idx = threadIdx.x; idx < ncols * K; idx += kConsumerThreads) {
    s.cbuf[(idx / K) * cap + idx % K] = s.tmp[idx];
  }
  consumer_sync();
  for (int col = threadIdx.x; col < ncols; col += kConsumerThreads) {
    const int count = s.cnt[col] < K ? s.cnt[col] : K;
    s.cnt[col] = count;
    s.tau[col] = count == K ? s.cbuf[col * cap + K - 1] : kPadKey;
  }
  consumer_sync();
}

// Copies request r's ordered lists (cbuf[col][0..K)) to the outputs: ids (+ sparse table) or
// exchange keys.
__device__ inline void finalize_request(const ScoreTopkParams& p, const Smem& s, int r,
                                        int32_t seq_len, int ncols) {
  const int Q = p.query_len, K = p.topk, cap = cand_capacity(K);
  const int64_t n = static_cast<int64_t>(p.num_reqs) * Q;
  for (int idx = threadIdx.x; idx < ncols * K; idx += kConsumerThreads) {
    const int col = idx / K, i = idx % K;
    const int h = col / Q, t = col % Q;
    const int64_t row = static_cast<int64_t>(r) * Q + t;
    const Key key = s.cbuf[col * cap + i];
    if (p.keys) {
      p.keys[(h * n + row) * K + i] = key;
    } else {
      p.ids[h * p.ids_head_stride + row * p.ids_row_stride + i] =
          key == kPadKey ? -1 : key_block(key);
    }
  }
  if (p.table.table) {  // one head: one table row per query token
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int t = warp; t < Q; t += kConsumerWarps) {
      write_sparse_row<true>(p.table, s.cbuf + t * cap, K, r, static_cast<int64_t>(r) * Q + t,
                             static_cast<int64_t>(seq_len) - Q + t, lane);
    }
  }
}

}  // namespace cuda
}  // namespace cpidx
