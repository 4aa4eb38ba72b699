"""DeepSeek-V4 (V4-Flash architecture): config, parameter inventory, paged cache, step plan, layers, model."""

from .cache import BLOCK_SIZE, CacheSpec, DeepseekV4Cache, allocate_cache
from .compressor import indexer_select, indexer_topk
from .config import CSA, HASH_MOE, HCA, MOE, SLIDING, TINY_CONFIG, DeepseekV4Config
from .layers import Linear, fp8_block_weight, fp8_linear, linear_rows, resolve_gemm, rope_inv_freq
from .model import DeepseekV4ForCausalLM
from .params import KINDS, expected_parameters, init_parameters
from .plan import Capacity, PlanBuilder, SeqStep, StepPlan

__all__ = [
    "BLOCK_SIZE", "CSA", "HASH_MOE", "HCA", "MOE", "SLIDING", "TINY_CONFIG", "CacheSpec", "Capacity",
    "DeepseekV4Cache", "DeepseekV4Config", "DeepseekV4ForCausalLM", "KINDS", "Linear", "PlanBuilder", "SeqStep",
    "StepPlan", "allocate_cache", "expected_parameters", "fp8_block_weight", "fp8_linear", "indexer_select",
    "indexer_topk", "init_parameters", "linear_rows", "resolve_gemm", "rope_inv_freq",
]
