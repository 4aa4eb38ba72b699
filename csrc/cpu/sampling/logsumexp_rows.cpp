// CPU logsumexp_rows: each row on its own, in a fixed order: the row max (and a NaN check), then exp(x - max) summed
// into 8 lanes (lane = v % 8; float sums per 1024-element chunk, added to double lane totals), the lanes added in
// order. exp is a select-only polynomial (below) that the compiler vectorises; every element goes through the same
// arithmetic wherever it sits, so a row's bits depend on its values only, never on the other rows, its address or
// threading.
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "common/sampling_checks.h"
#include "ops.h"

namespace deepinfer {
namespace {

constexpr int kLanes = 8;

// exp(d) in float32 to ~1 ulp for d <= 0 (Cody-Waite reduction by ln 2, degree-6 Taylor polynomial on
// |r| <= ln2 / 2, scaling by 2^n through the exponent bits); d < -87.3 (-inf included) gives 0: below the smallest
// normal float, and a logsumexp sum holds exp(0) = 1, so nothing is lost. Plain SSE2 arithmetic and selects, so the
// compiler vectorises the loops below (rounding to nearest by adding and subtracting 1.5 * 2^23).
inline float exp_nonpositive(float d) {
  const float xc = d < -87.3f ? -87.3f : d;
  constexpr float kRound = 12582912.f;
  const float n = (xc * 1.44269504088896341f + kRound) - kRound;
  const float r = (xc - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);  // 2^n (no std::bit_cast: torch < 2.12 builds as C++17)
  return d < -87.3f ? 0.f : p * scale;
}

// Element v belongs to lane v % 8 in both passes (the last V % 8 elements too).
float logsumexp_row(const float* __restrict x, int64_t V) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  float mx[kLanes];
  uint32_t nan[kLanes];
  for (int j = 0; j < kLanes; ++j) mx[j] = -kInf, nan[j] = 0;
  const int64_t full = V / kLanes * kLanes;
  auto scan = [&](int64_t v, int j) {
    const float t = x[v + j];
    mx[j] = t > mx[j] ? t : mx[j];
    uint32_t u;
    std::memcpy(&u, &t, sizeof u);
    nan[j] |= (u & 0x7fffffffu) > 0x7f800000u;
  };
  for (int64_t v = 0; v < full; v += kLanes) {
    for (int j = 0; j < kLanes; ++j) scan(v, j);
  }
  for (int j = 0; j < V - full; ++j) scan(full, j);
  float m = -kInf;
  uint32_t any_nan = 0;
  for (int j = 0; j < kLanes; ++j) m = mx[j] > m ? mx[j] : m, any_nan |= nan[j];
  if (any_nan) return std::numeric_limits<float>::quiet_NaN();
  if (!std::isfinite(m)) return m;  // a +inf row -> +inf; all -inf (or V == 0) -> -inf
  // float lane sums over chunks of kChunk elements, added to double lane totals after each chunk (keeps the
  // rounding error of a 129,280-wide row near float precision)
  constexpr int64_t kChunk = 1024;
  double total[kLanes] = {0., 0., 0., 0., 0., 0., 0., 0.};
  for (int64_t c = 0; c < full; c += kChunk) {
    const int64_t end = c + kChunk < full ? c + kChunk : full;
    float acc[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t v = c; v < end; v += kLanes) {
      for (int j = 0; j < kLanes; ++j) acc[j] += exp_nonpositive(x[v + j] - m);
    }
    for (int j = 0; j < kLanes; ++j) total[j] += acc[j];
  }
  for (int j = 0; j < V - full; ++j) total[j] += exp_nonpositive(x[full + j] - m);  // the last V % 8
  double sum = 0.;
  for (int j = 0; j < kLanes; ++j) sum += total[j];
  return static_cast<float>(std::log(sum) + m);
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
