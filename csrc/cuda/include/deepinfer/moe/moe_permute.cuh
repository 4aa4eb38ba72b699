// moe_permute device code: the T*k (token, slot) pairs stably sorted by expert (padding slots first), as the
// row order of the grouped expert GEMMs. One CTA; its result depends only on topk_idx (deterministic).
#pragma once

#include "deepinfer/common.cuh"

namespace deepinfer::moe {

struct MoePermuteParams {
  const void* topk_idx;   // [rows] (= [T, k] flattened), int32 or int64
  bool idx_int64;
  int32_t* m_indices;     // [rows] expert of each sorted row (-1 = padding)
  int64_t* token_of_row;  // [rows] token of each sorted row
  int64_t* slot_rows;     // [rows] sorted row of each (token, slot); -1 for padding slots
  int64_t rows, top_k, num_experts;
};

// Most experts the CUDA kernel takes (its per-expert counters live in shared memory), and most rows (T * k: its
// positions are int32).
constexpr int64_t kMoePermuteMaxExperts = 25000;
constexpr int64_t kMoePermuteMaxRows = (1ll << 31) - 1;

void launch_moe_permute(const MoePermuteParams& p, cudaStream_t stream);

}  // namespace deepinfer::moe
