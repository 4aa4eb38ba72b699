// FP8 block-scaled GEMM for few rows (M <= 64, K % 128 == 0, bf16 out), sm90a: the recipe of fp8_gemm.cuh.
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

template <int BN>
struct SmallM {
  const Fp8GemmParams& p;
  uint32_t base;  // shared address of stage 0
  int n0, r0, r1, t4;
  float acc[BN / 2];

  // Block kb's A and B tiles into stage kb % kStages (zero-filled rows past M / N).
  __device__ __forceinline__ void load(int kb) const {
    const uint32_t st = base + (kb % kStages) * Smem<BN>::stage;
    const uint8_t* a = static_cast<const uint8_t*>(p.a);
    const uint8_t* b = static_cast<const uint8_t*>(p.b);
    for (int i = threadIdx.x; i < kRowsA * 8; i += kThreads) {
      const int r = i / 8, c = i % 8;
      const bool ok = r < p.M;
      cp_async_16_zfill(st + swizzled(r, c), ok ? a + r * p.lda + kb * kBlockK + c * 16 : a, ok ? 16u : 0u);
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
    const float sb = p.sfb[static_cast<int64_t>(n0 / kScaleBlock) * p.ld_sfb + kb];
    const float* sa = p.sfa + static_cast<int64_t>(kb) * p.ld_sfa;
    const float s0 = r0 < p.M ? sa[r0] * sb : 0.f, s1 = r1 < p.M ? sa[r1] * sb : 0.f;
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
    fence_proxy_async_shared();
    __syncthreads();  // everyone's copies of block kb
    fence_proxy_async_shared();
    if (kb + kStages - 1 < num_kb) load(kb + kStages - 1);
    cp_async_commit();
    issue(kb, blk);
    cute::warpgroup_wait<0>();
    promote(kb, blk);
  }
};

template <int BN>
__global__ void __launch_bounds__(kThreads) fp8_gemm_small_m_kernel(const __grid_constant__ Fp8GemmParams p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  SmallM<BN> k{p, base, static_cast<int>(blockIdx.x) * BN, warp * 16 + lane / 4, warp * 16 + lane / 4 + 8, lane % 4};
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) k.acc[i] = 0.f;
  const int num_kb = p.K / kBlockK;
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_kb) k.load(s);
    cp_async_commit();
  }
  float blk[BN / 2];
#pragma unroll 1
  for (int kb = 0; kb < num_kb; ++kb) k.step(kb, num_kb, blk);
  // D = bf16(acc): rows r0, r1; columns n0 + 8 j + 2 t4 (+1).
  __nv_bfloat16* d = static_cast<__nv_bfloat16*>(p.d);
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int n = k.n0 + 8 * j + 2 * k.t4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = h == 0 ? k.r0 : k.r1;
      if (r >= p.M || n >= p.N) continue;
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
void launch_bn(const Fp8GemmParams& p, cudaStream_t stream) {
  constexpr int smem = Smem<BN>::alloc;
  ensure_dynamic_smem(fp8_gemm_small_m_kernel<BN>, smem);
  const unsigned grid = static_cast<unsigned>((p.N + BN - 1) / BN);
  fp8_gemm_small_m_kernel<BN><<<grid, kThreads, smem, stream>>>(p);
  DEEPINFER_CHECK_LAUNCH("fp8_gemm_small_m_kernel");
}

}  // namespace

bool fp8_gemm_small_m_fits(const Fp8GemmParams& p) {
  return p.M >= 1 && p.M <= kRowsA && p.K % kBlockK == 0 && p.K > 0 && !p.accumulate && p.split_k <= 1 &&
         p.ldd % 2 == 0;
}

void launch_fp8_gemm_nt_bf16_small_m(const Fp8GemmParams& p, cudaStream_t stream) {
  // The widest tile whose CTAs still cover the SMs (weights stream from every SM).
  if ((p.N + 127) / 128 >= p.num_sms) {
    launch_bn<128>(p, stream);
  } else if ((p.N + 63) / 64 >= p.num_sms) {
    launch_bn<64>(p, stream);
  } else {
    launch_bn<32>(p, stream);
  }
}

}  // namespace deepinfer::gemm
