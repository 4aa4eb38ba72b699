// CPU per_token_group_quant_fp8: per (row, group) amax -> scale -> e4m3 with round-to-nearest-even.
// Bit-for-bit the same recipe as the CUDA kernel and deepinfer_ops.testing.refs.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/quant_checks.h"
#include "ops.h"

namespace deepinfer {
namespace {

// Smallest power of two >= s (s positive, normal): exact via the exponent bits.
inline float round_up_pow2(float s) {
  uint32_t bits;
  std::memcpy(&bits, &s, 4);
  uint32_t exp = (bits >> 23) & 0xffu;
  if ((bits & 0x7fffffu) != 0u) exp += 1u;
  bits = exp << 23;
  float r;
  std::memcpy(&r, &bits, 4);
  return r;
}

template <typename T>
void quant_rows(at::Tensor& q2, at::Tensor& scale, const at::Tensor& in2, int64_t group_size, bool ue8m0) {
  const int64_t rows = in2.size(0), K = in2.size(1);
  const int64_t groups = ceil_div(K, group_size);
  const T* in = in2.const_data_ptr<T>();
  auto* q = reinterpret_cast<c10::Float8_e4m3fn*>(q2.mutable_data_ptr());
  float* s = scale.mutable_data_ptr<float>();
  const int64_t in_stride = in2.stride(0), q_stride = q2.stride(0);
  const int64_t s_row = scale.stride(0), s_col = scale.stride(1);
  at::parallel_for(0, rows * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t r = idx / groups, g = idx % groups;
      const int64_t k0 = g * group_size, k1 = std::min(K, k0 + group_size);
      const T* x = in + r * in_stride;
      float amax = 0.f;
      for (int64_t k = k0; k < k1; ++k) {
        const float a = std::fabs(static_cast<float>(x[k]));
        amax = (a > amax || std::isnan(a)) ? a : amax;  // NaN propagates, like torch.amax
      }
      float sc = std::max(amax, kQuantAmaxEps) / kFp8E4m3Max;
      if (std::isnan(amax)) sc = amax;
      if (ue8m0 && std::isfinite(sc)) sc = round_up_pow2(sc);
      s[r * s_row + g * s_col] = sc;
      const float inv = 1.0f / sc;
      for (int64_t k = k0; k < k1; ++k) {
        float v = static_cast<float>(x[k]) * inv;
        v = std::min(std::max(v, -kFp8E4m3Max), kFp8E4m3Max);
        q[r * q_stride + k] = c10::Float8_e4m3fn(v);
      }
    }
  });
}

}  // namespace

void per_token_group_quant_fp8_cpu(at::Tensor& out_q, at::Tensor& out_scale, const at::Tensor& input,
                                   int64_t group_size, bool scale_ue8m0) {
  auto [in2, q2] = check_per_token_group_quant_fp8(out_q, out_scale, input, group_size);
  if (in2.numel() == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "per_token_group_quant_fp8_cpu", [&] {
    quant_rows<scalar_t>(q2, out_scale, in2, group_size, scale_ue8m0);
  });
}

}  // namespace deepinfer
