// Geometry of CONTRACT.md section 1 (local heads, replicas, head offsets, rejected pairs) and
// the Status / DType text.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cpidx/contract.h"
#include "cpidx/status.h"

namespace {

using cpidx::Geometry;
using cpidx::make_geometry;

struct GeometryRow {
  int total_heads, world, local_heads, replicas;
  std::vector<int> offsets;  // head_offset of rank 0..world-1
};

TEST(Geometry, TableOfValidPairs) {
  const std::vector<GeometryRow> table = {
      {4, 1, 4, 1, {0}},          {4, 2, 2, 1, {0, 2}},
      {4, 4, 1, 1, {0, 1, 2, 3}}, {4, 8, 1, 2, {0, 0, 1, 1, 2, 2, 3, 3}},
      {1, 1, 1, 1, {0}},          {1, 2, 1, 2, {0, 0}},
      {1, 4, 1, 4, {0, 0, 0, 0}}, {1, 8, 1, 8, {0, 0, 0, 0, 0, 0, 0, 0}},
      {2, 1, 2, 1, {0}},          {2, 2, 1, 1, {0, 1}},
      {2, 4, 1, 2, {0, 0, 1, 1}}, {2, 8, 1, 4, {0, 0, 0, 0, 1, 1, 1, 1}},
      {8, 1, 8, 1, {0}},          {8, 2, 4, 1, {0, 4}},
      {8, 4, 2, 1, {0, 2, 4, 6}}, {8, 8, 1, 1, {0, 1, 2, 3, 4, 5, 6, 7}},
      {6, 2, 3, 1, {0, 3}},       {2, 6, 1, 3, {0, 0, 0, 1, 1, 1}},
  };
  for (const auto& row : table) {
    for (int r = 0; r < row.world; ++r) {
      Geometry g;
      const cpidx::Status s = make_geometry(row.total_heads, row.world, r, &g);
      ASSERT_TRUE(s.is_ok()) << s.to_string();
      EXPECT_EQ(g.total_heads, row.total_heads);
      EXPECT_EQ(g.world_size, row.world);
      EXPECT_EQ(g.rank, r);
      EXPECT_EQ(g.local_heads, row.local_heads) << "T=" << row.total_heads << " P=" << row.world;
      EXPECT_EQ(g.replicas, row.replicas) << "T=" << row.total_heads << " P=" << row.world;
      EXPECT_EQ(g.head_offset, row.offsets[static_cast<size_t>(r)])
          << "T=" << row.total_heads << " P=" << row.world << " r=" << r;
    }
  }
}

TEST(Geometry, RejectsPairsThatDoNotDivide) {
  const std::vector<std::pair<int, int>> bad = {{3, 2}, {4, 3}, {4, 6}, {8, 3}, {8, 12},
                                                {2, 3}, {6, 4}, {8, 6}, {3, 8}, {5, 2}};
  for (auto [t, p] : bad) {
    Geometry g;
    g.local_heads = 77;
    const cpidx::Status s = make_geometry(t, p, 0, &g);
    ASSERT_FALSE(s.is_ok()) << "T=" << t << " P=" << p;
    EXPECT_EQ(s.code(), cpidx::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("total_heads (" + std::to_string(t) + ")"), std::string::npos)
        << s.message();
    EXPECT_NE(s.message().find("world_size (" + std::to_string(p) + ")"), std::string::npos)
        << s.message();
    EXPECT_EQ(g.local_heads, 77) << "output written on failure";
  }
}

TEST(Geometry, RejectsOutOfRangeValues) {
  struct Bad {
    int t, p, r;
    const char* needle;
  };
  const std::vector<Bad> bad = {{0, 1, 0, "total_heads"},  {9, 1, 0, "total_heads"},
                                {-1, 1, 0, "total_heads"}, {4, 0, 0, "world_size"},
                                {4, -2, 0, "world_size"},  {4, 4, 4, "rank"},
                                {4, 4, -1, "rank"}};
  for (const auto& b : bad) {
    Geometry g;
    const cpidx::Status s = make_geometry(b.t, b.p, b.r, &g);
    ASSERT_FALSE(s.is_ok()) << b.t << " " << b.p << " " << b.r;
    EXPECT_NE(s.message().find(b.needle), std::string::npos) << s.message();
  }
  EXPECT_FALSE(make_geometry(4, 4, 0, nullptr).is_ok());
}

TEST(StatusText, NamesCodeAndMessage) {
  EXPECT_EQ(cpidx::Status::ok().to_string(), "ok");
  const cpidx::Status s = cpidx::invalid_argument("topk must be in [1, 64], got 0");
  EXPECT_EQ(s.to_string(), "invalid argument: topk must be in [1, 64], got 0");
  EXPECT_FALSE(static_cast<bool>(s));
  EXPECT_STREQ(cpidx::to_string(cpidx::StatusCode::kCommError), "communicator error");
  EXPECT_STREQ(cpidx::to_string(cpidx::StatusCode::kUnsupported), "unsupported");
  EXPECT_STREQ(cpidx::to_string(cpidx::DType::kBF16), "bf16");
  EXPECT_STREQ(cpidx::to_string(cpidx::DType::kFP8E4M3), "fp8_e4m3");
}

}  // namespace
