// tests/gpu/test_rank_topk.cc: the context-parallel merge's rank counting (src/cuda/rank_topk.h,
// merge.cu's warp_rank_topk), checked on the host (no GPU needed, so it runs in CI): its 32 lanes
// run one after another, as the warp would run them, over candidate lists of every count the
// merge takes (P x K up to 8 x 64), against std::sort. The slots past the list (but the pad an odd
// count leaves) and the output past K are poisoned, so a read or a write out of bounds shows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cpidx/contract.h"
#include "cuda/rank_topk.h"

namespace {

using cpidx::Key;
using cpidx::kPadKey;

constexpr int kMaxCand = 8 * 64;    // the merge's P x K at most
constexpr Key kPoison = ~Key{0};    // above every key: ranks it touches would shift
constexpr int kGuard = 8;           // output slots past K that must stay untouched

// The warp's result: lanes 0-31 (or 31-0) in turn, over `fill` in every output slot.
template <bool kTies = false>
std::vector<Key> run_warp(const std::vector<Key>& cand, int count, int k, bool reverse,
                          Key fill = kPoison - 1) {
  std::vector<Key> out(static_cast<size_t>(k + kGuard), fill);
  for (int l = 0; l < 32; ++l) {
    cpidx::cuda::warp_rank_topk<kTies>(cand.data(), count, k, out.data(), reverse ? 31 - l : l);
  }
  return out;
}

// The list as merge_item leaves it: count unique real keys, a pad after an odd count, poison
// beyond.
std::vector<Key> candidates(const std::vector<Key>& keys) {
  std::vector<Key> cand(kMaxCand + 2, kPoison);
  std::copy(keys.begin(), keys.end(), cand.begin());
  if (keys.size() % 2 == 1) cand[keys.size()] = kPadKey;
  return cand;
}

template <bool kTies = false>
void expect_top_k(const std::vector<Key>& keys, int k, const std::string& what) {
  const int count = static_cast<int>(keys.size());
  std::vector<Key> want = keys;
  std::sort(want.begin(), want.end(), std::greater<Key>());
  want.resize(static_cast<size_t>(k), kPadKey);
  const std::vector<Key> cand = candidates(keys);
  for (bool reverse : {false, true}) {
    const std::vector<Key> out = run_warp<kTies>(cand, count, k, reverse);
    for (int i = 0; i < k; ++i) {
      ASSERT_EQ(out[static_cast<size_t>(i)], want[static_cast<size_t>(i)])
          << what << ": slot " << i << " of K = " << k << ", count " << count
          << (reverse ? ", lanes 31-0" : ", lanes 0-31");
    }
    for (int i = k; i < k + kGuard; ++i) {
      ASSERT_EQ(out[static_cast<size_t>(i)], kPoison - 1) << what << ": wrote slot " << i;
    }
  }
}

// n unique real keys: random 64-bit values, or packed (score, block id) keys whose scores are
// drawn from only a few values, so most keys differ in the id's bits alone.
std::vector<Key> unique_keys(std::mt19937_64& rng, int n, bool few_scores) {
  std::vector<Key> keys;
  std::uniform_int_distribution<Key> any(1, kPoison - 2);
  std::uniform_int_distribution<uint32_t> score(0, 3);
  while (static_cast<int>(keys.size()) < n) {
    const Key key = few_scores
                        ? (static_cast<Key>(0x40000000u + score(rng)) << 32) | (rng() & 0xFFFFFu)
                        : any(rng);
    if (std::find(keys.begin(), keys.end(), key) == keys.end()) keys.push_back(key);
  }
  return keys;
}

TEST(RankTopK, EveryCountAndKAgainstSort) {
  std::mt19937_64 rng(29);
  for (int count = 0; count <= 130; ++count) {  // one and two groups, both group sizes, odd
    for (int k : {1, 4, 16, 31, 32, 33, 64}) {
      expect_top_k(unique_keys(rng, count, count % 3 == 0), k, "random");
    }
  }
}

TEST(RankTopK, TheMergesListLengths) {
  std::mt19937_64 rng(31);
  for (int P : {2, 4, 8}) {
    for (int K : {1, 16, 32, 64}) {
      for (int pads : {0, 1, K / 2, K}) {  // lists with fewer than K real keys (short requests)
        const int count = P * K - pads;
        for (bool few : {false, true}) {
          expect_top_k(unique_keys(rng, count, few), K,
                       "P = " + std::to_string(P) + ", " + std::to_string(pads) + " pads");
        }
      }
    }
  }
}

TEST(RankTopK, DescendingAndAscendingLists) {
  // Every key's rank is its place in the list or its mirror: the extremes of the counts.
  for (int count : {31, 32, 33, 63, 64, 65, 127, 128, 129, 511, 512}) {
    std::vector<Key> keys(static_cast<size_t>(count));
    for (int i = 0; i < count; ++i) keys[static_cast<size_t>(i)] = static_cast<Key>(1000 + i);
    expect_top_k(keys, 16, "ascending");
    std::reverse(keys.begin(), keys.end());
    expect_top_k(keys, 64, "descending");
  }
}

// Equal keys (which only a corrupted gather holds): the merge's first ranking gives them one rank
// and leaves the slots after it as they were, where the merge looks for its pads, and the ranking
// with ties (its second) writes them all, in order, as std::sort.
TEST(RankTopK, EqualKeysLeaveSlotsThatTheRankingWithTiesFills) {
  std::mt19937_64 rng(37);
  for (int count : {2, 3, 17, 32, 33, 64, 65, 128, 512}) {
    for (int k : {1, 2, 16, 64}) {
      std::vector<Key> keys = unique_keys(rng, count, true);
      keys[static_cast<size_t>(1 + rng() % (count - 1))] = keys[0];  // a key twice at least
      for (Key& key : keys) {
        if (rng() % 4 == 0) key = keys[static_cast<size_t>(rng() % count)];
      }
      const std::string what = "count " + std::to_string(count) + ", K = " + std::to_string(k);
      expect_top_k<true>(keys, k, "ties, " + what);
      std::vector<Key> sorted = keys;
      std::sort(sorted.begin(), sorted.end(), std::greater<Key>());
      const int filled = std::min(count, k);
      const bool repeats_in_top = std::adjacent_find(sorted.begin(), sorted.begin() + filled) !=
                                  sorted.begin() + filled;
      const std::vector<Key> untied = run_warp(candidates(keys), count, k, false, kPadKey);
      const bool pad_left =
          std::find(untied.begin(), untied.begin() + filled, kPadKey) != untied.begin() + filled;
      EXPECT_EQ(pad_left, repeats_in_top) << what;
    }
  }
}

}  // namespace
