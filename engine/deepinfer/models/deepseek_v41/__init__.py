"""DeepSeek-V4.1 (V4.1-Flash architecture): config, inventory, loading, forward on the CPU or CUDA
(``docs/deepseek_v41.md``)."""

from .config import MODEL_TYPE, DeepseekV41Config
from .loading import expected_parameters, load_model, load_token_map, load_weights
from .model import DeepseekV41ForCausalLM, SeqState

__all__ = ["MODEL_TYPE", "DeepseekV41Config", "DeepseekV41ForCausalLM", "SeqState", "expected_parameters",
           "load_model", "load_token_map", "load_weights"]
