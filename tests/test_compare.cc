// ref::compare_ids, the acceptance rule GPU tests, the demo and the benchmark use: identical ids
// are exact, a swap of two equal-score blocks is a near tie, and a weak or repeated block fails.
#include <gtest/gtest.h>

#include "cpidx/reference.h"
#include "test_util.h"

namespace {

using namespace cpidx_test;

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
}

}  // namespace
