// Selection of CONTRACT.md sections 4 and 5: forced scores, ordered keys, the shard's top-K,
// the merge of the world's candidates, and the plain decode (= world 1). Cost per (head, row):
// O(V log K) for the shard, O(P*K log K) for the merge.
#include <algorithm>
#include <atomic>
#include <functional>
#include <vector>

#include "cpidx/reference.h"
#include "reference/internal.h"

namespace cpidx {
namespace ref {
namespace {

// Top `k` keys of `cand`, descending, padded with kPadKey. Keys of one row are unique, so
// the order is strict and the result does not depend on the sort algorithm.
void top_keys(std::vector<Key>& cand, int k, Key* out) {
  const size_t m = std::min(cand.size(), static_cast<size_t>(k));
  std::partial_sort(cand.begin(), cand.begin() + static_cast<std::ptrdiff_t>(m), cand.end(),
                    std::greater<Key>());
  std::copy(cand.begin(), cand.begin() + static_cast<std::ptrdiff_t>(m), out);
  std::fill(out + m, out + k, kPadKey);
}

}  // namespace

void select_keys(const float* scores, const int64_t* blocks, int64_t count, int64_t visible,
                 const Selection& sel, Key* keys_out) {
  std::vector<Key> cand(static_cast<size_t>(std::max<int64_t>(count, 0)));
  for (int64_t i = 0; i < count; ++i) {
    const float s = forced_score(scores[i], blocks[i], visible, sel.init_blocks, sel.local_blocks);
    cand[static_cast<size_t>(i)] = make_key(s, blocks[i]);
  }
  top_keys(cand, sel.topk, keys_out);
}

Status shard_topk_keys(const DecodeInputs& in, const Selection& sel, int world, int rank, Key* keys,
                       int32_t* err) {
  CPIDX_RETURN_IF_ERROR(validate(in, sel));
  CPIDX_CHECK(world >= 1, "world must be >= 1, got " << world);
  CPIDX_CHECK(rank >= 0 && rank < world, "rank must be in [0, " << world << "), got " << rank);
  CPIDX_CHECK(keys != nullptr, "keys is null");
  CPIDX_CHECK(detail::aligned(keys, alignof(Key)), "keys must be 8-byte aligned, got address "
                                                       << keys);
  const int64_t n = in.num_rows();
  detail::CallSpans spans;
  spans.decode_inputs(in);
  spans.output(detail::CallSpans::keys("keys", keys, in.num_heads * n, sel.topk));
  spans.flag("err", err);
  CPIDX_RETURN_IF_ERROR(detail::check_no_aliasing(spans));
  const int num_q = in.query_len;
  const int heads = in.num_heads;
  const int k = sel.topk;
  std::atomic<int32_t> flags{0};
  const double work = static_cast<double>(n) * heads * in.max_seq_len * kHeadDim / world;
  detail::parallel_for(in.num_reqs, work, [&](int64_t req, int) {
    int32_t local_err = 0;
    const int32_t seq_len = clamp_seq_len(in.seq_lens[req], in.max_seq_len, &local_err);
    const int64_t slots = owned_blocks(visible_blocks(int64_t{seq_len} - 1), world, rank);
    std::vector<float> buf(static_cast<size_t>(num_q) * heads * slots);
    detail::score_request(in, world, rank, static_cast<int>(req), seq_len, slots, buf.data(),
                          &local_err);
    std::vector<int64_t> blocks(static_cast<size_t>(slots));
    for (int64_t l = 0; l < slots; ++l) blocks[static_cast<size_t>(l)] = l * world + rank;
    for (int t = 0; t < num_q; ++t) {
      const int64_t row = req * num_q + t;
      const int64_t visible = visible_blocks(int64_t{seq_len} - num_q + t);
      const int64_t count = owned_blocks(visible, world, rank);  // the row's own shard slots
      for (int h = 0; h < heads; ++h) {
        const float* s = buf.data() + (static_cast<size_t>(t) * heads + h) * slots;
        select_keys(s, blocks.data(), count, visible, sel, keys + (h * n + row) * k);
      }
    }
    flags.fetch_or(local_err);
  });
  if (err != nullptr) *err |= flags.load();
  return Status::ok();
}

Status merge_topk_keys(const Key* gathered, int world, int total_heads, int64_t n,
                       const Selection& sel, int head_offset, int local_heads,
                       const int32_t* seq_lens, int num_reqs, int query_len, int32_t max_seq_len,
                       const TopkOutput& out, const SparseTableOutput* table) {
  CPIDX_RETURN_IF_ERROR(detail::check_selection(sel));
  CPIDX_CHECK(world >= 1, "world must be >= 1, got " << world);
  CPIDX_CHECK(total_heads >= 1 && total_heads <= kMaxHeads,
              "total_heads must be in [1, " << kMaxHeads << "], got " << total_heads);
  CPIDX_CHECK(local_heads >= 1 && head_offset >= 0 && head_offset + local_heads <= total_heads,
              "owned heads [head_offset, head_offset + local_heads) = ["
                  << head_offset << ", " << head_offset + local_heads << ") must lie in [0, "
                  << total_heads << ")");
  CPIDX_CHECK(query_len >= 1 && query_len <= kMaxQueryLen,
              "query_len must be in [1, " << kMaxQueryLen << "], got " << query_len);
  CPIDX_CHECK(
      n == int64_t{num_reqs} * query_len,
      "n must equal num_reqs * query_len = " << int64_t{num_reqs} * query_len << ", got " << n);
  CPIDX_CHECK(num_reqs >= 0, "num_reqs must be >= 0, got " << num_reqs);
  CPIDX_CHECK(gathered != nullptr || n == 0, "gathered keys are null");
  CPIDX_CHECK(detail::aligned(gathered, alignof(Key)),
              "gathered keys must be 8-byte aligned, got address " << gathered);
  CPIDX_RETURN_IF_ERROR(detail::check_ids(out, local_heads, n, sel.topk));
  const bool with_table = table != nullptr;
  if (with_table) {
    CPIDX_RETURN_IF_ERROR(validate(*table, local_heads));
    if (table->enabled()) {  // every table argument is checked before any id is written
      CPIDX_CHECK(seq_lens != nullptr, "seq_lens is null");
      CPIDX_CHECK(detail::aligned(seq_lens, alignof(int32_t)),
                  "seq_lens must be 4-byte aligned (int32), got address " << seq_lens);
      CPIDX_RETURN_IF_ERROR(
          detail::check_table_args(*table, num_reqs, query_len, max_seq_len, sel.topk));
    }
  }
  CPIDX_RETURN_IF_ERROR(detail::check_no_aliasing(
      detail::merge_spans(gathered, world, total_heads, n, sel.topk, seq_lens, num_reqs,
                          query_len, max_seq_len, out, local_heads, table)));

  const int k = sel.topk;
  const int64_t rows = n;
  detail::parallel_for(
      rows, static_cast<double>(rows) * local_heads * world * k * 16, [&](int64_t row, int) {
        std::vector<Key> cand(static_cast<size_t>(world) * k);
        std::vector<Key> win(static_cast<size_t>(k));
        for (int j = 0; j < local_heads; ++j) {
          const int h = head_offset + j;
          for (int w = 0; w < world; ++w) {
            const Key* src = gathered + ((int64_t{w} * total_heads + h) * rows + row) * k;
            std::copy(src, src + k, cand.begin() + int64_t{w} * k);
          }
          top_keys(cand, k, win.data());
          int32_t* dst = out.ids + j * out.head_stride + row * out.row_stride;
          for (int i = 0; i < k; ++i) dst[i] = key_is_pad(win[i]) ? -1 : key_block(win[i]);
        }
      });
  if (with_table && table->enabled()) {
    return sparse_table(out.ids, out.row_stride, seq_lens, num_reqs, query_len, max_seq_len, k,
                        *table);
  }
  return Status::ok();
}

Status decode_topk(const DecodeInputs& in, const Selection& sel, const TopkOutput& out,
                   const SparseTableOutput* table, int32_t* err) {
  CPIDX_RETURN_IF_ERROR(validate(in, sel));
  CPIDX_RETURN_IF_ERROR(detail::check_ids(out, in.num_heads, in.num_rows(), sel.topk));
  if (table != nullptr) {  // every argument is checked before scoring raises any error bit
    CPIDX_RETURN_IF_ERROR(validate(*table, in.num_heads));
    if (table->enabled()) {
      CPIDX_RETURN_IF_ERROR(detail::check_table_args(*table, in.num_reqs, in.query_len,
                                                     in.max_seq_len, sel.topk));
    }
  }
  detail::CallSpans spans = detail::decode_spans(in, out, in.num_heads, sel.topk, table);
  spans.flag("err", err);
  CPIDX_RETURN_IF_ERROR(detail::check_no_aliasing(spans));
  std::vector<Key> keys(static_cast<size_t>(in.num_heads * in.num_rows() * sel.topk));
  CPIDX_RETURN_IF_ERROR(shard_topk_keys(in, sel, 1, 0, keys.data(), err));
  return merge_topk_keys(keys.data(), 1, in.num_heads, in.num_rows(), sel, 0, in.num_heads,
                         in.seq_lens, in.num_reqs, in.query_len, in.max_seq_len, out, table);
}

}  // namespace ref
}  // namespace cpidx
