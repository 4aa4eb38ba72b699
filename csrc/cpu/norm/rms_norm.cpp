// CPU rms_norm: one row at a time, fp32 accumulation in a fixed order (8 interleaved partial sums
// combined pairwise), so a row's result never depends on how many rows are in the batch.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "common/norm_checks.h"
#include "ops.h"

namespace deepinfer {
namespace {

template <typename T, typename W>
void rms_norm_rows(at::Tensor& out2, const at::Tensor& in2, const W* w, float eps) {
  const int64_t rows = in2.size(0), hidden = in2.size(1);
  const int64_t in_stride = in2.stride(0), out_stride = out2.stride(0);
  const T* in = in2.const_data_ptr<T>();
  T* out = out2.mutable_data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x = in + r * in_stride;
      T* y = out + r * out_stride;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      int64_t i = 0;
      for (; i + 8 <= hidden; i += 8) {
        for (int j = 0; j < 8; ++j) {
          const float v = static_cast<float>(x[i + j]);
          acc[j] += v * v;
        }
      }
      for (int j = 0; i < hidden; ++i, ++j) {
        const float v = static_cast<float>(x[i]);
        acc[j] += v * v;
      }
      const float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
      for (int64_t k = 0; k < hidden; ++k) {
        float v = static_cast<float>(x[k]) * inv;
        if (w != nullptr) v *= static_cast<float>(w[k]);
        y[k] = static_cast<T>(v);
      }
    }
  });
}

}  // namespace

void rms_norm_cpu(at::Tensor& out, const at::Tensor& input, const std::optional<at::Tensor>& weight, double eps) {
  auto [in2, out2] = check_rms_norm(out, input, weight, eps);
  if (in2.numel() == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "rms_norm_cpu", [&] {
    if (!weight.has_value()) {
      rms_norm_rows<scalar_t, float>(out2, in2, nullptr, static_cast<float>(eps));
    } else if (weight->scalar_type() == at::kFloat) {
      rms_norm_rows<scalar_t, float>(out2, in2, weight->const_data_ptr<float>(), static_cast<float>(eps));
    } else {
      rms_norm_rows<scalar_t, scalar_t>(out2, in2, weight->const_data_ptr<scalar_t>(), static_cast<float>(eps));
    }
  });
}

}  // namespace deepinfer
