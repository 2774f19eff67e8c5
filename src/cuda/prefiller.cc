// src/cuda/prefiller.cc: the Prefiller object (host validation before any kernel runs, the one-time
// plan and workspace, the prefill call as three launches on the caller's stream) and mixed_topk,
// an engine's decode + prefill rows into one output. Nothing allocates, synchronises or queries
// the device after create().
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "cpidx/prefill.h"
#include "cpidx/reference.h"
#include "graph_holds.h"
#include "host_util.h"
#include "prefill_kernels.h"
#include "reference/internal.h"

namespace cpidx {
namespace {

using cuda_host::align_up;

// The split lists are the only large buffer: max_tokens x H x K keys per split. Above this many
// bytes the workspace holds fewer splits at max_tokens (calls with fewer tokens still get more).
constexpr size_t kPartialBudgetBytes = size_t{512} << 20;

// Sizes and carves the workspace from one routine (offsets from the base).
struct PrefillWorkspaceLayout {
  size_t header = 0, tiles = 0, partial = 0, error_flag = 0, total = 0;
  int64_t tiles_capacity = 0, partial_keys = 0;
  int max_splits = 0;
};

PrefillWorkspaceLayout workspace_layout(const PrefillConfig& c) {
  PrefillWorkspaceLayout w;
  // Tiles are cut per request; with more heads a tile holds fewer tokens, so size for the most.
  w.tiles_capacity = cuda::prefill_max_tiles(c.max_tokens, c.max_tokens, kMaxHeads);
  const int64_t per_split = int64_t{c.max_tokens} * c.num_heads * c.sel.topk;
  const int64_t fit = static_cast<int64_t>(kPartialBudgetBytes / sizeof(Key)) / per_split;
  w.max_splits = static_cast<int>(std::clamp<int64_t>(fit, 1, cuda::kPrefillMaxSplits));
  w.partial_keys = per_split * w.max_splits;
  size_t o = 0;
  auto take = [&](size_t bytes) {
    o = align_up(o, 256);
    const size_t at = o;
    o += bytes;
    return at;
  };
  w.header = take(sizeof(cuda::PrefillPlanHeader));
  w.tiles = take(static_cast<size_t>(w.tiles_capacity) * sizeof(cuda::PrefillTile));
  w.partial = take(static_cast<size_t>(w.partial_keys) * sizeof(Key));
  w.error_flag = take(sizeof(int32_t));
  w.total = align_up(o, 256);
  return w;
}

}  // namespace

struct Prefiller::Impl {
  PrefillConfig cfg;
  PrefillPlan plan;
  cuda::PrefillLaunch launch;
  PrefillWorkspaceLayout layout;
  uint8_t* workspace = nullptr;
  // Launches held by live CUDA graphs, whose replays use the workspace (launches_in_live_graphs).
  cuda_host::GraphHolds holds;
  int device = 0;

  template <typename T>
  T* at(size_t offset) const { return reinterpret_cast<T*>(workspace + offset); }

  cuda::PrefillParams params(const PrefillInputs& in, const TopkOutput& out) const {
    cuda::PrefillParams p;
    cuda_host::set_common_params(p, in, cfg.sel);
    cuda_host::set_ids_output(p, out);
    p.query = in.query;
    p.q_head_stride = in.q_head_stride;
    p.cu_seqlens_q = in.cu_seqlens_q;
    p.context_lens = in.context_lens;
    p.num_tokens = in.num_tokens;
    p.header = at<cuda::PrefillPlanHeader>(layout.header);
    p.tiles = at<cuda::PrefillTile>(layout.tiles);
    p.tiles_capacity = layout.tiles_capacity;
    p.partial = at<Key>(layout.partial);
    p.error_flag = in.error_flag != nullptr ? in.error_flag : at<int32_t>(layout.error_flag);
    // As many splits as the workspace holds for this call's rows, up to what fills the device.
    const int64_t per_split = in.num_tokens * in.num_heads * cfg.sel.topk;
    const int fit = static_cast<int>(
        std::min<int64_t>(layout.partial_keys / per_split, cuda::kPrefillMaxSplits));
    p.splits = cuda::prefill_splits(in.num_tokens, in.num_heads, launch.sms, fit);
    return p;
  }
};

Prefiller::Prefiller(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Prefiller::~Prefiller() {
  // Not under a live graph that still uses it (Decoder::~Decoder).
  if (impl_ && impl_->holds.wait_on_destroy() == 0) {
    cuda_host::free_relaxed(impl_->workspace);
  }
}

long long Prefiller::launches_in_live_graphs(double wait_seconds) const {
  return impl_->holds.wait_for_release(wait_seconds);
}

Status Prefiller::create(const PrefillConfig& c, int device, std::unique_ptr<Prefiller>* out) {
  CPIDX_CHECK(out != nullptr, "out must not be null");
  CPIDX_RETURN_IF_ERROR(cuda_host::check_cache_dtype(c.cache_dtype));
  CPIDX_RETURN_IF_ERROR(ref::detail::check_selection(c.sel));
  CPIDX_CHECK(c.num_heads >= 1 && c.num_heads <= kMaxHeads,
              "num_heads must be in [1, " << kMaxHeads << "], got " << c.num_heads);
  CPIDX_CHECK(c.max_tokens >= 1, "max_tokens must be >= 1, got " << c.max_tokens);
  CPIDX_CHECK(c.max_seq_len >= 1, "max_seq_len must be >= 1, got " << c.max_seq_len);
  CPIDX_CHECK(c.kernel == PrefillKernel::kAuto || c.kernel == PrefillKernel::kMmaSync ||
                  c.kernel == PrefillKernel::kWgmma,
              "kernel must be auto, mma or wgmma, got code " << static_cast<int>(c.kernel));
  auto impl = std::make_unique<Impl>();
  impl->cfg = c;
  impl->layout = workspace_layout(c);
  impl->device = device;
  const Status st = cuda_host::on_device(device, [&]() -> Status {
    bool wgmma = false;
    if (c.kernel != PrefillKernel::kMmaSync) {
      CPIDX_CUDA_TRY(cuda::prefill_wgmma_available(device, &wgmma));
      if (c.kernel == PrefillKernel::kWgmma && !wgmma) {
        return unsupported("kernel wgmma needs a compute capability 9.0 device and a build with "
                           "sm_90a code; device " + std::to_string(device) +
                           " lacks one of them (use kernel mma or auto)");
      }
    }
    CPIDX_CUDA_TRY(cuda::plan_prefill(c.sel.topk, c.cache_dtype, device, wgmma, &impl->launch));
    CPIDX_CUDA_TRY(cudaMalloc(&impl->workspace, impl->layout.total));
    CPIDX_CUDA_TRY(cudaMemset(impl->workspace, 0, impl->layout.total));
    CPIDX_CUDA_TRY(cudaDeviceSynchronize());
    return Status::ok();
  });
  if (!st.is_ok()) {
    cuda_host::free_relaxed(impl->workspace);
    return st;
  }
  impl->plan.kernel = impl->launch.wgmma ? PrefillKernel::kWgmma : PrefillKernel::kMmaSync;
  impl->plan.stages = impl->launch.stages;
  impl->plan.smem_bytes = impl->launch.smem_bytes;
  impl->plan.max_splits = impl->layout.max_splits;
  impl->plan.workspace_bytes = impl->layout.total;
  out->reset(new Prefiller(std::move(impl)));
  return Status::ok();
}

const PrefillConfig& Prefiller::config() const { return impl_->cfg; }
const PrefillPlan& Prefiller::plan() const { return impl_->plan; }
int32_t* Prefiller::error_flag() const { return impl_->at<int32_t>(impl_->layout.error_flag); }

Status Prefiller::clear_error_flag(cudaStream_t stream) {
  CPIDX_RETURN_IF_ERROR(cuda_host::check_current_device(impl_->device, "Prefiller"));
  CPIDX_RETURN_IF_ERROR(impl_->holds.count_if_captured(stream));
  CPIDX_LAUNCH_TRY(cudaMemsetAsync(error_flag(), 0, sizeof(int32_t), stream));
  return Status::ok();
}

Status Prefiller::validate(const PrefillInputs& in, const TopkOutput& out) const {
  const PrefillConfig& c = impl_->cfg;
  CPIDX_RETURN_IF_ERROR(cuda_host::check_current_device(impl_->device, "Prefiller"));
  CPIDX_RETURN_IF_ERROR(ref::validate(in, c.sel));
  CPIDX_CHECK(in.num_heads <= c.num_heads, "query heads (num_heads) must be in [1, "
                                               << c.num_heads << "], got " << in.num_heads);
  CPIDX_CHECK(in.num_tokens <= c.max_tokens, "num_tokens (" << in.num_tokens
                                                             << ") exceeds max_tokens ("
                                                             << c.max_tokens << ")");
  // The plan kernel walks the requests in int32 passes of 1023: far from wrapping below 2^30.
  CPIDX_CHECK(in.num_reqs <= kMaxPrefillRequests,
              "num_reqs must be <= 2^30, got " << in.num_reqs);
  CPIDX_RETURN_IF_ERROR(cuda_host::check_kernel_inputs(
      in.query, in.q_row_stride, in.q_head_stride, in.cache, in.max_seq_len, c.max_seq_len,
      c.cache_dtype, in.error_flag, "Prefiller"));
  CPIDX_RETURN_IF_ERROR(ref::detail::check_ids(out, in.num_heads, in.num_tokens, c.sel.topk));
  ref::detail::CallSpans spans;
  spans.prefill_inputs(in);
  spans.ids(out, in.num_heads, in.num_tokens, c.sel.topk);
  spans.flag("error_flag", in.error_flag);
  return ref::detail::check_no_aliasing(spans);
}

Status Prefiller::prefill(const PrefillInputs& in, const TopkOutput& out, cudaStream_t stream) {
  CPIDX_RETURN_IF_ERROR(validate(in, out));
  CPIDX_RETURN_IF_ERROR(impl_->holds.count_if_captured(stream));
  CPIDX_LAUNCH_TRY(cuda::launch_prefill(impl_->params(in, out), impl_->launch, stream));
  return Status::ok();
}

Status mixed_topk(Decoder& dec, Communicator* comm, const DecodeInputs& decode_rows,
                  Prefiller& pre, const PrefillInputs& prefill_rows, int32_t* out,
                  int64_t head_stride, int64_t row_stride, cudaStream_t stream) {
  const bool has_decode = decode_rows.num_reqs > 0;
  const bool has_prefill = prefill_rows.num_reqs > 0;
  const int64_t nd = has_decode ? decode_rows.num_rows() : 0;
  const int64_t np = has_prefill ? prefill_rows.num_tokens : 0;
  const int k = dec.config().sel.topk;
  const TopkOutput all{out, head_stride, row_stride};
  const TopkOutput prefill_out{out + nd * row_stride, head_stride, row_stride};
  // The batch-level checks, then the prefill part's, so a bad prefill argument fails before the
  // decode part runs (the decode calls validate their own arguments before their first launch).
  const Status valid = [&]() -> Status {
    // A part is empty only at num_reqs == 0 (the header's rule); a negative count is a mistake,
    // not an empty part whose rows would be left unwritten.
    CPIDX_CHECK(decode_rows.num_reqs >= 0,
                "decode num_reqs must be >= 0 (0: no decode rows), got " << decode_rows.num_reqs);
    CPIDX_CHECK(prefill_rows.num_reqs >= 0, "prefill num_reqs must be >= 0 (0: no prefill rows), "
                                            "got " << prefill_rows.num_reqs);
    CPIDX_CHECK(has_prefill || prefill_rows.num_tokens == 0,
                "prefill num_tokens must be 0 when its num_reqs is 0, got "
                    << prefill_rows.num_tokens);
    CPIDX_CHECK(pre.config().sel.topk == k, "the Decoder's topk (" << k
                                                << ") and the Prefiller's ("
                                                << pre.config().sel.topk << ") must be equal");
    // Heads written by each part: the owned heads for a context-parallel decode.
    const int decode_heads = comm != nullptr ? dec.geometry().local_heads : decode_rows.num_heads;
    const int heads = has_decode ? decode_heads : prefill_rows.num_heads;
    CPIDX_CHECK(!has_decode || !has_prefill || prefill_rows.num_heads == decode_heads,
                "prefill heads (num_heads " << prefill_rows.num_heads
                                            << ") must equal the decode output heads ("
                                            << decode_heads << ")");
    if (!has_decode && !has_prefill) return Status::ok();
    CPIDX_RETURN_IF_ERROR(ref::detail::check_ids(all, heads, nd + np, k));
    // Each part checks its own rows; across the parts, neither's outputs (rows, error flag) may
    // overlap the other's inputs or outputs either: the prefill runs after the decode wrote. One
    // flag shared by both parts is fine.
    ref::detail::CallSpans spans;
    if (has_decode) spans.decode_inputs(decode_rows);
    if (has_prefill) spans.prefill_inputs(prefill_rows);
    spans.ids(all, heads, nd + np, k);
    if (has_decode) spans.flag("decode error_flag", decode_rows.error_flag);
    if (has_prefill && !(has_decode && prefill_rows.error_flag == decode_rows.error_flag)) {
      spans.flag("prefill error_flag", prefill_rows.error_flag);
    }
    CPIDX_RETURN_IF_ERROR(ref::detail::check_no_aliasing(spans));
    if (has_prefill) CPIDX_RETURN_IF_ERROR(pre.validate(prefill_rows, prefill_out));
    return Status::ok();
  }();
  const bool context_parallel = comm != nullptr && dec.config().world_size > 1;
  if (context_parallel && dec.config().check_agreement && !(has_decode && valid.is_ok())) {
    // This rank runs no cp_decode this step (its batch failed, or it has no decode rows): its
    // peers' cp_decode must hear so from the agreement, or they would wait for it in a
    // collective. Ranks that all have no decode rows agree on 0 and go on.
    const Status agree = comm->check_agree(valid.is_ok() ? 0 : -1, kCpRowsAgreement);
    CPIDX_RETURN_IF_ERROR(valid);
    CPIDX_RETURN_IF_ERROR(agree);
  }
  CPIDX_RETURN_IF_ERROR(valid);
  if (has_decode) {
    CPIDX_RETURN_IF_ERROR(comm != nullptr ? dec.cp_decode(*comm, decode_rows, all, nullptr, stream)
                                          : dec.decode(decode_rows, all, nullptr, stream));
  }
  if (has_prefill) CPIDX_RETURN_IF_ERROR(pre.prefill(prefill_rows, prefill_out, stream));
  return Status::ok();
}

}  // namespace cpidx
