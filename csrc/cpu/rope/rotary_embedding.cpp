// CPU rotary_embedding: DeepSeek-V4's interleaved (GPT-J pair) partial RoPE on the trailing rope_dim
// channels of every head, in place. Positions outside [0, max_position) write NaN into the rope slice
// (the CUDA kernel does the same) so that a bad position cannot pass unnoticed.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <limits>

#include "common/rope_checks.h"
#include "ops.h"

namespace deepinfer {
namespace {

template <typename T, typename P>
void rope_rows(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cache, bool inverse) {
  const int64_t T_ = x.size(0);
  const int64_t H = x.dim() == 3 ? x.size(1) : 1;
  const int64_t D = x.size(-1);
  const int64_t s_tok = x.stride(0), s_head = x.dim() == 3 ? x.stride(1) : 0;
  const int64_t rope_dim = cache.size(1), half = rope_dim / 2, max_pos = cache.size(0);
  const int64_t off = D - rope_dim;
  T* data = x.mutable_data_ptr<T>();
  const P* pos = positions.const_data_ptr<P>();
  const int64_t pos_stride = positions.stride(0);
  const float* cs = cache.const_data_ptr<float>();
  const float sign = inverse ? -1.f : 1.f;
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = static_cast<int64_t>(pos[t * pos_stride]);
      const bool valid = p >= 0 && p < max_pos;
      const float* c = cs + (valid ? p : 0) * rope_dim;
      for (int64_t h = 0; h < H; ++h) {
        T* v = data + t * s_tok + h * s_head + off;
        for (int64_t i = 0; i < half; ++i) {
          if (!valid) {
            v[2 * i] = static_cast<T>(std::numeric_limits<float>::quiet_NaN());
            v[2 * i + 1] = static_cast<T>(std::numeric_limits<float>::quiet_NaN());
            continue;
          }
          const float cosv = c[i], sinv = sign * c[half + i];
          const float x0 = static_cast<float>(v[2 * i]), x1 = static_cast<float>(v[2 * i + 1]);
          v[2 * i] = static_cast<T>(x0 * cosv - x1 * sinv);
          v[2 * i + 1] = static_cast<T>(x0 * sinv + x1 * cosv);
        }
      }
    }
  });
}

}  // namespace

void rotary_embedding_cpu(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin_cache, bool inverse) {
  check_rotary_embedding(x, positions, cos_sin_cache);
  if (x.numel() == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_embedding_cpu", [&] {
    if (positions.scalar_type() == at::kLong) {
      rope_rows<scalar_t, int64_t>(x, positions, cos_sin_cache, inverse);
    } else {
      rope_rows<scalar_t, int32_t>(x, positions, cos_sin_cache, inverse);
    }
  });
}

}  // namespace deepinfer
