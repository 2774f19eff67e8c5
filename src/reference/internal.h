// Private helpers of the CPU reference: a small work-sharing loop, the fp32 dot product in
// the contract's order, and the per-request position arithmetic shared by every path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <utility>

#include "cpidx/comm.h"
#include "cpidx/contract.h"
#include "cpidx/params.h"
#include "cpidx/reference.h"
#include "cpidx/status.h"

namespace cpidx {
namespace ref {
namespace detail {

// Runs body(item, worker) for item in [0, count) on up to hardware_concurrency() threads,
// items handed out one at a time. `work` (a rough count of multiply-adds) keeps small jobs
// on the calling thread. worker < the returned thread count. Threads the system refuses are
// done without; an exception from body is rethrown here, after every thread has joined.
int parallel_for(int64_t count, double work, const std::function<void(int64_t, int)>& body);
int max_workers();

// sum_d q[d] * k[d] in fp32, in order d = 0..kHeadDim-1 (the contract's accumulation).
inline float dot128(const float* q, const float* k) {
  float acc = 0.0f;
  for (int d = 0; d < kHeadDim; ++d) acc += q[d] * k[d];
  return acc;
}

// Decodes one cached key (token `token` of page `page`) to fp32.
void load_key(const PagedCache& cache, int64_t page, int token, float* out);

// Loads query row `row`, head `h` of a strided bf16 tensor to fp32.
void load_query(const uint16_t* query, int64_t row_stride, int64_t head_stride, int64_t row,
                int head, float* out);

// Scores one decode request on this shard for all heads and rows: out[t][h][l] for local slot
// l < slots (global block g = l * world + rank), -inf where g >= the row's visible count.
// seq_len is already clamped. Page clamps OR into *err.
void score_request(const DecodeInputs& in, int world, int rank, int req, int32_t seq_len,
                   int64_t slots, float* out, int32_t* err);

inline bool aligned(const void* p, size_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

// Whether ids strides [heads, rows, topk] (last dim contiguous) nest without overlap, either
// [heads, n, K] or [n, heads, K] with gaps allowed; a dim of one entry takes any stride.
bool ids_strides_nest(int64_t heads, int64_t rows, int64_t topk, int64_t row_stride,
                      int64_t head_stride);

// ids [heads, rows, topk]: not null, int32-aligned, strides that nest without overlap (either
// [heads, n, K] or [n, heads, K], gaps allowed). Names the strides and the bound on failure.
Status check_ids(const TopkOutput& out, int heads, int64_t rows, int topk);

// The memory one argument spans, from its first byte to its last (strides as given): the unit
// of the aliasing check. A null pointer or no bytes spans nothing.
struct Span {
  const char* name = "";
  const void* data = nullptr;
  int64_t bytes = 0;
};

// Bytes from an array's first element to its last: `inner` contiguous elements of `elem`
// bytes, then outer dims of {count, stride} elements (a dim of count 1 adds nothing, as its
// stride is free; an empty dim empties the array). Saturates at INT64_MAX.
int64_t span_bytes(int elem, int64_t inner,
                   std::initializer_list<std::pair<int64_t, int64_t>> dims);

// The spans of one call's arguments, split into what it writes and what it only reads. Fixed
// capacity: building them allocates nothing.
struct CallSpans {
  static constexpr int kCapacity = 12;
  Span outputs[kCapacity];
  Span inputs[kCapacity];
  int num_outputs = 0;
  int num_inputs = 0;
  void output(Span s) {
    if (num_outputs < kCapacity) outputs[num_outputs++] = s;
  }
  void input(Span s) {
    if (num_inputs < kCapacity) inputs[num_inputs++] = s;
  }
  // Query, cache, block_table and seq_lens of a decode step (those set).
  void decode_inputs(const DecodeInputs& in);
  // Query, cache, block_table, cu_seqlens_q, context_lens and seq_lens of a prefill call.
  void prefill_inputs(const PrefillInputs& in);
  // ids [heads, rows, topk] with out's strides.
  void ids(const TopkOutput& out, int heads, int64_t rows, int topk);
  // A sparse-table call's attention block table (read) and its two outputs, when enabled.
  void table(const SparseTableOutput* table, int num_reqs, int query_len, int32_t max_seq_len,
             int topk);
  // One int32 error word the call ORs into (null: none).
  void flag(const char* name, const int32_t* word) { output({name, word, sizeof(int32_t)}); }
  // `lists` lists of `topk` keys.
  static Span keys(const char* name, const Key* keys, int64_t lists, int topk) {
    return {name, keys, static_cast<int64_t>(sizeof(Key)) * lists * topk};
  }
};

// A call's outputs must share no memory with one another or with any of its inputs: the
// kernels and the reference read inputs (the sparse table reads the ids back) after outputs
// are written, so aliasing would give silently wrong ids, or a race on the GPU. Judged by each
// argument's span, first element to last, so outputs laid in the gaps of a strided input are
// refused too. Names both arguments. Run after each argument's own checks.
Status check_no_aliasing(const CallSpans& spans);

// The spans of a decode step: decode_inputs(in), ids over `heads` heads and the sparse table.
CallSpans decode_spans(const DecodeInputs& in, const TopkOutput& out, int heads, int topk,
                       const SparseTableOutput* table);

// The spans of a merge of `world` ranks' key lists over `total_heads` heads and n rows: it
// reads only those keys, and seq_lens when it writes the sparse table; raises no error bit.
CallSpans merge_spans(const Key* gathered, int world, int total_heads, int64_t n, int topk,
                      const int32_t* seq_lens, int num_reqs, int query_len, int32_t max_seq_len,
                      const TopkOutput& out, int heads, const SparseTableOutput* table);

// topk in [1, kMaxTopK] (kUnsupported above), init/local blocks >= 0.
Status check_selection(const Selection& sel);

// Host checks of a sparse-table call that need the batch shape (row strides, widths); run
// before any output is written. Includes validate(table, 1) and requires it enabled.
Status check_table_args(const SparseTableOutput& table, int num_reqs, int query_len,
                        int32_t max_seq_len, int topk);

// compare_ids' acceptance rule for one row (CONTRACT.md section 4): ids exact, or distinct and
// visible with -1 after min(K, V), every differing position's two forced scores within 1e-3 of
// the K-th forced score's magnitude, and no two forced blocks (sel's init and local ones) in
// each other's place: their scores are constants on every path, so rounding cannot order them
// otherwise. forced(b) gives block b's forced score. describe_bad_row counts a failing row and
// records the first one in res->first_bad.
bool ids_row_acceptable(const int32_t* got, const int32_t* want, int k, int64_t visible,
                        const Selection& sel, const std::function<float(int32_t)>& forced);
void describe_bad_row(int head, int64_t row, const int32_t* got, const int32_t* want, int k,
                      IdsComparison* res);
// The same for a row that differs where the reference refused the inputs (`refusal`).
void describe_refused_row(int head, int64_t row, const Status& refusal, IdsComparison* res);

// What every rank of a context-parallel step must share besides its rows, or the merge mixes
// lists scored differently (no crash, silently wrong ids): topk, init and local blocks,
// query_len, max_seq_len, total_heads, the scale's bits and the cache's dtype. One
// check_agree_all; a mismatch is a kCommError on every rank naming the first setting that
// differs and its value on each rank. The CPU reference and the GPU Decoder both ask it.
Status agree_on_settings(Communicator& comm, int total_heads, const DecodeInputs& local,
                         const Selection& sel);

}  // namespace detail
}  // namespace ref
}  // namespace cpidx
