// decode_plan_fill: the host lists of a graph-mode decode step (DeepSeek-V4 step plan), written into one int64
// buffer in the order PlanBuilder._chunks lays them out: one token per sequence (a plain decode) or up to
// tokens_per_seq (a speculative verification, the MTP pass over kept positions). A loop over the sequences in
// place of numpy calls: the lists are what PlanBuilder._chunks and PlanBuilder._compressor_lists compute for the
// same step at the same capacity (tested equal, entry for entry). Host data only; every table lookup is
// bounds-checked.
#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "common/checks.h"
#include "cpu/plan/host_args.h"
#include "ops.h"

namespace deepinfer {
namespace {

constexpr const char* kOp = "decode_plan_fill";

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

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// the first ring row a compressor of ratio m keeps for the windows open at position p
int64_t open_start(int64_t p, int64_t m, bool overlap) {
  return overlap ? std::max<int64_t>(0, (p / m) * m - m) : (p / m) * m;
}

int64_t decode_plan_size(int64_t num_seqs, int64_t tokens_per_seq, int64_t max_blocks, int64_t block_size,
                         int64_t lookback, at::IntArrayRef ratios, at::IntArrayRef overlaps) {
  const int64_t n = num_seqs, q = tokens_per_seq, B = block_size, rows = n * q;
  const int64_t nwb = ceil_div(lookback + q - 1, B) + 1;
  int64_t total = rows * (6 + max_blocks + nwb);
  for (size_t r = 0; r < ratios.size(); ++r) {
    const int64_t m = ratios[r], R = overlaps[r] ? 2 * m : m;
    const int64_t close = n * ceil_div(q, m), st = n * R * (1 + ceil_div(q - 1, B));
    total += n * (R - 1) + close * (m + 2) + 2 * st + (overlaps[r] ? close * (m + 1) : 0);
  }
  return total;
}

}  // namespace

void decode_plan_fill_cpu(at::Tensor& out, const at::Tensor& c0, const at::Tensor& query_lens,
                          const at::Tensor& row_starts, const at::Tensor& block_tables, const at::Tensor& window_tables,
                          const at::Tensor& shared_len, const at::Tensor& input_ids, const at::Tensor& logits_indices,
                          int64_t num_seqs, int64_t tokens_per_seq, int64_t max_blocks, int64_t block_size,
                          int64_t lookback, at::IntArrayRef ratios, at::IntArrayRef overlaps) {
  check_host_i64(kOp, out, "out", 1);
  DEEPINFER_CHECK(out.is_contiguous(), kOp, "out must be contiguous");
  check_host_i64(kOp, c0, "c0", 1);
  check_host_i64(kOp, query_lens, "query_lens", 1);
  check_host_i64(kOp, row_starts, "row_starts", 1);
  check_host_i64(kOp, block_tables, "block_tables", 2);
  check_host_i64(kOp, window_tables, "window_tables", 2);
  check_host_i64(kOp, shared_len, "shared_len", 1);
  check_host_i64(kOp, input_ids, "input_ids", 1);
  check_host_i64(kOp, logits_indices, "logits_indices", 1);
  const int64_t S = c0.size(0), n = num_seqs, qc = tokens_per_seq, B = block_size, rows = n * qc;
  DEEPINFER_CHECK(S <= n, kOp, S, " sequences do not fit num_seqs=", n);
  DEEPINFER_CHECK(B > 0 && lookback >= 0 && max_blocks > 0, kOp, "block_size, max_blocks must be > 0, lookback >= 0");
  DEEPINFER_CHECK(qc >= 1 && qc <= B, kOp, "tokens_per_seq must be in [1, block_size=", B, "], got ", qc);
  DEEPINFER_CHECK(query_lens.size(0) == 0 || query_lens.size(0) == S, kOp, "query_lens must be empty or [", S, "]");
  DEEPINFER_CHECK(row_starts.size(0) == 0 || row_starts.size(0) == S, kOp, "row_starts must be empty or [", S, "]");
  DEEPINFER_CHECK(block_tables.size(0) == S && window_tables.size(0) == S, kOp,
                  "block_tables and window_tables must have one row per sequence (", S, ")");
  DEEPINFER_CHECK(shared_len.size(0) == 0 || shared_len.size(0) == S, kOp, "shared_len must be empty or [", S, "]");
  DEEPINFER_CHECK(logits_indices.size(0) <= rows, kOp, "more logits_indices than rows (", rows, ")");
  DEEPINFER_CHECK(ratios.size() == overlaps.size(), kOp, "ratios and overlaps must have the same length");
  for (size_t r = 0; r < ratios.size(); ++r)
    DEEPINFER_CHECK(ratios[r] > 0 && B % ratios[r] == 0, kOp, "ratio ", ratios[r], " must divide block_size ", B);
  const int64_t* ql = query_lens.size(0) ? query_lens.const_data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; ql != nullptr && i < S; ++i)
    DEEPINFER_CHECK(ql[i] >= 1 && ql[i] <= qc, kOp, "query_lens[", i, "]=", ql[i], " must be in [1, ", qc, "]");
  const int64_t total = decode_plan_size(n, qc, max_blocks, B, lookback, ratios, overlaps);
  DEEPINFER_CHECK(out.numel() == total, kOp, "out holds ", out.numel(), " entries, the plan needs ", total);

  const int64_t* p = c0.const_data_ptr<int64_t>();
  const int64_t* shared = shared_len.size(0) ? shared_len.const_data_ptr<int64_t>() : nullptr;
  const Table bt = table(block_tables, "block_tables"), wt = table(window_tables, "window_tables");
  const int64_t nb = max_blocks, nwb = ceil_div(lookback + qc - 1, B) + 1;
  std::vector<int64_t> q(S), L(S), start(S), w0(S), seq_bt(S * nb, -1), seq_wbt(S * nwb, -1);
  int64_t T = 0;
  for (int64_t i = 0; i < S; ++i) {
    DEEPINFER_CHECK(p[i] >= 0, kOp, "c0[", i, "] must be >= 0, got ", p[i]);
    q[i] = ql ? ql[i] : 1;
    start[i] = T;
    T += q[i];
    L[i] = p[i] + q[i];
    const int64_t need = ceil_div(L[i], B);
    w0[i] = std::max<int64_t>(p[i] - lookback, 0) / B;
    for (int64_t c = 0; c < std::min(nb, bt.cols); ++c)
      if (c < need) seq_bt[i * nb + c] = bt.at(i, c);
    for (int64_t k = 0; k < nwb; ++k) {
      const int64_t col = w0[i] + k;
      if (col < need && col < wt.cols) seq_wbt[i * nwb + k] = wt.at(i, col);
    }
  }
  DEEPINFER_CHECK(input_ids.size(0) == 0 || input_ids.size(0) == T, kOp, "input_ids must be empty or [", T, "]");
  const int64_t* rs = row_starts.size(0) ? row_starts.const_data_ptr<int64_t>() : start.data();
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
  int64_t* slots = positions + rows;
  int64_t* tok_bt = slots + rows;
  int64_t* tok_wbt = tok_bt + rows * nb;
  int64_t* win_base = tok_wbt + rows * nwb;
  int64_t* li = win_base + rows;
  int64_t* ids = li + rows;
  int64_t* row_valid = ids + rows;
  int64_t* next = row_valid + rows;
  std::fill(o, next, 0);
  std::fill(slots, slots + rows, -1);
  std::fill(tok_bt, tok_bt + rows * nb, -1);
  std::fill(tok_wbt, tok_wbt + rows * nwb, -1);
  for (int64_t i = 0; i < S; ++i) {
    for (int64_t j = 0; j < q[i]; ++j) {
      const int64_t t = start[i] + j, pos = p[i] + j;
      positions[t] = pos;
      std::copy(seq_bt.begin() + i * nb, seq_bt.begin() + (i + 1) * nb, tok_bt + t * nb);
      std::copy(seq_wbt.begin() + i * nwb, seq_wbt.begin() + (i + 1) * nwb, tok_wbt + t * nwb);
      win_base[t] = w0[i];
      slots[t] = swbt(i, pos / B - w0[i]) * B + pos % B;
      row_valid[t] = 1;
    }
  }
  if (input_ids.size(0)) std::copy(input_ids.const_data_ptr<int64_t>(), input_ids.const_data_ptr<int64_t>() + T, ids);
  const int64_t* lip = logits_indices.const_data_ptr<int64_t>();
  std::copy(lip, lip + logits_indices.size(0), li);

  for (size_t r = 0; r < ratios.size(); ++r) {
    const int64_t m = ratios[r];
    const bool overlap = overlaps[r] != 0;
    const int64_t R = overlap ? 2 * m : m, per_block = B / m, n_ring = n * (R - 1);
    const int64_t close_cap = n * ceil_div(qc, m), st_cap = n * R * (1 + ceil_div(qc - 1, B));
    int64_t* ring_src = next;
    int64_t* cur = ring_src + n_ring;
    int64_t* w_pos = cur + close_cap * m;
    int64_t* dst = w_pos + close_cap;
    int64_t* st_src = dst + close_cap;
    int64_t* st_dst = st_src + st_cap;
    int64_t* prev = st_dst + st_cap;
    int64_t* prev_ok = prev + (overlap ? close_cap * m : 0);
    next = prev_ok + (overlap ? close_cap : 0);
    std::fill(ring_src, next, 0);
    std::fill(dst, dst + close_cap, -1);
    std::fill(st_dst, st_dst + st_cap, -1);
    int64_t n_close = 0, n_st = 0;
    for (int64_t i = 0; i < S; ++i) {
      const int64_t ci = p[i], Li = L[i], s0 = open_start(ci, m, overlap), base = i * (R - 1);
      // the state as of E goes to the ring of the block of E - 1: every block end the step crosses, then L
      int64_t ends[2], starts_w[2], n_ends = 0;
      for (int64_t E = (ci / B + 1) * B; E < Li; E += B) ends[n_ends++] = E;  // at most one: q <= block_size
      ends[n_ends++] = Li;
      bool read = ci > s0 && Li / m > ci / m;
      for (int64_t e = 0; e < n_ends; ++e) {
        const bool same = ci > 0 && (ends[e] - 1) / B == (ci - 1) / B;
        const int64_t r0 = open_start(ends[e], m, overlap);
        starts_w[e] = same ? std::max(r0, ci) : r0;
        read = read || (ci > s0 && starts_w[e] < ci);
      }
      if (read) {
        const int64_t blk = std::max<int64_t>(swbt(i, (ci - 1) / B - w0[i]), 0);
        for (int64_t pos = s0; pos < ci; ++pos) ring_src[base + pos - s0] = blk * R + pos % R;
      }
      // ring rows as they are, the step's new-token rows after every ring row
      auto row = [&](int64_t pos) { return pos >= ci ? n_ring + rs[i] + pos - ci : base + pos - s0; };
      for (int64_t w = ci / m; w < Li / m; ++w) {
        const int64_t c = n_close++;
        for (int64_t t = 0; t < m; ++t) cur[c * m + t] = row(w * m + t);
        w_pos[c] = w * m;
        dst[c] = (shared != nullptr && (w + 1) * m <= shared[i]) ? -1 : sbt(i, (w * m) / B) * per_block + w % per_block;
        if (overlap) {
          for (int64_t t = 0; t < m; ++t) prev[c * m + t] = w >= 1 ? row(w * m - m + t) : 0;
          prev_ok[c] = w >= 1 ? 1 : 0;
        }
      }
      for (int64_t e = 0; e < n_ends; ++e) {
        const int64_t ring = swbt(i, (ends[e] - 1) / B - w0[i]);
        for (int64_t pos = starts_w[e]; pos < ends[e]; ++pos) {
          st_src[n_st] = row(pos);
          st_dst[n_st++] = ring * R + pos % R;
        }
      }
    }
  }
}

}  // namespace deepinfer
