// tests/gpu/test_work_split.cc: the fused decode path's work split (src/cuda/kernels.h), checked
// on the host (no GPU needed, so it runs in CI): the CTAs' page ranges partition the step, and
// the list slots that select_topk merges for a request spanning CTAs are exactly the ones those
// CTAs wrote in this launch, distinct across requests and inside the workspace.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <vector>

#include "cuda/kernels.h"

namespace {

using cpidx::cuda::cta_of;
using cpidx::cuda::fused_ctas;
using cpidx::cuda::kMinPagesPerCta;

TEST(FusedWorkSplit, RangesPartitionThePagesAndMergeSlotsWereAllWritten) {
  std::mt19937_64 rng(20261129);
  int checked = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const int grid = 1 + static_cast<int>(rng() % 300);
    const int B = 1 + static_cast<int>(rng() % 80);
    std::vector<int64_t> prefix(static_cast<size_t>(B) + 1, 0);
    for (int r = 0; r < B; ++r) {
      const int kind = static_cast<int>(rng() % 4);  // empty, tiny, or up to 5000 pages
      const int64_t pages = kind == 0 ? 0 : kind == 1 ? 1 + static_cast<int64_t>(rng() % 3)
                                                      : static_cast<int64_t>(rng() % 5000);
      prefix[r + 1] = prefix[r] + pages;
    }
    const int64_t total = prefix[B];
    if (total == 0) continue;
    const int64_t g = fused_ctas(total, grid);
    ASSERT_GE(g, 1);
    ASSERT_LE(g, grid);
    if (total >= kMinPagesPerCta * static_cast<int64_t>(grid)) ASSERT_EQ(g, grid);

    // CTA c scores [c * total / g, (c + 1) * total / g): contiguous, non-empty, covering.
    std::vector<int64_t> begin(static_cast<size_t>(g) + 1);
    for (int64_t c = 0; c <= g; ++c) begin[c] = c * total / g;
    ASSERT_EQ(begin[0], 0);
    ASSERT_EQ(begin[g], total);
    for (int64_t c = 0; c < g; ++c) ASSERT_LT(begin[c], begin[c + 1]) << "empty CTA range";
    // cta_of(x) names the range that holds page x.
    for (int k = 0; k < 50; ++k) {
      const int64_t x = static_cast<int64_t>(rng() % total);
      const int64_t c = cta_of(x, total, g);
      ASSERT_TRUE(c >= 0 && c < g && begin[c] <= x && x < begin[c + 1]) << "x " << x;
    }

    // Slots written: CTA c, for each request r it scores part of, when r spans CTAs.
    std::set<int64_t> written;
    for (int r = 0; r < B; ++r) {
      if (prefix[r + 1] == prefix[r]) continue;
      const int64_t c0 = cta_of(prefix[r], total, g), c1 = cta_of(prefix[r + 1] - 1, total, g);
      if (c0 == c1) continue;  // finished inside one CTA, nothing to merge
      for (int64_t c = 0; c < g; ++c) {
        const bool scores_part = std::max(begin[c], prefix[r]) < std::min(begin[c + 1], prefix[r + 1]);
        if (!scores_part) continue;
        ASSERT_TRUE(written.insert(c + r).second) << "slot " << c + r << " written twice";
        ASSERT_LT(c + r, static_cast<int64_t>(grid) + B) << "slot past the workspace";
      }
      // select_topk reads slots c0 + r .. c1 + r: each was written by this launch.
      for (int64_t c = c0; c <= c1; ++c) ASSERT_TRUE(written.count(c + r)) << "stale slot " << c + r;
      ++checked;
    }
  }
  EXPECT_GT(checked, 1000);  // the random batches did split many requests
}

}  // namespace
