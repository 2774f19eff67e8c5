// tools/mpi_session.cc: MPI start-up and shut-down for the `cpidx` tool. The only tool file that
// sees mpi.h; compiled to kUnsupported stubs when the build has no MPI.
#include "mpi_session.h"

#include <cstdlib>
#include <string>

#if defined(CPIDX_WITH_MPI)
#include <mpi.h>

#include "cpidx/comm_mpi.h"
#endif

namespace cpidx::tools {

bool built_with_mpi() {
#if defined(CPIDX_WITH_MPI)
  return true;
#else
  return false;
#endif
}

bool launched_by_mpi() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && std::atoi(value) > 1) return true;
  }
  return false;
}

#if defined(CPIDX_WITH_MPI)

MpiSession::~MpiSession() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owns_init_ && !finalized) MPI_Finalize();
}

Status MpiSession::start(int* argc, char*** argv, std::unique_ptr<Communicator>* world) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    if (MPI_Init(argc, argv) != MPI_SUCCESS) {
      return Status(StatusCode::kCommError, "MPI_Init failed");
    }
    owns_init_ = true;
  }
  Status status;
  *world = make_mpi_communicator(&status);
  return status;
}

#else

MpiSession::~MpiSession() = default;

Status MpiSession::start(int*, char***, std::unique_ptr<Communicator>*) {
  return unsupported(
      "this cpidx was built without MPI (install libopenmpi-dev and reconfigure); run it "
      "without mpirun, where --ranks ranks run as threads");
}

#endif

}  // namespace cpidx::tools
