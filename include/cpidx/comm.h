// cpidx/comm.h: the communicator the context-parallel decode uses, modelled on ncclAllGather.
// Implementations: ranks as threads of one process (comm_threads), MPI processes (cpidx_comm_mpi),
// NCCL (cpidx_comm_nccl). No framework header is included here.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "cpidx/status.h"

// Forward declaration keeps cuda_runtime.h out of CPU-only builds.
typedef struct CUstream_st* cudaStream_t;

namespace cpidx {

struct DeviceChannel;  // cpidx/device_channel.h

enum class MemorySpace { kHost, kDevice };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Where all_gather's buffers must live.
  virtual MemorySpace memory_space() const = 0;
  // Rank i's `bytes_per_rank` bytes land at recv + i * bytes_per_rank on every rank. In place
  // when send == recv + rank * bytes_per_rank. Host communicators complete before returning
  // (stream is ignored); device communicators are stream-ordered.
  virtual Status all_gather(const void* send, void* recv, size_t bytes_per_rank,
                            cudaStream_t stream) = 0;
  // Every rank must agree on `value` (for example the batch size) before a collective runs:
  // returns kCommError naming `what` and the values on a mismatch, on every rank. The default
  // gathers the values through all_gather, so it needs a host-memory communicator: on a
  // device-memory one that does not override it, it returns kUnsupported (and cp_decode, which
  // asks it first unless DecodeConfig::check_agreement is off, fails saying so).
  virtual Status check_agree(long long value, const char* what);
  virtual Status barrier() = 0;
  // A channel the library's kernels exchange through directly (cpidx/device_channel.h), or
  // nullptr. The peer communicator has one; cp_decode then fuses its key gather into its
  // selection and merge kernels.
  virtual const DeviceChannel* device_channel() const { return nullptr; }
};

// P communicators whose ranks are threads of this process (one communicator per thread).
// Host memory. Each rank must call every collective from its own thread, in the same order.
std::vector<std::unique_ptr<Communicator>> make_thread_communicators(int world_size);

}  // namespace cpidx
