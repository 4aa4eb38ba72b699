// FP8 block-scaled GEMM for few rows (M <= 64, K % 128 == 0, bf16 out), sm90a: the recipe of fp8_gemm.cuh, dense
// or grouped with the masked layout (one grid row per group; a group without rows reads nothing).
// One warpgroup per CTA and one CTA per BN columns of D (BN 32 / 64 / 128, the widest tile whose CTAs still cover
// the SMs): the CUTLASS kernels' N tile is 128 (the scale granularity fixes it there), so at N = 4096 they run 32
// CTAs and stream the weights from a quarter of the SMs. The A tile (64 rows, rows >= M zero-filled) and the B tile
// of each 128-deep K block arrive by cp.async through a kStages ring; a block is four wgmma m64nBNk32 (both
// operands K-major in the 128-byte swizzle, fp32 out, the first one overwriting), then promoted:
// acc = fma(block, sfa[m, kb] * sfb[n / 128, kb], acc), blocks in K order, and acc goes out as bf16. Per element
// these are the CUTLASS blockwise-scaling kernels' operations in their order (wgmma per 128-deep block, one FFMA
// promotion with the product of the two scales, alpha = 1 epilogue), so the bits equal theirs and the kernel may be
// chosen by M without breaking batch invariance (tests/ops/test_gemm_small_m.py). The promotion waits for its
// block's products (ptxas serialises the wgmma of an overlapped variant anyway); the cp.async ring keeps the
// weight stream going meanwhile.
#include <utility>

#include "deepinfer/gemm/fp8_gemm.cuh"
#include "deepinfer/common.cuh"
#include "deepinfer/ptx.cuh"
#include "deepinfer/wgmma.cuh"

namespace deepinfer::gemm {
namespace {

using namespace deepinfer::wgmma;

constexpr int kBlockK = 128;  // bytes of a K block's row = one 128-byte swizzle row
constexpr int kRowsA = 64;    // wgmma M
constexpr int kStages = 8;
constexpr int kThreads = 128;

template <int BN>
struct Atom;
template <>
struct Atom<32> {
  using type = gmma::MMA_64x32x32_F32E4M3E4M3_SS_TN<>;
};
template <>
struct Atom<64> {
  using type = gmma::MMA_64x64x32_F32E4M3E4M3_SS_TN<>;
};
template <>
struct Atom<128> {
  using type = gmma::MMA_64x128x32_F32E4M3E4M3_SS_TN<>;
};

template <int BN>
struct Smem {
  static constexpr int a_bytes = kRowsA * kBlockK;
  static constexpr int stage = a_bytes + BN * kBlockK;
  static constexpr int alloc = kStages * stage + 1024;  // the base aligned up to 1024 B (the swizzle's repeat)
};

// Dense (one group, group strides unused) or masked grouped: group g multiplies rows [0, min(masked_m[g], M)) of
// A[g] by B[g]. Strides in elements; A scales sfa[g * sfa_g + m * sfa_m + kb * sfa_k], B scales sfb[g * sfb_g +
// nb * sfb_n + kb].
struct SmallMParams {
  const uint8_t* a;
  const float* sfa;
  const uint8_t* b;
  const float* sfb;
  __nv_bfloat16* d;
  const int32_t* masked_m;  // null: dense
  int M, N, K;
  int64_t lda, a_g, sfa_m, sfa_k, sfa_g, ldb, b_g, sfb_n, sfb_g, ldd, d_g;
};

template <int BN>
struct SmallM {
  const SmallMParams& p;
  int M;          // rows of this CTA's group
  uint32_t base;  // shared address of stage 0
  int n0, r0, r1, t4;
  float acc[BN / 2];

  // Zeros in every stage's A rows past M (written once: the loads never touch them).
  __device__ __forceinline__ void zero_pad_rows() const {
    for (int i = M * 8 + threadIdx.x; i < kRowsA * 8; i += kThreads) {
      const int r = i / 8, c = i % 8;
#pragma unroll
      for (int s = 0; s < kStages; ++s) {
        st_shared_16(base + s * Smem<BN>::stage + swizzled(r, c), make_uint4(0u, 0u, 0u, 0u));
      }
    }
  }

  // Block kb's A rows (< M) and B tile (rows past N zero-filled) into stage kb % kStages.
  __device__ __forceinline__ void load(int kb) const {
    const uint32_t st = base + (kb % kStages) * Smem<BN>::stage;
    const uint8_t* a = p.a + blockIdx.y * p.a_g;
    const uint8_t* b = p.b + blockIdx.y * p.b_g;
    for (int i = threadIdx.x; i < M * 8; i += kThreads) {
      const int r = i / 8, c = i % 8;
      cp_async_16_zfill(st + swizzled(r, c), a + r * p.lda + kb * kBlockK + c * 16, 16u);
    }
    for (int i = threadIdx.x; i < BN * 8; i += kThreads) {
      const int r = i / 8, c = i % 8;
      const bool ok = n0 + r < p.N;
      cp_async_16_zfill(st + Smem<BN>::a_bytes + swizzled(r, c),
                        ok ? b + (n0 + r) * p.ldb + kb * kBlockK + c * 16 : b, ok ? 16u : 0u);
    }
  }

  // blk = the four k32 products of block kb (asynchronous; blk is overwritten by the first).
  __device__ __forceinline__ void issue(int kb, float (&blk)[BN / 2]) const {
    const uint32_t st = base + (kb % kStages) * Smem<BN>::stage;
    fence_regs(blk);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < kBlockK / 32; ++kk) {
      mma_ss<typename Atom<BN>::type>(desc(st + kk * 32, 16, 1024), desc(st + Smem<BN>::a_bytes + kk * 32, 16, 1024),
                                      blk, kk == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One,
                                      std::make_index_sequence<BN / 2>{});
    }
    cute::warpgroup_commit_batch();
  }

  // acc = fma(blk, sfa[m, kb] * sfb[n / 128, kb], acc) for this thread's rows r0, r1 (rows past M: scale 0).
  __device__ __forceinline__ void promote(int kb, float (&blk)[BN / 2]) {
    fence_regs(blk);
    const float sb = p.sfb[blockIdx.y * p.sfb_g + (n0 / kScaleBlock) * p.sfb_n + kb];
    const float* sa = p.sfa + blockIdx.y * p.sfa_g + kb * p.sfa_k;
    const float s0 = r0 < M ? sa[r0 * p.sfa_m] * sb : 0.f, s1 = r1 < M ? sa[r1 * p.sfa_m] * sb : 0.f;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      acc[4 * j] = __fmaf_rn(blk[4 * j], s0, acc[4 * j]);
      acc[4 * j + 1] = __fmaf_rn(blk[4 * j + 1], s0, acc[4 * j + 1]);
      acc[4 * j + 2] = __fmaf_rn(blk[4 * j + 2], s1, acc[4 * j + 2]);
      acc[4 * j + 3] = __fmaf_rn(blk[4 * j + 3], s1, acc[4 * j + 3]);
    }
  }

  // One K block: wait for its tiles, refill the ring (the stage of block kb - 1, whose products are done), then
  // its products and their promotion.
  __device__ __forceinline__ void step(int kb, int num_kb, float (&blk)[BN / 2]) {
    cp_async_wait_group<kStages - 2>();  // this thread's copies of block kb
    fence_proxy_async_shared();          // (they and the zero rows) before the wgmma of any thread reads them
    __syncthreads();
    if (kb + kStages - 1 < num_kb) load(kb + kStages - 1);
    cp_async_commit();
    issue(kb, blk);
    cute::warpgroup_wait<0>();
    promote(kb, blk);
  }
};

template <int BN>
__global__ void __launch_bounds__(kThreads) fp8_gemm_small_m_kernel(const __grid_constant__ SmallMParams p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const int rows = p.masked_m == nullptr ? p.M : min(max(p.masked_m[blockIdx.y], 0), p.M);
  if (rows == 0) return;  // a group without tokens: no weight read
  extern __shared__ char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  SmallM<BN> k{p, rows, base, static_cast<int>(blockIdx.x) * BN, warp * 16 + lane / 4, warp * 16 + lane / 4 + 8,
               lane % 4};
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) k.acc[i] = 0.f;
  const int num_kb = p.K / kBlockK;
  k.zero_pad_rows();
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_kb) k.load(s);
    cp_async_commit();
  }
  float blk[BN / 2];
#pragma unroll 1
  for (int kb = 0; kb < num_kb; ++kb) k.step(kb, num_kb, blk);
  // D = bf16(acc): rows r0, r1; columns n0 + 8 j + 2 t4 (+1).
  __nv_bfloat16* d = p.d + blockIdx.y * p.d_g;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int n = k.n0 + 8 * j + 2 * k.t4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = h == 0 ? k.r0 : k.r1;
      if (r >= rows || n >= p.N) continue;
      __nv_bfloat16* dst = d + static_cast<int64_t>(r) * p.ldd + n;
      if (n + 1 < p.N) {
        *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(k.acc[4 * j + 2 * h], k.acc[4 * j + 2 * h + 1]);
      } else {
        *dst = __float2bfloat16_rn(k.acc[4 * j + 2 * h]);
      }
    }
  }
#else
  __trap();  // built without sm_90a
#endif
}

template <int BN>
void launch_bn(const SmallMParams& p, int groups, cudaStream_t stream) {
  constexpr int smem = Smem<BN>::alloc;
  ensure_dynamic_smem(fp8_gemm_small_m_kernel<BN>, smem);
  const dim3 grid(static_cast<unsigned>((p.N + BN - 1) / BN), static_cast<unsigned>(groups));
  fp8_gemm_small_m_kernel<BN><<<grid, kThreads, smem, stream>>>(p);
  DEEPINFER_CHECK_LAUNCH("fp8_gemm_small_m_kernel");
}

// The widest tile whose CTAs (over all groups) still cover the SMs: the weights stream from every SM.
void launch(const SmallMParams& p, int groups, int num_sms, cudaStream_t stream) {
  const int64_t g = groups;
  if ((p.N + 127) / 128 * g >= num_sms) {
    launch_bn<128>(p, groups, stream);
  } else if ((p.N + 63) / 64 * g >= num_sms) {
    launch_bn<64>(p, groups, stream);
  } else {
    launch_bn<32>(p, groups, stream);
  }
}

}  // namespace

bool fp8_gemm_small_m_fits(const Fp8GemmParams& p) {
  return p.M >= 1 && p.M <= kRowsA && p.K % kBlockK == 0 && p.K > 0 && !p.accumulate && p.split_k <= 1 &&
         p.ldd % 2 == 0;
}

// The operands common to both layouts (group strides and masked_m zero).
static SmallMParams small_m_params(const void* a, const float* sfa, const void* b, const float* sfb, void* d, int M,
                                   int N, int K, int64_t lda, int64_t ldb, int64_t ldd, int64_t ld_sfb) {
  SmallMParams s{};
  s.a = static_cast<const uint8_t*>(a);
  s.sfa = sfa;
  s.b = static_cast<const uint8_t*>(b);
  s.sfb = sfb;
  s.d = static_cast<__nv_bfloat16*>(d);
  s.M = M;
  s.N = N;
  s.K = K;
  s.lda = lda;
  s.ldb = ldb;
  s.ldd = ldd;
  s.sfb_n = ld_sfb;
  return s;
}

void launch_fp8_gemm_nt_bf16_small_m(const Fp8GemmParams& p, cudaStream_t stream) {
  SmallMParams s = small_m_params(p.a, p.sfa, p.b, p.sfb, p.d, p.M, p.N, p.K, p.lda, p.ldb, p.ldd, p.ld_sfb);
  s.sfa_m = 1;
  s.sfa_k = p.ld_sfa;
  launch(s, 1, p.num_sms, stream);
}

bool grouped_fp8_gemm_small_m_fits(const GroupedFp8GemmParams& p) {
  return p.layout == GroupedLayout::kMasked && p.num_groups <= 65535 && p.M_total >= 1 && p.M_total <= kRowsA &&
         p.K % kBlockK == 0 && p.K > 0 && p.ldd % 2 == 0 && p.d_group_stride % 2 == 0;
}

void launch_grouped_fp8_gemm_nt_bf16_small_m(const GroupedFp8GemmParams& p, cudaStream_t stream) {
  SmallMParams s =
      small_m_params(p.a, p.sfa, p.b, p.sfb, p.d, p.M_total, p.N, p.K, p.lda, p.ldb, p.ldd, p.ld_sfb);
  s.masked_m = p.masked_m;
  s.a_g = p.a_group_stride;
  s.sfa_m = p.sfa_row_stride;
  s.sfa_k = p.sfa_k_stride;
  s.sfa_g = p.sfa_group_stride;
  s.b_g = p.b_group_stride;
  s.sfb_g = p.sfb_group_stride;
  s.d_g = p.d_group_stride;
  launch(s, p.num_groups, p.num_sms, stream);
}

}  // namespace deepinfer::gemm
