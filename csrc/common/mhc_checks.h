#pragma once

#include "common/checks.h"

#include <tuple>
#include <utility>
#include <vector>

namespace deepinfer {

// Manifold-constrained hyper-connection (mHC) ops of DeepSeek-V4: `hc` residual streams per token.
inline constexpr int64_t kHcMixMaxM = 32;  // hc_mix: outputs per token (V4: 2 hc + hc^2 = 24, and hc for the head)
inline constexpr int64_t kHcMaxStreams = 8;  // hc_collapse / hc_post: streams per token (V4: hc_mult = 4)

inline void check_float_tensor(const char* op, const at::Tensor& t, const char* name) {
  DEEPINFER_CHECK(is_float_activation(t.scalar_type()), op, name, " must be float32, bfloat16 or float16, got ",
                  dtype_name(t.scalar_type()));
}

inline void check_contiguous(const char* op, const at::Tensor& t, const char* name) {
  DEEPINFER_CHECK(t.is_contiguous(), op, name, " must be contiguous, got strides ", t.strides());
}

// hc_mix(out, x, fn, eps): x [T, K] (last dim contiguous, any row stride), fn [M, K] float32 contiguous,
// out [T, M] float32 contiguous.
inline void check_hc_mix(const at::Tensor& out, const at::Tensor& x, const at::Tensor& fn, double eps) {
  const char* op = "hc_mix";
  check_float_tensor(op, x, "x");
  DEEPINFER_CHECK(x.dim() == 2, op, "x must be [tokens, K], got ", x.sizes());
  DEEPINFER_CHECK(x.size(1) <= 1 || x.stride(1) == 1, op, "x must be contiguous in its last dim, got strides ",
                  x.strides());
  check_dtype(op, fn, "fn", at::kFloat);
  DEEPINFER_CHECK(fn.dim() == 2 && fn.size(1) == x.size(1), op, "fn must be [M, ", x.size(1), "] (K of x), got ",
                  fn.sizes());
  DEEPINFER_CHECK(fn.size(0) >= 1 && fn.size(0) <= kHcMixMaxM, op, "fn must have 1 to ", kHcMixMaxM,
                  " rows (M), got ", fn.size(0));
  DEEPINFER_CHECK(x.size(1) >= 1, op, "x must have K >= 1 columns");
  check_contiguous(op, fn, "fn");
  check_dtype(op, out, "out", at::kFloat);
  DEEPINFER_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == fn.size(0), op, "out must be [",
                  x.size(0), ", ", fn.size(0), "], got ", out.sizes());
  check_contiguous(op, out, "out");
  check_same_device(op, x, "x", fn, "fn");
  check_same_device(op, out, "out", x, "x");
  check_writable(op, out, "out");
  check_disjoint(op, out, "out", x, "x");
  check_disjoint(op, out, "out", fn, "fn");
  DEEPINFER_CHECK(eps >= 0.0, op, "eps must be >= 0, got ", eps);
}

// The per-token float32 weights of hc_collapse / hc_post: `w` [T, dims...] float32 contiguous.
inline void check_hc_weights(const char* op, const at::Tensor& w, const char* name, at::IntArrayRef want,
                             const at::Tensor& streams) {
  check_dtype(op, w, name, at::kFloat);
  DEEPINFER_CHECK(w.sizes() == want, op, name, " must be ", want, ", got ", w.sizes());
  check_contiguous(op, w, name);
  check_same_device(op, w, name, streams, "streams");
}

inline void check_hc_streams(const char* op, const at::Tensor& streams) {
  check_float_tensor(op, streams, "streams");
  DEEPINFER_CHECK(streams.dim() == 3, op, "streams must be [tokens, hc, hidden], got ", streams.sizes());
  DEEPINFER_CHECK(streams.size(1) >= 1 && streams.size(1) <= kHcMaxStreams, op, "streams must have 1 to ",
                  kHcMaxStreams, " streams (dim 1), got ", streams.size(1));
  check_contiguous(op, streams, "streams");
}

// hc_collapse(out, streams, pre): streams [T, hc, D] contiguous, pre [T, hc] float32, out [T, D] of the streams' dtype.
inline void check_hc_collapse(const at::Tensor& out, const at::Tensor& streams, const at::Tensor& pre) {
  const char* op = "hc_collapse";
  check_hc_streams(op, streams);
  const int64_t T = streams.size(0), hc = streams.size(1), D = streams.size(2);
  check_hc_weights(op, pre, "pre", {T, hc}, streams);
  DEEPINFER_CHECK(out.scalar_type() == streams.scalar_type(), op, "out dtype ", dtype_name(out.scalar_type()),
                  " != streams dtype ", dtype_name(streams.scalar_type()));
  DEEPINFER_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == D, op, "out must be [", T, ", ", D, "], got ",
                  out.sizes());
  check_contiguous(op, out, "out");
  check_same_device(op, out, "out", streams, "streams");
  check_writable(op, out, "out");
  check_disjoint(op, out, "out", streams, "streams");
  check_disjoint(op, out, "out", pre, "pre");
}

// hc_post(out, streams, x, post, comb): streams / out [T, hc, D] (out may be streams itself), x [T, D] of the same
// dtype, post [T, hc] and comb [T, hc, hc] float32.
inline void check_hc_post(const at::Tensor& out, const at::Tensor& streams, const at::Tensor& x, const at::Tensor& post,
                          const at::Tensor& comb) {
  const char* op = "hc_post";
  check_hc_streams(op, streams);
  const int64_t T = streams.size(0), hc = streams.size(1), D = streams.size(2);
  DEEPINFER_CHECK(x.scalar_type() == streams.scalar_type(), op, "x dtype ", dtype_name(x.scalar_type()),
                  " != streams dtype ", dtype_name(streams.scalar_type()));
  DEEPINFER_CHECK(x.dim() == 2 && x.size(0) == T && x.size(1) == D, op, "x must be [", T, ", ", D, "], got ",
                  x.sizes());
  check_contiguous(op, x, "x");
  check_same_device(op, x, "x", streams, "streams");
  check_hc_weights(op, post, "post", {T, hc}, streams);
  check_hc_weights(op, comb, "comb", {T, hc, hc}, streams);
  DEEPINFER_CHECK(out.scalar_type() == streams.scalar_type(), op, "out dtype ", dtype_name(out.scalar_type()),
                  " != streams dtype ", dtype_name(streams.scalar_type()));
  DEEPINFER_CHECK(out.sizes() == streams.sizes(), op, "out shape ", out.sizes(), " != streams shape ", streams.sizes());
  check_contiguous(op, out, "out");
  check_same_device(op, out, "out", streams, "streams");
  check_writable(op, out, "out");
  check_no_partial_overlap(op, out, "out", streams, "streams", /*allow_in_place=*/true);
  check_disjoint(op, out, "out", x, "x");
  check_disjoint(op, out, "out", post, "post");
  check_disjoint(op, out, "out", comb, "comb");
}

// hc_weights(pre, post, comb, mix, base, scale, eps, sinkhorn_iters): mix [T, 2 hc + hc^2], base [2 hc + hc^2],
// scale [3], pre / post [T, hc], comb [T, hc, hc]; all float32 contiguous on one device; hc from pre.
inline void check_hc_weights_op(const at::Tensor& pre, const at::Tensor& post, const at::Tensor& comb,
                                const at::Tensor& mix, const at::Tensor& base, const at::Tensor& scale, double eps,
                                int64_t sinkhorn_iters) {
  const char* op = "hc_weights";
  check_dtype(op, pre, "pre", at::kFloat);
  DEEPINFER_CHECK(pre.dim() == 2 && pre.size(1) >= 1 && pre.size(1) <= kHcMaxStreams, op,
                  "pre must be [tokens, hc] with 1 <= hc <= ", kHcMaxStreams, ", got ", pre.sizes());
  const int64_t T = pre.size(0), hc = pre.size(1), m = 2 * hc + hc * hc;
  for (const auto& [t, name, want] : {std::tuple<const at::Tensor&, const char*, std::vector<int64_t>>{mix, "mix", {T, m}},
                                      {base, "base", {m}}, {scale, "scale", {3}}, {post, "post", {T, hc}},
                                      {comb, "comb", {T, hc, hc}}}) {
    check_dtype(op, t, name, at::kFloat);
    DEEPINFER_CHECK(t.sizes() == at::IntArrayRef(want), op, name, " must be ", at::IntArrayRef(want), ", got ",
                    t.sizes());
    check_contiguous(op, t, name);
    check_same_device(op, t, name, pre, "pre");
  }
  check_contiguous(op, pre, "pre");
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{pre, "pre"}, {post, "post"}, {comb, "comb"}}) {
    check_writable(op, t, name);
    check_disjoint(op, t, name, mix, "mix");
    check_disjoint(op, t, name, base, "base");
    check_disjoint(op, t, name, scale, "scale");
  }
  check_disjoint(op, pre, "pre", post, "post");
  check_disjoint(op, pre, "pre", comb, "comb");
  check_disjoint(op, post, "post", comb, "comb");
  DEEPINFER_CHECK(eps >= 0.0, op, "eps must be >= 0, got ", eps);
  DEEPINFER_CHECK(sinkhorn_iters >= 0, op, "sinkhorn_iters must be >= 0, got ", sinkhorn_iters);
}

}  // namespace deepinfer
