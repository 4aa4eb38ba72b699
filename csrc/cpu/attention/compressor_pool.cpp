// CPU compressor_pool: each (window, dim) on its own over the window's slots in slot order, float32, scalar libm exp.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <algorithm>
#include <limits>
#include <optional>
#include <vector>

#include "common/attention_checks.h"
#include "ops.h"

namespace deepinfer {
namespace {

template <typename T>
void pool_windows(at::Tensor& out, const at::Tensor& kv, const at::Tensor& gate) {
  const int64_t n = kv.size(0), S = kv.size(1), hd = kv.size(2);
  const int64_t kv_n = kv.stride(0), kv_s = kv.stride(1), g_n = gate.stride(0), g_s = gate.stride(1);
  const T* kp = kv.const_data_ptr<T>();
  const float* gp = gate.const_data_ptr<float>();
  T* o = out.mutable_data_ptr<T>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t d = 0; d < hd; ++d) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < S; ++s) m = std::fmax(m, gp[w * g_n + s * g_s + d]);
        float den = 0.f, num = 0.f;
        for (int64_t s = 0; s < S; ++s) {
          const float e = std::exp(gp[w * g_n + s * g_s + d] - m);
          den += e;
          num += e * static_cast<float>(kp[w * kv_n + s * kv_s + d]);
        }
        if (!std::isfinite(num) && std::isfinite(den)) {
          // the exp-weighted sum overflowed (|kv| near FLT_MAX / S) though the weighted mean may be finite: redo it
          // with kv scaled by 2^-k (exact), 2^k >= 4 S, and scale the mean back; taken only for such windows, so
          // every other result keeps its bits (and inf / NaN kv still give inf / NaN)
          const int k = 2 + static_cast<int>(std::ceil(std::log2(static_cast<double>(S))));
          num = 0.f;
          for (int64_t s = 0; s < S; ++s) {
            const float e = std::exp(gp[w * g_n + s * g_s + d] - m);
            num += e * std::ldexp(static_cast<float>(kp[w * kv_n + s * kv_s + d]), -k);
          }
          o[w * hd + d] = static_cast<T>(std::ldexp(num / den, k));
          continue;
        }
        o[w * hd + d] = static_cast<T>(num / den);
      }
    }
  });
}

// Row r of all = cat(ring[ring_src], new): a pointer to its C elements, or nullptr when r or ring_src[r] is out of
// range.
template <typename T>
const T* source_row(const T* ring, int64_t ring_slots, const T* nw, int64_t new_rows, int64_t new_ld,
                    const int64_t* ring_src, int64_t n_ring, int64_t C, int64_t r) {
  if (r >= 0 && r < n_ring) {
    const int64_t s = ring_src[r];
    return s >= 0 && s < ring_slots ? ring + s * C : nullptr;
  }
  r -= n_ring;
  return r >= 0 && r < new_rows ? nw + r * new_ld : nullptr;
}

template <typename T>
void pool_rows(at::Tensor& out, const at::Tensor& ring_kv, const at::Tensor& ring_gate, const at::Tensor& new_kv,
               const at::Tensor& new_gate, const at::Tensor& ape, const at::Tensor& ring_src, const at::Tensor& cur,
               const std::optional<at::Tensor>& prev, const std::optional<at::Tensor>& prev_ok,
               const at::Tensor& dst) {
  const int64_t n = cur.size(0), m = cur.size(1), C = ring_kv.size(1), slots = ring_kv.size(0);
  const bool overlap = prev.has_value();
  const int64_t hd = overlap ? C / 2 : C, S = overlap ? 2 * m : m;
  const int64_t n_ring = ring_src.size(0), new_rows = new_kv.size(0);
  const T *rk = ring_kv.const_data_ptr<T>(), *rg = ring_gate.const_data_ptr<T>();
  const T *nk = new_kv.const_data_ptr<T>(), *ng = new_gate.const_data_ptr<T>();
  const int64_t ldk = new_kv.stride(0), ldg = new_gate.stride(0);
  const int64_t* rs = ring_src.const_data_ptr<int64_t>();
  const int64_t* cp = cur.const_data_ptr<int64_t>();
  const int64_t* pp = overlap ? prev->const_data_ptr<int64_t>() : nullptr;
  const int64_t* pok = overlap ? prev_ok->const_data_ptr<int64_t>() : nullptr;
  const int64_t* dp = dst.const_data_ptr<int64_t>();
  const float* ap = ape.const_data_ptr<float>();
  T* o = out.mutable_data_ptr<T>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<const T*> kv_rows(S), gate_rows(S);
    std::vector<int64_t> chan(S), ape_off(S);
    for (int64_t w = begin; w < end; ++w) {
      T* ow = o + w * hd;
      if (dp[w] < 0) {
        std::fill(ow, ow + hd, static_cast<T>(0.f));
        continue;
      }
      // the window's slots in order (CSA: the previous window's Ca half, then its own Cb half)
      int64_t used = 0;
      bool bad = false;
      for (int64_t s = 0; s < S; ++s) {
        int64_t r;
        if (overlap && s < m) {
          if (pok[w] == 0) continue;  // no previous window: weight 0
          r = pp[w * m + s];
        } else {
          r = cp[w * m + (overlap ? s - m : s)];
        }
        const int64_t c0 = overlap && s >= m ? hd : 0;
        kv_rows[used] = source_row(rk, slots, nk, new_rows, ldk, rs, n_ring, C, r);
        gate_rows[used] = source_row(rg, slots, ng, new_rows, ldg, rs, n_ring, C, r);
        bad |= kv_rows[used] == nullptr;
        chan[used] = c0;
        ape_off[used] = (overlap && s >= m ? s - m : s) * C + c0;
        ++used;
      }
      if (bad) {
        std::fill(ow, ow + hd, static_cast<T>(std::numeric_limits<float>::quiet_NaN()));
        continue;
      }
      for (int64_t d = 0; d < hd; ++d) {
        auto gate = [&](int64_t u) { return static_cast<float>(gate_rows[u][chan[u] + d]) + ap[ape_off[u] + d]; };
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t u = 0; u < used; ++u) mx = std::fmax(mx, gate(u));
        float den = 0.f, num = 0.f;
        for (int64_t u = 0; u < used; ++u) {
          const float e = std::exp(gate(u) - mx);
          den += e;
          num += e * static_cast<float>(kv_rows[u][chan[u] + d]);
        }
        if (!std::isfinite(num) && std::isfinite(den)) {  // as compressor_pool: rescale an overflowed sum
          const int k = 2 + static_cast<int>(std::ceil(std::log2(static_cast<double>(S))));
          num = 0.f;
          for (int64_t u = 0; u < used; ++u)
            num += std::exp(gate(u) - mx) * std::ldexp(static_cast<float>(kv_rows[u][chan[u] + d]), -k);
          ow[d] = static_cast<T>(std::ldexp(num / den, k));
          continue;
        }
        ow[d] = static_cast<T>(num / den);
      }
    }
  });
}

template <typename T>
void state_write(at::Tensor& ring_kv, at::Tensor& ring_gate, const at::Tensor& new_kv, const at::Tensor& new_gate,
                 const at::Tensor& ring_src, const at::Tensor& st_src, const at::Tensor& st_dst) {
  const int64_t C = ring_kv.size(1), slots = ring_kv.size(0), n_st = st_src.size(0);
  const int64_t n_ring = ring_src.size(0), new_rows = new_kv.size(0);
  T *rk = ring_kv.mutable_data_ptr<T>(), *rg = ring_gate.mutable_data_ptr<T>();
  const T *nk = new_kv.const_data_ptr<T>(), *ng = new_gate.const_data_ptr<T>();
  const int64_t* rs = ring_src.const_data_ptr<int64_t>();
  const int64_t *sp = st_src.const_data_ptr<int64_t>(), *dp = st_dst.const_data_ptr<int64_t>();
  at::parallel_for(0, n_st, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t d = dp[i];
      if (d < 0 || d >= slots) continue;
      const T* k = source_row<T>(rk, slots, nk, new_rows, new_kv.stride(0), rs, n_ring, C, sp[i]);
      const T* g = source_row<T>(rg, slots, ng, new_rows, new_gate.stride(0), rs, n_ring, C, sp[i]);
      for (int64_t c = 0; c < C; ++c) {
        rk[d * C + c] = k ? k[c] : static_cast<T>(std::numeric_limits<float>::quiet_NaN());
        rg[d * C + c] = g ? g[c] : static_cast<T>(std::numeric_limits<float>::quiet_NaN());
      }
    }
  });
}

}  // namespace

void compressor_pool_cpu(at::Tensor& out, const at::Tensor& kv, const at::Tensor& gate) {
  check_compressor_pool(out, kv, gate);
  if (out.numel() == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv.scalar_type(), "compressor_pool_cpu",
                                  [&] { pool_windows<scalar_t>(out, kv, gate); });
}

void compressor_pool_rows_cpu(at::Tensor& out, const at::Tensor& ring_kv, const at::Tensor& ring_gate,
                              const at::Tensor& new_kv, const at::Tensor& new_gate, const at::Tensor& ape,
                              const at::Tensor& ring_src, const at::Tensor& cur, const std::optional<at::Tensor>& prev,
                              const std::optional<at::Tensor>& prev_ok, const at::Tensor& dst) {
  check_compressor_pool_rows(out, ring_kv, ring_gate, new_kv, new_gate, ape, ring_src, cur, prev, prev_ok, dst);
  if (out.numel() == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, ring_kv.scalar_type(), "compressor_pool_rows_cpu", [&] {
    pool_rows<scalar_t>(out, ring_kv, ring_gate, new_kv, new_gate, ape, ring_src, cur, prev, prev_ok, dst);
  });
}

void compressor_state_write_cpu(at::Tensor& ring_kv, at::Tensor& ring_gate, const at::Tensor& new_kv,
                                const at::Tensor& new_gate, const at::Tensor& ring_src, const at::Tensor& st_src,
                                const at::Tensor& st_dst) {
  check_compressor_state_write(ring_kv, ring_gate, new_kv, new_gate, ring_src, st_src, st_dst);
  if (st_src.numel() == 0 || ring_kv.numel() == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, ring_kv.scalar_type(), "compressor_state_write_cpu",
                                  [&] { state_write<scalar_t>(ring_kv, ring_gate, new_kv, new_gate, ring_src, st_src,
                                                              st_dst); });
}

}  // namespace deepinfer
