// CPU compressor_pool: each (window, dim) on its own over the window's slots in slot order, float32, scalar libm exp.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "common/attention_checks.h"
#include "ops.h"

namespace deepinfer {
namespace {

template <typename T>
void pool_windows(at::Tensor& out, const at::Tensor& kv, const at::Tensor& gate) {
  const int64_t n = kv.size(0), S = kv.size(1), hd = kv.size(2);
  const int64_t kv_n = kv.stride(0), kv_s = kv.stride(1), g_n = gate.stride(0), g_s = gate.stride(1);
  const T* kp = kv.const_data_ptr<T>();
  const float* gp = gate.const_data_ptr<float>();
  T* o = out.mutable_data_ptr<T>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t d = 0; d < hd; ++d) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < S; ++s) m = std::fmax(m, gp[w * g_n + s * g_s + d]);
        float den = 0.f, num = 0.f;
        for (int64_t s = 0; s < S; ++s) {
          const float e = std::exp(gp[w * g_n + s * g_s + d] - m);
          den += e;
          num += e * static_cast<float>(kp[w * kv_n + s * kv_s + d]);
        }
        if (!std::isfinite(num) && std::isfinite(den)) {
          // the exp-weighted sum overflowed (|kv| near FLT_MAX / S) though the weighted mean may be finite: redo it
          // with kv scaled by 2^-k (exact), 2^k >= 4 S, and scale the mean back; taken only for such windows, so
          // every other result keeps its bits (and inf / NaN kv still give inf / NaN)
          const int k = 2 + static_cast<int>(std::ceil(std::log2(static_cast<double>(S))));
          num = 0.f;
          for (int64_t s = 0; s < S; ++s) {
            const float e = std::exp(gp[w * g_n + s * g_s + d] - m);
            num += e * std::ldexp(static_cast<float>(kp[w * kv_n + s * kv_s + d]), -k);
          }
          o[w * hd + d] = static_cast<T>(std::ldexp(num / den, k));
          continue;
        }
        o[w * hd + d] = static_cast<T>(num / den);
      }
    }
  });
}

}  // namespace

void compressor_pool_cpu(at::Tensor& out, const at::Tensor& kv, const at::Tensor& gate) {
  check_compressor_pool(out, kv, gate);
  if (out.numel() == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv.scalar_type(), "compressor_pool_cpu",
                                  [&] { pool_windows<scalar_t>(out, kv, gate); });
}

}  // namespace deepinfer
