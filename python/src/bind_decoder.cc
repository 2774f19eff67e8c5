// python/src/bind_decoder.cc: the GPU Decoder family (cpidx/indexer.h) on CUDA tensors. The
// Python object owns one Decoder (workspace sized at construction); every call checks its
// arguments on the host, then only enqueues kernels on the caller's stream (an int, as torch's
// `cuda_stream`): no allocation, no synchronisation, capturable in a CUDA graph.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include <cstdint>
#include <memory>
#include <string>

#include "communicator.h"
#include "cpidx/comm.h"
#include "cpidx/indexer.h"
#include "cpidx/prefill.h"
#include "tensor_args.h"

namespace cpidx::py {
namespace {

cudaStream_t as_stream(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

DType cache_dtype_of(const std::string& name) {
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  if (name == "fp8_e4m3" || name == "float8_e4m3fn") return DType::kFP8E4M3;
  throw nb::value_error(("cache_dtype: expected 'bf16' or 'fp8_e4m3', got '" + name + "'").c_str());
}

struct PyDecoder {
  std::unique_ptr<Decoder> decoder;
  Place place;

  const DecodeConfig& cfg() const { return decoder->config(); }
  const Decoder& object() const { return *decoder; }

  void decode(const InArray& index_query, const InArray& index_cache, const InArray& block_table,
              const InArray& seq_lens, int query_len, const OutArray& out, double scale,
              const std::optional<InArray>& attention_block_table,
              const std::optional<OutArray>& sparse_block_table_out,
              const std::optional<OutArray>& sparse_context_lens_out,
              std::optional<int> block_page_stride, const std::optional<OutArray>& error_flag,
              uintptr_t stream) {
    DecodeBatch b = decode_batch(index_query, index_cache, block_table, seq_lens, query_len,
                                 scale, cfg().max_seq_len, place);
    b.in.error_flag = error_flag_arg(error_flag, place);
    const TopkOutput o = topk_output(out, b.in.num_heads, b.rows, cfg().sel.topk, place);
    const SparseTableOutput t = sparse_table_output(
        attention_block_table, sparse_block_table_out, sparse_context_lens_out,
        block_page_stride, b.in.num_reqs, b.rows, cfg().sel.topk, cfg().max_seq_len, place);
    check_status(decoder->decode(b.in, o, t.enabled() ? &t : nullptr, as_stream(stream)));
  }

  void shard_keys(const InArray& index_query, const InArray& index_cache,
                  const InArray& block_table, const InArray& seq_lens, int query_len,
                  const nb::ndarray<>& keys_out, double scale,
                  const std::optional<OutArray>& error_flag, uintptr_t stream) {
    DecodeBatch b = decode_batch(index_query, index_cache, block_table, seq_lens, query_len,
                                 scale, cfg().max_seq_len, place);
    b.in.error_flag = error_flag_arg(error_flag, place);
    Key* keys = key_buffer(keys_out, "keys_out", {b.in.num_heads, b.rows, cfg().sel.topk}, place);
    check_status(decoder->shard_keys(b.in, keys, as_stream(stream)));
  }

  void merge(const nb::ndarray<>& gathered, const InArray& seq_lens, int query_len,
             const OutArray& out, const std::optional<InArray>& attention_block_table,
             const std::optional<OutArray>& sparse_block_table_out,
             const std::optional<OutArray>& sparse_context_lens_out,
             std::optional<int> block_page_stride, uintptr_t stream) {
    const DecodeBatch b = merge_batch(seq_lens, query_len, cfg().max_seq_len, place);
    const int K = cfg().sel.topk;
    const Key* keys = key_buffer(gathered, "gathered",
                                 {cfg().world_size, cfg().total_heads, b.rows, K}, place);
    const TopkOutput o = topk_output(out, decoder->geometry().local_heads, b.rows, K, place);
    const SparseTableOutput t = sparse_table_output(
        attention_block_table, sparse_block_table_out, sparse_context_lens_out,
        block_page_stride, b.in.num_reqs, b.rows, K, cfg().max_seq_len, place);
    check_status(decoder->merge(keys, b.in, o, t.enabled() ? &t : nullptr, as_stream(stream)));
  }

  // One context-parallel step's arguments as cp_decode takes them (this rank's L heads).
  struct CpStep {
    DecodeBatch b;
    TopkOutput o;
    SparseTableOutput t;
  };
  CpStep cp_step(const InArray& local_q, const InArray& kv_cache, const InArray& block_table,
                 const InArray& seq_lens, int query_len, const OutArray& out, double scale,
                 const std::optional<InArray>& attention_block_table,
                 const std::optional<OutArray>& sparse_block_table_out,
                 const std::optional<OutArray>& sparse_context_lens_out,
                 std::optional<int> block_page_stride) const {
    CpStep s;
    s.b = decode_batch(local_q, kv_cache, block_table, seq_lens, query_len, scale,
                       cfg().max_seq_len, place, DecodeArgNames{"local_q", "kv_cache"});
    s.o = topk_output(out, s.b.in.num_heads, s.b.rows, cfg().sel.topk, place);
    s.t = sparse_table_output(attention_block_table, sparse_block_table_out,
                              sparse_context_lens_out, block_page_stride, s.b.in.num_reqs,
                              s.b.rows, cfg().sel.topk, cfg().max_seq_len, place);
    return s;
  }

  void check_cp_decode(const InArray& local_q, const InArray& kv_cache,
                       const InArray& block_table, const InArray& seq_lens, int query_len,
                       const OutArray& out, double scale,
                       const std::optional<InArray>& attention_block_table,
                       const std::optional<OutArray>& sparse_block_table_out,
                       const std::optional<OutArray>& sparse_context_lens_out,
                       std::optional<int> block_page_stride,
                       const std::optional<OutArray>& error_flag) const {
    CpStep s = cp_step(local_q, kv_cache, block_table, seq_lens, query_len, out, scale,
                       attention_block_table, sparse_block_table_out, sparse_context_lens_out,
                       block_page_stride);
    s.b.in.error_flag = error_flag_arg(error_flag, place);
    check_status(decoder->check_cp_decode(s.b.in, s.o, s.t.enabled() ? &s.t : nullptr));
  }

  void cp_decode(PyCommunicator* comm, const InArray& local_q, const InArray& kv_cache,
                 const InArray& block_table, const InArray& seq_lens, int query_len,
                 const OutArray& out, double scale,
                 const std::optional<InArray>& attention_block_table,
                 const std::optional<OutArray>& sparse_block_table_out,
                 const std::optional<OutArray>& sparse_context_lens_out,
                 std::optional<int> block_page_stride, const std::optional<OutArray>& error_flag,
                 uintptr_t stream) {
    CpStep s = cp_step(local_q, kv_cache, block_table, seq_lens, query_len, out, scale,
                       attention_block_table, sparse_block_table_out, sparse_context_lens_out,
                       block_page_stride);
    s.b.in.error_flag = error_flag_arg(error_flag, place);
    const SparseTableOutput* table = s.t.enabled() ? &s.t : nullptr;
    if (comm == nullptr) {  // a world of one: Decoder::cp_decode without a communicator
      if (cfg().world_size != 1) {
        throw nb::value_error(("comm: required for a world of " +
                               std::to_string(cfg().world_size) +
                               " ranks; None runs a world of one")
                                  .c_str());
      }
      check_status(decoder->cp_decode(s.b.in, s.o, table, as_stream(stream)));
      return;
    }
    Status st;
    {
      PyCommunicator::Use use(*comm, "comm");  // not closed by another thread under the call
      // Host communicators may block in the collective: let other Python threads run.
      nb::gil_scoped_release release;
      st = decoder->cp_decode(use.comm(), s.b.in, s.o, table, as_stream(stream));
    }
    check_status(st);
  }
};

// launches_in_live_graphs of a Decoder or Prefiller binding (its C++ object's).
template <typename Py>
long long live_graph_launches(const Py& py, double wait_seconds) {
  nb::gil_scoped_release release;  // may poll up to wait_seconds
  return py.object().launches_in_live_graphs(wait_seconds);
}
constexpr const char* kLiveGraphLaunchesDoc =
    "How many of its launches (one per captured call) sit in live CUDA graphs (after "
    "waiting up to wait_seconds for graphs just deleted). While above 0, dropping it keeps its "
    "workspace, which their replays use, until the process exits: delete the graphs first.";

// The GPU prefill indexer of one (device, heads, maxima): workspace at construction.
struct PyPrefiller {
  std::unique_ptr<Prefiller> prefiller;
  Place place;

  const PrefillConfig& cfg() const { return prefiller->config(); }
  const Prefiller& object() const { return *prefiller; }

  void prefill(const InArray& index_query, const InArray& index_cache, const InArray& block_table,
               const InArray& cu_seqlens_q, const InArray& context_lens, const InArray& seq_lens,
               const OutArray& out, double scale, const std::optional<OutArray>& error_flag,
               uintptr_t stream) {
    PrefillInputs in = prefill_inputs(index_query, index_cache, block_table, cu_seqlens_q,
                                      context_lens, seq_lens, scale, cfg().max_seq_len, place);
    if (in.num_tokens > cfg().max_tokens) {  // the library names num_tokens, not an argument
      throw nb::value_error(("index_query: " + std::to_string(in.num_tokens) +
                             " tokens exceed the Prefiller's max_tokens (" +
                             std::to_string(cfg().max_tokens) + ")")
                                .c_str());
    }
    in.error_flag = error_flag_arg(error_flag, place);
    const TopkOutput o = topk_output(out, in.num_heads, in.num_tokens, cfg().sel.topk, place);
    check_status(prefiller->prefill(in, o, as_stream(stream)));
  }
};

}  // namespace

void bind_prefiller(nb::module_& m) {
  using namespace nb::literals;
  nb::class_<PyPrefiller>(m, "Prefiller",
                          "The GPU prefill indexer of one (device, heads, maxima): workspace "
                          "sized at construction; prefill() only enqueues work.")
      .def(
          "__init__",
          [](PyPrefiller* self, int num_heads, int max_tokens, int64_t max_seq_len, int topk,
             int init_blocks, int local_blocks, int device, const std::string& cache_dtype) {
            PrefillConfig c;
            c.num_heads = num_heads;
            c.max_tokens = max_tokens;
            if (max_seq_len < 1 || max_seq_len > INT32_MAX) {
              throw nb::value_error(
                  ("max_seq_len: expected 1 to 2^31-1, got " + std::to_string(max_seq_len)).c_str());
            }
            c.max_seq_len = static_cast<int32_t>(max_seq_len);
            c.sel = selection(topk, init_blocks, local_blocks);
            c.cache_dtype = cache_dtype_of(cache_dtype);
            std::unique_ptr<Prefiller> p;
            Status st;
            {
              nb::gil_scoped_release release;  // creation synchronises the device
              st = Prefiller::create(c, device, &p);
            }
            check_status(st);
            new (self) PyPrefiller{std::move(p), Place{true, device}};
          },
          nb::kw_only(), "num_heads"_a, "max_tokens"_a, "max_seq_len"_a, "topk"_a,
          "init_blocks"_a, "local_blocks"_a, "device"_a, "cache_dtype"_a = "bf16")
      .def_prop_ro("device", [](const PyPrefiller& p) { return p.place.device; })
      .def_prop_ro("num_heads", [](const PyPrefiller& p) { return p.cfg().num_heads; })
      .def_prop_ro("max_tokens", [](const PyPrefiller& p) { return p.cfg().max_tokens; })
      .def_prop_ro("max_seq_len", [](const PyPrefiller& p) { return p.cfg().max_seq_len; })
      .def_prop_ro("topk", [](const PyPrefiller& p) { return p.cfg().sel.topk; })
      .def_prop_ro("workspace_bytes",
                   [](const PyPrefiller& p) { return p.prefiller->plan().workspace_bytes; })
      .def("prefill", &PyPrefiller::prefill, "index_query"_a, "index_cache"_a, "block_table"_a,
           "cu_seqlens_q"_a, "context_lens"_a, "seq_lens"_a, "out"_a, nb::kw_only(), "scale"_a,
           "error_flag"_a = nb::none(), "stream"_a = 0,
           "ids [heads, tokens, topk] of packed prefill tokens (CONTRACT.md section 7). "
           "error_flag: an int32 tensor of one element that the call ORs its DeviceError bits "
           "into instead of the prefiller's own flag.")
      .def(
          "error_flag",
          [](PyPrefiller& p) {
            return nb::ndarray<nb::pytorch, int32_t, nb::shape<1>>(
                p.prefiller->error_flag(), {1}, nb::find(&p), {}, nb::dtype<int32_t>(),
                nb::device::cuda::value, p.place.device);
          },
          "Device int32 [1]: OR of DeviceError bits since the last clear, from the calls given "
          "no error_flag of their own (a torch tensor view).")
      .def(
          "clear_error_flag",
          [](PyPrefiller& p, uintptr_t stream) {
            check_status(p.prefiller->clear_error_flag(as_stream(stream)));
          },
          "stream"_a = 0)
      .def("launches_in_live_graphs", &live_graph_launches<PyPrefiller>, "wait_seconds"_a = 0.0,
           kLiveGraphLaunchesDoc);
}

void bind_decoder(nb::module_& m) {
  m.attr("MAX_TOKENS") = DecodeConfig::kMaxTokens;  // a Decoder's largest max_tokens
  using namespace nb::literals;
  m.def("gpu_available", &gpu_available,
        "True when the module was built with CUDA and a device is visible.");
  m.def("check_query_and_cache", &check_query_and_cache, "index_query"_a, "index_cache"_a,
        "Raises what decode / prefill would for the query's and the cache's own dtype and "
        "layout (the cache on the query's device), before anything is made from them.");
  nb::class_<PyDecoder>(m, "Decoder",
                        "The GPU decode indexer of one (device, geometry): workspace sized at "
                        "construction; decode / shard_keys / merge / cp_decode only enqueue work.")
      .def(
          "__init__",
          [](PyDecoder* self, int total_heads, int world_size, int rank, int max_tokens,
             int64_t max_seq_len, int topk, int init_blocks, int local_blocks, int device,
             int max_query_len, const std::string& cache_dtype, int head_dim,
             bool exchange_buffers) {
            DecodeConfig c;
            c.total_heads = total_heads;
            c.world_size = world_size;
            c.rank = rank;
            c.max_tokens = max_tokens;
            if (max_seq_len < 1 || max_seq_len > INT32_MAX) {
              throw nb::value_error(
                  ("max_seq_len: expected 1 to 2^31-1, got " + std::to_string(max_seq_len)).c_str());
            }
            c.max_seq_len = static_cast<int32_t>(max_seq_len);
            c.max_query_len = max_query_len;
            c.sel = selection(topk, init_blocks, local_blocks);
            c.cache_dtype = cache_dtype_of(cache_dtype);
            c.head_dim = head_dim;
            c.exchange_buffers = exchange_buffers;
            std::unique_ptr<Decoder> d;
            Status st;
            {
              nb::gil_scoped_release release;  // creation synchronises the device
              st = Decoder::create(c, device, &d);
            }
            check_status(st);
            new (self) PyDecoder{std::move(d), Place{true, device}};
          },
          nb::kw_only(), "total_heads"_a, "world_size"_a, "rank"_a, "max_tokens"_a,
          "max_seq_len"_a, "topk"_a, "init_blocks"_a, "local_blocks"_a, "device"_a,
          "max_query_len"_a = kMaxQueryLen, "cache_dtype"_a = "bf16", "head_dim"_a = kHeadDim,
          "exchange_buffers"_a = true)
      .def_prop_ro("device", [](const PyDecoder& d) { return d.place.device; })
      .def_prop_ro("total_heads", [](const PyDecoder& d) { return d.cfg().total_heads; })
      .def_prop_ro("world_size", [](const PyDecoder& d) { return d.cfg().world_size; })
      .def_prop_ro("rank", [](const PyDecoder& d) { return d.cfg().rank; })
      .def_prop_ro("local_heads", [](const PyDecoder& d) { return d.decoder->geometry().local_heads; })
      .def_prop_ro("replicas", [](const PyDecoder& d) { return d.decoder->geometry().replicas; })
      .def_prop_ro("head_offset", [](const PyDecoder& d) { return d.decoder->geometry().head_offset; })
      .def_prop_ro("max_tokens", [](const PyDecoder& d) { return d.cfg().max_tokens; })
      .def_prop_ro("max_seq_len", [](const PyDecoder& d) { return d.cfg().max_seq_len; })
      .def_prop_ro("max_query_len", [](const PyDecoder& d) { return d.cfg().max_query_len; })
      .def_prop_ro("topk", [](const PyDecoder& d) { return d.cfg().sel.topk; })
      .def_prop_ro("init_blocks", [](const PyDecoder& d) { return d.cfg().sel.init_blocks; })
      .def_prop_ro("local_blocks", [](const PyDecoder& d) { return d.cfg().sel.local_blocks; })
      .def_prop_ro("cache_dtype",
                   [](const PyDecoder& d) { return std::string(to_string(d.cfg().cache_dtype)); })
      .def_prop_ro("exchange_buffers",
                   [](const PyDecoder& d) { return d.cfg().exchange_buffers; })
      .def_prop_ro("workspace_bytes",
                   [](const PyDecoder& d) { return d.decoder->plan().workspace_bytes; })
      .def_prop_ro("grid", [](const PyDecoder& d) { return d.decoder->plan().grid; })
      .def_prop_ro("stages", [](const PyDecoder& d) { return d.decoder->plan().stages; })
      .def_prop_ro("offset_stride",
                   [](const PyDecoder& d) { return d.decoder->plan().offset_stride; })
      // The decode path's rule (DecodePlan): steps of at most split_any_pages pages take the
      // split path; up to split_max_pages they do while no request owns more than
      // split_longest_pages; larger steps take the fused path. 0 / 0 / 0: always fused.
      .def_prop_ro("split_max_pages",
                   [](const PyDecoder& d) { return d.decoder->plan().split_max_pages; })
      .def_prop_ro("split_any_pages",
                   [](const PyDecoder& d) { return d.decoder->plan().split_any_pages; })
      .def_prop_ro("split_longest_pages",
                   [](const PyDecoder& d) { return d.decoder->plan().split_longest_pages; })
      .def(
          "step_plan",
          [](const PyDecoder& d, int num_heads, int query_len) {
            check_range("num_heads", num_heads, 1, "total_heads", d.cfg().total_heads);
            check_range("query_len", query_len, 1, "max_query_len", d.cfg().max_query_len);
            const DecodePlan s = d.decoder->step_plan(num_heads, query_len);
            nb::dict out;
            out["grid"] = s.grid;
            out["stages"] = s.stages;
            out["offset_stride"] = s.offset_stride;
            out["smem_bytes"] = s.smem_bytes;
            return out;
          },
          "num_heads"_a, "query_len"_a,
          "The scoring plan a step of num_heads heads x query_len tokens launches: {grid, stages, "
          "offset_stride, smem_bytes}. grid/stages/offset_stride above are the bound's "
          "(total_heads x max_query_len); a step of fewer columns may run more CTAs per SM.")
      .def("decode", &PyDecoder::decode, "index_query"_a, "index_cache"_a, "block_table"_a,
           "seq_lens"_a, "query_len"_a, "out"_a, nb::kw_only(), "scale"_a,
           "attention_block_table"_a = nb::none(), "sparse_block_table_out"_a = nb::none(),
           "sparse_context_lens_out"_a = nb::none(), "block_page_stride"_a = nb::none(),
           "error_flag"_a = nb::none(), "stream"_a = 0,
           "Plain decode of every head in index_query: ids [heads, n, topk]. error_flag: an "
           "int32 tensor of one element that the call ORs its DeviceError bits into instead of "
           "the decoder's own flag.")
      .def("shard_keys", &PyDecoder::shard_keys, "index_query"_a, "index_cache"_a,
           "block_table"_a, "seq_lens"_a, "query_len"_a, "keys_out"_a, nb::kw_only(), "scale"_a,
           "error_flag"_a = nb::none(), "stream"_a = 0,
           "This rank's shard top-K keys [total_heads, n, topk] (int64) from all heads' queries "
           "(error_flag: as for decode).")
      .def("merge", &PyDecoder::merge, "gathered"_a, "seq_lens"_a, "query_len"_a, "out"_a,
           nb::kw_only(), "attention_block_table"_a = nb::none(),
           "sparse_block_table_out"_a = nb::none(), "sparse_context_lens_out"_a = nb::none(),
           "block_page_stride"_a = nb::none(), "stream"_a = 0,
           "Merge gathered keys [world, total_heads, n, topk] into ids [local_heads, n, topk].")
      .def("cp_decode", &PyDecoder::cp_decode, "comm"_a.none(), "local_q"_a, "kv_cache"_a,
           "block_table"_a, "seq_lens"_a, "query_len"_a, "out"_a, nb::kw_only(), "scale"_a,
           "attention_block_table"_a = nb::none(), "sparse_block_table_out"_a = nb::none(),
           "sparse_context_lens_out"_a = nb::none(), "block_page_stride"_a = nb::none(),
           "error_flag"_a = nb::none(), "stream"_a = 0,
           "The whole context-parallel step over a device communicator: ids [local_heads, n, "
           "topk] (error_flag: as for decode; this rank's bits, its shard's pages). comm None: "
           "a world of one (world_size 1), the plain decode of every head.")
      .def("check_cp_decode", &PyDecoder::check_cp_decode, "local_q"_a, "kv_cache"_a,
           "block_table"_a, "seq_lens"_a, "query_len"_a, "out"_a, nb::kw_only(), "scale"_a,
           "attention_block_table"_a = nb::none(), "sparse_block_table_out"_a = nb::none(),
           "sparse_context_lens_out"_a = nb::none(), "block_page_stride"_a = nb::none(),
           "error_flag"_a = nb::none(),
           "Raises what cp_decode would raise for these arguments before its first collective; "
           "runs nothing on the device (IndexerCPDecode agrees with its peers on the result).")
      .def(
          "error_flag",
          [](PyDecoder& d) {
            // A view of the device int32 error bits, kept alive by the Decoder object.
            return nb::ndarray<nb::pytorch, int32_t, nb::shape<1>>(
                d.decoder->error_flag(), {1}, nb::find(&d), {}, nb::dtype<int32_t>(),
                nb::device::cuda::value, d.place.device);
          },
          "Device int32 [1]: OR of DeviceError bits since the last clear, from the calls given "
          "no error_flag of their own (a torch tensor view).")
      .def(
          "clear_error_flag",
          [](PyDecoder& d, uintptr_t stream) {
            check_status(d.decoder->clear_error_flag(as_stream(stream)));
          },
          "stream"_a = 0)
      .def("launches_in_live_graphs", &live_graph_launches<PyDecoder>, "wait_seconds"_a = 0.0,
           kLiveGraphLaunchesDoc);
}

}  // namespace cpidx::py
