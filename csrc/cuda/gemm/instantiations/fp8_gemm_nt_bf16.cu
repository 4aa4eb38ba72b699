// Dense FP8 block-scaled GEMM, bf16 output (no source): tile 128x128x128, cooperative, persistent.
#include "../fp8_gemm_cutlass.cuh"

namespace deepinfer::gemm {
using Cfg = cutlass_impl::DenseConfig<cutlass::bfloat16_t, false>;
size_t fp8_gemm_nt_bf16_workspace_size(const Fp8GemmParams& p) { return Cfg::workspace_size(p); }
void launch_fp8_gemm_nt_bf16(const Fp8GemmParams& p, cudaStream_t stream) { Cfg::run(p, stream); }
}  // namespace deepinfer::gemm
