// Prefill selection (CONTRACT.md section 7): query i of request req at pos = context_lens[req]
// + i, scored over blocks < V(pos) for the rank's own heads, full context. Cost: sum over
// queries of (pos + 1) x heads x 128 multiply-adds; each key is decoded once per query chunk.
#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

#include "cpidx/reference.h"
#include "reference/internal.h"

namespace cpidx {
namespace ref {
namespace {

constexpr int64_t kQueryChunk = 32;  // queries of one request scored together

struct Chunk {
  int req;
  int64_t first;  // first query of the chunk, within the request
  int64_t count;
};

}  // namespace

Status prefill_topk(const PrefillInputs& in, const Selection& sel, const TopkOutput& out,
                    int32_t* err) {
  CPIDX_RETURN_IF_ERROR(validate(in, sel));
  CPIDX_RETURN_IF_ERROR(detail::check_ids(out, in.num_heads, in.num_tokens, sel.topk));
  detail::CallSpans spans;
  spans.prefill_inputs(in);
  spans.ids(out, in.num_heads, in.num_tokens, sel.topk);
  spans.flag("err", err);
  CPIDX_RETURN_IF_ERROR(detail::check_no_aliasing(spans));
  const int heads = in.num_heads;
  const int k = sel.topk;
  // Rows no request covers (cu_seqlens_q short of num_tokens) still get a defined -1 row.
  for (int h = 0; h < heads; ++h) {
    for (int64_t row = 0; row < in.num_tokens; ++row) {
      std::fill_n(out.ids + h * out.head_stride + row * out.row_stride, k, -1);
    }
  }

  // cu_seqlens_q is clamped into a non-decreasing sequence inside [0, num_tokens]; a value the
  // clamp moves is a bad device value like a seq_len out of range, and flagged the same way.
  int32_t flags_host = 0;
  std::vector<Chunk> chunks;
  std::vector<int64_t> starts(static_cast<size_t>(in.num_reqs) + 1, 0);
  std::vector<int32_t> contexts(static_cast<size_t>(in.num_reqs), 0);
  for (int req = 0; req <= in.num_reqs; ++req) {
    const int64_t prev = req == 0 ? 0 : starts[static_cast<size_t>(req) - 1];
    starts[static_cast<size_t>(req)] =
        std::clamp<int64_t>(in.cu_seqlens_q[req], prev, in.num_tokens);
    if (starts[static_cast<size_t>(req)] != in.cu_seqlens_q[req]) {
      flags_host |= kErrSeqLenOutOfRange;
    }
  }
  for (int req = 0; req < in.num_reqs; ++req) {
    contexts[static_cast<size_t>(req)] =
        clamp_seq_len(in.context_lens[req], in.max_seq_len, &flags_host);
    clamp_seq_len(in.seq_lens[req], in.max_seq_len, &flags_host);  // reported, not used
    const int64_t len = starts[static_cast<size_t>(req) + 1] - starts[static_cast<size_t>(req)];
    for (int64_t first = 0; first < len; first += kQueryChunk) {
      chunks.push_back({req, first, std::min(kQueryChunk, len - first)});
    }
  }

  std::atomic<int32_t> flags{flags_host};
  const double work = static_cast<double>(in.num_tokens) * heads * in.max_seq_len * kHeadDim;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  detail::parallel_for(static_cast<int64_t>(chunks.size()), work, [&](int64_t c, int) {
    const Chunk& chunk = chunks[static_cast<size_t>(c)];
    int32_t local_err = 0;
    const int64_t base_row = starts[static_cast<size_t>(chunk.req)] + chunk.first;
    std::vector<int64_t> pos(static_cast<size_t>(chunk.count));
    for (int64_t i = 0; i < chunk.count; ++i) {
      int64_t p = int64_t{contexts[static_cast<size_t>(chunk.req)]} + chunk.first + i;
      if (p >= in.max_seq_len) {  // a query past the construction bound reads the last block
        local_err |= kErrSeqLenOutOfRange;
        p = in.max_seq_len - 1;
      }
      pos[static_cast<size_t>(i)] = p;
    }
    const int64_t last_pos = *std::max_element(pos.begin(), pos.end());
    const int64_t blocks = visible_blocks(last_pos);
    std::vector<float> q(static_cast<size_t>(chunk.count) * heads * kHeadDim);
    for (int64_t i = 0; i < chunk.count; ++i) {
      for (int h = 0; h < heads; ++h) {
        detail::load_query(in.query, in.q_row_stride, in.q_head_stride, base_row + i, h,
                           &q[(static_cast<size_t>(i) * heads + h) * kHeadDim]);
      }
    }
    // raw[i][h][b]: max dot over the visible tokens of block b, -inf where none is visible.
    std::vector<float> raw(static_cast<size_t>(chunk.count) * heads * blocks, neg_inf);
    float key[kHeadDim];
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t page = clamp_page(in.block_table[chunk.req * in.bt_row_stride + b],
                                      in.cache.num_pages, &local_err);
      for (int j = 0; j < kBlockSize; ++j) {
        const int64_t p = b * kBlockSize + j;
        if (p > last_pos) break;
        detail::load_key(in.cache, page, j, key);
        for (int64_t i = 0; i < chunk.count; ++i) {
          if (p > pos[static_cast<size_t>(i)]) continue;
          for (int h = 0; h < heads; ++h) {
            const size_t ih = static_cast<size_t>(i) * heads + h;
            const float d = detail::dot128(&q[ih * kHeadDim], key);
            float& m = raw[ih * blocks + b];
            if (d > m) m = d;
          }
        }
      }
    }
    std::vector<int64_t> ids(static_cast<size_t>(blocks));
    for (int64_t b = 0; b < blocks; ++b) ids[static_cast<size_t>(b)] = b;
    std::vector<float> scores(static_cast<size_t>(blocks));
    std::vector<Key> keys(static_cast<size_t>(k));
    for (int64_t i = 0; i < chunk.count; ++i) {
      const int64_t visible = visible_blocks(pos[static_cast<size_t>(i)]);
      for (int h = 0; h < heads; ++h) {
        const float* m = &raw[(static_cast<size_t>(i) * heads + h) * blocks];
        for (int64_t b = 0; b < visible; ++b) scores[static_cast<size_t>(b)] = in.scale * m[b];
        select_keys(scores.data(), ids.data(), visible, visible, sel, keys.data());
        int32_t* dst = out.ids + h * out.head_stride + (base_row + i) * out.row_stride;
        for (int s = 0; s < k; ++s) dst[s] = key_is_pad(keys[s]) ? -1 : key_block(keys[s]);
      }
    }
    flags.fetch_or(local_err);
  });
  if (err != nullptr) *err |= flags.load();
  return Status::ok();
}

}  // namespace ref
}  // namespace cpidx
