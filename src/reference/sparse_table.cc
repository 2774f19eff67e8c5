// Fused page-16 sparse-table rows (CONTRACT.md section 6, REFERENCE_NOTES.md section 9.1):
// selected blocks become 8 page ids each, full blocks in selection order, the row's own
// partial block last, the rest zeroed. O(K * 8) per row.
#include <algorithm>

#include "cpidx/reference.h"
#include "reference/internal.h"

namespace cpidx {
namespace ref {
namespace detail {

Status check_table_args(const SparseTableOutput& table, int num_reqs, int query_len,
                        int32_t max_seq_len, int topk) {
  CPIDX_RETURN_IF_ERROR(validate(table, 1));
  CPIDX_CHECK(table.enabled(), "sparse table outputs are not set (table is null)");
  CPIDX_CHECK(num_reqs >= 1, "num_reqs must be >= 1, got " << num_reqs);
  CPIDX_CHECK(query_len >= 1 && query_len <= kMaxQueryLen,
              "query_len must be in [1, " << kMaxQueryLen << "], got " << query_len);
  CPIDX_CHECK(max_seq_len >= 1, "max_seq_len must be >= 1, got " << max_seq_len);
  CPIDX_CHECK(topk >= 1 && topk <= kMaxTopK,
              "topk must be in [1, " << kMaxTopK << "], got " << topk);
  const int64_t width = int64_t{topk} * kPagesPerBlock;
  CPIDX_CHECK(
      table.table_row_stride >= width || int64_t{num_reqs} * query_len == 1,
      "table_row_stride must be >= topk * 8 = " << width << ", got " << table.table_row_stride);
  const int64_t max_blocks = cdiv(max_seq_len, kBlockSize);
  CPIDX_CHECK(table.attn_bt_row_stride >= max_blocks || num_reqs == 1,
              "attn_bt_row_stride must be >= cdiv(max_seq_len, 128) = "
                  << max_blocks << ", got " << table.attn_bt_row_stride);
  return Status::ok();
}

}  // namespace detail

Status sparse_table(const int32_t* ids, int64_t ids_row_stride, const int32_t* seq_lens,
                    int num_reqs, int query_len, int32_t max_seq_len, int topk,
                    const SparseTableOutput& table) {
  CPIDX_RETURN_IF_ERROR(detail::check_table_args(table, num_reqs, query_len, max_seq_len, topk));
  CPIDX_CHECK(ids != nullptr, "ids is null");
  CPIDX_CHECK(seq_lens != nullptr, "seq_lens is null");
  CPIDX_CHECK(detail::aligned(ids, alignof(int32_t)),
              "ids must be 4-byte aligned (int32), got address " << ids);
  CPIDX_CHECK(detail::aligned(seq_lens, alignof(int32_t)),
              "seq_lens must be 4-byte aligned (int32), got address " << seq_lens);
  const int64_t n = int64_t{num_reqs} * query_len;
  CPIDX_CHECK(ids_row_stride >= topk || n == 1,
              "ids_row_stride must be >= topk = " << topk << ", got " << ids_row_stride);
  detail::CallSpans spans;
  spans.input({"ids", ids, detail::span_bytes(sizeof(int32_t), topk, {{n, ids_row_stride}})});
  spans.input({"seq_lens", seq_lens, detail::span_bytes(sizeof(int32_t), num_reqs, {})});
  spans.table(&table, num_reqs, query_len, max_seq_len, topk);
  CPIDX_RETURN_IF_ERROR(detail::check_no_aliasing(spans));

  const int64_t width = int64_t{topk} * kPagesPerBlock;
  for (int64_t row = 0; row < n; ++row) {
    const int req = static_cast<int>(row / query_len);
    const int t = static_cast<int>(row % query_len);
    int32_t ignored = 0;  // seq_len clamps are reported by the scoring pass
    const int64_t seq_len = clamp_seq_len(seq_lens[req], max_seq_len, &ignored);
    const int64_t abs_pos = seq_len - query_len + t;
    const int64_t causal = std::max<int64_t>(abs_pos + 1, 0);
    int32_t* out = table.table + row * table.table_row_stride;
    std::fill(out, out + width, 0);
    if (causal == 0) {
      table.context_lens[row] = 0;
      continue;
    }
    const int64_t self_blk = abs_pos / kBlockSize;
    const int32_t* sel = ids + row * ids_row_stride;
    const int32_t* attn_row = table.attention_block_table + req * table.attn_bt_row_stride;
    auto write_block = [&](int64_t slot, int32_t block) {
      const int64_t base = int64_t{attn_row[block]} * table.block_page_stride;
      for (int j = 0; j < kPagesPerBlock; ++j) {
        out[slot * kPagesPerBlock + j] = static_cast<int32_t>(base + j);
      }
    };
    int64_t n_full = 0;
    bool has_tail = false;
    for (int i = 0; i < topk; ++i) {
      if (sel[i] < 0 || sel[i] > self_blk) continue;
      if (sel[i] < self_blk) {
        write_block(n_full++, sel[i]);
      } else {
        has_tail = true;
      }
    }
    if (has_tail) write_block(n_full, static_cast<int32_t>(self_blk));
    const int64_t n_valid = n_full + (has_tail ? 1 : 0);
    const int64_t ctx = has_tail ? n_full * kBlockSize + (causal - self_blk * kBlockSize)
                                 : std::min(n_valid * kBlockSize, causal);
    table.context_lens[row] = static_cast<int32_t>(ctx);
  }
  return Status::ok();
}

}  // namespace ref
}  // namespace cpidx
