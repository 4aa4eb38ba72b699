// topk_rows on CUDA where keys fit in shared memory: one read of the scores, at most two launches.
//   * n <= 1024 and k <= 32 (the router): one warp per row, the scores in registers (topk_warp_kernel).
//   * n <= 32768: one CTA per row (select, sort, write).
//   * longer rows (n up to 32 chunks of 8192-32768): one CTA per chunk of a row writes the chunk's own top k
//     (unsorted) to the workspace; then one CTA per row selects the top k of those candidates, sorts and writes.
//     Every element of the row's top k is in its chunk's top k, so the result is exact.
// A select (select_top): the keys go to shared memory (chunk CTAs: the order-preserving 32-bit image of each score,
// topk_common.cuh; the merge CTA: the candidates' 64-bit entries key << 32 | ~index, all distinct). A radix select
// from the top, 8 bits a pass, finds the k-th largest: per pass a shared 256-bin histogram of the keys under the
// digits fixed so far (shared atomics, lanes of one bin aggregated), then one warp finds the digit holding the rank
// still wanted; it stops once every key in that digit's bin is selected. The selected keys are collected in shared
// memory: those above the k-th largest in any order; when only some keys equal to it are selected (ties of 32-bit
// keys), the lowest-index ones, by an index-ordered block scan over contiguous per-thread ranges. Then a bitonic
// sort (key desc, index asc) and values = scores[index] (the scores' own bits), indices.
// The selected set and its order follow the tie rule alone, so results equal topk.cu's other paths and do not
// depend on the chunking, the batch or the order of atomics.
#include "topk_common.cuh"

namespace deepinfer::attention::topk_detail {
namespace {

constexpr int kChunkMaxN = 32768;        // keys of one CTA (128 KiB of shared memory)
constexpr int kMinChunk = 8192;          // chunk lengths tried: 8192, 16384, 32768 (the first whose merge fits)
constexpr int kMergeMaxEntries = 16384;  // candidates of one row (128 KiB)
constexpr int kMaxK = 2048;
constexpr int kNarrowMaxN = 2048;        // rows up to this length use 256 threads (past the warp path's limits)
constexpr int kThreads = 1024;
constexpr int64_t kRowGroup = 256;       // rows per workspace pass (chunked rows)
constexpr size_t kStaticSmem = 8 * 1024; // the kernels' own shared arrays, with room to spare

// Entries of the sort buffer: the power of two at or above k, at least 32 (whole warps in the sort).
__host__ __device__ inline int sort_size(int k) {
  int s = 32;
  while (s < k) s <<= 1;
  return s;
}

struct SelectSmem {
  int hist[2][256];  // alternate passes: one is cleared while the other fills
  int warp[32];
  unsigned long long prefix;
  int rem, bin, count;
};

// Exclusive prefix of v over the block in thread order, and the block's total. Ends with a barrier.
template <int kNumWarps>
__device__ __forceinline__ int block_exclusive_scan(int v, int* s_warp, int& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int incl = warp_inclusive_scan(v, lane);
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  int before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < kNumWarps; ++w) {
    const int c = s_warp[w];
    before += w < warp ? c : 0;
    total += c;
  }
  __syncthreads();
  return before + incl - v;
}

// Radix select of the k-th largest of keys[0, m) (shared memory; 1 <= k <= m): on return prefix / mask are the
// digits fixed, rem the rank still wanted among the keys whose masked bits equal prefix, and take_all tells that
// all of those are selected (else mask is whole and prefix is the k-th largest key). Uniform across the block.
template <int kBlock, typename Key>
__device__ void radix_select(const Key* keys, int m, int k, SelectSmem& s, Key& prefix, Key& mask, int& rem,
                             bool& take_all) {
  constexpr int kPasses = sizeof(Key);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  prefix = 0;
  mask = 0;
  rem = k;
  take_all = false;
  for (int i = tid; i < 256; i += kBlock) s.hist[0][i] = 0;
  __syncthreads();
#pragma unroll 1
  for (int pass = 0; pass < kPasses; ++pass) {
    const int shift = 8 * (kPasses - 1 - pass);
    int* h = s.hist[pass & 1];
    for (int i = tid; i < 256; i += kBlock) s.hist[(pass + 1) & 1][i] = 0;  // read two barriers ago
    for (int base = 0; base < m; base += kBlock) {  // whole warps in every step (warp_hist_add)
      const int i = base + tid;
      const Key key = i < m ? keys[i] : Key(0);
      warp_hist_add(h, i < m && (key & mask) == prefix, static_cast<uint32_t>(key >> shift) & 255u, lane);
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
            s.prefix = static_cast<unsigned long long>(prefix | (static_cast<Key>(255 - 8 * lane - j) << shift));
            s.rem = rem - cum;
            s.bin = c[j];
            break;
          }
          cum += c[j];
        }
      }
    }
    __syncthreads();
    prefix = static_cast<Key>(s.prefix);
    rem = s.rem;
    mask |= static_cast<Key>(255) << shift;
    if (s.bin == rem) {  // uniform
      take_all = true;
      break;
    }
  }
}

// The k largest of keys[0, m) into sel[0, k) as 64-bit entries entry(key, i), any order (s.count zeroed and a
// barrier passed before the select). Ends with a barrier.
template <int kBlock, typename Key, class Entry>
__device__ void select_top(const Key* keys, int m, int k, SelectSmem& s, uint64_t* sel, Entry&& entry) {
  Key prefix, mask;
  int rem;
  bool take_all;
  radix_select<kBlock, Key>(keys, m, k, s, prefix, mask, rem, take_all);
  const int tid = threadIdx.x, lane = tid % 32;
  for (int base = 0; base < m; base += kBlock) {
    const int i = base + tid;
    const Key key = i < m ? keys[i] : Key(0);
    const Key top = key & mask;
    const bool take = i < m && (take_all ? top >= prefix : top > prefix);
    warp_append(take, entry(key, i), &s.count, sel, k, lane);
  }
  if (!take_all) {  // the rem lowest-index keys equal to prefix take slots [k - rem, k)
    const int per = (m + kBlock - 1) / kBlock;
    const int c0 = min(m, tid * per), c1 = min(m, c0 + per);
    int eq = 0;
    for (int i = c0; i < c1; ++i) eq += keys[i] == prefix ? 1 : 0;
    int total;
    int rank = block_exclusive_scan<kBlock / 32>(eq, s.warp, total);
    for (int i = c0; i < c1 && rank < rem; ++i) {
      if (keys[i] == prefix) {
        sel[k - rem + rank] = entry(prefix, i);
        ++rank;
      }
    }
  }
  __syncthreads();
}

// Descending bitonic sort of s[0, size) (size a power of two, 32 <= size <= kSortMax) by the whole block: thread
// t holds elements t + j kBlock in registers (kSortMax / kBlock of them: a launch that never sorts more than
// kBlock entries keeps one, and its registers); exchanges at strides below 32 are warp shuffles (each warp holds
// 32 consecutive elements), the others go through shared memory. Ends with a barrier.
template <int kBlock, int kSortMax>
__device__ void sort_desc(uint64_t* s, int size) {
  static_assert(kSortMax % kBlock == 0 && kSortMax <= kMaxK, "sort size");
  constexpr int kPer = kSortMax / kBlock;
  const int tid = threadIdx.x;
  uint64_t x[kPer];
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int e = tid + j * kBlock;
    x[j] = e < size ? s[e] : 0ull;
  }
  for (int run = 2; run <= size; run <<= 1) {
    for (int stride = run >> 1; stride > 0; stride >>= 1) {
      uint64_t y[kPer];
      if (stride >= 32) {  // uniform
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
          if (tid + j * kBlock < size) s[tid + j * kBlock] = x[j];
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
          const int e = tid + j * kBlock;
          y[j] = e < size ? s[e ^ stride] : 0ull;
        }
        __syncthreads();
      } else {
#pragma unroll
        for (int j = 0; j < kPer; ++j) y[j] = __shfl_xor_sync(0xffffffffu, x[j], stride);
      }
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int e = tid + j * kBlock;
        const bool want_max = ((e & stride) == 0) == ((e & run) == 0);  // the pair's lower element of a descending
        x[j] = want_max ? (x[j] > y[j] ? x[j] : y[j]) : (x[j] < y[j] ? x[j] : y[j]);  // run keeps the larger
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (tid + j * kBlock < size) s[tid + j * kBlock] = x[j];
  }
  __syncthreads();
}

// Sort sel[0, npow2) (entries past k are 0) and write the row's values and indices.
template <int kBlock, int kSortMax>
__device__ void sort_and_write(const TopkRows& r, int64_t row, uint64_t* sel, int npow2) {
  sort_desc<kBlock, kSortMax>(sel, npow2);
  const float* srow = r.scores + row * r.score_row_stride;
  float* vrow = r.values + row * r.k;
  int64_t* irow = r.indices + row * r.k;
  for (int j = threadIdx.x; j < r.k; j += kBlock) {
    const int idx = static_cast<int>(~static_cast<uint32_t>(sel[j]));
    vrow[j] = srow[idx];
    irow[j] = idx;
  }
}

// Keys of scores [c0, c0 + m) of a row into shared memory, several loads in flight per thread.
template <int kBlock>
__device__ void load_keys(const float* src, int m, bool vec, uint32_t* keys) {
  const int tid = threadIdx.x;
  if (vec) {
    const float4* s4 = reinterpret_cast<const float4*>(src);
    uint4* k4 = reinterpret_cast<uint4*>(keys);
    const int m4 = m >> 2;
    for (int base = 0; base < m4; base += 4 * kBlock) {
      float4 v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int q = base + j * kBlock + tid;
        v[j] = q < m4 ? __ldg(s4 + q) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int q = base + j * kBlock + tid;
        if (q < m4) k4[q] = make_uint4(topk_key(v[j].x), topk_key(v[j].y), topk_key(v[j].z), topk_key(v[j].w));
      }
    }
    for (int i = 4 * m4 + tid; i < m; i += kBlock) keys[i] = topk_key(__ldg(src + i));
  } else {
    for (int base = 0; base < m; base += 8 * kBlock) {
      float v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int i = base + j * kBlock + tid;
        v[j] = i < m ? __ldg(src + i) : 0.f;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int i = base + j * kBlock + tid;
        if (i < m) keys[i] = topk_key(v[j]);
      }
    }
  }
}

// Grid (rows of the group, chunks). kFinal (one chunk: the whole row): sort and write the row's result (sort_size(k)
// <= kSortMax); else the chunk's top min(k, its length) entries go to cand[g][chunk][0, k), zero-padded.
template <int kBlock, bool kFinal, int kSortMax = kMaxK>
__global__ void __launch_bounds__(kBlock) topk_chunk_kernel(const __grid_constant__ TopkRows r, int chunk,
                                                            uint64_t* cand) {
  extern __shared__ __align__(16) char dyn[];
  __shared__ SelectSmem s;
  const int npow2 = sort_size(r.k), cid = blockIdx.y;
  uint64_t* sel = reinterpret_cast<uint64_t*>(dyn);           // [npow2]
  uint32_t* keys = reinterpret_cast<uint32_t*>(sel + npow2);  // [chunk]
  const int64_t row = r.row0 + blockIdx.x;
  const int c0 = cid * chunk, m = min(r.n - c0, chunk), kk = min(r.k, m);
  load_keys<kBlock>(r.scores + row * r.score_row_stride + c0, m, r.vec, keys);  // chunk % 4 == 0: aligned too
  for (int i = threadIdx.x; i < npow2; i += kBlock) sel[i] = 0ull;  // padding sorts last (every entry is > 0)
  if (threadIdx.x == 0) s.count = 0;
  // (radix_select's first barrier orders these stores before any use)
  select_top<kBlock, uint32_t>(keys, m, kk, s, sel, [c0](uint32_t key, int i) { return sel_entry(key, c0 + i); });
  if constexpr (kFinal) {
    sort_and_write<kBlock, kSortMax>(r, row, sel, npow2);
  } else {
    uint64_t* out = cand + (static_cast<int64_t>(blockIdx.x) * gridDim.y + cid) * r.k;
    for (int j = threadIdx.x; j < r.k; j += kBlock) out[j] = sel[j];
  }
}

// One CTA per row of the group: the top k of the row's chunks * k candidates, sorted and written.
__global__ void __launch_bounds__(kThreads) topk_merge_kernel(const __grid_constant__ TopkRows r, int entries,
                                                              const uint64_t* cand) {
  extern __shared__ __align__(16) char dyn[];
  __shared__ SelectSmem s;
  const int npow2 = sort_size(r.k);
  uint64_t* sel = reinterpret_cast<uint64_t*>(dyn);  // [npow2]
  uint64_t* ent = sel + npow2;                       // [entries]
  const uint64_t* src = cand + static_cast<int64_t>(blockIdx.x) * entries;
  for (int i = threadIdx.x; i < entries; i += kThreads) ent[i] = __ldg(src + i);
  for (int i = threadIdx.x; i < npow2; i += kThreads) sel[i] = 0ull;
  if (threadIdx.x == 0) s.count = 0;
  select_top<kThreads, uint64_t>(ent, entries, r.k, s, sel, [](uint64_t e, int) { return e; });
  sort_and_write<kThreads, kMaxK>(r, r.row0 + blockIdx.x, sel, npow2);
}

// Short rows with a small k (the router: n = 256 experts, k = 6): one warp per row, the scores in registers (lane
// l holds scores j * 32 + l, j < kSlots). Each lane keeps its best entry not yet taken (key desc, index asc: the
// 64-bit sel_entry); each of the k rounds takes the warp's largest of those (a shuffle max, every entry distinct),
// and only the lane that gave it rescans its slots. Lane r keeps round r's value and index, so the row is written
// by one store per lane. No shared memory, no barrier, no atomics; a row's result depends on that row alone.
constexpr int kWarpMaxK = 32;
constexpr int kWarpMaxN = 1024;
constexpr int kWarpRows = 8;  // rows (warps) per CTA

template <int kSlots>
__device__ __forceinline__ void lane_best(const float (&v)[kSlots], uint32_t taken, int n, int lane, uint64_t& best,
                                          float& best_v) {
  best = 0;  // below every real entry (topk_key(-inf) > 0)
  best_v = 0.f;
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    const int idx = j * 32 + lane;
    const uint64_t e = sel_entry(topk_key(v[j]), idx);
    if (idx < n && !((taken >> j) & 1u) && e > best) {
      best = e;
      best_v = v[j];
    }
  }
}

template <int kSlots>
__global__ void __launch_bounds__(kWarpRows * 32) topk_warp_kernel(const __grid_constant__ TopkRows r,
                                                                     int64_t rows) {
  const int lane = threadIdx.x % 32;
  const int64_t row = r.row0 + static_cast<int64_t>(blockIdx.x) * kWarpRows + threadIdx.x / 32;
  if (row >= rows) return;  // the whole warp
  const float* src = r.scores + row * r.score_row_stride;
  float v[kSlots];
#pragma unroll
  for (int j = 0; j < kSlots; ++j) v[j] = j * 32 + lane < r.n ? src[j * 32 + lane] : 0.f;
  uint32_t taken = 0;
  uint64_t best;
  float best_v;
  lane_best(v, taken, r.n, lane, best, best_v);
  float out_v = 0.f;
  int out_i = 0;
#pragma unroll 1
  for (int round = 0; round < r.k; ++round) {
    uint64_t m = best;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const uint64_t o = __shfl_xor_sync(0xffffffffu, m, off);
      m = o > m ? o : m;
    }
    const int idx = static_cast<int>(~static_cast<uint32_t>(m));
    const int owner = idx % 32;
    const float val = __shfl_sync(0xffffffffu, best_v, owner);
    if (lane == round) {
      out_v = val;
      out_i = idx;
    }
    if (lane == owner) {
      taken |= 1u << (idx / 32);
      lane_best(v, taken, r.n, lane, best, best_v);
    }
  }
  if (lane < r.k) {
    r.values[row * r.k + lane] = out_v;
    r.indices[row * r.k + lane] = out_i;
  }
}

struct ChunkPlan {
  bool use;
  int chunk, chunks;
  int64_t group_rows;
  size_t chunk_smem, merge_smem;
  int64_t bytes;  // workspace
};

ChunkPlan make_chunk_plan(const TopkParams& p) {
  ChunkPlan c{};
  if (p.k < 1 || p.k > kMaxK || p.k > p.n) return c;
  int device = 0, optin = 0;
  DEEPINFER_CUDA_CHECK(cudaGetDevice(&device));
  DEEPINFER_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const size_t limit = static_cast<size_t>(optin) - kStaticSmem, sort_bytes = sort_size(p.k) * sizeof(uint64_t);
  if (p.n <= kChunkMaxN) {
    c.chunk = p.n;
    c.chunks = 1;
    c.chunk_smem = sort_bytes + static_cast<size_t>(p.n) * sizeof(uint32_t);
    c.use = c.chunk_smem <= limit;
    return c;
  }
  for (int chunk = kMinChunk; chunk <= kChunkMaxN; chunk *= 2) {
    const int chunks = (p.n + chunk - 1) / chunk;
    const int64_t entries = static_cast<int64_t>(chunks) * p.k;
    c.chunk_smem = sort_bytes + static_cast<size_t>(chunk) * sizeof(uint32_t);
    c.merge_smem = sort_bytes + static_cast<size_t>(entries) * sizeof(uint64_t);
    if (entries <= kMergeMaxEntries && c.chunk_smem <= limit && c.merge_smem <= limit) {
      c.use = true;
      c.chunk = chunk;
      c.chunks = chunks;
      c.group_rows = p.rows < kRowGroup ? p.rows : kRowGroup;
      c.bytes = c.group_rows * entries * static_cast<int64_t>(sizeof(uint64_t));
      return c;
    }
  }
  return ChunkPlan{};
}

}  // namespace

bool topk_warp_fits(const TopkParams& p) { return p.k >= 1 && p.k <= kWarpMaxK && p.k <= p.n && p.n <= kWarpMaxN; }

bool launch_topk_warp(const TopkParams& p, cudaStream_t stream) {
  if (!topk_warp_fits(p)) return false;
  TopkRows r = topk_rows_of(p);
  constexpr int64_t kMaxRows = (int64_t(1) << 30) * kWarpRows;  // grid.x <= 2^30 CTAs a launch
  for (int64_t row0 = 0; row0 < p.rows; row0 += kMaxRows) {
    r.row0 = row0;
    const int64_t g = p.rows - row0 < kMaxRows ? p.rows - row0 : kMaxRows;
    const unsigned grid = static_cast<unsigned>((g + kWarpRows - 1) / kWarpRows);
    if (p.n <= 256) {
      topk_warp_kernel<8><<<grid, kWarpRows * 32, 0, stream>>>(r, row0 + g);
    } else {
      topk_warp_kernel<32><<<grid, kWarpRows * 32, 0, stream>>>(r, row0 + g);
    }
    DEEPINFER_CHECK_LAUNCH("topk_warp_kernel");
  }
  return true;
}

bool topk_chunked_fits(const TopkParams& p, int64_t* workspace_bytes) {
  const ChunkPlan c = make_chunk_plan(p);
  if (workspace_bytes != nullptr) *workspace_bytes = c.bytes;
  return c.use;
}

bool launch_topk_chunked(const TopkParams& p, cudaStream_t stream) {
  const ChunkPlan c = make_chunk_plan(p);
  if (!c.use) return false;
  TopkRows r = topk_rows_of(p);
  if (c.chunks == 1) {
    constexpr int64_t kMaxGrid = int64_t(1) << 30;
    // narrow rows: 256 threads; where k needs no more than one sort entry a thread, the kernel
    // keeps one register for it, not eight (63 -> fewer registers a thread: more CTAs a multiprocessor)
    const bool narrow = p.n <= kNarrowMaxN, small_k = sort_size(p.k) <= 256;
    auto narrow_kernel = small_k ? topk_chunk_kernel<256, true, 256> : topk_chunk_kernel<256, true>;
    if (narrow) {
      ensure_dynamic_smem(narrow_kernel, c.chunk_smem);
    } else {
      ensure_dynamic_smem(topk_chunk_kernel<kThreads, true>, c.chunk_smem);
    }
    for (int64_t row0 = 0; row0 < p.rows; row0 += kMaxGrid) {
      r.row0 = row0;
      const unsigned g = static_cast<unsigned>(p.rows - row0 < kMaxGrid ? p.rows - row0 : kMaxGrid);
      if (narrow) {
        narrow_kernel<<<g, 256, c.chunk_smem, stream>>>(r, c.chunk, nullptr);
      } else {
        topk_chunk_kernel<kThreads, true><<<g, kThreads, c.chunk_smem, stream>>>(r, c.chunk, nullptr);
      }
      DEEPINFER_CHECK_LAUNCH("topk_chunk_kernel");
    }
    return true;
  }
  if (p.workspace == nullptr || p.workspace_bytes < c.bytes || !is_aligned(p.workspace, 16)) {
    throw std::runtime_error("deepinfer topk_rows: workspace missing, too small or not 16-byte aligned");
  }
  uint64_t* cand = static_cast<uint64_t*>(p.workspace);
  ensure_dynamic_smem(topk_chunk_kernel<kThreads, false>, c.chunk_smem);
  ensure_dynamic_smem(topk_merge_kernel, c.merge_smem);
  for (int64_t row0 = 0; row0 < p.rows; row0 += c.group_rows) {
    const int64_t g = p.rows - row0 < c.group_rows ? p.rows - row0 : c.group_rows;
    r.row0 = row0;
    const dim3 grid(static_cast<unsigned>(g), static_cast<unsigned>(c.chunks));
    topk_chunk_kernel<kThreads, false><<<grid, kThreads, c.chunk_smem, stream>>>(r, c.chunk, cand);
    DEEPINFER_CHECK_LAUNCH("topk_chunk_kernel");
    topk_merge_kernel<<<static_cast<unsigned>(g), kThreads, c.merge_smem, stream>>>(r, c.chunks * p.k, cand);
    DEEPINFER_CHECK_LAUNCH("topk_merge_kernel");
  }
  return true;
}

}  // namespace deepinfer::attention::topk_detail
