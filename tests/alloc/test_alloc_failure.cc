// Allocations that fail inside the CPU reference's context-parallel decode, on one rank: every
// rank returns an error (none waits forever in a collective, none ends the process) and writes
// no id, and the communicator stays usable. The failures are injected by replacing the global
// operator new, so this suite is its own executable; under AddressSanitizer, whose allocator
// the replacement would stand in front of, it is built without the hook and skips.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include "cpidx/reference.h"
#include "test_util.h"

namespace {

// An allocation of exactly this many bytes fails: on any thread (global), or on the thread
// that set it (thread_local). 0: none.
std::atomic<size_t> g_fail_size{0};
thread_local size_t t_fail_size = 0;
std::atomic<int> g_failures{0};

}  // namespace

#if defined(__SANITIZE_ADDRESS__)
#define CPIDX_ALLOC_HOOK 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CPIDX_ALLOC_HOOK 0
#endif
#endif
#ifndef CPIDX_ALLOC_HOOK
#define CPIDX_ALLOC_HOOK 1
#endif
constexpr bool kHooked = CPIDX_ALLOC_HOOK;

#if CPIDX_ALLOC_HOOK
void* operator new(size_t bytes) {
  if (bytes != 0 && (bytes == g_fail_size.load() || bytes == t_fail_size)) {
    ++g_failures;
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(bytes != 0 ? bytes : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
#endif

namespace {

using namespace cpidx_test;

constexpr int kWorld = 2;
constexpr int kHeads = 8;  // 4 a rank
constexpr int kQ = 4;
constexpr int32_t kMaxSeqLen = 20480;
const cpidx::Selection kSel{16, 1, 1};

struct Step {
  std::vector<cpidx::Status> status = std::vector<cpidx::Status>(kWorld);
  std::vector<IdsBuffer> ids;
};

// One cp_decode on every rank; `on_rank(r)` runs on rank r's thread before its call. An
// exception out of cp_decode is a failure of the test, not of the process.
Step run_step(const DecodeData& d, const std::function<void(int)>& on_rank) {
  Step step;
  for (int r = 0; r < kWorld; ++r) step.ids.emplace_back(kHeads / kWorld, d.rows(), kSel.topk);
  run_ranks(kWorld, [&](int r, cpidx::Communicator& comm) {
    const auto i = static_cast<size_t>(r);
    cpidx::Geometry g;
    cpidx::make_geometry(kHeads, kWorld, r, &g);
    on_rank(r);
    try {
      step.status[i] = cpidx::ref::cp_decode(comm, g, d.inputs(g.head_offset, g.local_heads),
                                             kSel, step.ids[i].out(), nullptr, nullptr);
    } catch (const std::exception& e) {
      step.status[i] = cpidx::Status(cpidx::StatusCode::kInternal,
                                     std::string("exception out of cp_decode: ") + e.what());
    }
    t_fail_size = 0;
  });
  return step;
}

// The step again without failures equals the plain decode, on every rank.
void expect_a_clean_step_after(const DecodeData& d) {
  IdsBuffer plain(kHeads, d.rows(), kSel.topk);
  ASSERT_TRUE(cpidx::ref::decode_topk(d.all_heads(), kSel, plain.out(), nullptr, nullptr).is_ok());
  const Step again = run_step(d, [](int) {});
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(again.status[static_cast<size_t>(r)].is_ok())
        << again.status[static_cast<size_t>(r)].to_string();
    const IdsBuffer& mine = again.ids[static_cast<size_t>(r)];
    for (int j = 0; j < mine.heads; ++j) {
      for (int64_t row = 0; row < d.rows(); ++row) {
        const int h = r * mine.heads + j;
        EXPECT_TRUE(std::equal(mine.row(j, row), mine.row(j, row) + kSel.topk, plain.row(h, row)))
            << "rank " << r << " head " << h << " row " << row;
      }
    }
  }
}

// Rank 1 cannot allocate its gather buffers: it offers -1 to the row agreement, so rank 0 fails
// there too instead of waiting in the query gather.
TEST(AllocFailure, GatherBuffersOnOneRankFailEveryRank) {
  if (!kHooked) GTEST_SKIP() << "operator new is not replaced under AddressSanitizer";
  const DecodeData d = random_decode(fresh_seed(), kHeads, kQ, {9000, 20000, 130}, kMaxSeqLen);
  // The query gather buffer: n rows x 4 local heads x 128 x 2 ranks, bf16.
  const size_t q_gathered = static_cast<size_t>(d.rows()) * (kHeads / kWorld) * kD * kWorld * 2;
  g_failures = 0;
  const Step step = run_step(d, [&](int r) { t_fail_size = r == 1 ? q_gathered : 0; });
  ASSERT_EQ(g_failures.load(), 1) << "the injected failure did not happen";
  EXPECT_EQ(step.status[1].code(), cpidx::StatusCode::kInternal) << step.status[1].to_string();
  EXPECT_NE(step.status[1].message().find("could not allocate the step's gather buffers"),
            std::string::npos)
      << step.status[1].message();
  EXPECT_EQ(step.status[0].code(), cpidx::StatusCode::kCommError) << step.status[0].to_string();
  EXPECT_NE(step.status[0].message().find("values by rank [12, -1]"), std::string::npos)
      << step.status[0].message();
  for (const IdsBuffer& ids : step.ids) EXPECT_TRUE(ids.all_poison());
  expect_a_clean_step_after(d);
}

// Rank 1's scoring cannot allocate a request's score buffer (on a worker thread when the
// reference spreads its requests over several): the ranks agree on the scoring before the key
// gather, so rank 0 fails there instead of waiting for rank 1's keys.
TEST(AllocFailure, ScoringOnOneRankFailsEveryRank) {
  if (!kHooked) GTEST_SKIP() << "operator new is not replaced under AddressSanitizer";
  // Three requests of 20,000 tokens: 157 blocks, 79 on rank 0 and 78 on rank 1, so the
  // per-request score buffers (Q x T x slots floats) differ between the ranks.
  const DecodeData d = random_decode(fresh_seed(), kHeads, kQ, {20000, 20000, 20000}, kMaxSeqLen);
  const size_t rank1_buffer = static_cast<size_t>(kQ) * kHeads * 78 * sizeof(float);
  g_failures = 0;
  g_fail_size = rank1_buffer;
  const Step step = run_step(d, [](int) {});
  g_fail_size = 0;
  ASSERT_GE(g_failures.load(), 1) << "the injected failure did not happen";
  EXPECT_EQ(step.status[1].code(), cpidx::StatusCode::kInternal) << step.status[1].to_string();
  EXPECT_EQ(step.status[1].message(), "cp_decode: scoring failed: std::bad_alloc");
  EXPECT_EQ(step.status[0].code(), cpidx::StatusCode::kCommError) << step.status[0].to_string();
  EXPECT_NE(step.status[0].message().find("shard scoring (-1: failed on that rank): values by "
                                          "rank [0, -1]"),
            std::string::npos)
      << step.status[0].message();
  for (const IdsBuffer& ids : step.ids) EXPECT_TRUE(ids.all_poison());
  expect_a_clean_step_after(d);
}

}  // namespace
