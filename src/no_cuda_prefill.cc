// src/no_cuda_prefill.cc: built only without CUDA. The prefill entry points exist and report
// kUnsupported, so CPU-only builds link the same programs and tests (which then skip).
#include "cpidx/prefill.h"

namespace cpidx {
namespace {
Status no_cuda() {
  return unsupported("cpidx was built without CUDA: the GPU prefill indexer is unavailable");
}
}  // namespace

struct Prefiller::Impl {
  PrefillConfig cfg;
  PrefillPlan plan;
};

Prefiller::Prefiller(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Prefiller::~Prefiller() = default;
Status Prefiller::create(const PrefillConfig&, int, std::unique_ptr<Prefiller>*) { return no_cuda(); }
const PrefillConfig& Prefiller::config() const { return impl_->cfg; }
const PrefillPlan& Prefiller::plan() const { return impl_->plan; }
Status Prefiller::validate(const PrefillInputs&, const TopkOutput&) const { return no_cuda(); }
Status Prefiller::prefill(const PrefillInputs&, const TopkOutput&, cudaStream_t) { return no_cuda(); }
int32_t* Prefiller::error_flag() const { return nullptr; }
Status Prefiller::clear_error_flag(cudaStream_t) { return no_cuda(); }
long long Prefiller::launches_in_live_graphs(double) const { return 0; }
Status mixed_topk(Decoder&, Communicator*, const DecodeInputs&, Prefiller&, const PrefillInputs&,
                  int32_t*, int64_t, int64_t, cudaStream_t) {
  return no_cuda();
}

}  // namespace cpidx
