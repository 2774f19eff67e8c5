// tools/rank_comm.cc: see rank_comm.h.
#include "rank_comm.h"

#include <cstring>

#if defined(CPIDX_WITH_CUDA)
#include <cuda_runtime.h>
#endif
#if defined(CPIDX_WITH_NCCL)
#include "cpidx/comm_nccl.h"
#endif
#if defined(CPIDX_WITH_PEER)
#include "cpidx/comm_peer.h"
#endif

namespace cpidx::tools {

int process_device(const Communicator& host) {
  int count = 0;
#if defined(CPIDX_WITH_CUDA)
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
#endif
  return count > 0 ? host.rank() % count : -1;
}

Status make_process_communicator([[maybe_unused]] Communicator& host, [[maybe_unused]] int device,
                                 const std::string& exchange,
                                 [[maybe_unused]] size_t peer_max_bytes,
                                 std::unique_ptr<Communicator>* out) {
  out->reset();
  Status status;
  if (exchange == "peer") {
#if defined(CPIDX_WITH_PEER)
    *out = make_peer_communicator(host, device, peer_max_bytes, &status);
    return status;
#else
    return unsupported("this cpidx was built without the peer communicator (needs CUDA)");
#endif
  }
  if (exchange != "nccl") {
    return Status(StatusCode::kInvalidArgument, "exchange must be nccl or peer, got " + exchange);
  }
#if defined(CPIDX_WITH_NCCL)
  // Rank 0's id reaches every rank through a host all_gather (the other ranks' bytes unused).
  NcclUniqueId mine{};
  if (host.rank() == 0) mine = nccl_unique_id(&status);
  std::string gathered(mine.size() * static_cast<size_t>(host.world_size()), '\0');
  if (Status s = host.all_gather(mine.data(), gathered.data(), mine.size(), nullptr); !s.is_ok()) {
    return s;
  }
  NcclUniqueId id{};
  std::memcpy(id.data(), gathered.data(), id.size());
  if (!status.is_ok()) {
    // The peers reach make_nccl_communicator's agreement and fail there with this rank.
    host.check_agree(-1, "NCCL communicator world size (-1: a rank refused its arguments)");
    return status;
  }
  *out = make_nccl_communicator(id, host.world_size(), host.rank(), device, &status, &host);
  return status;
#else
  return unsupported("this cpidx was built without NCCL");
#endif
}

}  // namespace cpidx::tools
