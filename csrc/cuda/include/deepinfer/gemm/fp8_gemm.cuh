// FP8 block-scaled GEMM family (sm90a, CUTLASS 3.x collectives): params structs and launch declarations.
// No torch and no CUTLASS here: the torch-facing entry points (csrc/cuda/gemm/gemm_ops.cpp) fill these structs and
// the CUTLASS instantiations (csrc/cuda/gemm/instantiations/*.cu) consume them.
//
// Recipe (DeepSeek-V3/V4, DeepGEMM):
//   D[m, n] = sum_kb sfa[m, kb] * sfb[n / 128, kb] * sum_{k in block kb} A[m, k] * B[n, k]
// with the inner sums accumulated in fp32 and promoted (scaled) once per 128-wide K block. K and N need not be
// multiples of 128: the last blocks are partial (TMA zero-fills out-of-bounds A/B elements); scale tensors hold
// ceil(K/128) and ceil(N/128) blocks.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace deepinfer::gemm {

constexpr int kScaleBlock = 128;  // K and N granularity of the block scales

// Dense D[M, N] = A[M, K] . B[N, K]^T (block-scaled), optionally D += (fp32 out only).
struct Fp8GemmParams {
  const void* a;      // [M, K] float8_e4m3fn, row stride lda (elements, multiple of 16), 16-byte aligned
  const float* sfa;   // A scales, M-major: sfa[kb * ld_sfa + m], kb < ceil(K/128), m < round_up(M, 4) (the
                      // rows >= M are read but do not matter); ld_sfa % 4 == 0, ld_sfa >= round_up(M, 4),
                      // 16-byte aligned
  const void* b;      // [N, K] float8_e4m3fn, row stride ldb (multiple of 16), 16-byte aligned
  const float* sfb;   // B scales, K-major: sfb[nb * ld_sfb + kb], nb < ceil(N/128)
  void* d;            // [M, N] bf16 (or fp32), row stride ldd (multiple of 8 (bf16) / 4 (fp32))
  int M, N, K;
  int64_t lda, ldb, ldd;
  int ld_sfa, ld_sfb;
  bool accumulate;    // fp32 only: D = acc + D (D read as the source C, in place)
  int split_k;        // 1: data-parallel tiles (batch-invariant); > 1 (bf16 only): K split in that many parts,
                      // partial sums reduced in a fixed order (deterministic, but rounding differs from split_k = 1)
  int num_sms;        // SMs of the device (persistent grid size)
  int swizzle = 1;    // tile scheduler's max swizzle size (1, 2, 4, 8): the order tiles are visited in (L2 reuse),
                      // never the arithmetic
  void* workspace;    // >= fp8_gemm_nt_*_workspace_size bytes (may be null when that size is 0)
};

// bf16 out: tile 128x128 cooperative, or (_pingpong) tile 64x128 ping-pong for few output tiles (small M). Both
// compute every output element with the same operations in the same order: the same bits.
size_t fp8_gemm_nt_bf16_workspace_size(const Fp8GemmParams& p);
size_t fp8_gemm_nt_bf16_pingpong_workspace_size(const Fp8GemmParams& p);
size_t fp8_gemm_nt_fp32_workspace_size(const Fp8GemmParams& p);
void launch_fp8_gemm_nt_bf16(const Fp8GemmParams& p, cudaStream_t stream);
void launch_fp8_gemm_nt_bf16_pingpong(const Fp8GemmParams& p, cudaStream_t stream);
void launch_fp8_gemm_nt_fp32(const Fp8GemmParams& p, cudaStream_t stream);
size_t fp8_gemm_nt_bf16_splitk_workspace_size(const Fp8GemmParams& p);
void launch_fp8_gemm_nt_bf16_splitk(const Fp8GemmParams& p, cudaStream_t stream);

// Grouped GEMM over G groups sharing N and K; group g multiplies its rows of A by B[g] ([N, K]).
// The per-group problem sizes and pointers are derived on the device (no host sync) by a setup kernel,
// from m_indices (contiguous layout) or masked_m (masked layout), then one persistent CUTLASS
// ptr-array grouped kernel runs all groups.
//
// Scale layouts inside the kernel: CUTLASS 4.2's sm90 grouped blockwise mainloop ignores the layout_SFA /
// layout_SFB arguments and rebuilds both scale layouts from each group's problem shape (M_g, N, K)
// (Sm90BlockwiseScaleConfig::tile_atom_to_shape_SFA/SFB): group g's A scales must be a compact M-major
// [ceil(K/128), M_g] block (kb stride M_g) and its B scales a compact K-major [ceil(N/128), ceil(K/128)] block.
// So the launcher first packs the caller's A scales (any strides) per group into such blocks in the workspace;
// the B scales must already be compact per group (ld_sfb == ceil(K/128); the torch entry point ensures it).
enum class GroupedLayout : int { kContiguous = 0, kMasked = 1 };

struct GroupedFp8GemmParams {
  GroupedLayout layout;
  int num_groups;       // G
  int N, K;
  // contiguous: A [M_total, K]; group g = the rows r with m_indices[r] == g, which must be one contiguous run
  //             (rows outside every run, e.g. m_indices == -1, are not read and their D rows are not written).
  // masked:     A [G, max_m, K]; group g = rows [0, min(masked_m[g], max_m)) of A[g].
  const void* a;        // float8_e4m3fn, row stride lda, group stride a_group_stride (masked), elements
  const float* sfa;     // A scales, any strides (elements): contiguous [M_total, kb]: sfa[r * sfa_row_stride +
                        // kb * sfa_k_stride]; masked [G, max_m, kb]: sfa[g * sfa_group_stride + m * sfa_row_stride +
                        // kb * sfa_k_stride]. Read once by the packing kernel (never by CUTLASS).
  const void* b;        // [G, N, K] float8_e4m3fn, row stride ldb, group stride b_group_stride
  const float* sfb;     // [G, ceil(N/128), ceil(K/128)] fp32, sfb[g * sfb_group_stride + nb * ld_sfb + kb];
                        // ld_sfb must equal ceil(K/128) when ceil(N/128) > 1 (compact per group, see above)
  void* d;              // bf16; contiguous [M_total, N], masked [G, max_m, N]; row stride ldd,
                        // group stride d_group_stride
  const int32_t* m_indices;  // contiguous: [M_total] group of each row (-1 = padding); else null
  const int32_t* masked_m;   // masked: [G] valid rows per group; else null
  int M_total;          // contiguous: rows of A; masked: max_m
  int64_t lda, ldb, ldd, a_group_stride, b_group_stride, d_group_stride;
  int64_t sfa_row_stride, sfa_k_stride, sfa_group_stride;
  int ld_sfb;
  int64_t sfb_group_stride;
  int num_sms;
  bool raster_along_n;  // tile order within a group: along N (an M row of tiles at a time: B stays in L2) or along
                        // M; visiting order only, never the arithmetic
  void* workspace;      // >= grouped_fp8_gemm_nt_bf16_workspace_size(...) bytes, 256-byte aligned
};

// Workspace bytes: per-group argument arrays, the packed A scales (sfa_rows * ceil(K/128) floats, where sfa_rows =
// M_total (contiguous) or G * max_m (masked)) and CUTLASS's own workspace.
// Two configurations with the same bits: tile 128x128 cooperative, or (_pingpong) tile 64x128 ping-pong for groups
// of few rows.
size_t grouped_fp8_gemm_nt_bf16_workspace_size(int num_groups, int64_t sfa_rows, int K, int num_sms);
size_t grouped_fp8_gemm_nt_bf16_pingpong_workspace_size(int num_groups, int64_t sfa_rows, int K, int num_sms);
void launch_grouped_fp8_gemm_nt_bf16(const GroupedFp8GemmParams& p, cudaStream_t stream);
void launch_grouped_fp8_gemm_nt_bf16_pingpong(const GroupedFp8GemmParams& p, cudaStream_t stream);

}  // namespace deepinfer::gemm
