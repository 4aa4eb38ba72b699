"""Training a small DeepSeek-V4 model with its MTP layer for speculative decoding (``tools/train_spec_model.py``).

``data``: the Python standard library's sources, split by path hash, tokenized and packed. ``model``: transformers'
``DeepseekV4ForCausalLM`` plus an MTP layer, the native-name mapping, the losses and the held-out metrics.
Design and usage: ``docs/train-spec-model.md``.
"""
