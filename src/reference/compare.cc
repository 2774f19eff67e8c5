// src/reference/compare.cc: the contract's acceptance rule for ids from another path: exact, or
// swaps of blocks whose scores differ by at most 1e-3 of the K-th score's magnitude (fp32
// rounding at near ties), never of two forced blocks (constants on every path). Block
// scores are computed only once a row differs, so identical outputs cost one pass over the ids.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpidx/reference.h"
#include "reference/internal.h"

namespace cpidx {
namespace ref {

namespace detail {

bool ids_row_acceptable(const int32_t* got, const int32_t* want, int k, int64_t visible,
                        const Selection& sel, const std::function<float(int32_t)>& forced) {
  const int64_t count = std::min<int64_t>(k, visible);
  bool ok = true;
  std::vector<bool> seen(static_cast<size_t>(std::max<int64_t>(visible, 1)), false);
  for (int i = 0; i < k && ok; ++i) {
    if (i >= count) {
      ok = got[i] == -1 && want[i] == -1;
    } else if (got[i] < 0 || got[i] >= visible || want[i] < 0 || want[i] >= visible ||
               seen[static_cast<size_t>(got[i])]) {
      ok = false;
    } else {
      seen[static_cast<size_t>(got[i])] = true;
    }
  }
  if (ok && count > 0) {
    // CONTRACT.md section 4: within 1e-3 relative of want's K-th score, inclusive, with no
    // absolute floor (a K-th score near 0 leaves a tolerance near 0). An infinite K-th score
    // leaves none: infinities are exact, and inf - 5 <= inf would accept any block for one.
    const float kth = forced(want[count - 1]);
    const float tol = std::isfinite(kth) ? 1e-3f * std::fabs(kth) : 0.0f;
    auto is_forced = [&](int32_t b) {  // the contract's rule, as forced_score applies it
      return forced_score(0.0f, b, visible, sel.init_blocks, sel.local_blocks) != 0.0f;
    };
    for (int i = 0; i < count && ok; ++i) {
      if (got[i] == want[i]) continue;
      ok = !(is_forced(got[i]) && is_forced(want[i])) &&
           std::fabs(forced(got[i]) - forced(want[i])) <= tol;
    }
  }
  return ok;
}

void describe_bad_row(int head, int64_t row, const int32_t* got, const int32_t* want, int k,
                      IdsComparison* res) {
  if (res->bad_rows++ != 0) return;
  ::cpidx::detail::Message os;  // (not string operator+: GCC 12 warns falsely, -Wrestrict)
  os << "head " << head << ", row " << row << ": got";
  for (int i = 0; i < k; ++i) os << ' ' << got[i];
  os << " | want";
  for (int i = 0; i < k; ++i) os << ' ' << want[i];
  res->first_bad = os.str();
}

void describe_refused_row(int head, int64_t row, const Status& refusal, IdsComparison* res) {
  if (res->bad_rows++ != 0) return;
  ::cpidx::detail::Message os;
  os << "head " << head << ", row " << row
     << ": differs, and the reference refused the inputs: " << refusal.message();
  res->first_bad = os.str();
}

}  // namespace detail

IdsComparison compare_ids(const DecodeInputs& in, const Selection& sel, const TopkOutput& got,
                          const TopkOutput& want) {
  IdsComparison res;
  const int K = sel.topk, Q = in.query_len;
  const int64_t n = in.num_rows();
  const int64_t W = owned_blocks(in.max_blocks(), 1, 0);
  std::vector<float> scores;
  Status scored;  // block_scores' verdict on the inputs, once scored
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
        scored = block_scores(in, 1, 0, scores.data(), &err);
      }
      if (!scored.is_ok()) {  // no scores to judge a difference by: the row is bad
        detail::describe_refused_row(h, row, scored, &res);
        continue;
      }
      int32_t err = 0;
      const int64_t pos =
          clamp_seq_len(in.seq_lens[row / Q], in.max_seq_len, &err) - Q + row % Q;
      const int64_t V = std::min<int64_t>(visible_blocks(pos), W);
      auto forced = [&](int32_t b) {
        return forced_score(scores[static_cast<size_t>((h * n + row) * W + b)], b, V,
                            sel.init_blocks, sel.local_blocks);
      };
      const bool ok = detail::ids_row_acceptable(g, c, K, V, sel, forced);
      if (ok) {
        ++res.near_tie_rows;
      } else {
        detail::describe_bad_row(h, row, g, c, K, &res);
      }
    }
  }
  return res;
}

}  // namespace ref
}  // namespace cpidx
