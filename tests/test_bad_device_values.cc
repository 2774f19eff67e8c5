// Bad values that live on the device (CONTRACT.md section 8) and non-finite numbers, on the CPU
// reference of every path: seq_lens and context_lens out of [0, max_seq_len], block-table entries
// outside the cache, cu_seqlens_q out of order, NaN / inf in queries and keys (bf16 and fp8),
// garbage keys handed to the merge. Each run must stay in bounds (the asan preset runs this
// file), give the documented result and raise exactly the documented error bits:
//  - a seq_len / context_len below 0 or above max_seq_len acts as 0 / max_seq_len, bit 1 (a
//    prefill seq_len raises it on its own); a prefill position past the bound reads
//    max_seq_len - 1;
//  - a block-table entry below 0 / at or past num_pages reads page 0 / num_pages - 1, bit 2;
//  - NaN dots never win a block's max (which starts at -inf), so a block whose visible dots
//    are all NaN scores -inf; inf dots behave as numbers (+inf outranks the forced 1e30);
//    scale is finite and > 0, so no block score is ever NaN. Non-finite values raise no bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpidx/reference.h"
#include "test_util.h"

namespace {

using namespace cpidx_test;
using cpidx::Selection;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr uint16_t kBf16NaN = 0x7FC0, kBf16Inf = 0x7F80, kBf16NegInf = 0xFF80;

// The plain decode of every head, with its error bits.
struct Result {
  std::vector<int32_t> ids;
  int32_t err = 0;
};
Result decode(const DecodeData& d, const Selection& sel) {
  IdsBuffer ids(d.total_heads, d.rows(), sel.topk);
  Result r;
  const cpidx::Status s = cpidx::ref::decode_topk(d.all_heads(), sel, ids.out(), nullptr, &r.err);
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_FALSE(ids.any_poison());
  r.ids = ids.ids;
  return r;
}

// The context-parallel decode over `world` thread ranks, ids of every head assembled from each
// head's owner, error bits OR-ed over the ranks.
Result cp_decode(const DecodeData& d, const Selection& sel, int world) {
  const int64_t n = d.rows();
  Result all;
  all.ids.assign(static_cast<size_t>(d.total_heads * n * sel.topk), kPoison);
  std::vector<IdsBuffer> ids;
  std::vector<cpidx::Geometry> geos(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    cpidx::make_geometry(d.total_heads, world, r, &geos[static_cast<size_t>(r)]);
    ids.emplace_back(geos[static_cast<size_t>(r)].local_heads, n, sel.topk);
  }
  std::vector<int32_t> errs(static_cast<size_t>(world), 0);
  run_ranks(world, [&](int r, cpidx::Communicator& comm) {
    const auto i = static_cast<size_t>(r);
    const cpidx::Status s =
        cpidx::ref::cp_decode(comm, geos[i], d.inputs(geos[i].head_offset, geos[i].local_heads),
                              sel, ids[i].out(), nullptr, &errs[i]);
    EXPECT_TRUE(s.is_ok()) << "rank " << r << ": " << s.to_string();
  });
  for (int r = 0; r < world; ++r) {
    const auto i = static_cast<size_t>(r);
    all.err |= errs[i];
    for (int j = 0; j < geos[i].local_heads; ++j) {
      std::copy(ids[i].ids.begin() + j * n * sel.topk, ids[i].ids.begin() + (j + 1) * n * sel.topk,
                all.ids.begin() + (geos[i].head_offset + j) * n * sel.topk);
    }
  }
  return all;
}

// Brute force of CONTRACT.md sections 3 and 4 on the clamped inputs: per-token fp32 dots in
// order d = 0..127 (NaN dots skipped by the max), forcing, then a sort on (score, block).
std::vector<int32_t> brute_force(const DecodeData& d, const Selection& sel) {
  const cpidx::DecodeInputs in = d.all_heads();
  const int64_t n = d.rows();
  const int K = sel.topk;
  std::vector<int32_t> out(static_cast<size_t>(d.total_heads * n * K), -1);
  for (int h = 0; h < d.total_heads; ++h) {
    for (int64_t row = 0; row < n; ++row) {
      const int req = static_cast<int>(row / d.query_len);
      const int32_t raw = d.seq_lens[static_cast<size_t>(req)];
      const int64_t seq = std::clamp<int64_t>(raw, 0, d.max_seq_len);
      const int64_t pos = seq - d.query_len + row % d.query_len;
      const int64_t V = cpidx::visible_blocks(pos);
      const uint16_t* q = d.query.data() + (row * d.total_heads + h) * kD;
      std::vector<std::pair<float, int64_t>> blocks;
      for (int64_t b = 0; b < V; ++b) {
        const int64_t page = std::clamp<int64_t>(
            d.block_table[static_cast<size_t>(req * d.bt_row_stride + b)], 0, d.num_pages - 1);
        float best = -kInf;
        for (int64_t p = b * kBS; p <= std::min(pos, b * kBS + kBS - 1); ++p) {
          float acc = 0.0f;
          for (int dd = 0; dd < kD; ++dd) {
            acc += cpidx::ref::bf16_to_float(q[dd]) *
                   cpidx::ref::cache_value(in.cache, page, static_cast<int>(p % kBS), dd);
          }
          if (acc > best) best = acc;
        }
        float s = d.scale * best;
        EXPECT_FALSE(std::isnan(s));
        if (b < sel.init_blocks) s = cpidx::kInitScore;
        if (b >= std::max<int64_t>(0, V - sel.local_blocks)) s = cpidx::kLocalScore;
        blocks.emplace_back(s == 0.0f ? 0.0f : s, b);  // -0 == +0
      }
      std::sort(blocks.begin(), blocks.end(), [](const auto& x, const auto& y) {
        return x.first != y.first ? x.first > y.first : x.second > y.second;
      });
      for (size_t i = 0; i < blocks.size() && i < static_cast<size_t>(K); ++i) {
        out[static_cast<size_t>((h * n + row) * K) + i] = static_cast<int32_t>(blocks[i].second);
      }
    }
  }
  return out;
}

// Every path agrees with the brute force, and raises `want_err`.
void expect_all_paths(const DecodeData& d, const Selection& sel, int32_t want_err) {
  const std::vector<int32_t> want = brute_force(d, sel);
  const Result plain = decode(d, sel);
  EXPECT_EQ(plain.ids, want) << "plain decode";
  EXPECT_EQ(plain.err, want_err) << "plain decode";
  for (int world : valid_worlds(d.total_heads)) {
    if (world == 1) continue;
    const Result cp = cp_decode(d, sel, world);
    EXPECT_EQ(cp.ids, want) << "cp_decode P=" << world;
    EXPECT_EQ(cp.err, want_err) << "cp_decode P=" << world;
  }
}

TEST(BadDeviceValues, SeqLensOutOfRangeAreClampedAndFlagged) {
  const int32_t bound = 1000;  // not a block multiple
  const std::vector<int32_t> bad = {std::numeric_limits<int32_t>::min(), -1, 0, 1, bound, bound + 1,
                                    std::numeric_limits<int32_t>::max()};
  for (int Q : {1, 3}) {
    // Built with every request at the bound, so every block-table column in range is valid.
    DecodeData d = random_decode(1000 + Q, 2, Q, std::vector<int32_t>(bad.size(), bound), bound);
    d.seq_lens = bad;
    SCOPED_TRACE("Q " + std::to_string(Q));
    expect_all_paths(d, {8, 1, 1}, cpidx::kErrSeqLenOutOfRange);
    // Only in-range values: no bit.
    DecodeData clean = d;
    clean.seq_lens = {0, 0, 0, 1, bound, bound, bound};
    expect_all_paths(clean, {8, 1, 1}, 0);
    EXPECT_EQ(decode(d, {8, 1, 1}).ids, decode(clean, {8, 1, 1}).ids);
  }
}

TEST(BadDeviceValues, PagesOutsideTheCacheAreClampedAndFlagged) {
  DecodeData d = random_decode(1100, 4, 2, {700, 1000, 129}, 1024);
  const int32_t pages = static_cast<int32_t>(d.num_pages);
  const std::vector<int32_t> bad = {std::numeric_limits<int32_t>::min(), -1, pages, pages + 7,
                                    std::numeric_limits<int32_t>::max()};
  // Request 1 uses 8 blocks: put every bad value in a used column.
  for (size_t i = 0; i < bad.size(); ++i) {
    d.block_table[static_cast<size_t>(d.bt_row_stride + static_cast<int64_t>(i))] = bad[i];
  }
  expect_all_paths(d, {4, 0, 2}, cpidx::kErrPageOutOfRange);
  // Columns past a request's length are never read: garbage there raises nothing
  // (random_decode fills them with -1000003 and 2^30).
  DecodeData fine = random_decode(1101, 4, 2, {700, 1000, 129}, 1024);
  expect_all_paths(fine, {4, 0, 2}, 0);
  // Both kinds at once.
  d.seq_lens[0] = -5;
  expect_all_paths(d, {4, 0, 2}, cpidx::kErrPageOutOfRange | cpidx::kErrSeqLenOutOfRange);
}

TEST(BadDeviceValues, ShardScoresFlagOnlyTheOwnersOfBadPages) {
  DecodeData d = random_decode(1150, 2, 1, {1024}, 1024);
  d.block_table[3] = -9;  // block 3: owned by rank 1 of 2, rank 3 of 4
  for (int world : {2, 4}) {
    for (int rank = 0; rank < world; ++rank) {
      const int64_t slots = cpidx::owned_blocks(d.max_blocks(), world, rank);
      std::vector<float> scores(static_cast<size_t>(2 * d.rows() * slots));
      int32_t err = 0;
      ASSERT_TRUE(
          cpidx::ref::block_scores(d.all_heads(), world, rank, scores.data(), &err).is_ok());
      EXPECT_EQ(err, rank == 3 % world ? cpidx::kErrPageOutOfRange : 0)
          << "world " << world << " rank " << rank;
    }
  }
}

TEST(BadDeviceValues, SparseTableWithBadSeqLensAndPages) {
  DecodeData d = random_decode(1200, 1, 2, {640, 640, 640, 640}, 640);
  d.seq_lens = {-3, 900, 0, 641};
  const auto req1_block0 = static_cast<size_t>(d.bt_row_stride);
  d.block_table[req1_block0] = 1 << 30;
  const Selection sel{4, 0, 1};
  const int64_t n = d.rows(), G = d.max_blocks();
  std::vector<int32_t> attn(static_cast<size_t>(d.num_reqs() * G));
  for (size_t i = 0; i < attn.size(); ++i) attn[i] = static_cast<int32_t>(100 + i);
  auto run = [&](const DecodeData& data, int32_t* err) {
    IdsBuffer ids(1, n, sel.topk);
    std::vector<int32_t> table(static_cast<size_t>(n * sel.topk * 8), kPoison), ctx(n, kPoison);
    const cpidx::SparseTableOutput t{attn.data(), G, table.data(), sel.topk * 8, ctx.data(), 16};
    EXPECT_TRUE(cpidx::ref::decode_topk(data.all_heads(), sel, ids.out(), &t, err).is_ok());
    EXPECT_FALSE(std::all_of(table.begin(), table.end(), [](int32_t v) { return v == kPoison; }));
    table.insert(table.end(), ctx.begin(), ctx.end());
    return table;
  };
  int32_t err = 0;
  const std::vector<int32_t> got = run(d, &err);
  EXPECT_EQ(err, cpidx::kErrSeqLenOutOfRange | cpidx::kErrPageOutOfRange);
  DecodeData clamped = d;
  clamped.seq_lens = {0, 640, 0, 640};
  clamped.block_table[req1_block0] = static_cast<int32_t>(d.num_pages - 1);
  int32_t clean_err = 0;
  EXPECT_EQ(got, run(clamped, &clean_err));
  EXPECT_EQ(clean_err, 0);
  // Padding rows (request 0 and 2): zero rows, context length 0.
  for (int64_t row : {0, 1, 4, 5}) EXPECT_EQ(got[static_cast<size_t>(n * sel.topk * 8 + row)], 0);
}

TEST(BadDeviceValues, PrefillLengthsAndCuSeqlensAreClampedAndFlagged) {
  const DecodeData d = random_decode(1300, 2, 1, {512, 512}, 512);
  std::vector<uint16_t> query(static_cast<size_t>(6 * 2 * kD));
  std::mt19937 rng(5);
  for (auto& q : query) q = bf16_of(static_cast<float>(static_cast<int>(rng() % 7) - 3));
  auto inputs = [&](const std::vector<int32_t>& cu, const std::vector<int32_t>& ctx,
                    const std::vector<int32_t>& seq, const std::vector<int32_t>& table) {
    cpidx::PrefillInputs in;
    in.query = query.data();
    in.q_row_stride = 2 * kD;
    in.q_head_stride = kD;
    in.num_heads = 2;
    in.cache = d.all_heads().cache;
    in.block_table = table.data();
    in.bt_row_stride = d.bt_row_stride;
    in.cu_seqlens_q = cu.data();
    in.context_lens = ctx.data();
    in.seq_lens = seq.data();
    in.num_reqs = 2;
    in.num_tokens = 6;
    in.max_seq_len = d.max_seq_len;
    in.scale = 0.125f;
    return in;
  };
  auto run = [&](const cpidx::PrefillInputs& in, int32_t* err) {
    IdsBuffer ids(2, 6, 4);
    EXPECT_TRUE(cpidx::ref::prefill_topk(in, {4, 0, 1}, ids.out(), err).is_ok());
    EXPECT_FALSE(ids.any_poison());
    return ids.ids;
  };
  const std::vector<int32_t> cu = {0, 3, 6}, ctx = {100, 200}, seq = {103, 206};
  int32_t err = 0;
  const std::vector<int32_t> clean = run(inputs(cu, ctx, seq, d.block_table), &err);
  EXPECT_EQ(err, 0);

  // context_lens below 0 / above the bound act as 0 / max_seq_len (positions past the bound
  // read the last block); seq_lens out of range are only reported.
  err = 0;
  const std::vector<int32_t> a = run(inputs(cu, {-50, 9999}, {-1, 1 << 30}, d.block_table), &err);
  EXPECT_EQ(err, cpidx::kErrSeqLenOutOfRange);
  err = 0;
  const std::vector<int32_t> b = run(inputs(cu, {0, 512}, seq, d.block_table), &err);
  EXPECT_EQ(err, cpidx::kErrSeqLenOutOfRange) << "positions past max_seq_len are flagged";
  EXPECT_EQ(a, b);

  // cu_seqlens_q out of order or past num_tokens: clamped into a non-decreasing sequence in
  // [0, num_tokens]; rows no request covers are -1; flagged.
  // Each bad cu_seqlens_q with the sequence its clamp gives: the ids are that sequence's.
  const std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> clamped = {
      {{0, 5, 2}, {0, 5, 5}}, {{0, -4, 6}, {0, 0, 6}}, {{0, 3, 99}, {0, 3, 6}},
      {{-7, 3, 6}, {0, 3, 6}}};
  for (const auto& [bad_cu, clamp] : clamped) {
    SCOPED_TRACE(::testing::Message() << bad_cu[0] << " " << bad_cu[1] << " " << bad_cu[2]);
    err = 0;
    const std::vector<int32_t> got = run(inputs(bad_cu, ctx, seq, d.block_table), &err);
    EXPECT_EQ(err, cpidx::kErrSeqLenOutOfRange);
    err = 0;
    EXPECT_EQ(got, run(inputs(clamp, ctx, seq, d.block_table), &err));
    EXPECT_EQ(err, 0) << "the clamped sequence is in range";
  }
  err = 0;
  const std::vector<int32_t> shifted = run(inputs({2, 3, 6}, ctx, seq, d.block_table), &err);
  EXPECT_EQ(err, 0) << "a cu_seqlens_q that starts past 0 is in range: rows 0-1 are uncovered";
  for (int h = 0; h < 2; ++h) {
    for (int row = 0; row < 2; ++row) {
      for (int s = 0; s < 4; ++s)
        EXPECT_EQ(shifted[static_cast<size_t>((h * 6 + row) * 4 + s)], -1);
    }
  }

  // Pages outside the cache.
  std::vector<int32_t> table = d.block_table;
  table[0] = -1;
  table[static_cast<size_t>(d.bt_row_stride)] = 1 << 30;
  err = 0;
  run(inputs(cu, ctx, seq, table), &err);
  EXPECT_EQ(err, cpidx::kErrPageOutOfRange);
}

// CONTRACT.md section 8: a prefill seq_len above max_seq_len is flagged (bit 1) even when every
// context_len and cu_seqlens_q is in range.
TEST(BadDeviceValues, PrefillSeqLenAboveTheBoundIsFlaggedOnItsOwn) {
  const ExactDots m(1, {256}, 256);
  const std::vector<int32_t> cu = {0, 1}, ctx = {10}, seq = {257};
  IdsBuffer ids(1, 1, 2);
  int32_t err = 0;
  const cpidx::PrefillInputs in = m.prefill(cu, ctx, seq, 1);
  ASSERT_TRUE(cpidx::ref::prefill_topk(in, {2, 0, 1}, ids.out(), &err).is_ok());
  EXPECT_EQ(err, cpidx::kErrSeqLenOutOfRange);
}

// docs/reliability.md section 2 (CONTRACT.md section 8's clamps): a prefill position past
// max_seq_len is clamped to max_seq_len - 1, so the token sees every key up to that last one (and
// the call is flagged).
TEST(BadDeviceValues, PrefillPositionPastTheBoundSeesTheLastKey) {
  ExactDots m(1, {512}, 512, -1.0f);
  m.set_dot(0, 0.5f);
  m.set_dot(511, 1.0f);  // visible only at position 511
  const std::vector<int32_t> cu = {0, 1}, ctx = {9999}, seq = {512};
  IdsBuffer ids(1, 1, 1);
  int32_t err = 0;
  const cpidx::PrefillInputs in = m.prefill(cu, ctx, seq, 1);
  ASSERT_TRUE(cpidx::ref::prefill_topk(in, {1, 0, 0}, ids.out(), &err).is_ok());
  EXPECT_EQ(ids.ids[0], 3);
  EXPECT_EQ(err, cpidx::kErrSeqLenOutOfRange);
}

// ---- NaN and inf -----------------------------------------------------------------------------

// A batch of small integers (exact dots) with one request long enough for 6 blocks.
DecodeData small_ints(uint64_t seed, DType dtype = DType::kBF16) {
  return random_decode(seed, 2, 2, {700, 300, 1}, 768, dtype, Values::kTies, 1.0f);
}

uint16_t* key_of(DecodeData& d, int req, int64_t token) {
  const int64_t page = d.block_table[static_cast<size_t>(req * d.bt_row_stride + token / kBS)];
  return d.cache_bf16.data() + (page * kBS + token % kBS) * kD;
}

TEST(NonFinite, NaNQueryScoresEveryBlockMinusInf) {
  DecodeData d = small_ints(1400);
  // Row 0 (request 0, t 0), head 1: one NaN element makes every dot NaN.
  d.query[static_cast<size_t>((0 * 2 + 1) * kD + 17)] = kBf16NaN;
  // Row 1, head 0: all NaN.
  std::fill_n(d.query.begin() + (1 * 2 + 0) * kD, kD, kBf16NaN);
  const Selection sel{6, 1, 1};
  expect_all_paths(d, sel, 0);
  // The documented result: forced blocks first, then every other block at -inf, higher id first.
  const Result r = decode(d, sel);
  const int64_t n = d.rows();
  const int32_t* row0_h1 = r.ids.data() + (1 * n + 0) * 6;
  // Row 0 sits at pos 698: V = 6; init block 0 (1e30), local block 5 (1e29), then 4, 3, 2, 1.
  EXPECT_EQ(std::vector<int32_t>(row0_h1, row0_h1 + 6), (std::vector<int32_t>{0, 5, 4, 3, 2, 1}));
  std::vector<float> scores(static_cast<size_t>(2 * n * 6));
  ASSERT_TRUE(cpidx::ref::block_scores(d.all_heads(), 1, 0, scores.data(), nullptr).is_ok());
  for (int b = 0; b < 6; ++b) {
    EXPECT_EQ(scores[static_cast<size_t>((1 * n + 0) * 6 + b)], -kInf) << "block " << b;
    EXPECT_EQ(scores[static_cast<size_t>((0 * n + 1) * 6 + b)], -kInf) << "block " << b;
  }
  for (float s : scores) EXPECT_FALSE(std::isnan(s)) << "a block score is never NaN";
}

TEST(NonFinite, NaNKeysNeverWinAndAllNaNBlocksScoreMinusInf) {
  DecodeData d = small_ints(1500);
  // Request 0: every key of block 2 NaN; one key of block 3 NaN (its other tokens still count).
  for (int64_t p = 2 * kBS; p < 3 * kBS; ++p) std::fill_n(key_of(d, 0, p), kD, kBf16NaN);
  key_of(d, 0, 3 * kBS + 5)[0] = kBf16NaN;
  const Selection sel{6, 0, 1};
  expect_all_paths(d, sel, 0);
  std::vector<float> scores(static_cast<size_t>(2 * d.rows() * 6));
  ASSERT_TRUE(cpidx::ref::block_scores(d.all_heads(), 1, 0, scores.data(), nullptr).is_ok());
  for (int h = 0; h < 2; ++h) {
    for (int64_t row = 0; row < 2; ++row) {
      EXPECT_EQ(scores[static_cast<size_t>((h * d.rows() + row) * 6 + 2)], -kInf);
      EXPECT_TRUE(std::isfinite(scores[static_cast<size_t>((h * d.rows() + row) * 6 + 3)]));
    }
  }
  // With K = V every block is listed; the all-NaN block is last among the unforced ones.
  const Result r = decode(d, sel);
  EXPECT_EQ(r.ids[5], 2) << "row 0 head 0: the -inf block ranks last";
}

TEST(NonFinite, InfDotsBehaveAsNumbers) {
  DecodeData d = small_ints(1600);
  // Request 0, token 130 (block 1): +inf in dim 0 with query dims 0 of both rows set to +1
  // -> a +inf dot; block 1 then outranks even the forced blocks (inf > 1e30).
  key_of(d, 0, 130)[0] = kBf16Inf;
  // Token 400 (block 3): -inf in dim 1 with query dim 1 = +1 -> a -inf dot (never wins).
  key_of(d, 0, 400)[1] = kBf16NegInf;
  // Token 520 (block 4): +inf in dim 2 with query dim 2 = 0 -> 0 * inf = NaN (never wins).
  key_of(d, 0, 520)[2] = kBf16Inf;
  for (int64_t row = 0; row < 2; ++row) {
    for (int h = 0; h < 2; ++h) {
      uint16_t* q = d.query.data() + (row * 2 + h) * kD;
      q[0] = bf16_of(1.0f);
      q[1] = bf16_of(1.0f);
      q[2] = bf16_of(0.0f);
    }
  }
  const Selection sel{3, 1, 1};
  expect_all_paths(d, sel, 0);
  const Result r = decode(d, sel);
  for (int h = 0; h < 2; ++h) {
    const int32_t* row0 = r.ids.data() + (h * d.rows()) * 3;
    EXPECT_EQ(row0[0], 1) << "+inf block first, head " << h;
    EXPECT_EQ(row0[1], 0) << "then the init block";
    EXPECT_EQ(row0[2], 5) << "then the local block";
  }
  // Huge finite values overflow the fp32 dot to inf: the same rule.
  DecodeData big = small_ints(1601);
  std::fill_n(key_of(big, 0, 260), kD, bf16_of(3e38f));
  for (int64_t row = 0; row < 2; ++row) {
    for (int h = 0; h < 2; ++h)
      std::fill_n(big.query.begin() + (row * 2 + h) * kD, kD, bf16_of(1e10f));
  }
  expect_all_paths(big, sel, 0);
  EXPECT_EQ(decode(big, sel).ids[0], 2);
}

TEST(NonFinite, Fp8NaNCodes) {
  DecodeData d = small_ints(1700, DType::kFP8E4M3);
  auto page_of = [&](int req, int64_t block) {
    return d.block_table[static_cast<size_t>(req * d.bt_row_stride + block)];
  };
  // Block 1 of request 0 all NaN (0x7F and 0xFF codes); block 4 has one NaN key element.
  uint8_t* b1 = d.cache_fp8.data() + int64_t{page_of(0, 1)} * kBS * kD;
  for (int64_t i = 0; i < kBS * kD; ++i) b1[i] = i % 2 ? 0x7F : 0xFF;
  d.cache_fp8[static_cast<size_t>(int64_t{page_of(0, 4)} * kBS * kD + 3)] = 0x7F;
  expect_all_paths(d, {6, 0, 1}, 0);
  std::vector<float> scores(static_cast<size_t>(2 * d.rows() * 6));
  ASSERT_TRUE(cpidx::ref::block_scores(d.all_heads(), 1, 0, scores.data(), nullptr).is_ok());
  EXPECT_EQ(scores[1], -kInf);
}

TEST(NonFinite, RandomNonFiniteSprinkleAllPathsAgree) {
  std::mt19937_64 rng(1800);
  const uint16_t specials[] = {kBf16NaN, 0xFFC1, kBf16Inf, kBf16NegInf, 0x7F7F /* max */, 0x8000};
  for (int trial = 0; trial < 6; ++trial) {
    DecodeData d = random_decode(1800 + trial, 4, 1 + trial % 3, {900, 129, 5, 1000}, 1024);
    for (int i = 0; i < 40; ++i) {
      d.query[rng() % d.query.size()] = specials[rng() % 6];
      d.cache_bf16[rng() % d.cache_bf16.size()] = specials[rng() % 6];
    }
    // Whole NaN tokens hit the all-NaN path more often.
    for (int i = 0; i < 30; ++i) {
      std::fill_n(d.cache_bf16.begin() + static_cast<int64_t>(rng() % (d.num_pages * kBS)) * kD, kD,
                  kBf16NaN);
    }
    SCOPED_TRACE("trial " + std::to_string(trial));
    expect_all_paths(d, {8, static_cast<int>(trial % 2), 1 + trial % 2}, 0);
  }
}

// CONTRACT.md sections 3-4.2: in prefill too, a NaN dot never wins a block's max, even as the
// block's last token (block 0: 1.0 then NaN at slot 127 must still beat block 1 at 0.5).
TEST(NonFinite, PrefillNaNDotLastInABlockNeverWins) {
  ExactDots m(1, {256}, 256, -1.0f);
  m.set_dot(5, 1.0f);
  m.set_dot(127, std::numeric_limits<float>::quiet_NaN());
  m.set_block(1, 0.5f);
  const std::vector<int32_t> cu = {0, 1}, ctx = {200}, seq = {201};
  IdsBuffer ids(1, 1, 1);
  const cpidx::PrefillInputs in = m.prefill(cu, ctx, seq, 1);
  ASSERT_TRUE(cpidx::ref::prefill_topk(in, {1, 0, 0}, ids.out(), nullptr).is_ok());
  EXPECT_EQ(ids.ids[0], 0);
}

// ---- Merge of garbage keys -----------------------------------------------------------------

TEST(BadDeviceValues, MergeOfGarbageKeysStaysInBounds) {
  // Keys come from other ranks through a device exchange: any 64-bit pattern must merge without
  // an out-of-bounds access, and the sparse table must skip ids outside [0, own block].
  std::mt19937_64 rng(1900);
  const int world = 2, T = 2, Q = 2, K = 4;
  const std::vector<int32_t> seq_lens = {700, -3, 1 << 30};
  const int reqs = 3;
  const int64_t n = reqs * Q;
  const int32_t bound = 768;
  const int64_t G = cpidx::cdiv(bound, kBS);
  std::vector<int32_t> attn(static_cast<size_t>(reqs * G), 11);
  for (int trial = 0; trial < 20; ++trial) {
    const std::vector<cpidx::Key> keys =
        garbage_keys(rng, static_cast<size_t>(world * T * n * K), 1);
    IdsBuffer ids(1, n, K);
    std::vector<int32_t> table(static_cast<size_t>(n * K * 8), kPoison), ctx(n, kPoison);
    const cpidx::SparseTableOutput t{attn.data(), G, table.data(), K * 8, ctx.data(), 8};
    ASSERT_TRUE(cpidx::ref::merge_topk_keys(keys.data(), world, T, n, {K, 0, 1}, 1, 1,
                                            seq_lens.data(), reqs, Q, bound, ids.out(), &t)
                    .is_ok());
    EXPECT_FALSE(ids.any_poison());
    for (int64_t row = 0; row < n; ++row) {
      EXPECT_GE(ctx[static_cast<size_t>(row)], 0);
      EXPECT_LE(ctx[static_cast<size_t>(row)], bound);
    }
    for (int32_t v : table) EXPECT_TRUE(v == 0 || (v >= 88 && v < 96)) << v;
  }
}

}  // namespace
