// select_keys against a brute-force sort written from CONTRACT.md section 4 (comparator on
// (forced score, block), not keys): random and heavily tied scores, forced sets, V below / at
// / above K, full rows and round-robin shards.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "cpidx/reference.h"

namespace {

// Contract order: higher score first, NaN below -inf, +0 == -0, ties -> higher block first.
bool before(float sa, int64_t a, float sb, int64_t b) {
  const bool na = std::isnan(sa), nb = std::isnan(sb);
  if (na != nb) return nb;  // the non-NaN one comes first
  if (!na && sa != sb) return sa > sb;
  return a > b;
}

std::vector<int32_t> brute_force(const std::vector<float>& scores,
                                 const std::vector<int64_t>& blocks, int64_t visible,
                                 const cpidx::Selection& sel) {
  std::vector<std::pair<float, int64_t>> items;
  for (size_t i = 0; i < blocks.size(); ++i) {
    float s = scores[i];
    if (blocks[i] < sel.init_blocks) s = 1e30f;
    if (blocks[i] >= std::max<int64_t>(0, visible - sel.local_blocks)) s = 1e29f;
    items.emplace_back(s, blocks[i]);
  }
  std::sort(items.begin(), items.end(), [](const auto& x, const auto& y) {
    return before(x.first, x.second, y.first, y.second);
  });
  std::vector<int32_t> out(static_cast<size_t>(sel.topk), -1);
  for (size_t i = 0; i < items.size() && i < out.size(); ++i) {
    out[i] = static_cast<int32_t>(items[i].second);
  }
  return out;
}

std::vector<int32_t> selected(const std::vector<float>& scores, const std::vector<int64_t>& blocks,
                              int64_t visible, const cpidx::Selection& sel) {
  std::vector<cpidx::Key> keys(static_cast<size_t>(sel.topk), 0xDEADBEEFull);
  cpidx::ref::select_keys(scores.data(), blocks.data(), static_cast<int64_t>(blocks.size()),
                          visible, sel, keys.data());
  std::vector<int32_t> out;
  for (cpidx::Key k : keys) out.push_back(cpidx::key_is_pad(k) ? -1 : cpidx::key_block(k));
  return out;
}

TEST(SelectKeys, MatchesBruteForce) {
  std::mt19937_64 rng(1234);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const std::vector<std::pair<int, int>> forced = {{0, 1}, {1, 2}, {2, 4}, {0, 0}, {3, 1}};
  int checked = 0;
  for (int topk : {1, 4, 16, 64}) {
    for (auto [init, local] : forced) {
      for (int64_t visible : {int64_t{1}, int64_t{topk - 1}, int64_t{topk}, int64_t{topk + 1},
                              int64_t{3 * topk + 5}, int64_t{300}}) {
        if (visible < 1) continue;
        for (bool ties : {false, true}) {
          for (int world : {1, 3, 4}) {
            for (int rank = 0; rank < world; rank += 2) {
              cpidx::Selection sel{topk, init, local};
              std::vector<int64_t> blocks;
              for (int64_t g = rank; g < visible; g += world) blocks.push_back(g);
              std::vector<float> scores;
              for (size_t i = 0; i < blocks.size(); ++i) {
                scores.push_back(ties ? static_cast<float>(static_cast<int>(rng() % 4) - 2)
                                      : normal(rng));
              }
              if (!ties && scores.size() > 3) {  // edge values among the real scores
                scores[1] = std::numeric_limits<float>::quiet_NaN();
                scores[2] = -0.0f;
                scores[3] = 0.0f;
              }
              ASSERT_EQ(selected(scores, blocks, visible, sel),
                        brute_force(scores, blocks, visible, sel))
                  << "K " << topk << " init " << init << " local " << local << " V " << visible
                  << " world " << world << " rank " << rank << " ties " << ties;
              ++checked;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 500);
}

TEST(SelectKeys, ForcedBlocksAndPadding) {
  // V = 5, K = 4, init 1, local 2: block 0 (1e30), then blocks 4, 3 (1e29, higher id first),
  // then the best real score.
  const std::vector<float> scores = {-5.0f, 2.0f, 9.0f, -1.0f, -7.0f};
  const std::vector<int64_t> blocks = {0, 1, 2, 3, 4};
  EXPECT_EQ(selected(scores, blocks, 5, {4, 1, 2}), (std::vector<int32_t>{0, 4, 3, 2}));
  // A block both init and local ends at 1e29.
  EXPECT_EQ(selected({3.0f}, {0}, 1, {4, 1, 1}), (std::vector<int32_t>{0, -1, -1, -1}));
  EXPECT_EQ(selected({3.0f, 1.0f}, {0, 1}, 2, {2, 2, 2}), (std::vector<int32_t>{1, 0}));
  // No candidates: all padding.
  EXPECT_EQ(selected({}, {}, 0, {3, 0, 1}), (std::vector<int32_t>{-1, -1, -1}));
  // All-NaN scores still fill min(K, V) slots, ties to the higher id.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(selected({nan, nan, nan}, {0, 1, 2}, 3, {4, 0, 0}),
            (std::vector<int32_t>{2, 1, 0, -1}));
}

}  // namespace
