// Lightning-indexer kernels: mqa_logits (CUDA cores, fp32), topk_rows (radix select + ordered tie compaction + rank
// sort, one CTA per row) and kv_cache_write (one warp per token, 16-byte copies when aligned).
#include <math_constants.h>

#include "deepinfer/attention/sparse_mqa.cuh"

namespace deepinfer::attention {
namespace {

// ---- mqa_logits: one thread per candidate, one CTA per (token, 128 candidates); the token's q and weights sit in
// shared memory as fp32 (every thread reads the same address: broadcast). Heads are summed in index order.
constexpr int kLogitsThreads = 128;

template <int kDim>
__global__ void __launch_bounds__(kLogitsThreads) mqa_logits_kernel(const __grid_constant__ MqaLogitsParams p) {
  extern __shared__ __align__(16) float sq[];  // [H][kDim] then w[H]
  const int H = p.num_heads;
  float* sw = sq + H * kDim;
  const int64_t i = blockIdx.x;
  for (int e = threadIdx.x; e < H * kDim; e += kLogitsThreads) sq[e] = __bfloat162float(p.q[i * H * kDim + e]);
  for (int e = threadIdx.x; e < H; e += kLogitsThreads) sw[e] = p.weights[i * H + e];
  __syncthreads();
  const int64_t c = static_cast<int64_t>(blockIdx.y) * kLogitsThreads + threadIdx.x;
  if (c >= p.num_candidates) return;
  const int64_t lo = p.k_start != nullptr ? p.k_start[i] : 0;
  const int64_t hi = p.k_end != nullptr ? p.k_end[i] : p.num_candidates;
  int64_t block = c / p.block_size;
  if (p.block_table != nullptr) block = block < p.max_blocks ? p.block_table[i * p.max_blocks + block] : -1;
  float* out = p.logits + i * p.num_candidates + c;
  if (c < lo || c >= hi || block < 0 || block >= p.num_blocks) {
    *out = -CUDART_INF_F;
    return;
  }
  const __nv_bfloat16* k = p.k_cache + block * p.block_stride + (c % p.block_size) * p.token_stride;
  float kf[kDim];
#pragma unroll
  for (int e = 0; e < kDim; e += 8) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(k + e));
    const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(v2[j]);
      kf[e + 2 * j] = f.x;
      kf[e + 2 * j + 1] = f.y;
    }
  }
  float acc = 0.f;
  for (int h = 0; h < H; ++h) {
    const float4* qh = reinterpret_cast<const float4*>(sq + h * kDim);
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < kDim / 4; ++e) {
      const float4 qv = qh[e];
      s = fmaf(qv.x, kf[4 * e], s);
      s = fmaf(qv.y, kf[4 * e + 1], s);
      s = fmaf(qv.z, kf[4 * e + 2], s);
      s = fmaf(qv.w, kf[4 * e + 3], s);
    }
    acc = fmaf(sw[h], fmaxf(s, 0.f), acc);
  }
  *out = acc;
}

template <int kDim>
void launch_logits_dim(const MqaLogitsParams& p, cudaStream_t stream) {
  const size_t smem = (static_cast<size_t>(p.num_heads) * kDim + p.num_heads) * sizeof(float);
  DEEPINFER_CUDA_CHECK(cudaFuncSetAttribute(mqa_logits_kernel<kDim>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>(p.t),
                  static_cast<unsigned>((p.num_candidates + kLogitsThreads - 1) / kLogitsThreads));
  mqa_logits_kernel<kDim><<<grid, kLogitsThreads, smem, stream>>>(p);
  DEEPINFER_CHECK_LAUNCH("mqa_logits_kernel");
}

// ---- topk_rows: the project's tie rule (higher score first, then lower index).
constexpr int kTopkThreads = 1024;

// Order-preserving map of a float to uint32 (larger float -> larger key); NaN is the largest, -0.0 == +0.0.
__device__ __forceinline__ uint32_t topk_key(float x) {
  if (isnan(x)) return 0xffffffffu;
  if (x == 0.f) x = 0.f;
  const uint32_t b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__global__ void __launch_bounds__(kTopkThreads) topk_rows_kernel(const __grid_constant__ TopkParams p) {
  __shared__ int hist[256];
  __shared__ int warp_count[kTopkThreads / 32];
  __shared__ uint32_t s_prefix;
  __shared__ int s_remaining, s_count_gt, s_base;
  extern __shared__ __align__(16) char dyn[];
  uint32_t* sel_key = reinterpret_cast<uint32_t*>(dyn);   // [k]
  int* sel_idx = reinterpret_cast<int*>(dyn) + p.k;       // [k]
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t row = blockIdx.x;
  const float* s = p.scores + row * p.score_row_stride;
  const int n = p.n, k = p.k;

  // 1. Radix select (8 bits per pass, most significant first): the key of the k-th largest element, and how many
  //    elements equal to it belong to the top k.
  if (tid == 0) {
    s_prefix = 0u;
    s_remaining = k;
  }
  uint32_t mask = 0u;
  for (int shift = 24; shift >= 0; shift -= 8) {
    if (tid < 256) hist[tid] = 0;
    __syncthreads();
    const uint32_t prefix = s_prefix;
    for (int i = tid; i < n; i += kTopkThreads) {
      const uint32_t u = topk_key(s[i]);
      if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 0xffu], 1);
    }
    __syncthreads();
    if (tid == 0) {
      const int rem = s_remaining;
      int cum = 0, d = 255;
      for (; d > 0; --d) {
        if (cum + hist[d] >= rem) break;
        cum += hist[d];
      }
      s_remaining = rem - cum;
      s_prefix = prefix | (static_cast<uint32_t>(d) << shift);
    }
    __syncthreads();
    mask |= 0xffu << shift;
  }
  const uint32_t thr = s_prefix;
  const int need_eq = s_remaining;  // >= 1
  if (tid == 0) {
    s_count_gt = 0;
    s_base = 0;
  }
  __syncthreads();

  // 2. Collect: every element above the threshold (slots [0, k - need_eq), any order), and the need_eq lowest-index
  //    elements equal to it (slots [k - need_eq, k), by a block-wide ordered scan).
  for (int start = 0; start < n; start += kTopkThreads) {
    const int i = start + tid;
    const uint32_t u = i < n ? topk_key(s[i]) : 0u;
    const bool gt = i < n && u > thr, eq = i < n && u == thr;
    if (gt) {
      const int pos = atomicAdd(&s_count_gt, 1);
      sel_key[pos] = u;
      sel_idx[pos] = i;
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, eq);
    if (lane == 0) warp_count[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < kTopkThreads / 32; ++w) {
      const int cnt = warp_count[w];
      before += w < warp ? cnt : 0;
      total += cnt;
    }
    const int base = s_base;
    if (eq) {
      const int r = base + before + __popc(ballot & ((1u << lane) - 1u));
      if (r < need_eq) {
        sel_key[k - need_eq + r] = u;
        sel_idx[k - need_eq + r] = i;
      }
    }
    __syncthreads();
    if (tid == 0) s_base = base + total;
    __syncthreads();
  }

  // 3. Sort the k selected by (key desc, index asc): each element's rank is the number of elements before it.
  for (int a = tid; a < k; a += kTopkThreads) {
    const uint32_t ua = sel_key[a];
    const int ia = sel_idx[a];
    int rank = 0;
    for (int b = 0; b < k; ++b) {
      const uint32_t ub = sel_key[b];
      rank += (ub > ua) || (ub == ua && sel_idx[b] < ia);
    }
    p.values[row * k + rank] = s[ia];
    p.indices[row * k + rank] = ia;
  }
}

// ---- kv_cache_write
constexpr int kWriteWarps = 4;

template <bool kVec16>
__global__ void __launch_bounds__(kWriteWarps * 32)
    kv_cache_write_kernel(const __grid_constant__ KvCacheWriteParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWriteWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (i >= p.t) return;
  const int64_t s = p.slot_mapping[i];
  if (s < 0 || s >= p.num_slots) return;
  char* dst = p.cache + (s / p.block_size) * p.block_stride_bytes + (s % p.block_size) * p.token_stride_bytes;
  const char* src = p.src + i * p.src_row_stride_bytes;
  if (kVec16) {
    for (int64_t off = lane * 16; off < p.row_bytes; off += 32 * 16) {
      *reinterpret_cast<uint4*>(dst + off) = *reinterpret_cast<const uint4*>(src + off);
    }
  } else {
    for (int64_t off = lane; off < p.row_bytes; off += 32) dst[off] = src[off];
  }
}

}  // namespace

void launch_mqa_logits(const MqaLogitsParams& p, cudaStream_t stream) {
  if (p.t == 0 || p.num_candidates == 0) return;
  if (p.head_dim == 128) {
    launch_logits_dim<128>(p, stream);
  } else if (p.head_dim == 64) {
    launch_logits_dim<64>(p, stream);
  } else if (p.head_dim == 48) {  // the tiny test preset's index_head_dim
    launch_logits_dim<48>(p, stream);
  } else {
    throw std::runtime_error("deepinfer mqa_logits: unsupported head_dim " + std::to_string(p.head_dim));
  }
}

void launch_topk_rows(const TopkParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.k == 0) return;
  const size_t smem = static_cast<size_t>(p.k) * 8;
  topk_rows_kernel<<<static_cast<unsigned>(p.rows), kTopkThreads, smem, stream>>>(p);
  DEEPINFER_CHECK_LAUNCH("topk_rows_kernel");
}

void launch_kv_cache_write(const KvCacheWriteParams& p, cudaStream_t stream) {
  if (p.t == 0 || p.num_slots == 0) return;
  const bool vec16 = p.row_bytes % 16 == 0 && p.block_stride_bytes % 16 == 0 && p.token_stride_bytes % 16 == 0 &&
                     p.src_row_stride_bytes % 16 == 0 && is_aligned(p.cache, 16) && is_aligned(p.src, 16);
  const dim3 grid(static_cast<unsigned>((p.t + kWriteWarps - 1) / kWriteWarps));
  if (vec16) {
    kv_cache_write_kernel<true><<<grid, kWriteWarps * 32, 0, stream>>>(p);
  } else {
    kv_cache_write_kernel<false><<<grid, kWriteWarps * 32, 0, stream>>>(p);
  }
  DEEPINFER_CHECK_LAUNCH("kv_cache_write_kernel");
}

}  // namespace deepinfer::attention
