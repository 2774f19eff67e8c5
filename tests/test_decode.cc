// Plain decode details: shard block scores against a per-token brute force (bit-exact, -inf
// past the visible count), device-value clamps and their error bits, strided outputs, and the
// bytes a shard reads.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "cpidx/reference.h"
#include "test_util.h"

namespace {

using namespace cpidx_test;

TEST(BlockScores, MatchPerTokenBruteForceOnEveryShard) {
  const DecodeData d = random_decode(31, 2, 3, {0, 2, 130, 385, 700}, 768);
  const cpidx::DecodeInputs in = d.all_heads();
  const int64_t n = d.rows();
  for (int world : {1, 3, 4}) {
    for (int rank = 0; rank < world; ++rank) {
      const int64_t slots = cpidx::owned_blocks(d.max_blocks(), world, rank);
      std::vector<float> scores(static_cast<size_t>(2 * n * slots), 12345.0f);
      int32_t err = 0;
      ASSERT_TRUE(cpidx::ref::block_scores(in, world, rank, scores.data(), &err).is_ok());
      EXPECT_EQ(err, 0);
      for (int h = 0; h < 2; ++h) {
        for (int64_t row = 0; row < n; ++row) {
          const int req = static_cast<int>(row / d.query_len);
          const int64_t pos =
              d.seq_lens[static_cast<size_t>(req)] - d.query_len + row % d.query_len;
          const uint16_t* q = d.query.data() + (row * 2 + h) * kD;
          for (int64_t l = 0; l < slots; ++l) {
            const int64_t g = l * world + rank;
            float want = -std::numeric_limits<float>::infinity();
            if (g < cpidx::visible_blocks(pos)) {
              const int64_t page = d.block_table[static_cast<size_t>(req * d.bt_row_stride + g)];
              for (int64_t p = g * kBS; p <= std::min(pos, g * kBS + kBS - 1); ++p) {
                float acc = 0.0f;
                for (int dd = 0; dd < kD; ++dd) {
                  acc += cpidx::ref::bf16_to_float(q[dd]) *
                         cpidx::ref::cache_value(in.cache, page, static_cast<int>(p % kBS), dd);
                }
                want = std::max(want, d.scale * acc);
              }
            }
            const float got = scores[static_cast<size_t>((h * n + row) * slots + l)];
            ASSERT_EQ(cpidx::float_bits(got), cpidx::float_bits(want))
                << "world " << world << " rank " << rank << " h " << h << " row " << row << " slot "
                << l;
          }
        }
      }
    }
  }
}

TEST(DecodeClamps, SeqLensAndPagesAreClampedAndFlagged) {
  DecodeData d = random_decode(32, 2, 2, {300, 500, 40}, 512);
  const cpidx::Selection sel{8, 0, 1};
  IdsBuffer clean(2, d.rows(), 8);
  int32_t err = 0;
  ASSERT_TRUE(cpidx::ref::decode_topk(d.all_heads(), sel, clean.out(), nullptr, &err).is_ok());
  ASSERT_EQ(err, 0);

  // seq_len above max_seq_len behaves as max_seq_len; negative behaves as padding.
  DecodeData over = d;
  over.seq_lens = {300, 999999, -5};
  DecodeData capped = d;
  capped.seq_lens = {300, 512, 0};
  IdsBuffer got(2, d.rows(), 8), want(2, d.rows(), 8);
  err = 0;
  ASSERT_TRUE(cpidx::ref::decode_topk(over.all_heads(), sel, got.out(), nullptr, &err).is_ok());
  EXPECT_EQ(err, cpidx::kErrSeqLenOutOfRange);
  ASSERT_TRUE(
      cpidx::ref::decode_topk(capped.all_heads(), sel, want.out(), nullptr, nullptr).is_ok());
  EXPECT_EQ(got.ids, want.ids);
  for (int64_t row = 4; row < 6; ++row) EXPECT_EQ(got.row(0, row)[0], -1);

  // A block-table entry outside the cache reads the clamped page and sets the page bit.
  DecodeData bad_page = d;
  DecodeData page_zero = d;
  bad_page.block_table[0] = -77;
  page_zero.block_table[0] = 0;
  bad_page.block_table[static_cast<size_t>(d.bt_row_stride + 1)] = 1 << 30;
  page_zero.block_table[static_cast<size_t>(d.bt_row_stride + 1)] =
      static_cast<int32_t>(d.num_pages - 1);
  err = 0;
  ASSERT_TRUE(cpidx::ref::decode_topk(bad_page.all_heads(), sel, got.out(), nullptr, &err).is_ok());
  EXPECT_EQ(err, cpidx::kErrPageOutOfRange);
  ASSERT_TRUE(
      cpidx::ref::decode_topk(page_zero.all_heads(), sel, want.out(), nullptr, nullptr).is_ok());
  EXPECT_EQ(got.ids, want.ids);

  // The context-parallel path clamps the same way; the owners of the bad pages flag them.
  std::vector<IdsBuffer> ids;
  for (int r = 0; r < 2; ++r) ids.emplace_back(1, d.rows(), 8);
  std::vector<int32_t> errs(2, 0);
  run_ranks(2, [&](int r, cpidx::Communicator& comm) {
    cpidx::Geometry g;
    cpidx::make_geometry(2, 2, r, &g);
    ASSERT_TRUE(cpidx::ref::cp_decode(comm, g, bad_page.inputs(r, 1), sel,
                                      ids[static_cast<size_t>(r)].out(), nullptr,
                                      &errs[static_cast<size_t>(r)])
                    .is_ok());
  });
  EXPECT_EQ(errs[0] | errs[1], cpidx::kErrPageOutOfRange);
  for (int r = 0; r < 2; ++r) {
    for (int64_t row = 0; row < d.rows(); ++row) {
      for (int s = 0; s < 8; ++s)
        EXPECT_EQ(ids[static_cast<size_t>(r)].row(0, row)[s], want.row(r, row)[s]);
    }
  }
}

TEST(DecodeOutput, StridedIdsLeaveGapsUntouched) {
  const DecodeData d = random_decode(33, 2, 1, {900, 100}, 1024);
  const cpidx::Selection sel{4, 0, 1};
  IdsBuffer dense(2, d.rows(), 4);
  ASSERT_TRUE(cpidx::ref::decode_topk(d.all_heads(), sel, dense.out(), nullptr, nullptr).is_ok());
  const int64_t row_stride = 7, head_stride = 3 * row_stride;  // 1 spare row per head
  std::vector<int32_t> buf(static_cast<size_t>(2 * head_stride), kPoison);
  ASSERT_TRUE(cpidx::ref::decode_topk(d.all_heads(), sel, {buf.data(), head_stride, row_stride},
                                      nullptr, nullptr)
                  .is_ok());
  for (int h = 0; h < 2; ++h) {
    for (int64_t i = 0; i < head_stride; ++i) {
      const int64_t row = i / row_stride, col = i % row_stride;
      const int32_t v = buf[static_cast<size_t>(h * head_stride + i)];
      if (row < d.rows() && col < 4) {
        EXPECT_EQ(v, dense.row(h, row)[col]);
      } else {
        EXPECT_EQ(v, kPoison) << "gap written at head " << h << " offset " << i;
      }
    }
  }
}

TEST(ShardCacheBytes, CountsValidTokensOfOwnedBlocks) {
  const DecodeData d = random_decode(34, 1, 1, {129, 0, 300}, 512);
  cpidx::DecodeInputs in = d.all_heads();
  EXPECT_EQ(cpidx::ref::shard_cache_bytes(in, 1, 0), 429 * 128 * 2);
  EXPECT_EQ(cpidx::ref::shard_cache_bytes(in, 2, 0), (128 + 128 + 44) * 128 * 2);
  EXPECT_EQ(cpidx::ref::shard_cache_bytes(in, 2, 1), (1 + 128) * 128 * 2);
  EXPECT_EQ(cpidx::ref::shard_cache_bytes(in, 4, 3), 0);
  in.cache.dtype = cpidx::DType::kFP8E4M3;
  int64_t total = 0;
  for (int r = 0; r < 4; ++r) total += cpidx::ref::shard_cache_bytes(in, 4, r);
  EXPECT_EQ(total, 429 * 128);
}

}  // namespace
