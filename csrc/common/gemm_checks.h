// Argument checks of the FP8 block-scaled GEMM family and its helpers, shared by the CPU and CUDA implementations.
#pragma once

#include "common/checks.h"

namespace deepinfer {

constexpr int64_t kGemmScaleBlock = 128;  // K and N granularity of the block scales
constexpr int64_t kFp4ScaleGroup = 32;    // FP4 e2m1 checkpoint: one UE8M0 scale per 32 elements along K

inline int64_t gemm_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline void check_fp8(const char* op, const at::Tensor& t, const char* name, int64_t dim) {
  check_dtype(op, t, name, at::kFloat8_e4m3fn);
  DEEPINFER_CHECK(t.dim() == dim, op, name, " must be ", dim, "-D, got shape ", t.sizes());
  DEEPINFER_CHECK(t.numel() == 0 || t.size(-1) == 1 || t.stride(-1) == 1, op, name,
                  " must be contiguous in its last (K) dim, got strides ", t.strides());
}

inline void check_shape(const char* op, const at::Tensor& t, const char* name, at::IntArrayRef expected,
                        const char* what) {
  DEEPINFER_CHECK(t.sizes() == expected, op, name, " must be ", expected, " (", what, "), got ", t.sizes());
}

// fp8_gemm_nt(out, a, a_scale, b, b_scale, accumulate, split_k)
inline void check_fp8_gemm_nt(const at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                              const at::Tensor& b, const at::Tensor& b_scale, bool accumulate, int64_t split_k) {
  const char* op = "fp8_gemm_nt";
  DEEPINFER_CHECK(split_k >= 1, op, "split_k must be >= 1, got ", split_k);
  DEEPINFER_CHECK(split_k == 1 || out.scalar_type() == at::kBFloat16, op,
                  "split_k > 1 needs a bfloat16 out (and no accumulate), got ", out.scalar_type());
  check_fp8(op, a, "a", 2);
  check_fp8(op, b, "b", 2);
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  DEEPINFER_CHECK(b.size(1) == K, op, "b must be [N, K] with K = a.size(1) = ", K, ", got ", b.sizes());
  check_dtype(op, a_scale, "a_scale", at::kFloat);
  check_dtype(op, b_scale, "b_scale", at::kFloat);
  const int64_t kb = gemm_ceil_div(K, kGemmScaleBlock), nb = gemm_ceil_div(N, kGemmScaleBlock);
  check_shape(op, a_scale, "a_scale", {M, kb}, "M, ceil(K / 128)");
  check_shape(op, b_scale, "b_scale", {nb, kb}, "ceil(N / 128), ceil(K / 128)");
  DEEPINFER_CHECK(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat, op,
                  "out must be bfloat16 or float32, got ", out.scalar_type());
  DEEPINFER_CHECK(!accumulate || out.scalar_type() == at::kFloat, op,
                  "accumulate=True needs a float32 out, got ", out.scalar_type());
  check_shape(op, out, "out", {M, N}, "M, N");
  DEEPINFER_CHECK(out.numel() == 0 || N == 1 || out.stride(1) == 1, op, "out must be contiguous in N, got strides ",
                  out.strides());
  check_writable(op, out, "out");
  check_same_device(op, a, "a", out, "out");
  check_same_device(op, a_scale, "a_scale", out, "out");
  check_same_device(op, b, "b", out, "out");
  check_same_device(op, b_scale, "b_scale", out, "out");
}

// m_grouped_fp8_gemm_nt_contiguous(out, a, a_scale, b, b_scale, m_indices)
inline void check_m_grouped_contiguous(const at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                                       const at::Tensor& b, const at::Tensor& b_scale, const at::Tensor& m_indices) {
  const char* op = "m_grouped_fp8_gemm_nt_contiguous";
  check_fp8(op, a, "a", 2);
  check_fp8(op, b, "b", 3);
  const int64_t M = a.size(0), K = a.size(1), G = b.size(0), N = b.size(1);
  DEEPINFER_CHECK(b.size(2) == K, op, "b must be [G, N, K] with K = a.size(1) = ", K, ", got ", b.sizes());
  check_dtype(op, a_scale, "a_scale", at::kFloat);
  check_dtype(op, b_scale, "b_scale", at::kFloat);
  const int64_t kb = gemm_ceil_div(K, kGemmScaleBlock), nb = gemm_ceil_div(N, kGemmScaleBlock);
  check_shape(op, a_scale, "a_scale", {M, kb}, "M, ceil(K / 128)");
  check_shape(op, b_scale, "b_scale", {G, nb, kb}, "G, ceil(N / 128), ceil(K / 128)");
  check_dtype(op, m_indices, "m_indices", at::kInt);
  check_shape(op, m_indices, "m_indices", {M}, "M");
  DEEPINFER_CHECK(m_indices.numel() <= 1 || m_indices.is_contiguous(), op, "m_indices must be contiguous");
  check_dtype(op, out, "out", at::kBFloat16);
  check_shape(op, out, "out", {M, N}, "M, N");
  DEEPINFER_CHECK(out.numel() == 0 || N == 1 || out.stride(1) == 1, op, "out must be contiguous in N, got strides ",
                  out.strides());
  check_writable(op, out, "out");
  for (auto* t : {&a, &a_scale, &b, &b_scale, &m_indices}) check_same_device(op, *t, "an input", out, "out");
}

// m_grouped_fp8_gemm_nt_masked(out, a, a_scale, b, b_scale, masked_m)
inline void check_m_grouped_masked(const at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                                   const at::Tensor& b, const at::Tensor& b_scale, const at::Tensor& masked_m) {
  const char* op = "m_grouped_fp8_gemm_nt_masked";
  check_fp8(op, a, "a", 3);
  check_fp8(op, b, "b", 3);
  const int64_t G = a.size(0), max_m = a.size(1), K = a.size(2), N = b.size(1);
  check_shape(op, b, "b", {G, N, K}, "G, N, K with G, K from a");
  check_dtype(op, a_scale, "a_scale", at::kFloat);
  check_dtype(op, b_scale, "b_scale", at::kFloat);
  const int64_t kb = gemm_ceil_div(K, kGemmScaleBlock), nb = gemm_ceil_div(N, kGemmScaleBlock);
  check_shape(op, a_scale, "a_scale", {G, max_m, kb}, "G, max_m, ceil(K / 128)");
  check_shape(op, b_scale, "b_scale", {G, nb, kb}, "G, ceil(N / 128), ceil(K / 128)");
  check_dtype(op, masked_m, "masked_m", at::kInt);
  check_shape(op, masked_m, "masked_m", {G}, "G");
  DEEPINFER_CHECK(masked_m.numel() <= 1 || masked_m.is_contiguous(), op, "masked_m must be contiguous");
  check_dtype(op, out, "out", at::kBFloat16);
  check_shape(op, out, "out", {G, max_m, N}, "G, max_m, N");
  DEEPINFER_CHECK(out.numel() == 0 || N == 1 || out.stride(2) == 1, op, "out must be contiguous in N, got strides ",
                  out.strides());
  check_writable(op, out, "out");
  for (auto* t : {&a, &a_scale, &b, &b_scale, &masked_m}) check_same_device(op, *t, "an input", out, "out");
}

// fp4_to_fp8_blockscaled(out_q, out_scale, w, w_scale)
inline void check_fp4_to_fp8_blockscaled(const at::Tensor& out_q, const at::Tensor& out_scale, const at::Tensor& w,
                                         const at::Tensor& w_scale) {
  const char* op = "fp4_to_fp8_blockscaled";
  DEEPINFER_CHECK(w.scalar_type() == at::kChar || w.scalar_type() == at::kByte, op,
                  "w must be int8 or uint8 (two e2m1 codes per byte), got ", w.scalar_type());
  DEEPINFER_CHECK(w.dim() == 2 && w.is_contiguous(), op, "w must be a contiguous [N, K / 2], got shape ", w.sizes(),
                  " strides ", w.strides());
  const int64_t N = w.size(0), K = 2 * w.size(1);
  DEEPINFER_CHECK(w_scale.scalar_type() == at::kByte || w_scale.scalar_type() == at::kFloat8_e8m0fnu, op,
                  "w_scale must be uint8 or float8_e8m0fnu (UE8M0 exponents), got ", w_scale.scalar_type());
  DEEPINFER_CHECK(w_scale.is_contiguous(), op, "w_scale must be contiguous");
  check_shape(op, w_scale, "w_scale", {N, gemm_ceil_div(K, kFp4ScaleGroup)}, "N, ceil(K / 32)");
  check_dtype(op, out_q, "out_q", at::kFloat8_e4m3fn);
  DEEPINFER_CHECK(out_q.is_contiguous(), op, "out_q must be contiguous");
  check_shape(op, out_q, "out_q", {N, K}, "N, K = 2 * w.size(1)");
  check_dtype(op, out_scale, "out_scale", at::kFloat);
  check_shape(op, out_scale, "out_scale", {gemm_ceil_div(N, kGemmScaleBlock), gemm_ceil_div(K, kGemmScaleBlock)},
              "ceil(N / 128), ceil(K / 128)");
  check_writable(op, out_q, "out_q");
  check_writable(op, out_scale, "out_scale");
  check_same_device(op, w_scale, "w_scale", w, "w");
  check_same_device(op, out_q, "out_q", w, "w");
  check_same_device(op, out_scale, "out_scale", w, "w");
}

// swiglu_clamp_quant_fp8(out_q, out_scale, gate_up, limit, scale_ue8m0)
// gate_up [rows, 2 * I] (gate = [:, :I], up = [:, I:]), out_q [rows, I] e4m3, out_scale [rows, ceil(I / 128)]
// (any strides). Returns (gate_up2d, out_q2d).
inline void check_swiglu_clamp_quant_fp8(const at::Tensor& out_q, const at::Tensor& out_scale,
                                         const at::Tensor& gate_up, double limit) {
  const char* op = "swiglu_clamp_quant_fp8";
  DEEPINFER_CHECK(is_float_activation(gate_up.scalar_type()), op,
                  "gate_up must be float32, bfloat16 or float16, got ", gate_up.scalar_type());
  DEEPINFER_CHECK(gate_up.dim() == 2 && (gate_up.numel() == 0 || gate_up.stride(1) == 1), op,
                  "gate_up must be 2-D [rows, 2 * I] contiguous in its last dim, got shape ", gate_up.sizes(),
                  " strides ", gate_up.strides());
  DEEPINFER_CHECK(gate_up.size(1) % 2 == 0, op, "gate_up's last dim must be even (gate | up), got ", gate_up.size(1));
  DEEPINFER_CHECK(limit > 0, op, "limit must be > 0, got ", limit);
  const int64_t rows = gate_up.size(0), I = gate_up.size(1) / 2;
  check_dtype(op, out_q, "out_q", at::kFloat8_e4m3fn);
  check_shape(op, out_q, "out_q", {rows, I}, "rows, I");
  DEEPINFER_CHECK(out_q.numel() == 0 || out_q.stride(1) == 1, op, "out_q must be contiguous in its last dim");
  check_dtype(op, out_scale, "out_scale", at::kFloat);
  check_shape(op, out_scale, "out_scale", {rows, gemm_ceil_div(I, kGemmScaleBlock)}, "rows, ceil(I / 128)");
  check_writable(op, out_q, "out_q");
  check_writable(op, out_scale, "out_scale");
  check_same_device(op, out_q, "out_q", gate_up, "gate_up");
  check_same_device(op, out_scale, "out_scale", gate_up, "gate_up");
}

}  // namespace deepinfer
