"""Hostile checkpoints (issue 25, item 2): every malformed file gives one CheckpointError naming the file and the
tensor or key: safetensors headers with mistyped entries, deeply nested JSON, integers too long for Python.
"""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path

import pytest

from deepinfer import checkpoint as C
from deepinfer.models import TINY_CONFIG


def _with(base: dict, **changes) -> dict:
    d = copy.deepcopy(base)
    d.update(changes)
    return d


def _deep_json(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


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

    idx = tmp_path / "idx"
    idx.mkdir()
    (idx / C.INDEX_FILE).write_bytes(b'{"weight_map": ' + deep + b"}")
    with pytest.raises(C.CheckpointError, match="nested") as e:
        C.list_tensors(idx)
    assert str(idx / C.INDEX_FILE) in str(e.value)


def test_integer_too_long_for_python_names_the_file(tmp_path):
    (tmp_path / "config.json").write_bytes(b'{"vocab_size": ' + b"9" * 5000 + b"}")
    with pytest.raises(C.CheckpointError) as e:
        C.load_checkpoint(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)


def test_quantization_config_of_the_wrong_type_names_the_key():
    for qc in ([1], "fp8", {"weight_block_size": "128"}, {"weight_block_size": [128, 1e9]}):
        with pytest.raises(C.CheckpointError, match="quantization_config"):
            C.parse_config(_with(TINY_CONFIG, quantization_config=qc))
