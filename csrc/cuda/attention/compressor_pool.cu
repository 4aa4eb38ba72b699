#include "deepinfer/attention/compressor_pool.cuh"

namespace deepinfer::attention {
namespace {

// out[w, d] = sum_s kv[w, s, d] * softmax_s(gate[w, :, d]): pass 1 the max over the slots (exact in any order),
// pass 2 the exp-sum and the exp-weighted kv sum in slot order, one division, one rounding. Neighbouring threads take
// neighbouring d (coalesced rows of kv and gate).
template <typename T>
__global__ void __launch_bounds__(256) compressor_pool_kernel(CompressorPoolParams p) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= p.n * p.hd) return;
  const int64_t w = idx / p.hd, d = idx % p.hd;
  const float* g = p.gate + w * p.gate_n + d;
  const T* kv = static_cast<const T*>(p.kv) + w * p.kv_n + d;
  float m = -INFINITY;
  for (int64_t s = 0; s < p.S; ++s) m = fmaxf(m, g[s * p.gate_s]);
  float den = 0.f, num = 0.f;
  for (int64_t s = 0; s < p.S; ++s) {
    const float e = expf(g[s * p.gate_s] - m);
    den += e;
    num += e * to_float(kv[s * p.kv_s]);
  }
  if (!isfinite(num) && isfinite(den)) {
    // the exp-weighted sum overflowed (|kv| near FLT_MAX / S) though the weighted mean may be finite: redo it with kv
    // scaled by 2^-k (exact), 2^k >= 4 S, and scale the mean back; only such windows take this path, so every other
    // result keeps its bits (and inf / NaN kv still give inf / NaN)
    const int k = 2 + static_cast<int>(ceil(log2(static_cast<double>(p.S))));
    num = 0.f;
    for (int64_t s = 0; s < p.S; ++s) num += expf(g[s * p.gate_s] - m) * ldexpf(to_float(kv[s * p.kv_s]), -k);
    static_cast<T*>(p.out)[idx] = from_float<T>(ldexpf(num / den, k));
    return;
  }
  static_cast<T*>(p.out)[idx] = from_float<T>(num / den);
}

template <typename T>
__device__ __forceinline__ const T* source_row(const CompressorRows& p, const void* ring, const void* nw,
                                               int64_t new_ld, int64_t r) {
  if (r >= 0 && r < p.n_ring) {
    const int64_t s = p.ring_src[r];
    return s >= 0 && s < p.ring_slots ? static_cast<const T*>(ring) + s * p.C : nullptr;
  }
  r -= p.n_ring;
  return r >= 0 && r < p.new_rows ? static_cast<const T*>(nw) + r * new_ld : nullptr;
}

// compressor_pool over rows picked by index lists: the same arithmetic as compressor_pool_kernel on the slots that
// exist (a missing previous window's slots have weight 0 there: skipping them leaves every sum unchanged).
// dst < 0: the window is not written (a graph-mode pad or a window that does not close this step): zeros, no reads.
template <typename T>
__global__ void __launch_bounds__(256) compressor_pool_rows_kernel(CompressorPoolRowsParams p) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= p.n * p.hd) return;
  const int64_t w = idx / p.hd, d = idx % p.hd;
  T* out = static_cast<T*>(p.out) + idx;
  if (p.dst[w] < 0) {
    *out = from_float<T>(0.f);
    return;
  }
  const bool overlap = p.prev != nullptr;
  const int64_t m = p.m, S = overlap ? 2 * m : m, C = p.rows.C;
  const int64_t s0 = overlap && p.prev_ok[w] == 0 ? m : 0;
  auto slot = [&](int64_t s, const T*& kv, const T*& gate, int64_t& c, int64_t& a) {
    const bool second = overlap && s >= m;
    const int64_t r = overlap && !second ? p.prev[w * m + s] : p.cur[w * m + (second ? s - m : s)];
    c = (second ? p.hd : 0) + d;
    a = (second ? s - m : s) * C + c;
    kv = source_row<T>(p.rows, p.rows.ring_kv, p.rows.new_kv, p.rows.new_kv_ld, r);
    gate = source_row<T>(p.rows, p.rows.ring_gate, p.rows.new_gate, p.rows.new_gate_ld, r);
  };
  float mx = -INFINITY;
  for (int64_t s = s0; s < S; ++s) {
    const T *kv, *gate;
    int64_t c, a;
    slot(s, kv, gate, c, a);
    if (kv == nullptr) {
      *out = from_float<T>(NAN);
      return;
    }
    mx = fmaxf(mx, to_float(gate[c]) + p.ape[a]);
  }
  float den = 0.f, num = 0.f;
  for (int64_t s = s0; s < S; ++s) {
    const T *kv, *gate;
    int64_t c, a;
    slot(s, kv, gate, c, a);
    const float e = expf(to_float(gate[c]) + p.ape[a] - mx);
    den += e;
    num += e * to_float(kv[c]);
  }
  if (!isfinite(num) && isfinite(den)) {  // as compressor_pool_kernel: rescale an overflowed sum
    const int k = 2 + static_cast<int>(ceil(log2(static_cast<double>(S))));
    num = 0.f;
    for (int64_t s = s0; s < S; ++s) {
      const T *kv, *gate;
      int64_t c, a;
      slot(s, kv, gate, c, a);
      num += expf(to_float(gate[c]) + p.ape[a] - mx) * ldexpf(to_float(kv[c]), -k);
    }
    *out = from_float<T>(ldexpf(num / den, k));
    return;
  }
  *out = from_float<T>(num / den);
}

// One thread per (state row, element): ring[st_dst[i]] = all[st_src[i]] for kv and gate; st_dst < 0 or past the
// ring: skipped. The plan never writes a slot that a ring read of the same call uses (see compressor.py).
template <typename T>
__global__ void __launch_bounds__(256) compressor_state_write_kernel(CompressorStateWriteParams p) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t C = p.rows.C;
  if (idx >= p.n_st * C) return;
  const int64_t i = idx / C, c = idx % C;
  const int64_t d = p.st_dst[i];
  if (d < 0 || d >= p.rows.ring_slots) return;
  const T* k = source_row<T>(p.rows, p.rows.ring_kv, p.rows.new_kv, p.rows.new_kv_ld, p.st_src[i]);
  const T* g = source_row<T>(p.rows, p.rows.ring_gate, p.rows.new_gate, p.rows.new_gate_ld, p.st_src[i]);
  static_cast<T*>(p.ring_kv)[d * C + c] = k ? k[c] : from_float<T>(NAN);
  static_cast<T*>(p.ring_gate)[d * C + c] = g ? g[c] : from_float<T>(NAN);
}

}  // namespace

void launch_compressor_pool(const CompressorPoolParams& p, cudaStream_t stream) {
  const int64_t total = p.n * p.hd;
  if (total == 0) return;
  const dim3 grid(static_cast<unsigned>((total + 255) / 256));
  DEEPINFER_DISPATCH_FLOAT(p.dtype, [&] { compressor_pool_kernel<scalar_t><<<grid, 256, 0, stream>>>(p); });
  DEEPINFER_CHECK_LAUNCH("compressor_pool_kernel");
}

void launch_compressor_pool_rows(const CompressorPoolRowsParams& p, cudaStream_t stream) {
  const int64_t total = p.n * p.hd;
  if (total == 0) return;
  const dim3 grid(static_cast<unsigned>((total + 255) / 256));
  DEEPINFER_DISPATCH_FLOAT(p.rows.dtype, [&] { compressor_pool_rows_kernel<scalar_t><<<grid, 256, 0, stream>>>(p); });
  DEEPINFER_CHECK_LAUNCH("compressor_pool_rows_kernel");
}

void launch_compressor_state_write(const CompressorStateWriteParams& p, cudaStream_t stream) {
  const int64_t total = p.n_st * p.rows.C;
  if (total == 0) return;
  const dim3 grid(static_cast<unsigned>((total + 255) / 256));
  DEEPINFER_DISPATCH_FLOAT(p.rows.dtype, [&] { compressor_state_write_kernel<scalar_t><<<grid, 256, 0, stream>>>(p); });
  DEEPINFER_CHECK_LAUNCH("compressor_state_write_kernel");
}

}  // namespace deepinfer::attention
