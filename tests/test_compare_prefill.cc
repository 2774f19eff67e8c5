// ref::compare_ids for prefill ids: identical ids are exact rows, a bad -1 pad is a bad row named
// in first_bad, and a swapped pair is judged by its scores (never counted exact): the scaled
// fp32 scores prefill_topk ranks, at each token's position as prefill_topk clamps it (cu_seqlens_q
// out of order, positions past max_seq_len), with the forced local block and own token there.
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

// prefill_topk's ids of a one-token batch.
std::vector<int32_t> want_of(const cpidx::PrefillInputs& in, const cpidx::Selection& sel) {
  const int k = sel.topk;
  std::vector<int32_t> want(static_cast<size_t>(k));
  EXPECT_TRUE(cpidx::ref::prefill_topk(in, sel, {want.data(), k, k}, nullptr).is_ok());
  return want;
}

// compare_ids of a one-token batch: got against want.
cpidx::ref::IdsComparison compare_row(const cpidx::PrefillInputs& in, const cpidx::Selection& sel,
                                      std::vector<int32_t> got, std::vector<int32_t> want) {
  const int k = sel.topk;
  return cpidx::ref::compare_ids(in, sel, {got.data(), k, k}, {want.data(), k, k});
}

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

// CONTRACT.md sections 3, 4.1 and 7: token i sits at context_len + i; its last visible block is
// the forced local one, and its own token counts in that block's score.
TEST(ComparePrefill, ForcedLocalBlockAndOwnTokenFollowThePosition) {
  const std::vector<int32_t> cu = {0, 1}, ctx = {300}, seq = {301};
  {  // pos 300: V = 3, block 2 forced; blocks 0 and 1 tie, so swapping them is a near tie.
    ExactDots m(1, {384}, 384);
    m.set_block(0, 500.0f);
    m.set_block(1, 500.0f);
    const cpidx::PrefillInputs in = m.prefill(cu, ctx, seq, 1);
    ASSERT_EQ(want_of(in, {3, 0, 1}), (std::vector<int32_t>{2, 1, 0}));
    EXPECT_EQ(compare_row(in, {3, 0, 1}, {2, 0, 1}, {2, 1, 0}).near_tie_rows, 1);
  }
  {
    // Block 2's max is the token's own key (600; the keys before it tie block 1 at 500):
    // swapping it below block 1 is bad.
    ExactDots m(1, {384}, 384);
    m.set_block(1, 500.0f);
    for (int t = 256; t < 300; ++t) m.set_dot(t, 500.0f);
    m.set_dot(300, 600.0f);
    const cpidx::PrefillInputs in = m.prefill(cu, ctx, seq, 1);
    ASSERT_EQ(want_of(in, {2, 0, 0}), (std::vector<int32_t>{2, 1}));
    EXPECT_EQ(compare_row(in, {2, 0, 0}, {1, 2}, {2, 1}).bad_rows, 1);
  }
}

// docs/reliability.md section 2 (CONTRACT.md section 8's clamps): a position past max_seq_len is
// clamped to max_seq_len - 1, so the comparator judges it there (block 2 forced local), not past
// the end of the block table.
TEST(ComparePrefill, PositionPastMaxSeqLenIsJudgedAtTheLastPosition) {
  ExactDots m(1, {384}, 384);
  for (int b = 0; b < 3; ++b) m.set_block(b, 500.0f);
  m.d.bt_row_stride = 100;  // room for a wrong, longer row
  m.d.block_table.resize(100, 0);
  const std::vector<int32_t> cu = {0, 1}, ctx = {9999}, seq = {384};
  const cpidx::PrefillInputs in = m.prefill(cu, ctx, seq, 1);
  ASSERT_EQ(want_of(in, {2, 0, 1}), (std::vector<int32_t>{2, 1}));
  EXPECT_EQ(compare_row(in, {2, 0, 1}, {1, 2}, {2, 1}).bad_rows, 1);
}

// Inputs the reference refuses (a null cu_seqlens_q) leave nothing to place or score: a differing
// row is bad, naming the refusal, and nothing is read through the null pointer.
TEST(ComparePrefill, RefusedInputsMakeADifferingRowBad) {
  ExactDots m(1, {384}, 384);
  for (int b = 0; b < 3; ++b) m.set_block(b, 500.0f);  // a three-way tie
  const std::vector<int32_t> cu = {0, 1}, ctx = {300}, seq = {301};
  cpidx::PrefillInputs in = m.prefill(cu, ctx, seq, 1);
  const cpidx::Selection sel{2, 0, 0};
  const std::vector<int32_t> want = want_of(in, sel);
  in.cu_seqlens_q = nullptr;
  const cpidx::ref::IdsComparison same = compare_row(in, sel, want, want);
  EXPECT_EQ(same.exact_rows, 1);
  const cpidx::ref::IdsComparison r = compare_row(in, sel, {want[1], want[0]}, want);
  EXPECT_EQ(r.bad_rows, 1);
  EXPECT_EQ(r.near_tie_rows, 0);
  EXPECT_NE(r.first_bad.find("head 0, row 0: differs, and the reference refused the inputs"),
            std::string::npos)
      << r.first_bad;
  EXPECT_NE(r.first_bad.find("cu_seqlens_q"), std::string::npos) << r.first_bad;
}

// docs/reliability.md section 2 (CONTRACT.md section 8's clamps): cu_seqlens_q out of order is
// clamped as prefill_topk clamps it (each start >= the previous start): {0, 2, 1, 3} gives tokens
// 0-1 to request 0, token 2 to request 2.
TEST(ComparePrefill, ClampsCuSeqlensLikePrefill) {
  ExactDots m(1, {384, 0, 384}, 384);
  m.set_block(0, 500.0f);  // request 0's blocks 0 and 1 tie
  m.set_block(1, 500.0f);
  const std::vector<int32_t> cu = {0, 2, 1, 3}, ctx = {300, 0, 0}, seq = {302, 0, 1};
  const cpidx::PrefillInputs in = m.prefill(cu, ctx, seq, 3);
  const cpidx::Selection sel{3, 0, 0};
  std::vector<int32_t> want(9);
  ASSERT_TRUE(cpidx::ref::prefill_topk(in, sel, {want.data(), 3, 3}, nullptr).is_ok());
  ASSERT_EQ(std::vector<int32_t>(want.begin() + 3, want.begin() + 6),
            (std::vector<int32_t>{1, 0, 2}));
  std::vector<int32_t> got = want;
  std::swap(got[3], got[4]);  // token 1 (request 0, position 301): a tie swap
  const cpidx::ref::IdsComparison r =
      cpidx::ref::compare_ids(in, sel, {got.data(), 3, 3}, {want.data(), 3, 3});
  EXPECT_EQ(r.near_tie_rows, 1);
  EXPECT_EQ(r.bad_rows, 0);
}

// CONTRACT.md sections 3-4: rows are judged on fp32(scale) * dot, the scores prefill_topk ranks,
// with a tolerance relative to the K-th of them (no absolute floor).
TEST(ComparePrefill, JudgesTheScaledScoresRelatively) {
  const std::vector<int32_t> cu = {0, 1}, ctx = {200}, seq = {201};
  const cpidx::Selection sel{2, 0, 0};
  auto swapped = [&](float scale, float dot0, float dot1) {  // got = want reversed
    ExactDots m(1, {256}, 256);
    m.d.scale = scale;
    m.set_block(0, dot0);
    m.set_block(1, dot1);
    const cpidx::PrefillInputs in = m.prefill(cu, ctx, seq, 1);
    const std::vector<int32_t> want = want_of(in, sel);
    return compare_row(in, sel, {want[1], want[0]}, want);
  };
  // Scale 1e-3: scores 0.0025 and 0.002, 25% apart: bad (an absolute 1e-3 floor would pass it).
  EXPECT_EQ(swapped(1e-3f, 2.5f, 2.0f).bad_rows, 1);
  // The smallest scale: dots 0.375 and 0.25 both score 0 in fp32, an exact tie (unscaled they
  // would lie 0.125 apart).
  EXPECT_EQ(swapped(std::numeric_limits<float>::denorm_min(), 0.375f, 0.25f).near_tie_rows, 1);
}

}  // namespace
