// src/cuda/rank_topk.h: the context-parallel merge's exact top-K by rank counting (merge.cu,
// one warp a (head, row)), on host and device so that CI checks it lane by lane
// (tests/gpu/test_rank_topk.cc). No lane reads another's registers: run for lanes 0-31 in turn
// on the host it writes what the warp writes.
#pragma once

#include <vector_types.h>  // ulonglong2: two keys, one 16-byte shared-memory load

#include "cpidx/contract.h"

#if defined(__CUDA_ARCH__)
#define CPIDX_RANK_UNROLL _Pragma("unroll")
#else
#define CPIDX_RANK_UNROLL
#endif

namespace cpidx {
namespace cuda {

// Keys 2j and 2j + 1 of the list: one 16-byte load on the device (cand 16-byte aligned).
CPIDX_HD ulonglong2 key_pair(const Key* cand, int j) {
#if defined(__CUDA_ARCH__)
  return reinterpret_cast<const ulonglong2*>(cand)[j];
#else
  return ulonglong2{cand[2 * j], cand[2 * j + 1]};  // the host test: no type punning
#endif
}

// One group of warp_rank_topk's keys: each lane ranks kKeys keys (i0 + lane, then
// i0 + 32 + lane) against the whole list, read two keys a 16-byte broadcast load (pads add no
// rank), and writes each real key of rank < k to out[rank]. kTies: a key equal to one before
// it in the list ranks below it, so equal keys take consecutive ranks.
template <int kKeys, bool kTies>
CPIDX_HD void warp_rank_group(const Key* cand, int count, int i0, int k, Key* out, int lane) {
  const int npairs = (count + 1) / 2;
  Key mine[kKeys];
  int rank[kKeys];
  CPIDX_RANK_UNROLL
  for (int q = 0; q < kKeys; ++q) {
    const int i = i0 + 32 * q + lane;
    mine[q] = i < count ? cand[i] : kPadKey;
    rank[q] = 0;
  }
  for (int j = 0; j < npairs; ++j) {
    const ulonglong2 two = key_pair(cand, j);
    CPIDX_RANK_UNROLL
    for (int q = 0; q < kKeys; ++q) {
      rank[q] += (two.x > mine[q]) + (two.y > mine[q]);
      if (kTies) {
        const int i = i0 + 32 * q + lane;
        rank[q] += (two.x == mine[q] && 2 * j < i) + (two.y == mine[q] && 2 * j + 1 < i);
      }
    }
  }
  CPIDX_RANK_UNROLL
  for (int q = 0; q < kKeys; ++q) {
    if (mine[q] != kPadKey && rank[q] < k) out[rank[q]] = mine[q];
  }
}

// Keys in `cand[0..count)` are real keys (> kPadKey), unique unless kTies; `cand` is 16-byte
// aligned and, when count is odd, cand[count] holds kPadKey. One warp writes the K largest, in
// descending order, to out[0..K), padding with kPadKey; `out` must not alias `cand`. Equal keys
// share a rank without kTies, leaving the slots after it unwritten (merge.cu looks for them).
// Each lane ranks two keys (i and i + 32 of every 64; up to 32 keys left, one), count / 2 loads
// a lane for up to 64 keys. select_topk's block-wide form is for_each_rank / rank_short
// (select_topk.cu).
// NOTE: one key a lane and 8-byte loads took 2 * count loads a lane at P = 4, K = 16 (64 keys);
// ranking a pad as every lane's second key at P = 2 (32 keys) cost ~1 us at 64 x Q=4 (v52m).
// The two group sizes as one template (v53r) ran 0.15-1.2 us faster than the same loop written
// twice on the 64-request Q=4 steps and within the noise elsewhere (docs/perf/README.md).
template <bool kTies = false>
CPIDX_HD void warp_rank_topk(const Key* cand, int count, int k, Key* out, int lane) {
  for (int i = lane; i < k; i += 32) {
    if (i >= count) out[i] = kPadKey;
  }
  for (int i0 = 0; i0 < count; i0 += 64) {  // warp-uniform, as the group size
    if (count - i0 <= 32) {
      warp_rank_group<1, kTies>(cand, count, i0, k, out, lane);
    } else {
      warp_rank_group<2, kTies>(cand, count, i0, k, out, lane);
    }
  }
}

}  // namespace cuda
}  // namespace cpidx

#undef CPIDX_RANK_UNROLL
