// Host-visible argument checks of CONTRACT.md section 8, shared by every reference entry
// point (and meant to be shared by the kernels' launchers): each failure names the argument
// and the expected value. O(1).
#include <cmath>
#include <cstdint>
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

Status check_ids(const TopkOutput& out, int heads, int64_t rows, int topk) {
  CPIDX_CHECK(out.ids != nullptr, "ids output is null");
  CPIDX_CHECK(aligned(out.ids, alignof(int32_t)),
              "ids output must be 4-byte aligned (int32), got address " << out.ids);
  // [heads, rows, topk] with the last dim contiguous; the two outer dims nest either way
  // round ([heads, n, K] or [n, heads, K], gaps allowed) so that no two lists overlap.
  const bool many_rows = rows > 1, many_heads = heads > 1;
  using Wide = __int128;  // stride products of a fuzzed call must not overflow
  const bool head_major =
      (!many_rows || out.row_stride >= topk) &&
      (!many_heads || Wide{out.head_stride} >= (many_rows ? Wide{rows} * out.row_stride : topk));
  const bool row_major =
      (!many_heads || out.head_stride >= topk) &&
      (!many_rows || Wide{out.row_stride} >= (many_heads ? Wide{heads} * out.head_stride : topk));
  CPIDX_CHECK(head_major || row_major,
              "ids strides must hold [heads = " << heads << ", n = " << rows << ", topk = " << topk
                  << "] without overlap: need row_stride >= topk and head_stride >= n * "
                     "row_stride (or head_stride >= topk and row_stride >= heads * "
                     "head_stride), got row_stride "
                  << out.row_stride << ", head_stride " << out.head_stride);
  return Status::ok();
}

}  // namespace detail

namespace {

using detail::aligned;

Status check_cache(const PagedCache& cache) {
  if (cache.dtype != DType::kBF16 && cache.dtype != DType::kFP8E4M3) {
    return unsupported("cache dtype must be bf16 or fp8_e4m3, got dtype code " +
                       std::to_string(static_cast<int>(cache.dtype)));
  }
  CPIDX_CHECK(cache.data != nullptr, "cache data is null");
  CPIDX_CHECK(aligned(cache.data, static_cast<size_t>(dtype_bytes(cache.dtype))),
              "cache data must be " << dtype_bytes(cache.dtype) << "-byte aligned ("
                                    << to_string(cache.dtype) << "), got address " << cache.data);
  CPIDX_CHECK(cache.num_pages >= 1, "cache num_pages must be >= 1, got " << cache.num_pages);
  return Status::ok();
}

// The query is [rows, num_heads, D] with the last dim contiguous: rows and heads must not
// alias each other's head-dim vectors.
Status check_query(const uint16_t* query, int num_heads, int64_t rows, int64_t row_stride,
                   int64_t head_stride) {
  CPIDX_CHECK(query != nullptr, "query is null");
  CPIDX_CHECK(aligned(query, alignof(uint16_t)),
              "query must be 2-byte aligned (bf16), got address " << query);
  CPIDX_CHECK(num_heads >= 1 && num_heads <= kMaxHeads,
              "num_heads must be in [1, " << kMaxHeads << "], got " << num_heads);
  CPIDX_CHECK(num_heads == 1 || head_stride >= kHeadDim,
              "q_head_stride must be >= " << kHeadDim << " (head dim), got " << head_stride);
  CPIDX_CHECK(rows <= 1 || row_stride >= kHeadDim,
              "q_row_stride must be >= " << kHeadDim << " (head dim), got " << row_stride);
  return Status::ok();
}

Status check_int32_input(const int32_t* p, const char* name) {
  CPIDX_CHECK(p != nullptr, name << " is null");
  CPIDX_CHECK(aligned(p, alignof(int32_t)),
              name << " must be 4-byte aligned (int32), got address " << p);
  return Status::ok();
}

Status check_common(int32_t max_seq_len, float scale, int num_reqs, const int32_t* block_table,
                    int64_t bt_row_stride) {
  CPIDX_CHECK(max_seq_len >= 1, "max_seq_len must be >= 1, got " << max_seq_len);
  CPIDX_CHECK(scale > 0.0f && std::isfinite(scale), "scale must be > 0 and finite, got " << scale);
  CPIDX_CHECK(num_reqs >= 1, "num_reqs must be >= 1, got " << num_reqs);
  CPIDX_CHECK(block_table != nullptr, "block_table is null");
  CPIDX_CHECK(aligned(block_table, alignof(int32_t)),
              "block_table must be 4-byte aligned (int32), got address " << block_table);
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
  CPIDX_RETURN_IF_ERROR(check_int32_input(in.seq_lens, "seq_lens"));
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
  CPIDX_RETURN_IF_ERROR(check_int32_input(in.cu_seqlens_q, "cu_seqlens_q"));
  CPIDX_RETURN_IF_ERROR(check_int32_input(in.context_lens, "context_lens"));
  CPIDX_RETURN_IF_ERROR(check_int32_input(in.seq_lens, "seq_lens"));
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
      "the sparse table needs exactly one index head (num_heads == 1; local_heads == 1 under "
      "context parallelism), got "
          << local_heads);
  CPIDX_CHECK(aligned(table.attention_block_table, alignof(int32_t)) &&
                  aligned(table.table, alignof(int32_t)) &&
                  aligned(table.context_lens, alignof(int32_t)),
              "attention_block_table, table and context_lens must be 4-byte aligned (int32)");
  return Status::ok();
}

}  // namespace ref
}  // namespace cpidx
