// Host-visible argument checks of CONTRACT.md section 8, shared by every reference entry
// point (and meant to be shared by the kernels' launchers): each failure names the argument
// and the expected value. O(1).
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

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

bool ids_strides_nest(int64_t heads, int64_t rows, int64_t topk, int64_t row_stride,
                      int64_t head_stride) {
  // [heads, rows, topk] with the last dim contiguous; the two outer dims nest either way
  // round ([heads, n, K] or [n, heads, K], gaps allowed) so that no two lists overlap.
  const bool many_rows = rows > 1, many_heads = heads > 1;
  using Wide = __int128;  // stride products of a fuzzed call must not overflow
  const bool head_major =
      (!many_rows || row_stride >= topk) &&
      (!many_heads || Wide{head_stride} >= (many_rows ? Wide{rows} * row_stride : Wide{topk}));
  const bool row_major =
      (!many_heads || head_stride >= topk) &&
      (!many_rows || Wide{row_stride} >= (many_heads ? Wide{heads} * head_stride : Wide{topk}));
  return head_major || row_major;
}

Status check_ids(const TopkOutput& out, int heads, int64_t rows, int topk) {
  CPIDX_CHECK(out.ids != nullptr, "ids output is null");
  CPIDX_CHECK(aligned(out.ids, alignof(int32_t)),
              "ids output must be 4-byte aligned (int32), got address " << out.ids);
  CPIDX_CHECK(ids_strides_nest(heads, rows, topk, out.row_stride, out.head_stride),
              "ids strides must hold [heads = " << heads << ", n = " << rows << ", topk = " << topk
                  << "] without overlap: need row_stride >= topk and head_stride >= n * "
                     "row_stride (or head_stride >= topk and row_stride >= heads * "
                     "head_stride), got row_stride "
                  << out.row_stride << ", head_stride " << out.head_stride);
  return Status::ok();
}

namespace {

using Wide = __int128;  // spans of a fuzzed call's strides must not overflow

}  // namespace

int64_t span_bytes(int elem, int64_t inner,
                   std::initializer_list<std::pair<int64_t, int64_t>> dims) {
  if (inner <= 0) return 0;
  Wide last = inner;
  for (const auto& [count, stride] : dims) {
    if (count <= 0) return 0;
    last += Wide{count - 1} * (stride < 0 ? -Wide{stride} : Wide{stride});
  }
  const Wide bytes = last * elem;
  return bytes > INT64_MAX ? INT64_MAX : static_cast<int64_t>(bytes);
}

namespace {

int64_t table_rows_bytes(int num_reqs, int64_t row_stride, int32_t max_seq_len) {
  return span_bytes(sizeof(int32_t), cdiv(max_seq_len, kBlockSize), {{num_reqs, row_stride}});
}

Span cache_span(const PagedCache& cache) {
  constexpr int64_t kPage = int64_t{kBlockSize} * kHeadDim;
  return {"cache (index_cache)", cache.data,
          span_bytes(dtype_bytes(cache.dtype), kPage, {{cache.num_pages, kPage}})};
}

bool overlap(const Span& a, const Span& b) {
  if (a.data == nullptr || b.data == nullptr || a.bytes <= 0 || b.bytes <= 0) return false;
  const Wide a0 = static_cast<Wide>(reinterpret_cast<uintptr_t>(a.data));
  const Wide b0 = static_cast<Wide>(reinterpret_cast<uintptr_t>(b.data));
  return a0 < b0 + b.bytes && b0 < a0 + a.bytes;
}

}  // namespace

void CallSpans::decode_inputs(const DecodeInputs& in) {
  const int64_t rows = in.num_rows();
  input({"query (index_query)", in.query,
         span_bytes(sizeof(uint16_t), kHeadDim,
                    {{rows, in.q_row_stride}, {in.num_heads, in.q_head_stride}})});
  input(cache_span(in.cache));
  input({"block_table", in.block_table,
         table_rows_bytes(in.num_reqs, in.bt_row_stride, in.max_seq_len)});
  input({"seq_lens", in.seq_lens, span_bytes(sizeof(int32_t), in.num_reqs, {})});
}

void CallSpans::prefill_inputs(const PrefillInputs& in) {
  input({"query (index_query)", in.query,
         span_bytes(sizeof(uint16_t), kHeadDim,
                    {{in.num_tokens, in.q_row_stride}, {in.num_heads, in.q_head_stride}})});
  input(cache_span(in.cache));
  input({"block_table", in.block_table,
         table_rows_bytes(in.num_reqs, in.bt_row_stride, in.max_seq_len)});
  input({"cu_seqlens_q", in.cu_seqlens_q,
         span_bytes(sizeof(int32_t), int64_t{in.num_reqs} + 1, {})});
  input({"context_lens", in.context_lens, span_bytes(sizeof(int32_t), in.num_reqs, {})});
  input({"seq_lens", in.seq_lens, span_bytes(sizeof(int32_t), in.num_reqs, {})});
}

void CallSpans::ids(const TopkOutput& out, int heads, int64_t rows, int topk) {
  output({"ids output (out)", out.ids,
          span_bytes(sizeof(int32_t), topk, {{heads, out.head_stride}, {rows, out.row_stride}})});
}

void CallSpans::table(const SparseTableOutput* t, int num_reqs, int query_len,
                      int32_t max_seq_len, int topk) {
  if (t == nullptr || !t->enabled()) return;
  const int64_t rows = int64_t{num_reqs} * query_len;
  input({"attention_block_table", t->attention_block_table,
         table_rows_bytes(num_reqs, t->attn_bt_row_stride, max_seq_len)});
  output({"sparse table (sparse_block_table_out)", t->table,
          span_bytes(sizeof(int32_t), int64_t{topk} * kPagesPerBlock,
                     {{rows, t->table_row_stride}})});
  output({"sparse context lens (sparse_context_lens_out)", t->context_lens,
          span_bytes(sizeof(int32_t), rows, {})});
}

CallSpans decode_spans(const DecodeInputs& in, const TopkOutput& out, int heads, int topk,
                       const SparseTableOutput* table) {
  CallSpans spans;
  spans.decode_inputs(in);
  spans.ids(out, heads, in.num_rows(), topk);
  spans.table(table, in.num_reqs, in.query_len, in.max_seq_len, topk);
  return spans;
}

CallSpans merge_spans(const Key* gathered, int world, int total_heads, int64_t n, int topk,
                      const int32_t* seq_lens, int num_reqs, int query_len, int32_t max_seq_len,
                      const TopkOutput& out, int heads, const SparseTableOutput* table) {
  CallSpans spans;
  spans.input(CallSpans::keys("gathered keys", gathered, int64_t{world} * total_heads * n, topk));
  if (table != nullptr && table->enabled()) {
    spans.input({"seq_lens", seq_lens, span_bytes(sizeof(int32_t), num_reqs, {})});
  }
  spans.ids(out, heads, n, topk);
  spans.table(table, num_reqs, query_len, max_seq_len, topk);
  return spans;
}

Status check_no_aliasing(const CallSpans& spans) {
  auto apart = [](const Span& o, const Span& p, const char* rule) -> Status {
    CPIDX_CHECK(!overlap(o, p), o.name << " and " << p.name << " share memory (" << o.bytes
                                       << " bytes at " << o.data << ", " << p.bytes
                                       << " bytes at " << p.data << "): " << rule);
    return Status::ok();
  };
  for (int i = 0; i < spans.num_outputs; ++i) {
    const Span& o = spans.outputs[i];
    for (int j = i + 1; j < spans.num_outputs; ++j) {
      CPIDX_RETURN_IF_ERROR(
          apart(o, spans.outputs[j], "outputs must not overlap each other"));
    }
    for (int j = 0; j < spans.num_inputs; ++j) {
      CPIDX_RETURN_IF_ERROR(apart(o, spans.inputs[j], "an output must not overlap an input"));
    }
  }
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

Status check_no_aliasing(const DecodeInputs& in, const TopkOutput& out, int heads, int topk,
                         const SparseTableOutput* table) {
  return detail::check_no_aliasing(detail::decode_spans(in, out, heads, topk, table));
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
