// Context-parallel decode == plain decode, bit for bit, on every rank (thread communicators):
// world sizes 1..8 incl. replicated heads, Q in {1, 4}, padding and sub-block requests, ranks
// owning no block, tie-heavy values, bf16 and fp8 caches, the lowest replica's query. Also rank
// disagreement and bad input on one rank: an error on every rank, never a hang.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "cpidx/reference.h"
#include "test_util.h"

namespace {

using namespace cpidx_test;

struct CpCase {
  int total_heads;
  int world;
  int query_len;
  std::vector<int32_t> seq_lens;
  int32_t max_seq_len;
  cpidx::Selection sel;
  DType dtype = DType::kBF16;
  Values values = Values::kRandom;
};

std::string describe(const CpCase& c) {
  std::string s = "T " + std::to_string(c.total_heads) + " P " + std::to_string(c.world) + " Q " +
                  std::to_string(c.query_len) + " K " + std::to_string(c.sel.topk) + " init " +
                  std::to_string(c.sel.init_blocks) + " local " +
                  std::to_string(c.sel.local_blocks) + " " + cpidx::to_string(c.dtype) +
                  (c.values == Values::kTies ? " ties" : "") + " seq_lens";
  for (int32_t v : c.seq_lens) s += " " + std::to_string(v);
  return s;
}

void expect_cp_equals_plain(const CpCase& c, uint64_t seed) {
  SCOPED_TRACE(describe(c));
  const DecodeData d =
      random_decode(seed, c.total_heads, c.query_len, c.seq_lens, c.max_seq_len, c.dtype, c.values);
  const int k = c.sel.topk;
  IdsBuffer plain(c.total_heads, d.rows(), k);
  int32_t plain_err = 0;
  const cpidx::Status s =
      cpidx::ref::decode_topk(d.all_heads(), c.sel, plain.out(), nullptr, &plain_err);
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  ASSERT_FALSE(plain.any_poison());
  ASSERT_EQ(plain_err, 0);

  std::vector<cpidx::Geometry> geos(static_cast<size_t>(c.world));
  std::vector<IdsBuffer> ids;
  for (int r = 0; r < c.world; ++r) {
    ASSERT_TRUE(
        cpidx::make_geometry(c.total_heads, c.world, r, &geos[static_cast<size_t>(r)]).is_ok());
    ids.emplace_back(geos[static_cast<size_t>(r)].local_heads, d.rows(), k);
  }
  std::vector<cpidx::Status> status(static_cast<size_t>(c.world));
  std::vector<int32_t> errs(static_cast<size_t>(c.world), 0);
  std::vector<cpidx::ref::CpStageTimes> times(static_cast<size_t>(c.world));
  run_ranks(c.world, [&](int r, cpidx::Communicator& comm) {
    const auto i = static_cast<size_t>(r);
    status[i] =
        cpidx::ref::cp_decode(comm, geos[i], d.inputs(geos[i].head_offset, geos[i].local_heads),
                              c.sel, ids[i].out(), nullptr, &errs[i], &times[i]);
  });
  for (int r = 0; r < c.world; ++r) {
    const auto i = static_cast<size_t>(r);
    ASSERT_TRUE(status[i].is_ok()) << "rank " << r << ": " << status[i].to_string();
    EXPECT_EQ(errs[i], 0) << "rank " << r;
    ASSERT_FALSE(ids[i].any_poison()) << "rank " << r << " left an id unwritten";
    EXPECT_GE(times[i].score_topk_ms, 0.0);
    for (int j = 0; j < geos[i].local_heads; ++j) {
      const int h = geos[i].head_offset + j;
      for (int64_t row = 0; row < d.rows(); ++row) {
        const std::vector<int32_t> want(plain.row(h, row), plain.row(h, row) + k);
        const std::vector<int32_t> got(ids[i].row(j, row), ids[i].row(j, row) + k);
        ASSERT_EQ(got, want) << "rank " << r << " head " << h << " row " << row;
      }
    }
  }
}

const std::vector<int32_t> kMixedLens = {0, 1, 127, 128, 129, 700, 2049, 3000};

TEST(CpDecode, EqualsPlainAllWorldsT4) {
  uint64_t seed = 100;
  for (int world : {1, 2, 4, 8}) {
    for (int q : {1, 4}) {
      expect_cp_equals_plain({4, world, q, kMixedLens, 3072, {16, 0, 1}}, ++seed);
    }
  }
}

TEST(CpDecode, EqualsPlainFewerHeadsThanRanks) {
  expect_cp_equals_plain({1, 4, 1, kMixedLens, 3200, {16, 0, 1}}, 201);
  expect_cp_equals_plain({2, 4, 4, kMixedLens, 3200, {16, 1, 2}}, 202);
  expect_cp_equals_plain({2, 8, 1, {5, 300, 0, 1500}, 1536, {4, 0, 1}}, 203);
  expect_cp_equals_plain({8, 4, 2, {900, 2, 1300}, 1408, {6, 0, 1}}, 204);
}

TEST(CpDecode, EqualsPlainForcedSetsAndTopk) {
  const std::vector<cpidx::Selection> sels = {
      {1, 0, 1}, {4, 1, 2}, {64, 2, 4}, {16, 0, 0}, {6, 3, 1}};
  uint64_t seed = 300;
  for (const auto& sel : sels) {
    expect_cp_equals_plain({4, 4, 2, kMixedLens, 3072, sel}, ++seed);
    expect_cp_equals_plain({4, 8, 1, kMixedLens, 3072, sel}, ++seed);
  }
}

TEST(CpDecode, RanksOwningNoBlock) {
  // One or two blocks in the whole batch: ranks 2..7 score nothing.
  expect_cp_equals_plain({4, 8, 1, {1, 130, 200, 0, 64}, 256, {16, 0, 1}}, 401);
  expect_cp_equals_plain({4, 8, 4, {4, 128, 0}, 128, {16, 0, 1}}, 402);
  expect_cp_equals_plain({1, 8, 1, {1}, 128, {1, 0, 1}}, 403);
  expect_cp_equals_plain({4, 4, 1, {0, 0}, 512, {16, 0, 1}}, 404);  // padding only
}

TEST(CpDecode, TieHeavyValues) {
  uint64_t seed = 500;
  for (int world : {2, 4, 8}) {
    for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
      expect_cp_equals_plain({4, world, 4, kMixedLens, 3072, {16, 0, 1}, dtype, Values::kTies},
                             ++seed);
    }
  }
}

TEST(CpDecode, Fp8Cache) {
  uint64_t seed = 600;
  for (int world : {1, 2, 4, 8}) {
    expect_cp_equals_plain({4, world, 1, kMixedLens, 3072, {16, 0, 1}, DType::kFP8E4M3}, ++seed);
  }
}

TEST(CpDecode, RanksDisagreeOnBatch) {
  const int world = 4;
  const DecodeData d = random_decode(700, 4, 1, {300, 500, 900, 12}, 1024);
  const cpidx::Selection sel{16, 0, 1};
  std::vector<cpidx::Status> status(world);
  std::vector<IdsBuffer> ids;
  for (int r = 0; r < world; ++r) ids.emplace_back(1, d.rows(), sel.topk);
  run_ranks(world, [&](int r, cpidx::Communicator& comm) {
    cpidx::Geometry g;
    cpidx::make_geometry(4, world, r, &g);
    cpidx::DecodeInputs in = d.inputs(g.head_offset, 1);
    in.num_reqs = r == 2 ? 3 : 4;  // rank 2 sees a shorter batch
    status[static_cast<size_t>(r)] = cpidx::ref::cp_decode(
        comm, g, in, sel, ids[static_cast<size_t>(r)].out(), nullptr, nullptr);
  });
  for (int r = 0; r < world; ++r) {
    const auto& s = status[static_cast<size_t>(r)];
    EXPECT_EQ(s.code(), cpidx::StatusCode::kCommError) << "rank " << r << ": " << s.to_string();
    EXPECT_NE(s.message().find("[4, 4, 3, 4]"), std::string::npos) << s.message();
    EXPECT_TRUE(ids[static_cast<size_t>(r)].all_poison()) << "rank " << r;
  }
}

TEST(CpDecode, BadInputOnOneRankFailsEveryRank) {
  const int world = 4;
  const DecodeData d = random_decode(701, 4, 1, {300, 500}, 1024);
  std::vector<cpidx::Status> status(world);
  std::vector<IdsBuffer> ids;
  for (int r = 0; r < world; ++r) ids.emplace_back(1, d.rows(), 16);
  run_ranks(world, [&](int r, cpidx::Communicator& comm) {
    cpidx::Geometry g;
    cpidx::make_geometry(4, world, r, &g);
    cpidx::Selection sel{r == 1 ? 0 : 16, 0, 1};  // rank 1 passes topk 0
    status[static_cast<size_t>(r)] =
        cpidx::ref::cp_decode(comm, g, d.inputs(g.head_offset, 1), sel,
                              ids[static_cast<size_t>(r)].out(), nullptr, nullptr);
  });
  EXPECT_EQ(status[1].code(), cpidx::StatusCode::kInvalidArgument);
  EXPECT_NE(status[1].message().find("topk"), std::string::npos) << status[1].message();
  for (int r : {0, 2, 3}) {
    EXPECT_EQ(status[static_cast<size_t>(r)].code(), cpidx::StatusCode::kCommError)
        << status[static_cast<size_t>(r)].to_string();
  }
  for (const auto& b : ids) EXPECT_TRUE(b.all_poison());
}

TEST(CpDecode, RejectsMismatchedGeometry) {
  const DecodeData d = random_decode(702, 4, 1, {300}, 512);
  std::vector<cpidx::Status> status(2);
  run_ranks(2, [&](int r, cpidx::Communicator& comm) {
    cpidx::Geometry g;
    cpidx::make_geometry(4, 4, r, &g);  // built for 4 ranks, run on 2
    IdsBuffer ids(1, d.rows(), 16);
    status[static_cast<size_t>(r)] =
        cpidx::ref::cp_decode(comm, g, d.inputs(0, 1), {16, 0, 1}, ids.out(), nullptr, nullptr);
  });
  for (const auto& s : status) {
    EXPECT_EQ(s.code(), cpidx::StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("geometry"), std::string::npos) << s.message();
  }
}

// cp_gather_bytes names the two payloads the step gathers, and nothing gathered is larger
// (what a peer communicator for cp_decode must hold per rank).
TEST(CpDecode, GatherBytesAreTheStepsPayloads) {
  uint64_t seed = 800;
  for (auto [T, P, Q, K] : {std::array<int, 4>{4, 2, 1, 16}, std::array<int, 4>{4, 8, 4, 16},
                            std::array<int, 4>{8, 2, 2, 64}, std::array<int, 4>{1, 4, 1, 1}}) {
    SCOPED_TRACE("T " + std::to_string(T) + " P " + std::to_string(P) + " Q " +
                 std::to_string(Q) + " K " + std::to_string(K));
    const DecodeData d = random_decode(++seed, T, Q, {0, 130, 2049}, 2560);
    std::vector<std::vector<size_t>> sizes(static_cast<size_t>(P));
    std::vector<cpidx::Geometry> geos(static_cast<size_t>(P));
    std::vector<cpidx::Status> status(static_cast<size_t>(P));
    run_ranks(P, [&](int r, cpidx::Communicator& comm) {
      const auto i = static_cast<size_t>(r);
      cpidx::make_geometry(T, P, r, &geos[i]);
      IdsBuffer ids(geos[i].local_heads, d.rows(), K);
      RecordingComm rec(comm);
      status[i] = cpidx::ref::cp_decode(rec, geos[i],
                                        d.inputs(geos[i].head_offset, geos[i].local_heads),
                                        {K, 0, 1}, ids.out(), nullptr, nullptr);
      sizes[i] = rec.sizes;
    });
    for (int r = 0; r < P; ++r) {
      const auto i = static_cast<size_t>(r);
      ASSERT_TRUE(status[i].is_ok()) << status[i].to_string();
      const cpidx::CpGatherBytes want = cpidx::cp_gather_bytes(geos[i], d.rows(), K);
      EXPECT_EQ(want.queries, static_cast<size_t>(d.rows()) * geos[i].local_heads * 128 * 2);
      EXPECT_EQ(want.keys, static_cast<size_t>(T) * d.rows() * K * 8);
      const auto& got = sizes[i];
      EXPECT_NE(std::find(got.begin(), got.end(), want.queries), got.end()) << "rank " << r;
      EXPECT_NE(std::find(got.begin(), got.end(), want.keys), got.end()) << "rank " << r;
      EXPECT_EQ(*std::max_element(got.begin(), got.end()), want.larger()) << "rank " << r;
    }
  }
}

// CONTRACT.md section 5.1: of each replica group the lowest rank's query is kept. T = 1, P = 2
// (R = 2): rank 1 passes a negated copy, and both ranks still give rank 0's ids.
TEST(CpDecode, ReplicasKeepTheLowestRanksQuery) {
  const DecodeData d0 = random_decode(5, 1, 1, {1000}, 1024);
  DecodeData d1 = d0;
  for (auto& q : d1.query) q ^= 0x8000;  // the sign bit
  const cpidx::Selection sel{2, 0, 0};
  IdsBuffer want(1, 1, 2);
  ASSERT_TRUE(cpidx::ref::decode_topk(d0.all_heads(), sel, want.out(), nullptr, nullptr).is_ok());
  std::vector<IdsBuffer> got(2, IdsBuffer(1, 1, 2));
  run_ranks(2, [&](int r, cpidx::Communicator& comm) {
    cpidx::Geometry geo;
    ASSERT_TRUE(cpidx::make_geometry(1, 2, r, &geo).is_ok());
    const DecodeData& mine = r == 0 ? d0 : d1;
    EXPECT_TRUE(cpidx::ref::cp_decode(comm, geo, mine.all_heads(), sel,
                                      got[static_cast<size_t>(r)].out(), nullptr, nullptr)
                    .is_ok());
  });
  EXPECT_EQ(got[0].ids, want.ids);
  EXPECT_EQ(got[1].ids, want.ids);
}

}  // namespace
