// python/src/bind_comm.cc: the communicator family. `Communicator` is the handle the Decoder's
// cp_decode takes (python/src/communicator.h: close() is the collective teardown, dropping it
// never is); the NCCL one (cpidx/comm_nccl.h, when built) is bootstrapped from a 128-byte unique
// id that Python broadcasts over its own process group, the peer one (cpidx/comm_peer.h, when
// built) over another cpidx Communicator, usually that NCCL one.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "communicator.h"
#include "cpidx/comm.h"
#include "cpidx/contract.h"
#include "cpidx/indexer.h"
#include "tensor_args.h"

#if defined(CPIDX_PY_NCCL)
#include "cpidx/comm_nccl.h"
#endif
#if defined(CPIDX_PY_PEER)
#include "cpidx/comm_peer.h"
#endif

namespace cpidx::py {

PyCommunicator::PyCommunicator(std::unique_ptr<Communicator> comm, std::string kind,
                               nb::object bootstrap)
    : comm_(std::move(comm)), kind_(std::move(kind)), bootstrap_(std::move(bootstrap)) {
  if (comm_ != nullptr) {
    rank_ = comm_->rank();
    world_ = comm_->world_size();
  }
  if (bootstrap_.is_valid()) {
    bootstrap_owner_ = nb::cast<PyCommunicator*>(bootstrap_);
    ++bootstrap_owner_->dependents_;
  }
}

PyCommunicator::~PyCommunicator() {
#if defined(CPIDX_PY_PEER)
  // A finalizer cannot promise that every rank lets go at the same time (garbage collection,
  // interpreter exit, a peer that exited): never the collective destructor here.
  if (comm_ != nullptr && peer_error_flag(*comm_) != nullptr) {
    (void)abandon_peer_communicator(&comm_);  // nothing to raise to; *comm_ is reset regardless
  }
#endif
  comm_.reset();
  release_bootstrap();
}

void PyCommunicator::release_bootstrap() {
  if (bootstrap_owner_ == nullptr) return;
  --bootstrap_owner_->dependents_;
  bootstrap_owner_ = nullptr;
  bootstrap_.reset();
}

std::string PyCommunicator::describe() const {
  return "cpidx.Communicator(" + kind_ + ", rank " + std::to_string(rank_) + " of " +
         std::to_string(world_) + ")";
}

Communicator& PyCommunicator::get(const char* arg) {
  if (comm_ == nullptr) {
    const std::string prefix = arg != nullptr ? std::string(arg) + ": " : std::string();
    throw std::runtime_error(prefix + describe() + " is closed");
  }
  return *comm_;
}

long long PyCommunicator::gathers_in_live_graphs(double wait_seconds) {
  if (comm_ == nullptr) return -1;
  long long held = -1;
  Use use(*this, nullptr);         // not closed by another thread while the GIL is released
  nb::gil_scoped_release release;  // may synchronise the device and wait (released first)
#if defined(CPIDX_PY_NCCL)
  held = nccl_gathers_in_live_graphs(use.comm(), wait_seconds);
#endif
#if defined(CPIDX_PY_PEER)
  if (held < 0) held = peer_gathers_in_live_graphs(use.comm(), wait_seconds);
#endif
  (void)wait_seconds;
  return held;
}

std::optional<std::string> PyCommunicator::close_blocker(bool ignore_dependents,
                                                         bool peer_graphs) {
  if (comm_ == nullptr) return std::nullopt;
  if (dependents_ > 0 && !ignore_dependents) {
    return describe() + " is the bootstrap of " + std::to_string(dependents_) +
           " open peer communicator(s): close those first";
  }
  if (in_use_ > 0) {
    return describe() + " is in use by a call on another thread; close it after that call";
  }
  // NCCL's destroy would wait forever for a live graph that holds one of its gathers. The peer
  // communicator's destructor keeps its buffers instead (a leak, no hang), so close() goes
  // ahead: refusing on one rank alone would leave the others in its collective destructor.
  // Callers that agree across ranks first (IndexerCPDecode with a host group) ask for it too
  // (peer_graphs), since their own buffers must outlive such a graph.
#if defined(CPIDX_PY_PEER)
  const bool is_peer = peer_error_flag(*comm_) != nullptr;
#else
  const bool is_peer = false;
#endif
  if (!is_peer || peer_graphs) {
    const long long held = gathers_in_live_graphs(1.0);  // syncs, then waits up to a second
    if (held > 0) {
      return describe() + ": " + std::to_string(held) +
             " of its gathers are in CUDA graphs that are still alive (captured steps); delete "
             "those graphs first: " +
             (is_peer ? "their replays store into its buffers"
                      : "NCCL's destroy would wait for them forever");
    }
  }
  return std::nullopt;
}

void PyCommunicator::close() {
  if (comm_ == nullptr) return;
  if (const std::optional<std::string> why = close_blocker(false, false)) {
    throw std::runtime_error(*why);
  }
  std::unique_ptr<Communicator> comm = std::move(comm_);  // closed for every other thread now
  {
    nb::gil_scoped_release release;  // collective: waits for every rank
    comm.reset();
  }
  release_bootstrap();
}

void PyCommunicator::leak_at_exit() {
  if (comm_ == nullptr) return;
  (void)comm_.release();  // on purpose: the process is exiting
  release_bootstrap();
}

namespace {

std::unique_ptr<PyCommunicator> owned(std::unique_ptr<Communicator> comm, const char* kind,
                                      nb::object bootstrap = nb::object()) {
  return std::make_unique<PyCommunicator>(std::move(comm), kind, std::move(bootstrap));
}

}  // namespace

void bind_comm(nb::module_& m) {
  using namespace nb::literals;
  nb::class_<PyCommunicator>(
      m, "Communicator",
      "A cpidx communicator; pass it as `group` or to cp_decode. close() is collective (every "
      "rank calls it; afterwards any use raises); dropping it without close() never waits for "
      "other ranks (a peer communicator then keeps its own buffers until the process exits).")
      .def_prop_ro("rank", [](PyCommunicator& c) { return c.get().rank(); })
      .def_prop_ro("world_size", [](PyCommunicator& c) { return c.get().world_size(); })
      .def_prop_ro("device_memory",
                   [](PyCommunicator& c) { return c.get().memory_space() == MemorySpace::kDevice; })
      .def_prop_ro(
          "device", [](PyCommunicator& c) { return c.get().device(); },
          "The CUDA device its gathers run on (-1 for host memory).")
      .def_prop_ro(
          "kind", [](const PyCommunicator& c) { return c.kind(); }, "'nccl', 'peer' or 'threads'.")
      .def_prop_ro("closed", &PyCommunicator::closed)
      .def("close", &PyCommunicator::close,
           "Collective teardown: every rank calls it, in the same order for every communicator. "
           "A peer communicator closes its mappings, waits for every rank (through its "
           "bootstrap) and frees its buffers; close it before its bootstrap. Idempotent. Delete "
           "the CUDA graphs that captured its gathers first: an NCCL communicator raises "
           "RuntimeError, closing nothing, while one is alive (NCCL's destroy would wait for "
           "it); a peer one closes and keeps its buffers until the process exits (the graph's "
           "replays store into them).")
      .def("_close_blocker", &PyCommunicator::close_blocker, "ignore_dependents"_a = false,
           "peer_graphs"_a = false,
           "Why close() would raise now, or None; local, closes nothing. ignore_dependents: the "
           "open peer communicators built over it are about to close first. peer_graphs: a "
           "peer communicator's gathers held by live CUDA graphs are a reason too (for callers "
           "that agree across ranks before closing).")
      .def("_gathers_in_live_graphs", &PyCommunicator::gathers_in_live_graphs,
           "wait_seconds"_a = 0.0,
           "How many of its gathers sit in live CUDA graphs (NCCL or peer; -1 for others or "
           "once closed), after synchronising its device and waiting up to wait_seconds for "
           "graphs just destroyed.")
      .def(
          "read_error_flag",
          [](PyCommunicator& c) -> nb::object {
#if defined(CPIDX_PY_PEER)
            PyCommunicator::Use use(c, nullptr);  // not closed under the read
            if (peer_error_flag(use.comm()) == nullptr) return nb::none();
            int32_t bits = 0;
            Status st;
            {
              nb::gil_scoped_release release;  // a blocking device read
              st = read_peer_error_flag(use.comm(), &bits);
            }
            check_status(st);
            return nb::int_(bits);
#else
            (void)c.get();
            return nb::none();
#endif
          },
          "The peer communicator's error bits since the last clear (PEER_ERROR_TIMEOUT: a rank "
          "gave up waiting for a peer; the results of its gathers since are undefined, recreate "
          "every rank's communicator), or None for communicators without an error word (NCCL "
          "reports its own errors). A blocking device read: synchronise the streams that ran "
          "the gathers first; never inside a capture.")
      .def(
          "clear_error_flag",
          [](PyCommunicator& c, uintptr_t stream) {
#if defined(CPIDX_PY_PEER)
            PyCommunicator::Use use(c, nullptr);
            if (peer_error_flag(use.comm()) == nullptr) return;
            check_status(clear_peer_error_flag(use.comm(), reinterpret_cast<cudaStream_t>(stream)));
#else
            (void)c.get();
            (void)stream;
#endif
          },
          "stream"_a = 0,
          "Stream-ordered clear of the peer communicator's error bits (nothing for other kinds).")
      .def("_leak_at_exit", &PyCommunicator::leak_at_exit,
           "Process exit only: marks it closed without destroying it (no collective, no wait "
           "for live CUDA graphs); its resources go with the process.")
      .def("__repr__", [](const PyCommunicator& c) {
        return "<" + c.describe() + (c.closed() ? ", closed>" : ">");
      });

  m.def(
      "cp_gather_bytes",
      [](int total_heads, int world_size, int rank, int64_t max_tokens, int topk) {
        if (max_tokens < 1 || max_tokens > DecodeConfig::kMaxTokens) {  // a Decoder's bounds
          throw nb::value_error(("max_tokens: expected 1 to " +
                                 std::to_string(DecodeConfig::kMaxTokens) + ", got " +
                                 std::to_string(max_tokens))
                                    .c_str());
        }
        const Selection sel = selection(topk, 0, 0);
        Geometry geo;
        check_status(make_geometry(total_heads, world_size, rank, &geo));
        return cp_gather_bytes(geo, max_tokens, sel.topk).larger();
      },
      nb::kw_only(), "total_heads"_a, "world_size"_a, "rank"_a = 0, "max_tokens"_a, "topk"_a,
      "Bytes per rank of the larger all-gather of a context-parallel step of up to max_tokens "
      "rows (its queries or its keys): the max_bytes_per_rank a peer communicator needs.");

  m.def(
      "_thread_communicators",
      [](int world_size) {
        if (world_size < 1) {
          throw nb::value_error(
              ("world_size: expected >= 1, got " + std::to_string(world_size)).c_str());
        }
        std::vector<std::unique_ptr<PyCommunicator>> out;
        for (auto& c : make_thread_communicators(world_size)) {
          out.push_back(owned(std::move(c), "threads"));
        }
        return out;
      },
      "world_size"_a,
      "For tests: host-memory communicators whose ranks are threads of this process (each rank "
      "makes its collective calls from its own thread).");

#if defined(CPIDX_PY_NCCL)
  m.attr("has_nccl") = true;
  m.def(
      "nccl_unique_id",
      []() {
        Status st;
        const auto id = nccl_unique_id(&st);
        check_status(st);
        return nb::bytes(id.data(), id.size());
      },
      "A fresh NCCL unique id (128 bytes) for rank 0 to broadcast.");
  m.def(
      "make_nccl_communicator",
      [](nb::bytes id_bytes, int world_size, int rank, int device, double init_timeout_seconds) {
        NcclUniqueId id{};
        if (id_bytes.size() != id.size()) {
          throw nb::value_error(("id: expected " + std::to_string(id.size()) + " bytes, got " +
                                 std::to_string(id_bytes.size())).c_str());
        }
        std::memcpy(id.data(), id_bytes.c_str(), id.size());
        Status st;
        std::unique_ptr<Communicator> comm;
        {
          nb::gil_scoped_release release;  // every rank blocks here until all have joined
          comm = make_nccl_communicator(id, world_size, rank, device, &st, nullptr,
                                        init_timeout_seconds);
        }
        check_status(st);
        return owned(std::move(comm), "nccl");
      },
      "id"_a, "world_size"_a, "rank"_a, "device"_a,
      "init_timeout_seconds"_a = kNcclInitTimeoutSeconds,
      "An NCCL communicator (device memory, stream-ordered, graph-capturable) joined by every "
      "rank with the same id. A rank that has not joined within init_timeout_seconds (> 0, "
      "inf: no deadline) makes the others raise RuntimeError instead of waiting forever.");
  m.def("nccl_version", &nccl_version_text, "NCCL library and header versions, for reports.");
  m.attr("nccl_init_timeout_seconds") = kNcclInitTimeoutSeconds;
#else
  m.attr("has_nccl") = false;
#endif

  // The bit read_error_flag() raises when a rank gave up waiting for a peer.
  m.attr("PEER_ERROR_TIMEOUT") = 1;
#if defined(CPIDX_PY_PEER)
  static_assert(kPeerErrorTimeout == 1, "PEER_ERROR_TIMEOUT above must follow comm_peer.h");
  m.attr("has_peer") = true;
  m.def(
      "make_peer_communicator",
      [](PyCommunicator& bootstrap, int device, int64_t max_bytes_per_rank,
         double timeout_seconds, bool allow_shared_gpu) {
        Status st;
        std::unique_ptr<Communicator> comm;
        {
          PyCommunicator::Use boot(bootstrap, "bootstrap");  // not closed under the call
          // A negative bound goes to the library as 0, which every rank then refuses together
          // (a local raise here would leave the other ranks waiting in the collective).
          const size_t bound = max_bytes_per_rank < 0 ? 0 : static_cast<size_t>(max_bytes_per_rank);
          nb::gil_scoped_release release;  // collective: every rank blocks until all have joined
          comm = make_peer_communicator(boot.comm(), device, bound, &st, timeout_seconds,
                                        allow_shared_gpu);
        }
        check_status(st);
        return owned(std::move(comm), "peer", nb::find(&bootstrap));
      },
      "bootstrap"_a, "device"_a, "max_bytes_per_rank"_a, "timeout_seconds"_a = 5.0,
      "allow_shared_gpu"_a = false,
      "Collective: the peer communicator (one-shot stores into CUDA-IPC / peer-mapped buffers, "
      "ranks on one host with P2P access) of this rank on `device`, for gathers of up to "
      "max_bytes_per_rank bytes per rank (cp_gather_bytes). `bootstrap` (any cpidx "
      "Communicator of the same ranks, e.g. the NCCL one) is held, and cannot be closed, while "
      "this one is open. Every rank raises the same error when the host, the GPUs or an "
      "argument rule it out: fall back to NCCL then. Ranks that share a GPU are refused "
      "(ValueError) unless allow_shared_gpu (for tests: their kernels compete for its SMs).");
#else
  m.attr("has_peer") = false;
#endif
}

}  // namespace cpidx::py
