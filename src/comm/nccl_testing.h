// src/comm/nccl_testing.h: a fault the library's tests inject into the NCCL factory; not part of
// the public API (nothing under include/ declares it).
#pragma once

namespace cpidx::comm_testing {

// The next make_nccl_communicator of rank `rank` in this process takes its successful
// ncclCommInitRank as failed (aborting the communicator), as a rank whose initialisation fails
// late would (out of memory, say) while its peers' returned. -1 clears it.
void fail_next_nccl_init_on_rank(int rank);

}  // namespace cpidx::comm_testing
