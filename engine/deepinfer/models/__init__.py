"""Model implementations. DeepSeek-V4 (V4-Flash architecture): config, parameter inventory, model, paged cache."""

from .cache import BLOCK_SIZE, CacheSpec, DeepseekV4Cache, allocate_cache
from .config import TINY_CONFIG, DeepseekV4Config
from .params import KINDS, expected_parameters, init_parameters

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
