// cpidx/comm_nccl.h: a Communicator whose all_gather is a stream-ordered ncclAllGather on device
// memory, so the context-parallel decode and its two exchanges can be captured in one CUDA graph.
// Built as the optional target cpidx_comm_nccl (cpidx::comm_nccl); nccl.h is not included here.
//
// NCCL environment: NVLink SHARP / multicast (NVLS) must stay off. Run with NCCL_NVLS_ENABLE=0;
// when the variable is unset, nccl_unique_id and the factories that create a communicator set it to
// 0, and they refuse (kUnsupported) while it asks for NVLS. adopt_nccl_communicator checks nothing
// of it: its ncclComm_t was made by its owner. NCCL reads the variable once per process, when its
// first communicator is created: setting it here takes effect only if the process (a framework that
// shares the NCCL library, say) has created none before, so set it at launch when it may have.
// cpidx never calls cuMulticastCreate. NCCL_GRAPH_MIXING_SUPPORT is left to the caller (see
// docs/design/exchange.md).
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "cpidx/comm.h"
#include "cpidx/status.h"

namespace cpidx {

// The bytes of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES).
using NcclUniqueId = std::array<char, 128>;

// A fresh NCCL unique id, made on one rank and handed to every rank by the caller (MPI_Bcast,
// torch.distributed, a file). On failure returns zeros and sets *status: kCommError from NCCL,
// kUnsupported while NCCL_NVLS_ENABLE asks for NVLS.
NcclUniqueId nccl_unique_id(Status* status);

// How long make_nccl_communicator waits, by default, for every rank to join: 10 minutes, the
// default collective timeout of torch.distributed.
inline constexpr double kNcclInitTimeoutSeconds = 600.0;

// Rank `rank` of `world` over `id`, on CUDA device `device` (ncclCommInitRank: collective, every
// rank calls it). `host_channel`, if given, is a host-memory communicator of the same ranks
// (MPI, threads) that check_agree() uses; it is not owned and must outlive the returned
// communicator. With a host channel, a rank whose arguments are refused makes every rank fail
// at once instead of leaving them waiting in the init.
// `init_timeout_seconds` (> 0; infinity for no deadline) bounds the wait for the other ranks:
// past it kCommError is returned, so a rank that never joins (it failed before the init without
// a host channel to tell, or its process is gone) cannot hold its peers forever. The init itself
// runs on a thread of its own, which is then left to end on its own (NCCL's blocking init cannot
// be interrupted) and aborts what it makes if it ever completes. The caller's current device is
// restored. On failure returns nullptr and sets *status; *status is ok otherwise.
std::unique_ptr<Communicator> make_nccl_communicator(
    const NcclUniqueId& id, int world, int rank, int device, Status* status,
    Communicator* host_channel = nullptr, double init_timeout_seconds = kNcclInitTimeoutSeconds);

// The same, bootstrapped over `host` (a host-memory communicator of the ranks: MPI, threads),
// which becomes the host channel: collective over `host`; rank 0 makes the unique id and `host`
// hands it out. Every rank fails together, naming the reason, when one cannot go on (its id,
// device or arguments refused). `host` must outlive the result.
std::unique_ptr<Communicator> make_nccl_communicator(
    Communicator& host, int device, Status* status,
    double init_timeout_seconds = kNcclInitTimeoutSeconds);

// Wraps an existing ncclComm_t (passed as void*), for example one owned by an engine. The
// communicator is used, never destroyed: its owner keeps it alive while the wrapper lives.
std::unique_ptr<Communicator> adopt_nccl_communicator(void* nccl_comm, Status* status,
                                                      Communicator* host_channel = nullptr);

// One communicator per device of `devices` (ncclCommInitAll): one process driving all its GPUs,
// rank i on devices[i]. Each has an internal thread-style host channel, so check_agree() catches
// disagreeing ranks; like thread communicators, each rank must then make its calls (cp_decode
// included) from its own host thread, concurrently with the others. On failure returns an empty
// vector and sets *status.
std::vector<std::unique_ptr<Communicator>> make_nccl_communicators_single_process(
    const std::vector<int>& devices, Status* status);

// How many of `comm`'s gathers sit in CUDA graphs (captured, or instantiated from such a graph)
// that are still alive; -1 when `comm` is not an NCCL communicator. NCCL's destroy does not
// return while such a graph lives, so the destructor then leaves the NCCL communicator to the
// process instead of destroying it (below); an owner that would rather not leak can refuse to
// destroy while this is above 0 (the Python binding's close() does). A graph's gathers leave
// the count when CUDA releases the graph's last reference, on an internal thread, which can
// trail cudaGraphExecDestroy / cudaGraphDestroy: with wait_seconds > 0 the call first
// synchronises the communicator's device, then waits up to that long for the count to reach 0.
long long nccl_gathers_in_live_graphs(Communicator& comm, double wait_seconds = 0);

// "NCCL 2.28.3 (library), 2.28.9 (headers)" for reports; "unavailable: <why>" on failure.
std::string nccl_version_text();

// Semantics of the NCCL communicators:
//  - memory_space() is kDevice: all_gather's buffers are device memory on the communicator's
//    device, and `stream` must belong to that device. all_gather enqueues one ncclAllGather of
//    ncclUint8 and returns at once (no host synchronisation), so it can be graph-captured.
//    Destroy every CUDA graph that captured a gather before the communicator: NCCL's destroy
//    waits until all such graphs are gone, so a communicator destroyed while one lives (after
//    a 0.1 s grace for graphs destroyed just before; 0.01 s within a burst of held objects, as
//    Decoder's destructor) leaves its ncclComm_t to the process instead of waiting forever
//    (nccl_gathers_in_live_graphs counts them).
//  - check_agree(value, what) forwards to the host channel. Without one (make_nccl_communicator
//    or adopt_nccl_communicator with host_channel == nullptr) there is no check: it returns ok,
//    and ranks that disagree on a batch shape are not caught before the collective.
//  - barrier() is a host barrier through the host channel; without one, a one-int ncclAllReduce
//    on an internal stream followed by a wait for that stream.
//  - Every NCCL failure is kCommError with ncclGetErrorString and ncclGetLastError.
//  - Only the init has a deadline, and ranks whose inits end differently are not told: a rank
//    whose init failed (or passed its deadline) after its peers' completed, or a peer gone
//    after the init, leaves the others in their next collective, as with any NCCL
//    communicator.

}  // namespace cpidx
