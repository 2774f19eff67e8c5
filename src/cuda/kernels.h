// src/cuda/kernels.h: Params structs and launchers of the decode kernels (no framework types).
//  - score_topk: one pass over a rank's shard of the paged index cache; every key page is read
//    once by the bulk-copy engine and scored on tensor cores against all (head, query-token)
//    columns of its request; block max, causal mask, forcing and the shard top-K are fused.
//  - select_topk: the kernel after score_topk, one CTA per (request, column). Split path (small
//    steps): score_topk writes one key per (column, owned block) to an L2-resident buffer instead
//    of selecting, and this kernel picks each item's top K. Fused path: it merges the per-CTA
//    lists of the requests that spanned CTAs. Which path runs is decided on the device from the
//    step's page count, so one captured graph serves every batch.
//  - merge_topk: P candidate lists of K keys per (owned head, row) -> final ids (+ sparse table),
//    read from the gathered keys or polled from a device channel that select_topk wrote.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cpidx/contract.h"
#include "cpidx/device_channel.h"
#include "cpidx/params.h"

namespace cpidx {
namespace cuda {

// Output of a shard's selection: final ids (P == 1) or ordered keys for the exchange.
struct SparseTableArgs {
  const int32_t* attention_block_table = nullptr;  // [num_reqs, >= G]
  int64_t attn_bt_row_stride = 0;
  int32_t* table = nullptr;  // [n, K * 8]
  int64_t table_row_stride = 0;
  int32_t* context_lens = nullptr;  // [n]
  int block_page_stride = 0;
};

struct ScoreTopkParams {
  // Queries of the scored heads: head h of row `row` at q_head[h] + row * q_row_stride.
  const __nv_bfloat16* q_head[kMaxHeads];
  int64_t q_row_stride = 0;
  int num_heads = 0;                      // H (all T heads for context-parallel scoring)
  const void* cache = nullptr;            // [num_pages, BS, D]
  int64_t num_pages = 0;
  const int32_t* block_table = nullptr;   // [num_reqs, >= G], column stride 1
  int64_t bt_row_stride = 0;
  const int32_t* seq_lens = nullptr;      // [num_reqs]
  int num_reqs = 0;
  int query_len = 1;                      // Q
  int32_t max_seq_len = 0;
  int64_t max_blocks = 0;                 // G
  float scale = 1.f;
  int topk = 16, init_blocks = 0, local_blocks = 1;
  int world = 1, rank = 0;

  // Outputs (exactly one of ids / keys).
  int32_t* ids = nullptr;                 // [H, n, K] with strides (world == 1)
  int64_t ids_head_stride = 0, ids_row_stride = 0;
  SparseTableArgs table;                  // optional, H == 1 and ids mode only
  Key* keys = nullptr;                    // [H, n, K] contiguous (exchange payload)
  // Fused key exchange (channel.world > 0): select_topk also stores every (head, row)'s K keys
  // (those score_topk finished from `keys`) into the channel's line (h * n + row) * K + i on
  // every rank, for merge_topk to poll.
  DeviceChannel channel;

  // Workspace.
  Key* partial = nullptr;                 // [H * Q][num_slots][K]: per-(CTA, request) lists
  int64_t num_slots = 0;                  // partial_slots(grid, num_reqs)
  int fused_grid = 0;                     // score_topk's grid (select_topk finds the lists by it)
  int32_t* error_flag = nullptr;          // OR of DeviceError bits
  // Split path (split_path() in page_order.cuh): steps of <= split_any_pages owned pages, and
  // steps of <= split_max_pages whose requests own <= split_longest_pages pages each.
  Key* split_keys = nullptr;              // [ncols_pad][split_max_pages] block keys
  int64_t split_max_pages = -1;           // -1: the fused path always
  int64_t split_any_pages = -1;
  int64_t split_longest_pages = -1;
  // Split-path work stealing (work_steal.h, v15): [fused_grid] packed unclaimed page ranges,
  // all ones between calls, and a count at steal_count_at (zero between calls; past every
  // instance's grid, so that launches of different grids share the words); nullptr keeps
  // static ranges.
  unsigned long long* steal_words = nullptr;
  int steal_count_at = 0;
  bool pdl = true;                        // programmatic dependent launch
};

// One kernel instance's launch (the padded column count of a step picks the instance).
struct ScoreTopkInstance {
  int grid = 0;           // persistent CTAs (SMs x occupancy)
  int stages = 0;         // key pages in flight per CTA
  size_t smem_bytes = 0;  // dynamic shared memory
  int prefix_shift = 0;   // the prefix keeps every 2^prefix_shift-th offset (page_order.cuh)
};

// Columns (heads x query tokens) padded as the kernels lay them out: 8, 16, 32 or 64.
int padded_columns(int heads_x_q);

struct ScoreTopkLaunch {
  // Every instance up to the bound's columns is planned on its own: a step of fewer columns
  // than the bound gets its instance's CTAs per SM (fp8: four at 8 columns, three at 16), not
  // the bound instance's.
  ScoreTopkInstance inst[4];  // 8, 16, 32, 64 padded columns, up to ncols_pad
  int grid = 0;           // the largest instance grid: what the workspace holds
  int max_reqs = 0;       // bound used to size the request prefix in shared memory
  int ncols_pad = 0;      // padded columns (H * Q rounded up to 8) the launch was sized for
  int topk = 0;           // K the layout was sized for
  int select_grid = 0;    // CTAs of select_topk (256 threads each), fixed at construction
  int select_narrow_grid = 0;  // its CTAs of 128 threads, for steps with more items than that
  int select_deep_grid = 0;    // its CTAs of 512 threads, for steps of long lists (one an SM)
  // The instance a step of `ncols_pad` padded columns (<= this->ncols_pad) launches.
  const ScoreTopkInstance& instance(int ncols) const {
    int i = 0;
    while ((8 << i) < ncols && i < 3) ++i;
    return inst[i];
  }
  // The instance a step of `heads` heads x `query_len` tokens launches (validated inputs).
  const ScoreTopkInstance& step_instance(int heads, int query_len) const {
    return instance(padded_columns(heads * query_len));
  }
};

// Chooses the launch (stages, grid, shared memory) for the given maxima and sets the kernel's
// shared-memory attributes (the cap, the largest carveout). Called once at construction.
// ctas_per_sm: 0 chooses (four, then three, where the instance's registers allow it and a
// pipeline of >= 3 pages fits each with every offset kept; else two when a pipeline of >= 2
// pages fits both; else one), 1-4 force it (cudaErrorInvalidConfiguration where it does not
// fit).
cudaError_t plan_score_topk(int max_heads_x_q, int topk, DType dtype, int max_reqs, int device,
                            int ctas_per_sm, ScoreTopkLaunch* launch);
// The fused path's persistent grid: CTA c of g = fused_ctas(total, grid) scores the step's
// flattened pages [c * total / g, (c + 1) * total / g); a request whose pages span CTAs c0 < c1
// leaves CTA c's ordered list of column `col` at partial[partial_index(col, c + r, ...)] (slot
// c + r is unique: the CTAs' request ranges are monotone), merged by select_topk.
// NOTE: the ranges are static. SMs stream at different rates (the last page of the slowest SM
// lands ~10 us after the median one at 8 x 256K), but handing the last quarter of the pages out
// in 4-page chunks to whichever CTA asked first was measured slower (docs/perf/README.md,
// v6-pool): DRAM stays saturated while the fast SMs idle, and the chunks' lists made the
// merge larger.
constexpr int kMinPagesPerCta = 2;  // small steps use fewer CTAs (fewer lists to merge)
__host__ __device__ inline int64_t fused_ctas(int64_t total, int grid) {
  const int64_t g = (total + kMinPagesPerCta - 1) / kMinPagesPerCta;
  return g < grid ? g : grid;
}
__host__ __device__ inline int64_t cta_of(int64_t x, int64_t total, int64_t g) {
  return ((x + 1) * g - 1) / total;  // largest c with floor(c * total / g) <= x
}
// Slots per column of a call's per-CTA lists: every slot c + r lies below it. Sized per call
// (not by max_tokens), so the workspace holds T * (Qmax * grid + max_tokens) lists, not
// T * Qmax * (grid + max_tokens).
inline int64_t partial_slots(int grid, int num_reqs) {
  return static_cast<int64_t>(grid) + num_reqs;
}
__host__ __device__ inline int64_t partial_index(int col, int64_t slot, int64_t num_slots, int K) {
  return (col * num_slots + slot) * K;
}

// The fused kernel's per-CTA timeline of its last launch (score_trace.cuh: kTraceSlots values per
// CTA, `ctas` CTAs); cudaErrorNotSupported unless the library was built with -DCPIDX_TRACE.
cudaError_t read_score_trace(long long* host, int ctas);
// Each CTA's page landings (kTracePages stamps per CTA, the first kTPages of them this launch's);
// likewise.
cudaError_t read_page_trace(long long* host, int ctas);
// select_topk's stamps (kSelectSlots per CTA with an item) of its last launch; likewise.
cudaError_t read_select_trace(long long* host, int ctas);
// From the next launch on, the fused kernel's last CTA waits `ns` at entry (0: none), standing
// for a CTA the SMs had no room for until others exited; likewise (the trace build only).
cudaError_t set_score_trace_late(long long ns);

cudaError_t launch_score_topk(const ScoreTopkParams& p, DType dtype, const ScoreTopkLaunch& l,
                              cudaStream_t stream);
// Sets l->select_grid, l->select_narrow_grid, l->select_deep_grid and the selection kernels'
// shared-memory cap (the request offsets are sized per launch, from the step's requests) and
// carveout (the largest).
cudaError_t plan_select_topk(int device, ScoreTopkLaunch* l);
// The selection after every score_topk: the split path's top K, or the fused path's merge of the
// requests that spanned CTAs.
cudaError_t launch_select_topk(const ScoreTopkParams& p, const ScoreTopkLaunch& l,
                               cudaStream_t stream);

struct MergeParams {
  const Key* gathered = nullptr;   // [world, total_heads, n, K]; or, when channel.world > 0,
  DeviceChannel channel;           // the same keys polled from the channel (select_topk's stores)
  int world = 1, total_heads = 0;
  int64_t n = 0;
  int topk = 16;
  int head_offset = 0, local_heads = 1;
  int32_t* ids = nullptr;          // [L, n, K] strided
  int64_t ids_head_stride = 0, ids_row_stride = 0;
  SparseTableArgs table;           // optional (L == 1)
  const int32_t* seq_lens = nullptr;
  int num_reqs = 0, query_len = 1;
  int32_t max_seq_len = 0;
  bool pdl = true;
};
cudaError_t launch_merge_topk(const MergeParams& p, cudaStream_t stream);
// The merge and query-packing kernels' attributes (prefer_max_shared), once per Decoder.
cudaError_t plan_merge_topk();

// The smallest shared-memory carveout preference (cudaFuncAttributes::preferredShmemCarveout,
// -1 where none was asked) over score_topk's instances for `dtype`, over select_topk's, and over
// the merge and query-packing kernels. A Decoder sets every one to cudaSharedmemCarveoutMaxShared
// (prefer_max_shared; tests).
cudaError_t smallest_score_topk_carveout(DType dtype, int* smallest);
cudaError_t smallest_select_topk_carveout(int* smallest);
cudaError_t smallest_merge_carveout(int* smallest);

// Packs strided local queries [n, L, D] into a contiguous [n, L, D] buffer (the all-gather
// payload).
cudaError_t launch_pack_queries(const __nv_bfloat16* src, int64_t row_stride,
                                int64_t head_stride, int64_t n, int heads,
                                __nv_bfloat16* dst, cudaStream_t stream);

}  // namespace cuda
}  // namespace cpidx
