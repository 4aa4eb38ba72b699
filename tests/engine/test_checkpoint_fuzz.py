"""Seeded fuzz of every config.json field (issue 25): each random value gives a valid config (whose inventory stays
within MAX_TENSORS / MAX_PARAMETERS) or one CheckpointError naming the field -- never another exception. About 500
cases with a fixed seed, under a second; no time limit.

Each case replaces one field of a valid config (the legacy-key tiny preset, or the same model in transformers
keys) by a random JSON value: ints (0, -1, 2^63, 10^30), floats (1e30, -1, NaN, inf), bools, null, strings
(number-like, unicode, lone surrogates), lists, objects, deep nesting, near-valid edits of the field's own value,
or removes it. Where the value is JSON-encodable the case also goes through a config.json file.
"""

from __future__ import annotations

import copy
import json
import random

import pytest

from deepinfer import checkpoint as C
from deepinfer.models import TINY_CONFIG
from deepinfer.models.deepseek_v4 import config as CF

SEED = 2025
CASES_PER_FIELD = 6
MISSING = object()


def _hf_tiny() -> dict:
    """TINY_CONFIG in transformers 5.23 keys (layer_types, rope_parameters, compress_rates, ...)."""
    cfg = C.parse_config(TINY_CONFIG)
    d = copy.deepcopy(TINY_CONFIG)
    for k in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling", "hidden_size",
              "num_hidden_layers", "num_attention_heads"):
        d.pop(k)
    d.update({
        "dim": cfg.hidden_size, "n_layers": cfg.num_hidden_layers, "n_heads": cfg.num_attention_heads,
        "layer_types": list(cfg.layer_types), "mlp_layer_types": list(cfg.mlp_layer_types),
        "partial_rotary_factor": cfg.qk_rope_head_dim / cfg.head_dim,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 10000.0},
            "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16,
                         "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
        },
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    })
    return d


def _deep(rng: random.Random):
    v = rng.choice([0, "x", None, {}])
    for _ in range(rng.choice([40, 300, 5000])):
        v = [v] if rng.random() < 0.5 else {"k": v}
    return v


def _scalar(rng: random.Random):
    return rng.choice([
        0, 1, -1, 2, 3, 7, 64, 96, 128, 129, 4097, 2**31, 2**63, 10**30, -(10**30), rng.randint(-10, 10**6),
        0.0, -1.0, 0.5, 1.5, 4.0, 1e9, 1e30, -1e30, 1e-30, 1e308, float("nan"), float("inf"), -float("inf"),
        True, False, None,
        "", "abc", "NaN", "inf", "-1", "1e9", "128", "yarn", "moe", "sliding_attention", "sqrtsoftplus",
        "\u00e9\u4e2d\U0001f600", "\ud800", "x" * 5000,
    ])


def _value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if r < 0.55 or depth > 2:
        return _scalar(rng)
    if r < 0.75:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 6))]
    if r < 0.93:
        keys = ["type", "rope_type", "factor", "main", "compress", "weight_block_size", "\u00fc", "",
                "compressed_sparse_attention", "heavily_compressed_attention", "original_max_position_embeddings"]
        return {rng.choice(keys): _value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return _deep(rng)


def _near(rng: random.Random, valid):
    """A small edit of a field's valid value: numbers scaled or shifted, one list entry or dict value replaced."""
    if isinstance(valid, bool) or valid is None:
        return _scalar(rng)
    if isinstance(valid, (int, float)):
        return rng.choice([valid * 2, valid + 1, valid - 1, -valid, valid * 1000, valid / 3, 0, valid * 10**12])
    if isinstance(valid, list) and valid:
        out = copy.deepcopy(valid)
        edit = rng.random()
        if edit < 0.6:
            out[rng.randrange(len(out))] = _near(rng, out[0]) if rng.random() < 0.5 else _value(rng)
        elif edit < 0.8:
            out = out + out
        else:
            out = out[: rng.randrange(len(out))]
        return out
    if isinstance(valid, dict) and valid:
        out = copy.deepcopy(valid)
        k = rng.choice(sorted(out))
        out[k] = _near(rng, out[k]) if rng.random() < 0.5 else _value(rng)
        return out
    return _value(rng)


def _cases():
    rng = random.Random(SEED)
    extra_fields = ("text_config", "dim", "compress_rate_csa", "compress_rate_hca", "quantization_config")
    for base_name, base in (("legacy", TINY_CONFIG), ("transformers", _hf_tiny())):
        for field in sorted(set(base) | set(extra_fields)):
            for i in range(CASES_PER_FIELD):
                kind = rng.random()
                if i == 0:
                    value = MISSING
                elif kind < 0.5 and field in base:
                    value = _near(rng, base[field])
                else:
                    value = _value(rng)
                yield base_name, base, field, value


def _check(d: dict, field: str, where: str):
    """The config when valid, else None after checking that the CheckpointError names ``where`` and ``field``."""
    try:
        return C.parse_config(d, where)
    except C.CheckpointError as e:
        msg = str(e)
        assert msg.startswith(where) and field in msg[len(where):], (field, msg[:300])
        return None
    except Exception as e:  # any other exception type is the failure this test exists for
        pytest.fail(f"{where}: {type(e).__name__}: {str(e)[:300]}")


def _check_file(folder, d: dict, field: str, where: str) -> None:
    """The same case through a config.json file (where ``d`` is JSON-encodable)."""
    try:
        text = json.dumps(d)
    except (RecursionError, ValueError):
        return
    folder.mkdir()
    path = folder / C.CONFIG_FILE
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    try:
        loaded = C.read_config(folder)
    except C.CheckpointError as e:
        assert str(path) in str(e), (where, str(e)[:300])
        return
    except Exception as e:
        pytest.fail(f"{where} (file): {type(e).__name__}: {str(e)[:300]}")
    _check(loaded, field, str(path))


def test_every_config_field_fuzzed(tmp_path):
    outcomes = []
    for i, (base_name, base, field, value) in enumerate(_cases()):
        d = copy.deepcopy(base)
        if value is MISSING:
            d.pop(field, None)
        else:
            d[field] = value
        where = f"case {i} ({base_name} keys)"
        outcomes.append(_check(d, field, where))
        _check_file(tmp_path / str(i), d, field, where)
    valid = [cfg for cfg in outcomes if cfg is not None]
    assert len(outcomes) >= 300 and 0.05 < len(valid) / len(outcomes) < 0.8, len(valid)  # both outcomes reached
    for cfg in valid:  # what a valid config implies stays within the budget
        tensors, params = cfg.inventory_size()
        assert tensors <= CF.MAX_TENSORS and params <= CF.MAX_PARAMETERS, (tensors, params)
