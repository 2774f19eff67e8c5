// cpidx/workspace.h: the decode workspace, sized and carved by one routine (offsets from a
// base), so the byte count a caller allocates and the buffers the kernels use cannot drift.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cpidx {

struct DecodeConfig;

struct DecodeWorkspaceLayout {
  // Byte offsets from the workspace base.
  // Per-(CTA, request) lists: a call's [H * Q, grid + num_reqs, K] keys, so
  // T * (Qmax * grid + max_tokens) * K in all (Q * num_reqs <= max_tokens).
  size_t partial = 0;
  size_t error_flag = 0;  // int32
  size_t q_send = 0;      // [max_tokens, L, D] bf16 (context-parallel only)
  size_t q_recv = 0;      // [P, max_tokens, L, D] bf16
  size_t keys_send = 0;   // [T, max_tokens, K] keys
  size_t keys_recv = 0;   // [P, T, max_tokens, K] keys
  size_t split_keys = 0;  // [padded(T * Qmax), split_max_pages] keys (split path)
  // [grid + 1] uint64: the split path's unclaimed page range per CTA (all ones: not started),
  // then a count of CTAs done with them (zero).
  size_t steal_words = 0;
  int64_t split_max_pages = 0;  // 0: no split path
  // Steps of at most this many pages split whatever their lengths; larger ones (up to
  // split_max_pages) only when no request owns more than split_longest_pages pages.
  int64_t split_any_pages = 0;
  int64_t split_longest_pages = 0;
  size_t total = 0;       // bytes to allocate
};

// `grid` is the largest scoring grid a Decoder of `config` launches (DecodePlan::max_grid, which
// may exceed DecodePlan::grid); a Decoder's own layout totals DecodePlan::workspace_bytes.
DecodeWorkspaceLayout decode_workspace_layout(const DecodeConfig& config, int grid);

}  // namespace cpidx
