// cpidx/prefill.h: the GPU prefill indexer (CONTRACT.md section 7) and the mixed decode + prefill
// step of an engine. One Prefiller per (device, head count, K, dtype) holds every buffer a call
// needs, sized at construction from max_tokens; a call validates its host-visible arguments,
// allocates nothing, never synchronises with the host and can be captured in a CUDA graph.
// One Prefiller serves every layer of a model (calls run in order on one stream).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "cpidx/comm.h"
#include "cpidx/contract.h"
#include "cpidx/indexer.h"
#include "cpidx/params.h"
#include "cpidx/status.h"

namespace cpidx {

// The scoring kernel. kMmaSync: warp-level mma.sync (any supported GPU). kWgmma: Hopper
// warpgroup MMA (needs compute capability 9.0 and a build for sm_90a; create() returns
// kUnsupported otherwise). kAuto: kWgmma where it is available, else kMmaSync. Both produce the
// contract's ids; they may differ only where the contract allows (near ties, section 4).
enum class PrefillKernel { kAuto, kMmaSync, kWgmma };
inline const char* to_string(PrefillKernel k) {
  return k == PrefillKernel::kMmaSync ? "mma" : k == PrefillKernel::kWgmma ? "wgmma" : "auto";
}

// Requests a prefill call may carry (padding requests without tokens included).
inline constexpr int kMaxPrefillRequests = 1 << 30;

struct PrefillConfig {
  int num_heads = 4;             // heads scored per call (the rank's L), 1..kMaxHeads
  int max_tokens = 0;            // bound on prefill tokens per call (PrefillInputs::num_tokens)
  int32_t max_seq_len = 0;       // bound on tokens per request (pass max_model_len)
  Selection sel;                 // K, init, local
  DType cache_dtype = DType::kBF16;
  PrefillKernel kernel = PrefillKernel::kAuto;
};

// Launch facts chosen at construction (for reports and benchmarks).
struct PrefillPlan {
  PrefillKernel kernel = PrefillKernel::kMmaSync;  // the scoring kernel chosen (never kAuto)
  int stages = 0;             // key pages in flight per CTA
  size_t smem_bytes = 0;      // dynamic shared memory of the scoring kernel
  int max_splits = 0;         // key-range splits the workspace holds at max_tokens
  size_t workspace_bytes = 0;
};

// Every call that touches the device needs the device the Prefiller was created on current, and
// refuses another (kInvalidArgument) before anything runs.
class Prefiller {
 public:
  // Checks the configuration, plans the kernels for `device` and allocates the workspace there.
  static Status create(const PrefillConfig& config, int device, std::unique_ptr<Prefiller>* out);
  ~Prefiller();
  Prefiller(const Prefiller&) = delete;
  Prefiller& operator=(const Prefiller&) = delete;

  const PrefillConfig& config() const;
  const PrefillPlan& plan() const;

  // The host-visible checks of prefill() alone (nothing is launched): lets a caller that runs
  // several ops in one step fail before the first of them.
  Status validate(const PrefillInputs& in, const TopkOutput& out) const;

  // ids [in.num_heads, in.num_tokens, K] into `out` (in.num_heads <= config().num_heads);
  // rows no request covers get -1. Rows of `out` past num_tokens are not touched.
  Status prefill(const PrefillInputs& in, const TopkOutput& out, cudaStream_t stream);

  // Device int32: OR of DeviceError bits raised by bad device-side values since the last clear,
  // by the calls whose inputs name no flag of their own (PrefillInputs::error_flag). The library
  // never reads it back itself.
  int32_t* error_flag() const;
  Status clear_error_flag(cudaStream_t stream);

  // How many of its launches sit in live CUDA graphs; while above 0 the destructor keeps the
  // workspace (Decoder::launches_in_live_graphs).
  long long launches_in_live_graphs(double wait_seconds = 0) const;

 private:
  struct Impl;
  explicit Prefiller(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// An engine's mixed batch into one persistent output `out` ([L, max_tokens, K] with the given
// strides): rows [0, nd) from the decode rows (nd = decode_rows.num_rows()), through
// dec.decode (comm == nullptr) or dec.cp_decode (comm given: every rank calls with the same
// batch), then rows [nd, nd + prefill_rows.num_tokens) through pre.prefill. Either part may be
// empty (num_reqs == 0). Every host-visible argument of both parts is checked before the first
// launch; both must produce the same number of heads and the same K. Context-parallel (comm
// given, P > 1, DecodeConfig::check_agreement), every rank joins cp_decode's agreement on the
// decode rows even when its own batch failed (it offers -1) or has no decode rows (0), so the
// ranks fail together instead of leaving some in a collective (kCpRowsAgreement).
Status mixed_topk(Decoder& dec, Communicator* comm, const DecodeInputs& decode_rows,
                  Prefiller& pre, const PrefillInputs& prefill_rows, int32_t* out,
                  int64_t head_stride, int64_t row_stride, cudaStream_t stream);

}  // namespace cpidx
