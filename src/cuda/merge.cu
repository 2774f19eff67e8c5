// src/cuda/merge.cu: the context-parallel merge (one warp per (owned head, row) ranks the P*K
// candidate keys, gathered or polled from a device channel; exact because every shard kept a
// full K) with the optional fused sparse table, and the packing of strided local queries into
// the all-gather payload.
#include "channel.cuh"
#include "device_utils.cuh"
#include "kernels.h"
#include "rank_topk.h"
#include "sparse_table.cuh"

namespace cpidx {
namespace cuda {
namespace {

constexpr int kMergeWarps = 4;
constexpr int kMaxCand = kMaxWorldSize * kMaxTopK;  // world <= 8 ranks x K keys

// One warp: (owned head j, row)'s P * K candidate keys (gathered, or polled from the channel),
// ranked to the top K, written as ids (+ the sparse-table row).
__device__ void merge_item(const MergeParams& p, int j, int64_t row, uint32_t uses, Key* cand,
                           Key* best, int lane) {
  const int K = p.topk, total = p.world * K;
  ll::Waiter waiter(p.channel.error, p.channel.timeout_ns);  // used with a channel only
  for (int i = lane; i < K; i += 32) best[i] = kPadKey;  // a slot no rank fills shows (below)
  // The real keys packed into cand by the warp's ballots (32 at a time, every lane in each
  // turn), where a shared-memory atomicAdd per key serialised the warp on one counter.
  int found = 0;
  for (int x0 = 0; x0 < total; x0 += 32) {
    const int x = x0 + lane;
    Key k = kPadKey;
    if (x < total) {
      const int w = x / K, i = x % K;
      const int64_t at = ((p.head_offset + j) * p.n + row) * K + i;  // in source w's payload
      k = p.channel.world > 0 ? channel_get(p.channel, uses, w, at, waiter)
                              : p.gathered[static_cast<int64_t>(w) * p.total_heads * p.n * K + at];
    }
    const unsigned real = __ballot_sync(0xffffffffu, k != kPadKey);
    if (k != kPadKey) cand[found + __popc(real & ((1u << lane) - 1u))] = k;
    found += __popc(real);
  }
  if (waiter.raised) channel_alarm_peers(p.channel);
  if (lane == 0 && (found & 1)) cand[found] = kPadKey;  // warp_rank_topk reads pairs
  __syncwarp();
  warp_rank_topk(cand, found, K, best, lane);
  __syncwarp();
  // Equal keys share a rank and leave the slots after it padded. No two ranks send one (a block
  // is one rank's), so only a corrupted gather does: ranked again, ties by their place in the
  // list, the duplicates kept as the reference's sort keeps them.
  bool hole = false;
  for (int i = lane; i < K && i < found; i += 32) hole |= best[i] == kPadKey;
  if (__any_sync(0xffffffffu, hole)) {
    __syncwarp();
    warp_rank_topk<true>(cand, found, K, best, lane);
    __syncwarp();
  }
  int32_t* out = p.ids + j * p.ids_head_stride + row * p.ids_row_stride;
  for (int i = lane; i < K; i += 32) out[i] = best[i] == kPadKey ? -1 : key_block(best[i]);
  if (p.table.table) {  // L == 1
    const int req = static_cast<int>(row / p.query_len), t = static_cast<int>(row % p.query_len);
    int32_t err = 0;
    const int32_t seq_len = clamp_seq_len(p.seq_lens[req], p.max_seq_len, &err);
    write_sparse_row<false>(p.table, best, K, req, row,
                            static_cast<int64_t>(seq_len) - p.query_len + t, lane);
  }
}

__global__ void __launch_bounds__(kMergeWarps * 32) merge_topk_kernel(const MergeParams p) {
  __shared__ alignas(16) Key cand[kMergeWarps][kMaxCand];  // 16-byte loads (warp_rank_topk)
  __shared__ Key best[kMergeWarps][kMaxTopK];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Fused exchange: the keys arrive in the channel, stored by every rank's select_topk; this grid
  // polls for them as soon as this rank's select_topk let it launch (its use count read), and
  // waits for that grid only before it ends (stream order for whatever follows).
  const bool channel = p.channel.world > 0;
  uint32_t uses = 0;
  if (channel) {
    uses = channel_uses(p.channel);
    __syncthreads();  // every thread read the count before it may change
    if (threadIdx.x == 0) channel_arrive(p.channel, uses);
  } else {
    pdl_wait();
  }
  pdl_launch_dependents();
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kMergeWarps + warp;
  if (item < p.local_heads * p.n) {  // warp-uniform
    const int j = static_cast<int>(item / p.n);
    const int64_t row = item % p.n;
    merge_item(p, j, row, uses, cand[warp], best[warp], lane);
  }
  if (channel) pdl_wait();
}

__global__ void pack_queries_kernel(const __nv_bfloat16* src, int64_t row_stride,
                                    int64_t head_stride, int64_t n, int heads,
                                    __nv_bfloat16* dst) {
  constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per head row
  const int64_t total = n * heads * kChunks;
  for (int64_t x = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; x < total;
       x += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = x / (heads * kChunks);
    const int h = static_cast<int>((x / kChunks) % heads), c = static_cast<int>(x % kChunks);
    reinterpret_cast<uint4*>(dst)[x] =
        *reinterpret_cast<const uint4*>(src + row * row_stride + h * head_stride + c * 8);
  }
}

}  // namespace

cudaError_t plan_merge_topk() {
  const cudaError_t e = prefer_max_shared(merge_topk_kernel);
  return e == cudaSuccess ? prefer_max_shared(pack_queries_kernel) : e;
}

cudaError_t smallest_merge_carveout(int* smallest) {
  *smallest = cudaSharedmemCarveoutMaxShared;
  const cudaError_t e = lower_to_carveout(merge_topk_kernel, smallest);
  return e == cudaSuccess ? lower_to_carveout(pack_queries_kernel, smallest) : e;
}

cudaError_t launch_merge_topk(const MergeParams& p, cudaStream_t stream) {
  if (p.world * p.topk > kMaxCand || p.topk > kMaxTopK) return cudaErrorInvalidValue;
  const int64_t items = p.local_heads * p.n;
  if (items == 0 && p.channel.world == 0) return cudaSuccess;
  // With a channel at least one CTA runs: the readers' arrival counts the use.
  const int64_t blocks = items == 0 ? 1 : (items + kMergeWarps - 1) / kMergeWarps;
  return launch_with_pdl(p.pdl, merge_topk_kernel, dim3(static_cast<unsigned>(blocks)),
                         dim3(kMergeWarps * 32), 0, stream, p);
}

cudaError_t launch_pack_queries(const __nv_bfloat16* src, int64_t row_stride,
                                int64_t head_stride, int64_t n, int heads,
                                __nv_bfloat16* dst, cudaStream_t stream) {
  const int64_t chunks = n * heads * (kHeadDim / 8);
  if (chunks == 0) return cudaSuccess;
  const int64_t blocks = (chunks + 255) / 256;
  // cudaLaunchKernelEx returns this launch's own error (cudaGetLastError after <<<>>> would also
  // return, and clear, an earlier one of the caller's).
  return launch_with_pdl(false, pack_queries_kernel,
                         dim3(static_cast<unsigned>(blocks < 1024 ? blocks : 1024)), dim3(256), 0,
                         stream, src, row_stride, head_stride, n, heads, dst);
}

}  // namespace cuda
}  // namespace cpidx
