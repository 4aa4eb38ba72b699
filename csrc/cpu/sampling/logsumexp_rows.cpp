// CPU logsumexp_rows: each row on its own, serial, in a fixed order (8 interleaved partial sums added in lane order),
// scalar libm exp: a row's bits depend on its values only, never on the other rows or on threading.
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "common/sampling_checks.h"
#include "ops.h"

namespace deepinfer {

namespace {

float logsumexp_row(const float* x, int64_t V) {
  constexpr int kLanes = 8;
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < V; ++v) m = std::fmax(m, x[v]);  // fmax skips NaN; a NaN reaches the sum below
  const float shift = std::isfinite(m) ? m : 0.f;  // +inf row -> +inf (or NaN), all -inf (or empty) -> -inf
  float acc[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int64_t v = 0; v < V; ++v) acc[v % kLanes] += std::exp(x[v] - shift);
  float total = 0.f;
  for (int l = 0; l < kLanes; ++l) total += acc[l];
  return std::log(total) + shift;
}

}  // namespace

void logsumexp_rows_cpu(at::Tensor& out, const at::Tensor& x) {
  check_logsumexp_rows(out, x);
  const int64_t n = x.size(0), V = x.size(1), stride = x.stride(0);
  if (n == 0) return;
  const float* xp = x.const_data_ptr<float>();
  float* o = out.mutable_data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = logsumexp_row(xp + r * stride, V);
  });
}

}  // namespace deepinfer
