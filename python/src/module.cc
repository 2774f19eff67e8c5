// python/src/module.cc: the one entry point of cpidx._C; each family registers itself.
#include <nanobind/nanobind.h>

#include "cpidx/version.h"

namespace nb = nanobind;

namespace cpidx::py {
void bind_comm(nb::module_& m);
void bind_reference(nb::module_& m);
void bind_decoder(nb::module_& m);
void bind_prefiller(nb::module_& m);
}  // namespace cpidx::py

NB_MODULE(_C, m) {
  m.doc() = "cpidx native module: thin destination-passing bindings of the C++ library";
  m.attr("__version__") = CPIDX_VERSION;
#if defined(CPIDX_WITH_CUDA)
  m.attr("cuda_built") = true;
#else
  m.attr("cuda_built") = false;
#endif
  cpidx::py::bind_comm(m);
  cpidx::py::bind_reference(m);
  cpidx::py::bind_decoder(m);
  cpidx::py::bind_prefiller(m);
}
