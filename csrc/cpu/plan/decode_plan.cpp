// decode_plan_fill: the host lists of a graph-mode decode step (DeepSeek-V4 step plan), written into one int64
// buffer in the order PlanBuilder._chunks lays them out. A loop over the sequences in place of numpy calls: the
// lists are what PlanBuilder._chunks and PlanBuilder._decode_compressor_lists compute for the same step (tested
// equal, entry for entry). Host data only; every table lookup is bounds-checked.
#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "common/checks.h"
#include "ops.h"

namespace deepinfer {
namespace {

constexpr const char* kOp = "decode_plan_fill";

void check_i64(const at::Tensor& t, const char* name, int64_t dim) {
  DEEPINFER_CHECK(t.device().is_cpu(), kOp, name, " must be a CPU tensor");
  DEEPINFER_CHECK(t.scalar_type() == at::kLong, kOp, name, " must be int64");
  DEEPINFER_CHECK(t.dim() == dim, kOp, name, " must be ", dim, "-D, got ", t.dim(), "-D");
}

struct Table {  // a [rows, cols] int64 view with checked reads
  const int64_t* p;
  int64_t rows, cols, s0, s1;
  const char* name;
  int64_t at(int64_t r, int64_t c) const {
    DEEPINFER_CHECK(r >= 0 && r < rows && c >= 0 && c < cols, kOp, name, ": entry [", r, ", ", c,
                    "] is outside its shape [", rows, ", ", cols, "]");
    return p[r * s0 + c * s1];
  }
};

Table table(const at::Tensor& t, const char* name) {
  return {t.const_data_ptr<int64_t>(), t.size(0), t.size(1), t.stride(0), t.stride(1), name};
}

}  // namespace

void decode_plan_fill_cpu(at::Tensor& out, const at::Tensor& c0, const at::Tensor& block_tables,
                          const at::Tensor& window_tables, const at::Tensor& shared_len, const at::Tensor& input_ids,
                          const at::Tensor& logits_indices, int64_t num_rows, int64_t max_blocks, int64_t block_size,
                          int64_t lookback, at::IntArrayRef ratios, at::IntArrayRef overlaps) {
  check_i64(out, "out", 1);
  DEEPINFER_CHECK(out.is_contiguous(), kOp, "out must be contiguous");
  check_i64(c0, "c0", 1);
  check_i64(block_tables, "block_tables", 2);
  check_i64(window_tables, "window_tables", 2);
  check_i64(shared_len, "shared_len", 1);
  check_i64(input_ids, "input_ids", 1);
  check_i64(logits_indices, "logits_indices", 1);
  const int64_t S = c0.size(0), n = num_rows, B = block_size;
  DEEPINFER_CHECK(S <= n, kOp, S, " sequences do not fit num_rows=", n);
  DEEPINFER_CHECK(B > 0 && lookback >= 0 && max_blocks > 0, kOp, "block_size, max_blocks must be > 0, lookback >= 0");
  DEEPINFER_CHECK(block_tables.size(0) == S && window_tables.size(0) == S, kOp,
                  "block_tables and window_tables must have one row per sequence (", S, ")");
  DEEPINFER_CHECK(shared_len.size(0) == 0 || shared_len.size(0) == S, kOp, "shared_len must be empty or [", S, "]");
  DEEPINFER_CHECK(input_ids.size(0) == 0 || input_ids.size(0) == S, kOp, "input_ids must be empty or [", S, "]");
  DEEPINFER_CHECK(logits_indices.size(0) <= n, kOp, "more logits_indices than num_rows");
  DEEPINFER_CHECK(ratios.size() == overlaps.size(), kOp, "ratios and overlaps must have the same length");
  const int64_t nb = max_blocks, nwb = (lookback + B - 1) / B + 1;
  int64_t total = n * (6 + nb + nwb);
  for (size_t r = 0; r < ratios.size(); ++r) {
    const int64_t m = ratios[r];
    DEEPINFER_CHECK(m > 0 && B % m == 0, kOp, "ratio ", m, " must divide block_size ", B);
    const int64_t R = overlaps[r] ? 2 * m : m;
    total += n * (R - 1) + n * m + 2 * n + 2 * n * R + (overlaps[r] ? n * m + n : 0);
  }
  DEEPINFER_CHECK(out.numel() == total, kOp, "out holds ", out.numel(), " entries, the plan needs ", total);

  const int64_t* p = c0.const_data_ptr<int64_t>();
  const int64_t* shared = shared_len.size(0) ? shared_len.const_data_ptr<int64_t>() : nullptr;
  const Table bt = table(block_tables, "block_tables"), wt = table(window_tables, "window_tables");
  std::vector<int64_t> need(S), w0(S), seq_bt(S * nb, -1), seq_wbt(S * nwb, -1);
  for (int64_t i = 0; i < S; ++i) {
    DEEPINFER_CHECK(p[i] >= 0, kOp, "c0[", i, "] must be >= 0, got ", p[i]);
    need[i] = (p[i] + 1 + B - 1) / B;
    w0[i] = std::max<int64_t>(p[i] - lookback, 0) / B;
    for (int64_t c = 0; c < std::min(nb, bt.cols); ++c)
      if (c < need[i]) seq_bt[i * nb + c] = bt.at(i, c);
    for (int64_t k = 0; k < nwb; ++k) {
      const int64_t col = w0[i] + k;
      if (col < need[i] && col < wt.cols) seq_wbt[i * nwb + k] = wt.at(i, col);
    }
  }
  auto sbt = [&](int64_t i, int64_t c) {
    DEEPINFER_CHECK(c >= 0 && c < nb, kOp, "sequence ", i, " reads block column ", c, " past max_blocks ", nb);
    return seq_bt[i * nb + c];
  };
  auto swbt = [&](int64_t i, int64_t k) {
    DEEPINFER_CHECK(k >= 0 && k < nwb, kOp, "sequence ", i, " reads window column ", k, " past ", nwb);
    return seq_wbt[i * nwb + k];
  };

  int64_t* o = out.mutable_data_ptr<int64_t>();
  int64_t* positions = o;
  int64_t* slots = positions + n;
  int64_t* tok_bt = slots + n;
  int64_t* tok_wbt = tok_bt + n * nb;
  int64_t* win_base = tok_wbt + n * nwb;
  int64_t* li = win_base + n;
  int64_t* ids = li + n;
  int64_t* row_valid = ids + n;
  int64_t* next = row_valid + n;
  std::fill(o, next, 0);
  std::fill(slots, slots + n, -1);
  std::fill(tok_bt, tok_bt + n * nb, -1);
  std::fill(tok_wbt, tok_wbt + n * nwb, -1);
  for (int64_t i = 0; i < S; ++i) {
    positions[i] = p[i];
    std::copy(seq_bt.begin() + i * nb, seq_bt.begin() + (i + 1) * nb, tok_bt + i * nb);
    std::copy(seq_wbt.begin() + i * nwb, seq_wbt.begin() + (i + 1) * nwb, tok_wbt + i * nwb);
    win_base[i] = w0[i];
    slots[i] = swbt(i, p[i] / B - w0[i]) * B + p[i] % B;
    row_valid[i] = 1;
    if (input_ids.size(0)) ids[i] = input_ids.const_data_ptr<int64_t>()[i];
  }
  const int64_t* lip = logits_indices.const_data_ptr<int64_t>();
  std::copy(lip, lip + logits_indices.size(0), li);

  for (size_t r = 0; r < ratios.size(); ++r) {
    const int64_t m = ratios[r];
    const bool overlap = overlaps[r] != 0;
    const int64_t R = overlap ? 2 * m : m, per_block = B / m, n_ring = n * (R - 1);
    int64_t* ring_src = next;
    int64_t* cur = ring_src + n_ring;
    int64_t* w_pos = cur + n * m;
    int64_t* dst = w_pos + n;
    int64_t* st_src = dst + n;
    int64_t* st_dst = st_src + n * R;
    int64_t* prev = st_dst + n * R;
    int64_t* prev_ok = prev + (overlap ? n * m : 0);
    next = prev_ok + (overlap ? n : 0);
    std::fill(ring_src, next, 0);
    std::fill(dst, dst + n, -1);
    std::fill(st_dst, st_dst + n * R, -1);
    int64_t n_close = 0, n_st = 0;
    for (int64_t i = 0; i < S; ++i) {
      const int64_t pi = p[i];
      const int64_t s0 = overlap ? std::max<int64_t>(0, (pi / m) * m - m) : (pi / m) * m;
      const bool closes = (pi + 1) % m == 0;
      const int64_t r0 = overlap ? std::max<int64_t>(0, ((pi + 1) / m) * m - m) : ((pi + 1) / m) * m;
      const bool same = pi > 0 && pi % B != 0;
      const int64_t st = same ? std::max(r0, pi) : r0;
      const int64_t n_read = (pi > s0 && (closes || st < pi)) ? pi - s0 : 0;
      const int64_t blk_prev = std::max<int64_t>(swbt(i, std::max<int64_t>(pi - 1, 0) / B - w0[i]), 0);
      for (int64_t k = 0; k < n_read && k < R - 1; ++k) ring_src[i * (R - 1) + k] = blk_prev * R + (s0 + k) % R;
      const int64_t base = i * (R - 1);
      auto row = [&](int64_t pos) { return pos >= pi ? n_ring + i : base + pos - s0; };
      if (closes) {
        const int64_t w = pi / m, c = n_close++;
        for (int64_t t = 0; t < m; ++t) cur[c * m + t] = row(w * m + t);
        w_pos[c] = w * m;
        dst[c] = (shared != nullptr && (w + 1) * m <= shared[i]) ? -1 : sbt(i, (w * m) / B) * per_block + w % per_block;
        if (overlap) {
          for (int64_t t = 0; t < m; ++t) prev[c * m + t] = w >= 1 ? row(w * m - m + t) : 0;
          prev_ok[c] = w >= 1 ? 1 : 0;
        }
      }
      const int64_t ring = swbt(i, pi / B - w0[i]);
      for (int64_t j = 0; j < R; ++j) {
        const int64_t pos = st + j;
        if (pos > pi) break;
        st_src[n_st] = row(pos);
        st_dst[n_st++] = ring * R + pos % R;
      }
    }
  }
}

}  // namespace deepinfer
