// tests/gpu/test_graph_holds.cc: the destructors' grace (src/cuda/graph_holds.h), checked on the
// host (no GPU needed, so it runs in CI). A destructor waits one full grace for graphs destroyed
// just before it; within a grace of another wait that ran out with launches held (a burst of
// objects that live graphs still hold: interpreter exit, a registry cleared) the short one.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <memory>

#include "cuda/graph_holds.h"

namespace {

using cpidx::cuda_host::GraphHolds;

constexpr int64_t kFullNs = static_cast<int64_t>(GraphHolds::kDestroyGraceSeconds * 1e9);

TEST(GraphHolds, GraceIsFullUnlessAnotherWaitRanOutWithinOneGrace) {
  static_assert(GraphHolds::kBurstGraceSeconds < GraphHolds::kDestroyGraceSeconds);
  const int64_t now = 5'000'000'000'000;  // any steady-clock time
  EXPECT_EQ(GraphHolds::destroy_grace(now, 0), GraphHolds::kDestroyGraceSeconds) << "never";
  EXPECT_EQ(GraphHolds::destroy_grace(now, now), GraphHolds::kBurstGraceSeconds);
  EXPECT_EQ(GraphHolds::destroy_grace(now, now - kFullNs), GraphHolds::kBurstGraceSeconds);
  EXPECT_EQ(GraphHolds::destroy_grace(now, now - kFullNs - 1), GraphHolds::kDestroyGraceSeconds);
  EXPECT_EQ(GraphHolds::destroy_grace(now, now - 3600 * int64_t{1'000'000'000}),
            GraphHolds::kDestroyGraceSeconds);
}

TEST(GraphHolds, AHeldObjectsWaitMarksTheBurstAndAFreeOnesDoesNot) {
  // A count no graph will release: the objects a live graph still holds.
  auto held_count = std::make_shared<std::atomic<long long>>(2);
  GraphHolds held;
  ASSERT_TRUE(held.adopt(held_count));
  GraphHolds free_holds;

  const int64_t before = GraphHolds::last_run_out_ns();
  double grace = -1;
  EXPECT_EQ(free_holds.wait_on_destroy(&grace), 0) << "nothing held: no wait";
  EXPECT_EQ(grace, 0);
  EXPECT_EQ(GraphHolds::last_run_out_ns(), before) << "a free object marks no burst";

  EXPECT_EQ(held.wait_on_destroy(&grace), 2) << "held through the grace";
  EXPECT_GT(grace, 0);
  const int64_t mark = GraphHolds::last_run_out_ns();
  EXPECT_GT(mark, before);

  // The next held object's destructor, right after (far within one grace of the mark).
  EXPECT_EQ(held.wait_on_destroy(&grace), 2) << "a second held object in the burst";
  EXPECT_EQ(grace, GraphHolds::kBurstGraceSeconds) << "the short grace";
  EXPECT_GE(GraphHolds::last_run_out_ns(), mark) << "the burst goes on from the later wait";

  held_count->store(0);  // the graphs released
  EXPECT_EQ(held.wait_on_destroy(&grace), 0);
  EXPECT_EQ(grace, 0) << "a released count returns at once";
}

// Registry.clear() asks each dropped object for its count (with what is left of one grace)
// before dropping them: that wait running out starts the burst too, so their destructors then
// wait the short grace. A zero wait (a plain query) marks nothing.
TEST(GraphHolds, AQueryWhoseWaitRunsOutMarksTheBurstAndAZeroWaitDoesNot) {
  auto held_count = std::make_shared<std::atomic<long long>>(1);
  GraphHolds held;
  ASSERT_TRUE(held.adopt(held_count));

  const int64_t before = GraphHolds::last_run_out_ns();
  EXPECT_EQ(held.wait_for_release(0), 1);
  EXPECT_EQ(GraphHolds::last_run_out_ns(), before) << "a zero wait marks no burst";

  EXPECT_EQ(held.wait_for_release(0.001), 1);
  EXPECT_GT(GraphHolds::last_run_out_ns(), before) << "a wait that ran out marks the burst";
  double grace = -1;
  EXPECT_EQ(held.wait_on_destroy(&grace), 1);
  EXPECT_EQ(grace, GraphHolds::kBurstGraceSeconds) << "the destructor right after it";
}

}  // namespace
