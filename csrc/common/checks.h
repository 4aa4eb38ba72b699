// Argument checks shared by the CPU and CUDA implementations of every op. Each check names
// the op and the tensor at fault, so that a bad call says what to fix.
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <utility>

#define DEEPINFER_CHECK(cond, op, ...) TORCH_CHECK(cond, "deepinfer_ops.", op, ": ", __VA_ARGS__)

namespace deepinfer {

// torch's Python name of a dtype ("torch.float32"), for error messages.
// (A local table: c10::getDtypeNames changed its return type across torch releases.)
inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kFloat8_e4m3fn: return "torch.float8_e4m3fn";
    case at::kFloat8_e5m2: return "torch.float8_e5m2";
    case at::kFloat8_e8m0fnu: return "torch.float8_e8m0fnu";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    default: return std::string("torch.") + c10::toString(t);
  }
}

inline void check_same_device(const char* op, const at::Tensor& a, const char* a_name, const at::Tensor& b,
                              const char* b_name) {
  DEEPINFER_CHECK(a.device() == b.device(), op, a_name, " is on ", a.device(), " but ", b_name, " is on ",
                  b.device());
}

inline void check_dtype(const char* op, const at::Tensor& t, const char* name, at::ScalarType dtype) {
  DEEPINFER_CHECK(t.scalar_type() == dtype, op, name, " must be ", dtype_name(dtype), ", got ", dtype_name(t.scalar_type()));
}

// A tensor the op writes must not have elements sharing memory (e.g. an expand()ed, stride-0 view).
inline void check_writable(const char* op, const at::Tensor& t, const char* name) {
  DEEPINFER_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, name,
                  " has elements that share memory (e.g. an expanded, stride-0 view) and cannot be written; pass a "
                  "tensor with its own storage per element");
}

// `out` (written) must not share memory with `in` (read) partially: the op would read elements it has already
// overwritten. Exactly the same elements (in place) are allowed where `allow_in_place`. Layouts ATen cannot
// decide about (non-dense views) pass.
inline void check_no_partial_overlap(const char* op, const at::Tensor& out, const char* out_name, const at::Tensor& in,
                                     const char* in_name, bool allow_in_place) {
  const auto s = at::get_overlap_status(out, in);
  DEEPINFER_CHECK(s != at::MemOverlapStatus::Partial && (allow_in_place || s != at::MemOverlapStatus::Full), op,
                  out_name, " and ", in_name, " share memory",
                  allow_in_place ? " partially (only the exact same elements, in place, are allowed)"
                                 : "; pass separate tensors");
}

// `out` (written) must not share any memory with `in` (read). Unlike check_no_partial_overlap this also decides
// non-dense layouts (a row-strided input such as hc_mix's x): it compares the byte ranges the two tensors span in one
// storage, so a non-dense `in` whose gaps hold `out` is refused too (pass separate buffers).
inline void check_disjoint(const char* op, const at::Tensor& out, const char* out_name, const at::Tensor& in,
                           const char* in_name) {
  if (out.numel() == 0 || in.numel() == 0 || !out.has_storage() || !in.has_storage()) return;
  if (!out.storage().is_alias_of(in.storage())) return;
  const auto span = [](const at::Tensor& t) {
    const char* p = static_cast<const char*>(t.const_data_ptr());
    int64_t lo = 0, hi = 0;  // element offsets of the first and the last element
    for (int64_t d = 0; d < t.dim(); ++d) {
      const int64_t ext = (t.size(d) - 1) * t.stride(d);
      (ext < 0 ? lo : hi) += ext;
    }
    return std::make_pair(p + lo * t.element_size(), p + (hi + 1) * t.element_size());
  };
  const auto [a0, a1] = span(out);
  const auto [b0, b1] = span(in);
  DEEPINFER_CHECK(a1 <= b0 || b1 <= a0, op, out_name, " and ", in_name, " share memory; pass separate tensors");
}

inline bool is_float_activation(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// View `t` ([..., last]) as [rows, last] without copying; last dim must be contiguous.
// Leading dims must collapse into one stride (true for contiguous tensors and 2-D row-strided views).
inline at::Tensor as_rows(const char* op, const at::Tensor& t, const char* name) {
  DEEPINFER_CHECK(t.dim() >= 1, op, name, " must have at least 1 dim, got a scalar");
  const int64_t last = t.size(-1);
  DEEPINFER_CHECK(t.numel() == 0 || last == 1 || t.stride(-1) == 1, op, name,
                  " must be contiguous in its last dim (stride(-1) == 1), got strides ", t.strides());
  if (t.dim() == 2) return t;
  if (t.dim() == 1) return t.view({1, last});
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  DEEPINFER_CHECK(t.numel() == 0 || t.is_contiguous() || t.dim() == 2, op, name,
                  " with more than 2 dims must be contiguous (got strides ", t.strides(), "); pass a 2-D [rows, ",
                  last, "] view for row-strided data");
  return t.view({rows, last});
}

}  // namespace deepinfer
