// Block scores of CONTRACT.md section 3 on one shard: S[h,row,b] = scale * max over visible
// tokens of the fp32 dot. Cost: (visible tokens owned) x (rows of the request) x heads x 128
// multiply-adds; each cached key is decoded once and reused by every row and head.
#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

#include "cpidx/reference.h"
#include "reference/internal.h"

namespace cpidx {
namespace ref {
namespace detail {

void score_request(const DecodeInputs& in, int world, int rank, int req, int32_t seq_len,
                   int64_t slots, float* out, int32_t* err) {
  const int num_q = in.query_len;
  const int heads = in.num_heads;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::fill(out, out + static_cast<int64_t>(num_q) * heads * slots, neg_inf);

  std::vector<int64_t> pos(static_cast<size_t>(num_q));
  for (int t = 0; t < num_q; ++t) pos[static_cast<size_t>(t)] = int64_t{seq_len} - num_q + t;
  const int64_t last_pos = pos.back();  // the request's furthest row sees the most
  const int64_t owned = std::min(slots, owned_blocks(visible_blocks(last_pos), world, rank));
  if (owned <= 0) return;

  std::vector<float> q(static_cast<size_t>(num_q) * heads * kHeadDim);
  for (int t = 0; t < num_q; ++t) {
    for (int h = 0; h < heads; ++h) {
      load_query(in.query, in.q_row_stride, in.q_head_stride, int64_t{req} * num_q + t, h,
                 &q[(static_cast<size_t>(t) * heads + h) * kHeadDim]);
    }
  }
  std::vector<float> raw_max(static_cast<size_t>(num_q) * heads);
  float key[kHeadDim];
  for (int64_t l = 0; l < owned; ++l) {
    const int64_t g = l * world + rank;
    const int64_t page =
        clamp_page(in.block_table[int64_t{req} * in.bt_row_stride + g], in.cache.num_pages, err);
    std::fill(raw_max.begin(), raw_max.end(), neg_inf);
    for (int j = 0; j < kBlockSize; ++j) {
      const int64_t p = g * kBlockSize + j;
      if (p > last_pos) break;
      load_key(in.cache, page, j, key);
      for (int t = 0; t < num_q; ++t) {
        if (p > pos[static_cast<size_t>(t)]) continue;  // token past this row's position
        for (int h = 0; h < heads; ++h) {
          const size_t th = static_cast<size_t>(t) * heads + h;
          const float d = dot128(&q[th * kHeadDim], key);
          if (d > raw_max[th]) raw_max[th] = d;  // NaN dots never win (fmaxf semantics)
        }
      }
    }
    // One multiply per block: fp32 scaling by a positive scale is monotone, so
    // scale * max(dot) == max(scale * dot) exactly.
    for (int t = 0; t < num_q; ++t) {
      if (g >= visible_blocks(pos[static_cast<size_t>(t)])) continue;
      for (int h = 0; h < heads; ++h) {
        const size_t th = static_cast<size_t>(t) * heads + h;
        out[th * slots + l] = in.scale * raw_max[th];
      }
    }
  }
}

}  // namespace detail

Status block_scores(const DecodeInputs& in, int world, int rank, float* scores, int32_t* err) {
  CPIDX_RETURN_IF_ERROR(validate(in, Selection{}));
  CPIDX_CHECK(world >= 1, "world must be >= 1, got " << world);
  CPIDX_CHECK(rank >= 0 && rank < world, "rank must be in [0, " << world << "), got " << rank);
  const int64_t slots = owned_blocks(in.max_blocks(), world, rank);
  CPIDX_CHECK(scores != nullptr || slots == 0, "scores is null");
  CPIDX_CHECK(detail::aligned(scores, alignof(float)),
              "scores must be 4-byte aligned, got address " << scores);
  const int64_t n = in.num_rows();
  detail::CallSpans spans;
  spans.decode_inputs(in);
  spans.output({"scores", scores, static_cast<int64_t>(sizeof(float)) * in.num_heads * n * slots});
  spans.flag("err", err);
  CPIDX_RETURN_IF_ERROR(detail::check_no_aliasing(spans));
  const int num_q = in.query_len;
  std::atomic<int32_t> flags{0};
  const double work = static_cast<double>(n) * in.num_heads * in.max_seq_len * kHeadDim / world;
  detail::parallel_for(in.num_reqs, work, [&](int64_t req, int) {
    int32_t local_err = 0;
    const int32_t seq_len = clamp_seq_len(in.seq_lens[req], in.max_seq_len, &local_err);
    std::vector<float> buf(static_cast<size_t>(num_q) * in.num_heads * slots);
    detail::score_request(in, world, rank, static_cast<int>(req), seq_len, slots, buf.data(),
                          &local_err);
    for (int t = 0; t < num_q; ++t) {
      const int64_t row = req * num_q + t;
      for (int h = 0; h < in.num_heads; ++h) {
        const float* src = buf.data() + (static_cast<size_t>(t) * in.num_heads + h) * slots;
        std::copy(src, src + slots, scores + (h * n + row) * slots);
      }
    }
    flags.fetch_or(local_err);
  });
  if (err != nullptr) *err |= flags.load();
  return Status::ok();
}

int64_t shard_cache_bytes(const DecodeInputs& in, int world, int rank) {
  if (in.seq_lens == nullptr || world < 1 || rank < 0 || rank >= world) return 0;
  int64_t tokens = 0;
  for (int req = 0; req < in.num_reqs; ++req) {
    int32_t ignored = 0;
    const int64_t seq_len = clamp_seq_len(in.seq_lens[req], in.max_seq_len, &ignored);
    const int64_t blocks = cdiv(seq_len, kBlockSize);
    for (int64_t g = rank; g < blocks; g += world) {
      tokens += std::min<int64_t>(kBlockSize, seq_len - g * kBlockSize);
    }
  }
  return tokens * kHeadDim * dtype_bytes(in.cache.dtype);
}

}  // namespace ref
}  // namespace cpidx
