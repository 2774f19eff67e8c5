// The context-parallel decode of CONTRACT.md section 5 on one rank: gather the queries of all
// heads, score this rank's round-robin blocks for every head, gather the shards' top-K keys,
// merge the owned heads. Moves n*(L*D*2 + T*K*8) bytes per rank; reads 1/P of the cache.
#include <chrono>
#include <string>
#include <vector>

#include "cpidx/reference.h"
#include "reference/internal.h"

namespace cpidx {
namespace ref {
namespace {

using Clock = std::chrono::steady_clock;

double elapsed_ms(Clock::time_point since) {
  return std::chrono::duration<double, std::milli>(Clock::now() - since).count();
}

Status check_local(const Communicator& comm, const Geometry& geo, const DecodeInputs& local,
                   const Selection& sel, const TopkOutput& out, const SparseTableOutput* table,
                   const int32_t* err) {
  CPIDX_CHECK(comm.memory_space() == MemorySpace::kHost,
              "cp_decode (CPU reference) needs a host-memory communicator");
  CPIDX_CHECK(comm.world_size() == geo.world_size && comm.rank() == geo.rank,
              "communicator (rank " << comm.rank() << " of " << comm.world_size()
                                    << ") does not match geometry (rank " << geo.rank << " of "
                                    << geo.world_size << ")");
  Geometry expected;
  CPIDX_RETURN_IF_ERROR(make_geometry(geo.total_heads, geo.world_size, geo.rank, &expected));
  CPIDX_CHECK(expected.local_heads == geo.local_heads && expected.replicas == geo.replicas &&
                  expected.head_offset == geo.head_offset,
              "geometry fields are inconsistent; build it with make_geometry");
  CPIDX_CHECK(local.num_heads == geo.local_heads,
              "num_heads of the local query must equal local_heads = "
                  << geo.local_heads << ", got " << local.num_heads);
  CPIDX_RETURN_IF_ERROR(validate(local, sel));
  CPIDX_RETURN_IF_ERROR(detail::check_ids(out, geo.local_heads, local.num_rows(), sel.topk));
  if (table != nullptr) {
    CPIDX_RETURN_IF_ERROR(validate(*table, geo.local_heads));
    if (table->enabled()) {
      CPIDX_RETURN_IF_ERROR(detail::check_table_args(*table, local.num_reqs, local.query_len,
                                                     local.max_seq_len, sel.topk));
    }
  }
  // Here, before the agreement: a rank refused later (by shard_topk_keys) would leave its
  // peers in the key gather.
  detail::CallSpans spans = detail::decode_spans(local, out, geo.local_heads, sel.topk, table);
  spans.flag("err", err);
  return detail::check_no_aliasing(spans);
}

}  // namespace

Status detail::agree_on_settings(Communicator& comm, int total_heads, const DecodeInputs& local,
                                 const Selection& sel) {
  constexpr int kCount = 8;
  static const char* const kNames[kCount] = {"topk",        "init_blocks", "local_blocks",
                                             "query_len",   "max_seq_len", "total_heads",
                                             "scale (bits)", "cache dtype"};
  const long long mine[kCount] = {sel.topk,        sel.init_blocks,   sel.local_blocks,
                                  local.query_len, local.max_seq_len, total_heads,
                                  static_cast<long long>(float_bits(local.scale)),
                                  static_cast<long long>(local.cache.dtype)};
  return comm.check_agree_all(mine, kNames, kCount);
}

Status cp_decode(Communicator& comm, const Geometry& geo, const DecodeInputs& local,
                 const Selection& sel, const TopkOutput& out, const SparseTableOutput* table,
                 int32_t* err, CpStageTimes* times) {
  // The step's buffers, sized from this rank's n (all ranks' once they agree on it).
  std::vector<uint16_t> q_gathered, q_full;
  std::vector<Key> keys_gathered;
  const int world = geo.world_size;
  const int total = geo.total_heads;
  const int lh = geo.local_heads;
  const int k = sel.topk;
  const int64_t n = local.num_rows();
  const size_t q_elems = static_cast<size_t>(n) * lh * kHeadDim;     // [n][L][D] a rank
  const size_t q_full_elems = static_cast<size_t>(n) * total * kHeadDim;  // [n][T][D]
  const size_t key_elems = static_cast<size_t>(total) * n * k;        // [T][n][K] a rank
  // Every rank joins the agreement even when its own inputs are bad or its buffers cannot be
  // allocated (it sends -1), so a mistake on one rank is an error on all ranks, never a hang in
  // a later collective.
  Status local_status = check_local(comm, geo, local, sel, out, table, err);
  if (local_status.is_ok()) {
    try {
      q_gathered.resize(q_elems * world);
      q_full.resize(q_full_elems);
      keys_gathered.resize(key_elems * world);
    } catch (const std::exception& e) {  // std::bad_alloc, std::length_error
      const size_t bytes =
          (q_elems * world + q_full_elems) * sizeof(uint16_t) + key_elems * world * sizeof(Key);
      local_status = Status(StatusCode::kInternal,
                            "cp_decode: could not allocate the step's gather buffers (" +
                                std::to_string(bytes) + " bytes): " + e.what());
    }
  }
  const long long n_or_bad = local_status.is_ok() ? n : -1;
  const Status agree_rows =
      comm.check_agree(n_or_bad, "decode rows n = num_reqs * query_len (-1: inputs rejected)");
  CPIDX_RETURN_IF_ERROR(local_status);
  CPIDX_RETURN_IF_ERROR(agree_rows);
  CPIDX_RETURN_IF_ERROR(detail::agree_on_settings(comm, geo.total_heads, local, sel));

  // (1) All-gather the local queries [n, L, D] (packed), keep each replica group's lowest rank.
  auto start = Clock::now();
  uint16_t* q_mine = q_gathered.data() + q_elems * geo.rank;  // in place
  for (int64_t row = 0; row < n; ++row) {
    for (int j = 0; j < lh; ++j) {
      const uint16_t* src = local.query + row * local.q_row_stride + j * local.q_head_stride;
      std::copy(src, src + kHeadDim, q_mine + (row * lh + j) * kHeadDim);
    }
  }
  CPIDX_RETURN_IF_ERROR(
      comm.all_gather(q_mine, q_gathered.data(), q_elems * sizeof(uint16_t), nullptr));
  for (int group = 0; group < world / geo.replicas; ++group) {
    const uint16_t* src_rank = q_gathered.data() + q_elems * (group * geo.replicas);
    for (int64_t row = 0; row < n; ++row) {
      for (int j = 0; j < lh; ++j) {
        const uint16_t* src = src_rank + (row * lh + j) * kHeadDim;
        std::copy(src, src + kHeadDim, q_full.data() + (row * total + group * lh + j) * kHeadDim);
      }
    }
  }
  if (times) times->gather_queries_ms = elapsed_ms(start);

  // (2) Score this rank's blocks for all T heads and keep the shard's top-K keys.
  start = Clock::now();
  DecodeInputs full = local;
  full.query = q_full.data();
  full.q_row_stride = int64_t{total} * kHeadDim;
  full.q_head_stride = kHeadDim;
  full.num_heads = total;
  Key* keys_mine = keys_gathered.data() + key_elems * geo.rank;
  // Inputs check_local accepted are not refused here, but the scoring can still fail (an
  // allocation): the ranks agree on it before the key gather, so a rank that failed does not
  // leave its peers waiting there.
  Status scored;
  int32_t shard_err = 0;  // into *err once every rank scored: a failed step leaves it as it was
  try {
    scored = shard_topk_keys(full, sel, world, geo.rank, keys_mine, &shard_err);
  } catch (const std::exception& e) {
    scored = Status(StatusCode::kInternal, std::string("cp_decode: scoring failed: ") + e.what());
  }
  if (times) times->score_topk_ms = elapsed_ms(start);
  const Status agree_scored =
      comm.check_agree(scored.is_ok() ? 0 : -1, "shard scoring (-1: failed on that rank)");
  CPIDX_RETURN_IF_ERROR(scored);
  CPIDX_RETURN_IF_ERROR(agree_scored);
  if (err != nullptr) *err |= shard_err;

  // (3) All-gather the keys: [world][T][n][K].
  start = Clock::now();
  CPIDX_RETURN_IF_ERROR(
      comm.all_gather(keys_mine, keys_gathered.data(), key_elems * sizeof(Key), nullptr));
  if (times) times->gather_keys_ms = elapsed_ms(start);

  // (4) Merge the owned heads.
  start = Clock::now();
  const Status merged = merge_topk_keys(keys_gathered.data(), world, total, n, sel, geo.head_offset,
                                        lh, local.seq_lens, local.num_reqs, local.query_len,
                                        local.max_seq_len, out, table);
  if (times) times->merge_ms = elapsed_ms(start);
  return merged;
}

}  // namespace ref
}  // namespace cpidx
