// src/cuda/select_topk.cu: the selection kernel after score_topk, chained with programmatic
// dependent launch. Split path (small steps): score_topk does not select; it writes one key per
// (column, owned page) into split_keys ([column][page], pages flattened request by request), and
// this kernel picks each (request, column)'s top K. Fused path: score_topk selected per CTA, and
// this kernel merges the ordered lists of every request that spans CTAs (the same selection over
// the request's slots of `partial`: the union of the CTAs' top K holds the request's top K).
// One CTA per item: the keys are read once from L2, the
// K-th largest is found by an MSD radix select on the 64-bit keys (8 bits a pass, usually 3-4
// passes on real scores), and the <= K winners are ordered by rank counting. Short lists
// (<= kThreads keys) skip the radix passes and are ranked directly.
// Keys are distinct (the block id is in the low bits); kPadKey marks an invisible block and is
// never selected: a list with fewer than K real keys is padded, as the fused path pads.
#include "device_utils.cuh"
#include "kernels.h"
#include "sparse_table.cuh"

namespace cpidx {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 8;  // keys kept in registers; longer lists are re-read from L2
constexpr int kBins = 256;

struct SelectSmem {
  int64_t* prefix;                 // [num_reqs + 1] (dynamic): flattened page offset per request
  int hist[kBins];
  Key chosen[kMaxTopK];            // the winners, unordered
  Key sorted[kMaxTopK];            // the winners, descending, padded with kPadKey
  int count;                       // winners gathered so far
  Key prefix_bits;                 // radix select state: the K-th key's high bits found so far
  int need;                        // winners still to find below prefix_bits' bin
  int done;
};

__device__ __forceinline__ int64_t owned_pages(const ScoreTopkParams& p, int r) {
  int32_t unused = 0;
  const int32_t len = clamp_seq_len(p.seq_lens[r], p.max_seq_len, &unused);
  const int64_t blocks = cdiv(len, kBlockSize);
  return owned_blocks(blocks < p.max_blocks ? blocks : p.max_blocks, p.world, p.rank);
}

// prefix[r] = pages of requests before r (the same flattening as score_topk).
__device__ void request_prefix(const ScoreTopkParams& p, SelectSmem& s) {
  const int B = p.num_reqs, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int per = (B + kThreads - 1) / kThreads;
  const int r0 = tid * per < B ? tid * per : B, r1 = r0 + per < B ? r0 + per : B;
  int64_t sum = 0;
  for (int r = r0; r < r1; ++r) sum += owned_pages(p, r);
  int64_t incl = sum;
  for (int d = 1; d < 32; d *= 2) {
    const int64_t v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  __shared__ int64_t warp_tot[kThreads / 32];
  if (lane == 31) warp_tot[warp] = incl;
  __syncthreads();
  int64_t run = incl - sum;
  for (int w = 0; w < warp; ++w) run += warp_tot[w];
  for (int r = r0; r < r1; ++r) {
    s.prefix[r] = run;
    run += owned_pages(p, r);
  }
  if (tid == kThreads - 1) s.prefix[B] = run;
  __syncthreads();
}

// The digit of the K-th largest key among those matching the prefix: bins are scanned from the
// top by warp 0 (8 bins per lane); the bin holding it becomes part of the prefix and `need`
// drops by the keys in higher bins (all of them winners).
__device__ void pick_bin(SelectSmem& s, int shift) {
  const int lane = threadIdx.x % 32;
  const int need = s.need;
  __syncwarp();  // every lane has read `need` before one of them rewrites it
  int c[8], sum = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    c[j] = s.hist[kBins - 1 - (lane * 8 + j)];
    sum += c[j];
  }
  int above = sum;  // inclusive scan over lanes, then exclusive
  for (int d = 1; d < 32; d *= 2) {
    const int v = __shfl_up_sync(0xffffffffu, above, d);
    if (lane >= d) above += v;
  }
  above -= sum;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (above < need && need <= above + c[j]) {
      const int bin = kBins - 1 - (lane * 8 + j);
      s.prefix_bits |= static_cast<Key>(bin) << shift;
      s.need = need - above;
      s.done = c[j] == need - above;  // every key of this bin wins: stop refining
    }
    above += c[j];
  }
}

// Selects and orders the top K of keys[0..n) (read from L2) into s.sorted.
__device__ void select_item(const Key* keys, int64_t n, int K, SelectSmem& s) {
  const int tid = threadIdx.x;
  Key mine[kPerThread];
  const bool in_regs = n <= static_cast<int64_t>(kThreads) * kPerThread;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t i = tid + static_cast<int64_t>(j) * kThreads;
    mine[j] = in_regs && i < n ? __ldcg(reinterpret_cast<const unsigned long long*>(keys) + i)
                               : kPadKey;
  }
  auto key_at = [&](int j, int64_t i) -> Key {  // the j-th key of this thread, index i
    return in_regs ? mine[j] : __ldcg(reinterpret_cast<const unsigned long long*>(keys) + i);
  };
  const int64_t chunks = in_regs ? kPerThread : (n + kThreads - 1) / kThreads;
  if (tid == 0) { s.count = 0; s.prefix_bits = 0; s.need = K; s.done = 0; }
  __syncthreads();

  // Threshold: the K-th largest real key (or 1 when fewer than K are real: take them all).
  Key lower = 1;
  if (n > K) {
    Key mask = 0;
    for (int shift = 56; shift >= 0 && !s.done; shift -= 8) {
      for (int b = tid; b < kBins; b += kThreads) s.hist[b] = 0;
      __syncthreads();
      const Key want = s.prefix_bits;
      for (int64_t j = 0; j < chunks; ++j) {
        const int64_t i = tid + j * kThreads;
        if (i >= n) break;
        const Key k = key_at(static_cast<int>(in_regs ? j : 0), i);
        if (k != kPadKey && (k & mask) == want) atomicAdd(&s.hist[(k >> shift) & 0xFF], 1);
      }
      __syncthreads();
      if (tid < 32) {
        if (tid == 0) s.done = 1;  // stays set if fewer than `need` real keys are left
        __syncwarp();
        pick_bin(s, shift);
      }
      __syncthreads();
      mask |= Key{0xFF} << shift;
    }
    // No bin held the K-th key only when fewer than K keys are real: prefix_bits stayed 0 and
    // every real key wins.
    lower = s.prefix_bits > 1 ? s.prefix_bits : 1;
  }
  // Gather the winners (keys >= lower; at most K of them, all distinct), then order them.
  for (int64_t j = 0; j < chunks; ++j) {
    const int64_t i = tid + j * kThreads;
    if (i >= n) break;
    const Key k = key_at(static_cast<int>(in_regs ? j : 0), i);
    if (k != kPadKey && k >= lower) {
      const int at = atomicAdd(&s.count, 1);
      if (at < K) s.chosen[at] = k;
    }
  }
  __syncthreads();
  const int count = s.count < K ? s.count : K;
  block_rank_topk(s.chosen, count, K, s.sorted);
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads, 4) select_topk_kernel(const ScoreTopkParams p) {
  __shared__ SelectSmem s;
  extern __shared__ int64_t prefix_smem[];
  if (threadIdx.x == 0) s.prefix = prefix_smem;
  __syncthreads();
  const int Q = p.query_len, K = p.topk, ncols = p.num_heads * Q, B = p.num_reqs;
  const int64_t n_rows = static_cast<int64_t>(B) * Q;
  // Before the wait: only the step's inputs (seq_lens), never score_topk's outputs.
  request_prefix(p, s);
  pdl_wait();
  pdl_launch_dependents();
  const int64_t total = s.prefix[B];
  const bool split = total <= p.split_max_pages;
  const int64_t g_eff = fused_ctas(total, p.fused_grid);

  for (int64_t item = blockIdx.x; item < static_cast<int64_t>(B) * ncols; item += gridDim.x) {
    const int r = static_cast<int>(item / ncols), col = static_cast<int>(item % ncols);
    const int h = col / Q, t = col % Q;
    const int64_t row = static_cast<int64_t>(r) * Q + t;
    const int64_t first = s.prefix[r], n = s.prefix[r + 1] - first;
    if (split) {
      select_item(p.split_keys + col * p.split_max_pages + first, n, K, s);
    } else {
      // Requests without pages or scored by one CTA alone were finished by score_topk (the
      // conditions are uniform across the CTA).
      if (n == 0) continue;
      const int64_t c0 = cta_of(first, total, g_eff), c1 = cta_of(first + n - 1, total, g_eff);
      if (c0 == c1) continue;
      select_item(p.partial + partial_index(col, c0 + r, p.num_slots, K), (c1 - c0 + 1) * K, K, s);
    }
    for (int i = threadIdx.x; i < K; i += kThreads) {
      const Key key = s.sorted[i];
      if (p.keys) {
        p.keys[(h * n_rows + row) * K + i] = key;
      } else {
        p.ids[h * p.ids_head_stride + row * p.ids_row_stride + i] =
            key == kPadKey ? -1 : key_block(key);
      }
    }
    if (p.table.table && threadIdx.x < 32) {  // one head: a table row per query token
      int32_t unused = 0;
      const int32_t len = clamp_seq_len(p.seq_lens[r], p.max_seq_len, &unused);
      write_sparse_row(p.table, s.sorted, K, r, row, static_cast<int64_t>(len) - Q + t,
                       threadIdx.x);
    }
    __syncthreads();  // s.sorted is rewritten by the next item
  }
}

}  // namespace

cudaError_t plan_select_topk(int device, ScoreTopkLaunch* l) {
  int sms = 0, smem_optin = 0;
  cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return e;
  e = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e != cudaSuccess) return e;
  cudaFuncAttributes attr{};
  e = cudaFuncGetAttributes(&attr, select_topk_kernel);
  if (e != cudaSuccess) return e;
  const size_t smem = (static_cast<size_t>(l->max_reqs) + 1) * sizeof(int64_t);
  if (smem + attr.sharedSizeBytes > static_cast<size_t>(smem_optin)) {
    return cudaErrorInvalidConfiguration;
  }
  // The cap is process-wide: raise it to the device limit, never to one Decoder's need.
  e = cudaFuncSetAttribute(select_topk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           smem_optin - static_cast<int>(attr.sharedSizeBytes));
  if (e != cudaSuccess) return e;
  l->select_grid = 4 * sms;  // items beyond it loop; a step rarely has more than a few hundred
  return cudaSuccess;
}

cudaError_t launch_select_topk(const ScoreTopkParams& p, const ScoreTopkLaunch& l,
                               cudaStream_t stream) {
  if (p.num_reqs > l.max_reqs || p.fused_grid != l.grid ||
      (p.split_max_pages >= 0 && p.split_keys == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const size_t smem = (static_cast<size_t>(l.max_reqs) + 1) * sizeof(int64_t);
  return launch_with_pdl(p.pdl, select_topk_kernel, l.select_grid, kThreads, smem, stream, p);
}

}  // namespace cuda
}  // namespace cpidx
