// CPU moe_combine: each token's top-k expert rows added in slot order in float32 (no dependence on the batch).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <vector>

#include "common/moe_checks.h"
#include "ops.h"

namespace deepinfer {
namespace {

template <typename Y, typename O>
void combine_rows(at::Tensor& out, const at::Tensor& y, const at::Tensor& slot_rows, const at::Tensor& weights) {
  const int64_t T_ = slot_rows.size(0), k = slot_rows.size(1), hidden = y.size(1), R = y.size(0);
  const int64_t ys = y.stride(0);
  const Y* yp = y.const_data_ptr<Y>();
  const int64_t* rows = slot_rows.const_data_ptr<int64_t>();
  const float* w = weights.const_data_ptr<float>();
  O* o = out.mutable_data_ptr<O>();
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(hidden);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = rows[t * k + j];
        if (r < 0 || r >= R) continue;
        const float wj = w[t * k + j];
        const Y* src = yp + r * ys;
        for (int64_t d = 0; d < hidden; ++d) acc[d] += wj * static_cast<float>(src[d]);
      }
      for (int64_t d = 0; d < hidden; ++d) o[t * hidden + d] = static_cast<O>(acc[d]);
    }
  });
}

}  // namespace

void moe_combine_cpu(at::Tensor& out, const at::Tensor& y, const at::Tensor& slot_rows, const at::Tensor& weights) {
  check_moe_combine(out, y, slot_rows, weights);
  if (out.numel() == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "moe_combine_cpu", [&] {
    using Y = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "moe_combine_cpu_out",
                                    [&] { combine_rows<Y, scalar_t>(out, y, slot_rows, weights); });
  });
}

}  // namespace deepinfer
