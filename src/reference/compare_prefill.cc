// src/reference/compare_prefill.cc: compare_ids for prefill ids. Positions follow prefill_topk's
// clamps (cu_seqlens_q, context_lens, positions past max_seq_len); a row that differs from the
// wanted ids is scored on its own (pos + 1 keys x 128 MACs) and judged by the shared rule.
#include <algorithm>
#include <limits>
#include <vector>

#include "cpidx/reference.h"
#include "reference/internal.h"

namespace cpidx {
namespace ref {
namespace {

constexpr int64_t kMaxScoredBadRows = 16;

struct TokenPlace {
  int req = -1;      // -1: no request covers the token
  int64_t pos = -1;  // clamped position
};

std::vector<TokenPlace> token_places(const PrefillInputs& in) {
  std::vector<TokenPlace> places(static_cast<size_t>(in.num_tokens));
  int32_t err = 0;
  int64_t prev = 0;
  for (int req = 0; req < in.num_reqs; ++req) {
    const int64_t start = std::clamp<int64_t>(in.cu_seqlens_q[req], prev, in.num_tokens);
    const int64_t end = std::clamp<int64_t>(in.cu_seqlens_q[req + 1], start, in.num_tokens);
    const int64_t ctx = clamp_seq_len(in.context_lens[req], in.max_seq_len, &err);
    for (int64_t t = start; t < end; ++t) {
      places[static_cast<size_t>(t)] = {req, std::min<int64_t>(ctx + t - start, in.max_seq_len - 1)};
    }
    prev = start;
  }
  return places;
}

// Unforced block scores of one (head, token) row over its visible blocks.
std::vector<float> row_scores(const PrefillInputs& in, int head, int64_t token,
                              const TokenPlace& place) {
  const int64_t visible = visible_blocks(place.pos);
  std::vector<float> scores(static_cast<size_t>(visible), -std::numeric_limits<float>::infinity());
  float q[kHeadDim], key[kHeadDim];
  detail::load_query(in.query, in.q_row_stride, in.q_head_stride, token, head, q);
  int32_t err = 0;
  for (int64_t b = 0; b < visible; ++b) {
    const int64_t page = clamp_page(in.block_table[place.req * in.bt_row_stride + b],
                                    in.cache.num_pages, &err);
    float m = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < kBlockSize && b * kBlockSize + j <= place.pos; ++j) {
      detail::load_key(in.cache, page, j, key);
      const float d = detail::dot128(q, key);
      if (d > m) m = d;
    }
    scores[static_cast<size_t>(b)] = in.scale * m;
  }
  return scores;
}

}  // namespace

IdsComparison compare_ids(const PrefillInputs& in, const Selection& sel, const TopkOutput& got,
                          const TopkOutput& want) {
  IdsComparison res;
  const int K = sel.topk;
  // Inputs the reference refuses cannot be scored (nor their places read): every row that
  // differs is bad, and says why, as in the decode comparison.
  const Status valid = validate(in, sel);
  const std::vector<TokenPlace> places =
      valid.is_ok() ? token_places(in) : std::vector<TokenPlace>();
  for (int h = 0; h < in.num_heads; ++h) {
    for (int64_t token = 0; token < in.num_tokens; ++token) {
      const int32_t* g = got.ids + h * got.head_stride + token * got.row_stride;
      const int32_t* c = want.ids + h * want.head_stride + token * want.row_stride;
      if (std::equal(g, g + K, c)) {
        ++res.exact_rows;
        continue;
      }
      if (!valid.is_ok()) {
        detail::describe_refused_row(h, token, valid, &res);
        continue;
      }
      const TokenPlace& place = places[static_cast<size_t>(token)];
      bool ok = false;
      if (place.req >= 0 && res.bad_rows < kMaxScoredBadRows) {
        const std::vector<float> scores = row_scores(in, h, token, place);
        const int64_t visible = static_cast<int64_t>(scores.size());
        ok = detail::ids_row_acceptable(g, c, K, visible, sel, [&](int32_t b) {
          return forced_score(scores[static_cast<size_t>(b)], b, visible, sel.init_blocks,
                              sel.local_blocks);
        });
      }
      if (ok) {
        ++res.near_tie_rows;
      } else {
        detail::describe_bad_row(h, token, g, c, K, &res);
      }
    }
  }
  return res;
}

}  // namespace ref
}  // namespace cpidx
