// ref::compare_ids, the acceptance rule GPU tests, the demo and the benchmark use: identical ids
// are exact, a swap of two equal-score blocks is a near tie (but never of two forced blocks),
// and a weak or repeated block fails.
// The tolerance is 1e-3 relative to want's K-th score (inclusive, no absolute floor); ids and
// -1 pads follow the row's position (V = pos / 128 + 1 visible blocks, forced ones included).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "cpidx/reference.h"
#include "test_util.h"

namespace {

using namespace cpidx_test;

// compare_ids of one head, one row: got against want.
cpidx::ref::IdsComparison compare_row(const DecodeData& d, const cpidx::Selection& sel,
                                      std::vector<int32_t> got, std::vector<int32_t> want) {
  const int k = sel.topk;
  return cpidx::ref::compare_ids(d.all_heads(), sel, {got.data(), k, k}, {want.data(), k, k});
}

TEST(CompareIds, ExactNearTieAndBad) {
  // Small-integer values: many equal block maxima, every score exact.
  DecodeData d = random_decode(77, 2, 1, {4000, 3000, 0}, 4096, cpidx::DType::kBF16,
                               Values::kTies, 1.0f);
  cpidx::Selection sel;
  sel.topk = 8;
  IdsBuffer want(2, d.rows(), sel.topk);
  int32_t err = 0;
  ASSERT_TRUE(cpidx::ref::decode_topk(d.all_heads(), sel, want.out(), nullptr, &err).is_ok());
  IdsBuffer got = want;
  auto cmp = [&] { return cpidx::ref::compare_ids(d.all_heads(), sel, got.out(), want.out()); };
  EXPECT_EQ(cmp().exact_rows, 2 * d.rows());
  EXPECT_EQ(cmp().bad_rows, 0);

  // Swap two selected blocks of equal score (ties are everywhere with these values).
  std::vector<float> scores(static_cast<size_t>(2 * d.rows() * d.max_blocks()));
  cpidx::ref::block_scores(d.all_heads(), 1, 0, scores.data(), &err);
  int32_t* row = got.ids.data();  // head 0, row 0
  const float* s = scores.data();
  int swapped = 0;
  for (int i = 1; i + 1 < sel.topk && !swapped; ++i) {
    if (s[row[i]] == s[row[i + 1]]) { std::swap(row[i], row[i + 1]); swapped = 1; }
  }
  ASSERT_TRUE(swapped);
  EXPECT_EQ(cmp().near_tie_rows, 1);
  EXPECT_EQ(cmp().bad_rows, 0);

  // A repeated block is never acceptable.
  row[2] = row[1];
  EXPECT_EQ(cmp().bad_rows, 1);
  EXPECT_NE(cmp().first_bad.find("head 0, row 0"), std::string::npos);

  // Two selected blocks whose scores differ (small integers: by >= 1, far past the 1e-3
  // tolerance) swapped: bad. Position 0 holds the forced local block, so from 1 on.
  got = want;
  row = got.ids.data();
  int unequal = 0;
  for (int i = 1; i + 1 < sel.topk && !unequal; ++i) {
    if (s[row[i]] != s[row[i + 1]]) { std::swap(row[i], row[i + 1]); unequal = 1; }
  }
  ASSERT_TRUE(unequal);
  EXPECT_EQ(cmp().bad_rows, 1);
  EXPECT_EQ(cmp().near_tie_rows, 0);

  // The K-th block replaced by an unselected one: a near tie when its score equals the K-th
  // score, bad when lower.
  const int64_t V = (4000 - 1) / 128 + 1;  // head 0, row 0: request 0's visible blocks
  const int32_t kth = want.ids[static_cast<size_t>(sel.topk - 1)];
  auto selected = [&](int64_t b) {
    return std::find(want.ids.begin(), want.ids.begin() + sel.topk, b) !=
           want.ids.begin() + sel.topk;
  };
  int tied = 0, lower = 0;
  for (int64_t b = 0; b + 1 < V; ++b) {  // the last visible block is the forced local one
    if (selected(b) || (s[b] == s[kth] ? tied : lower) || s[b] > s[kth]) continue;
    got = want;
    got.ids[static_cast<size_t>(sel.topk - 1)] = static_cast<int32_t>(b);
    const cpidx::ref::IdsComparison r = cmp();
    if (s[b] == s[kth]) {
      EXPECT_EQ(r.near_tie_rows, 1) << "block " << b;
      EXPECT_EQ(r.bad_rows, 0) << "block " << b;
      tied = 1;
    } else {
      EXPECT_EQ(r.bad_rows, 1) << "block " << b;
      lower = 1;
    }
  }
  EXPECT_TRUE(lower) << "no unselected block below the K-th score";
}

// Inputs the reference refuses (scale 0) leave no scores to judge a difference by: a differing
// row is bad, naming the refusal, never a near tie (zero scores would tie everything).
TEST(CompareIds, RefusedInputsMakeADifferingRowBad) {
  DecodeData d = random_decode(78, 1, 1, {3000, 2000}, 4096);
  cpidx::Selection sel;
  sel.topk = 6;
  IdsBuffer want(1, d.rows(), sel.topk);
  int32_t err = 0;
  ASSERT_TRUE(cpidx::ref::decode_topk(d.all_heads(), sel, want.out(), nullptr, &err).is_ok());
  IdsBuffer got = want;
  std::swap(got.ids[2], got.ids[3]);  // row 0: two unforced blocks, both selected
  cpidx::DecodeInputs refused = d.all_heads();
  refused.scale = 0.0f;
  const cpidx::ref::IdsComparison r = cpidx::ref::compare_ids(refused, sel, got.out(), want.out());
  EXPECT_EQ(r.bad_rows, 1);
  EXPECT_EQ(r.near_tie_rows, 0);
  EXPECT_EQ(r.exact_rows, d.rows() - 1);
  EXPECT_NE(r.first_bad.find("head 0, row 0: differs, and the reference refused the inputs"),
            std::string::npos)
      << r.first_bad;
  EXPECT_NE(r.first_bad.find("scale"), std::string::npos) << r.first_bad;
  // The same swap with valid inputs is judged on the scores (random values: not a tie).
  EXPECT_EQ(cpidx::ref::compare_ids(d.all_heads(), sel, got.out(), want.out()).bad_rows, 1);
}

// Forced blocks score constants on every path (1e30 init, 1e29 local), so no rounding can order
// two of them otherwise: a swap of two init or two local blocks is bad, though their scores are
// equal. A swap of two unforced blocks with equal scores stays a near tie.
TEST(CompareIds, ForcedBlocksOutOfOrderAreBad) {
  // 8 visible blocks: init 0-1, local 6-7; of the free ones 3 and 4 score 50 (a tie), 2 and 5
  // score 40 and 30.
  ExactDots m(1, {1024}, 1024);
  const float dots[8] = {10, 10, 40, 50, 50, 30, 10, 10};
  for (int b = 0; b < 8; ++b) m.set_block(b, dots[b]);
  const cpidx::Selection sel{7, 2, 2};
  IdsBuffer want(1, 1, sel.topk);
  int32_t err = 0;
  ASSERT_TRUE(cpidx::ref::decode_topk(m.d.all_heads(), sel, want.out(), nullptr, &err).is_ok());
  const std::vector<int32_t> w(want.ids.begin(), want.ids.end());
  ASSERT_EQ(w, (std::vector<int32_t>{1, 0, 7, 6, 4, 3, 2}));
  auto swapped = [&](int i, int j) {
    std::vector<int32_t> got = w;
    std::swap(got[static_cast<size_t>(i)], got[static_cast<size_t>(j)]);
    return compare_row(m.d, sel, got, w);
  };
  EXPECT_EQ(swapped(0, 1).bad_rows, 1) << "init blocks 1 and 0";
  EXPECT_EQ(swapped(2, 3).bad_rows, 1) << "local blocks 7 and 6";
  EXPECT_EQ(swapped(1, 2).bad_rows, 1) << "an init and a local block";
  EXPECT_EQ(swapped(4, 5).near_tie_rows, 1) << "free blocks 4 and 3, equal scores";
  EXPECT_EQ(swapped(5, 6).bad_rows, 1) << "free blocks 3 and 2, 50 and 40";
}

// CONTRACT.md section 4: a swapped block must score within 1e-3 relative of want's K-th score.
// The bound is inclusive, taken from want (not got), and has no absolute floor below |K-th| 1.
TEST(CompareIds, ToleranceIsRelativeToTheKthScoreInclusive) {
  const cpidx::Selection sel{2, 0, 0};
  // Scale 1: K-th score ~1000. Scale 2^-19 (exact): K-th score ~0.0019, tolerance ~1.9e-6.
  for (const float scale : {1.0f, std::ldexp(1.0f, -19)}) {
    SCOPED_TRACE(scale);
    auto swapped = [&](float dot0, float dot1) {  // want {0, 1}, got {1, 0}
      ExactDots m(1, {512}, 512);
      m.d.scale = scale;
      m.set_block(0, dot0);
      m.set_block(1, dot1);
      return compare_row(m.d, sel, {1, 0}, {0, 1});
    };
    EXPECT_EQ(swapped(1001.0f, 1000.0f).near_tie_rows, 1);  // 1 apart, tolerance 1e-3 * 1000
    EXPECT_EQ(swapped(1000.0f, 999.0f).bad_rows, 1);  // tolerance from want's K-th: 0.999
    EXPECT_EQ(swapped(1005.0f, 1000.0f).bad_rows, 1);
    // Scale 2^-19: 0.0024 and 0.0019 lie 4.8e-4 apart, inside an absolute 1e-3 floor.
    EXPECT_EQ(swapped(1250.0f, 1000.0f).bad_rows, 1);
  }
}

// CONTRACT.md section 4 (a strict order of distinct blocks): the output ids are distinct; a
// repeated id is bad even when its score equals the score of the id it replaces.
TEST(CompareIds, RepeatedIdIsBadEvenWhenItsScoreTies) {
  ExactDots m(1, {512}, 512);
  m.set_block(0, 500.0f);
  m.set_block(1, 500.0f);
  EXPECT_EQ(compare_row(m.d, {2, 0, 0}, {1, 1}, {1, 0}).bad_rows, 1);
}

// CONTRACT.md sections 3-4: ids are blocks b < V of the row; an id at or past V is bad even
// where the comparator keeps a score slot for it (seq_len 200: V = 2 of max_blocks 4).
TEST(CompareIds, IdPastTheRowsVisibleBlocksIsBad) {
  ExactDots m(1, {200}, 512);
  EXPECT_EQ(compare_row(m.d, {2, 0, 1}, {2, 0}, {1, 0}).bad_rows, 1);
}

// CONTRACT.md section 4.3: after min(K, V) ids both outputs hold -1; a want that holds a block
// there is bad too (V = 2, K = 3).
TEST(CompareIds, PaddingPastTheVisibleBlocksIsMinusOneInBoth) {
  ExactDots m(1, {200}, 512);
  EXPECT_EQ(compare_row(m.d, {3, 0, 1}, {1, 0, -1}, {1, 0, 3}).bad_rows, 1);
}

// CONTRACT.md section 3: row t sits at pos = seq_len - Q + t, so seq_len 256 gives V = 2 and
// block 1 is the forced local block: swapping it with a block of the same raw score is bad.
TEST(CompareIds, ForcedBlocksFollowTheRowsPosition) {
  ExactDots m(1, {256}, 384);
  m.set_block(0, 500.0f);
  m.set_block(1, 500.0f);
  EXPECT_EQ(compare_row(m.d, {2, 0, 1}, {0, 1}, {1, 0}).bad_rows, 1);
}

// An infinite K-th score leaves no tolerance: a finite block in an infinite one's place is bad
// (the difference, inf, passed an infinite tolerance), and so are equal infinities swapped
// (CONTRACT.md section 4 orders equal scores; their difference is NaN).
TEST(CompareIds, InfiniteKthScoreLeavesNoTolerance) {
  ExactDots m(1, {512}, 512);
  m.set_block(0, std::numeric_limits<float>::infinity());
  m.set_block(1, std::numeric_limits<float>::infinity());
  m.set_block(2, 5.0f);
  const cpidx::Selection sel{2, 0, 0};
  IdsBuffer want(1, 1, 2);
  ASSERT_TRUE(cpidx::ref::decode_topk(m.d.all_heads(), sel, want.out(), nullptr, nullptr).is_ok());
  const int32_t first = want.ids[0], second = want.ids[1];
  ASSERT_EQ(std::min(first, second), 0);
  ASSERT_EQ(std::max(first, second), 1);
  EXPECT_EQ(compare_row(m.d, sel, {first, 2}, want.ids).bad_rows, 1);
  EXPECT_EQ(compare_row(m.d, sel, {second, first}, want.ids).bad_rows, 1);
  EXPECT_EQ(compare_row(m.d, sel, want.ids, want.ids).exact_rows, 1);
}

}  // namespace
