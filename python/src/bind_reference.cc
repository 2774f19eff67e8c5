// python/src/bind_reference.cc: the CPU reference family (cpidx::ref) on host arrays: plain
// decode (with the optional sparse table), prefill, and the two halves of the context-parallel
// decode (shard keys, merge) so Python can run ranks over its own exchange. Destination passing:
// every output is an argument; the return value is the device-error bits of clamped inputs.
#include <nanobind/nanobind.h>

#include <string>

#include "cpidx/reference.h"
#include "tensor_args.h"

namespace cpidx::py {
namespace {

constexpr Place kHost{};

int32_t ref_decode_topk(const InArray& index_query, const InArray& index_cache,
                        const InArray& block_table, const InArray& seq_lens, int query_len,
                        const OutArray& out, double scale, int topk, int init_blocks,
                        int local_blocks, int64_t max_seq_len,
                        const std::optional<InArray>& attention_block_table,
                        const std::optional<OutArray>& sparse_block_table_out,
                        const std::optional<OutArray>& sparse_context_lens_out,
                        std::optional<int> block_page_stride) {
  const Selection sel = selection(topk, init_blocks, local_blocks);
  const DecodeBatch b = decode_batch(index_query, index_cache, block_table, seq_lens, query_len,
                                     scale, max_seq_len, kHost);
  const TopkOutput o = topk_output(out, b.in.num_heads, b.rows, topk, kHost);
  const SparseTableOutput t = sparse_table_output(
      attention_block_table, sparse_block_table_out, sparse_context_lens_out, block_page_stride,
      b.in.num_reqs, b.rows, topk, max_seq_len, kHost);
  int32_t err = 0;
  Status st;
  {
    nb::gil_scoped_release release;
    st = ref::decode_topk(b.in, sel, o, t.enabled() ? &t : nullptr, &err);
  }
  check_status(st);
  return err;
}

int32_t ref_prefill_topk(const InArray& index_query, const InArray& index_cache,
                         const InArray& block_table, const InArray& cu_seqlens_q,
                         const InArray& context_lens, const InArray& seq_lens,
                         const OutArray& out, double scale, int topk, int init_blocks,
                         int local_blocks, int64_t max_seq_len) {
  const Selection sel = selection(topk, init_blocks, local_blocks);
  const PrefillInputs in = prefill_inputs(index_query, index_cache, block_table, cu_seqlens_q,
                                          context_lens, seq_lens, scale, max_seq_len, kHost);
  const TopkOutput o = topk_output(out, in.num_heads, in.num_tokens, topk, kHost);
  int32_t err = 0;
  Status st;
  {
    nb::gil_scoped_release release;
    st = ref::prefill_topk(in, sel, o, &err);
  }
  check_status(st);
  return err;
}

int32_t ref_shard_topk_keys(const InArray& index_query, const InArray& index_cache,
                            const InArray& block_table, const InArray& seq_lens, int query_len,
                            const nb::ndarray<>& keys_out, double scale, int topk,
                            int init_blocks, int local_blocks, int64_t max_seq_len, int world_size,
                            int rank) {
  const Selection sel = selection(topk, init_blocks, local_blocks);
  if (world_size < 1) {
    throw nb::value_error(("world_size: expected >= 1, got " + std::to_string(world_size)).c_str());
  }
  if (rank < 0 || rank >= world_size) {
    throw nb::value_error(("rank: expected 0 <= rank < world_size = " + std::to_string(world_size) +
                           ", got " + std::to_string(rank)).c_str());
  }
  const DecodeBatch b = decode_batch(index_query, index_cache, block_table, seq_lens, query_len,
                                     scale, max_seq_len, kHost);
  Key* keys = key_buffer(keys_out, "keys_out", {b.in.num_heads, b.rows, topk}, kHost);
  int32_t err = 0;
  Status st;
  {
    nb::gil_scoped_release release;
    st = ref::shard_topk_keys(b.in, sel, world_size, rank, keys, &err);
  }
  check_status(st);
  return err;
}

void ref_merge_topk_keys(const nb::ndarray<>& gathered, const InArray& seq_lens, int query_len,
                         const OutArray& out, int topk, int init_blocks, int local_blocks,
                         int64_t max_seq_len, int head_offset,
                         const std::optional<InArray>& attention_block_table,
                         const std::optional<OutArray>& sparse_block_table_out,
                         const std::optional<OutArray>& sparse_context_lens_out,
                         std::optional<int> block_page_stride) {
  const Selection sel = selection(topk, init_blocks, local_blocks);
  const DecodeBatch b = merge_batch(seq_lens, query_len, max_seq_len, kHost);
  if (gathered.ndim() != 4) {
    throw nb::value_error("gathered: expected 4 dims [world_size, total_heads, tokens, topk]");
  }
  const int world = static_cast<int>(gathered.shape(0));
  const int total_heads = static_cast<int>(gathered.shape(1));
  const Key* keys = key_buffer(gathered, "gathered", {world, total_heads, b.rows, topk}, kHost);
  if (out.ndim() != 3) throw nb::value_error("out: expected 3 dims [heads, tokens, topk]");
  const int local_heads = static_cast<int>(out.shape(0));
  const TopkOutput o = topk_output(out, local_heads, b.rows, topk, kHost);
  const SparseTableOutput t = sparse_table_output(
      attention_block_table, sparse_block_table_out, sparse_context_lens_out, block_page_stride,
      b.in.num_reqs, b.rows, topk, max_seq_len, kHost);
  Status st;
  {
    nb::gil_scoped_release release;
    st = ref::merge_topk_keys(keys, world, total_heads, b.rows, sel, head_offset, local_heads,
                              b.in.seq_lens, b.in.num_reqs, query_len, b.in.max_seq_len, o,
                              t.enabled() ? &t : nullptr);
  }
  check_status(st);
}

// What a context-parallel step of this rank (local_heads heads of local_q) would refuse before
// its first collective, on the host: IndexerCPDecode agrees with its peers on the result.
void ref_check_cp_decode(const InArray& local_q, const InArray& kv_cache,
                         const InArray& block_table, const InArray& seq_lens, int query_len,
                         const OutArray& out, double scale, int topk, int init_blocks,
                         int local_blocks, int64_t max_seq_len, int local_heads,
                         int64_t max_tokens, int max_query_len,
                         const std::optional<InArray>& attention_block_table,
                         const std::optional<OutArray>& sparse_block_table_out,
                         const std::optional<OutArray>& sparse_context_lens_out,
                         std::optional<int> block_page_stride) {
  const Selection sel = selection(topk, init_blocks, local_blocks);
  check_range("query_len", query_len, 1, "max_query_len", max_query_len);
  const DecodeBatch b = decode_batch(local_q, kv_cache, block_table, seq_lens, query_len, scale,
                                     max_seq_len, kHost, DecodeArgNames{"local_q", "kv_cache"});
  if (b.in.num_heads != local_heads) {
    throw nb::value_error(("local_q: expected this rank's " + std::to_string(local_heads) +
                           " heads (local_heads), got " + std::to_string(b.in.num_heads))
                              .c_str());
  }
  check_status(ref::validate(b.in, sel, max_tokens));
  const TopkOutput o = topk_output(out, local_heads, b.rows, topk, kHost);
  const SparseTableOutput t = sparse_table_output(
      attention_block_table, sparse_block_table_out, sparse_context_lens_out, block_page_stride,
      b.in.num_reqs, b.rows, topk, max_seq_len, kHost);
  check_status(ref::validate(t, local_heads));
  check_status(ref::check_no_aliasing(b.in, o, local_heads, topk, t.enabled() ? &t : nullptr));
}

}  // namespace

void bind_reference(nb::module_& m) {
  using namespace nb::literals;
  // DeviceError bits (cpidx/contract.h): what an error flag holds after clamped device values.
  m.attr("ERR_SEQ_LEN_OUT_OF_RANGE") = static_cast<int>(kErrSeqLenOutOfRange);
  m.attr("ERR_PAGE_OUT_OF_RANGE") = static_cast<int>(kErrPageOutOfRange);
  // Context-parallel ranks of the GPU decode (cpidx/contract.h; the reference takes any).
  m.attr("MAX_WORLD_SIZE") = kMaxWorldSize;
  m.def("ref_decode_topk", &ref_decode_topk, "index_query"_a, "index_cache"_a, "block_table"_a,
        "seq_lens"_a, "query_len"_a, "out"_a, nb::kw_only(), "scale"_a, "topk"_a,
        "init_blocks"_a, "local_blocks"_a, "max_seq_len"_a,
        "attention_block_table"_a = nb::none(), "sparse_block_table_out"_a = nb::none(),
        "sparse_context_lens_out"_a = nb::none(), "block_page_stride"_a = nb::none(),
        "CPU reference decode: ids [heads, n, topk] into `out`; returns device-error bits.");
  m.def("ref_prefill_topk", &ref_prefill_topk, "index_query"_a, "index_cache"_a,
        "block_table"_a, "cu_seqlens_q"_a, "context_lens"_a, "seq_lens"_a, "out"_a,
        nb::kw_only(), "scale"_a, "topk"_a, "init_blocks"_a, "local_blocks"_a, "max_seq_len"_a,
        "CPU reference prefill: ids [heads, tokens, topk] into `out`; returns device-error bits.");
  m.def("ref_shard_topk_keys", &ref_shard_topk_keys, "index_query"_a, "index_cache"_a,
        "block_table"_a, "seq_lens"_a, "query_len"_a, "keys_out"_a, nb::kw_only(), "scale"_a,
        "topk"_a, "init_blocks"_a, "local_blocks"_a, "max_seq_len"_a, "world_size"_a, "rank"_a,
        "CPU reference shard top-K: ordered keys [heads, n, topk] (int64) of rank's blocks.");
  m.def("ref_check_cp_decode", &ref_check_cp_decode, "local_q"_a, "kv_cache"_a,
        "block_table"_a, "seq_lens"_a, "query_len"_a, "out"_a, nb::kw_only(), "scale"_a,
        "topk"_a, "init_blocks"_a, "local_blocks"_a, "max_seq_len"_a, "local_heads"_a,
        "max_tokens"_a, "max_query_len"_a, "attention_block_table"_a = nb::none(),
        "sparse_block_table_out"_a = nb::none(), "sparse_context_lens_out"_a = nb::none(),
        "block_page_stride"_a = nb::none(),
        "Raises what this rank's context-parallel step would refuse before its first "
        "collective (host arrays); runs nothing.");
  m.def("ref_merge_topk_keys", &ref_merge_topk_keys, "gathered"_a, "seq_lens"_a, "query_len"_a,
        "out"_a, nb::kw_only(), "topk"_a, "init_blocks"_a, "local_blocks"_a, "max_seq_len"_a,
        "head_offset"_a, "attention_block_table"_a = nb::none(),
        "sparse_block_table_out"_a = nb::none(), "sparse_context_lens_out"_a = nb::none(),
        "block_page_stride"_a = nb::none(),
        "CPU reference merge: gathered keys [world, total_heads, n, topk] -> ids of heads "
        "[head_offset, head_offset + out.shape[0]).");
}

}  // namespace cpidx::py
