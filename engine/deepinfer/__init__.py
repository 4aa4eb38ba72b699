"""deepinfer: the thin Python engine for DeepSeek-V4-family models, built on deepinfer_ops."""

__version__ = "0.1.0"
