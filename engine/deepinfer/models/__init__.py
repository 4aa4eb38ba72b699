"""Model implementations. DeepSeek-V4 (V4-Flash architecture): config, parameter inventory, model, paged cache."""

from .config import TINY_CONFIG, DeepseekV4Config
from .params import KINDS, expected_parameters, init_parameters

__all__ = ["KINDS", "TINY_CONFIG", "DeepseekV4Config", "expected_parameters", "init_parameters"]
