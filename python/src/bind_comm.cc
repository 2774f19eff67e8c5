// python/src/bind_comm.cc: the communicator family. `Communicator` is an opaque handle the
// Decoder's cp_decode takes; the NCCL one (cpidx/comm_nccl.h, when built) is bootstrapped from
// a 128-byte unique id that Python broadcasts over its own process group.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include <cstring>
#include <memory>
#include <string>

#include "cpidx/comm.h"
#include "tensor_args.h"

#if defined(CPIDX_PY_NCCL)
#include "cpidx/comm_nccl.h"
#endif

namespace cpidx::py {

void bind_comm(nb::module_& m) {
  using namespace nb::literals;
  nb::class_<Communicator>(m, "Communicator",
                           "A cpidx communicator (opaque); pass it as `group` or to cp_decode.")
      .def_prop_ro("rank", &Communicator::rank)
      .def_prop_ro("world_size", &Communicator::world_size)
      .def_prop_ro("device_memory", [](const Communicator& c) {
        return c.memory_space() == MemorySpace::kDevice;
      });

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
      [](nb::bytes id_bytes, int world_size, int rank, int device) {
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
          comm = make_nccl_communicator(id, world_size, rank, device, &st);
        }
        check_status(st);
        return comm;
      },
      "id"_a, "world_size"_a, "rank"_a, "device"_a,
      "An NCCL communicator (device memory, stream-ordered, graph-capturable) joined by every "
      "rank with the same id.");
  m.def("nccl_version", &nccl_version_text, "NCCL library and header versions, for reports.");
#else
  m.attr("has_nccl") = false;
#endif
}

}  // namespace cpidx::py
