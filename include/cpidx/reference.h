// cpidx/reference.h: the plain-loop CPU reference of every path of CONTRACT.md. It is the
// oracle for every GPU kernel and takes the same Params structs. Exactness over speed; the
// heavy loops (block scoring) run on a few threads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cpidx/comm.h"
#include "cpidx/contract.h"
#include "cpidx/params.h"
#include "cpidx/status.h"

namespace cpidx {
namespace ref {

// bf16 / fp8-e4m3 bit patterns to float (exact).
float bf16_to_float(uint16_t bits);
uint16_t float_to_bf16(float f);  // round to nearest even; NaN stays NaN
float fp8e4m3_to_float(uint8_t bits);
float cache_value(const PagedCache& cache, int64_t page, int token, int dim);

// Host-visible validation shared by every decode entry point (CONTRACT.md section 8):
// names the argument and the expected value. `max_tokens` < 0 skips the batch bound.
Status validate(const DecodeInputs& in, const Selection& sel, int64_t max_tokens = -1);
Status validate(const PrefillInputs& in, const Selection& sel);
Status validate(const SparseTableOutput& table, int local_heads);
// A decode step's outputs (ids over `heads` heads, the sparse table if enabled) sharing memory
// with one another or with `in`'s arrays, each taken from its first element to its last: an
// error naming both. Every entry point runs it; exposed for callers that check a step ahead.
Status check_no_aliasing(const DecodeInputs& in, const TopkOutput& out, int heads, int topk,
                         const SparseTableOutput* table);

// Shard block scores S[h][row][l] for local slots l < W = owned_blocks(G, world, rank), global
// block g = l * world + rank. Blocks at or past the row's visible count hold -inf.
// scores: [num_heads][n][W]. err: OR of DeviceError bits for clamped values.
Status block_scores(const DecodeInputs& in, int world, int rank, float* scores, int32_t* err);

// Selection of one (head, row) from its block scores (CONTRACT.md section 4), over the blocks
// `blocks[i]` with scores `scores[i]`, i < count, out of `visible` blocks in the row.
// Writes the top-K keys in order, padded with kPadKey.
void select_keys(const float* scores, const int64_t* blocks, int64_t count, int64_t visible,
                 const Selection& sel, Key* keys_out);

// The shard's top-K keys per (head, row): keys [num_heads][n][K]. world == 1 gives the full
// selection.
Status shard_topk_keys(const DecodeInputs& in, const Selection& sel, int world, int rank,
                       Key* keys, int32_t* err);

// Merge the world's candidate lists for heads [head_offset, head_offset + local_heads):
// gathered [world][total_heads][n][K] keys -> ids [local_heads][n][K] in `out` (strided).
// If `table` is enabled (local_heads == 1), also writes the sparse table rows.
Status merge_topk_keys(const Key* gathered, int world, int total_heads, int64_t n,
                       const Selection& sel, int head_offset, int local_heads,
                       const int32_t* seq_lens, int num_reqs, int query_len,
                       int32_t max_seq_len, const TopkOutput& out,
                       const SparseTableOutput* table);

// The plain (non-context-parallel) decode: ids [num_heads][n][K] for every head in `in`.
Status decode_topk(const DecodeInputs& in, const Selection& sel, const TopkOutput& out,
                   const SparseTableOutput* table, int32_t* err);

// Fused page-16 sparse-table rows from one head's ids ([n][K], row stride ids_row_stride),
// CONTRACT.md section 6 / REFERENCE_NOTES.md section 9.1.
Status sparse_table(const int32_t* ids, int64_t ids_row_stride, const int32_t* seq_lens,
                    int num_reqs, int query_len, int32_t max_seq_len, int topk,
                    const SparseTableOutput& table);

// Prefill selection (CONTRACT.md section 7) for every head in `in`: ids [num_heads][tokens][K].
Status prefill_topk(const PrefillInputs& in, const Selection& sel, const TopkOutput& out,
                    int32_t* err);

// Bytes of index cache a rank reads for one decode step (the shard's visible blocks).
int64_t shard_cache_bytes(const DecodeInputs& in, int world, int rank);

// The context-parallel decode of CONTRACT.md section 5, run by one rank over `comm` (host
// memory). `local` carries this rank's [n, L, D] queries (num_heads == L); the other fields
// describe the shared cache and batch. Writes ids [L][n][K] for the owned heads.
struct CpStageTimes {
  double gather_queries_ms = 0, score_topk_ms = 0, gather_keys_ms = 0, merge_ms = 0;
};
Status cp_decode(Communicator& comm, const Geometry& geo, const DecodeInputs& local,
                 const Selection& sel, const TopkOutput& out, const SparseTableOutput* table,
                 int32_t* err, CpStageTimes* times = nullptr);

// The acceptance rule of CONTRACT.md section 4 for ids computed elsewhere (GPU, another path)
// against ids `want` of the same inputs: a row passes exactly, or as a near tie when its ids
// are distinct, visible, -1 after min(K, V), and every position that differs holds blocks whose
// forced scores differ by at most 1e-3 of the K-th score's magnitude, not both forced (init and
// local blocks score constants on every path). Compares every head of `in`; inputs the
// reference refuses make every differing row bad, naming the refusal.
struct IdsComparison {
  int64_t exact_rows = 0, near_tie_rows = 0, bad_rows = 0;
  std::string first_bad;  // "head h, row r: got ... | want ..." for the first bad row
};
IdsComparison compare_ids(const DecodeInputs& in, const Selection& sel, const TopkOutput& got,
                          const TopkOutput& want);
// The same rule for prefill ids ([num_heads][num_tokens][K]), positions clamped as
// prefill_topk clamps them. Differing rows are re-scored one at a time; after 16 bad rows the
// rest are counted without scoring (a systematic error would otherwise cost a full reference).
IdsComparison compare_ids(const PrefillInputs& in, const Selection& sel, const TopkOutput& got,
                          const TopkOutput& want);

}  // namespace ref
}  // namespace cpidx
