// src/comm/nccl.cc: the NCCL Communicator (device buffers, stream-ordered, graph-capturable).
// all_gather is one ncclAllGather of bytes; check_agree goes through an optional host channel.
// Every NCCL and CUDA failure is returned as a Status naming the call, never fatal.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cpidx/comm_nccl.h"
#include "../cuda/graph_holds.h"

namespace cpidx {
namespace {

static_assert(sizeof(NcclUniqueId) == NCCL_UNIQUE_ID_BYTES, "NcclUniqueId must hold an id");
static_assert(sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES, "unexpected ncclUniqueId size");

// The oldest NCCL this file is written against (ncclGetLastError, ncclCommInitRankConfig and
// graph-captured collectives all predate it).
constexpr int kMinNcclMajor = 2, kMinNcclMinor = 18, kMinNcclPatch = 0;

Status comm_error(std::string message) {
  return Status(StatusCode::kCommError, std::move(message));
}

// "2.28.3" from an NCCL version code (old codes: X*1000 + Y*100 + Z, newer: X*10000 + Y*100 + Z).
std::string version_string(int code) {
  const bool wide = code >= 10000;
  const int major = wide ? code / 10000 : code / 1000;
  const int minor = wide ? (code / 100) % 100 : (code / 100) % 10;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

Status nccl_check(ncclResult_t r, const char* call, ncclComm_t comm, int rank, int world) {
  if (r == ncclSuccess) return Status::ok();
  ::cpidx::detail::Message os;
  os << call << " failed";
  if (rank >= 0) os << " on rank " << rank << " of " << world;
  os << ": " << ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') os << " (" << last << ")";
  return comm_error(os.str());
}

using cuda_host::cuda_status;

// ncclCommInitRank on a thread of its own, waited for up to `timeout_seconds` (> 0; infinity or
// 1e9 and above: no deadline). A blocking init cannot be interrupted. A non-blocking one could
// be aborted, but every group of calls on such a communicator would then be launched from a
// thread NCCL starts for it (NCCL's recent group.cc; 2.20 did so only when connecting). So past
// the deadline the caller returns kCommError and the thread is left to end on its own: if its
// init completes later, the thread aborts what it made (the shared state outlives whichever of
// the two ends first). Each abandoned init keeps its thread, its sockets and rank 0's bootstrap
// root until it ends or the process exits.
Status init_with_deadline(const ncclUniqueId& uid, int world, int rank, int device,
                          double timeout_seconds, ncclComm_t* out) {
  struct Job {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false, abandoned = false;
    ncclComm_t comm = nullptr;
    Status status;
  };
  std::shared_ptr<Job> job;
  try {
    job = std::make_shared<Job>();
    std::thread([job, uid, world, rank, device] {
      ncclComm_t comm = nullptr;
      Status st;
      try {
        // ncclCommInitRank takes the current device, per thread: the caller's, checked there.
        st = cuda_status(cudaSetDevice(device), "cudaSetDevice (NCCL init thread)");
        if (st.is_ok()) {
          const ncclResult_t r = ncclCommInitRank(&comm, world, uid, rank);
          // A failed blocking init frees its communicator and leaves comm null.
          st = nccl_check(r, "ncclCommInitRank", comm, rank, world);
        }
      } catch (...) {  // a message that could not be built: nothing may escape a thread
        st = Status(StatusCode::kInternal, "ncclCommInitRank's thread failed to report");
      }
      std::lock_guard<std::mutex> lock(job->mutex);
      if (job->abandoned) {
        if (comm != nullptr) ncclCommAbort(comm);  // local: no peer is waited for
        return;
      }
      job->comm = comm;
      job->status = std::move(st);
      job->done = true;
      job->cv.notify_all();
    }).detach();
  } catch (const std::exception& e) {  // std::system_error, std::bad_alloc
    return comm_error(std::string("could not start the NCCL init thread: ") + e.what());
  }
  std::unique_lock<std::mutex> lock(job->mutex);
  const auto finished = [&] { return job->done; };
  if (!(timeout_seconds < 1e9)) {  // infinity, or a wait that would overflow the clock
    job->cv.wait(lock, finished);
  } else if (!job->cv.wait_for(lock, std::chrono::duration<double>(timeout_seconds), finished)) {
    job->abandoned = true;
    ::cpidx::detail::Message os;
    os << "ncclCommInitRank on rank " << rank << " of " << world
       << " did not complete within init_timeout_seconds = " << timeout_seconds
       << ": a rank never joined (its own error says why, or its process is gone), or the init "
          "is slower than that; the init is left to its thread, which aborts what it makes";
    return comm_error(os.str());
  }
  *out = job->comm;
  return job->status;
}

// The library found at run time must be at least kMinNccl; the message names both versions
// (and the headers this file was compiled against).
Status check_version() {
  int code = 0;
  CPIDX_RETURN_IF_ERROR(nccl_check(ncclGetVersion(&code), "ncclGetVersion", nullptr, -1, 0));
  const int wanted = NCCL_VERSION(kMinNcclMajor, kMinNcclMinor, kMinNcclPatch);
  // Codes below 10000 are releases before 2.9, always too old.
  if (code >= 10000 && code >= wanted) return Status::ok();
  return comm_error("NCCL library " + version_string(code) + " is older than " +
                    version_string(wanted) + ", the oldest cpidx supports (compiled against " +
                    version_string(NCCL_VERSION_CODE) + ")");
}

// NVLS (NVLink SHARP, multicast) must stay off: the exchanges are a few KiB and never gain from
// it, and on shared hosts a program using multicast can take every GPU out of service. Sets
// NCCL_NVLS_ENABLE=0 when unset (before NCCL reads it: NCCL caches its parameters on first
// use) and refuses any other value. Serialised, so concurrent factories never race on setenv.
Status ensure_nvls_off() {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  const char* value = std::getenv("NCCL_NVLS_ENABLE");
  if (value == nullptr) {
    if (setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0) != 0) {
      return comm_error("could not set NCCL_NVLS_ENABLE=0 in the environment");
    }
    return Status::ok();
  }
  if (std::strcmp(value, "0") == 0) return Status::ok();
  return unsupported(std::string("NCCL_NVLS_ENABLE=") + value +
                     ": cpidx's NCCL communicators need NVLink SHARP / multicast off; run with "
                     "NCCL_NVLS_ENABLE=0 (or leave it unset)");
}

Status check_host_channel(const Communicator* host, int world, int rank) {
  if (host == nullptr) return Status::ok();
  CPIDX_CHECK(host->memory_space() == MemorySpace::kHost,
              "host_channel must be a host-memory communicator (MPI, threads)");
  CPIDX_CHECK(host->world_size() == world && host->rank() == rank,
              "host_channel is rank " << host->rank() << " of " << host->world_size()
                                      << ", but the NCCL communicator is rank " << rank << " of "
                                      << world);
  return Status::ok();
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, bool owns, int rank, int world, int device,
                   Communicator* host, std::unique_ptr<Communicator> owned_host)
      : comm_(comm),
        owns_(owns),
        rank_(rank),
        world_(world),
        device_(device),
        host_(host),
        owned_host_(std::move(owned_host)) {}

  ~NcclCommunicator() override {
    if (barrier_stream_ != nullptr || barrier_scratch_ != nullptr) {
      cuda_host::on_device_best_effort(device_, [&] {
        if (barrier_stream_ != nullptr) cudaStreamDestroy(barrier_stream_);
        if (barrier_scratch_ != nullptr) cudaFree(barrier_scratch_);
      });
    }
    // Destroy (not abort): waits for this rank's outstanding operations on the communicator.
    // Not while a live CUDA graph holds one of its gathers: NCCL's destroy would wait for that
    // graph forever, so the communicator is left to the process instead. Graphs destroyed just
    // before may still be releasing theirs on a CUDA thread: a short wait, and no CUDA call (a
    // destructor may run while another thread captures a graph).
    if (owns_ && comm_ != nullptr && holds_.wait_on_destroy() == 0) {
      ncclCommDestroy(comm_);
    }
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  MemorySpace memory_space() const override { return MemorySpace::kDevice; }

  Status all_gather(const void* send, void* recv, size_t bytes_per_rank,
                    cudaStream_t stream) override {
    if (bytes_per_rank == 0) return Status::ok();
    CPIDX_CHECK(send != nullptr && recv != nullptr,
                "all_gather: send and recv must be non-null device pointers");
    // NCCL counts such graphs too, and its destroy waits for them; this count lets an owner
    // refuse instead (nccl_gathers_in_live_graphs).
    CPIDX_RETURN_IF_ERROR(holds_.count_if_captured(stream));
    return nccl_check(ncclAllGather(send, recv, bytes_per_rank, ncclUint8, comm_, stream),
                      "ncclAllGather", comm_, rank_, world_);
  }

  Status check_agree(long long value, const char* what) override {
    if (host_ == nullptr) return Status::ok();  // no host channel, no check (see comm_nccl.h)
    return host_->check_agree(value, what);
  }
  Status check_agree_all(const long long* values, const char* const* names, int count) override {
    // Without a host channel the default still refuses a bad count or null values (each
    // check_agree it asks then agrees at once).
    if (host_ == nullptr) return Communicator::check_agree_all(values, names, count);
    return host_->check_agree_all(values, names, count);
  }

  // Gathers held by live CUDA graphs (nccl_gathers_in_live_graphs).
  long long gathers_in_live_graphs(double wait_seconds) const {
    return holds_.wait_for_release_on(device_, wait_seconds);
  }

  int device() const override { return device_; }

  Status barrier() override {
    if (host_ != nullptr) return host_->barrier();
    int prev = 0;
    CPIDX_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&prev), "cudaGetDevice"));
    CPIDX_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "cudaSetDevice"));
    Status st = device_barrier();
    cudaSetDevice(prev);
    return st;
  }

 private:
  // A one-int all-reduce on an internal stream, then a wait for it (created on first use).
  Status device_barrier() {
    if (barrier_stream_ == nullptr) {
      CPIDX_RETURN_IF_ERROR(cuda_status(
          cudaStreamCreateWithFlags(&barrier_stream_, cudaStreamNonBlocking), "cudaStreamCreate"));
    }
    if (barrier_scratch_ == nullptr) {
      CPIDX_RETURN_IF_ERROR(
          cuda_status(cudaMalloc(&barrier_scratch_, sizeof(int)), "cudaMalloc"));
      CPIDX_RETURN_IF_ERROR(
          cuda_status(cudaMemset(barrier_scratch_, 0, sizeof(int)), "cudaMemset"));
    }
    CPIDX_RETURN_IF_ERROR(nccl_check(ncclAllReduce(barrier_scratch_, barrier_scratch_, 1, ncclInt32,
                                                   ncclSum, comm_, barrier_stream_),
                                     "ncclAllReduce (barrier)", comm_, rank_, world_));
    return cuda_status(cudaStreamSynchronize(barrier_stream_), "cudaStreamSynchronize (barrier)");
  }

  ncclComm_t comm_;
  bool owns_;
  int rank_, world_, device_;
  Communicator* host_;                        // not owned unless it is owned_host_
  std::unique_ptr<Communicator> owned_host_;  // the single-process factory's thread channel
  cudaStream_t barrier_stream_ = nullptr;
  void* barrier_scratch_ = nullptr;
  cuda_host::GraphHolds holds_;
};

// What the ranks of make_nccl_communicator agree on through their host channel.
constexpr const char* kWorldAgreement =
    "NCCL communicator world size (-1: a rank refused its arguments)";

Status check_init_timeout(double seconds) {
  CPIDX_CHECK(seconds > 0,  // NaN fails too
              "make_nccl_communicator: init_timeout_seconds must be > 0 (infinity: no deadline), "
              "got " << seconds);
  return Status::ok();
}

// Sets *status (when given) and returns what the factories return on failure.
template <typename T>
T fail(Status* status, Status st, T empty) {
  if (status != nullptr) *status = std::move(st);
  return empty;
}

}  // namespace

NcclUniqueId nccl_unique_id(Status* status) {
  NcclUniqueId id{};
  Status st = ensure_nvls_off();
  if (st.is_ok()) st = check_version();
  ncclUniqueId uid;
  if (st.is_ok()) st = nccl_check(ncclGetUniqueId(&uid), "ncclGetUniqueId", nullptr, -1, 0);
  if (st.is_ok()) std::memcpy(id.data(), uid.internal, NCCL_UNIQUE_ID_BYTES);
  if (status != nullptr) *status = st;
  return id;
}

std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& id, int world, int rank,
                                                     int device, Status* status,
                                                     Communicator* host_channel,
                                                     double init_timeout_seconds) {
  if (status != nullptr) *status = Status::ok();
  int prev = -1;  // the caller's device, once switched: restored on every path after
  Status local = [&]() -> Status {
    CPIDX_CHECK(world >= 1, "make_nccl_communicator: world must be >= 1, got " << world);
    CPIDX_CHECK(rank >= 0 && rank < world,
                "make_nccl_communicator: rank must be in [0, " << world << "), got " << rank);
    CPIDX_RETURN_IF_ERROR(check_init_timeout(init_timeout_seconds));
    int count = 0;
    CPIDX_RETURN_IF_ERROR(cuda_status(cudaGetDeviceCount(&count), "cudaGetDeviceCount"));
    CPIDX_CHECK(device >= 0 && device < count,
                "make_nccl_communicator: device must be in [0, " << count << "), got " << device);
    CPIDX_RETURN_IF_ERROR(check_host_channel(host_channel, world, rank));
    CPIDX_RETURN_IF_ERROR(ensure_nvls_off());
    CPIDX_RETURN_IF_ERROR(check_version());
    // Switched before the agreement: cudaSetDevice initialises the device's context and can
    // fail on a valid ordinal (exclusive or prohibited compute mode, no memory left), and a
    // rank failing it after the agreement would leave its peers in ncclCommInitRank.
    int current = 0;
    CPIDX_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&current), "cudaGetDevice"));
    CPIDX_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device), "cudaSetDevice"));
    prev = current;
    return Status::ok();
  }();
  auto restore = [&] {
    if (prev >= 0) cudaSetDevice(prev);
  };
  // ncclCommInitRank waits for every rank: with a host channel, a rank that refused its
  // arguments makes the others fail here instead of hanging there.
  if (host_channel != nullptr) {
    Status agree = host_channel->check_agree(local.is_ok() ? world : -1, kWorldAgreement);
    if (!local.is_ok() || !agree.is_ok()) restore();
    if (!local.is_ok()) return fail(status, local, std::unique_ptr<Communicator>());
    if (!agree.is_ok()) return fail(status, agree, std::unique_ptr<Communicator>());
  } else if (!local.is_ok()) {
    restore();
    return fail(status, local, std::unique_ptr<Communicator>());
  }

  ncclUniqueId uid;
  std::memcpy(uid.internal, id.data(), NCCL_UNIQUE_ID_BYTES);
  ncclComm_t comm = nullptr;
  // No agreement on the init's outcome after it: a rank whose init failed early would wait in
  // it until its peers' inits end, up to their deadline, instead of returning at once so that
  // its launcher ends the job. Ranks whose inits end differently are therefore not told
  // (docs/reliability.md).
  const Status st = init_with_deadline(uid, world, rank, device, init_timeout_seconds, &comm);
  restore();
  if (!st.is_ok()) return fail(status, st, std::unique_ptr<Communicator>());
  return std::make_unique<NcclCommunicator>(comm, /*owns=*/true, rank, world, device, host_channel,
                                            nullptr);
}

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& host, int device,
                                                     Status* status, double init_timeout_seconds) {
  if (host.memory_space() != MemorySpace::kHost) {
    return fail(status, Status(StatusCode::kInvalidArgument,
                               "host must be a host-memory communicator (MPI, threads)"),
                std::unique_ptr<Communicator>());
  }
  // Rank 0's id reaches every rank through a host all_gather (the other ranks' bytes unused).
  Status id_status;
  NcclUniqueId mine{};
  if (host.rank() == 0) {
    // Rank 0's timeout refused before its id (each id starts a bootstrap root that waits for
    // the ranks); another rank's is refused in the agreement before the init, after the id.
    id_status = check_init_timeout(init_timeout_seconds);
    if (id_status.is_ok()) mine = nccl_unique_id(&id_status);
  }
  std::vector<char> gathered(mine.size() * static_cast<size_t>(host.world_size()));
  Status st = host.all_gather(mine.data(), gathered.data(), mine.size(), nullptr);
  if (!st.is_ok()) return fail(status, st, std::unique_ptr<Communicator>());
  if (!id_status.is_ok()) {
    // The other ranks reach the agreement in make_nccl_communicator and fail there with this one.
    host.check_agree(-1, kWorldAgreement);
    return fail(status, id_status, std::unique_ptr<Communicator>());
  }
  NcclUniqueId id{};
  std::memcpy(id.data(), gathered.data(), id.size());
  return make_nccl_communicator(id, host.world_size(), host.rank(), device, status, &host,
                                init_timeout_seconds);
}

std::unique_ptr<Communicator> adopt_nccl_communicator(void* nccl_comm, Status* status,
                                                      Communicator* host_channel) {
  if (status != nullptr) *status = Status::ok();
  auto comm = static_cast<ncclComm_t>(nccl_comm);
  Status st = [&]() -> Status {
    CPIDX_CHECK(comm != nullptr, "adopt_nccl_communicator: nccl_comm must be an ncclComm_t");
    CPIDX_RETURN_IF_ERROR(check_version());
    return Status::ok();
  }();
  int world = 0, rank = 0, device = 0;
  if (st.is_ok()) st = nccl_check(ncclCommCount(comm, &world), "ncclCommCount", comm, -1, 0);
  if (st.is_ok()) st = nccl_check(ncclCommUserRank(comm, &rank), "ncclCommUserRank", comm, -1, 0);
  if (st.is_ok()) st = nccl_check(ncclCommCuDevice(comm, &device), "ncclCommCuDevice", comm, -1, 0);
  if (st.is_ok()) st = check_host_channel(host_channel, world, rank);
  if (!st.is_ok()) return fail(status, st, std::unique_ptr<Communicator>());
  return std::make_unique<NcclCommunicator>(comm, /*owns=*/false, rank, world, device,
                                            host_channel, nullptr);
}

std::vector<std::unique_ptr<Communicator>> make_nccl_communicators_single_process(
    const std::vector<int>& devices, Status* status) {
  using Comms = std::vector<std::unique_ptr<Communicator>>;
  if (status != nullptr) *status = Status::ok();
  Status st = [&]() -> Status {
    CPIDX_CHECK(!devices.empty(), "make_nccl_communicators_single_process: no devices given");
    int count = 0;
    CPIDX_RETURN_IF_ERROR(cuda_status(cudaGetDeviceCount(&count), "cudaGetDeviceCount"));
    for (size_t i = 0; i < devices.size(); ++i) {
      CPIDX_CHECK(devices[i] >= 0 && devices[i] < count,
                  "make_nccl_communicators_single_process: devices[" << i << "] must be in [0, "
                                                                     << count << "), got "
                                                                     << devices[i]);
      CPIDX_CHECK(std::count(devices.begin(), devices.end(), devices[i]) == 1,
                  "make_nccl_communicators_single_process: device " << devices[i]
                                                                    << " is listed twice");
    }
    CPIDX_RETURN_IF_ERROR(ensure_nvls_off());
    return check_version();
  }();
  if (!st.is_ok()) return fail(status, st, Comms());

  const int world = static_cast<int>(devices.size());
  std::vector<ncclComm_t> raw(devices.size(), nullptr);
  int prev = 0;
  st = cuda_status(cudaGetDevice(&prev), "cudaGetDevice");
  if (st.is_ok()) {
    st = nccl_check(ncclCommInitAll(raw.data(), world, devices.data()), "ncclCommInitAll",
                    nullptr, -1, 0);
    cudaSetDevice(prev);
  }
  if (!st.is_ok()) return fail(status, st, Comms());
  Comms hosts = make_thread_communicators(world);
  Comms comms;
  comms.reserve(devices.size());
  for (int r = 0; r < world; ++r) {
    const auto i = static_cast<size_t>(r);
    Communicator* host = hosts[i].get();
    comms.push_back(std::make_unique<NcclCommunicator>(raw[i], true, r, world, devices[i], host,
                                                       std::move(hosts[i])));
  }
  return comms;
}

long long nccl_gathers_in_live_graphs(Communicator& comm, double wait_seconds) {
  const auto* nccl = dynamic_cast<const NcclCommunicator*>(&comm);
  return nccl != nullptr ? nccl->gathers_in_live_graphs(wait_seconds) : -1;
}

std::string nccl_version_text() {
  int code = 0;
  if (ncclGetVersion(&code) != ncclSuccess) return "unavailable: ncclGetVersion failed";
  return "NCCL " + version_string(code) + " (library), " + version_string(NCCL_VERSION_CODE) +
         " (headers)";
}

}  // namespace cpidx
