#include "deepinfer/mhc/mhc.cuh"
#include "deepinfer/ptx.cuh"
#include "common/mhc_math.h"
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace deepinfer::mhc {
namespace {

// Four consecutive elements of a row as float, 0 past the first `valid` (the weights' unaligned or partial groups;
// the aligned ones are copied with cp.async).
template <typename T>
__device__ __forceinline__ void load4(const T* src, int64_t valid, float (&v)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) v[e] = e < valid ? to_float(src[e]) : 0.f;
}

// hc_mix: out[t, m] = (x[t] . fn[m]) * rsqrt(mean(x[t]^2) + eps).
// The reduction order of a token is fixed by K alone: K is cut into parts of kPartK elements, a part into chunks of
// kChunk, and a chunk's 4-element groups are dealt to kSlices threads (slice s takes groups s, s + kSlices, ...). A
// thread accumulates its groups in K order; the kSlices partials go through a fixed xor-shuffle tree; the parts are
// added in order and the norm applied: one CTA column per part writes the partials, a second kernel adds them. kTpt
// (tokens per thread) and the CTA's token count only decide which tokens share the weight reads, never a token's
// arithmetic: batch-invariant for any number of tokens. bf16 streams take the tensor-core kernel below instead of
// the FMA one (hc_mix_mma_kernel), for every number of tokens.
constexpr int kSlices = 8;
constexpr int kChunk = 256;
constexpr int kPartK = static_cast<int>(kHcMixPartK);
constexpr int kGroupsPerSlice = kChunk / 4 / kSlices;

template <int kTpt>
__host__ __device__ constexpr int mix_threads() {
  return (kTpt == 1 ? 8 : 16) * kSlices;  // token groups per CTA x kSlices
}

// Stages the weights of the chunk at column c0 in w_s [kMaxM][kChunk / 4]: asynchronous copies when vec, columns
// past K as zeros; rows m >= p.m are neither written nor read.
template <int kMaxM, int kThreads>
__device__ __forceinline__ void stage_weights(const HcMixParams& p, float4 (*w_s)[kChunk / 4], int64_t c0, bool vec) {
  for (int i = threadIdx.x; i < p.m * (kChunk / 4); i += kThreads) {
    const int m = i / (kChunk / 4), g = i % (kChunk / 4);
    const int64_t k = c0 + 4 * g;
    if (vec && k < p.k) {
      cp_async_16(&w_s[m][g], p.fn + static_cast<int64_t>(m) * p.k + k);
    } else {
      float v[4] = {0.f, 0.f, 0.f, 0.f};
      if (k < p.k) load4(p.fn + static_cast<int64_t>(m) * p.k + k, p.k - k, v);
      w_s[m][g] = make_float4(v[0], v[1], v[2], v[3]);
    }
  }
}

// This thread's x groups of the chunk at column c0: tokens t0 .. t0 + kTpt - 1, groups slice + kSlices j (zeros past
// the tokens or K).
template <typename T, int kTpt>
__device__ __forceinline__ void load_x(const HcMixParams& p, int64_t t0, int64_t c0, int slice, bool vec,
                                       Vec<T, 4> (&xr)[kTpt][kGroupsPerSlice]) {
  const T* x = static_cast<const T*>(p.x);
#pragma unroll
  for (int t = 0; t < kTpt; ++t) {
#pragma unroll
    for (int j = 0; j < kGroupsPerSlice; ++j) {
      const int64_t k = c0 + 4 * (slice + kSlices * j);
      const T* src = x + (t0 + t) * p.x_row_stride + k;
      const bool row_ok = t0 + t < p.tokens && k < p.k;
      if (vec && row_ok) {
        xr[t][j] = *reinterpret_cast<const Vec<T, 4>*>(src);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) xr[t][j].v[e] = row_ok && e < p.k - k ? src[e] : from_float<T>(0.f);
      }
    }
  }
}

// One chunk's products: acc[t][m] += x . w over this thread's groups in K order, acc[t][kMaxM] += x . x. Both
// kernels run this code, so a part's arithmetic is the same in each.
template <typename T, int kTpt, int kMaxM>
__device__ __forceinline__ void mix_chunk(const float4 (*w_s)[kChunk / 4], const Vec<T, 4> (&xr)[kTpt][kGroupsPerSlice],
                                          int slice, int m_count, float (&acc)[kTpt][kMaxM + 1]) {
#pragma unroll
  for (int j = 0; j < kGroupsPerSlice; ++j) {
    const int g = slice + kSlices * j;
    float xv[kTpt][4];
#pragma unroll
    for (int t = 0; t < kTpt; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        xv[t][e] = to_float(xr[t][j].v[e]);
        acc[t][kMaxM] += xv[t][e] * xv[t][e];
      }
    }
#pragma unroll
    for (int m = 0; m < kMaxM; ++m) {
      if (m < m_count) {
        const float4 w = w_s[m][g];
#pragma unroll
        for (int t = 0; t < kTpt; ++t) {
          acc[t][m] += xv[t][0] * w.x;
          acc[t][m] += xv[t][1] * w.y;
          acc[t][m] += xv[t][2] * w.z;
          acc[t][m] += xv[t][3] * w.w;
        }
      }
    }
  }
}

template <typename T, int kTpt, int kMaxM>
__global__ void __launch_bounds__(mix_threads<kTpt>()) hc_mix_partial_kernel(HcMixParams p, float* partial,
                                                                              bool vec) {
  constexpr int kThreads = mix_threads<kTpt>();
  __shared__ float4 w_s[kMaxM][kChunk / 4];
  const int slice = threadIdx.x % kSlices, group = threadIdx.x / kSlices;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * (kThreads / kSlices) * kTpt + group * kTpt;
  const int64_t k_begin = static_cast<int64_t>(blockIdx.y) * kPartK;
  const int64_t k_end = k_begin + kPartK < p.k ? k_begin + kPartK : p.k;
  float acc[kTpt][kMaxM + 1];
#pragma unroll
  for (int t = 0; t < kTpt; ++t)
#pragma unroll
    for (int m = 0; m <= kMaxM; ++m) acc[t][m] = 0.f;
  for (int64_t c0 = k_begin; c0 < k_end; c0 += kChunk) {
    __syncthreads();  // the previous chunk's weights are no longer read
    // stage the chunk's weights [m][kChunk] (asynchronous copies, all in flight), then read this thread's x
    stage_weights<kMaxM, kThreads>(p, w_s, c0, vec);
    Vec<T, 4> xr[kTpt][kGroupsPerSlice];
    load_x<T, kTpt>(p, t0, c0, slice, vec, xr);
    cp_async_wait_all();
    __syncthreads();
    mix_chunk<T, kTpt, kMaxM>(w_s, xr, slice, p.m, acc);
  }
  // the kSlices threads of a token are consecutive lanes of one warp
#pragma unroll
  for (int t = 0; t < kTpt; ++t) {
#pragma unroll
    for (int m = 0; m <= kMaxM; ++m) {
      if (m < p.m || m == kMaxM) {
        float v = acc[t][m];
#pragma unroll
        for (int s = kSlices / 2; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
        if (slice == 0 && t0 + t < p.tokens) {
          partial[(static_cast<int64_t>(blockIdx.y) * p.tokens + t0 + t) * (p.m + 1) + (m == kMaxM ? p.m : m)] = v;
        }
      }
    }
  }
}

// bf16 streams, M <= 24: the part's products on tensor cores (mma.sync m16n8k16, fp32 accumulators). The fp32
// weights are split into three bf16 terms, hi + mid + lo == w exactly for |w| in [2^-100, 3.39e38) (outside it the
// split loses bits below 2^-133, or overflows to NaN), and a bf16 x times a bf16 term is exact in
// fp32, so the part's dot products keep fp32 accuracy; only the order of the additions differs from the FMA path.
// A CTA owns one part: it stages the part's split weights once, then walks token tiles blockIdx.x,
// blockIdx.x + gridDim.x, ... (kMmaTokens tokens each: 16 a warp tile, kMmaTiles tiles a warp) with the next tile's
// x in flight (cp.async, two buffers) while the current one is multiplied. Rows are padded by 16 bytes (ldmatrix
// without bank conflicts). A token's arithmetic depends on K alone, never on the tile or the CTA: batch-invariant.
// The sum of squares comes from the same fragments on the CUDA cores.
constexpr int kMmaWarps = 4, kMmaTiles = 2, kMmaTokens = kMmaWarps * kMmaTiles * 16;
constexpr int kMmaPitch = kPartK + 8;  // bf16 elements per staged row

template <int kNT>
__host__ __device__ constexpr size_t mma_smem_bytes() {  // x [2][kMmaTokens][pitch], w [3][kNT * 8][pitch]
  return static_cast<size_t>(2 * kMmaTokens + 3 * kNT * 8) * kMmaPitch * 2;
}

// Issues the copies of one token tile's x rows of the part at column k0 (rows past the tokens and columns past K
// are zeros, stored directly).
__device__ __forceinline__ void mma_stage_x(const HcMixParams& p, int64_t t0, int64_t k0, bool vec,
                                            __nv_bfloat16* xs) {
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(p.x);
  constexpr int kSeg = kPartK / 8;  // 16-byte segments a row
  for (int i = threadIdx.x; i < kMmaTokens * kSeg; i += kMmaWarps * 32) {
    const int r = i / kSeg, c = (i % kSeg) * 8;
    const int64_t t = t0 + r, k = k0 + c;
    __nv_bfloat16* dst = xs + r * kMmaPitch + c;
    if (vec && t < p.tokens && k + 8 <= p.k) {
      cp_async_16(dst, x + t * p.x_row_stride + k);
    } else {
      const __nv_bfloat16* src = x + t * p.x_row_stride + k;
      __align__(16) __nv_bfloat16 v[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = t < p.tokens && k + e < p.k ? src[e] : __float2bfloat16_rn(0.f);
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(v);
    }
  }
}

// Stages the part's weight terms (zeros past M or K): every load of this thread first (all in flight together),
// then the splits and stores.
template <int kNT>
__device__ __forceinline__ void mma_stage_w(const HcMixParams& p, int64_t k0, bool vec, __nv_bfloat16* ws) {
  constexpr int kW = kNT * 8 * (kPartK / 4) / (kMmaWarps * 32);  // float4 groups per thread
  static_assert(kNT * 8 * (kPartK / 4) % (kMmaWarps * 32) == 0, "whole groups per thread");
  float v[kW][4];
#pragma unroll
  for (int w = 0; w < kW; ++w) {
    const int i = threadIdx.x + w * kMmaWarps * 32, m = i / (kPartK / 4), c = (i % (kPartK / 4)) * 4;
    const int64_t k = k0 + c;
    v[w][0] = v[w][1] = v[w][2] = v[w][3] = 0.f;
    if (m < p.m && k < p.k) {
      const float* src = p.fn + static_cast<int64_t>(m) * p.k + k;
      if (vec && k + 4 <= p.k) {
        const float4 f = __ldg(reinterpret_cast<const float4*>(src));
        v[w][0] = f.x, v[w][1] = f.y, v[w][2] = f.z, v[w][3] = f.w;
      } else {
        load4(src, p.k - k, v[w]);
      }
    }
  }
#pragma unroll
  for (int w = 0; w < kW; ++w) {
    const int i = threadIdx.x + w * kMmaWarps * 32, m = i / (kPartK / 4), c = (i % (kPartK / 4)) * 4;
    __align__(8) __nv_bfloat16 term[3][4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float r = v[w][e];
#pragma unroll
      for (int s = 0; s < 3; ++s) {  // hi, mid, lo: each the rounding of what the previous terms leave
        term[s][e] = __float2bfloat16_rn(r);
        r -= __bfloat162float(term[s][e]);
      }
    }
#pragma unroll
    for (int s = 0; s < 3; ++s) {
      *reinterpret_cast<uint2*>(ws + (s * kNT * 8 + m) * kMmaPitch + c) = *reinterpret_cast<const uint2*>(term[s]);
    }
  }
}

// One staged token tile times the part's weights: the partial dot products and sum of squares of its tokens.
template <int kNT>
__device__ __forceinline__ void mma_tile(const HcMixParams& p, const __nv_bfloat16* xs, const __nv_bfloat16* ws,
                                         int64_t t0, float* base) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float acc[kMmaTiles][kNT][4], ss[kMmaTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMmaTiles; ++mt) {
    ss[mt][0] = ss[mt][1] = 0.f;
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0.f;
  }
  const uint32_t x_base = smem_u32(xs + (warp * kMmaTiles * 16 + lane % 16) * kMmaPitch + (lane / 16) * 8);
  const uint32_t w_base = smem_u32(ws + (lane % 8) * kMmaPitch + ((lane / 8) % 2) * 8);
#pragma unroll 4
  for (int kk = 0; kk < kPartK; kk += 16) {
    uint32_t a[kMmaTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMmaTiles; ++mt) {
      ldsm_x4(a[mt][0], a[mt][1], a[mt][2], a[mt][3], x_base + (mt * 16 * kMmaPitch + kk) * 2);
      // a[0], a[2]: row lane / 4 of the tile; a[1], a[3]: row lane / 4 + 8
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float lo = __uint_as_float(a[mt][r] << 16), hi = __uint_as_float(a[mt][r] & 0xffff0000u);
        ss[mt][r & 1] += lo * lo;
        ss[mt][r & 1] += hi * hi;
      }
    }
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
#pragma unroll
      for (int s = 2; s >= 0; --s) {  // lo, mid, hi: the small terms first
        uint32_t b0, b1;
        ldsm_x2(b0, b1, w_base + ((s * kNT * 8 + j * 8) * kMmaPitch + kk) * 2);
#pragma unroll
        for (int mt = 0; mt < kMmaTiles; ++mt) {
          mma_16816(acc[mt][j], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
        }
      }
    }
  }
  const int g = lane / 4, c = lane % 4;
#pragma unroll
  for (int mt = 0; mt < kMmaTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // rows g and g + 8
      float v = ss[mt][h];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      const int64_t t = t0 + (warp * kMmaTiles + mt) * 16 + g + 8 * h;
      if (t >= p.tokens) continue;
      float* row = base + t * (p.m + 1);
      if (c == 0) row[p.m] = v;
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int m = j * 8 + 2 * c + e;
          if (m < p.m) row[m] = acc[mt][j][2 * h + e];
        }
      }
    }
  }
}

template <int kNT>
__global__ void __launch_bounds__(kMmaWarps * 32) hc_mix_mma_kernel(HcMixParams p, float* partial, bool vec) {
  extern __shared__ __align__(16) unsigned char mma_smem[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(mma_smem);  // two buffers of kMmaTokens rows
  __nv_bfloat16* ws = xs + 2 * kMmaTokens * kMmaPitch;
  const int64_t k0 = static_cast<int64_t>(blockIdx.y) * kPartK;
  const int64_t tiles = (p.tokens + kMmaTokens - 1) / kMmaTokens;
  float* base = partial + static_cast<int64_t>(blockIdx.y) * p.tokens * (p.m + 1);
  int64_t tile = blockIdx.x;
  mma_stage_x(p, tile * kMmaTokens, k0, vec, xs);
  cp_async_commit();
  mma_stage_w<kNT>(p, k0, vec, ws);
  for (int it = 0; tile < tiles; ++it, tile += gridDim.x) {
    const int64_t next = tile + gridDim.x;
    if (next < tiles) mma_stage_x(p, next * kMmaTokens, k0, vec, xs + ((it + 1) & 1) * kMmaTokens * kMmaPitch);
    cp_async_commit();  // (an empty group when there is no next tile)
    cp_async_wait_group<1>();  // this thread's copies of the current tile; the barrier makes every thread's visible
    __syncthreads();
    mma_tile<kNT>(p, xs + (it & 1) * kMmaTokens * kMmaPitch, ws, tile * kMmaTokens, base);
    __syncthreads();  // the current buffer is read before the tile after next is staged into it
  }
}

__global__ void __launch_bounds__(256) hc_mix_finish_kernel(HcMixParams p, const float* partial, int parts) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= p.tokens * p.m) return;
  const int64_t t = idx / p.m;
  const int m = static_cast<int>(idx % p.m);
  float dot = 0.f, ss = 0.f;
  for (int q = 0; q < parts; ++q) {
    const float* row = partial + (static_cast<int64_t>(q) * p.tokens + t) * (p.m + 1);
    dot += row[m];
    ss += row[p.m];
  }
  p.out[idx] = dot * rsqrtf(ss / static_cast<float>(p.k) + p.eps);
}

template <typename T, int kTpt, int kMaxM>
void launch_mix_typed(const HcMixParams& p, float* partial, int parts, bool vec, cudaStream_t stream) {
  constexpr int kThreads = mix_threads<kTpt>();
  const int64_t tile = static_cast<int64_t>(kThreads / kSlices) * kTpt;
  const dim3 grid(static_cast<unsigned>((p.tokens + tile - 1) / tile), static_cast<unsigned>(parts));
  hc_mix_partial_kernel<T, kTpt, kMaxM><<<grid, kThreads, 0, stream>>>(p, partial, vec);
}

template <typename T, int kTpt>
void launch_mix_m(const HcMixParams& p, float* partial, int parts, bool vec, cudaStream_t stream) {
  if (p.m <= 4) {
    launch_mix_typed<T, kTpt, 4>(p, partial, parts, vec, stream);
  } else if (p.m <= 8) {
    launch_mix_typed<T, kTpt, 8>(p, partial, parts, vec, stream);
  } else if (p.m <= 16) {
    launch_mix_typed<T, kTpt, 16>(p, partial, parts, vec, stream);
  } else if (p.m <= 24) {
    launch_mix_typed<T, kTpt, 24>(p, partial, parts, vec, stream);
  } else {
    launch_mix_typed<T, kTpt, 32>(p, partial, parts, vec, stream);
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

// hc_stream_kernel for 4 streams (V4's hc_mult), the same arithmetic: the coefficients as float4 loads and two
// vectors per thread, so a thread's coefficient reads are amortised over 2V elements.
template <typename T, bool kPost>
__global__ void __launch_bounds__(256) hc_stream4_kernel(HcStreamParams p) {
  constexpr int V = 16 / sizeof(T), kRep = 2, kHc = 4;
  const int64_t per_row = p.hidden / (V * kRep);
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= p.tokens * per_row) return;
  const int64_t t = idx / per_row, d0 = (idx % per_row) * V * kRep;
  const T* s = static_cast<const T*>(p.streams) + t * kHc * p.hidden + d0;
  float in[kHc][kRep][V];
#pragma unroll
  for (int i = 0; i < kHc; ++i) {
#pragma unroll
    for (int r = 0; r < kRep; ++r) {
      const Vec<T, V> q = *reinterpret_cast<const Vec<T, V>*>(s + i * p.hidden + r * V);
#pragma unroll
      for (int e = 0; e < V; ++e) in[i][r][e] = to_float(q.v[e]);
    }
  }
  const float4 pre = *reinterpret_cast<const float4*>(p.pre + t * kHc);
  const float pv[kHc] = {pre.x, pre.y, pre.z, pre.w};
  if constexpr (!kPost) {
#pragma unroll
    for (int r = 0; r < kRep; ++r) {
      Vec<T, V> o;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        float acc = pv[0] * in[0][r][e];
#pragma unroll
        for (int i = 1; i < kHc; ++i) acc += pv[i] * in[i][r][e];
        o.v[e] = from_float<T>(acc);
      }
      *reinterpret_cast<Vec<T, V>*>(static_cast<T*>(p.out) + t * p.hidden + d0 + r * V) = o;
    }
  } else {
    float cb[kHc][kHc];
#pragma unroll
    for (int i = 0; i < kHc; ++i) {
      const float4 c = *reinterpret_cast<const float4*>(p.comb + t * kHc * kHc + i * kHc);
      cb[i][0] = c.x, cb[i][1] = c.y, cb[i][2] = c.z, cb[i][3] = c.w;
    }
    const T* xr = static_cast<const T*>(p.x) + t * p.hidden + d0;
    T* out = static_cast<T*>(p.out) + t * kHc * p.hidden + d0;
#pragma unroll
    for (int r = 0; r < kRep; ++r) {
      const Vec<T, V> xq = *reinterpret_cast<const Vec<T, V>*>(xr + r * V);
#pragma unroll
      for (int j = 0; j < kHc; ++j) {
        Vec<T, V> o;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          float acc = pv[j] * to_float(xq.v[e]);
#pragma unroll
          for (int i = 0; i < kHc; ++i) acc += cb[i][j] * in[i][r][e];
          o.v[e] = from_float<T>(acc);
        }
        *reinterpret_cast<Vec<T, V>*>(out + j * p.hidden + r * V) = o;
      }
    }
  }
}

template <typename T, bool kPost>
void launch_stream_typed(const HcStreamParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = p.hidden % kVec == 0 && is_aligned(p.streams, 16) && is_aligned(p.out, 16) &&
                   (!kPost || is_aligned(p.x, 16));
  if (vec && p.hc == 4 && p.hidden % (2 * kVec) == 0 && is_aligned(p.pre, 16) && (!kPost || is_aligned(p.comb, 16))) {
    const int64_t n4 = p.tokens * (p.hidden / (2 * kVec));
    hc_stream4_kernel<T, kPost><<<static_cast<unsigned>((n4 + 255) / 256), 256, 0, stream>>>(p);
    DEEPINFER_CHECK_LAUNCH(kPost ? "hc_post_kernel" : "hc_collapse_kernel");
    return;
  }
  const int64_t n = p.tokens * (vec ? p.hidden / kVec : p.hidden);
  const dim3 grid(static_cast<unsigned>((n + 255) / 256));
  if (vec) {
    hc_stream_kernel<T, kVec, kPost><<<grid, 256, 0, stream>>>(p);
  } else {
    hc_stream_kernel<T, 1, kPost><<<grid, 256, 0, stream>>>(p);
  }
  DEEPINFER_CHECK_LAUNCH(kPost ? "hc_post_kernel" : "hc_collapse_kernel");
}

// One thread per token: the shared per-token math (common/mhc_math.h), as on the CPU. HC: the stream count at
// compile time (0: at run time), so that the hc x hc matrix stays in registers.
template <int HC>
__global__ void __launch_bounds__(128) hc_weights_kernel(HcWeightsParams p) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= p.tokens) return;
  const int m = 2 * p.hc + p.hc * p.hc;
  mhc_math::hc_weights_token_n<HC>(p.mix + t * m, p.base, p.scale, p.hc, p.eps, p.sinkhorn_iters,
                                   p.pre + t * p.hc, p.post + t * p.hc, p.comb + t * p.hc * p.hc);
}

// hc_weights with HC * HC lanes per token (HC * HC divides 32): lane (i, j) holds comb[i][j]. Row and column sums
// gather the HC values of a row or column to every lane by shuffles and add them in index order, so the result
// equals hc_weights_token_n's bit for bit; the Sinkhorn passes run in parallel over the matrix instead of serially.
template <int HC>
__global__ void __launch_bounds__(128) hc_weights_lanes_kernel(HcWeightsParams p) {
  constexpr int kLanes = HC * HC;
  static_assert(32 % kLanes == 0, "a token's lanes stay in one warp");
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t t_raw = gid / kLanes;
  const bool live = t_raw < p.tokens;
  const int64_t t = live ? t_raw : p.tokens - 1;  // dead lanes still take part in the shuffles
  const int e = static_cast<int>(gid % kLanes), i = e / HC, j = e % HC;
  const int lane0 = static_cast<int>(threadIdx.x % 32) - e;  // the token's first lane in the warp
  const float* mix = p.mix + t * (2 * HC + kLanes);
  const float eps = p.eps;
  if (live && e < HC) {
    p.pre[t * HC + e] = mhc_math::sigmoid(mix[e] * p.scale[0] + p.base[e]) + eps;
    p.post[t * HC + e] = 2.0f * mhc_math::sigmoid(mix[HC + e] * p.scale[1] + p.base[HC + e]);
  }
  float c = mix[2 * HC + e] * p.scale[2] + p.base[2 * HC + e];
  float v[HC];
  auto gather_row = [&](float x) {
#pragma unroll
    for (int k = 0; k < HC; ++k) v[k] = __shfl_sync(0xffffffffu, x, lane0 + i * HC + k);
  };
  auto gather_col = [&](float x) {
#pragma unroll
    for (int k = 0; k < HC; ++k) v[k] = __shfl_sync(0xffffffffu, x, lane0 + k * HC + j);
  };
  auto sum_v = [&] {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < HC; ++k) s += v[k];
    return s;
  };
  gather_row(c);
  float mx = -INFINITY;
#pragma unroll
  for (int k = 0; k < HC; ++k) mx = v[k] > mx ? v[k] : mx;
  c = expf(c - mx);
  gather_row(c);
  c = c / sum_v() + eps;
  const int iters = p.sinkhorn_iters > 1 ? p.sinkhorn_iters : 1;
  for (int it = 0; it < iters; ++it) {
    if (it > 0) {
      gather_row(c);
      c = c / (sum_v() + eps);
    }
    gather_col(c);
    c = c / (sum_v() + eps);
  }
  if (live) p.comb[t * kLanes + e] = c;
}

}  // namespace

void launch_hc_weights(const HcWeightsParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return;
  const dim3 grid(static_cast<unsigned>((p.tokens + 127) / 128));
  switch (p.hc) {
    case 1: hc_weights_kernel<1><<<grid, 128, 0, stream>>>(p); break;
    case 2: hc_weights_lanes_kernel<2><<<static_cast<unsigned>((p.tokens * 4 + 127) / 128), 128, 0, stream>>>(p);
      break;
    case 3: hc_weights_kernel<3><<<grid, 128, 0, stream>>>(p); break;
    case 4: hc_weights_lanes_kernel<4><<<static_cast<unsigned>((p.tokens * 16 + 127) / 128), 128, 0, stream>>>(p);
      break;
    default: hc_weights_kernel<0><<<grid, 128, 0, stream>>>(p); break;
  }
  DEEPINFER_CHECK_LAUNCH("hc_weights_kernel");
}

namespace {

// DEEPINFER_HC_MIX_MMA=0 keeps the FMA kernel for bf16 too (read per call, so that bench_mhc can time both on one
// card).
bool hc_mix_mma(const HcMixParams& p) {
  const char* v = std::getenv("DEEPINFER_HC_MIX_MMA");
  if (v != nullptr && v[0] != '\0' && std::strcmp(v, "1") != 0) {
    if (std::strcmp(v, "0") == 0) return false;
    throw std::runtime_error(std::string("deepinfer hc_mix: DEEPINFER_HC_MIX_MMA must be 0 or 1, got '") + v + "'");
  }
  return p.dtype == DType::kBFloat16 && p.m <= 24;
}

// One CTA per SM (the shared memory allows one): the grid's columns per part fill the SMs, at most one per tile.
template <int kNT>
void launch_mma(const HcMixParams& p, float* partial, int parts, bool vec, cudaStream_t stream) {
  constexpr size_t smem = mma_smem_bytes<kNT>();
  ensure_dynamic_smem(hc_mix_mma_kernel<kNT>, smem);
  const int64_t tiles = (p.tokens + kMmaTokens - 1) / kMmaTokens;
  const int64_t cols = std::max<int64_t>(1, std::min<int64_t>(tiles, num_sms() / parts));
  const dim3 grid(static_cast<unsigned>(cols), static_cast<unsigned>(parts));
  hc_mix_mma_kernel<kNT><<<grid, kMmaWarps * 32, smem, stream>>>(p, partial, vec);
}

}  // namespace

int64_t hc_mix_workspace_floats(const HcMixParams& p) {
  return (p.k + kPartK - 1) / kPartK * p.tokens * (p.m + 1);
}

void launch_hc_mix(const HcMixParams& p, float* workspace, cudaStream_t stream) {
  if (p.tokens == 0) return;
  const int parts = static_cast<int>((p.k + kPartK - 1) / kPartK);
  const auto vec_ok = [&](size_t elem) {
    return p.k % 4 == 0 && p.x_row_stride % 4 == 0 && is_aligned(p.x, static_cast<int>(4 * elem)) &&
           is_aligned(p.fn, 16);
  };
  if (hc_mix_mma(p)) {
    const bool vec = p.k % 8 == 0 && p.x_row_stride % 8 == 0 && is_aligned(p.x, 16) && is_aligned(p.fn, 16);
    if (p.m <= 8) {
      launch_mma<1>(p, workspace, parts, vec, stream);
    } else if (p.m <= 16) {
      launch_mma<2>(p, workspace, parts, vec, stream);
    } else {
      launch_mma<3>(p, workspace, parts, vec, stream);
    }
    DEEPINFER_CHECK_LAUNCH("hc_mix_mma_kernel");
  } else {
    DEEPINFER_DISPATCH_FLOAT(p.dtype, [&] {
      const bool vec = vec_ok(sizeof(scalar_t));
      if (p.tokens >= 1024) {  // 2 tokens per thread share the weight reads once tokens fill the GPU
        launch_mix_m<scalar_t, 2>(p, workspace, parts, vec, stream);
      } else {
        launch_mix_m<scalar_t, 1>(p, workspace, parts, vec, stream);
      }
    });
    DEEPINFER_CHECK_LAUNCH("hc_mix_partial_kernel");
  }
  const int64_t n = p.tokens * p.m;
  hc_mix_finish_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(p, workspace, parts);
  DEEPINFER_CHECK_LAUNCH("hc_mix_finish_kernel");
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
