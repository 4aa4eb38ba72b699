"""Model families. DeepSeek-V4 (V4-Flash architecture) lives in the ``deepseek_v4`` package."""

from .deepseek_v4.cache import BLOCK_SIZE, CacheSpec, DeepseekV4Cache, allocate_cache
from .deepseek_v4.config import TINY_CONFIG, DeepseekV4Config
from .deepseek_v4.params import KINDS, expected_parameters, init_parameters

__all__ = [
    "BLOCK_SIZE",
    "CacheSpec",
    "DeepseekV4Cache",
    "DeepseekV4Config",
    "KINDS",
    "TINY_CONFIG",
    "allocate_cache",
    "expected_parameters",
    "init_parameters",
]
