// CUTLASS 3.x configurations of the FP8 block-scaled GEMM family for sm90a (internal: included only by the
// instantiation TUs under instantiations/, one configuration per TU; never by a file that includes torch).
//
// Mainloop: CUTLASS's warp-specialized TMA + wgmma mainloop with blockwise scaling ("FP8 block-scaled accum"):
// each 128-deep K block is accumulated by wgmma, then promoted into an fp32 accumulator after multiplying by
// sfa[m, kb] * sfb[nb, kb]. Scale granularity (M, N, K) = (1, 128, 128); SFA M-major, SFB K-major.
// Default: tiles 128x128x128, cooperative (two consumer warpgroups), cluster 1x1, persistent tile scheduler
// (data-parallel tiles: no split-K, so results are deterministic and independent of M). For few output tiles
// (small M): tiles 64x128x128, ping-pong. Both give every output element the same operations in the same order
// (wgmma over each 128-deep K block, then one promotion), so the same bits (H200: checked at 20 shapes against
// the other configurations below; clusters 2x1 / 1x2 were slower or no faster and are not built). An opt-in split-K
// variant (StreamKScheduler forced to SplitK, deterministic turnstile reduction) changes the bits.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/dispatch_policy.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/numeric_types.h>

#include <climits>
#include <type_traits>
#include <stdexcept>
#include <string>

#include "deepinfer/common.cuh"
#include "deepinfer/gemm/fp8_gemm.cuh"

namespace deepinfer::gemm::cutlass_impl {

using namespace cute;

using ElementAB = cutlass::float_e4m3_t;
using LayoutA = cutlass::layout::RowMajor;     // A [M, K], K contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // B [N, K], K contiguous ("NT")
using LayoutD = cutlass::layout::RowMajor;     // D [M, N], N contiguous
constexpr int kAlignAB = 16;
using ArchTag = cutlass::arch::Sm90;
using OpClass = cutlass::arch::OpClassTensorOp;
using TileShape = Shape<_128, _128, _128>;
using TileShapeSmallM = Shape<_64, _128, _128>;  // the ping-pong configurations (few output tiles / rows per group)
using ClusterShape = Shape<_1, _1, _1>;
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleBlock, kScaleBlock, cute::GMMA::Major::MN,
                                                              cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

inline void cutlass_check(cutlass::Status s, const char* what) {
  if (s != cutlass::Status::kSuccess) {
    throw std::runtime_error(std::string("deepinfer CUTLASS error in ") + what + ": " + cutlassGetStatusString(s));
  }
}

// SFA layout for an M-major [ceil(K/128), ld] buffer holding rows [0, M).
CUTE_HOST_DEVICE LayoutSFA make_layout_sfa(int M, int K, int ld) {
  const int kb = (K + kScaleBlock - 1) / kScaleBlock;
  return make_layout(make_shape(make_shape(Int<1>{}, M), make_shape(Int<kScaleBlock>{}, kb), 1),
                     make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, ld), ld * kb));
}
// SFB layout for a K-major [ceil(N/128), ld] buffer.
CUTE_HOST_DEVICE LayoutSFB make_layout_sfb(int N, int K, int ld) {
  const int nb = (N + kScaleBlock - 1) / kScaleBlock;
  const int kb = (K + kScaleBlock - 1) / kScaleBlock;
  return make_layout(make_shape(make_shape(Int<kScaleBlock>{}, nb), make_shape(Int<kScaleBlock>{}, kb), 1),
                     make_stride(make_stride(_0{}, ld), make_stride(_0{}, _1{}), ld * nb));
}

// ---------------------------------------------------------------------------------------------------------------
// Dense
// ---------------------------------------------------------------------------------------------------------------
// Kernel schedules: cooperative (both consumer warpgroups on one tile, each 64 rows of it) or ping-pong (each
// consumer warpgroup on its own tile, one's epilogue / scale promotion overlapping the other's wgmma).
struct Cooperative {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8BlockScaledAccum;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
  using GroupedKernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum;
  using GroupedEpilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Pingpong {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8BlockScaledAccum;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
  using GroupedKernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8BlockScaledAccum;
  using GroupedEpilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

template <class ElementD_, bool kWithSource, class Scheduler = cutlass::gemm::PersistentScheduler,
          class Tile = TileShape, class Cluster = ClusterShape, class Schedule = Cooperative>
struct DenseConfig {
  static constexpr bool kSplitK = std::is_same_v<Scheduler, cutlass::gemm::StreamKScheduler>;
  using ElementD = ElementD_;
  using ElementC = std::conditional_t<kWithSource, ElementD, void>;
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      ArchTag, OpClass, Tile, Cluster, cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      ElementC, LayoutD, kAlignD, ElementD, LayoutD, kAlignD, typename Schedule::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      ArchTag, OpClass, ElementAB, cute::tuple<LayoutA, LayoutSFA>, kAlignAB, ElementAB,
      cute::tuple<LayoutB, LayoutSFB>, kAlignAB, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // The A scales are loaded with TMA: CUTLASS requires their layout's M extent to be a multiple of 4, so the layout
  // covers round_up(M, 4) rows (the caller's buffer holds them: ld_sfa >= that); rows >= M only meet A rows that
  // TMA zero-fills and D rows the epilogue does not store.
  static typename Gemm::Arguments make_args(const Fp8GemmParams& p) {
    using StrideA = typename Gemm::GemmKernel::StrideA;
    using StrideB = typename Gemm::GemmKernel::StrideB;
    using StrideC = typename Gemm::GemmKernel::StrideC;
    using StrideD = typename Gemm::GemmKernel::StrideD;
    StrideA sa{};
    get<0>(sa) = p.lda;
    StrideB sb{};
    get<0>(sb) = p.ldb;
    StrideC sc{};
    get<0>(sc) = p.ldd;
    StrideD sd{};
    get<0>(sd) = p.ldd;
    cutlass::KernelHardwareInfo hw{};
    hw.sm_count = p.num_sms;
    const ElementC* c_ptr = nullptr;
    if constexpr (kWithSource) c_ptr = static_cast<const ElementD*>(p.d);
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {p.M, p.N, p.K, 1},
        {static_cast<const ElementAB*>(p.a), sa, static_cast<const ElementAB*>(p.b), sb, p.sfa,
         make_layout_sfa((p.M + 3) / 4 * 4, p.K, p.ld_sfa), p.sfb, make_layout_sfb(p.N, p.K, p.ld_sfb)},
        {{}, c_ptr, sc, static_cast<ElementD*>(p.d), sd},
        hw};
    args.epilogue.thread.alpha = 1.f;
    args.epilogue.thread.beta = (kWithSource && p.accumulate) ? 1.f : 0.f;
    args.scheduler.max_swizzle_size = p.swizzle;
    if constexpr (kSplitK) {
      using Decomposition = typename Kernel::TileScheduler::DecompositionMode;
      using Reduction = typename Kernel::TileScheduler::ReductionMode;
      args.scheduler.splits = p.split_k;
      args.scheduler.decomposition_mode = Decomposition::SplitK;
      args.scheduler.reduction_mode = Reduction::Deterministic;
    }
    return args;
  }

  static size_t workspace_size(const Fp8GemmParams& p) { return Gemm::get_workspace_size(make_args(p)); }

  static void run(const Fp8GemmParams& p, cudaStream_t stream) {
    auto args = make_args(p);
    Gemm gemm;
    cutlass_check(gemm.can_implement(args), "fp8_gemm_nt can_implement");
    cutlass_check(gemm.initialize(args, p.workspace, stream), "fp8_gemm_nt initialize");
    cutlass_check(gemm.run(stream), "fp8_gemm_nt run");
    DEEPINFER_CHECK_LAUNCH("fp8_gemm_nt");
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Grouped (ptr-array): contiguous and masked layouts share one kernel; a setup kernel writes the per-group
// problem sizes, pointers, strides and scale layouts into the workspace, and a packing kernel copies each group's
// A scales into a compact M-major [ceil(K/128), M_g] block there: CUTLASS 4.2's grouped blockwise mainloop
// (sm90_mma_array_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp, load_init) ignores layout_SFA/SFB and
// derives the scale layouts from the group's (M_g, N, K), i.e. SFA kb-stride = M_g and SFB nb-stride = ceil(K/128).
// ---------------------------------------------------------------------------------------------------------------
template <class Tile = TileShape, class Cluster = ClusterShape, class Schedule = Cooperative>
struct GroupedConfig {
  using ElementD = cutlass::bfloat16_t;
  static constexpr int kAlignD = 8;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      ArchTag, OpClass, Tile, Cluster, cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD, typename Schedule::GroupedEpilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      ArchTag, OpClass, ElementAB, cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB, ElementAB,
      cute::tuple<LayoutB*, LayoutSFB*>, kAlignAB, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::GroupedKernel>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Gemm::GemmKernel::InternalStrideA;
  using StrideB = typename Gemm::GemmKernel::InternalStrideB;
  using StrideD = typename Gemm::GemmKernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;

  // Per-group arrays carved out of the workspace (each 256-byte aligned), followed by CUTLASS's own workspace.
  struct Arrays {
    Shape3* problem;
    const ElementAB** ptr_a;
    const ElementAB** ptr_b;
    const float** ptr_sfa;
    const float** ptr_sfb;
    ElementD** ptr_d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideD* stride_d;
    LayoutSFA* layout_sfa;
    LayoutSFB* layout_sfb;
    int* row0;          // contiguous: first row of each group in A / D
    float* sfa_packed;  // per-group compact A scales (group g at ptr_sfa[g])
    void* cutlass_workspace;
    size_t bytes;  // total of the arrays (without CUTLASS's workspace)
  };

  static size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

  static Arrays carve(void* base, int G, size_t sfa_floats) {
    Arrays a{};
    char* p = static_cast<char*>(base);
    size_t off = 0;
    auto take = [&](size_t bytes) {
      char* r = p ? p + off : nullptr;
      off += align_up(bytes);
      return r;
    };
    a.problem = reinterpret_cast<Shape3*>(take(sizeof(Shape3) * G));
    a.ptr_a = reinterpret_cast<const ElementAB**>(take(sizeof(void*) * G));
    a.ptr_b = reinterpret_cast<const ElementAB**>(take(sizeof(void*) * G));
    a.ptr_sfa = reinterpret_cast<const float**>(take(sizeof(void*) * G));
    a.ptr_sfb = reinterpret_cast<const float**>(take(sizeof(void*) * G));
    a.ptr_d = reinterpret_cast<ElementD**>(take(sizeof(void*) * G));
    a.stride_a = reinterpret_cast<StrideA*>(take(sizeof(StrideA) * G));
    a.stride_b = reinterpret_cast<StrideB*>(take(sizeof(StrideB) * G));
    a.stride_d = reinterpret_cast<StrideD*>(take(sizeof(StrideD) * G));
    a.layout_sfa = reinterpret_cast<LayoutSFA*>(take(sizeof(LayoutSFA) * G));
    a.layout_sfb = reinterpret_cast<LayoutSFB*>(take(sizeof(LayoutSFB) * G));
    a.row0 = reinterpret_cast<int*>(take(sizeof(int) * G));
    a.sfa_packed = reinterpret_cast<float*>(take(sizeof(float) * sfa_floats));
    a.cutlass_workspace = p ? p + off : nullptr;
    a.bytes = off;
    return a;
  }

  static typename Gemm::Arguments make_args(const Arrays& arr, int G, int num_sms, bool raster_along_n = false) {
    cutlass::KernelHardwareInfo hw{};
    hw.sm_count = num_sms;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {G, arr.problem, nullptr},  // problem sizes live on the device only
        {arr.ptr_a, arr.stride_a, arr.ptr_b, arr.stride_b, arr.ptr_sfa, arr.layout_sfa, arr.ptr_sfb, arr.layout_sfb},
        {{}, nullptr, nullptr, arr.ptr_d, arr.stride_d},
        hw};
    args.epilogue.thread.alpha = 1.f;
    args.epilogue.thread.beta = 0.f;
    using Raster = typename Kernel::TileScheduler::RasterOrderOptions;
    args.scheduler.raster_order = raster_along_n ? Raster::AlongN : Raster::AlongM;
    return args;
  }

  static size_t workspace_size(int G, size_t sfa_floats, int num_sms) {
    Arrays arr = carve(nullptr, G, sfa_floats);
    return arr.bytes + align_up(Gemm::get_workspace_size(make_args(arr, G, num_sms)));
  }
};

}  // namespace deepinfer::gemm::cutlass_impl
