"""deepinfer_ops: native ops for DeepSeek-V4-family inference, registered as ``torch.ops.deepinfer_ops.*``.

Importing this package loads the compiled extension ``deepinfer_ops._C`` (CPU kernels always; CUDA kernels
when built with CUDA) and the fake implementations used by torch.compile. The functions below are thin
wrappers that allocate outputs; pure-torch float32 references live in ``deepinfer_ops.testing.refs``.
"""

from __future__ import annotations

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers torch.ops.deepinfer_ops.*)
from . import _fake  # noqa: F401
from .attention import (
    compressor_pool,
    compressor_pool_rows,
    compressor_state_write,
    indexer_k_cache_dequant_fp8,
    indexer_k_cache_write_fp8,
    kv_cache_dequant_fp8,
    kv_cache_write,
    kv_cache_write_fp8,
    mqa_logits,
    sparse_mqa_decode,
    sparse_mqa_prefill,
)
from .backend import BUILT_WITH_CUDA, BackendUnavailableError, device_for, select_accelerator
from .gemm import (
    fp4_to_fp8_blockscaled,
    fp8_gemm_nt,
    m_grouped_fp8_gemm_nt_contiguous,
    m_grouped_fp8_gemm_nt_masked,
    swiglu_clamp_quant_fp8,
)
from .mhc import hc_collapse, hc_mix, hc_post, hc_weights
from .moe import fused_moe_fp8, moe_combine, moe_permute
from .norm import rms_norm
from .plan import decode_plan_fill, step_tables_check
from .quant import FP8_E4M3_MAX, per_token_group_quant_fp8
from .rope import rope_cos_sin_cache, rotary_embedding
from .sampling import logsumexp_rows
from .topk import topk

__version__ = "0.1.0"

__all__ = [
    "BUILT_WITH_CUDA",
    "BackendUnavailableError",
    "FP8_E4M3_MAX",
    "compressor_pool",
    "compressor_pool_rows",
    "compressor_state_write",
    "decode_plan_fill",
    "device_for",
    "fp4_to_fp8_blockscaled",
    "fp8_gemm_nt",
    "fused_moe_fp8",
    "hc_collapse",
    "hc_mix",
    "hc_post",
    "hc_weights",
    "indexer_k_cache_dequant_fp8",
    "indexer_k_cache_write_fp8",
    "kv_cache_dequant_fp8",
    "kv_cache_write",
    "kv_cache_write_fp8",
    "logsumexp_rows",
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_masked",
    "moe_combine",
    "moe_permute",
    "mqa_logits",
    "per_token_group_quant_fp8",
    "rms_norm",
    "rope_cos_sin_cache",
    "rotary_embedding",
    "select_accelerator",
    "sparse_mqa_decode",
    "sparse_mqa_prefill",
    "step_tables_check",
    "swiglu_clamp_quant_fp8",
    "topk",
]
