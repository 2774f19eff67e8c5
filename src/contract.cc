// Geometry of CONTRACT.md section 1 (local heads, replicas, head offset of a rank) and the
// dtype names. O(1); every failure names the numbers involved.
#include "cpidx/contract.h"

namespace cpidx {

const char* to_string(DType t) {
  switch (t) {
    case DType::kBF16:
      return "bf16";
    case DType::kFP8E4M3:
      return "fp8_e4m3";
  }
  return "unknown dtype";
}

Status make_geometry(int total_heads, int world_size, int rank, Geometry* out) {
  CPIDX_CHECK(out != nullptr, "geometry output is null");
  CPIDX_CHECK(total_heads >= 1 && total_heads <= kMaxHeads,
              "total_heads must be in [1, " << kMaxHeads << "], got " << total_heads);
  CPIDX_CHECK(world_size >= 1, "world_size must be >= 1, got " << world_size);
  CPIDX_CHECK(rank >= 0 && rank < world_size,
              "rank must be in [0, world_size) = [0, " << world_size << "), got " << rank);
  const bool divides =
      total_heads >= world_size ? total_heads % world_size == 0 : world_size % total_heads == 0;
  CPIDX_CHECK(divides, "total_heads (" << total_heads << ") and world_size (" << world_size
                                       << ") do not divide: need total_heads % world_size == 0"
                                       << " when total_heads >= world_size, or world_size % "
                                       << "total_heads == 0");
  Geometry g;
  g.total_heads = total_heads;
  g.world_size = world_size;
  g.rank = rank;
  g.local_heads = total_heads >= world_size ? total_heads / world_size : 1;
  g.replicas = total_heads >= world_size ? 1 : world_size / total_heads;
  g.head_offset = (rank / g.replicas) * g.local_heads;
  *out = g;
  return Status::ok();
}

CpGatherBytes cp_gather_bytes(const Geometry& geo, int64_t rows, int topk) {
  CpGatherBytes b;
  b.queries = static_cast<size_t>(rows) * geo.local_heads * kHeadDim * sizeof(uint16_t);
  b.keys = static_cast<size_t>(geo.total_heads) * rows * topk * sizeof(Key);
  return b;
}

}  // namespace cpidx
