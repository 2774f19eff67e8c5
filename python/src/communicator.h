// python/src/communicator.h: the Python object behind cpidx.Communicator, shared by the comm and
// decoder bindings. It owns one C++ communicator until close() (every rank together: the C++
// destructor, collective for a peer communicator across processes) or until Python drops it
// (a finalizer, which never makes a collective: a peer communicator is abandoned, comm_peer.h).
#pragma once

#include <nanobind/nanobind.h>

#include <memory>
#include <optional>
#include <string>

#include "cpidx/comm.h"

namespace cpidx::py {

namespace nb = nanobind;

class PyCommunicator {
 public:
  // `kind` names it in messages ("nccl", "peer", "threads"); `bootstrap` is the PyCommunicator a
  // peer communicator was built over, held (and kept from closing) while this one is open.
  PyCommunicator(std::unique_ptr<Communicator> comm, std::string kind,
                 nb::object bootstrap = nb::object());
  ~PyCommunicator();
  PyCommunicator(const PyCommunicator&) = delete;
  PyCommunicator& operator=(const PyCommunicator&) = delete;

  // The open communicator; raises RuntimeError naming `arg` (when given) and this communicator
  // once it is closed.
  Communicator& get(const char* arg = nullptr);
  // Collective and idempotent. Refused (RuntimeError) while a peer communicator built over this
  // one is open, while a call that released the GIL still uses it, or (NCCL) while a CUDA graph
  // that captured one of its gathers lives: NCCL's destroy would wait for it forever. (A
  // finalizer destroys it anyway: the C++ destructor then leaves the ncclComm_t to the process.)
  // A peer communicator under such a graph is not refused (one rank refusing would leave the
  // others in the collective destructor): its destructor keeps the buffers the graph uses.
  void close();
  // Why close() would raise now (the same checks, NCCL's wait for live graphs included), or
  // nothing; closes nothing. ignore_dependents: the open peer communicators built over this one
  // are about to close first (a teardown that agrees with its peers before closing anything).
  // peer_graphs: a peer communicator's gathers held by live graphs are a reason too (for such
  // a teardown, whose own buffers the graphs use as well).
  std::optional<std::string> close_blocker(bool ignore_dependents, bool peer_graphs);
  // nccl_gathers_in_live_graphs / peer_gathers_in_live_graphs; -1 for other kinds or closed.
  long long gathers_in_live_graphs(double wait_seconds);
  // Process exit: lets go of the communicator without destroying it (its memory, threads and
  // mappings go with the process). A destroy could wait forever there: NCCL's waits for every
  // live CUDA graph that captured one of its kernels, and an engine's graphs usually outlive
  // the atexit handlers; a peer communicator's collective destructor waits for every rank.
  void leak_at_exit();
  bool closed() const { return comm_ == nullptr; }
  const std::string& kind() const { return kind_; }
  // "cpidx.Communicator(peer, rank 0 of 2)".
  std::string describe() const;

  // Marks the communicator busy for the lifetime of the guard, so close() from another thread
  // cannot destroy it under a call that released the GIL. Create and destroy it with the GIL.
  class Use {
   public:
    Use(PyCommunicator& owner, const char* arg) : owner_(owner), comm_(owner.get(arg)) {
      ++owner_.in_use_;
    }
    ~Use() { --owner_.in_use_; }
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;
    Communicator& comm() const { return comm_; }

   private:
    PyCommunicator& owner_;
    Communicator& comm_;
  };

 private:
  // Drops the reference to the bootstrap (it may then be closed or collected).
  void release_bootstrap();

  std::unique_ptr<Communicator> comm_;
  std::string kind_;
  int rank_ = 0, world_ = 0;
  nb::object bootstrap_;
  // bootstrap_'s C++ side, kept so that the finalizer needs no cast.
  PyCommunicator* bootstrap_owner_ = nullptr;
  int dependents_ = 0;  // open peer communicators built over this one
  int in_use_ = 0;      // Use guards alive
};

}  // namespace cpidx::py
