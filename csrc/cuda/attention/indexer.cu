// Lightning-indexer kernels: mqa_logits (tensor cores, fp32 accumulation) and kv_cache_write (one warp per token,
// 16-byte copies when aligned). topk_rows lives in topk.cu.
#include <cuda_fp8.h>
#include <math_constants.h>

#include "deepinfer/attention/sparse_mqa.cuh"
#include "deepinfer/ptx.cuh"

namespace deepinfer::attention {
namespace {

// ---- mqa_logits: tensor cores. One CTA of 4 warps per (token, 64 candidates) (a CTA loops over candidate blocks
// when there are more than the grid's y extent holds): the candidates' K rows (cp.async) and the token's Q (heads
// padded to 8, zero rows) sit in shared memory; warp w computes S = K Q^T for candidates [16 w, +16) x all heads with
// mma.sync m16n8k16 (bf16 in, fp32 accumulate), then sum_h w_h relu(S) per candidate (each lane 2 heads per n-tile,
// a 4-lane shuffle sum). A candidate's logit depends only on its own row and the token: batch-invariant. Heads are
// not summed in index order (fp32 rounding differs from a sequential sum in the last bits; the reference is fp32).
// FP8 keys (kFp8): each key is decoded to bf16 on its way into shared memory (e4m3 x its power-of-two scale: exact),
// so the logits equal those over the decoded bf16 cache bit for bit.
constexpr int kLogitsThreads = 128;
constexpr int kLogitsCands = 64;
constexpr int kLogitsMaxNT = 16;  // 128 heads
constexpr int64_t kMaxGridY = 65535;

template <int kDim>
struct LogitsSmem {
  static constexpr int kStride = kDim + 8;  // bf16 per row (+16 B: conflict-free ldmatrix)
  static constexpr size_t k_off = 0;
  static constexpr size_t q_off = k_off + size_t(kLogitsCands) * kStride * 2;
  static constexpr size_t w_off = q_off + size_t(kLogitsMaxNT) * 8 * kStride * 2;
  static constexpr size_t scale_off = w_off + kLogitsMaxNT * 8 * 4;
  static constexpr size_t ptr_off = scale_off + kLogitsCands * 4;
  static constexpr size_t bytes = ptr_off + kLogitsCands * sizeof(void*);
};

// Eight e4m3 codes times a power-of-two scale -> eight bf16 (exact), as one 16-byte word.
__device__ __forceinline__ uint4 decode_e4m3x8(uint2 raw, float scale) {
  uint4 out;
  uint32_t* o = reinterpret_cast<uint32_t*>(&out);
  const uint32_t w[2] = {raw.x, raw.y};
#pragma unroll
  for (int h = 0; h < 4; ++h) {
    const __half2_raw hr =
        __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w[h / 2] >> (16 * (h % 2))), __NV_E4M3);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&hr));
    const __nv_bfloat162 b = __halves2bfloat162(__float2bfloat16_rn(f.x * scale), __float2bfloat16_rn(f.y * scale));
    o[h] = *reinterpret_cast<const uint32_t*>(&b);
  }
  return out;
}

template <int kDim, bool kFp8>
__global__ void __launch_bounds__(kLogitsThreads) mqa_logits_kernel(const __grid_constant__ MqaLogitsParams p) {
  static_assert(kLogitsCands * (kDim / 8) % kLogitsThreads == 0, "FP8 key loads: whole rounds per thread");
  using L = LogitsSmem<kDim>;
  constexpr int kStride = L::kStride, kVec = kDim / 8;
  extern __shared__ __align__(16) char smem[];
  __nv_bfloat16* sK = reinterpret_cast<__nv_bfloat16*>(smem + L::k_off);
  __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem + L::q_off);
  float* sW = reinterpret_cast<float*>(smem + L::w_off);
  float* sScale = reinterpret_cast<float*>(smem + L::scale_off);  // FP8 keys: the candidate's scale
  const char** sRow = reinterpret_cast<const char**>(smem + L::ptr_off);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int H = p.num_heads, num_nt = (H + 7) / 8;
  const int64_t i = blockIdx.x;
  const bool q_vec = (reinterpret_cast<uintptr_t>(p.q) & 15u) == 0u;
  for (int v = tid; v < num_nt * 8 * kVec; v += kLogitsThreads) {
    const int h = v / kVec, col = (v % kVec) * 8;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (h < H) {
      const __nv_bfloat16* src = p.q + (i * H + h) * kDim + col;
      if (q_vec) {
        val = *reinterpret_cast<const uint4*>(src);
      } else {
        __nv_bfloat16* e = reinterpret_cast<__nv_bfloat16*>(&val);
#pragma unroll
        for (int j = 0; j < 8; ++j) e[j] = src[j];
      }
    }
    *reinterpret_cast<uint4*>(sQ + h * kStride + col) = val;
  }
  for (int h = tid; h < num_nt * 8; h += kLogitsThreads) sW[h] = h < H ? p.weights[i * H + h] : 0.f;
  const int64_t num_cb = (p.num_candidates + kLogitsCands - 1) / kLogitsCands;
  for (int64_t cb = blockIdx.y; cb < num_cb; cb += gridDim.y) {
    const int64_t c0 = cb * kLogitsCands;
    // Candidate rows -> K row pointers (nullptr: outside [k_start, k_end), past n, or an invalid block).
    if (tid < kLogitsCands) {
      const int64_t c = c0 + tid;
      const int64_t lo = p.k_start != nullptr ? p.k_start[i] : 0;
      const int64_t hi = p.k_end != nullptr ? p.k_end[i] : p.num_candidates;
      const char* ptr = nullptr;
      if (c < p.num_candidates && c >= lo && c < hi) {
        int64_t block = c / p.block_size;
        if (p.paged) block = block < p.max_blocks ? p.block_table[i * p.max_blocks + block] : -1;
        if (block >= 0 && block < p.num_blocks) {
          const int64_t j = c % p.block_size;
          if constexpr (kFp8) {
            const char* blk = static_cast<const char*>(p.k_cache) + block * p.block_stride;
            ptr = blk + j * kDim;
            sScale[tid] = *reinterpret_cast<const float*>(blk + int64_t(p.block_size) * kDim + 4 * j);
          } else {
            ptr = reinterpret_cast<const char*>(static_cast<const __nv_bfloat16*>(p.k_cache) + block * p.block_stride +
                                                j * p.token_stride);
          }
        }
      }
      sRow[tid] = ptr;
    }
    __syncthreads();  // sRow (and, the first time, sQ / sW) written
    if constexpr (kFp8) {
      // Every load of the block first (all in flight at once), then the decodes: 8 codes per 8-byte load.
      constexpr int kPer = kLogitsCands * kVec / kLogitsThreads;  // 3, 4 or 8
      uint2 raw[kPer];
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int v = tid + j * kLogitsThreads, r = v / kVec, col = (v % kVec) * 8;
        const char* src = sRow[r];
        raw[j] = src != nullptr ? __ldg(reinterpret_cast<const uint2*>(src + col)) : make_uint2(0u, 0u);
      }
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int v = tid + j * kLogitsThreads, r = v / kVec, col = (v % kVec) * 8;
        *reinterpret_cast<uint4*>(sK + r * kStride + col) =
            sRow[r] != nullptr ? decode_e4m3x8(raw[j], sScale[r]) : make_uint4(0u, 0u, 0u, 0u);
      }
    } else {
      for (int v = tid; v < kLogitsCands * kVec; v += kLogitsThreads) {
        const int r = v / kVec, col = (v % kVec) * 8;
        const char* src = sRow[r];
        if (src != nullptr) {
          cp_async_16(sK + r * kStride + col, reinterpret_cast<const __nv_bfloat16*>(src) + col);
        } else {
          *reinterpret_cast<uint4*>(sK + r * kStride + col) = make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();

    float acc[kLogitsMaxNT][4];
#pragma unroll
    for (int nt = 0; nt < kLogitsMaxNT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    const uint32_t ka = smem_u32(sK + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride + (lane >> 4) * 8);
    const uint32_t qb = smem_u32(sQ + (lane & 7) * kStride + ((lane >> 3) & 1) * 8);
#pragma unroll
    for (int kk = 0; kk < kDim; kk += 16) {
      uint32_t a0, a1, a2, a3;
      ldsm_x4(a0, a1, a2, a3, ka + kk * 2);
#pragma unroll
      for (int nt = 0; nt < kLogitsMaxNT; ++nt) {
        if (nt < num_nt) {
          uint32_t b0, b1;
          ldsm_x2(b0, b1, qb + (nt * 8 * kStride + kk) * 2);
          mma_16816(acc[nt], a0, a1, a2, a3, b0, b1);
        }
      }
    }
    // acc[nt]: rows (candidates) g / g + 8 of this warp's 16, columns (heads) nt * 8 + 2 t4, + 1.
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int nt = 0; nt < kLogitsMaxNT; ++nt) {
      if (nt < num_nt) {
        const float w0 = sW[nt * 8 + 2 * t4], w1 = sW[nt * 8 + 2 * t4 + 1];
        sum0 = fmaf(w0, fmaxf(acc[nt][0], 0.f), sum0);
        sum0 = fmaf(w1, fmaxf(acc[nt][1], 0.f), sum0);
        sum1 = fmaf(w0, fmaxf(acc[nt][2], 0.f), sum1);
        sum1 = fmaf(w1, fmaxf(acc[nt][3], 0.f), sum1);
      }
    }
    sum0 += __shfl_xor_sync(0xffffffffu, sum0, 1);
    sum0 += __shfl_xor_sync(0xffffffffu, sum0, 2);
    sum1 += __shfl_xor_sync(0xffffffffu, sum1, 1);
    sum1 += __shfl_xor_sync(0xffffffffu, sum1, 2);
    if (t4 == 0) {
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int r = warp * 16 + g + rr * 8;
        const int64_t c = c0 + r;
        if (c < p.num_candidates) {
          p.logits[i * p.num_candidates + c] = sRow[r] != nullptr ? (rr ? sum1 : sum0) : -CUDART_INF_F;
        }
      }
    }
    __syncthreads();  // sRow / sK read before the next candidate block overwrites them
  }
}

template <int kDim, bool kFp8>
void launch_logits_kernel(const MqaLogitsParams& p, cudaStream_t stream) {
  constexpr size_t smem = LogitsSmem<kDim>::bytes;
  ensure_dynamic_smem(mqa_logits_kernel<kDim, kFp8>, smem);
  const int64_t num_cb = (p.num_candidates + kLogitsCands - 1) / kLogitsCands;
  const dim3 grid(static_cast<unsigned>(p.t), static_cast<unsigned>(num_cb < kMaxGridY ? num_cb : kMaxGridY));
  mqa_logits_kernel<kDim, kFp8><<<grid, kLogitsThreads, smem, stream>>>(p);
  DEEPINFER_CHECK_LAUNCH("mqa_logits_kernel");
}

template <int kDim>
void launch_logits_dim(const MqaLogitsParams& p, cudaStream_t stream) {
  if (p.k_fp8) {
    launch_logits_kernel<kDim, true>(p, stream);
  } else {
    launch_logits_kernel<kDim, false>(p, stream);
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
  if (p.num_heads < 1 || p.num_heads > kLogitsMaxNT * 8) {
    throw std::runtime_error("deepinfer mqa_logits: num_heads must be in [1, 128], got " +
                             std::to_string(p.num_heads));
  }
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
