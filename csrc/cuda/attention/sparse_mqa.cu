// Sparse MQA kernel for Hopper (sm_90a), decode and prefill: warp-specialised, wgmma.
// One CTA of three warpgroups per (query row, 64 heads): warpgroup 0 gathers (producer), warpgroups 1 and 2 compute
// (consumers). Shared memory holds the Q tile and two 64-entry K buffers, each as head_dim / 64 column blocks of
// 64 rows x 128 B in the 128-byte swizzle wgmma reads. Producer: 8 threads per entry, each thread 4 entries of a tile
// (their indices loaded one tile ahead, their addresses computed side by side, no shuffles); bf16 rows arrive by
// cp.async (invalid entries as zero-filled copies), FP8 MODEL1 entries are loaded as 8-byte pieces and decoded to
// bf16 in registers. The producer never waits for its own copies: each thread arrives on the buffer's
// `full` mbarrier once for its stores and once more through cp.async.mbarrier.arrive.noinc, which fires when its
// copies have landed, so the next tile's gathers go out as soon as the consumers release that buffer through its
// `empty` mbarrier (after their PV product has read it).
// Consumers on alternate tiles: tile t is scored by consumer t % 2 over all dims (S = Q K^T, wgmma m64n64k16 with
// both operands from shared memory), which runs the online softmax (base-2 exponent, weights rounded to bf16 and
// summed as rounded) and hands its bf16 weights P and new running max to the other consumer through shared memory
// and a named barrier. Both then apply every tile in order to their half of O: O = alpha O + P V[:, half c] (the
// scorer with P from registers, the other from shared memory; V as the MN-major operand). The sink logit joins the
// denominator at the end. No split-KV: every head row is computed the same way whatever the batch or the heads
// beside it, so results are batch-invariant by construction (bench/NOTES-attention.md 12).
#include <cuda_fp8.h>
#include <math_constants.h>

#include <utility>

#include "deepinfer/attention/sparse_mqa.cuh"
#include "deepinfer/ptx.cuh"
#include "deepinfer/wgmma.cuh"

namespace deepinfer::attention {
namespace {

// 8 e4m3 codes (raw.x, raw.y) times the power of two 2^(raw.z - 127) (UE8M0; 0xff is NaN) -> 8 bf16 (exact: e4m3
// x a power of two fits bf16; the recipe of fp8_cache.cu's dequant and the CPU reference).
__device__ __forceinline__ uint4 decode_fp8_entry8(uint4 raw) {
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

namespace sm90 {

using namespace deepinfer::wgmma;

constexpr int kRows = 64;     // heads per CTA (wgmma M)
constexpr int kEntries = 64;  // KV entries per tile
constexpr int kThreads = 384;

template <int kDim>
struct Layout {
  static constexpr int kTileBytes = kRows * kDim * 2;  // Q tile or one K buffer
  static constexpr int q_off = 0;
  static constexpr int k_off = kTileBytes;                 // two K buffers
  // Per buffer the scorer's bf16 weights P (64 heads x 64 entries, one swizzled 128-byte column block, 1024-byte
  // aligned) and its running max per head; per consumer its row sums (l, lf).
  static constexpr int p_off = k_off + 2 * kTileBytes;
  static constexpr int m_off = p_off + 2 * kRows * kEntries * 2;
  static constexpr int l_off = m_off + 2 * kRows * 4;
  static constexpr int valid_off = l_off + 2 * kRows * 2 * 4;  // per buffer a 64-bit mask of valid entries
  static constexpr int bar_off = valid_off + 2 * 8;            // full[2], empty[2]
  static constexpr int bytes = bar_off + 4 * 8;
  static constexpr int alloc = bytes + 1024;  // the base is aligned up to 1024 B (the swizzle's repeat)
};

template <int N>
struct PvAtom;  // O[:, N dims] += P V: P from registers (rs, the scorer's) or from shared memory (ss)
template <>
struct PvAtom<64> {
  using rs = gmma::MMA_64x64x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>;
  using ss = gmma::MMA_64x64x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::MN>;
};
template <>
struct PvAtom<128> {
  using rs = gmma::MMA_64x128x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>;
  using ss = gmma::MMA_64x128x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::MN>;
};
template <>
struct PvAtom<256> {
  using rs = gmma::MMA_64x256x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>;
  using ss = gmma::MMA_64x256x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::MN>;
};


__device__ __forceinline__ float ex2(float x) {  // 2^x (MUFU; -inf -> 0)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Online softmax of one 64-entry tile, rows r0 = 16 w4 + g (s[4j], s[4j + 1]) and r1 = r0 + 8 (s[4j + 2],
// s[4j + 3]), columns 8j + 2 t4 (+1); invalid entries -> -inf. Scales s to base-2 units, updates the running max
// (m0, m1), and returns the rescale factors of the old O and sums, the weights as the bf16 A fragments of PV
// (registers 0 / 1 hold rows r0 / r1 of keys 16 (j/2) + 2 t4 for j even, registers 2 / 3 the same rows 8 keys on
// for j odd), and the tile's row sums of the rounded (sum) and the fp32 (sumf) weights, reduced over the row's
// four lanes.
__device__ __forceinline__ void softmax_tile(float (&s)[32], uint64_t vmask, float sl2, int t4, float& m0, float& m1,
                                             float& alpha0, float& alpha1, uint32_t (&pa)[4][4], float& sum0,
                                             float& sum1, float& sumf0, float& sumf1) {
  float mx0 = -CUDART_INF_F, mx1 = -CUDART_INF_F;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int col = j * 8 + 2 * t4;
    const bool v0 = (vmask >> col) & 1u, v1 = (vmask >> (col + 1)) & 1u;
    s[4 * j] = v0 ? s[4 * j] * sl2 : -CUDART_INF_F;
    s[4 * j + 1] = v1 ? s[4 * j + 1] * sl2 : -CUDART_INF_F;
    s[4 * j + 2] = v0 ? s[4 * j + 2] * sl2 : -CUDART_INF_F;
    s[4 * j + 3] = v1 ? s[4 * j + 3] * sl2 : -CUDART_INF_F;
    mx0 = fmaxf(mx0, fmaxf(s[4 * j], s[4 * j + 1]));
    mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
  alpha0 = mn0 == -CUDART_INF_F ? 1.f : ex2(m0 - mn0);  // 0 when m0 is -inf
  alpha1 = mn1 == -CUDART_INF_F ? 1.f : ex2(m1 - mn1);
  const float base0 = mn0 == -CUDART_INF_F ? 0.f : mn0, base1 = mn1 == -CUDART_INF_F ? 0.f : mn1;
  float sum0a = 0.f, sum0b = 0.f, sum1a = 0.f, sum1b = 0.f;
  sumf0 = 0.f;
  sumf1 = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float x0 = ex2(s[4 * j] - base0), x1 = ex2(s[4 * j + 1] - base0);
    const float x2 = ex2(s[4 * j + 2] - base1), x3 = ex2(s[4 * j + 3] - base1);
    sumf0 += x0 + x1;
    sumf1 += x2 + x3;
    const __nv_bfloat162 e01 = __floats2bfloat162_rn(x0, x1);
    const __nv_bfloat162 e23 = __floats2bfloat162_rn(x2, x3);
    // Sums of the rounded weights (the ones PV multiplies), two chains per row, added at the end.
    const float2 f01 = __bfloat1622float2(e01), f23 = __bfloat1622float2(e23);
    sum0a += f01.x;
    sum0b += f01.y;
    sum1a += f23.x;
    sum1b += f23.y;
    pa[j / 2][(j % 2) * 2] = *reinterpret_cast<const uint32_t*>(&e01);
    pa[j / 2][(j % 2) * 2 + 1] = *reinterpret_cast<const uint32_t*>(&e23);
  }
  sum0 = sum0a + sum0b;
  sum1 = sum1a + sum1b;
  sum0 += __shfl_xor_sync(0xffffffffu, sum0, 1);
  sum1 += __shfl_xor_sync(0xffffffffu, sum1, 1);
  sum0 += __shfl_xor_sync(0xffffffffu, sum0, 2);
  sum1 += __shfl_xor_sync(0xffffffffu, sum1, 2);
  sumf0 += __shfl_xor_sync(0xffffffffu, sumf0, 1);
  sumf1 += __shfl_xor_sync(0xffffffffu, sumf1, 1);
  sumf0 += __shfl_xor_sync(0xffffffffu, sumf0, 2);
  sumf1 += __shfl_xor_sync(0xffffffffu, sumf1, 2);
  m0 = mn0;
  m1 = mn1;
}

// O *= alpha per row (skipped when no row of the warp changed its max).
template <size_t N>
__device__ __forceinline__ void rescale_o(float (&o)[N], float alpha0, float alpha1) {
  if (__any_sync(0xffffffffu, alpha0 != 1.f || alpha1 != 1.f)) {
#pragma unroll
    for (size_t jn = 0; jn < N / 4; ++jn) {
      o[4 * jn] *= alpha0;
      o[4 * jn + 1] *= alpha0;
      o[4 * jn + 2] *= alpha1;
      o[4 * jn + 3] *= alpha1;
    }
  }
}

template <int kDim>
__global__ void __launch_bounds__(kThreads, 1) sparse_mqa_sm90_kernel(const __grid_constant__ SparseMqaParams p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = Layout<kDim>;
  constexpr int kChunks = kDim / 8;                   // 16-byte chunks per row
  constexpr int kPvN = kDim >= 128 ? kDim / 2 : kDim;  // dims of each consumer's PV share (head_dim 64: both all)
  constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
  extern __shared__ char smem_raw[];
  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* bar_full = reinterpret_cast<uint64_t*>(smem + L::bar_off);
  uint64_t* bar_empty = bar_full + 2;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, wg = tid / 128;
  const int64_t row = blockIdx.x;
  const int h0 = blockIdx.y * kRows;
  const int num_heads = p.num_heads;

  // Q tile (rows past num_heads zero) -> swizzled shared memory; barriers.
  for (int v = tid; v < kRows * kChunks; v += kThreads) {
    const int r = v / kChunks, c = v % kChunks;
    char* dst = smem + L::q_off + swizzled(r, c);
    if (h0 + r < num_heads) {
      cp_async_16(dst, p.q + (row * num_heads + h0 + r) * kDim + c * 8);
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  cp_async_wait_all();
  fence_proxy_async_shared();
  if (tid == 0) {
    mbar_init(bar_full, 256);  // per producer thread: its stores (arrive) and its cp.async copies (arrive.noinc)
    mbar_init(bar_full + 1, 256);
    mbar_init(bar_empty, 256);
    mbar_init(bar_empty + 1, 256);
    fence_mbar_init();
  }
  int len0 = p.lists[0].topk, len1 = 0;
  if (p.lists[0].topk_length != nullptr) len0 = min(max(p.lists[0].topk_length[row / p.rows_per_length], 0), len0);
  if (p.num_lists > 1) {
    len1 = p.lists[1].topk;
    if (p.lists[1].topk_length != nullptr) {
      len1 = min(max(p.lists[1].topk_length[row / p.rows_per_length], 0), len1);
    }
  }
  const int total = len0 + len1;
  const int num_tiles = (total + kEntries - 1) / kEntries;
  __syncthreads();

  if (wg == 0) {
    // ---- producer: 8 threads per entry. Thread (warp w, lane) gathers entries 16 w + 4 r + lane / 8 (r < 4) of each
    //      tile, the 16-byte chunks lane % 8 + 8 m (m < kChunks / 8) of each; its indices are loaded one tile ahead.
    //      No shuffles and no waits on its own copies: the address math of four rows runs side by side. ----
    setmaxnreg_dec<88>();
    constexpr int kRowChunks = kChunks / 8;
    const int gi = lane & 7, e0 = warp * 16 + (lane >> 3);
    const uint32_t k_s = smem_u32(smem + L::k_off);
    // Index (a slot of list 0 or 1) of entry kp of the row, or -1 past the row's entries.
    auto load_index = [&](int kp) -> int32_t {
      if (kp >= total) return -1;
      return kp < len0 ? p.lists[0].indices[row * p.lists[0].topk + kp]
                       : p.lists[1].indices[row * p.lists[1].topk + (kp - len0)];
    };
    int32_t index[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) index[r] = num_tiles > 0 ? load_index(e0 + 4 * r) : -1;
    for (int t = 0; t < num_tiles; ++t) {
      const int b = t & 1;
      const uint8_t* src[4];  // the entry's bytes (an FP8 entry's row), nullptr when invalid
      int32_t sc_off[4];      // FP8: the entry's scale bytes, relative to its row
      bool fp8[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int kp = t * kEntries + e0 + 4 * r;
        const SparseKvListParams& kl = p.lists[kp < len0 ? 0 : 1];
        const int32_t sl = index[r];
        const bool valid = kp < total && sl >= 0 && sl < kl.num_blocks * kl.block_size;
        const uint32_t bs = static_cast<uint32_t>(max(kl.block_size, 1));
        const uint32_t blk = static_cast<uint32_t>(sl) / bs, off = static_cast<uint32_t>(sl) - blk * bs;
        fp8[r] = kl.is_fp8;
        sc_off[r] = static_cast<int32_t>(bs * kFp8RowBytes - off * (kFp8RowBytes - kFp8ScaleBytes));
        const uint8_t* cache = static_cast<const uint8_t*>(kl.cache);
        src[r] = !valid     ? nullptr
                 : kl.is_fp8 ? cache + blk * kl.block_stride + off * kFp8RowBytes
                             : cache + (blk * kl.block_stride + off * kl.token_stride) * 2;
      }
      if (t + 1 < num_tiles) {
#pragma unroll
        for (int r = 0; r < 4; ++r) index[r] = load_index((t + 1) * kEntries + e0 + 4 * r);  // in flight meanwhile
      }
      if (t >= 2) mbar_wait(bar_empty + b, ((t >> 1) + 1) & 1);
      // Valid mask of the warp's 16 entries: bit 4 r + lane / 8 (all 8 lanes of an entry agree).
      uint32_t vmask = 0;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const uint32_t v = __ballot_sync(0xffffffffu, src[r] != nullptr);
        vmask |= ((v & 1u) | ((v >> 7) & 2u) | ((v >> 14) & 4u) | ((v >> 21) & 8u)) << (4 * r);
      }
      if (lane == 0) reinterpret_cast<uint16_t*>(smem + L::valid_off + b * 8)[warp] = static_cast<uint16_t>(vmask);
      const uint32_t kbuf = k_s + b * L::kTileBytes;
      // Two entries at a time: the pieces of both FP8 entries are loaded before either is decoded. A MODEL1 entry
      // (row and scales 8-byte aligned): chunk c < 56 is 8 e4m3 codes at byte 8 c of the row with the scale
      // exponent of dims [64 (c / 8), ..) at byte c / 8 of the scales (c / 8 = m here), decoded to bf16 in
      // registers; chunk 56 + gi is 8 bf16 RoPE dims.
      constexpr int kCodeChunks = kDim == 512 ? kRowChunks - 1 : 1;
#pragma unroll
      for (int r0 = 0; r0 < 4; r0 += 2) {
        bool dec[2];
        uint2 sc[2], rope[2][2], codes[2][kCodeChunks];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          dec[h] = kDim == 512 && fp8[r0 + h] && src[r0 + h] != nullptr;
          if (dec[h]) {
            const uint2* e8 = reinterpret_cast<const uint2*>(src[r0 + h]);
            sc[h] = __ldg(reinterpret_cast<const uint2*>(src[r0 + h] + sc_off[r0 + h]));
            rope[h][0] = __ldg(e8 + kFp8NopeDims / 8 + 2 * gi);
            rope[h][1] = __ldg(e8 + kFp8NopeDims / 8 + 2 * gi + 1);
#pragma unroll
            for (int m = 0; m < kCodeChunks; ++m) codes[h][m] = __ldg(e8 + gi + 8 * m);
          }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = r0 + h, e = e0 + 4 * r;
          const uint32_t dst = kbuf + swizzled(e, gi);  // chunk gi + 8 m of the entry: + m * 64 rows * 128 B
          if (dec[h]) {
            st_shared_16(dst + kCodeChunks * (64 * 128),
                         make_uint4(rope[h][0].x, rope[h][0].y, rope[h][1].x, rope[h][1].y));
#pragma unroll
            for (int m = 0; m < kCodeChunks; ++m) {
              const uint32_t ex = ((m < 4 ? sc[h].x : sc[h].y) >> (8 * (m & 3))) & 0xffu;
              st_shared_16(dst + m * (64 * 128), decode_fp8_entry8(make_uint4(codes[h][m].x, codes[h][m].y, ex, 0u)));
            }
          } else {  // bf16 entry (or zeros when invalid: the source is not read)
            const uint8_t* rs = src[r] != nullptr ? src[r] : static_cast<const uint8_t*>(p.lists[0].cache);
            const uint32_t n = src[r] != nullptr ? 16u : 0u;
#pragma unroll
            for (int m = 0; m < kRowChunks; ++m) {
              cp_async_16_zfill(dst + m * (64 * 128), rs + (gi + 8 * m) * 16, n);
            }
          }
        }
      }
      fence_proxy_async_shared();  // decoded FP8 rows and the mask before the consumers' wgmma
      mbar_arrive(bar_full + b);
      cp_async_mbar_arrive_noinc(bar_full + b);  // the second arrival: once this thread's copies have landed
    }
    return;
  }

  // ---- consumers ----
  setmaxnreg_inc<208>();
  // the consumer index through a shuffle: warp-uniform for the compiler, so wgmma under branches on it stays async
  const int c = __shfl_sync(0xffffffffu, wg, 0) - 1, ct = tid - 128 * wg, w4 = ct / 32, g = lane / 4, t4 = lane % 4;
  const int pv_col0 = kDim >= 128 ? c * kPvN : 0;
  const uint32_t q_s = smem_u32(smem + L::q_off), k_s = smem_u32(smem + L::k_off);
  const float sl2 = p.softmax_scale * kLog2e;  // scores in base-2 units
  float o[kPvN / 2];
#pragma unroll
  for (int i = 0; i < kPvN / 2; ++i) o[i] = 0.f;
  // l: sums of the bf16-rounded weights (out's denominator: the weights PV multiplies); lf: of the fp32 weights
  // (lse's, exact to fp32 rounding as engines merging attention states by lse need).
  float m0 = -CUDART_INF_F, m1 = -CUDART_INF_F, l0 = 0.f, l1 = 0.f, lf0 = 0.f, lf1 = 0.f;
  float s[32];
  uint32_t pa[4][4];
  float alpha0, alpha1, sum0, sum1, sumf0, sumf1;

  {
    // Alternate tiles: tile t sits in buffer b = t & 1 and is scored by consumer b over all dims (S = Q K^T, then
    // the online softmax against the running max the other consumer left in shared memory); the scorer writes
    // its weights P and new max for the other consumer, and both apply every tile in order to their half of O:
    // O = alpha O + P V[:, dims] (the scorer with P from registers, the other from shared memory). Each consumer
    // sums the weights of its own tiles (rescaled at every tile); the two sums are added at the end.
    const int r0 = w4 * 16 + g, r1 = r0 + 8;
    const uint32_t p_s = smem_u32(smem + L::p_off);
    float* m_s = reinterpret_cast<float*>(smem + L::m_off);  // [buffer][head row]
    float* l_s = reinterpret_cast<float*>(smem + L::l_off);  // [consumer][head row][l, lf]
#pragma unroll 1
    for (int t = -1; t < num_tiles; ++t) {  // t = -1 only issues consumer 0's first QK^T (one issue site, so no
      const int b = t & 1;                  // register copies of S while a wgmma is in flight)
      if (t >= 0) {
        const uint32_t kb = k_s + b * L::kTileBytes;
        cute::warpgroup_wait<0>();  // its own PV of tile t - 1, or its QK^T of tile t
        fence_regs(o);
        if (t > 0 && (b ^ 1) == c) mbar_arrive(bar_empty + (b ^ 1));  // own tile t - 1's buffer is read no more
        if (b == c) {
          fence_regs(s);
          const uint64_t vmask = *reinterpret_cast<const uint64_t*>(smem + L::valid_off + b * 8);
          softmax_tile(s, vmask, sl2, t4, m0, m1, alpha0, alpha1, pa, sum0, sum1, sumf0, sumf1);
          // P (64 heads x 64 entries bf16, K-major, 128-byte swizzle) and the new max for the other consumer.
          const uint32_t pb = p_s + b * (kRows * kEntries * 2);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            st_shared_u32(pb + swizzled(r0, j) + 4 * t4, pa[j / 2][(j % 2) * 2]);
            st_shared_u32(pb + swizzled(r1, j) + 4 * t4, pa[j / 2][(j % 2) * 2 + 1]);
          }
          if (t4 == 0) {
            m_s[b * kRows + r0] = m0;
            m_s[b * kRows + r1] = m1;
          }
          fence_proxy_async_shared();  // P before the other consumer's wgmma reads it
          named_bar_arrive(1 + b, 256);
          l0 = l0 * alpha0 + sum0;
          l1 = l1 * alpha1 + sum1;
          lf0 = lf0 * alpha0 + sumf0;
          lf1 = lf1 * alpha1 + sumf1;
        } else {
          named_bar_sync(1 + b, 256);  // the scorer's P and max of tile t
          mbar_wait(bar_full + b, (t >> 1) & 1);  // (complete already) the producer's rows of tile t
          fence_proxy_async_shared();
          const float mn0 = m_s[b * kRows + r0], mn1 = m_s[b * kRows + r1];
          alpha0 = mn0 == -CUDART_INF_F ? 1.f : ex2(m0 - mn0);  // the scorer's factors, bit for bit
          alpha1 = mn1 == -CUDART_INF_F ? 1.f : ex2(m1 - mn1);
          m0 = mn0;
          m1 = mn1;
          l0 *= alpha0;
          l1 *= alpha1;
          lf0 *= alpha0;
          lf1 *= alpha1;
        }
        rescale_o(o, alpha0, alpha1);
        fence_regs(o);
        const uint32_t vb = kb + (pv_col0 / 64) * (64 * 128);  // V[:, this consumer's dims]
        if (b == c) {
          cute::warpgroup_arrive();
#pragma unroll
          for (int kk = 0; kk < kEntries / 16; ++kk) {
            mma_rs<typename PvAtom<kPvN>::rs>(pa[kk], desc(vb + kk * 2048, 8192, 1024), o,
                                                 std::make_index_sequence<kPvN / 2>{});
          }
          cute::warpgroup_commit_batch();
        } else {
          const uint32_t pb = p_s + b * (kRows * kEntries * 2);
          cute::warpgroup_arrive();
#pragma unroll
          for (int kk = 0; kk < kEntries / 16; ++kk) {
            mma_ss<typename PvAtom<kPvN>::ss>(desc(pb + kk * 32, 16, 1024),
                                                   desc(vb + kk * 2048, 8192, 1024), o, gmma::ScaleOut::One,
                                                   std::make_index_sequence<kPvN / 2>{});
          }
          cute::warpgroup_commit_batch();
          // Release the buffer now, before waiting for the next tile: its refill must not wait for that tile's
          // gather and QK^T (the gathers would run one after another).
          cute::warpgroup_wait<0>();
          fence_regs(o);
          mbar_arrive(bar_empty + b);
        }
      }
      if (b != c && t + 1 < num_tiles) {  // S = Q K^T of this consumer's next tile over all dims, behind the PV
        const int bn = b ^ 1;
        mbar_wait(bar_full + bn, ((t + 1) >> 1) & 1);
        fence_proxy_async_shared();
        const uint32_t kb = k_s + bn * L::kTileBytes;
        cute::warpgroup_arrive();
#pragma unroll
        for (int kk = 0; kk < kDim / 16; ++kk) {
          const uint32_t off = (kk >> 2) * (64 * 128) + (kk & 3) * 32;
          mma_ss<gmma::MMA_64x64x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>>(
              desc(q_s + off, 16, 1024), desc(kb + off, 16, 1024), s,
              kk == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One, std::make_index_sequence<32>{});
        }
        cute::warpgroup_commit_batch();
      }
    }
    cute::warpgroup_wait<0>();
    fence_regs(o);
    // Row sums: each consumer's share through shared memory, added in consumer order (the same bits in both).
    if (t4 == 0) {
      l_s[(c * kRows + r0) * 2] = l0;
      l_s[(c * kRows + r0) * 2 + 1] = lf0;
      l_s[(c * kRows + r1) * 2] = l1;
      l_s[(c * kRows + r1) * 2 + 1] = lf1;
    }
    named_bar_sync(5, 256);  // also: every wgmma of both consumers has completed (the Q tile is free)
    l0 = l_s[r0 * 2] + l_s[(kRows + r0) * 2];
    lf0 = l_s[r0 * 2 + 1] + l_s[(kRows + r0) * 2 + 1];
    l1 = l_s[r1 * 2] + l_s[(kRows + r1) * 2];
    lf1 = l_s[r1 * 2 + 1] + l_s[(kRows + r1) * 2 + 1];
  }

  // Epilogue: out = O / (l + exp(sink - m)); lse = m + log(lf) (natural log, without the sink), -inf when nothing
  // was valid. O is staged as bf16 in the Q tile's space (free: both consumers' last QK^T products completed before
  // that tile's exchange barrier, or before the row-sum barrier with alternate tiles), 16-byte chunk ch of row r at
  // chunk ch ^ (r & 7) (no bank conflicts), then written out with coalesced 16-byte stores.
  const bool writes_o = kDim >= 128 || c == 0;  // head_dim 64: both consumers hold all of O, consumer 0 writes it
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = w4 * 16 + g + 8 * rr;
    const int head = h0 + r;
    const float m = rr == 0 ? m0 : m1, l = rr == 0 ? l0 : l1, lf = rr == 0 ? lf0 : lf1;
    float inv = 0.f;
    if (m != -CUDART_INF_F && head < num_heads) {
      float den = l;
      if (p.attn_sink != nullptr) den += exp2f(p.attn_sink[head] * kLog2e - m);
      inv = 1.f / den;
    }
    if (writes_o) {
#pragma unroll
      for (int jn = 0; jn < kPvN / 8; ++jn) {
        const int ch = pv_col0 / 8 + jn;
        const __nv_bfloat162 v = __floats2bfloat162_rn(o[4 * jn + 2 * rr] * inv, o[4 * jn + 2 * rr + 1] * inv);
        st_shared_u32(q_s + r * (kDim * 2) + ((ch ^ (r & 7)) << 4) + t4 * 4, *reinterpret_cast<const uint32_t*>(&v));
      }
    }
    if (c == 0 && t4 == 0 && head < num_heads) {
      // m = -inf: no finite score; l is NaN only when a score was NaN (NaN in, NaN out), else 0 (the empty-set rule).
      p.lse[row * num_heads + head] = m == -CUDART_INF_F ? (isnan(lf) ? CUDART_NAN_F : -CUDART_INF_F)
                                                          : m * kLn2 + logf(lf);
    }
  }
  if (writes_o) {
    named_bar_sync(3 + c, 128);  // this consumer's columns of O staged
    constexpr int kOutChunks = kPvN / 8;  // 16-byte chunks of a row this consumer writes
#pragma unroll 4
    for (int v = ct; v < kRows * kOutChunks; v += 128) {
      const int r = v / kOutChunks, ch = pv_col0 / 8 + v % kOutChunks;
      if (h0 + r >= num_heads) break;  // rows only grow with v
      *reinterpret_cast<uint4*>(p.out + (row * num_heads + h0 + r) * kDim + ch * 8) =
          ld_shared_u4(q_s + r * (kDim * 2) + ((ch ^ (r & 7)) << 4));
    }
  }
#else
  __trap();  // built without sm_90a (launch_sparse_mqa refuses other GPUs)
#endif
}

template <int kDim>
void launch(const SparseMqaParams& p, cudaStream_t stream) {
  constexpr int smem = Layout<kDim>::alloc;
  static_assert(smem <= 227 * 1024, "shared memory");
  const dim3 grid(static_cast<unsigned>(p.rows), static_cast<unsigned>((p.num_heads + kRows - 1) / kRows));
  ensure_dynamic_smem(sparse_mqa_sm90_kernel<kDim>, smem);
  sparse_mqa_sm90_kernel<kDim><<<grid, kThreads, smem, stream>>>(p);
  DEEPINFER_CHECK_LAUNCH("sparse_mqa_sm90_kernel");
}

}  // namespace sm90


}  // namespace

void launch_sparse_mqa(const SparseMqaParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.num_heads == 0) return;
  int device = 0, major = 0;
  DEEPINFER_CUDA_CHECK(cudaGetDevice(&device));
  DEEPINFER_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major != 9) {
    throw std::runtime_error("deepinfer sparse_mqa: the CUDA kernel needs a Hopper (sm_90a) GPU, got compute "
                             "capability " + std::to_string(major) + ".x");
  }
  switch (p.head_dim) {
    case 64: sm90::launch<64>(p, stream); break;
    case 128: sm90::launch<128>(p, stream); break;
    case 256: sm90::launch<256>(p, stream); break;
    case 512: sm90::launch<512>(p, stream); break;
    default: throw std::runtime_error("deepinfer sparse_mqa: unsupported head_dim " + std::to_string(p.head_dim));
  }
}

}  // namespace deepinfer::attention
