"""deepinfer: the thin Python engine for DeepSeek-V4-family models, built on deepinfer_ops.

``LLM``, ``SamplingParams``, ``EngineConfig`` and ``RequestOutput`` are imported lazily, so ``import deepinfer.models``
does not pull in the engine and the recipe.
"""

__version__ = "0.1.0"
#: model names ``LLM`` and the CLI take for the built-in tiny checkpoints (besides checkpoint folders): DeepSeek-V4's
#: ``tiny`` (alias ``deepinfer-tiny``) and DeepSeek-V4.1's ``tiny-v41``
MODEL_PRESETS = ("tiny", "deepinfer-tiny", "tiny-v41")

_EXPORTS = {
    "LLM": "deepinfer.llm",
    "RequestOutput": "deepinfer.llm",
    "EngineConfig": "deepinfer.config",
    "SamplingParams": "deepinfer.sequence",
}

__all__ = [*_EXPORTS, "__version__", "MODEL_PRESETS"]


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
