// The thread communicator: all_gather in and out of place over many generations, mismatched
// sizes and null buffers as errors on every rank (no hang), check_agree, and the default
// check_agree of a device-memory communicator.
#include <gtest/gtest.h>

#include <atomic>
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

}  // namespace
