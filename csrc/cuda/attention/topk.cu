// topk_rows on CUDA: exact top-k of each row of fp32 scores with the project's tie rule (higher score first, then
// lower index). Three paths, chosen by the shape only (never by the data), with identical results:
//   * one CTA per row (rows of at most 32768, whose keys fit in shared memory; topk_row.cu): one launch, one read;
//   * two-stage (one read of the scores; rows whose candidates fit: chunks * q <= kSelectMaxCand, e.g. n <= 262144
//     at k <= 704): per-chunk candidate supersets, then one exact select + sort per row (see below, "Two-stage");
//   * radix select over several CTAs per row (every other shape: larger k at long rows), described here.
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


// ---- Two-stage path (one read of the scores): chunk candidates, then an exact select per row ---------------------
//
// topk_chunk_candidates  persistent CTAs (one per SM) over the (row, chunk of kCandChunk) items, the next item's
//                        loads in flight during the current one: an item's chunk is loaded once into registers
//                        (keys); its candidates are the elements >= x for a key x with k <= count(>= x) <= q
//                        (q = 2 k slots, k + 64 for k < 64): a superset of the chunk's top k under "key desc,
//                        index asc". x comes from a sample (every 8th element; a key with about 1.25-1.56 k / 8
//                        samples at or above it, checked by one count over the chunk), else from a search over
//                        the whole chunk, two bits per round, that stops once count(>= x) <= q. When no x gets the
//                        count down to q (ties: x is then the chunk's k-th key), the candidates are the elements
//                        above x and the k - count(> x) lowest-index elements equal to x (index-ordered block scans).
//                        Candidates (key << 32 | ~index) go to the chunk's own q slots; their count to counts[].
// topk_select            one CTA per row: the row's candidates (<= kSelectMaxCand) in shared memory; the same
//                        sample step narrows them to at most 2 k; the k-th largest by a search over the 64-bit
//                        entries, two bits per round (they are distinct, so it stops at a count of exactly k); the
//                        k entries >= it sorted (k <= 1024: each entry's rank = the number of entries above it,
//                        from warp-sorted runs of 32; else bitonic), then values = scores[index], indices.
// Every element of the row's top k is in its chunk's top k, so it is a candidate; the result is exact and, as the
// entries are distinct, independent of the order of atomics, the sample, the chunking and the batch (the sample
// only decides how much work the exact steps do). Used when the row's candidates fit (chunks * q <=
// kSelectMaxCand: e.g. n <= 262144 at k <= 704); the radix path above otherwise.
constexpr int kCandThreads = 512;
constexpr int kCandWarps = kCandThreads / 32;
constexpr int kCandPerThread = 32;                          // keys per thread: 8 float4
constexpr int kCandChunk = kCandThreads * kCandPerThread;   // 16384 elements per CTA
constexpr int kSelectThreads = 1024;
constexpr int kSelectMaxCand = 22528;                       // 176 KiB of shared memory in topk_select
constexpr int kSelectMaxChunks = 1024;

__host__ __device__ constexpr int cand_slots(int k) { return k + (k > 64 ? k : 64); }

struct TopkCandRun : TopkRows {  // the two-stage path
  int chunks, q;
  int* counts;    // [group][chunks]
  uint64_t* cand; // [group][chunks][q]
};

// Sum over the block of v (any order: integer), through one of two alternating scratch buffers so that one barrier
// per call suffices.
template <int kNumWarps>
__device__ __forceinline__ int block_count(int v, int (*s_red)[kNumWarps], int& parity) {
  v = __reduce_add_sync(0xffffffffu, v);
  int* buf = s_red[parity];
  parity ^= 1;
  if (threadIdx.x % 32 == 0) buf[threadIdx.x / 32] = v;
  __syncthreads();
  const int lane = threadIdx.x % 32;  // each warp re-reduces the partials: one shared load per lane
  return __reduce_add_sync(0xffffffffu, lane < kNumWarps ? buf[lane] : 0);
}

// Three block sums at once (one barrier), as block_count.
template <int kNumWarps>
__device__ __forceinline__ void block_count3(int& a, int& b, int& c, int (*s_red)[3][kNumWarps], int& parity) {
  a = __reduce_add_sync(0xffffffffu, a);
  b = __reduce_add_sync(0xffffffffu, b);
  c = __reduce_add_sync(0xffffffffu, c);
  int(*buf)[kNumWarps] = s_red[parity];
  parity ^= 1;
  if (threadIdx.x % 32 == 0) {
    buf[0][threadIdx.x / 32] = a;
    buf[1][threadIdx.x / 32] = b;
    buf[2][threadIdx.x / 32] = c;
  }
  __syncthreads();
  const int lane = threadIdx.x % 32;
  a = __reduce_add_sync(0xffffffffu, lane < kNumWarps ? buf[0][lane] : 0);
  b = __reduce_add_sync(0xffffffffu, lane < kNumWarps ? buf[1][lane] : 0);
  c = __reduce_add_sync(0xffffffffu, lane < kNumWarps ? buf[2][lane] : 0);
}

// The largest x such that at least `rank` of the values given by `count3` lie at or above it (rank >= 1 and at
// least rank values present), found two bits per round from the top (one barrier per round); stops early once
// exactly `rank` lie at or above x when `stop_exact`. count3(t1, t2, t3, c1, c2, c3) adds this thread's counts of
// values >= t1, t2, t3. Returns x; *count gets the number of values >= x. Uniform across the block.
template <int kNumWarps, typename Key, class Count3>
__device__ __forceinline__ Key block_search_kth(int rank, bool stop_exact, int stop_at_most, Count3&& count3,
                                                int (*s_red3)[3][kNumWarps], int& parity, int& count) {
  Key x = 0;
  int c = -1;  // count(>= x) not yet known (x = 0: everything)
  for (int sh = static_cast<int>(sizeof(Key)) * 8 - 2; sh >= 0; sh -= 2) {
    const Key t1 = x | (Key(1) << sh), t2 = x | (Key(2) << sh), t3 = x | (Key(3) << sh);
    int c1 = 0, c2 = 0, c3 = 0;
    count3(t1, t2, t3, c1, c2, c3);
    block_count3<kNumWarps>(c1, c2, c3, s_red3, parity);
    if (c3 >= rank) {
      x = t3;
      c = c3;
    } else if (c2 >= rank) {
      x = t2;
      c = c2;
    } else if (c1 >= rank) {
      x = t1;
      c = c1;
    }
    if (c >= 0 && ((stop_exact && c == rank) || c <= stop_at_most)) break;  // uniform
  }
  count = c;
  return x;
}


// Persistent: CTA i takes work items (row, chunk) i, i + gridDim.x, ...; the next item's scores are loaded (into
// registers) while the current one is searched, so the row is read once at close to the copy bandwidth.
__global__ void __launch_bounds__(kCandThreads, 1)
    topk_chunk_candidates_kernel(const __grid_constant__ TopkCandRun r, int num_items) {
  __shared__ int s_red[2][kCandWarps];
  __shared__ int s_red3[2][3][kCandWarps];
  __shared__ int s_warp[kCandWarps];
  __shared__ int s_count;
  const int tid = threadIdx.x, lane = tid % 32;
  // Element m = 4 j + e of this thread in a chunk starting at c0 is index c0 + 4 (j * kCandThreads + tid) + e
  // (index order: j, tid, e).
  float v[kCandPerThread];  // the scores of the item being loaded
  const auto load = [&](int item) {
    const int g = item / r.chunks, chunk = item % r.chunks;
    const float* srow = r.scores + (r.row0 + g) * r.score_row_stride;
    const int c0 = chunk * kCandChunk, c1 = min(c0 + kCandChunk, r.n);
#pragma unroll
    for (int j = 0; j < kCandPerThread / 4; ++j) {
      const int base = c0 + 4 * (j * kCandThreads + tid);
      if (r.vec && base + 4 <= c1) {
        const float4 f = __ldg(reinterpret_cast<const float4*>(srow + base));
        v[4 * j] = f.x;
        v[4 * j + 1] = f.y;
        v[4 * j + 2] = f.z;
        v[4 * j + 3] = f.w;
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) v[4 * j + e] = base + e < c1 ? __ldg(srow + base + e) : 0.f;
      }
    }
  };
  if (static_cast<int>(blockIdx.x) < num_items) load(blockIdx.x);
  for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
    const int g = item / r.chunks, chunk = item % r.chunks;
    const int c0 = chunk * kCandChunk, c1 = min(c0 + kCandChunk, r.n), len = c1 - c0;
    // Real keys are >= 1 (topk_key(-inf) > 0); positions past the row get 0 and are never taken (x >= 1 below, or
    // the index check when the whole chunk is taken).
    const bool full = len == kCandChunk;  // (uniform) no position past the row: no index checks below
    const auto valid = [&](int m) { return full || c0 + 4 * ((m / 4) * kCandThreads + tid) + m % 4 < c1; };
    uint32_t u[kCandPerThread];
#pragma unroll
    for (int m = 0; m < kCandPerThread; ++m) u[m] = valid(m) ? topk_key(v[m]) : 0u;
    if (item + static_cast<int>(gridDim.x) < num_items) load(item + gridDim.x);  // in flight during the search
    if (tid == 0) s_count = 0;
    uint32_t x = 0u;
    int need_eq = -1;  // >= 0: the tie path
    if (len > r.q) {
      int parity = 0, c = -1;
      // 1. Sample every 8th element (u[0], u[8], u[16], u[24] of each thread) and take a key with between
      //    1.25 k / 8 and 1.56 k / 8 samples at or above it; one count over the chunk accepts it when
      //    k <= count(>= it) <= q (= 2 k).
      const int rank_s = (5 * r.k + 31) / 32;
      if (rank_s <= len / 16) {  // enough samples (a partial chunk holds about len / 8)
        int cs;
        const uint32_t ts = block_search_kth<kCandWarps, uint32_t>(
            rank_s, /*stop_exact=*/false, /*stop_at_most=*/rank_s + rank_s / 4,
            [&](uint32_t t1, uint32_t t2, uint32_t t3, int& c1, int& c2, int& c3) {
#pragma unroll
              for (int m = 0; m < kCandPerThread; m += 8) {
                c1 += u[m] >= t1 ? 1 : 0;
                c2 += u[m] >= t2 ? 1 : 0;
                c3 += u[m] >= t3 ? 1 : 0;
              }
            },
            s_red3, parity, cs);
        int cnt = 0;
#pragma unroll
        for (int m = 0; m < kCandPerThread; ++m) cnt += u[m] >= ts ? 1 : 0;
        cnt = block_count<kCandWarps>(cnt, s_red, parity);
        if (cnt >= r.k && cnt <= r.q) {
          x = ts;
          c = cnt;
        }
      }
      // 2. Otherwise (a sample off the mark, ties, small chunks) the search over the whole chunk, stopping as soon
      //    as count(>= x) <= q.
      if (c < 0) {
        x = block_search_kth<kCandWarps, uint32_t>(
            r.k, /*stop_exact=*/false, /*stop_at_most=*/r.q,
            [&](uint32_t t1, uint32_t t2, uint32_t t3, int& c1, int& c2, int& c3) {
#pragma unroll
              for (int m = 0; m < kCandPerThread; ++m) {
                c1 += u[m] >= t1 ? 1 : 0;
                c2 += u[m] >= t2 ? 1 : 0;
                c3 += u[m] >= t3 ? 1 : 0;
              }
            },
            s_red3, parity, c);
      }
      if (c > r.q) {  // x is the chunk's k-th largest key and too many elements equal it
        int gt = 0;
#pragma unroll
        for (int m = 0; m < kCandPerThread; ++m) gt += u[m] > x ? 1 : 0;
        need_eq = r.k - block_count<kCandWarps>(gt, s_red, parity);
      }
    }
    __syncthreads();  // s_count initialised
    uint64_t* cand = r.cand + (static_cast<int64_t>(g) * r.chunks + chunk) * r.q;
    {  // the elements above (or at) x: one shared atomic per warp, then each lane's slots from the ballots
      const bool ge = need_eq < 0;  // take key >= x, or key > x on the tie path (x may be 0xffffffff: NaN)
      uint32_t mine = 0u;           // bit m: element m taken
#pragma unroll
      for (int m = 0; m < kCandPerThread; ++m) {
        mine |= ((ge ? u[m] >= x : u[m] > x) && valid(m) ? 1u : 0u) << m;
      }
      const int n_mine = __popc(mine);
      const int incl = warp_inclusive_scan(n_mine, lane);
      const int warp_total = __shfl_sync(0xffffffffu, incl, 31);
      if (warp_total > 0) {  // (uniform in the warp) lane l's entries go to slots base + (lanes before l's count) ..
        int base = 0;
        if (lane == 0) base = atomicAdd(&s_count, warp_total);
        int slot = __shfl_sync(0xffffffffu, base, 0) + incl - n_mine;
        if (mine != 0u) {
#pragma unroll
          for (int m = 0; m < kCandPerThread; ++m) {
            if ((mine >> m) & 1u) {
              if (slot < r.q) cand[slot] = sel_entry(u[m], c0 + 4 * ((m / 4) * kCandThreads + tid) + m % 4);
              ++slot;
            }
          }
        }
      }
    }
    if (need_eq >= 0) {  // uniform: the need_eq lowest-index elements equal to x
      int done = 0;
#pragma unroll  // (compile-time indices into u: a runtime index would move u to local memory)
      for (int j = 0; j < kCandPerThread / 4; ++j) {
        if (done >= need_eq) break;  // uniform
        const int base = c0 + 4 * (j * kCandThreads + tid);
        int eq = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) eq += (base + e < c1 && u[4 * j + e] == x) ? 1 : 0;
        int total;
        int rank = done + block_exclusive_scan<kCandWarps>(eq, s_warp, total);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool is_eq = base + e < c1 && u[4 * j + e] == x;
          warp_append(is_eq && rank < need_eq, sel_entry(x, base + e), &s_count, cand, r.q, lane);
          rank += is_eq ? 1 : 0;
        }
        done += total;
      }
    }
    __syncthreads();  // every append done
    if (tid == 0) r.counts[static_cast<int64_t>(g) * r.chunks + chunk] = min(s_count, r.q);
    __syncthreads();  // s_count read before the next item resets it
  }
}

__global__ void __launch_bounds__(kSelectThreads) topk_select_kernel(const __grid_constant__ TopkCandRun r) {
  constexpr int kWarpsSel = kSelectThreads / 32;
  extern __shared__ __align__(16) char dyn[];
  int npow2 = 32;  // >= 32: the rank sort reads whole warp runs
  while (npow2 < r.k) npow2 <<= 1;
  uint64_t* s_sort = reinterpret_cast<uint64_t*>(dyn);  // [npow2]
  uint64_t* s_small = s_sort + npow2;                    // [2 k] (k <= kSelectThreads) or none
  uint64_t* s_cand = s_small + (r.k <= kSelectThreads ? 2 * r.k : 0);  // [chunks * q]
  int* s_off = reinterpret_cast<int*>(s_cand + static_cast<int64_t>(r.chunks) * r.q);  // [chunks + 1]
  __shared__ int s_red[2][kWarpsSel];
  __shared__ int s_red3[2][3][kWarpsSel];
  __shared__ int s_warp[kWarpsSel];
  __shared__ int s_sel;
  const int g = blockIdx.x, tid = threadIdx.x;
  const int* counts = r.counts + static_cast<int64_t>(g) * r.chunks;
  // Offsets of the chunks' candidates (chunks <= kSelectMaxChunks = kSelectThreads).
  const int my = tid < r.chunks ? counts[tid] : 0;
  int m_total;
  const int off = block_exclusive_scan<kWarpsSel>(my, s_warp, m_total);
  if (tid < r.chunks) s_off[tid] = off;
  if (tid == 0) {
    s_off[r.chunks] = m_total;
    s_sel = 0;
  }
  __syncthreads();
  const uint64_t* cand = r.cand + static_cast<int64_t>(g) * r.chunks * r.q;
  for (int i = tid; i < m_total; i += kSelectThreads) {  // candidate i: chunk c with s_off[c] <= i < s_off[c + 1]
    int lo = 0, hi = r.chunks - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (s_off[mid] <= i) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    s_cand[i] = cand[static_cast<int64_t>(lo) * r.q + (i - s_off[lo])];
  }
  __syncthreads();
  // The k-th largest candidate: the largest x with count(entry >= x) >= k; entries are distinct, so the search stops
  // at a count of exactly k.
  uint64_t x = 0ull;
  const uint64_t* src = s_cand;  // the entries the k largest are taken from
  int m = m_total;
  if (m_total > r.k) {
    int parity = 0, c;
    // 1. As in topk_chunk_candidates, a threshold from every 8th entry; when k <= count(>= it) <= 2 k, those
    //    entries move to s_small and the exact search runs over them only.
    const int rank_s = (5 * r.k + 31) / 32, samples = (m_total + 7) / 8;
    if (r.k <= kSelectThreads && 2 * rank_s <= samples) {
      const uint64_t ts = block_search_kth<kWarpsSel, uint64_t>(
          rank_s, /*stop_exact=*/false, /*stop_at_most=*/rank_s + rank_s / 4,
          [&](uint64_t t1, uint64_t t2, uint64_t t3, int& c1, int& c2, int& c3) {
            for (int i = tid; i < samples; i += kSelectThreads) {
              const uint64_t e = s_cand[8 * i];
              c1 += e >= t1 ? 1 : 0;
              c2 += e >= t2 ? 1 : 0;
              c3 += e >= t3 ? 1 : 0;
            }
          },
          s_red3, parity, c);
      int cnt = 0;
      for (int i = tid; i < m_total; i += kSelectThreads) cnt += s_cand[i] >= ts ? 1 : 0;
      cnt = block_count<kWarpsSel>(cnt, s_red, parity);
      if (cnt >= r.k && cnt <= 2 * r.k) {
        for (int i0 = 0; i0 < m_total; i0 += kSelectThreads) {  // uniform trip count (warp ballots)
          const int i = i0 + tid;
          const bool take = i < m_total && s_cand[i] >= ts;
          const unsigned ballot = __ballot_sync(0xffffffffu, take);
          int base = 0;
          if (tid % 32 == 0 && ballot != 0u) base = atomicAdd(&s_sel, __popc(ballot));
          base = __shfl_sync(0xffffffffu, base, 0);
          if (take) s_small[base + __popc(ballot & ((1u << (tid % 32)) - 1u))] = s_cand[i];
        }
        __syncthreads();
        src = s_small;
        m = cnt;
        if (tid == 0) s_sel = 0;
      }
    }
    // 2. The k-th largest of src: entries are distinct, so the search stops at a count of exactly k.
    if (m > r.k) {
      x = block_search_kth<kWarpsSel, uint64_t>(
          r.k, /*stop_exact=*/true, /*stop_at_most=*/0,
          [&](uint64_t t1, uint64_t t2, uint64_t t3, int& c1, int& c2, int& c3) {
            for (int i = tid; i < m; i += kSelectThreads) {
              const uint64_t e = src[i];
              c1 += e >= t1 ? 1 : 0;
              c2 += e >= t2 ? 1 : 0;
              c3 += e >= t3 ? 1 : 0;
            }
          },
          s_red3, parity, c);
    }
  }
  for (int i = tid; i < npow2; i += kSelectThreads) s_sort[i] = 0ull;  // zero padding sorts last
  __syncthreads();
  for (int i = tid; i < m; i += kSelectThreads) {
    const uint64_t e = src[i];
    if (e >= x) {
      const int slot = atomicAdd(&s_sel, 1);
      if (slot < r.k) s_sort[slot] = e;
    }
  }
  const int64_t row = r.row0 + g;
  const float* srow = r.scores + row * r.score_row_stride;
  const auto write = [&](int pos, uint64_t e) {
    const int idx = static_cast<int>(~static_cast<uint32_t>(e));
    r.values[row * r.k + pos] = srow[idx];
    r.indices[row * r.k + pos] = idx;
  };
  if (r.k <= kSelectThreads) {
    // Rank sort (the entries are distinct: an entry's position = the number above it). Each warp sorts its 32
    // entries (zero padding sorts last) in registers, then an entry's rank is its lane plus, for every other run,
    // the number of that run's entries above it (a binary search in the sorted run).
    __syncthreads();
    const int lane = tid % 32, warp = tid / 32, runs = (r.k + 31) / 32;
    uint64_t e = warp < runs ? s_sort[tid] : 0ull;  // (npow2 >= 32 * runs entries, zero padded)
    if (warp < runs) {
#pragma unroll
      for (int size = 2; size <= 32; size <<= 1) {
#pragma unroll
        for (int stride = size / 2; stride > 0; stride /= 2) {
          const uint64_t o = __shfl_xor_sync(0xffffffffu, e, stride);
          const bool desc = (lane & size) == 0;  // this pair's direction (size 32: descending)
          const bool low = (lane & stride) == 0;
          e = ((o > e) == (low == desc)) ? o : e;
        }
      }
    }
    __syncthreads();  // every run read before it is overwritten
    if (warp < runs) s_sort[tid] = e;
    __syncthreads();
    if (warp < runs && e != 0ull) {
      int rank = lane;
      for (int run = 0; run < runs; ++run) {
        if (run == warp) continue;
        const uint64_t* rs = s_sort + 32 * run;
        int lo = 0, hi = 32;  // entries of the run above e: the first position whose entry is < e
        while (lo < hi) {
          const int mid = (lo + hi) / 2;
          if (rs[mid] > e) {
            lo = mid + 1;
          } else {
            hi = mid;
          }
        }
        rank += lo;
      }
      write(rank, e);
    }
    return;
  }
  bitonic_sort_desc<kSelectThreads>(s_sort, npow2);  // (key desc, index asc); starts and ends with a barrier
  for (int j = tid; j < r.k; j += kSelectThreads) write(j, s_sort[j]);
}

struct TopkCandPlan {
  bool use;
  int chunks, q;
  int64_t group_rows, counts_off, cand_off, bytes;
  size_t select_smem;
};

TopkCandPlan make_cand_plan(const TopkParams& p) {
  TopkCandPlan t{};
  const int64_t n = p.n;
  t.chunks = static_cast<int>(n == 0 ? 1 : (n + kCandChunk - 1) / kCandChunk);
  t.q = cand_slots(p.k);
  if (t.q > kCandChunk) t.q = kCandChunk;
  t.use = t.chunks <= kSelectMaxChunks && static_cast<int64_t>(t.chunks) * t.q <= kSelectMaxCand;
  t.group_rows = p.rows < kRowGroup ? p.rows : kRowGroup;
  t.counts_off = 0;
  t.cand_off = (t.group_rows * t.chunks * 4 + 15) / 16 * 16;
  t.bytes = t.cand_off + t.group_rows * t.chunks * t.q * 8;
  int npow2 = 32;  // as topk_select
  while (npow2 < p.k) npow2 <<= 1;
  t.select_smem = static_cast<size_t>(npow2) * 8 + (p.k <= kSelectThreads ? 2 * p.k * 8 : 0) +
                  static_cast<size_t>(t.chunks) * t.q * 8 + (t.chunks + 1) * 4;
  return t;
}

void launch_topk_two_stage(const TopkParams& p, const TopkCandPlan& plan, cudaStream_t stream) {
  char* ws = static_cast<char*>(p.workspace);
  TopkCandRun r{};
  static_cast<TopkRows&>(r) = topk_rows_of(p);
  r.chunks = plan.chunks;
  r.q = plan.q;
  r.counts = reinterpret_cast<int*>(ws + plan.counts_off);
  r.cand = reinterpret_cast<uint64_t*>(ws + plan.cand_off);
  ensure_dynamic_smem(topk_select_kernel, plan.select_smem);
  for (int64_t row0 = 0; row0 < p.rows; row0 += plan.group_rows) {
    const int64_t g = p.rows - row0 < plan.group_rows ? p.rows - row0 : plan.group_rows;
    r.row0 = row0;
    const int items = static_cast<int>(g) * plan.chunks;
    const int ctas = items < p.num_sms ? items : (p.num_sms > 0 ? p.num_sms : 132);
    topk_chunk_candidates_kernel<<<static_cast<unsigned>(ctas), kCandThreads, 0, stream>>>(r, items);
    DEEPINFER_CHECK_LAUNCH("topk_chunk_candidates_kernel");
    topk_select_kernel<<<static_cast<unsigned>(g), kSelectThreads, plan.select_smem, stream>>>(r);
    DEEPINFER_CHECK_LAUNCH("topk_select_kernel");
  }
}

}  // namespace

int64_t topk_rows_workspace_bytes(const TopkParams& p) {
  if (p.rows == 0 || p.k == 0 || topk_detail::topk_row_cta_fits(p)) return 0;
  const TopkCandPlan cp = make_cand_plan(p);
  return cp.use ? cp.bytes : make_plan(p).bytes;
}

void launch_topk_rows(const TopkParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.k == 0) return;
  if (p.k > kMaxK || p.k > p.n || p.n >= (1 << 30)) {
    throw std::runtime_error("deepinfer topk_rows: need k <= min(n, 2048) and n < 2^30, got k = " +
                             std::to_string(p.k) + ", n = " + std::to_string(p.n));
  }
  if (topk_detail::topk_row_cta_fits(p)) {
    topk_detail::launch_topk_row_cta(p, stream);
    return;
  }
  const TopkCandPlan cp = make_cand_plan(p);
  const TopkPlan plan = cp.use ? TopkPlan{} : make_plan(p);
  const int64_t need = cp.use ? cp.bytes : plan.bytes;
  if (p.workspace == nullptr || p.workspace_bytes < need || !is_aligned(p.workspace, 16)) {
    throw std::runtime_error("deepinfer topk_rows: workspace missing, too small or not 16-byte aligned");
  }
  if (cp.use) {
    launch_topk_two_stage(p, cp, stream);
    return;
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
