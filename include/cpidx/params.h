// cpidx/params.h: framework-free descriptions of the inputs and outputs of each op.
// Raw pointers + explicit strides (in elements). The CPU reference and the CUDA kernels take
// the same structs, so both index the cache and the tables identically.
#pragma once

#include <cstdint>

#include "cpidx/contract.h"

namespace cpidx {

// The paged index-key cache: [num_pages, kBlockSize, kHeadDim], contiguous, one key per token
// shared by all index heads. bf16 (raw uint16 bits) or fp8 e4m3 (raw bytes, no scale).
struct PagedCache {
  const void* data = nullptr;  // [num_pages, BS, D]
  DType dtype = DType::kBF16;
  int64_t num_pages = 0;
};

// Selection settings (CONTRACT.md section 4).
struct Selection {
  int topk = 16;          // K, 1..kMaxTopK
  int init_blocks = 0;    // forced leading blocks
  int local_blocks = 1;   // forced trailing blocks
};

// One decode step's inputs for the heads being scored. Row `row = req * query_len + t` sits at
// pos = seq_lens[req] - query_len + t and sees positions 0..pos.
struct DecodeInputs {
  const uint16_t* query = nullptr;  // [n, num_heads, D] bf16 bits; dim stride 1
  int64_t q_row_stride = 0;         // elements between rows
  int64_t q_head_stride = 0;        // elements between heads
  int num_heads = 0;                // heads in `query` (all T for context-parallel scoring)
  PagedCache cache;
  const int32_t* block_table = nullptr;  // [num_reqs, >= cdiv(max_seq_len, BS)], column stride 1
  int64_t bt_row_stride = 0;             // elements between block-table rows
  const int32_t* seq_lens = nullptr;     // [num_reqs]
  int num_reqs = 0;
  int query_len = 1;                     // Q
  int32_t max_seq_len = 0;               // construction bound; seq_lens are clamped to it
  float scale = 1.0f;                    // > 0, multiplied into every dot in fp32
  // GPU steps: a device int32 (4-byte aligned) that this call ORs its DeviceError bits into,
  // in place of the Decoder's own flag (Decoder::error_flag(), then left untouched); null: the
  // Decoder's. Lets a caller keep one flag per call or per layer without a clear and a copy.
  // The CPU reference returns its bits instead and ignores this pointer.
  int32_t* error_flag = nullptr;

  int64_t num_rows() const { return static_cast<int64_t>(num_reqs) * query_len; }
  int64_t max_blocks() const { return cdiv(max_seq_len, kBlockSize); }  // G
};

// Output block ids: [heads, n, K] int32 with explicit head and row strides, last dim contiguous.
struct TopkOutput {
  int32_t* ids = nullptr;
  int64_t head_stride = 0;
  int64_t row_stride = 0;
};

// Optional fused page-16 sparse table (CONTRACT.md section 6). All four set, or none.
struct SparseTableOutput {
  const int32_t* attention_block_table = nullptr;  // [num_reqs, >= G], column stride 1
  int64_t attn_bt_row_stride = 0;
  int32_t* table = nullptr;         // [n, K * BS / 16], row stride table_row_stride
  int64_t table_row_stride = 0;
  int32_t* context_lens = nullptr;  // [n]
  int block_page_stride = 0;        // 8 or 16
  bool enabled() const { return table != nullptr; }
};

// Prefill (CONTRACT.md section 7): query i of request req sits at context_lens[req] + i.
struct PrefillInputs {
  const uint16_t* query = nullptr;  // [num_tokens, num_heads, D] bf16 bits
  int64_t q_row_stride = 0;
  int64_t q_head_stride = 0;
  int num_heads = 0;
  PagedCache cache;
  const int32_t* block_table = nullptr;  // [num_reqs, >= cdiv(max_seq_len, BS)]
  int64_t bt_row_stride = 0;
  const int32_t* cu_seqlens_q = nullptr;  // [num_reqs + 1], starts at 0
  const int32_t* context_lens = nullptr;  // [num_reqs]: tokens cached before this chunk
  const int32_t* seq_lens = nullptr;      // [num_reqs]: context_lens + q_len
  int num_reqs = 0;
  int64_t num_tokens = 0;                 // cu_seqlens_q[num_reqs]
  int32_t max_seq_len = 0;
  float scale = 1.0f;
  int32_t* error_flag = nullptr;  // as DecodeInputs::error_flag, in place of the Prefiller's flag
};

}  // namespace cpidx
