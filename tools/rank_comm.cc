// tools/rank_comm.cc: see rank_comm.h.
#include "rank_comm.h"

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
  *out = make_nccl_communicator(host, device, &status);
  return status;
#else
  return unsupported("this cpidx was built without NCCL");
#endif
}

}  // namespace cpidx::tools
