// CPU implementations of the FP8 block-scaled GEMM family, the FP4 -> FP8 weight conversion and the clamped
// SwiGLU + FP8 re-quantisation. Same contract as the CUDA kernels (see python/deepinfer_ops/gemm.py):
// per 128-deep K block, the block's products are summed in fp32 and added to the fp32 accumulator after
// multiplying by sfa[m, kb] * sfb[n / 128, kb]; the result is rounded once to the output dtype.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/gemm_checks.h"
#include "common/quant_checks.h"
#include "ops.h"

namespace deepinfer {
namespace {

// fp32 [R, N] = block-scaled A2 [R, K] . B2[N, K]^T. sa [R, ceil(K/128)], sb [ceil(N/128), ceil(K/128)], any strides.
// Each output element is computed by one thread in a fixed order (per K block: sequential fp32 sum of the block's
// products, then total += sum * (sa * sb)), so the result is deterministic and independent of R and of threading.
at::Tensor blockscaled_mm_f32(const at::Tensor& a2, const at::Tensor& sa, const at::Tensor& b2, const at::Tensor& sb) {
  const int64_t R = a2.size(0), K = a2.size(1), N = b2.size(0);
  auto acc = at::zeros({R, N}, a2.options().dtype(at::kFloat));
  if (R == 0 || N == 0 || K == 0) return acc;
  const auto af = a2.to(at::kFloat).contiguous();
  const auto bf = b2.to(at::kFloat).contiguous();
  const auto saf = sa.to(at::kFloat);
  const auto sbf = sb.to(at::kFloat);
  const float* A = af.const_data_ptr<float>();
  const float* B = bf.const_data_ptr<float>();
  const float* SA = saf.const_data_ptr<float>();
  const float* SB = sbf.const_data_ptr<float>();
  const int64_t sa_r = saf.stride(0), sa_k = saf.stride(1), sb_n = sbf.stride(0), sb_k = sbf.stride(1);
  float* C = acc.mutable_data_ptr<float>();
  const int64_t kb_count = gemm_ceil_div(K, kGemmScaleBlock);
  at::parallel_for(0, R * N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t r = idx / N, n = idx % N;
      const float* a = A + r * K;
      const float* b = B + n * K;
      float total = 0.f;
      for (int64_t kb = 0; kb < kb_count; ++kb) {
        const int64_t k0 = kb * kGemmScaleBlock, k1 = std::min(K, k0 + kGemmScaleBlock);
        float part = 0.f;
        for (int64_t k = k0; k < k1; ++k) part += a[k] * b[k];
        const float scale = SA[r * sa_r + kb * sa_k] * SB[(n / kGemmScaleBlock) * sb_n + kb * sb_k];
        total += part * scale;
      }
      C[idx] = total;
    }
  });
  return acc;
}

// e2m1 code -> value (sign bit 3, exponent bits 2..1, mantissa bit 0).
constexpr float kE2m1Values[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                                   -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

inline float silu_clamped(float g, float limit) {
  g = std::min(g, limit);  // NaN stays NaN (std::min returns the first argument when unordered)
  return g / (1.f + std::exp(-g));
}

}  // namespace

// split_k only changes the CUDA schedule (the CPU result is the same for every split_k).
void fp8_gemm_nt_cpu(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                     const at::Tensor& b_scale, bool accumulate, int64_t split_k) {
  check_fp8_gemm_nt(out, a, a_scale, b, b_scale, accumulate, split_k);
  if (out.numel() == 0) return;
  const auto acc = blockscaled_mm_f32(a, a_scale, b, b_scale);
  if (accumulate) {
    out.add_(acc);
  } else {
    out.copy_(acc);
  }
}

void m_grouped_fp8_gemm_nt_contiguous_cpu(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                                          const at::Tensor& b, const at::Tensor& b_scale,
                                          const at::Tensor& m_indices) {
  const char* op = "m_grouped_fp8_gemm_nt_contiguous";
  check_m_grouped_contiguous(out, a, a_scale, b, b_scale, m_indices);
  const int64_t M = a.size(0), G = b.size(0);
  if (M == 0 || out.numel() == 0) return;
  const int32_t* idx = m_indices.const_data_ptr<int32_t>();
  std::vector<int64_t> first(G, -1), last(G, -1), count(G, 0);
  for (int64_t r = 0; r < M; ++r) {
    const int32_t e = idx[r];
    DEEPINFER_CHECK(e >= -1 && e < G, op, "m_indices[", r, "] = ", e, " is outside [-1, ", G, ")");
    if (e < 0) continue;
    if (first[e] < 0) first[e] = r;
    last[e] = r;
    ++count[e];
  }
  for (int64_t g = 0; g < G; ++g) {
    if (count[g] == 0) continue;
    DEEPINFER_CHECK(last[g] - first[g] + 1 == count[g], op, "the rows of group ", g,
                    " must be one contiguous run of m_indices, but rows ", first[g], "..", last[g], " hold only ",
                    count[g], " rows of it");
    const auto rows = a.narrow(0, first[g], count[g]);
    const auto acc = blockscaled_mm_f32(rows, a_scale.narrow(0, first[g], count[g]), b[g], b_scale[g]);
    out.narrow(0, first[g], count[g]).copy_(acc);
  }
}

void m_grouped_fp8_gemm_nt_masked_cpu(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                                      const at::Tensor& b, const at::Tensor& b_scale, const at::Tensor& masked_m) {
  const char* op = "m_grouped_fp8_gemm_nt_masked";
  check_m_grouped_masked(out, a, a_scale, b, b_scale, masked_m);
  const int64_t G = a.size(0), max_m = a.size(1);
  const int32_t* mm = masked_m.const_data_ptr<int32_t>();
  for (int64_t g = 0; g < G; ++g) {
    DEEPINFER_CHECK(mm[g] >= 0 && mm[g] <= max_m, op, "masked_m[", g, "] = ", mm[g], " is outside [0, max_m = ",
                    max_m, "]");
  }
  if (out.numel() == 0) return;
  for (int64_t g = 0; g < G; ++g) {
    if (mm[g] == 0) continue;
    const auto acc = blockscaled_mm_f32(a[g].narrow(0, 0, mm[g]), a_scale[g].narrow(0, 0, mm[g]), b[g], b_scale[g]);
    out[g].narrow(0, 0, mm[g]).copy_(acc);
  }
}

void fp4_to_fp8_blockscaled_cpu(at::Tensor& out_q, at::Tensor& out_scale, const at::Tensor& w,
                                const at::Tensor& w_scale) {
  check_fp4_to_fp8_blockscaled(out_q, out_scale, w, w_scale);
  const int64_t N = w.size(0), K = 2 * w.size(1);
  if (N == 0 || K == 0) return;
  const int64_t groups = gemm_ceil_div(K, kFp4ScaleGroup);
  const int64_t nb_count = gemm_ceil_div(N, kGemmScaleBlock), kb_count = gemm_ceil_div(K, kGemmScaleBlock);
  const uint8_t* wp = static_cast<const uint8_t*>(w.const_data_ptr());
  const uint8_t* sp = static_cast<const uint8_t*>(w_scale.const_data_ptr());
  auto* q = reinterpret_cast<c10::Float8_e4m3fn*>(out_q.mutable_data_ptr());
  float* os = out_scale.mutable_data_ptr<float>();
  const int64_t os_row = out_scale.stride(0), os_col = out_scale.stride(1);
  at::parallel_for(0, nb_count * kb_count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t nb = blk / kb_count, kb = blk % kb_count;
      const int64_t n0 = nb * kGemmScaleBlock, n1 = std::min(N, n0 + kGemmScaleBlock);
      const int64_t k0 = kb * kGemmScaleBlock, k1 = std::min(K, k0 + kGemmScaleBlock);
      const int64_t g0 = k0 / kFp4ScaleGroup, g1 = gemm_ceil_div(k1, kFp4ScaleGroup);
      // Block exponent: the largest finite UE8M0 exponent of the block (255 encodes NaN).
      int emax = 0;
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t g = g0; g < g1; ++g)
          if (sp[n * groups + g] != 255) emax = std::max<int>(emax, sp[n * groups + g]);
      // Block scale 2^(emax - 127 - 6): |q| <= 6 * 2^6 = 384 <= 448, and every element whose group exponent is at
      // most 14 below emax stays exact in e4m3 (its smallest non-zero magnitude 0.5 * 2^(e - emax + 6) >= 2^-9).
      os[nb * os_row + kb * os_col] = std::ldexp(1.f, emax - 127 - 6);
      for (int64_t n = n0; n < n1; ++n) {
        for (int64_t k = k0; k < k1; ++k) {
          const uint8_t e = sp[n * groups + k / kFp4ScaleGroup];
          const uint8_t byte = wp[n * (K / 2) + k / 2];
          const int code = (k % 2 == 0) ? (byte & 0xF) : (byte >> 4);
          const float v = e == 255 ? NAN : std::ldexp(kE2m1Values[code], int(e) - emax + 6);
          q[n * K + k] = c10::Float8_e4m3fn(v);
        }
      }
    }
  });
}

void swiglu_clamp_quant_fp8_cpu(at::Tensor& out_q, at::Tensor& out_scale, const at::Tensor& gate_up, double limit,
                                bool scale_ue8m0) {
  check_swiglu_clamp_quant_fp8(out_q, out_scale, gate_up, limit);
  const int64_t rows = gate_up.size(0), I = gate_up.size(1) / 2;
  if (rows == 0 || I == 0) return;
  const int64_t groups = gemm_ceil_div(I, kGemmScaleBlock);
  const float lim = static_cast<float>(limit);
  auto* q = reinterpret_cast<c10::Float8_e4m3fn*>(out_q.mutable_data_ptr());
  float* s = out_scale.mutable_data_ptr<float>();
  const int64_t q_row = out_q.stride(0), s_row = out_scale.stride(0), s_col = out_scale.stride(1);
  const int64_t in_row = gate_up.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "swiglu_clamp_quant_fp8_cpu", [&] {
    const scalar_t* x = gate_up.const_data_ptr<scalar_t>();
    at::parallel_for(0, rows * groups, 16, [&](int64_t begin, int64_t end) {
      float h[kGemmScaleBlock];
      for (int64_t idx = begin; idx < end; ++idx) {
        const int64_t r = idx / groups, g = idx % groups;
        const int64_t i0 = g * kGemmScaleBlock, i1 = std::min(I, i0 + kGemmScaleBlock);
        float amax = 0.f;
        for (int64_t i = i0; i < i1; ++i) {
          const float gate = static_cast<float>(x[r * in_row + i]);
          const float up = std::min(std::max(static_cast<float>(x[r * in_row + I + i]), -lim), lim);
          const float v = silu_clamped(gate, lim) * up;  // clamps keep NaN
          h[i - i0] = v;
          const float av = std::fabs(v);
          amax = (av > amax || std::isnan(av)) ? av : amax;
        }
        float sc = std::max(amax, kQuantAmaxEps) / kFp8E4m3Max;
        if (std::isnan(amax)) sc = amax;
        if (scale_ue8m0 && std::isfinite(sc)) {
          int e;
          const float m = std::frexp(sc, &e);  // sc = m * 2^e, m in [0.5, 1)
          sc = (m == 0.5f) ? sc : std::ldexp(1.f, e);
        }
        s[r * s_row + g * s_col] = sc;
        for (int64_t i = i0; i < i1; ++i) {
          float v = h[i - i0] / sc;
          v = std::min(std::max(v, -kFp8E4m3Max), kFp8E4m3Max);
          q[r * q_row + i] = c10::Float8_e4m3fn(v);
        }
      }
    });
  });
}

}  // namespace deepinfer
