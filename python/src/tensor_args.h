// python/src/tensor_args.h: DLPack arrays (numpy on the host, torch on CUDA) to the library's
// Params structs. Every check names the Python argument and the expected value and raises
// TypeError (dtype) or ValueError (shape, stride, device, value) before any C++ entry point runs.
// O(1) per call: reads shapes and strides only, never the data.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>

#include "cpidx/params.h"
#include "cpidx/status.h"

namespace cpidx::py {

namespace nb = nanobind;

using InArray = nb::ndarray<nb::ro>;  // an input: any dtype, device and layout, checked here
using OutArray = nb::ndarray<>;       // an output the call writes into (destination passing)

// Where a call's tensors must live: host memory (reference) or one CUDA device (Decoder).
struct Place {
  bool cuda = false;
  int device = 0;
};

// A bad Status as a Python exception carrying its message: kInvalidArgument -> ValueError,
// kUnsupported -> NotImplementedError, anything else -> RuntimeError.
[[noreturn]] void raise_status(const Status& status);
inline void check_status(const Status& status) {
  if (!status.is_ok()) raise_status(status);
}

// Per-call argument parsing, shared by the reference and the Decoder bindings.
struct DecodeBatch {
  DecodeInputs in;  // query, cache, block table, seq_lens, Q, max_seq_len, scale
  int64_t rows = 0;
};

// The names a call's messages give its query and cache (the context-parallel entry points call
// them local_q and kv_cache).
struct DecodeArgNames {
  const char* query = "index_query";
  const char* cache = "index_cache";
};

// index_query bf16 [n, H, 128] (last dim contiguous); index_cache bf16 or fp8 e4m3fn (as uint16
// / uint8 bits too) [pages, 128, 128] contiguous; block_table int32 [>= num_reqs, >= G] (column
// stride 1); seq_lens int32 [num_reqs] contiguous; n == num_reqs * query_len.
DecodeBatch decode_batch(const InArray& index_query, const InArray& index_cache,
                         const InArray& block_table, const InArray& seq_lens, int query_len,
                         double scale, int64_t max_seq_len, const Place& place,
                         const DecodeArgNames& names = {});

// The query's and the cache's own checks (dtype, layout; the cache on the query's device), as
// decode and prefill make them: for a front end that sizes a GPU object from them before any
// call takes them (the registry's Decoder is made from the query's heads and the cache's dtype).
void check_query_and_cache(const InArray& index_query, const InArray& index_cache);

// seq_lens only (the merge needs the batch shape, not the inputs).
DecodeBatch merge_batch(const InArray& seq_lens, int query_len, int64_t max_seq_len,
                        const Place& place);

// out int32 [heads, rows, topk], last dim contiguous, other strides free.
TopkOutput topk_output(const OutArray& out, int64_t heads, int64_t rows, int topk,
                       const Place& place);

// Keys (int64 or uint64 holding the library's ordered keys), contiguous, shape `dims`.
Key* key_buffer(const nb::ndarray<>& keys, const char* name, std::initializer_list<int64_t> dims,
                const Place& place);

// The optional fused sparse table: all four given or none (returns an empty output then).
SparseTableOutput sparse_table_output(const std::optional<InArray>& attention_block_table,
                                      const std::optional<OutArray>& sparse_block_table_out,
                                      const std::optional<OutArray>& sparse_context_lens_out,
                                      std::optional<int> block_page_stride, int num_reqs,
                                      int64_t rows, int topk, int64_t max_seq_len,
                                      const Place& place);

// Prefill: index_query [tokens, H, 128], cu_seqlens_q int32 [num_reqs + 1], context_lens and
// seq_lens int32 [num_reqs]. num_tokens is read from index_query (== cu_seqlens_q[-1] is the
// caller's promise; the reference reads the offsets on the host).
PrefillInputs prefill_inputs(const InArray& index_query, const InArray& index_cache,
                             const InArray& block_table, const InArray& cu_seqlens_q,
                             const InArray& context_lens, const InArray& seq_lens, double scale,
                             int64_t max_seq_len, const Place& place);

// error_flag: one int32 element (any shape) where the call's tensors live, which the call ORs
// its DeviceError bits into; null when not given.
int32_t* error_flag_arg(const std::optional<OutArray>& error_flag, const Place& place);

Selection selection(int topk, int init_blocks, int local_blocks);

// A scalar argument against its range: ValueError "<name>: expected <lo> to <hi_name> <hi>, got
// <value>" unless lo <= value <= hi.
void check_range(const char* name, int64_t value, int64_t lo, const char* hi_name, int64_t hi);

}  // namespace cpidx::py
