// topk_rows on CUDA: exact top-k of each row of fp32 scores with the project's tie rule (higher score first, then
// lower index). Two paths, chosen by the shape only (never by the data), with identical results:
//   * keys in shared memory (topk_row.cu): one CTA per row of at most 32768, or per chunk of a longer row then one
//     merge CTA per row (up to 16384 candidates: n <= 262144 at k = 2048, n <= 1M at k = 512); one read;
//   * radix select over several CTAs per row (longer rows at large k), described here.
//
// Keys: the order-preserving uint32 image of each score (larger float -> larger key; every NaN -> 0xffffffff, above
// +inf; -0.0 -> the key of +0.0), so "score desc, index asc" is "key desc, index asc" and the values written are
// the scores' own bits, read back at the selected indices.
//
// Per group of up to kRowGroup rows (one workspace, zeroed by one memset), seven launches on the stream:
//   hist<0>                    grid (rows, chunks): each CTA streams its chunk of the row (float4 loads when rows are
//                              16-byte aligned) and counts the top digit (key bits [21, 32), 2048 bins) in a shared
//                              histogram (warp-aggregated atomics), then adds it to the row's global histogram.
//   hist<1>                    derives the top digit d0 of the k-th largest key from the complete histogram (a block
//                              scan from the top bin; every CTA of the row gets the same answer, CTA 0 records it
//                              for the next launch). Compact rows -- at most kCandCap elements in bin d0, the usual
//                              case (< 1% of a row of real scores) -- are finished in this pass: elements above bin
//                              d0 (all selected) go to the row's selection buffer, elements in bin d0 to a candidate
//                              buffer (per-row warp-aggregated atomic counters, any order). Other rows count the next
//                              digit (bits [10, 21)) of the elements in bin d0.
//   hist<2>, collect,          other rows only (compact rows return at once): the last digit (bits [0, 10)), then
//   collect_ties               thr = the key of the k-th largest element and need_eq = how many elements equal to
//                              thr belong to the top k; elements with key > thr (exactly k - need_eq) take slots
//                              [0, k - need_eq) of the selection buffer; when every element equal to thr is selected
//                              (the usual case) they take the rest the same way, otherwise collect_ties writes the
//                              need_eq lowest-index ones in index order (per-chunk counts, then an ordered block
//                              scan in the CTAs whose chunk holds some of them).
//   finish_candidates          compact rows only: one CTA per row sorts the candidates (key << 32 | ~index,
//                              descending = key desc, index asc; bitonic, shared memory) and appends the first
//                              k - (number above bin d0) to the selection buffer.
//   sort                       one CTA per row: bitonic sort of the k selected entries, then values =
//                              scores[index], indices.
// Compact rows read the scores twice from memory, the others four times.
// The selected set and its order do not depend on the chunking, the grid or the order of atomics, so results are
// the same for any batch size and any GPU. Limits: k <= 2048 (the sort), n < 2^30.
#include "topk_common.cuh"

namespace deepinfer::attention {
namespace {

using namespace topk_detail;

constexpr int kThreads = 512;                       // hist / collect CTAs
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;                          // loads in flight per thread per step
constexpr int kStep = kThreads * kUnroll * 4;       // elements per step of a CTA (float4 loads): 8192
constexpr int kBins = 2048;                         // the largest digit (11 bits)
constexpr int kMetaInts = 8;  // per row: P0, R0, P1, R1, thr, need_eq, selection counter, candidate counter
constexpr int kMaxChunks = 1024;                    // per row (grid y, per-chunk tie counts)
constexpr int64_t kRowGroup = 256;                  // rows per workspace pass
constexpr int kCandCap = 8192;                      // candidates per compact row (sorted in 64 KiB of shared memory)
constexpr int kSortThreads = 1024;
constexpr int kMaxK = 2048;

// Descending bitonic sort of s[0, npow2) (npow2 a power of two) by the whole block; ends with a barrier.
template <int kBlock>
__device__ void bitonic_sort_desc(uint64_t* s, int npow2) {
  for (int size = 2; size <= npow2; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      __syncthreads();
      for (int t = threadIdx.x; t < npow2 / 2; t += kBlock) {
        const int lo = 2 * t - (t & (stride - 1)), hi = lo + stride;  // lo: the t-th index with bit `stride` clear
        const bool desc = (lo & size) == 0;  // direction of this run (the last merge, size = npow2, is descending)
        const uint64_t a = s[lo], b = s[hi];
        if ((a < b) == desc) {
          s[lo] = b;
          s[hi] = a;
        }
      }
    }
  }
  __syncthreads();
}

__host__ __device__ constexpr int digit_shift(int pass) { return pass == 0 ? 21 : (pass == 1 ? 10 : 0); }
__host__ __device__ constexpr int digit_bins(int pass) { return pass == 2 ? 1024 : 2048; }
// Key bits fixed once the digits of passes 0..pass are known.
__host__ __device__ constexpr uint32_t digits_mask(int pass) { return ~((1u << digit_shift(pass)) - 1u); }

struct TopkPlan {
  int64_t group_rows;  // rows per workspace pass
  int chunk, chunks;   // elements per CTA (a multiple of 4) and CTAs per row
  int64_t hist_off, meta_off, ties_off, sel_off, cand_off, zero_bytes, bytes;  // workspace layout (bytes)
};

TopkPlan make_plan(const TopkParams& p) {
  TopkPlan t{};
  t.group_rows = p.rows < kRowGroup ? p.rows : kRowGroup;
  const int64_t n = p.n;
  // About 4 CTAs per SM (two resident waves of 2 CTAs) when rows are few, each streaming at least one full step.
  const int64_t sms = p.num_sms > 0 ? p.num_sms : 132;
  int64_t per_row = (4 * sms + t.group_rows - 1) / t.group_rows;
  const int64_t most = (n + kStep - 1) / kStep;
  if (per_row > most) per_row = most;
  if (per_row < 1) per_row = 1;
  int64_t chunk = ((n + per_row - 1) / per_row + kStep - 1) / kStep * kStep;
  if ((n + chunk - 1) / chunk > kMaxChunks) chunk = ((n + kMaxChunks - 1) / kMaxChunks + kStep - 1) / kStep * kStep;
  t.chunk = static_cast<int>(chunk);
  t.chunks = static_cast<int>(n == 0 ? 1 : (n + chunk - 1) / chunk);
  const int64_t g = t.group_rows;
  t.hist_off = 0;
  t.meta_off = t.hist_off + g * 3 * kBins * 4;
  t.ties_off = t.meta_off + g * kMetaInts * 4;
  t.zero_bytes = t.ties_off + g * t.chunks * 4;
  t.sel_off = (t.zero_bytes + 15) / 16 * 16;
  t.cand_off = t.sel_off + g * p.k * 8;
  t.bytes = t.cand_off + g * kCandCap * 8;
  return t;
}


struct TopkRun : TopkRows {  // the radix path
  int chunk, chunks;
  int* hist;          // [group][3][kBins]
  int* meta;          // [group][kMetaInts]
  int* ties;          // [group][chunks]: elements equal to thr per chunk (when not all are selected)
  uint64_t* sel;      // [group][k]
  uint64_t* cand;     // [group][kCandCap]
};


// Elements of row g in the top-digit bin of the k-th largest key (valid once hist<1> has recorded that digit).
__device__ __forceinline__ int top_bin_count(const TopkRun& r, int g, uint32_t prefix0) {
  return r.hist[static_cast<int64_t>(g) * 3 * kBins + (prefix0 >> digit_shift(0))];
}

// Row g is finished by the compact path (hist<1> + finish_candidates); valid after hist<1>.
__device__ __forceinline__ bool row_is_compact(const TopkRun& r, int g) {
  const uint32_t prefix0 = static_cast<uint32_t>(r.meta[static_cast<int64_t>(g) * kMetaInts]);
  return top_bin_count(r, g, prefix0) <= kCandCap;
}

// Calls f(index, score, valid) for every element of [c0, c1) of the row (any order); every thread of the block
// makes the same number of calls (invalid ones past the end), so f may use warp collectives.
template <class F>
__device__ __forceinline__ void for_each_in_chunk(const TopkRun& r, const float* srow, int c0, int c1, F&& f) {
  const int tid = threadIdx.x;
  if (r.vec) {  // srow 16-byte aligned, c0 a multiple of 4
    const float4* s4 = reinterpret_cast<const float4*>(srow);
    const int q0 = c0 >> 2, q1 = c1 >> 2;  // whole float4s; the row's last 1-3 elements follow
    for (int base = q0; base < q1; base += kThreads * kUnroll) {
      float4 v[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int q = base + j * kThreads + tid;
        v[j] = q < q1 ? __ldg(s4 + q) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int q = base + j * kThreads + tid;
        const bool ok = q < q1;
        f(4 * q, v[j].x, ok);
        f(4 * q + 1, v[j].y, ok);
        f(4 * q + 2, v[j].z, ok);
        f(4 * q + 3, v[j].w, ok);
      }
    }
    if (4 * q1 < c1) {  // uniform: the same condition in every thread
      const int i = 4 * q1 + tid;
      const bool ok = i < c1;
      f(i, ok ? __ldg(srow + i) : 0.f, ok);
    }
  } else {
    for (int base = c0; base < c1; base += kThreads * kUnroll * 4) {
      float v[kUnroll * 4];
#pragma unroll
      for (int j = 0; j < kUnroll * 4; ++j) {
        const int i = base + j * kThreads + tid;
        v[j] = i < c1 ? __ldg(srow + i) : 0.f;
      }
#pragma unroll
      for (int j = 0; j < kUnroll * 4; ++j) {
        const int i = base + j * kThreads + tid;
        f(i, v[j], i < c1);
      }
    }
  }
}

// The digit of pass `pass` for row g (its histogram complete): among the elements under the prefix of the earlier
// passes (recorded in meta by the previous launch; pass 0: none, rank k), the digit d holding the rem-th largest,
// scanning bins from the top, and the rank left inside it. Every thread returns the same (prefix | d << shift,
// rank); CTA (g, 0) records it in meta for the next launch. Ends with a barrier (shared scratch reusable).
__device__ void derive_digit(const TopkRun& r, int g, int pass, uint32_t& prefix_out, int& rem_out) {
  __shared__ int s_scan[kWarps];
  __shared__ uint32_t s_prefix;
  __shared__ int s_rem;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int* meta = r.meta + static_cast<int64_t>(g) * kMetaInts;
  const uint32_t prefix = pass == 0 ? 0u : static_cast<uint32_t>(meta[2 * (pass - 1)]);
  const int rem = pass == 0 ? r.k : meta[2 * (pass - 1) + 1];
  const int bins = digit_bins(pass), per = bins / kThreads;  // 4 or 2 bins per thread
  const int* hist = r.hist + (static_cast<int64_t>(g) * 3 + pass) * kBins;
  if (tid == 0) {  // not reached unless the histogram is short of rem (it never is): keep a defined answer
    s_prefix = prefix;
    s_rem = rem;
  }
  // Thread t owns bins bins-1-per*t .. bins-per*(t+1), from the top down.
  int c[4] = {0, 0, 0, 0};
  int local = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (j < per) {
      c[j] = hist[bins - 1 - per * tid - j];
      local += c[j];
    }
  }
  int incl = warp_inclusive_scan(local, lane);
  if (lane == 31) s_scan[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int v = lane < kWarps ? s_scan[lane] : 0;
    v = warp_inclusive_scan(v, lane);
    if (lane < kWarps) s_scan[lane] = v;
  }
  __syncthreads();
  incl += warp > 0 ? s_scan[warp - 1] : 0;
  const int excl = incl - local;
  if (excl < rem && rem <= incl) {  // exactly one thread
    int cum = excl;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j < per) {
        if (cum + c[j] >= rem) {
          const int d = bins - 1 - per * tid - j;
          s_prefix = prefix | (static_cast<uint32_t>(d) << digit_shift(pass));
          s_rem = rem - cum;
          break;
        }
        cum += c[j];
      }
    }
  }
  __syncthreads();
  prefix_out = s_prefix;
  rem_out = s_rem;
  if (blockIdx.y == 0 && tid == 0) {
    int* m = r.meta + static_cast<int64_t>(g) * kMetaInts;
    m[2 * pass] = static_cast<int>(prefix_out);
    m[2 * pass + 1] = rem_out;
  }
  __syncthreads();
}

template <int kPass>
__global__ void __launch_bounds__(kThreads) topk_hist_kernel(const __grid_constant__ TopkRun r) {
  constexpr int kShift = digit_shift(kPass), kNumBins = digit_bins(kPass);
  __shared__ int s_hist[kBins];
  const int g = blockIdx.x, tid = threadIdx.x, lane = tid % 32;
  if (kPass == 2 && row_is_compact(r, g)) return;  // finished by hist<1> (uniform)
  const float* srow = r.scores + (r.row0 + g) * r.score_row_stride;
  const int c0 = blockIdx.y * r.chunk, c1 = min(c0 + r.chunk, r.n);
  uint32_t prefix = 0u, mask = 0u;
  if constexpr (kPass > 0) {
    int rem;  // (the rank is only needed by the next derivation, which reads it from meta)
    derive_digit(r, g, kPass - 1, prefix, rem);
    mask = digits_mask(kPass - 1);
  }
  if constexpr (kPass == 1) {
    if (top_bin_count(r, g, prefix) <= kCandCap) {  // compact row (uniform): select / collect candidates
      const uint32_t d0 = prefix >> digit_shift(0);
      int* meta = r.meta + static_cast<int64_t>(g) * kMetaInts;
      uint64_t* sel = r.sel + static_cast<int64_t>(g) * r.k;
      uint64_t* cand = r.cand + static_cast<int64_t>(g) * kCandCap;
      for_each_in_chunk(r, srow, c0, c1, [&](int i, float x, bool ok) {
        const uint32_t u = topk_key(x);
        const uint32_t d = u >> digit_shift(0);
        const uint64_t e = sel_entry(u, i);
        warp_append(ok && d > d0, e, meta + 6, sel, r.k, lane);
        warp_append(ok && d == d0, e, meta + 7, cand, kCandCap, lane);
      });
      return;
    }
  }
  for (int b = tid; b < kNumBins; b += kThreads) s_hist[b] = 0;
  __syncthreads();
  for_each_in_chunk(r, srow, c0, c1, [&](int, float x, bool ok) {
    const uint32_t u = topk_key(x);
    const bool take = ok && (u & mask) == prefix;
    const unsigned active = __ballot_sync(0xffffffffu, take);
    if (take) {  // lanes with the same bin add once, through their leader
      const uint32_t bin = (u >> kShift) & static_cast<uint32_t>(kNumBins - 1);
      const unsigned peers = __match_any_sync(active, bin);
      if (__ffs(peers) - 1 == lane) atomicAdd(&s_hist[bin], __popc(peers));
    }
  });
  __syncthreads();
  int* hist = r.hist + (static_cast<int64_t>(g) * 3 + kPass) * kBins;
  for (int b = tid; b < kNumBins; b += kThreads) {
    const int v = s_hist[b];
    if (v != 0) atomicAdd(hist + b, v);
  }
}

__global__ void __launch_bounds__(kThreads) topk_collect_kernel(const __grid_constant__ TopkRun r) {
  __shared__ int s_warp[kWarps];
  const int g = blockIdx.x, tid = threadIdx.x, lane = tid % 32;
  if (row_is_compact(r, g)) return;  // finished by hist<1> and finish_candidates (uniform)
  uint32_t thr;
  int need_eq;
  derive_digit(r, g, 2, thr, need_eq);  // need_eq >= 1
  const int eq_total = r.hist[(static_cast<int64_t>(g) * 3 + 2) * kBins + (thr & 1023u)];
  const bool all_eq = need_eq == eq_total;
  const int k = r.k;
  int* counter = r.meta + static_cast<int64_t>(g) * kMetaInts + 6;
  uint64_t* sel = r.sel + static_cast<int64_t>(g) * k;
  const float* srow = r.scores + (r.row0 + g) * r.score_row_stride;
  const int c0 = blockIdx.y * r.chunk, c1 = min(c0 + r.chunk, r.n);
  int my_eq = 0;
  for_each_in_chunk(r, srow, c0, c1, [&](int i, float x, bool ok) {
    const uint32_t u = topk_key(x);
    const bool eq = ok && u == thr;
    my_eq += eq ? 1 : 0;
    warp_append((ok && u > thr) || (eq && all_eq), sel_entry(u, i), counter, sel, k, lane);
  });
  if (!all_eq) {  // uniform: this chunk's count of elements equal to thr, for collect_ties
    const int total = block_sum_fixed_order<kThreads>(my_eq, s_warp);
    if (tid == 0) r.ties[static_cast<int64_t>(g) * r.chunks + blockIdx.y] = total;
  }
}

// The need_eq lowest-index elements equal to thr, in index order, to slots [k - need_eq, k): only CTAs whose chunk
// holds some of them do any work (the rows where every tie is selected return at once).
__global__ void __launch_bounds__(kThreads) topk_collect_ties_kernel(const __grid_constant__ TopkRun r) {
  __shared__ int s_warp[kWarps];
  const int g = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  if (row_is_compact(r, g)) return;  // (uniform)
  const int* meta = r.meta + static_cast<int64_t>(g) * kMetaInts;
  const uint32_t thr = static_cast<uint32_t>(meta[4]);
  const int need_eq = meta[5];
  const int eq_total = r.hist[(static_cast<int64_t>(g) * 3 + 2) * kBins + (thr & 1023u)];
  if (need_eq == eq_total) return;  // collect took them all
  const int* ties = r.ties + static_cast<int64_t>(g) * r.chunks;
  const int chunk_id = blockIdx.y;
  if (ties[chunk_id] == 0) return;
  // Ties in the chunks before this one (a fixed-order block sum).
  int v = 0;
  for (int c = tid; c < chunk_id; c += kThreads) v += ties[c];
  int base = block_sum_fixed_order<kThreads>(v, s_warp);  // the same in every thread
  if (base >= need_eq) return;
  const int k = r.k;
  uint64_t* sel = r.sel + static_cast<int64_t>(g) * k;
  const float* srow = r.scores + (r.row0 + g) * r.score_row_stride;
  const int c0 = chunk_id * r.chunk, c1 = min(c0 + r.chunk, r.n);
  for (int start = c0; start < c1 && base < need_eq; start += kThreads) {  // uniform trip count
    const int i = start + tid;
    const bool eq = i < c1 && topk_key(__ldg(srow + i)) == thr;
    if (!__syncthreads_or(eq)) continue;  // the same answer in every thread
    const unsigned ballot = __ballot_sync(0xffffffffu, eq);
    if (lane == 0) s_warp[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < kWarps; ++w) {
      const int cnt = s_warp[w];
      before += w < warp ? cnt : 0;
      total += cnt;
    }
    if (eq) {
      const int rank = base + before + __popc(ballot & ((1u << lane) - 1u));
      if (rank < need_eq) sel[k - need_eq + rank] = sel_entry(thr, i);
    }
    base += total;
    __syncthreads();  // s_warp read by every thread before the next step writes it
  }
}

// Compact rows: sort the row's candidates (bin d0) and append the first R0 (the rank left in bin d0) to the
// selection buffer after the k - R0 entries hist<1> took from the higher bins.
__global__ void __launch_bounds__(kSortThreads) topk_finish_candidates_kernel(const __grid_constant__ TopkRun r) {
  extern __shared__ __align__(16) char dyn[];
  uint64_t* s = reinterpret_cast<uint64_t*>(dyn);  // [kCandCap]
  const int g = blockIdx.x, tid = threadIdx.x, k = r.k;
  const int* meta = r.meta + static_cast<int64_t>(g) * kMetaInts;
  const int count = top_bin_count(r, g, static_cast<uint32_t>(meta[0]));
  if (count > kCandCap) return;  // not compact (uniform)
  const int rem = meta[1];       // 1 <= rem <= count
  int npow2 = 1;
  while (npow2 < count) npow2 <<= 1;
  const uint64_t* cand = r.cand + static_cast<int64_t>(g) * kCandCap;
  for (int i = tid; i < npow2; i += kSortThreads) s[i] = i < count ? cand[i] : 0ull;  // zero padding sorts last
  bitonic_sort_desc<kSortThreads>(s, npow2);
  uint64_t* sel = r.sel + static_cast<int64_t>(g) * k;
  for (int j = tid; j < rem && j < k; j += kSortThreads) sel[k - rem + j] = s[j];
}

__global__ void __launch_bounds__(kSortThreads) topk_sort_kernel(const __grid_constant__ TopkRun r) {
  extern __shared__ __align__(16) char dyn[];
  uint64_t* s = reinterpret_cast<uint64_t*>(dyn);  // [npow2]
  const int g = blockIdx.x, tid = threadIdx.x, k = r.k;
  int npow2 = 1;
  while (npow2 < k) npow2 <<= 1;
  const uint64_t* sel = r.sel + static_cast<int64_t>(g) * k;
  for (int i = tid; i < npow2; i += kSortThreads) s[i] = i < k ? sel[i] : 0ull;  // zero padding sorts last
  bitonic_sort_desc<kSortThreads>(s, npow2);  // (key desc, index asc)
  const int64_t row = r.row0 + g;
  const float* srow = r.scores + row * r.score_row_stride;
  for (int j = tid; j < k; j += kSortThreads) {
    const int idx = static_cast<int>(~static_cast<uint32_t>(s[j]));
    r.values[row * k + j] = srow[idx];
    r.indices[row * k + j] = idx;
  }
}


}  // namespace

int64_t topk_rows_workspace_bytes(const TopkParams& p) {
  if (p.rows == 0 || p.k == 0) return 0;
  int64_t chunked = 0;
  if (topk_detail::topk_warp_fits(p)) return 0;
  if (topk_detail::topk_chunked_fits(p, &chunked)) return chunked;
  return make_plan(p).bytes;
}

void launch_topk_rows(const TopkParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.k == 0) return;
  if (p.k > kMaxK || p.k > p.n || p.n >= (1 << 30)) {
    throw std::runtime_error("deepinfer topk_rows: need k <= min(n, 2048) and n < 2^30, got k = " +
                             std::to_string(p.k) + ", n = " + std::to_string(p.n));
  }
  if (topk_detail::launch_topk_warp(p, stream)) return;
  if (topk_detail::launch_topk_chunked(p, stream)) return;
  const TopkPlan plan = make_plan(p);
  if (p.workspace == nullptr || p.workspace_bytes < plan.bytes || !is_aligned(p.workspace, 16)) {
    throw std::runtime_error("deepinfer topk_rows: workspace missing, too small or not 16-byte aligned");
  }
  char* ws = static_cast<char*>(p.workspace);
  TopkRun r{};
  static_cast<TopkRows&>(r) = topk_rows_of(p);
  r.chunk = plan.chunk;
  r.chunks = plan.chunks;
  r.hist = reinterpret_cast<int*>(ws + plan.hist_off);
  r.meta = reinterpret_cast<int*>(ws + plan.meta_off);
  r.ties = reinterpret_cast<int*>(ws + plan.ties_off);
  r.sel = reinterpret_cast<uint64_t*>(ws + plan.sel_off);
  r.cand = reinterpret_cast<uint64_t*>(ws + plan.cand_off);
  constexpr size_t kCandSmem = static_cast<size_t>(kCandCap) * sizeof(uint64_t);  // 64 KiB
  ensure_dynamic_smem(topk_finish_candidates_kernel, kCandSmem);
  int npow2 = 1;
  while (npow2 < p.k) npow2 <<= 1;
  const size_t sort_smem = static_cast<size_t>(npow2) * sizeof(uint64_t);  // <= 16 KiB
  for (int64_t row0 = 0; row0 < p.rows; row0 += plan.group_rows) {
    const int64_t g = p.rows - row0 < plan.group_rows ? p.rows - row0 : plan.group_rows;
    r.row0 = row0;
    DEEPINFER_CUDA_CHECK(cudaMemsetAsync(ws, 0, static_cast<size_t>(plan.zero_bytes), stream));
    const dim3 grid(static_cast<unsigned>(g), static_cast<unsigned>(plan.chunks));
    topk_hist_kernel<0><<<grid, kThreads, 0, stream>>>(r);
    DEEPINFER_CHECK_LAUNCH("topk_hist_kernel<0>");
    topk_hist_kernel<1><<<grid, kThreads, 0, stream>>>(r);
    DEEPINFER_CHECK_LAUNCH("topk_hist_kernel<1>");
    topk_hist_kernel<2><<<grid, kThreads, 0, stream>>>(r);
    DEEPINFER_CHECK_LAUNCH("topk_hist_kernel<2>");
    topk_collect_kernel<<<grid, kThreads, 0, stream>>>(r);
    DEEPINFER_CHECK_LAUNCH("topk_collect_kernel");
    topk_collect_ties_kernel<<<grid, kThreads, 0, stream>>>(r);
    DEEPINFER_CHECK_LAUNCH("topk_collect_ties_kernel");
    topk_finish_candidates_kernel<<<static_cast<unsigned>(g), kSortThreads, kCandSmem, stream>>>(r);
    DEEPINFER_CHECK_LAUNCH("topk_finish_candidates_kernel");
    topk_sort_kernel<<<static_cast<unsigned>(g), kSortThreads, sort_smem, stream>>>(r);
    DEEPINFER_CHECK_LAUNCH("topk_sort_kernel");
  }
}

}  // namespace deepinfer::attention
