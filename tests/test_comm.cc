// The thread communicator: all_gather in and out of place over many generations, mismatched
// sizes and null buffers as errors on every rank (no hang), check_agree and check_agree_all, and
// the defaults of a device-memory communicator.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpidx/comm.h"
#include "test_util.h"

namespace {

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
    EXPECT_NE(sizes[static_cast<size_t>(r)].message().find("bytes_per_rank"), std::string::npos);
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
  std::vector<cpidx::Status> same(world), differ(world), two(world), none(world);
  run_ranks(world, [&](int r, cpidx::Communicator& comm) {
    const long long base[3] = {8, 2, 1065353216};
    same[static_cast<size_t>(r)] = comm.check_agree_all(base, names, 3);
    const long long one[3] = {8, r == 2 ? 1 : 2, 1065353216};
    differ[static_cast<size_t>(r)] = comm.check_agree_all(one, names, 3);
    const long long both[3] = {8, r == 0 ? 4 : 2, r == 1 ? 7 : 1065353216};  // first one named
    two[static_cast<size_t>(r)] = comm.check_agree_all(both, names, 3);
    none[static_cast<size_t>(r)] = comm.check_agree_all(nullptr, names, 0);
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
    if (value == refuse) return cpidx::Status(cpidx::StatusCode::kCommError, what);
    return cpidx::Status::ok();
  }
  cpidx::Status barrier() override { return cpidx::Status::ok(); }
  int gathers = 0;
  long long refuse = -1;
  std::vector<std::string> asked;
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
  EXPECT_EQ(comm.gathers + refusing.gathers, 0);
  EXPECT_EQ(comm.max_bytes_per_rank(), SIZE_MAX);  // the default: any size goes
}

}  // namespace
