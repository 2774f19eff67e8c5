// src/reference/compare.cc: the contract's acceptance rule for ids from another path: exact, or
// swaps among blocks within 1e-3 relative of the K-th score (fp32 rounding at near ties). Block
// scores are computed only once a row differs, so identical outputs cost one pass over the ids.
#include <algorithm>
#include <cmath>
#include <sstream>
#include <vector>

#include "cpidx/reference.h"

namespace cpidx {
namespace ref {

IdsComparison compare_ids(const DecodeInputs& in, const Selection& sel, const TopkOutput& got,
                          const TopkOutput& want) {
  IdsComparison res;
  const int K = sel.topk, Q = in.query_len;
  const int64_t n = in.num_rows();
  const int64_t W = owned_blocks(in.max_blocks(), 1, 0);
  std::vector<float> scores;
  for (int h = 0; h < in.num_heads; ++h) {
    for (int64_t row = 0; row < n; ++row) {
      const int32_t* g = got.ids + h * got.head_stride + row * got.row_stride;
      const int32_t* c = want.ids + h * want.head_stride + row * want.row_stride;
      if (std::equal(g, g + K, c)) {
        ++res.exact_rows;
        continue;
      }
      if (scores.empty()) {
        scores.resize(static_cast<size_t>(in.num_heads * n * W));
        int32_t err = 0;
        block_scores(in, 1, 0, scores.data(), &err);
      }
      int32_t err = 0;
      const int64_t pos =
          clamp_seq_len(in.seq_lens[row / Q], in.max_seq_len, &err) - Q + row % Q;
      const int64_t V = std::min<int64_t>(visible_blocks(pos), W);
      auto forced = [&](int32_t b) {
        return forced_score(scores[static_cast<size_t>((h * n + row) * W + b)], b, V,
                            sel.init_blocks, sel.local_blocks);
      };
      const int64_t count = std::min<int64_t>(K, V);
      bool ok = true;
      std::vector<bool> seen(static_cast<size_t>(std::max<int64_t>(V, 1)), false);
      for (int i = 0; i < K && ok; ++i) {
        if (i >= count) {
          ok = g[i] == -1 && c[i] == -1;
        } else if (g[i] < 0 || g[i] >= V || c[i] < 0 || c[i] >= V ||
                   seen[static_cast<size_t>(g[i])]) {
          ok = false;
        } else {
          seen[static_cast<size_t>(g[i])] = true;
        }
      }
      if (ok && count > 0) {
        const float kth = forced(c[count - 1]);
        const float tol = 1e-3f * std::max(1.0f, std::fabs(kth));
        for (int i = 0; i < count && ok; ++i) {
          if (g[i] != c[i]) ok = std::fabs(forced(g[i]) - forced(c[i])) <= tol;
        }
      }
      if (ok) {
        ++res.near_tie_rows;
      } else if (res.bad_rows++ == 0) {
        std::ostringstream os;  // (not string operator+: GCC 12 warns falsely, -Wrestrict)
        os << "head " << h << ", row " << row << ": got";
        for (int i = 0; i < K; ++i) os << ' ' << g[i];
        os << " | want";
        for (int i = 0; i < K; ++i) os << ' ' << c[i];
        res.first_bad = os.str();
      }
    }
  }
  return res;
}

}  // namespace ref
}  // namespace cpidx
