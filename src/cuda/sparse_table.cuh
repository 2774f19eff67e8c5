// src/cuda/sparse_table.cuh: the fused page-16 sparse-table row (CONTRACT.md section 6), written
// by one warp from a row's ordered selection: full blocks in selection order, the row's own
// partial block last, the rest zeroed; plus the row's attended context length.
#pragma once

#include <stdint.h>

#include "cpidx/contract.h"
#include "kernels.h"

namespace cpidx {
namespace cuda {

// keys[0..K): the row's selection in output order (kPadKey = none). pos: the row's position
// (< 0 for padding rows). Every lane of the warp calls it. kDistinct: no two keys name one block
// (score_topk's and select_topk's own selections: every block is scored once), so the valid
// blocks are counted as they come; merge_topk's gathered keys may repeat one (a corrupted or
// custom gather), and there the tail counts once however often it was selected (907ce90).
// NOTE: inlined into every score_topk instance (shard_select.cuh), select_topk and merge_topk,
// where it runs only on steps with a table, yet its code shapes the kernels' register
// allocation: with the tail-once count in select_topk, the deep grid's dense instance spilled
// 120 B and the wide one's 28 B, and the plain and CP P=2 rows at 8 x 1M Q = 4 ran 1.0-3.4%
// slower than v47's build on an H100 (v60's call); with this count -0.6 to +0.7% of it
// (docs/perf/README.md, v60 and d1207d). select_topk's spills are checked by ctest
// (select_topk_instances_do_not_spill); a change here is A/B'd like a kernel change. Not
// inlining it gave every scoring instance a 440-584 B stack frame.
template <bool kDistinct>
__device__ __forceinline__ void write_sparse_row(const SparseTableArgs& t, const Key* keys, int k,
                                                 int req, int64_t row, int64_t pos, int lane) {
  int32_t* out = t.table + row * t.table_row_stride;
  const int64_t causal = pos + 1 > 0 ? pos + 1 : 0;
  const int64_t self_blk = pos >= 0 ? pos / kBlockSize : -1;
  auto block_of = [&](int i) -> int64_t {
    return keys[i] == kPadKey ? -1 : static_cast<int64_t>(key_block(keys[i]));
  };
  auto is_valid = [&](int64_t b) { return causal > 0 && b >= 0 && b <= self_blk; };
  int n_full = 0, n_counted = 0;
  bool has_tail = false;
  for (int i = 0; i < k; ++i) {
    int64_t b = block_of(i);
    if (!is_valid(b)) continue;
    ++n_counted;
    if (b < self_blk) ++n_full; else has_tail = true;
  }
  // The tail once, however often a (corrupted) merge selected it: every entry of it goes to
  // slot n_full, and the zeros start after it. Distinct keys hold it at most once.
  const int n_valid = kDistinct ? n_counted : n_full + (has_tail ? 1 : 0);
  for (int x = lane; x < k * kPagesPerBlock; x += 32) {
    const int e = x / kPagesPerBlock, j = x % kPagesPerBlock;
    // The slot of entry e: full blocks keep selection order, the tail block goes last.
    const int64_t b = block_of(e);
    if (is_valid(b)) {
      int slot = n_full;
      if (b < self_blk) {
        slot = 0;
        for (int i = 0; i < e; ++i) {
          int64_t bi = block_of(i);
          slot += is_valid(bi) && bi < self_blk;
        }
      }
      const int64_t page =
          static_cast<int64_t>(t.attention_block_table[req * t.attn_bt_row_stride + b]) *
              t.block_page_stride + j;
      out[slot * kPagesPerBlock + j] = static_cast<int32_t>(page);
    }
    if (x >= n_valid * kPagesPerBlock) out[x] = 0;
  }
  if (lane == 0) {
    int64_t ctx = has_tail ? n_full * static_cast<int64_t>(kBlockSize) + (causal - self_blk * kBlockSize)
                           : (n_valid * static_cast<int64_t>(kBlockSize) < causal
                                  ? n_valid * static_cast<int64_t>(kBlockSize) : causal);
    t.context_lens[row] = static_cast<int32_t>(ctx);
  }
}

}  // namespace cuda
}  // namespace cpidx
