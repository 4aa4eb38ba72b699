"""Model families by ``model_type`` (``config.json``): what the engine needs to load, size and run one.

A family declares one :class:`ModelFamily` entry (see ``docs/engine.md``): the checkpoint loader and writer take
its config class and parameter inventory by the ``config.json`` ``model_type``, ``LLM`` its model class and cache
spec, the synthetic presets its random init and tiny config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class ModelFamily:
    """One model family.

    Attributes:
        model_type: the ``config.json`` ``model_type`` it serves.
        config_class: ``from_dict(config_json) -> config`` (raises ValueError naming the key).
        expected_parameters: ``config -> {native name: (shape, kind)}``.
        cache_spec: ``(config, dtype, block_size, kv_cache_dtype) -> spec`` with ``bytes_per_block``,
            ``bytes_per_token()``, ``group_bytes_per_block()``, ``lookback``, ``cache_groups(num_blocks,
            window_blocks)`` and ``report(num_blocks, window_blocks)`` (``deepinfer.models.deepseek_v4.cache``).
        model_class: built as ``model_class(config, dtype, gemm)``; ``forward(plan, cache)``, ``plan_builder(cache)``.
        init_parameters: ``(config, seed) -> {name: tensor}`` deterministic random weights (synthetic presets).
        tiny_config: the ``config.json`` dict of its built-in tiny preset.
        plan_builder_class: ``(config, block_size, num_blocks, device) -> builder`` of its step plans (the model's
            ``plan_builder(cache)`` method returns one for a cache).
        load: ``(path, device, gemm) -> model`` for a family whose checkpoints ``deepinfer.checkpoint`` does not read
            (its own native format), else None (``model_class.from_parameters`` over ``load_checkpoint``).
        model_version: the prompt encoding its models take (``chat.ChatFrontend``: ``"v4"`` or ``"v4.1"``).
        presets: the built-in preset names that are checkpoints of this family.
    """

    model_type: str
    config_class: Any
    expected_parameters: Callable
    cache_spec: Callable
    model_class: Any
    init_parameters: Callable
    tiny_config: dict
    plan_builder_class: Callable
    load: Callable | None = None
    model_version: str = "v4"
    presets: tuple[str, ...] = ()


def _deepseek_v4() -> ModelFamily:
    from .deepseek_v4 import TINY_CONFIG, CacheSpec, DeepseekV4Config, DeepseekV4ForCausalLM, PlanBuilder
    from .deepseek_v4 import expected_parameters, init_parameters

    return ModelFamily("deepseek_v4", DeepseekV4Config, expected_parameters, CacheSpec.from_config,
                       DeepseekV4ForCausalLM, init_parameters, TINY_CONFIG, PlanBuilder,
                       presets=("tiny", "deepinfer-tiny"))


def _deepseek_v41() -> ModelFamily:
    from .deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM, expected_parameters
    from .deepseek_v41.cache import cache_spec
    from .deepseek_v41.config import TINY_CONFIG
    from .deepseek_v41.params import init_parameters
    from .deepseek_v41.plan import PlanBuilder

    return ModelFamily("deepseek_v41", DeepseekV41Config, expected_parameters, cache_spec, DeepseekV41ForCausalLM,
                       init_parameters, TINY_CONFIG, PlanBuilder, load=DeepseekV41ForCausalLM.from_checkpoint,
                       model_version="v4.1", presets=("tiny-v41",))


_FAMILIES: dict[str, Callable[[], ModelFamily]] = {"deepseek_v4": _deepseek_v4, "deepseek_v41": _deepseek_v41}


def model_family(model_type: str | None) -> ModelFamily:
    """The family serving ``model_type`` (``None``: ``"deepseek_v4"``, the default of checkpoints without one).

    Raises:
        ValueError naming ``model_type`` and the known ones.
    """
    key = "deepseek_v4" if model_type is None else model_type
    if not isinstance(key, str) or key not in _FAMILIES:
        import reprlib

        raise ValueError(f"model_type: {reprlib.repr(model_type)} is not a known model family "
                         f"({', '.join(sorted(_FAMILIES))})")
    return _FAMILIES[key]()


def model_types() -> tuple[str, ...]:
    """The registered ``model_type`` s."""
    return tuple(_FAMILIES)
