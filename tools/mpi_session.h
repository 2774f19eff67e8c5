// tools/mpi_session.h: the tool's side of MPI: detect an MPI launcher, initialise and finalise
// MPI, and hand out the MPI_COMM_WORLD communicator. Builds without MPI report kUnsupported.
#pragma once

#include <memory>

#include "cpidx/comm.h"
#include "cpidx/status.h"

namespace cpidx::tools {

// True when the build has the MPI communicator (cpidx_comm_mpi).
bool built_with_mpi();

// True when an MPI launcher started this process among several (OMPI_COMM_WORLD_SIZE, PMI_SIZE
// or PMIX_SIZE above 1). Only read to pick the mode at start-up, never as configuration.
bool launched_by_mpi();

// MPI_Init on construction (if not yet initialised), MPI_Finalize on destruction (if it did
// the init). start() returns the world communicator.
class MpiSession {
 public:
  MpiSession() = default;
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  ~MpiSession();
  Status start(int* argc, char*** argv, std::unique_ptr<Communicator>* world);

 private:
  bool owns_init_ = false;
};

}  // namespace cpidx::tools
