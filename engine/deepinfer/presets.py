"""Synthetic checkpoints: the built-in ``tiny`` preset (created on first use in the cache folder) and
``v4-flash-shapes`` (V4-Flash dimensions, for GPU benchmarks), written in the native format by
:func:`deepinfer.checkpoint.write_checkpoint` with deterministic random weights and the real V4 tokenizer; and
their DeepSeek-V4.1 twins ``tiny-v41`` (built-in, created on first use too) and ``v41-flash-shapes``, written in
V4.1's native format by :func:`deepinfer.models.deepseek_v41.params.write_checkpoint` with V4.1's tokenizer."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from . import quantization as Q
from .checkpoint import CONFIG_FILE, DEFAULT_SHARD_SIZE, parse_config, write_checkpoint
from .models.registry import model_family
from .quantization import QuantizedWeight

PRESETS = ("tiny", "v4-flash-shapes", "tiny-v41", "v41-flash-shapes")
V41_PRESETS = ("tiny-v41", "v41-flash-shapes")
#: bump when the generated tiny checkpoint's bytes change (names the cache folder of :func:`default_model_path`).
TINY_FORMAT_VERSION = 1
TINY_V41_FORMAT_VERSION = 1

#: ``v41-flash-shapes`` over ``tiny-v41``: V4.1-Flash dimensions (``../shared/reference/architecture.md``, V4.1)
#: with one layer of each block type (6 layers), Engram on layer 1 with 1/160 of the real bucket count (the
#: released tables are ~100 GB per layer; rows do not change the compute), 3 DSpark stages of block 5.
V41_FLASH_SHAPES = {
    "dim": 5120, "moe_inter_dim": 2304, "n_heads": 64, "head_dim": 512, "rope_head_dim": 64, "q_lora_rank": 1280,
    "o_groups": 8, "o_lora_rank": 1024, "n_routed_experts": 384, "n_activated_experts": 6, "window_size": 128,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_topk_blocks": 2048,
    "candidate_block_size": 8, "original_seq_len": 65536, "rope_factor": 16, "max_seq_len": 65536,
    "engram_layer_ids": [1], "engram_max_ngram_size": 4, "engram_vocab_size": 100000, "engram_n_heads": 8,
    "engram_head_dim": 256, "n_mtp_layers": 3, "compress_ratios": [0, 2, 2, 1, 1, 1, 0, 0, 0],
    "dspark_block_size": 5, "dspark_target_layer_ids": [3, 4, 5], "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128, "dspark_n_activated_experts": 3,
}


def _v41_preset_config(preset: str, num_layers: int | None, num_experts: int | None) -> dict:
    from .models.deepseek_v41.config import TINY_CONFIG
    from .models.deepseek_v41.params import with_engram_rows

    if num_layers is not None:
        raise ValueError(f"num_layers: the {preset} preset has one layer of each V4.1 block type (6); its depth is "
                         "fixed")
    cfg = json.loads(json.dumps(TINY_CONFIG))
    if preset == "v41-flash-shapes":
        cfg.update(json.loads(json.dumps(V41_FLASH_SHAPES)))
    if num_experts is not None:
        if num_experts < int(cfg["n_activated_experts"]):
            raise ValueError(f"num_experts must be >= n_activated_experts={cfg['n_activated_experts']}, got "
                             f"{num_experts}")
        cfg["n_routed_experts"] = num_experts
        cfg["dspark_n_routed_experts"] = min(int(cfg["dspark_n_routed_experts"]), num_experts)
    return with_engram_rows(cfg)


def preset_config(preset: str, *, num_layers: int | None = None, num_experts: int | None = None) -> dict:
    """The ``config.json`` dict of a preset.

    ``tiny``: ``TINY_CONFIG`` of :mod:`deepinfer.models` (every layer type, hash + routed MoE, MTP, real window 128
    and ratios 4 / 128, vocab 129,280, hidden 64). ``v4-flash-shapes``: V4-Flash dimensions (hidden 4096, 64 heads x
    512, q_lora 1024, o 8 x 1024, 256 experts top-6 x 2048, indexer 64 x 128 top-512, hc 4, vocab 129,280) at
    reduced depth: 4 layers ``compress_ratios = [0, 0, 4, 128]`` (sliding, sliding, CSA, HCA; layers 0-2 hash MoE,
    layer 3 score-routed) + 1 MTP layer. ``num_layers`` / ``num_experts`` override depth and expert count
    (the layer pattern continues V4-Flash's ``[0, 0, 4, 128, 4, 128, ...]``).
    ``tiny-v41`` / ``v41-flash-shapes``: DeepSeek-V4.1 (``deepseek_v41.config.TINY_CONFIG``, :data:`V41_FLASH_SHAPES`;
    ``num_experts`` only).
    Raises: ValueError for an unknown preset or bad override.
    """
    if preset in V41_PRESETS:
        return _v41_preset_config(preset, num_layers, num_experts)
    tiny = model_family("deepseek_v4").tiny_config
    if preset == "tiny":
        cfg = json.loads(json.dumps(tiny))
    elif preset == "v4-flash-shapes":
        cfg = json.loads(json.dumps(tiny))
        cfg.update(
            {
                "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 4, "num_attention_heads": 64,
                "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024,
                "o_groups": 8, "o_lora_rank": 1024, "n_routed_experts": 256, "n_shared_experts": 1,
                "num_experts_per_tok": 6, "moe_intermediate_size": 2048, "compress_ratios": [0, 0, 4, 128, 0],
                "num_hash_layers": 3, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
                "swiglu_limit": 10.0, "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128,
                "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1.0e-6, "rms_norm_eps": 1.0e-6,
                "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
                "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                                 "beta_fast": 32, "beta_slow": 1},
                "num_nextn_predict_layers": 1,
            }
        )
    else:
        raise ValueError(f"unknown checkpoint preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        ratios = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(max(num_layers - 2, 0))]
        if preset == "tiny":
            base = list(tiny["compress_ratios"][: tiny["num_hidden_layers"]])
            ratios = (base * (num_layers // len(base) + 1))[:num_layers]
        cfg["compress_ratios"] = ratios[:num_layers] + [0] * int(cfg.get("num_nextn_predict_layers", 1))
        cfg["num_hidden_layers"] = num_layers
        cfg["num_hash_layers"] = min(int(cfg.get("num_hash_layers", 3)), num_layers)
    if num_experts is not None:
        if num_experts < int(cfg["num_experts_per_tok"]):
            raise ValueError(f"num_experts must be >= num_experts_per_tok={cfg['num_experts_per_tok']}, got {num_experts}")
        cfg["n_routed_experts"] = num_experts
    return cfg


def name_seed(seed: int, name: str) -> int:
    """Deterministic per-tensor seed: ``crc32(name)`` mixed with ``seed`` (independent of tensor order)."""
    return (int(seed) * 0x9E3779B1 + zlib.crc32(name.encode())) & 0x7FFFFFFFFFFFFFFF


class _LazyParams(Mapping):
    """A read-only mapping that builds each value on access (so huge presets never sit in memory at once)."""

    def __init__(self, names: Iterable[str], fn: Callable[[str], Any]):
        self._names = list(names)
        self._set = set(self._names)
        self._fn = fn

    def __getitem__(self, name: str) -> Any:
        if name not in self._set:
            raise KeyError(name)
        return self._fn(name)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _u64(c: int) -> int:
    return c - (1 << 64) if c >= (1 << 63) else c


_SPLITMIX = (_u64(0x9E3779B97F4A7C15), _u64(0xBF58476D1CE4E5B9), _u64(0x94D049BB133111EB))


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser applied in place to an int64 tensor (wrapping arithmetic, logical shifts)."""
    k1, k2, k3 = _SPLITMIX
    x.mul_(k1)
    t = torch.empty_like(x)  # in-place rounds: no large temporaries
    for shift, k in ((30, k2), (27, k3), (31, None)):
        torch.bitwise_right_shift(x, shift, out=t)
        t.bitwise_and_((1 << (64 - shift)) - 1)  # logical shift
        x.bitwise_xor_(t)
        if k is not None:
            x.mul_(k)
    return x


_RANDOM_BASE = 1 << 16  # int64 words hashed per tensor; longer outputs are odd-affine images of this base


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    """``nbytes`` pseudo-random bytes (uint8), deterministic in ``seed`` on every (little-endian) machine.

    A 512 KiB base is a counter-based splitmix64 hash of ``(seed, index)``; longer outputs repeat it through a
    per-chunk affine map ``base * K_j + C_j`` (``K_j`` odd, so each chunk is a bijection of the base) with hashed
    ``K_j, C_j``: two multithreaded passes per byte, so the 20 GB ``v4-flash-shapes`` preset is bound by disk writes.
    Benchmark filler, not for anything statistical.
    """
    n = -(-nbytes // 8)
    s = (int(seed) * 0x632BE59BD9B4E019) & ((1 << 62) - 1)
    base = _splitmix64(torch.arange(min(n, _RANDOM_BASE), dtype=torch.int64).add_(s))
    if n <= _RANDOM_BASE:
        return base.view(torch.uint8)[:nbytes]
    chunks = -(-n // _RANDOM_BASE)
    kc = _splitmix64(torch.arange(2 * chunks, dtype=torch.int64).add_(s ^ 0x2545F4914F6CDD1D)).view(chunks, 2)
    out = torch.empty(chunks, _RANDOM_BASE, dtype=torch.int64)
    torch.mul(base.view(1, -1), kc[:, :1].bitwise_or(1), out=out)
    out.add_(kc[:, 1:])
    return out.view(-1).view(torch.uint8)[:nbytes]


def _random_codes_weight(fmt: str, shape: tuple[int, ...], seed: int) -> QuantizedWeight:
    """Random FP8 / FP4 codes with UE8M0 scales giving an rms near ``1/sqrt(in)`` (variance preserving)."""
    out, inp = shape
    target = 1.0 / math.sqrt(inp)
    if fmt == "fp4":
        data = random_bytes(out * inp // 2, seed).view(out, inp // 2).view(torch.int8)
        code_rms, sshape, block = 2.93, (out, -(-inp // Q.FP4_BLOCK)), (1, Q.FP4_BLOCK)  # rms of uniform e2m1 codes
    else:
        # clearing bit 6 keeps the e4m3 exponent field <= 7 (|v| < 2, never NaN); rms of such codes ~ 0.48
        data = (random_bytes(out * inp, seed).view(out, inp) & 0xBF).view(Q.FP8_DTYPE)
        code_rms, sshape, block = 0.48, (-(-out // Q.FP8_BLOCK[0]), -(-inp // Q.FP8_BLOCK[1])), Q.FP8_BLOCK
    e = int(round(math.log2(target / code_rms)))
    jitter = (random_bytes(math.prod(sshape), seed ^ 0x5A5A).view(sshape) & 1).to(torch.int16)  # exponent e or e-1
    scale = (127 + e - jitter).clamp(0, 254).to(torch.uint8).view(Q.UE8M0_DTYPE)
    return QuantizedWeight(fmt, data, scale, block)


def _random_bf16(shape: tuple[int, ...], seed: int, rms: float) -> torch.Tensor:
    """bf16 values with random sign / mantissa and exponents spread over 8 binades below ~``rms`` (rms ~ ``rms``)."""
    r = random_bytes(2 * math.prod(shape), seed).view(torch.int16).view(shape)
    top = 127 + int(round(math.log2(rms / 0.59)))
    expo = (r >> 7).bitwise_and_(7).neg_().add_(top).bitwise_left_shift_(7)  # int16: (top - k) << 7, k in 0..7
    return r.bitwise_and_(-32768 | 0x7F).bitwise_or_(expo).view(torch.bfloat16)


def _synthetic_value(
    name: str, shape: tuple[int, ...], kind: str, seed: int, config: Any, quant: str, expert_quant: str
) -> Any:
    """Fast random values for the benchmark preset (not for parity tests): O(1) activations, nothing left at zero.

    Quantised linears are drawn directly as codes + UE8M0 scales and big bf16 tensors as random bit patterns, so no
    large fp32 tensor is drawn or quantised; small fp32 / norm tensors use torch's generator.
    """
    s = name_seed(seed, name)
    fmt = {"dense_linear": quant, "expert_linear": expert_quant}.get(kind, "none")
    if fmt in ("fp8", "fp4"):
        return _random_codes_weight(fmt, shape, s)
    g = torch.Generator().manual_seed(s)
    if name.endswith("tid2eid"):
        r = torch.rand(shape[0], config.n_routed_experts, generator=g)
        return r.topk(shape[1], dim=-1).indices.to(torch.int32)
    leaf = name[: -len(".weight")].rsplit(".", 1)[-1] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    if len(shape) == 1 and leaf.endswith("norm"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if "hc_" in leaf and leaf.endswith("_fn"):
        return torch.randn(shape, generator=g) / math.sqrt(shape[1])
    if "hc_" in leaf and leaf.endswith("_base"):
        return 0.5 * torch.randn(shape, generator=g)
    if "hc_" in leaf and leaf.endswith("_scale"):
        return 0.5 + 0.5 * torch.rand(shape, generator=g)
    if leaf == "attn_sink":
        return torch.randn(shape, generator=g)
    if leaf == "ape":
        return 0.5 * torch.randn(shape, generator=g)
    if name.endswith("gate.bias"):
        return 0.1 * torch.randn(shape, generator=g)
    if len(shape) == 2:
        return _random_bf16(shape, s, 1.0 if name == "embed.weight" else 1.0 / math.sqrt(shape[1]))
    return 0.1 * torch.randn(shape, generator=g)


def checkpoint_size(preset: str, *, quant: str = "fp8", expert_quant: str = "fp4", scale_fmt: str = "ue8m0",
                    dtype: torch.dtype | None = None, num_layers: int | None = None,
                    num_experts: int | None = None) -> int:
    """Bytes :func:`make_checkpoint` writes for these arguments (tensor data). Raises ValueError like it."""
    from .checkpoint import checkpoint_bytes

    cfg_dict = preset_config(preset, num_layers=num_layers, num_experts=num_experts)
    if preset in V41_PRESETS:
        from .models.deepseek_v41 import DeepseekV41Config
        from .models.deepseek_v41.params import stored_bytes

        _v41_options(quant, expert_quant, scale_fmt, dtype)
        return stored_bytes(DeepseekV41Config.from_dict(cfg_dict))
    spec = model_family("deepseek_v4").expected_parameters(parse_config(cfg_dict, f"preset {preset!r}"))
    return checkpoint_bytes(spec, quant=quant, expert_quant=expert_quant, scale_fmt=scale_fmt, dtype=dtype)


def make_checkpoint(
    preset: str,
    out_dir: str | os.PathLike,
    seed: int = 0,
    *,
    quant: str = "fp8",
    expert_quant: str = "fp4",
    scale_fmt: str = "ue8m0",
    shard_size: int | None = None,
    dtype: torch.dtype | None = None,
    num_layers: int | None = None,
    num_experts: int | None = None,
    vocab_size: int | None = None,
    progress: bool | None = None,
) -> Path:
    """Generate a deterministic random checkpoint of ``preset`` (see :func:`preset_config`) into ``out_dir``.

    ``tiny`` draws its parameters with the model's ``init_parameters(config, seed)`` (fp32, the values the parity
    tests use) and quantises them as asked. ``v4-flash-shapes`` (GPU benchmarks) draws each tensor on the fly with a
    per-name generator and FP4 experts directly as codes, so generation is bound by writing ~20 GB (4 layers + MTP at
    256 experts), not by CPU math; it is never committed anywhere.
    ``tiny-v41`` / ``v41-flash-shapes`` are written in V4.1's native format (FP8 dense with 32x32 UE8M0 scales, FP4
    experts; ``deepseek_v41.params``); the format options must stay at their defaults.
    ``vocab_size`` (``tiny`` only) shrinks the vocabulary, for host-time benchmarks whose sampling must cost
    nothing; the tokenizer files stay V4's.
    Returns ``Path(out_dir)``. Raises ValueError for an unknown preset or bad options.
    """
    cfg_dict = preset_config(preset, num_layers=num_layers, num_experts=num_experts)
    if vocab_size is not None:
        if preset != "tiny" or not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 2:
            raise ValueError(f"vocab_size: an integer >= 2 for the tiny preset only, got {vocab_size!r} for "
                             f"{preset!r}")
        cfg_dict["vocab_size"] = vocab_size
    if preset in V41_PRESETS:
        from .models.deepseek_v41.params import write_checkpoint as write_v41

        _v41_options(quant, expert_quant, scale_fmt, dtype)
        return write_v41(out_dir, cfg_dict, seed, shard_bytes=shard_size or 4 << 30)
    config = parse_config(cfg_dict, f"preset {preset!r}")
    family = model_family("deepseek_v4")
    expected_parameters, init_parameters = family.expected_parameters, family.init_parameters
    spec = expected_parameters(config)
    if preset == "tiny":
        params: Mapping[str, Any] = init_parameters(config, seed)
    else:
        params = _LazyParams(
            spec, lambda n: _synthetic_value(n, tuple(spec[n][0]), spec[n][1], seed, config, quant, expert_quant)
        )
    return write_checkpoint(
        out_dir, cfg_dict, params, quant=quant, expert_quant=expert_quant, scale_fmt=scale_fmt,
        shard_size=shard_size or (DEFAULT_SHARD_SIZE if preset != "tiny" else 64 * 1024**2),
        dtype=dtype, spec=spec, progress=progress,
    )


def _v41_options(quant: str, expert_quant: str, scale_fmt: str, dtype) -> None:
    if (quant, expert_quant, scale_fmt, dtype) != ("fp8", "fp4", "ue8m0", None):
        raise ValueError("the V4.1 presets are written in V4.1's native format only (FP8 dense, FP4 experts, UE8M0 "
                         "scales): leave --quant, --expert-quant, --scale-fmt and --dtype at their defaults")


def default_model_path(seed: int = 0, preset: str = "tiny") -> Path:
    """The built-in ``tiny`` (or ``tiny-v41``) checkpoint, created on first use under
    ``deepinfer_ops.envs.cache_dir() / f"tiny-v{TINY_FORMAT_VERSION}-seed{seed}"`` (``tiny-v41-f{N}-seed{seed}``).

    Creation is atomic (written to a temporary sibling folder, then renamed), so concurrent first uses are safe.
    Returns the folder path. Raises ValueError for another preset.
    """
    from deepinfer_ops import envs

    if preset not in ("tiny", "tiny-v41"):
        raise ValueError(f"preset: {preset!r} is not a built-in preset ('tiny', 'tiny-v41')")
    root = envs.cache_dir()
    target = root / (f"tiny-v{TINY_FORMAT_VERSION}-seed{seed}" if preset == "tiny"
                     else f"tiny-v41-f{TINY_V41_FORMAT_VERSION}-seed{seed}")
    if (target / CONFIG_FILE).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=root))
    try:
        make_checkpoint(preset, tmp, seed)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / CONFIG_FILE).is_file():  # lost a race only if the winner finished
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
