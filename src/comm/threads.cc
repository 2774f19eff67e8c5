// Ranks as threads of one process: all_gather through a shared staging area and a
// generation-counted barrier (mutex + condition variable). Host memory, blocking.
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cpidx/comm.h"

namespace cpidx {
namespace {

constexpr size_t kBadBuffer = std::numeric_limits<size_t>::max();
constexpr size_t kNoStaging = kBadBuffer - 1;  // posted by a rank that could not stage its bytes

struct SharedState {
  explicit SharedState(int world) : world_size(world), staging(world), sizes(world, 0) {}
  const int world_size;
  std::mutex mutex;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  std::vector<std::vector<unsigned char>> staging;  // [world][bytes]: each rank's send copy
  std::vector<size_t> sizes;  // [world]: bytes posted, or kBadBuffer / kNoStaging (an error)

  void wait_all() {
    std::unique_lock<std::mutex> lock(mutex);
    const uint64_t gen = generation;
    if (++arrived == world_size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
    } else {
      cv.wait(lock, [&] { return generation != gen; });
    }
  }
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<SharedState> shared, int rank)
      : shared_(std::move(shared)), rank_(rank) {}

  int rank() const override { return rank_; }
  int world_size() const override { return shared_->world_size; }
  MemorySpace memory_space() const override { return MemorySpace::kHost; }

  // Every rank runs both barriers even on bad arguments, so a mistake on one rank turns
  // into an error on all ranks instead of a hang.
  Status all_gather(const void* send, void* recv, size_t bytes_per_rank,
                    cudaStream_t /*stream*/) override {
    SharedState& s = *shared_;
    const bool usable = bytes_per_rank == 0 || (send != nullptr && recv != nullptr);
    // Staging is written by this rank only, read by others only between the two barriers.
    auto& mine = s.staging[static_cast<size_t>(rank_)];
    size_t posted = usable ? bytes_per_rank : kBadBuffer;
    if (usable) {
      // A size no allocation holds fails every rank, as a null buffer does: thrown out of this
      // rank alone, it would leave the others in the barrier.
      try {
        const auto* src = static_cast<const unsigned char*>(send);
        mine.assign(src, src + bytes_per_rank);  // one pass (null only with 0 bytes: no range)
      } catch (const std::exception&) {  // std::bad_alloc, std::length_error
        posted = kNoStaging;
      }
    }
    s.sizes[static_cast<size_t>(rank_)] = posted;
    s.wait_all();
    Status status = Status::ok();
    // The lowest rank that could not post its bytes first (the same message on every rank),
    // then the sizes.
    for (int i = 0; i < s.world_size && status.is_ok(); ++i) {
      const size_t other = s.sizes[static_cast<size_t>(i)];
      if (other == kBadBuffer) {
        status = Status(StatusCode::kCommError,
                        "all_gather: rank " + std::to_string(i) + " passed a null buffer");
      } else if (other == kNoStaging) {
        status = Status(StatusCode::kCommError, "all_gather: rank " + std::to_string(i) +
                                                    " could not allocate a copy of its bytes");
      }
    }
    bool same = true;
    for (const size_t other : s.sizes) same = same && other == s.sizes[0];
    if (status.is_ok() && !same) {  // every rank's size, so every rank's message is the same
      std::string by_rank;
      for (int i = 0; i < s.world_size; ++i) {
        by_rank += (i ? ", " : "") + std::to_string(s.sizes[static_cast<size_t>(i)]);
      }
      status = Status(StatusCode::kCommError,
                      "all_gather: ranks disagree on bytes_per_rank: values by rank [" + by_rank +
                          "]");
    }
    if (status.is_ok() && bytes_per_rank > 0) {
      auto* dst = static_cast<unsigned char*>(recv);
      for (int i = 0; i < s.world_size; ++i) {
        std::memcpy(dst + static_cast<size_t>(i) * bytes_per_rank,
                    s.staging[static_cast<size_t>(i)].data(), bytes_per_rank);
      }
    }
    s.wait_all();
    return status;
  }

  Status barrier() override {
    shared_->wait_all();
    return Status::ok();
  }

 private:
  std::shared_ptr<SharedState> shared_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_thread_communicators(int world_size) {
  std::vector<std::unique_ptr<Communicator>> comms;
  if (world_size < 1) return comms;
  auto shared = std::make_shared<SharedState>(world_size);
  comms.reserve(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) {
    comms.push_back(std::make_unique<ThreadCommunicator>(shared, r));
  }
  return comms;
}

}  // namespace cpidx
