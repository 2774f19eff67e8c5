// src/cuda/shard_select.cuh: the selection side of the fused decode kernel, run by its consumer
// warps: per-column candidate buffers compacted to their top K by rank counting, the exact merge
// of a request's per-CTA lists by the last CTA to finish it, and the output writers.
#pragma once

#include "device_utils.cuh"
#include "kernels.h"
#include "sparse_table.cuh"

namespace cpidx {
namespace cuda {

constexpr int kConsumerWarps = 4;                 // 4 warps x 32 tokens = one 128-token page
constexpr int kConsumerThreads = kConsumerWarps * 32;
constexpr int kThreads = kConsumerThreads + 32;   // + one producer warp
constexpr int kMaxMergeChunk = 8;                 // columns merged per pass, at most

__host__ __device__ inline int cand_capacity(int topk) { return topk * 2 > 32 ? topk * 2 : 32; }
// Merge scratch (keys): list heads [merge_heads_keys], then per-column candidate areas of
// merge_col_keys (K*K) each, for up to merge_chunk_max columns at a time.
__host__ __device__ inline int64_t merge_heads_keys(int grid) {
  return 4 * grid > 1024 ? 4 * grid : 1024;
}
__host__ __device__ inline int64_t merge_col_keys(int topk) {
  return static_cast<int64_t>(topk) * topk;
}
__host__ __device__ inline int merge_chunk_max(int topk) {
  const int64_t c = 2048 / merge_col_keys(topk);
  return c < 1 ? 1 : c > kMaxMergeChunk ? kMaxMergeChunk : static_cast<int>(c);
}
__host__ __device__ inline int64_t merge_scratch_keys(int grid, int topk) {
  return merge_heads_keys(grid) + merge_chunk_max(topk) * merge_col_keys(topk);
}

// Named barrier over the consumer warps only (the producer warp runs its own loop).
__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumerThreads) : "memory");
}

struct Smem {
  uint8_t* pages;     // [stages][page bytes]
  __nv_bfloat16* q;   // [ncols][kQStride]
  float* red;         // [2][kConsumerWarps][ncols]
  Key* cbuf;          // [ncols][cap]: candidates, then the ordered top K
  Key* tmp;           // [ncols][K]
  int* cnt;           // [ncols]
  Key* tau;           // [ncols]: admission threshold (the current K-th key)
  Key* mbuf;          // [merge_scratch_keys]
  Key* mtau;          // [kMaxMergeChunk]
  Key* mlane;         // [kConsumerWarps][32]: lane maxima
  int* mcount;        // [2 * kMaxMergeChunk]
  int* msel;          // [kMaxMergeChunk][K]
  int64_t* prefix;    // [num_reqs + 1]: flattened page offset of each request
  uint64_t* full;     // [stages]
  uint64_t* empty;    // [stages]
  int* misc;          // [0] compact flag, [1] last-arriver flag, [4 + w] warp counters
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

// The exact K-th largest of heads[0..n) (kPadKey = none), or 1 when fewer than K are real:
// one warp, shared memory only. A lower bound tau0 (the K-th largest lane maximum) leaves few
// heads at or above it; they are compacted into `work` (capacity `cap`) and ranked there.
__device__ inline Key kth_head(const Key* heads, int n, int K, Key* lane_max_buf, Key* work,
                               int cap, int* counter, Key* result, int lane) {
  Key m = kPadKey;
  for (int i = lane; i < n; i += 32) m = heads[i] > m ? heads[i] : m;
  lane_max_buf[lane] = m;
  if (lane == 0) { *result = Key{1}; *counter = 0; }
  __syncwarp();
  int rank0 = 0;
  for (int j = 0; j < 32; ++j) rank0 += lane_max_buf[j] > m;
  const bool mine = rank0 == K - 1 && m != kPadKey;  // unique: real keys differ
  if (mine) lane_max_buf[32] = m;
  const bool have_tau0 = __any_sync(0xffffffffu, mine);
  __syncwarp();
  const Key tau0 = have_tau0 ? lane_max_buf[32] : Key{1};
  for (int i = lane; i < n; i += 32) {
    const Key h = heads[i];
    if (h >= tau0 && h != kPadKey) {
      const int at = atomicAdd(counter, 1);
      if (at < cap) work[at] = h;
    }
  }
  __syncwarp();
  const int n1 = *counter;
  // Rank among the compacted heads, or (if they overflowed) among all heads.
  const Key* pool = n1 <= cap ? work : heads;
  const int np = n1 <= cap ? n1 : n;
  for (int i = lane; i < np; i += 32) {
    const Key h = pool[i];
    if (h < tau0 || h == kPadKey) continue;
    int rank = 0;
    for (int j = 0; j < np; ++j) rank += pool[j] > h;
    if (rank == K - 1) *result = h;
  }
  __syncwarp();
  const Key tau = *result;
  __syncwarp();
  return tau;
}

// The last CTA to finish request r merges its per-CTA lists (slots c0 + r .. c1 + r, each K
// ordered keys per column) into cbuf[col][0..K). Exact: with tau = the K-th best list head, a
// list whose head is below tau cannot contribute and keys below tau cannot win, so at most K
// lists (K*K keys) per column are ranked. Columns go in chunks; each chunk costs two dependent
// reads of L2 (all heads, then the selected lists), whatever the number of columns.
__device__ inline void merge_request(const ScoreTopkParams& p, const Smem& s, int r, int64_t c0,
                                     int64_t c1, int ncols, int grid) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, K = p.topk;
  const int nseg = static_cast<int>(c1 - c0 + 1);
  const int64_t col_keys = merge_col_keys(K);
  int chunk = static_cast<int>(merge_heads_keys(grid) / nseg);
  chunk = chunk < merge_chunk_max(K) ? chunk : merge_chunk_max(K);
  Key* heads = s.mbuf;                            // [chunk][nseg]
  Key* work = s.mbuf + merge_heads_keys(grid);    // [chunk][K * K]
  int* nsel = s.mcount;                           // [chunk]: selected lists
  int* ncand = s.mcount + kMaxMergeChunk;         // [chunk]: candidates
  int* sel = s.msel;                              // [chunk][K]: selected segments
  auto list = [&](int seg, int col) {
    return reinterpret_cast<const unsigned long long*>(p.partial) +
           ((c0 + r + seg) * ncols + col) * static_cast<int64_t>(K);
  };
  for (int cb = 0; cb < ncols; cb += chunk) {
    const int cols = ncols - cb < chunk ? ncols - cb : chunk;
    for (int idx = threadIdx.x; idx < cols * nseg; idx += kConsumerThreads) {
      heads[idx] = __ldcg(list(idx % nseg, cb + idx / nseg));
    }
    if (threadIdx.x < cols) { nsel[threadIdx.x] = 0; ncand[threadIdx.x] = 0; }
    consumer_sync();
    for (int cc = warp; cc < cols; cc += kConsumerWarps) {
      const Key* h = heads + cc * nseg;
      const Key t = kth_head(h, nseg, K, s.mlane + warp * 33, work + cc * col_keys,
                             static_cast<int>(col_keys), &ncand[cc], s.mtau + cc, lane);
      __syncwarp();
      if (lane == 0) ncand[cc] = 0;
      __syncwarp();
      for (int seg = lane; seg < nseg; seg += 32) {
        if (h[seg] >= t) sel[cc * K + atomicAdd(&nsel[cc], 1)] = seg;
      }
    }
    consumer_sync();
    // The selected lists' keys at or above tau.
    for (int idx = threadIdx.x; idx < cols * K * K; idx += kConsumerThreads) {
      const int cc = idx / (K * K), j = (idx / K) % K, i = idx % K;
      if (j >= nsel[cc]) continue;
      const Key k = __ldcg(list(sel[cc * K + j], cb + cc) + i);
      if (k != kPadKey && k >= s.mtau[cc]) work[cc * col_keys + atomicAdd(&ncand[cc], 1)] = k;
    }
    consumer_sync();
    for (int cc = warp; cc < cols; cc += kConsumerWarps) {
      warp_rank_topk(work + cc * col_keys, ncand[cc], K, s.cbuf + (cb + cc) * cand_capacity(K),
                     lane);
    }
    consumer_sync();
  }
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
      write_sparse_row(p.table, s.cbuf + t * cap, K, r, static_cast<int64_t>(r) * Q + t,
                       static_cast<int64_t>(seq_len) - Q + t, lane);
    }
  }
}

}  // namespace cuda
}  // namespace cpidx
