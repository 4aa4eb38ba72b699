// step_tables_check: PlanBuilder.check_arrays's verdict on a step's block tables, in one loop instead of ~40 numpy
// calls (engine/deepinfer/models/deepseek_v4/plan.py holds the rules and the messages; on a fault the engine reruns
// its per-sequence checks to name it). Host data only.
//
// A step is valid when every sequence adds at least one token at a position >= 0, its context fits the tables and
// max_positions, its prefix-cache and window-floor positions are whole blocks, and for each cache group the blocks
// its context reads lie in [0, limit), no row lists a block twice, and a block a row writes is read by no other row.
#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "common/checks.h"
#include "cpu/plan/host_args.h"
#include "ops.h"

namespace deepinfer {
namespace {

constexpr const char* kOp = "step_tables_check";

struct Rows {  // a [rows, cols] int64 view
  const int64_t* p;
  int64_t s0, s1, cols;
  int64_t at(int64_t r, int64_t c) const { return p[r * s0 + c * s1]; }
};

// Block id -> the row that writes it, for the few blocks a step writes (open addressing, linear probing).
class Owners {
 public:
  void reset(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    keys_.assign(cap, -1);
    rows_.resize(cap);
    mask_ = cap - 1;
  }
  // false when another row already writes block b
  bool claim(int64_t b, int64_t row) {
    for (size_t h = hash(b);; h = (h + 1) & mask_) {
      if (keys_[h] == -1) {
        keys_[h] = b;
        rows_[h] = row;
        return true;
      }
      if (keys_[h] == b) return rows_[h] == row;
    }
  }
  int64_t owner(int64_t b) const {  // -1: no row writes it
    for (size_t h = hash(b);; h = (h + 1) & mask_) {
      if (keys_[h] == -1) return -1;
      if (keys_[h] == b) return rows_[h];
    }
  }

 private:
  size_t hash(int64_t b) const { return (static_cast<uint64_t>(b) * 0x9E3779B97F4A7C15ull >> 32) & mask_; }
  std::vector<int64_t> keys_, rows_;
  size_t mask_ = 0;
};

// One cache group: row i reads columns [first[i], end[i]) and writes those from written_from[i] on.
bool group_ok(const Rows& t, const std::vector<int64_t>& first, const std::vector<int64_t>& end,
              const std::vector<int64_t>& written_from, int64_t limit, Owners& owners, std::vector<int64_t>& row) {
  const int64_t S = static_cast<int64_t>(first.size());
  size_t n_written = 0;
  for (int64_t i = 0; i < S; ++i) n_written += std::max<int64_t>(end[i] - std::max(first[i], written_from[i]), 0);
  owners.reset(n_written);
  for (int64_t i = 0; i < S; ++i) {
    row.clear();
    for (int64_t c = std::max<int64_t>(first[i], 0); c < end[i]; ++c) {
      const int64_t b = t.at(i, c);
      if (b < 0 || b >= limit) return false;
      if (c >= written_from[i] && !owners.claim(b, i)) return false;  // written by two rows
      row.push_back(b);
    }
    std::sort(row.begin(), row.end());
    if (std::adjacent_find(row.begin(), row.end()) != row.end()) return false;  // the row lists a block twice
  }
  for (int64_t i = 0; i < S; ++i) {  // a block written by one row and read by another
    for (int64_t c = std::max<int64_t>(first[i], 0); c < end[i]; ++c) {
      const int64_t o = owners.owner(t.at(i, c));
      if (o != -1 && o != i) return false;
    }
  }
  return true;
}

}  // namespace

void step_tables_check_cpu(at::Tensor& out, const at::Tensor& c0, const at::Tensor& query_lens,
                           const at::Tensor& block_tables, const at::Tensor& window_tables,
                           const at::Tensor& shared_len, const at::Tensor& window_floor, int64_t block_size,
                           int64_t lookback, int64_t num_blocks, int64_t window_blocks, int64_t max_positions) {
  check_host_i64(kOp, out, "out", 1);
  DEEPINFER_CHECK(out.numel() == 1, kOp, "out must hold one value");
  check_host_i64(kOp, c0, "c0", 1);
  check_host_i64(kOp, query_lens, "query_lens", 1);
  check_host_i64(kOp, block_tables, "block_tables", 2);
  check_host_i64(kOp, window_tables, "window_tables", 2);
  check_host_i64(kOp, shared_len, "shared_len", 1);
  check_host_i64(kOp, window_floor, "window_floor", 1);
  const int64_t S = c0.size(0), B = block_size;
  DEEPINFER_CHECK(B > 0 && lookback >= 0 && max_positions >= 0, kOp,
                  "block_size must be > 0, lookback and max_positions >= 0");
  DEEPINFER_CHECK(query_lens.size(0) == S && block_tables.size(0) == S, kOp,
                  "query_lens and block_tables must have one entry per sequence (", S, ")");
  const bool has_wt = window_tables.size(0) != 0 || window_tables.size(1) != 0;
  DEEPINFER_CHECK(!has_wt || window_tables.size(0) == S, kOp, "window_tables must be empty or have ", S, " rows");
  DEEPINFER_CHECK(shared_len.size(0) == 0 || shared_len.size(0) == S, kOp, "shared_len must be empty or [", S, "]");
  DEEPINFER_CHECK(window_floor.size(0) == 0 || window_floor.size(0) == S, kOp, "window_floor must be empty or [", S,
                  "]");
  int64_t* verdict = out.data_ptr<int64_t>();
  verdict[0] = 0;
  if (S == 0) {
    verdict[0] = 1;
    return;
  }
  struct Col {  // a [S] or [0] int64 vector (0 where empty)
    const int64_t* p;
    int64_t stride;
    int64_t operator[](int64_t i) const { return p == nullptr ? 0 : p[i * stride]; }
  };
  const auto col = [](const at::Tensor& t) {
    return Col{t.size(0) ? t.const_data_ptr<int64_t>() : nullptr, t.size(0) ? t.stride(0) : 0};
  };
  const Col c0v = col(c0), qv = col(query_lens), sharedv = col(shared_len), floorv = col(window_floor);
  const Rows bt{block_tables.const_data_ptr<int64_t>(), block_tables.stride(0), block_tables.stride(1),
                block_tables.size(1)};
  const Rows wt = has_wt ? Rows{window_tables.const_data_ptr<int64_t>(), window_tables.stride(0),
                                window_tables.stride(1), window_tables.size(1)}
                         : bt;
  std::vector<int64_t> zero(S, 0), nb(S), written(S), w0(S), wwritten(S);
  for (int64_t i = 0; i < S; ++i) {
    const int64_t c = c0v[i], q = qv[i], shared = sharedv[i], floor = floorv[i];
    if (q < 1 || c < 0 || c > max_positions - q) return;
    const int64_t L = c + q;
    nb[i] = (L + B - 1) / B;
    if (nb[i] > bt.cols || (has_wt && nb[i] > wt.cols)) return;
    if (shared < 0 || shared % B != 0 || floor < 0 || floor > c || floor % B != 0) return;
    if (!has_wt && floor != 0) return;
    written[i] = std::max(c, shared) / B;
    w0[i] = std::max(std::max<int64_t>(c - lookback, 0) / B, floor / B);
    wwritten[i] = c / B;
  }
  Owners owners;
  std::vector<int64_t> row;
  if (!group_ok(bt, zero, nb, written, num_blocks, owners, row)) return;
  if (!has_wt) {  // one table serves both groups: its ids must also lie in the window group
    for (int64_t i = 0; i < S; ++i)
      for (int64_t c = 0; c < nb[i]; ++c)
        if (bt.at(i, c) >= window_blocks) return;
  }
  if (!group_ok(wt, w0, nb, wwritten, window_blocks, owners, row)) return;
  verdict[0] = 1;
}

}  // namespace deepinfer
