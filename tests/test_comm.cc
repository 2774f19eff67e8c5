// The thread communicator: all_gather in and out of place over many generations, mismatched
// sizes and null buffers on any rank as errors on every rank (no hang, no recv written), the
// barrier, check_agree and check_agree_all, and the defaults of a device-memory communicator.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpidx/comm.h"
#include "test_util.h"

namespace {

using cpidx_test::fresh_seed;
using cpidx_test::run_ranks;

TEST(ThreadComm, AllGatherInAndOutOfPlace) {
  for (int world : {1, 2, 3, 8}) {
    run_ranks(world, [&](int r, cpidx::Communicator& comm) {
      EXPECT_EQ(comm.rank(), r);
      EXPECT_EQ(comm.world_size(), world);
      EXPECT_EQ(comm.memory_space(), cpidx::MemorySpace::kHost);
      for (int round = 0; round < 20; ++round) {
        const size_t bytes = static_cast<size_t>(1 + round * 13);
        std::vector<unsigned char> send(bytes), recv(bytes * world, 0xEE);
        for (size_t i = 0; i < bytes; ++i) send[i] = static_cast<unsigned char>(r * 31 + round + i);
        const bool in_place = round % 2 == 1;
        if (in_place) std::memcpy(recv.data() + bytes * r, send.data(), bytes);
        const void* src = in_place ? recv.data() + bytes * r : send.data();
        ASSERT_TRUE(comm.all_gather(src, recv.data(), bytes, nullptr).is_ok());
        for (int w = 0; w < world; ++w) {
          for (size_t i = 0; i < bytes; ++i) {
            ASSERT_EQ(recv[bytes * w + i], static_cast<unsigned char>(w * 31 + round + i))
                << "world " << world << " rank " << r << " round " << round;
          }
        }
      }
      EXPECT_TRUE(comm.barrier().is_ok());
    });
  }
}

TEST(ThreadComm, MismatchedSizesAndNullBuffersFailEveryRank) {
  const int world = 4;
  std::vector<cpidx::Status> sizes(world), nulls(world), after(world);
  run_ranks(world, [&](int r, cpidx::Communicator& comm) {
    std::vector<char> send(16, 1), recv(16 * world);
    sizes[static_cast<size_t>(r)] =
        comm.all_gather(send.data(), recv.data(), r == 3 ? 8 : 16, nullptr);
    nulls[static_cast<size_t>(r)] =
        comm.all_gather(r == 1 ? nullptr : send.data(), recv.data(), 16, nullptr);
    after[static_cast<size_t>(r)] = comm.all_gather(send.data(), recv.data(), 16, nullptr);
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(sizes[static_cast<size_t>(r)].code(), cpidx::StatusCode::kCommError);
    EXPECT_EQ(sizes[static_cast<size_t>(r)].message(),  // every rank's, the same on each
              "all_gather: ranks disagree on bytes_per_rank: values by rank [16, 16, 16, 8]");
    EXPECT_EQ(nulls[static_cast<size_t>(r)].code(), cpidx::StatusCode::kCommError);
    EXPECT_TRUE(after[static_cast<size_t>(r)].is_ok()) << "the communicator stays usable";
  }
}

TEST(ThreadComm, CheckAgree) {
  const int world = 3;
  std::vector<cpidx::Status> same(world), differ(world);
  run_ranks(world, [&](int r, cpidx::Communicator& comm) {
    same[static_cast<size_t>(r)] = comm.check_agree(42, "batch");
    differ[static_cast<size_t>(r)] = comm.check_agree(r == 1 ? 7 : 42, "batch rows");
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(same[static_cast<size_t>(r)].is_ok());
    const cpidx::Status& s = differ[static_cast<size_t>(r)];
    EXPECT_EQ(s.code(), cpidx::StatusCode::kCommError);
    EXPECT_NE(s.message().find("batch rows"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("[42, 7, 42]"), std::string::npos) << s.message();
  }
  EXPECT_TRUE(cpidx::make_thread_communicators(0).empty());
}

// All values in one round: every rank names the first that differs and its values by rank.
TEST(ThreadComm, CheckAgreeAll) {
  const int world = 3;
  const char* const names[3] = {"rows", "query_len", "scale (bits)"};
  std::vector<cpidx::Status> same(world), differ(world), two(world), none(world),
      null_values(world), null_names(world);
  run_ranks(world, [&](int r, cpidx::Communicator& comm) {
    const long long base[3] = {8, 2, 1065353216};
    same[static_cast<size_t>(r)] = comm.check_agree_all(base, names, 3);
    const long long one[3] = {8, r == 2 ? 1 : 2, 1065353216};
    differ[static_cast<size_t>(r)] = comm.check_agree_all(one, names, 3);
    const long long both[3] = {8, r == 0 ? 4 : 2, r == 1 ? 7 : 1065353216};  // first one named
    two[static_cast<size_t>(r)] = comm.check_agree_all(both, names, 3);
    none[static_cast<size_t>(r)] = comm.check_agree_all(nullptr, names, 0);
    // Null values on one rank, or null names: an error on every rank, never a hang or a fault.
    null_values[static_cast<size_t>(r)] = comm.check_agree_all(r == 1 ? nullptr : base, names, 3);
    null_names[static_cast<size_t>(r)] = comm.check_agree_all(one, nullptr, 3);
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(same[static_cast<size_t>(r)].is_ok());
    EXPECT_TRUE(none[static_cast<size_t>(r)].is_ok());
    const cpidx::Status& s = differ[static_cast<size_t>(r)];
    EXPECT_EQ(s.code(), cpidx::StatusCode::kCommError);
    EXPECT_NE(s.message().find("ranks disagree on query_len: values by rank [2, 2, 1]"),
              std::string::npos)
        << s.message();
    const cpidx::Status& t = two[static_cast<size_t>(r)];
    EXPECT_NE(t.message().find("query_len: values by rank [4, 2, 2]"), std::string::npos)
        << t.message();
    EXPECT_EQ(t.message().find("scale"), std::string::npos) << t.message();
    EXPECT_EQ(null_values[static_cast<size_t>(r)].message(),
              "check_agree_all: rank 1 passed null values with count 3");
    EXPECT_EQ(null_names[static_cast<size_t>(r)].message(),
              "ranks disagree on value: values by rank [2, 2, 1]");
  }
}

// Zero bytes per rank is a no-op that needs no buffers: null pointers are fine on any rank.
TEST(ThreadComm, ZeroBytesNeedNoBuffers) {
  const int world = 3;
  std::vector<cpidx::Status> nulls(world), mixed(world);
  run_ranks(world, [&](int r, cpidx::Communicator& comm) {
    char byte = 0;
    nulls[static_cast<size_t>(r)] = comm.all_gather(nullptr, nullptr, 0, nullptr);
    mixed[static_cast<size_t>(r)] =
        comm.all_gather(r == 1 ? nullptr : &byte, r == 2 ? nullptr : &byte, 0, nullptr);
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(nulls[static_cast<size_t>(r)].is_ok()) << nulls[static_cast<size_t>(r)].to_string();
    EXPECT_TRUE(mixed[static_cast<size_t>(r)].is_ok()) << mixed[static_cast<size_t>(r)].to_string();
  }
}

// One rank's mistake, whichever rank makes it (rank 0 and the last too): a null send, a null
// recv or another size fails every rank with kCommError, the null ones naming that rank, and no
// rank's recv is written. The next gather on the same communicators works.
TEST(ThreadComm, AnyOneRanksMistakeFailsEveryRankAndWritesNoRecv) {
  enum class Mistake { kNullSend, kNullRecv, kOtherSize };
  const char* const kMistakes[3] = {"a null send", "a null recv", "another size"};
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int world : {2, 3, 5}) {
    for (int bad = 0; bad < world; ++bad) {
      for (Mistake mistake : {Mistake::kNullSend, Mistake::kNullRecv, Mistake::kOtherSize}) {
        const size_t bytes = 1 + rng() % 64;
        size_t other = rng() % (2 * bytes);  // 0 .. 2 * bytes, never bytes
        if (other >= bytes) ++other;
        const size_t most = std::max(bytes, other) * static_cast<size_t>(world);
        const auto poison = static_cast<unsigned char>(rng());
        std::vector<std::vector<unsigned char>> send(world), recv(world);
        for (auto& s : send) {
          s.resize(std::max(bytes, other));
          for (auto& b : s) b = static_cast<unsigned char>(rng());
        }
        for (auto& v : recv) v.assign(most, poison);
        std::vector<cpidx::Status> got(world), after(world);
        std::vector<std::vector<unsigned char>> again(world);
        run_ranks(world, [&](int r, cpidx::Communicator& comm) {
          const auto ru = static_cast<size_t>(r);
          const bool mine = r == bad;
          const void* src = mine && mistake == Mistake::kNullSend ? nullptr : send[ru].data();
          void* dst = mine && mistake == Mistake::kNullRecv ? nullptr : recv[ru].data();
          const size_t n = mine && mistake == Mistake::kOtherSize ? other : bytes;
          got[ru] = comm.all_gather(src, dst, n, nullptr);
          again[ru].assign(bytes * static_cast<size_t>(world), 0);
          after[ru] = comm.all_gather(send[ru].data(), again[ru].data(), bytes, nullptr);
        });
        for (int r = 0; r < world; ++r) {
          const auto ru = static_cast<size_t>(r);
          SCOPED_TRACE("world " + std::to_string(world) + ", rank " + std::to_string(bad) +
                       " passes " + kMistakes[static_cast<int>(mistake)] + ", rank " +
                       std::to_string(r));
          EXPECT_EQ(got[ru].code(), cpidx::StatusCode::kCommError) << got[ru].to_string();
          const std::string want = mistake == Mistake::kOtherSize
                                       ? "bytes_per_rank"
                                       : "rank " + std::to_string(bad) + " passed a null buffer";
          EXPECT_NE(got[ru].message().find(want), std::string::npos) << got[ru].message();
          EXPECT_TRUE(std::all_of(recv[ru].begin(), recv[ru].end(),
                                  [&](unsigned char b) { return b == poison; }))
              << "a failed all_gather wrote recv";
          EXPECT_TRUE(after[ru].is_ok()) << after[ru].to_string();
          for (int w = 0; w < world; ++w) {
            const auto wu = static_cast<size_t>(w);
            EXPECT_TRUE(std::equal(send[wu].begin(), send[wu].begin() + bytes,
                                   again[ru].begin() + wu * bytes))
                << "rank " << w << "'s bytes after the failed gather";
          }
        }
      }
    }
  }
}

// A size no allocation holds on one rank (its copy cannot be staged) fails every rank, naming
// it, instead of throwing on that rank and leaving the others in the barrier; nothing is written
// and the next gather works.
TEST(ThreadComm, AnUnallocatableSizeOnOneRankFailsEveryRank) {
  const int world = 3;
  std::vector<cpidx::Status> got(world), after(world);
  std::vector<std::vector<int>> recv(world, std::vector<int>(world, -7));
  run_ranks(world, [&](int r, cpidx::Communicator& comm) {
    const auto ru = static_cast<size_t>(r);
    const int mine = 10 + r;
    const size_t bytes = r == 1 ? std::numeric_limits<size_t>::max() - 2 : sizeof(int);
    got[ru] = comm.all_gather(&mine, recv[ru].data(), bytes, nullptr);
    std::vector<int> all(world, -1);
    after[ru] = comm.all_gather(&mine, all.data(), sizeof(int), nullptr);
    EXPECT_EQ(all, (std::vector<int>{10, 11, 12})) << "rank " << r;
  });
  for (int r = 0; r < world; ++r) {
    const auto ru = static_cast<size_t>(r);
    EXPECT_EQ(got[ru].code(), cpidx::StatusCode::kCommError) << got[ru].to_string();
    EXPECT_EQ(got[ru].message(), "all_gather: rank 1 could not allocate a copy of its bytes");
    EXPECT_EQ(recv[ru], std::vector<int>(world, -7)) << "rank " << r;
    EXPECT_TRUE(after[ru].is_ok()) << after[ru].to_string();
  }
}

// Where several ranks pass a null buffer, every rank names the same one: the lowest.
TEST(ThreadComm, SeveralNullBuffersNameTheLowestRankOnEveryRank) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int world = 5;
  for (int trial = 0; trial < 8; ++trial) {
    std::vector<bool> null_send(world);
    while (std::count(null_send.begin(), null_send.end(), true) < 2) {
      null_send[rng() % world] = true;
    }
    const auto lowest = std::find(null_send.begin(), null_send.end(), true) - null_send.begin();
    std::vector<cpidx::Status> got(world);
    run_ranks(world, [&](int r, cpidx::Communicator& comm) {
      std::vector<char> send(4), recv(4 * world);
      got[static_cast<size_t>(r)] = comm.all_gather(
          null_send[static_cast<size_t>(r)] ? nullptr : send.data(), recv.data(), 4, nullptr);
    });
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(got[static_cast<size_t>(r)].message(),
                "all_gather: rank " + std::to_string(lowest) + " passed a null buffer")
          << "rank " << r;
    }
  }
}

// No rank leaves barrier() before every rank has entered it: a count each rank raises before
// each barrier is complete after it, round after round.
TEST(ThreadComm, BarrierWaitsForEveryRank) {
  for (int world : {2, 3, 8}) {
    std::atomic<int> entered{0}, early{0};
    run_ranks(world, [&](int, cpidx::Communicator& comm) {
      for (int round = 1; round <= 100; ++round) {
        entered.fetch_add(1);
        EXPECT_TRUE(comm.barrier().is_ok());
        if (entered.load() < world * round) early.fetch_add(1);
      }
    });
    EXPECT_EQ(early.load(), 0) << "world " << world << ": ranks left a barrier early";
  }
}

// The values and which rank differs are drawn afresh: a difference in the last value is found
// like any other, a value without a name is called "value", a count of zero agrees without a
// gather and a negative one is refused, by name, on every rank.
TEST(ThreadComm, CheckAgreeAllFindsTheLastValueAndNamesUnnamedOnes) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int world : {2, 3, 5}) {
    const int count = 1 + static_cast<int>(rng() % 6);
    const int odd = static_cast<int>(rng() % static_cast<uint64_t>(world));  // it differs
    std::vector<long long> base(static_cast<size_t>(count));
    for (auto& v : base) v = static_cast<long long>(rng());
    const long long odd_value = base.back() ^ static_cast<long long>(1 + rng() % 1000);
    std::vector<const char*> names(static_cast<size_t>(count), "some setting");
    names.back() = nullptr;
    std::string by_rank;
    for (int r = 0; r < world; ++r) {
      by_rank += (r ? ", " : "") + std::to_string(r == odd ? odd_value : base.back());
    }
    std::vector<cpidx::Status> all(world), one(world), empty(world), negative(world);
    run_ranks(world, [&](int r, cpidx::Communicator& comm) {
      std::vector<long long> mine = base;
      if (r == odd) mine.back() = odd_value;
      const auto ru = static_cast<size_t>(r);
      all[ru] = comm.check_agree_all(mine.data(), names.data(), count);
      one[ru] = comm.check_agree(mine.back(), nullptr);
      empty[ru] = comm.check_agree_all(nullptr, nullptr, 0);
      negative[ru] = comm.check_agree_all(nullptr, nullptr, -1);
    });
    for (int r = 0; r < world; ++r) {
      const auto ru = static_cast<size_t>(r);
      const std::string want = "ranks disagree on value: values by rank [" + by_rank + "]";
      EXPECT_EQ(all[ru].code(), cpidx::StatusCode::kCommError) << all[ru].to_string();
      EXPECT_EQ(all[ru].message(), want);
      EXPECT_EQ(one[ru].code(), cpidx::StatusCode::kCommError) << one[ru].to_string();
      EXPECT_EQ(one[ru].message(), want);
      EXPECT_TRUE(empty[ru].is_ok()) << empty[ru].to_string();
      EXPECT_EQ(negative[ru].code(), cpidx::StatusCode::kInvalidArgument);
      EXPECT_EQ(negative[ru].message(), "check_agree_all: count must be >= 0, got -1");
    }
  }
}

class FakeDeviceComm final : public cpidx::Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  cpidx::MemorySpace memory_space() const override { return cpidx::MemorySpace::kDevice; }
  cpidx::Status all_gather(const void*, void*, size_t, cudaStream_t) override {
    ++gathers;
    return cpidx::Status::ok();
  }
  cpidx::Status barrier() override { return cpidx::Status::ok(); }
  int gathers = 0;
};

TEST(ThreadComm, DefaultCheckAgreeOnDeviceMemoryIsUnsupported) {
  FakeDeviceComm comm;
  const cpidx::Status s = comm.check_agree(5, "n");
  EXPECT_EQ(s.code(), cpidx::StatusCode::kUnsupported);
  EXPECT_NE(s.message().find("check_agree on n needs"), std::string::npos) << s.message();
  const cpidx::Status unnamed = comm.check_agree(5, nullptr);
  EXPECT_EQ(unnamed.code(), cpidx::StatusCode::kUnsupported);
  EXPECT_NE(unnamed.message().find("check_agree on value needs"), std::string::npos)
      << unnamed.message();
  EXPECT_EQ(comm.gathers, 0);
}

// A device-memory communicator's default check_agree_all asks its check_agree for each value in
// turn (its host channel, where it has one) and stops at the first refusal.
class AgreeingDeviceComm final : public cpidx::Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 2; }
  cpidx::MemorySpace memory_space() const override { return cpidx::MemorySpace::kDevice; }
  cpidx::Status all_gather(const void*, void*, size_t, cudaStream_t) override {
    ++gathers;
    return cpidx::Status::ok();
  }
  cpidx::Status check_agree(long long value, const char* what) override {
    asked.emplace_back(what);
    offered.push_back(value);
    if (value == refuse) return cpidx::Status(cpidx::StatusCode::kCommError, what);
    return cpidx::Status::ok();
  }
  cpidx::Status barrier() override { return cpidx::Status::ok(); }
  int gathers = 0;
  long long refuse = -1;
  std::vector<std::string> asked;
  std::vector<long long> offered;
};

TEST(ThreadComm, DefaultCheckAgreeAllOnDeviceMemoryAsksEachValue) {
  const char* const names[3] = {"a", "b", "c"};
  const long long values[3] = {1, 2, 3};
  AgreeingDeviceComm comm;
  EXPECT_TRUE(comm.check_agree_all(values, names, 3).is_ok());
  EXPECT_EQ(comm.asked, (std::vector<std::string>{"a", "b", "c"}));
  AgreeingDeviceComm refusing;
  refusing.refuse = 2;
  const cpidx::Status s = refusing.check_agree_all(values, names, 3);
  EXPECT_EQ(s.code(), cpidx::StatusCode::kCommError);
  EXPECT_EQ(s.message(), "b");
  EXPECT_EQ(refusing.asked, (std::vector<std::string>{"a", "b"}));
  // Null values: every value is still asked (as LLONG_MIN, so ranks with values disagree), then
  // refused; null names are asked as "value".
  AgreeingDeviceComm unnamed;
  const cpidx::Status none = unnamed.check_agree_all(nullptr, nullptr, 2);
  EXPECT_EQ(none.code(), cpidx::StatusCode::kInvalidArgument);
  EXPECT_EQ(none.message(), "check_agree_all: null values with count 2");
  EXPECT_EQ(unnamed.asked, (std::vector<std::string>{"value", "value"}));
  EXPECT_EQ(unnamed.offered, (std::vector<long long>{LLONG_MIN, LLONG_MIN}));
  EXPECT_EQ(comm.gathers + refusing.gathers, 0);
  EXPECT_EQ(comm.max_bytes_per_rank(), SIZE_MAX);  // the default: any size goes
}

}  // namespace
