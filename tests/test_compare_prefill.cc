// ref::compare_ids for prefill ids: identical ids are exact rows, a bad -1 pad is a bad row named
// in first_bad, and a swapped pair is judged by its scores (never counted exact).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cpidx/reference.h"
#include "test_util.h"

namespace {

using namespace cpidx_test;

TEST(ComparePrefill, ExactWrongAndTiedRows) {
  // One request, 3 tokens at positions 300..302 over a cache of small integers: many equal
  // block maxima (ties), every dot exact.
  DecodeData cache = random_decode(31, 1, 1, {303}, 384, DType::kBF16, Values::kTies, 1.0f);
  std::vector<uint16_t> query(3 * kD);
  std::mt19937_64 rng(32);
  for (auto& q : query) q = bf16_of(static_cast<float>(static_cast<int>(rng() % 5) - 2));
  // Blocks 0 and 1 read the same page: equal scores for every token, a tie by construction.
  cache.block_table[1] = cache.block_table[0];
  const std::vector<int32_t> cu = {0, 3}, ctx = {300}, seq = {303};
  cpidx::PrefillInputs in;
  in.query = query.data();
  in.q_row_stride = kD;
  in.q_head_stride = kD;
  in.num_heads = 1;
  in.cache = {cache.cache_bf16.data(), DType::kBF16, cache.num_pages};
  in.block_table = cache.block_table.data();
  in.bt_row_stride = cache.bt_row_stride;
  in.cu_seqlens_q = cu.data();
  in.context_lens = ctx.data();
  in.seq_lens = seq.data();
  in.num_reqs = 1;
  in.num_tokens = 3;
  in.max_seq_len = 384;
  const cpidx::Selection sel{3, 0, 0};  // 3 of the 3 visible blocks: any order change is a swap
  IdsBuffer want(1, 3, 3);
  ASSERT_TRUE(cpidx::ref::prefill_topk(in, sel, want.out(), nullptr).is_ok());

  IdsBuffer got = want;
  cpidx::ref::IdsComparison r = cpidx::ref::compare_ids(in, sel, got.out(), want.out());
  EXPECT_EQ(r.exact_rows, 3);
  EXPECT_EQ(r.bad_rows, 0);

  got.ids[2] = -1;  // row 0 pads a visible block
  r = cpidx::ref::compare_ids(in, sel, got.out(), want.out());
  EXPECT_EQ(r.bad_rows, 1);
  EXPECT_NE(r.first_bad.find("row 0"), std::string::npos) << r.first_bad;

  // Swapping two positions is accepted exactly when their scores are equal (small integers:
  // unequal scores differ by >= 1, far past the 1e-3 tolerance). Token t sits at 300 + t; its
  // block b's score is the max of q . k over the block's tokens up to it.
  auto block_score = [&](int t, int32_t b) {
    float best = -INFINITY;
    for (int p = b * kBS; p < (b + 1) * kBS && p <= 300 + t; ++p) {
      const int64_t page = cache.block_table[static_cast<size_t>(p / kBS)];
      float dot = 0.0f;
      for (int j = 0; j < kD; ++j) {
        dot += cpidx::ref::bf16_to_float(query[static_cast<size_t>(t * kD + j)]) *
               cpidx::ref::cache_value(in.cache, page, p % kBS, j);
      }
      best = std::max(best, dot);
    }
    return best;
  };
  int unequal = 0, ties = 0;
  for (int t = 0; t < 3; ++t) {
    for (int i = 0; i < 3; ++i) {
      for (int j = i + 1; j < 3; ++j) {
        got = want;
        int32_t* ids = got.ids.data() + t * 3;
        const bool tie = block_score(t, ids[i]) == block_score(t, ids[j]);
        std::swap(ids[i], ids[j]);
        r = cpidx::ref::compare_ids(in, sel, got.out(), want.out());
        const std::string where =
            "token " + std::to_string(t) + ", positions " + std::to_string(i) + ", " +
            std::to_string(j);
        EXPECT_EQ(r.exact_rows, 2) << where;
        EXPECT_EQ(r.near_tie_rows, tie ? 1 : 0) << where;
        EXPECT_EQ(r.bad_rows, tie ? 0 : 1) << where;
        unequal += tie ? 0 : 1;
        ties += tie ? 1 : 0;
      }
    }
  }
  EXPECT_GT(unequal, 0) << "every swap was between equal scores: the rule was not exercised";
  EXPECT_GE(ties, 3) << "blocks 0 and 1 should tie for every token";
}

}  // namespace
