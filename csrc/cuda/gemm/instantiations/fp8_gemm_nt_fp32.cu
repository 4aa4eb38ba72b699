// Dense FP8 block-scaled GEMM, fp32 output with optional in-place accumulation (D = acc + D):
// tile 128x128x128, cooperative, persistent.
#include "../fp8_gemm_cutlass.cuh"

namespace deepinfer::gemm {
using Cfg = cutlass_impl::DenseConfig<float, true>;
size_t fp8_gemm_nt_fp32_workspace_size(const Fp8GemmParams& p) { return Cfg::workspace_size(p); }
void launch_fp8_gemm_nt_fp32(const Fp8GemmParams& p, cudaStream_t stream) { Cfg::run(p, stream); }
}  // namespace deepinfer::gemm
