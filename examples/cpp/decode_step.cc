// examples/cpp/decode_step.cc: one decode step of the indexer from C++, against an installed
// cpidx (find_package(cpidx)). Three requests of random bf16 index keys in a shuffled paged
// cache, 4 index heads, one query token each: the CPU reference picks each (head, request)'s 16
// blocks; where the library was built with its kernels and a GPU is present, a cpidx::Decoder
// does the same on the GPU and the two are compared (ref::compare_ids: exact ids, swaps only
// between scores within 1e-3 relative of the 16th). Exits non-zero on any error or mismatch.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <numeric>
#include <random>
#include <vector>

#include "cpidx/indexer.h"
#include "cpidx/reference.h"
#include "cpidx/version.h"

#ifndef CPIDX_PACKAGE_VERSION
#define CPIDX_PACKAGE_VERSION "(not given)"
#endif

#if CPIDX_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

constexpr int kHeads = 4, kTopK = 16;
constexpr int32_t kMaxSeqLen = 8192;

int fail(const char* what, const cpidx::Status& st) {
  std::fprintf(stderr, "%s: %s\n", what, st.to_string().c_str());
  return 1;
}

#if CPIDX_WITH_CUDA
// What run_on_gpu did: ran the step, found a GPU the kernels do not run on, or failed.
enum class Gpu { kRan, kUnsupported, kFailed };

// The same step on the GPU: device copies of the inputs, one Decoder::decode, ids back.
Gpu run_on_gpu(const cpidx::DecodeInputs& host_in, const std::vector<uint16_t>& query,
               const std::vector<uint16_t>& cache, const std::vector<int32_t>& table,
               const std::vector<int32_t>& lens, std::vector<int32_t>* ids) {
  cpidx::DecodeConfig config;
  config.total_heads = kHeads;
  config.max_tokens = host_in.num_reqs;
  config.max_seq_len = kMaxSeqLen;
  config.sel.topk = kTopK;
  std::unique_ptr<cpidx::Decoder> decoder;
  cpidx::Status st = cpidx::Decoder::create(config, /*device=*/0, &decoder);
  if (st.code() == cpidx::StatusCode::kUnsupported) {  // not Hopper: it names the architectures
    std::printf("gpu: %s: the CPU reference only\n", st.message().c_str());
    return Gpu::kUnsupported;
  }
  if (!st) {
    fail("Decoder::create", st);
    return Gpu::kFailed;
  }
  auto copy = [](const auto& v, auto** dst) {
    const size_t bytes = v.size() * sizeof(v[0]);
    return cudaMalloc(reinterpret_cast<void**>(dst), bytes) == cudaSuccess &&
           cudaMemcpy(*dst, v.data(), bytes, cudaMemcpyHostToDevice) == cudaSuccess;
  };
  uint16_t *d_query = nullptr, *d_cache = nullptr;
  int32_t *d_table = nullptr, *d_lens = nullptr, *d_ids = nullptr;
  bool ok = copy(query, &d_query) && copy(cache, &d_cache) && copy(table, &d_table) &&
            copy(lens, &d_lens) && copy(*ids, &d_ids);
  if (ok) {
    cpidx::DecodeInputs in = host_in;  // the same strides and sizes, device pointers
    in.query = d_query;
    in.cache.data = d_cache;
    in.block_table = d_table;
    in.seq_lens = d_lens;
    const cpidx::TopkOutput out{d_ids, int64_t{in.num_reqs} * kTopK, kTopK};
    st = decoder->decode(in, out, /*table=*/nullptr, /*stream=*/nullptr);
    ok = st.is_ok() && cudaMemcpy(ids->data(), d_ids, ids->size() * sizeof(int32_t),
                                  cudaMemcpyDeviceToHost) == cudaSuccess;
  }
  for (void* p : std::initializer_list<void*>{d_query, d_cache, d_table, d_lens, d_ids}) {
    cudaFree(p);
  }
  if (!st) {
    fail("Decoder::decode", st);
    return Gpu::kFailed;
  }
  if (!ok) {
    std::fprintf(stderr, "CUDA: %s\n", cudaGetErrorString(cudaGetLastError()));
    return Gpu::kFailed;
  }
  return Gpu::kRan;
}
#endif

}  // namespace

int main() {
  std::printf("cpidx %s (headers), %s (CMake package)\n", CPIDX_VERSION, CPIDX_PACKAGE_VERSION);
  const std::vector<int32_t> lens = {1000, 4100, 130};  // tokens cached per request
  const int num_reqs = static_cast<int>(lens.size());
  const int64_t row_blocks = cpidx::cdiv(kMaxSeqLen, cpidx::kBlockSize);
  int64_t pages = 0;
  for (int32_t len : lens) pages += cpidx::cdiv(len, cpidx::kBlockSize);

  // Random keys and queries (bf16 bits), and a block table that scatters each request's blocks
  // over the cache's pages in shuffled order.
  std::mt19937 rng(2026);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> cache(pages * cpidx::kBlockSize * cpidx::kHeadDim);
  std::vector<uint16_t> query(int64_t{num_reqs} * kHeads * cpidx::kHeadDim);
  for (auto& v : cache) v = cpidx::ref::float_to_bf16(normal(rng));
  for (auto& v : query) v = cpidx::ref::float_to_bf16(normal(rng));
  std::vector<int32_t> order(pages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<int32_t> table(num_reqs * row_blocks, 0);
  for (int r = 0, next = 0; r < num_reqs; ++r) {
    for (int b = 0; b < cpidx::cdiv(lens[r], cpidx::kBlockSize); ++b) {
      table[r * row_blocks + b] = order[next++];
    }
  }

  cpidx::DecodeInputs in;
  in.query = query.data();
  in.q_row_stride = int64_t{kHeads} * cpidx::kHeadDim;
  in.q_head_stride = cpidx::kHeadDim;
  in.num_heads = kHeads;
  in.cache = {cache.data(), cpidx::DType::kBF16, pages};
  in.block_table = table.data();
  in.bt_row_stride = row_blocks;
  in.seq_lens = lens.data();
  in.num_reqs = num_reqs;
  in.query_len = 1;
  in.max_seq_len = kMaxSeqLen;
  in.scale = 1.0f / std::sqrt(static_cast<float>(cpidx::kHeadDim));
  cpidx::Selection sel;
  sel.topk = kTopK;

  // ids [head][row][K]: -1 past a request's visible blocks.
  std::vector<int32_t> ids(int64_t{kHeads} * num_reqs * kTopK, -7);
  const cpidx::TopkOutput out{ids.data(), int64_t{num_reqs} * kTopK, kTopK};
  int32_t err = 0;
  cpidx::Status st = cpidx::ref::decode_topk(in, sel, out, /*table=*/nullptr, &err);
  if (!st) return fail("ref::decode_topk", st);
  if (err != 0) {
    std::fprintf(stderr, "error bits %d on valid input\n", err);
    return 1;
  }
  for (int r = 0; r < num_reqs; ++r) {
    std::printf("head 0, request %d (%d tokens):", r, lens[r]);
    for (int k = 0; k < kTopK; ++k) std::printf(" %d", ids[r * kTopK + k]);
    std::printf("\n");
  }

#if CPIDX_WITH_CUDA
  if (!cpidx::gpu_available()) {
    std::printf("gpu: none found, the CPU reference only\n");
    return 0;
  }
  // The kernels are Hopper's (sm_90a): on another GPU, Decoder::create returns kUnsupported
  // naming the architectures they were built for, and the CPU ids stand.
  std::vector<int32_t> gpu_ids(ids.size(), -7);
  const Gpu gpu = run_on_gpu(in, query, cache, table, lens, &gpu_ids);
  if (gpu != Gpu::kRan) return gpu == Gpu::kUnsupported ? 0 : 1;
  const cpidx::TopkOutput got{gpu_ids.data(), out.head_stride, out.row_stride};
  const cpidx::ref::IdsComparison cmp = cpidx::ref::compare_ids(in, sel, got, out);
  std::printf("gpu: %lld rows exact, %lld near ties, %lld wrong%s%s\n",
              static_cast<long long>(cmp.exact_rows), static_cast<long long>(cmp.near_tie_rows),
              static_cast<long long>(cmp.bad_rows), cmp.bad_rows ? ": " : "",
              cmp.first_bad.c_str());
  return cmp.bad_rows == 0 ? 0 : 1;
#else
  std::printf("gpu: cpidx was built without its kernels, the CPU reference only\n");
  return 0;
#endif
}
