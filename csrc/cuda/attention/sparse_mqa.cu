// Sparse MQA kernel (decode and prefill). One CTA of 8 warps per (query row, tile of heads_per_cta = 16, 32 or 64
// heads):
//   the Q tile stays in shared memory; the row's KV entries are gathered by index, 64 at a time, into shared memory
//   (cp.async for bf16 rows; FP8 MODEL1 entries decoded to bf16 -- in registers, or, with 16 heads per CTA and
//   head_dim 512, staged raw by cp.async in the unused Q rows and decoded in shared memory; invalid entries are zero
//   rows with score -inf); S = Q K^T and O += P V run on tensor cores (mma.sync m16n8k16 bf16 -> fp32, ldmatrix
//   fragments) with an online softmax in fp32; the sink logit joins the denominator at the end.
// Warps split by the heads the CTA computes: heads_per_cta / 16 warps along heads, the rest along keys (QK^T) and
// dims (PV). The gather of tile i + 1 (two K buffers; its indices fetched one tile ahead) overlaps the math of
// tile i. Few query rows: fewer heads per CTA (more CTAs, each gathering the same rows) -- a head's result does not
// depend on which heads share its CTA (mma rows are independent, the softmax always reduces 4 threads x 16 entries
// per head row), so this choice keeps results batch-invariant. No split-KV: the work of a row never depends on the
// batch, so results are batch-invariant by construction.
#include <cuda_fp8.h>
#include <math_constants.h>

#include "deepinfer/attention/sparse_mqa.cuh"
#include "deepinfer/ptx.cuh"

namespace deepinfer::attention {
namespace {

constexpr int kBlockH = 64;   // most heads per CTA (shared memory is sized for it)
constexpr int kBlockN = 64;   // KV entries per tile
constexpr int kThreads = 256;

template <int kDim>
struct SmemLayout {
  static constexpr int kStride = kDim + 8;        // bf16 elements per Q/K row (+16 B: conflict-free fragments)
  static constexpr int kSStride = kBlockN + 1;    // fp32 scores
  static constexpr int kPStride = kBlockN + 8;    // bf16 probabilities
  static constexpr size_t q_off = 0;
  static constexpr size_t k_off = q_off + size_t(kBlockH) * kStride * 2;
  static constexpr size_t k_buf = size_t(kBlockN) * kStride * 2;  // bytes of one K buffer (two: double-buffered)
  static constexpr size_t s_off = k_off + 2 * k_buf;
  static constexpr size_t p_off = s_off + size_t(kBlockH) * kSStride * 4;
  static constexpr size_t m_off = p_off + size_t(kBlockH) * kPStride * 2;
  static constexpr size_t l_off = m_off + kBlockH * 4;
  static constexpr size_t a_off = l_off + kBlockH * 4;
  static constexpr size_t ptr_off = a_off + kBlockH * 4;
  static constexpr size_t fp8_off = ptr_off + 2 * kBlockN * sizeof(void*);
  static constexpr size_t bytes = fp8_off + 2 * kBlockN;
};

// Raw bytes of dims [c, c + 8) of a MODEL1 FP8 entry: no-RoPE dims -> (8 codes, scale byte), RoPE dims -> 8 bf16.
__device__ __forceinline__ uint4 fetch_fp8_entry8(const uint8_t* e, int c) {
  if (c < kFp8NopeDims) {
    const uint2 codes = __ldg(reinterpret_cast<const uint2*>(e + c));
    return make_uint4(codes.x, codes.y, static_cast<uint32_t>(__ldg(e + kFp8ScaleOffset + c / 64)), 0u);
  }
  const uint2* rope = reinterpret_cast<const uint2*>(e + kFp8NopeDims + (c - kFp8NopeDims) * 2);
  const uint2 a = __ldg(rope), b = __ldg(rope + 1);
  return make_uint4(a.x, a.y, b.x, b.y);
}

// fetch_fp8_entry8's raw bytes -> 8 bf16 (exact: e4m3 x a power of two fits bf16; the recipe of fp8_cache.cu's
// dequant and the CPU reference).
__device__ __forceinline__ uint4 decode_fp8_entry8(uint4 raw, int c) {
  if (c >= kFp8NopeDims) return raw;
  uint4 out;
  uint32_t* o = reinterpret_cast<uint32_t*>(&out);
  const uint2 codes = make_uint2(raw.x, raw.y);
  const uint8_t* b = reinterpret_cast<const uint8_t*>(&codes);
  const uint32_t ex = raw.z;
  const float sc = ex == 0xffu ? CUDART_NAN_F : __uint_as_float(ex << 23);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    __nv_fp8_e4m3 lo, hi;
    lo.__x = b[2 * j];
    hi.__x = b[2 * j + 1];
    const __nv_bfloat162 v = __floats2bfloat162_rn(static_cast<float>(lo) * sc, static_cast<float>(hi) * sc);
    o[j] = *reinterpret_cast<const uint32_t*>(&v);
  }
  return out;
}

template <int kDim, int kWarpsH>
__global__ void __launch_bounds__(kThreads, 1) sparse_mqa_kernel(const __grid_constant__ SparseMqaParams p) {
  using L = SmemLayout<kDim>;
  constexpr int kStride = L::kStride, kSStride = L::kSStride, kPStride = L::kPStride;
  constexpr int kVecPerRow = kDim / 8;
  constexpr int kHeads = 16 * kWarpsH;                 // Q rows computed = heads_per_cta
  constexpr int kWarpsN = (kThreads / 32) / kWarpsH;   // warps along keys (QK^T) and dims (PV)
  constexpr int kKeysPerWarp = kBlockN / kWarpsN;      // 8, 16 or 32
  constexpr int kQkNT = kKeysPerWarp / 8;
  constexpr int kDimsPerWarp = kDim / kWarpsN;
  constexpr int kNT = kDimsPerWarp / 8;                // PV n-tiles per warp
  constexpr int kIssueIters = kBlockN * kVecPerRow / kThreads;
  constexpr int kFp8Batch = kIssueIters < 8 ? kIssueIters : 8;
  static_assert(kBlockN * kVecPerRow % kThreads == 0 && kIssueIters % kFp8Batch == 0, "gather split");
  static_assert(kDimsPerWarp % 8 == 0 && kKeysPerWarp % 8 == 0, "warp tiles");
  // 16 heads per CTA: Q rows [16, 64) are unused, so FP8 entries are staged there raw by cp.async (asynchronous like
  // the bf16 rows) and decoded in shared memory once they land, instead of register round trips before the math.
  constexpr bool kStageFp8 = kWarpsH == 1 && kDim == 512;
  constexpr int kFp8Chunks = kFp8EntryBytes / 8;  // 73 8-byte pieces per entry
  static_assert(!kStageFp8 || (kFp8EntryBytes % 8 == 0 && (kBlockH - 16) * kStride * 2 >= kBlockN * kFp8EntryBytes),
                "FP8 staging");
  extern __shared__ __align__(16) char smem[];
  __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem + L::q_off);
  __nv_bfloat16* sK = reinterpret_cast<__nv_bfloat16*>(smem + L::k_off);
  float* sS = reinterpret_cast<float*>(smem + L::s_off);
  __nv_bfloat16* sP = reinterpret_cast<__nv_bfloat16*>(smem + L::p_off);
  float* sM = reinterpret_cast<float*>(smem + L::m_off);
  float* sL = reinterpret_cast<float*>(smem + L::l_off);
  float* sA = reinterpret_cast<float*>(smem + L::a_off);
  const uint8_t** sPtr = reinterpret_cast<const uint8_t**>(smem + L::ptr_off);
  bool* sFp8 = reinterpret_cast<bool*>(smem + L::fp8_off);
  uint8_t* sStage = reinterpret_cast<uint8_t*>(sQ + 16 * kStride);  // kStageFp8 only: [kBlockN][584] raw entries

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int64_t row = blockIdx.x;
  const int h0 = blockIdx.y * kHeads;
  const int num_heads = p.num_heads;

  for (int v = tid; v < kHeads * kVecPerRow; v += kThreads) {
    const int r = v / kVecPerRow, c = (v % kVecPerRow) * 8;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (h0 + r < num_heads) val = *reinterpret_cast<const uint4*>(p.q + (row * num_heads + h0 + r) * kDim + c);
    *reinterpret_cast<uint4*>(sQ + r * kStride + c) = val;
  }
  if (tid < kHeads) {
    sM[tid] = -CUDART_INF_F;
    sL[tid] = 0.f;
  }
  int len0 = 0, len1 = 0;
  {
    const SparseKvListParams& l0 = p.lists[0];
    len0 = l0.topk;
    if (l0.topk_length != nullptr) len0 = min(max(l0.topk_length[row / p.rows_per_length], 0), l0.topk);
    if (p.num_lists > 1) {
      const SparseKvListParams& l1 = p.lists[1];
      len1 = l1.topk;
      if (l1.topk_length != nullptr) len1 = min(max(l1.topk_length[row / p.rows_per_length], 0), l1.topk);
    }
  }
  const int total = len0 + len1;
  const float scale = p.softmax_scale;
  const int wh = warp % kWarpsH, wn = warp / kWarpsH;
  const int r0 = wh * 16 + g, r1 = r0 + 8;
  // ldmatrix lane roles: x4 A tiles (rows 0-7 / 8-15 x cols lo / hi), x2 B tiles (two 8x8 halves along k).
  const int a_row = wh * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, a_col = (lane >> 4) * 8;
  const int b_row = lane & 7, b_half = ((lane >> 3) & 1) * 8;

  float acc[kNT][4];
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  __syncthreads();

  // Index of entry tile * kBlockN + tid (threads < kBlockN), loaded one tile before resolve() needs it.
  auto fetch_index = [&](int tile) -> int32_t {
    const int kp = tile * kBlockN + tid;
    if (tid >= kBlockN || kp >= total) return -1;
    return kp < len0 ? p.lists[0].indices[row * p.lists[0].topk + kp]
                     : p.lists[1].indices[row * p.lists[1].topk + (kp - len0)];
  };
  // Entries of tile `tile` (indices already fetched) -> row pointers (nullptr = invalid) in slot `buf`.
  auto resolve = [&](int tile, int buf, int32_t index) {
    if (tid < kBlockN) {
      const int kp = tile * kBlockN + tid;
      const uint8_t* ptr = nullptr;
      bool fp8 = false;
      if (kp < total) {
        const SparseKvListParams& kl = kp < len0 ? p.lists[0] : p.lists[1];
        const int64_t s = index;
        fp8 = kl.is_fp8;
        if (s >= 0 && s < kl.num_blocks * kl.block_size) {
          const int64_t elem = (s / kl.block_size) * kl.block_stride + (s % kl.block_size) * kl.token_stride;
          ptr = static_cast<const uint8_t*>(kl.cache) + elem * (fp8 ? 1 : 2);
        }
      }
      sPtr[buf * kBlockN + tid] = ptr;
      sFp8[buf * kBlockN + tid] = fp8;
    }
  };
  // Gather into K buffer `buf`: cp.async for bf16 rows; FP8 entries fetched kFp8Batch at a time (independent loads
  // in flight together), then decoded; zero rows for invalid entries.
  auto issue = [&](int buf) {
    __nv_bfloat16* kbuf = sK + buf * kBlockN * kStride;
    const uint8_t* const* ptrs = sPtr + buf * kBlockN;
    const bool* fp8s = sFp8 + buf * kBlockN;
    const int c = (tid % kVecPerRow) * 8;  // the same dims for every row this thread gathers
    if constexpr (kStageFp8) {
      // bf16 rows -> K buffer, invalid rows -> zeros, FP8 entries -> staging (decoded at the
      // top of the tile loop once they land).
#pragma unroll 4
      for (int i = 0; i < kIssueIters; ++i) {
        const int r = (tid + i * kThreads) / kVecPerRow;
        const uint8_t* ptr = ptrs[r];
        __nv_bfloat16* dst = kbuf + r * kStride + c;
        if (ptr == nullptr) {
          *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
        } else if (!fp8s[r]) {
          cp_async_16(dst, ptr + 2 * c);
        }
      }
      for (int v = tid; v < kBlockN * kFp8Chunks; v += kThreads) {
        const int r = v / kFp8Chunks, j = v % kFp8Chunks;
        const uint8_t* ptr = ptrs[r];
        if (ptr != nullptr && fp8s[r]) cp_async_8(sStage + r * kFp8EntryBytes + j * 8, ptr + j * 8);
      }
    } else {
#pragma unroll 1
      for (int i0 = 0; i0 < kIssueIters; i0 += kFp8Batch) {
        uint4 raw[kFp8Batch];
#pragma unroll
        for (int j = 0; j < kFp8Batch; ++j) {
          const int r = (tid + (i0 + j) * kThreads) / kVecPerRow;
          const uint8_t* ptr = ptrs[r];
          raw[j] = make_uint4(0u, 0u, 0u, 0u);
          if (ptr != nullptr && fp8s[r]) raw[j] = fetch_fp8_entry8(ptr, c);
        }
#pragma unroll
        for (int j = 0; j < kFp8Batch; ++j) {
          const int r = (tid + (i0 + j) * kThreads) / kVecPerRow;
          const uint8_t* ptr = ptrs[r];
          __nv_bfloat16* dst = kbuf + r * kStride + c;
          if (ptr != nullptr && !fp8s[r]) {
            cp_async_16(dst, ptr + 2 * c);
          } else {
            *reinterpret_cast<uint4*>(dst) =
                ptr != nullptr ? decode_fp8_entry8(raw[j], c) : make_uint4(0u, 0u, 0u, 0u);
          }
        }
      }
    }
  };

  const int num_tiles = (total + kBlockN - 1) / kBlockN;
  int32_t next_index = 0;
  if (num_tiles > 0) {
    resolve(0, 0, fetch_index(0));
    next_index = fetch_index(1);
    __syncthreads();
    issue(0);
  }
  for (int tile = 0; tile < num_tiles; ++tile) {
    const int buf = tile & 1;
    // 1. Wait for this tile's rows, then start gathering the next tile into the other buffer (its last readers,
    //    tile - 1's QK^T and PV, finished before the previous iteration's final barrier).
    cp_async_wait_all();
    __syncthreads();
    if constexpr (kStageFp8) {
      // Staged FP8 entries of this tile -> bf16 rows of K buffer `buf` (decode_fp8_entry8's bits, as the register
      // path); the staging is free again before the next issue() below.
      const uint8_t* const* ptrs = sPtr + buf * kBlockN;
      const bool* fp8s = sFp8 + buf * kBlockN;
      __nv_bfloat16* kbuf = sK + buf * kBlockN * kStride;
      for (int v = tid; v < kBlockN * kVecPerRow; v += kThreads) {
        const int r = v / kVecPerRow, c = (v % kVecPerRow) * 8;
        if (ptrs[r] == nullptr || !fp8s[r]) continue;
        const uint8_t* e = sStage + r * kFp8EntryBytes;
        uint4 raw;
        if (c < kFp8NopeDims) {
          const uint2 codes = *reinterpret_cast<const uint2*>(e + c);
          raw = make_uint4(codes.x, codes.y, static_cast<uint32_t>(e[kFp8ScaleOffset + c / 64]), 0u);
        } else {
          const uint2* rope = reinterpret_cast<const uint2*>(e + kFp8NopeDims + (c - kFp8NopeDims) * 2);
          const uint2 a = rope[0], b = rope[1];
          raw = make_uint4(a.x, a.y, b.x, b.y);
        }
        *reinterpret_cast<uint4*>(kbuf + r * kStride + c) = decode_fp8_entry8(raw, c);
      }
      __syncthreads();  // decoded rows before QK^T; staging reads before the next issue()
    }
    if (tile + 1 < num_tiles) {
      resolve(tile + 1, buf ^ 1, next_index);
      next_index = fetch_index(tile + 2);
      __syncthreads();
      issue(buf ^ 1);
    }
    const __nv_bfloat16* sKt = sK + buf * kBlockN * kStride;
    const uint8_t* const* sPtrT = sPtr + buf * kBlockN;

    // 2. S = scale * Q K^T for this warp's 16 heads x kKeysPerWarp entries; invalid entries -> -inf.
    {
      float s[kQkNT][4];
#pragma unroll
      for (int nt = 0; nt < kQkNT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
      const uint32_t qa = smem_u32(sQ + a_row * kStride + a_col);
      const uint32_t kb = smem_u32(sKt + (wn * kKeysPerWarp + b_row) * kStride + b_half);
#pragma unroll 4
      for (int kk = 0; kk < kDim; kk += 16) {
        uint32_t a0, a1, a2, a3;
        ldsm_x4(a0, a1, a2, a3, qa + kk * 2);
#pragma unroll
        for (int nt = 0; nt < kQkNT; ++nt) {
          uint32_t b0, b1;
          ldsm_x2(b0, b1, kb + (nt * 8 * kStride + kk) * 2);
          mma_16816(s[nt], a0, a1, a2, a3, b0, b1);
        }
      }
#pragma unroll
      for (int nt = 0; nt < kQkNT; ++nt) {
        const int col = wn * kKeysPerWarp + nt * 8 + 2 * t4;
        const bool v0 = sPtrT[col] != nullptr, v1 = sPtrT[col + 1] != nullptr;
        sS[r0 * kSStride + col] = v0 ? s[nt][0] * scale : -CUDART_INF_F;
        sS[r0 * kSStride + col + 1] = v1 ? s[nt][1] * scale : -CUDART_INF_F;
        sS[r1 * kSStride + col] = v0 ? s[nt][2] * scale : -CUDART_INF_F;
        sS[r1 * kSStride + col + 1] = v1 ? s[nt][3] * scale : -CUDART_INF_F;
      }
    }
    __syncthreads();

    // 3. Online softmax: 4 threads per head row, 16 entries each (the same reduction order for any kHeads:
    //    same bits).
    if (tid < kHeads * 4) {  // whole warps (kHeads * 4 is a multiple of 64)
      const int r = tid / 4, part = tid % 4;
      const float* srow = sS + r * kSStride + part * 16;
      __nv_bfloat16* prow = sP + r * kPStride + part * 16;
      float mx = -CUDART_INF_F;
#pragma unroll
      for (int i = 0; i < 16; ++i) mx = fmaxf(mx, srow[i]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_old = sM[r];
      const float m_new = fmaxf(m_old, mx);
      float alpha = 1.f, sum = 0.f;
      if (m_new == -CUDART_INF_F) {
#pragma unroll
        for (int i = 0; i < 16; ++i) prow[i] = __float2bfloat16_rn(0.f);
      } else {
        alpha = expf(m_old - m_new);  // 0 when m_old is -inf
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const __nv_bfloat16 e = __float2bfloat16_rn(expf(srow[i] - m_new));
          prow[i] = e;
          sum += __bfloat162float(e);  // normalise with the same rounded weights the PV product uses
        }
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (part == 0) {
        sM[r] = m_new;
        sL[r] = sL[r] * alpha + sum;
        sA[r] = alpha;
      }
    }
    __syncthreads();

    // 4. O = alpha O + P V for this warp's 16 heads x kDimsPerWarp dims.
    {
      const float al0 = sA[r0], al1 = sA[r1];
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        acc[nt][0] *= al0;
        acc[nt][1] *= al0;
        acc[nt][2] *= al1;
        acc[nt][3] *= al1;
      }
      const uint32_t pa = smem_u32(sP + a_row * kPStride + a_col);
      const uint32_t vb = smem_u32(sKt + (b_row + b_half) * kStride + wn * kDimsPerWarp);
#pragma unroll
      for (int kk = 0; kk < kBlockN; kk += 16) {
        uint32_t a0, a1, a2, a3;
        ldsm_x4(a0, a1, a2, a3, pa + kk * 2);
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          uint32_t b0, b1;
          ldsm_x2_trans(b0, b1, vb + (kk * kStride + nt * 8) * 2);
          mma_16816(acc[nt], a0, a1, a2, a3, b0, b1);
        }
      }
    }
    __syncthreads();
  }

  // Epilogue: out = O / (l + exp(sink - m)); lse = m + log(l) (without the sink), -inf when nothing was valid.
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = rr == 0 ? r0 : r1;
    const int head = h0 + r;
    if (head >= num_heads) continue;
    const float m = sM[r], l = sL[r];
    float inv = 0.f;
    if (m != -CUDART_INF_F) {
      float den = l;
      if (p.attn_sink != nullptr) den += expf(p.attn_sink[head] - m);
      inv = 1.f / den;
    }
    __nv_bfloat16* o = p.out + (row * num_heads + head) * kDim + wn * kDimsPerWarp + 2 * t4;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      *reinterpret_cast<__nv_bfloat162*>(o + nt * 8) =
          __floats2bfloat162_rn(acc[nt][2 * rr] * inv, acc[nt][2 * rr + 1] * inv);
    }
    if (wn == 0 && t4 == 0) p.lse[row * num_heads + head] = m == -CUDART_INF_F ? -CUDART_INF_F : m + logf(l);
  }
}

template <int kDim>
void launch_dim(const SparseMqaParams& p, cudaStream_t stream) {
  constexpr size_t smem = SmemLayout<kDim>::bytes;
  const dim3 grid(static_cast<unsigned>(p.rows),
                  static_cast<unsigned>((p.num_heads + p.heads_per_cta - 1) / p.heads_per_cta));
  // Attributes are set on every launch: they are per device, and the call is a cheap host-side one.
  auto go = [&](auto kernel, const char* name) {
    DEEPINFER_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    kernel<<<grid, kThreads, smem, stream>>>(p);
    DEEPINFER_CHECK_LAUNCH(name);
  };
  if (p.heads_per_cta == 16) {
    go(sparse_mqa_kernel<kDim, 1>, "sparse_mqa_kernel<16 heads>");
  } else if (p.heads_per_cta == 32) {
    go(sparse_mqa_kernel<kDim, 2>, "sparse_mqa_kernel<32 heads>");
  } else {
    go(sparse_mqa_kernel<kDim, 4>, "sparse_mqa_kernel<64 heads>");
  }
}

}  // namespace

void launch_sparse_mqa(const SparseMqaParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.num_heads == 0) return;
  if (p.heads_per_cta != 16 && p.heads_per_cta != 32 && p.heads_per_cta != 64) {
    throw std::runtime_error("deepinfer sparse_mqa: heads_per_cta must be 16, 32 or 64");
  }
  switch (p.head_dim) {
    case 64: launch_dim<64>(p, stream); break;
    case 128: launch_dim<128>(p, stream); break;
    case 256: launch_dim<256>(p, stream); break;
    case 512: launch_dim<512>(p, stream); break;
    default: throw std::runtime_error("deepinfer sparse_mqa: unsupported head_dim " + std::to_string(p.head_dim));
  }
}

}  // namespace deepinfer::attention
