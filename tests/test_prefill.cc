// Prefill selection (CONTRACT.md section 7) against a brute force inside the test: a dense
// per-token score matrix, block maxima, forcing, then a sort on (score, block). Chunked
// contexts (not multiples of 128), fresh prompts (context 0), head-major query strides, and
// scores scaled in fp32 (an overflow to +inf is a tie).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "cpidx/reference.h"
#include "test_util.h"

namespace {

using namespace cpidx_test;

struct PrefillData {
  int heads = 0;
  std::vector<int32_t> q_lens, context_lens, seq_lens, cu_seqlens, block_table;
  std::vector<uint16_t> query;  // head-major: [heads][tokens][D]
  DecodeData cache;             // reuses the random cache and block table builder
  int64_t tokens = 0;

  cpidx::PrefillInputs inputs() const {
    cpidx::PrefillInputs in;
    in.query = query.data();
    in.q_row_stride = kD;
    in.q_head_stride = tokens * kD;
    in.num_heads = heads;
    in.cache.data = cache.dtype == DType::kBF16 ? static_cast<const void*>(cache.cache_bf16.data())
                                                : static_cast<const void*>(cache.cache_fp8.data());
    in.cache.dtype = cache.dtype;
    in.cache.num_pages = cache.num_pages;
    in.block_table = cache.block_table.data();
    in.bt_row_stride = cache.bt_row_stride;
    in.cu_seqlens_q = cu_seqlens.data();
    in.context_lens = context_lens.data();
    in.seq_lens = seq_lens.data();
    in.num_reqs = static_cast<int>(q_lens.size());
    in.num_tokens = tokens;
    in.max_seq_len = cache.max_seq_len;
    in.scale = cache.scale;
    return in;
  }
};

PrefillData make_prefill(uint64_t seed, int heads, const std::vector<int32_t>& q_lens,
                         const std::vector<int32_t>& context_lens, int32_t max_seq_len, DType dtype,
                         Values values) {
  PrefillData p;
  p.heads = heads;
  p.q_lens = q_lens;
  p.context_lens = context_lens;
  p.cu_seqlens.push_back(0);
  for (size_t i = 0; i < q_lens.size(); ++i) {
    p.seq_lens.push_back(context_lens[i] + q_lens[i]);
    p.cu_seqlens.push_back(p.cu_seqlens.back() + q_lens[i]);
  }
  p.tokens = p.cu_seqlens.back();
  p.cache = random_decode(seed, 1, 1, p.seq_lens, max_seq_len, dtype, values);
  std::mt19937_64 rng(seed + 1);
  p.query.resize(static_cast<size_t>(heads * p.tokens * kD));
  for (auto& q : p.query) q = bf16_of(draw_value(rng, values));
  return p;
}

// Dense brute force: ids [heads][tokens][K].
std::vector<int32_t> brute_force(const PrefillData& p, const cpidx::Selection& sel) {
  const cpidx::PrefillInputs in = p.inputs();
  std::vector<int32_t> out(static_cast<size_t>(p.heads * p.tokens * sel.topk), -1);
  for (size_t req = 0; req < p.q_lens.size(); ++req) {
    for (int i = 0; i < p.q_lens[req]; ++i) {
      const int64_t tok = p.cu_seqlens[req] + i;
      const int64_t pos = p.context_lens[req] + i;
      const int64_t visible = pos / kBS + 1;
      for (int h = 0; h < p.heads; ++h) {
        const uint16_t* q = p.query.data() + (h * p.tokens + tok) * kD;
        std::vector<float> dense(static_cast<size_t>(pos + 1));
        for (int64_t t = 0; t <= pos; ++t) {
          const int64_t page = in.block_table[req * in.bt_row_stride + t / kBS];
          float acc = 0.0f;
          for (int d = 0; d < kD; ++d) {
            acc += cpidx::ref::bf16_to_float(q[d]) *
                   cpidx::ref::cache_value(in.cache, page, static_cast<int>(t % kBS), d);
          }
          dense[static_cast<size_t>(t)] = in.scale * acc;
        }
        std::vector<std::pair<float, int64_t>> blocks;
        for (int64_t b = 0; b < visible; ++b) {
          float m = -std::numeric_limits<float>::infinity();
          for (int64_t t = b * kBS; t <= std::min(pos, b * kBS + kBS - 1); ++t) {
            m = std::max(m, dense[static_cast<size_t>(t)]);
          }
          if (b < sel.init_blocks) m = 1e30f;
          if (b >= std::max<int64_t>(0, visible - sel.local_blocks)) m = 1e29f;
          blocks.emplace_back(m, b);
        }
        std::sort(blocks.begin(), blocks.end(), [](const auto& x, const auto& y) {
          return x.first != y.first ? x.first > y.first : x.second > y.second;
        });
        for (size_t s = 0; s < blocks.size() && s < static_cast<size_t>(sel.topk); ++s) {
          out[static_cast<size_t>((h * p.tokens + tok) * sel.topk) + s] =
              static_cast<int32_t>(blocks[s].second);
        }
      }
    }
  }
  return out;
}

void expect_matches_brute_force(const PrefillData& p, const cpidx::Selection& sel) {
  IdsBuffer ids(p.heads, p.tokens, sel.topk);
  int32_t err = 0;
  const cpidx::Status s = cpidx::ref::prefill_topk(p.inputs(), sel, ids.out(), &err);
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(err, 0);
  ASSERT_FALSE(ids.any_poison());
  EXPECT_EQ(ids.ids, brute_force(p, sel));
}

TEST(Prefill, ChunkedAndFreshMatchBruteForce) {
  const PrefillData p =
      make_prefill(11, 2, {70, 1, 33, 5}, {200, 1000, 0, 129}, 1280, DType::kBF16, Values::kRandom);
  for (const cpidx::Selection& sel :
       std::vector<cpidx::Selection>{{6, 0, 1}, {4, 1, 2}, {16, 2, 4}, {1, 0, 0}}) {
    expect_matches_brute_force(p, sel);
  }
}

TEST(Prefill, TiesAndFp8MatchBruteForce) {
  expect_matches_brute_force(
      make_prefill(12, 1, {40, 130}, {300, 0}, 512, DType::kFP8E4M3, Values::kTies), {6, 0, 1});
  expect_matches_brute_force(
      make_prefill(13, 3, {20, 7}, {517, 128}, 640, DType::kBF16, Values::kTies), {4, 1, 1});
}

TEST(Prefill, RowsOutsideEveryRequestAreMinusOne) {
  PrefillData p = make_prefill(14, 1, {10, 6}, {0, 50}, 256, DType::kBF16, Values::kRandom);
  cpidx::PrefillInputs in = p.inputs();
  in.num_reqs = 1;  // the second request's 6 tokens are not covered
  IdsBuffer ids(1, p.tokens, 4);
  ASSERT_TRUE(cpidx::ref::prefill_topk(in, {4, 0, 1}, ids.out(), nullptr).is_ok());
  for (int64_t row = 10; row < p.tokens; ++row) {
    for (int s = 0; s < 4; ++s) EXPECT_EQ(ids.row(0, row)[s], -1);
  }
}

// CONTRACT.md sections 3 and 4.2: a score is fp32(scale) * dot, rounded in fp32. Scale 3e38
// takes dots 3 and 2 to +inf alike: equal scores, so the higher block id comes first.
TEST(Prefill, ScoresAreScaledInFp32) {
  ExactDots m(1, {256}, 256);
  m.set_block(0, 3.0f);
  m.set_block(1, 2.0f);
  m.d.scale = 3e38f;
  const std::vector<int32_t> cu = {0, 1}, ctx = {255}, seq = {256};
  const cpidx::PrefillInputs in = m.prefill(cu, ctx, seq, 1);
  IdsBuffer ids(1, 1, 1);
  ASSERT_TRUE(cpidx::ref::prefill_topk(in, {1, 0, 0}, ids.out(), nullptr).is_ok());
  EXPECT_EQ(ids.ids[0], 1);
}

}  // namespace
