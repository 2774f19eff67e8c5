// cpidx/comm.h: the communicator the context-parallel decode uses, modelled on ncclAllGather.
// Implementations: ranks as threads of one process (comm_threads), MPI processes (cpidx_comm_mpi),
// NCCL (cpidx_comm_nccl). No framework header is included here.
#pragma once

#include <cstddef>
#include <cstdint>
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
  // (stream is ignored); device communicators are stream-ordered. The arguments must be valid
  // on every rank: the thread communicator turns one rank's mistake into an error on all, but
  // MPI, NCCL and the peer communicator refuse it on that rank alone, before the collective,
  // leaving the others in it (cp_decode agrees on its sizes first, check_agree).
  virtual Status all_gather(const void* send, void* recv, size_t bytes_per_rank,
                            cudaStream_t stream) = 0;
  // Every rank must agree on `value` (for example the batch size) before a collective runs:
  // returns kCommError naming `what` and the values on a mismatch, on every rank. The default
  // gathers the values through all_gather, so it needs a host-memory communicator: on a
  // device-memory one that does not override it, it returns kUnsupported (and cp_decode, which
  // asks it first unless DecodeConfig::check_agreement is off, fails saying so).
  virtual Status check_agree(long long value, const char* what);
  // Every rank must agree on each of values[0..count) (a step's settings, say, named names[i]):
  // returns kCommError naming the first that differs and its values by rank, on every rank. The
  // default gathers them in one all_gather on a host-memory communicator, and asks check_agree
  // for each in turn on a device-memory one (`count` host rounds: the library's NCCL and peer
  // communicators forward it to their host channel, one round; a subclass of your own should
  // too). `count` is the same on every rank: 0 agrees at once, a negative one is kInvalidArgument
  // (neither makes a collective). Null `values` with a count fail every rank that agrees through
  // host memory: kInvalidArgument naming the lowest such rank (the default), or the kCommError
  // of the first value where some ranks gave theirs (a device-memory one's check_agree rounds).
  // An NCCL communicator without a host channel checks nothing across ranks, so only a rank
  // without values fails there. Null `names` (or a null name) are named "value".
  virtual Status check_agree_all(const long long* values, const char* const* names, int count);
  virtual Status barrier() = 0;
  // The most bytes a rank may send in one all_gather (the peer communicator's bound, fixed at
  // its creation); SIZE_MAX when any size goes. cp_decode checks its gathers against it before
  // its first collective, so a batch too large is refused before anything runs.
  virtual size_t max_bytes_per_rank() const { return SIZE_MAX; }
  // A channel the library's kernels exchange through directly (cpidx/device_channel.h), or
  // nullptr. The peer communicator has one; cp_decode then fuses its key gather into its
  // selection and merge kernels.
  virtual const DeviceChannel* device_channel() const { return nullptr; }
  // The CUDA device a device-memory communicator gathers on, or -1 where it does not say (host
  // memory, or a subclass of your own). Decoder::cp_decode refuses one on another device than
  // its own: its gathers would run on that device, unordered with the Decoder's stream.
  virtual int device() const { return -1; }
};

// P communicators whose ranks are threads of this process (one communicator per thread).
// Host memory. Each rank must call every collective from its own thread, in the same order.
std::vector<std::unique_ptr<Communicator>> make_thread_communicators(int world_size);

}  // namespace cpidx
