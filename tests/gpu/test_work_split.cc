// tests/gpu/test_work_split.cc: the decode's work split, checked on the host (no GPU needed, so
// it runs in CI). The fused path's (src/cuda/kernels.h): the CTAs' page ranges partition the
// step, and the list slots that select_topk merges for a request spanning CTAs are exactly the
// ones those CTAs wrote in this launch, distinct across requests and inside the workspace. The
// split path's run-time share (src/cuda/work_steal.h, v15): the scoring kernel's producer
// protocol played step by step under random interleavings (some CTAs starting only after the
// others are done, as when SMs are held): every page is claimed once, pages are taken across
// requests too, and the words are reset for the next call.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <vector>

#include "cuda/kernels.h"
#include "cuda/work_steal.h"

namespace {

using cpidx::cuda::cta_of;
using cpidx::cuda::fused_ctas;
using cpidx::cuda::kMinPagesPerCta;
namespace ws = cpidx::cuda;

TEST(FusedWorkSplit, RangesPartitionThePagesAndMergeSlotsWereAllWritten) {
  std::mt19937_64 rng(20261129);
  int checked = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const int grid = 1 + static_cast<int>(rng() % 300);
    const int B = 1 + static_cast<int>(rng() % 80);
    std::vector<int64_t> prefix(static_cast<size_t>(B) + 1, 0);
    for (int r = 0; r < B; ++r) {
      const int kind = static_cast<int>(rng() % 4);  // empty, tiny, or up to 5000 pages
      const int64_t pages = kind == 0 ? 0 : kind == 1 ? 1 + static_cast<int64_t>(rng() % 3)
                                                      : static_cast<int64_t>(rng() % 5000);
      prefix[r + 1] = prefix[r] + pages;
    }
    const int64_t total = prefix[B];
    if (total == 0) continue;
    const int64_t g = fused_ctas(total, grid);
    ASSERT_GE(g, 1);
    ASSERT_LE(g, grid);
    if (total >= kMinPagesPerCta * static_cast<int64_t>(grid)) ASSERT_EQ(g, grid);

    // CTA c scores [c * total / g, (c + 1) * total / g): contiguous, non-empty, covering.
    std::vector<int64_t> begin(static_cast<size_t>(g) + 1);
    for (int64_t c = 0; c <= g; ++c) begin[c] = c * total / g;
    ASSERT_EQ(begin[0], 0);
    ASSERT_EQ(begin[g], total);
    for (int64_t c = 0; c < g; ++c) ASSERT_LT(begin[c], begin[c + 1]) << "empty CTA range";
    // cta_of(x) names the range that holds page x.
    for (int k = 0; k < 50; ++k) {
      const int64_t x = static_cast<int64_t>(rng() % total);
      const int64_t c = cta_of(x, total, g);
      ASSERT_TRUE(c >= 0 && c < g && begin[c] <= x && x < begin[c + 1]) << "x " << x;
    }

    // Lists written: CTA c's of each column, for each request r it scores part of, when r spans
    // CTAs, at partial_index(col, c + r, ...) (score_topk's store); every one inside the call's
    // partial_slots and none written twice.
    const int cols = 1 + static_cast<int>(rng() % 3), K = 1 + static_cast<int>(rng() % 64);
    const int64_t slots = cpidx::cuda::partial_slots(grid, B);
    const int64_t elems = cpidx::cuda::partial_index(cols, 0, slots, K);
    std::set<int64_t> written;
    for (int r = 0; r < B; ++r) {
      if (prefix[r + 1] == prefix[r]) continue;
      const int64_t c0 = cta_of(prefix[r], total, g), c1 = cta_of(prefix[r + 1] - 1, total, g);
      if (c0 == c1) continue;  // finished inside one CTA, nothing to merge
      for (int64_t c = 0; c < g; ++c) {
        const bool scores_part =
            std::max(begin[c], prefix[r]) < std::min(begin[c + 1], prefix[r + 1]);
        if (!scores_part) continue;
        for (int col = 0; col < cols; ++col) {
          const int64_t at = cpidx::cuda::partial_index(col, c + r, slots, K);
          ASSERT_TRUE(at >= 0 && at + K <= elems) << "list past the call's slots";
          ASSERT_TRUE(written.insert(at).second) << "list at " << at << " written twice";
        }
      }
      // select_topk reads each column's (c1 - c0 + 1) * K keys from partial_index(col, c0 + r,
      // ...) on: every list of them was written by this launch.
      for (int col = 0; col < cols; ++col) {
        const int64_t first = cpidx::cuda::partial_index(col, c0 + r, slots, K);
        for (int64_t i = 0; i <= c1 - c0; ++i) {
          ASSERT_TRUE(written.count(first + i * K)) << "stale list at " << first + i * K;
        }
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, 1000);  // the random batches did split many requests
}

// One scoring CTA's producer in the split path's shared ranges (page_producer.cuh, produce()),
// one step per memory operation on the words, so that a scheduler can interleave CTAs.
struct StealSim {
  int64_t total = 0, ctas = 0;
  std::vector<int64_t> prefix;         // requests' page offsets
  std::vector<unsigned long long> words;  // [ctas + 1], as in the workspace
  std::vector<int> claims;             // per page, this call
  int64_t taken = 0, taken_across = 0, started_by_others = 0, lost_races = 0, dry_takes = 0,
          late_owned = 0;

  int request_of(int64_t x) const {
    return static_cast<int>(std::upper_bound(prefix.begin(), prefix.end(), x) - prefix.begin()) - 1;
  }
};

struct StealCta {
  enum Phase { kStart, kOwn, kLook, kTake, kDone } phase = kStart;
  int64_t self = 0, start = 0, end = 0, front = 0, back = 0, last = -1;
  int64_t victim = 0, vf = 0, vb = 0, take = 0;  // the chosen steal
  unsigned long long seen = 0;
  bool late = false;  // its range was started by a taker

  void claim(StealSim& sim, int64_t from, int64_t to, bool stolen) {
    for (int64_t x = from; x < to; ++x) {
      ASSERT_TRUE(x >= 0 && x < sim.total) << "page " << x;
      ++sim.claims[static_cast<size_t>(x)];
      // A page of another request than the taker's last: its consumers load new queries.
      if (stolen && last >= 0 && sim.request_of(x) != sim.request_of(last)) ++sim.taken_across;
    }
    if (to > from) last = to - 1;
  }
  // One step (kDone once the CTA is done with the words).
  void step(StealSim& sim) {
    unsigned long long& mine = sim.words[static_cast<size_t>(self)];
    switch (phase) {
      case kStart: {
        front = start + ws::own_chunk(end - start);
        back = end;
        const unsigned long long old = mine;
        if (old == ws::kUnstarted) {
          mine = ws::pack_range(front, back);
          claim(sim, start, front, false);
        } else {
          ++sim.started_by_others;
          late = true;
          front = ws::range_front(old);
          back = ws::range_back(old);
        }
        phase = kOwn;
        break;
      }
      case kOwn: {
        if (front >= back) { phase = kLook; break; }
        const int64_t c = ws::owner_chunk(front, back, end);
        const unsigned long long old = mine;
        mine += static_cast<unsigned long long>(c);  // atomicAdd
        front = ws::range_front(old);
        back = ws::range_back(old);
        if (front >= back) { phase = kLook; break; }
        claim(sim, front, std::min(front + c, back), false);
        if (late) sim.late_owned += std::min(front + c, back) - front;
        front += c;
        break;
      }
      case kLook: {  // every lane reads its CTA's word; the lane that sees the most takes
        int64_t best = 0;
        for (int lane = 0; lane < ws::kStealLanes; ++lane) {
          const int64_t v = ws::steal_victim(self, lane, sim.ctas);
          const bool can = ws::in_grid(v, sim.ctas);
          const unsigned long long w = can ? sim.words[static_cast<size_t>(v)] : 0;
          int64_t f = 0, b = 0;
          ws::unclaimed(w, v, sim.total, sim.ctas, &f, &b);
          const int64_t avail = ws::stealable(can, f, b);
          if (avail > best) { best = avail; victim = v; seen = w; vf = f; vb = b; }
        }
        if (best == 0) { phase = kDone; break; }
        take = ws::steal_take(best);
        phase = kTake;
        break;
      }
      case kTake: {  // compare-and-swap on the value read to start it, else subtract
        unsigned long long& w = sim.words[static_cast<size_t>(victim)];
        if (seen == ws::kUnstarted) {
          if (w == seen) {
            w = ws::pack_range(vf, vb - take);
            ++sim.started_by_others;
            sim.taken += take;
            claim(sim, vb - take, vb, true);
          } else {
            ++sim.lost_races;
          }
        } else {
          const unsigned long long old = w;
          w += ws::steal_delta(take);  // atomicAdd
          int64_t lo = 0, hi = 0;
          if (ws::stolen_range(old, take, &lo, &hi)) {
            if (ws::range_front(w) != ws::range_front(old)) {
              ADD_FAILURE() << "the subtraction moved the front";
            }
            sim.taken += hi - lo;
            claim(sim, lo, hi, true);
          } else {
            ++sim.dry_takes;
          }
        }
        phase = kLook;
        break;
      }
      case kDone:
        break;
    }
  }
};

TEST(SplitWorkStealing, EveryPageClaimedOnceWhateverTheInterleaving) {
  std::mt19937_64 rng(20261130);
  StealSim totals;
  for (int trial = 0; trial < 300; ++trial) {
    StealSim sim;
    sim.ctas = 1 + static_cast<int64_t>(rng() % 300);
    sim.words.assign(static_cast<size_t>(sim.ctas) + 1, ws::kUnstarted);
    sim.words.back() = 0;
    for (int call = 0; call < 3; ++call) {  // the words carry over between calls
      // Requests of 0 to ~2x the CTAs' share, at least 16 pages a CTA in all.
      const int B = 1 + static_cast<int>(rng() % 12);
      sim.prefix.assign(1, 0);
      for (int r = 0; r < B; ++r) {
        const int64_t pages = rng() % 5 == 0 ? 0 : static_cast<int64_t>(rng() % (40 * sim.ctas));
        sim.prefix.push_back(sim.prefix.back() + pages);
      }
      if (sim.prefix.back() < ws::kMinStealShare * sim.ctas) {
        sim.prefix.back() = ws::kMinStealShare * sim.ctas + static_cast<int64_t>(rng() % 100);
      }
      sim.total = sim.prefix.back();
      ASSERT_TRUE(ws::steals(true, true, sim.total, static_cast<int>(sim.ctas)));
      sim.claims.assign(static_cast<size_t>(sim.total), 0);
      std::vector<StealCta> ctas(static_cast<size_t>(sim.ctas));
      std::vector<bool> late(ctas.size());
      for (int64_t c = 0; c < sim.ctas; ++c) {
        StealCta& t = ctas[static_cast<size_t>(c)];
        t.self = c;
        t.start = c * sim.total / sim.ctas;
        t.end = (c + 1) * sim.total / sim.ctas;
        late[static_cast<size_t>(c)] = call >= 1 && rng() % 2 == 0;
      }
      // Run: pick a CTA not done at random, one step; a CTA done counts out, and the last one
      // resets the words. The late ones start in call 1 once the others are done, in call 2 once
      // one of them is (as on the GPU, where a CTA without room takes the first freed slot):
      // their owners then claim beside the takers.
      std::vector<size_t> running, later;
      for (size_t i = 0; i < ctas.size(); ++i) (late[i] ? later : running).push_back(i);
      size_t done = 0;
      while (!running.empty() || !later.empty()) {
        if (!later.empty() && (running.empty() || (call == 2 && done > 0))) {
          running.insert(running.end(), later.begin(), later.end());
          later.clear();
        }
        const size_t k = static_cast<size_t>(rng() % running.size());
        StealCta& t = ctas[running[k]];
        t.step(sim);
        if (::testing::Test::HasFatalFailure()) return;
        if (t.phase != StealCta::kDone) continue;
        running[k] = running.back();
        running.pop_back();
        ++done;
        if (++sim.words.back() == static_cast<unsigned long long>(sim.ctas)) {
          for (int64_t c = 0; c < sim.ctas; ++c) sim.words[static_cast<size_t>(c)] = ws::kUnstarted;
          sim.words.back() = 0;
        }
      }
      for (int64_t x = 0; x < sim.total; ++x) {
        ASSERT_EQ(sim.claims[static_cast<size_t>(x)], 1) << "page " << x << " of " << sim.total
                                                         << ", " << sim.ctas << " CTAs";
      }
      for (size_t c = 0; c + 1 < sim.words.size(); ++c) ASSERT_EQ(sim.words[c], ws::kUnstarted);
      ASSERT_EQ(sim.words.back(), 0u);
    }
    totals.taken += sim.taken;
    totals.taken_across += sim.taken_across;
    totals.started_by_others += sim.started_by_others;
    totals.lost_races += sim.lost_races;
    totals.dry_takes += sim.dry_takes;
    totals.late_owned += sim.late_owned;
  }
  // The interleavings did exercise each branch: pages taken (of other requests too), ranges
  // started by a taker (late owners), starts lost to a concurrent claim, subtractions that
  // found the range dry (takers together past its front), and pages late owners claimed beside
  // the takers.
  EXPECT_GT(totals.taken, 1000);
  EXPECT_GT(totals.taken_across, 100);
  EXPECT_GT(totals.started_by_others, 100);
  EXPECT_GT(totals.lost_races, 10);
  EXPECT_GT(totals.dry_takes, 10);
  EXPECT_GT(totals.late_owned, 100);
}

}  // namespace
