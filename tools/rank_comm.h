// tools/rank_comm.h: the device communicator of a rank whose ranks are processes (under
// mpirun), for `cpidx bench` and `cpidx demo`: NCCL or the peer communicator (CUDA IPC), each
// bootstrapped over the host communicator of the processes.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "cpidx/comm.h"
#include "cpidx/status.h"

namespace cpidx::tools {

// The per-rank payload bound the tools make a peer communicator with for a step whose larger
// gather is `need` bytes (cp_gather_bytes(...).larger()): at least 64 KiB, so the small shapes
// of a run share one communicator instead of remaking it.
inline size_t peer_payload_bound(size_t need) {
  return need > (size_t{64} << 10) ? need : size_t{64} << 10;
}

// This process's GPU: its rank modulo the visible devices (one host, as the peer communicator
// needs); -1 without a device.
int process_device(const Communicator& host);

// Collective over `host` (every rank calls it): the device communicator of this rank on `device`.
// `exchange` is "nccl" or "peer" (then `peer_max_bytes` bounds a gather's payload per rank).
// Every rank fails together (the factories agree through `host`), naming the reason; `host`
// must outlive the result. kUnsupported when the build lacks the communicator asked for.
Status make_process_communicator(Communicator& host, int device, const std::string& exchange,
                                 size_t peer_max_bytes, std::unique_ptr<Communicator>* out);

}  // namespace cpidx::tools
