// topk_rows on CUDA, one CTA per row, for rows whose keys fit in shared memory (n <= 32768): one launch, no
// workspace, one read of the scores.
//   1. The row's order-preserving keys (topk_common.cuh) go to shared memory, several 16-byte loads in flight per
//      thread.
//   2. Radix select from the top, 8 bits a pass (four passes at most): a shared 256-bin histogram of the keys under
//      the digits fixed so far (lanes with the same bin add once), then one warp finds the digit holding the rank
//      still wanted. It stops early when every key in that digit's bin is selected.
//   3. The k entries (key << 32 | ~index) are collected in shared memory: keys above the k-th largest in any order;
//      when only some of the keys equal to it are selected, the lowest-index ones, found by an index-ordered block
//      scan over contiguous per-thread ranges.
//   4. Bitonic sort (key desc, index asc), then values = scores[index] (the scores' own bits) and indices.
// The selected set and its order are those of the tie rule, so the result equals topk.cu's other paths.
#include "topk_common.cuh"

namespace deepinfer::attention::topk_detail {
namespace {

constexpr int kRowMaxN = 32768;
constexpr int kRowMaxK = 2048;
constexpr int kNarrowMaxN = 2048;      // rows up to this length use 256 threads (the router: n = 256)
constexpr int64_t kMaxGrid = 1 << 30;  // rows per launch

// Entries of the sort buffer: the power of two at or above k, at least 2 (the keys after it stay 16-byte aligned).
__host__ __device__ inline int sort_size(int k) {
  int s = 2;
  while (s < k) s <<= 1;
  return s;
}

size_t row_cta_smem(int n, int k) {
  return static_cast<size_t>(sort_size(k)) * sizeof(uint64_t) + static_cast<size_t>(n) * sizeof(uint32_t);
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads) topk_row_cta_kernel(const __grid_constant__ TopkRows r) {
  constexpr int kWarps = kThreads / 32;
  extern __shared__ __align__(16) char dyn[];
  const int n = r.n, k = r.k, npow2 = sort_size(k);
  uint64_t* sel = reinterpret_cast<uint64_t*>(dyn);           // [npow2]
  uint32_t* keys = reinterpret_cast<uint32_t*>(sel + npow2);  // [n]
  __shared__ int hist[2][256];  // alternate passes: one is cleared while the other fills
  __shared__ int s_warp[kWarps];
  __shared__ uint32_t s_prefix;
  __shared__ int s_rem, s_bin, s_count;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t row = r.row0 + blockIdx.x;
  const float* srow = r.scores + row * r.score_row_stride;

  // 1. Keys into shared memory.
  if (r.vec) {
    const float4* s4 = reinterpret_cast<const float4*>(srow);
    uint4* k4 = reinterpret_cast<uint4*>(keys);
    const int n4 = n >> 2;
    for (int base = 0; base < n4; base += 4 * kThreads) {
      float4 v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int q = base + j * kThreads + tid;
        v[j] = q < n4 ? __ldg(s4 + q) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int q = base + j * kThreads + tid;
        if (q < n4) k4[q] = make_uint4(topk_key(v[j].x), topk_key(v[j].y), topk_key(v[j].z), topk_key(v[j].w));
      }
    }
    for (int i = 4 * n4 + tid; i < n; i += kThreads) keys[i] = topk_key(__ldg(srow + i));
  } else {
    for (int base = 0; base < n; base += 8 * kThreads) {
      float v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int i = base + j * kThreads + tid;
        v[j] = i < n ? __ldg(srow + i) : 0.f;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int i = base + j * kThreads + tid;
        if (i < n) keys[i] = topk_key(v[j]);
      }
    }
  }
  for (int i = tid; i < npow2; i += kThreads) sel[i] = 0ull;  // padding sorts last (every entry is > 0)
  for (int i = tid; i < 256; i += kThreads) hist[0][i] = 0;
  if (tid == 0) s_count = 0;
  __syncthreads();

  // 2. Radix select: prefix / mask = the digits fixed so far, rem = the rank of the k-th largest key among the keys
  // under the prefix.
  uint32_t prefix = 0u, mask = 0u;
  int rem = k;
  bool take_all = false;  // every key under the prefix is selected
#pragma unroll 1
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    int* h = hist[pass & 1];
    for (int i = tid; i < 256; i += kThreads) hist[(pass + 1) & 1][i] = 0;  // read two barriers ago
    for (int base = 0; base < n; base += kThreads) {  // the same trip count in every thread (warp collectives)
      const int i = base + tid;
      const uint32_t key = i < n ? keys[i] : 0u;
      const bool take = i < n && (key & mask) == prefix;
      const unsigned active = __ballot_sync(0xffffffffu, take);
      if (take) {
        const uint32_t bin = (key >> shift) & 255u;
        const unsigned peers = __match_any_sync(active, bin);
        if (__ffs(peers) - 1 == lane) atomicAdd(&h[bin], __popc(peers));
      }
    }
    __syncthreads();
    if (warp == 0) {  // lane l owns bins 255 - 8 l .. 248 - 8 l, from the top down
      int c[8], local = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c[j] = h[255 - 8 * lane - j];
        local += c[j];
      }
      const int incl = warp_inclusive_scan(local, lane), excl = incl - local;
      if (excl < rem && rem <= incl) {  // one lane
        int cum = excl;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (cum + c[j] >= rem) {
            s_prefix = prefix | (static_cast<uint32_t>(255 - 8 * lane - j) << shift);
            s_rem = rem - cum;
            s_bin = c[j];
            break;
          }
          cum += c[j];
        }
      }
    }
    __syncthreads();
    prefix = s_prefix;
    rem = s_rem;
    mask |= 255u << shift;
    if (s_bin == rem) {  // uniform
      take_all = true;
      break;
    }
  }

  // 3. Collect the k entries.
  for (int base = 0; base < n; base += kThreads) {
    const int i = base + tid;
    const uint32_t key = i < n ? keys[i] : 0u;
    const uint32_t top = key & mask;
    const bool take = i < n && (take_all ? top >= prefix : top > prefix);
    warp_append(take, sel_entry(key, i), &s_count, sel, k, lane);
  }
  if (!take_all) {  // mask is whole: prefix is the k-th largest key; the rem lowest-index keys equal to it
    const int per = (n + kThreads - 1) / kThreads;
    const int c0 = min(n, tid * per), c1 = min(n, c0 + per);
    int eq = 0;
    for (int i = c0; i < c1; ++i) eq += keys[i] == prefix ? 1 : 0;
    int total;
    int rank = block_exclusive_scan<kWarps>(eq, s_warp, total);
    for (int i = c0; i < c1 && rank < rem; ++i) {
      if (keys[i] == prefix) {
        sel[k - rem + rank] = sel_entry(prefix, i);
        ++rank;
      }
    }
  }

  // 4. Sort and write.
  bitonic_sort_desc<kThreads>(sel, npow2);
  float* vrow = r.values + row * k;
  int64_t* irow = r.indices + row * k;
  for (int j = tid; j < k; j += kThreads) {
    const int idx = static_cast<int>(~static_cast<uint32_t>(sel[j]));
    vrow[j] = srow[idx];
    irow[j] = idx;
  }
}

template <int kThreads>
void launch_rows(const TopkParams& p, size_t smem, cudaStream_t stream) {
  ensure_dynamic_smem(topk_row_cta_kernel<kThreads>, smem);
  TopkRows r = topk_rows_of(p);
  for (int64_t row0 = 0; row0 < p.rows; row0 += kMaxGrid) {
    r.row0 = row0;
    const int64_t g = p.rows - row0 < kMaxGrid ? p.rows - row0 : kMaxGrid;
    topk_row_cta_kernel<kThreads><<<static_cast<unsigned>(g), kThreads, smem, stream>>>(r);
    DEEPINFER_CHECK_LAUNCH("topk_row_cta_kernel");
  }
}

}  // namespace

bool topk_row_cta_fits(const TopkParams& p) {
  if (p.n > kRowMaxN || p.k > kRowMaxK || p.k < 1) return false;
  int device = 0, optin = 0;
  DEEPINFER_CUDA_CHECK(cudaGetDevice(&device));
  DEEPINFER_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  constexpr size_t kStaticSmem = 8 * 1024;  // the kernel's own arrays, with room to spare
  return row_cta_smem(p.n, p.k) + kStaticSmem <= static_cast<size_t>(optin);
}

void launch_topk_row_cta(const TopkParams& p, cudaStream_t stream) {
  const size_t smem = row_cta_smem(p.n, p.k);
  if (p.n <= kNarrowMaxN) {
    launch_rows<256>(p, smem, stream);
  } else {
    launch_rows<1024>(p, smem, stream);
  }
}

}  // namespace deepinfer::attention::topk_detail
