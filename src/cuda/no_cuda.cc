// src/cuda/no_cuda.cc: built only without CUDA. The GPU entry points exist and report
// kUnsupported, so CPU-only builds link the same programs and tests (which then skip).
#include "cpidx/indexer.h"
#include "cpidx/workspace.h"

namespace cpidx {
namespace {
Status no_cuda() {
  return unsupported("cpidx was built without CUDA: the GPU decoder is unavailable");
}
}  // namespace

struct Decoder::Impl {
  DecodeConfig cfg;
  Geometry geo;
  DecodePlan plan;
};

DecodeWorkspaceLayout decode_workspace_layout(const DecodeConfig&, int) { return {}; }
Decoder::Decoder(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Decoder::~Decoder() = default;
Status Decoder::create(const DecodeConfig&, int, std::unique_ptr<Decoder>*) { return no_cuda(); }
const DecodeConfig& Decoder::config() const { return impl_->cfg; }
const Geometry& Decoder::geometry() const { return impl_->geo; }
const DecodePlan& Decoder::plan() const { return impl_->plan; }
DecodePlan Decoder::step_plan(int, int) const { return impl_->plan; }
Status Decoder::decode(const DecodeInputs&, const TopkOutput&, const SparseTableOutput*,
                       cudaStream_t) { return no_cuda(); }
Status Decoder::shard_keys(const DecodeInputs&, Key*, cudaStream_t) { return no_cuda(); }
Status Decoder::merge(const Key*, const DecodeInputs&, const TopkOutput&,
                      const SparseTableOutput*, cudaStream_t) { return no_cuda(); }
Status Decoder::cp_decode(Communicator&, const DecodeInputs&, const TopkOutput&,
                          const SparseTableOutput*, cudaStream_t) { return no_cuda(); }
Status Decoder::cp_decode(const DecodeInputs&, const TopkOutput&, const SparseTableOutput*,
                          cudaStream_t) { return no_cuda(); }
Status Decoder::check_cp_decode(const DecodeInputs&, const TopkOutput&,
                                const SparseTableOutput*) const {
  return no_cuda();
}
int32_t* Decoder::error_flag() const { return nullptr; }
Status Decoder::clear_error_flag(cudaStream_t) { return no_cuda(); }
void* Decoder::exchange_buffer() const { return nullptr; }
size_t Decoder::exchange_buffer_bytes() const { return 0; }
long long Decoder::launches_in_live_graphs(double) const { return 0; }
bool gpu_available() { return false; }

}  // namespace cpidx
