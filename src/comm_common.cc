// Communicator::check_agree, shared by every host-memory communicator: one all_gather of a
// long long, then a comparison on each rank (so every rank reaches the same verdict).
#include <vector>

#include "cpidx/comm.h"

namespace cpidx {

Status Communicator::check_agree(long long value, const char* what) {
  const char* name = what != nullptr ? what : "value";
  if (memory_space() != MemorySpace::kHost) {
    return unsupported(std::string("check_agree on ") + name +
                       " needs a host-memory communicator; this one gathers device memory");
  }
  const int world = world_size();
  std::vector<long long> values(static_cast<size_t>(world), 0);
  CPIDX_RETURN_IF_ERROR(all_gather(&value, values.data(), sizeof(long long), nullptr));
  bool same = true;
  for (long long v : values) same = same && v == values[0];
  if (same) return Status::ok();
  ::cpidx::detail::Message os;
  os << "ranks disagree on " << name << ": values by rank [";
  for (int i = 0; i < world; ++i) os << (i ? ", " : "") << values[static_cast<size_t>(i)];
  os << "]";
  return Status(StatusCode::kCommError, os.str());
}

}  // namespace cpidx
