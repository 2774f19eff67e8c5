// cpidx/comm_mpi.h: a Communicator whose ranks are MPI processes (one rank per process), with
// buffers in host memory. Built as the optional target cpidx_comm_mpi (cpidx::comm_mpi).
// mpi.h is not included here: the communicator handle crosses this header as a void*.
#pragma once

#include <memory>

#include "cpidx/comm.h"
#include "cpidx/status.h"

namespace cpidx {

// A communicator over MPI_COMM_WORLD. MPI must already be initialised (MPI_Init) and must stay
// initialised while the communicator is used. Collective: every process calls it. On failure
// returns nullptr and sets *status (kCommError naming the MPI error); *status is ok otherwise.
// The MPI_Comm_dup below runs under the parent's error handler (MPI_ERRORS_ARE_FATAL on
// MPI_COMM_WORLD unless the caller set another), which cpidx leaves as it is.
std::unique_ptr<Communicator> make_mpi_communicator(Status* status);

// The same over any MPI communicator: `mpi_comm_handle` points to an MPI_Comm (pass `&comm`).
// The communicator is duplicated (MPI_Comm_dup), so cpidx's collectives never match the
// caller's own messages; the duplicate is freed on destruction if MPI is still initialised.
// Errors on the duplicate are returned (MPI_ERRORS_RETURN), never fatal.
std::unique_ptr<Communicator> make_mpi_communicator(void* mpi_comm_handle, Status* status);

}  // namespace cpidx
