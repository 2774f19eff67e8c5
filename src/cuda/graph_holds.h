// src/cuda/graph_holds.h: how many of an object's launches (a communicator's gathers, a
// Decoder's or Prefiller's steps) sit in CUDA graphs that are still alive (captured, or
// instantiated from such a graph). NCCL's destroy would wait for those graphs, and their replays
// use the peer communicator's buffers and the decoders' workspaces, so the owners keep what such
// a graph uses instead of destroying or freeing it.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>

#include "host_util.h"
#include "cpidx/status.h"

namespace cpidx {
namespace cuda_host {

// Copies share one count (the ranks of a peer communicator in one process: a graph of any of
// them stores into every rank's buffer). The count outlives its holders: graphs may release
// their gathers after the communicator is gone.
class GraphHolds {
 public:
  // A launch (a gather, a step) enqueued on `stream`: when the stream is capturing, the graph
  // keeps a CUDA user object whose release, once the graph and every instantiation of it are
  // gone, takes it off the count. Nothing when the stream is not capturing.
  Status count_if_captured(cudaStream_t stream) const {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    cudaGraph_t graph = nullptr;
    // Errors as a launch's (launch_status): reported here, not left pending for the caller.
    CPIDX_RETURN_IF_ERROR(launch_status(
        cudaStreamGetCaptureInfo(stream, &capture, nullptr, &graph), "cudaStreamGetCaptureInfo"));
    if (capture != cudaStreamCaptureStatusActive) return Status::ok();
    auto* held = new std::shared_ptr<std::atomic<long long>>(count_);
    cudaUserObject_t object = nullptr;
    Status st = launch_status(
        cudaUserObjectCreate(&object, held, &release, 1, cudaUserObjectNoDestructorSync),
        "cudaUserObjectCreate");
    if (!st.is_ok()) {
      delete held;
      return st;
    }
    ++*count_;
    st = launch_status(
        cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove),
        "cudaGraphRetainUserObject");
    if (!st.is_ok()) cudaUserObjectRelease(object, 1);  // runs release()
    return st;
  }

  long long count() const { return count_->load(); }

  // A weak reference to this count, and taking one up (false, nothing changed, once the count
  // is gone): how the ranks of one process come to share rank 0's.
  std::weak_ptr<std::atomic<long long>> share() const { return count_; }
  bool adopt(const std::weak_ptr<std::atomic<long long>>& shared) {
    std::shared_ptr<std::atomic<long long>> count = shared.lock();
    if (count == nullptr) return false;
    count_ = std::move(count);
    return true;
  }

  // The count after waiting up to `seconds` for it to reach 0: CUDA releases a destroyed graph's
  // objects on an internal thread, which can trail cudaGraphExecDestroy / cudaGraphDestroy.
  // Host polling only, no CUDA call (a destructor may run while another thread captures).
  // A positive wait that runs out with launches still held marks a burst (destroy_grace): a
  // destructor's, or a caller's that asks before dropping its objects (Registry.clear()).
  long long wait_for_release(double seconds) const {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (count_->load() > 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    const long long left = count_->load();
    if (seconds > 0 && left > 0) last_run_out().store(steady_ns());
    return left;
  }

  // wait_for_release for a caller that may make CUDA calls (never a destructor): while the count
  // is above 0 it first synchronises `device` (a graph still running keeps its references until
  // it ends), best effort, the caller's device restored and no error left pending.
  long long wait_for_release_on(int device, double seconds) const {
    if (seconds > 0 && count() > 0) {
      on_device_best_effort(device, [] { cudaDeviceSynchronize(); });
      cudaGetLastError();
    }
    return wait_for_release(seconds);
  }

  // How long a destructor waits for graphs destroyed just before it; within a burst (below),
  // how long each further destructor waits.
  static constexpr double kDestroyGraceSeconds = 0.1;
  static constexpr double kBurstGraceSeconds = 0.01;

  // The grace of a destructor that starts at `now_ns` (steady clock), given when the last wait
  // of this process ran out with launches still held (0: never; wait_for_release). Within one
  // full grace of it, a burst of objects that live graphs still hold is being destroyed
  // (interpreter exit, a registry cleared: CUDA graphs commonly live until then), and the short
  // grace applies, so that N of them cost one grace and N short ones rather than N graces. A
  // graph destroyed just before its object in such a burst may then release after the short
  // grace: that object's memory is kept until the process exits, as a held object's is.
  static double destroy_grace(int64_t now_ns, int64_t last_run_out_ns) {
    const int64_t full = static_cast<int64_t>(kDestroyGraceSeconds * 1e9);
    const bool in_burst = last_run_out_ns != 0 && now_ns - last_run_out_ns <= full;
    return in_burst ? kBurstGraceSeconds : kDestroyGraceSeconds;
  }

  // A destructor's wait: the count after destroy_grace(). The grace waited goes to
  // `grace_seconds` (0 when nothing was held), for tests. The mark is process-wide: a test that
  // lets held objects go leaves it set for 0.1 s.
  long long wait_on_destroy(double* grace_seconds = nullptr) const {
    if (grace_seconds != nullptr) *grace_seconds = 0;
    if (count_->load() == 0) return 0;
    const double grace = destroy_grace(steady_ns(), last_run_out().load());
    if (grace_seconds != nullptr) *grace_seconds = grace;
    return wait_for_release(grace);
  }

  // When a wait last ran out with launches held (steady clock, ns; 0: never), for tests.
  static int64_t last_run_out_ns() { return last_run_out().load(); }

 private:
  static int64_t steady_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  // When a wait last ran out with launches held, process-wide (one library, so one variable).
  static std::atomic<int64_t>& last_run_out() {
    static std::atomic<int64_t> at{0};
    return at;
  }

  // The user object's destructor (a CUDA-internal thread: no CUDA calls).
  static void release(void* counter) {
    auto* held = static_cast<std::shared_ptr<std::atomic<long long>>*>(counter);
    --**held;
    delete held;
  }

  std::shared_ptr<std::atomic<long long>> count_ = std::make_shared<std::atomic<long long>>(0);
};

}  // namespace cuda_host
}  // namespace cpidx
