// cpidx/comm_peer.h: a low-latency device Communicator for ranks on one host whose GPUs reach each
// other by peer access (NVLink / PCIe P2P). all_gather is one kernel of one-shot LL-style stores
// straight into every peer's receive buffer (about 2-3 µs per tiny gather in a CUDA graph, against
// 6-9 µs for NCCL; docs/design/exchange.md). Built as the optional target cpidx_comm_peer
// (cpidx::comm_peer) when CUDA is on; no CUDA header is included here.
//
// Selection rule: use the peer communicator when all ranks are on one host with P2P access and
// every payload fits max_bytes_per_rank (for cp_decode: cp_gather_bytes(geometry, max_tokens,
// K).larger(), cpidx/contract.h); NCCL otherwise. make_peer_communicator fails cleanly
// (a Status naming the reason, on every rank) in the other cases, so callers can fall back.
// It never uses NVLink multicast (NVLS, cuMulticastCreate).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "cpidx/comm.h"
#include "cpidx/status.h"

namespace cpidx {

// The most ranks the peer communicator serves (one NVLink / P2P clique).
constexpr int kPeerMaxRanks = 8;
// The largest max_bytes_per_rank accepted (the receive buffers are about 4 x P x this).
constexpr size_t kPeerMaxBytesPerRank = size_t{16} << 20;
// Bit of the device error word raised when a rank waited longer than the timeout for a peer.
constexpr int32_t kPeerErrorTimeout = 1;

// Collective: every rank of `bootstrap` calls it at the same time (each from its own thread or
// process), with the same max_bytes_per_rank. `bootstrap` is any communicator of the same ranks
// (threads, MPI, or NCCL: host or device memory); it is used at creation to exchange buffer
// handles, and afterwards by check_agree() and barrier(), so it must outlive the result.
//  - Ranks of one process (threads, ncclCommInitAll) exchange raw device pointers and enable
//    peer access (cudaDeviceEnablePeerAccess); ranks of different processes exchange CUDA IPC
//    handles (cudaIpcGetMemHandle / cudaIpcOpenMemHandle).
//  - Fails on every rank with kUnsupported (world > kPeerMaxRanks, a pair of GPUs without peer
//    access, ranks on different hosts, IPC refused) or kInvalidArgument (bad device, sizes that
//    differ between ranks, two ranks on one GPU), naming the rank and the reason: fall back to
//    NCCL then (which refuses a shared GPU too).
//  - allow_shared_gpu (the same on every rank) accepts ranks that share a GPU, which the
//    library's one-GPU tests use; see "Ranks that share one GPU" below for the hazard.
//  - A device-memory bootstrap (NCCL) gathers the set-up messages through a few KB staged on
//    `device`, or, where this rank cannot allocate there (a bad device), on the caller's current
//    device (its NCCL device, usually), so the failing rank still joins the gathers. A rank that
//    can stage on neither returns at once and leaves its peers in the bootstrap's gather.
// Allocates, once, peer-mapped receive buffers (2 parities x P ranks x the payload in 16-byte
// lines of 8 payload bytes: about 4 x P x max_bytes_per_rank), the same again for its device
// channel (below), and a few device words. A waiting
// rank gives up after `timeout_seconds` and raises kPeerErrorTimeout in its error word (below)
// instead of hanging. The caller's current device is restored. On failure returns nullptr and
// sets *status; *status is ok otherwise.
std::unique_ptr<Communicator> make_peer_communicator(Communicator& bootstrap, int device,
                                                     size_t max_bytes_per_rank, Status* status,
                                                     double timeout_seconds = 5.0,
                                                     bool allow_shared_gpu = false);

// The device int32 error word of a peer communicator (OR of kPeerError* bits since the last
// clear; the library never reads it back), or nullptr when `comm` is not one. Once a rank timed
// out, its later gathers no longer wait (their results are undefined): read the word after a
// step or a batch of graph replays, and recreate every rank's communicator if it is set. A
// rank that times out raises the bit in every rank's word (the words are peer-mapped), so each
// rank's own word tells it, also a rank that fell one call behind its peers (it skipped a
// gather they ran) and whose own waits then find their previous call's lines.
int32_t* peer_error_flag(Communicator& comm);
// Stream-ordered clear of that word (kInvalidArgument when `comm` is not a peer communicator).
Status clear_peer_error_flag(Communicator& comm, cudaStream_t stream);
// Blocking host read of that word into *bits (a cudaMemcpy: synchronize the streams that ran
// the step first; never inside a capture). kInvalidArgument when `comm` is not a peer
// communicator or `bits` is null.
Status read_peer_error_flag(Communicator& comm, int32_t* bits);

// How many gathers of `comm` sit in CUDA graphs (captured, or instantiated from such a graph)
// that are still alive; -1 when `comm` is not a peer communicator. When every rank lives in this
// process the count is theirs together (a replay of any rank's graph stores into every rank's
// buffer). cp_decode's steps count through their query gather (their key exchange through the
// device channel rides in the same graph). While it is above 0 the destructor frees nothing (a
// leak until the process exits, instead of a replay storing into freed memory): an owner that
// would rather not leak, and can agree with the other ranks first (the destructor is collective
// across processes), refuses to destroy then (the Python IndexerCPDecode.close() with a host
// group does). Otherwise each rank counts its own graphs. A graph's
// gathers leave the count when CUDA releases the graph's last reference, on an internal thread,
// which can trail cudaGraphExecDestroy / cudaGraphDestroy: with wait_seconds > 0 the call first
// synchronises the communicator's device, then waits up to that long for the count to reach 0.
long long peer_gathers_in_live_graphs(Communicator& comm, double wait_seconds = 0);

// Lets go of a peer communicator without a collective, for owners that cannot promise that every
// rank destroys its communicator at the same time: a garbage collector, interpreter or process
// exit, a rank whose peers exited or failed. It synchronises the communicator's device (a gather
// still waiting for an exited peer gives up after timeout_seconds), closes this rank's mappings
// of the peers' buffers, skips the bootstrap barrier (the bootstrap is not used, so it may be gone
// already) and deliberately leaks this rank's own buffers and device words (about
// 8 x P x max_bytes_per_rank) until the process exits; while a live CUDA graph holds its gathers,
// its mappings of the peers' buffers stay open too.
// The trade-off: a peer that has not let go yet may still map this rank's buffers and store into
// them; the collective destructor waits for every peer before freeing them, this function keeps
// them allocated instead, so it never waits for a peer that exited or tears down later but never
// gives the memory back. Prefer destruction when every rank can do it together while the
// bootstrap lives (a deliberate shutdown); use this everywhere else.
// When *comm holds a peer communicator, *comm is reset whatever the CUDA calls return; their
// first failure comes back as kCudaError (the mappings are closed as far as possible). ok for an
// empty *comm; kInvalidArgument, *comm untouched, when comm is null or holds another kind of
// communicator (destroy those as usual).
Status abandon_peer_communicator(std::unique_ptr<Communicator>* comm);

// Semantics of the peer communicator:
//  - memory_space() is kDevice. all_gather(send, recv, bytes, stream) enqueues one kernel on
//    `stream` (a stream of the communicator's device) and returns at once: no host
//    synchronisation, no allocation, so it can be captured in a CUDA graph and replayed any
//    number of times (the per-call epochs live on the device). bytes_per_rank must be at most
//    max_bytes_per_rank (kInvalidArgument otherwise); any size works, 8-byte multiples on
//    8-byte aligned buffers take the fast path. In place when send == recv + rank * bytes.
//  - Ordering: every rank must issue the same sequence of gathers (same sizes), each rank's
//    gathers in one stream order (one stream, or streams joined by events), as with NCCL.
//    A rank may run at most one gather ahead of a peer: the kernel enforces it by waiting.
//  - check_agree() and barrier() forward to the bootstrap communicator.
//  - Ranks that share one GPU are refused unless allow_shared_gpu (the library's one-GPU tests
//    put two ranks there), because they share its SMs: one rank's cp_decode launches its
//    scoring grid early, behind its query gather, and that grid can hold every SM while the
//    gather waits for the other rank's, which then finds no SM until the timeout. Give each
//    rank its own GPU, as NCCL requires.
//  - device_channel() (cpidx/device_channel.h) is a second set of peer-mapped lines of the same
//    capacity, which cp_decode writes from its selection kernel and polls from its merge kernel:
//    the key gather costs no kernel of its own (DecodeConfig::fused_exchange). Its timeouts
//    raise the same error word.
//  - Destruction: make sure no gather is in flight (synchronise the streams), and destroy the
//    CUDA graphs that captured gathers first. When any peer is in another process, the
//    destructor is collective: the ranks tell each other whether a live graph holds their
//    gathers (one bootstrap.barrier()), close the IPC mappings, then wait in a second barrier
//    before freeing their buffers, so every rank must destroy its communicator (each from its
//    own thread or process) while the bootstrap is still alive. While a live graph holds a
//    gather of any rank (peer_gathers_in_live_graphs, after a 0.1 s grace for graphs destroyed
//    just before; 0.01 s within a burst of held objects, as Decoder's destructor), no rank
//    frees its buffers, and the holder keeps its mappings: they stay until the process
//    exits, so that a replay stores into memory still allocated (its gathers then time out,
//    raising the error word, once the peers are gone). Ranks of one process destroy theirs
//    without a collective, after synchronising the other ranks' devices (their kernels may
//    still store into this rank's buffer), so not while any of those devices captures a
//    graph. abandon_peer_communicator (above) is the non-collective alternative in either
//    case.

}  // namespace cpidx
