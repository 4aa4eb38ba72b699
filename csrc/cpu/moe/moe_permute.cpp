// CPU moe_permute: the T*k (token, slot) pairs stably sorted by expert (padding first). A counting sort when the
// per-expert counters are small next to the rows; otherwise (a huge num_experts, up to 2^31 - 1, for few rows) a
// stable comparison sort, so that memory stays O(rows) and never O(num_experts).
#include <algorithm>
#include <numeric>
#include <vector>

#include "common/moe_checks.h"
#include "ops.h"

namespace deepinfer {
namespace {

// The counting sort's counters (8 bytes per expert) are used while they are at most this many or a few per row.
constexpr int64_t kCountingSortMinBins = int64_t{1} << 16;

template <typename I>
void permute(at::Tensor& m_indices, at::Tensor& token_of_row, at::Tensor& slot_rows, const at::Tensor& topk_idx,
             int64_t num_experts) {
  const int64_t rows = topk_idx.numel(), top_k = topk_idx.size(1);
  const I* idx = topk_idx.const_data_ptr<I>();
  // Bin 0 holds the padding slots (ids outside [0, E)), bin e + 1 expert e.
  const auto bin = [&](int64_t i) -> int64_t {
    const int64_t e = static_cast<int64_t>(idx[i]);
    return e >= 0 && e < num_experts ? e + 1 : 0;
  };
  int32_t* mi = m_indices.mutable_data_ptr<int32_t>();
  int64_t* tok = token_of_row.mutable_data_ptr<int64_t>();
  int64_t* slot = slot_rows.mutable_data_ptr<int64_t>();
  const int64_t bins = num_experts + 1;
  if (bins > std::max(kCountingSortMinBins, 4 * rows)) {
    std::vector<int64_t> key(rows), order(rows);
    for (int64_t i = 0; i < rows; ++i) key[i] = bin(i);
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return key[a] < key[b]; });
    for (int64_t pos = 0; pos < rows; ++pos) {
      const int64_t i = order[pos], b = key[i];
      mi[pos] = static_cast<int32_t>(b - 1);
      tok[pos] = i / top_k;
      slot[i] = b == 0 ? -1 : pos;
    }
    return;
  }
  std::vector<int64_t> next(bins, 0);
  for (int64_t i = 0; i < rows; ++i) ++next[bin(i)];
  int64_t start = 0;
  for (auto& n : next) {
    const int64_t c = n;
    n = start;
    start += c;
  }
  for (int64_t i = 0; i < rows; ++i) {  // in slot order: stable
    const int64_t b = bin(i), pos = next[b]++;
    mi[pos] = static_cast<int32_t>(b - 1);
    tok[pos] = i / top_k;
    slot[i] = b == 0 ? -1 : pos;
  }
}

}  // namespace

void moe_permute_cpu(at::Tensor& m_indices, at::Tensor& token_of_row, at::Tensor& slot_rows,
                     const at::Tensor& topk_idx, int64_t num_experts) {
  check_moe_permute(m_indices, token_of_row, slot_rows, topk_idx, num_experts);
  if (topk_idx.numel() == 0) return;
  if (topk_idx.scalar_type() == at::kInt) {
    permute<int32_t>(m_indices, token_of_row, slot_rows, topk_idx, num_experts);
  } else {
    permute<int64_t>(m_indices, token_of_row, slot_rows, topk_idx, num_experts);
  }
}

}  // namespace deepinfer
