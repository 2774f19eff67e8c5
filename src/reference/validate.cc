// Host-visible argument checks of CONTRACT.md section 8, shared by every reference entry
// point (and meant to be shared by the kernels' launchers): each failure names the argument
// and the expected value. O(1).
#include <cmath>
#include <string>

#include "cpidx/reference.h"
#include "reference/internal.h"

namespace cpidx {
namespace ref {
namespace detail {

Status check_selection(const Selection& sel) {
  if (sel.topk > kMaxTopK) {
    return unsupported("topk must be in [1, " + std::to_string(kMaxTopK) + "], got " +
                       std::to_string(sel.topk));
  }
  CPIDX_CHECK(sel.topk >= 1, "topk must be in [1, " << kMaxTopK << "], got " << sel.topk);
  CPIDX_CHECK(sel.init_blocks >= 0, "init_blocks must be >= 0, got " << sel.init_blocks);
  CPIDX_CHECK(sel.local_blocks >= 0, "local_blocks must be >= 0, got " << sel.local_blocks);
  return Status::ok();
}

}  // namespace detail

namespace {

Status check_cache(const PagedCache& cache) {
  if (cache.dtype != DType::kBF16 && cache.dtype != DType::kFP8E4M3) {
    return unsupported("cache dtype must be bf16 or fp8_e4m3, got dtype code " +
                       std::to_string(static_cast<int>(cache.dtype)));
  }
  CPIDX_CHECK(cache.data != nullptr, "cache data is null");
  CPIDX_CHECK(cache.num_pages >= 1, "cache num_pages must be >= 1, got " << cache.num_pages);
  return Status::ok();
}

// The query is [rows, num_heads, D] with the last dim contiguous: rows and heads must not
// alias each other's head-dim vectors.
Status check_query(const uint16_t* query, int num_heads, int64_t rows, int64_t row_stride,
                   int64_t head_stride) {
  CPIDX_CHECK(query != nullptr, "query is null");
  CPIDX_CHECK(num_heads >= 1 && num_heads <= kMaxHeads,
              "num_heads must be in [1, " << kMaxHeads << "], got " << num_heads);
  CPIDX_CHECK(num_heads == 1 || head_stride >= kHeadDim,
              "q_head_stride must be >= " << kHeadDim << " (head dim), got " << head_stride);
  CPIDX_CHECK(rows <= 1 || row_stride >= kHeadDim,
              "q_row_stride must be >= " << kHeadDim << " (head dim), got " << row_stride);
  return Status::ok();
}

Status check_common(int32_t max_seq_len, float scale, int num_reqs, const int32_t* block_table,
                    int64_t bt_row_stride) {
  CPIDX_CHECK(max_seq_len >= 1, "max_seq_len must be >= 1, got " << max_seq_len);
  CPIDX_CHECK(scale > 0.0f && std::isfinite(scale), "scale must be > 0 and finite, got " << scale);
  CPIDX_CHECK(num_reqs >= 1, "num_reqs must be >= 1, got " << num_reqs);
  CPIDX_CHECK(block_table != nullptr, "block_table is null");
  const int64_t max_blocks = cdiv(max_seq_len, kBlockSize);
  CPIDX_CHECK(num_reqs == 1 || bt_row_stride >= max_blocks,
              "bt_row_stride must be >= cdiv(max_seq_len, 128) = " << max_blocks << ", got "
                                                                   << bt_row_stride);
  return Status::ok();
}

}  // namespace

Status validate(const DecodeInputs& in, const Selection& sel, int64_t max_tokens) {
  CPIDX_RETURN_IF_ERROR(detail::check_selection(sel));
  CPIDX_CHECK(in.query_len >= 1 && in.query_len <= kMaxQueryLen,
              "query_len must be in [1, " << kMaxQueryLen << "], got " << in.query_len);
  CPIDX_RETURN_IF_ERROR(
      check_common(in.max_seq_len, in.scale, in.num_reqs, in.block_table, in.bt_row_stride));
  CPIDX_CHECK(
      max_tokens < 0 || in.num_rows() <= max_tokens,
      "num_reqs * query_len (" << in.num_rows() << ") exceeds max_tokens (" << max_tokens << ")");
  CPIDX_RETURN_IF_ERROR(
      check_query(in.query, in.num_heads, in.num_rows(), in.q_row_stride, in.q_head_stride));
  CPIDX_RETURN_IF_ERROR(check_cache(in.cache));
  CPIDX_CHECK(in.seq_lens != nullptr, "seq_lens is null");
  return Status::ok();
}

Status validate(const PrefillInputs& in, const Selection& sel) {
  CPIDX_RETURN_IF_ERROR(detail::check_selection(sel));
  CPIDX_RETURN_IF_ERROR(
      check_common(in.max_seq_len, in.scale, in.num_reqs, in.block_table, in.bt_row_stride));
  CPIDX_CHECK(in.num_tokens >= 1, "num_tokens must be >= 1, got " << in.num_tokens);
  CPIDX_RETURN_IF_ERROR(
      check_query(in.query, in.num_heads, in.num_tokens, in.q_row_stride, in.q_head_stride));
  CPIDX_RETURN_IF_ERROR(check_cache(in.cache));
  CPIDX_CHECK(in.cu_seqlens_q != nullptr, "cu_seqlens_q is null");
  CPIDX_CHECK(in.context_lens != nullptr, "context_lens is null");
  CPIDX_CHECK(in.seq_lens != nullptr, "seq_lens is null");
  return Status::ok();
}

Status validate(const SparseTableOutput& table, int local_heads) {
  const int given = (table.attention_block_table != nullptr) + (table.table != nullptr) +
                    (table.context_lens != nullptr) + (table.block_page_stride != 0);
  if (given == 0) return Status::ok();
  CPIDX_CHECK(given == 4,
              "sparse table outputs must be given all together or not at all: "
              "attention_block_table, table, context_lens and block_page_stride (got "
                  << given << " of 4)");
  CPIDX_CHECK(table.block_page_stride == 8 || table.block_page_stride == 16,
              "block_page_stride must be 8 or 16, got " << table.block_page_stride);
  CPIDX_CHECK(
      local_heads == 1,
      "the sparse table needs exactly one index head (local_heads == 1), got " << local_heads);
  return Status::ok();
}

}  // namespace ref
}  // namespace cpidx
