"""Native DeepSeek-V4.1 checkpoints: parameter inventory and loading (reference names and storage dtypes).

Storage (golden README, "model.safetensors"): FP8 e4m3 + UE8M0 ``[ceil(out/32), ceil(in/32)]`` for the dense
linears; FP4 e2m1 (``F4`` header shape ``[out, in]``, or ``I8``/``U8 [out, in/2]``) + UE8M0 ``[out, in/32]`` for the
routed experts; FP8 + UE8M0 ``[rows, head_dim/32]`` for the Engram tables; BF16 and F32 as listed in
:func:`expected_parameters`. ``mtp.S.embed.weight`` / ``mtp.S.head.weight`` are aliases of ``embed.weight`` /
``head.weight`` and may be absent.

Every problem raises :class:`deepinfer.checkpoint.CheckpointError` naming the tensor and the file.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ...checkpoint import CheckpointError, _get, list_tensors, read_config
from .config import DeepseekV41Config
from .quant import DequantWeight, QWeight, e8m0_to_float

#: storage kinds: "fp8" (F8_E4M3 + 32x32 UE8M0 scale), "fp4" (packed + per-32 UE8M0), "table" (Engram FP8 rows +
#: per-32 UE8M0), "bf16", "f32".
STORAGE_DTYPES = {"bf16": ("BF16",), "f32": ("F32",)}
ALIASES = ("embed.weight", "head.weight")


def expected_parameters(cfg: DeepseekV41Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{native name: (logical shape, storage kind)}`` of a V4.1 checkpoint (scales implied by the kind)."""
    c = cfg
    dense = "fp8" if c.dtype == "fp8" else "bf16"
    expert = "fp4" if c.expert_dtype == "fp4" else dense
    hc_mix = (2 + c.hc_mult) * c.hc_mult
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "embed.weight": ((c.vocab_size, c.dim), "bf16"), "head.weight": ((c.vocab_size, c.dim), "f32"),
        "norm.weight": ((c.dim,), "bf16"),
    }

    def block(p: str, L: int) -> None:
        out[p + "attn_norm.weight"] = ((c.dim,), "bf16")
        out[p + "ffn_norm.weight"] = ((c.dim,), "bf16")
        for s in ("attn", "ffn"):
            out[f"{p}hc_{s}_fn"] = ((hc_mix, c.hc_mult * c.dim), "f32")
            out[f"{p}hc_{s}_base"] = ((hc_mix,), "f32")
            out[f"{p}hc_{s}_scale"] = ((3,), "f32")
        a = p + "attn."
        hd, nh = c.head_dim, c.n_heads
        out.update({
            a + "attn_sink": ((nh,), "f32"), a + "wq_a.weight": ((c.q_lora_rank, c.dim), dense),
            a + "q_norm.weight": ((c.q_lora_rank,), "bf16"), a + "wq_b.weight": ((nh * hd, c.q_lora_rank), dense),
            a + "wkv.weight": ((hd, c.dim), dense), a + "kv_norm.weight": ((hd,), "bf16"),
            a + "wo_a.weight": ((c.o_groups * c.o_lora_rank, nh * hd // c.o_groups), "bf16"),
            a + "wo_b.weight": ((c.dim, c.o_groups * c.o_lora_rank), dense),
        })
        if L < c.n_layers and L in c.kv_source_layers:
            r = c.ratio(L)
            kind = "f32" if r > 1 else "bf16"
            out[a + "compressor.wkv.weight"] = ((hd, c.dim), kind)
            if r > 1:
                out[a + "compressor.wgate.weight"] = ((hd, c.dim), kind)
            out[a + "compressor.norm.weight"] = ((hd,), "bf16")
        if L < c.n_layers and L in c.index_source_layers:
            i = a + "indexer."
            out[i + "wq_b.weight"] = ((c.index_n_heads * c.index_head_dim, c.q_lora_rank), dense)
            out[i + "weights_proj.weight"] = ((c.index_n_heads, c.dim), "bf16")
            if L in c.kv_source_layers:
                out[i + "wk.weight"] = ((c.index_head_dim, hd), "bf16")
                out[i + "k_norm.weight"] = ((c.index_head_dim,), "bf16")
        f = p + "ffn."
        n_exp, _ = c.moe_experts(L)
        out[f + "gate.weight"] = ((n_exp, c.dim), "bf16")
        out[f + "gate.bias"] = ((n_exp,), "f32")
        if c.vision_n_layers:
            out[f + "gate.bias_vl"] = ((n_exp,), "f32")
        for e in range(n_exp):
            out[f"{f}experts.{e}.w1.weight"] = ((c.moe_inter_dim, c.dim), expert)
            out[f"{f}experts.{e}.w2.weight"] = ((c.dim, c.moe_inter_dim), expert)
            out[f"{f}experts.{e}.w3.weight"] = ((c.moe_inter_dim, c.dim), expert)
        out[f + "shared_experts.w1.weight"] = ((c.moe_inter_dim, c.dim), dense)
        out[f + "shared_experts.w2.weight"] = ((c.dim, c.moe_inter_dim), dense)
        out[f + "shared_experts.w3.weight"] = ((c.moe_inter_dim, c.dim), dense)
        if L < c.n_layers and L in c.engram_layer_ids:
            g = p + "engram."
            rows = c.engram_num_embeddings[c.engram_layer_ids.index(L)]
            cols = (c.engram_max_ngram_size - 1) * c.engram_n_heads * c.engram_head_dim
            out[g + "embed.weight"] = ((rows, c.engram_head_dim), "table")
            out[g + "wkv.weight"] = ((c.dim * (c.hc_mult + 1), cols), dense)
            out[g + "q_weight"] = ((c.hc_mult, c.dim), "bf16")
            out[g + "k_weight"] = ((c.hc_mult, c.dim), "bf16")

    for L in range(c.n_layers):
        block(f"layers.{L}.", L)
    n = c.num_dspark_layers
    for j in range(n):
        p = f"mtp.{j}."
        block(p, c.n_layers + j)
        if j == 0:
            out[p + "main_proj.weight"] = ((c.dim, c.dim * len(c.dspark_target_layer_ids)), dense)
            out[p + "main_norm.weight"] = ((c.dim,), "bf16")
        if j == n - 1:
            out[p + "norm.weight"] = ((c.dim,), "bf16")
            out[p + "markov_head.embed.weight"] = ((c.vocab_size, c.dspark_markov_rank), "bf16")
            out[p + "markov_head.head.weight"] = ((c.vocab_size, c.dspark_markov_rank), "f32")
            out[p + "confidence_head.proj.weight"] = ((1, c.dim + c.dspark_markov_rank), "f32")
    return out


def _scale_name(name: str) -> str:
    return name[:-len(".weight")] + ".scale"


def _check(name: str, shape, kind: str, infos: dict) -> None:
    w = infos[name]
    where = f"tensor {name!r} in {w.file}"
    if kind in ("bf16", "f32"):
        if w.dtype not in STORAGE_DTYPES[kind]:
            raise CheckpointError(f"{where}: dtype {w.dtype}, expected {STORAGE_DTYPES[kind][0]}")
        if w.shape != tuple(shape):
            raise CheckpointError(f"{where}: shape {list(w.shape)}, expected {list(shape)}")
        return
    sname = _scale_name(name)
    if sname not in infos:
        raise CheckpointError(f"{where}: {w.dtype} weight without its scale tensor {sname!r}")
    s = infos[sname]
    if s.dtype != "F8_E8M0":
        raise CheckpointError(f"scale tensor {sname!r} in {s.file}: dtype {s.dtype}, expected F8_E8M0 (UE8M0)")
    out_, in_ = shape
    if kind in ("fp8", "table"):
        if w.dtype != "F8_E4M3":
            raise CheckpointError(f"{where}: dtype {w.dtype}, expected F8_E4M3")
        if w.shape != tuple(shape):
            raise CheckpointError(f"{where}: shape {list(w.shape)}, expected {list(shape)}")
        want = (out_, in_ // 32) if kind == "table" else (-(-out_ // 32), -(-in_ // 32))
    else:
        if w.dtype == "F4":
            packed = (out_, in_)
        elif w.dtype in ("I8", "U8"):
            packed = (out_, in_ // 2)
        else:
            raise CheckpointError(f"{where}: dtype {w.dtype}, expected F4 (or I8 / U8 packed e2m1 pairs)")
        if w.shape != packed:
            raise CheckpointError(f"{where}: shape {list(w.shape)}, expected {list(packed)} for a [{out_}, {in_}] "
                                  "FP4 weight")
        want = (out_, in_ // 32)
    if s.shape != want:
        raise CheckpointError(f"scale tensor {sname!r} in {s.file}: shape {list(s.shape)}, expected {list(want)}")


def _scale(t: torch.Tensor, name: str, file) -> torch.Tensor:
    if bool((t.view(torch.uint8) == 255).any()):
        raise CheckpointError(f"scale tensor {name!r} in {file}: UE8M0 byte 255 (NaN)")
    return t


def device_bytes(cfg: DeepseekV41Config, dequant: bool) -> int:
    """Bytes the loaded weights hold: FP8 / FP4 linears as float32 values + scales (the exact path) or, with
    ``dequant``, as bf16 (:class:`~.quant.DequantWeight`); Engram tables as float32 values + scales."""
    total = 0
    for (out, *rest), kind in expected_parameters(cfg).values():
        n = out * (rest[0] if rest else 1)
        if kind in ("fp8", "fp4"):
            total += 2 * n if dequant else 4 * n + n // 8
        elif kind == "table":
            total += 4 * n + n // 8
        else:
            total += n * (4 if kind == "f32" else 2)
    return total


def check_device_memory(cfg: DeepseekV41Config, device: torch.device, dequant: bool = True) -> None:
    """Refuse, before reading any weight, a GPU load whose weights exceed the device's free memory (ValueError with
    both figures)."""
    if device.type != "cuda":
        return
    need, free = device_bytes(cfg, dequant), int(torch.cuda.mem_get_info(device)[0])
    if need > free:
        gib = 1 << 30
        raise ValueError(f"device: the DeepSeek-V4.1 weights need {need / gib:.1f} GiB on {device}, but only "
                         f"{free / gib:.1f} GiB is free; use a checkpoint with fewer routed experts (deepinfer "
                         "make-checkpoint --num-experts N)")


def load_weights(path: str | os.PathLike, cfg: DeepseekV41Config | None = None, device: torch.device | str = "cpu",
                 dequant: bool | None = None):
    """Load a V4.1 checkpoint folder. Returns (config, weights) where weights maps each expected name to a
    :class:`QWeight` (FP8 / FP4 linears; a :class:`DequantWeight` with ``dequant``, default: on a GPU), a float32
    values tensor (Engram tables, with their float32 scales under ``<name>.scale``) or the stored BF16 / F32
    tensor, on ``device``. Raises CheckpointError naming the tensor and file; ValueError when the weights do not
    fit the GPU."""
    root = Path(path)
    if cfg is None:
        try:
            cfg = DeepseekV41Config.from_dict(read_config(root))
        except ValueError as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{root / 'config.json'}: {e}") from e
    infos = list_tensors(root)
    spec = expected_parameters(cfg)
    scale_names = {_scale_name(n) for n, (_, k) in spec.items() if k in ("fp8", "fp4", "table")}
    for n in infos:
        if n in spec or n in scale_names:
            continue
        alias = next((a for j in range(cfg.num_dspark_layers) for a in ALIASES if n == f"mtp.{j}.{a}"), None)
        if alias is not None:  # never read, but a copy of another shape or dtype is a broken checkpoint
            _check(n, *spec[alias], infos)
            continue
        raise CheckpointError(f"unexpected tensor {n!r} in {infos[n].file}")
    for n, (shape, kind) in spec.items():
        if n not in infos:
            raise CheckpointError(f"tensor {n!r}: missing from the checkpoint in {root}")
        _check(n, shape, kind, infos)
    device = torch.device(device)
    dequant = device.type != "cpu" if dequant is None else dequant
    check_device_memory(cfg, device, dequant)
    handles: dict = {}
    weights: dict = {}
    for n, (shape, kind) in spec.items():
        t = _get(handles, infos[n])
        if kind in ("bf16", "f32"):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise CheckpointError(f"tensor {n!r} in {infos[n].file}: holds NaN or infinity")
            weights[n] = t.to(device)
            continue
        sn = _scale_name(n)
        s = _scale(_get(handles, infos[sn]), sn, infos[sn].file)
        if kind in ("fp8", "fp4"):
            w = QWeight.from_fp8(t, s) if kind == "fp8" else QWeight.from_fp4(t, s)
            if kind == "fp8" and not bool(torch.isfinite(w.values).all()):  # e2m1 codes are always finite
                raise CheckpointError(f"tensor {n!r} in {infos[n].file}: holds NaN or infinity")
            # each 32-wide block's largest |value| times its scale must stay finite in bf16 (and so in float32)
            block_max = w.values.abs().unflatten(1, (-1, 32)).amax(-1) * w.scales
            if not bool((block_max <= torch.finfo(torch.bfloat16).max).all()):
                raise CheckpointError(f"scale tensor {sn!r} in {infos[sn].file}: a scale makes the dequantised "
                                      f"{n!r} overflow (inf)")
            weights[n] = DequantWeight(w, device) if dequant else w
        else:
            v = t.float()
            if not bool(torch.isfinite(v).all()):
                raise CheckpointError(f"tensor {n!r} in {infos[n].file}: holds NaN or infinity")
            weights[n], weights[sn] = v.to(device), e8m0_to_float(s).to(device)
    return cfg, weights


def load_token_map(path: str | os.PathLike, cfg: DeepseekV41Config) -> torch.Tensor | None:
    """The Engram raw -> compressed id map: ``engram.token_map`` of ``extra.safetensors`` when the folder has one
    (the golden checkpoints), else built from the folder's ``tokenizer.json``. None without engram layers."""
    if not cfg.engram_layer_ids:
        return None
    root = Path(path)
    extra = root / "extra.safetensors"
    if extra.is_file():
        from safetensors.torch import load_file

        try:
            t = load_file(str(extra)).get("engram.token_map")
        except Exception as e:  # safetensors raises its own error type for a corrupt file
            raise CheckpointError(f"{extra}: not a readable safetensors file ({e})") from None
        if t is not None:
            return t
    tok = root / "tokenizer.json"
    if not tok.is_file():
        raise CheckpointError(f"{root}: engram layers need the tokenizer's compressed vocabulary, but there is no "
                              "tokenizer.json (nor extra.safetensors with engram.token_map)")
    from tokenizers import Tokenizer

    from .engram import compressed_token_map

    try:
        tokenizer = Tokenizer.from_file(str(tok))
    except Exception as e:  # tokenizers raises a bare Exception for a corrupt file
        raise CheckpointError(f"{tok}: not a readable tokenizer.json ({e})") from None
    m, n = compressed_token_map(tokenizer)
    if n != cfg.engram_compressed_vocab_size:
        raise CheckpointError(f"{tok}: its compressed vocabulary has {n} ids, but engram_compressed_vocab_size is "
                              f"{cfg.engram_compressed_vocab_size}")
    return torch.tensor(m[:cfg.vocab_size] + [0] * max(0, cfg.vocab_size - len(m)), dtype=torch.int64)


def load_model(path: str | os.PathLike, device: torch.device | str = "cpu", gemm: str = "auto"):
    """Config + weights + Engram map -> :class:`DeepseekV41ForCausalLM` on ``device`` (``gemm``: ``"exact"``,
    ``"dequant"`` or ``"auto"``: exact on the CPU, dequant on a GPU)."""
    from .model import DeepseekV41ForCausalLM

    device = torch.device(device)
    if gemm == "auto":
        gemm = "exact" if device.type == "cpu" else "dequant"
    cfg, weights = load_weights(path, device=device, dequant=gemm == "dequant")
    return DeepseekV41ForCausalLM(cfg, weights, load_token_map(path, cfg), device=device, gemm=gemm)
