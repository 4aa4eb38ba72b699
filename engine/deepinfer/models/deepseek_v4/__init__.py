"""DeepSeek-V4 (V4-Flash architecture): config, parameter inventory, paged cache, step plan, layers, model."""

from .cache import BLOCK_SIZE, CacheSpec, DeepseekV4Cache, allocate_cache
from .config import CSA, HASH_MOE, HCA, MOE, SLIDING, TINY_CONFIG, DeepseekV4Config
from .model import (DeepseekV4ForCausalLM, _check_batch, indexer_select, indexer_topk, linear_rows, resolve_gemm,
                    rope_inv_freq)
from .params import KINDS, expected_parameters, init_parameters

__all__ = [
    "BLOCK_SIZE", "CSA", "HASH_MOE", "HCA", "MOE", "SLIDING", "TINY_CONFIG", "CacheSpec", "DeepseekV4Cache",
    "DeepseekV4Config", "DeepseekV4ForCausalLM", "KINDS", "allocate_cache", "expected_parameters", "indexer_select",
    "indexer_topk", "init_parameters", "linear_rows", "resolve_gemm", "rope_inv_freq",
]
