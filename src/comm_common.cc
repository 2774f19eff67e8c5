// Communicator::check_agree and check_agree_all, shared by every host-memory communicator: one
// all_gather of the values, then a comparison on each rank (so every rank reaches the same
// verdict).
#include <algorithm>
#include <climits>
#include <string>
#include <vector>

#include "cpidx/comm.h"

namespace cpidx {
namespace {

const char* name_of(const char* const* names, int i) {
  return names != nullptr && names[i] != nullptr ? names[i] : "value";
}

// One all_gather of every rank's `count` values, behind a word that says whether the rank gave
// them (null `values` with a count: a mistake that must fail every rank, not leave the others in
// the gather), then the first value that differs, named, with its values by rank (the same
// message on every rank).
Status gather_and_compare(Communicator& comm, const long long* values, const char* const* names,
                          int count) {
  const int world = comm.world_size();
  const size_t n = static_cast<size_t>(count) + 1;
  std::vector<long long> mine(n, 0);
  mine[0] = values != nullptr;
  if (values != nullptr) std::copy(values, values + count, mine.begin() + 1);
  std::vector<long long> all(static_cast<size_t>(world) * n, 0);
  CPIDX_RETURN_IF_ERROR(comm.all_gather(mine.data(), all.data(), n * sizeof(long long), nullptr));
  for (int r = 0; r < world; ++r) {
    if (all[static_cast<size_t>(r) * n] == 0) {
      return invalid_argument("check_agree_all: rank " + std::to_string(r) +
                              " passed null values with count " + std::to_string(count));
    }
  }
  for (size_t f = 1; f < n; ++f) {
    bool same = true;
    for (int r = 0; r < world; ++r) same = same && all[static_cast<size_t>(r) * n + f] == all[f];
    if (same) continue;
    ::cpidx::detail::Message os;
    os << "ranks disagree on " << name_of(names, static_cast<int>(f - 1))
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
  const char* const names[1] = {what};
  return gather_and_compare(*this, &value, names, 1);
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
    // at the same value. A rank without values offers a word no rank with them would send
    // (LLONG_MIN, which the library's agreements never use), so they disagree; if every rank
    // has none, each refuses on its own, all alike.
    for (int i = 0; i < count; ++i) {
      CPIDX_RETURN_IF_ERROR(check_agree(values != nullptr ? values[i] : LLONG_MIN,
                                        name_of(names, i)));
    }
    if (values == nullptr) {
      return invalid_argument("check_agree_all: null values with count " + std::to_string(count));
    }
    return Status::ok();
  }
  return gather_and_compare(*this, values, names, count);
}

}  // namespace cpidx
