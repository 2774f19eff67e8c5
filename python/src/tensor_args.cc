// python/src/tensor_args.cc: argument checks and DLPack -> Params conversion (see tensor_args.h).
#include "tensor_args.h"

#include <Python.h>

#include <climits>
#include <cmath>
#include <string>

#include "cpidx/contract.h"
#include "reference/internal.h"

namespace cpidx::py {
namespace {

namespace dl = nb::dlpack;

// DLPack device types (dlpack.h): the host, CUDA, pinned host and managed memory.
constexpr int kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13;
// DLPack 1.1's float8_e4m3fn (torch.float8_e4m3fn): the cache's format, no infinities. Code 8
// is float8_e4m3, IEEE-like with infinities, whose top-exponent patterns mean something else.
constexpr uint8_t kDLPackFloat8E4M3FN = 10;

template <typename... Args>
std::string cat(const Args&... args) {
  ::cpidx::detail::Message os;
  (os << ... << args);
  return os.str();
}

[[noreturn]] void type_fail(const std::string& msg) { throw nb::type_error(msg.c_str()); }
[[noreturn]] void value_fail(const std::string& msg) { throw nb::value_error(msg.c_str()); }

bool is(dl::dtype t, dl::dtype_code code, int bits) {
  return t.code == static_cast<uint8_t>(code) && t.bits == bits && t.lanes == 1;
}

std::string dtype_name(dl::dtype t) {
  const int bits = t.bits;
  switch (static_cast<dl::dtype_code>(t.code)) {
    case dl::dtype_code::Int: return cat("int", bits);
    case dl::dtype_code::UInt: return cat("uint", bits);
    case dl::dtype_code::Float: return cat("float", bits);
    case dl::dtype_code::Bfloat: return cat("bfloat", bits);
    case dl::dtype_code::Bool: return "bool";
    case dl::dtype_code::Complex: return cat("complex", bits);
    default: break;
  }
  switch (t.code) {  // float8 codes of DLPack 1.1 (spelled as numbers for older nanobind)
    case 8: return "float8_e4m3";
    case 10: return "float8_e4m3fn";
    case 11: return "float8_e4m3fnuz";
    case 12: return "float8_e5m2";
    case 13: return "float8_e5m2fnuz";
    default: return cat("dtype(code ", int{t.code}, ", bits ", bits, ")");
  }
}

// "[d0, d1, ...]" of `dim(i)` over the array's dims (its shape or its strides).
template <typename A, typename Dim>
std::string dims_str(const A& a, Dim dim) {
  ::cpidx::detail::Message os;
  os << '[';
  for (size_t i = 0; i < a.ndim(); ++i) os << (i ? ", " : "") << dim(i);
  os << ']';
  return os.str();
}

template <typename A>
std::string shape_str(const A& a) {
  return dims_str(a, [&](size_t i) { return a.shape(i); });
}

template <typename A>
std::string strides_str(const A& a) {
  return dims_str(a, [&](size_t i) { return a.stride(i); });
}

template <typename A>
std::string device_str(const A& a) {
  switch (a.device_type()) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return cat("cuda:", a.device_id());
    case kDLCUDAHost: return "cuda pinned host memory";
    case kDLCUDAManaged: return "cuda managed memory";
    default: return cat("device type ", a.device_type());
  }
}

template <typename A>
void check_place(const A& a, const char* name, const Place& place) {
  const int type = a.device_type();
  if (place.cuda) {
    if (type != kDLCUDA || a.device_id() != place.device) {
      value_fail(cat(name, ": expected a CUDA tensor on cuda:", place.device, ", got ",
                     device_str(a)));
    }
  } else if (type != kDLCPU && type != kDLCUDAHost) {
    value_fail(cat(name, ": expected a host array (numpy or a CPU tensor), got ", device_str(a)));
  }
}

template <typename A>
void check_ndim(const A& a, const char* name, size_t ndim, const char* layout) {
  if (a.ndim() != ndim) {
    value_fail(cat(name, ": expected ", ndim, " dims ", layout, ", got shape ", shape_str(a)));
  }
}

template <typename A>
void check_int32(const A& a, const char* name) {
  if (!is(a.dtype(), dl::dtype_code::Int, 32)) {
    type_fail(cat(name, ": expected int32, got ", dtype_name(a.dtype())));
  }
}

// Stride of dim `d` must be 1 unless the dim has one element (then the stride is irrelevant).
template <typename A>
void check_unit_stride(const A& a, const char* name, size_t d) {
  if (a.shape(d) > 1 && a.stride(d) != 1) {
    value_fail(cat(name, ": expected dim ", d, " to be contiguous (stride 1), got stride ",
                   a.stride(d)));
  }
}

// A positive stride for dim d, or `fallback` when the dim has at most one element.
template <typename A>
int64_t stride_of(const A& a, const char* name, size_t d, int64_t fallback) {
  if (a.shape(d) <= 1) return fallback;
  if (a.stride(d) <= 0) {
    value_fail(cat(name, ": expected a positive stride in dim ", d, ", got ", a.stride(d)));
  }
  return a.stride(d);
}

// A 1-d int32 vector of `len` entries (len < 0: any length >= 1), contiguous.
template <typename A>
void check_vector(const A& a, const char* name, int64_t len, const Place& place) {
  check_place(a, name, place);
  check_int32(a, name);
  check_ndim(a, name, 1, "[num_reqs]");
  if (len >= 0 && static_cast<int64_t>(a.shape(0)) != len) {
    value_fail(cat(name, ": expected shape [", len, "], got ", shape_str(a)));
  }
  check_unit_stride(a, name, 0);
}

// An int32 table [>= rows, >= cols] with column stride 1 whose first `rows` rows do not
// overlap in their first `cols` columns; returns the row stride.
template <typename A>
int64_t check_table(const A& a, const char* name, int64_t rows, int64_t cols, const char* what,
                    const Place& place) {
  check_place(a, name, place);
  check_int32(a, name);
  check_ndim(a, name, 2, "[rows, columns]");
  if (static_cast<int64_t>(a.shape(0)) < rows || static_cast<int64_t>(a.shape(1)) < cols) {
    value_fail(cat(name, ": expected at least ", rows, " rows and ", cols, " columns (", what,
                   "), got shape ", shape_str(a)));
  }
  check_unit_stride(a, name, 1);
  const int64_t row_stride = stride_of(a, name, 0, static_cast<int64_t>(a.shape(1)));
  if (rows > 1 && row_stride < cols) {
    value_fail(cat(name, ": rows must not overlap: expected a row stride >= ", cols, ", got ",
                   row_stride));
  }
  return row_stride;
}

void check_query(const InArray& q, const char* name, const Place& place) {
  check_place(q, name, place);
  if (!is(q.dtype(), dl::dtype_code::Bfloat, 16) && !is(q.dtype(), dl::dtype_code::UInt, 16)) {
    type_fail(cat(name, ": expected bfloat16 (or uint16 holding bf16 bits), got ",
                  dtype_name(q.dtype())));
  }
  check_ndim(q, name, 3, "[tokens, heads, 128]");
  if (q.shape(2) != static_cast<size_t>(kHeadDim)) {
    value_fail(cat(name, ": expected head dim ", kHeadDim, " (shape [tokens, heads, ", kHeadDim,
                   "]), got shape ", shape_str(q)));
  }
  if (q.shape(1) < 1 || q.shape(1) > static_cast<size_t>(kMaxHeads)) {
    value_fail(cat(name, ": expected 1 to ", kMaxHeads, " heads in dim 1, got shape ",
                   shape_str(q)));
  }
  check_unit_stride(q, name, 2);
}

void fill_query(const InArray& q, const char* name, const uint16_t** data, int64_t* row_stride,
                int64_t* head_stride, int* num_heads) {
  *data = static_cast<const uint16_t*>(q.data());
  *num_heads = static_cast<int>(q.shape(1));
  *head_stride = stride_of(q, name, 1, kHeadDim);
  *row_stride = stride_of(q, name, 0, static_cast<int64_t>(q.shape(1)) * kHeadDim);
  if ((q.shape(1) > 1 && *head_stride < kHeadDim) || (q.shape(0) > 1 && *row_stride < kHeadDim)) {
    value_fail(cat(name, ": rows and heads must not overlap: expected strides >= ", kHeadDim,
                   ", got row stride ", *row_stride, " and head stride ", *head_stride));
  }
}

PagedCache paged_cache(const InArray& c, const char* name, const Place& place) {
  check_place(c, name, place);
  const dl::dtype t = c.dtype();
  PagedCache cache;
  if (is(t, dl::dtype_code::Bfloat, 16) || is(t, dl::dtype_code::UInt, 16)) {
    cache.dtype = DType::kBF16;
  } else if (is(t, dl::dtype_code::UInt, 8) ||
             (t.bits == 8 && t.lanes == 1 && t.code == kDLPackFloat8E4M3FN)) {
    cache.dtype = DType::kFP8E4M3;
  } else {
    type_fail(cat(name, ": expected bfloat16 or float8_e4m3fn (or uint16 / uint8 holding their "
                        "bits), got ", dtype_name(t)));
  }
  check_ndim(c, name, 3, "[pages, 128, 128]");
  if (c.shape(0) < 1 || c.shape(1) != static_cast<size_t>(kBlockSize) ||
      c.shape(2) != static_cast<size_t>(kHeadDim)) {
    value_fail(cat(name, ": expected shape [pages >= 1, ", kBlockSize, ", ", kHeadDim, "], got ",
                   shape_str(c)));
  }
  if (c.stride(2) != 1 || c.stride(1) != kHeadDim ||
      (c.shape(0) > 1 && c.stride(0) != int64_t{kBlockSize} * kHeadDim)) {
    value_fail(cat(name, ": expected a contiguous cache, got strides [", c.stride(0), ", ",
                   c.stride(1), ", ", c.stride(2), "]"));
  }
  cache.data = c.data();
  cache.num_pages = static_cast<int64_t>(c.shape(0));
  return cache;
}

void check_scalars(int query_len, double scale, int64_t max_seq_len) {
  if (query_len < 1 || query_len > kMaxQueryLen) {
    value_fail(cat("query_len: expected 1 to ", kMaxQueryLen, ", got ", query_len));
  }
  // Judged as the float32 the kernels take: 1e-50 would become 0 and 1e39 infinity there.
  const float as_float = static_cast<float>(scale);
  if (!(as_float > 0.0f) || !std::isfinite(as_float)) {
    value_fail(cat("scale: expected a finite value > 0 in float32, got ", scale));
  }
  if (max_seq_len < 1 || max_seq_len > INT32_MAX) {
    value_fail(cat("max_seq_len: expected 1 to ", INT32_MAX, ", got ", max_seq_len));
  }
}

}  // namespace

void raise_status(const Status& status) {
  switch (status.code()) {
    case StatusCode::kInvalidArgument: throw nb::value_error(status.message().c_str());
    case StatusCode::kUnsupported:
      PyErr_SetString(PyExc_NotImplementedError, status.message().c_str());
      throw nb::python_error();
    default: throw std::runtime_error(status.to_string());
  }
}

Selection selection(int topk, int init_blocks, int local_blocks) {
  if (topk < 1 || topk > kMaxTopK) {
    value_fail(cat("topk: expected 1 to ", kMaxTopK, ", got ", topk));
  }
  if (init_blocks < 0) value_fail(cat("init_blocks: expected >= 0, got ", init_blocks));
  if (local_blocks < 0) value_fail(cat("local_blocks: expected >= 0, got ", local_blocks));
  Selection sel;
  sel.topk = topk;
  sel.init_blocks = init_blocks;
  sel.local_blocks = local_blocks;
  return sel;
}

DecodeBatch merge_batch(const InArray& seq_lens, int query_len, int64_t max_seq_len,
                        const Place& place) {
  check_scalars(query_len, 1.0, max_seq_len);
  check_vector(seq_lens, "seq_lens", -1, place);
  if (seq_lens.shape(0) < 1 || seq_lens.shape(0) > static_cast<size_t>(INT_MAX)) {
    value_fail(cat("seq_lens: expected 1 to INT_MAX requests, got shape ", shape_str(seq_lens)));
  }
  DecodeBatch b;
  b.in.seq_lens = static_cast<const int32_t*>(seq_lens.data());
  b.in.num_reqs = static_cast<int>(seq_lens.shape(0));
  b.in.query_len = query_len;
  b.in.max_seq_len = static_cast<int32_t>(max_seq_len);
  b.rows = b.in.num_rows();
  return b;
}

DecodeBatch decode_batch(const InArray& index_query, const InArray& index_cache,
                         const InArray& block_table, const InArray& seq_lens, int query_len,
                         double scale, int64_t max_seq_len, const Place& place,
                         const DecodeArgNames& names) {
  check_scalars(query_len, scale, max_seq_len);
  DecodeBatch b = merge_batch(seq_lens, query_len, max_seq_len, place);
  DecodeInputs& in = b.in;
  check_query(index_query, names.query, place);
  if (static_cast<int64_t>(index_query.shape(0)) != b.rows) {
    // Either may be the mistake: both named, the query first (its shape is what disagrees).
    value_fail(cat(names.query, ", seq_lens: ", names.query, " has ", index_query.shape(0),
                   " rows (shape ", shape_str(index_query), "), but num_reqs * query_len = ",
                   in.num_reqs, " * ", query_len, " = ", b.rows,
                   " (num_reqs: the length of seq_lens)"));
  }
  fill_query(index_query, names.query, &in.query, &in.q_row_stride, &in.q_head_stride,
             &in.num_heads);
  in.cache = paged_cache(index_cache, names.cache, place);
  in.bt_row_stride = check_table(block_table, "block_table", in.num_reqs, in.max_blocks(),
                                 "num_reqs x cdiv(max_seq_len, 128)", place);
  in.block_table = static_cast<const int32_t*>(block_table.data());
  in.scale = static_cast<float>(scale);
  return b;
}

TopkOutput topk_output(const OutArray& out, int64_t heads, int64_t rows, int topk,
                       const Place& place) {
  const char* name = "out";
  check_place(out, name, place);
  check_int32(out, name);
  check_ndim(out, name, 3, "[heads, tokens, topk]");
  if (static_cast<int64_t>(out.shape(0)) != heads || static_cast<int64_t>(out.shape(1)) != rows ||
      static_cast<int64_t>(out.shape(2)) != topk) {
    value_fail(cat(name, ": expected shape [", heads, ", ", rows, ", ", topk, "], got ",
                   shape_str(out)));
  }
  check_unit_stride(out, name, 2);
  TopkOutput o;
  o.ids = static_cast<int32_t*>(out.data());
  o.row_stride = stride_of(out, name, 1, topk);
  o.head_stride = stride_of(out, name, 0, rows * topk);
  if (!::cpidx::ref::detail::ids_strides_nest(heads, rows, topk, o.row_stride, o.head_stride)) {
    value_fail(cat(name, ": heads and tokens must not overlap: expected a row stride >= topk and "
                         "a head stride >= tokens * row stride (or a head stride >= topk and a "
                         "row stride >= heads * head stride), got strides ", strides_str(out)));
  }
  return o;
}

Key* key_buffer(const nb::ndarray<>& keys, const char* name, std::initializer_list<int64_t> dims,
                const Place& place) {
  check_place(keys, name, place);
  if (!is(keys.dtype(), dl::dtype_code::Int, 64) && !is(keys.dtype(), dl::dtype_code::UInt, 64)) {
    type_fail(cat(name, ": expected int64 (ordered keys), got ", dtype_name(keys.dtype())));
  }
  bool shape_ok = keys.ndim() == dims.size(), strides_ok = true;
  int64_t expect_stride = 1;
  for (size_t i = dims.size(); shape_ok && i-- > 0;) {
    const int64_t d = *(dims.begin() + i);
    shape_ok = static_cast<int64_t>(keys.shape(i)) == d;
    strides_ok = strides_ok && (d <= 1 || keys.stride(i) == expect_stride);
    expect_stride *= d;
  }
  if (!shape_ok || !strides_ok) {
    ::cpidx::detail::Message want;
    want << '[';
    for (size_t i = 0; i < dims.size(); ++i) want << (i ? ", " : "") << *(dims.begin() + i);
    want << ']';
    // A shape that matches is named with its strides: they are what is wrong.
    value_fail(cat(name, ": expected a contiguous int64 array of shape ", want.str(),
                   ", got shape ", shape_str(keys),
                   shape_ok ? cat(" with strides ", strides_str(keys)) : ""));
  }
  return static_cast<Key*>(keys.data());
}

SparseTableOutput sparse_table_output(const std::optional<InArray>& attention_block_table,
                                      const std::optional<OutArray>& sparse_block_table_out,
                                      const std::optional<OutArray>& sparse_context_lens_out,
                                      std::optional<int> block_page_stride, int num_reqs,
                                      int64_t rows, int topk, int64_t max_seq_len,
                                      const Place& place) {
  SparseTableOutput t;
  const int given = attention_block_table.has_value() + sparse_block_table_out.has_value() +
                    sparse_context_lens_out.has_value() + block_page_stride.has_value();
  if (given == 0) return t;
  if (given != 4) {
    std::string missing;
    auto add = [&](bool has, const char* n) {
      if (!has) missing += missing.empty() ? n : cat(", ", n);
    };
    add(attention_block_table.has_value(), "attention_block_table");
    add(sparse_block_table_out.has_value(), "sparse_block_table_out");
    add(sparse_context_lens_out.has_value(), "sparse_context_lens_out");
    add(block_page_stride.has_value(), "block_page_stride");
    value_fail(cat("the sparse table arguments go together: missing ", missing));
  }
  if (*block_page_stride != 8 && *block_page_stride != 16) {
    value_fail(cat("block_page_stride: expected 8 or 16, got ", *block_page_stride));
  }
  const int64_t width = int64_t{topk} * (kBlockSize / 16);
  t.attn_bt_row_stride = check_table(*attention_block_table, "attention_block_table", num_reqs,
                                     cdiv(max_seq_len, kBlockSize),
                                     "num_reqs x cdiv(max_seq_len, 128)", place);
  t.attention_block_table = static_cast<const int32_t*>(attention_block_table->data());
  t.table_row_stride = check_table(*sparse_block_table_out, "sparse_block_table_out", rows, width,
                                   "tokens x topk * 8", place);
  if (static_cast<int64_t>(sparse_block_table_out->shape(0)) != rows) {
    value_fail(cat("sparse_block_table_out: expected ", rows, " rows, got shape ",
                   shape_str(*sparse_block_table_out)));
  }
  t.table = static_cast<int32_t*>(sparse_block_table_out->data());
  check_vector(*sparse_context_lens_out, "sparse_context_lens_out", rows, place);
  t.context_lens = static_cast<int32_t*>(sparse_context_lens_out->data());
  t.block_page_stride = *block_page_stride;
  return t;
}

int32_t* error_flag_arg(const std::optional<OutArray>& error_flag, const Place& place) {
  if (!error_flag.has_value()) return nullptr;
  check_place(*error_flag, "error_flag", place);
  check_int32(*error_flag, "error_flag");
  if (error_flag->size() != 1) {
    value_fail(cat("error_flag: expected one element, got shape ", shape_str(*error_flag)));
  }
  return static_cast<int32_t*>(error_flag->data());
}

PrefillInputs prefill_inputs(const InArray& index_query, const InArray& index_cache,
                             const InArray& block_table, const InArray& cu_seqlens_q,
                             const InArray& context_lens, const InArray& seq_lens, double scale,
                             int64_t max_seq_len, const Place& place) {
  check_scalars(1, scale, max_seq_len);
  check_vector(seq_lens, "seq_lens", -1, place);
  const int64_t num_reqs = static_cast<int64_t>(seq_lens.shape(0));
  if (num_reqs < 1 || num_reqs > INT_MAX) {
    value_fail(cat("seq_lens: expected 1 to INT_MAX requests, got shape ", shape_str(seq_lens)));
  }
  check_vector(context_lens, "context_lens", num_reqs, place);
  check_vector(cu_seqlens_q, "cu_seqlens_q", num_reqs + 1, place);
  check_query(index_query, "index_query", place);
  if (index_query.shape(0) < 1) value_fail("index_query: expected at least one token, got none");
  PrefillInputs in;
  fill_query(index_query, "index_query", &in.query, &in.q_row_stride, &in.q_head_stride,
             &in.num_heads);
  in.cache = paged_cache(index_cache, "index_cache", place);
  in.num_reqs = static_cast<int>(num_reqs);
  in.num_tokens = static_cast<int64_t>(index_query.shape(0));
  in.max_seq_len = static_cast<int32_t>(max_seq_len);
  in.bt_row_stride = check_table(block_table, "block_table", num_reqs,
                                 cdiv(max_seq_len, kBlockSize),
                                 "num_reqs x cdiv(max_seq_len, 128)", place);
  in.block_table = static_cast<const int32_t*>(block_table.data());
  in.cu_seqlens_q = static_cast<const int32_t*>(cu_seqlens_q.data());
  in.context_lens = static_cast<const int32_t*>(context_lens.data());
  in.seq_lens = static_cast<const int32_t*>(seq_lens.data());
  in.scale = static_cast<float>(scale);
  return in;
}

void check_range(const char* name, int64_t value, int64_t lo, const char* hi_name, int64_t hi) {
  if (value < lo || value > hi) {
    value_fail(cat(name, ": expected ", lo, " to ", hi_name, " ", hi, ", got ", value));
  }
}

void check_query_and_cache(const InArray& index_query, const InArray& index_cache) {
  const Place own{index_query.device_type() == kDLCUDA, index_query.device_id()};
  check_query(index_query, "index_query", own);
  paged_cache(index_cache, "index_cache", own);
}

}  // namespace cpidx::py
