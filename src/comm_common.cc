// Communicator::check_agree and check_agree_all, shared by every host-memory communicator: one
// all_gather of the values, then a comparison on each rank (so every rank reaches the same
// verdict).
#include <string>
#include <vector>

#include "cpidx/comm.h"

namespace cpidx {
namespace {

// One all_gather of every rank's `count` values, then the first value that differs, named, with
// its values by rank (the same message on every rank).
Status gather_and_compare(Communicator& comm, const long long* values, const char* const* names,
                          int count) {
  const int world = comm.world_size();
  const size_t n = static_cast<size_t>(count);
  std::vector<long long> all(static_cast<size_t>(world) * n, 0);
  CPIDX_RETURN_IF_ERROR(comm.all_gather(values, all.data(), n * sizeof(long long), nullptr));
  for (size_t f = 0; f < n; ++f) {
    bool same = true;
    for (int r = 0; r < world; ++r) same = same && all[static_cast<size_t>(r) * n + f] == all[f];
    if (same) continue;
    ::cpidx::detail::Message os;
    os << "ranks disagree on " << (names[f] != nullptr ? names[f] : "value")
       << ": values by rank [";
    for (int r = 0; r < world; ++r) os << (r ? ", " : "") << all[static_cast<size_t>(r) * n + f];
    os << "]";
    return Status(StatusCode::kCommError, os.str());
  }
  return Status::ok();
}

}  // namespace

Status Communicator::check_agree(long long value, const char* what) {
  if (memory_space() != MemorySpace::kHost) {
    return unsupported(std::string("check_agree on ") + (what != nullptr ? what : "value") +
                       " needs a host-memory communicator; this one gathers device memory");
  }
  return gather_and_compare(*this, &value, &what, 1);
}

Status Communicator::check_agree_all(const long long* values, const char* const* names,
                                     int count) {
  // No collective for either: `count` is the same on every rank (a count of its own on one rank
  // is a call sequence of its own, which no communicator can check).
  if (count < 0) {
    return invalid_argument("check_agree_all: count must be >= 0, got " + std::to_string(count));
  }
  if (count == 0) return Status::ok();
  if (memory_space() != MemorySpace::kHost) {
    // Each check_agree is collective and gives every rank the same verdict, so every rank stops
    // at the same value.
    for (int i = 0; i < count; ++i) CPIDX_RETURN_IF_ERROR(check_agree(values[i], names[i]));
    return Status::ok();
  }
  return gather_and_compare(*this, values, names, count);
}

}  // namespace cpidx
