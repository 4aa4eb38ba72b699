// moe_permute: a stable counting sort of the (token, slot) pairs by expert in one CTA (see moe_permute.cuh).
#include "deepinfer/moe/moe_permute.cuh"

namespace deepinfer::moe {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr size_t kSmemBudget = 200 * 1024;

__device__ __forceinline__ int64_t load_idx(const MoePermuteParams& p, int64_t i) {
  return p.idx_int64 ? static_cast<const int64_t*>(p.topk_idx)[i]
                     : static_cast<int64_t>(static_cast<const int32_t*>(p.topk_idx)[i]);
}

// Bin 0 = padding (ids outside [0, E)), bin e + 1 = expert e.
__device__ __forceinline__ int bin_of(const MoePermuteParams& p, int64_t i) {
  const int64_t e = load_idx(p, i);
  return e >= 0 && e < p.num_experts ? static_cast<int>(e) + 1 : 0;
}

// W segments of consecutive rows, one warp each (W <= 32 warps; the other warps only help with the scans).
// next[w][b]: first sorted position of bin b's rows of segment w (a stable counting sort: bins in order, and
// within a bin segments in order, rows in order).
__global__ void __launch_bounds__(kThreads) moe_permute_kernel(const MoePermuteParams p, int segments) {
  extern __shared__ int32_t smem[];  // positions < rows < 2^31
  const int bins = static_cast<int>(p.num_experts) + 1;
  int32_t* next = smem;                                          // [segments][bins]
  int32_t* total = smem + static_cast<int64_t>(segments) * bins;  // [bins]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t seg_len = (p.rows + segments - 1) / segments;
  const unsigned lt_mask = (1u << lane) - 1u;

  for (int64_t v = tid; v < static_cast<int64_t>(segments) * bins; v += kThreads) next[v] = 0;
  __syncthreads();
  // 1. Per-segment counts (each segment's warp alone writes its row of next).
  if (warp < segments) {
    const int64_t lo = warp * seg_len, hi = min(p.rows, lo + seg_len);
    for (int64_t base = lo; base < hi; base += 32) {
      const int64_t i = base + lane;
      const int b = i < hi ? bin_of(p, i) : -1;
      const unsigned peers = __match_any_sync(0xffffffffu, b);
      if (b >= 0 && (peers & lt_mask) == 0) next[static_cast<int64_t>(warp) * bins + b] += __popc(peers);
      __syncwarp();
    }
  }
  __syncthreads();
  // 2. Within each bin, segments in order: next[w][b] = rows of bin b in segments < w; total[b] = all of them.
  for (int b = tid; b < bins; b += kThreads) {
    int32_t run = 0;
    for (int w = 0; w < segments; ++w) {
      const int32_t c = next[static_cast<int64_t>(w) * bins + b];
      next[static_cast<int64_t>(w) * bins + b] = run;
      run += c;
    }
    total[b] = run;
  }
  __syncthreads();
  // 3. Exclusive scan of the bin totals (warp 0, 32 bins at a time, in order).
  if (warp == 0) {
    int32_t carry = 0;
    for (int base = 0; base < bins; base += 32) {
      const int b = base + lane;
      const int32_t c = b < bins ? total[b] : 0;
      int32_t incl = c;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int32_t up = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += up;
      }
      if (b < bins) total[b] = carry + incl - c;
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
  }
  __syncthreads();
  for (int64_t v = tid; v < static_cast<int64_t>(segments) * bins; v += kThreads) next[v] += total[v % bins];
  __syncthreads();
  // 4. Placement, each segment's rows in order by its warp.
  if (warp < segments) {
    const int64_t lo = warp * seg_len, hi = min(p.rows, lo + seg_len);
    int32_t* my = next + static_cast<int64_t>(warp) * bins;
    for (int64_t base = lo; base < hi; base += 32) {
      const int64_t i = base + lane;
      const int b = i < hi ? bin_of(p, i) : -1;
      const unsigned peers = __match_any_sync(0xffffffffu, b);
      const int32_t start = b >= 0 ? my[b] : 0;
      __syncwarp();
      if (b >= 0) {
        const int32_t pos = start + __popc(peers & lt_mask);
        p.m_indices[pos] = b - 1;
        p.token_of_row[pos] = i / p.top_k;
        p.slot_rows[i] = b == 0 ? -1 : pos;
        if ((peers & lt_mask) == 0) my[b] = start + __popc(peers);
      }
      __syncwarp();
    }
  }
}

}  // namespace

void launch_moe_permute(const MoePermuteParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  const int64_t bins = p.num_experts + 1;
  // As many segments (parallel warps in the placement) as the shared memory holds counters for, up to 32.
  const int64_t fit = static_cast<int64_t>(kSmemBudget / sizeof(int32_t)) / bins - 1;
  const int segments = static_cast<int>(fit < 1 ? 1 : (fit > kWarps ? kWarps : fit));
  const size_t smem = sizeof(int32_t) * static_cast<size_t>((segments + 1) * bins);
  if (smem > 48 * 1024) {  // the default limit covers the usual expert counts (256 experts, 32 segments: 34 KB)
    ensure_dynamic_smem(moe_permute_kernel, smem);
  }
  moe_permute_kernel<<<1, kThreads, smem, stream>>>(p, segments);
  DEEPINFER_CHECK_LAUNCH("moe_permute");
}

}  // namespace deepinfer::moe
