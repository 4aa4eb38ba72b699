#include "deepinfer/mhc/mhc.cuh"

namespace deepinfer::mhc {
namespace {

constexpr int kMixThreads = 256;

// Four consecutive elements k0 .. k0 + 3 of a row as float (0 past `valid`); one vector load when `vec`.
template <typename T>
__device__ __forceinline__ void load4(const T* src, int64_t valid, bool vec, float (&v)[4]) {
  if (vec) {
    const Vec<T, 4> q = *reinterpret_cast<const Vec<T, 4>*>(src);
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = to_float(q.v[e]);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = e < valid ? to_float(src[e]) : 0.f;
  }
}

// hc_mix: out[t, m] = (x[t] . fn[m]) * rsqrt(mean(x[t]^2) + eps). A CTA of 256 threads takes kTok tokens; thread i
// owns the 4-element groups i, i + 256, ... of K for every one of them, accumulating in K order (the same order
// whether the loads are vectors or not); the per-thread partials then go through a fixed xor-shuffle tree and a
// sequential sum over the 8 warps. kTok only decides how many tokens share the weight reads: a token's arithmetic
// is the same for any kTok and any number of tokens.
template <typename T, int kTok, int kMaxM>
__global__ void __launch_bounds__(kMixThreads) hc_mix_kernel(HcMixParams p, bool vec) {
  constexpr int kWarps = kMixThreads / 32;
  constexpr int kVals = kTok * (kMaxM + 1);  // per token: kMaxM dot products, then the sum of squares
  __shared__ float red[kWarps][kVals];
  __shared__ float total[kVals];
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTok;
  const T* x = static_cast<const T*>(p.x);
  float acc[kTok][kMaxM + 1];
#pragma unroll
  for (int t = 0; t < kTok; ++t)
#pragma unroll
    for (int m = 0; m <= kMaxM; ++m) acc[t][m] = 0.f;
  for (int64_t k0 = static_cast<int64_t>(threadIdx.x) * 4; k0 < p.k; k0 += kMixThreads * 4) {
    const int64_t valid = p.k - k0;
    float xv[kTok][4];
#pragma unroll
    for (int t = 0; t < kTok; ++t) {
      if (t0 + t < p.tokens) {
        load4(x + (t0 + t) * p.x_row_stride + k0, valid, vec, xv[t]);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) xv[t][e] = 0.f;
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[t][kMaxM] += xv[t][e] * xv[t][e];
    }
#pragma unroll
    for (int m = 0; m < kMaxM; ++m) {
      if (m < p.m) {
        float w[4];
        load4(p.fn + static_cast<int64_t>(m) * p.k + k0, valid, vec, w);
#pragma unroll
        for (int t = 0; t < kTok; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[t][m] += xv[t][e] * w[e];
      }
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int t = 0; t < kTok; ++t) {
#pragma unroll
    for (int m = 0; m <= kMaxM; ++m) {
      if (m < p.m || m == kMaxM) {
        float v = acc[t][m];
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
        if (lane == 0) red[warp][t * (kMaxM + 1) + m] = v;
      }
    }
  }
  __syncthreads();
  for (int v = threadIdx.x; v < kVals; v += kMixThreads) {
    float s = red[0][v];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) s += red[w][v];
    total[v] = s;
  }
  __syncthreads();
  for (int v = threadIdx.x; v < kTok * p.m; v += kMixThreads) {
    const int t = v / p.m, m = v % p.m;
    if (t0 + t < p.tokens) {
      const float inv = rsqrtf(total[t * (kMaxM + 1) + kMaxM] / static_cast<float>(p.k) + p.eps);
      p.out[(t0 + t) * p.m + m] = total[t * (kMaxM + 1) + m] * inv;
    }
  }
}

template <typename T, int kTok>
void launch_mix_tok(const HcMixParams& p, bool vec, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.tokens + kTok - 1) / kTok));
  if (p.m <= 4) {
    hc_mix_kernel<T, kTok, 4><<<grid, kMixThreads, 0, stream>>>(p, vec);
  } else if (p.m <= 8) {
    hc_mix_kernel<T, kTok, 8><<<grid, kMixThreads, 0, stream>>>(p, vec);
  } else if (p.m <= 16) {
    hc_mix_kernel<T, kTok, 16><<<grid, kMixThreads, 0, stream>>>(p, vec);
  } else if (p.m <= 24) {
    hc_mix_kernel<T, kTok, 24><<<grid, kMixThreads, 0, stream>>>(p, vec);
  } else {
    hc_mix_kernel<T, kTok, 32><<<grid, kMixThreads, 0, stream>>>(p, vec);
  }
}

// hc_collapse (kPost = false): out[t, d] = sum_i pre[t, i] * streams[t, i, d].
// hc_post (kPost = true): out[t, j, d] = post[t, j] * x[t, d] + sum_i comb[t, i, j] * streams[t, i, d].
// float32 in stream order, one rounding; a thread takes V consecutive elements of one token (reads every stream of
// them before writing, so out may be streams itself).
template <typename T, int V, bool kPost>
__global__ void __launch_bounds__(256) hc_stream_kernel(HcStreamParams p) {
  const int64_t per_row = p.hidden / V;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= p.tokens * per_row) return;
  const int64_t t = idx / per_row, d0 = (idx % per_row) * V;
  const int hc = p.hc;
  const T* s = static_cast<const T*>(p.streams) + t * hc * p.hidden + d0;
  float in[kMaxStreams][V];
#pragma unroll
  for (int i = 0; i < kMaxStreams; ++i) {
    if (i < hc) {
      const Vec<T, V> q = *reinterpret_cast<const Vec<T, V>*>(s + i * p.hidden);
#pragma unroll
      for (int e = 0; e < V; ++e) in[i][e] = to_float(q.v[e]);
    }
  }
  if constexpr (!kPost) {
    const float* pre = p.pre + t * hc;
    Vec<T, V> o;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      float acc = pre[0] * in[0][e];
#pragma unroll
      for (int i = 1; i < kMaxStreams; ++i)
        if (i < hc) acc += pre[i] * in[i][e];
      o.v[e] = from_float<T>(acc);
    }
    *reinterpret_cast<Vec<T, V>*>(static_cast<T*>(p.out) + t * p.hidden + d0) = o;
  } else {
    const Vec<T, V> xq = *reinterpret_cast<const Vec<T, V>*>(static_cast<const T*>(p.x) + t * p.hidden + d0);
    const float* post = p.pre + t * hc;
    const float* comb = p.comb + t * hc * hc;
    T* out = static_cast<T*>(p.out) + t * hc * p.hidden + d0;
#pragma unroll
    for (int j = 0; j < kMaxStreams; ++j) {
      if (j < hc) {
        Vec<T, V> o;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          float acc = post[j] * to_float(xq.v[e]);
#pragma unroll
          for (int i = 0; i < kMaxStreams; ++i)
            if (i < hc) acc += comb[i * hc + j] * in[i][e];
          o.v[e] = from_float<T>(acc);
        }
        *reinterpret_cast<Vec<T, V>*>(out + j * p.hidden) = o;
      }
    }
  }
}

template <typename T, bool kPost>
void launch_stream_typed(const HcStreamParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = p.hidden % kVec == 0 && is_aligned(p.streams, 16) && is_aligned(p.out, 16) &&
                   (!kPost || is_aligned(p.x, 16));
  const int64_t n = p.tokens * (vec ? p.hidden / kVec : p.hidden);
  const dim3 grid(static_cast<unsigned>((n + 255) / 256));
  if (vec) {
    hc_stream_kernel<T, kVec, kPost><<<grid, 256, 0, stream>>>(p);
  } else {
    hc_stream_kernel<T, 1, kPost><<<grid, 256, 0, stream>>>(p);
  }
  DEEPINFER_CHECK_LAUNCH(kPost ? "hc_post_kernel" : "hc_collapse_kernel");
}

}  // namespace

void launch_hc_mix(const HcMixParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return;
  DEEPINFER_DISPATCH_FLOAT(p.dtype, [&] {
    const bool vec = p.k % 4 == 0 && p.x_row_stride % 4 == 0 && is_aligned(p.x, 4 * sizeof(scalar_t)) &&
                     is_aligned(p.fn, 16);
    // 4 tokens per CTA share the weight reads once there are enough tokens to fill the GPU with such CTAs
    if (p.tokens >= 1024) {
      launch_mix_tok<scalar_t, 4>(p, vec, stream);
    } else {
      launch_mix_tok<scalar_t, 1>(p, vec, stream);
    }
  });
  DEEPINFER_CHECK_LAUNCH("hc_mix_kernel");
}

void launch_hc_collapse(const HcStreamParams& p, cudaStream_t stream) {
  if (p.tokens == 0 || p.hidden == 0) return;
  DEEPINFER_DISPATCH_FLOAT(p.dtype, [&] { launch_stream_typed<scalar_t, false>(p, stream); });
}

void launch_hc_post(const HcStreamParams& p, cudaStream_t stream) {
  if (p.tokens == 0 || p.hidden == 0) return;
  DEEPINFER_DISPATCH_FLOAT(p.dtype, [&] { launch_stream_typed<scalar_t, true>(p, stream); });
}

}  // namespace deepinfer::mhc
