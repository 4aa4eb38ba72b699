// rotary_embedding device code: interleaved (GPT-J pair) RoPE on the trailing rope_dim channels,
// in place; inverse rotates by -theta. Out-of-range positions write NaN into the rope slice.
#pragma once

#include "deepinfer/common.cuh"

namespace deepinfer::rope {

struct RotaryEmbeddingParams {
  void* x;                   // [num_tokens, num_heads, head_dim], strides token_stride / head_stride (elements)
  const void* positions;     // [num_tokens] int64 (positions_int64) or int32, stride positions_stride
  const float* cos_sin;      // [max_position, rope_dim]: cos for pair i at [p, i], sin at [p, rope_dim/2 + i]
  int64_t num_tokens, num_heads, head_dim, rope_dim, max_position;
  int64_t token_stride, head_stride, positions_stride;
  DType dtype;
  bool positions_int64;
  bool inverse;
};

void launch_rotary_embedding(const RotaryEmbeddingParams& p, cudaStream_t stream);

}  // namespace deepinfer::rope
